/* test_dtype: sizes, alignments and PyTorch names of every dtype. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <tdpipe/dtype.h>

static const struct {
    tdp_dtype dt;
    const char *name;
    size_t itemsize;
    size_t align;
} table[] = {
    {TDP_BOOL, "torch.bool", 1, 1},
    {TDP_INT8, "torch.int8", 1, 1},
    {TDP_INT16, "torch.int16", 2, 2},
    {TDP_INT32, "torch.int32", 4, 4},
    {TDP_INT64, "torch.int64", 8, 8},
    {TDP_UINT8, "torch.uint8", 1, 1},
    {TDP_UINT16, "torch.uint16", 2, 2},
    {TDP_UINT32, "torch.uint32", 4, 4},
    {TDP_UINT64, "torch.uint64", 8, 8},
    {TDP_FLOAT16, "torch.float16", 2, 2},
    {TDP_BFLOAT16, "torch.bfloat16", 2, 2},
    {TDP_FLOAT32, "torch.float32", 4, 4},
    {TDP_FLOAT64, "torch.float64", 8, 8},
    {TDP_COMPLEX64, "torch.complex64", 8, 4},
    {TDP_COMPLEX128, "torch.complex128", 16, 8},
    {TDP_FLOAT8_E4M3FN, "torch.float8_e4m3fn", 1, 1},
    {TDP_FLOAT8_E5M2, "torch.float8_e5m2", 1, 1},
};
#define NTABLE (sizeof(table) / sizeof(table[0]))

static void test_table_covers_every_dtype(void **state)
{
    (void)state;
    assert_int_equal(NTABLE, TDP_DTYPE_COUNT - 1);
    for (int dt = 1; dt < TDP_DTYPE_COUNT; dt++) {
        bool found = false;
        for (size_t i = 0; i < NTABLE; i++)
            found |= table[i].dt == (tdp_dtype)dt;
        assert_true(found);
    }
}

static void test_itemsize_align_name(void **state)
{
    (void)state;
    for (size_t i = 0; i < NTABLE; i++) {
        assert_int_equal(tdp_dtype_itemsize(table[i].dt), table[i].itemsize);
        assert_int_equal(tdp_dtype_align(table[i].dt), table[i].align);
        assert_non_null(tdp_dtype_name(table[i].dt));
        assert_string_equal(tdp_dtype_name(table[i].dt), table[i].name);
        /* alignment is a power of two dividing the item size */
        size_t a = table[i].align;
        assert_true(a != 0 && (a & (a - 1)) == 0);
        assert_int_equal(table[i].itemsize % a, 0);
    }
}

static void test_invalid_values(void **state)
{
    (void)state;
    const tdp_dtype bad[] = {TDP_DTYPE_INVALID, TDP_DTYPE_COUNT, (tdp_dtype)(TDP_DTYPE_COUNT + 5),
                             (tdp_dtype)-1, (tdp_dtype)1000};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(tdp_dtype_itemsize(bad[i]), 0);
        assert_int_equal(tdp_dtype_align(bad[i]), 0);
        assert_null(tdp_dtype_name(bad[i]));
    }
}

static void test_parse_canonical_and_short(void **state)
{
    (void)state;
    for (size_t i = 0; i < NTABLE; i++) {
        tdp_dtype out = TDP_DTYPE_INVALID;
        assert_int_equal(tdp_dtype_parse(table[i].name, &out), TDP_OK);
        assert_int_equal(out, table[i].dt);
        out = TDP_DTYPE_INVALID;
        const char *short_name = table[i].name + strlen("torch.");
        assert_int_equal(tdp_dtype_parse(short_name, &out), TDP_OK);
        assert_int_equal(out, table[i].dt);
        /* the canonical name round-trips */
        assert_string_equal(tdp_dtype_name(out), table[i].name);
    }
}

static void test_parse_aliases(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        tdp_dtype dt;
    } aliases[] = {
        {"torch.float", TDP_FLOAT32},      {"float", TDP_FLOAT32},
        {"torch.double", TDP_FLOAT64},     {"double", TDP_FLOAT64},
        {"torch.half", TDP_FLOAT16},       {"half", TDP_FLOAT16},
        {"torch.int", TDP_INT32},          {"int", TDP_INT32},
        {"torch.long", TDP_INT64},         {"long", TDP_INT64},
        {"torch.short", TDP_INT16},        {"short", TDP_INT16},
        {"torch.cfloat", TDP_COMPLEX64},   {"cfloat", TDP_COMPLEX64},
        {"torch.cdouble", TDP_COMPLEX128}, {"cdouble", TDP_COMPLEX128},
    };
    for (size_t i = 0; i < sizeof(aliases) / sizeof(aliases[0]); i++) {
        tdp_dtype out = TDP_DTYPE_INVALID;
        if (tdp_dtype_parse(aliases[i].name, &out) != TDP_OK)
            fail_msg("alias '%s' rejected", aliases[i].name);
        assert_int_equal(out, aliases[i].dt);
    }
}

static void test_parse_rejects_unknown(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "torch.float33",
        "",
        "torch.",
        "Float32",
        "torch.Float32",
        "FLOAT32",
        "float33",
        "torch.float32 ",
        " torch.float32",
        "torch..float32",
        "torch",
        "numpy.float32",
        "f4",
        "torch.float8",
        "torch.int128",
        "torch.complex32",
        "torch.bool\n",
        "tor.float32",
        "torch.float32\t",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tdp_dtype out = (tdp_dtype)99;
        if (tdp_dtype_parse(bad[i], &out) != TDP_EINVAL)
            fail_msg("dtype name '%s' accepted", bad[i]);
        assert_int_equal(out, (tdp_dtype)99); /* untouched */
    }
    tdp_dtype out;
    assert_int_equal(tdp_dtype_parse(NULL, &out), TDP_EINVAL);
    assert_int_equal(tdp_dtype_parse("torch.float32", NULL), TDP_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_covers_every_dtype),
        cmocka_unit_test(test_itemsize_align_name),
        cmocka_unit_test(test_invalid_values),
        cmocka_unit_test(test_parse_canonical_and_short),
        cmocka_unit_test(test_parse_aliases),
        cmocka_unit_test(test_parse_rejects_unknown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
