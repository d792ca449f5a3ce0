/*
 * loop.c: one libevent event_base driving progress sources (a UCP worker, a
 * shared-memory ring: whatever the layers above add), plus a task queue
 * other threads use to hand work to the loop thread.
 *
 * How sources are driven: each one's event fd is a level-triggered EV_READ
 * event; every wakeup drains all sources (bounded) and re-arms them. Anything
 * that must progress "soon" (a bounded drain that had more work, a kick after
 * a send, a task posted from the loop thread) is a zero-timeout timer rather
 * than event_active: libevent runs an event activated from a callback in the
 * same pass over the active queue, so a drain that keeps rescheduling itself
 * would never let the loop poll fds or fire timers (the safety timer and the
 * run_until deadline included), and EVLOOP_ONCE would never return. A
 * zero-timeout timer fires only after the next poll (with a zero timeout),
 * so everything else gets its turn first.
 */
#include "loop_int.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include <event2/thread.h>

#include "alloc.h"
#include "log.h"

#define DEFAULT_MAX_PROGRESS    64
#define DEFAULT_SAFETY_TIMER_MS 10

struct tdp__source {
    const tdp__source_ops *ops;
    void *arg;
    struct event *ev; /* its fd readable; NULL without an fd */
    bool dead;        /* removed during a walk: unlinked when the walk ends */
    bool unwatched;   /* ev left out of the event base (tdp__loop_source_watch) */
    bool arm_error_logged;
    struct tdp__source *next;
};

typedef struct ext_slot {
    void *ext;
    void (*pre_fini)(void *ext);
    void (*fini)(void *ext);
} ext_slot;

struct tdp_loop {
    struct event_base *base;
    struct event *ev_again;    /* zero-timeout timer: progress the sources again */
    struct event *ev_safety;   /* slow persistent timer against a lost wakeup */
    struct event *ev_tasks;    /* drain the task queue */
    struct event *ev_stop;     /* turns a stop request into a loopbreak on the loop thread */
    struct event *ev_deadline; /* run_until's deadline */

    /*
     * Loop thread only. walking counts the walks over the list in progress:
     * a source removed meanwhile (from inside a progress or arm callback) is
     * only marked dead and unlinked when the last walk ends, so no walk
     * steps onto freed memory.
     */
    tdp__source *sources;
    unsigned walking;
    bool has_dead;

    ext_slot ext[TDP__EXT_COUNT]; /* see tdp__loop_set_ext */

    uint32_t max_progress;
    uint32_t safety_timer_ms;
    uint32_t busy_poll_us;
    uint64_t last_activity_ns; /* last progress that did something (busy poll) */

    /* Loop thread only (or whoever drives the loop while nobody else does). */
    bool again_pending;
    bool deadline_hit;
    volatile bool *until_done; /* run_until's flag while it runs, else NULL */
    tdp__idle *idle_head;      /* tdp__loop_idle_add: run before the loop sleeps */
    tdp__idle *idle_run;       /* the ones run_idle is running now */
    bool idle_running;         /* inside run_idle */

    /* lock guards everything below; holder is also read without it. */
    pthread_mutex_t lock;
    pthread_cond_t idle; /* signalled when holder drops to HOLD_NONE */
    tdp__task *head, *tail;
    bool stop_requested; /* consumed by the run it ends, or by the next run */
    bool has_thread;     /* thread must be joined */
    pthread_t thread;
    _Atomic int holder; /* enum hold: who owns the loop now (acquire / release) */
    _Atomic int idle_waiters; /* threads waiting on idle for holder to change */
};

/*
 * Who holds the loop. Only the holder touches what belongs to the loop
 * thread (sources, timers, every pipe's state); the kind tells the others
 * whether a posted task will run: a loop run until stopped runs it, a
 * blocking call driving the loop runs it only until its own call is done,
 * and an inline hold lasts one internal function.
 */
enum hold {
    HOLD_NONE,
    HOLD_RUN,    /* tdp_loop_run or the loop thread: until tdp_loop_stop */
    HOLD_UNTIL,  /* tdp__loop_run_until: a blocking call drives it until done */
    HOLD_INLINE, /* tdp__loop_run_inline: one call on an idle loop */
};

/*
 * The loops this thread is running now, innermost first. A frame lives on
 * the stack of run / run_until / the loop thread, so tdp_loop_on_thread
 * needs no lock and no pthread_t comparison racing with another thread's
 * write; nesting (run_until of one loop inside a callback of another) works.
 */
typedef struct run_frame {
    const tdp_loop *loop;
    struct run_frame *prev;
} run_frame;

static _Thread_local run_frame *tls_frames;

static void frame_push(run_frame *f, const tdp_loop *loop)
{
    f->loop = loop;
    f->prev = tls_frames;
    tls_frames = f;
}

static void frame_pop(run_frame *f)
{
    tls_frames = f->prev;
}

/* ---- threading setup ----------------------------------------------------- */

static pthread_once_t threads_once = PTHREAD_ONCE_INIT;
static int threads_rc;

static void threads_init(void)
{
    /* must precede every event_base: bases made before it get no lock */
    threads_rc = evthread_use_pthreads();
}

/* ---- sources ----------------------------------------------------------------- */

static void schedule_again(tdp_loop *loop)
{
    static const struct timeval zero = {0, 0};

    if (loop->again_pending)
        return;
    if (event_add(loop->ev_again, &zero) == 0)
        loop->again_pending = true;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Unlink and free the sources removed while a walk was in progress. */
static void sweep(tdp_loop *loop)
{
    tdp__source **pp = &loop->sources;

    while (*pp != NULL) {
        tdp__source *s = *pp;
        if (s->dead) {
            *pp = s->next;
            tdp__free(s);
        } else {
            pp = &s->next;
        }
    }
    loop->has_dead = false;
}

static void walk_end(tdp_loop *loop)
{
    if (--loop->walking == 0 && loop->has_dead)
        sweep(loop);
}

static unsigned progress_all(tdp_loop *loop)
{
    unsigned n = 0;

    loop->walking++;
    for (tdp__source *s = loop->sources; s != NULL; s = s->next)
        if (!s->dead)
            n += s->ops->progress(s->arg);
    walk_end(loop);
    return n;
}

/*
 * Arm every source; 1 (busy) as soon as one has events waiting. A source
 * that fails to arm is logged once and left to the safety timer: retrying
 * now would spin, and the other sources still get armed.
 */
static int arm_all(tdp_loop *loop)
{
    int rc = 0;

    loop->walking++;
    for (tdp__source *s = loop->sources; s != NULL; s = s->next) {
        if (s->dead || s->ops->arm == NULL)
            continue;
        int r = s->ops->arm(s->arg);
        if (r > 0) {
            rc = 1;
            break;
        }
        if (r < 0 && !s->arm_error_logged) {
            tdp_log_error("a loop source failed to arm (%d); the safety timer progresses it", r);
            s->arm_error_logged = true;
        }
    }
    walk_end(loop);
    return rc;
}

void tdp__loop_idle_add(tdp_loop *loop, tdp__idle *h)
{
    if (h->queued)
        return;
    h->queued = true;
    h->next = loop->idle_head;
    loop->idle_head = h;
    /* queued from a task or a socket callback, no drain may follow before the
     * loop sleeps: one turn of it, which runs h before sleeping. Not from
     * run_idle itself: a fn that queues itself again waits for the next sleep */
    if (!loop->idle_running)
        schedule_again(loop);
}

static bool idle_unlink(tdp__idle **list, tdp__idle *h)
{
    for (tdp__idle **pp = list; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == h) {
            *pp = h->next;
            return true;
        }
    }
    return false;
}

void tdp__loop_idle_cancel(tdp_loop *loop, tdp__idle *h)
{
    if (!h->queued)
        return;
    /* queued, or still waiting its turn in a run_idle going on (a fn may cancel another) */
    if (!idle_unlink(&loop->idle_head, h))
        (void)idle_unlink(&loop->idle_run, h);
    h->queued = false;
    h->next = NULL;
}

/*
 * The loop is about to sleep: what waited for that runs now, one at a
 * time off idle_run (which cancel also searches). What a fn queues goes on
 * idle_head, for the next sleep. True when one of them did work that the
 * sources must progress first.
 */
static bool run_idle(tdp_loop *loop)
{
    bool acted = false;
    loop->idle_run = loop->idle_head;
    loop->idle_head = NULL;
    loop->idle_running = true;
    while (loop->idle_run != NULL) {
        tdp__idle *h = loop->idle_run;
        loop->idle_run = h->next;
        h->queued = false;
        h->next = NULL;
        if (h->fn(h->arg))
            acted = true;
    }
    loop->idle_running = false;
    return acted;
}

/*
 * Progress the sources, then arm them so their fds wake us. The whole drain
 * costs at most max_progress rounds of progress calls; past that the rest
 * waits for the again timer so other events get a turn. A busy arm means
 * events arrived since the last progress: progress them before sleeping.
 */
static void drain(tdp_loop *loop)
{
    uint32_t budget = loop->max_progress;
    bool active = false, idled = false;

    for (;;) {
        while (budget > 0) {
            budget--;
            if (progress_all(loop) == 0)
                break;
            active = true;
        }
        if (budget == 0) {
            schedule_again(loop);
            break;
        }
        /* a blocking call's work is done: it returns, and whoever drives the
         * loop next progresses and arms the sources before sleeping (a kick) */
        if (loop->until_done != NULL && *loop->until_done)
            break;
        if (loop->busy_poll_us > 0) {
            /* busy-poll window: keep progressing instead of sleeping for a
             * while after the last activity, trading CPU for wakeup latency */
            uint64_t now = mono_ns();
            if (active)
                loop->last_activity_ns = now;
            if (now - loop->last_activity_ns < (uint64_t)loop->busy_poll_us * 1000u) {
                /* awake, so what waits for a sleep runs now (credit a
                 * stopped peer needs: it looks whether it is) */
                if (loop->idle_head != NULL)
                    run_idle(loop);
                schedule_again(loop);
                break;
            }
        }
        /* about to sleep; once per drain: what it queues again waits for the next sleep */
        if (!idled && loop->idle_head != NULL) {
            idled = true;
            if (run_idle(loop))
                continue; /* what it did needs progress before the loop sleeps */
        }
        if (arm_all(loop) == 0)
            break;
    }
    if (loop->until_done != NULL && *loop->until_done)
        event_base_loopbreak(loop->base);
}

static void efd_cb(evutil_socket_t fd, short what, void *arg)
{
    drain(arg);
}

static void again_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_loop *loop = arg;

    loop->again_pending = false;
    drain(loop);
}

static void safety_cb(evutil_socket_t fd, short what, void *arg)
{
    drain(arg);
}

void tdp__loop_kick(tdp_loop *loop)
{
    schedule_again(loop);
}

tdp_err tdp__loop_source_add(tdp_loop *loop, int fd, const tdp__source_ops *ops, void *arg,
                             tdp__source **out)
{
    if (loop == NULL || ops == NULL || ops->progress == NULL || out == NULL)
        return TDP_EINVAL;
    tdp__source *s = tdp__calloc(1, sizeof(*s));
    if (s == NULL)
        return TDP_ENOMEM;
    s->ops = ops;
    s->arg = arg;
    if (fd >= 0) {
        s->ev = event_new(loop->base, fd, EV_READ | EV_PERSIST, efd_cb, loop);
        if (s->ev == NULL || event_add(s->ev, NULL) != 0) {
            tdp_log_error("cannot watch a loop source's fd %d", fd);
            if (s->ev != NULL)
                event_free(s->ev);
            tdp__free(s);
            return TDP_ENOMEM;
        }
    }
    /*
     * At the tail: sources are progressed and armed in the order they were
     * added, which is the order their owner chose (the UCX workers: general
     * first, same-host second; the other way round doubles UCX's wake-up
     * signals). A walk in progress may visit it; progressing or arming a
     * new source early is harmless, and the kick below covers the rest.
     */
    tdp__source **tail = &loop->sources;
    while (*tail != NULL)
        tail = &(*tail)->next;
    s->next = NULL;
    *tail = s;
    /* its fd wakes the loop only once armed: progress and arm it before sleeping */
    schedule_again(loop);
    *out = s;
    return TDP_OK;
}

void tdp__loop_source_remove(tdp_loop *loop, tdp__source *s)
{
    if (loop == NULL || s == NULL)
        return;
    /* at once, even inside its own callback: the caller may close the fd next */
    if (s->ev != NULL)
        event_free(s->ev);
    s->ev = NULL;
    if (loop->walking > 0) {
        s->dead = true;
        loop->has_dead = true;
        return;
    }
    for (tdp__source **pp = &loop->sources; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    }
    tdp__free(s);
}

void tdp__loop_source_watch(tdp__source *s, bool on)
{
    if (s == NULL || s->ev == NULL || s->unwatched == !on)
        return;
    if (on ? event_add(s->ev, NULL) : event_del(s->ev)) {
        tdp_log_error("cannot %s a loop source's fd", on ? "watch" : "stop watching");
        return; /* as it was: watched too long is a wasted wakeup, not a lost one */
    }
    s->unwatched = !on;
}

/* Forget every source (loop free): their owners' fini already let them go. */
static void sources_drop(tdp_loop *loop)
{
    while (loop->sources != NULL) {
        tdp__source *s = loop->sources;
        loop->sources = s->next;
        if (s->ev != NULL)
            event_free(s->ev);
        tdp__free(s);
    }
}

/* ---- tasks ----------------------------------------------------------------- */

static void tasks_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_loop *loop = arg;

    /* take the whole batch: what is posted while it runs waits for a later turn */
    pthread_mutex_lock(&loop->lock);
    tdp__task *t = loop->head;
    loop->head = loop->tail = NULL;
    pthread_mutex_unlock(&loop->lock);

    while (t != NULL) {
        tdp__task *next = t->next; /* fn may free or re-post t */
        t->fn(t->arg);
        t = next;
    }
    if (loop->until_done != NULL && *loop->until_done)
        event_base_loopbreak(loop->base);
}

static bool on_thread(const tdp_loop *loop)
{
    for (run_frame *f = tls_frames; f != NULL; f = f->prev)
        if (f->loop == loop)
            return true;
    return false;
}

void tdp__loop_unpost_task(tdp_loop *loop, tdp__task *t)
{
    pthread_mutex_lock(&loop->lock);
    tdp__task *prev = NULL;
    for (tdp__task *x = loop->head; x != NULL; prev = x, x = x->next) {
        if (x != t)
            continue;
        if (prev != NULL)
            prev->next = x->next;
        else
            loop->head = x->next;
        if (loop->tail == x)
            loop->tail = prev;
        x->next = NULL;
        break;
    }
    pthread_mutex_unlock(&loop->lock);
}

void tdp__loop_post_task(tdp_loop *loop, tdp__task *t)
{
    static const struct timeval zero = {0, 0};
    bool wake;

    t->next = NULL;
    pthread_mutex_lock(&loop->lock);
    /* one wakeup per batch: a non-empty queue already has one on its way */
    wake = loop->head == NULL;
    if (loop->tail != NULL)
        loop->tail->next = t;
    else
        loop->head = t;
    loop->tail = t;
    pthread_mutex_unlock(&loop->lock);

    if (!wake)
        return;
    /*
     * From another thread, event_active: thread-safe once evthread is on,
     * and it wakes a sleeping loop through libevent's own notification fd,
     * so no eventfd of ours is needed. From the loop thread, a zero timer,
     * so a task that re-posts itself cannot keep the loop from polling.
     */
    if (on_thread(loop))
        event_add(loop->ev_tasks, &zero);
    else
        event_active(loop->ev_tasks, 0, 0);
}

/* A tdp_loop_post task: the wrapper is freed before fn runs, so fn may do anything. */
typedef struct posted {
    tdp__task task; /* first: free_pending recognises wrappers by task.fn */
    tdp_loop_fn fn;
    void *arg;
} posted;

static void posted_run(void *arg)
{
    posted *p = arg;
    tdp_loop_fn fn = p->fn;
    void *fn_arg = p->arg;

    tdp__free(p);
    fn(fn_arg);
}

tdp_err tdp_loop_post(tdp_loop *loop, tdp_loop_fn fn, void *arg)
{
    if (loop == NULL || fn == NULL)
        return TDP_EINVAL;
    posted *p = tdp__malloc(sizeof(*p));
    if (p == NULL)
        return TDP_ENOMEM;
    p->fn = fn;
    p->arg = arg;
    p->task.fn = posted_run;
    p->task.arg = p;
    tdp__loop_post_task(loop, &p->task);
    return TDP_OK;
}

/*
 * Tasks still queued when the loop is freed are dropped without running:
 * running them after the loop stopped would surprise their owners more than
 * not running them. Our own wrappers are freed; an intrusive task belongs to
 * its owner, which must be gone already.
 */
static void free_pending(tdp_loop *loop)
{
    tdp__task *t = loop->head;

    loop->head = loop->tail = NULL;
    while (t != NULL) {
        tdp__task *next = t->next;
        if (t->fn == posted_run)
            tdp__free(t->arg);
        t = next;
    }
}

/* ---- running ----------------------------------------------------------------- */

static void stop_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_loop *loop = arg;
    bool stop;

    /* a stale activation after the request was consumed must not stop the next run */
    pthread_mutex_lock(&loop->lock);
    stop = loop->stop_requested;
    pthread_mutex_unlock(&loop->lock);
    if (stop)
        event_base_loopbreak(loop->base);
}

void tdp_loop_stop(tdp_loop *loop)
{
    if (loop == NULL)
        return;
    pthread_mutex_lock(&loop->lock);
    loop->stop_requested = true;
    pthread_mutex_unlock(&loop->lock);
    /*
     * Not event_base_loopbreak here: event_base_loop clears the break flag
     * when it starts, so a stop between "run decided to loop" and "loop
     * started" would be lost. An active event survives until the loop
     * processes it, and the flag covers a loop that is not running at all.
     */
    event_active(loop->ev_stop, 0, 0);
}

/*
 * Taking and giving back the loop is lock-free when nobody waits: a blocking
 * call takes it and gives it back for each operation, so the common case
 * must cost one atomic each way. Whoever must wait for the holder to go
 * (an inline hold being waited out, tdp_loop_free) counts itself in
 * idle_waiters under lock before it looks at holder again; release stores
 * HOLD_NONE before it reads idle_waiters. Both are sequentially consistent,
 * so either the waiter sees HOLD_NONE or release sees the waiter and
 * signals idle under the lock (which the waiter holds until it sleeps).
 */
static void idle_wait_begin(tdp_loop *loop) /* lock held */
{
    atomic_fetch_add(&loop->idle_waiters, 1);
}

static void idle_wait_end(tdp_loop *loop) /* lock held */
{
    atomic_fetch_sub(&loop->idle_waiters, 1);
}

/*
 * Take the loop for the calling thread as kind; false if someone holds it.
 * An inline hold ends within one internal call: it is waited out rather
 * than failed, except when this thread holds a loop itself: a thread
 * holding a loop never waits for another one's, so two threads can never
 * wait for each other.
 */
static bool acquire(tdp_loop *loop, enum hold kind)
{
    int seen = HOLD_NONE;
    if (atomic_compare_exchange_strong(&loop->holder, &seen, kind))
        return true;
    if (seen != HOLD_INLINE || tls_frames != NULL)
        return false;
    bool ok;
    pthread_mutex_lock(&loop->lock);
    idle_wait_begin(loop);
    for (;;) {
        seen = HOLD_NONE;
        if (atomic_compare_exchange_strong(&loop->holder, &seen, kind)) {
            ok = true;
            break;
        }
        if (seen != HOLD_INLINE) {
            ok = false;
            break;
        }
        pthread_cond_wait(&loop->idle, &loop->lock);
    }
    idle_wait_end(loop);
    pthread_mutex_unlock(&loop->lock);
    return ok;
}

static void release(tdp_loop *loop)
{
    atomic_store(&loop->holder, HOLD_NONE);
    if (atomic_load(&loop->idle_waiters) == 0)
        return;
    pthread_mutex_lock(&loop->lock);
    pthread_cond_broadcast(&loop->idle);
    pthread_mutex_unlock(&loop->lock);
}

/* Run until a stop request, and consume it. The caller holds the loop. */
static tdp_err run_loop(tdp_loop *loop)
{
    run_frame frame;
    tdp_err rc = TDP_OK;

    frame_push(&frame, loop);
    tdp__loop_kick(loop); /* sources must be armed before their fds can wake us */
    for (;;) {
        pthread_mutex_lock(&loop->lock);
        bool stop = loop->stop_requested;
        loop->stop_requested = false;
        pthread_mutex_unlock(&loop->lock);
        if (stop)
            break;
        /* returns on our loopbreak, and also on one by anybody else: recheck */
        if (event_base_loop(loop->base, EVLOOP_NO_EXIT_ON_EMPTY) < 0) {
            tdp_log_error("event_base_loop failed");
            rc = TDP_EINTERNAL;
            break;
        }
    }
    frame_pop(&frame);
    return rc;
}

tdp_err tdp_loop_run(tdp_loop *loop)
{
    if (loop == NULL || !acquire(loop, HOLD_RUN))
        return TDP_EINVAL;
    tdp_err rc = run_loop(loop);
    release(loop);
    return rc;
}

static void *thread_main(void *arg)
{
    tdp_loop *loop = arg;

    (void)run_loop(loop); /* logged where it failed; tdp_loop_free joins */
    release(loop);
    return NULL;
}

tdp_err tdp_loop_start_thread(tdp_loop *loop)
{
    tdp_err rc = TDP_OK;

    if (loop == NULL)
        return TDP_EINVAL;
    /* held before the thread exists, so run / run_until cannot slip in */
    if (!acquire(loop, HOLD_RUN))
        return TDP_EINVAL;
    /*
     * A previous loop thread was stopped and has let the loop go: reap it,
     * without the lock (its release may still take it to signal a waiter).
     */
    pthread_mutex_lock(&loop->lock);
    bool reap = loop->has_thread;
    pthread_t old = loop->thread;
    loop->has_thread = false;
    pthread_mutex_unlock(&loop->lock);
    if (reap)
        pthread_join(old, NULL);
    pthread_t t;
    int err = pthread_create(&t, NULL, thread_main, loop);
    if (err == 0) {
        pthread_mutex_lock(&loop->lock);
        loop->thread = t;
        loop->has_thread = true;
        pthread_mutex_unlock(&loop->lock);
    }
    if (err != 0) {
        tdp_log_error("pthread_create: %s", strerror(err));
        release(loop);
        rc = err == EAGAIN ? TDP_ENOMEM : TDP_EINTERNAL;
    }
    return rc;
}

static void deadline_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_loop *loop = arg;

    loop->deadline_hit = true;
    event_base_loopbreak(loop->base);
}

/*
 * Busy-poll fast path of run_until: progress the sources directly, without
 * a trip through libevent per iteration (an epoll_wait and a timer each),
 * and give libevent a non-blocking turn every few spins so sockets, timers
 * and posted tasks still run. Ends when done, at the deadline, or after the
 * busy-poll window passes with nothing to do.
 */
static void spin(tdp_loop *loop, volatile bool *done, uint64_t t0, uint64_t deadline_ns)
{
    uint64_t window = (uint64_t)loop->busy_poll_us * 1000u;
    uint64_t last = t0;
    unsigned n = 0;

    while (!*done) {
        if (progress_all(loop) != 0) {
            last = 0; /* refreshed below, on the next libevent turn */
            continue;
        }
        if (++n % 256 != 0)
            continue;
        /* nothing to do for a while, though the window keeps the loop awake:
         * what waits for a sleep runs now (credit a stopped peer needs) */
        if (loop->idle_head != NULL)
            run_idle(loop);
        if (event_base_loop(loop->base, EVLOOP_NONBLOCK) != 0)
            return;
        uint64_t now = mono_ns();
        if (deadline_ns != 0 && now >= deadline_ns)
            return; /* run_until's timer says so too, on its next turn */
        if (last == 0) {
            last = now;
        } else if (now - last > window) {
            /* idle for a whole window: arm the sources and sleep on their fds */
            loop->last_activity_ns = 0;
            drain(loop);
            return;
        }
    }
}

tdp_err tdp__loop_run_until(tdp_loop *loop, volatile bool *done, int64_t timeout_ms)
{
    return tdp__loop_run_after(loop, NULL, NULL, done, timeout_ms);
}

tdp_err tdp__loop_run_after(tdp_loop *loop, tdp_loop_fn fn, void *arg, volatile bool *done,
                            int64_t timeout_ms)
{
    run_frame frame;
    tdp_err rc = TDP_OK;

    if (loop == NULL || done == NULL)
        return TDP_EINVAL;
    if (!acquire(loop, HOLD_UNTIL))
        return TDP_EINVAL;
    frame_push(&frame, loop);
    if (fn != NULL)
        fn(arg);
    /* read only now: the flag is set by whoever held the loop before us */
    if (*done)
        goto out_release;
    loop->until_done = done;
    loop->deadline_hit = false;
    /*
     * Progress first, without a libevent turn: work already waiting in a
     * source (a message UCX holds) completes here with no poll of the fds
     * before it; otherwise the sources are armed and the loop can sleep.
     */
    if (loop->again_pending) { /* this is that turn */
        event_del(loop->ev_again);
        loop->again_pending = false;
    }
    drain(loop);
    if (*done)
        goto out_release;
    if (loop->busy_poll_us > 0) {
        /* the fast path first: no timer, no libevent turn per iteration */
        uint64_t t0 = mono_ns();
        spin(loop, done, t0, timeout_ms >= 0 ? t0 + (uint64_t)timeout_ms * 1000000u : 0);
        if (*done)
            goto out_release;
        if (timeout_ms >= 0) { /* what is left of the deadline for the slow path */
            int64_t spent = (int64_t)((mono_ns() - t0) / 1000000u);
            if (spent >= timeout_ms) {
                rc = TDP_ETIMEDOUT;
                goto out_release;
            }
            timeout_ms -= spent;
        }
    }
    if (timeout_ms >= 0) {
        struct timeval tv = {.tv_sec = (time_t)(timeout_ms / 1000),
                             .tv_usec = (suseconds_t)((timeout_ms % 1000) * 1000)};
        if (event_add(loop->ev_deadline, &tv) != 0) {
            tdp_log_error("run_until: cannot add the deadline timer");
            rc = TDP_EINTERNAL;
            goto out_release;
        }
    }
    /*
     * The drain above armed the sources (or scheduled another turn).
     * EVLOOP_ONCE sleeps until something happens and returns after running
     * what did; callbacks of ours that see *done break out early, the
     * deadline timer bounds the sleep.
     */
    while (!*done && !loop->deadline_hit) {
        if (event_base_loop(loop->base, EVLOOP_ONCE) != 0) {
            tdp_log_error("event_base_loop failed");
            rc = TDP_EINTERNAL;
            break;
        }
    }
    event_del(loop->ev_deadline);
    if (rc == TDP_OK && !*done)
        rc = TDP_ETIMEDOUT;
out_release:
    loop->until_done = NULL;
    frame_pop(&frame);
    release(loop);
    return rc;
}

bool tdp_loop_on_thread(const tdp_loop *loop)
{
    return loop != NULL && on_thread(loop);
}

bool tdp__loop_running(const tdp_loop *loop)
{
    return loop != NULL && atomic_load(&((tdp_loop *)loop)->holder) != HOLD_NONE;
}

bool tdp__loop_has_runner(const tdp_loop *loop)
{
    return loop != NULL && atomic_load(&((tdp_loop *)loop)->holder) == HOLD_RUN;
}

bool tdp__loop_run_inline(tdp_loop *loop, tdp_loop_fn fn, void *arg)
{
    run_frame frame;

    if (on_thread(loop)) {
        fn(arg);
        return true;
    }
    if (!acquire(loop, HOLD_INLINE))
        return false;
    frame_push(&frame, loop);
    fn(arg);
    frame_pop(&frame);
    release(loop);
    return true;
}

/* ---- create and free ------------------------------------------------------- */

static void opts_resolve(const tdp_loop_opts *in, tdp_loop *loop)
{
    loop->max_progress = DEFAULT_MAX_PROGRESS;
    loop->safety_timer_ms = DEFAULT_SAFETY_TIMER_MS;
    if (in == NULL)
        return;
    size_t n = in->size < sizeof(*in) ? in->size : sizeof(*in);
#define TAKE(f)                                                                                    \
    if (offsetof(tdp_loop_opts, f) + sizeof(in->f) <= n && in->f != 0)                             \
        loop->f = in->f;
    TAKE(max_progress)
    TAKE(safety_timer_ms)
    TAKE(busy_poll_us)
#undef TAKE
}

static void events_free(tdp_loop *loop)
{
    struct event **evs[] = {&loop->ev_again, &loop->ev_safety, &loop->ev_tasks, &loop->ev_stop,
                            &loop->ev_deadline};

    for (size_t i = 0; i < sizeof(evs) / sizeof(evs[0]); i++) {
        if (*evs[i] != NULL)
            event_free(*evs[i]);
        *evs[i] = NULL;
    }
}

static tdp_err events_init(tdp_loop *loop)
{
    struct event_base *b = loop->base;

    loop->ev_again = evtimer_new(b, again_cb, loop);
    loop->ev_safety = event_new(b, -1, EV_PERSIST, safety_cb, loop);
    loop->ev_tasks = event_new(b, -1, 0, tasks_cb, loop);
    loop->ev_stop = event_new(b, -1, 0, stop_cb, loop);
    loop->ev_deadline = evtimer_new(b, deadline_cb, loop);
    if (loop->ev_again == NULL || loop->ev_safety == NULL || loop->ev_tasks == NULL ||
        loop->ev_stop == NULL || loop->ev_deadline == NULL)
        return TDP_ENOMEM;

    struct timeval safety = {.tv_sec = loop->safety_timer_ms / 1000,
                             .tv_usec = (suseconds_t)(loop->safety_timer_ms % 1000) * 1000};
    if (event_add(loop->ev_safety, &safety) != 0) {
        tdp_log_error("event_add failed for the safety timer");
        return TDP_EINTERNAL;
    }
    return TDP_OK;
}

tdp_err tdp_loop_new(const tdp_loop_opts *opts, tdp_loop **out)
{
    tdp_loop *loop;
    tdp_err rc;

    if (out == NULL)
        return TDP_EINVAL;
    pthread_once(&threads_once, threads_init);
    if (threads_rc != 0) {
        tdp_log_error("evthread_use_pthreads failed");
        return TDP_ENOMEM;
    }

    loop = tdp__calloc(1, sizeof(*loop));
    if (loop == NULL)
        return TDP_ENOMEM;
    opts_resolve(opts, loop);
    atomic_init(&loop->holder, HOLD_NONE);
    atomic_init(&loop->idle_waiters, 0);
    if (pthread_mutex_init(&loop->lock, NULL) != 0) {
        rc = TDP_ENOMEM;
        goto err_free_loop;
    }
    if (pthread_cond_init(&loop->idle, NULL) != 0) {
        rc = TDP_ENOMEM;
        goto err_destroy_lock;
    }
    /*
     * Not EVENT_BASE_FLAG_PRECISE_TIMER: with it, libevent's epoll backend
     * keeps its timeouts in a timerfd and resets it (a system call) before
     * nearly every wait, on the path of every event-driven message. Without
     * it the wait's own millisecond timeout bounds the sleep, and libevent
     * reads a clock of at most a millisecond's resolution: deadlines are
     * still kept to the millisecond.
     */
    loop->base = event_base_new();
    if (loop->base == NULL) {
        tdp_log_error("event_base_new failed");
        rc = TDP_ENOMEM;
        goto err_destroy_idle;
    }
    rc = events_init(loop);
    if (rc != TDP_OK)
        goto err_free_events;

    *out = loop;
    return TDP_OK;

err_free_events:
    events_free(loop);
    event_base_free(loop->base);
err_destroy_idle:
    pthread_cond_destroy(&loop->idle);
err_destroy_lock:
    pthread_mutex_destroy(&loop->lock);
err_free_loop:
    tdp__free(loop);
    return rc;
}

void tdp_loop_free(tdp_loop *loop)
{
    if (loop == NULL)
        return;
    if (on_thread(loop)) {
        /* freeing under our own feet would be a use after free: leak instead */
        tdp_log_error("tdp_loop_free called on the loop thread; loop not freed");
        return;
    }
    tdp_loop_stop(loop);
    pthread_mutex_lock(&loop->lock);
    if (loop->has_thread) {
        /* the thread needs the lock to finish; join without it */
        pthread_t t = loop->thread;
        loop->has_thread = false;
        pthread_mutex_unlock(&loop->lock);
        pthread_join(t, NULL);
        pthread_mutex_lock(&loop->lock);
    }
    /* a tdp_loop_run or run_until on another thread: the stop ends the first */
    idle_wait_begin(loop);
    while (atomic_load(&loop->holder) != HOLD_NONE)
        pthread_cond_wait(&loop->idle, &loop->lock);
    idle_wait_end(loop);
    /* before the finis: queued intrusive tasks live in objects a fini frees */
    free_pending(loop);
    pthread_mutex_unlock(&loop->lock);

    /*
     * Higher layers first, in two rounds: every pre_fini while all state
     * below still stands (the UCX layer's destroys its workers, after the
     * pipe layer's has let endpoint closes finish), then every fini (the
     * pipe layer unmaps memory before the UCX layer cleans its contexts up).
     * The base and its events stay until the end: a fini may still free
     * events of its own.
     */
    for (int k = TDP__EXT_COUNT - 1; k >= 0; k--)
        if (loop->ext[k].pre_fini != NULL)
            loop->ext[k].pre_fini(loop->ext[k].ext);
    pthread_mutex_lock(&loop->lock);
    free_pending(loop); /* what the pre_finis posted: their owners stand until the finis */
    pthread_mutex_unlock(&loop->lock);
    for (int k = TDP__EXT_COUNT - 1; k >= 0; k--)
        if (loop->ext[k].fini != NULL)
            loop->ext[k].fini(loop->ext[k].ext);
    sources_drop(loop);
    events_free(loop);
    event_base_free(loop->base);
    pthread_cond_destroy(&loop->idle);
    pthread_mutex_destroy(&loop->lock);
    tdp__free(loop);
}

struct event_base *tdp__loop_base(tdp_loop *loop)
{
    return loop->base;
}

void *tdp__loop_ext(tdp_loop *loop, int key)
{
    if (key < 0 || key >= TDP__EXT_COUNT)
        return NULL;
    return loop->ext[key].ext;
}

void tdp__loop_set_ext(tdp_loop *loop, int key, void *ext, void (*pre_fini)(void *ext),
                       void (*fini)(void *ext))
{
    if (key < 0 || key >= TDP__EXT_COUNT) {
        tdp_log_error("tdp__loop_set_ext: no slot %d", key);
        return;
    }
    loop->ext[key] = (ext_slot){.ext = ext, .pre_fini = pre_fini, .fini = fini};
}
