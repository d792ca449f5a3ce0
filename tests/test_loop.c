/*
 * test_loop.c: the event loop: lifetime, stop races, cross-thread tasks,
 * run_until, progress sources (fake ones over an eventfd: wakeups, arm,
 * kicks, busy-poll, removal inside callbacks, extension teardown order) and
 * UCX wakeups through the pipe layer's worker sources (loopback inside this
 * process only). Every test proves the library's small allocations balance
 * once the loop is freed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <tdpipe/log.h>
#include <tdpipe/mem.h>

#include "core/loop_int.h"
#include "pipe/ucx/ucx_workers.h"

/* ---- helpers ------------------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

/* Poll (sleeping, so the loop thread stays the only busy one) until *v >= want. */
static bool wait_for(atomic_int *v, int want, int timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    while (atomic_load(v) < want) {
        if (now_ms() > end)
            return false;
        sleep_ms(1);
    }
    return true;
}

static uint64_t live_small(void)
{
    tdp_mem_stats st;
    tdp_mem_stats_get(&st);
    return st.small_allocs - st.small_frees;
}

static tdp_loop *new_loop(uint32_t safety_ms)
{
    tdp_loop_opts o = {.size = sizeof(o), .safety_timer_ms = safety_ms};
    tdp_loop *loop = NULL;
    assert_int_equal(tdp_loop_new(&o, &loop), TDP_OK);
    assert_non_null(loop);
    return loop;
}

/* Run fn(arg) on a running loop's thread and wait for it to return. */
typedef struct call {
    tdp_loop_fn fn;
    void *arg;
    atomic_int done;
} call;

static void call_run(void *arg)
{
    call *c = arg;
    c->fn(c->arg);
    atomic_store(&c->done, 1);
}

static void call_on_loop(tdp_loop *loop, tdp_loop_fn fn, void *arg)
{
    call c = {.fn = fn, .arg = arg};
    assert_int_equal(tdp_loop_post(loop, call_run, &c), TDP_OK);
    assert_true(wait_for(&c.done, 1, 10000));
}

static void count_task(void *arg)
{
    atomic_fetch_add((atomic_int *)arg, 1);
}

static void stop_task(void *arg)
{
    tdp_loop_stop(arg);
}

/* ---- lifetime -------------------------------------------------------------- */

static void test_new_free(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = NULL;

    assert_int_equal(tdp_loop_new(NULL, NULL), TDP_EINVAL);
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_false(tdp_loop_on_thread(loop));
    assert_false(tdp__loop_running(loop));
    assert_non_null(tdp__loop_base(loop));
    /* no UCX until a layer asks for it; then made once, on an idle loop too */
    assert_null(tdp__ucx_peek(loop));
    tdp__ucx *u = NULL, *u2 = NULL;
    assert_int_equal(tdp__ucx_get(loop, &u), TDP_OK);
    assert_non_null(u);
    assert_non_null(u->context[TDP_WORKER_ANY]);
    assert_non_null(u->worker[TDP_WORKER_ANY]);
    assert_true(u->nworkers >= 1 && u->nworkers <= TDP_LOOP_WORKERS);
    assert_int_equal(tdp__ucx_get(loop, &u2), TDP_OK);
    assert_ptr_equal(u, u2);
    assert_ptr_equal(tdp__ucx_peek(loop), u);
    tdp_loop_free(loop);

    /* a short opts struct (an older caller) takes only the fields it has */
    tdp_loop_opts o = {.size = offsetof(tdp_loop_opts, safety_timer_ms), .max_progress = 8};
    loop = NULL;
    assert_int_equal(tdp_loop_new(&o, &loop), TDP_OK);
    tdp_loop_free(loop);

    tdp_loop_free(NULL);
    tdp_loop_stop(NULL);
    assert_false(tdp_loop_on_thread(NULL));
    assert_int_equal(live_small(), live);
}

static void test_misuse(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(0);
    volatile bool done = false;

    assert_int_equal(tdp_loop_run(NULL), TDP_EINVAL);
    assert_int_equal(tdp_loop_start_thread(NULL), TDP_EINVAL);
    assert_int_equal(tdp_loop_post(NULL, count_task, NULL), TDP_EINVAL);
    assert_int_equal(tdp_loop_post(loop, NULL, NULL), TDP_EINVAL);
    assert_int_equal(tdp__loop_run_until(loop, NULL, 0), TDP_EINVAL);

    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_true(tdp__loop_running(loop));
    assert_false(tdp_loop_on_thread(loop));
    assert_int_equal(tdp_loop_start_thread(loop), TDP_EINVAL);
    assert_int_equal(tdp_loop_run(loop), TDP_EINVAL);
    assert_int_equal(tdp__loop_run_until(loop, &done, 10), TDP_EINVAL);
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

static void test_free_drops_pending(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(0);
    atomic_int ran = 0;

    for (int i = 0; i < 5; i++)
        assert_int_equal(tdp_loop_post(loop, count_task, &ran), TDP_OK);
    tdp_loop_free(loop); /* never ran: the tasks are freed, not run */
    assert_int_equal(atomic_load(&ran), 0);
    assert_int_equal(live_small(), live);
}

/* ---- stop ---------------------------------------------------------------- */

static void test_stop_before_run(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(0);
    atomic_int ran = 0;

    tdp_loop_stop(loop);
    tdp_loop_stop(loop); /* idempotent */
    int64_t t0 = now_ms();
    assert_int_equal(tdp_loop_run(loop), TDP_OK);
    assert_true(now_ms() - t0 < 5000);
    assert_false(tdp__loop_running(loop));

    /* the stop was consumed: the next run lasts until the next stop */
    assert_int_equal(tdp_loop_post(loop, count_task, &ran), TDP_OK);
    assert_int_equal(tdp_loop_post(loop, stop_task, loop), TDP_OK);
    assert_int_equal(tdp_loop_run(loop), TDP_OK);
    assert_int_equal(atomic_load(&ran), 1);

    /* a stop before the loop thread starts ends that thread at once */
    tdp_loop_stop(loop);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    int64_t end = now_ms() + 2000;
    while (tdp__loop_running(loop) && now_ms() < end)
        sleep_ms(1);
    assert_false(tdp__loop_running(loop));

    /* and a stopped thread can be replaced by a new one */
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    call_on_loop(loop, count_task, &ran);
    assert_int_equal(atomic_load(&ran), 2);
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

static void *stopper_main(void *arg)
{
    tdp_loop *loop = arg;
    /* land anywhere from before run starts to well inside it */
    sleep_ms(rand() % 3);
    tdp_loop_stop(loop);
    return NULL;
}

static void test_stop_race(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(0);

    srand(1234);
    for (int i = 0; i < 200; i++) {
        pthread_t t;
        assert_int_equal(pthread_create(&t, NULL, stopper_main, loop), 0);
        int64_t t0 = now_ms();
        assert_int_equal(tdp_loop_run(loop), TDP_OK);
        assert_true(now_ms() - t0 < 5000);
        pthread_join(t, NULL);
    }
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

/* ---- tasks ---------------------------------------------------------------- */

#define POSTERS    4
#define PER_POSTER 2500

typedef struct order {
    tdp_loop *loop;
    int next[POSTERS]; /* loop thread only */
    atomic_int ran;
    atomic_int bad; /* out of order, duplicate or off the loop thread */
    int runs[POSTERS * PER_POSTER];
} order;

typedef struct order_item {
    order *o;
    int poster, seq;
} order_item;

static order_item items[POSTERS * PER_POSTER];

static void order_task(void *arg)
{
    order_item *it = arg;
    order *o = it->o;

    if (!tdp_loop_on_thread(o->loop) || o->next[it->poster] != it->seq)
        atomic_fetch_add(&o->bad, 1);
    o->next[it->poster] = it->seq + 1;
    o->runs[it->poster * PER_POSTER + it->seq]++;
    atomic_fetch_add(&o->ran, 1);
}

typedef struct poster_arg {
    order *o;
    int poster;
} poster_arg;

static void *poster_main(void *arg)
{
    poster_arg *p = arg;
    for (int i = 0; i < PER_POSTER; i++) {
        order_item *it = &items[p->poster * PER_POSTER + i];
        *it = (order_item){.o = p->o, .poster = p->poster, .seq = i};
        if (tdp_loop_post(p->o->loop, order_task, it) != TDP_OK)
            atomic_fetch_add(&p->o->bad, 1);
    }
    return NULL;
}

static void test_post_many(void **state)
{
    uint64_t live = live_small();
    static order o;
    pthread_t t[POSTERS];
    poster_arg pa[POSTERS];

    memset(&o, 0, sizeof(o));
    o.loop = new_loop(0);
    assert_int_equal(tdp_loop_start_thread(o.loop), TDP_OK);
    for (int i = 0; i < POSTERS; i++) {
        pa[i] = (poster_arg){.o = &o, .poster = i};
        assert_int_equal(pthread_create(&t[i], NULL, poster_main, &pa[i]), 0);
    }
    for (int i = 0; i < POSTERS; i++)
        pthread_join(t[i], NULL);
    assert_true(wait_for(&o.ran, POSTERS * PER_POSTER, 10000));
    sleep_ms(10); /* a duplicate would show up now */
    assert_int_equal(atomic_load(&o.ran), POSTERS * PER_POSTER);
    assert_int_equal(atomic_load(&o.bad), 0);
    for (int i = 0; i < POSTERS * PER_POSTER; i++)
        assert_int_equal(o.runs[i], 1);
    tdp_loop_free(o.loop);
    assert_int_equal(live_small(), live);
}

/* A task posting from the loop thread: the new one runs later, not inside post. */
typedef struct nested {
    tdp_loop *loop;
    atomic_int step;
    bool inner_ran_early;
} nested;

static void inner_task(void *arg)
{
    nested *n = arg;
    atomic_fetch_add(&n->step, 1);
}

static void outer_task(void *arg)
{
    nested *n = arg;
    assert_int_equal(tdp_loop_post(n->loop, inner_task, n), TDP_OK);
    n->inner_ran_early = atomic_load(&n->step) != 0;
    atomic_fetch_add(&n->step, 1);
}

/* An intrusive task that re-posts itself: nothing allocated per post. */
typedef struct repost {
    tdp__task task;
    tdp_loop *loop;
    int left;
    atomic_int done;
} repost;

static void repost_task(void *arg)
{
    repost *r = arg;
    if (--r->left > 0)
        tdp__loop_post_task(r->loop, &r->task);
    else
        atomic_store(&r->done, 1);
}

static void test_post_from_loop(void **state)
{
    uint64_t live = live_small();
    nested n = {.loop = new_loop(0)};
    repost r = {.loop = n.loop, .left = 1000};

    assert_int_equal(tdp_loop_start_thread(n.loop), TDP_OK);
    assert_int_equal(tdp_loop_post(n.loop, outer_task, &n), TDP_OK);
    assert_true(wait_for(&n.step, 2, 5000));
    assert_false(n.inner_ran_early);

    r.task = (tdp__task){.fn = repost_task, .arg = &r};
    uint64_t before = tdp_mem_total_allocs();
    tdp__loop_post_task(r.loop, &r.task);
    assert_true(wait_for(&r.done, 1, 5000));
    assert_int_equal(tdp_mem_total_allocs(), before);
    tdp_loop_free(n.loop);
    assert_int_equal(live_small(), live);
}

/* ---- run_until ---------------------------------------------------------- */

static void set_done(void *arg)
{
    *(volatile bool *)arg = true;
}

typedef struct later {
    tdp_loop *loop;
    volatile bool *done;
    int delay_ms;
    tdp_err rc; /* cmocka asserts only on the test's own thread */
} later;

static void *post_later_main(void *arg)
{
    later *l = arg;
    sleep_ms(l->delay_ms);
    l->rc = tdp_loop_post(l->loop, set_done, (void *)l->done);
    return NULL;
}

/* Keeps the loop busy forever: the deadline must still fire. */
typedef struct spinner {
    tdp__task task;
    tdp_loop *loop;
    bool stop;
    long runs;
} spinner;

static void spin_task(void *arg)
{
    spinner *s = arg;
    s->runs++;
    if (!s->stop)
        tdp__loop_post_task(s->loop, &s->task);
}

/* The busy-poll fast path keeps run_until's contract: deadline and done. */
static void test_run_until_busy_poll(void **state)
{
    tdp_loop *loop;
    tdp_loop_opts o = {.size = sizeof(o), .busy_poll_us = 200};
    volatile bool done = false;
    assert_int_equal(tdp_loop_new(&o, &loop), TDP_OK);
    int64_t t0 = now_ms();
    assert_int_equal(tdp__loop_run_until(loop, &done, 100), TDP_ETIMEDOUT);
    int64_t dt = now_ms() - t0;
    assert_true(dt >= 95 && dt < 5000);
    assert_int_equal(tdp_loop_post(loop, set_done, (void *)&done), TDP_OK);
    t0 = now_ms();
    assert_int_equal(tdp__loop_run_until(loop, &done, 5000), TDP_OK);
    assert_true(now_ms() - t0 < 1000);
    tdp_loop_free(loop);
}

/*
 * Holding the loop: calls from several threads exclude each other (a plain
 * counter bumped under the hold comes out exact, and ThreadSanitizer sees
 * the hand-over), an inline hold is waited out rather than failed, and
 * run_after runs its function only when it gets the loop.
 */
typedef struct hold_ctx {
    tdp_loop *loop;
    long counter;          /* only touched while holding the loop */
    atomic_int in_slow;    /* slow_fn has the loop */
    atomic_int slow_done;
    atomic_long run_after_ok, run_after_busy, inline_ok;
    atomic_int errors; /* counted by the threads: cmocka asserts only on the main one */
} hold_ctx;

static void bump(void *arg)
{
    hold_ctx *c = arg;
    c->counter++;
}

static void slow_fn(void *arg)
{
    hold_ctx *c = arg;
    atomic_store(&c->in_slow, 1);
    sleep_ms(50);
    c->counter += 1000;
    atomic_store(&c->slow_done, 1);
}

static void check_slow_done(void *arg)
{
    hold_ctx *c = arg;
    if (atomic_load(&c->slow_done) != 1) /* must run after slow_fn let go */
        atomic_fetch_add(&c->errors, 1);
    c->counter++;
}

#define HOLD_ROUNDS 20000

static void *bump_main(void *arg)
{
    hold_ctx *c = arg;
    /* an inline call waits out another inline hold, but not run_after's */
    for (int i = 0; i < HOLD_ROUNDS; i++)
        if (tdp__loop_run_inline(c->loop, bump, c))
            atomic_fetch_add(&c->inline_ok, 1);
    return NULL;
}

static void *run_after_main(void *arg)
{
    hold_ctx *c = arg;
    volatile bool done = true; /* nothing to wait for once bump ran */
    for (int i = 0; i < HOLD_ROUNDS; i++) {
        tdp_err rc = tdp__loop_run_after(c->loop, bump, c, &done, 1000);
        if (rc == TDP_OK)
            atomic_fetch_add(&c->run_after_ok, 1);
        else if (rc == TDP_EINVAL)
            atomic_fetch_add(&c->run_after_busy, 1); /* held: bump not run */
        else
            atomic_fetch_add(&c->errors, 1);
    }
    return NULL;
}

static void *slow_main(void *arg)
{
    hold_ctx *c = arg;
    if (!tdp__loop_run_inline(c->loop, slow_fn, c))
        atomic_fetch_add(&c->errors, 1);
    return NULL;
}

static void test_hold(void **state)
{
    (void)state;
    hold_ctx c = {0};
    assert_int_equal(tdp_loop_new(NULL, &c.loop), TDP_OK);

    /* an inline hold is waited out, not failed, by inline calls and run_until alike */
    pthread_t slow;
    assert_int_equal(pthread_create(&slow, NULL, slow_main, &c), 0);
    for (int i = 0; i < 5000 && !atomic_load(&c.in_slow); i++)
        sleep_ms(1);
    assert_int_equal(atomic_load(&c.in_slow), 1);
    volatile bool never = false;
    assert_int_equal(tdp__loop_run_until(c.loop, &never, 10), TDP_ETIMEDOUT);
    assert_int_equal(atomic_load(&c.slow_done), 1);
    int64_t t0 = now_ms();
    assert_true(tdp__loop_run_inline(c.loop, check_slow_done, &c));
    assert_true(now_ms() - t0 < 2000);
    pthread_join(slow, NULL);
    assert_int_equal(atomic_load(&c.errors), 0);
    assert_int_equal(c.counter, 1001);
    /* a loop run by a thread refuses run_until and run_after (fn not run) */
    assert_int_equal(tdp_loop_start_thread(c.loop), TDP_OK);
    assert_int_equal(tdp__loop_run_after(c.loop, bump, &c, &never, 10), TDP_EINVAL);
    tdp_loop_stop(c.loop);
    for (int i = 0; i < 5000 && tdp__loop_running(c.loop); i++)
        sleep_ms(1);
    assert_false(tdp__loop_running(c.loop));
    assert_int_equal(c.counter, 1001);

    /* three threads taking it in turns, one of them through run_after */
    c.counter = 0;
    pthread_t th[3];
    assert_int_equal(pthread_create(&th[0], NULL, bump_main, &c), 0);
    assert_int_equal(pthread_create(&th[1], NULL, bump_main, &c), 0);
    assert_int_equal(pthread_create(&th[2], NULL, run_after_main, &c), 0);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(atomic_load(&c.errors), 0);
    assert_int_equal(atomic_load(&c.run_after_ok) + atomic_load(&c.run_after_busy), HOLD_ROUNDS);
    assert_int_equal(c.counter, atomic_load(&c.inline_ok) + atomic_load(&c.run_after_ok));
    assert_true(atomic_load(&c.inline_ok) > 0);
    assert_false(tdp__loop_running(c.loop));
    tdp_loop_free(c.loop);
}

static void test_run_until(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(0);
    volatile bool done = false;
    int64_t t0, dt;

    /* nothing happens: the deadline, not earlier, not much later */
    t0 = now_ms();
    assert_int_equal(tdp__loop_run_until(loop, &done, 200), TDP_ETIMEDOUT);
    dt = now_ms() - t0;
    assert_true(dt >= 195 && dt < 5000);
    assert_false(tdp__loop_running(loop));

    /* a task posted from another thread ends it promptly */
    later l = {.loop = loop, .done = &done, .delay_ms = 50};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, post_later_main, &l), 0);
    t0 = now_ms();
    assert_int_equal(tdp__loop_run_until(loop, &done, 5000), TDP_OK);
    dt = now_ms() - t0;
    pthread_join(t, NULL);
    assert_int_equal(l.rc, TDP_OK);
    assert_true(done);
    assert_true(dt >= 45 && dt < 5000);

    /* already done: returns at once */
    assert_int_equal(tdp__loop_run_until(loop, &done, -1), TDP_OK);

    /* on_thread inside callbacks, a task posted before the call */
    done = false;
    nested n = {.loop = loop};
    assert_int_equal(tdp_loop_post(loop, outer_task, &n), TDP_OK);
    assert_int_equal(tdp_loop_post(loop, set_done, (void *)&done), TDP_OK);
    assert_int_equal(tdp__loop_run_until(loop, &done, 5000), TDP_OK);

    /* a task that re-posts itself forever must not starve the deadline */
    done = false;
    spinner s = {.loop = loop};
    s.task = (tdp__task){.fn = spin_task, .arg = &s};
    tdp__loop_post_task(loop, &s.task);
    t0 = now_ms();
    assert_int_equal(tdp__loop_run_until(loop, &done, 100), TDP_ETIMEDOUT);
    dt = now_ms() - t0;
    assert_true(dt >= 95 && dt < 5000);
    assert_true(s.runs > 10);
    s.stop = true;
    tdp_loop_free(loop); /* the spinner's last post is dropped: it is ours, not the loop's */
    assert_int_equal(live_small(), live);
}

/* ---- progress sources ------------------------------------------------------- */

/*
 * A fake source: an eventfd (or no fd) standing in for a UCP worker. Counters
 * the test thread reads while a loop thread runs are atomic; the trace is
 * read only after the loop that wrote it stopped.
 */
typedef struct fake_src {
    tdp_loop *loop;
    int fd; /* eventfd, or -1 */
    tdp__source *src;
    atomic_int progressed, handled, armed;
    int busy_left;   /* arm answers busy this many more times */
    int arm_rc;      /* and then this */
    int active_left; /* progress reports this many more events of its own */
    bool remove_self;
    struct fake_src *remove_other; /* removed by this one's first progress */
    struct fake_src *add_new;      /* added by this one's first progress */
    char trace[64];                /* P progress, B busy arm, A armed, E arm error */
    int ntrace;
} fake_src;

static void trace(fake_src *f, char c)
{
    if (f->ntrace < (int)sizeof(f->trace) - 1)
        f->trace[f->ntrace++] = c;
}

static unsigned fake_progress(void *arg);
static int fake_arm(void *arg);
static const tdp__source_ops fake_ops = {.progress = fake_progress, .arm = fake_arm};

static unsigned fake_progress(void *arg)
{
    fake_src *f = arg;
    unsigned n = 0;
    uint64_t v;

    atomic_fetch_add(&f->progressed, 1);
    trace(f, 'P');
    if (f->fd >= 0 && read(f->fd, &v, sizeof(v)) == (ssize_t)sizeof(v)) {
        atomic_fetch_add(&f->handled, (int)v);
        n += (unsigned)v;
    }
    if (f->active_left > 0) {
        f->active_left--;
        n++;
    }
    if (f->remove_other != NULL) {
        tdp__loop_source_remove(f->loop, f->remove_other->src);
        f->remove_other->src = NULL;
        f->remove_other = NULL;
    }
    if (f->add_new != NULL) {
        fake_src *g = f->add_new;
        f->add_new = NULL;
        if (tdp__loop_source_add(f->loop, g->fd, &fake_ops, g, &g->src) != TDP_OK)
            g->src = NULL;
    }
    if (f->remove_self) {
        f->remove_self = false;
        tdp__loop_source_remove(f->loop, f->src);
        f->src = NULL;
    }
    return n;
}

static int fake_arm(void *arg)
{
    fake_src *f = arg;

    atomic_fetch_add(&f->armed, 1);
    if (f->busy_left > 0) {
        f->busy_left--;
        trace(f, 'B');
        return 1;
    }
    trace(f, f->arm_rc == 0 ? 'A' : 'E');
    return f->arm_rc;
}

static void fake_init(fake_src *f, tdp_loop *loop, bool with_fd)
{
    memset(f, 0, sizeof(*f));
    f->loop = loop;
    f->fd = -1;
    if (with_fd) {
        f->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        assert_true(f->fd >= 0);
    }
}

static void fake_add(fake_src *f)
{
    assert_int_equal(tdp__loop_source_add(f->loop, f->fd, &fake_ops, f, &f->src), TDP_OK);
    assert_non_null(f->src);
}

static void fake_close(fake_src *f)
{
    if (f->fd >= 0)
        close(f->fd);
    f->fd = -1;
}

static void fake_signal(fake_src *f, uint64_t v)
{
    assert_int_equal(write(f->fd, &v, sizeof(v)), (ssize_t)sizeof(v));
}

static void fake_remove_task(void *arg)
{
    fake_src *f = arg;
    tdp__loop_source_remove(f->loop, f->src);
    f->src = NULL;
}

static void kick_task(void *arg)
{
    tdp__loop_kick(arg);
}

#define HOUR_MS (3600 * 1000)

/* ---- idle work (tdp__loop_idle_add) ----------------------------------------- */

typedef struct idler {
    tdp_loop *loop;
    tdp__idle h;
    atomic_int runs;
    volatile bool *done; /* set by the queuing task, when given */
} idler;

static bool idle_fn(void *arg)
{
    atomic_fetch_add(&((idler *)arg)->runs, 1);
    return false;
}

/* Queue the idle work twice (the second is a no-op) and, if asked, end a run_until. */
static void queue_idle(void *arg)
{
    idler *d = arg;
    tdp__loop_idle_add(d->loop, &d->h);
    tdp__loop_idle_add(d->loop, &d->h);
    if (d->done != NULL)
        *d->done = true;
}

static void cancel_idle(void *arg)
{
    idler *d = arg;
    tdp__loop_idle_add(d->loop, &d->h);
    tdp__loop_idle_cancel(d->loop, &d->h);
}

/*
 * Idle work runs once, when the loop is about to sleep: on a loop thread
 * after the turn that queued it; in a blocking call's drive only if that
 * call goes on waiting, never when its own work is done and it returns.
 */
static void test_idle(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(HOUR_MS);
    idler d = {.loop = loop};
    d.h = (tdp__idle){.fn = idle_fn, .arg = &d};
    atomic_init(&d.runs, 0);

    /* a blocking call whose work is done returns: the idle work waits */
    volatile bool done = false;
    d.done = &done;
    assert_int_equal(tdp_loop_post(loop, queue_idle, &d), TDP_OK);
    assert_int_equal(tdp__loop_run_until(loop, &done, 5000), TDP_OK);
    assert_int_equal(atomic_load(&d.runs), 0);
    assert_true(d.h.queued);
    /* one that goes on waiting runs it, once */
    done = false;
    assert_int_equal(tdp__loop_run_until(loop, &done, 50), TDP_ETIMEDOUT);
    assert_int_equal(atomic_load(&d.runs), 1);
    assert_false(d.h.queued);

    /* a loop thread runs it once after the turn that queued it */
    d.done = NULL;
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    call_on_loop(loop, queue_idle, &d);
    assert_true(wait_for(&d.runs, 2, 5000));
    sleep_ms(50);
    assert_int_equal(atomic_load(&d.runs), 2);
    /* cancelled: never runs */
    call_on_loop(loop, cancel_idle, &d);
    call_on_loop(loop, kick_task, loop);
    sleep_ms(50);
    assert_int_equal(atomic_load(&d.runs), 2);
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

/* Idle work that did something (true) or nothing (false), and a trace mark of its own. */
typedef struct idle_tracer {
    fake_src *f;
    tdp__idle h;
    bool acted;
} idle_tracer;

static bool idle_trace_fn(void *arg)
{
    idle_tracer *t = arg;
    trace(t->f, 'I');
    return t->acted;
}

static void queue_idle_tracer(void *arg)
{
    idle_tracer *t = arg;
    tdp__loop_idle_add(t->f->loop, &t->h);
}

/*
 * Before the loop sleeps: idle work that did nothing lets the sources be
 * armed at once; idle work that did something (a send posted) gets its
 * round of progress first.
 */
static void test_idle_then_arm(void **state)
{
    for (int acted = 0; acted < 2; acted++) {
        uint64_t live = live_small();
        tdp_loop *loop = new_loop(HOUR_MS);
        volatile bool never = false;
        fake_src f;
        fake_init(&f, loop, false);
        fake_add(&f);
        idle_tracer t = {.f = &f, .acted = acted != 0};
        t.h = (tdp__idle){.fn = idle_trace_fn, .arg = &t};
        assert_int_equal(tdp_loop_post(loop, queue_idle_tracer, &t), TDP_OK);
        assert_int_equal(tdp__loop_run_until(loop, &never, 100), TDP_ETIMEDOUT);
        /* the first drain arms; the task queues the idle work, whose turn drains again */
        assert_string_equal(f.trace, acted ? "PAPIPA" : "PAPIA");
        tdp_loop_free(loop);
        assert_int_equal(live_small(), live);
    }
}

static tdp_loop *new_loop_opts(uint32_t safety_ms, uint32_t busy_poll_us)
{
    tdp_loop_opts o = {
        .size = sizeof(o), .safety_timer_ms = safety_ms, .busy_poll_us = busy_poll_us};
    tdp_loop *loop = NULL;
    assert_int_equal(tdp_loop_new(&o, &loop), TDP_OK);
    return loop;
}


/* A readable fd wakes a sleeping loop; an idle source is not polled. */
static void test_source_fd(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(HOUR_MS); /* no safety timer to hide a missed wakeup */
    fake_src f;

    fake_init(&f, loop, true);
    fake_add(&f); /* on an idle loop */
    assert_int_equal(tdp__loop_source_add(loop, -1, NULL, &f, &f.src), TDP_EINVAL);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_true(wait_for(&f.armed, 1, 5000)); /* armed on the first turn */
    sleep_ms(20);
    int p0 = atomic_load(&f.progressed);
    sleep_ms(100);
    assert_int_equal(atomic_load(&f.progressed), p0); /* asleep, not polling */

    fake_signal(&f, 3);
    assert_true(wait_for(&f.handled, 3, 5000));
    fake_signal(&f, 2);
    assert_true(wait_for(&f.handled, 5, 5000));
    assert_true(atomic_load(&f.progressed) > p0);

    call_on_loop(loop, fake_remove_task, &f);
    p0 = atomic_load(&f.progressed);
    fake_signal(&f, 1); /* no longer watched */
    sleep_ms(50);
    assert_int_equal(atomic_load(&f.progressed), p0);
    assert_int_equal(atomic_load(&f.handled), 5);
    tdp_loop_free(loop);
    fake_close(&f);
    assert_int_equal(live_small(), live);
}

/* A busy arm makes the loop progress again before it sleeps. */
static void test_source_arm_busy(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(HOUR_MS);
    volatile bool never = false;
    fake_src f;

    fake_init(&f, loop, false);
    f.busy_left = 3;
    fake_add(&f);
    assert_int_equal(tdp__loop_run_until(loop, &never, 100), TDP_ETIMEDOUT);
    /* one drain: progress, busy, progress, ..., armed; then nothing woke the loop */
    assert_string_equal(f.trace, "PBPBPBPA");
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

static atomic_int arm_errors;

static void count_arm_errors(tdp_log_level level, const char *file, int line, const char *msg,
                             void *arg)
{
    if (level == TDP_LOG_ERROR && strstr(msg, "arm") != NULL)
        atomic_fetch_add(&arm_errors, 1);
}

/* An arm error is logged once; the safety timer keeps progressing the source. */
static void test_source_arm_error(void **state)
{
    uint64_t live = live_small();
    tdp_log_level saved = tdp_log_get_level();
    tdp_loop *loop = new_loop(10);
    volatile bool never = false;
    fake_src bad, good;

    atomic_store(&arm_errors, 0);
    tdp_log_set_handler(count_arm_errors, NULL);
    tdp_log_set_level(TDP_LOG_ERROR);
    fake_init(&good, loop, false);
    fake_init(&bad, loop, false);
    bad.arm_rc = -5;
    fake_add(&good);
    fake_add(&bad); /* walked first: its error must not keep good from being armed */
    assert_int_equal(tdp__loop_run_until(loop, &never, 200), TDP_ETIMEDOUT);
    tdp_log_set_handler(NULL, NULL);
    tdp_log_set_level(saved);
    print_message("arm error: %d progress calls, %d arms in 200 ms\n", atomic_load(&bad.progressed),
                  atomic_load(&bad.armed));
    assert_true(atomic_load(&bad.progressed) >= 4); /* the 10 ms safety timer */
    assert_true(atomic_load(&bad.armed) >= 4);
    assert_int_equal(atomic_load(&good.armed), atomic_load(&bad.armed));
    assert_int_equal(atomic_load(&arm_errors), 1);
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

/* Without an fd a source moves on kicks (and safety timer, busy-poll) only. */
static void test_source_no_fd(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(HOUR_MS);
    fake_src f;

    fake_init(&f, loop, false);
    fake_add(&f);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_true(wait_for(&f.progressed, 1, 5000));
    sleep_ms(20);
    int p0 = atomic_load(&f.progressed);
    sleep_ms(50);
    assert_int_equal(atomic_load(&f.progressed), p0);
    call_on_loop(loop, kick_task, loop);
    assert_true(wait_for(&f.progressed, p0 + 1, 5000));
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

/* The busy-poll window progresses an fd-less source, on both paths. */
static void test_source_busy_poll(void **state)
{
    uint64_t live = live_small();
    volatile bool never = false;
    fake_src f;

    /* run_until's spin: the window outlasts the call */
    tdp_loop *loop = new_loop_opts(HOUR_MS, 100 * 1000);
    fake_init(&f, loop, false);
    f.active_left = 1;
    fake_add(&f);
    assert_int_equal(tdp__loop_run_until(loop, &never, 30), TDP_ETIMEDOUT);
    print_message("busy-poll spin: %d progress calls in 30 ms\n", atomic_load(&f.progressed));
    assert_true(atomic_load(&f.progressed) > 100);
    tdp_loop_free(loop);

    /* a loop thread: the again timer, until the window after the last activity ends */
    loop = new_loop_opts(HOUR_MS, 30 * 1000);
    fake_init(&f, loop, false);
    f.active_left = 1;
    fake_add(&f);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    sleep_ms(200);
    int p1 = atomic_load(&f.progressed);
    print_message("busy-poll loop: %d progress calls\n", p1);
    assert_true(p1 > 20);
    sleep_ms(100);
    assert_int_equal(atomic_load(&f.progressed), p1); /* asleep after the window */
    tdp_loop_free(loop);
    assert_int_equal(live_small(), live);
}

/* Removing (itself, an earlier or a later source) and adding inside progress. */
static void test_source_remove_in_progress(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(HOUR_MS);
    volatile bool never = false;
    fake_src s1, s2, s3, s4, s5;

    fake_init(&s1, loop, true);
    fake_init(&s2, loop, true);
    fake_init(&s3, loop, false);
    fake_init(&s4, loop, true);
    fake_init(&s5, loop, false);
    fake_add(&s1);
    fake_add(&s2);
    fake_add(&s3);
    fake_add(&s4); /* walked in the order added: s1, s2, s3, s4 */
    s1.remove_self = true;
    s2.remove_other = &s4; /* not walked yet */
    s3.remove_other = &s2; /* walked already */
    s3.add_new = &s5;
    /* all fds readable: their events are active when the first drain frees them */
    fake_signal(&s1, 1);
    fake_signal(&s2, 1);
    fake_signal(&s4, 1);
    assert_int_equal(tdp__loop_run_until(loop, &never, 50), TDP_ETIMEDOUT);
    assert_null(s1.src);
    assert_null(s2.src);
    assert_null(s4.src);
    assert_non_null(s3.src);
    assert_non_null(s5.src);
    assert_int_equal(atomic_load(&s1.progressed), 1);
    assert_int_equal(atomic_load(&s2.progressed), 1);
    assert_int_equal(atomic_load(&s4.progressed), 0);
    assert_true(atomic_load(&s3.progressed) >= 1);
    assert_true(atomic_load(&s5.progressed) >= 1); /* the add kicked the loop */
    assert_int_equal(atomic_load(&s1.armed) + atomic_load(&s2.armed), 0);

    /* removed fds no longer wake anything; the live ones still move on a kick */
    int p3 = atomic_load(&s3.progressed), p5 = atomic_load(&s5.progressed);
    fake_signal(&s1, 1);
    fake_signal(&s2, 1);
    fake_signal(&s4, 1);
    tdp__loop_kick(loop);
    assert_int_equal(tdp__loop_run_until(loop, &never, 50), TDP_ETIMEDOUT);
    assert_int_equal(atomic_load(&s1.progressed), 1);
    assert_int_equal(atomic_load(&s2.progressed), 1);
    assert_int_equal(atomic_load(&s4.progressed), 0);
    assert_true(atomic_load(&s3.progressed) > p3);
    assert_true(atomic_load(&s5.progressed) > p5);

    /* a source removing the only other one, then itself, in the same call */
    s3.remove_other = &s5;
    s3.remove_self = true;
    tdp__loop_kick(loop);
    assert_int_equal(tdp__loop_run_until(loop, &never, 50), TDP_ETIMEDOUT);
    assert_null(s3.src);
    assert_null(s5.src);
    tdp__loop_source_remove(loop, NULL); /* no-op */

    /* one left registered at free is dropped with the loop */
    fake_src s6;
    fake_init(&s6, loop, true);
    fake_add(&s6);
    tdp_loop_free(loop);
    fake_close(&s1);
    fake_close(&s2);
    fake_close(&s4);
    fake_close(&s6);
    assert_int_equal(live_small(), live);
}

/* tdp_loop_free: every pre_fini, then every fini, each round highest key first. */
static char ext_order[32];

static void ext_note(const char *what)
{
    strncat(ext_order, what, sizeof(ext_order) - strlen(ext_order) - 1);
}

static void pre_fini_n(void *ext)
{
    char s[3] = {'p', (char)('0' + *(int *)ext), 0};
    ext_note(s);
}

static void fini_n(void *ext)
{
    char s[3] = {'f', (char)('0' + *(int *)ext), 0};
    ext_note(s);
}

static void test_ext_order(void **state)
{
    uint64_t live = live_small();
    tdp_loop *loop = new_loop(0);
    static int keys[TDP__EXT_COUNT] = {TDP__EXT_UCX, TDP__EXT_PIPE, TDP__EXT_SHM};

    ext_order[0] = '\0';
    assert_null(tdp__loop_ext(loop, TDP__EXT_PIPE));
    assert_null(tdp__loop_ext(loop, -1));
    assert_null(tdp__loop_ext(loop, TDP__EXT_COUNT));
    tdp__loop_set_ext(loop, TDP__EXT_PIPE, &keys[1], pre_fini_n, fini_n);
    tdp__loop_set_ext(loop, TDP__EXT_UCX, &keys[0], pre_fini_n, fini_n);
    tdp__loop_set_ext(loop, TDP__EXT_SHM, &keys[2], NULL, fini_n);
    assert_ptr_equal(tdp__loop_ext(loop, TDP__EXT_UCX), &keys[0]);
    assert_ptr_equal(tdp__loop_ext(loop, TDP__EXT_SHM), &keys[2]);
    tdp_loop_free(loop);
    assert_string_equal(ext_order, "p1p0f2f1f0");
    assert_int_equal(live_small(), live);
}

/* ---- UCX wakeups ------------------------------------------------------------ */

#define AM_ID    7
#define N_MSGS   1000
#define PER_TASK 10

typedef struct am_test {
    tdp_loop *tx, *rx; /* the same loop for the self test */
    bool peer;         /* endpoint with peer error handling (closed by force) */
    ucp_address_t *addr;
    size_t addr_len;
    ucp_ep_h ep;
    uint32_t payload[N_MSGS]; /* stays put until each send completes */
    int next_send;            /* tx loop thread only */
    atomic_int sent, send_failed, received, bad, ep_errors, seen[N_MSGS];
    ucs_status_t status;
} am_test;

static am_test amt;

static ucs_status_t am_recv(void *arg, const void *header, size_t header_length, void *data,
                            size_t length, const ucp_am_recv_param_t *param)
{
    am_test *a = arg;
    uint32_t v;

    if (!tdp_loop_on_thread(a->rx) || length != sizeof(v) ||
        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        atomic_fetch_add(&a->bad, 1);
        return UCS_OK;
    }
    memcpy(&v, data, sizeof(v));
    if (v >= N_MSGS || atomic_fetch_add(&a->seen[v], 1) != 0)
        atomic_fetch_add(&a->bad, 1);
    atomic_fetch_add(&a->received, 1);
    return UCS_OK;
}

/* This test makes its own endpoints: the workers are in use throughout. */
static bool always_in_use(void *arg)
{
    (void)arg;
    return true;
}

static void rx_setup(void *arg)
{
    am_test *a = arg;
    tdp__ucx *u;
    if (tdp__ucx_get(a->rx, &u) != TDP_OK) {
        a->status = UCS_ERR_NO_RESOURCE;
        return;
    }
    u->in_use = always_in_use;
    ucp_worker_h w = u->worker[TDP_WORKER_ANY];
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = AM_ID,
        .cb = am_recv,
        .arg = a,
    };
    a->status = ucp_worker_set_am_recv_handler(w, &hp);
    if (a->status == UCS_OK)
        a->status = ucp_worker_get_address(w, &a->addr, &a->addr_len);
}

static void rx_release_addr(void *arg)
{
    am_test *a = arg;
    ucp_worker_release_address(tdp__ucx_peek(a->rx)->worker[TDP_WORKER_ANY], a->addr);
    a->addr = NULL;
}

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    am_test *a = arg;
    atomic_fetch_add(&a->ep_errors, 1);
}

static void tx_connect(void *arg)
{
    am_test *a = arg;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
        .address = a->addr,
    };
    if (a->peer) {
        /* UCP_EP_CLOSE_FLAG_FORCE refuses endpoints without it */
        ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
        ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        ep.err_handler = (ucp_err_handler_t){.cb = ep_error, .arg = a};
    }
    tdp__ucx *u;
    if (tdp__ucx_get(a->tx, &u) != TDP_OK) {
        a->status = UCS_ERR_NO_RESOURCE;
        return;
    }
    u->in_use = always_in_use;
    a->status = ucp_ep_create(u->worker[TDP_WORKER_ANY], &ep, &a->ep);
    tdp__loop_kick(a->tx); /* wireup may have queued work */
}

static void send_done(void *request, ucs_status_t status, void *user_data)
{
    am_test *a = user_data;
    atomic_fetch_add(status == UCS_OK ? &a->sent : &a->send_failed, 1);
    ucp_request_free(request);
}

static void send_task(void *arg)
{
    am_test *a = arg;
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = send_done,
        .user_data = a,
    };

    for (int i = 0; i < PER_TASK && a->next_send < N_MSGS; i++) {
        int k = a->next_send++;
        a->payload[k] = (uint32_t)k;
        ucs_status_ptr_t r =
            ucp_am_send_nbx(a->ep, AM_ID, NULL, 0, &a->payload[k], sizeof(uint32_t), &rp);
        if (r == NULL)
            atomic_fetch_add(&a->sent, 1);
        else if (UCS_PTR_IS_ERR(r))
            atomic_fetch_add(&a->send_failed, 1);
    }
    /* the sends progressed the worker after it was armed: re-check before sleeping */
    tdp__loop_kick(a->tx);
}

static void tx_close(void *arg)
{
    am_test *a = arg;
    ucp_worker_h w = tdp__ucx_peek(a->tx)->worker[TDP_WORKER_ANY];
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
        .flags = a->peer ? UCP_EP_CLOSE_FLAG_FORCE : 0, /* else flush: the peer is alive */
    };
    ucs_status_ptr_t r = ucp_ep_close_nbx(a->ep, &rp);
    a->status = UCS_OK;
    if (UCS_PTR_IS_ERR(r)) {
        a->status = UCS_PTR_STATUS(r);
    } else if (r != NULL) {
        int64_t end = now_ms() + 5000;
        while ((a->status = ucp_request_check_status(r)) == UCS_INPROGRESS && now_ms() < end)
            ucp_worker_progress(w);
        ucp_request_free(r);
    }
    a->ep = NULL;
    tdp__loop_kick(a->tx);
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
           ((double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_usec) / 1e6;
}

/* Start the loops, register the handler, connect; a->status tells how it went. */
static void am_begin(am_test *a, bool two_loops, bool peer)
{
    /*
     * With peer error handling UCX picks a transport whose wakeups work and
     * the safety timers are an hour long: messages can then only move
     * through worker fd wakeups and kicks. Without it, see am_case.
     */
    uint32_t safety = peer ? HOUR_MS : 0;

    memset(a, 0, sizeof(*a));
    a->peer = peer;
    a->tx = new_loop(safety);
    a->rx = two_loops ? new_loop(safety) : a->tx;
    assert_int_equal(tdp_loop_start_thread(a->tx), TDP_OK);
    if (a->rx != a->tx)
        assert_int_equal(tdp_loop_start_thread(a->rx), TDP_OK);
    call_on_loop(a->rx, rx_setup, a);
    assert_int_equal(a->status, UCS_OK);
    call_on_loop(a->tx, tx_connect, a);
    call_on_loop(a->rx, rx_release_addr, a);
}

static void am_end(am_test *a)
{
    if (a->rx != a->tx)
        tdp_loop_free(a->rx);
    tdp_loop_free(a->tx);
    a->tx = a->rx = NULL;
}

/* N small AMs from tx loop tasks; the test thread only sleeps while they fly. */
static void am_traffic(am_test *a)
{
    for (int i = 0; i < N_MSGS / PER_TASK; i++)
        assert_int_equal(tdp_loop_post(a->tx, send_task, a), TDP_OK);
    assert_true(wait_for(&a->received, N_MSGS, 20000));
    assert_true(wait_for(&a->sent, N_MSGS, 5000));
    assert_int_equal(atomic_load(&a->send_failed), 0);
    assert_int_equal(atomic_load(&a->bad), 0);
    assert_int_equal(atomic_load(&a->ep_errors), 0);
    for (int i = 0; i < N_MSGS; i++)
        assert_int_equal(atomic_load(&a->seen[i]), 1);

    /* idle with a live endpoint: the loops sleep, they do not spin */
    sleep_ms(50);
    int64_t w0 = now_ms();
    double c0 = cpu_s();
    sleep_ms(300);
    double cpu = cpu_s() - c0;
    double wall = (double)(now_ms() - w0) / 1000.0;
    print_message("idle: cpu %.3f s over %.3f s wall\n", cpu, wall);
    assert_true(cpu < wall * 0.2);

    call_on_loop(a->tx, tx_close, a);
    assert_int_equal(a->status, UCS_OK);
}

static void am_case(bool two_loops)
{
    uint64_t live = live_small();
    am_test *a = &amt;

    am_begin(a, two_loops, true);
    if (a->status == UCS_ERR_UNREACHABLE) {
        /*
         * UCX_TLS names no transport with peer failure handling (UCX 1.13's
         * self and shared-memory transports have none). Shared memory can
         * also lose a wakeup in UCX 1.13 (two workers in one process, both
         * armed, messages left in the FIFO): with the default safety timer
         * this run also checks that the timer carries the loop past that.
         */
        print_message("no transport with peer error handling: default safety timer\n");
        am_end(a);
        am_begin(a, two_loops, false);
    }
    assert_int_equal(a->status, UCS_OK);
    am_traffic(a);
    am_end(a);
    assert_int_equal(live_small(), live);
}

static void test_ucx_self(void **state)
{
    am_case(false);
}

static void test_ucx_two_loops(void **state)
{
    am_case(true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_new_free),
        cmocka_unit_test(test_misuse),
        cmocka_unit_test(test_free_drops_pending),
        cmocka_unit_test(test_stop_before_run),
        cmocka_unit_test(test_stop_race),
        cmocka_unit_test(test_post_many),
        cmocka_unit_test(test_post_from_loop),
        cmocka_unit_test(test_run_until),
        cmocka_unit_test(test_run_until_busy_poll),
        cmocka_unit_test(test_hold),
        cmocka_unit_test(test_source_fd),
        cmocka_unit_test(test_source_arm_busy),
        cmocka_unit_test(test_source_arm_error),
        cmocka_unit_test(test_source_no_fd),
        cmocka_unit_test(test_source_busy_poll),
        cmocka_unit_test(test_source_remove_in_progress),
        cmocka_unit_test(test_ext_order),
        cmocka_unit_test(test_idle),
        cmocka_unit_test(test_idle_then_arm),
        cmocka_unit_test(test_ucx_self),
        cmocka_unit_test(test_ucx_two_loops),
    };
    /* TDP_TEST_FILTER=test_ucx* runs a subset while debugging */
    if (getenv("TDP_TEST_FILTER") != NULL)
        cmocka_set_test_filter(getenv("TDP_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
