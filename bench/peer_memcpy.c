/*
 * peer_memcpy.c: the copy limit — one thread copying a size-byte buffer into
 * another, repeated. Throughput is bytes copied per second (3 repeats of the
 * same number of copies tdpipe sends messages); "latency" is the time of one
 * copy, timed copy by copy (there is no other side to answer).
 *
 * Every message tdpipe moves over shared memory is copied at least once, so
 * this is the ceiling a single-copy path can reach on this machine.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peers.h"

/* The copy must happen even though nobody reads dst. */
static inline void copy_once(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
    __asm__ volatile("" : : "r"(dst) : "memory");
}

static int measure(const peer_cfg *cfg, char *dst, const char *src, uint64_t bytes,
                   size_result *res)
{
    char label[32];
    peers_format_size(bytes, label, sizeof(label));

    int n = peers_lat_rounds(cfg, bytes), warm = peers_lat_warm(n);
    double *lat = calloc((size_t)n, sizeof(double));
    if (lat == NULL)
        return 1;
    for (int i = 0; i < warm + n; i++) {
        uint64_t a = peers_now_ns();
        copy_once(dst, src, bytes);
        uint64_t b = peers_now_ns();
        if (i >= warm)
            lat[i - warm] = (double)(b - a) / 1e3;
    }
    peers_lat_summary(lat, n, res);
    free(lat);

    int count = peers_tp_count(cfg, bytes), twarm = peers_tp_warm(count);
    for (int r = 0; r < PEERS_REPEATS; r++) {
        /* as the receivers: the clock starts when copy `twarm` is complete */
        uint64_t t0 = 0;
        for (int i = 0; i < count; i++) {
            copy_once(dst, src, bytes);
            if (i == twarm)
                t0 = peers_now_ns();
        }
        double secs = (double)(peers_now_ns() - t0) / 1e9;
        res->tp_msgs = (uint64_t)(count - 1 - twarm);
        res->tp_bps[r] = (double)res->tp_msgs * (double)bytes / secs;
    }
    peers_tp_summary(res);
    peers_progress(cfg, "  memcpy  %-9s one copy p50 %.2f us, %.2f GB/s\n", label, res->lat_p50,
                   res->tp_median / 1e9);
    return 0;
}

static int memcpy_run(const peer_cfg *cfg, size_result *res)
{
    uint64_t max = 0;
    for (int i = 0; i < cfg->nsizes; i++)
        max = cfg->sizes[i] > max ? cfg->sizes[i] : max;
    char *src = aligned_alloc(4096, (max + 4095) & ~4095ull);
    char *dst = aligned_alloc(4096, (max + 4095) & ~4095ull);
    int rc = 1;
    if (src == NULL || dst == NULL) {
        fprintf(stderr, "tdp_peers memcpy: cannot allocate 2 x %llu bytes\n",
                (unsigned long long)max);
        goto out;
    }
    /* touch every page first: page faults are not the copy's cost */
    memset(src, 0xa5, max);
    memset(dst, 0, max);
    for (int i = 0; i < cfg->nsizes; i++) {
        peers_result_init(&res[i], cfg->sizes[i]);
        if ((rc = measure(cfg, dst, src, cfg->sizes[i], &res[i])) != 0)
            goto out;
    }
out:
    free(src);
    free(dst);
    return rc;
}

const peer_ops peer_memcpy = {
    .name = "memcpy",
    .method = "single-thread memcpy of a size-byte buffer into another (both pre-faulted), "
              "repeated; latency = time of one copy",
    .run = memcpy_run,
};
