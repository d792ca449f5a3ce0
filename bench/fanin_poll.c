/*
 * fanin_poll: the baseline `tdpipe bench --fanin N --fanin-baseline PROG`
 * measures a fan-in against — what an application writes without one. It
 * accepts N producers, each on its own pipe, posts one receive per pipe
 * whose completion writes that pipe's eventfd, and drains them with a
 * poll(2) loop: release, post again.
 *
 *   tdp_fanin_poll --producers N --rounds TOTAL [--depth D] [--plane NAME]
 *
 * Prints "port P", then "result BYTES NS" (bytes received from the first
 * tenth of TOTAL messages to the last, and the time that took), then waits
 * for its stdin to close. The protocol of tdpipe bench's consumer roles.
 */
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <tdpipe/tdpipe.h>

#define MAXP 64

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Loop thread: only wake the poll loop. */
static void done_cb(tdp_op *op, void *arg)
{
    (void)op;
    uint64_t one = 1;
    ssize_t n = write((int)(intptr_t)arg, &one, sizeof(one));
    (void)n;
}

int main(int argc, char **argv)
{
    int n = 0;
    uint64_t total = 0;
    uint32_t depth = 4;
    tdp_plane plane = TDP_PLANE_AUTO;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--producers") == 0)
            n = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--rounds") == 0)
            total = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--depth") == 0)
            depth = (uint32_t)atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--plane") == 0 && tdp_plane_parse(argv[i + 1], &plane) != TDP_OK)
            return 2;
    }
    if (n < 1 || n > MAXP || total == 0) {
        fprintf(stderr, "usage: tdp_fanin_poll --producers N --rounds TOTAL [--depth D] "
                        "[--plane NAME]\n");
        return 2;
    }
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.recv_depth = depth;
    o.plane = plane;
    if (tdp_loop_new(NULL, &loop) != TDP_OK || tdp_loop_start_thread(loop) != TDP_OK ||
        tdp_listener_new(loop, "127.0.0.1", 0, &o, NULL, NULL, &l) != TDP_OK)
        return 3;
    printf("port %u\n", tdp_listener_port(l));
    fflush(stdout);

    tdp_pipe *pipes[MAXP];
    tdp_op *ops[MAXP];
    struct pollfd pfd[MAXP];
    int efd[MAXP];
    for (int i = 0; i < n; i++) {
        if (tdp_listener_accept(l, 60000, &pipes[i]) != TDP_OK)
            return 4;
        pfd[i] = (struct pollfd){.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC), .events = POLLIN};
        efd[i] = pfd[i].fd;
        if (pfd[i].fd < 0 || tdp_op_new(done_cb, (void *)(intptr_t)pfd[i].fd, &ops[i]) != TDP_OK)
            return 5;
        tdp_pipe_recv_async(pipes[i], ops[i]);
    }
    tdp_listener_free(l);

    uint64_t got = 0, warm = total / 10 + 1, bytes = 0, t0 = 0;
    int open = n, rc = 0;
    while (got < total && open > 0) {
        if (poll(pfd, (nfds_t)n, 60000) <= 0) {
            rc = 6;
            break;
        }
        for (int i = 0; i < n; i++) {
            if (!(pfd[i].revents & POLLIN))
                continue;
            uint64_t v;
            while (read(pfd[i].fd, &v, sizeof(v)) > 0)
                ;
            tdp_err r = tdp_op_result(ops[i]);
            if (r == TDP_EAGAIN)
                continue;
            if (r != TDP_OK) { /* that producer is done */
                pfd[i].fd = -1;
                open--;
                continue;
            }
            tdp_td *td = tdp_op_td(ops[i]);
            if (++got == warm)
                t0 = now_ns();
            if (got > warm)
                bytes += tdp_td_nbytes(td);
            tdp_pipe_release(pipes[i], td);
            tdp_pipe_recv_async(pipes[i], ops[i]);
        }
    }
    if (rc == 0 && got == total) {
        printf("result %" PRIu64 " %" PRIu64 "\n", bytes, now_ns() - t0);
        fflush(stdout);
    } else if (rc == 0) {
        rc = 7;
    }
    char b[64];
    while (read(STDIN_FILENO, b, sizeof(b)) > 0) /* until the producers are done */
        ;
    for (int i = 0; i < n; i++) {
        tdp_pipe_free(pipes[i]); /* completes a pending receive */
        tdp_op_free(ops[i]);
        close(efd[i]);
    }
    tdp_loop_free(loop);
    return rc;
}
