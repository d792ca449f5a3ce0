/* bench_method.c: the measuring rules shared by tdpipe bench and bench/. */
#include "bench_method.h"

#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
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
    out->p999 = samples[(int)((n - 1) * 0.999)];
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

/*
 * The unit after the number: "" or "B"; a prefix K/M/G/T (any case),
 * optionally "i" (any case), optionally "B". *mult on success.
 */
static bool size_unit(const char *u, uint64_t *mult, const char **why)
{
    static const char prefixes[] = "kmgt";
    uint64_t si = 1, iec = 1;
    bool binary = false;

    if (*u != '\0' && *u != 'B' && *u != 'b') {
        const char *p = strchr(prefixes, tolower((unsigned char)*u));
        if (p == NULL) {
            *why = "unknown unit (B; K, M, G, T = 1000^n; Ki, Mi, Gi, Ti = 1024^n)";
            return false;
        }
        for (const char *q = prefixes; q <= p; q++) {
            si *= 1000;
            iec *= 1024;
        }
        u++;
        if (*u == 'i' || *u == 'I') {
            binary = true;
            u++;
        }
    }
    if (*u == 'b') {
        *why = "a lower-case b means bits: sizes are bytes, write B";
        return false;
    }
    if (*u == 'B')
        u++;
    if (*u != '\0') {
        *why = "unknown unit (B; K, M, G, T = 1000^n; Ki, Mi, Gi, Ti = 1024^n)";
        return false;
    }
    *mult = binary ? iec : si;
    return true;
}

bool tdp_bm_parse_size_why(const char *s, uint64_t *out, const char **why)
{
    /* Exact integer arithmetic: strtod would round large byte counts. */
    typedef unsigned __int128 u128;
    const u128 limit = UINT64_MAX;
    u128 whole = 0, frac = 0, scale = 1;
    const char *p = s, *dummy;

    if (why == NULL)
        why = &dummy;
    *why = "not a number";
    if (s == NULL || !(isdigit((unsigned char)*p) || *p == '.'))
        return false;
    for (; isdigit((unsigned char)*p); p++) {
        whole = whole * 10 + (u128)(*p - '0');
        if (whole > limit) {
            *why = "too large";
            return false;
        }
    }
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p))
            return false; /* "." alone, or "1." */
        for (int n = 0; isdigit((unsigned char)*p); p++, n++) {
            if (n >= 18) {
                *why = "more decimals than any byte count needs";
                return false;
            }
            frac = frac * 10 + (u128)(*p - '0');
            scale *= 10;
        }
    }
    while (*p == ' ')
        p++;
    uint64_t mult;
    if (!size_unit(p, &mult, why))
        return false;
    u128 v = whole * mult;
    if (v > limit) {
        *why = "too large";
        return false;
    }
    if ((frac * mult) % scale != 0) {
        *why = "not a whole number of bytes";
        return false;
    }
    v += frac * mult / scale;
    if (v > limit) {
        *why = "too large";
        return false;
    }
    *out = (uint64_t)v;
    return true;
}

bool tdp_bm_parse_size(const char *s, uint64_t *out)
{
    return tdp_bm_parse_size_why(s, out, NULL);
}

/* A bound for a message: "128 B", "64 GiB". */
static const char *fmt_bound(uint64_t v, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (u < 4 && v >= 1024 && v % 1024 == 0) {
        v /= 1024;
        u++;
    }
    snprintf(buf, len, "%" PRIu64 " %s", v, units[u]);
    return buf;
}

bool tdp_bm_parse_size_list(const char *list, uint64_t min, uint64_t max, uint64_t *out, int max_n,
                            int *n, char *why, size_t len)
{
    char tok[64];
    const char *p = list, *reason;
    int count = 0;

    if (list == NULL || *list == '\0') {
        snprintf(why, len, "no sizes given");
        return false;
    }
    for (;;) {
        const char *end = strchr(p, ',');
        size_t tl = end != NULL ? (size_t)(end - p) : strlen(p);
        uint64_t v;
        if (tl == 0) {
            snprintf(why, len, "empty size in the list '%s' (element %d)", list, count + 1);
            return false;
        }
        if (tl >= sizeof(tok)) {
            snprintf(why, len, "size '%.20s...' is too long", p);
            return false;
        }
        memcpy(tok, p, tl);
        tok[tl] = '\0';
        if (count == max_n) {
            snprintf(why, len, "more than %d sizes", max_n);
            return false;
        }
        if (!tdp_bm_parse_size_why(tok, &v, &reason)) {
            snprintf(why, len, "invalid size '%s': %s", tok, reason);
            return false;
        }
        if (v < min || v > max) {
            char lo[32], hi[32];
            snprintf(why, len, "size '%s' is out of range (%s .. %s)", tok,
                     fmt_bound(min, lo, sizeof(lo)), fmt_bound(max, hi, sizeof(hi)));
            return false;
        }
        out[count++] = v;
        if (end == NULL)
            break;
        p = end + 1;
    }
    *n = count;
    return true;
}

uint64_t tdp_bm_whole_floats(uint64_t bytes)
{
    return bytes > UINT64_MAX - 3 ? UINT64_MAX & ~3ull : (bytes + 3) & ~3ull;
}
