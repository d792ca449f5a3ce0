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

void tdp__op_complete(tdp_op *op, tdp_err rc)
{
    if (op->kind == OP_SEND && op->td != NULL) {
        tdp_td_unref(op->td);
        op->td = NULL;
    }
    op->result = rc;
    op->next = NULL;
    tdp__waiter *w = op->waiter;
    if (w != NULL) {
        pthread_mutex_lock(&w->mtx);
        atomic_store_explicit(&op->state, OP_DONE, memory_order_release);
        op->done = true;
        pthread_cond_broadcast(&w->cond);
        pthread_mutex_unlock(&w->mtx);
        return;
    }
    atomic_store_explicit(&op->state, OP_DONE, memory_order_release);
    if (op->cb != NULL)
        op->cb(op, op->arg);
}

void tdp__op_submit(tdp_loop *loop, tdp_op *op, tdp_loop_fn start)
{
    op->done = false;
    atomic_store_explicit(&op->state, OP_PENDING, memory_order_release);
    if (tdp_loop_on_thread(loop) || !tdp__loop_running(loop)) {
        start(op);
        return;
    }
    op->task = (tdp__task){.fn = start, .arg = op};
    tdp__loop_post_task(loop, &op->task);
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

static void op_cancel(void *arg)
{
    tdp_op *op = arg;
    if (tdp__op_pending(op) && op->take_back != NULL)
        op->take_back(op); /* completes it with TDP_ETIMEDOUT if it could */
    pthread_mutex_lock(&op->waiter->mtx);
    op->cancel_pending = false; /* the waiter may return: this task is done with op */
    pthread_cond_broadcast(&op->waiter->cond);
    pthread_mutex_unlock(&op->waiter->mtx);
}

tdp_err tdp__op_wait(tdp_loop *loop, tdp_op *op, int64_t timeout_ms)
{
    tdp__waiter *w = op->waiter;
    if (!tdp__loop_running(loop) || tdp_loop_on_thread(loop)) {
        if (tdp__loop_run_until(loop, &op->done, timeout_ms) != TDP_OK && !op->done)
            op_cancel(op);
        return op->result;
    }
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;
    bool canceled = false;
    pthread_mutex_lock(&w->mtx);
    while (!op->done || op->cancel_pending) {
        if (!tdp__cond_wait_until(&w->cond, &w->mtx, canceled ? -1 : deadline)) {
            canceled = true;
            op->cancel_pending = true;
            op->cancel_task = (tdp__task){.fn = op_cancel, .arg = op};
            tdp__loop_post_task(loop, &op->cancel_task);
        }
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
    /* the request lives on this stack, so fn may free the object it works on */
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
