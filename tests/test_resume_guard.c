/*
 * test_resume_guard: only a dialer resumes a stream. A listener that says
 * RESUME in its HELLO (here a proxy in front of a real listener that adds
 * the record to the listener's HELLO) is refused by the dialer with
 * TDP_EPROTO, and a reconnecting producer is not left believing it
 * resumed: its next link to an honest listener works and reports nothing
 * resumed.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "pipe/wire.h"
#include "test_util.h"

#define TMO 20000

/* A TCP proxy for one connection; the upstream's first frame (its HELLO) gets RESUME. */
typedef struct proxy {
    int lfd;
    uint16_t port, upstream;
    uint64_t resume; /* put in the upstream's HELLO */
    pthread_t th;
    atomic_bool stop;
    atomic_int rewritten;
} proxy;

static bool read_full(int fd, uint8_t *buf, size_t n, int64_t end)
{
    size_t got = 0;
    while (got < n && mono_ms() < end) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0)
            continue;
        ssize_t r = recv(fd, buf + got, n - got, 0);
        if (r <= 0)
            return false;
        got += (size_t)r;
    }
    return got == n;
}

static void *proxy_main(void *arg)
{
    proxy *x = arg;
    int c = -1, u = -1;
    int64_t end = mono_ms() + TMO;
    while (c < 0 && !atomic_load(&x->stop) && mono_ms() < end) {
        struct pollfd p = {.fd = x->lfd, .events = POLLIN};
        if (poll(&p, 1, 50) > 0)
            c = accept(x->lfd, NULL, NULL);
    }
    if (c < 0)
        return NULL;
    u = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                             .sin_port = htons(x->upstream)};
    if (connect(u, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        goto out;
    /* the listener speaks first: its HELLO, rewritten */
    static uint8_t in[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN],
        out[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN];
    tdp_ctl_hdr h;
    if (!read_full(u, in, TDP_CTL_HDR_LEN, end) || tdp_wire_ctl_hdr_decode(in, &h) != TDP_OK ||
        h.type != TDP_CTL_HELLO || h.length > TDP_HELLO_MAX_LEN ||
        !read_full(u, in + TDP_CTL_HDR_LEN, h.length, end))
        goto out;
    tdp_hello hello;
    if (tdp_wire_hello_decode(in + TDP_CTL_HDR_LEN, h.length, &hello) != TDP_OK)
        goto out;
    hello.resume = x->resume;
    size_t n = tdp_wire_hello_size(&hello);
    if (n == 0 || n > sizeof(out) || tdp_wire_hello_encode(out, &hello) != TDP_OK ||
        send(c, out, n, MSG_NOSIGNAL) != (ssize_t)n)
        goto out;
    atomic_fetch_add(&x->rewritten, 1);
    /* then bytes both ways until either side hangs up */
    while (!atomic_load(&x->stop) && mono_ms() < end) {
        struct pollfd p[2] = {{.fd = c, .events = POLLIN}, {.fd = u, .events = POLLIN}};
        if (poll(p, 2, 50) <= 0)
            continue;
        uint8_t buf[4096];
        for (int i = 0; i < 2; i++) {
            if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            ssize_t r = recv(p[i].fd, buf, sizeof(buf), 0);
            if (r <= 0 || send(p[1 - i].fd, buf, (size_t)r, MSG_NOSIGNAL) != r)
                goto out;
        }
    }
out:
    if (u >= 0)
        close(u);
    close(c);
    return NULL;
}

static void proxy_start(proxy *x, uint16_t upstream, uint64_t resume)
{
    x->upstream = upstream;
    x->resume = resume;
    atomic_init(&x->stop, false);
    atomic_init(&x->rewritten, 0);
    x->lfd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(x->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(x->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(x->lfd, 4), 0);
    socklen_t sl = sizeof(sa);
    assert_int_equal(getsockname(x->lfd, (struct sockaddr *)&sa, &sl), 0);
    x->port = ntohs(sa.sin_port);
    assert_int_equal(pthread_create(&x->th, NULL, proxy_main, x), 0);
}

static void proxy_stop(proxy *x)
{
    atomic_store(&x->stop, true);
    pthread_join(x->th, NULL);
    close(x->lfd);
}

/* A listener that answers with RESUME: the dialer refuses it with TDP_EPROTO. */
static void test_listener_resume_refused(void **state)
{
    (void)state;
    tdp_loop *sl, *cl;
    tdp_listener *l;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_OK);
    proxy x;
    proxy_start(&x, tdp_listener_port(l), 5);
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.reconnect_ms = 2000; /* a producer that reconnects: the refusal is no outage */
    o.connect_timeout_ms = 3000;
    tdp_pipe *c = NULL;
    tdp_err rc = tdp_pipe_connect(cl, "127.0.0.1", x.port, &o, &c);
    assert_int_equal(rc, TDP_EPROTO);
    /* the proxy counts its rewrite after the send, so the dialer may have
     * refused it first: read the count once the proxy has stopped */
    proxy_stop(&x);
    assert_int_equal(atomic_load(&x.rewritten), 1);

    /* an honest listener (a fresh one: the first may still hold the pipe
     * the dialer refused) works, and nothing says "resumed" */
    tdp_listener_free(l);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), &o, &c), TDP_OK);
    tdp_pipe *p;
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_schema *s = host_bytes_schema(64);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    tdp_pipe_release(p, got);
    tdp_pipe_stats st;
    tdp_pipe_stats_get(c, &st);
    assert_int_equal(st.resumed_from, 0);
    tdp_pipe_stats_get(p, &st);
    assert_int_equal(st.resumed_from, 0);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_pipe_close(c, TMO);
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_listener_resume_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
