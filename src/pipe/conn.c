/*
 * conn.c: the control socket of a pipe — connect, accept, the HELLO
 * exchange that sets up the UCX endpoint, BYE, and liveness: when the peer
 * process dies its socket closes at once, and TCP keepalive covers a peer
 * host that vanishes.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <unistd.h>

#include "pipe_int.h"
#include "../core/alloc.h"
#include "../core/log.h"

static void conn_read_cb(struct bufferevent *bev, void *arg);
static void conn_event_cb(struct bufferevent *bev, short what, void *arg);

static void set_sockopts(tdp_pipe *p, evutil_socket_t fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &p->opts.keepalive_idle_s, sizeof(int));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &p->opts.keepalive_intvl_s, sizeof(int));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &p->opts.keepalive_cnt, sizeof(int));
    /* unacknowledged data also ends the connection after the same time */
    unsigned int ums = (unsigned int)(p->opts.keepalive_idle_s +
                                      p->opts.keepalive_intvl_s * p->opts.keepalive_cnt) *
                       1000u;
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ums, sizeof(ums));
}

static void name_peer(tdp_pipe *p, const struct sockaddr *sa)
{
    char host[INET6_ADDRSTRLEN] = "?";
    unsigned port = 0;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *s4 = (const void *)sa;
        inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
        port = ntohs(s4->sin_port);
        snprintf(p->peer_name, sizeof(p->peer_name), "%s:%u", host, port);
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const void *)sa;
        inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
        port = ntohs(s6->sin6_port);
        snprintf(p->peer_name, sizeof(p->peer_name), "[%s]:%u", host, port);
    }
}

static tdp_err send_hello(tdp_pipe *p)
{
    const void *addr, *laddr;
    size_t alen, llen;
    tdp_err rc = tdp__reg_worker_address(p->loop, TDP_WORKER_ANY, &addr, &alen);
    if (rc == TDP_OK)
        rc = tdp__reg_worker_address(p->loop, TDP_WORKER_LOCAL, &laddr, &llen);
    if (rc != TDP_OK)
        return rc;
    tdp_hello h = {
        .recv_depth = p->depth,
        .peer_mode = (uint32_t)p->opts.peer_mode,
        .caps = TDP_CAP_MEM_HOST | TDP_CAP_PLANE_UCX | (tdp_cuda_built() ? TDP_CAP_MEM_CUDA : 0),
        .max_msg_bytes = p->limits.max_total_bytes,
        .token = p->token,
        .addr_len = (uint32_t)alen,
        .addr = addr,
        .local_addr_len = (uint32_t)llen,
        .local_addr = laddr,
    };
    memcpy(h.host_id, tdp__host_id(), TDP_HOST_ID_LEN);
    size_t n = tdp_wire_hello_size(&h);
    uint8_t *buf = tdp__malloc(n);
    if (buf == NULL)
        return TDP_ENOMEM;
    tdp_wire_hello_encode(buf, &h);
    int r = bufferevent_write(p->bev, buf, n);
    tdp__free(buf);
    p->hello_sent = true;
    return r == 0 ? TDP_OK : TDP_ENOMEM;
}

static void connect_timeout_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (p->state == PIPE_CONNECTING)
        tdp__pipe_fail(p, TDP_ETIMEDOUT, "connect/handshake deadline passed");
}

static void arm_timer(tdp_pipe *p, int64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    if (p->timer == NULL)
        p->timer = evtimer_new(tdp__loop_base(p->loop), connect_timeout_cb, p);
    if (p->timer != NULL)
        evtimer_add(p->timer, &tv);
}

tdp_err tdp__conn_start_connect(tdp_pipe *p, const struct sockaddr *sa, socklen_t salen)
{
    p->bev = bufferevent_socket_new(tdp__loop_base(p->loop), -1, BEV_OPT_CLOSE_ON_FREE);
    if (p->bev == NULL)
        return TDP_ENOMEM;
    name_peer(p, sa);
    bufferevent_setcb(p->bev, conn_read_cb, NULL, conn_event_cb, p);
    arm_timer(p, p->opts.connect_timeout_ms);
    if (bufferevent_socket_connect(p->bev, sa, (int)salen) != 0) {
        int e = EVUTIL_SOCKET_ERROR();
        tdp_log_debug("connect %s: %s", p->peer_name, strerror(e));
        return e == ECONNREFUSED ? TDP_ECONNREFUSED : TDP_EADDR;
    }
    bufferevent_enable(p->bev, EV_READ);
    return TDP_OK;
}

/* An accepted socket: start the handshake at once. */
tdp_err tdp__conn_accepted(tdp_pipe *p, evutil_socket_t fd, const struct sockaddr *sa)
{
    p->bev = bufferevent_socket_new(tdp__loop_base(p->loop), fd, BEV_OPT_CLOSE_ON_FREE);
    if (p->bev == NULL) {
        evutil_closesocket(fd);
        return TDP_ENOMEM;
    }
    name_peer(p, sa);
    set_sockopts(p, fd);
    bufferevent_setcb(p->bev, conn_read_cb, NULL, conn_event_cb, p);
    bufferevent_enable(p->bev, EV_READ);
    arm_timer(p, p->opts.connect_timeout_ms);
    return send_hello(p);
}

static void on_hello(tdp_pipe *p, const uint8_t *payload, size_t len)
{
    tdp_hello h;
    if (p->hello_recv || tdp_wire_hello_decode(payload, len, &h) != TDP_OK) {
        tdp__pipe_fail(p, TDP_EPROTO, "malformed or repeated HELLO");
        return;
    }
    p->hello_recv = true;
    p->peer_hello = h;
    p->peer_hello.addr = NULL; /* points into the socket buffer: used below only */
    p->peer_token = h.token;
    p->peer_depth = h.recv_depth;
    p->same_host = memcmp(h.host_id, tdp__host_id(), TDP_HOST_ID_LEN) == 0;
    /*
     * Which worker, and whether UCX watches for peer failure. Both sides
     * compute the same answer from both HELLOs: a peer on this host, when
     * both have a shared-memory worker, gets that worker without UCX's
     * peer-failure mode (shared memory stays usable; the control socket
     * sees the peer die); any other peer gets the general worker with UCX's
     * peer-failure mode. TDP_PEER_UCX / TDP_PEER_SOCKET force the general
     * worker with / without it.
     */
    bool local = p->same_host && h.local_addr_len > 0 &&
                 tdp__ucx_peek(p->loop)->worker[TDP_WORKER_LOCAL] != NULL;
    int seen = p->wi;
    p->wi = TDP_WORKER_ANY;
    if (h.peer_mode == TDP_PEER_UCX || p->opts.peer_mode == TDP_PEER_UCX) {
        p->peer_mode_ucx = true;
    } else if (h.peer_mode == TDP_PEER_SOCKET || p->opts.peer_mode == TDP_PEER_SOCKET) {
        p->peer_mode_ucx = false;
    } else if (local) {
        p->peer_mode_ucx = false;
        p->wi = TDP_WORKER_LOCAL;
    } else {
        p->peer_mode_ucx = true;
    }

    if (p->wi_seen && seen != p->wi) {
        tdp__pipe_fail(p, TDP_EPROTO, "the peer chose another worker than this side would");
        return;
    }
    tdp_err rc = p->wi == TDP_WORKER_LOCAL
                     ? tdp__pipe_open_ep(p, h.local_addr, h.local_addr_len)
                     : tdp__pipe_open_ep(p, h.addr, h.addr_len);
    if (rc != TDP_OK)
        tdp__pipe_fail(p, rc, "cannot create the UCX endpoint");
}

/*
 * Handle every whole frame in the input. A frame can end the pipe, and a
 * pipe that fails while connecting is freed on the spot (its listener or
 * connect callback drops it): *gone, set by tdp__conn_close, says so, and
 * then p must not be touched again.
 */
static void conn_read_frames(tdp_pipe *p, struct evbuffer *in, const bool *gone)
{
    while (p->state != PIPE_DEAD) {
        uint8_t hb[TDP_CTL_HDR_LEN];
        tdp_ctl_hdr hdr;
        if (evbuffer_copyout(in, hb, sizeof(hb)) < (ev_ssize_t)sizeof(hb))
            return;
        tdp_err rc = tdp_wire_ctl_hdr_decode(hb, &hdr);
        if (rc == TDP_EVERSION) {
            tdp_log_warn("peer %s speaks protocol %u, this library %u", p->peer_name,
                         hdr.version, TDP_PROTOCOL_VERSION);
            tdp__pipe_fail(p, TDP_EVERSION, "protocol version mismatch");
            return;
        }
        if (rc != TDP_OK) {
            tdp__pipe_fail(p, TDP_EPROTO, "malformed control frame");
            return;
        }
        size_t total = TDP_CTL_HDR_LEN + hdr.length;
        if (evbuffer_get_length(in) < total)
            return;
        const uint8_t *f = evbuffer_pullup(in, (ev_ssize_t)total);
        if (f == NULL) {
            tdp__pipe_fail(p, TDP_ENOMEM, "cannot buffer control frame");
            return;
        }
        if (hdr.type == TDP_CTL_HELLO) {
            on_hello(p, f + TDP_CTL_HDR_LEN, hdr.length);
        } else {
            tdp_bye bye;
            if (tdp_wire_bye_decode(f + TDP_CTL_HDR_LEN, hdr.length, &bye) != TDP_OK)
                tdp__pipe_fail(p, TDP_EPROTO, "malformed BYE");
            else
                tdp__pipe_on_bye(p, &bye);
        }
        if (*gone)
            return; /* the pipe closed its socket (or was freed) handling the frame */
        evbuffer_drain(in, total);
    }
}

static void conn_read_cb(struct bufferevent *bev, void *arg)
{
    tdp_pipe *p = arg;
    bool gone = false;
    p->conn_gone = &gone;
    conn_read_frames(p, bufferevent_get_input(bev), &gone);
    if (!gone)
        p->conn_gone = NULL; /* when gone, tdp__conn_close cleared it */
}

static void conn_event_cb(struct bufferevent *bev, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (what & BEV_EVENT_CONNECTED) {
        set_sockopts(p, bufferevent_getfd(bev));
        tdp_err rc = send_hello(p);
        if (rc != TDP_OK)
            tdp__pipe_fail(p, rc, "cannot send HELLO");
        return;
    }
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) {
        int e = EVUTIL_SOCKET_ERROR();
        if (p->state == PIPE_CONNECTING && !p->hello_sent) {
            if (p->iaddr + 1 < p->naddr) { /* e.g. localhost: ::1 refused, try 127.0.0.1 */
                bufferevent_free(p->bev);
                p->bev = NULL;
                p->iaddr++;
                tdp_err rc = tdp__conn_start_connect(p, (struct sockaddr *)&p->addrs[p->iaddr],
                                                     p->addrlens[p->iaddr]);
                if (rc != TDP_OK)
                    tdp__pipe_fail(p, rc, "cannot connect");
                return;
            }
            tdp__pipe_fail(p, e == ECONNREFUSED ? TDP_ECONNREFUSED : TDP_EADDR,
                           "cannot connect");
            return;
        }
        /* an open pipe outlives this; a connecting one may be freed by it */
        void (*hook)(tdp_pipe *, void *) =
            p->state != PIPE_CONNECTING ? p->sock_closed_cb : NULL;
        void *hook_arg = p->sock_closed_arg;
        tdp__pipe_on_socket_closed(p);
        if (hook != NULL)
            hook(p, hook_arg);
    }
}

static void bye_written_cb(struct bufferevent *bev, void *arg)
{
    tdp_pipe *p = arg;
    p->bye_flushed = true;
    bufferevent_setcb(bev, conn_read_cb, NULL, conn_event_cb, p);
    tdp__pipe_check_close(p);
}

void tdp__conn_send_bye(tdp_pipe *p, tdp_err reason)
{
    uint8_t buf[TDP_CTL_HDR_LEN + TDP_BYE_LEN];
    tdp_bye b = {.last_seq = p->send_seq, .reason = reason};
    if (p->bev == NULL || p->bye_sent)
        return;
    tdp_wire_bye_encode(buf, &b);
    p->bye_sent = true;
    bufferevent_setcb(p->bev, conn_read_cb, bye_written_cb, conn_event_cb, p);
    bufferevent_write(p->bev, buf, sizeof(buf));
}

void tdp__conn_close(tdp_pipe *p)
{
    if (p->conn_gone != NULL) {
        *p->conn_gone = true;
        p->conn_gone = NULL;
    }
    if (p->bev != NULL) {
        /* a BYE still queued goes out now: freeing would drop it */
        struct evbuffer *out = bufferevent_get_output(p->bev);
        size_t n = evbuffer_get_length(out);
        if (n > 0 && n <= 256 && bufferevent_getfd(p->bev) >= 0) {
            const void *b = evbuffer_pullup(out, (ev_ssize_t)n);
            /* MSG_NOSIGNAL: a peer already gone must not SIGPIPE the application */
            if (b != NULL)
                (void)!send(bufferevent_getfd(p->bev), b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        bufferevent_free(p->bev);
        p->bev = NULL;
    }
    if (p->timer != NULL) {
        event_free(p->timer);
        p->timer = NULL;
    }
}

/* ---- refusing --------------------------------------------------------------- */

/*
 * A socket the listener will not serve (a server at its client limit). It
 * gets BYE with the reason instead of HELLO, so the connecting side fails
 * with that reason rather than a bare reset. The socket stays open until
 * the peer hangs up: closing with the peer's HELLO unread would send a RST,
 * which can destroy the BYE before the peer reads it.
 */
#define TDP_MAX_REFUSALS 256u /* more at once are closed without a word */
#define TDP_REFUSAL_MS   2000 /* at most this long, or the handshake deadline */

struct tdp__refusal {
    tdp_listener *l;
    struct bufferevent *bev;
    struct event *timer;
    struct tdp__refusal *next;
};

static void refusal_free(struct tdp__refusal *r)
{
    for (struct tdp__refusal **pp = &r->l->refusals; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    }
    r->l->nrefusals--;
    if (r->bev != NULL)
        bufferevent_free(r->bev);
    if (r->timer != NULL)
        event_free(r->timer);
    tdp__free(r);
}

static void refusal_read_cb(struct bufferevent *bev, void *arg)
{
    struct evbuffer *in = bufferevent_get_input(bev);
    evbuffer_drain(in, evbuffer_get_length(in)); /* its HELLO: not read */
}

static void refusal_event_cb(struct bufferevent *bev, short what, void *arg)
{
    if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR))
        refusal_free(arg);
}

static void refusal_written_cb(struct bufferevent *bev, void *arg)
{
    /* the BYE is out: say nothing more, wait for the peer to hang up */
    shutdown(bufferevent_getfd(bev), SHUT_WR);
    bufferevent_setcb(bev, refusal_read_cb, NULL, refusal_event_cb, arg);
}

static void refusal_timeout_cb(evutil_socket_t fd, short what, void *arg)
{
    refusal_free(arg);
}

void tdp__conn_refuse(tdp_listener *l, evutil_socket_t fd, tdp_err reason)
{
    struct tdp__refusal *r = NULL;
    if (l->nrefusals < TDP_MAX_REFUSALS)
        r = tdp__calloc(1, sizeof(*r));
    if (r == NULL) {
        evutil_closesocket(fd);
        return;
    }
    r->l = l;
    r->next = l->refusals;
    l->refusals = r;
    l->nrefusals++;
    r->bev = bufferevent_socket_new(tdp__loop_base(l->loop), fd, BEV_OPT_CLOSE_ON_FREE);
    r->timer = evtimer_new(tdp__loop_base(l->loop), refusal_timeout_cb, r);
    if (r->bev == NULL || r->timer == NULL) {
        if (r->bev == NULL)
            evutil_closesocket(fd);
        refusal_free(r);
        return;
    }
    int64_t ms = l->opts.connect_timeout_ms < TDP_REFUSAL_MS ? l->opts.connect_timeout_ms
                                                             : TDP_REFUSAL_MS;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    evtimer_add(r->timer, &tv);
    uint8_t buf[TDP_CTL_HDR_LEN + TDP_BYE_LEN];
    tdp_bye b = {.last_seq = 0, .reason = reason};
    tdp_wire_bye_encode(buf, &b);
    bufferevent_setcb(r->bev, refusal_read_cb, refusal_written_cb, refusal_event_cb, r);
    bufferevent_enable(r->bev, EV_READ);
    if (bufferevent_write(r->bev, buf, sizeof(buf)) != 0)
        refusal_free(r);
}

void tdp__conn_refusals_free(tdp_listener *l)
{
    while (l->refusals != NULL)
        refusal_free(l->refusals);
}

/* ---- resolving ------------------------------------------------------------ */

tdp_err tdp__resolve(const char *host, uint16_t port, bool passive, struct sockaddr_storage *out,
                     socklen_t *outlen, int max, int *count)
{
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC,
        .ai_socktype = SOCK_STREAM,
        .ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0),
    }, *res = NULL;
    char ps[8];
    snprintf(ps, sizeof(ps), "%u", port);
    int r = getaddrinfo(host && host[0] ? host : NULL, ps, &hints, &res);
    if (r != 0) {
        tdp_log_debug("getaddrinfo(%s): %s", host ? host : "", gai_strerror(r));
        return TDP_EADDR;
    }
    int n = 0;
    for (struct addrinfo *ai = res; ai != NULL && n < max; ai = ai->ai_next) {
        if (ai->ai_addrlen > sizeof(*out))
            continue;
        memcpy(&out[n], ai->ai_addr, ai->ai_addrlen);
        outlen[n++] = ai->ai_addrlen;
    }
    freeaddrinfo(res);
    *count = n;
    return n > 0 ? TDP_OK : TDP_EADDR;
}
