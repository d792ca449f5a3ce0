/* bench_method.c: the measuring rules shared by tdpipe bench and bench/. */
#include "bench_method.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

int tdp_bm_lat_rounds(int rounds, uint64_t bytes)
{
    if (rounds > 0)
        return rounds;
    uint64_t r = (1ull << 30) / (bytes ? bytes : 1); /* about 1 GiB each way */
    return (int)(r < 10 ? 10 : r > 2000 ? 2000 : r);
}

int tdp_bm_lat_warm(int rounds)
{
    return rounds / 10 + 2;
}

int tdp_bm_tp_count(int rounds, uint64_t bytes)
{
    if (rounds > 0)
        return rounds;
    uint64_t r = (2ull << 30) / (bytes ? bytes : 1); /* about 2 GiB per repeat */
    return (int)(r < 20 ? 20 : r > 20000 ? 20000 : r);
}

int tdp_bm_tp_warm(int count)
{
    return count / 10 + 1;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void tdp_bm_lat_summary(double *samples, int n, tdp_bm_lat *out)
{
    if (n <= 0)
        return;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += samples[i];
    qsort(samples, (size_t)n, sizeof(double), cmp_double);
    out->mean = sum / n;
    out->min = samples[0];
    out->p50 = samples[n / 2];
    out->p99 = samples[(int)((n - 1) * 0.99)];
    out->n = n;
}

void tdp_bm_spread(const double *v, int n, double *min, double *median, double *max)
{
    double s[64];
    if (n <= 0 || n > 64)
        return;
    memcpy(s, v, (size_t)n * sizeof(double));
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    *min = s[0];
    *median = s[n / 2];
    *max = s[n - 1];
}

static bool size_unit(const char *u, uint64_t *mult)
{
    static const struct {
        const char *name;
        uint64_t mult;
    } units[] = {
        {"", 1},
        {"b", 1},
        {"k", 1000ull},
        {"kb", 1000ull},
        {"kib", 1ull << 10},
        {"m", 1000000ull},
        {"mb", 1000000ull},
        {"mib", 1ull << 20},
        {"g", 1000000000ull},
        {"gb", 1000000000ull},
        {"gib", 1ull << 30},
        {"t", 1000000000000ull},
        {"tb", 1000000000000ull},
        {"tib", 1ull << 40},
    };
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (strcasecmp(u, units[i].name) == 0) {
            *mult = units[i].mult;
            return true;
        }
    }
    return false;
}

bool tdp_bm_parse_size(const char *s, uint64_t *out)
{
    /* Exact integer arithmetic: strtod would round large byte counts. */
    typedef unsigned __int128 u128;
    const u128 limit = UINT64_MAX;
    u128 whole = 0, frac = 0, scale = 1;
    const char *p = s;

    if (s == NULL || !(isdigit((unsigned char)*p) || *p == '.'))
        return false;
    for (; isdigit((unsigned char)*p); p++) {
        whole = whole * 10 + (u128)(*p - '0');
        if (whole > limit)
            return false;
    }
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p) && p - 1 == s)
            return false; /* "." alone */
        for (int n = 0; isdigit((unsigned char)*p); p++, n++) {
            if (n >= 18)
                return false; /* more precision than any byte count needs */
            frac = frac * 10 + (u128)(*p - '0');
            scale *= 10;
        }
    }
    while (*p == ' ')
        p++;
    uint64_t mult;
    if (!size_unit(p, &mult))
        return false;
    u128 v = whole * mult;
    if (v > limit || (frac * mult) % scale != 0)
        return false; /* overflow, or not a whole number of bytes */
    v += frac * mult / scale;
    if (v > limit)
        return false;
    *out = (uint64_t)v;
    return true;
}
