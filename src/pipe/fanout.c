/*
 * fanout.c: one producer, many consumer pipes (include/tdpipe/fanout.h).
 *
 * Everything lives on the loop thread. A message is a slot of msgs[]
 * holding a reference on the producer's tensordict and a count of the
 * consumers that still hold it; each consumer has a ring of slot indices
 * in sequence order and up to `depth` sends of its pipe in flight (in
 * broadcast mode; one in distribute mode, where being free is the credit),
 * so its pipe streams as it would alone. A slot is free when no consumer holds it;
 * then the producer's op completes. Nothing here allocates per message.
 *
 * One copy on the shm plane: in broadcast mode the links of the consumers
 * on the shm plane send from one pool group (plane_shm.h), the first such
 * consumer's. A message is copied once, into a loan of that group (or is
 * one already: tdp_fanout_loan), and that loan goes to each of them
 * without a copy. Those links send nothing else, so a message waits for a
 * free slot of the group instead of being copied per consumer.
 */
#include <event2/event.h>
#include <string.h>
#include <tdpipe/fanout.h>

#include "op.h"
#include "session.h"
#include "shm/plane_shm.h"
#include "../core/alloc.h"
#include "../core/log.h"

#define FO_MAX_DEPTH     64
#define FO_MAX_CONSUMERS 1024

enum c_state {
    C_FREE = 0, /* slot unused */
    C_LIVE,     /* gets new messages */
    C_LEAVING,  /* sends what it holds, then closes */
    C_CLOSING,  /* its pipe is closing */
    C_DEAD,     /* failed or ended: waits to be freed */
};

typedef struct fo_msg {
    tdp_td *td;
    tdp_op *op; /* the producer's; NULL once taken back */
    uint64_t seq;
    uint32_t refs; /* consumers still holding it */
    bool live;
} fo_msg;

enum op_flag { OPF_NONE = 0, OPF_DROP, OPF_MOVE };

struct fo_consumer;
typedef struct fo_opref {
    struct fo_consumer *c;
    uint32_t k;
} fo_opref;

typedef struct fo_consumer {
    tdp_fanout *fo;
    tdp_pipe *pipe;
    /* its pipe's sends: ops[k] carries msgs[op_msg[k]] (-1: idle) */
    tdp_op *ops[FO_MAX_DEPTH];
    fo_opref ref[FO_MAX_DEPTH];
    int op_msg[FO_MAX_DEPTH];
    uint8_t op_flag[FO_MAX_DEPTH]; /* enum op_flag: why it was taken back */
    uint32_t nops, ninflight;
    uint64_t id;
    enum c_state state;
    uint8_t q[FO_MAX_DEPTH]; /* msgs[] indices, oldest first */
    uint32_t qh, qn;
    bool ended;  /* its pipe's end callback ran */
    bool shared; /* its link sends from the fan-out's shm pool group */
    char peer[64];
    tdp_fanout_peer_stats st;
} fo_consumer;

struct tdp_fanout {
    tdp_loop *loop;
    tdp_fanout_opts o;
    fo_msg msgs[FO_MAX_DEPTH];
    uint64_t next_seq, next_id;
    tdp__opq waitq; /* sends waiting for a slot (or, distribute, a consumer) */
    fo_consumer *cons;
    uint32_t rr; /* distribute: where the next search starts */
    tdp_listener *listener;
    struct event *reap_ev;  /* frees dead consumers' pipes outside their callbacks */
    /* a message waits for credit (distribute) or a free slot of the shm
     * group: a consumer's credit (each release on shm) activates it */
    struct event *wake_ev;
    bool closing, freeing, pumping, again, want_wake;
    bool close_timed_out; /* a consumer's pipe ended at its close deadline while closing */
    tdp_fanout_stats st;
    tdp_op *sync;
    tdp__waiter w;
    volatile bool gone; /* closing and no consumer left; under w.mtx */
};

static void pump(tdp_fanout *fo);

void tdp_fanout_opts_default(tdp_fanout_opts *o)
{
    if (o == NULL)
        return;
    memset(o, 0, sizeof(*o));
    o->size = sizeof(*o);
    o->depth = 4;
    o->max_consumers = 64;
    o->close_timeout_ms = 5000;
}

/* ---- messages ---------------------------------------------------------------- */

static int msg_free_slot(const tdp_fanout *fo)
{
    for (uint32_t i = 0; i < fo->o.depth; i++)
        if (!fo->msgs[i].live)
            return (int)i;
    return -1;
}

/* The last holder let go: the producer's send is done. */
static void msg_finish(tdp_fanout *fo, int m, tdp_err rc)
{
    fo_msg *g = &fo->msgs[m];
    tdp_op *op = g->op;
    uint64_t bytes = tdp_td_nbytes(g->td);
    tdp_td_unref(g->td);
    *g = (fo_msg){0};
    if (op == NULL)
        return;
    if (rc == TDP_OK) {
        fo->st.msgs++;
        fo->st.bytes += bytes;
    }
    tdp__op_complete(op, rc);
}

static void msg_release(tdp_fanout *fo, int m)
{
    if (--fo->msgs[m].refs == 0)
        msg_finish(fo, m, fo->freeing ? TDP_ECANCELED : TDP_OK);
}

/* ---- consumers --------------------------------------------------------------- */

static bool c_holds(const fo_consumer *c)
{
    return c->state == C_LIVE || c->state == C_LEAVING;
}

static void c_push(fo_consumer *c, int m)
{
    c->q[(c->qh + c->qn) % FO_MAX_DEPTH] = (uint8_t)m;
    c->qn++;
    c->fo->msgs[m].refs++;
    if (c->st.first_seq == 0)
        c->st.first_seq = c->fo->msgs[m].seq;
}

static int c_pop(fo_consumer *c)
{
    int m = c->q[c->qh];
    c->qh = (c->qh + 1) % FO_MAX_DEPTH;
    c->qn--;
    return m;
}

static void c_drain_queue(fo_consumer *c)
{
    while (c->qn > 0)
        msg_release(c->fo, c_pop(c));
}

/* The consumer is gone (its pipe failed or ended): what it held goes back. */
static void c_fail(fo_consumer *c, tdp_err why)
{
    if (c->state == C_DEAD || c->state == C_FREE)
        return;
    tdp_fanout *fo = c->fo;
    bool clean = why == TDP_OK || (why == TDP_ECLOSED && c->state != C_LIVE);
    c->st.status = why == TDP_OK ? TDP_ECLOSED : why;
    c->state = C_DEAD;
    fo->st.left++;
    if (!clean && why != TDP_ECLOSED)
        fo->st.failed++;
    if (!clean)
        tdp_log_info("fanout: consumer %llu (%s) left: %s", (unsigned long long)c->id, c->peer,
                     tdp_strerror(why));
    c_drain_queue(c);
    if (!c->ended)
        tdp_pipe_abort(c->pipe, why == TDP_OK ? TDP_ECANCELED : why);
}

static void reap_later(tdp_fanout *fo)
{
    if (!fo->freeing)
        event_active(fo->reap_ev, 0, 0);
}

/* Loop thread, outside the pipe's callbacks. */
static void c_free(fo_consumer *c)
{
    tdp_fanout *fo = c->fo;
    if (c->pipe != NULL) /* free_task has freed it already */
        tdp__session_set_credit_cb(c->pipe, NULL, NULL);
    tdp_pipe_free(c->pipe);
    for (uint32_t k = 0; k < c->nops; k++)
        tdp_op_free(c->ops[k]);
    memset(c, 0, sizeof(*c));
    fo->st.consumers--;
    if (fo->closing && fo->st.consumers == 0) {
        pthread_mutex_lock(&fo->w.mtx);
        fo->gone = true;
        pthread_cond_broadcast(&fo->w.cond);
        pthread_mutex_unlock(&fo->w.mtx);
    }
}

static void reap_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    tdp_fanout *fo = arg;
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->state == C_DEAD && c->ended && c->ninflight == 0)
            c_free(c);
    }
    pump(fo);
}

static void wake_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    tdp_fanout *fo = arg;
    fo->want_wake = false;
    pump(fo);
}

/* A consumer's pipe got credit; in its callback: the pump runs from the event. */
static void c_credit_cb(void *arg)
{
    fo_consumer *c = arg;
    if (c->fo->want_wake && !c->fo->freeing)
        event_active(c->fo->wake_ev, 0, 0);
}

static void c_send_cb(tdp_op *op, void *arg)
{
    fo_opref *r = arg;
    fo_consumer *c = r->c;
    tdp_fanout *fo = c->fo;
    int m = c->op_msg[r->k];
    uint8_t flag = c->op_flag[r->k];
    c->op_msg[r->k] = -1;
    c->op_flag[r->k] = OPF_NONE;
    c->ninflight--;
    tdp_err rc = tdp_op_result(op);
    if (rc == TDP_OK) {
        c->st.msgs_sent++;
        c->st.bytes_sent += tdp_td_nbytes(fo->msgs[m].td);
    } else if (flag == OPF_DROP && rc == TDP_ETIMEDOUT) {
        c->st.drops++;
        fo->st.drops++;
    } else if (flag == OPF_MOVE && rc == TDP_ETIMEDOUT) {
        c->st.moved++;
    } else {
        c_fail(c, rc);
    }
    msg_release(fo, m);
    if (c->state == C_DEAD && c->ended)
        reap_later(fo);
    pump(fo);
}

/* The op of c that carries msgs[m], or -1. */
static int c_op_of(const fo_consumer *c, int m)
{
    for (uint32_t k = 0; k < c->nops; k++)
        if (c->op_msg[k] == m)
            return (int)k;
    return -1;
}

static void c_end_cb(tdp_pipe *pipe, tdp_err status, void *arg)
{
    (void)pipe;
    fo_consumer *c = arg;
    c->ended = true;
    if (c->fo->closing && status == TDP_ETIMEDOUT)
        c->fo->close_timed_out = true; /* set before the reap that may end the close's wait */
    c_fail(c, status);
    if (c->ninflight == 0)
        reap_later(c->fo);
}

/* Start the consumer's next sends, or its close once it holds nothing. */
static void c_pump(fo_consumer *c)
{
    if (!c_holds(c))
        return;
    uint32_t most = c->fo->o.mode == TDP_FANOUT_DISTRIBUTE ? 1 : c->nops;
    while (c_holds(c) && c->qn > 0 && c->ninflight < most) {
        int k = c_op_of(c, -1);
        int m = c_pop(c);
        c->op_msg[k] = m;
        c->ninflight++;
        /* may complete (c_send_cb) in here: pump is guarded against re-entry */
        tdp_pipe_send_async(c->pipe, c->fo->msgs[m].td, c->ops[k]);
    }
    if (c->state == C_LEAVING && c->qn == 0 && c->ninflight == 0) {
        c->state = C_CLOSING;
        tdp_pipe_close_async(c->pipe, c->fo->o.close_timeout_ms);
    }
}

/* ---- the producer ------------------------------------------------------------ */

static bool c_has(const fo_consumer *c, int m)
{
    if (c_op_of(c, m) >= 0)
        return true;
    for (uint32_t k = 0; k < c->qn; k++)
        if (c->q[(c->qh + k) % FO_MAX_DEPTH] == m)
            return true;
    return false;
}

/*
 * Drop-oldest: when some consumer that was there for the oldest message
 * is done with it, the others — those that fell a whole window behind it —
 * lose it: those that still queue it, and those whose send of it waits in
 * their pipe for credit (taken back whole). When every consumer still
 * holds it the producer waits: it runs at the pace of the fastest. A
 * consumer whose transport already has it keeps it; the slot frees when
 * that completes.
 */
static void drop_oldest(tdp_fanout *fo)
{
    int old = -1;
    for (uint32_t i = 0; i < fo->o.depth; i++)
        if (fo->msgs[i].live && (old < 0 || fo->msgs[i].seq < fo->msgs[old].seq))
            old = (int)i;
    if (old < 0)
        return;
    uint64_t seq = fo->msgs[old].seq;
    uint32_t there = 0, holding = 0;
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        const fo_consumer *c = &fo->cons[i];
        if (!c_holds(c) || c->st.first_seq == 0 || c->st.first_seq > seq)
            continue;
        there++;
        holding += c_has(c, old);
    }
    if (holding == there)
        return;
    for (uint32_t i = 0; i < fo->o.max_consumers && fo->msgs[old].live; i++) {
        fo_consumer *c = &fo->cons[i];
        if (!c_holds(c))
            continue;
        if (c->qn > 0 && c->q[c->qh] == old) {
            c_pop(c);
            c->st.drops++;
            fo->st.drops++;
            msg_release(fo, old);
        } else {
            int k = c_op_of(c, old);
            if (k >= 0 && c->op_flag[k] == OPF_NONE &&
                tdp__session_send_waiting(c->pipe, c->ops[k])) {
                c->op_flag[k] = OPF_DROP;
                c->ops[k]->take_back(c->ops[k]); /* c_send_cb runs now and counts the drop */
            }
        }
    }
}

/*
 * Distribute: a consumer holding nothing, round robin; one whose pipe has
 * credit first, else (credit: false) any.
 */
static fo_consumer *pick_free(tdp_fanout *fo, bool credit)
{
    uint32_t n = fo->o.max_consumers;
    for (uint32_t k = 0; k < n; k++) {
        fo_consumer *c = &fo->cons[(fo->rr + k) % n];
        if (c->state == C_LIVE && c->qn == 0 && c->ninflight == 0 &&
            (!credit || tdp__session_send_credit(c->pipe))) {
            fo->rr = (fo->rr + k + 1) % n;
            return c;
        }
    }
    return NULL;
}

static fo_consumer *pick(tdp_fanout *fo)
{
    fo_consumer *c = pick_free(fo, true);
    return c != NULL ? c : pick_free(fo, false);
}

/*
 * Distribute: a message that waits in a pipe without credit moves to a
 * consumer whose pipe has some (taken back whole: no byte of it went), so
 * a consumer that stops receiving holds one message at most beyond its
 * credit, and only while nobody else is free.
 */
static void redistribute(tdp_fanout *fo)
{
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        int k = -1;
        for (uint32_t j = 0; j < c->nops && k < 0 && c_holds(c); j++)
            if (c->op_msg[j] >= 0 && c->op_flag[j] == OPF_NONE &&
                tdp__session_send_waiting(c->pipe, c->ops[j]))
                k = (int)j;
        if (k < 0)
            continue;
        fo_consumer *d = pick_free(fo, true);
        if (d == NULL) {
            fo->want_wake = true; /* a consumer's credit wakes us (c_credit_cb) */
            return;
        }
        int m = c->op_msg[k];
        fo->msgs[m].refs++; /* held across the take-back */
        c->op_flag[k] = OPF_MOVE;
        c->ops[k]->take_back(c->ops[k]); /* c_send_cb runs now */
        c_push(d, m);
        msg_release(fo, m);
        fo->st.moved++;
    }
}

/* ---- one copy on the shm plane ------------------------------------------------- */

/* A consumer whose link is in the group, other than c; NULL: none. */
static fo_consumer *shm_member(tdp_fanout *fo, const fo_consumer *c)
{
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *d = &fo->cons[i];
        if (d != c && d->shared && c_holds(d) && tdp__session_link(d->pipe) != NULL)
            return d;
    }
    return NULL;
}

/* Whether a consumer of the group has a link whose socket is not up yet. */
static bool shm_starting(tdp_fanout *fo)
{
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->shared && c_holds(c) && !tdp__shm_link_up(tdp__session_link(c->pipe)))
            return true;
    }
    return false;
}

/* A new consumer on the shm plane joins the group (or founds it). */
static void c_share(tdp_fanout *fo, fo_consumer *c)
{
    if (fo->o.mode != TDP_FANOUT_BROADCAST || tdp_pipe_plane(c->pipe) != TDP_PLANE_SHM ||
        tdp__session_link(c->pipe) == NULL)
        return;
    fo_consumer *d = shm_member(fo, c);
    tdp_err rc = d == NULL
                     ? TDP_OK
                     : tdp__shm_link_share(tdp__session_link(c->pipe), tdp__session_link(d->pipe));
    /* else it holds slots of its own (tried again when idle), the group is full, or its
     * peer granted a smaller window than the group's pools are sized for: copies */
    c->shared = rc == TDP_OK;
    if (c->shared) /* its sends keep to the group's window */
        tdp__session_keep_window(c->pipe, tdp__shm_link_peer_window(tdp__session_link(c->pipe)));
}

/* Consumers whose plane was not known when they joined, or whose link was busy then. */
static void share_late(tdp_fanout *fo)
{
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->state == C_LIVE && !c->shared && c->ninflight == 0 && c->qn == 0)
            c_share(fo, c);
    }
}

/*
 * What msgs[] holds for the producer's td: td itself when it is a loan of
 * the group already or no consumer is in the group, else a loan of the
 * group with td copied in. TDP_EAGAIN: no slot of the group is free yet.
 */
static tdp_err one_copy(tdp_fanout *fo, tdp_td *td, tdp_td **out)
{
    *out = NULL;
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (!c->shared || !c_holds(c))
            continue;
        tdp__link *l = tdp__session_link(c->pipe);
        if (tdp__shm_group_lent(l, td))
            break;
        tdp_td *loan;
        tdp_err rc = tdp__shm_group_loan(l, tdp_td_schema(td), &loan);
        if (rc == TDP_EAGAIN)
            return rc;
        if (rc != TDP_OK)
            continue; /* a failing link, or a device layout: another, or as it is */
        memcpy(tdp_td_data(loan), tdp_td_data(td), tdp_td_nbytes(td));
        *out = loan;
        return TDP_OK;
    }
    *out = tdp_td_ref(td);
    return TDP_OK;
}

/*
 * Drop-oldest: the group's slots are all held by consumers that lag while
 * a consumer that gets new messages could take more. The producer runs at
 * the pace of the fastest, so the group gets a fresh pool (the laggards
 * keep the slots they hold in the old one) and a loan of it for sc.
 * TDP_EAGAIN: every such consumer holds its window (wait for it).
 */
static tdp_err restock(tdp_fanout *fo, tdp_schema *sc, tdp_td **loan)
{
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (!c->shared || c->state != C_LIVE)
            continue;
        tdp__link *l = tdp__session_link(c->pipe);
        if (tdp__shm_group_restock(l, sc) == TDP_OK && tdp__shm_group_loan(l, sc, loan) == TDP_OK)
            return TDP_OK;
    }
    return TDP_EAGAIN;
}

static bool drop_for_slot(tdp_fanout *fo);

/*
 * one_copy, and with drop-oldest, when no slot of the group is free: the
 * oldest messages only laggards hold go, then a fresh pool if laggards
 * still hold every slot.
 */
static tdp_err one_copy_drop(tdp_fanout *fo, tdp_td *td, tdp_td **out)
{
    tdp_err rc = one_copy(fo, td, out);
    if (rc != TDP_EAGAIN || fo->o.slow != TDP_FANOUT_DROP_OLDEST)
        return rc;
    while (rc == TDP_EAGAIN && drop_for_slot(fo))
        rc = one_copy(fo, td, out);
    if (rc == TDP_EAGAIN && restock(fo, tdp_td_schema(td), out) == TDP_OK) {
        memcpy(tdp_td_data(*out), tdp_td_data(td), tdp_td_nbytes(td));
        rc = TDP_OK;
    }
    return rc;
}

typedef struct loan_call {
    tdp_fanout *fo;
    tdp_schema *sc;
    tdp_td **out;
    tdp_err rc;
} loan_call;

/* A loan of the group: TDP_EAGAIN none free, TDP_ENOENT no group. */
static tdp_err loan_any(tdp_fanout *fo, tdp_schema *sc, tdp_td **out)
{
    tdp_err rc = TDP_ENOENT;
    for (uint32_t i = 0; i < fo->o.max_consumers && rc != TDP_OK && rc != TDP_EAGAIN; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->shared && c_holds(c))
            rc = tdp__shm_group_loan(tdp__session_link(c->pipe), sc, out);
    }
    return rc;
}

static void loan_task(void *arg)
{
    loan_call *a = arg;
    tdp_fanout *fo = a->fo;
    a->rc = loan_any(fo, a->sc, a->out);
    if (a->rc == TDP_EAGAIN && fo->o.mode == TDP_FANOUT_BROADCAST &&
        fo->o.slow == TDP_FANOUT_DROP_OLDEST) {
        /* as a send would: laggards lose their oldest, or the group a fresh pool */
        while (a->rc == TDP_EAGAIN && drop_for_slot(fo))
            a->rc = loan_any(fo, a->sc, a->out);
        if (a->rc == TDP_EAGAIN)
            a->rc = restock(fo, a->sc, a->out);
    }
    if (a->rc != TDP_OK && a->rc != TDP_EAGAIN)
        a->rc = tdp_td_new(a->sc, a->out); /* no group: an ordinary buffer */
}

tdp_err tdp_fanout_loan(tdp_fanout *fo, tdp_schema *schema, tdp_td **out)
{
    if (fo == NULL || schema == NULL || out == NULL || tdp_loop_on_thread(fo->loop))
        return TDP_EINVAL;
    *out = NULL;
    loan_call a = {.fo = fo, .sc = schema, .out = out};
    tdp__call_on_loop(fo->loop, loan_task, &a);
    return a.rc;
}

/*
 * Drop-oldest: the group's slots are all held, some by messages that only
 * lagging consumers still wait for: the oldest of them goes, as when
 * msgs[] is full. Whether one went.
 */
static bool drop_for_slot(tdp_fanout *fo)
{
    uint32_t live = 0;
    for (uint32_t i = 0; i < fo->o.depth; i++)
        live += fo->msgs[i].live;
    drop_oldest(fo);
    uint32_t after = 0;
    for (uint32_t i = 0; i < fo->o.depth; i++)
        after += fo->msgs[i].live;
    return after < live;
}

/* Give waiting sends a slot and their consumers while there is room. */
static void admit(tdp_fanout *fo)
{
    while (fo->waitq.head != NULL) {
        if (fo->closing) {
            tdp__op_complete(tdp__opq_pop(&fo->waitq), fo->freeing ? TDP_ECANCELED : TDP_ECLOSED);
            continue;
        }
        bool bcast = fo->o.mode == TDP_FANOUT_BROADCAST;
        int m = msg_free_slot(fo);
        if (m < 0 && bcast && fo->o.slow == TDP_FANOUT_DROP_OLDEST) {
            drop_oldest(fo);
            m = msg_free_slot(fo);
        }
        if (m < 0)
            return;
        fo_consumer *one = NULL;
        if (!bcast && (one = pick(fo)) == NULL)
            return;
        share_late(fo);
        tdp_td *td = NULL;
        if (!bcast)
            td = tdp_td_ref(fo->waitq.head->td);
        else if (one_copy_drop(fo, fo->waitq.head->td, &td) != TDP_OK) {
            /* the group's slots are all held: a release (a consumer's
             * credit) wakes us; the group's links all ask to hear of one */
            fo->want_wake = true;
            if (shm_starting(fo)) {
                /* a link's socket is still coming up: nothing will be
                 * released to say when it is (once per consumer) */
                static const struct timeval again = {0, 1000};
                event_add(fo->wake_ev, &again);
            }
            return;
        }
        tdp_op *op = tdp__opq_pop(&fo->waitq);
        fo_msg *g = &fo->msgs[m];
        *g = (fo_msg){.td = td, .op = op, .seq = ++fo->next_seq, .live = true};
        op->seq = g->seq;
        if (one != NULL) {
            c_push(one, m);
        } else {
            for (uint32_t i = 0; i < fo->o.max_consumers; i++)
                if (fo->cons[i].state == C_LIVE)
                    c_push(&fo->cons[i], m);
        }
        if (g->refs == 0) {
            fo->st.unsent++;
            msg_finish(fo, m, TDP_OK);
        } else if (bcast && fo->o.slow == TDP_FANOUT_DROP_OLDEST) {
            /* queued is done: a lagging consumer must not hold the producer */
            g->op = NULL;
            fo->st.msgs++;
            fo->st.bytes += tdp_td_nbytes(g->td);
            tdp__op_complete(op, TDP_OK);
        }
    }
}

/* Move everything along; re-entered from completions, it loops instead. */
static void pump(tdp_fanout *fo)
{
    if (fo->pumping) {
        fo->again = true;
        return;
    }
    fo->pumping = true;
    do {
        fo->again = false;
        admit(fo);
        for (uint32_t i = 0; i < fo->o.max_consumers; i++)
            c_pump(&fo->cons[i]);
        if (fo->o.mode == TDP_FANOUT_DISTRIBUTE)
            redistribute(fo);
    } while (fo->again);
    fo->pumping = false;
}

static void send_start(void *arg)
{
    tdp_op *op = arg;
    tdp_fanout *fo = op->owner;
    tdp__opq_push(&fo->waitq, op);
    pump(fo);
}

/* A timed-out send: out of the queue, or let go of the slot it has. */
static void take_back(tdp_op *op)
{
    tdp_fanout *fo = op->owner;
    if (!tdp__opq_remove(&fo->waitq, op)) {
        bool found = false;
        for (uint32_t i = 0; i < fo->o.depth; i++) {
            if (fo->msgs[i].live && fo->msgs[i].op == op) {
                fo->msgs[i].op = NULL; /* the consumers go on with the slot's own reference */
                found = true;
            }
        }
        if (!found)
            return;
    }
    tdp__op_complete(op, TDP_ETIMEDOUT);
}

void tdp_fanout_send_async(tdp_fanout *fo, tdp_td *td, tdp_op *op)
{
    if (op == NULL)
        return;
    if (tdp__op_pending(op)) {
        tdp_log_error("tdp_fanout_send_async: op %p is still pending; ignored", (void *)op);
        return;
    }
    op->kind = OP_SEND;
    op->owner = fo;
    op->take_back = take_back;
    op->seq = 0;
    if (fo == NULL || td == NULL) {
        op->td = NULL;
        tdp__op_complete(op, TDP_EINVAL);
        return;
    }
    op->td = tdp_td_ref(td);
    tdp__op_submit(fo->loop, op, send_start);
}

tdp_err tdp_fanout_send(tdp_fanout *fo, tdp_td *td, int64_t timeout_ms)
{
    if (fo == NULL || td == NULL || tdp_loop_on_thread(fo->loop) || tdp__op_pending(fo->sync))
        return TDP_EINVAL;
    tdp_op *op = fo->sync;
    op->kind = OP_SEND;
    op->seq = 0;
    op->td = tdp_td_ref(td);
    return tdp__op_run(fo->loop, op, send_start, timeout_ms);
}

/* ---- making, joining, leaving ----------------------------------------------- */

tdp_err tdp_fanout_new(tdp_loop *loop, const tdp_fanout_opts *opts, tdp_fanout **out)
{
    tdp_fanout_opts o;
    tdp_fanout_opts_default(&o);
    if (opts != NULL) {
        size_t n = opts->size < sizeof(o) ? opts->size : sizeof(o);
        memcpy(&o, opts, n);
        o.size = sizeof(o);
        if (o.depth == 0)
            o.depth = 4;
        if (o.max_consumers == 0)
            o.max_consumers = 64;
        if (o.close_timeout_ms == 0)
            o.close_timeout_ms = 5000;
    }
    if (loop == NULL || out == NULL || o.depth > FO_MAX_DEPTH ||
        o.max_consumers > FO_MAX_CONSUMERS || (unsigned)o.mode > TDP_FANOUT_DISTRIBUTE ||
        (unsigned)o.slow > TDP_FANOUT_DROP_OLDEST)
        return TDP_EINVAL;
    tdp_fanout *fo = tdp__calloc(1, sizeof(*fo));
    if (fo == NULL)
        return TDP_ENOMEM;
    fo->loop = loop;
    fo->o = o;
    tdp__waiter_init(&fo->w);
    fo->cons = tdp__calloc(o.max_consumers, sizeof(*fo->cons));
    fo->reap_ev = event_new(tdp__loop_base(loop), -1, 0, reap_cb, fo);
    fo->wake_ev = event_new(tdp__loop_base(loop), -1, 0, wake_cb, fo);
    if (fo->cons == NULL || fo->reap_ev == NULL || fo->wake_ev == NULL ||
        tdp_op_new(NULL, NULL, &fo->sync) != TDP_OK)
        goto err_free;
    fo->sync->waiter = &fo->w;
    fo->sync->owner = fo;
    fo->sync->take_back = take_back;
    *out = fo;
    return TDP_OK;

err_free:
    if (fo->reap_ev != NULL)
        event_free(fo->reap_ev);
    if (fo->wake_ev != NULL)
        event_free(fo->wake_ev);
    tdp__free(fo->cons);
    tdp__waiter_fini(&fo->w);
    tdp__free(fo);
    return TDP_ENOMEM;
}

typedef struct add_call {
    tdp_fanout *fo;
    tdp_pipe *pipe;
    uint64_t id;
    tdp_err rc;
} add_call;

static void add_task(void *arg)
{
    add_call *a = arg;
    tdp_fanout *fo = a->fo;
    a->rc = TDP_ELIMIT;
    if (fo->closing) {
        a->rc = TDP_ECLOSED;
        return;
    }
    if (tdp_pipe_status(a->pipe) != TDP_OK) {
        a->rc = TDP_EINVAL;
        return;
    }
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->state != C_FREE)
            continue;
        for (uint32_t k = 0; k < fo->o.depth; k++) {
            c->ref[k] = (fo_opref){.c = c, .k = k};
            c->op_msg[k] = -1;
            if (tdp_op_new(c_send_cb, &c->ref[k], &c->ops[k]) != TDP_OK) {
                for (uint32_t j = 0; j < k; j++)
                    tdp_op_free(c->ops[j]);
                memset(c, 0, sizeof(*c));
                a->rc = TDP_ENOMEM;
                return;
            }
        }
        c->nops = fo->o.depth;
        c->fo = fo;
        c->pipe = a->pipe;
        c->id = ++fo->next_id;
        c->state = C_LIVE;
        c->st.id = c->id;
        c->st.plane = tdp_pipe_plane(a->pipe);
        tdp_pipe_peer(a->pipe, c->peer, sizeof(c->peer));
        fo->st.joined++;
        fo->st.consumers++;
        a->id = c->id;
        a->rc = TDP_OK;
        c_share(fo, c);
        tdp__session_set_credit_cb(a->pipe, c_credit_cb, c);
        tdp_pipe_set_end_cb(a->pipe, c_end_cb, c); /* an end that came before runs now */
        pump(fo);
        return;
    }
}

tdp_err tdp_fanout_add(tdp_fanout *fo, tdp_pipe *pipe, uint64_t *id)
{
    if (fo == NULL || pipe == NULL || tdp__session_loop(pipe) != fo->loop)
        return TDP_EINVAL;
    add_call a = {.fo = fo, .pipe = pipe};
    tdp__call_on_loop(fo->loop, add_task, &a);
    if (a.rc == TDP_OK && id != NULL)
        *id = a.id;
    return a.rc;
}

tdp_err tdp_fanout_connect(tdp_fanout *fo, const char *host, uint16_t port,
                           const tdp_pipe_opts *opts, uint64_t *id)
{
    if (fo == NULL)
        return TDP_EINVAL;
    tdp_pipe *p;
    tdp_err rc = tdp_pipe_connect(fo->loop, host, port, opts, &p);
    if (rc != TDP_OK)
        return rc;
    rc = tdp_fanout_add(fo, p, id);
    if (rc != TDP_OK)
        tdp_pipe_free(p);
    return rc;
}

static void refused_end_cb(tdp_pipe *pipe, tdp_err status, void *arg)
{
    (void)status;
    (void)arg;
    tdp_pipe_free(pipe);
}

static void on_accept(tdp_pipe *pipe, tdp_err status, void *arg)
{
    tdp_fanout *fo = arg;
    if (pipe == NULL) {
        tdp_log_debug("fanout: accept failed: %s", tdp_strerror(status));
        return;
    }
    add_call a = {.fo = fo, .pipe = pipe};
    add_task(&a);
    if (a.rc != TDP_OK) {
        /* not freed inside the callback that delivered it: when it has ended */
        fo->st.refused++;
        tdp_pipe_set_end_cb(pipe, refused_end_cb, NULL);
        tdp_pipe_abort(pipe, TDP_ELIMIT);
    }
}

tdp_err tdp_fanout_listen(tdp_fanout *fo, const char *bind_host, uint16_t port,
                          const tdp_listener_opts *opts, uint16_t *bound)
{
    if (fo == NULL || fo->listener != NULL || tdp_loop_on_thread(fo->loop))
        return TDP_EINVAL;
    tdp_listener *l;
    tdp_err rc = tdp_listener_new_opts(fo->loop, bind_host, port, opts, on_accept, fo, &l);
    if (rc != TDP_OK)
        return rc;
    fo->listener = l;
    if (bound != NULL)
        *bound = tdp_listener_port(l);
    return TDP_OK;
}

typedef struct remove_call {
    tdp_fanout *fo;
    uint64_t id;
    tdp_err rc;
} remove_call;

static void remove_task(void *arg)
{
    remove_call *r = arg;
    r->rc = TDP_EINVAL;
    for (uint32_t i = 0; i < r->fo->o.max_consumers; i++) {
        fo_consumer *c = &r->fo->cons[i];
        if (c->id == r->id && c->state != C_FREE) {
            if (c->state == C_LIVE)
                c->state = C_LEAVING;
            r->rc = TDP_OK;
            pump(r->fo);
            return;
        }
    }
}

tdp_err tdp_fanout_remove(tdp_fanout *fo, uint64_t id)
{
    if (fo == NULL || id == 0)
        return TDP_EINVAL;
    remove_call r = {.fo = fo, .id = id};
    tdp__call_on_loop(fo->loop, remove_task, &r);
    return r.rc;
}

/* ---- ending ------------------------------------------------------------------ */

static void close_task(void *arg)
{
    tdp_fanout *fo = arg;
    fo->closing = true;
    fo->close_timed_out = false;
    for (uint32_t i = 0; i < fo->o.max_consumers; i++)
        if (fo->cons[i].state == C_LIVE)
            fo->cons[i].state = C_LEAVING;
    pthread_mutex_lock(&fo->w.mtx);
    fo->gone = fo->st.consumers == 0;
    pthread_mutex_unlock(&fo->w.mtx);
    pump(fo);
}

static void abort_task(void *arg)
{
    tdp_fanout *fo = arg;
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->state != C_FREE && !c->ended)
            tdp_pipe_abort(c->pipe, TDP_ETIMEDOUT);
    }
}

static void stop_listener(tdp_fanout *fo)
{
    tdp_listener_free(fo->listener);
    fo->listener = NULL;
}

tdp_err tdp_fanout_close(tdp_fanout *fo, int64_t timeout_ms)
{
    if (fo == NULL || tdp_loop_on_thread(fo->loop))
        return TDP_EINVAL;
    stop_listener(fo);
    tdp__call_on_loop(fo->loop, close_task, fo);
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    pthread_mutex_lock(&fo->w.mtx);
    bool ok = tdp__loop_wait(fo->loop, &fo->w.mtx, &fo->w.cond, &fo->gone, deadline);
    bool late = ok && fo->close_timed_out; /* written before gone was */
    pthread_mutex_unlock(&fo->w.mtx);
    if (ok)
        return late ? TDP_ETIMEDOUT : TDP_OK;
    tdp__call_on_loop(fo->loop, abort_task, fo);
    return TDP_ETIMEDOUT;
}

static void free_task(void *arg)
{
    tdp_fanout *fo = arg;
    fo->closing = fo->freeing = true;
    admit(fo); /* waiting sends: TDP_ECANCELED */
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->state == C_FREE)
            continue;
        tdp_pipe_set_end_cb(c->pipe, NULL, NULL);
        tdp__session_set_credit_cb(c->pipe, NULL, NULL);
        c_fail(c, TDP_ECANCELED);
        tdp_pipe_free(c->pipe); /* a send in flight completes (c_send_cb) in here */
        c->pipe = NULL;
        c->ended = true;
        c_free(c);
    }
    for (uint32_t i = 0; i < fo->o.depth; i++)
        if (fo->msgs[i].live)
            msg_finish(fo, (int)i, TDP_ECANCELED);
    event_free(fo->reap_ev);
    event_free(fo->wake_ev);
}

void tdp_fanout_free(tdp_fanout *fo)
{
    if (fo == NULL)
        return;
    if (tdp_loop_on_thread(fo->loop)) {
        tdp_log_error("tdp_fanout_free: not from the loop thread; leaked");
        return;
    }
    stop_listener(fo);
    tdp__call_on_loop(fo->loop, free_task, fo);
    tdp_op_free(fo->sync);
    tdp__waiter_fini(&fo->w);
    tdp__free(fo->cons);
    tdp__free(fo);
}

/* ---- queries ----------------------------------------------------------------- */

typedef struct stats_call {
    tdp_fanout *fo;
    tdp_fanout_stats *st;
    tdp_fanout_peer_stats *peers;
    uint32_t max, n;
} stats_call;

static void stats_task(void *arg)
{
    stats_call *s = arg;
    tdp_fanout *fo = s->fo;
    if (s->st != NULL)
        *s->st = fo->st;
    for (uint32_t i = 0; i < fo->o.max_consumers; i++) {
        fo_consumer *c = &fo->cons[i];
        if (c->state == C_FREE || c->state == C_DEAD)
            continue;
        if (s->n < s->max) {
            tdp_fanout_peer_stats *p = &s->peers[s->n];
            *p = c->st;
            memcpy(p->peer, c->peer, sizeof(p->peer));
            p->queued = c->qn;
            p->status = TDP_OK;
            p->leaving = c->state != C_LIVE;
        }
        s->n++;
    }
}

uint32_t tdp_fanout_stats_get(tdp_fanout *fo, tdp_fanout_stats *st, tdp_fanout_peer_stats *peers,
                              uint32_t max)
{
    if (fo == NULL || (peers == NULL && max > 0))
        return 0;
    stats_call s = {.fo = fo, .st = st, .peers = peers, .max = max};
    tdp__call_on_loop(fo->loop, stats_task, &s);
    return s.n;
}
