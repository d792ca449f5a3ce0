/*
 * cmd_bench.c: `tdpipe bench` — a producer (this process) and a consumer (a
 * child process it starts) on loopback, measuring for each payload size:
 *
 *   first send   round trip of the first message of a new schema (schema
 *                frame, receiver validation + allocation + registration,
 *                data) and a small acknowledgement back;
 *   latency      one-way time = half the round trip of a ping-pong in which
 *                the consumer sends each message straight back (the method
 *                of ucx_perftest's am_lat), mean, p50, p99, p99.9;
 *   throughput   messages streamed back to back, timed by the consumer from
 *                the completion of the first counted message to the last,
 *                repeated to show the spread.
 *
 * Across two hosts the same two roles run in two commands: `bench --server`
 * plays the consumer for one client after another, `bench --client
 * HOST:PORT` the producer; the producer's settings travel in the SETUP
 * message (see consume()), so the server needs no other protocol.
 *
 * Each message is exactly `size` bytes (a multiple of 4): the synthetic
 * schema of `tdpipe send` (one float32 leaf, docs/cli.md) whose first 32
 * bytes carry the benchmark's control words.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <getopt.h>
#include <jansson.h>
#include <ucp/api/ucp.h>

#include <tdpipe/tdpipe.h>

#include "bench_method.h"
#include "cli.h"
#include "send_ring.h"

enum { PH_SETUP = 1, PH_FIRST = 2, PH_PING = 3, PH_STREAM = 4 };
#define HDR_BYTES  32u /* four int64 control words at the start of each message */
#define MAX_SIZES  16
#define MIN_SIZE   128           /* room for the control words, and some payload */
#define MAX_SIZE   (64ull << 30) /* 64 GiB */
#define TP_REPEATS 3
#define BENCH_TMO  120000
/*
 * A peer that does not answer SETUP in this time is no bench server (one
 * busy with another client refuses at once).
 */
#define SETUP_TMO 10000
#define SLICE_MS  200 /* the server's waits, in slices to see a signal */
/* SETUP's ack, word 1: the peer is a bench consumer (any other answer is not) */
#define BENCH_MAGIC   INT64_C(0x7464702d62656e63)
#define SETUP_NO_LOAN 1 /* SETUP word 1: the producer sends plain buffers */
/* --window: each side's receive window (tdp_pipe_opts.recv_window_bytes) */
#define TDP_BENCH_WINDOW (256u << 10)

typedef struct bench_cfg {
    uint64_t sizes[MAX_SIZES];
    int nsizes;
    int rounds; /* 0: scaled by size */
    uint32_t depth;
    uint64_t window; /* tdp_pipe_opts.recv_window_bytes of both sides (--window) */
    uint32_t busy_poll_us;
    tdp_peer_mode peer_mode;
    tdp_plane plane;
    const char *tls;
    const char *json_path;
    const char *plot_path;
    bool quiet;
    bool progress;
    int clients;                /* --clients N: many producers to one server */
    int fanin;                  /* --fanin N: many producers into one tdp_fanin (bench_fanin.c) */
    const char *fanin_baseline; /* --fanin-baseline PROG: the poll-loop consumer */
    bool fanin_procs;           /* --fanin-procs: each producer a process of its own */
    bool fanin_role;            /* --role=fanin: its consumer process */
    int fanout;                 /* --fanout N: a broadcast to N consumers (bench_fanout.c) */
    bool no_loan;               /* --no-loan: plain sends on the shm plane too */
    bool prepare;               /* --prepare: tdp_pipe_prepare each size's layout, untimed */
    bool checksum;              /* --checksum: both sides offer the payload checksum */
    uint32_t inflight;          /* --inflight N: plain streams as N async sends in flight */
    bool sizes_given;
    tdp_device mem; /* --mem: where the producer's buffers live (the consumer's follow) */
    bool mem_given;
    /* child roles */
    bool consumer;
    bool server;
    const char *connect;
    /* two hosts: --server [--bind --port --once], --client HOST:PORT */
    bool serve;
    bool once;
    const char *bind;
    uint16_t port;
    bool bind_given, port_given;
    const char *client_of;
    char peer_host[TDP_CLI_HOST_LEN];
    uint16_t peer_port;
} bench_cfg;

/* What a bench server said of itself in the SETUP ack (client mode). */
typedef struct server_info {
    int64_t depth, busy_poll_us;
} server_info;

typedef struct size_result {
    uint64_t bytes;
    double first_us;
    double prepare_us; /* --prepare: how long tdp_pipe_prepare took (0 without) */
    double lat_mean, lat_p50, lat_p99, lat_p999, lat_min;
    int lat_n;
    double tp_bps[TP_REPEATS]; /* bytes per second, each repeat */
    double tp_median, tp_min, tp_max;
    uint64_t tp_msgs;
    /*
     * Loaned slots (shm plane, host memory): no byte is copied, so tp_* is
     * a hand-off rate (messages times their size per second), not a data
     * rate. Then plain_* is the data rate of plain sends (one copy into a
     * slot) of the same messages, measured the same way.
     */
    bool loaned;
    double plain_bps[TP_REPEATS];
    double plain_median, plain_min, plain_max;
} size_result;

/* A message of `bytes` on dev (SETUP and the acks are always host memory). */
static tdp_schema *bench_schema_on(uint64_t bytes, tdp_device dev)
{
    tdp_schema *s = NULL;
    if (tdp_cli_synth_schema(bytes, dev, &s) != TDP_OK)
        return NULL;
    return s;
}

static tdp_schema *bench_schema(uint64_t bytes)
{
    return bench_schema_on(bytes, TDP_DEVICE_CPU_INIT);
}

/*
 * TDPIPE_BENCH_PHASES=1: where each side's ping-pong time goes, the mean of
 * each step per ping on stderr (the producer's after each size's pings,
 * the consumer's when the stream after them starts). For finding a cost,
 * not a figure: the marks themselves read the clock.
 */
enum { S_WAIT, S_GET, S_REL, S_LOAN, S_PUT, S_SEND, S_STEPS };
static const char *const step_name[S_STEPS] = {"wait", "get", "release", "loan", "put", "send"};
static struct {
    bool on;
    uint64_t last;
    double sum[S_STEPS];
    uint64_t pings;
} steps;

static void step_start(void)
{
    if (steps.on)
        steps.last = tdp_cli_now_ns();
}

static void step_mark(int k)
{
    if (!steps.on)
        return;
    uint64_t now = tdp_cli_now_ns();
    steps.sum[k] += (double)(now - steps.last) / 1e3;
    steps.last = now;
}

static void steps_report(const char *side)
{
    if (steps.on && steps.pings > 0) {
        fprintf(stderr, "tdpipe bench: %s, per ping (mean us):", side);
        for (int k = 0; k < S_STEPS; k++)
            fprintf(stderr, " %s %.2f", step_name[k], steps.sum[k] / (double)steps.pings);
        fprintf(stderr, "\n");
    }
    memset(steps.sum, 0, sizeof(steps.sum));
    steps.pings = 0;
}

/* The control words ride in the first HDR_BYTES of the buffer (host memory). */
static int64_t *hdr_of(tdp_td *td)
{
    return tdp_td_data(td);
}

static bool on_gpu(const tdp_td *td)
{
    return tdp_td_device(td).type == TDP_DEVICE_CUDA;
}

/* Whether the plane lends slots for buffers where these live: host slots
 * on shm, device slots on cuda-ipc. */
static bool plane_lends(tdp_plane plane, bool gpu)
{
    return plane == (gpu ? TDP_PLANE_CUDA_IPC : TDP_PLANE_SHM);
}

/*
 * The control words of a message in any memory: a GPU buffer's are copied
 * to or from the device (32 bytes, each message, on both sides: part of
 * what --mem cuda measures).
 */
static tdp_err hdr_put(tdp_td *td, const int64_t h[4])
{
    /* one device query per message: the tool's own cost stays out of the figures */
    if (on_gpu(td))
        return tdp_mem_copy(tdp_td_data(td), h, HDR_BYTES);
    memcpy(hdr_of(td), h, HDR_BYTES);
    return TDP_OK;
}

static tdp_err hdr_get(tdp_td *td, bool gpu, int64_t h[4])
{
    if (tdp_td_nbytes(td) < HDR_BYTES)
        return TDP_EPROTO;
    if (gpu)
        return tdp_mem_copy(h, tdp_td_data(td), HDR_BYTES);
    memcpy(h, hdr_of(td), HDR_BYTES);
    return TDP_OK;
}

/* Give a message's buffer some contents, once: the benchmark times transfers. */
static tdp_err bench_fill(tdp_td *td)
{
    if (on_gpu(td))
        return tdp_mem_set(tdp_td_data(td), 1, tdp_td_nbytes(td));
    return tdp_cli_fill(td, 1);
}

/*
 * --mem cuda needs a CUDA device (the driver's, or TDPIPE_CUDA=fake); TDP_EXIT_OK, or
 * the message and TDP_EXIT_USAGE.
 */
static int check_mem(const bench_cfg *cfg)
{
    if (cfg->mem.type != TDP_DEVICE_CUDA)
        return TDP_EXIT_OK;
    int n = tdp_cuda_device_count();
    if (n == 0) {
        char why[128];
        return tdp_cli_usage_error("bench", "--mem cuda: %s", tdp_cuda_describe(why, sizeof(why)));
    }
    if (cfg->mem.index >= n)
        return tdp_cli_usage_error("bench", "--mem cuda:%d: there %s %d CUDA device%s",
                                   cfg->mem.index, n == 1 ? "is" : "are", n, n == 1 ? "" : "s");
    return TDP_EXIT_OK;
}

/*
 * Send a message of proto's layout whose control words are hdr[0..3]. On
 * the shm plane with host buffers and on the cuda-ipc plane with GPU ones
 * (unless --no-loan) it is a loaned slot: only the control words are
 * written, nothing is copied, the receiver reads the slot where it lies —
 * as ucx_perftest moves buffers it never writes. Elsewhere it is proto
 * itself, sent from its own buffer.
 */
static tdp_err bench_send(const bench_cfg *cfg, tdp_pipe *p, tdp_td *proto, const int64_t hdr[4])
{
    if (cfg->no_loan || !plane_lends(tdp_pipe_plane(p), on_gpu(proto))) {
        tdp_err rc = hdr_put(proto, hdr);
        step_mark(S_PUT);
        if (rc == TDP_OK)
            rc = tdp_pipe_send(p, proto, BENCH_TMO);
        step_mark(S_SEND);
        return rc;
    }
    tdp_td *slot = NULL;
    tdp_err rc;
    /* every slot out for a moment: a release on its way frees one */
    for (int i = 0;
         i < 100000 && (rc = tdp_pipe_loan(p, tdp_td_schema(proto), &slot)) == TDP_EAGAIN; i++)
        sched_yield();
    step_mark(S_LOAN);
    if (rc != TDP_OK)
        return rc;
    rc = hdr_put(slot, hdr); /* a device slot's through a copy */
    step_mark(S_PUT);
    if (rc == TDP_OK)
        rc = tdp_pipe_send(p, slot, BENCH_TMO);
    step_mark(S_SEND);
    tdp_td_unref(slot);
    return rc;
}

/* ---- the consumer (child process, or bench --server) ------------------------- */

/*
 * The next message, waiting up to BENCH_TMO. With watch (the server), in
 * slices, so that SIGINT/SIGTERM is seen: TDP_ECANCELED then.
 */
static tdp_err bench_recv(tdp_pipe *p, bool watch, tdp_td **out)
{
    if (!watch)
        return tdp_pipe_recv(p, BENCH_TMO, out);
    uint64_t deadline = tdp_cli_now_ns() + (uint64_t)BENCH_TMO * 1000000u;
    for (;;) {
        if (tdp_cli_interrupted())
            return TDP_ECANCELED;
        tdp_err rc = tdp_pipe_recv(p, SLICE_MS, out);
        /* a timed-out receive was canceled before it started: the pipe lives on */
        if (rc != TDP_ETIMEDOUT || tdp_pipe_status(p) != TDP_OK || tdp_cli_now_ns() >= deadline)
            return rc;
    }
}

/*
 * One producer's run on an open pipe: echo the pings, time the streams,
 * acknowledge the rest, until the producer closes (TDP_ECLOSED) or
 * something fails. SETUP carries the producer's settings (word 1: flags,
 * SETUP_NO_LOAN; words 2, 3: its depth and busy-poll, for the record: the
 * depth itself came in the HELLO); the ack answers BENCH_MAGIC and the
 * depth this side's pipe receives with and its busy-poll. The sizes
 * need no setting: each is a new schema, which the pipe handles itself.
 */
static tdp_err consume(const bench_cfg *cfg_in, tdp_pipe *pipe, bool watch)
{
    bench_cfg c = *cfg_in; /* no_loan is the producer's choice */
    const bench_cfg *cfg = &c;
    tdp_pipe_stats ps;
    tdp_pipe_stats_get(pipe, &ps);
    if (ps.recv_depth != 0)
        c.depth = ps.recv_depth; /* a server follows the client's wish (run_server) */
    tdp_schema *as = bench_schema(128);
    tdp_td *ack = NULL, *td, *echo = NULL;
    if (as == NULL || tdp_td_new(as, &ack) != TDP_OK) {
        tdp_schema_unref(as);
        return TDP_ENOMEM;
    }
    uint64_t t_start = 0;
    tdp_err rc;
    const tdp_plane plane = tdp_pipe_plane(pipe); /* fixed by the HELLO */
    step_start();
    while ((rc = bench_recv(pipe, watch, &td)) == TDP_OK) {
        int64_t h[4];
        const bool gpu = on_gpu(td);
        step_mark(S_WAIT);
        if ((rc = hdr_get(td, gpu, h)) != TDP_OK) {
            tdp_pipe_release(pipe, td);
            break;
        }
        step_mark(S_GET);
        if (h[0] == PH_PING)
            steps.pings++;
        else
            steps_report("consumer");
        switch (h[0]) {
        case PH_PING:
            if (cfg->no_loan || !plane_lends(plane, gpu)) {
                rc = tdp_pipe_send(pipe, td, BENCH_TMO); /* the same buffer, straight back */
                step_mark(S_SEND);
                tdp_pipe_release(pipe, td);
                step_mark(S_REL);
            } else {
                /* zero copy both ways: a slot of this side's pool answers */
                int64_t back[4];
                memcpy(back, h, sizeof(back));
                tdp_pipe_release(pipe, td);
                step_mark(S_REL);
                if (echo == NULL || tdp_td_schema(echo) != tdp_td_schema(td)) {
                    tdp_td_unref(echo);
                    echo = tdp_td_ref(td); /* its layout; never sent itself */
                }
                rc = bench_send(cfg, pipe, echo, back);
            }
            break;
        case PH_STREAM: {
            int64_t idx = h[1], count = h[2], warm = h[3];
            if (idx == warm)
                t_start = tdp_cli_now_ns();
            tdp_pipe_release(pipe, td);
            /* a peer's words: no arithmetic on them that can overflow */
            if (count > 0 && idx == count - 1) {
                hdr_of(ack)[0] = PH_STREAM;
                hdr_of(ack)[1] = (int64_t)(tdp_cli_now_ns() - t_start);
                hdr_of(ack)[2] = warm >= 0 && warm < count ? count - 1 - warm : 0; /* timed */
                rc = tdp_pipe_send(pipe, ack, BENCH_TMO);
            }
            break;
        }
        case PH_SETUP:
            if (h[1] & SETUP_NO_LOAN)
                c.no_loan = true;
            hdr_of(ack)[0] = PH_SETUP;
            hdr_of(ack)[1] = BENCH_MAGIC;
            hdr_of(ack)[2] = (int64_t)cfg->depth;
            hdr_of(ack)[3] = (int64_t)cfg->busy_poll_us;
            tdp_pipe_release(pipe, td);
            rc = tdp_pipe_send(pipe, ack, BENCH_TMO);
            break;
        default: /* FIRST: acknowledge */
            hdr_of(ack)[0] = h[0];
            tdp_pipe_release(pipe, td);
            rc = tdp_pipe_send(pipe, ack, BENCH_TMO);
            break;
        }
        if (rc != TDP_OK)
            break;
    }
    tdp_td_unref(echo);
    tdp_td_unref(ack);
    tdp_schema_unref(as);
    return rc;
}

/* --mem cuda: the pipe sets up its GPU staging when it connects, not in the first message. */
static void opts_mem(const bench_cfg *cfg, tdp_pipe_opts *po)
{
    if (cfg->mem.type == TDP_DEVICE_CUDA) {
        po->cuda_device_set = true;
        po->cuda_device = cfg->mem.index;
    }
}

static int run_consumer(const bench_cfg *cfg)
{
    char host[TDP_CLI_HOST_LEN];
    uint16_t port;
    tdp_loop *loop;
    tdp_pipe *pipe;
    tdp_loop_opts lo = {.size = sizeof(lo), .busy_poll_us = cfg->busy_poll_us};
    tdp_pipe_opts po;

    if (!tdp_cli_parse_hostport(cfg->connect, false, host, sizeof(host), &port))
        return TDP_EXIT_USAGE;
    tdp_pipe_opts_default(&po);
    po.recv_depth = cfg->depth;
    po.recv_window_bytes = cfg->window;
    po.peer_mode = cfg->peer_mode;
    po.plane = cfg->plane;
    opts_mem(cfg, &po);
    po.checksum = cfg->checksum;
    if (tdp_loop_new(&lo, &loop) != TDP_OK || tdp_pipe_connect(loop, host, port, &po, &pipe))
        return TDP_EXIT_CONNECT;
    tdp_err rc = consume(cfg, pipe, false);
    tdp_pipe_free(pipe);
    tdp_loop_free(loop);
    return rc == TDP_ECLOSED ? TDP_EXIT_OK : tdp_cli_exit_for(rc);
}

static const char *signal_name(int sig)
{
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "signal";
}

/*
 * One client at a time: the pipe being measured holds the claim from its
 * HELLO until it is done; anyone else is turned away at once (TDP_ELIMIT:
 * the client says "busy") rather than queued behind it. The hooks run on
 * the loop thread, which is this one, inside the blocking calls.
 */
typedef struct serve_state {
    const bench_cfg *cfg;
    bool claimed;       /* a handshake or a client holds the server */
    int64_t claimed_ns; /* since when (a handshake that fails never arrives) */
    int turned_away;    /* while busy, reported after the client */
} serve_state;

#define SERVE_HANDSHAKE_MS 5000

static tdp_err serve_admit(const tdp_accept_info *info, void *arg)
{
    serve_state *st = arg;
    (void)info;
    if (!st->claimed)
        return TDP_OK;
    st->turned_away++;
    return TDP_ELIMIT;
}

/* The client's HELLO: claim the server, and receive with the depth it asks for. */
static tdp_err serve_hello(const tdp_accept_info *info, tdp_pipe_opts *o, void *arg)
{
    serve_state *st = arg;
    if (st->claimed) { /* two came at once: the first HELLO wins */
        st->turned_away++;
        return TDP_ELIMIT;
    }
    st->claimed = true;
    st->claimed_ns = (int64_t)tdp_cli_now_ns();
    o->recv_depth = info->want_depth != 0 ? info->want_depth : st->cfg->depth;
    return TDP_OK;
}

/*
 * bench --server: listen, then be the consumer of one client after another
 * (all of --once: only the first), each with the receive depth it asks for.
 * A client that fails is reported and the next one served; clients that
 * come while one is measured are refused at once; SIGINT/SIGTERM ends it
 * between or during clients.
 */
static int run_server(const bench_cfg *cfg)
{
    tdp_loop *loop;
    tdp_listener *l;
    tdp_loop_opts lo = {.size = sizeof(lo), .busy_poll_us = cfg->busy_poll_us};
    tdp_listener_opts lopts;
    serve_state st = {.cfg = cfg};
    int rc_exit = TDP_EXIT_OK, served = 0;
    tdp_err rc;

    tdp_listener_opts_default(&lopts);
    lopts.pipe.recv_depth = cfg->depth; /* for a client that asks for none */
    lopts.pipe.recv_window_bytes = cfg->window;
    lopts.pipe.peer_mode = cfg->peer_mode;
    lopts.pipe.plane = cfg->plane;
    lopts.pipe.checksum = cfg->checksum;
    lopts.pipe.connect_timeout_ms = SERVE_HANDSHAKE_MS;
    lopts.admit = serve_admit;
    lopts.on_hello = serve_hello;
    lopts.hook_arg = &st;
    if ((rc = tdp_loop_new(&lo, &loop)) != TDP_OK) {
        tdp_cli_error("bench", "cannot create the event loop: %s", tdp_strerror(rc));
        return TDP_EXIT_FAIL;
    }
    rc = tdp_listener_new_opts(loop, cfg->bind, cfg->port, &lopts, NULL, NULL, &l);
    if (rc != TDP_OK) {
        tdp_loop_free(loop);
        return tdp_cli_listen_failed("bench", cfg->bind, cfg->port, rc);
    }
    tdp_cli_print_listening(cfg->bind, tdp_listener_port(l));
    fflush(stdout);
    for (;;) {
        tdp_pipe *p = NULL;
        char peer[80];
        do {
            rc = tdp_listener_accept(l, SLICE_MS, &p);
            /* a claimed handshake that failed never arrives: free the server again */
            if (rc == TDP_ETIMEDOUT && st.claimed &&
                (int64_t)tdp_cli_now_ns() - st.claimed_ns > (SERVE_HANDSHAKE_MS + 1000) * 1000000ll)
                st.claimed = false;
        } while (rc == TDP_ETIMEDOUT && !tdp_cli_interrupted());
        if (tdp_cli_interrupted()) {
            if (rc == TDP_OK)
                tdp_pipe_free(p);
            break;
        }
        if (rc != TDP_OK) {
            tdp_cli_error("bench", "accept: %s", tdp_strerror(rc));
            rc_exit = tdp_cli_exit_for(rc);
            break;
        }
        tdp_pipe_peer(p, peer, sizeof(peer));
        tdp_pipe_stats ps;
        tdp_pipe_stats_get(p, &ps);
        if (!cfg->quiet)
            fprintf(stderr, "tdpipe bench: client %s connected, plane %s, depth %u, %s\n", peer,
                    tdp_cli_plane_of(p), ps.recv_depth,
                    cfg->busy_poll_us ? "busy-poll" : "event-driven");
        uint64_t t0 = tdp_cli_now_ns();
        rc = consume(cfg, p, true);
        served++;
        int one = TDP_EXIT_OK;
        if (rc == TDP_ECANCELED) {
            tdp_pipe_close(p, 2000); /* tell the client, rather than vanish */
        } else if (rc == TDP_ECLOSED) {
            if (!cfg->quiet)
                fprintf(stderr, "tdpipe bench: client %s done (%.1f s)\n", peer,
                        (double)(tdp_cli_now_ns() - t0) / 1e9);
        } else {
            tdp_cli_error("bench", "client %s: %s", peer, tdp_cli_strerror(rc));
            one = tdp_cli_exit_for(rc);
        }
        tdp_pipe_free(p);
        if (st.turned_away > 0 && !cfg->quiet)
            fprintf(stderr, "tdpipe bench: turned away %d client%s while busy with %s\n",
                    st.turned_away, st.turned_away == 1 ? "" : "s", peer);
        st.turned_away = 0;
        st.claimed = false;
        if (rc == TDP_ECANCELED)
            break;
        if (cfg->once) {
            rc_exit = one;
            break;
        }
    }
    tdp_listener_free(l);
    tdp_loop_free(loop);
    int sig = tdp_cli_interrupted();
    if (sig != 0) {
        fprintf(stderr, "tdpipe bench: interrupted (%s) after %d client%s\n", signal_name(sig),
                served, served == 1 ? "" : "s");
        return TDP_EXIT_SIGNAL(sig);
    }
    return rc_exit;
}

/* ---- the producer ------------------------------------------------------------- */

/* Send one message with header phase/idx and wait for the consumer's ack. */
static tdp_err round_trip(tdp_pipe *p, tdp_td *td, int64_t phase)
{
    tdp_td *got;
    int64_t h[4] = {phase, 0, 0, 0};
    tdp_err rc = hdr_put(td, h);
    if (rc == TDP_OK)
        rc = tdp_pipe_send(p, td, BENCH_TMO);
    if (rc == TDP_OK)
        rc = tdp_pipe_recv(p, BENCH_TMO, &got);
    if (rc == TDP_OK)
        tdp_pipe_release(p, got);
    return rc;
}

/*
 * TP_REPEATS streams of back-to-back messages of td's layout, each timed by
 * the consumer from the first counted message to the last: bytes per
 * second into bps[], messages timed per repeat into *msgs.
 */
/*
 * --inflight N: a plain stream as a producer of small messages should send
 * it (docs/pipe.md, "Streams of small messages"): N messages of their own
 * buffers in flight as async sends, the sending thread waiting for the
 * oldest (tdp_op_wait, which drives the loop meanwhile) only when it needs
 * its buffer again. Sends made while the loop is not driven may go out
 * together (the ucx plane's BATCH frames).
 */
typedef tdp_cli_ring inflight;

/* Wait for op k if it is out; its result (TDP_OK for one never started). */
static tdp_err inflight_wait(inflight *f, uint32_t k)
{
    tdp_err rc = tdp_op_result(f->op[k]);
    return rc == TDP_EAGAIN ? tdp_op_wait(f->op[k], BENCH_TMO) : rc;
}

/* One repeat's count messages as async sends, then the wait for all of them. */
static tdp_err stream_async(tdp_pipe *p, inflight *f, int count, int twarm)
{
    tdp_err rc = TDP_OK;
    for (int i = 0; i < count && rc == TDP_OK; i++) {
        uint32_t k = (uint32_t)i % f->n;
        if ((rc = inflight_wait(f, k)) != TDP_OK)
            break;
        int64_t h[4] = {PH_STREAM, i, count, twarm};
        memcpy(hdr_of(f->td[k]), h, HDR_BYTES);
        tdp_pipe_send_async(p, f->td[k], f->op[k]);
    }
    for (uint32_t k = 0; k < f->n; k++) { /* every op back, even after a failure */
        tdp_err r = inflight_wait(f, k);
        if (rc == TDP_OK)
            rc = r;
    }
    return rc;
}

static tdp_err stream_repeats(const bench_cfg *cfg, tdp_pipe *p, tdp_td *td, uint64_t bytes,
                              const char *label, const char *what, double *bps, uint64_t *msgs)
{
    tdp_err rc = TDP_OK;
    tdp_td *got;
    int count = tdp_bm_tp_count(cfg->rounds, bytes), twarm = tdp_bm_tp_warm(count);
    inflight fl;
    /*
     * Small messages only (up to 64 KiB, as many as 256 KiB holds), as
     * tdpipe send keeps them: a buffer of its own per send in flight is a
     * cold buffer each time, which cost a 1 MB stream a third of its rate
     * against peers that send one buffer again and again (docs/cli.md)
     */
    uint32_t n = tdp_cli_inflight_for(bytes, cfg->inflight);
    bool async = n > 1 && !on_gpu(td) && (cfg->no_loan || !plane_lends(tdp_pipe_plane(p), false));
    if (async && (rc = tdp_cli_ring_init(&fl, n, td)) != TDP_OK)
        return rc;
    for (int r = 0; r < TP_REPEATS && rc == TDP_OK; r++) {
        if (async)
            rc = stream_async(p, &fl, count, twarm);
        for (int i = 0; !async && i < count && rc == TDP_OK; i++) {
            int64_t h[4] = {PH_STREAM, i, count, twarm};
            rc = bench_send(cfg, p, td, h);
            if (cfg->progress && (i % 512 == 0 || i == count - 1))
                fprintf(stderr, "\r  %-9s %s %d/%d  %6d/%d ", label, what, r + 1, TP_REPEATS, i + 1,
                        count);
        }
        if (rc == TDP_OK)
            rc = tdp_pipe_recv(p, BENCH_TMO, &got);
        if (rc == TDP_OK) {
            /* the consumer's ack (host memory: read as any reply, wherever it landed) */
            int64_t h[4] = {0};
            rc = hdr_get(got, on_gpu(got), h);
            if (rc == TDP_OK && h[0] != PH_STREAM) {
                fprintf(stderr, "tdpipe bench: the consumer answered phase %lld where the "
                                "stream's ack was due\n", (long long)h[0]);
                rc = TDP_EPROTO;
            }
            double secs = (double)h[1] / 1e9;
            *msgs = (uint64_t)h[2];
            bps[r] = rc == TDP_OK && secs > 0 ? (double)h[2] * (double)bytes / secs : 0;
            tdp_pipe_release(p, got);
        }
    }
    if (async)
        tdp_cli_ring_free(&fl);
    return rc;
}

static tdp_err measure_size(const bench_cfg *cfg, tdp_pipe *p, uint64_t bytes, size_result *out)
{
    tdp_schema *s = bench_schema_on(bytes, cfg->mem);
    tdp_td *td = NULL, *got;
    tdp_err rc;

    if (s == NULL)
        return TDP_EINVAL;
    if ((rc = tdp_td_new(s, &td)) != TDP_OK || (rc = bench_fill(td)) != TDP_OK) {
        tdp_td_unref(td);
        tdp_schema_unref(s);
        return rc;
    }
    out->bytes = bytes;
    char label[32];
    tdp_cli_format_size(bytes, label, sizeof(label));

    /* --prepare: the layout announced first, outside the first send's time */
    if (cfg->prepare) {
        uint64_t tp = tdp_cli_now_ns();
        rc = tdp_pipe_prepare(p, s, BENCH_TMO);
        out->prepare_us = (double)(tdp_cli_now_ns() - tp) / 1e3;
        if (rc != TDP_OK) {
            fprintf(stderr, "tdpipe bench: prepare of %s: %s\n", label, tdp_strerror(rc));
            goto out;
        }
    }
    /* first send: a new schema on the wire (unless prepared), allocation on the receiver */
    uint64_t t0 = tdp_cli_now_ns();
    rc = round_trip(p, td, PH_FIRST);
    out->first_us = (double)(tdp_cli_now_ns() - t0) / 1e3;
    if (rc != TDP_OK)
        goto out;

    /* latency: ping-pong, half the round trip */
    int n = tdp_bm_lat_rounds(cfg->rounds, bytes), warm = tdp_bm_lat_warm(n);
    double *lat = calloc((size_t)n, sizeof(double));
    if (lat == NULL) {
        rc = TDP_ENOMEM;
        goto out;
    }
    for (int i = 0; i < warm + n && rc == TDP_OK; i++) {
        int64_t h[4] = {PH_PING, i, 0, 0};
        uint64_t a = tdp_cli_now_ns();
        step_start();
        rc = bench_send(cfg, p, td, h);
        if (rc == TDP_OK)
            rc = tdp_pipe_recv(p, BENCH_TMO, &got);
        uint64_t b = tdp_cli_now_ns();
        step_mark(S_WAIT);
        if (rc == TDP_OK)
            tdp_pipe_release(p, got);
        step_mark(S_REL);
        steps.pings++;
        if (i >= warm)
            lat[i - warm] = (double)(b - a) / 2e3;
        if (cfg->progress && (i % 256 == 0 || i == warm + n - 1))
            fprintf(stderr, "\r  %-9s latency   %5d/%d ", label, i + 1, warm + n);
    }
    steps_report("producer");
    if (rc == TDP_OK) {
        tdp_bm_lat l;
        tdp_bm_lat_summary(lat, n, &l);
        out->lat_mean = l.mean;
        out->lat_min = l.min;
        out->lat_p50 = l.p50;
        out->lat_p99 = l.p99;
        out->lat_p999 = l.p999;
        out->lat_n = l.n;
    }
    free(lat);

    /* throughput: back to back, timed on the receiver, repeated */
    rc = stream_repeats(cfg, p, td, bytes, label, "throughput", out->tp_bps, &out->tp_msgs);
    if (rc == TDP_OK)
        tdp_bm_spread(out->tp_bps, TP_REPEATS, &out->tp_min, &out->tp_median, &out->tp_max);
    out->loaned = !cfg->no_loan && plane_lends(tdp_pipe_plane(p), on_gpu(td));
    if (rc == TDP_OK && out->loaned) {
        /* the same stream sent plainly: the data rate beside the hand-off rate */
        bench_cfg plain = *cfg;
        uint64_t msgs;
        plain.no_loan = true;
        rc = stream_repeats(&plain, p, td, bytes, label, "plain send", out->plain_bps, &msgs);
        if (rc == TDP_OK)
            tdp_bm_spread(out->plain_bps, TP_REPEATS, &out->plain_min, &out->plain_median,
                          &out->plain_max);
    }
    if (cfg->progress)
        fprintf(stderr, "\r%60s\r", "");
out:
    tdp_td_unref(td);
    tdp_schema_unref(s);
    return rc;
}

/* Did any size run on loaned slots (its throughput a hand-off rate)? */
static bool any_loaned(const size_result *r, int n)
{
    for (int i = 0; i < n; i++)
        if (r[i].loaned)
            return true;
    return false;
}

static void print_table(const bench_cfg *cfg, const size_result *r, int n, FILE *f)
{
    char sz[32], tp[32], lo[32], hi[32], pl[32];
    bool loaned = any_loaned(r, n);
    /* the range column is padded only when the plain-send column follows it */
    int rw = loaned ? 32 : 0;
    fprintf(f, "%-10s %12s %12s %11s %11s %11s %11s %12s %-*s%s\n", "size", "bytes", "first send",
            "lat mean", "lat p50", "lat p99", "lat p99.9", loaned ? "hand-off" : "throughput", rw,
            "(min..max of 3)", loaned ? " plain send" : "");
    for (int i = 0; i < n; i++) {
        tdp_cli_format_size(r[i].bytes, sz, sizeof(sz));
        tdp_cli_format_rate(r[i].tp_median, tp, sizeof(tp));
        tdp_cli_format_rate(r[i].tp_min, lo, sizeof(lo));
        tdp_cli_format_rate(r[i].tp_max, hi, sizeof(hi));
        char range[80];
        snprintf(range, sizeof(range), "(%s..%s)", lo, hi);
        if (r[i].loaned)
            tdp_cli_format_rate(r[i].plain_median, pl, sizeof(pl));
        fprintf(f,
                "%-10s %12" PRIu64 " %9.1f us %8.2f us %8.2f us %8.2f us %8.2f us %12s %-*s%s%s\n",
                sz, r[i].bytes, r[i].first_us, r[i].lat_mean, r[i].lat_p50, r[i].lat_p99,
                r[i].lat_p999, tp, rw, range, r[i].loaned ? " " : "", r[i].loaned ? pl : "");
    }
    if (loaned)
        fprintf(f, "hand-off: messages x size per second with loaned slots, where the receiver "
                   "reads the sender's pages and no byte is copied (not a data rate); plain send: "
                   "the data rate of the same messages sent from their own buffer (one copy)\n");
}

/* False (and a message) when the file could not be written. */
static bool write_json(const bench_cfg *cfg, const char *plane, const size_result *r, int n,
                       const server_info *srv, const char *path)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        tdp_cli_error("bench", "cannot write %s: %s", path, strerror(errno));
        return false;
    }
    char date[64];
    time_t t = time(NULL);
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
    const char *tls = getenv("UCX_TLS");
    char mem[TDP_DEVICE_STRLEN];
    bool gpu = cfg->mem.type == TDP_DEVICE_CUDA;
    bool loaned = !cfg->no_loan && strcmp(plane, gpu ? "cuda-ipc" : "shm") == 0;
    char huge[128]; /* fixed words and a number: nothing to escape */
    fprintf(f,
            "{\n  \"tool\": \"tdpipe bench\",\n  \"version\": \"%s\",\n  \"date\": \"%s\",\n"
            "  \"mode\": \"%s\",\n"
            "  \"ucx\": {\"version\": \"%s\", \"tls\": \"%s\"},\n"
            "  \"huge_pages\": \"%s\",\n"
            "  \"config\": {\"depth\": %u, \"window\": %llu, \"busy_poll_us\": %u, "
            "\"peer_mode\": \"%s\", "
            "\"plane\": \"%s\", \"loan\": %s, \"mem\": \"%s\", \"checksum\": %s, "
            "\"inflight\": %u, \"cpus\": %ld},\n",
            tdp_version_string(), date, cfg->client_of != NULL ? "client" : "loopback",
            ucp_get_version_string(), tls ? tls : "default",
            tdp_mem_huge_describe(huge, sizeof(huge)), cfg->depth, (unsigned long long)cfg->window,
            cfg->busy_poll_us,
            cfg->peer_mode == TDP_PEER_UCX      ? "ucx"
            : cfg->peer_mode == TDP_PEER_SOCKET ? "socket"
                                                : "auto",
            plane, loaned ? "true" : "false", tdp_device_format(cfg->mem, mem),
            cfg->checksum ? "true" : "false", cfg->inflight, sysconf(_SC_NPROCESSORS_ONLN));
    if (cfg->client_of != NULL) {
        /* the peer as given on the command line: a host name or literal, ':' and a port;
         * null when it is not UTF-8 (jansson takes nothing else) */
        json_t *js = json_string(cfg->client_of);
        char *peer = js != NULL ? json_dumps(js, JSON_ENCODE_ANY | JSON_ENSURE_ASCII) : NULL;
        json_decref(js);
        fprintf(f,
                "  \"peer\": %s,\n  \"server\": {\"depth\": %" PRId64 ", \"busy_poll_us\": %" PRId64
                "},\n",
                peer != NULL ? peer : "null", srv->depth, srv->busy_poll_us);
        free(peer);
    }
    fprintf(f, "  \"results\": [\n");
    for (int i = 0; i < n; i++) {
        fprintf(f,
                "    {\"bytes\": %" PRIu64 ", \"first_send_us\": %.2f, \"prepare_us\": %.2f,\n"
                "     \"latency_us\": {\"mean\": %.3f, \"p50\": %.3f, \"p99\": %.3f, "
                "\"p999\": %.3f, \"min\": %.3f, \"n\": %d},\n"
                "     \"throughput_is\": \"%s\",\n"
                "     \"throughput_Bps\": {\"median\": %.0f, \"min\": %.0f, \"max\": %.0f, "
                "\"repeats\": %d, \"msgs_per_repeat\": %" PRIu64 "}",
                r[i].bytes, r[i].first_us, r[i].prepare_us, r[i].lat_mean, r[i].lat_p50,
                r[i].lat_p99, r[i].lat_p999, r[i].lat_min, r[i].lat_n,
                r[i].loaned ? "handoff" : "data", r[i].tp_median, r[i].tp_min, r[i].tp_max,
                TP_REPEATS, r[i].tp_msgs);
        if (r[i].loaned)
            fprintf(f,
                    ",\n     \"plain_send_Bps\": {\"median\": %.0f, \"min\": %.0f, \"max\": "
                    "%.0f, \"repeats\": %d}",
                    r[i].plain_median, r[i].plain_min, r[i].plain_max, TP_REPEATS);
        fprintf(f, "}%s\n", i + 1 < n ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    bool ok = !ferror(f);
    if (fclose(f) != 0 || !ok) {
        tdp_cli_error("bench", "cannot write %s: %s", path, strerror(errno));
        return false;
    }
    return true;
}

/* ---- --plot and --json: checked before, written after ------------------------- */

/* The gnuplot terminal for a plot file, from its extension; NULL for others. */
static const char *plot_terminal(const char *path)
{
    const char *dot = strrchr(path, '.');
    if (dot != NULL && strcasecmp(dot, ".png") == 0)
        return "pngcairo size 1100,450 font ',10'";
    if (dot != NULL && strcasecmp(dot, ".svg") == 0)
        return "svg size 1100,450 font ',10' dynamic";
    return NULL;
}

/* Is an executable `name` in PATH? */
static bool in_path(const char *name)
{
    const char *path = getenv("PATH");
    char buf[4096];
    while (path != NULL && *path != '\0') {
        const char *end = strchr(path, ':');
        size_t len = end != NULL ? (size_t)(end - path) : strlen(path);
        if (len > 0 && len + strlen(name) + 2 <= sizeof(buf)) {
            snprintf(buf, sizeof(buf), "%.*s/%s", (int)len, path, name);
            if (access(buf, X_OK) == 0)
                return true;
        }
        path = end != NULL ? end + 1 : NULL;
    }
    return false;
}

/*
 * Before a long run: can path be written (its folder exists and is ours
 * to write)? The file itself is not created yet. False with a message.
 */
static bool can_write(const char *opt, const char *path)
{
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (slash == NULL)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == path)
        snprintf(dir, sizeof(dir), "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    if (slash != NULL && slash[1] == '\0') {
        tdp_cli_error("bench", "%s %s: a file name is needed, not a folder", opt, path);
        return false;
    }
    if (access(dir, W_OK | X_OK) != 0) {
        tdp_cli_error("bench", "%s %s: cannot write in %s: %s", opt, path, dir, strerror(errno));
        return false;
    }
    return true;
}

/* The checks of --json and --plot that need no benchmark; false with a message. */
static bool outputs_ok(const bench_cfg *cfg)
{
    if (cfg->json_path != NULL && !can_write("--json", cfg->json_path))
        return false;
    if (cfg->plot_path == NULL)
        return true;
    if (!can_write("--plot", cfg->plot_path))
        return false;
    if (!in_path("gnuplot")) {
        tdp_cli_error("bench", "--plot needs gnuplot, which is not in PATH (Debian: gnuplot)");
        return false;
    }
    return true;
}

/* Print what gnuplot said (its stderr, kept in fd), indented. */
static void show_log(int fd)
{
    char line[512];
    FILE *f = fdopen(fd, "r");
    if (f == NULL)
        return;
    rewind(f);
    for (int n = 0; n < 20 && fgets(line, sizeof(line), f) != NULL; n++)
        fprintf(stderr, "  gnuplot: %s", line);
    fclose(f);
}

/*
 * Draw latency and throughput against size with gnuplot into path (PNG or
 * SVG, from the extension). gnuplot writes to its stdout, which is the file
 * opened here: no output of gnuplot's can reach our stdout, and a file
 * that cannot be written is reported with the real cause. False with a
 * message (and no half-written file) on failure.
 */
static bool write_plot(const bench_cfg *cfg, const size_result *r, int n, const char *path)
{
    char dat[] = "/tmp/tdpipe-bench-XXXXXX", log[] = "/tmp/tdpipe-gnuplot-XXXXXX";
    const char *term = plot_terminal(path);
    int status = -1, to_gp[2] = {-1, -1};
    bool ok = false;

    int out = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) {
        tdp_cli_error("bench", "cannot write %s: %s", path, strerror(errno));
        return false;
    }
    int dfd = mkstemp(dat), lfd = mkstemp(log);
    FILE *f = dfd >= 0 ? fdopen(dfd, "w") : NULL;
    if (f == NULL || lfd < 0 || pipe(to_gp) != 0) {
        tdp_cli_error("bench", "--plot: cannot make scratch files: %s", strerror(errno));
        goto out;
    }
    for (int i = 0; i < n; i++)
        fprintf(f, "%" PRIu64 " %.3f %.3f %.3f %.3f\n", r[i].bytes, r[i].lat_p50, r[i].lat_p99,
                r[i].tp_median / 1e9, r[i].loaned ? r[i].plain_median / 1e9 : r[i].tp_median / 1e9);
    fclose(f);
    f = NULL;
    dfd = -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(to_gp[0], STDIN_FILENO);
        dup2(out, STDOUT_FILENO);
        dup2(lfd, STDERR_FILENO);
        close(to_gp[1]);
        execlp("gnuplot", "gnuplot", (char *)NULL);
        fprintf(stderr, "cannot run gnuplot: %s\n", strerror(errno));
        _exit(127);
    }
    close(to_gp[0]);
    to_gp[0] = -1;
    if (pid < 0) {
        tdp_cli_error("bench", "--plot: cannot start gnuplot: %s", strerror(errno));
        goto out;
    }
    /* the peer in the title; nothing in it may end gnuplot's quoted string */
    char title[TDP_CLI_HOST_LEN + 16] = "loopback";
    if (cfg->client_of != NULL) {
        snprintf(title, sizeof(title), "client of %s", cfg->client_of);
        for (char *c = title; *c != '\0'; c++)
            if (*c == '\'' || *c == '\\' || (unsigned char)*c < 0x20)
                *c = '?';
    }
    FILE *g = fdopen(to_gp[1], "w");
    bool loaned = any_loaned(r, n);
    if (g != NULL && loaned) {
        /* the hand-off rate of loaned slots is no data rate: say so, and draw the data rate */
        fprintf(g,
                "set terminal %s\n"
                "set multiplot layout 1,2 title 'tdpipe bench (%s)'\n"
                "set logscale xy\nset xlabel 'message size (bytes)'\nset grid\n"
                "set ylabel 'one-way latency (us)'\n"
                "plot '%s' using 1:2 with linespoints title 'p50', '' using 1:3 with "
                "linespoints title 'p99'\n"
                "set ylabel 'GB/s, median of 3'\n"
                "plot '%s' using 1:5 with linespoints title 'plain send (data rate, one copy)', "
                "'' using 1:4 with linespoints title 'hand-off rate, loaned slots (no copy: not "
                "a data rate)'\nunset multiplot\n",
                term, title, dat, dat);
        fclose(g);
    } else if (g != NULL) {
        fprintf(g,
                "set terminal %s\n"
                "set multiplot layout 1,2 title 'tdpipe bench (%s)'\n"
                "set logscale xy\nset xlabel 'message size (bytes)'\nset grid\n"
                "set ylabel 'one-way latency (us)'\n"
                "plot '%s' using 1:2 with linespoints title 'p50', '' using 1:3 with "
                "linespoints title 'p99'\n"
                "unset logscale y\nset ylabel 'throughput (GB/s)'\n"
                "plot '%s' using 1:4 with linespoints title 'median of 3'\nunset multiplot\n",
                term, title, dat, dat);
        fclose(g); /* gnuplot ends at the end of its input */
    } else {
        close(to_gp[1]);
    }
    to_gp[1] = -1;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok) {
        tdp_cli_error("bench", "gnuplot failed (%s %d); no plot written:",
                      WIFEXITED(status) ? "exit status" : "signal",
                      WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        show_log(lfd);
        lfd = -1; /* closed by show_log */
    }
out:
    if (!ok)
        unlink(path);
    close(out);
    if (f != NULL)
        fclose(f);
    else if (dfd >= 0)
        close(dfd);
    if (lfd >= 0)
        close(lfd);
    for (int i = 0; i < 2; i++)
        if (to_gp[i] >= 0)
            close(to_gp[i]);
    unlink(dat);
    unlink(log);
    return ok;
}

static pid_t spawn_consumer(const bench_cfg *cfg, uint16_t port)
{
    char hp[64], depth[16], poll[16], mem[TDP_DEVICE_STRLEN], win[24];
    bool gpu = cfg->mem.type == TDP_DEVICE_CUDA;
    snprintf(hp, sizeof(hp), "127.0.0.1:%u", port);
    tdp_device_format(cfg->mem, mem);
    snprintf(depth, sizeof(depth), "%u", cfg->depth);
    snprintf(win, sizeof(win), "%llu", (unsigned long long)cfg->window);
    snprintf(poll, sizeof(poll), "%u", cfg->busy_poll_us);
    const char *mode = cfg->peer_mode == TDP_PEER_UCX      ? "ucx"
                       : cfg->peer_mode == TDP_PEER_SOCKET ? "socket"
                                                           : "auto";
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        tdp_cli_ucx_log_env();
        execl("/proc/self/exe", "tdpipe", "bench", "--role=consumer", "--connect", hp, "--depth",
              depth, "--window", win, "--busy-poll", poll, "--peer-mode", mode, "--plane",
              tdp_plane_name(cfg->plane), cfg->no_loan ? "--no-loan" : "--quiet",
              cfg->checksum ? "--checksum" : "--quiet",
              /* the consumer's pipe names the GPU too (cuda-ipc is offered then) */
              gpu ? "--mem" : "--quiet", gpu ? mem : "--quiet", (char *)NULL);
        _exit(127);
    }
    return pid;
}

/*
 * SETUP (which settles the acknowledgement's schema before anything is
 * timed, and tells the consumer this side's settings), then each size.
 * Returns the first error; *done says how many sizes were measured.
 */
static tdp_err measure_all(bench_cfg *cfg, tdp_pipe *p, size_result *res, int *done,
                           server_info *srv)
{
    tdp_schema *ss = bench_schema(128);
    tdp_td *std_, *got;
    tdp_err rc = ss ? tdp_td_new(ss, &std_) : TDP_ENOMEM;
    *done = 0;
    tdp_pipe_stats pst;
    tdp_pipe_stats_get(p, &pst);
    if (cfg->checksum && !pst.checksum)
        fprintf(stderr, "tdpipe bench: the peer does not offer the payload checksum: "
                        "measuring without it\n");
    cfg->checksum = pst.checksum; /* what the figures are for */
    if (rc == TDP_OK) {
        int64_t *h = hdr_of(std_);
        h[0] = PH_SETUP;
        h[1] = cfg->no_loan ? SETUP_NO_LOAN : 0;
        h[2] = (int64_t)cfg->depth;
        h[3] = (int64_t)cfg->busy_poll_us;
        rc = tdp_pipe_send(p, std_, BENCH_TMO);
        if (rc == TDP_OK)
            rc = tdp_pipe_recv(p, SETUP_TMO, &got);
        if (rc == TDP_OK) {
            int64_t a[4] = {0}; /* wherever it landed */
            bool bench_peer = hdr_get(got, on_gpu(got), a) == TDP_OK && a[0] == PH_SETUP &&
                              a[1] == BENCH_MAGIC;
            if (bench_peer) {
                srv->depth = a[2];
                srv->busy_poll_us = a[3];
            }
            tdp_pipe_release(p, got);
            if (!bench_peer) {
                tdp_cli_error("bench", "the peer's answer to SETUP is not a bench server's");
                rc = TDP_EPROTO;
            }
        } else if (rc == TDP_ETIMEDOUT && cfg->client_of != NULL) {
            tdp_cli_error("bench",
                          "no answer to SETUP within %d s: is %s a 'tdpipe bench --server'?",
                          SETUP_TMO / 1000, cfg->client_of);
        }
        tdp_td_unref(std_);
    }
    tdp_schema_unref(ss);
    for (int i = 0; i < cfg->nsizes && rc == TDP_OK; i++) {
        rc = measure_size(cfg, p, cfg->sizes[i], &res[i]);
        if (rc != TDP_OK)
            break;
        ++*done;
        if (!cfg->quiet && cfg->prepare)
            fprintf(stderr, "  prepared in %.1f us (untimed)\n", res[i].prepare_us);
        if (!cfg->quiet) {
            char sz[32], tp[32];
            tdp_cli_format_size(res[i].bytes, sz, sizeof(sz));
            tdp_cli_format_rate(res[i].tp_median, tp, sizeof(tp));
            if (res[i].loaned) {
                char pl[32];
                tdp_cli_format_rate(res[i].plain_median, pl, sizeof(pl));
                fprintf(stderr,
                        "  %-9s first %.1f us, latency p50 %.2f us, hand-off %s (loaned slots, "
                        "no copy), plain send %s\n",
                        sz, res[i].first_us, res[i].lat_p50, tp, pl);
            } else {
                fprintf(stderr, "  %-9s first %.1f us, latency p50 %.2f us, throughput %s\n", sz,
                        res[i].first_us, res[i].lat_p50, tp);
            }
        }
    }
    return rc;
}

/* The table (stdout), --json and --plot for the sizes done; the exit status. */
static int report(const bench_cfg *cfg, const char *plane, bool loaned, const size_result *res,
                  int done, const server_info *srv, int rc_exit)
{
    const char *tls = getenv("UCX_TLS");
    if (done == 0)
        return rc_exit;
    if (cfg->client_of != NULL)
        printf("client of %s: server depth %" PRId64 ", %s\n", cfg->client_of, srv->depth,
               srv->busy_poll_us ? "busy-poll" : "event-driven");
    char mem[TDP_DEVICE_STRLEN];
    char infl[48] = "";
    if (cfg->inflight > 1)
        snprintf(infl, sizeof(infl), ", plain streams %u in flight", cfg->inflight);
    printf("plane %s%s, depth %u, %s, UCX_TLS=%s, mem %s%s%s\n", plane,
           loaned ? " (loaned slots: no copy)" : "", cfg->depth,
           cfg->busy_poll_us ? "busy-poll" : "event-driven", tls ? tls : "default",
           tdp_device_format(cfg->mem, mem), cfg->checksum ? ", checksum" : "", infl);
    print_table(cfg, res, done, stdout);
    if (cfg->json_path != NULL && !write_json(cfg, plane, res, done, srv, cfg->json_path) &&
        rc_exit == TDP_EXIT_OK)
        rc_exit = TDP_EXIT_FAIL;
    if (cfg->plot_path != NULL && !write_plot(cfg, res, done, cfg->plot_path) &&
        rc_exit == TDP_EXIT_OK)
        rc_exit = TDP_EXIT_FAIL;
    return rc_exit;
}

static int run_producer(bench_cfg *cfg)
{
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    tdp_loop_opts lo = {.size = sizeof(lo), .busy_poll_us = cfg->busy_poll_us};
    tdp_pipe_opts po;
    size_result res[MAX_SIZES];
    server_info srv = {0};
    int rc_exit = TDP_EXIT_OK, done = 0;

    tdp_pipe_opts_default(&po);
    po.recv_depth = cfg->depth;
    po.recv_window_bytes = cfg->window;
    po.peer_mode = cfg->peer_mode;
    po.plane = cfg->plane;
    opts_mem(cfg, &po);
    po.checksum = cfg->checksum;
    if (tdp_loop_new(&lo, &loop) != TDP_OK) {
        fprintf(stderr, "tdpipe bench: cannot create the UCX worker\n");
        return TDP_EXIT_FAIL;
    }
    tdp_err lrc = tdp_listener_new(loop, "127.0.0.1", 0, &po, NULL, NULL, &l);
    if (lrc != TDP_OK) {
        tdp_loop_free(loop);
        return tdp_cli_listen_failed("bench", "127.0.0.1", 0, lrc);
    }
    pid_t child = spawn_consumer(cfg, tdp_listener_port(l));
    tdp_err rc = tdp_listener_accept(l, 30000, &p);
    if (rc != TDP_OK) {
        fprintf(stderr, "tdpipe bench: the consumer did not connect: %s%s\n", tdp_strerror(rc),
                cfg->plane != TDP_PLANE_AUTO ? " (is the plane available here?)" : "");
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        tdp_listener_free(l);
        tdp_loop_free(loop);
        return TDP_EXIT_CONNECT;
    }
    const char *tls = getenv("UCX_TLS"), *plane = tdp_cli_plane_of(p);
    bool loaned = !cfg->no_loan && plane_lends(tdp_pipe_plane(p), cfg->mem.type == TDP_DEVICE_CUDA);
    if (!cfg->quiet)
        fprintf(stderr,
                "tdpipe bench: producer pid %d -> consumer pid %d over loopback, UCX %s, "
                "UCX_TLS=%s, plane %s, depth %u, %s\n",
                (int)getpid(), (int)child, ucp_get_version_string(), tls ? tls : "default", plane,
                cfg->depth, cfg->busy_poll_us ? "busy-poll" : "event-driven");
    rc = measure_all(cfg, p, res, &done, &srv);
    if (rc != TDP_OK) {
        fprintf(stderr, "tdpipe bench: failed: %s\n", tdp_strerror(rc));
        rc_exit = tdp_cli_exit_for(rc);
    } else {
        rc = tdp_pipe_close(p, 10000);
    }
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    int st = 0;
    waitpid(child, &st, 0);
    if (rc_exit == TDP_EXIT_OK && (!WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
        fprintf(stderr, "tdpipe bench: the consumer failed (status %d)\n", st);
        rc_exit = TDP_EXIT_FAIL;
    }
    return report(cfg, plane, loaned, res, done, &srv, rc_exit);
}

/*
 * A bench server measures one client at a time and refuses the others at
 * once with TDP_ELIMIT (as a server at its client limit does: exit 3).
 */
static int busy_refusal(const bench_cfg *cfg)
{
    fprintf(stderr,
            "tdpipe bench: busy: a bench is running on %s for another client, try again "
            "later\n",
            cfg->client_of);
    return TDP_EXIT_CONNECT;
}

/* bench --client HOST:PORT: the producer's part against a bench server. */
static int run_client(bench_cfg *cfg)
{
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_loop_opts lo = {.size = sizeof(lo), .busy_poll_us = cfg->busy_poll_us};
    tdp_pipe_opts po;
    size_result res[MAX_SIZES];
    server_info srv = {0};
    int rc_exit = TDP_EXIT_OK, done = 0;
    tdp_err rc;

    tdp_pipe_opts_default(&po);
    po.recv_depth = cfg->depth;
    po.recv_window_bytes = cfg->window;
    po.want_peer_depth = cfg->depth; /* the server receives as the loopback consumer would */
    po.peer_mode = cfg->peer_mode;
    po.plane = cfg->plane;
    opts_mem(cfg, &po);
    po.checksum = cfg->checksum;
    if ((rc = tdp_loop_new(&lo, &loop)) != TDP_OK) {
        tdp_cli_error("bench", "cannot create the event loop: %s", tdp_strerror(rc));
        return TDP_EXIT_FAIL;
    }
    rc = tdp_pipe_connect(loop, cfg->peer_host, cfg->peer_port, &po, &p);
    if (rc != TDP_OK) {
        tdp_loop_free(loop);
        if (rc == TDP_ELIMIT)
            return busy_refusal(cfg);
        return tdp_cli_connect_failed("bench", cfg->peer_host, cfg->peer_port, rc, cfg->plane);
    }
    const char *tls = getenv("UCX_TLS"), *plane = tdp_cli_plane_of(p);
    bool loaned = !cfg->no_loan && plane_lends(tdp_pipe_plane(p), cfg->mem.type == TDP_DEVICE_CUDA);
    if (!cfg->quiet)
        fprintf(stderr,
                "tdpipe bench: client -> server %s, UCX %s, UCX_TLS=%s, plane %s, "
                "depth %u, %s\n",
                cfg->client_of, ucp_get_version_string(), tls ? tls : "default", plane, cfg->depth,
                cfg->busy_poll_us ? "busy-poll" : "event-driven");
    rc = measure_all(cfg, p, res, &done, &srv);
    if (rc == TDP_ECLOSED) {
        fprintf(stderr, "tdpipe bench: the server closed the pipe mid-run (stopped?)\n");
        rc_exit = TDP_EXIT_PEER;
    } else if (rc == TDP_ELIMIT && done == 0) {
        rc_exit = busy_refusal(cfg); /* another client's handshake was a moment ahead */
    } else if (rc != TDP_OK) {
        fprintf(stderr, "tdpipe bench: failed: %s\n", tdp_cli_strerror(rc));
        rc_exit = tdp_cli_exit_for(rc);
    } else if ((rc = tdp_pipe_close(p, 10000)) != TDP_OK) {
        fprintf(stderr, "tdpipe bench: close: %s\n", tdp_cli_strerror(rc));
    }
    tdp_pipe_free(p);
    tdp_loop_free(loop);
    if (!cfg->quiet && done > 0 && srv.depth != (int64_t)cfg->depth)
        fprintf(stderr,
                "tdpipe bench: note: the server receives with depth %" PRId64
                " (its own --depth: an older server?), this side with %u\n",
                srv.depth, cfg->depth);
    if (!cfg->quiet && done > 0 && srv.busy_poll_us != (int64_t)cfg->busy_poll_us)
        fprintf(stderr,
                "tdpipe bench: note: the server polls with its own --busy-poll (%" PRId64
                " us), this side with %u us\n",
                srv.busy_poll_us, cfg->busy_poll_us);
    return report(cfg, plane, loaned, res, done, &srv, rc_exit);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tdpipe bench [options]\n"
            "\n"
            "Producer and consumer on loopback (this process and a child it starts):\n"
            "first-send time, one-way latency (half a ping-pong: mean, p50, p99, p99.9)\n"
            "and throughput (timed on the receiver, 3 repeats) for each payload size.\n"
            "\n"
            "  --sizes LIST       payload sizes, comma-separated (default 1KB,1MB,100MB;\n"
            "                     K/KB, M/MB, G/GB = 1000^n, Ki/KiB, Mi/MiB, Gi/GiB = 1024^n;\n"
            "                     128 B .. 64 GiB, rounded up to a multiple of 4)\n"
            "  --rounds N         ping-pongs and messages per repeat (default: scaled by size;\n"
            "                     below 20 the figures are mostly noise, and a warning says so)\n"
            "  --depth N          receive buffers on each side (default 4)\n"
            "  --window SIZE      receive window of each side for small messages (default\n"
            "                     256KiB; 0: depth alone bounds what is in flight)\n"
            "  --tls LIST         UCX transports (sets UCX_TLS, e.g. tcp or shm,self)\n"
            "  --busy-poll US     busy-poll window of both loops (default 0: event-driven)\n"
            "  --peer-mode MODE   auto, ucx or socket (see docs/pipe.md)\n"
            "  --plane NAME       data plane (default auto: the HELLO picks one);\n"
            "                     'tdpipe version' lists the names\n"
            "  --no-loan          on the shm plane (host buffers) and the cuda-ipc plane\n"
            "                     (GPU buffers), send plain buffers (one copy into a\n"
            "                     slot) instead of loaned slots (no copy: the default)\n"
            "  --prepare          tdp_pipe_prepare each size's layout before its first\n"
            "                     send (untimed): the first-send column then shows a\n"
            "                     prepared first send\n"
            "  --checksum         both sides offer the payload checksum (XXH3-64 of every\n"
            "                     message, computed by the sender, checked by the receiver)\n"
            "  --inflight N       throughput of plain sends as N async sends in flight\n"
            "                     (own buffers each, 64 MiB of them at most;\n"
            "                     tdp_op_wait for the oldest), as a stream of small\n"
            "                     messages is best sent (default 1: blocking sends;\n"
            "                     loaned sends stay blocking)\n"
            "  --mem cpu|cuda[:N] where the buffers live (default cpu): cuda sends from and\n"
            "                     receives into GPU memory (the receiver follows); needs a\n"
            "                     build with CUDA and a device, else exit 2\n"
            "  --json FILE        write the results as JSON (format: docs/benchmarks.md)\n"
            "  --plot FILE        draw latency and throughput against size (needs gnuplot);\n"
            "                     FILE.png or FILE.svg: the format comes from the name\n"
            "  --clients N        instead: N producers streaming to one server at once\n"
            "                     against one producer alone (first --sizes entry,\n"
            "                     default 1MB; --rounds = messages in all, default ~4 GiB)\n"
            "  --fanin N          instead: N producers into one fan-in (tdp_fanin) at once\n"
            "                     against one producer alone, as --clients\n"
            "  --fanin-baseline PROG\n"
            "                     with --fanin: also the same N producers each on its own\n"
            "                     pipe, drained by PROG (bench/fanin_poll.c: a hand-written\n"
            "                     poll loop)\n"
            "  --fanin-procs      with --fanin: each producer a process of its own (as a\n"
            "                     data loader's workers), not a pipe of this process\n"
            "  --fanout N         instead: one producer broadcasting to N consumers (pipes\n"
            "                     of this process) through a fan-out (tdp_fanout), loaned\n"
            "                     slots and plain buffers (--no-loan: plain only), for\n"
            "                     each --sizes entry: throughput per consumer, one-way p50\n"
            "                     to the last consumer, shared memory and RSS\n"
            "  --quiet            no progress on stderr\n"
            "\n"
            "Across two hosts (as iperf3 -s / -c), the same figures:\n"
            "  --server           be the consumer for one client after another, with the\n"
            "                     depth each asks for (--depth: for clients that ask for\n"
            "                     none); a client that comes while another is measured is\n"
            "                     refused at once (it says 'busy', exit 3); the first line\n"
            "                     on stdout is 'listening on HOST:PORT'; ends on\n"
            "                     SIGINT/SIGTERM (130/143). Takes --bind, --port, --once,\n"
            "                     --depth, --busy-poll, --tls, --peer-mode, --plane\n"
            "  --bind HOST        address to listen on (default: all IPv4 and IPv6)\n"
            "  --port PORT        port (default 0: any free port, printed)\n"
            "  --once             serve one client, then exit with its outcome\n"
            "  --client HOST:PORT run the measurements against a 'bench --server' there;\n"
            "                     --sizes, --rounds, --depth, --mem, --plane, --no-loan, --json,\n"
            "                     --plot are the client's (the server polls with its own\n"
            "                     --busy-poll)\n"
            "  -v, --verbose      more log (as before the subcommand: -v, -vv, -vvv)\n"
            "  -h, --help         this text\n"
            "\n"
            "UCX is kept on the loopback device (UCX_NET_DEVICES=lo) unless already set,\n"
            "or unless --server/--client name an address that is not a loopback one.\n");
}

/* An unsigned option value in [min, max]; false (and a message) otherwise. */
static bool parse_num(const char *opt, const char *val, uint64_t min, uint64_t max, uint64_t *out)
{
    if (tdp_cli_parse_u64(val, min, max, out))
        return true;
    tdp_cli_usage_error("bench", "%s must be %" PRIu64 "..%" PRIu64 ", not '%s'", opt, min, max,
                        val);
    return false;
}

/*
 * Which options go with --server and --client: the client chooses what is
 * measured (sizes, rounds, plane, loans) and keeps the figures (--json,
 * --plot); the server only how it listens and receives.
 */
static int check_modes(const bench_cfg *cfg)
{
    if (cfg->serve && cfg->client_of != NULL)
        return tdp_cli_usage_error("bench", "--server and --client exclude each other");
    if (!cfg->serve && (cfg->bind_given || cfg->port_given || cfg->once))
        return tdp_cli_usage_error("bench", "--%s goes with --server",
                                   cfg->bind_given   ? "bind"
                                   : cfg->port_given ? "port"
                                                     : "once");
    if (cfg->clients > 0 && cfg->mem_given)
        return tdp_cli_usage_error("bench", "--mem does not go with --clients (host buffers only)");
    if (cfg->clients > 0 && (cfg->serve || cfg->client_of != NULL))
        return tdp_cli_usage_error("bench",
                                   "--clients starts its own server and clients on loopback; "
                                   "it does not go with --%s",
                                   cfg->serve ? "server" : "client");
    if ((cfg->fanin_baseline != NULL || cfg->fanin_procs) && cfg->fanin == 0 && cfg->fanout == 0)
        return tdp_cli_usage_error("bench", "--%s goes with --fanin N",
                                   cfg->fanin_procs ? "fanin-procs" : "fanin-baseline");
    if (cfg->fanout > 0) {
        const char *other = cfg->clients > 0         ? "--clients"
                            : cfg->fanin > 0         ? "--fanin"
                            : cfg->fanin_baseline    ? "--fanin-baseline"
                            : cfg->fanin_procs       ? "--fanin-procs"
                            : cfg->serve             ? "--server"
                            : cfg->client_of != NULL ? "--client"
                            : cfg->mem_given         ? "--mem"
                            : cfg->plot_path != NULL ? "--plot"
                            : cfg->prepare           ? "--prepare"
                            : cfg->checksum          ? "--checksum"
                                                     : NULL;
        if (other != NULL)
            return tdp_cli_usage_error("bench",
                                       "--fanout runs its own producer and consumers on this "
                                       "host with host buffers; it does not go with %s",
                                       other);
    }
    if (!cfg->serve)
        return TDP_EXIT_OK;
    const char *opt = cfg->sizes_given  ? "--sizes"
                      : cfg->mem_given  ? "--mem"
                      : cfg->rounds > 0 ? "--rounds"
                      : cfg->no_loan    ? "--no-loan"
                      : cfg->prepare    ? "--prepare"
                      : cfg->json_path  ? "--json"
                      : cfg->plot_path  ? "--plot"
                                        : NULL;
    if (opt != NULL)
        return tdp_cli_usage_error("bench",
                                   "%s is the client's to give: the server measures what the "
                                   "client asks and the client keeps the figures",
                                   opt);
    return TDP_EXIT_OK;
}

/* Returns TDP_EXIT_OK to go on, -1 after --help, else the exit status. */
static int parse_args(int argc, char **argv, bench_cfg *cfg)
{
    static const struct option opts[] = {
        {"sizes", required_argument, NULL, 's'},
        {"rounds", required_argument, NULL, 'r'},
        {"depth", required_argument, NULL, 'd'},
        {"window", required_argument, NULL, 'w'},
        {"tls", required_argument, NULL, 't'},
        {"busy-poll", required_argument, NULL, 'b'},
        {"peer-mode", required_argument, NULL, 'm'},
        {"json", required_argument, NULL, 'j'},
        {"plot", required_argument, NULL, 'p'},
        {"quiet", no_argument, NULL, 'q'},
        {"help", no_argument, NULL, 'h'},
        {"role", required_argument, NULL, 'R'},
        {"connect", required_argument, NULL, 'c'},
        {"clients", required_argument, NULL, 'C'},
        {"fanin", required_argument, NULL, 'F'},
        {"fanin-baseline", required_argument, NULL, 'G'},
        {"fanin-procs", no_argument, NULL, 'N'},
        {"fanout", required_argument, NULL, 'T'},
        {"plane", required_argument, NULL, 'P'},
        {"verbose", no_argument, NULL, 'v'},
        {"no-loan", no_argument, NULL, 'L'},
        {"prepare", no_argument, NULL, 'W'},
        {"server", no_argument, NULL, 'S'},
        {"client", required_argument, NULL, 'K'},
        {"bind", required_argument, NULL, 'B'},
        {"port", required_argument, NULL, 'O'},
        {"once", no_argument, NULL, 'o'},
        {"mem", required_argument, NULL, 'M'},
        {"checksum", no_argument, NULL, 'X'},
        {"inflight", required_argument, NULL, 'I'},
        {NULL, 0, NULL, 0},
    };
    char why[160];
    uint64_t v;
    int c;

    tdp_cli_getopt_reset();
    while ((c = getopt_long(argc, argv, ":vh", opts, NULL)) != -1) {
        switch (c) {
        case 'L':
            cfg->no_loan = true;
            break;
        case 'W':
            cfg->prepare = true;
            break;
        case 'X':
            cfg->checksum = true;
            break;
        case 'I':
            if (!parse_num("--inflight", optarg, 1, 64, &v))
                return TDP_EXIT_USAGE;
            cfg->inflight = (uint32_t)v;
            break;
        case 'S':
            cfg->serve = true;
            break;
        case 'K':
            if (!tdp_cli_parse_hostport(optarg, false, cfg->peer_host, sizeof(cfg->peer_host),
                                        &cfg->peer_port))
                return tdp_cli_usage_error("bench",
                                           "--client wants HOST:PORT (an IPv6 literal in "
                                           "brackets: [::1]:5000), not '%s'",
                                           optarg);
            cfg->client_of = optarg;
            break;
        case 'B':
            cfg->bind = optarg;
            cfg->bind_given = true;
            break;
        case 'O':
            if (!tdp_cli_parse_port(optarg, true, &cfg->port))
                return tdp_cli_usage_error("bench", "--port must be 0..65535, not '%s'", optarg);
            cfg->port_given = true;
            break;
        case 'o':
            cfg->once = true;
            break;
        case 'M':
            if (strcmp(optarg, "cpu") != 0 && strncmp(optarg, "cuda", 4) != 0)
                return tdp_cli_usage_error("bench", "--mem is cpu or cuda[:N], not '%s'", optarg);
            if (tdp_device_parse(optarg, &cfg->mem) != TDP_OK)
                return tdp_cli_usage_error("bench", "--mem is cpu or cuda[:N], not '%s'", optarg);
            cfg->mem_given = true;
            break;
        case 'C':
            if (!parse_num("--clients", optarg, 1, 1024, &v))
                return TDP_EXIT_USAGE;
            cfg->clients = (int)v;
            break;
        case 'F':
            if (!parse_num("--fanin", optarg, 1, 1024, &v))
                return TDP_EXIT_USAGE;
            cfg->fanin = (int)v;
            break;
        case 'T':
            if (!parse_num("--fanout", optarg, 1, 64, &v))
                return TDP_EXIT_USAGE;
            cfg->fanout = (int)v;
            break;
        case 'G':
            cfg->fanin_baseline = optarg;
            break;
        case 'N':
            cfg->fanin_procs = true;
            break;
        case 's':
            cfg->sizes_given = true;
            if (!tdp_bm_parse_size_list(optarg, MIN_SIZE, MAX_SIZE, cfg->sizes, MAX_SIZES,
                                        &cfg->nsizes, why, sizeof(why)))
                return tdp_cli_usage_error("bench", "--sizes: %s", why);
            for (int i = 0; i < cfg->nsizes; i++)
                cfg->sizes[i] = tdp_bm_whole_floats(cfg->sizes[i]);
            break;
        case 'r':
            /* one warm-up message and two timed, at the least */
            if (!parse_num("--rounds", optarg, 3, INT32_MAX, &v))
                return TDP_EXIT_USAGE;
            cfg->rounds = (int)v;
            break;
        case 'd':
            if (!parse_num("--depth", optarg, 1, 64, &v))
                return TDP_EXIT_USAGE;
            cfg->depth = (uint32_t)v;
            break;
        case 'w': {
            int ec = tdp_cli_parse_window("bench", optarg, &v);
            if (ec >= 0)
                return ec;
            cfg->window = v;
            break;
        }
        case 't':
            cfg->tls = optarg;
            break;
        case 'b':
            if (!parse_num("--busy-poll", optarg, 0, 10000000, &v))
                return TDP_EXIT_USAGE;
            cfg->busy_poll_us = (uint32_t)v;
            break;
        case 'm':
            if (strcmp(optarg, "auto") == 0)
                cfg->peer_mode = TDP_PEER_AUTO;
            else if (strcmp(optarg, "ucx") == 0)
                cfg->peer_mode = TDP_PEER_UCX;
            else if (strcmp(optarg, "socket") == 0)
                cfg->peer_mode = TDP_PEER_SOCKET;
            else
                return tdp_cli_usage_error("bench", "--peer-mode is auto, ucx or socket, not '%s'",
                                           optarg);
            break;
        case 'P':
            if (!tdp_cli_parse_plane("bench", optarg, &cfg->plane))
                return TDP_EXIT_USAGE;
            break;
        case 'j':
            cfg->json_path = optarg;
            break;
        case 'p':
            if (plot_terminal(optarg) == NULL)
                return tdp_cli_usage_error("bench",
                                           "--plot %s: the file must end in .png or .svg (the "
                                           "format comes from the name)",
                                           optarg);
            cfg->plot_path = optarg;
            break;
        case 'q':
            cfg->quiet = true;
            break;
        case 'R':
            cfg->consumer = strcmp(optarg, "consumer") == 0;
            cfg->server = strcmp(optarg, "server") == 0;
            cfg->fanin_role = strcmp(optarg, "fanin") == 0;
            break;
        case 'c':
            cfg->connect = optarg;
            break;
        case 'v':
            tdp_cli_more_verbose();
            break;
        case 'h':
            usage(stdout);
            return -1;
        default:
            return tdp_cli_bad_option("bench", argv, c);
        }
    }
    if (optind < argc)
        return tdp_cli_usage_error("bench", "unexpected argument '%s'", argv[optind]);
    if (cfg->consumer && cfg->connect == NULL)
        return TDP_EXIT_USAGE;
    return check_modes(cfg);
}

/*
 * --rounds small enough that the figures say little: a throughput repeat
 * that times fewer than MIN_TIMED messages, or fewer latency samples.
 */
#define MIN_TIMED 10

/*
 * A receive window lets up to 64 small messages be in flight at once (the
 * depth, at least): a throughput repeat that times only a few times that
 * many may time a queue the receiver drains, not the stream. Measured at
 * 1 KB: 20 and 50 rounds gave anywhere from 0.1 to 9 GB/s, 2000 rounds
 * 1.0-1.2.
 */
#define MIN_TIMED_PER_INFLIGHT 4

static void warn_rounds_inflight(const bench_cfg *cfg, int timed)
{
    for (int i = 0; i < cfg->nsizes; i++) {
        uint64_t size = cfg->sizes[i] ? cfg->sizes[i] : 1;
        uint64_t w = cfg->window / size;
        uint64_t most = w > 64 ? 64 : w;
        if (most < cfg->depth)
            most = cfg->depth;
        if ((uint64_t)timed >= MIN_TIMED_PER_INFLIGHT * most)
            continue;
        char buf[32];
        fprintf(stderr,
                "tdpipe bench: warning: --rounds %d times %d messages per throughput repeat at "
                "%s, where up to %llu may be in flight: the rate may be that of a queue "
                "draining; use --rounds %llu or more\n",
                cfg->rounds, timed, tdp_cli_format_size(size, buf, sizeof(buf)),
                (unsigned long long)most,
                (unsigned long long)(MIN_TIMED_PER_INFLIGHT * most * 10 / 9 + 2));
        return;
    }
}

static void warn_rounds(const bench_cfg *cfg)
{
    if (cfg->rounds <= 0 || cfg->consumer || cfg->server || cfg->fanout > 0)
        return;
    if (cfg->clients > 0) {
        if (cfg->rounds < 10 * cfg->clients)
            fprintf(stderr,
                    "tdpipe bench: warning: --rounds %d is raised to %d (10 messages per "
                    "client)\n",
                    cfg->rounds, 10 * cfg->clients);
        return;
    }
    int timed = cfg->rounds - 1 - tdp_bm_tp_warm(cfg->rounds);
    if (timed < MIN_TIMED)
        fprintf(stderr,
                "tdpipe bench: warning: --rounds %d times %d message%s per throughput repeat "
                "and %d latency round trips: the figures are mostly noise (p99 is the maximum "
                "below 100); use 20 or more\n",
                cfg->rounds, timed, timed == 1 ? "" : "s", cfg->rounds);
    else
        warn_rounds_inflight(cfg, timed);
}

/* A loopback address (127.0.0.0/8, ::1, localhost); NULL (every address) is not. */
static bool is_loopback(const char *host)
{
    return host != NULL && (strncmp(host, "127.", 4) == 0 || strcmp(host, "::1") == 0 ||
                            strcasecmp(host, "localhost") == 0);
}

int tdp_cmd_bench(int argc, char **argv)
{
    bench_cfg cfg = {
        .sizes = {1000, 1000 * 1000, 100 * 1000 * 1000}, /* 1 KB, 1 MB, 100 MB */
        .nsizes = 3,
        .depth = TDP_CLI_DEFAULT_DEPTH,
        .window = TDP_BENCH_WINDOW,
        .inflight = 1,
        .peer_mode = TDP_PEER_AUTO,
    };
    int rc = parse_args(argc, argv, &cfg);
    if (rc != TDP_EXIT_OK)
        return rc < 0 ? TDP_EXIT_OK : rc;
    const char *ph = getenv("TDPIPE_BENCH_PHASES");
    steps.on = ph != NULL && *ph != '\0' && strcmp(ph, "0") != 0;
    warn_rounds(&cfg);
    if (!cfg.consumer && !cfg.server && (rc = check_mem(&cfg)) != TDP_EXIT_OK)
        return rc; /* before any process or socket */
    if (!cfg.consumer && !cfg.server && !cfg.serve && !outputs_ok(&cfg))
        return TDP_EXIT_FAIL; /* before a run that may take minutes */
    /*
     * A loopback benchmark: keep UCX's TCP transport off the other
     * interfaces. Across hosts UCX picks its devices itself (UCX_NET_DEVICES
     * chooses), unless the address is a loopback one.
     */
    bool across = (cfg.serve && !is_loopback(cfg.bind)) ||
                  (cfg.client_of != NULL && !is_loopback(cfg.peer_host));
    if (!across)
        setenv("UCX_NET_DEVICES", "lo", 0);
    if (cfg.tls != NULL)
        setenv("UCX_TLS", cfg.tls, 1);
    signal(SIGPIPE, SIG_IGN);
    /* live progress redraws one line: only on a terminal */
    cfg.progress = !cfg.quiet && isatty(STDERR_FILENO);
    if (cfg.serve) {
        tdp_cli_catch_signals(); /* before the loop's and UCX's threads exist */
        return run_server(&cfg);
    }
    if (cfg.client_of != NULL)
        return run_client(&cfg);
    if (cfg.server)
        return tdp_bench_clients_server((uint64_t)cfg.rounds, cfg.depth, cfg.plane);
    if (cfg.fanin_role)
        return tdp_bench_fanin_consumer((uint64_t)cfg.rounds, cfg.depth, cfg.plane);
    if (cfg.fanout > 0)
        return tdp_bench_fanout(cfg.fanout, cfg.sizes, cfg.nsizes, cfg.rounds, cfg.depth, cfg.plane,
                                cfg.no_loan, cfg.json_path, cfg.quiet);
    if (cfg.fanin > 0)
        return tdp_bench_fanin(cfg.fanin, cfg.sizes_given ? cfg.sizes[0] : 1000000, cfg.rounds,
                               cfg.depth, cfg.plane, cfg.fanin_procs, cfg.fanin_baseline,
                               cfg.json_path, cfg.quiet);
    if (cfg.clients > 0)
        return tdp_bench_clients(cfg.clients, cfg.sizes_given ? cfg.sizes[0] : 1000000, cfg.rounds,
                                 cfg.depth, cfg.plane, cfg.quiet);
    return cfg.consumer ? run_consumer(&cfg) : run_producer(&cfg);
}
