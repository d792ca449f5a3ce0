/*
 * bench_fanout.c: `tdpipe bench --fanout N` — one producer broadcasting to
 * N consumers through a tdp_fanout, with loaned slots (tdp_fanout_loan)
 * and with plain buffers, for each size.
 *
 * The consumers are N pipes of this process on a loop of their own, each
 * drained by a thread that notes when it had each message; the fan-out
 * accepts them on loopback, so the planes are those of two processes on
 * one host. Per size and kind of send, two phases of `rounds` messages:
 *   - hand-off: one message at a time, the next once every consumer has
 *     had the last: the one-way time (send call to a consumer's receive)
 *     to the last consumer, p50, and over all consumers;
 *   - throughput: back to back: messages x size from the first send call
 *     to the last consumer's receipt of the last message (each consumer
 *     gets every byte: the aggregate is N times that).
 * After each, the process's VmRSS and the shared memory it maps, counted
 * once per memfd (a consumer maps the producer's pool too: one pool shows
 * as one memfd whatever N is).
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <tdpipe/tdpipe.h>

#include "cli.h"
#include "report.h"

#define FO_WAIT_MS 60000

typedef struct fo_consumer {
    tdp_pipe *pipe;
    pthread_t thread;
    uint64_t *recv_ns;    /* by global message number */
    _Atomic uint64_t got; /* the last message number it had */
    _Atomic int end;      /* TDP_OK while it receives, else how its receive ended */
    _Atomic bool stop;    /* every message is measured: leave */
    uint64_t cap;
} fo_consumer;

typedef struct fo_result {
    uint64_t size, msgs;
    bool loan;
    double bps; /* per consumer */
    uint64_t p50_last_ns, p50_all_ns, pool_bytes, rss_bytes;
    uint32_t pool_memfds;
} fo_result;

/*
 * Each message carries its global number in its first 8 bytes. The
 * consumer leaves by itself once told to stop (its close, then the
 * fan-out's, is the clean end the measurements do not include).
 */
static void *drain(void *arg)
{
    fo_consumer *c = arg;
    uint64_t idle_since = tdp_cli_now_ns();
    for (;;) {
        tdp_td *td;
        tdp_err rc = tdp_pipe_recv(c->pipe, 50, &td);
        if (rc == TDP_ETIMEDOUT && !atomic_load(&c->stop) &&
            tdp_cli_now_ns() - idle_since < FO_WAIT_MS * 1000000ull)
            continue;
        if (rc != TDP_OK) {
            atomic_store(&c->end,
                         (int)(rc == TDP_ETIMEDOUT && atomic_load(&c->stop) ? TDP_ECLOSED : rc));
            tdp_pipe_close(c->pipe, FO_WAIT_MS);
            return NULL;
        }
        uint64_t now = tdp_cli_now_ns(), g;
        idle_since = now;
        memcpy(&g, tdp_td_data(td), sizeof(g));
        if (g < c->cap)
            c->recv_ns[g] = now;
        tdp_pipe_release(c->pipe, td);
        atomic_store_explicit(&c->got, g, memory_order_release);
    }
}

static uint64_t status_kb(const char *name)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t v = 0;
    size_t n = strlen(name);
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, name, n) == 0)
            v = strtoull(line + n + 1, NULL, 10);
    if (f != NULL)
        fclose(f);
    return v;
}

/* Shared memory mapped from memfds, each memfd (inode) counted once at its largest extent. */
static uint64_t memfd_bytes(uint32_t *memfds)
{
    enum { MAXF = 256 };
    unsigned long ino[MAXF];
    uint64_t top[MAXF], total = 0;
    uint32_t n = 0;
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        unsigned long a, b, off, inode;
        char dev[16];
        if (strstr(line, "/memfd:") == NULL ||
            sscanf(line, "%lx-%lx %*s %lx %15s %lu", &a, &b, &off, dev, &inode) != 5)
            continue;
        uint32_t i = 0;
        while (i < n && ino[i] != inode)
            i++;
        if (i == n && n < MAXF) {
            ino[n] = inode;
            top[n++] = 0;
        }
        if (i < n && off + (b - a) > top[i])
            top[i] = off + (b - a);
    }
    if (f != NULL)
        fclose(f);
    for (uint32_t i = 0; i < n; i++)
        total += top[i];
    *memfds = n;
    return total;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t p50(uint64_t *v, uint64_t n)
{
    qsort(v, n, sizeof(*v), cmp_u64);
    return n ? v[n / 2] : 0;
}

/* A loaned slot (retried while every slot is held) or a buffer of our own, numbered g. */
static tdp_err take_td(tdp_fanout *fo, tdp_schema *s, bool loan, tdp_td *own, tdp_td **out)
{
    tdp_err rc = TDP_OK;
    if (!loan) {
        *out = tdp_td_ref(own);
        return TDP_OK;
    }
    for (uint64_t end = tdp_cli_now_ns() + FO_WAIT_MS * 1000000ull; tdp_cli_now_ns() < end;) {
        if ((rc = tdp_fanout_loan(fo, s, out)) != TDP_EAGAIN)
            return rc;
        usleep(20);
    }
    return TDP_ETIMEDOUT;
}

/* Wait until every consumer has had message g. */
static tdp_err wait_all(fo_consumer *cs, int n, uint64_t g)
{
    uint64_t end = tdp_cli_now_ns() + FO_WAIT_MS * 1000000ull;
    for (int i = 0; i < n; i++)
        while (atomic_load_explicit(&cs[i].got, memory_order_acquire) < g) {
            tdp_err e = (tdp_err)atomic_load(&cs[i].end);
            if (e != TDP_OK || tdp_cli_now_ns() > end)
                return e != TDP_OK ? e : TDP_ETIMEDOUT;
            sched_yield();
        }
    return TDP_OK;
}

/* rounds messages numbered from *g; paced: each after every consumer had the last. */
static tdp_err phase(tdp_fanout *fo, tdp_schema *s, bool loan, tdp_td *own, int rounds, bool paced,
                     uint64_t *g, uint64_t *send_ns, fo_consumer *cs, int n)
{
    for (int k = 0; k < rounds; k++) {
        tdp_td *td;
        tdp_err rc = take_td(fo, s, loan, own, &td);
        if (rc != TDP_OK)
            return rc;
        uint64_t num = ++*g;
        memcpy(tdp_td_data(td), &num, sizeof(num));
        send_ns[num] = tdp_cli_now_ns();
        rc = tdp_fanout_send(fo, td, FO_WAIT_MS);
        tdp_td_unref(td);
        if (rc == TDP_OK && paced)
            rc = wait_all(cs, n, num);
        if (rc != TDP_OK)
            return rc;
    }
    return wait_all(cs, n, *g);
}

static tdp_err measure(tdp_fanout *fo, uint64_t size, bool loan, int rounds, uint64_t *g,
                       uint64_t *send_ns, fo_consumer *cs, int n, fo_result *r)
{
    tdp_schema *s;
    tdp_td *own = NULL;
    tdp_err rc = tdp_cli_synth_schema(size, (tdp_device){.type = TDP_DEVICE_CPU}, &s);
    if (rc != TDP_OK)
        return rc;
    if (!loan && (rc = tdp_td_new(s, &own)) == TDP_OK)
        memset(tdp_td_data(own), 0x5a, tdp_td_nbytes(own)); /* touched once: RSS shows it */
    uint64_t *last = calloc((size_t)rounds, sizeof(*last));
    uint64_t *all = calloc((size_t)rounds * (size_t)n, sizeof(*all));
    if (rc == TDP_OK && (last == NULL || all == NULL))
        rc = TDP_ENOMEM;
    /* hand-off */
    uint64_t first = *g + 1;
    if (rc == TDP_OK)
        rc = phase(fo, s, loan, own, rounds, true, g, send_ns, cs, n);
    for (int k = 0; rc == TDP_OK && k < rounds; k++)
        for (int i = 0; i < n; i++) {
            uint64_t d = cs[i].recv_ns[first + k] - send_ns[first + k];
            all[(size_t)k * n + i] = d;
            last[k] = d > last[k] ? d : last[k];
        }
    /* throughput */
    first = *g + 1;
    if (rc == TDP_OK)
        rc = phase(fo, s, loan, own, rounds, false, g, send_ns, cs, n);
    if (rc == TDP_OK) {
        uint64_t end = 0;
        for (int i = 0; i < n; i++)
            end = cs[i].recv_ns[*g] > end ? cs[i].recv_ns[*g] : end;
        double secs = (double)(end - send_ns[first]) / 1e9;
        *r = (fo_result){.size = tdp_cli_synth_bytes(size),
                         .msgs = (uint64_t)rounds,
                         .loan = loan,
                         .bps = secs > 0 ? (double)rounds * (double)tdp_cli_synth_bytes(size) / secs
                                         : 0,
                         .p50_last_ns = p50(last, (uint64_t)rounds),
                         .p50_all_ns = p50(all, (uint64_t)rounds * (uint64_t)n),
                         .rss_bytes = status_kb("VmRSS:") * 1024};
        r->pool_bytes = memfd_bytes(&r->pool_memfds);
    }
    free(last);
    free(all);
    if (own != NULL)
        tdp_td_unref(own);
    tdp_schema_unref(s);
    return rc;
}

/* The fan-out on its loop, listening; n consumers dialed on theirs and draining. */
static tdp_err set_up(int n, uint32_t depth, tdp_plane plane, uint64_t cap, tdp_loop *pl,
                      tdp_loop *cl, tdp_fanout **fo, fo_consumer *cs)
{
    tdp_listener_opts lo;
    tdp_listener_opts_default(&lo);
    lo.pipe.plane = plane;
    uint16_t port;
    tdp_err rc = tdp_fanout_new(pl, NULL, fo);
    if (rc == TDP_OK)
        rc = tdp_fanout_listen(*fo, "127.0.0.1", 0, &lo, &port);
    tdp_pipe_opts po;
    tdp_pipe_opts_default(&po);
    po.plane = plane;
    po.recv_depth = depth;
    for (int i = 0; rc == TDP_OK && i < n; i++) {
        cs[i].cap = cap;
        cs[i].recv_ns = calloc(cap, sizeof(uint64_t));
        if (cs[i].recv_ns == NULL)
            return TDP_ENOMEM;
        rc = tdp_pipe_connect(cl, "127.0.0.1", port, &po, &cs[i].pipe);
        if (rc == TDP_OK && pthread_create(&cs[i].thread, NULL, drain, &cs[i]) != 0) {
            tdp_pipe_free(cs[i].pipe);
            cs[i].pipe = NULL;
            rc = TDP_ENOMEM;
        }
    }
    tdp_fanout_stats st = {0};
    for (uint64_t end = tdp_cli_now_ns() + FO_WAIT_MS * 1000000ull;
         rc == TDP_OK && tdp_fanout_stats_get(*fo, &st, NULL, 0) < (uint32_t)n;) {
        if (tdp_cli_now_ns() > end)
            rc = TDP_ETIMEDOUT;
        usleep(1000);
    }
    return rc;
}

static void tear_down(tdp_fanout *fo, fo_consumer *cs, int n)
{
    for (int i = 0; i < n; i++)
        atomic_store(&cs[i].stop, true);
    for (int i = 0; i < n; i++) {
        if (cs[i].pipe != NULL) {
            pthread_join(cs[i].thread, NULL); /* each has closed its pipe */
            tdp_pipe_free(cs[i].pipe);
        }
        free(cs[i].recv_ns);
    }
    if (fo != NULL)
        tdp_fanout_close(fo, FO_WAIT_MS); /* the consumers are gone or going */
    tdp_fanout_free(fo);
}

static void print_text(int n, const char *plane, uint32_t depth, const fo_result *r, int nr)
{
    char a[TDP_CLI_FMT_LEN], b[TDP_CLI_FMT_LEN], c[TDP_CLI_FMT_LEN], d[TDP_CLI_FMT_LEN],
        e[TDP_CLI_FMT_LEN];
    printf("fan-out broadcast to %d consumer%s (pipes of this process), plane %s, depth %u\n", n,
           tdp_cli_s((uint64_t)n), plane, depth);
    printf("%-10s %-6s %6s %14s %14s %12s %12s %14s %12s\n", "size", "send", "msgs", "per consumer",
           "aggregate", "p50 last", "p50 all", "pool (memfd)", "RSS");
    for (int i = 0; i < nr; i++)
        printf("%-10s %-6s %6" PRIu64 " %14s %14s %9.1f us %9.1f us %11s/%u %12s\n",
               tdp_cli_format_size(r[i].size, a, sizeof(a)), r[i].loan ? "loan" : "plain",
               r[i].msgs, tdp_cli_format_rate(r[i].bps, b, sizeof(b)),
               tdp_cli_format_rate(r[i].bps * n, c, sizeof(c)), r[i].p50_last_ns / 1e3,
               r[i].p50_all_ns / 1e3, tdp_cli_format_size(r[i].pool_bytes, d, sizeof(d)),
               r[i].pool_memfds, tdp_cli_format_size(r[i].rss_bytes, e, sizeof(e)));
    printf("p50 last: one-way time, send call to the last consumer's receive, one message at a\n"
           "time; per consumer: back to back, every consumer gets every byte (loan rows on the\n"
           "shm plane: a hand-off rate, messages x size per second: the slot is written once\n"
           "and no byte is copied); pool: shared memory mapped, each memfd once (/N: how\n"
           "many); RSS: the whole process, consumers included\n");
}

static bool write_json(const char *path, int n, const char *plane, uint32_t depth,
                       const fo_result *r, int nr)
{
    json_t *o = json_object(), *rs = json_array();
    json_object_set_new(o, "mode", json_string("fanout"));
    json_object_set_new(o, "consumers", json_integer(n));
    json_object_set_new(o, "plane", json_string(plane));
    json_object_set_new(o, "depth", json_integer(depth));
    for (int i = 0; i < nr; i++) {
        json_t *x = json_object();
        json_object_set_new(x, "size", json_integer((json_int_t)r[i].size));
        json_object_set_new(x, "send", json_string(r[i].loan ? "loan" : "plain"));
        json_object_set_new(x, "msgs", json_integer((json_int_t)r[i].msgs));
        json_object_set_new(x, "bytes_per_s_per_consumer", json_real(r[i].bps));
        json_object_set_new(x, "bytes_per_s_aggregate", json_real(r[i].bps * n));
        json_object_set_new(x, "p50_last_ns", json_integer((json_int_t)r[i].p50_last_ns));
        json_object_set_new(x, "p50_all_ns", json_integer((json_int_t)r[i].p50_all_ns));
        json_object_set_new(x, "pool_bytes", json_integer((json_int_t)r[i].pool_bytes));
        json_object_set_new(x, "pool_memfds", json_integer(r[i].pool_memfds));
        json_object_set_new(x, "rss_bytes", json_integer((json_int_t)r[i].rss_bytes));
        json_array_append_new(rs, x);
    }
    json_object_set_new(o, "results", rs);
    FILE *fp = fopen(path, "w");
    if (fp == NULL) {
        json_decref(o);
        return false;
    }
    bool ok = tdp_cli_json_line(o, fp);
    return fclose(fp) == 0 && ok;
}

/* Rounds for a size when --rounds is not given: about 200 MB a phase, 10..200 messages. */
static int rounds_for(uint64_t size, int rounds)
{
    if (rounds > 0)
        return rounds;
    uint64_t r = 200000000u / (size ? size : 1);
    return r < 10 ? 10 : r > 200 ? 200 : (int)r;
}

int tdp_bench_fanout(int n, const uint64_t *sizes, int nsizes, int rounds, uint32_t depth,
                     tdp_plane plane, bool no_loan, const char *json, bool quiet)
{
    uint64_t cap = 1;
    for (int i = 0; i < nsizes; i++)
        cap += 4 * (uint64_t)rounds_for(sizes[i], rounds);
    fo_consumer *cs = calloc((size_t)n, sizeof(*cs));
    uint64_t *send_ns = calloc(cap, sizeof(*send_ns));
    fo_result *res = calloc((size_t)nsizes * 2, sizeof(*res));
    tdp_loop *pl = NULL, *cl = NULL;
    tdp_fanout *fo = NULL;
    tdp_err rc = cs == NULL || send_ns == NULL || res == NULL ? TDP_ENOMEM : TDP_OK;
    if (rc == TDP_OK && (rc = tdp_loop_new(NULL, &pl)) == TDP_OK)
        rc = tdp_loop_start_thread(pl);
    if (rc == TDP_OK && (rc = tdp_loop_new(NULL, &cl)) == TDP_OK)
        rc = tdp_loop_start_thread(cl);
    if (rc == TDP_OK)
        rc = set_up(n, depth, plane, cap, pl, cl, &fo, cs);
    const char *used = "?";
    tdp_fanout_peer_stats ps;
    if (rc == TDP_OK && tdp_fanout_stats_get(fo, NULL, &ps, 1) > 0)
        used = tdp_plane_name(ps.plane);
    uint64_t g = 0;
    int nr = 0;
    for (int i = 0; rc == TDP_OK && i < nsizes; i++)
        for (int loan = no_loan ? 0 : 1; rc == TDP_OK && loan >= 0; loan--) {
            if (!quiet)
                fprintf(stderr, "tdpipe bench: fan-out to %d, %" PRIu64 " B, %s sends\n", n,
                        sizes[i], loan ? "loaned" : "plain");
            rc = measure(fo, sizes[i], loan, rounds_for(sizes[i], rounds), &g, send_ns, cs, n,
                         &res[nr]);
            nr += rc == TDP_OK;
        }
    tear_down(fo, cs, n);
    tdp_loop_free(cl);
    tdp_loop_free(pl);
    int ec = TDP_EXIT_OK;
    if (rc != TDP_OK) {
        tdp_cli_error("bench", "fan-out run failed: %s", tdp_strerror(rc));
        ec = tdp_cli_exit_for(rc);
    } else {
        print_text(n, used, depth, res, nr);
        if (json != NULL && !write_json(json, n, used, depth, res, nr)) {
            tdp_cli_error("bench", "cannot write %s", json);
            ec = TDP_EXIT_FAIL;
        }
    }
    free(cs);
    free(send_ns);
    free(res);
    return ec;
}
