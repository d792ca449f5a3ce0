/*
 * table.c: `tdp_peers table FILE... [--json OUT]` — read the JSON of
 * `tdpipe bench` and of the peers, print one table (rows: figure and size;
 * columns: each tool, then tdpipe's ratio to each peer), check the goals
 * (docs/benchmarks.md), and write everything into one JSON file.
 *
 * A file's role comes from its contents: "tool": "tdpipe bench" with
 * config.busy_poll_us 0 (event-driven) or not (busy-poll); "tool":
 * "tdp_peers" with its "peer" (perftest split by config.wait, and by
 * config.err_mode: -e -E sleep, UCX's peer-failure mode). A role may
 * have several files (bench/run.sh --runs K): each figure is then the
 * median over the runs, and the spread rows cover all of them.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peers.h"

enum role { R_EV, R_BP, R_UCX_POLL, R_UCX_SLEEP, R_UCX_ERR, R_ZMQ, R_TCP, R_MEMCPY, NROLES };
static const char *const role_key[NROLES] = {
    "tdpipe", "tdpipe_busy_poll", "perftest_poll", "perftest_sleep", "perftest_sleep_err", "zmq",
    "tcp",    "memcpy",
};
static const char *const role_col[NROLES] = {
    "tdpipe", "tdpipe-bp", "ucx-poll", "ucx-sleep", "ucx-err", "zmq", "tcp", "memcpy",
};

#define MAX_RUNS        32
#define MAX_TABLE_SIZES 64
#define NRATIOS         6

typedef struct table {
    json_t *in[NROLES][MAX_RUNS];
    int nin[NROLES];
    uint64_t sizes[MAX_TABLE_SIZES];
    int nsizes;
    int max_runs;
} table;

static int role_of(json_t *root)
{
    const char *tool = json_string_value(json_object_get(root, "tool"));
    json_t *cfg = json_object_get(root, "config");
    if (tool != NULL && strcmp(tool, "tdpipe bench") == 0)
        return json_integer_value(json_object_get(cfg, "busy_poll_us")) > 0 ? R_BP : R_EV;
    const char *peer = json_string_value(json_object_get(root, "peer"));
    if (tool == NULL || peer == NULL || strcmp(tool, "tdp_peers") != 0)
        return -1;
    if (strcmp(peer, "perftest") == 0) {
        const char *w = json_string_value(json_object_get(cfg, "wait"));
        bool sleep = w != NULL && strcmp(w, "sleep") == 0;
        if (json_is_true(json_object_get(cfg, "err_mode")))
            return sleep ? R_UCX_ERR : -1; /* only the event-driven one has a column */
        return sleep ? R_UCX_SLEEP : R_UCX_POLL;
    }
    for (int r = R_ZMQ; r < NROLES; r++)
        if (strcmp(peer, role_key[r]) == 0)
            return r;
    return -1;
}

/* The results entry with this many bytes in one file, or NULL. */
static json_t *result_for(json_t *root, uint64_t bytes)
{
    json_t *res = json_object_get(root, "results"), *e;
    size_t i;
    json_array_foreach(res, i, e)
    {
        if ((uint64_t)json_integer_value(json_object_get(e, "bytes")) == bytes)
            return e;
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

enum agg { A_MEDIAN, A_MIN, A_MAX };

/* A figure ("latency_us"/"p50", ...) over the runs of role r, or NAN where none has it. */
static double fig(const table *t, int r, uint64_t bytes, const char *group, const char *key,
                  enum agg how)
{
    double v[MAX_RUNS];
    int n = 0;
    for (int k = 0; k < t->nin[r]; k++) {
        json_t *x = json_object_get(json_object_get(result_for(t->in[r][k], bytes), group), key);
        if (json_is_number(x))
            v[n++] = json_number_value(x);
    }
    if (n == 0)
        return NAN;
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    if (how != A_MEDIAN)
        return how == A_MIN ? v[0] : v[n - 1];
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

typedef double (*getter)(const table *t, int r, uint64_t bytes);

static double lat_p50(const table *t, int r, uint64_t b)
{
    return fig(t, r, b, "latency_us", "p50", A_MEDIAN);
}
static double lat_p99(const table *t, int r, uint64_t b)
{
    return fig(t, r, b, "latency_us", "p99", A_MEDIAN);
}
static double lat_spread(const table *t, int r, uint64_t b)
{
    double lo = fig(t, r, b, "latency_us", "p50", A_MIN),
           hi = fig(t, r, b, "latency_us", "p50", A_MAX), med = lat_p50(t, r, b);
    return med > 0 ? 100.0 * (hi - lo) / med : NAN;
}
static double tp_gbs(const table *t, int r, uint64_t b)
{
    return fig(t, r, b, "throughput_Bps", "median", A_MEDIAN) / 1e9;
}
static double tp_spread(const table *t, int r, uint64_t b)
{
    double lo = fig(t, r, b, "throughput_Bps", "min", A_MIN),
           hi = fig(t, r, b, "throughput_Bps", "max", A_MAX),
           med = fig(t, r, b, "throughput_Bps", "median", A_MEDIAN);
    return med > 0 ? 100.0 * (hi - lo) / med : NAN;
}

/* The ratio columns: tdpipe run `num` over peer `den`. */
typedef struct ratio_col {
    int num, den;
    const char *key; /* in the combined JSON */
} ratio_col;

static void ratio_cols(const table *t, ratio_col out[NRATIOS])
{
    int td = t->nin[R_BP] > 0 ? R_BP : R_EV;
    out[0] = (ratio_col){td, R_UCX_POLL,
                         td == R_BP ? "busy_poll_over_perftest_poll" : "event_over_perftest_poll"};
    out[1] = (ratio_col){R_EV, R_UCX_SLEEP, "event_over_perftest_sleep"};
    out[2] = (ratio_col){R_EV, R_UCX_ERR, "event_over_perftest_sleep_err"};
    out[3] = (ratio_col){R_EV, R_ZMQ, "event_over_zmq"};
    out[4] = (ratio_col){R_EV, R_TCP, "event_over_tcp"};
    out[5] = (ratio_col){R_EV, R_MEMCPY, "event_over_memcpy"}; /* last: it has no latency */
}

static double ratio(const table *t, getter g, int num, int den, uint64_t bytes)
{
    return g(t, num, bytes) / g(t, den, bytes); /* NAN when either is missing */
}

static void cell(double v, int width)
{
    if (isnan(v))
        printf(" %*s", width, "-");
    else
        printf(" %*.*f", width, fabs(v) >= 100 ? 1 : fabs(v) >= 1 ? 2 : 3, v);
}

/* One group of rows, a row per size; nratios: how many ratio columns apply. */
static void print_group(const table *t, const char *title, const char *short_name, getter g,
                        int nratios)
{
    ratio_col rc[NRATIOS];
    ratio_cols(t, rc);
    printf("%s\n", title);
    for (int i = 0; i < t->nsizes; i++) {
        char sz[32];
        uint64_t b = t->sizes[i];
        printf("  %-9s %-9s", peers_format_size(b, sz, sizeof(sz)), short_name);
        for (int r = 0; r < NROLES; r++)
            cell(g(t, r, b), 9);
        printf("  |");
        for (int c = 0; c < NRATIOS; c++)
            cell(c < nratios ? ratio(t, g, rc[c].num, rc[c].den, b) : NAN, 9);
        printf("\n");
    }
}

/* One of the goals: the ratio, the bound, and whether it is met. */
static json_t *target(const char *name, double ratio, const char *op, double goal)
{
    bool met = !isnan(ratio) && (op[0] == '>' ? ratio >= goal : ratio <= goal);
    printf("  %-60s %s %.2f: ", name, op, goal);
    if (isnan(ratio))
        printf("not measured\n");
    else
        printf("%.2f  %s\n", ratio, met ? "met" : "MISSED");
    return json_pack("{s:s, s:o, s:s, s:f, s:o}", "target", name, "ratio",
                     isnan(ratio) ? json_null() : json_real(ratio), "op", op, "goal", goal, "met",
                     isnan(ratio) ? json_null() : json_boolean(met));
}

static json_t *print_targets(const table *t)
{
    static const struct {
        const char *name;
        getter g;
        int num, den;
        uint64_t bytes;
        const char *op;
        double goal;
    } targets[] = {
        {"100 MB throughput, busy-poll tdpipe / am_bw (poll)", tp_gbs, R_BP, R_UCX_POLL, 100000000,
         ">=", 0.9},
        {"100 MB throughput, event-driven tdpipe / am_bw (poll)", tp_gbs, R_EV, R_UCX_POLL,
         100000000, ">=", 0.9},
        {"100 MB throughput, event-driven tdpipe / am_bw (-E sleep)", tp_gbs, R_EV, R_UCX_SLEEP,
         100000000, ">=", 0.9},
        {"1 KB latency p50, busy-poll tdpipe / am_lat (poll)", lat_p50, R_BP, R_UCX_POLL, 1000,
         "<=", 1.5},
        {"1 KB latency p50, event-driven tdpipe / am_lat (-E sleep)", lat_p50, R_EV, R_UCX_SLEEP,
         1000, "<=", 1.5},
        {"1 KB latency p50, event-driven tdpipe / am_lat (poll)", lat_p50, R_EV, R_UCX_POLL, 1000,
         "<=", 1.5},
        {"100 MB throughput, event-driven tdpipe / ZeroMQ", tp_gbs, R_EV, R_ZMQ, 100000000,
         ">=", 5.0},
        /* ZeroMQ over ipc next to a same-host plane, tcp next to ucx (bench/run.sh) */
        {"1 KB throughput, event-driven tdpipe / ZeroMQ", tp_gbs, R_EV, R_ZMQ, 1000, ">=", 1.0},
    };
    json_t *a = json_array();
    printf("\ngoals (ratio = tdpipe / peer):\n");
    for (size_t i = 0; i < sizeof(targets) / sizeof(targets[0]); i++)
        json_array_append_new(
            a, target(targets[i].name,
                      ratio(t, targets[i].g, targets[i].num, targets[i].den, targets[i].bytes),
                      targets[i].op, targets[i].goal));
    /* the shm plane's own goals: faster than the transport, size-independent hand-off */
    const char *plane = NULL;
    for (int r = R_EV; r <= R_BP && plane == NULL; r++)
        if (t->nin[r] > 0)
            plane = json_string_value(
                json_object_get(json_object_get(t->in[r][0], "config"), "plane"));
    if (plane != NULL && strcmp(plane, "shm") == 0) {
        json_array_append_new(a, target("shm plane: 1 KB latency p50, busy-poll tdpipe / am_lat (poll)",
                                        ratio(t, lat_p50, R_BP, R_UCX_POLL, 1000), "<=", 1.0));
        json_array_append_new(
            a, target("shm plane: busy-poll tdpipe latency p50, 100 MB / 1 KB",
                      lat_p50(t, R_BP, 100000000) / lat_p50(t, R_BP, 1000), "<=", 2.0));
    }
    if (t->nin[R_BP] == 0)
        printf("  (no busy-poll tdpipe run: bench/run.sh --busy-poll US adds one)\n");
    return a;
}

static json_t *num_or_null(double v)
{
    return isnan(v) ? json_null() : json_real(v);
}

static json_t *summary(const table *t)
{
    static const struct {
        const char *key;
        getter g;
        double scale;
    } figs[] = {{"latency_p50_us", lat_p50, 1},
                {"latency_p99_us", lat_p99, 1},
                {"latency_p50_spread_pct", lat_spread, 1},
                {"throughput_Bps", tp_gbs, 1e9},
                {"throughput_spread_pct", tp_spread, 1}};
    ratio_col rc[NRATIOS];
    ratio_cols(t, rc);
    json_t *rows = json_array();
    for (int i = 0; i < t->nsizes; i++) {
        uint64_t b = t->sizes[i];
        json_t *row = json_pack("{s:I}", "bytes", (json_int_t)b);
        for (size_t f = 0; f < sizeof(figs) / sizeof(figs[0]); f++) {
            json_t *o = json_object();
            for (int r = 0; r < NROLES; r++)
                if (t->nin[r] > 0)
                    json_object_set_new(o, role_key[r],
                                        num_or_null(figs[f].g(t, r, b) * figs[f].scale));
            json_object_set_new(row, figs[f].key, o);
        }
        json_t *rl = json_object(), *rt = json_object();
        for (int c = 0; c < NRATIOS; c++) {
            if (c < NRATIOS - 1) /* memcpy has no latency to compare with */
                json_object_set_new(rl, rc[c].key,
                                    num_or_null(ratio(t, lat_p50, rc[c].num, rc[c].den, b)));
            json_object_set_new(rt, rc[c].key,
                                num_or_null(ratio(t, tp_gbs, rc[c].num, rc[c].den, b)));
        }
        json_object_set_new(row, "ratio_latency_p50", rl);
        json_object_set_new(row, "ratio_throughput", rt);
        json_array_append_new(rows, row);
    }
    return rows;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void add_sizes(table *t, json_t *root)
{
    json_t *res = json_object_get(root, "results"), *e;
    size_t i;
    json_array_foreach(res, i, e)
    {
        uint64_t b = (uint64_t)json_integer_value(json_object_get(e, "bytes"));
        bool seen = false;
        for (int k = 0; k < t->nsizes; k++)
            seen = seen || t->sizes[k] == b;
        if (!seen && t->nsizes < MAX_TABLE_SIZES)
            t->sizes[t->nsizes++] = b;
    }
}

static void free_table(table *t)
{
    for (int r = 0; r < NROLES; r++)
        for (int k = 0; k < t->nin[r]; k++)
            json_decref(t->in[r][k]);
}

static void print_table(const table *t, const char *tls, const char *ucxv, json_int_t cpus,
                        const char *date)
{
    ratio_col rc[NRATIOS];
    ratio_cols(t, rc);
    printf("\ntdpipe and its peers on loopback: UCX %s, UCX_TLS=%s, %lld CPUs, %s\n",
           ucxv ? ucxv : "?", tls ? tls : "?", (long long)cpus, date);
    printf("tdpipe = event-driven; tdpipe-bp = busy-poll%s; ucx = ucx_perftest "
           "ucp_am_lat/ucp_am_bw (poll: busy-polling, its default; sleep: -E sleep; "
           "err: -E sleep -e, UCX's peer-failure mode%s)\n",
           t->nin[R_BP] > 0 ? "" : " (not run)", t->nin[R_UCX_ERR] > 0 ? "" : ", not run");
    if (t->max_runs > 1)
        printf("each figure is the median over %d runs (bench/run.sh --runs); spreads cover "
               "all runs\n",
               t->max_runs);
    printf("\n  %-9s %-9s", "size", "figure");
    for (int r = 0; r < NROLES; r++)
        printf(" %9s", role_col[r]);
    printf("  | %9s %9s %9s %9s %9s %9s\n", rc[0].num == R_BP ? "bp/ucx-p" : "td/ucx-p", "td/ucx-s",
           "td/ucx-e", "td/zmq", "td/tcp", "td/memcpy");
    print_group(t,
                "latency, one-way (half a ping-pong), p50, us; memcpy: one copy; "
                "ratio: lower is better",
                "lat p50", lat_p50, NRATIOS - 1);
    print_group(t, "latency p99, us", "lat p99", lat_p99, 0);
    if (t->max_runs > 1)
        print_group(t, "latency p50 spread over the runs, (max - min) / median, %", "spread %",
                    lat_spread, 0);
    print_group(t,
                "throughput, timed on the receiver, median of 3 repeats, GB/s (1e9 B/s); "
                "ratio: higher is better",
                "tput", tp_gbs, NRATIOS);
    print_group(t, "throughput spread over the repeats, (max - min) / median, %", "spread %",
                tp_spread, 0);
    printf("  (ratios: td = event-driven tdpipe%s; ucx-p = perftest poll, "
           "ucx-s = perftest -E sleep, ucx-e = perftest -E sleep -e)\n",
           rc[0].num == R_BP ? ", bp = busy-poll tdpipe" : "");
}

int peers_table_main(int argc, char **argv)
{
    table t;
    memset(&t, 0, sizeof(t));
    const char *out = NULL;
    int rc = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
            out = argv[++i];
            continue;
        }
        json_error_t err;
        json_t *root = json_load_file(argv[i], 0, &err);
        int r = root ? role_of(root) : -1;
        if (r < 0 || t.nin[r] == MAX_RUNS) {
            fprintf(stderr, "tdp_peers table: %s: %s\n", argv[i],
                    root == NULL ? err.text
                    : r < 0      ? "not a tdpipe bench or tdp_peers result"
                                 : "too many runs");
            json_decref(root);
            rc = 1;
            continue;
        }
        t.in[r][t.nin[r]++] = root;
        t.max_runs = t.nin[r] > t.max_runs ? t.nin[r] : t.max_runs;
        add_sizes(&t, root);
    }
    if (t.nin[R_EV] == 0 && t.nin[R_BP] == 0) {
        fprintf(stderr, "tdp_peers table: no tdpipe bench results among the files\n");
        free_table(&t);
        return 1;
    }
    qsort(t.sizes, (size_t)t.nsizes, sizeof(uint64_t), cmp_u64);

    json_t *td = t.nin[R_EV] > 0 ? t.in[R_EV][0] : t.in[R_BP][0];
    const char *tls = json_string_value(json_object_get(json_object_get(td, "ucx"), "tls"));
    const char *ucxv = json_string_value(json_object_get(json_object_get(td, "ucx"), "version"));
    json_int_t cpus = json_integer_value(json_object_get(json_object_get(td, "config"), "cpus"));
    json_int_t bp = t.nin[R_BP] == 0
                        ? 0
                        : json_integer_value(json_object_get(
                              json_object_get(t.in[R_BP][0], "config"), "busy_poll_us"));
    char date[64];
    time_t now = time(NULL);
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));

    print_table(&t, tls, ucxv, cpus, date);
    json_t *targets = print_targets(&t);

    if (out != NULL) {
        json_t *inputs = json_object();
        for (int r = 0; r < NROLES; r++) {
            if (t.nin[r] == 0)
                continue;
            json_t *runs = json_array();
            for (int k = 0; k < t.nin[r]; k++)
                json_array_append(runs, t.in[r][k]);
            json_object_set_new(inputs, role_key[r], runs);
        }
        json_t *root =
            json_pack("{s:s, s:s, s:s, s:s, s:I, s:I, s:i, s:o, s:o, s:o}", "tool", "bench/run.sh",
                      "date", date, "ucx_version", ucxv ? ucxv : "?", "ucx_tls", tls ? tls : "?",
                      "cpus", cpus, "busy_poll_us", bp, "runs", t.max_runs, "summary", summary(&t),
                      "targets", targets, "inputs", inputs);
        if (json_dump_file(root, out, JSON_INDENT(2) | JSON_REAL_PRECISION(8)) != 0) {
            fprintf(stderr, "tdp_peers table: cannot write %s\n", out);
            rc = 1;
        }
        json_decref(root);
    } else {
        json_decref(targets);
    }
    free_table(&t);
    return rc;
}
