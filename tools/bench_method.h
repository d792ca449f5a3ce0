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
#include <stdint.h>

/* Ping-pongs for a size: `rounds` if > 0, else about 1 GiB each way (10..2000). */
int tdp_bm_lat_rounds(int rounds, uint64_t bytes);
/* Untimed ping-pongs before those. */
int tdp_bm_lat_warm(int rounds);
/* Messages per throughput repeat: `rounds` if > 0, else about 2 GiB (20..20000). */
int tdp_bm_tp_count(int rounds, uint64_t bytes);
/* Messages of a repeat before the receiver's clock starts. */
int tdp_bm_tp_warm(int count);

/* Latency summary of n samples (sorted in place): mean, p50, p99, min. */
typedef struct tdp_bm_lat {
    double mean, p50, p99, min;
    int n;
} tdp_bm_lat;
void tdp_bm_lat_summary(double *samples, int n, tdp_bm_lat *out);

/* min, median and max of n values (n >= 1; the values are not changed). */
void tdp_bm_spread(const double *v, int n, double *min, double *median, double *max);

/*
 * A byte count with an optional unit, case-insensitive, space allowed:
 * B or none; KB MB GB TB (K M G T) = 1000^n; KiB MiB GiB TiB = 1024^n.
 * Fractions only when they come to whole bytes. False on anything else.
 */
bool tdp_bm_parse_size(const char *s, uint64_t *out);

#endif
