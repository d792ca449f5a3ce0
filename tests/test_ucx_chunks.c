/*
 * test_ucx_chunks.c: GPU payloads staged over the ucx plane as CHUNK frames
 * (docs/wire-format.md, "Chunked DATA"), on the fake CUDA device over UCX's
 * TCP transport: whole messages with late-completing copies (a missing wait
 * shows stale bytes), CHUNK frames from a hostile peer, and a sender killed
 * between chunks.
 */
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>
#include <event2/bufferevent.h>
#include <sys/socket.h>

#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "core/cuda.h"
#include "core/loop_int.h"
#include "pipe/op.h"
#include "pipe/session.h"
#include "pipe/session_int.h"
#include "pipe/ucx/plane_ucx.h"
#include "pipe/wire.h"
#include "test_rogue_am.h"
#include "test_util.h"

#define TMO 20000
#define MIB (1u << 20)

static tdp_schema *bytes_schema(int64_t nbytes, bool dev)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL, *d = NULL;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &nbytes), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    if (!dev)
        return s;
    assert_int_equal(tdp_schema_with_device(s, (tdp_device){TDP_DEVICE_CUDA, 0}, &d), TDP_OK);
    tdp_schema_unref(s);
    return d;
}

/* A pattern of (seq, offset): a stale or misplaced byte fails it. */
static void pattern(uint8_t *p, size_t n, uint64_t seq)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((i >> 12) * 31 + i * 7 + seq * 101);
}

/* Device memory is read and written through copies (touching it faults). */
static void fill(tdp_td *td, uint64_t seq)
{
    size_t n = tdp_td_nbytes(td);
    uint8_t *h = malloc(n);
    assert_non_null(h);
    pattern(h, n, seq);
    assert_int_equal(tdp_mem_copy(tdp_td_data(td), h, n), TDP_OK);
    free(h);
}

static bool verify(const tdp_td *td, uint64_t seq)
{
    size_t n = tdp_td_nbytes(td);
    uint8_t *h = malloc(n), *want = malloc(n);
    assert_true(h != NULL && want != NULL);
    assert_int_equal(tdp_mem_copy(h, tdp_td_data(td), n), TDP_OK);
    pattern(want, n, seq);
    bool ok = memcmp(h, want, n) == 0;
    free(h);
    free(want);
    return ok;
}

static void dev_opts(tdp_pipe_opts *o)
{
    tdp_pipe_opts_default(o);
    o->plane = TDP_PLANE_UCX;
    o->cuda_device_set = true;
    o->cuda_device = 0;
}

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
} env;

/* linger_ms: 0 for the default */
static void env_up_linger(env *e, int linger_ms)
{
    tdp_pipe_opts o;
    dev_opts(&o);
    if (linger_ms > 0)
        o.linger_ms = linger_ms;
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(e->sl, "127.0.0.1", 0, &o, NULL, NULL, &e->l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), &o, &e->cli),
                     TDP_OK);
    assert_int_equal(tdp_listener_accept(e->l, TMO, &e->srv), TDP_OK);
    assert_int_equal(tdp_pipe_plane(e->srv), TDP_PLANE_UCX);
}

static void env_up(env *e)
{
    env_up_linger(e, 0);
}

static void env_down(env *e)
{
    tdp_pipe_free(e->cli);
    tdp_pipe_free(e->srv);
    tdp_listener_free(e->l);
    /* the loops run on a moment: UCX 1.13 can abort destroying a worker
     * whose endpoint still has a wireup reply pending (seen after pipes
     * that failed early) */
    usleep(100000);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->sl);
}

/* ---- whole messages ------------------------------------------------------------ */

/* A thread that sends td `count` times, message i with pattern first + i. */
typedef struct sender {
    pthread_t th;
    tdp_pipe *pipe;
    tdp_td *td;
    int count;
    uint64_t first;
    tdp_err rc;
} sender;

static void *sender_main(void *arg)
{
    sender *s = arg;
    s->rc = TDP_OK;
    for (int i = 0; i < s->count && s->rc == TDP_OK; i++) {
        fill(s->td, s->first + (uint64_t)i);
        s->rc = tdp_pipe_send(s->pipe, s->td, TMO);
    }
    return NULL;
}

static void send_recv(env *e, tdp_td *td, int count, uint64_t first)
{
    sender snd = {.pipe = e->cli, .td = td, .count = count, .first = first};
    assert_int_equal(pthread_create(&snd.th, NULL, sender_main, &snd), 0);
    for (int i = 0; i < count; i++) {
        tdp_td *got;
        assert_int_equal(tdp_pipe_recv(e->srv, TMO, &got), TDP_OK);
        assert_true(verify(got, first + (uint64_t)i));
    }
    pthread_join(snd.th, NULL);
    assert_int_equal(snd.rc, TDP_OK);
}

/*
 * Messages of 10 and a bit chunks, each with its own pattern, through
 * copies the fake completes late (and later still with a delay): the
 * receiver hands out a message only once every chunk is on the device.
 */
static void roundtrip(unsigned delay_us)
{
    enum { COUNT = 4 };
    env e;
    tdp__cuda_fake_set_delay_us(delay_us);
    env_up(&e);
    tdp_schema *s = bytes_schema(40 * MIB + 12345, true);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    send_recv(&e, td, COUNT, 1);
    assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(e.cli), false), COUNT);
    assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(e.srv), true), COUNT);
    tdp__cuda_fake_set_delay_us(0);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

static void test_chunked_roundtrip(void **state)
{
    roundtrip(0);
}

static void test_chunked_late_copies(void **state)
{
    roundtrip(2000);
}

/* A message at the threshold is sent whole; one byte more is chunked. */
static void test_threshold(void **state)
{
    env e;
    env_up(&e);
    for (int k = 0; k < 2; k++) {
        tdp_schema *s = bytes_schema(4 * MIB + k, true);
        tdp_td *td;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        send_recv(&e, td, 1, 9);
        assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(e.srv), true), (uint64_t)k);
        tdp_td_unref(td);
        tdp_schema_unref(s);
    }
    env_down(&e);
}

/* A peer whose HELLO has no UCX_CHUNKS (an older one) gets whole messages. */
static void test_older_peer(void **state)
{
    env e;
    tdp__ucx_hello_no_chunks(true);
    env_up(&e);
    tdp__ucx_hello_no_chunks(false);
    tdp_schema *s = bytes_schema(20 * MIB + 3, true);
    tdp_td *td;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    send_recv(&e, td, 2, 4);
    assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(e.cli), false), 0);
    assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(e.srv), true), 0);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

/* ---- hostile frames ------------------------------------------------------------- */

/* One raw AM from the client's loop; returns once UCX let go of it (or the time is up). */
static void rogue_send(env *e, const tdp_am_hdr *h, const void *payload, size_t len)
{
    rogue_am_send(e->cl, e->cli, h, payload, len, false, TMO);
}

enum {
    H_GOOD,          /* three chunks, out of order: delivered */
    H_NO_DATA,       /* a CHUNK with no chunked DATA before it */
    H_OFF_GRID,      /* offset not a multiple of the chunk size */
    H_PAST_END,      /* a chunk index past the message */
    H_SHORT,         /* a chunk shorter than the grid says */
    H_TWICE,         /* the same chunk twice */
    H_OTHER_SEQ,     /* a chunk of another message */
    H_DATA_INSIDE,   /* a DATA while chunks are due */
    H_SCHEMA_INSIDE, /* a SCHEMA while chunks are due */
    H_BAD_SIZE,      /* a chunk size out of bounds */
    H_HOST_LAYOUT,   /* chunked DATA for a layout this side does not stage */
    H_CASES
};

/*
 * One real message from the server first: UCX's TCP wireup is done both
 * ways before the server ends the pipe (UCX 1.13 can abort destroying a
 * worker while an endpoint's wireup reply is still pending).
 */
static void warm_up(env *e)
{
    tdp_schema *s = bytes_schema(64, false);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    memset(tdp_td_data(td), 1, 64);
    assert_int_equal(tdp_pipe_send(e->srv, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e->cli, TMO, &got), TDP_OK);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void hostile(int kind, tdp_err want)
{
    env e;
    env_up(&e);
    warm_up(&e);
    tdp_schema *s = bytes_schema(2 * MIB + MIB / 2 + 5, kind != H_HOST_LAYOUT);
    const size_t n = tdp_schema_total_bytes(s); /* three chunks of 1 MiB, the last short */
    size_t jl;
    const char *json = tdp_schema_json(s, &jl);
    uint64_t tok = tdp__ucx_link_peer_token(tdp__session_link(e.cli));
    uint64_t hash = tdp_schema_hash(s);
    uint8_t *bytes = malloc(n);
    assert_non_null(bytes);
    pattern(bytes, n, 5);
    uint32_t csize = kind == H_BAD_SIZE ? 4096 : MIB;
    uint8_t desc[8] = {(uint8_t)csize, (uint8_t)(csize >> 8), (uint8_t)(csize >> 16),
                       (uint8_t)(csize >> 24)};

    tdp_am_hdr h = {
        .type = TDP_AM_SCHEMA, .token = tok, .seq = 1, .hash = hash, .length = jl, .arg = n};
    rogue_send(&e, &h, json, jl);
    if (kind != H_NO_DATA) {
        h = (tdp_am_hdr){.type = TDP_AM_DATA,
                         .flags = TDP_AM_F_CHUNKED,
                         .token = tok,
                         .seq = 1,
                         .hash = hash,
                         .length = n};
        rogue_send(&e, &h, desc, sizeof(desc));
    }
    /* the chunks, in the order 2, 0, 1 (UCX may reorder them too) */
    const size_t off[3] = {2 * MIB, 0, MIB};
    for (int i = 0; i < 3; i++) {
        size_t o = off[i], len = o + MIB > n ? n - o : MIB;
        h = (tdp_am_hdr){
            .type = TDP_AM_CHUNK, .token = tok, .seq = 1, .hash = hash, .length = len, .arg = o};
        if (i == 1) {
            if (kind == H_OFF_GRID)
                h.arg = 4096;
            else if (kind == H_PAST_END)
                h.arg = 3 * MIB;
            else if (kind == H_SHORT)
                h.length = len = 1000;
            else if (kind == H_TWICE)
                h.arg = o = 2 * MIB, h.length = len = n - o;
            else if (kind == H_OTHER_SEQ)
                h.seq = 2;
        }
        if (i == 1 && kind == H_DATA_INSIDE) {
            tdp_am_hdr d = {.type = TDP_AM_DATA, .token = tok, .seq = 2, .hash = hash, .length = n};
            rogue_send(&e, &d, bytes, n);
            break;
        }
        if (i == 1 && kind == H_SCHEMA_INSIDE) {
            tdp_am_hdr d = {.type = TDP_AM_SCHEMA,
                            .token = tok,
                            .seq = 2,
                            .hash = hash,
                            .length = jl,
                            .arg = n};
            rogue_send(&e, &d, json, jl);
            break;
        }
        rogue_send(&e, &h, bytes + h.arg % n, len);
        if (want != TDP_OK && tdp_pipe_status(e.srv) != TDP_OK)
            break; /* refused already: nothing more reaches it */
    }
    tdp_td *got = NULL;
    tdp_err rc = tdp_pipe_recv(e.srv, TMO, &got);
    print_message("case %d: %s\n", kind, tdp_errname(rc));
    assert_int_equal(rc, want);
    if (want == TDP_OK) {
        size_t nn = tdp_td_nbytes(got);
        uint8_t *h2 = malloc(nn);
        assert_non_null(h2);
        assert_int_equal(tdp_mem_copy(h2, tdp_td_data(got), nn), TDP_OK);
        assert_int_equal(nn, n);
        assert_memory_equal(h2, bytes, n);
        free(h2);
    }
    free(bytes);
    tdp_schema_unref(s);
    env_down(&e);
}

static void test_hostile_chunks(void **state)
{
    hostile(H_GOOD, TDP_OK);
    for (int k = H_NO_DATA; k < H_CASES; k++)
        hostile(k, TDP_EPROTO);
}

/* ---- a peer that never reads its control socket -------------------------------- */

/* On a pipe's loop: stop reading its control socket, and let the kernel hold little. */
static void deaf_task(void *arg)
{
    tdp_pipe *p = arg;
    int one = 1;
    bufferevent_disable(p->ctl.bev, EV_READ);
    (void)setsockopt(bufferevent_getfd(p->ctl.bev), SOL_SOCKET, SO_RCVBUF, &one, sizeof(one));
}

static void small_sndbuf_task(void *arg)
{
    tdp_pipe *p = arg;
    int one = 1;
    (void)setsockopt(bufferevent_getfd(p->ctl.bev), SOL_SOCKET, SO_SNDBUF, &one, sizeof(one));
}

/*
 * A peer that sends the same prepared SCHEMA over and over and never reads
 * its control socket: each one is answered by a READY that cannot leave.
 * The receiver ends the pipe with TDP_ELIMIT once 64 KiB of them wait,
 * instead of queueing 32 bytes per frame without a bound.
 */
static void test_ready_flood(void **state)
{
    (void)state;
    enum { MAX_FRAMES = 100000 };
    env e;
    env_up(&e);
    warm_up(&e);
    tdp__call_on_loop(e.cl, deaf_task, e.cli);
    tdp__call_on_loop(e.sl, small_sndbuf_task, e.srv);
    tdp_schema *s = bytes_schema(64, false);
    size_t jl;
    const char *json = tdp_schema_json(s, &jl);
    tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                    .flags = TDP_AM_F_PREPARE,
                    .token = tdp__ucx_link_peer_token(tdp__session_link(e.cli)),
                    .seq = 1,
                    .hash = tdp_schema_hash(s),
                    .length = jl,
                    .arg = tdp_schema_total_bytes(s)};
    int sent = 0;
    while (sent < MAX_FRAMES && tdp_pipe_status(e.srv) == TDP_OK) {
        for (int k = 0; k < 100; k++, sent++)
            rogue_send(&e, &h, json, jl);
    }
    /* the last ones may still be in UCX's hands: the verdict within the time */
    for (int i = 0; i < 5000 && tdp_pipe_status(e.srv) == TDP_OK; i++)
        usleep(1000);
    print_message("%d prepared SCHEMAs, unanswered: the receiver's pipe %s\n", sent,
                  tdp_errname(tdp_pipe_status(e.srv)));
    assert_int_equal(tdp_pipe_status(e.srv), TDP_ELIMIT);
    assert_true(sent > 1000); /* not before READYs could pile up */
    tdp_schema_unref(s);
    env_down(&e);
}

/*
 * A peer that says BYE naming a chunked message whose DATA frame came and
 * whose CHUNKs never do (it keeps its socket and endpoint open): the
 * message announced never lands, so the pipe ends at the linger deadline
 * with TDP_ECONNRESET instead of staying open with a receive that can
 * never complete.
 */
typedef struct bye_req {
    tdp_pipe *p;
    uint64_t last_seq;
} bye_req;

static void bye_task(void *arg)
{
    bye_req *r = arg;
    tdp_bye b = {.last_seq = r->last_seq, .reason = TDP_OK};
    tdp__ctl_send_bye(&r->p->ctl, &b);
}

/*
 * A chunked message of three chunks (1 MiB, 1 MiB, the rest): SCHEMA,
 * DATA and the first chunk from a rogue sender, then its BYE naming it.
 */
typedef struct bye_rig {
    env e;
    tdp_schema *s;
    uint8_t *bytes;
    uint64_t tok, hash;
    size_t n;
} bye_rig;

static void bye_rig_up(bye_rig *r, int linger_ms)
{
    env_up_linger(&r->e, linger_ms);
    warm_up(&r->e);
    r->s = bytes_schema(2 * MIB + MIB / 2 + 5, true);
    r->n = tdp_schema_total_bytes(r->s);
    size_t jl;
    const char *json = tdp_schema_json(r->s, &jl);
    r->tok = tdp__ucx_link_peer_token(tdp__session_link(r->e.cli));
    r->hash = tdp_schema_hash(r->s);
    r->bytes = calloc(1, MIB);
    assert_non_null(r->bytes);
    const uint8_t desc[8] = {0, 0, 0x10, 0}; /* chunks of 1 MiB */

    tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                    .token = r->tok,
                    .seq = 1,
                    .hash = r->hash,
                    .length = jl,
                    .arg = r->n};
    rogue_send(&r->e, &h, json, jl);
    h = (tdp_am_hdr){.type = TDP_AM_DATA,
                     .flags = TDP_AM_F_CHUNKED,
                     .token = r->tok,
                     .seq = 1,
                     .hash = r->hash,
                     .length = r->n};
    rogue_send(&r->e, &h, desc, sizeof(desc));
    h = (tdp_am_hdr){
        .type = TDP_AM_CHUNK, .token = r->tok, .seq = 1, .hash = r->hash, .length = MIB, .arg = 0};
    rogue_send(&r->e, &h, r->bytes, MIB);
    bye_req br = {.p = r->e.cli, .last_seq = 1};
    tdp__call_on_loop(r->e.cl, bye_task, &br);
}

/* chunk i (1 or 2) of the rig's message */
static void bye_rig_chunk(bye_rig *r, int i)
{
    size_t off = (size_t)i * MIB;
    size_t len = r->n - off < MIB ? r->n - off : MIB;
    tdp_am_hdr h = {.type = TDP_AM_CHUNK,
                    .token = r->tok,
                    .seq = 1,
                    .hash = r->hash,
                    .length = len,
                    .arg = off};
    rogue_send(&r->e, &h, r->bytes, len);
}

static void bye_rig_down(bye_rig *r)
{
    free(r->bytes);
    tdp_schema_unref(r->s);
    env_down(&r->e);
}

static void test_bye_mid_chunks(void **state)
{
    (void)state;
    enum { LINGER = 300, WAIT = 5000 };
    bye_rig r;
    bye_rig_up(&r, LINGER); /* the first of its three chunks, then nothing more */
    tdp_td *got = NULL;
    int64_t t0 = mono_ms();
    tdp_err rc = tdp_pipe_recv(r.e.srv, WAIT, &got);
    int64_t dt = mono_ms() - t0;
    print_message("BYE with its chunks missing: %s after %" PRId64 " ms\n", tdp_errname(rc), dt);
    assert_int_equal(rc, TDP_ECONNRESET);
    assert_true(dt < WAIT);
    bye_rig_down(&r);
}

/*
 * The same BYE from a peer whose chunks are still on their way over a slow
 * link: they come in longer than the linger in all, but never with a gap
 * as long. The wait goes on while they come: the message is delivered
 * whole, then the pipe ends cleanly.
 */
static void test_bye_slow_chunks(void **state)
{
    (void)state;
    enum { LINGER = 400, GAP = 250, WAIT = 5000 };
    bye_rig r;
    bye_rig_up(&r, LINGER);
    int64_t t0 = mono_ms();
    usleep(GAP * 1000);
    bye_rig_chunk(&r, 1);
    usleep(GAP * 1000);
    bye_rig_chunk(&r, 2);
    tdp_td *got = NULL;
    tdp_err rc = tdp_pipe_recv(r.e.srv, WAIT, &got);
    print_message("BYE, then chunks %d ms apart (linger %d ms): %s after %" PRId64 " ms\n", GAP,
                  LINGER, tdp_errname(rc), mono_ms() - t0);
    assert_int_equal(rc, TDP_OK);
    assert_int_equal(tdp_td_nbytes(got), r.n);
    tdp_pipe_release(r.e.srv, got);
    assert_int_equal(tdp_pipe_recv(r.e.srv, WAIT, &got), TDP_ECLOSED);
    bye_rig_down(&r);
}

/* ---- a sender killed between chunks ------------------------------------------- */

#define KILL_SIZE (64 * MIB)

/* Child: send device messages of 16 chunks; the fake kills it after copy `after`. */
static void child_send(uint16_t port, unsigned after)
{
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_pipe_opts o;
    dev_opts(&o);
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p) != TDP_OK)
        _exit(3);
    tdp_schema *s = bytes_schema(KILL_SIZE, true);
    tdp_td *td;
    if (tdp_td_new(s, &td) != TDP_OK)
        _exit(3);
    fill(td, 1);
    if (tdp_pipe_send(p, td, TMO) != TDP_OK) /* one whole message first */
        _exit(4);
    fill(td, 2);
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_KILL_AFTER_COPY, after);
    for (int i = 0; i < 100; i++)
        if (tdp_pipe_send(p, td, TMO) != TDP_OK)
            _exit(4);
    _exit(0);
}

static void test_killed_mid_chunks(void **state)
{
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    tdp_pipe_opts o;
    dev_opts(&o);
    assert_int_equal(tdp_loop_new(NULL, &loop), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(loop), TDP_OK);
    assert_int_equal(tdp_listener_new(loop, "127.0.0.1", 0, &o, NULL, NULL, &l), TDP_OK);
    fflush(NULL);
    pid_t pid = fork(); /* and exec: UCX's state does not survive a bare fork */
    assert_true(pid >= 0);
    if (pid == 0) {
        char ps[16];
        snprintf(ps, sizeof(ps), "%u", tdp_listener_port(l));
        execl("/proc/self/exe", "test_ucx_chunks", "--child", ps, "6", (char *)NULL);
        _exit(127);
    }
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    assert_true(verify(got, 1));
    /* the link goes with the pipe's failure: count its chunked messages now */
    assert_int_equal(tdp__ucx_link_chunked(tdp__session_link(p), true), 1);
    int64_t t0 = mono_ms();
    /* the second message dies after 6 of its 16 chunk copies: never handed out */
    tdp_err rc = tdp_pipe_recv(p, TMO, &got);
    int64_t dt = mono_ms() - t0;
    print_message("sender killed mid-message: %s after %" PRId64 " ms\n", tdp_errname(rc), dt);
    assert_int_equal(rc, TDP_ECONNRESET);
    assert_true(dt < TMO);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
}

int main(int argc, char **argv)
{
    /* the ucx plane's staging, on the fake device, over UCX's TCP transport */
    setenv("TDPIPE_CUDA", "fake", 1);
    setenv("UCX_TLS", "tcp", 1);
    if (argc == 4 && strcmp(argv[1], "--child") == 0)
        child_send((uint16_t)atoi(argv[2]), (unsigned)atoi(argv[3]));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunked_roundtrip), cmocka_unit_test(test_chunked_late_copies),
        cmocka_unit_test(test_threshold),         cmocka_unit_test(test_older_peer),
        cmocka_unit_test(test_hostile_chunks),    cmocka_unit_test(test_killed_mid_chunks),
        cmocka_unit_test(test_ready_flood),       cmocka_unit_test(test_bye_mid_chunks),
        cmocka_unit_test(test_bye_slow_chunks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
