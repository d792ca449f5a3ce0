/*
 * test_cli_args: the tdpipe command's argument grammar (tools/cli.c,
 * tools/bench_method.c) — sizes, size lists, message rounding, plurals,
 * planes, this host's addresses.
 * The command end to end is tests/test_cli.sh.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "bench_method.h"
#include "cli.h"

static uint64_t size_ok(const char *s)
{
    uint64_t v = 0;
    const char *why = NULL;
    if (!tdp_bm_parse_size_why(s, &v, &why))
        fail_msg("'%s' refused: %s", s, why);
    return v;
}

/* Refused, and the reason contains `needle`. */
static void size_bad(const char *s, const char *needle)
{
    uint64_t v = 12345;
    const char *why = NULL;
    if (tdp_bm_parse_size_why(s, &v, &why))
        fail_msg("'%s' accepted as %llu", s, (unsigned long long)v);
    assert_int_equal(v, 12345);
    assert_non_null(why);
    if (strstr(why, needle) == NULL)
        fail_msg("'%s': reason '%s' lacks '%s'", s, why, needle);
}

static void test_size_grammar(void **state)
{
    (void)state;
    /* bytes */
    assert_int_equal(size_ok("0"), 0);
    assert_int_equal(size_ok("64"), 64);
    assert_int_equal(size_ok("64B"), 64);
    assert_int_equal(size_ok("64 B"), 64);
    /* SI, with or without B, any case of the prefix */
    assert_int_equal(size_ok("1K"), 1000);
    assert_int_equal(size_ok("1KB"), 1000);
    assert_int_equal(size_ok("1kB"), 1000);
    assert_int_equal(size_ok("1MB"), 1000000);
    assert_int_equal(size_ok("1 M"), 1000000);
    assert_int_equal(size_ok("2G"), 2000000000ull);
    assert_int_equal(size_ok("1TB"), 1000000000000ull);
    /* IEC */
    assert_int_equal(size_ok("1Ki"), 1024);
    assert_int_equal(size_ok("1KiB"), 1024);
    assert_int_equal(size_ok("1kiB"), 1024);
    assert_int_equal(size_ok("1KIB"), 1024);
    assert_int_equal(size_ok("4MiB"), 4u << 20);
    assert_int_equal(size_ok("1GiB"), 1ull << 30);
    assert_int_equal(size_ok("1TiB"), 1ull << 40);
    /* fractions that come to whole bytes */
    assert_int_equal(size_ok("1.5KB"), 1500);
    assert_int_equal(size_ok("0.5KiB"), 512);
    assert_int_equal(size_ok(".25KiB"), 256);
    assert_int_equal(size_ok("18446744073709551615"), UINT64_MAX);

    size_bad("", "not a number");
    size_bad("-1", "not a number");
    size_bad("+1", "not a number");
    size_bad(" 1", "not a number");
    size_bad(".", "not a number");
    size_bad("1.", "not a number");
    size_bad("KB", "not a number");
    size_bad("1Mb", "bits");
    size_bad("1kb", "bits");
    size_bad("64b", "bits");
    size_bad("1Kib", "bits");
    size_bad("12XB", "unknown unit");
    size_bad("1KBB", "unknown unit");
    size_bad("1 KB ", "unknown unit");
    size_bad("1iB", "unknown unit");
    size_bad("1.5B", "whole number of bytes");
    size_bad("1.0001KB", "whole number of bytes");
    size_bad("18446744073709551616", "too large");
    size_bad("20000000TB", "too large");
    size_bad("1.0000000000000000001", "decimals");
}

static void test_size_lists(void **state)
{
    (void)state;
    uint64_t v[4];
    int n = -1;
    char why[160];

    assert_true(
        tdp_bm_parse_size_list("1KB,1MiB,128", 128, 1ull << 30, v, 4, &n, why, sizeof(why)));
    assert_int_equal(n, 3);
    assert_int_equal(v[0], 1000);
    assert_int_equal(v[1], 1u << 20);
    assert_int_equal(v[2], 128);

    static const struct {
        const char *list, *needle;
    } bad[] = {
        {"1KB,,1MB", "empty size"},  {"1KB,", "empty size"},
        {",1KB", "empty size"},      {"", "no sizes"},
        {"1KB,1Mb", "bits"},         {"1KB,2GiB", "out of range"},
        {"100", "(128 B .. 1 GiB)"}, {"1K,2K,3K,4K,5K", "more than 4"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        why[0] = '\0';
        if (tdp_bm_parse_size_list(bad[i].list, 128, 1ull << 30, v, 4, &n, why, sizeof(why)))
            fail_msg("'%s' accepted", bad[i].list);
        if (strstr(why, bad[i].needle) == NULL)
            fail_msg("'%s': '%s' lacks '%s'", bad[i].list, why, bad[i].needle);
    }
}

/* send and bench round a requested size the same way: whole float32 elements, up. */
static void test_rounding(void **state)
{
    (void)state;
    assert_int_equal(tdp_bm_whole_floats(0), 0);
    assert_int_equal(tdp_bm_whole_floats(1), 4);
    assert_int_equal(tdp_bm_whole_floats(1000), 1000);
    assert_int_equal(tdp_bm_whole_floats(1001), 1004);
    assert_int_equal(tdp_bm_whole_floats(UINT64_MAX), UINT64_MAX & ~3ull);
    for (uint64_t s = 0; s < 64; s++)
        assert_int_equal(tdp_cli_synth_bytes(s), tdp_bm_whole_floats(s));
    tdp_schema *sc;
    assert_int_equal(tdp_cli_synth_schema(1001, TDP_DEVICE_CPU_INIT, &sc), TDP_OK);
    assert_int_equal(tdp_schema_total_bytes(sc), 1004);
    tdp_schema_unref(sc);
}

static void test_plurals_and_planes(void **state)
{
    (void)state;
    char names[128];
    tdp_plane p = TDP_PLANE_SHM;
    assert_string_equal(tdp_cli_s(0), "s");
    assert_string_equal(tdp_cli_s(1), "");
    assert_string_equal(tdp_cli_s(2), "s");
    /* every name the library parses, auto first */
    tdp_cli_plane_names(names, sizeof(names));
    assert_true(strncmp(names, "auto, ucx", 9) == 0);
    assert_true(tdp_cli_parse_plane("test", "ucx", &p));
    assert_int_equal(p, TDP_PLANE_UCX);
}

/* Addresses for other hosts: never loopback, never link-local, each with the port. */
static void test_host_addresses(void **state)
{
    (void)state;
    char buf[1024], *save = NULL;
    int n = tdp_cli_host_addresses(5000, buf, sizeof(buf));
    print_message("other hosts: %d: %s\n", n, buf);
    assert_true(n >= 0);
    assert_true((n == 0) == (buf[0] == '\0'));
    assert_null(strstr(buf, "127.0.0.1"));
    assert_null(strstr(buf, "[::1]"));
    assert_null(strstr(buf, "[fe80:"));
    for (char *t = strtok_r(buf, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        if (strstr(t, " more") != NULL)
            continue;
        size_t l = strlen(t);
        assert_true(l > 5 && strcmp(t + l - 5, ":5000") == 0);
    }
}

/* --keepalive IDLE,INTVL,CNT: three numbers in Linux's ranges, nothing else. */
static void test_keepalive(void **state)
{
    (void)state;
    tdp_pipe_opts o = {0};
    assert_true(tdp_cli_parse_keepalive("5,1,15", &o));
    assert_int_equal(o.keepalive_idle_s, 5);
    assert_int_equal(o.keepalive_intvl_s, 1);
    assert_int_equal(o.keepalive_cnt, 15);
    assert_true(tdp_cli_parse_keepalive("32767,32767,127", &o));
    static const char *bad[] = {"",      "5",       "5,1",     "5,1,15,1",  "0,1,1",
                                "1,0,1", "1,1,0",   "1,1,128", "32768,1,1", "a,1,1",
                                "5,,15", "5, 1,15", "-1,1,1",  "5,1,15,",   ",5,1,15"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        o = (tdp_pipe_opts){0};
        assert_false(tdp_cli_parse_keepalive(bad[i], &o));
        assert_int_equal(o.keepalive_idle_s, 0); /* untouched */
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_size_grammar),   cmocka_unit_test(test_size_lists),
        cmocka_unit_test(test_rounding),       cmocka_unit_test(test_plurals_and_planes),
        cmocka_unit_test(test_host_addresses), cmocka_unit_test(test_keepalive),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
