/*
 * test_prepare: tdp_pipe_prepare on each data plane (ctest runs it once per
 * plane, as the pipe suite: TDP_TEST_PLANE, UCX_TLS). A prepared layout's
 * first send carries no SCHEMA and arrives intact; a prepare is not a
 * message (sequence and credit go on as before); limits refuse it as they
 * would a send; a second layout after it works. Loopback only, every wait
 * bounded.
 */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include <tdpipe/pipe.h>
#include <tdpipe/server.h>
#include <tdpipe/tdpipe.h>

#define TMO 20000 /* ms: bound for any single wait */

static tdp_plane test_plane(void)
{
    const char *n = getenv("TDP_TEST_PLANE");
    tdp_plane pl = TDP_PLANE_AUTO;
    if (n != NULL)
        assert_int_equal(tdp_plane_parse(n, &pl), TDP_OK);
    return pl;
}

/* Whether the peer's storage is made at the SCHEMA (the ucx plane), so READY confirms it. */
static bool receiver_builds(tdp_pipe *p)
{
    return tdp_pipe_plane(p) == TDP_PLANE_UCX;
}

static tdp_schema *bytes_schema(int64_t nbytes, const char *key)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, key, TDP_UINT8, 1, &nbytes), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    return s;
}

static tdp_td *filled(tdp_schema *s, uint8_t seed)
{
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    uint8_t *p = tdp_td_data(td);
    for (uint64_t i = 0; i < tdp_td_nbytes(td); i++)
        p[i] = (uint8_t)(seed + i * 31u);
    return td;
}

static bool same_bytes(const tdp_td *a, const tdp_td *b)
{
    return tdp_td_nbytes(a) == tdp_td_nbytes(b) &&
           memcmp(tdp_td_data(a), tdp_td_data(b), tdp_td_nbytes(a)) == 0;
}

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
} env;

static void env_up_opts(env *e, tdp_pipe_opts *so)
{
    tdp_pipe_opts co;
    tdp_pipe_opts_default(&co);
    co.plane = so->plane = test_plane();
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(e->sl, "127.0.0.1", 0, so, NULL, NULL, &e->l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), &co, &e->cli),
                     TDP_OK);
    assert_int_equal(tdp_listener_accept(e->l, TMO, &e->srv), TDP_OK);
}

static void env_up(env *e)
{
    tdp_pipe_opts so;
    tdp_pipe_opts_default(&so);
    env_up_opts(e, &so);
}

static void env_down(env *e)
{
    tdp_pipe_free(e->cli);
    tdp_pipe_free(e->srv);
    tdp_listener_free(e->l);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->sl);
}

static tdp_pipe_stats stats(tdp_pipe *p)
{
    tdp_pipe_stats st;
    tdp_pipe_stats_get(p, &st);
    return st;
}

/* Send td and receive it on the other side: its bytes, the seq it came with. */
static void send_check(env *e, tdp_td *td, uint64_t want_seq)
{
    tdp_td *got;
    assert_int_equal(tdp_pipe_send(e->cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e->srv, TMO, &got), TDP_OK);
    assert_true(tdp_schema_equal(tdp_td_schema(got), tdp_td_schema(td)));
    assert_true(same_bytes(got, td));
    assert_int_equal(stats(e->srv).msgs_recv, want_seq);
    tdp_pipe_release(e->srv, got);
}

static void test_prepare_then_send(void **state)
{
    (void)state;
    env e;
    tdp_schema *s = bytes_schema(3 << 20, "x");
    tdp_td *td = filled(s, 7);
    env_up(&e);
    assert_int_equal(tdp_pipe_prepare(e.cli, s, TMO), TDP_OK);
    tdp_pipe_stats c = stats(e.cli);
    assert_int_equal(c.schemas_sent, 1);
    assert_int_equal(c.msgs_sent, 0); /* not a message */
    if (receiver_builds(e.cli))       /* READY came: the receiver holds it already */
        assert_int_equal(stats(e.srv).schemas_recv, 1);
    for (uint64_t i = 1; i <= 3; i++)
        send_check(&e, td, i);
    /* the first send carried DATA only: one SCHEMA each way in all */
    assert_int_equal(stats(e.cli).schemas_sent, 1);
    assert_int_equal(stats(e.srv).schemas_recv, 1);
    assert_int_equal(stats(e.cli).msgs_sent, 3);
    /* prepared again while in force: nothing to send */
    assert_int_equal(tdp_pipe_prepare(e.cli, s, TMO), TDP_OK);
    assert_int_equal(stats(e.cli).schemas_sent, 1);
    send_check(&e, td, 4);
    assert_int_equal(tdp_pipe_close(e.cli, TMO), TDP_OK);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED);
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* A prepare, then a send of another layout; then a second prepare replaces the first. */
static void test_prepare_then_other(void **state)
{
    (void)state;
    env e;
    tdp_schema *a = bytes_schema(1 << 20, "a"), *b = bytes_schema(2 << 20, "b");
    tdp_schema *c = bytes_schema(4 << 20, "c");
    tdp_td *ta = filled(a, 1), *tb = filled(b, 2), *tc = filled(c, 3);
    env_up(&e);
    assert_int_equal(tdp_pipe_prepare(e.cli, a, TMO), TDP_OK);
    send_check(&e, tb, 1); /* b's SCHEMA goes with it, after a's */
    send_check(&e, ta, 2);
    /* two prepares in a row: the second is the layout in force */
    assert_int_equal(tdp_pipe_prepare(e.cli, c, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_prepare(e.cli, b, TMO), TDP_OK);
    send_check(&e, tb, 3);
    send_check(&e, tc, 4);
    send_check(&e, tc, 5);
    uint64_t sent = stats(e.cli).schemas_sent;
    /* a(prepared), b, a, then c and b prepared (the shm plane may leave one
     * to its send), then c: at least 5 and every one the receiver took */
    assert_true(sent >= 5 && sent <= 6);
    assert_int_equal(stats(e.srv).schemas_recv, sent);
    env_down(&e);
    tdp_td_unref(ta);
    tdp_td_unref(tb);
    tdp_td_unref(tc);
    tdp_schema_unref(a);
    tdp_schema_unref(b);
    tdp_schema_unref(c);
}

/* Over the receiver's limit: refused with the error a send would get; the pipe goes on. */
static void test_prepare_over_limit(void **state)
{
    (void)state;
    env e;
    tdp_schema_limits lim;
    tdp_schema_limits_default(&lim);
    lim.max_total_bytes = 1 << 20;
    tdp_pipe_opts so;
    tdp_pipe_opts_default(&so);
    so.limits = &lim;
    tdp_schema *big = bytes_schema((1 << 20) + 1, "x"), *ok = bytes_schema(1000, "x");
    tdp_td *td = filled(ok, 9);
    env_up_opts(&e, &so);
    assert_int_equal(tdp_pipe_prepare(e.cli, big, TMO), TDP_EMSGSIZE);
    assert_int_equal(stats(e.cli).schemas_sent, 0);
    assert_int_equal(tdp_pipe_status(e.cli), TDP_OK);
    send_check(&e, td, 1);
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(big);
    tdp_schema_unref(ok);
}

static void test_prepare_bad_args_and_closed(void **state)
{
    (void)state;
    env e;
    tdp_schema *s = bytes_schema(100, "x");
    env_up(&e);
    assert_int_equal(tdp_pipe_prepare(NULL, s, TMO), TDP_EINVAL);
    assert_int_equal(tdp_pipe_prepare(e.cli, NULL, TMO), TDP_EINVAL);
    assert_int_equal(tdp_pipe_close(e.cli, TMO), TDP_OK);
    tdp_err rc = tdp_pipe_prepare(e.cli, s, TMO);
    assert_int_not_equal(rc, TDP_OK);
    assert_int_not_equal(rc, TDP_ETIMEDOUT);
    env_down(&e);
    tdp_schema_unref(s);
}

/* A server's memory cap: a prepare over it ends the pipe with ELIMIT, as the send would. */
static void test_prepare_over_server_cap(void **state)
{
    (void)state;
    if (test_plane() != TDP_PLANE_UCX)
        skip(); /* the shm receiver takes the layout only with its first DATA */
    tdp_loop *sl, *cl;
    tdp_server *srv;
    tdp_pipe *cli;
    tdp_server_opts so;
    tdp_server_opts_default(&so);
    so.pipe.recv_depth = 1;
    so.max_memory = 1 << 20;
    so.pipe.plane = TDP_PLANE_UCX;
    tdp_pipe_opts co;
    tdp_pipe_opts_default(&co);
    co.plane = TDP_PLANE_UCX;
    tdp_schema *big = bytes_schema(2 << 20, "x");
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    tdp_server_handler h = {.size = sizeof(h)};
    assert_int_equal(tdp_server_new(sl, "127.0.0.1", 0, &so, &h, NULL, &srv), TDP_OK);
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_server_port(srv), &co, &cli), TDP_OK);
    tdp_err rc = tdp_pipe_prepare(cli, big, TMO);
    assert_int_equal(rc, TDP_ELIMIT);
    tdp_pipe_free(cli);
    tdp_server_free(srv);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
    tdp_schema_unref(big);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prepare_then_send),
        cmocka_unit_test(test_prepare_then_other),
        cmocka_unit_test(test_prepare_over_limit),
        cmocka_unit_test(test_prepare_bad_args_and_closed),
        cmocka_unit_test(test_prepare_over_server_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
