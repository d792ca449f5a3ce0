/*
 * fanin.h: many producers, one consumer, one stream (the data-loader
 * pattern: N worker processes feed one trainer).
 *
 * A fan-in listens like a server and accepts producers: each is an
 * ordinary peer that dials with tdp_pipe_connect and sends. Their
 * messages come out of one receive call, each saying which producer sent
 * it and its sequence number in that producer's stream. See docs/pipe.md,
 * "Fan-in", for the ordering, fairness, credit and failure rules.
 *
 * Ordering: one producer's messages come in the order it sent them; the
 * streams of different producers interleave.
 * Fairness: one receive is posted on each producer's pipe at a time; a
 * producer whose message has arrived joins the back of a ready list, and
 * receives take from its front (round robin over the producers that have a
 * message ready): a producer that floods waits its turn behind every other
 * producer with a message ready.
 * Credit: each producer's pipe keeps its own receive depth (at least 2).
 * A message stays lent until tdp_fanin_release; while the consumer holds
 * all of one producer's buffers, that producer waits for credit and the
 * others go on. Memory is bounded by producers x depth x message size, and
 * by max_memory.
 * Failure: a producer that ends cleanly or dies is an event in the stream
 * (TDP_FANIN_LEAVE, with TDP_ECLOSED or the error), after all the messages
 * it delivered; it never stops the others.
 *
 * Threading: a fan-in belongs to one tdp_loop; its callbacks run on the
 * loop's thread. tdp_fanin_recv_async, tdp_fanin_release, tdp_fanin_close
 * and tdp_fanin_stats_get may be called from any thread; tdp_fanin_recv
 * (one at a time) and tdp_fanin_free from any thread but the loop's, as
 * tdp_pipe_recv.
 *
 * Allocation: a producer's pipe and receive op are made when it joins;
 * receiving and releasing allocate nothing. On the shm plane a received
 * tensordict is the producer's own shared-memory slot: nothing is copied.
 */
#ifndef TDPIPE_FANIN_H
#define TDPIPE_FANIN_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>
#include <tdpipe/loop.h>
#include <tdpipe/pipe.h>
#include <tdpipe/td.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdp_fanin tdp_fanin;

/* What a receive delivered. */
typedef enum tdp_fanin_kind {
    TDP_FANIN_MSG = 0,   /* a message: td, seq */
    TDP_FANIN_JOIN = 1,  /* a producer completed its handshake; its messages follow */
    TDP_FANIN_LEAVE = 2, /* a producer is gone, after its last message: status says how */
} tdp_fanin_kind;

/* "msg", "join", "leave"; NULL for an unknown value. */
TDP_API const char *tdp_fanin_kind_name(tdp_fanin_kind kind);

/* One item of the stream, written by a receive. */
typedef struct tdp_fanin_msg {
    tdp_fanin_kind kind;
    /* LEAVE: TDP_ECLOSED for a clean end (the producer closed), else why
     * (TDP_ECONNRESET for a producer that died, TDP_EPROTO, TDP_ELIMIT...) */
    tdp_err status;
    uint64_t producer; /* unique within the fan-in, from 1, in the order producers joined */
    uint64_t seq;      /* MSG: its sequence number in the producer's stream (1 for the first) */
    /* MSG: lent until tdp_fanin_release (the producer's receive slot) */
    tdp_td *td;
    /* MSG: the producer's first message, or its schema changed since its last */
    bool new_schema;
    char peer[64]; /* the producer's address, "ip:port" ("[ip]:port" for IPv6) */
    void *src;     /* internal: the producer (tdp_fanin_release reads it) */
} tdp_fanin_msg;

/* Options; the struct can grow: set size = sizeof(tdp_fanin_opts). Zero = default. */
typedef struct tdp_fanin_opts {
    size_t size;
    /*
     * The listener: every producer's pipe options (listener.pipe: receive
     * depth per producer, default 4, at least 2; schema limits; a shared
     * secret; planes...), the handshake limits (max_pending,
     * max_per_source) and the admit / on_hello hooks, as for
     * tdp_listener_new_opts. listener.pipe.connect_timeout_ms is the
     * handshake deadline.
     */
    tdp_listener_opts listener;
    /*
     * Producers at once (handshakes under way not included); default 64.
     * One more is refused: its tdp_pipe_connect fails with TDP_ELIMIT.
     */
    uint32_t max_producers;
    /*
     * Receive storage of all producers together, bytes, as
     * tdp_server_opts.max_memory: a schema that would take the fan-in past
     * it ends that producer with TDP_ELIMIT (a LEAVE event). Default (0):
     * half of physical memory; UINT64_MAX: no cap.
     */
    uint64_t max_memory;
} tdp_fanin_opts;

/* Fill *o with the defaults (size, listener and listener.pipe included). */
TDP_API void tdp_fanin_opts_default(tdp_fanin_opts *o);

/*
 * Listen on host:port (NULL: all IPv4 and IPv6 addresses; port 0 picks one,
 * see tdp_fanin_port) and accept producers. opts is copied (NULL:
 * defaults). *out is written only on success. TDP_EINVAL, TDP_EADDR,
 * TDP_EUCX, TDP_ENOMEM as tdp_server_new.
 */
TDP_API tdp_err tdp_fanin_new(tdp_loop *loop, const char *host, uint16_t port,
                              const tdp_fanin_opts *opts, tdp_fanin **out);

/* The port actually bound. */
TDP_API uint16_t tdp_fanin_port(const tdp_fanin *f);

/*
 * Receive the next item of the stream into *out (which must live until the
 * op completes). The op completes with TDP_OK and *out written (also
 * tdp_op_td and tdp_op_seq for a message), TDP_ECLOSED once tdp_fanin_close
 * was called and every producer has left (their LEAVE events delivered),
 * TDP_ECANCELED when the fan-in is freed. Several receives may be pending:
 * they complete in the order they were made. Any thread; the callback runs
 * on the loop thread, possibly before this returns.
 */
TDP_API void tdp_fanin_recv_async(tdp_fanin *f, tdp_op *op, tdp_fanin_msg *out);

/*
 * Receive and wait (timeout_ms -1: forever): TDP_OK and *out, TDP_ETIMEDOUT,
 * TDP_ECLOSED as above. One blocking receive at a time; not from the loop
 * thread (TDP_EINVAL).
 */
TDP_API tdp_err tdp_fanin_recv(tdp_fanin *f, int64_t timeout_ms, tdp_fanin_msg *out);

/*
 * Give a message back to the pipe it came from (a credit for its producer).
 * Any thread; a JOIN or LEAVE item, or NULL, is a no-op. Every message must
 * be released once; a producer that has left is freed, with its pipe, at
 * the first receive after its LEAVE once all its messages are released.
 */
TDP_API void tdp_fanin_release(tdp_fanin *f, const tdp_fanin_msg *m);

/*
 * Stop accepting producers. Those connected stream on; once all of them
 * have left, receives end with TDP_ECLOSED. Any thread.
 */
TDP_API void tdp_fanin_close(tdp_fanin *f);

/*
 * Close every producer's pipe at once (they see TDP_ECONNRESET), complete
 * pending receives with TDP_ECANCELED and free. Tensordicts still lent go
 * with their pipes. Not from the loop thread. NULL is a no-op.
 */
TDP_API void tdp_fanin_free(tdp_fanin *f);

/* Totals; the struct can grow: tdp_fanin_stats_get passes sizeof(*out). */
typedef struct tdp_fanin_stats {
    uint64_t producers_now;     /* joined and not yet left */
    uint64_t producers_total;   /* joined */
    uint64_t producers_failed;  /* left with an error (not a clean end) */
    uint64_t refused;           /* over max_producers or max_per_source, or by the admit hook */
    uint64_t handshakes_failed; /* timed out, garbage, wrong secret or version */
    uint64_t msgs, bytes;       /* messages delivered, their payload bytes */
} tdp_fanin_stats;

/* Copy the totals into the first size bytes of out (any thread). */
TDP_API void tdp_fanin_stats_get_sized(const tdp_fanin *f, tdp_fanin_stats *out, size_t size);
#define tdp_fanin_stats_get(f, out) tdp_fanin_stats_get_sized((f), (out), sizeof(*(out)))

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_FANIN_H */
