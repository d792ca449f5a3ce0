/*
 * test_stats: the latency histogram (stats.h) — percentiles of known
 * distributions, the bucket error bound, edge values, merging.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include <tdpipe/stats.h>

/* Heap: the struct is too big to want several on a test's stack. */
static tdp_hist *hist_new(void)
{
    tdp_hist *h = malloc(sizeof(*h));
    assert_non_null(h);
    memset(h, 0x5a, sizeof(*h)); /* reset must clear whatever was there */
    tdp_hist_reset(h);
    return h;
}

/* v read back through a histogram is within one bucket (1/32) above v. */
static void assert_close(uint64_t got, uint64_t want)
{
    assert_true(got >= want);
    assert_true((double)(got - want) <= (double)want / 32.0);
}

static void test_empty(void **state)
{
    tdp_hist *h = hist_new();
    tdp_hist_summary s;
    assert_int_equal(h->count, 0);
    assert_int_equal(tdp_hist_percentile(h, 50), 0);
    assert_true(tdp_hist_mean(h) == 0);
    tdp_hist_summarize(h, &s);
    assert_int_equal(s.count, 0);
    assert_int_equal(s.max, 0);
    tdp_hist_summary zero = {0};
    assert_memory_equal(&s, &zero, sizeof(s));
    free(h);
}

static void test_small_exact(void **state)
{
    /* below 64 every value has its own bucket: percentiles are exact */
    tdp_hist *h = hist_new();
    for (uint64_t v = 1; v <= 50; v++)
        tdp_hist_record(h, v);
    assert_int_equal(h->count, 50);
    assert_int_equal(h->min, 1);
    assert_int_equal(h->max, 50);
    assert_int_equal(tdp_hist_percentile(h, 50), 25);
    assert_int_equal(tdp_hist_percentile(h, 2), 1);
    assert_int_equal(tdp_hist_percentile(h, 98), 49);
    assert_int_equal(tdp_hist_percentile(h, 0), 1);
    assert_int_equal(tdp_hist_percentile(h, 100), 50);
    assert_true(fabs(tdp_hist_mean(h) - 25.5) < 1e-9);
    free(h);
}

static void test_uniform(void **state)
{
    /* 1..100000 ns once each: the p-th percentile is p x 1000 */
    tdp_hist *h = hist_new();
    for (uint64_t v = 1; v <= 100000; v++)
        tdp_hist_record(h, v);
    assert_close(tdp_hist_percentile(h, 50), 50000);
    assert_close(tdp_hist_percentile(h, 90), 90000);
    assert_close(tdp_hist_percentile(h, 99), 99000);
    assert_close(tdp_hist_percentile(h, 99.9), 99900);
    assert_int_equal(tdp_hist_percentile(h, 100), 100000);
    tdp_hist_summary s;
    tdp_hist_summarize(h, &s);
    assert_int_equal(s.count, 100000);
    assert_int_equal(s.min, 1);
    assert_int_equal(s.max, 100000);
    assert_true(s.min <= s.p50 && s.p50 <= s.p90 && s.p90 <= s.p99 && s.p99 <= s.p999 &&
                s.p999 <= s.max);
    assert_true(fabs(s.mean - 50000.5) < 1e-6);
    free(h);
}

static void test_bimodal(void **state)
{
    /* 990 fast values and 10 slow ones: p99 is fast, p99.9 slow */
    tdp_hist *h = hist_new();
    for (int i = 0; i < 990; i++)
        tdp_hist_record(h, 10000);
    for (int i = 0; i < 10; i++)
        tdp_hist_record(h, 5000000);
    assert_close(tdp_hist_percentile(h, 50), 10000);
    assert_close(tdp_hist_percentile(h, 99), 10000);
    assert_int_equal(tdp_hist_percentile(h, 99.1), 5000000); /* clamped to max */
    assert_int_equal(tdp_hist_percentile(h, 99.9), 5000000);
    free(h);
}

static void test_error_bound(void **state)
{
    /* a single value at every scale reads back within 1/32, never below */
    tdp_hist *h = hist_new();
    for (uint64_t v = 1; v != 0 && v < (UINT64_C(1) << 62); v = v * 3 + 1) {
        tdp_hist_reset(h);
        tdp_hist_record(h, v);
        tdp_hist_record(h, v + v / 2); /* a larger max, so p50 is not clamped to it */
        assert_close(tdp_hist_percentile(h, 50), v);
    }
    free(h);
}

static void test_edges(void **state)
{
    tdp_hist *h = hist_new();
    tdp_hist_record(h, 0);
    assert_int_equal(h->min, 0);
    assert_int_equal(tdp_hist_percentile(h, 50), 0);
    tdp_hist_record(h, UINT64_MAX);
    tdp_hist_record(h, UINT64_MAX - 1);
    tdp_hist_record(h, UINT64_C(1) << 63);
    assert_int_equal(h->count, 4);
    assert_int_equal(h->min, 0);
    assert_int_equal(h->max, UINT64_MAX);
    assert_int_equal(tdp_hist_percentile(h, 25), 0);
    uint64_t p50 = tdp_hist_percentile(h, 50);
    assert_true(p50 >= (UINT64_C(1) << 63));
    assert_int_equal(tdp_hist_percentile(h, 100), UINT64_MAX);
    assert_int_equal(tdp_hist_percentile(h, 99.999), UINT64_MAX);
    /* out-of-range percentages are clamped */
    assert_int_equal(tdp_hist_percentile(h, -5), 0);
    assert_int_equal(tdp_hist_percentile(h, 250), UINT64_MAX);
    assert_int_equal(tdp_hist_percentile(h, NAN), 0);
    assert_true(tdp_hist_mean(h) > 0);
    free(h);
}

static void test_merge(void **state)
{
    tdp_hist *a = hist_new(), *b = hist_new(), *all = hist_new();
    for (uint64_t v = 1; v <= 1000; v++) {
        tdp_hist_record(v % 2 ? a : b, v * 100);
        tdp_hist_record(all, v * 100);
    }
    tdp_hist_merge(a, b);
    assert_memory_equal(a, all, sizeof(*a));
    /* merging an empty one changes nothing; into an empty one copies */
    tdp_hist_reset(b);
    tdp_hist_merge(a, b);
    assert_memory_equal(a, all, sizeof(*a));
    tdp_hist_merge(b, a);
    assert_memory_equal(b, all, sizeof(*b));
    /* into itself: twice everything, the same percentiles */
    tdp_hist_merge(a, a);
    assert_int_equal(a->count, 2000);
    assert_int_equal(a->min, 100);
    assert_int_equal(a->max, 100000);
    assert_int_equal(tdp_hist_percentile(a, 50), tdp_hist_percentile(all, 50));
    assert_int_equal(tdp_hist_percentile(a, 99), tdp_hist_percentile(all, 99));
    free(a);
    free(b);
    free(all);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_empty),       cmocka_unit_test(test_small_exact),
        cmocka_unit_test(test_uniform),     cmocka_unit_test(test_bimodal),
        cmocka_unit_test(test_error_bound), cmocka_unit_test(test_edges),
        cmocka_unit_test(test_merge),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
