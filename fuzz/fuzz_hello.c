/*
 * fuzz_hello: the real HELLO handler, end to end. A pipe is made as a
 * listener makes one (tdp__session_new + tdp__session_accept) on one end
 * of a socketpair; the input, turned into a HELLO, arrives on the other
 * end; the loop runs it through everything a received HELLO goes through:
 * ctl.c's framing and decoder, session.c's plane choice and same-host
 * test, and the ucx plane's link_start — the UCX address guard
 * (ucx_addr.c) and ucp_ep_create on what it let through. Nothing may
 * crash, hang, leak or be reported as anything but a clean outcome.
 *
 * Input, first byte:
 *  - even: the rest is the HELLO payload as sent;
 *  - odd: a HELLO built from this side's own (its real UCX worker
 *    addresses), edited by the rest: a flags byte (bit 0 claim this host,
 *    bit 1 send UCX_LOCAL_ADDR, bit 2 no UCX_ADDR, bits 3-4 peer mode),
 *    then edits of 3 bytes {op, offset, value}: op bit 0 picks the address
 *    (UCX_ADDR / UCX_LOCAL_ADDR), bits 1-2 the edit (xor, set, truncate,
 *    insert) at offset modulo the length.
 *
 * UCX runs with TCP on loopback only (UCX_TLS=tcp, UCX_NET_DEVICES=lo,
 * unless set already): an address the guard lets through makes UCX
 * connect, and on a shared machine a fuzzer must not attach other
 * processes' shared memory.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <tdpipe/tdpipe.h>

#include "core/loop_int.h"
#include "pipe/session.h"
#include "pipe/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define ROUND_MS                                                                                   \
    200 /* the handshake deadline; the whole exchange is local: far more than it takes */

static tdp_loop *loop;
static tdp_pipe_opts opts;
static tdp_schema_limits lim;

typedef struct outcome {
    volatile bool done;
    tdp_err st;
    tdp_pipe *pipe;
} outcome;

static void ready(tdp_pipe *p, tdp_err st, void *arg)
{
    outcome *o = arg;
    o->st = st;
    o->pipe = p;
    o->done = true;
}

static void setup(void)
{
    setenv("UCX_TLS", "tcp", 0);
    setenv("UCX_NET_DEVICES", "lo", 0);
    setenv("TDP_LOG_LEVEL", "error", 0);
    if (tdp_loop_new(NULL, &loop) != TDP_OK)
        abort();
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = TDP_PLANE_UCX;
    o.connect_timeout_ms = ROUND_MS;
    tdp__opts_resolve(&o, &opts, &lim);
}

/* Run the loop until o->done; the handshake deadline ends it well before. */
static void run(outcome *o)
{
    tdp__loop_run_until(loop, &o->done, 5 * ROUND_MS);
}

/* The session's HELLO from fd, running the loop until it is whole (bounded). */
static size_t read_ours(int fd, uint8_t *buf, size_t cap)
{
    size_t n = 0;
    for (int turn = 0; turn < 50; turn++) {
        bool tick = false;
        tdp__loop_run_until(loop, &tick, 1);
        ssize_t r;
        while (n < cap && (r = recv(fd, buf + n, cap - n, MSG_DONTWAIT)) > 0)
            n += (size_t)r;
        tdp_ctl_hdr hdr;
        if (n >= TDP_CTL_HDR_LEN && (tdp_wire_ctl_hdr_decode(buf, &hdr) != TDP_OK ||
                                     n >= TDP_CTL_HDR_LEN + (size_t)hdr.length))
            break;
    }
    return n;
}

static uint8_t ours_buf[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN];
static uint8_t addr_buf[2][TDP_MAX_UCX_ADDR + 256];

/* Apply one edit to an address of *len bytes (kept 1..TDP_MAX_UCX_ADDR). */
static void edit(uint8_t *a, uint32_t *len, uint8_t op, uint8_t off, uint8_t val)
{
    uint32_t n = *len, at = n > 0 ? off % n : 0;
    switch ((op >> 1) & 3) {
    case 0:
        if (n > 0)
            a[at] ^= val;
        break;
    case 1:
        if (n > 0)
            a[at] = val;
        break;
    case 2:
        if (at > 0)
            *len = at;
        break;
    case 3:
        if (n < TDP_MAX_UCX_ADDR) {
            memmove(a + at + 1, a + at, n - at);
            a[at] = val;
            *len = n + 1;
        }
        break;
    }
}

/* The HELLO payload for a templated input; NULL when ours was not read. */
static uint8_t *templated(const uint8_t *data, size_t size, const uint8_t *ours, size_t nours,
                          size_t *len)
{
    tdp_ctl_hdr hdr;
    tdp_hello mine, h;
    static const uint8_t planes[] = {TDP_PLANE_UCX};
    if (nours < TDP_CTL_HDR_LEN || tdp_wire_ctl_hdr_decode(ours, &hdr) != TDP_OK ||
        nours < TDP_CTL_HDR_LEN + (size_t)hdr.length ||
        tdp_wire_hello_decode(ours + TDP_CTL_HDR_LEN, hdr.length, &mine) != TDP_OK)
        return NULL;
    uint8_t fl = size > 0 ? data[0] : 0;
    const tdp_hx_rec *ra = tdp_hello_rec(&mine, TDP_HX_UCX_ADDR);
    const tdp_hx_rec *rl = tdp_hello_rec(&mine, TDP_HX_UCX_LOCAL_ADDR);
    uint32_t alen[2] = {ra != NULL ? ra->len : 0, rl != NULL ? rl->len : 0};
    if (alen[0] > 0)
        memcpy(addr_buf[0], ra->val, alen[0]);
    if (alen[1] > 0)
        memcpy(addr_buf[1], rl->val, alen[1]);
    for (size_t i = 1; i + 3 <= size; i += 3) {
        int w = data[i] & 1;
        edit(addr_buf[w], &alen[w], data[i], data[i + 1], data[i + 2]);
    }
    h = (tdp_hello){
        .recv_depth = 1,
        .peer_mode = (fl >> 3) % 3,
        .caps = TDP_CAP_MEM_HOST,
        .max_msg_bytes = 1 << 20,
        .token = 0x5eed,
        .planes = planes,
        .nplanes = 1,
    };
    if (fl & 1)
        memcpy(h.host_id, mine.host_id, TDP_HOST_ID_LEN);
    /* put in as they are: one the encoder refuses leaves nothing to send */
    if (!(fl & 4) && alen[0] > 0)
        h.recs[h.nrecs++] = (tdp_hx_rec){TDP_HX_UCX_ADDR, alen[0], addr_buf[0]};
    if ((fl & 2) && alen[1] > 0)
        h.recs[h.nrecs++] = (tdp_hx_rec){TDP_HX_UCX_LOCAL_ADDR, alen[1], addr_buf[1]};
    size_t n = tdp_wire_hello_size(&h);
    uint8_t *out = n > 0 ? malloc(n) : NULL;
    if (out == NULL || tdp_wire_hello_encode(out, &h) != TDP_OK) {
        free(out);
        return NULL;
    }
    /* the caller frames it: keep the payload only */
    memmove(out, out + TDP_CTL_HDR_LEN, n - TDP_CTL_HDR_LEN);
    *len = n - TDP_CTL_HDR_LEN;
    return out;
}

static bool send_all(int fd, const uint8_t *b, size_t n, outcome *o)
{
    while (n > 0) {
        ssize_t r = send(fd, b, n, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0) {
            b += r;
            n -= (size_t)r;
            continue;
        }
        if (o->done) /* the session gave up on us: the rest is not read */
            return false;
        /* let the session read what is queued */
        bool tick = false;
        tdp__loop_run_until(loop, &tick, 1);
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (loop == NULL)
        setup();
    if (size == 0 || size > TDP_HELLO_MAX_LEN)
        return 0;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        abort();
    tdp_err err;
    tdp_pipe *p = tdp__session_new(loop, &opts, &lim, &err);
    if (p == NULL)
        abort();
    outcome o = {0};
    struct sockaddr_un un = {.sun_family = AF_UNIX};
    if (tdp__session_accept(p, sv[0], (struct sockaddr *)&un, ready, &o) != TDP_OK)
        abort();

    /* the session's HELLO went out at accept */
    size_t nours = read_ours(sv[1], ours_buf, sizeof(ours_buf));

    uint8_t *payload = NULL;
    size_t plen = 0;
    if (data[0] & 1) {
        payload = templated(data + 1, size - 1, ours_buf, nours, &plen);
    } else if ((payload = malloc(size - 1 + 1)) != NULL) {
        memcpy(payload, data + 1, size - 1);
        plen = size - 1;
    }
    if (payload != NULL) {
        uint8_t hdr[TDP_CTL_HDR_LEN];
        tdp_wire_ctl_hdr_encode(hdr, TDP_CTL_HELLO, (uint32_t)plen);
        if (send_all(sv[1], hdr, sizeof(hdr), &o))
            send_all(sv[1], payload, plen, &o);
        free(payload);
    }
    shutdown(sv[1], SHUT_WR); /* a HELLO cut short ends at EOF, not at a deadline */
    run(&o);
    if (!o.done)
        abort(); /* the handshake hung: its own deadline should have ended it */
    switch (o.st) {
    case TDP_OK:
    case TDP_EPROTO:     /* the decoder or the address guard refused */
    case TDP_EVERSION:   /* an unknown critical record */
    case TDP_ENOTSUP:    /* nothing in common: plane, transport */
    case TDP_EUCX:       /* UCX refused a checked address (e.g. unreachable) */
    case TDP_ECONNRESET: /* no HELLO before EOF */
    case TDP_ETIMEDOUT:
        break;
    default:
        fprintf(stderr, "fuzz_hello: unexpected outcome %s\n", tdp_strerror(o.st));
        abort();
    }
    if (getenv("TDP_FUZZ_VERBOSE") != NULL)
        fprintf(stderr, "fuzz_hello: %s\n", o.st == TDP_OK ? "opened" : tdp_strerror(o.st));
    if (o.pipe != NULL)
        tdp_pipe_free(o.pipe);
    close(sv[1]);
    /* let reaps and endpoint closes finish before the next input */
    bool tick = false;
    tdp__loop_run_until(loop, &tick, 2);
    return 0;
}
