/*
 * test_stage: the staging engine on the fake device. Completions arrive
 * through the loop (never inside the call), bytes land right, copies finish
 * in order, chunks in flight stay bounded, a copy can follow its source as
 * it grows, cancel and free leave no callback behind, an injected copy
 * failure reaches the callback as TDP_ECUDA, and a copy allocates nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tdpipe/loop.h>
#include <tdpipe/mem.h>

#include "core/cuda.h"
#include "core/loop_int.h"
#include "pipe/stage.h"

#define OK(x)   assert_int_equal((x), TDP_OK)
#define WAIT_MS 10000
#define NCOPY   8

typedef struct fixture {
    tdp_loop *loop;
    tdp__stage *st;
} fixture;

typedef struct rec {
    tdp__stage_copy c;
    int id;
    bool done;
    tdp_err status;
    bool on_loop;
    size_t last_progress;
    unsigned progress_calls;
    bool progress_backwards;
} rec;

static int order[NCOPY * 4];
static int norder;
static bool in_start;
static bool called_in_start;
static volatile bool all_done;
static int want_done;
static int ndone;
static tdp_loop *cur_loop;

static void on_done(tdp__stage_copy *c, tdp_err status)
{
    rec *r = c->arg;
    if (in_start)
        called_in_start = true;
    r->done = true;
    r->status = status;
    r->on_loop = tdp_loop_on_thread(cur_loop);
    order[norder++ % (NCOPY * 4)] = r->id;
    if (++ndone >= want_done)
        all_done = true;
}

static void on_progress(tdp__stage_copy *c, size_t landed)
{
    rec *r = c->arg;
    if (landed < r->last_progress)
        r->progress_backwards = true;
    r->last_progress = landed;
    r->progress_calls++;
}

static int setup(void **state)
{
    OK(tdp__cuda_select("fake"));
    tdp__cuda_fake_set_delay_us(0);
    for (int f = 0; f < TDP__CUDA_FAULT_COUNT; f++)
        tdp__cuda_fake_inject((tdp__cuda_fault)f, 0);
    fixture *fx = calloc(1, sizeof(*fx));
    OK(tdp_loop_new(NULL, &fx->loop));
    OK(tdp__stage_new(fx->loop, 0, 0, &fx->st));
    cur_loop = fx->loop;
    norder = ndone = want_done = 0;
    all_done = false;
    in_start = called_in_start = false;
    *state = fx;
    return 0;
}

static int teardown(void **state)
{
    fixture *fx = *state;
    tdp__cuda_fake_set_delay_us(0);
    tdp__stage_free(fx->st);
    tdp_loop_free(fx->loop);
    free(fx);
    return 0;
}

static void rec_init(rec *r, int id)
{
    memset(r, 0, sizeof(*r));
    r->id = id;
    r->c.done = on_done;
    r->c.arg = r;
}

static tdp_err start(fixture *fx, rec *r, void *dst, const void *src, size_t n, size_t avail,
                     size_t chunk, unsigned max)
{
    in_start = true;
    tdp_err rc = tdp__stage_copy_start(fx->st, &r->c, dst, src, n, avail, chunk, max);
    in_start = false;
    return rc;
}

static void wait_all(fixture *fx, int n)
{
    want_done = n;
    all_done = ndone >= n;
    OK(tdp__loop_run_until(fx->loop, &all_done, WAIT_MS));
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 131u + seed);
}

/* Host -> device -> host through the stage; the bytes come back. */
static void test_round_trip(void **state)
{
    fixture *fx = *state;
    size_t n = (1u << 20) + 123;
    unsigned char *src = malloc(n), *back = calloc(1, n);
    fill(src, n, 7);
    void *dev;
    OK(tdp__cuda_malloc(0, n, &dev));
    rec a, b;
    rec_init(&a, 1);
    rec_init(&b, 2);
    tdp__cuda_fake_set_delay_us(2000); /* nothing can finish inside the call */
    OK(start(fx, &a, dev, src, n, n, 64 << 10, 4));
    OK(start(fx, &b, back, dev, n, n, 100000, 0));
    assert_false(a.done);
    wait_all(fx, 2);
    assert_false(called_in_start);
    assert_true(a.on_loop && b.on_loop);
    OK(a.status);
    OK(b.status);
    assert_memory_equal(src, back, n);
    assert_int_equal(order[0], 1);
    assert_int_equal(order[1], 2);
    tdp__cuda_free(dev);
    free(src);
    free(back);
}

/* Copies finish in the order started, whatever their sizes and chunks. */
static void test_order(void **state)
{
    fixture *fx = *state;
    enum { SZ = 256 << 10 };
    unsigned char *src = malloc(SZ), *dst = calloc(NCOPY, SZ);
    fill(src, SZ, 3);
    void *dev;
    OK(tdp__cuda_malloc(0, SZ, &dev));
    rec r[NCOPY];
    tdp__cuda_fake_set_delay_us(200);
    for (int i = 0; i < NCOPY; i++) {
        rec_init(&r[i], i);
        size_t n = (i % 2 == 0) ? SZ : (size_t)SZ / (size_t)(i + 1);
        /* even: host -> device; odd: small ones that would finish first if overtaking */
        if (i % 2 == 0)
            OK(start(fx, &r[i], dev, src, n, n, 16 << 10, 2));
        else
            OK(start(fx, &r[i], dst + (size_t)i * SZ, src, n, n, 0, 0));
    }
    wait_all(fx, NCOPY);
    for (int i = 0; i < NCOPY; i++) {
        assert_int_equal(order[i], i);
        OK(r[i].status);
    }
    for (int i = 1; i < NCOPY; i += 2)
        assert_memory_equal(dst + (size_t)i * SZ, src, (size_t)SZ / (size_t)(i + 1));
    tdp__cuda_free(dev);
    free(src);
    free(dst);
}

/* A copy's own limit and the stage's limit both hold. */
static void test_bounded(void **state)
{
    fixture *fx = *state;
    size_t n = 1u << 20;
    unsigned char *src = malloc(n), *back = calloc(1, n);
    fill(src, n, 11);
    void *dev;
    OK(tdp__cuda_malloc(0, n, &dev));
    rec a;
    rec_init(&a, 0);
    tdp__cuda_fake_set_delay_us(5000); /* the first chunk is still queued when we look */
    OK(start(fx, &a, dev, src, n, n, 64 << 10, 3));
    assert_int_equal(tdp__stage_inflight(fx->st), 3);
    wait_all(fx, 1);
    OK(a.status);
    assert_int_equal(tdp__stage_inflight_max(fx->st), 3);

    /* a stage of 5: two copies together never queue more than 5 chunks */
    tdp__stage *small;
    OK(tdp__stage_new(fx->loop, 0, 5, &small));
    rec b, c;
    rec_init(&b, 1);
    rec_init(&c, 2);
    in_start = true;
    OK(tdp__stage_copy_start(small, &b.c, back, dev, n / 2, n / 2, 64 << 10, 0));
    OK(tdp__stage_copy_start(small, &c.c, back + n / 2, (char *)dev + n / 2, n / 2, n / 2, 64 << 10,
                             0));
    in_start = false;
    assert_int_equal(tdp__stage_inflight(small), 5);
    ndone = 0;
    all_done = false;
    wait_all(fx, 2);
    OK(b.status);
    OK(c.status);
    assert_int_equal(tdp__stage_inflight_max(small), 5);
    assert_memory_equal(src, back, n);
    tdp__stage_free(small);
    tdp__cuda_free(dev);
    free(src);
    free(back);
}

/* A copy follows its source chunk by chunk; progress only grows. */
static void test_avail(void **state)
{
    fixture *fx = *state;
    size_t n = 200000, chunk = 16384;
    unsigned char *src = malloc(n), *back = calloc(1, n);
    fill(src, n, 5);
    void *dev;
    OK(tdp__cuda_malloc(0, n, &dev));
    rec a, b;
    rec_init(&a, 0);
    rec_init(&b, 1);
    a.c.progress = on_progress;
    OK(start(fx, &a, dev, src, n, 0, chunk, 0));
    /* b is behind a: it must not run before a has queued everything */
    OK(start(fx, &b, back, dev, n, n, 0, 0));
    volatile bool never = false;
    assert_int_equal(tdp__loop_run_until(fx->loop, &never, 50), TDP_ETIMEDOUT);
    assert_int_equal(tdp__stage_inflight(fx->st), 0);
    assert_false(a.done || b.done);
    for (size_t have = chunk; have < n + chunk; have += chunk) {
        tdp__stage_copy_avail(fx->st, &a.c, have);
        assert_int_equal(tdp__loop_run_until(fx->loop, &never, 5), TDP_ETIMEDOUT);
    }
    wait_all(fx, 2);
    OK(a.status);
    OK(b.status);
    assert_false(a.progress_backwards);
    assert_true(a.progress_calls >= 2);
    assert_int_equal(a.last_progress, n);
    assert_memory_equal(src, back, n);
    tdp__cuda_free(dev);
    free(src);
    free(back);
}

/* An injected copy failure ends the copy with TDP_ECUDA; the stage goes on. */
static void test_copy_failure(void **state)
{
    fixture *fx = *state;
    size_t n = 100000;
    unsigned char *src = malloc(n), *back = calloc(1, n);
    fill(src, n, 9);
    void *dev;
    OK(tdp__cuda_malloc(0, n, &dev));
    rec a, b;
    rec_init(&a, 0);
    rec_init(&b, 1);
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_COPY_FAIL_AT, 3); /* the third chunk */
    OK(start(fx, &a, dev, src, n, n, 10000, 0));
    assert_false(a.done);
    wait_all(fx, 1);
    assert_false(called_in_start);
    assert_int_equal(a.status, TDP_ECUDA);

    /* the first chunk fails: still reported through the callback */
    rec_init(&a, 2);
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_COPY_FAIL_AT, 1);
    OK(start(fx, &a, dev, src, n, n, 0, 0));
    assert_false(a.done);
    ndone = 0;
    all_done = false;
    wait_all(fx, 1);
    assert_int_equal(a.status, TDP_ECUDA);

    rec_init(&a, 0);
    OK(start(fx, &a, dev, src, n, n, 10000, 0));
    OK(start(fx, &b, back, dev, n, n, 0, 0));
    ndone = 0;
    all_done = false;
    wait_all(fx, 2);
    OK(a.status);
    OK(b.status);
    assert_memory_equal(src, back, n);
    tdp__cuda_free(dev);
    free(src);
    free(back);
}

/* Cancel: no callback, later copies go on; free with copies queued: none ever. */
static void test_cancel(void **state)
{
    fixture *fx = *state;
    size_t n = 65536;
    unsigned char *src = malloc(n), *back = calloc(1, n);
    fill(src, n, 1);
    void *dev;
    OK(tdp__cuda_malloc(0, n, &dev));
    OK(tdp__cuda_memcpy(dev, src, n));
    rec a, b, c;
    rec_init(&a, 0);
    rec_init(&b, 1);
    rec_init(&c, 2);
    tdp__cuda_fake_set_delay_us(5000);
    unsigned char *junk = malloc(n);
    OK(start(fx, &a, junk, dev, n, n, 4096, 0));
    OK(start(fx, &b, junk, dev, n, n, 4096, 0));
    OK(start(fx, &c, back, dev, n, n, 4096, 0));
    tdp__stage_copy_cancel(fx->st, &a.c); /* a had chunks queued: waits for them */
    free(junk);                           /* safe: the stream has passed them */
    tdp__stage_copy_cancel(fx->st, &b.c); /* b too, its chunks now passed */
    tdp__cuda_fake_set_delay_us(0);
    wait_all(fx, 1);
    assert_false(a.done || b.done);
    assert_true(c.done);
    OK(c.status);
    assert_memory_equal(src, back, n);

    /* free with copies queued: they drain and no callback ever runs */
    tdp__stage *st2;
    OK(tdp__stage_new(fx->loop, 0, 0, &st2));
    rec d;
    rec_init(&d, 3);
    tdp__cuda_fake_set_delay_us(5000);
    OK(tdp__stage_copy_start(st2, &d.c, back, dev, n, n, 4096, 0));
    tdp__stage_free(st2);
    tdp__cuda_fake_set_delay_us(0);
    volatile bool never = false;
    assert_int_equal(tdp__loop_run_until(fx->loop, &never, 50), TDP_ETIMEDOUT);
    assert_false(d.done);
    tdp__cuda_free(dev);
    free(src);
    free(back);
}

/*
 * A small chunk on an idle stream is polled for: it is counted finished
 * when the start returns, yet done still runs from the loop. A chunk queued
 * behind another, one over the poll's size, and one that takes longer than
 * the poll get host functions, and all land in order with their bytes.
 */
static void test_small_polled(void **state)
{
    fixture *fx = *state;
    size_t small = 1000, big = 1u << 20;
    unsigned char *src = malloc(big), *back = calloc(1, big), *back2 = calloc(1, small);
    fill(src, big, 5);
    void *dev;
    OK(tdp__cuda_malloc(0, big, &dev));
    tdp__stage_set_spin_ns(fx->st, 10ull * 1000 * 1000 * 1000); /* never runs out here */
    rec a, b, c, d;
    rec_init(&a, 1);
    OK(start(fx, &a, dev, src, small, small, 0, 0));
    assert_int_equal(tdp__stage_inflight(fx->st), 0); /* polled: landed on return */
    assert_false(a.done);                             /* yet reported from the loop */
    wait_all(fx, 1);
    OK(a.status);
    assert_true(a.on_loop);
    assert_false(called_in_start);

    /* over the poll's size, or behind a queued chunk: host functions */
    tdp__cuda_fake_set_delay_us(20000);
    rec_init(&b, 2);
    rec_init(&c, 3);
    OK(start(fx, &b, dev, src, big, big, 0, 0));
    OK(start(fx, &c, back2, dev, small, small, 0, 0));
    assert_int_equal(tdp__stage_inflight(fx->st), 2);
    ndone = 0;
    wait_all(fx, 2);
    OK(b.status);
    OK(c.status);
    /* slower than the poll, on an idle stream: it gives up, a host function reports it */
    tdp__stage_set_spin_ns(fx->st, 100000);
    rec_init(&d, 4);
    OK(start(fx, &d, back, dev, small, small, 0, 0));
    assert_int_equal(tdp__stage_inflight(fx->st), 1);
    ndone = 0;
    wait_all(fx, 1);
    OK(d.status);
    assert_memory_equal(back2, src, small);
    assert_memory_equal(back, src, small);
    assert_int_equal(order[0], 1);
    assert_int_equal(order[1], 2);
    assert_int_equal(order[2], 3);
    assert_int_equal(order[3], 4);
    tdp__cuda_free(dev);
    free(src);
    free(back);
    free(back2);
}

/* Calls of one kind through the CUDA layer so far (its statistics). */
static unsigned long long calls_of(const char *name)
{
    char line[160], key[32];
    unsigned long long n = 0;
    for (int k = 0; k < 64; k++)
        if (tdp__cuda_stats_line(k, line, sizeof(line)) &&
            sscanf(line, "%31s calls %llu", key, &n) == 2 && strcmp(key, name) == 0)
            return n;
    return 0;
}

/*
 * A small host-to-device copy is written by the device (no copy engine),
 * lands whole and in order with the copies around it; a device-to-host
 * one, an unaligned one, a big one, or any once inline writes are off,
 * is a copy.
 */
static void test_small_inline(void **state)
{
    fixture *fx = *state;
    size_t small = 1000, big = 1u << 20;
    unsigned char *src = malloc(big), *back = calloc(1, big);
    fill(src, big, 9);
    unsigned char *dev;
    OK(tdp__cuda_malloc(0, big, (void **)&dev));
    OK(tdp__cuda_memset(dev, 0, big));
    tdp__cuda_stats_enable(true);
    tdp__cuda_stats_reset();
    tdp__cuda_fake_set_delay_us(20000); /* late: the loop reports it only once it landed */
    rec a, b, c, d, e;
    rec_init(&a, 1);
    rec_init(&b, 2);
    OK(start(fx, &a, dev, src, small, small, 0, 0));
    OK(start(fx, &b, back, dev, small, small, 0, 0)); /* back, after it */
    wait_all(fx, 2);
    OK(a.status);
    OK(b.status);
    assert_memory_equal(back, src, small);
    assert_int_equal(calls_of("write_inline"), 1);
    assert_int_equal(calls_of("memcpy_async"), 1); /* the copy back */
    tdp__cuda_fake_set_delay_us(0);

    /* unaligned, and past the largest: copies */
    rec_init(&c, 3);
    rec_init(&d, 4);
    OK(start(fx, &c, dev + 1, src, small, small, 0, 0));
    OK(start(fx, &d, dev + 4096, src, TDP__CUDA_INLINE_MAX + 4, TDP__CUDA_INLINE_MAX + 4, 0, 0));
    ndone = 0;
    wait_all(fx, 2);
    OK(c.status);
    OK(d.status);
    assert_int_equal(calls_of("write_inline"), 1);
    assert_int_equal(calls_of("memcpy_async"), 3);
    OK(tdp__cuda_memcpy(back, dev + 1, small));
    assert_memory_equal(back, src, small);

    /* refused by the device (nothing queued): copied instead, and not tried again */
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_INLINE_REFUSED_AT, 1);
    rec f, g;
    rec_init(&f, 6);
    rec_init(&g, 7);
    OK(start(fx, &f, dev + 8192, src + 4, small, small, 0, 0));
    OK(start(fx, &g, dev + 12288, src + 12, small, small, 0, 0));
    ndone = 0;
    wait_all(fx, 2);
    OK(f.status);
    OK(g.status);
    assert_int_equal(calls_of("write_inline"), 2); /* the refused one, then none */
    assert_int_equal(calls_of("memcpy_async"), 5);
    OK(tdp__cuda_memcpy(back, dev + 8192, small));
    assert_memory_equal(back, src + 4, small);
    OK(tdp__cuda_memcpy(back, dev + 12288, small));
    assert_memory_equal(back, src + 12, small);
    tdp__stage_set_inline(fx->st, true);

    /* off: a copy again */
    tdp__stage_set_inline(fx->st, false);
    rec_init(&e, 5);
    OK(start(fx, &e, dev, src + 8, small, small, 0, 0));
    ndone = 0;
    wait_all(fx, 1);
    OK(e.status);
    assert_int_equal(calls_of("write_inline"), 2);
    assert_int_equal(calls_of("memcpy_async"), 6);
    OK(tdp__cuda_memcpy(back, dev, small));
    assert_memory_equal(back, src + 8, small);
    tdp__cuda_stats_enable(false);
    tdp__cuda_free(dev);
    free(src);
    free(back);
}

/* A zero-length copy completes through the loop too. */
static void test_empty(void **state)
{
    fixture *fx = *state;
    rec a;
    rec_init(&a, 0);
    OK(start(fx, &a, NULL, NULL, 0, 0, 0, 0));
    assert_false(a.done);
    wait_all(fx, 1);
    OK(a.status);
    assert_true(a.on_loop);
    assert_int_equal(tdp__stage_copy_start(fx->st, NULL, NULL, NULL, 0, 0, 0, 0), TDP_EINVAL);
}

/* After setup, copies allocate nothing of the library's. */
static void test_no_alloc(void **state)
{
    fixture *fx = *state;
    size_t n = 300000;
    unsigned char *src = malloc(n), *back = calloc(1, n);
    fill(src, n, 2);
    void *dev;
    OK(tdp__cuda_malloc(0, n, &dev));
    rec a, b;
    rec_init(&a, 0);
    rec_init(&b, 1);
    OK(start(fx, &a, dev, src, n, n, 65536, 2)); /* warm up */
    wait_all(fx, 1);
    uint64_t before = tdp_mem_total_allocs();
    for (int i = 0; i < 50; i++) {
        rec_init(&a, 0);
        rec_init(&b, 1);
        src[i] = (unsigned char)(i + 1);
        OK(start(fx, &a, dev, src, n, n, 65536, 2));
        OK(start(fx, &b, back, dev, n, n, 100000, 0));
        ndone = 0;
        all_done = false;
        wait_all(fx, 2);
        OK(a.status);
        OK(b.status);
    }
    assert_int_equal(tdp_mem_total_allocs(), before);
    assert_memory_equal(src, back, n);
    tdp__cuda_free(dev);
    free(src);
    free(back);
}

/* No device: the stage says so. */
static void test_no_device(void **state)
{
    (void)state;
    tdp_loop *loop;
    OK(tdp_loop_new(NULL, &loop));
    OK(tdp__cuda_select("off"));
    tdp__stage *st = NULL;
    assert_int_equal(tdp__stage_new(loop, 0, 0, &st), TDP_ENOTSUP);
    assert_null(st);
    OK(tdp__cuda_select("fake"));
    assert_int_equal(tdp__stage_new(loop, 1, 0, &st), TDP_ENOTSUP);
    assert_int_equal(tdp__stage_new(loop, 0, TDP__STAGE_MAX_INFLIGHT + 1, &st), TDP_EINVAL);
    tdp_loop_free(loop);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bounded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_avail, setup, teardown),
        cmocka_unit_test_setup_teardown(test_copy_failure, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_empty, setup, teardown),
        cmocka_unit_test_setup_teardown(test_small_polled, setup, teardown),
        cmocka_unit_test_setup_teardown(test_small_inline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_alloc, setup, teardown),
        cmocka_unit_test(test_no_device),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
