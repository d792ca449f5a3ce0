/*
 * op.c: tdp_op — submit to the loop thread, complete, wait with a
 * deadline, take back. See op.h for the memory-ordering rule.
 */
#include <string.h>
#include <time.h>

#include "op.h"
#include "../core/alloc.h"
#include "../core/log.h"

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
    atomic_init(&op->state, OP_IDLE);
    tdp__waiter_init(&op->own);
    *out = op;
    return TDP_OK;
}

bool tdp__op_pending(const tdp_op *op)
{
    return atomic_load_explicit(&op->state, memory_order_acquire) == OP_PENDING;
}

void tdp_op_free(tdp_op *op)
{
    if (op == NULL)
        return;
    if (tdp__op_pending(op)) {
        tdp_log_error("tdp_op_free: op %p is still pending; not freed", (void *)op);
        return;
    }
    /* a completion on another thread may still be letting go of the mutex */
    pthread_mutex_lock(&op->own.mtx);
    pthread_mutex_unlock(&op->own.mtx);
    tdp__waiter_fini(&op->own);
    tdp__free(op);
}

tdp_err tdp_op_result(const tdp_op *op)
{
    if (op == NULL)
        return TDP_EINVAL;
    return tdp__op_pending(op) ? TDP_EAGAIN : op->result;
}

tdp_td *tdp_op_td(const tdp_op *op)
{
    if (op == NULL || atomic_load_explicit(&op->state, memory_order_acquire) != OP_DONE)
        return NULL;
    return op->kind == OP_RECV && op->result == TDP_OK ? op->td : NULL;
}

uint64_t tdp_op_seq(const tdp_op *op)
{
    if (op == NULL || atomic_load_explicit(&op->state, memory_order_acquire) != OP_DONE)
        return 0;
    return op->seq;
}

void tdp__waiter_init(tdp__waiter *w)
{
    pthread_mutex_init(&w->mtx, NULL);
    pthread_cond_init(&w->cond, NULL);
}

void tdp__waiter_fini(tdp__waiter *w)
{
    pthread_mutex_destroy(&w->mtx);
    pthread_cond_destroy(&w->cond);
}

/* The op a blocking call on this thread drives the loop for (tdp__op_run). */
static _Thread_local const tdp_op *tls_driving;

void tdp__op_complete(tdp_op *op, tdp_err rc)
{
    if (op->kind == OP_SEND && op->td != NULL) {
        tdp_td_unref(op->td);
        op->td = NULL;
    }
    op->result = rc;
    op->next = NULL;
    tdp__waiter *w = op->waiter;
    if (w != NULL && tls_driving == op) {
        /* its waiter is this very thread, inside tdp__op_run: nobody sleeps on it */
        atomic_store_explicit(&op->state, OP_DONE, memory_order_release);
        op->done = true;
        return;
    }
    if (w != NULL) {
        pthread_mutex_lock(&w->mtx);
        atomic_store_explicit(&op->state, OP_DONE, memory_order_release);
        op->done = true;
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->mtx);
        return;
    }
    /*
     * Under own.mtx: a waiter sees the state and wdone change together, and
     * once it (or tdp_op_free) has taken the mutex after this, nothing here
     * touches op again but the callback, read before.
     */
    tdp_op_cb cb = op->cb;
    void *arg = op->arg;
    pthread_mutex_lock(&op->own.mtx);
    atomic_store_explicit(&op->state, OP_DONE, memory_order_release);
    op->wdone = true;
    if (op->watched)
        pthread_cond_broadcast(&op->own.cond);
    pthread_mutex_unlock(&op->own.mtx);
    if (cb != NULL)
        cb(op, arg);
}

/* Another thread holds the loop: it starts the op from a posted task. */
static void post_start(tdp_loop *loop, tdp_op *op, tdp_loop_fn start)
{
    op->task = (tdp__task){.fn = start, .arg = op};
    tdp__loop_post_task(loop, &op->task);
}

void tdp__op_submit(tdp_loop *loop, tdp_op *op, tdp_loop_fn start)
{
    op->loop = loop;
    op->done = false;
    atomic_store_explicit(&op->state, OP_PENDING, memory_order_release);
    /* inline only while holding the loop: "nobody runs it" can change under us */
    if (!tdp__loop_run_inline(loop, start, op))
        post_start(loop, op, start);
}

tdp_err tdp__op_run(tdp_loop *loop, tdp_op *op, tdp_loop_fn start, int64_t timeout_ms)
{
    op->done = false;
    atomic_store_explicit(&op->state, OP_PENDING, memory_order_release);
    /*
     * The common case, an idle loop: start the op and drive the loop for it
     * under one hold, with no clock read when it completes at once (a send
     * the transport takes inline) and no wakeup to hand the result over.
     */
    tls_driving = op;
    tdp_err rc = tdp__loop_run_after(loop, start, op, &op->done, timeout_ms);
    tls_driving = NULL;
    if (rc == TDP_EINVAL) {
        post_start(loop, op, start); /* and wait for the holder to run it */
        return tdp__op_wait(loop, op, timeout_ms);
    }
    /* completed by this thread while it held the loop: nobody else writes it now */
    if (op->done)
        return op->result;
    /* the deadline passed (or the loop failed): take it back, as a waiter would */
    return tdp__op_wait(loop, op, timeout_ms < 0 ? -1 : 0);
}

/* ---- queues -------------------------------------------------------------------- */

void tdp__opq_push(tdp__opq *q, tdp_op *op)
{
    op->next = NULL;
    if (q->tail != NULL)
        q->tail->next = op;
    else
        q->head = op;
    q->tail = op;
}

tdp_op *tdp__opq_pop(tdp__opq *q)
{
    tdp_op *op = q->head;
    if (op != NULL) {
        q->head = op->next;
        if (q->head == NULL)
            q->tail = NULL;
        op->next = NULL;
    }
    return op;
}

bool tdp__opq_remove(tdp__opq *q, tdp_op *op)
{
    tdp_op *prev = NULL;
    for (tdp_op *o = q->head; o != NULL; prev = o, o = o->next) {
        if (o != op)
            continue;
        if (prev != NULL)
            prev->next = o->next;
        else
            q->head = o->next;
        if (q->tail == o)
            q->tail = prev;
        o->next = NULL;
        return true;
    }
    return false;
}

/* ---- waiting --------------------------------------------------------------------- */

int64_t tdp__now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
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

/* Slices of sleep while another thread holds the loop (see tdp__loop_wait). */
#define WAIT_SLICE_DRIVER_MS 1
#define WAIT_SLICE_RUNNER_MS 100

bool tdp__loop_wait(tdp_loop *loop, pthread_mutex_t *mtx, pthread_cond_t *cond, volatile bool *done,
                    int64_t deadline_ms)
{
    while (!*done) {
        int64_t now = tdp__now_ms();
        if (deadline_ms >= 0 && now >= deadline_ms)
            return false;
        if (!tdp__loop_running(loop)) {
            /* nobody runs it: drive it here (TDP_EINVAL if another thread took
             * it first: then go round and sleep instead) */
            pthread_mutex_unlock(mtx);
            tdp__loop_run_until(loop, done, deadline_ms < 0 ? -1 : deadline_ms - now);
            pthread_mutex_lock(mtx);
            continue;
        }
        /*
         * Someone else holds it. A blocking call driving it lets go when its
         * own call is done, so look again soon and take over; a loop thread
         * runs until stopped, so only a stop is looked for, rarely.
         */
        int64_t slice = tdp__loop_has_runner(loop) ? WAIT_SLICE_RUNNER_MS : WAIT_SLICE_DRIVER_MS;
        int64_t until = now + slice;
        if (deadline_ms >= 0 && deadline_ms < until)
            until = deadline_ms;
        tdp__cond_wait_until(cond, mtx, until);
    }
    return true;
}

static void op_cancel(void *arg)
{
    tdp_op *op = arg;
    if (tdp__op_pending(op) && op->take_back != NULL)
        op->take_back(op); /* completes it with TDP_ETIMEDOUT if it could */
    pthread_mutex_lock(&op->waiter->mtx);
    op->cancel_done = true; /* the waiter may return: this task is done with op */
    pthread_cond_broadcast(&op->waiter->cond);
    pthread_mutex_unlock(&op->waiter->mtx);
}

tdp_err tdp__op_wait(tdp_loop *loop, tdp_op *op, int64_t timeout_ms)
{
    tdp__waiter *w = op->waiter;
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    pthread_mutex_lock(&w->mtx);
    if (!tdp__loop_wait(loop, &w->mtx, &w->cond, &op->done, deadline)) {
        /* the deadline: take the op back on the loop thread, and wait for that */
        op->cancel_done = false;
        pthread_mutex_unlock(&w->mtx);
        if (!tdp__loop_run_inline(loop, op_cancel, op)) {
            op->cancel_task = (tdp__task){.fn = op_cancel, .arg = op};
            tdp__loop_post_task(loop, &op->cancel_task);
        }
        pthread_mutex_lock(&w->mtx);
        tdp__loop_wait(loop, &w->mtx, &w->cond, &op->cancel_done, -1);
    }
    tdp_err rc = op->result;
    pthread_mutex_unlock(&w->mtx);
    return rc;
}

/* ---- run on the loop thread and wait ---------------------------------------------- */

typedef struct loop_call {
    tdp__task task;
    tdp_loop_fn fn;
    void *arg;
    volatile bool done; /* under mtx */
    pthread_mutex_t mtx;
    pthread_cond_t cond;
} loop_call;

static void loop_call_run(void *arg)
{
    loop_call *c = arg;
    c->fn(c->arg);
    pthread_mutex_lock(&c->mtx);
    c->done = true;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->mtx);
}

void tdp__call_on_loop(tdp_loop *loop, tdp_loop_fn fn, void *arg)
{
    if (tdp__loop_run_inline(loop, fn, arg))
        return;
    /* the request lives on this stack, so fn may free the object it works on */
    loop_call c = {.task = {.fn = loop_call_run}, .fn = fn, .arg = arg};
    c.task.arg = &c;
    pthread_mutex_init(&c.mtx, NULL);
    pthread_cond_init(&c.cond, NULL);
    tdp__loop_post_task(loop, &c.task);
    pthread_mutex_lock(&c.mtx);
    tdp__loop_wait(loop, &c.mtx, &c.cond, &c.done, -1);
    pthread_mutex_unlock(&c.mtx);
    pthread_mutex_destroy(&c.mtx);
    pthread_cond_destroy(&c.cond);
}

tdp_err tdp_op_wait(tdp_op *op, int64_t timeout_ms)
{
    if (op == NULL || op->waiter != NULL)
        return TDP_EINVAL; /* a blocking call's own op waits inside that call */
    int st = atomic_load(&op->state);
    if (st == OP_DONE)
        return op->result;
    tdp_loop *loop = op->loop;
    if (st == OP_IDLE || loop == NULL)
        return TDP_EINVAL; /* never started */
    if (tdp__loop_running(loop) && tdp_loop_on_thread(loop))
        return TDP_EINVAL; /* it would wait for itself */
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    pthread_mutex_lock(&op->own.mtx);
    tdp_err rc = TDP_OK;
    if (atomic_load_explicit(&op->state, memory_order_acquire) != OP_DONE) {
        /* the next completion sets it (under the mutex), whenever it comes */
        op->wdone = false;
        op->watched = true;
        bool ok = tdp__loop_wait(loop, &op->own.mtx, &op->own.cond, &op->wdone, deadline);
        op->watched = false;
        rc = ok ? TDP_OK : TDP_ETIMEDOUT;
    }
    /* done, or started again by its callback meanwhile */
    bool done = atomic_load_explicit(&op->state, memory_order_acquire) == OP_DONE;
    if (rc == TDP_OK)
        rc = done ? op->result : TDP_EAGAIN;
    pthread_mutex_unlock(&op->own.mtx);
    return rc;
}
