/*
 * test_gpu_shm: GPU payloads on the shm plane, on the fake device (whose
 * device memory faults when host code touches it, and whose copies land
 * late): sends from device memory, receives into it, the receive-device
 * override both ways, layout changes with host and GPU messages mixed,
 * no allocation per message, and a peer killed between a copy and its
 * hand-off. Bytes are compared through copies back to the host.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <tdpipe/tdpipe.h>

#include "core/cuda.h"
#include "pipe/shm/plane_shm.h"
#include "test_gpu_util.h"

#define OK(x) assert_int_equal((x), TDP_OK)
#define TMO   20000
#define NMSG  24
#define DEPTH 4
#define BIG   (9u << 20) /* three staging chunks */
#define CUDA0 ((tdp_device){TDP_DEVICE_CUDA, 0})

/* ---- two loops on their threads, one shm pipe --------------------------------- */

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli; /* srv receives, cli sends */
} env;

static void opts_for(tdp_pipe_opts *o, bool cuda, const tdp_device *recv_dev)
{
    tdp_pipe_opts_default(o);
    o->plane = TDP_PLANE_SHM;
    o->recv_depth = DEPTH;
    if (cuda) {
        o->cuda_device_set = true;
        o->cuda_device = 0;
    }
    if (recv_dev != NULL) {
        o->recv_device_set = true;
        o->recv_device = *recv_dev;
    }
}

static void env_up(env *e, bool cuda, const tdp_device *recv_dev)
{
    tdp_pipe_opts so, co;
    opts_for(&so, cuda, recv_dev);
    opts_for(&co, cuda, NULL);
    memset(e, 0, sizeof(*e));
    OK(tdp_loop_new(NULL, &e->sl));
    OK(tdp_loop_new(NULL, &e->cl));
    OK(tdp_loop_start_thread(e->sl));
    OK(tdp_loop_start_thread(e->cl));
    OK(tdp_listener_new(e->sl, "127.0.0.1", 0, &so, NULL, NULL, &e->l));
    OK(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), &co, &e->cli));
    OK(tdp_listener_accept(e->l, TMO, &e->srv));
    assert_int_equal(tdp_pipe_plane(e->cli), TDP_PLANE_SHM);
}

static void env_down(env *e)
{
    tdp_pipe_free(e->cli);
    tdp_pipe_free(e->srv);
    tdp_listener_free(e->l);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->sl);
}

/* A sender thread: message i is tds[plan[i]] filled with tag i + 1. */
typedef struct sender {
    pthread_t th;
    tdp_pipe *pipe;
    tdp_td **tds;
    const int *plan;
    int count;
    tdp_err rc;
} sender;

static void *sender_main(void *arg)
{
    sender *s = arg;
    for (int i = 0; i < s->count && s->rc == TDP_OK; i++) {
        tdp_td *td = s->tds[s->plan[i]];
        gpu_fill(td, (uint64_t)i + 1);
        s->rc = tdp_pipe_send(s->pipe, td, TMO);
    }
    if (s->rc == TDP_OK)
        s->rc = tdp_pipe_close(s->pipe, TMO);
    return NULL;
}

/*
 * Send count messages from tds by plan, receive them all; each must hold
 * its tag, lie on want_dev[plan[i]], and come in order.
 */
static void exchange(env *e, tdp_td **tds, const int *plan, int count, const tdp_device *want_dev)
{
    sender s = {.pipe = e->cli, .tds = tds, .plan = plan, .count = count};
    assert_int_equal(pthread_create(&s.th, NULL, sender_main, &s), 0);
    tdp_td *held[DEPTH] = {0};
    for (int i = 0; i < count; i++) {
        tdp_td *got = NULL;
        tdp_err rc = tdp_pipe_recv(e->srv, TMO, &got);
        if (rc != TDP_OK)
            fail_msg("message %d: %s", i, tdp_strerror(rc));
        assert_int_equal(tdp_td_device(got).type, want_dev[plan[i]].type);
        assert_int_equal(tdp_td_nbytes(got), tdp_td_nbytes(tds[plan[i]]));
        if (!gpu_holds(got, (uint64_t)i + 1))
            fail_msg("message %d: bytes differ", i);
        /* hold up to DEPTH - 1 at once: landings must not wait for releases */
        if (held[i % (DEPTH - 1)] != NULL)
            tdp_pipe_release(e->srv, held[i % (DEPTH - 1)]);
        held[i % (DEPTH - 1)] = got;
    }
    for (int i = 0; i < DEPTH; i++)
        if (held[i] != NULL)
            tdp_pipe_release(e->srv, held[i]);
    tdp_td *none = NULL;
    assert_int_equal(tdp_pipe_recv(e->srv, TMO, &none), TDP_ECLOSED);
    pthread_join(s.th, NULL);
    OK(s.rc);
}

static int setup(void **state)
{
    (void)state;
    OK(tdp__cuda_select("fake"));
    tdp__cuda_fake_set_delay_us(300); /* copies land well after they are queued */
    tdp__cuda_fake_set_register_ms(0);
    for (int f = 0; f < TDP__CUDA_FAULT_COUNT; f++)
        tdp__cuda_fake_inject((tdp__cuda_fault)f, 0);
    return 0;
}

/* Device memory to device memory, small and multi-chunk messages. */
static void test_gpu_to_gpu(void **state)
{
    (void)state;
    env e;
    env_up(&e, true, NULL);
    tdp_schema *small = gpu_schema_of(1000, CUDA0), *big = gpu_schema_of(BIG, CUDA0);
    tdp_td *tds[2];
    OK(tdp_td_new(small, &tds[0]));
    OK(tdp_td_new(big, &tds[1]));
    int plan[NMSG];
    for (int i = 0; i < NMSG; i++)
        plan[i] = i < NMSG / 2 ? 0 : 1;
    tdp_device dev[2] = {CUDA0, CUDA0};
    exchange(&e, tds, plan, NMSG, dev);
    tdp_td_unref(tds[0]);
    tdp_td_unref(tds[1]);
    tdp_schema_unref(small);
    tdp_schema_unref(big);
    env_down(&e);
}

/* Host sender, receiver asks for the GPU; and without cuda_device. */
static void test_override_host_to_gpu(void **state)
{
    (void)state;
    for (int named = 0; named < 2; named++) {
        env e;
        tdp_device cuda = CUDA0;
        env_up(&e, named == 1, &cuda);
        tdp_schema *sc = gpu_schema_of(300000, TDP_DEVICE_CPU_INIT);
        tdp_td *tds[1];
        OK(tdp_td_new(sc, &tds[0]));
        int plan[NMSG] = {0};
        tdp_device dev[1] = {CUDA0};
        exchange(&e, tds, plan, NMSG, dev);
        tdp_td_unref(tds[0]);
        tdp_schema_unref(sc);
        env_down(&e);
    }
}

/* GPU sender, receiver asks for host memory: views of the slots. */
static void test_override_gpu_to_host(void **state)
{
    (void)state;
    env e;
    tdp_device cpu = TDP_DEVICE_CPU_INIT;
    env_up(&e, true, &cpu);
    tdp_schema *sc = gpu_schema_of(BIG, CUDA0);
    tdp_td *tds[1];
    OK(tdp_td_new(sc, &tds[0]));
    int plan[NMSG / 2] = {0};
    tdp_device dev[1] = {TDP_DEVICE_CPU_INIT};
    exchange(&e, tds, plan, NMSG / 2, dev);
    tdp_td_unref(tds[0]);
    tdp_schema_unref(sc);
    env_down(&e);
}

/* Layouts change mid-stream, GPU and host messages interleaved: order holds. */
static void test_schema_change(void **state)
{
    (void)state;
    env e;
    env_up(&e, true, NULL);
    tdp_schema *sc[4] = {gpu_schema_of(1000, CUDA0), gpu_schema_of(5u << 20, CUDA0),
                         gpu_schema_of(4000, TDP_DEVICE_CPU_INIT), gpu_schema_of(BIG + 5, CUDA0)};
    tdp_td *tds[4];
    for (int i = 0; i < 4; i++)
        OK(tdp_td_new(sc[i], &tds[i]));
    int plan[NMSG];
    for (int i = 0; i < NMSG; i++)
        plan[i] = (i * 5 + i / 3) % 4; /* every pair of layouts meets */
    tdp_device dev[4] = {CUDA0, CUDA0, TDP_DEVICE_CPU_INIT, CUDA0};
    exchange(&e, tds, plan, NMSG, dev);
    for (int i = 0; i < 4; i++) {
        tdp_td_unref(tds[i]);
        tdp_schema_unref(sc[i]);
    }
    env_down(&e);
}

static int count_threads(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/*
 * With cuda_device, each link makes its stream when the pipe connects (on
 * the fake, a stream is an engine thread): two more threads before any
 * message than without it. Without it, the first GPU message makes them.
 */
static void test_setup_at_connect(void **state)
{
    (void)state;
    int grown[2];
    for (int named = 0; named < 2; named++) {
        int before = count_threads();
        env e;
        env_up(&e, named == 1, NULL);
        grown[named] = count_threads() - before;
        if (named == 0) {
            tdp_schema *sc = gpu_schema_of(1000, CUDA0);
            tdp_td *td, *got;
            OK(tdp_td_new(sc, &td));
            int at_open = count_threads();
            gpu_fill(td, 1);
            OK(tdp_pipe_send(e.cli, td, TMO));
            OK(tdp_pipe_recv(e.srv, TMO, &got));
            assert_true(gpu_holds(got, 1));
            /* the pools' pins run on threads of their own for a while */
            for (int i = 0; i < 200 && count_threads() - at_open != 2; i++)
                usleep(5 * 1000);
            assert_int_equal(count_threads() - at_open, 2);
            tdp_pipe_release(e.srv, got);
            tdp_td_unref(td);
            tdp_schema_unref(sc);
        }
        env_down(&e);
    }
    assert_int_equal(grown[1] - grown[0], 2);
}

/*
 * Page-locking a pool is slow (449 ms for a 100 MB layout's pools on an
 * H200): a pool made by a send, or announced with one, is pinned on a
 * thread of its own while the message's copies go at pageable speed, in
 * both processes. A prepare waits for its pool's pinning (off the path).
 * A pipe closed while pins are running waits for them before the memory
 * goes (ASan, TSan).
 */
static int64_t now_ms(void);

#define PIN_MS 1500
static void test_send_while_pinning(void **state)
{
    (void)state;
    tdp__cuda_fake_set_register_ms(PIN_MS);
    tdp_schema *sc = gpu_schema_of(3 << 20, CUDA0), *sc2 = gpu_schema_of(5 << 20, CUDA0);
    tdp_td *td, *td2, *got;
    OK(tdp_td_new(sc, &td));
    OK(tdp_td_new(sc2, &td2));
    for (int round = 0; round < 2; round++) {
        env e;
        env_up(&e, true, NULL);
        uint64_t landed = tdp__cuda_pins_landed();
        int64_t t0 = now_ms();
        gpu_fill(td, 1);
        OK(tdp_pipe_send(e.cli, td, TMO));
        OK(tdp_pipe_recv(e.srv, TMO, &got));
        int64_t took = now_ms() - t0;
        assert_true(gpu_holds(got, 1));
        tdp_pipe_release(e.srv, got);
        print_message("first GPU message, pools pinning for %d ms: %lld ms\n", PIN_MS,
                      (long long)took);
        assert_true(took < PIN_MS); /* it waited for neither side's pinning */
        assert_true(tdp__cuda_pins_landed() < landed + 2);
        if (round == 0) { /* the pins land; the next messages use them */
            for (int i = 0; i < 500 && tdp__cuda_pins_landed() < landed + 2; i++)
                usleep(10 * 1000);
            assert_int_equal(tdp__cuda_pins_landed(), landed + 2);
            for (int i = 2; i < 6; i++) {
                gpu_fill(td, (uint64_t)i);
                OK(tdp_pipe_send(e.cli, td, TMO));
                OK(tdp_pipe_recv(e.srv, TMO, &got));
                assert_true(gpu_holds(got, (uint64_t)i));
                tdp_pipe_release(e.srv, got);
            }
            /* a prepared layout: the prepare returns with its pool pinned */
            t0 = now_ms();
            OK(tdp_pipe_prepare(e.cli, sc2, TMO));
            took = now_ms() - t0;
            assert_true(took >= PIN_MS - 50);
            gpu_fill(td2, 7);
            OK(tdp_pipe_send(e.cli, td2, TMO));
            OK(tdp_pipe_recv(e.srv, TMO, &got));
            assert_true(gpu_holds(got, 7));
            tdp_pipe_release(e.srv, got);
        }
        /* round 1: closed with both pins still running */
        env_down(&e);
    }
    tdp__cuda_fake_set_register_ms(0);
    tdp_td_unref(td);
    tdp_td_unref(td2);
    tdp_schema_unref(sc);
    tdp_schema_unref(sc2);
}

/*
 * A layout prepared ahead (tdp_pipe_prepare): the receiver maps its pool
 * and page-locks the mapping when the announcement comes, before any
 * message, and the first message then maps and pins nothing (page-locking
 * a pool was most of a staged first send's time on an H100).
 */
static void test_prepared_pool_pinned_ahead(void **state)
{
    (void)state;
    env e;
    env_up(&e, true, NULL);
    uint64_t mapped = tdp__shm_rx_pools_mapped(), pinned = tdp__shm_pools_pinned();
    tdp_schema *sc = gpu_schema_of(3 << 20, CUDA0);
    tdp_td *td, *got;
    OK(tdp_td_new(sc, &td));
    OK(tdp_pipe_prepare(e.cli, sc, TMO));
    /* no message yet: the receiver's loop thread takes the announcement */
    for (int i = 0; i < 1000 && tdp__shm_rx_pools_mapped() == mapped; i++)
        usleep(10 * 1000);
    for (int i = 0; i < 1000 && tdp__shm_pools_pinned() < pinned + 2; i++)
        usleep(10 * 1000);
    assert_int_equal(tdp__shm_rx_pools_mapped(), mapped + 1);
    assert_int_equal(tdp__shm_pools_pinned(), pinned + 2); /* the sender's and the receiver's */
    gpu_fill(td, 9);
    OK(tdp_pipe_send(e.cli, td, TMO));
    OK(tdp_pipe_recv(e.srv, TMO, &got));
    assert_true(gpu_holds(got, 9));
    assert_int_equal(tdp__shm_rx_pools_mapped(), mapped + 1); /* nothing more at the message */
    assert_int_equal(tdp__shm_pools_pinned(), pinned + 2);
    tdp_pipe_release(e.srv, got);
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    env_down(&e);
}

/* Steady state: no allocation per message, either side, staged or streamed. */
static void test_no_alloc(void **state)
{
    (void)state;
    env e;
    env_up(&e, true, NULL);
    tdp__cuda_fake_set_delay_us(0);
    const uint64_t sizes[] = {70000, BIG};
    for (int k = 0; k < 2; k++) {
        tdp_schema *sc = gpu_schema_of(sizes[k], CUDA0);
        tdp_td *td;
        OK(tdp_td_new(sc, &td));
        uint64_t before = 0;
        enum { WARM = 3 * DEPTH, MEASURED = 40 };
        for (int i = 0; i < WARM + MEASURED; i++) {
            if (i == WARM)
                before = tdp_mem_total_allocs();
            if (i < 3) /* not in the measured part: fill copies through malloc */
                gpu_fill(td, (uint64_t)i + 1);
            OK(tdp_pipe_send(e.cli, td, TMO));
            tdp_td *got;
            OK(tdp_pipe_recv(e.srv, TMO, &got));
            assert_int_equal(tdp_td_device(got).type, TDP_DEVICE_CUDA);
            if (i < 3)
                assert_true(gpu_holds(got, (uint64_t)i + 1));
            tdp_pipe_release(e.srv, got);
        }
        uint64_t after = tdp_mem_total_allocs();
        print_message("library allocations over %d GPU messages of %llu bytes: %llu\n", MEASURED,
                      (unsigned long long)sizes[k], (unsigned long long)(after - before));
        assert_int_equal(after - before, 0);
        tdp_td_unref(td);
        tdp_schema_unref(sc);
    }
    env_down(&e);
}

/* ---- a peer killed between a copy and its hand-off ------------------------------ */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int reap(pid_t pid, int timeout_ms)
{
    int st = 0;
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return st;
        if (r < 0 && errno != EINTR)
            return -1;
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(1000);
    }
}

/* In the child: connect to port (read from fd) and send GPU messages; the
 * fourth copy from here kills it (fill 1, send 1, fill 2, then send 2's). */
static void child_sender(int rfd)
{
    uint16_t port = 0;
    if (read(rfd, &port, sizeof(port)) != (ssize_t)sizeof(port))
        _exit(10);
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_pipe_opts o;
    opts_for(&o, true, NULL);
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p) != TDP_OK)
        _exit(11);
    tdp_schema *sc = gpu_schema_of(100000, CUDA0);
    tdp_td *td;
    if (tdp_td_new(sc, &td) != TDP_OK)
        _exit(12);
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_KILL_AFTER_COPY, 4);
    for (int i = 0; i < 4; i++) {
        gpu_fill(td, (uint64_t)i + 1);
        if (tdp_pipe_send(p, td, TMO) != TDP_OK)
            _exit(13);
        char ack;
        /* the parent has message 1 before this one dies mid-message 2 */
        if (i == 0 && read(rfd, &ack, 1) != 1)
            _exit(16);
    }
    _exit(14); /* never: killed after the second message's copy */
}

/* In the child: one large GPU message, streamed; killed once two of its three
 * chunks are in the slot (copies: the fill, chunk 1, chunk 2). */
static void child_streamer(int rfd)
{
    uint16_t port = 0;
    if (read(rfd, &port, sizeof(port)) != (ssize_t)sizeof(port))
        _exit(10);
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_pipe_opts o;
    opts_for(&o, true, NULL);
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p) != TDP_OK)
        _exit(11);
    tdp_schema *sc = gpu_schema_of(BIG, CUDA0);
    tdp_td *td;
    if (tdp_td_new(sc, &td) != TDP_OK)
        _exit(12);
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_KILL_AFTER_COPY, 3);
    tdp__cuda_fake_set_delay_us(20000); /* the parent sees the first chunks first */
    gpu_fill(td, 1);
    (void)tdp_pipe_send(p, td, TMO);
    _exit(14);
}

/* In the child: receive into the GPU; killed after the second message's copy in. */
static void child_receiver(int rfd)
{
    uint16_t port = 0;
    if (read(rfd, &port, sizeof(port)) != (ssize_t)sizeof(port))
        _exit(10);
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_pipe_opts o;
    tdp_device cuda = CUDA0;
    opts_for(&o, true, &cuda);
    o.recv_depth = 1;
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p) != TDP_OK)
        _exit(11);
    /* copies from here: land 1, compare 1 (back to host), land 2: killed */
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_KILL_AFTER_COPY, 3);
    for (int i = 0; i < 4; i++) {
        tdp_td *got;
        if (tdp_pipe_recv(p, TMO, &got) != TDP_OK)
            _exit(13);
        if (!gpu_holds(got, (uint64_t)i + 1))
            _exit(15);
    }
    _exit(14);
}

/* The survivor can still make a pipe and move a GPU message on it. */
static void still_usable(void)
{
    env e;
    env_up(&e, true, NULL);
    tdp_schema *sc = gpu_schema_of(5000, CUDA0);
    tdp_td *td;
    OK(tdp_td_new(sc, &td));
    int plan[2] = {0, 0};
    tdp_device dev[1] = {CUDA0};
    exchange(&e, &td, plan, 2, dev);
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    env_down(&e);
}

/* Fork before any thread of this process runs, then listen and tell the child the port. */
static pid_t fork_peer(void (*child)(int), int *wfd)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[1]);
        child(fds[0]);
    }
    close(fds[0]);
    *wfd = fds[1];
    return pid;
}

static void listen_for(int wfd, tdp_loop **loop, tdp_listener **l, tdp_pipe **p, bool cuda_recv)
{
    tdp_pipe_opts o;
    tdp_device cuda = CUDA0;
    opts_for(&o, true, cuda_recv ? &cuda : NULL);
    OK(tdp_loop_new(NULL, loop));
    OK(tdp_loop_start_thread(*loop));
    OK(tdp_listener_new(*loop, "127.0.0.1", 0, &o, NULL, NULL, l));
    uint16_t port = tdp_listener_port(*l);
    assert_int_equal(write(wfd, &port, sizeof(port)), (ssize_t)sizeof(port));
    OK(tdp_listener_accept(*l, TMO, p));
}

/* The sender dies after its copy into the slot, before the descriptor. */
static void test_sender_killed(void **state)
{
    (void)state;
    tdp__cuda_fake_set_delay_us(0);
    int wfd;
    pid_t pid = fork_peer(child_sender, &wfd);
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    listen_for(wfd, &loop, &l, &p, true);
    tdp_td *got;
    OK(tdp_pipe_recv(p, TMO, &got));
    assert_true(gpu_holds(got, 1));
    assert_int_equal(write(wfd, "k", 1), 1);
    close(wfd);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_ECONNRESET);
    int st = reap(pid, TMO);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    still_usable();
}

/* The receiver dies after a copy out of the slot, before the message landed. */
static void test_receiver_killed(void **state)
{
    (void)state;
    tdp__cuda_fake_set_delay_us(0);
    int wfd;
    pid_t pid = fork_peer(child_receiver, &wfd);
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    listen_for(wfd, &loop, &l, &p, false);
    close(wfd);
    tdp_schema *sc = gpu_schema_of(100000, CUDA0);
    tdp_td *td;
    OK(tdp_td_new(sc, &td));
    tdp_err rc = TDP_OK;
    int sent = 0;
    for (int i = 0; i < 6 && rc == TDP_OK; i++) {
        gpu_fill(td, (uint64_t)i + 1);
        if ((rc = tdp_pipe_send(p, td, TMO)) == TDP_OK)
            sent++;
    }
    if (rc == TDP_OK)
        rc = tdp_pipe_close(p, TMO);
    assert_int_equal(rc, TDP_ECONNRESET);
    assert_true(sent >= 2);
    int st = reap(pid, TMO);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    still_usable();
}

/* The sender dies with a streamed message partly in the slot: into a GPU
 * layout (following the sender) and a host one (waiting for all of it). */
static void test_streamer_killed(void **state)
{
    (void)state;
    tdp__cuda_fake_set_delay_us(0);
    for (int gpu = 0; gpu < 2; gpu++) {
        int wfd;
        pid_t pid = fork_peer(child_streamer, &wfd);
        tdp_loop *loop;
        tdp_listener *l;
        tdp_pipe *p;
        tdp_pipe_opts o;
        tdp_device dev = gpu ? CUDA0 : (tdp_device)TDP_DEVICE_CPU_INIT;
        opts_for(&o, true, &dev);
        OK(tdp_loop_new(NULL, &loop));
        OK(tdp_loop_start_thread(loop));
        OK(tdp_listener_new(loop, "127.0.0.1", 0, &o, NULL, NULL, &l));
        uint16_t port = tdp_listener_port(l);
        assert_int_equal(write(wfd, &port, sizeof(port)), (ssize_t)sizeof(port));
        close(wfd);
        OK(tdp_listener_accept(l, TMO, &p));
        tdp_td *got = NULL;
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_ECONNRESET);
        int st = reap(pid, TMO);
        assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
        tdp_pipe_free(p);
        tdp_listener_free(l);
        tdp_loop_free(loop);
    }
    still_usable();
}

/* One message through the pipe with each fake copy taking delay_ms: ms it took to land. */
static int64_t one_message_ms(env *e, tdp_td *td, unsigned delay_ms, uint64_t tag)
{
    tdp_td *got;
    gpu_fill(td, tag);
    tdp__cuda_fake_set_delay_us(delay_ms * 1000u);
    int64_t t0 = now_ms();
    OK(tdp_pipe_send(e->cli, td, TMO));
    OK(tdp_pipe_recv(e->srv, TMO, &got));
    int64_t ms = now_ms() - t0;
    tdp__cuda_fake_set_delay_us(0);
    assert_true(gpu_holds(got, tag));
    tdp_pipe_release(e->srv, got);
    return ms;
}

/*
 * A large message is copied out as it is copied in: with each copy taking
 * D, five chunks land in about 6 D (copy-out of chunk i + 1 beside the
 * copy-in of chunk i), not the 10 D of one copy after the other. What the
 * same message costs without the delay (memmove, wakeups: much more under
 * a sanitizer) is measured first and allowed for.
 */
static void test_pipelined(void **state)
{
    (void)state;
    enum { D_MS = 300 };
    env e;
    env_up(&e, true, NULL);
    tdp_schema *sc = gpu_schema_of(5u * (4u << 20), CUDA0);
    tdp_td *td;
    OK(tdp_td_new(sc, &td));
    int64_t base = one_message_ms(&e, td, 0, 1);
    int64_t b2 = one_message_ms(&e, td, 0, 2);
    base = b2 < base ? b2 : base;
    int64_t ms = one_message_ms(&e, td, D_MS, 3);
    print_message("5 chunks, %d ms a copy: landed in %lld ms (%lld ms without the delay)\n", D_MS,
                  (long long)ms, (long long)base);
    assert_true(ms >= 6 * D_MS - 10);
    assert_true(ms - base < 8 * D_MS); /* one after the other: 10 D and more */
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    env_down(&e);
}

int main(void)
{
    /* 4 MiB chunks, so that the multi-chunk and streamed cases stay small (test_pipelined) */
    setenv("TDPIPE_STAGE_CHUNK_KIB", "4096", 1);
    const struct CMUnitTest tests[] = {
        /* first: they fork, and the child must not inherit a running thread */
        cmocka_unit_test_setup(test_sender_killed, setup),
        cmocka_unit_test_setup(test_receiver_killed, setup),
        cmocka_unit_test_setup(test_streamer_killed, setup),
        cmocka_unit_test_setup(test_gpu_to_gpu, setup),
        cmocka_unit_test_setup(test_override_host_to_gpu, setup),
        cmocka_unit_test_setup(test_override_gpu_to_host, setup),
        cmocka_unit_test_setup(test_schema_change, setup),
        cmocka_unit_test_setup(test_no_alloc, setup),
        cmocka_unit_test_setup(test_setup_at_connect, setup),
        cmocka_unit_test_setup(test_pipelined, setup),
        cmocka_unit_test_setup(test_prepared_pool_pinned_ahead, setup),
        cmocka_unit_test_setup(test_send_while_pinning, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
