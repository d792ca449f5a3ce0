/*
 * test_fanout: one producer, many consumers (include/tdpipe/fanout.h), on
 * the plane TDP_TEST_PLANE names (tests/CMakeLists.txt runs it per plane).
 * Every message carries its fan-out sequence number in its first 8 bytes
 * and a pattern derived from it in the rest, so order, loss and torn
 * buffers all show.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/tdpipe.h>

#include "core/cuda.h"
#include "pipe/op.h"
#include "pipe/session.h"
#include "pipe/shm/plane_shm.h"
#include "test_util.h"

#define TMO    20000 /* ms: bound for any single wait */
#define NBYTES 4096
#define MAXC   8

/* Every pipe's receive window (0: none); a test sets it for itself. */
static uint64_t g_window;

static tdp_pipe_opts popts(void)
{
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.recv_window_bytes = g_window;
    const char *n = getenv("TDP_TEST_PLANE");
    if (n != NULL && tdp_plane_parse(n, &o.plane) != TDP_OK)
        abort();
    return o;
}

static void fill(tdp_td *td, uint64_t seq)
{
    uint8_t *p = tdp_td_data(td);
    uint64_t n = tdp_td_nbytes(td);
    memcpy(p, &seq, 8);
    for (uint64_t i = 8; i < n; i++)
        p[i] = (uint8_t)(seq * 31 + i);
}

/* The message's sequence number, 0 when its pattern does not match it. */
static uint64_t check(const tdp_td *td)
{
    const uint8_t *p = tdp_td_data(td);
    uint64_t n = tdp_td_nbytes(td), seq;
    memcpy(&seq, p, 8);
    for (uint64_t i = 8; i < n; i++)
        if (p[i] != (uint8_t)(seq * 31 + i))
            return 0;
    return seq;
}

/* ---- environment: a producer loop with a fan-out that listens, consumer pipes ---- */

typedef struct consumer {
    pthread_t th;
    tdp_pipe *pipe;
    int stall_ms;       /* wait this long before the first receive */
    uint64_t seqs[512]; /* what it got, in order */
    uint64_t n, max;
    tdp_err end; /* how its stream ended */
    bool bad;    /* a torn or mismatched buffer */
    bool joined;
    atomic_bool wake; /* ends a stall */
} consumer;

typedef struct env {
    tdp_loop *pl, *cl;
    tdp_fanout *fo;
    uint16_t port;
    consumer c[MAXC];
    int nc;
} env;

static void env_up(env *e, const tdp_fanout_opts *fo_opts)
{
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->pl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->pl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->cl), TDP_OK);
    assert_int_equal(tdp_fanout_new(e->pl, fo_opts, &e->fo), TDP_OK);
    tdp_listener_opts lo;
    tdp_listener_opts_default(&lo);
    lo.pipe = popts();
    assert_int_equal(tdp_fanout_listen(e->fo, "127.0.0.1", 0, &lo, &e->port), TDP_OK);
    assert_true(e->port > 0);
}

static uint32_t consumers_now(env *e)
{
    tdp_fanout_stats st;
    tdp_fanout_stats_get(e->fo, &st, NULL, 0);
    return st.consumers;
}

static void wait_consumers(env *e, uint32_t n)
{
    int64_t end = mono_ms() + TMO;
    while (consumers_now(e) != n && mono_ms() < end)
        usleep(2000);
    assert_int_equal(consumers_now(e), n);
}

static void *consumer_main(void *arg)
{
    consumer *c = arg;
    int64_t until = mono_ms() + c->stall_ms;
    while (!atomic_load(&c->wake) && mono_ms() < until)
        usleep(1000);
    for (;;) {
        tdp_td *td;
        tdp_err rc = tdp_pipe_recv(c->pipe, TMO, &td);
        if (rc != TDP_OK) {
            /* the consumer's side of the clean end: the fan-out's close waits for it */
            c->end = rc;
            tdp_pipe_free(c->pipe);
            c->pipe = NULL;
            return NULL;
        }
        uint64_t seq = check(td);
        if (seq == 0 || c->n == c->max)
            c->bad = true;
        else
            c->seqs[c->n++] = seq;
    }
}

/* Dial one more consumer; it receives on a thread of its own. */
static consumer *add_consumer(env *e, uint64_t max, int stall_ms)
{
    consumer *c = &e->c[e->nc];
    tdp_pipe_opts o = popts();
    c->max = max;
    c->stall_ms = stall_ms;
    assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", e->port, &o, &c->pipe), TDP_OK);
    e->nc++;
    wait_consumers(e, (uint32_t)e->nc);
    assert_int_equal(pthread_create(&c->th, NULL, consumer_main, c), 0);
    return c;
}

static void env_down(env *e)
{
    assert_int_equal(tdp_fanout_close(e->fo, TMO), TDP_OK);
    for (int i = 0; i < e->nc; i++) {
        if (!e->c[i].joined)
            pthread_join(e->c[i].th, NULL);
        assert_int_equal(e->c[i].end, TDP_ECLOSED);
        assert_false(e->c[i].bad);
    }
    tdp_fanout_free(e->fo);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->pl);
}

static void assert_run(const consumer *c, uint64_t from, uint64_t to)
{
    assert_int_equal(c->n, to - from + 1);
    for (uint64_t i = 0; i < c->n; i++)
        assert_int_equal(c->seqs[i], from + i);
}

/* ---- tests ------------------------------------------------------------------- */

/* Broadcast: three consumers each get 1..N in order; one buffer reused. */
static void broadcast_order(void)
{
    env e;
    const uint64_t n = 300;
    env_up(&e, NULL);
    for (int i = 0; i < 3; i++)
        add_consumer(&e, n, 0);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (uint64_t i = 1; i <= n; i++) {
        fill(td, i); /* safe: the previous send has completed on every consumer */
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    }
    tdp_fanout_peer_stats ps[MAXC];
    tdp_fanout_stats st;
    assert_int_equal(tdp_fanout_stats_get(e.fo, &st, ps, MAXC), 3);
    assert_int_equal(st.msgs, n);
    assert_int_equal(st.unsent, 0);
    assert_int_equal(st.drops, 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ps[i].msgs_sent, n);
        assert_int_equal(ps[i].bytes_sent, n * NBYTES);
        assert_int_equal(ps[i].first_seq, 1);
    }
    env_down(&e);
    for (int i = 0; i < 3; i++)
        assert_run(&e.c[i], 1, n);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_broadcast_order(void **state)
{
    (void)state;
    broadcast_order();
}

/*
 * Consumers that grant a receive window: more in flight per consumer (on
 * the shm plane, one group's pools sized for the window).
 */
static void test_broadcast_order_window(void **state)
{
    (void)state;
    g_window = 256u << 10;
    broadcast_order();
    g_window = 0;
}

/* Async sends, several in flight, each with its own buffer: all in order. */
static void test_broadcast_async(void **state)
{
    (void)state;
    env e;
    const uint64_t n = 200;
    enum { K = 4 };
    env_up(&e, NULL);
    for (int i = 0; i < 2; i++)
        add_consumer(&e, n, 0);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td[K];
    tdp_op *op[K];
    for (int k = 0; k < K; k++) {
        assert_int_equal(tdp_td_new(s, &td[k]), TDP_OK);
        assert_int_equal(tdp_op_new(NULL, NULL, &op[k]), TDP_OK);
    }
    for (uint64_t i = 1; i <= n; i++) {
        int k = (int)(i % K);
        int64_t end = mono_ms() + TMO;
        while (tdp_op_result(op[k]) == TDP_EAGAIN && mono_ms() < end)
            usleep(100);
        assert_int_equal(tdp_op_result(op[k]), TDP_OK);
        if (i > K)
            assert_int_equal(tdp_op_seq(op[k]), i - K);
        fill(td[k], i);
        tdp_fanout_send_async(e.fo, td[k], op[k]);
    }
    for (int k = 0; k < K; k++) {
        int64_t end = mono_ms() + TMO;
        while (tdp_op_result(op[k]) == TDP_EAGAIN && mono_ms() < end)
            usleep(100);
        assert_int_equal(tdp_op_result(op[k]), TDP_OK);
    }
    env_down(&e);
    for (int i = 0; i < 2; i++)
        assert_run(&e.c[i], 1, n);
    for (int k = 0; k < K; k++) {
        tdp_op_free(op[k]);
        tdp_td_unref(td[k]);
    }
    tdp_schema_unref(s);
}

/* A consumer that joins late starts at the next message. */
static void test_late_joiner(void **state)
{
    (void)state;
    env e;
    const uint64_t n = 100;
    env_up(&e, NULL);
    add_consumer(&e, n, 0);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (uint64_t i = 1; i <= n; i++) {
        if (i == 51)
            add_consumer(&e, n, 0);
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    }
    tdp_fanout_peer_stats ps[MAXC];
    assert_int_equal(tdp_fanout_stats_get(e.fo, NULL, ps, MAXC), 2);
    assert_int_equal(ps[0].first_seq + ps[1].first_seq, 1 + 51);
    env_down(&e);
    assert_run(&e.c[0], 1, n);
    assert_run(&e.c[1], 51, n);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* Broadcast with nobody there: done at once, counted as unsent. */
static void test_broadcast_nobody(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    tdp_schema *s = host_bytes_schema(64);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    fill(td, 1);
    assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    tdp_fanout_stats st;
    assert_int_equal(tdp_fanout_stats_get(e.fo, &st, NULL, 0), 0);
    assert_int_equal(st.unsent, 1);
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/*
 * Distribute: every message goes to exactly one consumer, each consumer's
 * share in order; a consumer that does not receive holds no more than its
 * credit (one buffer, depth 1) and one send waiting for it, while the
 * others take the rest.
 */
static void test_distribute_credit(void **state)
{
    (void)state;
    env e;
    const uint64_t n = 300;
    tdp_fanout_opts fo;
    tdp_fanout_opts_default(&fo);
    fo.mode = TDP_FANOUT_DISTRIBUTE;
    env_up(&e, &fo);
    add_consumer(&e, n, 0);
    add_consumer(&e, n, 0);
    consumer *slow = add_consumer(&e, n, TMO); /* does not receive until woken below */
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (uint64_t i = 1; i <= n; i++) {
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    }
    tdp_fanout_peer_stats ps[MAXC];
    assert_int_equal(tdp_fanout_stats_get(e.fo, NULL, ps, MAXC), 3);
    uint64_t total = 0;
    for (int i = 0; i < 3; i++)
        total += ps[i].msgs_sent;
    assert_int_equal(total, n);
    /* the stalled one: one message in its buffer, at most one more that its pipe took */
    print_message("shares %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", ps[0].msgs_sent, ps[1].msgs_sent,
                  ps[2].msgs_sent);
    assert_true(ps[2].msgs_sent <= 2);
    assert_true(ps[0].msgs_sent > 0 && ps[1].msgs_sent > 0);
    atomic_store(&slow->wake, true);
    env_down(&e);
    bool *seen = calloc(n + 1, sizeof(bool));
    for (int i = 0; i < 3; i++) {
        for (uint64_t k = 0; k < e.c[i].n; k++) {
            assert_false(seen[e.c[i].seqs[k]]);
            seen[e.c[i].seqs[k]] = true;
            if (k > 0)
                assert_true(e.c[i].seqs[k] > e.c[i].seqs[k - 1]);
        }
    }
    for (uint64_t i = 1; i <= n; i++)
        assert_true(seen[i]);
    free(seen);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/*
 * Drop-oldest: a consumer that does not receive loses messages (counted)
 * and stops nobody; what it does get is in order, and what it got plus
 * what it lost is everything.
 */
static void test_drop_oldest(void **state)
{
    (void)state;
    env e;
    const uint64_t n = 200;
    tdp_fanout_opts fo;
    tdp_fanout_opts_default(&fo);
    fo.slow = TDP_FANOUT_DROP_OLDEST;
    env_up(&e, &fo);
    add_consumer(&e, n, 0);
    consumer *slow = add_consumer(&e, n, TMO);
    tdp_schema *s = host_bytes_schema(NBYTES);
    int64_t t0 = mono_ms();
    for (uint64_t i = 1; i <= n; i++) {
        tdp_td *td; /* a fresh buffer each time: lagging consumers may still hold the last */
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
        tdp_td_unref(td);
    }
    assert_true(mono_ms() - t0 < TMO); /* the stalled consumer did not hold the producer */
    tdp_fanout_peer_stats ps[MAXC];
    tdp_fanout_stats st;
    assert_int_equal(tdp_fanout_stats_get(e.fo, &st, ps, MAXC), 2);
    print_message("drops: fast %" PRIu64 ", stalled %" PRIu64 "\n", ps[0].drops, ps[1].drops);
    /* the stalled one holds at most depth queued, one in its buffer and one in its pipe */
    assert_true(ps[1].drops >= n - fo.depth - 2);
    assert_int_equal(ps[0].drops, 0); /* the fastest sets the pace: it loses nothing */
    assert_int_equal(st.drops, ps[0].drops + ps[1].drops);
    atomic_store(&slow->wake, true);
    env_down(&e);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(e.c[i].n + ps[i].drops, n);
        for (uint64_t k = 1; k < e.c[i].n; k++)
            assert_true(e.c[i].seqs[k] > e.c[i].seqs[k - 1]);
    }
    tdp_schema_unref(s);
}

/* A consumer that leaves (removed) gets what it held and a clean end. */
static void test_remove(void **state)
{
    (void)state;
    env e;
    const uint64_t n = 60;
    env_up(&e, NULL);
    add_consumer(&e, n, 0);
    add_consumer(&e, n, 0);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    tdp_fanout_peer_stats ps[MAXC];
    for (uint64_t i = 1; i <= n; i++) {
        if (i == 31) {
            assert_int_equal(tdp_fanout_stats_get(e.fo, NULL, ps, MAXC), 2);
            assert_int_equal(tdp_fanout_remove(e.fo, ps[1].id), TDP_OK);
        }
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    }
    assert_int_equal(tdp_fanout_remove(e.fo, 999), TDP_EINVAL);
    pthread_join(e.c[1].th, NULL); /* its stream ended cleanly after message 30 */
    e.c[1].joined = true;
    assert_int_equal(e.c[1].end, TDP_ECLOSED);
    assert_run(&e.c[1], 1, 30);
    wait_consumers(&e, 1);
    tdp_fanout_stats st;
    tdp_fanout_stats_get(e.fo, &st, NULL, 0);
    assert_int_equal(st.left, 1);
    assert_int_equal(st.failed, 0);
    env_down(&e);
    assert_run(&e.c[0], 1, n);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* Zero library allocations per message once every consumer is there. */
static void test_zero_alloc(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    for (int i = 0; i < 2; i++)
        add_consumer(&e, 400, 0);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    uint64_t a0 = 0;
    for (uint64_t i = 1; i <= 400; i++) {
        if (i == 101)
            a0 = tdp_mem_total_allocs();
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    }
    uint64_t a1 = tdp_mem_total_allocs();
    print_message("library allocations in 300 steady messages: %" PRIu64 "\n", a1 - a0);
    assert_int_equal(a1 - a0, 0);
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/*
 * Consumers that listen: the fan-out dials them (tdp_fanout_connect) and
 * is handed a pipe (tdp_fanout_add); a pipe of another loop is refused.
 */
static void test_dial_and_add(void **state)
{
    (void)state;
    env e;
    const uint64_t n = 50;
    env_up(&e, NULL);
    tdp_pipe_opts o = popts();
    tdp_listener *l;
    assert_int_equal(tdp_listener_new(e.cl, "127.0.0.1", 0, &o, NULL, NULL, &l), TDP_OK);
    uint16_t lport = tdp_listener_port(l);
    uint64_t id1 = 0, id2 = 0;
    assert_int_equal(tdp_fanout_connect(e.fo, "127.0.0.1", lport, &o, &id1), TDP_OK);
    tdp_pipe *mine;
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", lport, &o, &mine), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &e.c[0].pipe), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &e.c[1].pipe), TDP_OK);
    /* a pipe on the consumers' loop, not the fan-out's */
    assert_int_equal(tdp_fanout_add(e.fo, e.c[0].pipe, &id2), TDP_EINVAL);
    assert_int_equal(tdp_fanout_add(e.fo, mine, &id2), TDP_OK);
    assert_true(id1 != 0 && id2 != 0 && id1 != id2);
    for (int i = 0; i < 2; i++) {
        e.c[i].max = n;
        assert_int_equal(pthread_create(&e.c[i].th, NULL, consumer_main, &e.c[i]), 0);
    }
    e.nc = 2;
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (uint64_t i = 1; i <= n; i++) {
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    }
    tdp_listener_free(l);
    env_down(&e);
    for (int i = 0; i < 2; i++)
        assert_run(&e.c[i], 1, n);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* ---- kill one of four consumers, each its own process ------------------------------ */

/* A consumer process: connect, receive until the end, exit 0 if it got 1..n in order. */
static int child_main(int rfd, uint64_t n)
{
    uint16_t port;
    if (read(rfd, &port, sizeof(port)) != sizeof(port))
        return 2;
    tdp_loop *l;
    tdp_pipe *p;
    tdp_pipe_opts o = popts();
    if (tdp_loop_new(NULL, &l) != TDP_OK || tdp_loop_start_thread(l) != TDP_OK ||
        tdp_pipe_connect(l, "127.0.0.1", port, &o, &p) != TDP_OK)
        return 3;
    uint64_t want = 1;
    tdp_td *td;
    tdp_err rc;
    while ((rc = tdp_pipe_recv(p, TMO, &td)) == TDP_OK) {
        if (check(td) != want)
            return 4;
        want++;
    }
    int code = rc == TDP_ECLOSED && want == n + 1 ? 0 : 5;
    tdp_pipe_free(p);
    tdp_loop_free(l);
    return code;
}

static void test_kill_one_of_four(void **state)
{
    (void)state;
    enum { NC = 4 };
    const uint64_t n = 400;
    int rounds = getenv("TDP_FANOUT_KILL_ROUNDS") ? atoi(getenv("TDP_FANOUT_KILL_ROUNDS")) : 2;
    for (int r = 0; r < rounds; r++) {
        pid_t pid[NC];
        int wfd[NC];
        for (int i = 0; i < NC; i++) {
            int fds[2];
            assert_int_equal(pipe(fds), 0);
            pid[i] = fork();
            assert_true(pid[i] >= 0);
            if (pid[i] == 0) {
                close(fds[1]);
                _exit(child_main(fds[0], n));
            }
            close(fds[0]);
            wfd[i] = fds[1];
        }
        env e;
        env_up(&e, NULL);
        for (int i = 0; i < NC; i++) {
            assert_int_equal(write(wfd[i], &e.port, sizeof(e.port)), (ssize_t)sizeof(e.port));
            close(wfd[i]);
        }
        wait_consumers(&e, NC);
        tdp_schema *s = host_bytes_schema(NBYTES);
        tdp_td *td;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        int victim = r % NC;
        for (uint64_t i = 1; i <= n; i++) {
            if (i == n / 3)
                kill(pid[victim], SIGKILL);
            fill(td, i);
            assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
        }
        assert_int_equal(tdp_fanout_close(e.fo, TMO), TDP_OK);
        for (int i = 0; i < NC; i++) {
            int st;
            assert_int_equal(waitpid(pid[i], &st, 0), pid[i]);
            if (i == victim) {
                assert_true(WIFSIGNALED(st));
            } else {
                assert_true(WIFEXITED(st));
                assert_int_equal(WEXITSTATUS(st), 0);
            }
        }
        tdp_fanout_stats fst;
        tdp_fanout_stats_get(e.fo, &fst, NULL, 0);
        assert_int_equal(fst.joined, NC);
        assert_int_equal(fst.failed, 1);
        tdp_fanout_free(e.fo);
        tdp_loop_free(e.cl);
        tdp_loop_free(e.pl);
        tdp_td_unref(td);
        tdp_schema_unref(s);
    }
}

/* ---- the shm plane: one pool for every consumer ------------------------------------ */

static bool on_shm(void)
{
    const char *n = getenv("TDP_TEST_PLANE");
    return n != NULL && strcmp(n, "shm") == 0;
}

/*
 * Where p lies in this process's memfd mappings: the file (device and
 * inode) and the offset in it; false when in none.
 */
static bool memfd_at(const void *p, unsigned long *ino, unsigned long *off)
{
    FILE *f = fopen("/proc/self/maps", "r");
    assert_non_null(f);
    char line[512];
    bool found = false;
    while (!found && fgets(line, sizeof(line), f) != NULL) {
        unsigned long a, b, o, in;
        if (strstr(line, "/memfd:") == NULL ||
            sscanf(line, "%lx-%lx %*s %lx %*s %lu", &a, &b, &o, &in) != 4)
            continue;
        if ((uintptr_t)p >= a && (uintptr_t)p < b) {
            *ino = in;
            *off = o + ((uintptr_t)p - a);
            found = true;
        }
    }
    fclose(f);
    return found;
}

/* The memfds this process maps that are larger than min bytes: how many, and their bytes. */
static uint32_t memfd_pools(unsigned long min, unsigned long *bytes)
{
    FILE *f = fopen("/proc/self/maps", "r");
    assert_non_null(f);
    unsigned long seen[64];
    uint32_t n = 0;
    *bytes = 0;
    char line[512];
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned long a, b, in;
        if (strstr(line, "/memfd:tdpipe") == NULL ||
            sscanf(line, "%lx-%lx %*s %*s %*s %lu", &a, &b, &in) != 3 || b - a < min)
            continue;
        bool dup = false;
        for (uint32_t i = 0; i < n; i++)
            dup |= seen[i] == in;
        if (!dup && n < 64) {
            seen[n++] = in;
            *bytes += b - a;
        }
    }
    fclose(f);
    return n;
}

/*
 * Broadcast to 1, 2 and 4 consumer processes: the producer maps one pool,
 * of the same bytes, whatever their number (each had its own before).
 */
static void test_shm_one_pool(void **state)
{
    (void)state;
    if (!on_shm())
        skip();
    const uint64_t n = 50;
    const int64_t big = 256 * 1024; /* pools stand out from the control segments */
    unsigned long bytes1 = 0;
    for (int nc = 1; nc <= 4; nc *= 2) {
        pid_t pid[4];
        int wfd[4];
        for (int i = 0; i < nc; i++) {
            int fds[2];
            assert_int_equal(pipe(fds), 0);
            pid[i] = fork();
            assert_true(pid[i] >= 0);
            if (pid[i] == 0) {
                close(fds[1]);
                _exit(child_main(fds[0], n));
            }
            close(fds[0]);
            wfd[i] = fds[1];
        }
        env e;
        env_up(&e, NULL);
        for (int i = 0; i < nc; i++) {
            assert_int_equal(write(wfd[i], &e.port, sizeof(e.port)), (ssize_t)sizeof(e.port));
            close(wfd[i]);
        }
        wait_consumers(&e, (uint32_t)nc);
        tdp_schema *s = host_bytes_schema(big);
        tdp_td *td;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        for (uint64_t i = 1; i <= n; i++) {
            fill(td, i);
            assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
        }
        unsigned long bytes;
        uint32_t pools = memfd_pools(big, &bytes);
        print_message("%d consumer(s): %u pool(s), %lu bytes\n", nc, pools, bytes);
        assert_int_equal(pools, 1);
        if (nc == 1)
            bytes1 = bytes;
        assert_int_equal(bytes, bytes1);
        assert_int_equal(tdp_fanout_close(e.fo, TMO), TDP_OK);
        for (int i = 0; i < nc; i++) {
            int st;
            assert_int_equal(waitpid(pid[i], &st, 0), pid[i]);
            assert_true(WIFEXITED(st));
            assert_int_equal(WEXITSTATUS(st), 0);
        }
        tdp_fanout_free(e.fo);
        tdp_loop_free(e.cl);
        tdp_loop_free(e.pl);
        tdp_td_unref(td);
        tdp_schema_unref(s);
    }
}

/* Consumers received by the test thread itself: dial nc of them, of receive depth depth. */
static void dial_bare(env *e, int nc, uint32_t depth)
{
    for (int i = 0; i < nc; i++) {
        tdp_pipe_opts o = popts();
        o.recv_depth = depth;
        assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", e->port, &o, &e->c[i].pipe), TDP_OK);
        e->nc++;
        wait_consumers(e, (uint32_t)e->nc);
    }
}

/* The consumers go first (the test thread cannot receive their end while it closes). */
static void bare_down(env *e)
{
    for (int i = 0; i < e->nc; i++)
        tdp_pipe_free(e->c[i].pipe);
    assert_int_equal(tdp_fanout_close(e->fo, TMO), TDP_OK);
    tdp_fanout_free(e->fo);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->pl);
}

/* A loan of the fan-out, or TDP_EAGAIN for a bounded while (the sockets come up). */
static tdp_err loan_retry(tdp_fanout *fo, tdp_schema *s, tdp_td **out)
{
    tdp_err rc = TDP_EAGAIN;
    for (int64_t end = mono_ms() + TMO; rc == TDP_EAGAIN && mono_ms() < end; usleep(1000))
        rc = tdp_fanout_loan(fo, s, out);
    return rc;
}

/*
 * A loan goes to every consumer without a copy, and a plain send is copied
 * once: each consumer's view is the same bytes of the same memfd.
 */
static void test_shm_loan_zero_copy(void **state)
{
    (void)state;
    if (!on_shm())
        skip();
    enum { NC = 3 };
    env e;
    env_up(&e, NULL);
    dial_bare(&e, NC, 1);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_op *op;
    assert_int_equal(tdp_op_new(NULL, NULL, &op), TDP_OK);
    for (uint64_t i = 1; i <= 6; i++) {
        tdp_td *td;
        unsigned long ino0, off0;
        bool loaned = i % 2 == 1;
        if (loaned) {
            assert_int_equal(loan_retry(e.fo, s, &td), TDP_OK);
            assert_true(memfd_at(tdp_td_data(td), &ino0, &off0)); /* a slot of the pool */
        } else {
            assert_int_equal(tdp_td_new(s, &td), TDP_OK);
            assert_false(memfd_at(tdp_td_data(td), &ino0, &off0));
        }
        fill(td, i);
        /* async: a consumer gives the last message back at its next receive */
        tdp_fanout_send_async(e.fo, td, op);
        tdp_td *got[NC];
        for (int c = 0; c < NC; c++) {
            assert_int_equal(tdp_pipe_recv(e.c[c].pipe, TMO, &got[c]), TDP_OK);
            assert_int_equal(check(got[c]), i);
            unsigned long ino, off;
            assert_true(memfd_at(tdp_td_data(got[c]), &ino, &off));
            if (c == 0 && !loaned) {
                ino0 = ino;
                off0 = off;
            }
            assert_int_equal(ino, ino0);
            assert_int_equal(off, off0);
        }
        for (int64_t end = mono_ms() + TMO; tdp_op_result(op) == TDP_EAGAIN && mono_ms() < end;)
            usleep(1000);
        assert_int_equal(tdp_op_result(op), TDP_OK);
        tdp_td_unref(td); /* got[]: lent, given back by the next receive (depth 1) */
    }
    bare_down(&e); /* then the op: its completion may still be on the loop thread */
    tdp_op_free(op);
    tdp_schema_unref(s);
}

/*
 * Broadcast to consumers that grant receive windows: those whose window is
 * the group's, or larger (it keeps to the group's), take every loan from
 * one pool without a copy; one whose window is smaller cannot map the
 * group's pools and gets a copy in a pool of its own. Every message
 * arrives, in order, and no consumer fails.
 */
static void test_shm_window_group(void **state)
{
    (void)state;
    if (!on_shm())
        skip();
    enum { NC = 3, N = 40 };
    static const uint64_t win[NC] = {256u << 10, 1u << 20, 64u << 10};
    const int64_t size = 16 * 1024; /* 16 in flight in 256 KiB, 64 in 1 MiB, 4 in 64 KiB */
    env e;
    env_up(&e, NULL);
    for (int i = 0; i < NC; i++) {
        tdp_pipe_opts o = popts();
        o.recv_window_bytes = win[i];
        assert_int_equal(tdp_pipe_connect(e.cl, "127.0.0.1", e.port, &o, &e.c[i].pipe), TDP_OK);
        e.nc++;
        wait_consumers(&e, (uint32_t)e.nc);
    }
    tdp_schema *s = host_bytes_schema(size);
    tdp_op *op;
    assert_int_equal(tdp_op_new(NULL, NULL, &op), TDP_OK);
    for (uint64_t i = 1; i <= N; i++) {
        tdp_td *td;
        unsigned long ino0, off0;
        assert_int_equal(loan_retry(e.fo, s, &td), TDP_OK);
        assert_true(memfd_at(tdp_td_data(td), &ino0, &off0));
        fill(td, i);
        tdp_fanout_send_async(e.fo, td, op);
        for (int c = 0; c < NC; c++) {
            tdp_td *got;
            assert_int_equal(tdp_pipe_recv(e.c[c].pipe, TMO, &got), TDP_OK);
            assert_int_equal(check(got), i);
            unsigned long ino, off;
            assert_true(memfd_at(tdp_td_data(got), &ino, &off));
            assert_true(c < 2 ? ino == ino0 && off == off0 : ino != ino0);
        }
        for (int64_t end = mono_ms() + TMO; tdp_op_result(op) == TDP_EAGAIN && mono_ms() < end;)
            usleep(1000);
        assert_int_equal(tdp_op_result(op), TDP_OK);
        tdp_td_unref(td);
    }
    tdp_fanout_stats st;
    tdp_fanout_stats_get(e.fo, &st, NULL, 0);
    assert_int_equal(st.failed, 0);
    bare_down(&e);
    tdp_op_free(op);
    tdp_schema_unref(s);
}

typedef struct rogue_rel {
    tdp__link *l;
    tdp__shm_desc d;
    tdp_err rc;
} rogue_rel;

/* The same release twice, at once: the first gives the slot back, the second is a lie. */
static void rogue_rel_task(void *arg)
{
    rogue_rel *r = arg;
    r->rc = tdp__shm_rogue_release(r->l, &r->d);
    if (r->rc == TDP_OK)
        r->rc = tdp__shm_rogue_release(r->l, &r->d);
}

/*
 * A consumer that gives back a slot it does not hold (another consumer
 * holds it) is refused: its pipe fails, the slot stays held, and the
 * others go on.
 */
static void test_shm_release_refused(void **state)
{
    (void)state;
    if (!on_shm())
        skip();
    env e;
    env_up(&e, NULL);
    dial_bare(&e, 2, 4); /* consumer 0 holds a message while it receives others */
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    fill(td, 1);
    assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    tdp_td *held, *other;
    assert_int_equal(tdp_pipe_recv(e.c[0].pipe, TMO, &held), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.c[1].pipe, TMO, &other), TDP_OK);
    /* consumer 0 keeps it; consumer 1 gives it back, and then again */
    /* the first message of a fresh pool (generation 1) is in its slot 0 */
    rogue_rel r = {
        .l = tdp__session_link(e.c[1].pipe),
        .d = {.type = tdp__shm_desc_word(TDP__SHM_DESC_RELEASE, 1), .slot = 0, .seq = 1}};
    tdp__call_on_loop(e.cl, rogue_rel_task, &r);
    assert_int_equal(r.rc, TDP_OK);
    /* consumer 0 goes on; the slot it holds is not written again (the
     * producer reads the second release by its next send at the latest) */
    for (uint64_t i = 2; i <= 20; i++) {
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
        tdp_td *got;
        assert_int_equal(tdp_pipe_recv(e.c[0].pipe, TMO, &got), TDP_OK);
        assert_int_equal(check(got), i);
        tdp_pipe_release(e.c[0].pipe, got);
        assert_int_equal(check(held), 1);
    }
    tdp_fanout_stats st;
    int64_t end = mono_ms() + TMO;
    for (tdp_fanout_stats_get(e.fo, &st, NULL, 0); st.failed == 0 && mono_ms() < end;
         tdp_fanout_stats_get(e.fo, &st, NULL, 0))
        usleep(2000);
    assert_int_equal(st.failed, 1);
    tdp_pipe_release(e.c[0].pipe, held);
    bare_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* ---- GPU broadcasts to shm consumers: each link stages its own copy -------------- */

typedef struct gpu_consumer {
    pthread_t th;
    tdp_pipe *pipe;
    int hold;     /* views kept at once (its loans) */
    int sleep_us; /* after each receive: a slow consumer */
    uint64_t seqs[256];
    uint64_t n;
    tdp_err end;
} gpu_consumer;

/* The seq in a device message's first 8 bytes. */
static uint64_t gpu_seq(const tdp_td *td)
{
    uint64_t seq = 0;
    if (tdp_td_device(td).type == TDP_DEVICE_CPU)
        memcpy(&seq, tdp_td_data(td), 8);
    else if (tdp__cuda_memcpy(&seq, tdp_td_data(td), 8) != TDP_OK)
        return 0;
    return seq;
}

static void *gpu_consumer_main(void *arg)
{
    gpu_consumer *c = arg;
    tdp_td *held[8] = {0};
    for (uint64_t i = 0;; i++) {
        tdp_td *td;
        tdp_err rc = tdp_pipe_recv(c->pipe, TMO, &td);
        if (rc != TDP_OK) {
            c->end = rc;
            break;
        }
        if (c->n < 256)
            c->seqs[c->n++] = gpu_seq(td);
        tdp_td **slot = &held[i % (uint64_t)c->hold];
        if (*slot != NULL)
            tdp_pipe_release(c->pipe, *slot);
        *slot = td;
        if (c->sleep_us > 0)
            usleep((useconds_t)c->sleep_us);
    }
    for (int k = 0; k < c->hold; k++)
        if (held[k] != NULL)
            tdp_pipe_release(c->pipe, held[k]);
    tdp_pipe_free(c->pipe);
    c->pipe = NULL;
    return NULL;
}

/*
 * A GPU broadcast to four shm consumers (fake device), a deep stream, one
 * consumer slow and holding its loans: each consumer's link stages the
 * message into a slot of the pool they share, so every slot can be held at
 * once. That must mean wait (block) or drops (drop-oldest), never a failed
 * consumer (TDP_EINTERNAL).
 */
static void test_shm_gpu_slots_held(void **state)
{
    (void)state;
    if (!on_shm())
        skip();
    enum { NC = 4, DEPTH = 4 };
    const uint64_t n = 120;
    const int64_t nbytes = 64 * 1024;
    assert_int_equal(tdp__cuda_select("fake"), TDP_OK);
    tdp__cuda_fake_set_delay_us(200); /* copies land after they are queued */
    for (int slow = 0; slow < 2; slow++) {
        tdp_fanout_opts fo;
        tdp_fanout_opts_default(&fo);
        fo.depth = 16;
        fo.slow = slow == 0 ? TDP_FANOUT_BLOCK : TDP_FANOUT_DROP_OLDEST;
        env e;
        env_up(&e, &fo);
        gpu_consumer gc[NC];
        memset(gc, 0, sizeof(gc));
        for (int i = 0; i < NC; i++) {
            tdp_pipe_opts o = popts();
            o.recv_depth = DEPTH;
            assert_int_equal(tdp_pipe_connect(e.cl, "127.0.0.1", e.port, &o, &gc[i].pipe),
                             TDP_OK);
            wait_consumers(&e, (uint32_t)i + 1);
            gc[i].hold = i == 0 ? DEPTH - 1 : 1; /* all of them would stop its own pipe */
            gc[i].sleep_us = i == 0 ? 3000 : 0;
            assert_int_equal(pthread_create(&gc[i].th, NULL, gpu_consumer_main, &gc[i]), 0);
        }
        tdp_schema_builder *b;
        tdp_schema *s;
        assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
        assert_int_equal(tdp_schema_builder_set_device(b, (tdp_device){TDP_DEVICE_CUDA, 0}),
                         TDP_OK);
        assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &nbytes), TDP_OK);
        assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
        tdp_schema_builder_free(b);
        for (uint64_t i = 1; i <= n; i++) {
            tdp_td *td; /* fresh each time: drop-oldest completes a send once queued */
            assert_int_equal(tdp_td_new(s, &td), TDP_OK);
            assert_int_equal(tdp__cuda_memcpy(tdp_td_data(td), &i, 8), TDP_OK);
            assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
            tdp_td_unref(td);
        }
        tdp_fanout_stats st;
        tdp_fanout_peer_stats ps[MAXC];
        uint32_t there = tdp_fanout_stats_get(e.fo, &st, ps, MAXC);
        print_message("%s: consumers %u, failed %" PRIu64 ", drops %" PRIu64 "\n",
                      slow == 0 ? "block" : "drop-oldest", there, st.failed, st.drops);
        assert_int_equal(st.failed, 0);
        assert_int_equal(there, NC);
        assert_int_equal(tdp_fanout_close(e.fo, TMO), TDP_OK);
        for (int i = 0; i < NC; i++) {
            pthread_join(gc[i].th, NULL);
            assert_int_equal(gc[i].end, TDP_ECLOSED);
            if (slow == 0)
                assert_int_equal(gc[i].n, n);
            for (uint64_t k = 0; k < gc[i].n; k++) {
                assert_true(gc[i].seqs[k] >= 1 && gc[i].seqs[k] <= n);
                if (k > 0)
                    assert_true(gc[i].seqs[k] > gc[i].seqs[k - 1]);
                if (slow == 0)
                    assert_int_equal(gc[i].seqs[k], k + 1);
            }
        }
        tdp_fanout_free(e.fo);
        tdp_loop_free(e.cl);
        tdp_loop_free(e.pl);
        tdp_schema_unref(s);
    }
    tdp__cuda_fake_set_delay_us(0);
}

static void tid_task(void *arg)
{
    *(long *)arg = syscall(SYS_gettid);
}

/* Voluntary context switches of thread tid of this process so far: its sleeps. */
static long thread_sleeps(long tid)
{
    char path[64], line[128];
    snprintf(path, sizeof(path), "/proc/self/task/%ld/status", tid);
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    long n = -1;
    while (fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "voluntary_ctxt_switches: %ld", &n) == 1)
            break;
    fclose(f);
    return n;
}

/*
 * A broadcast waiting for a free slot of the shm group is woken by the
 * release that frees one (a consumer's credit), not by a timer: while
 * nothing is released the producer's loop sleeps (about the loop's own
 * 10 ms safety timer, where a 1 ms retry made it wake 300 times in 300 ms),
 * and the send goes as soon as a consumer gives a slot back.
 */
static void test_shm_wait_woken(void **state)
{
    (void)state;
    if (!on_shm())
        skip();
    enum { NC = 2, NM = 4 };
    env e;
    env_up(&e, NULL);
    dial_bare(&e, NC, 1);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_op *op[NM];
    tdp_td *td[NM];
    for (int i = 0; i < NM; i++) {
        assert_int_equal(tdp_op_new(NULL, NULL, &op[i]), TDP_OK);
        assert_int_equal(tdp_td_new(s, &td[i]), TDP_OK);
        fill(td[i], (uint64_t)i + 1);
    }
    /* the first makes the group (the sockets come up); then the pool's three slots
     * go to the next two and the first, and the fourth finds none */
    tdp_td *got[NC];
    tdp_fanout_send_async(e.fo, td[0], op[0]);
    for (int c = 0; c < NC; c++) {
        assert_int_equal(tdp_pipe_recv(e.c[c].pipe, TMO, &got[c]), TDP_OK);
        assert_int_equal(check(got[c]), 1);
    }
    for (int i = 1; i < NM; i++)
        tdp_fanout_send_async(e.fo, td[i], op[i]);
    usleep(100 * 1000);
    assert_int_equal(tdp_op_result(op[NM - 1]), TDP_EAGAIN);
    long tid = 0;
    tdp__call_on_loop(e.pl, tid_task, &tid);
    long before = thread_sleeps(tid);
    usleep(300 * 1000);
    long slept = thread_sleeps(tid) - before;
    print_message("producer loop: %ld wakeups in 300 ms of waiting\n", slept);
    assert_int_equal(tdp_op_result(op[NM - 1]), TDP_EAGAIN);
    assert_true(slept < 100);
    /* each consumer takes the rest: its releases free slots, the last send goes */
    for (uint64_t i = 2; i <= NM; i++) {
        for (int c = 0; c < NC; c++) {
            assert_int_equal(tdp_pipe_recv(e.c[c].pipe, TMO, &got[c]), TDP_OK);
            assert_int_equal(check(got[c]), i);
        }
    }
    for (int i = 0; i < NM; i++) {
        for (int64_t end = mono_ms() + TMO; tdp_op_result(op[i]) == TDP_EAGAIN && mono_ms() < end;)
            usleep(1000);
        assert_int_equal(tdp_op_result(op[i]), TDP_OK);
    }
    bare_down(&e);
    for (int i = 0; i < NM; i++) {
        tdp_op_free(op[i]);
        tdp_td_unref(td[i]);
    }
    tdp_schema_unref(s);
}

/* ---- closing with consumers in this process ----------------------------------- */

#define CLOSE_MS 3000 /* the fan-out's close timeout here: reached only when a close hangs */

/* What the consumers of this process do around the fan-out's close. */
enum end_order {
    END_CLOSE_AFTER, /* receive until TDP_ECLOSED, then close their pipe (freed later) */
    END_CLOSE_FIRST, /* close their pipe before the fan-out closes */
    END_FREE_FIRST,  /* free their pipe before the fan-out closes */
};

typedef struct closer {
    pthread_t th;
    tdp_pipe *pipe;
    uint64_t want; /* receive this many, then stop; 0: until the end */
    uint64_t n;
    tdp_err end;      /* how its receives ended (TDP_OK: it stopped at want) */
    tdp_err close_rc; /* its tdp_pipe_close (TDP_EAGAIN: not called) */
    bool bad;
} closer;

static void *closer_main(void *arg)
{
    closer *c = arg;
    c->end = TDP_OK;
    c->close_rc = TDP_EAGAIN;
    while (c->want == 0 || c->n < c->want) {
        tdp_td *td;
        tdp_err rc = tdp_pipe_recv(c->pipe, TMO, &td);
        if (rc != TDP_OK) {
            /* the user's clean end: close (not free) after TDP_ECLOSED */
            c->end = rc;
            c->close_rc = tdp_pipe_close(c->pipe, CLOSE_MS);
            return NULL;
        }
        c->bad |= check(td) != c->n + 1;
        c->n++;
    }
    return NULL;
}

/*
 * Two consumers in this process, on their own loop, each drained by a
 * thread of its own; the fan-out closes in one of the orders a user
 * picks. Every order ends cleanly and at once: the close returns TDP_OK
 * well within its timeout and every consumer is gone.
 */
static void close_in_process(enum end_order order)
{
    enum { NC = 2, NM = 10 };
    env e;
    env_up(&e, NULL);
    closer c[NC];
    memset(c, 0, sizeof(c));
    for (int i = 0; i < NC; i++) {
        tdp_pipe_opts o = popts();
        assert_int_equal(tdp_pipe_connect(e.cl, "127.0.0.1", e.port, &o, &c[i].pipe), TDP_OK);
        wait_consumers(&e, (uint32_t)i + 1);
        c[i].want = order == END_CLOSE_AFTER ? 0 : NM;
        assert_int_equal(pthread_create(&c[i].th, NULL, closer_main, &c[i]), 0);
    }
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (uint64_t i = 1; i <= NM; i++) {
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, TMO), TDP_OK);
    }
    tdp_err first_rc[NC];
    for (int i = 0; i < NC && order != END_CLOSE_AFTER; i++) {
        pthread_join(c[i].th, NULL);
        first_rc[i] = TDP_OK;
        if (order == END_CLOSE_FIRST) {
            first_rc[i] = tdp_pipe_close(c[i].pipe, CLOSE_MS);
        } else {
            tdp_pipe_free(c[i].pipe);
            c[i].pipe = NULL;
        }
    }
    int64_t t0 = mono_ms();
    tdp_err rc = tdp_fanout_close(e.fo, CLOSE_MS);
    int64_t took = mono_ms() - t0;
    for (int i = 0; i < NC && order == END_CLOSE_AFTER; i++)
        pthread_join(c[i].th, NULL);
    tdp_fanout_stats st;
    tdp_fanout_stats_get(e.fo, &st, NULL, 0);
    for (int i = 0; i < NC; i++)
        tdp_pipe_free(c[i].pipe);
    tdp_fanout_free(e.fo);
    tdp_loop_free(e.cl);
    tdp_loop_free(e.pl);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    print_message("order %d: tdp_fanout_close %s in %" PRId64 " ms\n", (int)order, tdp_strerror(rc),
                  took);
    assert_int_equal(rc, TDP_OK);
    assert_true(took < CLOSE_MS / 2);
    assert_int_equal(st.consumers, 0);
    assert_int_equal(st.left, NC);
    /* freeing an open pipe is an abort: whether the fan-out counts it a
     * failure depends on what its link saw first (BYE or the data plane) */
    if (order != END_FREE_FIRST)
        assert_int_equal(st.failed, 0);
    for (int i = 0; i < NC; i++) {
        assert_int_equal(c[i].n, NM);
        assert_false(c[i].bad);
        if (order == END_CLOSE_AFTER) {
            assert_int_equal(c[i].end, TDP_ECLOSED);
            assert_int_equal(c[i].close_rc, TDP_OK);
        } else {
            assert_int_equal(first_rc[i], TDP_OK);
        }
    }
}

static void test_close_consumers_receiving(void **state)
{
    (void)state;
    close_in_process(END_CLOSE_AFTER);
}

static void test_close_consumers_closed_first(void **state)
{
    (void)state;
    close_in_process(END_CLOSE_FIRST);
}

static void test_close_consumers_freed_first(void **state)
{
    (void)state;
    close_in_process(END_FREE_FIRST);
}

/*
 * A consumer of this process that is alive but stopped receiving, with
 * sends waiting for its credit, cannot hold the close past its timeout:
 * TDP_ETIMEDOUT on time, then its pipe is aborted and it is gone (its side
 * sees the message it had and then the reset), and the sends it held
 * complete.
 */
static void test_close_stuck_consumer(void **state)
{
    (void)state;
    enum { NM = 3, STUCK_MS = 300 };
    env e;
    env_up(&e, NULL);
    tdp_pipe_opts o = popts();
    tdp_pipe *p;
    assert_int_equal(tdp_pipe_connect(e.cl, "127.0.0.1", e.port, &o, &p), TDP_OK);
    wait_consumers(&e, 1);
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *td[NM];
    tdp_op *op[NM];
    for (int i = 0; i < NM; i++) {
        assert_int_equal(tdp_td_new(s, &td[i]), TDP_OK);
        assert_int_equal(tdp_op_new(NULL, NULL, &op[i]), TDP_OK);
        fill(td[i], (uint64_t)i + 1);
        tdp_fanout_send_async(e.fo, td[i], op[i]);
    }
    /* the first lands in its one receive slot; the others wait for credit */
    for (int64_t end = mono_ms() + TMO; tdp_op_result(op[0]) == TDP_EAGAIN && mono_ms() < end;)
        usleep(1000);
    int64_t t0 = mono_ms();
    tdp_err rc = tdp_fanout_close(e.fo, STUCK_MS);
    int64_t took = mono_ms() - t0;
    int64_t end = mono_ms() + CLOSE_MS;
    while (consumers_now(&e) != 0 && mono_ms() < end)
        usleep(2000);
    uint32_t left = consumers_now(&e);
    bool held = false;
    for (int i = 0; i < NM; i++) {
        while (tdp_op_result(op[i]) == TDP_EAGAIN && mono_ms() < end)
            usleep(1000);
        held |= tdp_op_result(op[i]) == TDP_EAGAIN;
    }
    tdp_td *got;
    tdp_err first = tdp_pipe_recv(p, CLOSE_MS, &got);
    uint64_t seq = first == TDP_OK ? check(got) : 0;
    tdp_err then = tdp_pipe_recv(p, CLOSE_MS, &got);
    tdp_pipe_free(p);
    tdp_fanout_free(e.fo);
    tdp_loop_free(e.cl);
    tdp_loop_free(e.pl);
    for (int i = 0; i < NM; i++) {
        tdp_op_free(op[i]);
        tdp_td_unref(td[i]);
    }
    tdp_schema_unref(s);
    print_message("stuck consumer: tdp_fanout_close %s in %" PRId64 " ms; consumer %s, then %s\n",
                  tdp_strerror(rc), took, tdp_strerror(first), tdp_strerror(then));
    assert_int_equal(rc, TDP_ETIMEDOUT);
    assert_true(took >= STUCK_MS - 50 && took < STUCK_MS + 1000);
    assert_int_equal(left, 0);
    assert_false(held);
    assert_int_equal(first, TDP_OK);
    assert_int_equal(seq, 1);
    assert_int_equal(then, TDP_ECONNRESET);
}

/*
 * Drop-oldest on the shm plane: consumers that stop receiving at different
 * points, each holding its receive depth of slots of the shared pool, do
 * not stop one that keeps up — sent as copies or as loans (whose slots the
 * sends waiting for a laggard's credit hold too). The slots the laggards
 * hold are not written meanwhile, and they go on when they receive again.
 */
static void shm_drop_stalled(bool loan)
{
    enum { STALL_A = 4, STALL_B = 8, N = 24, MORE = 4 };
    tdp_fanout_opts fo;
    tdp_fanout_opts_default(&fo);
    fo.slow = TDP_FANOUT_DROP_OLDEST;
    env e;
    env_up(&e, &fo);
    dial_bare(&e, 3, 4); /* 0 and 1 stall, 2 keeps up */
    tdp_schema *s = host_bytes_schema(NBYTES);
    tdp_td *held[2][4];
    int nheld[2] = {0, 0};
    for (uint64_t i = 1; i <= N + MORE; i++) {
        tdp_td *td;
        tdp_err rc = loan ? TDP_EAGAIN : tdp_td_new(s, &td);
        for (int64_t end = mono_ms() + 5000; rc == TDP_EAGAIN && mono_ms() < end; usleep(1000))
            rc = tdp_fanout_loan(e.fo, s, &td); /* EAGAIN while the sockets come up */
        assert_int_equal(rc, TDP_OK);
        fill(td, i);
        assert_int_equal(tdp_fanout_send(e.fo, td, 5000), TDP_OK);
        tdp_td_unref(td);
        if (i == N + 1) /* the laggards let go of what they held */
            for (int c = 0; c < 2; c++)
                for (int k = 0; k < nheld[c]; k++) {
                    assert_int_equal(check(held[c][k]), (uint64_t)(c * STALL_A + k + 1));
                    tdp_pipe_release(e.c[c].pipe, held[c][k]);
                }
        tdp_td *got;
        assert_int_equal(tdp_pipe_recv(e.c[2].pipe, TMO, &got), TDP_OK);
        assert_int_equal(check(got), i);
        tdp_pipe_release(e.c[2].pipe, got);
        for (int c = 0; c < 2 && i <= N; c++) {
            if ((c == 0 && i > STALL_A) || (c == 1 && i > STALL_B))
                continue; /* stalled */
            assert_int_equal(tdp_pipe_recv(e.c[c].pipe, TMO, &got), TDP_OK);
            assert_int_equal(check(got), i);
            if (i > (uint64_t)(c * STALL_A))
                held[c][nheld[c]++] = got;
            else
                tdp_pipe_release(e.c[c].pipe, got);
        }
    }
    /* the laggards receive again: what they still queue, in order, up to the last */
    for (int c = 0; c < 2; c++) {
        uint64_t last = 0;
        while (last != N + MORE) {
            tdp_td *got;
            assert_int_equal(tdp_pipe_recv(e.c[c].pipe, TMO, &got), TDP_OK);
            uint64_t seq = check(got);
            assert_true(seq > last);
            last = seq;
            tdp_pipe_release(e.c[c].pipe, got);
        }
    }
    tdp_fanout_peer_stats ps[MAXC];
    assert_int_equal(tdp_fanout_stats_get(e.fo, NULL, ps, MAXC), 3);
    assert_int_equal(ps[2].drops, 0);
    assert_int_equal(ps[2].msgs_sent, N + MORE);
    assert_int_equal(ps[2].status, TDP_OK);
    bare_down(&e);
    tdp_schema_unref(s);
}

static void test_shm_drop_stalled(void **state)
{
    (void)state;
    if (!on_shm())
        skip();
    shm_drop_stalled(false);
    shm_drop_stalled(true);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_broadcast_order),     cmocka_unit_test(test_broadcast_order_window),
        cmocka_unit_test(test_broadcast_async),     cmocka_unit_test(test_late_joiner),
        cmocka_unit_test(test_broadcast_nobody),    cmocka_unit_test(test_distribute_credit),
        cmocka_unit_test(test_drop_oldest),         cmocka_unit_test(test_remove),
        cmocka_unit_test(test_zero_alloc),          cmocka_unit_test(test_dial_and_add),
        cmocka_unit_test(test_kill_one_of_four),    cmocka_unit_test(test_shm_one_pool),
        cmocka_unit_test(test_shm_loan_zero_copy),  cmocka_unit_test(test_shm_window_group),
        cmocka_unit_test(test_shm_release_refused), cmocka_unit_test(test_shm_gpu_slots_held),
        cmocka_unit_test(test_shm_wait_woken),
        cmocka_unit_test(test_close_consumers_receiving),
        cmocka_unit_test(test_close_consumers_closed_first),
        cmocka_unit_test(test_close_consumers_freed_first),
        cmocka_unit_test(test_close_stuck_consumer),
        cmocka_unit_test(test_shm_drop_stalled),
    };
    if (getenv("TDP_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TDP_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
