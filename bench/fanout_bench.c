/*
 * fanout_bench.c: one producer broadcasting to N consumer processes on
 * this host through a tdp_fanout (docs/benchmarks.md, "Fan-out").
 *
 *   tdp_fanout_bench [--consumers N] [--size BYTES] [--count K] [--plane NAME]
 *                    [--inflight W] [--loan] [--drive] [--drive-producer]
 *                    [--gap US] [--floor]
 *
 * The consumers are forked before the producer touches UCX, dial the
 * fan-out's listener and receive K messages (4 receive buffers each, as
 * tdpipe bench). Each message carries the
 * monotonic time of its send call (the clock is the same in every process
 * on a host); each consumer sends back, per message, when it had it. The
 * producer sends one message at a time (a blocking send, which returns
 * once every consumer's pipe has taken it: on the shm plane, before any
 * consumer has woken; see --gap); with --inflight W it keeps W
 * asynchronous sends going, each from a buffer of its own (for throughput;
 * the one-way time then includes the queue). With --loan each message is a slot lent by the fan-out
 * (tdp_fanout_loan: on the shm plane, of the pool every consumer maps), so
 * nothing is copied on the way and the one-way time is the hand-off
 * itself; without it each send copies the buffer into the pool once. With
 * --drive the consumers start no loop thread: each blocking receive drives
 * the loop on the receiving thread, one wake-up per message instead of two
 * (the loop thread's, then the receiver's); with --drive-producer the
 * producer's loop thread stops once every consumer is in, and each loan
 * and send runs on the sending thread (no hop onto a loop thread). With --gap US the producer
 * sleeps US microseconds before each send, so that every consumer is done
 * with the last message and asleep when the next comes: each one-way time
 * is then a wake-up from idle, as for a rare broadcast of new weights.
 *
 * --floor measures what waking N sleeping processes costs this machine,
 * with no library in between: each consumer sleeps in epoll_wait on an
 * eventfd of its own (what an event-driven receiver must at least do),
 * the producer writes the time into a shared page and rings the N
 * eventfds one after the other, and waits until every consumer has
 * counted the message before the next (--gap applies as above). That is
 * the floor the fan-out's one-way times are compared to.
 *
 * Printed as one JSON object: the one-way p50 to the last consumer (per
 * message, the latest consumer), the p50 over all consumers, the
 * throughput, and the producer's memory: VmRSS and the bytes of shared
 * memory (memfd) it maps.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <tdpipe/tdpipe.h>

#define MAX_CONSUMERS 16
#define MAX_COUNT     100000
#define MAX_INFLIGHT  64

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static tdp_schema *bytes_schema(int64_t nbytes)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    if (tdp_schema_builder_new(&b) != TDP_OK)
        return NULL;
    if (tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &nbytes) != TDP_OK ||
        tdp_schema_builder_finish(b, &s, NULL, 0) != TDP_OK)
        s = NULL;
    tdp_schema_builder_free(b);
    return s;
}

/* A consumer: receive count messages, write back the one-way time of each. */
static int consumer(int rfd, int wfd, uint64_t count, tdp_plane plane, bool drive)
{
    uint16_t port;
    if (read(rfd, &port, sizeof(port)) != sizeof(port))
        return 2;
    tdp_loop *l;
    tdp_pipe *p;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = plane;
    o.recv_depth = 4; /* as tdpipe bench: the producer may run ahead by 4 */
    /* --drive: no loop thread; each blocking call runs the loop on this one */
    if (tdp_loop_new(NULL, &l) != TDP_OK || (!drive && tdp_loop_start_thread(l) != TDP_OK) ||
        tdp_pipe_connect(l, "127.0.0.1", port, &o, &p) != TDP_OK)
        return 3;
    uint64_t *lat = calloc(count, sizeof(*lat));
    for (uint64_t i = 0; i < count; i++) {
        tdp_td *td;
        if (tdp_pipe_recv(p, 60000, &td) != TDP_OK)
            return 4;
        uint64_t t0;
        memcpy(&t0, tdp_td_data(td), 8);
        lat[i] = now_ns() - t0;
        tdp_pipe_release(p, td);
    }
    tdp_td *td;
    tdp_err rc = tdp_pipe_recv(p, 60000, &td); /* the clean end */
    ssize_t want = (ssize_t)(count * sizeof(*lat));
    int code = write(wfd, lat, (size_t)want) == want && rc == TDP_ECLOSED ? 0 : 5;
    tdp_pipe_free(p);
    tdp_loop_free(l);
    free(lat);
    return code;
}

/* --floor: the page every process shares, and one consumer of it. */
typedef struct {
    _Atomic uint64_t seq;  /* the message now posted, 1, 2, ... */
    _Atomic uint64_t t0;   /* its send time */
    _Atomic uint64_t seen; /* consumers that counted a message, in all */
} floor_page;

static void pause_us(long us)
{
    if (us <= 0)
        return;
    struct timespec g = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    nanosleep(&g, NULL);
}

static int floor_consumer(floor_page *pg, int efd, int wfd, uint64_t count)
{
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN};
    if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, efd, &ev) != 0)
        return 3;
    uint64_t *lat = calloc(count, sizeof(*lat)), end = now_ns() + 60000000000u;
    if (lat == NULL)
        return 3;
    for (uint64_t i = 0; i < count; i++) {
        while (atomic_load(&pg->seq) <= i) {
            if (now_ns() > end)
                return 4;
            struct epoll_event out;
            uint64_t v;
            if (epoll_wait(ep, &out, 1, 100) > 0 && read(efd, &v, sizeof(v)) < 0 && errno != EAGAIN)
                return 4;
        }
        lat[i] = now_ns() - atomic_load(&pg->t0);
        atomic_fetch_add(&pg->seen, 1);
    }
    ssize_t want = (ssize_t)(count * sizeof(*lat));
    int code = write(wfd, lat, (size_t)want) == want ? 0 : 5;
    free(lat);
    return code;
}

/*
 * --floor's producer: post, ring every consumer, sleep; before the next,
 * make sure that every consumer counted the last (it sleeps meanwhile,
 * so that it takes no CPU from them).
 */
static int floor_produce(floor_page *pg, const int *efd, int nc, uint64_t count, long gap_us,
                         double *secs)
{
    uint64_t t0 = now_ns(), end = t0 + 60000000000u;
    for (uint64_t i = 0; i < count; i++) {
        pause_us(gap_us);
        while (atomic_load(&pg->seen) < i * (uint64_t)nc) {
            if (now_ns() > end)
                return 1;
            pause_us(50);
        }
        atomic_store(&pg->t0, now_ns());
        atomic_store(&pg->seq, i + 1);
        for (int c = 0; c < nc; c++) {
            uint64_t one = 1;
            if (write(efd[c], &one, sizeof(one)) != sizeof(one))
                return 1;
        }
    }
    while (atomic_load(&pg->seen) < count * (uint64_t)nc && now_ns() < end)
        pause_us(50);
    *secs = (double)(now_ns() - t0) / 1e9;
    return 0;
}

/* kB of a "Name:   N kB" line of /proc/self/status. */
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

/* Bytes of shared memory this process maps from memfds (the shm plane's pools). */
static uint64_t memfd_bytes(uint32_t *mappings)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    uint64_t total = 0;
    *mappings = 0;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        unsigned long a, b;
        if (strstr(line, "/memfd:") == NULL || sscanf(line, "%lx-%lx", &a, &b) != 2)
            continue;
        total += b - a;
        (*mappings)++;
    }
    if (f != NULL)
        fclose(f);
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

/* A slot lent by the fan-out; while every slot is held, look again shortly. */
static tdp_err loan_td(tdp_fanout *fo, tdp_schema *s, tdp_td **out)
{
    uint64_t end = now_ns() + 60000000000u;
    tdp_err rc;
    while ((rc = tdp_fanout_loan(fo, s, out)) == TDP_EAGAIN && now_ns() < end)
        usleep(10);
    return rc;
}

typedef struct {
    int nc;
    uint64_t size, count;
    tdp_plane plane;
    bool loan, drive, floor;
    long gap_us;
} run_cfg;

/* Read each consumer's one-way times, reap it and print the JSON line. */
static int report(const run_cfg *c, const int *from, const pid_t *pid, double secs, uint64_t rss,
                  uint64_t shm, uint32_t maps)
{
    int nc = c->nc;
    uint64_t count = c->count;
    uint64_t *lat = calloc((size_t)nc * count, sizeof(*lat)), *last = calloc(count, sizeof(*last));
    if (lat == NULL || last == NULL)
        return 1;
    int bad = 0;
    for (int i = 0; i < nc; i++) {
        size_t want = count * sizeof(*lat), got = 0;
        while (got < want) {
            ssize_t r = read(from[i], (char *)(lat + (size_t)i * count) + got, want - got);
            if (r <= 0)
                break;
            got += (size_t)r;
        }
        int wst;
        waitpid(pid[i], &wst, 0);
        bad += got != want || !WIFEXITED(wst) || WEXITSTATUS(wst) != 0;
    }
    for (uint64_t k = 0; k < count; k++)
        for (int i = 0; i < nc; i++)
            if (lat[(size_t)i * count + k] > last[k])
                last[k] = lat[(size_t)i * count + k];
    printf("{\"consumers\":%d,\"plane\":\"%s\",\"size\":%" PRIu64 ",\"count\":%" PRIu64
           ",\"p50_last_ns\":%" PRIu64 ",\"p50_all_ns\":%" PRIu64
           ",\"msgs_per_s\":%.1f,\"bytes_per_s\":%.0f,\"producer_rss_bytes\":%" PRIu64
           ",\"producer_shm_bytes\":%" PRIu64
           ",\"producer_shm_mappings\":%u,\"failed_consumers\":%d"
           ",\"loan\":%s,\"drive\":%s,\"floor\":%s,\"gap_us\":%ld}\n",
           nc, c->floor ? "none" : tdp_plane_name(c->plane), c->size, count, p50(last, count),
           p50(lat, (uint64_t)nc * count), (double)count / secs, (double)(count * c->size) / secs,
           rss, shm, maps, bad, c->loan ? "true" : "false", c->drive ? "true" : "false",
           c->floor ? "true" : "false", c->gap_us);
    free(lat);
    free(last);
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    int nc = 4, inflight = 1;
    long gap_us = 0;
    bool loan = false, drive = false, floor = false, pdrive = false;
    uint64_t size = 100000000, count = 20;
    tdp_plane plane = TDP_PLANE_SHM;
    for (int i = 1; i < argc; i += 2) {
        if (strcmp(argv[i], "--loan") == 0) {
            loan = true;
            i--; /* no value */
            continue;
        }
        if (strcmp(argv[i], "--drive") == 0) {
            drive = true;
            i--;
            continue;
        }
        if (strcmp(argv[i], "--drive-producer") == 0) {
            pdrive = true;
            i--;
            continue;
        }
        if (strcmp(argv[i], "--floor") == 0) {
            floor = true;
            i--;
            continue;
        }
        if (i + 1 >= argc)
            return 2;
        if (strcmp(argv[i], "--consumers") == 0)
            nc = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--size") == 0)
            size = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--count") == 0)
            count = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--inflight") == 0)
            inflight = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--gap") == 0)
            gap_us = atol(argv[i + 1]);
        else if (strcmp(argv[i], "--plane") == 0 && tdp_plane_parse(argv[i + 1], &plane) == TDP_OK)
            ;
        else {
            fprintf(stderr,
                    "usage: %s [--consumers N] [--size BYTES] [--count K] [--plane NAME]"
                    " [--inflight W] [--loan] [--drive] [--drive-producer] [--gap US] [--floor]\n",
                    argv[0]);
            return 2;
        }
    }
    if (nc < 1 || nc > MAX_CONSUMERS || size < 8 || count < 1 || count > MAX_COUNT ||
        inflight < 1 || inflight > MAX_INFLIGHT || gap_us < 0 || gap_us > 10000000 ||
        (floor && (loan || inflight > 1)))
        return 2;
    run_cfg cfg = {.nc = nc,
                   .size = floor ? 0 : size,
                   .count = count,
                   .plane = plane,
                   .loan = loan,
                   .drive = drive,
                   .floor = floor,
                   .gap_us = gap_us};
    floor_page *pg = NULL;
    int efd[MAX_CONSUMERS];
    if (floor) {
        pg = mmap(NULL, sizeof(*pg), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (pg == MAP_FAILED)
            return 1;
        for (int i = 0; i < nc; i++)
            if ((efd[i] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0)
                return 1;
    }

    pid_t pid[MAX_CONSUMERS];
    int to[MAX_CONSUMERS], from[MAX_CONSUMERS];
    for (int i = 0; i < nc; i++) {
        int a[2], b[2];
        if (pipe(a) != 0 || pipe(b) != 0)
            return 1;
        pid[i] = fork();
        if (pid[i] == 0) {
            close(a[1]);
            close(b[0]);
            _exit(floor ? floor_consumer(pg, efd[i], b[1], count)
                        : consumer(a[0], b[1], count, plane, drive));
        }
        close(a[0]);
        close(b[1]);
        to[i] = a[1];
        from[i] = b[0];
    }
    if (floor) {
        double secs = 0;
        usleep(100000); /* every consumer asleep in epoll_wait */
        if (floor_produce(pg, efd, nc, count, gap_us, &secs) != 0)
            return 1;
        return report(&cfg, from, pid, secs, status_kb("VmRSS:") * 1024, 0, 0);
    }

    tdp_loop *loop;
    tdp_fanout *fo;
    tdp_listener_opts lo;
    uint16_t port;
    tdp_listener_opts_default(&lo);
    lo.pipe.plane = plane;
    if (tdp_loop_new(NULL, &loop) != TDP_OK || tdp_loop_start_thread(loop) != TDP_OK ||
        tdp_fanout_new(loop, NULL, &fo) != TDP_OK ||
        tdp_fanout_listen(fo, "127.0.0.1", 0, &lo, &port) != TDP_OK)
        return 1;
    for (int i = 0; i < nc; i++)
        if (write(to[i], &port, sizeof(port)) != sizeof(port))
            return 1;
    tdp_fanout_stats st;
    uint64_t end = now_ns() + 30000000000u;
    while (tdp_fanout_stats_get(fo, &st, NULL, 0) < (uint32_t)nc && now_ns() < end)
        usleep(1000);
    if (st.consumers != (uint32_t)nc)
        return 1;
    if (pdrive) {
        /* every consumer is in: from here each call drives the loop itself */
        tdp_loop_stop(loop);
        usleep(50000); /* the loop thread has let go (a call would take over anyway) */
    }

    tdp_schema *s = bytes_schema((int64_t)size);
    tdp_td *tds[MAX_INFLIGHT] = {NULL};
    tdp_op *ops[MAX_INFLIGHT];
    if (s == NULL)
        return 1;
    for (int k = 0; k < inflight; k++) {
        if (tdp_op_new(NULL, NULL, &ops[k]) != TDP_OK)
            return 1;
        if (loan) /* the slots are the fan-out's */
            continue;
        if (tdp_td_new(s, &tds[k]) != TDP_OK)
            return 1;
        memset(tdp_td_data(tds[k]), 0x5a, size); /* touched once: RSS shows it */
    }
    uint64_t t0 = now_ns();
    for (uint64_t i = 0; i < count; i++) {
        int k = (int)(i % (uint64_t)inflight);
        uint64_t t;
        if (inflight > 1) {
            while (tdp_op_result(ops[k]) == TDP_EAGAIN)
                ; /* the send W messages ago: done soon, with the pace of the consumers */
            if (tdp_op_result(ops[k]) != TDP_OK)
                return 1;
        }
        pause_us(gap_us);
        tdp_td *td = tds[k];
        if (loan && loan_td(fo, s, &td) != TDP_OK)
            return 1;
        t = now_ns();
        memcpy(tdp_td_data(td), &t, 8);
        if (inflight == 1) {
            tdp_err rc = tdp_fanout_send(fo, td, 60000);
            if (loan)
                tdp_td_unref(td);
            if (rc != TDP_OK)
                return 1;
            continue;
        }
        tdp_fanout_send_async(fo, td, ops[k]);
        if (loan)
            tdp_td_unref(td); /* the fan-out holds its own reference until sent */
    }
    for (int k = 0; k < inflight; k++)
        while (tdp_op_result(ops[k]) == TDP_EAGAIN)
            ;
    double secs = (double)(now_ns() - t0) / 1e9;
    uint32_t maps;
    uint64_t shm = memfd_bytes(&maps), rss_kb = status_kb("VmRSS:");
    if (tdp_fanout_close(fo, 60000) != TDP_OK)
        return 1;

    int bad = report(&cfg, from, pid, secs, rss_kb * 1024, shm, maps);
    tdp_fanout_free(fo);
    tdp_loop_free(loop);
    for (int k = 0; k < inflight; k++) {
        tdp_op_free(ops[k]);
        tdp_td_unref(tds[k]);
    }
    tdp_schema_unref(s);
    return bad;
}
