/*
 * test_checksum: the optional payload checksum (tdp_pipe_opts.checksum),
 * run once per data plane (TDP_TEST_PLANE, tests/CMakeLists.txt).
 *
 * A hook in the sending plane (tdp__sum_set_corrupt_hook) changes the
 * bytes of every other message after their sum is taken, as a fault on
 * the way would. Every corrupted message must come out of tdp_pipe_recv
 * as TDP_ECHECKSUM, every clean one intact, in order: a corrupted message
 * handed out as TDP_OK is counted as undetected, and there must be none.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <inttypes.h>
#include <time.h>

#include <cmocka.h>
#include <tdpipe/tdpipe.h>

#include "pipe/checksum.h"
#include "test_util.h"

#define TMO 20000 /* ms: bound on any single wait */

/* A pattern that depends on the sequence number: any changed byte fails it. */
static uint64_t pattern(uint64_t seq, uint64_t i)
{
    uint64_t x = seq * 0x9E3779B97F4A7C15ull ^ (i + 1) * 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 29);
}

static void fill(tdp_td *td, uint64_t seq)
{
    uint8_t *p = tdp_td_data(td);
    for (uint64_t i = 0; i < tdp_td_nbytes(td); i++)
        p[i] = (uint8_t)pattern(seq, i);
}

static bool intact(const tdp_td *td, uint64_t seq)
{
    const uint8_t *p = tdp_td_data(td);
    for (uint64_t i = 0; i < tdp_td_nbytes(td); i++)
        if (p[i] != (uint8_t)pattern(seq, i))
            return false;
    return true;
}

/* ---- the corruption hook (runs on the sending pipe's loop thread) ---------- */

static atomic_uint_fast64_t corrupted; /* messages the hook changed */
static atomic_uint_fast64_t hooked;    /* messages the hook saw */
static uint64_t rng = 0x243F6A8885A308D3ull;

static uint64_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/*
 * Every odd message is changed, in one of four ways faults take: one bit,
 * a few scattered bytes, a burst of bytes, two 8-byte words swapped (the
 * same bytes, in another order). Each way is sure to change the buffer.
 */
static void corrupt(void *buf, size_t len, uint64_t seq, void *arg)
{
    (void)arg;
    atomic_fetch_add(&hooked, 1);
    if (seq % 2 == 0 || len < 16)
        return;
    uint8_t *p = buf;
    switch (next_rand() % 4) {
    case 0:
        p[next_rand() % len] ^= (uint8_t)(1u << (next_rand() % 8));
        break;
    case 1:
        for (int k = 1 + (int)(next_rand() % 8); k > 0; k--)
            p[next_rand() % len] ^= (uint8_t)(1 + next_rand() % 255);
        break;
    case 2: {
        size_t n = 2 + next_rand() % 32, at = next_rand() % (len - n + 1);
        for (size_t i = 0; i < n; i++)
            p[at + i] = (uint8_t)~p[at + i];
        break;
    }
    default: {
        size_t words = len / 8, a = next_rand() % words, b = next_rand() % words;
        uint64_t x, y;
        memcpy(&x, p + 8 * a, 8);
        memcpy(&y, p + 8 * b, 8);
        if (a == b || x == y) { /* nothing would change: flip a bit instead */
            p[8 * a] ^= 1;
            break;
        }
        memcpy(p + 8 * a, &y, 8);
        memcpy(p + 8 * b, &x, 8);
        break;
    }
    }
    atomic_fetch_add(&corrupted, 1);
}

/* ---- two loops, one pipe --------------------------------------------------- */

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
} env;

static void opts_for(tdp_pipe_opts *o, bool checksum, uint32_t depth)
{
    tdp_pipe_opts_default(o);
    const char *n = getenv("TDP_TEST_PLANE");
    if (n != NULL)
        assert_int_equal(tdp_plane_parse(n, &o->plane), TDP_OK);
    o->checksum = checksum;
    o->recv_depth = depth;
}

static void env_up(env *e, bool srv_sum, bool cli_sum)
{
    tdp_pipe_opts so, co;
    opts_for(&so, srv_sum, 4);
    opts_for(&co, cli_sum, 1);
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(e->sl, "127.0.0.1", 0, &so, NULL, NULL, &e->l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), &co, &e->cli),
                     TDP_OK);
    assert_int_equal(tdp_listener_accept(e->l, TMO, &e->srv), TDP_OK);
}

static void env_down(env *e)
{
    tdp_pipe_free(e->cli);
    tdp_pipe_free(e->srv);
    tdp_listener_free(e->l);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->sl);
}

static bool sum_in_force(tdp_pipe *p)
{
    tdp_pipe_stats st;
    tdp_pipe_stats_get(p, &st);
    return st.checksum;
}

/* The client sends count messages of nbytes each, then closes. */
typedef struct sender {
    pthread_t th;
    tdp_pipe *pipe;
    int64_t nbytes;
    int count;
    tdp_err rc;
} sender;

static void *sender_main(void *arg)
{
    sender *s = arg;
    tdp_schema *sc = host_bytes_schema(s->nbytes);
    tdp_td *td;
    s->rc = tdp_td_new(sc, &td);
    for (int i = 0; s->rc == TDP_OK && i < s->count; i++) {
        fill(td, (uint64_t)i + 1); /* the hook may have changed the last one */
        s->rc = tdp_pipe_send(s->pipe, td, TMO);
    }
    if (s->rc == TDP_OK)
        s->rc = tdp_pipe_close(s->pipe, TMO);
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    return NULL;
}

typedef struct tally {
    uint64_t ok, detected, undetected, other;
} tally;

/* Receive until the clean end (bounded in count and time), judging each message. */
static tally stream(env *e, int64_t nbytes, int count)
{
    tally t = {0};
    sender s = {.pipe = e->cli, .nbytes = nbytes, .count = count};
    assert_int_equal(pthread_create(&s.th, NULL, sender_main, &s), 0);
    int64_t deadline = mono_ms() + 120000;
    for (int i = 0; i <= count && mono_ms() < deadline; i++) {
        tdp_td *td = NULL;
        tdp_err rc = tdp_pipe_recv(e->srv, TMO, &td);
        if (rc == TDP_ECLOSED)
            break;
        if (rc == TDP_ECHECKSUM) {
            t.detected++;
        } else if (rc == TDP_OK) {
            if (intact(td, (uint64_t)i + 1))
                t.ok++;
            else
                t.undetected++;
            tdp_pipe_release(e->srv, td);
        } else {
            t.other++;
            break;
        }
    }
    pthread_join(s.th, NULL);
    assert_int_equal(s.rc, TDP_OK);
    return t;
}

/* ---- tests ------------------------------------------------------------------ */

/* 10,000 corrupted 1 KiB messages among 10,000 clean ones: all caught. */
static void test_corruptions_caught(void **state)
{
    (void)state;
    env e;
    atomic_store(&corrupted, 0);
    atomic_store(&hooked, 0);
    tdp__sum_set_corrupt_hook(corrupt, NULL);
    env_up(&e, true, true);
    assert_true(sum_in_force(e.srv));
    assert_true(sum_in_force(e.cli));
    tdp_log_set_level(TDP_LOG_ERROR); /* one warning per dropped message otherwise */
    int64_t t0 = mono_ms();
    tally t = stream(&e, 1024, 20000);
    tdp_log_set_level(TDP_LOG_WARN);
    print_message("1 KiB: %" PRIu64 " corrupted, %" PRIu64 " caught, %" PRIu64
                  " undetected, %" PRIu64 " clean delivered, %" PRId64 " ms\n",
                  (uint64_t)atomic_load(&corrupted), t.detected, t.undetected, t.ok,
                  mono_ms() - t0);
    assert_int_equal(atomic_load(&corrupted), 10000);
    assert_int_equal(t.undetected, 0);
    assert_int_equal(t.detected, 10000);
    assert_int_equal(t.ok, 10000);
    assert_int_equal(t.other, 0);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(e.srv, &st);
    assert_int_equal(st.checksum_errors, 10000);
    assert_int_equal(st.msgs_recv, 10000);
    env_down(&e);
    tdp__sum_set_corrupt_hook(NULL, NULL);
}

/* The same at 4 MiB: large payloads (rendezvous on the ucx plane). */
static void test_corruptions_caught_large(void **state)
{
    (void)state;
    env e;
    atomic_store(&corrupted, 0);
    tdp__sum_set_corrupt_hook(corrupt, NULL);
    env_up(&e, true, true);
    tdp_log_set_level(TDP_LOG_ERROR);
    tally t = stream(&e, 4 << 20, 200);
    tdp_log_set_level(TDP_LOG_WARN);
    assert_int_equal(atomic_load(&corrupted), 100);
    assert_int_equal(t.undetected, 0);
    assert_int_equal(t.detected, 100);
    assert_int_equal(t.ok, 100);
    env_down(&e);
    tdp__sum_set_corrupt_hook(NULL, NULL);
}

/*
 * Offered by one side only (an older peer offers nothing): no checksum
 * either way, no sum taken, every message delivered.
 */
static void test_one_side_only(void **state)
{
    (void)state;
    for (int k = 0; k < 2; k++) {
        env e;
        atomic_store(&hooked, 0);
        tdp__sum_set_corrupt_hook(corrupt, NULL);
        env_up(&e, k == 0, k == 1);
        assert_false(sum_in_force(e.srv));
        assert_false(sum_in_force(e.cli));
        tally t = stream(&e, 1024, 100);
        assert_int_equal(t.ok, 100);
        assert_int_equal(t.detected + t.undetected + t.other, 0);
        assert_int_equal(atomic_load(&hooked), 0);
        env_down(&e);
        tdp__sum_set_corrupt_hook(NULL, NULL);
    }
}

/*
 * Host code never reads device memory: a checksummed pipe refuses a
 * receive layout on a GPU (here the fake device) with TDP_ENOTSUP, and the
 * sender hears it.
 */
static void test_device_layout_refused(void **state)
{
    (void)state;
    env e;
    tdp_pipe_opts so, co;
    opts_for(&so, true, 1);
    opts_for(&co, true, 1);
    so.recv_device_set = true;
    so.recv_device = (tdp_device){TDP_DEVICE_CUDA, 0};
    memset(&e, 0, sizeof(e));
    assert_int_equal(tdp_loop_new(NULL, &e.sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e.cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e.sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e.cl), TDP_OK);
    assert_int_equal(tdp_listener_new(e.sl, "127.0.0.1", 0, &so, NULL, NULL, &e.l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e.cl, "127.0.0.1", tdp_listener_port(e.l), &co, &e.cli),
                     TDP_OK);
    assert_int_equal(tdp_listener_accept(e.l, TMO, &e.srv), TDP_OK);
    tdp_schema *sc = host_bytes_schema(4096);
    tdp_td *td;
    assert_int_equal(tdp_td_new(sc, &td), TDP_OK);
    fill(td, 1);
    tdp_err rc = tdp_pipe_send(e.cli, td, TMO);
    assert_true(rc == TDP_OK || rc == TDP_ENOTSUP);
    tdp_td *got = NULL;
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ENOTSUP);
    int64_t deadline = mono_ms() + TMO;
    while (tdp_pipe_status(e.cli) == TDP_OK && mono_ms() < deadline) {
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    assert_int_equal(tdp_pipe_status(e.cli), TDP_ENOTSUP);
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    env_down(&e);
}

int main(void)
{
    setenv("TDPIPE_CUDA", "fake", 1); /* a device that faults when host code reads it */
    const char *plane = getenv("TDP_TEST_PLANE");
    printf("# plane=%s\n", plane ? plane : "auto");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corruptions_caught),
        cmocka_unit_test(test_corruptions_caught_large),
        cmocka_unit_test(test_one_side_only),
        cmocka_unit_test(test_device_layout_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
