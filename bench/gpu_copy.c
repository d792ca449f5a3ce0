/*
 * gpu_copy.c: the copy limits a GPU path is measured against, through the
 * library's own CUDA layer (so the same backend, driver or fake, as the
 * pipes use): host to device and device to host from pinned and from
 * pageable memory, and device to device, each timed over repeated async
 * copies on one stream and a sync.
 *
 *   tdp_gpu_copy [--size BYTES] [--reps N] [--device D] [--json]
 *
 * Prints one line per copy kind: "kind bytes GB/s". On the fake device the
 * figures measure the fake's engine thread, not a GPU.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tdpipe/mem.h>

#include "core/cuda.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* GB/s of reps copies of n bytes, after two untimed ones; < 0 on error. */
static double rate(void *dst, const void *src, size_t n, int reps, tdp__cuda_stream *s)
{
    for (int i = 0; i < 2; i++)
        if (tdp__cuda_memcpy_async(dst, src, n, s) != TDP_OK)
            return -1;
    if (tdp__cuda_stream_sync(s) != TDP_OK)
        return -1;
    double t = now_s();
    for (int i = 0; i < reps; i++)
        if (tdp__cuda_memcpy_async(dst, src, n, s) != TDP_OK)
            return -1;
    if (tdp__cuda_stream_sync(s) != TDP_OK)
        return -1;
    double dt = now_s() - t;
    return dt > 0 ? (double)n * reps / dt / 1e9 : -1;
}

int main(int argc, char **argv)
{
    size_t size = 100u * 1000 * 1000;
    int reps = 20, dev = 0;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
            size = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            dev = atoi(argv[++i]);
        else if (strcmp(argv[i], "--json") == 0)
            json = true;
        else {
            fprintf(stderr, "usage: %s [--size BYTES] [--reps N] [--device D] [--json]\n",
                    argv[0]);
            return 2;
        }
    }
    if (size == 0 || reps < 1) {
        fprintf(stderr, "tdp_gpu_copy: --size and --reps must be positive\n");
        return 2;
    }
    char what[128];
    tdp__cuda_describe(what, sizeof(what));
    if (tdp__cuda_device_count() <= dev) {
        fprintf(stderr, "tdp_gpu_copy: no device %d (cuda: %s)\n", dev, what);
        return 3;
    }
    void *pinned = NULL, *d1 = NULL, *d2 = NULL;
    void *pageable = NULL;
    tdp__cuda_stream *s = NULL;
    int rc = 1;
    if (tdp__cuda_ctx_set(dev) != TDP_OK || tdp__cuda_host_alloc(size, &pinned) != TDP_OK ||
        tdp__cuda_malloc(dev, size, &d1) != TDP_OK || tdp__cuda_malloc(dev, size, &d2) != TDP_OK ||
        tdp__cuda_stream_create(dev, &s) != TDP_OK ||
        posix_memalign(&pageable, 4096, size) != 0) {
        fprintf(stderr, "tdp_gpu_copy: cannot allocate %zu bytes on device %d\n", size, dev);
        goto out;
    }
    memset(pinned, 1, size);
    memset(pageable, 2, size);
    struct {
        const char *name;
        void *dst;
        const void *src;
    } kinds[] = {
        {"h2d_pinned", d1, pinned},   {"d2h_pinned", pinned, d1},
        {"h2d_pageable", d1, pageable}, {"d2h_pageable", pageable, d1},
        {"d2d", d2, d1},
    };
    if (json)
        printf("{\"cuda\": \"%s\", \"bytes\": %zu, \"reps\": %d", what, size, reps);
    else
        printf("# cuda: %s; %zu bytes, %d copies each\n", what, size, reps);
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        double r = rate(kinds[k].dst, kinds[k].src, size, reps, s);
        if (r < 0) {
            fprintf(stderr, "tdp_gpu_copy: %s failed\n", kinds[k].name);
            goto out;
        }
        if (json)
            printf(", \"%s_gbps\": %.2f", kinds[k].name, r);
        else
            printf("%-13s %zu %.2f GB/s\n", kinds[k].name, size, r);
    }
    if (json)
        printf("}\n");
    rc = 0;
out:
    if (s != NULL)
        tdp__cuda_stream_destroy(s);
    tdp__cuda_free(d1);
    tdp__cuda_free(d2);
    tdp__cuda_host_free(pinned);
    free(pageable);
    return rc;
}
