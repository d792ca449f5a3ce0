/*
 * test_hello_guard: a HELLO whose UCX records are junk — random bytes, a
 * real worker address cut short, a real one with bytes changed — must give
 * the victim a clean protocol error (BYE with TDP_EPROTO) and leave it
 * serving. Both directions: a hostile client against a listener, and a
 * hostile listener against a dialing client. The same-host worker's
 * address travels in PROVEN, after the HELLOs: those cases offer PROVEN,
 * read the victim's, and send the junk in their own.
 *
 * The victim runs in a child process, so a victim that dies (UCX aborts on
 * an address it cannot parse) shows up as a signal in its exit status
 * instead of taking the test runner down. Loopback only, every wait bounded.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/tdpipe.h>

#include "pipe/wire.h"
#include "test_util.h"

#define TMO 10000 /* ms: bound for any single wait */

/* ---- raw control-socket helpers ------------------------------------------------ */

/* Read exactly n bytes within the deadline; false on EOF, error or timeout. */
static bool read_full(int fd, void *buf, size_t n, int64_t deadline)
{
    uint8_t *p = buf;
    while (n > 0) {
        int left = (int)(deadline - mono_ms());
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&pf, 1, left) <= 0)
            return false;
        ssize_t r = read(fd, p, n);
        if (r <= 0)
            return false;
        p += r;
        n -= (size_t)r;
    }
    return true;
}

static bool write_full(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r <= 0)
            return false;
        p += r;
        n -= (size_t)r;
    }
    return true;
}

/* The peer's next frame, of this type: the whole of it (header included) in *frame. */
static bool read_frame(int fd, uint16_t type, uint8_t **frame, uint32_t *len)
{
    uint8_t hb[TDP_CTL_HDR_LEN];
    tdp_ctl_hdr hdr;
    int64_t deadline = mono_ms() + TMO;
    if (!read_full(fd, hb, sizeof(hb), deadline) || tdp_wire_ctl_hdr_decode(hb, &hdr) != TDP_OK ||
        hdr.type != type)
        return false;
    uint8_t *f = malloc(TDP_CTL_HDR_LEN + hdr.length + 1);
    assert_non_null(f);
    memcpy(f, hb, sizeof(hb));
    if (!read_full(fd, f + TDP_CTL_HDR_LEN, hdr.length, deadline)) {
        free(f);
        return false;
    }
    *frame = f;
    *len = hdr.length;
    return true;
}

/* The peer's HELLO: the whole frame (header included) in *frame, decoded in *h. */
static bool read_hello(int fd, uint8_t **frame, tdp_hello *h)
{
    uint32_t n;
    if (!read_frame(fd, TDP_CTL_HELLO, frame, &n))
        return false;
    if (tdp_wire_hello_decode(*frame + TDP_CTL_HDR_LEN, n, h) != TDP_OK) {
        free(*frame);
        return false;
    }
    return true;
}

/*
 * After our HELLO: what the victim says. The reason of its BYE, or 1 when
 * it closed or went quiet without one (it may have opened the pipe: then
 * it waits for the data plane until we hang up).
 */
static int victim_answer(int fd, int64_t quiet_ms)
{
    uint8_t b[TDP_CTL_HDR_LEN + TDP_BYE_LEN];
    tdp_bye bye;
    if (!read_full(fd, b, sizeof(b), mono_ms() + quiet_ms))
        return 1;
    tdp_ctl_hdr hdr;
    if (tdp_wire_ctl_hdr_decode(b, &hdr) != TDP_OK || hdr.type != TDP_CTL_BYE ||
        tdp_wire_bye_decode(b + TDP_CTL_HDR_LEN, TDP_BYE_LEN, &bye) != TDP_OK)
        return 1;
    return bye.reason;
}

/* ---- the junk --------------------------------------------------------------- */

enum junk_kind { J_RANDOM, J_CUT, J_FLIP, J_SET };

typedef struct junk {
    const char *name;
    enum junk_kind kind;
    size_t arg;       /* J_RANDOM: length; J_CUT: bytes kept (0: half); J_FLIP/J_SET: offset */
    uint8_t val;      /* J_FLIP: xor mask; J_SET: the byte written */
    bool local;       /* the record attacked: UCX_LOCAL_ADDR (claiming this host) or UCX_ADDR */
    bool must_eproto; /* structurally broken: the victim must refuse with TDP_EPROTO */
} junk;

static const junk cases[] = {
    {"random 1 byte", J_RANDOM, 1, 0, false, true},
    {"random 64 bytes", J_RANDOM, 64, 0, false, true},
    {"random 600 bytes", J_RANDOM, 600, 0, false, true},
    {"random 64 bytes, local worker", J_RANDOM, 64, 0, true, true},
    {"real address cut to 3 bytes", J_CUT, 3, 0, false, true},
    {"real address cut in half", J_CUT, 0, 0, false, true},
    {"real address less its last byte", J_CUT, (size_t)-1, 0, false, true},
    {"real local address cut in half", J_CUT, 0, 0, true, true},
    {"address version 15", J_SET, 0, 0x0f, false, true},
    {"address version 15, local worker", J_SET, 0, 0x0f, true, true},
    {"address version 2", J_SET, 0, 0x02, false, true},
    {"empty device list byte", J_SET, 9, 0x3f, false, false},
    {"flip byte 9", J_FLIP, 9, 0xff, false, false},
    {"flip byte 10", J_FLIP, 10, 0x80, false, false},
    {"flip byte 11", J_FLIP, 11, 0x5a, false, false},
    {"flip byte 12", J_FLIP, 12, 0xff, false, false},
    {"flip byte 14", J_FLIP, 14, 0x40, false, false},
    {"flip byte 20", J_FLIP, 20, 0xff, false, false},
    {"flip byte 30", J_FLIP, 30, 0x40, false, false},
    {"flip byte 13, local worker", J_FLIP, 13, 0xff, true, false},
    {"flip byte 16, local worker", J_FLIP, 16, 0x40, true, false},
};
#define NCASES (sizeof(cases) / sizeof(cases[0]))

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint8_t rng8(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint8_t)rng_state;
}

/* The junk made from a real address (its raw material) into addr; its length. */
static size_t junk_addr(const junk *j, const uint8_t *real, size_t rlen, uint8_t *addr, size_t cap)
{
    size_t n = 0;
    assert_true(rlen > 0 && rlen <= cap);
    switch (j->kind) {
    case J_RANDOM:
        n = j->arg;
        for (size_t i = 0; i < n; i++)
            addr[i] = rng8();
        break;
    case J_CUT:
        n = j->arg == 0 ? rlen / 2 : j->arg == (size_t)-1 ? rlen - 1 : j->arg;
        memcpy(addr, real, n);
        break;
    case J_FLIP:
    case J_SET:
        n = rlen;
        memcpy(addr, real, n);
        if (j->arg < n)
            addr[j->arg] = j->kind == J_FLIP ? addr[j->arg] ^ j->val : j->val;
        break;
    }
    return n;
}

/*
 * A HELLO built from the victim's own (its real worker addresses are the
 * raw material). Attacking the general worker: its UCX_ADDR replaced by
 * junk, from another host. Attacking the same-host worker: the victim's
 * host id and a good general address, and PROVEN offered, so that the
 * victim makes its own worker and sends its address in a PROVEN frame;
 * the junk then goes in this side's PROVEN (hostile_proven).
 */
static uint8_t *hostile_hello(const tdp_hello *victim, const junk *j, size_t *len)
{
    static uint8_t addr[TDP_MAX_UCX_ADDR];
    static const uint8_t planes[] = {TDP_PLANE_UCX};
    const tdp_hx_rec *any = tdp_hello_rec(victim, TDP_HX_UCX_ADDR);
    assert_non_null(any);
    tdp_hello h = {
        .recv_depth = 1,
        .peer_mode = TDP_PEER_AUTO,
        .caps = TDP_CAP_MEM_HOST,
        .max_msg_bytes = 1 << 20,
        .token = 0x1234,
        .planes = planes,
        .nplanes = 1,
    };
    if (j->local) {
        assert_int_equal(victim->proven, TDP_PROVEN_V1); /* a local socket: offered */
        memcpy(h.host_id, victim->host_id, TDP_HOST_ID_LEN);
        h.recs[h.nrecs++] = *any; /* a well-formed general address */
        h.proven = TDP_PROVEN_V1;
    } else {
        size_t n = junk_addr(j, any->val, any->len, addr, sizeof(addr));
        memset(h.host_id, 0xa5, TDP_HOST_ID_LEN); /* another host: the general worker */
        h.recs[h.nrecs++] = (tdp_hx_rec){TDP_HX_UCX_ADDR, (uint32_t)n, addr};
    }
    *len = tdp_wire_hello_size(&h);
    uint8_t *out = malloc(*len);
    assert_non_null(out);
    assert_int_equal(tdp_wire_hello_encode(out, &h), TDP_OK);
    return out;
}

/* The victim's PROVEN frame (after our HELLO offering it): its records in *h. */
static bool read_proven_frame(int fd, uint8_t **frame, tdp_hello *h)
{
    uint32_t n;
    if (!read_frame(fd, TDP_CTL_PROVEN, frame, &n))
        return false;
    memset(h, 0, sizeof(*h));
    if (tdp_wire_proven_decode(*frame + TDP_CTL_HDR_LEN, n, h) != TDP_OK) {
        free(*frame);
        return false;
    }
    return true;
}

/* Our PROVEN: the victim's same-host address (from its PROVEN) made junk. */
static uint8_t *hostile_proven(const tdp_hello *vp, const junk *j, size_t *len)
{
    static uint8_t addr[TDP_MAX_UCX_ADDR];
    const tdp_hx_rec *vr = tdp_hello_rec(vp, TDP_HX_UCX_LOCAL_ADDR);
    assert_non_null(vr);
    size_t n = junk_addr(j, vr->val, vr->len, addr, sizeof(addr));
    tdp_hello h = {0};
    h.recs[h.nrecs++] = (tdp_hx_rec){TDP_HX_UCX_LOCAL_ADDR, (uint32_t)n, addr};
    *len = tdp_wire_proven_size(&h);
    uint8_t *out = malloc(*len);
    assert_non_null(out);
    assert_int_equal(tdp_wire_proven_encode(out, &h), TDP_OK);
    return out;
}

/* Our hostile HELLO, and for a same-host case our hostile PROVEN after the victim's. */
static void attack(int fd, const tdp_hello *vh, const junk *j)
{
    size_t n;
    uint8_t *out = hostile_hello(vh, j, &n);
    assert_true(write_full(fd, out, n));
    free(out);
    if (!j->local)
        return;
    uint8_t *pf;
    tdp_hello vp;
    assert_true(read_proven_frame(fd, &pf, &vp));
    out = hostile_proven(&vp, j, &n);
    free(pf);
    assert_true(write_full(fd, out, n));
    free(out);
}

/* ---- helpers for the victim child ---------------------------------------------- */

static tdp_schema *one_schema(void)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    int64_t n = 64;
    if (tdp_schema_builder_new(&b) != TDP_OK)
        return NULL;
    if (tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &n) != TDP_OK ||
        tdp_schema_builder_finish(b, &s, NULL, 0) != TDP_OK)
        s = NULL;
    tdp_schema_builder_free(b);
    return s;
}

/* Send one message of 64 bytes 0..63 on p. */
static tdp_err send_one(tdp_pipe *p)
{
    tdp_schema *s = one_schema();
    tdp_td *td;
    if (s == NULL || tdp_td_new(s, &td) != TDP_OK)
        return TDP_ENOMEM;
    uint8_t *d = tdp_td_data(td);
    for (int i = 0; i < 64; i++)
        d[i] = (uint8_t)i;
    tdp_err rc = tdp_pipe_send(p, td, TMO);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    return rc;
}

static bool got_one(tdp_pipe *p, int64_t ms)
{
    tdp_td *td;
    if (tdp_pipe_recv(p, ms, &td) != TDP_OK)
        return false;
    const uint8_t *d = tdp_td_data(td);
    bool ok = tdp_td_nbytes(td) == 64;
    for (int i = 0; ok && i < 64; i++)
        ok = d[i] == (uint8_t)i;
    tdp_pipe_release(p, td);
    return ok;
}

/* Dead victims, by case: reported all at once at the end of a test. */
static char deaths[4096];

static void note_death(const char *who, const char *what, int st)
{
    size_t n = strlen(deaths);
    snprintf(deaths + n, sizeof(deaths) - n, "  %s, case '%s': %s %d\n", who, what,
             WIFSIGNALED(st) ? "killed by signal" : "exited with",
             WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
}

static void note_wrong(const char *who, const char *what, int why)
{
    size_t n = strlen(deaths);
    snprintf(deaths + n, sizeof(deaths) - n,
             "  %s, case '%s': lived, but answered %d, not TDP_EPROTO\n", who, what, why);
}

static void check_deaths(void)
{
    if (deaths[0] != '\0') {
        fprintf(stderr, "the victim died or did not refuse:\n%s", deaths);
        deaths[0] = '\0';
        fail();
    }
}

static void check_child(pid_t pid, const char *what)
{
    int st = 0;
    pid_t r = waitpid(pid, &st, 0);
    assert_int_equal(r, pid);
    if (WIFSIGNALED(st)) {
        fprintf(stderr, "%s: the victim died with signal %d (%s)\n", what, WTERMSIG(st),
                strsignal(WTERMSIG(st)));
        fail();
    }
    assert_true(WIFEXITED(st));
    if (WEXITSTATUS(st) != 0)
        fprintf(stderr, "%s: the victim exited with %d\n", what, WEXITSTATUS(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

static bool alive(pid_t pid, int *st)
{
    return waitpid(pid, st, WNOHANG) == 0;
}

/* ---- a hostile client against a listener ------------------------------------------ */

/*
 * The victim: a listener. Pipes the handshake lets through (a changed
 * address can still be a valid one) are given a moment and dropped; the
 * good client's message ends it with status 0.
 */
static void listener_victim(int report_fd)
{
    tdp_loop *loop;
    tdp_listener *l;
    if (tdp_loop_new(NULL, &loop) != TDP_OK || tdp_loop_start_thread(loop) != TDP_OK ||
        tdp_listener_new(loop, "127.0.0.1", 0, NULL, NULL, NULL, &l) != TDP_OK)
        _exit(10);
    uint16_t port = tdp_listener_port(l);
    if (write(report_fd, &port, sizeof(port)) != (ssize_t)sizeof(port))
        _exit(11);
    int64_t end = mono_ms() + 120000;
    while (mono_ms() < end) {
        tdp_pipe *p;
        if (tdp_listener_accept(l, 1000, &p) != TDP_OK)
            continue;
        bool good = got_one(p, 3000);
        tdp_pipe_free(p);
        if (good) {
            tdp_listener_free(l);
            tdp_loop_free(loop);
            _exit(0);
        }
    }
    _exit(12);
}

static pid_t start_listener_victim(uint16_t *port)
{
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(pfd[0]);
        listener_victim(pfd[1]);
    }
    close(pfd[1]);
    assert_true(read_full(pfd[0], port, sizeof(*port), mono_ms() + TMO));
    close(pfd[0]);
    return pid;
}

static void test_hostile_client(void **state)
{
    uint16_t port = 0;
    pid_t pid = start_listener_victim(&port);
    for (size_t k = 0; k < NCASES; k++) {
        const junk *j = &cases[k];
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                                 .sin_port = htons(port)};
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        assert_true(fd >= 0);
        assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        uint8_t *vf;
        tdp_hello vh;
        assert_true(read_hello(fd, &vf, &vh));
        attack(fd, &vh, j);
        int why = victim_answer(fd, j->must_eproto ? TMO : 1500);
        close(fd);
        free(vf);
        usleep(50 * 1000);
        int st;
        if (!alive(pid, &st)) {
            printf("hostile client, %-40s -> the listener died\n", j->name);
            note_death("listener", j->name, st);
            pid = start_listener_victim(&port); /* and go on: every case is tried */
            continue;
        }
        printf("hostile client, %-40s -> %s\n", j->name,
               why == 1 ? "no BYE (pipe opened or quiet)" : tdp_strerror((tdp_err)why));
        if (j->must_eproto && why != TDP_EPROTO)
            note_wrong("listener", j->name, why);
    }
    /* the listener still serves a good client */
    tdp_loop *loop;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_pipe_connect(loop, "127.0.0.1", port, NULL, &p), TDP_OK);
    assert_int_equal(send_one(p), TDP_OK);
    tdp_pipe_close(p, TMO);
    tdp_pipe_free(p);
    tdp_loop_free(loop);
    check_child(pid, "listener victim");
    check_deaths();
}

/* ---- a hostile listener against a dialing client ----------------------------------- */

/*
 * The victim: a client dialing the hostile listener once per case (each
 * must fail cleanly; a junk address that happens to be valid may open),
 * then a good listener, which it must reach.
 */
static void client_victim(uint16_t hostile_port, size_t k0, int good_fd)
{
    tdp_loop *loop;
    if (tdp_loop_new(NULL, &loop) != TDP_OK)
        _exit(20);
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.connect_timeout_ms = 3000;
    for (size_t k = k0; k < NCASES; k++) {
        tdp_pipe *p;
        tdp_err rc = tdp_pipe_connect(loop, "127.0.0.1", hostile_port, &o, &p);
        if (rc == TDP_OK)
            tdp_pipe_free(p);
        else if (cases[k].must_eproto && rc != TDP_EPROTO)
            _exit(21);
    }
    uint16_t good_port;
    if (!read_full(good_fd, &good_port, sizeof(good_port), mono_ms() + TMO))
        _exit(22);
    tdp_pipe *p;
    if (tdp_pipe_connect(loop, "127.0.0.1", good_port, NULL, &p) != TDP_OK)
        _exit(23);
    bool ok = got_one(p, TMO);
    tdp_pipe_free(p);
    tdp_loop_free(loop);
    _exit(ok ? 0 : 24);
}

static pid_t start_client_victim(uint16_t hostile_port, size_t k0, int *good_fd)
{
    int pfd[2];
    assert_int_equal(pipe(pfd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(pfd[1]);
        client_victim(hostile_port, k0, pfd[0]);
    }
    close(pfd[0]);
    *good_fd = pfd[1];
    return pid;
}

static void test_hostile_listener(void **state)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 8), 0);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&sa, &sl), 0);
    int good_fd;
    pid_t pid = start_client_victim(ntohs(sa.sin_port), 0, &good_fd);
    for (size_t k = 0; k < NCASES; k++) {
        const junk *j = &cases[k];
        struct pollfd pf = {.fd = lfd, .events = POLLIN};
        if (poll(&pf, 1, TMO) <= 0) {
            fprintf(stderr, "hostile listener, case '%s': no connection\n", j->name);
            check_child(pid, j->name);
            fail();
        }
        int fd = accept(lfd, NULL, NULL);
        assert_true(fd >= 0);
        uint8_t *vf;
        tdp_hello vh;
        assert_true(read_hello(fd, &vf, &vh));
        attack(fd, &vh, j);
        int why = victim_answer(fd, j->must_eproto ? TMO : 1500);
        close(fd);
        free(vf);
        usleep(50 * 1000);
        int st;
        if (!alive(pid, &st)) {
            printf("hostile listener, %-40s -> the client died\n", j->name);
            note_death("client", j->name, st);
            close(good_fd);
            pid = start_client_victim(ntohs(sa.sin_port), k + 1, &good_fd);
            continue;
        }
        printf("hostile listener, %-40s -> %s\n", j->name,
               why == 1 ? "no BYE (pipe opened or quiet)" : tdp_strerror((tdp_err)why));
        if (j->must_eproto && why != TDP_EPROTO)
            note_wrong("client", j->name, why);
    }
    close(lfd);
    /* the client still reaches a good listener */
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, NULL, NULL, NULL, &l), TDP_OK);
    uint16_t port = tdp_listener_port(l);
    assert_int_equal(write(good_fd, &port, sizeof(port)), (ssize_t)sizeof(port));
    close(good_fd);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    assert_int_equal(send_one(p), TDP_OK);
    check_child(pid, "client victim");
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    check_deaths();
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IONBF, 0); /* nothing buffered is copied into the victims */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostile_client),
        cmocka_unit_test(test_hostile_listener),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
