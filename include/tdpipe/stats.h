/*
 * stats.h: a latency histogram an application can keep itself and the
 * pipe keeps when asked (tdp_pipe_opts.latency_stats, tdp_pipe_latency_get).
 *
 * Log-linear buckets: values below 64 are counted exactly; above, every
 * power of two is split into 32 buckets, so a value read back (a
 * percentile) is within 1/32 (about 3 %) of what was recorded, from 0 to
 * UINT64_MAX. The struct is plain data of fixed size (about 15 KB):
 * recording allocates nothing and takes a few instructions; copy it, keep
 * it on the stack, merge it.
 *
 * Threading: none inside. A tdp_hist is the caller's to guard; the pipe's
 * own are read with tdp_pipe_latency_get, which copies them safely.
 *
 * Units are the caller's choice; the pipe records nanoseconds.
 */
#ifndef TDPIPE_STATS_H
#define TDPIPE_STATS_H

#include <tdpipe/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Buckets per power of two above the exact range, as a power of two. */
#define TDP_HIST_SUB_BITS 5
/* Buckets in all: 64 exact values, then 32 per power of two up to 2^64. */
#define TDP_HIST_BUCKETS ((64 - TDP_HIST_SUB_BITS + 1) << TDP_HIST_SUB_BITS)

/*
 * Zero-initialised ({0} or tdp_hist_reset) it is an empty histogram. count,
 * min, max and sum may be read directly; min and max are 0 while empty.
 * sum is a double: exact for totals up to 2^53.
 */
typedef struct tdp_hist {
    uint64_t count;
    uint64_t min, max;
    double sum;
    uint64_t buckets[TDP_HIST_BUCKETS];
} tdp_hist;

/* Empty h. */
TDP_API void tdp_hist_reset(tdp_hist *h);

/* Count one value. Never allocates, never fails. */
TDP_API void tdp_hist_record(tdp_hist *h, uint64_t value);

/* Add everything src counted to dst (src unchanged; dst == src doubles it). */
TDP_API void tdp_hist_merge(tdp_hist *dst, const tdp_hist *src);

/* The arithmetic mean of the values counted; 0 while empty. */
TDP_API double tdp_hist_mean(const tdp_hist *h);

/*
 * The value at or below which pct percent (0..100, clamped) of the values
 * fall: the upper end of the bucket holding that rank, clamped to
 * [min, max], so it never overstates by more than a bucket's width (1/32
 * of the value) and 0 gives min, 100 gives max exactly. 0 while empty.
 */
TDP_API uint64_t tdp_hist_percentile(const tdp_hist *h, double pct);

/* The figures a report shows, read from a histogram at once. */
typedef struct tdp_hist_summary {
    uint64_t count;
    uint64_t min, p50, p90, p99, p999, max; /* p999: the 99.9th percentile */
    double mean;
} tdp_hist_summary;

/* Fill *out from h (all zero while h is empty). */
TDP_API void tdp_hist_summarize(const tdp_hist *h, tdp_hist_summary *out);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_STATS_H */
