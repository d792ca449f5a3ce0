/*
 * pipe.c: the pipe state machine — schema once, then raw buffers received
 * in place; credits; clean end vs failure; async ops and blocking wrappers.
 *
 * Everything here runs on the loop thread except the entry points that hop
 * to it (tdp_pipe_*_async, tdp_pipe_release, the blocking wrappers).
 */
#include <errno.h>
#include <inttypes.h>
#include <string.h>
#include <time.h>

#include "pipe_int.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../schema/schema_int.h"

static void send_kick(tdp_pipe *p);
static void deliver(tdp_pipe *p);
static void send_credit(tdp_pipe *p);
static void slot_release(tdp_pipe *p, rx_slot *s, bool defer_credit);
static void credit_ev_cb(evutil_socket_t fd, short what, void *arg);

/* ---- options -------------------------------------------------------------- */

void tdp_pipe_opts_default(tdp_pipe_opts *o)
{
    if (o == NULL)
        return;
    *o = (tdp_pipe_opts){
        .size = sizeof(*o),
        .recv_depth = 1,
        .connect_timeout_ms = 10000,
        .linger_ms = 5000,
        .peer_mode = TDP_PEER_AUTO,
        .keepalive_idle_s = 1,
        .keepalive_intvl_s = 1,
        .keepalive_cnt = 3,
    };
}

void tdp__opts_resolve(const tdp_pipe_opts *in, tdp_pipe_opts *out, tdp_schema_limits *lim)
{
    tdp_pipe_opts_default(out);
    tdp__limits_resolve(NULL, lim);
    if (in == NULL)
        return;
    size_t n = in->size < sizeof(*in) ? in->size : sizeof(*in);
#define TAKE(f)                                                                                    \
    if (offsetof(tdp_pipe_opts, f) + sizeof(in->f) <= n && in->f)                                  \
        out->f = in->f;
    TAKE(recv_depth)
    TAKE(recv_device_set)
    TAKE(connect_timeout_ms)
    TAKE(linger_ms)
    TAKE(peer_mode)
    TAKE(keepalive_idle_s)
    TAKE(keepalive_intvl_s)
    TAKE(keepalive_cnt)
#undef TAKE
    if (out->recv_device_set)
        out->recv_device = in->recv_device;
    if (offsetof(tdp_pipe_opts, limits) + sizeof(in->limits) <= n && in->limits != NULL)
        tdp__limits_resolve(in->limits, lim);
    out->limits = NULL; /* copied into *lim */
    if (out->recv_depth > TDP_MAX_DEPTH)
        out->recv_depth = TDP_MAX_DEPTH;
}

/* ---- receive storage ------------------------------------------------------ */

static void store_unref(void *buf, void *arg)
{
    rx_store *st = arg;
    if (atomic_fetch_sub_explicit(&st->refs, 1, memory_order_acq_rel) == 1) {
        tdp_mem_free(st->mt, st->buf);
        tdp__free(st);
    }
}

static void slot_drop(tdp_pipe *p, rx_slot *s)
{
    if (s->memh != NULL) {
        ucp_mem_unmap(tdp__ucx_peek(p->loop)->context[p->wi], s->memh);
        s->memh = NULL;
    }
    tdp_td_unref(s->td); /* the store goes with the last td that wraps it */
    s->td = NULL;
    s->store = NULL;
}

/* Make a FREE slot hold a td of the current receive schema. */
static tdp_err slot_build(tdp_pipe *p, rx_slot *s)
{
    tdp_schema *sc = p->rx_schema;
    tdp_device dev = tdp_schema_device(sc);
    tdp_mem_type mt = dev.type == TDP_DEVICE_CUDA ? TDP_MEM_CUDA : TDP_MEM_HOST;
    uint64_t need = tdp_schema_total_bytes(sc);
    tdp_err rc;

    if (s->td != NULL && s->td->schema == sc)
        return TDP_OK;
    if (s->store != NULL && s->store->cap >= need && s->store->mt == mt &&
        tdp_device_equal(s->td->device, dev)) {
        /* reuse the storage (and its registration) under the new layout */
        tdp_td *td;
        atomic_fetch_add(&s->store->refs, 1);
        rc = tdp_td_wrap(sc, s->store->buf, s->store->cap, dev, store_unref, s->store, &td);
        if (rc != TDP_OK) {
            store_unref(NULL, s->store);
            return rc;
        }
        tdp_td_unref(s->td);
        s->td = td;
        return TDP_OK;
    }
    slot_drop(p, s);
    rx_store *st = tdp__calloc(1, sizeof(*st));
    if (st == NULL)
        return TDP_ENOMEM;
    if ((rc = tdp_mem_alloc(mt, dev.index, need, 0, &st->buf)) != TDP_OK) {
        tdp__free(st);
        return rc;
    }
    st->cap = need;
    st->mt = mt;
    atomic_init(&st->refs, 1);
    if ((rc = tdp_td_wrap(sc, st->buf, need, dev, store_unref, st, &s->td)) != TDP_OK) {
        store_unref(NULL, st);
        return rc;
    }
    s->store = st;
    if (need > 0) {
        /* registered once: every rendezvous lands here without a lookup */
        ucp_mem_map_params_t mp = {
            .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            .address = st->buf,
            .length = need,
        };
        if (mt == TDP_MEM_CUDA) {
            mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
            mp.memory_type = UCS_MEMORY_TYPE_CUDA;
        }
        ucs_status_t us = ucp_mem_map(tdp__ucx_peek(p->loop)->context[p->wi], &mp, &s->memh);
        if (us != UCS_OK) {
            tdp_log_debug("ucp_mem_map: %s (receiving without a handle)", ucs_status_string(us));
            s->memh = NULL;
        }
    }
    return TDP_OK;
}

/* ---- ops -------------------------------------------------------------------- */

tdp_err tdp_op_new(tdp_op_cb cb, void *arg, tdp_op **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    tdp_op *op = tdp__calloc(1, sizeof(*op));
    if (op == NULL)
        return TDP_ENOMEM;
    op->cb = cb;
    op->arg = arg;
    op->result = TDP_OK;
    *out = op;
    return TDP_OK;
}

void tdp_op_free(tdp_op *op)
{
    if (op != NULL && !op->pending)
        tdp__free(op);
    else if (op != NULL)
        tdp_log_error("tdp_op_free: op %p is still pending; not freed", (void *)op);
}

tdp_err tdp_op_result(const tdp_op *op)
{
    return op == NULL ? TDP_EINVAL : op->pending ? TDP_EAGAIN : op->result;
}

tdp_td *tdp_op_td(const tdp_op *op)
{
    return op && !op->pending && op->kind == OP_RECV && op->result == TDP_OK ? op->td : NULL;
}

uint64_t tdp_op_seq(const tdp_op *op)
{
    return op ? op->seq : 0;
}

static void op_complete(tdp_op *op, tdp_err rc)
{
    if (op->kind == OP_SEND && op->td != NULL) {
        tdp_td_unref(op->td);
        op->td = NULL;
    }
    op->result = rc;
    op->pending = false;
    op->next = NULL;
    if (op->sync) {
        tdp_pipe *p = op->pipe;
        pthread_mutex_lock(&p->mtx);
        op->done = true;
        pthread_cond_broadcast(&p->cond);
        pthread_mutex_unlock(&p->mtx);
        return;
    }
    if (op->cb != NULL)
        op->cb(op, op->arg);
}

static void q_push(tdp_op **head, tdp_op **tail, tdp_op *op)
{
    op->next = NULL;
    if (*tail != NULL)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

static tdp_op *q_pop(tdp_op **head, tdp_op **tail)
{
    tdp_op *op = *head;
    if (op != NULL) {
        *head = op->next;
        if (*head == NULL)
            *tail = NULL;
        op->next = NULL;
    }
    return op;
}

static bool q_remove(tdp_op **head, tdp_op **tail, tdp_op *op)
{
    tdp_op *prev = NULL;
    for (tdp_op *o = *head; o != NULL; prev = o, o = o->next) {
        if (o != op)
            continue;
        if (prev != NULL)
            prev->next = o->next;
        else
            *head = o->next;
        if (*tail == o)
            *tail = prev;
        o->next = NULL;
        return true;
    }
    return false;
}

/* ---- failure and end of stream ------------------------------------------ */

static void ep_close(tdp_pipe *p, bool force)
{
    (void)force; /* the endpoint is shared: it closes with its last pipe */
    if (p->sep != NULL)
        tdp__reg_ep_release(p);
}

/* Complete what can be completed after the pipe ended. */
static void drain_ops(tdp_pipe *p)
{
    tdp_op *op;
    tdp_err rc = p->status == TDP_OK || p->status == TDP_ECLOSED ? TDP_ECANCELED : p->status;
    while ((op = q_pop(&p->sendq, &p->sendq_tail)) != NULL)
        op_complete(op, rc);
    /* sends UCX still holds: the op goes back now, the ticket waits for UCX */
    for (uint32_t i = 0; i < p->nticket; i++) {
        tx_ticket *t = &p->tickets[i];
        if (t->op != NULL) {
            op = t->op;
            t->op = NULL;
            op_complete(op, rc);
        }
    }
    deliver(p);
}

void tdp__pipe_fail(tdp_pipe *p, tdp_err err, const char *why)
{
    if (p->state == PIPE_DEAD)
        return;
    bool was_connecting = p->state == PIPE_CONNECTING;
    p->state = PIPE_DEAD;
    p->status = err;
    if (err != TDP_ECLOSED && err != TDP_ECANCELED)
        tdp_log_info("pipe %s: %s (%s)", p->peer_name, why, tdp_strerror(err));
    /* tell a live peer why, when it was its fault or ours; a dead one won't read */
    if (err != TDP_ECONNRESET && err != TDP_ETIMEDOUT && p->bev != NULL && !p->bye_sent)
        tdp__conn_send_bye(p, err == TDP_ECLOSED ? TDP_ECANCELED : err);
    ep_close(p, true);
    if (p->timer != NULL)
        evtimer_del(p->timer);
    if (was_connecting) {
        if (p->listener != NULL) {
            /* the listener's handshake failed: drop it, nobody saw it */
            tdp__listener_drop(p->listener, p);
            return;
        }
        if (p->connect_cb != NULL) {
            tdp_pipe_cb cb = p->connect_cb;
            p->connect_cb = NULL;
            cb(NULL, err, p->connect_arg);
            tdp__reg_defer_destroy(p); /* we may be inside its socket's callback */
            return;
        }
    }
    drain_ops(p);
}

void tdp__pipe_on_socket_closed(tdp_pipe *p)
{
    tdp__conn_close(p);
    if (p->state == PIPE_DEAD)
        return;
    if (p->peer_bye && p->rx_seq >= p->peer_last_seq) {
        /* the peer said goodbye and every frame it sent has arrived; the
         * last payloads may still be landing: the end comes after them */
        if (p->ready_count == 0 && p->ucx_recvs == 0)
            tdp__pipe_fail(p, TDP_ECLOSED, "peer closed");
        return;
    }
    tdp__pipe_fail(p, TDP_ECONNRESET, p->peer_bye ? "peer left before its last message arrived"
                                                  : "peer vanished (control socket closed)");
}

static void linger_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (p->state != PIPE_DEAD && p->rx_seq < p->peer_last_seq)
        tdp__pipe_fail(p, TDP_ECONNRESET, "messages announced in BYE never arrived");
}

void tdp__pipe_on_bye(tdp_pipe *p, const tdp_bye *bye)
{
    if (bye->reason != TDP_OK) {
        tdp_err e = bye->reason == TDP_ELIMIT || bye->reason == TDP_EVERSION ? bye->reason
                                                                               : TDP_ECONNRESET;
        tdp__pipe_fail(p, e, "peer ended the pipe with an error");
        return;
    }
    if (p->peer_bye || bye->last_seq < p->rx_seq) {
        tdp__pipe_fail(p, TDP_EPROTO, "inconsistent BYE");
        return;
    }
    p->peer_bye = true;
    p->peer_last_seq = bye->last_seq;
    /* the peer reads no more: sends waiting for it can never go */
    tdp_op *op;
    while ((op = q_pop(&p->sendq, &p->sendq_tail)) != NULL)
        op_complete(op, TDP_ECLOSED);
    if (p->rx_seq < p->peer_last_seq) {
        event_free(p->timer);
        p->timer = evtimer_new(tdp__loop_base(p->loop), linger_cb, p);
        struct timeval tv = {(time_t)(p->opts.linger_ms / 1000),
                             (suseconds_t)(p->opts.linger_ms % 1000) * 1000};
        if (p->timer != NULL)
            evtimer_add(p->timer, &tv);
    }
    deliver(p);
}

/* ---- connection ------------------------------------------------------------ */

tdp_err tdp__pipe_open_ep(tdp_pipe *p, const void *addr, size_t alen)
{
    /* sends in flight are bounded by the peer's credit; twice that covers a
     * credit that comes back before the local completion of its send */
    p->nticket = 2 * p->peer_depth + 1;
    p->tickets = tdp__alloc_array(p->nticket, sizeof(*p->tickets));
    if (p->tickets == NULL)
        return TDP_ENOMEM;
    for (uint32_t i = 0; i < p->nticket; i++) {
        p->tickets[i].pipe = p;
        p->tickets[i].next_free = i + 1 < p->nticket ? &p->tickets[i + 1] : NULL;
    }
    p->free_tickets = p->tickets;
    p->credit_ev = evtimer_new(tdp__loop_base(p->loop), credit_ev_cb, p);
    if (p->credit_ev == NULL)
        return TDP_ENOMEM;
    tdp_err rc = tdp__reg_ep_acquire(p, addr, alen, p->peer_mode_ucx);
    if (rc != TDP_OK)
        return rc;
    p->state = PIPE_OPEN;
    if (p->timer != NULL)
        evtimer_del(p->timer);
    tdp_log_debug("pipe %s open: same_host=%d ucx_peer_mode=%d depth=%u/%u", p->peer_name,
                  p->same_host, p->peer_mode_ucx, p->depth, p->peer_depth);
    if (p->listener != NULL) {
        tdp_listener *l = p->listener;
        p->listener = NULL;
        tdp__listener_ready(l, p);
    } else if (p->connect_cb != NULL) {
        tdp_pipe_cb cb = p->connect_cb;
        p->connect_cb = NULL;
        cb(p, TDP_OK, p->connect_arg);
    }
    send_credit(p); /* releases that happened before the ep existed */
    send_kick(p);
    return TDP_OK;
}

tdp_pipe *tdp__pipe_alloc(tdp_loop *loop, const tdp_pipe_opts *opts)
{
    tdp_pipe *p = tdp__calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->loop = loop;
    tdp__opts_resolve(opts, &p->opts, &p->limits);
    p->depth = p->opts.recv_depth;
    p->lent1 = -1;
    p->status = TDP_OK;
    snprintf(p->peer_name, sizeof(p->peer_name), "?");
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        p->slots[i].pipe = p;
    pthread_mutex_init(&p->mtx, NULL);
    pthread_cond_init(&p->cond, NULL);
    if (tdp_op_new(NULL, NULL, &p->sync_send) != TDP_OK ||
        tdp_op_new(NULL, NULL, &p->sync_recv) != TDP_OK || tdp__reg_add(p) != TDP_OK) {
        tdp_op_free(p->sync_send);
        tdp_op_free(p->sync_recv);
        pthread_mutex_destroy(&p->mtx);
        pthread_cond_destroy(&p->cond);
        tdp__free(p);
        return NULL;
    }
    p->sync_send->sync = p->sync_recv->sync = true;
    p->sync_send->pipe = p->sync_recv->pipe = p;
    return p;
}

void tdp__pipe_destroy(tdp_pipe *p)
{
    tdp__conn_close(p);
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        slot_drop(p, &p->slots[i]);
    tdp_schema_unref(p->rx_schema);
    tdp_schema_unref(p->sent_schema);
    tdp_td_unref(p->gather_td);
    for (uint32_t i = 0; i < p->nticket; i++)
        tdp_td_unref(p->tickets[i].td); /* only tickets UCX never gave back */
    tdp__free(p->tickets);
    if (p->credit_ev != NULL)
        event_free(p->credit_ev);
    tdp__reg_remove(p);
    tdp__free(p->sync_send);
    tdp__free(p->sync_recv);
    pthread_mutex_destroy(&p->mtx);
    pthread_cond_destroy(&p->cond);
    tdp__free(p);
}

/* ---- sending --------------------------------------------------------------- */

static tdp_err ucs_to_err(tdp_pipe *p, ucs_status_t st)
{
    if (p->status != TDP_OK)
        return p->status; /* say why the pipe ended, not how UCX noticed */
    /*
     * Cancelled while this pipe is up: not by us (we cancel only after the
     * pipe ended) but by the receiver, which declines a rendezvous that
     * arrives after its side has ended — typically just after its BYE,
     * which may not have been read yet: the stream has ended.
     */
    return st == UCS_ERR_CANCELED ? TDP_ECLOSED : TDP_ECONNRESET;
}

/* One UCX request of a ticket finished (or the hold post_send keeps). */
static void ticket_done(tx_ticket *t, ucs_status_t st)
{
    tdp_pipe *p = t->pipe;
    p->ucx_sends--;
    if (st != UCS_OK && t->status == TDP_OK)
        t->status = ucs_to_err(p, st);
    if (--t->inflight > 0)
        return;
    tdp_op *op = t->op;
    t->op = NULL;
    tdp_td_unref(t->td);
    t->td = NULL;
    t->next_free = p->free_tickets;
    p->free_tickets = t;
    if (op != NULL)
        op_complete(op, t->status);
    send_kick(p); /* a ticket came back: a send may have waited for one */
    tdp__pipe_check_close(p);
}

static void send_cb(void *req, ucs_status_t st, void *user)
{
    tx_ticket *t = user;
    for (int i = 0; i < 2; i++)
        if (t->req[i] == req)
            t->req[i] = NULL;
    ucp_request_free(req);
    ticket_done(t, st);
}

/* Post one AM for a ticket; counts it in flight unless it finished at once. */
static tdp_err am_post(tdp_pipe *p, tx_ticket *t, uint8_t *hdr, const void *buf, size_t len,
                       uint32_t flags, ucs_memory_type_t mt)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = send_cb,
        .user_data = t,
        .flags = flags,
    };
    if (mt != UCS_MEMORY_TYPE_HOST) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        prm.memory_type = mt;
    }
    void *r = ucp_am_send_nbx(p->ep, TDP_AM_ID, hdr, TDP_AM_HDR_LEN, buf, len, &prm);
    if (r == NULL)
        return TDP_OK;
    if (UCS_PTR_IS_ERR(r)) {
        tdp_log_debug("ucp_am_send_nbx: %s", ucs_status_string(UCS_PTR_STATUS(r)));
        return TDP_ECONNRESET;
    }
    t->req[t->req[0] == NULL ? 0 : 1] = r;
    t->inflight++;
    p->ucx_sends++;
    return TDP_OK;
}

static void post_send(tdp_pipe *p, tdp_op *op, tx_ticket *t)
{
    tdp_schema *sc = op->td->schema;
    tdp_err rc = TDP_OK;
    ucs_memory_type_t mt =
        op->td->device.type == TDP_DEVICE_CUDA ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;

    t->op = op;
    t->td = tdp_td_ref(op->td);
    t->status = TDP_OK;
    t->inflight = 1; /* held until both posts are made */
    p->ucx_sends++;
    op->seq = p->send_seq + 1;
    if (p->sent_schema != sc && !tdp_schema_equal(p->sent_schema, sc)) {
        size_t jl;
        const char *json = tdp_schema_json(sc, &jl);
        tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                        .token = p->peer_token,
                        .seq = op->seq,
                        .hash = tdp_schema_hash(sc),
                        .length = jl,
                        .arg = tdp_schema_total_bytes(sc)};
        tdp_wire_am_encode(t->schema_hdr, &h);
        /* eager: the schema is whole in the receiver's callback, before its data */
        rc = am_post(p, t, t->schema_hdr, json, jl, UCP_AM_SEND_FLAG_EAGER, UCS_MEMORY_TYPE_HOST);
        if (rc == TDP_OK)
            p->stats.schemas_sent++;
    }
    if (p->sent_schema != sc) {
        /* remember this object: the next send compares pointers only */
        tdp_schema_unref(p->sent_schema);
        p->sent_schema = tdp_schema_ref(sc);
    }
    if (rc == TDP_OK) {
        /* the credit this side owes its peer rides along for free */
        tdp_am_hdr h = {.type = TDP_AM_DATA,
                        .token = p->peer_token,
                        .seq = op->seq,
                        .hash = tdp_schema_hash(sc),
                        .length = op->td->nbytes,
                        .arg = p->released};
        if (p->released > p->credit_sent)
            p->credit_sent = p->released;
        tdp_wire_am_encode(t->data_hdr, &h);
        rc = am_post(p, t, t->data_hdr, op->td->data, op->td->nbytes, 0, mt);
    }
    p->send_seq = op->seq;
    if (rc == TDP_OK) {
        p->stats.msgs_sent++;
        p->stats.bytes_sent += op->td->nbytes;
    } else {
        t->status = rc;
    }
    tdp__loop_kick(p->loop);
    if (rc != TDP_OK)
        tdp__pipe_fail(p, TDP_ECONNRESET, "send failed");
    ticket_done(t, UCS_OK); /* drop the hold: completes now if UCX finished both */
}

static void send_kick(tdp_pipe *p)
{
    while (p->sendq != NULL && p->state == PIPE_OPEN && p->ep != NULL && !p->peer_bye) {
        if (p->send_seq - p->peer_credit >= p->peer_depth || p->free_tickets == NULL) {
            if (!p->sendq->waited) { /* count each waiting send once */
                p->sendq->waited = true;
                p->stats.credit_waits++;
            }
            return;
        }
        tdp_op *op = q_pop(&p->sendq, &p->sendq_tail);
        tx_ticket *t = p->free_tickets;
        p->free_tickets = t->next_free;
        post_send(p, op, t);
    }
}

static void send_start(tdp_pipe *p, tdp_op *op)
{
    if (p->state == PIPE_DEAD || p->close_requested || p->peer_bye) {
        op_complete(op, p->peer_bye                             ? TDP_ECLOSED
                        : p->status != TDP_OK && !p->close_requested ? p->status
                                                                     : TDP_ECANCELED);
        return;
    }
    op->waited = false;
    q_push(&p->sendq, &p->sendq_tail, op);
    send_kick(p);
}

/* ---- credits ---------------------------------------------------------------- */

static void credit_cb(void *req, ucs_status_t st, void *user)
{
    tdp_pipe *p = user;
    ucp_request_free(req);
    p->ucx_sends--;
    p->credit_inflight = false;
    p->credit_req = NULL;
    send_credit(p);
}

static void send_credit(tdp_pipe *p)
{
    if (p->credit_inflight || p->released == p->credit_sent || p->ep == NULL ||
        p->state == PIPE_DEAD)
        return;
    /* cumulative count: one frame in flight at a time says everything */
    tdp_am_hdr h = {.type = TDP_AM_CREDIT, .token = p->peer_token, .arg = p->released};
    tdp_wire_am_encode(p->credit_hdr, &h);
    p->credit_sent = p->released;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = credit_cb,
        .user_data = p,
        .flags = UCP_AM_SEND_FLAG_EAGER,
    };
    void *r = ucp_am_send_nbx(p->ep, TDP_AM_ID, p->credit_hdr, TDP_AM_HDR_LEN, NULL, 0, &prm);
    tdp__loop_kick(p->loop);
    if (r == NULL)
        return;
    if (UCS_PTR_IS_ERR(r)) {
        tdp__pipe_fail(p, TDP_ECONNRESET, "cannot send credit");
        return;
    }
    p->credit_inflight = true;
    p->credit_req = r;
    p->ucx_sends++;
}

/* ---- receiving -------------------------------------------------------------- */

static void deliver(tdp_pipe *p)
{
    while (p->recvq != NULL) {
        tdp_err end = TDP_OK;
        if (p->ready_count == 0) {
            if (p->peer_bye && p->rx_seq >= p->peer_last_seq && p->ucx_recvs == 0)
                end = TDP_ECLOSED; /* every message announced in BYE was delivered */
            else if (p->state == PIPE_DEAD)
                end = p->status == TDP_OK ? TDP_ECANCELED : p->status;
            else
                return;
            op_complete(q_pop(&p->recvq, &p->recvq_tail), end);
            continue;
        }
        uint32_t si = p->ready[p->ready_head];
        p->ready_head = (p->ready_head + 1) % TDP_MAX_DEPTH;
        p->ready_count--;
        rx_slot *s = &p->slots[si];
        s->state = SLOT_LENT;
        if (p->depth == 1)
            p->lent1 = (int32_t)si;
        tdp_op *op = q_pop(&p->recvq, &p->recvq_tail);
        op->td = s->td;
        op->seq = s->seq;
        op_complete(op, TDP_OK);
    }
}

static void slot_ready(tdp_pipe *p, rx_slot *s)
{
    s->state = SLOT_READY;
    p->ready[(p->ready_head + p->ready_count) % TDP_MAX_DEPTH] = (uint32_t)(s - p->slots);
    p->ready_count++;
    p->stats.msgs_recv++;
    p->stats.bytes_recv += s->td->nbytes;
    if (p->peer_bye && p->rx_seq >= p->peer_last_seq && p->timer != NULL)
        evtimer_del(p->timer);
    deliver(p);
}

static void recv_cb(void *req, ucs_status_t st, size_t length, void *user)
{
    rx_slot *s = user;
    tdp_pipe *p = s->pipe;
    ucp_request_free(req);
    p->ucx_recvs--;
    s->req = NULL;
    if (st != UCS_OK || length != s->td->nbytes) {
        /* never hand out a partly filled buffer */
        s->state = SLOT_FREE;
        tdp__pipe_fail(p, TDP_ECONNRESET, "data transfer failed");
        return;
    }
    slot_ready(p, s);
}

static void proto_fail(tdp_pipe *p, tdp_err err, const char *why)
{
    tdp_log_warn("pipe %s: %s: disconnecting", p->peer_name, why);
    tdp__pipe_fail(p, err, why);
}

static void on_schema(tdp_pipe *p, const tdp_am_hdr *h, const void *data, size_t length,
                      const ucp_am_recv_param_t *param)
{
    char why[256];
    tdp_schema *sc = NULL;

    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        proto_fail(p, TDP_EPROTO, "schema frame sent by rendezvous");
        return;
    }
    if (h->seq != p->rx_seq + 1 || length != h->length) {
        proto_fail(p, TDP_EPROTO, "schema frame out of sequence or with a wrong length");
        return;
    }
    if (h->length > p->limits.max_json_bytes || h->arg > p->limits.max_total_bytes) {
        proto_fail(p, TDP_EMSGSIZE, "schema over this side's limits");
        return;
    }
    tdp_err rc = tdp_schema_decode(data, length, &p->limits, &sc, why, sizeof(why));
    if (rc != TDP_OK) {
        tdp_log_warn("pipe %s: rejected schema: %s", p->peer_name, why);
        tdp__pipe_fail(p, rc == TDP_ENOMEM ? TDP_ENOMEM : TDP_ESCHEMA, why);
        return;
    }
    if (tdp_schema_hash(sc) != h->hash || tdp_schema_total_bytes(sc) != h->arg) {
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
            tdp__pipe_fail(p, rc, "cannot place the schema on the receive device");
            return;
        }
        sc = local;
    }
    tdp_schema_unref(p->rx_schema);
    p->rx_schema = sc;
    p->rx_hash = h->hash;
    p->stats.schemas_recv++;
    for (uint32_t i = 0; i < p->depth; i++) {
        if (p->slots[i].state != SLOT_FREE)
            continue; /* rebuilt when released; it holds an older message */
        if ((rc = slot_build(p, &p->slots[i])) != TDP_OK) {
            tdp__pipe_fail(p, rc, "cannot allocate receive storage");
            return;
        }
    }
}

/* The peer's running count of released buffers, from CREDIT or DATA. */
static bool take_credit(tdp_pipe *p, uint64_t total)
{
    if (total < p->peer_credit || total > p->send_seq) {
        proto_fail(p, TDP_EPROTO, "credit beyond what was sent");
        return false;
    }
    if (total > p->peer_credit) {
        p->peer_credit = total;
        send_kick(p);
    }
    return true;
}

static void on_data(tdp_pipe *p, const tdp_am_hdr *h, void *data, size_t length,
                    const ucp_am_recv_param_t *param)
{
    if (p->rx_schema == NULL || h->hash != p->rx_hash) {
        proto_fail(p, TDP_EMISMATCH, "data frame for a schema this side does not hold");
        return;
    }
    if (h->seq != p->rx_seq + 1) {
        proto_fail(p, TDP_EPROTO, "data frame out of sequence");
        return;
    }
    if (h->length != tdp_schema_total_bytes(p->rx_schema) || length != h->length) {
        proto_fail(p, TDP_EMSGSIZE, "data length differs from the schema's size");
        return;
    }
    if (!take_credit(p, h->arg))
        return;
    rx_slot *s = NULL;
    for (uint32_t i = 0; i < p->depth; i++) {
        if (p->slots[i].state == SLOT_FREE) {
            s = &p->slots[i];
            break;
        }
    }
    if (s == NULL) {
        proto_fail(p, TDP_EPROTO, "data frame beyond the credit granted");
        return;
    }
    if (s->td == NULL || s->td->schema != p->rx_schema) {
        tdp_err rc = slot_build(p, s);
        if (rc != TDP_OK) {
            tdp__pipe_fail(p, rc, "cannot allocate receive storage");
            return;
        }
    }
    p->rx_seq = h->seq;
    s->seq = h->seq;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        if (length > 0)
            memcpy(s->td->data, data, length);
        slot_ready(p, s);
        return;
    }
    s->state = SLOT_FILLING;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.recv_am = recv_cb,
        .user_data = s,
    };
    if (s->memh != NULL) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = s->memh;
    }
    if (s->store->mt == TDP_MEM_CUDA) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        prm.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    void *r = ucp_am_recv_data_nbx(tdp__ucx_peek(p->loop)->worker[p->wi], data, s->td->data, length,
                                   &prm);
    if (r == NULL) {
        slot_ready(p, s);
    } else if (UCS_PTR_IS_ERR(r)) {
        s->state = SLOT_FREE;
        tdp__pipe_fail(p, TDP_ECONNRESET, "cannot receive data");
    } else {
        s->req = r;
        p->ucx_recvs++;
    }
}

ucs_status_t tdp__pipe_am_cb(void *arg, const void *header, size_t header_length, void *data,
                             size_t length, const ucp_am_recv_param_t *param)
{
    const tdp__am_arg *aa = arg;
    tdp_loop *loop = aa->loop;
    tdp_am_hdr h;
    tdp_err rc = tdp_wire_am_decode(header, header_length, &h);

    if (rc != TDP_OK) {
        /* the token sits at a fixed place: end the pipe it names, if any */
        if (header != NULL && header_length == TDP_AM_HDR_LEN) {
            uint64_t tok = 0;
            for (int i = 7; i >= 0; i--)
                tok = (tok << 8) | ((const uint8_t *)header)[8 + i];
            tdp_pipe *p = tdp__reg_lookup(loop, tok);
            if (p != NULL)
                proto_fail(p, rc, "malformed frame header");
        }
        tdp_log_debug("dropping malformed active message (%zu-byte header)", header_length);
        return UCS_OK; /* UCX drops the data (and answers a rendezvous) */
    }
    tdp_pipe *p = tdp__reg_lookup(loop, h.token);
    if (p == NULL || p->state == PIPE_DEAD)
        return UCS_OK;
    if (!p->hello_recv && !p->wi_seen) {
        /* the peer has our HELLO and chose a worker before we read its own:
         * its choice is the one ours will be; on_hello checks that */
        p->wi = aa->wi;
        p->wi_seen = true;
    } else if (aa->wi != p->wi) {
        proto_fail(p, TDP_EPROTO, "frame on the wrong worker");
        return UCS_OK;
    }
    switch (h.type) {
    case TDP_AM_CREDIT:
        take_credit(p, h.arg);
        break;
    case TDP_AM_SCHEMA:
        on_schema(p, &h, data, length, param);
        break;
    case TDP_AM_DATA:
        on_data(p, &h, data, length, param);
        break;
    }
    return UCS_OK;
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
    s->state = SLOT_FREE;
    if (p->lent1 == (int32_t)(s - p->slots))
        p->lent1 = -1;
    if (p->state == PIPE_DEAD)
        return;
    if (s->td->schema != p->rx_schema && slot_build(p, s) != TDP_OK) {
        tdp__pipe_fail(p, TDP_ENOMEM, "cannot allocate receive storage");
        return;
    }
    p->released++;
    if (defer_credit && p->credit_ev != NULL) {
        static const struct timeval zero = {0, 0};
        event_add(p->credit_ev, &zero);
        return;
    }
    send_credit(p);
}

static void credit_ev_cb(evutil_socket_t fd, short what, void *arg)
{
    send_credit(arg);
}

static void recv_start(tdp_pipe *p, tdp_op *op)
{
    if (p->depth == 1 && p->lent1 >= 0)
        slot_release(p, &p->slots[p->lent1], true); /* depth 1: the next receive overwrites */
    q_push(&p->recvq, &p->recvq_tail, op);
    deliver(p);
}

/* ---- entry points ------------------------------------------------------------- */

static void op_run(void *arg)
{
    tdp_op *op = arg;
    if (op->kind == OP_SEND)
        send_start(op->pipe, op);
    else
        recv_start(op->pipe, op);
}

static void op_submit(tdp_pipe *p, tdp_op *op)
{
    op->pipe = p;
    op->pending = true;
    op->done = false;
    if (tdp_loop_on_thread(p->loop) || !tdp__loop_running(p->loop)) {
        op_run(op);
        return;
    }
    op->task.fn = op_run;
    op->task.arg = op;
    tdp__loop_post_task(p->loop, &op->task);
}

void tdp_pipe_send_async(tdp_pipe *pipe, tdp_td *td, tdp_op *op)
{
    if (op == NULL)
        return;
    if (op->pending) {
        /* completing it here would corrupt the operation in flight */
        tdp_log_error("tdp_pipe_send_async: op %p is still pending; ignored", (void *)op);
        return;
    }
    op->kind = OP_SEND;
    if (pipe == NULL || td == NULL) {
        op->pipe = pipe;
        op->td = NULL;
        op_complete(op, TDP_EINVAL);
        return;
    }
    op->td = tdp_td_ref(td);
    op_submit(pipe, op);
}

void tdp_pipe_recv_async(tdp_pipe *pipe, tdp_op *op)
{
    if (op == NULL)
        return;
    if (op->pending) {
        tdp_log_error("tdp_pipe_recv_async: op %p is still pending; ignored", (void *)op);
        return;
    }
    op->kind = OP_RECV;
    op->td = NULL;
    if (pipe == NULL) {
        op->pipe = pipe;
        op_complete(op, TDP_EINVAL);
        return;
    }
    op_submit(pipe, op);
}

bool tdp__cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mtx, int64_t deadline_ms)
{
    if (deadline_ms < 0) {
        pthread_cond_wait(cond, mtx);
        return true;
    }
    int64_t left = deadline_ms - tdp__now_ms();
    if (left <= 0)
        return false;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* pthread_cond_timedwait's clock */
    ts.tv_sec += left / 1000;
    ts.tv_nsec += (left % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(cond, mtx, &ts);
    return true;
}

int64_t tdp__now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void op_cancel(void *arg)
{
    tdp_op *op = arg;
    tdp_pipe *p = op->pipe;
    if (q_remove(&p->sendq, &p->sendq_tail, op) || q_remove(&p->recvq, &p->recvq_tail, op)) {
        op_complete(op, TDP_ETIMEDOUT);
    } else if (op->pending && op->kind == OP_SEND) {
        /* already with UCX: its ticket keeps the headers and the buffer's
         * reference until UCX lets go; the caller gets the op back now */
        for (uint32_t i = 0; i < p->nticket; i++) {
            if (p->tickets[i].op == op) {
                p->tickets[i].op = NULL;
                op_complete(op, TDP_ETIMEDOUT);
                break;
            }
        }
    }
    pthread_mutex_lock(&p->mtx);
    op->cancel_pending = false; /* the waiter may return: this task is done with op */
    pthread_cond_broadcast(&p->cond);
    pthread_mutex_unlock(&p->mtx);
}

/*
 * Wait for a sync op: on another thread's loop, sleep on the pipe's condition
 * variable; on a loop nobody runs, run it here. A deadline cancels what has
 * not started; a send already with UCX is waited for (it ends when the
 * transport finishes or the pipe fails).
 */
tdp_err tdp__wait_op(tdp_pipe *p, tdp_op *op, int64_t timeout_ms)
{
    if (!tdp__loop_running(p->loop) || tdp_loop_on_thread(p->loop)) {
        if (tdp__loop_run_until(p->loop, &op->done, timeout_ms) != TDP_OK && !op->done)
            op_cancel(op); /* completes it, whatever state it is in */
        return op->result;
    }
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    bool canceled = false;
    pthread_mutex_lock(&p->mtx);
    while (!op->done || op->cancel_pending) {
        if (!tdp__cond_wait_until(&p->cond, &p->mtx, canceled ? -1 : deadline)) {
            canceled = true;
            op->cancel_pending = true;
            op->cancel_task = (tdp__task){.fn = op_cancel, .arg = op};
            tdp__loop_post_task(p->loop, &op->cancel_task);
        }
    }
    pthread_mutex_unlock(&p->mtx);
    return op->result;
}

static bool blocking_ok(tdp_pipe *p)
{
    /* a blocking call inside a loop callback would wait for itself */
    return !(tdp__loop_running(p->loop) && tdp_loop_on_thread(p->loop));
}

tdp_err tdp_pipe_send(tdp_pipe *pipe, tdp_td *td, int64_t timeout_ms)
{
    if (pipe == NULL || td == NULL || !blocking_ok(pipe) || pipe->sync_send->pending)
        return TDP_EINVAL;
    tdp_op *op = pipe->sync_send;
    op->kind = OP_SEND;
    op->td = tdp_td_ref(td);
    op_submit(pipe, op);
    return tdp__wait_op(pipe, op, timeout_ms);
}

tdp_err tdp_pipe_recv(tdp_pipe *pipe, int64_t timeout_ms, tdp_td **out)
{
    if (pipe == NULL || out == NULL || !blocking_ok(pipe) || pipe->sync_recv->pending)
        return TDP_EINVAL;
    tdp_op *op = pipe->sync_recv;
    op->kind = OP_RECV;
    op->td = NULL;
    op_submit(pipe, op);
    tdp_err rc = tdp__wait_op(pipe, op, timeout_ms);
    if (rc == TDP_OK)
        *out = op->td;
    return rc;
}

static void gather_release(void *buf, void *arg)
{
    store_unref(buf, arg);
}

tdp_err tdp_pipe_send_gather(tdp_pipe *pipe, tdp_schema *schema, const void *const *ptrs,
                             int64_t timeout_ms)
{
    if (pipe == NULL || schema == NULL || (ptrs == NULL && tdp_schema_num_tensors(schema) > 0) ||
        tdp_schema_device(schema).type != TDP_DEVICE_CPU)
        return TDP_EINVAL;
    /* the send buffer is rebuilt only when the schema changes or grows */
    if (pipe->gather_td == NULL || pipe->gather_td->schema != schema) {
        uint64_t need = tdp_schema_total_bytes(schema);
        rx_store *st = pipe->gather;
        if (st == NULL || st->cap < need) {
            st = tdp__calloc(1, sizeof(*st));
            if (st == NULL)
                return TDP_ENOMEM;
            if (tdp_mem_alloc(TDP_MEM_HOST, 0, need, 0, &st->buf) != TDP_OK) {
                tdp__free(st);
                return TDP_ENOMEM;
            }
            st->cap = need;
            st->mt = TDP_MEM_HOST;
            atomic_init(&st->refs, 0);
        }
        tdp_td *td;
        atomic_fetch_add(&st->refs, 1);
        tdp_err rc = tdp_td_wrap(schema, st->buf, st->cap, TDP_DEVICE_CPU_INIT, gather_release,
                                 st, &td);
        if (rc != TDP_OK) {
            store_unref(NULL, st);
            return rc;
        }
        tdp_td_unref(pipe->gather_td);
        pipe->gather_td = td;
        pipe->gather = st;
    }
    for (uint32_t i = 0; i < tdp_schema_num_tensors(schema); i++) {
        tdp_leaf l;
        tdp_td_leaf_at(pipe->gather_td, i, &l);
        if (l.nbytes > 0)
            memcpy(l.data, ptrs[i], l.nbytes);
    }
    return tdp_pipe_send(pipe, pipe->gather_td, timeout_ms);
}

static void release_task(void *arg)
{
    rx_slot *s = arg;
    s->release_posted = false;
    slot_release(s->pipe, s, false);
}

void tdp_pipe_release(tdp_pipe *pipe, tdp_td *td)
{
    if (pipe == NULL || td == NULL)
        return;
    for (uint32_t i = 0; i < pipe->depth; i++) {
        rx_slot *s = &pipe->slots[i];
        if (s->td != td || s->state != SLOT_LENT)
            continue;
        if (tdp_loop_on_thread(pipe->loop) || !tdp__loop_running(pipe->loop)) {
            slot_release(pipe, s, false);
        } else if (!s->release_posted) {
            s->release_posted = true;
            s->release_task = (tdp__task){.fn = release_task, .arg = s};
            tdp__loop_post_task(pipe->loop, &s->release_task);
        }
        return;
    }
}

void tdp__pipe_check_close(tdp_pipe *p)
{
    if (!p->close_requested || p->state == PIPE_DEAD)
        return;
    if (!p->bye_sent) {
        if (p->sendq != NULL || p->ucx_sends > (p->credit_inflight ? 1u : 0u))
            return; /* BYE names the last seq: everything before it must be gone */
        tdp__conn_send_bye(p, TDP_OK);
        return;
    }
    if (p->bye_flushed) {
        p->state = PIPE_CLOSING;
        tdp__pipe_fail(p, TDP_ECLOSED, "closed");
    }
}

/*
 * Run fn(arg) on the loop thread and wait for it: inline when this is the
 * loop thread or nobody runs the loop. The request lives on this stack, so
 * fn may free the object it works on.
 */
typedef struct loop_call {
    tdp__task task;
    tdp_loop_fn fn;
    void *arg;
    bool done;
    pthread_mutex_t mtx;
    pthread_cond_t cond;
} loop_call;

static void loop_call_run(void *arg)
{
    loop_call *c = arg;
    c->fn(c->arg);
    pthread_mutex_lock(&c->mtx);
    c->done = true;
    pthread_cond_signal(&c->cond);
    pthread_mutex_unlock(&c->mtx);
}

void tdp__call_on_loop(tdp_loop *loop, tdp_loop_fn fn, void *arg)
{
    if (tdp_loop_on_thread(loop) || !tdp__loop_running(loop)) {
        fn(arg);
        return;
    }
    loop_call c = {.task = {.fn = loop_call_run}, .fn = fn, .arg = arg};
    c.task.arg = &c;
    pthread_mutex_init(&c.mtx, NULL);
    pthread_cond_init(&c.cond, NULL);
    tdp__loop_post_task(loop, &c.task);
    pthread_mutex_lock(&c.mtx);
    while (!c.done)
        pthread_cond_wait(&c.cond, &c.mtx);
    pthread_mutex_unlock(&c.mtx);
    pthread_mutex_destroy(&c.mtx);
    pthread_cond_destroy(&c.cond);
}

static void status_task(void *arg)
{
    tdp_pipe *p = ((void **)arg)[0];
    tdp_err *out = ((void **)arg)[1];
    if (p->state != PIPE_DEAD)
        *out = TDP_ETIMEDOUT;
    else
        *out = p->status == TDP_ECLOSED ? TDP_OK : p->status;
}

static void close_task(void *arg)
{
    tdp_pipe *p = arg;
    if (p->state == PIPE_DEAD)
        return;
    p->close_requested = true;
    if (p->state == PIPE_CONNECTING || p->bev == NULL) {
        tdp__pipe_fail(p, TDP_ECLOSED, "closed");
        return;
    }
    tdp__pipe_check_close(p);
}

static void state_task(void *arg)
{
    tdp_pipe *p = ((void **)arg)[0];
    *(bool *)((void **)arg)[1] = p->state == PIPE_DEAD;
}

static bool pipe_dead(tdp_pipe *p)
{
    bool dead;
    void *args[2] = {p, &dead};
    tdp__call_on_loop(p->loop, state_task, args);
    return dead;
}

tdp_err tdp_pipe_close(tdp_pipe *pipe, int64_t timeout_ms)
{
    if (pipe == NULL || !blocking_ok(pipe))
        return TDP_EINVAL;
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    tdp__call_on_loop(pipe->loop, close_task, pipe);
    if (!tdp__loop_running(pipe->loop)) {
        volatile bool never = false;
        while (pipe->state != PIPE_DEAD) {
            int64_t left = deadline < 0 ? 20 : deadline - tdp__now_ms();
            if (left <= 0)
                break;
            tdp__loop_run_until(pipe->loop, &never, left < 20 ? left : 20);
        }
    } else {
        /* close is rare: check on the loop thread every millisecond */
        while (!pipe_dead(pipe) && (deadline < 0 || tdp__now_ms() < deadline)) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    tdp_err st;
    void *args[2] = {pipe, &st};
    tdp__call_on_loop(pipe->loop, status_task, args);
    return st;
}

/*
 * Let go of every UCX request still pending: after ucp_request_free their
 * callbacks never run, so the pipe can go now; the buffers they may still
 * read or write are buried with the loop.
 */
static void abandon_requests(tdp_pipe *p)
{
    for (uint32_t i = 0; i < p->nticket; i++) {
        tx_ticket *t = &p->tickets[i];
        bool busy = false;
        for (int k = 0; k < 2; k++) {
            if (t->req[k] != NULL) {
                ucp_request_free(t->req[k]);
                t->req[k] = NULL;
                busy = true;
            }
        }
        if (busy) {
            tdp__reg_bury(p->loop, t->td, NULL, p->wi);
            t->td = NULL;
        }
    }
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        rx_slot *sl = &p->slots[i];
        if (sl->req == NULL)
            continue;
        ucp_request_free(sl->req);
        sl->req = NULL;
        tdp__reg_bury(p->loop, sl->td, sl->memh, p->wi);
        sl->td = NULL;
        sl->memh = NULL;
        sl->store = NULL;
    }
    if (p->credit_req != NULL) {
        ucp_request_free(p->credit_req);
        p->credit_req = NULL;
    }
    p->ucx_sends = p->ucx_recvs = 0;
}

static void free_task(void *arg)
{
    tdp_pipe *p = arg;
    if (p->state != PIPE_DEAD)
        tdp__pipe_fail(p, TDP_ECANCELED, "freed");
    if (p->status == TDP_OK)
        p->status = TDP_ECANCELED;
    /* complete every op the user still has pending */
    drain_ops(p);
    tdp_op *op;
    while ((op = q_pop(&p->recvq, &p->recvq_tail)) != NULL)
        op_complete(op, TDP_ECANCELED);
    ep_close(p, true);
    abandon_requests(p);
    if (p->credit_ev != NULL)
        event_del(p->credit_ev);
    if (tdp_loop_on_thread(p->loop)) {
        /* maybe inside one of this pipe's own callbacks, whose frames still
         * read it: the pipe is inert now; its memory goes on a later turn */
        tdp__reg_defer_destroy(p);
        return;
    }
    tdp__reg_remove(p);
    tdp__pipe_destroy(p);
}

void tdp_pipe_free(tdp_pipe *pipe)
{
    if (pipe != NULL)
        tdp__call_on_loop(pipe->loop, free_task, pipe);
}

/* ---- queries ------------------------------------------------------------------ */

void tdp_pipe_stats_get(const tdp_pipe *pipe, tdp_pipe_stats *out)
{
    if (pipe != NULL && out != NULL)
        *out = pipe->stats;
}

tdp_err tdp_pipe_status(const tdp_pipe *pipe)
{
    return pipe ? pipe->status : TDP_EINVAL;
}

tdp_schema *tdp_pipe_recv_schema(const tdp_pipe *pipe)
{
    return pipe ? pipe->rx_schema : NULL;
}

const char *tdp_pipe_peer(const tdp_pipe *pipe, char *buf, size_t len)
{
    if (buf != NULL && len > 0)
        snprintf(buf, len, "%s", pipe ? pipe->peer_name : "?");
    return buf;
}

bool tdp_pipe_same_host(const tdp_pipe *pipe)
{
    return pipe && pipe->same_host;
}
