/*
 * peer_tcp.c: a raw TCP socket loop over 127.0.0.1 — what the kernel's
 * loopback gives a program that does nothing but move framed bytes.
 *
 * Messages are length-prefixed (an 8-byte length, then the payload), sent
 * with one send() each from a prebuilt buffer; TCP_NODELAY on both ends.
 * The receiver reads into one preallocated buffer: one recv() may complete
 * many small messages, and a message is complete when its last byte is in
 * the buffer. Latency is a send/recv echo (the consumer sends each message
 * back once it has all of it); throughput is timed by the consumer.
 *
 * Control frames (32 bytes: phase, size, count, warm-up) tell the consumer
 * what follows; their bytes are not counted.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "peers.h"

enum { PH_PING = 1, PH_STREAM = 2, PH_RESULT = 3, PH_END = 4 };
#define HDR         8u             /* the length prefix */
#define READ_WINDOW (256u * 1024u) /* small messages are read this many bytes at a time */

/* The receive side: frames parsed in place from one buffer. */
typedef struct reader {
    int fd;
    char *buf;
    size_t cap, start, end;
} reader;

static bool rd_init(reader *rd, int fd, uint64_t max_payload)
{
    rd->fd = fd;
    rd->cap = max_payload + HDR + READ_WINDOW;
    rd->start = rd->end = 0;
    rd->buf = malloc(rd->cap);
    if (rd->buf != NULL)
        memset(rd->buf, 0, rd->cap); /* fault the pages in before anything is timed */
    return rd->buf != NULL;
}

/* Make `need` bytes from rd->start available, reading at most up to max(need, window). */
static bool rd_fill(reader *rd, size_t need)
{
    size_t lim = need > READ_WINDOW ? need : READ_WINDOW;
    if (need > rd->cap)
        return false;
    if (rd->start + need > lim) { /* move the partial frame to the front */
        memmove(rd->buf, rd->buf + rd->start, rd->end - rd->start);
        rd->end -= rd->start;
        rd->start = 0;
    }
    while (rd->end - rd->start < need) {
        ssize_t n = recv(rd->fd, rd->buf + rd->end, lim - rd->end, 0);
        if (n <= 0)
            return false;
        rd->end += (size_t)n;
    }
    return true;
}

/* The next frame; *frame (prefix included) stays valid until the next call. */
static bool rd_next(reader *rd, char **frame, uint64_t *len)
{
    if (rd->start == rd->end)
        rd->start = rd->end = 0;
    if (!rd_fill(rd, HDR))
        return false;
    memcpy(len, rd->buf + rd->start, HDR);
    if (*len > rd->cap - HDR || !rd_fill(rd, HDR + *len))
        return false;
    *frame = rd->buf + rd->start;
    rd->start += HDR + *len;
    return true;
}

static bool send_ctrl(int fd, int64_t a, int64_t b, int64_t c, int64_t d)
{
    struct {
        uint64_t len;
        int64_t w[4];
    } f = {sizeof(f.w), {a, b, c, d}};
    return net_send_all(fd, &f, sizeof(f));
}

static bool recv_ctrl(reader *rd, int64_t w[4])
{
    char *frame;
    uint64_t len;
    if (!rd_next(rd, &frame, &len) || len != 4 * sizeof(int64_t))
        return false;
    memcpy(w, frame + HDR, 4 * sizeof(int64_t));
    return true;
}

/* ---- the consumer (child process) ---------------------------------------------- */

static int tcp_consumer(uint16_t port, uint64_t max)
{
    int fd = net_connect_loopback(port);
    reader rd;
    if (fd < 0 || !rd_init(&rd, fd, max))
        return 1;
    int64_t w[4];
    bool ok = true;
    while (ok && recv_ctrl(&rd, w) && w[0] != PH_END) {
        uint64_t bytes = (uint64_t)w[1], len;
        int64_t count = w[2], warm = w[3];
        uint64_t t0 = 0, t1 = 0;
        char *frame;
        for (int64_t i = 0; ok && i < count; i++) {
            ok = rd_next(&rd, &frame, &len) && len == bytes;
            if (ok && w[0] == PH_PING)
                ok = net_send_all(fd, frame, HDR + len); /* the same bytes straight back */
            if (i == warm)
                t0 = peers_now_ns();
            if (i == count - 1)
                t1 = peers_now_ns();
        }
        if (ok && w[0] == PH_STREAM)
            ok = send_ctrl(fd, PH_RESULT, (int64_t)(t1 - t0), count - 1 - warm, 0);
    }
    close(fd);
    free(rd.buf);
    return ok ? 0 : 1;
}

/* ---- the producer ---------------------------------------------------------------- */

static int measure(const peer_cfg *cfg, int fd, reader *rd, char *msg, uint64_t bytes,
                   size_result *res)
{
    char label[32], *frame;
    uint64_t len;
    peers_format_size(bytes, label, sizeof(label));
    memcpy(msg, &bytes, HDR);

    int n = peers_lat_rounds(cfg, bytes), warm = peers_lat_warm(n);
    double *lat = calloc((size_t)n, sizeof(double));
    bool ok = lat != NULL && send_ctrl(fd, PH_PING, (int64_t)bytes, warm + n, 0);
    for (int i = 0; ok && i < warm + n; i++) {
        uint64_t a = peers_now_ns();
        ok = net_send_all(fd, msg, HDR + bytes) && rd_next(rd, &frame, &len) && len == bytes;
        uint64_t b = peers_now_ns();
        if (i >= warm)
            lat[i - warm] = (double)(b - a) / 2e3;
    }
    if (ok)
        peers_lat_summary(lat, n, res);
    free(lat);

    int count = peers_tp_count(cfg, bytes), twarm = peers_tp_warm(count);
    for (int r = 0; ok && r < PEERS_REPEATS; r++) {
        int64_t w[4];
        ok = send_ctrl(fd, PH_STREAM, (int64_t)bytes, count, twarm);
        for (int i = 0; ok && i < count; i++)
            ok = net_send_all(fd, msg, HDR + bytes);
        ok = ok && recv_ctrl(rd, w) && w[0] == PH_RESULT && w[1] > 0;
        if (ok) {
            res->tp_msgs = (uint64_t)w[2];
            res->tp_bps[r] = (double)w[2] * (double)bytes / ((double)w[1] / 1e9);
        }
    }
    if (!ok) {
        fprintf(stderr, "tdp_peers tcp: %s: the transfer failed\n", label);
        return 1;
    }
    peers_tp_summary(res);
    peers_progress(cfg, "  tcp     %-9s latency p50 %.2f us, %.3f GB/s\n", label, res->lat_p50,
                   res->tp_median / 1e9);
    return 0;
}

static int tcp_run(const peer_cfg *cfg, size_result *res)
{
    uint64_t max = 0;
    for (int i = 0; i < cfg->nsizes; i++)
        max = cfg->sizes[i] > max ? cfg->sizes[i] : max;
    uint16_t port;
    int lfd = net_listen_loopback(&port);
    if (lfd < 0) {
        fprintf(stderr, "tdp_peers tcp: cannot listen on 127.0.0.1\n");
        return 1;
    }
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        close(lfd);
        _exit(tcp_consumer(port, max));
    }
    int fd = child > 0 ? net_accept_timeout(lfd, 30000) : -1;
    close(lfd);
    reader rd = {.buf = NULL};
    char *msg = malloc(HDR + max);
    int rc = 1;
    if (fd < 0 || msg == NULL || !rd_init(&rd, fd, max)) {
        fprintf(stderr, "tdp_peers tcp: the consumer did not connect\n");
        goto out;
    }
    memset(msg, 0x5a, HDR + max); /* real, touched data */
    rc = 0;
    for (int i = 0; i < cfg->nsizes && rc == 0; i++) {
        peers_result_init(&res[i], cfg->sizes[i]);
        rc = measure(cfg, fd, &rd, msg, cfg->sizes[i], &res[i]);
    }
    if (rc == 0)
        send_ctrl(fd, PH_END, 0, 0, 0);
out:
    if (fd >= 0)
        close(fd);
    if (child > 0) {
        bool tmo;
        int st = peers_wait_child(child, rc == 0 ? PEERS_TMO_MS : 1000, &tmo);
        if (rc == 0 && (tmo || !WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
            fprintf(stderr, "tdp_peers tcp: the consumer failed\n");
            rc = 1;
        }
    }
    free(msg);
    free(rd.buf);
    return rc;
}

const peer_ops peer_tcp = {
    .name = "tcp",
    .method = "raw TCP over 127.0.0.1, TCP_NODELAY, 8-byte length prefix + payload, one send() "
              "per message, receiver reads into one preallocated buffer; latency = half a "
              "send/recv echo; throughput timed on the receiver",
    .run = tcp_run,
};
