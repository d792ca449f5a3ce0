/*
 * cmd_net.c: the point-to-point subcommands — `send` (connect and stream
 * synthetic messages, or a file's tensors), `recv` (listen for one
 * producer, receive, verify, dump) and `inspect` (listen for one producer
 * and show what it sends). File formats: datafile.h; values: values.h.
 *
 * All three drive their loop from the calling thread through the blocking
 * pipe calls: one pipe, one thread, nothing to synchronise.
 */
#include <ctype.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "report.h"
#include "send_fanout.h"
#include "send_ring.h"
#include "datafile.h"
#include "recv_fanin.h"
#include "values.h"

/* The longest wait in one blocking call, so an interruption (tdp_cli_interrupted) is seen soon. */
#define SLICE_MS 100
#define SEND_INFLIGHT_MAX TDP_CLI_RING_MAX /* send --inflight: at most this many out at once */

/* Why a command stopped early on a signal, for its summary. */
static const char *signal_name(int sig)
{
    return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
}

/* ---- shared: listening for one producer ---------------------------------- */

typedef struct listen_args {
    const char *bind; /* NULL: all addresses */
    uint16_t port;
    uint32_t depth;
    tdp_plane plane;
    int64_t timeout_ms; /* for the producer to connect; -1 forever */
    tdp_pipe_opts ka;   /* what --keepalive and --secret-file set (tdp_cli_apply_net_opts) */
    bool latency;       /* the pipe keeps latency histograms */
} listen_args;

/*
 * Listen, print "listening on HOST:PORT" (the first line on stdout, which
 * scripts read for the port), accept one producer and stop listening.
 * On success *loop and *pipe are the caller's; on failure nothing is left
 * and the return value is the exit status.
 */
static int accept_one(const char *cmd, const listen_args *a, tdp_loop **loop_out,
                      tdp_pipe **pipe_out)
{
    char peer[80];
    tdp_pipe_opts opts;
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *pipe;
    tdp_err rc;

    tdp_pipe_opts_default(&opts);
    opts.recv_depth = a->depth;
    opts.plane = a->plane;
    opts.latency_stats = a->latency;
    tdp_cli_apply_net_opts(&a->ka, &opts);
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK) {
        tdp_cli_error(cmd, "cannot create the event loop: %s", tdp_strerror(rc));
        return TDP_EXIT_FAIL;
    }
    rc = tdp_listener_new(loop, a->bind, a->port, &opts, NULL, NULL, &l);
    if (rc != TDP_OK) {
        tdp_loop_free(loop);
        return tdp_cli_listen_failed(cmd, a->bind, a->port, rc);
    }
    tdp_cli_print_listening(a->bind, tdp_listener_port(l));
    /* in slices, to see an interruption */
    uint64_t deadline = tdp_cli_now_ns() + (uint64_t)a->timeout_ms * 1000000u;
    do {
        int64_t slice = SLICE_MS;
        if (a->timeout_ms >= 0) {
            uint64_t now = tdp_cli_now_ns();
            slice = now >= deadline ? 0 : (int64_t)((deadline - now) / 1000000u);
            slice = slice > SLICE_MS ? SLICE_MS : slice;
        }
        rc = tdp_listener_accept(l, slice, &pipe);
    } while (rc == TDP_ETIMEDOUT && !tdp_cli_interrupted() &&
             (a->timeout_ms < 0 || tdp_cli_now_ns() < deadline));
    tdp_listener_free(l); /* one producer: later ones are refused */
    if (rc != TDP_OK && tdp_cli_interrupted()) {
        tdp_cli_error(cmd, "interrupted (%s) before a producer connected",
                      signal_name(tdp_cli_interrupted()));
        tdp_loop_free(loop);
        return TDP_EXIT_SIGNAL(tdp_cli_interrupted());
    }
    if (rc != TDP_OK) {
        if (rc == TDP_ETIMEDOUT)
            tdp_cli_error(cmd, "no producer connected within %" PRId64 " ms", a->timeout_ms);
        else
            tdp_cli_error(cmd, "accept: %s", tdp_strerror(rc));
        tdp_loop_free(loop);
        return tdp_cli_exit_for(rc);
    }
    fprintf(stderr, "%s: producer %s connected, plane %s\n", cmd,
            tdp_pipe_peer(pipe, peer, sizeof(peer)), tdp_cli_plane_of(pipe));
    *loop_out = loop;
    *pipe_out = pipe;
    return TDP_EXIT_OK;
}

/*
 * Receive the next message, waiting up to timeout_ms (-1 forever) in
 * slices so that a signal is seen while the stream is idle.
 * TDP_ECANCELED when interrupted (the pipe is still open).
 */
static tdp_err recv_next(tdp_pipe *pipe, int64_t timeout_ms, tdp_td **out)
{
    uint64_t deadline = timeout_ms < 0 ? 0 : tdp_cli_now_ns() + (uint64_t)timeout_ms * 1000000u;
    for (;;) {
        if (tdp_cli_interrupted())
            return TDP_ECANCELED;
        int64_t slice = SLICE_MS;
        if (timeout_ms >= 0) {
            uint64_t now = tdp_cli_now_ns();
            if (now >= deadline)
                return TDP_ETIMEDOUT;
            if ((deadline - now) / 1000000u < (uint64_t)slice)
                slice = (int64_t)((deadline - now) / 1000000u) + 1;
        }
        tdp_err rc = tdp_pipe_recv(pipe, slice, out);
        /* a timed-out receive was canceled before it started: the pipe lives on */
        if (rc != TDP_ETIMEDOUT || tdp_pipe_status(pipe) != TDP_OK)
            return rc;
    }
}

/* Close cleanly (the producer sees the end), then free. */
static void close_and_free(tdp_pipe *pipe, tdp_loop *loop)
{
    if (tdp_pipe_status(pipe) == TDP_OK)
        tdp_pipe_close(pipe, 2000);
    tdp_pipe_free(pipe);
    tdp_loop_free(loop);
}

/*
 * The producer waits for each message to come back (`send --echo`), which
 * recv and inspect never do: tell it so with a notice (it then says which
 * flag to change) rather than leave it waiting for its timeout.
 */
static void refuse_echo(const char *cmd, tdp_pipe *pipe)
{
    char from[32];
    tdp_td *notice;
    snprintf(from, sizeof(from), "tdpipe %s", cmd);
    tdp_cli_error(cmd,
                  "the producer waits for each message to come back ('tdpipe send --echo'), and "
                  "%s never replies: drop --echo, or send to 'tdpipe serve'",
                  cmd);
    if (tdp_cli_notice_new(TDP_CLI_NOTICE_NO_ECHO, from, &notice) != TDP_OK)
        return;
    tdp_pipe_send(pipe, notice, 2000); /* best effort: the clean close follows */
    tdp_td_unref(notice);
}

/* ---- recv ------------------------------------------------------------------ */

static const char recv_help[] =
    "usage: tdpipe recv [OPTIONS]\n\n"
    "Listen, accept one producer (e.g. 'tdpipe send'), receive until it closes\n"
    "or COUNT messages arrived, and check each message of 'tdpipe send's own\n"
    "stream against its pattern (other schemas, as 'send --file' sends, are\n"
    "not checked: 'verify skipped (not the send pattern)').\n\n"
    "The first line on stdout is 'listening on HOST:PORT'; then a summary:\n"
    "  received N messages (SIZE) in S s: RATE, M msgs/s; verify ok; end: ...;\n"
    "  plane P, depth D\n"
    "and with --dump, 'dumped N messages to DIR';\n"
    "or with --json one object: {\"cmd\": \"recv\", \"msgs\": N, \"bytes\", \"elapsed_s\",\n"
    "\"msgs_per_s\", \"bytes_per_s\", \"verify\", \"bad\", \"end\", \"plane\", \"depth\",\n"
    "\"peer\", \"resumed_from\", \"recv_wait_ns\": {...}} (docs/cli.md).\n\n"
    "Options:\n"
    "  -b, --bind HOST     address to listen on (default: all IPv4 and IPv6)\n"
    "  -p, --port PORT     port (default 0: any free port, printed)\n"
    "  -n, --count N       stop after N messages (default 0: until the producer closes)\n"
    "  -d, --depth D       receive buffers, 1..64 (default 4: the sender may have 4\n"
    "                      messages in flight, as in 'tdpipe bench')\n"
    "  -P, --producers N   accept N producers and receive their messages as one\n"
    "                      stream (a fan-in; depth D each, at least 2), until all N\n"
    "                      have left; rate lines and the summary give each\n"
    "                      producer's figures (\"producers\" in --json); each\n"
    "                      message is verified with its producer's own numbering\n"
    "      --window SIZE   receive window for small messages (default 256KiB: 64\n"
    "                      of 1 KB; 0: off): a layout of N bytes may have SIZE / N\n"
    "                      messages in flight (N in whole 4 KiB pages; at least\n"
    "                      --depth, at most 64); see docs/pipe.md\n"
    "      --plane NAME    data plane (default auto: the HELLO picks one);\n"
    "                      'tdpipe version' lists the names\n"
    "  -t, --timeout MS    longest wait for the producer and for each message\n"
    "                      (default 60000; -1 waits forever)\n"
    "      --secret-file F shared secret (16-256 bytes, as in the file): the peer\n"
    "                      must hold the same (authenticated, not encrypted)\n"
    "      --checksum      offer a payload checksum (XXH3-64 of every message,\n"
    "                      checked before it is handed out): in force when the\n"
    "                      peer offers it too; a damaged message ends the run (exit 1)\n"
    "      --keepalive I,N,C\n"
    "                      dead-peer detection: probe the control socket after I s\n"
    "                      idle, then every N s; a peer silent for I + N x C s is\n"
    "                      dead (default 5,1,15: 20 s; outages under 10 s pass)\n"
    "      --no-verify     do not check the payload against 'tdpipe send's pattern\n"
    "      --interval S    a rate line on stderr every S seconds (default: 1 when\n"
    "                      stderr is a terminal, else none; 0: none)\n"
    "      --json          the summary as one JSON object on stdout, rate lines as\n"
    "                      JSON objects on stderr (keys: docs/cli.md)\n"
    "      --dump DIR      write message n to DIR/msg-00000n.safetensors (6 digits\n"
    "                      or more), tensors under their dotted paths, values in\n"
    "                      __metadata__; DIR is created if missing\n"
    "  -q, --quiet         no rate lines (unless --interval is given)\n"
    "  -v, --verbose       more log (as before the subcommand: -v, -vv, -vvv)\n"
    "  -h, --help          show this help\n\n" TDP_CLI_EXIT_HELP;

typedef struct recv_args {
    listen_args listen;
    uint64_t count;
    bool verify, quiet, json;
    double interval;      /* --interval, TDP_CLI_INTERVAL_UNSET if not given */
    const char *dump_dir; /* --dump: NULL off */
    uint32_t producers;   /* --producers: 0 one producer, a plain pipe */
} recv_args;

/* long options without a short form */
enum {
    OPT_NO_VERIFY = 0x100,
    OPT_DEPTH_HINT,
    OPT_PLANE,
    OPT_KEEPALIVE,
    OPT_SECRET,
    OPT_RECONNECT,
    OPT_INTERVAL,
    OPT_JSON,
    OPT_CHECKSUM,
    OPT_WINDOW,
};
enum {
    OPT_DUMP = 0x200,
    OPT_FILE,
    OPT_SCHEMA,
    OPT_WAIT,
    OPT_VALUES,
    OPT_TO,
    OPT_DISTRIBUTE,
    OPT_NO_PREPARE,
    OPT_INFLIGHT
};

/* Parses recv's options into *a; returns -1 to go on, else an exit status. */
static int recv_parse(int argc, char **argv, recv_args *a)
{
    static const struct option opts[] = {
        {"bind", required_argument, NULL, 'b'},
        {"port", required_argument, NULL, 'p'},
        {"count", required_argument, NULL, 'n'},
        {"depth", required_argument, NULL, 'd'},
        {"timeout", required_argument, NULL, 't'},
        {"no-verify", no_argument, NULL, OPT_NO_VERIFY},
        {"interval", required_argument, NULL, OPT_INTERVAL},
        {"json", no_argument, NULL, OPT_JSON},
        {"dump", required_argument, NULL, OPT_DUMP},
        {"plane", required_argument, NULL, OPT_PLANE},
        {"keepalive", required_argument, NULL, OPT_KEEPALIVE},
        {"secret-file", required_argument, NULL, OPT_SECRET},
        {"checksum", no_argument, NULL, OPT_CHECKSUM},
        {"producers", required_argument, NULL, 'P'},
        {"window", required_argument, NULL, OPT_WINDOW},
        {"quiet", no_argument, NULL, 'q'},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    uint64_t v;
    int c;

    *a = (recv_args){
        .listen = {.depth = TDP_CLI_DEFAULT_DEPTH, .timeout_ms = 60000, .latency = true},
        .verify = true,
        .interval = TDP_CLI_INTERVAL_UNSET};
    tdp_pipe_opts_default(&a->listen.ka); /* the receive window is on unless --window 0 */
    tdp_cli_getopt_reset();
    while ((c = getopt_long(argc, argv, ":b:p:n:d:t:P:qvh", opts, NULL)) != -1) {
        switch (c) {
        case 'b':
            a->listen.bind = optarg[0] ? optarg : NULL;
            break;
        case 'P':
            if (!tdp_cli_parse_u64(optarg, 1, 4096, &v))
                return tdp_cli_usage_error("recv", "producers must be 1..4096, not '%s'", optarg);
            a->producers = (uint32_t)v;
            break;
        case 'p':
            if (!tdp_cli_parse_port(optarg, true, &a->listen.port))
                return tdp_cli_usage_error("recv", "invalid port '%s'", optarg);
            break;
        case 'n':
            if (!tdp_cli_parse_u64(optarg, 0, UINT64_MAX, &a->count))
                return tdp_cli_usage_error("recv", "invalid count '%s'", optarg);
            break;
        case 'd':
            if (!tdp_cli_parse_u64(optarg, 1, 64, &v))
                return tdp_cli_usage_error("recv", "depth must be 1..64, not '%s'", optarg);
            a->listen.depth = (uint32_t)v;
            break;
        case 't':
            if (!tdp_cli_parse_timeout(optarg, &a->listen.timeout_ms))
                return tdp_cli_usage_error("recv", "invalid timeout '%s' (ms >= 1, or -1 for none)",
                                           optarg);
            break;
        case OPT_NO_VERIFY:
            a->verify = false;
            break;
        case OPT_WINDOW: {
            int ec = tdp_cli_parse_window("recv", optarg, &a->listen.ka.recv_window_bytes);
            if (ec >= 0)
                return ec;
            break;
        }
        case OPT_INTERVAL:
            if (!tdp_cli_parse_interval(optarg, &a->interval))
                return tdp_cli_usage_error(
                    "recv", "invalid interval '%s' (seconds: 0, or 0.01 and up)", optarg);
            break;
        case OPT_JSON:
            a->json = true;
            break;
        case OPT_DUMP:
            a->dump_dir = optarg;
            break;
        case OPT_PLANE:
            if (!tdp_cli_parse_plane("recv", optarg, &a->listen.plane))
                return TDP_EXIT_USAGE;
            break;
        case OPT_SECRET:
            if (!tdp_cli_read_secret("recv", optarg, &a->listen.ka))
                return TDP_EXIT_USAGE;
            break;
        case OPT_CHECKSUM:
            a->listen.ka.checksum = true;
            break;
        case OPT_KEEPALIVE:
            if (!tdp_cli_parse_keepalive(optarg, &a->listen.ka))
                return tdp_cli_usage_error("recv", "invalid keepalive '%s' (IDLE,INTVL,CNT)",
                                           optarg);
            break;
        case 'q':
            a->quiet = true;
            break;
        case 'v':
            tdp_cli_more_verbose();
            break;
        case 'h':
            fputs(recv_help, stdout);
            return TDP_EXIT_OK;
        default:
            return tdp_cli_bad_option("recv", argv, c);
        }
    }
    if (optind < argc)
        return tdp_cli_usage_error("recv", "unexpected argument '%s'", argv[optind]);
    if (a->producers > 0 && a->dump_dir != NULL)
        return tdp_cli_usage_error("recv", "--dump takes one producer, not --producers");
    return -1;
}

/* --producers N: a fan-in (recv_fanin.c) */
static int recv_many(const recv_args *a)
{
    tdp_cli_fanin_args fa = {
        .bind = a->listen.bind,
        .port = a->listen.port,
        .depth = a->listen.depth,
        .plane = a->listen.plane,
        .timeout_ms = a->listen.timeout_ms,
        .ka = a->listen.ka,
        .producers = a->producers,
        .count = a->count,
        .verify = a->verify,
        .json = a->json,
        .interval = tdp_cli_interval(a->interval, a->quiet),
    };
    tdp_cli_catch_signals();
    return tdp_cli_recv_fanin(&fa);
}

/* What ended the receive loop and how the messages fared. */
typedef struct recv_result {
    tdp_err end; /* TDP_ECLOSED: producer closed; TDP_OK: --count reached */
    int signal;  /* interrupted by it (end is then TDP_ECANCELED) */
    uint64_t bad;
    uint64_t resumed; /* the producer reconnected: its first message to us had this seq */
    bool refused;     /* the producer wanted echoes */
    uint64_t checked; /* messages of `tdpipe send`'s stream, verified */
    bool dump_failed;
} recv_result;

static void recv_loop(tdp_pipe *pipe, const recv_args *a, tdp_cli_meter *m, recv_result *r)
{
    tdp_td *td;
    uint64_t first = 0; /* the producer's seq of our first message: 1, or where it resumed */
    *r = (recv_result){.end = TDP_OK};
    while (a->count == 0 || m->msgs < a->count) {
        tdp_err rc = recv_next(pipe, a->listen.timeout_ms, &td);
        if (rc != TDP_OK) {
            r->end = rc;
            r->signal = rc == TDP_ECANCELED ? tdp_cli_interrupted() : 0;
            return;
        }
        if (m->msgs == 0 && tdp_cli_wants_echo(tdp_td_schema(td)) == 1) {
            tdp_pipe_release(pipe, td);
            refuse_echo("recv", pipe);
            r->refused = true;
            return;
        }
        if (first == 0) {
            tdp_pipe_stats st;
            tdp_pipe_stats_get(pipe, &st);
            first = st.resumed_from != 0 ? st.resumed_from : 1;
            r->resumed = st.resumed_from;
        }
        uint64_t seq = first + m->msgs, off = 0;
        /* the pattern is `tdpipe send`'s own: other schemas carry real data */
        bool ours = tdp_cli_wants_echo(tdp_td_schema(td)) >= 0;
        r->checked += a->verify && ours;
        if (a->verify && ours && tdp_cli_verify(td, seq, &off) != TDP_OK && r->bad++ == 0)
            tdp_cli_error("recv", "message %" PRIu64 ": pattern mismatch at byte %" PRIu64, seq,
                          off);
        tdp_cli_meter_add(m, tdp_td_nbytes(td));
        char why[512];
        if (a->dump_dir != NULL &&
            tdp_cli_dump(a->dump_dir, m->msgs, td, why, sizeof(why)) != TDP_OK) {
            tdp_cli_error("recv", "message %" PRIu64 ": cannot dump it: %s", m->msgs, why);
            tdp_pipe_release(pipe, td);
            r->dump_failed = true;
            return;
        }
        tdp_pipe_release(pipe, td);
    }
}

/* Report how the stream ended; returns the exit status. */
static int recv_report(tdp_pipe *pipe, const recv_args *a, const tdp_cli_meter *m,
                       const recv_result *r)
{
    char line[256], end[48];
    bool clean = r->end == TDP_OK || r->end == TDP_ECLOSED || r->signal != 0;
    uint64_t now = tdp_cli_now_ns();
    snprintf(end, sizeof(end), "interrupted (%s)", signal_name(r->signal));
    const char *verify = !a->verify             ? "off"
                         : r->bad               ? "FAILED"
                         : m->msgs == 0         ? "none (nothing received)"
                         : r->checked == 0      ? "skipped (not the send pattern)"
                         : r->checked < m->msgs ? "ok (others skipped: not the send pattern)"
                                                : "ok";
    const char *how = r->refused              ? "refused (the producer wants echoes)"
                      : r->dump_failed        ? "dump failed"
                      : r->signal != 0        ? end
                      : r->end == TDP_OK      ? "count reached"
                      : r->end == TDP_ECLOSED ? "producer closed"
                                              : tdp_strerror(r->end);
    if (a->json) {
        static tdp_hist wait; /* large for the stack */
        char peer[80];
        json_t *o = json_object();
        json_object_set_new(o, "cmd", json_string("recv"));
        tdp_cli_meter_json(o, m, now);
        json_object_set_new(o, "verify",
                            json_string(!a->verify        ? "off"
                                        : r->bad          ? "failed"
                                        : m->msgs == 0    ? "none"
                                        : r->checked == 0 ? "skipped"
                                                          : "ok"));
        json_object_set_new(o, "bad", json_integer((json_int_t)r->bad));
        json_object_set_new(o, "checked", json_integer((json_int_t)r->checked));
        json_object_set_new(o, "end", json_string(how));
        json_object_set_new(o, "plane", json_string(tdp_cli_plane_of(pipe)));
        json_object_set_new(o, "depth", json_integer(a->listen.depth));
        json_object_set_new(o, "window", json_integer((json_int_t)a->listen.ka.recv_window_bytes));
        json_object_set_new(o, "peer", json_string(tdp_pipe_peer(pipe, peer, sizeof(peer))));
        json_object_set_new(o, "resumed_from", json_integer((json_int_t)r->resumed));
        if (a->dump_dir != NULL) {
            json_object_set_new(o, "dump_dir", json_string(a->dump_dir));
            json_object_set_new(o, "dumped", json_integer((json_int_t)(m->msgs - r->dump_failed)));
        }
        if (tdp_pipe_latency_get(pipe, TDP_LAT_RECV_WAIT, &wait) == TDP_OK)
            json_object_set_new(o, "recv_wait_ns", tdp_cli_hist_json(&wait));
        tdp_cli_json_line(o, stdout);
    } else {
        char win[48] = "";
        if (a->listen.ka.recv_window_bytes != 0)
            snprintf(win, sizeof(win), ", window %" PRIu64 " B",
                     (uint64_t)a->listen.ka.recv_window_bytes);
        printf("%s; verify %s; end: %s; plane %s, depth %u%s\n",
               tdp_cli_meter_summary(m, "received", now, line, sizeof(line)), verify, how,
               tdp_cli_plane_of(pipe), a->listen.depth, win);
    }
    if (r->resumed != 0 && !a->json)
        printf("the producer resumed at message %" PRIu64 " (it reconnected: earlier ones went "
               "to another receiver)\n",
               r->resumed);
    if (a->dump_dir != NULL && !a->json)
        printf("dumped %" PRIu64 " message%s to %s\n", m->msgs - r->dump_failed,
               tdp_cli_s(m->msgs - r->dump_failed), a->dump_dir);
    if (r->refused || r->dump_failed)
        return TDP_EXIT_FAIL;
    if (!clean) {
        if (r->end == TDP_ETIMEDOUT)
            tdp_cli_error("recv", "no message for %" PRId64 " ms after %" PRIu64 " message%s",
                          a->listen.timeout_ms, m->msgs, tdp_cli_s(m->msgs));
        else
            tdp_cli_error("recv", "stream ended after %" PRIu64 " message%s: %s", m->msgs,
                          tdp_cli_s(m->msgs), tdp_strerror(r->end));
        return tdp_cli_exit_for(r->end);
    }
    if (r->bad > 0) {
        tdp_cli_error("recv", "%" PRIu64 " of %" PRIu64 " message%s failed verification", r->bad,
                      m->msgs, tdp_cli_s(m->msgs));
        return TDP_EXIT_FAIL;
    }
    if (r->signal != 0)
        return TDP_EXIT_SIGNAL(r->signal);
    if (m->msgs == 0) {
        tdp_cli_error("recv", "the producer closed without sending a message");
        return TDP_EXIT_FAIL;
    }
    return TDP_EXIT_OK;
}

int tdp_cmd_recv(int argc, char **argv)
{
    recv_args a;
    tdp_cli_meter m;
    recv_result r;
    tdp_loop *loop;
    tdp_pipe *pipe;

    int ec = recv_parse(argc, argv, &a);
    if (ec >= 0)
        return ec;
    if (a.producers > 0)
        return recv_many(&a);
    char why[512];
    if (a.dump_dir != NULL && !tdp_cli_dump_dir(a.dump_dir, why, sizeof(why))) {
        tdp_cli_error("recv", "--dump %s: %s", a.dump_dir, why);
        return TDP_EXIT_USAGE;
    }
    tdp_cli_catch_signals();
    if ((ec = accept_one("recv", &a.listen, &loop, &pipe)) != TDP_EXIT_OK)
        return ec;
    tdp_cli_meter_start(&m);
    tdp_cli_ticker *tick = tdp_cli_ticker_start(
        "recv", 0, a.json, tdp_cli_interval(a.interval, a.quiet), tdp_cli_sample_recv, pipe);
    recv_loop(pipe, &a, &m, &r);
    tdp_cli_ticker_stop(tick);
    ec = recv_report(pipe, &a, &m, &r);
    close_and_free(pipe, loop);
    return ec;
}

/* ---- send ------------------------------------------------------------------ */

static const char send_help[] =
    "usage: tdpipe send HOST:PORT [OPTIONS]\n"
    "       tdpipe send --to HOST:PORT --to HOST:PORT ... [OPTIONS]\n\n"
    "Connect to a receiver ('tdpipe recv', 'tdpipe serve', 'tdpipe inspect') and\n"
    "send COUNT synthetic tensordicts of SIZE bytes: a float32 leaf 'data' and a\n"
    "nested 'meta' node; message n (from 1) carries a pattern that depends on n,\n"
    "which 'recv' and 'serve' check. Then close cleanly.\n"
    "With --file, send a file's tensors instead (COUNT times, default once):\n"
    "a safetensors file, whose tensor 'a.b' becomes leaf b of node a and whose\n"
    "__metadata__ becomes string values under '__metadata__'; or, with --schema,\n"
    "a raw buffer and its tdpipe schema JSON. Receivers do not check these.\n"
    "HOST is a name, an IPv4 address or an IPv6 address in brackets ([::1]:5000).\n\n"
    "The summary on stdout: a line, then how long each send took (from the call\n"
    "to its completion: credit waits included), round trips with --echo, credit\n"
    "waits with --depth-hint:\n"
    "  sent N messages (SIZE) in S s: RATE, M msgs/s; plane P\n"
    "  send time: min T, p50 T, p99 T, p99.9 T, max T\n"
    "  round trip: min T, p50 T, p99 T, p99.9 T, max T\n"
    "or with --json one object: {\"cmd\": \"send\", \"msgs\": N, \"bytes\", \"elapsed_s\",\n"
    "\"msgs_per_s\", \"bytes_per_s\", \"size\", \"end\", \"plane\", \"peer\", \"credit_waits\",\n"
    "\"prepare_ms\", \"inflight\", \"send_ns\": {...}, \"rtt_ns\": {...} with --echo} "
    "(docs/cli.md).\n\n"
    "A receiver that cannot serve this sender as started (--echo against 'recv',\n"
    "'inspect' or 'serve --mode sink'; no --echo against 'serve --mode echo')\n"
    "says so at once; send then names the flag to change and exits 2.\n\n"
    "Several receivers (--to, repeated; HOST:PORT counts as one more): every\n"
    "message goes to each of them (a broadcast fan-out, docs/pipe.md), at the\n"
    "pace of the slowest; a receiver that fails leaves and the others go on.\n"
    "The summary adds a line per receiver (its messages, bytes, plane), the\n"
    "rate lines and --json a \"peers\" list; not with --echo, --reconnect,\n"
    "--depth-hint. With --distribute each message goes to one receiver that is\n"
    "free instead (a share each; their pattern check no longer lines up: run\n"
    "them with --no-verify).\n\n"
    "Options:\n"
    "  -s, --size BYTES    payload size, 1 B or more (default 1MB); units B, K/KB,\n"
    "                      M/MB, G/GB (1000^n), Ki/KiB, Mi/MiB, Gi/GiB (1024^n);\n"
    "                      rounded up to a multiple of 4 (whole float32 elements)\n"
    "  -n, --count N       messages to send (default 1000; 1 with --file)\n"
    "      --to HOST:PORT  one more receiver (repeat it: up to 64)\n"
    "      --distribute    with several receivers: each message to one that is free\n"
    "                      (default: every message to each of them)\n"
    "      --file PATH     send the tensors of safetensors file PATH (checked first:\n"
    "                      a malformed file is refused, exit 2); not with --size,\n"
    "                      --echo\n"
    "      --schema JSON   with --file: PATH is a raw buffer of exactly the\n"
    "                      schema's total_bytes, JSON a schema as 'tdpipe inspect'\n"
    "                      prints it after 'json: ' (docs/schema.md)\n"
    "  -r, --rate R        at most R messages per second (default 0: as fast as possible)\n"
    "  -e, --echo          wait for each message to come back and check it\n"
    "                      (for 'tdpipe serve'); reports round-trip percentiles\n"
    "      --depth-hint    report how often sends waited for the receiver's buffers,\n"
    "                      and whether a larger 'recv --depth' would help\n"
    "      --plane NAME    data plane (default auto: the HELLO picks one);\n"
    "                      'tdpipe version' lists the names\n"
    "      --inflight N    keep N sends in flight (1-64), each from a buffer of its\n"
    "                      own (default: as many as 256 KiB holds for messages up\n"
    "                      to 64 KiB, else 1; always 1 with --echo, --reconnect,\n"
    "                      --depth-hint); small messages then travel several to\n"
    "                      one transfer (docs/pipe.md)\n"
    "      --no-prepare    do not announce the layout before the first message:\n"
    "                      by default (with more than one message, one receiver)\n"
    "                      pools, receive buffers and their pages are made first,\n"
    "                      outside the rate and the send times (tdp_pipe_prepare;\n"
    "                      the summary's prepare_ms)\n"
    "  -t, --timeout MS    deadline of the connect and of each message (default 10000;\n"
    "                      -1 waits forever)\n"
    "      --wait SECONDS  a receiver not listening yet (connection refused): try\n"
    "                      again until it listens or SECONDS passed (decimals\n"
    "                      allowed), then go on; without it a refusal fails at once\n"
    "      --reconnect MS  when the receiver goes away (or is not there yet), dial\n"
    "                      it again for up to MS ms and go on from the next message;\n"
    "                      'lost' counts sends that failed with the outage (still in\n"
    "                      flight when the link went), 'unconfirmed' the messages\n"
    "                      the link carried that the receiver never gave back (lost\n"
    "                      ones included): any of these may or may not have reached\n"
    "                      the receiving application; sends that completed are not\n"
    "                      in 'lost'\n"
    "      --secret-file F shared secret (16-256 bytes, as in the file): the peer\n"
    "                      must hold the same (authenticated, not encrypted)\n"
    "      --checksum      offer a payload checksum (XXH3-64 of every message,\n"
    "                      checked before it is handed out): in force when the\n"
    "                      peer offers it too; a damaged message ends the run (exit 1)\n"
    "      --keepalive I,N,C\n"
    "                      dead-peer detection: probe the control socket after I s\n"
    "                      idle, then every N s; a peer silent for I + N x C s is\n"
    "                      dead (default 5,1,15: 20 s; outages under 10 s pass)\n"
    "      --interval S    a rate line on stderr every S seconds (default: 1 when\n"
    "                      stderr is a terminal, else none; 0: none)\n"
    "      --json          the summary as one JSON object on stdout, rate lines as\n"
    "                      JSON objects on stderr (keys: docs/cli.md)\n"
    "  -q, --quiet         no rate lines (unless --interval is given), no notices\n"
    "  -v, --verbose       more log (as before the subcommand: -v, -vv, -vvv)\n"
    "  -h, --help          show this help\n\n" TDP_CLI_EXIT_HELP;

typedef struct send_args {
    char host[TDP_CLI_HOST_LEN];
    uint16_t port;
    uint64_t size, count;
    double rate;
    int64_t timeout_ms;
    tdp_plane plane;
    tdp_pipe_opts ka; /* what --keepalive and --secret-file set (tdp_cli_apply_net_opts) */
    bool echo, depth_hint, quiet, json;
    bool no_prepare;      /* --no-prepare: the first message carries its layout (plain) */
    uint32_t inflight;    /* --inflight: async sends in flight (0: not given, auto) */
    double prepare_ms;    /* how long the prepare took; < 0: none made, or it failed */
    double interval;      /* --interval, TDP_CLI_INTERVAL_UNSET if not given */
    int64_t reconnect_ms; /* --reconnect: 0 off */
    uint64_t lost;        /* sends an outage took (reconnecting) */
    const char *file, *schema_file; /* --file, --schema: real data */
    int64_t wait_ms;                /* --wait: 0 off */
    tdp_cli_fanout_args *fan;       /* --to: the receivers (HOST:PORT among them) */
} send_args;

/* Parses send's options and HOST:PORT; returns -1 to go on, else an exit status. */
static int send_parse(int argc, char **argv, send_args *a)
{
    static const struct option opts[] = {
        {"size", required_argument, NULL, 's'},
        {"count", required_argument, NULL, 'n'},
        {"rate", required_argument, NULL, 'r'},
        {"echo", no_argument, NULL, 'e'},
        {"depth-hint", no_argument, NULL, OPT_DEPTH_HINT},
        {"interval", required_argument, NULL, OPT_INTERVAL},
        {"json", no_argument, NULL, OPT_JSON},
        {"plane", required_argument, NULL, OPT_PLANE},
        {"timeout", required_argument, NULL, 't'},
        {"keepalive", required_argument, NULL, OPT_KEEPALIVE},
        {"reconnect", required_argument, NULL, OPT_RECONNECT},
        {"secret-file", required_argument, NULL, OPT_SECRET},
        {"checksum", no_argument, NULL, OPT_CHECKSUM},
        {"file", required_argument, NULL, OPT_FILE},
        {"schema", required_argument, NULL, OPT_SCHEMA},
        {"wait", required_argument, NULL, OPT_WAIT},
        {"to", required_argument, NULL, OPT_TO},
        {"distribute", no_argument, NULL, OPT_DISTRIBUTE},
        {"no-prepare", no_argument, NULL, OPT_NO_PREPARE},
        {"inflight", required_argument, NULL, OPT_INFLIGHT},
        {"quiet", no_argument, NULL, 'q'},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *why;
    char buf[TDP_CLI_FMT_LEN];
    bool size_set = false, count_set = false;
    double wait_s;
    int c;

    static tdp_cli_fanout_args fan; /* large for the stack */
    memset(&fan, 0, sizeof(fan));
    *a = (send_args){.size = 1000000,
                     .count = 1000,
                     .timeout_ms = 10000,
                     .prepare_ms = -1,
                     .interval = TDP_CLI_INTERVAL_UNSET,
                     .fan = &fan};
    tdp_pipe_opts_default(&a->ka); /* tdp_cli_apply_net_opts takes its window as it is */
    tdp_cli_getopt_reset();
    while ((c = getopt_long(argc, argv, ":s:n:r:et:qvh", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            size_set = true;
            if (!tdp_cli_parse_size(optarg, &a->size, &why))
                return tdp_cli_usage_error("send", "invalid size '%s': %s", optarg, why);
            if (a->size == 0)
                return tdp_cli_usage_error("send", "invalid size '%s': at least 1 B", optarg);
            if (tdp_cli_synth_bytes(a->size) > TDP_SCHEMA_DEFAULT_MAX_TOTAL_BYTES)
                return tdp_cli_usage_error(
                    "send", "size '%s' is over the largest message a receiver takes, %s", optarg,
                    tdp_cli_format_size(TDP_SCHEMA_DEFAULT_MAX_TOTAL_BYTES, buf, sizeof(buf)));
            break;
        case 'n':
            count_set = true;
            if (!tdp_cli_parse_u64(optarg, 0, UINT64_MAX, &a->count))
                return tdp_cli_usage_error("send", "invalid count '%s'", optarg);
            break;
        case OPT_FILE:
            a->file = optarg;
            break;
        case OPT_SCHEMA:
            a->schema_file = optarg;
            break;
        case OPT_TO:
            if (fan.n == TDP_CLI_FANOUT_MAX)
                return tdp_cli_usage_error("send", "more than %d receivers", TDP_CLI_FANOUT_MAX);
            if (!tdp_cli_parse_hostport(optarg, false, fan.host[fan.n], sizeof(fan.host[0]),
                                        &fan.port[fan.n]))
                return tdp_cli_usage_error(
                    "send", "invalid address '%s' (want HOST:PORT or [V6]:PORT)", optarg);
            fan.n++;
            break;
        case OPT_DISTRIBUTE:
            fan.distribute = true;
            break;
        case OPT_NO_PREPARE:
            a->no_prepare = true;
            break;
        case OPT_INFLIGHT: {
            uint64_t v;
            if (!tdp_cli_parse_u64(optarg, 1, SEND_INFLIGHT_MAX, &v))
                return tdp_cli_usage_error("send", "invalid --inflight '%s' (1 to %d)", optarg,
                                           SEND_INFLIGHT_MAX);
            a->inflight = (uint32_t)v;
            break;
        }
        case OPT_WAIT:
            if (!tdp_cli_parse_double(optarg, &wait_s) || wait_s <= 0 ||
                wait_s * 1000 > (double)TDP_CLI_TIMEOUT_MAX_MS)
                return tdp_cli_usage_error("send", "invalid wait '%s' (seconds, above 0)", optarg);
            a->wait_ms = (int64_t)(wait_s * 1000 + 0.5);
            a->wait_ms = a->wait_ms > 0 ? a->wait_ms : 1;
            break;
        case 'r':
            /* a floor keeps (seq - 1) / rate within the clock's range */
            if (!tdp_cli_parse_double(optarg, &a->rate) || (a->rate > 0 && a->rate < 1e-3))
                return tdp_cli_usage_error("send", "invalid rate '%s' (0, or 0.001 and up)",
                                           optarg);
            break;
        case 'e':
            a->echo = true;
            break;
        case OPT_DEPTH_HINT:
            a->depth_hint = true;
            break;
        case OPT_INTERVAL:
            if (!tdp_cli_parse_interval(optarg, &a->interval))
                return tdp_cli_usage_error(
                    "send", "invalid interval '%s' (seconds: 0, or 0.01 and up)", optarg);
            break;
        case OPT_JSON:
            a->json = true;
            break;
        case OPT_PLANE:
            if (!tdp_cli_parse_plane("send", optarg, &a->plane))
                return TDP_EXIT_USAGE;
            break;
        case OPT_RECONNECT: {
            uint64_t ms;
            if (!tdp_cli_parse_u64(optarg, 1, UINT64_C(1) << 40, &ms))
                return tdp_cli_usage_error("send", "invalid reconnect time '%s' (ms, 1 and up)",
                                           optarg);
            a->reconnect_ms = (int64_t)ms;
            break;
        }
        case OPT_SECRET:
            if (!tdp_cli_read_secret("send", optarg, &a->ka))
                return TDP_EXIT_USAGE;
            break;
        case OPT_CHECKSUM:
            a->ka.checksum = true;
            break;
        case OPT_KEEPALIVE:
            if (!tdp_cli_parse_keepalive(optarg, &a->ka))
                return tdp_cli_usage_error("send", "invalid keepalive '%s' (IDLE,INTVL,CNT)",
                                           optarg);
            break;
        case 't':
            if (!tdp_cli_parse_timeout(optarg, &a->timeout_ms))
                return tdp_cli_usage_error("send", "invalid timeout '%s' (ms >= 1, or -1 for none)",
                                           optarg);
            break;
        case 'q':
            a->quiet = true;
            break;
        case 'v':
            tdp_cli_more_verbose();
            break;
        case 'h':
            fputs(send_help, stdout);
            return TDP_EXIT_OK;
        default:
            return tdp_cli_bad_option("send", argv, c);
        }
    }
    if (optind >= argc && fan.n == 0)
        return tdp_cli_usage_error("send", "missing HOST:PORT");
    if (optind + 1 < argc)
        return tdp_cli_usage_error("send", "unexpected argument '%s'", argv[optind + 1]);
    if (optind < argc &&
        !tdp_cli_parse_hostport(argv[optind], false, a->host, sizeof(a->host), &a->port))
        return tdp_cli_usage_error("send", "invalid address '%s' (want HOST:PORT or [V6]:PORT)",
                                   argv[optind]);
    if (fan.n > 0 && optind < argc) { /* HOST:PORT is one more receiver */
        if (fan.n == TDP_CLI_FANOUT_MAX)
            return tdp_cli_usage_error("send", "more than %d receivers", TDP_CLI_FANOUT_MAX);
        memmove(fan.host[1], fan.host[0], fan.n * sizeof(fan.host[0]));
        memmove(&fan.port[1], &fan.port[0], fan.n * sizeof(fan.port[0]));
        snprintf(fan.host[0], sizeof(fan.host[0]), "%s", a->host);
        fan.port[0] = a->port;
        fan.n++;
    } else if (fan.n == 1) { /* one --to: an ordinary send */
        snprintf(a->host, sizeof(a->host), "%s", fan.host[0]);
        a->port = fan.port[0];
        fan.n = 0;
    }
    if (fan.distribute && fan.n < 2)
        return tdp_cli_usage_error("send", "--distribute shares the messages among receivers: "
                                           "name two or more (--to HOST:PORT, repeated)");
    if (fan.n > 1 && (a->echo || a->reconnect_ms > 0 || a->depth_hint))
        return tdp_cli_usage_error("send", "several receivers: not with --echo, --reconnect or "
                                           "--depth-hint");
    if (a->schema_file != NULL && a->file == NULL)
        return tdp_cli_usage_error("send", "--schema needs --file (the raw data it describes)");
    if (a->file != NULL && size_set)
        return tdp_cli_usage_error("send", "--size and --file: the file's tensors set the size");
    if (a->file != NULL && a->echo)
        return tdp_cli_usage_error("send", "--echo checks replies against the synthetic pattern: "
                                           "not with --file");
    if (a->file != NULL && !count_set)
        a->count = 1;
    return -1;
}

/*
 * A receiver's notice (tdp_cli_notice_new): say what it means for this
 * sender and which flag to change. False when td is not a notice.
 */
static bool explain_notice(const tdp_td *td)
{
    char from[64];
    const char *code = tdp_cli_notice_of(td, from, sizeof(from));
    if (code == NULL)
        return false;
    bool server = strncmp(from, "tdpipe serve", 12) == 0;
    if (strcmp(code, TDP_CLI_NOTICE_NO_ECHO) == 0)
        tdp_cli_error("send",
                      "the receiver (%s) does not send messages back, and --echo waits for "
                      "each: drop --echo, or %s",
                      from,
                      server ? "start the server with '--mode auto'" : "send to 'tdpipe serve'");
    else
        tdp_cli_error("send",
                      "the receiver (%s) sends every message back, and this sender does not read "
                      "them: add --echo%s",
                      from, server ? ", or start the server with '--mode auto'" : "");
    return true;
}

/* --echo: the message comes back; it must be the one sent. */
static tdp_err await_echo(tdp_pipe *pipe, const send_args *a, uint64_t seq, bool *refused)
{
    tdp_td *reply;
    uint64_t off;
    tdp_err rc = recv_next(pipe, a->timeout_ms, &reply);
    if (rc != TDP_OK)
        return rc;
    if (explain_notice(reply)) {
        tdp_pipe_release(pipe, reply);
        *refused = true;
        return TDP_ECLOSED; /* the receiver closes after its notice */
    }
    rc = tdp_cli_verify(reply, seq, &off);
    if (rc != TDP_OK)
        tdp_cli_error("send", "echo of message %" PRIu64 ": pattern mismatch at byte %" PRIu64, seq,
                      off);
    tdp_pipe_release(pipe, reply);
    return rc;
}

/*
 * Say why message seq failed and return the error that tells it best: an
 * operation canceled because the pipe ended reports how the pipe ended.
 */
static tdp_err send_failed(tdp_pipe *pipe, uint64_t seq, tdp_err rc, bool *refused)
{
    tdp_err status = tdp_pipe_status(pipe);
    if (*refused)
        return rc; /* explain_notice has said why */
    if ((rc == TDP_ECANCELED && status == TDP_OK) || rc == TDP_ECLOSED) {
        /*
         * UCX cancels a payload the receiver declined as it closed, and may
         * say so before the receiver's BYE is read. A receive ends when the
         * pipe does: wait a little for the real reason. A receiver that
         * closed may have sent a notice first (we expect no other data).
         */
        tdp_td *td;
        tdp_err end = tdp_pipe_recv(pipe, 1000, &td);
        if (end == TDP_OK) {
            *refused = explain_notice(td);
            tdp_pipe_release(pipe, td);
            if (*refused)
                return TDP_ECLOSED;
        } else if (end != TDP_ETIMEDOUT && rc == TDP_ECANCELED) {
            status = end; /* TDP_ECLOSED: the receiver said goodbye */
        }
    }
    if (rc == TDP_ECANCELED && status != TDP_OK)
        rc = status;
    if (rc == TDP_ECLOSED)
        tdp_cli_error("send", "message %" PRIu64 ": the receiver closed the stream", seq);
    else if (rc != TDP_EMISMATCH) /* await_echo has said what was wrong */
        tdp_cli_error("send", "message %" PRIu64 ": %s", seq, tdp_strerror(rc));
    return rc;
}

/* Sleep until deadline_ns, or less when interrupted. */
static void pace_until(uint64_t deadline_ns)
{
    const uint64_t slice = (uint64_t)SLICE_MS * 1000000u;
    for (uint64_t now = tdp_cli_now_ns(); now < deadline_ns && !tdp_cli_interrupted();
         now = tdp_cli_now_ns())
        tdp_cli_sleep_until_ns(deadline_ns - now > slice ? now + slice : deadline_ns);
}

/*
 * After the last send: a receiver that refused us may have sent its notice
 * (it is here or on its way); TDP_ECLOSED when it did, having said why.
 */
static tdp_err late_notice(tdp_pipe *pipe, bool *refused)
{
    tdp_td *got;
    if (tdp_pipe_recv(pipe, 0, &got) == TDP_OK) {
        *refused = explain_notice(got);
        tdp_pipe_release(pipe, got);
        if (*refused)
            return TDP_ECLOSED;
    }
    return TDP_OK;
}

/*
 * Sends in flight (--inflight, or by default for small messages): each has
 * a buffer of its own, filled just before its send; the sending thread
 * waits for the oldest (tdp_op_wait, which drives the loop meanwhile) only
 * when it needs that buffer again, as docs/pipe.md's "Streams of small
 * messages" says a producer of small messages should. Made before the run
 * and freed after the pipe: an op still out when a send failed is ended by
 * the pipe's close.
 */
typedef struct send_ring {
    tdp_cli_ring r;
    uint64_t seq[SEND_INFLIGHT_MAX]; /* the message each op carries; 0: none out */
} send_ring;

/* How many in flight: --inflight, else tdp_cli_inflight_for; one with
 * --echo, --reconnect and --depth-hint, which count each send on its own. */
static uint32_t send_inflight(const send_args *a, uint64_t bytes)
{
    if (a->echo || a->reconnect_ms > 0 || a->depth_hint || a->count < 2)
        return 1;
    return a->inflight > 0 ? a->inflight : tdp_cli_inflight_for(bytes, SEND_INFLIGHT_MAX);
}

/* Wait for op k if a send is out on it; TDP_OK when none is. Counts it sent. */
static tdp_err send_ring_wait(send_ring *r, uint32_t k, const send_args *a, tdp_cli_meter *m,
                              uint64_t *failed)
{
    if (r->seq[k] == 0)
        return TDP_OK;
    tdp_err rc = tdp_op_wait(r->r.op[k], a->timeout_ms);
    if (rc == TDP_ETIMEDOUT) {
        *failed = r->seq[k]; /* still out: the pipe's close ends it */
        return rc;
    }
    if (rc == TDP_OK)
        tdp_cli_meter_add(m, tdp_td_nbytes(r->r.td[k]));
    else if (*failed == 0)
        *failed = r->seq[k];
    r->seq[k] = 0;
    return rc;
}

/* send_loop with r->r.n sends in flight (no --echo, no --reconnect). */
static tdp_err send_loop_ring(tdp_pipe *pipe, send_ring *r, send_args *a, tdp_cli_meter *m,
                              bool *refused)
{
    uint64_t t0 = m->start_ns, failed = 0;
    tdp_err rc = TDP_OK;
    for (uint64_t seq = 1; seq <= a->count && rc == TDP_OK; seq++) {
        uint32_t k = (uint32_t)((seq - 1) % r->r.n);
        if ((rc = send_ring_wait(r, k, a, m, &failed)) != TDP_OK)
            break;
        if (a->rate > 0)
            pace_until(t0 + (uint64_t)((double)(seq - 1) * 1e9 / a->rate));
        if (tdp_cli_interrupted()) {
            rc = TDP_ECANCELED;
            break;
        }
        if (a->file == NULL)
            tdp_cli_fill(r->r.td[k], seq);
        r->seq[k] = seq;
        tdp_pipe_send_async(pipe, r->r.td[k], r->r.op[k]);
    }
    /* every send still out, oldest first: they complete in order */
    for (uint64_t i = 0; i < r->r.n; i++) {
        uint32_t k = (uint32_t)((a->count + i) % r->r.n);
        tdp_err e = send_ring_wait(r, k, a, m, &failed);
        if (rc == TDP_OK)
            rc = e;
        if (e == TDP_ETIMEDOUT)
            break; /* the rest wait behind it */
    }
    if (rc == TDP_ECANCELED && tdp_cli_interrupted() && tdp_pipe_status(pipe) == TDP_OK)
        return rc; /* between messages, all of ours back: close cleanly */
    if (rc != TDP_OK)
        return send_failed(pipe, failed != 0 ? failed : 1, rc, refused);
    return late_notice(pipe, refused);
}

/*
 * Send (and with --echo, get back) every message; returns the first error,
 * TDP_ECANCELED when interrupted (the pipe still open: close it cleanly).
 * *refused: the receiver sent a notice (it cannot serve us as started).
 */
static tdp_err send_loop(tdp_pipe *pipe, tdp_td *td, send_args *a, tdp_cli_meter *m, tdp_hist *rtt,
                         bool *refused)
{
    uint64_t t0 = m->start_ns;
    for (uint64_t seq = 1; seq <= a->count; seq++) {
        if (a->rate > 0) /* message seq leaves no sooner than (seq - 1) / rate */
            pace_until(t0 + (uint64_t)((double)(seq - 1) * 1e9 / a->rate));
        if (tdp_cli_interrupted())
            return TDP_ECANCELED; /* between messages: nothing in flight of ours */
        if (a->file == NULL)
            tdp_cli_fill(td, seq);
        uint64_t t = tdp_cli_now_ns();
        tdp_err rc = tdp_pipe_send(pipe, td, a->timeout_ms);
        if (rc == TDP_OK)
            tdp_cli_meter_add(m, tdp_td_nbytes(td)); /* sent, whatever comes back */
        if (rc == TDP_OK && a->echo)
            rc = await_echo(pipe, a, seq, refused);
        if (rc == TDP_ECANCELED && tdp_cli_interrupted() && tdp_pipe_status(pipe) == TDP_OK)
            return rc; /* waiting for the echo */
        if (rc == TDP_ECONNRESET && a->reconnect_ms > 0 && !a->echo &&
            tdp_pipe_status(pipe) == TDP_OK) {
            a->lost++; /* the receiver went with it; the pipe is dialing the next one */
            continue;
        }
        if (rc != TDP_OK)
            return send_failed(pipe, seq, rc, refused);
        if (a->echo)
            tdp_hist_record(rtt, tdp_cli_now_ns() - t);
    }
    return a->echo ? TDP_OK : late_notice(pipe, refused);
}

/* The lines after the first of send's text summary. */
static void send_report_extra(tdp_pipe *pipe, const send_args *a, const tdp_hist *rtt)
{
    static tdp_hist sent; /* large for the stack */
    char buf[160];
    if (tdp_pipe_latency_get(pipe, TDP_LAT_SEND, &sent) == TDP_OK && sent.count > 0)
        printf("send time: %s\n", tdp_cli_hist_text(&sent, buf, sizeof(buf)));
    if (a->echo && rtt->count > 0)
        printf("round trip: %s\n", tdp_cli_hist_text(rtt, buf, sizeof(buf)));
    if (a->depth_hint) {
        tdp_pipe_stats st;
        tdp_pipe_stats_get(pipe, &st);
        double frac = st.msgs_sent ? (double)st.credit_waits / (double)st.msgs_sent : 0;
        printf("credit waits: %" PRIu64 " of %" PRIu64 " send%s (%.0f%%)%s\n", st.credit_waits,
               st.msgs_sent, tdp_cli_s(st.msgs_sent), frac * 100,
               frac > 0.1 ? ": the receiver's buffers were the limit; a larger "
                            "'recv --depth' may help"
                          : ": the receiver kept up");
    }
}

/* send --json: the whole summary as one object on stdout. */
static void send_report_json(tdp_pipe *pipe, const send_args *a, const tdp_cli_meter *m,
                             const tdp_hist *rtt, uint64_t size, const char *end)
{
    static tdp_hist sent; /* large for the stack */
    tdp_pipe_stats st;
    char peer[80];
    json_t *o = json_object();
    tdp_pipe_stats_get(pipe, &st);
    json_object_set_new(o, "cmd", json_string("send"));
    tdp_cli_meter_json(o, m, tdp_cli_now_ns());
    json_object_set_new(o, "size", json_integer((json_int_t)size));
    json_object_set_new(o, "end", json_string(end));
    json_object_set_new(o, "plane", json_string(tdp_cli_plane_of(pipe)));
    json_object_set_new(o, "peer", json_string(tdp_pipe_peer(pipe, peer, sizeof(peer))));
    json_object_set_new(o, "credit_waits", json_integer((json_int_t)st.credit_waits));
    json_object_set_new(o, "prepare_ms", a->prepare_ms >= 0 ? json_real(a->prepare_ms) : json_null());
    json_object_set_new(o, "inflight", json_integer(a->inflight));
    if (a->reconnect_ms > 0) {
        json_object_set_new(o, "reconnects", json_integer((json_int_t)st.reconnects));
        json_object_set_new(o, "lost", json_integer((json_int_t)a->lost));
        json_object_set_new(o, "unconfirmed", json_integer((json_int_t)st.unconfirmed));
    }
    if (tdp_pipe_latency_get(pipe, TDP_LAT_SEND, &sent) == TDP_OK)
        json_object_set_new(o, "send_ns", tdp_cli_hist_json(&sent));
    if (a->echo)
        json_object_set_new(o, "rtt_ns", tdp_cli_hist_json(rtt));
    tdp_cli_json_line(o, stdout);
}

/* Connect; on failure says why and returns the exit status, else -1. */
static int send_connect(const send_args *a, tdp_loop *loop, tdp_pipe **pipe)
{
    tdp_pipe_opts opts;
    tdp_pipe_opts_default(&opts);
    opts.plane = a->plane;
    opts.reconnect_ms = a->reconnect_ms;
    opts.latency_stats = true; /* the summary's send times */
    opts.connect_wait_ms = a->wait_ms;
    tdp_cli_apply_net_opts(&a->ka, &opts);
    if (a->timeout_ms >= 0)
        opts.connect_timeout_ms = a->timeout_ms;
    else
        opts.connect_timeout_ms = 365LL * 24 * 3600 * 1000; /* "forever", in a timeval's range */
    tdp_err rc = tdp_pipe_connect(loop, a->host, a->port, &opts, pipe);
    if (rc == TDP_OK)
        return -1;
    int ec = tdp_cli_connect_failed("send", a->host, a->port, rc, a->plane);
    if (rc == TDP_ECONNREFUSED && a->wait_ms > 0)
        tdp_cli_error("send", "nothing listened there within --wait %.3g s", a->wait_ms / 1e3);
    else if (rc == TDP_ECONNREFUSED)
        tdp_cli_error("send", "nothing listens there: start the receiver first, or give "
                              "--wait SECONDS to wait for it");
    return ec;
}

/*
 * The layout announced before the first message (tdp_pipe_prepare): pools,
 * receive buffers and their pages made now, outside the rate and the send
 * times. A failure is not fatal here: the first send meets the same cause
 * and reports it (a refusal, a dead receiver) as send always has.
 */
static void send_prepare(tdp_pipe *pipe, tdp_td *td, send_args *a)
{
    uint64_t t0 = tdp_cli_now_ns();
    tdp_err rc = tdp_pipe_prepare(pipe, tdp_td_schema(td), a->timeout_ms);
    if (rc != TDP_OK) {
        if (!a->quiet)
            fprintf(stderr, "send: prepare: %s (the first message carries its layout)\n",
                    tdp_strerror(rc));
        return;
    }
    a->prepare_ms = (double)(tdp_cli_now_ns() - t0) / 1e6;
    char sz[TDP_CLI_FMT_LEN];
    if (!a->quiet && !a->json)
        fprintf(stderr, "send: layout (%s) prepared in %.1f ms\n",
                tdp_cli_format_size(tdp_td_nbytes(td), sz, sizeof(sz)), a->prepare_ms);
}

/* --file: the message; on failure says why and returns the exit status, else -1. */
static int send_load(const send_args *a, tdp_td **td)
{
    char why[512], sz[TDP_CLI_FMT_LEN];
    tdp_err rc = a->schema_file != NULL
                     ? tdp_cli_raw_load(a->schema_file, a->file, td, why, sizeof(why))
                     : tdp_cli_st_load(a->file, stderr, td, why, sizeof(why));
    if (rc != TDP_OK) {
        tdp_cli_error("send", "%s: %s", a->file, why);
        return rc == TDP_ENOMEM ? TDP_EXIT_FAIL : TDP_EXIT_USAGE;
    }
    if (!a->quiet)
        fprintf(stderr, "send: %s: %u tensor%s, %s a message\n", a->file,
                tdp_schema_num_tensors(tdp_td_schema(*td)),
                tdp_cli_s(tdp_schema_num_tensors(tdp_td_schema(*td))),
                tdp_cli_format_size(tdp_td_nbytes(*td), sz, sizeof(sz)));
    return -1;
}

/* Several receivers: the fan-out, with the pipe options one receiver would get. */
static int send_fanout(const send_args *a, tdp_td *td)
{
    tdp_pipe_opts opts;
    tdp_pipe_opts_default(&opts);
    opts.plane = a->plane;
    opts.connect_wait_ms = a->wait_ms;
    tdp_cli_apply_net_opts(&a->ka, &opts);
    opts.connect_timeout_ms = a->timeout_ms >= 0 ? a->timeout_ms : 365LL * 24 * 3600 * 1000;
    a->fan->count = a->count;
    a->fan->rate = a->rate;
    a->fan->interval = a->interval;
    a->fan->timeout_ms = a->timeout_ms;
    a->fan->pipe = &opts;
    a->fan->fill = a->file == NULL;
    a->fan->quiet = a->quiet;
    a->fan->json = a->json;
    return tdp_cli_send_fanout(a->fan, td);
}

int tdp_cmd_send(int argc, char **argv)
{
    send_args a;
    tdp_cli_meter m;
    static tdp_hist rtt; /* --echo's round trips, ns; large for the stack */
    tdp_schema *s;
    tdp_loop *loop;
    tdp_pipe *pipe;
    tdp_td *td;
    tdp_err rc;
    char line[256];

    int ec = send_parse(argc, argv, &a);
    if (ec >= 0)
        return ec;
    tdp_cli_catch_signals();
    if (a.file != NULL) {
        if ((ec = send_load(&a, &td)) >= 0)
            return ec;
    } else if ((rc = tdp_cli_send_schema(a.size, TDP_DEVICE_CPU_INIT, a.echo, &s)) != TDP_OK ||
               (rc = tdp_td_new(s, &td)) != TDP_OK) {
        tdp_cli_error("send", "cannot make a %" PRIu64 "-byte message: %s", a.size,
                      tdp_strerror(rc));
        return TDP_EXIT_FAIL;
    } else {
        tdp_schema_unref(s); /* td holds it */
    }
    if (a.file == NULL && tdp_td_nbytes(td) != a.size && !a.quiet)
        fprintf(stderr,
                "send: each message is %" PRIu64 " bytes (%" PRIu64 " rounded up to whole "
                "float32 elements)\n",
                tdp_td_nbytes(td), a.size);
    if (a.fan->n > 1) {
        ec = send_fanout(&a, td);
        tdp_td_unref(td);
        return ec;
    }
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK) {
        tdp_cli_error("send", "cannot create the event loop: %s", tdp_strerror(rc));
        tdp_td_unref(td);
        return TDP_EXIT_FAIL;
    }
    if ((ec = send_connect(&a, loop, &pipe)) >= 0)
        goto out_free_loop;
    if (!a.no_prepare && a.count > 1) /* one message: the prepare would only move its cost */
        send_prepare(pipe, td, &a);

    static send_ring ring; /* large for the stack */
    uint32_t nfl = send_inflight(&a, tdp_td_nbytes(td));
    memset(&ring, 0, sizeof(ring));
    if (nfl > 1 && tdp_cli_ring_init(&ring.r, nfl, td) != TDP_OK)
        nfl = 1;      /* no memory for the buffers: one at a time */
    a.inflight = nfl; /* as run, for the summary */

    tdp_cli_meter_start(&m);
    tdp_hist_reset(&rtt);
    bool refused = false;
    tdp_cli_ticker *tick =
        tdp_cli_ticker_start("send", TDP_CLI_RATE_CREDIT, a.json,
                             tdp_cli_interval(a.interval, a.quiet), tdp_cli_sample_send, pipe);
    rc = nfl > 1 ? send_loop_ring(pipe, &ring, &a, &m, &refused)
                 : send_loop(pipe, td, &a, &m, &rtt, &refused);
    tdp_cli_ticker_stop(tick);
    int sig = rc == TDP_ECANCELED ? tdp_cli_interrupted() : 0;
    if (sig != 0) {
        tdp_cli_error("send", "interrupted (%s) after %" PRIu64 " message%s: closing",
                      signal_name(sig), m.msgs, tdp_cli_s(m.msgs));
        rc = TDP_OK; /* the receiver sees a clean end */
    }
    if (rc == TDP_OK && (rc = tdp_pipe_close(pipe, a.timeout_ms)) != TDP_OK)
        tdp_cli_error("send", "close: %s", tdp_strerror(rc));
    if (a.json) {
        char end[48];
        snprintf(end, sizeof(end), "interrupted (%s)", signal_name(sig));
        send_report_json(pipe, &a, &m, &rtt, tdp_td_nbytes(td),
                         refused        ? "refused"
                         : sig != 0     ? end
                         : rc == TDP_OK ? "ok"
                                        : tdp_strerror(rc));
    } else {
        printf("%s; plane %s\n",
               tdp_cli_meter_summary(&m, "sent", tdp_cli_now_ns(), line, sizeof(line)),
               tdp_cli_plane_of(pipe));
        if (a.reconnect_ms > 0) {
            tdp_pipe_stats st;
            tdp_pipe_stats_get(pipe, &st);
            printf("reconnects: %" PRIu64 "; sends lost to an outage: %" PRIu64
                   "; messages the receiver never confirmed: %" PRIu64 "\n",
                   st.reconnects, a.lost, st.unconfirmed);
        }
        send_report_extra(pipe, &a, &rtt);
    }
    ec = refused               ? TDP_EXIT_USAGE
         : rc == TDP_EMISMATCH ? TDP_EXIT_FAIL
         : rc == TDP_OK && sig ? TDP_EXIT_SIGNAL(sig)
                               : tdp_cli_exit_for(rc);
    tdp_pipe_free(pipe);
    tdp_cli_ring_free(&ring.r); /* after the pipe: its close ended any send still out */
out_free_loop:
    tdp_loop_free(loop);
    tdp_td_unref(td);
    return ec;
}

/* ---- inspect --------------------------------------------------------------- */

static const char inspect_help[] =
    "usage: tdpipe inspect [OPTIONS]\n\n"
    "Listen, accept one producer and show what it sends: the schema of the stream\n"
    "as a tree, its canonical JSON and hash; then one line per message, and the\n"
    "tree again whenever the schema changes. Ends when the producer closes, or\n"
    "closes after COUNT messages.\n\n"
    "Output (stdout):\n"
    "  listening on HOST:PORT\n"
    "  schema HASH  BYTES bytes on DEVICE  (...)      <- the tree (tdp_schema_print)\n"
    "  ...\n"
    "  json: {...}\n"
    "  hash: HASH\n"
    "  message SEQ: BYTES bytes, schema HASH\n"
    "    PATH DTYPE[SHAPE] = [v0, v1, ...]            <- with --values, per tensor\n\n"
    "Options:\n"
    "  -b, --bind HOST     address to listen on (default: all IPv4 and IPv6)\n"
    "  -p, --port PORT     port (default 0: any free port, printed)\n"
    "  -n, --count N       messages to show before closing (default 0: all, until\n"
    "                      the producer closes)\n"
    "      --values [N]    also print the first N values (default 8) of each tensor\n"
    "                      of each message, '...' when there are more; floats with\n"
    "                      %g (float16, bfloat16, float8 converted), integers, bool\n"
    "      --plane NAME    data plane (default auto: the HELLO picks one);\n"
    "                      'tdpipe version' lists the names\n"
    "  -t, --timeout MS    longest wait for the producer and for each message\n"
    "                      (default 60000; -1 waits forever)\n"
    "      --secret-file F shared secret (16-256 bytes, as in the file): the peer\n"
    "                      must hold the same (authenticated, not encrypted)\n"
    "      --keepalive I,N,C\n"
    "                      dead-peer detection: probe the control socket after I s\n"
    "                      idle, then every N s; a peer silent for I + N x C s is\n"
    "                      dead (default 5,1,15: 20 s; outages under 10 s pass)\n"
    "  -v, --verbose       more log (as before the subcommand: -v, -vv, -vvv)\n"
    "  -h, --help          show this help\n\n" TDP_CLI_EXIT_HELP;

typedef struct inspect_args {
    listen_args listen;
    uint64_t count;
    uint64_t values; /* --values: elements shown per tensor; 0 off */
} inspect_args;

static int inspect_parse(int argc, char **argv, inspect_args *a)
{
    static const struct option opts[] = {
        {"bind", required_argument, NULL, 'b'},
        {"port", required_argument, NULL, 'p'},
        {"count", required_argument, NULL, 'n'},
        {"timeout", required_argument, NULL, 't'},
        {"plane", required_argument, NULL, OPT_PLANE},
        {"keepalive", required_argument, NULL, OPT_KEEPALIVE},
        {"secret-file", required_argument, NULL, OPT_SECRET},
        {"values", optional_argument, NULL, OPT_VALUES},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;

    *a = (inspect_args){.listen = {.depth = 1, .timeout_ms = 60000}};
    tdp_pipe_opts_default(&a->listen.ka); /* tdp_cli_apply_net_opts takes its window as it is */
    tdp_cli_getopt_reset();
    while ((c = getopt_long(argc, argv, ":b:p:n:t:vh", opts, NULL)) != -1) {
        switch (c) {
        case 'b':
            a->listen.bind = optarg[0] ? optarg : NULL;
            break;
        case 'p':
            if (!tdp_cli_parse_port(optarg, true, &a->listen.port))
                return tdp_cli_usage_error("inspect", "invalid port '%s'", optarg);
            break;
        case 'n':
            if (!tdp_cli_parse_u64(optarg, 0, UINT64_MAX, &a->count))
                return tdp_cli_usage_error("inspect", "invalid count '%s'", optarg);
            break;
        case 't':
            if (!tdp_cli_parse_timeout(optarg, &a->listen.timeout_ms))
                return tdp_cli_usage_error(
                    "inspect", "invalid timeout '%s' (ms >= 1, or -1 for none)", optarg);
            break;
        case OPT_VALUES: {
            /* "--values 4" as well as "--values=4": a number right after is its count */
            const char *v = optarg;
            if (v == NULL && optind < argc && isdigit((unsigned char)argv[optind][0]))
                v = argv[optind++];
            a->values = 8;
            if (v != NULL && !tdp_cli_parse_u64(v, 1, 1000000, &a->values))
                return tdp_cli_usage_error("inspect", "invalid --values count '%s' (1..1000000)",
                                           v);
            break;
        }
        case OPT_PLANE:
            if (!tdp_cli_parse_plane("inspect", optarg, &a->listen.plane))
                return TDP_EXIT_USAGE;
            break;
        case OPT_SECRET:
            if (!tdp_cli_read_secret("inspect", optarg, &a->listen.ka))
                return TDP_EXIT_USAGE;
            break;
        case OPT_KEEPALIVE:
            if (!tdp_cli_parse_keepalive(optarg, &a->listen.ka))
                return tdp_cli_usage_error("inspect", "invalid keepalive '%s' (IDLE,INTVL,CNT)",
                                           optarg);
            break;
        case 'v':
            tdp_cli_more_verbose();
            break;
        case 'h':
            fputs(inspect_help, stdout);
            return TDP_EXIT_OK;
        default:
            return tdp_cli_bad_option("inspect", argv, c);
        }
    }
    if (optind < argc)
        return tdp_cli_usage_error("inspect", "unexpected argument '%s'", argv[optind]);
    return -1;
}

static void print_schema(tdp_schema *s)
{
    tdp_schema_print(s, stdout);
    printf("json: %s\n", tdp_schema_json(s, NULL));
    printf("hash: %016" PRIx64 "\n", tdp_schema_hash(s));
}

int tdp_cmd_inspect(int argc, char **argv)
{
    inspect_args a;
    tdp_loop *loop;
    tdp_pipe *pipe;
    tdp_td *td;
    tdp_err rc = TDP_OK;
    uint64_t n = 0, last_hash = 0;
    bool refused = false;

    int ec = inspect_parse(argc, argv, &a);
    if (ec >= 0)
        return ec;
    tdp_cli_catch_signals();
    if ((ec = accept_one("inspect", &a.listen, &loop, &pipe)) != TDP_EXIT_OK)
        return ec;
    while ((a.count == 0 || n < a.count) &&
           (rc = recv_next(pipe, a.listen.timeout_ms, &td)) == TDP_OK) {
        tdp_schema *s = tdp_td_schema(td);
        n++;
        if (n == 1 || tdp_schema_hash(s) != last_hash)
            print_schema(s);
        last_hash = tdp_schema_hash(s);
        printf("message %" PRIu64 ": %" PRIu64 " bytes, schema %016" PRIx64 "\n", n,
               tdp_td_nbytes(td), last_hash);
        if (a.values > 0)
            tdp_cli_print_values(stdout, td, a.values);
        bool wants_echo = n == 1 && tdp_cli_wants_echo(s) == 1;
        tdp_pipe_release(pipe, td);
        if (wants_echo) { /* shown; but it would wait for the echo until its timeout */
            refuse_echo("inspect", pipe);
            refused = true;
            break;
        }
    }
    if (n > 0)
        printf("plane %s\n", tdp_cli_plane_of(pipe));
    int sig = rc == TDP_ECANCELED ? tdp_cli_interrupted() : 0;
    if (sig != 0) {
        printf("interrupted (%s) after %" PRIu64 " message%s\n", signal_name(sig), n, tdp_cli_s(n));
        rc = TDP_OK;
    } else if (rc == TDP_ECLOSED && n > 0) {
        printf("producer closed after %" PRIu64 " message%s\n", n, tdp_cli_s(n));
        rc = TDP_OK;
    } else if (rc != TDP_OK) {
        tdp_cli_error("inspect", "after %" PRIu64 " message%s: %s", n, tdp_cli_s(n),
                      tdp_strerror(rc));
    }
    ec = refused             ? TDP_EXIT_FAIL
         : sig != 0          ? TDP_EXIT_SIGNAL(sig)
         : rc == TDP_ECLOSED ? TDP_EXIT_FAIL
                             : tdp_cli_exit_for(rc);
    close_and_free(pipe, loop);
    return ec;
}
