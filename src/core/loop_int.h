/* loop_int.h (internal): what the pipe and server layers use of the loop. */
#ifndef TDP_CORE_LOOP_INT_H
#define TDP_CORE_LOOP_INT_H

#include <event2/event.h>
#include <tdpipe/loop.h>

/*
 * An intrusive task: embed one in a request so posting it from another
 * thread allocates nothing (the steady-state path must not allocate).
 */
typedef struct tdp__task {
    tdp_loop_fn fn;
    void *arg;
    struct tdp__task *next;
} tdp__task;

/* Queue t to run on the loop thread; thread-safe; never allocates. */
void tdp__loop_post_task(tdp_loop *loop, tdp__task *t);
/* Take t out of the queue if it is there, unrun (the loop being freed: its owner goes). */
void tdp__loop_unpost_task(tdp_loop *loop, tdp__task *t);

struct event_base *tdp__loop_base(tdp_loop *loop);

/*
 * Progress sources: something the loop must progress when its fd says so
 * (a UCP worker, a shared-memory ring), shaped after UCT's iface (event fd,
 * arm, progress). Every wakeup of any source drains all of them: progress
 * until idle or max_progress calls, then arm each before sleeping.
 */
typedef struct tdp__source tdp__source;
typedef struct tdp__source_ops {
    /* Handle what is pending; returns how many events it handled (0: idle). */
    unsigned (*progress)(void *arg);
    /*
     * Before the loop sleeps: 0 = armed (the fd will wake the loop), 1 = busy
     * (events arrived: progress again first), <0 = error (logged once; the
     * safety timer covers). NULL = always armed.
     */
    int (*arm)(void *arg);
} tdp__source_ops;

/*
 * Add a source. fd: readable when the source needs progress (-1: none; such
 * a source is progressed only by the safety timer, kicks and the busy-poll
 * window). ops is not copied (a static const table). The loop does not own
 * fd: remove the source before closing it. From the loop thread, or while
 * nobody runs the loop. *out is written only on success; TDP_ENOMEM.
 */
tdp_err tdp__loop_source_add(tdp_loop *loop, int fd, const tdp__source_ops *ops, void *arg,
                             tdp__source **out);

/*
 * Remove a source: its callbacks never run again and its fd leaves the loop
 * before this returns. Loop thread (or an idle loop); safe from inside any
 * source's progress callback, its own included. NULL is a no-op.
 */
void tdp__loop_source_remove(tdp_loop *loop, tdp__source *s);

/*
 * Stop or resume watching a source's fd. An unwatched source is still
 * progressed on every drain and by the safety timer; this is for a source
 * with nothing to wake up for now, whose fd may be readable for reasons it
 * does not care about (left watched, that would make the loop spin). Loop
 * thread (or an idle loop); safe inside any source's callbacks.
 */
void tdp__loop_source_watch(tdp__source *s, bool on);

/*
 * Call after work on a source done outside its progress (e.g. a UCP send
 * posted from a timer or a task): makes the loop progress all sources before
 * it sleeps again, so completions are not left waiting for a wakeup that
 * already happened.
 */
void tdp__loop_kick(tdp_loop *loop);

/*
 * Work for when the loop is about to wait: fn(arg) runs once, as the
 * loop's holder, the next time a drain finds nothing more to do and the
 * loop would sleep, or, while a busy-poll window keeps the loop awake, a
 * turn finds nothing to do. Not when a blocking call's own work is done
 * and it returns instead. For what may wait until then but no longer (credit a receiver
 * gives back while it drains a burst). Intrusive: adding allocates
 * nothing; adding one already queued is a no-op; one fn adds again from
 * inside itself runs at the next sleep, not this one. Loop thread (or
 * the loop's holder). fn returns true when it did work a source must
 * progress before the loop sleeps (it posted a send); false, and the
 * loop arms its sources at once, without another round of progress.
 */
typedef struct tdp__idle {
    bool (*fn)(void *arg);
    void *arg;
    struct tdp__idle *next;
    bool queued;
} tdp__idle;
void tdp__loop_idle_add(tdp_loop *loop, tdp__idle *h);
/* Take h off the queue, if it is on it (its fn does not run). */
void tdp__loop_idle_cancel(tdp_loop *loop, tdp__idle *h);

/*
 * Drive the loop on the calling thread until *done becomes true or
 * timeout_ms passes (-1: no timeout). Returns TDP_OK when done,
 * TDP_ETIMEDOUT otherwise, TDP_EINVAL at once when another thread holds the
 * loop. *done is read only while holding the loop: it must be set only by
 * the loop's holder (a completion on the loop thread). Blocking wrappers
 * use tdp__loop_wait, which picks between this and sleeping.
 */
tdp_err tdp__loop_run_until(tdp_loop *loop, volatile bool *done, int64_t timeout_ms);

/*
 * As tdp__loop_run_until, but first runs fn(arg) as the holder (when fn is
 * not NULL): a blocking call starts its operation and drives the loop for it
 * under one hold of the loop. TDP_EINVAL, without calling fn, when another
 * thread holds the loop.
 */
tdp_err tdp__loop_run_after(tdp_loop *loop, tdp_loop_fn fn, void *arg, volatile bool *done,
                            int64_t timeout_ms);

/*
 * True when a thread holds the loop now: a loop thread or tdp_loop_run, a
 * blocking call driving it (run_until), or an inline call (run_inline).
 */
bool tdp__loop_running(const tdp_loop *loop);

/*
 * True when a loop thread or tdp_loop_run holds the loop: it runs posted
 * tasks until stopped. A blocking call that drives the loop runs them only
 * until its own call is done; whoever waits on such a loop must be ready to
 * take over (tdp__loop_wait does).
 */
bool tdp__loop_has_runner(const tdp_loop *loop);

/*
 * Run fn(arg) as the loop's holder, now: directly on the loop thread; on an
 * idle loop, on the calling thread while holding the loop for the call (so
 * nobody else drives it meanwhile, and tdp_loop_on_thread is true inside).
 * False, without calling fn, when another thread holds the loop: post a
 * task instead. Waits out another thread's inline call rather than fail.
 */
bool tdp__loop_run_inline(tdp_loop *loop, tdp_loop_fn fn, void *arg);

/*
 * Per-loop extension slots for the layers above (each sets its own, at most
 * once per loop, from the loop thread or an idle loop). tdp_loop_free, once
 * nothing runs the loop, calls every pre_fini in descending key order, then
 * every fini in descending key order: a higher key may use a lower one's
 * state in both its pre_fini and its fini (the pipe layer's pre_fini runs
 * while the UCX workers exist, its fini before their contexts go). Tasks queued
 * before or posted by a pre_fini are dropped unrun between the rounds; a
 * fini must not post. Sources still registered after the finis are dropped.
 */
enum { TDP__EXT_UCX = 0, TDP__EXT_PIPE = 1, TDP__EXT_SHM = 2, TDP__EXT_REAP = 3, TDP__EXT_COUNT };
void *tdp__loop_ext(tdp_loop *loop, int key); /* NULL if never set */
void tdp__loop_set_ext(tdp_loop *loop, int key, void *ext, void (*pre_fini)(void *ext),
                       void (*fini)(void *ext));

#endif
