/* dial.c: tdp_pipe_connect_async / tdp_pipe_connect — resolve, then hand the pipe its socket. */
#include <string.h>

#include "session.h"
#include "op.h"
#include "../core/alloc.h"
#include "../core/log.h"

typedef struct connect_req {
    tdp__task task;
    tdp_loop *loop;
    tdp_pipe_opts opts;
    tdp_schema_limits limits;
    struct sockaddr_storage addrs[TDP_CTL_MAX_ADDRS];
    socklen_t addrlens[TDP_CTL_MAX_ADDRS];
    int naddr;
    tdp_pipe_cb cb;
    void *arg;
} connect_req;

static void connect_task(void *arg)
{
    connect_req *r = arg;
    tdp_err rc;
    tdp_pipe *p = tdp__session_new(r->loop, &r->opts, &r->limits, &rc);
    if (p != NULL) {
        rc = tdp__session_dial(p, r->addrs, r->addrlens, r->naddr, r->cb, r->arg);
        if (rc != TDP_OK)
            tdp__session_destroy(p);
    }
    if (rc != TDP_OK)
        r->cb(NULL, rc, r->arg);
    tdp__free(r);
}

tdp_err tdp_pipe_connect_async(tdp_loop *loop, const char *host, uint16_t port,
                               const tdp_pipe_opts *opts, tdp_pipe_cb cb, void *arg)
{
    if (loop == NULL || host == NULL || host[0] == '\0' || port == 0 || cb == NULL)
        return TDP_EINVAL;
    connect_req *r = tdp__calloc(1, sizeof(*r));
    if (r == NULL)
        return TDP_ENOMEM;
    /* resolved here, on the caller's thread: a slow DNS never stalls the loop */
    tdp_err rc = tdp__resolve(host, port, false, r->addrs, r->addrlens, TDP_CTL_MAX_ADDRS,
                              &r->naddr);
    if (rc != TDP_OK) {
        tdp__free(r);
        return rc;
    }
    r->loop = loop;
    tdp__opts_resolve(opts, &r->opts, &r->limits);
    r->cb = cb;
    r->arg = arg;
    r->task = (tdp__task){.fn = connect_task, .arg = r};
    /* the callback must never run inside this call: always a later turn */
    tdp__loop_post_task(loop, &r->task);
    return TDP_OK;
}

typedef struct waiter {
    volatile bool done;
    tdp_err rc;
    tdp_pipe *pipe;
    pthread_mutex_t mtx;
    pthread_cond_t cond;
} waiter;

static void waiter_cb(tdp_pipe *pipe, tdp_err status, void *arg)
{
    waiter *w = arg;
    pthread_mutex_lock(&w->mtx);
    w->pipe = pipe;
    w->rc = status;
    w->done = true;
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->mtx);
}

tdp_err tdp_pipe_connect(tdp_loop *loop, const char *host, uint16_t port,
                         const tdp_pipe_opts *opts, tdp_pipe **out)
{
    if (out == NULL || loop == NULL || (tdp__loop_running(loop) && tdp_loop_on_thread(loop)))
        return TDP_EINVAL;
    waiter w = {.rc = TDP_EINTERNAL};
    pthread_mutex_init(&w.mtx, NULL);
    pthread_cond_init(&w.cond, NULL);
    tdp_err rc = tdp_pipe_connect_async(loop, host, port, opts, waiter_cb, &w);
    if (rc == TDP_OK) {
        pthread_mutex_lock(&w.mtx);
        tdp__loop_wait(loop, &w.mtx, &w.cond, &w.done, -1); /* the pipe's own deadline ends it */
        rc = w.rc;
        pthread_mutex_unlock(&w.mtx);
    }
    pthread_mutex_destroy(&w.mtx);
    pthread_cond_destroy(&w.cond);
    if (rc == TDP_OK)
        *out = w.pipe;
    return rc;
}
