/*
 * test_ucx_addr: the guard between a peer's UCX worker address and UCX
 * (src/pipe/ucx/ucx_addr.c). Real addresses of real workers (address versions
 * 1 and 2, several transport sets) parse and come back unchanged; every
 * prefix of one, and every rule broken on purpose, is refused; interfaces
 * this side cannot use are dropped; a remote peer cannot pass this host's
 * own devices.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <ucp/api/ucp.h>

#include "pipe/ucx/ucx_addr.h"

/* ---- real workers ------------------------------------------------------------------ */

typedef struct worker {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_address_t *addr;
    size_t len;
} worker;

/* A worker as tdpipe makes one (not unified mode), with the given UCX settings. */
static bool worker_up(worker *k, const char *tls, const char *addr_version)
{
    ucp_config_t *c;
    memset(k, 0, sizeof(*k));
    if (ucp_config_read(NULL, NULL, &c) != UCS_OK)
        return false;
    bool ok =
        (tls == NULL || ucp_config_modify(c, "TLS", tls) == UCS_OK) &&
        (addr_version == NULL || ucp_config_modify(c, "ADDRESS_VERSION", addr_version) == UCS_OK) &&
        ucp_config_modify(c, "UNIFIED_MODE", "n") == UCS_OK;
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
    ok = ok && ucp_init(&p, c, &k->ctx) == UCS_OK;
    ucp_config_release(c);
    if (!ok)
        return false;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(k->ctx, &wp, &k->w) != UCS_OK) {
        ucp_cleanup(k->ctx);
        return false;
    }
    if (ucp_worker_get_address(k->w, &k->addr, &k->len) != UCS_OK) {
        ucp_worker_destroy(k->w);
        ucp_cleanup(k->ctx);
        return false;
    }
    return true;
}

static void worker_down(worker *k)
{
    ucp_worker_release_address(k->w, k->addr);
    ucp_worker_destroy(k->w);
    ucp_cleanup(k->ctx);
}

static tdp__ucxa parsed; /* large: kept off the stack */
static tdp__ucxa_profile prof;
static uint8_t out[70000];

static tdp_err canon(const tdp__ucxa_profile *p, const void *a, size_t len, bool local,
                     size_t *olen)
{
    const char *why = NULL;
    tdp_err rc = tdp__ucxa_canonical(p, a, len, local, out, sizeof(out), olen, &why);
    if (rc != TDP_OK)
        assert_non_null(why);
    return rc;
}

/* Every transport set the pipe suite uses, in both address versions. */
static void test_real_addresses(void **state)
{
    static const char *tls[] = {NULL, "tcp", "posix,sysv", "shm,self", "tcp,posix"};
    static const char *ver[] = {NULL, "v1", "v2"};
    for (size_t t = 0; t < sizeof(tls) / sizeof(tls[0]); t++) {
        for (size_t v = 0; v < sizeof(ver) / sizeof(ver[0]); v++) {
            worker k;
            if (!worker_up(&k, tls[t], ver[v])) {
                printf("no worker for TLS=%s ADDRESS_VERSION=%s: skipped\n",
                       tls[t] ? tls[t] : "(default)", ver[v] ? ver[v] : "(default)");
                continue;
            }
            const char *why = NULL;
            assert_int_equal(tdp__ucxa_parse((const uint8_t *)k.addr, k.len, &parsed, &why),
                             TDP_OK);
            assert_true(parsed.ndev > 0 && parsed.ntl > 0);
            assert_int_equal(parsed.version, ver[v] != NULL && !strcmp(ver[v], "v2") ? 1 : 0);
            assert_int_equal(tdp__ucxa_profile_init(&prof, k.addr, k.len), TDP_OK);
            /* this side's own address, from a peer on this host: unchanged */
            size_t n = 0;
            assert_int_equal(canon(&prof, k.addr, k.len, true, &n), TDP_OK);
            assert_int_equal(n, k.len);
            assert_memory_equal(out, k.addr, n);
            for (size_t i = 0; i < 64; i++)
                assert_int_equal(out[n + i], 0); /* the padding */
            /* every strict prefix is refused */
            for (size_t cut = 0; cut < k.len; cut++) {
                tdp_err rc = tdp__ucxa_parse((const uint8_t *)k.addr, cut, &parsed, &why);
                assert_int_equal(rc, TDP_EPROTO);
            }
            /* a byte more is refused */
            uint8_t longer[4096];
            assert_true(k.len < sizeof(longer));
            memcpy(longer, k.addr, k.len);
            longer[k.len] = 0;
            assert_int_equal(tdp__ucxa_parse(longer, k.len + 1, &parsed, &why), TDP_EPROTO);
            worker_down(&k);
        }
    }
}

/*
 * From a peer that the control socket did not prove local, this host's own
 * devices (shared memory's system id, TCP's loopback namespace) are
 * dropped: with loopback TCP and shared memory only, nothing is left.
 */
static void test_remote_claims_this_host(void **state)
{
    worker k;
    assert_true(worker_up(&k, "tcp,posix,sysv", NULL));
    assert_int_equal(tdp__ucxa_profile_init(&prof, k.addr, k.len), TDP_OK);
    size_t n;
    assert_int_equal(canon(&prof, k.addr, k.len, false, &n), TDP_ENOTSUP);
    assert_int_equal(canon(&prof, k.addr, k.len, true, &n), TDP_OK);
    worker_down(&k);
}

/* ---- synthetic addresses -------------------------------------------------------------- */

typedef struct sb {
    uint8_t b[8192];
    size_t n;
} sb;

static void u8(sb *s, uint8_t v)
{
    assert_true(s->n < sizeof(s->b));
    s->b[s->n++] = v;
}

static void fill(sb *s, uint8_t v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        u8(s, v);
}

static void f32(sb *s, float f)
{
    uint8_t b[4];
    memcpy(b, &f, 4);
    for (int i = 0; i < 4; i++)
        u8(s, b[i]);
}

/* Header with a uuid (version 1 always has one). */
static void hdr(sb *s, int v2, uint8_t flags)
{
    if (v2) {
        u8(s, 1);
        u8(s, flags | 0x02);
    } else {
        u8(s, (uint8_t)(flags << 4));
    }
    fill(s, 0x11, 8);
}

/* md byte and device length byte (with the version 2 extension when needed). */
static void dev(sb *s, int v2, uint8_t md, bool empty, bool last, uint8_t dev_len, uint8_t fill_b)
{
    if (v2 && md >= 0x7f) {
        u8(s, (uint8_t)(0x7f | (empty ? 0x80 : 0)));
        u8(s, md);
    } else {
        u8(s, (uint8_t)(md | (empty ? 0x80 : 0)));
    }
    uint8_t fl = last ? 0x80 : 0;
    if (v2 && dev_len >= 0x1f) {
        u8(s, fl | 0x1f);
        u8(s, dev_len);
    } else {
        u8(s, fl | dev_len);
    }
    fill(s, fill_b, dev_len);
}

static void iface(sb *s, int v2, uint16_t csum, bool last, uint8_t len, float bw)
{
    u8(s, (uint8_t)csum);
    u8(s, (uint8_t)(csum >> 8));
    if (v2) {
        fill(s, 0x40, 4);
        u8(s, 16); /* seg size */
        u8(s, 0);
        u8(s, 1); /* flags */
        u8(s, 0);
    } else {
        f32(s, 1e-9f);
        f32(s, bw);
        f32(s, 1e-7f);
        u8(s, 10);
        fill(s, 0, 3);
    }
    uint8_t fl = last ? 0x80 : 0;
    if (v2 && len >= 0x3f) {
        u8(s, fl | 0x3f);
        u8(s, len);
    } else {
        u8(s, fl | len);
    }
    fill(s, 0x22, len);
}

static tdp_err parse(const sb *s)
{
    const char *why = NULL;
    tdp_err rc = tdp__ucxa_parse(s->b, s->n, &parsed, &why);
    if (rc != TDP_OK)
        assert_non_null(why);
    return rc;
}

static void test_rules(void **state)
{
    sb s;
    /* a good one of each version, then each rule broken */
    for (int v2 = 0; v2 <= 1; v2++) {
        s.n = 0;
        hdr(&s, v2, 0);
        dev(&s, v2, 3, false, true, 6, 0x33);
        iface(&s, v2, 0xabcd, true, 2, 1e9f);
        assert_int_equal(parse(&s), TDP_OK);
        assert_int_equal(parsed.ndev, 1);
        assert_int_equal(parsed.ntl, 1);
        assert_int_equal(parsed.dev[0].md_index, 3);
        assert_int_equal(parsed.tl[0].csum, 0xabcd);
    }
    /* unknown address versions: UCX 1.13 asserts on them */
    for (int v = 2; v < 16; v++) {
        s.n = 0;
        hdr(&s, 0, 0);
        s.b[0] = (uint8_t)v;
        dev(&s, 0, 0, false, true, 6, 0x33);
        iface(&s, 0, 1, true, 2, 1e9f);
        assert_int_equal(parse(&s), TDP_EPROTO);
    }
    /* no devices */
    s.n = 0;
    hdr(&s, 0, 0);
    u8(&s, 0xff);
    assert_int_equal(parse(&s), TDP_EPROTO);
    /* an endpoint address in a worker address */
    s.n = 0;
    hdr(&s, 0, 0);
    dev(&s, 0, 0, false, true, 6, 0x33);
    iface(&s, 0, 1, true, 2, 1e9f);
    s.b[s.n - 3] |= 0x40; /* HAS_EP_ADDR on the interface length byte */
    assert_int_equal(parse(&s), TDP_EPROTO);
    /* attributes: not a number, infinite, zero and negative bandwidth */
    const float bad[] = {NAN, INFINITY, 0.0f, -5.0f};
    for (size_t i = 0; i < 4; i++) {
        s.n = 0;
        hdr(&s, 0, 0);
        dev(&s, 0, 0, false, true, 6, 0x33);
        iface(&s, 0, 1, true, 2, bad[i]);
        assert_int_equal(parse(&s), TDP_EPROTO);
    }
    /* a memory domain index past 63 (version 2's extension byte) */
    s.n = 0;
    hdr(&s, 1, 0);
    dev(&s, 1, 64, false, true, 6, 0x33);
    iface(&s, 1, 1, true, 2, 1e9f);
    assert_int_equal(parse(&s), TDP_EPROTO);
    s.n = 0;
    hdr(&s, 1, 0);
    dev(&s, 1, 63, false, true, 6, 0x33);
    iface(&s, 1, 1, true, 2, 1e9f);
    assert_int_equal(parse(&s), TDP_OK);
    /* unknown version 2 header flags */
    s.n = 0;
    hdr(&s, 1, 0x10);
    dev(&s, 1, 0, false, true, 6, 0x33);
    iface(&s, 1, 1, true, 2, 1e9f);
    assert_int_equal(parse(&s), TDP_EPROTO);
    /* 64 devices are fine, 65 are not (UCX keeps them in a 64-bit map) */
    for (int nd = 64; nd <= 65; nd++) {
        s.n = 0;
        hdr(&s, 0, 0);
        for (int d = 0; d < nd - 1; d++)
            dev(&s, 0, 0, true, false, 0, 0);
        dev(&s, 0, 0, false, true, 6, 0x33);
        iface(&s, 0, 1, true, 2, 1e9f);
        assert_int_equal(parse(&s), nd == 64 ? TDP_OK : TDP_EPROTO);
    }
    /* 128 interfaces are fine, 129 are not (UCP_MAX_RESOURCES) */
    for (int nt = 128; nt <= 129; nt++) {
        s.n = 0;
        hdr(&s, 0, 0);
        dev(&s, 0, 0, false, true, 0, 0);
        for (int t = 0; t < nt; t++)
            iface(&s, 0, (uint16_t)t, t == nt - 1, 0, 1e9f);
        assert_int_equal(parse(&s), nt == 128 ? TDP_OK : TDP_EPROTO);
    }
    /* the worker name (debug info) is skipped by its length */
    s.n = 0;
    hdr(&s, 0, 0x01);
    u8(&s, 5);
    fill(&s, 'n', 5);
    dev(&s, 0, 0, false, true, 6, 0x33);
    iface(&s, 0, 1, true, 2, 1e9f);
    assert_int_equal(parse(&s), TDP_OK);
    s.b[9] = 200; /* a name running past the end */
    assert_int_equal(parse(&s), TDP_EPROTO);
    /* a device with zero paths */
    s.n = 0;
    hdr(&s, 0, 0);
    u8(&s, 0);
    u8(&s, 0x80 | 0x40 | 6); /* LAST | NUM_PATHS */
    u8(&s, 0);
    fill(&s, 0x33, 6);
    iface(&s, 0, 1, true, 2, 1e9f);
    assert_int_equal(parse(&s), TDP_EPROTO);
}

/*
 * Only interfaces of a transport this side has, with the address lengths
 * its own interface of that transport has, are kept; the peer's name is
 * dropped; long version 2 lengths survive the rebuilding.
 */
static void test_canonical_keeps_usable(void **state)
{
    for (int v2 = 0; v2 <= 1; v2++) {
        sb own = {.n = 0}, peer = {.n = 0}, want = {.n = 0};
        /* this side: transport 0x1111 (device address 40 bytes, interface 70) */
        hdr(&own, v2, 0);
        dev(&own, v2, 1, false, true, v2 ? 40 : 20, 0x44);
        iface(&own, v2, 0x1111, true, v2 ? 70 : 30, 1e9f);
        assert_int_equal(tdp__ucxa_profile_init(&prof, own.b, own.n), TDP_OK);
        /* the peer: a name, an unknown transport, the known one with a wrong
         * length, a device without interfaces, then the known one right */
        hdr(&peer, v2, 0x01);
        u8(&peer, 3);
        fill(&peer, 'p', 3);
        dev(&peer, v2, 2, false, false, v2 ? 40 : 20, 0x55);
        iface(&peer, v2, 0x2222, false, 4, 1e9f);
        iface(&peer, v2, 0x1111, true, 5, 1e9f);
        dev(&peer, v2, 0, true, false, 0, 0);
        dev(&peer, v2, 3, false, true, v2 ? 40 : 20, 0x66);
        iface(&peer, v2, 0x2222, false, 4, 1e9f);
        iface(&peer, v2, 0x1111, true, v2 ? 70 : 30, 2e9f);
        hdr(&want, v2, 0);
        dev(&want, v2, 3, false, true, v2 ? 40 : 20, 0x66);
        iface(&want, v2, 0x1111, true, v2 ? 70 : 30, 2e9f);
        size_t n;
        assert_int_equal(canon(&prof, peer.b, peer.n, false, &n), TDP_OK);
        assert_int_equal(n, want.n);
        assert_memory_equal(out, want.b, n);
        /* the canonical address parses, and is its own canonical form */
        const char *why;
        assert_int_equal(tdp__ucxa_parse(out, n, &parsed, &why), TDP_OK);
        uint8_t again[4096];
        memcpy(again, out, n);
        size_t n2;
        assert_int_equal(canon(&prof, again, n, false, &n2), TDP_OK);
        assert_int_equal(n2, n);
        assert_memory_equal(out, again, n);
        /* a device equal to one of this side's: kept only for a local peer */
        sb same = {.n = 0};
        hdr(&same, v2, 0);
        dev(&same, v2, 1, false, true, v2 ? 40 : 20, 0x44);
        iface(&same, v2, 0x1111, true, v2 ? 70 : 30, 1e9f);
        assert_int_equal(canon(&prof, same.b, same.n, false, &n), TDP_ENOTSUP);
        assert_int_equal(canon(&prof, same.b, same.n, true, &n), TDP_OK);
    }
}

int main(void)
{
    setenv("UCX_NET_DEVICES", "lo", 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_real_addresses),
        cmocka_unit_test(test_remote_claims_this_host),
        cmocka_unit_test(test_rules),
        cmocka_unit_test(test_canonical_keeps_usable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
