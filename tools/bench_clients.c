/*
 * bench_clients.c: `tdpipe bench --clients N` — N producers streaming to one
 * tdp_server at once, against one producer alone, on loopback.
 *
 * The server runs in a child process (started as `tdpipe bench
 * --role=server`) and times what it receives: from the moment the first
 * tenth of all messages has arrived to the last message, bytes counted
 * exactly. The producers are N pipes on one loop in this process, each
 * sending its share back to back with asynchronous sends. The same run with
 * one producer and the same total gives the single-client figure; the
 * ratio of the two is how well the server shares its receive path.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <tdpipe/tdpipe.h>

#include "cli.h"

/* ---- the server (child) ------------------------------------------------------ */

typedef struct srv_state {
    uint64_t expect, warm, got, bytes;
    uint64_t t_first, t_last;
    bool reported;
} srv_state;

static tdp_err srv_on_message(tdp_client *c, tdp_td *td, void *arg)
{
    srv_state *st = arg;
    st->got++;
    if (st->got == st->warm)
        st->t_first = tdp_cli_now_ns();
    if (st->got > st->warm)
        st->bytes += tdp_td_nbytes(td);
    if (st->got == st->expect && !st->reported) {
        st->t_last = tdp_cli_now_ns();
        st->reported = true;
        printf("result %" PRIu64 " %" PRIu64 "\n", st->bytes, st->t_last - st->t_first);
        fflush(stdout);
    }
    return TDP_OK;
}

int tdp_bench_clients_server(uint64_t expect, uint32_t depth, tdp_plane plane)
{
    tdp_loop *loop;
    tdp_server *srv;
    srv_state st = {.expect = expect, .warm = expect / 10 + 1};
    tdp_server_handler h = {.size = sizeof(h), .on_message = srv_on_message};
    tdp_server_opts so;

    tdp_server_opts_default(&so);
    so.pipe.recv_depth = depth;
    so.pipe.plane = plane;
    so.max_clients = 4096;
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_server_new(loop, "127.0.0.1", 0, &so, &h, &st, &srv) != TDP_OK)
        return TDP_EXIT_CONNECT;
    printf("port %u\n", tdp_server_port(srv));
    fflush(stdout);
    /* serve on this thread until the producer says it is done (stdin closes) */
    if (tdp_loop_start_thread(loop) != TDP_OK)
        return TDP_EXIT_FAIL;
    char b[64];
    while (read(STDIN_FILENO, b, sizeof(b)) > 0)
        ;
    tdp_server_shutdown(srv, 5000);
    tdp_server_free(srv);
    tdp_loop_free(loop);
    return st.reported ? TDP_EXIT_OK : TDP_EXIT_FAIL;
}

/* ---- the producers ------------------------------------------------------------ */

typedef struct producer {
    tdp_pipe *pipe;
    tdp_op *op;
    tdp_td *td;
    int left;
    tdp_err rc;
    _Atomic int *running;
} producer;

static void prod_sent(tdp_op *op, void *arg)
{
    producer *pr = arg;
    tdp_err rc = tdp_op_result(op);
    if (rc != TDP_OK || --pr->left == 0) {
        pr->rc = rc;
        atomic_fetch_sub(pr->running, 1);
        return;
    }
    tdp_pipe_send_async(pr->pipe, pr->td, op); /* back to back */
}

/* Read one line from fd within timeout_ms; false on timeout or EOF. */
static bool read_line(int fd, char *buf, size_t len, int timeout_ms)
{
    size_t n = 0;
    while (n + 1 < len) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, timeout_ms) <= 0)
            return false;
        ssize_t r = read(fd, buf + n, 1);
        if (r <= 0)
            return false;
        if (buf[n] == '\n')
            break;
        n++;
    }
    buf[n] = '\0';
    return true;
}

/*
 * A producer in a process of its own (tdp_bench_producers with procs): its
 * loop, one pipe, its share sent back to back with blocking sends (no loop
 * thread: each send drives the loop on this one), then a clean close. It
 * writes the plane its pipe took to plane_fd once connected.
 */
static int producer_proc(unsigned port, uint64_t size, int count, tdp_plane plane, int plane_fd)
{
    tdp_loop *loop;
    tdp_schema *s;
    tdp_td *td;
    tdp_pipe *p;
    tdp_pipe_opts po;
    tdp_pipe_opts_default(&po);
    po.plane = plane;
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_cli_synth_schema(size, TDP_DEVICE_CPU_INIT, &s) != TDP_OK ||
        tdp_td_new(s, &td) != TDP_OK)
        return TDP_EXIT_FAIL;
    tdp_cli_fill(td, 1);
    if (tdp_pipe_connect(loop, "127.0.0.1", (uint16_t)port, &po, &p) != TDP_OK)
        return TDP_EXIT_CONNECT;
    uint8_t used = (uint8_t)tdp_pipe_plane(p);
    if (write(plane_fd, &used, 1) != 1)
        return TDP_EXIT_FAIL;
    for (int i = 0; i < count; i++)
        if (tdp_pipe_send(p, td, 60000) != TDP_OK)
            return TDP_EXIT_PEER;
    int ec = tdp_pipe_close(p, 10000) == TDP_OK ? TDP_EXIT_OK : TDP_EXIT_PEER;
    tdp_pipe_free(p);
    tdp_loop_free(loop);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    return ec;
}

/* n producer processes against the consumer at port; TDP_OK once all have sent and closed. */
static tdp_err run_producer_procs(int n, uint64_t size, int total, tdp_plane plane, unsigned port,
                                  const char **plane_used)
{
    int pl[2];
    pid_t pids[1024];
    int started = 0;
    tdp_err rc = TDP_OK;
    if (n > 1024 || pipe(pl) != 0)
        return TDP_ENOMEM;
    fflush(NULL);
    for (int i = 0; i < n; i++, started++) {
        pids[i] = fork();
        if (pids[i] < 0) {
            rc = TDP_ENOMEM;
            break;
        }
        if (pids[i] == 0) {
            close(pl[0]);
            _exit(producer_proc(port, size, total / n + (i < total % n), plane, pl[1]));
        }
    }
    close(pl[1]);
    /* every producer says its plane once connected (all read: a closed pipe would fail them) */
    uint8_t used;
    for (int i = 0; i < started && read(pl[0], &used, 1) == 1; i++)
        if (tdp_plane_name((tdp_plane)used) != NULL)
            *plane_used = tdp_plane_name((tdp_plane)used);
    close(pl[0]);
    for (int i = 0; i < started; i++) {
        int st;
        if (waitpid(pids[i], &st, 0) != pids[i] || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
            rc = rc != TDP_OK ? rc : TDP_ECONNRESET;
    }
    return rc;
}

/* One run: n producers, `total` messages of `size` bytes; bytes/s at the server. */
static tdp_err run_clients(int n, uint64_t size, int total, uint32_t depth, tdp_plane plane,
                           double *bps, const char **plane_used)
{
    char tot[24], dep[16];
    snprintf(tot, sizeof(tot), "%d", total);
    snprintf(dep, sizeof(dep), "%u", depth);
    const char *argv[] = {
        "/proc/self/exe",      "bench", "--role=server", "--rounds", tot, "--depth", dep, "--plane",
        tdp_plane_name(plane), NULL};
    return tdp_bench_producers(n, size, total, plane, false, argv, bps, plane_used);
}

tdp_err tdp_bench_producers(int n, uint64_t size, int total, tdp_plane plane, bool procs,
                            const char *const *child_argv, double *bps, const char **plane_used)
{
    int to_child[2], from_child[2];
    char line[128];
    tdp_err rc = TDP_EINTERNAL;

    if (pipe(to_child) != 0 || pipe(from_child) != 0)
        return TDP_ENOMEM;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(to_child[0], STDIN_FILENO);
        dup2(from_child[1], STDOUT_FILENO);
        close(to_child[1]);
        close(from_child[0]);
        tdp_cli_ucx_log_env();
        execv(child_argv[0], (char *const *)child_argv);
        _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    unsigned port = 0;
    if (!read_line(from_child[0], line, sizeof(line), 20000) ||
        sscanf(line, "port %u", &port) != 1) {
        tdp_cli_error("bench", "the server process did not start");
        goto out_child;
    }

    if (procs) {
        /* the producers first: their results decide, then the consumer's figure */
        rc = run_producer_procs(n, size, total, plane, port, plane_used);
        unsigned long long bytes = 0, ns = 0;
        if (rc == TDP_OK && (!read_line(from_child[0], line, sizeof(line), 600000) ||
                             sscanf(line, "result %llu %llu", &bytes, &ns) != 2 || ns == 0)) {
            tdp_cli_error("bench", "no result from the consumer process");
            rc = TDP_ETIMEDOUT;
        } else if (rc == TDP_OK) {
            *bps = (double)bytes / ((double)ns / 1e9);
        }
        goto out_child;
    }
    tdp_loop *loop;
    tdp_schema *s = NULL;
    tdp_td *td = NULL;
    producer *pr = calloc((size_t)n, sizeof(*pr));
    _Atomic int running = n;
    if (pr == NULL || tdp_loop_new(NULL, &loop) != TDP_OK) {
        free(pr);
        goto out_child;
    }
    if (tdp_cli_synth_schema(size, TDP_DEVICE_CPU_INIT, &s) != TDP_OK ||
        tdp_td_new(s, &td) != TDP_OK || tdp_loop_start_thread(loop) != TDP_OK)
        goto out_loop;
    tdp_cli_fill(td, 1);
    tdp_pipe_opts po;
    tdp_pipe_opts_default(&po);
    po.plane = plane;
    int connected = 0;
    for (int i = 0; i < n; i++, connected++) {
        pr[i] = (producer){.td = td, .left = total / n + (i < total % n), .running = &running};
        if ((rc = tdp_pipe_connect(loop, "127.0.0.1", (uint16_t)port, &po, &pr[i].pipe)) !=
                TDP_OK ||
            (rc = tdp_op_new(prod_sent, &pr[i], &pr[i].op)) != TDP_OK)
            goto out_pipes;
    }
    *plane_used = tdp_cli_plane_of(pr[0].pipe); /* a static name */
    for (int i = 0; i < n; i++)
        tdp_pipe_send_async(pr[i].pipe, td, pr[i].op);
    unsigned long long bytes = 0, ns = 0;
    if (!read_line(from_child[0], line, sizeof(line), 600000) ||
        sscanf(line, "result %llu %llu", &bytes, &ns) != 2 || ns == 0) {
        tdp_cli_error("bench", "no result from the server process");
        rc = TDP_ETIMEDOUT;
    } else {
        *bps = (double)bytes / ((double)ns / 1e9);
        rc = TDP_OK;
    }
    for (int k = 0; k < 10000 && atomic_load(&running) > 0; k++)
        usleep(1000);
    for (int i = 0; i < n && rc == TDP_OK; i++)
        if (pr[i].rc != TDP_OK)
            rc = pr[i].rc;
out_pipes:
    for (int i = 0; i < connected; i++) {
        if (pr[i].pipe != NULL) {
            tdp_pipe_close(pr[i].pipe, 5000);
            tdp_pipe_free(pr[i].pipe);
        }
        tdp_op_free(pr[i].op);
    }
out_loop:
    tdp_loop_free(loop);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    free(pr);
out_child:
    close(to_child[1]); /* tells the server to stop */
    close(from_child[0]);
    int st;
    waitpid(pid, &st, 0);
    return rc;
}

int tdp_bench_clients(int n, uint64_t size, int total, uint32_t depth, tdp_plane plane, bool quiet)
{
    double one = 0, many = 0;
    char a[TDP_CLI_FMT_LEN], b[TDP_CLI_FMT_LEN], sz[TDP_CLI_FMT_LEN];

    if (total <= 0)
        total = (int)((4ull << 30) / size); /* about 4 GiB in all */
    if (total < 10 * n)
        total = 10 * n;
    tdp_cli_format_size(size, sz, sizeof(sz));
    if (!quiet)
        fprintf(stderr, "tdpipe bench: %d messages of %s, 1 client, then %d client%s\n", total, sz,
                n, tdp_cli_s((uint64_t)n));
    const char *used = "?";
    tdp_err rc = run_clients(1, size, total, depth, plane, &one, &used);
    if (rc == TDP_OK)
        rc = run_clients(n, size, total, depth, plane, &many, &used);
    if (rc != TDP_OK) {
        tdp_cli_error("bench", "clients run failed: %s", tdp_strerror(rc));
        return tdp_cli_exit_for(rc);
    }
    printf("plane %s, depth %u\n", used, depth);
    printf("%-10s %8s %14s %14s %8s\n", "size", "clients", "1 client", "aggregate", "ratio");
    printf("%-10s %8d %14s %14s %8.2f\n", sz, n, tdp_cli_format_rate(one, a, sizeof(a)),
           tdp_cli_format_rate(many, b, sizeof(b)), one > 0 ? many / one : 0.0);
    return TDP_EXIT_OK;
}
