/*
 * session_base.c: the floor of the pipe's state machine — how a pipe ends
 * (a failure, a clean close, the linger and close deadlines, whether a
 * failure dials again), its teardown, and what every other part shares:
 * the plane a frame came by, a plane's failure report, receive slots
 * going free, latency samples. It calls nothing of the parts above it by
 * name: reconnecting and delivering receives go through the hooks session.c
 * sets (tdp__pipe_hooks).
 *
 * Loop thread only.
 */
#include <inttypes.h>
#include <string.h>
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

void tdp__pipe_fail_ops_sent(tdp_pipe *p, tdp_err rc)
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
void tdp__pipe_drain_ops(tdp_pipe *p)
{
    tdp_op *op;
    tdp_err rc = p->status == TDP_OK || p->status == TDP_ECLOSED ? TDP_ECANCELED : p->status;
    /* a send the peer's clean end left unsent: "the receiver closed the stream" */
    tdp_err send_rc = p->status == TDP_ECLOSED && p->peer_bye ? TDP_ECLOSED : rc;
    while ((op = tdp__opq_pop(&p->sendq)) != NULL)
        tdp__op_complete(op, send_rc);
    tdp__pipe_fail_ops_sent(p, rc);
    p->hooks->deliver(p); /* session_rx.c */
}

void tdp__pipe_close_links(tdp_pipe *p, bool gone)
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
    tdp__pipe_close_links(p, p->status == TDP_ECONNRESET || p->status == TDP_ETIMEDOUT);
}

void tdp__pipe_timer_del(tdp_pipe *p)
{
    if (p->timer != NULL)
        evtimer_del(p->timer);
}

/* Tell the application once the pipe has ended and its socket is closed. */
void tdp__pipe_maybe_tell_end(tdp_pipe *p)
{
    if (p->told_end || p->state != PIPE_DEAD || tdp__ctl_open(&p->ctl) || p->end_cb == NULL ||
        p->freed)
        return;
    p->told_end = true;
    tdp_err st =
        p->status == TDP_ECLOSED && p->close_requested && !p->peer_bye ? TDP_OK : p->status;
    p->end_cb(p, st, p->end_arg);
}

void tdp__pipe_fail(tdp_pipe *p, tdp_err err, const char *why)
{
    if (p->state == PIPE_DEAD)
        return;
    if (tdp__pipe_want_reconnect(p, err)) {
        p->hooks->reconnect(p, err, why);
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
    tdp__pipe_timer_del(p);
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
    tdp__pipe_drain_ops(p);
    if (p->peer_bye)
        tdp__ctl_close(&p->ctl); /* both sides have said all: hang up (see tdp__pipe_hang_up) */
    tdp__pipe_maybe_tell_end(p);
}

/*
 * Both sides have said BYE (or this one ended and then heard the peer's):
 * nothing more can come either way, so this side hangs up instead of
 * waiting for the peer to. Each side waiting for the other's hang-up was
 * how two pipes that both closed stayed open forever. The peer's BYE has
 * been read and it sends nothing after it, so no unread byte turns the
 * close into a reset; a BYE of ours still queued goes out first.
 */
void tdp__pipe_hang_up(tdp_pipe *p)
{
    if (p->state != PIPE_DEAD)
        return; /* a pipe that reconnects has a new socket by now */
    tdp__ctl_close(&p->ctl);
    tdp__pipe_maybe_tell_end(p);
}

void tdp__pipe_arm_timer(tdp_pipe *p, int64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    if (p->timer != NULL)
        evtimer_add(p->timer, &tv);
}

/* Our BYE is out: the pipe has ended; the peer's hang-up is waited for until the close deadline. */
static void closed_cleanly(tdp_pipe *p)
{
    tdp__pipe_fail(p, TDP_ECLOSED, "closed"); /* hangs up if the peer said BYE */
    if (tdp__ctl_open(&p->ctl) && p->close_deadline >= 0) {
        int64_t left = p->close_deadline - tdp__now_ms();
        tdp__pipe_arm_timer(p, left > 0 ? left : 0);
    }
}

void tdp__pipe_linger_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (p->state == PIPE_DEAD && p->close_requested && tdp__ctl_open(&p->ctl)) {
        /* our BYE went, the peer neither answered nor hung up in time */
        tdp_log_info("pipe %s: the peer did not end its side within the close deadline",
                     p->ctl.peer_name);
        p->status = TDP_ETIMEDOUT;
        tdp__pipe_hang_up(p);
        return;
    }
    if (p->state == PIPE_CONNECTING) {
        tdp__pipe_fail(p, TDP_ETIMEDOUT, "connect/handshake deadline passed");
    } else if (p->state == PIPE_OPEN && p->peer_bye && !tdp__pipe_peer_done(p)) {
        /* a frame or a payload still missing (a chunked message's CHUNKs):
         * what is on its way over a slow link keeps coming, so the wait
         * goes on while anything lands; a peer that sends nothing more ends
         * it */
        uint64_t mark = tdp__pipe_rx_mark(p);
        if (mark != p->linger_mark) {
            p->linger_mark = mark;
            tdp__pipe_arm_timer(p, p->opts.linger_ms);
            return;
        }
        tdp__pipe_fail(p, TDP_ECONNRESET, "messages announced in BYE never arrived");
    } else if (p->state == PIPE_OPEN && p->link_failed) {
        tdp__pipe_fail(p, TDP_ECONNRESET, "data plane failed and the peer said nothing");
    } else if (p->state == PIPE_OPEN && p->close_requested) {
        tdp__pipe_fail(p, TDP_ETIMEDOUT, "close deadline passed");
        tdp__pipe_hang_up(p); /* the close gave up: nothing is waited for any more */
    }
}

/* What has landed so far: DATA frames taken, and parts of payloads in flight. */
uint64_t tdp__pipe_rx_mark(const tdp_pipe *p)
{
    uint64_t m = p->rx_seq;
    if (p->link != NULL && p->plane != NULL && p->plane->rx_progress != NULL)
        m += p->plane->rx_progress(p->link);
    return m;
}

/* Has everything the peer announced been delivered or lent? */
bool tdp__pipe_peer_done(const tdp_pipe *p)
{
    return p->peer_bye && p->rx_seq >= p->peer_last_seq && p->rx_inflight == 0;
}

void tdp__pipe_end_if_peer_done(tdp_pipe *p)
{
    if (p->state == PIPE_OPEN && tdp__pipe_peer_done(p) && p->ready_count == 0 &&
        (!tdp__ctl_open(&p->ctl) || p->link_failed))
        tdp__pipe_fail(p, TDP_ECLOSED, "peer closed");
}

static int link_index(const tdp_pipe *p, const tdp__link *l)
{
    for (int i = 0; i < p->ncand; i++)
        if (p->links[i] == l)
            return i;
    return -1;
}

void tdp__pipe_proto_fail(tdp_pipe *p, tdp_err err, const char *why)
{
    tdp_log_warn("pipe %s: %s: disconnecting", p->ctl.peer_name, why);
    tdp__pipe_fail(p, err, why);
}

/*
 * The plane a frame came by: the chosen one, or — a fast peer that has our
 * HELLO may send before we have read its own — a candidate, which must
 * then be the one the HELLO picks.
 */
const tdp__plane_ops *tdp__pipe_frame_plane(tdp_pipe *p, tdp__link *l)
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
            tdp__pipe_proto_fail(p, TDP_EAUTH,
                                 "data-plane frame before the peer proved it holds the secret");
            return NULL;
        }
    }
    if (p->link != NULL)
        return l == p->link ? p->plane : NULL;
    int i = link_index(p, l);
    return i >= 0 ? p->cand[i] : NULL;
}

void tdp__pipe_up_failed(void *owner, tdp__link *l, tdp_err st, const char *why)
{
    tdp_pipe *p = owner;
    if (tdp__pipe_frame_plane(p, l) == NULL || p->link_failed)
        return;
    if (st != TDP_ECONNRESET) { /* the peer sent something invalid */
        tdp__pipe_proto_fail(p, st, why);
        return;
    }
    /* a transfer in flight was lost, or nothing is left to say how it ended
     * (sends still waiting for credit were never handed over: they wait too) */
    if (p->state == PIPE_CONNECTING || !tdp__ctl_open(&p->ctl) || p->rx_inflight > 0 ||
        p->tx_inflight > 0) {
        /* a clean end only if everything the peer announced has come */
        tdp__pipe_fail(p, p->peer_bye && p->rx_seq >= p->peer_last_seq ? TDP_ECLOSED : st, why);
        return;
    }
    /*
     * The data plane saw the peer go. A peer that closed cleanly tears its
     * side down right after its BYE, which may not have been read yet: the
     * control socket decides (BYE, then EOF: a clean end; EOF alone or
     * silence until the linger deadline: a failure).
     */
    p->link_failed = true;
    tdp_log_debug("pipe %s: data plane ended (%s); the control socket decides", p->ctl.peer_name,
                  why);
    /* sends made from now on wait for that verdict (bounded by the linger) */
    tdp__pipe_arm_timer(p, p->opts.linger_ms);
    tdp__pipe_end_if_peer_done(p);
}

/*
 * A slot holds a reference on its view from the plane's recv until it is
 * free again: a lent view stays valid until released (or the pipe freed),
 * even when the pipe failed and its plane let go of it meanwhile.
 */
void tdp__pipe_slot_free(rx_slot *s)
{
    tdp_td *td = s->td;
    s->state = SLOT_FREE;
    s->td = NULL;
    tdp_td_unref(td);
}

/* CLOCK_MONOTONIC, ns: what latency_stats records (only read when it is on). */
uint64_t tdp__pipe_lat_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void tdp__pipe_lat_record(tdp_pipe *p, tdp_latency which, uint64_t since_ns)
{
    uint64_t now = tdp__pipe_lat_now_ns();
    tdp_hist_record(&p->lat[which], now > since_ns ? now - since_ns : 0);
}

void tdp__pipe_check_close(tdp_pipe *p)
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

/*
 * A dialed pipe with reconnect_ms dials again after its peer failed, closed
 * (a consumer restarting), or could not be reached (also before the first
 * HELLO: waiting for a peer that is not there yet) — unless this side is
 * closing, or the outage has lasted its time.
 */
bool tdp__pipe_want_reconnect(const tdp_pipe *p, tdp_err err)
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

static void destroy_now(void *arg)
{
    tdp_pipe *p = arg;
    tdp__ctl_close(&p->ctl);
    close_link(p);
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        tdp__pipe_slot_free(&p->slots[i]); /* views still lent: the application is done with them */
    tdp_schema_unref(p->rx_schema);
    tdp_schema_unref(p->sent_schema);
    tdp_td_unref(p->gather_td);
    tdp__free(p->tickets);
    if (p->timer != NULL)
        event_free(p->timer);
    tdp__loop_idle_cancel(p->loop, &p->credit_idle);
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
    tdp__loop_idle_cancel(p->loop, &p->credit_idle);
    if (p->retry_ev != NULL)
        event_del(p->retry_ev);
    tdp__reap_later(p->loop, &p->reap, destroy_now, p);
}
