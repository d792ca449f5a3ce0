/*
 * test_tcp_hostile: a hostile peer on the tcp plane's socket. A raw
 * socket dials a listener, speaks a HELLO that picks the tcp plane, then
 * sends frames the library would never build, or stops mid-frame. The
 * listener's pipe must end with the error that names what the peer did,
 * within a bounded time, and tell the peer why in a BYE.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "pipe/plane.h"
#include "pipe/wire.h"
#include "test_util.h"
#include "test_ctl_frame.h"

#define TMO 10000

typedef struct raw {
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *srv;
    int fd;
    tdp_hello h; /* the listener's */
    uint8_t hello[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN];
} raw;

static void raw_up(raw *r, const tdp_pipe_opts *so)
{
    memset(r, 0, sizeof(*r));
    assert_int_equal(tdp_loop_new(NULL, &r->loop), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(r->loop), TDP_OK);
    assert_int_equal(tdp_listener_new(r->loop, "127.0.0.1", 0, so, NULL, NULL, &r->l), TDP_OK);
    r->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                             .sin_port = htons(tdp_listener_port(r->l))};
    assert_int_equal(connect(r->fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    ssize_t n = read_ctl_frame(r->fd, r->hello, sizeof(r->hello), 5000);
    assert_true(n > (ssize_t)TDP_CTL_HDR_LEN);
    assert_int_equal(
        tdp_wire_hello_decode(r->hello + TDP_CTL_HDR_LEN, (size_t)n - TDP_CTL_HDR_LEN, &r->h),
        TDP_OK);
    static const uint8_t planes[] = {TDP_PLANE_TCP};
    static const uint8_t tcpf = 0;
    tdp_hello mine = {
        .recv_depth = 1,
        .max_msg_bytes = 1u << 20,
        .planes = planes,
        .nplanes = 1,
    };
    assert_int_equal(tdp_hello_add_rec(&mine, TDP_HX_TCP, &tcpf, 1), TDP_OK);
    memcpy(mine.host_id, r->h.host_id, TDP_HOST_ID_LEN);
    for (size_t i = 0; i < TDP_HELLO_NONCE_LEN; i++)
        mine.nonce[i] = (uint8_t)(i * 37 + 11);
    uint8_t buf[TDP_CTL_HDR_LEN + 1024];
    size_t len = tdp_wire_hello_size(&mine);
    assert_true(len > 0 && len <= sizeof(buf));
    assert_int_equal(tdp_wire_hello_encode(buf, &mine), TDP_OK);
    assert_int_equal(send(r->fd, buf, len, MSG_NOSIGNAL), (ssize_t)len);
    assert_int_equal(tdp_listener_accept(r->l, TMO, &r->srv), TDP_OK);
    assert_int_equal(tdp_pipe_plane(r->srv), TDP_PLANE_TCP);
}

static void raw_down(raw *r)
{
    if (r->fd >= 0)
        close(r->fd);
    tdp_pipe_free(r->srv);
    tdp_listener_free(r->l);
    tdp_loop_free(r->loop);
}

/* One PLANE frame: control header, AM header, then plen payload bytes (of pl, or zeros). */
static void raw_frame(raw *r, const tdp_am_hdr *h, const void *pl, size_t plen)
{
    uint8_t f[TDP_CTL_HDR_LEN + TDP_AM_HDR_MAX_LEN];
    size_t al = tdp_wire_am_encode(f + TDP_CTL_HDR_LEN, h);
    tdp_wire_ctl_hdr_encode(f, TDP_CTL_PLANE, (uint32_t)al);
    assert_int_equal(send(r->fd, f, TDP_CTL_HDR_LEN + al, MSG_NOSIGNAL),
                     (ssize_t)(TDP_CTL_HDR_LEN + al));
    if (plen > 0) {
        void *z = NULL;
        if (pl == NULL)
            pl = z = calloc(1, plen);
        size_t off = 0;
        while (off < plen) {
            ssize_t n = send(r->fd, (const uint8_t *)pl + off, plen - off, MSG_NOSIGNAL);
            assert_true(n > 0);
            off += (size_t)n;
        }
        free(z);
    }
}

static void raw_schema(raw *r, tdp_schema *s, uint64_t seq)
{
    size_t jl;
    const char *json = tdp_schema_json(s, &jl);
    tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                    .seq = seq,
                    .hash = tdp_schema_hash(s),
                    .length = jl,
                    .arg = tdp_schema_total_bytes(s)};
    raw_frame(r, &h, json, jl);
}

static tdp_am_hdr data_hdr(tdp_schema *s, uint64_t seq)
{
    return (tdp_am_hdr){.type = TDP_AM_DATA,
                        .seq = seq,
                        .hash = tdp_schema_hash(s),
                        .length = tdp_schema_total_bytes(s)};
}

/* What the listener says next, within ms: the BYE's reason, or 1 for none. */
static int raw_bye(raw *r, int64_t ms)
{
    uint8_t buf[TDP_CTL_HDR_LEN + TDP_AM_HDR_MAX_LEN];
    for (;;) {
        ssize_t n = read_ctl_frame(r->fd, buf, sizeof(buf), ms);
        if (n < 0)
            return 1;
        tdp_ctl_hdr h;
        assert_int_equal(tdp_wire_ctl_hdr_decode(buf, &h), TDP_OK);
        if (h.type == TDP_CTL_BYE) {
            tdp_bye b;
            assert_int_equal(tdp_wire_bye_decode(buf + TDP_CTL_HDR_LEN, h.length, &b), TDP_OK);
            return b.reason;
        }
    }
}

/* A DATA whose payload stops part way, the peer gone: a reset, at once. */
static void test_close_mid_payload(void **state)
{
    (void)state;
    raw r;
    raw_up(&r, NULL);
    tdp_schema *s = host_bytes_schema(1 << 20);
    raw_schema(&r, s, 1);
    tdp_am_hdr h = data_hdr(s, 1);
    raw_frame(&r, &h, NULL, 0);
    static uint8_t part[300000];
    assert_int_equal(send(r.fd, part, sizeof(part), MSG_NOSIGNAL), (ssize_t)sizeof(part));
    close(r.fd);
    r.fd = -1;
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(r.srv, TMO, &got), TDP_ECONNRESET);
    tdp_schema_unref(s);
    raw_down(&r);
}

/*
 * A SCHEMA longer than this side's max_json_bytes: TDP_EMSGSIZE, as on
 * every plane (docs/pipe.md, "Errors"), and the peer hears it in a BYE;
 * not a peer that vanished.
 */
static void test_schema_over_max_json(void **state)
{
    (void)state;
    raw r;
    tdp_schema_limits lim;
    tdp_schema_limits_default(&lim);
    lim.max_json_bytes = 4096;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.limits = &lim;
    raw_up(&r, &o);
    tdp_am_hdr h = {.type = TDP_AM_SCHEMA, .seq = 1, .length = 4097, .arg = 64};
    raw_frame(&r, &h, NULL, 0);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(r.srv, TMO, &got), TDP_EMSGSIZE);
    assert_int_equal(tdp_pipe_status(r.srv), TDP_EMSGSIZE);
    assert_int_equal(raw_bye(&r, 5000), TDP_EMSGSIZE);
    raw_down(&r);
}

/*
 * A DATA past the last one the peer's BYE announced, its payload cut
 * short by the peer's hang-up: a protocol error at once (the peer is
 * told), not a pipe held open by a message that can never come.
 */
static void test_data_after_bye(void **state)
{
    (void)state;
    raw r;
    raw_up(&r, NULL);
    tdp_schema *s = host_bytes_schema(1 << 20);
    raw_schema(&r, s, 1);
    uint8_t b[TDP_CTL_HDR_LEN + TDP_BYE_LEN];
    tdp_bye bye = {.last_seq = 0};
    tdp_wire_bye_encode(b, &bye);
    assert_int_equal(send(r.fd, b, sizeof(b), MSG_NOSIGNAL), (ssize_t)sizeof(b));
    tdp_am_hdr h = data_hdr(s, 1);
    raw_frame(&r, &h, NULL, 0);
    static uint8_t part[1000];
    assert_int_equal(send(r.fd, part, sizeof(part), MSG_NOSIGNAL), (ssize_t)sizeof(part));
    assert_int_equal(raw_bye(&r, 5000), TDP_EPROTO);
    close(r.fd);
    r.fd = -1;
    /* what the BYE announced (nothing) was delivered: the stream ends */
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(r.srv, TMO, &got), TDP_ECLOSED);
    assert_int_equal(tdp_pipe_status(r.srv), TDP_EPROTO);
    tdp_schema_unref(s);
    raw_down(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_close_mid_payload),
        cmocka_unit_test(test_schema_over_max_json),
        cmocka_unit_test(test_data_after_bye),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
