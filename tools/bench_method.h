/*
 * bench_method.h: the measuring rules `tdpipe bench` and bench/'s peers
 * share, so every figure in one table comes from the same method: how many
 * rounds a size gets, how many of them warm up, how samples are summarised,
 * and how a size is written. No dependency on the library: bench/tdp_peers
 * compiles this file too.
 */
#ifndef TDPIPE_TOOLS_BENCH_METHOD_H
#define TDPIPE_TOOLS_BENCH_METHOD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Ping-pongs for a size: `rounds` if > 0, else about 1 GiB each way (10..2000). */
int tdp_bm_lat_rounds(int rounds, uint64_t bytes);
/* Untimed ping-pongs before those. */
int tdp_bm_lat_warm(int rounds);
/* Messages per throughput repeat: `rounds` if > 0, else about 2 GiB (20..20000). */
int tdp_bm_tp_count(int rounds, uint64_t bytes);
/* Messages of a repeat before the receiver's clock starts. */
int tdp_bm_tp_warm(int count);

/*
 * Latency summary of n samples (sorted in place): mean, p50, p99, p99.9,
 * min. A percentile is the sample at rank floor((n - 1) x p): below 100
 * samples p99 is the maximum, below 1000 p99.9 is.
 */
typedef struct tdp_bm_lat {
    double mean, p50, p99, p999, min;
    int n;
} tdp_bm_lat;
void tdp_bm_lat_summary(double *samples, int n, tdp_bm_lat *out);

/* min, median and max of n values (n >= 1; the values are not changed). */
void tdp_bm_spread(const double *v, int n, double *min, double *median, double *max);

/*
 * A byte count: a number (digits, optionally a decimal fraction) and an
 * optional unit, with or without a space between:
 *   none or B              bytes
 *   K, M, G, T (+ B)       SI, 1000^1..4: 1K = 1KB = 1000
 *   Ki, Mi, Gi, Ti (+ B)   IEC, 1024^1..4: 1Ki = 1KiB = 1024
 * The prefix and the i are case-insensitive; the B must be upper case: a
 * lower-case b means bits ("1Mb"), and is refused. A fraction must come to
 * a whole number of bytes ("1.5KB" = 1500; "1.5B" is refused). False on
 * anything else; *why (if not NULL) then says what, in a few words.
 */
bool tdp_bm_parse_size(const char *s, uint64_t *out);
bool tdp_bm_parse_size_why(const char *s, uint64_t *out, const char **why);

/*
 * A comma-separated list of sizes, each in [min, max], at most max_n: no
 * empty element ("1KB,,1MB" and a trailing comma are refused). On failure
 * why (len bytes) says which element and what is wrong.
 */
bool tdp_bm_parse_size_list(const char *list, uint64_t min, uint64_t max, uint64_t *out, int max_n,
                            int *n, char *why, size_t len);

/*
 * The message size for a requested size: whole float32 elements, so
 * rounded up to a multiple of 4 (saturating). `tdpipe send`, `tdpipe
 * bench` and bench/'s peers all use it.
 */
uint64_t tdp_bm_whole_floats(uint64_t bytes);

#endif
