/* pipe_int.h (internal): pipe, listener and op objects, shared by src/pipe and src/server. */
#ifndef TDP_PIPE_INT_H
#define TDP_PIPE_INT_H

#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <pthread.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <tdpipe/pipe.h>

#include "../core/loop_int.h"
#include "ucx_workers.h"
#include "../schema/td_int.h"
#include "wire.h"

#define TDP_MAX_DEPTH 64u

enum op_kind { OP_NONE, OP_SEND, OP_RECV };

struct tdp_op {
    tdp_op_cb cb;
    void *arg;
    tdp__task task; /* hop to the loop thread without allocating */
    enum op_kind kind;
    tdp_pipe *pipe;
    tdp_td *td;
    tdp_err result;
    uint64_t seq;
    bool pending;
    bool waited; /* counted once in credit_waits */
    struct tdp_op *next;
    /* blocking wrappers */
    bool sync;
    volatile bool done;
    tdp__task cancel_task;
    bool cancel_pending; /* under the pipe's mutex */
};

/*
 * A send in flight with UCX. The pipe owns it, not the op: when the pipe
 * fails, the op is handed back at once while the ticket keeps the headers
 * and a reference on the buffer until UCX lets go of its requests.
 */
typedef struct tx_ticket {
    tdp_pipe *pipe;
    tdp_op *op; /* NULL once handed back */
    tdp_td *td;
    int inflight;
    tdp_err status;
    void *req[2]; /* UCX requests not yet completed */
    struct tx_ticket *next_free;
    uint8_t schema_hdr[TDP_AM_HDR_LEN];
    uint8_t data_hdr[TDP_AM_HDR_LEN];
} tx_ticket;

enum slot_state { SLOT_FREE, SLOT_FILLING, SLOT_READY, SLOT_LENT };

/* Storage shared by the tds that wrap it; freed with the last one. */
typedef struct rx_store {
    _Atomic uint32_t refs;
    void *buf;
    uint64_t cap;
    tdp_mem_type mt;
} rx_store;

typedef struct rx_slot {
    enum slot_state state;
    rx_store *store;
    ucp_mem_h memh;
    tdp_td *td; /* wraps store for the schema it was built for */
    uint64_t seq;
    tdp_pipe *pipe;
    tdp__task release_task;
    bool release_posted;
    void *req; /* the rendezvous receive while FILLING */
} rx_slot;

enum pipe_state {
    PIPE_CONNECTING, /* socket connecting or HELLO not yet exchanged */
    PIPE_OPEN,
    PIPE_CLOSING, /* our BYE sent; the peer may still send */
    PIPE_DEAD,    /* failed or closed for good */
};

struct tdp_pipe {
    tdp_loop *loop;
    tdp_pipe_opts opts;
    tdp_schema_limits limits;
    enum pipe_state state;
    tdp_err status; /* why it ended */
    uint32_t reg_index;
    uint64_t token, peer_token;
    char peer_name[64];

    /* control socket */
    struct bufferevent *bev;
    struct event *timer; /* connect deadline, then linger */
    bool hello_sent, hello_recv;
    tdp_hello peer_hello;
    tdp_pipe_cb connect_cb;
    void *connect_arg;
    tdp_listener *listener; /* set while an accepted pipe is handshaking */
    struct tdp_pipe *lnext; /* listener's queue */
    bool same_host;
    bool peer_mode_ucx;
    struct sockaddr_storage addrs[4]; /* connect: resolved addresses, tried in turn */
    socklen_t addrlens[4];
    int naddr, iaddr;
    bool bye_sent, bye_flushed;
    struct tdp_pipe *doomed_next;
    bool close_requested;
    tdp__task free_task;
    /*
     * Set by conn_read_cb while it handles frames: tdp__conn_close sets *it
     * to true, so the callback knows the socket (and maybe the pipe) is gone.
     */
    bool *conn_gone;
    /*
     * Told (on the loop thread) after the control socket of an open pipe
     * closed and the pipe has reacted; must not free the pipe inline. The
     * server uses it to know when a finished client may be freed.
     */
    void (*sock_closed_cb)(tdp_pipe *p, void *arg);
    void *sock_closed_arg;

    /* UCX */
    int wi; /* which of the loop's workers: TDP_WORKER_ANY or TDP_WORKER_LOCAL */
    bool wi_seen; /* a frame arrived (on worker wi) before the peer's HELLO */
    ucp_ep_h ep; /* borrowed from sep */
    struct tdp__shared_ep *sep;
    bool ep_failed;

    /* send side */
    tdp_op *sendq, *sendq_tail; /* waiting for credit or for the ep */
    uint64_t send_seq;          /* seq of the last DATA handed to UCX */
    uint64_t peer_credit;       /* cumulative buffers the peer released */
    uint32_t peer_depth;
    tdp_schema *sent_schema;
    uint32_t ucx_sends; /* outstanding UCX send requests (all kinds) */
    tx_ticket *tickets; /* 2 x peer depth + 1, allocated at HELLO */
    uint32_t nticket;
    tx_ticket *free_tickets;
    rx_store *gather;   /* tdp_pipe_send_gather's reused buffer */
    tdp_td *gather_td;

    /* receive side */
    uint32_t depth;
    rx_slot slots[TDP_MAX_DEPTH];
    uint32_t ready[TDP_MAX_DEPTH]; /* FIFO of READY slot indices */
    uint32_t ready_head, ready_count;
    int32_t lent1; /* depth 1: the slot lent until the next receive, or -1 */
    tdp_op *recvq, *recvq_tail;
    tdp_schema *rx_schema; /* layout of incoming data (device-adjusted) */
    uint64_t rx_hash;      /* the sender's hash for it */
    uint64_t rx_seq;       /* seq of the last DATA received */
    uint64_t released;     /* cumulative buffers released (sent as CREDIT) */
    uint64_t credit_sent;
    bool credit_inflight;
    void *credit_req;
    struct event *credit_ev; /* deferred credit: end of the loop turn */
    uint8_t credit_hdr[TDP_AM_HDR_LEN];
    uint32_t ucx_recvs; /* outstanding UCX receive requests */
    bool peer_bye;
    uint64_t peer_last_seq;

    /* blocking wrappers */
    tdp_op *sync_send, *sync_recv;
    pthread_mutex_t mtx;
    pthread_cond_t cond;

    tdp_pipe_stats stats;
};

/*
 * What a server adds to its listener (tdp__listener_new): an admission check
 * consulted for every accepted socket before any handshake, and a report of
 * handshakes that failed. Both run on the loop thread.
 */
typedef struct tdp__listener_hooks {
    /* false: refuse the socket (BYE with TDP_ELIMIT instead of HELLO) */
    bool (*admit)(void *arg, uint32_t npending);
    /* a handshake ended without a pipe (timed out, garbage, version) */
    void (*handshake_failed)(void *arg, tdp_err why);
    void *arg;
} tdp__listener_hooks;

struct tdp__refusal; /* conn.c: a refused socket until its BYE is out */

struct tdp_listener {
    tdp_loop *loop;
    tdp_pipe_opts opts;
    tdp_schema_limits limits;
    struct evconnlistener *evl[2];
    uint16_t port;
    tdp_pipe_cb on_accept;
    void *arg;
    tdp_pipe *pending; /* handshaking, linked by lnext */
    uint32_t npending;
    tdp__listener_hooks hooks;
    struct tdp__refusal *refusals; /* sockets being refused */
    uint32_t nrefusals;
    tdp_pipe *ready, *ready_tail;
    volatile bool has_ready;
    pthread_mutex_t mtx;
    pthread_cond_t cond;
};

/* The argument of a worker's AM handler: which loop, which of its workers. */
typedef struct tdp__am_arg {
    tdp_loop *loop;
    int wi;
} tdp__am_arg;

/* registry.c: per-loop pipe table, AM handler, host identity. */
tdp_err tdp__reg_add(tdp_pipe *p);
void tdp__reg_remove(tdp_pipe *p);
tdp_pipe *tdp__reg_lookup(tdp_loop *loop, uint64_t token);
const uint8_t *tdp__host_id(void);
/*
 * Keep a buffer (and its registration) UCX may still touch after its
 * request was abandoned: freed with the loop, after the worker is gone.
 */
void tdp__reg_bury(tdp_loop *loop, tdp_td *td, ucp_mem_h memh, int wi);
/*
 * One UCX endpoint per remote worker, shared by every pipe between the same
 * two workers: frames are routed by token, and UCX pairs the endpoints two
 * workers create to each other in creation order, which two sides opening
 * several pipes at once need not agree on. Reference-counted; a peer
 * failure UCX reports ends every pipe on the endpoint.
 */
typedef struct tdp__shared_ep tdp__shared_ep;
tdp_err tdp__reg_ep_acquire(tdp_pipe *p, const void *addr, size_t alen, bool peer_mode);
void tdp__reg_ep_release(tdp_pipe *p);

/* Keep an endpoint close request until UCX finishes it (or the loop goes). */
void tdp__reg_track_close(tdp_loop *loop, void *req);
/* Destroy a freed (inert) pipe on a later loop turn, or when the loop goes. */
void tdp__reg_defer_destroy(tdp_pipe *p);
tdp_err tdp__reg_worker_address(tdp_loop *loop, int wi, const void **addr, size_t *len);

/* conn.c: control socket. */
tdp_err tdp__conn_start_connect(tdp_pipe *p, const struct sockaddr *sa, socklen_t salen);
void tdp__conn_send_bye(tdp_pipe *p, tdp_err reason);
void tdp__conn_close(tdp_pipe *p);
/*
 * Refuse an accepted socket: send BYE(reason) instead of HELLO, then close
 * once the peer hangs up (or after the listener's handshake deadline). Takes
 * fd. The listener keeps track; tdp__conn_refusals_free drops what is left.
 */
void tdp__conn_refuse(tdp_listener *l, evutil_socket_t fd, tdp_err reason);
void tdp__conn_refusals_free(tdp_listener *l);
tdp_err tdp__conn_accepted(tdp_pipe *p, evutil_socket_t fd, const struct sockaddr *sa);
tdp_err tdp__resolve(const char *host, uint16_t port, bool passive, struct sockaddr_storage *out,
                     socklen_t *outlen, int max, int *count);

/* pipe.c */
tdp_pipe *tdp__pipe_alloc(tdp_loop *loop, const tdp_pipe_opts *opts);
void tdp__pipe_destroy(tdp_pipe *p);
void tdp__pipe_fail(tdp_pipe *p, tdp_err err, const char *why);
tdp_err tdp__pipe_open_ep(tdp_pipe *p, const void *addr, size_t alen);
void tdp__pipe_check_close(tdp_pipe *p);
void tdp__pipe_on_bye(tdp_pipe *p, const tdp_bye *bye);
void tdp__pipe_on_socket_closed(tdp_pipe *p);
ucs_status_t tdp__pipe_am_cb(void *arg, const void *header, size_t header_length, void *data,
                             size_t length, const ucp_am_recv_param_t *param);
void tdp__opts_resolve(const tdp_pipe_opts *in, tdp_pipe_opts *out, tdp_schema_limits *lim);
tdp_err tdp__wait_op(tdp_pipe *p, tdp_op *op, int64_t timeout_ms);
/* Run fn(arg) on the loop thread and wait (inline on the loop thread or an idle loop). */
void tdp__call_on_loop(tdp_loop *loop, tdp_loop_fn fn, void *arg);
/* connect.c: tdp_listener_new with server hooks (hooks may be NULL). */
tdp_err tdp__listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                          const tdp_pipe_opts *opts, tdp_pipe_cb on_accept, void *arg,
                          const tdp__listener_hooks *hooks, tdp_listener **out);
void tdp__listener_ready(tdp_listener *l, tdp_pipe *p);
void tdp__listener_drop(tdp_listener *l, tdp_pipe *p);
int64_t tdp__now_ms(void);
/*
 * Wait on cond (mtx held) until signalled or until deadline_ms on the
 * tdp__now_ms clock (-1: no deadline). False, without waiting, once the
 * deadline has passed; spurious wakeups return true: callers loop.
 */
bool tdp__cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mtx, int64_t deadline_ms);

#endif
