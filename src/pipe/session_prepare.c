/*
 * session_prepare.c: tdp_pipe_prepare — announce a layout before its first
 * message, so that both sides set up for it off the message's path.
 *
 * The prepare rides the send queue (in order with the sends before it) as
 * a send op without a td. At the head it asks the plane to set up this
 * side (pools, bounces, pages faulted in) and to announce the schema as
 * the layout of the next DATA; the session then counts the schema as sent,
 * so the first send of it carries DATA only. Where the peer has storage to
 * make (the ucx plane), the SCHEMA goes flagged TDP_AM_F_PREPARE and the
 * peer answers READY on the control socket once its storage is allocated
 * and faulted in; the prepare completes then. A prepare is not a message:
 * no sequence number, no credit, no ticket.
 */
#include <inttypes.h>
#include <stddef.h>

#include "session_int.h"
#include "../core/log.h"
#include "../schema/schema_int.h"

tdp__prep_step_rc tdp__prep_step(tdp_pipe *p, tdp_err *fail)
{
    tdp_op *op = p->sendq.head;
    tdp_schema *sc = op->prep;
    uint64_t total = tdp_schema_total_bytes(sc);

    if (p->plane->prepare == NULL || p->prep_op != NULL) {
        /* a plane without the operation; or a second prepare meanwhile (async) */
        tdp__op_complete(tdp__opq_pop(&p->sendq),
                         p->plane->prepare == NULL ? TDP_ENOTSUP : TDP_EAGAIN);
        return TDP__PREP_DONE;
    }
    if (p->peer_max_msg != 0 && total > p->peer_max_msg) {
        /* what the peer's receive of such a send would say, without ending the pipe */
        tdp_log_warn("pipe %s: prepare of a %" PRIu64 "-byte layout, over the peer's %" PRIu64
                     "-byte limit: refused",
                     p->ctl.peer_name, total, p->peer_max_msg);
        tdp__op_complete(tdp__opq_pop(&p->sendq), TDP_EMSGSIZE);
        return TDP__PREP_DONE;
    }
    tdp_device dev = tdp_schema_device(sc);
    uint32_t need = dev.type == TDP_DEVICE_CPU ? TDP__MEM_HOST : TDP__MEM_ANY_CUDA;
    if ((p->plane_mem & need) == 0) {
        tdp__op_complete(tdp__opq_pop(&p->sendq), TDP_ENOTSUP); /* as a send of it */
        return TDP__PREP_DONE;
    }
    bool in_force = p->sent_schema == sc || tdp_schema_equal(p->sent_schema, sc);
    bool sent = false, await = false;
    tdp_err rc = p->plane->prepare(p->link, sc, p->send_seq + 1, !in_force, &sent, &await);
    if (rc == TDP_EAGAIN)
        return TDP__PREP_RETRY;
    tdp__opq_pop(&p->sendq);
    if (rc != TDP_OK) {
        tdp__op_complete(op, rc);
        if (rc == TDP_ECONNRESET)
            *fail = rc;
        return TDP__PREP_DONE;
    }
    if (sent) {
        if (p->sent_schema != sc) {
            tdp_schema_unref(p->sent_schema);
            p->sent_schema = tdp_schema_ref(sc);
        }
        p->stats.schemas_sent++;
    }
    if (!(sent && await)) {
        tdp__op_complete(op, TDP_OK);
        return TDP__PREP_DONE;
    }
    p->prep_op = op;
    p->prep_hash = tdp_schema_hash(sc);
    p->prep_want = ++p->prep_tx_n;
    return TDP__PREP_DONE;
}

void tdp__prep_fail(tdp_pipe *p, tdp_err rc)
{
    tdp_op *op = p->prep_op;
    p->prep_op = NULL;
    if (op != NULL)
        tdp__op_complete(op, rc);
}

bool tdp__prep_take_back(tdp_pipe *p, tdp_op *op)
{
    if (op == NULL || p->prep_op != op)
        return false;
    tdp__prep_fail(p, TDP_ETIMEDOUT);
    return true;
}

bool tdp__prep_ready(tdp_pipe *p, const tdp_ready *r)
{
    if (r->count > p->prep_tx_n) {
        tdp_log_warn("pipe %s: READY for a prepare never sent", p->ctl.peer_name);
        return false;
    }
    /* an earlier prepare's (one that timed out) is late: not this one's */
    if (p->prep_op != NULL && r->count == p->prep_want && r->hash == p->prep_hash)
        tdp__prep_fail(p, TDP_OK);
    return true;
}

/*
 * What a peer may leave unread on the control socket before its prepared
 * layouts are refused: about 2000 READYs beyond what the kernel holds. An
 * honest peer reads each READY before its next prepare; one that never
 * reads would make this side queue 32 bytes per prepared SCHEMA, unbounded.
 */
#define READY_BACKLOG_MAX (64u * 1024u)

void tdp__prep_schema_in(tdp_pipe *p, const tdp__frame *f)
{
    if (!f->prepare)
        return;
    if (tdp__ctl_backlog(&p->ctl) > READY_BACKLOG_MAX) {
        tdp__pipe_proto_fail(p, TDP_ELIMIT,
                             "prepared layouts keep coming and the peer does not read its "
                             "control socket");
        return;
    }
    p->prep_rx_n++;
    if (p->peer_ready) {
        tdp_ready r = {.hash = f->hash, .count = p->prep_rx_n};
        tdp__ctl_send_ready(&p->ctl, &r);
    }
}

void tdp__prep_reset(tdp_pipe *p)
{
    p->prep_tx_n = p->prep_rx_n = 0;
    p->peer_ready = false;
    p->peer_max_msg = 0;
}
