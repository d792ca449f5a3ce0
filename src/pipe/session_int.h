/*
 * session_int.h (internal): the pipe object, shared by the files of the
 * pipe's state machine (session.c: negotiation, the data path, reconnect
 * and teardown; session_query.c: what the application may ask of a pipe).
 * Nothing outside them includes it; it stands below session.h (which the
 * dialer and the listener use) and includes nothing of it.
 */
#ifndef TDP_PIPE_SESSION_INT_H
#define TDP_PIPE_SESSION_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <tdpipe/pipe.h>

#include "budget.h"
#include "ctl.h"
#include "op.h"
#include "plane.h"
#include "../core/reap.h"

enum slot_state { SLOT_FREE, SLOT_FILLING, SLOT_READY, SLOT_LENT };

typedef struct rx_slot {
    enum slot_state state;
    tdp_td *td; /* the message's view while READY or LENT */
    uint64_t seq;
    uint32_t epoch;    /* the link it came by (reconnecting pipes have several) */
    uint64_t ready_ns; /* latency_stats: when it had fully arrived */
    tdp_pipe *pipe;
    uint64_t sum; /* the checksum its DATA frame carried, when has_sum */
    bool has_sum;
    bool bad; /* READY but its checksum did not match: a receive drops it */
} rx_slot;

/* A send the plane holds; the op goes back early if the pipe fails or times out. */
typedef struct tx_ticket {
    tdp_op *op;
    struct tx_ticket *next_free;
    struct tx_ticket *next_done; /* completions queued while the session calls the plane */
    tdp_err done_st;
    bool busy;
} tx_ticket;

enum pipe_state {
    PIPE_CONNECTING, /* socket connecting or HELLO not yet exchanged */
    PIPE_OPEN,
    PIPE_DEAD, /* ended: failed, or closed cleanly */
};

struct tdp_pipe {
    tdp_loop *loop;
    tdp_pipe_opts opts;
    tdp_schema_limits limits;
    enum pipe_state state;
    tdp_err status; /* why it ended */
    tdp__ctl ctl;
    struct event *timer; /* connect deadline, then linger or close deadline */
    bool same_host;
    tdp_pipe_cb ready_cb;
    void *ready_arg;
    /* accepting with a hook: our HELLO answers the peer's (tdp__session_answer_hello) */
    tdp_err (*hello_hook)(void *arg, const tdp_hello *h, tdp_pipe_opts *opts); /* tdp__hello_hook */
    void *hello_hook_arg;

    /* planes: a link per candidate until the HELLO picks one */
    const tdp__plane_ops *cand[TDP__PLANES_MAX];
    tdp__link *links[TDP__PLANES_MAX];
    int ncand;
    const tdp__plane_ops *plane;
    tdp__link *link;
    uint32_t plane_mem; /* TDP__MEM_*: what the link carries */
    uint64_t peer_caps; /* the peer's HELLO caps (TDP_CAP_MEM_*) */
    bool link_failed;   /* the plane saw the peer go; the socket decides how it ended */

    /* ending */
    bool close_requested, bye_flushed, told_end;
    int64_t close_deadline; /* tdp__now_ms() at which a close gives up; -1: never */
    tdp_pipe_end_cb end_cb;
    void *end_arg;
    bool freed;
    tdp__reap reap;

    /* send side */
    tdp__opq sendq; /* waiting for credit, a ticket or the HELLO */
    uint64_t send_seq;
    uint64_t peer_credit; /* cumulative buffers the peer released */
    void (*credit_cb)(void *arg); /* tdp__session_set_credit_cb */
    void *credit_arg;
    uint32_t peer_depth;
    uint64_t peer_window; /* the peer's receive window (TDP_HX_WINDOW), 0: none */
    tdp_schema *sent_schema;
    tx_ticket *tickets;
    uint32_t nticket, tx_inflight;
    tx_ticket *free_tickets;
    /*
     * Send completions a plane reported from inside send_kick (the shm plane
     * completes inline): queued through the tickets themselves (each is
     * there at most once: no allocation, no bound to check) and taken when
     * the outermost send_kick is done with the plane, never by recursion.
     */
    tx_ticket *done_head, *done_tail;
    bool kicking;
    tdp_td *gather_td; /* tdp_pipe_send_gather's reused buffer */

    /* receive side */
    uint32_t depth;
    rx_slot slots[TDP_MAX_DEPTH];
    uint32_t ready[TDP_MAX_DEPTH]; /* FIFO of READY slot indices */
    uint32_t ready_head, ready_count;
    int32_t lent1; /* depth 1: the slot lent until the next receive, or -1 */
    bool window_sent; /* the last HELLO granted a window (recv_window_bytes) */
    tdp__opq recvq;
    tdp_schema *rx_schema;
    uint64_t rx_hash, rx_seq;
    uint64_t released, credit_sent;
    struct event *credit_ev;        /* deferred credit: end of the loop turn */
    uint8_t secret[TDP_SECRET_MAX]; /* opts.secret points here */
    size_t secret_len;
    uint32_t rx_inflight;
    bool peer_bye;
    uint64_t peer_last_seq;

    /* releases from other threads, under w.mtx */
    tdp_td *rel[2 * TDP_MAX_DEPTH];
    uint32_t nrel;
    bool rel_posted;
    tdp__task rel_task;

    /* blocking wrappers */
    tdp__waiter w;
    tdp_op *sync_send, *sync_recv;

    tdp_pipe_stats stats;
    /* opts.latency_stats: [tdp_latency], loop thread only; else NULL */
    tdp_hist *lat;

    /*
     * Reconnecting (opts.reconnect_ms, a dialed pipe): the addresses to dial
     * again, and the outage in progress. epoch counts links; a buffer lent
     * from an earlier one is not the current link's to give back.
     * credit_base: send_seq when the current link started (its peer counts
     * credit from there).
     */
    struct sockaddr_storage addrs[TDP_CTL_MAX_ADDRS];
    socklen_t addrlens[TDP_CTL_MAX_ADDRS];
    int naddr;
    bool was_open, reconnecting;
    tdp_err lost;          /* what started the outage */
    int64_t outage_end_ms; /* give up then (tdp__now_ms) */
    int64_t backoff_ms;
    struct event *retry_ev;
    uint32_t epoch;
    uint64_t credit_base;

    bool sum_on; /* payload checksum in force: both HELLOs offered it */
    /* a server's cap on all its clients' receive storage (tdp__session_set_budget) */
    tdp__budget *budget;
    uint64_t budget_held; /* bytes this pipe took from it */

    /*
     * tdp_pipe_prepare (session_prepare.c): the prepare waiting for the
     * peer's READY, and the prepared SCHEMAs of this connection, counted
     * both ways (a READY names the count, so a late one is never taken for
     * a later prepare's).
     */
    bool peer_ready;       /* the peer's HELLO speaks READY */
    uint64_t peer_max_msg; /* the peer's HELLO max_msg_bytes */
    tdp_op *prep_op;       /* sent, waiting for READY */
    uint64_t prep_hash, prep_want;
    uint64_t prep_tx_n, prep_rx_n;
    struct event *prep_ev; /* the plane was not up yet: try again */
};

/*
 * ---- session_prepare.c, for session.c (loop thread) ----
 * It never calls the session back: what the session must do (fail the
 * pipe, look at the queue again later) comes back as results.
 */

typedef enum tdp__prep_step_rc {
    TDP__PREP_DONE = 0,  /* the prepare left the queue (done, failed or waiting for READY) */
    TDP__PREP_RETRY = 1, /* the plane is not up yet: it stays at the head; look again soon */
} tdp__prep_step_rc;

/* The send queue's head is a prepare: handle it. *fail: the pipe must end with it (else as was). */
tdp__prep_step_rc tdp__prep_step(tdp_pipe *p, tdp_err *fail);
/* The prepare waiting for READY ends with rc (the link went, or the pipe ended). */
void tdp__prep_fail(tdp_pipe *p, tdp_err rc);
/* A timed-out op: true if it was the prepare waiting for READY (now completed). */
bool tdp__prep_take_back(tdp_pipe *p, tdp_op *op);
/* The peer's READY; false: it answers no prepare ever sent (a protocol error). */
bool tdp__prep_ready(tdp_pipe *p, const tdp_ready *r);
/* A prepared SCHEMA (f->prepare) was put in force: answer READY. */
void tdp__prep_schema_in(tdp_pipe *p, const tdp__frame *f);
/* A new connection: the counts start again. */
void tdp__prep_reset(tdp_pipe *p);

#endif
