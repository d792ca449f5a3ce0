/*
 * report.c: rate lines and summary pieces of `send`, `recv` and `serve`
 * (report.h).
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "report.h"

/* ---- --interval ------------------------------------------------------------ */

bool tdp_cli_parse_interval(const char *s, double *out)
{
    double v;
    if (!tdp_cli_parse_double(s, &v) || (v != 0 && (v < 0.01 || v > 1e6)))
        return false;
    *out = v;
    return true;
}

double tdp_cli_interval(double given, bool quiet)
{
    if (given >= 0)
        return given;
    return !quiet && isatty(STDERR_FILENO) ? 1.0 : 0.0;
}

/* ---- rate lines ------------------------------------------------------------ */

void tdp_cli_rate_start(tdp_cli_rate *r, const char *cmd, unsigned fields, bool json,
                        const tdp_cli_sample *zero)
{
    *r = (tdp_cli_rate){.cmd = cmd, .fields = fields, .json = json};
    if (zero != NULL)
        r->last = *zero;
    r->start_ns = r->last_ns = tdp_cli_now_ns();
}

static double per_s(uint64_t now, uint64_t before, double dt)
{
    return dt > 0 && now >= before ? (double)(now - before) / dt : 0;
}

/* The same peer in the last sample (by name: peers come and go), or NULL. */
static const tdp_cli_peer_sample *peer_before(const tdp_cli_sample *last,
                                              const tdp_cli_peer_sample *p)
{
    for (uint32_t i = 0; i < last->npeers; i++)
        if (strcmp(last->peers[i].name, p->name) == 0)
            return &last->peers[i];
    return NULL;
}

static json_t *peers_json(const tdp_cli_sample *last, const tdp_cli_sample *now, double dt)
{
    json_t *a = json_array();
    for (uint32_t i = 0; i < now->npeers; i++) {
        const tdp_cli_peer_sample *p = &now->peers[i], *b = peer_before(last, p);
        json_t *o = json_object();
        json_object_set_new(o, "peer", json_string(p->name));
        json_object_set_new(o, "msgs", json_integer((json_int_t)p->msgs));
        json_object_set_new(o, "bytes", json_integer((json_int_t)p->bytes));
        json_object_set_new(o, "msgs_per_s", json_real(per_s(p->msgs, b ? b->msgs : 0, dt)));
        json_object_set_new(o, "bytes_per_s", json_real(per_s(p->bytes, b ? b->bytes : 0, dt)));
        json_object_set_new(o, "drops", json_integer((json_int_t)p->drops));
        json_array_append_new(a, o);
    }
    return a;
}

static void peers_text(const tdp_cli_sample *last, const tdp_cli_sample *now, double dt, FILE *f)
{
    char rate[TDP_CLI_FMT_LEN];
    for (uint32_t i = 0; i < now->npeers; i++) {
        const tdp_cli_peer_sample *p = &now->peers[i], *b = peer_before(last, p);
        fprintf(f, "%s %s %" PRIu64 " msgs %s", i == 0 ? ";" : ",", p->name, p->msgs,
                tdp_cli_format_rate(per_s(p->bytes, b ? b->bytes : 0, dt), rate, sizeof(rate)));
        if (p->drops > 0)
            fprintf(f, " %" PRIu64 " dropped", p->drops);
    }
}

void tdp_cli_rate_line(tdp_cli_rate *r, const tdp_cli_sample *now, FILE *f)
{
    uint64_t t = tdp_cli_now_ns();
    double dt = (double)(t - r->last_ns) / 1e9, elapsed = (double)(t - r->start_ns) / 1e9;
    double mps = per_s(now->msgs, r->last.msgs, dt), bps = per_s(now->bytes, r->last.bytes, dt);
    double omps = per_s(now->msgs_out, r->last.msgs_out, dt);
    double obps = per_s(now->bytes_out, r->last.bytes_out, dt);
    bool clients = r->fields & TDP_CLI_RATE_CLIENTS, credit = r->fields & TDP_CLI_RATE_CREDIT;

    if (r->json) {
        json_t *o = json_object();
        json_object_set_new(o, "cmd", json_string(r->cmd));
        json_object_set_new(o, "elapsed_s", json_real(elapsed));
        if (clients) {
            json_object_set_new(o, "clients", json_integer((json_int_t)now->clients));
            json_object_set_new(o, "clients_total", json_integer((json_int_t)now->clients_total));
        }
        json_object_set_new(o, "msgs", json_integer((json_int_t)now->msgs));
        json_object_set_new(o, "bytes", json_integer((json_int_t)now->bytes));
        json_object_set_new(o, "msgs_per_s", json_real(mps));
        json_object_set_new(o, "bytes_per_s", json_real(bps));
        if (clients) {
            json_object_set_new(o, "msgs_out", json_integer((json_int_t)now->msgs_out));
            json_object_set_new(o, "bytes_out", json_integer((json_int_t)now->bytes_out));
            json_object_set_new(o, "msgs_out_per_s", json_real(omps));
            json_object_set_new(o, "bytes_out_per_s", json_real(obps));
        }
        if (credit)
            json_object_set_new(o, "credit_waits", json_integer((json_int_t)now->credit_waits));
        if (now->npeers > 0)
            json_object_set_new(o, "peers", peers_json(&r->last, now, dt));
        tdp_cli_json_line(o, f);
    } else {
        char rate[TDP_CLI_FMT_LEN], orate[TDP_CLI_FMT_LEN];
        char who[64] = "", out[128] = "", waits[48] = "";
        if (clients) {
            snprintf(who, sizeof(who), " %" PRIu64 " client%s (%" PRIu64 " total),", now->clients,
                     tdp_cli_s(now->clients), now->clients_total);
            snprintf(out, sizeof(out), "; out %" PRIu64 " message%s, %.0f msgs/s, %s",
                     now->msgs_out, tdp_cli_s(now->msgs_out), omps,
                     tdp_cli_format_rate(obps, orate, sizeof(orate)));
        }
        if (credit)
            snprintf(waits, sizeof(waits), ", %" PRIu64 " credit wait%s", now->credit_waits,
                     tdp_cli_s(now->credit_waits));
        fprintf(f, "%s: %.2f s,%s %s%" PRIu64 " message%s, %.0f msgs/s, %s%s%s", r->cmd, elapsed,
                who, clients ? "in " : "", now->msgs, tdp_cli_s(now->msgs), mps,
                tdp_cli_format_rate(bps, rate, sizeof(rate)), waits, out);
        peers_text(&r->last, now, dt, f);
        fputc('\n', f);
    }
    r->last = *now;
    r->last_ns = t;
}

/* ---- the ticker thread ----------------------------------------------------- */

struct tdp_cli_ticker {
    pthread_t th;
    pthread_mutex_t mtx;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
    bool stop;
    uint64_t interval_ns;
    tdp_cli_sample_fn sample;
    void *arg;
    tdp_cli_rate rate;
};

static void *ticker_main(void *arg)
{
    tdp_cli_ticker *t = arg;
    uint64_t next = t->rate.start_ns + t->interval_ns;
    pthread_mutex_lock(&t->mtx);
    while (!t->stop) {
        struct timespec ts = {(time_t)(next / 1000000000u), (long)(next % 1000000000u)};
        int rc = pthread_cond_timedwait(&t->cond, &t->mtx, &ts);
        if (t->stop)
            break;
        if (rc != ETIMEDOUT)
            continue; /* spurious */
        /* sample without the lock: a stats call may wait for the loop */
        pthread_mutex_unlock(&t->mtx);
        tdp_cli_sample s = {0};
        t->sample(t->arg, &s);
        tdp_cli_rate_line(&t->rate, &s, stderr);
        pthread_mutex_lock(&t->mtx);
        next += t->interval_ns;
        uint64_t now = tdp_cli_now_ns();
        if (next <= now) /* fell behind (a slow sample): no burst of lines */
            next = now + t->interval_ns;
    }
    pthread_mutex_unlock(&t->mtx);
    return NULL;
}

tdp_cli_ticker *tdp_cli_ticker_start(const char *cmd, unsigned fields, bool json, double interval_s,
                                     tdp_cli_sample_fn sample, void *arg)
{
    pthread_condattr_t ca;
    if (interval_s <= 0)
        return NULL;
    tdp_cli_ticker *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->interval_ns = (uint64_t)(interval_s * 1e9);
    t->sample = sample;
    t->arg = arg;
    pthread_mutex_init(&t->mtx, NULL);
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* the clock of tdp_cli_now_ns */
    pthread_cond_init(&t->cond, &ca);
    pthread_condattr_destroy(&ca);
    tdp_cli_rate_start(&t->rate, cmd, fields, json, NULL);
    if (pthread_create(&t->th, NULL, ticker_main, t) != 0) {
        pthread_cond_destroy(&t->cond);
        pthread_mutex_destroy(&t->mtx);
        free(t);
        return NULL; /* no rate lines; the command itself goes on */
    }
    return t;
}

void tdp_cli_ticker_stop(tdp_cli_ticker *t)
{
    if (t == NULL)
        return;
    pthread_mutex_lock(&t->mtx);
    t->stop = true;
    pthread_cond_signal(&t->cond);
    pthread_mutex_unlock(&t->mtx);
    pthread_join(t->th, NULL);
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->mtx);
    free(t);
}

void tdp_cli_sample_send(void *pipe, tdp_cli_sample *out)
{
    tdp_pipe_stats st;
    tdp_pipe_stats_get(pipe, &st);
    *out = (tdp_cli_sample){
        .msgs = st.msgs_sent, .bytes = st.bytes_sent, .credit_waits = st.credit_waits};
}

void tdp_cli_sample_recv(void *pipe, tdp_cli_sample *out)
{
    tdp_pipe_stats st;
    tdp_pipe_stats_get(pipe, &st);
    *out = (tdp_cli_sample){.msgs = st.msgs_recv, .bytes = st.bytes_recv};
}

/* ---- summaries ------------------------------------------------------------- */

const char *tdp_cli_hist_text(const tdp_hist *h, char *buf, size_t len)
{
    tdp_hist_summary s;
    tdp_hist_summarize(h, &s);
    if (s.count == 0)
        snprintf(buf, len, "none");
    else
        snprintf(buf, len, "min %.1f us, p50 %.1f us, p99 %.1f us, p99.9 %.1f us, max %.1f us",
                 (double)s.min / 1e3, (double)s.p50 / 1e3, (double)s.p99 / 1e3,
                 (double)s.p999 / 1e3, (double)s.max / 1e3);
    return buf;
}

/* ns values beyond json_int_t's range (a histogram takes up to UINT64_MAX) */
static json_t *json_u64(uint64_t v)
{
    return json_integer(v > (uint64_t)INT64_MAX ? INT64_MAX : (json_int_t)v);
}

json_t *tdp_cli_hist_json(const tdp_hist *h)
{
    tdp_hist_summary s;
    tdp_hist_summarize(h, &s);
    json_t *o = json_object();
    json_object_set_new(o, "count", json_u64(s.count));
    json_object_set_new(o, "min", json_u64(s.min));
    json_object_set_new(o, "p50", json_u64(s.p50));
    json_object_set_new(o, "p90", json_u64(s.p90));
    json_object_set_new(o, "p99", json_u64(s.p99));
    json_object_set_new(o, "p999", json_u64(s.p999));
    json_object_set_new(o, "max", json_u64(s.max));
    json_object_set_new(o, "mean", json_real(s.mean));
    return o;
}

void tdp_cli_meter_json(json_t *obj, const tdp_cli_meter *m, uint64_t now_ns)
{
    double s = now_ns > m->start_ns ? (double)(now_ns - m->start_ns) / 1e9 : 0;
    json_object_set_new(obj, "msgs", json_u64(m->msgs));
    json_object_set_new(obj, "bytes", json_u64(m->bytes));
    json_object_set_new(obj, "elapsed_s", json_real(s));
    json_object_set_new(obj, "msgs_per_s", json_real(s > 0 ? (double)m->msgs / s : 0));
    json_object_set_new(obj, "bytes_per_s", json_real(s > 0 ? (double)m->bytes / s : 0));
}

bool tdp_cli_json_line(json_t *obj, FILE *f)
{
    /* 9 digits: nanoseconds in seconds, and no 0.90022903300000001 */
    char *text = json_dumps(obj, JSON_COMPACT | JSON_ENSURE_ASCII | JSON_REAL_PRECISION(9));
    json_decref(obj);
    if (text == NULL)
        return false;
    fprintf(f, "%s\n", text);
    free(text);
    return true;
}
