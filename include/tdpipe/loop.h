/*
 * loop.h: the event loop every pipe and server runs on.
 *
 * A tdp_loop owns one libevent event_base and drives what the pipes on it
 * add: UCX workers (created on the loop with its first pipe or listener and
 * freed with the loop), sockets, timers. All library callbacks run on the
 * loop's thread.
 * The loop runs either on the caller's thread (tdp_loop_run) or on a thread
 * of its own (tdp_loop_start_thread); other threads hand it work with
 * tdp_loop_post, which is safe from any thread.
 *
 * Teardown: tdp_loop_stop (any thread) makes run return / the thread exit;
 * tdp_loop_free (not from the loop thread) joins a loop thread if one runs,
 * then frees. Free every pipe and server on a loop before freeing the loop.
 */
#ifndef TDPIPE_LOOP_H
#define TDPIPE_LOOP_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdp_loop tdp_loop;

/* Options; the struct can grow: set size = sizeof(tdp_loop_opts). */
typedef struct tdp_loop_opts {
    size_t size;
    /*
     * Most progress calls per wakeup of the transports (UCX workers and the
     * like) before other events (sockets, timers, tasks) get a turn: a
     * bounded drain. 0 = default (64).
     */
    uint32_t max_progress;
    /*
     * Period of the safety timer that progresses the transports against a
     * lost wakeup, ms. 0 = 10. UCX 1.13's shared-memory transports
     * occasionally miss a wakeup; this bounds what one costs.
     */
    uint32_t safety_timer_ms;
    /*
     * Busy-poll window, microseconds (0 = off, the default): after the last
     * transport activity the loop keeps progressing the transports for this
     * long instead of sleeping on their event fds. Lower latency for ping-pong
     * traffic at the price of a busy core — the progress mode UCX's own
     * ucx_perftest uses.
     */
    uint32_t busy_poll_us;
} tdp_loop_opts;

/*
 * Create a loop (an event_base and its timers). opts may be NULL. *out is
 * written only on success. UCX is not touched here: the first pipe or
 * listener on the loop creates its UCP contexts and workers (UCX reads its
 * usual UCX_* environment, e.g. UCX_TLS), and that call fails with TDP_EUCX
 * if UCX does.
 */
TDP_API tdp_err tdp_loop_new(const tdp_loop_opts *opts, tdp_loop **out);

/*
 * Run on the calling thread until tdp_loop_stop. Returns TDP_OK after a
 * stop, TDP_EINVAL if the loop already runs (here or on its thread).
 */
TDP_API tdp_err tdp_loop_run(tdp_loop *loop);

/*
 * Start a thread that runs the loop until tdp_loop_stop / tdp_loop_free.
 * TDP_EINVAL if the loop already runs; a loop thread that was stopped is
 * joined and replaced.
 */
TDP_API tdp_err tdp_loop_start_thread(tdp_loop *loop);

/*
 * Ask the loop to stop. Safe from any thread, any number of times. The
 * request is consumed by the run (or loop thread) it ends; made while
 * nothing runs the loop, it ends the next run at once.
 */
TDP_API void tdp_loop_stop(tdp_loop *loop);

/*
 * Stop, join the loop thread if any (or wait for tdp_loop_run on another
 * thread to return), and free. Tasks still queued are dropped without
 * running. Not from the loop thread (that is logged and the loop is leaked
 * rather than freed under its own feet). NULL is a no-op.
 */
TDP_API void tdp_loop_free(tdp_loop *loop);

/* True when called on the thread currently running the loop. */
TDP_API bool tdp_loop_on_thread(const tdp_loop *loop);

/* A function to run on the loop thread. */
typedef void (*tdp_loop_fn)(void *arg);

/*
 * Run fn(arg) on the loop thread, soon, in posting order. Safe from any
 * thread (from the loop thread too: it runs on a later turn, never inside
 * this call). Allocates one small task; TDP_ENOMEM if that fails.
 */
TDP_API tdp_err tdp_loop_post(tdp_loop *loop, tdp_loop_fn fn, void *arg);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_LOOP_H */
