/*
 * session.c: the pipe's state machine — HELLO outcome and plane choice,
 * schema once then data, sequence numbers, credits, the receive ring and
 * lending, clean end vs failure, teardown. It calls the control channel
 * (ctl.h) and the chosen data plane (plane.h, through its ops table) and
 * hears from them through callbacks; it makes no transport call itself.
 *
 * Everything runs on the loop thread except the public entry points, which
 * hop to it (ops through op.c, the rest through tdp__call_on_loop).
 */
#include <inttypes.h>
#include <sodium.h>
#include <sys/random.h>
#include <string.h>
#include <time.h>

#include "session.h"
#include "session_int.h"
#include "budget.h"
#include "checksum.h"
#include "op.h"
#include "plane.h"
#include "host.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../core/reap.h"
#include "../core/sized.h"
#include "../schema/schema_int.h"

static void send_kick(tdp_pipe *p);
static void deliver(tdp_pipe *p);
static void send_credit(tdp_pipe *p);
static void check_close(tdp_pipe *p);
static void pipe_fail(tdp_pipe *p, tdp_err err, const char *why);
static void credit_ev_cb(evutil_socket_t fd, short what, void *arg);

/* ---- ops ------------------------------------------------------------------- */

static void fail_ops_sent(tdp_pipe *p, tdp_err rc)
{
    tdp__prep_fail(p, rc); /* a READY that will not come now */
    /* sends the plane still holds: the op goes back now, the plane keeps the buffer */
    for (uint32_t i = 0; i < p->nticket; i++) {
        tx_ticket *t = &p->tickets[i];
        if (t->busy && t->op != NULL) {
            tdp_op *op = t->op;
            t->op = NULL;
            tdp__op_complete(op, rc);
        }
    }
}

/* Complete what can be completed after the pipe ended. */
static void drain_ops(tdp_pipe *p)
{
    tdp_op *op;
    tdp_err rc = p->status == TDP_OK || p->status == TDP_ECLOSED ? TDP_ECANCELED : p->status;
    /* a send the peer's clean end left unsent: "the receiver closed the stream" */
    tdp_err send_rc = p->status == TDP_ECLOSED && p->peer_bye ? TDP_ECLOSED : rc;
    while ((op = tdp__opq_pop(&p->sendq)) != NULL)
        tdp__op_complete(op, send_rc);
    fail_ops_sent(p, rc);
    deliver(p);
}

/* ---- ending -------------------------------------------------------------- */

static void close_links(tdp_pipe *p, bool gone)
{
    for (int i = 0; i < p->ncand; i++) {
        if (p->links[i] != NULL) {
            p->cand[i]->link_close(p->links[i], gone);
            p->links[i] = NULL;
        }
    }
    p->link = NULL;
}

static void close_link(tdp_pipe *p)
{
    /* a reset or a timeout: the peer is gone, or as good as */
    close_links(p, p->status == TDP_ECONNRESET || p->status == TDP_ETIMEDOUT);
}

static bool want_reconnect(const tdp_pipe *p, tdp_err err);
static void begin_reconnect(tdp_pipe *p, tdp_err err, const char *why);

static void timer_del(tdp_pipe *p)
{
    if (p->timer != NULL)
        evtimer_del(p->timer);
}

/* Tell the application once the pipe has ended and its socket is closed. */
static void maybe_tell_end(tdp_pipe *p)
{
    if (p->told_end || p->state != PIPE_DEAD || tdp__ctl_open(&p->ctl) || p->end_cb == NULL ||
        p->freed)
        return;
    p->told_end = true;
    tdp_err st = p->status == TDP_ECLOSED && p->close_requested && !p->peer_bye ? TDP_OK
                                                                                 : p->status;
    p->end_cb(p, st, p->end_arg);
}

static void pipe_fail(tdp_pipe *p, tdp_err err, const char *why)
{
    if (p->state == PIPE_DEAD)
        return;
    if (want_reconnect(p, err)) {
        begin_reconnect(p, err, why);
        return;
    }
    if (p->reconnecting) {
        /* given up: the outage's cause is the pipe's end */
        tdp_log_info("pipe %s: no peer again within the reconnect time (%s)", p->ctl.peer_name,
                     why);
        p->reconnecting = false;
        /* out of time: the outage's cause; a peer that answered and refused
         * us (TDP_EAUTH, TDP_EVERSION, ...) says why itself */
        if (err == TDP_ECONNREFUSED || err == TDP_ECONNRESET || err == TDP_ETIMEDOUT)
            err = p->lost;
        if (err == TDP_ECLOSED)
            p->peer_bye = true; /* the last peer said goodbye and none came after */
    }
    bool was_connecting = p->state == PIPE_CONNECTING && !p->was_open;
    p->state = PIPE_DEAD;
    p->status = err;
    if (err != TDP_ECLOSED && err != TDP_ECANCELED)
        tdp_log_info("pipe %s: %s (%s)", p->ctl.peer_name, why, tdp_strerror(err));
    /* tell a live peer why, when it was its fault or ours; a dead one won't read */
    if (err != TDP_ECONNRESET && err != TDP_ETIMEDOUT && !p->ctl.bye_sent) {
        tdp_bye b = {.last_seq = p->send_seq, .reason = err == TDP_ECLOSED ? TDP_ECANCELED : err};
        tdp__ctl_send_bye(&p->ctl, &b);
    }
    close_link(p);
    timer_del(p);
    if (was_connecting) {
        tdp__ctl_close(&p->ctl);
        if (p->ready_cb != NULL) {
            tdp_pipe_cb cb = p->ready_cb;
            p->ready_cb = NULL;
            p->freed = true; /* nobody else has it: it goes on a later turn */
            cb(NULL, err, p->ready_arg);
            tdp__session_destroy(p);
        }
        return;
    }
    drain_ops(p);
    if (p->peer_bye)
        tdp__ctl_close(&p->ctl); /* both sides have said all: hang up (see hang_up) */
    maybe_tell_end(p);
}

/*
 * Both sides have said BYE (or this one ended and then heard the peer's):
 * nothing more can come either way, so this side hangs up instead of
 * waiting for the peer to. Each side waiting for the other's hang-up was
 * how two pipes that both closed stayed open forever. The peer's BYE has
 * been read and it sends nothing after it, so no unread byte turns the
 * close into a reset; a BYE of ours still queued goes out first.
 */
static void hang_up(tdp_pipe *p)
{
    if (p->state != PIPE_DEAD)
        return; /* a pipe that reconnects has a new socket by now */
    tdp__ctl_close(&p->ctl);
    maybe_tell_end(p);
}

static void arm_timer(tdp_pipe *p, int64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    if (p->timer != NULL)
        evtimer_add(p->timer, &tv);
}

/* Our BYE is out: the pipe has ended; the peer's hang-up is waited for until the close deadline. */
static void closed_cleanly(tdp_pipe *p)
{
    pipe_fail(p, TDP_ECLOSED, "closed"); /* hangs up if the peer said BYE */
    if (tdp__ctl_open(&p->ctl) && p->close_deadline >= 0) {
        int64_t left = p->close_deadline - tdp__now_ms();
        arm_timer(p, left > 0 ? left : 0);
    }
}

static void linger_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (p->state == PIPE_DEAD && p->close_requested && tdp__ctl_open(&p->ctl)) {
        /* our BYE went, the peer neither answered nor hung up in time */
        tdp_log_info("pipe %s: the peer did not end its side within the close deadline",
                     p->ctl.peer_name);
        p->status = TDP_ETIMEDOUT;
        hang_up(p);
        return;
    }
    if (p->state == PIPE_CONNECTING) {
        pipe_fail(p, TDP_ETIMEDOUT, "connect/handshake deadline passed");
    } else if (p->state == PIPE_OPEN && p->peer_bye && p->rx_seq < p->peer_last_seq) {
        pipe_fail(p, TDP_ECONNRESET, "messages announced in BYE never arrived");
    } else if (p->state == PIPE_OPEN && p->link_failed) {
        pipe_fail(p, TDP_ECONNRESET, "data plane failed and the peer said nothing");
    } else if (p->state == PIPE_OPEN && p->close_requested) {
        pipe_fail(p, TDP_ETIMEDOUT, "close deadline passed");
        hang_up(p); /* the close gave up: nothing is waited for any more */
    }
}

/* Has everything the peer announced been delivered or lent? */
static bool peer_done(const tdp_pipe *p)
{
    return p->peer_bye && p->rx_seq >= p->peer_last_seq && p->rx_inflight == 0;
}

static void end_if_peer_done(tdp_pipe *p)
{
    if (p->state == PIPE_OPEN && peer_done(p) && p->ready_count == 0 &&
        (!tdp__ctl_open(&p->ctl) || p->link_failed))
        pipe_fail(p, TDP_ECLOSED, "peer closed");
}

/* ---- control channel events ------------------------------------------------ */

static void on_ctl_closed(void *owner, tdp_err why)
{
    tdp_pipe *p = owner;
    if (p->state == PIPE_CONNECTING) {
        pipe_fail(p, why, why == TDP_ECONNRESET ? "closed during the handshake"
                          : why == TDP_EAUTH   ? "authentication failed"
                                               : "cannot connect");
        return;
    }
    if (p->state == PIPE_DEAD) {
        maybe_tell_end(p);
        return;
    }
    if (p->peer_bye && p->rx_seq >= p->peer_last_seq) {
        /* the peer said goodbye and every frame it sent has arrived; the
         * last payloads may still be landing: the end comes after them */
        end_if_peer_done(p);
        return;
    }
    if (why == TDP_EPROTO || why == TDP_EVERSION)
        pipe_fail(p, why, "garbage on the control socket");
    else
        pipe_fail(p, TDP_ECONNRESET, p->peer_bye ? "peer left before its last message arrived"
                                                 : "peer vanished (control socket closed)");
}

static void on_ctl_bye(void *owner, const tdp_bye *bye)
{
    tdp_pipe *p = owner;
    if (p->state == PIPE_DEAD) {
        hang_up(p); /* ours went (or we failed): the peer's answers it */
        return;
    }
    if (bye->reason != TDP_OK) {
        tdp_err e = bye->reason == TDP_ELIMIT || bye->reason == TDP_EVERSION ||
                            bye->reason == TDP_ENOTSUP || bye->reason == TDP_EAUTH ||
                            bye->reason == TDP_ECHECKSUM
                        ? bye->reason
                        : TDP_ECONNRESET;
        pipe_fail(p, e, "peer ended the pipe with an error");
        hang_up(p); /* it said all it will */
        return;
    }
    if (p->state == PIPE_CONNECTING || p->peer_bye || bye->last_seq < p->rx_seq) {
        pipe_fail(p, TDP_EPROTO, "inconsistent BYE");
        hang_up(p);
        return;
    }
    if (want_reconnect(p, TDP_ECLOSED)) {
        /* a reconnecting pipe waits for the next peer instead (what this
         * one still had on its way here is dropped: its sender is closing) */
        begin_reconnect(p, TDP_ECLOSED, "peer closed");
        return;
    }
    p->peer_bye = true;
    p->peer_last_seq = bye->last_seq;
    /* the peer reads no more: sends waiting for it can never go */
    tdp_op *op;
    while ((op = tdp__opq_pop(&p->sendq)) != NULL)
        tdp__op_complete(op, TDP_ECLOSED);
    if (p->rx_seq < p->peer_last_seq)
        arm_timer(p, p->opts.linger_ms);
    deliver(p);
    end_if_peer_done(p);
}

static void on_ctl_bye_flushed(void *owner)
{
    tdp_pipe *p = owner;
    p->bye_flushed = true;
    check_close(p);
}

static void send_hello(tdp_pipe *p)
{
    uint8_t ids[TDP__PLANES_MAX];
    tdp_hello h = {
        .recv_depth = p->depth,
        .peer_mode = (uint32_t)p->opts.peer_mode,
        .caps = TDP_CAP_MEM_HOST | (tdp_cuda_built() ? TDP_CAP_MEM_CUDA : 0),
        .max_msg_bytes = p->limits.max_total_bytes,
        /* set before the planes fill theirs: what a plane may hold for a
         * peer that has not proven itself yet depends on it */
        .auth = p->secret_len > 0 ? TDP_AUTH_HMAC_SHA256 : 0,
    };
    uint32_t n = 0;
    if (p->state == PIPE_DEAD)
        return;
    /* the planes still in the running: all, or the one the peer's HELLO picked */
    for (int i = 0; i < p->ncand; i++) {
        if (p->links[i] == NULL)
            continue;
        ids[n++] = p->cand[i]->id;
        tdp_err rc = p->cand[i]->hello_fill(p->links[i], &h);
        if (rc != TDP_OK) {
            pipe_fail(p, rc, "cannot describe a data plane");
            return;
        }
    }
    h.planes = ids;
    h.nplanes = n;
    /* a reconnected stream goes on where it was: the peer is told from where
     * (the link's start, not send_seq now: a dialer may open, and send, on
     * the peer's HELLO before its own connect event has sent this one) */
    h.resume = p->credit_base > 0 ? p->credit_base + 1 : 0;
    h.want_depth = p->opts.want_peer_depth;
    h.checksum = p->opts.checksum ? TDP_SUM_XXH3_64 : 0;
    h.ready = TDP_READY_V1; /* this side answers prepared SCHEMAs (session_prepare.c) */
    h.window = p->opts.recv_window_bytes;
    /* with a secret, a peer on this host gets a same-host UCX worker only
     * after the proofs: its address then travels in PROVEN (wire.h) */
    h.proven = p->secret_len > 0 && tdp__ctl_local_now(&p->ctl) ? TDP_PROVEN_V1 : 0;
    /* buffers still lent from an earlier link hold receive slots: fewer credits */
    uint32_t held = 0;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        held += p->slots[i].state != SLOT_FREE;
    if (held > 0 && held < p->depth)
        h.recv_depth = p->depth - held;
    if (held > 0)
        h.window = 0; /* lent buffers hold slots of the window too: depth alone */
    p->window_sent = h.window != 0;
    if (getrandom(h.nonce, sizeof(h.nonce), 0) != (ssize_t)sizeof(h.nonce)) {
        /* never seen; still unique enough to tell an echo (ctl.c) from a peer */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t a = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30), b = (uintptr_t)p;
        memcpy(h.nonce, &a, 8);
        memcpy(h.nonce + 8, &b, 8);
    }
    tdp__host_id(h.host_id);
    tdp_err rc = tdp__ctl_send_hello(&p->ctl, &h);
    if (rc != TDP_OK)
        pipe_fail(p, rc, "cannot send HELLO");
}

static void on_ctl_connected(void *owner)
{
    send_hello(owner);
}

/*
 * The peer's HELLO is in: a listener with a hook chooses, then answers.
 * With a secret the hook runs only once the peer has proven it holds it
 * (ctl.c), so our HELLO cannot wait for it (the proofs cover it).
 */
static void on_ctl_hello_in(void *owner, const tdp_hello *h)
{
    tdp_pipe *p = owner;
    if (p->hello_hook == NULL || p->state != PIPE_CONNECTING)
        return;
    tdp__hello_hook fn = p->hello_hook;
    p->hello_hook = NULL; /* once */
    tdp_pipe_opts o = p->opts;
    tdp_err rc = fn(p->hello_hook_arg, h, &o);
    if (rc != TDP_OK) {
        pipe_fail(p, rc, "refused by the listener");
        return;
    }
    if (p->secret_len > 0)
        return; /* called after the proof: our HELLO, and its depth, went out before it */
    p->depth = o.recv_depth < 1              ? 1
               : o.recv_depth > TDP_MAX_DEPTH ? TDP_MAX_DEPTH
                                              : o.recv_depth;
    p->opts.recv_depth = p->depth;
    send_hello(p);
}

static int link_index(const tdp_pipe *p, const tdp__link *l)
{
    for (int i = 0; i < p->ncand; i++)
        if (p->links[i] == l)
            return i;
    return -1;
}

static void become_open(tdp_pipe *p)
{
    p->state = PIPE_OPEN;
    p->was_open = true;
    if (p->reconnecting) {
        p->reconnecting = false;
        tdp_log_info("pipe %s: reconnected; sending goes on from message %" PRIu64,
                     p->ctl.peer_name, p->send_seq + 1);
    }
    timer_del(p);
    tdp_log_debug("pipe %s open: plane=%s same_host=%d depth=%u/%u", p->ctl.peer_name,
                  p->plane->name, p->same_host, p->depth, p->peer_depth);
    tdp_pipe_cb cb = p->ready_cb;
    p->ready_cb = NULL;
    if (cb != NULL)
        cb(p, TDP_OK, p->ready_arg);
    if (p->state != PIPE_OPEN)
        return;
    send_credit(p); /* releases that happened before the link existed */
    send_kick(p);
}

/* The payload checksum is in force when both sides offered the one algorithm. */
static void sum_negotiate(tdp_pipe *p, const tdp_hello *h)
{
    p->sum_on = p->opts.checksum && h->checksum == TDP_SUM_XXH3_64;
    p->stats.checksum = p->sum_on;
    if (p->opts.checksum && !p->sum_on)
        tdp_log_info("pipe %s: the peer does not offer the payload checksum: none on this pipe",
                     p->ctl.peer_name);
}

/* Can plane o serve this peer? The same answer on both sides (plane.h). */
static bool plane_usable(const tdp_pipe *p, const tdp__plane_ops *o, const tdp_hello *h,
                         bool same_host)
{
    if (o->usable_link != NULL) {
        const tdp__link *mine = NULL;
        for (int i = 0; i < p->ncand; i++)
            if (p->cand[i] == o)
                mine = p->links[i];
        return o->usable_link(mine, h, same_host);
    }
    return o->usable == NULL || o->usable(h, same_host);
}

/*
 * The candidate the two HELLOs pick, -1 for none. Both sides compute the
 * same choice: the same lists, the same filter.
 */
static int choose_plane(const tdp_pipe *p, const tdp_hello *h, bool same_host)
{
    uint8_t mine[TDP__PLANES_MAX], theirs[TDP_MAX_PLANES];
    size_t nm = 0, nt = 0;
    for (int i = 0; i < p->ncand; i++)
        if (plane_usable(p, p->cand[i], h, same_host))
            mine[nm++] = p->cand[i]->id;
    for (uint32_t i = 0; i < h->nplanes && nt < TDP_MAX_PLANES; i++) {
        const tdp__plane_ops *o = tdp__plane_by_id(h->planes[i]);
        if (o != NULL && !plane_usable(p, o, h, same_host))
            continue;
        theirs[nt++] = h->planes[i];
    }
    int id = tdp_wire_plane_choose(mine, nm, theirs, nt, ~UINT64_C(0));
    for (int i = 0; i < p->ncand; i++)
        if (p->cand[i]->id == id && p->links[i] != NULL)
            return i;
    return -1;
}

/* Whether the peer's HELLO says it runs on this host (and the socket agrees). */
static bool peer_same_host(const tdp_pipe *p, const tdp_hello *h)
{
    uint8_t host[TDP_HOST_ID_LEN];
    tdp__host_id(host);
    /* the host id is the peer's claim; the socket must agree (ctl.h: peer_local) */
    return memcmp(h->host_id, host, TDP_HOST_ID_LEN) == 0 && p->ctl.peer_local;
}

/*
 * The peer has proven itself: the plane the HELLOs pick may now make what
 * it could not make for a stranger (its PROVEN records). The choice is made
 * again, the same, when the peer's PROVEN brings its HELLO up.
 */
static tdp_err on_ctl_proven(void *owner, const tdp_hello *h, tdp_hello *out)
{
    tdp_pipe *p = owner;
    if (p->state != PIPE_CONNECTING)
        return TDP_OK;
    int ci = choose_plane(p, h, peer_same_host(p, h));
    if (ci < 0 || p->cand[ci]->proven_fill == NULL)
        return TDP_OK; /* on_ctl_hello says why, if it matters */
    return p->cand[ci]->proven_fill(p->links[ci], h, peer_same_host(p, h), out);
}

static void on_ctl_hello(void *owner, const tdp_hello *h)
{
    tdp_pipe *p = owner;
    if (p->state != PIPE_CONNECTING)
        return;
    const tdp__plane_ops *po;
    for (size_t i = 0; (po = tdp__plane_at(i)) != NULL; i++) {
        /* each plane reads its own records (wire.c only framed them) */
        if (po->hello_check != NULL && po->hello_check(h) != TDP_OK) {
            tdp_log_warn("pipe %s: the peer's HELLO has a malformed %s record: disconnecting",
                         p->ctl.peer_name, po->name);
            pipe_fail(p, TDP_EPROTO, "malformed plane record in HELLO");
            return;
        }
    }
    p->same_host = peer_same_host(p, h);
    p->peer_ready = h->ready == TDP_READY_V1;
    p->peer_max_msg = h->max_msg_bytes;
    p->peer_depth = h->recv_depth;
    p->peer_window = h->window;
    p->stats.recv_depth = p->depth;
    p->stats.peer_depth = p->peer_depth;
    if (h->resume != 0 && p->ctl.dialer) {
        /* only a dialer reconnects: a listener has no earlier stream to resume */
        tdp_log_warn("pipe %s: its HELLO claims to resume a stream, which only a dialer does",
                     p->ctl.peer_name);
        pipe_fail(p, TDP_EPROTO, "the listener's HELLO claims to resume a stream");
        return;
    }
    if (p->stats.resumed_from != 0 && h->resume != p->stats.resumed_from) {
        pipe_fail(p, TDP_EPROTO, "the peer's first message does not start where its HELLO says");
        return;
    }
    if (h->resume != 0 && p->stats.resumed_from == 0) {
        /* the peer reconnected: its messages go on from there (the ones
         * before went to a peer that is gone) */
        p->rx_seq = h->resume - 1;
        p->stats.resumed_from = h->resume;
    }

    sum_negotiate(p, h);

    int ci = choose_plane(p, h, p->same_host);
    if (ci < 0) {
        pipe_fail(p, TDP_ENOTSUP, "no data plane both sides allow");
        return;
    }
    for (int i = 0; i < p->ncand; i++) {
        if (i != ci && p->links[i] != NULL) {
            p->cand[i]->link_close(p->links[i], false);
            p->links[i] = NULL;
        }
    }
    p->plane = p->cand[ci];
    p->link = p->links[ci];
    p->peer_caps = h->caps;

    /* sends in flight are bounded by the peer's credit (its window for the
     * smallest layouts); twice that covers a credit that comes back before
     * the local completion of its send */
    p->nticket = 2 * tdp__window(p->peer_depth, p->peer_window, 1) + 1;
    p->tickets = tdp__alloc_array(p->nticket, sizeof(*p->tickets));
    if (p->tickets == NULL) {
        pipe_fail(p, TDP_ENOMEM, "no memory for send tickets");
        return;
    }
    memset(p->tickets, 0, p->nticket * sizeof(*p->tickets));
    for (uint32_t i = 0; i < p->nticket; i++)
        p->tickets[i].next_free = i + 1 < p->nticket ? &p->tickets[i + 1] : NULL;
    p->free_tickets = p->tickets;
    tdp__link_peer lp = {
        .hello = h,
        .same_host = p->same_host,
        .local = p->ctl.peer_local,
        .peer_depth = p->peer_depth,
        .depth = p->depth,
        .peer_window = p->peer_window,
        .window = p->opts.recv_window_bytes,
        .peer_caps = h->caps,
        .mode = p->opts.peer_mode,
        .max_json_bytes = p->limits.max_json_bytes,
        .max_total_bytes = p->limits.max_total_bytes,
        .sent_seq = p->send_seq,
        .cuda_device = p->opts.cuda_device_set ? p->opts.cuda_device : -1,
        .checksum = p->sum_on,
    };
    tdp_err rc = p->plane->link_start(p->link, &lp);
    if (rc != TDP_OK) {
        pipe_fail(p, rc, "cannot start the data plane");
        return;
    }
    p->plane_mem =
        p->plane->link_mem != NULL ? p->plane->link_mem(p->link) & p->plane->mem : p->plane->mem;
    become_open(p);
}

/* The peer's READY for a prepare (session_prepare.c). */
static void on_ctl_ready(void *owner, const tdp_ready *r)
{
    tdp_pipe *p = owner;
    if (!tdp__prep_ready(p, r))
        pipe_fail(p, TDP_EPROTO, "READY for a prepare never sent");
}

static const tdp__ctl_up ctl_up = {
    .connected = on_ctl_connected,
    .hello_in = on_ctl_hello_in,
    .proven = on_ctl_proven,
    .hello = on_ctl_hello,
    .bye = on_ctl_bye,
    .ready = on_ctl_ready,
    .closed = on_ctl_closed,
    .bye_flushed = on_ctl_bye_flushed,
};

/* ---- plane events ----------------------------------------------------------- */

static void proto_fail(tdp_pipe *p, tdp_err err, const char *why)
{
    tdp_log_warn("pipe %s: %s: disconnecting", p->ctl.peer_name, why);
    pipe_fail(p, err, why);
}

/*
 * The plane a frame came by: the chosen one, or — a fast peer that has our
 * HELLO may send before we have read its own — a candidate, which must
 * then be the one the HELLO picks.
 */
static const tdp__plane_ops *frame_plane(tdp_pipe *p, tdp__link *l)
{
    if (p->state == PIPE_DEAD)
        return NULL;
    if (p->secret_len > 0 && !p->ctl.authed) {
        /* its proof left before any frame: it may be unread on the socket */
        tdp__ctl_pump(&p->ctl);
        if (p->state == PIPE_DEAD)
            return NULL;
        if (!p->ctl.authed) {
            /* nothing is decoded, received or allocated for it */
            proto_fail(p, TDP_EAUTH, "data-plane frame before the peer proved it holds the secret");
            return NULL;
        }
    }
    if (p->link != NULL)
        return l == p->link ? p->plane : NULL;
    int i = link_index(p, l);
    return i >= 0 ? p->cand[i] : NULL;
}

static void up_failed(void *owner, tdp__link *l, tdp_err st, const char *why)
{
    tdp_pipe *p = owner;
    if (frame_plane(p, l) == NULL || p->link_failed)
        return;
    if (st != TDP_ECONNRESET) { /* the peer sent something invalid */
        proto_fail(p, st, why);
        return;
    }
    /* a transfer in flight was lost, or nothing is left to say how it ended
     * (sends still waiting for credit were never handed over: they wait too) */
    if (p->state == PIPE_CONNECTING || !tdp__ctl_open(&p->ctl) || p->rx_inflight > 0 ||
        p->tx_inflight > 0) {
        pipe_fail(p, p->peer_bye ? TDP_ECLOSED : st, why);
        return;
    }
    /*
     * The data plane saw the peer go. A peer that closed cleanly tears its
     * side down right after its BYE, which may not have been read yet: the
     * control socket decides (BYE, then EOF: a clean end; EOF alone or
     * silence until the linger deadline: a failure).
     */
    p->link_failed = true;
    tdp_log_debug("pipe %s: data plane ended (%s); the control socket decides",
                  p->ctl.peer_name, why);
    /* sends made from now on wait for that verdict (bounded by the linger) */
    arm_timer(p, p->opts.linger_ms);
    end_if_peer_done(p);
}

static bool take_credit(tdp_pipe *p, uint64_t total)
{
    if (total < p->peer_credit || total > p->send_seq - p->credit_base) {
        proto_fail(p, TDP_EPROTO, "credit beyond what was sent");
        return false;
    }
    if (total > p->peer_credit) {
        p->peer_credit = total;
        send_kick(p);
        if (p->credit_cb != NULL)
            p->credit_cb(p->credit_arg);
    }
    return true;
}

static void up_credit(void *owner, tdp__link *l, uint64_t total)
{
    tdp_pipe *p = owner;
    if (frame_plane(p, l) != NULL)
        take_credit(p, total);
}

/*
 * May this side hold the receive layout sc? The checksum is computed by
 * host code (never on device memory), and a server's budget caps the
 * storage of all its clients: depth buffers of the largest layout so far
 * (storage that is large enough is reused). Fails the pipe when not.
 */
/* Messages of receive layout sc that may be in flight to this side. */
static uint32_t rx_window(const tdp_pipe *p, const tdp_schema *sc)
{
    return tdp__window(p->depth, p->opts.recv_window_bytes, tdp_schema_total_bytes(sc));
}

static tdp_err rx_layout_admit(tdp_pipe *p, const tdp_schema *sc)
{
    if (p->sum_on && tdp_schema_device(sc).type != TDP_DEVICE_CPU) {
        pipe_fail(p, TDP_ENOTSUP,
                  "the payload checksum covers host memory only, and this "
                  "layout is received into device memory");
        return TDP_ENOTSUP;
    }
    /* <= 64 x total cap */
    uint64_t need = (uint64_t)rx_window(p, sc) * tdp_schema_total_bytes(sc);
    if (p->budget == NULL || need <= p->budget_held)
        return TDP_OK;
    if (!tdp__budget_take(p->budget, need - p->budget_held)) {
        tdp_log_warn("pipe %s: a layout of %u x %" PRIu64 " bytes would take the server past its "
                     "memory cap (%" PRIu64 " of %" PRIu64 " bytes in use): refused",
                     p->ctl.peer_name, rx_window(p, sc), tdp_schema_total_bytes(sc),
                     tdp__budget_used(p->budget), p->budget->cap);
        pipe_fail(p, TDP_ELIMIT, "schema over the server's memory cap");
        return TDP_ELIMIT;
    }
    p->budget_held = need;
    return TDP_OK;
}

static void up_schema(void *owner, tdp__link *l, const tdp__frame *f, const void *json,
                      size_t length)
{
    tdp_pipe *p = owner;
    const tdp__plane_ops *ops = frame_plane(p, l);
    char why[256];
    tdp_schema *sc = NULL;

    if (ops == NULL)
        return;
    if (f->seq != p->rx_seq + 1 && length == f->length && p->state == PIPE_CONNECTING &&
        !p->ctl.dialer && p->rx_seq == 0 && p->stats.schemas_recv == 0 && f->seq >= 2 &&
        f->seq <= TDP_RESUME_MAX) {
        /* a reconnected peer's first SCHEMA, ahead of the HELLO that says
         * where it resumes (the HELLO must then agree: on_ctl_hello) */
        p->rx_seq = f->seq - 1;
        p->stats.resumed_from = f->seq;
    }
    if (f->seq != p->rx_seq + 1 || length != f->length) {
            proto_fail(p, TDP_EPROTO, "schema frame out of sequence or with a wrong length");
        return;
    }
    if (f->length > p->limits.max_json_bytes || f->arg > p->limits.max_total_bytes) {
        proto_fail(p, TDP_EMSGSIZE, "schema over this side's limits");
        return;
    }
    tdp_err rc = tdp_schema_decode(json, length, &p->limits, &sc, why, sizeof(why));
    if (rc != TDP_OK) {
        tdp_log_warn("pipe %s: rejected schema: %s", p->ctl.peer_name, why);
        pipe_fail(p, rc == TDP_ENOMEM ? TDP_ENOMEM : TDP_ESCHEMA, why);
        return;
    }
    if (tdp_schema_hash(sc) != f->hash || tdp_schema_total_bytes(sc) != f->arg) {
        tdp_schema_unref(sc);
        proto_fail(p, TDP_ESCHEMA, "schema hash or size does not match its frame");
        return;
    }
    if (p->opts.recv_device_set &&
        !tdp_device_equal(p->opts.recv_device, tdp_schema_device(sc))) {
        tdp_schema *local;
        rc = tdp_schema_with_device(sc, p->opts.recv_device, &local);
        tdp_schema_unref(sc);
        if (rc != TDP_OK) {
            pipe_fail(p, rc, "cannot place the schema on the receive device");
            return;
        }
        sc = local;
    }
    if ((rc = rx_layout_admit(p, sc)) != TDP_OK) {
        tdp_schema_unref(sc);
        return;
    }
    tdp_schema_unref(p->rx_schema);
    p->rx_schema = sc;
    p->rx_hash = f->hash;
    p->stats.schemas_recv++;
    if ((rc = ops->rx_schema(l, sc, rx_window(p, sc))) != TDP_OK) {
        pipe_fail(p, rc, "cannot prepare receive storage");
        return;
    }
    tdp__prep_schema_in(p, f);
}

/*
 * A slot holds a reference on its view from the plane's recv until it is
 * free again: a lent view stays valid until released (or the pipe freed),
 * even when the pipe failed and its plane let go of it meanwhile.
 */
static void slot_free(rx_slot *s)
{
    tdp_td *td = s->td;
    s->state = SLOT_FREE;
    s->td = NULL;
    tdp_td_unref(td);
}

/* CLOCK_MONOTONIC, ns: what latency_stats records (only read when it is on). */
static uint64_t lat_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void lat_record(tdp_pipe *p, tdp_latency which, uint64_t since_ns)
{
    uint64_t now = lat_now_ns();
    tdp_hist_record(&p->lat[which], now > since_ns ? now - since_ns : 0);
}

/*
 * The payload in s against the checksum its frame carried: a mismatch
 * marks it bad, and the receive it would go to drops it (deliver).
 */
static void rx_sum_check(tdp_pipe *p, rx_slot *s)
{
    if (!s->has_sum)
        return;
    s->has_sum = false;
    /* rx_layout_admit keeps checksummed layouts in host memory */
    if (s->td->device.type == TDP_DEVICE_CPU && tdp__sum(s->td->data, s->td->nbytes) == s->sum)
        return;
    s->bad = true;
    p->stats.checksum_errors++;
    tdp_log_warn("pipe %s: message %" PRIu64 ": payload checksum mismatch: dropped",
                 p->ctl.peer_name, s->seq);
}

static void slot_ready(tdp_pipe *p, rx_slot *s)
{
    s->state = SLOT_READY;
    if (p->lat != NULL)
        s->ready_ns = lat_now_ns();
    p->ready[(p->ready_head + p->ready_count) % TDP_MAX_DEPTH] = (uint32_t)(s - p->slots);
    p->ready_count++;
    if (!s->bad) {
        p->stats.msgs_recv++;
        p->stats.bytes_recv += s->td->nbytes;
    }
    if (peer_done(p))
        timer_del(p);
    deliver(p);
}

static void up_data(void *owner, tdp__link *l, const tdp__frame *f, void *desc)
{
    tdp_pipe *p = owner;
    const tdp__plane_ops *ops = frame_plane(p, l);
    if (ops == NULL)
        return;
    if (p->rx_schema == NULL || f->hash != p->rx_hash) {
        proto_fail(p, TDP_EMISMATCH, "data frame for a schema this side does not hold");
        return;
    }
    if (f->seq != p->rx_seq + 1) {
        proto_fail(p, TDP_EPROTO, "data frame out of sequence");
        return;
    }
    if (f->length != tdp_schema_total_bytes(p->rx_schema)) {
        proto_fail(p, TDP_EMSGSIZE, "data length differs from the schema's size");
        return;
    }
    /* a sum only when both offered (a fast peer's DATA may come before its
     * HELLO is read: it had ours, so it sums only if we offered) */
    if (f->has_sum ? !p->opts.checksum : p->sum_on) {
        proto_fail(p, TDP_EPROTO, "data frame with a checksum not agreed, or without one agreed");
        return;
    }
    /* fewer than the window's messages in flight leave one of its slots free */
    rx_slot *s = NULL;
    uint32_t win = rx_window(p, p->rx_schema);
    for (uint32_t i = 0; i < win; i++) {
        if (p->slots[i].state == SLOT_FREE) {
            s = &p->slots[i];
            break;
        }
    }
    if (s == NULL) {
        proto_fail(p, TDP_EPROTO, "data frame beyond the credit granted");
        return;
    }
    p->rx_seq = f->seq;
    s->seq = f->seq;
    s->epoch = p->epoch;
    s->state = SLOT_FILLING;
    s->has_sum = f->has_sum;
    s->sum = f->sum;
    s->bad = false;
    tdp_err rc = ops->recv(l, desc, (uint32_t)(s - p->slots), &s->td);
    if (rc == TDP_OK || rc == TDP_EAGAIN)
        tdp_td_ref(s->td);
    if (rc == TDP_OK) {
        rx_sum_check(p, s);
        slot_ready(p, s);
    } else if (rc == TDP_EAGAIN) {
        p->rx_inflight++;
    } else {
        s->state = SLOT_FREE;
        s->td = NULL;
        pipe_fail(p, rc == TDP_EPROTO || rc == TDP_EMSGSIZE ? rc : TDP_ECONNRESET,
                  "cannot receive data");
    }
}

static void up_landed(void *owner, tdp__link *l, uint32_t slot, tdp_err st)
{
    tdp_pipe *p = owner;
    if (slot >= TDP_MAX_DEPTH || p->slots[slot].state != SLOT_FILLING)
        return;
    rx_slot *s = &p->slots[slot];
    p->rx_inflight--;
    if (frame_plane(p, l) == NULL) {
        slot_free(s);
        deliver(p);
        return;
    }
    if (st != TDP_OK) {
        /* never hand out a partly filled buffer */
        slot_free(s);
        if (st == TDP_ECUDA) /* this side's copy to the device, not the peer */
            pipe_fail(p, TDP_ECUDA, "copying a message to the device failed");
        else
            pipe_fail(p, TDP_ECONNRESET, "data transfer failed");
        return;
    }
    rx_sum_check(p, s);
    slot_ready(p, s);
    end_if_peer_done(p);
}

/* A send the plane is done with: its ticket comes back and its op completes. */
static void sent_done(tdp_pipe *p, tx_ticket *t, tdp_err st)
{
    tdp_op *op = t->op;
    t->op = NULL;
    t->busy = false;
    t->next_free = p->free_tickets;
    p->free_tickets = t;
    p->tx_inflight--;
    if (op != NULL) {
        if (st != TDP_OK && p->status != TDP_OK)
            st = p->status; /* say why the pipe ended, not how the transport noticed */
        if (p->lat != NULL && st == TDP_OK)
            lat_record(p, TDP_LAT_SEND, op->t_call_ns);
        tdp__op_complete(op, st);
    }
}

static void up_sent(void *owner, tdp__link *l, void *cookie, tdp_err st)
{
    tdp_pipe *p = owner;
    tx_ticket *t = cookie;
    if (p->kicking) { /* inside the session's own call: send_kick takes it when done */
        t->done_st = st;
        t->next_done = NULL;
        if (p->done_tail != NULL)
            p->done_tail->next_done = t;
        else
            p->done_head = t;
        p->done_tail = t;
        return;
    }
    sent_done(p, t, st);
    if (p->state != PIPE_OPEN)
        return;
    send_kick(p); /* a ticket came back: a send may have waited for one */
    check_close(p);
}

static const tdp__plane_up plane_up = {
    .schema = up_schema,
    .data = up_data,
    .credit = up_credit,
    .landed = up_landed,
    .sent = up_sent,
    .failed = up_failed,
};

/* ---- sending --------------------------------------------------------------- */

static void post_send(tdp_pipe *p, tdp_op *op, tx_ticket *t)
{
    tdp_schema *sc = op->td->schema;
    bool new_schema = p->sent_schema != sc && !tdp_schema_equal(p->sent_schema, sc);
    if (p->sent_schema != sc) {
        /* remember this object: the next send compares pointers only */
        tdp_schema_unref(p->sent_schema);
        p->sent_schema = tdp_schema_ref(sc);
    }
    t->op = op;
    t->busy = true;
    op->seq = p->send_seq + 1;
    tdp__tx tx = {
        .td = op->td,
        .seq = op->seq,
        .schema = new_schema ? sc : NULL,
        .credit = p->released, /* the credit this side owes rides along for free */
        .cookie = t,
    };
    p->send_seq = op->seq;
    p->tx_inflight++;
    if (p->plane->credit != NULL && p->released > p->credit_sent)
        p->credit_sent = p->released;
    if (new_schema)
        p->stats.schemas_sent++;
    /* the plane may fail the pipe inside send, completing op (its td gone) */
    uint64_t nbytes = op->td->nbytes;
    p->stats.msgs_sent++;
    p->stats.bytes_sent += nbytes;
    tdp_err rc = p->plane->send(p->link, &tx);
    if (rc != TDP_OK) {
        /* the plane took nothing: the ticket and the op come back now */
        p->stats.msgs_sent--;
        p->stats.bytes_sent -= nbytes;
        sent_done(p, t, rc);
        pipe_fail(p,
                  rc == TDP_EMSGSIZE || rc == TDP_EINVAL || rc == TDP_ENOTSUP ? rc : TDP_ECONNRESET,
                  "send failed");
    }
}

/*
 * A message in memory the link cannot carry is refused, never handed over
 * (a transport given a device pointer it cannot read crashes).
 */
static bool refuse_memory(tdp_pipe *p, tdp_op *op)
{
    tdp_device dev = tdp_td_device(op->td);
    uint32_t need = dev.type == TDP_DEVICE_CPU ? TDP__MEM_HOST : TDP__MEM_ANY_CUDA;
    if ((p->plane_mem & need) != 0)
        return false;
    char d[TDP_DEVICE_STRLEN];
    tdp_log_error("pipe %s: the %s plane cannot carry %s memory; send refused", p->ctl.peer_name,
                  p->plane->name, tdp_device_format(dev, d));
    return true;
}

#define PREP_RETRY_MS 1 /* a prepare whose plane was not up yet */

static void prep_retry_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    send_kick(arg);
}

/* The prepare at the queue's head waits for its plane: look again soon. */
static void prep_retry(tdp_pipe *p)
{
    if (p->prep_ev == NULL) {
        p->prep_ev = evtimer_new(tdp__loop_base(p->loop), prep_retry_cb, p);
        if (p->prep_ev == NULL) {
            tdp__op_complete(tdp__opq_pop(&p->sendq), TDP_ENOMEM);
            return;
        }
    }
    struct timeval tv = {0, PREP_RETRY_MS * 1000};
    event_add(p->prep_ev, &tv);
}

/* Messages of op's layout that may be in flight to the peer. */
static uint32_t tx_window(const tdp_pipe *p, const tdp_op *op)
{
    if (p->peer_window == 0 || op->td == NULL)
        return p->peer_depth;
    return tdp__window(p->peer_depth, p->peer_window, tdp_schema_total_bytes(op->td->schema));
}

void tdp__session_keep_window(tdp_pipe *p, uint64_t window)
{
    if (p != NULL && window < p->peer_window)
        p->peer_window = window;
}

/* Send what the queue's head may: credit, a ticket and the link allow. */
static void kick_once(tdp_pipe *p)
{
    while (p->sendq.head != NULL && p->state == PIPE_OPEN && !p->peer_bye && !p->link_failed) {
        if (p->sendq.head->prep != NULL) { /* tdp_pipe_prepare: no credit, no ticket */
            tdp_err fail = TDP_OK;
            if (tdp__prep_step(p, &fail) == TDP__PREP_RETRY) {
                prep_retry(p);
                return;
            }
            if (fail != TDP_OK) {
                pipe_fail(p, fail, "prepare failed");
                return;
            }
            continue;
        }
        if (refuse_memory(p, p->sendq.head)) {
            tdp__op_complete(tdp__opq_pop(&p->sendq), TDP_ENOTSUP);
            continue;
        }
        if (p->send_seq - p->credit_base - p->peer_credit >= tx_window(p, p->sendq.head) ||
            p->free_tickets == NULL) {
            if (p->done_head != NULL)
                return; /* completions are queued: send_kick takes them, then looks again */
            if (!p->sendq.head->waited && p->plane->poll_credit != NULL) {
                /* credit the peer gave while nobody drove the loop is not a wait */
                uint64_t before = p->peer_credit;
                p->plane->poll_credit(p->link);
                if (p->peer_credit != before || p->sendq.head == NULL || p->state != PIPE_OPEN ||
                    p->peer_bye || p->link_failed)
                    continue; /* credit came (or the pipe changed): look again */
            }
            if (!p->sendq.head->waited) { /* count each waiting send once */
                p->sendq.head->waited = true;
                p->stats.credit_waits++;
            }
            return;
        }
        tdp_op *op = tdp__opq_pop(&p->sendq);
        tx_ticket *t = p->free_tickets;
        p->free_tickets = t->next_free;
        post_send(p, op, t);
    }
}

/* Completions queued during kick_once; true if there were any. */
static bool take_done(tdp_pipe *p)
{
    tx_ticket *t = p->done_head;
    if (t == NULL)
        return false;
    while (t != NULL) {
        p->done_head = t->next_done;
        if (p->done_head == NULL)
            p->done_tail = NULL;
        sent_done(p, t, t->done_st);
        t = p->done_head;
    }
    return true;
}

/*
 * Never re-entered: a plane that completes a send inside ops->send has its
 * completion queued (up_sent), and the tickets it gives back are used by
 * this loop, not by a nested one.
 */
static void send_kick(tdp_pipe *p)
{
    if (p->kicking)
        return; /* the outer call goes on with whatever made this one */
    p->kicking = true;
    bool done = false;
    do
        kick_once(p);
    while (take_done(p) && (done = true));
    p->kicking = false;
    if (done && p->state == PIPE_OPEN)
        check_close(p);
}

static void send_start(void *arg)
{
    tdp_op *op = arg;
    tdp_pipe *p = op->owner;
    if (p->state == PIPE_DEAD || p->close_requested || p->peer_bye) {
        tdp__op_complete(op, p->peer_bye                              ? TDP_ECLOSED
                             : p->status != TDP_OK && !p->close_requested ? p->status
                                                                          : TDP_ECANCELED);
        return;
    }
    op->waited = false;
    tdp__opq_push(&p->sendq, op);
    send_kick(p);
}

/* ---- credits and releases -------------------------------------------------- */

static void send_credit(tdp_pipe *p)
{
    if (p->state != PIPE_OPEN || p->plane->credit == NULL || p->released == p->credit_sent ||
        p->link_failed)
        return;
    p->credit_sent = p->released;
    if (p->plane->credit(p->link, p->released) != TDP_OK)
        up_failed(p, p->link, TDP_ECONNRESET, "cannot send credit");
}

static void credit_ev_cb(evutil_socket_t fd, short what, void *arg)
{
    send_credit(arg);
}

/*
 * A released buffer is a credit for the peer. defer_credit: the caller is
 * about to run the loop (a receive is starting), so let the credit wait for
 * the end of this turn — a DATA frame sent meanwhile carries it for free.
 */
static void slot_release(tdp_pipe *p, rx_slot *s, bool defer_credit)
{
    if (s->state != SLOT_LENT)
        return;
    if (p->lent1 == (int32_t)(s - p->slots))
        p->lent1 = -1;
    bool ours = s->epoch == p->epoch; /* not from a link gone since */
    if (p->link != NULL && ours)
        p->plane->release(p->link, (uint32_t)(s - p->slots));
    slot_free(s);
    if (p->state != PIPE_OPEN || !ours)
        return;
    p->released++;
    if (p->plane->credit == NULL)
        return; /* the plane's own release is the credit (shm): nothing to send */
    /*
     * With a window in force, fewer than depth credits wait for the end of
     * this loop turn too: a receiver draining a batch then returns it in one
     * frame, not one per message. The sender is never held back by them
     * alone: depth is no more than any layout's window.
     */
    bool batch = p->window_sent && p->rx_schema != NULL && rx_window(p, p->rx_schema) > p->depth &&
                 p->released - p->credit_sent < p->depth;
    if ((defer_credit || batch) && p->credit_ev != NULL) {
        static const struct timeval zero = {0, 0};
        event_add(p->credit_ev, &zero);
        return;
    }
    send_credit(p);
}

/* ---- receiving -------------------------------------------------------------- */

/* A message whose checksum did not match: its receive fails, its buffer goes back. */
static void rx_drop(tdp_pipe *p, rx_slot *s, tdp_op *op)
{
    s->bad = false;
    slot_release(p, s, false);
    tdp__op_complete(op, TDP_ECHECKSUM);
}

static void deliver(tdp_pipe *p)
{
    while (p->recvq.head != NULL) {
        tdp_err end = TDP_OK;
        if (p->ready_count == 0) {
            if (peer_done(p))
                end = TDP_ECLOSED; /* every message announced in BYE was delivered */
            else if (p->state == PIPE_DEAD)
                end = p->status == TDP_OK ? TDP_ECANCELED : p->status;
            else
                return;
            tdp__op_complete(tdp__opq_pop(&p->recvq), end);
            continue;
        }
        uint32_t si = p->ready[p->ready_head];
        p->ready_head = (p->ready_head + 1) % TDP_MAX_DEPTH;
        p->ready_count--;
        rx_slot *s = &p->slots[si];
        s->state = SLOT_LENT;
        if (s->bad) {
            rx_drop(p, s, tdp__opq_pop(&p->recvq));
            continue;
        }
        if (p->depth == 1)
            p->lent1 = (int32_t)si;
        tdp_op *op = tdp__opq_pop(&p->recvq);
        if (p->lat != NULL)
            lat_record(p, TDP_LAT_RECV_WAIT, s->ready_ns);
        op->td = s->td;
        op->seq = s->seq;
        tdp__op_complete(op, TDP_OK);
    }
    end_if_peer_done(p);
}

static void recv_start(void *arg)
{
    tdp_op *op = arg;
    tdp_pipe *p = op->owner;
    if (p->depth == 1 && p->lent1 >= 0)
        slot_release(p, &p->slots[p->lent1], true); /* depth 1: the next receive overwrites */
    tdp__opq_push(&p->recvq, op);
    deliver(p);
}

/* ---- entry points ------------------------------------------------------------- */

/* A timed-out op: take it back from wherever it is (loop thread). */
static void take_back(tdp_op *op)
{
    tdp_pipe *p = op->owner;
    if (tdp__opq_remove(&p->sendq, op) || tdp__opq_remove(&p->recvq, op)) {
        tdp__op_complete(op, TDP_ETIMEDOUT);
        return;
    }
    if (tdp__prep_take_back(p, op))
        return;
    /* already with the plane: it keeps the buffer until the transport lets go */
    for (uint32_t i = 0; i < p->nticket; i++) {
        if (p->tickets[i].op == op) {
            p->tickets[i].op = NULL;
            tdp__op_complete(op, TDP_ETIMEDOUT);
            return;
        }
    }
}

static bool reject_busy(tdp_op *op, const char *what)
{
    if (!tdp__op_pending(op))
        return false;
    /* completing it here would corrupt the operation in flight */
    tdp_log_error("%s: op %p is still pending; ignored", what, (void *)op);
    return true;
}

void tdp_pipe_send_async(tdp_pipe *pipe, tdp_td *td, tdp_op *op)
{
    if (op == NULL || reject_busy(op, "tdp_pipe_send_async"))
        return;
    op->kind = OP_SEND;
    op->owner = pipe;
    op->take_back = take_back;
    if (pipe == NULL || td == NULL) {
        op->td = NULL;
        tdp__op_complete(op, TDP_EINVAL);
        return;
    }
    op->td = tdp_td_ref(td);
    if (pipe->lat != NULL) /* set once when the pipe is made: any thread may read it */
        op->t_call_ns = lat_now_ns();
    tdp__op_submit(pipe->loop, op, send_start);
}

void tdp_pipe_recv_async(tdp_pipe *pipe, tdp_op *op)
{
    if (op == NULL || reject_busy(op, "tdp_pipe_recv_async"))
        return;
    op->kind = OP_RECV;
    op->td = NULL;
    op->owner = pipe;
    op->take_back = take_back;
    if (pipe == NULL) {
        tdp__op_complete(op, TDP_EINVAL);
        return;
    }
    tdp__op_submit(pipe->loop, op, recv_start);
}

static bool blocking_ok(tdp_pipe *p)
{
    /* a blocking call inside a loop callback would wait for itself */
    return !(tdp__loop_running(p->loop) && tdp_loop_on_thread(p->loop));
}

tdp_err tdp_pipe_send(tdp_pipe *pipe, tdp_td *td, int64_t timeout_ms)
{
    if (pipe == NULL || td == NULL || !blocking_ok(pipe) || tdp__op_pending(pipe->sync_send))
        return TDP_EINVAL;
    tdp_op *op = pipe->sync_send;
    op->kind = OP_SEND;
    op->td = tdp_td_ref(td);
    if (pipe->lat != NULL)
        op->t_call_ns = lat_now_ns();
    return tdp__op_run(pipe->loop, op, send_start, timeout_ms);
}

/* tdp_pipe_prepare: a send op without a td (session_prepare.c handles it at the queue's head). */
tdp_err tdp_pipe_prepare(tdp_pipe *pipe, tdp_schema *schema, int64_t timeout_ms)
{
    if (pipe == NULL || schema == NULL || tdp__op_pending(pipe->sync_send))
        return TDP_EINVAL;
    if (tdp__loop_running(pipe->loop) && tdp_loop_on_thread(pipe->loop))
        return TDP_EINVAL; /* it would wait for itself */
    tdp_op *op = pipe->sync_send;
    op->kind = OP_SEND;
    op->td = NULL;
    op->prep = schema; /* the caller's reference: the op is done before this returns */
    tdp_err rc = tdp__op_run(pipe->loop, op, send_start, timeout_ms);
    op->prep = NULL;
    return rc;
}

tdp_err tdp_pipe_recv(tdp_pipe *pipe, int64_t timeout_ms, tdp_td **out)
{
    if (pipe == NULL || out == NULL || !blocking_ok(pipe) || tdp__op_pending(pipe->sync_recv))
        return TDP_EINVAL;
    tdp_op *op = pipe->sync_recv;
    op->kind = OP_RECV;
    op->td = NULL;
    tdp_err rc = tdp__op_run(pipe->loop, op, recv_start, timeout_ms);
    if (rc == TDP_OK)
        *out = op->td;
    return rc;
}

tdp_err tdp_pipe_send_gather(tdp_pipe *pipe, tdp_schema *schema, const void *const *ptrs,
                             int64_t timeout_ms)
{
    if (pipe == NULL || schema == NULL || (ptrs == NULL && tdp_schema_num_tensors(schema) > 0) ||
        tdp_schema_device(schema).type != TDP_DEVICE_CPU)
        return TDP_EINVAL;
    /* the send buffer is rebuilt only when the schema changes */
    if (pipe->gather_td == NULL || pipe->gather_td->schema != schema) {
        tdp_td *td;
        tdp_err rc = tdp_td_new(schema, &td);
        if (rc != TDP_OK)
            return rc;
        tdp_td_unref(pipe->gather_td);
        pipe->gather_td = td;
    }
    for (uint32_t i = 0; i < tdp_schema_num_tensors(schema); i++) {
        tdp_leaf l;
        tdp_td_leaf_at(pipe->gather_td, i, &l);
        if (l.nbytes > 0)
            memcpy(l.data, ptrs[i], l.nbytes);
    }
    return tdp_pipe_send(pipe, pipe->gather_td, timeout_ms);
}

/* Releases made on other threads, handed to the loop thread (under w.mtx). */
static void release_task(void *arg)
{
    tdp_pipe *p = arg;
    tdp_td *batch[2 * TDP_MAX_DEPTH];
    pthread_mutex_lock(&p->w.mtx);
    uint32_t n = p->nrel;
    memcpy(batch, p->rel, n * sizeof(batch[0]));
    p->nrel = 0;
    p->rel_posted = false;
    pthread_mutex_unlock(&p->w.mtx);
    for (uint32_t k = 0; k < n; k++) {
        for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
            if (p->slots[i].td == batch[k] && p->slots[i].state == SLOT_LENT) {
                slot_release(p, &p->slots[i], false);
                break;
            }
        }
    }
}

typedef struct release_req {
    tdp_pipe *p;
    tdp_td *td;
} release_req;

static void release_now(void *arg)
{
    release_req *r = arg;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        if (r->p->slots[i].td == r->td && r->p->slots[i].state == SLOT_LENT) {
            slot_release(r->p, &r->p->slots[i], false);
            return;
        }
    }
}

void tdp_pipe_release(tdp_pipe *pipe, tdp_td *td)
{
    if (pipe == NULL || td == NULL)
        return;
    /* at once on the loop thread, or holding an idle loop */
    release_req r = {pipe, td};
    if (tdp__loop_run_inline(pipe->loop, release_now, &r))
        return;
    /* another thread: the slots belong to the loop thread; queue it there */
    pthread_mutex_lock(&pipe->w.mtx);
    bool dup = false;
    for (uint32_t i = 0; i < pipe->nrel; i++)
        dup |= pipe->rel[i] == td;
    if (!dup && pipe->nrel < 2 * TDP_MAX_DEPTH)
        pipe->rel[pipe->nrel++] = td;
    bool post = !pipe->rel_posted;
    pipe->rel_posted = true;
    pthread_mutex_unlock(&pipe->w.mtx);
    if (post)
        tdp__loop_post_task(pipe->loop, &pipe->rel_task); /* fn and arg set once, at creation */
}

/* ---- closing ------------------------------------------------------------------ */

static void check_close(tdp_pipe *p)
{
    if (!p->close_requested || p->state != PIPE_OPEN)
        return;
    if (!p->ctl.bye_sent) {
        if (p->sendq.head != NULL || p->tx_inflight > 0)
            return; /* BYE names the last seq: everything before it must be gone */
        tdp_bye b = {.last_seq = p->send_seq, .reason = TDP_OK};
        tdp__ctl_send_bye(&p->ctl, &b);
        return;
    }
    if (p->bye_flushed)
        closed_cleanly(p);
}

typedef struct close_req {
    tdp_pipe *p;
    int64_t timeout_ms;
} close_req;

static void close_start(tdp_pipe *p, int64_t timeout_ms)
{
    if (p->state == PIPE_DEAD || p->close_requested)
        return;
    p->close_requested = true;
    p->close_deadline = timeout_ms >= 0 ? tdp__now_ms() + timeout_ms : -1;
    if (p->state == PIPE_CONNECTING || !tdp__ctl_open(&p->ctl)) {
        pipe_fail(p, TDP_ECLOSED, "closed");
        return;
    }
    if (timeout_ms >= 0)
        arm_timer(p, timeout_ms);
    check_close(p);
}

static void close_task(void *arg)
{
    close_req *r = arg;
    close_start(r->p, r->timeout_ms);
}

static void state_task(void *arg)
{
    tdp_pipe *p = ((void **)arg)[0];
    tdp_err *st = ((void **)arg)[1];
    if (p->state != PIPE_DEAD)
        *st = TDP_EAGAIN;
    else
        *st = p->status == TDP_ECLOSED && p->close_requested && !p->peer_bye ? TDP_OK : p->status;
}

static tdp_err state_now(tdp_pipe *p)
{
    tdp_err st;
    void *args[2] = {p, &st};
    tdp__call_on_loop(p->loop, state_task, args);
    return st;
}

tdp_err tdp_pipe_close(tdp_pipe *pipe, int64_t timeout_ms)
{
    if (pipe == NULL || !blocking_ok(pipe))
        return TDP_EINVAL;
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    close_req r = {pipe, -1};
    tdp__call_on_loop(pipe->loop, close_task, &r);
    tdp_err st;
    while ((st = state_now(pipe)) == TDP_EAGAIN) {
        int64_t left = deadline < 0 ? 20 : deadline - tdp__now_ms();
        if (left <= 0)
            break;
        /* nobody runs the loop: run it here a while; else (close is rare)
         * check again in a millisecond */
        volatile bool never = false;
        if (tdp__loop_run_until(pipe->loop, &never, left < 20 ? left : 20) == TDP_EINVAL) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    if (st == TDP_EAGAIN)
        st = TDP_ETIMEDOUT;
    return st == TDP_ECLOSED ? TDP_OK : st;
}

typedef struct async_req {
    tdp__task task;
    tdp_pipe *p;
    int64_t arg;
} async_req;

static void close_async_task(void *arg)
{
    async_req *r = arg;
    close_start(r->p, r->arg);
    tdp__free(r);
}

static void abort_task(void *arg)
{
    async_req *r = arg;
    tdp_pipe *p = r->p;
    tdp_err why = (tdp_err)r->arg;
    bool dead = p->state == PIPE_DEAD;
    pipe_fail(p, why, "aborted");
    /* ended and waiting for the peer to hang up, or ended without a BYE to
     * deliver: nothing is left to wait for (a BYE with a reason is left to
     * reach the peer before its socket closes) */
    if (dead || why == TDP_ECONNRESET || why == TDP_ETIMEDOUT)
        hang_up(p);
    tdp__free(r);
}

static void post_async(tdp_pipe *p, tdp_loop_fn fn, int64_t arg)
{
    async_req *r = tdp__malloc(sizeof(*r));
    if (r == NULL) {
        tdp_log_error("no memory to hand a close or abort to the loop thread");
        return;
    }
    *r = (async_req){.task = {.fn = fn}, .p = p, .arg = arg};
    r->task.arg = r;
    if (!tdp__loop_run_inline(p->loop, fn, r)) /* fn frees r */
        tdp__loop_post_task(p->loop, &r->task);
}

void tdp_pipe_close_async(tdp_pipe *pipe, int64_t timeout_ms)
{
    if (pipe != NULL)
        post_async(pipe, close_async_task, timeout_ms);
}

void tdp_pipe_abort(tdp_pipe *pipe, tdp_err why)
{
    if (pipe != NULL)
        post_async(pipe, abort_task, why == TDP_OK ? TDP_ECANCELED : why);
}

static void set_end_task(void *arg)
{
    void **a = arg;
    tdp_pipe *p = a[0];
    p->end_cb = (tdp_pipe_end_cb)(uintptr_t)a[1];
    p->end_arg = a[2];
    maybe_tell_end(p);
}

void tdp_pipe_set_end_cb(tdp_pipe *pipe, tdp_pipe_end_cb cb, void *arg)
{
    if (pipe == NULL)
        return;
    void *a[3] = {pipe, (void *)(uintptr_t)cb, arg};
    tdp__call_on_loop(pipe->loop, set_end_task, a);
}

/* ---- loans ---------------------------------------------------------------------- */

typedef struct loan_req {
    tdp_pipe *p;
    tdp_schema *sc;
    tdp_td **out;
    tdp_err rc;
} loan_req;

static void loan_task(void *arg)
{
    loan_req *r = arg;
    tdp_pipe *p = r->p;
    if (p->state != PIPE_OPEN || p->link_failed) {
        r->rc = p->state == PIPE_CONNECTING ? TDP_EINVAL
                : p->status != TDP_OK       ? p->status
                                            : TDP_ECONNRESET;
        return;
    }
    if (p->plane->loan == NULL) {
        r->rc = tdp_td_new(r->sc, r->out);
        return;
    }
    r->rc = p->plane->loan(p->link, r->sc, r->out);
}

tdp_err tdp_pipe_loan(tdp_pipe *pipe, tdp_schema *schema, tdp_td **out)
{
    if (pipe == NULL || schema == NULL || out == NULL)
        return TDP_EINVAL;
    loan_req r = {pipe, schema, out, TDP_EINTERNAL};
    tdp__call_on_loop(pipe->loop, loan_task, &r);
    if (r.rc == TDP_EAGAIN && !tdp__loop_running(pipe->loop)) {
        /*
         * Nobody drives the loop (blocking calls only, none under way): what
         * would end the wait (a release from the peer, its shared-memory
         * proof) is read only when someone does. Give it one turn that does
         * not sleep, then ask again, so a caller retrying is not stuck.
         */
        volatile bool never = false;
        (void)tdp__loop_run_until(pipe->loop, &never, 0);
        r.rc = TDP_EINTERNAL;
        tdp__call_on_loop(pipe->loop, loan_task, &r);
    }
    return r.rc;
}

/* ---- creating and freeing ---------------------------------------------------------- */

/* A fresh control channel (at creation, and for each reconnect). */
static void ctl_setup(tdp_pipe *p)
{
    tdp__ctl_opts co = {p->opts.keepalive_idle_s, p->opts.keepalive_intvl_s,
                        p->opts.keepalive_cnt, p->opts.secret, p->opts.secret_len};
    tdp__ctl_init(&p->ctl, p->loop, &co, &ctl_up, p);
}

/* A link per candidate plane, in the registry's order of preference. */
static tdp_err make_links(tdp_pipe *p)
{
    tdp_err err = TDP_ENOTSUP;
    const tdp__plane_ops *o;
    p->ncand = 0;
    for (size_t i = 0; (o = tdp__plane_at(i)) != NULL && p->ncand < (int)TDP__PLANES_MAX; i++) {
        if ((p->opts.plane != TDP_PLANE_AUTO && p->opts.plane != o->id) || o->id >= 32 ||
            (p->opts.planes_forbidden & (1u << o->id)))
            continue;
        tdp_err rc = o->link_new(p->loop, p, &plane_up, &p->links[p->ncand]);
        if (rc == TDP_OK && o->link_device != NULL &&
            (rc = o->link_device(p->links[p->ncand],
                                 p->opts.cuda_device_set ? p->opts.cuda_device : -1)) != TDP_OK) {
            o->link_close(p->links[p->ncand], false);
            p->links[p->ncand] = NULL;
        }
        if (rc != TDP_OK) {
            tdp_log_debug("plane %s unavailable: %s", o->name, tdp_strerror(rc));
            err = rc;
            continue;
        }
        p->cand[p->ncand++] = o;
    }
    if (p->ncand > 0)
        return TDP_OK;
    return err == TDP_ENOMEM ? TDP_ENOTSUP : err;
}

/* ---- reconnecting ------------------------------------------------------------ */

/*
 * A dialed pipe with reconnect_ms dials again after its peer failed, closed
 * (a consumer restarting), or could not be reached (also before the first
 * HELLO: waiting for a peer that is not there yet) — unless this side is
 * closing, or the outage has lasted its time.
 */
static bool want_reconnect(const tdp_pipe *p, tdp_err err)
{
    /* connect_wait_ms: the first connect, refused (no listener yet), and nothing else */
    bool wait = p->opts.connect_wait_ms > 0 && !p->was_open && err == TDP_ECONNREFUSED;
    if ((p->opts.reconnect_ms <= 0 && !wait) || p->naddr == 0 || p->close_requested || p->freed)
        return false;
    if (p->reconnecting && tdp__now_ms() >= p->outage_end_ms)
        return false;
    switch (err) {
    case TDP_ECONNREFUSED:
    case TDP_ECONNRESET:
        return true;
    case TDP_ETIMEDOUT: /* a handshake that never finished */
        return p->state == PIPE_CONNECTING;
    case TDP_ECLOSED: /* the peer said BYE: it may be back */
        return p->was_open && p->state == PIPE_OPEN;
    default:
        return false;
    }
}

static void retry_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (!p->reconnecting || p->state != PIPE_CONNECTING || p->freed)
        return;
    int64_t now = tdp__now_ms();
    if (now >= p->outage_end_ms) {
        pipe_fail(p, p->lost, "reconnect time passed");
        return;
    }
    tdp_err rc = make_links(p);
    if (rc != TDP_OK) {
        pipe_fail(p, rc, "no data plane to reconnect with");
        return;
    }
    ctl_setup(p);
    rc = tdp__ctl_dial(&p->ctl, p->addrs, p->addrlens, p->naddr);
    if (rc != TDP_OK) {
        pipe_fail(p, rc, "cannot dial");
        return;
    }
    /* this attempt's handshake ends within the outage's time */
    int64_t left = p->outage_end_ms - now + 1;
    arm_timer(p, left < p->opts.connect_timeout_ms ? left : p->opts.connect_timeout_ms);
}

/*
 * The link is gone: put the pipe back to connecting, keep what the
 * application holds (queued sends, messages lent), and dial again after a
 * backoff. Sends the old link held end with TDP_ECONNRESET: they may or may
 * not have arrived. The next HELLO says where the stream goes on.
 */
static void begin_reconnect(tdp_pipe *p, tdp_err err, const char *why)
{
    int64_t now = tdp__now_ms();
    if (!p->reconnecting) {
        int64_t span = p->was_open                    ? p->opts.reconnect_ms
                       : p->opts.connect_wait_ms > 0 ? p->opts.connect_wait_ms
                                                     : p->opts.connect_timeout_ms;
        p->reconnecting = true;
        p->lost = err;
        p->outage_end_ms = now + span;
        p->backoff_ms = 50;
        if (p->was_open) {
            p->stats.reconnects++;
            tdp_log_info("pipe %s: %s (%s); reconnecting for up to %" PRId64 " ms",
                         p->ctl.peer_name, why, tdp_strerror(err), span);
        }
    } else {
        tdp_log_debug("pipe %s: reconnect attempt failed: %s (%s)", p->ctl.peer_name, why,
                      tdp_strerror(err));
        p->backoff_ms = p->backoff_ms * 2 > 1000 ? 1000 : p->backoff_ms * 2;
    }
    p->state = PIPE_CONNECTING;
    timer_del(p);
    close_links(p, true);
    tdp__ctl_close(&p->ctl);
    if (p->credit_ev != NULL)
        event_del(p->credit_ev);

    /* sending: what the old link held is lost to us; the rest waits */
    fail_ops_sent(p, TDP_ECONNRESET);
    tdp__prep_reset(p);
    if (p->prep_ev != NULL)
        event_del(p->prep_ev);
    tdp__free(p->tickets);
    p->tickets = NULL;
    p->free_tickets = NULL;
    p->done_head = p->done_tail = NULL; /* the old link's: nothing to give back */
    p->nticket = 0;
    p->tx_inflight = 0;
    tdp_schema_unref(p->sent_schema);
    p->sent_schema = NULL; /* the schema goes again */
    /* what the old link carried that its peer never gave back */
    p->stats.unconfirmed += p->send_seq - p->credit_base - p->peer_credit;
    p->credit_base = p->send_seq;
    p->peer_credit = 0;
    p->sum_on = false; /* the next peer's HELLO says again */

    /* receiving: a new peer starts its own stream; views lent stay valid */
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        rx_slot *s = &p->slots[i];
        if (s->state == SLOT_FILLING || s->state == SLOT_READY) {
            if (s->state == SLOT_READY)
                p->stats.msgs_recv--; /* never handed out */
            slot_free(s);
        }
    }
    p->ready_count = 0;
    p->ready_head = 0;
    p->rx_inflight = 0;
    p->rx_seq = 0;
    p->rx_hash = 0; /* a DATA before the new peer's SCHEMA is refused */
    p->released = p->credit_sent = 0;
    p->peer_bye = false;
    p->peer_last_seq = 0;
    p->stats.resumed_from = 0; /* the next link's peer says for itself */
    p->link_failed = false;
    p->epoch++;

    int64_t left_ms = p->outage_end_ms - now;
    int64_t wait = p->backoff_ms < left_ms ? p->backoff_ms : left_ms > 0 ? left_ms : 0;
    struct timeval tv = {(time_t)(wait / 1000), (suseconds_t)((wait % 1000) * 1000)};
    evtimer_add(p->retry_ev, &tv);
}

tdp_pipe *tdp__session_new(tdp_loop *loop, const tdp_pipe_opts *opts,
                           const tdp_schema_limits *lim, tdp_err *err)
{
    tdp_pipe *p = tdp__calloc(1, sizeof(*p));
    *err = TDP_ENOMEM;
    if (p == NULL)
        return NULL;
    p->loop = loop;
    p->opts = *opts;
    p->limits = *lim;
    if (opts->secret != NULL) {
        /* a copy: the caller's bytes may go once the pipe is made */
        if (opts->secret_len < TDP_SECRET_MIN || opts->secret_len > TDP_SECRET_MAX ||
            sodium_init() < 0) {
            *err = opts->secret_len < TDP_SECRET_MIN || opts->secret_len > TDP_SECRET_MAX
                       ? TDP_EINVAL
                       : TDP_EINTERNAL;
            tdp__free(p);
            return NULL;
        }
        memcpy(p->secret, opts->secret, opts->secret_len);
        p->secret_len = opts->secret_len;
    }
    p->opts.secret = p->secret_len > 0 ? p->secret : NULL;
    p->opts.secret_len = p->secret_len;
    p->depth = p->opts.recv_depth;
    p->lent1 = -1;
    p->status = TDP_OK;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        p->slots[i].pipe = p;
    p->rel_task = (tdp__task){.fn = release_task, .arg = p};
    tdp__waiter_init(&p->w);
    ctl_setup(p);
    p->timer = evtimer_new(tdp__loop_base(loop), linger_cb, p);
    p->credit_ev = evtimer_new(tdp__loop_base(loop), credit_ev_cb, p);
    if (p->opts.latency_stats)
        p->lat = tdp__alloc_array(TDP_LAT_RECV_WAIT + 1, sizeof(*p->lat));
    if (p->timer == NULL || p->credit_ev == NULL || (p->opts.latency_stats && p->lat == NULL) ||
        tdp_op_new(NULL, NULL, &p->sync_send) != TDP_OK ||
        tdp_op_new(NULL, NULL, &p->sync_recv) != TDP_OK)
        goto err_free;
    p->sync_send->waiter = p->sync_recv->waiter = &p->w;
    p->sync_send->owner = p->sync_recv->owner = p;
    p->sync_send->take_back = p->sync_recv->take_back = take_back;

    p->retry_ev = evtimer_new(tdp__loop_base(loop), retry_cb, p);
    if (p->retry_ev == NULL || (*err = make_links(p)) != TDP_OK)
        goto err_free;
    return p;

err_free:
    tdp__session_destroy(p);
    return NULL;
}

static void ready_deadline(tdp_pipe *p)
{
    arm_timer(p, p->opts.connect_timeout_ms);
}

tdp_err tdp__session_dial(tdp_pipe *p, const struct sockaddr_storage *addrs,
                          const socklen_t *lens, int n, tdp_pipe_cb ready, void *arg)
{
    if (n <= 0 || n > TDP_CTL_MAX_ADDRS)
        return TDP_EINVAL;
    /* kept: a reconnecting pipe dials them again */
    memcpy(p->addrs, addrs, (size_t)n * sizeof(*addrs));
    memcpy(p->addrlens, lens, (size_t)n * sizeof(*lens));
    p->naddr = n;
    tdp_err rc = tdp__ctl_dial(&p->ctl, addrs, lens, n);
    if (rc != TDP_OK)
        return rc;
    p->ready_cb = ready;
    p->ready_arg = arg;
    ready_deadline(p);
    return TDP_OK;
}

tdp_err tdp__session_accept(tdp_pipe *p, evutil_socket_t fd, const struct sockaddr *sa,
                            tdp_pipe_cb ready, void *arg)
{
    tdp_err rc = tdp__ctl_accept(&p->ctl, fd, sa);
    if (rc != TDP_OK)
        return rc;
    p->ready_cb = ready;
    p->ready_arg = arg;
    ready_deadline(p);
    if (p->hello_hook == NULL || p->secret_len > 0)
        send_hello(p); /* a failure here is reported through ready */
    return TDP_OK;
}

void tdp__session_answer_hello(tdp_pipe *p, tdp__hello_hook fn, void *arg)
{
    p->hello_hook = fn;
    p->hello_hook_arg = arg;
}

const char *tdp__session_peer(const tdp_pipe *p)
{
    return p->ctl.peer_name;
}

static void destroy_now(void *arg)
{
    tdp_pipe *p = arg;
    tdp__ctl_close(&p->ctl);
    close_link(p);
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        slot_free(&p->slots[i]); /* views still lent: the application is done with them */
    tdp_schema_unref(p->rx_schema);
    tdp_schema_unref(p->sent_schema);
    tdp_td_unref(p->gather_td);
    tdp__free(p->tickets);
    if (p->timer != NULL)
        event_free(p->timer);
    if (p->credit_ev != NULL)
        event_free(p->credit_ev);
    if (p->prep_ev != NULL)
        event_free(p->prep_ev);
    if (p->retry_ev != NULL)
        event_free(p->retry_ev);
    tdp__free(p->sync_send);
    tdp__free(p->sync_recv);
    tdp__free(p->lat);
    if (p->budget != NULL) {
        tdp__budget_give(p->budget, p->budget_held);
        tdp__budget_unref(p->budget);
    }
    tdp__waiter_fini(&p->w);
    tdp__free(p);
}

void tdp__session_set_budget(tdp_pipe *p, struct tdp__budget *b)
{
    tdp__budget_unref(p->budget);
    p->budget = b != NULL ? tdp__budget_ref(b) : NULL;
}

void tdp__session_destroy(tdp_pipe *p)
{
    /* inert from now on: no callback reaches it; memory goes on a later turn
     * (we may be inside one of its own callbacks) */
    p->freed = true;
    p->ready_cb = NULL;
    p->end_cb = NULL;
    tdp__ctl_close(&p->ctl);
    close_link(p);
    if (p->timer != NULL)
        evtimer_del(p->timer);
    if (p->credit_ev != NULL)
        event_del(p->credit_ev);
    if (p->retry_ev != NULL)
        event_del(p->retry_ev);
    tdp__reap_later(p->loop, &p->reap, destroy_now, p);
}

static void free_task(void *arg)
{
    tdp_pipe *p = arg;
    if (p->state != PIPE_DEAD)
        pipe_fail(p, TDP_ECANCELED, "freed");
    if (p->status == TDP_OK)
        p->status = TDP_ECANCELED;
    /* complete every op the user still has pending */
    p->end_cb = NULL;
    drain_ops(p);
    tdp_op *op;
    while ((op = tdp__opq_pop(&p->recvq)) != NULL)
        tdp__op_complete(op, TDP_ECANCELED);
    tdp__session_destroy(p);
}

void tdp_pipe_free(tdp_pipe *pipe)
{
    if (pipe != NULL)
        tdp__call_on_loop(pipe->loop, free_task, pipe);
}
