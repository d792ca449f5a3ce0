/*
 * test_pipe: the pipe conformance suite. ctest runs it once per UCX
 * transport set (UCX_TLS=tcp, UCX_TLS=shm,self... see CMakeLists.txt).
 * Loopback only, ephemeral ports, every wait bounded.
 */
#include <dirent.h>
#include <errno.h>
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
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "test_skip.h"
#include "test_rogue_am.h"
#include "test_util.h"
#include "test_ctl_frame.h"

#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "core/cuda.h"
#include "pipe/op.h"
#include "pipe/shm/plane_shm.h"
#include "pipe/ucx/plane_ucx.h"
#include "pipe/session.h"
#include "pipe/ucx/ucx_workers.h"

#define TMO 20000 /* ms: generous bound for any single wait in this suite */

/* ThreadSanitizer maps shadow memory for every fresh page and slows each
 * copy tenfold; a 256 MiB message there takes tens of seconds on two busy
 * cores.  The largest sizes shrink under it (still far above the 4 MiB
 * chunk size, so the same paths run) and the wait for one message grows. */
#ifdef UNDER_TSAN /* test_skip.h */
#define LARGE_BYTES (64ll << 20)
#define LARGE_TMO 180000
#else
#define LARGE_BYTES (256ll << 20)
#define LARGE_TMO 60000
#endif

/*
 * TDP_TEST_MEM=cuda: the device-memory mode. The schemas' device is cuda:0
 * (on the fake device where no GPU exists: its memory faults when host
 * code touches it), and fill() / verify() reach the payload through copies,
 * never directly. Cases that do not apply to device buffers are skipped
 * with their reason (main, host_only).
 */
static bool dev_mode;

static tdp_schema *on_test_device(tdp_schema *s)
{
    if (!dev_mode)
        return s;
    tdp_schema *d = NULL;
    assert_int_equal(tdp_schema_with_device(s, (tdp_device){TDP_DEVICE_CUDA, 0}, &d), TDP_OK);
    tdp_schema_unref(s);
    return d;
}

/* ---- schemas and payload patterns ------------------------------------------- */

/* variant picks one of several layouts that differ in one way each */
static tdp_schema *make_schema(int variant, int64_t n)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    const int64_t batch[] = {4};
    int64_t obs[] = {4, n}, lab[] = {4};
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_node(b, "", NULL, 1, batch), TDP_OK);
    if (variant == 1)
        obs[1] = n + 3; /* shape change */
    assert_int_equal(tdp_schema_builder_tensor(b, "obs", variant == 2 ? TDP_FLOAT64 : TDP_FLOAT32,
                                               2, obs),
                     TDP_OK); /* variant 2: dtype change */
    if (variant != 4)         /* variant 4: key removed */
        assert_int_equal(tdp_schema_builder_tensor(b, "label", TDP_INT64, 1, lab), TDP_OK);
    if (variant == 3) /* key added */
        assert_int_equal(tdp_schema_builder_tensor(b, "extra", TDP_UINT8, 1, lab), TDP_OK);
    assert_int_equal(tdp_schema_builder_node(b, "meta", variant == 5 ? "Renamed" : "Meta", 1,
                                             batch),
                     TDP_OK); /* variant 5: class name */
    assert_int_equal(tdp_schema_builder_tensor(b, "meta.weight", TDP_BFLOAT16, 1, lab), TDP_OK);
    assert_int_equal(tdp_schema_builder_string(b, "meta.source", "unit test"), TDP_OK);
    assert_int_equal(tdp_schema_builder_int(b, "meta.epoch", 7), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    return on_test_device(s);
}

static tdp_schema *bytes_schema(int64_t nbytes)
{
    return on_test_device(host_bytes_schema(nbytes));
}

static bool on_device(const tdp_td *td)
{
    return tdp_td_device(td).type == TDP_DEVICE_CUDA;
}

/* A pattern that depends on the sequence number: a stale buffer fails it. */
static void fill_host(uint8_t *p, uint64_t n, uint64_t seq)
{
    uint64_t x = seq * 0x9E3779B97F4A7C15ull;
    for (uint64_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = x ^ (i * 0xBF58476D1CE4E5B9ull);
        memcpy(p + i, &v, 8);
    }
    for (uint64_t i = n & ~7ull; i < n; i++)
        p[i] = (uint8_t)(seq + i);
}

static bool verify_host(const uint8_t *p, uint64_t n, uint64_t seq)
{
    uint64_t x = seq * 0x9E3779B97F4A7C15ull;
    for (uint64_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = x ^ (i * 0xBF58476D1CE4E5B9ull), got;
        memcpy(&got, p + i, 8);
        if (got != v)
            return false;
    }
    for (uint64_t i = n & ~7ull; i < n; i++)
        if (p[i] != (uint8_t)(seq + i))
            return false;
    return true;
}

/* Device buffers are written through a host copy (touching them faults). */
static void fill(tdp_td *td, uint64_t seq)
{
    uint64_t n = tdp_td_nbytes(td);
    if (!on_device(td)) {
        fill_host(tdp_td_data(td), n, seq);
        return;
    }
    uint8_t *h = malloc(n > 0 ? n : 1);
    assert_non_null(h);
    fill_host(h, n, seq);
    assert_int_equal(tdp_mem_copy(tdp_td_data(td), h, n), TDP_OK);
    free(h);
}

static bool verify(const tdp_td *td, uint64_t seq)
{
    uint64_t n = tdp_td_nbytes(td);
    if (!on_device(td))
        return verify_host(tdp_td_data(td), n, seq);
    uint8_t *h = malloc(n > 0 ? n : 1);
    assert_non_null(h);
    assert_int_equal(tdp_mem_copy(h, tdp_td_data(td), n), TDP_OK);
    bool ok = verify_host(h, n, seq);
    free(h);
    return ok;
}

/*
 * TDP_TEST_PEER_MODE=ucx runs the suite with UCX's peer-failure mode;
 * TDP_TEST_PLANE=NAME forces a data plane (else both sides choose).
 */
static tdp_plane test_plane(void)
{
    const char *n = getenv("TDP_TEST_PLANE");
    tdp_plane pl = TDP_PLANE_AUTO;
    if (n != NULL)
        assert_int_equal(tdp_plane_parse(n, &pl), TDP_OK);
    return pl;
}

static const tdp_pipe_opts *mode_opts(const tdp_pipe_opts *o, tdp_pipe_opts *buf)
{
    const char *m = getenv("TDP_TEST_PEER_MODE");
    if (o != NULL)
        *buf = *o;
    else
        tdp_pipe_opts_default(buf);
    /* the conformance suite holds each side to recv_depth (in place at
     * depth 1, credit per buffer); test_window covers the receive window */
    buf->recv_window_bytes = 0;
    if (m != NULL && strcmp(m, "ucx") == 0)
        buf->peer_mode = TDP_PEER_UCX;
    if (buf->plane == TDP_PLANE_AUTO)
        buf->plane = test_plane();
    if (dev_mode && !buf->cuda_device_set) {
        /* the payloads' GPU, as the CLI's --mem cuda names it */
        buf->cuda_device_set = true;
        buf->cuda_device = 0;
    }
    return buf;
}

/* ---- environment: two loops on their own threads, one pipe between them ------- */

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
} env;

static void env_up(env *e, const tdp_pipe_opts *so, const tdp_pipe_opts *co)
{
    tdp_pipe_opts sb, cb;
    so = mode_opts(so, &sb);
    co = mode_opts(co, &cb);
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(e->sl, "127.0.0.1", 0, so, NULL, NULL, &e->l), TDP_OK);
    assert_true(tdp_listener_port(e->l) > 0);
    assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), co, &e->cli),
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

/* A thread that sends `count` messages, cycling through tds, then closes. */
typedef struct sender {
    pthread_t th;
    tdp_pipe *pipe;
    tdp_td **tds;
    int ntds;
    int per_td; /* messages before moving to the next td */
    int count;
    bool close;
    tdp_err rc;
    int sent;
} sender;

static void *sender_main(void *arg)
{
    sender *s = arg;
    s->rc = TDP_OK;
    for (int i = 0; i < s->count; i++) {
        tdp_td *td = s->tds[(i / s->per_td) % s->ntds];
        fill(td, (uint64_t)i + 1);
        s->rc = tdp_pipe_send(s->pipe, td, TMO);
        if (s->rc != TDP_OK)
            return NULL;
        s->sent++;
    }
    if (s->close)
        s->rc = tdp_pipe_close(s->pipe, TMO);
    return NULL;
}

static void sender_start(sender *s)
{
    if (s->per_td == 0)
        s->per_td = 1;
    assert_int_equal(pthread_create(&s->th, NULL, sender_main, s), 0);
}

/* ---- tests ---------------------------------------------------------------------- */

static void test_handshake(void **state)
{
    env e;
    char buf[80];
    env_up(&e, NULL, NULL);
    assert_true(tdp_pipe_same_host(e.cli));
    assert_true(tdp_pipe_same_host(e.srv));
    /* both sides chose the same plane: the one forced, else on one host
     * cuda-ipc for a pipe that names its GPU, shm for one that does not */
    tdp_plane want = test_plane() != TDP_PLANE_AUTO ? test_plane()
                     : dev_mode                     ? TDP_PLANE_CUDA_IPC
                                                    : TDP_PLANE_SHM;
    assert_int_equal(tdp_pipe_plane(e.cli), want);
    assert_int_equal(tdp_pipe_plane(e.srv), want);
    print_message("plane %s\n", tdp_plane_name(want));
    if (want != TDP_PLANE_UCX) {
        env_down(&e);
        return;
    }
    /* both sides agree: a shared-memory worker of the link's own when both
     * have the transports (same host), else the general worker; UCX's
     * peer-failure mode on either */
    const char *m = getenv("TDP_TEST_PEER_MODE");
    bool forced = m != NULL && strcmp(m, "ucx") == 0;
    tdp__ucx *ucx = tdp__ucx_peek(e.sl);
    bool local = !forced && ucx != NULL && ucx->nworkers > TDP_WORKER_LOCAL &&
                 ucx->worker[TDP_WORKER_LOCAL] != NULL;
    print_message("same-host pipe on the %s worker\n", local ? "shared-memory" : "general");
    tdp__link *cl = tdp__session_link(e.cli), *sl = tdp__session_link(e.srv);
    assert_int_equal(tdp__ucx_link_worker(cl), local ? TDP_WORKER_LOCAL : TDP_WORKER_ANY);
    assert_int_equal(tdp__ucx_link_worker(sl), tdp__ucx_link_worker(cl));
    assert_true(tdp__ucx_link_peer_mode(cl));
    assert_true(tdp__ucx_link_peer_mode(sl));
    assert_non_null(strstr(tdp_pipe_peer(e.cli, buf, sizeof(buf)), "127.0.0.1:"));
    assert_int_equal(tdp_pipe_status(e.cli), TDP_OK);
    assert_null(tdp_pipe_recv_schema(e.srv));
    env_down(&e);
}

static void test_steady_1000(void **state)
{
    env e;
    tdp_schema *s = make_schema(0, 1000);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    env_up(&e, NULL, NULL);
    sender snd = {.pipe = e.cli, .tds = &td, .ntds = 1, .count = 1000, .close = true};
    sender_start(&snd);
    tdp_td *got, *first = NULL;
    for (uint64_t i = 1; i <= 1000; i++) {
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        if (first == NULL)
            first = got;
        assert_ptr_equal(got, first); /* depth 1: received in place, same storage */
        assert_true(tdp_schema_equal(tdp_td_schema(got), s));
        assert_true(verify(got, i));
    }
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED); /* clean end */
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED); /* and it stays ended */
    pthread_join(snd.th, NULL);
    assert_int_equal(snd.rc, TDP_OK);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(e.srv, &st);
    assert_int_equal(st.msgs_recv, 1000);
    assert_int_equal(st.schemas_recv, 1);
    assert_int_equal(st.bytes_recv, 1000 * tdp_schema_total_bytes(s));
    tdp_pipe_stats_get(e.cli, &st);
    assert_int_equal(st.schemas_sent, 1);
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* opts.latency_stats: one value per message, on both sides; off: ENOTSUP. */
static void test_latency_stats(void **state)
{
    enum { N = 300 };
    env e;
    tdp_pipe_opts so, co;
    tdp_pipe_opts_default(&so);
    tdp_pipe_opts_default(&co);
    so.recv_depth = 4;
    so.latency_stats = co.latency_stats = true;
    tdp_schema *s = bytes_schema(4096);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    env_up(&e, &so, &co);
    sender snd = {.pipe = e.cli, .tds = &td, .ntds = 1, .count = N, .close = true};
    sender_start(&snd);
    for (uint64_t i = 1; i <= N; i++) {
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(verify(got, i));
        if (i % 50 == 0)
            usleep(2000); /* let a few queue in the ring: a longer receive wait */
        tdp_pipe_release(e.srv, got);
    }
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED);
    pthread_join(snd.th, NULL);
    assert_int_equal(snd.rc, TDP_OK);

    tdp_hist *h = malloc(sizeof(*h));
    tdp_hist_summary sm;
    assert_non_null(h);
    assert_int_equal(tdp_pipe_latency_get(e.cli, TDP_LAT_SEND, h), TDP_OK);
    tdp_hist_summarize(h, &sm);
    print_message("send: min %" PRIu64 " p50 %" PRIu64 " p99 %" PRIu64 " max %" PRIu64 " ns\n",
                  sm.min, sm.p50, sm.p99, sm.max);
    assert_int_equal(sm.count, N);
    assert_true(sm.min > 0);
    assert_true(sm.min <= sm.p50 && sm.p50 <= sm.p99 && sm.p99 <= sm.p999 && sm.p999 <= sm.max);
    assert_true(sm.max < (uint64_t)TMO * 1000000u);
    assert_int_equal(tdp_pipe_latency_get(e.srv, TDP_LAT_RECV_WAIT, h), TDP_OK);
    tdp_hist_summarize(h, &sm);
    print_message("recv wait: min %" PRIu64 " p50 %" PRIu64 " p99 %" PRIu64 " max %" PRIu64 " ns\n",
                  sm.min, sm.p50, sm.p99, sm.max);
    assert_int_equal(sm.count, N);
    assert_true(sm.min <= sm.p50 && sm.p50 <= sm.p99 && sm.p99 <= sm.max);
    /* nothing sent the other way, nothing received this way */
    assert_int_equal(tdp_pipe_latency_get(e.srv, TDP_LAT_SEND, h), TDP_OK);
    assert_int_equal(h->count, 0);
    assert_int_equal(tdp_pipe_latency_get(e.cli, TDP_LAT_RECV_WAIT, h), TDP_OK);
    assert_int_equal(h->count, 0);
    assert_int_equal(tdp_pipe_latency_get(e.cli, (tdp_latency)7, h), TDP_EINVAL);
    assert_int_equal(tdp_pipe_latency_get(NULL, TDP_LAT_SEND, h), TDP_EINVAL);
    env_down(&e);

    /* off by default */
    env_up(&e, NULL, NULL);
    h->count = 12345;
    assert_int_equal(tdp_pipe_latency_get(e.cli, TDP_LAT_SEND, h), TDP_ENOTSUP);
    assert_int_equal(h->count, 12345); /* untouched */
    env_down(&e);
    free(h);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_schema_changes(void **state)
{
    env e;
    enum { NV = 6, PER = 5, ROUNDS = 2 };
    tdp_schema *s[NV];
    tdp_td *tds[NV];
    for (int v = 0; v < NV; v++) {
        s[v] = make_schema(v, 100);
        assert_int_equal(tdp_td_new(s[v], &tds[v]), TDP_OK);
        for (int w = 0; w < v; w++)
            assert_int_not_equal(tdp_schema_hash(s[v]), tdp_schema_hash(s[w]));
    }
    env_up(&e, NULL, NULL);
    sender snd = {.pipe = e.cli, .tds = tds, .ntds = NV, .per_td = PER,
                  .count = NV * PER * ROUNDS, .close = true};
    sender_start(&snd);
    tdp_td *got;
    for (int i = 0; i < NV * PER * ROUNDS; i++) {
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(tdp_schema_equal(tdp_td_schema(got), s[(i / PER) % NV]));
        assert_true(verify(got, (uint64_t)i + 1));
        /* nested keys, class names and non-tensor values arrive intact */
        tdp_leaf l;
        tdp_node_info ni;
        assert_int_equal(tdp_td_get(got, "meta.source", &l), TDP_OK);
        assert_int_equal(l.kind, TDP_LEAF_VALUE);
        assert_string_equal(l.value_json, "\"unit test\"");
        assert_int_equal(tdp_td_get(got, "meta.epoch", &l), TDP_OK);
        assert_string_equal(l.value_json, "7");
        assert_int_equal(tdp_schema_find_node(tdp_td_schema(got), "meta", &ni), TDP_OK);
        assert_string_equal(ni.cls, (i / PER) % NV == 5 ? "Renamed" : "Meta");
    }
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED);
    pthread_join(snd.th, NULL);
    assert_int_equal(snd.rc, TDP_OK);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(e.srv, &st);
    assert_int_equal(st.schemas_recv, NV * ROUNDS);
    env_down(&e);
    for (int v = 0; v < NV; v++) {
        tdp_td_unref(tds[v]);
        tdp_schema_unref(s[v]);
    }
}

static void sizes_case(int64_t nbytes, int count)
{
    env e;
    tdp_schema *s = bytes_schema(nbytes);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    env_up(&e, NULL, NULL);
    /* staged through host memory: large messages go as CHUNK frames,
     * counted on the links before the sender closes (they go with it) */
    bool chunks = dev_mode && tdp__cuda_backend_get() == TDP__CUDA_FAKE &&
                  tdp_pipe_plane(e.srv) == TDP_PLANE_UCX && nbytes > (4 << 20);
    sender snd = {.pipe = e.cli, .tds = &td, .ntds = 1, .count = count, .close = !chunks};
    sender_start(&snd);
    tdp_td *got;
    for (int i = 1; i <= count; i++) {
        assert_int_equal(tdp_pipe_recv(e.srv, LARGE_TMO, &got), TDP_OK);
        assert_int_equal(tdp_td_nbytes(got), tdp_schema_total_bytes(s));
        assert_true(verify(got, (uint64_t)i));
    }
    pthread_join(snd.th, NULL);
    assert_int_equal(snd.rc, TDP_OK);
    if (chunks) {
        assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(e.cli), false), count);
        assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(e.srv), true), count);
        assert_int_equal(tdp_pipe_close(e.cli, TMO), TDP_OK);
    }
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED);
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_tiny(void **state)
{
    sizes_case(3, 50);
}

static void test_large_256mib(void **state)
{
    sizes_case(LARGE_BYTES, 3);
}

/* depth N: a slow consumer holds several lent buffers at once; the sender waits. */
static void test_depth_ring(void **state)
{
    env e;
    tdp_pipe_opts so;
    tdp_pipe_opts_default(&so);
    so.recv_depth = 4;
    tdp_schema *s = bytes_schema(64 << 10);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    env_up(&e, &so, NULL);
    sender snd = {.pipe = e.cli, .tds = &td, .ntds = 1, .count = 200, .close = true};
    sender_start(&snd);
    tdp_td *held[4];
    uint64_t seq = 1;
    for (int round = 0; round < 50; round++) {
        for (int k = 0; k < 4; k++) {
            assert_int_equal(tdp_pipe_recv(e.srv, TMO, &held[k]), TDP_OK);
            for (int j = 0; j < k; j++)
                assert_ptr_not_equal(held[j], held[k]); /* distinct buffers */
        }
        /* all four are intact while held: nothing overwrote a lent buffer */
        usleep(2000);
        for (int k = 0; k < 4; k++)
            assert_true(verify(held[k], seq + (uint64_t)k));
        for (int k = 0; k < 4; k++)
            tdp_pipe_release(e.srv, held[k]);
        seq += 4;
    }
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &held[0]), TDP_ECLOSED);
    pthread_join(snd.th, NULL);
    assert_int_equal(snd.rc, TDP_OK);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(e.cli, &st);
    assert_true(st.credit_waits > 0); /* the sender was held back, not buffered */
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_bidirectional(void **state)
{
    env e;
    tdp_schema *a = make_schema(0, 64), *b = make_schema(3, 32);
    tdp_td *ta, *tb;
    assert_int_equal(tdp_td_new(a, &ta), TDP_OK);
    assert_int_equal(tdp_td_new(b, &tb), TDP_OK);
    env_up(&e, NULL, NULL);
    sender s1 = {.pipe = e.cli, .tds = &ta, .ntds = 1, .count = 300};
    sender s2 = {.pipe = e.srv, .tds = &tb, .ntds = 1, .count = 300};
    sender_start(&s1);
    sender_start(&s2);
    tdp_td *got;
    for (int i = 1; i <= 300; i++) {
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(tdp_schema_equal(tdp_td_schema(got), a));
        assert_true(verify(got, (uint64_t)i));
        assert_int_equal(tdp_pipe_recv(e.cli, TMO, &got), TDP_OK);
        assert_true(tdp_schema_equal(tdp_td_schema(got), b));
        assert_true(verify(got, (uint64_t)i));
    }
    pthread_join(s1.th, NULL);
    pthread_join(s2.th, NULL);
    assert_int_equal(s1.rc, TDP_OK);
    assert_int_equal(s2.rc, TDP_OK);
    env_down(&e);
    tdp_td_unref(ta);
    tdp_td_unref(tb);
    tdp_schema_unref(a);
    tdp_schema_unref(b);
}

static void test_timeouts(void **state)
{
    env e;
    tdp_td *got;
    env_up(&e, NULL, NULL);
    int64_t t0 = mono_ms();
    assert_int_equal(tdp_pipe_recv(e.srv, 150, &got), TDP_ETIMEDOUT);
    int64_t dt = mono_ms() - t0;
    assert_true(dt >= 140 && dt < 5000);
    /* the pipe still works after a timed-out receive */
    tdp_schema *s = bytes_schema(100);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    fill(td, 1);
    assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_true(verify(got, 1));
    /* the next send waits for credit (depth 1, buffer still lent): times out */
    t0 = mono_ms();
    assert_int_equal(tdp_pipe_send(e.cli, td, 150), TDP_ETIMEDOUT);
    assert_true(mono_ms() - t0 < 5000);
    /* releasing the lent buffer returns the credit; the pipe carries on */
    tdp_pipe_release(e.srv, got);
    fill(td, 2);
    assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_true(verify(got, 2));
    env_down(&e);

    /* nobody listening: refused */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    uint16_t port = ntohs(sa.sin_port);
    tdp_loop *loop;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", port, NULL, &p), TDP_ECONNREFUSED);
    /* a listener that never says HELLO: the handshake deadline ends it */
    assert_int_equal(listen(fd, 4), 0);
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.connect_timeout_ms = 200;
    t0 = mono_ms();
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p), TDP_ETIMEDOUT);
    dt = mono_ms() - t0;
    assert_true(dt >= 190 && dt < 5000);
    /* with a longer deadline, its silence says it is not a tdpipe peer (an HTTP
     * server waits for a request): the greeting deadline ends it, not the handshake's */
    o.connect_timeout_ms = 20000;
    t0 = mono_ms();
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p), TDP_EPROTO);
    dt = mono_ms() - t0;
    assert_true(dt >= 1900 && dt < 10000);
    /* unresolvable names and bad arguments */
    assert_int_equal(tdp_pipe_connect(loop, "no-such-host.invalid", 1, NULL, &p), TDP_EADDR);
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", 0, NULL, &p), TDP_EINVAL);
    close(fd);
    tdp_loop_free(loop);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* IPv6 loopback and a host name resolve and connect. */
static void test_ipv6_and_names(void **state)
{
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *c, *s;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, NULL, 0, NULL, NULL, NULL, &l), TDP_OK); /* dual stack */
    const char *hosts[] = {"::1", "127.0.0.1", "localhost"};
    /* tdp_pipe_peer's form, as pipe.h gives it: "[ip]:port" for IPv6 */
    const char *peer_fmt[] = {"[::1]:%u", "127.0.0.1:%u", NULL};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(tdp_pipe_connect(cl, hosts[i], tdp_listener_port(l), NULL, &c), TDP_OK);
        assert_int_equal(tdp_listener_accept(l, TMO, &s), TDP_OK);
        if (peer_fmt[i] != NULL) {
            char want[64], got[64];
            snprintf(want, sizeof(want), peer_fmt[i], (unsigned)tdp_listener_port(l));
            assert_string_equal(tdp_pipe_peer(c, got, sizeof(got)), want);
        }
        if (i == 0) {
            /* closing ends both directions: a receive pending at the close,
             * and one after it, end with ECLOSED (pipe.h, tdp_pipe_close) */
            tdp_op *rop;
            assert_int_equal(tdp_op_new(NULL, NULL, &rop), TDP_OK);
            tdp_pipe_recv_async(c, rop);
            assert_int_equal(tdp_pipe_close(c, TMO), TDP_OK);
            for (int k = 0; k < 5000 && tdp_op_result(rop) == TDP_EAGAIN; k++)
                usleep(1000);
            assert_int_equal(tdp_op_result(rop), TDP_ECLOSED);
            tdp_td *td;
            assert_int_equal(tdp_pipe_recv(c, TMO, &td), TDP_ECLOSED);
            tdp_op_free(rop);
        }
        tdp_pipe_free(c);
        tdp_pipe_free(s);
    }
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/* ---- a peer SIGKILLed mid-transfer --------------------------------------------- */

/* Child: connect and stream big messages until killed. */
static void child_stream(uint16_t port, bool send)
{
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_pipe_opts ob; /* the suite's plane and device, as the parent's */
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, mode_opts(NULL, &ob), &p) != TDP_OK)
        _exit(3);
    tdp_schema *s = bytes_schema(32 << 20);
    tdp_td *td;
    tdp_td_new(s, &td);
    for (uint64_t i = 1; i < 100000; i++) {
        tdp_td *got;
        if (send) {
            fill(td, i);
            if (tdp_pipe_send(p, td, TMO) != TDP_OK)
                _exit(4);
        } else if (tdp_pipe_recv(p, TMO, &got) != TDP_OK) {
            _exit(5);
        }
    }
    _exit(0);
}

static void kill_case(bool child_sends)
{
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    tdp_pipe_opts ob;
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, mode_opts(NULL, &ob), NULL, NULL, &l),
                     TDP_OK);
    uint16_t port = tdp_listener_port(l);
    fflush(NULL);
    /* a fresh process (fork + exec): UCX's global state, its async thread
     * among it, does not survive a bare fork */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char ps[16];
        snprintf(ps, sizeof(ps), "%u", port);
        execl("/proc/self/exe", "test_pipe", "--child", ps, child_sends ? "send" : "recv",
              (char *)NULL);
        _exit(127);
    }
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_schema *s = bytes_schema(32 << 20);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    /* a few complete messages first */
    for (uint64_t i = 1; i <= 3; i++) {
        if (child_sends) {
            assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
            assert_true(verify(got, i));
        } else {
            fill(td, i);
            assert_int_equal(tdp_pipe_send(p, td, TMO), TDP_OK);
        }
    }
    kill(pid, SIGKILL);
    int64_t t0 = mono_ms();
    tdp_err rc = TDP_OK;
    for (int i = 0; i < 1000 && rc == TDP_OK; i++) {
        if (child_sends) {
            rc = tdp_pipe_recv(p, TMO, &got);
            /* anything handed out is a whole message, never a partial one */
            if (rc == TDP_OK)
                assert_true(verify(got, 4 + (uint64_t)i));
        } else {
            rc = tdp_pipe_send(p, td, TMO);
        }
    }
    int64_t dt = mono_ms() - t0;
    print_message("peer death seen after %" PRId64 " ms (%s)\n", dt, tdp_errname(rc));
    assert_int_equal(rc, TDP_ECONNRESET);
    assert_true(dt < 1000);
    assert_int_equal(tdp_pipe_status(p), TDP_ECONNRESET);
    int st;
    waitpid(pid, &st, 0);
    /* the survivor is not held up by its dead peer: nothing waits for
     * endpoint closes that cannot end (it once took a second here) */
    t0 = mono_ms();
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    dt = mono_ms() - t0;
    print_message("teardown after the peer's death: %" PRId64 " ms\n", dt);
    assert_true(dt < 500);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_kill_sender(void **state)
{
    kill_case(true);
}

static void test_kill_receiver(void **state)
{
    kill_case(false);
}

/*
 * A device copy that fails (the fake's injected fault), on the sending side
 * (k = 1: the copy out of the sender's buffer) or the receiving side (k = 2:
 * the copy into the receiver's device buffer): the pipe fails with an error
 * on at least one side, nothing crashes, nothing hangs, and a receive never
 * hands out a message whose copy failed.
 */
static void test_device_copy_fault(void **state)
{
    if (!dev_mode || tdp__cuda_backend_get() != TDP__CUDA_FAKE) {
        print_message("skipped: needs device mode on the fake device (injected faults)\n");
        skip();
    }
    for (unsigned k = 1; k <= 2; k++) {
        env e;
        env_up(&e, NULL, NULL);
        if (k == 2 && tdp_pipe_plane(e.cli) == TDP_PLANE_CUDA_IPC) {
            /* the receiver views the sender's device slot: it copies nothing */
            print_message("copy 2: none on the receiving side of cuda-ipc\n");
            env_down(&e);
            break;
        }
        tdp_schema *s = bytes_schema(1 << 20);
        tdp_td *td, *got;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        fill(td, 1);
        assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK); /* a good one first */
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(verify(got, 1));
        tdp_pipe_release(e.srv, got);
        fill(td, 2);
        tdp__cuda_fake_inject(TDP__CUDA_FAULT_COPY_FAIL_AT, k);
        tdp_err src = tdp_pipe_send(e.cli, td, 5000);
        tdp_err rrc = tdp_pipe_recv(e.srv, 5000, &got);
        tdp__cuda_fake_inject(TDP__CUDA_FAULT_COPY_FAIL_AT, 0);
        print_message("copy %u fails: send %s, recv %s, status %s / %s\n", k, tdp_errname(src),
                      tdp_errname(rrc), tdp_errname(tdp_pipe_status(e.cli)),
                      tdp_errname(tdp_pipe_status(e.srv)));
        assert_int_not_equal(rrc, TDP_OK); /* the message whose copy failed is never handed out */
        /* the side whose copy failed says so */
        assert_int_equal(k == 1 ? src : rrc, TDP_ECUDA);
        assert_true(tdp_pipe_status(e.cli) != TDP_OK || tdp_pipe_status(e.srv) != TDP_OK);
        env_down(&e);
        tdp_td_unref(td);
        tdp_schema_unref(s);
    }
}

/* ---- hostile peers ------------------------------------------------------------- */

/* One raw AM from the client's loop to the server pipe (test_rogue_am.h). */
/* The token a rogue frame names: the ucx plane's peer link; the tcp plane's socket names it (0). */
static uint64_t peer_token(env *e)
{
    tdp__link *l = tdp__session_link(e->cli);
    return tdp_pipe_plane(e->cli) == TDP_PLANE_TCP ? 0 : tdp__ucx_link_peer_token(l);
}

static void rogue_send(env *e, const tdp_am_hdr *h, const void *payload, size_t len,
                       bool corrupt_magic)
{
    rogue_am_send(e->cl, e->cli, h, payload, len, corrupt_magic, TMO);
}

/* The same attacks, made by a hostile same-host sender on the shm plane. */
typedef struct shm_rogue {
    tdp__link *l;
    tdp__shm_desc d;
    const char *json;
    uint64_t total;
    bool release;
    tdp_err rc;
} shm_rogue;

static void shm_rogue_task(void *arg)
{
    shm_rogue *r = arg;
    r->rc = r->release ? tdp__shm_rogue_release(r->l, &r->d)
                       : tdp__shm_rogue_data(r->l, &r->d, r->json,
                                             r->json ? strlen(r->json) : 0, r->d.seq, r->total);
}

static void shm_rogue_send(env *e, int kind, const char *hostile)
{
    shm_rogue r = {.l = tdp__session_link(e->cli)};
    r.d.seq = 1;
    switch (kind) {
    case 0: /* a descriptor of no known type */
        r.d.type = 77;
        break;
    case 1: /* hostile schema, then its data */
        r.d.type = tdp__shm_desc_word(TDP__SHM_DESC_DATA, 1);
        r.json = hostile;
        r.total = 64;
        break;
    case 2: /* data with no schema */
        r.d.type = tdp__shm_desc_word(TDP__SHM_DESC_DATA, 1);
        r.d.hash = 42;
        r.d.arg = 4096;
        break;
    }
    tdp__call_on_loop(e->cl, shm_rogue_task, &r);
    assert_int_equal(r.rc, TDP_OK);
}

static void hostile_case(int kind, tdp_err expect)
{
    env e, good;
    env_up(&e, NULL, NULL);
    env_up(&good, NULL, NULL);
    bool shm = tdp_pipe_plane(e.cli) == TDP_PLANE_SHM;
    tdp_schema *s = bytes_schema(4096);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);

    const char *hostile = "{\"device\":\"cpu\",\"format\":\"tdpipe.schema\",\"td\":{\"cls\":"
                          "\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},\"leaves\":{\"x\":"
                          "[\"torch.float32\",[4294967296,4294967296,2],0,0,0]}},"
                          "\"total_bytes\":64,\"version\":1}";
    tdp_am_hdr h = {.seq = 1};
    if (shm)
        shm_rogue_send(&e, kind, hostile);
    else
        h.token = peer_token(&e);
    switch (shm ? -1 : kind) {
    case 0: /* garbage header */
        h.type = TDP_AM_DATA;
        rogue_send(&e, &h, "junk", 4, true);
        break;
    case 1: /* hostile schema */
        h.type = TDP_AM_SCHEMA;
        h.length = strlen(hostile);
        h.arg = 64;
        rogue_send(&e, &h, hostile, strlen(hostile), false);
        break;
    case 2: /* data with no schema */
        h.type = TDP_AM_DATA;
        h.hash = 42;
        h.length = 4096;
        rogue_send(&e, &h, tdp_td_data(td), 4096, false);
        break;
    case 3: /* credit for messages never sent */
        h.type = TDP_AM_CREDIT;
        h.token = peer_token(&e);
        h.arg = 1000;
        h.seq = 0;
        rogue_send(&e, &h, NULL, 0, false);
        break;
    }
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), expect);
    assert_int_equal(tdp_pipe_status(e.srv), expect);
    /* the peer is told, and its pipe ends too */
    tdp_err rc = tdp_pipe_recv(e.cli, TMO, &got);
    assert_true(rc == TDP_ECONNRESET || rc == TDP_ECLOSED);
    /* other pipes carry on */
    fill(td, 1);
    assert_int_equal(tdp_pipe_send(good.cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(good.srv, TMO, &got), TDP_OK);
    assert_true(verify(got, 1));
    env_down(&good);
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_garbage_frame(void **state)
{
    hostile_case(0, TDP_EPROTO);
}
static void test_hostile_schema(void **state)
{
    hostile_case(1, TDP_ESCHEMA);
}
static void test_data_without_schema(void **state)
{
    hostile_case(2, TDP_EMISMATCH);
}

static void test_forged_credit(void **state)
{
    /* the credit goes to the server pipe's send side: its sends fail */
    env e;
    env_up(&e, NULL, NULL);
    tdp_td *got;
    if (tdp_pipe_plane(e.cli) == TDP_PLANE_SHM) {
        /* a release of a slot never lent: the server has one message out */
        tdp_schema *s = bytes_schema(64);
        tdp_td *td;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        assert_int_equal(tdp_pipe_send(e.srv, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(e.cli, TMO, &got), TDP_OK);
        shm_rogue r = {.l = tdp__session_link(e.cli), .release = true};
        r.d.type = tdp__shm_desc_word(TDP__SHM_DESC_RELEASE, 1);
        r.d.slot = 3; /* slot 0 is the one out */
        tdp__call_on_loop(e.cl, shm_rogue_task, &r);
        assert_int_equal(r.rc, TDP_OK);
        /* the server's pipe fails: a receive there says why */
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_EPROTO);
        tdp_td_unref(td);
        tdp_schema_unref(s);
        env_down(&e);
        return;
    }
    tdp_am_hdr h = {.type = TDP_AM_CREDIT, .token = peer_token(&e), .arg = 1000};
    rogue_send(&e, &h, NULL, 0, false);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_EPROTO);
    env_down(&e);
}

/* Junk on the control socket: the handshake fails, the listener lives on. */
static void test_garbage_control(void **state)
{
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_OK);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                             .sin_port = htons(tdp_listener_port(l))};
    for (int k = 0; k < 3; k++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        char junk[64];
        memset(junk, 'A' + k, sizeof(junk));
        if (k == 1) { /* a valid header from a future protocol version */
            memcpy(junk, "TDPC", 4);
            junk[4] = 99;
            junk[5] = 0;
        }
        assert_int_equal(write(fd, junk, sizeof(junk)), (ssize_t)sizeof(junk));
        /* the server closes on us */
        char b[256];
        int64_t t0 = mono_ms();
        ssize_t n;
        while ((n = read(fd, b, sizeof(b))) > 0 && mono_ms() - t0 < 5000)
            ;
        assert_true(n <= 0);
        close(fd);
    }
    assert_int_equal(tdp_listener_accept(l, 100, &p), TDP_ETIMEDOUT);
    /* and a real client still gets in */
    tdp_loop *cl;
    tdp_pipe *c;
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), NULL, &c), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_loop_free(cl);
    tdp_listener_free(l);
    tdp_loop_free(loop);
}

/* A schema change reuses the receive storage when it is large enough. */
static void test_storage_reuse(void **state)
{
    env e;
    env_up(&e, NULL, NULL);
    tdp_schema *big = bytes_schema(1 << 20), *small = bytes_schema(100 << 10);
    tdp_td *tb, *ts, *got;
    assert_int_equal(tdp_td_new(big, &tb), TDP_OK);
    assert_int_equal(tdp_td_new(small, &ts), TDP_OK);
    tdp_td *order[] = {tb, ts, tb, ts, tb};
    tdp_mem_stats m0, m1;
    for (int i = 0; i < 5; i++) {
        if (i == 1)
            tdp_mem_stats_get(&m0); /* after the first, largest, allocation */
        fill(order[i], (uint64_t)i + 1);
        assert_int_equal(tdp_pipe_send(e.cli, order[i], TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(verify(got, (uint64_t)i + 1));
        assert_int_equal(tdp_td_nbytes(got), tdp_td_nbytes(order[i]));
        tdp_pipe_release(e.srv, got);
    }
    tdp_mem_stats_get(&m1);
    for (int t = 0; t < TDP_MEM_TYPE_COUNT; t++) /* host, pinned and device memory alike */
        print_message("allocations of memory type %d: %" PRIu64 "\n", t,
                      m1.allocs[t] - m0.allocs[t]);
    for (int t = 0; t < TDP_MEM_TYPE_COUNT; t++)
        assert_int_equal(m1.allocs[t], m0.allocs[t]);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(e.srv, &st);
    assert_int_equal(st.schemas_recv, 5);
    env_down(&e);
    tdp_td_unref(tb);
    tdp_td_unref(ts);
    tdp_schema_unref(big);
    tdp_schema_unref(small);
}

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

/* Connect, exchange, close, free, many times: no fds or memory left behind. */
static void test_connect_cycles(void **state)
{
    enum { CYCLES = 100 };
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe_opts ob;
    const tdp_pipe_opts *o = mode_opts(NULL, &ob);
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, o, NULL, NULL, &l), TDP_OK);
    tdp_schema *s = bytes_schema(200000); /* large enough for a rendezvous */
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    int fd0 = 0;
    tdp_mem_stats m0, m1;
    for (int i = 0; i < CYCLES + 5; i++) {
        if (i == 5) { /* after a warm-up: what UCX keeps for good is made */
            fd0 = count_fds();
            tdp_mem_stats_get(&m0);
        }
        tdp_pipe *c, *p;
        assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), o, &c), TDP_OK);
        assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
        fill(td, (uint64_t)i + 1);
        assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_true(verify(got, (uint64_t)i + 1));
        assert_int_equal(tdp_pipe_close(c, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_ECLOSED);
        tdp_pipe_free(c);
        tdp_pipe_free(p);
    }
    /* endpoints and freed pipes go on the loops' later turns: give them a moment */
    int fds = count_fds();
    tdp_mem_stats_get(&m1);
    for (int k = 0; k < 500 && (fds > fd0 || m1.small_allocs - m1.small_frees >
                                                   m0.small_allocs - m0.small_frees + 1);
         k++) {
        usleep(10000);
        fds = count_fds();
        tdp_mem_stats_get(&m1);
    }
    print_message("%d cycles: fds %d -> %d, small objects live %" PRIu64 " -> %" PRIu64 "\n",
                  CYCLES, fd0, fds, m0.small_allocs - m0.small_frees,
                  m1.small_allocs - m1.small_frees);
    assert_true(fds <= fd0);
    /* one object may be the list of endpoint closes in progress, grown once */
    assert_true(m1.small_allocs - m1.small_frees <= m0.small_allocs - m0.small_frees + 1);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* Several pipes at once between the same two loops (one UCX endpoint pair). */
typedef struct multi {
    tdp_loop *cl;
    uint16_t port;
    int idx;
    tdp_err rc;
    pthread_t th;
} multi;

static void *multi_client(void *arg)
{
    multi *m = arg;
    tdp_pipe *p;
    tdp_pipe_opts ob;
    tdp_schema *s = bytes_schema(1000 + 37000 * m->idx); /* eager and rendezvous sizes */
    tdp_td *td, *got;
    m->rc = tdp_td_new(s, &td);
    if (m->rc == TDP_OK)
        m->rc = tdp_pipe_connect(m->cl, "127.0.0.1", m->port, mode_opts(NULL, &ob), &p);
    for (uint64_t k = 1; k <= 40 && m->rc == TDP_OK; k++) {
        fill(td, k * 100 + (uint64_t)m->idx);
        m->rc = tdp_pipe_send(p, td, TMO);
        if (m->rc == TDP_OK)
            m->rc = tdp_pipe_recv(p, TMO, &got); /* the server echoes it */
        if (m->rc == TDP_OK && !verify(got, k * 100 + (uint64_t)m->idx))
            m->rc = TDP_EINTERNAL;
    }
    if (m->rc == TDP_OK)
        m->rc = tdp_pipe_close(p, TMO);
    tdp_pipe_free(p);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    return NULL;
}

static void *echo_server(void *arg)
{
    tdp_pipe *p = arg;
    tdp_td *got;
    tdp_err rc;
    while ((rc = tdp_pipe_recv(p, TMO, &got)) == TDP_OK)
        if (tdp_pipe_send(p, got, TMO) != TDP_OK)
            break;
    tdp_pipe_free(p);
    return (void *)(intptr_t)(rc == TDP_ECLOSED ? 0 : 1);
}

static void test_many_pipes_two_loops(void **state)
{
    enum { N = 8 };
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe_opts ob;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, mode_opts(NULL, &ob), NULL, NULL, &l),
                     TDP_OK);
    multi m[N];
    pthread_t srv[N];
    for (int i = 0; i < N; i++) {
        m[i] = (multi){.cl = cl, .port = tdp_listener_port(l), .idx = i};
        assert_int_equal(pthread_create(&m[i].th, NULL, multi_client, &m[i]), 0);
    }
    for (int i = 0; i < N; i++) {
        tdp_pipe *p;
        assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
        assert_int_equal(pthread_create(&srv[i], NULL, echo_server, p), 0);
    }
    for (int i = 0; i < N; i++) {
        void *bad;
        pthread_join(m[i].th, NULL);
        pthread_join(srv[i], &bad);
        assert_int_equal(m[i].rc, TDP_OK);
        assert_null(bad);
    }
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/* A peer of another protocol version: the connect fails with TDP_EVERSION. */
static void *future_server(void *arg)
{
    int lfd = *(int *)arg;
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0)
        return NULL;
    uint8_t hdr[TDP_CTL_HDR_LEN];
    tdp_wire_ctl_hdr_encode(hdr, TDP_CTL_HELLO, TDP_HELLO_FIXED_LEN + 8);
    hdr[4] = TDP_PROTOCOL_VERSION + 1; /* a later version */
    uint8_t payload[TDP_HELLO_FIXED_LEN + 8] = {0};
    if (write(fd, hdr, sizeof(hdr)) == (ssize_t)sizeof(hdr))
        (void)!write(fd, payload, sizeof(payload));
    char b[256];
    while (read(fd, b, sizeof(b)) > 0) /* until the client hangs up */
        ;
    close(fd);
    return NULL;
}

static void test_version_mismatch(void **state)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 4), 0);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&sa, &sl), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, future_server, &lfd), 0);
    tdp_loop *loop;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    int64_t t0 = mono_ms();
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", ntohs(sa.sin_port), NULL, &p),
                     TDP_EVERSION);
    assert_true(mono_ms() - t0 < 5000); /* told at once, not by a timeout */
    tdp_loop_free(loop);
    pthread_join(th, NULL);
    close(lfd);
}

/*
 * The receiver may place the data on another device than the sender's: the
 * message arrives whole, in the receiver's memory, under a schema that
 * names the receiver's device.
 */
static void override_case(tdp_device send_dev, tdp_device recv_dev)
{
    env e;
    tdp_pipe_opts so;
    char d1[TDP_DEVICE_STRLEN], d2[TDP_DEVICE_STRLEN];
    tdp_pipe_opts_default(&so);
    so.recv_device_set = true;
    so.recv_device = recv_dev;
    print_message("%s -> %s\n", tdp_device_format(send_dev, d1), tdp_device_format(recv_dev, d2));
    env_up(&e, &so, NULL);
    tdp_schema *base = bytes_schema(100000), *s;
    assert_int_equal(tdp_schema_with_device(base, send_dev, &s), TDP_OK);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    assert_int_equal(tdp_td_device(td).type, send_dev.type);
    for (uint64_t i = 1; i <= 5; i++) {
        fill(td, i);
        assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(verify(got, i));
        assert_true(tdp_device_equal(tdp_schema_device(tdp_td_schema(got)), recv_dev));
        assert_true(tdp_device_equal(tdp_td_device(got), recv_dev));
        tdp_pipe_release(e.srv, got);
    }
    env_down(&e);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_schema_unref(base);
}

static void test_recv_device_override(void **state)
{
    const tdp_device cpu = {TDP_DEVICE_CPU, 0}, gpu = {TDP_DEVICE_CUDA, 0};
    override_case(dev_mode ? gpu : cpu, cpu); /* GPU -> host in device mode */
    if (dev_mode)
        override_case(cpu, gpu); /* host -> GPU */
}

static void test_gather(void **state)
{
    env e;
    env_up(&e, NULL, NULL);
    tdp_schema *s = make_schema(0, 10);
    float obs[4 * 10];
    int64_t lab[4];
    uint16_t w[4];
    for (int i = 0; i < 40; i++)
        obs[i] = (float)i * 0.25f;
    for (int i = 0; i < 4; i++)
        lab[i] = 100 + i, w[i] = (uint16_t)(0x3f80 + i);
    const void *ptrs[] = {obs, lab, w};
    assert_int_equal(tdp_schema_num_tensors(s), 3);
    tdp_mem_stats m0, m1;
    for (int k = 0; k < 3; k++) {
        tdp_mem_stats_get(&m0);
        assert_int_equal(tdp_pipe_send_gather(e.cli, s, ptrs, TMO), TDP_OK);
        tdp_mem_stats_get(&m1);
        if (k > 0) /* the send buffer is reused */
            assert_int_equal(m1.allocs[TDP_MEM_HOST], m0.allocs[TDP_MEM_HOST]);
        tdp_td *got;
        tdp_leaf l;
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_int_equal(tdp_td_get(got, "obs", &l), TDP_OK);
        assert_memory_equal(l.data, obs, sizeof(obs));
        assert_int_equal(tdp_td_get(got, "label", &l), TDP_OK);
        assert_memory_equal(l.data, lab, sizeof(lab));
        assert_int_equal(tdp_td_get(got, "meta.weight", &l), TDP_OK);
        assert_memory_equal(l.data, w, sizeof(w));
        tdp_pipe_release(e.srv, got); /* depth 1: give the buffer back before the next send */
    }
    env_down(&e);
    tdp_schema_unref(s);
}

/*
 * Async API on a loop the caller drives: callbacks on the loop thread. The
 * main thread reads what the callbacks wrote: the counter is the release /
 * acquire pair that publishes last and on_thread.
 */
typedef struct actx {
    atomic_int sends_done, recvs_done;
    tdp_err last;
    tdp_loop *loop;
    bool on_thread;
} actx;

static void a_send_cb(tdp_op *op, void *arg)
{
    actx *c = arg;
    c->last = tdp_op_result(op);
    c->on_thread = tdp_loop_on_thread(c->loop);
    atomic_fetch_add_explicit(&c->sends_done, 1, memory_order_release);
}

static void a_recv_cb(tdp_op *op, void *arg)
{
    actx *c = arg;
    c->last = tdp_op_result(op);
    atomic_fetch_add_explicit(&c->recvs_done, 1, memory_order_release);
}

typedef struct wait_on_loop {
    tdp_op *op;
    tdp_err rc;
} wait_on_loop;

static void wait_on_loop_task(void *arg)
{
    wait_on_loop *w = arg;
    w->rc = tdp_op_wait(w->op, 10);
}

static void test_async_ops(void **state)
{
    env e;
    tdp_pipe_opts so, co;
    tdp_pipe_opts_default(&so);
    tdp_pipe_opts_default(&co);
    so.recv_depth = 8;
    co.latency_stats = true; /* async sends are timed from tdp_pipe_send_async */
    env_up(&e, &so, &co);
    tdp_schema *s = bytes_schema(10000);
    tdp_td *td[8];
    tdp_op *sops[8], *rop;
    actx c = {.loop = e.cl};
    for (int i = 0; i < 8; i++) {
        assert_int_equal(tdp_td_new(s, &td[i]), TDP_OK);
        fill(td[i], (uint64_t)i + 1);
        assert_int_equal(tdp_op_new(a_send_cb, &c, &sops[i]), TDP_OK);
        tdp_pipe_send_async(e.cli, td[i], sops[i]);
    }
    actx rc_ = {.loop = e.sl};
    assert_int_equal(tdp_op_new(a_recv_cb, &rc_, &rop), TDP_OK);
    /* never started: nothing to wait for */
    assert_int_equal(tdp_op_wait(rop, 0), TDP_EINVAL);
    assert_int_equal(tdp_op_wait(NULL, 0), TDP_EINVAL);
    for (uint64_t i = 1; i <= 8; i++) {
        tdp_pipe_recv_async(e.srv, rop);
        /* the loop threads complete it: tdp_op_wait sleeps until they do */
        assert_int_equal(tdp_op_wait(rop, TMO), TDP_OK);
        assert_int_equal(tdp_op_result(rop), TDP_OK);
        assert_int_equal(tdp_op_seq(rop), i);
        assert_true(verify(tdp_op_td(rop), i));
        tdp_pipe_release(e.srv, tdp_op_td(rop));
    }
    for (int i = 0; i < 8; i++)
        assert_int_equal(tdp_op_wait(sops[i], TMO), TDP_OK);
    for (int k = 0; k < 5000 && atomic_load_explicit(&c.sends_done, memory_order_acquire) < 8; k++)
        usleep(1000);
    assert_int_equal(atomic_load_explicit(&c.sends_done, memory_order_acquire), 8);
    assert_int_equal(c.last, TDP_OK);
    assert_true(c.on_thread);
    /* a done op answers at once, with its result */
    assert_int_equal(tdp_op_wait(sops[0], 0), TDP_OK);
    /* a receive nobody sends to: the deadline, and the op still pending */
    tdp_pipe_recv_async(e.srv, rop);
    assert_int_equal(tdp_op_wait(rop, 50), TDP_ETIMEDOUT);
    assert_int_equal(tdp_op_result(rop), TDP_EAGAIN);
    /* on the loop thread it would wait for itself: refused */
    wait_on_loop w = {.op = rop, .rc = TDP_OK};
    tdp__call_on_loop(e.sl, wait_on_loop_task, &w);
    assert_int_equal(w.rc, TDP_EINVAL);
    tdp_hist *h = malloc(sizeof(*h));
    assert_non_null(h);
    assert_int_equal(tdp_pipe_latency_get(e.cli, TDP_LAT_SEND, h), TDP_OK);
    assert_int_equal(h->count, 8);
    assert_true(h->min > 0 && h->min <= h->max);
    assert_int_equal(tdp_pipe_latency_get(e.srv, TDP_LAT_RECV_WAIT, h), TDP_ENOTSUP);
    free(h);
    /* a receive pending when the pipe is freed completes with ECANCELED */
    tdp_pipe_free(e.srv);
    e.srv = NULL;
    assert_int_equal(tdp_op_result(rop), TDP_ECANCELED);
    env_down(&e);
    for (int i = 0; i < 8; i++) {
        tdp_op_free(sops[i]);
        tdp_td_unref(td[i]);
    }
    tdp_op_free(rop);
    tdp_schema_unref(s);
}

/* A receive callback that starts its op again once. */
typedef struct restart_ctx {
    tdp_pipe *p;
    int calls;
} restart_ctx;

static void restart_cb(tdp_op *op, void *arg)
{
    restart_ctx *r = arg;
    r->calls++;
    if (tdp_op_result(op) == TDP_OK)
        tdp_pipe_release(r->p, tdp_op_td(op));
    if (r->calls == 1)
        tdp_pipe_recv_async(r->p, op);
}

/* Both ends on one loop driven by the caller (no loop threads at all). */
static void test_single_thread(void **state)
{
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *c, *p;
    tdp_op *sop, *rop;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", tdp_listener_port(l), NULL, &c), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_schema *s = bytes_schema(300000);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    actx ac = {.loop = loop};
    assert_int_equal(tdp_op_new(a_send_cb, &ac, &sop), TDP_OK);
    assert_int_equal(tdp_op_new(a_recv_cb, &ac, &rop), TDP_OK);
    for (uint64_t i = 1; i <= 20; i++) {
        fill(td, i);
        tdp_pipe_send_async(c, td, sop);
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_true(verify(got, i));
        tdp_pipe_release(p, got);
        /* nobody runs the loop: the wait drives it until the send is done */
        assert_int_equal(tdp_op_wait(sop, TMO), TDP_OK);
        assert_int_equal(tdp_op_result(sop), TDP_OK);
    }
    /* several sends in flight from this one thread, each waited for when its buffer is
     * needed again (the way to stream small messages: docs/pipe.md) */
    tdp_schema *small = bytes_schema(1000);
    enum { RING = 8, MSGS = 400 };
    tdp_op *ring[RING];
    tdp_td *rtd[RING];
    for (int k = 0; k < RING; k++) {
        assert_int_equal(tdp_op_new(NULL, NULL, &ring[k]), TDP_OK);
        assert_int_equal(tdp_td_new(small, &rtd[k]), TDP_OK);
    }
    uint64_t next = 21;
    for (int i = 0; i < MSGS; i++) {
        int k = i % RING;
        if (tdp_op_result(ring[k]) == TDP_EAGAIN)
            assert_int_equal(tdp_op_wait(ring[k], TMO), TDP_OK);
        fill(rtd[k], 21 + (uint64_t)i);
        tdp_pipe_send_async(c, rtd[k], ring[k]);
        /* the receiver keeps up now and then: a window's worth at most in flight */
        while (i % 16 == 15 && next <= 21 + (uint64_t)i) {
            assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
            assert_true(verify(got, next));
            tdp_pipe_release(p, got);
            next++;
        }
    }
    for (; next < 21 + (uint64_t)MSGS; next++) {
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_true(verify(got, next));
        tdp_pipe_release(p, got);
    }
    for (int k = 0; k < RING; k++) {
        assert_int_equal(tdp_op_wait(ring[k], TMO), TDP_OK);
        tdp_op_free(ring[k]);
        tdp_td_unref(rtd[k]);
    }
    tdp_schema_unref(small);
    /* a callback that starts its op again: the wait ends at the first completion, and
     * says the op is pending again (not a deadline later) */
    restart_ctx rx = {.p = p};
    tdp_op *rop2;
    assert_int_equal(tdp_op_new(restart_cb, &rx, &rop2), TDP_OK);
    tdp_pipe_recv_async(p, rop2);
    /* async: it arrives while the wait drives the loop (a blocking send's own drive
     * could complete the receive before the wait begins: then the wait is for the next) */
    tdp_pipe_send_async(c, td, sop);
    int64_t w0 = mono_ms();
    assert_int_equal(tdp_op_wait(rop2, TMO), TDP_EAGAIN);
    assert_int_equal(tdp_op_wait(sop, TMO), TDP_OK);
    assert_true(mono_ms() - w0 < TMO / 2);
    assert_int_equal(rx.calls, 1);
    assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    assert_int_equal(tdp_op_wait(rop2, TMO), TDP_OK);
    assert_int_equal(rx.calls, 2);
    tdp_op_free(rop2);
    assert_int_equal(tdp_pipe_close(c, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_ECLOSED);
    tdp_op_free(sop);
    tdp_op_free(rop);
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/*
 * Loans: on the shm plane a loaned buffer is a slot of the sender's pool and
 * the receiver's view lies in the same pages (nothing copied either way);
 * a plain send is copied once into a slot; a schema change grows the pool
 * while an older loan is out, and that loan can still be sent (copied). On
 * other planes a loan is an ordinary buffer and everything still arrives.
 */
typedef struct pool_q {
    tdp__link *l;
    const void *p;
    bool in;
} pool_q;

static void pool_q_task(void *arg)
{
    pool_q *q = arg;
    q->in = tdp__shm_view_in_pool(q->l, q->p);
}

static bool in_pool(tdp_loop *loop, tdp_pipe *pipe, const void *ptr)
{
    pool_q q = {tdp__session_link(pipe), ptr, false};
    tdp__call_on_loop(loop, pool_q_task, &q);
    return q.in;
}

/* A loan, retried while the plane asks for it (TDP_EAGAIN), within TMO ms. */
static tdp_err loan_retry(tdp_pipe *p, tdp_schema *sc, tdp_td **out)
{
    tdp_err rc = TDP_EAGAIN;
    for (int i = 0; i < TMO * 10 && (rc = tdp_pipe_loan(p, sc, out)) == TDP_EAGAIN; i++)
        usleep(100);
    return rc;
}

/* On the receiver's loop: read the socket, wait for the sender, pop the ring. */
typedef struct split_turn {
    tdp__link *l;
    atomic_bool socket_read, sent, done;
} split_turn;

static void split_turn_task(void *arg)
{
    split_turn *st = arg;
    tdp__shm_step_socket(st->l);
    atomic_store(&st->socket_read, true);
    for (int i = 0; i < TMO && !atomic_load(&st->sent); i++)
        usleep(1000);
    tdp__shm_step_ring(st->l);
    atomic_store(&st->done, true);
}

static void test_loans(void **state)
{
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.recv_depth = 4;
    env e;
    env_up(&e, &o, &o);
    bool shm = tdp_pipe_plane(e.cli) == TDP_PLANE_SHM;
    print_message("plane %s\n", tdp_plane_name(tdp_pipe_plane(e.cli)));
    tdp_schema *small = bytes_schema(4096), *big = bytes_schema(3u << 20);
    tdp_td *loan, *got, *old;

    /*
     * loaned: zero copy both ways, from the very first loan (which may come
     * before the peer's shared-memory connection is proven: the plane then
     * asks for a retry rather than lend an ordinary buffer it would copy)
     */
    for (int i = 1; i <= 20; i++) {
        assert_int_equal(loan_retry(e.cli, small, &loan), TDP_OK);
        fill(loan, (uint64_t)i);
        const void *wrote = tdp_td_data(loan);
        if (shm)
            assert_true(in_pool(e.cl, e.cli, wrote)); /* a slot of the sender's pool */
        assert_int_equal(tdp_pipe_send(e.cli, loan, TMO), TDP_OK);
        tdp_td_unref(loan);
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_true(verify(got, (uint64_t)i));
        if (shm) {
            assert_true(in_pool(e.sl, e.srv, tdp_td_data(got)));
            assert_ptr_not_equal(tdp_td_data(got), wrote); /* another mapping of the same pages */
        }
        tdp_pipe_release(e.srv, got);
    }
    /* a plain send: copied into a slot, still in the pool on arrival */
    tdp_td *plain;
    assert_int_equal(tdp_td_new(small, &plain), TDP_OK);
    fill(plain, 99);
    assert_int_equal(tdp_pipe_send(e.cli, plain, TMO), TDP_OK);
    fill(plain, 1000); /* the sender may reuse its buffer at once */
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_true(verify(got, 99));
    if (shm)
        assert_true(in_pool(e.sl, e.srv, tdp_td_data(got)));
    tdp_pipe_release(e.srv, got);

    /* a schema change grows the pool while a loan of the old one is out */
    assert_int_equal(tdp_pipe_loan(e.cli, small, &old), TDP_OK);
    fill(old, 7);
    assert_int_equal(tdp_pipe_loan(e.cli, big, &loan), TDP_OK);
    fill(loan, 8);
    /* the receiver reads the new POOL now and its SCHEMA only after the
     * DATA's descriptor is in the ring: it must not take that DATA as
     * announced in full because one announcement for it is in (it once did,
     * and failed the pipe with TDP_EMISMATCH) */
    split_turn st = {.l = shm ? tdp__session_link(e.srv) : NULL};
    tdp__task t = {.fn = split_turn_task, .arg = &st};
    if (shm) {
        tdp__loop_post_task(e.sl, &t);
        for (int i = 0; i < TMO && !atomic_load(&st.socket_read); i++)
            usleep(1000);
        assert_true(atomic_load(&st.socket_read));
    }
    assert_int_equal(tdp_pipe_send(e.cli, loan, TMO), TDP_OK);
    atomic_store(&st.sent, true);
    for (int i = 0; shm && i < TMO && !atomic_load(&st.done); i++)
        usleep(1000);
    tdp_td_unref(loan);
    assert_int_equal(tdp_pipe_send(e.cli, old, TMO), TDP_OK); /* copied into the new pool */
    tdp_td_unref(old);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_true(verify(got, 8));
    assert_int_equal(tdp_td_nbytes(got), 3u << 20);
    /* a view held across the next receive stays intact */
    tdp_td *got2;
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got2), TDP_OK);
    assert_true(verify(got2, 7));
    assert_true(verify(got, 8));
    tdp_pipe_release(e.srv, got);
    tdp_pipe_release(e.srv, got2);

    /* loans are bounded: every slot out gives TDP_EAGAIN, not a hang */
    if (shm) {
        tdp_td *held[64];
        int n = 0;
        tdp_err rc = TDP_OK;
        while (n < 64 && (rc = tdp_pipe_loan(e.cli, small, &held[n])) == TDP_OK)
            n++;
        assert_int_equal(rc, TDP_EAGAIN);
        assert_true(n >= 2);
        for (int i = 0; i < n; i++)
            tdp_td_unref(held[i]); /* unsent loans go back */
        assert_int_equal(tdp_pipe_loan(e.cli, small, &loan), TDP_OK);
        tdp_td_unref(loan);
    }
    assert_int_equal(tdp_pipe_close(e.cli, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_ECLOSED);
    tdp_td_unref(plain);
    tdp_schema_unref(small);
    tdp_schema_unref(big);
    env_down(&e);
}

/* ---- reconnecting ------------------------------------------------------------------ */

/* A loopback port nobody listens on now: bound, then let go. */
static uint16_t free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(sa);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
    close(fd);
    return ntohs(sa.sin_port);
}

typedef struct late_listener {
    pthread_t th;
    tdp_loop *loop;
    uint16_t port;
    int delay_ms;
    tdp_listener *l;
    tdp_err rc;
} late_listener;

static void *late_listen(void *arg)
{
    late_listener *ll = arg;
    usleep((useconds_t)ll->delay_ms * 1000);
    tdp_pipe_opts ob; /* the suite's plane, peer mode and depth-only credit */
    ll->rc = tdp_listener_new(ll->loop, "127.0.0.1", ll->port, mode_opts(NULL, &ob), NULL, NULL,
                              &ll->l);
    return NULL;
}

static uint64_t stat_reconnects(tdp_pipe *p)
{
    tdp_pipe_stats st;
    tdp_pipe_stats_get(p, &st);
    return st.reconnects;
}

/*
 * A producer with reconnect_ms: its consumer goes away mid-stream and a new
 * one listens on the same port a little later; the stream goes on there,
 * its first message says where it resumed, and the schema comes again.
 * Before that, the first connect waits for a consumer that is not there
 * yet; after, a consumer that never comes back ends the pipe in bounded time.
 */
static void test_reconnect(void **state)
{
    tdp_loop *sl, *cl;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    uint16_t port = free_port();

    /* the first connect waits for the consumer (up to connect_timeout_ms) */
    late_listener ll = {.loop = sl, .port = port, .delay_ms = 300};
    assert_int_equal(pthread_create(&ll.th, NULL, late_listen, &ll), 0);
    tdp_pipe_opts ob, o = *mode_opts(NULL, &ob); /* the suite's plane and peer mode */
    o.reconnect_ms = 5000;
    o.connect_timeout_ms = 5000;
    tdp_pipe *c, *p;
    int64_t t0 = mono_ms();
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", port, &o, &c), TDP_OK);
    print_message("connected %" PRId64 " ms after a consumer appeared 300 ms late\n",
                  mono_ms() - t0);
    pthread_join(ll.th, NULL);
    assert_int_equal(ll.rc, TDP_OK);
    assert_int_equal(tdp_listener_accept(ll.l, TMO, &p), TDP_OK);

    tdp_schema *s = bytes_schema(64 << 10);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (uint64_t i = 1; i <= 3; i++) {
        fill(td, i);
        assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_true(verify(got, i));
        tdp_pipe_release(p, got); /* depth 1: the credit for the next send */
    }
    /* the consumer goes; the producer notices and starts reconnecting */
    tdp_pipe_free(p);
    tdp_listener_free(ll.l);
    for (int i = 0; i < 2000 && stat_reconnects(c) == 0; i++)
        usleep(1000);
    assert_int_equal(stat_reconnects(c), 1);
    assert_int_equal(tdp_pipe_status(c), TDP_OK); /* not ended: reconnecting */
    tdp_pipe_stats cs;
    tdp_pipe_stats_get(c, &cs);
    uint64_t unconfirmed1 = cs.unconfirmed; /* message 3's credit may not have left */
    assert_true(unconfirmed1 <= 1);
    /* a send now waits for the next consumer, which comes 300 ms later */
    ll = (late_listener){.loop = sl, .port = port, .delay_ms = 300};
    assert_int_equal(pthread_create(&ll.th, NULL, late_listen, &ll), 0);
    fill(td, 4);
    t0 = mono_ms();
    assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    pthread_join(ll.th, NULL);
    assert_int_equal(ll.rc, TDP_OK);
    assert_int_equal(tdp_listener_accept(ll.l, TMO, &p), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    print_message("message 4 arrived %" PRId64 " ms after its send began\n", mono_ms() - t0);
    assert_true(verify(got, 4));
    tdp_pipe_stats st;
    tdp_pipe_stats_get(p, &st);
    assert_int_equal(st.resumed_from, 4); /* 1..3 went to the consumer that left */
    assert_int_equal(st.schemas_recv, 1); /* the schema came again */
    tdp_pipe_release(p, got);
    fill(td, 5);
    assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    assert_true(verify(got, 5));

    /* gone for good: the pipe ends once reconnect_ms has passed */
    tdp_pipe_free(p);
    tdp_listener_free(ll.l);
    for (int i = 0; i < 2000 && stat_reconnects(c) < 2; i++)
        usleep(1000);
    /* message 5 was taken and never released: the outage may have lost it */
    tdp_pipe_stats_get(c, &cs);
    assert_int_equal(cs.unconfirmed, unconfirmed1 + 1);
    t0 = mono_ms();
    fill(td, 6);
    tdp_err rc = tdp_pipe_send(c, td, 20000);
    int64_t dt = mono_ms() - t0;
    print_message("no consumer: send ended with %s after %" PRId64 " ms\n", tdp_errname(rc), dt);
    assert_true(rc == TDP_ECONNRESET || rc == TDP_ECLOSED);
    assert_true(dt < 5000 + 2000);
    assert_true(tdp_pipe_status(c) == TDP_ECONNRESET || tdp_pipe_status(c) == TDP_ECLOSED);
    tdp_pipe_free(c);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/*
 * connect_wait_ms: a connect made before its listener exists waits for it
 * (the listener comes 300 ms late) and the pipe works; that pipe does not
 * redial when its peer goes (no reconnect_ms). With nobody listening the
 * connect ends with TDP_ECONNREFUSED once the wait is over: not sooner,
 * not much later. Without the option a refusal ends the connect at once.
 */
static void test_connect_wait(void **state)
{
    tdp_loop *sl, *cl;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    uint16_t port = free_port();

    late_listener ll = {.loop = sl, .port = port, .delay_ms = 300};
    assert_int_equal(pthread_create(&ll.th, NULL, late_listen, &ll), 0);
    tdp_pipe_opts ob, o = *mode_opts(NULL, &ob);
    o.connect_wait_ms = 5000;
    tdp_pipe *c, *p;
    int64_t t0 = mono_ms();
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", port, &o, &c), TDP_OK);
    int64_t dt = mono_ms() - t0;
    print_message("connected %" PRId64 " ms after a listener appeared 300 ms late\n", dt);
    assert_true(dt >= 250); /* it did wait for the listener */
    pthread_join(ll.th, NULL);
    assert_int_equal(ll.rc, TDP_OK);
    assert_int_equal(tdp_listener_accept(ll.l, TMO, &p), TDP_OK);
    tdp_schema *s = bytes_schema(4096);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    fill(td, 1);
    assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    assert_true(verify(got, 1));
    tdp_pipe_release(p, got);
    /* the peer goes: the pipe ends, with no redial */
    tdp_pipe_free(p);
    tdp_listener_free(ll.l);
    for (int i = 0; i < 5000 && tdp_pipe_status(c) == TDP_OK; i++)
        usleep(1000);
    assert_int_not_equal(tdp_pipe_status(c), TDP_OK);
    assert_int_equal(stat_reconnects(c), 0);
    tdp_pipe_free(c);

    /* nobody listens: refused once the wait is over */
    port = free_port();
    o.connect_wait_ms = 700;
    t0 = mono_ms();
    tdp_err rc = tdp_pipe_connect(cl, "127.0.0.1", port, &o, &c);
    dt = mono_ms() - t0;
    print_message("no listener: connect ended with %s after %" PRId64 " ms (wait 700)\n",
                  tdp_errname(rc), dt);
    assert_int_equal(rc, TDP_ECONNREFUSED);
    assert_true(dt >= 650 && dt < 700 + 2000);

    /* without the option: at once */
    o.connect_wait_ms = 0;
    t0 = mono_ms();
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", port, &o, &c), TDP_ECONNREFUSED);
    assert_true(mono_ms() - t0 < 500);

    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/*
 * Child: a consumer on 127.0.0.1:port that takes n messages (0: until
 * killed), each carrying its own seq as its pattern, from the seq its
 * producer resumed at; exits 0 when they all check out.
 */
static void child_consumer(uint16_t port, int n)
{
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.recv_depth = 4;
    if (tdp_loop_new(NULL, &loop) != TDP_OK || tdp_loop_start_thread(loop) != TDP_OK ||
        tdp_listener_new(loop, "127.0.0.1", port, &o, NULL, NULL, &l) != TDP_OK ||
        tdp_listener_accept(l, TMO, &p) != TDP_OK)
        _exit(3);
    uint64_t expect = 0;
    for (int i = 0; n == 0 || i < n; i++) {
        tdp_td *got;
        if (tdp_pipe_recv(p, TMO, &got) != TDP_OK)
            _exit(4);
        if (expect == 0) {
            tdp_pipe_stats st;
            tdp_pipe_stats_get(p, &st);
            expect = st.resumed_from != 0 ? st.resumed_from : 1;
        }
        if (!verify(got, expect++))
            _exit(5);
        tdp_pipe_release(p, got);
    }
    tdp_pipe_stats st;
    tdp_pipe_stats_get(p, &st);
    printf("consumer: resumed at %" PRIu64 ", took %d\n", st.resumed_from, n);
    fflush(stdout);
    _exit(st.resumed_from > 1 ? 0 : 6);
}

static pid_t spawn_consumer(uint16_t port, int n)
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char ps[16], ns[16];
        snprintf(ps, sizeof(ps), "%u", port);
        snprintf(ns, sizeof(ns), "%d", n);
        execl("/proc/self/exe", "test_pipe", "--consumer", ps, ns, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/*
 * The consumer process is SIGKILLed mid-stream and a new one started on the
 * same port: the producer's stream goes on there, from the seq after the
 * last one it sent, every message whole and in order (the new consumer
 * checks each against its seq). Sends in between either succeed, end with
 * TDP_ECONNRESET (the old link held them), or wait for the new consumer.
 */
static void test_reconnect_killed(void **state)
{
    uint16_t port = free_port();
    pid_t first = spawn_consumer(port, 0);
    tdp_loop *cl;
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    tdp_pipe_opts ob, o = *mode_opts(NULL, &ob);
    o.reconnect_ms = 10000;
    o.connect_timeout_ms = 10000;
    tdp_pipe *c;
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", port, &o, &c), TDP_OK);
    tdp_schema *s = bytes_schema(256 << 10);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    uint64_t seq = 0;
    int resets = 0;
    for (int i = 0; i < 20; i++) {
        fill(td, ++seq);
        assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    }
    kill(first, SIGKILL);
    int st;
    waitpid(first, &st, 0);
    pid_t second = spawn_consumer(port, 10);
    /* send on until the new consumer has taken its ten (bounded) */
    int64_t end = mono_ms() + 15000;
    pid_t done = 0;
    while (done == 0 && mono_ms() < end) {
        fill(td, ++seq);
        tdp_err rc = tdp_pipe_send(c, td, 1000);
        if (rc == TDP_ECONNRESET)
            resets++;
        else if (rc == TDP_ETIMEDOUT)
            seq--; /* withdrawn before it was posted: that seq was never used */
        else
            assert_int_equal(rc, TDP_OK);
        done = waitpid(second, &st, WNOHANG);
    }
    if (done == 0) {
        kill(second, SIGKILL);
        waitpid(second, &st, 0);
        fail_msg("the new consumer did not get its messages within 15 s");
    }
    tdp_pipe_stats ps;
    tdp_pipe_stats_get(c, &ps);
    print_message("reconnects %" PRIu64 ", %d send(s) ended with ECONNRESET, %" PRIu64
                  " sent in all; new consumer exit %d\n",
                  ps.reconnects, resets, seq, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    /* the kill; and the new consumer's exit once it had its ten, if seen yet */
    assert_true(ps.reconnects >= 1 && ps.reconnects <= 2);
    tdp_pipe_free(c);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_loop_free(cl);
}

/* ---- shared-secret authentication ----------------------------------------------- */

/* The lanes of a pipe's UCX endpoint, as UCX prints them (on the pipe's loop). */
typedef struct lanes_q {
    tdp_pipe *pipe;
    char *text;
    size_t len;
} lanes_q;

static void lanes_task(void *arg)
{
    lanes_q *q = arg;
    ucp_ep_h ep = tdp__ucx_link_ep(tdp__session_link(q->pipe));
    FILE *f = open_memstream(&q->text, &q->len);
    if (f == NULL)
        return;
    if (ep != NULL)
        ucp_ep_print_info(ep, f);
    fclose(f);
}

/* Whether the endpoint of p has a lane on one of UCX's shared-memory transports. */
static bool lanes_shm(tdp_pipe *p)
{
    lanes_q q = {.pipe = p};
    tdp__call_on_loop(tdp__session_loop(p), lanes_task, &q);
    assert_non_null(q.text);
    bool shm = false;
    for (char *line = strtok(q.text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (strstr(line, "lane[") == NULL)
            continue;
        print_message("  %s\n", line);
        shm |= strstr(line, "posix/") != NULL || strstr(line, "sysv/") != NULL;
    }
    free(q.text);
    return shm;
}

/*
 * What keeps a same-host peer killed mid-message from stopping other pipes
 * (docs/security.md), with and without a shared secret alike: a pipe on
 * UCX's shared-memory transports is on a worker of its own, whose receive
 * FIFO no other peer writes into, and one on the general worker is in
 * UCX's peer-failure mode, which leaves those transports out (the general
 * context keeps their error handling off), so it shares no FIFO either.
 * With a secret the own worker is made after the proofs and its address
 * travels in PROVEN; before, such a pipe took the general worker (over
 * TCP, and no pipe at all under UCX_TLS=shm,self). Messages must flow both
 * ways: the dialer may send before the listener has read its PROVEN.
 */
static void test_secret_same_host_lanes(void **state)
{
    if (test_plane() != TDP_PLANE_UCX)
        skip();
    static const char secret[] = "correct horse battery staple";
    tdp_schema *sc = make_schema(0, 1000);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(sc, &td), TDP_OK);
    for (int with = 0; with < 2; with++) {
        tdp_pipe_opts o;
        tdp_pipe_opts_default(&o);
        if (with) {
            o.secret = secret;
            o.secret_len = sizeof(secret) - 1;
        }
        env e;
        env_up(&e, &o, &o);
        const char *m = getenv("TDP_TEST_PEER_MODE");
        tdp__ucx *ucx = tdp__ucx_peek(e.sl);
        bool local = (m == NULL || strcmp(m, "ucx") != 0) && ucx != NULL &&
                     ucx->nworkers > TDP_WORKER_LOCAL && ucx->worker[TDP_WORKER_LOCAL] != NULL;
        tdp_pipe *side[2] = {e.cli, e.srv};
        for (int i = 0; i < 2; i++) {
            tdp__link *l = tdp__session_link(side[i]);
            int wi = tdp__ucx_link_worker(l);
            print_message("%s, %s: worker %s, peer-failure mode %d\n",
                          with ? "secret" : "no secret", i ? "listener" : "dialer",
                          wi == TDP_WORKER_LOCAL ? "own" : "general", tdp__ucx_link_peer_mode(l));
            bool shm = lanes_shm(side[i]);
            assert_int_equal(wi, local ? TDP_WORKER_LOCAL : TDP_WORKER_ANY);
            assert_true(tdp__ucx_link_peer_mode(l));
            if (wi != TDP_WORKER_LOCAL)
                assert_false(shm); /* no FIFO shared with other peers */
        }
        for (uint64_t seq = 1; seq <= 3; seq++) {
            fill(td, seq);
            assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
            assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
            assert_true(verify(got, seq));
            tdp_pipe_release(e.srv, got);
            assert_int_equal(tdp_pipe_send(e.srv, td, TMO), TDP_OK);
            assert_int_equal(tdp_pipe_recv(e.cli, TMO, &got), TDP_OK);
            assert_true(verify(got, seq));
            tdp_pipe_release(e.cli, got);
        }
        env_down(&e);
    }
    tdp_td_unref(td);
    tdp_schema_unref(sc);
}

/*
 * With a secret the dialer opens on the listener's PROVEN and may send at
 * once: its first frames can reach the listener's own worker before the
 * listener has read the dialer's PROVEN (its pipe not open yet). Sent here
 * before the listener's pipe is taken: they must all arrive, in order.
 */
static void test_secret_send_first(void **state)
{
    static const char secret[] = "correct horse battery staple";
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.secret = secret;
    o.secret_len = sizeof(secret) - 1;
    o.recv_depth = 4; /* room for all three before the listener takes one */
    tdp_pipe_opts sb, cb;
    const tdp_pipe_opts *so = mode_opts(&o, &sb), *co = mode_opts(&o, &cb);
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *cli, *srv;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, so, NULL, NULL, &l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), co, &cli), TDP_OK);
    tdp_schema *sc = make_schema(0, 1000);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(sc, &td), TDP_OK);
    const uint32_t n = 3;
    for (uint64_t seq = 1; seq <= n; seq++) {
        fill(td, seq);
        assert_int_equal(tdp_pipe_send(cli, td, TMO), TDP_OK);
    }
    assert_int_equal(tdp_listener_accept(l, TMO, &srv), TDP_OK);
    print_message("%u messages sent before the accept, plane %s\n", n,
                  tdp_plane_name(tdp_pipe_plane(srv)));
    for (uint64_t seq = 1; seq <= n; seq++) {
        assert_int_equal(tdp_pipe_recv(srv, TMO, &got), TDP_OK);
        assert_true(verify(got, seq));
        tdp_pipe_release(srv, got);
    }
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    tdp_pipe_free(cli);
    tdp_pipe_free(srv);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/* One connect against a listener, each side with its own secret (NULL: none). */
static tdp_err auth_try(const char *srv_secret, const char *cli_secret, tdp_err *accepted,
                        int64_t *ms)
{
    tdp_pipe_opts so, co;
    tdp_pipe_opts_default(&so);
    tdp_pipe_opts_default(&co);
    if (srv_secret != NULL) {
        so.secret = srv_secret;
        so.secret_len = strlen(srv_secret);
    }
    if (cli_secret != NULL) {
        co.secret = cli_secret;
        co.secret_len = strlen(cli_secret);
    }
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *c = NULL, *p = NULL;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, &so, NULL, NULL, &l), TDP_OK);
    int64_t t0 = mono_ms();
    tdp_err rc = tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), &co, &c);
    *ms = mono_ms() - t0;
    *accepted = tdp_listener_accept(l, rc == TDP_OK ? TMO : 300, &p);
    if (rc == TDP_OK && *accepted == TDP_OK) {
        /* and the pipe works */
        tdp_schema *s = bytes_schema(4096);
        tdp_td *td, *got;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        fill(td, 5);
        assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_true(verify(got, 5));
        tdp_td_unref(td);
        tdp_schema_unref(s);
    }
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
    return rc;
}

/*
 * Both sides with the same secret: a working pipe. Wrong, missing on either
 * side: TDP_EAUTH at once, and no pipe on the listener's side. A stranger
 * that echoes the listener's own HELLO back gets no proof from it to
 * reflect (the listener proves itself after the dialer), and a BYE saying
 * TDP_EAUTH for the proof it makes up, never a pipe.
 */
static void test_auth(void **state)
{
    tdp_err acc;
    int64_t ms;
    assert_int_equal(auth_try("correct horse battery", "correct horse battery", &acc, &ms),
                     TDP_OK);
    assert_int_equal(acc, TDP_OK);
    const char *cases[][2] = {
        {"correct horse battery", "correct horse batterY"},
        {"correct horse battery", NULL},
        {NULL, "correct horse battery"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        assert_int_equal(auth_try(cases[i][0], cases[i][1], &acc, &ms), TDP_EAUTH);
        print_message("auth case %zu: TDP_EAUTH after %" PRId64 " ms\n", i, ms);
        assert_true(ms < 2000);
        assert_int_equal(acc, TDP_ETIMEDOUT);
    }
    /* secrets out of bounds are the caller's mistake */
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.secret = "short";
    o.secret_len = 5;
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, &o, NULL, NULL, &l), TDP_EINVAL);
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", 9, &o, &p), TDP_EINVAL);
    tdp_loop_free(loop);

    /* reflection: send the listener its own HELLO (its nonce changed: the
     * HELLO as it is is refused at once as an echo), then its own proof */
    static const char secret[] = "a secret the stranger lacks";
    tdp_pipe_opts_default(&o);
    o.secret = secret;
    o.secret_len = sizeof(secret) - 1;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, &o, NULL, NULL, &l), TDP_OK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                             .sin_port = htons(tdp_listener_port(l))};
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    static uint8_t buf[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN];
    ssize_t n = read_ctl_frame(fd, buf, sizeof(buf), 5000);
    assert_true(n > (ssize_t)TDP_CTL_HDR_LEN);
    buf[TDP_CTL_HDR_LEN + 56] ^= 1; /* the nonce's first byte */
    assert_int_equal(send(fd, buf, (size_t)n, MSG_NOSIGNAL), n); /* its HELLO, echoed */
    /* the listener proves itself only after the dialer has: nothing to reflect */
    usleep(200 * 1000);
    assert_int_equal(recv(fd, buf, sizeof(buf), MSG_DONTWAIT), -1);
    uint8_t forged[TDP_CTL_HDR_LEN + TDP_AUTH_TAG_LEN], tag[TDP_AUTH_TAG_LEN] = {0};
    tdp_wire_auth_encode(forged, tag);
    assert_int_equal(send(fd, forged, sizeof(forged), MSG_NOSIGNAL), (ssize_t)sizeof(forged));
    n = read_ctl_frame(fd, buf, sizeof(buf), 5000);
    assert_int_equal(n, TDP_CTL_HDR_LEN + TDP_BYE_LEN);
    tdp_bye bye;
    assert_int_equal(tdp_wire_bye_decode(buf + TDP_CTL_HDR_LEN, TDP_BYE_LEN, &bye), TDP_OK);
    assert_int_equal(bye.reason, TDP_EAUTH);
    assert_int_equal(tdp_listener_accept(l, 200, &p), TDP_ETIMEDOUT);
    close(fd);
    tdp_listener_free(l);
    tdp_loop_free(loop);
}

/*
 * shm plane: descriptors naming what they may not — a slot past the pool, a
 * pool that was never announced, a slot the receiver still holds — end the
 * pipe with TDP_EPROTO and touch nothing (ASan runs this too).
 */
static void test_shm_hostile_descriptors(void **state)
{
    for (int k = 0; k < 3; k++) {
        tdp_pipe_opts o;
        tdp_pipe_opts_default(&o);
        o.recv_depth = 2;
        env e;
        env_up(&e, &o, &o);
        if (tdp_pipe_plane(e.cli) != TDP_PLANE_SHM) {
            print_message("not the shm plane: nothing to do\n");
            env_down(&e);
            return;
        }
        tdp_schema *s = bytes_schema(4096);
        tdp_td *td, *got;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        fill(td, 1);
        /* one real message, held: pool generation 1 is in force, slot 0 is out */
        assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        shm_rogue r = {.l = tdp__session_link(e.cli)};
        r.d.type = tdp__shm_desc_word(TDP__SHM_DESC_DATA, k == 1 ? 99 : 1);
        r.d.slot = k == 0 ? 100000 : 0;
        r.d.seq = 2;
        r.d.hash = tdp_schema_hash(s);
        r.d.arg = 4096;
        tdp__call_on_loop(e.cl, shm_rogue_task, &r);
        assert_int_equal(r.rc, TDP_OK);
        tdp_td *next;
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &next), TDP_EPROTO);
        assert_true(verify(got, 1)); /* the held view is intact */
        tdp_pipe_release(e.srv, got);
        tdp_td_unref(td);
        tdp_schema_unref(s);
        env_down(&e);
    }
}

/* A view lent by a sender that then died stays readable until released. */
static void test_view_outlives_sender(void **state)
{
    env e;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.recv_depth = 2; /* with depth 1 the next receive would release the view */
    env_up(&e, &o, &o);
    tdp_schema *s = bytes_schema(1u << 20);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    fill(td, 5);
    assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    /* the sender goes away entirely: pipe, loop and with them its pool */
    tdp_pipe_abort(e.cli, TDP_ECANCELED);
    tdp_pipe_free(e.cli);
    e.cli = NULL;
    tdp_loop_free(e.cl);
    e.cl = NULL;
    tdp_td *next;
    tdp_err rc = tdp_pipe_recv(e.srv, TMO, &next);
    assert_true(rc == TDP_ECONNRESET || rc == TDP_ECLOSED || rc == TDP_ECANCELED);
    assert_true(verify(got, 5));
    tdp_pipe_release(e.srv, got);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

/*
 * Blocking calls from several threads on one loop that nobody runs: a
 * sender thread, the receiving main thread and a thread asking for stats
 * and status. Whoever waits drives the loop, and a waiter whose call is not
 * done yet takes over when the driver's own call ends.
 */
typedef struct poller {
    pthread_t th;
    tdp_pipe *pipe;
    atomic_bool stop;
    int rounds;
} poller;

static void *poller_main(void *arg)
{
    poller *q = arg;
    while (!atomic_load(&q->stop) && q->rounds < 100000) {
        tdp_pipe_stats st;
        tdp_pipe_stats_get(q->pipe, &st);
        (void)tdp_pipe_status(q->pipe);
        (void)tdp_pipe_recv_schema(q->pipe);
        q->rounds++;
        usleep(500);
    }
    return NULL;
}

static void test_threads_no_runner(void **state)
{
    enum { N = 300 };
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *c, *p;
    tdp_pipe_opts so, sb, cb;
    tdp_pipe_opts_default(&so);
    so.recv_depth = 4;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, mode_opts(&so, &sb), NULL, NULL, &l),
                     TDP_OK);
    assert_int_equal(
        tdp_pipe_connect(loop, "127.0.0.1", tdp_listener_port(l), mode_opts(NULL, &cb), &c),
        TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_schema *s = bytes_schema(100000);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    sender snd = {.pipe = c, .tds = &td, .ntds = 1, .count = N, .close = true};
    sender_start(&snd);
    poller q = {.pipe = p};
    atomic_init(&q.stop, false);
    assert_int_equal(pthread_create(&q.th, NULL, poller_main, &q), 0);
    for (uint64_t i = 1; i <= N; i++) {
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_true(verify(got, i));
        tdp_pipe_release(p, got);
    }
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_ECLOSED);
    pthread_join(snd.th, NULL);
    assert_int_equal(snd.rc, TDP_OK);
    atomic_store(&q.stop, true);
    pthread_join(q.th, NULL);
    assert_true(q.rounds > 0);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(p, &st);
    assert_int_equal(st.msgs_recv, N);
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/*
 * A listener out of file descriptors pauses accepting instead of spinning
 * on the connection that waits in its backlog, says so once, and accepts
 * again once descriptors free up.
 */
static atomic_int fd_warnings;

static void count_fd_warnings(tdp_log_level level, const char *file, int line, const char *msg,
                              void *arg)
{
    if (strstr(msg, "accept") != NULL)
        atomic_fetch_add(&fd_warnings, 1);
}

static void test_accept_out_of_fds(void **state)
{
    tdp_loop *loop, *cl;
    tdp_listener *l;
    tdp_pipe *p, *c;
    struct rlimit saved, low;
    atomic_store(&fd_warnings, 0);
    tdp_log_level lvl = tdp_log_get_level();
    tdp_log_set_level(TDP_LOG_WARN);
    tdp_log_set_handler(count_fd_warnings, NULL);
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    tdp_pipe_opts ob;
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, mode_opts(NULL, &ob), NULL, NULL, &l),
                     TDP_OK);
    uint16_t port = tdp_listener_port(l);
    /* a child holds 32 connections open in the listener's backlog */
    int ctl[2];
    assert_int_equal(pipe(ctl), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* a fresh process (exec): a bare fork of this threaded one may
         * inherit a lock some thread held */
        char ps[16];
        close(ctl[1]);
        dup2(ctl[0], 0);
        snprintf(ps, sizeof(ps), "%u", port);
        execl("/proc/self/exe", "test_pipe", "--hold", ps, (char *)NULL);
        _exit(127);
    }
    close(ctl[0]);
    /* this process may open only a few more descriptors */
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &saved), 0);
    low = saved;
    low.rlim_cur = (rlim_t)count_fds() + 2;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    struct timespec a, b;
    /* the backlog fills, accept hits the limit (bounded wait: a loaded machine) */
    for (int i = 0; i < 1000 && atomic_load(&fd_warnings) == 0; i++)
        usleep(10 * 1000);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
    usleep(1000 * 1000);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
    double cpu = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &saved), 0);
    print_message("out of fds: %.0f ms of CPU in 1 s, %d log line(s)\n", cpu * 1e3,
                  atomic_load(&fd_warnings));
    assert_true(cpu < 0.3);                     /* a spinning accept burns the whole second */
    assert_true(atomic_load(&fd_warnings) >= 1); /* it did run out, and said so */
    assert_true(atomic_load(&fd_warnings) <= 3); /* once per episode, not per try */
    /* descriptors back: the strangers go, a real client gets in */
    close(ctl[1]);
    int st;
    waitpid(pid, &st, 0);
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", port, mode_opts(NULL, &ob), &c), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(loop);
    tdp_log_set_handler(NULL, NULL);
    tdp_log_set_level(lvl);
}

/* UCX failing is a pipe's or listener's error, not the loop's; a later call retries. */
static void test_ucx_unavailable(void **state)
{
    const char *tls = getenv("UCX_TLS");
    char *saved = tls != NULL ? strdup(tls) : NULL;
    tdp_loop *loop = NULL;
    tdp_listener *l = NULL;
    tdp_pipe *p = NULL;

    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = TDP_PLANE_UCX; /* the shm plane needs no UCX */
    setenv("UCX_TLS", "nosuchtransport", 1); /* UCX reads it when a context is made */
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_EUCX);
    assert_null(l);
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", 9, &o, &p), TDP_EUCX);
    assert_null(p);
    assert_null(tdp__ucx_peek(loop));
    if (saved != NULL)
        setenv("UCX_TLS", saved, 1);
    else
        unsetenv("UCX_TLS");
    free(saved);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_OK);
    assert_non_null(tdp__ucx_peek(loop));
    tdp_listener_free(l);
    tdp_loop_free(loop);
}

/* test_accept_out_of_fds's child: 32 connections held until stdin ends. */
static void child_hold(uint16_t port)
{
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                             .sin_port = htons(port)};
    for (int i = 0; i < 32; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0)
            (void)connect(fd, (struct sockaddr *)&sa, sizeof(sa));
    }
    char b;
    (void)read(0, &b, 1); /* until the parent says so (or dies) */
    _exit(0);
}

/*
 * Cases that do not apply to device buffers, and why. Everything else runs
 * in device mode with the schemas on cuda:0.
 */
static const struct {
    const char *name, *why;
} host_only[] = {
    {"test_ipv6_and_names", "addressing and name resolution: no payload"},
    {"test_garbage_frame", "hostile frames: the decoder never sees payload memory"},
    {"test_hostile_schema", "hostile schemas: rejected before any buffer exists"},
    {"test_data_without_schema", "hostile frames: rejected before any buffer is used"},
    {"test_forged_credit", "hostile credit frames: no payload"},
    {"test_garbage_control", "hostile control bytes: no payload"},
    {"test_version_mismatch", "the handshake only"},
    {"test_connect_cycles", "connection churn: no payload"},
    {"test_many_pipes_two_loops", "connection fan-out with host echo payloads"},
    {"test_gather", "gathers from host pointers (tdp_pipe_send_gather)"},
    {"test_ucx_unavailable", "UCX start-up failure: no payload"},
    {"test_loans", "loans are host memory from the plane's pool"},
    {"test_shm_hostile_descriptors", "hostile shm descriptors: no payload"},
    {"test_accept_out_of_fds", "descriptor exhaustion: no payload"},
    {"test_auth", "authentication: the handshake only"},
    {"test_reconnect", "reconnection: control-channel logic with host payloads"},
    {"test_connect_wait", "connect waiting: no payload"},
    {"test_reconnect_killed", "reconnection after a kill: control-channel logic"},
};

static void skip_host_only(void **state)
{
    print_message("skipped with device buffers: %s\n", (const char *)*state);
    skip();
}

/*
 * TDP_TEST_MEM=cuda: the real driver where it has a GPU, else the fake
 * (children inherit the choice through TDPIPE_CUDA).
 */
static void device_mode_setup(void)
{
    const char *mem = getenv("TDP_TEST_MEM");
    char d[128];
    dev_mode = mem != NULL && strcmp(mem, "cuda") == 0;
    if (!dev_mode)
        return;
    if (getenv("TDPIPE_CUDA") == NULL && tdp__cuda_device_count() == 0) {
        setenv("TDPIPE_CUDA", "fake", 1);
        if (tdp__cuda_select("fake") != TDP_OK)
            abort();
    }
    if (tdp__cuda_device_count() == 0) {
        fprintf(stderr, "TDP_TEST_MEM=cuda: no CUDA device (%s)\n",
                tdp__cuda_describe(d, sizeof(d)));
        exit(1);
    }
    printf("# device mode: payloads on cuda:0, %s\n", tdp__cuda_describe(d, sizeof(d)));
}

int main(int argc, char **argv)
{
    device_mode_setup();
    if (argc == 3 && strcmp(argv[1], "--hold") == 0)
        child_hold((uint16_t)atoi(argv[2]));
    if (argc == 4 && strcmp(argv[1], "--child") == 0)
        child_stream((uint16_t)atoi(argv[2]), strcmp(argv[3], "send") == 0);
    if (argc == 4 && strcmp(argv[1], "--consumer") == 0)
        child_consumer((uint16_t)atoi(argv[2]), atoi(argv[3]));
    const char *tls = getenv("UCX_TLS"), *mode = getenv("TDP_TEST_PEER_MODE"),
               *plane = getenv("TDP_TEST_PLANE");
    printf("# UCX_TLS=%s peer mode=%s plane=%s\n", tls ? tls : "(default)", mode ? mode : "auto",
           plane ? plane : "auto");
    signal(SIGPIPE, SIG_IGN);
    struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handshake),
        cmocka_unit_test(test_steady_1000),
        cmocka_unit_test(test_latency_stats),
        cmocka_unit_test(test_schema_changes),
        cmocka_unit_test(test_tiny),
        cmocka_unit_test(test_large_256mib),
        cmocka_unit_test(test_depth_ring),
        cmocka_unit_test(test_bidirectional),
        cmocka_unit_test(test_timeouts),
        cmocka_unit_test(test_ipv6_and_names),
        cmocka_unit_test(test_kill_sender),
        cmocka_unit_test(test_kill_receiver),
        cmocka_unit_test(test_device_copy_fault),
        cmocka_unit_test(test_garbage_frame),
        cmocka_unit_test(test_hostile_schema),
        cmocka_unit_test(test_data_without_schema),
        cmocka_unit_test(test_forged_credit),
        cmocka_unit_test(test_garbage_control),
        cmocka_unit_test(test_version_mismatch),
        cmocka_unit_test(test_storage_reuse),
        cmocka_unit_test(test_connect_cycles),
        cmocka_unit_test(test_many_pipes_two_loops),
        cmocka_unit_test(test_recv_device_override),
        cmocka_unit_test(test_gather),
        cmocka_unit_test(test_async_ops),
        cmocka_unit_test(test_single_thread),
        cmocka_unit_test(test_threads_no_runner),
        cmocka_unit_test(test_ucx_unavailable),
        cmocka_unit_test(test_loans),
        cmocka_unit_test(test_view_outlives_sender),
        cmocka_unit_test(test_shm_hostile_descriptors),
        cmocka_unit_test(test_accept_out_of_fds),
        cmocka_unit_test(test_auth),
        cmocka_unit_test(test_secret_same_host_lanes),
        cmocka_unit_test(test_secret_send_first),
        cmocka_unit_test(test_reconnect),
        cmocka_unit_test(test_connect_wait),
        cmocka_unit_test(test_reconnect_killed),
    };
    /* TDP_TEST_FILTER=pattern runs only the matching tests, TDP_TEST_SKIP=pattern
     * leaves the matching ones out (cmocka wildcards) */
    const char *filter = getenv("TDP_TEST_FILTER"), *skip = getenv("TDP_TEST_SKIP");
    if (filter != NULL && *filter != '\0')
        cmocka_set_test_filter(filter);
    size_t ntests = sizeof(tests) / sizeof(tests[0]);
    for (size_t i = 0; dev_mode && i < ntests; i++) {
        for (size_t k = 0; k < sizeof(host_only) / sizeof(host_only[0]); k++) {
            if (strcmp(tests[i].name, host_only[k].name) == 0) {
                tests[i].test_func = skip_host_only;
                tests[i].initial_state = (void *)host_only[k].why;
            }
        }
    }
    if (skip != NULL && strchr(skip, ':') != NULL)
        ntests = skip_named(tests, ntests, skip); /* a list of names */
    else if (skip != NULL && *skip != '\0')
        cmocka_set_skip_filter(skip);
    return _cmocka_run_group_tests("tests", tests, ntests, NULL, NULL);
}
