/*
 * gpu_ipc.c: the floor of a same-host GPU hand-off between two processes,
 * with no pipe in between — what the cuda-ipc plane is measured against
 * (docs/benchmarks.md). Through the library's own CUDA layer, so the same
 * backend (driver or fake) as the pipes:
 *
 *   - the producer allocates an exportable pool of 4 slots once and sends
 *     its handle once (the POSIX fd by SCM_RIGHTS, or the legacy handle);
 *     the consumer imports it once;
 *   - per message, the producer writes the slot's first 8 bytes (seq, from
 *     page-locked memory, async on its stream), waits for its stream on
 *     the CPU, and posts 16 bytes (slot, seq) on a Unix socket;
 *   - the consumer copies those 8 bytes of the slot back to page-locked
 *     memory, checks them against seq (the bytes are visible end to end),
 *     and answers 8 bytes; one-way latency is half the round trip.
 *
 * Neither side records an interprocess event per message: a CPU-side
 * stream wait costs far less (the ipc_pingpong figures).
 *
 * --both-ways: as a cuda-ipc pipe's bench does, the answer goes back the
 * same way: the consumer exports a pool of its own, which the producer
 * imports; per message the consumer writes the 8 bytes into its slot and
 * the producer reads them back and checks them. --sync-copies: every
 * 8-byte copy is the synchronous call tdp_mem_copy makes (cuMemcpy from
 * or to pageable memory, then a wait for the default stream) instead of
 * page-locked memory, an async copy and a stream wait. --device-writes:
 * the 8 bytes are written into device memory by the device's front end
 * (cuStreamWriteValue64, then a stream wait), not by a copy engine; reads
 * stay copies. Together they take apart what a GPU ping-pong's small
 * copies cost (docs/gpu.md).
 *
 *   tdp_gpu_ipc [--sizes LIST] [--rounds N] [--device D] [--both-ways]
 *               [--sync-copies] [--device-writes] [--json]
 *
 * LIST: comma-separated byte counts (default 1000,1000000,100000000). The
 * payload size only sets the slot size (nothing but the 8 bytes is
 * written): the floor of a hand-off that moves no bytes. Prints per size:
 * the p50 and mean one-way latency, and the consumer's one-time import
 * cost. On the fake device the figures measure the fake, not a GPU.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/cuda.h"
#include "pipe/shm/shm.h"

#define SLOTS 4
#define MAX_SIZES 16

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Exactly n bytes, or false (the peer died or sent garbage). */
static bool xfer(int fd, void *buf, size_t n, bool wr)
{
    char *c = buf;
    while (n > 0) {
        ssize_t k = wr ? send(fd, c, n, MSG_NOSIGNAL) : recv(fd, c, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return false;
        c += k;
        n -= (size_t)k;
    }
    return true;
}

/* What the producer sends once: the pool's handle (its fd, if any, rides along). */
typedef struct hello {
    uint64_t slot_bytes;
    uint32_t flags; /* F_* */
    tdp__cuda_ipc h;
} hello;
#define F_BOTH 1u /* --both-ways */
#define F_SYNC 2u /* --sync-copies */
#define F_DEVW 4u /* --device-writes */

/* 8 bytes to device memory, or back, as the flags say. */
static bool put8(void *dst, uint64_t v, void *pin, tdp__cuda_stream *s, uint32_t flags)
{
    if (flags & F_DEVW)
        return tdp__cuda_write_inline(dst, &v, 8, s) == TDP_OK &&
               tdp__cuda_stream_sync(s) == TDP_OK;
    if (flags & F_SYNC)
        return tdp__cuda_memcpy(dst, &v, 8) == TDP_OK;
    memcpy(pin, &v, 8);
    return tdp__cuda_memcpy_async(dst, pin, 8, s) == TDP_OK && tdp__cuda_stream_sync(s) == TDP_OK;
}

static bool get8(uint64_t *v, const void *src, void *pin, tdp__cuda_stream *s, uint32_t flags)
{
    if (flags & F_SYNC)
        return tdp__cuda_memcpy(v, src, 8) == TDP_OK;
    if (tdp__cuda_memcpy_async(pin, src, 8, s) != TDP_OK || tdp__cuda_stream_sync(s) != TDP_OK)
        return false;
    memcpy(v, pin, 8);
    return true;
}

/* Export pool and send its handle (and the flags) over fd. */
static bool send_pool(int fd, void *pool, uint64_t slot, uint32_t flags)
{
    hello m = {.slot_bytes = slot, .flags = flags};
    if (tdp__cuda_export(pool, &m.h) != TDP_OK)
        return false;
    int hfd = m.h.fd;
    tdp_err rc = tdp__shm_sock_send(fd, &m, sizeof(m), &hfd, hfd >= 0 ? 1 : 0);
    if (hfd >= 0)
        close(hfd);
    return rc == TDP_OK;
}

/* The other side's pool handle, imported on dev; TDP_ECLOSED at the end of the stream. */
static tdp_err recv_pool(int fd, int dev, hello *m, void **pool)
{
    size_t len = 0, nfds = 0;
    int fds[1] = {-1};
    tdp_err rc = tdp__shm_sock_recv(fd, m, sizeof(*m), &len, fds, 1, &nfds);
    if (rc != TDP_OK)
        return rc;
    if (len == 0 || len > sizeof(*m) ||
        !xfer(fd, (char *)m + len, sizeof(*m) - len, false)) { /* a stream: the rest */
        if (nfds == 1)
            close(fds[0]);
        return TDP_EPROTO;
    }
    m->h.fd = nfds == 1 ? fds[0] : -1;
    rc = tdp__cuda_import(dev, &m->h, pool);
    if (m->h.fd >= 0)
        close(m->h.fd);
    return rc;
}

/* The consumer: import once, then check and answer each message. */
static int consumer(int fd, int dev)
{
    if (tdp__cuda_ctx_set(dev) != TDP_OK)
        return 1;
    for (;;) {
        hello m;
        double t0 = now_us();
        void *pool = NULL, *pin = NULL, *own = NULL;
        tdp__cuda_stream *s = NULL;
        tdp_err rc = recv_pool(fd, dev, &m, &pool);
        if (rc == TDP_ECLOSED)
            return 0; /* the producer is done */
        if (rc != TDP_OK || tdp__cuda_stream_create(dev, &s) != TDP_OK ||
            tdp__cuda_host_alloc(8, &pin) != TDP_OK) {
            fprintf(stderr, "tdp_gpu_ipc: the consumer cannot import the pool\n");
            return 1;
        }
        double open_us = now_us() - t0;
        if (!xfer(fd, &open_us, sizeof(open_us), true))
            return 1;
        /* --both-ways: a pool of this side's for the answers, the same size */
        if ((m.flags & F_BOTH) &&
            (tdp__cuda_malloc_shared(dev, SLOTS * m.slot_bytes, &own) != TDP_OK ||
             !send_pool(fd, own, m.slot_bytes, m.flags))) {
            fprintf(stderr, "tdp_gpu_ipc: the consumer cannot export its pool\n");
            return 1;
        }
        for (;;) {
            uint64_t msg[2]; /* slot, seq; slot UINT64_MAX: this size is done */
            if (!xfer(fd, msg, sizeof(msg), false))
                return 1;
            if (msg[0] == UINT64_MAX)
                break;
            uint64_t got = 0;
            if (msg[0] >= SLOTS ||
                !get8(&got, (char *)pool + msg[0] * m.slot_bytes, pin, s, m.flags))
                return 1;
            if (own != NULL && !put8((char *)own + msg[0] * m.slot_bytes, got, pin, s, m.flags))
                return 1;
            uint64_t ok = got == msg[1];
            if (!xfer(fd, &ok, sizeof(ok), true))
                return 1;
        }
        tdp__cuda_stream_destroy(s);
        tdp__cuda_host_free(pin);
        tdp__cuda_import_close(pool);
        tdp__cuda_free(own);
    }
}

typedef struct result {
    uint64_t bytes;
    double p50_us, mean_us, open_us;
} result;

/* The producer's side for one slot size: allocate, export, ping-pong. */
static int produce(int fd, int dev, uint64_t bytes, int rounds, uint32_t flags, result *out)
{
    /* slots on a 2 MiB grain, as an exportable allocation wants */
    uint64_t slot = (bytes + (UINT64_C(2) << 20) - 1) & ~((UINT64_C(2) << 20) - 1);
    void *pool = NULL, *pin = NULL, *back = NULL;
    tdp__cuda_stream *s = NULL;
    int rc = 1;
    double *lat = calloc((size_t)rounds, sizeof(*lat));
    if (lat == NULL || tdp__cuda_malloc_shared(dev, SLOTS * slot, &pool) != TDP_OK ||
        tdp__cuda_stream_create(dev, &s) != TDP_OK || tdp__cuda_host_alloc(8, &pin) != TDP_OK ||
        !send_pool(fd, pool, slot, flags)) {
        fprintf(stderr, "tdp_gpu_ipc: cannot make an exportable pool of %d x %" PRIu64 " bytes\n",
                SLOTS, slot);
        goto out;
    }
    if (!xfer(fd, &out->open_us, sizeof(out->open_us), false))
        goto out;
    hello bm;
    if ((flags & F_BOTH) && recv_pool(fd, dev, &bm, &back) != TDP_OK) {
        fprintf(stderr, "tdp_gpu_ipc: cannot import the consumer's pool\n");
        goto out;
    }
    int warm = rounds / 10 + 2;
    for (int i = -warm; i < rounds; i++) {
        uint64_t seq = (uint64_t)(i + warm + 1), msg[2] = {(uint64_t)(i + warm) % SLOTS, seq};
        uint64_t ok = 0;
        double t0 = now_us();
        if (!put8((char *)pool + msg[0] * slot, seq, pin, s, flags) ||
            !xfer(fd, msg, sizeof(msg), true) || !xfer(fd, &ok, sizeof(ok), false))
            goto out;
        uint64_t echo = seq;
        if (back != NULL && !get8(&echo, (char *)back + msg[0] * slot, pin, s, flags))
            goto out;
        if (ok != 1 || echo != seq) {
            fprintf(stderr, "tdp_gpu_ipc: message %" PRIu64 ": the consumer read other bytes\n",
                    seq);
            goto out;
        }
        if (i >= 0)
            lat[i] = (now_us() - t0) / 2;
    }
    uint64_t done[2] = {UINT64_MAX, 0};
    if (!xfer(fd, done, sizeof(done), true))
        goto out;
    double sum = 0;
    for (int i = 0; i < rounds; i++)
        sum += lat[i];
    qsort(lat, (size_t)rounds, sizeof(*lat), cmp_double);
    out->bytes = bytes;
    out->p50_us = lat[rounds / 2];
    out->mean_us = sum / rounds;
    rc = 0;
out:
    free(lat);
    if (s != NULL)
        tdp__cuda_stream_destroy(s);
    tdp__cuda_host_free(pin);
    if (back != NULL)
        tdp__cuda_import_close(back);
    tdp__cuda_free(pool);
    return rc;
}

static int parse_sizes(const char *list, uint64_t *sizes)
{
    int n = 0;
    const char *p = list;
    while (*p != '\0' && n < MAX_SIZES) {
        char *end;
        unsigned long long v = strtoull(p, &end, 10);
        if (end == p || v == 0 || (*end != ',' && *end != '\0'))
            return -1;
        sizes[n++] = v;
        p = *end == ',' ? end + 1 : end;
    }
    return *p == '\0' ? n : -1;
}

int main(int argc, char **argv)
{
    uint64_t sizes[MAX_SIZES] = {1000, 1000000, 100000000};
    int nsizes = 3, rounds = 1000, dev = 0;
    uint32_t flags = 0;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--sizes") == 0 && i + 1 < argc)
            nsizes = parse_sizes(argv[++i], sizes);
        else if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            dev = atoi(argv[++i]);
        else if (strcmp(argv[i], "--json") == 0)
            json = true;
        else if (strcmp(argv[i], "--both-ways") == 0)
            flags |= F_BOTH;
        else if (strcmp(argv[i], "--sync-copies") == 0)
            flags |= F_SYNC;
        else if (strcmp(argv[i], "--device-writes") == 0)
            flags |= F_DEVW;
        else
            nsizes = -1;
        if (nsizes < 1)
            break;
    }
    if (nsizes < 1 || rounds < 1) {
        fprintf(stderr,
                "usage: %s [--sizes BYTES,...] [--rounds N (>= 1)] [--device D] [--both-ways] "
                "[--sync-copies] [--device-writes] [--json]\n",
                argv[0]);
        return 2;
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("tdp_gpu_ipc: socketpair");
        return 1;
    }
    /* fork before any CUDA call: a CUDA context does not survive fork */
    pid_t pid = fork();
    if (pid < 0) {
        perror("tdp_gpu_ipc: fork");
        return 1;
    }
    if (pid == 0) {
        close(sv[0]);
        _exit(consumer(sv[1], dev));
    }
    close(sv[1]);
    char what[128];
    tdp__cuda_describe(what, sizeof(what));
    int rc = 0;
    result res[MAX_SIZES];
    if (tdp__cuda_device_count() <= dev || tdp__cuda_ctx_set(dev) != TDP_OK) {
        fprintf(stderr, "tdp_gpu_ipc: no device %d (cuda: %s)\n", dev, what);
        rc = 3;
    }
    for (int i = 0; rc == 0 && i < nsizes; i++)
        rc = produce(sv[0], dev, sizes[i], rounds, flags, &res[i]);
    close(sv[0]); /* the consumer's end of stream */
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        if (rc == 0)
            fprintf(stderr, "tdp_gpu_ipc: the consumer failed\n");
        rc = rc != 0 ? rc : 1;
    }
    if (rc != 0)
        return rc;
    if (json) {
        printf("{\"cuda\": \"%s\", \"rounds\": %d, \"both_ways\": %s, \"sync_copies\": %s, "
               "\"device_writes\": %s, \"results\": [",
               what, rounds, flags & F_BOTH ? "true" : "false", flags & F_SYNC ? "true" : "false",
               flags & F_DEVW ? "true" : "false");
        for (int i = 0; i < nsizes; i++)
            printf("%s{\"bytes\": %" PRIu64 ", \"p50_us\": %.2f, \"mean_us\": %.2f, "
                   "\"import_us\": %.0f}",
                   i ? ", " : "", res[i].bytes, res[i].p50_us, res[i].mean_us, res[i].open_us);
        printf("]}\n");
    } else {
        printf("# cuda: %s; %d ping-pongs per size, one-way = half%s%s\n", what, rounds,
               flags & F_BOTH ? "; answers written back the same way" : "",
               flags & F_DEVW   ? "; writes by the device (no copy engine)"
               : flags & F_SYNC ? "; synchronous copies from pageable memory"
                                : "");
        printf("%-12s %10s %10s %12s\n", "bytes", "p50 us", "mean us", "import us");
        for (int i = 0; i < nsizes; i++)
            printf("%-12" PRIu64 " %10.2f %10.2f %12.0f\n", res[i].bytes, res[i].p50_us,
                   res[i].mean_us, res[i].open_us);
    }
    return 0;
}
