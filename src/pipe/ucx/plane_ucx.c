/*
 * plane_ucx.c: the ucx data plane — SCHEMA, DATA and CREDIT as UCX active
 * messages; DATA payloads by rendezvous straight into receive buffers
 * registered once with ucp_mem_map. Works with any peer.
 *
 * Per loop (TDP__EXT_PIPE): the table that maps the token in every
 * incoming frame to its link, the AM handler of each worker, the workers'
 * addresses and what they look like (a peer's address is checked against
 * that and rebuilt before UCX sees it: ucx_addr.h), and one UCX endpoint
 * per remote worker shared by every link
 * between the same two workers (UCX pairs the endpoints two workers create
 * to each other in creation order, which two sides opening several pipes
 * at once need not agree on). A same-host link has a worker of its own
 * (ucx_workers.h says why), and so an endpoint of its own.
 *
 * A closed link lives on while UCX holds any of its buffers (a send or a
 * rendezvous receive in flight) and is freed when the last request
 * completes; in peer-failure mode closing the endpoint completes them at
 * once. What UCX never gives back is freed after the workers are gone.
 */
#include <endian.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>
#include <xxhash.h>

#include "plane_ucx.h"
#include "../checksum.h"
#include "../op.h"
#include "../rx_store.h"
#include "../stage.h"
#include "ucx_addr.h"
#include "ucx_workers.h"
#include "../../core/alloc.h"
#include "../../core/cuda.h"
#include "../../core/log.h"
#include "../../core/populate.h"
#include "../../core/reap.h"

typedef struct ucx_ext ucx_ext;

/* One endpoint per remote worker, shared by the links to it. */
typedef struct shared_ep {
    ucx_ext *x;
    int wi;
    bool peer_mode;
    bool failed;
    bool peer_gone; /* a link's control channel saw the peer die */
    bool flushed;   /* the flush before its forced close ended (or was not needed) */
    void *flush_req;
    int64_t flush_deadline;
    uint32_t refs;
    ucp_worker_h w;
    struct tdp__link *solo; /* the one link of a private worker's endpoint */
    ucp_ep_h ep;
    size_t alen;
    uint8_t *addr;
    struct shared_ep *next;
} shared_ep;

/*
 * A registered page-locked host buffer: where a GPU payload waits between
 * its device->host copy and UCX (sending), or between UCX and its
 * host->device copy (receiving), on a UCX without CUDA support. Made when a
 * layout is first sent or received, grown only when a layout needs more.
 */
typedef struct bounce {
    void *p;
    size_t cap;
    tdp__cuda_pin *pin; /* page-locked, or being (tdp__stage_host_alloc) */
    ucp_mem_h memh;
    bool busy;
} bounce;

/*
 * Chunked staged sends (TDP_AM_F_CHUNKED, CHUNK frames): a GPU payload of
 * more than CHUNK_MIN bytes goes out as CHUNK frames of STAGE_CHUNK bytes
 * (the last one shorter), each posted as soon as the device->bounce copy
 * has landed it, at most TX_CHUNKS of a message in flight in UCX. UCX may
 * hand the receiver the CHUNKs of one message in another order than they
 * were sent (rendezvous and multi-lane eager complete as they complete):
 * the receiver places each by its offset on the sender's grid.
 */
#define STAGE_CHUNK   (4u << 20)
#define CHUNK_MIN     STAGE_CHUNK
#define TX_CHUNKS     8u
#define TX_REQS       (2u + TX_CHUNKS) /* SCHEMA, DATA, then one per CHUNK in flight */
#define CHUNK_DESC    8u               /* a CHUNKED DATA's payload: chunk_bytes u32, 0 u32 */
#define CHUNK_MIN_LEN (1u << 20)       /* the chunk sizes a receiver takes */
#define CHUNK_MAX_LEN (64u << 20)

/*
 * Batches (TDP_AM_BATCH, to a peer whose HELLO has TDP_HX_UCX_BATCH): the
 * first send of a loop turn is posted at once, as ever, and so is any send
 * a blocking call waits for; small host messages sent after it in the same
 * turn (async sends, or several threads' sends the loop thread takes at
 * once) are copied into a batch, posted as one AM when the loop ends its
 * turn (the flush source), when the batch is full, or before a send that
 * cannot join it. A stream of small messages then costs one UCX send (over
 * TCP one system call, and one wake-up of the receiver) per batch, not per
 * message. A batch fits UCX's eager short protocol (8185 bytes with the
 * AM's header in UCX 1.13, over TCP and shared memory): a larger AM goes
 * by zero-copy or rendezvous, each a round trip. Over TCP an eager AM is
 * one zero-copy send up to a 64 KB segment, with no round trip: where a
 * link's active messages go over TCP its batches are twice as large
 * (BATCH_BYTES_TCP), which halves the system calls and wake-ups per small
 * message (docs/benchmarks.md, "Streams of small messages").
 */
#define BATCH_BYTES     8064u  /* a batch's payload: entries back to back */
#define BATCH_BYTES_TCP 16320u /* the same where the link's AM lane is TCP */
#define BATCH_ITEM_MAX  (BATCH_BYTES / 2)
#define BATCH_BUFS     4u /* batches in UCX at once, besides the open one */

struct ticket;

typedef struct batch {
    struct tdp__link *l;
    void *req;                  /* UCX holds it (and its buffer) */
    struct ticket *head, *tail; /* its sends, in order (ticket.next_b) */
    uint32_t n;
    size_t len;
    uint64_t seq0; /* the first entry's */
    bool busy;     /* open, or in UCX */
    uint8_t hdr[TDP_AM_HDR_LEN];
    uint8_t *buf; /* BATCH_BYTES of the link's batch_mem */
} batch;

/* A send UCX may hold: the headers live here until its requests finish. */
typedef struct ticket {
    tdp__stage_copy copy; /* a staged send's device->bounce copy (copy.arg: the ticket) */
    struct tdp__link *l;
    void *cookie;
    tdp_td *td;
    int inflight;
    tdp_err status;
    void *req[TX_REQS]; /* [0] SCHEMA, [1] DATA, [2 + i] the CHUNK in chunk_hdr[i] */
    struct ticket *next_free;
    struct ticket *next_q; /* in l->txq: sends waiting behind a staged one */
    struct ticket *next_b; /* in a batch */
    bounce *bn;            /* a staged send's bounce, while it holds one */
    bool send_schema;      /* the SCHEMA frame goes first */
    bool staged;           /* a GPU payload copied through a bounce */
    bool copying, copied;  /* its copy is queued / has landed */
    tdp_err copy_rc;
    uint8_t schema_hdr[TDP_AM_HDR_LEN];
    uint8_t data_hdr[TDP_AM_HDR_MAX_LEN];
    size_t data_hdr_len; /* TDP_AM_HDR_LEN, or with the checksum TDP_AM_HDR_SUM_LEN */
    /* a chunked staged send: its frames go out as the copy lands them */
    bool chunked;
    bool head_sent; /* SCHEMA and DATA are posted; CHUNKs follow */
    uint64_t data_seq;
    size_t landed; /* bytes of the bounce that hold their final value */
    size_t posted; /* bytes posted as CHUNK frames */
    uint8_t chunk_hdr[TX_CHUNKS][TDP_AM_HDR_LEN];
    uint8_t chunk_desc[CHUNK_DESC]; /* the DATA's payload: the chunk size */
} ticket;

/* Receive storage shared by the tds that wrap it; freed with the last one. */
typedef tdp__rx_store rx_store;

struct rx_buf;

/* One CHUNK frame's bytes on their way into the receive bounce. */
typedef struct rx_chunk {
    struct rx_buf *b;
    void *req; /* rendezvous receive in flight */
    size_t len;
    tdp_err rc;
    bool seen;                 /* its CHUNK frame came (each comes once) */
    bool done;                 /* its bytes are in the bounce (or failed: rc) */
    bool posting, posted_done; /* as rx_buf's, for this receive */
} rx_chunk;

typedef struct rx_buf {
    tdp__stage_copy copy; /* a staged receive's bounce->device copy (copy.arg: the buffer) */
    struct tdp__link *l;
    rx_store *store;
    ucp_mem_h memh;
    bounce rb;    /* GPU layouts on a UCX without CUDA: UCX lands the bytes here */
    bool copying; /* the bounce->device copy is queued */
    tdp_td *td; /* wraps store for the schema it was built for */
    void *req;  /* rendezvous receive in flight */
    bool lent;  /* given to the session, not yet released */
    bool posting;     /* inside ucp_am_recv_data_nbx */
    bool posted_done; /* ...and its callback already ran, with posted_rc */
    tdp_err posted_rc;
    /* a chunked message: one entry per chunk of the sender's grid */
    bool chunk_failed;
    uint64_t cseq, chash;       /* the DATA frame's: every CHUNK must carry them */
    size_t csize;               /* the sender's chunk size, from the DATA frame */
    size_t cavail;              /* bytes [0, cavail) of the bounce are in */
    uint32_t nch, nseen, nheld; /* chunks, CHUNK frames seen, receives in UCX */
    uint32_t cbase;             /* the first chunk not yet in */
    rx_chunk *ch;               /* capch entries: grown with the layout, never per message */
    uint32_t capch;
} rx_buf;

struct tdp__link {
    ucx_ext *x;
    void *owner;
    const tdp__plane_up *up;
    uint64_t token, peer_token;
    uint32_t reg_index;
    int wi;       /* TDP_WORKER_ANY or TDP_WORKER_LOCAL */
    bool wi_seen; /* a frame pinned the worker before link_start */
    /* the link's own same-host worker (ucx_workers.h says why), its address,
     * and the forced close of its endpoint while that is in progress */
    tdp__ucx_private *own;
    bool no_own; /* none, for good: the HELLO has (or will have) no same-host address */
    /* with a secret: none before the proofs, then one if PROVEN carries its address */
    bool own_late;
    ucp_address_t *own_addr;
    size_t own_addr_len;
    void *close_req;
    bool started, closed;
    bool peer_mode;
    bool sum_on; /* the payload checksum is in force (tdp__link_peer.checksum) */
    shared_ep *sep;
    tdp__reap reap;
    struct tdp__link *next, *prev; /* every link of the loop, for teardown */

    ticket *tickets;
    uint32_t nticket;
    ticket *free_tickets;
    uint32_t reqs; /* UCX requests in flight (sends, credit, receives) */

    void *credit_req;
    uint64_t credit_want;
    /* the most credit any frame of this link was posted with: a DATA's
     * header, encoded when it was sent, may be posted later (a batch, the
     * queue behind a staged send) and is raised to it, since a peer refuses
     * credit that goes backwards */
    uint64_t credit_hi;
    uint8_t credit_hdr[TDP_AM_HDR_LEN];

    tdp_schema *rx_schema;
    rx_buf rx[TDP_MAX_DEPTH];

    /* GPU payloads where UCX cannot take device memory ("GPU payloads" below) */
    int cuda_device;        /* tdp_pipe_opts.cuda_device, -1 for none */
    tdp__stage *stage;      /* the link's copy stream for sends, made once */
    tdp__stage *rx_stage;   /* ...and for receives (a chunked receive waits on its peer) */
    bool peer_chunks;       /* the peer's HELLO has TDP_HX_UCX_CHUNKS version 1 */
    rx_buf *rx_open;        /* the chunked message whose CHUNK frames are still due */
    uint64_t chunked_tx, chunked_rx; /* messages sent / taken as CHUNK frames (for tests) */
    uint64_t rx_progress;            /* CHUNK frames taken and fetches landed (ops.rx_progress) */
    bounce txb[2];          /* send bounces: a copy overlaps the previous transfer */
    uint32_t ntxb;          /* in use: min(peer depth, 2) */
    ticket *txq, *txq_tail; /* sends in order behind a staged one */
    bool stage_failed;

    /* tdp_pipe_prepare ("prepare" below) */
    bool peer_ready;  /* the peer answers a prepared SCHEMA with READY */
    bool rx_populate; /* the SCHEMA being taken was prepared: fault its storage in now */

    /* batches of small messages (see BATCH_BYTES) */
    bool peer_batch; /* the peer's HELLO has TDP_HX_UCX_BATCH version 1 */
    bool turn_sent;  /* a send went out this loop turn: the next small one may wait */
    bool dirty;      /* in x->dirty: the flush source looks at it */
    struct tdp__link *next_dirty;
    batch bt[BATCH_BUFS];
    batch *bopen;       /* the batch sends join now */
    uint8_t *batch_mem; /* BATCH_BUFS * batch_bytes, made at the first batch */
    uint32_t batch_bytes;            /* BATCH_BYTES, or BATCH_BYTES_TCP (link_batch_bytes) */
    uint64_t batched_tx, batched_rx; /* messages sent / taken inside BATCH frames */
};

/* A link's own worker whose endpoint close did not finish: freed last. */
struct stray {
    tdp__ucx_private *own;
    ucp_address_t *addr;
    void *req;
    struct stray *next;
};

struct ucx_ext {
    tdp_loop *loop;
    tdp__ucx *ucx;
    int cuda_mem; /* -1 not asked yet, 0: this UCX cannot take device memory, 1: it can */
    struct tdp__link *links;
    struct tdp__link **tab; /* token low half -> link */
    uint32_t cap;
    shared_ep *eps, *dead_eps;
    shared_ep *closing_eps; /* unused (refs 0), closed by flush_progress (ep_unref) */
    struct stray *strays;
    void **closing; /* endpoint closes still in progress */
    uint32_t nclosing, capclosing;
    struct am_arg {
        ucx_ext *x;
        int wi;
    } args[TDP_LOOP_WORKERS];
    ucp_address_t *addr[TDP_LOOP_WORKERS];
    size_t addr_len[TDP_LOOP_WORKERS];
    tdp__ucxa_profile *profile[TDP_LOOP_WORKERS];
    /* links that sent this turn: the flush source posts their batches */
    struct tdp__link *dirty;
    tdp__source *flush_src;
};

static void link_maybe_free(struct tdp__link *l);

/* ---- per-loop state ------------------------------------------------------------ */

static void purge_closing(ucx_ext *x)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < x->nclosing; i++) {
        if (ucp_request_check_status(x->closing[i]) != UCS_INPROGRESS)
            ucp_request_free(x->closing[i]);
        else
            x->closing[k++] = x->closing[i];
    }
    x->nclosing = k;
}

static void track_close(ucx_ext *x, void *req)
{
    purge_closing(x);
    if (x->nclosing == x->capclosing) {
        uint32_t cap = x->capclosing ? x->capclosing * 2 : 16;
        void **c = tdp__realloc(x->closing, cap * sizeof(*c));
        if (c == NULL) {
            ucp_request_free(req); /* cannot wait for it: let UCX finish alone */
            return;
        }
        x->closing = c;
        x->capclosing = cap;
    }
    x->closing[x->nclosing++] = req;
}

static void rx_buf_drop(struct tdp__link *l, rx_buf *b);
static void unlink_ep(shared_ep **list, shared_ep *e);
static void link_drop_own(struct tdp__link *l);
static void close_deferred_now(ucx_ext *x, bool all);

/*
 * Before the workers go: let endpoint closes finish (destroying a worker
 * with a close in progress can crash UCX 1.13), then abandon what UCX
 * still holds: the requests are freed (their callbacks never run) and the
 * buffers wait for fini, after the workers.
 */
static void ext_pre_fini(void *ext)
{
    ucx_ext *x = ext;
    int64_t end = tdp__now_ms() + 1000;
    close_deferred_now(x, true); /* flushes still under way end with the close */
    tdp__loop_source_remove(x->loop, x->flush_src);
    x->flush_src = NULL;
    for (;;) {
        purge_closing(x);
        if (x->nclosing == 0 || tdp__now_ms() > end)
            break;
        x->ucx->progressing++;
        for (int i = 0; i < x->ucx->nworkers; i++)
            ucp_worker_progress(x->ucx->worker[i]);
        x->ucx->progressing--;
    }
    if (x->nclosing > 0)
        tdp_log_warn("%u endpoint close(s) still in progress as the loop goes", x->nclosing);
    for (uint32_t i = 0; i < x->nclosing; i++)
        ucp_request_free(x->closing[i]);
    x->nclosing = 0;
    for (struct tdp__link *l = x->links; l != NULL; l = l->next) {
        for (uint32_t i = 0; i < l->nticket; i++) {
            for (uint32_t k = 0; k < TX_REQS; k++) {
                if (l->tickets[i].req[k] != NULL)
                    ucp_request_free(l->tickets[i].req[k]);
                l->tickets[i].req[k] = NULL;
            }
        }
        for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
            if (l->rx[i].req != NULL)
                ucp_request_free(l->rx[i].req);
            l->rx[i].req = NULL;
            for (uint32_t k = 0; k < l->rx[i].capch; k++) {
                if (l->rx[i].ch[k].req != NULL)
                    ucp_request_free(l->rx[i].ch[k].req);
                l->rx[i].ch[k].req = NULL;
            }
        }
        if (l->credit_req != NULL)
            ucp_request_free(l->credit_req);
        l->credit_req = NULL;
        for (uint32_t i = 0; i < BATCH_BUFS; i++) {
            if (l->bt[i].req != NULL)
                ucp_request_free(l->bt[i].req);
            l->bt[i].req = NULL;
        }
        l->reqs = 0;
        if (l->own != NULL) {
            if (l->sep != NULL && l->sep->solo == l) {
                /* its endpoint goes with the worker */
                shared_ep *e = l->sep;
                l->sep = NULL;
                unlink_ep(e->failed ? &x->dead_eps : &x->eps, e);
                tdp__free(e->addr);
                tdp__free(e);
            }
            if (l->close_req != NULL)
                ucp_request_free(l->close_req);
            l->close_req = NULL;
            link_drop_own(l);
        }
    }
    while (x->strays != NULL) {
        struct stray *st = x->strays;
        ucp_worker_h w = tdp__ucx_private_worker(st->own);
        for (int64_t stop = tdp__now_ms() + 100;
             ucp_request_check_status(st->req) == UCS_INPROGRESS && tdp__now_ms() <= stop;) {
            x->ucx->progressing++;
            ucp_worker_progress(w);
            x->ucx->progressing--;
        }
        ucp_request_free(st->req);
        ucp_worker_release_address(w, st->addr);
        tdp__ucx_private_free(st->own);
        x->strays = st->next;
        tdp__free(st);
    }
    for (int i = 0; i < TDP_LOOP_WORKERS; i++) {
        if (x->addr[i] != NULL)
            ucp_worker_release_address(x->ucx->worker[i], x->addr[i]);
        x->addr[i] = NULL;
    }
}

static void link_destroy(struct tdp__link *l);

/* After the workers are gone: nothing can touch the buffers any more. */
static void ext_fini(void *ext)
{
    ucx_ext *x = ext;
    x->ucx->in_use = NULL;
    while (x->links != NULL) {
        x->links->sep = NULL; /* its endpoint went with the worker */
        link_destroy(x->links);
    }
    shared_ep *lists[2] = {x->eps, x->dead_eps};
    for (int k = 0; k < 2; k++) { /* links never closed: the workers took their eps */
        while (lists[k] != NULL) {
            shared_ep *e = lists[k];
            lists[k] = e->next;
            tdp__free(e->addr);
            tdp__free(e);
        }
    }
    for (int i = 0; i < TDP_LOOP_WORKERS; i++)
        tdp__free(x->profile[i]);
    tdp__free(x->closing);
    tdp__free(x->tab);
    tdp__free(x);
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param);
static tdp_err worker_address(ucx_ext *x, int wi, const void **addr, size_t *len);
static const tdp__source_ops flush_ops;

/* What each worker's address looks like: the shapes a peer's may take. */
static tdp_err learn_profiles(ucx_ext *x)
{
    for (int i = 0; i < x->ucx->nworkers; i++) {
        const void *a;
        size_t len;
        tdp_err rc = worker_address(x, i, &a, &len);
        if (rc != TDP_OK)
            return rc;
        if (a == NULL)
            continue; /* no such worker: no link uses it */
        if ((x->profile[i] = tdp__malloc(sizeof(*x->profile[i]))) == NULL)
            return TDP_ENOMEM;
        if ((rc = tdp__ucxa_profile_init(x->profile[i], a, len)) != TDP_OK)
            return rc;
    }
    return TDP_OK;
}

static void ext_free_unregistered(ucx_ext *x)
{
    for (int i = 0; i < TDP_LOOP_WORKERS; i++) {
        if (x->addr[i] != NULL)
            ucp_worker_release_address(x->ucx->worker[i], x->addr[i]);
        tdp__free(x->profile[i]);
    }
    tdp__free(x);
}

/* Whether UCX may have anything for this loop (ucx_workers.h). */
static bool ext_in_use(void *arg)
{
    const ucx_ext *x = arg;
    return x->links != NULL || x->eps != NULL || x->dead_eps != NULL || x->closing_eps != NULL ||
           x->nclosing > 0 || x->strays != NULL;
}

static tdp_err ext_get(tdp_loop *loop, ucx_ext **out)
{
    ucx_ext *x = tdp__loop_ext(loop, TDP__EXT_PIPE);
    if (x != NULL) {
        *out = x;
        return TDP_OK;
    }
    tdp__ucx *ucx;
    tdp_err rc = tdp__ucx_get(loop, &ucx);
    if (rc != TDP_OK)
        return rc;
    x = tdp__calloc(1, sizeof(*x));
    if (x == NULL)
        return TDP_ENOMEM;
    x->loop = loop;
    x->ucx = ucx;
    x->cuda_mem = -1;
    /* before any handler points at x: a failure here leaves nothing behind */
    if ((rc = learn_profiles(x)) != TDP_OK) {
        ext_free_unregistered(x);
        return rc;
    }
    /* after the workers' sources: a turn's batches go once UCX has progressed */
    if ((rc = tdp__loop_source_add(loop, -1, &flush_ops, x, &x->flush_src)) != TDP_OK) {
        ext_free_unregistered(x);
        return rc;
    }
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = TDP_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = am_cb,
    };
    for (int i = 0; i < ucx->nworkers; i++) {
        x->args[i].x = x;
        x->args[i].wi = i;
        hp.arg = &x->args[i];
        ucs_status_t st = ucp_worker_set_am_recv_handler(ucx->worker[i], &hp);
        if (st != UCS_OK) {
            tdp_log_error("ucp_worker_set_am_recv_handler: %s", ucs_status_string(st));
            tdp__loop_source_remove(loop, x->flush_src);
            ext_free_unregistered(x);
            return TDP_EUCX;
        }
    }
    ucx->in_use = ext_in_use;
    ucx->in_use_arg = x;
    tdp__loop_set_ext(loop, TDP__EXT_PIPE, x, ext_pre_fini, ext_fini);
    *out = x;
    return TDP_OK;
}

static tdp_err worker_address(ucx_ext *x, int wi, const void **addr, size_t *len)
{
    if (wi >= x->ucx->nworkers || x->ucx->worker[wi] == NULL) {
        *addr = NULL; /* no such worker: an empty address */
        *len = 0;
        return TDP_OK;
    }
    if (x->addr[wi] == NULL) {
        ucs_status_t st = ucp_worker_get_address(x->ucx->worker[wi], &x->addr[wi],
                                                 &x->addr_len[wi]);
        if (st != UCS_OK) {
            tdp_log_error("ucp_worker_get_address: %s", ucs_status_string(st));
            return TDP_EUCX;
        }
    }
    *addr = x->addr[wi];
    *len = x->addr_len[wi];
    return TDP_OK;
}

static uint64_t random64(void)
{
    uint64_t v;
    if (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v)) {
        static _Atomic uint64_t ctr;
        v = XXH3_64bits_withSeed(&v, sizeof(v), (uint64_t)getpid() ^ atomic_fetch_add(&ctr, 1));
    }
    return v;
}

static tdp_err tab_add(ucx_ext *x, struct tdp__link *l)
{
    uint32_t i;
    for (i = 0; i < x->cap; i++)
        if (x->tab[i] == NULL)
            break;
    if (i == x->cap) {
        uint32_t cap = x->cap ? x->cap * 2 : 16;
        struct tdp__link **t = tdp__realloc(x->tab, cap * sizeof(*t));
        if (t == NULL)
            return TDP_ENOMEM;
        memset(t + x->cap, 0, (cap - x->cap) * sizeof(*t));
        x->tab = t;
        x->cap = cap;
    }
    x->tab[i] = l;
    l->reg_index = i;
    /* high half random: a stale or forged token names no live link */
    l->token = (random64() & 0xffffffff00000000ull) | i;
    return TDP_OK;
}

static void tab_remove(struct tdp__link *l)
{
    ucx_ext *x = l->x;
    if (l->reg_index < x->cap && x->tab[l->reg_index] == l)
        x->tab[l->reg_index] = NULL;
}

static struct tdp__link *tab_lookup(ucx_ext *x, uint64_t token)
{
    uint32_t i = (uint32_t)token;
    if (i >= x->cap || x->tab[i] == NULL || x->tab[i]->token != token)
        return NULL;
    return x->tab[i];
}

/* ---- shared endpoints ------------------------------------------------------- */

static void unlink_ep(shared_ep **list, shared_ep *e)
{
    for (shared_ep **pp = list; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == e) {
            *pp = e->next;
            return;
        }
    }
}

static void ep_unref(shared_ep *e);

/* UCX says the peer behind this endpoint failed: every link on it fails. */
static void shared_ep_err(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    shared_ep *e = arg;
    ucx_ext *x = e->x;
    if (e->failed || e->refs == 0) /* none left: closing (ep_unref), its links gone */
        return;
    e->failed = true;
    unlink_ep(&x->eps, e); /* new links to that peer get a fresh endpoint */
    e->next = x->dead_eps;
    x->dead_eps = e;
    e->refs++; /* hold it while the links let go */
    for (uint32_t i = 0; i < x->cap; i++) {
        struct tdp__link *l = x->tab[i];
        if (l != NULL && l->sep == e && !l->closed)
            l->up->failed(l->owner, l, TDP_ECONNRESET,
                          l->rx_open != NULL ? "the peer failed inside a chunked message"
                                             : ucs_status_string(st));
    }
    ep_unref(e);
}

static ucp_worker_h link_worker(const struct tdp__link *l)
{
    if (l->wi == TDP_WORKER_LOCAL)
        return l->own != NULL ? tdp__ucx_private_worker(l->own) : NULL;
    return l->x->ucx->worker[TDP_WORKER_ANY];
}

static tdp_err ep_acquire(struct tdp__link *l, const void *addr, size_t alen)
{
    ucx_ext *x = l->x;
    ucp_worker_h w = link_worker(l);
    if (w == NULL)
        return TDP_EINTERNAL; /* link_start made the link's own worker */
    for (shared_ep *e = x->eps; e != NULL; e = e->next) {
        if (e->w == w && e->peer_mode == l->peer_mode && e->alen == alen &&
            memcmp(e->addr, addr, alen) == 0) {
            e->refs++;
            l->sep = e;
            return TDP_OK;
        }
    }
    shared_ep *e = tdp__calloc(1, sizeof(*e));
    /* zeros after the address: a transport that reads a little past it reads them */
    if (e == NULL || (e->addr = tdp__calloc(1, alen + TDP_UCXA_PAD)) == NULL) {
        tdp__free(e);
        return TDP_ENOMEM;
    }
    memcpy(e->addr, addr, alen);
    e->alen = alen;
    e->x = x;
    e->wi = l->wi;
    e->w = w;
    e->solo = l->wi == TDP_WORKER_LOCAL ? l : NULL;
    e->peer_mode = l->peer_mode;
    ucp_ep_params_t prm = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = (const ucp_address_t *)e->addr,
        .err_mode = l->peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
    };
    if (l->peer_mode) {
        prm.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        prm.err_handler.cb = shared_ep_err;
        prm.err_handler.arg = e;
    }
    ucs_status_t st = ucp_ep_create(w, &prm, &e->ep);
    if (st != UCS_OK) {
        tdp_log_error("ucp_ep_create: %s", ucs_status_string(st));
        tdp__free(e->addr);
        tdp__free(e);
        return TDP_EUCX;
    }
    e->refs = 1;
    e->next = x->eps;
    x->eps = e;
    l->sep = e;
    return TDP_OK;
}

/* Close an endpoint nobody uses any more (never from inside a UCX callback: ep_unref). */
static void ep_close(shared_ep *e)
{
    ucx_ext *x = e->x;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
        /* in peer-failure mode a forced close releases everything at once
         * (a flush close there keeps TCP sockets open); UCX 1.13 allows it
         * only in that mode */
        .flags = e->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0,
    };
    void *req = ucp_ep_close_nbx(e->ep, &prm);
    if (UCS_PTR_IS_ERR(req))
        tdp_log_debug("ucp_ep_close_nbx: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    else if (req != NULL && e->peer_gone && !e->peer_mode)
        /* a flush towards a dead process never ends (and a forced close
         * needs peer-failure mode, which TDP_PEER_SOCKET turns off):
         * UCX frees it when done or with the worker; nobody waits for it */
        ucp_request_free(req);
    else if (req != NULL && e->solo != NULL)
        e->solo->close_req = req; /* its private worker waits for it (link_drop_own) */
    else if (req != NULL)
        track_close(x, req); /* finished before the worker goes */
    tdp__loop_kick(x->loop);
    tdp__free(e->addr);
    tdp__free(e);
}

/* How long a closing endpoint's flush may take before it is closed anyway. */
#define EP_FLUSH_MS 1000

static void ep_flush_cb(void *req, ucs_status_t st, void *user)
{
    shared_ep *e = user;
    (void)st; /* failed or not, the forced close comes next */
    ucp_request_free(req);
    e->flush_req = NULL;
    e->flushed = true;
    tdp__loop_kick(e->x->loop); /* flush_progress closes it */
}

/*
 * The endpoints whose close waits: for UCX to return (ep_unref), and for
 * their flush, or its deadline. all: the loop goes, close every one now.
 * Never inside a UCX callback.
 */
static void close_deferred_now(ucx_ext *x, bool all)
{
    int64_t now = all ? 0 : tdp__now_ms();
    for (shared_ep **pp = &x->closing_eps; *pp != NULL;) {
        shared_ep *e = *pp;
        if (!all && !e->flushed && now < e->flush_deadline) {
            pp = &e->next;
            continue;
        }
        *pp = e->next;
        if (e->flush_req != NULL) { /* the deadline: the close takes it over */
            ucp_request_free(e->flush_req);
            e->flush_req = NULL;
        }
        ep_close(e);
    }
}

/*
 * An endpoint nobody uses any more is closed, forced (peer-failure mode),
 * but not at once:
 * - not inside a UCX callback (a frame refused from its active-message
 *   handler, a peer's failure): there a forced close lets UCX 1.13's TCP
 *   transport reset the receive buffer of the very connection whose
 *   message it is still parsing, which it then releases again (a crash in
 *   uct_tcp_iface_progress);
 * - not while its wireup is under way: a forced close then purges the
 *   reply UCX still has to send, which UCX 1.13 asserts never happens
 *   (ucp_request_send_state_ff: "got REP message"; the assertion is gone
 *   from UCX 1.14). So it is flushed first, for at most EP_FLUSH_MS, unless
 *   its peer is known gone.
 * A link's own worker's endpoint (solo) is closed now: its link waits for
 * that close (link_drop_own).
 */
static void ep_unref(shared_ep *e)
{
    if (--e->refs > 0)
        return;
    ucx_ext *x = e->x;
    unlink_ep(e->failed ? &x->dead_eps : &x->eps, e);
    if (e->solo != NULL) {
        ep_close(e);
        return;
    }
    e->flushed = true;
    e->flush_req = NULL;
    if (e->peer_mode && !e->failed && !e->peer_gone) {
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            .cb.send = ep_flush_cb,
            .user_data = e,
        };
        e->flushed = false;
        e->flush_deadline = tdp__now_ms() + EP_FLUSH_MS;
        void *r = ucp_ep_flush_nbx(e->ep, &prm);
        if (r == NULL || UCS_PTR_IS_ERR(r))
            e->flushed = true;
        else if (!e->flushed) /* else its callback ran already and freed it */
            e->flush_req = r;
    }
    if (e->flushed && x->ucx->progressing == 0) {
        ep_close(e);
        return;
    }
    e->next = x->closing_eps;
    x->closing_eps = e;
    tdp__loop_kick(x->loop); /* flush_progress closes it once UCX has returned */
}

/* ---- GPU payloads on a UCX without CUDA --------------------------------------- */

/*
 * Copies on the link's stream: 4 MiB chunks, at most 4 of a copy queued at
 * once, so a large payload neither waits for one huge copy nor floods the
 * stream.
 */
#define STAGE_INFLIGHT 4u

/*
 * Whether this UCX can take device memory (ucp_context_query's memory
 * types; Debian's UCX has no CUDA support). Asked once per loop: every
 * worker's context comes from the same library. The fake device's memory
 * is ours alone: even a UCX with CUDA could not read it.
 */
static bool ucx_takes_cuda(ucx_ext *x)
{
    if (x->cuda_mem < 0) {
        ucp_context_attr_t a = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
        ucp_context_h c = x->ucx->context[TDP_WORKER_ANY];
        x->cuda_mem = tdp__cuda_backend_get() == TDP__CUDA_DRIVER && c != NULL &&
                      ucp_context_query(c, &a) == UCS_OK &&
                      (a.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
        tdp_log_debug("ucx: device memory %s",
                      x->cuda_mem ? "handed to UCX" : "staged through host memory");
    }
    return x->cuda_mem == 1;
}

/* Device memory this link copies through bounces (UCX cannot take it). */
static bool stages(const struct tdp__link *l, tdp_device dev)
{
    return dev.type == TDP_DEVICE_CUDA && !ucx_takes_cuda(l->x);
}

static void bounce_free(struct tdp__link *l, bounce *b)
{
    if (b->memh != NULL)
        ucp_mem_unmap(l->x->ucx->context[l->wi], b->memh);
    if (b->p != NULL)
        tdp__stage_host_free(b->p, b->pin);
    *b = (bounce){0};
}

/*
 * At least `need` bytes of registered page-locked memory in b: made (or
 * grown) when a layout is first sent or received, never per message;
 * page-locked at once for a prepare (now), else in the background
 * (tdp__stage_host_alloc).
 */
static tdp_err bounce_fit(struct tdp__link *l, bounce *b, size_t need, bool now)
{
    if (b->p != NULL && b->cap >= need)
        return TDP_OK;
    bounce_free(l, b);
    tdp_err rc = tdp__stage_host_alloc(need, now, &b->p, &b->pin);
    if (rc != TDP_OK)
        return rc;
    b->cap = need;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = b->p,
        .length = need > 0 ? need : 1,
    };
    ucs_status_t us = ucp_mem_map(l->x->ucx->context[l->wi], &mp, &b->memh);
    if (us != UCS_OK) {
        tdp_log_debug("ucp_mem_map of a bounce: %s (sending without a handle)",
                      ucs_status_string(us));
        b->memh = NULL;
    }
    return TDP_OK;
}

/* The link's stream, made at link start when the pipe names a device, else now. */
static tdp_err stage_ready(struct tdp__link *l, int dev)
{
    tdp_err rc = TDP_OK;
    if (l->stage == NULL)
        rc = tdp__stage_new(l->x->loop, dev < 0 ? 0 : dev, 0, &l->stage);
    if (rc == TDP_OK && l->rx_stage == NULL)
        rc = tdp__stage_new(l->x->loop, dev < 0 ? 0 : dev, 0, &l->rx_stage);
    return rc;
}

/* ---- receive storage ------------------------------------------------------------ */

static void rx_buf_drop(struct tdp__link *l, rx_buf *b)
{
    if (b->memh != NULL) {
        ucp_mem_unmap(l->x->ucx->context[l->wi], b->memh);
        b->memh = NULL;
    }
    bounce_free(l, &b->rb);
    tdp_td_unref(b->td); /* the store goes with the last td that wraps it */
    b->td = NULL;
    b->store = NULL;
}

/* Make b hold a td of the current receive schema (storage only). */
static tdp_err rx_store_build(struct tdp__link *l, rx_buf *b)
{
    tdp_schema *sc = l->rx_schema;
    tdp_device dev = tdp_schema_device(sc);
    tdp_mem_type mt = dev.type == TDP_DEVICE_CUDA ? TDP_MEM_CUDA : TDP_MEM_HOST;
    uint64_t need = tdp_schema_total_bytes(sc);
    tdp_err rc;

    bool staged = stages(l, dev);
    if (b->td != NULL && b->td->schema == sc)
        return TDP_OK;
    if (tdp__rx_store_fits(b->store, b->td, need, mt, dev))
        return tdp__rx_store_rewrap(b->store, sc, dev, &b->td); /* its registration kept */
    rx_buf_drop(l, b);
    rx_store *st;
    if ((rc = tdp__rx_store_new(sc, mt, dev, need, l->rx_populate, &st, &b->td)) != TDP_OK)
        return rc;
    b->store = st;
    if (need > 0 && !staged) {
        /* registered once: every rendezvous lands here without a lookup */
        ucp_mem_map_params_t mp = {
            .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            .address = st->buf,
            .length = need,
        };
        if (mt == TDP_MEM_CUDA) {
            mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
            mp.memory_type = UCS_MEMORY_TYPE_CUDA;
        }
        ucs_status_t us = ucp_mem_map(l->x->ucx->context[l->wi], &mp, &b->memh);
        if (us != UCS_OK) {
            tdp_log_debug("ucp_mem_map: %s (receiving without a handle)", ucs_status_string(us));
            b->memh = NULL;
        }
    }
    return TDP_OK;
}

static tdp_err rx_chunks_fit(rx_buf *b, uint32_t n);

/*
 * Make b hold a td of the current receive schema; a GPU layout on a UCX
 * without CUDA gets its bounce (as large as the storage) and the stream now.
 */
static tdp_err rx_buf_build(struct tdp__link *l, rx_buf *b)
{
    tdp_err rc = rx_store_build(l, b);
    tdp_device dev = tdp_schema_device(l->rx_schema);
    if (rc != TDP_OK || !stages(l, dev))
        return rc;
    if ((rc = stage_ready(l, dev.index)) != TDP_OK)
        return rc;
    if ((rc = bounce_fit(l, &b->rb, b->store->cap, l->rx_populate)) != TDP_OK)
        return rc;
    /* room for a chunked message at the smallest chunk size a peer may use:
     * made with the layout, so no receive allocates */
    uint64_t most = (b->store->cap + CHUNK_MIN_LEN - 1) / CHUNK_MIN_LEN;
    return rx_chunks_fit(b, most > UINT32_MAX ? UINT32_MAX : (uint32_t)most);
}

static tdp_err u_rx_schema(tdp__link *l, tdp_schema *sc, uint32_t depth)
{
    if (l->rx_schema != sc) {
        tdp_schema_unref(l->rx_schema);
        l->rx_schema = tdp_schema_ref(sc);
    }
    /* buffers holding an older message are rebuilt when it is released */
    for (uint32_t i = 0; i < depth && i < TDP_MAX_DEPTH; i++) {
        rx_buf *b = &l->rx[i];
        if (b->lent || b->req != NULL)
            continue;
        tdp_err rc = rx_buf_build(l, b);
        if (rc != TDP_OK)
            return rc;
    }
    return TDP_OK;
}

/* A GPU layout on a UCX without CUDA: the bytes land in the bounce first. */
static bool rx_staged(const rx_buf *b)
{
    return b->rb.p != NULL && b->store != NULL && b->store->mt == TDP_MEM_CUDA;
}

/* The bounce->device copy landed: the message is whole on the device. */
static void rx_copied(tdp__stage_copy *c, tdp_err st)
{
    rx_buf *b = c->arg;
    struct tdp__link *l = b->l;
    b->copying = false;
    l->reqs--;
    if (!l->closed)
        l->up->landed(l->owner, l, (uint32_t)(b - l->rx), st);
    link_maybe_free(l);
}

static tdp_err rx_copy_start(struct tdp__link *l, rx_buf *b, size_t n)
{
    b->copy = (tdp__stage_copy){.done = rx_copied, .arg = b};
    tdp_err rc = tdp__stage_copy_start(l->rx_stage, &b->copy, b->td->data, b->rb.p, n, n,
                                       STAGE_CHUNK, STAGE_INFLIGHT);
    if (rc != TDP_OK)
        return rc;
    b->copying = true;
    l->reqs++;
    return TDP_OK;
}

static void recv_cb(void *req, ucs_status_t st, size_t length, void *user)
{
    rx_buf *b = user;
    struct tdp__link *l = b->l;
    tdp_err rc = st == UCS_OK && length == b->td->nbytes ? TDP_OK : TDP_ECONNRESET;
    ucp_request_free(req);
    if (b->posting) {
        /*
         * UCX 1.13 completes a rendezvous receive inside ucp_am_recv_data_nbx
         * when the endpoint failed before the RTS was handled (a peer killed
         * mid-transfer), and still returns the request: u_recv reports it.
         * Counting it and telling the session from here, before u_recv
         * returned, left the freed request in b->req, dropped the buffer's
         * td under the plane and kept the link, with its other buffers,
         * until the loop was freed (which freed the request again).
         */
        tdp_log_debug("rendezvous receive ended as it was posted: %s", ucs_status_string(st));
        b->posted_done = true;
        b->posted_rc = rc;
        return;
    }
    b->req = NULL;
    l->reqs--;
    /* staged: landed once the copy to the device is done (rx_copied) */
    if (!l->closed && rc == TDP_OK && rx_staged(b) &&
        (rc = rx_copy_start(l, b, b->td->nbytes)) == TDP_OK) {
        link_maybe_free(l);
        return;
    }
    if (!l->closed)
        l->up->landed(l->owner, l, (uint32_t)(b - l->rx), rc);
    link_maybe_free(l);
}

/*
 * The bytes of a staged receive are in the bounce (st TDP_OK): copy them to
 * the device; the session hears of it through up->landed (TDP_EAGAIN).
 */
static tdp_err rx_staged_landed(struct tdp__link *l, rx_buf *b, tdp_err st)
{
    if (st == TDP_OK)
        st = rx_copy_start(l, b, b->td->nbytes);
    if (st != TDP_OK) {
        b->lent = false;
        return st;
    }
    return TDP_EAGAIN;
}

typedef struct am_desc {
    void *data;
    size_t length;
    const ucp_am_recv_param_t *param;
    const tdp_am_hdr *h; /* the DATA frame's header */
} am_desc;

static tdp_err rx_chunked_start(struct tdp__link *l, rx_buf *b, const am_desc *d, tdp_td **td);

static tdp_err u_recv(tdp__link *l, void *desc, uint32_t slot, tdp_td **td)
{
    am_desc *d = desc;
    if (slot >= TDP_MAX_DEPTH || l->rx_schema == NULL)
        return TDP_EINVAL;
    rx_buf *b = &l->rx[slot];
    if (b->req != NULL || b->lent)
        return TDP_EPROTO;
    tdp_err rc = rx_buf_build(l, b);
    if (rc != TDP_OK)
        return rc;
    if ((d->h->flags & TDP_AM_F_CHUNKED) != 0)
        return rx_chunked_start(l, b, d, td);
    if (d->length != b->td->nbytes)
        return TDP_EMSGSIZE;
    b->lent = true;
    *td = b->td;
    bool staged = rx_staged(b);
    void *into = staged ? b->rb.p : b->td->data;
    if (!(d->param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        if (d->length > 0)
            memcpy(into, d->data, d->length);
        return staged ? rx_staged_landed(l, b, TDP_OK) : TDP_OK;
    }
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.recv_am = recv_cb,
        .user_data = b,
    };
    ucp_mem_h memh = staged ? b->rb.memh : b->memh;
    if (memh != NULL) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = memh;
    }
    if (b->store->mt == TDP_MEM_CUDA && !staged) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        prm.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    b->posting = true;
    b->posted_done = false;
    void *r = ucp_am_recv_data_nbx(link_worker(l), d->data, into, d->length, &prm);
    b->posting = false;
    if (b->posted_done) { /* recv_cb ran and freed the request: r is not ours */
        if (b->posted_rc != TDP_OK)
            b->lent = false;
        return staged ? rx_staged_landed(l, b, b->posted_rc) : b->posted_rc;
    }
    if (r == NULL)
        return staged ? rx_staged_landed(l, b, TDP_OK) : TDP_OK;
    if (UCS_PTR_IS_ERR(r)) {
        b->lent = false;
        return TDP_ECONNRESET;
    }
    b->req = r;
    l->reqs++;
    return TDP_EAGAIN;
}

static void u_release(tdp__link *l, uint32_t slot)
{
    if (slot < TDP_MAX_DEPTH)
        l->rx[slot].lent = false;
}

/* ---- chunked receives --------------------------------------------------------- */

/* Room for n chunk entries: grown when a layout needs more, never per message. */
static tdp_err rx_chunks_fit(rx_buf *b, uint32_t n)
{
    if (b->capch >= n)
        return TDP_OK;
    rx_chunk *ch = tdp__alloc_array(n, sizeof(*ch));
    if (ch == NULL)
        return TDP_ENOMEM;
    tdp__free(b->ch);
    b->ch = ch;
    b->capch = n;
    return TDP_OK;
}

/*
 * A CHUNKED DATA frame: its 8-byte payload names the sender's chunk size
 * (1..64 MiB). The buffer's bounce->device copy starts now with nothing
 * yet to copy and follows the CHUNK frames as their bytes land
 * (tdp__stage_copy_avail); the session hears through up->landed once the
 * last byte is on the device. Only a layout this side stages takes it.
 */
static tdp_err rx_chunked_start(struct tdp__link *l, rx_buf *b, const am_desc *d, tdp_td **td)
{
    size_t n = b->td->nbytes;
    const uint8_t *p = d->data;
    if (!rx_staged(b) || l->rx_stage == NULL || d->length != CHUNK_DESC || n == 0)
        return TDP_EPROTO; /* chunks for a layout this side does not stage */
    uint32_t csize =
        (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    if (csize < CHUNK_MIN_LEN || csize > CHUNK_MAX_LEN || memcmp(p + 4, "\0\0\0\0", 4) != 0)
        return TDP_EPROTO;
    if (d->h->length != n)
        return TDP_EMSGSIZE;
    if (b->nheld != 0)
        return TDP_EPROTO; /* receives of an earlier message still held: never reused */
    uint64_t nch = (n + csize - 1) / csize;
    if (nch > UINT32_MAX)
        return TDP_EMSGSIZE;
    tdp_err rc = rx_chunks_fit(b, (uint32_t)nch);
    if (rc != TDP_OK)
        return rc;
    memset(b->ch, 0, nch * sizeof(*b->ch));
    b->chunk_failed = false;
    b->cseq = d->h->seq;
    b->chash = d->h->hash;
    b->csize = csize;
    b->nch = (uint32_t)nch;
    b->nseen = b->cbase = 0;
    b->cavail = 0;
    b->copy = (tdp__stage_copy){.done = rx_copied, .arg = b};
    rc = tdp__stage_copy_start(l->rx_stage, &b->copy, b->td->data, b->rb.p, n, 0, STAGE_CHUNK,
                               STAGE_INFLIGHT);
    if (rc != TDP_OK)
        return rc;
    b->copying = true;
    l->reqs++;
    b->lent = true;
    *td = b->td;
    l->rx_open = b;
    l->chunked_rx++;
    return TDP_EAGAIN;
}

/*
 * A chunked message will not complete: its copy stops, the session drops
 * the buffer (never handed out partly filled) and the link ends. Receives
 * still in UCX keep the link until they come back.
 */
static void rx_chunk_fail(struct tdp__link *l, rx_buf *b, tdp_err rc)
{
    b->chunk_failed = true;
    if (l->rx_open == b)
        l->rx_open = NULL;
    tdp_log_warn("a chunked message was cut short: %zu of %zu bytes arrived in order", b->cavail,
                 b->td != NULL ? b->td->nbytes : 0);
    if (b->copying) {
        tdp__stage_copy_cancel(l->rx_stage, &b->copy);
        b->copying = false;
        l->reqs--;
    }
    if (l->closed)
        return;
    l->up->failed(l->owner, l, rc, "the peer's chunked message was cut short");
    if (!l->closed)
        l->up->landed(l->owner, l, (uint32_t)(b - l->rx), rc);
}

/* The copy may take the bytes up to the first chunk not yet in. */
static void rx_chunks_settle(struct tdp__link *l, rx_buf *b)
{
    while (b->cbase < b->nch && b->ch[b->cbase].done) {
        rx_chunk *k = &b->ch[b->cbase];
        if (k->rc != TDP_OK) {
            rx_chunk_fail(l, b, k->rc);
            return;
        }
        b->cavail += k->len;
        b->cbase++;
    }
    if (b->copying)
        tdp__stage_copy_avail(l->rx_stage, &b->copy, b->cavail);
}

static void chunk_recv_cb(void *req, ucs_status_t st, size_t length, void *user)
{
    rx_chunk *k = user;
    rx_buf *b = k->b;
    struct tdp__link *l = b->l;
    tdp_err rc = st == UCS_OK && length == k->len ? TDP_OK : TDP_ECONNRESET;
    ucp_request_free(req);
    k->rc = rc;
    if (k->posting) { /* as in recv_cb: the poster sees it */
        k->posted_done = true;
        return;
    }
    k->req = NULL;
    k->done = true;
    b->nheld--;
    l->reqs--;
    l->rx_progress++;
    if (!l->closed && !b->chunk_failed)
        rx_chunks_settle(l, b);
    link_maybe_free(l);
}

/* Fetch one chunk's bytes into the bounce; k is done, or held by UCX. */
static void rx_chunk_fetch(struct tdp__link *l, rx_chunk *k, void *desc, void *into,
                           const ucp_am_recv_param_t *param)
{
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(into, desc, k->len);
        k->done = true;
        return;
    }
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.recv_am = chunk_recv_cb,
        .user_data = k,
    };
    if (k->b->rb.memh != NULL) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = k->b->rb.memh;
    }
    k->posting = true;
    k->posted_done = false;
    void *r = ucp_am_recv_data_nbx(link_worker(l), desc, into, k->len, &prm);
    k->posting = false;
    if (k->posted_done || r == NULL) {
        k->done = true; /* k->rc: TDP_OK, or what the callback said */
    } else if (UCS_PTR_IS_ERR(r)) {
        k->done = true;
        k->rc = TDP_ECONNRESET;
    } else {
        k->req = r;
        k->b->nheld++;
        l->reqs++;
    }
}

/*
 * A CHUNK frame. Checked before a byte moves: a chunked message is open
 * on this link and the frame is of it (seq, hash); its offset is on the
 * sender's grid and inside the layout, its length is that chunk's (the
 * grid's size, the last one what is left), no chunk comes twice (so none
 * overlaps and, once all have come, none is missing), and the payload is
 * as long as the frame says. Anything else ends the link (TDP_EPROTO).
 */
static void rx_chunk_in(struct tdp__link *l, const tdp_am_hdr *h, void *data, size_t length,
                        const ucp_am_recv_param_t *param)
{
    rx_buf *b = l->rx_open;
    const char *why = NULL;
    uint64_t i = 0;
    if (b == NULL) {
        why = "chunk frame without a chunked message in progress";
    } else if (h->seq != b->cseq || h->hash != b->chash) {
        why = "chunk frame of another message";
    } else if (h->arg % b->csize != 0 || (i = h->arg / b->csize) >= b->nch) {
        why = "chunk frame off its message's grid";
    } else if (b->ch[i].seen) {
        why = "chunk frame sent twice";
    } else {
        size_t left = b->td->nbytes - (size_t)h->arg;
        if (h->length != (left < b->csize ? left : b->csize))
            why = "chunk frame of the wrong length";
        else if (length != h->length)
            why = "chunk length differs from its frame";
    }
    if (why != NULL) {
        tdp_log_debug("chunk frame refused: seq %llu offset %llu length %llu",
                      (unsigned long long)h->seq, (unsigned long long)h->arg,
                      (unsigned long long)h->length);
        l->up->failed(l->owner, l, TDP_EPROTO, why);
        return;
    }
    rx_chunk *k = &b->ch[i];
    *k = (rx_chunk){.b = b, .len = length, .rc = TDP_OK, .seen = true};
    l->rx_progress++;
    if (++b->nseen == b->nch)
        l->rx_open = NULL; /* every chunk announced: the next frame is a new message */
    rx_chunk_fetch(l, k, data, (char *)b->rb.p + h->arg, param);
    rx_chunks_settle(l, b);
}

/* ---- incoming frames ------------------------------------------------------------ */

/*
 * A BATCH frame: every entry is checked (a DATA for this link, numbered
 * on from the batch's seq, within the payload, which they fill exactly)
 * before the first is handed on; then each goes as the DATA frame it
 * would have been, its bytes copied out in the callback as eager DATA's.
 */
static void rx_batch_in(struct tdp__link *l, const tdp_am_hdr *bh, const void *data, size_t length,
                        const ucp_am_recv_param_t *param)
{
    static const ucp_am_recv_param_t eager = {.recv_attr = 0};
    if (l->rx_open != NULL) {
        l->up->failed(l->owner, l, TDP_EPROTO, "batch frame inside a chunked message");
        return;
    }
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV || length != bh->length) {
        l->up->failed(l->owner, l, TDP_EPROTO, "batch frame by rendezvous or cut short");
        return;
    }
    const uint8_t *p = data;
    size_t left = length, used;
    tdp_am_hdr h;
    const uint8_t *bytes;
    for (uint64_t i = 0; i < bh->arg; i++, p += used, left -= used) {
        if (tdp_wire_batch_entry(p, left, l->token, bh->seq + i, &h, &bytes, &used) != TDP_OK) {
            l->up->failed(l->owner, l, TDP_EPROTO, "malformed batch entry");
            return;
        }
    }
    if (left != 0) {
        l->up->failed(l->owner, l, TDP_EPROTO, "batch longer than its entries");
        return;
    }
    p = data;
    left = length;
    for (uint64_t i = 0; i < bh->arg && !l->closed; i++, p += used, left -= used) {
        (void)tdp_wire_batch_entry(p, left, l->token, bh->seq + i, &h, &bytes, &used);
        l->up->credit(l->owner, l, h.arg);
        if (l->closed)
            break;
        tdp__frame f = {.type = TDP_AM_DATA,
                        .seq = h.seq,
                        .hash = h.hash,
                        .length = h.length,
                        .arg = h.arg,
                        .has_sum = (h.flags & TDP_AM_F_SUM) != 0,
                        .sum = h.sum};
        am_desc d = {(void *)bytes, (size_t)h.length, &eager, &h};
        l->up->data(l->owner, l, &f, &d);
        l->batched_rx++;
    }
}

static ucs_status_t am_cb(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param)
{
    const struct am_arg *aa = arg;
    ucx_ext *x = aa->x;
    tdp_am_hdr h;
    tdp_err rc = tdp_wire_am_decode(header, header_length, &h);

    if (rc != TDP_OK) {
        /* the token sits at a fixed place: end the link it names, if any */
        if (header != NULL && header_length >= TDP_AM_HDR_LEN) {
            uint64_t tok = 0;
            for (int i = 7; i >= 0; i--)
                tok = (tok << 8) | ((const uint8_t *)header)[8 + i];
            struct tdp__link *l = tab_lookup(x, tok);
            if (l != NULL && !l->closed)
                l->up->failed(l->owner, l, rc, "malformed frame header");
        }
        tdp_log_debug("dropping malformed active message (%zu-byte header)", header_length);
        return UCS_OK; /* UCX drops the data (and answers a rendezvous) */
    }
    struct tdp__link *l = tab_lookup(x, h.token);
    if (l == NULL || l->closed)
        return UCS_OK;
    if (!l->started && !l->wi_seen) {
        /* the peer has our HELLO and chose a worker before we read its own:
         * its choice is the one ours will be; link_start checks that */
        l->wi = aa->wi;
        l->wi_seen = true;
    } else if (aa->wi != l->wi) {
        l->up->failed(l->owner, l, TDP_EPROTO, "frame on the wrong worker");
        return UCS_OK;
    }
    tdp__frame f = {.type = h.type,
                    .seq = h.seq,
                    .hash = h.hash,
                    .length = h.length,
                    .arg = h.arg,
                    .has_sum = (h.flags & TDP_AM_F_SUM) != 0,
                    .sum = h.sum,
                    .prepare = (h.flags & TDP_AM_F_PREPARE) != 0};
    switch (h.type) {
    case TDP_AM_CREDIT:
        l->up->credit(l->owner, l, h.arg);
        break;
    case TDP_AM_SCHEMA:
        if (l->rx_open != NULL) {
            l->up->failed(l->owner, l, TDP_EPROTO, "schema frame inside a chunked message");
            break;
        }
        if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV || length != h.length) {
            l->up->failed(l->owner, l, TDP_EPROTO, "schema frame by rendezvous or cut short");
            break;
        }
        l->rx_populate = f.prepare;
        l->up->schema(l->owner, l, &f, data, length);
        l->rx_populate = false;
        break;
    case TDP_AM_DATA: {
        bool chunked = (h.flags & TDP_AM_F_CHUNKED) != 0;
        if (l->rx_open != NULL) {
            l->up->failed(l->owner, l, TDP_EPROTO, "data frame inside a chunked message");
            break;
        }
        if (chunked ? length != CHUNK_DESC : length != h.length) {
            l->up->failed(l->owner, l, TDP_EMSGSIZE, "data length differs from its frame");
            break;
        }
        /* the credit the peer owes rides on its data */
        l->up->credit(l->owner, l, h.arg);
        if (l->closed)
            break;
        am_desc d = {data, length, param, &h};
        l->up->data(l->owner, l, &f, &d);
        break;
    }
    case TDP_AM_CHUNK:
        rx_chunk_in(l, &h, data, length, param);
        break;
    case TDP_AM_BATCH:
        rx_batch_in(l, &h, data, length, param);
        break;
    }
    return UCS_OK;
}

/* ---- sending ------------------------------------------------------------------ */

static void tx_pump(struct tdp__link *l);

static void ticket_done(ticket *t, ucs_status_t st)
{
    struct tdp__link *l = t->l;
    if (st != UCS_OK && t->status == TDP_OK)
        /* cancelled while the link is up: the receiver declined a rendezvous
         * that came after its side ended (just after its BYE): the stream ended */
        t->status = st == UCS_ERR_CANCELED ? TDP_ECLOSED : TDP_ECONNRESET;
    if (--t->inflight > 0)
        return;
    void *cookie = t->cookie;
    tdp_err status = t->status;
    bool had_bounce = t->bn != NULL;
    if (t->bn != NULL)
        t->bn->busy = false; /* UCX is done with it: the next staged send may copy into it */
    t->bn = NULL;
    tdp_td_unref(t->td);
    t->td = NULL;
    t->cookie = NULL;
    t->next_free = l->free_tickets;
    l->free_tickets = t;
    if (!l->closed)
        l->up->sent(l->owner, l, cookie, status);
    if (had_bounce && !l->closed)
        tx_pump(l);
    link_maybe_free(l);
}

/* A chunked send still posting: its hold keeps the ticket while it is. */
static bool chunks_due(const ticket *t)
{
    return t->chunked && t->td != NULL && t->posted < t->td->nbytes;
}

static void send_cb(void *req, ucs_status_t st, void *user)
{
    ticket *t = user;
    struct tdp__link *l = t->l;
    for (uint32_t i = 0; i < TX_REQS; i++)
        if (t->req[i] == req)
            t->req[i] = NULL;
    ucp_request_free(req);
    l->reqs--;
    bool more = chunks_due(t); /* a failure there ends the send too */
    ticket_done(t, st);
    if (more && !l->closed)
        tx_pump(l); /* a CHUNK slot came free */
}

/*
 * A DATA header about to be posted: its credit (arg) raised to the most
 * any frame before it said, and that most raised to its own.
 */
static void hdr_credit(struct tdp__link *l, uint8_t *hdr)
{
    uint64_t v;
    memcpy(&v, hdr + TDP_AM_HDR_ARG_OFF, sizeof(v));
    v = le64toh(v);
    if (v < l->credit_hi) {
        uint64_t w = htole64(l->credit_hi);
        memcpy(hdr + TDP_AM_HDR_ARG_OFF, &w, sizeof(w));
    } else {
        l->credit_hi = v;
    }
}

/*
 * Post one AM for a ticket, its request kept in t->req[slot]; counts it in
 * flight unless it finished at once.
 */
static tdp_err am_post(struct tdp__link *l, ticket *t, uint32_t slot, uint8_t *hdr, size_t hdr_len,
                       const void *buf, size_t len, uint32_t flags, ucs_memory_type_t mt,
                       ucp_mem_h memh)
{
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = send_cb,
        .user_data = t,
        .flags = flags,
    };
    if (mt != UCS_MEMORY_TYPE_HOST) {
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        prm.memory_type = mt;
    }
    if (memh != NULL) { /* a bounce, registered once */
        prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        prm.memh = memh;
    }
    void *r = ucp_am_send_nbx(l->sep->ep, TDP_AM_ID, hdr, hdr_len, buf, len, &prm);
    if (r == NULL)
        return TDP_OK;
    if (UCS_PTR_IS_ERR(r)) {
        tdp_log_debug("ucp_am_send_nbx: %s", ucs_status_string(UCS_PTR_STATUS(r)));
        return TDP_ECONNRESET;
    }
    t->req[slot] = r;
    t->inflight++;
    l->reqs++;
    return TDP_OK;
}

/* Hand a ticket back unsent, without telling the session. */
static void ticket_return(struct tdp__link *l, ticket *t)
{
    tdp_td_unref(t->td);
    t->td = NULL;
    t->cookie = NULL;
    t->bn = NULL;
    t->next_free = l->free_tickets;
    l->free_tickets = t;
}

/*
 * Post a ticket's frames: the schema if asked, then the data, from the
 * bounce for a staged send (host memory to UCX). TDP_OK: the ticket
 * completes through ticket_done; else nothing was posted.
 */
static tdp_err tx_post(struct tdp__link *l, ticket *t)
{
    tdp_td *td = t->td;
    tdp_err rc = TDP_OK;
    t->inflight = 1; /* held until both posts are made */
    if (t->send_schema) {
        size_t jl;
        const char *json = tdp_schema_json(td->schema, &jl);
        /* eager: the schema is whole in the receiver's callback, before its data */
        rc = am_post(l, t, 0, t->schema_hdr, TDP_AM_HDR_LEN, json, jl, UCP_AM_SEND_FLAG_EAGER,
                     UCS_MEMORY_TYPE_HOST, NULL);
    }
    if (rc == TDP_OK) {
        const void *src = t->bn != NULL ? t->bn->p : td->data;
        ucs_memory_type_t mt = td->device.type == TDP_DEVICE_CUDA && t->bn == NULL
                                   ? UCS_MEMORY_TYPE_CUDA
                                   : UCS_MEMORY_TYPE_HOST;
        hdr_credit(l, t->data_hdr);
        if (t->chunked) /* the chunk size only: the CHUNKs carry the bytes */
            rc = am_post(l, t, 1, t->data_hdr, t->data_hdr_len, t->chunk_desc, CHUNK_DESC,
                         UCP_AM_SEND_FLAG_EAGER, UCS_MEMORY_TYPE_HOST, NULL);
        else
            rc = am_post(l, t, 1, t->data_hdr, t->data_hdr_len, src, td->nbytes, 0, mt,
                         t->bn != NULL ? t->bn->memh : NULL);
    }
    if (t->chunked) { /* the hold stays until every CHUNK is posted (tx_chunks) */
        tdp__loop_kick(l->x->loop);
        if (rc != TDP_OK && t->inflight == 1)
            return rc;
        if (rc != TDP_OK)
            t->status = rc;
        t->head_sent = true;
        return TDP_OK;
    }
    tdp__loop_kick(l->x->loop);
    if (rc != TDP_OK && t->inflight == 1)
        return rc;
    if (rc != TDP_OK)
        t->status = rc;
    ticket_done(t, UCS_OK); /* drop the hold: completes now if UCX finished both */
    return TDP_OK;
}

/* A free send bounce, made large enough; NULL while every one is in flight. */
static bounce *bounce_take(struct tdp__link *l, size_t need, tdp_err *rc)
{
    *rc = TDP_OK;
    for (uint32_t i = 0; i < l->ntxb; i++) {
        bounce *b = &l->txb[i];
        if (b->busy)
            continue;
        if ((*rc = bounce_fit(l, b, need, false)) != TDP_OK)
            return NULL;
        b->busy = true;
        return b;
    }
    return NULL;
}

/* Bytes [0, landed) of a chunked send's bounce are in: CHUNKs may go. */
static void tx_progress(tdp__stage_copy *c, size_t landed)
{
    ticket *t = c->arg;
    t->landed = landed;
    if (!t->l->closed)
        tx_pump(t->l);
}

/* A staged send's device->bounce copy landed (or failed). */
static void tx_copied(tdp__stage_copy *c, tdp_err st)
{
    ticket *t = c->arg;
    struct tdp__link *l = t->l;
    t->copying = false;
    t->copied = true;
    t->copy_rc = st;
    if (st == TDP_OK)
        t->landed = t->td->nbytes;
    l->reqs--;
    if (!l->closed)
        tx_pump(l);
    link_maybe_free(l);
}

/* The queue's head leaves it; a failure ends that send (and the link). */
static void tx_finish_head(struct tdp__link *l, ticket *t, tdp_err rc)
{
    l->txq = t->next_q;
    if (l->txq == NULL)
        l->txq_tail = NULL;
    t->next_q = NULL;
    if (rc == TDP_OK && (rc = tx_post(l, t)) == TDP_OK)
        return;
    void *cookie = t->cookie;
    if (t->bn != NULL)
        t->bn->busy = false;
    ticket_return(l, t);
    l->stage_failed = true;
    l->up->sent(l->owner, l, cookie, rc);
    if (!l->closed)
        l->up->failed(l->owner, l, rc == TDP_ECUDA ? TDP_ECUDA : TDP_ECONNRESET,
                      "cannot stage a GPU payload through host memory");
}

/*
 * Move the queue on, in order: staged sends take a free bounce and start
 * their copy (the stage lands copies in start order); the head is posted
 * once its copy has landed, and host sends behind it right after it.
 */
static void tx_pump_copies(struct tdp__link *l)
{
    for (ticket *t = l->txq; t != NULL; t = t->next_q) {
        if (!t->staged || t->bn != NULL || t->copied)
            continue;
        tdp_err rc;
        bounce *b = bounce_take(l, t->td->nbytes, &rc);
        if (b == NULL && rc == TDP_OK)
            break; /* every bounce in flight: a completion brings this back */
        if (rc == TDP_OK) {
            t->bn = b;
            t->copy = (tdp__stage_copy){
                .done = tx_copied, .progress = t->chunked ? tx_progress : NULL, .arg = t};
            rc = tdp__stage_copy_start(l->stage, &t->copy, b->p, t->td->data, t->td->nbytes,
                                       t->td->nbytes, STAGE_CHUNK, STAGE_INFLIGHT);
        }
        if (rc != TDP_OK) {
            t->copied = true; /* fails when it reaches the head */
            t->copy_rc = rc;
            break;
        }
        t->copying = true;
        l->reqs++;
    }
}

/* The head, chunked and posting, leaves the queue; its hold goes. */
static void tx_chunks_leave(struct tdp__link *l, ticket *t, tdp_err rc)
{
    l->txq = t->next_q;
    if (l->txq == NULL)
        l->txq_tail = NULL;
    t->next_q = NULL;
    if (rc != TDP_OK) {
        if (t->copying) {
            tdp__stage_copy_cancel(l->stage, &t->copy);
            t->copying = false;
            l->reqs--;
        }
        if (t->status == TDP_OK)
            t->status = rc;
        l->stage_failed = true;
    }
    ticket_done(t, UCS_OK); /* the session hears when UCX gave every request back */
    if (rc != TDP_OK && !l->closed)
        l->up->failed(l->owner, l, rc == TDP_ECUDA ? TDP_ECUDA : TDP_ECONNRESET,
                      "cannot stage a GPU payload through host memory");
}

/* A free CHUNK slot of t (its header and request), or TX_CHUNKS. */
static uint32_t chunk_slot(const ticket *t)
{
    for (uint32_t i = 0; i < TX_CHUNKS; i++)
        if (t->req[2 + i] == NULL)
            return i;
    return TX_CHUNKS;
}

/*
 * The chunked head: its SCHEMA and DATA go at once, then a CHUNK for each
 * piece of the bounce the copy has landed, at most TX_CHUNKS in UCX. True
 * when it left the queue (every CHUNK posted, or failed).
 */
static bool tx_chunks(struct tdp__link *l, ticket *t)
{
    size_t n = t->td->nbytes;
    tdp_err rc = l->stage_failed ? TDP_ECONNRESET : TDP_OK;
    if (!t->head_sent) {
        if (rc == TDP_OK && t->copied)
            rc = t->copy_rc;
        if (rc != TDP_OK) { /* nothing posted yet: as any staged send */
            tx_finish_head(l, t, rc);
            return true;
        }
        if ((rc = tx_post(l, t)) != TDP_OK) {
            tx_finish_head(l, t, rc); /* nothing was posted */
            return true;
        }
        l->chunked_tx++;
    }
    uint32_t i;
    while (rc == TDP_OK && t->status == TDP_OK && t->posted < t->landed &&
           (i = chunk_slot(t)) < TX_CHUNKS) {
        size_t len = t->landed - t->posted;
        if (len > STAGE_CHUNK)
            len = STAGE_CHUNK;
        tdp_am_hdr h = {.type = TDP_AM_CHUNK,
                        .token = l->peer_token,
                        .seq = t->data_seq,
                        .hash = tdp_schema_hash(t->td->schema),
                        .length = len,
                        .arg = t->posted};
        tdp_wire_am_encode(t->chunk_hdr[i], &h);
        rc = am_post(l, t, 2 + i, t->chunk_hdr[i], TDP_AM_HDR_LEN, (char *)t->bn->p + t->posted,
                     len, 0, UCS_MEMORY_TYPE_HOST, t->bn->memh);
        if (rc == TDP_OK)
            t->posted += len;
    }
    tdp__loop_kick(l->x->loop);
    if (rc == TDP_OK && t->status != TDP_OK)
        rc = t->status; /* a request UCX gave back failed */
    if (rc == TDP_OK && t->copied && t->copy_rc != TDP_OK)
        rc = t->copy_rc;
    /* the copy's done comes after its last progress: until then the stage
     * holds t->copy, so the ticket must not come free (tx_copied pumps) */
    if (rc == TDP_OK && (t->posted < n || !t->copied))
        return false; /* more when the copy lands more or a CHUNK completes */
    tx_chunks_leave(l, t, rc);
    return true;
}

static void tx_pump(struct tdp__link *l)
{
    tx_pump_copies(l);
    while (l->txq != NULL && !l->closed) {
        ticket *t = l->txq;
        if (t->chunked && t->bn != NULL) {
            if (!tx_chunks(l, t))
                break;
            continue;
        }
        if (t->staged && !t->copied)
            break;
        tx_finish_head(l, t, l->stage_failed ? TDP_ECONNRESET : t->copy_rc);
    }
}

/* Cancel what waits in the queue (closing: no up-call). */
static void tx_queue_drop(struct tdp__link *l)
{
    while (l->txq != NULL) {
        ticket *t = l->txq;
        l->txq = t->next_q;
        t->next_q = NULL;
        if (t->copying) {
            tdp__stage_copy_cancel(l->stage, &t->copy); /* waits for the stream */
            t->copying = false;
            l->reqs--;
        }
        if (t->head_sent) { /* UCX holds some of its frames: they give it back */
            ticket_done(t, UCS_OK);
            continue;
        }
        if (t->bn != NULL)
            t->bn->busy = false;
        ticket_return(l, t);
    }
    l->txq_tail = NULL;
}

/*
 * A staged send's resources: the stream, and the bounces sized for this
 * layout as soon as it is first sent (not at its first message after).
 */
static tdp_err tx_stage_ready(struct tdp__link *l, const ticket *t)
{
    tdp_err rc = stage_ready(l, t->td->device.index);
    for (uint32_t i = 0; rc == TDP_OK && t->send_schema && i < l->ntxb; i++)
        if (!l->txb[i].busy)
            rc = bounce_fit(l, &l->txb[i], t->td->nbytes, false);
    return rc;
}

/* ---- batches (BATCH_BYTES says when) --------------------------------------------- */

/* A batch UCX is done with: each of its sends completes, in order. */
static void batch_done(batch *b, ucs_status_t st)
{
    ticket *t = b->head;
    b->head = b->tail = NULL;
    b->n = 0;
    b->len = 0;
    b->busy = false; /* free for the next batch before anyone hears of these */
    while (t != NULL) {
        ticket *next = t->next_b;
        t->next_b = NULL;
        ticket_done(t, st);
        t = next;
    }
}

static void batch_cb(void *req, ucs_status_t st, void *user)
{
    batch *b = user;
    struct tdp__link *l = b->l;
    ucp_request_free(req);
    b->req = NULL;
    l->reqs--;
    batch_done(b, st); /* a closed link goes later (reaped), not inside this */
    link_maybe_free(l);
}

/*
 * Post the open batch: a BATCH frame, or a lone message as the DATA frame
 * it would have been. Its sends complete when UCX lets go of it.
 */
static void batch_flush(struct tdp__link *l)
{
    batch *b = l->bopen;
    if (b == NULL)
        return;
    l->bopen = NULL;
    size_t off = 0;
    for (ticket *t = b->head; t != NULL; t = t->next_b) {
        hdr_credit(l, b->buf + off);
        off += t->data_hdr_len + t->td->nbytes;
    }
    const uint8_t *hdr = b->hdr, *payload = b->buf;
    size_t hl = TDP_AM_HDR_LEN, plen = b->len;
    if (b->n == 1) {
        hdr = b->buf;
        hl = b->head->data_hdr_len;
        payload = b->buf + hl;
        plen = b->len - hl;
    } else {
        tdp_am_hdr h = {.type = TDP_AM_BATCH,
                        .token = l->peer_token,
                        .seq = b->seq0,
                        .length = b->len,
                        .arg = b->n};
        tdp_wire_am_encode(b->hdr, &h);
        l->batched_tx += b->n;
    }
    if (l->sep == NULL) { /* the endpoint failed: as UCX would say */
        batch_done(b, UCS_ERR_CONNECTION_RESET);
        return;
    }
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = batch_cb,
        .user_data = b,
        .flags = UCP_AM_SEND_FLAG_EAGER,
    };
    void *r = ucp_am_send_nbx(l->sep->ep, TDP_AM_ID, hdr, hl, payload, plen, &prm);
    tdp__loop_kick(l->x->loop);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        if (r != NULL)
            tdp_log_debug("ucp_am_send_nbx (batch): %s", ucs_status_string(UCS_PTR_STATUS(r)));
        batch_done(b, r == NULL ? UCS_OK : UCS_PTR_STATUS(r));
        return;
    }
    b->req = r;
    l->reqs++;
}

/*
 * How large this endpoint's batches are: BATCH_BYTES_TCP where its active
 * messages go over UCX's TCP transport, else BATCH_BYTES. UCX 1.13 names an
 * endpoint's transports only in ucp_ep_print_info's text: an AM lane reads
 * "lane[0]:  1:tcp/lo.0 md[0] -> ... am am_bw#0 ...". Anything else in that
 * text (another transport, another format) keeps the small batch, which
 * fits one eager fragment everywhere. Once per link, at its first batch.
 */
static uint32_t link_batch_bytes(ucp_ep_h ep)
{
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    if (f == NULL)
        return BATCH_BYTES;
    ucp_ep_print_info(ep, f);
    fclose(f);
    bool tcp = false, other = false;
    for (char *line = text; line != NULL && *line != '\0';) {
        char *nl = strchr(line, '\n');
        if (nl != NULL)
            *nl = '\0';
        char *lane = strstr(line, "lane[");
        char *tl = lane != NULL ? strstr(lane, "]:") : NULL;
        if (tl != NULL && strstr(tl, " am ") != NULL) { /* a lane that carries AMs */
            tl += 2;
            tl += strspn(tl, " ");
            tl += strspn(tl, "0123456789");
            if (strncmp(tl, ":tcp/", 5) == 0)
                tcp = true;
            else
                other = true;
        }
        line = nl != NULL ? nl + 1 : NULL;
    }
    free(text);
    return tcp && !other ? BATCH_BYTES_TCP : BATCH_BYTES;
}

/* Whether t may wait in a batch: small host bytes, its schema sent, nobody blocked on it. */
static bool batchable(const struct tdp__link *l, const ticket *t, const tdp__tx *tx)
{
    return l->peer_batch && l->turn_sent && !tx->urgent && !t->send_schema && !t->staged &&
           t->td->device.type == TDP_DEVICE_CPU &&
           t->data_hdr_len + t->td->nbytes <= BATCH_ITEM_MAX;
}

/* Copy t into the open batch (a new one if need be); false: no batch free, send it alone. */
static bool batch_add(struct tdp__link *l, ticket *t)
{
    size_t need = t->data_hdr_len + t->td->nbytes;
    if (l->bopen != NULL &&
        (l->bopen->len + need > l->batch_bytes || l->bopen->n == TDP_AM_BATCH_MAX))
        batch_flush(l);
    if (l->bopen == NULL) {
        if (l->batch_mem == NULL) { /* once per link, at its first batch */
            if (l->sep == NULL)
                return false; /* the endpoint failed: the send alone meets it */
            l->batch_bytes = link_batch_bytes(l->sep->ep);
            tdp_log_debug("ucx plane: batches of up to %" PRIu32 " bytes on this link",
                          l->batch_bytes);
            l->batch_mem = tdp__malloc((size_t)BATCH_BUFS * l->batch_bytes);
            if (l->batch_mem == NULL)
                return false;
            for (uint32_t i = 0; i < BATCH_BUFS; i++) {
                l->bt[i].l = l;
                l->bt[i].buf = l->batch_mem + (size_t)i * l->batch_bytes;
            }
        }
        for (uint32_t i = 0; i < BATCH_BUFS && l->bopen == NULL; i++)
            if (!l->bt[i].busy)
                l->bopen = &l->bt[i];
        if (l->bopen == NULL)
            return false;
        l->bopen->busy = true;
        l->bopen->seq0 = t->data_seq;
    }
    batch *b = l->bopen;
    memcpy(b->buf + b->len, t->data_hdr, t->data_hdr_len);
    if (t->td->nbytes > 0)
        memcpy(b->buf + b->len + t->data_hdr_len, t->td->data, t->td->nbytes);
    b->len += need;
    b->n++;
    t->inflight = 1;
    t->next_b = NULL;
    if (b->tail != NULL)
        b->tail->next_b = t;
    else
        b->head = t;
    b->tail = t;
    return true;
}

/* A send went out this turn: the flush source ends the turn. */
static void turn_mark(struct tdp__link *l)
{
    l->turn_sent = true;
    if (!l->dirty) {
        l->dirty = true;
        l->next_dirty = l->x->dirty;
        l->x->dirty = l;
    }
}

static void turn_unmark(struct tdp__link *l)
{
    if (!l->dirty)
        return;
    for (struct tdp__link **pp = &l->x->dirty; *pp != NULL; pp = &(*pp)->next_dirty) {
        if (*pp == l) {
            *pp = l->next_dirty;
            break;
        }
    }
    l->dirty = false;
    l->next_dirty = NULL;
    l->turn_sent = false;
}

/* The cancel of the open batch (closing: no up-call). */
static void batch_drop(struct tdp__link *l)
{
    batch *b = l->bopen;
    if (b == NULL)
        return;
    l->bopen = NULL;
    ticket *t = b->head;
    b->head = b->tail = NULL;
    b->n = 0;
    b->len = 0;
    b->busy = false;
    while (t != NULL) {
        ticket *next = t->next_b;
        t->next_b = NULL;
        t->inflight = 0;
        ticket_return(l, t);
        t = next;
    }
}

/* The loop ends a turn: post every open batch; the next turn starts afresh. */
static unsigned flush_progress(void *arg)
{
    ucx_ext *x = arg;
    unsigned n = 0;
    if (x->closing_eps != NULL && x->ucx->progressing == 0)
        close_deferred_now(x, false); /* flushed, or past their deadline */
    while (x->dirty != NULL) {
        struct tdp__link *l = x->dirty;
        x->dirty = l->next_dirty;
        l->next_dirty = NULL;
        l->dirty = false;
        l->turn_sent = false;
        if (l->bopen != NULL && !l->closed) {
            batch_flush(l);
            n++;
        }
    }
    return n;
}

static const tdp__source_ops flush_ops = {.progress = flush_progress, .arm = NULL};

static tdp_err u_send(tdp__link *l, const tdp__tx *tx)
{
    ticket *t = l->free_tickets;
    if (t == NULL || l->sep == NULL)
        return TDP_EINTERNAL; /* the session bounds sends by its own tickets */
    if (l->stage_failed)
        return TDP_ECONNRESET;
    if (l->sum_on && tx->td->device.type != TDP_DEVICE_CPU) {
        /* no host copy of device memory on this plane, and host code never reads it */
        tdp_log_warn("the payload checksum covers host memory only: cannot send device memory");
        return TDP_ENOTSUP;
    }
    l->free_tickets = t->next_free;
    tdp_td *td = tx->td;
    t->cookie = tx->cookie;
    t->td = tdp_td_ref(td);
    t->status = TDP_OK;
    t->send_schema = tx->schema != NULL;
    t->staged = stages(l, td->device);
    t->copying = t->copied = false;
    t->copy_rc = TDP_OK;
    /* the CHUNK frames carry the DATA's seq (tx->seq lives only in this call) */
    t->data_seq = tx->seq;
    t->chunked = t->staged && l->peer_chunks && td->nbytes > CHUNK_MIN;
    t->head_sent = false;
    t->landed = t->posted = 0;
    if (t->chunked) {
        uint32_t c = STAGE_CHUNK;
        uint8_t d[CHUNK_DESC] = {(uint8_t)c, (uint8_t)(c >> 8), (uint8_t)(c >> 16),
                                 (uint8_t)(c >> 24)};
        memcpy(t->chunk_desc, d, sizeof(d));
    }
    t->bn = NULL;
    t->next_q = NULL;
    if (tx->schema != NULL) {
        size_t jl;
        (void)tdp_schema_json(tx->schema, &jl);
        tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                        .token = l->peer_token,
                        .seq = tx->seq,
                        .hash = tdp_schema_hash(tx->schema),
                        .length = jl,
                        .arg = tdp_schema_total_bytes(tx->schema)};
        tdp_wire_am_encode(t->schema_hdr, &h);
    }
    tdp_am_hdr h = {.type = TDP_AM_DATA,
                    .token = l->peer_token,
                    .seq = tx->seq,
                    .hash = tdp_schema_hash(td->schema),
                    .length = td->nbytes,
                    .arg = tx->credit};
    if (t->chunked)
        h.flags |= TDP_AM_F_CHUNKED;
    if (l->sum_on) { /* host memory only (refused above otherwise) */
        h.flags |= TDP_AM_F_SUM;
        h.sum = tdp__sum_tx(td->data, td->nbytes, tx->seq);
    }
    t->data_hdr_len = tdp_wire_am_encode(t->data_hdr, &h);
    if (!t->staged && l->txq == NULL) {
        if (batchable(l, t, tx) && batch_add(l, t))
            return TDP_OK; /* turn_sent already */
        /* what waits in a batch goes first */
        batch_flush(l);
        tdp_err rc = tx_post(l, t);
        if (rc != TDP_OK)
            ticket_return(l, t);
        else
            turn_mark(l);
        return rc;
    }
    batch_flush(l);
    /* a GPU payload through a bounce, or a send behind one: in order */
    tdp_err rc = t->staged ? tx_stage_ready(l, t) : TDP_OK;
    if (rc != TDP_OK) {
        ticket_return(l, t);
        return rc;
    }
    if (l->txq_tail != NULL)
        l->txq_tail->next_q = t;
    else
        l->txq = t;
    l->txq_tail = t;
    /* start the copy now; posting waits for its completion on the loop */
    tx_pump_copies(l);
    if (t == l->txq && t->copied && t->copy_rc != TDP_OK) {
        /* nothing ahead of it to wake the queue: refuse it here */
        rc = t->copy_rc;
        if (t->bn != NULL)
            t->bn->busy = false;
        l->txq = l->txq_tail = NULL;
        ticket_return(l, t);
        return rc;
    }
    return TDP_OK;
}

static void credit_cb(void *req, ucs_status_t st, void *user);

static void credit_post(struct tdp__link *l)
{
    if (l->credit_req != NULL || l->sep == NULL || l->closed || l->credit_want <= l->credit_hi)
        return; /* one in flight, or a DATA already said as much */
    l->credit_hi = l->credit_want;
    /* cumulative count: one frame in flight at a time says everything */
    tdp_am_hdr h = {.type = TDP_AM_CREDIT, .token = l->peer_token, .arg = l->credit_want};
    tdp_wire_am_encode(l->credit_hdr, &h);
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = credit_cb,
        .user_data = l,
        .flags = UCP_AM_SEND_FLAG_EAGER,
    };
    void *r = ucp_am_send_nbx(l->sep->ep, TDP_AM_ID, l->credit_hdr, TDP_AM_HDR_LEN, NULL, 0,
                              &prm);
    tdp__loop_kick(l->x->loop);
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        if (UCS_PTR_IS_ERR(r) && !l->closed)
            l->up->failed(l->owner, l, TDP_ECONNRESET, "cannot send credit");
        return;
    }
    l->credit_req = r;
    l->reqs++;
}

static void credit_cb(void *req, ucs_status_t st, void *user)
{
    struct tdp__link *l = user;
    ucp_request_free(req);
    l->credit_req = NULL;
    l->reqs--;
    credit_post(l); /* released more while this one flew, unless a DATA said so */
    link_maybe_free(l);
}

static tdp_err u_credit(tdp__link *l, uint64_t total)
{
    l->credit_want = total;
    credit_post(l);
    return TDP_OK;
}

/* ---- links ----------------------------------------------------------------------- */

static tdp_err u_link_new(tdp_loop *loop, void *owner, const tdp__plane_up *up, tdp__link **out)
{
    ucx_ext *x;
    tdp_err rc = ext_get(loop, &x);
    if (rc != TDP_OK)
        return rc;
    struct tdp__link *l = tdp__calloc(1, sizeof(*l));
    if (l == NULL)
        return TDP_ENOMEM;
    l->x = x;
    l->owner = owner;
    l->up = up;
    l->wi = TDP_WORKER_ANY;
    l->cuda_device = -1;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        l->rx[i].l = l;
    if ((rc = tab_add(x, l)) != TDP_OK) {
        tdp__free(l);
        return rc;
    }
    l->next = x->links;
    if (x->links != NULL)
        x->links->prev = l;
    x->links = l;
    tdp__loop_kick(loop); /* the workers may be unwatched: arm them before the next sleep */
    *out = l;
    return TDP_OK;
}

static bool have_local(const ucx_ext *x)
{
    return x->ucx->nworkers > TDP_WORKER_LOCAL && x->ucx->worker[TDP_WORKER_LOCAL] != NULL;
}

/*
 * The link's own same-host worker, made on first need (its address goes in
 * this side's HELLO). A worker per link, because one shared by every peer
 * on this host is stopped for all of them by one killed mid-send
 * (ucx_workers.h).
 */
static tdp_err link_own(struct tdp__link *l)
{
    ucx_ext *x = l->x;
    if (l->own != NULL)
        return TDP_OK;
    if (l->no_own || !have_local(x))
        return TDP_ENOTSUP;
    tdp_err rc = tdp__ucx_private_new(x->ucx, &l->own);
    if (rc != TDP_OK) {
        l->no_own = true;
        return rc;
    }
    ucp_worker_h w = tdp__ucx_private_worker(l->own);
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = TDP_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = am_cb,
        .arg = &x->args[TDP_WORKER_LOCAL],
    };
    ucs_status_t st = ucp_worker_set_am_recv_handler(w, &hp);
    if (st == UCS_OK)
        st = ucp_worker_get_address(w, &l->own_addr, &l->own_addr_len);
    if (st != UCS_OK) {
        tdp_log_error("link worker: %s", ucs_status_string(st));
        l->own_addr = NULL;
        tdp__ucx_private_free(l->own);
        l->own = NULL;
        l->no_own = true;
        return TDP_EUCX;
    }
    return TDP_OK;
}

/*
 * The link's own worker goes, after the forced close of its endpoint
 * finished (destroying a worker with a close in progress can crash UCX
 * 1.13). Not from inside a progress of it; a close that does not finish
 * in a second leaves the worker to the loop's end.
 */
static void link_drop_own(struct tdp__link *l)
{
    if (l->own == NULL)
        return;
    ucp_worker_h w = tdp__ucx_private_worker(l->own);
    if (l->close_req != NULL) {
        int64_t end = tdp__now_ms() + 1000;
        while (l->x->ucx->progressing == 0 &&
               ucp_request_check_status(l->close_req) == UCS_INPROGRESS && tdp__now_ms() <= end) {
            l->x->ucx->progressing++;
            ucp_worker_progress(w);
            l->x->ucx->progressing--;
        }
        if (ucp_request_check_status(l->close_req) == UCS_INPROGRESS) {
            struct stray *st = tdp__calloc(1, sizeof(*st));
            tdp_log_warn("a link's endpoint close did not finish; its worker stays");
            if (st != NULL) { /* the loop's end frees it (ext_pre_fini) */
                *st = (struct stray){l->own, l->own_addr, l->close_req, l->x->strays};
                l->x->strays = st;
            }
            l->own = NULL;
            l->own_addr = NULL;
            l->close_req = NULL;
            return;
        }
        ucp_request_free(l->close_req);
        l->close_req = NULL;
    }
    if (l->own_addr != NULL)
        ucp_worker_release_address(w, l->own_addr);
    l->own_addr = NULL;
    tdp__ucx_private_free(l->own);
    l->own = NULL;
}

/* Tests: HELLOs without TDP_HX_UCX_CHUNKS, as an older peer sends them. */
static atomic_bool hello_no_chunks;

void tdp__ucx_hello_no_chunks(bool on)
{
    atomic_store(&hello_no_chunks, on);
}

/* Tests: HELLOs without TDP_HX_UCX_BATCH, as an older peer sends them. */
static atomic_bool hello_no_batch;

void tdp__ucx_hello_no_batch(bool on)
{
    atomic_store(&hello_no_batch, on);
}

static tdp_err u_hello_fill(tdp__link *l, tdp_hello *h)
{
    const void *addr, *laddr = NULL;
    size_t alen, llen = 0;
    tdp_err rc = worker_address(l->x, TDP_WORKER_ANY, &addr, &alen);
    if (rc != TDP_OK)
        return rc;
    /*
     * A worker of the pipe's own is made only for a peer that needs it: with
     * PROVEN offered (every pipe whose control socket is local), once both
     * HELLOs are in and pick this plane for a same-host peer, and with a
     * shared secret only after the proofs too (nothing is made for a peer
     * before its proof). Its address then goes in this side's PROVEN frame
     * (u_proven_fill); with a peer that speaks no PROVEN, both sides use
     * the general worker.
     */
    if (h->auth != 0 || h->proven == TDP_PROVEN_V1) {
        l->own_late = !l->no_own && have_local(l->x) && h->peer_mode == TDP_PEER_AUTO;
        l->no_own = true;
    }
    if (have_local(l->x) && !l->no_own) {
        if (link_own(l) == TDP_OK) {
            laddr = l->own_addr;
            llen = l->own_addr_len;
        } else {
            /* out of descriptors or memory: no same-host address, so both
             * sides pick the general worker, which costs this side nothing */
            tdp_log_info("no same-host worker for this pipe: it uses the general one");
        }
    }
    h->token = l->token;
    if (addr != NULL && alen > 0) /* no worker: no record */
        rc = tdp_hello_add_rec(h, TDP_HX_UCX_ADDR, addr, (uint32_t)alen);
    if (rc == TDP_OK && laddr != NULL && llen > 0)
        rc = tdp_hello_add_rec(h, TDP_HX_UCX_LOCAL_ADDR, laddr, (uint32_t)llen);
    if (rc == TDP_OK && addr != NULL && alen > 0 && !atomic_load(&hello_no_chunks)) {
        /* this side reads chunked DATA: a peer that knows it may send it */
        static const uint8_t chunks_v = TDP_UCX_CHUNKS_V1;
        rc = tdp_hello_add_rec(h, TDP_HX_UCX_CHUNKS, &chunks_v, 1);
    }
    if (rc == TDP_OK && addr != NULL && alen > 0 && !atomic_load(&hello_no_batch)) {
        /* this side reads BATCH frames */
        static const uint8_t batch_v = TDP_UCX_BATCH_V1;
        rc = tdp_hello_add_rec(h, TDP_HX_UCX_BATCH, &batch_v, 1);
    }
    return rc == TDP_OK ? TDP_OK : TDP_EINTERNAL;
}

/*
 * With a secret, after both proofs: the link's own same-host worker, when
 * link_start will pick it (a peer on this host, neither side forcing a
 * peer mode), and its address for PROVEN. link_start's rule then applies
 * as without a secret: the own worker iff both sides sent an address.
 */
static tdp_err u_proven_fill(tdp__link *l, const tdp_hello *peer, bool same_host, tdp_hello *out)
{
    if (!l->own_late)
        return TDP_OK;
    l->own_late = false;
    if (!same_host || peer->peer_mode != TDP_PEER_AUTO)
        return TDP_OK;
    l->no_own = false;
    if (link_own(l) != TDP_OK) { /* sets no_own: the general worker, for both */
        tdp_log_info("no same-host worker for this pipe: it uses the general one");
        return TDP_OK;
    }
    tdp_err rc =
        tdp_hello_add_rec(out, TDP_HX_UCX_LOCAL_ADDR, l->own_addr, (uint32_t)l->own_addr_len);
    return rc == TDP_OK ? TDP_OK : TDP_EINTERNAL;
}

/*
 * The endpoint to the peer's worker, made from the canonical form of the
 * address in its HELLO: UCX never sees a byte of the peer's own.
 */
static tdp_err link_ep(struct tdp__link *l, const tdp__link_peer *peer)
{
    const tdp_hello *h = peer->hello;
    bool loc = l->wi == TDP_WORKER_LOCAL;
    const tdp_hx_rec *r = tdp_hello_rec(h, loc ? TDP_HX_UCX_LOCAL_ADDR : TDP_HX_UCX_ADDR);
    const void *raw = r != NULL ? r->val : NULL;
    size_t rlen = r != NULL ? r->len : 0;
    const tdp__ucxa_profile *prof = l->x->profile[l->wi];
    const char *why = "no address";
    size_t clen = 0;
    tdp_err rc = TDP_EPROTO;
    if (prof == NULL)
        return TDP_EINTERNAL; /* ext_get made one for every worker a link can pick */
    uint8_t *canon = tdp__malloc(rlen + TDP_UCXA_PAD);
    if (canon == NULL)
        return TDP_ENOMEM;
    if (raw != NULL && rlen > 0)
        rc = tdp__ucxa_canonical(prof, raw, rlen, peer->local, canon, rlen + TDP_UCXA_PAD,
                                 &clen, &why);
    if (rc == TDP_OK)
        rc = ep_acquire(l, canon, clen);
    else
        tdp_log_info("the peer's %s in its HELLO is refused: %s",
                     loc ? "UCX_LOCAL_ADDR" : "UCX_ADDR", why);
    tdp__free(canon);
    return rc;
}

static tdp_err u_link_start(tdp__link *l, const tdp__link_peer *peer)
{
    const tdp_hello *h = peer->hello;
    if (tdp_hello_rec(h, TDP_HX_UCX_ADDR) == NULL)
        return TDP_EPROTO;
    l->peer_token = h->token;
    l->sum_on = peer->checksum;
    l->peer_ready = h->ready == TDP_READY_V1;
    /* chunked DATA only to a peer that reads it; another version: whole messages */
    const tdp_hx_rec *ck = tdp_hello_rec(h, TDP_HX_UCX_CHUNKS);
    if (ck != NULL && ck->len != 1)
        return TDP_EPROTO;
    l->peer_chunks = ck != NULL && ck->val[0] == TDP_UCX_CHUNKS_V1;
    /* BATCH frames likewise: another version gets every message alone */
    const tdp_hx_rec *bt = tdp_hello_rec(h, TDP_HX_UCX_BATCH);
    if (bt != NULL && bt->len != 1)
        return TDP_EPROTO;
    l->peer_batch = bt != NULL && bt->val[0] == TDP_UCX_BATCH_V1;
    /*
     * Which worker, and whether UCX watches for peer failure. Both sides
     * compute the same answer from both HELLOs: a peer on this host, when
     * both offer a same-host address, gets the link's own shared-memory
     * worker; any other peer gets the general worker; both with UCX's
     * peer-failure mode. TDP_PEER_UCX / TDP_PEER_SOCKET force the general
     * worker with / without it.
     */
    /*
     * This side's HELLO gives a same-host address iff the link has its own
     * worker. The peer's HELLO may be read before this side's is sent:
     * the worker is made now, and one this side goes without stays so.
     */
    if (have_local(l->x) && !l->no_own)
        (void)link_own(l); /* a failure sets no_own */
    bool local = peer->same_host && tdp_hello_rec(h, TDP_HX_UCX_LOCAL_ADDR) != NULL && l->own != NULL;
    int seen = l->wi;
    l->wi = TDP_WORKER_ANY;
    if (h->peer_mode == TDP_PEER_UCX || peer->mode == TDP_PEER_UCX) {
        l->peer_mode = true;
    } else if (h->peer_mode == TDP_PEER_SOCKET || peer->mode == TDP_PEER_SOCKET) {
        l->peer_mode = false;
    } else if (local) {
        /* the link's own worker, in peer-failure mode: a killed peer's
         * endpoint can be closed at once, with what UCX held for it */
        l->peer_mode = true;
        l->wi = TDP_WORKER_LOCAL;
    } else {
        l->peer_mode = true;
    }
    if (l->wi_seen && seen != l->wi) {
        tdp_log_warn("the peer chose another UCX worker than this side would");
        return TDP_EPROTO;
    }
    l->nticket = 2 * tdp__window(peer->peer_depth, peer->peer_window, 1) + 1;
    l->tickets = tdp__alloc_array(l->nticket, sizeof(*l->tickets));
    if (l->tickets == NULL)
        return TDP_ENOMEM;
    memset(l->tickets, 0, l->nticket * sizeof(*l->tickets));
    for (uint32_t i = 0; i < l->nticket; i++) {
        l->tickets[i].l = l;
        l->tickets[i].next_free = i + 1 < l->nticket ? &l->tickets[i + 1] : NULL;
    }
    l->free_tickets = l->tickets;
    /* a receive schema that came before the HELLO was prepared on the default worker */
    if (l->rx_schema != NULL && seen != l->wi) {
        for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
            if (!l->rx[i].lent && l->rx[i].req == NULL)
                rx_buf_drop(l, &l->rx[i]);
    }
    if (l->wi != TDP_WORKER_LOCAL && l->own != NULL) {
        link_drop_own(l); /* unused: not a peer on this host (no progress is on the stack) */
        l->no_own = true; /* a HELLO still to send says so */
    }
    tdp_err rc = link_ep(l, peer);
    if (rc != TDP_OK)
        return rc;
    /* two send bounces at most: the copy of one overlaps the transfer of the other */
    l->ntxb = peer->peer_depth < 2 ? 1 : 2;
    l->cuda_device = peer->cuda_device;
    if (l->cuda_device >= 0 && l->cuda_device < tdp__cuda_device_count() && !ucx_takes_cuda(l->x)) {
        /* the context and the stream now, not in the first GPU send */
        if ((rc = tdp__cuda_ctx_set(l->cuda_device)) != TDP_OK ||
            (rc = stage_ready(l, l->cuda_device)) != TDP_OK)
            return rc;
    }
    l->started = true;
    return TDP_OK;
}

static bool u_link_busy(const tdp__link *l)
{
    return l->reqs > 0;
}

static void link_destroy(struct tdp__link *l)
{
    ucx_ext *x = l->x;
    tab_remove(l);
    turn_unmark(l);
    if (l->prev != NULL)
        l->prev->next = l->next;
    else
        x->links = l->next;
    if (l->next != NULL)
        l->next->prev = l->prev;
    if (l->sep != NULL)
        ep_unref(l->sep);
    l->sep = NULL;
    link_drop_own(l);
    tdp__stage_free(l->stage); /* cancels its copies: the bounces are free to go */
    l->stage = NULL;
    tdp__stage_free(l->rx_stage);
    l->rx_stage = NULL;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        rx_buf_drop(l, &l->rx[i]);
        tdp__free(l->rx[i].ch);
    }
    for (uint32_t i = 0; i < sizeof(l->txb) / sizeof(l->txb[0]); i++)
        bounce_free(l, &l->txb[i]);
    for (uint32_t i = 0; i < l->nticket; i++)
        tdp_td_unref(l->tickets[i].td); /* only sends UCX never gave back */
    tdp__free(l->tickets);
    tdp__free(l->batch_mem);
    tdp_schema_unref(l->rx_schema);
    tdp__free(l);
}

static void link_reap(void *arg)
{
    struct tdp__link *l = arg;
    if (l->reqs > 0) {
        /* UCX holds something posted since the reap was queued: its
         * callback frees the link (link_maybe_free), never before it */
        tdp_log_debug("ucx link: %u requests still in UCX at its reap: it waits for them", l->reqs);
        return;
    }
    link_destroy(l);
}

/* A closed link goes once UCX has let go of everything it holds. */
static void link_maybe_free(struct tdp__link *l)
{
    if (!l->closed || l->reqs > 0 || l->reap.queued)
        return;
    tdp__reap_later(l->x->loop, &l->reap, link_reap, l);
}

static void u_link_close(tdp__link *l, bool peer_gone)
{
    if (l->closed)
        return;
    l->closed = true;
    if (l->batched_tx + l->batched_rx > 0)
        tdp_log_debug("ucx link: %llu messages sent and %llu received inside batches",
                      (unsigned long long)l->batched_tx, (unsigned long long)l->batched_rx);
    if (peer_gone && l->sep != NULL)
        l->sep->peer_gone = true;
    tab_remove(l); /* no frame finds it any more */
    /* staged copies stop here (the stream is waited for): nothing is told */
    tx_queue_drop(l);
    batch_drop(l);
    turn_unmark(l);
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        if (l->rx[i].copying) {
            tdp__stage_copy_cancel(l->rx_stage, &l->rx[i].copy);
            l->rx[i].copying = false;
            l->reqs--;
        }
    }
    /* the last link on an endpoint closes it: in peer-failure mode that
     * completes (with an error) what UCX still holds for this link */
    if (l->sep != NULL) {
        shared_ep *e = l->sep;
        l->sep = NULL;
        ep_unref(e);
    }
    link_maybe_free(l);
}

static tdp_err u_loan(tdp__link *l, tdp_schema *sc, tdp_td **out)
{
    return tdp_td_new(sc, out);
}

/*
 * Credit the peer sent may wait in the worker while nobody drove the loop
 * (a sender pausing between sends): progress this link's worker once, unless
 * a progress is already on the stack (UCX does not nest).
 */
static void u_poll_credit(tdp__link *l)
{
    tdp__ucx *u = l->x->ucx;
    ucp_worker_h w = link_worker(l);
    if (l->closed || u->progressing > 0 || w == NULL)
        return;
    u->progressing++;
    (void)ucp_worker_progress(w);
    u->progressing--;
}

/*
 * Device memory goes to UCX as it is only where this UCX was built with
 * CUDA (Debian's is not); elsewhere it is staged through host bounces.
 */
static uint32_t u_link_mem(const tdp__link *l)
{
    return TDP__MEM_HOST | (ucx_takes_cuda(l->x) ? TDP__MEM_CUDA : TDP__MEM_CUDA_STAGED);
}

/* ---- prepare ---------------------------------------------------------------------- */

/* A prepared SCHEMA in flight: its header and JSON live until UCX lets go. */
typedef struct prep_send {
    struct tdp__link *l;
    tdp_schema *sc;
    uint8_t hdr[TDP_AM_HDR_LEN];
} prep_send;

static void prep_send_free(prep_send *ps)
{
    tdp_schema_unref(ps->sc);
    tdp__free(ps);
}

static void prep_cb(void *req, ucs_status_t st, void *user)
{
    prep_send *ps = user;
    struct tdp__link *l = ps->l;
    (void)st; /* a failed send fails the link through UCX's error handler */
    ucp_request_free(req);
    l->reqs--;
    prep_send_free(ps);
    link_maybe_free(l);
}

/*
 * The send side has nothing to make for host memory (UCX registers the
 * application's buffer as it goes); a GPU layout staged through host
 * memory gets its bounces now. The SCHEMA goes flagged TDP_AM_F_PREPARE:
 * the receiver builds its storage (faulted in: rx_store_build) and answers
 * READY. A peer that does not answer READY is sent nothing now.
 */
static tdp_err u_prepare(tdp__link *l, tdp_schema *sc, uint64_t seq, bool send_schema, bool *sent,
                         bool *await)
{
    *sent = *await = false;
    if (l->sep == NULL)
        return TDP_EAGAIN;
    if (l->stage_failed)
        return TDP_ECONNRESET;
    tdp_device dev = tdp_schema_device(sc);
    if (stages(l, dev)) {
        tdp_err rc = stage_ready(l, dev.index);
        for (uint32_t i = 0; rc == TDP_OK && i < l->ntxb; i++)
            if (!l->txb[i].busy)
                rc = bounce_fit(l, &l->txb[i], tdp_schema_total_bytes(sc), true);
        if (rc != TDP_OK)
            return rc;
    }
    if (!send_schema || !l->peer_ready)
        return TDP_OK;
    batch_flush(l); /* the SCHEMA after every message before it */
    prep_send *ps = tdp__calloc(1, sizeof(*ps));
    if (ps == NULL)
        return TDP_ENOMEM;
    ps->l = l;
    ps->sc = tdp_schema_ref(sc);
    size_t jl;
    const char *json = tdp_schema_json(sc, &jl);
    tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                    .flags = TDP_AM_F_PREPARE,
                    .token = l->peer_token,
                    .seq = seq,
                    .hash = tdp_schema_hash(sc),
                    .length = jl,
                    .arg = tdp_schema_total_bytes(sc)};
    tdp_wire_am_encode(ps->hdr, &h);
    ucp_request_param_t prm = {
        .op_attr_mask =
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = prep_cb,
        .user_data = ps,
        .flags = UCP_AM_SEND_FLAG_EAGER, /* whole in the receiver's callback, as any SCHEMA */
    };
    void *r = ucp_am_send_nbx(l->sep->ep, TDP_AM_ID, ps->hdr, TDP_AM_HDR_LEN, json, jl, &prm);
    tdp__loop_kick(l->x->loop);
    if (UCS_PTR_IS_ERR(r)) {
        tdp_log_debug("ucp_am_send_nbx (prepared schema): %s",
                      ucs_status_string(UCS_PTR_STATUS(r)));
        prep_send_free(ps);
        return TDP_ECONNRESET;
    }
    if (r == NULL)
        prep_send_free(ps);
    else
        l->reqs++;
    *sent = *await = true;
    return TDP_OK;
}

static uint64_t u_rx_progress(const tdp__link *l)
{
    return l->rx_progress;
}

const tdp__plane_ops tdp__plane_ucx = {
    .name = "ucx",
    .id = TDP_PLANE_UCX,
    .mem = TDP__MEM_HOST | TDP__MEM_CUDA | TDP__MEM_CUDA_STAGED,
    .link_mem = u_link_mem,
    .hello_fill = u_hello_fill,
    .proven_fill = u_proven_fill,
    .usable = NULL,
    .link_new = u_link_new,
    .link_start = u_link_start,
    .link_close = u_link_close,
    .link_busy = u_link_busy,
    .send = u_send,
    .credit = u_credit,
    .rx_schema = u_rx_schema,
    .prepare = u_prepare,
    .recv = u_recv,
    .release = u_release,
    .loan = u_loan,
    .poll_credit = u_poll_credit,
    .rx_progress = u_rx_progress,
};

ucp_ep_h tdp__ucx_link_ep(const tdp__link *l)
{
    return l != NULL && l->sep != NULL ? l->sep->ep : NULL;
}

int tdp__ucx_link_worker(const tdp__link *l)
{
    return l != NULL ? l->wi : -1;
}

bool tdp__ucx_link_peer_mode(const tdp__link *l)
{
    return l != NULL && l->peer_mode;
}

uint64_t tdp__ucx_link_peer_token(const tdp__link *l)
{
    return l != NULL ? l->peer_token : 0;
}

uint64_t tdp__ucx_link_chunked(const tdp__link *l, bool rx)
{
    return l == NULL ? 0 : rx ? l->chunked_rx : l->chunked_tx;
}

uint64_t tdp__ucx_link_batched(const tdp__link *l, bool rx)
{
    return l == NULL ? 0 : rx ? l->batched_rx : l->batched_tx;
}

uint32_t tdp__ucx_link_batch_bytes(const tdp__link *l)
{
    if (l == NULL)
        return 0;
    if (l->batch_mem != NULL)
        return l->batch_bytes;
    return l->sep != NULL ? link_batch_bytes(l->sep->ep) : 0; /* what its first batch would get */
}
