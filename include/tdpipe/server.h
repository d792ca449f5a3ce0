/*
 * server.h: one listener, many clients, each with its own pipe and schema
 * state, served by the application's handler (request -> reply on the same
 * pipe: the inference-server pattern). See docs/server.md.
 *
 * Every handler callback runs on the server's loop thread. A handler that
 * returns an error closes only its own client; the server counts it and
 * reports it through on_close. Limits protect the server: a client over
 * max_clients is refused (it sees TDP_ELIMIT), a client that connects and
 * never completes its handshake is dropped after handshake_timeout_ms, and
 * a client that sends garbage or a hostile schema is disconnected while the
 * others carry on.
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
    size_t size; /* sizeof(tdp_server_handler) */
    /* A client completed its handshake. Return non-OK to turn it away. */
    tdp_err (*on_connect)(tdp_client *c, void *arg);
    /*
     * A message arrived. td is lent for the duration of the call (copy what
     * must outlive it, or reply with it: tdp_client_send references it).
     * Return TDP_OK to go on receiving; anything else closes this client
     * (counted in handler_errors, reported to on_close).
     */
    tdp_err (*on_message)(tdp_client *c, tdp_td *td, void *arg);
    /* The client is gone: TDP_ECLOSED for a clean end, else why. Last call for c. */
    void (*on_close)(tdp_client *c, tdp_err status, void *arg);
} tdp_server_handler;

/* Options; set size = sizeof(tdp_server_opts). Zero fields take defaults. */
typedef struct tdp_server_opts {
    size_t size;
    tdp_pipe_opts pipe;           /* for every client's pipe (size 0: defaults) */
    uint32_t max_clients;         /* default 1024 */
    int64_t handshake_timeout_ms; /* default 5000 */
    uint32_t max_replies_queued;  /* per client, default 4; more gives TDP_EAGAIN */
} tdp_server_opts;

TDP_API void tdp_server_opts_default(tdp_server_opts *o);

/*
 * Listen on host:port (NULL: all addresses; port 0 picks a free one) and
 * serve. `h` is copied. *out written only on success.
 */
TDP_API tdp_err tdp_server_new(tdp_loop *loop, const char *host, uint16_t port,
                               const tdp_server_opts *opts, const tdp_server_handler *h,
                               void *arg, tdp_server **out);

TDP_API uint16_t tdp_server_port(const tdp_server *s);

/*
 * Graceful shutdown: stop accepting, let in-flight replies finish (up to
 * timeout_ms), then close every client cleanly (they see TDP_ECLOSED).
 * Returns TDP_ETIMEDOUT if replies were still pending at the deadline (those
 * clients are closed anyway). Not from the loop thread.
 */
TDP_API tdp_err tdp_server_shutdown(tdp_server *s, int64_t timeout_ms);

/* Shut down (if not yet, with a short deadline) and free. Not from the loop thread. */
TDP_API void tdp_server_free(tdp_server *s);

typedef struct tdp_server_stats {
    uint64_t clients_now, clients_total;
    uint64_t refused;           /* over max_clients or turned away by on_connect */
    uint64_t handshakes_failed; /* timed out, garbage, version mismatch */
    uint64_t handler_errors;    /* on_message returned an error */
    uint64_t client_errors;     /* clients that ended other than cleanly */
    uint64_t msgs_recv, msgs_sent, bytes_recv, bytes_sent, schemas_recv;
} tdp_server_stats;

/* Totals over all clients, past and present. Thread-safe. */
TDP_API void tdp_server_stats_get(const tdp_server *s, tdp_server_stats *out);

/* ---- clients (loop thread only, inside handler callbacks) ---------------- */

/* Reply (or push) td to this client; it is referenced until sent. */
TDP_API tdp_err tdp_client_send(tdp_client *c, tdp_td *td);
/* Close this client cleanly after its queued replies. */
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
