/*
 * plane_shm.c: the same-host data plane. The sender owns a pool of slots in
 * a sealed memfd (shm.h) that the receiver maps; a message is a slot the
 * sender filled (or lent to the application to fill) and a 32-byte DATA
 * descriptor on a ring; the receiver's view of it is the slot itself, and
 * releasing the view puts a RELEASE descriptor on the way back, which is the
 * sender's credit. No byte of a payload is copied on a loaned send; a plain
 * send of an ordinary tensordict copies it once, into a slot.
 *
 * Per direction of a pipe (each side may send), the sender makes:
 *  - one control segment: its two rings and their eventfd doorbells (the
 *    segment's own single slot is unused);
 *  - a pool segment per generation: `nslots` slots of `stride` bytes. A
 *    schema larger than the pool's stride makes a new generation; the old
 *    pool goes once every slot of it is back and no loan of it is out.
 *
 * The Unix socket. Each loop listens on one abstract SOCK_SEQPACKET name,
 * announced in the HELLO with a random 16-byte key per link. Once both
 * HELLOs are known, the side with the smaller key connects to the other's
 * name and proves itself with a PROOF message carrying both keys (a
 * process of our uid that only knows the name gets nowhere). The socket
 * then carries, in order, the messages that announce what descriptors will
 * refer to: CTL (the control segment, once), POOL (a pool generation), and
 * SCHEMA (the layout JSON, inline or, when large, in a sealed memfd). POOL
 * and SCHEMA carry the sequence number of the DATA they come into force
 * at; the receiver reads the socket eagerly into a bounded queue and
 * applies each entry just before that DATA, so a descriptor is never read
 * against a pool or layout it was not written for. The socket also tells
 * each side when the other process is gone (EOF).
 *
 * Trust: the peer is another process of our uid and may be hostile. Every
 * fd is checked for what it claims to be, every segment header against the
 * layout this side recomputes (shm_seg.c), every descriptor field (type,
 * generation, slot, state of that slot) against private state before use;
 * a slot index never reaches memory unchecked. A bad message or descriptor
 * fails the link with TDP_EPROTO. Views the receiver lent stay readable
 * after the sender dies (the mapping lives as long as a view does; sealed
 * memfds cannot shrink, so no SIGBUS).
 *
 * The cuda-ipc plane (tdp__plane_cuda_ipc, at the end) is this link with
 * one difference: a GPU payload goes in a pool of device memory (a DPOOL
 * message announces it with its exported handle, src/pipe/cudaipc/), so
 * the receiver views the sender's device slots as it views host ones.
 *
 * Everything runs on the loop thread, except the release of the last
 * reference to a tensordict view, which may happen on any thread: pools are
 * reference counted with atomics for that.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <event2/event.h>

#include "../checksum.h"
#include "../plane.h"
#include "../stage.h"
#include "plane_shm.h"
#include "shm.h"
#include "shm_hello.h"
#include "../cudaipc/cudaipc.h"
#include "../../core/env.h"
#include "../../core/alloc.h"
#include "../../core/cuda.h"
#include "../../core/log.h"
#include "../../core/populate.h"
#include "../../core/loop_int.h"
#include "../../core/reap.h"

/* ---- socket messages ---------------------------------------------------------- */

#define MSG_MAGIC      0x314d5350u /* "PSM1" */
#define MSG_INLINE_MAX (32u * 1024u) /* larger JSON travels in a memfd */
#define MSG_HDR_BYTES  80u
/*
 * Announcements not yet in force, per link, scaled by this side's own depth
 * (never the peer's word): each DATA in flight (at most depth) may bring a
 * SCHEMA and a POOL, and each loan the sender holds (at most depth) a POOL.
 * More is a protocol error. Until in force a POOL holds its three fds and
 * is not mapped, and a SCHEMA holds its inline JSON (at most
 * MSG_INLINE_MAX bytes) or its memfd, not yet read.
 */
#define PEND_POOLS(depth)   (2u * (depth) + 1u)
#define PEND_SCHEMAS(depth) ((depth) + 1u)
#define MAX_GEN        0x00ffffffu                /* generations fit 24 bits of a descriptor */
#define ACCEPT_PENDING 64u /* connections not yet proven, per loop */

/*
 * MSG_DPOOL (cuda-ipc links only): a pool of device slots, in force as a
 * POOL. json_len: slots; total: stride; hash: the bytes its handle maps
 * (the driver's allocation, rounded up); key: the pool's id (cudaipc.h);
 * peer_key: the UUID of its device; one fd (its POSIX handle), or none and
 * the legacy handle as the message's tail (MSG_F_LEGACY).
 */
enum msg_type { MSG_PROOF = 1, MSG_CTL = 2, MSG_POOL = 3, MSG_SCHEMA = 4, MSG_DPOOL = 5 };
#define MSG_F_JSON_FD 1u
#define MSG_F_LEGACY  2u
#define LEGACY_LEN    64u

typedef struct shm_msg {
    uint32_t magic;
    uint16_t type;
    uint16_t flags;
    uint32_t gen; /* CTL, POOL: the segment's generation */
    uint32_t pad;
    uint64_t seq;      /* POOL, SCHEMA: the DATA it comes into force at */
    uint64_t hash;     /* SCHEMA */
    uint64_t json_len; /* SCHEMA */
    uint64_t total;    /* SCHEMA: the layout's bytes */
    uint8_t key[TDP_SHM_KEY_LEN];      /* PROOF: the listening side's key */
    uint8_t peer_key[TDP_SHM_KEY_LEN]; /* PROOF: the connecting side's key */
} shm_msg;
_Static_assert(sizeof(shm_msg) == MSG_HDR_BYTES, "socket message header is 80 bytes");

/* Descriptor type word: the low byte is the type, the rest the pool generation. */
#define DESC_TYPE(w) ((w) & 0xffu)
#define DESC_GEN(w)  ((w) >> 8)
#define DESC_WORD(type, gen) ((uint32_t)(type) | ((uint32_t)(gen) << 8))

/* ---- state ---------------------------------------------------------------------- */

typedef struct shm_ext shm_ext;
typedef struct tx_pool tx_pool;
typedef struct tx_group tx_group;
typedef struct rx_pool rx_pool;

/* A sender's slot. td: a view of the slot for lending (the link holds a
 * reference; more references mean the application holds a loan). */
typedef struct tx_slot {
    tx_pool *pool;
    tdp_td *td;
    uint32_t idx;
    uint64_t held;  /* the group's links it is in flight on: sent, not yet released */
    bool parked;    /* held by a link that closed while its peer lives: never reused */
    bool staging;   /* reserved for a send whose copy into it runs: not sent yet */
} tx_slot;

struct tx_pool {
    _Atomic uint32_t refs; /* the link's, plus one per slot view alive */
    tdp__shm_seg *seg;
    tdp__dpool *dp; /* cuda-ipc: device slots instead of seg */
    uint32_t gen, nslots, nflight; /* nflight: holds, a link's bit on a slot each */
    uint64_t stride;
    tx_slot *slots;
    tx_pool *next;   /* older generations still out */
    tdp__cuda_pin *pin; /* page-locked with the CUDA driver (GPU copies), or being */
    bool populated;  /* its slots' pages faulted in (s_prepare) */
};

/*
 * The pools some links send from: a link's own (one pipe), or shared by
 * several links of one loop (tdp__shm_link_share), so that one slot goes
 * to each of their peers without a copy. A slot says which links hold it
 * (one bit each, so at most 64 links a group); a release is checked
 * against the releasing link's bit, and a link that goes gives its bits
 * back. Generations count per group; each link announces to its own peer
 * the generation it sends from when that peer has not seen it yet.
 * Loop thread only.
 */
struct tx_group {
    uint32_t refs; /* links that point at it, in it or gone from it */
    uint64_t bits; /* the bits of the links in it */
    tx_pool *pool; /* current generation; older ones in pool->next */
    uint32_t next_gen;
    bool stale; /* the current pool has parked slots and none free: make a new one */
    /* a group loan found no slot free: every link of the group asks to be
     * woken by a release (one of any of them frees a slot) */
    bool starved;
};

typedef struct rx_slot {
    rx_pool *pool;
    tdp_td *td; /* a view for the current receive layout (built on first use) */
    bool held;  /* with the session: received, not yet released */
} rx_slot;

struct rx_pool {
    _Atomic uint32_t refs; /* the link's, plus one per view alive */
    tdp__shm_seg *seg;
    tdp__dpool *dp;                 /* cuda-ipc: device slots instead of seg */
    uint8_t uuid[TDP_CUDAIPC_UUID]; /* dp: its device, as announced */
    uint32_t gen, nslots, nheld;
    uint64_t stride;
    rx_slot *slots;
    rx_pool *next;      /* retired generations with slots still held */
    tdp__cuda_pin *pin; /* page-locked with the CUDA driver (GPU copies), or being */
};

/* An announcement read from the socket, waiting for its DATA. */
typedef struct pend_msg {
    shm_msg m;
    char *json; /* SCHEMA, inline */
    uint8_t legacy[LEGACY_LEN]; /* DPOOL without an fd: its legacy handle */
    int fds[3]; /* POOL: its segment's three; SCHEMA in a memfd: fds[0] */
    uint32_t nfds;
    /* the first pool pending is opened as it comes, the others at their DATA */
    tdp__dpool *dp;    /* DPOOL: imported */
    tdp__shm_seg *seg; /* POOL: mapped */
    tdp__cuda_pin *pin; /* seg page-locked (with a stage), or being */
} pend_msg;

/* A send that came before the socket was up. */
typedef struct early_tx {
    tdp__tx tx;
} early_tx;

/*
 * A send whose payload is being copied into its slot (from a GPU, or a
 * host send queued behind one so that descriptors keep their order); its
 * descriptor goes out when the copy has landed.
 */
typedef struct staged_tx {
    tdp__stage_copy copy; /* first: the callback finds the record from it */
    struct tdp__link *l;
    tx_slot *s;
    tdp__tx tx;  /* holds a reference on tx.td */
    bool posted; /* streamed: its descriptor went before the copy */
} staged_tx;

/* A receive being copied from its slot into the session slot's device buffer. */
typedef struct staged_rx {
    tdp__stage_copy copy; /* first */
    struct tdp__link *l;
    uint32_t slot;
    _Atomic uint64_t *prog; /* streamed: the sender's progress word */
} staged_rx;

/*
 * GPU copies: chunks in flight per copy, and their size: 64 MiB, or
 * TDPIPE_STAGE_CHUNK_KIB (256 KiB to 64 MiB, read once; a tuning knob for
 * measuring, docs/gpu.md). On an H100, 100 MB staged between two
 * processes went at 41.7 GB/s in 64 MiB chunks, 26.5 in 16 MiB and 28.5
 * in 4 MiB (one run each, docs/benchmarks.md): each chunk costs a turn of
 * both processes' copies on the one GPU, more than the overlap of a
 * streamed message's chunks gains.
 */
#define STAGE_INFLIGHT 4u
static size_t stage_chunk(void)
{
    static _Atomic size_t chunk;
    size_t c = atomic_load_explicit(&chunk, memory_order_relaxed);
    if (c == 0) {
        c = tdp__env_kib("TDPIPE_STAGE_CHUNK_KIB", 64u << 20, 256, 64u << 10, false);
        atomic_store_explicit(&chunk, c, memory_order_relaxed);
    }
    return c;
}
#define STAGE_CHUNK (stage_chunk())

/*
 * Streaming: a GPU payload of STREAM_MIN bytes or more has its descriptor
 * sent when its copy into the slot starts, and the sender publishes the
 * bytes landed so far in a progress word, one per seq modulo
 * PROGRESS_WORDS (more than the most sends in flight), in the control
 * segment's slot; a receiver with a GPU layout copies each chunk out as it
 * lands, one with a host layout waits for the whole message.
 */
#define STREAM_MIN     (2u * STAGE_CHUNK)
#define PROGRESS_WORDS (2u * TDP_MAX_DEPTH)
struct tdp__link {
    shm_ext *x;
    void *owner;
    const tdp__plane_up *up;
    uint8_t key[TDP_SHM_KEY_LEN], peer_key[TDP_SHM_KEY_LEN], proof_key[TDP_SHM_KEY_LEN];
    uint8_t hello_rec[TDP_SHM_REC_MAX]; /* this side's TDP_HX_SHM value */
    bool started, closed, failed, proven;
    bool peer_dead; /* closed because the peer process or host is gone */
    int sock;
    struct event *sev;
    tdp__reap reap;
    struct tdp__link *next, *prev;
    uint32_t depth, peer_depth;
    uint64_t window, peer_window; /* receive windows, bytes (tdp__window); 0: none */
    uint32_t tx_win_now;          /* the window of the layout last sent */
    uint64_t max_json, max_total;
    /* the payload checksum is in force: a DATA descriptor's arg is the sum
     * of the slot's bytes instead of their count (the layout says that) */
    bool sum_on;

    /* sending */
    tdp__shm_seg *tx_ctl;
    tdp__source *tx_src; /* the release ring */
    bool tx_armed;       /* its doorbell may hold a wakeup to reset */
    uint32_t tx_skips, rx_skips;
    tx_group *grp;               /* the pools this link sends from */
    uint64_t bit;                /* this link's bit in its group */
    uint32_t ann_gen;            /* the newest generation announced to the peer */
    uint64_t last_seq, released; /* released: counted from this link's start */
    uint64_t seq0;               /* seq of the last DATA sent before this link */
    uint64_t prep_ann_seq;       /* s_prepare announced a schema for this DATA seq (0: none) */
    bool loan_starved; /* a loan was refused for want of a free slot */
    /* seqs of POOLs announced that the receiver may not have in force yet */
    uint64_t pool_ann[PEND_POOLS(TDP_MAX_DEPTH)];
    uint32_t pool_ann_head, npool_ann;
    bool in_tx_progress; /* tx_progress is on the stack (poll_credit does not nest) */
    early_tx *early; /* sends waiting, oldest first: for the socket, or for a slot */
    uint32_t nearly, capearly;
    /* early holds sends that found every slot of the shared group held:
     * they go, in order, when one is released (shm_ext.slot_ev) */
    bool slot_wait;

    /* receiving */
    tdp__shm_seg *rx_ctl;
    tdp__source *rx_src; /* the data ring */
    bool rx_armed;
    rx_pool *rpool;      /* in force; retired ones in rpool->next */
    uint32_t last_gen;
    pend_msg *pend; /* a ring of pend_cap */
    uint32_t pend_head, npend, pend_cap, npend_pools, npend_schemas;
    tdp_schema *rx_schema;
    uint64_t rx_hash;
    rx_slot *held[TDP_MAX_DEPTH]; /* by session slot */
    tdp_td *staged[TDP_MAX_DEPTH]; /* GPU receive layouts: device buffers by session slot */
    struct dev_store *dstore[TDP_MAX_DEPTH]; /* their storage, kept across layouts */

    /* GPU payloads (stage.h): the link's stream, made at start when the pipe
     * names a device (tdp_pipe_opts.cuda_device), else at the first GPU payload */
    tdp__stage *stage;
    int cuda_device;
    staged_tx *stx; /* a ring, in seq order: copies land in start order */
    uint32_t stx_head, nstx, capstx;
    uint32_t stx_unposted;        /* staged sends whose descriptor waits for their copy */
    staged_rx srx[TDP_MAX_DEPTH]; /* by session slot */
    uint32_t nsrx;                /* receives copying */
    uint32_t nstream;             /* of them, streamed ones still following the sender */
    tdp__shm_desc parked;         /* a streamed DATA waiting for all its bytes */
    bool has_parked;
    bool peer_gone; /* the socket said so while receives were copying: told after them */

    /* cuda-ipc (tdp__plane_cuda_ipc): GPU payloads in device pools */
    bool ipc;
    int ipc_dev;                          /* the pipe's GPU (link_device) */
    uint8_t ipc_rec[TDP_SHM_IPC_REC_MAX]; /* this side's HELLO record */
    size_t ipc_rec_len;
    uint8_t peer_rec[TDP_SHM_IPC_REC_MAX]; /* the peer's, copied at start */
    tdp__shm_ipc_hello peer_ipc;           /* read from peer_rec */
    int8_t ipc_reach[TDP_CUDAIPC_DEVS];    /* by device: 1 the peer sees it, -1 not, 0 unknown */
};

typedef struct pending_conn {
    shm_ext *x;
    int fd;
    struct event *ev;
    struct pending_conn *next, *prev;
} pending_conn;

struct shm_ext {
    tdp_loop *loop;
    int lfd;
    char name[TDP__SHM_NAME_LEN];
    struct event *lev;
    struct event *resume; /* accepting paused: out of descriptors */
    struct event *slot_ev; /* a slot of a shared group came back: waiting links send */
    uint32_t slot_waits;   /* links with slot_wait set */
    struct tdp__link *links;
    pending_conn *conns;
    uint32_t nconns;
};

static void link_fail(struct tdp__link *l, tdp_err st, const char *why);
static void link_flush_early(struct tdp__link *l);
static void sock_arm(struct tdp__link *l);
static void slot_wait_set(struct tdp__link *l, bool on);
static void group_slot_back(struct tdp__link *l);

/* ---- pools ------------------------------------------------------------------------- */

/* Pools mapped by a receiver, mappings page-locked (tdp__shm_rx_pools_mapped). */
static _Atomic uint64_t rx_pools_mapped, pools_pinned;

/*
 * Page-lock a pool's mapping once, so the link's GPU copies run at pinned
 * speed straight from or into the slots (pageable memory makes the driver
 * bounce them through its own buffers, synchronously). now: before this
 * returns (a prepare, off the messages' path); else on a thread of its own
 * (a pool made by a send, or announced with one): cuMemHostRegister of a
 * 100 MB layout's 8 slots took 449 ms on an H200, and the copies of the
 * messages that come meanwhile go at pageable speed rather than wait for
 * it. Failure only costs speed. NULL for a device pool.
 */
static tdp__cuda_pin *seg_pin(tdp__shm_seg *seg, bool now)
{
    if (seg == NULL)
        return NULL; /* a device pool */
    tdp__cuda_pin *pin = NULL;
    tdp_err rc =
        tdp__cuda_pin_new(tdp__shm_seg_base(seg), tdp__shm_seg_geom(seg)->total_bytes, now, &pin);
    if (rc != TDP_OK)
        tdp_log_debug("shm: pool not page-locked (%s): GPU copies go at pageable speed",
                      tdp_strerror(rc));
    else
        atomic_fetch_add_explicit(&pools_pinned, 1, memory_order_relaxed);
    return pin;
}

/* Slot i of a pool's memory (either side's), host or device. */
static void *pool_mem(const tdp__shm_seg *seg, const tdp__dpool *dp, uint64_t stride, uint32_t i)
{
    if (dp != NULL)
        return (uint8_t *)tdp__dpool_base(dp) + (uint64_t)i * stride;
    return tdp__shm_seg_slot(seg, i);
}

/* A pool's memory and slot table go (either side's, its last reference gone). */
static void pool_mem_free(tdp__shm_seg *seg, tdp__cuda_pin *pin, tdp__dpool *dp, void *slots)
{
    tdp__cuda_pin_end(pin); /* before the mapping goes */
    tdp__shm_seg_close(seg);
    tdp__dpool_unref(dp);
    tdp__free(slots);
}

static void tx_pool_unref(tx_pool *p)
{
    if (atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) != 1)
        return;
    pool_mem_free(p->seg, p->pin, p->dp, p->slots);
    tdp__free(p);
}

/* Slot i of a sender's pool, host or device. */
static void *tx_mem(const tx_pool *p, uint32_t i)
{
    return pool_mem(p->seg, p->dp, p->stride, i);
}

static void tx_view_gone(void *buf, void *arg)
{
    (void)buf;
    tx_pool_unref(((tx_slot *)arg)->pool);
}

/* The link lets a pool go: its views (and with them the mapping) go with the
 * last loan the application still holds. */
static void tx_pool_drop(tx_pool *p)
{
    for (uint32_t i = 0; i < p->nslots; i++) {
        tdp_td *td = p->slots[i].td;
        p->slots[i].td = NULL;
        tdp_td_unref(td);
    }
    tx_pool_unref(p);
}

static void rx_pool_unref(rx_pool *p)
{
    if (atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) != 1)
        return;
    pool_mem_free(p->seg, p->pin, p->dp, p->slots);
    tdp__free(p);
}

/* Slot i of a received pool (i checked by the caller), host or device. */
static void *rx_mem(const rx_pool *p, uint32_t i)
{
    return pool_mem(p->seg, p->dp, p->stride, i);
}

static void rx_view_gone(void *buf, void *arg)
{
    (void)buf;
    rx_pool_unref(((rx_slot *)arg)->pool);
}

static void rx_pool_drop(rx_pool *p)
{
    for (uint32_t i = 0; i < p->nslots; i++) {
        tdp_td *td = p->slots[i].td;
        p->slots[i].td = NULL;
        tdp_td_unref(td);
    }
    rx_pool_unref(p);
}

/* A slot is free when no link has it in flight and no loan of it is out. */
static bool tx_slot_free(const tx_slot *s)
{
    return s->held == 0 && !s->parked &&
           (s->td == NULL || atomic_load_explicit(&s->td->refs, memory_order_acquire) == 1);
}

static uint64_t page_round(uint64_t n)
{
    return (n + TDP__SHM_PAGE - 1) / TDP__SHM_PAGE * TDP__SHM_PAGE;
}

/* The progress word of message seq in a control segment (its slot, checked at map). */
static _Atomic uint64_t *progress_word(const tdp__shm_seg *ctl, uint64_t seq)
{
    return (_Atomic uint64_t *)tdp__shm_seg_slot(ctl, 0) + seq % PROGRESS_WORDS;
}

/* Slots a sender's pool has: the receiver's depth in flight, and as many loans. */
static uint32_t pool_slots(uint32_t peer_depth)
{
    return peer_depth + (peer_depth < 2 ? 2 : peer_depth);
}

/* Messages of `bytes` that may be in flight to the peer (its depth, or its window). */
static uint32_t tx_win(const struct tdp__link *l, uint64_t bytes)
{
    return tdp__window(l->peer_depth, l->peer_window, bytes);
}

/* Messages of `bytes` this side lets the peer have in flight to it. */
static uint32_t rx_win(const struct tdp__link *l, uint64_t bytes)
{
    return tdp__window(l->depth, l->window, bytes);
}

/* ---- GPU staging --------------------------------------------------------------------- */

/*
 * The link's stage, made now if need be: at link start when the pipe named
 * a device (so that the first GPU payload pays for neither the context,
 * the stream nor the page-locking), else at the first GPU payload or
 * layout. The pools get page-locked with it. One stage per link: the
 * driver's unified addressing lets its stream copy any device's memory.
 */
static tdp_err link_stage(struct tdp__link *l, int dev)
{
    if (l->stage != NULL)
        return TDP_OK;
    if (l->cuda_device < 0)
        tdp_log_debug("shm: GPU staging starts with the first GPU payload (no cuda_device)");
    tdp_err rc = tdp__stage_new(l->x->loop, dev < 0 ? 0 : dev, 0, &l->stage);
    if (rc != TDP_OK)
        return rc;
    for (tx_pool *p = l->grp->pool; p != NULL; p = p->next)
        if (p->pin == NULL)
            p->pin = seg_pin(p->seg, false);
    for (rx_pool *p = l->rpool; p != NULL; p = p->next)
        if (p->pin == NULL)
            p->pin = seg_pin(p->seg, false);
    return TDP_OK;
}

/* Stop every copy in flight (the stream passes them first): close and teardown. */
static void link_stage_cancel(struct tdp__link *l)
{
    if (l->stage == NULL)
        return;
    while (l->nstx > 0) {
        staged_tx *e = &l->stx[l->stx_head];
        tdp__stage_copy_cancel(l->stage, &e->copy);
        tdp_td_unref(e->tx.td);
        tdp_schema_unref((tdp_schema *)e->tx.schema);
        e->tx.td = NULL;
        l->stx_head = (l->stx_head + 1) % l->capstx;
        l->nstx--;
    }
    l->stx_unposted = 0;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        tdp__stage_copy_cancel(l->stage, &l->srx[i].copy);
    l->nsrx = l->nstream = 0;
}

/* ---- the socket ------------------------------------------------------------------- */

static tdp_err msg_send(struct tdp__link *l, shm_msg *m, const void *tail, size_t tlen,
                        const int *fds, size_t nfds)
{
    uint8_t buf[MSG_HDR_BYTES + MSG_INLINE_MAX];
    m->magic = MSG_MAGIC;
    memcpy(buf, m, MSG_HDR_BYTES);
    if (tlen > 0)
        memcpy(buf + MSG_HDR_BYTES, tail, tlen);
    tdp_err rc = tdp__shm_sock_send(l->sock, buf, MSG_HDR_BYTES + tlen, fds, nfds);
    if (rc == TDP_EAGAIN) /* the receiver reads eagerly: a full socket means it is stuck */
        rc = TDP_ECONNRESET;
    return rc;
}

/* Announce a segment: CTL or POOL. */
static tdp_err announce_seg(struct tdp__link *l, uint16_t type, const tdp__shm_seg *seg,
                            uint64_t seq)
{
    int fds[3];
    tdp__shm_seg_fds(seg, fds);
    shm_msg m = {.type = type, .gen = tdp__shm_seg_generation(seg), .seq = seq};
    return msg_send(l, &m, NULL, 0, fds, 3);
}

static tdp_err announce_schema(struct tdp__link *l, const tdp_schema *sc, uint64_t seq)
{
    size_t jl;
    const char *json = tdp_schema_json(sc, &jl);
    shm_msg m = {.type = MSG_SCHEMA,
                 .seq = seq,
                 .hash = tdp_schema_hash(sc),
                 .json_len = jl,
                 .total = tdp_schema_total_bytes(sc)};
    if (jl <= MSG_INLINE_MAX)
        return msg_send(l, &m, json, jl, NULL, 0);
    /* too large for one datagram: a sealed memfd carries it */
    int fd = memfd_create("tdpipe-schema", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return TDP_ENOMEM;
    tdp_err rc = TDP_ENOMEM;
    size_t off = 0;
    while (off < jl) {
        ssize_t w = write(fd, json + off, jl - off);
        if (w <= 0)
            goto out;
        off += (size_t)w;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0)
        goto out;
    m.flags = MSG_F_JSON_FD;
    rc = msg_send(l, &m, NULL, 0, &fd, 1);
out:
    close(fd);
    return rc;
}

/* ---- sending ------------------------------------------------------------------------ */

/* The control segment: the rings, made on the first send. */
static unsigned tx_progress(void *arg);
static int tx_arm(void *arg);
static const tdp__source_ops tx_src_ops = {.progress = tx_progress, .arm = tx_arm};

static tdp_err tx_ctl_up(struct tdp__link *l)
{
    if (l->tx_ctl != NULL)
        return TDP_OK;
    uint32_t ring = 1;
    while (ring < 2 * pool_slots(tx_win(l, 1)))
        ring <<= 1;
    tdp__shm_seg *seg;
    tdp_err rc = tdp__shm_seg_create(0, 1, TDP__SHM_PAGE, ring, &seg);
    if (rc != TDP_OK)
        return rc;
    if ((rc = announce_seg(l, MSG_CTL, seg, 0)) != TDP_OK) {
        tdp__shm_seg_close(seg);
        return rc;
    }
    rc = tdp__loop_source_add(l->x->loop, tdp__shm_ring_fd(tdp__shm_seg_rx(seg)), &tx_src_ops, l,
                              &l->tx_src);
    if (rc != TDP_OK) {
        tdp__shm_seg_close(seg);
        return rc;
    }
    l->tx_ctl = seg;
    return TDP_OK;
}

/*
 * POOLs the receiver may not have put in force: those announced for a DATA
 * past the ones it has given back (it reads DATA in order, so it has read,
 * and applied the announcements of, at least as many as it released).
 */
static uint32_t tx_pools_pending(struct tdp__link *l)
{
    while (l->npool_ann > 0 && l->pool_ann[l->pool_ann_head] <= l->seq0 + l->released) {
        l->pool_ann_head = (l->pool_ann_head + 1) % PEND_POOLS(TDP_MAX_DEPTH);
        l->npool_ann--;
    }
    return l->npool_ann;
}

/*
 * Whether the current pool is of the kind wanted (dev -1: host), holds
 * bytes per slot and is announced to the peer or may be (its generation is
 * not older than the last one announced: a link that joined a group).
 */
static bool tx_pool_fits(const struct tdp__link *l, uint64_t bytes, int dev)
{
    const tx_pool *p = l->grp->pool;
    if (p == NULL || p->stride < bytes || p->gen < l->ann_gen || l->grp->stale)
        return false;
    if (p->gen != l->ann_gen && (p->dp != NULL || p->nslots > pool_slots(tx_win(l, p->stride))))
        return false; /* a device pool is exported once; the peer maps so many slots */
    if (l->peer_window != 0 && p->nslots < pool_slots(tx_win(l, bytes)))
        return false; /* a small layout's window wants more slots than this pool has */
    return dev < 0 ? p->dp == NULL : p->dp != NULL && tdp__dpool_device(p->dp) == dev;
}

/*
 * Announce the group's current pool (host slots, made by another link of
 * the group) to this link's peer, from the next DATA on, unless it has it.
 */
static tdp_err tx_pool_announce(struct tdp__link *l)
{
    tx_pool *p = l->grp->pool;
    if (p->gen == l->ann_gen)
        return TDP_OK;
    if (tx_pools_pending(l) >= PEND_POOLS(l->peer_depth))
        return TDP_EINTERNAL; /* s_loan keeps room for every send the credit allows */
    tdp_err rc = announce_seg(l, MSG_POOL, p->seg, l->last_seq + 1);
    if (rc != TDP_OK)
        return rc;
    l->pool_ann[(l->pool_ann_head + l->npool_ann++) % PEND_POOLS(TDP_MAX_DEPTH)] = l->last_seq + 1;
    l->ann_gen = p->gen;
    return TDP_OK;
}

/* A group of one link, which takes the group's first bit. */
static tdp_err tx_group_new(struct tdp__link *l)
{
    tx_group *g = tdp__calloc(1, sizeof(*g));
    if (g == NULL)
        return TDP_ENOMEM;
    g->refs = 1;
    g->bits = 1;
    l->grp = g;
    l->bit = 1;
    return TDP_OK;
}

/* Whether a loan of p is out (the application, or a fan-out, holds a view of a slot). */
static bool tx_pool_lent(const tx_pool *p)
{
    for (uint32_t i = 0; i < p->nslots; i++)
        if (p->slots[i].held == 0 && !p->slots[i].parked && p->slots[i].td != NULL &&
            atomic_load_explicit(&p->slots[i].td->refs, memory_order_acquire) > 1)
            return true;
    return false;
}

static bool tx_pool_parked(const tx_pool *p)
{
    for (uint32_t i = 0; i < p->nslots; i++)
        if (p->slots[i].parked)
            return true;
    return false;
}

/*
 * Older pools that no link holds a slot of go (loans out keep their
 * mapping). A shared group keeps a pool a loan of which is out: other
 * links may still send it where it lies.
 */
static void tx_group_trim(tx_group *g)
{
    bool shared = (g->bits & (g->bits - 1)) != 0;
    for (tx_pool **pp = &g->pool->next; *pp != NULL;) {
        tx_pool *o = *pp;
        if (o->nflight == 0 && !(shared && tx_pool_lent(o))) {
            *pp = o->next;
            tx_pool_drop(o);
        } else {
            pp = &o->next;
        }
    }
}

/*
 * The link leaves its group (at teardown, or to join another): every slot
 * it holds is given back, as a release would, and with the last link the
 * pools go (loans the application still holds keep their mapping). In a
 * group shared with other links, a link closed while its peer lives parks
 * what it holds instead: the peer may still read those slots, so they are
 * never reused (their pool goes once nothing else of it is out). A peer
 * that is gone (killed) or failed gives them back.
 */
static void tx_group_leave(struct tdp__link *l)
{
    tx_group *g = l->grp;
    if (g == NULL || l->bit == 0)
        return;
    bool park = (g->bits & ~l->bit) != 0 && l->closed && !l->failed && !l->peer_dead;
    for (tx_pool *p = g->pool; p != NULL; p = p->next) {
        for (uint32_t i = 0; i < p->nslots; i++) {
            if ((p->slots[i].held & l->bit) != 0) {
                p->slots[i].held &= ~l->bit;
                p->slots[i].parked |= park; /* the others may let go first: still parked */
                p->nflight--;
            }
        }
    }
    g->bits &= ~l->bit;
    l->bit = 0;
    if (g->bits != 0) {
        if (g->pool != NULL)
            tx_group_trim(g);
        return;
    }
    while (g->pool != NULL) {
        tx_pool *p = g->pool;
        g->pool = p->next;
        tx_pool_drop(p);
    }
}

/* The link lets go of its group's struct (at its destruction). */
static void tx_group_unref(struct tdp__link *l)
{
    tx_group_leave(l);
    if (l->grp != NULL && --l->grp->refs == 0)
        tdp__free(l->grp);
    l->grp = NULL;
}

/*
 * A pool of device slots on dev, exported once and announced (cuda-ipc).
 * The handle's fd is this side's, closed once sent.
 */
static tdp_err tx_dpool_new(struct tdp__link *l, tx_pool *p, uint32_t n, uint64_t bytes, int dev)
{
    uint64_t stride = page_round(bytes == 0 ? 1 : bytes);
    if (stride > UINT64_MAX / n)
        return TDP_EMSGSIZE;
    uint8_t uuid[TDP_CUDAIPC_UUID];
    tdp_err rc = tdp__cuda_device_uuid(dev, uuid);
    if (rc == TDP_OK)
        rc = tdp__dpool_new(dev, stride * n, &p->dp);
    if (rc != TDP_OK)
        return rc;
    p->stride = stride;
    tdp__cuda_ipc h;
    if ((rc = tdp__dpool_export(p->dp, &h)) != TDP_OK)
        return rc;
    if (tx_pools_pending(l) >= PEND_POOLS(l->peer_depth)) {
        rc = TDP_EINTERNAL; /* s_loan keeps room for every send the credit allows */
    } else {
        shm_msg m = {.type = MSG_DPOOL,
                     .flags = h.fd < 0 ? MSG_F_LEGACY : 0,
                     .gen = p->gen,
                     .seq = l->last_seq + 1,
                     .hash = h.size,
                     .json_len = n,
                     .total = stride};
        memcpy(m.key, tdp__dpool_id(p->dp), TDP_DPOOL_ID_LEN);
        memcpy(m.peer_key, uuid, TDP_CUDAIPC_UUID);
        rc = h.fd < 0 ? msg_send(l, &m, h.legacy, LEGACY_LEN, NULL, 0)
                      : msg_send(l, &m, NULL, 0, &h.fd, 1);
    }
    if (h.fd >= 0)
        close(h.fd);
    return rc;
}

/*
 * Make a pool that holds `bytes` per slot the current one, announced from
 * the next DATA on: host slots (dev -1), or device slots on dev (cuda-ipc).
 */
static tdp_err tx_pool_grow(struct tdp__link *l, uint64_t bytes, int dev)
{
    if (tx_pool_fits(l, bytes, dev))
        return tx_pool_announce(l);
    tx_group *g = l->grp;
    if (g->next_gen < l->ann_gen)
        g->next_gen = l->ann_gen; /* the peer takes only newer generations */
    if (g->next_gen >= MAX_GEN)
        return TDP_ENOMEM;
    uint32_t gen = ++g->next_gen;
    uint32_t n = pool_slots(tx_win(l, bytes));
    tx_pool *p = tdp__calloc(1, sizeof(*p));
    if (p == NULL)
        return TDP_ENOMEM;
    p->gen = gen;
    p->slots = tdp__alloc_array(n, sizeof(*p->slots));
    tdp_err rc = TDP_ENOMEM;
    if (p->slots != NULL && dev >= 0) {
        rc = tx_dpool_new(l, p, n, bytes, dev);
    } else if (p->slots != NULL) {
        rc = tdp__shm_seg_create(gen, n, bytes == 0 ? 1 : bytes, 0, &p->seg);
        if (rc == TDP_OK && tx_pools_pending(l) >= PEND_POOLS(l->peer_depth))
            rc = TDP_EINTERNAL; /* s_loan keeps room for every send the credit allows */
        if (rc == TDP_OK)
            rc = announce_seg(l, MSG_POOL, p->seg, l->last_seq + 1);
        if (rc == TDP_OK)
            p->stride = tdp__shm_seg_geom(p->seg)->slot_bytes;
    }
    if (rc != TDP_OK) {
        tdp__shm_seg_close(p->seg);
        tdp__dpool_unref(p->dp);
        tdp__free(p->slots);
        tdp__free(p);
        return rc;
    }
    l->pool_ann[(l->pool_ann_head + l->npool_ann++) % PEND_POOLS(TDP_MAX_DEPTH)] = l->last_seq + 1;
    l->ann_gen = gen;
    atomic_init(&p->refs, 1);
    p->nslots = n;
    for (uint32_t i = 0; i < n; i++)
        p->slots[i] = (tx_slot){.pool = p, .idx = i};
    if (l->stage != NULL)
        p->pin = seg_pin(p->seg, false); /* s_prepare waits for it */
    p->next = g->pool;
    g->pool = p;
    g->stale = false;
    tx_group_trim(g);
    return TDP_OK;
}

/* Whether p is one of g's pools (a pool struct of another group may look alike). */
static bool tx_pool_listed(const tx_group *g, const tx_pool *p)
{
    for (const tx_pool *q = g->pool; q != NULL; q = q->next)
        if (q == p)
            return true;
    return false;
}

static tx_slot *tx_pick(tx_pool *p)
{
    for (uint32_t i = 0; i < p->nslots; i++)
        if (tx_slot_free(&p->slots[i]))
            return &p->slots[i];
    return NULL;
}

/*
 * The loaned slot td is, when it is one of this link's group and of the
 * pool its next DATA may name: the one last announced to the peer, or the
 * group's current one (announced at the send). A link of its own always
 * has them equal; in a shared group a loan made just before another link
 * grew the group is still sent where it lies.
 */
static tx_slot *tx_loaned(struct tdp__link *l, const tdp_td *td)
{
    if (td->release != tx_view_gone || l->bit == 0)
        return NULL;
    tx_slot *s = td->release_arg;
    if (s->td != td || (s->held & l->bit) != 0 || s->staging)
        return NULL; /* let go by its group, or sent on this link already: copy it */
    if (s->pool->gen == l->ann_gen && l->ann_gen != 0 && tx_pool_listed(l->grp, s->pool))
        return s;
    return s->pool == l->grp->pool ? s : NULL; /* else another group's or an older pool's */
}

/* Put the descriptor of tx (in slot s) on the ring. */
static tdp_err tx_push(struct tdp__link *l, tx_slot *s, const tdp__tx *tx, uint32_t type)
{
    tdp__shm_desc d = {.type = DESC_WORD(type, s->pool->gen),
                       .slot = s->idx,
                       .seq = tx->seq,
                       .hash = tdp_schema_hash(tx->td->schema),
                       .arg = tx->td->nbytes};
    if (l->sum_on && type == TDP__SHM_DESC_DATA) /* over the slot: the host copy the receiver reads */
        d.arg = tdp__sum_tx(tx_mem(s->pool, s->idx), tx->td->nbytes, tx->seq);
    if (s->pool->dp != NULL)
        tdp__dpool_publish(s->pool->dp); /* the slot's bytes before the descriptor */
    tdp__shm_ring *r = tdp__shm_seg_tx(l->tx_ctl);
    tdp_err rc = tdp__shm_ring_push(r, &d);
    if (rc != TDP_OK)
        return rc == TDP_EAGAIN ? TDP_EPROTO : rc; /* full: the receiver is not popping */
    return tdp__shm_ring_notify(r) == TDP_OK ? TDP_OK : TDP_ECONNRESET;
}

/* The payload is in slot s: post its descriptor; the send is complete. */
static tdp_err tx_post(struct tdp__link *l, tx_slot *s, const tdp__tx *tx)
{
    tdp_err rc = tx_push(l, s, tx, TDP__SHM_DESC_DATA);
    if (rc != TDP_OK)
        return rc;
    s->staging = false;
    /* the receiver has it: the caller's buffer is free again */
    l->up->sent(l->owner, l, tx->cookie, TDP_OK);
    return TDP_OK;
}

/* A streamed send's chunks landed in its slot: tell the receiver. */
static void tx_progressed(tdp__stage_copy *c, size_t landed)
{
    staged_tx *e = (staged_tx *)c;
    struct tdp__link *l = e->l;
    if (l->closed || l->failed)
        return;
    atomic_store_explicit(progress_word(l->tx_ctl, e->tx.seq), landed, memory_order_release);
    if (tdp__shm_ring_notify(tdp__shm_seg_tx(l->tx_ctl)) != TDP_OK)
        link_fail(l, TDP_ECONNRESET, "cannot ring the shared-memory doorbell");
}

/* A staged send's copy landed (or failed): post it, in order. */
static void tx_copied(tdp__stage_copy *c, tdp_err st)
{
    staged_tx *e = (staged_tx *)c;
    struct tdp__link *l = e->l;
    tdp__tx tx = e->tx;
    tx_slot *s = e->s;
    bool posted = e->posted;
    /* copies land in start order, so this is the ring's head */
    e->tx.td = NULL;
    l->stx_head = (l->stx_head + 1) % l->capstx;
    l->nstx--;
    if (!posted)
        l->stx_unposted--;
    if (st == TDP_OK && (l->failed || l->closed)) {
        st = TDP_ECONNRESET;
    } else if (st == TDP_OK && posted) {
        tx_progressed(c, tx.td->nbytes);
        s->staging = false;
        l->up->sent(l->owner, l, tx.cookie, l->failed ? TDP_ECONNRESET : TDP_OK);
    } else if (st == TDP_OK) {
        st = tx_post(l, s, &tx);
    }
    if (st != TDP_OK && !l->closed) {
        l->up->sent(l->owner, l, tx.cookie, st);
        link_fail(l, st == TDP_ECUDA ? TDP_ECUDA : TDP_ECONNRESET,
                  "cannot stage a payload into shared memory");
    }
    tdp_td_unref(tx.td);
    tdp_schema_unref((tdp_schema *)tx.schema);
}

/*
 * Copy the payload into s on the link's stream; the descriptor goes when
 * the copy has landed, or went already (posted: a streamed send). copy
 * false: the payload is in s already (a loan, or a host payload copied
 * here) and waits only for the sends before it.
 */
static tdp_err tx_stage(struct tdp__link *l, tx_slot *s, const tdp__tx *tx, bool copy, bool posted)
{
    if (l->nstx == l->capstx)
        return TDP_EINTERNAL; /* the credit bounds sends in flight below this */
    staged_tx *e = &l->stx[(l->stx_head + l->nstx) % l->capstx];
    *e = (staged_tx){.copy = {.done = tx_copied, .progress = posted ? tx_progressed : NULL},
                     .l = l,
                     .s = s,
                     .tx = *tx,
                     .posted = posted};
    e->copy.arg = e;
    size_t n = copy ? tx->td->nbytes : 0;
    tdp_err rc = tdp__stage_copy_start(l->stage, &e->copy, tx_mem(s->pool, s->idx), tx->td->data, n,
                                       n, STAGE_CHUNK, STAGE_INFLIGHT);
    if (rc != TDP_OK)
        return rc;
    tdp_td_ref(tx->td);
    if (tx->schema != NULL)
        tdp_schema_ref((tdp_schema *)tx->schema);
    e->tx.schema = tx->schema;
    s->staging = true;
    l->nstx++;
    if (!posted)
        l->stx_unposted++;
    return TDP_OK;
}

/* A large GPU payload goes out as it is copied, unless a send before it still waits. */
static tdp_err tx_stream(struct tdp__link *l, tx_slot *s, const tdp__tx *tx)
{
    atomic_store_explicit(progress_word(l->tx_ctl, tx->seq), 0, memory_order_release);
    tdp_err rc = tx_push(l, s, tx, TDP__SHM_DESC_DATA_STREAM);
    if (rc == TDP_OK)
        rc = tx_stage(l, s, tx, true, true);
    if (rc != TDP_OK && rc != TDP_ECONNRESET)
        rc = TDP_ECONNRESET; /* the descriptor may be out: the stream cannot go on */
    return rc;
}

/*
 * cuda-ipc: whether a GPU payload on dev goes in a device pool — the peer
 * sees that device (its HELLO record lists the UUID) and no checksum is in
 * force (host code cannot sum device memory). Else it is staged through
 * host slots, as on shm. Known once per device.
 */
static bool ipc_dev_ok(struct tdp__link *l, int dev)
{
    if (!l->ipc || l->sum_on || dev < 0 || dev >= (int)TDP_CUDAIPC_DEVS)
        return false;
    if (l->ipc_reach[dev] == 0) {
        uint8_t u[TDP_CUDAIPC_UUID];
        bool ok = tdp__cuda_device_uuid(dev, u) == TDP_OK && tdp__cudaipc_sees(&l->peer_ipc.gpus, u);
        l->ipc_reach[dev] = ok ? 1 : -1;
        if (!ok)
            tdp_log_info("cuda-ipc: the peer does not see cuda:%d: its payloads go staged", dev);
    }
    return l->ipc_reach[dev] > 0;
}

/*
 * No slot is free and some are parked (held by a link that closed while
 * its peer lives: never given back): a new generation, when the peer can
 * take one more announcement. Marks the pool stale; whether it did.
 */
static bool tx_restock(struct tdp__link *l)
{
    if (!tx_pool_parked(l->grp->pool) || tx_pools_pending(l) > l->peer_depth)
        return false;
    l->grp->stale = true;
    return true;
}

static tdp_err tx_now(struct tdp__link *l, const tdp__tx *tx)
{
    tdp_td *td = tx->td;
    bool gpu = td->device.type == TDP_DEVICE_CUDA;
    int pdev = gpu && ipc_dev_ok(l, td->device.index) ? td->device.index : -1;
    tdp_err rc = tx_ctl_up(l);
    if (rc == TDP_OK && gpu)
        rc = link_stage(l, td->device.index);
    /* a loan of the pool in force at the peer goes as it is; else the current pool */
    tx_slot *s = rc == TDP_OK ? tx_loaned(l, td) : NULL;
    if (rc == TDP_OK && (s == NULL || s->pool->gen != l->ann_gen))
        rc = tx_pool_grow(l, td->nbytes, pdev);
    if (s != NULL && s->pool != l->grp->pool && s->pool->gen != l->ann_gen)
        s = NULL;
    bool loaned = s != NULL;
    if (rc == TDP_OK && !loaned && (s = tx_pick(l->grp->pool)) == NULL && tx_restock(l)) {
        rc = tx_pool_grow(l, td->nbytes, pdev);
        s = rc == TDP_OK ? tx_pick(l->grp->pool) : NULL;
    }
    if (rc == TDP_OK && !loaned && s == NULL)
        /* alone, the credit and the loan limit leave one free; in a shared
         * group the other links' holds count too: wait for a release */
        return (l->grp->bits & ~l->bit) != 0 ? TDP_EAGAIN : TDP_EINTERNAL;
    if (rc == TDP_OK && tx->schema != NULL)
        rc = announce_schema(l, tx->schema, tx->seq);
    if (rc != TDP_OK)
        return rc;
    if (!loaned && !gpu)      /* a plain send: one copy, into a slot */
        memcpy(tx_mem(s->pool, s->idx), td->data, td->nbytes);
    /* the slot is taken from now on, and later announcements follow this seq */
    s->held |= l->bit;
    s->pool->nflight++;
    l->last_seq = tx->seq;
    l->tx_win_now = tx_win(l, td->nbytes);
    /* streamed: the descriptor leaves before the bytes, so it cannot carry
     * their sum; a device pool is filled device to device, never streamed */
    if (gpu && !loaned && pdev < 0 && td->nbytes >= STREAM_MIN && l->stx_unposted == 0 &&
        !l->sum_on)
        rc = tx_stream(l, s, tx);
    else if ((gpu && !loaned) || l->nstx > 0) /* a loaned device slot is filled already */
        rc = tx_stage(l, s, tx, gpu && !loaned, false);
    else
        rc = tx_post(l, s, tx);
    if (rc != TDP_OK && rc != TDP_ECONNRESET) {
        s->held &= ~l->bit;
        s->staging = false;
        s->pool->nflight--;
    }
    return rc;
}

static tdp_err s_send(tdp__link *l, const tdp__tx *tx)
{
    if (l->failed)
        return TDP_ECONNRESET;
    if (l->sock >= 0 && l->proven && l->nearly == 0) {
        tdp_err rc = tx_now(l, tx);
        if (rc != TDP_EAGAIN)
            return rc;
        slot_wait_set(l, true); /* kept below, sent when a slot comes back */
    }
    /* the peer has not connected yet, or sends wait for a slot: keep it
     * (the session's credit bounds how many) */
    if (l->nearly == l->capearly)
        return TDP_EINTERNAL;
    l->early[l->nearly++] = (early_tx){*tx};
    tdp_td_ref(tx->td);
    if (tx->schema != NULL)
        tdp_schema_ref((tdp_schema *)tx->schema);
    return TDP_OK;
}

/*
 * Send what waits, oldest first, until a send finds no slot (it stays at
 * the head). A send made from a callback in here queues behind.
 */
static void link_flush_early(struct tdp__link *l)
{
    slot_wait_set(l, false);
    while (l->nearly > 0) {
        early_tx e = l->early[0];
        tdp_err rc = l->closed || l->failed ? TDP_ECONNRESET : tx_now(l, &e.tx);
        if (rc == TDP_EAGAIN) {
            slot_wait_set(l, true);
            return;
        }
        if (l->nearly == 0)
            return; /* a callback in tx_now closed the link: teardown let go of e */
        l->nearly--;
        memmove(&l->early[0], &l->early[1], l->nearly * sizeof(l->early[0]));
        if (rc != TDP_OK && !l->closed)
            l->up->sent(l->owner, l, e.tx.cookie, rc);
        tdp_td_unref(e.tx.td);
        tdp_schema_unref((tdp_schema *)e.tx.schema);
        if (rc != TDP_OK && !l->closed && !l->failed)
            link_fail(l, rc, "cannot send over shared memory");
    }
}

/* RELEASE descriptors: slots back, and the credit they are. */
static unsigned tx_progress_now(struct tdp__link *l);

static unsigned tx_progress(void *arg)
{
    struct tdp__link *l = arg;
    l->in_tx_progress = true;
    unsigned n = tx_progress_now(l);
    l->in_tx_progress = false;
    return n;
}

static unsigned tx_progress_now(struct tdp__link *l)
{
    tdp__shm_ring *r = tdp__shm_seg_rx(l->tx_ctl);
    unsigned n = 0;
    if (l->tx_armed) {
        /* reset the doorbell if it rang (and every 64th time regardless:
         * a peer that rings while claiming not to cannot make us spin) */
        l->tx_armed = false;
        if (tdp__shm_ring_rung(r) || (++l->tx_skips & 63) == 0)
            tdp__shm_ring_drain(r);
    }
    tdp__shm_desc d;
    tdp_err rc = TDP_OK;
    while (!l->closed && (rc = tdp__shm_ring_pop(r, &d)) == TDP_OK) {
        n++;
        uint32_t gen = DESC_GEN(d.type);
        tx_pool *p = l->grp->pool;
        while (p != NULL && p->gen != gen)
            p = p->next;
        /* only a slot this link holds: another link's hold is not this peer's to give */
        if (DESC_TYPE(d.type) != TDP__SHM_DESC_RELEASE || p == NULL || d.slot >= p->nslots ||
            (p->slots[d.slot].held & l->bit) == 0 || p->slots[d.slot].staging) {
            link_fail(l, TDP_EPROTO, "invalid release descriptor");
            return n;
        }
        if (p->dp != NULL)
            tdp__dpool_observe(p->dp); /* the receiver's reads before our next write */
        p->slots[d.slot].held &= ~l->bit;
        p->nflight--;
        l->released++;
        l->loan_starved = false;
        l->grp->starved = false;
        if (p != l->grp->pool && p->nflight == 0)
            tx_group_trim(l->grp);
    }
    if (!l->closed && rc == TDP_EPROTO) {
        link_fail(l, TDP_EPROTO, "release ring corrupted");
        return n;
    }
    if (n > 0 && !l->closed) {
        group_slot_back(l);
        l->up->credit(l->owner, l, l->released);
    }
    return n;
}

static void slot_wait_set(struct tdp__link *l, bool on)
{
    if (l->slot_wait == on)
        return;
    l->slot_wait = on;
    if (on)
        l->x->slot_waits++;
    else
        l->x->slot_waits--;
}

/* A slot of l's group may be free again: links of the group waiting for one try. */
static void group_slot_back(struct tdp__link *l)
{
    if (l->x->slot_waits > 0 && l->x->slot_ev != NULL)
        event_active(l->x->slot_ev, 0, 0);
}

/* A link that waits and can go: its group has a free slot (or will make a pool). */
static struct tdp__link *slot_waiter(shm_ext *x)
{
    for (struct tdp__link *l = x->links; l != NULL; l = l->next)
        if (l->slot_wait && !l->closed &&
            (l->grp->pool == NULL || l->failed || tx_pick(l->grp->pool) != NULL ||
             (tx_pool_parked(l->grp->pool) && tx_pools_pending(l) <= l->peer_depth)))
            return l;
    return NULL;
}

/*
 * Out of every callback: a link's sends may complete the application's
 * ops. Each round either sends (a slot taken) or leaves the link waiting
 * on a group with none free, so it ends.
 */
static void slot_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    shm_ext *x = arg;
    struct tdp__link *l;
    while ((l = slot_waiter(x)) != NULL)
        link_flush_early(l);
}

/*
 * Before the loop sleeps. The doorbell is reset in progress, after a sleep
 * that followed an arm and before popping: a ring after that reset stays
 * counted and wakes the next sleep, so no wakeup is lost (shm.h).
 */
static int tx_arm(void *arg)
{
    struct tdp__link *l = arg;
    /*
     * Ask to be woken by a release only while a send or a loan waits for
     * one: with credit left, releases are picked up on the next turn anyway
     * and the receiver is spared an eventfd write per message (and this
     * side a wakeup). The safety timer bounds how stale they can get.
     */
    bool group_waits =
        l->grp->starved || (l->x->slot_waits > 0 && (l->grp->bits & ~l->bit) != 0);
    if (l->last_seq - l->seq0 - l->released < l->tx_win_now && !l->loan_starved && !group_waits)
        return 0;
    int a = tdp__shm_ring_arm(tdp__shm_seg_rx(l->tx_ctl));
    l->tx_armed |= a == 0;
    return a < 0 ? 1 : a; /* a broken ring: progress reports it */
}

/* Lend free slot s of p as a tensordict of layout sc. */
static tdp_err tx_lend(tx_pool *p, tx_slot *s, tdp_schema *sc, tdp_td **out)
{
    if (s->td == NULL || s->td->schema != sc) {
        /* a new layout: the views of every free slot, made once for the loans to come */
        uint64_t need = tdp_schema_total_bytes(sc);
        for (uint32_t i = 0; i < p->nslots; i++) {
            tx_slot *f = &p->slots[i];
            if ((f != s && !tx_slot_free(f)) || (f->td != NULL && f->td->schema == sc))
                continue;
            tdp_td *td;
            atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
            tdp_err rc = tdp_td_wrap(sc, tx_mem(p, f->idx), need, tdp_schema_device(sc),
                                     tx_view_gone, f, &td);
            if (rc != TDP_OK) {
                tx_pool_unref(p);
                return rc;
            }
            tdp_td_unref(f->td);
            f->td = td;
        }
    }
    *out = tdp_td_ref(s->td);
    return TDP_OK;
}

static tdp_err s_loan(tdp__link *l, tdp_schema *sc, tdp_td **out)
{
    tdp_device sdev = tdp_schema_device(sc);
    int pdev = sdev.type == TDP_DEVICE_CUDA && ipc_dev_ok(l, sdev.index) ? sdev.index : -1;
    if ((sdev.type != TDP_DEVICE_CPU && pdev < 0) || l->failed)
        return tdp_td_new(sc, out); /* no slot to lend: an ordinary buffer */
    if (l->sock < 0 || !l->proven)
        /* just after the HELLO, the peer's socket connect and proof may still
         * be on their way (the larger key waits for them): an ordinary buffer
         * now would be copied at its send, so ask for a retry instead */
        return TDP_EAGAIN;
    uint64_t need = tdp_schema_total_bytes(sc);
    if (!tx_pool_fits(l, need, pdev) && tx_pools_pending(l) > l->peer_depth)
        /* a new pool now could leave the receiver more announcements than
         * it holds (PEND_POOLS) once the sends the credit allows add theirs:
         * an ordinary buffer, copied at its send */
        return tdp_td_new(sc, out);
    tdp_err rc = tx_ctl_up(l);
    if (rc == TDP_OK && pdev >= 0)
        rc = link_stage(l, pdev); /* its sends may queue behind copies */
    if (rc == TDP_OK)
        rc = tx_pool_grow(l, need, pdev);
    if (rc != TDP_OK)
        return rc;
    tx_pool *p = l->grp->pool;
    /* leave a free slot for each send the credit still allows */
    uint32_t nfree = 0, mine = 0;
    tx_slot *s = NULL;
    for (uint32_t i = 0; i < p->nslots; i++) {
        mine += (p->slots[i].held & l->bit) != 0;
        if (tx_slot_free(&p->slots[i])) {
            nfree++;
            if (s == NULL)
                s = &p->slots[i];
        }
    }
    uint32_t win = tx_win(l, need);
    uint32_t credit_left = mine < win ? win - mine : 0;
    if (s == NULL || nfree <= credit_left) {
        l->loan_starved = true; /* a release may end this: be woken by one */
        return TDP_EAGAIN;
    }
    return tx_lend(p, s, sc, out);
}

/* Releases already in the ring count now (see tdp__plane_ops.poll_credit). */
static void s_poll_credit(tdp__link *l)
{
    if (l->tx_ctl != NULL && !l->closed && !l->in_tx_progress)
        (void)tx_progress(l);
}

/* ---- receiving ---------------------------------------------------------------------- */

static unsigned rx_progress(void *arg);
static int rx_arm(void *arg);
static const tdp__source_ops rx_src_ops = {.progress = rx_progress, .arm = rx_arm};

static void close_fds(int *fds, size_t n);

static uint64_t rx_map_cap(const struct tdp__link *l, uint32_t nslots)
{
    uint64_t stride = page_round(l->max_total);
    uint64_t cap = (uint64_t)nslots * stride;
    return stride != 0 && cap / stride != nslots ? UINT64_MAX : cap + (8u << 20);
}

/* The largest pool this side maps: depth's slots of the largest layout, or a window's small ones */
static uint64_t rx_pool_cap(const struct tdp__link *l)
{
    return rx_map_cap(l, pool_slots(l->depth)) + 2 * l->window;
}

/* A pool announced: its generation in order and its size in bounds; mapped once in force. */
static tdp_err rx_check_pool(struct tdp__link *l, const shm_msg *m, const int *fds)
{
    struct stat st;
    if (m->gen <= l->last_gen || m->gen > MAX_GEN || fstat(fds[0], &st) != 0 ||
        (uint64_t)st.st_size > rx_pool_cap(l))
        return TDP_EPROTO;
    l->last_gen = m->gen;
    return TDP_OK;
}

/*
 * A device pool announced (cuda-ipc): generation in order, slots and stride
 * within what this side's depth and limits allow, on a device this side
 * sees; imported once in force.
 */
static tdp_err rx_check_dpool(struct tdp__link *l, const shm_msg *m)
{
    uint64_t n = m->json_len, stride = m->total;
    if (m->gen <= l->last_gen || m->gen > MAX_GEN || n == 0 || stride == 0 ||
        n > pool_slots(rx_win(l, stride)) || stride % TDP__SHM_PAGE != 0 ||
        stride > page_round(l->max_total) + TDP__SHM_PAGE ||
        tdp__cudaipc_local_dev(m->peer_key) < 0)
        return TDP_EPROTO;
    l->last_gen = m->gen;
    return TDP_OK;
}

/*
 * A device pool, as its DPOOL comes (checked) when no other is pending:
 * import it (or share the pointer: same process) at once, not when it
 * comes into force with its first DATA, so that a pool announced ahead
 * (tdp_pipe_prepare) is mapped before that message (a GPU's first import
 * in a process took 126 ms on an H100). Pools announced behind it are
 * imported at their DATA, so a peer's flood of announcements holds one
 * import at most. Its fd is closed.
 */
static tdp_err rx_import_dpool(pend_msg *pm)
{
    tdp__cuda_ipc h = {.fd = pm->nfds == 1 ? pm->fds[0] : -1, .size = pm->m.hash};
    memcpy(h.legacy, pm->legacy, LEGACY_LEN);
    int dev = tdp__cudaipc_local_dev(pm->m.peer_key);
    tdp_err rc = dev < 0
                     ? TDP_EPROTO
                     : tdp__dpool_open(dev, pm->m.key, &h, pm->m.json_len * pm->m.total, &pm->dp);
    close_fds(pm->fds, pm->nfds);
    pm->nfds = 0;
    return rc == TDP_OK || rc == TDP_ENOMEM ? rc : TDP_EPROTO;
}

/* A device pool in force: the one imported when its DPOOL came, or now. */
static tdp_err rx_open_dpool(pend_msg *pm, rx_pool *p)
{
    if (pm->dp == NULL) {
        tdp_err rc = rx_import_dpool(pm);
        if (rc != TDP_OK)
            return rc;
    }
    p->dp = pm->dp;
    pm->dp = NULL;
    p->nslots = (uint32_t)pm->m.json_len;
    p->stride = pm->m.total;
    memcpy(p->uuid, pm->m.peer_key, TDP_CUDAIPC_UUID);
    return TDP_OK;
}

/*
 * Map an announced pool into pm->seg (it is checked whole), and page-lock
 * it when the link stages GPU payloads: as its POOL comes when no other is
 * pending, else at its DATA. The fds are the segment's, or closed.
 */
static tdp_err rx_map_pool(struct tdp__link *l, pend_msg *pm)
{
    tdp__shm_seg *seg;
    tdp_err rc =
        tdp__shm_seg_map(pm->fds[0], pm->fds[1], pm->fds[2], pm->m.gen, rx_pool_cap(l), &seg);
    pm->nfds = 0;
    if (rc != TDP_OK) {
        for (int i = 0; i < 3; i++)
            close(pm->fds[i]);
        return rc == TDP_ENOMEM ? rc : TDP_EPROTO;
    }
    const tdp__shm_geom *g = tdp__shm_seg_geom(seg);
    if (g->nslots > pool_slots(rx_win(l, g->slot_bytes)) ||
        g->slot_bytes > page_round(l->max_total) + TDP__SHM_PAGE) {
        tdp__shm_seg_close(seg);
        return TDP_EPROTO;
    }
    atomic_fetch_add_explicit(&rx_pools_mapped, 1, memory_order_relaxed);
    pm->seg = seg;
    pm->pin = l->stage != NULL ? seg_pin(seg, false) : NULL;
    return TDP_OK;
}

/* Map the peer's control segment. Its three fds are the segment's, or closed. */
static tdp_err rx_map_ctl(struct tdp__link *l, const shm_msg *m, int *fds)
{
    tdp__shm_seg *seg;
    tdp_err rc = l->rx_ctl != NULL || m->gen != 0
                     ? TDP_EPROTO
                     : tdp__shm_seg_map(fds[0], fds[1], fds[2], 0, 64u << 20, &seg);
    if (rc != TDP_OK) {
        close_fds(fds, 3);
        return rc;
    }
    /* from here on the segment owns the fds: closing it closes them */
    uint32_t want = 1;
    while (want < 2 * pool_slots(rx_win(l, 1)))
        want <<= 1;
    const tdp__shm_geom *g = tdp__shm_seg_geom(seg);
    if (g->ring_cap > want || g->nslots < 1 || g->slot_bytes < PROGRESS_WORDS * sizeof(uint64_t)) {
        tdp__shm_seg_close(seg);
        return TDP_EPROTO;
    }
    rc = tdp__loop_source_add(l->x->loop, tdp__shm_ring_fd(tdp__shm_seg_rx(seg)), &rx_src_ops, l,
                              &l->rx_src);
    if (rc != TDP_OK) {
        tdp__shm_seg_close(seg);
        return rc;
    }
    l->rx_ctl = seg;
    tdp__loop_kick(l->x->loop); /* descriptors may be there already */
    return TDP_OK;
}

/* Read a large schema from its memfd, which must be sealed as said. */
static tdp_err read_json_fd(int fd, uint64_t len, char *out)
{
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_WRITE) || !(seals & F_SEAL_SHRINK) || fstat(fd, &st) != 0 ||
        (uint64_t)st.st_size != len)
        return TDP_EPROTO;
    uint64_t off = 0;
    while (off < len) {
        ssize_t r = pread(fd, out + off, len - off, (off_t)off);
        if (r <= 0)
            return TDP_EPROTO;
        off += (uint64_t)r;
    }
    return TDP_OK;
}

static void close_fds(int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
}

/* One message from the socket. TDP_EAGAIN: none; TDP_ECLOSED: the peer went. */
static tdp_err sock_read_one(struct tdp__link *l)
{
    uint8_t buf[MSG_HDR_BYTES + MSG_INLINE_MAX];
    int fds[TDP__SHM_MAX_FDS];
    size_t len = 0, nfds = 0;
    tdp_err rc = tdp__shm_sock_recv(l->sock, buf, sizeof(buf), &len, fds, TDP__SHM_MAX_FDS, &nfds);
    if (rc != TDP_OK)
        return rc == TDP_ECONNRESET ? TDP_ECLOSED : rc;
    shm_msg m;
    if (len < MSG_HDR_BYTES) {
        close_fds(fds, nfds);
        return TDP_EPROTO;
    }
    memcpy(&m, buf, MSG_HDR_BYTES);
    size_t tail = len - MSG_HDR_BYTES;
    size_t want_fds = m.type == MSG_CTL || m.type == MSG_POOL             ? 3
                      : m.type == MSG_SCHEMA && (m.flags & MSG_F_JSON_FD) ? 1
                      : m.type == MSG_DPOOL && !(m.flags & MSG_F_LEGACY)  ? 1
                                                                          : 0;
    if (m.magic != MSG_MAGIC || nfds != want_fds ||
        (m.type != MSG_CTL && m.type != MSG_POOL && m.type != MSG_SCHEMA &&
         (m.type != MSG_DPOOL || !l->ipc))) {
        close_fds(fds, nfds);
        return TDP_EPROTO;
    }
    if (m.type == MSG_CTL) {
        rc = rx_map_ctl(l, &m, fds); /* the fds are the segment's, or closed */
        return rc == TDP_OK ? TDP_OK : TDP_EPROTO;
    }
    /* POOL and SCHEMA wait for their DATA, in order, and only so many */
    bool pool = m.type == MSG_POOL || m.type == MSG_DPOOL;
    if ((pool ? l->npend_pools >= PEND_POOLS(l->depth)
              : l->npend_schemas >= PEND_SCHEMAS(rx_win(l, 1))) ||
        (l->npend > 0 && m.seq < l->pend[(l->pend_head + l->npend - 1) % l->pend_cap].m.seq)) {
        close_fds(fds, nfds);
        return TDP_EPROTO;
    }
    pend_msg pm = {.m = m, .nfds = (uint32_t)nfds};
    memcpy(pm.fds, fds, nfds * sizeof(int));
    if (m.type == MSG_DPOOL) {
        bool legacy = m.flags & MSG_F_LEGACY;
        if (tail != (legacy ? LEGACY_LEN : 0) || rx_check_dpool(l, &m) != TDP_OK) {
            close_fds(fds, nfds);
            return TDP_EPROTO;
        }
        if (legacy)
            memcpy(pm.legacy, buf + MSG_HDR_BYTES, LEGACY_LEN);
        /* the first one pending as it comes, the rest at their DATA (as host pools) */
        if (l->npend_pools == 0 && (rc = rx_import_dpool(&pm)) != TDP_OK)
            return rc;
    } else if (pool) {
        if (tail != 0 || rx_check_pool(l, &m, fds) != TDP_OK) {
            close_fds(fds, nfds);
            return TDP_EPROTO;
        }
        /*
         * The first pool pending is mapped, and page-locked for GPU copies,
         * as it comes, not when its first DATA puts it in force: a pool
         * announced ahead (tdp_pipe_prepare) costs that message nothing
         * (page-locking 400 MB was most of a staged first send's time).
         * Only one: a peer that announces more without their DATA gets
         * the rest mapped at their DATA, as any one message would
         * (test_preauth test_pool_flood).
         */
        if (l->npend_pools == 0 && (rc = rx_map_pool(l, &pm)) != TDP_OK)
            return rc;
    } else {
        bool in_fd = m.flags & MSG_F_JSON_FD;
        if (m.json_len == 0 || m.json_len > l->max_json || m.total > l->max_total ||
            (in_fd ? tail != 0 : tail != m.json_len)) {
            close_fds(fds, nfds);
            return TDP_EPROTO;
        }
        if (!in_fd) {
            pm.json = tdp__malloc(m.json_len);
            if (pm.json == NULL)
                return TDP_ENOMEM;
            memcpy(pm.json, buf + MSG_HDR_BYTES, m.json_len);
        }
    }
    l->pend[(l->pend_head + l->npend) % l->pend_cap] = pm;
    l->npend++;
    if (pool)
        l->npend_pools++;
    else
        l->npend_schemas++;
    return TDP_OK;
}

/* Read what the socket holds. TDP_OK (drained), TDP_ECLOSED, or an error. */
static tdp_err sock_read_all(struct tdp__link *l)
{
    for (int i = 0; i < 4 * (int)l->pend_cap; i++) {
        tdp_err rc = sock_read_one(l);
        if (rc == TDP_EAGAIN)
            return TDP_OK;
        if (rc != TDP_OK)
            return rc;
    }
    return TDP_OK; /* more next time: the event stays readable */
}

/* Put the announcements for DATA seq in force. */
static tdp_err rx_views(struct tdp__link *l);

static tdp_err apply_pending(struct tdp__link *l, uint64_t seq)
{
    while (l->npend > 0 && !l->closed) {
        pend_msg *pm = &l->pend[l->pend_head];
        if (pm->m.seq > seq)
            return TDP_OK;
        if (pm->m.seq < seq)
            return TDP_EPROTO; /* announced for a DATA that never came */
        pend_msg cur = *pm;
        pm->json = NULL;
        pm->nfds = 0;
        pm->dp = NULL;
        pm->seg = NULL;
        pm->pin = NULL;
        l->pend_head = (l->pend_head + 1) % l->pend_cap;
        l->npend--;
        if (cur.m.type == MSG_POOL || cur.m.type == MSG_DPOOL) {
            l->npend_pools--;
            rx_pool *p = tdp__calloc(1, sizeof(*p));
            if (p == NULL) {
                close_fds(cur.fds, cur.nfds);
                tdp__dpool_unref(cur.dp);
                tdp__cuda_pin_end(cur.pin);
                tdp__shm_seg_close(cur.seg);
                return TDP_ENOMEM;
            }
            tdp_err rc = TDP_OK;
            if (cur.m.type == MSG_DPOOL) {
                rc = rx_open_dpool(&cur, p);
            } else if (cur.seg != NULL || (rc = rx_map_pool(l, &cur)) == TDP_OK) {
                p->seg = cur.seg; /* mapped when it came, or now */
                p->pin = cur.pin;
                p->nslots = tdp__shm_seg_geom(p->seg)->nslots;
                p->stride = tdp__shm_seg_geom(p->seg)->slot_bytes;
            }
            rx_slot *slots = rc == TDP_OK ? tdp__alloc_array(p->nslots, sizeof(*slots)) : NULL;
            if (slots == NULL) {
                tdp__dpool_unref(cur.dp); /* not taken */
                tdp__cuda_pin_end(p->pin);
                tdp__shm_seg_close(p->seg);
                tdp__dpool_unref(p->dp);
                tdp__free(p);
                return rc == TDP_OK ? TDP_ENOMEM : rc;
            }
            atomic_init(&p->refs, 1);
            p->gen = cur.m.gen;
            p->slots = slots;
            for (uint32_t i = 0; i < p->nslots; i++)
                slots[i].pool = p;
            if (l->stage != NULL && p->pin == NULL)
                p->pin = seg_pin(p->seg, false);
            /* keep the superseded pool in the list while it has slots out */
            rx_pool *old = l->rpool;
            p->next = old;
            l->rpool = p;
            if (old != NULL && old->nheld == 0) {
                p->next = old->next;
                rx_pool_drop(old);
            }
            rc = rx_views(l);
            if (rc != TDP_OK)
                return rc;
        } else {
            l->npend_schemas--;
            if (cur.json == NULL) { /* in its memfd: read now */
                tdp_err rc = TDP_ENOMEM;
                cur.json = tdp__malloc(cur.m.json_len);
                if (cur.json != NULL)
                    rc = read_json_fd(cur.fds[0], cur.m.json_len, cur.json);
                close(cur.fds[0]);
                if (rc != TDP_OK) {
                    tdp__free(cur.json);
                    return rc;
                }
            }
            tdp__frame f = {.type = TDP_AM_SCHEMA,
                            .seq = cur.m.seq,
                            .hash = cur.m.hash,
                            .length = cur.m.json_len,
                            .arg = cur.m.total};
            /* DATA carries the hash of the schema as sent (the session checks both) */
            l->rx_hash = cur.m.hash;
            l->up->schema(l->owner, l, &f, cur.json, cur.m.json_len);
            tdp__free(cur.json);
        }
    }
    return TDP_OK;
}

static rx_slot *rx_slot_of(struct tdp__link *l, const tdp__shm_desc *d)
{
    rx_pool *p = l->rpool;
    if (p == NULL || DESC_GEN(d->type) != p->gen || d->slot >= p->nslots || p->slots[d->slot].held)
        return NULL;
    return &p->slots[d->slot];
}

/* Whether the pool and schema in force are the ones descriptor d names. */
static bool rx_fits(const struct tdp__link *l, const tdp__shm_desc *d)
{
    return l->rpool != NULL && DESC_GEN(d->type) == l->rpool->gen && d->hash == l->rx_hash;
}

/* The bytes of streamed message seq in its slot so far (a hostile sender's word capped at n). */
static uint64_t rx_stream_have(const struct tdp__link *l, uint64_t seq, uint64_t n)
{
    uint64_t v = atomic_load_explicit(progress_word(l->rx_ctl, seq), memory_order_acquire);
    return v < n ? v : n;
}

/* A DATA for the session (its announcements are in force). */
static void rx_data(struct tdp__link *l, tdp__shm_desc *d, bool has_sum, uint64_t sum)
{
    /* the session checks order and layout, then recv checks the slot */
    tdp__frame f = {.type = TDP_AM_DATA,
                    .seq = d->seq,
                    .hash = d->hash,
                    .length = d->arg,
                    .has_sum = has_sum,
                    .sum = sum};
    l->up->data(l->owner, l, &f, d);
}

/*
 * Streamed receives follow their sender: copies get what has landed, a
 * parked DATA goes to the session once all of it is there. Returns true
 * when anything moved.
 */
static bool rx_follow(struct tdp__link *l)
{
    bool moved = false;
    for (uint32_t i = 0; l->nstream > 0 && i < TDP_MAX_DEPTH; i++) {
        staged_rx *r = &l->srx[i];
        if (r->prog == NULL || !r->copy.active)
            continue;
        uint64_t v = atomic_load_explicit(r->prog, memory_order_acquire);
        if (v > r->copy.n)
            v = r->copy.n; /* a hostile word beyond the message must not keep us busy */
        if (v > r->copy.avail) {
            tdp__stage_copy_avail(l->stage, &r->copy, v);
            moved = true;
        }
    }
    if (l->has_parked && rx_stream_have(l, l->parked.seq, l->parked.arg) == l->parked.arg) {
        tdp__shm_desc d = l->parked;
        l->has_parked = false;
        rx_data(l, &d, false, 0); /* streamed: never with the checksum in force */
        moved = true;
    }
    return moved;
}

/* Whether a streamed receive could move now (checked after arming). */
static bool rx_follow_due(const struct tdp__link *l)
{
    for (uint32_t i = 0; l->nstream > 0 && i < TDP_MAX_DEPTH; i++) {
        const staged_rx *r = &l->srx[i];
        if (r->prog != NULL && r->copy.active && r->copy.avail < r->copy.n &&
            atomic_load_explicit(r->prog, memory_order_acquire) > r->copy.avail)
            return true;
    }
    return l->has_parked && rx_stream_have(l, l->parked.seq, l->parked.arg) == l->parked.arg;
}

/* Whether every streamed receive has all its bytes in the slot (a dead sender adds none). */
static bool rx_streams_whole(const struct tdp__link *l)
{
    for (uint32_t i = 0; l->nstream > 0 && i < TDP_MAX_DEPTH; i++) {
        const staged_rx *r = &l->srx[i];
        if (r->prog != NULL && r->copy.active && r->copy.avail < r->copy.n)
            return false;
    }
    return !l->has_parked;
}

/* A streamed DATA the session cannot take yet: only a GPU layout follows the sender. */
static bool rx_must_park(const struct tdp__link *l, const tdp__shm_desc *d)
{
    if (DESC_TYPE(d->type) != TDP__SHM_DESC_DATA_STREAM)
        return false;
    bool follows = l->stage != NULL && l->rx_schema != NULL &&
                   tdp_schema_device(l->rx_schema).type == TDP_DEVICE_CUDA;
    return !follows && rx_stream_have(l, d->seq, d->arg) < d->arg;
}

static unsigned rx_progress(void *arg)
{
    struct tdp__link *l = arg;
    tdp__shm_ring *r = tdp__shm_seg_rx(l->rx_ctl);
    unsigned n = 0;
    if (l->rx_armed) {
        /* reset the doorbell if it rang (and every 64th time regardless:
         * a peer that rings while claiming not to cannot make us spin) */
        l->rx_armed = false;
        if (tdp__shm_ring_rung(r) || (++l->rx_skips & 63) == 0)
            tdp__shm_ring_drain(r);
    }
    tdp__shm_desc d;
    tdp_err rc = TDP_OK;
    if (rx_follow(l))
        n++;
    /* bounded: each DATA needs a free session slot, which the credit ensures */
    while (!l->closed && !l->failed && !l->has_parked && n < TDP_MAX_DEPTH &&
           (rc = tdp__shm_ring_pop(r, &d)) == TDP_OK) {
        n++;
        if (DESC_TYPE(d.type) != TDP__SHM_DESC_DATA &&
            DESC_TYPE(d.type) != TDP__SHM_DESC_DATA_STREAM) {
            link_fail(l, TDP_EPROTO, "invalid data descriptor");
            return n;
        }
        /*
         * The sender puts a DATA's announcements in the socket before the
         * descriptor in the ring, so they are there to read now — but maybe
         * only some of them read so far (a POOL made at loan time, its
         * SCHEMA with the DATA): when what is in force does not fit the
         * descriptor, read the socket before deciding.
         */
        if ((rc = apply_pending(l, d.seq)) == TDP_OK && !l->closed && !rx_fits(l, &d)) {
            tdp_err sr = sock_read_all(l);
            if (sr != TDP_OK && sr != TDP_ECLOSED) {
                link_fail(l, sr, "invalid message on the shared-memory socket");
                return n;
            }
            rc = apply_pending(l, d.seq);
        }
        if (rc != TDP_OK) {
            link_fail(l, rc, "pool or schema announced out of order");
            return n;
        }
        if (l->closed)
            return n;
        uint64_t sum = 0;
        bool has_sum = l->sum_on;
        if (has_sum) {
            /* arg carried the sum: the length is the layout's in force */
            sum = d.arg;
            d.arg = l->rx_schema != NULL ? tdp_schema_total_bytes(l->rx_schema) : 0;
        }
        if (rx_must_park(l, &d)) {
            /* later DATA stay in the ring: they come after this one */
            l->parked = d;
            l->has_parked = true;
            break;
        }
        rx_data(l, &d, has_sum, sum);
    }
    if (!l->closed && !l->failed && n < TDP_MAX_DEPTH && rc == TDP_EPROTO)
        link_fail(l, TDP_EPROTO, "data ring corrupted");
    return n;
}

static int rx_arm(void *arg)
{
    struct tdp__link *l = arg;
    int a = tdp__shm_ring_arm(tdp__shm_seg_rx(l->rx_ctl));
    l->rx_armed |= a == 0;
    /* progress published before the arm rang no bell: look after arming */
    if (a == 0 && rx_follow_due(l))
        return 1;
    return a < 0 ? 1 : a;
}

/*
 * Whether layout sc reads the slots of pool p where they lie: host slots
 * for a host layout; device slots (cuda-ipc) for a layout on their GPU,
 * named in this side's numbering of devices or the sender's (the layout as
 * it was sent). Else each message is copied out of its slot.
 */
static bool rx_in_place(const struct tdp__link *l, const rx_pool *p, const tdp_schema *sc)
{
    tdp_device dev = tdp_schema_device(sc);
    if (p->dp == NULL)
        return dev.type == TDP_DEVICE_CPU;
    if (dev.type != TDP_DEVICE_CUDA)
        return false;
    if (dev.index == tdp__dpool_device(p->dp))
        return true;
    return dev.index >= 0 && dev.index < l->peer_ipc.gpus.ndev &&
           memcmp(l->peer_ipc.gpus.uuids + (size_t)dev.index * TDP_CUDAIPC_UUID, p->uuid,
                  TDP_CUDAIPC_UUID) == 0;
}

/* A view of slot s for the current receive layout, where it lies. */
static tdp_err rx_view(struct tdp__link *l, rx_slot *s)
{
    tdp_schema *sc = l->rx_schema;
    rx_pool *p = s->pool;
    if (s->td != NULL && s->td->schema == sc)
        return TDP_OK;
    tdp_td *v;
    atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
    tdp_device dev = tdp_schema_device(sc);
    if (p->dp != NULL)
        dev = (tdp_device){TDP_DEVICE_CUDA, tdp__dpool_device(p->dp)};
    tdp_err rc = tdp_td_wrap(sc, rx_mem(p, (uint32_t)(s - p->slots)), tdp_schema_total_bytes(sc),
                             dev, rx_view_gone, s, &v);
    if (rc != TDP_OK) {
        rx_pool_unref(p);
        return rc;
    }
    tdp_td_unref(s->td);
    s->td = v;
    return TDP_OK;
}

/* Views of every slot not held, made when a layout or pool comes into force
 * so that receiving allocates nothing. */
static tdp_err rx_views(struct tdp__link *l)
{
    rx_pool *p = l->rpool;
    if (p == NULL || l->rx_schema == NULL || !rx_in_place(l, p, l->rx_schema) ||
        p->stride < tdp_schema_total_bytes(l->rx_schema))
        return TDP_OK;
    for (uint32_t i = 0; i < p->nslots; i++) {
        if (p->slots[i].held)
            continue;
        tdp_err rc = rx_view(l, &p->slots[i]);
        if (rc != TDP_OK)
            return rc;
    }
    return TDP_OK;
}

static tdp_err rx_device_buf(struct tdp__link *l, uint32_t slot, tdp_schema *sc, tdp_td **out);

/* The device whose stream copies a message of layout dev out of pool p. */
static int rx_copy_dev(const rx_pool *p, tdp_device dev)
{
    if (dev.type == TDP_DEVICE_CUDA)
        return dev.index;
    return p->dp != NULL ? tdp__dpool_device(p->dp) : 0;
}

static tdp_err s_rx_schema(tdp__link *l, tdp_schema *sc, uint32_t depth)
{
    if (l->rpool == NULL || l->rpool->stride < tdp_schema_total_bytes(sc))
        return TDP_EPROTO; /* the pool in force cannot hold this layout */
    tdp_device dev = tdp_schema_device(sc);
    if (!rx_in_place(l, l->rpool, sc)) {
        /* before the first message of a layout copied out of its slot (a
         * GPU layout from host slots, or a device pool to another device or
         * to host memory): the stream and page-locking */
        tdp_err rc = link_stage(l, rx_copy_dev(l->rpool, dev));
        if (rc != TDP_OK)
            return rc;
        /* device storage for every receive slot now, not at a slot's first
         * message (which may come late, once the consumer falls behind);
         * a slot still held or being filled gets it when it comes free */
        for (uint32_t i = 0; i < depth && i < TDP_MAX_DEPTH; i++) {
            tdp_td *g;
            if (l->held[i] != NULL || l->srx[i].copy.active)
                continue;
            if ((rc = rx_device_buf(l, i, sc, &g)) != TDP_OK)
                return rc;
        }
    }
    if (l->rx_schema != sc) {
        tdp_schema_unref(l->rx_schema);
        l->rx_schema = tdp_schema_ref(sc);
    }
    return rx_views(l);
}

/* Give a slot back to the sender. */
static void rx_give_back(struct tdp__link *l, rx_slot *s)
{
    rx_pool *p = s->pool;
    s->held = false;
    p->nheld--;
    if (p->dp != NULL)
        tdp__dpool_publish(p->dp); /* our reads of the slot before the sender rewrites it */
    if (!l->failed && l->rx_ctl != NULL) {
        tdp__shm_desc d = {.type = DESC_WORD(TDP__SHM_DESC_RELEASE, p->gen), .slot =
                               (uint32_t)(s - p->slots)};
        tdp__shm_ring *r = tdp__shm_seg_tx(l->rx_ctl);
        if (tdp__shm_ring_push(r, &d) != TDP_OK || tdp__shm_ring_notify(r) != TDP_OK)
            link_fail(l, TDP_EPROTO, "release ring full or broken");
    }
    if (p != l->rpool && p->nheld == 0) {
        rx_pool **pp = &l->rpool;
        while (*pp != NULL && *pp != p)
            pp = &(*pp)->next;
        if (*pp == p) {
            *pp = p->next;
            rx_pool_drop(p);
        }
    }
}

/* A receive's copy landed (or failed): the session has the message now. */
static void rx_copied(tdp__stage_copy *c, tdp_err st)
{
    staged_rx *r = (staged_rx *)c;
    struct tdp__link *l = r->l;
    l->nsrx--;
    if (r->prog != NULL) {
        r->prog = NULL;
        l->nstream--;
    }
    if (st != TDP_OK) {
        /* the session frees the slot without a release: give it back here */
        rx_slot *s = l->held[r->slot];
        l->held[r->slot] = NULL;
        if (s != NULL)
            rx_give_back(l, s);
    }
    if (!l->closed)
        l->up->landed(l->owner, l, r->slot, st);
    if (l->peer_gone && l->nsrx == 0 && !l->closed)
        link_fail(l, TDP_ECONNRESET, "the peer closed the shared-memory socket");
}

/*
 * Land the message in the session slot through the stage: a copy from the
 * shared slot into dst (NULL: it is in place, and waits only for the
 * receives before it). The shared slot stays held until the session
 * releases the message, which is the sender's credit.
 */
static tdp_err rx_stage(struct tdp__link *l, uint32_t slot, void *dst, const void *src, size_t n,
                        const tdp__shm_desc *d)
{
    staged_rx *r = &l->srx[slot];
    r->copy = (tdp__stage_copy){.done = rx_copied, .arg = r};
    r->l = l;
    r->slot = slot;
    r->prog = NULL;
    if (dst == NULL)
        n = 0;
    size_t avail = n;
    if (n > 0 && DESC_TYPE(d->type) == TDP__SHM_DESC_DATA_STREAM) {
        /* streamed: copy out what has landed, follow the rest (rx_follow) */
        avail = rx_stream_have(l, d->seq, n);
        if (avail < n)
            r->prog = progress_word(l->rx_ctl, d->seq);
    }
    tdp_err rc =
        tdp__stage_copy_start(l->stage, &r->copy, dst, src, n, avail, STAGE_CHUNK, STAGE_INFLIGHT);
    if (rc != TDP_OK)
        return rc;
    l->nsrx++;
    l->nstream += r->prog != NULL;
    return TDP_OK;
}

/*
 * Device storage of a session slot's GPU layouts, shared by the tds that
 * wrap it (the link holds one reference): a layout change that fits reuses
 * it, as the ucx plane reuses its receive storage.
 */
typedef struct dev_store {
    _Atomic uint32_t refs;
    void *buf;
    uint64_t cap;
    int dev;
    tdp_mem_type kind; /* TDP_MEM_CUDA; TDP_MEM_HOST_PINNED for a host layout of device slots */
} dev_store;

static void dev_store_unref(void *buf, void *arg)
{
    dev_store *st = arg;
    (void)buf;
    if (st != NULL && atomic_fetch_sub_explicit(&st->refs, 1, memory_order_acq_rel) == 1) {
        tdp_mem_free(st->kind, st->buf);
        tdp__free(st);
    }
}

/*
 * The buffer session slot `slot` receives a layout copied out of its slot
 * into: device memory for a GPU layout, page-locked host memory for a host
 * layout of device slots (cuda-ipc to a host receive device).
 */
static tdp_err rx_device_buf(struct tdp__link *l, uint32_t slot, tdp_schema *sc, tdp_td **out)
{
    tdp_td *g = l->staged[slot];
    if (g != NULL && g->schema == sc) {
        *out = g;
        return TDP_OK;
    }
    tdp_device dev = tdp_schema_device(sc);
    tdp_mem_type kind = dev.type == TDP_DEVICE_CUDA ? TDP_MEM_CUDA : TDP_MEM_HOST_PINNED;
    int mdev = dev.type == TDP_DEVICE_CUDA ? dev.index : (l->cuda_device >= 0 ? l->cuda_device : 0);
    uint64_t need = tdp_schema_total_bytes(sc);
    dev_store *st = l->dstore[slot];
    tdp_err rc;
    if (st == NULL || st->cap < need || st->dev != mdev || st->kind != kind) {
        dev_store *n = tdp__calloc(1, sizeof(*n));
        if (n == NULL)
            return TDP_ENOMEM;
        if ((rc = tdp_mem_alloc(kind, mdev, need, 0, &n->buf)) != TDP_OK) {
            tdp__free(n);
            return rc;
        }
        n->cap = need;
        n->dev = mdev;
        n->kind = kind;
        atomic_init(&n->refs, 1);
        dev_store_unref(NULL, st); /* the link's reference to the old one */
        l->dstore[slot] = st = n;
    }
    atomic_fetch_add_explicit(&st->refs, 1, memory_order_relaxed);
    tdp_td *n;
    if ((rc = tdp_td_wrap(sc, st->buf, st->cap, dev, dev_store_unref, st, &n)) != TDP_OK) {
        dev_store_unref(NULL, st);
        return rc;
    }
    tdp_td_unref(g);
    l->staged[slot] = n;
    *out = n;
    return TDP_OK;
}

static tdp_err s_recv(tdp__link *l, void *desc, uint32_t slot, tdp_td **td)
{
    const tdp__shm_desc *d = desc;
    rx_slot *s = rx_slot_of(l, d);
    if (slot >= TDP_MAX_DEPTH || l->held[slot] != NULL || l->rx_schema == NULL || s == NULL ||
        l->srx[slot].copy.active)
        return TDP_EPROTO;
    tdp_schema *sc = l->rx_schema;
    uint64_t total = tdp_schema_total_bytes(sc);
    if (d->arg != total || s->pool->stride < total)
        return TDP_EMSGSIZE;
    rx_pool *p = s->pool;
    void *mem = rx_mem(p, d->slot);
    if (p->dp != NULL)
        tdp__dpool_observe(p->dp); /* the sender's bytes, as its descriptor says */
    tdp_device dev = tdp_schema_device(sc);
    tdp_err rc;
    if (!rx_in_place(l, p, sc)) {
        /* a GPU layout from host slots, or device slots to another device
         * (a peer copy) or to host memory: one copy on the link's stream */
        tdp_td *g;
        if ((rc = link_stage(l, rx_copy_dev(p, dev))) != TDP_OK ||
            (rc = rx_device_buf(l, slot, sc, &g)) != TDP_OK ||
            (rc = rx_stage(l, slot, g->data, mem, total, d)) != TDP_OK)
            return rc;
        *td = g;
    } else {
        if (DESC_TYPE(d->type) == TDP__SHM_DESC_DATA_STREAM &&
            rx_stream_have(l, d->seq, total) < total)
            return TDP_EPROTO; /* parked until complete: cannot happen */
        if ((rc = rx_view(l, s)) != TDP_OK)
            return rc;
        /* behind a GPU receive still copying: land after it, in order */
        if (l->nsrx > 0 && (rc = rx_stage(l, slot, NULL, NULL, 0, d)) != TDP_OK)
            return rc;
        *td = s->td;
    }
    s->held = true;
    p->nheld++;
    l->held[slot] = s;
    return l->srx[slot].copy.active ? TDP_EAGAIN : TDP_OK;
}

static void s_release(tdp__link *l, uint32_t slot)
{
    if (slot >= TDP_MAX_DEPTH || l->held[slot] == NULL)
        return;
    rx_slot *s = l->held[slot];
    l->held[slot] = NULL;
    rx_give_back(l, s);
}

/* ---- the socket's events ------------------------------------------------------------ */

static void link_fail(struct tdp__link *l, tdp_err st, const char *why)
{
    if (l->failed || l->closed)
        return;
    l->failed = true;
    if (l->sev != NULL)
        event_del(l->sev);
    l->up->failed(l->owner, l, st, why);
}

static void sock_cb(evutil_socket_t fd, short what, void *arg)
{
    struct tdp__link *l = arg;
    (void)fd;
    (void)what;
    tdp_err rc = sock_read_all(l);
    if (rc == TDP_OK || l->closed)
        return;
    if (rc == TDP_ECLOSED) {
        /* the peer process is gone or closed its side: what it sent before
         * is in the ring; hand that over first, then report the end */
        if (l->rx_ctl != NULL)
            rx_progress(l);
        /* (a streamed message not all there will never be) */
        if (l->nsrx > 0 && rx_streams_whole(l) && !l->failed && !l->closed) {
            /* receives still copying out of our mapping land first (it
             * outlives the peer): the end is told after the last one */
            l->peer_gone = true;
            event_del(l->sev);
            return;
        }
        link_fail(l, TDP_ECONNRESET, "the peer closed the shared-memory socket");
        return;
    }
    link_fail(l, rc == TDP_ENOMEM ? TDP_ENOMEM : TDP_EPROTO,
              "invalid message on the shared-memory socket");
}

static void sock_arm(struct tdp__link *l)
{
    if (l->sev != NULL || l->sock < 0)
        return;
    l->sev = event_new(tdp__loop_base(l->x->loop), l->sock, EV_READ | EV_PERSIST, sock_cb, l);
    if (l->sev == NULL || event_add(l->sev, NULL) != 0) {
        link_fail(l, TDP_ENOMEM, "cannot watch the shared-memory socket");
        return;
    }
}

/* The socket is up and the peer proven: start. */
static void link_ready(struct tdp__link *l)
{
    l->proven = true;
    sock_arm(l);
    if (!l->failed)
        link_flush_early(l);
    /* messages that came with the proof: the (level-triggered) event reads them */
}

/* ---- the listener ------------------------------------------------------------------- */

static void conn_free(pending_conn *c, bool close_fd)
{
    shm_ext *x = c->x;
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        x->conns = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    x->nconns--;
    event_free(c->ev);
    if (close_fd)
        close(c->fd);
    tdp__free(c);
}

static void conn_cb(evutil_socket_t fd, short what, void *arg)
{
    pending_conn *c = arg;
    shm_ext *x = c->x;
    uint8_t buf[MSG_HDR_BYTES];
    int fds[TDP__SHM_MAX_FDS];
    size_t len = 0, nfds = 0;
    (void)what;
    tdp_err rc = tdp__shm_sock_recv(fd, buf, sizeof(buf), &len, fds, TDP__SHM_MAX_FDS, &nfds);
    if (rc == TDP_EAGAIN)
        return;
    close_fds(fds, rc == TDP_OK ? nfds : 0);
    shm_msg m;
    memcpy(&m, buf, sizeof(m));
    struct tdp__link *l = NULL;
    if (rc == TDP_OK && len == MSG_HDR_BYTES && nfds == 0 && m.magic == MSG_MAGIC &&
        m.type == MSG_PROOF) {
        for (l = x->links; l != NULL; l = l->next)
            if (!l->closed && l->sock < 0 && memcmp(l->key, m.key, TDP_SHM_KEY_LEN) == 0)
                break;
    }
    if (l == NULL) {
        tdp_log_debug("shm: dropping a connection that did not prove itself");
        conn_free(c, true);
        return;
    }
    l->sock = c->fd;
    memcpy(l->proof_key, m.peer_key, TDP_SHM_KEY_LEN);
    conn_free(c, false);
    if (!l->started)
        return; /* link_start checks the proof against the HELLO */
    if (memcmp(l->proof_key, l->peer_key, TDP_SHM_KEY_LEN) != 0) {
        link_fail(l, TDP_EPROTO, "the shared-memory peer is not the HELLO's");
        return;
    }
    link_ready(l);
}

static void resume_cb(evutil_socket_t fd, short what, void *arg)
{
    shm_ext *x = arg;
    (void)fd;
    (void)what;
    event_add(x->lev, NULL);
}

static void accept_cb(evutil_socket_t lfd, short what, void *arg)
{
    shm_ext *x = arg;
    (void)what;
    for (int i = 0; i < 16; i++) {
        int fd;
        tdp_err rc = tdp__shm_accept(lfd, true, &fd, NULL);
        if (rc == TDP_EAGAIN || rc == TDP_ECONNREFUSED)
            return; /* nothing more, or a stranger turned away */
        if (rc != TDP_OK) {
            /* out of descriptors: the connection waits in the backlog and
             * the socket stays readable; pause rather than spin */
            static const struct timeval pause = {0, 100000};
            event_del(x->lev);
            if (x->resume == NULL)
                x->resume = evtimer_new(tdp__loop_base(x->loop), resume_cb, x);
            if (x->resume == NULL || evtimer_add(x->resume, &pause) != 0)
                event_add(x->lev, NULL);
            return;
        }
        if (x->nconns >= ACCEPT_PENDING) {
            /* strangers of our uid hold the queue: the oldest go */
            pending_conn *o = x->conns;
            while (o->next != NULL)
                o = o->next;
            conn_free(o, true);
        }
        pending_conn *c = tdp__calloc(1, sizeof(*c));
        if (c == NULL) {
            close(fd);
            return;
        }
        c->x = x;
        c->fd = fd;
        c->ev = event_new(tdp__loop_base(x->loop), fd, EV_READ | EV_PERSIST, conn_cb, c);
        if (c->ev == NULL || event_add(c->ev, NULL) != 0) {
            if (c->ev != NULL)
                event_free(c->ev);
            close(fd);
            tdp__free(c);
            return;
        }
        c->next = x->conns;
        if (x->conns != NULL)
            x->conns->prev = c;
        x->conns = c;
        x->nconns++;
    }
}

/* ---- links --------------------------------------------------------------------------- */

static void link_teardown(struct tdp__link *l)
{
    link_stage_cancel(l); /* before the pools go: the stream may still copy into them */
    if (l->tx_src != NULL)
        tdp__loop_source_remove(l->x->loop, l->tx_src);
    if (l->rx_src != NULL)
        tdp__loop_source_remove(l->x->loop, l->rx_src);
    l->tx_src = l->rx_src = NULL;
    if (l->sev != NULL)
        event_free(l->sev);
    l->sev = NULL;
    if (l->sock >= 0)
        close(l->sock);
    l->sock = -1;
    for (uint32_t i = 0; i < l->nearly; i++) {
        tdp_td_unref(l->early[i].tx.td);
        tdp_schema_unref((tdp_schema *)l->early[i].tx.schema);
    }
    l->nearly = 0;
    slot_wait_set(l, false);
    group_slot_back(l); /* what it held is given back */
    tx_group_leave(l);
    tdp__shm_seg_close(l->tx_ctl);
    l->tx_ctl = NULL;
    for (uint32_t i = 0; i < l->npend; i++) {
        pend_msg *pm = &l->pend[(l->pend_head + i) % l->pend_cap];
        tdp__free(pm->json);
        close_fds(pm->fds, pm->nfds);
        tdp__dpool_unref(pm->dp);
        pm->dp = NULL;
        tdp__cuda_pin_end(pm->pin);
        pm->pin = NULL;
        tdp__shm_seg_close(pm->seg);
        pm->seg = NULL;
    }
    l->npend = l->npend_pools = l->npend_schemas = 0;
    /* views the application holds keep their pool mapped */
    while (l->rpool != NULL) {
        rx_pool *p = l->rpool;
        l->rpool = p->next;
        rx_pool_drop(p);
    }
    tdp__shm_seg_close(l->rx_ctl);
    l->rx_ctl = NULL;
}

static void link_destroy(struct tdp__link *l)
{
    shm_ext *x = l->x;
    link_teardown(l);
    if (l->prev != NULL)
        l->prev->next = l->next;
    else
        x->links = l->next;
    if (l->next != NULL)
        l->next->prev = l->prev;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        tdp_td_unref(l->staged[i]);
        dev_store_unref(NULL, l->dstore[i]);
    }
    tdp_schema_unref(l->rx_schema);
    tx_group_unref(l);
    /* here, not in teardown: a close may come from inside one of its callbacks */
    tdp__stage_free(l->stage);
    tdp__free(l->stx);
    tdp__free(l->early);
    tdp__free(l->pend);
    tdp__free(l);
}

static void link_reap(void *arg)
{
    link_destroy(arg);
}

static void ext_fini(void *ext)
{
    shm_ext *x = ext;
    while (x->conns != NULL)
        conn_free(x->conns, true);
    while (x->links != NULL)
        link_destroy(x->links);
    if (x->lev != NULL)
        event_free(x->lev);
    if (x->resume != NULL)
        event_free(x->resume);
    if (x->slot_ev != NULL)
        event_free(x->slot_ev);
    if (x->lfd >= 0)
        close(x->lfd);
    tdp__free(x);
}

static tdp_err ext_get(tdp_loop *loop, shm_ext **out)
{
    shm_ext *x = tdp__loop_ext(loop, TDP__EXT_SHM);
    if (x != NULL) {
        *out = x;
        return x->lfd >= 0 ? TDP_OK : TDP_ENOTSUP;
    }
    x = tdp__calloc(1, sizeof(*x));
    if (x == NULL)
        return TDP_ENOMEM;
    x->loop = loop;
    x->lfd = -1;
    tdp_err rc = tdp__shm_listen(SOCK_SEQPACKET, true, x->name, &x->lfd);
    if (rc == TDP_OK) {
        x->lev = event_new(tdp__loop_base(loop), x->lfd, EV_READ | EV_PERSIST, accept_cb, x);
        x->slot_ev = event_new(tdp__loop_base(loop), -1, 0, slot_cb, x);
        if (x->lev == NULL || x->slot_ev == NULL || event_add(x->lev, NULL) != 0)
            rc = TDP_ENOMEM;
    }
    /* set even on failure: later pipes on this loop do not try again */
    tdp__loop_set_ext(loop, TDP__EXT_SHM, x, NULL, ext_fini);
    if (rc != TDP_OK) {
        if (x->lev != NULL)
            event_free(x->lev);
        if (x->slot_ev != NULL)
            event_free(x->slot_ev);
        x->lev = x->slot_ev = NULL;
        if (x->lfd >= 0)
            close(x->lfd);
        x->lfd = -1;
        tdp_log_debug("shm plane unavailable on this loop: %s", tdp_strerror(rc));
        return TDP_ENOTSUP;
    }
    *out = x;
    return TDP_OK;
}

static tdp_err s_link_new(tdp_loop *loop, void *owner, const tdp__plane_up *up, tdp__link **out)
{
    shm_ext *x;
    tdp_err rc = ext_get(loop, &x);
    if (rc != TDP_OK)
        return rc;
    struct tdp__link *l = tdp__calloc(1, sizeof(*l));
    if (l == NULL)
        return TDP_ENOMEM;
    if (getrandom(l->key, sizeof(l->key), 0) != (ssize_t)sizeof(l->key)) {
        tdp__free(l);
        return TDP_EINTERNAL;
    }
    l->x = x;
    l->owner = owner;
    l->up = up;
    l->sock = -1;
    l->cuda_device = -1;
    if (tx_group_new(l) != TDP_OK) {
        tdp__free(l);
        return TDP_ENOMEM;
    }
    l->next = x->links;
    if (x->links != NULL)
        x->links->prev = l;
    x->links = l;
    *out = l;
    return TDP_OK;
}

static tdp_err s_hello_fill(tdp__link *l, tdp_hello *h)
{
    tdp__shm_hello mine = {l->key, l->x->name, TDP__SHM_NAME_LEN};
    return tdp__shm_hello_put(h, l->hello_rec, &mine);
}

static tdp_err s_hello_check(const tdp_hello *peer)
{
    tdp__shm_hello sh;
    tdp_err rc = tdp__shm_hello_get(peer, &sh);
    return rc == TDP_ENOENT ? TDP_OK : rc;
}

static bool s_usable(const tdp_hello *peer, bool same_host)
{
    tdp__shm_hello sh;
    return same_host && tdp__shm_hello_get(peer, &sh) == TDP_OK;
}

/* Start a link whose peer's socket and key are h (from its shm or cuda-ipc record). */
static tdp_err link_start_sock(struct tdp__link *l, const tdp__link_peer *peer,
                               const tdp__shm_hello *h)
{
    int c = memcmp(l->key, h->key, TDP_SHM_KEY_LEN);
    if (c == 0)
        return TDP_EPROTO;
    memcpy(l->peer_key, h->key, TDP_SHM_KEY_LEN);
    l->depth = peer->depth;
    l->peer_depth = peer->peer_depth;
    l->window = peer->window;
    l->peer_window = peer->peer_window;
    l->tx_win_now = l->peer_depth;
    l->last_seq = l->seq0 = peer->sent_seq; /* announcements name seqs from there on */
    l->max_json = peer->max_json_bytes;
    l->max_total = peer->max_total_bytes;
    l->sum_on = peer->checksum;
    l->capearly = 2 * tx_win(l, 1) + 1;
    l->early = tdp__alloc_array(l->capearly, sizeof(*l->early));
    /* each message in flight may bring a schema of its own: the window's most of them */
    l->pend_cap = PEND_POOLS(l->depth) + PEND_SCHEMAS(rx_win(l, 1));
    l->pend = tdp__alloc_array(l->pend_cap, sizeof(*l->pend));
    l->capstx = l->capearly;
    l->stx = tdp__alloc_array(l->capstx, sizeof(*l->stx));
    if (l->early == NULL || l->pend == NULL || l->stx == NULL)
        return TDP_ENOMEM;
    l->cuda_device = peer->cuda_device;
    if (l->cuda_device >= 0 && tdp__cuda_device_count() > l->cuda_device) {
        /* the pipe names a device: stream and page-locking now, not in the first send */
        tdp_err rc = link_stage(l, l->cuda_device);
        if (rc != TDP_OK)
            return rc;
    }
    l->started = true;
    if (c < 0) {
        /* the smaller key connects and proves itself */
        int fd;
        tdp_err rc = tdp__shm_connect(SOCK_SEQPACKET, h->name, h->name_len, true, &fd, NULL);
        if (rc != TDP_OK) {
            tdp_log_debug("shm: cannot reach the peer's socket: %s", tdp_strerror(rc));
            return rc == TDP_ENOMEM ? rc : TDP_ECONNREFUSED;
        }
        l->sock = fd;
        shm_msg m = {.type = MSG_PROOF};
        memcpy(m.key, l->peer_key, TDP_SHM_KEY_LEN);
        memcpy(m.peer_key, l->key, TDP_SHM_KEY_LEN);
        if ((rc = msg_send(l, &m, NULL, 0, NULL, 0)) != TDP_OK)
            return rc;
        link_ready(l);
        return l->failed ? TDP_ECONNRESET : TDP_OK;
    }
    if (l->sock >= 0) {
        /* the peer connected before its HELLO was read here */
        if (memcmp(l->proof_key, l->peer_key, TDP_SHM_KEY_LEN) != 0)
            return TDP_EPROTO;
        link_ready(l);
        return l->failed ? TDP_ECONNRESET : TDP_OK;
    }
    return TDP_OK; /* sends wait for the peer to connect */
}

static tdp_err s_link_start(tdp__link *l, const tdp__link_peer *peer)
{
    tdp__shm_hello sh;
    if (tdp__shm_hello_get(peer->hello, &sh) != TDP_OK)
        return TDP_EPROTO;
    return link_start_sock(l, peer, &sh);
}

static bool s_link_busy(const tdp__link *l)
{
    (void)l;
    return false; /* nothing is held by a transport: the peer reads our pages */
}

static void s_link_close(tdp__link *l, bool peer_gone)
{
    if (l->closed)
        return;
    l->closed = true;
    l->peer_dead = peer_gone; /* nothing here waits for the peer; a shared group parks for it */
    link_teardown(l);
    tdp__reap_later(l->x->loop, &l->reap, link_reap, l);
}

/* ---- prepare ------------------------------------------------------------------------ */

/*
 * tdp_pipe_prepare: the pool that holds sc made now and its pages faulted
 * in (a plain first send would fault them in while it copies: 80-100 ms
 * for 100 MB on a virtual machine). The receiver has nothing to allocate
 * (it reads the pool in place): no READY is awaited. The schema is
 * announced for the next DATA when nothing earlier is still to be put in
 * force by the receiver, so that its pending announcements stay within
 * what a send alone may leave (PEND_SCHEMAS); otherwise it goes with the
 * send as usual.
 */
static tdp_err s_prepare(tdp__link *l, tdp_schema *sc, uint64_t seq, bool send_schema, bool *sent,
                         bool *await)
{
    *sent = *await = false;
    if (l->failed)
        return TDP_ECONNRESET;
    if (l->sock < 0 || !l->proven || l->nearly > 0)
        return TDP_EAGAIN; /* the peer has not connected yet, or early sends wait */
    tdp_device dev = tdp_schema_device(sc);
    bool gpu = dev.type == TDP_DEVICE_CUDA;
    int pdev = gpu && ipc_dev_ok(l, dev.index) ? dev.index : -1;
    uint64_t total = tdp_schema_total_bytes(sc);
    s_poll_credit(l); /* releases that came meanwhile */
    tdp_err rc = tx_ctl_up(l);
    if (rc == TDP_OK && gpu)
        rc = link_stage(l, dev.index);
    /* a new pool only while the send that follows still has room for its own */
    if (rc == TDP_OK && !tx_pool_fits(l, total, pdev) &&
        tx_pools_pending(l) + 1 < PEND_POOLS(l->peer_depth))
        rc = tx_pool_grow(l, total, pdev);
    if (rc != TDP_OK)
        return rc;
    tx_pool *p = l->grp->pool;
    bool fits = tx_pool_fits(l, total, pdev);
    if (fits && gpu)
        tdp__cuda_pin_wait(p->pin); /* the first message copies at pinned speed */
    if (fits && p->seg != NULL && !p->populated) {
        /* the slots the sends the credit allows at once take first (tx_pick): the
         * rest of the pool (loans, sends behind them) faults in as it is used */
        uint32_t n = l->peer_depth < p->nslots ? l->peer_depth : p->nslots;
        tdp__populate_write(tx_mem(p, 0), (size_t)(p->stride * n));
        p->populated = true;
    }
    /* the receiver takes a schema only into a pool that holds it (s_rx_schema):
     * announced after that pool, or left to the send that makes one */
    /* (a pool another link of a shared group made, this peer has not seen:
     * the send announces both, in order) */
    if (send_schema && fits && p->gen == l->ann_gen && l->prep_ann_seq != seq &&
        l->seq0 + l->released + 1 >= seq) {
        if ((rc = announce_schema(l, sc, seq)) != TDP_OK)
            return rc;
        l->prep_ann_seq = seq;
        *sent = true;
    }
    return TDP_OK;
}

const tdp__plane_ops tdp__plane_shm = {
    .name = "shm",
    .id = TDP_PLANE_SHM,
    .mem = TDP__MEM_HOST | TDP__MEM_CUDA_STAGED, /* device buffers are copied into the slots */
    .hello_fill = s_hello_fill,
    .hello_check = s_hello_check,
    .usable = s_usable,
    .link_new = s_link_new,
    .link_start = s_link_start,
    .link_close = s_link_close,
    .link_busy = s_link_busy,
    .send = s_send,
    .credit = NULL, /* a RELEASE descriptor is the credit */
    .rx_schema = s_rx_schema,
    .recv = s_recv,
    .release = s_release,
    .loan = s_loan,
    .poll_credit = s_poll_credit,
    .prepare = s_prepare,
};

/* ---- the cuda-ipc plane: this link, GPU payloads in device pools ------------------- */

static tdp_err c_link_new(tdp_loop *loop, void *owner, const tdp__plane_up *up, tdp__link **out)
{
    tdp_err rc = s_link_new(loop, owner, up, out);
    if (rc == TDP_OK) {
        (*out)->ipc = true;
        (*out)->ipc_dev = -1;
    }
    return rc;
}

/* Offered only by a pipe that names its GPU, and only with the UUIDs to tell it by. */
static tdp_err c_link_device(tdp__link *l, int dev)
{
    if (dev < 0)
        return TDP_ENOTSUP;
    l->ipc_dev = dev;
    /* the record now: the peer's HELLO may be read before this side's is sent */
    tdp__shm_hello mine = {l->key, l->x->name, TDP__SHM_NAME_LEN};
    return tdp__shm_ipc_hello_encode(l->ipc_rec, &mine, dev, &l->ipc_rec_len);
}

static tdp_err c_hello_fill(tdp__link *l, tdp_hello *h)
{
    return tdp_hello_add_rec(h, TDP_HX_CUDA_IPC, l->ipc_rec, (uint32_t)l->ipc_rec_len);
}

static tdp_err c_hello_check(const tdp_hello *peer)
{
    tdp__shm_ipc_hello ch;
    tdp_err rc = tdp__shm_ipc_hello_get(peer, &ch);
    return rc == TDP_ENOENT ? TDP_OK : rc;
}

/*
 * Both sides offer it (each record is there), on one host, and each side's
 * GPU is one the other sees: both compute the same answer from the two
 * records.
 */
static bool c_usable_link(const tdp__link *mine, const tdp_hello *peer, bool same_host)
{
    tdp__shm_ipc_hello a, b;
    return mine != NULL && same_host && mine->ipc_rec_len > 0 &&
           tdp__shm_ipc_hello_parse(mine->ipc_rec, mine->ipc_rec_len, &a) == TDP_OK &&
           tdp__shm_ipc_hello_get(peer, &b) == TDP_OK && tdp__cudaipc_reach(&a.gpus, &b.gpus);
}

static tdp_err c_link_start(tdp__link *l, const tdp__link_peer *peer)
{
    const tdp_hx_rec *r = tdp_hello_rec(peer->hello, TDP_HX_CUDA_IPC);
    if (r == NULL || r->len > sizeof(l->peer_rec))
        return TDP_EPROTO;
    /* the peer's record outlives the HELLO: which GPUs it sees decides each pool */
    memcpy(l->peer_rec, r->val, r->len);
    if (tdp__shm_ipc_hello_parse(l->peer_rec, r->len, &l->peer_ipc) != TDP_OK)
        return TDP_EPROTO;
    return link_start_sock(l, peer, &l->peer_ipc.sock);
}

const tdp__plane_ops tdp__plane_cuda_ipc = {
    .name = "cuda-ipc",
    .id = TDP_PLANE_CUDA_IPC,
    /* GPU payloads in device slots (staged through host slots to a peer
     * that does not see their GPU, or with the checksum); host ones as shm */
    .mem = TDP__MEM_HOST | TDP__MEM_CUDA | TDP__MEM_CUDA_STAGED,
    .hello_fill = c_hello_fill,
    .hello_check = c_hello_check,
    .usable_link = c_usable_link,
    .link_device = c_link_device,
    .link_new = c_link_new,
    .link_start = c_link_start,
    .link_close = s_link_close,
    .link_busy = s_link_busy,
    .send = s_send,
    .credit = NULL,
    .rx_schema = s_rx_schema,
    .recv = s_recv,
    .release = s_release,
    .loan = s_loan,
    .poll_credit = s_poll_credit,
    .prepare = s_prepare,
};

/* ---- test hooks ---------------------------------------------------------------------- */

tdp_err tdp__shm_rogue_data(tdp__link *l, const tdp__shm_desc *d, const char *json, size_t jlen,
                            uint64_t seq, uint64_t total)
{
    if (l == NULL || l->sock < 0 || !l->proven)
        return TDP_EINVAL;
    tdp_err rc = tx_ctl_up(l);
    if (rc != TDP_OK)
        return rc;
    if (json != NULL) {
        shm_msg m = {.type = MSG_SCHEMA, .seq = seq, .hash = d->hash, .json_len = jlen,
                     .total = total};
        if ((rc = msg_send(l, &m, json, jlen, NULL, 0)) != TDP_OK)
            return rc;
    }
    tdp__shm_ring *r = tdp__shm_seg_tx(l->tx_ctl);
    if ((rc = tdp__shm_ring_push(r, d)) != TDP_OK)
        return rc;
    return tdp__shm_ring_notify(r);
}

tdp_err tdp__shm_rogue_announce(tdp__link *l, bool pool, uint64_t seq, uint64_t bytes)
{
    if (l == NULL || l->sock < 0 || !l->proven)
        return TDP_EINVAL;
    tdp_err rc;
    if (pool) {
        tdp__shm_seg *seg;
        if ((rc = tdp__shm_seg_create(++l->grp->next_gen, pool_slots(l->peer_depth), bytes, 0,
                                      &seg)) != TDP_OK)
            return rc;
        rc = announce_seg(l, MSG_POOL, seg, seq);
        tdp__shm_seg_close(seg);
        return rc;
    }
    int fd = memfd_create("tdpipe-rogue", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return TDP_ENOMEM;
    rc = TDP_ENOMEM;
    shm_msg m = {.type = MSG_SCHEMA, .flags = MSG_F_JSON_FD, .seq = seq, .json_len = bytes};
    if (ftruncate(fd, (off_t)bytes) == 0 &&
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) == 0)
        rc = msg_send(l, &m, NULL, 0, &fd, 1);
    close(fd);
    return rc;
}

tdp_err tdp__shm_rogue_ctl(tdp__link *l, uint32_t ring_cap)
{
    if (l == NULL || l->sock < 0 || !l->proven || l->tx_ctl != NULL)
        return TDP_EINVAL;
    tdp__shm_seg *seg;
    tdp_err rc = tdp__shm_seg_create(0, 1, TDP__SHM_PAGE, ring_cap, &seg);
    if (rc != TDP_OK)
        return rc;
    rc = announce_seg(l, MSG_CTL, seg, 0);
    tdp__shm_seg_close(seg);
    return rc;
}

tdp_err tdp__shm_rogue_dpool(tdp__link *l, uint64_t seq, int dev, uint64_t bytes, uint64_t nslots,
                             uint64_t stride, const uint8_t *uuid, tdp__dpool **keep)
{
    if (l == NULL || l->sock < 0 || !l->proven)
        return TDP_EINVAL;
    tdp__dpool *dp;
    tdp_err rc = tdp__dpool_new(dev, bytes, &dp);
    if (rc != TDP_OK)
        return rc;
    tdp__cuda_ipc h;
    shm_msg m = {.type = MSG_DPOOL,
                 .gen = ++l->grp->next_gen,
                 .seq = seq,
                 .json_len = nslots,
                 .total = stride,
                 .hash = nslots * stride}; /* a handle as large as claimed */
    memcpy(m.key, tdp__dpool_id(dp), TDP_DPOOL_ID_LEN);
    if (uuid != NULL)
        memcpy(m.peer_key, uuid, TDP_CUDAIPC_UUID);
    else
        rc = tdp__cuda_device_uuid(dev, m.peer_key);
    if (rc == TDP_OK && (rc = tdp__cuda_export(tdp__dpool_base(dp), &h)) == TDP_OK) {
        rc = msg_send(l, &m, NULL, 0, &h.fd, 1);
        close(h.fd);
    }
    if (rc == TDP_OK && keep != NULL)
        *keep = dp;
    else
        tdp__dpool_unref(dp);
    return rc;
}

tdp_err tdp__shm_rogue_release(tdp__link *l, const tdp__shm_desc *d)
{
    if (l == NULL || l->rx_ctl == NULL)
        return TDP_EINVAL;
    tdp__shm_ring *r = tdp__shm_seg_tx(l->rx_ctl);
    tdp_err rc = tdp__shm_ring_push(r, d);
    return rc == TDP_OK ? tdp__shm_ring_notify(r) : rc;
}

uint32_t tdp__shm_desc_word(uint32_t type, uint32_t gen)
{
    return DESC_WORD(type, gen);
}

void tdp__shm_step_socket(tdp__link *l)
{
    if (l->sock >= 0)
        sock_cb(l->sock, EV_READ, l);
}

void tdp__shm_step_ring(tdp__link *l)
{
    if (l->rx_ctl != NULL)
        rx_progress(l);
}

static bool in_seg(const tdp__shm_seg *seg, const tdp__dpool *dp, const void *p)
{
    const uint8_t *base = dp != NULL ? tdp__dpool_base(dp) : tdp__shm_seg_base(seg);
    uint64_t n = dp != NULL ? tdp__dpool_bytes(dp) : tdp__shm_seg_geom(seg)->total_bytes;
    return (const uint8_t *)p >= base && (const uint8_t *)p < base + n;
}

bool tdp__shm_view_in_pool(tdp__link *l, const void *p)
{
    for (rx_pool *rp = l != NULL ? l->rpool : NULL; rp != NULL; rp = rp->next)
        if (in_seg(rp->seg, rp->dp, p))
            return true;
    for (tx_pool *tp = l != NULL ? l->grp->pool : NULL; tp != NULL; tp = tp->next)
        if (in_seg(tp->seg, tp->dp, p))
            return true;
    return false;
}

tdp_err tdp__shm_link_share(tdp__link *l, tdp__link *with)
{
    if (l == NULL || with == NULL || l == with || l->x != with->x || l->ipc || with->ipc ||
        l->bit == 0 || with->bit == 0)
        return TDP_EINVAL;
    if (l->peer_window < with->peer_window)
        return TDP_ENOTSUP; /* the group's pools have more slots than l's peer maps */
    tx_group *g = with->grp;
    if (l->grp == g)
        return TDP_OK;
    for (tx_pool *p = l->grp->pool; p != NULL; p = p->next)
        for (uint32_t i = 0; i < p->nslots; i++)
            if ((p->slots[i].held & l->bit) != 0 || p->slots[i].staging)
                return TDP_EAGAIN; /* its releases would name the old group's slots */
    if (g->bits == UINT64_MAX)
        return TDP_ELIMIT;
    uint64_t bit = ~g->bits & (g->bits + 1); /* the lowest bit free */
    tx_group_unref(l);
    l->grp = g;
    l->bit = bit;
    l->peer_window = with->peer_window; /* the group's pools hold so many in flight */
    g->bits |= bit;
    g->refs++;
    return TDP_OK;
}

uint64_t tdp__shm_link_peer_window(const tdp__link *l)
{
    return l != NULL ? l->peer_window : 0;
}

uint64_t tdp__shm_pool_bytes(tdp__link *l, uint32_t *npools)
{
    uint64_t n = 0;
    uint32_t k = 0;
    for (tx_pool *p = l != NULL && l->grp != NULL ? l->grp->pool : NULL; p != NULL; p = p->next) {
        n += p->seg != NULL ? tdp__shm_seg_geom(p->seg)->total_bytes : tdp__dpool_bytes(p->dp);
        k++;
    }
    if (npools != NULL)
        *npools = k;
    return n;
}

tdp_err tdp__shm_group_loan(tdp__link *l, tdp_schema *sc, tdp_td **out)
{
    if (l == NULL || l->bit == 0 || l->failed || l->closed ||
        tdp_schema_device(sc).type != TDP_DEVICE_CPU)
        return TDP_EINVAL;
    if (l->sock < 0 || !l->proven)
        return TDP_EAGAIN;
    uint64_t need = tdp_schema_total_bytes(sc);
    if (!tx_pool_fits(l, need, -1) && tx_pools_pending(l) > l->peer_depth)
        return TDP_EAGAIN; /* as s_loan: room for the announcements the credit allows */
    tdp_err rc = tx_ctl_up(l);
    if (rc == TDP_OK)
        rc = tx_pool_grow(l, need, -1);
    if (rc != TDP_OK)
        return rc;
    /* the group's links send nothing but its loans: any free slot will do */
    tx_slot *s = tx_pick(l->grp->pool);
    if (s == NULL && tx_pool_parked(l->grp->pool) && tx_pools_pending(l) <= l->peer_depth) {
        l->grp->stale = true; /* parked slots may never come back: a new generation */
        if ((rc = tx_pool_grow(l, need, -1)) != TDP_OK)
            return rc;
        s = tx_pick(l->grp->pool);
    }
    if (s == NULL) {
        l->loan_starved = true; /* a release wakes the loop */
        l->grp->starved = true;
        return TDP_EAGAIN;
    }
    return tx_lend(l->grp->pool, s, sc, out);
}

tdp_err tdp__shm_group_restock(tdp__link *l, tdp_schema *sc)
{
    if (l == NULL || l->bit == 0 || l->failed || l->closed || l->grp->pool == NULL)
        return TDP_EINVAL;
    if (l->sock < 0 || !l->proven)
        return TDP_EAGAIN;
    if (tx_pick(l->grp->pool) != NULL)
        return TDP_OK;
    uint32_t mine = 0;
    for (const tx_pool *p = l->grp->pool; p != NULL; p = p->next)
        for (uint32_t i = 0; i < p->nslots; i++)
            mine += (p->slots[i].held & l->bit) != 0;
    if (mine >= tx_win(l, tdp_schema_total_bytes(sc)) || tx_pools_pending(l) > l->peer_depth)
        return TDP_EAGAIN;
    l->grp->stale = true;
    return TDP_OK;
}

bool tdp__shm_link_up(const tdp__link *l)
{
    return l != NULL && l->sock >= 0 && l->proven;
}

bool tdp__shm_group_lent(tdp__link *l, const tdp_td *td)
{
    return l != NULL && td != NULL && tx_loaned(l, td) != NULL;
}

uint64_t tdp__shm_rx_pools_mapped(void)
{
    return atomic_load_explicit(&rx_pools_mapped, memory_order_relaxed);
}

uint64_t tdp__shm_pools_pinned(void)
{
    return atomic_load_explicit(&pools_pinned, memory_order_relaxed);
}
