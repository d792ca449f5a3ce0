/*
 * fanout_zmq.c: ZeroMQ's broadcast, the reference for tdp_fanout_bench —
 * one XPUB socket over ipc:// and N SUB processes on this host.
 *
 *   tdp_fanout_zmq [--consumers N] [--size BYTES] [--count K]
 *
 * ZeroMQ gets its best case: zero-copy sends (zmq_msg_init_data on a
 * constant buffer, no free function; one message object shared by every
 * subscriber's pipe), receives that keep ZeroMQ's own message, and no
 * loss: ZMQ_XPUB_NODROP makes the publisher wait (EAGAIN, retried) at the
 * high-water mark (16 messages each way) instead of dropping. Each
 * subscriber sends back when it had its last message; the throughput runs
 * from the first send to the last subscriber's last message. One JSON
 * object on stdout.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#define MAX_CONSUMERS 16
#define HWM           16

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int subscriber(const char *ep, int wfd, uint64_t count, uint64_t size)
{
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_SUB);
    int hwm = HWM;
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
    if (zmq_connect(s, ep) != 0)
        return 3;
    zmq_msg_t m;
    zmq_msg_init(&m);
    uint64_t got = 0;
    int code = 0;
    while (got < count) {
        if (zmq_msg_recv(&m, s, 0) < 0) {
            code = 4;
            break;
        }
        if (zmq_msg_size(&m) == size)
            got++; /* a 1-byte message is the publisher's "are you there" */
    }
    uint64_t t = now_ns();
    if (write(wfd, &t, sizeof(t)) != sizeof(t))
        code = 5;
    zmq_msg_close(&m);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return code;
}

int main(int argc, char **argv)
{
    int nc = 4;
    uint64_t size = 1000000, count = 2000;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--consumers") == 0)
            nc = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--size") == 0)
            size = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--count") == 0)
            count = strtoull(argv[i + 1], NULL, 10);
        else
            return 2;
    }
    if (nc < 1 || nc > MAX_CONSUMERS || size < 2 || count < 1)
        return 2;
    char ep[64];
    snprintf(ep, sizeof(ep), "ipc:///tmp/tdp-fanout-zmq-%d", (int)getpid());

    pid_t pid[MAX_CONSUMERS];
    int from[MAX_CONSUMERS];
    for (int i = 0; i < nc; i++) {
        int p[2];
        if (pipe(p) != 0)
            return 1;
        pid[i] = fork();
        if (pid[i] == 0) {
            close(p[0]);
            usleep(200000); /* the publisher binds first */
            _exit(subscriber(ep, p[1], count, size));
        }
        close(p[1]);
        from[i] = p[0];
    }
    void *ctx = zmq_ctx_new();
    void *pub = zmq_socket(ctx, ZMQ_XPUB);
    int hwm = HWM, one = 1;
    zmq_setsockopt(pub, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(pub, ZMQ_XPUB_NODROP, &one, sizeof(one));
    zmq_setsockopt(pub, ZMQ_XPUB_VERBOSE, &one, sizeof(one)); /* every subscription, duplicates too */
    if (zmq_bind(pub, ep) != 0)
        return 1;
    /* every subscription in (XPUB hands them up) before the stream starts */
    char sub[256];
    for (int n = 0; n < nc;)
        if (zmq_recv(pub, sub, sizeof(sub), 0) >= 1 && sub[0] == 1)
            n++;
    void *buf = calloc(1, size);
    uint64_t t0 = now_ns();
    for (uint64_t k = 0; k < count; k++) {
        zmq_msg_t m;
        zmq_msg_init_data(&m, buf, size, NULL, NULL);
        while (zmq_msg_send(&m, pub, 0) < 0) {
            if (errno != EAGAIN)
                return 1;
            usleep(10);
        }
    }
    uint64_t last = 0;
    int bad = 0;
    for (int i = 0; i < nc; i++) {
        uint64_t t = 0;
        int st;
        if (read(from[i], &t, sizeof(t)) != sizeof(t))
            bad++;
        last = t > last ? t : last;
        waitpid(pid[i], &st, 0);
        bad += !WIFEXITED(st) || WEXITSTATUS(st) != 0;
    }
    double secs = (double)(last - t0) / 1e9;
    printf("{\"peer\":\"zmq-xpub-ipc\",\"consumers\":%d,\"size\":%" PRIu64 ",\"count\":%" PRIu64
           ",\"msgs_per_s\":%.1f,\"bytes_per_s\":%.0f,\"failed_consumers\":%d}\n",
           nc, size, count, (double)count / secs, (double)(count * size) / secs, bad);
    zmq_close(pub);
    zmq_ctx_term(ctx);
    free(buf);
    return bad ? 1 : 0;
}
