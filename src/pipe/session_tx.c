/*
 * session_tx.c: the pipe's send side — the send queue, credit and send
 * tickets, posting a message (its schema first when it changed) to the
 * plane, and the plane's reports that a send is done or that the peer
 * gave credit back.
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

static bool take_credit(tdp_pipe *p, uint64_t total)
{
    if (total < p->peer_credit || total > p->send_seq - p->credit_base) {
        tdp__pipe_proto_fail(p, TDP_EPROTO, "credit beyond what was sent");
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

void tdp__pipe_up_credit(void *owner, tdp__link *l, uint64_t total)
{
    tdp_pipe *p = owner;
    if (tdp__pipe_frame_plane(p, l) != NULL)
        take_credit(p, total);
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
            tdp__pipe_lat_record(p, TDP_LAT_SEND, op->t_call_ns);
        tdp__op_complete(op, st);
    }
}

void tdp__pipe_up_sent(void *owner, tdp__link *l, void *cookie, tdp_err st)
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
    tdp__pipe_send_kick(p); /* a ticket came back: a send may have waited for one */
    tdp__pipe_check_close(p);
}

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
        .urgent = op->waiter != NULL,
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
 * completion queued (tdp__pipe_up_sent), and the tickets it gives back are used by
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

void tdp__pipe_send_start(void *arg)
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
