/*
 * session.h (internal): how the dialer and the listener make pipes. The
 * pipe itself (struct tdp_pipe, the state machine) is private to
 * session.c.
 */
#ifndef TDP_PIPE_SESSION_H
#define TDP_PIPE_SESSION_H

#include <sys/socket.h>
#include <tdpipe/pipe.h>

#include "ctl.h"
#include "plane.h" /* TDP_MAX_DEPTH */

/* Defaults applied, limits copied into *lim (out->limits = NULL). */
void tdp__opts_resolve(const tdp_pipe_opts *in, tdp_pipe_opts *out, tdp_schema_limits *lim);

/* A new pipe, not yet connected. NULL: no memory or no transport (*err says). */
tdp_pipe *tdp__session_new(tdp_loop *loop, const tdp_pipe_opts *opts,
                           const tdp_schema_limits *lim, tdp_err *err);
/*
 * Start the handshake. ready(pipe, TDP_OK, arg) when the HELLO exchange is
 * done (the pipe is the callee's); ready(NULL, err, arg) when it failed
 * (the pipe is gone). Never before this returns. On an error return,
 * nothing is called and the pipe must be freed with tdp__session_destroy.
 */
tdp_err tdp__session_dial(tdp_pipe *p, const struct sockaddr_storage *addrs,
                          const socklen_t *lens, int n, tdp_pipe_cb ready, void *arg);
/* As dial, for an accepted socket (takes fd, also on failure). */
tdp_err tdp__session_accept(tdp_pipe *p, evutil_socket_t fd, const struct sockaddr *sa,
                            tdp_pipe_cb ready, void *arg);
/*
 * Accepting: wait for the peer's HELLO before sending ours, and when it is
 * in call fn with a copy of the pipe's options, of which recv_depth is
 * taken back (clamped to 1..TDP_MAX_DEPTH). TDP_OK goes on; an error
 * refuses the peer (BYE with that reason; ready gets it). Set before
 * tdp__session_accept.
 */
typedef tdp_err (*tdp__hello_hook)(void *arg, const tdp_hello *h, tdp_pipe_opts *opts);
void tdp__session_answer_hello(tdp_pipe *p, tdp__hello_hook fn, void *arg);
/* Free a pipe that never started, or drop a handshaking one without a ready call. */
void tdp__session_destroy(tdp_pipe *p);
const char *tdp__session_peer(const tdp_pipe *p);

/*
 * Charge this pipe's receive storage to b (a server's memory cap, which
 * outlives the pipe): a layout that would take b over its cap fails the
 * pipe with TDP_ELIMIT (BYE says so); all is given back when the pipe is
 * freed. The pipe holds a reference on b. Set before the handshake starts.
 */
struct tdp__budget;
void tdp__session_set_budget(tdp_pipe *p, struct tdp__budget *b);

/*
 * Loop thread: true while op, a send of p, still waits in the pipe's queue
 * (for credit, a ticket or the HELLO): no byte of it has gone, and
 * op->take_back takes it back whole. The fan-out drops such sends.
 */
struct tdp_op;
bool tdp__session_send_waiting(const tdp_pipe *p, const struct tdp_op *op);
/*
 * Loop thread: true when a send of p would go at once: the pipe is open,
 * nothing waits in its queue, and the peer has a free buffer (as far as
 * this side has heard). The fan-out's distribute mode picks by it.
 */
bool tdp__session_send_credit(const tdp_pipe *p);

/*
 * Loop thread: cb(arg) runs each time the peer gives p credit (on the shm
 * plane, each release; a slot of a shared pool group may be free again),
 * after p's own queue took what it could. NULL clears it. The fan-out
 * waits on it instead of polling.
 */
void tdp__session_set_credit_cb(tdp_pipe *p, void (*cb)(void *arg), void *arg);

/*
 * From now on, send to p's peer no more than a receive window of `window`
 * bytes allows (0: the peer's depth), when the peer granted more: a link
 * that joined a shm pool group keeps to the group's window. A larger one
 * is ignored: the peer's grant is the most.
 */
void tdp__session_keep_window(tdp_pipe *p, uint64_t window);

/* For tests: the chosen plane's link and its loop (NULL before the HELLO). */
struct tdp__link *tdp__session_link(const tdp_pipe *p);
tdp_loop *tdp__session_loop(const tdp_pipe *p);

#endif
