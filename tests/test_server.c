/*
 * test_server: tdp_server with many clients — different schemas at once,
 * request/reply, the reply ring, limits (max clients, handshake deadline),
 * hostile clients, handler errors, connect/disconnect cycles without leaks,
 * a client killed mid-stream, graceful shutdown.
 *
 * Loopback only, ephemeral ports, every wait bounded. cmocka asserts run on
 * the main thread only: client threads and handlers record what they saw.
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
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "test_skip.h"
#include "test_rogue_am.h"
#include "test_util.h"

#include <tdpipe/tdpipe.h>

#include "pipe/op.h"
#include "pipe/ucx/plane_ucx.h"
#include "pipe/session.h"
#include "pipe/ucx/ucx_workers.h"

#define TMO     20000 /* ms: generous bound for any single wait */
#define MAX_IDS 1024

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

/* Poll cond for up to ms; true if it held. */
#define WAIT_FOR(cond, ms)                                                                         \
    ({                                                                                             \
        int64_t _end = mono_ms() + (ms);                                                           \
        while (!(cond) && mono_ms() < _end)                                                        \
            sleep_ms(2);                                                                           \
        (bool)(cond);                                                                              \
    })

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (d == NULL)
        return -1;
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

/* ---- payloads: a header {cid, seq} and leaves filled from (cid, seq, leaf) --- */

static void pat_fill(uint8_t *p, uint64_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull;
    for (uint64_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = x ^ (i * 0xBF58476D1CE4E5B9ull);
        memcpy(p + i, &v, 8);
    }
    for (uint64_t i = n & ~7ull; i < n; i++)
        p[i] = (uint8_t)(seed + i);
}

static bool pat_check(const uint8_t *p, uint64_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull;
    for (uint64_t i = 0; i + 8 <= n; i += 8) {
        uint64_t v = x ^ (i * 0xBF58476D1CE4E5B9ull), got;
        memcpy(&got, p + i, 8);
        if (got != v)
            return false;
    }
    for (uint64_t i = n & ~7ull; i < n; i++)
        if (p[i] != (uint8_t)(seed + i))
            return false;
    return true;
}

static uint64_t seed_of(int64_t cid, int64_t seq, uint32_t leaf)
{
    return ((uint64_t)cid << 40) ^ ((uint64_t)seq << 8) ^ leaf;
}

static void td_fill(tdp_td *td, int64_t cid, int64_t seq)
{
    tdp_leaf l;
    for (uint32_t i = 0; i < tdp_td_num_leaves(td); i++) {
        tdp_td_leaf_at(td, i, &l);
        if (l.kind != TDP_LEAF_TENSOR)
            continue;
        if (strcmp(l.path, "hdr") == 0) {
            int64_t h[2] = {cid, seq};
            memcpy(l.data, h, sizeof(h));
        } else {
            pat_fill(l.data, l.nbytes, seed_of(cid, seq, i));
        }
    }
}

/* Every byte checked; *cid and *seq come from the header. */
static bool td_check(const tdp_td *td, int64_t *cid, int64_t *seq)
{
    tdp_leaf l;
    int64_t h[2];
    if (tdp_td_get(td, "hdr", &l) != TDP_OK || l.nbytes != sizeof(h))
        return false;
    memcpy(h, l.data, sizeof(h));
    for (uint32_t i = 0; i < tdp_td_num_leaves(td); i++) {
        tdp_td_leaf_at(td, i, &l);
        if (l.kind != TDP_LEAF_TENSOR || strcmp(l.path, "hdr") == 0)
            continue;
        if (!pat_check(l.data, l.nbytes, seed_of(h[0], h[1], i)))
            return false;
    }
    if (cid != NULL)
        *cid = h[0];
    if (seq != NULL)
        *seq = h[1];
    return true;
}

/* A schema of client cid's own: its keys, dtypes and sizes; variant 1 differs. */
static tdp_schema *stream_schema(int cid, int variant, int64_t nbytes)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    char path[64];
    const int64_t two = 2;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "hdr", TDP_INT64, 1, &two), TDP_OK);
    int64_t n = nbytes + (variant ? 64 : 0);
    snprintf(path, sizeof(path), "c%d.payload", cid);
    assert_int_equal(tdp_schema_builder_tensor(b, path, TDP_UINT8, 1, &n), TDP_OK);
    int64_t aux[2] = {cid % 5 + 1, 3};
    snprintf(path, sizeof(path), "c%d.%s", cid, variant ? "ids" : "aux");
    assert_int_equal(tdp_schema_builder_tensor(b, path, variant ? TDP_INT32 : TDP_FLOAT32, 2, aux),
                     TDP_OK);
    if (variant) {
        snprintf(path, sizeof(path), "c%d.tag", cid);
        assert_int_equal(tdp_schema_builder_string(b, path, "second"), TDP_OK);
    }
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    return s;
}

static tdp_schema *req_schema(int64_t n)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    const int64_t two = 2;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "hdr", TDP_INT64, 1, &two), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_FLOAT32, 1, &n), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    return s;
}

/* ---- the server side: one context, several handler behaviours ------------------ */

enum mode {
    MODE_ECHO,   /* verify every byte, send the same td back */
    MODE_REQREP, /* reply {hdr, sum, y = 2x + 1} in a schema of its own */
    MODE_RING,   /* on the first message, queue replies until the ring is full */
};

typedef struct srv_ctx {
    enum mode mode;
    atomic_int connects, closes, msgs, bad;
    atomic_int close_clean;
    atomic_int reject;               /* on_connect turns away while > 0 (counts down) */
    int64_t fail_cid, fail_seq;      /* on_message fails for this message */
    atomic_int ring_ok, ring_eagain; /* MODE_RING results (read by the test thread) */
    tdp_td *ring_td;
    _Atomic int status[MAX_IDS]; /* on_close status per client id (1 = not yet) */
    _Atomic int64_t cid_of[MAX_IDS];
    atomic_int bad_thread;
    tdp_loop *loop;
} srv_ctx;

/* MODE_REQREP: per client, the reply buffer, rebuilt only when the request changes. */
typedef struct rr_client {
    tdp_schema *req, *rep_schema;
    tdp_td *rep;
} rr_client;

static tdp_err h_connect(tdp_client *c, void *arg)
{
    srv_ctx *x = arg;
    if (!tdp_loop_on_thread(x->loop))
        atomic_fetch_add(&x->bad_thread, 1);
    atomic_fetch_add(&x->connects, 1);
    if (atomic_load(&x->reject) > 0) {
        atomic_fetch_sub(&x->reject, 1);
        return TDP_EINVAL;
    }
    if (x->mode == MODE_REQREP) {
        rr_client *r = calloc(1, sizeof(*r));
        if (r == NULL)
            return TDP_ENOMEM;
        tdp_client_set_data(c, r);
    }
    return TDP_OK;
}

static tdp_err build_reply(rr_client *r, tdp_schema *req)
{
    tdp_leaf x;
    tdp_schema_builder *b;
    const int64_t one = 1, two = 2;
    tdp_err rc;
    if (tdp_schema_find(req, "x", &x) != TDP_OK || x.ndim != 1)
        return TDP_ESCHEMA;
    int64_t n = x.shape[0];
    if ((rc = tdp_schema_builder_new(&b)) != TDP_OK)
        return rc;
    tdp_schema_builder_tensor(b, "hdr", TDP_INT64, 1, &two);
    tdp_schema_builder_tensor(b, "sum", TDP_FLOAT64, 1, &one);
    tdp_schema_builder_tensor(b, "y", TDP_FLOAT32, 1, &n);
    tdp_schema_builder_string(b, "kind", "reply");
    tdp_schema *s = NULL;
    rc = tdp_schema_builder_finish(b, &s, NULL, 0);
    tdp_schema_builder_free(b);
    if (rc != TDP_OK)
        return rc;
    tdp_td_unref(r->rep);
    tdp_schema_unref(r->rep_schema);
    tdp_schema_unref(r->req);
    r->rep_schema = s;
    r->req = tdp_schema_ref(req);
    return tdp_td_new(s, &r->rep);
}

static tdp_err h_message(tdp_client *c, tdp_td *td, void *arg)
{
    srv_ctx *x = arg;
    int64_t cid = 0, seq = 0;
    tdp_leaf l;
    if (!tdp_loop_on_thread(x->loop))
        atomic_fetch_add(&x->bad_thread, 1);
    atomic_fetch_add(&x->msgs, 1);
    if (tdp_td_get(td, "hdr", &l) == TDP_OK) {
        cid = ((const int64_t *)l.data)[0];
        seq = ((const int64_t *)l.data)[1];
    }
    if (tdp_client_id(c) < MAX_IDS)
        atomic_store(&x->cid_of[tdp_client_id(c)], cid);
    if (cid == x->fail_cid && seq == x->fail_seq)
        return TDP_EINVAL; /* the handler fails: only this client goes */
    switch (x->mode) {
    case MODE_ECHO:
        if (!td_check(td, NULL, NULL)) {
            atomic_fetch_add(&x->bad, 1);
            return TDP_EINVAL;
        }
        return tdp_client_send(c, td);
    case MODE_REQREP: {
        rr_client *r = tdp_client_get_data(c);
        tdp_err rc;
        if (r->req != tdp_td_schema(td) && (rc = build_reply(r, tdp_td_schema(td))) != TDP_OK)
            return rc;
        tdp_leaf xs, y, sum, h;
        tdp_td_get(td, "x", &xs);
        tdp_td_get(r->rep, "y", &y);
        tdp_td_get(r->rep, "sum", &sum);
        tdp_td_get(r->rep, "hdr", &h);
        const float *in = xs.data;
        float *out = y.data;
        double acc = 0;
        for (uint64_t i = 0; i < xs.numel; i++) {
            acc += in[i];
            out[i] = 2.0f * in[i] + 1.0f;
        }
        *(double *)sum.data = acc;
        memcpy(h.data, l.data, 16);
        return tdp_client_send(c, r->rep);
    }
    case MODE_RING:
        if (atomic_load(&x->ring_ok) == 0 && atomic_load(&x->ring_eagain) == 0) {
            for (int i = 0; i < 20; i++) {
                td_fill(x->ring_td, 77, i + 1);
                tdp_err rc = tdp_client_send(c, x->ring_td);
                if (rc == TDP_OK)
                    atomic_fetch_add(&x->ring_ok, 1);
                else if (rc == TDP_EAGAIN)
                    atomic_fetch_add(&x->ring_eagain, 1);
                else
                    return rc;
            }
        }
        return TDP_OK;
    }
    return TDP_OK;
}

static void h_close(tdp_client *c, tdp_err status, void *arg)
{
    srv_ctx *x = arg;
    if (!tdp_loop_on_thread(x->loop))
        atomic_fetch_add(&x->bad_thread, 1);
    atomic_fetch_add(&x->closes, 1);
    if (status == TDP_ECLOSED)
        atomic_fetch_add(&x->close_clean, 1);
    if (tdp_client_id(c) < MAX_IDS)
        atomic_store(&x->status[tdp_client_id(c)], status);
    rr_client *r = tdp_client_get_data(c);
    if (r != NULL) {
        tdp_td_unref(r->rep);
        tdp_schema_unref(r->rep_schema);
        tdp_schema_unref(r->req);
        free(r);
        tdp_client_set_data(c, NULL);
    }
}

static const tdp_server_handler handler = {
    .size = sizeof(tdp_server_handler),
    .on_connect = h_connect,
    .on_message = h_message,
    .on_close = h_close,
};

typedef struct env {
    tdp_loop *sl, *cl[2];
    tdp_server *s;
    uint16_t port;
    srv_ctx *x;
} env;

static void env_up(env *e, enum mode mode, const tdp_server_opts *o)
{
    memset(e, 0, sizeof(*e));
    e->x = calloc(1, sizeof(*e->x));
    assert_non_null(e->x);
    e->x->mode = mode;
    e->x->fail_cid = -1;
    for (int i = 0; i < MAX_IDS; i++)
        atomic_init(&e->x->status[i], 1);
    assert_int_equal(tdp_loop_new(NULL, &e->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->sl), TDP_OK);
    e->x->loop = e->sl;
    for (int i = 0; i < 2; i++) {
        assert_int_equal(tdp_loop_new(NULL, &e->cl[i]), TDP_OK);
        assert_int_equal(tdp_loop_start_thread(e->cl[i]), TDP_OK);
    }
    assert_int_equal(tdp_server_new(e->sl, "127.0.0.1", 0, o, &handler, e->x, &e->s), TDP_OK);
    e->port = tdp_server_port(e->s);
    assert_true(e->port > 0);
}

static void env_down(env *e)
{
    assert_int_equal(tdp_server_shutdown(e->s, TMO), TDP_OK);
    tdp_server_stats st;
    tdp_server_stats_get(e->s, &st);
    assert_int_equal(st.clients_now, 0);
    /* every client on_connect saw got exactly one on_close, on the loop thread */
    assert_int_equal(atomic_load(&e->x->closes), atomic_load(&e->x->connects));
    assert_int_equal(atomic_load(&e->x->bad_thread), 0);
    tdp_server_free(e->s);
    for (int i = 0; i < 2; i++)
        tdp_loop_free(e->cl[i]);
    tdp_loop_free(e->sl);
    tdp_td_unref(e->x->ring_td);
    free(e->x);
}

static tdp_server_stats stats(env *e)
{
    tdp_server_stats st;
    tdp_server_stats_get(e->s, &st);
    return st;
}

/* ---- client threads ------------------------------------------------------------- */

/*
 * one_loop_per_client: clients that are connected at the same time each
 * use a loop (a UCP worker) of their own. Several pipes open at once
 * between the same two loops can crash UCX 1.13 when one of them ends: it
 * pairs the two sides' endpoints by creation order, not by pipe, so a pipe
 * may be left holding its peer's id of an endpoint another pipe destroyed
 * (see the report on the pipe layer). Clients of different processes, the
 * real case, always have loops of their own.
 */

typedef struct worker {
    pthread_t th;
    int cid;
    tdp_loop *loop;
    uint16_t port;
    int count; /* messages; 0: until the stream ends */
    int64_t nbytes;
    bool change;   /* switch to the second schema halfway */
    bool close;    /* close cleanly at the end (else just free) */
    tdp_err rc;    /* connect, or the first failure */
    tdp_err end;   /* how the stream ended (count 0) */
    atomic_int ok; /* echoes received and verified */
    atomic_bool stop; /* end early (then close as said) */
    int bad;
} worker;

static void *echo_worker(void *arg)
{
    worker *w = arg;
    tdp_loop *own = NULL;
    tdp_pipe *p;
    tdp_schema *s[2];
    tdp_td *td[2], *got;
    /*
     * By default each client has a loop of its own, driven by its blocking
     * calls: see the note on one_loop_per_client below.
     */
    if (w->loop == NULL && (w->rc = tdp_loop_new(NULL, &own)) != TDP_OK)
        return NULL;
    w->rc = tdp_pipe_connect(own ? own : w->loop, "127.0.0.1", w->port, NULL, &p);
    if (w->rc != TDP_OK) {
        tdp_loop_free(own);
        return NULL;
    }
    for (int v = 0; v < 2; v++) {
        s[v] = stream_schema(w->cid, v, w->nbytes);
        tdp_td_new(s[v], &td[v]);
    }
    for (int64_t seq = 1; (w->count == 0 || seq <= w->count) && !atomic_load(&w->stop); seq++) {
        int v = w->change && seq > w->count / 2;
        td_fill(td[v], w->cid, seq);
        tdp_err rc = tdp_pipe_send(p, td[v], TMO);
        if (rc == TDP_OK)
            rc = tdp_pipe_recv(p, TMO, &got);
        if (rc != TDP_OK) {
            w->end = rc;
            if (w->count != 0)
                w->rc = rc;
            break;
        }
        int64_t cid, sq;
        if (!td_check(got, &cid, &sq) || cid != w->cid || sq != seq ||
            !tdp_schema_equal(tdp_td_schema(got), s[v]))
            w->bad++;
        else
            atomic_fetch_add(&w->ok, 1);
    }
    if (w->rc == TDP_OK && w->close)
        w->rc = tdp_pipe_close(p, TMO);
    tdp_pipe_free(p);
    tdp_loop_free(own);
    for (int v = 0; v < 2; v++) {
        tdp_td_unref(td[v]);
        tdp_schema_unref(s[v]);
    }
    return NULL;
}

static void worker_start(worker *w)
{
    assert_int_equal(pthread_create(&w->th, NULL, echo_worker, w), 0);
}

/* ---- tests ------------------------------------------------------------------------ */

static void test_lifecycle(void **state)
{
    tdp_loop *loop;
    tdp_server *s;
    tdp_server_opts o;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    /* bad arguments */
    tdp_server_handler bad = {.size = 0};
    assert_int_equal(tdp_server_new(NULL, NULL, 0, NULL, NULL, NULL, &s), TDP_EINVAL);
    assert_int_equal(tdp_server_new(loop, NULL, 0, NULL, &bad, NULL, &s), TDP_EINVAL);
    assert_int_equal(tdp_server_new(loop, "no-such-host.invalid", 0, NULL, NULL, NULL, &s),
                     TDP_EADDR);
    /* a loop nobody runs: set up and torn down inline */
    tdp_server_opts_default(&o);
    assert_int_equal(o.max_clients, 1024);
    assert_int_equal(o.handshake_timeout_ms, 5000);
    assert_int_equal(tdp_server_new(loop, "127.0.0.1", 0, &o, &handler, NULL, &s), TDP_OK);
    assert_true(tdp_server_port(s) > 0);
    tdp_server_stats st;
    tdp_server_stats_get(s, &st);
    assert_int_equal(st.clients_now + st.clients_total + st.refused + st.msgs_recv, 0);
    assert_int_equal(tdp_server_shutdown(s, 100), TDP_OK);
    assert_int_equal(tdp_server_shutdown(s, 100), TDP_OK); /* twice is fine */
    tdp_server_free(s);
    /* on a loop thread, all addresses, freed without an explicit shutdown */
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_int_equal(tdp_server_new(loop, NULL, 0, NULL, NULL, NULL, &s), TDP_OK);
    tdp_loop *cl;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_pipe_connect(cl, "::1", tdp_server_port(s), NULL, &p), TDP_OK);
    assert_true(WAIT_FOR((tdp_server_stats_get(s, &st), st.clients_now == 1), TMO));
    tdp_server_free(s);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_ECLOSED); /* the server's clean end */
    tdp_pipe_free(p);
    tdp_loop_free(cl);
    tdp_loop_free(loop);
}

/* 16 clients at once, each its own schemas (changed halfway), every byte checked twice. */
static void test_many_clients(void **state)
{
    enum { N = 16, COUNT = 40 };
    env e;
    env_up(&e, MODE_ECHO, NULL);
    static const int64_t sizes[] = {24, 300, 4000, 20000, 100000, 300000};
    worker w[N];
    memset(w, 0, sizeof(w));
    for (int i = 0; i < N; i++) {
        w[i] = (worker){.cid = i + 1,
                        .port = e.port,
                        .count = COUNT,
                        .nbytes = sizes[i % 6],
                        .change = true,
                        .close = true};
        worker_start(&w[i]);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(w[i].th, NULL);
        assert_int_equal(w[i].rc, TDP_OK);
        assert_int_equal(w[i].bad, 0);
        assert_int_equal(atomic_load(&w[i].ok), COUNT);
    }
    assert_int_equal(atomic_load(&e.x->bad), 0);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.clients_total, N);
    assert_int_equal(st.msgs_recv, N * COUNT);
    assert_int_equal(st.msgs_sent, N * COUNT);
    assert_int_equal(st.schemas_recv, N * 2);
    assert_int_equal(st.client_errors + st.handler_errors + st.refused, 0);
    assert_true(st.bytes_recv > 0 && st.bytes_recv == st.bytes_sent);
    assert_int_equal(atomic_load(&e.x->close_clean), N);
    env_down(&e);
}

/* A receive ring on the server (depth 4): four requests in flight, each echoed. */
static void test_depth_echo(void **state)
{
    enum { BATCH = 4, ROUNDS = 50 };
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.pipe.recv_depth = BATCH;
    env_up(&e, MODE_ECHO, &o);
    tdp_pipe *p;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    tdp_schema *s = stream_schema(8, 0, 40000); /* rendezvous on most transports */
    tdp_td *td[BATCH], *got;
    for (int k = 0; k < BATCH; k++)
        assert_int_equal(tdp_td_new(s, &td[k]), TDP_OK);
    int64_t seq = 1;
    for (int r = 0; r < ROUNDS; r++) {
        /* the server grants four credits: four sends go without a reply */
        for (int k = 0; k < BATCH; k++) {
            td_fill(td[k], 8, seq + k);
            assert_int_equal(tdp_pipe_send(p, td[k], TMO), TDP_OK);
        }
        for (int k = 0; k < BATCH; k++) {
            int64_t cid, sq;
            assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
            assert_true(td_check(got, &cid, &sq));
            assert_int_equal(sq, seq + k); /* in order, every byte intact */
        }
        seq += BATCH;
    }
    assert_int_equal(tdp_pipe_close(p, TMO), TDP_OK);
    tdp_pipe_free(p);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.msgs_recv, BATCH * ROUNDS);
    assert_int_equal(st.msgs_sent, BATCH * ROUNDS);
    assert_int_equal(st.client_errors + st.handler_errors, 0);
    assert_int_equal(atomic_load(&e.x->bad), 0);
    for (int k = 0; k < BATCH; k++)
        tdp_td_unref(td[k]);
    tdp_schema_unref(s);
    env_down(&e);
}

/* Request -> reply in another schema; steady state allocates nothing on either side. */
static void test_request_reply(void **state)
{
    env e;
    env_up(&e, MODE_REQREP, NULL);
    tdp_pipe *p;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    const int64_t ns[] = {10, 5000, 33};
    uint64_t allocs0 = 0;
    for (int k = 0; k < 3; k++) {
        tdp_schema *rs = req_schema(ns[k]);
        tdp_td *req, *rep;
        assert_int_equal(tdp_td_new(rs, &req), TDP_OK);
        for (int64_t seq = 1; seq <= 300; seq++) {
            if (k == 1 && seq == 50)
                allocs0 = tdp_mem_total_allocs();
            tdp_leaf h, x;
            tdp_td_get(req, "hdr", &h);
            tdp_td_get(req, "x", &x);
            ((int64_t *)h.data)[0] = 9;
            ((int64_t *)h.data)[1] = seq + k * 1000;
            float *f = x.data;
            double want = 0;
            for (int64_t i = 0; i < ns[k]; i++) {
                f[i] = (float)((seq * 31 + i * 7) % 1000) * 0.125f;
                want += f[i];
            }
            assert_int_equal(tdp_pipe_send(p, req, TMO), TDP_OK);
            assert_int_equal(tdp_pipe_recv(p, TMO, &rep), TDP_OK);
            tdp_leaf sum, y, rh, kind;
            assert_int_equal(tdp_td_get(rep, "sum", &sum), TDP_OK);
            assert_int_equal(tdp_td_get(rep, "y", &y), TDP_OK);
            assert_int_equal(tdp_td_get(rep, "hdr", &rh), TDP_OK);
            assert_int_equal(tdp_td_get(rep, "kind", &kind), TDP_OK);
            assert_string_equal(kind.value_json, "\"reply\"");
            assert_int_equal(y.numel, ns[k]);
            assert_true(*(double *)sum.data == want);
            assert_int_equal(((int64_t *)rh.data)[1], seq + k * 1000);
            for (int64_t i = 0; i < ns[k]; i++)
                assert_true(((float *)y.data)[i] == 2.0f * f[i] + 1.0f);
            if (k == 1 && seq == 250) /* 200 round trips: nothing allocated anywhere */
                assert_int_equal(tdp_mem_total_allocs(), allocs0);
        }
        tdp_td_unref(req);
        tdp_schema_unref(rs);
    }
    tdp_pipe_stats ps;
    tdp_pipe_stats_get(p, &ps);
    assert_int_equal(ps.msgs_recv, 900);
    assert_int_equal(ps.schemas_recv, 3); /* one reply schema per request schema */
    assert_int_equal(tdp_pipe_close(p, TMO), TDP_OK);
    tdp_pipe_free(p);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.msgs_recv, 900);
    assert_int_equal(st.msgs_sent, 900);
    assert_int_equal(st.schemas_recv, 3);
    assert_int_equal(atomic_load(&e.x->close_clean), 1);
    env_down(&e);
}

/* The reply ring: max_replies_queued sends at once, then TDP_EAGAIN; all arrive. */
static void test_reply_ring(void **state)
{
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.max_replies_queued = 4;
    env_up(&e, MODE_RING, &o);
    tdp_schema *s = stream_schema(77, 0, 1 << 20); /* rendezvous: no send ends inline */
    assert_int_equal(tdp_td_new(s, &e.x->ring_td), TDP_OK);
    tdp_pipe *p;
    tdp_td *td, *got;
    /* the ucx plane: on the shm plane a send ends inline, so the ring never fills */
    tdp_pipe_opts po;
    tdp_pipe_opts_default(&po);
    po.plane = TDP_PLANE_UCX;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, &po, &p), TDP_OK);
    tdp_schema *rs = req_schema(4);
    assert_int_equal(tdp_td_new(rs, &td), TDP_OK);
    td_fill(td, 1, 1);
    assert_int_equal(tdp_pipe_send(p, td, TMO), TDP_OK);
    /* (the handler reuses one buffer for all its sends: contents not checked here) */
    for (int i = 0; i < 4; i++) {
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_int_equal(tdp_td_nbytes(got), tdp_td_nbytes(e.x->ring_td));
    }
    /* the replies can arrive before the handler's loop has counted them all */
    assert_true(WAIT_FOR(atomic_load(&e.x->ring_ok) + atomic_load(&e.x->ring_eagain) == 20, TMO));
    assert_int_equal(atomic_load(&e.x->ring_ok), 4);
    assert_int_equal(atomic_load(&e.x->ring_eagain), 16);
    assert_int_equal(tdp_pipe_recv(p, 200, &got), TDP_ETIMEDOUT); /* nothing more */
    assert_int_equal(tdp_pipe_close(p, TMO), TDP_OK);
    tdp_pipe_free(p);
    tdp_td_unref(td);
    tdp_schema_unref(rs);
    tdp_schema_unref(s);
    env_down(&e);
}

/* max_clients: the next one is refused with TDP_ELIMIT; a slot freed is reusable. */
static void test_max_clients(void **state)
{
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.max_clients = 2;
    env_up(&e, MODE_ECHO, &o);
    tdp_pipe *a, *b, *c;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &a), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e.cl[1], "127.0.0.1", e.port, NULL, &b), TDP_OK);
    /* their HELLOs may still be on their way when connect returns: the server
     * is full once it has taken both (before, a third is turned away only
     * when its own handshake completes) */
    assert_true(WAIT_FOR(stats(&e).clients_now == 2, TMO));
    int64_t t0 = mono_ms();
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &c), TDP_ELIMIT);
    assert_true(mono_ms() - t0 < 2000); /* told at once, not timed out */
    assert_int_equal(tdp_pipe_connect(e.cl[1], "127.0.0.1", e.port, NULL, &c), TDP_ELIMIT);
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.refused, 2);
    assert_int_equal(st.clients_now, 2);
    /* the two admitted ones work */
    tdp_schema *s = stream_schema(1, 0, 100);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    td_fill(td, 1, 1);
    assert_int_equal(tdp_pipe_send(b, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(b, TMO, &got), TDP_OK);
    assert_true(td_check(got, NULL, NULL));
    /* one leaves: its slot is free again */
    assert_int_equal(tdp_pipe_close(a, TMO), TDP_OK);
    tdp_pipe_free(a);
    assert_true(WAIT_FOR(stats(&e).clients_now == 1, TMO));
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &c), TDP_OK);
    assert_true(WAIT_FOR(stats(&e).clients_total == 3, TMO)); /* the server took it too */
    /* on_connect may turn a client away: its pipe ends with TDP_ELIMIT */
    tdp_pipe_free(b);
    assert_true(WAIT_FOR(stats(&e).clients_now == 1, TMO));
    atomic_store(&e.x->reject, 1);
    assert_int_equal(tdp_pipe_connect(e.cl[1], "127.0.0.1", e.port, NULL, &b), TDP_OK);
    assert_int_equal(tdp_pipe_recv(b, TMO, &got), TDP_ELIMIT);
    assert_int_equal(stats(&e).refused, 3);
    tdp_pipe_free(b);
    /* and it got its on_close with what on_connect said */
    assert_true(WAIT_FOR(atomic_load(&e.x->status[4]) != 1, TMO));
    assert_int_equal(atomic_load(&e.x->status[4]), TDP_EINVAL);
    assert_true(WAIT_FOR(stats(&e).clients_now == 1, TMO));
    assert_int_equal(stats(&e).clients_total, 3);
    tdp_pipe_free(c);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

/* A plain TCP socket to the server from 127.0.0.<from> (all of 127/8 is loopback). */
static int raw_connect_from(uint16_t port, int from)
{
    struct sockaddr_in sa = {
        .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(port)};
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000000u | from)};
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&me, sizeof(me)), 0);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    return fd;
}

static int raw_connect(uint16_t port)
{
    return raw_connect_from(port, 1);
}

/*
 * The first frame the server sends on fd (bounded wait): its type
 * (TDP_CTL_HELLO: a handshake began; TDP_CTL_BYE: refused), or -1. The
 * whole frame is copied to buf when it fits (*len: its size).
 */
static int raw_first_frame(int fd, uint8_t *buf, size_t cap, size_t *len)
{
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    uint8_t h[TDP_CTL_HDR_LEN];
    if (recv(fd, h, sizeof(h), MSG_WAITALL) != (ssize_t)sizeof(h))
        return -1;
    tdp_ctl_hdr hdr;
    if (tdp_wire_ctl_hdr_decode(h, &hdr) != TDP_OK)
        return -1;
    size_t n = TDP_CTL_HDR_LEN + (size_t)hdr.length;
    if (buf != NULL && n <= cap) {
        memcpy(buf, h, sizeof(h));
        if (recv(fd, buf + sizeof(h), hdr.length, MSG_WAITALL) != (ssize_t)hdr.length)
            return -1;
        *len = n;
    }
    return hdr.type;
}

/* Read until the server closes (bounded); returns ms waited. */
static int64_t raw_wait_closed(int fd)
{
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    int64_t t0 = mono_ms();
    char b[512];
    ssize_t n;
    while ((n = read(fd, b, sizeof(b))) > 0 && mono_ms() - t0 < 10000)
        ;
    assert_true(n == 0 || (n < 0 && errno == ECONNRESET));
    return mono_ms() - t0;
}

/*
 * What a connection costs the server before it says HELLO: no UCX worker
 * of its own (a pipe gets one only once both HELLOs pick the ucx plane for
 * a peer on this host), so silent sockets make none; a client on the shm
 * plane makes none on either side, one on the ucx plane one on each.
 * Until 2026-11-28 every accepted socket made one (4 MB of shared memory,
 * ~10 ms) when the server's HELLO was written.
 */
static void test_silent_sockets_make_no_worker(void **state)
{
    enum { N = 20 };
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    env_up(&e, MODE_ECHO, &o);
    tdp__ucx *ucx = tdp__ucx_peek(e.sl);
    bool local =
        ucx != NULL && ucx->nworkers > TDP_WORKER_LOCAL && ucx->worker[TDP_WORKER_LOCAL] != NULL;
    unsigned base = tdp__ucx_private_live();
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = raw_connect_from(e.port, 10 + i);
        assert_int_equal(raw_first_frame(fds[i], NULL, 0, NULL), TDP_CTL_HELLO);
    }
    print_message("%d silent sockets, each sent the server's HELLO: %u private workers "
                  "(%u before; same-host context: %d)\n",
                  N, tdp__ucx_private_live(), base, local);
    assert_int_equal(tdp__ucx_private_live(), base);
    for (int i = 0; i < N; i++)
        close(fds[i]);
    assert_true(WAIT_FOR(stats(&e).handshakes_failed == N, TMO));

    tdp_pipe *p;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    if (tdp_pipe_plane(p) == TDP_PLANE_SHM)
        assert_int_equal(tdp__ucx_private_live(), base);
    tdp_pipe_free(p);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    tdp_pipe_opts po;
    tdp_pipe_opts_default(&po);
    po.plane = TDP_PLANE_UCX;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, &po, &p), TDP_OK);
    assert_int_equal(tdp_pipe_plane(p), TDP_PLANE_UCX);
    unsigned want = base + (local ? 2 : 0);
    assert_true(WAIT_FOR(tdp__ucx_private_live() == want, TMO));
    if (local) /* the pipe's own worker is the one in use */
        assert_int_equal(tdp__ucx_link_worker(tdp__session_link(p)), TDP_WORKER_LOCAL);
    tdp_pipe_free(p);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    assert_true(WAIT_FOR(tdp__ucx_private_live() == base, TMO));
    env_down(&e);
}

/* TcpExt ListenOverflows of /proc/net/netstat: connections a full accept queue turned away. */
static long listen_overflows(void)
{
    FILE *f = fopen("/proc/net/netstat", "r");
    char names[4096], vals[4096];
    long v = -1;
    if (f == NULL)
        return -1;
    while (fgets(names, sizeof(names), f) != NULL && fgets(vals, sizeof(vals), f) != NULL) {
        if (strncmp(names, "TcpExt:", 7) != 0)
            continue;
        char *sn, *sv;
        char *n = strtok_r(names, " \n", &sn), *x = strtok_r(vals, " \n", &sv);
        while (n != NULL && x != NULL) {
            if (strcmp(n, "ListenOverflows") == 0)
                v = atol(x);
            n = strtok_r(NULL, " \n", &sn);
            x = strtok_r(NULL, " \n", &sv);
        }
    }
    fclose(f);
    return v;
}

static void block_task(void *arg)
{
    usleep((useconds_t)(*(int *)arg) * 1000);
}

static void *block_loop(void *arg)
{
    static int ms = 400;
    tdp__call_on_loop(arg, block_task, &ms);
    return NULL;
}

/*
 * A burst of connections while the server's loop is busy waits in the
 * kernel's accept queue, not in SYN retransmissions: 160 sockets opened
 * while the loop sleeps 400 ms are all taken, and none overflows the queue
 * (the listen backlog was 128, which libevent set again over ours, until
 * 2026-11-28: 32 of them then waited a second for a SYN retransmission).
 */
static void test_connect_burst(void **state)
{
    enum { N = 160 };
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    env_up(&e, MODE_ECHO, &o);
    long before = listen_overflows();
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, block_loop, e.sl), 0);
    usleep(50 * 1000); /* the loop is asleep now */
    int fds[N];
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                             .sin_port = htons(e.port)};
    for (int i = 0; i < N; i++) {
        struct sockaddr_in me = {.sin_family = AF_INET,
                                 .sin_addr.s_addr = htonl(0x7f000000u | (uint32_t)(10 + i % 8))};
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        assert_true(fds[i] >= 0);
        assert_int_equal(bind(fds[i], (struct sockaddr *)&me, sizeof(me)), 0);
        int r = connect(fds[i], (struct sockaddr *)&sa, sizeof(sa));
        assert_true(r == 0 || errno == EINPROGRESS);
    }
    pthread_join(th, NULL);
    for (int i = 0; i < N; i++) {
        int fl = fcntl(fds[i], F_GETFL);
        fcntl(fds[i], F_SETFL, fl & ~O_NONBLOCK);
        assert_int_equal(raw_first_frame(fds[i], NULL, 0, NULL), TDP_CTL_HELLO);
    }
    long after = listen_overflows();
    print_message("%d connections during a 400 ms stall: all answered, %ld accept-queue "
                  "overflows\n",
                  N, before >= 0 && after >= 0 ? after - before : -1);
    if (before >= 0 && after >= 0)
        assert_int_equal(after - before, 0);
    for (int i = 0; i < N; i++)
        close(fds[i]);
    env_down(&e);
}

/*
 * A socket that says nothing is dropped at the handshake deadline, and
 * meanwhile takes no client's place.
 */
static void test_handshake_timeout(void **state)
{
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.max_clients = 1;
    o.handshake_timeout_ms = 200;
    env_up(&e, MODE_ECHO, &o);
    int fd = raw_connect(e.port);
    /* wait for the server to take it (its HELLO arrives) */
    char hb[16];
    struct timeval tv = {5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    assert_int_equal(read(fd, hb, sizeof(hb)), (ssize_t)sizeof(hb));
    assert_memory_equal(hb, "TDPC", 4);
    int64_t t0 = mono_ms();
    /* the only client slot is free all the same: a real client gets in */
    tdp_pipe *p;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    /* (its HELLO may still be on its way when connect returns: let it land) */
    assert_true(WAIT_FOR(stats(&e).clients_total == 1, TMO));
    raw_wait_closed(fd);
    int64_t dt = mono_ms() - t0;
    close(fd);
    print_message("silent socket dropped after about %" PRId64 " ms\n", dt);
    assert_true(dt < 5000);
    assert_true(WAIT_FOR(stats(&e).handshakes_failed == 1, TMO));
    /* the server is full now: the next one is refused */
    tdp_pipe *q;
    assert_int_equal(tdp_pipe_connect(e.cl[1], "127.0.0.1", e.port, NULL, &q), TDP_ELIMIT);
    tdp_pipe_free(p);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    /* junk on the control socket: dropped at once, counted */
    fd = raw_connect(e.port);
    char junk[64];
    memset(junk, 'J', sizeof(junk));
    assert_int_equal(write(fd, junk, sizeof(junk)), (ssize_t)sizeof(junk));
    assert_true(raw_wait_closed(fd) < 1000);
    close(fd);
    assert_true(WAIT_FOR(stats(&e).handshakes_failed == 2, TMO));
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.handshakes_failed, 2);
    assert_int_equal(st.refused, 1);
    assert_int_equal(st.clients_total, 1);
    env_down(&e);
}

/* One message out and back on p. */
static void echo_once(tdp_pipe *p, int64_t cid)
{
    tdp_schema *s = stream_schema(1, 0, 100);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    td_fill(td, cid, 1);
    assert_int_equal(tdp_pipe_send(p, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    assert_true(td_check(got, NULL, NULL));
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

/* n echoes of client cid's own schema with a payload of nbytes; the last status. */
static tdp_err echo_n(tdp_pipe *p, int cid, int64_t nbytes, int n)
{
    tdp_schema *s = stream_schema(cid, 0, nbytes);
    tdp_td *td, *got;
    tdp_err rc = tdp_td_new(s, &td);
    for (int i = 1; rc == TDP_OK && i <= n; i++) {
        td_fill(td, cid, i);
        if ((rc = tdp_pipe_send(p, td, TMO)) != TDP_OK)
            break;
        if ((rc = tdp_pipe_recv(p, TMO, &got)) != TDP_OK)
            break;
        int64_t gc, gs;
        if (!td_check(got, &gc, &gs) || gc != cid || gs != i)
            rc = TDP_EINTERNAL;
    }
    tdp_td_unref(td);
    tdp_schema_unref(s);
    return rc;
}

static uint64_t held_by(int cid, int64_t nbytes, uint32_t depth)
{
    tdp_schema *s = stream_schema(cid, 0, nbytes);
    uint64_t n = depth * tdp_schema_total_bytes(s);
    tdp_schema_unref(s);
    return n;
}

/*
 * max_memory caps the receive storage of all clients together: two
 * clients whose layouts fit stream on while a third, whose layout would go
 * over, is refused with TDP_ELIMIT (and told so); when one leaves, its
 * storage returns to the budget and a new client fits.
 */
static void test_memory_cap(void **state)
{
    enum { NB = 1 << 20, DEPTH = 2 };
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.pipe.recv_depth = DEPTH;
    o.max_memory = 5u << 20; /* two clients of 2 x ~1 MiB, not three */
    env_up(&e, MODE_ECHO, &o);
    assert_int_equal(stats(&e).memory_cap, 5u << 20);
    assert_int_equal(stats(&e).memory_used, 0);
    /* a loop per client connected at once (see one_loop_per_client) */
    tdp_loop *lp[2];
    for (int i = 0; i < 2; i++) {
        assert_int_equal(tdp_loop_new(NULL, &lp[i]), TDP_OK);
        assert_int_equal(tdp_loop_start_thread(lp[i]), TDP_OK);
    }
    tdp_pipe *a, *b, *c, *d;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &a), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e.cl[1], "127.0.0.1", e.port, NULL, &b), TDP_OK);
    assert_int_equal(echo_n(a, 1, NB, 3), TDP_OK);
    assert_int_equal(echo_n(b, 2, NB, 3), TDP_OK);
    uint64_t ha = held_by(1, NB, DEPTH), hb = held_by(2, NB, DEPTH);
    assert_int_equal(stats(&e).memory_used, ha + hb);

    /* the third would go over: refused, and told why */
    assert_int_equal(tdp_pipe_connect(lp[0], "127.0.0.1", e.port, NULL, &c), TDP_OK);
    tdp_err rc = echo_n(c, 3, NB, 1);
    assert_int_equal(rc, TDP_ELIMIT);
    assert_true(WAIT_FOR(tdp_pipe_status(c) == TDP_ELIMIT, TMO));
    assert_int_equal(stats(&e).memory_refused, 1);
    assert_int_equal(stats(&e).memory_used, ha + hb);
    int elimit = 0;
    assert_true(WAIT_FOR(atomic_load(&e.x->closes) == 1, TMO));
    for (int i = 0; i < MAX_IDS; i++)
        elimit += atomic_load(&e.x->status[i]) == TDP_ELIMIT;
    assert_int_equal(elimit, 1); /* on_close heard it too */
    tdp_pipe_free(c);

    /* the others keep streaming */
    assert_int_equal(echo_n(a, 1, NB, 3), TDP_OK);
    assert_int_equal(echo_n(b, 2, NB, 3), TDP_OK);

    /* one leaves: its storage is back, and a new client fits */
    assert_int_equal(tdp_pipe_close(a, TMO), TDP_OK);
    tdp_pipe_free(a);
    assert_true(WAIT_FOR(stats(&e).memory_used == hb, TMO));
    assert_int_equal(tdp_pipe_connect(lp[1], "127.0.0.1", e.port, NULL, &d), TDP_OK);
    assert_int_equal(echo_n(d, 4, NB, 3), TDP_OK);
    assert_int_equal(stats(&e).memory_used, hb + held_by(4, NB, DEPTH));
    assert_int_equal(echo_n(b, 2, NB, 1), TDP_OK);
    assert_int_equal(stats(&e).memory_refused, 1);

    tdp_pipe_close(b, TMO);
    tdp_pipe_close(d, TMO);
    tdp_pipe_free(b);
    tdp_pipe_free(d);
    assert_true(WAIT_FOR(stats(&e).memory_used == 0, TMO));
    env_down(&e);
    for (int i = 0; i < 2; i++)
        tdp_loop_free(lp[i]);
}

#define NSTRANGERS 40

/*
 * Strangers that open sockets and say nothing: they hold neither client
 * slots nor, beyond max_per_source, handshake slots; past max_pending the
 * oldest goes. Good clients get in and work all along.
 */
static void test_strangers(void **state)
{
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.max_clients = 2;
    o.max_pending = 8;
    o.max_per_source = 3;
    o.handshake_timeout_ms = 20000; /* strangers stay until evicted */
    env_up(&e, MODE_ECHO, &o);

    /* per source: three handshakes from 127.0.0.1, the fourth is refused */
    int mine[3];
    for (int i = 0; i < 3; i++) {
        mine[i] = raw_connect_from(e.port, 1);
        assert_int_equal(raw_first_frame(mine[i], NULL, 0, NULL), TDP_CTL_HELLO);
    }
    assert_true(WAIT_FOR(stats(&e).pending_now == 3, TMO));
    int fd = raw_connect_from(e.port, 1);
    assert_int_equal(raw_first_frame(fd, NULL, 0, NULL), TDP_CTL_BYE);
    close(fd);
    tdp_pipe *a, *b, *c;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &a), TDP_ELIMIT);
    /* another source still gets in */
    fd = raw_connect_from(e.port, 2);
    assert_int_equal(raw_first_frame(fd, NULL, 0, NULL), TDP_CTL_HELLO);
    close(fd);
    assert_int_equal(stats(&e).refused, 2);

    /* more strangers than handshake and client slots, from other sources:
     * each evicts the oldest handshake (127.0.0.1's three first) */
    int many[NSTRANGERS];
    for (int i = 0; i < NSTRANGERS; i++) {
        many[i] = raw_connect_from(e.port, 2 + i % 3);
        assert_int_equal(raw_first_frame(many[i], NULL, 0, NULL), TDP_CTL_HELLO);
    }
    for (int i = 0; i < 3; i++) {
        raw_wait_closed(mine[i]);
        close(mine[i]);
    }
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.pending_now, 8);
    assert_int_equal(st.clients_now, 0);
    assert_int_equal(st.refused, 2);

    /* good clients get in and work while the strangers keep up their sockets */
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &a), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e.cl[1], "127.0.0.1", e.port, NULL, &b), TDP_OK);
    echo_once(a, 1);
    echo_once(b, 2);
    assert_true(WAIT_FOR(stats(&e).clients_now == 2, TMO));
    /* max_clients is for clients: the third is refused */
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &c), TDP_ELIMIT);
    st = stats(&e);
    print_message("strangers: %" PRIu64 " handshakes dropped, %" PRIu64 " refused\n",
                  st.handshakes_failed, st.refused);
    assert_true(st.pending_now <= 8);
    assert_int_equal(st.refused, 3);
    /* every stranger but the newest eight lost its place */
    assert_true(st.handshakes_failed >= 3 + NSTRANGERS + 1 - 8);
    for (int i = 0; i < NSTRANGERS; i++)
        close(many[i]);
    assert_true(WAIT_FOR(stats(&e).pending_now == 0, TMO));
    tdp_pipe_free(a);
    tdp_pipe_free(b);
    env_down(&e);
}

/*
 * A client that neither sends nor receives is closed after idle_timeout_ms;
 * one that talks is not. A stranger that sends the server's own HELLO back
 * does not keep a client slot either.
 */
static void test_idle_timeout(void **state)
{
    env e;
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.max_clients = 1;
    o.idle_timeout_ms = 300;
    /* on the ucx plane a mirror would complete its handshake (the server's
     * endpoint reaches its own worker) if its HELLO were not recognised */
    o.pipe.plane = TDP_PLANE_UCX;
    o.pipe.linger_ms = 1000; /* how long a mirror has to hang up once closed */
    env_up(&e, MODE_ECHO, &o);

    /* silent: closed after 300 to 375 ms (plus scheduling) */
    tdp_pipe *p;
    tdp_td *got;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    int64_t t0 = mono_ms();
    tdp_err rc = tdp_pipe_recv(p, 5000, &got);
    int64_t dt = mono_ms() - t0;
    print_message("idle client closed after %" PRId64 " ms (%s)\n", dt, tdp_strerror(rc));
    assert_true(rc == TDP_ECONNRESET || rc == TDP_ECLOSED);
    assert_true(dt >= 250 && dt < 3000);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    assert_int_equal(stats(&e).idle_closed, 1);
    assert_int_equal(atomic_load(&e.x->status[1]), TDP_ETIMEDOUT);
    tdp_pipe_free(p);

    /* talking every 100 ms for a second: stays */
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    for (int i = 0; i < 10; i++) {
        echo_once(p, 1);
        sleep_ms(100);
    }
    assert_int_equal(stats(&e).idle_closed, 1);
    assert_int_equal(tdp_pipe_close(p, TMO), TDP_OK);
    tdp_pipe_free(p);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));

    /* a mirror: the server's HELLO, sent back as ours — its own nonce gives
     * it away and the handshake fails at once */
    static uint8_t hello[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN];
    size_t n = 0;
    int fd = raw_connect_from(e.port, 2);
    assert_int_equal(raw_first_frame(fd, hello, sizeof(hello), &n), TDP_CTL_HELLO);
    assert_int_equal(write(fd, hello, n), (ssize_t)n);
    t0 = mono_ms();
    raw_wait_closed(fd);
    dt = mono_ms() - t0;
    close(fd);
    tdp_server_stats st = stats(&e);
    print_message("mirror dropped after %" PRId64 " ms (%" PRIu64 " idle closes, %" PRIu64
                  " failed handshakes)\n",
                  dt, st.idle_closed, st.handshakes_failed);
    assert_true(dt < 1000);
    assert_int_equal(st.idle_closed, 1);
    assert_int_equal(st.handshakes_failed, 1);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    /* its slot is free: a real client gets in and works */
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    echo_once(p, 1);
    tdp_pipe_free(p);
    env_down(&e);
}

/* ---- hostile clients --------------------------------------------------------------- */

/* Send one raw active message from a client pipe to its server side. */
static void rogue_send(tdp_pipe *cli, const tdp_am_hdr *h, const void *payload, size_t len,
                       bool corrupt_magic)
{
    rogue_am_send(tdp__session_loop(cli), cli, h, payload, len, corrupt_magic, TMO);
}

/* Garbage and a hostile schema end their own clients; a streaming one carries on. */
static void test_hostile_clients(void **state)
{
    env e;
    env_up(&e, MODE_ECHO, NULL);
    /* streams until told to stop (however fast the plane is) */
    worker good = {.cid = 5, .port = e.port, .count = 10000000, .nbytes = 50000, .close = true};
    worker_start(&good);
    assert_true(WAIT_FOR(atomic_load(&good.ok) >= 20, TMO));

    const char *hostile = "{\"device\":\"cpu\",\"format\":\"tdpipe.schema\",\"td\":{\"cls\":"
                          "\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},\"leaves\":{\"x\":"
                          "[\"torch.float32\",[4294967296,4294967296,2],0,0,0]}},"
                          "\"total_bytes\":64,\"version\":1}";
    tdp_pipe *bad[3];
    tdp_td *got;
    tdp_pipe_opts po; /* hostile frames made by hand on the ucx plane (the shm plane's: test_pipe) */
    tdp_pipe_opts_default(&po);
    po.plane = TDP_PLANE_UCX;
    for (int k = 0; k < 3; k++) {
        assert_int_equal(tdp_pipe_connect(e.cl[1], "127.0.0.1", e.port, &po, &bad[k]), TDP_OK);
        /* once the server has taken it (else it is a failed handshake instead) */
        assert_true(WAIT_FOR(stats(&e).clients_total == (uint64_t)k + 2, TMO));
        tdp_am_hdr h = {.token = tdp__ucx_link_peer_token(tdp__session_link(bad[k])), .seq = 1};
        if (k == 0) { /* garbage header */
            h.type = TDP_AM_DATA;
            rogue_send(bad[k], &h, "junk", 4, true);
        } else if (k == 1) { /* hostile schema */
            h.type = TDP_AM_SCHEMA;
            h.length = strlen(hostile);
            h.arg = 64;
            rogue_send(bad[k], &h, hostile, strlen(hostile), false);
        } else { /* data with no schema */
            h.type = TDP_AM_DATA;
            h.hash = 42;
            h.length = 16;
            rogue_send(bad[k], &h, "0123456789abcdef", 16, false);
        }
        /* the server tells it why and hangs up on it */
        tdp_err rc = tdp_pipe_recv(bad[k], TMO, &got);
        assert_true(rc == TDP_ECONNRESET || rc == TDP_ECLOSED);
        tdp_pipe_free(bad[k]);
    }
    /* it streamed all along, and still does */
    int before = atomic_load(&good.ok);
    assert_true(WAIT_FOR(atomic_load(&good.ok) >= before + 20, TMO));
    atomic_store(&good.stop, true);
    pthread_join(good.th, NULL);
    assert_int_equal(good.rc, TDP_OK);
    assert_int_equal(good.bad, 0);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.client_errors, 3);
    assert_int_equal(st.handler_errors, 0);
    /* on_close said why for each */
    int eproto = 0, eschema = 0, emismatch = 0;
    for (int id = 1; id < 8; id++) {
        int s = atomic_load(&e.x->status[id]);
        eproto += s == TDP_EPROTO;
        eschema += s == TDP_ESCHEMA;
        emismatch += s == TDP_EMISMATCH;
    }
    assert_int_equal(eproto, 1);
    assert_int_equal(eschema, 1);
    assert_int_equal(emismatch, 1);
    env_down(&e);
}

/* A handler error closes its client only, and on_close hears it. */
static void test_handler_error(void **state)
{
    env e;
    env_up(&e, MODE_ECHO, NULL);
    e.x->fail_cid = 2;
    e.x->fail_seq = 5;
    worker w[2] = {
        {.cid = 1, .port = e.port, .count = 200, .nbytes = 1000, .close = true},
        {.cid = 2, .port = e.port, .count = 200, .nbytes = 1000, .close = true},
    };
    worker_start(&w[0]);
    worker_start(&w[1]);
    pthread_join(w[0].th, NULL);
    pthread_join(w[1].th, NULL);
    assert_int_equal(w[0].rc, TDP_OK);
    assert_int_equal(atomic_load(&w[0].ok), 200);
    assert_int_equal(w[1].rc, TDP_ECONNRESET); /* its pipe ended: the server gave up on it */
    assert_int_equal(atomic_load(&w[1].ok), 4);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.handler_errors, 1);
    assert_int_equal(st.client_errors, 0);
    int einval = 0, clean = 0;
    for (int id = 1; id <= 2; id++) {
        einval += atomic_load(&e.x->status[id]) == TDP_EINVAL;
        clean += atomic_load(&e.x->status[id]) == TDP_ECLOSED;
    }
    assert_int_equal(einval, 1);
    assert_int_equal(clean, 1);
    env_down(&e);
}

/* 200 connect / request / reply / close cycles: no fd or memory growth. */
static void one_cycle(env *e, tdp_td *td, int64_t seq)
{
    tdp_pipe *p;
    tdp_td *got;
    assert_int_equal(tdp_pipe_connect(e->cl[0], "127.0.0.1", e->port, NULL, &p), TDP_OK);
    td_fill(td, 3, seq);
    assert_int_equal(tdp_pipe_send(p, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    int64_t cid, sq;
    assert_true(td_check(got, &cid, &sq));
    assert_int_equal(sq, seq);
    assert_int_equal(tdp_pipe_close(p, TMO), TDP_OK);
    tdp_pipe_free(p);
}

static void test_connect_cycles(void **state)
{
    enum { CYCLES = 200 };
    env e;
    env_up(&e, MODE_ECHO, NULL);
    tdp_schema *s = stream_schema(3, 0, 2000);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (int i = 0; i < 5; i++) /* warm up: UCX sets up what it keeps */
        one_cycle(&e, td, i + 1);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    int fd0 = count_fds();
    tdp_mem_stats m0, m1;
    tdp_mem_stats_get(&m0);
    int64_t t0 = mono_ms();
    for (int i = 0; i < CYCLES; i++)
        one_cycle(&e, td, i + 100);
    int64_t dt = mono_ms() - t0;
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    /*
     * The last peers' endpoints may take a moment to go. No growth, not
     * equality: the baseline can still count warm-up pipes whose memory
     * goes on a later loop turn (deferred destruction), so the end may be
     * lower than the start.
     */
    bool same =
        WAIT_FOR((tdp_mem_stats_get(&m1),
                  count_fds() <= fd0 &&
                      m1.small_allocs - m1.small_frees <= m0.small_allocs - m0.small_frees &&
                      m1.live_bytes[TDP_MEM_HOST] <= m0.live_bytes[TDP_MEM_HOST]),
                 5000);
    print_message("%d cycles in %" PRId64 " ms; fds %d -> %d; small live %" PRIu64 " -> %" PRIu64
                  "; host bytes %" PRIu64 " -> %" PRIu64 "\n",
                  CYCLES, dt, fd0, count_fds(), m0.small_allocs - m0.small_frees,
                  m1.small_allocs - m1.small_frees, m0.live_bytes[TDP_MEM_HOST],
                  m1.live_bytes[TDP_MEM_HOST]);
    assert_true(same);
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.clients_total, CYCLES + 5);
    assert_int_equal(st.msgs_recv, CYCLES + 5);
    assert_int_equal(st.client_errors + st.handler_errors + st.refused, 0);
    assert_int_equal(atomic_load(&e.x->close_clean), CYCLES + 5);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

/* ---- a client process killed mid-stream ------------------------------------------ */

static void child_main(uint16_t port)
{
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_td *got;
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, NULL, &p) != TDP_OK)
        _exit(3);
    tdp_schema_builder *b;
    tdp_schema *s;
    tdp_td *td;
    const int64_t two = 2, n = 1 << 20;
    tdp_schema_builder_new(&b);
    tdp_schema_builder_tensor(b, "hdr", TDP_INT64, 1, &two);
    tdp_schema_builder_tensor(b, "big", TDP_UINT8, 1, &n);
    if (tdp_schema_builder_finish(b, &s, NULL, 0) != TDP_OK || tdp_td_new(s, &td) != TDP_OK)
        _exit(4);
    for (int64_t seq = 1; seq < 1000000; seq++) {
        td_fill(td, 99, seq);
        if (tdp_pipe_send(p, td, TMO) != TDP_OK || tdp_pipe_recv(p, TMO, &got) != TDP_OK)
            _exit(5);
    }
    _exit(0);
}

static void test_kill_client(void **state)
{
    env e;
    env_up(&e, MODE_ECHO, NULL);
    fflush(NULL);
    /* a fresh process (fork + exec): UCX's state does not survive a bare fork */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char ps[16];
        snprintf(ps, sizeof(ps), "%u", e.port);
        execl("/proc/self/exe", "test_server", "--child", ps, (char *)NULL);
        _exit(127);
    }
    assert_true(WAIT_FOR(stats(&e).msgs_recv >= 10, TMO));
    worker good = {.cid = 6, .port = e.port, .count = 300, .nbytes = 70000, .close = true};
    worker_start(&good);
    assert_true(WAIT_FOR(atomic_load(&good.ok) >= 20, TMO));
    int at_kill = atomic_load(&good.ok);
    kill(pid, SIGKILL);
    int st_;
    waitpid(pid, &st_, 0);
    int64_t t0 = mono_ms();
    assert_true(WAIT_FOR(stats(&e).client_errors == 1, TMO));
    print_message("killed client seen after %" PRId64 " ms\n", mono_ms() - t0);
    pthread_join(good.th, NULL);
    assert_int_equal(good.rc, TDP_OK);
    assert_int_equal(good.bad, 0);
    assert_int_equal(atomic_load(&good.ok), 300);
    assert_true(at_kill < 300);
    assert_true(WAIT_FOR(stats(&e).clients_now == 0, TMO));
    assert_int_equal(atomic_load(&e.x->status[1]), TDP_ECONNRESET);
    assert_int_equal(atomic_load(&e.x->bad), 0);
    env_down(&e);
}

/* ---- graceful shutdown ------------------------------------------------------------ */

static void test_shutdown(void **state)
{
    enum { N = 6 };
    env e;
    env_up(&e, MODE_ECHO, NULL);
    worker w[N];
    memset(w, 0, sizeof(w));
    for (int i = 0; i < N; i++) {
        w[i] = (worker){.cid = 20 + i, .port = e.port, .count = 0, .nbytes = i % 2 ? 200000 : 500};
        worker_start(&w[i]);
    }
    for (int i = 0; i < N; i++)
        assert_true(WAIT_FOR(atomic_load(&w[i].ok) >= 20, TMO));
    int64_t t0 = mono_ms();
    assert_int_equal(tdp_server_shutdown(e.s, 10000), TDP_OK);
    print_message("shutdown with %d busy clients took %" PRId64 " ms\n", N, mono_ms() - t0);
    for (int i = 0; i < N; i++) {
        pthread_join(w[i].th, NULL);
        assert_int_equal(w[i].rc, TDP_OK);
        assert_int_equal(w[i].end, TDP_ECLOSED); /* a clean end, mid-conversation */
        assert_int_equal(w[i].bad, 0);
    }
    tdp_server_stats st = stats(&e);
    assert_int_equal(st.clients_now, 0);
    assert_int_equal(st.client_errors + st.handler_errors, 0);
    assert_int_equal(atomic_load(&e.x->close_clean), N);
    /* nothing listens any more */
    tdp_pipe *p;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_ECONNREFUSED);
    env_down(&e); /* a second shutdown returns the first one's result */
}

/* ---- the plain listener: the same limits, and its hooks ---------------------- */

/*
 * A plain listener (tdp_listener_new, default limits) has the server's
 * protection: 290 silent sockets from eight sources (more than
 * max_pending, 256; more than max_per_source, 32, from each) do not keep a
 * good client out. It gets in within a bound far below their handshake
 * deadline (10 s): its handshake takes the oldest stranger's place.
 */
#define NIDLE 290
static void test_listener_strangers(void **state)
{
    tdp_loop *sl, *cl;
    tdp_listener *l;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_OK);
    uint16_t port = tdp_listener_port(l);

    static int fds[NIDLE];
    int hello = 0, bye = 0;
    for (int i = 0; i < NIDLE; i++) {
        fds[i] = raw_connect_from(port, 2 + i % 8); /* 127.0.0.2 .. 127.0.0.9 */
        int t = raw_first_frame(fds[i], NULL, 0, NULL);
        hello += t == TDP_CTL_HELLO;
        bye += t == TDP_CTL_BYE;
    }
    print_message("listener: %d strangers got a HELLO, %d a BYE\n", hello, bye);
    assert_int_equal(hello + bye, NIDLE);
    assert_true(bye >= NIDLE - 8 * 32); /* past 32 from each source: refused at once */
    assert_true(hello <= 256 + 8);

    int64_t t0 = mono_ms();
    tdp_pipe *p, *sp;
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", port, NULL, &p), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, 5000, &sp), TDP_OK);
    int64_t dt = mono_ms() - t0;
    print_message("listener: a good client got in after %lld ms\n", (long long)dt);
    assert_true(dt < 3000);
    tdp_schema *s = stream_schema(1, 0, 100);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    td_fill(td, 1, 1);
    assert_int_equal(tdp_pipe_send(p, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(sp, TMO, &got), TDP_OK);
    assert_true(td_check(got, NULL, NULL));
    tdp_td_unref(td);
    tdp_schema_unref(s);

    for (int i = 0; i < NIDLE; i++)
        close(fds[i]);
    tdp_pipe_free(p);
    tdp_pipe_free(sp);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

typedef struct hook_ctx {
    _Atomic int refuse_admit, refuse_hello;
    _Atomic int admits, hellos;
    _Atomic uint32_t want, peer_depth;
} hook_ctx;

static tdp_err hk_admit(const tdp_accept_info *info, void *arg)
{
    hook_ctx *h = arg;
    atomic_fetch_add(&h->admits, 1);
    return info->peer != NULL && atomic_load(&h->refuse_admit) ? TDP_ELIMIT : TDP_OK;
}

/* Follow the peer's wish, when it has one. */
static tdp_err hk_hello(const tdp_accept_info *info, tdp_pipe_opts *o, void *arg)
{
    hook_ctx *h = arg;
    atomic_fetch_add(&h->hellos, 1);
    atomic_store(&h->want, info->want_depth);
    atomic_store(&h->peer_depth, info->peer_depth);
    if (atomic_load(&h->refuse_hello))
        return TDP_ELIMIT;
    if (info->want_depth != 0)
        o->recv_depth = info->want_depth;
    return TDP_OK;
}

/* One connect to l; the accepted pipe's depth and the dialer's view of it. */
static tdp_err hook_connect(tdp_loop *cl, tdp_listener *l, const tdp_pipe_opts *po,
                            uint32_t *srv_depth, uint32_t *cli_peer_depth)
{
    tdp_pipe *p, *sp;
    tdp_err rc = tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), po, &p);
    if (rc != TDP_OK)
        return rc;
    assert_int_equal(tdp_listener_accept(l, TMO, &sp), TDP_OK);
    tdp_pipe_stats a, b;
    tdp_pipe_stats_get(sp, &a);
    tdp_pipe_stats_get(p, &b);
    *srv_depth = a.recv_depth;
    *cli_peer_depth = b.peer_depth;
    assert_int_equal(a.peer_depth, b.recv_depth);
    /* the chosen depth is the real one: that many sends go without a release */
    tdp_schema *s = stream_schema(1, 0, 100);
    tdp_td *td, *got[TDP_MAX_DEPTH];
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    td_fill(td, 1, 1);
    for (uint32_t i = 0; i < a.recv_depth; i++)
        assert_int_equal(tdp_pipe_send(p, td, TMO), TDP_OK);
    if (a.recv_depth > 1) {
        for (uint32_t i = 0; i < a.recv_depth; i++)
            assert_int_equal(tdp_pipe_recv(sp, TMO, &got[i]), TDP_OK);
        for (uint32_t i = 0; i < a.recv_depth; i++)
            tdp_pipe_release(sp, got[i]);
    }
    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_pipe_free(p);
    tdp_pipe_free(sp);
    return TDP_OK;
}

/*
 * tdp_listener_opts' hooks: on_hello sets the accepted pipe's receive
 * depth from the dialer's want_peer_depth (WANT_DEPTH in its HELLO); with a
 * shared secret it runs only after the dialer's proof, and the depth stays
 * the listener's; admit and on_hello turn a peer away with TDP_ELIMIT,
 * which is what its connect returns.
 */
static void test_listener_hooks(void **state)
{
    static const char secret[] = "sixteen-bytes-at-least!";
    tdp_loop *sl, *cl;
    tdp_listener *l;
    hook_ctx h = {0};
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);

    for (int sec = 0; sec < 2; sec++) {
        tdp_listener_opts lo;
        tdp_listener_opts_default(&lo);
        lo.pipe.recv_depth = 2;
        lo.admit = hk_admit;
        lo.on_hello = hk_hello;
        lo.hook_arg = &h;
        tdp_pipe_opts po;
        tdp_pipe_opts_default(&po);
        po.recv_depth = 3;
        if (sec) {
            lo.pipe.secret = po.secret = secret;
            lo.pipe.secret_len = po.secret_len = sizeof(secret) - 1;
        }
        assert_int_equal(tdp_listener_new_opts(sl, "127.0.0.1", 0, &lo, NULL, NULL, &l), TDP_OK);
        uint32_t sd = 0, cd = 0;
        /* no wish: the listener's depth */
        assert_int_equal(hook_connect(cl, l, &po, &sd, &cd), TDP_OK);
        assert_int_equal(sd, 2);
        assert_int_equal(cd, 2);
        assert_int_equal(atomic_load(&h.want), 0);
        assert_int_equal(atomic_load(&h.peer_depth), 3);
        /* a wish the hook follows */
        po.want_peer_depth = 8;
        assert_int_equal(hook_connect(cl, l, &po, &sd, &cd), TDP_OK);
        assert_int_equal(atomic_load(&h.want), 8);
        /* with a secret the hook runs after the proof, which covers the
         * listener's HELLO: the depth in it stays the listener's */
        assert_int_equal(sd, sec ? 2 : 8);
        assert_int_equal(cd, sec ? 2 : 8);
        /* turned away after the HELLO, and before any */
        atomic_store(&h.refuse_hello, 1);
        assert_int_equal(hook_connect(cl, l, &po, &sd, &cd), TDP_ELIMIT);
        atomic_store(&h.refuse_hello, 0);
        atomic_store(&h.refuse_admit, 1);
        int hellos = atomic_load(&h.hellos);
        assert_int_equal(hook_connect(cl, l, &po, &sd, &cd), TDP_ELIMIT);
        assert_int_equal(atomic_load(&h.hellos), hellos); /* no handshake began */
        atomic_store(&h.refuse_admit, 0);
        if (sec) { /* a wrong secret never reaches application code */
            static const char wrong[] = "sixteen-bytes-at-least?";
            tdp_pipe_opts bad = po;
            bad.secret = wrong;
            hellos = atomic_load(&h.hellos);
            assert_int_equal(hook_connect(cl, l, &bad, &sd, &cd), TDP_EAUTH);
            assert_int_equal(atomic_load(&h.hellos), hellos);
        }
        tdp_listener_free(l);
    }
    assert_int_equal(atomic_load(&h.admits), 9);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/*
 * The stats structs can grow: a caller that knows fewer fields (a smaller
 * size) gets only that many bytes written; one that knows more gets zeros
 * past what the library has.
 */
static void test_stats_sized(void **state)
{
    env e;
    env_up(&e, MODE_ECHO, NULL);
    tdp_pipe *p;
    assert_int_equal(tdp_pipe_connect(e.cl[0], "127.0.0.1", e.port, NULL, &p), TDP_OK);
    echo_once(p, 1);
    assert_true(WAIT_FOR(stats(&e).msgs_recv == 1, TMO));

    union {
        tdp_server_stats st;
        unsigned char b[sizeof(tdp_server_stats) + 16];
    } u;
    tdp_server_stats full = stats(&e);
    const size_t small = offsetof(tdp_server_stats, refused); /* clients_now, clients_total */
    memset(&u, 0xab, sizeof(u));
    tdp_server_stats_get_sized(e.s, &u.st, small);
    assert_memory_equal(u.b, &full, small);
    for (size_t i = small; i < sizeof(u); i++)
        assert_int_equal(u.b[i], 0xab);
    /* a newer caller's larger struct: the part this library lacks is zeroed */
    memset(&u, 0xab, sizeof(u));
    tdp_server_stats_get_sized(e.s, &u.st, sizeof(u));
    assert_int_equal(u.st.msgs_recv, 1);
    for (size_t i = sizeof(tdp_server_stats); i < sizeof(u); i++)
        assert_int_equal(u.b[i], 0);
    /* the exported function of the old name writes the first version only */
    memset(&u, 0xab, sizeof(u));
    (tdp_server_stats_get)(e.s, &u.st);
    assert_int_equal(u.st.msgs_recv, 1);
    const size_t v1 = offsetof(tdp_server_stats, idle_closed) + sizeof(uint64_t);
    for (size_t i = v1; i < sizeof(u); i++)
        assert_int_equal(u.b[i], 0xab);

    union {
        tdp_pipe_stats st;
        unsigned char b[sizeof(tdp_pipe_stats) + 16];
    } v;
    const size_t psmall = offsetof(tdp_pipe_stats, bytes_sent);
    memset(&v, 0xab, sizeof(v));
    tdp_pipe_stats_get_sized(p, &v.st, psmall);
    assert_int_equal(v.st.msgs_sent, 1);
    assert_int_equal(v.st.msgs_recv, 1);
    for (size_t i = psmall; i < sizeof(v); i++)
        assert_int_equal(v.b[i], 0xab);
    memset(&v, 0xab, sizeof(v));
    (tdp_pipe_stats_get)(p, &v.st); /* before recv_depth and peer_depth */
    const size_t pv1 = offsetof(tdp_pipe_stats, resumed_from) + sizeof(uint64_t);
    assert_int_equal(v.st.resumed_from, 0);
    for (size_t i = pv1; i < sizeof(v); i++)
        assert_int_equal(v.b[i], 0xab);
    memset(&v, 0xab, sizeof(v));
    tdp_pipe_stats_get(p, &v.st); /* the macro: this header's size */
    assert_int_equal(v.st.recv_depth, 1);
    assert_int_equal(v.st.peer_depth, 1);
    for (size_t i = sizeof(tdp_pipe_stats); i < sizeof(v); i++)
        assert_int_equal(v.b[i], 0xab);

    tdp_pipe_close(p, TMO);
    tdp_pipe_free(p);
    env_down(&e);
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--child") == 0)
        child_main((uint16_t)atoi(argv[2]));
    signal(SIGPIPE, SIG_IGN);
    struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lifecycle),
        cmocka_unit_test(test_many_clients),
        cmocka_unit_test(test_request_reply),
        cmocka_unit_test(test_depth_echo),
        cmocka_unit_test(test_reply_ring),
        cmocka_unit_test(test_max_clients),
        cmocka_unit_test(test_handshake_timeout),
        cmocka_unit_test(test_hostile_clients),
        cmocka_unit_test(test_handler_error),
        cmocka_unit_test(test_connect_cycles),
        cmocka_unit_test(test_kill_client),
        cmocka_unit_test(test_shutdown),
        cmocka_unit_test(test_strangers),
        cmocka_unit_test(test_idle_timeout),
        cmocka_unit_test(test_listener_strangers),
        cmocka_unit_test(test_listener_hooks),
        cmocka_unit_test(test_stats_sized),
        cmocka_unit_test(test_memory_cap),
        cmocka_unit_test(test_silent_sockets_make_no_worker),
        cmocka_unit_test(test_connect_burst),
    };
    /* TDP_TEST_FILTER=pattern runs only the matching tests, TDP_TEST_SKIP=pattern
     * leaves the matching ones out (cmocka wildcards) */
    const char *filter = getenv("TDP_TEST_FILTER"), *skip = getenv("TDP_TEST_SKIP");
    if (filter != NULL && *filter != '\0')
        cmocka_set_test_filter(filter);
    size_t ntests = sizeof(tests) / sizeof(tests[0]);
    if (skip != NULL && strchr(skip, ':') != NULL)
        ntests = skip_named(tests, ntests, skip); /* a list of names */
    else if (skip != NULL && *skip != '\0')
        cmocka_set_skip_filter(skip);
    return _cmocka_run_group_tests("tests", tests, ntests, NULL, NULL);
}
