/*
 * session.c: the top of the pipe's state machine — the public entry points
 * (sends, receives, close, abort, loans, free) and making a pipe for the
 * dialer and the listener. The state machine's parts lie below it
 * (session_int.h: hello, rx, tx, reconnect, base); together they call the
 * control channel (ctl.h) and the chosen data plane (plane.h, through its
 * ops table) and hear from them through callbacks; none makes a transport
 * call itself.
 *
 * Everything runs on the loop thread except the public entry points, which
 * hop to it (ops through op.c, the rest through tdp__call_on_loop).
 */
#include <inttypes.h>
#include <sodium.h>
#include <sys/random.h>
#include <string.h>
#include <time.h>

#include "session.h"
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

/* A timed-out op: take it back from wherever it is (loop thread). */
static void take_back(tdp_op *op)
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
    op->take_back = take_back;
    if (pipe == NULL || td == NULL) {
        op->td = NULL;
        tdp__op_complete(op, TDP_EINVAL);
        return;
    }
    op->td = tdp_td_ref(td);
    if (pipe->lat != NULL) /* set once when the pipe is made: any thread may read it */
        op->t_call_ns = tdp__pipe_lat_now_ns();
    tdp__op_submit(pipe->loop, op, tdp__pipe_send_start);
}

void tdp_pipe_recv_async(tdp_pipe *pipe, tdp_op *op)
{
    if (op == NULL || reject_busy(op, "tdp_pipe_recv_async"))
        return;
    op->kind = OP_RECV;
    op->td = NULL;
    op->owner = pipe;
    op->take_back = take_back;
    if (pipe == NULL) {
        tdp__op_complete(op, TDP_EINVAL);
        return;
    }
    tdp__op_submit(pipe->loop, op, tdp__pipe_recv_start);
}

static bool blocking_ok(tdp_pipe *p)
{
    /* a blocking call inside a loop callback would wait for itself */
    return !(tdp__loop_running(p->loop) && tdp_loop_on_thread(p->loop));
}

tdp_err tdp_pipe_send(tdp_pipe *pipe, tdp_td *td, int64_t timeout_ms)
{
    if (pipe == NULL || td == NULL || !blocking_ok(pipe) || tdp__op_pending(pipe->sync_send))
        return TDP_EINVAL;
    tdp_op *op = pipe->sync_send;
    op->kind = OP_SEND;
    op->td = tdp_td_ref(td);
    if (pipe->lat != NULL)
        op->t_call_ns = tdp__pipe_lat_now_ns();
    return tdp__op_run(pipe->loop, op, tdp__pipe_send_start, timeout_ms);
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
    tdp_err rc = tdp__op_run(pipe->loop, op, tdp__pipe_send_start, timeout_ms);
    op->prep = NULL;
    return rc;
}

tdp_err tdp_pipe_recv(tdp_pipe *pipe, int64_t timeout_ms, tdp_td **out)
{
    if (pipe == NULL || out == NULL || !blocking_ok(pipe) || tdp__op_pending(pipe->sync_recv))
        return TDP_EINVAL;
    tdp_op *op = pipe->sync_recv;
    op->kind = OP_RECV;
    op->td = NULL;
    tdp_err rc = tdp__op_run(pipe->loop, op, tdp__pipe_recv_start, timeout_ms);
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

typedef struct close_req {
    tdp_pipe *p;
    int64_t timeout_ms;
} close_req;

static void close_start(tdp_pipe *p, int64_t timeout_ms)
{
    if (p->state == PIPE_DEAD || p->close_requested)
        return;
    p->close_requested = true;
    p->close_deadline = timeout_ms >= 0 ? tdp__now_ms() + timeout_ms : -1;
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
    if (pipe == NULL || !blocking_ok(pipe))
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
    tdp_pipe *p = r->p;
    tdp_err why = (tdp_err)r->arg;
    bool dead = p->state == PIPE_DEAD;
    tdp__pipe_fail(p, why, "aborted");
    /* ended and waiting for the peer to hang up, or ended without a BYE to
     * deliver: nothing is left to wait for (a BYE with a reason is left to
     * reach the peer before its socket closes) */
    if (dead || why == TDP_ECONNRESET || why == TDP_ETIMEDOUT)
        tdp__pipe_hang_up(p);
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
    tdp__pipe_maybe_tell_end(p);
}

void tdp_pipe_set_end_cb(tdp_pipe *pipe, tdp_pipe_end_cb cb, void *arg)
{
    if (pipe == NULL)
        return;
    void *a[3] = {pipe, (void *)(uintptr_t)cb, arg};
    tdp__call_on_loop(pipe->loop, set_end_task, a);
}

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

tdp_pipe *tdp__session_new(tdp_loop *loop, const tdp_pipe_opts *opts, const tdp_schema_limits *lim,
                           tdp_err *err)
{
    tdp_pipe *p = tdp__calloc(1, sizeof(*p));
    *err = TDP_ENOMEM;
    if (p == NULL)
        return NULL;
    static const tdp__pipe_hooks hooks = {
        .reconnect = tdp__pipe_begin_reconnect,
        .deliver = tdp__pipe_deliver,
    };
    p->loop = loop;
    p->hooks = &hooks;
    p->opts = *opts;
    p->limits = *lim;
    if (opts->secret != NULL) {
        /* a copy: the caller's bytes may go once the pipe is made */
        if (opts->secret_len < TDP_SECRET_MIN || opts->secret_len > TDP_SECRET_MAX ||
            sodium_init() < 0) {
            *err = opts->secret_len < TDP_SECRET_MIN || opts->secret_len > TDP_SECRET_MAX
                       ? TDP_EINVAL
                       : TDP_EINTERNAL;
            tdp__free(p);
            return NULL;
        }
        memcpy(p->secret, opts->secret, opts->secret_len);
        p->secret_len = opts->secret_len;
    }
    p->opts.secret = p->secret_len > 0 ? p->secret : NULL;
    p->opts.secret_len = p->secret_len;
    p->depth = p->opts.recv_depth;
    p->lent1 = -1;
    p->status = TDP_OK;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        p->slots[i].pipe = p;
    p->rel_task = (tdp__task){.fn = tdp__pipe_release_task, .arg = p};
    tdp__waiter_init(&p->w);
    tdp__pipe_ctl_setup(p);
    p->timer = evtimer_new(tdp__loop_base(loop), tdp__pipe_linger_cb, p);
    p->credit_idle = (tdp__idle){.fn = tdp__pipe_credit_idle, .arg = p};
    if (p->opts.latency_stats)
        p->lat = tdp__alloc_array(TDP_LAT_RECV_WAIT + 1, sizeof(*p->lat));
    if (p->timer == NULL || (p->opts.latency_stats && p->lat == NULL) ||
        tdp_op_new(NULL, NULL, &p->sync_send) != TDP_OK ||
        tdp_op_new(NULL, NULL, &p->sync_recv) != TDP_OK)
        goto err_free;
    p->sync_send->waiter = p->sync_recv->waiter = &p->w;
    p->sync_send->owner = p->sync_recv->owner = p;
    p->sync_send->take_back = p->sync_recv->take_back = take_back;

    p->retry_ev = evtimer_new(tdp__loop_base(loop), tdp__pipe_retry_cb, p);
    if (p->retry_ev == NULL || (*err = tdp__pipe_make_links(p)) != TDP_OK)
        goto err_free;
    return p;

err_free:
    tdp__session_destroy(p);
    return NULL;
}

static void ready_deadline(tdp_pipe *p)
{
    tdp__pipe_arm_timer(p, p->opts.connect_timeout_ms);
}

tdp_err tdp__session_dial(tdp_pipe *p, const struct sockaddr_storage *addrs, const socklen_t *lens,
                          int n, tdp_pipe_cb ready, void *arg)
{
    if (n <= 0 || n > TDP_CTL_MAX_ADDRS)
        return TDP_EINVAL;
    /* kept: a reconnecting pipe dials them again */
    memcpy(p->addrs, addrs, (size_t)n * sizeof(*addrs));
    memcpy(p->addrlens, lens, (size_t)n * sizeof(*lens));
    p->naddr = n;
    tdp_err rc = tdp__ctl_dial(&p->ctl, addrs, lens, n);
    if (rc != TDP_OK)
        return rc;
    p->ready_cb = ready;
    p->ready_arg = arg;
    ready_deadline(p);
    return TDP_OK;
}

tdp_err tdp__session_accept(tdp_pipe *p, evutil_socket_t fd, const struct sockaddr *sa,
                            tdp_pipe_cb ready, void *arg)
{
    tdp_err rc = tdp__ctl_accept(&p->ctl, fd, sa);
    if (rc != TDP_OK)
        return rc;
    p->ready_cb = ready;
    p->ready_arg = arg;
    ready_deadline(p);
    if (p->hello_hook == NULL || p->secret_len > 0)
        tdp__pipe_send_hello(p); /* a failure here is reported through ready */
    return TDP_OK;
}

void tdp__session_answer_hello(tdp_pipe *p, tdp__hello_hook fn, void *arg)
{
    p->hello_hook = fn;
    p->hello_hook_arg = arg;
}

const char *tdp__session_peer(const tdp_pipe *p)
{
    return p->ctl.peer_name;
}

void tdp__session_set_budget(tdp_pipe *p, struct tdp__budget *b)
{
    tdp__budget_unref(p->budget);
    p->budget = b != NULL ? tdp__budget_ref(b) : NULL;
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
    tdp__pipe_drain_ops(p);
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
