/*
 * fuzz_frames: the frame decoders a peer reaches before anything else —
 * control header, HELLO with its extension records, PROVEN, READY, BYE and
 * the active-message header. Every decode must either fail cleanly or produce
 * fields inside their documented bounds, an accepted frame must re-encode
 * to something that decodes to the same fields, and plane negotiation on a
 * decoded plane list must agree whichever side computes it.
 */
#include <stdbool.h>
#include <stdlib.h>
#include <endian.h>
#include <string.h>

#include "pipe/wire.h"
#include "pipe/shm/shm_hello.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool inside(const void *p, size_t n, const uint8_t *buf, size_t len)
{
    const uint8_t *q = p;
    return q >= buf && n <= len && (size_t)(q - buf) <= len - n;
}

static bool same_bytes(const void *a, uint32_t na, const void *b, uint32_t nb)
{
    if ((a == NULL) != (b == NULL) || na != nb)
        return false;
    return a == NULL || memcmp(a, b, na) == 0;
}

/* What a decoded HELLO promises, whatever the input was. */
static void check_hello(const tdp_hello *h, const uint8_t *pl, size_t n)
{
    if (h->recv_depth == 0 || h->recv_depth > 64 || h->want_depth > 64 || h->unknown_critical != 0)
        abort();
    if (h->planes != NULL) {
        if (h->nplanes == 0 || h->nplanes > TDP_MAX_PLANES || !inside(h->planes, h->nplanes, pl, n))
            abort();
        for (uint32_t i = 0; i < h->nplanes; i++)
            for (uint32_t j = 0; j < i; j++)
                if (h->planes[i] == 0 || h->planes[i] == h->planes[j])
                    abort();
    }
    if (h->nrecs > TDP_HX_PLANE_RECS)
        abort();
    for (uint32_t i = 0; i < h->nrecs; i++) {
        const tdp_hx_rec *r = &h->recs[i];
        if (!tdp_wire_hx_is_plane(r->type) || r->len == 0 || r->len > TDP_HX_PLANE_REC_MAX ||
            !inside(r->val, r->len, pl, n) || tdp_hello_rec(h, r->type) != r)
            abort();
    }
    /* the shm plane's reading of its record stays inside it */
    tdp__shm_hello sh;
    tdp_err rc = tdp__shm_hello_get(h, &sh);
    if (rc == TDP_OK &&
        (sh.name_len == 0 || sh.name_len > TDP_SHM_NAME_MAX ||
         !inside(sh.key, TDP_SHM_KEY_LEN, pl, n) || !inside(sh.name, sh.name_len, pl, n)))
        abort();
    if (rc != TDP_OK && rc != TDP_ENOENT && rc != TDP_EPROTO)
        abort();
}

/* The plane records of a and b hold the same bytes, type by type. */
static bool same_recs(const tdp_hello *a, const tdp_hello *b)
{
    if (a->nrecs != b->nrecs)
        return false;
    for (uint32_t i = 0; i < a->nrecs; i++) {
        const tdp_hx_rec *r = tdp_hello_rec(b, a->recs[i].type);
        if (r == NULL || !same_bytes(r->val, r->len, a->recs[i].val, a->recs[i].len))
            return false;
    }
    return true;
}

/* Encode what was decoded, decode it again: the same HELLO comes back. */
static void check_reencode(const tdp_hello *h)
{
    size_t sz = tdp_wire_hello_size(h);
    if (sz < TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN)
        abort();
    uint8_t *re = malloc(sz);
    if (re == NULL)
        return;
    tdp_ctl_hdr rh;
    tdp_hello h2;
    if (tdp_wire_hello_encode(re, h) != TDP_OK || tdp_wire_ctl_hdr_decode(re, &rh) != TDP_OK ||
        rh.type != TDP_CTL_HELLO || rh.length != sz - TDP_CTL_HDR_LEN ||
        tdp_wire_hello_decode(re + TDP_CTL_HDR_LEN, rh.length, &h2) != TDP_OK)
        abort();
    if (h2.recv_depth != h->recv_depth || h2.peer_mode != h->peer_mode || h2.caps != h->caps ||
        h2.max_msg_bytes != h->max_msg_bytes || h2.token != h->token || h2.flags != h->flags ||
        memcmp(h2.host_id, h->host_id, TDP_HOST_ID_LEN) != 0 ||
        memcmp(h2.nonce, h->nonce, TDP_HELLO_NONCE_LEN) != 0 ||
        !same_bytes(h2.planes, h2.nplanes, h->planes, h->nplanes) || !same_recs(&h2, h) ||
        h2.auth != h->auth || h2.resume != h->resume || h2.want_depth != h->want_depth ||
        h2.checksum != h->checksum || h2.proven != h->proven || h2.ready != h->ready ||
        h2.nskipped != 0)
        abort();
    free(re);
}

/* Negotiation against a few local lists: symmetric, and a common id or 0. */
static void check_planes(const uint8_t *p, uint32_t np)
{
    static const uint8_t locals[][4] = {{1, 2, 3, 4}, {4, 3, 2, 1}, {2, 1, 0, 0}, {1, 0, 0, 0}};
    static const size_t nlocals[] = {4, 4, 2, 1};
    static const uint64_t masks[] = {~UINT64_C(0), TDP_PLANE_BIT(TDP_PLANE_UCX),
                                     TDP_PLANE_BIT(TDP_PLANE_UCX) | TDP_PLANE_BIT(TDP_PLANE_SHM)};
    for (size_t l = 0; l < sizeof(nlocals) / sizeof(nlocals[0]); l++) {
        for (size_t m = 0; m < sizeof(masks) / sizeof(masks[0]); m++) {
            int x = tdp_wire_plane_choose(locals[l], nlocals[l], p, np, masks[m]);
            int y = tdp_wire_plane_choose(p, np, locals[l], nlocals[l], masks[m]);
            if (x != y || x < 0 || x >= 64)
                abort();
            if (x != 0 && ((masks[m] & TDP_PLANE_BIT(x)) == 0 || memchr(p, x, np) == NULL ||
                           memchr(locals[l], x, nlocals[l]) == NULL))
                abort();
        }
    }
    /* with itself, a list's first usable id wins */
    int self = tdp_wire_plane_choose(p, np, p, np, ~UINT64_C(0));
    for (uint32_t i = 0; i < np; i++) {
        if (p[i] < 64) {
            if (self != p[i])
                abort();
            return;
        }
    }
    if (self != 0)
        abort();
}

static void fuzz_ctl(const uint8_t *data, size_t size)
{
    tdp_ctl_hdr h;
    if (tdp_wire_ctl_hdr_decode(data, &h) != TDP_OK)
        return;
    const uint8_t *pl = data + TDP_CTL_HDR_LEN;
    size_t avail = size - TDP_CTL_HDR_LEN;
    size_t n = h.length < avail ? h.length : avail;
    if (h.type == TDP_CTL_HELLO) {
        if (h.length < TDP_HELLO_FIXED_LEN || h.length > TDP_HELLO_MAX_LEN)
            abort();
        tdp_hello hello;
        tdp_err rc = tdp_wire_hello_decode(pl, n, &hello);
        if (rc == TDP_OK) {
            check_hello(&hello, pl, n);
            check_reencode(&hello);
            if (hello.planes != NULL)
                check_planes(hello.planes, hello.nplanes);
        } else if (rc == TDP_EVERSION) {
            if (hello.unknown_critical == 0 || hello.unknown_critical <= TDP_HX_WANT_DEPTH)
                abort();
        } else if (rc != TDP_EPROTO) {
            abort();
        }
    } else if (h.type == TDP_CTL_PROVEN) {
        if (h.length > TDP_PROVEN_MAX_LEN)
            abort();
        /* added to a HELLO that has the general address already */
        static const uint8_t addr[8] = {1};
        tdp_hello hello = {.recv_depth = 1};
        if (tdp_hello_add_rec(&hello, TDP_HX_UCX_ADDR, addr, sizeof(addr)) != TDP_OK)
            abort();
        tdp_err rc = tdp_wire_proven_decode(pl, n, &hello);
        if (rc == TDP_OK) {
            const tdp_hx_rec *a = tdp_hello_rec(&hello, TDP_HX_UCX_ADDR);
            if (a == NULL || a->val != addr || hello.nrecs > TDP_HX_PLANE_RECS)
                abort();
            for (uint32_t i = 0; i < hello.nrecs; i++) {
                const tdp_hx_rec *r = &hello.recs[i];
                if (r != a &&
                    (!tdp_wire_hx_is_plane(r->type) || r->len == 0 ||
                     !inside(r->val, r->len, pl, n) || tdp_hello_rec(&hello, r->type) != r))
                    abort();
            }
            if (hello.planes != NULL || hello.auth != 0 || hello.resume != 0 ||
                hello.want_depth != 0 || hello.checksum != 0 || hello.proven != 0 ||
                hello.ready != 0 || tdp_wire_proven_size(&hello) == 0)
                abort();
        } else if (rc != TDP_EPROTO && rc != TDP_EVERSION) {
            abort();
        }
    } else if (h.type == TDP_CTL_AUTH) {
        if (h.length != TDP_AUTH_TAG_LEN)
            abort();
    } else if (h.type == TDP_CTL_READY) {
        tdp_ready r;
        if (h.length != TDP_READY_LEN)
            abort();
        if (tdp_wire_ready_decode(pl, n, &r) == TDP_OK) {
            uint8_t re[TDP_CTL_HDR_LEN + TDP_READY_LEN];
            if (r.count == 0)
                abort();
            tdp_wire_ready_encode(re, &r);
            if (n != TDP_READY_LEN || memcmp(re + TDP_CTL_HDR_LEN, pl, n) != 0)
                abort();
        }
    } else if (h.type == TDP_CTL_BYE) {
        tdp_bye bye;
        if (tdp_wire_bye_decode(pl, n, &bye) == TDP_OK && bye.reason > 0)
            abort();
    }
}

/*
 * The input as a BATCH payload: its entries, for the token and seq the
 * first one names (so that well-formed runs are reached). Every entry
 * taken lies within the input and is a DATA without CHUNKED.
 */
static void fuzz_batch(const uint8_t *data, size_t size)
{
    if (size < TDP_AM_HDR_LEN)
        return;
    uint64_t token, seq;
    memcpy(&token, data + 8, 8);
    memcpy(&seq, data + 16, 8);
    token = le64toh(token);
    seq = le64toh(seq);
    const uint8_t *p = data;
    size_t left = size;
    for (uint32_t i = 0; i < TDP_AM_BATCH_MAX && left > 0; i++) {
        tdp_am_hdr h;
        const uint8_t *bytes;
        size_t used;
        if (tdp_wire_batch_entry(p, left, token, seq + i, &h, &bytes, &used) != TDP_OK)
            return;
        if (h.type != TDP_AM_DATA || (h.flags & TDP_AM_F_CHUNKED) != 0 || used > left ||
            used < TDP_AM_HDR_LEN || bytes < p || bytes + h.length != p + used ||
            h.token != token || h.seq != seq + i)
            abort();
        p += used;
        left -= used;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_batch(data, size);
    if (size >= TDP_CTL_HDR_LEN)
        fuzz_ctl(data, size);
    tdp_am_hdr am;
    if (tdp_wire_am_decode(data, size, &am) == TDP_OK) {
        uint8_t re[TDP_AM_HDR_MAX_LEN];
        if (am.type < TDP_AM_SCHEMA || am.type > TDP_AM_BATCH)
            abort();
        /* a BATCH: 2..64 entries, each at least a header, no flags */
        if (am.type == TDP_AM_BATCH && (am.flags != 0 || am.arg < 2 || am.arg > TDP_AM_BATCH_MAX ||
                                        am.length < am.arg * TDP_AM_HDR_LEN))
            abort();
        /* CHUNKED only on DATA; a CHUNK carries no flag and is never empty */
        if ((am.flags & TDP_AM_F_CHUNKED) != 0 && am.type != TDP_AM_DATA)
            abort();
        if (am.type == TDP_AM_CHUNK && (am.flags != 0 || am.length == 0))
            abort();
        /* the prepare flag on SCHEMA only, the sum flag on DATA only */
        if ((am.flags & TDP_AM_F_PREPARE) != 0 && am.type != TDP_AM_SCHEMA)
            abort();
        if (tdp_wire_am_encode(re, &am) != size || memcmp(re, data, size) != 0)
            abort();
    }
    return 0;
}
