/*
 * ctl_carry.c: the control channel carrying the tcp plane (ctl.h,
 * tdp__ctl_carry). Once the HELLOs chose that plane, the socket is read
 * and written here instead of through the bufferevent:
 *
 *   - receive: a fixed buffer holds frame headers and small payloads; a
 *     payload still due when the buffer is empty is read straight into
 *     the memory the plane named (one copy, the kernel's, as raw TCP);
 *   - send: a fixed ring of frames (header bytes inline, the payload by
 *     pointer) written with sendmsg, as many frames a call as are queued;
 *     a frame not urgent waits for the end of the loop's turn so that the
 *     frames of one turn leave together;
 *   - the socket is a loop source: readable wakes the loop, and a loop
 *     that busy-polls polls it.
 *
 * Completions (the plane's `sent`, the BYE's flush) come from the
 * source's progress (before the source exists, and once detached, from a
 * loop task), never from inside the call that queued the frame. When the channel
 * closes the carrier detaches: the socket is let go of, and the frames
 * still queued are reported (those wholly written as sent, the rest as
 * lost) before the carrier frees itself.
 */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "../core/alloc.h"
#include "../core/env.h"
#include "../core/log.h"
#include "../core/loop_int.h"
#include "../core/reap.h"
#include "ctl.h"

static void carry_take(tdp__ctl *c, struct evbuffer *in);
static void carry_detach(tdp__ctl *c);
static const tdp__ctl_carry_ops ctl_calls;

#define RX_BUF       (64u * 1024u) /* the receive buffer: headers and small payloads */
#define DIRECT_MIN   4096u         /* a payload at least this long left is read in place */
#define RX_ROUNDS    32            /* reads per progress call: then other sources' turn */
#define TX_ROUNDS    16            /* sendmsg calls per flush */
#define TX_IOV       64            /* iovecs per sendmsg */
#define IOV_MAX_LEN  (1u << 30)    /* one iovec's bytes, at most */
#define CONTROL_ROOM 8u            /* ring entries only READY and BYE may take */

typedef struct cq_ent {
    uint8_t hdr[TDP_CTL_HDR_LEN + TDP_AM_HDR_MAX_LEN];
    uint8_t hlen;
    bool bye;
    const uint8_t *pl;
    uint64_t plen;
    uint64_t pavail; /* payload bytes that may be written (held: < plen) */
    uint64_t off;    /* bytes of hdr, then payload, written */
    void *cookie;
} cq_ent;

struct tdp__ctl_carry {
    tdp__ctl *c; /* NULL once detached (the channel closed) */
    tdp_loop *loop;
    evutil_socket_t fd;
    tdp__source *src;
    struct event *wr; /* the socket is writable again */
    const tdp__ctl_carrier *up;
    void *arg;
    bool taking; /* the plane takes frames (until uncarry) */
    /* receive */
    uint8_t *rb;
    size_t rcap, rbeg, rend;
    uint64_t left; /* payload bytes of the last frame still due */
    uint64_t plen; /* ...of that many */
    uint8_t *into; /* where they go (NULL: dropped) */
    bool tell;     /* call up->payload when they are in */
    /* send: entries [head, head + n) of the ring; the first nw wholly written */
    cq_ent *q;
    uint32_t head, n, nw;
    uint64_t head_id;  /* the id of entry head (ids count every frame queued) */
    bool dirty;        /* frames wait for the end of the turn */
    bool write_failed; /* the peer is gone; the read side will see it */
    bool wr_armed;
    tdp__reap done; /* reports on a later turn (or when the loop goes) */
    bool in_done;
    bool in_rx; /* carry_progress is on the stack */
    int lowat;  /* the socket's SO_RCVLOWAT as last set (0: never set, the kernel's 1) */
};

static cq_ent *ent(struct tdp__ctl_carry *k, uint32_t i)
{
    return &k->q[(k->head + i) % TDP_CTL_CARRY_QUEUE];
}

static void carry_free(struct tdp__ctl_carry *k)
{
    tdp__free(k->rb);
    tdp__free(k->q);
    tdp__free(k);
}

/* ---- completions ------------------------------------------------------------------ */

static void post_done(struct tdp__ctl_carry *k);

/*
 * Report what has left (and, once detached, what never will). Never frees
 * the carrier: only the posted task does, so that a task still queued
 * never finds it gone.
 */
static void deliver(struct tdp__ctl_carry *k)
{
    if (k->in_done)
        return;
    k->in_done = true;
    /* each call may queue, flush or close: re-read the counts every time */
    while (k->n > 0 && (k->nw > 0 || k->c == NULL)) {
        cq_ent *e = ent(k, 0);
        bool written = k->nw > 0;
        bool bye = e->bye;
        void *cookie = e->cookie;
        k->head = (k->head + 1) % TDP_CTL_CARRY_QUEUE;
        k->head_id++;
        k->n--;
        if (written)
            k->nw--;
        if (bye) {
            if (written && k->c != NULL)
                k->c->up->bye_flushed(k->c->owner);
        } else if (cookie != NULL) {
            k->up->sent(k->arg, cookie, written ? TDP_OK : TDP_ECONNRESET);
        }
    }
    k->in_done = false;
}

/*
 * On a later turn, or when the loop is freed first (a detached carrier
 * then still reports, and goes): tdp__reap runs it either way.
 */
static void done_cb(void *arg)
{
    struct tdp__ctl_carry *k = arg;
    deliver(k);
    if (k->c != NULL || k->done.queued)
        return; /* carrying still, or a report asked for again inside this one */
    if (k->n == 0)
        carry_free(k);
    else
        post_done(k);
}

static void post_done(struct tdp__ctl_carry *k)
{
    tdp__reap_later(k->loop, &k->done, done_cb, k);
}

/* ---- send ------------------------------------------------------------------------ */

static void wr_cb(evutil_socket_t fd, short what, void *arg);

static void arm_write(struct tdp__ctl_carry *k)
{
    if (k->wr_armed || k->wr == NULL)
        return;
    if (event_add(k->wr, NULL) == 0)
        k->wr_armed = true;
}

/*
 * The handshake's own bytes still wait in the bufferevent (our HELLO is
 * always queued before a plane starts: session_hello.c, on_ctl_hello):
 * ours go after them, when the bufferevent has written them
 * (bev_written_cb).
 */
static bool bev_pending(const struct tdp__ctl_carry *k)
{
    return k->c != NULL && k->c->bev != NULL &&
           evbuffer_get_length(bufferevent_get_output(k->c->bev)) > 0;
}

/*
 * The bytes of e that may be written now: all of them, or for a held
 * frame its header and the payload given so far, the header only once
 * some payload is there (so that a small payload leaves with its header,
 * one segment, one wake-up of the receiver).
 */
static uint64_t ent_ready(const cq_ent *e)
{
    if (e->pavail == 0 && e->plen > 0)
        return 0;
    return e->hlen + e->pavail;
}

/* Whether the first frame not wholly written has bytes that may go now. */
static bool writable_left(struct tdp__ctl_carry *k)
{
    if (k->nw >= k->n)
        return false;
    const cq_ent *e = ent(k, k->nw);
    return e->off < ent_ready(e);
}

/* Write what is queued, as far as the socket takes it; returns the calls that moved bytes. */
static unsigned flush(struct tdp__ctl_carry *k)
{
    unsigned did = 0;
    k->dirty = false;
    if (k->fd < 0 || k->write_failed || bev_pending(k))
        return 0;
    for (int round = 0; round < TX_ROUNDS && writable_left(k); round++) {
        struct iovec iov[TX_IOV];
        int ni = 0;
        for (uint32_t i = k->nw; i < k->n && ni + 2 <= TX_IOV; i++) {
            cq_ent *e = ent(k, i);
            if (ent_ready(e) == 0)
                break; /* held, nothing given yet: it and what follows wait */
            uint64_t off = e->off;
            if (off < e->hlen) {
                iov[ni++] = (struct iovec){e->hdr + off, e->hlen - off};
                off = e->hlen;
            }
            uint64_t po = off - e->hlen;
            if (po < e->pavail) {
                uint64_t m = e->pavail - po;
                iov[ni++] = (struct iovec){(void *)(e->pl + po), m > IOV_MAX_LEN ? IOV_MAX_LEN : m};
                if (m > IOV_MAX_LEN)
                    break; /* the rest of this payload in a later call */
            }
            if (e->pavail < e->plen)
                break; /* held: what follows waits for the rest of its bytes */
        }
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)ni};
        ssize_t w = sendmsg(k->fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                /* the peer reset or vanished: the read side ends the channel */
                k->write_failed = true;
                tdp_log_debug("tcp plane: send: %s", strerror(errno));
            }
            break;
        }
        did++;
        uint64_t left = (uint64_t)w;
        while (k->nw < k->n) {
            cq_ent *e = ent(k, k->nw);
            uint64_t need = e->hlen + e->plen - e->off;
            if (left < need) {
                e->off += left;
                break;
            }
            left -= need;
            e->off = e->hlen + e->plen;
            k->nw++;
        }
    }
    /* what has left is reported by the source's next progress, before
     * the loop sleeps (the kick); without a source (not yet made, or
     * detached) by a task */
    if (k->nw > 0) {
        if (k->src != NULL)
            tdp__loop_kick(k->loop);
        else
            post_done(k);
    }
    /* bytes the socket did not take: on when it can (a held payload's
     * missing bytes are no reason: tdp__ctl_plane_give flushes) */
    if (!k->write_failed && writable_left(k))
        arm_write(k);
    return did;
}

static void wr_cb(evutil_socket_t fd, short what, void *arg)
{
    struct tdp__ctl_carry *k = arg;
    (void)fd;
    (void)what;
    k->wr_armed = false;
    flush(k);
}

/* The bufferevent wrote the handshake's last bytes: ours may go. */
static void bev_written_cb(struct bufferevent *bev, void *arg)
{
    tdp__ctl *c = arg;
    (void)bev;
    if (c->carry != NULL)
        flush(c->carry);
}

static tdp_err enqueue(struct tdp__ctl_carry *k, const uint8_t *hdr, size_t hlen, const void *pl,
                       uint64_t plen, void *cookie, bool bye, uint32_t room)
{
    if (k->n + room >= TDP_CTL_CARRY_QUEUE)
        return TDP_ELIMIT;
    cq_ent *e = ent(k, k->n);
    memcpy(e->hdr, hdr, hlen);
    e->hlen = (uint8_t)hlen;
    e->bye = bye;
    e->pl = pl;
    e->plen = plen;
    e->pavail = pl != NULL ? plen : 0;
    e->off = 0;
    e->cookie = cookie;
    k->n++;
    return TDP_OK;
}

tdp_err tdp__ctl_plane_send(tdp__ctl *c, const tdp_am_hdr *h, const void *payload, void *cookie,
                            bool now)
{
    struct tdp__ctl_carry *k = c->carry;
    if (cookie == NULL && h->length > 0)
        return TDP_EINVAL;
    if (k != NULL && c->bev != NULL && c->bye_sent && cookie == NULL)
        return TDP_OK; /* credit after our BYE: nobody needs it, and the peer's
                        * hang-up must meet no unread byte (tdp__pipe_hang_up) */
    if (k == NULL || c->bev == NULL || c->bye_sent)
        return TDP_ECONNRESET;
    uint8_t am[TDP_AM_HDR_MAX_LEN];
    size_t al = tdp_wire_am_encode(am, h);
    return tdp__ctl_plane_send_raw(c, am, al, payload, h->length, cookie, now);
}

/*
 * Queue a PLANE frame (its AM header am, al bytes; payload NULL: held) and
 * write it now, or at the end of the loop's turn; *id (if asked) names it.
 */
static tdp_err queue_plane(struct tdp__ctl_carry *k, const uint8_t *am, size_t al,
                           const void *payload, uint64_t len, void *cookie, bool now, uint64_t *id)
{
    uint8_t hdr[TDP_CTL_HDR_LEN + TDP_AM_HDR_MAX_LEN];
    memcpy(hdr + TDP_CTL_HDR_LEN, am, al);
    tdp_wire_ctl_hdr_encode(hdr, TDP_CTL_PLANE, (uint32_t)al);
    uint64_t my = k->head_id + k->n;
    tdp_err rc = enqueue(k, hdr, TDP_CTL_HDR_LEN + al, payload, len, cookie, false, CONTROL_ROOM);
    if (rc != TDP_OK)
        return rc;
    if (id != NULL)
        *id = my;
    if (now) {
        flush(k);
    } else if (!k->dirty) {
        k->dirty = true;
        tdp__loop_kick(k->loop); /* the loop progresses its sources before it sleeps */
    }
    return TDP_OK;
}

tdp_err tdp__ctl_plane_send_held(tdp__ctl *c, const tdp_am_hdr *h, void *cookie, uint64_t *id)
{
    struct tdp__ctl_carry *k = c->carry;
    if (cookie == NULL || h->length == 0)
        return TDP_EINVAL;
    if (k == NULL || c->bev == NULL || c->bye_sent)
        return TDP_ECONNRESET;
    uint8_t am[TDP_AM_HDR_MAX_LEN];
    size_t al = tdp_wire_am_encode(am, h);
    return queue_plane(k, am, al, NULL, h->length, cookie, false, id);
}

void tdp__ctl_plane_give(struct tdp__ctl_carry *k, uint64_t id, const void *payload, uint64_t avail)
{
    if (k == NULL || id < k->head_id || id - k->head_id >= k->n)
        return; /* closed: the frame is reported lost */
    cq_ent *e = ent(k, (uint32_t)(id - k->head_id));
    if (payload != NULL && e->pl == NULL)
        e->pl = payload;
    if (e->pl == NULL || avail <= e->pavail)
        return;
    e->pavail = avail < e->plen ? avail : e->plen;
    flush(k);
}

tdp_err tdp__ctl_plane_send_raw(tdp__ctl *c, const uint8_t *am, size_t al, const void *payload,
                                uint64_t len, void *cookie, bool now)
{
    struct tdp__ctl_carry *k = c->carry;
    if (k == NULL || c->bev == NULL || al > TDP_AM_HDR_MAX_LEN)
        return TDP_ECONNRESET;
    if (len > 0 && payload == NULL)
        return TDP_EINVAL;
    return queue_plane(k, am, al, payload, len, cookie, now, NULL);
}

static void carry_control(tdp__ctl *c, const uint8_t *frame, size_t len, bool bye)
{
    struct tdp__ctl_carry *k = c->carry;
    if (enqueue(k, frame, len, NULL, 0, NULL, bye, 0) != TDP_OK) {
        /* a ring full of frames the peer does not read: it is stuck or gone */
        tdp_log_warn("peer %s: control frame dropped: the send queue is full", c->peer_name);
        return;
    }
    flush(k);
}

/* ---- receive ---------------------------------------------------------------------- */

/* Payload bytes came in: the plane hears of the whole, or of progress where it asks. */
static void landed(struct tdp__ctl_carry *k)
{
    if (!k->tell)
        return;
    if (k->left == 0) {
        k->tell = false;
        k->up->payload(k->arg);
    } else if (k->up->landing != NULL) {
        k->up->landing(k->arg, k->plen - k->left);
    }
}

/* Every whole frame and payload byte in the buffer; false when the channel ended. */
static bool parse(struct tdp__ctl_carry *k)
{
    while (k->c != NULL) {
        size_t avail = k->rend - k->rbeg;
        if (k->left > 0) {
            if (avail == 0)
                return true;
            size_t m = avail < k->left ? avail : (size_t)k->left;
            if (k->into != NULL) {
                memcpy(k->into, k->rb + k->rbeg, m);
                k->into += m;
            }
            k->rbeg += m;
            k->left -= m;
            landed(k);
            continue;
        }
        if (avail < TDP_CTL_HDR_LEN)
            return true;
        tdp_ctl_hdr hdr;
        tdp_err rc = tdp_wire_ctl_hdr_decode(k->rb + k->rbeg, &hdr);
        if (rc != TDP_OK) {
            tdp_log_info("peer %s: malformed frame on the tcp plane", k->c->peer_name);
            tdp__ctl_fail(k->c, rc == TDP_EVERSION ? TDP_EVERSION : TDP_EPROTO);
            return false;
        }
        if (hdr.type != TDP_CTL_PLANE && hdr.type != TDP_CTL_READY && hdr.type != TDP_CTL_BYE) {
            tdp_log_info("peer %s: handshake frame after the handshake", k->c->peer_name);
            tdp__ctl_fail(k->c, TDP_EPROTO);
            return false;
        }
        if (avail < TDP_CTL_HDR_LEN + hdr.length)
            return true;
        const uint8_t *f = k->rb + k->rbeg + TDP_CTL_HDR_LEN;
        k->rbeg += TDP_CTL_HDR_LEN + hdr.length;
        if (hdr.type != TDP_CTL_PLANE) {
            if (!tdp__ctl_small(k->c, hdr.type, f, hdr.length))
                return false;
            continue;
        }
        tdp_am_hdr h;
        if (tdp_wire_am_decode(f, hdr.length, &h) != TDP_OK) {
            tdp_log_info("peer %s: malformed tcp plane frame", k->c->peer_name);
            tdp__ctl_fail(k->c, TDP_EPROTO);
            return false;
        }
        uint8_t *into = NULL;
        if (k->taking) {
            rc = k->up->frame(k->arg, &h, &into);
            if (k->c == NULL)
                return false;
            if (rc != TDP_OK) {
                tdp__ctl_fail(k->c, rc);
                return false;
            }
        }
        k->left = k->plen = h.length;
        k->into = k->taking ? into : NULL;
        k->tell = k->taking && into != NULL && h.length > 0;
    }
    return false;
}

/*
 * The receive low-water mark while a large payload is due: LOWAT_KIB, or
 * TDPIPE_TCP_LOWAT_KIB (0: never set; 4..65536), read once per process.
 */
#define LOWAT_KIB 512
static int lowat_cap(void)
{
    static _Atomic int cap = -1;
    int c = atomic_load_explicit(&cap, memory_order_relaxed);
    if (c < 0) {
        c = (int)tdp__env_kib("TDPIPE_TCP_LOWAT_KIB", LOWAT_KIB << 10, 4, 65536, true);
        atomic_store_explicit(&cap, c, memory_order_relaxed);
    }
    return c;
}

/*
 * Before the loop sleeps on the socket: while at least the cap of a
 * payload is still due, the socket wakes it (SO_RCVLOWAT) only once that
 * much has come in, not for every segment, and each read then takes a
 * large piece. Back to 1 for what is left under the cap (so the last bytes
 * and the next header wake it). One system call when the mark changes:
 * about two a large message. A dead peer still wakes it (a socket's end or
 * error is readable whatever the mark). docs/planes.md, "The tcp plane".
 */
static void set_lowat(struct tdp__ctl_carry *k)
{
    int cap = lowat_cap();
    if (cap <= 0)
        return;
    int want = 1;
    if (k->left >= (uint64_t)cap)
        want = cap;
    if (want == (k->lowat == 0 ? 1 : k->lowat))
        return;
    if (setsockopt(k->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(want)) == 0)
        k->lowat = want;
}

/* Read and handle what the socket holds, up to RX_ROUNDS reads; returns the reads. */
static unsigned rx(struct tdp__ctl_carry *k)
{
    unsigned did = 0;
    bool drained = false;
    for (int round = 0; round < RX_ROUNDS; round++) {
        if (!parse(k))
            return did + 1;
        if (drained && k->left == 0 && k->rbeg == k->rend)
            break; /* a short read emptied the socket between frames: its fd
                    * says when more comes (inside a frame, more is on its way:
                    * read on) */
        ssize_t r;
        bool direct = k->left >= DIRECT_MIN && k->rbeg == k->rend;
        if (direct && round == 0 && k->lowat > 1 && k->left >= (uint64_t)k->lowat) {
            /* a loop that busy-polls asks the socket (lockless) before it
             * reads: as for one that sleeps, a read once a mark's worth is
             * in, not a read per segment fighting the sender for the lock */
            struct pollfd pfd = {.fd = k->fd, .events = POLLIN};
            if (poll(&pfd, 1, 0) == 0)
                return did;
        }
        if (direct) {
            uint8_t *dst = k->into != NULL ? k->into : k->rb;
            uint64_t cap = k->into != NULL ? IOV_MAX_LEN : k->rcap;
            size_t want = (size_t)(k->left < cap ? k->left : cap);
            r = recv(k->fd, dst, want, MSG_DONTWAIT);
            if (r > 0) {
                did++;
                drained = (size_t)r < want;
                if (k->into != NULL)
                    k->into += r;
                k->left -= (uint64_t)r;
                landed(k);
                if (k->c == NULL)
                    return did;
                continue;
            }
        } else {
            if (k->rbeg == k->rend) {
                k->rbeg = k->rend = 0;
            } else if (k->rend == k->rcap) {
                memmove(k->rb, k->rb + k->rbeg, k->rend - k->rbeg);
                k->rend -= k->rbeg;
                k->rbeg = 0;
            }
            size_t room = k->rcap - k->rend;
            r = recv(k->fd, k->rb + k->rend, room, MSG_DONTWAIT);
            if (r > 0) {
                did++;
                drained = (size_t)r < room;
                k->rend += (size_t)r;
                continue;
            }
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            break;
        /* end of stream or a reset: the peer is gone (a BYE came first if it said one) */
        if (k->c != NULL)
            tdp__ctl_fail(k->c, TDP_ECONNRESET);
        return did + 1;
    }
    set_lowat(k); /* more to read: the mark must suit what is left */
    return did;
}

static unsigned carry_progress(void *arg)
{
    struct tdp__ctl_carry *k = arg;
    if (k->c == NULL || k->in_rx)
        return 0;
    unsigned did = 0;
    k->in_rx = true;
    /* what has left is reported before what the peer says next is read: a
     * send is complete before the peer's answer to it (its BYE) arrives */
    if (k->nw > 0)
        deliver(k);
    if (k->c != NULL && k->dirty)
        did += flush(k);
    if (k->c != NULL)
        did += rx(k);
    k->in_rx = false;
    return did;
}

static const tdp__source_ops carry_ops = {.progress = carry_progress, .arm = NULL};

static void carry_pump(tdp__ctl *c)
{
    (void)carry_progress(c->carry);
}

/* ---- start and end ---------------------------------------------------------------- */

tdp_err tdp__ctl_carry(tdp__ctl *c, const tdp__ctl_carrier *up, void *arg)
{
    if (c->bev == NULL || c->carry != NULL || up == NULL)
        return TDP_EINVAL;
    struct tdp__ctl_carry *k = tdp__calloc(1, sizeof(*k));
    if (k == NULL)
        return TDP_ENOMEM;
    k->c = c;
    k->loop = c->loop;
    k->fd = bufferevent_getfd(c->bev);
    k->up = up;
    k->arg = arg;
    k->taking = true;
    k->rcap = RX_BUF;
    k->rb = tdp__malloc(k->rcap);
    k->q = tdp__calloc(TDP_CTL_CARRY_QUEUE, sizeof(*k->q));
    k->wr = event_new(tdp__loop_base(c->loop), k->fd, EV_WRITE, wr_cb, k);
    tdp_err rc = k->rb == NULL || k->q == NULL || k->wr == NULL ? TDP_ENOMEM : TDP_OK;
    if (rc == TDP_OK)
        rc = tdp__loop_source_add(c->loop, k->fd, &carry_ops, k, &k->src);
    if (rc != TDP_OK) {
        if (k->wr != NULL)
            event_free(k->wr);
        carry_free(k);
        return rc;
    }
    c->carry = k;
    c->carry_ops = &ctl_calls;
    /* the bufferevent reads no more; it still writes what the handshake left */
    bufferevent_disable(c->bev, EV_READ);
    tdp__ctl_bev_written(c, bev_written_cb);
    if (!c->reading)
        carry_take(c, bufferevent_get_input(c->bev));
    return TDP_OK;
}

static void carry_take(tdp__ctl *c, struct evbuffer *in)
{
    struct tdp__ctl_carry *k = c->carry;
    size_t n = evbuffer_get_length(in);
    if (n > k->rcap - k->rend) {
        /* more came with the handshake than the buffer holds: once, at the start */
        uint8_t *nb = tdp__realloc(k->rb, k->rend + n);
        if (nb == NULL) {
            tdp__ctl_fail(c, TDP_ENOMEM);
            return;
        }
        k->rb = nb;
        k->rcap = k->rend + n;
    }
    if (n > 0)
        evbuffer_remove(in, k->rb + k->rend, n);
    k->rend += n;
    tdp__loop_kick(k->loop); /* parsed by the source, outside the handshake's up-calls */
}

void tdp__ctl_uncarry(tdp__ctl *c, void *arg)
{
    struct tdp__ctl_carry *k = c != NULL ? c->carry : NULL;
    if (k == NULL || k->arg != arg)
        return;
    k->taking = false;
    k->into = NULL;
    k->tell = false;
}

static void carry_detach(tdp__ctl *c)
{
    struct tdp__ctl_carry *k = c->carry;
    flush(k); /* a BYE queued last goes out if the socket takes it */
    c->carry = NULL;
    k->c = NULL;
    k->taking = false;
    k->into = NULL;
    k->tell = false;
    tdp__loop_source_remove(k->loop, k->src);
    k->src = NULL;
    event_free(k->wr);
    k->wr = NULL;
    k->fd = -1;
    /* the rest is reported, then the carrier goes: always from a task */
    post_done(k);
}

static const tdp__ctl_carry_ops ctl_calls = {
    .take = carry_take,
    .pump = carry_pump,
    .control = carry_control,
    .detach = carry_detach,
};
