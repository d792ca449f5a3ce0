/*
 * cmd_serve.c: `tdpipe serve` — a tdp_server that echoes every message back
 * to its client, or verifies and drops it: by default each client gets what
 * its schema says it reads (`tdpipe send --echo` or not).
 *
 * The server runs on a loop thread of its own; the main thread only waits
 * for a reason to stop (SIGINT/SIGTERM, --count, --duration) and prints
 * totals. tdp_server_shutdown must not be called from the loop thread, and
 * this way it never is. The signals are blocked in every thread and taken
 * with sigtimedwait on the main thread, so no handler runs at a random point
 * of the library; the handler that sees the last of --count messages wakes
 * the main thread with SIGUSR1.
 */
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "report.h"

static const char serve_help[] =
    "usage: tdpipe serve [OPTIONS]\n\n"
    "Serve any number of clients (e.g. 'tdpipe send'). In echo mode every message\n"
    "is sent back to its client ('tdpipe send --echo' waits for it and checks it);\n"
    "in sink mode it is dropped, after a check of 'tdpipe send's pattern. In auto\n"
    "mode (the default) each 'tdpipe send' client gets what it asked for: echoes\n"
    "with --echo, sink without; other producers are sunk. A 'tdpipe send' client\n"
    "that a forced mode cannot serve is told so at once and closed.\n"
    "Stops on SIGINT or SIGTERM, after COUNT messages or after S seconds, with a\n"
    "graceful shutdown (clients see a clean end).\n\n"
    "Output: 'listening on HOST:PORT' first, then a line per client connecting and\n"
    "closing, 'stopping: WHY' and a final 'served ...' line; a rate line on stderr\n"
    "every --interval while anything moves. With --json every line after\n"
    "'listening on' is a JSON object: {\"event\": \"connect\", \"client\", \"peer\",\n"
    "\"plane\"}, {\"event\": \"close\", \"client\", \"status\", \"msgs\", \"bytes\",\n"
    "\"mode\"}, {\"event\": \"stopping\", \"why\"} and last {\"event\": \"summary\",\n"
    "\"cmd\": \"serve\", \"clients\", \"msgs_in\", \"msgs_out\", ...} (docs/cli.md).\n\n"
    "Options:\n"
    "  -b, --bind HOST       address to listen on (default: all IPv4 and IPv6)\n"
    "  -p, --port PORT       port (default 0: any free port, printed)\n"
    "  -m, --mode MODE       auto (default), echo or sink\n"
    "  -c, --max-clients N   clients at once; more are refused (default 1024)\n"
    "      --max-pending N   handshakes under way at once; one more drops the oldest\n"
    "                        (default 256)\n"
    "      --max-per-source N\n"
    "                        handshakes under way from one address (IPv6: one /64)\n"
    "                        at once; one more is refused (default 32; 0: no limit)\n"
    "      --idle-timeout MS\n"
    "                        close a client that sent and received nothing for MS\n"
    "                        (default 300000: 5 min; -1: never)\n"
    "      --secret-file F   shared secret (16-256 bytes, as in the file): the\n"
    "                        peer must hold the same (authenticated, not encrypted)\n"
    "      --checksum        offer a payload checksum (XXH3-64 of every message):\n"
    "                        in force with each client that offers it too; a\n"
    "                        damaged message is dropped and that client closed\n"
    "      --max-memory SIZE receive buffers of all clients together (depth x each\n"
    "                        client's message size); a client whose schema would\n"
    "                        go over is refused (TDP_ELIMIT). Default: half of\n"
    "                        physical memory; 'none': no cap\n"
    "      --keepalive I,N,C\n"
    "                        dead-peer detection: probe a client's control socket\n"
    "                        after I s idle, then every N s; a client silent for\n"
    "                        I + N x C s is dead (default 5,1,15: 20 s; outages\n"
    "                        under 10 s pass)\n"
    "  -n, --count N         stop after N messages in total (default 0: no limit)\n"
    "  -T, --duration S      stop after S seconds (default 0: no limit)\n"
    "  -d, --depth D         receive buffers per client, 1..64 (default 4)\n"
    "      --window SIZE     receive window per client for small messages (default\n"
    "                        256KiB; 0: off): a layout of N bytes may have SIZE / N in\n"
    "                        flight (N in whole 4 KiB pages; at least --depth, at\n"
    "                        most 64); see docs/pipe.md\n"
    "      --plane NAME      data plane (default auto: each HELLO picks one);\n"
    "                        'tdpipe version' lists the names\n"
    "      --no-verify       sink mode: do not check the pattern\n"
    "      --interval S      a rate line on stderr every S seconds while anything\n"
    "                        moves (default: 1 when stderr is a terminal, else\n"
    "                        none; 0: none)\n"
    "      --json            JSON lines on stdout (above), rate lines as JSON\n"
    "                        objects on stderr\n"
    "  -q, --quiet           no rate lines (unless --interval is given)\n"
    "  -v, --verbose         more log (as before the subcommand: -v, -vv, -vvv)\n"
    "  -h, --help            show this help\n\n"
    "Exit status: 0 ok, 1 sink verification failures or runtime failure, 2 usage\n"
    "error, 3 cannot listen, 5 replies still pending at the shutdown deadline.\n";

/* How long the graceful shutdown may wait for replies in flight. */
#define SHUTDOWN_MS 5000

typedef enum serve_mode { MODE_AUTO, MODE_ECHO, MODE_SINK } serve_mode;

typedef struct serve_args {
    const char *bind;
    uint16_t port;
    serve_mode mode;
    bool verify, quiet, json;
    double interval; /* --interval, TDP_CLI_INTERVAL_UNSET if not given */
    uint32_t max_clients, depth;
    uint32_t max_pending, max_per_source; /* 0: the library's default */
    int64_t idle_timeout_ms;              /* 0: the library's default */
    tdp_pipe_opts ka; /* what --keepalive and --secret-file set (tdp_cli_apply_net_opts) */
    tdp_plane plane;
    uint64_t count;
    double duration_s;
    uint64_t max_memory; /* 0: the library's default; UINT64_MAX: none */
} serve_args;

/* State the handler callbacks share with the main thread. */
typedef struct serve_ctx {
    const serve_args *args;
    pthread_t main_thread;
    tdp_td *notice;               /* what a client this mode cannot serve is sent (read-only) */
    atomic_uint_fast64_t msgs;    /* messages handled, for --count */
    atomic_uint_fast64_t bad;     /* sink: messages that failed verification */
    atomic_uint_fast64_t checked; /* sink: messages verified */
} serve_ctx;

/* Per client, owned by the loop thread from on_connect to on_close. */
typedef struct client_state {
    uint64_t msgs, bytes, bad;
    bool decided, echo, verify; /* set by the first message */
    bool refused;               /* told it cannot be served as it asks */
} client_state;

enum {
    OPT_NO_VERIFY = 0x100,
    OPT_PLANE,
    OPT_MAX_PENDING,
    OPT_MAX_PER_SOURCE,
    OPT_IDLE_TIMEOUT,
    OPT_KEEPALIVE,
    OPT_SECRET,
    OPT_INTERVAL,
    OPT_JSON,
    OPT_CHECKSUM,
    OPT_MAX_MEMORY,
    OPT_WINDOW,
};

static int serve_parse(int argc, char **argv, serve_args *a)
{
    static const struct option opts[] = {
        {"bind", required_argument, NULL, 'b'},
        {"port", required_argument, NULL, 'p'},
        {"mode", required_argument, NULL, 'm'},
        {"max-clients", required_argument, NULL, 'c'},
        {"max-pending", required_argument, NULL, OPT_MAX_PENDING},
        {"max-per-source", required_argument, NULL, OPT_MAX_PER_SOURCE},
        {"idle-timeout", required_argument, NULL, OPT_IDLE_TIMEOUT},
        {"keepalive", required_argument, NULL, OPT_KEEPALIVE},
        {"secret-file", required_argument, NULL, OPT_SECRET},
        {"checksum", no_argument, NULL, OPT_CHECKSUM},
        {"max-memory", required_argument, NULL, OPT_MAX_MEMORY},
        {"count", required_argument, NULL, 'n'},
        {"duration", required_argument, NULL, 'T'},
        {"depth", required_argument, NULL, 'd'},
        {"window", required_argument, NULL, OPT_WINDOW},
        {"no-verify", no_argument, NULL, OPT_NO_VERIFY},
        {"interval", required_argument, NULL, OPT_INTERVAL},
        {"json", no_argument, NULL, OPT_JSON},
        {"plane", required_argument, NULL, OPT_PLANE},
        {"quiet", no_argument, NULL, 'q'},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    uint64_t v;
    int c;

    *a = (serve_args){.mode = MODE_AUTO,
                      .verify = true,
                      .depth = TDP_CLI_DEFAULT_DEPTH,
                      .interval = TDP_CLI_INTERVAL_UNSET};
    tdp_pipe_opts_default(&a->ka); /* the receive window is on unless --window 0 */
    tdp_cli_getopt_reset();
    while ((c = getopt_long(argc, argv, ":b:p:m:c:n:T:d:qvh", opts, NULL)) != -1) {
        switch (c) {
        case 'b':
            a->bind = optarg[0] ? optarg : NULL;
            break;
        case 'p':
            if (!tdp_cli_parse_port(optarg, true, &a->port))
                return tdp_cli_usage_error("serve", "invalid port '%s'", optarg);
            break;
        case 'm':
            if (strcmp(optarg, "auto") == 0)
                a->mode = MODE_AUTO;
            else if (strcmp(optarg, "echo") == 0)
                a->mode = MODE_ECHO;
            else if (strcmp(optarg, "sink") == 0)
                a->mode = MODE_SINK;
            else
                return tdp_cli_usage_error("serve", "mode must be auto, echo or sink, not '%s'",
                                           optarg);
            break;
        case 'c':
            if (!tdp_cli_parse_u64(optarg, 1, UINT32_MAX, &v))
                return tdp_cli_usage_error("serve", "invalid max-clients '%s'", optarg);
            a->max_clients = (uint32_t)v;
            break;
        case OPT_MAX_PENDING:
            if (!tdp_cli_parse_u64(optarg, 1, UINT32_MAX, &v))
                return tdp_cli_usage_error("serve", "invalid max-pending '%s'", optarg);
            a->max_pending = (uint32_t)v;
            break;
        case OPT_MAX_PER_SOURCE:
            if (!tdp_cli_parse_u64(optarg, 0, UINT32_MAX, &v))
                return tdp_cli_usage_error("serve", "invalid max-per-source '%s'", optarg);
            a->max_per_source = v == 0 ? UINT32_MAX : (uint32_t)v;
            break;
        case OPT_IDLE_TIMEOUT:
            if (!tdp_cli_parse_timeout(optarg, &a->idle_timeout_ms))
                return tdp_cli_usage_error("serve", "invalid idle-timeout '%s' (ms > 0, or -1)",
                                           optarg);
            break;
        case OPT_SECRET:
            if (!tdp_cli_read_secret("serve", optarg, &a->ka))
                return TDP_EXIT_USAGE;
            break;
        case OPT_CHECKSUM:
            a->ka.checksum = true;
            break;
        case OPT_MAX_MEMORY: {
            const char *why = NULL;
            if (strcmp(optarg, "none") == 0)
                a->max_memory = UINT64_MAX;
            else if (!tdp_cli_parse_size(optarg, &a->max_memory, &why))
                return tdp_cli_usage_error("serve", "invalid max-memory '%s'%s%s (a size, or none)",
                                           optarg, why ? ": " : "", why ? why : "");
            else if (a->max_memory == 0)
                return tdp_cli_usage_error(
                    "serve",
                    "invalid max-memory '%s': no client could be served (a size of 1 B "
                    "or more, or none for no cap)",
                    optarg);
            break;
        }
        case OPT_KEEPALIVE:
            if (!tdp_cli_parse_keepalive(optarg, &a->ka))
                return tdp_cli_usage_error("serve", "invalid keepalive '%s' (IDLE,INTVL,CNT)",
                                           optarg);
            break;
        case 'n':
            if (!tdp_cli_parse_u64(optarg, 0, UINT64_MAX, &a->count))
                return tdp_cli_usage_error("serve", "invalid count '%s'", optarg);
            break;
        case 'T':
            if (!tdp_cli_parse_double(optarg, &a->duration_s) || a->duration_s > 1e9)
                return tdp_cli_usage_error("serve", "invalid duration '%s' (seconds)", optarg);
            break;
        case 'd':
            if (!tdp_cli_parse_u64(optarg, 1, 64, &v))
                return tdp_cli_usage_error("serve", "depth must be 1..64, not '%s'", optarg);
            a->depth = (uint32_t)v;
            break;
        case OPT_NO_VERIFY:
            a->verify = false;
            break;
        case OPT_WINDOW: {
            int ec = tdp_cli_parse_window("serve", optarg, &a->ka.recv_window_bytes);
            if (ec >= 0)
                return ec;
            break;
        }
        case OPT_INTERVAL:
            if (!tdp_cli_parse_interval(optarg, &a->interval))
                return tdp_cli_usage_error(
                    "serve", "invalid interval '%s' (seconds: 0, or 0.01 and up)", optarg);
            break;
        case OPT_JSON:
            a->json = true;
            break;
        case OPT_PLANE:
            if (!tdp_cli_parse_plane("serve", optarg, &a->plane))
                return TDP_EXIT_USAGE;
            break;
        case 'q':
            a->quiet = true;
            break;
        case 'v':
            tdp_cli_more_verbose();
            break;
        case 'h':
            fputs(serve_help, stdout);
            return TDP_EXIT_OK;
        default:
            return tdp_cli_bad_option("serve", argv, c);
        }
    }
    if (optind < argc)
        return tdp_cli_usage_error("serve", "unexpected argument '%s'", argv[optind]);
    return -1;
}

/* ---- handler (loop thread) ------------------------------------------------- */

static tdp_err on_connect(tdp_client *c, void *arg)
{
    serve_ctx *ctx = arg;
    char peer[80];
    client_state *cs = calloc(1, sizeof(*cs));
    if (cs == NULL)
        return TDP_ENOMEM;
    tdp_client_set_data(c, cs);
    tdp_pipe_peer(tdp_client_pipe(c), peer, sizeof(peer));
    if (ctx->args->json) {
        json_t *o = json_object();
        json_object_set_new(o, "event", json_string("connect"));
        json_object_set_new(o, "client", json_integer((json_int_t)tdp_client_id(c)));
        json_object_set_new(o, "peer", json_string(peer));
        json_object_set_new(o, "plane", json_string(tdp_cli_plane_of(tdp_client_pipe(c))));
        tdp_cli_json_line(o, stdout);
        return TDP_OK;
    }
    printf("client %" PRIu64 " connected from %s, plane %s\n", tdp_client_id(c), peer,
           tdp_cli_plane_of(tdp_client_pipe(c)));
    return TDP_OK;
}

/* Sink: message n of a client must carry pattern n (as `tdpipe send` fills it). */
static void sink_check(serve_ctx *ctx, tdp_client *c, client_state *cs, tdp_td *td)
{
    uint64_t off;
    atomic_fetch_add(&ctx->checked, 1);
    if (tdp_cli_verify(td, cs->msgs, &off) == TDP_OK)
        return;
    atomic_fetch_add(&ctx->bad, 1);
    if (cs->bad++ == 0) /* once per client: a foreign producer would flood */
        tdp_cli_error("serve",
                      "client %" PRIu64 ", message %" PRIu64 ": pattern mismatch at byte %" PRIu64,
                      tdp_client_id(c), cs->msgs, off);
}

/*
 * The first message says what the client is: `tdpipe send` marks whether it
 * reads replies (tdp_cli_wants_echo). Returns false when this server's mode
 * cannot serve it: it has been sent the notice and is closing.
 */
static bool decide(serve_ctx *ctx, tdp_client *c, client_state *cs, tdp_td *td)
{
    serve_mode mode = ctx->args->mode;
    int wants = tdp_cli_wants_echo(tdp_td_schema(td));
    cs->decided = true;
    if ((mode == MODE_ECHO && wants == 0) || (mode == MODE_SINK && wants == 1)) {
        tdp_cli_error("serve",
                      "client %" PRIu64 " %s, and this server %s (--mode %s): told it so and "
                      "closed it",
                      tdp_client_id(c),
                      wants ? "waits for replies ('tdpipe send --echo')"
                            : "does not read replies ('tdpipe send' without --echo)",
                      wants ? "never replies" : "replies to every message",
                      mode == MODE_ECHO ? "echo" : "sink");
        cs->refused = true;
        if (ctx->notice != NULL)
            tdp_client_send(c, ctx->notice);
        tdp_client_close(c);
        return false;
    }
    cs->echo = mode == MODE_ECHO || (mode == MODE_AUTO && wants == 1);
    /* the pattern is `tdpipe send`'s: other producers' payloads are not checked */
    cs->verify = !cs->echo && ctx->args->verify && wants >= 0;
    return true;
}

static tdp_err on_message(tdp_client *c, tdp_td *td, void *arg)
{
    serve_ctx *ctx = arg;
    client_state *cs = tdp_client_get_data(c);
    tdp_err rc = TDP_OK;

    if (cs->refused || (!cs->decided && !decide(ctx, c, cs, td)))
        return TDP_OK;
    cs->msgs++;
    cs->bytes += tdp_td_nbytes(td);
    if (cs->echo) {
        if ((rc = tdp_client_send(c, td)) != TDP_OK) /* counted as a handler error */
            tdp_cli_error("serve", "client %" PRIu64 ": cannot echo message %" PRIu64 ": %s",
                          tdp_client_id(c), cs->msgs, tdp_strerror(rc));
    } else if (cs->verify) {
        sink_check(ctx, c, cs, td);
    }
    uint64_t total = atomic_fetch_add(&ctx->msgs, 1) + 1;
    if (ctx->args->count != 0 && total == ctx->args->count)
        pthread_kill(ctx->main_thread, SIGUSR1);
    return rc; /* an error closes only this client */
}

static void on_close(tdp_client *c, tdp_err status, void *arg)
{
    serve_ctx *ctx = arg;
    client_state *cs = tdp_client_get_data(c);
    char size[TDP_CLI_FMT_LEN];
    if (cs == NULL)
        return; /* turned away before on_connect kept anything */
    const char *how = cs->refused             ? "refused"
                      : status == TDP_ECLOSED ? "clean"
                                              : tdp_strerror(status);
    const char *mode = !cs->decided || cs->refused ? NULL : cs->echo ? "echo" : "sink";
    if (ctx->args->json) {
        json_t *o = json_object();
        json_object_set_new(o, "event", json_string("close"));
        json_object_set_new(o, "client", json_integer((json_int_t)tdp_client_id(c)));
        json_object_set_new(o, "status", json_string(how));
        json_object_set_new(o, "msgs", json_integer((json_int_t)cs->msgs));
        json_object_set_new(o, "bytes", json_integer((json_int_t)cs->bytes));
        json_object_set_new(o, "mode", mode != NULL ? json_string(mode) : json_null());
        tdp_cli_json_line(o, stdout);
    } else {
        printf("client %" PRIu64 " closed: %s, %" PRIu64 " message%s (%s)%s\n", tdp_client_id(c),
               how, cs->msgs, tdp_cli_s(cs->msgs),
               tdp_cli_format_size(cs->bytes, size, sizeof(size)),
               mode == NULL ? ""
               : cs->echo   ? ", echoed"
                            : ", sunk");
    }
    tdp_client_set_data(c, NULL);
    free(cs);
}

/* ---- main thread ----------------------------------------------------------- */

/* A rate line on stderr when anything moved since the last one. */
static void report_totals(tdp_server *s, tdp_cli_rate *r)
{
    tdp_server_stats st;
    tdp_server_stats_get(s, &st);
    tdp_cli_sample now = {
        .msgs = st.msgs_recv,
        .bytes = st.bytes_recv,
        .msgs_out = st.msgs_sent,
        .bytes_out = st.bytes_sent,
        .clients = st.clients_now,
        .clients_total = st.clients_total,
    };
    if (now.msgs == r->last.msgs && now.msgs_out == r->last.msgs_out &&
        now.clients == r->last.clients && now.clients_total == r->last.clients_total) {
        r->last_ns = tdp_cli_now_ns(); /* idle: the next line's rates start from here */
        return;
    }
    tdp_cli_rate_line(r, &now, stderr);
}

/* Wait for a reason to stop; print rate lines meanwhile. Returns the reason. */
static const char *wait_for_stop(tdp_server *s, const serve_args *a, const sigset_t *set)
{
    static char why[64];
    const uint64_t second = 1000000000ull, start = tdp_cli_now_ns();
    uint64_t deadline = a->duration_s > 0 ? start + (uint64_t)(a->duration_s * 1e9) : 0;
    uint64_t last_report = start;
    double interval = tdp_cli_interval(a->interval, a->quiet);
    /* no rate lines: wake once an hour all the same (nothing else to do then) */
    uint64_t period = interval > 0 ? (uint64_t)(interval * 1e9) : 3600 * second;
    tdp_cli_rate rate;
    tdp_cli_rate_start(&rate, "serve", TDP_CLI_RATE_CLIENTS, a->json, NULL);

    for (;;) {
        uint64_t now = tdp_cli_now_ns(), until = last_report + period;
        if (deadline != 0 && deadline < until)
            until = deadline;
        uint64_t wait = until > now ? until - now : 0;
        struct timespec ts = {(time_t)(wait / second), (long)(wait % second)};
        int sig = sigtimedwait(set, NULL, &ts);
        if (sig == SIGUSR1) {
            snprintf(why, sizeof(why), "%" PRIu64 " message%s handled", a->count,
                     tdp_cli_s(a->count));
            return why;
        }
        if (sig > 0) {
            snprintf(why, sizeof(why), "%s", sig == SIGINT ? "SIGINT" : "SIGTERM");
            return why;
        }
        now = tdp_cli_now_ns();
        if (deadline != 0 && now >= deadline) {
            snprintf(why, sizeof(why), "%g s elapsed", a->duration_s);
            return why;
        }
        if (now - last_report >= period) {
            if (interval > 0)
                report_totals(s, &rate);
            last_report = now;
        }
    }
}

static void print_final(tdp_server *s, serve_ctx *ctx, uint64_t ns, const char *why)
{
    tdp_server_stats st;
    char in[TDP_CLI_FMT_LEN], out[TDP_CLI_FMT_LEN];
    const char *verify = atomic_load(&ctx->checked) == 0 ? "off"
                         : atomic_load(&ctx->bad) > 0    ? "FAILED"
                                                         : "ok";
    tdp_server_stats_get(s, &st);
    if (ctx->args->json) {
        double sec = (double)ns / 1e9;
        json_t *o = json_object();
        json_object_set_new(o, "event", json_string("summary"));
        json_object_set_new(o, "cmd", json_string("serve"));
        json_object_set_new(o, "stopped", json_string(why));
        json_object_set_new(o, "elapsed_s", json_real(sec));
        json_object_set_new(o, "clients", json_integer((json_int_t)st.clients_total));
        json_object_set_new(o, "msgs_in", json_integer((json_int_t)st.msgs_recv));
        json_object_set_new(o, "bytes_in", json_integer((json_int_t)st.bytes_recv));
        json_object_set_new(o, "msgs_out", json_integer((json_int_t)st.msgs_sent));
        json_object_set_new(o, "bytes_out", json_integer((json_int_t)st.bytes_sent));
        json_object_set_new(o, "msgs_in_per_s",
                            json_real(sec > 0 ? (double)st.msgs_recv / sec : 0));
        json_object_set_new(o, "bytes_in_per_s",
                            json_real(sec > 0 ? (double)st.bytes_recv / sec : 0));
        json_object_set_new(o, "refused", json_integer((json_int_t)st.refused));
        json_object_set_new(o, "memory_refused", json_integer((json_int_t)st.memory_refused));
        json_object_set_new(o, "max_memory", json_integer((json_int_t)st.memory_cap));
        json_object_set_new(o, "handshakes_failed", json_integer((json_int_t)st.handshakes_failed));
        json_object_set_new(o, "client_errors", json_integer((json_int_t)st.client_errors));
        json_object_set_new(o, "handler_errors", json_integer((json_int_t)st.handler_errors));
        json_object_set_new(o, "verify",
                            json_string(atomic_load(&ctx->checked) == 0 ? "off"
                                        : atomic_load(&ctx->bad) > 0    ? "failed"
                                                                        : "ok"));
        json_object_set_new(o, "bad", json_integer((json_int_t)atomic_load(&ctx->bad)));
        json_object_set_new(o, "depth", json_integer(ctx->args->depth));
        tdp_cli_json_line(o, stdout);
        return;
    }
    printf("served %" PRIu64 " client%s in %.3f s: %" PRIu64 " message%s in (%s), %" PRIu64
           " out (%s); refused %" PRIu64 ", handshakes failed %" PRIu64 ", client errors %" PRIu64
           ", handler errors %" PRIu64 "; verify %s; depth %u\n",
           st.clients_total, tdp_cli_s(st.clients_total), (double)ns / 1e9, st.msgs_recv,
           tdp_cli_s(st.msgs_recv), tdp_cli_format_size(st.bytes_recv, in, sizeof(in)),
           st.msgs_sent, tdp_cli_format_size(st.bytes_sent, out, sizeof(out)), st.refused,
           st.handshakes_failed, st.client_errors, st.handler_errors, verify, ctx->args->depth);
}

/* Listen and start serving on a loop thread; on failure, the exit status. */
static int serve_start(const serve_args *a, serve_ctx *ctx, tdp_loop **loop, tdp_server **s)
{
    static const tdp_server_handler h = {
        .size = sizeof(tdp_server_handler),
        .on_connect = on_connect,
        .on_message = on_message,
        .on_close = on_close,
    };
    tdp_server_opts opts;
    tdp_err rc;

    tdp_server_opts_default(&opts);
    tdp_pipe_opts_default(&opts.pipe);
    opts.pipe.recv_depth = a->depth;
    opts.pipe.plane = a->plane;
    if (a->max_clients != 0)
        opts.max_clients = a->max_clients;
    if (a->max_pending != 0)
        opts.max_pending = a->max_pending;
    if (a->max_per_source != 0)
        opts.max_per_source = a->max_per_source;
    if (a->idle_timeout_ms != 0)
        opts.idle_timeout_ms = a->idle_timeout_ms;
    opts.max_memory = a->max_memory;
    tdp_cli_apply_net_opts(&a->ka, &opts.pipe);
    if ((rc = tdp_loop_new(NULL, loop)) != TDP_OK ||
        (rc = tdp_loop_start_thread(*loop)) != TDP_OK) {
        tdp_cli_error("serve", "cannot start the event loop: %s", tdp_strerror(rc));
        tdp_loop_free(*loop);
        return TDP_EXIT_FAIL;
    }
    if ((rc = tdp_server_new(*loop, a->bind, a->port, &opts, &h, ctx, s)) != TDP_OK) {
        tdp_loop_free(*loop);
        return tdp_cli_listen_failed("serve", a->bind, a->port, rc);
    }
    tdp_cli_print_listening(a->bind, tdp_server_port(*s));
    return TDP_EXIT_OK;
}

static void ignore_signal(int sig)
{
    (void)sig;
}

int tdp_cmd_serve(int argc, char **argv)
{
    serve_args a;
    tdp_loop *loop = NULL;
    tdp_server *s;
    sigset_t set;

    int ec = serve_parse(argc, argv, &a);
    if (ec >= 0)
        return ec;
    serve_ctx ctx = {.args = &a, .main_thread = pthread_self()};
    if (a.mode != MODE_AUTO &&
        tdp_cli_notice_new(a.mode == MODE_ECHO ? TDP_CLI_NOTICE_ECHOES : TDP_CLI_NOTICE_NO_ECHO,
                           a.mode == MODE_ECHO ? "tdpipe serve --mode echo"
                                               : "tdpipe serve --mode sink",
                           &ctx.notice) != TDP_OK)
        ctx.notice = NULL; /* refused clients then see only the close */

    /*
     * A handler, not SIG_IGN: an ignored signal is dropped even while
     * blocked, and a shell starts background jobs with SIGINT ignored. The
     * handler never runs (the signals stay blocked); sigtimedwait takes them.
     */
    struct sigaction sa = {.sa_handler = ignore_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
    /* blocked before any thread exists (the loop's, UCX's): all inherit it */
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, NULL);

    if ((ec = serve_start(&a, &ctx, &loop, &s)) != TDP_EXIT_OK) {
        tdp_td_unref(ctx.notice);
        return ec;
    }
    uint64_t t0 = tdp_cli_now_ns();
    const char *why = wait_for_stop(s, &a, &set);
    if (a.json) {
        json_t *o = json_object();
        json_object_set_new(o, "event", json_string("stopping"));
        json_object_set_new(o, "why", json_string(why));
        tdp_cli_json_line(o, stdout);
    } else {
        printf("stopping: %s\n", why);
    }

    tdp_err rc = tdp_server_shutdown(s, SHUTDOWN_MS);
    if (rc != TDP_OK)
        tdp_cli_error("serve", "shutdown: %s", tdp_strerror(rc));
    print_final(s, &ctx, tdp_cli_now_ns() - t0, why);
    tdp_server_free(s);
    tdp_loop_free(loop);
    tdp_td_unref(ctx.notice);

    if (rc == TDP_ETIMEDOUT)
        return TDP_EXIT_TIMEOUT;
    if (atomic_load(&ctx.bad) > 0)
        return TDP_EXIT_FAIL;
    return rc == TDP_OK ? TDP_EXIT_OK : TDP_EXIT_FAIL;
}
