/*
 * test_pipe_alloc: zero allocations in steady state, on both sides.
 *
 * Two independent counts over 1000+ steady-state messages: the library's
 * own counters (tdp_mem_total_allocs: every buffer and small object the
 * library makes), and every malloc/calloc/realloc in the whole process —
 * UCX, libevent and libc included — through interposition of the allocator
 * symbols. Under AddressSanitizer and ThreadSanitizer the allocator belongs
 * to the sanitizer (replacing it would hide every allocation from the
 * sanitizer, and crashes before main), so only the library counters are
 * checked there.
 */
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/fanin.h>
#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "core/cuda.h"
#include "pipe/cudaipc/cudaipc.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HAVE_INTERPOSE 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define HAVE_INTERPOSE 0
#endif
#endif
#ifndef HAVE_INTERPOSE
#define HAVE_INTERPOSE 1
#endif

static _Atomic uint64_t n_malloc_all;

#if HAVE_INTERPOSE
/* glibc's own entry points: interposing these symbols counts every call. */
extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

/*
 * Counted unless made on a thread of the CUDA driver's own ("cuda-EvtHandlr",
 * "cuda0000..."): where a GPU is, the driver's threads allocate in the
 * background whatever the pipe does (1 to 6 per 1000 messages on an H100,
 * host buffers included), as no other process thread does.
 */
static bool driver_thread(void)
{
    char name[16] = {0};
    return prctl(PR_GET_NAME, name, 0, 0, 0) == 0 && strncmp(name, "cuda", 4) == 0;
}
static _Atomic uint64_t n_malloc_driver;
static inline void count_malloc(void)
{
    atomic_fetch_add_explicit(&n_malloc_all, 1, memory_order_relaxed);
    if (driver_thread())
        atomic_fetch_add_explicit(&n_malloc_driver, 1, memory_order_relaxed);
}
#define n_malloc_now() (atomic_load(&n_malloc_all) - atomic_load(&n_malloc_driver))

void *malloc(size_t n)
{
    count_malloc();
    return __libc_malloc(n);
}
void *calloc(size_t a, size_t b)
{
    count_malloc();
    return __libc_calloc(a, b);
}
void *realloc(void *p, size_t n)
{
    count_malloc();
    return __libc_realloc(p, n);
}
int posix_memalign(void **out, size_t align, size_t n)
{
    count_malloc();
    void *p = __libc_memalign(align, n);
    if (p == NULL)
        return 12; /* ENOMEM */
    *out = p;
    return 0;
}
void *aligned_alloc(size_t align, size_t n)
{
    count_malloc();
    return __libc_memalign(align, n);
}
void *memalign(size_t align, size_t n)
{
    count_malloc();
    return __libc_memalign(align, n);
}
#else
#define n_malloc_now() atomic_load(&n_malloc_all)
#endif

#define TMO    20000
#define WARMUP 50
#define STEADY 1000

typedef struct side {
    tdp_pipe *pipe;
    tdp_td *td;
    int count;
    tdp_err rc;
    bool send;
    bool loan; /* send loaned buffers (tdp_pipe_loan) instead of td */
    bool dev;  /* device buffers: the counter goes through copies */
    /* counters read at message WARMUP and at the end */
    uint64_t lib0, lib1, m0, m1;
    uint64_t x0, x1; /* device pools exported and imported (cuda-ipc) */
    pthread_barrier_t *bar;
} side;

/* The message number in the first 8 bytes; device memory through a copy. */
static tdp_err put_seq(tdp_td *td, bool dev, uint64_t v)
{
    if (dev)
        return tdp_mem_copy(tdp_td_data(td), &v, sizeof(v));
    memcpy(tdp_td_data(td), &v, sizeof(v));
    return TDP_OK;
}

static uint64_t get_seq(const tdp_td *td, bool dev)
{
    uint64_t v = UINT64_MAX;
    if (dev)
        (void)tdp_mem_copy(&v, tdp_td_data(td), sizeof(v));
    else
        memcpy(&v, tdp_td_data(td), sizeof(v));
    return v;
}

static void *run_side(void *arg)
{
    side *s = arg;
    tdp_td *got;
    s->rc = TDP_OK;
    for (int i = 0; i < s->count && s->rc == TDP_OK; i++) {
        if (i == WARMUP) {
            /* both sides reach steady state, then both take their snapshot;
             * the staging memory a layout's first message made is page-locked
             * on threads of their own (tdp__cuda_pin): a one-time job, whose
             * allocations (the driver's, or the fake's records) belong to
             * the setup, not to the steady state */
            for (int k = 0; k < 4000 && tdp__cuda_pins_running() > 0; k++)
                usleep(5000); /* 20 s at most: pins are slow on a loaded 2-core machine */
            pthread_barrier_wait(s->bar);
            s->lib0 = tdp_mem_total_allocs();
            s->m0 = n_malloc_now();
            s->x0 = tdp__dpool_exports() + tdp__dpool_imports();
            pthread_barrier_wait(s->bar);
        }
        if (s->send && s->loan) {
            tdp_td *buf = NULL;
            /* every slot may be out for a moment: a send completing frees one */
            for (int k = 0; k < 100000 && (s->rc = tdp_pipe_loan(s->pipe, tdp_td_schema(s->td),
                                                                 &buf)) == TDP_EAGAIN;
                 k++)
                sched_yield();
            if (s->rc != TDP_OK)
                break;
            s->rc = put_seq(buf, s->dev, (uint64_t)i); /* a device slot on cuda-ipc */
            if (s->rc == TDP_OK)
                s->rc = tdp_pipe_send(s->pipe, buf, TMO);
            tdp_td_unref(buf);
        } else if (s->send) {
            s->rc = put_seq(s->td, s->dev, (uint64_t)i);
            if (s->rc == TDP_OK)
                s->rc = tdp_pipe_send(s->pipe, s->td, TMO);
        } else {
            s->rc = tdp_pipe_recv(s->pipe, TMO, &got);
            if (s->rc == TDP_OK && get_seq(got, s->dev) != (uint64_t)i)
                s->rc = TDP_EINTERNAL;
            if (s->rc == TDP_OK)
                tdp_pipe_release(s->pipe, got); /* depth > 1: lent until released */
        }
    }
    /* the receiver snapshots after its last receive; the sender waits for it */
    pthread_barrier_wait(s->bar);
    s->lib1 = tdp_mem_total_allocs();
    s->m1 = n_malloc_now();
    s->x1 = tdp__dpool_exports() + tdp__dpool_imports();
    return NULL;
}

/*
 * lat: both sides keep latency histograms (opts.latency_stats), which must
 * not allocate either; dev: the buffers are on cuda:0 (the fake without a GPU)
 */
/* The layout is prepared (tdp_pipe_prepare) before the first message. */
static bool g_prepare;
/* Process mallocs that come from inside UCX, counted but not asserted (see its case). */
static bool ucx_mallocs_known;
/* Both sides grant a receive window (more small messages in flight than depth). */
static uint64_t g_window;

static void steady_case_mem(uint64_t nbytes, uint32_t depth, tdp_plane plane, bool loan, bool lat,
                            bool dev)
{
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
    tdp_schema_builder *b;
    tdp_schema *s;
    tdp_td *td;
    tdp_pipe_opts so;
    int64_t n = (int64_t)nbytes;

    tdp_pipe_opts_default(&so);
    so.recv_depth = depth;
    so.plane = plane;
    so.latency_stats = lat;
    so.recv_window_bytes = g_window;
    if (dev) { /* the pipe names its GPU: cuda-ipc is offered */
        so.cuda_device_set = true;
        so.cuda_device = 0;
    }
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &n), TDP_OK);
    assert_int_equal(tdp_schema_builder_string(b, "note", "steady"), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    if (dev) {
        tdp_schema *d;
        assert_int_equal(tdp_schema_with_device(s, (tdp_device){TDP_DEVICE_CUDA, 0}, &d), TDP_OK);
        tdp_schema_unref(s);
        s = d;
    }
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    assert_int_equal(tdp_mem_set(tdp_td_data(td), 0x5a, tdp_td_nbytes(td)), TDP_OK);

    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, &so, NULL, NULL, &l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), &so, &cli), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &srv), TDP_OK);
    assert_int_equal(tdp_pipe_plane(cli), plane);
    if (g_prepare)
        assert_int_equal(tdp_pipe_prepare(cli, s, TMO), TDP_OK);

    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, 2);
    side tx = {.pipe = cli,
               .td = td,
               .count = WARMUP + STEADY,
               .send = true,
               .loan = loan,
               .dev = dev,
               .bar = &bar};
    side rx = {.pipe = srv, .count = WARMUP + STEADY, .dev = dev, .bar = &bar};
    pthread_t t1, t2;
    pthread_create(&t1, NULL, run_side, &tx);
    pthread_create(&t2, NULL, run_side, &rx);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    pthread_barrier_destroy(&bar);
    assert_int_equal(tx.rc, TDP_OK);
    assert_int_equal(rx.rc, TDP_OK);

    print_message("%s%s%s%s%s %" PRIu64
                  " B depth %u: library allocations in %d steady messages: %" PRIu64
                  "; process mallocs: %s%" PRIu64 "\n",
                  tdp_plane_name(plane), dev ? " cuda" : "", loan ? " loaned" : "",
                  lat ? " latency_stats" : "", g_window ? " window" : "", nbytes, depth, STEADY,
                  rx.lib1 - rx.lib0, HAVE_INTERPOSE ? "" : "(not counted) ", rx.m1 - rx.m0);
    assert_int_equal(rx.lib1 - rx.lib0, 0);
    /* no pool exported or imported per message */
    print_message("device pools exported + imported in steady state: %" PRIu64 "\n", rx.x1 - rx.x0);
    assert_int_equal(rx.x1 - rx.x0, 0);
    if (plane == TDP_PLANE_CUDA_IPC)
        assert_true(rx.x1 > 0); /* the plane did export its pool at all */
    /*
     * On a GPU the driver allocates inside the calls the library makes per
     * message (an H100: about 5 a message for a cuda-ipc plain send, 10 for
     * a staged one; not yet traced to a call): the library's own count
     * above holds, the process count is shown. The fake allocates nothing.
     */
    bool driver_mallocs = dev && tdp__cuda_backend_get() == TDP__CUDA_DRIVER;
    if (driver_mallocs)
        print_message("(process mallocs include the CUDA driver's, inside its calls: not asserted)\n");
    if (HAVE_INTERPOSE) {
        assert_true(rx.m1 > 0); /* the interposition works at all */
        if (!ucx_mallocs_known && !driver_mallocs)
            assert_int_equal(rx.m1 - rx.m0, 0);
    }
    if (lat) {
        static tdp_hist h; /* large: not on the stack */
        assert_int_equal(tdp_pipe_latency_get(cli, TDP_LAT_SEND, &h), TDP_OK);
        assert_int_equal(h.count, WARMUP + STEADY);
        assert_int_equal(tdp_pipe_latency_get(srv, TDP_LAT_RECV_WAIT, &h), TDP_OK);
        assert_int_equal(h.count, WARMUP + STEADY);
    }

    tdp_pipe_free(cli);
    tdp_pipe_free(srv);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void steady_case(uint64_t nbytes, uint32_t depth, tdp_plane plane, bool loan, bool lat)
{
    steady_case_mem(nbytes, depth, plane, loan, lat, false);
}

static void test_small_depth1(void **state)
{
    steady_case(1000, 1, TDP_PLANE_UCX, false, false);
}

static void test_large_depth4(void **state)
{
    steady_case(4 << 20, 4, TDP_PLANE_UCX, false, true);
}

/* Prepared first: the steady state after it allocates nothing either. */
static void test_prepared_large_depth4(void **state)
{
    g_prepare = true;
    steady_case(4 << 20, 4, TDP_PLANE_UCX, false, false);
    g_prepare = false;
}

static void test_shm_prepared_large_depth4(void **state)
{
    g_prepare = true;
    steady_case(4 << 20, 4, TDP_PLANE_SHM, false, false);
    g_prepare = false;
}

/* The shm plane: plain sends (one copy into a slot) and loans (none). */
static void test_shm_small_depth1(void **state)
{
    steady_case(1000, 1, TDP_PLANE_SHM, false, true);
}

static void test_shm_large_depth4(void **state)
{
    steady_case(4 << 20, 4, TDP_PLANE_SHM, false, false);
}

static void test_shm_loan_small_depth1(void **state)
{
    steady_case(1000, 1, TDP_PLANE_SHM, true, false);
}

static void test_shm_loan_large_depth4(void **state)
{
    steady_case(4 << 20, 4, TDP_PLANE_SHM, true, true);
}

/* The tcp plane: frames on the control socket, a fixed send ring and receive buffer. */
static void test_tcp_small_depth1(void **state)
{
    steady_case(1000, 1, TDP_PLANE_TCP, false, true);
}

static void test_tcp_large_depth4(void **state)
{
    steady_case(4 << 20, 4, TDP_PLANE_TCP, false, false);
}

static void test_tcp_window_small_depth4(void **state)
{
    g_window = 256u << 10;
    steady_case(1000, 4, TDP_PLANE_TCP, false, false);
    g_window = 0;
}

/* A receive window: up to 64 small messages in flight, storage for as many. */
static void test_window_small_depth4(void **state)
{
    g_window = 256u << 10;
    steady_case(1000, 4, TDP_PLANE_UCX, false, false);
    g_window = 0;
}

static void test_shm_window_small_depth4(void **state)
{
    g_window = 256u << 10;
    steady_case(1000, 4, TDP_PLANE_SHM, false, false);
    g_window = 0;
}

static void test_shm_loan_window_small_depth4(void **state)
{
    g_window = 256u << 10;
    steady_case(1000, 4, TDP_PLANE_SHM, true, false);
    g_window = 0;
}

/* Device buffers (cuda:0; the fake device where the machine has no GPU). */
static void test_cuda_ucx_small_depth1(void **state)
{
    steady_case_mem(1000, 1, TDP_PLANE_UCX, false, false, true);
}

static void test_cuda_ucx_large_depth4(void **state)
{
    steady_case_mem(4 << 20, 4, TDP_PLANE_UCX, false, true, true);
}

/*
 * Above 4 MiB a staged message goes as CHUNK frames: the library still
 * allocates nothing per message. UCX 1.13 itself mallocs about 1.6 times
 * per chunked message here (several rendezvous of one message in flight
 * at once), which the process count shows: known, not yet traced.
 */
static void test_cuda_ucx_chunked_depth4(void **state)
{
    ucx_mallocs_known = true;
    steady_case_mem(12 << 20, 4, TDP_PLANE_UCX, false, false, true);
    ucx_mallocs_known = false;
}

static void test_cuda_shm_small_depth1(void **state)
{
    steady_case_mem(1000, 1, TDP_PLANE_SHM, false, false, true);
}

static void test_cuda_shm_large_depth4(void **state)
{
    steady_case_mem(4 << 20, 4, TDP_PLANE_SHM, false, true, true);
}

/* The tcp plane: staged through bounces; 12 MiB is three chunks each way. */
static void test_cuda_tcp_small_depth1(void **state)
{
    steady_case_mem(1000, 1, TDP_PLANE_TCP, false, false, true);
}

static void test_cuda_tcp_chunked_depth4(void **state)
{
    steady_case_mem(12 << 20, 4, TDP_PLANE_TCP, false, true, true);
}

/* The cuda-ipc plane: plain sends (one device copy into a slot) and loans (none). */
static void test_cuda_ipc_small_depth1(void **state)
{
    steady_case_mem(1000, 1, TDP_PLANE_CUDA_IPC, false, false, true);
}

static void test_cuda_ipc_large_depth4(void **state)
{
    steady_case_mem(4 << 20, 4, TDP_PLANE_CUDA_IPC, false, true, true);
}

static void test_cuda_ipc_loan_small_depth1(void **state)
{
    steady_case_mem(1000, 1, TDP_PLANE_CUDA_IPC, true, false, true);
}

static void test_cuda_ipc_loan_large_depth4(void **state)
{
    steady_case_mem(4 << 20, 4, TDP_PLANE_CUDA_IPC, true, false, true);
}

/* ---- fan-in: two producers, one consumer --------------------------------------- */

#define FANIN_TAIL 20 /* messages after the consumer's last snapshot: the close is not counted */

typedef struct fanin_tx {
    pthread_t th;
    tdp_loop *loop;
    uint16_t port;
    tdp_plane plane;
    tdp_td *td;
    bool loan;
    tdp_err rc;
    atomic_int *warm; /* producers past their warm-up: both wait for the other there */
} fanin_tx;

/*
 * Both producers start their steady messages together (bounded: 30 s), so
 * that a producer the scheduler runs far ahead of the other cannot leave
 * the consumer's window, which needs both past their warm-up, too short.
 */
static void fanin_warm_wait(atomic_int *warm)
{
    atomic_fetch_add(warm, 1);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        sched_yield();
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (atomic_load(warm) < 2 && t.tv_sec - t0.tv_sec < 30);
}

static void *fanin_tx_main(void *arg)
{
    fanin_tx *t = arg;
    tdp_pipe_opts o;
    tdp_pipe *pipe;
    tdp_pipe_opts_default(&o);
    o.plane = t->plane;
    if ((t->rc = tdp_pipe_connect(t->loop, "127.0.0.1", t->port, &o, &pipe)) != TDP_OK)
        return NULL;
    for (int i = 0; i < WARMUP + STEADY + FANIN_TAIL && t->rc == TDP_OK; i++) {
        tdp_td *buf = t->td;
        if (t->loan) {
            for (int k = 0; k < 100000 &&
                            (t->rc = tdp_pipe_loan(pipe, tdp_td_schema(t->td), &buf)) == TDP_EAGAIN;
                 k++)
                sched_yield();
            if (t->rc != TDP_OK)
                break;
        }
        ((uint64_t *)tdp_td_data(buf))[0] = (uint64_t)i + 1;
        t->rc = tdp_pipe_send(pipe, buf, TMO);
        if (t->loan)
            tdp_td_unref(buf);
        if (i == WARMUP)
            fanin_warm_wait(t->warm);
    }
    if (t->rc == TDP_OK)
        t->rc = tdp_pipe_close(pipe, TMO);
    tdp_pipe_free(pipe);
    return NULL;
}

static void fanin_case(tdp_plane plane, bool loan)
{
    tdp_loop *fl, *pl;
    tdp_fanin *f;
    tdp_schema_builder *b;
    tdp_schema *s;
    int64_t n = 64 << 10;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &n), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    assert_int_equal(tdp_loop_new(NULL, &fl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &pl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(fl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(pl), TDP_OK);
    tdp_fanin_opts fo;
    tdp_fanin_opts_default(&fo);
    fo.listener.pipe.plane = plane;
    assert_int_equal(tdp_fanin_new(fl, "127.0.0.1", 0, &fo, &f), TDP_OK);
    fanin_tx tx[2];
    atomic_int warm = 0;
    for (int i = 0; i < 2; i++) {
        tx[i] = (fanin_tx){
            .loop = pl, .port = tdp_fanin_port(f), .plane = plane, .loan = loan, .warm = &warm};
        assert_int_equal(tdp_td_new(s, &tx[i].td), TDP_OK);
        assert_int_equal(pthread_create(&tx[i].th, NULL, fanin_tx_main, &tx[i]), 0);
    }
    uint64_t next[3] = {1, 1, 1}, msgs = 0, lib0 = 0, lib1 = 0, m0 = 0, m1 = 0, w0 = 0, w1 = 0;
    int left = 0;
    tdp_fanin_msg m;
    for (int k = 0; k < 10 * (WARMUP + STEADY) && left < 2; k++) {
        /* from when both are past their warm-up to when one is near its end (not its close) */
        uint64_t lo = next[1] < next[2] ? next[1] : next[2],
                 hi = next[1] > next[2] ? next[1] : next[2];
        if (lo > WARMUP && w0 == 0) {
            lib0 = tdp_mem_total_allocs();
            m0 = n_malloc_now();
            w0 = msgs;
        }
        if (hi > WARMUP + STEADY && w1 == 0) {
            lib1 = tdp_mem_total_allocs();
            m1 = n_malloc_now();
            w1 = msgs;
        }
        assert_int_equal(tdp_fanin_recv(f, TMO, &m), TDP_OK);
        assert_true(m.producer >= 1 && m.producer <= 2);
        if (m.kind == TDP_FANIN_MSG) {
            assert_int_equal(m.seq, next[m.producer]);
            assert_int_equal(((uint64_t *)tdp_td_data(m.td))[0], m.seq);
            next[m.producer]++;
            msgs++;
        } else if (m.kind == TDP_FANIN_LEAVE) {
            assert_int_equal(m.status, TDP_ECLOSED);
            left++;
        }
        tdp_fanin_release(f, &m);
    }
    assert_int_equal(left, 2);
    for (int i = 0; i < 2; i++) {
        pthread_join(tx[i].th, NULL);
        assert_int_equal(tx[i].rc, TDP_OK);
        tdp_td_unref(tx[i].td);
    }
    print_message("fan-in %s%s, 2 producers, 64 KiB: library allocations in %" PRIu64
                  " steady messages: %" PRIu64 "; process mallocs: %s%" PRIu64 "\n",
                  tdp_plane_name(plane), loan ? " loaned" : "", w1 - w0, lib1 - lib0,
                  HAVE_INTERPOSE ? "" : "(not counted) ", m1 - m0);
    assert_true(w1 - w0 >= STEADY); /* the window held both streams' steady state */
    assert_int_equal(lib1 - lib0, 0);
    if (HAVE_INTERPOSE) {
        assert_true(m1 > 0);
        assert_int_equal(m1 - m0, 0);
    }
    tdp_fanin_free(f);
    tdp_loop_free(pl);
    tdp_loop_free(fl);
    tdp_schema_unref(s);
}

static void test_fanin_ucx(void **state)
{
    fanin_case(TDP_PLANE_UCX, false);
}

static void test_fanin_shm_loan(void **state)
{
    fanin_case(TDP_PLANE_SHM, true);
}

int main(void)
{
    /* the fake device stands in where there is no GPU: its memory faults on host access */
    if (getenv("TDPIPE_CUDA") == NULL && tdp__cuda_device_count() == 0 &&
        tdp__cuda_select("fake") != TDP_OK)
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_depth1),
        cmocka_unit_test(test_large_depth4),
        cmocka_unit_test(test_prepared_large_depth4),
        cmocka_unit_test(test_shm_prepared_large_depth4),
        cmocka_unit_test(test_tcp_small_depth1),
        cmocka_unit_test(test_tcp_large_depth4),
        cmocka_unit_test(test_tcp_window_small_depth4),
        cmocka_unit_test(test_shm_small_depth1),
        cmocka_unit_test(test_shm_large_depth4),
        cmocka_unit_test(test_shm_loan_small_depth1),
        cmocka_unit_test(test_shm_loan_large_depth4),
        cmocka_unit_test(test_window_small_depth4),
        cmocka_unit_test(test_shm_window_small_depth4),
        cmocka_unit_test(test_shm_loan_window_small_depth4),
        cmocka_unit_test(test_cuda_ucx_small_depth1),
        cmocka_unit_test(test_cuda_ucx_large_depth4),
        cmocka_unit_test(test_cuda_ucx_chunked_depth4),
        cmocka_unit_test(test_cuda_tcp_small_depth1),
        cmocka_unit_test(test_cuda_tcp_chunked_depth4),
        cmocka_unit_test(test_cuda_shm_small_depth1),
        cmocka_unit_test(test_cuda_shm_large_depth4),
        cmocka_unit_test(test_cuda_ipc_small_depth1),
        cmocka_unit_test(test_cuda_ipc_large_depth4),
        cmocka_unit_test(test_cuda_ipc_loan_small_depth1),
        cmocka_unit_test(test_cuda_ipc_loan_large_depth4),
        cmocka_unit_test(test_fanin_ucx),
        cmocka_unit_test(test_fanin_shm_loan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
