/*
 * bench_fanin.c: `tdpipe bench --fanin N` — N producers into one tdp_fanin
 * at once, against one producer alone, and (with --fanin-baseline PROG)
 * against the same N producers each on its own pipe drained by PROG, a
 * hand-written poll loop (bench/fanin_poll.c).
 *
 * The consumer runs in a child process (`tdpipe bench --role=fanin`, or
 * PROG); the fan-in's runs no loop thread, its receiving thread drives the
 * loop (PROG, a poll loop over the pipes' receive ops, needs one). It
 * times what it receives, as `--clients` does: from the moment
 * the first tenth of all messages has arrived to the last one, bytes
 * counted exactly. The producers are N pipes on one loop in this process
 * (tdp_bench_producers), sending back to back; with --fanin-procs each is
 * a process of its own, as a data loader's workers are.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <tdpipe/tdpipe.h>

#include "cli.h"
#include "report.h"

int tdp_bench_fanin_consumer(uint64_t expect, uint32_t depth, tdp_plane plane)
{
    tdp_loop *loop;
    tdp_fanin *f;
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    o.listener.pipe.recv_depth = depth;
    o.listener.pipe.plane = plane;
    o.max_producers = 4096;
    /* no loop thread: each blocking receive drives the loop on this one (one
     * wake-up per message, not two; producers are accepted meanwhile) */
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_fanin_new(loop, "127.0.0.1", 0, &o, &f) != TDP_OK)
        return TDP_EXIT_CONNECT;
    printf("port %u\n", tdp_fanin_port(f));
    fflush(stdout);
    uint64_t got = 0, warm = expect / 10 + 1, bytes = 0, t0 = 0;
    int ec = TDP_EXIT_FAIL;
    while (got < expect) {
        tdp_fanin_msg m;
        if (tdp_fanin_recv(f, 60000, &m) != TDP_OK)
            goto out;
        if (m.kind == TDP_FANIN_MSG) {
            if (++got == warm)
                t0 = tdp_cli_now_ns();
            if (got > warm)
                bytes += tdp_td_nbytes(m.td);
        }
        tdp_fanin_release(f, &m);
    }
    printf("result %" PRIu64 " %" PRIu64 "\n", bytes, tdp_cli_now_ns() - t0);
    fflush(stdout);
    ec = TDP_EXIT_OK;
out:;
    char b[64];
    while (read(STDIN_FILENO, b, sizeof(b)) > 0) /* until the producers are done */
        ;
    tdp_fanin_free(f);
    tdp_loop_free(loop);
    return ec;
}

static tdp_err run(int n, uint64_t size, int total, uint32_t depth, tdp_plane plane, bool procs,
                   const char *prog, double *bps, const char **used)
{
    char tot[24], dep[16], np[16];
    snprintf(tot, sizeof(tot), "%d", total);
    snprintf(dep, sizeof(dep), "%u", depth);
    snprintf(np, sizeof(np), "%d", n);
    const char *fan[] = {
        "/proc/self/exe",      "bench", "--role=fanin", "--rounds", tot, "--depth", dep, "--plane",
        tdp_plane_name(plane), NULL};
    const char *base[] = {prog,      "--producers",         np,  "--rounds", tot, "--depth", dep,
                          "--plane", tdp_plane_name(plane), NULL};
    return tdp_bench_producers(n, size, total, plane, procs, prog != NULL ? base : fan, bps, used);
}

int tdp_bench_fanin(int n, uint64_t size, int total, uint32_t depth, tdp_plane plane, bool procs,
                    const char *baseline, const char *json, bool quiet)
{
    double one = 0, many = 0, polled = 0;
    char a[TDP_CLI_FMT_LEN], b[TDP_CLI_FMT_LEN], c[TDP_CLI_FMT_LEN], d[16], sz[TDP_CLI_FMT_LEN];

    if (total <= 0)
        total = (int)((4ull << 30) / size); /* about 4 GiB in all */
    if (total < 10 * n)
        total = 10 * n;
    tdp_cli_format_size(size, sz, sizeof(sz));
    if (!quiet)
        fprintf(stderr, "tdpipe bench: %d messages of %s into a fan-in: 1 producer, then %d%s\n",
                total, sz, n,
                baseline != NULL ? ", then the same on pipes drained by a poll loop" : "");
    const char *used = "?";
    tdp_err rc = run(1, size, total, depth, plane, procs, NULL, &one, &used);
    if (rc == TDP_OK)
        rc = run(n, size, total, depth, plane, procs, NULL, &many, &used);
    if (rc == TDP_OK && baseline != NULL)
        rc = run(n, size, total, depth, plane, procs, baseline, &polled, &used);
    if (rc != TDP_OK) {
        tdp_cli_error("bench", "fan-in run failed: %s", tdp_strerror(rc));
        return tdp_cli_exit_for(rc);
    }
    printf("fan-in, plane %s, depth %u per producer, producers %s\n", used, depth,
           procs ? "in processes of their own" : "on one loop of one process");
    printf("%-10s %9s %14s %14s %8s %14s %8s\n", "size", "producers", "1 producer", "fan-in",
           "ratio", "poll loop", "ratio");
    printf("%-10s %9d %14s %14s %8.2f %14s %8s\n", sz, n, tdp_cli_format_rate(one, a, sizeof(a)),
           tdp_cli_format_rate(many, b, sizeof(b)), one > 0 ? many / one : 0.0,
           baseline != NULL ? tdp_cli_format_rate(polled, c, sizeof(c)) : "-",
           baseline != NULL && polled > 0 ? (snprintf(d, sizeof(d), "%.2f", many / polled), d)
                                          : "-");
    if (json != NULL) {
        json_t *o = json_object();
        json_object_set_new(o, "mode", json_string("fanin"));
        json_object_set_new(o, "plane", json_string(used));
        json_object_set_new(o, "depth", json_integer(depth));
        json_object_set_new(o, "producer_processes", json_boolean(procs));
        json_object_set_new(o, "size", json_integer((json_int_t)size));
        json_object_set_new(o, "messages", json_integer(total));
        json_object_set_new(o, "producers", json_integer(n));
        json_object_set_new(o, "one_producer_bytes_per_s", json_real(one));
        json_object_set_new(o, "fanin_bytes_per_s", json_real(many));
        json_object_set_new(o, "ratio_to_one", json_real(one > 0 ? many / one : 0.0));
        if (baseline != NULL) {
            json_object_set_new(o, "poll_loop_bytes_per_s", json_real(polled));
            json_object_set_new(o, "ratio_to_poll_loop",
                                json_real(polled > 0 ? many / polled : 0.0));
        }
        FILE *fp = fopen(json, "w");
        if (fp == NULL)
            json_decref(o);
        if (fp == NULL || !tdp_cli_json_line(o, fp)) {
            tdp_cli_error("bench", "cannot write %s", json);
            if (fp != NULL)
                fclose(fp);
            return TDP_EXIT_FAIL;
        }
        fclose(fp);
    }
    return TDP_EXIT_OK;
}
