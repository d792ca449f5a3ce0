/*
 * test_session: the pipe's state machine (session.c) over an in-memory
 * data plane (fake_plane.c) — no UCX worker is ever made, which every
 * test checks at the end. The control channel is real TCP over
 * 127.0.0.1; both pipes live on one loop that only this thread runs.
 * Every wait is bounded (TMO).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/tdpipe.h>

#include "fake_plane.h"
#include "pipe/host.h"
#include "pipe/session.h"
#include "pipe/ucx/ucx_workers.h"
#include "schema/schema_int.h"
#include "test_util.h"

#define TMO    5000 /* ms: bound of any single wait */
#define LINGER 500  /* ms: linger deadline where a test waits for it */

/* ---- schemas and payloads ----------------------------------------------------------- */

/* A pattern that depends on seq: a stale or torn buffer fails verify. */
static void fill(tdp_td *td, uint64_t seq)
{
    uint8_t *p = tdp_td_data(td);
    for (uint64_t i = 0; i < tdp_td_nbytes(td); i++)
        p[i] = (uint8_t)(seq * 131 + i * 7 + (i >> 8));
}

static bool verify(const tdp_td *td, uint64_t seq)
{
    const uint8_t *p = tdp_td_data(td);
    for (uint64_t i = 0; i < tdp_td_nbytes(td); i++)
        if (p[i] != (uint8_t)(seq * 131 + i * 7 + (i >> 8)))
            return false;
    return true;
}

static tdp_td *msg(tdp_schema *sc, uint64_t seq)
{
    tdp_td *td;
    assert_int_equal(tdp_td_new(sc, &td), TDP_OK);
    fill(td, seq);
    return td;
}

/* ---- environment: one loop, a dialed pipe (cli) and an accepted one (srv) ------------- */

typedef struct side {
    tdp_pipe *p;
    bool ready, ended;
    tdp_err ready_rc, end_rc;
    tdp_schema *send_on_ready; /* send one message (seq 1) from the ready callback */
    tdp_op *ready_op;
} side;

typedef struct env {
    tdp_loop *loop;
    side cli, srv;
} env;

static void spin(env *e, int64_t ms)
{
    volatile bool never = false;
    tdp__loop_run_until(e->loop, &never, ms);
}

/* Run the loop until expr holds; fail the test after TMO. */
#define WAIT(e, expr)                                                                              \
    do {                                                                                           \
        int64_t end_ = mono_ms() + TMO;                                                            \
        while (!(expr)) {                                                                          \
            if (mono_ms() > end_)                                                                  \
                fail_msg("timed out waiting for %s", #expr);                                       \
            spin((e), 2);                                                                          \
        }                                                                                          \
    } while (0)

static void on_end(tdp_pipe *p, tdp_err st, void *arg)
{
    side *s = arg;
    assert_false(s->ended); /* once */
    s->ended = true;
    s->end_rc = st;
}

static void on_ready(tdp_pipe *p, tdp_err st, void *arg)
{
    side *s = arg;
    assert_false(s->ready); /* once */
    s->ready = true;
    s->ready_rc = st;
    s->p = p;
    if (p == NULL)
        return;
    assert_int_equal(st, TDP_OK);
    tdp_pipe_set_end_cb(p, on_end, s);
    if (s->send_on_ready != NULL) {
        tdp_td *td = msg(s->send_on_ready, 1);
        tdp_pipe_send_async(p, td, s->ready_op);
        tdp_td_unref(td);
    }
}

static tdp_pipe_opts fake_opts(uint32_t depth)
{
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = (tdp_plane)TDP__PLANE_TEST;
    o.recv_depth = depth;
    o.recv_window_bytes = 0; /* the credit tests count depth itself (test_window: the window) */
    o.linger_ms = LINGER;
    o.connect_timeout_ms = TMO;
    return o;
}

/*
 * Dial and accept over 127.0.0.1; the fake's links take ccfg (dialer) and
 * scfg (acceptor). Returns once both sides' ready callbacks have run.
 */
static void env_up_cfg(env *e, const tdp_pipe_opts *co, const tdp_pipe_opts *so,
                       const fake_cfg *ccfg, const fake_cfg *scfg)
{
    tdp_op *cop = e->cli.ready_op, *sop = e->srv.ready_op;
    tdp_schema *csc = e->cli.send_on_ready, *ssc = e->srv.send_on_ready;
    memset(e, 0, sizeof(*e));
    e->cli.ready_op = cop;
    e->srv.ready_op = sop;
    e->cli.send_on_ready = csc;
    e->srv.send_on_ready = ssc;
    assert_int_equal(tdp_loop_new(NULL, &e->loop), TDP_OK);

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    assert_true(lfd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sl), 0);
    assert_int_equal(listen(lfd, 4), 0);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&sa, &sl), 0);

    *fake_defaults() = ccfg != NULL ? *ccfg : (fake_cfg){0};
    assert_int_equal(
        tdp_pipe_connect_async(e->loop, "127.0.0.1", ntohs(sa.sin_port), co, on_ready, &e->cli),
        TDP_OK);
    struct sockaddr_storage peer;
    socklen_t pl = sizeof(peer);
    int fd = -1;
    WAIT(e, e->cli.ready || (fd = accept4(lfd, (struct sockaddr *)&peer, &pl,
                                          SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0);
    close(lfd);
    if (fd < 0) { /* the dialer failed before it connected */
        e->srv.ready = true;
        e->srv.ready_rc = TDP_ECONNRESET;
        return;
    }

    *fake_defaults() = scfg != NULL ? *scfg : (fake_cfg){0};
    tdp_pipe_opts ro;
    tdp_schema_limits lim;
    tdp__opts_resolve(so, &ro, &lim);
    tdp_err rc;
    tdp_pipe *p = tdp__session_new(e->loop, &ro, &lim, &rc);
    if (p == NULL) {
        close(fd);
        e->srv.ready = true;
        e->srv.ready_rc = rc;
    } else if ((rc = tdp__session_accept(p, fd, (struct sockaddr *)&peer, on_ready, &e->srv)) !=
               TDP_OK) {
        tdp__session_destroy(p);
        e->srv.ready = true;
        e->srv.ready_rc = rc;
    }
    *fake_defaults() = (fake_cfg){0};
    WAIT(e, e->cli.ready && e->srv.ready);
}

static void env_up(env *e, uint32_t cdepth, uint32_t sdepth)
{
    tdp_pipe_opts co = fake_opts(cdepth), so = fake_opts(sdepth);
    env_up_cfg(e, &co, &so, NULL, NULL);
    assert_int_equal(e->cli.ready_rc, TDP_OK);
    assert_int_equal(e->srv.ready_rc, TDP_OK);
}

/* Free both pipes, let the fake let go of everything, and check nothing touched UCX. */
static void env_down(env *e)
{
    tdp_pipe_free(e->cli.p);
    tdp_pipe_free(e->srv.p);
    e->cli.p = e->srv.p = NULL;
    fake_release_all();
    WAIT(e, fake_live_links() == 0 && fake_pending() == 0);
    spin(e, 1); /* the pipes' own memory goes on a later turn */
    assert_null(tdp__ucx_peek(e->loop));
    assert_null(tdp__loop_ext(e->loop, TDP__EXT_PIPE));
    tdp_loop_free(e->loop);
    e->loop = NULL;
    assert_int_equal(fake_guard_errors(), 0);
    assert_int_equal(fake_contract_errors(), 0);
}

static const fake_stats *stats(const env *e, bool cli)
{
    return fake_stats_of(fake_link_of(cli ? e->cli.p : e->srv.p));
}

static tdp_op *new_op(void)
{
    tdp_op *op;
    assert_int_equal(tdp_op_new(NULL, NULL, &op), TDP_OK);
    return op;
}

static bool done(const tdp_op *op)
{
    return tdp_op_result(op) != TDP_EAGAIN;
}

static void send_one(tdp_pipe *p, tdp_schema *sc, uint64_t seq, tdp_op *op)
{
    tdp_td *td = msg(sc, seq);
    tdp_pipe_send_async(p, td, op);
    tdp_td_unref(td); /* the op holds it */
}

/* Receive one message, wait for it and check it is seq's. */
static tdp_td *recv_one(env *e, tdp_pipe *p, tdp_op *op, uint64_t seq)
{
    tdp_pipe_recv_async(p, op);
    WAIT(e, done(op));
    assert_int_equal(tdp_op_result(op), TDP_OK);
    assert_int_equal(tdp_op_seq(op), seq);
    assert_true(verify(tdp_op_td(op), seq));
    return tdp_op_td(op);
}

static int setup(void **state)
{
    fake_plane_install(true);
    return 0;
}

static int teardown(void **state)
{
    fake_plane_uninstall();
    return 0;
}

/* ---- HELLO ------------------------------------------------------------------------------ */

static void test_hello_opens_on_fake(void **state)
{
    env e = {0};
    env_up(&e, 2, 3);
    assert_int_equal(tdp_pipe_plane(e.cli.p), TDP__PLANE_TEST);
    assert_int_equal(tdp_pipe_plane(e.srv.p), TDP__PLANE_TEST);
    assert_true(tdp_pipe_same_host(e.cli.p));
    /* each side's link learnt the depth the other grants */
    assert_true(stats(&e, true)->started);
    assert_true(stats(&e, false)->started);
    assert_int_equal(stats(&e, true)->peer_depth, 3);
    assert_int_equal(stats(&e, false)->peer_depth, 2);
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_OK);
    assert_null(tdp__ucx_peek(e.loop));
    env_down(&e);
}

/*
 * More planes than the registry ever held before (two built, one test):
 * fill it to the brim; the registry refuses the one too many, and a pipe
 * offering every plane there is opens on the most preferred.
 */
static tdp_err no_records(tdp__link *l, tdp_hello *h)
{
    (void)l;
    (void)h;
    return TDP_OK; /* the fake's records are the installed plane's */
}

static void test_registry_full(void **state)
{
    static tdp__plane_ops more[TDP__PLANE_TEST - TDP__PLANE_TEST_MIN];
    size_t added = 0;
    tdp_err rc = TDP_OK;
    for (uint8_t id = TDP__PLANE_TEST_MIN; id < TDP__PLANE_TEST; id++) {
        more[id - TDP__PLANE_TEST_MIN] = *fake_plane_ops();
        more[id - TDP__PLANE_TEST_MIN].id = id;
        more[id - TDP__PLANE_TEST_MIN].hello_fill = no_records;
        if ((rc = tdp__plane_add_test(&more[id - TDP__PLANE_TEST_MIN])) != TDP_OK)
            break;
        added++;
    }
    assert_int_equal(rc, TDP_ELIMIT);
    assert_int_equal(tdp__plane_count(), TDP__PLANES_MAX);
    assert_true(added + 1 > 4); /* more test links than make_links once had room for */
    assert_null(tdp__plane_at(TDP__PLANES_MAX));
    /* an id already there, or out of the test range, is refused */
    assert_int_equal(tdp__plane_add_test(fake_plane_ops()), TDP_EINVAL);

    env e = {0};
    tdp_pipe_opts co = fake_opts(2), so = fake_opts(2);
    co.plane = so.plane = TDP_PLANE_AUTO;
    co.planes_forbidden = so.planes_forbidden =
        (1u << TDP_PLANE_UCX) | (1u << TDP_PLANE_SHM) | (1u << TDP_PLANE_TCP); /* test planes only */
    env_up_cfg(&e, &co, &so, NULL, NULL);
    assert_int_equal(e.cli.ready_rc, TDP_OK);
    assert_int_equal(e.srv.ready_rc, TDP_OK);
    assert_int_equal(tdp_pipe_plane(e.cli.p), TDP__PLANE_TEST); /* first on both lists */
    assert_int_equal(tdp_pipe_plane(e.srv.p), TDP__PLANE_TEST);
    tdp_schema *sc = host_bytes_schema(100);
    tdp_op *s = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 1));
    WAIT(&e, done(s));
    assert_int_equal(tdp_op_result(s), TDP_OK);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/*
 * The tcp plane's choice rule (plane_tcp.c, t_usable_link): usable when a
 * side offers it alone (asked for it), or by default for a peer on
 * another host when both HELLOs say TCP is their way off the host (no
 * RDMA device). Both sides apply the same test to the same two HELLOs.
 */
static void tcp_peer(tdp_hello *h, const uint8_t *planes, uint32_t n, const uint8_t *rec)
{
    *h = (tdp_hello){.planes = planes, .nplanes = n};
    if (rec != NULL)
        assert_int_equal(tdp_hello_add_rec(h, TDP_HX_TCP, rec, 1), TDP_OK);
}

static void test_tcp_plane_choice_rule(void **state)
{
    (void)state;
    const tdp__plane_ops *o = tdp__plane_by_id(TDP_PLANE_TCP);
    assert_non_null(o);
    assert_non_null(o->usable_link);
    /* before ucx in the registry: where both are usable, tcp is chosen */
    size_t pos_tcp = 99, pos_ucx = 99;
    for (size_t i = 0; tdp__plane_at(i) != NULL; i++) {
        if (tdp__plane_at(i)->id == TDP_PLANE_TCP)
            pos_tcp = i;
        if (tdp__plane_at(i)->id == TDP_PLANE_UCX)
            pos_ucx = i;
    }
    assert_true(pos_tcp < pos_ucx);

    tdp_loop *loop;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    static const tdp__plane_up up = {0};
    tdp__link *all, *alone;
    assert_int_equal(o->link_new(loop, NULL, &up, &all), TDP_OK);
    assert_int_equal(o->link_new(loop, NULL, &up, &alone), TDP_OK);
    const uint8_t every[] = {TDP_PLANE_SHM, TDP_PLANE_TCP, TDP_PLANE_UCX};
    const uint8_t only[] = {TDP_PLANE_TCP};
    tdp_hello mine;
    tcp_peer(&mine, every, 3, NULL);
    assert_int_equal(o->hello_fill(all, &mine), TDP_OK);
    const tdp_hx_rec *r = tdp_hello_rec(&mine, TDP_HX_TCP);
    assert_non_null(r);
    assert_int_equal(r->len, 1);
    bool off_host = (r->val[0] & TDP_TCP_OFF_HOST) != 0; /* no RDMA device on this machine */
    tdp_hello mine1;
    tcp_peer(&mine1, only, 1, NULL);
    assert_int_equal(o->hello_fill(alone, &mine1), TDP_OK);

    const uint8_t tcp_only = TDP_TCP_OFF_HOST, rdma = 0, unknown_bits = 0xfe | TDP_TCP_OFF_HOST;
    tdp_hello peer;
    /* by default: another host, both without RDMA */
    tcp_peer(&peer, every, 3, &tcp_only);
    assert_false(o->usable_link(all, &peer, true)); /* same host: shm, else ucx */
    assert_int_equal(o->usable_link(all, &peer, false), off_host);
    tcp_peer(&peer, every, 3, &unknown_bits); /* bits not known are ignored */
    assert_int_equal(o->usable_link(all, &peer, false), off_host);
    tcp_peer(&peer, every, 3, &rdma); /* the peer has RDMA: ucx */
    assert_false(o->usable_link(all, &peer, false));
    tcp_peer(&peer, every, 3, NULL); /* a peer that does not say: ucx */
    assert_false(o->usable_link(all, &peer, false));
    /* asked for, by either side: usable anywhere */
    tcp_peer(&peer, only, 1, NULL);
    assert_true(o->usable_link(all, &peer, true));
    tcp_peer(&peer, every, 3, &rdma);
    assert_true(o->usable_link(alone, &peer, true));
    /* this side does not offer it */
    tcp_peer(&peer, only, 1, &tcp_only);
    assert_false(o->usable_link(NULL, &peer, false));
    /* the record is one byte */
    const uint8_t two[2] = {1, 0};
    peer = (tdp_hello){.planes = every, .nplanes = 3};
    assert_int_equal(tdp_hello_add_rec(&peer, TDP_HX_TCP, two, 2), TDP_OK);
    assert_int_equal(o->hello_check(&peer), TDP_EPROTO);
    tcp_peer(&peer, every, 3, &tcp_only);
    assert_int_equal(o->hello_check(&peer), TDP_OK);

    o->link_close(all, false);
    o->link_close(alone, false);
    tdp_loop_free(loop); /* the closed links go with it */
}

/*
 * A link that carries host memory only is never handed a device buffer:
 * the send ends with TDP_ENOTSUP, the plane sees nothing, the pipe goes on.
 * The peer's HELLO caps reach the plane.
 */
static void test_memory_refused(void **state)
{
    fake_set_mem(TDP__MEM_HOST);
    env e = {0};
    env_up(&e, 2, 2);
    assert_true(stats(&e, true)->peer_caps & TDP_CAP_MEM_HOST);
    assert_true(stats(&e, false)->peer_caps & TDP_CAP_MEM_HOST);
    tdp_schema *host = host_bytes_schema(64), *dev;
    tdp_device cuda = {TDP_DEVICE_CUDA, 0};
    assert_int_equal(tdp_schema_with_device(host, cuda, &dev), TDP_OK);
    static _Alignas(64) uint8_t buf[4096];
    tdp_td *td;
    assert_int_equal(tdp_td_wrap(dev, buf, sizeof(buf), cuda, NULL, NULL, &td), TDP_OK);
    tdp_op *s = new_op(), *r = new_op();
    tdp_pipe_send_async(e.cli.p, td, s);
    tdp_td_unref(td);
    WAIT(&e, done(s));
    assert_int_equal(tdp_op_result(s), TDP_ENOTSUP);
    assert_int_equal(stats(&e, true)->tx_data, 0);
    assert_int_equal(stats(&e, true)->tx_schema, 0);
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_OK);
    /* host memory still goes, numbered as if nothing had been tried */
    send_one(e.cli.p, host, 1, s);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 1));
    WAIT(&e, done(s));
    assert_int_equal(tdp_op_result(s), TDP_OK);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(host);
    tdp_schema_unref(dev);
}

static tdp_err refuse_records(const tdp_hello *peer)
{
    (void)peer;
    return TDP_EPROTO;
}

/*
 * A plane finds its records in the peer's HELLO malformed: the pipe fails
 * with TDP_EPROTO, though that plane is not even one this pipe may use.
 */
static void test_hello_plane_record_malformed(void **state)
{
    static tdp__plane_ops picky;
    picky = *fake_plane_ops();
    picky.id = TDP__PLANE_TEST - 1;
    picky.name = "picky";
    picky.hello_check = refuse_records;
    assert_int_equal(tdp__plane_add_test(&picky), TDP_OK);
    env e = {0};
    tdp_pipe_opts o = fake_opts(1);
    o.planes_forbidden = 1u << picky.id;
    env_up_cfg(&e, &o, &o, NULL, NULL);
    assert_null(e.srv.p);
    assert_int_equal(e.srv.ready_rc, TDP_EPROTO);
    assert_true(e.cli.ready_rc == TDP_EPROTO || e.cli.ready_rc == TDP_ECONNRESET);
    env_down(&e);
}

static void test_hello_no_common_plane(void **state)
{
    env e = {0};
    tdp_pipe_opts o = fake_opts(1);
    fake_set_usable(false); /* both sides filter it out: nothing in common */
    env_up_cfg(&e, &o, &o, NULL, NULL);
    assert_null(e.cli.p);
    assert_null(e.srv.p);
    assert_int_equal(e.cli.ready_rc, TDP_ENOTSUP);
    assert_int_equal(e.srv.ready_rc, TDP_ENOTSUP);
    env_down(&e);
}

static void test_hello_plane_refuses(void **state)
{
    env e = {0};
    tdp_pipe_opts o = fake_opts(1);

    /* no link at all: the dialer never connects */
    fake_set_link_new_rc(TDP_EINTERNAL);
    env_up_cfg(&e, &o, &o, NULL, NULL);
    fake_set_link_new_rc(TDP_OK);
    assert_null(e.cli.p);
    assert_int_equal(e.cli.ready_rc, TDP_EINTERNAL);
    env_down(&e);

    /* the acceptor's plane cannot describe itself: it fails, the dialer is told */
    fake_cfg bad = {.fill_rc = TDP_EINVAL};
    env_up_cfg(&e, &o, &o, NULL, &bad);
    assert_null(e.srv.p);
    assert_int_equal(e.srv.ready_rc, TDP_EINVAL);
    assert_null(e.cli.p);
    assert_int_equal(e.cli.ready_rc, TDP_ECONNRESET);
    env_down(&e);

    /* the dialer's plane cannot start: the dialer fails with its error */
    bad = (fake_cfg){.start_rc = TDP_EPROTO};
    env_up_cfg(&e, &o, &o, &bad, NULL);
    assert_null(e.cli.p);
    assert_int_equal(e.cli.ready_rc, TDP_EPROTO);
    if (e.srv.p != NULL) /* it may have opened before the BYE came */
        WAIT(&e, tdp_pipe_status(e.srv.p) == TDP_ECONNRESET);
    else
        assert_int_equal(e.srv.ready_rc, TDP_ECONNRESET);
    env_down(&e);
}

/*
 * A raw peer on the control socket: its HELLO offers `ids`; whatever the
 * pipe sends back is collected until it hangs up (or the peer gives up).
 */
typedef struct raw_peer {
    int fd;
    uint8_t in[4096];
    size_t nin;
    bool eof;
} raw_peer;

static void raw_up(env *e, raw_peer *rp, const uint8_t *ids, uint32_t nids)
{
    memset(e, 0, sizeof(*e));
    memset(rp, 0, sizeof(*rp));
    assert_int_equal(tdp_loop_new(NULL, &e->loop), TDP_OK);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(lfd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sl), 0);
    assert_int_equal(listen(lfd, 4), 0);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&sa, &sl), 0);
    rp->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_int_equal(connect(rp->fd, (struct sockaddr *)&sa, sl), 0); /* the backlog takes it */
    struct sockaddr_storage peer;
    socklen_t pl = sizeof(peer);
    int fd = accept4(lfd, (struct sockaddr *)&peer, &pl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    assert_true(fd >= 0);
    close(lfd);

    tdp_hello h = {.recv_depth = 1, .caps = TDP_CAP_MEM_HOST, .max_msg_bytes = 1u << 20};
    tdp__host_id(h.host_id);
    h.planes = ids;
    h.nplanes = nids;
    size_t n = tdp_wire_hello_size(&h);
    assert_true(n > 0 && n <= 1024);
    uint8_t buf[1024];
    assert_int_equal(tdp_wire_hello_encode(buf, &h), TDP_OK);
    assert_int_equal(send(rp->fd, buf, n, MSG_NOSIGNAL), (ssize_t)n);

    tdp_pipe_opts o = fake_opts(1), ro;
    tdp_schema_limits lim;
    tdp__opts_resolve(&o, &ro, &lim);
    tdp_err rc;
    tdp_pipe *p = tdp__session_new(e->loop, &ro, &lim, &rc);
    assert_non_null(p);
    assert_int_equal(tdp__session_accept(p, fd, (struct sockaddr *)&peer, on_ready, &e->srv),
                     TDP_OK);
    WAIT(e, e->srv.ready);
}

static bool raw_read(raw_peer *rp)
{
    ssize_t n = recv(rp->fd, rp->in + rp->nin, sizeof(rp->in) - rp->nin, MSG_DONTWAIT);
    if (n == 0)
        rp->eof = true;
    else if (n > 0)
        rp->nin += (size_t)n;
    return rp->eof || rp->nin == sizeof(rp->in);
}

/* The BYE among what the pipe sent (its HELLO first); false when there is none. */
static bool raw_bye(const raw_peer *rp, tdp_bye *b)
{
    size_t at = 0;
    while (rp->nin - at >= TDP_CTL_HDR_LEN) {
        tdp_ctl_hdr hdr;
        assert_int_equal(tdp_wire_ctl_hdr_decode(rp->in + at, &hdr), TDP_OK);
        assert_true(rp->nin - at >= TDP_CTL_HDR_LEN + hdr.length);
        if (hdr.type == TDP_CTL_BYE)
            return tdp_wire_bye_decode(rp->in + at + TDP_CTL_HDR_LEN, hdr.length, b) == TDP_OK;
        at += TDP_CTL_HDR_LEN + hdr.length;
    }
    return false;
}

/* The peer offers only planes this side does not allow: no pipe, and the peer is told. */
static void test_hello_peer_lacks_plane(void **state)
{
    env e;
    raw_peer rp;
    const uint8_t ucx_only[] = {TDP_PLANE_UCX};
    raw_up(&e, &rp, ucx_only, 1);
    assert_null(e.srv.p);
    assert_int_equal(e.srv.ready_rc, TDP_ENOTSUP);
    WAIT(&e, raw_read(&rp));
    assert_true(rp.eof);
    tdp_bye b;
    assert_true(raw_bye(&rp, &b));
    assert_int_equal(b.reason, TDP_ENOTSUP);
    close(rp.fd);
    env_down(&e);

    /* offered second, the one plane both allow is chosen */
    const uint8_t both[] = {TDP_PLANE_UCX, TDP__PLANE_TEST};
    raw_up(&e, &rp, both, 2);
    assert_int_equal(e.srv.ready_rc, TDP_OK);
    assert_int_equal(tdp_pipe_plane(e.srv.p), TDP__PLANE_TEST);
    tdp_op *r = new_op();
    tdp_pipe_recv_async(e.srv.p, r);
    close(rp.fd); /* the peer vanishes without a word */
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET);
    env_down(&e);
    tdp_op_free(r);
}

/* A side that opens first sends at once: the frames reach a link the HELLO has not started. */
static void test_frames_before_hello(void **state)
{
    env e = {0};
    tdp_schema *sc = host_bytes_schema(100);
    tdp_pipe_opts co = fake_opts(1), so = fake_opts(1);
    fake_cfg sync = {.sync_frames = true};
    e.cli.send_on_ready = e.srv.send_on_ready = sc;
    e.cli.ready_op = new_op();
    e.srv.ready_op = new_op();
    env_up_cfg(&e, &co, &so, &sync, &sync);
    assert_int_equal(e.cli.ready_rc, TDP_OK);
    assert_int_equal(e.srv.ready_rc, TDP_OK);
    /* whichever opened first sent its schema and data before the other had started */
    assert_int_equal(stats(&e, true)->rx_early + stats(&e, false)->rx_early, 2);
    tdp_op *r = new_op();
    recv_one(&e, e.cli.p, r, 1);
    recv_one(&e, e.srv.p, r, 1);
    WAIT(&e, done(e.cli.ready_op) && done(e.srv.ready_op));
    assert_int_equal(tdp_op_result(e.cli.ready_op), TDP_OK);
    assert_int_equal(tdp_op_result(e.srv.ready_op), TDP_OK);
    env_down(&e);
    tdp_op_free(r);
    tdp_op_free(e.cli.ready_op);
    tdp_op_free(e.srv.ready_op);
    tdp_schema_unref(sc);
}

/* ---- schema, data, sequence numbers ----------------------------------------------------- */

static void test_schema_once_then_data(void **state)
{
    env e = {0};
    env_up(&e, 1, 4);
    tdp_schema *a = host_bytes_schema(1000), *a2 = host_bytes_schema(1000),
               *b = host_bytes_schema(77);
    /* a, a again (another object, same layout), b, then a: schema frames for a, b, a */
    tdp_schema *plan[] = {a, a, a, a2, a2, b, b, a};
    const uint64_t schemas_after[] = {1, 1, 1, 1, 1, 2, 2, 3};
    tdp_op *s = new_op(), *r = new_op();
    for (uint64_t i = 0; i < 8; i++) {
        uint64_t seq = i + 1;
        send_one(e.cli.p, plan[i], seq, s);
        tdp_td *td = recv_one(&e, e.srv.p, r, seq);
        WAIT(&e, done(s));
        assert_int_equal(tdp_op_result(s), TDP_OK);
        assert_int_equal(tdp_op_seq(s), seq);
        assert_int_equal(tdp_td_nbytes(td), tdp_schema_total_bytes(plan[i]));
        assert_true(tdp_schema_equal(tdp_pipe_recv_schema(e.srv.p), plan[i]));
        assert_int_equal(stats(&e, true)->tx_schema, schemas_after[i]);
        assert_int_equal(stats(&e, false)->rx_schema, schemas_after[i]);
        assert_int_equal(stats(&e, true)->tx_data, seq);
        tdp_pipe_release(e.srv.p, td);
    }
    tdp_pipe_stats cs, ss;
    tdp_pipe_stats_get(e.cli.p, &cs);
    tdp_pipe_stats_get(e.srv.p, &ss);
    assert_int_equal(cs.msgs_sent, 8);
    assert_int_equal(cs.schemas_sent, 3);
    assert_int_equal(ss.msgs_recv, 8);
    assert_int_equal(ss.schemas_recv, 3);
    assert_int_equal(ss.bytes_recv, cs.bytes_sent);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(a);
    tdp_schema_unref(a2);
    tdp_schema_unref(b);
}

/* Both directions at once, each with its own numbering. */
static void test_both_directions(void **state)
{
    env e = {0};
    env_up(&e, 2, 2);
    tdp_schema *sc = host_bytes_schema(64);
    tdp_op *s1 = new_op(), *s2 = new_op(), *r1 = new_op(), *r2 = new_op();
    for (uint64_t seq = 1; seq <= 5; seq++) {
        send_one(e.cli.p, sc, seq, s1);
        send_one(e.srv.p, sc, seq, s2);
        tdp_td *a = recv_one(&e, e.srv.p, r1, seq);
        tdp_td *b = recv_one(&e, e.cli.p, r2, seq);
        WAIT(&e, done(s1) && done(s2));
        assert_int_equal(tdp_op_result(s1), TDP_OK);
        assert_int_equal(tdp_op_result(s2), TDP_OK);
        tdp_pipe_release(e.srv.p, a);
        tdp_pipe_release(e.cli.p, b);
    }
    env_down(&e);
    tdp_op_free(s1);
    tdp_op_free(s2);
    tdp_op_free(r1);
    tdp_op_free(r2);
    tdp_schema_unref(sc);
}

/* ---- credits ------------------------------------------------------------------------------ */

static void test_credit_blocks_at_depth(void **state)
{
    env e = {0};
    env_up(&e, 1, 2);
    tdp_schema *sc = host_bytes_schema(256);
    tdp_op *s[5], *r = new_op();
    for (int i = 0; i < 5; i++) {
        s[i] = new_op();
        send_one(e.cli.p, sc, (uint64_t)i + 1, s[i]);
    }
    WAIT(&e, done(s[0]) && done(s[1]));
    spin(&e, 20);
    /* the receiver holds two buffers: two sends went, the rest wait for credit */
    assert_int_equal(stats(&e, true)->tx_data, 2);
    assert_false(done(s[2]));
    assert_false(done(s[4]));
    tdp_pipe_stats cs;
    tdp_pipe_stats_get(e.cli.p, &cs);
    assert_int_equal(cs.credit_waits, 1);

    tdp_td *t1 = recv_one(&e, e.srv.p, r, 1);
    tdp_td_ref(t1);
    spin(&e, 10);
    assert_int_equal(stats(&e, true)->tx_data, 2); /* received but still lent: no credit */
    tdp_pipe_release(e.srv.p, t1);
    WAIT(&e, done(s[2]));
    assert_int_equal(stats(&e, true)->tx_data, 3);
    assert_int_equal(stats(&e, false)->last_credit_tx, 1);
    assert_false(done(s[3]));
    tdp_td_unref(t1);

    for (uint64_t seq = 2; seq <= 5; seq++)
        tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, seq));
    WAIT(&e, done(s[4]));
    for (int i = 0; i < 5; i++) {
        assert_int_equal(tdp_op_result(s[i]), TDP_OK);
        assert_int_equal(tdp_op_seq(s[i]), (uint64_t)i + 1);
    }
    assert_int_equal(stats(&e, true)->tx_data, 5);
    env_down(&e);
    for (int i = 0; i < 5; i++)
        tdp_op_free(s[i]);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* Depth 1: the next receive releases the last; its credit waits for the end of the turn. */
static void test_credit_depth1_blocking(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(300);
    tdp_op *s[3];
    for (int i = 0; i < 3; i++) {
        s[i] = new_op();
        send_one(e.cli.p, sc, (uint64_t)i + 1, s[i]);
    }
    tdp_td *prev = NULL;
    for (uint64_t seq = 1; seq <= 3; seq++) {
        tdp_td *td = NULL;
        assert_int_equal(tdp_pipe_recv(e.srv.p, TMO, &td), TDP_OK);
        assert_true(verify(td, seq));
        if (prev != NULL)
            assert_ptr_equal(td, prev); /* one buffer, overwritten by each receive */
        prev = td;
    }
    WAIT(&e, done(s[2]));
    for (int i = 0; i < 3; i++)
        assert_int_equal(tdp_op_result(s[i]), TDP_OK);
    assert_int_equal(stats(&e, false)->tx_credit, 2);
    env_down(&e);
    for (int i = 0; i < 3; i++)
        tdp_op_free(s[i]);
    tdp_schema_unref(sc);
}

/* A credit frame lost: the sender stays blocked until a DATA frame carries the count. */
static void test_credit_lost_rides_on_data(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(40);
    fake_cfg_of(fake_link_of(e.srv.p))->drop_credit = true;
    tdp_op *s1 = new_op(), *s2 = new_op(), *r = new_op(), *back = new_op();
    send_one(e.cli.p, sc, 1, s1);
    send_one(e.cli.p, sc, 2, s2);
    tdp_td *t = recv_one(&e, e.srv.p, r, 1);
    tdp_pipe_release(e.srv.p, t);
    spin(&e, 30);
    assert_int_equal(stats(&e, false)->credit_dropped, 1);
    assert_int_equal(stats(&e, true)->tx_data, 1);
    assert_false(done(s2));

    send_one(e.srv.p, sc, 1, back); /* carries "1 released" */
    WAIT(&e, done(s2));
    assert_int_equal(tdp_op_result(s2), TDP_OK);
    assert_int_equal(stats(&e, true)->tx_data, 2);
    recv_one(&e, e.srv.p, r, 2);
    recv_one(&e, e.cli.p, r, 1);
    env_down(&e);
    tdp_op_free(s1);
    tdp_op_free(s2);
    tdp_op_free(r);
    tdp_op_free(back);
    tdp_schema_unref(sc);
}

/* A plane without ops->credit (its releases tell the peer) and without loans of its own. */
static void test_plane_without_credit_op(void **state)
{
    fake_plane_install(false);
    env e = {0};
    env_up(&e, 1, 2);
    tdp_schema *sc = host_bytes_schema(128);
    tdp_op *s[4], *r = new_op();
    for (int i = 0; i < 4; i++) {
        s[i] = new_op();
        send_one(e.cli.p, sc, (uint64_t)i + 1, s[i]);
    }
    for (uint64_t seq = 1; seq <= 4; seq++)
        tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, seq));
    WAIT(&e, done(s[3]));
    assert_int_equal(stats(&e, false)->tx_credit, 4); /* one per release, by the plane */
    tdp_td *loan = NULL;
    assert_int_equal(tdp_pipe_loan(e.cli.p, sc, &loan), TDP_OK);
    assert_int_equal(stats(&e, true)->loans, 0); /* the session's own buffer */
    tdp_td_unref(loan);
    env_down(&e);
    for (int i = 0; i < 4; i++)
        tdp_op_free(s[i]);
    tdp_op_free(r);
    tdp_schema_unref(sc);
    fake_plane_install(true);
}

/* ---- lending --------------------------------------------------------------------------- */

static void test_lending_and_release(void **state)
{
    env e = {0};
    env_up(&e, 1, 3);
    tdp_schema *sc = host_bytes_schema(512);
    tdp_op *s = new_op(), *r = new_op();
    tdp_td *lent[3];
    for (uint64_t seq = 1; seq <= 3; seq++) {
        send_one(e.cli.p, sc, seq, s);
        lent[seq - 1] = recv_one(&e, e.srv.p, r, seq);
        WAIT(&e, done(s));
    }
    assert_true(lent[0] != lent[1] && lent[1] != lent[2] && lent[0] != lent[2]);
    /* out of order: the middle one comes back; the next message takes its buffer */
    tdp_pipe_release(e.srv.p, lent[1]);
    tdp_pipe_release(e.srv.p, lent[1]); /* twice: ignored */
    send_one(e.cli.p, sc, 4, s);
    tdp_td *t4 = recv_one(&e, e.srv.p, r, 4);
    assert_ptr_equal(t4, lent[1]);
    assert_true(verify(lent[0], 1));
    assert_true(verify(lent[2], 3));
    assert_int_equal(stats(&e, false)->releases, 1);

    /* a td the pipe never lent is ignored */
    tdp_td *stranger = msg(sc, 9);
    tdp_pipe_release(e.srv.p, stranger);
    tdp_td_unref(stranger);
    assert_int_equal(stats(&e, false)->releases, 1);

    tdp_pipe_release(e.srv.p, lent[0]);
    tdp_pipe_release(e.srv.p, lent[2]);
    tdp_pipe_release(e.srv.p, t4);
    assert_int_equal(stats(&e, false)->releases, 4);
    WAIT(&e, done(s));

    /* loans come from the plane while the pipe is open */
    tdp_td *loan = NULL;
    assert_int_equal(tdp_pipe_loan(e.cli.p, sc, &loan), TDP_OK);
    fill(loan, 5);
    tdp_pipe_send_async(e.cli.p, loan, s);
    tdp_td_unref(loan);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 5));
    assert_int_equal(stats(&e, true)->loans, 1);
    fake_cfg_of(fake_link_of(e.cli.p))->loan_rc = TDP_EAGAIN;
    assert_int_equal(tdp_pipe_loan(e.cli.p, sc, &loan), TDP_EAGAIN);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* A new layout while messages of the old one are lent: they keep theirs, untouched. */
static void test_schema_change_while_lent(void **state)
{
    env e = {0};
    env_up(&e, 1, 3);
    tdp_schema *a = host_bytes_schema(300), *b = host_bytes_schema(700);
    tdp_op *s = new_op(), *r = new_op();
    send_one(e.cli.p, a, 1, s);
    tdp_td *t1 = recv_one(&e, e.srv.p, r, 1);
    send_one(e.cli.p, b, 2, s);
    tdp_td *t2 = recv_one(&e, e.srv.p, r, 2);
    send_one(e.cli.p, a, 3, s);
    tdp_td *t3 = recv_one(&e, e.srv.p, r, 3);
    assert_true(tdp_schema_equal(tdp_td_schema(t1), a));
    assert_true(tdp_schema_equal(tdp_td_schema(t2), b));
    assert_true(tdp_schema_equal(tdp_td_schema(t3), a));
    assert_true(verify(t1, 1));
    assert_true(verify(t2, 2));
    assert_int_equal(stats(&e, false)->rx_schema, 3);
    tdp_pipe_release(e.srv.p, t2);
    tdp_pipe_release(e.srv.p, t1);
    send_one(e.cli.p, b, 4, s); /* into a buffer that held the other layout */
    tdp_td *t4 = recv_one(&e, e.srv.p, r, 4);
    assert_int_equal(tdp_td_nbytes(t4), tdp_schema_total_bytes(b));
    assert_true(verify(t3, 3));
    tdp_pipe_release(e.srv.p, t3);
    tdp_pipe_release(e.srv.p, t4);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(a);
    tdp_schema_unref(b);
}

/* ---- ending cleanly ----------------------------------------------------------------------- */

static void test_clean_close(void **state)
{
    env e = {0};
    env_up(&e, 1, 4);
    tdp_schema *sc = host_bytes_schema(100);
    tdp_op *s[3], *r = new_op();
    for (int i = 0; i < 3; i++) {
        s[i] = new_op();
        send_one(e.cli.p, sc, (uint64_t)i + 1, s[i]);
    }
    assert_int_equal(tdp_pipe_close(e.cli.p, TMO), TDP_OK);
    for (int i = 0; i < 3; i++)
        assert_int_equal(tdp_op_result(s[i]), TDP_OK);
    for (uint64_t seq = 1; seq <= 3; seq++)
        tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, seq));
    tdp_pipe_recv_async(e.srv.p, r);
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECLOSED);
    /* sends after the peer's BYE cannot go */
    send_one(e.srv.p, sc, 1, s[0]);
    WAIT(&e, done(s[0]));
    assert_int_equal(tdp_op_result(s[0]), TDP_ECLOSED);
    /* the end comes when the closer hangs up: the socket has the last word */
    spin(&e, 10);
    assert_false(e.srv.ended);
    tdp_pipe_free(e.cli.p);
    e.cli.p = NULL;
    WAIT(&e, e.srv.ended);
    assert_int_equal(e.srv.end_rc, TDP_ECLOSED);
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECLOSED);
    env_down(&e);
    for (int i = 0; i < 3; i++)
        tdp_op_free(s[i]);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* The BYE goes only after every send has completed. */
static void test_close_waits_for_sends(void **state)
{
    env e = {0};
    env_up(&e, 1, 4);
    tdp_schema *sc = host_bytes_schema(100);
    tdp__link *cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->hold_sent = true;
    tdp_op *s1 = new_op(), *s2 = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s1);
    send_one(e.cli.p, sc, 2, s2);
    tdp_pipe_close_async(e.cli.p, -1);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 1));
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 2));
    tdp_pipe_recv_async(e.srv.p, r);
    spin(&e, 30);
    assert_false(done(r)); /* no BYE yet: the transport still has both sends */
    assert_false(done(s1));
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_OK);
    assert_int_equal(fake_complete_sends(cl), 2);
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECLOSED);
    assert_int_equal(tdp_op_result(s1), TDP_OK);
    assert_int_equal(tdp_op_result(s2), TDP_OK);
    WAIT(&e, tdp_pipe_status(e.cli.p) != TDP_OK);
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_ECLOSED);
    /* the closer is told once the peer hangs up */
    spin(&e, 10);
    assert_false(e.cli.ended);
    tdp_pipe_free(e.srv.p);
    e.srv.p = NULL;
    WAIT(&e, e.cli.ended);
    assert_int_equal(e.cli.end_rc, TDP_OK);
    env_down(&e);
    tdp_op_free(s1);
    tdp_op_free(s2);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* The BYE overtakes the last frames: the receiver waits for them, then ends cleanly. */
static void test_bye_before_last_frames(void **state)
{
    env e = {0};
    env_up(&e, 1, 4);
    tdp_schema *sc = host_bytes_schema(100);
    tdp__link *cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->hold_frames = true;
    tdp_op *s1 = new_op(), *s2 = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s1);
    send_one(e.cli.p, sc, 2, s2);
    assert_int_equal(tdp_pipe_close(e.cli.p, TMO), TDP_OK);
    tdp_pipe_recv_async(e.srv.p, r);
    spin(&e, 30);
    assert_false(done(r));
    assert_int_equal(fake_flush(cl), 3); /* schema, data, data */
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_OK);
    assert_true(verify(tdp_op_td(r), 1));
    tdp_pipe_release(e.srv.p, tdp_op_td(r));
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 2));
    tdp_pipe_recv_async(e.srv.p, r);
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECLOSED);
    env_down(&e);
    tdp_op_free(s1);
    tdp_op_free(s2);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* ... and when they never come, the linger deadline ends the pipe as a failure. */
static void test_bye_frames_never_come(void **state)
{
    env e = {0};
    env_up(&e, 1, 4);
    tdp_schema *sc = host_bytes_schema(100);
    tdp__link *cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->hold_frames = true;
    tdp_op *s1 = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s1);
    int64_t t0 = mono_ms(); /* the receiver may read the BYE while this side closes */
    assert_int_equal(tdp_pipe_close(e.cli.p, TMO), TDP_OK);
    tdp_pipe_recv_async(e.srv.p, r);
    WAIT(&e, done(r));
    assert_true(mono_ms() - t0 >= LINGER - 5); /* clock rounding */
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET);
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECONNRESET);
    env_down(&e);
    tdp_op_free(s1);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* ---- closing with sends in flight --------------------------------------------------------- */

static void test_close_deadline_with_sends_stuck(void **state)
{
    env e = {0};
    tdp_schema *sc = host_bytes_schema(100);
    tdp_op *s1 = new_op(), *s2 = new_op(), *r = new_op();

    /* a blocking close gives up; the pipe stays closing and ends once the sends go */
    env_up(&e, 1, 4);
    tdp__link *cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->hold_sent = true;
    send_one(e.cli.p, sc, 1, s1);
    send_one(e.cli.p, sc, 2, s2);
    assert_int_equal(tdp_pipe_close(e.cli.p, 50), TDP_ETIMEDOUT);
    assert_false(done(s1));
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_OK);
    assert_int_equal(fake_complete_sends(cl), 2);
    WAIT(&e, tdp_pipe_status(e.cli.p) != TDP_OK);
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_ECLOSED);
    assert_int_equal(tdp_op_result(s1), TDP_OK);
    assert_int_equal(tdp_op_result(s2), TDP_OK);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 1));
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 2));
    env_down(&e);

    /* a close with a deadline: the pipe ends, the ops come back, the plane keeps the buffers */
    env_up(&e, 1, 4);
    cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->hold_sent = true;
    send_one(e.cli.p, sc, 1, s1);
    send_one(e.cli.p, sc, 2, s2);
    tdp_pipe_close_async(e.cli.p, 100);
    WAIT(&e, done(s1) && done(s2));
    assert_int_equal(tdp_op_result(s1), TDP_ETIMEDOUT);
    assert_int_equal(tdp_op_result(s2), TDP_ETIMEDOUT);
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_ETIMEDOUT);
    /* the close gave up and hung up: the peer's side ends at once, as a reset */
    WAIT(&e, tdp_pipe_status(e.srv.p) != TDP_OK);
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECONNRESET);
    spin(&e, 10);
    assert_int_equal(fake_live_links(), 1);       /* the dialer's link: closed, still busy */
    assert_int_equal(fake_complete_sends(cl), 2); /* completes after the close: no up-call */
    spin(&e, 10);
    assert_int_equal(fake_live_links(), 0);
    env_down(&e);

    tdp_op_free(s1);
    tdp_op_free(s2);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

static void test_free_with_ops_pending(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(100);
    fake_cfg_of(fake_link_of(e.cli.p))->hold_sent = true;
    tdp_op *s[3], *r = new_op(), *r2 = new_op();
    for (int i = 0; i < 3; i++) {
        s[i] = new_op();
        send_one(e.cli.p, sc, (uint64_t)i + 1, s[i]); /* 1 with the plane, 2 wait for credit */
    }
    tdp_pipe_recv_async(e.cli.p, r);
    spin(&e, 10);
    tdp_pipe_free(e.cli.p);
    e.cli.p = NULL;
    for (int i = 0; i < 3; i++)
        assert_int_equal(tdp_op_result(s[i]), TDP_ECANCELED);
    assert_int_equal(tdp_op_result(r), TDP_ECANCELED);
    /* the peer sees the socket go without a clean BYE */
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r2, 1));
    tdp_pipe_recv_async(e.srv.p, r2);
    WAIT(&e, done(r2));
    assert_int_equal(tdp_op_result(r2), TDP_ECONNRESET);
    env_down(&e);
    for (int i = 0; i < 3; i++)
        tdp_op_free(s[i]);
    tdp_op_free(r);
    tdp_op_free(r2);
    tdp_schema_unref(sc);
}

/* A timed-out blocking send is taken back, whether it waited for credit or the plane has it. */
static void test_blocking_send_timeouts(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(100);
    tdp__link *cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->hold_sent = true;
    tdp_td *td = msg(sc, 1);
    assert_int_equal(tdp_pipe_send(e.cli.p, td, 30), TDP_ETIMEDOUT); /* with the plane */
    tdp_td_unref(td);
    td = msg(sc, 2);
    assert_int_equal(tdp_pipe_send(e.cli.p, td, 30), TDP_ETIMEDOUT); /* no credit */
    tdp_td_unref(td);
    fake_cfg_of(cl)->hold_sent = false;
    assert_int_equal(fake_complete_sends(cl), 1);
    tdp_td *got = NULL;
    assert_int_equal(tdp_pipe_recv(e.srv.p, TMO, &got), TDP_OK);
    assert_true(verify(got, 1));
    /* the pipe goes on: the next send takes seq 2 (credit first: one thread drives both) */
    tdp_pipe_release(e.srv.p, got);
    td = msg(sc, 2);
    assert_int_equal(tdp_pipe_send(e.cli.p, td, TMO), TDP_OK);
    tdp_td_unref(td);
    assert_int_equal(tdp_pipe_recv(e.srv.p, TMO, &got), TDP_OK);
    assert_true(verify(got, 2));
    env_down(&e);
    tdp_schema_unref(sc);
}

/* ---- failures of the plane ----------------------------------------------------------------- */

/*
 * The peer fails the pipe while this side holds a lent message and has
 * another arrived but not yet received: both stay readable until
 * released, after the plane's link is gone.
 */
static void test_lent_survives_failure(void **state)
{
    env e = {0};
    env_up(&e, 1, 2);
    tdp_schema *sc = host_bytes_schema(4096);
    tdp_op *s1 = new_op(), *s2 = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s1);
    send_one(e.cli.p, sc, 2, s2);
    tdp_td *t1 = recv_one(&e, e.srv.p, r, 1);
    WAIT(&e, stats(&e, false)->rx_data == 2);
    tdp_pipe_abort(e.cli.p, TDP_ECANCELED);
    WAIT(&e, tdp_pipe_status(e.srv.p) != TDP_OK);
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECONNRESET);
    WAIT(&e, fake_live_links() == 0); /* both links are gone */
    assert_true(verify(t1, 1));
    tdp_td *t2 = recv_one(&e, e.srv.p, r, 2); /* arrived before the end: still delivered */
    tdp_pipe_recv_async(e.srv.p, r);
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET);
    assert_true(verify(t1, 1));
    assert_true(verify(t2, 2));
    tdp_pipe_release(e.srv.p, t1);
    tdp_pipe_release(e.srv.p, t2);
    env_down(&e);
    tdp_op_free(s1);
    tdp_op_free(s2);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

static void test_plane_fails_mid_receive(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(1000);
    tdp__link *sl = fake_link_of(e.srv.p);
    fake_cfg_of(sl)->rndv = true;
    fake_cfg_of(sl)->hold_landing = true;
    tdp_op *s = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s);
    tdp_pipe_recv_async(e.srv.p, r);
    WAIT(&e, stats(&e, false)->recvs == 1);
    fake_fail(sl, TDP_ECONNRESET, "peer gone");
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET);
    assert_null(tdp_op_td(r));
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECONNRESET);
    assert_int_equal(fake_land(sl), 1); /* lands after the close: nobody is told */
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

static void test_landing_fails(void **state)
{
    env e = {0};
    env_up(&e, 1, 2);
    tdp_schema *sc = host_bytes_schema(1000);
    tdp__link *sl = fake_link_of(e.srv.p);
    fake_cfg_of(sl)->rndv = true;
    tdp_op *s = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 1)); /* a late landing that works */
    fake_cfg_of(sl)->land_status = TDP_ECONNRESET;
    send_one(e.cli.p, sc, 2, s);
    tdp_pipe_recv_async(e.srv.p, r);
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET); /* never the half-filled buffer */
    assert_null(tdp_op_td(r));
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECONNRESET);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* The plane fails with nothing in flight: the control socket decides how it ended. */
static void test_plane_fails_idle_then_bye(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(10);
    tdp_op *s = new_op(), *r = new_op();
    send_one(e.cli.p, sc, 1, s);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 1));
    WAIT(&e, done(s));
    tdp_pipe_recv_async(e.srv.p, r);
    fake_fail(fake_link_of(e.srv.p), TDP_ECONNRESET, "peer gone");
    spin(&e, 10);
    assert_false(done(r));
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_OK);
    send_one(e.srv.p, sc, 1, s); /* waits for the verdict: nothing goes on a failed plane */
    spin(&e, 10);
    assert_false(done(s));
    assert_int_equal(stats(&e, false)->tx_data, 0);
    tdp_td *loan;
    assert_int_equal(tdp_pipe_loan(e.srv.p, sc, &loan), TDP_ECONNRESET);
    assert_int_equal(tdp_pipe_close(e.cli.p, TMO), TDP_OK); /* BYE: a clean end after all */
    WAIT(&e, done(r) && done(s));
    assert_int_equal(tdp_op_result(r), TDP_ECLOSED);
    assert_int_equal(tdp_op_result(s), TDP_ECLOSED); /* the receiver closed the stream */
    WAIT(&e, tdp_pipe_status(e.srv.p) != TDP_OK);
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECLOSED);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

static void test_plane_fails_idle_peer_silent(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(10);
    tdp_op *r = new_op(), *s = new_op();
    tdp_pipe_recv_async(e.srv.p, r);
    int64_t t0 = mono_ms();
    fake_fail(fake_link_of(e.srv.p), TDP_ECONNRESET, "peer gone");
    send_one(e.srv.p, sc, 1, s); /* waits for the verdict, which never comes */
    WAIT(&e, done(r) && done(s));
    assert_true(mono_ms() - t0 >= LINGER - 5); /* clock rounding */
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET);
    assert_int_equal(tdp_op_result(s), TDP_ECONNRESET);
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ECONNRESET);
    env_down(&e);
    tdp_op_free(r);
    tdp_op_free(s);
    tdp_schema_unref(sc);
}

static void test_send_errors(void **state)
{
    env e = {0};
    tdp_schema *sc = host_bytes_schema(10);
    tdp_op *s = new_op(), *r = new_op();

    /* a send whose completion fails: the op says so */
    env_up(&e, 1, 1);
    fake_cfg_of(fake_link_of(e.cli.p))->sent_status = TDP_ECLOSED;
    send_one(e.cli.p, sc, 1, s);
    WAIT(&e, done(s));
    assert_int_equal(tdp_op_result(s), TDP_ECLOSED);
    env_down(&e);

    /* the plane refuses the send: the op and the pipe fail */
    env_up(&e, 1, 1);
    fake_cfg_of(fake_link_of(e.cli.p))->send_rc = TDP_ECONNRESET;
    tdp_pipe_recv_async(e.cli.p, r);
    send_one(e.cli.p, sc, 1, s);
    WAIT(&e, done(s) && done(r));
    assert_int_equal(tdp_op_result(s), TDP_ECONNRESET);
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET);
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_ECONNRESET);
    env_down(&e);

    /* a message too large for the plane */
    env_up(&e, 1, 1);
    fake_cfg_of(fake_link_of(e.cli.p))->send_rc = TDP_EMSGSIZE;
    send_one(e.cli.p, sc, 1, s);
    WAIT(&e, done(s));
    assert_int_equal(tdp_op_result(s), TDP_EMSGSIZE);
    assert_int_equal(tdp_pipe_status(e.cli.p), TDP_EMSGSIZE);
    tdp_pipe_recv_async(e.srv.p, r); /* the peer is told with BYE */
    WAIT(&e, done(r));
    assert_int_equal(tdp_op_result(r), TDP_ECONNRESET);
    env_down(&e);

    /* sends complete inside ops->send: the session takes it in its stride */
    env_up(&e, 1, 2);
    fake_cfg_of(fake_link_of(e.cli.p))->sent_inline = true;
    tdp_op *ss[4];
    for (int i = 0; i < 4; i++) {
        ss[i] = new_op();
        send_one(e.cli.p, sc, (uint64_t)i + 1, ss[i]);
    }
    assert_int_equal(tdp_op_result(ss[0]), TDP_OK);
    assert_int_equal(tdp_op_result(ss[1]), TDP_OK);
    for (uint64_t seq = 1; seq <= 4; seq++)
        tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, seq));
    WAIT(&e, done(ss[3]));
    assert_int_equal(tdp_op_result(ss[3]), TDP_OK);
    assert_int_equal(tdp_pipe_close(e.cli.p, TMO), TDP_OK);
    env_down(&e);
    for (int i = 0; i < 4; i++)
        tdp_op_free(ss[i]);

    /*
     * ... and never by recursion: sends wait for credit, the peer gives
     * back four at once, and every send completes inside ops->send; the
     * session sends the next one after ops->send returned, not from inside
     * the completion of the one before.
     */
    env_up(&e, 1, 4);
    tdp__link *cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->sent_inline = true;
    tdp_op *many[12];
    for (int i = 0; i < 12; i++) {
        many[i] = new_op();
        send_one(e.cli.p, sc, (uint64_t)i + 1, many[i]);
    }
    tdp_td *got[4];
    for (uint64_t seq = 1; seq <= 4; seq++)
        got[seq - 1] = recv_one(&e, e.srv.p, r, seq);
    assert_int_equal(fake_stats_of(cl)->tx_data, 4); /* the rest wait for credit */
    /* the first three CREDIT frames are lost: the fourth gives all four back */
    fake_cfg *scfg = fake_cfg_of(fake_link_of(e.srv.p));
    scfg->drop_credit = true;
    for (int i = 0; i < 3; i++)
        tdp_pipe_release(e.srv.p, got[i]);
    scfg->drop_credit = false;
    tdp_pipe_release(e.srv.p, got[3]);
    WAIT(&e, fake_stats_of(cl)->tx_data == 8);
    for (uint64_t seq = 5; seq <= 12; seq++)
        tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, seq));
    for (int i = 0; i < 12; i++) {
        WAIT(&e, done(many[i]));
        assert_int_equal(tdp_op_result(many[i]), TDP_OK);
    }
    assert_int_equal(fake_stats_of(cl)->max_send_depth, 1);
    env_down(&e);
    for (int i = 0; i < 12; i++)
        tdp_op_free(many[i]);

    tdp_op_free(s);
    tdp_op_free(r);
    tdp_schema_unref(sc);
}

/* The receiving side's plane cannot store a layout, or cannot send a credit. */
static void test_plane_refuses_storage_or_credit(void **state)
{
    env e = {0};
    tdp_schema *sc = host_bytes_schema(64);
    tdp_op *s = new_op(), *r = new_op(), *pr = new_op();

    env_up(&e, 1, 2);
    fake_cfg_of(fake_link_of(e.srv.p))->rx_schema_rc = TDP_ENOMEM;
    tdp_pipe_recv_async(e.srv.p, r);
    tdp_pipe_recv_async(e.cli.p, pr);
    send_one(e.cli.p, sc, 1, s);
    WAIT(&e, done(r) && done(pr));
    assert_int_equal(tdp_op_result(r), TDP_ENOMEM);
    assert_int_equal(tdp_pipe_status(e.srv.p), TDP_ENOMEM);
    assert_int_equal(tdp_op_result(pr), TDP_ECONNRESET); /* told in BYE */
    env_down(&e);

    /* a credit that cannot go: the plane is taken as failed, the socket decides */
    env_up(&e, 1, 2);
    fake_cfg_of(fake_link_of(e.srv.p))->credit_rc = TDP_ECONNRESET;
    send_one(e.cli.p, sc, 1, s);
    tdp_pipe_release(e.srv.p, recv_one(&e, e.srv.p, r, 1));
    WAIT(&e, done(s));
    tdp_pipe_recv_async(e.srv.p, r);
    send_one(e.srv.p, sc, 1, s); /* waits for the verdict */
    spin(&e, 10);
    assert_false(done(r));
    assert_false(done(s));
    assert_int_equal(tdp_pipe_close(e.cli.p, TMO), TDP_OK);
    WAIT(&e, done(r) && done(s));
    assert_int_equal(tdp_op_result(r), TDP_ECLOSED);
    assert_int_equal(tdp_op_result(s), TDP_ECLOSED);
    env_down(&e);

    tdp_op_free(s);
    tdp_op_free(r);
    tdp_op_free(pr);
    tdp_schema_unref(sc);
}

/* ---- a hostile peer plane ----------------------------------------------------------- */

enum prime { NONE, ONE_MSG };

typedef struct hostile {
    const char *name;
    enum prime prime; /* ONE_MSG: seq 1 delivered (and kept lent) first */
    bool to_cli;      /* the frame goes to the sender's link instead */
    uint32_t depth;   /* the victim's receive depth */
    uint8_t type;
    enum { H_OK, H_HASH, H_ZERO } hash; /* the schema's hash, a wrong one, 0 */
    uint64_t seq;
    int64_t length; /* -1: the payload's size */
    int64_t arg;    /* -1: the schema's total bytes */
    enum { P_JSON, P_DATA, P_BIG, P_SHORT, P_GARBAGE, P_NONE } payload;
    tdp_err want;
} hostile;

static const hostile cases[] = {
    {"data before schema", NONE, false, 2, TDP_AM_DATA, H_OK, 1, -1, 0, P_DATA, TDP_EMISMATCH},
    {"schema wrong hash", NONE, false, 2, TDP_AM_SCHEMA, H_HASH, 1, -1, -1, P_JSON, TDP_ESCHEMA},
    {"schema wrong size", NONE, false, 2, TDP_AM_SCHEMA, H_OK, 1, -1, 5, P_JSON, TDP_ESCHEMA},
    {"schema garbage", NONE, false, 2, TDP_AM_SCHEMA, H_ZERO, 1, -1, 8, P_GARBAGE, TDP_ESCHEMA},
    {"schema out of seq", NONE, false, 2, TDP_AM_SCHEMA, H_OK, 2, -1, -1, P_JSON, TDP_EPROTO},
    {"schema cut short", NONE, false, 2, TDP_AM_SCHEMA, H_OK, 1, 4096, -1, P_JSON, TDP_EPROTO},
    {"schema over limits", NONE, false, 2, TDP_AM_SCHEMA, H_OK, 1, -1, INT64_MAX, P_JSON,
     TDP_EMSGSIZE},
    {"data duplicate seq", ONE_MSG, false, 2, TDP_AM_DATA, H_OK, 1, -1, 0, P_DATA, TDP_EPROTO},
    {"data seq gap", ONE_MSG, false, 2, TDP_AM_DATA, H_OK, 3, -1, 0, P_DATA, TDP_EPROTO},
    {"data oversized", ONE_MSG, false, 2, TDP_AM_DATA, H_OK, 2, -1, 0, P_BIG, TDP_EMSGSIZE},
    {"data undersized", ONE_MSG, false, 2, TDP_AM_DATA, H_OK, 2, -1, 0, P_SHORT, TDP_EMSGSIZE},
    {"data length lies", ONE_MSG, false, 2, TDP_AM_DATA, H_OK, 2, INT64_MAX, 0, P_DATA,
     TDP_EMSGSIZE},
    {"data other schema", ONE_MSG, false, 2, TDP_AM_DATA, H_HASH, 2, -1, 0, P_DATA, TDP_EMISMATCH},
    {"data beyond credit", ONE_MSG, false, 1, TDP_AM_DATA, H_OK, 2, -1, 0, P_DATA, TDP_EPROTO},
    {"credit beyond sent", NONE, true, 2, TDP_AM_CREDIT, H_ZERO, 0, 0, 5, P_NONE, TDP_EPROTO},
    {"credit backwards", ONE_MSG, true, 2, TDP_AM_CREDIT, H_ZERO, 0, 0, 0, P_NONE, TDP_EPROTO},
    {"unknown frame type", NONE, false, 2, 9, H_ZERO, 1, 0, 0, P_NONE, TDP_EPROTO},
};

static void run_hostile(const hostile *c)
{
    env e = {0};
    tdp_schema *sc = host_bytes_schema(200), *other = host_bytes_schema(201);
    tdp_op *s = new_op(), *r = new_op(), *pr = new_op();
    tdp_td *kept = NULL;
    print_message("hostile: %s\n", c->name);
    env_up(&e, 2, c->depth);
    if (c->prime == ONE_MSG) {
        send_one(e.cli.p, sc, 1, s);
        kept = tdp_td_ref(recv_one(&e, e.srv.p, r, 1)); /* lent, not released */
        WAIT(&e, done(s));
        if (c->to_cli) { /* the receiver gives the buffer back: credit 1 */
            tdp_pipe_release(e.srv.p, kept);
            WAIT(&e, stats(&e, false)->tx_credit == 1 && stats(&e, true)->rx_credit == 1);
        }
    }
    side *victim = c->to_cli ? &e.cli : &e.srv, *peer = c->to_cli ? &e.srv : &e.cli;
    /* depth 1 with a message lent: a receive would release it, so wait on the status */
    bool watch_recv = !(c->depth == 1 && c->prime == ONE_MSG);
    if (watch_recv)
        tdp_pipe_recv_async(victim->p, r);
    tdp_pipe_recv_async(peer->p, pr);

    size_t jl;
    const char *json = tdp_schema_json(sc, &jl);
    size_t total = (size_t)tdp_schema_total_bytes(sc);
    uint8_t data[1024];
    assert_true(total + 64 <= sizeof(data));
    memset(data, 0x5a, sizeof(data));
    const void *payload = NULL;
    size_t len = 0;
    switch (c->payload) {
    case P_JSON:
        payload = json;
        len = jl;
        break;
    case P_DATA:
        payload = data;
        len = total;
        break;
    case P_BIG:
        payload = data;
        len = total + 64;
        break;
    case P_SHORT:
        payload = data;
        len = total - 1;
        break;
    case P_GARBAGE:
        payload = "{\"not\": a schema";
        len = strlen(payload);
        break;
    case P_NONE:
        break;
    }
    tdp__frame f = {
        .type = c->type,
        .seq = c->seq,
        .hash = c->hash == H_OK     ? tdp_schema_hash(sc)
                : c->hash == H_HASH ? tdp_schema_hash(other)
                                    : 0,
        .length = c->length < 0 ? len : (uint64_t)c->length,
        .arg = c->arg < 0 ? tdp_schema_total_bytes(sc) : (uint64_t)c->arg,
    };
    fake_inject(fake_link_of(victim->p), &f, payload, len);

    if (watch_recv) {
        WAIT(&e, done(r));
        assert_int_equal(tdp_op_result(r), c->want);
        assert_null(tdp_op_td(r));
    }
    WAIT(&e, tdp_pipe_status(victim->p) != TDP_OK);
    assert_int_equal(tdp_pipe_status(victim->p), c->want);
    /* the peer is told why in BYE, and ends as reset */
    WAIT(&e, done(pr));
    assert_int_equal(tdp_op_result(pr), TDP_ECONNRESET);
    /* what the application holds was not written */
    if (kept != NULL) {
        assert_true(verify(kept, 1));
        tdp_td_unref(kept);
    }
    assert_int_equal(fake_guard_errors(), 0);
    env_down(&e);
    tdp_op_free(s);
    tdp_op_free(r);
    tdp_op_free(pr);
    tdp_schema_unref(sc);
    tdp_schema_unref(other);
}

static void test_hostile_frames(void **state)
{
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        run_hostile(&cases[i]);
}

/* A frame for a link that no longer exists is dropped; nothing reaches a freed pipe. */
static void test_frames_after_end(void **state)
{
    env e = {0};
    env_up(&e, 1, 1);
    tdp_schema *sc = host_bytes_schema(50);
    tdp__link *cl = fake_link_of(e.cli.p);
    fake_cfg_of(cl)->hold_frames = true;
    tdp_op *s = new_op();
    send_one(e.cli.p, sc, 1, s);
    WAIT(&e, done(s));
    assert_int_equal(fake_stats_of(cl)->tx_data, 1);
    tdp_pipe_free(e.srv.p);
    e.srv.p = NULL;
    spin(&e, 5);
    assert_int_equal(fake_flush(cl), 2); /* to a link that is gone: dropped */
    spin(&e, 5);
    env_down(&e);
    tdp_op_free(s);
    tdp_schema_unref(sc);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hello_opens_on_fake, setup, teardown),
        cmocka_unit_test_setup_teardown(test_registry_full, setup, teardown),
        cmocka_unit_test(test_tcp_plane_choice_rule),
        cmocka_unit_test_setup_teardown(test_memory_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hello_plane_record_malformed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hello_no_common_plane, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hello_plane_refuses, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hello_peer_lacks_plane, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frames_before_hello, setup, teardown),
        cmocka_unit_test_setup_teardown(test_schema_once_then_data, setup, teardown),
        cmocka_unit_test_setup_teardown(test_both_directions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_credit_blocks_at_depth, setup, teardown),
        cmocka_unit_test_setup_teardown(test_credit_depth1_blocking, setup, teardown),
        cmocka_unit_test_setup_teardown(test_credit_lost_rides_on_data, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plane_without_credit_op, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lending_and_release, setup, teardown),
        cmocka_unit_test_setup_teardown(test_schema_change_while_lent, setup, teardown),
        cmocka_unit_test_setup_teardown(test_clean_close, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_waits_for_sends, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bye_before_last_frames, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bye_frames_never_come, setup, teardown),
        cmocka_unit_test_setup_teardown(test_close_deadline_with_sends_stuck, setup, teardown),
        cmocka_unit_test_setup_teardown(test_free_with_ops_pending, setup, teardown),
        cmocka_unit_test_setup_teardown(test_blocking_send_timeouts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lent_survives_failure, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plane_fails_mid_receive, setup, teardown),
        cmocka_unit_test_setup_teardown(test_landing_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plane_fails_idle_then_bye, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plane_fails_idle_peer_silent, setup, teardown),
        cmocka_unit_test_setup_teardown(test_send_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plane_refuses_storage_or_credit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hostile_frames, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frames_after_end, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
