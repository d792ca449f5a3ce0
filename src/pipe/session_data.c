/*
 * session_data.c: the data path — frames from the plane (SCHEMA, DATA,
 * landed, sent, credit, failure), the send queue and its credit and
 * tickets, the receive ring, lending and releases, and the application's
 * send, receive, release and loan calls (which hop to the loop thread).
 */
#include <inttypes.h>
#include <string.h>
#include <time.h>

#include "session.h"
#include "session_int.h"
#include "budget.h"
#include "checksum.h"
#include "op.h"
#include "plane.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../schema/schema_int.h"

static int link_index(const tdp_pipe *p, const tdp__link *l)
{
    for (int i = 0; i < p->ncand; i++)
        if (p->links[i] == l)
            return i;
    return -1;
}

/* ---- plane events ----------------------------------------------------------- */

static void proto_fail(tdp_pipe *p, tdp_err err, const char *why)
{
    tdp_log_warn("pipe %s: %s: disconnecting", p->ctl.peer_name, why);
    tdp__pipe_fail(p, err, why);
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
        tdp__pipe_fail(p, p->peer_bye ? TDP_ECLOSED : st, why);
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

static bool take_credit(tdp_pipe *p, uint64_t total)
{
    if (total < p->peer_credit || total > p->send_seq - p->credit_base) {
        proto_fail(p, TDP_EPROTO, "credit beyond what was sent");
        return false;
    }
    if (total > p->peer_credit) {
        p->peer_credit = total;
        tdp__pipe_send_kick(p);
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
        tdp__pipe_fail(p, rc == TDP_ENOMEM ? TDP_ENOMEM : TDP_ESCHEMA, why);
        return;
    }
    if (tdp_schema_hash(sc) != f->hash || tdp_schema_total_bytes(sc) != f->arg) {
        tdp_schema_unref(sc);
        proto_fail(p, TDP_ESCHEMA, "schema hash or size does not match its frame");
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
        s->ready_ns = lat_now_ns();
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
        tdp__pipe_fail(p, rc == TDP_EPROTO || rc == TDP_EMSGSIZE ? rc : TDP_ECONNRESET,
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
    if (p->kicking) { /* inside the session's own call: tdp__pipe_send_kick takes it when done */
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
    tdp__pipe_send_kick(p); /* a ticket came back: a send may have waited for one */
    tdp__pipe_check_close(p);
}

const tdp__plane_up tdp__pipe_plane_up = {
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
        tdp__pipe_fail(
            p, rc == TDP_EMSGSIZE || rc == TDP_EINVAL || rc == TDP_ENOTSUP ? rc : TDP_ECONNRESET,
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
    tdp__pipe_send_kick(arg);
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
                tdp__pipe_fail(p, fail, "prepare failed");
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
                return; /* queued completions: tdp__pipe_send_kick takes them, looks again */
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
void tdp__pipe_send_kick(tdp_pipe *p)
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
        tdp__pipe_check_close(p);
}

static void send_start(void *arg)
{
    tdp_op *op = arg;
    tdp_pipe *p = op->owner;
    if (p->state == PIPE_DEAD || p->close_requested || p->peer_bye) {
        tdp__op_complete(op, p->peer_bye                                  ? TDP_ECLOSED
                             : p->status != TDP_OK && !p->close_requested ? p->status
                                                                          : TDP_ECANCELED);
        return;
    }
    op->waited = false;
    tdp__opq_push(&p->sendq, op);
    tdp__pipe_send_kick(p);
}

/* ---- credits and releases -------------------------------------------------- */

void tdp__pipe_send_credit(tdp_pipe *p)
{
    if (p->state != PIPE_OPEN || p->plane->credit == NULL || p->released == p->credit_sent ||
        p->link_failed)
        return;
    p->credit_sent = p->released;
    if (p->plane->credit(p->link, p->released) != TDP_OK)
        up_failed(p, p->link, TDP_ECONNRESET, "cannot send credit");
}

void tdp__pipe_credit_ev_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp__pipe_send_credit(arg);
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
    tdp__pipe_slot_free(s);
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
    tdp__pipe_send_credit(p);
}

/* ---- receiving -------------------------------------------------------------- */

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
            lat_record(p, TDP_LAT_RECV_WAIT, s->ready_ns);
        op->td = s->td;
        op->seq = s->seq;
        tdp__op_complete(op, TDP_OK);
    }
    tdp__pipe_end_if_peer_done(p);
}

static void recv_start(void *arg)
{
    tdp_op *op = arg;
    tdp_pipe *p = op->owner;
    if (p->depth == 1 && p->lent1 >= 0)
        slot_release(p, &p->slots[p->lent1], true); /* depth 1: the next receive overwrites */
    tdp__opq_push(&p->recvq, op);
    tdp__pipe_deliver(p);
}

/* ---- entry points ------------------------------------------------------------- */

/* A timed-out op: take it back from wherever it is (loop thread). */
void tdp__pipe_take_back(tdp_op *op)
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
    op->take_back = tdp__pipe_take_back;
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
    op->take_back = tdp__pipe_take_back;
    if (pipe == NULL) {
        tdp__op_complete(op, TDP_EINVAL);
        return;
    }
    tdp__op_submit(pipe->loop, op, recv_start);
}

tdp_err tdp_pipe_send(tdp_pipe *pipe, tdp_td *td, int64_t timeout_ms)
{
    if (pipe == NULL || td == NULL || !tdp__pipe_blocking_ok(pipe) ||
        tdp__op_pending(pipe->sync_send))
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
    if (pipe == NULL || out == NULL || !tdp__pipe_blocking_ok(pipe) ||
        tdp__op_pending(pipe->sync_recv))
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
