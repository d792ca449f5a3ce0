/*
 * gpu_copy.c: the copy limits a GPU path is measured against, through the
 * library's own CUDA layer (so the same backend, driver or fake, as the
 * pipes use): host to device and device to host from pinned and from
 * pageable memory, and device to device, each timed over repeated async
 * copies on one stream and a sync.
 *
 *   tdp_gpu_copy [--size BYTES] [--reps N] [--device D] [--json]
 *   tdp_gpu_copy --lat [--size BYTES] [--reps N] [--device D] [--json]
 *
 * Prints one line per copy kind: "kind bytes GB/s". With --lat, instead the
 * latency of one small operation and of the ways to learn it finished
 * (default 32 bytes, 2000 each): tdp_mem_copy and tdp_mem_set (the public
 * synchronous calls), an async copy from page-locked memory then a stream
 * wait, then a host function writing an eventfd the caller blocks on (the
 * staging engine's wake-up), then an event polled from the CPU: "op bytes
 * p50 us mean us". On the fake device the figures measure the fake's
 * engine thread, not a GPU.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

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

/* ---- --lat: one small operation at a time ------------------------------------- */

typedef enum lat_op {
    LAT_MEM_COPY_H2D,        /* tdp_mem_copy from pageable memory */
    LAT_MEM_COPY_D2H,        /* tdp_mem_copy to pageable memory */
    LAT_MEM_COPY_SHARED_D2H, /* the same from exportable (cuda-ipc pool) memory */
    LAT_MEM_SET,             /* tdp_mem_set */
    LAT_ASYNC_SYNC_H2D,      /* page-locked, async, stream wait */
    LAT_ASYNC_SYNC_D2H,
    LAT_ASYNC_HOSTFN, /* async D2H, host function writes an eventfd, read() blocks */
    LAT_ASYNC_EVENT,  /* async D2H, event recorded and polled */
    LAT_SYNC_IDLE,    /* a wait on a stream with nothing queued */
    LAT_OPS
} lat_op;

static const char *const lat_names[LAT_OPS] = {
    "mem_copy_h2d",   "mem_copy_d2h",     "mem_copy_shared_d2h", "mem_set",   "async_sync_h2d",
    "async_sync_d2h", "async_hostfn_efd", "async_event_poll",    "sync_idle",
};

typedef struct lat_env {
    void *dev, *shared, *pinned, *pageable;
    tdp__cuda_stream *s;
    tdp__cuda_event *ev;
    int efd;
} lat_env;

static void lat_wake(void *arg)
{
    uint64_t one = 1;
    ssize_t w;
    do {
        w = write(*(int *)arg, &one, sizeof(one));
    } while (w < 0 && errno == EINTR);
}

static bool lat_once(lat_env *e, lat_op op, size_t n)
{
    uint64_t v;
    switch (op) {
    case LAT_MEM_COPY_H2D:
        return tdp_mem_copy(e->dev, e->pageable, n) == TDP_OK;
    case LAT_MEM_COPY_D2H:
        return tdp_mem_copy(e->pageable, e->dev, n) == TDP_OK;
    case LAT_MEM_COPY_SHARED_D2H:
        return tdp_mem_copy(e->pageable, e->shared, n) == TDP_OK;
    case LAT_MEM_SET:
        return tdp_mem_set(e->dev, 3, n) == TDP_OK;
    case LAT_ASYNC_SYNC_H2D:
        return tdp__cuda_memcpy_async(e->dev, e->pinned, n, e->s) == TDP_OK &&
               tdp__cuda_stream_sync(e->s) == TDP_OK;
    case LAT_ASYNC_SYNC_D2H:
        return tdp__cuda_memcpy_async(e->pinned, e->dev, n, e->s) == TDP_OK &&
               tdp__cuda_stream_sync(e->s) == TDP_OK;
    case LAT_ASYNC_HOSTFN:
        return tdp__cuda_memcpy_async(e->pinned, e->dev, n, e->s) == TDP_OK &&
               tdp__cuda_launch_host_func(e->s, lat_wake, &e->efd) == TDP_OK &&
               read(e->efd, &v, sizeof(v)) == (ssize_t)sizeof(v);
    case LAT_ASYNC_EVENT: {
        if (tdp__cuda_memcpy_async(e->pinned, e->dev, n, e->s) != TDP_OK ||
            tdp__cuda_event_record(e->ev, e->s) != TDP_OK)
            return false;
        tdp_err rc;
        while ((rc = tdp__cuda_event_query(e->ev)) == TDP_EAGAIN)
            ;
        return rc == TDP_OK;
    }
    case LAT_SYNC_IDLE:
        return tdp__cuda_stream_sync(e->s) == TDP_OK;
    default:
        return false;
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int run_lat(int dev, size_t n, int reps, bool json, const char *what)
{
    lat_env e = {.efd = eventfd(0, EFD_CLOEXEC)};
    double *t = calloc((size_t)reps, sizeof(*t));
    int rc = 1;
    if (t == NULL || e.efd < 0 || tdp__cuda_ctx_set(dev) != TDP_OK ||
        tdp__cuda_malloc(dev, n, &e.dev) != TDP_OK ||
        tdp__cuda_malloc_shared(dev, n, &e.shared) != TDP_OK ||
        tdp__cuda_host_alloc(n, &e.pinned) != TDP_OK ||
        tdp__cuda_stream_create(dev, &e.s) != TDP_OK ||
        tdp__cuda_event_create(dev, &e.ev) != TDP_OK || posix_memalign(&e.pageable, 64, n) != 0) {
        fprintf(stderr, "tdp_gpu_copy: cannot set up %zu bytes on device %d\n", n, dev);
        goto out;
    }
    memset(e.pageable, 1, n);
    memset(e.pinned, 2, n);
    if (json)
        printf("{\"cuda\": \"%s\", \"bytes\": %zu, \"reps\": %d, \"lat_us\": {", what, n, reps);
    else
        printf("# cuda: %s; %zu bytes, %d of each, one at a time\n", what, n, reps);
    for (int op = 0; op < LAT_OPS; op++) {
        double sum = 0;
        for (int i = -reps / 10; i < reps; i++) {
            double t0 = now_s();
            if (!lat_once(&e, (lat_op)op, n)) {
                fprintf(stderr, "tdp_gpu_copy: %s failed\n", lat_names[op]);
                goto out;
            }
            if (i >= 0)
                sum += t[i] = (now_s() - t0) * 1e6;
        }
        qsort(t, (size_t)reps, sizeof(*t), cmp_double);
        if (json)
            printf("%s\"%s\": {\"p50\": %.2f, \"mean\": %.2f}", op ? ", " : "", lat_names[op],
                   t[reps / 2], sum / reps);
        else
            printf("%-20s %zu p50 %8.2f us  mean %8.2f us\n", lat_names[op], n, t[reps / 2],
                   sum / reps);
    }
    if (json)
        printf("}}\n");
    rc = 0;
out:
    if (e.ev != NULL)
        tdp__cuda_event_destroy(e.ev);
    if (e.s != NULL)
        tdp__cuda_stream_destroy(e.s);
    tdp__cuda_free(e.dev);
    tdp__cuda_free(e.shared);
    tdp__cuda_host_free(e.pinned);
    free(e.pageable);
    free(t);
    if (e.efd >= 0)
        close(e.efd);
    return rc;
}

int main(int argc, char **argv)
{
    size_t size = 100u * 1000 * 1000;
    int reps = 20, dev = 0;
    bool json = false, lat = false, size_set = false, reps_set = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
            size = strtoull(argv[++i], NULL, 10), size_set = true;
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]), reps_set = true;
        else if (strcmp(argv[i], "--lat") == 0)
            lat = true;
        else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            dev = atoi(argv[++i]);
        else if (strcmp(argv[i], "--json") == 0)
            json = true;
        else {
            fprintf(stderr, "usage: %s [--lat] [--size BYTES] [--reps N] [--device D] [--json]\n",
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
    if (lat)
        return run_lat(dev, size_set ? size : 32, reps_set ? reps : 2000, json, what);
    void *pinned = NULL, *d1 = NULL, *d2 = NULL;
    void *pageable = NULL;
    tdp__cuda_stream *s = NULL;
    int rc = 1;
    if (tdp__cuda_ctx_set(dev) != TDP_OK || tdp__cuda_host_alloc(size, &pinned) != TDP_OK ||
        tdp__cuda_malloc(dev, size, &d1) != TDP_OK || tdp__cuda_malloc(dev, size, &d2) != TDP_OK ||
        tdp__cuda_stream_create(dev, &s) != TDP_OK || posix_memalign(&pageable, 4096, size) != 0) {
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
        {"h2d_pinned", d1, pinned},
        {"d2h_pinned", pinned, d1},
        {"h2d_pageable", d1, pageable},
        {"d2h_pageable", pageable, d1},
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
