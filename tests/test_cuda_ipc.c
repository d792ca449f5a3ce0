/*
 * test_cuda_ipc: the same-host GPU plane (cuda-ipc) on the fake device
 * (TDPIPE_CUDA=fake where the machine has no GPU: device memory faults when
 * host code touches it, so every payload byte here goes through copies).
 *
 * What the conformance suite (test_pipe_cuda_ipc) does not show: which
 * plane the HELLO picks; that nothing is copied (the receiver's tensors lie
 * in the sender's exported pool, or share its pointer within one process);
 * loans of device slots across a schema change; a host receive device;
 * hostile pool announcements and descriptors; and a producer process that
 * dies while the receiver still holds its view.
 */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

#include "core/cuda.h"
#include "pipe/cudaipc/cudaipc.h"
#include "pipe/shm/shm_hello.h"
#include "pipe/op.h"
#include "pipe/session.h"
#include "pipe/shm/plane_shm.h"

#define TMO 20000

static const tdp_device GPU0 = {TDP_DEVICE_CUDA, 0};

/* ---- helpers ------------------------------------------------------------------- */

static tdp_schema *bytes_schema(int64_t n, bool gpu)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL, *d = NULL;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &n), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    if (!gpu)
        return s;
    assert_int_equal(tdp_schema_with_device(s, GPU0, &d), TDP_OK);
    tdp_schema_unref(s);
    return d;
}

static uint8_t pat(uint64_t seq, size_t i)
{
    return (uint8_t)(seq * 131u + i * 7u + (i >> 9));
}

/* Fill td (device or host) with message seq's pattern, through a copy. */
static void fill(tdp_td *td, uint64_t seq)
{
    size_t n = tdp_td_nbytes(td);
    uint8_t *h = malloc(n);
    assert_non_null(h);
    for (size_t i = 0; i < n; i++)
        h[i] = pat(seq, i);
    assert_int_equal(tdp_mem_copy(tdp_td_data(td), h, n), TDP_OK);
    free(h);
}

static bool verify(const tdp_td *td, uint64_t seq)
{
    size_t n = tdp_td_nbytes(td);
    uint8_t *h = malloc(n);
    assert_non_null(h);
    assert_int_equal(tdp_mem_copy(h, tdp_td_data(td), n), TDP_OK);
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++)
        ok = h[i] == pat(seq, i);
    free(h);
    return ok;
}

static void gpu_opts(tdp_pipe_opts *o, uint32_t depth)
{
    tdp_pipe_opts_default(o);
    o->cuda_device_set = true;
    o->cuda_device = 0;
    o->recv_depth = depth;
}

typedef struct env {
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe *srv, *cli;
} env;

static void env_up(env *e, const tdp_pipe_opts *so, const tdp_pipe_opts *co)
{
    memset(e, 0, sizeof(*e));
    assert_int_equal(tdp_loop_new(NULL, &e->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &e->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(e->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(e->sl, "127.0.0.1", 0, so, NULL, NULL, &e->l), TDP_OK);
    assert_int_equal(tdp_pipe_connect(e->cl, "127.0.0.1", tdp_listener_port(e->l), co, &e->cli),
                     TDP_OK);
    assert_int_equal(tdp_listener_accept(e->l, TMO, &e->srv), TDP_OK);
}

static void env_down(env *e)
{
    tdp_pipe_free(e->cli);
    tdp_pipe_free(e->srv);
    tdp_listener_free(e->l);
    tdp_loop_free(e->cl);
    tdp_loop_free(e->sl);
}

/* Whether p lies in a pool of the pipe's link (run on its loop: links are the loop's). */
typedef struct in_pool {
    tdp_pipe *pipe;
    const void *p;
    bool yes;
} in_pool;

static void in_pool_task(void *arg)
{
    in_pool *q = arg;
    q->yes = tdp__shm_view_in_pool(tdp__session_link(q->pipe), q->p);
}

static bool view_in_pool(tdp_loop *loop, tdp_pipe *pipe, const void *p)
{
    in_pool q = {pipe, p, false};
    tdp__call_on_loop(loop, in_pool_task, &q);
    return q.yes;
}

/* A loan, retried while the plane asks for it (the peer's proof may be on its way). */
static tdp_err loan(tdp_pipe *p, tdp_schema *s, tdp_td **out)
{
    tdp_err rc = TDP_EAGAIN;
    for (int i = 0; i < 2000 && rc == TDP_EAGAIN; i++) {
        rc = tdp_pipe_loan(p, s, out);
        if (rc == TDP_EAGAIN)
            usleep(1000);
    }
    return rc;
}

/* ---- the choice ------------------------------------------------------------------ */

/* Chosen when both pipes name a GPU; a pipe that names none offers shm only. */
static void test_choice(void **state)
{
    (void)state;
    tdp_pipe_opts g, h, f;
    gpu_opts(&g, 1);
    tdp_pipe_opts_default(&h);
    gpu_opts(&f, 1);
    f.planes_forbidden = 1u << TDP_PLANE_CUDA_IPC;
    struct {
        const tdp_pipe_opts *so, *co;
        tdp_plane want;
    } cases[] = {
        {&g, &g, TDP_PLANE_CUDA_IPC},
        {&g, &h, TDP_PLANE_SHM},
        {&h, &g, TDP_PLANE_SHM},
        {&g, &f, TDP_PLANE_SHM},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        env e;
        env_up(&e, cases[i].so, cases[i].co);
        print_message("case %zu: %s / %s\n", i, tdp_plane_name(tdp_pipe_plane(e.cli)),
                      tdp_plane_name(tdp_pipe_plane(e.srv)));
        assert_int_equal(tdp_pipe_plane(e.cli), cases[i].want);
        assert_int_equal(tdp_pipe_plane(e.srv), cases[i].want);
        env_down(&e);
    }
    tdp_plane pl;
    assert_int_equal(tdp_plane_parse("cuda-ipc", &pl), TDP_OK);
    assert_int_equal(pl, TDP_PLANE_CUDA_IPC);
}

/* The record and the reach rule: symmetric, by UUID, never by index. */
static void test_reach_rule(void **state)
{
    (void)state;
    static const uint8_t key[16] = {1};
    tdp__shm_hello sock = {key, "tdpipe.x", 8};
    uint8_t buf[TDP_SHM_IPC_REC_MAX];
    size_t len;
    assert_int_equal(tdp__shm_ipc_hello_encode(buf, &sock, 0, &len), TDP_OK);
    tdp__shm_ipc_hello a, b;
    assert_int_equal(tdp__shm_ipc_hello_parse(buf, len, &a), TDP_OK);
    assert_int_equal(a.gpus.ndev, (uint8_t)tdp__cuda_device_count());
    assert_int_equal(a.gpus.dev, 0);
    assert_true(tdp__cudaipc_reach(&a.gpus, &a.gpus));
    /* no device: the plane is not offered */
    assert_int_equal(tdp__shm_ipc_hello_encode(buf, &sock, 99, &len), TDP_ENOTSUP);
    /* a peer that sees another GPU only (its own index 0 too): not reachable, both ways */
    uint8_t other[TDP_SHM_REC_MAX + 2 + 16];
    size_t off = tdp__shm_hello_encode(other, &sock);
    other[off] = 1;
    other[off + 1] = 0;
    memset(other + off + 2, 0xee, 16);
    assert_int_equal(tdp__shm_ipc_hello_parse(other, off + 18, &b), TDP_OK);
    assert_false(tdp__cudaipc_reach(&a.gpus, &b.gpus));
    assert_false(tdp__cudaipc_reach(&b.gpus, &a.gpus));
    /* malformed: device index past the list, wrong length, no device */
    other[off + 1] = 1;
    assert_int_equal(tdp__shm_ipc_hello_parse(other, off + 18, &b), TDP_EPROTO);
    other[off + 1] = 0;
    assert_int_equal(tdp__shm_ipc_hello_parse(other, off + 17, &b), TDP_EPROTO);
    other[off] = 0;
    assert_int_equal(tdp__shm_ipc_hello_parse(other, off + 2, &b), TDP_EPROTO);
}

/* ---- zero copy -------------------------------------------------------------------- */

/*
 * A plain send copies once, device to device, into a slot; the receiver's
 * tensor lies in that slot: in the receiver's pool, which within one
 * process is the sender's own memory (shared, not imported).
 */
static void test_plain_send_no_copy(void **state)
{
    (void)state;
    tdp_pipe_opts o;
    gpu_opts(&o, 2);
    env e;
    env_up(&e, &o, &o);
    assert_int_equal(tdp_pipe_plane(e.cli), TDP_PLANE_CUDA_IPC);
    tdp_schema *s = bytes_schema(1 << 20, true);
    tdp_td *td, *got, *got2;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    uint64_t imports = tdp__dpool_imports(), exports = tdp__dpool_exports();
    fill(td, 1);
    assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_true(verify(got, 1));
    assert_int_equal(tdp_td_device(got).type, TDP_DEVICE_CUDA);
    assert_true(view_in_pool(e.sl, e.srv, tdp_td_data(got)));
    assert_true(view_in_pool(e.cl, e.cli, tdp_td_data(got))); /* the sender's memory */
    assert_true(tdp_td_data(got) != tdp_td_data(td));
    /* one pool exported for the layout; shared by pointer here, never imported */
    assert_int_equal(tdp__dpool_exports(), exports + 1);
    assert_int_equal(tdp__dpool_imports(), imports);
    /* a second message while the first is held: another slot, nothing more exported */
    fill(td, 2);
    assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got2), TDP_OK);
    assert_true(tdp_td_data(got2) != tdp_td_data(got));
    assert_true(verify(got2, 2));
    assert_true(verify(got, 1)); /* not rewritten while held */
    assert_int_equal(tdp__dpool_exports(), exports + 1);
    tdp_pipe_release(e.srv, got);
    tdp_pipe_release(e.srv, got2);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

/* A loaned device slot: its send carries only a descriptor; the receiver views the same bytes. */
static void test_loan_no_copy(void **state)
{
    (void)state;
    tdp_pipe_opts o;
    gpu_opts(&o, 2);
    env e;
    env_up(&e, &o, &o);
    tdp_schema *s = bytes_schema(64 << 10, true);
    tdp_td *buf, *got;
    assert_int_equal(loan(e.cli, s, &buf), TDP_OK);
    assert_int_equal(tdp_td_device(buf).type, TDP_DEVICE_CUDA);
    assert_true(view_in_pool(e.cl, e.cli, tdp_td_data(buf)));
    void *where = tdp_td_data(buf);
    fill(buf, 7);
    assert_int_equal(tdp_pipe_send(e.cli, buf, TMO), TDP_OK);
    tdp_td_unref(buf);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_ptr_equal(tdp_td_data(got), where); /* the very bytes the producer wrote */
    assert_true(verify(got, 7));
    tdp_pipe_release(e.srv, got);
    tdp_schema_unref(s);
    env_down(&e);
}

/*
 * A larger layout makes a new pool while a loan of the old one is out and
 * a view of the old one is held: the loan is still sent (copied into the
 * new pool), the held view stays intact.
 */
static void test_schema_change_with_loans_out(void **state)
{
    (void)state;
    tdp_pipe_opts o;
    gpu_opts(&o, 2);
    env e;
    env_up(&e, &o, &o);
    tdp_schema *small = bytes_schema(8 << 10, true), *big = bytes_schema(3 << 20, true);
    tdp_td *l1, *l2, *tb, *got1, *got2, *got3;
    assert_int_equal(loan(e.cli, small, &l1), TDP_OK);
    fill(l1, 1);
    assert_int_equal(tdp_pipe_send(e.cli, l1, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got1), TDP_OK); /* held: old pool */
    assert_int_equal(loan(e.cli, small, &l2), TDP_OK);          /* out: old pool */
    fill(l2, 3);
    uint64_t exports = tdp__dpool_exports();
    assert_int_equal(tdp_td_new(big, &tb), TDP_OK);
    fill(tb, 2);
    assert_int_equal(tdp_pipe_send(e.cli, tb, TMO), TDP_OK); /* a new pool */
    assert_int_equal(tdp__dpool_exports(), exports + 1);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got2), TDP_OK);
    assert_true(verify(got2, 2));
    assert_true(verify(got1, 1));
    tdp_pipe_release(e.srv, got1);
    tdp_pipe_release(e.srv, got2);
    assert_int_equal(tdp_pipe_send(e.cli, l2, TMO), TDP_OK); /* the old loan, copied */
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got3), TDP_OK);
    assert_true(verify(got3, 3));
    assert_true(tdp_td_data(got3) != tdp_td_data(l2));
    tdp_pipe_release(e.srv, got3);
    tdp_td_unref(l1);
    tdp_td_unref(l2);
    tdp_td_unref(tb);
    tdp_schema_unref(small);
    tdp_schema_unref(big);
    env_down(&e);
}

/* A receive device on the host: one copy out of the device slot, into host memory. */
static void test_recv_to_host(void **state)
{
    (void)state;
    tdp_pipe_opts so, co;
    gpu_opts(&so, 2);
    gpu_opts(&co, 2);
    so.recv_device_set = true;
    so.recv_device = (tdp_device){TDP_DEVICE_CPU, 0};
    env e;
    env_up(&e, &so, &co);
    assert_int_equal(tdp_pipe_plane(e.cli), TDP_PLANE_CUDA_IPC);
    tdp_schema *s = bytes_schema(5 << 20, true);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (uint64_t i = 1; i <= 3; i++) {
        fill(td, i);
        assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        assert_int_equal(tdp_td_device(got).type, TDP_DEVICE_CPU);
        assert_false(view_in_pool(e.sl, e.srv, tdp_td_data(got)));
        const uint8_t *h = tdp_td_data(got); /* host memory: read directly */
        assert_int_equal(h[0], pat(i, 0));
        assert_int_equal(h[tdp_td_nbytes(got) - 1], pat(i, tdp_td_nbytes(got) - 1));
        assert_true(verify(got, i));
        tdp_pipe_release(e.srv, got);
    }
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

/*
 * Two GPUs (the fake's cuda:0 and cuda:1): a payload on the GPU the pipe
 * does not name gets a pool of its own device; a receive device on the
 * other GPU is one peer copy, out of the pool into that GPU's memory.
 */
static void test_two_gpus(void **state)
{
    (void)state;
    if (tdp__cuda_device_count() < 2) {
        print_message("skipped: needs two devices (the fake has them: TDPIPE_CUDA=fake:2)\n");
        skip();
    }
    tdp_pipe_opts so, co;
    gpu_opts(&so, 2);
    gpu_opts(&co, 2);
    so.recv_device_set = true;
    so.recv_device = (tdp_device){TDP_DEVICE_CUDA, 1};
    env e;
    env_up(&e, &so, &co);
    assert_int_equal(tdp_pipe_plane(e.cli), TDP_PLANE_CUDA_IPC);
    tdp_schema *s0 = bytes_schema(1 << 20, true), *s1;
    assert_int_equal(tdp_schema_with_device(s0, (tdp_device){TDP_DEVICE_CUDA, 1}, &s1), TDP_OK);
    tdp_td *td0, *td1, *got;
    assert_int_equal(tdp_td_new(s0, &td0), TDP_OK);
    assert_int_equal(tdp_td_new(s1, &td1), TDP_OK);
    /* from cuda:0 into the receiver's cuda:1: a peer copy, not a view */
    fill(td0, 1);
    assert_int_equal(tdp_pipe_send(e.cli, td0, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_int_equal(tdp_td_device(got).index, 1);
    assert_false(view_in_pool(e.sl, e.srv, tdp_td_data(got)));
    assert_true(verify(got, 1));
    tdp_pipe_release(e.srv, got);
    /* from cuda:1: a pool on cuda:1, which the receive layout views in place */
    uint64_t exports = tdp__dpool_exports();
    fill(td1, 2);
    assert_int_equal(tdp_pipe_send(e.cli, td1, TMO), TDP_OK);
    assert_int_equal(tdp__dpool_exports(), exports + 1);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    assert_int_equal(tdp_td_device(got).index, 1);
    assert_true(view_in_pool(e.sl, e.srv, tdp_td_data(got)));
    assert_true(verify(got, 2));
    tdp_pipe_release(e.srv, got);
    tdp_td_unref(td0);
    tdp_td_unref(td1);
    tdp_schema_unref(s0);
    tdp_schema_unref(s1);
    env_down(&e);
}

/* ---- hostile senders ------------------------------------------------------------------ */

typedef struct rogue {
    tdp__link *l;
    int kind;
    uint64_t seq;
    uint64_t hash;
    tdp__dpool *keep;
    tdp_err rc;
} rogue;

enum {
    R_SLOT_PAST,     /* DATA naming a slot past the pool in force */
    R_POOL_SHORT,    /* a pool claiming more bytes than its memory has (imported) */
    R_POOL_SHORT_SP, /* the same, found by id in this process */
    R_POOL_UUID,     /* a pool on a device this side does not see */
    R_POOL_STRIDE,   /* a stride that is not a whole number of pages */
    R_POOL_SLOTS,    /* more slots than this side's depth allows */
    R_COUNT
};

static void rogue_task(void *arg)
{
    rogue *r = arg;
    static const uint8_t nowhere[16] = {0xde, 0xad};
    tdp__shm_desc d = {.type = tdp__shm_desc_word(TDP__SHM_DESC_DATA, 1),
                       .slot = 0,
                       .seq = r->seq,
                       .hash = r->hash,
                       .arg = 4096};
    r->rc = TDP_OK;
    switch (r->kind) {
    case R_SLOT_PAST:
        d.slot = 1000;
        break;
    case R_POOL_SHORT:
        r->rc = tdp__shm_rogue_dpool(r->l, r->seq, 0, 4096, 4, 1 << 20, NULL, NULL);
        break;
    case R_POOL_SHORT_SP:
        r->rc = tdp__shm_rogue_dpool(r->l, r->seq, 0, 4096, 4, 1 << 20, NULL, &r->keep);
        break;
    case R_POOL_UUID:
        r->rc = tdp__shm_rogue_dpool(r->l, r->seq, 0, 4 * 4096, 4, 4096, nowhere, NULL);
        break;
    case R_POOL_STRIDE:
        r->rc = tdp__shm_rogue_dpool(r->l, r->seq, 0, 4 * 8192, 4, 4097, NULL, NULL);
        break;
    case R_POOL_SLOTS:
        r->rc = tdp__shm_rogue_dpool(r->l, r->seq, 0, 4096 * 1000, 1000, 4096, NULL, NULL);
        break;
    }
    if (r->kind != R_SLOT_PAST)
        d.type = tdp__shm_desc_word(TDP__SHM_DESC_DATA, 2); /* the announced generation */
    if (r->rc == TDP_OK)
        r->rc = tdp__shm_rogue_data(r->l, &d, NULL, 0, r->seq, 0);
}

/*
 * Whatever a hostile sender names — a slot past the pool, a pool whose
 * memory is smaller than it claims, on a GPU this side does not see, with
 * a bad stride or too many slots — the receiver fails the pipe with
 * TDP_EPROTO and touches nothing; the view it holds stays intact.
 */
static void test_hostile_pools(void **state)
{
    (void)state;
    for (int k = 0; k < R_COUNT; k++) {
        tdp_pipe_opts o;
        gpu_opts(&o, 2);
        env e;
        env_up(&e, &o, &o);
        tdp_schema *s = bytes_schema(4096, true);
        tdp_td *td, *got, *next;
        assert_int_equal(tdp_td_new(s, &td), TDP_OK);
        fill(td, 1);
        assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
        rogue r = {.l = tdp__session_link(e.cli), .kind = k, .seq = 2, .hash = tdp_schema_hash(s)};
        tdp__call_on_loop(e.cl, rogue_task, &r);
        assert_int_equal(r.rc, TDP_OK);
        tdp_err rc = tdp_pipe_recv(e.srv, TMO, &next);
        print_message("hostile case %d: %s\n", k, tdp_errname(rc));
        assert_int_equal(rc, TDP_EPROTO);
        assert_true(verify(got, 1));
        tdp_pipe_release(e.srv, got);
        tdp__dpool_unref(r.keep);
        tdp_td_unref(td);
        tdp_schema_unref(s);
        env_down(&e);
    }
}

/* Announce n valid device pools for seq, none with its DATA (on the sender's loop). */
typedef struct flood {
    tdp__link *l;
    int n;
    tdp_err rc;
    tdp__dpool *keep[8]; /* alive until the test ends: one process, shared by id */
} flood;

static void flood_task(void *arg)
{
    flood *f = arg;
    f->rc = TDP_OK;
    for (int i = 0; i < f->n && f->rc == TDP_OK; i++)
        f->rc = tdp__shm_rogue_dpool(f->l, 2, 0, 4 * 4096, 4, 4096, NULL, &f->keep[i]);
}

/*
 * A flood of DPOOLs whose DATA never comes: the receiver imports the first
 * as it comes (a prepared layout's pool), and none of the others. The
 * sender keeps its pools: in one process they are shared by id (a freed
 * pool's handle, imported in the process that made it, failed on an H200
 * and the receiver closed the link).
 */
static void test_dpool_flood(void **state)
{
    (void)state;
    tdp_pipe_opts o;
    gpu_opts(&o, 2);
    env e;
    env_up(&e, &o, &o);
    tdp_schema *s = bytes_schema(4096, true);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    fill(td, 1);
    assert_int_equal(tdp_pipe_send(e.cli, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(e.srv, TMO, &got), TDP_OK);
    tdp_pipe_release(e.srv, got);
    /* opened: imported, or (the sender's pool still alive) shared by id */
    uint64_t opens = tdp__dpool_opens();
    flood f = {.l = tdp__session_link(e.cli), .n = 5};
    tdp__call_on_loop(e.cl, flood_task, &f);
    assert_int_equal(f.rc, TDP_OK);
    for (int i = 0; i < 400 && tdp__dpool_opens() == opens; i++)
        usleep(5 * 1000);
    usleep(300 * 1000); /* time for the others to come (and, were they opened, be) */
    assert_int_equal(tdp__dpool_opens(), opens + 1);
    assert_int_equal(tdp_pipe_status(e.srv), TDP_OK);
    for (int i = 0; i < f.n; i++)
        tdp__dpool_unref(f.keep[i]);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    env_down(&e);
}

/* ---- a producer process that dies ------------------------------------------------------ */

/* The child: connect, send message 9 from a device buffer, then wait to be killed. */
static void child_producer(uint16_t port)
{
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_pipe_opts o;
    gpu_opts(&o, 2);
    o.plane = TDP_PLANE_CUDA_IPC;
    if (tdp_loop_new(NULL, &loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p) != TDP_OK)
        _exit(3);
    tdp_schema *s = bytes_schema(2 << 20, true);
    tdp_td *td;
    if (tdp_td_new(s, &td) != TDP_OK)
        _exit(4);
    fill(td, 9);
    if (tdp_pipe_send(p, td, TMO) != TDP_OK)
        _exit(5);
    for (int i = 0; i < 600; i++) /* bounded: the parent kills it long before */
        usleep(100 * 1000);
    _exit(0);
}

/*
 * A cuda-ipc listener on a loop thread of its own, and a child process
 * running this test as `ROLE PORT [FD]`: fork, then exec (UCX's state does
 * not survive a bare fork). fd: passed on (-1: none); fd_close: closed in
 * the child (this process's end of a pipe; -1: none).
 */
static pid_t listen_and_spawn(tdp_loop **loop, tdp_listener **l, const char *role, int fd,
                              int fd_close)
{
    tdp_pipe_opts o;
    gpu_opts(&o, 2);
    o.plane = TDP_PLANE_CUDA_IPC;
    assert_int_equal(tdp_loop_new(NULL, loop), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(*loop), TDP_OK);
    assert_int_equal(tdp_listener_new(*loop, "127.0.0.1", 0, &o, NULL, NULL, l), TDP_OK);
    char ps[16], fs[16];
    snprintf(ps, sizeof(ps), "%u", tdp_listener_port(*l));
    snprintf(fs, sizeof(fs), "%d", fd);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (fd_close >= 0)
            close(fd_close);
        execl("/proc/self/exe", "test_cuda_ipc", role, ps, fd >= 0 ? fs : (char *)NULL,
              (char *)NULL);
        _exit(127);
    }
    return pid;
}

/*
 * Two processes through the fake's memfd export: the receiver imports the
 * producer's pool once, and the view it holds stays readable after the
 * producer is killed; the next receive ends, it does not hang.
 */
static void test_producer_dies(void **state)
{
    (void)state;
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    pid_t pid = listen_and_spawn(&loop, &l, "--producer", -1, -1);
    uint64_t imports = tdp__dpool_imports();
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_td *got, *next;
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    assert_int_equal(tdp__dpool_imports(), imports + 1); /* another process: imported */
    assert_true(view_in_pool(loop, p, tdp_td_data(got)));
    assert_true(verify(got, 9));
    assert_int_equal(kill(pid, SIGKILL), 0);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    tdp_err rc = tdp_pipe_recv(p, TMO, &next);
    print_message("receive after the producer died: %s\n", tdp_errname(rc));
    assert_true(rc == TDP_ECONNRESET || rc == TDP_ECLOSED);
    assert_true(verify(got, 9)); /* still readable */
    tdp_pipe_release(p, got);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
}

/*
 * The child: connect, prepare a 2 MiB GPU layout (its pool made and
 * announced), wait for the parent's byte on fd, then send message 7 and
 * wait for the parent to close fd.
 */
static void child_preparer(uint16_t port, int fd)
{
    tdp_loop *loop;
    tdp_pipe *p;
    tdp_pipe_opts o;
    gpu_opts(&o, 2);
    o.plane = TDP_PLANE_CUDA_IPC;
    if (tdp_loop_new(NULL, &loop) != TDP_OK || tdp_loop_start_thread(loop) != TDP_OK ||
        tdp_pipe_connect(loop, "127.0.0.1", port, &o, &p) != TDP_OK)
        _exit(3);
    tdp_schema *s = bytes_schema(2 << 20, true);
    tdp_td *td;
    if (tdp_td_new(s, &td) != TDP_OK || tdp_pipe_prepare(p, s, TMO) != TDP_OK)
        _exit(4);
    char c;
    if (read(fd, &c, 1) != 1)
        _exit(5);
    fill(td, 7);
    if (tdp_pipe_send(p, td, TMO) != TDP_OK)
        _exit(6);
    while (read(fd, &c, 1) > 0) /* until the parent closes it */
        ;
    tdp_pipe_close(p, TMO);
    _exit(0);
}

/*
 * A pool announced ahead (tdp_pipe_prepare in another process) is imported
 * when its announcement comes, before any message: a GPU's first import
 * (126 ms on an H100) stays out of the first message's time.
 */
static void test_prepared_pool_imported_ahead(void **state)
{
    (void)state;
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *p;
    int go[2];
    assert_int_equal(pipe(go), 0);
    uint64_t imports = tdp__dpool_imports();
    pid_t pid = listen_and_spawn(&loop, &l, "--preparer", go[0], go[1]);
    close(go[0]);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    /* no message has been sent: the child waits for our byte */
    for (int i = 0; i < 1000 && tdp__dpool_imports() == imports; i++)
        usleep(10 * 1000);
    assert_int_equal(tdp__dpool_imports(), imports + 1);
    assert_int_equal(write(go[1], "g", 1), 1);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    assert_true(verify(got, 7));
    assert_true(view_in_pool(loop, p, tdp_td_data(got)));
    assert_int_equal(tdp__dpool_imports(), imports + 1); /* nothing more at the message */
    tdp_pipe_release(p, got);
    close(go[1]);
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(loop);
}

int main(int argc, char **argv)
{
    /* the fake device, with two GPUs, where the machine has no GPU (children inherit it) */
    if (getenv("TDPIPE_CUDA") == NULL && tdp__cuda_device_count() == 0) {
        setenv("TDPIPE_CUDA", "fake:2", 1);
        if (tdp__cuda_select("fake:2") != TDP_OK)
            return 1;
    }
    if (argc == 3 && strcmp(argv[1], "--producer") == 0)
        child_producer((uint16_t)atoi(argv[2]));
    if (argc == 4 && strcmp(argv[1], "--preparer") == 0)
        child_preparer((uint16_t)atoi(argv[2]), atoi(argv[3]));
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choice),
        cmocka_unit_test(test_reach_rule),
        cmocka_unit_test(test_plain_send_no_copy),
        cmocka_unit_test(test_loan_no_copy),
        cmocka_unit_test(test_schema_change_with_loans_out),
        cmocka_unit_test(test_recv_to_host),
        cmocka_unit_test(test_two_gpus),
        cmocka_unit_test(test_hostile_pools),
        cmocka_unit_test(test_dpool_flood),
        cmocka_unit_test(test_producer_dies),
        cmocka_unit_test(test_prepared_pool_imported_ahead),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
