/*
 * loop.c: one libevent event_base driving one UCP worker, plus a task queue
 * other threads use to hand work to the loop thread.
 *
 * How the worker is driven: its event fd is a level-triggered EV_READ event;
 * every wakeup drains the worker (bounded) and re-arms it. Anything that
 * must progress "soon" (a bounded drain that had more work, a kick after a
 * send, a task posted from the loop thread) is a zero-timeout timer rather
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
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <event2/thread.h>

#include "alloc.h"
#include "log.h"

#define DEFAULT_MAX_PROGRESS    64
#define DEFAULT_SAFETY_TIMER_MS 10

struct tdp_loop {
    struct event_base *base;
    struct event *ev_efd[TDP_LOOP_WORKERS]; /* a worker's event fd readable */
    struct event *ev_again;    /* zero-timeout timer: progress the worker again */
    struct event *ev_safety;   /* slow persistent timer against a lost wakeup */
    struct event *ev_tasks;    /* drain the task queue */
    struct event *ev_stop;     /* turns a stop request into a loopbreak on the loop thread */
    struct event *ev_deadline; /* run_until's deadline */

    /*
     * Worker 0 uses the transports UCX_TLS allows, for any peer; worker 1
     * (NULL when unavailable) only shared memory, for peers on this host.
     */
    ucp_context_h context[TDP_LOOP_WORKERS];
    ucp_worker_h worker[TDP_LOOP_WORKERS];
    int nworkers;

    /* the pipe layer's per-loop state (see tdp__loop_set_pipe_ext) */
    void *pipe_ext;
    void (*pipe_pre_fini)(void *ext);
    void (*pipe_fini)(void *ext);

    uint32_t max_progress;
    uint32_t safety_timer_ms;
    uint32_t busy_poll_us;
    uint64_t last_activity_ns; /* last progress that did something (busy poll) */

    /* Loop thread only (or whoever drives the loop while nobody else does). */
    bool again_pending;
    bool arm_error_logged;
    bool deadline_hit;
    volatile bool *until_done; /* run_until's flag while it runs, else NULL */

    /* lock guards everything below; busy is also read without it. */
    pthread_mutex_t lock;
    pthread_cond_t idle; /* signalled when busy drops to false */
    tdp__task *head, *tail;
    bool stop_requested; /* consumed by the run it ends, or by the next run */
    bool has_thread;     /* thread must be joined */
    pthread_t thread;
    atomic_bool busy; /* run, run_until or a loop thread owns the loop */
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

/* ---- the worker ------------------------------------------------------------ */

static void schedule_again(tdp_loop *loop)
{
    static const struct timeval zero = {0, 0};

    if (loop->again_pending)
        return;
    if (event_add(loop->ev_again, &zero) == 0)
        loop->again_pending = true;
}

/*
 * Progress the worker, then arm it so its fd wakes us. The whole drain costs
 * at most max_progress progress calls; past that the rest waits for the
 * again timer so other events get a turn. UCS_ERR_BUSY from arm means
 * events arrived since the last progress: progress them before sleeping.
 */
static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static unsigned progress_all(tdp_loop *loop)
{
    unsigned n = 0;
    for (int i = 0; i < loop->nworkers; i++)
        n += ucp_worker_progress(loop->worker[i]);
    return n;
}

/* Arm every worker; BUSY as soon as one has events waiting. */
static ucs_status_t arm_all(tdp_loop *loop)
{
    for (int i = 0; i < loop->nworkers; i++) {
        ucs_status_t st = ucp_worker_arm(loop->worker[i]);
        if (st != UCS_OK)
            return st;
    }
    return UCS_OK;
}

static void drain(tdp_loop *loop)
{
    uint32_t budget = loop->max_progress;
    bool active = false;

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
        if (loop->busy_poll_us > 0) {
            /* busy-poll window: keep progressing instead of sleeping for a
             * while after the last activity, trading CPU for wakeup latency */
            uint64_t now = mono_ns();
            if (active)
                loop->last_activity_ns = now;
            if (now - loop->last_activity_ns < (uint64_t)loop->busy_poll_us * 1000u) {
                schedule_again(loop);
                break;
            }
        }
        ucs_status_t st = arm_all(loop);
        if (st == UCS_OK)
            break;
        if (st != UCS_ERR_BUSY) {
            /* the safety timer keeps the worker going; a retry now would spin */
            if (!loop->arm_error_logged)
                tdp_log_error("ucp_worker_arm: %s", ucs_status_string(st));
            loop->arm_error_logged = true;
            break;
        }
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

/* Take the loop for the calling thread; false if someone runs it already. */
static bool acquire(tdp_loop *loop)
{
    bool ok;

    pthread_mutex_lock(&loop->lock);
    ok = !atomic_load(&loop->busy);
    if (ok)
        atomic_store(&loop->busy, true);
    pthread_mutex_unlock(&loop->lock);
    return ok;
}

static void release(tdp_loop *loop)
{
    pthread_mutex_lock(&loop->lock);
    atomic_store(&loop->busy, false);
    pthread_cond_broadcast(&loop->idle);
    pthread_mutex_unlock(&loop->lock);
}

/* Run until a stop request, and consume it. The caller holds the loop. */
static tdp_err run_loop(tdp_loop *loop)
{
    run_frame frame;
    tdp_err rc = TDP_OK;

    frame_push(&frame, loop);
    tdp__loop_kick(loop); /* the worker must be armed before its fd can wake us */
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
    if (loop == NULL || !acquire(loop))
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
    pthread_mutex_lock(&loop->lock);
    if (atomic_load(&loop->busy)) {
        rc = TDP_EINVAL;
        goto out_unlock;
    }
    if (loop->has_thread) {
        /* a previous loop thread was stopped and has released the loop: reap it */
        pthread_join(loop->thread, NULL);
        loop->has_thread = false;
    }
    /* busy before the thread exists, so run / run_until cannot slip in */
    atomic_store(&loop->busy, true);
    int err = pthread_create(&loop->thread, NULL, thread_main, loop);
    if (err != 0) {
        tdp_log_error("pthread_create: %s", strerror(err));
        atomic_store(&loop->busy, false);
        rc = err == EAGAIN ? TDP_ENOMEM : TDP_EINTERNAL;
        goto out_unlock;
    }
    loop->has_thread = true;
out_unlock:
    pthread_mutex_unlock(&loop->lock);
    return rc;
}

static void deadline_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_loop *loop = arg;

    loop->deadline_hit = true;
    event_base_loopbreak(loop->base);
}

/*
 * Busy-poll fast path of run_until: progress the worker directly, without
 * a trip through libevent per iteration (an epoll_wait and a timer each),
 * and give libevent a non-blocking turn every few spins so sockets, timers
 * and posted tasks still run. Ends when done, at the deadline, or after the
 * busy-poll window passes with nothing to do.
 */
static void spin(tdp_loop *loop, volatile bool *done, uint64_t deadline_ns)
{
    uint64_t window = (uint64_t)loop->busy_poll_us * 1000u;
    uint64_t last = mono_ns();
    unsigned n = 0;

    while (!*done) {
        if (progress_all(loop) != 0) {
            last = 0; /* refreshed below, on the next libevent turn */
            continue;
        }
        if (++n % 256 != 0)
            continue;
        if (event_base_loop(loop->base, EVLOOP_NONBLOCK) != 0)
            return;
        uint64_t now = mono_ns();
        if (deadline_ns != 0 && now >= deadline_ns)
            return; /* run_until's timer says so too, on its next turn */
        if (last == 0) {
            last = now;
        } else if (now - last > window) {
            /* idle for a whole window: arm the workers and sleep on their fds */
            loop->last_activity_ns = 0;
            drain(loop);
            return;
        }
    }
}

tdp_err tdp__loop_run_until(tdp_loop *loop, volatile bool *done, int64_t timeout_ms)
{
    run_frame frame;
    tdp_err rc = TDP_OK;

    if (loop == NULL || done == NULL)
        return TDP_EINVAL;
    if (*done)
        return TDP_OK;
    if (!acquire(loop))
        return TDP_EINVAL;
    frame_push(&frame, loop);
    loop->until_done = done;
    loop->deadline_hit = false;
    if (loop->busy_poll_us > 0) {
        /* the fast path first: no timer, no libevent turn per iteration */
        uint64_t t0 = mono_ns();
        spin(loop, done, timeout_ms >= 0 ? t0 + (uint64_t)timeout_ms * 1000000u : 0);
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
    tdp__loop_kick(loop);
    /*
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
    return loop != NULL && atomic_load(&((tdp_loop *)loop)->busy);
}

/* ---- create and free ------------------------------------------------------- */

static tdp_err ucx_fail(const char *what, ucs_status_t st)
{
    tdp_log_error("%s: %s", what, ucs_status_string(st));
    return TDP_EUCX;
}

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

/*
 * The shared-memory transports of UCX_TLS for the same-host worker, or NULL
 * when the user's list leaves none. cma is never among them: it reads a
 * peer's memory with process_vm_readv, and in UCX 1.13 a peer that dies
 * during such a read is a fatal error in the reading process whenever the
 * endpoint has no peer-failure mode (which same-host endpoints cannot have:
 * UCX's shared-memory transports do not support it).
 */
static char *local_tls(const char *user)
{
    static const char all[] = "posix,sysv";
    if (user == NULL || user[0] == '\0' || strcmp(user, "all") == 0 || user[0] == '^')
        return tdp__strdup(all); /* an exclusion list keeps these, unless it names them */
    char *out = tdp__calloc(1, sizeof(all));
    char *copy = tdp__strdup(user), *save = NULL;
    if (out == NULL || copy == NULL) {
        tdp__free(out);
        tdp__free(copy);
        return NULL;
    }
    bool posix = false, sysv = false, self = false;
    for (char *t = strtok_r(copy, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        posix |= !strcmp(t, "shm") || !strcmp(t, "posix") || !strcmp(t, "sm");
        sysv |= !strcmp(t, "shm") || !strcmp(t, "sysv") || !strcmp(t, "sm");
        self |= !strcmp(t, "self");
    }
    tdp__free(copy);
    if (!posix && !sysv) {
        tdp__free(out);
        return NULL;
    }
    (void)self; /* never "self": a worker's rendezvous to itself leaves requests behind
                 * that crash ucp_worker_destroy in UCX 1.13 */
    snprintf(out, sizeof(all), "%s%s%s", posix ? "posix" : "", posix && sysv ? "," : "",
             sysv ? "sysv" : "");
    return out;
}

static tdp_err worker_init(tdp_loop *loop, int i, const char *tls)
{
    ucp_config_t *config;
    ucs_status_t st;

    /* NULL env prefix: UCX_* variables (UCX_TLS, ...) apply as usual */
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK)
        return ucx_fail("ucp_config_read", st);
    if (tls != NULL && (st = ucp_config_modify(config, "TLS", tls)) != UCS_OK) {
        ucp_config_release(config);
        return ucx_fail("ucp_config_modify(TLS)", st);
    }
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
    };
    st = ucp_init(&params, config, &loop->context[i]);
    ucp_config_release(config);
    if (st != UCS_OK) {
        loop->context[i] = NULL;
        return ucx_fail("ucp_init", st);
    }
    ucp_worker_params_t wparams = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    st = ucp_worker_create(loop->context[i], &wparams, &loop->worker[i]);
    if (st != UCS_OK) {
        loop->worker[i] = NULL;
        return ucx_fail("ucp_worker_create", st);
    }
    loop->nworkers = i + 1;
    return TDP_OK;
}

static tdp_err ucx_init(tdp_loop *loop)
{
    tdp_err rc = worker_init(loop, 0, NULL);
    if (rc != TDP_OK)
        return rc;
    char *tls = local_tls(getenv("UCX_TLS"));
    if (tls != NULL) {
        /* without it, same-host pipes use worker 0 in peer-failure mode */
        if (worker_init(loop, 1, tls) != TDP_OK)
            tdp_log_info("no same-host shared-memory worker (%s); peers on this host use TCP",
                         tls);
        else
            tdp_log_debug("same-host worker transports: %s", tls);
        tdp__free(tls);
    }
    return TDP_OK;
}

static void events_free(tdp_loop *loop)
{
    struct event **evs[] = {&loop->ev_efd[0], &loop->ev_efd[1], &loop->ev_again,
                            &loop->ev_safety, &loop->ev_tasks,  &loop->ev_stop,
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
    ucs_status_t st;
    int efd;

    for (int i = 0; i < loop->nworkers; i++) {
        st = ucp_worker_get_efd(loop->worker[i], &efd);
        if (st != UCS_OK)
            return ucx_fail("ucp_worker_get_efd", st);
        loop->ev_efd[i] = event_new(b, efd, EV_READ | EV_PERSIST, efd_cb, loop);
        if (loop->ev_efd[i] == NULL || event_add(loop->ev_efd[i], NULL) != 0)
            return TDP_ENOMEM;
    }
    loop->ev_again = evtimer_new(b, again_cb, loop);
    loop->ev_safety = event_new(b, -1, EV_PERSIST, safety_cb, loop);
    loop->ev_tasks = event_new(b, -1, 0, tasks_cb, loop);
    loop->ev_stop = event_new(b, -1, 0, stop_cb, loop);
    loop->ev_deadline = evtimer_new(b, deadline_cb, loop);
    if (loop->ev_again == NULL || loop->ev_safety == NULL ||
        loop->ev_tasks == NULL || loop->ev_stop == NULL || loop->ev_deadline == NULL)
        return TDP_ENOMEM;

    struct timeval safety = {.tv_sec = loop->safety_timer_ms / 1000,
                             .tv_usec = (suseconds_t)(loop->safety_timer_ms % 1000) * 1000};
    if (event_add(loop->ev_safety, &safety) != 0) {
        tdp_log_error("event_add failed for the worker events");
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
    atomic_init(&loop->busy, false);
    if (pthread_mutex_init(&loop->lock, NULL) != 0) {
        rc = TDP_ENOMEM;
        goto err_free_loop;
    }
    if (pthread_cond_init(&loop->idle, NULL) != 0) {
        rc = TDP_ENOMEM;
        goto err_destroy_lock;
    }
    /* precise timers: deadlines are kept to the millisecond, not the
     * coarse clock's few-millisecond tick */
    struct event_config *cfg = event_config_new();
    if (cfg != NULL) {
        event_config_set_flag(cfg, EVENT_BASE_FLAG_PRECISE_TIMER);
        loop->base = event_base_new_with_config(cfg);
        event_config_free(cfg);
    }
    if (loop->base == NULL) {
        tdp_log_error("event_base_new failed");
        rc = TDP_ENOMEM;
        goto err_destroy_idle;
    }
    rc = ucx_init(loop);
    if (rc != TDP_OK)
        goto err_cleanup_ucx; /* ucx_init leaves what it did not make NULL */
    rc = events_init(loop);
    if (rc != TDP_OK)
        goto err_free_events;
    tdp__loop_kick(loop); /* arm the worker on the first turn, whoever runs it */

    *out = loop;
    return TDP_OK;

err_free_events:
    events_free(loop);
err_cleanup_ucx:
    for (int i = TDP_LOOP_WORKERS - 1; i >= 0; i--) {
        if (loop->worker[i] != NULL)
            ucp_worker_destroy(loop->worker[i]);
        if (loop->context[i] != NULL)
            ucp_cleanup(loop->context[i]);
    }
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
    while (atomic_load(&loop->busy))
        pthread_cond_wait(&loop->idle, &loop->lock);
    free_pending(loop);
    pthread_mutex_unlock(&loop->lock);

    /* events first: the efd event must leave epoll before the worker closes the fd */
    events_free(loop);
    if (loop->pipe_pre_fini != NULL)
        loop->pipe_pre_fini(loop->pipe_ext);
    for (int i = 0; i < loop->nworkers; i++)
        ucp_worker_destroy(loop->worker[i]);
    if (loop->pipe_fini != NULL)
        loop->pipe_fini(loop->pipe_ext); /* memory of requests the workers took with them */
    for (int i = 0; i < loop->nworkers; i++)
        ucp_cleanup(loop->context[i]);
    event_base_free(loop->base);
    pthread_cond_destroy(&loop->idle);
    pthread_mutex_destroy(&loop->lock);
    tdp__free(loop);
}

struct event_base *tdp__loop_base(tdp_loop *loop)
{
    return loop->base;
}

ucp_context_h tdp__loop_context(tdp_loop *loop)
{
    return loop->context[0];
}

ucp_worker_h tdp__loop_worker(tdp_loop *loop)
{
    return loop->worker[0];
}

int tdp__loop_nworkers(tdp_loop *loop)
{
    return loop->nworkers;
}

ucp_worker_h tdp__loop_worker_n(tdp_loop *loop, int i)
{
    return i < loop->nworkers ? loop->worker[i] : NULL;
}

ucp_context_h tdp__loop_context_n(tdp_loop *loop, int i)
{
    return i < loop->nworkers ? loop->context[i] : NULL;
}

void *tdp__loop_pipe_ext(tdp_loop *loop)
{
    return loop->pipe_ext;
}

void tdp__loop_set_pipe_ext(tdp_loop *loop, void *ext, void (*pre_fini)(void *ext),
                            void (*fini)(void *ext))
{
    loop->pipe_ext = ext;
    loop->pipe_pre_fini = pre_fini;
    loop->pipe_fini = fini;
}
