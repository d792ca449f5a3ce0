/*
 * session_rx.c: the pipe's receive side — the peer's SCHEMA and DATA
 * frames, landing payloads in the receive slots, handing them to receives
 * in order, releases from any thread, and the credit they give back.
 *
 * Loop thread, except tdp_pipe_release (any thread).
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
        tdp__pipe_fail(p, TDP_ENOTSUP,
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
        tdp__pipe_fail(p, TDP_ELIMIT, "schema over the server's memory cap");
        return TDP_ELIMIT;
    }
    p->budget_held = need;
    return TDP_OK;
}

void tdp__pipe_up_schema(void *owner, tdp__link *l, const tdp__frame *f, const void *json,
                         size_t length)
{
    tdp_pipe *p = owner;
    const tdp__plane_ops *ops = tdp__pipe_frame_plane(p, l);
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
        tdp__pipe_proto_fail(p, TDP_EPROTO, "schema frame out of sequence or with a wrong length");
        return;
    }
    if (f->length > p->limits.max_json_bytes || f->arg > p->limits.max_total_bytes) {
        tdp__pipe_proto_fail(p, TDP_EMSGSIZE, "schema over this side's limits");
        return;
    }
    tdp_err rc = tdp_schema_decode(json, length, &p->limits, &sc, why, sizeof(why));
    if (rc != TDP_OK) {
        tdp_log_warn("pipe %s: rejected schema: %s", p->ctl.peer_name, why);
        tdp__pipe_fail(p, rc == TDP_ENOMEM ? TDP_ENOMEM : TDP_ESCHEMA, why);
        return;
    }
    if (tdp_schema_hash(sc) != f->hash || tdp_schema_total_bytes(sc) != f->arg) {
        tdp_schema_unref(sc);
        tdp__pipe_proto_fail(p, TDP_ESCHEMA, "schema hash or size does not match its frame");
        return;
    }
    if (p->opts.recv_device_set && !tdp_device_equal(p->opts.recv_device, tdp_schema_device(sc))) {
        tdp_schema *local;
        rc = tdp_schema_with_device(sc, p->opts.recv_device, &local);
        tdp_schema_unref(sc);
        if (rc != TDP_OK) {
            tdp__pipe_fail(p, rc, "cannot place the schema on the receive device");
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
        tdp__pipe_fail(p, rc, "cannot prepare receive storage");
        return;
    }
    tdp__prep_schema_in(p, f);
}

/*
 * The payload in s against the checksum its frame carried: a mismatch
 * marks it bad, and the receive it would go to drops it (tdp__pipe_deliver).
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
        s->ready_ns = tdp__pipe_lat_now_ns();
    p->ready[(p->ready_head + p->ready_count) % TDP_MAX_DEPTH] = (uint32_t)(s - p->slots);
    p->ready_count++;
    if (!s->bad) {
        p->stats.msgs_recv++;
        p->stats.bytes_recv += s->td->nbytes;
    }
    if (tdp__pipe_peer_done(p))
        tdp__pipe_timer_del(p);
    tdp__pipe_deliver(p);
}

void tdp__pipe_up_data(void *owner, tdp__link *l, const tdp__frame *f, void *desc)
{
    tdp_pipe *p = owner;
    const tdp__plane_ops *ops = tdp__pipe_frame_plane(p, l);
    if (ops == NULL)
        return;
    if (p->rx_schema == NULL || f->hash != p->rx_hash) {
        tdp__pipe_proto_fail(p, TDP_EMISMATCH, "data frame for a schema this side does not hold");
        return;
    }
    if (f->seq != p->rx_seq + 1) {
        tdp__pipe_proto_fail(p, TDP_EPROTO, "data frame out of sequence");
        return;
    }
    if (p->peer_bye && f->seq > p->peer_last_seq) {
        /* its BYE named its last: a payload after it that never comes
         * would hold the pipe open with nothing left to end it */
        tdp__pipe_proto_fail(p, TDP_EPROTO, "data frame after the peer's BYE");
        return;
    }
    if (f->length != tdp_schema_total_bytes(p->rx_schema)) {
        tdp__pipe_proto_fail(p, TDP_EMSGSIZE, "data length differs from the schema's size");
        return;
    }
    /* a sum only when both offered (a fast peer's DATA may come before its
     * HELLO is read: it had ours, so it sums only if we offered) */
    if (f->has_sum ? !p->opts.checksum : p->sum_on) {
        tdp__pipe_proto_fail(p, TDP_EPROTO,
                             "data frame with a checksum not agreed, or without one agreed");
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
        tdp__pipe_proto_fail(p, TDP_EPROTO, "data frame beyond the credit granted");
        return;
    }
    p->rx_seq = f->seq;
    p->rx_link++;
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
        tdp__pipe_fail(p, rc == TDP_EPROTO || rc == TDP_EMSGSIZE ? rc : TDP_ECONNRESET,
                       "cannot receive data");
    }
}

void tdp__pipe_up_landed(void *owner, tdp__link *l, uint32_t slot, tdp_err st)
{
    tdp_pipe *p = owner;
    if (slot >= TDP_MAX_DEPTH || p->slots[slot].state != SLOT_FILLING)
        return;
    rx_slot *s = &p->slots[slot];
    p->rx_inflight--;
    if (tdp__pipe_frame_plane(p, l) == NULL) {
        tdp__pipe_slot_free(s);
        tdp__pipe_deliver(p);
        return;
    }
    if (st != TDP_OK) {
        /* never hand out a partly filled buffer */
        tdp__pipe_slot_free(s);
        if (st == TDP_ECUDA) /* this side's copy to the device, not the peer */
            tdp__pipe_fail(p, TDP_ECUDA, "copying a message to the device failed");
        else
            tdp__pipe_fail(p, TDP_ECONNRESET, "data transfer failed");
        return;
    }
    rx_sum_check(p, s);
    slot_ready(p, s);
    tdp__pipe_end_if_peer_done(p);
}

void tdp__pipe_send_credit(tdp_pipe *p)
{
    if (p->state != PIPE_OPEN || p->plane->credit == NULL || p->released == p->credit_sent ||
        p->link_failed)
        return;
    p->credit_sent = p->released;
    if (p->plane->credit(p->link, p->released) != TDP_OK)
        tdp__pipe_up_failed(p, p->link, TDP_ECONNRESET, "cannot send credit");
}

/*
 * The loop is about to sleep with credit still owed. With a window in
 * force it goes only once the peer may be stopped for want of it: when it
 * counts depth messages in flight, the least any layout's window allows.
 * Until then the peer sends on, its next DATA wakes this side, and a reply
 * carries the credit for free; this looks again at every sleep meanwhile.
 */
bool tdp__pipe_credit_idle(void *arg)
{
    tdp_pipe *p = arg;
    if (p->state != PIPE_OPEN || p->released == p->credit_sent)
        return false;
    if (!p->window_sent || p->rx_link - p->credit_sent >= p->depth) {
        tdp__pipe_send_credit(p);
        return true;
    }
    tdp__loop_idle_add(p->loop, &p->credit_idle);
    return false;
}

/*
 * A released buffer is a credit for the peer. defer_credit: the caller is
 * about to run the loop (a receive is starting), so let the credit wait
 * until the loop is about to sleep — a DATA frame sent meanwhile carries
 * it for free.
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
    tdp__pipe_slot_free(s);
    if (p->state != PIPE_OPEN || !ours)
        return;
    p->released++;
    if (p->plane->credit == NULL)
        return; /* the plane's own release is the credit (shm): nothing to send */
    /*
     * With a window in force, fewer than half the window's credits (and at
     * least depth) wait too, until the loop is about to sleep: a receiver
     * draining a burst returns it in a few frames, not one per message, and
     * one that keeps up without ever sleeping returns it in halves. Half the
     * window at least stays the sender's to fill meanwhile.
     */
    uint32_t win = p->window_sent && p->rx_schema != NULL ? rx_window(p, p->rx_schema) : 0;
    uint32_t hold = win / 2 > p->depth ? win / 2 : p->depth;
    bool batch = win > p->depth && p->released - p->credit_sent < hold;
    if (defer_credit || batch) {
        tdp__loop_idle_add(p->loop, &p->credit_idle);
        return;
    }
    tdp__pipe_send_credit(p);
}

/* A message whose checksum did not match: its receive fails, its buffer goes back. */
static void rx_drop(tdp_pipe *p, rx_slot *s, tdp_op *op)
{
    s->bad = false;
    slot_release(p, s, false);
    tdp__op_complete(op, TDP_ECHECKSUM);
}

void tdp__pipe_deliver(tdp_pipe *p)
{
    while (p->recvq.head != NULL) {
        tdp_err end = TDP_OK;
        if (p->ready_count == 0) {
            if (tdp__pipe_peer_done(p))
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
            tdp__pipe_lat_record(p, TDP_LAT_RECV_WAIT, s->ready_ns);
        op->td = s->td;
        op->seq = s->seq;
        tdp__op_complete(op, TDP_OK);
    }
    tdp__pipe_end_if_peer_done(p);
}

void tdp__pipe_recv_start(void *arg)
{
    tdp_op *op = arg;
    tdp_pipe *p = op->owner;
    if (p->depth == 1 && p->lent1 >= 0)
        slot_release(p, &p->slots[p->lent1], true); /* depth 1: the next receive overwrites */
    tdp__opq_push(&p->recvq, op);
    tdp__pipe_deliver(p);
}

/* Releases made on other threads, handed to the loop thread (under w.mtx). */
void tdp__pipe_release_task(void *arg)
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
