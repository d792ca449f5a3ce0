/*
 * peer_zmq.c: ZeroMQ (libzmq) over tcp://127.0.0.1, or ipc:// (an abstract
 * Unix socket) with --transport ipc — a widely used messaging library doing
 * the same job as tdpipe.
 *
 * Latency: REQ/REP, the REP side sends each message it receives straight
 * back (the same zmq_msg_t, no copy). Throughput: PUSH/PULL, a new pair per
 * size with high-water marks of min(1000, max(4, 256 MiB / size)) messages
 * on both ends, timed by the PULL side. Both sides are given ZeroMQ's best
 * case: sends are zero-copy (zmq_msg_init_data on a constant buffer, no
 * free function), receives keep ZeroMQ's own message (zmq_msg_recv, no copy
 * out). Control messages ride the REQ/REP pair.
 *
 * The consumer is forked before either side creates a ZeroMQ context; the
 * producer tells it the endpoints through a pipe.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "peers.h"

#ifdef TDP_HAVE_ZMQ
#include <zmq.h>

enum { PH_PING = 1, PH_STREAM = 2, PH_RESULT = 3, PH_END = 4 };
#define EP_LEN 64

typedef struct ctrl {
    int64_t phase, bytes, count, warm, hwm;
    char endpoint[EP_LEN]; /* the PUSH side, for PH_STREAM */
} ctrl;

static int hwm_for(uint64_t bytes)
{
    uint64_t h = (256ull << 20) / bytes;
    return (int)(h < 4 ? 4 : h > 1000 ? 1000 : h);
}

static void *new_socket(void *ctx, int type, int hwm)
{
    void *s = zmq_socket(ctx, type);
    int tmo = PEERS_TMO_MS, linger = 0;
    if (s == NULL)
        return NULL;
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &tmo, sizeof(tmo));
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    if (hwm > 0) {
        zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
        zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    }
    return s;
}

/*
 * Bind to 127.0.0.1 at an ephemeral port, or (--transport ipc) to an
 * abstract Unix socket named after this process; the endpoint goes into ep.
 */
static bool bind_loopback(const peer_cfg *cfg, void *s, char ep[EP_LEN])
{
    static unsigned n;
    char want[EP_LEN];
    size_t len = EP_LEN;
    if (cfg->zmq_ipc)
        snprintf(want, sizeof(want), "ipc://@tdp-peers-zmq-%ld-%u", (long)getpid(), n++);
    else
        snprintf(want, sizeof(want), "tcp://127.0.0.1:*");
    return zmq_bind(s, want) == 0 && zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len) == 0;
}

static bool send_ctrl(void *s, const ctrl *c)
{
    return zmq_send(s, c, sizeof(*c), 0) == (int)sizeof(*c);
}

static bool recv_ctrl(void *s, ctrl *c)
{
    return zmq_recv(s, c, sizeof(*c), 0) == (int)sizeof(*c);
}

/* Send len bytes of buf without copying them (buf outlives the message). */
static bool send_zc(void *s, void *buf, size_t len)
{
    zmq_msg_t m;
    zmq_msg_init_data(&m, buf, len, NULL, NULL);
    if (zmq_msg_send(&m, s, 0) < 0) {
        zmq_msg_close(&m);
        return false;
    }
    return true;
}

/* Receive one message and check its size; it is dropped. */
static bool recv_drop(void *s, uint64_t bytes)
{
    zmq_msg_t m;
    zmq_msg_init(&m);
    bool ok = zmq_msg_recv(&m, s, 0) >= 0 && zmq_msg_size(&m) == bytes;
    zmq_msg_close(&m);
    return ok;
}

/* ---- the consumer (child process) ------------------------------------------------ */

static int zmq_consumer(int pipe_fd)
{
    char ep[EP_LEN], pull_ep[EP_LEN] = "";
    if (read(pipe_fd, ep, sizeof(ep)) != (ssize_t)sizeof(ep)) /* atomic: < PIPE_BUF */
        return 1;
    close(pipe_fd);
    void *ctx = zmq_ctx_new(), *rep = new_socket(ctx, ZMQ_REP, 0), *pull = NULL;
    bool ok = rep != NULL && zmq_connect(rep, ep) == 0;
    ctrl c;
    while (ok && recv_ctrl(rep, &c) && c.phase != PH_END) {
        if (c.phase == PH_STREAM && strcmp(c.endpoint, pull_ep) != 0) { /* a new size */
            if (pull != NULL)
                zmq_close(pull);
            pull = new_socket(ctx, ZMQ_PULL, (int)c.hwm);
            ok = pull != NULL && zmq_connect(pull, c.endpoint) == 0;
            memcpy(pull_ep, c.endpoint, EP_LEN);
        }
        ok = ok && send_ctrl(rep, &c); /* ready */
        if (c.phase == PH_PING) {
            for (int64_t i = 0; ok && i < c.count; i++) {
                zmq_msg_t m;
                zmq_msg_init(&m);
                ok = zmq_msg_recv(&m, rep, 0) >= 0 && zmq_msg_size(&m) == (size_t)c.bytes &&
                     zmq_msg_send(&m, rep, 0) >= 0; /* the same message straight back */
                zmq_msg_close(&m);
            }
        } else if (c.phase == PH_STREAM) {
            uint64_t t0 = 0, t1 = 0;
            for (int64_t i = 0; ok && i < c.count; i++) {
                ok = recv_drop(pull, (uint64_t)c.bytes);
                if (i == c.warm)
                    t0 = peers_now_ns();
                if (i == c.count - 1)
                    t1 = peers_now_ns();
            }
            ctrl q;
            ok = ok && recv_ctrl(rep, &q) && q.phase == PH_RESULT;
            q.bytes = (int64_t)(t1 - t0);   /* elapsed ns */
            q.count = c.count - 1 - c.warm; /* messages timed */
            ok = ok && send_ctrl(rep, &q);
        }
    }
    if (ok)
        send_ctrl(rep, &c); /* acknowledge the end */
    if (pull != NULL)
        zmq_close(pull);
    if (rep != NULL)
        zmq_close(rep);
    zmq_ctx_term(ctx);
    return ok ? 0 : 1;
}

/* ---- the producer -------------------------------------------------------------------- */

static bool measure(const peer_cfg *cfg, void *ctx, void *req, char *msg, uint64_t bytes,
                    size_result *res)
{
    char label[32];
    peers_format_size(bytes, label, sizeof(label));
    ctrl c = {.phase = PH_PING, .bytes = (int64_t)bytes};

    int n = peers_lat_rounds(cfg, bytes), warm = peers_lat_warm(n);
    double *lat = calloc((size_t)n, sizeof(double));
    c.count = warm + n;
    bool ok = lat != NULL && send_ctrl(req, &c) && recv_ctrl(req, &c);
    for (int i = 0; ok && i < warm + n; i++) {
        uint64_t a = peers_now_ns();
        ok = send_zc(req, msg, bytes) && recv_drop(req, bytes);
        uint64_t b = peers_now_ns();
        if (i >= warm)
            lat[i - warm] = (double)(b - a) / 2e3;
    }
    if (ok)
        peers_lat_summary(lat, n, res);
    free(lat);

    int count = peers_tp_count(cfg, bytes), twarm = peers_tp_warm(count);
    void *push = new_socket(ctx, ZMQ_PUSH, hwm_for(bytes));
    c = (ctrl){.phase = PH_STREAM,
               .bytes = (int64_t)bytes,
               .count = count,
               .warm = twarm,
               .hwm = hwm_for(bytes)};
    ok = ok && push != NULL && bind_loopback(cfg, push, c.endpoint);
    for (int r = 0; ok && r < PEERS_REPEATS; r++) {
        ctrl q = c;
        ok = send_ctrl(req, &q) && recv_ctrl(req, &q);
        for (int i = 0; ok && i < count; i++)
            ok = send_zc(push, msg, bytes);
        q.phase = PH_RESULT;
        ok = ok && send_ctrl(req, &q) && recv_ctrl(req, &q) && q.bytes > 0;
        if (ok) {
            res->tp_msgs = (uint64_t)q.count;
            res->tp_bps[r] = (double)q.count * (double)bytes / ((double)q.bytes / 1e9);
        }
    }
    if (push != NULL)
        zmq_close(push);
    if (!ok) {
        fprintf(stderr, "tdp_peers zmq: %s: the transfer failed: %s\n", label,
                zmq_strerror(zmq_errno()));
        return false;
    }
    peers_tp_summary(res);
    peers_progress(cfg, "  zmq     %-9s latency p50 %.2f us, %.3f GB/s\n", label, res->lat_p50,
                   res->tp_median / 1e9);
    return true;
}

static int zmq_run(const peer_cfg *cfg, size_result *res)
{
    uint64_t max = 0;
    for (int i = 0; i < cfg->nsizes; i++)
        max = cfg->sizes[i] > max ? cfg->sizes[i] : max;
    int pfd[2];
    if (pipe(pfd) != 0)
        return 1;
    fflush(NULL);
    pid_t child = fork(); /* before any ZeroMQ context exists */
    if (child == 0) {
        close(pfd[1]);
        _exit(zmq_consumer(pfd[0]));
    }
    close(pfd[0]);
    char ep[EP_LEN] = "";
    void *ctx = zmq_ctx_new(), *req = new_socket(ctx, ZMQ_REQ, 0);
    char *msg = malloc(max);
    bool ok = child > 0 && msg != NULL && req != NULL && bind_loopback(cfg, req, ep) &&
              write(pfd[1], ep, sizeof(ep)) == (ssize_t)sizeof(ep);
    close(pfd[1]);
    if (!ok)
        fprintf(stderr, "tdp_peers zmq: cannot set up the REQ socket on 127.0.0.1: %s\n",
                zmq_strerror(zmq_errno()));
    if (msg != NULL)
        memset(msg, 0x5a, max); /* real, touched data */
    for (int i = 0; ok && i < cfg->nsizes; i++) {
        peers_result_init(&res[i], cfg->sizes[i]);
        ok = measure(cfg, ctx, req, msg, cfg->sizes[i], &res[i]);
    }
    if (ok) {
        ctrl c = {.phase = PH_END};
        ok = send_ctrl(req, &c) && recv_ctrl(req, &c);
    }
    if (req != NULL)
        zmq_close(req);
    zmq_ctx_term(ctx);
    free(msg);
    if (child > 0) {
        bool tmo;
        int st = peers_wait_child(child, ok ? PEERS_TMO_MS : 1000, &tmo);
        if (ok && (tmo || !WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
            fprintf(stderr, "tdp_peers zmq: the consumer failed\n");
            ok = false;
        }
    }
    return ok ? 0 : 1;
}

static void zmq_describe(const peer_cfg *cfg, json_t *obj)
{
    int ma, mi, pa;
    char v[32];
    zmq_version(&ma, &mi, &pa);
    snprintf(v, sizeof(v), "%d.%d.%d", ma, mi, pa);
    json_object_set_new(obj, "zmq_version", json_string(v));
    json_object_set_new(obj, "hwm", json_string("min(1000, max(4, 256 MiB / size)) messages"));
    json_object_set_new(obj, "transport", json_string(cfg->zmq_ipc ? "ipc" : "tcp"));
}

#else /* !TDP_HAVE_ZMQ */

static int zmq_run(const peer_cfg *cfg, size_result *res)
{
    fprintf(stderr, "tdp_peers zmq: built without ZeroMQ (libzmq was not found when "
                    "configuring); install libzmq3-dev and rebuild\n");
    return 77; /* "not built here": bench/run.sh skips the step */
}
#define zmq_describe NULL

#endif

const peer_ops peer_zmq = {
    .name = "zmq",
    .method = "ZeroMQ over tcp://127.0.0.1: latency = half a REQ/REP round trip (REP echoes the "
              "same message); throughput = PUSH/PULL, timed on the PULL side; zero-copy sends, "
              "zmq_msg_recv receives",
    .run = zmq_run,
    .describe = zmq_describe,
};
