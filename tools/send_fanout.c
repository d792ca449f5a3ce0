/*
 * send_fanout.c: `tdpipe send` to several receivers at once (--to,
 * repeated): one fan-out (include/tdpipe/fanout.h) whose consumers are
 * the receivers dialed. Broadcast (the default): every message to each of
 * them, the producer at the pace of the slowest; --distribute: each
 * message to one receiver that is free. Rate lines and the summary show
 * each receiver's figures.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <tdpipe/tdpipe.h>

#include "cli.h"
#include "report.h"
#include "send_fanout.h"

/* The rate lines' counters: the fan-out's, and each receiver's. */
static void sample(void *arg, tdp_cli_sample *out)
{
    tdp_fanout_peer_stats ps[TDP_CLI_RATE_PEERS_MAX];
    tdp_fanout_stats st;
    uint32_t n = tdp_fanout_stats_get(arg, &st, ps, TDP_CLI_RATE_PEERS_MAX);
    memset(out, 0, sizeof(*out));
    out->npeers = n < TDP_CLI_RATE_PEERS_MAX ? n : TDP_CLI_RATE_PEERS_MAX;
    for (uint32_t i = 0; i < out->npeers; i++) {
        tdp_cli_peer_sample *p = &out->peers[i];
        snprintf(p->name, sizeof(p->name), "%s", ps[i].peer);
        p->msgs = ps[i].msgs_sent;
        p->bytes = ps[i].bytes_sent;
        p->drops = ps[i].drops;
    }
    out->msgs = st.msgs;
    out->bytes = st.bytes;
}

/* Dial every receiver; on failure says which and why, returns the exit status, else -1. */
static int dial_all(const tdp_cli_fanout_args *a, tdp_fanout *fo)
{
    tdp_pipe_opts opts = *a->pipe;
    for (uint32_t i = 0; i < a->n; i++) {
        tdp_err rc = tdp_fanout_connect(fo, a->host[i], a->port[i], &opts, NULL);
        if (rc != TDP_OK)
            return tdp_cli_connect_failed("send", a->host[i], a->port[i], rc, opts.plane);
    }
    return -1;
}

static const char *mode_name(const tdp_cli_fanout_args *a)
{
    return a->distribute ? "distribute" : "broadcast";
}

static void report_text(const tdp_cli_fanout_args *a, const tdp_cli_meter *m,
                        const tdp_fanout_peer_stats *ps, uint32_t n)
{
    char line[256], sz[TDP_CLI_FMT_LEN];
    printf("%s; to %u receiver%s%s\n",
           tdp_cli_meter_summary(m, "sent", tdp_cli_now_ns(), line, sizeof(line)), n, tdp_cli_s(n),
           a->distribute ? ", distributed" : "");
    for (uint32_t i = 0; i < n; i++)
        printf("  %s: %" PRIu64 " message%s, %s, plane %s, %" PRIu64 " dropped\n", ps[i].peer,
               ps[i].msgs_sent, tdp_cli_s(ps[i].msgs_sent),
               tdp_cli_format_size(ps[i].bytes_sent, sz, sizeof(sz)), tdp_plane_name(ps[i].plane),
               ps[i].drops);
}

static void report_json(const tdp_cli_fanout_args *a, const tdp_cli_meter *m,
                        const tdp_fanout_peer_stats *ps, uint32_t n, uint64_t size, const char *end)
{
    json_t *o = json_object(), *peers = json_array();
    json_object_set_new(o, "cmd", json_string("send"));
    tdp_cli_meter_json(o, m, tdp_cli_now_ns());
    json_object_set_new(o, "size", json_integer((json_int_t)size));
    json_object_set_new(o, "end", json_string(end));
    json_object_set_new(o, "mode", json_string(mode_name(a)));
    for (uint32_t i = 0; i < n; i++) {
        json_t *p = json_object();
        json_object_set_new(p, "peer", json_string(ps[i].peer));
        json_object_set_new(p, "plane", json_string(tdp_plane_name(ps[i].plane)));
        json_object_set_new(p, "msgs", json_integer((json_int_t)ps[i].msgs_sent));
        json_object_set_new(p, "bytes", json_integer((json_int_t)ps[i].bytes_sent));
        json_object_set_new(p, "drops", json_integer((json_int_t)ps[i].drops));
        json_array_append_new(peers, p);
    }
    json_object_set_new(o, "peers", peers);
    tdp_cli_json_line(o, stdout);
}

/* Every message to every receiver; the first error, TDP_ECANCELED when interrupted. */
static tdp_err send_all(const tdp_cli_fanout_args *a, tdp_fanout *fo, tdp_td *td, tdp_cli_meter *m)
{
    for (uint64_t seq = 1; seq <= a->count; seq++) {
        if (a->rate > 0) {
            uint64_t due = m->start_ns + (uint64_t)((double)(seq - 1) * 1e9 / a->rate);
            while (tdp_cli_now_ns() < due && !tdp_cli_interrupted())
                tdp_cli_sleep_until_ns(due);
        }
        if (tdp_cli_interrupted())
            return TDP_ECANCELED;
        if (a->fill)
            tdp_cli_fill(td, seq); /* the last send is done on every receiver: safe to write */
        tdp_err rc = tdp_fanout_send(fo, td, a->timeout_ms);
        if (rc != TDP_OK)
            return rc;
        tdp_fanout_stats st;
        if (tdp_fanout_stats_get(fo, &st, NULL, 0) == 0) {
            tdp_cli_error("send", "every receiver is gone after message %" PRIu64, seq);
            return TDP_ECONNRESET;
        }
        tdp_cli_meter_add(m, tdp_td_nbytes(td));
    }
    return TDP_OK;
}

int tdp_cli_send_fanout(const tdp_cli_fanout_args *a, tdp_td *td)
{
    tdp_loop *loop;
    tdp_fanout *fo;
    tdp_cli_meter m;
    tdp_fanout_peer_stats ps[TDP_CLI_FANOUT_MAX];
    tdp_fanout_opts fopts;
    tdp_fanout_opts_default(&fopts);
    fopts.mode = a->distribute ? TDP_FANOUT_DISTRIBUTE : TDP_FANOUT_BROADCAST;
    tdp_err rc = tdp_loop_new(NULL, &loop);
    if (rc == TDP_OK && (rc = tdp_fanout_new(loop, &fopts, &fo)) != TDP_OK)
        tdp_loop_free(loop);
    if (rc != TDP_OK) {
        tdp_cli_error("send", "cannot make the fan-out: %s", tdp_strerror(rc));
        return TDP_EXIT_FAIL;
    }
    int ec = dial_all(a, fo);
    if (ec >= 0)
        goto out;
    if (!a->quiet && !a->json)
        fprintf(stderr, "send: %s to %u receivers\n",
                a->distribute ? "distributing" : "broadcasting", a->n);
    tdp_cli_meter_start(&m);
    tdp_cli_ticker *tick = tdp_cli_ticker_start(
        "send", 0, a->json, tdp_cli_interval(a->interval, a->quiet), sample, fo);
    rc = send_all(a, fo, td, &m);
    tdp_cli_ticker_stop(tick);
    int sig = rc == TDP_ECANCELED ? tdp_cli_interrupted() : 0;
    if (sig != 0)
        rc = TDP_OK; /* the receivers see a clean end */
    uint32_t n = tdp_fanout_stats_get(fo, NULL, ps, TDP_CLI_FANOUT_MAX);
    n = n < TDP_CLI_FANOUT_MAX ? n : TDP_CLI_FANOUT_MAX;
    tdp_err crc = tdp_fanout_close(fo, a->timeout_ms);
    if (rc == TDP_OK && crc != TDP_OK) {
        tdp_cli_error("send", "close: %s", tdp_strerror(crc));
        rc = crc;
    }
    if (a->json)
        report_json(a, &m, ps, n, tdp_td_nbytes(td),
                    sig != 0       ? "interrupted"
                    : rc == TDP_OK ? "ok"
                                   : tdp_strerror(rc));
    else
        report_text(a, &m, ps, n);
    ec = rc == TDP_OK && sig ? TDP_EXIT_SIGNAL(sig) : tdp_cli_exit_for(rc);
out:
    tdp_fanout_free(fo);
    tdp_loop_free(loop);
    return ec;
}
