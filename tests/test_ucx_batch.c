/*
 * test_ucx_batch.c: small host messages coalesced into BATCH frames by the
 * ucx plane (TDP_AM_BATCH; docs/wire-format.md), over UCX's TCP transport
 * on loopback: a stream of async sends from one thread with no loop thread
 * (the op-ring pattern of tdp_op_wait) arrives whole and in order, schema
 * changes, big messages and blocking sends mixed in; blocking sends are
 * never batched; a peer without TDP_HX_UCX_BATCH gets none; batched entries
 * carry their checksum; a steady batched stream allocates nothing; a close
 * posts what waits in a batch; several threads' sends through a loop
 * thread keep each thread's order; the credit count a held message carries
 * never arrives after a larger one; BATCH frames from a hostile peer are
 * refused before any entry is handed on.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "core/loop_int.h"
#include "pipe/checksum.h"
#include "pipe/op.h"
#include "pipe/session.h"
#include "pipe/ucx/plane_ucx.h"
#include "pipe/wire.h"
#include "test_rogue_am.h"
#include "test_util.h"

#define TMO  20000
#define NOPS 32 /* async sends in flight (the op ring) */

/* Message i: a pattern of (i, offset) with i itself in its first bytes. */
static uint8_t msg_byte(size_t j, uint64_t i)
{
    if (j < 8)
        return (uint8_t)(i >> (8 * j));
    return (uint8_t)(j * 7 + (j >> 8) * 31 + i * 101 + (i >> 8) * 13);
}

static void fill_msg(uint8_t *p, size_t n, uint64_t i)
{
    for (size_t j = 0; j < n; j++)
        p[j] = msg_byte(j, i);
}

/* Byte by byte, allocating nothing (the zero-allocation case counts). */
static bool msg_ok(const uint8_t *p, size_t n, uint64_t i)
{
    for (size_t j = 0; j < n; j++)
        if (p[j] != msg_byte(j, i))
            return false;
    return true;
}

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
} env;

/*
 * cli_thread false: nobody runs the client's loop but its own blocking
 * calls and tdp_op_wait — the way sends made between two drives of the
 * loop go out together. The server's loop has a thread.
 */
static void env_up_opts(env *e, bool cli_thread, const tdp_pipe_opts *o)
{
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->sl), TDP_OK);
    if (cli_thread)
        assert_int_equal(tdp_loop_start_thread(e->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(e->sl, "127.0.0.1", 0, o, NULL, NULL, &e->l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), o, &e->cli),
                     TDP_OK);
    assert_int_equal(tdp_listener_accept(e->l, TMO, &e->srv), TDP_OK);
    assert_int_equal(tdp_pipe_plane(e->srv), TDP_PLANE_UCX);
    assert_int_equal(tdp_pipe_plane(e->cli), TDP_PLANE_UCX);
}

static void env_up(env *e, bool cli_thread, bool checksum)
{
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = TDP_PLANE_UCX;
    o.checksum = checksum;
    env_up_opts(e, cli_thread, &o);
}

static void env_down(env *e)
{
    tdp_pipe_free(e->cli);
    tdp_pipe_free(e->srv);
    tdp_listener_free(e->l);
    /* the loops run on a moment: UCX 1.13 can abort destroying a worker
     * whose endpoint still has a wireup reply pending */
    usleep(100000);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->sl);
}

typedef struct count_req {
    tdp_pipe *p;
    bool rx, size; /* size: the link's batch size, not a count */
    uint64_t n;
} count_req;

static void count_task(void *arg)
{
    count_req *c = arg;
    c->n = c->size ? tdp__ucx_link_batch_bytes(tdp__session_link(c->p))
                   : tdp__ucx_link_batched(tdp__session_link(c->p), c->rx);
}

/*
 * Messages p's link sent / received in BATCH frames, read on its loop:
 * a receiver may have its last message before the loop thread has counted
 * it (the count goes up once the entry was handed on).
 */
static uint64_t batched(tdp_pipe *p, bool rx)
{
    count_req c = {p, rx, false, 0};
    tdp__call_on_loop(tdp__session_loop(p), count_task, &c);
    return c.n;
}

/* The payload bytes of p's batches (before its first: what it would get), read on its loop. */
static uint64_t batch_size(tdp_pipe *p)
{
    count_req c = {p, false, true, 0};
    tdp__call_on_loop(tdp__session_loop(p), count_task, &c);
    return c.n;
}

/* ---- streams -------------------------------------------------------------------- */

/*
 * The layouts a stream mixes: two that batch, one too big to (over 4032
 * bytes with its header). A message is the tensor padded to 64 bytes.
 */
enum { K_1000, K_3000, K_BIG, K_N };
static const int64_t kind_bytes[K_N] = {1000, 3000, 6000};
static const size_t kind_msg[K_N] = {1024, 3008, 6016};

/*
 * A stream: message i has layout kind[i] and goes as how[i] says (NULL:
 * all async): by tdp_pipe_send, or as an async send of op i % NOPS, which
 * is waited for first if still out (tdp_op_wait: the one thread drives the
 * loop meanwhile). Every op and td its own: one td per op and layout.
 */
enum {
    H_ASYNC,
    H_BLOCK,
    H_DRIVE, /* async, after a turn of the loop: the first send of a turn */
};
typedef struct ring {
    tdp_schema *s[K_N];
    tdp_op *op[NOPS];
    tdp_td *td[K_N][NOPS];
    tdp_td *sync_td[K_N];
} ring;

static void ring_init(ring *r)
{
    memset(r, 0, sizeof(*r));
    for (int k = 0; k < K_N; k++) {
        r->s[k] = host_bytes_schema(kind_bytes[k]);
        assert_int_equal(tdp_schema_total_bytes(r->s[k]), kind_msg[k]);
        for (int i = 0; i < NOPS; i++)
            assert_int_equal(tdp_td_new(r->s[k], &r->td[k][i]), TDP_OK);
        assert_int_equal(tdp_td_new(r->s[k], &r->sync_td[k]), TDP_OK);
    }
    for (int i = 0; i < NOPS; i++)
        assert_int_equal(tdp_op_new(NULL, NULL, &r->op[i]), TDP_OK);
}

static void ring_fini(ring *r)
{
    for (int i = 0; i < NOPS; i++)
        tdp_op_free(r->op[i]);
    for (int k = 0; k < K_N; k++) {
        for (int i = 0; i < NOPS; i++)
            tdp_td_unref(r->td[k][i]);
        tdp_td_unref(r->sync_td[k]);
        tdp_schema_unref(r->s[k]);
    }
}

/* Op k's last send: waited for if still out; TDP_OK for one never started. */
static tdp_err op_back(tdp_op *op)
{
    tdp_err rc = tdp_op_result(op);
    return rc == TDP_EAGAIN ? tdp_op_wait(op, TMO) : rc;
}

/*
 * Messages first .. first + count - 1 of the stream; every op is back
 * when it returns. *bad: the message whose send failed (-1: none).
 * snap_at >= 0: *snap is the client's batched count just before message
 * snap_at is sent.
 */
static tdp_err send_stream(tdp_pipe *p, ring *r, const uint8_t *kind, const uint8_t *how, int first,
                           int count, int *bad, int snap_at, uint64_t *snap)
{
    tdp_err rc = TDP_OK;
    *bad = -1;
    for (int i = first; i < first + count && rc == TDP_OK; i++) {
        if (i == snap_at)
            *snap = batched(p, false);
        if (how != NULL && how[i] == H_BLOCK) {
            tdp_td *td = r->sync_td[kind[i]];
            fill_msg(tdp_td_data(td), tdp_td_nbytes(td), (uint64_t)i);
            if ((rc = tdp_pipe_send(p, td, TMO)) != TDP_OK)
                *bad = i;
            continue;
        }
        int k = i % NOPS;
        if ((rc = op_back(r->op[k])) != TDP_OK) {
            *bad = i;
            break;
        }
        if (how != NULL && how[i] == H_DRIVE) {
            /* one drain of the loop at least: the flush source ends the turn */
            volatile bool never = false;
            if ((rc = tdp__loop_run_until(tdp__session_loop(p), &never, 0)) != TDP_ETIMEDOUT) {
                *bad = i;
                break;
            }
            rc = TDP_OK;
        }
        tdp_td *td = r->td[kind[i]][k];
        fill_msg(tdp_td_data(td), tdp_td_nbytes(td), (uint64_t)i);
        tdp_pipe_send_async(p, td, r->op[k]);
    }
    for (int k = 0; k < NOPS; k++) { /* every op back, even after a failure */
        tdp_err r2 = op_back(r->op[k]);
        if (rc == TDP_OK && r2 != TDP_OK) {
            rc = r2;
            *bad = k;
        }
    }
    return rc;
}

/* The server's side: receives count messages and checks each (no cmocka off main). */
typedef struct receiver {
    pthread_t th;
    tdp_pipe *p;
    const uint8_t *kind;
    int first, count;
    tdp_err rc;
    int got;      /* messages received intact, in order */
    int bad;      /* the first message received wrong (-1: none) */
    size_t n;     /* its size */
    uint64_t saw; /* the message number in its first bytes */
} receiver;

static void *receiver_main(void *arg)
{
    receiver *rv = arg;
    rv->rc = TDP_OK;
    rv->bad = -1;
    for (int i = rv->first; i < rv->first + rv->count; i++) {
        tdp_td *got;
        if ((rv->rc = tdp_pipe_recv(rv->p, TMO, &got)) != TDP_OK)
            break;
        size_t n = tdp_td_nbytes(got);
        if (n != kind_msg[rv->kind[i]] || !msg_ok(tdp_td_data(got), n, (uint64_t)i)) {
            rv->bad = i;
            rv->n = n;
            rv->saw = 0;
            memcpy(&rv->saw, tdp_td_data(got), n < 8 ? n : 8);
            break;
        }
        rv->got++;
        tdp_pipe_release(rv->p, got); /* depth > 1: lent until released */
        /*
         * A pause now and then: the sender fills its window meanwhile and
         * has sends waiting when the credit comes back, so batches form
         * however fast this thread is (a receiver that always keeps up
         * leaves each send alone in its turn: 60 of 7000 batched once, on
         * a quick run)
         */
        if (rv->got % 256 == 0)
            usleep(2000);
    }
    /* the sender waits for credit no more: its sends fail, soon */
    if (rv->rc != TDP_OK || rv->bad >= 0)
        tdp_pipe_abort(rv->p, TDP_ECANCELED);
    return NULL;
}

static void receiver_start(receiver *rv, tdp_pipe *p, const uint8_t *kind, int first, int count)
{
    *rv = (receiver){.p = p, .kind = kind, .first = first, .count = count};
    assert_int_equal(pthread_create(&rv->th, NULL, receiver_main, rv), 0);
}

static void receiver_join(receiver *rv)
{
    pthread_join(rv->th, NULL);
    if (rv->bad >= 0)
        print_message("message %d arrived wrong (%zu bytes, numbered %" PRIu64 ")\n", rv->bad,
                      rv->n, rv->saw);
    assert_int_equal(rv->rc, TDP_OK);
    assert_int_equal(rv->bad, -1);
    assert_int_equal(rv->got, rv->count);
}

/* Send count messages while a receiver checks them; returns the time taken. */
static int64_t stream(env *e, ring *r, const uint8_t *kind, const uint8_t *how, int first,
                      int count, int snap_at, uint64_t *snap)
{
    receiver rv;
    int bad;
    int64_t t0 = mono_ms();
    receiver_start(&rv, e->srv, kind, first, count);
    tdp_err rc = send_stream(e->cli, r, kind, how, first, count, &bad, snap_at, snap);
    if (rc != TDP_OK)
        print_message("send of message %d: %s\n", bad, tdp_errname(rc));
    receiver_join(&rv);
    assert_int_equal(rc, TDP_OK);
    return mono_ms() - t0;
}

/*
 * 5000 messages of 1000 bytes, then 2000 of 3000 (the schema changes with
 * sends of the old one still in batches), then a mix: runs of both
 * layouts, messages too big for a batch and blocking sends among the async
 * ones. The client's loop has no thread: the op ring's waits drive it.
 */
static void test_batched_stream(void **state)
{
    enum { P1 = 5000, P2 = 2000, P3 = 1500, TOTAL = P1 + P2 + P3 };
    static uint8_t kind[TOTAL];
    static uint8_t how[TOTAL];
    int nbig = 0, nblock = 0;
    for (int i = 0; i < TOTAL; i++) {
        kind[i] = i < P1 ? K_1000 : K_3000;
        how[i] = H_ASYNC;
        if (i >= P1 + P2) {
            int j = i - (P1 + P2);
            kind[i] = j % 23 < 9 ? K_1000 : j % 23 < 20 ? K_3000 : j % 23 == 20 ? K_BIG : K_1000;
            how[i] = j % 50 == 49 ? H_BLOCK : H_ASYNC;
            nbig += kind[i] == K_BIG;
            nblock += how[i] == H_BLOCK;
        }
    }
    env e;
    ring r;
    env_up(&e, false, false);
    ring_init(&r);
    uint64_t at_p2 = 0;
    int64_t ms1 = stream(&e, &r, kind, how, 0, P1 + P2, P1, &at_p2);
    uint64_t after_p2 = batched(e.cli, false);
    int64_t ms2 = stream(&e, &r, kind, how, P1 + P2, P3, -1, NULL);
    uint64_t tx = batched(e.cli, false), rx = batched(e.srv, true);
    print_message("%d + %d messages in %" PRId64 " ms, %d mixed (%d big, %d blocking) in %" PRId64
                  " ms; batched: %" PRIu64 " before the 3000-byte layout, %" PRIu64
                  " after it, %" PRIu64 " in all (received %" PRIu64 ")\n",
                  P1, P2, ms1, P3, nbig, nblock, ms2, at_p2, after_p2, tx, rx);
    assert_true(at_p2 > 0);            /* 1000-byte messages were batched */
    assert_true(after_p2 > at_p2);     /* and 3000-byte ones */
    assert_true(tx > after_p2);        /* and in the mix */
    assert_true(tx < (uint64_t)TOTAL); /* the first send of a turn goes alone */
    assert_int_equal(tx, rx);
    /* over TCP, batches of 16 KiB less a margin (plane_ucx.c, BATCH_BYTES_TCP) */
    assert_int_equal(batch_size(e.cli), 16320);
    /* nothing went the other way */
    assert_int_equal(batched(e.srv, false), 0);
    assert_int_equal(batched(e.cli, true), 0);
    assert_int_equal(tdp_pipe_status(e.cli), TDP_OK);
    assert_int_equal(tdp_pipe_status(e.srv), TDP_OK);
    ring_fini(&r);
    env_down(&e);
}

/*
 * The batch size follows the transport: with UCX's shared memory only (the
 * pipe's same-host worker), batches stay at one eager fragment, 8064 bytes,
 * and a stream arrives whole; over TCP (the test above) they are twice that.
 */
static void test_batch_size_shm(void **state)
{
    enum { N = 3000 };
    static uint8_t kind[N];
    static uint8_t how[N];
    for (int i = 0; i < N; i++) {
        kind[i] = i % 3 == 2 ? K_3000 : K_1000;
        how[i] = H_ASYNC;
    }
    setenv("UCX_TLS", "posix,sysv,self", 1); /* read as the loops are made */
    env e;
    ring r;
    env_up(&e, false, false);
    setenv("UCX_TLS", "tcp", 1);
    ring_init(&r);
    stream(&e, &r, kind, how, 0, N, -1, NULL);
    uint64_t tx = batched(e.cli, false);
    print_message("%d messages over shared memory, %" PRIu64 " batched\n", N, tx);
    assert_int_equal(tx, batched(e.srv, true));
    assert_int_equal(batch_size(e.cli), 8064);
    assert_int_equal(tdp_pipe_status(e.cli), TDP_OK);
    ring_fini(&r);
    env_down(&e);
}

/*
 * Blocking sends are waited for: never held for a batch, loop thread or
 * not. Then, with no loop thread, rounds of a turn of the loop, two async
 * sends (the first goes at once, the second waits in a batch) and a
 * blocking send, which could join that batch and must not: it posts the
 * batch (one message: a plain DATA) and goes alone.
 */
static void test_blocking_never_batched(void **state)
{
    enum { COUNT = 500, MIXED = 999 };
    static uint8_t kind[MIXED];
    static uint8_t how[MIXED];
    for (int i = 0; i < MIXED; i++)
        how[i] = H_BLOCK;
    for (int thread = 0; thread < 2; thread++) {
        env e;
        ring r;
        env_up(&e, thread == 1, false);
        ring_init(&r);
        int64_t ms = stream(&e, &r, kind, how, 0, COUNT, -1, NULL);
        print_message("%d blocking sends (client loop thread: %s) in %" PRId64 " ms\n", COUNT,
                      thread ? "yes" : "no", ms);
        assert_int_equal(batched(e.cli, false), 0);
        assert_int_equal(batched(e.srv, true), 0);
        ring_fini(&r);
        env_down(&e);
    }
    for (int i = 0; i < MIXED; i++)
        how[i] = i % 3 == 0 ? H_DRIVE : i % 3 == 1 ? H_ASYNC : H_BLOCK;
    env e;
    ring r;
    env_up(&e, false, false);
    ring_init(&r);
    int64_t ms = stream(&e, &r, kind, how, 0, MIXED, -1, NULL);
    print_message("2 async sends and a blocking one, %d times, in %" PRId64 " ms: %" PRIu64
                  " batched\n",
                  MIXED / 3, ms, batched(e.cli, false));
    assert_int_equal(batched(e.cli, false), 0);
    assert_int_equal(batched(e.srv, true), 0);
    ring_fini(&r);
    env_down(&e);
}

/* A peer whose HELLO has no UCX_BATCH (an older one) gets every message alone. */
static void test_older_peer(void **state)
{
    enum { COUNT = 2000 };
    static uint8_t kind[COUNT];
    for (int i = 0; i < COUNT; i++)
        kind[i] = i < COUNT / 2 ? K_1000 : K_3000;
    env e;
    ring r;
    tdp__ucx_hello_no_batch(true);
    env_up(&e, false, false);
    tdp__ucx_hello_no_batch(false);
    ring_init(&r);
    int64_t ms = stream(&e, &r, kind, NULL, 0, COUNT, -1, NULL);
    print_message("%d async sends to an older peer in %" PRId64 " ms\n", COUNT, ms);
    assert_int_equal(batched(e.cli, false), 0);
    assert_int_equal(batched(e.srv, true), 0);
    ring_fini(&r);
    env_down(&e);
}

/* With the payload checksum in force, batched entries carry it (56-byte headers). */
static void test_checksum_batched(void **state)
{
    enum { COUNT = 3000 };
    static uint8_t kind[COUNT];
    for (int i = 0; i < COUNT; i++)
        kind[i] = i < 2000 ? K_1000 : K_3000;
    env e;
    ring r;
    env_up(&e, false, true);
    ring_init(&r);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(e.cli, &st);
    assert_true(st.checksum);
    int64_t ms = stream(&e, &r, kind, NULL, 0, COUNT, -1, NULL);
    uint64_t tx = batched(e.cli, false), rx = batched(e.srv, true);
    print_message("%d checksummed async sends in %" PRId64 " ms, %" PRIu64 " batched\n", COUNT, ms,
                  tx);
    assert_true(tx > 0);
    assert_int_equal(tx, rx);
    tdp_pipe_stats_get(e.srv, &st);
    assert_true(st.checksum);
    assert_int_equal(st.checksum_errors, 0);
    ring_fini(&r);
    env_down(&e);
}

/*
 * After a warm-up (the link's batch buffers are made at its first batch),
 * 2000 batched async sends and their receives allocate nothing in the
 * library, on either side (tdp_mem_total_allocs counts the process; the
 * allocator itself is test_pipe_alloc's to watch).
 */
static void test_batch_zero_alloc(void **state)
{
    enum { WARM = 500, STEADY = 2000, COUNT = WARM + STEADY };
    static uint8_t kind[COUNT];
    env e;
    ring r;
    env_up(&e, false, false);
    ring_init(&r);
    stream(&e, &r, kind, NULL, 0, WARM, -1, NULL);
    uint64_t b0 = batched(e.cli, false);
    uint64_t a0 = tdp_mem_total_allocs();
    int64_t ms = stream(&e, &r, kind, NULL, WARM, STEADY, -1, NULL);
    uint64_t a1 = tdp_mem_total_allocs();
    uint64_t b1 = batched(e.cli, false);
    print_message("%d steady async sends in %" PRId64 " ms: %" PRIu64 " batched, %" PRIu64
                  " library allocations\n",
                  STEADY, ms, b1 - b0, a1 - a0);
    assert_true(b1 > b0);
    assert_int_equal(a1 - a0, 0);
    ring_fini(&r);
    env_down(&e);
}

/*
 * A clean close right after async sends the loop never drove (all but the
 * first wait in a batch): the close finishes them first, the server gets
 * every one and then the end of the stream.
 */
static void test_close_after_batch(void **state)
{
    enum { COUNT = 20 };
    static uint8_t kind[COUNT];
    env e;
    ring r;
    env_up(&e, false, false);
    ring_init(&r);
    for (int i = 0; i < COUNT; i++) {
        tdp_td *td = r.td[K_1000][i];
        fill_msg(tdp_td_data(td), tdp_td_nbytes(td), (uint64_t)i);
        tdp_pipe_send_async(e.cli, td, r.op[i]);
    }
    /* full batches went already; the last one waits for the loop */
    uint64_t went = batched(e.cli, false);
    assert_int_equal(tdp_pipe_close(e.cli, TMO), TDP_OK);
    for (int i = 0; i < COUNT; i++)
        assert_int_equal(tdp_op_result(r.op[i]), TDP_OK);
    receiver rv;
    receiver_start(&rv, e.srv, kind, 0, COUNT);
    receiver_join(&rv);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED);
    print_message("%d async sends, then a close: %" PRIu64 " in full batches before it\n", COUNT,
                  went);
    assert_true(went > 0 && went < COUNT - 1);
    ring_fini(&r);
    env_down(&e);
}

/*
 * Several threads' async sends with a loop thread: those the loop thread
 * takes in one turn go out together. Each thread's messages arrive in its
 * order (a message is numbered thread << 32 | its number).
 */
enum { T_THREADS = 4, T_COUNT = 1500, T_OPS = 8 };

typedef struct tsender {
    pthread_t th;
    tdp_pipe *p;
    int id;
    tdp_op *op[T_OPS];
    tdp_td *td[T_OPS];
    tdp_err rc;
} tsender;

static void *tsender_main(void *arg)
{
    tsender *t = arg;
    t->rc = TDP_OK;
    for (int i = 0; i < T_COUNT && t->rc == TDP_OK; i++) {
        int k = i % T_OPS;
        if ((t->rc = op_back(t->op[k])) != TDP_OK)
            break;
        fill_msg(tdp_td_data(t->td[k]), tdp_td_nbytes(t->td[k]),
                 (uint64_t)t->id << 32 | (uint64_t)i);
        tdp_pipe_send_async(t->p, t->td[k], t->op[k]);
    }
    for (int k = 0; k < T_OPS; k++) {
        tdp_err r2 = op_back(t->op[k]);
        if (t->rc == TDP_OK)
            t->rc = r2;
    }
    return NULL;
}

static void test_threads_batched(void **state)
{
    env e;
    env_up(&e, true, false);
    tdp_schema *s = host_bytes_schema(kind_bytes[K_1000]);
    static tsender ts[T_THREADS];
    for (int t = 0; t < T_THREADS; t++) {
        ts[t] = (tsender){.p = e.cli, .id = t};
        for (int k = 0; k < T_OPS; k++) {
            assert_int_equal(tdp_op_new(NULL, NULL, &ts[t].op[k]), TDP_OK);
            assert_int_equal(tdp_td_new(s, &ts[t].td[k]), TDP_OK);
        }
    }
    int64_t t0 = mono_ms();
    for (int t = 0; t < T_THREADS; t++)
        assert_int_equal(pthread_create(&ts[t].th, NULL, tsender_main, &ts[t]), 0);
    int next[T_THREADS] = {0};
    tdp_err rc = TDP_OK;
    int bad = -1;
    for (int i = 0; i < T_THREADS * T_COUNT; i++) {
        tdp_td *got;
        if ((rc = tdp_pipe_recv(e.srv, TMO, &got)) != TDP_OK)
            break;
        uint64_t v;
        memcpy(&v, tdp_td_data(got), sizeof(v));
        int t = (int)(v >> 32);
        if (tdp_td_nbytes(got) != kind_msg[K_1000] || t < 0 || t >= T_THREADS ||
            (v & 0xffffffffu) != (uint64_t)next[t] ||
            !msg_ok(tdp_td_data(got), tdp_td_nbytes(got), v)) {
            bad = i;
            break;
        }
        next[t]++;
    }
    if (rc != TDP_OK || bad >= 0)
        tdp_pipe_abort(e.srv, TDP_ECANCELED);
    for (int t = 0; t < T_THREADS; t++)
        pthread_join(ts[t].th, NULL);
    uint64_t tx = batched(e.cli, false), rx = batched(e.srv, true);
    print_message("%d threads x %d async sends in %" PRId64 " ms: %s, message %d wrong; "
                  "%" PRIu64 " batched (received %" PRIu64 ")\n",
                  T_THREADS, T_COUNT, mono_ms() - t0, tdp_errname(rc), bad, tx, rx);
    assert_int_equal(rc, TDP_OK);
    assert_int_equal(bad, -1);
    for (int t = 0; t < T_THREADS; t++) {
        assert_int_equal(ts[t].rc, TDP_OK);
        assert_int_equal(next[t], T_COUNT);
    }
    assert_int_equal(tx, rx);
    for (int t = 0; t < T_THREADS; t++) {
        for (int k = 0; k < T_OPS; k++) {
            tdp_op_free(ts[t].op[k]);
            tdp_td_unref(ts[t].td[k]);
        }
    }
    tdp_schema_unref(s);
    env_down(&e);
}

/*
 * Both ways at once, no loop thread on the client. The client receives
 * the server's big messages (depth 4: each lent until released) and, each
 * time, sends two small ones (the second waits in a batch) and then
 * releases what it received: the credit goes at once (a layout too big for
 * a window gets no credit held back). Every DATA carries the client's
 * credit count as it was when the message was sent; the server refuses a
 * count that goes back ("credit beyond what was sent").
 */
typedef struct big_sender {
    pthread_t th;
    tdp_pipe *p;
    tdp_td *td;
    int count;
    tdp_err rc;
} big_sender;

static void *big_sender_main(void *arg)
{
    big_sender *b = arg;
    b->rc = TDP_OK;
    for (int i = 0; i < b->count && b->rc == TDP_OK; i++) {
        fill_msg(tdp_td_data(b->td), tdp_td_nbytes(b->td), (uint64_t)i);
        b->rc = tdp_pipe_send(b->p, b->td, TMO);
    }
    if (b->rc != TDP_OK)
        tdp_pipe_abort(b->p, TDP_ECANCELED);
    return NULL;
}

static void credit_order(bool batches)
{
    enum { ROUNDS = 300, BIG = 256 << 10 };
    static uint8_t kind[2 * ROUNDS];
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = TDP_PLANE_UCX;
    o.recv_depth = 4;
    env e;
    ring r;
    tdp__ucx_hello_no_batch(!batches);
    env_up_opts(&e, false, &o);
    tdp__ucx_hello_no_batch(false);
    ring_init(&r);
    tdp_schema *bs = host_bytes_schema(BIG);
    big_sender bsnd = {.p = e.srv, .count = ROUNDS};
    assert_int_equal(tdp_td_new(bs, &bsnd.td), TDP_OK);
    receiver rv;
    receiver_start(&rv, e.srv, kind, 0, 2 * ROUNDS);
    assert_int_equal(pthread_create(&bsnd.th, NULL, big_sender_main, &bsnd), 0);
    tdp_err rc = TDP_OK;
    int bad = -1, got_ok = 0;
    for (int i = 0; i < ROUNDS && rc == TDP_OK; i++) {
        tdp_td *got;
        if ((rc = tdp_pipe_recv(e.cli, TMO, &got)) != TDP_OK)
            break;
        if (tdp_td_nbytes(got) != BIG || !msg_ok(tdp_td_data(got), BIG, (uint64_t)i))
            break;
        got_ok++;
        /* two async sends: the first at once, the second held in a batch
         * (their ops were last used 16 rounds ago: done, no wait drives the loop) */
        for (int m = 2 * i; m < 2 * i + 2 && rc == TDP_OK; m++) {
            tdp_op *op = r.op[m % NOPS];
            if ((rc = op_back(op)) != TDP_OK) {
                bad = m;
                break;
            }
            tdp_td *td = r.td[K_1000][m % NOPS];
            fill_msg(tdp_td_data(td), tdp_td_nbytes(td), (uint64_t)m);
            tdp_pipe_send_async(e.cli, td, op);
        }
        tdp_pipe_release(e.cli, got); /* the credit goes now, the second send still held */
    }
    for (int k = 0; k < NOPS; k++) {
        tdp_err r2 = op_back(r.op[k]);
        if (rc == TDP_OK && r2 != TDP_OK)
            rc = r2, bad = k;
    }
    pthread_join(bsnd.th, NULL);
    print_message("%d rounds (batches: %s): client %s (message %d), %d big messages intact; "
                  "server sender %s; %" PRIu64 " batched\n",
                  ROUNDS, batches ? "yes" : "no", tdp_errname(rc), bad, got_ok,
                  tdp_errname(bsnd.rc), batched(e.cli, false));
    if (rc != TDP_OK)
        tdp_pipe_abort(e.cli, TDP_ECANCELED);
    receiver_join(&rv);
    assert_int_equal(rc, TDP_OK);
    assert_int_equal(got_ok, ROUNDS);
    assert_int_equal(bsnd.rc, TDP_OK);
    tdp_td_unref(bsnd.td);
    tdp_schema_unref(bs);
    ring_fini(&r);
    env_down(&e);
}

static void test_credit_order(void **state)
{
    credit_order(false); /* the same stream, no batches: the control */
    credit_order(true);
}

/* ---- hostile frames ------------------------------------------------------------- */

/* One raw AM from the client's loop; returns once UCX let go of it (or the time is up). */
static void rogue_send(env *e, const tdp_am_hdr *h, const void *payload, size_t len)
{
    rogue_am_send(e->cl, e->cli, h, payload, len, false, TMO);
}

/*
 * One real message from the server first: UCX's TCP wireup is done both
 * ways before the server ends the pipe (UCX 1.13 can abort destroying a
 * worker while an endpoint's wireup reply is still pending).
 */
static void warm_up(env *e)
{
    tdp_schema *s = host_bytes_schema(64);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    memset(tdp_td_data(td), 1, 64);
    assert_int_equal(tdp_pipe_send(e->srv, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e->cli, TMO, &got), TDP_OK);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

#define HB 64 /* the hostile layout's bytes: its window is 64 messages */

typedef enum {
    B_GOOD,         /* batches of 2 and 3 entries: five messages */
    B_GOOD_MAX,     /* one of 64 entries (the window): all delivered */
    B_BAD_MAGIC,    /* the last entry's magic is wrong */
    B_CREDIT,       /* the last entry is a CREDIT frame */
    B_CHUNKED,      /* the last entry has the CHUNKED flag */
    B_TOKEN,        /* the last entry names another link */
    B_SEQ_GAP,      /* the last entry's seq skips one */
    B_PAST_END,     /* the last entry's length runs past the payload */
    B_TRAILING,     /* bytes after the last entry */
    B_COUNT_1,      /* a batch of one (count 1) */
    B_COUNT_65,     /* 65 entries */
    B_COUNT_MORE,   /* count 4, three entries */
    B_HDR_LEN,      /* the BATCH header's length is not the payload's */
    B_HDR_FLAGS,    /* the BATCH header has a flag */
    B_SUM_UNAGREED, /* the last entry has a checksum none agreed on (session) */
    B_STREAM_SEQ,   /* well formed, but numbered past the stream (session) */
    B_HASH,         /* the second entry's hash names another layout (session) */
    B_SIZE,         /* the second entry's length is not the layout's (session) */
    /* with the checksum in force */
    B_SUM_BAD,     /* the second entry's sum is wrong: that message is dropped */
    B_SUM_MISSING, /* the second entry has no sum (session) */
    B_CASES
} bcase;

/* What the server's receives give: `before` messages, then `want`. */
static const struct {
    const char *name;
    int nent;   /* entries in the (last) batch */
    int before; /* messages received intact first */
    tdp_err want;
    bool sum; /* both sides offer the checksum */
} bcases[B_CASES] = {
    [B_GOOD] = {"good", 3, 5, TDP_OK, false},
    [B_GOOD_MAX] = {"good, 64 entries", 64, 64, TDP_OK, false},
    [B_BAD_MAGIC] = {"bad magic", 3, 0, TDP_EPROTO, false},
    [B_CREDIT] = {"CREDIT entry", 3, 0, TDP_EPROTO, false},
    [B_CHUNKED] = {"CHUNKED entry", 3, 0, TDP_EPROTO, false},
    [B_TOKEN] = {"other token", 3, 0, TDP_EPROTO, false},
    [B_SEQ_GAP] = {"seq gap", 3, 0, TDP_EPROTO, false},
    [B_PAST_END] = {"entry past the end", 3, 0, TDP_EPROTO, false},
    [B_TRAILING] = {"trailing bytes", 3, 0, TDP_EPROTO, false},
    [B_COUNT_1] = {"count 1", 1, 0, TDP_EPROTO, false},
    [B_COUNT_65] = {"count 65", 65, 0, TDP_EPROTO, false},
    [B_COUNT_MORE] = {"count past the entries", 3, 0, TDP_EPROTO, false},
    [B_HDR_LEN] = {"header length", 3, 0, TDP_EPROTO, false},
    [B_HDR_FLAGS] = {"header flags", 3, 0, TDP_EPROTO, false},
    [B_SUM_UNAGREED] = {"sum not agreed", 3, 2, TDP_EPROTO, false},
    [B_STREAM_SEQ] = {"numbered past the stream", 3, 0, TDP_EPROTO, false},
    [B_HASH] = {"other layout's hash", 3, 1, TDP_EMISMATCH, false},
    [B_SIZE] = {"other size", 3, 1, TDP_EMSGSIZE, false},
    [B_SUM_BAD] = {"bad sum", 3, 1, TDP_ECHECKSUM, true},
    [B_SUM_MISSING] = {"sum missing", 3, 1, TDP_EPROTO, true},
};

typedef struct hctx {
    uint64_t tok, hash;
    bool sum;
    uint8_t *buf; /* the payload being built */
    size_t len;
} hctx;

/* Append a DATA entry for message `seq` (1-based; message index seq - 1). */
static void put_entry(hctx *c, tdp_am_hdr h, size_t nbytes)
{
    uint8_t bytes[HB + 8];
    fill_msg(bytes, sizeof(bytes), h.seq - 1);
    if ((h.flags & TDP_AM_F_SUM) != 0)
        h.sum ^= tdp__sum(bytes, nbytes); /* h.sum given: a wrong one */
    size_t hl = tdp_wire_am_encode(c->buf + c->len, &h);
    memcpy(c->buf + c->len + hl, bytes, nbytes);
    c->len += hl + nbytes;
}

static void send_batch(env *e, hctx *c, uint64_t seq0, int count, uint16_t flags, size_t len)
{
    tdp_am_hdr bh = {.type = TDP_AM_BATCH,
                     .flags = flags,
                     .token = c->tok,
                     .seq = seq0,
                     .length = len,
                     .arg = (uint64_t)count};
    rogue_send(e, &bh, c->buf, c->len);
}

/* A batch of nent entries for messages seq0.., the last (or second) one spoiled per kind. */
static void build(hctx *c, bcase kind, uint64_t seq0, int nent)
{
    c->len = 0;
    for (int i = 0; i < nent; i++) {
        tdp_am_hdr h = {.type = TDP_AM_DATA,
                        .flags = c->sum ? TDP_AM_F_SUM : 0,
                        .token = c->tok,
                        .seq = seq0 + (uint64_t)i,
                        .hash = c->hash,
                        .length = HB};
        size_t n = HB, at = c->len;
        bool last = i == nent - 1, second = i == 1;
        if (last && kind == B_CREDIT)
            h = (tdp_am_hdr){.type = TDP_AM_CREDIT, .token = c->tok, .seq = h.seq}, n = 0;
        else if (last && kind == B_CHUNKED)
            h.flags |= TDP_AM_F_CHUNKED;
        else if (last && kind == B_TOKEN)
            h.token ^= 0x10000;
        else if (last && kind == B_SEQ_GAP)
            h.seq++;
        else if (last && kind == B_PAST_END)
            h.length = HB + 1;
        else if (last && kind == B_SUM_UNAGREED)
            h.flags |= TDP_AM_F_SUM;
        else if (second && kind == B_HASH)
            h.hash ^= 1;
        else if (second && kind == B_SIZE)
            h.length = n = HB - 1;
        else if (second && kind == B_SUM_BAD)
            h.sum = 0x5a5a; /* xored into the right sum */
        else if (second && kind == B_SUM_MISSING)
            h.flags &= (uint16_t)~TDP_AM_F_SUM;
        put_entry(c, h, n);
        if (last && kind == B_BAD_MAGIC)
            c->buf[at] ^= 0xff;
    }
    if (kind == B_TRAILING) {
        memset(c->buf + c->len, 0, 8);
        c->len += 8;
    }
}

static void hostile(bcase kind)
{
    const int nent = bcases[kind].nent;
    env e;
    env_up(&e, true, bcases[kind].sum);
    warm_up(&e);
    tdp_schema *s = host_bytes_schema(HB);
    assert_int_equal(tdp_schema_total_bytes(s), HB);
    size_t jl;
    const char *json = tdp_schema_json(s, &jl);
    hctx c = {.tok = tdp__ucx_link_peer_token(tdp__session_link(e.cli)),
              .hash = tdp_schema_hash(s),
              .sum = bcases[kind].sum,
              .buf = calloc(70, TDP_AM_HDR_SUM_LEN + HB + 8)};
    assert_non_null(c.buf);

    tdp_am_hdr h = {
        .type = TDP_AM_SCHEMA, .token = c.tok, .seq = 1, .hash = c.hash, .length = jl, .arg = HB};
    rogue_send(&e, &h, json, jl);
    uint64_t seq0 = kind == B_STREAM_SEQ ? 2 : 1;
    if (kind == B_GOOD) { /* two first: the smallest batch */
        build(&c, kind, seq0, 2);
        send_batch(&e, &c, seq0, 2, 0, c.len);
        seq0 += 2;
    }
    build(&c, kind, seq0, nent);
    int count = kind == B_COUNT_MORE ? nent + 1 : nent;
    uint16_t flags = kind == B_HDR_FLAGS ? TDP_AM_F_PREPARE : 0;
    size_t len = kind == B_HDR_LEN ? c.len + 8 : c.len;
    send_batch(&e, &c, seq0, count, flags, len);

    /* the messages expected intact, then the verdict (none after TDP_OK: all taken) */
    int ok = 0;
    tdp_err rc = TDP_OK;
    for (int i = 0; i < 70; i++) {
        tdp_td *got = NULL;
        rc = tdp_pipe_recv(e.srv, TMO, &got);
        if (rc != TDP_OK)
            break;
        /* message seq i + 1, but for the one dropped (B_SUM_BAD: seq 2) */
        uint64_t idx = (uint64_t)i + (kind == B_SUM_BAD && i >= 1);
        assert_int_equal(tdp_td_nbytes(got), HB);
        assert_true(msg_ok(tdp_td_data(got), HB, idx));
        ok++;
        if (bcases[kind].want == TDP_OK && ok == bcases[kind].before)
            break;
    }
    print_message("batch case %s: %d messages, then %s\n", bcases[kind].name, ok, tdp_errname(rc));
    assert_int_equal(ok, bcases[kind].before);
    assert_int_equal(rc, bcases[kind].want);
    if (kind == B_SUM_BAD) { /* the pipe goes on: the third message follows */
        tdp_td *got = NULL;
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(msg_ok(tdp_td_data(got), HB, 2));
        tdp_pipe_stats st;
        tdp_pipe_stats_get(e.srv, &st);
        assert_int_equal(st.checksum_errors, 1);
    }
    /* no look at the server's batched count here: the credit it returns for
     * these frames is refused by the client, which never sent them, and the
     * server's link may be gone by now */
    free(c.buf);
    tdp_schema_unref(s);
    env_down(&e);
}

static void test_hostile_batches(void **state)
{
    for (int k = 0; k < B_CASES; k++)
        hostile((bcase)k);
}

int main(void)
{
    /* the ucx plane over UCX's TCP transport (CMake keeps it on loopback) */
    setenv("UCX_TLS", "tcp", 1);
    /* TDP_TEST_FILTER=pattern runs only the matching tests, TDP_TEST_SKIP=pattern
     * leaves the matching ones out (cmocka wildcards) */
    const char *filter = getenv("TDP_TEST_FILTER"), *skip = getenv("TDP_TEST_SKIP");
    if (filter != NULL && *filter != '\0')
        cmocka_set_test_filter(filter);
    if (skip != NULL && *skip != '\0')
        cmocka_set_skip_filter(skip);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batched_stream),   cmocka_unit_test(test_blocking_never_batched),
        cmocka_unit_test(test_older_peer),       cmocka_unit_test(test_checksum_batched),
        cmocka_unit_test(test_batch_zero_alloc), cmocka_unit_test(test_close_after_batch),
        cmocka_unit_test(test_threads_batched),  cmocka_unit_test(test_credit_order),
        cmocka_unit_test(test_hostile_batches),  cmocka_unit_test(test_batch_size_shm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
