/*
 * ucx_addr.c: a peer's UCX worker address, parsed against its length and
 * rebuilt from checked parts before UCX sees it (ucx_addr.h says why).
 *
 * The layout is UCX 1.13's (src/ucp/wireup/address.c, ucp_address_unpack,
 * with the flags ucp_ep_create uses for a worker address: worker uuid and
 * name, device, interface and endpoint addresses; not unified mode):
 *
 *   header      v1: 1 byte, version (low 4 bits) | flags << 4
 *               v2: 2 bytes, version, flags
 *   uuid        8 bytes (v1: always; v2: if flag WORKER_UUID)
 *   client id   8 bytes, if flag CLIENT_ID
 *   name        length byte + bytes, if flag DEBUG_INFO
 *   devices     a first byte of 0xff means none; else, until one has LAST:
 *     md        EMPTY 0x80 | md index (v1: 5 bits + 2 flag bits; v2: 7 bits,
 *               0x7f = the index is in the next byte)
 *     dev len   LAST 0x80 | NUM_PATHS 0x40 | SYS_DEVICE 0x20 | length (5 bits;
 *               v2: 0x1f = the length is in the next byte)
 *     [paths]   1 byte, if NUM_PATHS;  [sys dev] 1 byte, if SYS_DEVICE
 *     address   dev len bytes
 *     interfaces (none if EMPTY), until one has LAST:
 *       csum    2 bytes, checksum of the transport name
 *       attrs   v1: 16 bytes (overhead, bandwidth, latency as floats, flags);
 *               v2: 8 bytes
 *       if len  LAST 0x80 | HAS_EP_ADDR 0x40 | length (6 bits; v2: 0x3f =
 *               the length is in the next byte)
 *       address if len bytes
 *       [endpoint addresses, if HAS_EP_ADDR: never in a worker address]
 */
#include <math.h>
#include <string.h>
#include <ucp/api/ucp.h>

#include "ucx_addr.h"
#include "../../core/alloc.h"
#include "../../core/log.h"

#define A_V1 0u
#define A_V2 1u

#define H_DEBUG_INFO  0x01u
#define H_WORKER_UUID 0x02u
#define H_CLIENT_ID   0x04u
#define H_AM_ONLY     0x08u
#define H_KNOWN       0x0fu

#define F_LAST       0x80u
#define F_HAS_EP     0x40u /* interface length byte */
#define F_NUM_PATHS  0x40u /* device length byte */
#define F_SYS_DEVICE 0x20u
#define MD_EMPTY     0x80u
#define MD_V1_FLAGS  0x60u /* "can allocate", "can register": sent, not used */
#define MD_MASK_V1   0x1fu
#define MD_MASK_V2   0x7fu
#define DEV_LEN_MASK 0x1fu
#define IF_LEN_MASK  0x3fu
#define NULL_RSC     0xffu

#define ATTR_V1_LEN 16u
#define ATTR_V2_LEN 8u

/* ---- reading ----------------------------------------------------------------- */

typedef struct rd {
    const uint8_t *p, *end;
} rd;

static bool take(rd *r, size_t n, const uint8_t **out)
{
    if ((size_t)(r->end - r->p) < n)
        return false;
    *out = r->p;
    r->p += n;
    return true;
}

static bool take_byte(rd *r, uint8_t *v)
{
    const uint8_t *b;
    if (!take(r, 1, &b))
        return false;
    *v = *b;
    return true;
}

/* A value in the low bits of `first`; in version 2 an all-ones value means the next byte. */
static bool ext_value(rd *r, uint8_t first, uint8_t mask, uint8_t version, uint8_t *v)
{
    *v = first & mask;
    if (version == A_V2 && *v == mask)
        return take_byte(r, v);
    return true;
}

static float get_f32(const uint8_t *p)
{
    float f;
    memcpy(&f, p, sizeof(f));
    return f;
}

/* Interface attributes: what UCX would turn into nonsense or refuse later. */
static bool attrs_ok(const uint8_t *a, uint8_t version)
{
    if (version == A_V2)
        return true; /* small integers and 8-bit floats: any value is a number */
    float overhead = get_f32(a), bandwidth = get_f32(a + 4), lat = get_f32(a + 8);
    return isfinite(overhead) && isfinite(bandwidth) && isfinite(lat) && overhead >= 0.0f &&
           bandwidth > 0.0f && lat >= 0.0f;
}

#define FAIL(msg)                                                                                  \
    do {                                                                                           \
        *why = (msg);                                                                              \
        return TDP_EPROTO;                                                                         \
    } while (0)

static tdp_err parse_iface(rd *r, tdp__ucxa *o, uint8_t version, bool *last, const char **why)
{
    const uint8_t *csum;
    uint8_t raw;
    if (o->ntl == TDP_UCXA_MAX_TLS)
        FAIL("more than 128 interfaces");
    tdp__ucxa_tl *t = &o->tl[o->ntl];
    t->attr_len = version == A_V1 ? ATTR_V1_LEN : ATTR_V2_LEN;
    if (!take(r, 2, &csum) || !take(r, t->attr_len, &t->attr))
        FAIL("cut short in an interface");
    memcpy(&t->csum, csum, 2);
    if (!attrs_ok(t->attr, version))
        FAIL("interface attributes out of range");
    if (!take_byte(r, &raw) || !ext_value(r, raw, IF_LEN_MASK, version, &t->iface_len))
        FAIL("cut short in an interface");
    if (raw & F_HAS_EP)
        FAIL("endpoint addresses in a worker address");
    if (!take(r, t->iface_len, &t->iface))
        FAIL("cut short in an interface address");
    *last = (raw & F_LAST) != 0;
    o->ntl++;
    return TDP_OK;
}

static tdp_err parse_device(rd *r, tdp__ucxa *o, uint8_t version, bool *last, const char **why)
{
    uint8_t md, raw;
    if (o->ndev == TDP_UCXA_MAX_DEVS)
        FAIL("more than 64 devices");
    tdp__ucxa_dev *d = &o->dev[o->ndev];
    memset(d, 0, sizeof(*d));
    if (!take_byte(r, &md) ||
        !ext_value(r, md, version == A_V1 ? MD_MASK_V1 : MD_MASK_V2, version, &d->md_index))
        FAIL("cut short in a device");
    if (d->md_index >= TDP_UCXA_MAX_MD)
        FAIL("memory domain index out of range");
    d->md_flags = version == A_V1 ? (uint8_t)(md & MD_V1_FLAGS) : 0;
    if (!take_byte(r, &raw) || !ext_value(r, raw, DEV_LEN_MASK, version, &d->addr_len))
        FAIL("cut short in a device");
    d->has_paths = (raw & F_NUM_PATHS) != 0;
    d->has_sys_dev = (raw & F_SYS_DEVICE) != 0;
    if ((d->has_paths && !take_byte(r, &d->num_paths)) ||
        (d->has_sys_dev && !take_byte(r, &d->sys_dev)) || !take(r, d->addr_len, &d->addr))
        FAIL("cut short in a device");
    if (d->has_paths && d->num_paths == 0)
        FAIL("a device with no paths");
    *last = (raw & F_LAST) != 0;
    d->tl0 = o->ntl;
    bool last_tl = (md & MD_EMPTY) != 0;
    while (!last_tl) {
        tdp_err rc = parse_iface(r, o, version, &last_tl, why);
        if (rc != TDP_OK)
            return rc;
    }
    d->ntl = o->ntl - d->tl0;
    o->ndev++;
    return TDP_OK;
}

tdp_err tdp__ucxa_parse(const uint8_t *a, size_t len, tdp__ucxa *o, const char **why)
{
    rd r = {a, a + len};
    uint8_t b0, name_len;
    const uint8_t *skip;

    o->ndev = o->ntl = 0;
    o->uuid = o->client_id = NULL;
    if (a == NULL || !take_byte(&r, &b0))
        FAIL("empty");
    o->version = b0 & 0x0fu;
    if (o->version == A_V1) {
        o->flags = b0 >> 4;
    } else if (o->version == A_V2) {
        if ((b0 & 0xf0u) != 0 || !take_byte(&r, &o->flags))
            FAIL("malformed header");
        if (o->flags & ~H_KNOWN)
            FAIL("unknown header flags");
    } else {
        FAIL("unknown address version"); /* UCX 1.13 asserts on it */
    }
    /* version 1 always carries the uuid when a worker address is unpacked */
    if ((o->version == A_V1 || (o->flags & H_WORKER_UUID)) && !take(&r, 8, &o->uuid))
        FAIL("cut short in the header");
    if ((o->flags & H_CLIENT_ID) && !take(&r, 8, &o->client_id))
        FAIL("cut short in the header");
    if ((o->flags & H_DEBUG_INFO) && (!take_byte(&r, &name_len) || !take(&r, name_len, &skip)))
        FAIL("cut short in the worker name");
    if (r.p == r.end)
        FAIL("cut short before the devices");
    if (*r.p == NULL_RSC)
        FAIL("no devices");
    bool last = false;
    while (!last) {
        tdp_err rc = parse_device(&r, o, o->version, &last, why);
        if (rc != TDP_OK)
            return rc;
    }
    if (r.p != r.end)
        FAIL("bytes after the last device");
    return TDP_OK;
}

/* ---- the profile ------------------------------------------------------------------ */

tdp_err tdp__ucxa_profile_init(tdp__ucxa_profile *p, const void *own, size_t len)
{
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    if (major != 1 || minor != 13) {
        tdp_log_error("UCX %u.%u.%u: tdpipe checks a peer's UCX worker address in the "
                      "layout of UCX 1.13 only, and hands UCX no address it has not checked",
                      major, minor, release);
        return TDP_ENOTSUP;
    }
    tdp__ucxa *a = tdp__malloc(sizeof(*a));
    const char *why = NULL;
    if (a == NULL)
        return TDP_ENOMEM;
    if (tdp__ucxa_parse(own, len, a, &why) != TDP_OK) {
        tdp_log_error("this worker's own UCX address does not parse (%s): peers' addresses "
                      "cannot be checked",
                      why);
        tdp__free(a);
        return TDP_ENOTSUP;
    }
    memset(p, 0, sizeof(*p));
    for (uint32_t d = 0; d < a->ndev; d++) {
        const tdp__ucxa_dev *dv = &a->dev[d];
        p->dev[p->ndev].len = dv->addr_len;
        if (dv->addr_len > 0)
            memcpy(p->dev[p->ndev].bytes, dv->addr, dv->addr_len);
        p->ndev++;
        for (uint32_t i = dv->tl0; i < dv->tl0 + dv->ntl; i++) {
            p->shape[p->nshape].csum = a->tl[i].csum;
            p->shape[p->nshape].dev_len = dv->addr_len;
            p->shape[p->nshape].iface_len = a->tl[i].iface_len;
            p->nshape++;
        }
    }
    tdp__free(a);
    return TDP_OK;
}

static bool own_device(const tdp__ucxa_profile *p, const tdp__ucxa_dev *d)
{
    for (uint32_t i = 0; i < p->ndev; i++)
        if (p->dev[i].len == d->addr_len && d->addr_len > 0 &&
            memcmp(p->dev[i].bytes, d->addr, d->addr_len) == 0)
            return true;
    return false;
}

/* Could this worker have produced an interface of this shape on a device like d? */
static bool usable(const tdp__ucxa_profile *p, const tdp__ucxa_dev *d, const tdp__ucxa_tl *t)
{
    for (uint32_t i = 0; i < p->nshape; i++)
        if (p->shape[i].csum == t->csum && p->shape[i].dev_len == d->addr_len &&
            p->shape[i].iface_len == t->iface_len)
            return true;
    return false;
}

/* ---- writing ------------------------------------------------------------------------- */

typedef struct wr {
    uint8_t *p, *end;
    bool over; /* never: the output is no larger than the input it was sized for */
} wr;

static void put(wr *w, const void *b, size_t n)
{
    if (w->over || (size_t)(w->end - w->p) < n) {
        w->over = true;
        return;
    }
    if (n > 0)
        memcpy(w->p, b, n);
    w->p += n;
}

static void put_byte(wr *w, uint8_t v)
{
    put(w, &v, 1);
}

/* The reverse of ext_value: flags in the first byte, the value there or after it. */
static void put_ext(wr *w, uint8_t flags, uint8_t v, uint8_t mask, uint8_t version)
{
    if (version == A_V2 && v >= mask) {
        put_byte(w, flags | mask);
        put_byte(w, v);
    } else {
        put_byte(w, flags | (v & mask));
    }
}

static tdp_err write_canonical(const tdp__ucxa_profile *p, tdp__ucxa *ap, const void *peer,
                               size_t len, bool local, uint8_t *out, size_t cap, size_t *out_len,
                               const char **why)
{
    bool keep[TDP_UCXA_MAX_TLS];
    uint32_t keep_dev[TDP_UCXA_MAX_DEVS], nkeep_dev = 0;
    tdp_err rc = tdp__ucxa_parse(peer, len, ap, why);
    if (rc != TDP_OK)
        return rc;
    const tdp__ucxa *a = ap;
    for (uint32_t d = 0; d < a->ndev; d++) {
        const tdp__ucxa_dev *dv = &a->dev[d];
        bool any = false;
        bool foreign_ok = local || !own_device(p, dv);
        for (uint32_t i = dv->tl0; i < dv->tl0 + dv->ntl; i++) {
            keep[i] = foreign_ok && usable(p, dv, &a->tl[i]);
            any |= keep[i];
        }
        if (any)
            keep_dev[nkeep_dev++] = d;
    }
    if (nkeep_dev == 0) {
        *why = "no interface of a transport this side has, with its address lengths";
        return TDP_ENOTSUP;
    }

    wr w = {out, out + cap - TDP_UCXA_PAD, false};
    uint8_t flags = a->flags & (uint8_t)~H_DEBUG_INFO; /* the peer's name is not passed on */
    if (a->version == A_V1) {
        put_byte(&w, (uint8_t)(A_V1 | (flags << 4)));
    } else {
        put_byte(&w, A_V2);
        put_byte(&w, flags);
    }
    if (a->uuid != NULL)
        put(&w, a->uuid, 8);
    if (a->client_id != NULL)
        put(&w, a->client_id, 8);
    for (uint32_t k = 0; k < nkeep_dev; k++) {
        const tdp__ucxa_dev *dv = &a->dev[keep_dev[k]];
        /* md_index < 64 and never EMPTY: the first byte is never 0xff (no devices) */
        put_ext(&w, dv->md_flags, dv->md_index, a->version == A_V1 ? MD_MASK_V1 : MD_MASK_V2,
                a->version);
        uint8_t df =
            (uint8_t)((k + 1 == nkeep_dev ? F_LAST : 0) | (dv->has_paths ? F_NUM_PATHS : 0) |
                      (dv->has_sys_dev ? F_SYS_DEVICE : 0));
        put_ext(&w, df, dv->addr_len, DEV_LEN_MASK, a->version);
        if (dv->has_paths)
            put_byte(&w, dv->num_paths);
        if (dv->has_sys_dev)
            put_byte(&w, dv->sys_dev);
        put(&w, dv->addr, dv->addr_len);
        uint32_t last = dv->tl0;
        for (uint32_t i = dv->tl0; i < dv->tl0 + dv->ntl; i++)
            if (keep[i])
                last = i;
        for (uint32_t i = dv->tl0; i < dv->tl0 + dv->ntl; i++) {
            if (!keep[i])
                continue;
            const tdp__ucxa_tl *t = &a->tl[i];
            put(&w, &t->csum, 2);
            put(&w, t->attr, t->attr_len);
            put_ext(&w, i == last ? F_LAST : 0, t->iface_len, IF_LEN_MASK, a->version);
            put(&w, t->iface, t->iface_len);
        }
    }
    if (w.over) {
        *why = "canonical address larger than the input";
        return TDP_EINTERNAL;
    }
    *out_len = (size_t)(w.p - out);
    memset(w.p, 0, TDP_UCXA_PAD);
    return TDP_OK;
}

tdp_err tdp__ucxa_canonical(const tdp__ucxa_profile *p, const void *peer, size_t len, bool local,
                            uint8_t *out, size_t cap, size_t *out_len, const char **why)
{
    if (cap < len + TDP_UCXA_PAD) {
        *why = "no room for the canonical address";
        return TDP_EINTERNAL;
    }
    tdp__ucxa *a = tdp__malloc(sizeof(*a)); /* a few KiB: once per pipe */
    if (a == NULL)
        return TDP_ENOMEM;
    tdp_err rc = write_canonical(p, a, peer, len, local, out, cap, out_len, why);
    tdp__free(a);
    return rc;
}
