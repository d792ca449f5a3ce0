/*
 * common.c: what every peer of tdp_peers shares — the clock, the scaling of
 * rounds by size (the same as tools/cmd_bench.c), the statistics, sizes,
 * and the JSON output.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "peers.h"
#include "bench_method.h"

uint64_t peers_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The method is tdpipe bench's own (tools/bench_method.c): same rounds, warm-up, summaries. */
int peers_lat_rounds(const peer_cfg *cfg, uint64_t bytes)
{
    return tdp_bm_lat_rounds(cfg->rounds, bytes);
}

int peers_lat_warm(int rounds)
{
    return tdp_bm_lat_warm(rounds);
}

int peers_tp_count(const peer_cfg *cfg, uint64_t bytes)
{
    return tdp_bm_tp_count(cfg->rounds, bytes);
}

int peers_tp_warm(int count)
{
    return tdp_bm_tp_warm(count);
}

void peers_lat_summary(double *samples, int n, size_result *res)
{
    tdp_bm_lat l;
    if (n <= 0)
        return;
    tdp_bm_lat_summary(samples, n, &l);
    res->lat_mean = l.mean;
    res->lat_min = l.min;
    res->lat_p50 = l.p50;
    res->lat_p99 = l.p99;
    res->lat_n = l.n;
}

void peers_tp_summary(size_result *res)
{
    tdp_bm_spread(res->tp_bps, PEERS_REPEATS, &res->tp_min, &res->tp_median, &res->tp_max);
}

void peers_result_init(size_result *res, uint64_t bytes)
{
    memset(res, 0, sizeof(*res));
    res->bytes = bytes;
    res->lat_mean = res->lat_p50 = res->lat_p99 = res->lat_min = -1;
    res->tp_median = res->tp_min = res->tp_max = -1;
    for (int i = 0; i < PEERS_REPEATS; i++)
        res->tp_bps[i] = -1;
}

bool peers_parse_sizes(const char *list, peer_cfg *cfg)
{
    char why[160];
    if (!tdp_bm_parse_size_list(list, PEERS_MIN_SIZE, 64ull << 30, cfg->sizes, PEERS_MAX_SIZES,
                                &cfg->nsizes, why, sizeof(why))) {
        fprintf(stderr, "tdp_peers: --sizes: %s\n", why);
        return false;
    }
    for (int i = 0; i < cfg->nsizes; i++)
        cfg->sizes[i] = tdp_bm_whole_floats(cfg->sizes[i]); /* as tdpipe bench */
    return true;
}

const char *peers_format_size(uint64_t bytes, char *buf, size_t len)
{
    static const char *const unit[] = {"B", "KB", "MB", "GB", "TB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1000 && u < 4) {
        v /= 1000;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    else
        snprintf(buf, len, v >= 100 ? "%.0f %s" : v >= 10 ? "%.1f %s" : "%.2f %s", v, unit[u]);
    return buf;
}

void peers_progress(const peer_cfg *cfg, const char *fmt, ...)
{
    if (cfg->quiet)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

/* A figure, or null where the peer does not measure it. */
static json_t *num(double v, int decimals)
{
    if (v < 0)
        return json_null();
    double scale = pow(10, decimals);
    return decimals == 0 ? json_integer((json_int_t)llround(v))
                         : json_real(round(v * scale) / scale);
}

int peers_write_json(const peer_cfg *cfg, const peer_ops *peer, const size_result *res, int n)
{
    char date[64];
    time_t t = time(NULL);
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
    json_t *config =
        json_pack("{s:i, s:i}", "cpus", (int)sysconf(_SC_NPROCESSORS_ONLN), "rounds", cfg->rounds);
    if (peer->describe != NULL)
        peer->describe(cfg, config);
    json_t *results = json_array();
    for (int i = 0; i < n; i++) {
        const size_result *r = &res[i];
        json_t *lat = json_pack("{s:o, s:o, s:o, s:o, s:i}", "mean", num(r->lat_mean, 3), "p50",
                                num(r->lat_p50, 3), "p99", num(r->lat_p99, 3), "min",
                                num(r->lat_min, 3), "n", r->lat_n);
        json_t *tp = json_pack("{s:o, s:o, s:o, s:i, s:I}", "median", num(r->tp_median, 0), "min",
                               num(r->tp_min, 0), "max", num(r->tp_max, 0), "repeats",
                               PEERS_REPEATS, "msgs_per_repeat", (json_int_t)r->tp_msgs);
        json_array_append_new(results, json_pack("{s:I, s:o, s:o}", "bytes", (json_int_t)r->bytes,
                                                 "latency_us", lat, "throughput_Bps", tp));
    }
    json_t *root =
        json_pack("{s:s, s:s, s:s, s:s, s:o, s:o}", "tool", "tdp_peers", "peer", peer->name,
                  "method", peer->method, "date", date, "config", config, "results", results);
    int rc = json_dump_file(root, cfg->json_path, JSON_INDENT(2) | JSON_REAL_PRECISION(12));
    if (rc != 0)
        fprintf(stderr, "tdp_peers: cannot write %s\n", cfg->json_path);
    json_decref(root);
    return rc == 0 ? 0 : 1;
}
