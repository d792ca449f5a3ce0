/* wire.c: frame encoding and strict decoding. */
#include "wire.h"

#include <endian.h>

#include <stdbool.h>
#include <string.h>
#include <tdpipe/pipe.h>

/* Little-endian fields at fixed offsets (memcpy: no alignment assumed). */
static void put16(uint8_t *p, uint16_t v)
{
    v = htole16(v);
    memcpy(p, &v, 2);
}
static void put32(uint8_t *p, uint32_t v)
{
    v = htole32(v);
    memcpy(p, &v, 4);
}
static void put64(uint8_t *p, uint64_t v)
{
    v = htole64(v);
    memcpy(p, &v, 8);
}
static uint16_t get16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return le16toh(v);
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return le64toh(v);
}

void tdp_wire_ctl_hdr_encode(uint8_t out[TDP_CTL_HDR_LEN], uint16_t type, uint32_t length)
{
    put32(out, TDP_CTL_MAGIC);
    put16(out + 4, TDP_PROTOCOL_VERSION);
    put16(out + 6, type);
    put32(out + 8, length);
    put32(out + 12, 0);
}

tdp_err tdp_wire_ctl_hdr_decode(const uint8_t in[TDP_CTL_HDR_LEN], tdp_ctl_hdr *hdr)
{
    hdr->magic = get32(in);
    hdr->version = get16(in + 4);
    hdr->type = get16(in + 6);
    hdr->length = get32(in + 8);
    if (hdr->magic != TDP_CTL_MAGIC || get32(in + 12) != 0)
        return TDP_EPROTO;
    if (hdr->version != TDP_PROTOCOL_VERSION)
        return TDP_EVERSION;
    switch (hdr->type) {
    case TDP_CTL_HELLO:
        if (hdr->length < TDP_HELLO_FIXED_LEN || hdr->length > TDP_HELLO_MAX_LEN)
            return TDP_EPROTO;
        return TDP_OK;
    case TDP_CTL_BYE:
        return hdr->length == TDP_BYE_LEN ? TDP_OK : TDP_EPROTO;
    case TDP_CTL_AUTH:
        return hdr->length == TDP_AUTH_TAG_LEN ? TDP_OK : TDP_EPROTO;
    case TDP_CTL_PROVEN:
        return hdr->length <= TDP_PROVEN_MAX_LEN ? TDP_OK : TDP_EPROTO;
    case TDP_CTL_READY:
        return hdr->length == TDP_READY_LEN ? TDP_OK : TDP_EPROTO;
    case TDP_CTL_PLANE:
        return hdr->length == TDP_AM_HDR_LEN || hdr->length == TDP_AM_HDR_SUM_LEN ? TDP_OK
                                                                                  : TDP_EPROTO;
    default:
        return TDP_EPROTO;
    }
}

/*
 * HELLO payload: recv_depth u32 | peer_mode u32 | caps u64 | max_msg u64 |
 * token u64 | host_id[16] | flags u64 | nonce[16], then records, each
 * type u16 | flags u16 | length u32 | value, zero-padded to 8 bytes.
 */

/* Record span after its header: the value rounded up to the alignment. */
static uint64_t hx_span(uint64_t vlen)
{
    return (vlen + (TDP_HX_ALIGN - 1)) & ~(uint64_t)(TDP_HX_ALIGN - 1);
}

/* 1..TDP_MAX_PLANES ids, none 0, none repeated. */
static bool planes_ok(const uint8_t *ids, size_t n)
{
    uint8_t seen[256 / 8] = {0};
    if (n == 0 || n > TDP_MAX_PLANES)
        return false;
    for (size_t i = 0; i < n; i++) {
        uint8_t id = ids[i];
        if (id == 0 || (seen[id / 8] & (1u << (id % 8))) != 0)
            return false;
        seen[id / 8] |= (uint8_t)(1u << (id % 8));
    }
    return true;
}

bool tdp_wire_hx_is_plane(uint16_t type)
{
    return type == TDP_HX_UCX_ADDR || type == TDP_HX_UCX_LOCAL_ADDR || type == TDP_HX_SHM ||
           type == TDP_HX_CUDA_IPC || type == TDP_HX_UCX_CHUNKS || type == TDP_HX_UCX_BATCH ||
           type == TDP_HX_TCP;
}

static bool rec_ok(uint16_t type, uint32_t len)
{
    return tdp_wire_hx_is_plane(type) && len >= 1 && len <= TDP_HX_PLANE_REC_MAX;
}

const tdp_hx_rec *tdp_hello_rec(const tdp_hello *h, uint16_t type)
{
    for (uint32_t i = 0; i < h->nrecs && i < TDP_HX_PLANE_RECS; i++)
        if (h->recs[i].type == type)
            return &h->recs[i];
    return NULL;
}

tdp_err tdp_hello_add_rec(tdp_hello *h, uint16_t type, const void *val, uint32_t len)
{
    if (val == NULL || !rec_ok(type, len) || tdp_hello_rec(h, type) != NULL)
        return TDP_EINVAL;
    if (h->nrecs >= TDP_HX_PLANE_RECS)
        return TDP_ELIMIT;
    h->recs[h->nrecs++] = (tdp_hx_rec){type, len, val};
    return TDP_OK;
}

/* Plane records as the encoder takes them: each well formed, each type once. */
static bool recs_ok(const tdp_hello *h)
{
    if (h->nrecs > TDP_HX_PLANE_RECS)
        return false;
    for (uint32_t i = 0; i < h->nrecs; i++) {
        if (h->recs[i].val == NULL || !rec_ok(h->recs[i].type, h->recs[i].len))
            return false;
        for (uint32_t j = 0; j < i; j++)
            if (h->recs[j].type == h->recs[i].type)
                return false;
    }
    return true;
}

static bool fixed_ok(uint32_t recv_depth, uint32_t peer_mode)
{
    return recv_depth >= 1 && recv_depth <= TDP_HX_MAX_DEPTH && peer_mode <= TDP_PEER_SOCKET;
}

/*
 * The payload length h encodes to, after checking every field against the
 * bounds the decoder enforces, so that what is encoded always decodes.
 */
static tdp_err hello_payload_len(const tdp_hello *h, uint64_t *out)
{
    uint64_t n = TDP_HELLO_FIXED_LEN;
    if (!fixed_ok(h->recv_depth, h->peer_mode))
        return TDP_EINVAL;
    if (h->planes != NULL) {
        if (!planes_ok(h->planes, h->nplanes))
            return TDP_EINVAL;
        n += TDP_HX_HDR_LEN + hx_span(h->nplanes);
    }
    if (!recs_ok(h))
        return TDP_EINVAL;
    for (uint32_t i = 0; i < h->nrecs; i++)
        n += TDP_HX_HDR_LEN + hx_span(h->recs[i].len);
    if (h->auth != 0) /* the method: any but 0 goes on the wire (the session picks) */
        n += TDP_HX_HDR_LEN + hx_span(1);
    if (h->resume != 0) {
        if (h->resume < 2 || h->resume > TDP_RESUME_MAX)
            return TDP_EINVAL;
        n += TDP_HX_HDR_LEN + hx_span(8);
    }
    if (h->want_depth != 0) {
        if (h->want_depth > TDP_HX_MAX_DEPTH)
            return TDP_EINVAL;
        n += TDP_HX_HDR_LEN + hx_span(4);
    }
    if (h->checksum != 0) /* any algorithm but 0 goes on the wire (the session picks) */
        n += TDP_HX_HDR_LEN + hx_span(1);
    if (h->proven != 0)
        n += TDP_HX_HDR_LEN + hx_span(1);
    if (h->ready != 0)
        n += TDP_HX_HDR_LEN + hx_span(1);
    if (h->window != 0) {
        if (h->window < TDP_HX_WINDOW_MIN || h->window > TDP_HX_WINDOW_MAX)
            return TDP_EINVAL;
        n += TDP_HX_HDR_LEN + hx_span(8);
    }
    if (n > TDP_HELLO_MAX_LEN)
        return TDP_EINVAL;
    *out = n;
    return TDP_OK;
}

size_t tdp_wire_hello_size(const tdp_hello *h)
{
    uint64_t n;
    if (hello_payload_len(h, &n) != TDP_OK)
        return 0;
    return TDP_CTL_HDR_LEN + (size_t)n;
}

/* Write a record's header and padding; returns where its value goes. */
static uint8_t *hx_put(uint8_t **pp, uint16_t type, uint32_t vlen)
{
    uint8_t *p = *pp;
    uint64_t span = hx_span(vlen);
    put16(p, type);
    /* a peer that cannot authenticate must refuse, not skip, the request */
    put16(p + 2, type == TDP_HX_AUTH || type == TDP_HX_RESUME ? TDP_HX_CRITICAL : 0);
    put32(p + 4, vlen);
    memset(p + TDP_HX_HDR_LEN + vlen, 0, (size_t)(span - vlen));
    *pp = p + TDP_HX_HDR_LEN + span;
    return p + TDP_HX_HDR_LEN;
}

tdp_err tdp_wire_hello_encode(uint8_t *out, const tdp_hello *h)
{
    uint64_t len;
    tdp_err rc = hello_payload_len(h, &len);
    if (rc != TDP_OK)
        return rc;
    tdp_wire_ctl_hdr_encode(out, TDP_CTL_HELLO, (uint32_t)len);
    uint8_t *p = out + TDP_CTL_HDR_LEN;
    put32(p, h->recv_depth);
    put32(p + 4, h->peer_mode);
    put64(p + 8, h->caps);
    put64(p + 16, h->max_msg_bytes);
    put64(p + 24, h->token);
    memcpy(p + 32, h->host_id, TDP_HOST_ID_LEN);
    put64(p + 48, h->flags);
    memcpy(p + 56, h->nonce, TDP_HELLO_NONCE_LEN);
    p += TDP_HELLO_FIXED_LEN;
    /* in type order; a receiver accepts any order */
    if (h->planes != NULL)
        memcpy(hx_put(&p, TDP_HX_PLANES, h->nplanes), h->planes, h->nplanes);
    /* the planes' records in type order too (they lie between PLANES and
     * AUTH), whatever order the planes added them in: the same bytes */
    for (uint16_t type = TDP_HX_UCX_ADDR; type <= TDP_HX_SHM; type++) {
        const tdp_hx_rec *r = tdp_hello_rec(h, type);
        if (r != NULL)
            memcpy(hx_put(&p, type, r->len), r->val, r->len);
    }
    if (h->auth != 0)
        *hx_put(&p, TDP_HX_AUTH, 1) = h->auth;
    if (h->resume != 0)
        put64(hx_put(&p, TDP_HX_RESUME, 8), h->resume);
    if (h->want_depth != 0)
        put32(hx_put(&p, TDP_HX_WANT_DEPTH, 4), h->want_depth);
    if (h->checksum != 0)
        *hx_put(&p, TDP_HX_CHECKSUM, 1) = h->checksum;
    if (h->proven != 0)
        *hx_put(&p, TDP_HX_PROVEN, 1) = h->proven;
    if (h->ready != 0)
        *hx_put(&p, TDP_HX_READY, 1) = h->ready;
    const tdp_hx_rec *ipc = tdp_hello_rec(h, TDP_HX_CUDA_IPC); /* a plane's, typed after the rest */
    if (ipc != NULL)
        memcpy(hx_put(&p, TDP_HX_CUDA_IPC, ipc->len), ipc->val, ipc->len);
    const tdp_hx_rec *chk = tdp_hello_rec(h, TDP_HX_UCX_CHUNKS);
    if (chk != NULL)
        memcpy(hx_put(&p, TDP_HX_UCX_CHUNKS, chk->len), chk->val, chk->len);
    if (h->window != 0)
        put64(hx_put(&p, TDP_HX_WINDOW, 8), h->window);
    const tdp_hx_rec *bat = tdp_hello_rec(h, TDP_HX_UCX_BATCH);
    if (bat != NULL)
        memcpy(hx_put(&p, TDP_HX_UCX_BATCH, bat->len), bat->val, bat->len);
    const tdp_hx_rec *tcp = tdp_hello_rec(h, TDP_HX_TCP);
    if (tcp != NULL)
        memcpy(hx_put(&p, TDP_HX_TCP, tcp->len), tcp->val, tcp->len);
    return TDP_OK;
}

/* One record's value, checked; a known type seen twice is malformed. */
static tdp_err hx_decode(tdp_hello *h, uint16_t type, uint16_t flags, const uint8_t *v,
                         uint32_t vlen)
{
    switch (type) {
    case TDP_HX_PLANES:
        if (h->planes != NULL || !planes_ok(v, vlen))
            return TDP_EPROTO;
        h->planes = v;
        h->nplanes = vlen;
        return TDP_OK;
    case TDP_HX_UCX_ADDR:
    case TDP_HX_UCX_LOCAL_ADDR:
    case TDP_HX_SHM:
    case TDP_HX_CUDA_IPC:
    case TDP_HX_UCX_CHUNKS:
    case TDP_HX_UCX_BATCH:
    case TDP_HX_TCP:
        /* a plane's: framed here, read and checked by the plane */
        return tdp_hello_add_rec(h, type, v, vlen) == TDP_OK ? TDP_OK : TDP_EPROTO;
    case TDP_HX_AUTH:
        /* another method (a later version) is this side's to refuse, with TDP_EAUTH */
        if (h->auth != 0 || vlen != 1 || v[0] == 0)
            return TDP_EPROTO;
        h->auth = v[0];
        return TDP_OK;
    case TDP_HX_RESUME:
        if (h->resume != 0 || vlen != 8)
            return TDP_EPROTO;
        h->resume = get64(v);
        if (h->resume < 2 || h->resume > TDP_RESUME_MAX)
            return TDP_EPROTO;
        return TDP_OK;
    case TDP_HX_WANT_DEPTH:
        /* only a wish: the receiver's listener decides, within its own bounds */
        if (h->want_depth != 0 || vlen != 4)
            return TDP_EPROTO;
        h->want_depth = get32(v);
        if (h->want_depth == 0 || h->want_depth > TDP_HX_MAX_DEPTH)
            return TDP_EPROTO;
        return TDP_OK;
    case TDP_HX_CHECKSUM:
        /* an algorithm this side lacks is allowed: the checksum is then off */
        if (h->checksum != 0 || vlen != 1 || v[0] == 0)
            return TDP_EPROTO;
        h->checksum = v[0];
        return TDP_OK;
    case TDP_HX_PROVEN:
        /* a later version is allowed: the frame is then not exchanged */
        if (h->proven != 0 || vlen != 1 || v[0] == 0)
            return TDP_EPROTO;
        h->proven = v[0];
        return TDP_OK;
    case TDP_HX_WINDOW:
        /* the receiver's grant: a sender that knows it may use it, one that
         * does not skips it and keeps to recv_depth */
        if (h->window != 0 || vlen != 8)
            return TDP_EPROTO;
        h->window = get64(v);
        if (h->window < TDP_HX_WINDOW_MIN || h->window > TDP_HX_WINDOW_MAX)
            return TDP_EPROTO;
        return TDP_OK;
    case TDP_HX_READY:
        /* a later version is allowed: nothing is prepared with that peer then */
        if (h->ready != 0 || vlen != 1 || v[0] == 0)
            return TDP_EPROTO;
        h->ready = v[0];
        return TDP_OK;
    case 0:
        return TDP_EPROTO;
    default:
        /*
         * Not ours. A critical one is remembered, not returned: the rest is
         * still checked, so a malformed HELLO is EPROTO whatever it carries.
         */
        if ((flags & TDP_HX_CRITICAL) == 0)
            h->nskipped++;
        else if (h->unknown_critical == 0)
            h->unknown_critical = type;
        return TDP_OK;
    }
}

/*
 * The records in in[off..len), each handed to decode (nrec counts them
 * across calls); TDP_EPROTO when one is malformed or padded with non-zero.
 */
static tdp_err hx_walk(tdp_hello *h, const uint8_t *in, size_t off, size_t len, unsigned *nrec,
                       tdp_err (*decode)(tdp_hello *, uint16_t, uint16_t, const uint8_t *,
                                         uint32_t))
{
    while (off < len) {
        size_t rem = len - off;
        if (rem < TDP_HX_HDR_LEN || ++*nrec > TDP_HX_MAX_RECORDS)
            return TDP_EPROTO;
        const uint8_t *r = in + off;
        uint16_t type = get16(r);
        uint16_t flags = get16(r + 2);
        uint32_t vlen = get32(r + 4);
        uint64_t span = hx_span(vlen);
        if (span > rem - TDP_HX_HDR_LEN)
            return TDP_EPROTO;
        const uint8_t *v = r + TDP_HX_HDR_LEN;
        for (uint64_t i = vlen; i < span; i++)
            if (v[i] != 0)
                return TDP_EPROTO;
        tdp_err rc = decode(h, type, flags, v, vlen);
        if (rc != TDP_OK)
            return rc;
        off += TDP_HX_HDR_LEN + (size_t)span;
    }
    return TDP_OK;
}

tdp_err tdp_wire_hello_decode(const uint8_t *in, size_t len, tdp_hello *h)
{
    memset(h, 0, sizeof(*h));
    if (len < TDP_HELLO_FIXED_LEN || len > TDP_HELLO_MAX_LEN)
        return TDP_EPROTO;
    h->recv_depth = get32(in);
    h->peer_mode = get32(in + 4);
    h->caps = get64(in + 8);
    h->max_msg_bytes = get64(in + 16);
    h->token = get64(in + 24);
    memcpy(h->host_id, in + 32, TDP_HOST_ID_LEN);
    h->flags = get64(in + 48);
    memcpy(h->nonce, in + 56, TDP_HELLO_NONCE_LEN);
    if (!fixed_ok(h->recv_depth, h->peer_mode))
        return TDP_EPROTO;

    unsigned nrec = 0;
    tdp_err rc = hx_walk(h, in, TDP_HELLO_FIXED_LEN, len, &nrec, hx_decode);
    if (rc != TDP_OK)
        return rc;
    return h->unknown_critical != 0 ? TDP_EVERSION : TDP_OK;
}

/* First position of id in l, or n when absent. */
static size_t rank_of(const uint8_t *l, size_t n, uint8_t id)
{
    size_t i = 0;
    while (i < n && l[i] != id)
        i++;
    return i;
}

int tdp_wire_plane_choose(const uint8_t *a, size_t na, const uint8_t *b, size_t nb,
                          uint64_t allowed)
{
    int best = 0;
    size_t best_sum = SIZE_MAX;
    for (size_t i = 0; i < na; i++) {
        uint8_t id = a[i];
        /* a repeated id in a: its later places have larger sums, never chosen */
        if (id == 0 || id >= 64 || (allowed & TDP_PLANE_BIT(id)) == 0)
            continue;
        size_t j = rank_of(b, nb, id);
        if (j == nb)
            continue;
        /* ranks are below the list sizes, which are object sizes: no wrap */
        size_t sum = i + j;
        if (sum < best_sum || (sum == best_sum && id < best)) {
            best = id;
            best_sum = sum;
        }
    }
    return best;
}

void tdp_wire_auth_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_AUTH_TAG_LEN],
                          const uint8_t tag[TDP_AUTH_TAG_LEN])
{
    tdp_wire_ctl_hdr_encode(out, TDP_CTL_AUTH, TDP_AUTH_TAG_LEN);
    memcpy(out + TDP_CTL_HDR_LEN, tag, TDP_AUTH_TAG_LEN);
}

/* PROVEN payload: plane records, framed as in HELLO. */
static tdp_err proven_payload_len(const tdp_hello *h, uint64_t *out)
{
    uint64_t n = 0;
    if (!recs_ok(h))
        return TDP_EINVAL;
    for (uint32_t i = 0; i < h->nrecs; i++)
        n += TDP_HX_HDR_LEN + hx_span(h->recs[i].len);
    if (n > TDP_PROVEN_MAX_LEN)
        return TDP_EINVAL;
    *out = n;
    return TDP_OK;
}

size_t tdp_wire_proven_size(const tdp_hello *h)
{
    uint64_t n;
    if (proven_payload_len(h, &n) != TDP_OK)
        return 0;
    return TDP_CTL_HDR_LEN + (size_t)n;
}

tdp_err tdp_wire_proven_encode(uint8_t *out, const tdp_hello *h)
{
    uint64_t len;
    tdp_err rc = proven_payload_len(h, &len);
    if (rc != TDP_OK)
        return rc;
    tdp_wire_ctl_hdr_encode(out, TDP_CTL_PROVEN, (uint32_t)len);
    uint8_t *p = out + TDP_CTL_HDR_LEN;
    for (uint16_t type = TDP_HX_UCX_ADDR; type <= TDP_HX_SHM; type++) {
        const tdp_hx_rec *r = tdp_hello_rec(h, type);
        if (r != NULL)
            memcpy(hx_put(&p, type, r->len), r->val, r->len);
    }
    return TDP_OK;
}

/*
 * A PROVEN record: a plane's, not already in the HELLO. Every other record
 * this side knows belongs in the HELLO, which the proofs cover (PROVEN is
 * not covered): only an unknown one is skipped (or refused, if critical).
 * Asked of the decoder itself, so that a record type added later is
 * refused here too.
 */
static tdp_err proven_rec(tdp_hello *h, uint16_t type, uint16_t flags, const uint8_t *v,
                          uint32_t vlen)
{
    if (tdp_wire_hx_is_plane(type))
        return tdp_hello_add_rec(h, type, v, vlen) == TDP_OK ? TDP_OK : TDP_EPROTO;
    tdp_hello probe = {0};
    if (hx_decode(&probe, type, flags, v, vlen) != TDP_OK ||
        (probe.nskipped == 0 && probe.unknown_critical == 0))
        return TDP_EPROTO; /* 0, malformed, or a known record: HELLO's */
    return hx_decode(h, type, flags, v, vlen);
}

tdp_err tdp_wire_proven_decode(const uint8_t *in, size_t len, tdp_hello *h)
{
    unsigned nrec = 0;
    if (len > TDP_PROVEN_MAX_LEN)
        return TDP_EPROTO;
    tdp_err rc = hx_walk(h, in, 0, len, &nrec, proven_rec);
    if (rc != TDP_OK)
        return rc;
    return h->unknown_critical != 0 ? TDP_EVERSION : TDP_OK;
}

void tdp_wire_ready_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_READY_LEN], const tdp_ready *r)
{
    tdp_wire_ctl_hdr_encode(out, TDP_CTL_READY, TDP_READY_LEN);
    put64(out + TDP_CTL_HDR_LEN, r->hash);
    put64(out + TDP_CTL_HDR_LEN + 8, r->count);
}

tdp_err tdp_wire_ready_decode(const uint8_t *in, size_t len, tdp_ready *r)
{
    if (len != TDP_READY_LEN)
        return TDP_EPROTO;
    r->hash = get64(in);
    r->count = get64(in + 8);
    return r->count == 0 ? TDP_EPROTO : TDP_OK;
}

void tdp_wire_bye_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_BYE_LEN], const tdp_bye *b)
{
    tdp_wire_ctl_hdr_encode(out, TDP_CTL_BYE, TDP_BYE_LEN);
    put64(out + TDP_CTL_HDR_LEN, b->last_seq);
    put32(out + TDP_CTL_HDR_LEN + 8, (uint32_t)b->reason);
    put32(out + TDP_CTL_HDR_LEN + 12, 0);
}

tdp_err tdp_wire_bye_decode(const uint8_t *in, size_t len, tdp_bye *b)
{
    if (len != TDP_BYE_LEN || get32(in + 12) != 0)
        return TDP_EPROTO;
    b->last_seq = get64(in);
    b->reason = (int32_t)get32(in + 8);
    if (b->reason > 0 || b->reason < -1000)
        return TDP_EPROTO;
    return TDP_OK;
}

/*
 * AM header: magic u32 | version u8 | type u8 | flags u16 | token u64 |
 * seq u64 | hash u64 | length u64 | arg u64 [| sum u64 with TDP_AM_F_SUM].
 */
size_t tdp_wire_am_len(const tdp_am_hdr *h)
{
    return (h->flags & TDP_AM_F_SUM) != 0 ? TDP_AM_HDR_SUM_LEN : TDP_AM_HDR_LEN;
}

size_t tdp_wire_am_encode(uint8_t *out, const tdp_am_hdr *h)
{
    put32(out, TDP_AM_MAGIC);
    out[4] = TDP_PROTOCOL_VERSION;
    out[5] = h->type;
    put16(out + 6, h->flags);
    put64(out + 8, h->token);
    put64(out + 16, h->seq);
    put64(out + 24, h->hash);
    put64(out + 32, h->length);
    put64(out + 40, h->arg);
    if ((h->flags & TDP_AM_F_SUM) != 0)
        put64(out + TDP_AM_HDR_LEN, h->sum);
    return tdp_wire_am_len(h);
}

tdp_err tdp_wire_am_decode(const void *in, size_t len, tdp_am_hdr *h)
{
    const uint8_t *p = in;
    if (in == NULL || (len != TDP_AM_HDR_LEN && len != TDP_AM_HDR_SUM_LEN) ||
        get32(p) != TDP_AM_MAGIC)
        return TDP_EPROTO;
    if (p[4] != TDP_PROTOCOL_VERSION)
        return TDP_EVERSION;
    h->type = p[5];
    h->flags = get16(p + 6);
    h->token = get64(p + 8);
    h->seq = get64(p + 16);
    h->hash = get64(p + 24);
    h->length = get64(p + 32);
    h->arg = get64(p + 40);
    h->sum = 0;
    /* the sum flag and the longer header go together, on DATA only */
    if (len != tdp_wire_am_len(h))
        return TDP_EPROTO;
    if ((h->flags & TDP_AM_F_SUM) != 0)
        h->sum = get64(p + TDP_AM_HDR_LEN);
    switch (h->type) {
    case TDP_AM_SCHEMA:
        return (h->flags & ~TDP_AM_F_PREPARE) == 0 ? TDP_OK : TDP_EPROTO;
    case TDP_AM_DATA:
        return (h->flags & ~(TDP_AM_F_SUM | TDP_AM_F_CHUNKED)) == 0 ? TDP_OK : TDP_EPROTO;
    case TDP_AM_CHUNK:
        /* a chunk is never empty; where it lies is the receiving plane's to check */
        return h->flags == 0 && h->length > 0 ? TDP_OK : TDP_EPROTO;
    case TDP_AM_CREDIT:
        return h->flags == 0 && h->length == 0 ? TDP_OK : TDP_EPROTO;
    case TDP_AM_BATCH:
        return h->flags == 0 && h->arg >= 2 && h->arg <= TDP_AM_BATCH_MAX &&
                       h->length >= h->arg * TDP_AM_HDR_LEN
                   ? TDP_OK
                   : TDP_EPROTO;
    default:
        return TDP_EPROTO;
    }
}

tdp_err tdp_wire_batch_entry(const uint8_t *in, size_t left, uint64_t token, uint64_t seq,
                             tdp_am_hdr *h, const uint8_t **data, size_t *used)
{
    if (left < TDP_AM_HDR_LEN)
        return TDP_EPROTO;
    /* the flags say how long the header is: 56 bytes with the checksum */
    size_t hl = (get16(in + 6) & TDP_AM_F_SUM) != 0 ? TDP_AM_HDR_SUM_LEN : TDP_AM_HDR_LEN;
    if (left < hl || tdp_wire_am_decode(in, hl, h) != TDP_OK || h->type != TDP_AM_DATA ||
        (h->flags & TDP_AM_F_CHUNKED) != 0 || h->token != token || h->seq != seq ||
        h->length > left - hl)
        return TDP_EPROTO;
    *data = in + hl;
    *used = hl + (size_t)h->length;
    return TDP_OK;
}
