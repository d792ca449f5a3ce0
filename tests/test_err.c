/* test_err: the error table — codes, names and messages. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <string.h>
#include <tdpipe/err.h>

typedef struct err_row {
    int value;
    const char *name; /* as spelled in the table, without prefix */
    const char *msg;
} err_row;

static const err_row rows[] = {
#define ROW(name, value, msg) {TDP_##name, #name, msg},
    TDP_ERR_TABLE(ROW)
#undef ROW
};
#define NROWS (sizeof(rows) / sizeof(rows[0]))

static void test_ok_is_zero_others_negative_distinct(void **state)
{
    (void)state;
    assert_int_equal(TDP_OK, 0);
    assert_true(NROWS > 1);
    for (size_t i = 0; i < NROWS; i++) {
        if (strcmp(rows[i].name, "OK") == 0)
            assert_int_equal(rows[i].value, 0);
        else
            assert_true(rows[i].value < 0);
        for (size_t j = i + 1; j < NROWS; j++)
            assert_int_not_equal(rows[i].value, rows[j].value);
    }
}

static void test_strings_and_names_match_table(void **state)
{
    (void)state;
    for (size_t i = 0; i < NROWS; i++) {
        const char *s = tdp_strerror(rows[i].value);
        const char *n = tdp_errname(rows[i].value);
        assert_non_null(s);
        assert_non_null(n);
        assert_true(s[0] != '\0');
        assert_true(n[0] != '\0');
        assert_string_equal(s, rows[i].msg);
        assert_string_equal(n, rows[i].name);
        assert_string_not_equal(s, "unknown error");
        assert_string_not_equal(n, "UNKNOWN");
    }
}

static void test_strings_and_names_distinct(void **state)
{
    (void)state;
    for (size_t i = 0; i < NROWS; i++) {
        for (size_t j = i + 1; j < NROWS; j++) {
            assert_string_not_equal(tdp_strerror(rows[i].value), tdp_strerror(rows[j].value));
            assert_string_not_equal(tdp_errname(rows[i].value), tdp_errname(rows[j].value));
        }
    }
}

static void test_known_codes_spot_check(void **state)
{
    (void)state;
    assert_string_equal(tdp_errname(TDP_ECLOSED), "ECLOSED");
    assert_string_equal(tdp_errname(TDP_OK), "OK");
    assert_string_equal(tdp_strerror(TDP_OK), "success");
    assert_int_equal(TDP_EINVAL, -1);
    assert_int_equal(TDP_ESCHEMA, -2);
    assert_int_equal(TDP_EMSGSIZE, -4);
    assert_int_equal(TDP_ENOTSUP, -9);
    assert_int_equal(TDP_ENOENT, -13);
}

static void test_unknown_code(void **state)
{
    (void)state;
    const int unknown[] = {1, 42, -99, -1000, INT_MAX, INT_MIN};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        /* none of these is in the table */
        for (size_t j = 0; j < NROWS; j++)
            assert_int_not_equal(unknown[i], rows[j].value);
        assert_string_equal(tdp_strerror(unknown[i]), "unknown error");
        assert_string_equal(tdp_errname(unknown[i]), "UNKNOWN");
    }
}

static void test_strings_are_static(void **state)
{
    (void)state;
    /* the same pointer each call: static storage, nothing formatted per call */
    assert_ptr_equal(tdp_strerror(TDP_ETIMEDOUT), tdp_strerror(TDP_ETIMEDOUT));
    assert_ptr_equal(tdp_errname(TDP_ETIMEDOUT), tdp_errname(TDP_ETIMEDOUT));
    assert_ptr_equal(tdp_strerror(12345), tdp_strerror(-12345));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ok_is_zero_others_negative_distinct),
        cmocka_unit_test(test_strings_and_names_match_table),
        cmocka_unit_test(test_strings_and_names_distinct),
        cmocka_unit_test(test_known_codes_spot_check),
        cmocka_unit_test(test_unknown_code),
        cmocka_unit_test(test_strings_are_static),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
