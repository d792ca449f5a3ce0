/*
 * recv_fanin.c: `tdpipe recv --producers N`. A fan-in accepts the
 * producers; messages are verified against `tdpipe send`'s pattern with
 * each producer's own sequence numbers; rate lines and the summary give
 * the totals and each producer's figures. The run ends when N producers
 * have left (or --count messages arrived, or a signal).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "recv_fanin.h"
#include "report.h"

#define SLICE_MS 200 /* receive in slices: a signal or a rate line is never late by more */

/* What the run saw of one producer. */
typedef struct prod {
    uint64_t id;
    char peer[64];
    uint64_t msgs, bytes, bad;
    uint64_t last_msgs, last_bytes; /* at the last rate line */
    tdp_err end;                    /* its LEAVE's status; TDP_OK while it streams */
} prod;

typedef struct run {
    const tdp_cli_fanin_args *a;
    prod *p;
    size_t np, cap;
    uint32_t joined, left, failed;
    tdp_cli_meter m;
    uint64_t bad, checked;
    uint64_t last_ns, last_msgs, last_bytes;
    tdp_err end; /* what ended the loop: TDP_OK (done), a receive error */
    int signal;
} run;

static prod *find(run *r, uint64_t id)
{
    for (size_t i = 0; i < r->np; i++)
        if (r->p[i].id == id)
            return &r->p[i];
    return NULL;
}

static prod *join(run *r, const tdp_fanin_msg *m)
{
    if (r->np == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 8;
        prod *p = realloc(r->p, cap * sizeof(*p));
        if (p == NULL)
            return NULL;
        r->p = p;
        r->cap = cap;
    }
    prod *p = &r->p[r->np++];
    *p = (prod){.id = m->producer};
    snprintf(p->peer, sizeof(p->peer), "%s", m->peer);
    return p;
}

static double per_s(uint64_t n, uint64_t ns)
{
    return ns > 0 ? (double)n * 1e9 / (double)ns : 0.0;
}

/* One rate line on stderr: totals, then each producer still streaming or seen since. */
static void rate_line(run *r, uint64_t now)
{
    uint64_t dt = now - r->last_ns, el = now - r->m.start_ns;
    char rate[32], buf[4096];
    if (r->a->json) {
        json_t *o = json_object(), *ps = json_array();
        json_object_set_new(o, "cmd", json_string("recv"));
        json_object_set_new(o, "elapsed_s", json_real((double)el / 1e9));
        json_object_set_new(o, "msgs", json_integer((json_int_t)r->m.msgs));
        json_object_set_new(o, "bytes", json_integer((json_int_t)r->m.bytes));
        json_object_set_new(o, "msgs_per_s", json_real(per_s(r->m.msgs - r->last_msgs, dt)));
        json_object_set_new(o, "bytes_per_s", json_real(per_s(r->m.bytes - r->last_bytes, dt)));
        json_object_set_new(o, "producers_now", json_integer(r->joined - r->left));
        for (size_t i = 0; i < r->np; i++) {
            prod *p = &r->p[i];
            json_t *po = json_object();
            json_object_set_new(po, "id", json_integer((json_int_t)p->id));
            json_object_set_new(po, "peer", json_string(p->peer));
            json_object_set_new(po, "msgs", json_integer((json_int_t)p->msgs));
            json_object_set_new(po, "bytes", json_integer((json_int_t)p->bytes));
            json_object_set_new(po, "msgs_per_s", json_real(per_s(p->msgs - p->last_msgs, dt)));
            json_object_set_new(po, "bytes_per_s", json_real(per_s(p->bytes - p->last_bytes, dt)));
            json_array_append_new(ps, po);
        }
        json_object_set_new(o, "producers", ps);
        tdp_cli_json_line(o, stderr);
    } else {
        int n = snprintf(
            buf, sizeof(buf), "recv: %.2f s, %u producer%s, %" PRIu64 " messages, %.0f msgs/s, %s",
            (double)el / 1e9, r->joined - r->left, tdp_cli_s(r->joined - r->left), r->m.msgs,
            per_s(r->m.msgs - r->last_msgs, dt),
            tdp_cli_format_rate(per_s(r->m.bytes - r->last_bytes, dt), rate, sizeof(rate)));
        for (size_t i = 0; i < r->np && n > 0 && (size_t)n < sizeof(buf); i++) {
            prod *p = &r->p[i];
            if (p->end != TDP_OK && p->msgs == p->last_msgs)
                continue; /* gone, and nothing since the last line */
            n += snprintf(
                buf + n, sizeof(buf) - (size_t)n, "; #%" PRIu64 " %.0f msgs/s %s", p->id,
                per_s(p->msgs - p->last_msgs, dt),
                tdp_cli_format_rate(per_s(p->bytes - p->last_bytes, dt), rate, sizeof(rate)));
        }
        fprintf(stderr, "%s\n", buf);
    }
    for (size_t i = 0; i < r->np; i++) {
        r->p[i].last_msgs = r->p[i].msgs;
        r->p[i].last_bytes = r->p[i].bytes;
    }
    r->last_ns = now;
    r->last_msgs = r->m.msgs;
    r->last_bytes = r->m.bytes;
}

static void take_msg(run *r, const tdp_fanin_msg *m)
{
    prod *p = find(r, m->producer);
    uint64_t n = tdp_td_nbytes(m->td), off = 0;
    tdp_cli_meter_add(&r->m, n);
    if (p == NULL)
        return;
    p->msgs++;
    p->bytes += n;
    /* `tdpipe send`'s pattern, numbered by that producer's own sequence */
    if (r->a->verify && tdp_cli_wants_echo(tdp_td_schema(m->td)) >= 0) {
        r->checked++;
        if (tdp_cli_verify(m->td, m->seq, &off) != TDP_OK && p->bad++ == 0 && r->bad++ == 0)
            tdp_cli_error("recv",
                          "producer %" PRIu64 " message %" PRIu64
                          ": pattern mismatch at byte %" PRIu64,
                          p->id, m->seq, off);
    }
}

static void receive(run *r, tdp_fanin *f)
{
    const tdp_cli_fanin_args *a = r->a;
    uint64_t interval_ns = (uint64_t)(a->interval * 1e9);
    uint64_t idle_since = tdp_cli_now_ns();
    r->last_ns = r->m.start_ns;
    while (r->left < a->producers && (a->count == 0 || r->m.msgs < a->count)) {
        if ((r->signal = tdp_cli_interrupted()) != 0) {
            r->end = TDP_ECANCELED;
            return;
        }
        tdp_fanin_msg m;
        tdp_err rc = tdp_fanin_recv(f, SLICE_MS, &m);
        uint64_t now = tdp_cli_now_ns();
        if (interval_ns > 0 && now - r->last_ns >= interval_ns)
            rate_line(r, now);
        if (rc == TDP_ETIMEDOUT) {
            if (a->timeout_ms >= 0 && now - idle_since >= (uint64_t)a->timeout_ms * 1000000u) {
                r->end = TDP_ETIMEDOUT;
                return;
            }
            continue;
        }
        if (rc != TDP_OK) {
            r->end = rc;
            return;
        }
        idle_since = now;
        prod *p;
        switch (m.kind) {
        case TDP_FANIN_JOIN:
            if (join(r, &m) == NULL) {
                r->end = TDP_ENOMEM;
                return;
            }
            if (r->joined++ == 0) {
                tdp_cli_meter_start(&r->m); /* the figures count from the first producer */
                r->last_ns = r->m.start_ns;
            }
            if (r->joined == a->producers)
                tdp_fanin_close(f); /* all here: later ones are refused */
            if (!a->json)
                fprintf(stderr, "recv: producer %" PRIu64 " connected from %s\n", m.producer,
                        m.peer);
            break;
        case TDP_FANIN_MSG:
            take_msg(r, &m);
            break;
        case TDP_FANIN_LEAVE:
            r->left++;
            if ((p = find(r, m.producer)) != NULL)
                p->end = m.status;
            r->failed += m.status != TDP_ECLOSED;
            if (!a->json && m.status != TDP_ECLOSED)
                tdp_cli_error("recv",
                              "producer %" PRIu64 " (%s) failed after %" PRIu64 " messages: %s",
                              m.producer, m.peer, p != NULL ? p->msgs : 0, tdp_strerror(m.status));
            break;
        }
        tdp_fanin_release(f, &m);
    }
    r->end = TDP_OK;
}

static const char *end_text(tdp_err e)
{
    return e == TDP_OK ? "streaming" : e == TDP_ECLOSED ? "producer closed" : tdp_strerror(e);
}

static void summary(run *r)
{
    const tdp_cli_fanin_args *a = r->a;
    uint64_t now = tdp_cli_now_ns(), el = now - r->m.start_ns;
    const char *verify = !a->verify        ? "off"
                         : r->bad          ? "FAILED"
                         : r->m.msgs == 0  ? "none (nothing received)"
                         : r->checked == 0 ? "skipped (not the send pattern)"
                                           : "ok";
    char line[256], rate[32];
    if (a->json) {
        json_t *o = json_object(), *ps = json_array();
        json_object_set_new(o, "cmd", json_string("recv"));
        tdp_cli_meter_json(o, &r->m, now);
        json_object_set_new(o, "verify",
                            json_string(!a->verify        ? "off"
                                        : r->bad          ? "failed"
                                        : r->m.msgs == 0  ? "none"
                                        : r->checked == 0 ? "skipped"
                                                          : "ok"));
        json_object_set_new(o, "bad", json_integer((json_int_t)r->bad));
        json_object_set_new(o, "depth", json_integer(a->depth));
        json_object_set_new(o, "producers_joined", json_integer(r->joined));
        json_object_set_new(o, "producers_failed", json_integer(r->failed));
        for (size_t i = 0; i < r->np; i++) {
            prod *p = &r->p[i];
            json_t *po = json_object();
            json_object_set_new(po, "id", json_integer((json_int_t)p->id));
            json_object_set_new(po, "peer", json_string(p->peer));
            json_object_set_new(po, "msgs", json_integer((json_int_t)p->msgs));
            json_object_set_new(po, "bytes", json_integer((json_int_t)p->bytes));
            json_object_set_new(po, "bytes_per_s", json_real(per_s(p->bytes, el)));
            json_object_set_new(po, "bad", json_integer((json_int_t)p->bad));
            json_object_set_new(po, "end", json_string(end_text(p->end)));
            json_array_append_new(ps, po);
        }
        json_object_set_new(o, "producers", ps);
        json_object_set_new(o, "end",
                            json_string(r->signal          ? "interrupted"
                                        : r->end == TDP_OK ? "done"
                                                           : tdp_strerror(r->end)));
        tdp_cli_json_line(o, stdout);
        return;
    }
    printf("%s from %u producer%s; verify %s; depth %u each\n",
           tdp_cli_meter_summary(&r->m, "received", now, line, sizeof(line)), r->joined,
           tdp_cli_s(r->joined), verify, a->depth);
    for (size_t i = 0; i < r->np; i++) {
        prod *p = &r->p[i];
        printf("  producer %" PRIu64 " (%s): %" PRIu64 " messages, %s; end: %s\n", p->id, p->peer,
               p->msgs, tdp_cli_format_rate(per_s(p->bytes, el), rate, sizeof(rate)),
               end_text(p->end));
    }
}

int tdp_cli_recv_fanin(const tdp_cli_fanin_args *a)
{
    tdp_loop *loop;
    tdp_fanin *f;
    tdp_err rc;
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    o.listener.pipe.recv_depth = a->depth;
    o.listener.pipe.plane = a->plane;
    tdp_cli_apply_net_opts(&a->ka, &o.listener.pipe);
    o.max_producers = a->producers;
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK) {
        tdp_cli_error("recv", "cannot create the event loop: %s", tdp_strerror(rc));
        return TDP_EXIT_FAIL;
    }
    /* the loop on a thread of its own: producers join and stream while we verify */
    if ((rc = tdp_loop_start_thread(loop)) != TDP_OK) {
        tdp_cli_error("recv", "cannot start the loop thread: %s", tdp_strerror(rc));
        tdp_loop_free(loop);
        return TDP_EXIT_FAIL;
    }
    if ((rc = tdp_fanin_new(loop, a->bind, a->port, &o, &f)) != TDP_OK) {
        tdp_loop_free(loop);
        return tdp_cli_listen_failed("recv", a->bind, a->port, rc);
    }
    tdp_cli_print_listening(a->bind, tdp_fanin_port(f));
    run r = {.a = a};
    tdp_cli_meter_start(&r.m);
    receive(&r, f);
    summary(&r);
    int ec = TDP_EXIT_OK;
    if (r.signal != 0)
        ec = TDP_EXIT_SIGNAL(r.signal);
    else if (r.end != TDP_OK) {
        tdp_cli_error("recv", "%s after %" PRIu64 " message%s", tdp_strerror(r.end), r.m.msgs,
                      tdp_cli_s(r.m.msgs));
        ec = tdp_cli_exit_for(r.end);
    } else if (r.bad > 0 || r.failed > 0) {
        ec = TDP_EXIT_FAIL;
    }
    tdp_fanin_free(f);
    tdp_loop_free(loop);
    free(r.p);
    return ec;
}
