/*
 * fanout.h: one producer, many consumers — a set of pipes fed as one
 * stream.
 *
 * A tdp_fanout sends each tensordict to the consumers it holds, in one of
 * two modes: broadcast (every consumer gets every message; one that joins
 * late starts at the next message) or distribute (each message goes to
 * one consumer that is free). Consumers are ordinary pipes on the
 * fan-out's loop, dialed (tdp_fanout_connect), accepted (tdp_fanout_listen)
 * or handed over (tdp_fanout_add); they join and leave at any time, and a
 * consumer that fails leaves without stopping the others. On each
 * consumer's pipe the messages keep the order they were sent in; in
 * broadcast mode every consumer sees the same order. See docs/pipe.md,
 * "Fan-out".
 *
 * Buffers: the fan-out takes a reference on each tensordict sent and the
 * same buffer goes to every consumer (no copy by the fan-out; each pipe's
 * data plane moves it as for one pipe). A send completes when every
 * consumer it went to has completed its own send of it (or dropped it):
 * then the buffer may be written again.
 *
 * Slow consumers: at most `depth` messages are in flight. With
 * TDP_FANOUT_BLOCK (the default) a send waits while every slot is held,
 * so every consumer gets everything at the pace of the slowest. With
 * TDP_FANOUT_DROP_OLDEST (broadcast) the consumers a whole window behind
 * the fastest lose their oldest message (counted in their drops) and the
 * producer goes at the pace of the fastest; a send then completes as soon
 * as it is queued, so send a fresh tensordict each time (a loan or
 * tdp_td_new): writing one just sent changes what lagging consumers get.
 *
 * Threading: the fan-out belongs to one tdp_loop; its state lives on the
 * loop thread. The async send, add, remove and queries may be called from
 * any thread; the blocking calls from any thread but the loop's, as for a
 * pipe (they drive the loop when nobody runs it). Zero allocations per
 * message: the message slots and each consumer's queue are made when the
 * fan-out or the consumer is.
 */
#ifndef TDPIPE_FANOUT_H
#define TDPIPE_FANOUT_H

#include <tdpipe/pipe.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdp_fanout tdp_fanout;

typedef enum tdp_fanout_mode {
    TDP_FANOUT_BROADCAST = 0,  /* every consumer gets every message */
    TDP_FANOUT_DISTRIBUTE = 1, /* each message goes to one free consumer */
} tdp_fanout_mode;

typedef enum tdp_fanout_slow {
    TDP_FANOUT_BLOCK = 0,       /* the producer waits for the slowest consumer */
    TDP_FANOUT_DROP_OLDEST = 1, /* a consumer that lags loses its oldest messages */
} tdp_fanout_slow;

/* Options; the struct can grow: set size = sizeof(tdp_fanout_opts). Zero = default. */
typedef struct tdp_fanout_opts {
    size_t size;
    tdp_fanout_mode mode;
    tdp_fanout_slow slow;
    /* Messages in flight at once, 1..64 (default 4): each consumer's high-water mark. */
    uint32_t depth;
    /* Consumers at once, 1..1024 (default 64); one more is refused (TDP_ELIMIT). */
    uint32_t max_consumers;
    /* How long a leaving consumer's pipe may take to close, ms (default 5000). */
    int64_t close_timeout_ms;
} tdp_fanout_opts;

/* Fill *o with the defaults (size included). */
TDP_API void tdp_fanout_opts_default(tdp_fanout_opts *o);

/*
 * Make a fan-out on loop (opts NULL: defaults). *out written only on
 * success. TDP_EINVAL for options out of range, TDP_ENOMEM.
 */
TDP_API tdp_err tdp_fanout_new(tdp_loop *loop, const tdp_fanout_opts *opts, tdp_fanout **out);

/*
 * Hand an open pipe on the fan-out's loop over as a consumer (broadcast:
 * it gets the messages sent from now on). On success the fan-out owns the
 * pipe (do not use or free it; it is freed when the consumer leaves) and
 * *id names the consumer (never 0, never reused). On failure the caller
 * keeps it. TDP_EINVAL (NULL, a pipe of another loop, a pipe that has
 * ended), TDP_ELIMIT (max_consumers), TDP_ENOMEM.
 */
TDP_API tdp_err tdp_fanout_add(tdp_fanout *fo, tdp_pipe *pipe, uint64_t *id);

/* Dial host:port (tdp_pipe_connect) and add the pipe; blocking. */
TDP_API tdp_err tdp_fanout_connect(tdp_fanout *fo, const char *host, uint16_t port,
                                   const tdp_pipe_opts *opts, uint64_t *id);

/*
 * Accept consumers on bind_host:port (tdp_listener_new_opts; port 0 picks
 * one, *bound gets it): every pipe accepted joins the fan-out. One
 * listener per fan-out (TDP_EINVAL for a second); it stops with
 * tdp_fanout_close / tdp_fanout_free. Consumers beyond max_consumers are
 * closed as they come (counted in tdp_fanout_stats.refused).
 */
TDP_API tdp_err tdp_fanout_listen(tdp_fanout *fo, const char *bind_host, uint16_t port,
                                  const tdp_listener_opts *opts, uint16_t *bound);

/*
 * Let consumer id leave cleanly: it gets no new message, sends what it
 * holds, then its pipe closes (its peer sees TDP_ECLOSED) and is freed.
 * Returns at once; TDP_EINVAL for an unknown id.
 */
TDP_API tdp_err tdp_fanout_remove(tdp_fanout *fo, uint64_t id);

/* ---- sending ------------------------------------------------------------- */

/*
 * Send td to the consumers (broadcast) or to one of them (distribute),
 * referencing it until every consumer is done with it; op completes as
 * described at the top (TDP_OK), with TDP_ECLOSED after tdp_fanout_close,
 * or TDP_ECANCELED when the fan-out is freed; a consumer that fails does
 * not fail the send (it leaves). Broadcast with no consumer completes at
 * once with TDP_OK (counted in tdp_fanout_stats.unsent); distribute waits
 * for a consumer. In broadcast mode sends complete in order; in
 * distribute mode each consumer's do. tdp_op_seq(op) is the fan-out's
 * sequence number (1 for the first).
 */
TDP_API void tdp_fanout_send_async(tdp_fanout *fo, tdp_td *td, tdp_op *op);

/*
 * A tensordict of layout schema to fill and send (any thread but the
 * loop's): in broadcast mode with consumers on the shm plane, a slot of
 * the pool their links share, which tdp_fanout_send then gives every one
 * of them without a copy; else an ordinary buffer. TDP_EAGAIN: every slot
 * is held by a consumer now; try again shortly. Send it once.
 */
TDP_API tdp_err tdp_fanout_loan(tdp_fanout *fo, tdp_schema *schema, tdp_td **out);

/*
 * Send and wait (timeout_ms -1: forever). One blocking send at a time. A
 * send that times out after consumers took it goes on to them (the
 * fan-out keeps its own reference on td).
 */
TDP_API tdp_err tdp_fanout_send(tdp_fanout *fo, tdp_td *td, int64_t timeout_ms);

/*
 * Clean close: no new sends (they complete with TDP_ECLOSED), every
 * consumer finishes what it holds and closes, the listener stops. Waits
 * up to timeout_ms (-1: no limit) for the consumers to be gone; whatever
 * the consumers do — still receiving, closed or freed their pipe before —
 * it returns: TDP_OK once every one is gone cleanly; TDP_ETIMEDOUT if some
 * are not gone by then (their pipes are then aborted and leave soon after)
 * or one had to be ended by close_timeout_ms (its peer neither closed nor
 * hung up).
 */
TDP_API tdp_err tdp_fanout_close(tdp_fanout *fo, int64_t timeout_ms);

/*
 * Abort every consumer still there, complete pending sends with
 * TDP_ECANCELED, free. Not from the loop thread or a callback. NULL is a
 * no-op.
 */
TDP_API void tdp_fanout_free(tdp_fanout *fo);

/* ---- queries ------------------------------------------------------------- */

/* A consumer's figures; the struct can grow (new fields at the end). */
typedef struct tdp_fanout_peer_stats {
    uint64_t id;
    char peer[64];       /* tdp_pipe_peer */
    uint64_t msgs_sent;  /* completed sends of this consumer's pipe */
    uint64_t bytes_sent; /* their payload bytes */
    uint64_t drops;      /* messages taken away from it (TDP_FANOUT_DROP_OLDEST) */
    uint64_t first_seq;  /* the fan-out sequence number of the first message it was given */
    uint64_t moved;      /* distribute: messages that waited for its credit and went to another */
    uint32_t queued;     /* messages it holds and has not sent */
    tdp_err status;      /* TDP_OK while it is there, else why it left */
    bool leaving;        /* removed or closing; still sending what it holds */
    tdp_plane plane;     /* its pipe's data plane */
} tdp_fanout_peer_stats;

/* The fan-out's figures. */
typedef struct tdp_fanout_stats {
    uint64_t msgs;      /* sends completed */
    uint64_t bytes;     /* their payload bytes (once per message, whatever the consumers) */
    uint64_t unsent;    /* of them, broadcast to nobody */
    uint64_t drops;     /* messages dropped, all consumers */
    uint64_t joined;    /* consumers that joined */
    uint64_t left;      /* consumers gone (removed, closed or failed) */
    uint64_t failed;    /* of them, those that failed (peer died, ...) */
    uint64_t refused;   /* accepted beyond max_consumers, closed at once */
    uint64_t moved;     /* distribute: messages moved from a consumer without credit */
    uint32_t consumers; /* there now */
} tdp_fanout_stats;

/*
 * The fan-out's figures (st may be NULL), and up to max of its consumers'
 * (peers may be NULL when max is 0); consumers that left are not listed.
 * Returns how many consumers there are (may be more than max). Any thread,
 * the loop thread included.
 */
TDP_API uint32_t tdp_fanout_stats_get(tdp_fanout *fo, tdp_fanout_stats *st,
                                      tdp_fanout_peer_stats *peers, uint32_t max);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_FANOUT_H */
