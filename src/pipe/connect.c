/* connect.c: tdp_pipe_connect* and the listener that accepts pipes. */
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <unistd.h>

#include "pipe_int.h"
#include "../core/alloc.h"
#include "../core/log.h"

/* ---- connecting ------------------------------------------------------------ */

typedef struct connect_req {
    tdp__task task;
    tdp_loop *loop;
    tdp_pipe_opts opts;
    tdp_schema_limits limits;
    struct sockaddr_storage addrs[4];
    socklen_t addrlens[4];
    int naddr;
    tdp_pipe_cb cb;
    void *arg;
} connect_req;

static void connect_task(void *arg)
{
    connect_req *r = arg;
    r->opts.limits = &r->limits;
    tdp__ucx *ucx; /* made with the loop's first pipe: say so if UCX fails */
    tdp_err urc = tdp__ucx_get(r->loop, &ucx);
    if (urc != TDP_OK) {
        r->cb(NULL, urc, r->arg);
        tdp__free(r);
        return;
    }
    tdp_pipe *p = tdp__pipe_alloc(r->loop, &r->opts);
    if (p == NULL) {
        r->cb(NULL, TDP_ENOMEM, r->arg);
        tdp__free(r);
        return;
    }
    memcpy(p->addrs, r->addrs, sizeof(p->addrs));
    memcpy(p->addrlens, r->addrlens, sizeof(p->addrlens));
    p->naddr = r->naddr;
    p->connect_cb = r->cb;
    p->connect_arg = r->arg;
    tdp__free(r);
    tdp_err rc = tdp__conn_start_connect(p, (struct sockaddr *)&p->addrs[0], p->addrlens[0]);
    if (rc != TDP_OK)
        tdp__pipe_fail(p, rc, "cannot connect");
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
    tdp_err rc = tdp__resolve(host, port, false, r->addrs, r->addrlens, 4, &r->naddr);
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
    pthread_cond_signal(&w->cond);
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
        if (tdp__loop_running(loop)) {
            pthread_mutex_lock(&w.mtx);
            while (!w.done)
                pthread_cond_wait(&w.cond, &w.mtx); /* the pipe's own deadline ends it */
            pthread_mutex_unlock(&w.mtx);
        } else {
            tdp__loop_run_until(loop, &w.done, -1);
        }
        rc = w.rc;
    }
    pthread_mutex_destroy(&w.mtx);
    pthread_cond_destroy(&w.cond);
    if (rc == TDP_OK)
        *out = w.pipe;
    return rc;
}

/* ---- listening ------------------------------------------------------------- */

static void accept_cb(struct evconnlistener *evl, evutil_socket_t fd, struct sockaddr *sa,
                      int salen, void *arg)
{
    tdp_listener *l = arg;
    /* a server at its limit turns the socket away before any handshake */
    if (l->hooks.admit != NULL && !l->hooks.admit(l->hooks.arg, l->npending)) {
        tdp__conn_refuse(l, fd, TDP_ELIMIT);
        return;
    }
    tdp_pipe *p = tdp__pipe_alloc(l->loop, &l->opts);
    if (p == NULL) {
        evutil_closesocket(fd);
        return;
    }
    p->listener = l;
    p->lnext = l->pending;
    l->pending = p;
    l->npending++;
    tdp_err rc = tdp__conn_accepted(p, fd, sa);
    if (rc != TDP_OK)
        tdp__pipe_fail(p, rc, "cannot start the handshake");
}

static void unlink_pending(tdp_listener *l, tdp_pipe *p)
{
    for (tdp_pipe **pp = &l->pending; *pp != NULL; pp = &(*pp)->lnext) {
        if (*pp == p) {
            *pp = p->lnext;
            p->lnext = NULL;
            l->npending--;
            return;
        }
    }
}

void tdp__listener_ready(tdp_listener *l, tdp_pipe *p)
{
    unlink_pending(l, p);
    if (l->on_accept != NULL) {
        l->on_accept(p, TDP_OK, l->arg);
        return;
    }
    pthread_mutex_lock(&l->mtx);
    p->lnext = NULL;
    if (l->ready_tail != NULL)
        l->ready_tail->lnext = p;
    else
        l->ready = p;
    l->ready_tail = p;
    l->has_ready = true;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mtx);
}

void tdp__listener_drop(tdp_listener *l, tdp_pipe *p)
{
    unlink_pending(l, p);
    tdp_log_debug("handshake with %s failed: %s", p->peer_name, tdp_strerror(p->status));
    if (l->hooks.handshake_failed != NULL)
        l->hooks.handshake_failed(l->hooks.arg, p->status);
    tdp__reg_defer_destroy(p); /* we may be inside its socket's callback */
}

typedef struct listen_req {
    tdp_listener *l;
    struct sockaddr_storage sa;
    socklen_t salen;
    bool wildcard;
    tdp_err rc;
} listen_req;

static void listen_task(void *arg)
{
    listen_req *r = arg;
    tdp_listener *l = r->l;
    /* the workers every accepted pipe needs: a failing UCX fails the listener, not each accept */
    tdp__ucx *ucx;
    if ((r->rc = tdp__ucx_get(l->loop, &ucx)) != TDP_OK)
        return;
    int fd = socket(r->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        r->rc = TDP_EADDR;
        return;
    }
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (r->sa.ss_family == AF_INET6 && r->wildcard)
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero)); /* v4 too */
    if (bind(fd, (struct sockaddr *)&r->sa, r->salen) != 0 || listen(fd, 128) != 0) {
        tdp_log_debug("bind/listen: %s", strerror(errno));
        close(fd);
        r->rc = errno == EADDRINUSE ? TDP_EADDR : TDP_EADDR;
        return;
    }
    struct sockaddr_storage got;
    socklen_t gl = sizeof(got);
    getsockname(fd, (struct sockaddr *)&got, &gl);
    l->port = ntohs(got.ss_family == AF_INET ? ((struct sockaddr_in *)&got)->sin_port
                                             : ((struct sockaddr_in6 *)&got)->sin6_port);
    l->evl[0] = evconnlistener_new(tdp__loop_base(l->loop), accept_cb, l,
                                   LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, -1, fd);
    if (l->evl[0] == NULL) {
        close(fd);
        r->rc = TDP_ENOMEM;
        return;
    }
    r->rc = TDP_OK;
}

tdp_err tdp_listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                         const tdp_pipe_opts *opts, tdp_pipe_cb on_accept, void *arg,
                         tdp_listener **out)
{
    return tdp__listener_new(loop, bind_host, port, opts, on_accept, arg, NULL, out);
}

tdp_err tdp__listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                          const tdp_pipe_opts *opts, tdp_pipe_cb on_accept, void *arg,
                          const tdp__listener_hooks *hooks, tdp_listener **out)
{
    if (loop == NULL || out == NULL)
        return TDP_EINVAL;
    listen_req r = {.rc = TDP_EINTERNAL};
    bool wildcard = bind_host == NULL || bind_host[0] == '\0';
    if (wildcard) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&r.sa;
        s6->sin6_family = AF_INET6;
        s6->sin6_addr = in6addr_any;
        s6->sin6_port = htons(port);
        r.salen = sizeof(*s6);
    } else {
        int n;
        tdp_err rc = tdp__resolve(bind_host, port, true, &r.sa, &r.salen, 1, &n);
        if (rc != TDP_OK)
            return rc;
    }
    r.wildcard = wildcard;
    tdp_listener *l = tdp__calloc(1, sizeof(*l));
    if (l == NULL)
        return TDP_ENOMEM;
    l->loop = loop;
    tdp__opts_resolve(opts, &l->opts, &l->limits);
    l->opts.limits = &l->limits;
    l->on_accept = on_accept;
    l->arg = arg;
    if (hooks != NULL)
        l->hooks = *hooks; /* set before the socket listens: no accept misses them */
    pthread_mutex_init(&l->mtx, NULL);
    pthread_cond_init(&l->cond, NULL);
    r.l = l;
    tdp__call_on_loop(loop, listen_task, &r);
    if (r.rc != TDP_OK) {
        pthread_mutex_destroy(&l->mtx);
        pthread_cond_destroy(&l->cond);
        tdp__free(l);
        return r.rc;
    }
    *out = l;
    return TDP_OK;
}

uint16_t tdp_listener_port(const tdp_listener *l)
{
    return l ? l->port : 0;
}

tdp_err tdp_listener_accept(tdp_listener *l, int64_t timeout_ms, tdp_pipe **out)
{
    if (l == NULL || out == NULL || l->on_accept != NULL ||
        (tdp__loop_running(l->loop) && tdp_loop_on_thread(l->loop)))
        return TDP_EINVAL;
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    if (!tdp__loop_running(l->loop)) {
        if (!l->has_ready && tdp__loop_run_until(l->loop, &l->has_ready, timeout_ms) != TDP_OK)
            return TDP_ETIMEDOUT;
        pthread_mutex_lock(&l->mtx);
    } else {
        pthread_mutex_lock(&l->mtx);
        while (!l->has_ready && tdp__cond_wait_until(&l->cond, &l->mtx, deadline))
            ;
    }
    tdp_pipe *p = l->ready;
    if (p != NULL) {
        l->ready = p->lnext;
        if (l->ready == NULL) {
            l->ready_tail = NULL;
            l->has_ready = false;
        }
        p->lnext = NULL;
    }
    pthread_mutex_unlock(&l->mtx);
    if (p == NULL)
        return TDP_ETIMEDOUT;
    *out = p;
    return TDP_OK;
}

static void listener_free_task(void *arg)
{
    tdp_listener *l = arg;
    for (int i = 0; i < 2; i++)
        if (l->evl[i] != NULL)
            evconnlistener_free(l->evl[i]);
    tdp__conn_refusals_free(l);
    while (l->pending != NULL) {
        tdp_pipe *p = l->pending;
        l->pending = p->lnext;
        tdp__pipe_destroy(p);
    }
    while (l->ready != NULL) {
        tdp_pipe *p = l->ready;
        l->ready = p->lnext;
        tdp_pipe_free(p);
    }
}

void tdp_listener_free(tdp_listener *l)
{
    if (l == NULL)
        return;
    tdp__call_on_loop(l->loop, listener_free_task, l);
    pthread_mutex_destroy(&l->mtx);
    pthread_cond_destroy(&l->cond);
    tdp__free(l);
}
