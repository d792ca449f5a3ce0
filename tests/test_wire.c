/*
 * test_wire: the control frames' codec — HELLO with its extension records,
 * plane negotiation, and the headers that must not change (control header,
 * BYE, AM header).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <tdpipe/pipe.h>

#include "pipe/wire.h"
#include "pipe/shm/shm_hello.h"

#define N(a) (sizeof(a) / sizeof((a)[0]))

/* ---- building HELLO payloads by hand ------------------------------------------ */

/* Big enough for both UCX addresses at their largest and then some. */
#define BUF_CAP (TDP_HELLO_MAX_LEN + 1024u)

typedef struct buf {
    uint8_t *b;
    size_t n;
    size_t bounds[TDP_HX_MAX_RECORDS + 8]; /* payload length after each record */
    size_t nbounds;
} buf;

static void le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void buf_init(buf *b)
{
    b->b = calloc(1, BUF_CAP);
    assert_non_null(b->b);
    b->n = 0;
    b->nbounds = 0;
}

static void buf_free(buf *b)
{
    free(b->b);
}

static void put_fixed(buf *b, uint32_t depth, uint32_t mode, uint64_t flags)
{
    uint8_t *p = b->b;
    le(p, depth, 4);
    le(p + 4, mode, 4);
    le(p + 8, 3, 8);                /* caps */
    le(p + 16, 1u << 30, 8);        /* max_msg_bytes */
    le(p + 24, 0x1234567890ull, 8); /* token */
    memset(p + 32, 'H', TDP_HOST_ID_LEN);
    le(p + 48, flags, 8);
    for (int i = 0; i < 16; i++)
        p[56 + i] = (uint8_t)(0xa0 + i);
    b->n = TDP_HELLO_FIXED_LEN;
}

/* A record with `vlen` in its header and `have` value bytes copied from v. */
static void put_rec_raw(buf *b, uint16_t type, uint16_t flags, uint32_t vlen, const void *v,
                        size_t have, size_t pad)
{
    assert_true(b->n + TDP_HX_HDR_LEN + have + pad <= BUF_CAP);
    le(b->b + b->n, type, 2);
    le(b->b + b->n + 2, flags, 2);
    le(b->b + b->n + 4, vlen, 4);
    b->n += TDP_HX_HDR_LEN;
    if (have > 0)
        memcpy(b->b + b->n, v, have);
    b->n += have;
    memset(b->b + b->n, 0, pad);
    b->n += pad;
    b->bounds[b->nbounds++] = b->n;
}

static void put_rec(buf *b, uint16_t type, uint16_t flags, const void *v, size_t len)
{
    put_rec_raw(b, type, flags, (uint32_t)len, v, len, (8 - len % 8) % 8);
}

static tdp_err dec(const buf *b, tdp_hello *h)
{
    return tdp_wire_hello_decode(b->b, b->n, h);
}

typedef struct rec {
    uint16_t type;
    const void *v;
    size_t n;
} rec;

static const uint8_t addr_bytes[] = "a UCX worker address, 37 bytes long..";
static const uint8_t laddr_bytes[] = "shm worker addr";
static const uint8_t shm_key[TDP_SHM_KEY_LEN] = {1, 2,  3,  4,  5,  6,  7,  8,
                                                 9, 10, 11, 12, 13, 14, 15, 16};
static const char shm_name[] = "tdpipe-1234-shm";
static const uint8_t planes3[] = {TDP_PLANE_SHM, TDP_PLANE_UCX, TDP_PLANE_CUDA_IPC};

/* The SHM record value for shm_key and a name. */
static size_t shm_value(uint8_t *v, const char *name, size_t name_len)
{
    memcpy(v, shm_key, TDP_SHM_KEY_LEN);
    le(v + TDP_SHM_KEY_LEN, name_len, 2);
    memcpy(v + TDP_SHM_KEY_LEN + 2, name, name_len);
    return TDP_SHM_KEY_LEN + 2 + name_len;
}

static tdp_hello base_hello(void)
{
    tdp_hello h = {
        .recv_depth = 4,
        .peer_mode = TDP_PEER_SOCKET,
        .caps = TDP_CAP_MEM_HOST | TDP_CAP_MEM_CUDA,
        .max_msg_bytes = 1ull << 40,
        .token = 0xfeedface12345678ull,
        .flags = 0,
    };
    memset(h.host_id, 0x5a, sizeof(h.host_id));
    for (int i = 0; i < TDP_HELLO_NONCE_LEN; i++)
        h.nonce[i] = (uint8_t)(i * 7 + 1);
    return h;
}

/* A plane record put in as is (the encoder is to refuse a bad one). */
static void set_rec(tdp_hello *h, uint16_t type, const void *v, size_t n)
{
    assert_true(h->nrecs < TDP_HX_PLANE_RECS);
    h->recs[h->nrecs++] = (tdp_hx_rec){type, (uint32_t)n, v};
}

static const uint8_t *rec_val(const tdp_hello *h, uint16_t type)
{
    const tdp_hx_rec *r = tdp_hello_rec(h, type);
    return r != NULL ? r->val : NULL;
}

static uint32_t rec_len(const tdp_hello *h, uint16_t type)
{
    const tdp_hx_rec *r = tdp_hello_rec(h, type);
    return r != NULL ? r->len : 0;
}

#define REC_BYTES(h, t) rec_val((h), (t)), rec_len((h), (t))

static void assert_bytes(const void *got, uint32_t ngot, const void *want, uint32_t nwant)
{
    if (want == NULL) {
        assert_null(got);
        return;
    }
    assert_non_null(got);
    assert_int_equal(ngot, nwant);
    assert_memory_equal(got, want, nwant);
}

/* Encode h, check the header, decode the payload and compare every field. */
static void round_trip(const tdp_hello *h)
{
    size_t sz = tdp_wire_hello_size(h);
    assert_true(sz >= TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN);
    assert_int_equal(sz % 8, 0);
    uint8_t *out = malloc(sz);
    assert_non_null(out);
    assert_int_equal(tdp_wire_hello_encode(out, h), TDP_OK);
    tdp_ctl_hdr hdr;
    assert_int_equal(tdp_wire_ctl_hdr_decode(out, &hdr), TDP_OK);
    assert_int_equal(hdr.type, TDP_CTL_HELLO);
    assert_int_equal(hdr.version, TDP_PROTOCOL_VERSION);
    assert_int_equal(hdr.length, sz - TDP_CTL_HDR_LEN);
    tdp_hello g;
    memset(&g, 0xee, sizeof(g)); /* the decoder must clear what is absent */
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, hdr.length, &g), TDP_OK);
    assert_int_equal(g.recv_depth, h->recv_depth);
    assert_int_equal(g.peer_mode, h->peer_mode);
    assert_int_equal(g.caps, h->caps);
    assert_int_equal(g.max_msg_bytes, h->max_msg_bytes);
    assert_int_equal(g.token, h->token);
    assert_int_equal(g.flags, h->flags);
    assert_memory_equal(g.host_id, h->host_id, TDP_HOST_ID_LEN);
    assert_memory_equal(g.nonce, h->nonce, TDP_HELLO_NONCE_LEN);
    assert_bytes(g.planes, g.nplanes, h->planes, h->nplanes);
    assert_int_equal(g.nrecs, h->nrecs);
    for (uint16_t t = TDP_HX_UCX_ADDR; t <= TDP_HX_SHM; t++)
        assert_bytes(REC_BYTES(&g, t), REC_BYTES(h, t));
    assert_bytes(REC_BYTES(&g, TDP_HX_CUDA_IPC), REC_BYTES(h, TDP_HX_CUDA_IPC));
    for (uint16_t t = 0; t < 256; t++) /* every plane record, whoever adds one */
        if (tdp_wire_hx_is_plane(t))
            assert_bytes(REC_BYTES(&g, t), REC_BYTES(h, t));
    assert_int_equal(g.nskipped, 0);
    assert_int_equal(g.unknown_critical, 0);
    /* decoded pointers point into the input */
    const uint8_t *lo = out + TDP_CTL_HDR_LEN, *hi = out + sz;
    for (uint32_t i = 0; i < g.nrecs; i++)
        assert_true(g.recs[i].val >= lo && g.recs[i].val + g.recs[i].len <= hi);
    if (g.planes != NULL)
        assert_true(g.planes >= lo && g.planes + g.nplanes <= hi);
    free(out);
}

/* ---- round trips ------------------------------------------------------------ */

static void test_round_trip_each_record(void **state)
{
    (void)state;
    tdp_hello h = base_hello();
    round_trip(&h); /* no record at all */

    uint8_t sv[64];
    size_t svl = shm_value(sv, shm_name, strlen(shm_name));
    for (int which = 0; which < 16; which++) { /* every subset of the four records */
        h = base_hello();
        if (which & 1) {
            h.planes = planes3;
            h.nplanes = sizeof(planes3);
        }
        /* planes add theirs in any order: they go out in type order */
        if (which & 8)
            set_rec(&h, TDP_HX_SHM, sv, svl);
        if (which & 4)
            set_rec(&h, TDP_HX_UCX_LOCAL_ADDR, laddr_bytes, sizeof(laddr_bytes));
        if (which & 2)
            set_rec(&h, TDP_HX_UCX_ADDR, addr_bytes, sizeof(addr_bytes));
        round_trip(&h);
    }
    /* the cuda-ipc plane's record (the shm value, then two device UUIDs),
     * added first: it goes out after the others, whole */
    uint8_t cv[64 + 2 + 32];
    memcpy(cv, sv, svl);
    cv[svl] = 2;
    cv[svl + 1] = 1;
    memset(cv + svl + 2, 0x5a, 32);
    h = base_hello();
    set_rec(&h, TDP_HX_CUDA_IPC, cv, svl + 34);
    set_rec(&h, TDP_HX_SHM, sv, svl);
    round_trip(&h);
}

/*
 * Every plane record type, alone and all together (a one-byte value where
 * its plane defines none: wire.c frames plane records without reading
 * them): what the encoder counts it also writes, and the decoder keeps.
 */
static void test_round_trip_every_plane_record(void **state)
{
    (void)state;
    static const uint8_t v[4] = {1, 2, 3, 4};
    tdp_hello all = base_hello();
    unsigned n = 0;
    for (uint16_t t = 0; t < 256; t++) {
        if (!tdp_wire_hx_is_plane(t))
            continue;
        tdp_hello h = base_hello();
        set_rec(&h, t, v, 1 + t % 4);
        round_trip(&h);
        set_rec(&all, t, v, 1 + t % 4);
        n++;
    }
    assert_true(n >= 7); /* ucx (4), shm, cuda-ipc, tcp */
    round_trip(&all);
}

static void test_round_trip_bounds(void **state)
{
    (void)state;
    uint8_t *big = malloc(TDP_MAX_UCX_ADDR);
    assert_non_null(big);
    for (size_t i = 0; i < TDP_MAX_UCX_ADDR; i++)
        big[i] = (uint8_t)(i * 31 + 7);
    char name[TDP_SHM_NAME_MAX];
    memset(name, 'n', sizeof(name));
    name[0] = '\0'; /* any bytes: the abstract namespace has no terminator */
    uint8_t p16[TDP_MAX_PLANES];
    for (size_t i = 0; i < N(p16); i++)
        p16[i] = (uint8_t)(255 - i); /* ids this side does not know are fine */

    tdp_hello h = base_hello();
    h.recv_depth = 64;
    h.peer_mode = TDP_PEER_AUTO;
    h.flags = ~0ull; /* unknown flag bits travel and are ignored */
    h.caps = ~0ull;
    h.planes = p16;
    h.nplanes = TDP_MAX_PLANES;
    set_rec(&h, TDP_HX_UCX_ADDR, big, TDP_MAX_UCX_ADDR);
    set_rec(&h, TDP_HX_UCX_LOCAL_ADDR, big, TDP_MAX_UCX_ADDR);
    uint8_t sv[TDP_SHM_REC_MAX];
    tdp__shm_hello sh = {shm_key, name, TDP_SHM_NAME_MAX};
    assert_int_equal(tdp__shm_hello_put(&h, sv, &sh), TDP_OK);
    assert_true(tdp_wire_hello_size(&h) - TDP_CTL_HDR_LEN <= TDP_HELLO_MAX_LEN);
    round_trip(&h);

    /* value lengths around the padding: 1..17 bytes */
    for (uint32_t n = 1; n <= 17; n++) {
        h = base_hello();
        set_rec(&h, TDP_HX_UCX_ADDR, big, n);
        h.recv_depth = 1;
        round_trip(&h);
    }
    free(big);
}

static void test_encode_refuses_what_would_not_decode(void **state)
{
    (void)state;
    static const uint8_t zero_id[] = {TDP_PLANE_UCX, 0};
    static const uint8_t dup[] = {TDP_PLANE_UCX, TDP_PLANE_SHM, TDP_PLANE_UCX};
    uint8_t p17[TDP_MAX_PLANES + 1];
    for (size_t i = 0; i < N(p17); i++)
        p17[i] = (uint8_t)(i + 1);
    uint8_t out[512];

    tdp_hello cases[13];
    for (size_t i = 0; i < N(cases); i++)
        cases[i] = base_hello();
    cases[0].recv_depth = 0;
    cases[1].recv_depth = 65;
    cases[2].peer_mode = TDP_PEER_SOCKET + 1;
    cases[3].planes = p17;
    cases[3].nplanes = 0;
    cases[4].planes = p17;
    cases[4].nplanes = N(p17);
    cases[5].planes = zero_id;
    cases[5].nplanes = N(zero_id);
    cases[6].planes = dup;
    cases[6].nplanes = N(dup);
    set_rec(&cases[7], TDP_HX_UCX_ADDR, addr_bytes, 0);
    set_rec(&cases[8], TDP_HX_UCX_LOCAL_ADDR, addr_bytes, TDP_MAX_UCX_ADDR + 1);
    set_rec(&cases[9], TDP_HX_SHM, NULL, 20);        /* no value */
    set_rec(&cases[10], TDP_HX_AUTH, addr_bytes, 1); /* not a plane's record */
    set_rec(&cases[11], TDP_HX_UCX_ADDR, addr_bytes, 3);
    set_rec(&cases[11], TDP_HX_UCX_ADDR, addr_bytes, 4); /* twice */
    cases[12].nrecs = TDP_HX_PLANE_RECS + 1;
    for (size_t i = 0; i < N(cases); i++) {
        memset(out, 0x77, sizeof(out));
        assert_int_equal(tdp_wire_hello_size(&cases[i]), 0);
        assert_int_equal(tdp_wire_hello_encode(out, &cases[i]), TDP_EINVAL);
        assert_int_equal(out[0], 0x77); /* nothing written */
    }
}

/* The bytes at their documented offsets (docs/wire-format.md). */
static void test_hello_layout(void **state)
{
    (void)state;
    tdp_hello h = base_hello();
    static const uint8_t pl[] = {TDP_PLANE_UCX};
    static const uint8_t a[3] = {0xaa, 0xbb, 0xcc};
    h.planes = pl;
    h.nplanes = 1;
    uint8_t sv[TDP_SHM_REC_MAX];
    tdp__shm_hello sh = {shm_key, "ab", 2};
    assert_int_equal(tdp__shm_hello_put(&h, sv, &sh), TDP_OK); /* added first, goes out last */
    assert_int_equal(tdp_hello_add_rec(&h, TDP_HX_UCX_ADDR, a, 3), TDP_OK);
    uint8_t out[256];
    size_t sz = tdp_wire_hello_size(&h);
    /* fixed 72, PLANES 8+8, UCX_ADDR 8+8, SHM 8+24 (16+2+2 = 20 padded) */
    assert_int_equal(sz, TDP_CTL_HDR_LEN + 72 + 16 + 16 + 32);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    const uint8_t *p = out + TDP_CTL_HDR_LEN;
    static const uint8_t fixed_head[] = {
        4,    0,    0,    0,                            /* recv_depth */
        2,    0,    0,    0,                            /* peer_mode */
        3,    0,    0,    0,    0,    0,    0,    0,    /* caps */
        0,    0,    0,    0,    0,    1,    0,    0,    /* max_msg_bytes 2^40 */
        0x78, 0x56, 0x34, 0x12, 0xce, 0xfa, 0xed, 0xfe, /* token */
    };
    assert_memory_equal(p, fixed_head, sizeof(fixed_head));
    assert_memory_equal(p + 32, h.host_id, 16);
    static const uint8_t zero8[8] = {0};
    assert_memory_equal(p + 48, zero8, 8); /* flags */
    assert_memory_equal(p + 56, h.nonce, 16);
    static const uint8_t recs[] = {
        1, 0, 0, 0, 1,  0, 0, 0, 1,    0,    0,    0, 0, 0, 0, 0, /* PLANES {UCX} */
        2, 0, 0, 0, 3,  0, 0, 0, 0xaa, 0xbb, 0xcc, 0, 0, 0, 0, 0, /* UCX_ADDR */
        4, 0, 0, 0, 20, 0, 0, 0,                                  /* SHM header */
    };
    assert_memory_equal(p + 72, recs, sizeof(recs));
    assert_memory_equal(p + 72 + sizeof(recs), shm_key, 16);
    static const uint8_t shm_tail[] = {2, 0, 'a', 'b', 0, 0, 0, 0};
    assert_memory_equal(p + 72 + sizeof(recs) + 16, shm_tail, sizeof(shm_tail));
}

/* ---- extension records --------------------------------------------------------- */

static void test_unknown_noncritical_skipped(void **state)
{
    (void)state;
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, 0x7001, 0, "future", 6);
    put_rec(&b, TDP_HX_UCX_ADDR, 0, addr_bytes, sizeof(addr_bytes));
    put_rec(&b, 0x7001, 0xfffe, NULL, 0); /* again, empty, unknown flag bits */
    put_rec(&b, 0xffff, 0, "12345678", 8);
    tdp_hello h;
    assert_int_equal(dec(&b, &h), TDP_OK);
    assert_int_equal(h.nskipped, 3);
    assert_int_equal(h.unknown_critical, 0);
    assert_bytes(REC_BYTES(&h, TDP_HX_UCX_ADDR), addr_bytes, sizeof(addr_bytes));
    assert_null(h.planes);
    assert_null(tdp_hello_rec(&h, TDP_HX_UCX_LOCAL_ADDR));
    assert_null(tdp_hello_rec(&h, TDP_HX_SHM));
    buf_free(&b);
}

static void test_unknown_critical_refused(void **state)
{
    (void)state;
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_UCX_ADDR, 0, addr_bytes, sizeof(addr_bytes));
    put_rec(&b, 0x0100, TDP_HX_CRITICAL, "must understand", 15);
    put_rec(&b, 0x0101, TDP_HX_CRITICAL | 0x8000, NULL, 0);
    tdp_hello h;
    assert_int_equal(dec(&b, &h), TDP_EVERSION);
    assert_int_equal(h.unknown_critical, 0x0100); /* the first one */

    /* the rest is still checked: malformed wins over unknown */
    put_rec(&b, TDP_HX_UCX_ADDR, 0, addr_bytes, sizeof(addr_bytes));
    assert_int_equal(dec(&b, &h), TDP_EPROTO);

    /* a known record flagged critical is simply understood */
    buf_free(&b);
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_PLANES, TDP_HX_CRITICAL, planes3, sizeof(planes3));
    put_rec(&b, TDP_HX_UCX_ADDR, TDP_HX_CRITICAL, addr_bytes, sizeof(addr_bytes));
    assert_int_equal(dec(&b, &h), TDP_OK);
    assert_bytes(h.planes, h.nplanes, planes3, sizeof(planes3));
    buf_free(&b);
}

/* WANT_DEPTH: a plain (skippable) record; 1..64, 4 bytes, once. */
static void test_want_depth_record(void **state)
{
    (void)state;
    tdp_hello h = {.recv_depth = 2, .want_depth = 8}, g;
    size_t n = tdp_wire_hello_size(&h);
    assert_true(n > 0);
    uint8_t *out = malloc(n);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g),
                     TDP_OK);
    assert_int_equal(g.want_depth, 8);
    /* not critical: a peer that does not know it skips it */
    const uint8_t *r = out + TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN;
    assert_int_equal(r[0] | r[1] << 8, TDP_HX_WANT_DEPTH);
    assert_false((r[2] | r[3] << 8) & TDP_HX_CRITICAL);
    free(out);
    h.want_depth = TDP_HX_MAX_DEPTH + 1;
    assert_int_equal(tdp_wire_hello_size(&h), 0);
    const uint32_t bad[] = {0, TDP_HX_MAX_DEPTH + 1};
    for (size_t i = 0; i < 2; i++) {
        buf b;
        buf_init(&b);
        put_fixed(&b, 2, 0, 0);
        uint8_t v[4] = {(uint8_t)bad[i], (uint8_t)(bad[i] >> 8), 0, 0};
        put_rec(&b, TDP_HX_WANT_DEPTH, 0, v, 4);
        assert_int_equal(dec(&b, &g), TDP_EPROTO);
        buf_free(&b);
    }
    /* another size, or twice */
    const uint8_t v8[8] = {4}, v4[4] = {4};
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_WANT_DEPTH, 0, v8, 8);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    buf_free(&b);
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_WANT_DEPTH, 0, v4, 4);
    assert_int_equal(dec(&b, &g), TDP_OK);
    assert_int_equal(g.want_depth, 4);
    put_rec(&b, TDP_HX_WANT_DEPTH, 0, v4, 4);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    buf_free(&b);
}

/* WINDOW: a plain (skippable) record; 8 bytes, TDP_HX_WINDOW_MIN..MAX, once. */
static void test_window_record(void **state)
{
    (void)state;
    tdp_hello h = {.recv_depth = 4, .window = 256u << 10}, g;
    size_t n = tdp_wire_hello_size(&h);
    assert_true(n > 0);
    uint8_t *out = malloc(n);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g), TDP_OK);
    assert_int_equal(g.window, 256u << 10);
    const uint8_t *r = out + TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN;
    assert_int_equal(r[0] | r[1] << 8, TDP_HX_WINDOW);
    assert_false((r[2] | r[3] << 8) & TDP_HX_CRITICAL);
    free(out);
    h.window = TDP_HX_WINDOW_MIN - 1;
    assert_int_equal(tdp_wire_hello_size(&h), 0);
    h.window = TDP_HX_WINDOW_MAX + 1;
    assert_int_equal(tdp_wire_hello_size(&h), 0);
    const uint64_t bad[] = {0, TDP_HX_WINDOW_MIN - 1, TDP_HX_WINDOW_MAX + 1};
    for (size_t i = 0; i < 3; i++) {
        buf b;
        buf_init(&b);
        put_fixed(&b, 2, 0, 0);
        uint8_t v[8];
        for (int k = 0; k < 8; k++)
            v[k] = (uint8_t)(bad[i] >> (8 * k));
        put_rec(&b, TDP_HX_WINDOW, 0, v, 8);
        assert_int_equal(dec(&b, &g), TDP_EPROTO);
        buf_free(&b);
    }
    const uint8_t v8[8] = {0, 0x10}, v4[4] = {0, 0x10}; /* 4096 */
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_WINDOW, 0, v4, 4);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    buf_free(&b);
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_WINDOW, 0, v8, 8);
    assert_int_equal(dec(&b, &g), TDP_OK);
    assert_int_equal(g.window, 4096);
    put_rec(&b, TDP_HX_WINDOW, 0, v8, 8);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    buf_free(&b);
}

/* TDP_HX_CHECKSUM: one byte, not 0, not twice, not critical; the AM sum field. */
static void test_checksum_record(void **state)
{
    (void)state;
    tdp_hello h = {.recv_depth = 1, .checksum = TDP_SUM_XXH3_64}, g;
    size_t n = tdp_wire_hello_size(&h);
    assert_true(n > 0);
    uint8_t *out = malloc(n);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g), TDP_OK);
    assert_int_equal(g.checksum, TDP_SUM_XXH3_64);
    const uint8_t *r = out + TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN;
    assert_int_equal(r[0] | r[1] << 8, TDP_HX_CHECKSUM);
    assert_false((r[2] | r[3] << 8) & TDP_HX_CRITICAL); /* older peers skip it */
    free(out);
    h.checksum = 0; /* not offered: no record */
    assert_int_equal(tdp_wire_hello_size(&h), TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN);

    const uint8_t zero[1] = {0}, two[2] = {1, 0}, one[1] = {1}, other[1] = {9};
    const struct {
        const uint8_t *v;
        uint32_t n;
        tdp_err want;
    } cases[] = {{zero, 1, TDP_EPROTO},
                 {two, 2, TDP_EPROTO},
                 {NULL, 0, TDP_EPROTO},
                 {one, 1, TDP_OK},
                 {other, 1, TDP_OK}};
    for (size_t i = 0; i < N(cases); i++) {
        buf b;
        buf_init(&b);
        put_fixed(&b, 2, 0, 0);
        put_rec(&b, TDP_HX_CHECKSUM, 0, cases[i].v, cases[i].n);
        assert_int_equal(dec(&b, &g), cases[i].want);
        if (cases[i].want == TDP_OK) {
            assert_int_equal(g.checksum,
                             cases[i].v[0]); /* an unknown algorithm: the session says no */
            put_rec(&b, TDP_HX_CHECKSUM, 0, one, 1);
            assert_int_equal(dec(&b, &g), TDP_EPROTO); /* twice */
        }
        buf_free(&b);
    }

    /* a DATA header with the sum: 56 bytes, the sum after the 48 */
    tdp_am_hdr am = {.type = TDP_AM_DATA,
                     .flags = TDP_AM_F_SUM,
                     .token = 5,
                     .seq = 1,
                     .hash = 7,
                     .length = 1024,
                     .arg = 3,
                     .sum = 0x1122334455667788ull};
    uint8_t ab[TDP_AM_HDR_MAX_LEN];
    assert_int_equal(tdp_wire_am_encode(ab, &am), TDP_AM_HDR_SUM_LEN);
    assert_int_equal(ab[6], TDP_AM_F_SUM);
    assert_int_equal(ab[48], 0x88);
    assert_int_equal(ab[55], 0x11);
    tdp_am_hdr ga;
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_SUM_LEN, &ga), TDP_OK);
    assert_int_equal(ga.sum, am.sum);
    assert_int_equal(ga.flags, TDP_AM_F_SUM);
    /* the flag without the field, the field without the flag */
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &ga), TDP_EPROTO);
    am.flags = 0;
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_SUM_LEN, &ga), TDP_EPROTO);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &ga), TDP_OK);
    assert_int_equal(ga.sum, 0);
    /* only DATA carries a sum */
    const uint8_t types[] = {TDP_AM_SCHEMA, TDP_AM_CREDIT};
    for (size_t i = 0; i < N(types); i++) {
        tdp_am_hdr x = {.type = types[i], .flags = TDP_AM_F_SUM, .length = 0};
        assert_int_equal(tdp_wire_am_encode(ab, &x), TDP_AM_HDR_SUM_LEN);
        assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_SUM_LEN, &ga), TDP_EPROTO);
    }
}

/*
 * TDP_HX_PROVEN in HELLO (non-critical: older peers skip it and never see
 * a PROVEN frame), and the PROVEN frame: plane records only, each type not
 * already in the HELLO it is added to, framed and padded as in HELLO.
 */
static void test_proven(void **state)
{
    (void)state;
    tdp_hello h = {.recv_depth = 1, .auth = TDP_AUTH_HMAC_SHA256, .proven = TDP_PROVEN_V1}, g;
    size_t n = tdp_wire_hello_size(&h);
    uint8_t *out = malloc(n);
    assert_non_null(out);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g), TDP_OK);
    assert_int_equal(g.proven, TDP_PROVEN_V1);
    const uint8_t *r = out + n - TDP_HX_HDR_LEN - 8; /* the last record */
    assert_int_equal(r[0] | r[1] << 8, TDP_HX_PROVEN);
    assert_false((r[2] | r[3] << 8) & TDP_HX_CRITICAL);
    free(out);
    const uint8_t zero[1] = {0}, two[2] = {1, 0}, later[1] = {7};
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_PROVEN, 0, zero, 1);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_PROVEN, 0, two, 2);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_PROVEN, 0, later, 1);
    assert_int_equal(dec(&b, &g), TDP_OK); /* a later version: not spoken, not refused */
    assert_int_equal(g.proven, 7);
    put_rec(&b, TDP_HX_PROVEN, 0, later, 1);
    assert_int_equal(dec(&b, &g), TDP_EPROTO); /* twice */
    buf_free(&b);

    /* a PROVEN frame round trip, added to a HELLO that has the general address */
    tdp_hello p = {0};
    assert_int_equal(tdp_hello_add_rec(&p, TDP_HX_UCX_LOCAL_ADDR, laddr_bytes, sizeof(laddr_bytes)),
                     TDP_OK);
    n = tdp_wire_proven_size(&p);
    assert_int_equal(n, TDP_CTL_HDR_LEN + TDP_HX_HDR_LEN + 16);
    out = malloc(n);
    assert_non_null(out);
    assert_int_equal(tdp_wire_proven_encode(out, &p), TDP_OK);
    tdp_ctl_hdr ch;
    assert_int_equal(tdp_wire_ctl_hdr_decode(out, &ch), TDP_OK);
    assert_int_equal(ch.type, TDP_CTL_PROVEN);
    assert_int_equal(ch.length, n - TDP_CTL_HDR_LEN);
    tdp_hello base = {.recv_depth = 1};
    assert_int_equal(tdp_hello_add_rec(&base, TDP_HX_UCX_ADDR, addr_bytes, sizeof(addr_bytes)),
                     TDP_OK);
    g = base;
    assert_int_equal(tdp_wire_proven_decode(out + TDP_CTL_HDR_LEN, ch.length, &g), TDP_OK);
    const tdp_hx_rec *lr = tdp_hello_rec(&g, TDP_HX_UCX_LOCAL_ADDR);
    assert_non_null(lr);
    assert_int_equal(lr->len, sizeof(laddr_bytes));
    assert_memory_equal(lr->val, laddr_bytes, sizeof(laddr_bytes));
    assert_non_null(tdp_hello_rec(&g, TDP_HX_UCX_ADDR));
    /* the same type twice (the HELLO has it already): refused */
    g = base;
    assert_int_equal(tdp_wire_proven_decode(out + TDP_CTL_HDR_LEN, ch.length, &g), TDP_OK);
    assert_int_equal(tdp_wire_proven_decode(out + TDP_CTL_HDR_LEN, ch.length, &g), TDP_EPROTO);
    /* every cut of it is malformed; the empty one is fine */
    for (size_t cut = 1; cut < ch.length; cut++) {
        g = base;
        assert_int_equal(tdp_wire_proven_decode(out + TDP_CTL_HDR_LEN, cut, &g), TDP_EPROTO);
    }
    g = base;
    assert_int_equal(tdp_wire_proven_decode(out, 0, &g), TDP_OK);
    free(out);
    p.nrecs = 0; /* nothing to say: an empty frame */
    assert_int_equal(tdp_wire_proven_size(&p), TDP_CTL_HDR_LEN);

    /* what belongs in HELLO is refused; unknown records as in HELLO */
    const uint8_t one[1] = {1}, d4[4] = {2, 0, 0, 0}, junk[3] = {1, 2, 3};
    const uint8_t w8[8] = {0, 0, 1, 0, 0, 0, 0, 0}, r8[8] = {5, 0, 0, 0, 0, 0, 0, 0};
    const struct {
        uint16_t type, flags;
        const uint8_t *v;
        size_t n;
        tdp_err want;
    } cases[] = {
        {TDP_HX_PLANES, 0, one, 1, TDP_EPROTO},
        {TDP_HX_AUTH, TDP_HX_CRITICAL, one, 1, TDP_EPROTO},
        {TDP_HX_WANT_DEPTH, 0, d4, 4, TDP_EPROTO},
        {TDP_HX_CHECKSUM, 0, one, 1, TDP_EPROTO},
        {TDP_HX_PROVEN, 0, one, 1, TDP_EPROTO},
        {TDP_HX_READY, 0, one, 1, TDP_EPROTO},
        {TDP_HX_WINDOW, 0, w8, 8, TDP_EPROTO}, /* flow control: the proofs cover it in HELLO */
        {TDP_HX_RESUME, TDP_HX_CRITICAL, r8, 8, TDP_EPROTO},
        {0, 0, one, 1, TDP_EPROTO},
        {TDP_HX_UCX_LOCAL_ADDR, 0, NULL, 0, TDP_EPROTO}, /* an empty plane record */
        {4000, 0, junk, 3, TDP_OK},                      /* unknown: skipped */
        {4000, TDP_HX_CRITICAL, junk, 3, TDP_EVERSION},  /* unknown, critical */
    };
    for (size_t i = 0; i < N(cases); i++) {
        buf_init(&b);
        put_rec(&b, cases[i].type, cases[i].flags, cases[i].v, cases[i].n);
        g = base;
        assert_int_equal(tdp_wire_proven_decode(b.b, b.n, &g), cases[i].want);
        buf_free(&b);
    }
    /* non-zero padding */
    buf_init(&b);
    put_rec_raw(&b, TDP_HX_UCX_LOCAL_ADDR, 0, 3, junk, 3, 5);
    b.b[b.n - 1] = 1;
    g = base;
    assert_int_equal(tdp_wire_proven_decode(b.b, b.n, &g), TDP_EPROTO);
    buf_free(&b);
    /* the control header bounds its length */
    uint8_t hb[TDP_CTL_HDR_LEN];
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_PROVEN, 0);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &ch), TDP_OK);
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_PROVEN, TDP_PROVEN_MAX_LEN);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &ch), TDP_OK);
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_PROVEN, TDP_PROVEN_MAX_LEN + 1);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &ch), TDP_EPROTO);
}

static void test_records_any_order(void **state)
{
    (void)state;
    buf b;
    buf_init(&b);
    uint8_t v[64];
    size_t vl = shm_value(v, shm_name, strlen(shm_name));
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_SHM, 0, v, vl);
    put_rec(&b, TDP_HX_UCX_LOCAL_ADDR, 0, laddr_bytes, sizeof(laddr_bytes));
    put_rec(&b, TDP_HX_UCX_ADDR, 0, addr_bytes, sizeof(addr_bytes));
    put_rec(&b, TDP_HX_PLANES, 0, planes3, sizeof(planes3));
    tdp_hello h;
    assert_int_equal(dec(&b, &h), TDP_OK);
    assert_bytes(h.planes, h.nplanes, planes3, sizeof(planes3));
    assert_bytes(REC_BYTES(&h, TDP_HX_UCX_ADDR), addr_bytes, sizeof(addr_bytes));
    assert_bytes(REC_BYTES(&h, TDP_HX_UCX_LOCAL_ADDR), laddr_bytes, sizeof(laddr_bytes));
    tdp__shm_hello sh;
    assert_int_equal(tdp__shm_hello_get(&h, &sh), TDP_OK);
    assert_memory_equal(sh.key, shm_key, TDP_SHM_KEY_LEN);
    assert_bytes(sh.name, sh.name_len, shm_name, (uint32_t)strlen(shm_name));
    buf_free(&b);
}

/* AUTH and RESUME: round trip, flagged critical, values checked; the AUTH frame's size. */
static void test_auth_and_resume_records(void **state)
{
    (void)state;
    tdp_hello h = {.recv_depth = 4, .auth = TDP_AUTH_HMAC_SHA256, .resume = 5}, g;
    size_t n = tdp_wire_hello_size(&h);
    assert_true(n > 0);
    uint8_t *out = malloc(n);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g),
                     TDP_OK);
    assert_int_equal(g.auth, TDP_AUTH_HMAC_SHA256);
    assert_int_equal(g.resume, 5);
    /* both critical: a peer that does not know them refuses, never skips */
    const uint8_t *r = out + TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN;
    for (int i = 0; i < 2; i++) {
        uint16_t flags = (uint16_t)(r[2] | r[3] << 8);
        uint32_t vlen = (uint32_t)(r[4] | r[5] << 8 | r[6] << 16 | (uint32_t)r[7] << 24);
        assert_true(flags & TDP_HX_CRITICAL);
        r += TDP_HX_HDR_LEN + ((vlen + 7) & ~7u);
    }
    free(out);
    /* resume 1 (a fresh stream needs none) and past the bound are refused */
    h.resume = 1;
    assert_int_equal(tdp_wire_hello_size(&h), 0);
    const uint64_t bad[] = {0, 1, TDP_RESUME_MAX + 1};
    for (size_t i = 0; i < 3; i++) {
        buf b;
        buf_init(&b);
        put_fixed(&b, 2, 0, 0);
        uint8_t v[8];
        for (int k = 0; k < 8; k++)
            v[k] = (uint8_t)(bad[i] >> (8 * k));
        put_rec(&b, TDP_HX_RESUME, TDP_HX_CRITICAL, v, 8);
        assert_int_equal(dec(&b, &g), TDP_EPROTO);
        buf_free(&b);
    }
    /* an AUTH record of another size, or method 0 */
    const uint8_t two[2] = {1, 1}, zero[1] = {0};
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_AUTH, TDP_HX_CRITICAL, two, 2);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    buf_free(&b);
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_AUTH, TDP_HX_CRITICAL, zero, 1);
    assert_int_equal(dec(&b, &g), TDP_EPROTO);
    buf_free(&b);
    /* the AUTH frame is exactly a 32-byte tag */
    uint8_t tag[TDP_AUTH_TAG_LEN] = {7}, fr[TDP_CTL_HDR_LEN + TDP_AUTH_TAG_LEN];
    tdp_wire_auth_encode(fr, tag);
    tdp_ctl_hdr hdr;
    assert_int_equal(tdp_wire_ctl_hdr_decode(fr, &hdr), TDP_OK);
    assert_int_equal(hdr.type, TDP_CTL_AUTH);
    assert_memory_equal(fr + TDP_CTL_HDR_LEN, tag, TDP_AUTH_TAG_LEN);
    tdp_wire_ctl_hdr_encode(fr, TDP_CTL_AUTH, TDP_AUTH_TAG_LEN - 1);
    assert_int_equal(tdp_wire_ctl_hdr_decode(fr, &hdr), TDP_EPROTO);
}

static void test_duplicate_known_record(void **state)
{
    (void)state;
    uint8_t v[64];
    size_t vl = shm_value(v, shm_name, strlen(shm_name));
    const rec recs[] = {
        {TDP_HX_PLANES, planes3, sizeof(planes3)},
        {TDP_HX_UCX_ADDR, addr_bytes, sizeof(addr_bytes)},
        {TDP_HX_UCX_LOCAL_ADDR, laddr_bytes, sizeof(laddr_bytes)},
        {TDP_HX_SHM, v, vl},
    };
    for (size_t i = 0; i < N(recs); i++) {
        buf b;
        buf_init(&b);
        tdp_hello h;
        put_fixed(&b, 2, 0, 0);
        put_rec(&b, recs[i].type, 0, recs[i].v, recs[i].n);
        assert_int_equal(dec(&b, &h), TDP_OK);
        put_rec(&b, 0x6000, 0, "x", 1); /* not adjacent */
        put_rec(&b, recs[i].type, 0, recs[i].v, recs[i].n);
        assert_int_equal(dec(&b, &h), TDP_EPROTO);
        buf_free(&b);
    }
}

/*
 * Every prefix of a valid HELLO: a prefix that ends on a record boundary is
 * a valid HELLO with fewer records, anything else is malformed.
 */
static void test_truncated_every_prefix(void **state)
{
    (void)state;
    buf b;
    buf_init(&b);
    uint8_t v[64];
    size_t vl = shm_value(v, shm_name, strlen(shm_name));
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_PLANES, 0, planes3, sizeof(planes3));
    put_rec(&b, TDP_HX_UCX_ADDR, 0, addr_bytes, sizeof(addr_bytes));
    put_rec(&b, 0x4242, 0, "skip me", 7);
    put_rec(&b, TDP_HX_UCX_LOCAL_ADDR, 0, laddr_bytes, sizeof(laddr_bytes));
    put_rec(&b, TDP_HX_SHM, 0, v, vl);
    put_rec(&b, 0x4243, 0, NULL, 0);
    for (size_t k = 0; k <= b.n; k++) {
        tdp_hello h;
        tdp_err rc = tdp_wire_hello_decode(b.b, k, &h);
        bool boundary = k == TDP_HELLO_FIXED_LEN;
        size_t nrec = 0;
        for (size_t i = 0; i < b.nbounds; i++) {
            if (b.bounds[i] == k) {
                boundary = true;
                nrec = i + 1;
            }
        }
        if (!boundary) {
            assert_int_equal(rc, TDP_EPROTO);
            continue;
        }
        assert_int_equal(rc, TDP_OK);
        assert_int_equal(h.planes != NULL, nrec >= 1);
        assert_int_equal(tdp_hello_rec(&h, TDP_HX_UCX_ADDR) != NULL, nrec >= 2);
        assert_int_equal(h.nskipped, (nrec >= 3) + (nrec >= 6));
        assert_int_equal(tdp_hello_rec(&h, TDP_HX_UCX_LOCAL_ADDR) != NULL, nrec >= 4);
        assert_int_equal(tdp_hello_rec(&h, TDP_HX_SHM) != NULL, nrec >= 5);
    }
    buf_free(&b);
}

/* Record lengths that run past the payload, including ones that wrap. */
static void test_record_length_overflow(void **state)
{
    (void)state;
    static const uint32_t lens[] = {
        0xffffffffu, 0xfffffff9u,       0xfffffff8u,
        0x80000000u, TDP_HELLO_MAX_LEN, 17, /* one more than what follows */
    };
    for (size_t i = 0; i < N(lens); i++) {
        for (int known = 0; known < 2; known++) {
            buf b;
            buf_init(&b);
            put_fixed(&b, 2, 0, 0);
            put_rec_raw(&b, known ? TDP_HX_UCX_ADDR : 0x5555, 0, lens[i], "0123456789abcdef", 16,
                        0);
            tdp_hello h;
            assert_int_equal(dec(&b, &h), TDP_EPROTO);
            buf_free(&b);
        }
    }
    /* value fits but its padding does not */
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec_raw(&b, 0x5555, 0, 5, "abcde", 5, 2);
    tdp_hello h;
    assert_int_equal(dec(&b, &h), TDP_EPROTO);
    b.b[b.n++] = 0;
    assert_int_equal(dec(&b, &h), TDP_OK);
    /* a trailing partial record header */
    for (int extra = 1; extra < (int)TDP_HX_HDR_LEN; extra++) {
        memset(b.b + b.n, 0, (size_t)extra);
        assert_int_equal(tdp_wire_hello_decode(b.b, b.n + (size_t)extra, &h), TDP_EPROTO);
    }
    buf_free(&b);
}

static void test_padding(void **state)
{
    (void)state;
    for (size_t len = 0; len <= 16; len++) {
        uint8_t v[16];
        memset(v, 0x11, sizeof(v));
        buf b;
        buf_init(&b);
        put_fixed(&b, 2, 0, 0);
        put_rec(&b, 0x5000, 0, v, len);
        size_t pad = (8 - len % 8) % 8;
        assert_int_equal(b.n % 8, 0);
        tdp_hello h;
        assert_int_equal(dec(&b, &h), TDP_OK);
        /* every padding byte must be zero */
        for (size_t i = 0; i < pad; i++) {
            b.b[b.n - 1 - i] = 0x01;
            assert_int_equal(dec(&b, &h), TDP_EPROTO);
            b.b[b.n - 1 - i] = 0;
        }
        /* an unpadded record is malformed, unless no padding was due */
        if (pad > 0)
            assert_int_equal(tdp_wire_hello_decode(b.b, b.n - pad, &h), TDP_EPROTO);
        buf_free(&b);
    }
}

static void test_record_count_limit(void **state)
{
    (void)state;
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    put_rec(&b, TDP_HX_UCX_ADDR, 0, addr_bytes, sizeof(addr_bytes));
    for (unsigned i = 1; i < TDP_HX_MAX_RECORDS; i++)
        put_rec(&b, (uint16_t)(0x1000 + i), 0, NULL, 0);
    tdp_hello h;
    assert_int_equal(dec(&b, &h), TDP_OK);
    assert_int_equal(h.nskipped, TDP_HX_MAX_RECORDS - 1);
    put_rec(&b, 0x2000, 0, NULL, 0); /* the 65th */
    assert_int_equal(dec(&b, &h), TDP_EPROTO);
    buf_free(&b);
}

static void test_malformed_known_records(void **state)
{
    (void)state;
    uint8_t v[256];
    uint8_t big[TDP_MAX_UCX_ADDR + 1];
    memset(big, 0x42, sizeof(big));
    rec bad[16];
    size_t nb = 0;
    static const uint8_t p_zero[] = {1, 0};
    static const uint8_t p_dup[] = {1, 2, 3, 2};
    uint8_t p17[17];
    for (int i = 0; i < 17; i++)
        p17[i] = (uint8_t)(i + 1);
    bad[nb++] = (rec){TDP_HX_PLANES, NULL, 0};
    bad[nb++] = (rec){TDP_HX_PLANES, p17, 17};
    bad[nb++] = (rec){TDP_HX_PLANES, p_zero, sizeof(p_zero)};
    bad[nb++] = (rec){TDP_HX_PLANES, p_dup, sizeof(p_dup)};
    bad[nb++] = (rec){TDP_HX_UCX_ADDR, NULL, 0};
    bad[nb++] = (rec){TDP_HX_UCX_ADDR, big, sizeof(big)};
    bad[nb++] = (rec){TDP_HX_UCX_LOCAL_ADDR, NULL, 0};
    bad[nb++] = (rec){TDP_HX_UCX_LOCAL_ADDR, big, sizeof(big)};
    bad[nb++] = (rec){0, "type zero", 9};
    for (size_t i = 0; i < nb; i++) {
        buf b;
        buf_init(&b);
        put_fixed(&b, 2, 0, 0);
        put_rec(&b, bad[i].type, 0, bad[i].v, bad[i].n);
        tdp_hello h;
        assert_int_equal(dec(&b, &h), TDP_EPROTO);
        buf_free(&b);
    }

    /* SHM: name length 0 and 108, length fields that disagree, too short
     * (wire.c frames the record; the shm plane reads it) */
    char name[TDP_SHM_NAME_MAX + 1];
    memset(name, 's', sizeof(name));
    struct {
        size_t name_len;
        long vlen_delta;
        tdp_err want;
    } shm[] = {
        {1, 0, TDP_OK},       {TDP_SHM_NAME_MAX, 0, TDP_OK},
        {0, 0, TDP_EPROTO},   {TDP_SHM_NAME_MAX + 1, 0, TDP_EPROTO},
        {5, 1, TDP_EPROTO},   /* a byte more than the name */
        {5, -1, TDP_EPROTO},  /* a byte less */
        {5, -6, TDP_EPROTO},  /* no name */
        {5, -7, TDP_EPROTO},  /* not even name_len */
        {5, -23, TDP_EPROTO}, /* empty */
    };
    for (size_t i = 0; i < N(shm); i++) {
        size_t vl = shm_value(v, name, shm[i].name_len);
        vl = (size_t)((long)vl + shm[i].vlen_delta);
        buf b;
        buf_init(&b);
        put_fixed(&b, 2, 0, 0);
        put_rec(&b, TDP_HX_SHM, 0, v, vl);
        tdp_hello h;
        tdp__shm_hello sh;
        tdp_err rc = dec(&b, &h);
        if (rc == TDP_OK)
            rc = tdp__shm_hello_get(&h, &sh);
        assert_int_equal(rc, shm[i].want);
        buf_free(&b);
    }
}

static void test_fixed_part(void **state)
{
    (void)state;
    struct {
        uint32_t depth, mode;
        uint64_t flags;
        tdp_err want;
    } cases[] = {
        {1, TDP_PEER_AUTO, 0, TDP_OK},
        {64, TDP_PEER_SOCKET, 0, TDP_OK},
        {8, TDP_PEER_UCX, ~0ull, TDP_OK}, /* unknown flag bits ignored */
        {0, 0, 0, TDP_EPROTO},
        {65, 0, 0, TDP_EPROTO},
        {1, TDP_PEER_SOCKET + 1, 0, TDP_EPROTO},
    };
    for (size_t i = 0; i < N(cases); i++) {
        buf b;
        buf_init(&b);
        put_fixed(&b, cases[i].depth, cases[i].mode, cases[i].flags);
        tdp_hello h;
        assert_int_equal(dec(&b, &h), cases[i].want);
        if (cases[i].want == TDP_OK)
            assert_int_equal(h.flags, cases[i].flags);
        /* shorter than the fixed part */
        for (size_t k = 0; k < TDP_HELLO_FIXED_LEN; k++)
            assert_int_equal(tdp_wire_hello_decode(b.b, k, &h), TDP_EPROTO);
        buf_free(&b);
    }

    /* the length cap holds even for records this side would skip */
    buf b;
    buf_init(&b);
    put_fixed(&b, 2, 0, 0);
    size_t fill = TDP_HELLO_MAX_LEN - TDP_HELLO_FIXED_LEN - TDP_HX_HDR_LEN;
    put_rec_raw(&b, 0x5151, 0, (uint32_t)fill, NULL, 0, fill);
    tdp_hello h;
    assert_int_equal(b.n, TDP_HELLO_MAX_LEN);
    assert_int_equal(dec(&b, &h), TDP_OK);
    b.n += 8;
    le(b.b + TDP_HELLO_FIXED_LEN + 4, fill + 8, 4);
    assert_int_equal(dec(&b, &h), TDP_EPROTO);
    buf_free(&b);
}

/* ---- negotiation ----------------------------------------------------------------- */

/* The rule written out the slow way, for comparison. */
static int choose_ref(const uint8_t *a, size_t na, const uint8_t *b, size_t nb, uint64_t allowed)
{
    int best = 0;
    size_t best_sum = SIZE_MAX;
    for (int id = 1; id < 64; id++) {
        if ((allowed & TDP_PLANE_BIT(id)) == 0)
            continue;
        const uint8_t *pa = memchr(a, id, na), *pb = memchr(b, id, nb);
        if (na == 0 || nb == 0 || pa == NULL || pb == NULL)
            continue;
        size_t sum = (size_t)(pa - a) + (size_t)(pb - b);
        if (sum < best_sum) { /* ids ascend: the first at a sum is the smallest */
            best = id;
            best_sum = sum;
        }
    }
    return best;
}

/* Every list of distinct ids from 1..5 (and 70, unknown) up to 4 long. */
#define MAXL 4
typedef struct lists {
    uint8_t l[2000][MAXL];
    size_t n[2000];
    size_t count;
} lists;

static void gen(lists *ls, uint8_t *cur, size_t len)
{
    memcpy(ls->l[ls->count], cur, len);
    ls->n[ls->count++] = len;
    if (len == MAXL)
        return;
    static const uint8_t ids[] = {1, 2, 3, 4, 5, 70};
    for (size_t i = 0; i < N(ids); i++) {
        if (memchr(cur, ids[i], len) != NULL)
            continue;
        cur[len] = ids[i];
        gen(ls, cur, len + 1);
    }
}

static void test_choose_symmetric_exhaustive(void **state)
{
    (void)state;
    lists *ls = calloc(1, sizeof(*ls));
    assert_non_null(ls);
    uint8_t cur[MAXL];
    gen(ls, cur, 0);
    assert_int_equal(ls->count, 1 + 6 + 30 + 120 + 360);
    static const uint64_t masks[] = {
        ~0ull,
        TDP_PLANE_BIT(TDP_PLANE_UCX),
        TDP_PLANE_BIT(2) | TDP_PLANE_BIT(4) | TDP_PLANE_BIT(5),
        0,
    };
    unsigned none = 0;
    for (size_t i = 0; i < ls->count; i++) {
        for (size_t j = 0; j < ls->count; j++) {
            for (size_t m = 0; m < N(masks); m++) {
                int x = tdp_wire_plane_choose(ls->l[i], ls->n[i], ls->l[j], ls->n[j], masks[m]);
                int y = tdp_wire_plane_choose(ls->l[j], ls->n[j], ls->l[i], ls->n[i], masks[m]);
                if (x != y || x != choose_ref(ls->l[i], ls->n[i], ls->l[j], ls->n[j], masks[m]))
                    fail_msg("lists %zu/%zu mask %zu: %d, %d", i, j, m, x, y);
                if (x == 0) {
                    none++;
                    continue;
                }
                assert_non_null(memchr(ls->l[i], x, ls->n[i]));
                assert_non_null(memchr(ls->l[j], x, ls->n[j]));
            }
        }
    }
    assert_true(none > 0);
    free(ls);
}

static void test_choose_examples(void **state)
{
    (void)state;
    const uint64_t all = ~0ull;
    static const uint8_t ucx[] = {TDP_PLANE_UCX};
    static const uint8_t shm_ucx[] = {TDP_PLANE_SHM, TDP_PLANE_UCX};
    static const uint8_t ucx_shm[] = {TDP_PLANE_UCX, TDP_PLANE_SHM};
    static const uint8_t ipc_shm_ucx[] = {TDP_PLANE_CUDA_IPC, TDP_PLANE_SHM, TDP_PLANE_UCX};
    static const uint8_t staged[] = {TDP_PLANE_CUDA_STAGED};
    static const uint8_t unknown[] = {200, 63, TDP_PLANE_UCX};

    assert_int_equal(tdp_wire_plane_choose(shm_ucx, 2, ucx, 1, all), TDP_PLANE_UCX);
    assert_int_equal(tdp_wire_plane_choose(shm_ucx, 2, shm_ucx, 2, all), TDP_PLANE_SHM);
    /* opposite preferences: a tie on the rank sum, the smaller id wins */
    assert_int_equal(tdp_wire_plane_choose(shm_ucx, 2, ucx_shm, 2, all), TDP_PLANE_UCX);
    /* SHM 1 + 1 ties UCX 2 + 0: UCX, the smaller id; CUDA_IPC is not common */
    assert_int_equal(tdp_wire_plane_choose(ipc_shm_ucx, 3, ucx_shm, 2, all), TDP_PLANE_UCX);
    assert_int_equal(tdp_wire_plane_choose(ipc_shm_ucx, 3, shm_ucx, 2, all), TDP_PLANE_SHM);
    /* allowed rules a plane out for both */
    assert_int_equal(tdp_wire_plane_choose(shm_ucx, 2, shm_ucx, 2, ~TDP_PLANE_BIT(TDP_PLANE_SHM)),
                     TDP_PLANE_UCX);
    /* nothing in common */
    assert_int_equal(tdp_wire_plane_choose(staged, 1, shm_ucx, 2, all), 0);
    assert_int_equal(tdp_wire_plane_choose(NULL, 0, shm_ucx, 2, all), 0);
    assert_int_equal(tdp_wire_plane_choose(shm_ucx, 2, NULL, 0, all), 0);
    assert_int_equal(tdp_wire_plane_choose(shm_ucx, 2, shm_ucx, 2, 0), 0);
    /* a repeated id counts where it first appears, from either side */
    static const uint8_t rep[] = {TDP_PLANE_SHM, TDP_PLANE_UCX, TDP_PLANE_SHM};
    assert_int_equal(tdp_wire_plane_choose(rep, 3, ucx_shm, 2, all), TDP_PLANE_UCX);
    assert_int_equal(tdp_wire_plane_choose(ucx_shm, 2, rep, 3, all), TDP_PLANE_UCX);
    assert_int_equal(tdp_wire_plane_choose(rep, 3, shm_ucx, 2, all), TDP_PLANE_SHM);
    assert_int_equal(tdp_wire_plane_choose(shm_ucx, 2, rep, 3, all), TDP_PLANE_SHM);
    /* ids of 64 and above never win, even shared; 63 can */
    assert_int_equal(tdp_wire_plane_choose(unknown, 3, unknown, 3, all), 63);
    assert_int_equal(tdp_wire_plane_choose(unknown, 3, unknown, 3, ~TDP_PLANE_BIT(63)),
                     TDP_PLANE_UCX);
}

/* ---- headers ----------------------------------------------------------------- */

/* How a protocol-1 peer reads a control header: its decoder, as it was. */
static tdp_err v1_ctl_hdr_check(const uint8_t in[TDP_CTL_HDR_LEN])
{
    uint32_t magic =
        (uint32_t)in[0] | (uint32_t)in[1] << 8 | (uint32_t)in[2] << 16 | (uint32_t)in[3] << 24;
    uint16_t version = (uint16_t)(in[4] | in[5] << 8);
    if (magic != TDP_CTL_MAGIC || in[12] != 0 || in[13] != 0 || in[14] != 0 || in[15] != 0)
        return TDP_EPROTO;
    return version != 1 ? TDP_EVERSION : TDP_OK;
}

static void test_version_mismatch_both_ways(void **state)
{
    (void)state;
    assert_int_equal(TDP_PROTOCOL_VERSION, 2);
    /* a protocol-1 HELLO header (from fuzz/corpus/frames/hello_v1) */
    static const uint8_t v1[TDP_CTL_HDR_LEN] = {0x54, 0x44, 0x50, 0x43, 1, 0, 1, 0,
                                                0x68, 0,    0,    0,    0, 0, 0, 0};
    tdp_ctl_hdr h;
    assert_int_equal(tdp_wire_ctl_hdr_decode(v1, &h), TDP_EVERSION);
    assert_int_equal(h.version, 1);
    assert_int_equal(h.type, TDP_CTL_HELLO);

    /* and a protocol-1 peer reading ours sees a version mismatch, not garbage */
    tdp_hello hello = base_hello();
    set_rec(&hello, TDP_HX_UCX_ADDR, addr_bytes, sizeof(addr_bytes));
    uint8_t out[256];
    assert_true(tdp_wire_hello_size(&hello) <= sizeof(out));
    assert_int_equal(tdp_wire_hello_encode(out, &hello), TDP_OK);
    assert_int_equal(v1_ctl_hdr_check(out), TDP_EVERSION);
    uint8_t bye[TDP_CTL_HDR_LEN + TDP_BYE_LEN];
    tdp_wire_bye_encode(bye, &(tdp_bye){.last_seq = 0, .reason = TDP_EVERSION});
    assert_int_equal(v1_ctl_hdr_check(bye), TDP_EVERSION);

    /* later versions too */
    uint8_t v3[TDP_CTL_HDR_LEN];
    memcpy(v3, out, sizeof(v3));
    v3[4] = 3;
    assert_int_equal(tdp_wire_ctl_hdr_decode(v3, &h), TDP_EVERSION);
}

static void test_ctl_hdr_bounds(void **state)
{
    (void)state;
    uint8_t hb[TDP_CTL_HDR_LEN];
    tdp_ctl_hdr h;
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_HELLO, TDP_HELLO_FIXED_LEN);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &h), TDP_OK);
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_HELLO, TDP_HELLO_MAX_LEN);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &h), TDP_OK);
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_HELLO, TDP_HELLO_FIXED_LEN - 1);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &h), TDP_EPROTO);
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_HELLO, TDP_HELLO_MAX_LEN + 1);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &h), TDP_EPROTO);
    tdp_wire_ctl_hdr_encode(hb, 3, 16);
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &h), TDP_EPROTO);
    tdp_wire_ctl_hdr_encode(hb, 5, 0); /* after PROVEN: none yet */
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &h), TDP_EPROTO);
    tdp_wire_ctl_hdr_encode(hb, TDP_CTL_BYE, TDP_BYE_LEN);
    hb[13] = 1; /* reserved */
    assert_int_equal(tdp_wire_ctl_hdr_decode(hb, &h), TDP_EPROTO);
}

/* BYE and the AM header keep their layout; only the version byte moved on. */
/* tdp_pipe_prepare's wire: the READY record and frame, and the SCHEMA's prepare flag. */
static void test_ready(void **state)
{
    (void)state;
    tdp_hello h = {.recv_depth = 1, .ready = TDP_READY_V1}, g;
    size_t n = tdp_wire_hello_size(&h);
    uint8_t *out = malloc(n);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g), TDP_OK);
    assert_int_equal(g.ready, TDP_READY_V1);
    const uint8_t *r = out + TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN;
    assert_int_equal(r[0] | r[1] << 8, TDP_HX_READY);
    assert_false((r[2] | r[3] << 8) & TDP_HX_CRITICAL); /* older peers skip it */
    /* a value of 0 is malformed; a later version is taken (and not spoken) */
    out[TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN + TDP_HX_HDR_LEN] = 0;
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g),
                     TDP_EPROTO);
    out[TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN + TDP_HX_HDR_LEN] = 7;
    assert_int_equal(tdp_wire_hello_decode(out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN, &g), TDP_OK);
    assert_int_equal(g.ready, 7);
    free(out);

    uint8_t f[TDP_CTL_HDR_LEN + TDP_READY_LEN];
    tdp_wire_ready_encode(f, &(tdp_ready){.hash = 0x1122334455667788u, .count = 3});
    tdp_ctl_hdr ch;
    assert_int_equal(tdp_wire_ctl_hdr_decode(f, &ch), TDP_OK);
    assert_int_equal(ch.type, TDP_CTL_READY);
    assert_int_equal(ch.length, TDP_READY_LEN);
    tdp_ready rd;
    assert_int_equal(tdp_wire_ready_decode(f + TDP_CTL_HDR_LEN, TDP_READY_LEN, &rd), TDP_OK);
    assert_int_equal(rd.hash, 0x1122334455667788u);
    assert_int_equal(rd.count, 3);
    assert_int_equal(tdp_wire_ready_decode(f + TDP_CTL_HDR_LEN, TDP_READY_LEN - 1, &rd),
                     TDP_EPROTO);
    memset(f + TDP_CTL_HDR_LEN + 8, 0, 8); /* count 0: no prepare has that number */
    assert_int_equal(tdp_wire_ready_decode(f + TDP_CTL_HDR_LEN, TDP_READY_LEN, &rd), TDP_EPROTO);
    f[8] = TDP_READY_LEN + 1; /* a READY of another length */
    assert_int_equal(tdp_wire_ctl_hdr_decode(f, &ch), TDP_EPROTO);

    /* the prepare flag: on SCHEMA only */
    uint8_t ab[TDP_AM_HDR_LEN];
    tdp_am_hdr am = {.type = TDP_AM_SCHEMA, .flags = TDP_AM_F_PREPARE, .length = 2, .arg = 8};
    tdp_am_hdr g2;
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, sizeof(ab), &g2), TDP_OK);
    assert_int_equal(g2.flags, TDP_AM_F_PREPARE);
    am.type = TDP_AM_DATA;
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, sizeof(ab), &g2), TDP_EPROTO);
    am = (tdp_am_hdr){.type = TDP_AM_CREDIT, .flags = TDP_AM_F_PREPARE};
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, sizeof(ab), &g2), TDP_EPROTO);
    am = (tdp_am_hdr){.type = TDP_AM_SCHEMA, .flags = 1u << 2};
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, sizeof(ab), &g2), TDP_EPROTO);
}

static void test_bye_and_am_unchanged(void **state)
{
    (void)state;
    uint8_t bye[TDP_CTL_HDR_LEN + TDP_BYE_LEN];
    tdp_wire_bye_encode(bye, &(tdp_bye){.last_seq = 10, .reason = TDP_ELIMIT});
    static const uint8_t want_bye[] = {
        0x54, 0x44, 0x50, 0x43, 2, 0, 2, 0, 16,   0,    0,    0,    0, 0, 0, 0,
        10,   0,    0,    0,    0, 0, 0, 0, 0xed, 0xff, 0xff, 0xff, 0, 0, 0, 0,
    };
    assert_memory_equal(bye, want_bye, sizeof(want_bye));
    tdp_bye b;
    assert_int_equal(tdp_wire_bye_decode(bye + TDP_CTL_HDR_LEN, TDP_BYE_LEN, &b), TDP_OK);
    assert_int_equal(b.last_seq, 10);
    assert_int_equal(b.reason, TDP_ELIMIT);

    tdp_am_hdr am = {
        .type = TDP_AM_DATA, .token = 5, .seq = 1, .hash = 7, .length = 1024, .arg = 3};
    uint8_t ab[TDP_AM_HDR_LEN];
    tdp_wire_am_encode(ab, &am);
    static const uint8_t want_am[TDP_AM_HDR_LEN] = {
        0x54, 0x54, 0x44, 0x50, 2, 2, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
        7,    0,    0,    0,    0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0,
    };
    assert_memory_equal(ab, want_am, sizeof(want_am));
    tdp_am_hdr g;
    assert_int_equal(tdp_wire_am_decode(ab, sizeof(ab), &g), TDP_OK);
    assert_int_equal(g.length, 1024);
    ab[4] = 1; /* a protocol-1 AM frame */
    assert_int_equal(tdp_wire_am_decode(ab, sizeof(ab), &g), TDP_EVERSION);
}

/*
 * Chunked DATA on the ucx plane: the UCX_CHUNKS record is a plane's
 * (framed here, read by the plane), CHUNKED goes on DATA only, and a CHUNK
 * has no flags and is never empty.
 */
static void test_chunk_frames(void **state)
{
    (void)state;
    tdp_hello h = base_hello();
    static const uint8_t v1 = TDP_UCX_CHUNKS_V1;
    assert_true(tdp_wire_hx_is_plane(TDP_HX_UCX_CHUNKS));
    assert_int_equal(tdp_hello_add_rec(&h, TDP_HX_UCX_CHUNKS, &v1, 1), TDP_OK);
    round_trip(&h);

    tdp_am_hdr am = {
        .type = TDP_AM_CHUNK, .token = 5, .seq = 9, .hash = 7, .length = 4096, .arg = 8192};
    uint8_t ab[TDP_AM_HDR_MAX_LEN];
    tdp_am_hdr g;
    assert_int_equal(tdp_wire_am_encode(ab, &am), TDP_AM_HDR_LEN);
    assert_int_equal(ab[5], 4);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &g), TDP_OK);
    assert_int_equal(g.type, TDP_AM_CHUNK);
    assert_int_equal(g.arg, 8192);
    assert_int_equal(g.length, 4096);
    am.length = 0; /* an empty chunk */
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &g), TDP_EPROTO);
    am.length = 1;
    am.flags = TDP_AM_F_CHUNKED; /* a flag on a chunk */
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &g), TDP_EPROTO);

    am = (tdp_am_hdr){.type = TDP_AM_DATA, .flags = TDP_AM_F_CHUNKED, .length = 40 << 20};
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &g), TDP_OK);
    assert_int_equal(g.flags, TDP_AM_F_CHUNKED);
    am.type = TDP_AM_SCHEMA; /* CHUNKED on anything but DATA */
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &g), TDP_EPROTO);
    am = (tdp_am_hdr){.type = TDP_AM_CREDIT, .flags = TDP_AM_F_CHUNKED};
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &g), TDP_EPROTO);
    am = (tdp_am_hdr){.type = 5}; /* the next type is still unknown */
    tdp_wire_am_encode(ab, &am);
    assert_int_equal(tdp_wire_am_decode(ab, TDP_AM_HDR_LEN, &g), TDP_EPROTO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunk_frames),
        cmocka_unit_test(test_round_trip_each_record),
        cmocka_unit_test(test_round_trip_every_plane_record),
        cmocka_unit_test(test_round_trip_bounds),
        cmocka_unit_test(test_encode_refuses_what_would_not_decode),
        cmocka_unit_test(test_hello_layout),
        cmocka_unit_test(test_unknown_noncritical_skipped),
        cmocka_unit_test(test_unknown_critical_refused),
        cmocka_unit_test(test_records_any_order),
        cmocka_unit_test(test_duplicate_known_record),
        cmocka_unit_test(test_auth_and_resume_records),
        cmocka_unit_test(test_want_depth_record),
        cmocka_unit_test(test_window_record),
        cmocka_unit_test(test_checksum_record),
        cmocka_unit_test(test_proven),
        cmocka_unit_test(test_truncated_every_prefix),
        cmocka_unit_test(test_record_length_overflow),
        cmocka_unit_test(test_padding),
        cmocka_unit_test(test_record_count_limit),
        cmocka_unit_test(test_malformed_known_records),
        cmocka_unit_test(test_fixed_part),
        cmocka_unit_test(test_choose_symmetric_exhaustive),
        cmocka_unit_test(test_choose_examples),
        cmocka_unit_test(test_version_mismatch_both_ways),
        cmocka_unit_test(test_ctl_hdr_bounds),
        cmocka_unit_test(test_bye_and_am_unchanged),
        cmocka_unit_test(test_ready),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
