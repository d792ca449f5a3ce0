/*
 * pipe.h: a pipe streams consolidated tensordicts between two peers.
 *
 * One side listens, the other connects, by IP (v4 or v6) or host name and
 * port. Each direction sends its schema once (and again after every change,
 * detected by hash); every other message carries only the raw buffer, which
 * lands in place in storage the receiver allocated once. See docs/pipe.md
 * for the guide and docs/wire-format.md for the bytes.
 *
 * Threading: every pipe belongs to one tdp_loop and all its callbacks run on
 * that loop's thread. The async calls (tdp_pipe_send_async,
 * tdp_pipe_recv_async), tdp_pipe_release, tdp_pipe_close_async,
 * tdp_pipe_abort, tdp_pipe_loan and the queries may be made from any
 * thread. The blocking calls may be made from any thread except the loop
 * thread: when the loop runs on a thread of its own they wait for it; when
 * nobody runs the loop they drive it on the calling thread until done —
 * from several threads at once too: one drives, the others wait, and one of
 * them takes over when the driver's call is done. An op's result, tensordict
 * and sequence number are published to every thread when tdp_op_result
 * stops returning TDP_EAGAIN.
 *
 * Errors: TDP_ECLOSED is a clean end (the peer closed after its last
 * message), TDP_ECONNRESET a peer that died or vanished, TDP_ETIMEDOUT a
 * deadline that passed, TDP_EPROTO / TDP_ESCHEMA / TDP_EMISMATCH a peer that
 * sent something invalid (the pipe is then closed), TDP_EVERSION a peer that
 * speaks another protocol version.
 */
#ifndef TDPIPE_PIPE_H
#define TDPIPE_PIPE_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>
#include <tdpipe/loop.h>
#include <tdpipe/schema.h>
#include <tdpipe/stats.h>
#include <tdpipe/td.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdp_pipe tdp_pipe;
typedef struct tdp_listener tdp_listener;
typedef struct tdp_op tdp_op;

/* Wire protocol version this library speaks. */
#define TDP_PROTOCOL_VERSION 2

/*
 * How a peer's death is detected, and which of the loop's two UCX workers a
 * pipe uses; both sides compute the same choice. See docs/pipe.md.
 */
/*
 * Data planes: what carries the payload once the HELLO is done. Both sides
 * list what they allow; the HELLO picks one both have (docs/planes.md).
 */
typedef enum tdp_plane {
    TDP_PLANE_AUTO = 0, /* options: let the HELLO choose */
    TDP_PLANE_UCX = 1,  /* UCX active messages, rendezvous into registered buffers; any peer */
    TDP_PLANE_SHM = 2,  /* same host: a shared-memory slot pool owned by the sender; zero copy */
    /* same host, GPU payloads: a device slot pool owned by the sender, mapped
     * once by the receiver; offered only by a pipe that names its GPU
     * (cuda_device); host payloads go as on shm */
    TDP_PLANE_CUDA_IPC = 3,
    /* any peer, host memory: frames and payloads on the pipe's own TCP
     * connection, received in place; chosen only when asked for */
    TDP_PLANE_TCP = 5,
} tdp_plane;

/* "ucx", "shm", "cuda-ipc", "tcp" ("auto" for TDP_PLANE_AUTO); NULL for an unknown value. */
TDP_API const char *tdp_plane_name(tdp_plane plane);
/* TDP_OK and *out set for a known name (case-sensitive), else TDP_EINVAL. */
TDP_API tdp_err tdp_plane_parse(const char *name, tdp_plane *out);

typedef enum tdp_peer_mode {
    /*
     * The default. A peer on this host: the loop's shared-memory worker
     * (posix/sysv) without UCX's peer-failure mode; death is seen on the
     * control socket. Other peers: the general worker in UCX's
     * peer-failure mode (and the socket).
     */
    TDP_PEER_AUTO = 0,
    TDP_PEER_UCX = 1,    /* always the general worker in UCX's peer-failure mode */
    /*
     * Always the general worker without UCX's peer-failure mode: fastest
     * across hosts, but UCX 1.13 then keeps TCP endpoints' sockets open
     * until the loop is freed — for short-lived tools, not servers.
     */
    TDP_PEER_SOCKET = 2,
} tdp_peer_mode;

/* Options; the struct can grow: set size = sizeof(tdp_pipe_opts). Zero = default. */
typedef struct tdp_pipe_opts {
    size_t size;
    /*
     * Receive buffers this side holds (1..64, default 1). 1 is the reference
     * behaviour: each receive overwrites the last, the buffer is lent until
     * the next receive. N > 1: a ring; each receive lends one buffer until
     * tdp_pipe_release. The sender never has more in flight than this, or
     * than recv_window_bytes lets a small layout have (on by default: a
     * small layout then gets a ring even at depth 1; window 0 for the
     * reference behaviour with every layout).
     */
    uint32_t recv_depth;
    /* Where received buffers live; default: the sender's device. */
    bool recv_device_set;
    tdp_device recv_device;
    /* Limits on the schemas a peer may send (NULL: defaults). Copied. */
    const tdp_schema_limits *limits;
    /* Connect / handshake deadline, ms (default 10000). */
    int64_t connect_timeout_ms;
    /*
     * After a clean BYE, how long to wait for messages still in flight
     * when nothing of them arrives, ms (default 5000): each DATA frame or
     * part of a payload that lands starts the wait again, so a slow link
     * still delivers everything, and a peer that sends nothing more ends
     * the pipe (TDP_ECONNRESET) this long after the last it sent.
     */
    int64_t linger_ms;
    tdp_peer_mode peer_mode;
    /*
     * Dead-link detection across hosts: TCP keepalive idle/interval seconds
     * and probe count on the control socket, and TCP_USER_TIMEOUT set to
     * idle + intvl x cnt. Default 5, 1, 15: a host that stops answering ends
     * the pipe (TDP_ECONNRESET) within 20 s of its last answer, idle or not,
     * and a link down for less than 10 s is ridden out. A process that dies
     * on a live host is seen at once (its socket closes). See docs/pipe.md.
     */
    int keepalive_idle_s, keepalive_intvl_s, keepalive_cnt;
    /*
     * Force one data plane, or let both sides' preferences choose
     * (TDP_PLANE_AUTO, the default). When the peer does not allow it or
     * cannot use it (shm across hosts), the HELLO fails with TDP_ENOTSUP
     * on both sides.
     */
    tdp_plane plane;
    /* Planes this side refuses: bit (1u << TDP_PLANE_x). */
    uint32_t planes_forbidden;
    /*
     * Shared secret (NULL: none): both sides must hold the same bytes, or
     * the handshake ends with TDP_EAUTH on both. TDP_SECRET_MIN..MAX bytes,
     * copied when the pipe or listener is made. It authenticates the peer
     * and the HELLO exchange (HMAC-SHA256 over both HELLOs, nonces
     * included) before any plane is started; it does not encrypt anything
     * (docs/security.md).
     */
    const void *secret;
    size_t secret_len;
    /*
     * Reconnect (a dialed pipe only; 0: off). When the peer fails, closes
     * or cannot be reached, the pipe dials the same address again, backing
     * off from 50 ms to 1 s, until a peer answers or reconnect_ms passed
     * (then it ends with the error that started the outage). Meanwhile
     * sends wait (each bounded by its own timeout); sends the old link held
     * end with TDP_ECONNRESET (they may or may not have arrived); sequence
     * numbers go on, so the new peer's first message says what it missed
     * (tdp_pipe_stats.resumed_from); the schema is sent again. Also waits
     * for a peer that is not there yet: the first connect retries a
     * refused connection until connect_timeout_ms (connect_wait_ms, when
     * set, instead). docs/pipe.md#reconnect.
     */
    int64_t reconnect_ms;
    /*
     * Dialing: the receive depth (1..64) this side asks the listening side
     * to hold for this pipe; 0 (the default): no wish. It travels in the
     * HELLO (a record older peers skip). A listener follows it only when
     * its tdp_listener_opts.on_hello hook says so; the peer's choice is
     * tdp_pipe_stats.peer_depth.
     */
    uint32_t want_peer_depth;
    /*
     * Keep latency histograms (default off; tdp_pipe_latency_get). Costs
     * two clock reads per message and about 30 KB per pipe, allocated
     * when the pipe is made; nothing when off.
     */
    bool latency_stats;
    /*
     * Wait for a listener that is not there yet (a dialed pipe only; 0:
     * off). While the first connect is refused (nothing listens on the
     * port: a consumer still starting), dial again, backing off from 50 ms
     * to 1 s, for up to connect_wait_ms; then the connect ends with
     * TDP_ECONNREFUSED. Only a refusal is retried: a peer that answers and
     * fails the handshake (TDP_EAUTH, TDP_EVERSION, ...) ends the connect
     * at once. Once the pipe has opened this plays no part: a peer lost
     * later ends the pipe, unless reconnect_ms is set. The handshake that
     * follows a late listener still has connect_timeout_ms.
     * docs/pipe.md#waiting-for-the-listener.
     */
    int64_t connect_wait_ms;
    /*
     * The GPU this pipe's payloads live on (cuda_device_set true; default
     * none, cuda_device -1). A plane that copies GPU payloads through host
     * memory (shm) then starts the device's primary context, makes its copy
     * stream and page-locks its buffers when the pipe connects, so the
     * first send or receive of a GPU tensordict does not pay for them.
     * Without it the same happens at the first GPU payload or layout.
     * A device that does not exist is ignored. docs/gpu.md, "Staging".
     * It also offers the cuda-ipc plane (same host, GPU payloads in a
     * device pool the peer maps once), which only pipes that name their
     * GPU offer: docs/planes.md, "The cuda-ipc plane".
     */
    bool cuda_device_set;
    int cuda_device;
    /*
     * Offer a payload checksum (default off): XXH3-64 of every DATA
     * payload, computed by the sender over the bytes it sends and checked
     * by the receiver over the bytes that arrived, before the message is
     * handed out. In force, both ways, only when both sides offer it (a
     * record in the HELLO that older peers skip: with them, no checksum;
     * tdp_pipe_stats.checksum says). A message whose sum does not match is
     * dropped: the receive that would have returned it fails with
     * TDP_ECHECKSUM (its buffer is released, the credit returned) and the
     * pipe goes on. Host-resident payloads only: a send of device memory
     * on the ucx plane fails the pipe with TDP_ENOTSUP (the shm plane sums
     * its host copy), and so does a receive layout on a GPU
     * (recv_device). docs/pipe.md#payload-checksum.
     */
    bool checksum;
    /*
     * Receive window for small messages, bytes (default
     * TDP_RECV_WINDOW_DEFAULT, 256 KiB; 0: off; else 4096 .. 2^30). Unlike
     * the other fields, 0 is taken as given (off): start from
     * tdp_pipe_opts_default for the default. recv_depth bounds the
     * messages in flight to this side; with a window, a layout of N bytes
     * may have up to window / N messages in flight instead (N counted in
     * whole 4 KiB pages; never fewer than recv_depth nor more than 64), so
     * small messages stream without a round trip per recv_depth of them.
     * The storage this side keeps for a layout is then at most
     * max(recv_depth x N, window) bytes. Told to the peer in the HELLO (a
     * record older peers skip: they keep to recv_depth).
     * docs/pipe.md#receive-window.
     */
    uint64_t recv_window_bytes;
} tdp_pipe_opts;

/* tdp_pipe_opts.recv_window_bytes of tdp_pipe_opts_default */
#define TDP_RECV_WINDOW_DEFAULT (256u << 10)

#define TDP_SECRET_MIN 16
#define TDP_SECRET_MAX 256

/* Fill *o with the defaults (size included). */
TDP_API void tdp_pipe_opts_default(tdp_pipe_opts *o);

/* ---- connecting ---------------------------------------------------------- */

/*
 * Called on the loop thread when a connect or accept completes. On success
 * `pipe` is the new pipe, owned by the callee (free it with tdp_pipe_free);
 * on failure pipe is NULL and status says why.
 */
typedef void (*tdp_pipe_cb)(tdp_pipe *pipe, tdp_err status, void *arg);

/*
 * Connect to host:port (IPv4/IPv6 literal or host name) and do the HELLO
 * exchange. The host is resolved on the calling thread. Returns an error,
 * and the callback never runs, for TDP_EINVAL (NULL loop, host or cb, empty
 * host, port 0), TDP_EADDR (the host does not resolve) and TDP_ENOMEM.
 * Otherwise returns TDP_OK and the callback runs exactly once, never before
 * this returns, on the loop thread: with the new pipe, or with NULL and why
 * (TDP_ECONNREFUSED, TDP_ETIMEDOUT, TDP_EVERSION, TDP_EAUTH, TDP_ELIMIT,
 * TDP_EUCX, TDP_ENOTSUP, ...; TDP_EINVAL for a secret of the wrong length).
 */
TDP_API tdp_err tdp_pipe_connect_async(tdp_loop *loop, const char *host, uint16_t port,
                                       const tdp_pipe_opts *opts, tdp_pipe_cb cb, void *arg);

/* Blocking connect; *out written only on success. */
TDP_API tdp_err tdp_pipe_connect(tdp_loop *loop, const char *host, uint16_t port,
                                 const tdp_pipe_opts *opts, tdp_pipe **out);

/*
 * Listen on bind_host:port (NULL or "" = all IPv4 and IPv6 addresses; port
 * 0 picks a free port, see tdp_listener_port). Each connection that
 * completes its HELLO is handed to on_accept (if not NULL) or queued for
 * tdp_listener_accept. Handshake failures are logged and dropped. The
 * limits of tdp_listener_opts apply with their defaults (256 handshakes
 * under way, 32 from one source).
 * TDP_EUCX when the loop's UCX workers (made with its first pipe or
 * listener) cannot be created.
 */
TDP_API tdp_err tdp_listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                                 const tdp_pipe_opts *opts, tdp_pipe_cb on_accept, void *arg,
                                 tdp_listener **out);

/*
 * What a listener knows of a connection it is accepting, for the hooks of
 * tdp_listener_opts. Valid during the call only.
 */
typedef struct tdp_accept_info {
    const char *peer;     /* the connecting side's address, "ip:port" ("[ip]:port" for IPv6) */
    uint32_t pending;     /* handshakes under way, not counting this one */
    uint32_t from_source; /* of them, from this one's source (IPv4 address, IPv6 /64) */
    /* on_hello only (0 in admit): from the peer's HELLO */
    uint32_t want_depth; /* the receive depth it asks this side for (tdp_pipe_opts.want_peer_depth); 0: none */
    uint32_t peer_depth; /* its own receive depth */
} tdp_accept_info;

/*
 * Listener options; the struct can grow: set size = sizeof(tdp_listener_opts)
 * (tdp_listener_opts_default does). Zero fields take defaults.
 */
typedef struct tdp_listener_opts {
    size_t size;
    /* Every accepted pipe's options (size 0: defaults). Copied. */
    tdp_pipe_opts pipe;
    /*
     * Handshakes under way at once; default 256. One more makes room by
     * dropping the oldest: a good client's handshake takes a round trip, a
     * stranger that says nothing holds its slot until the handshake
     * deadline (pipe.connect_timeout_ms).
     */
    uint32_t max_pending;
    /*
     * Handshakes under way from one source (one IPv4 address, one IPv6
     * /64) at once; one more is refused at once (the peer's connect fails
     * with TDP_ELIMIT). Default 32; UINT32_MAX: no limit. Pipes already
     * accepted do not count.
     */
    uint32_t max_per_source;
    /*
     * Admission (may be NULL): called on the loop thread for each accepted
     * socket, after the limits above let it through and before any
     * handshake. TDP_OK: go on. TDP_ELIMIT (or any error): refuse — the
     * peer gets a BYE instead of a HELLO and its tdp_pipe_connect fails
     * with TDP_ELIMIT (an older peer may see TDP_ECONNRESET for errors
     * other than TDP_ELIMIT, TDP_EAUTH, TDP_ENOTSUP, TDP_EVERSION).
     */
    tdp_err (*admit)(const tdp_accept_info *info, void *arg);
    /*
     * Per-pipe options (may be NULL): called on the loop thread when the
     * peer's HELLO is in and before this side's goes out (with this hook
     * set, the listening side answers the dialer's HELLO instead of
     * speaking first). *opts holds the pipe's options; the hook may change
     * recv_depth (clamped to 1..64) — other fields are fixed by then and
     * changes to them are ignored. Return TDP_OK to go on, or an error to
     * refuse as admit does. With a shared secret it is called only once
     * the peer has proven it holds the secret; this side's HELLO (which
     * the proof covers) went out before, so recv_depth stays
     * pipe.recv_depth and changes to it are ignored: the hook lets the
     * peer in or refuses it.
     */
    tdp_err (*on_hello)(const tdp_accept_info *info, tdp_pipe_opts *opts, void *arg);
    void *hook_arg; /* passed to admit and on_hello */
} tdp_listener_opts;

/* Fill *o with the defaults (size and pipe.size included). */
TDP_API void tdp_listener_opts_default(tdp_listener_opts *o);

/*
 * tdp_listener_new with listener options (NULL: defaults); opts is copied.
 * tdp_listener_new(loop, h, p, po, ...) is this with the defaults and
 * pipe = *po.
 */
TDP_API tdp_err tdp_listener_new_opts(tdp_loop *loop, const char *bind_host, uint16_t port,
                                      const tdp_listener_opts *opts, tdp_pipe_cb on_accept,
                                      void *arg, tdp_listener **out);

/* The port actually bound. */
TDP_API uint16_t tdp_listener_port(const tdp_listener *l);

/* Blocking: the next accepted pipe, waiting up to timeout_ms (-1: forever). */
TDP_API tdp_err tdp_listener_accept(tdp_listener *l, int64_t timeout_ms, tdp_pipe **out);

/*
 * Stop listening; pipes already accepted live on. Queued, unclaimed pipes
 * and handshakes in progress are freed. NULL is a no-op.
 */
TDP_API void tdp_listener_free(tdp_listener *l);

/* ---- operations (async) -------------------------------------------------- */

/* Completion callback of an operation; runs on the loop thread. */
typedef void (*tdp_op_cb)(tdp_op *op, void *arg);

/*
 * An operation object, reusable for any number of sends or receives, one at
 * a time. Allocate it once (this allocates); using it does not.
 */
TDP_API tdp_err tdp_op_new(tdp_op_cb cb, void *arg, tdp_op **out);
/*
 * Free an idle op. One with an operation pending is not freed (logged: its
 * callback is still to come). NULL is a no-op.
 */
TDP_API void tdp_op_free(tdp_op *op);
/* Result of the last completed operation (TDP_EAGAIN while pending). */
TDP_API tdp_err tdp_op_result(const tdp_op *op);
/* The tensordict a completed receive lent (NULL otherwise). */
TDP_API tdp_td *tdp_op_td(const tdp_op *op);
/* Sequence number of the completed message (1 for the first). */
TDP_API uint64_t tdp_op_seq(const tdp_op *op);
/*
 * Wait until op's operation completes, up to timeout_ms (-1: no limit),
 * and return its result. While nobody runs the op's loop, this call
 * drives it on the calling thread (as a blocking call does), so one
 * thread with no loop thread can keep several async sends in flight and
 * wait for the oldest: the fastest way to stream small messages
 * (docs/pipe.md, "Streams of small messages"). The callback, if any,
 * still runs, on whichever thread runs the loop. TDP_ETIMEDOUT leaves
 * the operation pending. TDP_EINVAL for NULL, an op never started, or on
 * the loop thread while the loop runs (it would wait for itself).
 * TDP_EAGAIN when the callback already started the op again. One thread
 * at a time may wait on an op. An op with a callback may be freed only
 * once its callback has returned, which can be after this returns.
 */
TDP_API tdp_err tdp_op_wait(tdp_op *op, int64_t timeout_ms);

/*
 * Send td (referenced until the op completes; do not write its buffer
 * meanwhile). The schema frame goes first when the schema differs from the
 * last one sent. The op completes when the buffer may be reused; TDP_OK
 * means the transport has taken the bytes, not that the consumer has read
 * them. Sends complete in order. Waits for credit when the receiver's
 * buffers are all in use.
 */
TDP_API void tdp_pipe_send_async(tdp_pipe *pipe, tdp_td *td, tdp_op *op);

/*
 * Receive the next message. On success tdp_op_td(op) is lent: with depth 1
 * until the next receive; with depth N until tdp_pipe_release. Ends with
 * TDP_ECLOSED after the peer's last message.
 */
TDP_API void tdp_pipe_recv_async(tdp_pipe *pipe, tdp_op *op);

/* ---- blocking ------------------------------------------------------------ */

/*
 * Send and wait (timeout_ms -1: forever). One blocking send at a time per
 * pipe. Returns within the timeout whatever the transport does: a send that
 * times out after it was handed to UCX may still be delivered (the pipe
 * keeps its own reference on td until UCX lets go of it).
 */
TDP_API tdp_err tdp_pipe_send(tdp_pipe *pipe, tdp_td *td, int64_t timeout_ms);

/*
 * Prepare the pipe for messages of schema's layout before the first one,
 * so that its first send costs what a steady one does: this side's pools,
 * bounce buffers and registrations are made, and their pages faulted in,
 * now; the schema goes to the peer now, and a peer with receive storage to
 * make (the ucx plane) allocates it, faults it in and confirms. Returns
 * once the peer has confirmed (or, on a plane whose receiver needs nothing
 * before the data, once this side is set up). The next send of this layout
 * then carries no schema. A prepare is not a message: no sequence number,
 * no credit. The latest prepare (or send) names the layout in force: a
 * send of another layout after it sends that schema as usual.
 *
 * Thread rules as tdp_pipe_send (it uses the same blocking slot: not while
 * a blocking send is in progress, not on the loop thread). The caller
 * keeps its reference on schema. Errors: TDP_EMSGSIZE (the layout is over
 * the peer's limit; the pipe goes on), TDP_ENOTSUP (a plane without
 * prepare, or memory it cannot carry), TDP_ETIMEDOUT, and what a send of
 * the layout would get from a peer that refuses it (TDP_ELIMIT: over a
 * server's memory cap; the pipe ends, as it would for the send).
 * docs/pipe.md, "Preparing a layout".
 */
TDP_API tdp_err tdp_pipe_prepare(tdp_pipe *pipe, tdp_schema *schema, int64_t timeout_ms);

/*
 * Gather tensor leaves from separate buffers (leaf i of the schema's tensor
 * order from ptrs[i], nbytes from the schema) into a send buffer the pipe
 * keeps and reuses, then send it. Host memory only.
 */
TDP_API tdp_err tdp_pipe_send_gather(tdp_pipe *pipe, tdp_schema *schema,
                                     const void *const *ptrs, int64_t timeout_ms);

/*
 * Receive and wait. *out is lent as for tdp_pipe_recv_async. Returns
 * TDP_ECLOSED at the clean end of the stream. With depth 1, a receive
 * releases the previous message.
 */
TDP_API tdp_err tdp_pipe_recv(tdp_pipe *pipe, int64_t timeout_ms, tdp_td **out);

/* Give a received buffer back (returns a credit to the sender). */
TDP_API void tdp_pipe_release(tdp_pipe *pipe, tdp_td *td);

/*
 * Clean close: finish the sends already started (those waiting for credit
 * included), send BYE, and wait up to timeout_ms for it to go. The peer's
 * receives end with TDP_ECLOSED after the last message. On this side, sends
 * started after the call complete with TDP_ECANCELED; receives, pending or
 * later, get the messages that had already arrived and then TDP_ECLOSED
 * (closing ends both directions). Returns TDP_OK for a clean end, the
 * pipe's error if it had failed, TDP_ETIMEDOUT if the sends and the BYE had
 * not gone in time (the close goes on in the background; pending receives
 * then end with TDP_ETIMEDOUT).
 */
TDP_API tdp_err tdp_pipe_close(tdp_pipe *pipe, int64_t timeout_ms);

/*
 * Start a clean close without waiting (any thread, also inside a callback
 * of the pipe): as tdp_pipe_close, but the outcome comes through the end
 * callback (tdp_pipe_set_end_cb) and tdp_pipe_status. After timeout_ms
 * (-1: none) a close that has not finished ends with TDP_ETIMEDOUT: the
 * sends and the BYE had not gone, or the BYE went and the peer neither
 * answered with its own BYE nor closed its socket; the socket is then
 * closed (the end callback runs).
 */
TDP_API void tdp_pipe_close_async(tdp_pipe *pipe, int64_t timeout_ms);

/*
 * End the pipe now with why (an error: the peer is told in BYE), without
 * waiting. Pending operations complete with why. Any thread. A pipe that
 * has ended already (a close whose BYE went) stops waiting for the peer's
 * side: its socket closes and the end callback runs.
 */
TDP_API void tdp_pipe_abort(tdp_pipe *pipe, tdp_err why);

/*
 * Called once on the loop thread when the pipe has ended (status: TDP_OK
 * for a clean close this side asked for, TDP_ECLOSED for the peer's clean
 * end, else why it failed) and its control socket is closed: nothing of
 * the pipe touches the network any more; tdp_pipe_free may be called from
 * the callback. Set it from the connect/accept callback (loop thread) so
 * no end is missed; an end that came before is reported at once.
 */
typedef void (*tdp_pipe_end_cb)(tdp_pipe *pipe, tdp_err status, void *arg);
TDP_API void tdp_pipe_set_end_cb(tdp_pipe *pipe, tdp_pipe_end_cb cb, void *arg);

/*
 * Borrow a send buffer laid out for schema from the pipe's data plane: on
 * the shm plane a slot of the shared pool, so that tdp_pipe_send of it
 * copies nothing (the peer reads the same pages). Fill it, send it, then
 * drop the reference (tdp_td_unref) — a loan not sent goes back when
 * unreferenced. Other planes lend an ordinary buffer, and so does the shm
 * plane for a loan that needs a larger pool while more than depth larger
 * pools the receiver has not reached are out (loans of growing sizes held
 * at once; docs/planes.md). Loop thread or any
 * thread; TDP_EAGAIN when every slot is in use (retry after a send
 * completes) and, on the shm plane just after the pipe opened, until the
 * peer's shared-memory connection is proven (retry shortly; microseconds
 * on an idle host), TDP_EINVAL before the pipe is open.
 */
TDP_API tdp_err tdp_pipe_loan(tdp_pipe *pipe, tdp_schema *schema, tdp_td **out);

/* The data plane the HELLO chose (TDP_PLANE_AUTO before it). */
TDP_API tdp_plane tdp_pipe_plane(const tdp_pipe *pipe);

/*
 * Abort the pipe if it is still open (the peer sees TDP_ECONNRESET, not a
 * clean end) and free it. Every operation still pending completes with
 * TDP_ECANCELED before this returns; the callbacks run on the loop thread
 * (from another thread, this call waits for them). Not from inside a
 * callback of this pipe's ops or the callback that delivered it (see
 * docs/pipe.md); the end callback may. Tensordicts the pipe lent go with
 * it, unless the application took a reference of its own (tdp_td_ref).
 * NULL is a no-op.
 */
TDP_API void tdp_pipe_free(tdp_pipe *pipe);

/* ---- queries ------------------------------------------------------------- */

/*
 * A pipe's counters. The struct can grow (new fields go at the end):
 * tdp_pipe_stats_get is a macro that passes sizeof(*out), and
 * tdp_pipe_stats_get_sized writes no more than that many bytes — a caller
 * built against an older header gets the fields it knows, one built
 * against a newer header zeros where this library has nothing.
 */
typedef struct tdp_pipe_stats {
    uint64_t msgs_sent, msgs_recv;
    uint64_t bytes_sent, bytes_recv; /* payload bytes */
    uint64_t schemas_sent, schemas_recv;
    uint64_t credit_waits; /* sends that had to wait for the receiver */
    uint64_t reconnects;   /* outages a reconnecting pipe went through */
    /*
     * Receiving: the sequence number the peer said it goes on from (its
     * first message's), when it reconnected after an outage — messages
     * before it were sent to a peer that is gone; 0 for a fresh stream.
     */
    uint64_t resumed_from;
    /* receive depths once the HELLO is done (0 before): this side's, the peer's */
    uint32_t recv_depth, peer_depth;
    /*
     * Sending, a reconnecting pipe: messages handed to a link that then went
     * down whose buffers the peer never gave back (sent on it, less the
     * credit it returned), summed over outages. Each may or may not have
     * reached the application on the other side; those whose send was still
     * in flight ended with TDP_ECONNRESET and are counted here too.
     */
    uint64_t unconfirmed;
    /* the payload checksum is in force on this pipe (opts.checksum, both sides) */
    bool checksum;
    /* messages dropped because their payload checksum did not match */
    uint64_t checksum_errors;
} tdp_pipe_stats;

/*
 * Copy the counters into the first `size` bytes of out (any thread). size
 * is the caller's sizeof(tdp_pipe_stats); bytes past what this library
 * knows are zeroed, none past size are written.
 */
TDP_API void tdp_pipe_stats_get_sized(const tdp_pipe *pipe, tdp_pipe_stats *out, size_t size);
/*
 * The same with the caller's sizeof. Also an exported function of that
 * name (for callers built before the macro), which writes the first
 * version of the struct (the fields up to resumed_from).
 */
TDP_API void tdp_pipe_stats_get(const tdp_pipe *pipe, tdp_pipe_stats *out);
#define tdp_pipe_stats_get(pipe, out) tdp_pipe_stats_get_sized((pipe), (out), sizeof(*(out)))

/*
 * What a pipe made with opts.latency_stats measures, in nanoseconds on the
 * monotonic clock, one value per message:
 */
typedef enum tdp_latency {
    /*
     * A send, from the call (tdp_pipe_send_async, tdp_pipe_send,
     * tdp_pipe_send_gather) to its completion with TDP_OK: the time the
     * buffer was held — waiting for credit included (a receiver that
     * does not keep up shows here), the consumer's reading not.
     * Failed, canceled and timed-out sends are not counted.
     */
    TDP_LAT_SEND = 0,
    /*
     * A received message, from the moment it had fully arrived to the
     * moment a receive took it: near 0 while the application waits in
     * tdp_pipe_recv, long when messages queue in the ring (depth > 1)
     * because the application is slower than the stream.
     */
    TDP_LAT_RECV_WAIT = 1,
} tdp_latency;

/*
 * Copy the histogram of `which` since the pipe was made into *out (any
 * thread, any time before tdp_pipe_free; tdp_hist_summarize gives
 * min/p50/p99/p99.9/max). TDP_ENOTSUP when the pipe was made without
 * opts.latency_stats, TDP_EINVAL for a bad argument; *out is written only
 * on success.
 */
TDP_API tdp_err tdp_pipe_latency_get(const tdp_pipe *pipe, tdp_latency which, tdp_hist *out);

/* Error that ended the pipe (TDP_OK while it is open). */
TDP_API tdp_err tdp_pipe_status(const tdp_pipe *pipe);

/*
 * The schema of the last message received (NULL before the first). Any
 * thread. Borrowed: valid until the pipe receives another schema or is
 * freed; the schema of a lent tensordict, tdp_td_schema(td), lives as long
 * as the tensordict.
 */
TDP_API tdp_schema *tdp_pipe_recv_schema(const tdp_pipe *pipe);

/*
 * The peer's address into buf (at most len bytes, NUL included): "ip:port"
 * for IPv4, "[ip]:port" for IPv6 ("[::1]:5000"). Returns buf.
 */
TDP_API const char *tdp_pipe_peer(const tdp_pipe *pipe, char *buf, size_t len);

/* True when the peer is on this host (shared-memory transports usable). */
TDP_API bool tdp_pipe_same_host(const tdp_pipe *pipe);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_PIPE_H */
