/* loop_int.h (internal): what the pipe and server layers use of the loop. */
#ifndef TDP_CORE_LOOP_INT_H
#define TDP_CORE_LOOP_INT_H

#include <event2/event.h>
#include <ucp/api/ucp.h>
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

struct event_base *tdp__loop_base(tdp_loop *loop);

/*
 * A loop has up to two UCP workers, each with its own context: worker 0
 * (TDP_WORKER_ANY) uses the transports UCX_TLS allows and serves any peer;
 * worker 1 (TDP_WORKER_LOCAL), when it exists, uses only UCX's
 * shared-memory transports (never cma) and serves peers on this host
 * without UCX's peer-failure mode. tdp__loop_worker/context name worker 0.
 */
#define TDP_LOOP_WORKERS 2
#define TDP_WORKER_ANY   0
#define TDP_WORKER_LOCAL 1
ucp_context_h tdp__loop_context(tdp_loop *loop);
ucp_worker_h tdp__loop_worker(tdp_loop *loop);
int tdp__loop_nworkers(tdp_loop *loop);
ucp_worker_h tdp__loop_worker_n(tdp_loop *loop, int i); /* NULL if absent */
ucp_context_h tdp__loop_context_n(tdp_loop *loop, int i);

/*
 * Call after UCP calls made outside the worker fd callback (e.g. a send
 * posted from a timer or a task): makes the loop progress the worker before
 * it sleeps again, so completions are not left waiting for a wakeup that
 * already happened.
 */
void tdp__loop_kick(tdp_loop *loop);

/*
 * Drive the loop on the calling thread until *done becomes true or
 * timeout_ms passes (-1: no timeout). Only when no other thread runs the
 * loop. Returns TDP_OK when done, TDP_ETIMEDOUT otherwise. Used by blocking
 * wrappers when the caller owns the loop.
 */
tdp_err tdp__loop_run_until(tdp_loop *loop, volatile bool *done, int64_t timeout_ms);

/* True when a thread (a loop thread or tdp_loop_run) is running the loop now. */
bool tdp__loop_running(const tdp_loop *loop);

/*
 * One slot of per-loop state for the pipe layer. pre_fini runs in
 * tdp_loop_free before the UCP worker is destroyed, fini after it (and
 * before the UCP context is cleaned up). Set at most once per loop.
 */
void *tdp__loop_pipe_ext(tdp_loop *loop);
void tdp__loop_set_pipe_ext(tdp_loop *loop, void *ext, void (*pre_fini)(void *ext),
                            void (*fini)(void *ext));

#endif
