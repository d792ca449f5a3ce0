/*
 * test_fanin: many producers, one consumer (tdp_fanin). Run once per data
 * plane (TDP_TEST_PLANE, UCX_TLS: tests/CMakeLists.txt): per-producer
 * order by sequence number, fairness against a flooding producer, a
 * producer killed or closing mid-stream while the others go on, schema
 * changes per producer, blocking / timed / async receive, limits and the
 * shared secret.
 *
 * Producers are pipes on a loop of their own, each sending from a thread;
 * the killed one is this program run again as a child process
 * (`test_fanin --producer PORT COUNT TAG KILL_AFTER`), so that its death is
 * a real one.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/tdpipe.h>
#include "test_util.h"

extern char **environ;

#define TMO    20000
#define MAXP   8
#define SECRET "fan-in test secret, 32 bytes...."

static tdp_plane test_plane(void)
{
    const char *n = getenv("TDP_TEST_PLANE");
    tdp_plane pl = TDP_PLANE_AUTO;
    if (n != NULL && tdp_plane_parse(n, &pl) != TDP_OK)
        pl = TDP_PLANE_AUTO;
    return pl;
}

static void pipe_opts(tdp_pipe_opts *o)
{
    tdp_pipe_opts_default(o);
    o->plane = test_plane();
}

static tdp_schema *bytes_schema(int64_t n, const char *note)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    if (tdp_schema_builder_new(&b) != TDP_OK)
        return NULL;
    if (tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &n) != TDP_OK ||
        tdp_schema_builder_string(b, "note", note) != TDP_OK ||
        tdp_schema_builder_finish(b, &s, NULL, 0) != TDP_OK)
        s = NULL;
    tdp_schema_builder_free(b);
    return s;
}

/* The producer's tag and the message's number in the first 16 bytes. */
static void stamp(tdp_td *td, uint64_t tag, uint64_t seq)
{
    uint64_t *w = tdp_td_data(td);
    w[0] = tag;
    w[1] = seq;
}

static uint64_t word(const tdp_td *td, int i)
{
    uint64_t v;
    memcpy(&v, (const uint8_t *)tdp_td_data(td) + 8 * i, sizeof(v));
    return v;
}

/*
 * Is p inside a mapping of a shared-memory pool (a memfd named tdpipe-shm)?
 * On the shm plane a received message is read in place from the
 * producer's pool; on the ucx plane it is in the pipe's own buffer.
 */
static bool in_shm_pool(const void *p)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    bool in = false;
    uintptr_t a = (uintptr_t)p;
    while (f != NULL && !in && fgets(line, sizeof(line), f) != NULL) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && a >= lo && a < hi)
            in = strstr(line, "memfd:tdpipe-shm") != NULL;
    }
    if (f != NULL)
        fclose(f);
    return in;
}

/* ---- a producer in this process: a pipe on the producers' loop, a thread ---- */

typedef struct producer {
    pthread_t th;
    tdp_loop *loop;
    uint16_t port;
    uint64_t tag;
    int count;     /* messages */
    int switch_at; /* from this message on (1-based), schema b; 0: never */
    int64_t bytes;
    bool abort; /* end with tdp_pipe_abort instead of a clean close */
    const char *secret;
    tdp_err rc;
    int sent;
} producer;

static void *producer_main(void *arg)
{
    producer *p = arg;
    tdp_pipe_opts o;
    pipe_opts(&o);
    if (p->secret != NULL) {
        o.secret = p->secret;
        o.secret_len = strlen(p->secret);
    }
    tdp_pipe *pipe;
    p->rc = tdp_pipe_connect(p->loop, "127.0.0.1", p->port, &o, &pipe);
    if (p->rc != TDP_OK)
        return NULL;
    tdp_schema *sa = bytes_schema(p->bytes, "a"), *sb = bytes_schema(p->bytes + 8, "b");
    tdp_td *a = NULL, *b = NULL;
    if (sa == NULL || sb == NULL || tdp_td_new(sa, &a) != TDP_OK || tdp_td_new(sb, &b) != TDP_OK) {
        p->rc = TDP_ENOMEM;
        goto out;
    }
    for (int i = 1; i <= p->count; i++) {
        tdp_td *td = p->switch_at > 0 && i >= p->switch_at ? b : a;
        stamp(td, p->tag, (uint64_t)i);
        p->rc = tdp_pipe_send(pipe, td, TMO);
        if (p->rc != TDP_OK)
            goto out;
        p->sent++;
    }
    if (p->abort)
        tdp_pipe_abort(pipe, TDP_EPROTO);
    else
        p->rc = tdp_pipe_close(pipe, TMO);
out:
    tdp_pipe_free(pipe);
    tdp_td_unref(a);
    tdp_td_unref(b);
    tdp_schema_unref(sa);
    tdp_schema_unref(sb);
    return NULL;
}

static void producer_start(producer *p)
{
    assert_int_equal(pthread_create(&p->th, NULL, producer_main, p), 0);
}

/* ---- the consumer's side ------------------------------------------------------ */

typedef struct env {
    tdp_loop *fl, *pl; /* the fan-in's loop, the producers' */
    tdp_fanin *f;
} env;

static void env_up(env *e, const tdp_fanin_opts *fo)
{
    tdp_fanin_opts o;
    if (fo != NULL)
        o = *fo;
    else
        tdp_fanin_opts_default(&o);
    o.listener.pipe.plane = test_plane();
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->fl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->pl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->fl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->pl), TDP_OK);
    assert_int_equal(tdp_fanin_new(e->fl, "127.0.0.1", 0, &o, &e->f), TDP_OK);
    assert_true(tdp_fanin_port(e->f) > 0);
}

static void env_down(env *e)
{
    tdp_fanin_free(e->f);
    tdp_loop_free(e->pl);
    tdp_loop_free(e->fl);
}

/* What the consumer saw of one producer. */
typedef struct seen {
    uint64_t tag;  /* from its messages (UINT64_MAX: none yet) */
    uint64_t next; /* the sequence number expected next */
    uint64_t msgs;
    int joins, leaves;
    tdp_err status; /* its LEAVE's */
    uint64_t new_schema_at[4];
    int nnew;
} seen;

typedef struct tally {
    seen s[MAXP + 1]; /* by producer id */
    int left;         /* LEAVE events */
    uint64_t msgs;
} tally;

/*
 * One item, checked: a message's producer and sequence number match what
 * it carries, and come in order, after its JOIN and before its LEAVE.
 */
static void take(tally *t, const tdp_fanin_msg *m)
{
    assert_true(m->producer >= 1 && m->producer <= MAXP);
    seen *s = &t->s[m->producer];
    assert_non_null(strstr(m->peer, "127.0.0.1:"));
    switch (m->kind) {
    case TDP_FANIN_JOIN:
        assert_int_equal(s->joins, 0);
        s->joins++;
        s->tag = UINT64_MAX;
        s->next = 1;
        break;
    case TDP_FANIN_MSG:
        assert_int_equal(s->joins, 1);
        assert_int_equal(s->leaves, 0);
        assert_non_null(m->td);
        assert_int_equal(m->seq, s->next);
        assert_int_equal(word(m->td, 1), m->seq);
        if (s->tag == UINT64_MAX)
            s->tag = word(m->td, 0);
        assert_int_equal(word(m->td, 0), s->tag);
        if (m->new_schema && s->nnew < 4)
            s->new_schema_at[s->nnew++] = m->seq;
        if (m->seq <= 3) /* zero copy on the shm plane (one host's default): the pool's pages */
            assert_true(in_shm_pool(tdp_td_data(m->td)) ==
                        (test_plane() == TDP_PLANE_SHM || test_plane() == TDP_PLANE_AUTO));
        s->next++;
        s->msgs++;
        t->msgs++;
        break;
    case TDP_FANIN_LEAVE:
        assert_int_equal(s->joins, 1);
        assert_int_equal(s->leaves, 0);
        s->leaves++;
        s->status = m->status;
        t->left++;
        break;
    default:
        fail_msg("unknown kind %d", (int)m->kind);
    }
}

/* Receive until `leaves` producers have left (bounded by TMO per item). */
static void drain(env *e, tally *t, int leaves)
{
    tdp_fanin_msg m;
    for (int n = 0; t->left < leaves && n < 1000000; n++) {
        assert_int_equal(tdp_fanin_recv(e->f, TMO, &m), TDP_OK);
        take(t, &m);
        tdp_fanin_release(e->f, &m);
    }
    assert_int_equal(t->left, leaves);
}

/*
 * The producers that left with an error (not a clean end), at most max of
 * them into out; how many there were. Found by their LEAVE, not their tag:
 * an end may overtake every message a producer sent (the BYE or the reset
 * comes by the control socket, the data by the plane).
 */
static int failed_producers(tally *t, seen **out, int max)
{
    int n = 0;
    for (int i = 1; i <= MAXP; i++) {
        seen *s = &t->s[i];
        if (s->joins == 0 || s->leaves == 0 || s->status == TDP_OK || s->status == TDP_ECLOSED)
            continue;
        if (n < max)
            out[n] = s;
        n++;
        print_message("failed producer, tag %" PRId64 ": %" PRIu64 " messages, then %s\n",
                      s->tag == UINT64_MAX ? (int64_t)-1 : (int64_t)s->tag, s->msgs,
                      tdp_strerror(s->status));
    }
    return n;
}

static seen *by_tag(tally *t, uint64_t tag)
{
    for (int i = 1; i <= MAXP; i++)
        if (t->s[i].joins > 0 && t->s[i].tag == tag)
            return &t->s[i];
    for (int i = 1; i <= MAXP; i++) /* what was seen instead, for the failure's reader */
        if (t->s[i].joins > 0)
            print_message("producer %d: tag %" PRId64 ", %" PRIu64 " messages, %d leave(s), %s\n",
                          i, t->s[i].tag == UINT64_MAX ? (int64_t)-1 : (int64_t)t->s[i].tag,
                          t->s[i].msgs, t->s[i].leaves, tdp_strerror(t->s[i].status));
    fail_msg("no producer with tag %" PRIu64, tag);
    return NULL;
}

/* ---- tests ---------------------------------------------------------------------- */

/* Four producers, 300 messages each: all of them, each stream in order; then the end. */
static void test_order(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    producer p[4];
    for (int i = 0; i < 4; i++) {
        p[i] = (producer){.loop = e.pl,
                          .port = tdp_fanin_port(e.f),
                          .tag = 100 + (uint64_t)i,
                          .count = 300,
                          .bytes = 4096};
        producer_start(&p[i]);
    }
    static tally t;
    memset(&t, 0, sizeof(t));
    drain(&e, &t, 4);
    for (int i = 0; i < 4; i++) {
        pthread_join(p[i].th, NULL);
        assert_int_equal(p[i].rc, TDP_OK);
        seen *s = by_tag(&t, 100 + (uint64_t)i);
        assert_int_equal(s->msgs, 300);
        assert_int_equal(s->status, TDP_ECLOSED);
        assert_int_equal(s->nnew, 1); /* one schema: new at its first message only */
        assert_int_equal(s->new_schema_at[0], 1);
    }
    tdp_fanin_stats st;
    tdp_fanin_stats_get(e.f, &st);
    assert_int_equal(st.producers_total, 4);
    assert_int_equal(st.producers_now, 0);
    assert_int_equal(st.producers_failed, 0);
    assert_int_equal(st.msgs, 1200);
    assert_true(st.bytes >= 1200 * 4096);
    /* nothing more: a timed receive times out; after close, the stream ends */
    tdp_fanin_msg m;
    assert_int_equal(tdp_fanin_recv(e.f, 50, &m), TDP_ETIMEDOUT);
    tdp_fanin_close(e.f);
    assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_ECLOSED);
    assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_ECLOSED);
    env_down(&e);
}

/*
 * One producer floods, two send a few: while the consumer is the
 * bottleneck, each of the few is served in turn with the flood (round
 * robin), so the flood cannot have delivered much more than they did by
 * the time their last message is out.
 */
static void test_fairness(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    enum { FLOOD = 3000, FEW = 60 };
    producer p[3];
    p[0] = (producer){
        .loop = e.pl, .port = tdp_fanin_port(e.f), .tag = 1, .count = FLOOD, .bytes = 256};
    producer_start(&p[0]);
    /* the flood has filled its credit before the others join */
    tdp_fanin_msg m;
    static tally t;
    memset(&t, 0, sizeof(t));
    for (int n = 0; n < 20; n++) {
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
        take(&t, &m);
        tdp_fanin_release(e.f, &m);
    }
    for (int i = 1; i < 3; i++) {
        p[i] = (producer){.loop = e.pl,
                          .port = tdp_fanin_port(e.f),
                          .tag = 1 + (uint64_t)i,
                          .count = FEW,
                          .bytes = 256};
        producer_start(&p[i]);
    }
    /* a slow consumer: 300 us per message */
    uint64_t flood_when_done[3] = {0, 0, 0};
    int done = 0;
    for (int n = 0; n < 2 * FLOOD && t.left < 3; n++) {
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
        take(&t, &m);
        tdp_fanin_release(e.f, &m);
        if (m.kind == TDP_FANIN_LEAVE && m.producer != 1 && done < 2) {
            seen *fl = NULL;
            for (int i = 1; i <= MAXP; i++)
                if (t.s[i].joins > 0 && t.s[i].tag == 1)
                    fl = &t.s[i];
            assert_non_null(fl);
            flood_when_done[++done] = fl->msgs;
        }
        nanosleep(&(struct timespec){0, 300000}, NULL);
    }
    assert_int_equal(t.left, 3);
    for (int i = 0; i < 3; i++) {
        pthread_join(p[i].th, NULL);
        assert_int_equal(p[i].rc, TDP_OK);
    }
    /*
     * From the moment the two joined, the flood delivered at most about one
     * message per message of each (round robin over three), plus the 20
     * before, plus what their handshakes let through.
     */
    print_message("flood messages delivered when the two others had finished: %" PRIu64 ", %" PRIu64
                  " (of %d; they sent %d each)\n",
                  flood_when_done[1], flood_when_done[2], FLOOD, FEW);
    assert_true(flood_when_done[2] > 0);
    assert_true(flood_when_done[2] <= 20 + 2 * FEW + 60);
    assert_int_equal(by_tag(&t, 1)->msgs, FLOOD);
    assert_int_equal(by_tag(&t, 2)->msgs, FEW);
    assert_int_equal(by_tag(&t, 3)->msgs, FEW);
    env_down(&e);
}

/* Schema changes are per producer: one changes at its 11th message, the other never. */
static void test_schema_per_producer(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    producer p[2] = {
        {.loop = e.pl,
         .port = tdp_fanin_port(e.f),
         .tag = 7,
         .count = 20,
         .switch_at = 11,
         .bytes = 1000},
        {.loop = e.pl, .port = tdp_fanin_port(e.f), .tag = 8, .count = 20, .bytes = 3000},
    };
    producer_start(&p[0]);
    producer_start(&p[1]);
    static tally t;
    memset(&t, 0, sizeof(t));
    tdp_fanin_msg m;
    for (int n = 0; n < 1000 && t.left < 2; n++) {
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
        take(&t, &m);
        if (m.kind == TDP_FANIN_MSG) {
            uint64_t tag = word(m.td, 0);
            int64_t want = tag == 8 ? 3000 : m.seq >= 11 ? 1008 : 1000;
            tdp_leaf l;
            assert_int_equal(tdp_schema_find(tdp_td_schema(m.td), "x", &l), TDP_OK);
            assert_int_equal(l.nbytes, want);
        }
        tdp_fanin_release(e.f, &m);
    }
    for (int i = 0; i < 2; i++) {
        pthread_join(p[i].th, NULL);
        assert_int_equal(p[i].rc, TDP_OK);
    }
    seen *a = by_tag(&t, 7), *b = by_tag(&t, 8);
    assert_int_equal(a->nnew, 2);
    assert_int_equal(a->new_schema_at[0], 1);
    assert_int_equal(a->new_schema_at[1], 11);
    assert_int_equal(b->nnew, 1);
    assert_int_equal(b->new_schema_at[0], 1);
    env_down(&e);
}

/* ---- a producer in a process of its own, killed mid-stream ------------------- */

static int child_producer(int argc, char **argv)
{
    if (argc < 6)
        return 2;
    uint16_t port = (uint16_t)atoi(argv[2]);
    int count = atoi(argv[3]);
    uint64_t tag = strtoull(argv[4], NULL, 10);
    int kill_after = atoi(argv[5]);
    tdp_loop *loop;
    tdp_pipe *pipe;
    tdp_pipe_opts o;
    pipe_opts(&o);
    if (tdp_loop_new(NULL, &loop) != TDP_OK || tdp_loop_start_thread(loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, &o, &pipe) != TDP_OK)
        return 3;
    tdp_schema *s = bytes_schema(4096, "child");
    tdp_td *td;
    if (s == NULL || tdp_td_new(s, &td) != TDP_OK)
        return 4;
    for (int i = 1; i <= count; i++) {
        stamp(td, tag, (uint64_t)i);
        if (tdp_pipe_send(pipe, td, TMO) != TDP_OK)
            return 5;
        if (i == kill_after)
            kill(getpid(), SIGKILL); /* no BYE, no close: a crash */
    }
    int rc = tdp_pipe_close(pipe, TMO) == TDP_OK ? 0 : 6;
    tdp_pipe_free(pipe);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_loop_free(loop);
    return rc;
}

static pid_t spawn_producer(uint16_t port, int count, uint64_t tag, int kill_after)
{
    char a[4][32];
    snprintf(a[0], sizeof(a[0]), "%u", port);
    snprintf(a[1], sizeof(a[1]), "%d", count);
    snprintf(a[2], sizeof(a[2]), "%" PRIu64, tag);
    snprintf(a[3], sizeof(a[3]), "%d", kill_after);
    char *argv[] = {"test_fanin", "--producer", a[0], a[1], a[2], a[3], NULL};
    pid_t pid;
    assert_int_equal(posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ), 0);
    return pid;
}

/*
 * Three producers in processes of their own; one is killed after 150 of
 * its 400 messages, one of the threads ends with an abort after 100:
 * their LEAVEs carry an error, every other message arrives in order, and
 * the stream goes on.
 */
static void test_killed_producer(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    uint16_t port = tdp_fanin_port(e.f);
    pid_t pid[3] = {
        spawn_producer(port, 400, 11, 150),
        spawn_producer(port, 400, 12, 0),
        spawn_producer(port, 400, 13, 0),
    };
    producer ab = {
        .loop = e.pl, .port = port, .tag = 14, .count = 100, .bytes = 4096, .abort = true};
    producer_start(&ab);
    static tally t;
    memset(&t, 0, sizeof(t));
    drain(&e, &t, 4);
    int st[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(waitpid(pid[i], &st[i], 0), pid[i]);
    pthread_join(ab.th, NULL);
    assert_int_equal(ab.rc, TDP_OK);
    assert_true(WIFSIGNALED(st[0]) && WTERMSIG(st[0]) == SIGKILL);
    assert_true(WIFEXITED(st[1]) && WEXITSTATUS(st[1]) == 0);
    assert_true(WIFEXITED(st[2]) && WEXITSTATUS(st[2]) == 0);
    /*
     * The killed and the aborted producer (tags 11 and 14) each left with an
     * error (an abort is a failure for the peer, whatever the reason given).
     * Each is known by its tag if any of its messages came before its end
     * did, which nothing guarantees: the end may overtake them all.
     */
    seen *f[2];
    assert_int_equal(failed_producers(&t, f, 2), 2);
    for (int i = 0; i < 2; i++) {
        seen *s = f[i];
        assert_true(s->tag == 11 || s->tag == 14 || (s->tag == UINT64_MAX && s->msgs == 0));
        assert_true(s->msgs <= (s->tag == 11 ? 150u : 100u));
    }
    assert_int_equal(by_tag(&t, 12)->msgs, 400);
    assert_int_equal(by_tag(&t, 12)->status, TDP_ECLOSED);
    assert_int_equal(by_tag(&t, 13)->msgs, 400);
    assert_int_equal(by_tag(&t, 13)->status, TDP_ECLOSED);
    tdp_fanin_stats fs;
    tdp_fanin_stats_get(e.f, &fs);
    assert_int_equal(fs.producers_failed, 2);
    /* a producer may join after others left */
    producer late = {.loop = e.pl, .port = port, .tag = 15, .count = 10, .bytes = 64};
    producer_start(&late);
    drain(&e, &t, 5);
    pthread_join(late.th, NULL);
    assert_int_equal(by_tag(&t, 15)->msgs, 10);
    env_down(&e);
}

/*
 * max_memory: a producer whose receive storage would take the fan-in over
 * it leaves with TDP_ELIMIT (its peer hears it); a smaller one goes on.
 */
static void test_memory_cap(void **state)
{
    (void)state;
    env e;
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    o.max_memory = 200 * 1000;             /* depth 4: 4 x 64 KB is over, 4 x 4 KB is not */
    o.listener.pipe.recv_window_bytes = 0; /* the cap counted by depth (test_window: the window) */
    env_up(&e, &o);
    producer big = {
        .loop = e.pl, .port = tdp_fanin_port(e.f), .tag = 50, .count = 10, .bytes = 64000};
    producer small = {
        .loop = e.pl, .port = tdp_fanin_port(e.f), .tag = 51, .count = 10, .bytes = 4000};
    producer_start(&big);
    static tally t;
    memset(&t, 0, sizeof(t));
    drain(&e, &t, 1);
    pthread_join(big.th, NULL);
    assert_true(big.rc != TDP_OK);
    seen *b = NULL;
    for (int i = 1; i <= MAXP; i++)
        if (t.s[i].leaves == 1)
            b = &t.s[i];
    assert_non_null(b);
    assert_int_equal(b->msgs, 0);
    assert_int_equal(b->status, TDP_ELIMIT);
    producer_start(&small);
    drain(&e, &t, 2);
    pthread_join(small.th, NULL);
    assert_int_equal(small.rc, TDP_OK);
    assert_int_equal(by_tag(&t, 51)->msgs, 10);
    env_down(&e);
}

/*
 * Producer after producer refused (a layout over the memory cap). The
 * refusal comes while the consumer's plane is still inside the transport's
 * handler of the SCHEMA frame: a UCX endpoint closed there made UCX 1.13's
 * TCP transport release the receive buffer it was parsing twice, a crash
 * in its progress (10 of 300 runs of test_memory_cap under a debugger,
 * one refusal each). Then a producer within the cap is served in full.
 */
static void test_refused_many(void **state)
{
    (void)state;
    enum { ROUNDS = 60 };
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    o.max_memory = 200 * 1000;
    o.listener.pipe.recv_window_bytes = 0;
    for (int r = 0; r < ROUNDS; r++) {
        env e; /* fresh loops: the first connection between two workers each time */
        env_up(&e, &o);
        producer big = {.loop = e.pl,
                        .port = tdp_fanin_port(e.f),
                        .tag = 1000 + (uint64_t)r,
                        .count = 10,
                        .bytes = 64000};
        producer small = {.loop = e.pl,
                          .port = tdp_fanin_port(e.f),
                          .tag = (uint64_t)r,
                          .count = 10,
                          .bytes = 4000};
        producer_start(&big);
        pthread_join(big.th, NULL);
        assert_true(big.rc != TDP_OK);
        producer_start(&small);
        /* producer ids go past MAXP here: the two are told apart by their ends */
        int msgs = 0, refused = 0, ended = 0;
        for (int n = 0; refused + ended < 2 && n < 64; n++) {
            tdp_fanin_msg m;
            assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
            if (m.kind == TDP_FANIN_MSG) { /* nothing of the refused one is delivered */
                assert_int_equal(word(m.td, 0), (uint64_t)r);
                assert_int_equal(word(m.td, 1), (uint64_t)msgs + 1);
                msgs++;
            } else if (m.kind == TDP_FANIN_LEAVE) {
                if (m.status == TDP_ELIMIT)
                    refused++;
                else
                    ended++;
            }
            tdp_fanin_release(e.f, &m);
        }
        pthread_join(small.th, NULL);
        assert_int_equal(refused, 1);
        assert_int_equal(ended, 1);
        assert_int_equal(small.rc, TDP_OK);
        assert_int_equal(msgs, 10);
        env_down(&e);
    }
}

/* ---- async receive -------------------------------------------------------------- */

typedef struct async_rx {
    tdp_fanin *f;
    tdp_fanin_msg m;
    tally *t;
    int target; /* LEAVEs to wait for */
    pthread_mutex_t mtx;
    pthread_cond_t cond;
    bool done;
    tdp_err rc;
} async_rx;

/* On the loop thread: check, release and receive again, until the end. */
static void async_cb(tdp_op *op, void *arg)
{
    async_rx *a = arg;
    tdp_err rc = tdp_op_result(op);
    if (rc == TDP_OK) {
        if (a->m.kind == TDP_FANIN_MSG) {
            assert_ptr_equal(tdp_op_td(op), a->m.td);
            assert_int_equal(tdp_op_seq(op), a->m.seq);
        }
        take(a->t, &a->m);
        tdp_fanin_release(a->f, &a->m);
        if (a->t->left < a->target) {
            tdp_fanin_recv_async(a->f, op, &a->m);
            return;
        }
    }
    pthread_mutex_lock(&a->mtx);
    a->rc = rc;
    a->done = true;
    pthread_cond_broadcast(&a->cond);
    pthread_mutex_unlock(&a->mtx);
}

static void test_async(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    static tally t;
    memset(&t, 0, sizeof(t));
    async_rx a = {.f = e.f, .t = &t, .target = 3};
    pthread_mutex_init(&a.mtx, NULL);
    pthread_cond_init(&a.cond, NULL);
    tdp_op *op;
    assert_int_equal(tdp_op_new(async_cb, &a, &op), TDP_OK);
    tdp_fanin_recv_async(e.f, op, &a.m); /* posted before any producer is there */
    producer p[3];
    for (int i = 0; i < 3; i++) {
        p[i] = (producer){.loop = e.pl,
                          .port = tdp_fanin_port(e.f),
                          .tag = 20 + (uint64_t)i,
                          .count = 200,
                          .bytes = 2048};
        producer_start(&p[i]);
    }
    pthread_mutex_lock(&a.mtx);
    time_t until = time(NULL) + TMO / 1000;
    while (!a.done && time(NULL) < until)
        pthread_cond_timedwait(&a.cond, &a.mtx, &(struct timespec){time(NULL) + 1, 0});
    pthread_mutex_unlock(&a.mtx);
    assert_true(a.done);
    assert_int_equal(a.rc, TDP_OK);
    for (int i = 0; i < 3; i++) {
        pthread_join(p[i].th, NULL);
        assert_int_equal(by_tag(&t, 20 + (uint64_t)i)->msgs, 200);
    }
    /* a receive pending when the fan-in is freed ends with TDP_ECANCELED */
    a.done = false;
    a.target = 1000;
    tdp_fanin_recv_async(e.f, op, &a.m);
    tdp_fanin_free(e.f);
    e.f = NULL;
    assert_true(a.done);
    assert_int_equal(a.rc, TDP_ECANCELED);
    tdp_op_free(op);
    env_down(&e);
    pthread_mutex_destroy(&a.mtx);
    pthread_cond_destroy(&a.cond);
}

static void *close_main(void *arg)
{
    tdp_fanin_close(arg);
    return NULL;
}

/* tdp_fanin_close is callable from any thread: closes at once from four. */
static void test_close_from_threads(void **state)
{
    (void)state;
    for (int round = 0; round < 20; round++) {
        env e;
        env_up(&e, NULL);
        pthread_t th[4];
        for (int i = 0; i < 4; i++)
            assert_int_equal(pthread_create(&th[i], NULL, close_main, e.f), 0);
        for (int i = 0; i < 4; i++)
            pthread_join(th[i], NULL);
        tdp_fanin_msg m;
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_ECLOSED);
        env_down(&e);
    }
}

/* ---- limits and authentication ---------------------------------------------------- */

static void test_limits(void **state)
{
    (void)state;
    env e;
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    o.max_producers = 2;
    env_up(&e, &o);
    tdp_pipe_opts po;
    pipe_opts(&po);
    tdp_pipe *a, *b, *c;
    uint16_t port = tdp_fanin_port(e.f);
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", port, &po, &a), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", port, &po, &b), TDP_OK);
    tdp_fanin_msg m;
    /* both joined before the third tries */
    assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
    assert_int_equal(m.kind, TDP_FANIN_JOIN);
    assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
    assert_int_equal(m.kind, TDP_FANIN_JOIN);
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", port, &po, &c), TDP_ELIMIT);
    /* one leaves: there is room again */
    assert_int_equal(tdp_pipe_close(a, TMO), TDP_OK);
    assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
    assert_int_equal(m.kind, TDP_FANIN_LEAVE);
    assert_int_equal(m.status, TDP_ECLOSED);
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", port, &po, &c), TDP_OK);
    /* the dialer may finish its handshake before the fan-in has counted it */
    assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
    assert_int_equal(m.kind, TDP_FANIN_JOIN);
    tdp_fanin_stats st;
    tdp_fanin_stats_get(e.f, &st);
    assert_int_equal(st.refused, 1);
    assert_int_equal(st.producers_now, 2);
    tdp_pipe_free(a);
    tdp_pipe_free(b);
    tdp_pipe_free(c);
    env_down(&e);
}

static void test_secret(void **state)
{
    (void)state;
    env e;
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    o.listener.pipe.secret = SECRET;
    o.listener.pipe.secret_len = strlen(SECRET);
    env_up(&e, &o);
    tdp_pipe_opts po;
    pipe_opts(&po);
    tdp_pipe *p;
    uint16_t port = tdp_fanin_port(e.f);
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", port, &po, &p), TDP_EAUTH);
    po.secret = "another secret of 32 bytes......";
    po.secret_len = strlen(po.secret);
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", port, &po, &p), TDP_EAUTH);
    producer ok = {
        .loop = e.pl, .port = port, .tag = 30, .count = 5, .bytes = 64, .secret = SECRET};
    producer_start(&ok);
    static tally t;
    memset(&t, 0, sizeof(t));
    drain(&e, &t, 1);
    pthread_join(ok.th, NULL);
    assert_int_equal(ok.rc, TDP_OK);
    assert_int_equal(by_tag(&t, 30)->msgs, 5);
    tdp_fanin_stats st;
    tdp_fanin_stats_get(e.f, &st);
    assert_int_equal(st.producers_total, 1);
    assert_true(st.handshakes_failed >= 2);
    env_down(&e);
}

/*
 * Credit per producer: a consumer that holds every message of one producer
 * stops that producer (at its depth) while another goes on.
 */
static void test_credit(void **state)
{
    (void)state;
    env e;
    tdp_fanin_opts o;
    tdp_fanin_opts_default(&o);
    o.listener.pipe.recv_depth = 3;
    o.listener.pipe.recv_window_bytes = 0; /* credit counted by depth (test_window: the window) */
    env_up(&e, &o);
    producer p = {.loop = e.pl, .port = tdp_fanin_port(e.f), .tag = 40, .count = 50, .bytes = 512};
    producer_start(&p);
    static tally t;
    memset(&t, 0, sizeof(t));
    tdp_fanin_msg held[3], m;
    int nheld = 0;
    /* hold the first three messages: the producer can send no more */
    for (int n = 0; n < 10 && nheld < 3; n++) {
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
        take(&t, &m);
        if (m.kind == TDP_FANIN_MSG)
            held[nheld++] = m;
    }
    assert_int_equal(nheld, 3);
    assert_int_equal(tdp_fanin_recv(e.f, 200, &m), TDP_ETIMEDOUT);
    /* another producer is not held up */
    producer q = {.loop = e.pl, .port = tdp_fanin_port(e.f), .tag = 41, .count = 20, .bytes = 512};
    producer_start(&q);
    for (int n = 0; n < 100 && t.left < 1; n++) {
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
        take(&t, &m);
        assert_true(m.kind != TDP_FANIN_MSG || word(m.td, 0) == 41);
        tdp_fanin_release(e.f, &m);
    }
    pthread_join(q.th, NULL);
    assert_int_equal(by_tag(&t, 41)->msgs, 20);
    assert_int_equal(by_tag(&t, 40)->msgs, 3);
    /* the held messages are intact: nothing overwrote them */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(word(held[i].td, 1), (uint64_t)i + 1);
        tdp_fanin_release(e.f, &held[i]);
    }
    drain(&e, &t, 2);
    pthread_join(p.th, NULL);
    assert_int_equal(by_tag(&t, 40)->msgs, 50);
    env_down(&e);
}

/* Producer rounds in one thread of this process: each a new pipe (round 1 aborts). */
typedef struct rounds {
    pthread_t th;
    producer p[3];
} rounds;

static void *rounds_main(void *arg)
{
    rounds *r = arg;
    for (int i = 0; i < 3; i++)
        producer_main(&r->p[i]);
    return NULL;
}

/* A reconnecting producer (tdp_pipe_opts.reconnect_ms): count sends from `from` on, on a go. */
typedef struct resumer {
    pthread_t th;
    tdp_pipe *pipe;
    uint64_t from, count, tag;
    atomic_int go; /* 1: send the first part; 2: the second, then close */
    tdp_err rc;
} resumer;

static void *resumer_main(void *arg)
{
    resumer *r = arg;
    tdp_schema *sc = bytes_schema(4096, "a");
    tdp_td *td = NULL;
    r->rc = sc != NULL && tdp_td_new(sc, &td) == TDP_OK ? TDP_OK : TDP_ENOMEM;
    for (int part = 1; part <= 2 && r->rc == TDP_OK; part++) {
        for (int64_t end = mono_ms() + TMO; atomic_load(&r->go) < part && mono_ms() < end;)
            usleep(1000);
        for (uint64_t i = 0; i < r->count && r->rc == TDP_OK; i++) {
            stamp(td, r->tag, r->from + i);
            r->rc = tdp_pipe_send(r->pipe, td, TMO);
        }
        r->from += r->count;
    }
    if (r->rc == TDP_OK)
        r->rc = tdp_pipe_close(r->pipe, TMO);
    tdp_td_unref(td);
    tdp_schema_unref(sc);
    return NULL;
}

/*
 * Producers that go and come back. (1) One process opens a new pipe three
 * times (the second time it aborts): each is a producer of its own — JOIN,
 * its messages from seq 1 in order, LEAVE — while a steady producer beside
 * it loses nothing. (2) A pipe that reconnects by itself (reconnect_ms)
 * after its fan-in went and another came on the same port: the new fan-in
 * sees it JOIN, its stream resume at the next seq (the pipe's numbering is
 * never reused: RESUME), in order, and a clean LEAVE.
 */
static void test_producer_reconnects(void **state)
{
    (void)state;
    env e;
    env_up(&e, NULL);
    uint16_t port = tdp_fanin_port(e.f);
    producer steady = {.loop = e.pl, .port = port, .tag = 200, .count = 300, .bytes = 4096};
    static rounds r;
    memset(&r, 0, sizeof(r));
    for (int i = 0; i < 3; i++)
        r.p[i] = (producer){.loop = e.pl,
                            .port = port,
                            .tag = 300 + (uint64_t)i,
                            .count = 20,
                            .bytes = 4096,
                            .abort = i == 1};
    producer_start(&steady);
    assert_int_equal(pthread_create(&r.th, NULL, rounds_main, &r), 0);
    static tally t;
    memset(&t, 0, sizeof(t));
    drain(&e, &t, 4);
    pthread_join(steady.th, NULL);
    pthread_join(r.th, NULL);
    assert_int_equal(steady.rc, TDP_OK);
    assert_int_equal(by_tag(&t, 200)->msgs, 300);
    assert_int_equal(by_tag(&t, 200)->status, TDP_ECLOSED);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(r.p[i].rc, TDP_OK);
        seen *s = NULL;
        if (i == 1)
            assert_int_equal(failed_producers(&t, &s, 1), 1);
        else
            s = by_tag(&t, 300 + (uint64_t)i);
        assert_int_equal(s->joins, 1);
        assert_int_equal(s->leaves, 1);
        if (i == 1) {
            /* none of its messages may have come before its abort did */
            assert_true(s->msgs <= 20);
            assert_true(s->tag == 301 || (s->msgs == 0 && s->tag == UINT64_MAX));
        } else {
            assert_int_equal(s->msgs, 20);
            assert_int_equal(s->status, TDP_ECLOSED);
        }
    }
    tdp_fanin_stats st;
    tdp_fanin_stats_get(e.f, &st);
    assert_int_equal(st.producers_total, 4);

    /* (2) the pipe layer's reconnect */
    static resumer rs;
    memset(&rs, 0, sizeof(rs));
    rs.from = 1;
    rs.count = 10;
    rs.tag = 400;
    tdp_pipe_opts o;
    pipe_opts(&o);
    o.reconnect_ms = TMO;
    assert_int_equal(tdp_pipe_connect(e.pl, "127.0.0.1", port, &o, &rs.pipe), TDP_OK);
    assert_int_equal(pthread_create(&rs.th, NULL, resumer_main, &rs), 0);
    atomic_store(&rs.go, 1);
    tdp_fanin_msg m;
    uint64_t next = 1;
    while (next <= 10) {
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
        if (m.kind == TDP_FANIN_MSG) {
            assert_int_equal(m.seq, next);
            assert_int_equal(word(m.td, 0), 400);
            assert_int_equal(word(m.td, 1), next);
            next++;
        }
        tdp_fanin_release(e.f, &m);
    }
    tdp_fanin_free(e.f); /* the producer's peer is gone: it dials again */
    tdp_fanin_opts fo;
    tdp_fanin_opts_default(&fo);
    fo.listener.pipe.plane = test_plane();
    tdp_err rc = TDP_EADDR;
    for (int64_t end = mono_ms() + TMO; mono_ms() < end; usleep(20 * 1000))
        if ((rc = tdp_fanin_new(e.fl, "127.0.0.1", port, &fo, &e.f)) == TDP_OK)
            break;
    assert_int_equal(rc, TDP_OK);
    /* sends made before the producer saw the outage could go to the dead
     * link (an eager ucx send completes without its peer; pipe.md,
     * Reconnect): the rest of the stream starts once it has seen it */
    tdp_pipe_stats ps;
    for (int64_t end = mono_ms() + TMO; mono_ms() < end; usleep(5000)) {
        tdp_pipe_stats_get(rs.pipe, &ps);
        if (ps.reconnects >= 1)
            break;
    }
    assert_int_equal(ps.reconnects, 1);
    atomic_store(&rs.go, 2);
    int joins = 0, leaves = 0;
    while (leaves == 0) {
        assert_int_equal(tdp_fanin_recv(e.f, TMO, &m), TDP_OK);
        if (m.kind == TDP_FANIN_JOIN) {
            joins++;
        } else if (m.kind == TDP_FANIN_MSG) {
            assert_int_equal(joins, 1);
            assert_int_equal(m.seq, next);
            assert_int_equal(word(m.td, 0), 400);
            assert_int_equal(word(m.td, 1), next);
            assert_true(m.new_schema == (next == 11)); /* sent again after the reconnect */
            next++;
        } else {
            assert_int_equal(m.status, TDP_ECLOSED);
            leaves++;
        }
        tdp_fanin_release(e.f, &m);
    }
    pthread_join(rs.th, NULL);
    assert_int_equal(rs.rc, TDP_OK);
    assert_int_equal(next, 21);
    assert_int_equal(joins, 1);
    tdp_pipe_stats_get(rs.pipe, &ps);
    assert_int_equal(ps.reconnects, 1);
    tdp_pipe_free(rs.pipe);
    env_down(&e);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--producer") == 0)
        return child_producer(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_order),
        cmocka_unit_test(test_fairness),
        cmocka_unit_test(test_schema_per_producer),
        cmocka_unit_test(test_killed_producer),
        cmocka_unit_test(test_async),
        cmocka_unit_test(test_close_from_threads),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_secret),
        cmocka_unit_test(test_memory_cap),
        cmocka_unit_test(test_refused_many),
        cmocka_unit_test(test_credit),
        cmocka_unit_test(test_producer_reconnects),
    };
    const char *filter = getenv("TDP_TEST_FILTER");
    if (filter != NULL && *filter != '\0')
        cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
