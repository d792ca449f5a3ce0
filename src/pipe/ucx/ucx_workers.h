/*
 * ucx_workers.h (internal): the pipe layer's UCX contexts and workers, one
 * set per loop, created on first use and driven by the loop as progress
 * sources.
 */
#ifndef TDP_PIPE_UCX_WORKERS_H
#define TDP_PIPE_UCX_WORKERS_H

#include <ucp/api/ucp.h>

#include "../../core/loop_int.h"

/*
 * A loop has up to two UCP workers, each with its own context: worker 0
 * (TDP_WORKER_ANY) uses the transports UCX_TLS allows and serves any peer;
 * worker 1 (TDP_WORKER_LOCAL), when it exists, uses only UCX's
 * shared-memory transports (never cma) and serves peers on this host
 * without UCX's peer-failure mode.
 */
#define TDP_LOOP_WORKERS 2
#define TDP_WORKER_ANY   0
#define TDP_WORKER_LOCAL 1

typedef struct tdp__ucx {
    ucp_context_h context[TDP_LOOP_WORKERS];
    ucp_worker_h worker[TDP_LOOP_WORKERS]; /* worker[1] NULL when unavailable */
    int nworkers;
    /*
     * Set by the layer that makes endpoints on these workers: false while
     * it has nothing UCX could deliver or must progress (no link, no
     * endpoint, no close in flight). The workers are then not armed, which
     * spares each loop turn a system call or two when every pipe of the
     * loop uses another plane; the loop's safety timer still progresses
     * them. NULL: nobody has made an endpoint yet, so not in use either.
     */
    bool (*in_use)(void *arg);
    void *in_use_arg;
    /*
     * Non-zero while a ucp_worker_progress of these workers is on this
     * loop's stack (the loop's, or a plane's own): UCX must not be
     * progressed again from inside its callbacks. Loop thread only.
     */
    int progressing;
} tdp__ucx;

/*
 * The loop's UCX state, created on the first call (features: active
 * messages, wakeup; UCX_* environment as usual) and freed with the loop:
 * its workers go in the loop's pre_fini round, after the pipe layer's, and
 * its contexts last. Loop thread, or a loop nobody runs. *out is written
 * only on success; TDP_EUCX (logged) when UCX fails, TDP_ENOMEM.
 */
tdp_err tdp__ucx_get(tdp_loop *loop, tdp__ucx **out);

/* The loop's UCX state, NULL if never created. */
tdp__ucx *tdp__ucx_peek(tdp_loop *loop);

#endif
