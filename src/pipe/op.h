/*
 * op.h (internal): tdp_op — one send or receive at a time, reusable; how
 * it hops to the loop thread, completes, and how blocking calls wait for
 * it. It knows nothing of pipes: the session hands it the functions that
 * start and take back an operation.
 *
 * Threading: state is atomic. The loop thread writes result, td and seq,
 * then publishes with a release store of state = DONE; readers on any
 * thread load state with acquire before reading them (tdp_op_result,
 * tdp_op_td, tdp_op_seq).
 */
#ifndef TDP_PIPE_OP_H
#define TDP_PIPE_OP_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <tdpipe/pipe.h>

#include "../core/loop_int.h"

enum op_kind { OP_NONE, OP_SEND, OP_RECV };
enum op_state { OP_IDLE = 0, OP_PENDING = 1, OP_DONE = 2 };

/* Where blocking callers sleep (one per pipe). */
typedef struct tdp__waiter {
    pthread_mutex_t mtx;
    pthread_cond_t cond;
} tdp__waiter;

struct tdp_op {
    tdp_op_cb cb;
    void *arg;
    tdp__task task; /* hop to the loop thread without allocating */
    enum op_kind kind;
    void *owner; /* the pipe */
    tdp_td *td;
    tdp_err result;
    uint64_t seq;
    _Atomic int state; /* enum op_state */
    bool waited;       /* counted once in credit_waits */
    uint64_t t_call_ns; /* latency_stats: when the send was called (session.c, tdp__pipe_lat_now_ns) */
    struct tdp_op *next;
    /* blocking wrappers: completion wakes the waiter instead of calling cb */
    tdp__waiter *waiter;
    volatile bool done; /* set under waiter->mtx by the loop's holder */
    tdp__task cancel_task;
    volatile bool cancel_done;     /* a timed-out op taken back; as done */
    void (*take_back)(tdp_op *op); /* session: remove from its queues (loop thread) */
    void *out;                     /* fan-in: the tdp_fanin_msg a receive writes */
    tdp_schema *prep; /* a send op with no td: tdp_pipe_prepare of this layout (caller's ref) */
    /* tdp_op_wait: the loop the op was last started on, and its own waiter */
    tdp_loop *loop;
    tdp__waiter own;
    bool watched;        /* under own.mtx: a tdp_op_wait sleeps on own.cond */
    volatile bool wdone; /* under own.mtx: set by each completion, cleared by tdp_op_wait */
};

void tdp__waiter_init(tdp__waiter *w);
void tdp__waiter_fini(tdp__waiter *w);

bool tdp__op_pending(const tdp_op *op);
/*
 * Mark op pending and run start(op) on the loop thread: inline when this
 * is the loop thread or nobody runs the loop, else as a posted task.
 */
void tdp__op_submit(tdp_loop *loop, tdp_op *op, tdp_loop_fn start);
/* Loop thread: finish op with rc (drops a send's td reference) and tell its owner. */
void tdp__op_complete(tdp_op *op, tdp_err rc);
/*
 * Wait for a blocking op (tdp__loop_wait). A deadline takes the op back
 * (op->take_back) and completes it with TDP_ETIMEDOUT.
 */
tdp_err tdp__op_wait(tdp_loop *loop, tdp_op *op, int64_t timeout_ms);

/*
 * Submit a blocking op and wait for it (tdp__op_submit then tdp__op_wait,
 * in one hold of the loop when nobody else holds it). Not from the loop
 * thread.
 */
tdp_err tdp__op_run(tdp_loop *loop, tdp_op *op, tdp_loop_fn start, int64_t timeout_ms);

/*
 * Wait, with mtx held, until *done (set under mtx by the loop's holder,
 * which then signals cond) or until deadline_ms on the tdp__now_ms clock
 * (-1: none); false at the deadline. Someone must progress the loop
 * meanwhile: on a loop nobody holds, this thread drives it; while another
 * blocking call drives it, this one sleeps in short slices and takes over
 * when that call is done; while a loop thread runs it, this one sleeps
 * (and takes over if the loop is stopped). Not from the loop thread.
 */
bool tdp__loop_wait(tdp_loop *loop, pthread_mutex_t *mtx, pthread_cond_t *cond, volatile bool *done,
                    int64_t deadline_ms);

/* Intrusive FIFO of ops. */
typedef struct tdp__opq {
    tdp_op *head, *tail;
} tdp__opq;
void tdp__opq_push(tdp__opq *q, tdp_op *op);
tdp_op *tdp__opq_pop(tdp__opq *q);
bool tdp__opq_remove(tdp__opq *q, tdp_op *op);

/*
 * Run fn(arg) on the loop thread and wait (inline on the loop thread or,
 * holding it, on an idle loop).
 */
void tdp__call_on_loop(tdp_loop *loop, tdp_loop_fn fn, void *arg);
int64_t tdp__now_ms(void);
/*
 * Wait on cond (mtx held) until signalled or until deadline_ms on the
 * tdp__now_ms clock (-1: no deadline). False, without waiting, once the
 * deadline has passed; spurious wakeups return true: callers loop.
 */
bool tdp__cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mtx, int64_t deadline_ms);

#endif
