/*
 * server.h: one listener, many clients, each with its own pipe and schema
 * state, served by the application's handler (request -> reply on the same
 * pipe: the inference-server pattern). See docs/server.md.
 *
 * Threading: every handler callback runs on the server's loop thread, and
 * the tdp_client_* calls are made there (inside the callbacks). The server
 * needs its loop to run: on a thread of its own (tdp_loop_start_thread) or
 * in tdp_loop_run. tdp_server_new, _shutdown and _free are called from any
 * other thread; tdp_server_stats_get from any thread.
 *
 * Isolation: a handler that returns an error closes only its own client;
 * the server counts it and reports it through on_close. Limits protect the
 * server (docs/server.md, "Limits"): handshakes under way and clients are
 * counted apart, so sockets that never complete a handshake cannot take the
 * clients' places. A socket over max_clients or over max_per_source is
 * refused before any handshake (its tdp_pipe_connect fails with
 * TDP_ELIMIT); one over max_pending makes room by dropping the oldest
 * handshake; a socket that never completes its handshake is dropped after
 * handshake_timeout_ms; a client from which nothing arrives and to which
 * nothing is sent for idle_timeout_ms is closed; a client that sends
 * garbage or a hostile schema is disconnected (it sees TDP_ECONNRESET)
 * while the others carry on.
 *
 * Allocation: a client's receive op and reply ops are allocated once, when
 * it connects; receiving, calling the handler and replying allocate nothing.
 */
#ifndef TDPIPE_SERVER_H
#define TDPIPE_SERVER_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>
#include <tdpipe/loop.h>
#include <tdpipe/pipe.h>
#include <tdpipe/td.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdp_server tdp_server;
typedef struct tdp_client tdp_client;

/* The application's handler; any callback may be NULL. The struct can grow. */
typedef struct tdp_server_handler {
    size_t size; /* sizeof(tdp_server_handler); 0 is refused (TDP_EINVAL) */
    /*
     * A client completed its handshake. It may set client data and push
     * messages (tdp_client_send). Return non-OK to turn it away: it is
     * counted in `refused`, its pipe ends with TDP_ELIMIT on its side, and
     * on_close still runs (with the value returned here), so whatever was
     * set up can be released in one place.
     */
    tdp_err (*on_connect)(tdp_client *c, void *arg);
    /*
     * A message arrived. td is lent for the duration of the call: copy what
     * must outlive it, or reply with it — tdp_client_send references it, and
     * this client's next receive waits until that reply is out, so its
     * buffer is not overwritten while being sent. Return TDP_OK to go on
     * receiving; anything else closes this client (counted in
     * handler_errors, reported to on_close; its peer sees TDP_ECONNRESET).
     */
    tdp_err (*on_message)(tdp_client *c, tdp_td *td, void *arg);
    /*
     * The client is gone: TDP_ECLOSED for a clean end (the client closed,
     * or the server closed it with tdp_client_close or a shutdown), else
     * why: the pipe's error (TDP_ECONNRESET, TDP_EPROTO, TDP_ESCHEMA...),
     * what on_message or on_connect returned, TDP_ETIMEDOUT when a close
     * could not finish in time. Runs once for every client on_connect saw;
     * the last call for c: c is invalid after it returns.
     */
    void (*on_close)(tdp_client *c, tdp_err status, void *arg);
} tdp_server_handler;

/* Options; set size = sizeof(tdp_server_opts). Zero fields take defaults. */
typedef struct tdp_server_opts {
    size_t size;
    /*
     * For every client's pipe (size 0: defaults): receive depth, schema
     * limits, keepalive... linger_ms also bounds how long a client that is
     * being closed may take to read its last replies and hang up.
     * connect_timeout_ms is replaced by handshake_timeout_ms.
     */
    tdp_pipe_opts pipe;
    /*
     * Clients at once (handshakes under way not included); default 1024.
     * A handshake that completes while the server is full is turned away
     * with TDP_ELIMIT.
     */
    uint32_t max_clients;
    /* A client must complete its HELLO within this, ms; default 5000. */
    int64_t handshake_timeout_ms;
    /*
     * Replies in flight per client; one more gives TDP_EAGAIN. Default (0):
     * 4, or the pipe's recv_depth when larger (so echoing every message of
     * a full receive ring never runs out).
     */
    uint32_t max_replies_queued;
    /*
     * Handshakes under way at once; default 256. One more drops the oldest
     * (counted in handshakes_failed): a good client's handshake takes a
     * round trip, a stranger's lasts until the deadline.
     */
    uint32_t max_pending;
    /*
     * Handshakes under way from one source (one IPv4 address, one IPv6
     * /64) at once; one more is refused with TDP_ELIMIT. Default 32;
     * UINT32_MAX: no limit. Clients that completed their handshake do not
     * count: many clients may share a host or a NAT.
     */
    uint32_t max_per_source;
    /*
     * A client with no message received and none sent for this long, ms, is
     * closed as by tdp_client_close (its peer sees TDP_ECLOSED; on_close
     * gets TDP_ETIMEDOUT; counted in idle_closed). Default 300000 (5 min); -1: never. Checked
     * at a quarter of this period: a client goes after 1 to 1.25 times it.
     */
    int64_t idle_timeout_ms;
    /*
     * Receive storage of all clients together, bytes: a client takes
     * recv_depth x its schema's total bytes (the largest so far) when its
     * schema arrives, and gives it back when it is gone. A schema that
     * would take the server past this cap is refused: that client's pipe
     * ends with TDP_ELIMIT on both sides (on_close gets it; its peer
     * hears it in the BYE), the others go on. Default (0): half of the
     * machine's physical memory; UINT64_MAX: no cap. The cap counts the
     * receive buffers the pipes hold, not replies or the handler's own
     * memory. docs/server.md#memory-cap.
     */
    uint64_t max_memory;
} tdp_server_opts;

/* Fill *o with the defaults (size and pipe.size included). */
TDP_API void tdp_server_opts_default(tdp_server_opts *o);

/*
 * Listen on host:port (NULL: all IPv4 and IPv6 addresses; port 0 picks a
 * free one, see tdp_server_port) and serve. `h` and `opts` are copied; `arg`
 * is passed to every callback. *out is written only on success. Errors:
 * TDP_EINVAL (no loop or out, h->size 0), TDP_EADDR (cannot resolve or
 * bind), TDP_EUCX (the loop's UCX workers cannot be created), TDP_ENOMEM.
 * Clients may connect at once: callbacks can start on the loop thread
 * before this returns.
 */
TDP_API tdp_err tdp_server_new(tdp_loop *loop, const char *host, uint16_t port,
                               const tdp_server_opts *opts, const tdp_server_handler *h, void *arg,
                               tdp_server **out);

/* The port actually bound. */
TDP_API uint16_t tdp_server_port(const tdp_server *s);

/*
 * Graceful shutdown: stop accepting (handshakes under way are dropped),
 * stop handing messages to on_message, let every client's queued replies go
 * out, then close each client cleanly — it receives those replies and then
 * TDP_ECLOSED — and wait (up to timeout_ms, -1: no limit) for the clients
 * to hang up. Clients left at the deadline are closed at once; the result is
 * TDP_ETIMEDOUT if any of them still had replies going out, else TDP_OK.
 * on_close has run for every client when this returns. A second call
 * returns the first one's result. Not from the loop thread (TDP_EINVAL).
 */
TDP_API tdp_err tdp_server_shutdown(tdp_server *s, int64_t timeout_ms);

/*
 * Shut down (if not yet, with a 1 s deadline) and free. Not from the loop
 * thread. Free the server before its loop. NULL is a no-op.
 */
TDP_API void tdp_server_free(tdp_server *s);

/*
 * Totals. The struct can grow (new fields go at the end):
 * tdp_server_stats_get is a macro that passes sizeof(*out) to
 * tdp_server_stats_get_sized, which writes no more than that many bytes.
 */
typedef struct tdp_server_stats {
    uint64_t clients_now;   /* clients holding a slot (connected or being closed) */
    uint64_t clients_total; /* clients accepted (on_connect said yes) */
    uint64_t refused;       /* over max_clients or max_per_source, or turned away by on_connect */
    uint64_t handshakes_failed; /* timed out, garbage, version mismatch, hung up early, evicted */
    uint64_t handler_errors;    /* on_message returned an error */
    uint64_t client_errors;     /* clients whose pipe failed (not a clean end) */
    /* payload messages and bytes over all clients' pipes, schemas received */
    uint64_t msgs_recv, msgs_sent, bytes_recv, bytes_sent, schemas_recv;
    uint64_t pending_now; /* handshakes under way */
    uint64_t idle_closed; /* clients closed by idle_timeout_ms */
    /* receive storage: bytes the clients hold now, the cap, schemas refused over it */
    uint64_t memory_used, memory_cap, memory_refused;
} tdp_server_stats;

/*
 * Totals over all clients, past and present, into the first `size` bytes
 * of out: size is the caller's sizeof(tdp_server_stats); bytes past what
 * this library knows are zeroed, none past size are written. Thread-safe.
 * A client's own counters: tdp_pipe_stats_get(tdp_client_pipe(c), ...) on
 * the loop thread.
 */
TDP_API void tdp_server_stats_get_sized(const tdp_server *s, tdp_server_stats *out, size_t size);
/*
 * The same with the caller's sizeof. Also an exported function of that
 * name (for callers built before the macro), which writes the struct as
 * it was then (the fields up to idle_closed).
 */
TDP_API void tdp_server_stats_get(const tdp_server *s, tdp_server_stats *out);
#define tdp_server_stats_get(s, out) tdp_server_stats_get_sized((s), (out), sizeof(*(out)))

/* ---- clients (loop thread only, inside handler callbacks) ---------------- */

/*
 * Reply (or push) td to this client; td is referenced until the send
 * completes, and must not be written meanwhile. Sends complete in order and
 * at most max_replies_queued are in flight, so a ring of
 * max_replies_queued + 1 reply buffers used in turn is never written while
 * in flight. Returns TDP_OK (queued; a failure later ends the client),
 * TDP_EAGAIN (all reply ops busy: nothing queued), TDP_ECLOSED (the client
 * is closing or gone), TDP_EINVAL (NULL, or not on the loop thread).
 */
TDP_API tdp_err tdp_client_send(tdp_client *c, tdp_td *td);
/*
 * Close this client cleanly after its queued replies: no more on_message;
 * the client receives what was queued, then TDP_ECLOSED; on_close follows.
 * A client that does not take its replies within the pipe's linger_ms is
 * closed anyway (on_close gets TDP_ETIMEDOUT).
 */
TDP_API void tdp_client_close(tdp_client *c);
/* The client's pipe: for its stats, peer address, schema. Do not free it. */
TDP_API tdp_pipe *tdp_client_pipe(tdp_client *c);
/* A number unique within the server, from 1. */
TDP_API uint64_t tdp_client_id(const tdp_client *c);
/* A pointer of the application's, NULL until set. */
TDP_API void tdp_client_set_data(tdp_client *c, void *data);
TDP_API void *tdp_client_get_data(const tdp_client *c);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_SERVER_H */
