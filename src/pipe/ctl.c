/*
 * ctl.c: the control channel — connect (each resolved address in turn),
 * accept, HELLO and BYE framing, keepalive, and refusing sockets a
 * listener will not serve. It reports to its owner through tdp__ctl_up.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <event2/buffer.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#include "ctl.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../core/loop_int.h"

static void read_cb(struct bufferevent *bev, void *arg);
static void event_cb(struct bufferevent *bev, short what, void *arg);

void tdp__ctl_init(tdp__ctl *c, tdp_loop *loop, const tdp__ctl_opts *o, const tdp__ctl_up *up,
                   void *owner)
{
    memset(c, 0, sizeof(*c));
    c->loop = loop;
    c->opts = *o;
    c->up = up;
    c->owner = owner;
    snprintf(c->peer_name, sizeof(c->peer_name), "?");
}

static void set_sockopts(tdp__ctl *c, evutil_socket_t fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &c->opts.keepalive_idle_s, sizeof(int));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &c->opts.keepalive_intvl_s, sizeof(int));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &c->opts.keepalive_cnt, sizeof(int));
    /*
     * Unacknowledged data also ends the connection after the same time.
     * With TCP_USER_TIMEOUT set, Linux also ends an idle connection by it
     * (time since the peer last answered, once a probe is out) rather than
     * by the probe count: either way, idle or not, the bound is this.
     */
    int64_t secs = (int64_t)c->opts.keepalive_idle_s +
                   (int64_t)c->opts.keepalive_intvl_s * c->opts.keepalive_cnt;
    unsigned int ums = secs > 0 && secs < UINT_MAX / 1000u ? (unsigned int)secs * 1000u : 0;
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ums, sizeof(ums));
}

static void name_peer(tdp__ctl *c, const struct sockaddr *sa)
{
    char host[INET6_ADDRSTRLEN] = "?";
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *s4 = (const void *)sa;
        inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
        snprintf(c->peer_name, sizeof(c->peer_name), "%s:%u", host, ntohs(s4->sin_port));
    } else if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const void *)sa;
        inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
        snprintf(c->peer_name, sizeof(c->peer_name), "[%s]:%u", host, ntohs(s6->sin6_port));
    }
}

static bool addr_loopback(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *s4 = (const void *)ss;
        return (ntohl(s4->sin_addr.s_addr) >> 24) == 127;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const void *)ss;
        const uint8_t *b = s6->sin6_addr.s6_addr;
        return IN6_IS_ADDR_LOOPBACK(&s6->sin6_addr) ||
               (IN6_IS_ADDR_V4MAPPED(&s6->sin6_addr) && b[12] == 127);
    }
    return false;
}

static bool addr_equal(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
    if (a->ss_family != b->ss_family)
        return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)(const void *)a)->sin_addr.s_addr ==
               ((const struct sockaddr_in *)(const void *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return memcmp(&((const struct sockaddr_in6 *)(const void *)a)->sin6_addr,
                      &((const struct sockaddr_in6 *)(const void *)b)->sin6_addr,
                      sizeof(struct in6_addr)) == 0;
    return false;
}

/* See tdp__ctl.peer_local. */
static bool socket_peer_local(evutil_socket_t fd)
{
    struct sockaddr_storage me, peer;
    socklen_t ml = sizeof(me), pl = sizeof(peer);
    if (fd < 0 || getsockname(fd, (struct sockaddr *)&me, &ml) != 0 ||
        getpeername(fd, (struct sockaddr *)&peer, &pl) != 0)
        return false;
    if (me.ss_family == AF_UNIX)
        return true;
    return (addr_loopback(&me) && addr_loopback(&peer)) || addr_equal(&me, &peer);
}

static tdp_err dial_next(tdp__ctl *c)
{
    const struct sockaddr *sa = (const struct sockaddr *)&c->addrs[c->iaddr];
    c->bev = bufferevent_socket_new(tdp__loop_base(c->loop), -1, BEV_OPT_CLOSE_ON_FREE);
    if (c->bev == NULL)
        return TDP_ENOMEM;
    name_peer(c, sa);
    bufferevent_setcb(c->bev, read_cb, NULL, event_cb, c);
    if (bufferevent_socket_connect(c->bev, sa, (int)c->addrlens[c->iaddr]) != 0) {
        int e = EVUTIL_SOCKET_ERROR();
        tdp_log_debug("connect %s: %s", c->peer_name, strerror(e));
        bufferevent_free(c->bev);
        c->bev = NULL;
        return e == ECONNREFUSED ? TDP_ECONNREFUSED : TDP_EADDR;
    }
    bufferevent_enable(c->bev, EV_READ);
    return TDP_OK;
}

tdp_err tdp__ctl_dial(tdp__ctl *c, const struct sockaddr_storage *addrs, const socklen_t *lens,
                      int n)
{
    if (n <= 0 || n > TDP_CTL_MAX_ADDRS)
        return TDP_EINVAL;
    memcpy(c->addrs, addrs, (size_t)n * sizeof(*addrs));
    memcpy(c->addrlens, lens, (size_t)n * sizeof(*lens));
    c->naddr = n;
    c->iaddr = 0;
    c->dialer = true;
    tdp_err rc;
    while ((rc = dial_next(c)) != TDP_OK && c->iaddr + 1 < c->naddr)
        c->iaddr++;
    return rc;
}

tdp_err tdp__ctl_accept(tdp__ctl *c, evutil_socket_t fd, const struct sockaddr *sa)
{
    c->bev = bufferevent_socket_new(tdp__loop_base(c->loop), fd, BEV_OPT_CLOSE_ON_FREE);
    if (c->bev == NULL) {
        evutil_closesocket(fd);
        return TDP_ENOMEM;
    }
    name_peer(c, sa);
    set_sockopts(c, fd);
    c->connected = true;
    bufferevent_setcb(c->bev, read_cb, NULL, event_cb, c);
    bufferevent_enable(c->bev, EV_READ);
    return TDP_OK;
}

bool tdp__ctl_open(const tdp__ctl *c)
{
    return c->bev != NULL;
}

bool tdp__ctl_local_now(const tdp__ctl *c)
{
    return c->bev != NULL && socket_peer_local(bufferevent_getfd(c->bev));
}

/* ---- authentication ---------------------------------------------------------- */

static void hmac_len(crypto_auth_hmacsha256_state *st, uint64_t n)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(n >> (8 * i));
    crypto_auth_hmacsha256_update(st, b, sizeof(b));
}

/*
 * The proof a side sends: HMAC-SHA256, keyed with the secret, over a label,
 * the side's role (so a peer cannot reflect our own proof back) and both
 * HELLOs as sent — their nonces make every proof fresh, and an on-path
 * change to either HELLO makes both proofs fail.
 */
static void auth_tag(const tdp__ctl *c, bool of_dialer, uint8_t out[TDP_AUTH_TAG_LEN])
{
    static const char label[] = "tdpipe HELLO auth v1";
    const uint8_t role = of_dialer ? 'D' : 'A';
    const uint8_t *dh = c->dialer ? c->my_hello : c->peer_hello;
    const uint8_t *ah = c->dialer ? c->peer_hello : c->my_hello;
    size_t dl = c->dialer ? c->my_hello_len : c->peer_hello_len;
    size_t al = c->dialer ? c->peer_hello_len : c->my_hello_len;
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, c->opts.secret, c->opts.secret_len);
    crypto_auth_hmacsha256_update(&st, (const uint8_t *)label, sizeof(label) - 1);
    crypto_auth_hmacsha256_update(&st, &role, 1);
    hmac_len(&st, dl);
    crypto_auth_hmacsha256_update(&st, dh, dl);
    hmac_len(&st, al);
    crypto_auth_hmacsha256_update(&st, ah, al);
    crypto_auth_hmacsha256_final(&st, out);
    sodium_memzero(&st, sizeof(st));
}

/*
 * Out now when nothing is queued before it, not on a later loop turn: the
 * peer's proof (or PROVEN) may be in the same read, and the pipe then opens
 * and its blocking call returns — nobody may run this loop again for a
 * while, and the peer would wait for our frame until its deadline. (The
 * bufferevent's own buffer cannot be written from here: libevent freezes
 * its front.)
 */
static tdp_err write_now(tdp__ctl *c, const uint8_t *buf, size_t len)
{
    size_t off = 0;
    if (evbuffer_get_length(bufferevent_get_output(c->bev)) == 0) {
        ssize_t n = send(bufferevent_getfd(c->bev), buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0)
            off = (size_t)n;
    }
    if (off < len && bufferevent_write(c->bev, buf + off, len - off) != 0)
        return TDP_ENOMEM;
    return TDP_OK;
}

/*
 * Our proof, once both HELLOs are known; the accepting side's only once the
 * dialer's has checked out. A dialer opens on the listener's proof, so it
 * sends nothing on a data plane (and its connect returns nothing) before the
 * listener has its proof and, with an on_hello hook, has let it in.
 */
static tdp_err send_auth(tdp__ctl *c)
{
    uint8_t tag[TDP_AUTH_TAG_LEN], buf[TDP_CTL_HDR_LEN + TDP_AUTH_TAG_LEN];
    if (c->auth_sent || c->my_hello == NULL || c->peer_hello == NULL || c->bev == NULL ||
        (!c->dialer && !c->authed))
        return TDP_OK;
    auth_tag(c, c->dialer, tag);
    tdp_wire_auth_encode(buf, tag);
    c->auth_sent = true;
    return write_now(c, buf, sizeof(buf));
}

static void auth_drop(tdp__ctl *c)
{
    tdp__free(c->my_hello);
    tdp__free(c->peer_hello);
    c->my_hello = c->peer_hello = NULL;
}

/* On close: also a HELLO still waiting for its PROVEN. */
static void held_drop(tdp__ctl *c)
{
    tdp__free(c->held);
    c->held = NULL;
}

/*
 * Our PROVEN frame, once the peer's proof checked out: the records the
 * owner may make for the peer only now (h: the peer's HELLO).
 */
static tdp_err send_proven(tdp__ctl *c, const tdp_hello *h)
{
    tdp_hello out = {0};
    tdp_err rc = c->up->proven(c->owner, h, &out);
    if (rc != TDP_OK || c->bev == NULL)
        return rc;
    size_t n = tdp_wire_proven_size(&out);
    if (n == 0)
        return TDP_EINTERNAL;
    uint8_t *buf = tdp__malloc(n);
    if (buf == NULL)
        return TDP_ENOMEM;
    rc = tdp_wire_proven_encode(buf, &out);
    if (rc == TDP_OK)
        rc = write_now(c, buf, n);
    tdp__free(buf);
    return rc;
}

/* The peer's PROVEN frame: its held HELLO, with these records, goes up. */
static tdp_err read_proven(tdp__ctl *c, const uint8_t *pl, size_t len)
{
    tdp_hello h;
    uint8_t *ph = c->held; /* the records point into it during the call */
    c->held = NULL;
    tdp_err rc = tdp_wire_hello_decode(ph, c->held_len, &h);
    if (rc != TDP_OK) { /* it decoded before */
        tdp__free(ph);
        return TDP_EINTERNAL;
    }
    rc = tdp_wire_proven_decode(pl, len, &h);
    if (rc == TDP_OK)
        c->up->hello(c->owner, &h);
    else
        tdp_log_info("peer %s: malformed PROVEN frame", c->peer_name);
    tdp__free(ph);
    return rc;
}

tdp_err tdp__ctl_send_hello(tdp__ctl *c, const tdp_hello *h)
{
    if (c->bev == NULL)
        return TDP_ECONNRESET;
    size_t n = tdp_wire_hello_size(h);
    if (n == 0)
        return TDP_EINVAL;
    uint8_t *buf = tdp__malloc(n);
    if (buf == NULL)
        return TDP_ENOMEM;
    tdp_err rc = tdp_wire_hello_encode(buf, h);
    if (rc != TDP_OK) {
        tdp__free(buf);
        return rc;
    }
    int r = bufferevent_write(c->bev, buf, n);
    c->proven_mine = h->proven == TDP_PROVEN_V1;
    memcpy(c->my_nonce, h->nonce, TDP_HELLO_NONCE_LEN);
    c->nonce_sent = r == 0;
    if (r == 0 && c->opts.secret != NULL && c->my_hello == NULL && !c->authed) {
        /* kept for the proofs; the header is not part of them */
        memmove(buf, buf + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN);
        c->my_hello = buf;
        c->my_hello_len = n - TDP_CTL_HDR_LEN;
        return send_auth(c); /* the peer's HELLO may be here already */
    }
    tdp__free(buf);
    return r == 0 ? TDP_OK : TDP_ENOMEM;
}

/* End the channel and tell the owner (once). */
static void fail(tdp__ctl *c, tdp_err why)
{
    if (why == TDP_EPROTO || why == TDP_EVERSION || why == TDP_EAUTH) {
        /* tell the peer why; tdp__ctl_close pushes it out */
        tdp_bye b = {.last_seq = 0, .reason = why};
        tdp__ctl_send_bye(c, &b);
    }
    tdp__ctl_close(c);
    c->up->closed(c->owner, why);
}

/*
 * Handle every whole frame in the input. An up-call may close the channel
 * (the owner stays alive until a later loop turn): stop reading then.
 */
static void read_frames(tdp__ctl *c, struct evbuffer *in)
{
    while (c->bev != NULL) {
        uint8_t hb[TDP_CTL_HDR_LEN];
        tdp_ctl_hdr hdr;
        if (evbuffer_copyout(in, hb, sizeof(hb)) < (ev_ssize_t)sizeof(hb))
            return;
        tdp_err rc = tdp_wire_ctl_hdr_decode(hb, &hdr);
        if (rc == TDP_EVERSION) {
            tdp_log_warn("peer %s speaks protocol %u, this library %u", c->peer_name,
                         hdr.version, TDP_PROTOCOL_VERSION);
            fail(c, TDP_EVERSION);
            return;
        }
        if (rc != TDP_OK) {
            tdp_log_info("peer %s: malformed control frame (not a tdpipe peer?)", c->peer_name);
            fail(c, TDP_EPROTO);
            return;
        }
        size_t total = TDP_CTL_HDR_LEN + hdr.length;
        if (evbuffer_get_length(in) < total)
            return;
        const uint8_t *f = evbuffer_pullup(in, (ev_ssize_t)total);
        if (f == NULL) {
            fail(c, TDP_ENOMEM);
            return;
        }
        if (hdr.type == TDP_CTL_HELLO) {
            tdp_hello h;
            rc = c->hello_seen ? TDP_EPROTO
                               : tdp_wire_hello_decode(f + TDP_CTL_HDR_LEN, hdr.length, &h);
            if (rc != TDP_OK) {
                tdp_log_info("peer %s: %s", c->peer_name,
                             rc == TDP_EVERSION ? "its HELLO needs an extension this side lacks"
                                                : "malformed or repeated HELLO");
                fail(c, rc == TDP_EVERSION ? TDP_EVERSION : TDP_EPROTO);
                return;
            }
            if (c->nonce_sent && memcmp(h.nonce, c->my_nonce, TDP_HELLO_NONCE_LEN) == 0) {
                /* our own HELLO sent back: a mirror, not a peer */
                tdp_log_info("peer %s: echoed our own HELLO (not a tdpipe peer)", c->peer_name);
                fail(c, TDP_EPROTO);
                return;
            }
            c->hello_seen = true;
            /* asked now: a dialed socket's HELLO can be read before its connect event */
            c->peer_local = socket_peer_local(bufferevent_getfd(c->bev));
            if (c->up->hello_in != NULL && c->opts.secret == NULL) {
                /* with a secret: once the peer has proven it holds it (below) */
                c->up->hello_in(c->owner, &h); /* may send our HELLO, or close */
                if (c->bev == NULL)
                    return;
            }
            if (c->opts.secret == NULL && h.auth == 0 && c->proven_mine &&
                h.proven == TDP_PROVEN_V1) {
                /* both offered PROVEN: what the chosen plane makes only for
                 * a peer on this host goes out now; the peer's HELLO waits
                 * for the peer's own PROVEN */
                uint8_t *ph = tdp__malloc(hdr.length);
                if (ph == NULL) {
                    fail(c, TDP_ENOMEM);
                    return;
                }
                memcpy(ph, f + TDP_CTL_HDR_LEN, hdr.length);
                rc = send_proven(c, &h);
                if (rc != TDP_OK || c->bev == NULL) {
                    tdp__free(ph);
                    if (c->bev != NULL)
                        fail(c, rc == TDP_ENOMEM ? rc : TDP_EINTERNAL);
                    return;
                }
                c->held = ph;
                c->held_len = hdr.length;
            } else if (c->opts.secret == NULL && h.auth == 0) {
                c->up->hello(c->owner, &h);
            } else if (c->opts.secret == NULL || h.auth != TDP_AUTH_HMAC_SHA256) {
                tdp_log_warn("peer %s: %s", c->peer_name,
                             c->opts.secret == NULL ? "requires a shared secret; this side has none"
                             : h.auth == 0          ? "has no shared secret; this side requires one"
                                                    : "asks for an unknown authentication method");
                fail(c, TDP_EAUTH);
                return;
            } else {
                /* held back until the peer proves it holds the secret */
                c->peer_hello = tdp__malloc(hdr.length);
                if (c->peer_hello == NULL) {
                    fail(c, TDP_ENOMEM);
                    return;
                }
                memcpy(c->peer_hello, f + TDP_CTL_HDR_LEN, hdr.length);
                c->peer_hello_len = hdr.length;
                if (send_auth(c) != TDP_OK) {
                    fail(c, TDP_ENOMEM);
                    return;
                }
            }
        } else if (hdr.type == TDP_CTL_AUTH) {
            uint8_t want[TDP_AUTH_TAG_LEN];
            if (c->opts.secret == NULL || c->peer_hello == NULL || c->my_hello == NULL ||
                c->authed) {
                tdp_log_info("peer %s: unexpected AUTH frame", c->peer_name);
                fail(c, TDP_EPROTO);
                return;
            }
            auth_tag(c, !c->dialer, want);
            if (crypto_verify_32(want, f + TDP_CTL_HDR_LEN) != 0) {
                tdp_log_warn("peer %s: wrong shared secret", c->peer_name);
                fail(c, TDP_EAUTH);
                return;
            }
            c->authed = true;
            uint8_t *ph = c->peer_hello; /* the records point into it during the calls */
            size_t pl = c->peer_hello_len;
            c->peer_hello = NULL;
            tdp_hello h;
            rc = tdp_wire_hello_decode(ph, pl, &h);
            if (rc == TDP_OK && c->up->hello_in != NULL)
                c->up->hello_in(c->owner, &h); /* may close */
            if (rc == TDP_OK && c->bev != NULL) {
                c->peer_hello = ph; /* send_auth covers it */
                rc = send_auth(c);
                c->peer_hello = NULL;
            }
            auth_drop(c);
            bool proven = c->proven_mine && h.proven == TDP_PROVEN_V1;
            if (rc == TDP_OK && c->bev != NULL && proven) {
                /* what may exist only now goes out; the peer's HELLO waits
                 * for the peer's own PROVEN */
                rc = send_proven(c, &h);
                if (rc == TDP_OK && c->bev != NULL) {
                    c->held = ph;
                    c->held_len = pl;
                    ph = NULL;
                }
            } else if (rc == TDP_OK && c->bev != NULL) {
                c->up->hello(c->owner, &h);
            }
            tdp__free(ph);
            if (rc != TDP_OK && c->bev != NULL) {
                /* no memory, or the owner could not describe its planes */
                fail(c, rc == TDP_ENOMEM ? rc : TDP_EINTERNAL);
                return;
            }
        } else if (hdr.type == TDP_CTL_PROVEN) {
            if (c->held == NULL) {
                /* before the proofs, or not offered, or repeated */
                tdp_log_info("peer %s: unexpected PROVEN frame", c->peer_name);
                fail(c, TDP_EPROTO);
                return;
            }
            rc = read_proven(c, f + TDP_CTL_HDR_LEN, hdr.length);
            if (rc != TDP_OK && c->bev != NULL) {
                fail(c, rc);
                return;
            }
        } else if (hdr.type == TDP_CTL_READY || hdr.type == TDP_CTL_BYE) {
            if (!tdp__ctl_small(c, hdr.type, f + TDP_CTL_HDR_LEN, hdr.length))
                return;
        } else {
            /* a PLANE frame before this side carries a plane */
            tdp_log_info("peer %s: data plane frame on a channel that carries none", c->peer_name);
            fail(c, TDP_EPROTO);
            return;
        }
        if (c->bev == NULL)
            return;
        evbuffer_drain(in, total);
        if (c->carry != NULL) {
            /* the frame that chose the tcp plane: what follows is the carrier's */
            c->carry_ops->take(c, in);
            return;
        }
    }
}

bool tdp__ctl_small(tdp__ctl *c, uint16_t type, const uint8_t *pl, size_t len)
{
    if (type == TDP_CTL_READY) {
        tdp_ready r;
        if (!c->hello_seen || c->held != NULL || c->peer_hello != NULL ||
            tdp_wire_ready_decode(pl, len, &r) != TDP_OK) {
            /* before the HELLO went up, or malformed */
            tdp_log_info("peer %s: unexpected or malformed READY", c->peer_name);
            fail(c, TDP_EPROTO);
            return false;
        }
        if (c->up->ready != NULL)
            c->up->ready(c->owner, &r);
        return c->bev != NULL;
    }
    tdp_bye bye;
    if (tdp_wire_bye_decode(pl, len, &bye) != TDP_OK) {
        tdp_log_info("peer %s: malformed BYE", c->peer_name);
        fail(c, TDP_EPROTO);
        return false;
    }
    c->up->bye(c->owner, &bye);
    return c->bev != NULL;
}

void tdp__ctl_fail(tdp__ctl *c, tdp_err why)
{
    fail(c, why);
}

void tdp__ctl_bev_written(tdp__ctl *c, bufferevent_data_cb written)
{
    bufferevent_setcb(c->bev, NULL, written, event_cb, c);
}

static void read_cb(struct bufferevent *bev, void *arg)
{
    tdp__ctl *c = arg;
    if (c->greeting != NULL)
        evtimer_del(c->greeting); /* the peer speaks; what it says is judged below */
    c->reading = true;
    read_frames(c, bufferevent_get_input(bev));
    c->reading = false;
}

void tdp__ctl_pump(tdp__ctl *c)
{
    if (c->bev == NULL || c->reading)
        return;
    if (c->carry != NULL) {
        c->carry_ops->pump(c);
        return;
    }
    struct evbuffer *in = bufferevent_get_input(c->bev);
    evutil_socket_t fd = bufferevent_getfd(c->bev);
    /* a few reads: a proof is 48 bytes, behind at most a HELLO */
    for (int i = 0; i < 4 && fd >= 0; i++)
        if (evbuffer_read(in, fd, 16384) <= 0)
            break;
    c->reading = true;
    read_frames(c, in);
    c->reading = false;
}

static void greeting_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp__ctl *c = arg;
    if (c->bev == NULL || c->hello_seen)
        return;
    tdp_log_info("peer %s sent nothing within %d ms of connecting (not a tdpipe peer?)",
                 c->peer_name, TDP_CTL_GREETING_MS);
    fail(c, TDP_EPROTO);
}

/* Dial: a tdpipe listener's HELLO is due at once; wait this long for it. */
static void expect_greeting(tdp__ctl *c)
{
    struct timeval tv = {TDP_CTL_GREETING_MS / 1000, (TDP_CTL_GREETING_MS % 1000) * 1000};
    if (c->greeting == NULL)
        c->greeting = evtimer_new(tdp__loop_base(c->loop), greeting_cb, c);
    if (c->greeting != NULL) /* without it, the handshake deadline still ends a silent peer */
        evtimer_add(c->greeting, &tv);
}

static void event_cb(struct bufferevent *bev, short what, void *arg)
{
    tdp__ctl *c = arg;
    if (what & BEV_EVENT_CONNECTED) {
        c->connected = true;
        set_sockopts(c, bufferevent_getfd(bev));
        expect_greeting(c);
        c->up->connected(c->owner);
        return;
    }
    if (!(what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)))
        return;
    int e = EVUTIL_SOCKET_ERROR();
    if (!c->connected && ((what & BEV_EVENT_EOF) || e == ECONNRESET || e == EPIPE)) {
        /* the connection was made and the peer hung up at once (libevent may
         * report that before it reports the connect): closed during handshake */
        fail(c, TDP_ECONNRESET);
        return;
    }
    if (!c->connected) {
        bufferevent_free(c->bev);
        c->bev = NULL;
        /* e.g. localhost: ::1 refused, try 127.0.0.1 */
        while (c->iaddr + 1 < c->naddr) {
            c->iaddr++;
            if (dial_next(c) == TDP_OK)
                return;
        }
        c->up->closed(c->owner, e == ECONNREFUSED ? TDP_ECONNREFUSED : TDP_EADDR);
        return;
    }
    fail(c, TDP_ECONNRESET);
}

static void bye_written_cb(struct bufferevent *bev, void *arg)
{
    tdp__ctl *c = arg;
    bufferevent_setcb(bev, read_cb, NULL, event_cb, c);
    c->up->bye_flushed(c->owner);
}

void tdp__ctl_send_ready(tdp__ctl *c, const tdp_ready *r)
{
    uint8_t buf[TDP_CTL_HDR_LEN + TDP_READY_LEN];
    if (c->bev == NULL || c->bye_sent)
        return;
    tdp_wire_ready_encode(buf, r);
    if (c->carry != NULL)
        c->carry_ops->control(c, buf, sizeof(buf), false);
    else
        bufferevent_write(c->bev, buf, sizeof(buf));
}

size_t tdp__ctl_backlog(const tdp__ctl *c)
{
    if (c->bev == NULL || c->carry != NULL)
        return 0; /* the carrier's ring is bounded: it drops what does not fit */
    return evbuffer_get_length(bufferevent_get_output(c->bev));
}

void tdp__ctl_send_bye(tdp__ctl *c, const tdp_bye *b)
{
    uint8_t buf[TDP_CTL_HDR_LEN + TDP_BYE_LEN];
    if (c->bev == NULL || c->bye_sent)
        return;
    tdp_wire_bye_encode(buf, b);
    c->bye_sent = true;
    if (c->carry != NULL) {
        c->carry_ops->control(c, buf, sizeof(buf), true);
        return;
    }
    bufferevent_setcb(c->bev, read_cb, bye_written_cb, event_cb, c);
    bufferevent_write(c->bev, buf, sizeof(buf));
}

void tdp__ctl_close(tdp__ctl *c)
{
    auth_drop(c);
    held_drop(c);
    if (c->greeting != NULL) {
        event_free(c->greeting);
        c->greeting = NULL;
    }
    if (c->bev == NULL)
        return;
    if (c->carry != NULL)
        c->carry_ops->detach(c); /* before the socket closes */
    /* a BYE still queued goes out now: freeing would drop it */
    struct evbuffer *out = bufferevent_get_output(c->bev);
    size_t n = evbuffer_get_length(out);
    if (n > 0 && n <= 256 && bufferevent_getfd(c->bev) >= 0) {
        const void *b = evbuffer_pullup(out, (ev_ssize_t)n);
        /* MSG_NOSIGNAL: a peer already gone must not SIGPIPE the application */
        if (b != NULL)
            (void)!send(bufferevent_getfd(c->bev), b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    bufferevent_free(c->bev); /* libevent allows this inside the bev's own callback */
    c->bev = NULL;
}

/* ---- refusing --------------------------------------------------------------- */

/*
 * A socket the listener will not serve gets BYE with the reason instead of
 * HELLO, so the connecting side fails with that reason rather than a bare
 * reset. The socket stays open until the peer hangs up: closing with the
 * peer's HELLO unread would send a RST, which can destroy the BYE before
 * the peer reads it.
 */
#define TDP_MAX_REFUSALS 256u /* more at once are closed without a word */

struct tdp__refusal {
    tdp__refusals *rs;
    struct bufferevent *bev;
    struct event *timer;
    struct tdp__refusal *next;
};

static void refusal_free(struct tdp__refusal *r)
{
    for (struct tdp__refusal **pp = &r->rs->head; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    }
    r->rs->n--;
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

void tdp__ctl_refuse(tdp__refusals *rs, tdp_loop *loop, evutil_socket_t fd, tdp_err reason,
                     int64_t ms)
{
    struct tdp__refusal *r = NULL;
    if (rs->n < TDP_MAX_REFUSALS)
        r = tdp__calloc(1, sizeof(*r));
    if (r == NULL) {
        evutil_closesocket(fd);
        return;
    }
    r->rs = rs;
    r->next = rs->head;
    rs->head = r;
    rs->n++;
    r->bev = bufferevent_socket_new(tdp__loop_base(loop), fd, BEV_OPT_CLOSE_ON_FREE);
    r->timer = evtimer_new(tdp__loop_base(loop), refusal_timeout_cb, r);
    if (r->bev == NULL || r->timer == NULL) {
        if (r->bev == NULL)
            evutil_closesocket(fd);
        refusal_free(r);
        return;
    }
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

void tdp__ctl_refusals_free(tdp__refusals *rs)
{
    while (rs->head != NULL)
        refusal_free(rs->head);
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
