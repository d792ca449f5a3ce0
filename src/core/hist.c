/*
 * hist.c: the log-linear latency histogram of stats.h.
 *
 * Bucket of v: with s = max(0, msb(v) - 5), index = 32 s + (v >> s). For
 * v < 64, s = 0 and the index is v itself; above, v >> s is 32..63, so
 * every power of two gets 32 buckets of width 2^s.
 */
#include <string.h>

#include <tdpipe/stats.h>

#define SUB (1u << TDP_HIST_SUB_BITS)

static unsigned bucket_shift(uint64_t v)
{
    if (v < 2 * SUB)
        return 0;
    unsigned msb = 63u - (unsigned)__builtin_clzll(v);
    return msb - TDP_HIST_SUB_BITS;
}

static unsigned bucket_of(uint64_t v)
{
    unsigned s = bucket_shift(v);
    return (s << TDP_HIST_SUB_BITS) + (unsigned)(v >> s);
}

/* The largest value bucket i holds. */
static uint64_t bucket_high(unsigned i)
{
    if (i < 2 * SUB)
        return i;
    unsigned s = (i >> TDP_HIST_SUB_BITS) - 1;
    uint64_t m = i - ((uint64_t)s << TDP_HIST_SUB_BITS); /* 32..63 */
    return (m << s) + ((UINT64_C(1) << s) - 1);          /* no overflow at the top */
}

void tdp_hist_reset(tdp_hist *h)
{
    if (h != NULL)
        memset(h, 0, sizeof(*h));
}

void tdp_hist_record(tdp_hist *h, uint64_t value)
{
    h->buckets[bucket_of(value)]++;
    if (h->count == 0 || value < h->min)
        h->min = value;
    if (value > h->max)
        h->max = value;
    h->count++;
    h->sum += (double)value;
}

void tdp_hist_merge(tdp_hist *dst, const tdp_hist *src)
{
    if (dst == NULL || src == NULL || src->count == 0)
        return;
    if (dst->count == 0 || src->min < dst->min)
        dst->min = src->min;
    if (src->max > dst->max)
        dst->max = src->max;
    dst->sum += src->sum;
    uint64_t n = src->count; /* read before: dst may be src */
    for (unsigned i = 0; i < TDP_HIST_BUCKETS; i++)
        dst->buckets[i] += src->buckets[i];
    dst->count += n;
}

double tdp_hist_mean(const tdp_hist *h)
{
    return h == NULL || h->count == 0 ? 0 : h->sum / (double)h->count;
}

uint64_t tdp_hist_percentile(const tdp_hist *h, double pct)
{
    if (h == NULL || h->count == 0)
        return 0;
    if (!(pct > 0)) /* NaN too */
        return h->min;
    if (pct >= 100)
        return h->max;
    /*
     * The rank-th smallest value, 1-based: the nearest-rank definition.
     * The margin keeps a product that should be whole (99.9 % of 1000)
     * from rounding up past it.
     */
    double r = pct * (double)h->count / 100.0;
    uint64_t rank = (uint64_t)r;
    if ((double)rank < r - r * 1e-12)
        rank++;
    if (rank < 1)
        rank = 1;
    uint64_t seen = 0;
    for (unsigned i = 0; i < TDP_HIST_BUCKETS; i++) {
        seen += h->buckets[i];
        if (seen >= rank) {
            uint64_t v = bucket_high(i);
            return v > h->max ? h->max : v < h->min ? h->min : v;
        }
    }
    return h->max; /* buckets edited by hand to fewer than count */
}

void tdp_hist_summarize(const tdp_hist *h, tdp_hist_summary *out)
{
    if (out == NULL)
        return;
    *out = (tdp_hist_summary){0};
    if (h == NULL || h->count == 0)
        return;
    out->count = h->count;
    out->min = h->min;
    out->max = h->max;
    out->mean = tdp_hist_mean(h);
    out->p50 = tdp_hist_percentile(h, 50);
    out->p90 = tdp_hist_percentile(h, 90);
    out->p99 = tdp_hist_percentile(h, 99);
    out->p999 = tdp_hist_percentile(h, 99.9);
}
