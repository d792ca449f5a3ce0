/*
 * session_hello.c: the pipe's control channel events and the negotiation —
 * this side's HELLO, the peer's, the plane both pick, the links made for
 * the candidates, and the BYE and close events that end a stream. The
 * tables of callbacks the control channel and the planes report through
 * live here.
 *
 * Loop thread only.
 */
#include <inttypes.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

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

static void on_ctl_closed(void *owner, tdp_err why)
{
    tdp_pipe *p = owner;
    if (p->state == PIPE_CONNECTING) {
        tdp__pipe_fail(p, why,
                       why == TDP_ECONNRESET ? "closed during the handshake"
                       : why == TDP_EAUTH    ? "authentication failed"
                                             : "cannot connect");
        return;
    }
    if (p->state == PIPE_DEAD) {
        tdp__pipe_maybe_tell_end(p);
        return;
    }
    if (p->peer_bye && why != TDP_EPROTO && why != TDP_EVERSION) {
        /*
         * The peer said goodbye, then hung up. What it sent before its BYE
         * comes by the data plane, another channel than this socket, and
         * may not all be read yet (a shm ring's descriptors, frames UCX
         * still holds): the end comes after them, and if they never come,
         * at the linger deadline its BYE armed (linger_cb).
         */
        tdp__pipe_end_if_peer_done(p);
        return;
    }
    if (why == TDP_EPROTO || why == TDP_EVERSION)
        tdp__pipe_fail(p, why, "garbage on the control socket");
    else
        tdp__pipe_fail(p, TDP_ECONNRESET, "peer vanished (control socket closed)");
}

static void on_ctl_bye(void *owner, const tdp_bye *bye)
{
    tdp_pipe *p = owner;
    if (p->state == PIPE_DEAD) {
        tdp__pipe_hang_up(p); /* ours went (or we failed): the peer's answers it */
        return;
    }
    if (bye->reason != TDP_OK) {
        tdp_err e = bye->reason == TDP_ELIMIT || bye->reason == TDP_EVERSION ||
                            bye->reason == TDP_ENOTSUP || bye->reason == TDP_EAUTH ||
                            bye->reason == TDP_ECHECKSUM
                        ? bye->reason
                        : TDP_ECONNRESET;
        tdp__pipe_fail(p, e, "peer ended the pipe with an error");
        tdp__pipe_hang_up(p); /* it said all it will */
        return;
    }
    if (p->state == PIPE_CONNECTING || p->peer_bye || bye->last_seq < p->rx_seq) {
        tdp__pipe_fail(p, TDP_EPROTO, "inconsistent BYE");
        tdp__pipe_hang_up(p);
        return;
    }
    if (tdp__pipe_want_reconnect(p, TDP_ECLOSED)) {
        /* a reconnecting pipe waits for the next peer instead (what this
         * one still had on its way here is dropped: its sender is closing) */
        p->hooks->reconnect(p, TDP_ECLOSED, "peer closed");
        return;
    }
    p->peer_bye = true;
    p->peer_last_seq = bye->last_seq;
    /* the peer reads no more: sends waiting for it can never go */
    tdp_op *op;
    while ((op = tdp__opq_pop(&p->sendq)) != NULL)
        tdp__op_complete(op, TDP_ECLOSED);
    /* what it announced has not all landed: a DATA frame still to come, or
     * one whose payload (a rendezvous, a chunked message's CHUNKs) is */
    if (!tdp__pipe_peer_done(p)) {
        p->linger_mark = tdp__pipe_rx_mark(p);
        tdp__pipe_arm_timer(p, p->opts.linger_ms);
    }
    tdp__pipe_deliver(p);
    tdp__pipe_end_if_peer_done(p);
}

static void on_ctl_bye_flushed(void *owner)
{
    tdp_pipe *p = owner;
    p->bye_flushed = true;
    tdp__pipe_check_close(p);
}

void tdp__pipe_send_hello(tdp_pipe *p)
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
        /*
         * A peer on this host gets what only a same-host pipe needs (the
         * ucx plane's worker of its own: 4 MB of shared memory, ~10 ms)
         * only once both HELLOs have shown the plane they pick needs it:
         * its address then travels in PROVEN (wire.h), after the HELLOs
         * (with a secret, after the proofs too). A pipe that ends up on the
         * shm plane, or a connection that never says HELLO, makes none.
         */
        .proven =
            tdp__ctl_local_now(&p->ctl) && (p->secret_len > 0 || p->opts.peer_mode == TDP_PEER_AUTO)
                ? TDP_PROVEN_V1
                : 0,
    };
    uint32_t n = 0;
    if (p->state == PIPE_DEAD)
        return;
    /* the planes still in the running: all, or the one the peer's HELLO
     * picked; listed before the planes fill their records, which may
     * depend on it (the tcp plane: whether it was asked for) */
    for (int i = 0; i < p->ncand; i++)
        if (p->links[i] != NULL)
            ids[n++] = p->cand[i]->id;
    h.planes = ids;
    h.nplanes = n;
    for (int i = 0; i < p->ncand; i++) {
        if (p->links[i] == NULL)
            continue;
        tdp_err rc = p->cand[i]->hello_fill(p->links[i], &h);
        if (rc != TDP_OK) {
            tdp__pipe_fail(p, rc, "cannot describe a data plane");
            return;
        }
    }
    /* a reconnected stream goes on where it was: the peer is told from where
     * (the link's start, not send_seq now: a dialer may open, and send, on
     * the peer's HELLO before its own connect event has sent this one) */
    h.resume = p->credit_base > 0 ? p->credit_base + 1 : 0;
    h.want_depth = p->opts.want_peer_depth;
    h.checksum = p->opts.checksum ? TDP_SUM_XXH3_64 : 0;
    h.ready = TDP_READY_V1; /* this side answers prepared SCHEMAs (session_prepare.c) */
    h.window = p->opts.recv_window_bytes;
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
        tdp__pipe_fail(p, rc, "cannot send HELLO");
}

static void on_ctl_connected(void *owner)
{
    tdp_pipe *p = owner;
    if (!p->ctl.nonce_sent) /* not already sent on the peer's HELLO (on_ctl_hello) */
        tdp__pipe_send_hello(p);
}

/*
 * The peer's HELLO is in: a listener with a hook chooses, then answers.
 * With a secret the hook runs only once the peer has proven it holds it
 * (ctl.c), so our HELLO cannot wait for it (the proofs cover it).
 */
static void on_ctl_hello_in(void *owner, const tdp_hello *h)
{
    tdp_pipe *p = owner;
    if (p->state != PIPE_CONNECTING)
        return;
    if (p->hello_hook == NULL) {
        /* a dialer that reads the listener's HELLO before its own connect
         * event: ours goes now, so that whether PROVEN follows is known
         * (both HELLOs offer it) before the peer's is acted on */
        if (p->secret_len == 0 && !p->ctl.nonce_sent)
            tdp__pipe_send_hello(p);
        return;
    }
    tdp_err (*fn)(void *, const tdp_hello *, tdp_pipe_opts *) = p->hello_hook;
    p->hello_hook = NULL; /* once */
    tdp_pipe_opts o = p->opts;
    tdp_err rc = fn(p->hello_hook_arg, h, &o);
    if (rc != TDP_OK) {
        tdp__pipe_fail(p, rc, "refused by the listener");
        return;
    }
    if (p->secret_len > 0)
        return; /* called after the proof: our HELLO, and its depth, went out before it */
    p->depth = o.recv_depth < 1 ? 1 : o.recv_depth > TDP_MAX_DEPTH ? TDP_MAX_DEPTH : o.recv_depth;
    p->opts.recv_depth = p->depth;
    tdp__pipe_send_hello(p);
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
    tdp__pipe_timer_del(p);
    tdp_log_debug("pipe %s open: plane=%s same_host=%d depth=%u/%u", p->ctl.peer_name,
                  p->plane->name, p->same_host, p->depth, p->peer_depth);
    tdp_pipe_cb cb = p->ready_cb;
    p->ready_cb = NULL;
    if (cb != NULL)
        cb(p, TDP_OK, p->ready_arg);
    if (p->state != PIPE_OPEN)
        return;
    tdp__pipe_send_credit(p); /* releases that happened before the link existed */
    tdp__pipe_send_kick(p);
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
    /*
     * A dialer may read the listener's HELLO before its own connect event
     * has sent its HELLO: it goes now, listing every plane still in the
     * running, before the choice, which reads what the planes put in it
     * (the tcp plane's record), so that both sides choose from the same
     * two HELLOs.
     */
    if (!p->ctl.nonce_sent) {
        tdp__pipe_send_hello(p);
        if (p->state != PIPE_CONNECTING)
            return;
    }
    const tdp__plane_ops *po;
    for (size_t i = 0; (po = tdp__plane_at(i)) != NULL; i++) {
        /* each plane reads its own records (wire.c only framed them) */
        if (po->hello_check != NULL && po->hello_check(h) != TDP_OK) {
            tdp_log_warn("pipe %s: the peer's HELLO has a malformed %s record: disconnecting",
                         p->ctl.peer_name, po->name);
            tdp__pipe_fail(p, TDP_EPROTO, "malformed plane record in HELLO");
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
        tdp__pipe_fail(p, TDP_EPROTO, "the listener's HELLO claims to resume a stream");
        return;
    }
    if (p->stats.resumed_from != 0 && h->resume != p->stats.resumed_from) {
        tdp__pipe_fail(p, TDP_EPROTO,
                       "the peer's first message does not start where its HELLO says");
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
        tdp__pipe_fail(p, TDP_ENOTSUP, "no data plane both sides allow");
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
        tdp__pipe_fail(p, TDP_ENOMEM, "no memory for send tickets");
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
        .ctl = &p->ctl,
    };
    tdp_err rc = p->plane->link_start(p->link, &lp);
    if (rc != TDP_OK) {
        tdp__pipe_fail(p, rc, "cannot start the data plane");
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
        tdp__pipe_fail(p, TDP_EPROTO, "READY for a prepare never sent");
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

static const tdp__plane_up plane_up = {
    .schema = tdp__pipe_up_schema,
    .data = tdp__pipe_up_data,
    .credit = tdp__pipe_up_credit,
    .landed = tdp__pipe_up_landed,
    .sent = tdp__pipe_up_sent,
    .failed = tdp__pipe_up_failed,
};

/* A fresh control channel (at creation, and for each reconnect). */
void tdp__pipe_ctl_setup(tdp_pipe *p)
{
    tdp__ctl_opts co = {p->opts.keepalive_idle_s, p->opts.keepalive_intvl_s, p->opts.keepalive_cnt,
                        p->opts.secret, p->opts.secret_len};
    tdp__ctl_init(&p->ctl, p->loop, &co, &ctl_up, p);
}

/* A link per candidate plane, in the registry's order of preference. */
tdp_err tdp__pipe_make_links(tdp_pipe *p)
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
