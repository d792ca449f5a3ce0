/*
 * session_end.c: how a pipe ends — failure (tdp__pipe_fail: reconnect or
 * die), the peer's BYE and the control socket's close, the linger and close
 * deadlines, the application's close and abort, and completing what is
 * left once it has ended; teardown (tdp__session_destroy, tdp_pipe_free).
 * Loop thread, except the public entry points, which hop to it.
 */
#include <inttypes.h>
#include <string.h>
#include <time.h>

#include "session.h"
#include "session_int.h"
#include "budget.h"
#include "op.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../core/reap.h"

/* ---- ops ------------------------------------------------------------------- */

void tdp__pipe_fail_sent(tdp_pipe *p, tdp_err rc)
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
    tdp__pipe_fail_sent(p, rc);
    tdp__pipe_deliver(p);
}

/* ---- ending -------------------------------------------------------------- */

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
static void maybe_tell_end(tdp_pipe *p)
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
        tdp__pipe_begin_reconnect(p, err, why);
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
    drain_ops(p);
    maybe_tell_end(p);
}

void tdp__pipe_linger_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (p->state == PIPE_CONNECTING) {
        tdp__pipe_fail(p, TDP_ETIMEDOUT, "connect/handshake deadline passed");
    } else if (p->state == PIPE_OPEN && p->peer_bye && p->rx_seq < p->peer_last_seq) {
        tdp__pipe_fail(p, TDP_ECONNRESET, "messages announced in BYE never arrived");
    } else if (p->state == PIPE_OPEN && p->link_failed) {
        tdp__pipe_fail(p, TDP_ECONNRESET, "data plane failed and the peer said nothing");
    } else if (p->state == PIPE_OPEN && p->close_requested) {
        tdp__pipe_fail(p, TDP_ETIMEDOUT, "close deadline passed");
    }
}

void tdp__pipe_arm_timer(tdp_pipe *p, int64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    if (p->timer != NULL)
        evtimer_add(p->timer, &tv);
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

/* ---- control channel events ------------------------------------------------ */

void tdp__pipe_ctl_closed(void *owner, tdp_err why)
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
        maybe_tell_end(p);
        return;
    }
    if (p->peer_bye && p->rx_seq >= p->peer_last_seq) {
        /* the peer said goodbye and every frame it sent has arrived; the
         * last payloads may still be landing: the end comes after them */
        tdp__pipe_end_if_peer_done(p);
        return;
    }
    if (why == TDP_EPROTO || why == TDP_EVERSION)
        tdp__pipe_fail(p, why, "garbage on the control socket");
    else
        tdp__pipe_fail(p, TDP_ECONNRESET,
                       p->peer_bye ? "peer left before its last message arrived"
                                   : "peer vanished (control socket closed)");
}

void tdp__pipe_ctl_bye(void *owner, const tdp_bye *bye)
{
    tdp_pipe *p = owner;
    if (p->state == PIPE_DEAD)
        return;
    if (bye->reason != TDP_OK) {
        tdp_err e = bye->reason == TDP_ELIMIT || bye->reason == TDP_EVERSION ||
                            bye->reason == TDP_ENOTSUP || bye->reason == TDP_EAUTH ||
                            bye->reason == TDP_ECHECKSUM
                        ? bye->reason
                        : TDP_ECONNRESET;
        tdp__pipe_fail(p, e, "peer ended the pipe with an error");
        return;
    }
    if (p->state == PIPE_CONNECTING || p->peer_bye || bye->last_seq < p->rx_seq) {
        tdp__pipe_fail(p, TDP_EPROTO, "inconsistent BYE");
        return;
    }
    if (tdp__pipe_want_reconnect(p, TDP_ECLOSED)) {
        /* a reconnecting pipe waits for the next peer instead (what this
         * one still had on its way here is dropped: its sender is closing) */
        tdp__pipe_begin_reconnect(p, TDP_ECLOSED, "peer closed");
        return;
    }
    p->peer_bye = true;
    p->peer_last_seq = bye->last_seq;
    /* the peer reads no more: sends waiting for it can never go */
    tdp_op *op;
    while ((op = tdp__opq_pop(&p->sendq)) != NULL)
        tdp__op_complete(op, TDP_ECLOSED);
    if (p->rx_seq < p->peer_last_seq)
        tdp__pipe_arm_timer(p, p->opts.linger_ms);
    tdp__pipe_deliver(p);
    tdp__pipe_end_if_peer_done(p);
}

void tdp__pipe_ctl_bye_flushed(void *owner)
{
    tdp_pipe *p = owner;
    p->bye_flushed = true;
    tdp__pipe_check_close(p);
}

/* ---- closing ------------------------------------------------------------------ */

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
        tdp__pipe_fail(p, TDP_ECLOSED, "closed");
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
    if (p->state == PIPE_CONNECTING || !tdp__ctl_open(&p->ctl)) {
        tdp__pipe_fail(p, TDP_ECLOSED, "closed");
        return;
    }
    if (timeout_ms >= 0)
        tdp__pipe_arm_timer(p, timeout_ms);
    tdp__pipe_check_close(p);
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
    if (pipe == NULL || !tdp__pipe_blocking_ok(pipe))
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
    tdp__pipe_fail(r->p, (tdp_err)r->arg, "aborted");
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

/* ---- teardown -------------------------------------------------------------- */

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
        tdp__pipe_fail(p, TDP_ECANCELED, "freed");
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
