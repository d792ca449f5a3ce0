/*
 * zmq_fan.c: ZeroMQ with many peers behind one socket, the reference for
 * tdpipe's fan-in and fan-out (docs/benchmarks.md). Over ipc:// (one host)
 * or tcp://127.0.0.1:
 *
 *   fanin       N PUSH producers -> one PULL consumer; the consumer times
 *               the aggregate stream.
 *   broadcast   one PUB -> N SUB consumers, every consumer gets every
 *               message (ZMQ_XPUB_NODROP: the publisher blocks at the
 *               high-water mark rather than dropping, as tdpipe's default
 *               does); each consumer times its own stream.
 *   distribute  one PUSH -> N PULL consumers, each message to one of them
 *               (ZeroMQ's round robin); each consumer times its share.
 *
 *   tdp_zmq_fan MODE [--peers N] [--size BYTES] [--count M] [--transport ipc|tcp] [--json]
 *
 * Sends are zero-copy (zmq_msg_init_data on a constant buffer); receives
 * keep ZeroMQ's own message. High-water marks: min(1000, max(4, 256 MiB /
 * size)) on both ends. M messages per producer (fanin) or in all
 * (broadcast, distribute; default: ~2 GiB worth, 200..20000), the first 10 %
 * untimed. Every peer is its own process, forked before any ZeroMQ context.
 * Prints the aggregate delivered rate (bytes every consumer received, over
 * the longest consumer's time) and, for fan-out, the slowest consumer's rate.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#define MAX_PEERS 64
#define EP_LEN    128
#define TMO_MS    30000

typedef enum { FANIN, BROADCAST, DISTRIBUTE } fan_mode;

typedef struct report {       /* a consumer's, through a pipe */
    uint64_t msgs, bytes, ns; /* timed messages, their bytes, elapsed */
    uint64_t bad;             /* messages of another size */
} report;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int hwm_for(uint64_t bytes)
{
    uint64_t h = (256ull << 20) / bytes;
    return (int)(h < 4 ? 4 : h > 1000 ? 1000 : h);
}

static void *sock(void *ctx, int type, int hwm)
{
    void *s = zmq_socket(ctx, type);
    /* a sender's close waits (bounded) for what it queued: linger 0 drops it */
    int tmo = TMO_MS, linger = TMO_MS;
    if (s == NULL)
        return NULL;
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &tmo, sizeof(tmo));
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &tmo, sizeof(tmo));
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    return s;
}

static bool send_zc(void *s, void *buf, size_t len)
{
    zmq_msg_t m;
    zmq_msg_init_data(&m, buf, len, NULL, NULL);
    if (zmq_msg_send(&m, s, 0) < 0) {
        zmq_msg_close(&m);
        return false;
    }
    return true;
}

/* One message: its size, or -1 (timeout, or the end marker: size 0). */
static int64_t recv_one(void *s)
{
    zmq_msg_t m;
    zmq_msg_init(&m);
    int64_t n = zmq_msg_recv(&m, s, 0) >= 0 ? (int64_t)zmq_msg_size(&m) : -1;
    zmq_msg_close(&m);
    return n == 0 ? -1 : n;
}

/*
 * A consumer: receive until `expect` messages came (0: until a 1-byte end
 * marker, for distribute, whose share is not known), timing from the end
 * of message `warm` to the last message.
 */
static report consume(void *s, uint64_t bytes, uint64_t expect, uint64_t warm)
{
    report r = {0};
    uint64_t t0 = 0, t1 = 0, got = 0;
    while (expect == 0 || got < expect) {
        int64_t n = recv_one(s);
        if (n < 0 || n == 1)
            break; /* a timeout, or distribute's end marker */
        if ((uint64_t)n != bytes)
            r.bad++;
        got++;
        t1 = now_ns();
        if (got == warm + 1)
            t0 = t1;
        else if (got > warm + 1) {
            r.msgs++;
            r.bytes += (uint64_t)n;
        }
    }
    r.ns = t0 != 0 && t1 > t0 ? t1 - t0 : 0;
    if (expect > 0 && got != expect)
        r.bad++;
    return r;
}

typedef struct cfg {
    fan_mode mode;
    int peers;
    uint64_t size, count;
    char ep[EP_LEN];
} cfg;

/* The child of peer i: a producer (fanin) or a consumer (fan-out). */
static int child(const cfg *c, int i, int rfd, int wfd)
{
    void *ctx = zmq_ctx_new();
    int hwm = hwm_for(c->size);
    uint64_t warm = c->count / 10;
    int rc = 1;
    if (c->mode == FANIN) {
        void *push = sock(ctx, ZMQ_PUSH, hwm);
        char go;
        void *buf = calloc(1, c->size);
        if (push != NULL && buf != NULL && zmq_connect(push, c->ep) == 0 &&
            read(rfd, &go, 1) == 1) {
            rc = 0;
            for (uint64_t k = 0; k < c->count && rc == 0; k++)
                rc = send_zc(push, buf, c->size) ? 0 : 1;
        }
        zmq_close(push);
        zmq_ctx_term(ctx);
        free(buf);
        return rc;
    }
    void *s = sock(ctx, c->mode == BROADCAST ? ZMQ_SUB : ZMQ_PULL, hwm);
    if (s != NULL && c->mode == BROADCAST)
        zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
    if (s != NULL && zmq_connect(s, c->ep) == 0) {
        char ready = (char)i;
        if (write(wfd, &ready, 1) == 1) {
            report r = consume(s, c->size, c->mode == BROADCAST ? c->count : 0,
                               c->mode == BROADCAST ? warm : warm / (uint64_t)c->peers);
            rc = write(wfd, &r, sizeof(r)) == (ssize_t)sizeof(r) ? 0 : 1;
        }
    }
    zmq_close(s);
    zmq_ctx_term(ctx);
    return rc;
}

static int parse(int argc, char **argv, cfg *c, bool *json, bool *ipc)
{
    if (argc < 2)
        return -1;
    if (strcmp(argv[1], "fanin") == 0)
        c->mode = FANIN;
    else if (strcmp(argv[1], "broadcast") == 0)
        c->mode = BROADCAST;
    else if (strcmp(argv[1], "distribute") == 0)
        c->mode = DISTRIBUTE;
    else
        return -1;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--peers") == 0 && i + 1 < argc)
            c->peers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc)
            c->size = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--count") == 0 && i + 1 < argc)
            c->count = strtoull(argv[++i], NULL, 10);
        else if (strcmp(argv[i], "--transport") == 0 && i + 1 < argc) {
            const char *t = argv[++i];
            if (strcmp(t, "ipc") != 0 && strcmp(t, "tcp") != 0)
                return -1;
            *ipc = strcmp(t, "ipc") == 0;
        } else if (strcmp(argv[i], "--json") == 0)
            *json = true;
        else
            return -1;
    }
    return c->peers >= 1 && c->peers <= MAX_PEERS && c->size >= 2 ? 0 : -1;
}

int main(int argc, char **argv)
{
    cfg c = {.peers = 4, .size = 1000000};
    bool json = false, ipc = true;
    if (parse(argc, argv, &c, &json, &ipc) != 0) {
        fprintf(stderr,
                "usage: %s fanin|broadcast|distribute [--peers N (1..%d)] [--size BYTES (>= 2)]\n"
                "       [--count M] [--transport ipc|tcp] [--json]\n",
                argv[0], MAX_PEERS);
        return 2;
    }
    if (c.count == 0) {
        uint64_t m = (2ull << 30) / c.size;
        c.count = m < 200 ? 200 : m > 20000 ? 20000 : m;
    }
    /* the bound side is the single one; the N peers connect to it */
    void *ctx = NULL, *s = NULL, *sendbuf = NULL;
    bool reaped = false;
    char tmpl[] = "/tmp/tdp-zmq-fan-XXXXXX";
    if (ipc) {
        if (mkdtemp(tmpl) == NULL) {
            perror("tdp_zmq_fan: mkdtemp");
            return 1;
        }
        snprintf(c.ep, sizeof(c.ep), "ipc://%s/s", tmpl);
    } else {
        snprintf(c.ep, sizeof(c.ep), "tcp://127.0.0.1:*");
    }
    int to_kids[2], from_kids[2];
    if (pipe(to_kids) != 0 || pipe(from_kids) != 0) {
        perror("tdp_zmq_fan: pipe");
        return 1;
    }
    /* the peers are forked before any ZeroMQ context, and read the endpoint
     * (a tcp port is known only once bound) from a pipe */
    pid_t kids[MAX_PEERS];
    int endpoint_pipe[2];
    if (pipe(endpoint_pipe) != 0)
        return 1;
    for (int i = 0; i < c.peers; i++) {
        kids[i] = fork();
        if (kids[i] < 0) {
            perror("tdp_zmq_fan: fork");
            return 1;
        }
        if (kids[i] == 0) {
            close(to_kids[1]);
            close(from_kids[0]);
            close(endpoint_pipe[1]);
            if (read(endpoint_pipe[0], c.ep, sizeof(c.ep)) != (ssize_t)sizeof(c.ep))
                _exit(1);
            _exit(child(&c, i, to_kids[0], from_kids[1]));
        }
    }
    close(to_kids[0]);
    close(from_kids[1]);
    close(endpoint_pipe[0]);
    int hwm = hwm_for(c.size), rc = 1;
    ctx = zmq_ctx_new();
    s = sock(ctx, c.mode == FANIN ? ZMQ_PULL : c.mode == BROADCAST ? ZMQ_PUB : ZMQ_PUSH, hwm);
    size_t eplen = sizeof(c.ep);
    int one = 1;
    if (s != NULL && c.mode == BROADCAST)
        zmq_setsockopt(s, ZMQ_XPUB_NODROP, &one, sizeof(one));
    if (s == NULL || zmq_bind(s, c.ep) != 0 || zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, c.ep, &eplen)) {
        fprintf(stderr, "tdp_zmq_fan: cannot bind %s: %s\n", c.ep, zmq_strerror(zmq_errno()));
        goto out;
    }
    for (int i = 0; i < c.peers; i++) /* atomic writes: < PIPE_BUF */
        if (write(endpoint_pipe[1], c.ep, sizeof(c.ep)) != (ssize_t)sizeof(c.ep))
            goto out;
    report agg = {0};
    uint64_t slowest_ns = 0;
    double min_rate = 0;
    if (c.mode == FANIN) {
        char go[MAX_PEERS] = {0};
        if (write(to_kids[1], go, (size_t)c.peers) != c.peers)
            goto out;
        agg = consume(s, c.size, c.count * (uint64_t)c.peers, c.count * (uint64_t)c.peers / 10);
        slowest_ns = agg.ns;
    } else {
        /* every consumer connected (and, for SUB, subscribed) before the first message */
        for (int i = 0; i < c.peers; i++) {
            char r;
            if (read(from_kids[0], &r, 1) != 1)
                goto out;
        }
        usleep(200000); /* a SUB's subscription reaches the PUB after its connect */
        void *buf = calloc(1, c.size);
        bool ok = buf != NULL;
        for (uint64_t k = 0; ok && k < c.count; k++)
            ok = send_zc(s, buf, c.size);
        sendbuf = buf; /* zero-copy messages may still be queued: freed after the socket */
        if (!ok) {
            fprintf(stderr, "tdp_zmq_fan: send failed: %s\n", zmq_strerror(zmq_errno()));
            goto out;
        }
        int nrep = 0;
        uint64_t give_up = now_ns() + 30000000000u;
        while (nrep < c.peers && now_ns() < give_up) {
            /* distribute: end markers until every consumer has reported (a
             * PUSH skips a full pipe, so one marker each may not reach each) */
            char end = 0;
            if (c.mode == DISTRIBUTE)
                (void)zmq_send(s, &end, 1, ZMQ_DONTWAIT);
            struct pollfd pf = {.fd = from_kids[0], .events = POLLIN};
            if (poll(&pf, 1, 10) <= 0)
                continue;
            report r;
            if (read(from_kids[0], &r, sizeof(r)) != (ssize_t)sizeof(r))
                goto waitkids;
            nrep++;
            agg.msgs += r.msgs;
            agg.bytes += r.bytes;
            agg.bad += r.bad;
            if (r.ns > slowest_ns)
                slowest_ns = r.ns;
            double rate = r.ns > 0 ? (double)r.bytes / ((double)r.ns / 1e9) : 0;
            if (nrep == 1 || rate < min_rate)
                min_rate = rate;
        }
        if (nrep < c.peers)
            goto waitkids;
    }
    rc = 0;
waitkids:
    for (int i = 0; i < c.peers; i++) {
        int st = 0;
        if (waitpid(kids[i], &st, 0) != kids[i] || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
            rc = 1;
    }
    reaped = true;
    if (rc == 0 && (agg.bad > 0 || slowest_ns == 0)) {
        fprintf(stderr, "tdp_zmq_fan: %" PRIu64 " messages of the wrong size or missing\n",
                agg.bad);
        rc = 1;
    }
    if (rc == 0) {
        static const char *const names[] = {"fanin", "broadcast", "distribute"};
        double aggr = (double)agg.bytes / ((double)slowest_ns / 1e9);
        if (c.mode == FANIN)
            min_rate = aggr; /* one consumer */
        if (json)
            printf("{\"peer\": \"zmq\", \"mode\": \"%s\", \"transport\": \"%s\", \"peers\": %d, "
                   "\"bytes\": %" PRIu64 ", \"messages\": %" PRIu64
                   ", \"aggregate_Bps\": %.0f, \"slowest_consumer_Bps\": %.0f}\n",
                   names[c.mode], ipc ? "ipc" : "tcp", c.peers, c.size, agg.msgs, aggr, min_rate);
        else
            printf("zmq %s over %s, %d peers, %" PRIu64 " B: %" PRIu64
                   " timed messages, aggregate %.3f GB/s, slowest consumer %.3f GB/s\n",
                   names[c.mode], ipc ? "ipc" : "tcp", c.peers, c.size, agg.msgs, aggr / 1e9,
                   min_rate / 1e9);
    }
out:
    if (s != NULL)
        zmq_close(s);
    if (ctx != NULL)
        zmq_ctx_term(ctx);
    free(sendbuf);
    close(endpoint_pipe[1]);
    close(to_kids[1]);
    close(from_kids[0]);
    for (int i = 0; !reaped && i < c.peers; i++) {
        int st;
        waitpid(kids[i], &st, 0);
    }
    if (ipc) {
        char path[EP_LEN];
        snprintf(path, sizeof(path), "%s/s", tmpl);
        unlink(path);
        rmdir(tmpl);
    }
    return rc;
}
