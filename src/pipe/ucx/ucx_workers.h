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
 * shared-memory transports (never cma), with their peer-failure support
 * turned on. Peers on this host are served by private workers of that
 * context (tdp__ucx_private_new), one per link: UCX's shared-memory
 * transports give each worker one receive FIFO that every sender writes
 * into in order, and a sender killed between claiming a FIFO slot and
 * filling it stops that FIFO for good. Worker 1 itself carries no link;
 * its address is the model the private workers' addresses are checked
 * against.
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

typedef struct tdp__ucx_private tdp__ucx_private;

/*
 * A private worker of the same-host context (worker 1's), driven by the
 * loop like the shared ones. TDP_EINVAL when the loop has no same-host
 * context; TDP_ENOMEM, also when the process is short of descriptors;
 * TDP_EUCX (logged). Loop thread.
 */
tdp_err tdp__ucx_private_new(tdp__ucx *u, tdp__ucx_private **out);

ucp_worker_h tdp__ucx_private_worker(const tdp__ucx_private *p);

/* Destroys the worker (and every endpoint on it); NULL is a no-op. Never
 * from inside a progress of that worker. */
void tdp__ucx_private_free(tdp__ucx_private *p);

/* Private workers alive in this process, every loop's (for tests). Any thread. */
unsigned tdp__ucx_private_live(void);

#endif
