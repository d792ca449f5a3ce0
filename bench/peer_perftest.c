/*
 * peer_perftest.c: UCX's own limit — ucx_perftest's UCP active-message tests
 * on loopback, run as a server and a client (127.0.0.1) with the transports
 * of the environment (UCX_TLS, UCX_NET_DEVICES), as tdpipe runs.
 *
 * ucp_am_lat and ucp_am_bw are the UCP-level tests (tdpipe sends UCP active
 * messages); the plain am_lat/am_bw are UCT-level and would need a device
 * (-d) and bypass UCP's protocol selection. For each size:
 *
 *   latency     ucp_am_lat, -n rounds -w warm-up as tdpipe bench; one run
 *               with -R 50 (p50 and mean), one with -R 99 (p99). ucx_perftest
 *               reports one-way latency (half the round trip) in us; it does
 *               not report a minimum.
 *   throughput  ucp_am_bw, -n messages -w warm-up as tdpipe bench, run 3
 *               times; "overall bw" is MB/s with MB = 2^20 bytes, converted
 *               here to bytes/s. ucx_perftest times on the client, from the
 *               start (after a barrier) until the receiver's final ack.
 *
 * --wait poll (ucx_perftest's default: busy-polling) or sleep (-E sleep: wait
 * on the worker's event fd, like tdpipe's event-driven loop). --err-mode adds
 * -e: endpoints in UCX's peer-failure mode, which tdpipe's endpoints use over
 * TCP and which takes the put_zcopy rendezvous away there (docs/pipe.md).
 *
 * The server's control socket (-p) listens on all addresses — ucx_perftest
 * has no option to bind it — but the client connects to 127.0.0.1 and UCX is
 * kept on lo, so no traffic leaves the loopback device.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "peers.h"

#define PORT_TRIES    5
#define CONNECT_TRIES 100 /* the server may take a moment to listen */

/* The eight numbers of ucx_perftest's "Final:" line. */
typedef struct pt_final {
    double iters, typical_lat, avg_lat, overall_lat, avg_bw, overall_bw, avg_mr, overall_mr;
} pt_final;

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Start bin with argv, stdout and stderr into the file `out`. */
static pid_t spawn(char *const argv[], const char *out)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(out, O_WRONLY | O_TRUNC | O_CREAT, 0600);
        int nul = open("/dev/null", O_RDONLY);
        if (fd < 0 || nul < 0)
            _exit(127);
        dup2(nul, 0);
        dup2(fd, 1);
        dup2(fd, 2);
        execvp(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return NULL;
    char *buf = calloc(1, 65537);
    size_t n = buf ? fread(buf, 1, 65536, f) : 0;
    if (buf)
        buf[n] = '\0';
    fclose(f);
    return buf;
}

static bool parse_final(const char *text, pt_final *f)
{
    const char *p = text ? strstr(text, "Final:") : NULL;
    return p != NULL && sscanf(p, "Final: %lf %lf %lf %lf %lf %lf %lf %lf", &f->iters,
                               &f->typical_lat, &f->avg_lat, &f->overall_lat, &f->avg_bw,
                               &f->overall_bw, &f->avg_mr, &f->overall_mr) == 8;
}

/*
 * One ucx_perftest run: a server, then a client against 127.0.0.1 at a port
 * that was free a moment ago. A client that finds nobody listening yet is
 * started again; a server that cannot bind gets a new port.
 */
static bool run_pair(const peer_cfg *cfg, const char *test, uint64_t bytes, int iters, int warm,
                     int pct, pt_final *out)
{
    char sz[24], n[24], w[24], r[24], port[16];
    char srv_out[] = "/tmp/tdp_peers-srv-XXXXXX", cli_out[] = "/tmp/tdp_peers-cli-XXXXXX";
    int fd1 = mkstemp(srv_out), fd2 = mkstemp(cli_out);
    bool ok = false;
    char *text = NULL;
    if (fd1 < 0 || fd2 < 0)
        goto out;
    snprintf(sz, sizeof(sz), "%llu", (unsigned long long)bytes);
    snprintf(n, sizeof(n), "%d", iters);
    snprintf(w, sizeof(w), "%d", warm);
    snprintf(r, sizeof(r), "%d", pct);
    bool sleep_mode = strcmp(cfg->wait_mode, "sleep") == 0;
    for (int attempt = 0; attempt < PORT_TRIES && !ok; attempt++) {
        snprintf(port, sizeof(port), "%u", net_free_port());
        /* the server and the client differ only in the client's host argument */
        char *cli_argv[20], *srv_argv[20];
        int k = 0;
        cli_argv[k++] = (char *)cfg->perftest_bin;
        cli_argv[k++] = "127.0.0.1";
        char *rest[] = {"-p", port, "-t", (char *)test, "-s", sz, "-n", n, "-w", w, "-R", r};
        for (size_t j = 0; j < sizeof(rest) / sizeof(rest[0]); j++)
            cli_argv[k++] = rest[j];
        if (sleep_mode) {
            cli_argv[k++] = "-E";
            cli_argv[k++] = "sleep";
        }
        if (cfg->err_mode)
            cli_argv[k++] = "-e";
        cli_argv[k] = NULL;
        srv_argv[0] = cli_argv[0]; /* all but the host, the final NULL included */
        memcpy(srv_argv + 1, cli_argv + 2, (size_t)(k - 1) * sizeof(char *));
        pid_t srv = spawn(srv_argv, srv_out);
        if (srv < 0)
            break;
        for (int t = 0; t < CONNECT_TRIES; t++) {
            sleep_ms(t == 0 ? 30 : 50);
            if (waitpid(srv, NULL, WNOHANG) == srv) { /* it could not bind: another port */
                srv = -1;
                break;
            }
            bool tmo;
            pid_t cli = spawn(cli_argv, cli_out);
            int st = peers_wait_child(cli, PEERS_TMO_MS, &tmo);
            free(text);
            text = slurp(cli_out);
            if (parse_final(text, out)) {
                ok = true;
                break;
            }
            if (tmo || !WIFEXITED(st) || text == NULL || strstr(text, "connect()") == NULL) {
                fprintf(stderr, "tdp_peers perftest: %s -s %s failed:\n%s\n", test, sz,
                        text ? text : "(no output)");
                break;
            }
        }
        if (srv > 0) {
            bool tmo;
            peers_wait_child(srv, ok ? 10000 : 0, &tmo);
        }
        if (!ok && srv > 0)
            break; /* the server was up: not a port problem */
    }
out:
    if (!ok && text == NULL)
        fprintf(stderr, "tdp_peers perftest: %s -s %llu: could not run %s\n", test,
                (unsigned long long)bytes, cfg->perftest_bin);
    free(text);
    if (fd1 >= 0) {
        close(fd1);
        unlink(srv_out);
    }
    if (fd2 >= 0) {
        close(fd2);
        unlink(cli_out);
    }
    return ok;
}

static int perftest_run(const peer_cfg *cfg, size_result *res)
{
    for (int i = 0; i < cfg->nsizes; i++) {
        uint64_t bytes = cfg->sizes[i];
        size_result *s = &res[i];
        pt_final f50, f99, fb;
        char label[32];
        peers_format_size(bytes, label, sizeof(label));
        peers_result_init(s, bytes);

        int n = peers_lat_rounds(cfg, bytes), warm = peers_lat_warm(n);
        if (!run_pair(cfg, "ucp_am_lat", bytes, n, warm, 50, &f50) ||
            !run_pair(cfg, "ucp_am_lat", bytes, n, warm, 99, &f99))
            return 1;
        s->lat_mean = f50.overall_lat;
        s->lat_p50 = f50.typical_lat;
        s->lat_p99 = f99.typical_lat;
        s->lat_n = n;

        int count = peers_tp_count(cfg, bytes), twarm = peers_tp_warm(count);
        for (int r = 0; r < PEERS_REPEATS; r++) {
            if (!run_pair(cfg, "ucp_am_bw", bytes, count, twarm, 50, &fb))
                return 1;
            s->tp_bps[r] = fb.overall_bw * 1048576.0; /* MB/s there is MiB/s */
        }
        s->tp_msgs = (uint64_t)count;
        peers_tp_summary(s);
        peers_progress(cfg, "  perftest(%s%s) %-9s am_lat p50 %.2f us, am_bw %.3f GB/s\n",
                       cfg->wait_mode, cfg->err_mode ? ", -e" : "", label, s->lat_p50,
                       s->tp_median / 1e9);
    }
    return 0;
}

static void perftest_describe(const peer_cfg *cfg, json_t *obj)
{
    const char *tls = getenv("UCX_TLS"), *dev = getenv("UCX_NET_DEVICES");
    json_object_set_new(obj, "wait", json_string(cfg->wait_mode));
    json_object_set_new(obj, "err_mode", json_boolean(cfg->err_mode));
    json_object_set_new(obj, "tests", json_string("ucp_am_lat (-R 50, -R 99), ucp_am_bw"));
    json_object_set_new(obj, "ucx_tls", json_string(tls ? tls : "default"));
    json_object_set_new(obj, "ucx_net_devices", json_string(dev ? dev : "all"));
}

const peer_ops peer_perftest = {
    .name = "perftest",
    .method = "ucx_perftest (UCP level) server + client on 127.0.0.1: ucp_am_lat one-way latency "
              "(p50 and mean from a -R 50 run, p99 from a -R 99 run), ucp_am_bw overall bandwidth "
              "(3 runs), same -n/-w as tdpipe bench",
    .run = perftest_run,
    .describe = perftest_describe,
};
