/*
 * test_window: the receive window for small messages
 * (tdp_pipe_opts.recv_window_bytes, HELLO record TDP_HX_WINDOW), on the
 * plane TDP_TEST_PLANE names (ucx or shm; ctest runs it once per plane).
 *
 * - the sender may have exactly tdp__window(depth, window, size) messages
 *   in flight to a receiver that does not receive: more than depth for a
 *   small layout, depth for a large one, depth without a window on either
 *   side that receives;
 * - messages of a small and a large layout, interleaved, arrive whole and
 *   in order (the window changes with the layout);
 * - no lost wake-up: a producer sends bursts of random length with random
 *   pauses, the consumer receives event-driven; every message arrives, in
 *   order, within a bounded time.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "pipe/plane.h"

#define TMO    10000
#define WINDOW (256u << 10)

static tdp_plane test_plane(void)
{
    const char *e = getenv("TDP_TEST_PLANE");
    tdp_plane p = TDP_PLANE_UCX;
    if (e != NULL)
        assert_int_equal(tdp_plane_parse(e, &p), TDP_OK);
    return p;
}

typedef struct pair {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli; /* srv receives, cli sends */
} pair;

/* The receiver's window rx_win and the sender's tx_win (each side's own option). */
static void pair_open(pair *pr, uint32_t depth, uint64_t rx_win, uint64_t tx_win)
{
    tdp_pipe_opts so, co;
    tdp_pipe_opts_default(&so);
    so.recv_depth = depth;
    so.plane = test_plane();
    so.recv_window_bytes = rx_win;
    co = so;
    co.recv_window_bytes = tx_win;
    assert_int_equal(tdp_loop_new(NULL, &pr->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &pr->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(pr->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(pr->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(pr->sl, "127.0.0.1", 0, &so, NULL, NULL, &pr->l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(pr->cl, "127.0.0.1", tdp_listener_port(pr->l), &co, &pr->cli),
                     TDP_OK);
    assert_int_equal(tdp_listener_accept(pr->l, TMO, &pr->srv), TDP_OK);
    assert_int_equal(tdp_pipe_plane(pr->cli), so.plane);
}

static void pair_close(pair *pr)
{
    tdp_pipe_free(pr->cli);
    tdp_pipe_free(pr->srv);
    tdp_listener_free(pr->l);
    tdp_loop_free(pr->cl);
    tdp_loop_free(pr->sl);
}

static tdp_td *new_td(uint64_t nbytes)
{
    tdp_schema_builder *b;
    tdp_schema *s;
    tdp_td *td;
    int64_t n = (int64_t)nbytes;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &n), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    tdp_schema_unref(s);
    return td;
}

/* Message i: its number in the first 8 bytes, and i's low byte in the last. */
static void fill(tdp_td *td, uint64_t i)
{
    uint8_t *d = tdp_td_data(td);
    memcpy(d, &i, sizeof(i));
    d[tdp_td_nbytes(td) - 1] = (uint8_t)i;
}

static bool check(const tdp_td *td, uint64_t i)
{
    const uint8_t *d = tdp_td_data((tdp_td *)td);
    uint64_t v;
    memcpy(&v, d, sizeof(v));
    return v == i && d[tdp_td_nbytes(td) - 1] == (uint8_t)i;
}

/*
 * Send messages of nbytes with a short timeout while the receiver does not
 * receive: the number that go before one times out is the credit the
 * sender was given. Then receive them all, in order.
 */
static uint32_t in_flight_case(uint32_t depth, uint64_t rx_win, uint64_t tx_win, uint64_t nbytes)
{
    pair pr;
    pair_open(&pr, depth, rx_win, tx_win);
    tdp_td *td = new_td(nbytes);
    uint32_t sent = 0;
    tdp_err rc = TDP_OK;
    while (sent <= TDP_MAX_DEPTH && rc == TDP_OK) {
        fill(td, sent);
        /* the first waits for the handshake and the schema; the rest find credit or not */
        rc = tdp_pipe_send(pr.cli, td, sent == 0 ? TMO : 300);
        sent += rc == TDP_OK;
    }
    assert_int_equal(rc, TDP_ETIMEDOUT); /* canceled before it started: the pipe lives on */
    for (uint32_t i = 0; i < sent; i++) {
        tdp_td *got;
        assert_int_equal(tdp_pipe_recv(pr.srv, TMO, &got), TDP_OK);
        assert_true(check(got, i));
        tdp_pipe_release(pr.srv, got);
    }
    /* the credit came back: one more goes */
    fill(td, sent);
    assert_int_equal(tdp_pipe_send(pr.cli, td, TMO), TDP_OK);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(pr.srv, TMO, &got), TDP_OK);
    assert_true(check(got, sent));
    tdp_pipe_release(pr.srv, got);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(pr.cli, &st);
    assert_true(st.credit_waits > 0);
    tdp_td_unref(td);
    pair_close(&pr);
    print_message("%s depth %u, window %" PRIu64 " (sender's %" PRIu64 "), %" PRIu64
                  " B: %u in flight\n",
                  tdp_plane_name(test_plane()), depth, rx_win, tx_win, nbytes, sent);
    return sent;
}

/*
 * A new layout with every message, as many in flight as the window lets
 * go at depth 1: the receiver takes a schema announcement for each (the
 * shm plane holds them until their DATA) and every message lands intact.
 */
static void test_schema_per_message(void **state)
{
    (void)state;
    enum { N = 40 };
    pair pr;
    pair_open(&pr, 1, WINDOW, 0);
    tdp_td *td[N];
    for (uint32_t i = 0; i < N; i++) {
        td[i] = new_td(1000 + i); /* a layout of its own, one page */
        fill(td[i], i);
        assert_int_equal(tdp_pipe_send(pr.cli, td[i], TMO), TDP_OK); /* credit: the window */
    }
    for (uint32_t i = 0; i < N; i++) {
        tdp_td *got;
        assert_int_equal(tdp_pipe_recv(pr.srv, TMO, &got), TDP_OK);
        assert_int_equal(tdp_td_nbytes(got), tdp_td_nbytes(td[i]));
        assert_true(tdp_schema_equal(tdp_td_schema(got), tdp_td_schema(td[i])));
        assert_true(check(got, i));
        tdp_pipe_release(pr.srv, got);
        tdp_td_unref(td[i]);
    }
    assert_int_equal(tdp_pipe_status(pr.srv), TDP_OK);
    pair_close(&pr);
}

static void test_small_window(void **state)
{
    (void)state;
    /* 1000 B counts one page: 256 KiB / 4 KiB = 64 */
    assert_int_equal(in_flight_case(4, WINDOW, 0, 1000), tdp__window(4, WINDOW, 1000));
    assert_int_equal(tdp__window(4, WINDOW, 1000), 64);
    /* 16 KiB: 16 */
    assert_int_equal(in_flight_case(2, WINDOW, WINDOW, 16 << 10), 16);
}

static void test_large_layout_keeps_depth(void **state)
{
    (void)state;
    assert_int_equal(in_flight_case(4, WINDOW, WINDOW, 1 << 20), 4);
}

static void test_no_window_keeps_depth(void **state)
{
    (void)state;
    /* the sender's own window grants nothing: it is the receiver's to give */
    assert_int_equal(in_flight_case(4, 0, WINDOW, 1000), 4);
    assert_int_equal(in_flight_case(1, 0, 0, 1000), 1);
}

typedef struct producer {
    tdp_pipe *p;
    int count;
    bool mixed; /* alternate a small and a large layout */
    unsigned seed;
    tdp_err rc;
} producer;

static void *produce(void *arg)
{
    producer *pd = arg;
    tdp_td *small = new_td(1000), *large = new_td(300000);
    int i = 0;
    pd->rc = TDP_OK;
    while (i < pd->count && pd->rc == TDP_OK) {
        int burst = 1 + (int)(rand_r(&pd->seed) % 100);
        for (int k = 0; k < burst && i < pd->count && pd->rc == TDP_OK; k++, i++) {
            tdp_td *td = pd->mixed && (i / 7) % 2 == 1 ? large : small;
            fill(td, (uint64_t)i);
            pd->rc = tdp_pipe_send(pd->p, td, TMO);
        }
        /* a pause: the consumer goes to sleep, the next burst must wake it */
        unsigned us = rand_r(&pd->seed) % 300;
        if (us > 0)
            usleep(us);
    }
    tdp_td_unref(small);
    tdp_td_unref(large);
    return NULL;
}

/* count messages in bursts, received event-driven; all in order within the time bound. */
static void stream_case(int count, bool mixed, uint32_t depth)
{
    pair pr;
    pair_open(&pr, depth, WINDOW, WINDOW);
    producer pd = {.p = pr.cli, .count = count, .mixed = mixed, .seed = 12345};
    pthread_t t;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(pthread_create(&t, NULL, produce, &pd), 0);
    tdp_err rc = TDP_OK;
    int got_n = 0;
    for (; got_n < count && rc == TDP_OK; got_n++) {
        tdp_td *got;
        /* a lost wake-up shows as a receive that waits for the safety timer
         * or for ever: TMO bounds it, and the total time is checked below */
        rc = tdp_pipe_recv(pr.srv, TMO, &got);
        if (rc != TDP_OK)
            break;
        if (!check(got, (uint64_t)got_n))
            rc = TDP_EINTERNAL;
        if ((got_n & 15) == 0)
            sched_yield(); /* now and then let the producer run ahead into the window */
        tdp_pipe_release(pr.srv, got);
    }
    pthread_join(t, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    print_message("%s: %d messages (%s) in %.2f s\n", tdp_plane_name(test_plane()), got_n,
                  mixed ? "1000 B and 300 kB" : "1000 B", secs);
    assert_int_equal(pd.rc, TDP_OK);
    assert_int_equal(rc, TDP_OK);
    assert_int_equal(got_n, count);
    assert_true(secs < 60);
    pair_close(&pr);
}

static void test_bursts_small(void **state)
{
    (void)state;
    stream_case(20000, false, 4);
}

static void test_bursts_mixed_layouts(void **state)
{
    (void)state;
    stream_case(3000, true, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_window),
        cmocka_unit_test(test_schema_per_message),
        cmocka_unit_test(test_large_layout_keeps_depth),
        cmocka_unit_test(test_no_window_keeps_depth),
        cmocka_unit_test(test_bursts_small),
        cmocka_unit_test(test_bursts_mixed_layouts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
