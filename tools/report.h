/*
 * report.h: what `send`, `recv` and `serve` print while they run and when
 * they end — the rate line every --interval seconds on stderr, and the
 * pieces of the final summary (text or, with --json, one JSON object on
 * stdout). docs/cli.md describes the output; this file is its one source.
 *
 * Rate lines, text:
 *   send: 2.00 s, 1500 messages, 500 msgs/s, 2.05 GB/s, 12 credit waits
 *   recv: 2.00 s, 1500 messages, 500 msgs/s, 2.05 GB/s
 *   serve: 2.00 s, 1 client (3 total), in 1500 messages, 500 msgs/s, 2.05 GB/s;
 *          out 1500 messages, 500 msgs/s, 2.05 GB/s                  (one line)
 * and with --json, one object per line with the same figures:
 *   {"cmd": "send", "elapsed_s": 2.0, "msgs": 1500, "bytes": ..., "msgs_per_s": 500.0,
 *    "bytes_per_s": ..., "credit_waits": 12}
 *   serve: "clients", "clients_total", "msgs_out", "bytes_out", "msgs_out_per_s",
 *   "bytes_out_per_s" besides.
 * Rates are over the last interval, counts since the start.
 */
#ifndef TDPIPE_TOOLS_REPORT_H
#define TDPIPE_TOOLS_REPORT_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <tdpipe/tdpipe.h>

#include "cli.h"

/* ---- --interval and --json ------------------------------------------------- */

/* --interval not given (tdp_cli_interval then picks the default). */
#define TDP_CLI_INTERVAL_UNSET (-1.0)

/*
 * Parse --interval S: 0 (no rate lines) or 0.01 to 1e6 seconds. False on
 * anything else.
 */
bool tdp_cli_parse_interval(const char *s, double *out);

/*
 * The interval a command uses, in seconds (0: no rate lines): the one
 * given, else none with -q, else 1 s when stderr is a terminal and none
 * when it is not (a log file or a pipe gets the summary only).
 */
double tdp_cli_interval(double given, bool quiet);

/* ---- rate lines ------------------------------------------------------------ */

/* One reading of the counters a rate line shows (totals since the start). */
/* One peer's counters in a rate line (send to several receivers). */
#define TDP_CLI_RATE_PEERS_MAX 16
typedef struct tdp_cli_peer_sample {
    char name[64];
    uint64_t msgs, bytes, drops;
} tdp_cli_peer_sample;

typedef struct tdp_cli_sample {
    uint64_t msgs, bytes;            /* sent (send) or received (recv, serve) */
    uint64_t msgs_out, bytes_out;    /* serve: sent back */
    uint64_t credit_waits;           /* send */
    uint64_t clients, clients_total; /* serve */
    uint32_t npeers;                 /* send to several receivers: the first ones' figures */
    tdp_cli_peer_sample peers[TDP_CLI_RATE_PEERS_MAX];
} tdp_cli_sample;

/* What a command's rate line shows besides time, messages and rates. */
enum {
    TDP_CLI_RATE_CREDIT = 1u << 0,  /* credit waits (send) */
    TDP_CLI_RATE_CLIENTS = 1u << 1, /* clients and the way out (serve) */
};

/* Formats rate lines: the figures since the last one. Not thread-safe. */
typedef struct tdp_cli_rate {
    const char *cmd;
    unsigned fields;
    bool json;
    uint64_t start_ns, last_ns;
    tdp_cli_sample last;
} tdp_cli_rate;

/* Start counting time now, from the counters in *zero (NULL: all 0). */
void tdp_cli_rate_start(tdp_cli_rate *r, const char *cmd, unsigned fields, bool json,
                        const tdp_cli_sample *zero);

/* Print one rate line for the counters in *now on f, and start the next interval. */
void tdp_cli_rate_line(tdp_cli_rate *r, const tdp_cli_sample *now, FILE *f);

/*
 * A thread that reads the counters (sample(arg, out), from its own thread:
 * it must be thread-safe, as tdp_pipe_stats_get is) and prints a rate line
 * on stderr every interval_s seconds. NULL (and no thread) for interval 0
 * or when the thread cannot be started; tdp_cli_ticker_stop(NULL) does
 * nothing. Start it after tdp_cli_catch_signals, so it has the signals
 * blocked like every other thread.
 */
typedef struct tdp_cli_ticker tdp_cli_ticker;
typedef void (*tdp_cli_sample_fn)(void *arg, tdp_cli_sample *out);
tdp_cli_ticker *tdp_cli_ticker_start(const char *cmd, unsigned fields, bool json, double interval_s,
                                     tdp_cli_sample_fn sample, void *arg);
/* Stop and join the thread (at most one sample's time), free it. */
void tdp_cli_ticker_stop(tdp_cli_ticker *t);

/* A pipe's counters, for the ticker: arg is the tdp_pipe, sending or receiving. */
void tdp_cli_sample_send(void *pipe, tdp_cli_sample *out);
void tdp_cli_sample_recv(void *pipe, tdp_cli_sample *out);

/* ---- summaries ------------------------------------------------------------- */

/*
 * "min 12.3 us, p50 15.0 us, p99 30.1 us, p99.9 45.0 us, max 60.2 us" for a
 * histogram of nanoseconds, into buf; "none" while it is empty.
 */
const char *tdp_cli_hist_text(const tdp_hist *h, char *buf, size_t len);

/*
 * {"count", "min", "p50", "p90", "p99", "p999", "max", "mean"} of a
 * histogram of nanoseconds (integers; mean a real). New reference.
 */
json_t *tdp_cli_hist_json(const tdp_hist *h);

/*
 * A meter's totals as JSON fields set on obj: "msgs", "bytes",
 * "elapsed_s" (start to now_ns), "msgs_per_s", "bytes_per_s".
 */
void tdp_cli_meter_json(json_t *obj, const tdp_cli_meter *m, uint64_t now_ns);

/*
 * Print obj as one line (compact JSON and a newline) on f in one write,
 * so lines from two threads never mix; takes obj's reference. A value
 * that jansson cannot encode prints nothing and returns false.
 */
bool tdp_cli_json_line(json_t *obj, FILE *f);

#endif /* TDPIPE_TOOLS_REPORT_H */
