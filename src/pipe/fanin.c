/*
 * fanin.c: tdp_fanin — a listener whose accepted pipes are the producers
 * of one stream. As nng's pull0: one receive op posted per producer's
 * pipe; a producer whose op completed (a message, or its end) joins the
 * back of a ready list; the consumer's receives take from its front, and
 * the producer's next receive is posted as its item is handed out.
 *
 * Everything runs on the loop thread except the entry points, which hop
 * to it (tdp__op_submit, tdp__call_on_loop), tdp_fanin_release (the pipe's
 * own release is thread-safe; the count of lent messages is atomic) and
 * tdp_fanin_stats_get (atomics and the lock). A producer that has left is
 * freed from the reap event, a clean stack, never inside a callback of its
 * pipe's ops.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <tdpipe/fanin.h>

#include "budget.h"
#include "listener.h"
#include "op.h"
#include "session.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../core/loop_int.h"
#include "../core/sized.h"

#define DEFAULT_MAX_PRODUCERS 64u
#define DEFAULT_DEPTH         4u
/* depth 1 would let the next receive overwrite the message the consumer holds */
#define MIN_DEPTH 2u

typedef struct producer {
    tdp_fanin *f;
    uint64_t id;
    tdp_pipe *pipe;
    tdp_op *rop; /* the one receive posted on the pipe */
    char peer[64];
    tdp_fanin_kind kind; /* what it has ready, while on the ready list */
    tdp_err status;      /* LEAVE: why */
    bool left;           /* its LEAVE was delivered */
    bool have_hash;
    uint64_t hash;                /* schema hash of its last message */
    uint64_t left_at;             /* the consumer's receive count when its LEAVE went out */
    _Atomic uint32_t lent;        /* its messages the consumer holds */
    struct producer *prev, *next; /* every producer not yet freed */
    struct producer *rnext;       /* the ready list */
} producer;

struct tdp_fanin {
    tdp_loop *loop;
    tdp_listener *lis;
    tdp_fanin_opts opts;
    uint16_t port;
    producer *all;
    producer *rhead, *rtail; /* ready, in the order their items came */
    tdp__opq waiting;        /* the consumer's receives, in the order made */
    uint32_t nactive;        /* joined, not ended: what max_producers counts */
    uint32_t nleft;          /* left, not yet freed */
    uint64_t next_id;
    uint64_t nrecv; /* receives started (or taken at once) */
    bool dispatching;
    bool closing, freeing;
    struct event *reap;
    tdp_op *sync; /* tdp_fanin_recv's */
    tdp__waiter w;
    tdp__budget *budget;
    /* the application's listener hooks, when on_hello is wrapped */
    tdp_err (*user_admit)(const tdp_accept_info *info, void *arg);
    tdp_err (*user_on_hello)(const tdp_accept_info *info, tdp_pipe_opts *opts, void *arg);
    void *user_hook_arg;
    /*
     * lk: the ready list, the waiting receives, the counts and the
     * producers' item state, which a blocking receive on another thread
     * takes from directly while the loop has a thread of its own.
     */
    pthread_mutex_t lk;
    tdp__task reap_task; /* such a receive asks the loop thread to reap */
    _Atomic bool reap_posted;
    pthread_mutex_t mtx; /* st */
    tdp_fanin_stats st;
    _Atomic uint64_t msgs, bytes;
};

#define STAT_ADD(f, field, v)                                                                      \
    do {                                                                                           \
        pthread_mutex_lock(&(f)->mtx);                                                             \
        (f)->st.field += (v);                                                                      \
        pthread_mutex_unlock(&(f)->mtx);                                                           \
    } while (0)

const char *tdp_fanin_kind_name(tdp_fanin_kind kind)
{
    switch (kind) {
    case TDP_FANIN_MSG:
        return "msg";
    case TDP_FANIN_JOIN:
        return "join";
    case TDP_FANIN_LEAVE:
        return "leave";
    }
    return NULL;
}

void tdp_fanin_opts_default(tdp_fanin_opts *o)
{
    if (o == NULL)
        return;
    memset(o, 0, sizeof(*o));
    o->size = sizeof(*o);
    tdp_listener_opts_default(&o->listener);
    o->listener.pipe.recv_depth = DEFAULT_DEPTH;
    o->max_producers = DEFAULT_MAX_PRODUCERS;
}

/* ---- the ready list and the consumer's receives ------------------------------ */

static void ready_push(tdp_fanin *f, producer *pr)
{
    pr->rnext = NULL;
    if (f->rtail != NULL)
        f->rtail->rnext = pr;
    else
        f->rhead = pr;
    f->rtail = pr;
}

static producer *ready_pop(tdp_fanin *f)
{
    producer *pr = f->rhead;
    if (pr != NULL) {
        f->rhead = pr->rnext;
        if (f->rhead == NULL)
            f->rtail = NULL;
        pr->rnext = NULL;
    }
    return pr;
}

static void rop_cb(tdp_op *op, void *arg);

/* The producer's next item: its pipe's next message, or how it ended. */
static void post_recv(producer *pr)
{
    tdp_pipe_recv_async(pr->pipe, pr->rop);
}

/*
 * Write pr's ready item into *m (lk held). True when its pipe's next
 * receive is to be posted, which the caller does once lk is let go (it may
 * complete at once, into rop_cb).
 */
static bool take_item(tdp_fanin *f, producer *pr, tdp_fanin_msg *m)
{
    m->kind = pr->kind;
    m->status = TDP_OK;
    m->producer = pr->id;
    m->seq = 0;
    m->td = NULL;
    m->new_schema = false;
    memcpy(m->peer, pr->peer, sizeof(m->peer));
    m->src = pr;
    switch (pr->kind) {
    case TDP_FANIN_JOIN:
        return true;
    case TDP_FANIN_MSG: {
        /* read before the next receive reuses the op */
        tdp_td *td = tdp_op_td(pr->rop);
        uint64_t h = tdp_schema_hash(tdp_td_schema(td));
        m->new_schema = !pr->have_hash || h != pr->hash;
        pr->hash = h;
        pr->have_hash = true;
        atomic_fetch_add_explicit(&pr->lent, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&f->msgs, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&f->bytes, tdp_td_nbytes(td), memory_order_relaxed);
        m->td = td;
        m->seq = tdp_op_seq(pr->rop);
        return true;
    }
    case TDP_FANIN_LEAVE:
        m->status = pr->status;
        pr->left = true;
        pr->left_at = f->nrecv;
        f->nleft++;
        return false;
    }
    return false;
}

/* The stream is over: closed, and every producer's LEAVE is out (lk held). */
static bool stream_over(const tdp_fanin *f)
{
    return f->closing && f->nactive == 0 && f->rhead == NULL;
}

/*
 * Hand ready items to waiting receives, oldest of each first (loop
 * thread). Re-entered from the completions it causes (a next receive that
 * completes at once, a callback that receives again): those only queue,
 * this loop serves them. lk is held for the lists, never across a
 * completion or a post.
 */
static void dispatch(tdp_fanin *f)
{
    if (f->dispatching)
        return;
    f->dispatching = true;
    for (;;) {
        pthread_mutex_lock(&f->lk);
        if (f->waiting.head == NULL || (f->rhead == NULL && !stream_over(f))) {
            pthread_mutex_unlock(&f->lk);
            break;
        }
        tdp_op *op = tdp__opq_pop(&f->waiting);
        producer *pr = ready_pop(f);
        if (pr == NULL) {
            pthread_mutex_unlock(&f->lk);
            tdp__op_complete(op, TDP_ECLOSED);
            continue;
        }
        bool again = take_item(f, pr, op->out);
        pthread_mutex_unlock(&f->lk);
        tdp_fanin_msg *m = op->out;
        op->td = m->td;
        op->seq = m->seq;
        if (again)
            post_recv(pr);
        tdp__op_complete(op, TDP_OK);
    }
    f->dispatching = false;
}

/* Producers whose LEAVE went out may be freed now: on the loop thread, on a clean stack. */
static void reap_soon(tdp_fanin *f)
{
    if (f->reap != NULL)
        event_active(f->reap, EV_READ, 0);
}

static void reap_task_fn(void *arg)
{
    tdp_fanin *f = arg;
    atomic_store(&f->reap_posted, false);
    reap_soon(f);
}

static void rop_cb(tdp_op *op, void *arg)
{
    producer *pr = arg;
    tdp_fanin *f = pr->f;
    if (f->freeing)
        return;
    tdp_err rc = tdp_op_result(op);
    if (rc == TDP_ECHECKSUM) {
        /* that message was dropped (the pipe counts it); its stream goes on */
        post_recv(pr);
        return;
    }
    if (rc != TDP_OK) {
        /* counted before the LEAVE can be received: the stats agree with the stream */
        pthread_mutex_lock(&f->mtx);
        f->st.producers_now--;
        if (rc != TDP_ECLOSED)
            f->st.producers_failed++;
        pthread_mutex_unlock(&f->mtx);
    }
    pthread_mutex_lock(&f->lk);
    if (rc == TDP_OK) {
        pr->kind = TDP_FANIN_MSG;
    } else {
        pr->kind = TDP_FANIN_LEAVE;
        pr->status = rc;
        f->nactive--;
    }
    ready_push(f, pr);
    pthread_mutex_unlock(&f->lk);
    if (rc != TDP_OK) {
        tdp_log_debug("fanin: producer %llu (%s) ended: %s", (unsigned long long)pr->id, pr->peer,
                      tdp_strerror(rc));
    }
    dispatch(f);
}

static void recv_start(void *arg)
{
    tdp_op *op = arg;
    tdp_fanin *f = op->owner;
    if (f->freeing) {
        tdp__op_complete(op, TDP_ECANCELED);
        return;
    }
    pthread_mutex_lock(&f->lk);
    f->nrecv++;
    bool reap = f->nleft > 0;
    tdp__opq_push(&f->waiting, op);
    pthread_mutex_unlock(&f->lk);
    if (reap)
        reap_soon(f); /* producers whose LEAVE went out before this receive */
    dispatch(f);
}

/* A timed-out receive: take it back (loop thread). */
static void take_back(tdp_op *op)
{
    tdp_fanin *f = op->owner;
    pthread_mutex_lock(&f->lk);
    bool mine = tdp__opq_remove(&f->waiting, op);
    pthread_mutex_unlock(&f->lk);
    if (mine)
        tdp__op_complete(op, TDP_ETIMEDOUT);
}

/* ---- producers ---------------------------------------------------------------- */

static void producer_free(tdp_fanin *f, producer *pr)
{
    if (pr->prev != NULL)
        pr->prev->next = pr->next;
    else
        f->all = pr->next;
    if (pr->next != NULL)
        pr->next->prev = pr->prev;
    tdp_pipe_free(pr->pipe); /* its pending receive, if any, completes into freeing */
    tdp_op_free(pr->rop);
    tdp__free(pr);
}

/*
 * Free the producers that have left, whose messages are all released and
 * whose LEAVE the consumer has had a receive since to read.
 */
static void reap_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    tdp_fanin *f = arg;
    producer *next;
    for (producer *pr = f->all; pr != NULL; pr = next) {
        next = pr->next;
        pthread_mutex_lock(&f->lk);
        bool done = pr->left && f->nrecv > pr->left_at &&
                    atomic_load_explicit(&pr->lent, memory_order_acquire) == 0;
        f->nleft -= done;
        pthread_mutex_unlock(&f->lk);
        if (done)
            producer_free(f, pr);
    }
}

static void refuse(tdp_fanin *f, tdp_pipe *p, const char *why)
{
    STAT_ADD(f, refused, 1);
    tdp_log_debug("fanin: refusing a producer: %s (%u producers)", why, f->nactive);
    tdp_pipe_abort(p, TDP_ELIMIT);
    tdp_pipe_free(p); /* safe inside its own callback: the memory goes later */
}

/* A handshake completed. Runs inside the pipe's HELLO handling: p must live on. */
static void on_accept(tdp_pipe *p, tdp_err status, void *arg)
{
    tdp_fanin *f = arg;
    if (status != TDP_OK || p == NULL)
        return;
    /* handshakes are not counted in max_producers: it may have filled meanwhile */
    if (f->closing || f->freeing || f->nactive >= f->opts.max_producers) {
        refuse(f, p, f->closing ? "closing" : "max producers");
        return;
    }
    producer *pr = tdp__calloc(1, sizeof(*pr));
    if (pr == NULL || tdp_op_new(rop_cb, pr, &pr->rop) != TDP_OK) {
        tdp__free(pr);
        refuse(f, p, "no memory");
        return;
    }
    pr->f = f;
    pr->pipe = p;
    pr->id = ++f->next_id;
    atomic_init(&pr->lent, 0);
    tdp_pipe_peer(p, pr->peer, sizeof(pr->peer));
    pr->next = f->all;
    if (f->all != NULL)
        f->all->prev = pr;
    f->all = pr;
    /* counted before the JOIN can be received: the stats agree with the stream */
    pthread_mutex_lock(&f->mtx);
    f->st.producers_now++;
    f->st.producers_total++;
    pthread_mutex_unlock(&f->mtx);
    pthread_mutex_lock(&f->lk);
    f->nactive++;
    pr->kind = TDP_FANIN_JOIN; /* its first receive is posted when the JOIN goes out */
    ready_push(f, pr);
    pthread_mutex_unlock(&f->lk);
    tdp_log_debug("fanin: producer %llu joined from %s", (unsigned long long)pr->id, pr->peer);
    dispatch(f);
}

/* ---- listener hooks ------------------------------------------------------------ */

static bool fi_admit(void *arg, uint32_t npending)
{
    tdp_fanin *f = arg;
    if (!f->closing && !f->freeing && f->nactive < f->opts.max_producers)
        return true;
    STAT_ADD(f, refused, 1);
    tdp_log_debug("fanin: refusing a producer: %s (%u producers, %u handshaking)",
                  f->closing ? "closing" : "max producers", f->nactive, npending);
    return false;
}

static void fi_refused(void *arg, tdp_err why)
{
    (void)why;
    tdp_fanin *f = arg;
    STAT_ADD(f, refused, 1);
}

static void fi_handshake_failed(void *arg, tdp_err why)
{
    (void)why;
    tdp_fanin *f = arg;
    STAT_ADD(f, handshakes_failed, 1);
}

static tdp_err user_admit(const tdp_accept_info *info, void *arg)
{
    tdp_fanin *f = arg;
    return f->user_admit(info, f->user_hook_arg);
}

/* The application's on_hello, then the fan-in's floor on the depth. */
static tdp_err user_on_hello(const tdp_accept_info *info, tdp_pipe_opts *opts, void *arg)
{
    tdp_fanin *f = arg;
    tdp_err rc = f->user_on_hello(info, opts, f->user_hook_arg);
    if (opts->recv_depth < MIN_DEPTH)
        opts->recv_depth = MIN_DEPTH;
    return rc;
}

/* ---- the fan-in ------------------------------------------------------------------ */

static void reap_new_task(void *arg)
{
    tdp_fanin *f = arg;
    f->reap = event_new(tdp__loop_base(f->loop), -1, 0, reap_cb, f);
}

/* Every producer goes now; pending receives end. Loop thread. */
static void free_task(void *arg)
{
    tdp_fanin *f = arg;
    pthread_mutex_lock(&f->lk);
    f->freeing = true;
    tdp__opq q = f->waiting;
    f->waiting = (tdp__opq){0};
    f->rhead = f->rtail = NULL;
    pthread_mutex_unlock(&f->lk);
    tdp_op *op;
    while ((op = tdp__opq_pop(&q)) != NULL)
        tdp__op_complete(op, TDP_ECANCELED);
    while (f->all != NULL)
        producer_free(f, f->all);
    f->rhead = f->rtail = NULL;
    if (f->reap != NULL)
        event_free(f->reap);
    f->reap = NULL;
    /* a reap a receive posted, not run yet (a loop stopped): the loop must
     * not run it once f is gone */
    tdp__loop_unpost_task(f->loop, &f->reap_task);
}

static void fanin_release(tdp_fanin *f)
{
    tdp_op_free(f->sync);
    tdp__waiter_fini(&f->w);
    pthread_mutex_destroy(&f->mtx);
    pthread_mutex_destroy(&f->lk);
    tdp__budget_unref(f->budget); /* pipes winding down hold their own references */
    tdp__free(f);
}

static uint64_t default_max_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0)
        return UINT64_MAX; /* unknown: no cap rather than a wrong one */
    return (uint64_t)pages * (uint64_t)page / 2;
}

/* The caller's options over the defaults, sized, with the depth's floor. */
static void opts_resolve(const tdp_fanin_opts *in, tdp_fanin_opts *out)
{
    tdp_fanin_opts_default(out);
    if (in != NULL && in->size != 0) {
        memcpy(out, in, in->size < sizeof(*out) ? in->size : sizeof(*out));
        out->size = sizeof(*out);
    }
    if (out->listener.size == 0)
        tdp_listener_opts_default(&out->listener);
    if (out->listener.pipe.size == 0) {
        tdp_pipe_opts_default(&out->listener.pipe);
        out->listener.pipe.recv_depth = DEFAULT_DEPTH;
    }
    if (out->listener.pipe.recv_depth == 0)
        out->listener.pipe.recv_depth = DEFAULT_DEPTH;
    if (out->listener.pipe.recv_depth < MIN_DEPTH)
        out->listener.pipe.recv_depth = MIN_DEPTH;
    if (out->max_producers == 0)
        out->max_producers = DEFAULT_MAX_PRODUCERS;
}

tdp_err tdp_fanin_new(tdp_loop *loop, const char *host, uint16_t port, const tdp_fanin_opts *opts,
                      tdp_fanin **out)
{
    if (loop == NULL || out == NULL)
        return TDP_EINVAL;
    tdp_fanin *f = tdp__calloc(1, sizeof(*f));
    if (f == NULL)
        return TDP_ENOMEM;
    f->loop = loop;
    opts_resolve(opts, &f->opts);
    pthread_mutex_init(&f->mtx, NULL);
    pthread_mutex_init(&f->lk, NULL);
    f->reap_task = (tdp__task){.fn = reap_task_fn, .arg = f};
    atomic_init(&f->reap_posted, false);
    tdp__waiter_init(&f->w);
    atomic_init(&f->msgs, 0);
    atomic_init(&f->bytes, 0);
    f->budget =
        tdp__budget_new(f->opts.max_memory != 0 ? f->opts.max_memory : default_max_memory());
    if (f->budget == NULL || tdp_op_new(NULL, NULL, &f->sync) != TDP_OK) {
        fanin_release(f);
        return TDP_ENOMEM;
    }
    f->sync->waiter = &f->w;
    f->sync->owner = f;
    f->sync->take_back = take_back;
    tdp__call_on_loop(loop, reap_new_task, f);
    if (f->reap == NULL) {
        fanin_release(f);
        return TDP_ENOMEM;
    }

    tdp_listener_opts lo = f->opts.listener;
    if (lo.on_hello != NULL) {
        /* wrapped: whatever the hook says, the depth keeps its floor */
        f->user_admit = lo.admit;
        f->user_on_hello = lo.on_hello;
        f->user_hook_arg = lo.hook_arg;
        lo.admit = lo.admit != NULL ? user_admit : NULL;
        lo.on_hello = user_on_hello;
        lo.hook_arg = f;
    }
    tdp__listener_hooks hooks = {
        .admit = fi_admit,
        .refused = fi_refused,
        .handshake_failed = fi_handshake_failed,
        .budget = f->budget,
        .arg = f,
    };
    tdp_err rc = tdp__listener_new(loop, host, port, &lo, on_accept, f, &hooks, &f->lis);
    if (rc != TDP_OK) {
        tdp__call_on_loop(loop, free_task, f);
        fanin_release(f);
        return rc;
    }
    f->opts.listener.pipe.limits = NULL; /* the listener copied them */
    f->opts.listener.pipe.secret = NULL;
    f->port = tdp_listener_port(f->lis);
    *out = f;
    return TDP_OK;
}

uint16_t tdp_fanin_port(const tdp_fanin *f)
{
    return f != NULL ? f->port : 0;
}

static bool reject_busy(tdp_op *op, const char *what)
{
    if (!tdp__op_pending(op))
        return false;
    tdp_log_error("%s: op %p is still pending; ignored", what, (void *)op);
    return true;
}

void tdp_fanin_recv_async(tdp_fanin *f, tdp_op *op, tdp_fanin_msg *out)
{
    if (op == NULL || reject_busy(op, "tdp_fanin_recv_async"))
        return;
    op->kind = OP_RECV;
    op->td = NULL;
    op->seq = 0;
    op->owner = f;
    op->out = out;
    op->take_back = take_back;
    if (f == NULL || out == NULL) {
        tdp__op_complete(op, TDP_EINVAL);
        return;
    }
    tdp__op_submit(f->loop, op, recv_start);
}

/*
 * A blocking receive while a loop thread runs the loop: an item already
 * ready is taken here, without a round trip through the loop thread (two
 * thread switches per message); the producer's next receive is posted to
 * it. TDP_EAGAIN: nothing ready, or receives queued before this one
 * (order), or the fan-in is going: the slow path decides.
 */
static tdp_err take_now(tdp_fanin *f, tdp_fanin_msg *out)
{
    pthread_mutex_lock(&f->lk);
    if (f->freeing || f->waiting.head != NULL || (f->rhead == NULL && !stream_over(f))) {
        pthread_mutex_unlock(&f->lk);
        return TDP_EAGAIN;
    }
    producer *pr = ready_pop(f);
    if (pr == NULL) {
        pthread_mutex_unlock(&f->lk);
        return TDP_ECLOSED;
    }
    f->nrecv++;
    bool reap = f->nleft > 0;
    bool again = take_item(f, pr, out);
    pthread_mutex_unlock(&f->lk);
    if (again)
        post_recv(pr); /* its op is idle until then: nobody else touches it */
    if (reap && !atomic_exchange(&f->reap_posted, true))
        tdp__loop_post_task(f->loop, &f->reap_task);
    return TDP_OK;
}

tdp_err tdp_fanin_recv(tdp_fanin *f, int64_t timeout_ms, tdp_fanin_msg *out)
{
    if (f == NULL || out == NULL || tdp__op_pending(f->sync) ||
        (tdp__loop_running(f->loop) && tdp_loop_on_thread(f->loop)))
        return TDP_EINVAL;
    if (tdp__loop_has_runner(f->loop)) {
        tdp_err rc = take_now(f, out);
        if (rc != TDP_EAGAIN)
            return rc;
    }
    tdp_op *op = f->sync;
    op->kind = OP_RECV;
    op->td = NULL;
    op->seq = 0;
    op->out = out;
    return tdp__op_run(f->loop, op, recv_start, timeout_ms);
}

void tdp_fanin_release(tdp_fanin *f, const tdp_fanin_msg *m)
{
    if (f == NULL || m == NULL || m->kind != TDP_FANIN_MSG || m->td == NULL || m->src == NULL)
        return;
    producer *pr = m->src;
    tdp_pipe_release(pr->pipe, m->td);
    /* the last thing done with pr: at 0 the loop thread may free it */
    atomic_fetch_sub_explicit(&pr->lent, 1, memory_order_release);
}

static void close_task(void *arg)
{
    tdp_fanin *f = arg;
    pthread_mutex_lock(&f->lk);
    f->closing = true;
    pthread_mutex_unlock(&f->lk);
    dispatch(f); /* receives waiting on an empty stream end now */
}

/* The listener, taken once: closes may race each other (any thread). */
static tdp_listener *take_listener(tdp_fanin *f)
{
    pthread_mutex_lock(&f->lk);
    tdp_listener *lis = f->lis;
    f->lis = NULL;
    pthread_mutex_unlock(&f->lk);
    return lis;
}

void tdp_fanin_close(tdp_fanin *f)
{
    if (f == NULL)
        return;
    tdp_listener_free(take_listener(f)); /* handshakes under way are dropped */
    tdp__call_on_loop(f->loop, close_task, f);
}

void tdp_fanin_free(tdp_fanin *f)
{
    if (f == NULL)
        return;
    if (tdp__loop_running(f->loop) && tdp_loop_on_thread(f->loop)) {
        tdp_log_error("tdp_fanin_free: called on the loop thread; the fan-in is leaked");
        return;
    }
    /* no more producers: handshakes under way are dropped */
    tdp_listener_free(take_listener(f));
    tdp__call_on_loop(f->loop, free_task, f);
    fanin_release(f);
}

void tdp_fanin_stats_get_sized(const tdp_fanin *f, tdp_fanin_stats *out, size_t size)
{
    if (f == NULL || out == NULL)
        return;
    tdp_fanin *m = (tdp_fanin *)f; /* the lock is not part of the value */
    tdp_fanin_stats st;
    pthread_mutex_lock(&m->mtx);
    st = m->st;
    pthread_mutex_unlock(&m->mtx);
    st.msgs = atomic_load_explicit(&m->msgs, memory_order_relaxed);
    st.bytes = atomic_load_explicit(&m->bytes, memory_order_relaxed);
    tdp__fill_sized(out, size, &st, sizeof(st));
}
