/*
 * plane_tcp.c: the tcp plane — frames and payloads on the pipe's own TCP
 * connection, the one that carried the HELLOs (ctl.h, tdp__ctl_carry).
 *
 * Any two peers can use it. A sender's payload in host memory goes from
 * the application's buffer straight to the kernel (gathered with its
 * header, many frames a system call); a receiver's lands in the slot the
 * session names, read in place. So a message costs what raw TCP costs:
 * one copy on each side, the kernel's. There is no second
 * connection, no second port and nothing to register; a dead peer is the
 * socket's end, as for the control channel. It is chosen by default for a
 * peer on another host when neither side has an RDMA device (t_usable_link;
 * the registry lists it before ucx), else only when a side asks for it
 * (tdp_pipe_opts.plane, --plane tcp). docs/planes.md.
 *
 * GPU payloads are staged through page-locked host memory (stage.h), in
 * chunks that overlap the socket: a sender's DATA is queued held and goes,
 * header and payload, chunk by chunk as the device->host copy lands it in
 * one of two send bounces (tdp__ctl_plane_send_held); a receiver's payload
 * is read into the slot's bounce and copied to the device chunk by chunk
 * as the reads land it, the message handed over when the last chunk is on
 * the device. The wire is the same either way.
 *
 * Frames: SCHEMA (the JSON, at most the receiver's max_json_bytes), DATA
 * (the credit rides in arg; TDP_AM_F_SUM when the checksum is in force),
 * CREDIT. The header's token is 0: the socket names the pipe.
 */
#include <dirent.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "plane_tcp.h"
#include "../checksum.h"
#include "../ctl.h"
#include "../plane.h"
#include "../rx_store.h"
#include "../stage.h"
#include "../../core/alloc.h"
#include "../../core/log.h"
#include "../../core/loop_int.h"
#include "../../core/reap.h"

/* Sends in flight: the session's tickets (2 x window + 1), each a SCHEMA and a DATA. */
#define NREC (2u * (2u * TDP_MAX_DEPTH + 1u) + 8u)

/*
 * Staging: copies in chunks of STAGE_CHUNK bytes, at most STAGE_INFLIGHT
 * of one copy queued at once (the ucx plane's figures: the copy engine's
 * rate is reached well below the chunk, and the socket starts on the
 * first chunk while the next are copied).
 */
#define STAGE_CHUNK    (4u << 20)
#define STAGE_INFLIGHT 4u
#define TX_BOUNCES     2u /* the copy of one send overlaps the writing of the other */

/* Page-locked host memory a GPU payload passes through; grown, never per message. */
typedef struct bounce {
    void *p;
    size_t cap;
    tdp__cuda_pin *pin; /* page-locked, or being (tdp__stage_host_alloc) */
    bool busy;
} bounce;

struct tdp__link;

typedef struct tx_rec {
    struct tx_rec *next_free;
    tdp_td *td;     /* DATA: held until the kernel has the bytes */
    tdp_schema *sc; /* SCHEMA: its JSON is the payload */
    void *cookie;   /* the session's, for DATA */
    bool tell;      /* up->sent when it has left */
    void *own;      /* tdp__tcp_rogue's copy of its payload */
    /* a staged DATA: queued held (id), then a bounce, then its copy */
    struct tdp__link *l;
    tdp__stage_copy copy;
    uint64_t id;
    bounce *bn;
    bool staged, copying;
    struct tx_rec *next_wait; /* in l->waitq until it has a bounce */
} tx_rec;

typedef struct rx_slot {
    struct tdp__link *l;
    tdp_td *td;
    tdp__rx_store *store;
    bool lent, filling;
    /* GPU layouts: the bytes land here, then go to the device */
    bounce b;
    tdp__stage_copy copy;
    bool copying;
    size_t given; /* bytes of the bounce handed to the copy */
} rx_slot;

/* What up->data's desc points at: the frame, and the slot recv chose. */
typedef struct rx_desc {
    const tdp_am_hdr *h;
    uint32_t slot; /* UINT32_MAX: no receive */
} rx_desc;

struct tdp__link {
    tdp_loop *loop;
    void *owner;
    const tdp__plane_up *up;
    tdp__ctl *ctl; /* NULL until started, and once closed */
    bool started, closed;
    bool sum_on, peer_ready, populate;
    uint64_t max_json;
    tx_rec *recs, *free_recs;
    uint32_t outstanding; /* frames queued with a record, not yet accounted for */
    /* the frame whose payload is being read */
    uint8_t pend_type;
    tdp__frame pend_f;
    uint32_t pend_slot;
    uint8_t *json;
    size_t json_cap;
    tdp_schema *rx_schema;
    rx_slot rx[TDP_MAX_DEPTH];
    tdp__reap reap;
    /* staging (GPU payloads) */
    struct tdp__ctl_carry *carry; /* the frames' carrier: held payloads are given to it */
    tdp__stage *tx_stage, *rx_stage;
    bounce txb[TX_BOUNCES];
    uint32_t ntxb;
    tx_rec *waitq, *waitq_tail; /* staged sends waiting for a bounce, in order */
    uint32_t copies;            /* stage copies in flight */
    uint8_t rec;                /* this side's TDP_HX_TCP flags, as sent */
    bool asked;                 /* this side offered this plane alone */
};

/* ---- staging ---------------------------------------------------------------------- */

static void link_maybe_free(struct tdp__link *l);

static void bounce_free(bounce *b)
{
    if (b->p != NULL)
        tdp__stage_host_free(b->p, b->pin);
    *b = (bounce){0};
}

/* At least need bytes of page-locked memory in b (b not busy): at once for a
 * prepare (now), else in the background (tdp__stage_host_alloc). */
static tdp_err bounce_fit(bounce *b, size_t need, bool now)
{
    if (b->p != NULL && b->cap >= need)
        return TDP_OK;
    bounce_free(b);
    tdp_err rc = tdp__stage_host_alloc(need, now, &b->p, &b->pin);
    if (rc == TDP_OK)
        b->cap = need;
    return rc;
}

/* The link's two streams (sends, receives): made once, at start when the pipe names a GPU. */
static tdp_err stage_ready(struct tdp__link *l, int dev)
{
    if (dev < 0)
        dev = 0;
    tdp_err rc = TDP_OK;
    if (l->tx_stage == NULL)
        rc = tdp__stage_new(l->loop, dev, 0, &l->tx_stage);
    if (rc == TDP_OK && l->rx_stage == NULL)
        rc = tdp__stage_new(l->loop, dev, 0, &l->rx_stage);
    return rc;
}

/* ---- receive storage -------------------------------------------------------------- */

static void slot_drop(rx_slot *s)
{
    tdp_td_unref(s->td); /* the store goes with the last td that wraps it */
    s->td = NULL;
    s->store = NULL;
}

/* A GPU layout: the slot's bytes come through its bounce. */
static bool slot_staged(const rx_slot *s)
{
    return s->store != NULL && s->store->mt == TDP_MEM_CUDA;
}

/* Make s hold a td of the current receive layout (storage reused when it fits). */
static tdp_err slot_build(struct tdp__link *l, rx_slot *s)
{
    tdp_schema *sc = l->rx_schema;
    tdp_device dev = tdp_schema_device(sc);
    tdp_mem_type mt = dev.type == TDP_DEVICE_CUDA ? TDP_MEM_CUDA : TDP_MEM_HOST;
    uint64_t need = tdp_schema_total_bytes(sc);
    tdp_err rc = TDP_OK;
    if (dev.type != TDP_DEVICE_CPU && dev.type != TDP_DEVICE_CUDA)
        return TDP_ENOTSUP;
    if (s->td == NULL || s->td->schema != sc) {
        if (tdp__rx_store_fits(s->store, s->td, need, mt, dev)) {
            rc = tdp__rx_store_rewrap(s->store, sc, dev, &s->td);
        } else {
            slot_drop(s);
            rc = tdp__rx_store_new(sc, mt, dev, need, l->populate, &s->store, &s->td);
        }
    }
    if (rc != TDP_OK || mt != TDP_MEM_CUDA)
        return rc;
    /* the stream and the bounce with the layout, not with its first message */
    if ((rc = stage_ready(l, dev.index)) != TDP_OK)
        return rc;
    return bounce_fit(&s->b, (size_t)s->store->cap, l->populate);
}

static tdp_err t_rx_schema(tdp__link *l, tdp_schema *sc, uint32_t depth)
{
    if (l->rx_schema != sc) {
        tdp_schema_unref(l->rx_schema);
        l->rx_schema = tdp_schema_ref(sc);
    }
    /* slots holding an older message are rebuilt when it is released */
    for (uint32_t i = 0; i < depth && i < TDP_MAX_DEPTH; i++) {
        rx_slot *s = &l->rx[i];
        if (s->lent || s->filling)
            continue;
        tdp_err rc = slot_build(l, s);
        if (rc != TDP_OK)
            return rc;
    }
    return TDP_OK;
}

static tdp_err t_recv(tdp__link *l, void *desc, uint32_t slot, tdp_td **td)
{
    rx_desc *d = desc;
    if (slot >= TDP_MAX_DEPTH || l->rx_schema == NULL || d->slot != UINT32_MAX)
        return TDP_EINVAL;
    rx_slot *s = &l->rx[slot];
    if (s->lent || s->filling)
        return TDP_EPROTO;
    tdp_err rc = slot_build(l, s);
    if (rc != TDP_OK)
        return rc;
    if (d->h->length != s->td->nbytes)
        return TDP_EMSGSIZE;
    s->lent = true;
    *td = s->td;
    if (d->h->length == 0)
        return TDP_OK;
    s->filling = true;
    d->slot = slot;
    return TDP_EAGAIN; /* the bytes follow on the socket: up->landed */
}

static void t_release(tdp__link *l, uint32_t slot)
{
    if (slot < TDP_MAX_DEPTH)
        l->rx[slot].lent = false;
}

/* ---- staged receives -------------------------------------------------------------- */

/* The bounce->device copy of a slot is over: the message is whole on the device. */
static void rx_copied(tdp__stage_copy *c, tdp_err st)
{
    rx_slot *s = c->arg;
    struct tdp__link *l = s->l;
    s->copying = false;
    s->filling = false;
    l->copies--;
    if (!l->closed)
        l->up->landed(l->owner, l, (uint32_t)(s - l->rx), st);
    link_maybe_free(l);
}

/* A DATA for staged slot s: its bytes go to the bounce, and from there as they come. */
static tdp_err rx_stage_start(struct tdp__link *l, rx_slot *s)
{
    s->given = 0;
    s->copy = (tdp__stage_copy){.done = rx_copied, .arg = s};
    tdp_err rc = tdp__stage_copy_start(l->rx_stage, &s->copy, s->td->data, s->b.p, s->td->nbytes, 0,
                                       STAGE_CHUNK, STAGE_INFLIGHT);
    if (rc != TDP_OK)
        return rc;
    s->copying = true;
    l->copies++;
    return TDP_OK;
}

/* Bytes [0, got) of slot s's bounce are in: whole chunks of them go to the device. */
static void rx_stage_avail(struct tdp__link *l, rx_slot *s, size_t got)
{
    if (got < s->td->nbytes)
        got -= got % STAGE_CHUNK;
    if (got <= s->given)
        return;
    s->given = got;
    tdp__stage_copy_avail(l->rx_stage, &s->copy, got);
}

/* ---- the carrier's calls ---------------------------------------------------------- */

static tdp_err on_frame(void *arg, const tdp_am_hdr *h, uint8_t **into)
{
    struct tdp__link *l = arg;
    *into = NULL;
    if (l->closed)
        return TDP_OK;
    if (h->token != 0)
        return TDP_EPROTO;
    tdp__frame f = {.type = h->type,
                    .seq = h->seq,
                    .hash = h->hash,
                    .length = h->length,
                    .arg = h->arg,
                    .has_sum = (h->flags & TDP_AM_F_SUM) != 0,
                    .sum = h->sum,
                    .prepare = (h->flags & TDP_AM_F_PREPARE) != 0};
    switch (h->type) {
    case TDP_AM_CREDIT:
        l->up->credit(l->owner, l, h->arg);
        return TDP_OK;
    case TDP_AM_SCHEMA:
        if (h->length > l->max_json) {
            /* the session's verdict (TDP_EMSGSIZE, the peer told in a BYE),
             * not the channel's: its failure would read as a vanished peer;
             * the JSON that follows is read and dropped */
            tdp_log_info("tcp plane: a %llu-byte schema, over this side's limit of %llu",
                         (unsigned long long)h->length, (unsigned long long)l->max_json);
            l->up->failed(l->owner, l, TDP_EMSGSIZE, "schema over this side's limits");
            return TDP_OK;
        }
        if (h->length > l->json_cap) {
            uint8_t *nb = tdp__realloc(l->json, (size_t)h->length);
            if (nb == NULL) {
                l->up->failed(l->owner, l, TDP_ENOMEM, "no memory for a schema");
                return TDP_OK;
            }
            l->json = nb;
            l->json_cap = (size_t)h->length;
        }
        l->pend_type = TDP_AM_SCHEMA;
        l->pend_f = f;
        if (h->length == 0) { /* the session says what is wrong with it */
            l->populate = f.prepare;
            l->up->schema(l->owner, l, &f, "", 0);
            l->populate = false;
            return TDP_OK;
        }
        *into = l->json;
        return TDP_OK;
    case TDP_AM_DATA: {
        if ((h->flags & TDP_AM_F_CHUNKED) != 0)
            return TDP_EPROTO; /* the ucx plane's, never this one's */
        /* the credit the peer owes rides on its data */
        l->up->credit(l->owner, l, h->arg);
        if (l->closed)
            return TDP_OK;
        rx_desc d = {h, UINT32_MAX};
        l->up->data(l->owner, l, &f, &d);
        if (l->closed || d.slot == UINT32_MAX)
            return TDP_OK; /* landed already (empty), or the pipe failed: the bytes are dropped */
        rx_slot *s = &l->rx[d.slot];
        l->pend_type = TDP_AM_DATA;
        l->pend_slot = d.slot;
        if (slot_staged(s)) {
            tdp_err rc = rx_stage_start(l, s);
            if (rc != TDP_OK) {
                s->filling = false;
                return rc;
            }
            *into = s->b.p;
            return TDP_OK;
        }
        *into = s->td->data;
        return TDP_OK;
    }
    default:
        return TDP_EPROTO; /* CHUNK and BATCH are the ucx plane's */
    }
}

static void on_payload(void *arg)
{
    struct tdp__link *l = arg;
    if (l->closed)
        return;
    if (l->pend_type == TDP_AM_SCHEMA) {
        l->populate = l->pend_f.prepare;
        l->up->schema(l->owner, l, &l->pend_f, l->json, (size_t)l->pend_f.length);
        l->populate = false;
        return;
    }
    rx_slot *s = &l->rx[l->pend_slot];
    if (s->copying) { /* staged: landed once the last chunk is on the device (rx_copied) */
        rx_stage_avail(l, s, s->td->nbytes);
        return;
    }
    s->filling = false;
    l->up->landed(l->owner, l, l->pend_slot, TDP_OK);
}

static void on_landing(void *arg, uint64_t got)
{
    struct tdp__link *l = arg;
    if (l->closed || l->pend_type != TDP_AM_DATA)
        return;
    rx_slot *s = &l->rx[l->pend_slot];
    if (s->copying)
        rx_stage_avail(l, s, (size_t)got);
}

static void rec_give(struct tdp__link *l, tx_rec *r);
static void tx_pump(struct tdp__link *l);

static void waitq_remove(struct tdp__link *l, tx_rec *r)
{
    tx_rec *prev = NULL;
    for (tx_rec *x = l->waitq; x != NULL; prev = x, x = x->next_wait) {
        if (x != r)
            continue;
        if (prev == NULL)
            l->waitq = r->next_wait;
        else
            prev->next_wait = r->next_wait;
        if (l->waitq_tail == r)
            l->waitq_tail = prev;
        r->next_wait = NULL;
        return;
    }
}

static void on_sent(void *arg, void *cookie, tdp_err st)
{
    struct tdp__link *l = arg;
    tx_rec *r = cookie;
    void *user = r->cookie;
    bool tell = r->tell && !l->closed;
    if (r->staged) {
        /* a frame never written (the channel closed) may still be copying or waiting */
        if (r->copying) {
            tdp__stage_copy_cancel(l->tx_stage, &r->copy); /* waits for the stream */
            r->copying = false;
            l->copies--;
        }
        if (r->bn == NULL)
            waitq_remove(l, r);
        else
            r->bn->busy = false;
        r->bn = NULL;
    }
    bool staged = r->staged;
    rec_give(l, r);
    l->outstanding--;
    if (tell)
        l->up->sent(l->owner, l, user, st);
    if (staged && !l->closed)
        tx_pump(l); /* a bounce is free */
    link_maybe_free(l);
}

static const tdp__ctl_carrier carrier = {
    .frame = on_frame,
    .payload = on_payload,
    .landing = on_landing,
    .sent = on_sent,
};

/* ---- sending ---------------------------------------------------------------------- */

static tx_rec *rec_take(struct tdp__link *l)
{
    tx_rec *r = l->free_recs;
    if (r != NULL) {
        l->free_recs = r->next_free;
        r->next_free = NULL;
    }
    return r;
}

static void rec_give(struct tdp__link *l, tx_rec *r)
{
    tdp_td_unref(r->td);
    tdp_schema_unref(r->sc);
    tdp__free(r->own);
    *r = (tx_rec){.next_free = l->free_recs};
    l->free_recs = r;
}

/* Queue a SCHEMA frame of sc (flags: TDP_AM_F_PREPARE or 0). */
static tdp_err schema_out(struct tdp__link *l, const tdp_schema *sc, uint64_t seq, uint16_t flags,
                          bool now)
{
    tx_rec *r = rec_take(l);
    if (r == NULL)
        return TDP_EINTERNAL; /* the session bounds sends far below NREC */
    size_t jl;
    const char *json = tdp_schema_json(sc, &jl);
    r->sc = tdp_schema_ref((tdp_schema *)sc);
    tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                    .flags = flags,
                    .seq = seq,
                    .hash = tdp_schema_hash(sc),
                    .length = jl,
                    .arg = tdp_schema_total_bytes(sc)};
    tdp_err rc = tdp__ctl_plane_send(l->ctl, &h, json, r, now);
    if (rc != TDP_OK) {
        rec_give(l, r);
        return rc;
    }
    l->outstanding++;
    return TDP_OK;
}

/* Bytes [0, landed) of a staged send's bounce are in: they may be written. */
static void tx_progress(tdp__stage_copy *c, size_t landed)
{
    tx_rec *r = c->arg;
    tdp__ctl_plane_give(r->l->carry, r->id, NULL, landed);
}

/* A staged send's device->bounce copy is over. */
static void tx_copied(tdp__stage_copy *c, tdp_err st)
{
    tx_rec *r = c->arg;
    struct tdp__link *l = r->l;
    r->copying = false;
    l->copies--;
    if (st == TDP_OK) {
        /* even on a closed link: frames queued after it (a BYE) wait for its bytes */
        tdp__ctl_plane_give(l->carry, r->id, NULL, r->td->nbytes);
    } else if (!l->closed) {
        /* its header may be out: the stream cannot go on */
        l->up->failed(l->owner, l, st == TDP_ECUDA ? TDP_ECUDA : TDP_ECONNRESET,
                      "cannot stage a GPU payload through host memory");
    }
    link_maybe_free(l);
}

/* Staged sends waiting in order take a free bounce and start their copy. */
static void tx_pump(struct tdp__link *l)
{
    while (l->waitq != NULL && !l->closed) {
        tx_rec *r = l->waitq;
        bounce *b = NULL;
        for (uint32_t i = 0; i < l->ntxb && b == NULL; i++)
            if (!l->txb[i].busy)
                b = &l->txb[i];
        if (b == NULL)
            return; /* both are being written: the first one's sent brings this back */
        tdp_err rc = bounce_fit(b, r->td->nbytes, false);
        if (rc == TDP_OK) {
            r->copy = (tdp__stage_copy){.done = tx_copied, .progress = tx_progress, .arg = r};
            rc = tdp__stage_copy_start(l->tx_stage, &r->copy, b->p, r->td->data, r->td->nbytes,
                                       r->td->nbytes, STAGE_CHUNK, STAGE_INFLIGHT);
        }
        if (rc != TDP_OK) {
            l->up->failed(l->owner, l, rc, "cannot stage a GPU payload through host memory");
            return;
        }
        l->waitq = r->next_wait;
        if (l->waitq == NULL)
            l->waitq_tail = NULL;
        r->next_wait = NULL;
        b->busy = true;
        r->bn = b;
        r->copying = true;
        l->copies++;
        tdp__ctl_plane_give(l->carry, r->id, b->p, 0);
    }
}

/*
 * A GPU payload: its DATA is queued held (the header may go, the payload
 * and every frame after it wait), and its copy into a bounce starts as
 * soon as one is free.
 */
static tdp_err send_staged(struct tdp__link *l, tx_rec *r, const tdp_am_hdr *h)
{
    tdp_err rc = tdp__ctl_plane_send_held(l->ctl, h, r, &r->id);
    if (rc != TDP_OK)
        return rc;
    r->staged = true;
    r->l = l;
    if (l->waitq_tail != NULL)
        l->waitq_tail->next_wait = r;
    else
        l->waitq = r;
    l->waitq_tail = r;
    l->outstanding++;
    tx_pump(l);
    return TDP_OK;
}

static tdp_err t_send(tdp__link *l, const tdp__tx *tx)
{
    if (!l->started || l->closed)
        return TDP_ECONNRESET;
    tdp_td *td = tx->td;
    bool staged = td->device.type == TDP_DEVICE_CUDA;
    if (!staged && td->device.type != TDP_DEVICE_CPU)
        return TDP_ENOTSUP; /* the session checks plane.mem first */
    if (staged && l->sum_on) {
        /* host code never reads device memory, and the sum goes before the bytes */
        tdp_log_warn("the payload checksum covers host memory only: cannot send device memory");
        return TDP_ENOTSUP;
    }
    tdp_err rc;
    if (staged && (rc = stage_ready(l, td->device.index)) != TDP_OK)
        return rc;
    if (tx->schema != NULL && (rc = schema_out(l, tx->schema, tx->seq, 0, false)) != TDP_OK)
        return rc;
    tx_rec *r = rec_take(l);
    if (r == NULL)
        return TDP_EINTERNAL;
    r->td = tdp_td_ref(td);
    r->cookie = tx->cookie;
    r->tell = true;
    tdp_am_hdr h = {.type = TDP_AM_DATA,
                    .seq = tx->seq,
                    .hash = tdp_schema_hash(td->schema),
                    .length = td->nbytes,
                    .arg = tx->credit};
    if (staged && td->nbytes > 0) {
        rc = send_staged(l, r, &h);
        if (rc != TDP_OK)
            rec_give(l, r);
        return rc;
    }
    if (l->sum_on) {
        h.flags |= TDP_AM_F_SUM;
        h.sum = tdp__sum_tx(td->data, td->nbytes, tx->seq);
    }
    rc = tdp__ctl_plane_send(l->ctl, &h, td->data, r, tx->urgent);
    if (rc != TDP_OK) {
        rec_give(l, r);
        return rc;
    }
    l->outstanding++;
    return TDP_OK;
}

static tdp_err t_credit(tdp__link *l, uint64_t total)
{
    if (!l->started || l->closed)
        return TDP_ECONNRESET;
    tdp_am_hdr h = {.type = TDP_AM_CREDIT, .arg = total};
    return tdp__ctl_plane_send(l->ctl, &h, NULL, NULL, false);
}

static tdp_err t_loan(tdp__link *l, tdp_schema *sc, tdp_td **out)
{
    (void)l;
    return tdp_td_new(sc, out);
}

/*
 * Nothing to make on the send side for host memory (the kernel reads the
 * application's buffer); a GPU layout gets its stream and its bounces.
 * The SCHEMA goes flagged TDP_AM_F_PREPARE so that the receiver builds
 * its storage (faulted in; a GPU layout's bounces too) and answers READY.
 */
static tdp_err t_prepare(tdp__link *l, tdp_schema *sc, uint64_t seq, bool send_schema, bool *sent,
                         bool *await)
{
    *sent = *await = false;
    if (!l->started)
        return TDP_EAGAIN;
    if (l->closed)
        return TDP_ECONNRESET;
    tdp_device dev = tdp_schema_device(sc);
    tdp_err rc = TDP_OK;
    if (dev.type == TDP_DEVICE_CUDA) {
        rc = stage_ready(l, dev.index);
        for (uint32_t i = 0; rc == TDP_OK && i < l->ntxb; i++)
            if (!l->txb[i].busy)
                rc = bounce_fit(&l->txb[i], tdp_schema_total_bytes(sc), true);
        if (rc != TDP_OK)
            return rc;
    } else if (dev.type != TDP_DEVICE_CPU) {
        return TDP_ENOTSUP;
    }
    if (!send_schema || !l->peer_ready)
        return TDP_OK;
    rc = schema_out(l, sc, seq, TDP_AM_F_PREPARE, true);
    if (rc == TDP_OK)
        *sent = *await = true;
    return rc;
}

tdp_err tdp__tcp_rogue(tdp__link *l, const uint8_t *am, size_t al, const void *payload, size_t len)
{
    if (!l->started || l->closed)
        return TDP_ECONNRESET;
    tx_rec *r = rec_take(l);
    if (r == NULL)
        return TDP_ELIMIT;
    if (len > 0 && (r->own = tdp__malloc(len)) == NULL) {
        rec_give(l, r);
        return TDP_ENOMEM;
    }
    if (len > 0)
        memcpy(r->own, payload, len);
    tdp_err rc = tdp__ctl_plane_send_raw(l->ctl, am, al, r->own, len, r, true);
    if (rc != TDP_OK) {
        rec_give(l, r);
        return rc;
    }
    l->outstanding++;
    return TDP_OK;
}

/* ---- links ------------------------------------------------------------------------ */

static bool have_rdma(void);

static tdp_err t_link_new(tdp_loop *loop, void *owner, const tdp__plane_up *up, tdp__link **out)
{
    struct tdp__link *l = tdp__calloc(1, sizeof(*l));
    if (l == NULL)
        return TDP_ENOMEM;
    l->recs = tdp__calloc(NREC, sizeof(*l->recs));
    if (l->recs == NULL) {
        tdp__free(l);
        return TDP_ENOMEM;
    }
    for (uint32_t i = 0; i < NREC; i++)
        l->recs[i].next_free = i + 1 < NREC ? &l->recs[i + 1] : NULL;
    l->free_recs = l->recs;
    l->loop = loop;
    l->owner = owner;
    l->up = up;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        l->rx[i].l = l;                          /* for the stage's callbacks */
    l->rec = have_rdma() ? 0 : TDP_TCP_OFF_HOST; /* known before any HELLO, as sent */
    *out = l;
    return TDP_OK;
}

/* ---- choice --------------------------------------------------------------------- */

/*
 * Whether this host has an RDMA device (InfiniBand, RoCE, iWARP: anything
 * under /sys/class/infiniband), over which UCX moves more than TCP can.
 * Looked at once per process.
 */
static bool have_rdma(void)
{
    static _Atomic int seen; /* 0: not looked yet, 1: none, 2: some */
    int v = atomic_load_explicit(&seen, memory_order_relaxed);
    if (v == 0) {
        v = 1;
        DIR *d = opendir("/sys/class/infiniband");
        struct dirent *e;
        while (d != NULL && v == 1 && (e = readdir(d)) != NULL)
            if (e->d_name[0] != '.')
                v = 2;
        if (d != NULL)
            closedir(d);
        atomic_store_explicit(&seen, v, memory_order_relaxed);
    }
    return v == 2;
}

/* Whether a HELLO's plane list is this plane alone: its side asked for it. */
static bool only_tcp(const tdp_hello *h)
{
    return h->nplanes == 1 && h->planes != NULL && h->planes[0] == TDP_PLANE_TCP;
}

static tdp_err t_hello_fill(tdp__link *l, tdp_hello *h)
{
    l->asked = only_tcp(h);
    return tdp_hello_add_rec(h, TDP_HX_TCP, &l->rec, 1);
}

static tdp_err t_hello_check(const tdp_hello *peer)
{
    const tdp_hx_rec *r = tdp_hello_rec(peer, TDP_HX_TCP);
    return r == NULL || r->len == 1 ? TDP_OK : TDP_EPROTO;
}

/*
 * Usable when a side asked for it (offered it alone), or by default for a
 * peer on another host (or in another network namespace) when neither
 * side has RDMA: then UCX would run over TCP, and this plane moves more
 * over TCP than UCX does (docs/planes.md). Both sides read both HELLOs'
 * lists and records the same way, so both give the same answer.
 */
static bool t_usable_link(const tdp__link *mine, const tdp_hello *peer, bool same_host)
{
    if (mine == NULL)
        return false;
    if (mine->asked || only_tcp(peer))
        return true;
    const tdp_hx_rec *r = tdp_hello_rec(peer, TDP_HX_TCP);
    uint8_t theirs = r != NULL && r->len == 1 ? r->val[0] : 0;
    return !same_host && (mine->rec & theirs & TDP_TCP_OFF_HOST) != 0;
}

static tdp_err t_link_start(tdp__link *l, const tdp__link_peer *peer)
{
    if (peer->ctl == NULL)
        return TDP_EINTERNAL;
    tdp_err rc = tdp__ctl_carry(peer->ctl, &carrier, l);
    if (rc != TDP_OK)
        return rc;
    l->ctl = peer->ctl;
    l->carry = peer->ctl->carry;
    l->ntxb = peer->peer_depth < 2 ? 1 : TX_BOUNCES;
    int dev = peer->cuda_device;
    if (dev >= 0 && dev < tdp__cuda_device_count()) {
        /* the context and the streams now, not in the first GPU message */
        if ((rc = tdp__cuda_ctx_set(dev)) != TDP_OK || (rc = stage_ready(l, dev)) != TDP_OK) {
            tdp__ctl_uncarry(peer->ctl, l);
            return rc;
        }
    }
    l->sum_on = peer->checksum;
    l->peer_ready = peer->hello->ready == TDP_READY_V1;
    l->max_json = peer->max_json_bytes;
    l->started = true;
    return TDP_OK;
}

static bool t_link_busy(const tdp__link *l)
{
    return l->outstanding > 0 || l->copies > 0;
}

static void link_destroy(void *arg)
{
    struct tdp__link *l = arg;
    /* no copy is queued any more (link_maybe_free): the bounces may go */
    tdp__stage_free(l->tx_stage);
    tdp__stage_free(l->rx_stage);
    for (uint32_t i = 0; i < TX_BOUNCES; i++)
        bounce_free(&l->txb[i]);
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        slot_drop(&l->rx[i]);
        bounce_free(&l->rx[i].b);
    }
    tdp_schema_unref(l->rx_schema);
    tdp__free(l->json);
    tdp__free(l->recs);
    tdp__free(l);
}

/* A closed link goes once the carrier has accounted for every frame it queued. */
static void link_maybe_free(struct tdp__link *l)
{
    if (!l->closed || l->outstanding > 0 || l->copies > 0 || l->reap.queued)
        return;
    tdp__reap_later(l->loop, &l->reap, link_destroy, l);
}

static void t_link_close(tdp__link *l, bool peer_gone)
{
    (void)peer_gone;
    if (l->closed)
        return;
    l->closed = true;
    if (l->ctl != NULL)
        tdp__ctl_uncarry(l->ctl, l); /* a payload still due is read and dropped */
    l->ctl = NULL;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        rx_slot *s = &l->rx[i];
        if (s->copying) { /* a receive nobody will take: its copy goes (waits for the stream) */
            tdp__stage_copy_cancel(l->rx_stage, &s->copy);
            s->copying = false;
            l->copies--;
        }
        s->filling = false;
    }
    /* staged sends go on: the frames queued after them (a BYE) wait for their bytes */
    link_maybe_free(l);
}

const tdp__plane_ops tdp__plane_tcp = {
    .name = "tcp",
    .id = TDP_PLANE_TCP,
    .mem = TDP__MEM_HOST | TDP__MEM_CUDA_STAGED, /* device buffers are copied through bounces */
    .link_mem = NULL,
    .hello_fill = t_hello_fill,
    .proven_fill = NULL,
    .hello_check = t_hello_check,
    .usable = NULL,
    .usable_link = t_usable_link,
    .link_device = NULL,
    .link_new = t_link_new,
    .link_start = t_link_start,
    .link_close = t_link_close,
    .link_busy = t_link_busy,
    .send = t_send,
    .credit = t_credit,
    .rx_schema = t_rx_schema,
    .recv = t_recv,
    .release = t_release,
    .loan = t_loan,
    .poll_credit = NULL,
    .prepare = t_prepare,
};
