/*
 * session_int.h (internal): the pipe object, shared by the files of the
 * pipe's state machine, and what they call of each other. From the top:
 * session.c (the public entry points, creating and freeing),
 * session_reconnect.c, session_hello.c (control channel events and the
 * negotiation), session_rx.c and session_tx.c (the data path, each way),
 * session_base.c (ending and teardown, and what all of them share), and
 * session_prepare.c below them; session_query.c answers what the
 * application may ask of a pipe, session_opts.c its options. Each calls
 * only the files below it; session_base.c reaches the two things it needs
 * from above through tdp__pipe_hooks. Nothing outside them includes this
 * header; it stands below session.h (which the dialer and the listener
 * use) and includes nothing of it.
 */
#ifndef TDP_PIPE_SESSION_INT_H
#define TDP_PIPE_SESSION_INT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <event2/util.h>
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

/*
 * What session_base.c needs from the files above it, set by session.c when
 * the pipe is made (a function pointer, so that the floor of the state
 * machine calls nothing above it by name).
 */
typedef struct tdp__pipe_hooks {
    /* session_reconnect.c: the link went and tdp__pipe_want_reconnect said to dial again */
    void (*reconnect)(tdp_pipe *p, tdp_err err, const char *why);
    /* session_rx.c: complete the receives that can complete now */
    void (*deliver)(tdp_pipe *p);
} tdp__pipe_hooks;

enum pipe_state {
    PIPE_CONNECTING, /* socket connecting or HELLO not yet exchanged */
    PIPE_OPEN,
    PIPE_DEAD, /* ended: failed, or closed cleanly */
};

struct tdp_pipe {
    tdp_loop *loop;
    const tdp__pipe_hooks *hooks;
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
    uint64_t peer_credit;         /* cumulative buffers the peer released */
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
    int32_t lent1;    /* depth 1: the slot lent until the next receive, or -1 */
    bool window_sent; /* the last HELLO granted a window (recv_window_bytes) */
    tdp__opq recvq;
    tdp_schema *rx_schema;
    uint64_t rx_hash, rx_seq;
    uint64_t released, credit_sent;
    uint64_t rx_link; /* DATA taken on this link: with credit_sent, what the peer counts in flight */
    tdp__idle credit_idle;          /* deferred credit: when the loop is about to sleep */
    uint8_t secret[TDP_SECRET_MAX]; /* opts.secret points here */
    size_t secret_len;
    uint32_t rx_inflight;
    bool peer_bye;
    uint64_t peer_last_seq;
    /* after a BYE, what had landed when the linger was last armed
     * (tdp__pipe_rx_mark): the linger ends the pipe only once nothing more
     * has come for a whole linger_ms */
    uint64_t linger_mark;

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

/* ---- session_base.c (loop thread) ---- */

/* The pipe ends with err (or, dialed with reconnect_ms, reconnects): ops complete, the end is told.
 */
void tdp__pipe_fail(tdp_pipe *p, tdp_err err, const char *why);
/* The same, logged as the peer's fault. */
void tdp__pipe_proto_fail(tdp_pipe *p, tdp_err err, const char *why);
/* Would a failure with err dial again rather than end the pipe? */
bool tdp__pipe_want_reconnect(const tdp_pipe *p, tdp_err err);
/* Both sides have said all: close the control socket, tell the end. */
void tdp__pipe_hang_up(tdp_pipe *p);
void tdp__pipe_maybe_tell_end(tdp_pipe *p);
/* The pipe's one timer: the connect deadline, then the linger or close deadline. */
void tdp__pipe_arm_timer(tdp_pipe *p, int64_t ms);
uint64_t tdp__pipe_rx_mark(const tdp_pipe *p);
void tdp__pipe_timer_del(tdp_pipe *p);
void tdp__pipe_linger_cb(evutil_socket_t fd, short what, void *arg);
/* Has everything the peer announced in its BYE been delivered or lent? */
bool tdp__pipe_peer_done(const tdp_pipe *p);
void tdp__pipe_end_if_peer_done(tdp_pipe *p);
/* A close in progress: BYE once everything sent is gone, then the clean end. */
void tdp__pipe_check_close(tdp_pipe *p);
/* Close every candidate link (gone: the peer is, or as good as). */
void tdp__pipe_close_links(tdp_pipe *p, bool gone);
/* Sends the plane still holds complete with rc (it keeps their buffers). */
void tdp__pipe_fail_ops_sent(tdp_pipe *p, tdp_err rc);
/* After the end: every queued op completes. */
void tdp__pipe_drain_ops(tdp_pipe *p);
/* The plane a frame came by, or NULL: the pipe ended, or the frame is not to be taken. */
const tdp__plane_ops *tdp__pipe_frame_plane(tdp_pipe *p, tdp__link *l);
/* tdp__plane_up.failed */
void tdp__pipe_up_failed(void *owner, tdp__link *l, tdp_err st, const char *why);
void tdp__pipe_slot_free(rx_slot *s);
uint64_t tdp__pipe_lat_now_ns(void);
/* Also in session.h, for the dialer and the listener (session.c includes both: they must agree). */
void tdp__session_destroy(tdp_pipe *p);
void tdp__pipe_lat_record(tdp_pipe *p, tdp_latency which, uint64_t since_ns);

/* ---- session_rx.c (loop thread) ---- */

/* tdp__plane_up.schema, .data and .landed */
void tdp__pipe_up_schema(void *owner, tdp__link *l, const tdp__frame *f, const void *json,
                         size_t length);
void tdp__pipe_up_data(void *owner, tdp__link *l, const tdp__frame *f, void *desc);
void tdp__pipe_up_landed(void *owner, tdp__link *l, uint32_t slot, tdp_err st);
/* Give the peer the credit this side owes. */
void tdp__pipe_send_credit(tdp_pipe *p);
bool tdp__pipe_credit_idle(void *arg);
void tdp__pipe_deliver(tdp_pipe *p);
/* A receive op (tdp__op_submit / tdp__op_run). */
void tdp__pipe_recv_start(void *arg);
/* Releases made on other threads (p->rel_task). */
void tdp__pipe_release_task(void *arg);

/* ---- session_tx.c (loop thread) ---- */

/* tdp__plane_up.credit and .sent */
void tdp__pipe_up_credit(void *owner, tdp__link *l, uint64_t total);
void tdp__pipe_up_sent(void *owner, tdp__link *l, void *cookie, tdp_err st);
/* Post what the send queue may post now. */
void tdp__pipe_send_kick(tdp_pipe *p);
/* A send op (tdp__op_submit / tdp__op_run). */
void tdp__pipe_send_start(void *arg);

/* ---- session_hello.c (loop thread) ---- */

void tdp__pipe_send_hello(tdp_pipe *p);
/* A fresh control channel (at creation, and for each reconnect). */
void tdp__pipe_ctl_setup(tdp_pipe *p);
/* A link per candidate plane. */
tdp_err tdp__pipe_make_links(tdp_pipe *p);

/* ---- session_reconnect.c (loop thread) ---- */

void tdp__pipe_begin_reconnect(tdp_pipe *p, tdp_err err, const char *why);
void tdp__pipe_retry_cb(evutil_socket_t fd, short what, void *arg);

/*
 * ---- session_prepare.c, for the files above it (loop thread) ----
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
