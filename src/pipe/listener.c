/*
 * listener.c: tdp_listener — accept, admission and its limits (handshakes
 * under way, per source), handshaking pipes, the ready queue.
 */
#include <errno.h>
#include <event2/listener.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "listener.h"
#include "op.h"
#include "session.h"
#include "ucx/ucx_workers.h"
#include "../core/alloc.h"
#include "../core/log.h"

#define REFUSAL_MS 2000 /* at most this long, or the handshake deadline */
#define DEFAULT_MAX_PENDING 256u
/*
 * Connections the kernel completes before the loop accepts them (it caps
 * this at net.core.somaxconn, 4096 on current kernels). With 128, a burst
 * of connections (a flood, or many workers starting at once) had the
 * kernel drop the SYNs past it: those clients waited for a SYN
 * retransmission, 1 s and more, while the listener was idle.
 */
#define LISTEN_BACKLOG      4096
#define DEFAULT_PER_SOURCE  32u

/* Where a socket comes from, for per-source limits: an IPv4 address or an IPv6 /64. */
typedef struct source {
    uint8_t len; /* 4 or 8 bytes of b; 0: unknown (never equal) */
    uint8_t b[8];
} source;

/* A pipe handshaking or ready to be claimed. */
typedef struct pend {
    tdp_listener *l;
    tdp_pipe *p;
    source src;
    struct pend *prev, *next;
} pend;

struct tdp_listener {
    tdp_loop *loop;
    tdp_listener_opts lo; /* lo.pipe: see opts */
    tdp_pipe_opts opts;
    tdp_schema_limits limits;
    uint8_t secret[TDP_SECRET_MAX]; /* opts.secret points here */
    struct evconnlistener *evl;
    uint16_t port;
    tdp_pipe_cb on_accept;
    void *arg;
    pend *pending; /* handshaking, newest first */
    uint32_t npending;
    tdp__listener_hooks hooks;
    struct event *resume; /* accepting paused: out of fds or memory */
    int64_t pause_ms;
    uint64_t pauses;
    tdp__refusals refusals;
    pend *ready, *ready_tail; /* under mtx */
    volatile bool has_ready;
    pthread_mutex_t mtx;
    pthread_cond_t cond;
};

static void unlink_pending(tdp_listener *l, pend *e)
{
    if (e->prev != NULL)
        e->prev->next = e->next;
    else
        l->pending = e->next;
    if (e->next != NULL)
        e->next->prev = e->prev;
    e->prev = e->next = NULL;
    l->npending--;
    if (l->hooks.pending != NULL)
        l->hooks.pending(l->hooks.arg, l->npending);
}

/* The handshake of e->p ended. */
static void on_ready(tdp_pipe *p, tdp_err status, void *arg)
{
    pend *e = arg;
    tdp_listener *l = e->l;
    unlink_pending(l, e);
    if (p == NULL) {
        tdp_log_debug("a handshake failed: %s", tdp_strerror(status));
        if (l->hooks.handshake_failed != NULL)
            l->hooks.handshake_failed(l->hooks.arg, status);
        tdp__free(e);
        return;
    }
    if (l->on_accept != NULL) {
        tdp__free(e);
        l->on_accept(p, TDP_OK, l->arg);
        return;
    }
    pthread_mutex_lock(&l->mtx);
    if (l->ready_tail != NULL)
        l->ready_tail->next = e;
    else
        l->ready = e;
    l->ready_tail = e;
    l->has_ready = true;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mtx);
}

static source source_of(const struct sockaddr *sa)
{
    source s = {0};
    if (sa->sa_family == AF_INET) {
        s.len = 4;
        memcpy(s.b, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, 4);
    } else if (sa->sa_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr.s6_addr;
        if (IN6_IS_ADDR_V4MAPPED((const struct in6_addr *)(const void *)a)) {
            s.len = 4; /* a dual-stack socket's IPv4 peer is the same source as over IPv4 */
            memcpy(s.b, a + 12, 4);
        } else {
            s.len = 8;
            memcpy(s.b, a, 8);
        }
    }
    return s;
}

static uint32_t count_source(const tdp_listener *l, const source *s)
{
    uint32_t n = 0;
    if (s->len == 0)
        return 0;
    for (const pend *e = l->pending; e != NULL; e = e->next)
        n += e->src.len == s->len && memcmp(e->src.b, s->b, s->len) == 0;
    return n;
}

/*
 * Make room for a newcomer: the oldest handshake goes. A real client
 * completes its handshake in a round trip or two; a socket still silent
 * after all the newer ones is the likeliest stranger.
 */
static void evict_oldest(tdp_listener *l)
{
    pend *e = l->pending;
    if (e == NULL)
        return;
    while (e->next != NULL)
        e = e->next;
    unlink_pending(l, e);
    tdp_log_debug("dropping the oldest handshake (%s) for a newer one", tdp__session_peer(e->p));
    if (l->hooks.handshake_failed != NULL)
        l->hooks.handshake_failed(l->hooks.arg, TDP_ELIMIT);
    tdp__session_destroy(e->p);
    tdp__free(e);
}

/* "ip:port" ("[ip]:port" for IPv6), as ctl.c names its peers. */
static void peer_name(const struct sockaddr *sa, int salen, char *out, size_t len)
{
    char host[INET6_ADDRSTRLEN], serv[8];
    if (getnameinfo(sa, (socklen_t)salen, host, sizeof(host), serv, sizeof(serv),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
        snprintf(out, len, "?");
        return;
    }
    snprintf(out, len, sa->sa_family == AF_INET6 ? "[%s]:%s" : "%s:%s", host, serv);
}

/*
 * Who may start a handshake: the server's own check (clients, shutdown),
 * then the limits (one source's share, the oldest making room), then the
 * application's hook. TDP_OK, or the reason for a refusal; *evict: the
 * oldest handshake must go first.
 */
static tdp_err admission(tdp_listener *l, const source *src, const char *peer, bool *evict)
{
    uint32_t nsource = count_source(l, src);
    *evict = false;
    if (l->hooks.admit != NULL && !l->hooks.admit(l->hooks.arg, l->npending))
        return TDP_ELIMIT; /* counted by the server */
    tdp_err why = TDP_OK;
    if (nsource >= l->lo.max_per_source) {
        tdp_log_debug("refusing %s: %u handshakes under way from its source", peer, nsource);
        why = TDP_ELIMIT;
    } else if (l->lo.admit != NULL) {
        tdp_accept_info info = {.peer = peer, .pending = l->npending, .from_source = nsource};
        why = l->lo.admit(&info, l->lo.hook_arg);
        if (why != TDP_OK)
            tdp_log_debug("refusing %s: %s", peer, tdp_strerror(why));
    }
    if (why != TDP_OK) {
        if (l->hooks.refused != NULL)
            l->hooks.refused(l->hooks.arg, why);
        return why;
    }
    *evict = l->npending >= l->lo.max_pending;
    return TDP_OK;
}

/* The peer's HELLO is in (on_hello set): the application picks this pipe's options. */
static tdp_err hello_hook(void *arg, const tdp_hello *h, tdp_pipe_opts *opts)
{
    pend *e = arg;
    tdp_listener *l = e->l;
    uint32_t nsource = count_source(l, &e->src);
    tdp_accept_info info = {
        .peer = tdp__session_peer(e->p),
        .pending = l->npending > 0 ? l->npending - 1 : 0, /* not this one */
        .from_source = nsource > 0 ? nsource - 1 : 0, /* not this one */
        .want_depth = h->want_depth,
        .peer_depth = h->recv_depth,
    };
    return l->lo.on_hello(&info, opts, l->lo.hook_arg);
}

static void accept_cb(struct evconnlistener *evl, evutil_socket_t fd, struct sockaddr *sa,
                      int salen, void *arg)
{
    tdp_listener *l = arg;
    l->pause_ms = 0; /* accepting works (again) */
    source src = source_of(sa);
    char peer[INET6_ADDRSTRLEN + 16];
    peer_name(sa, salen, peer, sizeof(peer));
    bool evict;
    tdp_err why = admission(l, &src, peer, &evict);
    if (why != TDP_OK) {
        /* turned away before any handshake: a BYE instead of a HELLO */
        int64_t ms = l->opts.connect_timeout_ms < REFUSAL_MS ? l->opts.connect_timeout_ms
                                                             : REFUSAL_MS;
        tdp__ctl_refuse(&l->refusals, l->loop, fd, why, ms);
        return;
    }
    if (evict)
        evict_oldest(l);
    tdp_err rc;
    pend *e = tdp__calloc(1, sizeof(*e));
    tdp_pipe *p = e != NULL ? tdp__session_new(l->loop, &l->opts, &l->limits, &rc) : NULL;
    if (p == NULL) {
        tdp__free(e);
        evutil_closesocket(fd);
        return;
    }
    e->l = l;
    e->p = p;
    e->src = src;
    e->next = l->pending;
    if (l->pending != NULL)
        l->pending->prev = e;
    l->pending = e;
    l->npending++;
    if (l->hooks.pending != NULL)
        l->hooks.pending(l->hooks.arg, l->npending);
    if (l->hooks.budget != NULL)
        tdp__session_set_budget(p, l->hooks.budget);
    if (l->lo.on_hello != NULL)
        tdp__session_answer_hello(p, hello_hook, e);
    rc = tdp__session_accept(p, fd, sa, on_ready, e);
    if (rc != TDP_OK) { /* nothing was called back */
        unlink_pending(l, e);
        tdp__free(e);
        tdp__session_destroy(p);
    }
}

static void resume_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_listener *l = arg;
    (void)fd;
    (void)what;
    if (l->evl != NULL)
        evconnlistener_enable(l->evl); /* an accept that fails again pauses again */
}

/*
 * accept failed. Out of descriptors or memory, the pending connection stays
 * in the backlog and the socket stays readable: accepting again at once
 * would spin (and log) without end. Pause, with a backoff up to a second,
 * and say so once per episode; the backlog keeps what arrives meanwhile.
 * Other errors (a connection aborted before it was accepted) are the
 * peer's and cost nothing.
 */
static void accept_error_cb(struct evconnlistener *evl, void *arg)
{
    tdp_listener *l = arg;
    int e = EVUTIL_SOCKET_ERROR();
    if (e != EMFILE && e != ENFILE && e != ENOBUFS && e != ENOMEM) {
        tdp_log_debug("accept: %s", strerror(e));
        return;
    }
    evconnlistener_disable(evl);
    if (l->pause_ms == 0) {
        tdp_log_warn("accept: %s: not accepting new connections until descriptors free up",
                     strerror(e));
        l->pause_ms = 10;
    } else if (l->pause_ms < 1000) {
        l->pause_ms *= 2;
    }
    l->pauses++;
    if (l->resume == NULL)
        l->resume = evtimer_new(tdp__loop_base(l->loop), resume_cb, l);
    struct timeval tv = {l->pause_ms / 1000, (l->pause_ms % 1000) * 1000};
    if (l->resume == NULL || evtimer_add(l->resume, &tv) != 0)
        evconnlistener_enable(evl); /* cannot time a pause: better to spin than to stop */
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
    tdp__ucx *ucx;
    /* the ucx plane serves every peer: a listener without it would accept nobody */
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
    if (bind(fd, (struct sockaddr *)&r->sa, r->salen) != 0 || listen(fd, LISTEN_BACKLOG) != 0) {
        tdp_log_debug("bind/listen: %s", strerror(errno));
        close(fd);
        r->rc = TDP_EADDR;
        return;
    }
    struct sockaddr_storage got;
    socklen_t gl = sizeof(got);
    getsockname(fd, (struct sockaddr *)&got, &gl);
    l->port = ntohs(got.ss_family == AF_INET ? ((struct sockaddr_in *)&got)->sin_port
                                             : ((struct sockaddr_in6 *)&got)->sin6_port);
    l->evl = evconnlistener_new(tdp__loop_base(l->loop), accept_cb, l,
                                LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC,
                                0 /* listening already: -1 would listen(128) again */, fd);
    if (l->evl == NULL) {
        close(fd);
        r->rc = TDP_ENOMEM;
        return;
    }
    evconnlistener_set_error_cb(l->evl, accept_error_cb);
    r->rc = TDP_OK;
}

void tdp_listener_opts_default(tdp_listener_opts *o)
{
    if (o == NULL)
        return;
    *o = (tdp_listener_opts){
        .size = sizeof(*o),
        .max_pending = DEFAULT_MAX_PENDING,
        .max_per_source = DEFAULT_PER_SOURCE,
    };
    tdp_pipe_opts_default(&o->pipe);
}

/* Defaults for what the caller left zero or did not know of (a smaller size). */
static void listener_opts_resolve(const tdp_listener_opts *in, tdp_listener_opts *out)
{
    tdp_listener_opts_default(out);
    if (in == NULL)
        return;
    size_t n = in->size < sizeof(*in) ? in->size : sizeof(*in);
#define TAKE(f)                                                                                    \
    if (offsetof(tdp_listener_opts, f) + sizeof(in->f) <= n && in->f)                              \
        out->f = in->f;
    TAKE(max_pending)
    TAKE(max_per_source)
    TAKE(admit)
    TAKE(on_hello)
    TAKE(hook_arg)
#undef TAKE
    if (offsetof(tdp_listener_opts, pipe) + sizeof(in->pipe) <= n && in->pipe.size != 0)
        out->pipe = in->pipe;
}

tdp_err tdp_listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                         const tdp_pipe_opts *opts, tdp_pipe_cb on_accept, void *arg,
                         tdp_listener **out)
{
    tdp_listener_opts lo;
    tdp_listener_opts_default(&lo);
    if (opts != NULL)
        lo.pipe = *opts;
    return tdp__listener_new(loop, bind_host, port, &lo, on_accept, arg, NULL, out);
}

tdp_err tdp_listener_new_opts(tdp_loop *loop, const char *bind_host, uint16_t port,
                              const tdp_listener_opts *opts, tdp_pipe_cb on_accept, void *arg,
                              tdp_listener **out)
{
    return tdp__listener_new(loop, bind_host, port, opts, on_accept, arg, NULL, out);
}

tdp_err tdp__listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                          const tdp_listener_opts *opts, tdp_pipe_cb on_accept, void *arg,
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
    listener_opts_resolve(opts, &l->lo);
    tdp__opts_resolve(&l->lo.pipe, &l->opts, &l->limits);
    l->lo.pipe.limits = NULL; /* copied into l->limits; the caller's may not outlive this call */
    l->lo.pipe.secret = NULL; /* copied below */
    if (l->opts.secret != NULL) {
        if (l->opts.secret_len < TDP_SECRET_MIN || l->opts.secret_len > TDP_SECRET_MAX) {
            tdp__free(l);
            return TDP_EINVAL;
        }
        memcpy(l->secret, l->opts.secret, l->opts.secret_len);
        l->opts.secret = l->secret;
    }
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
    pthread_mutex_lock(&l->mtx);
    tdp__loop_wait(l->loop, &l->mtx, &l->cond, &l->has_ready, deadline);
    pend *e = l->ready;
    if (e != NULL) {
        l->ready = e->next;
        if (l->ready == NULL) {
            l->ready_tail = NULL;
            l->has_ready = false;
        }
    }
    pthread_mutex_unlock(&l->mtx);
    if (e == NULL)
        return TDP_ETIMEDOUT;
    *out = e->p;
    tdp__free(e);
    return TDP_OK;
}

static void listener_free_task(void *arg)
{
    tdp_listener *l = arg;
    if (l->evl != NULL)
        evconnlistener_free(l->evl);
    l->evl = NULL;
    if (l->resume != NULL)
        event_free(l->resume);
    l->resume = NULL;
    tdp__ctl_refusals_free(&l->refusals);
    while (l->pending != NULL) {
        pend *e = l->pending;
        unlink_pending(l, e);
        tdp__session_destroy(e->p);
        tdp__free(e);
    }
    while (l->ready != NULL) {
        pend *e = l->ready;
        l->ready = e->next;
        tdp_pipe_free(e->p);
        tdp__free(e);
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
