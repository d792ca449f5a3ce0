/*
 * plane.h (internal): a data plane — what carries a pipe's frames (SCHEMA,
 * DATA, CREDIT) and payloads once the control channel has done the HELLO.
 *
 * A plane is a const table of operations (struct tdp__plane_ops) and a
 * per-pipe object, its link. The pipe's state machine (session*.c) owns the
 * rules — schema once then data, sequence numbers, credits, lending, clean
 * end vs failure — and calls the plane only through the table; the plane
 * reports back only through the tdp__plane_up callbacks it was given, and
 * never includes the session's internals. docs/planes.md is the guide.
 *
 * Lifetime of a link: link_new (when the pipe is made, so that frames a
 * fast peer sends before this side has read its HELLO have a home), then
 * link_start (after HELLO, with the peer's records), then link_close (the
 * session is done with it: no up-call is made after it returns). A closed
 * link frees itself once the transport has let go of every buffer it
 * holds (sends and receives in flight), which may be later than the
 * session's own end; the plane's per-loop state frees what is left when
 * the loop goes.
 *
 * Everything runs on the loop thread.
 */
#ifndef TDP_PIPE_PLANE_H
#define TDP_PIPE_PLANE_H

#include <stdbool.h>
#include <stdint.h>
#include <tdpipe/loop.h>
#include <tdpipe/pipe.h>

#include "../schema/td_int.h"
#include "wire.h"

typedef struct tdp__link tdp__link;

/* Most receive buffers a pipe holds (recv_depth is clamped to it). */
#define TDP_MAX_DEPTH 64u

/*
 * The receive window: how many messages of a layout of `bytes` bytes may
 * be in flight to a receiver with `depth` buffers that granted `window`
 * bytes (its HELLO's TDP_HX_WINDOW; 0: none). Each message counts whole
 * 4 KiB pages, so a small layout gets window / 4 KiB messages, never fewer
 * than depth nor more than TDP_MAX_DEPTH. Both sides compute it from the
 * same three numbers: the sender to hold back, the receiver to check the
 * sender and to size its storage for the layout (at most
 * max(depth x bytes, window) bytes).
 */
static inline uint32_t tdp__window(uint32_t depth, uint64_t window, uint64_t bytes)
{
    uint64_t pages = bytes / 4096u + (bytes % 4096u != 0) + (bytes == 0);
    uint64_t w = window / (pages * 4096u);
    if (w <= depth)
        return depth;
    return w > TDP_MAX_DEPTH ? TDP_MAX_DEPTH : (uint32_t)w;
}

/*
 * What memory a plane can carry (tdp__plane_ops.mem, link_mem). The
 * session never hands a plane a message in memory its mask lacks: the send
 * ends with TDP_ENOTSUP (docs/planes.md, "Memory").
 */
#define TDP__MEM_HOST        (1u << 0) /* host memory */
#define TDP__MEM_CUDA        (1u << 1) /* CUDA device pointers, given to the transport as they are */
#define TDP__MEM_CUDA_STAGED (1u << 2) /* CUDA device buffers, copied through host memory */
#define TDP__MEM_ANY_CUDA    (TDP__MEM_CUDA | TDP__MEM_CUDA_STAGED)

/* A frame as the session sees it, whatever carried it. */
typedef struct tdp__frame {
    uint8_t type;    /* TDP_AM_SCHEMA / TDP_AM_DATA */
    uint64_t seq;
    uint64_t hash;   /* schema hash */
    uint64_t length; /* payload bytes (schema JSON or data) */
    uint64_t arg;    /* SCHEMA: total bytes of the layout */
    bool has_sum;    /* DATA: the sender's checksum of the payload came with it */
    uint64_t sum;    /* XXH3-64 of the payload (checksum.h) */
    bool prepare;    /* SCHEMA: sent by tdp_pipe_prepare (TDP_AM_F_PREPARE): answer READY */
} tdp__frame;

/* What a plane tells the session; owner is the session's pipe. */
typedef struct tdp__plane_up {
    /* A SCHEMA frame: json is valid during the call only. */
    void (*schema)(void *owner, tdp__link *l, const tdp__frame *f, const void *json, size_t len);
    /*
     * A DATA frame announced; desc is the plane's handle for it, valid
     * during the call. The session checks it and either calls
     * ops->recv(link, desc, slot) or fails the pipe.
     */
    void (*data)(void *owner, tdp__link *l, const tdp__frame *f, void *desc);
    /* The peer's running count of released buffers. */
    void (*credit)(void *owner, tdp__link *l, uint64_t total);
    /* A receive that ops->recv left in progress ended (TDP_OK: slot holds the message). */
    void (*landed)(void *owner, tdp__link *l, uint32_t slot, tdp_err st);
    /* A send finished: its buffer may be reused (TDP_OK: the transport has the bytes). */
    void (*sent)(void *owner, tdp__link *l, void *cookie, tdp_err st);
    /* The link failed (the transport saw the peer die); the session ends. */
    void (*failed)(void *owner, tdp__link *l, tdp_err st, const char *why);
} tdp__plane_up;

/* What a plane learns at link_start. */
typedef struct tdp__link_peer {
    const tdp_hello *hello; /* the peer's (records valid during the call) */
    bool same_host;      /* the host ids match and the control socket proves it (local) */
    bool local;          /* the control socket proves one network stack (tdp__ctl.peer_local) */
    uint32_t peer_depth; /* buffers the peer holds: most sends in flight */
    uint32_t depth;      /* buffers this side holds */
    /* the receive windows (tdp__window), bytes, 0 for none: the peer's,
     * which bounds this side's sends, and this side's own */
    uint64_t peer_window, window;
    uint64_t peer_caps;  /* the peer's HELLO caps (TDP_CAP_MEM_*: what memory it takes) */
    tdp_peer_mode mode;  /* this side's option */
    uint64_t max_json_bytes, max_total_bytes; /* this side's schema limits */
    /* the pipe's control channel (the tcp plane rides it) */
    struct tdp__ctl *ctl;
    /* seq of the last DATA this side sent before this link (a reconnected
     * pipe goes on from there; 0 for a fresh one): the next is sent_seq + 1 */
    uint64_t sent_seq;
    /* tdp_pipe_opts.cuda_device: the GPU this pipe's payloads live on, -1
     * for none; a plane that stages GPU payloads sets up for it now */
    int cuda_device;
    /* the payload checksum is in force: every DATA sent carries the sum of
     * its host bytes (tdp__sum_tx), and every DATA received must carry one */
    bool checksum;
} tdp__link_peer;

/* A send: the session has checked credit and order. */
typedef struct tdp__tx {
    tdp_td *td;
    uint64_t seq;
    const tdp_schema *schema; /* non-NULL: send this schema first */
    uint64_t credit;          /* this side's released count, ridden along if the plane can */
    void *cookie;             /* given back in up->sent */
    bool urgent; /* a blocking call waits for it: send it now, never held to join others */
} tdp__tx;

typedef struct tdp__plane_ops {
    const char *name;
    uint8_t id; /* TDP_PLANE_* */
    uint32_t mem; /* TDP__MEM_*: the most this plane can carry in this build */
    /*
     * Optional: what this link can carry, a subset of mem, known once the
     * transport is up (the ucx plane asks UCX). NULL: mem.
     */
    uint32_t (*link_mem)(const tdp__link *l);
    /*
     * Records this side's HELLO carries for the plane (token, addresses,
     * names). TDP_OK with nothing added is fine.
     */
    tdp_err (*hello_fill)(tdp__link *l, tdp_hello *h);
    /*
     * Optional: records that may exist only once the peer has proven it
     * holds the shared secret (a same-host worker's address), for this
     * side's PROVEN frame (wire.h). Called on the plane the two HELLOs
     * choose, when both offered PROVEN; the peer's PROVEN records reach
     * link_start among its HELLO's. TDP_OK with nothing added is fine.
     */
    tdp_err (*proven_fill)(tdp__link *l, const tdp_hello *peer, bool same_host, tdp_hello *out);
    /*
     * Optional: check the plane's records in a peer's HELLO (wire.c only
     * frames them). TDP_OK when they are absent; TDP_EPROTO when malformed:
     * the pipe fails, whichever plane it would have chosen.
     */
    tdp_err (*hello_check)(const tdp_hello *peer);
    /*
     * Can this plane serve a pipe to this peer? Must give the same answer
     * on both sides (it sees the peer's HELLO and same_host only).
     */
    bool (*usable)(const tdp_hello *peer, bool same_host);
    /*
     * Optional, in place of usable: the same question for a plane whose
     * answer needs this side's own record too. mine is this side's link of
     * the plane, NULL when this side does not offer it (then the answer
     * must be false, as the peer's is for a HELLO without the record).
     */
    bool (*usable_link)(const tdp__link *mine, const tdp_hello *peer, bool same_host);
    /*
     * Optional: told right after link_new what GPU the pipe names
     * (tdp_pipe_opts.cuda_device, -1 for none), before hello_fill. An error
     * drops the plane from this pipe's offer (cuda-ipc: no GPU named).
     */
    tdp_err (*link_device)(tdp__link *l, int cuda_device);

    tdp_err (*link_new)(tdp_loop *loop, void *owner, const tdp__plane_up *up, tdp__link **out);
    tdp_err (*link_start)(tdp__link *l, const tdp__link_peer *peer);
    /* peer_gone: the control channel says the peer process or host is
     * gone (nothing it holds will ever be given back: do not wait for it) */
    void (*link_close)(tdp__link *l, bool peer_gone);
    /* True while the transport still holds send or receive buffers. */
    bool (*link_busy)(const tdp__link *l);

    /* Send (schema if asked, then data). Completion through up->sent. */
    tdp_err (*send)(tdp__link *l, const tdp__tx *tx);
    /* Tell the peer how many buffers this side released (NULL: releases say it). */
    tdp_err (*credit)(tdp__link *l, uint64_t total);
    /* A new receive layout was accepted: prepare storage for slots 0..depth-1. */
    tdp_err (*rx_schema)(tdp__link *l, tdp_schema *sc, uint32_t depth);
    /*
     * Receive the announced DATA into slot: *td is the message's view.
     * TDP_OK: landed now; TDP_EAGAIN: up->landed follows; else failed.
     */
    tdp_err (*recv)(tdp__link *l, void *desc, uint32_t slot, tdp_td **td);
    /* The message in slot was released by the application. */
    void (*release)(tdp__link *l, uint32_t slot);
    /* Lend a send buffer from the plane's own pool (NULL: no loans). */
    tdp_err (*loan)(tdp__link *l, tdp_schema *sc, tdp_td **out);
    /*
     * Optional: take any credit the peer has already given back, without
     * waiting (it may call up->credit). The session calls it before it
     * counts a send as waiting for credit, so that a release that arrived
     * while nobody drove the loop is not mistaken for a slow receiver.
     * NULL: credit comes only through the plane's progress.
     */
    void (*poll_credit)(tdp__link *l);
    /*
     * Optional: tdp_pipe_prepare. Set up this side's send path for sc off
     * any message's path (pools, bounces, pages faulted in) and, when
     * send_schema, announce sc to the peer as the layout of DATA seq on.
     * *sent: the schema went (the session then does not send it again);
     * *await: the peer answers with a READY once its storage is ready (a
     * plane whose peer needs nothing before the DATA says false). A plane
     * not up yet returns TDP_EAGAIN (the session tries again shortly).
     * NULL: tdp_pipe_prepare gives TDP_ENOTSUP.
     */
    tdp_err (*prepare)(tdp__link *l, tdp_schema *sc, uint64_t seq, bool send_schema, bool *sent,
                       bool *await);
    /*
     * Optional: a running count that grows whenever part of a payload
     * still in flight comes in (a chunk frame, a fetch landing). After the
     * peer's BYE the session waits for what it announced as long as this
     * (or the DATA count) keeps moving. NULL: a plane whose payloads come
     * before the BYE, or land whole (tcp: the same socket; shm: in place).
     */
    uint64_t (*rx_progress)(const tdp__link *l);
} tdp__plane_ops;

extern const tdp__plane_ops tdp__plane_ucx;
extern const tdp__plane_ops tdp__plane_tcp; /* any peer, host memory, on the control socket */
#ifdef __linux__
#define TDP_HAVE_SHM_PLANE 1
extern const tdp__plane_ops tdp__plane_shm; /* same host, host memory; Linux only */
extern const tdp__plane_ops tdp__plane_cuda_ipc; /* same host, GPU pools (plane_shm.c's link) */
#endif

/*
 * The registry: the planes this build has, in this library's order of
 * preference (position 0 first), then the test planes. At most
 * TDP__PLANES_MAX in all (the wire's TDP_MAX_PLANES), so arrays sized by it
 * hold every plane a pipe may offer.
 */
#define TDP__PLANES_MAX TDP_MAX_PLANES
size_t tdp__plane_count(void);
const tdp__plane_ops *tdp__plane_at(size_t i); /* NULL past the end */
const tdp__plane_ops *tdp__plane_by_id(uint8_t id);
const tdp__plane_ops *tdp__plane_by_name(const char *name);

/*
 * For tests: planes this build does not have (tests/fake_plane.c, an
 * in-memory one), so the session's rules can be checked without any
 * transport. Their ids lie in TDP__PLANE_TEST_MIN..TDP__PLANE_TEST (below
 * 32: they fit the planes_forbidden mask); the session offers them after the
 * real planes, and a test forces one with tdp_pipe_opts.plane = its id.
 * register_test makes ops the only test plane (NULL takes them all away);
 * add_test appends one: TDP_EINVAL for an id out of range or taken,
 * TDP_ELIMIT once the registry is full. Call them while no pipe exists;
 * not thread-safe.
 */
#define TDP__PLANE_TEST     31
#define TDP__PLANE_TEST_MIN 16
void tdp__plane_register_test(const tdp__plane_ops *ops);
tdp_err tdp__plane_add_test(const tdp__plane_ops *ops);

#endif
