/*
 * test_validate: hostile schema JSON through tdp_schema_decode. Every case
 * checks the exact error code and that the message names the key or rule.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <tdpipe/schema.h>

#define N(a)     (uint32_t)(sizeof(a) / sizeof((a)[0]))
#define OK(call) assert_int_equal((call), TDP_OK)

/* ---- building documents ---------------------------------------------------- */

static char *fmt(const char *f, ...) TDP_CHECK_FMT(1, 2);
static char *fmt(const char *f, ...)
{
    va_list ap;
    char *s = NULL;
    va_start(ap, f);
    int n = vasprintf(&s, f, ap);
    va_end(ap);
    assert_true(n >= 0);
    return s;
}

/* A node: batch_size dims, leaves and non_tensors bodies, extra members. */
static char *node(const char *batch, const char *leaves, const char *values, const char *extra)
{
    return fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[%s]},"
               "\"leaves\":{%s},\"non_tensors\":{%s}%s%s}",
               batch, leaves, values, extra[0] ? "," : "", extra);
}

/* The whole document around a td node (consumed). */
static char *top(const char *total, char *td)
{
    char *s = fmt("{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":%s,"
                  "\"device\":\"cpu\",\"td\":%s}",
                  total, td);
    free(td);
    return s;
}

/* A document whose root has these leaves, values and extras. */
static char *doc(const char *total, const char *leaves, const char *values)
{
    return top(total, node("", leaves, values, ""));
}

/* ---- decoding ------------------------------------------------------------ */

/*
 * Decode `len` bytes; the result must be `want`, the output untouched on
 * failure, and the message must contain each needle. On success returns the
 * schema (caller unrefs).
 */
static tdp_schema *expect_n(const char *json, size_t len, const tdp_schema_limits *lim,
                            tdp_err want, const char *n1, const char *n2)
{
    tdp_schema *sentinel = (tdp_schema *)&sentinel, *s = sentinel;
    char why[512];
    memset(why, 'X', sizeof(why));
    tdp_err rc = tdp_schema_decode(json, len, lim, &s, why, sizeof(why));
    assert_non_null(memchr(why, '\0', sizeof(why)));
    if (rc != want)
        fail_msg("decode gave %s (%s), want %s, for:\n%.400s", tdp_errname(rc), rc ? why : "",
                 tdp_errname(want), json ? json : "(null)");
    if (rc != TDP_OK) {
        assert_ptr_equal(s, sentinel);
        assert_true(why[0] != '\0');
        if (n1 != NULL && strstr(why, n1) == NULL)
            fail_msg("'%s' not in message '%s'", n1, why);
        if (n2 != NULL && strstr(why, n2) == NULL)
            fail_msg("'%s' not in message '%s'", n2, why);
        return NULL;
    }
    assert_string_equal(why, "");
    assert_ptr_not_equal(s, sentinel);
    assert_non_null(s);
    return s;
}

static tdp_schema *expect(const char *json, const tdp_schema_limits *lim, tdp_err want,
                          const char *n1, const char *n2)
{
    return expect_n(json, strlen(json), lim, want, n1, n2);
}

/* Same, consuming a malloc'd document; a success is checked and dropped. */
static void expect_doc(char *json, const tdp_schema_limits *lim, tdp_err want, const char *n1,
                       const char *n2)
{
    tdp_schema *s = expect(json, lim, want, n1, n2);
    if (s != NULL) {
        /* what was accepted re-encodes to something that decodes alike */
        size_t len;
        const char *j = tdp_schema_json(s, &len);
        tdp_schema *again = expect_n(j, len, lim, TDP_OK, NULL, NULL);
        assert_true(tdp_schema_equal(s, again));
        tdp_schema_unref(again);
        tdp_schema_unref(s);
    }
    free(json);
}

static tdp_schema_limits limits(void)
{
    tdp_schema_limits l;
    tdp_schema_limits_default(&l);
    return l;
}

/* ---- sanity: the helpers produce a valid document --------------------------- */

static void test_baseline_accepted(void **state)
{
    (void)state;
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[2,2],0,16,0]", "\"v\":1"), NULL, TDP_OK, NULL,
               NULL);
    expect_doc(doc("0", "", ""), NULL, TDP_OK, NULL, NULL);
    /* tensordict pads to 8 only: decoded schemas need only dtype alignment */
    expect_doc(doc("32",
                   "\"a\":[\"torch.uint8\",[3],0,8,5],\"b\":[\"torch.float64\",[1],8,16,0],"
                   "\"c\":[\"torch.complex128\",[1],16,32,0]",
                   ""),
               NULL, TDP_OK, NULL, NULL);
    /* optional metadata fields may be missing; names may be given */
    expect_doc(top("8", node("2", "\"x\":[\"torch.int16\",[2],0,4,0]", "", "")), NULL, TDP_OK, NULL,
               NULL);
}

/* ---- arithmetic -------------------------------------------------------------- */

static void test_shape_overflow(void **state)
{
    (void)state;
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[4294967296,4294967296,2],0,64,0]", ""), NULL,
               TDP_ESCHEMA, "'x'", "overflow");
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[4611686018427387904],0,64,0]", ""), NULL,
               TDP_ESCHEMA, "'x'", "overflow");
    expect_doc(
        doc("64", "\"x\":[\"torch.uint8\",[9223372036854775807,9223372036854775807],0,64,0]", ""),
        NULL, TDP_ESCHEMA, "'x'", "overflow");
    /* a zero dim makes numel 0, but the int64 strides still overflow */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[0,4294967296,4294967296],0,0,0]", ""), NULL,
               TDP_ESCHEMA, "'x'", "stride");
    /* just past INT64_MAX (2^63) without wrapping uint64 */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[0,4294967296,2147483648],0,0,0]", ""), NULL,
               TDP_ESCHEMA, "'x'", "stride");
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[0,4294967296,2147483647],0,0,0]", ""), NULL,
               TDP_OK, NULL, NULL);
    /* a zero dim with modest others is fine */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[0,65536,65536],0,0,0]", ""), NULL, TDP_OK, NULL,
               NULL);
}

static void test_offset_near_max(void **state)
{
    (void)state;
    expect_doc(
        doc("64", "\"x\":[\"torch.uint8\",[1],9223372036854775807,9223372036854775807,0]", ""),
        NULL, TDP_ESCHEMA, "'x'", "outside");
    expect_doc(
        doc("64", "\"x\":[\"torch.uint8\",[1],9223372036854775800,9223372036854775801,0]", ""),
        NULL, TDP_ESCHEMA, "'x'", "outside");

    /* start + nbytes wraps past 2^64 to a small number: still refused */
    tdp_schema_limits l = limits();
    l.max_total_bytes = UINT64_MAX;
    expect_doc(doc("9223372036854775807",
                   "\"x\":[\"torch.complex128\",[576460752303423489],9223372036854775800,"
                   "9223372036854775807,0]",
                   ""),
               &l, TDP_ESCHEMA, "'x'", "outside");
    /* and beyond int64, JSON integers are refused by the parser */
    expect_doc(
        doc("64", "\"x\":[\"torch.uint8\",[1],18446744073709551615,18446744073709551615,0]", ""),
        NULL, TDP_ESCHEMA, "JSON", "integer");
}

static void test_stop_inconsistent(void **state)
{
    (void)state;
    /* 2x2 float32 is 16 bytes, not 20 */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[2,2],0,20,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "stop");
    /* pad accounts for it: fine */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[2,2],0,20,4]", ""), NULL, TDP_OK, NULL, NULL);
    /* too short */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[2,2],0,12,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "stop");
    /* stop before start */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[0],16,8,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "stop");
    /* pad larger than the range */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[1],0,4,8]", ""), NULL, TDP_ESCHEMA, "'x'",
               "pad");
    /* negative numbers */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[1],-4,0,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "non-negative");
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[1],0,4,-1]", ""), NULL, TDP_ESCHEMA, "'x'",
               "non-negative");
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[1],0,4.0,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "integers");
}

static void test_leaf_beyond_total(void **state)
{
    (void)state;
    expect_doc(doc("8", "\"x\":[\"torch.float32\",[4],0,16,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "8-byte buffer");
    expect_doc(doc("16", "\"x\":[\"torch.float32\",[4],0,16,0]", ""), NULL, TDP_OK, NULL, NULL);
    /* the padding must fit too */
    expect_doc(doc("16", "\"x\":[\"torch.float32\",[4],0,24,8]", ""), NULL, TDP_ESCHEMA, "'x'",
               "padding");
    expect_doc(doc("0", "\"x\":[\"torch.uint8\",[1],0,1,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "outside");
}

static void test_overlap(void **state)
{
    (void)state;
    expect_doc(
        doc("64", "\"a\":[\"torch.float32\",[4],0,16,0],\"b\":[\"torch.float32\",[4],8,24,0]", ""),
        NULL, TDP_ESCHEMA, "'b' overlaps leaf 'a'", NULL);
    /* a's padding covers b */
    expect_doc(doc("64",
                   "\"a\":[\"torch.float32\",[4],0,32,16],\"b\":[\"torch.float32\",[4],16,32,0]",
                   ""),
               NULL, TDP_ESCHEMA, "overlaps", NULL);
    /* same range, two names */
    expect_doc(
        doc("64", "\"a\":[\"torch.float32\",[4],0,16,0],\"b\":[\"torch.int32\",[4],0,16,0]", ""),
        NULL, TDP_ESCHEMA, "overlaps", NULL);
    /* in different nodes */
    expect_doc(
        top("64", node("", "\"a\":[\"torch.float32\",[4],0,16,0]", "",
                       "\"sub\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},"
                       "\"leaves\":{\"b\":[\"torch.uint8\",[1],15,16,0]}}")),
        NULL, TDP_ESCHEMA, "overlaps", NULL);
    /* adjacent is fine */
    expect_doc(
        doc("64", "\"a\":[\"torch.float32\",[4],0,16,0],\"b\":[\"torch.float32\",[4],16,32,0]", ""),
        NULL, TDP_OK, NULL, NULL);
    /* an empty leaf sharing the offset of a full one, either name order */
    expect_doc(
        doc("64", "\"a\":[\"torch.float32\",[4],0,16,0],\"b\":[\"torch.float32\",[0],0,0,0]", ""),
        NULL, TDP_OK, NULL, NULL);
    expect_doc(
        doc("64", "\"b\":[\"torch.float32\",[4],0,16,0],\"a\":[\"torch.float32\",[0],0,0,0]", ""),
        NULL, TDP_OK, NULL, NULL);
    /* ... but an empty leaf inside another one's bytes is not */
    expect_doc(
        doc("64", "\"a\":[\"torch.float32\",[4],0,16,0],\"b\":[\"torch.float32\",[0],8,8,0]", ""),
        NULL, TDP_ESCHEMA, "overlaps", NULL);
}

static void test_misaligned(void **state)
{
    (void)state;
    expect_doc(doc("8", "\"x\":[\"torch.float32\",[1],2,6,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "alignment 4");
    expect_doc(doc("16", "\"x\":[\"torch.float64\",[1],4,12,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "alignment 8");
    expect_doc(doc("32", "\"x\":[\"torch.complex128\",[1],12,28,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "alignment");
    expect_doc(doc("8", "\"x\":[\"torch.int16\",[1],1,3,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "alignment 2");
    expect_doc(doc("8", "\"x\":[\"torch.uint8\",[1],3,4,0]", ""), NULL, TDP_OK, NULL, NULL);
}

/* ---- nesting ------------------------------------------------------------ */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* `depth` nested sub-dicts "a", the deepest with a leaf when asked. */
static char *nested_doc(uint32_t depth, bool leaf)
{
    static const char open[] =
        "{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},\"a\":";
    static const char last_leaf[] = "{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},"
                                    "\"leaves\":{\"x\":[\"torch.float32\",[1],0,4,0]}}";
    static const char last_plain[] =
        "{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}";
    size_t cap = (size_t)depth * sizeof(open) + sizeof(last_leaf) + depth + 256;
    char *td = malloc(cap), *p = td;
    assert_non_null(td);
    for (uint32_t i = 0; i < depth; i++)
        p += sprintf(p, "%s", open);
    p += sprintf(p, "%s", leaf ? last_leaf : last_plain);
    memset(p, '}', depth);
    p[depth] = '\0';
    return top("64", td);
}

static void test_deep_nesting_rejected_fast(void **state)
{
    (void)state;
    double t0 = now_s();
    char *deep = nested_doc(10000, true);
    assert_true(strlen(deep) < TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES); /* the depth rule, not size */
    expect_doc(deep, NULL, TDP_ESCHEMA, "nested", NULL);

    /* bare brackets: never closed, never allocated */
    size_t n = 500000;
    char *brackets = malloc(n);
    assert_non_null(brackets);
    memset(brackets, '[', n);
    expect_n(brackets, n, NULL, TDP_ESCHEMA, "nested", NULL);
    memset(brackets, '{', n);
    expect_n(brackets, n, NULL, TDP_ESCHEMA, "nested", NULL);
    free(brackets);

    /* a permissive depth limit leaves it to the parser's own bound: still no crash */
    tdp_schema_limits l = limits();
    l.max_depth = 1000000;
    expect_doc(nested_doc(10000, false), &l, TDP_ESCHEMA, "JSON", NULL);
    double dt = now_s() - t0;
    if (dt > 2.0)
        fail_msg("deep documents took %.2f s", dt);
}

static void test_depth_limit_exact(void **state)
{
    (void)state;
    tdp_schema_limits l = limits();
    l.max_depth = 3;
    /* at the limit: accepted, also with a leaf (the JSON's deepest point) */
    expect_doc(nested_doc(3, true), &l, TDP_OK, NULL, NULL);
    expect_doc(nested_doc(3, false), &l, TDP_OK, NULL, NULL);
    /* one more: refused, by the pre-scan or by the decoder */
    expect_doc(nested_doc(4, true), &l, TDP_ESCHEMA, "nested", NULL);
    expect_doc(nested_doc(4, false), &l, TDP_ESCHEMA, "nested", NULL);

    /* the default: 32 */
    expect_doc(nested_doc(TDP_SCHEMA_DEFAULT_MAX_DEPTH, true), NULL, TDP_OK, NULL, NULL);
    expect_doc(nested_doc(TDP_SCHEMA_DEFAULT_MAX_DEPTH + 1, true), NULL, TDP_ESCHEMA, "nested",
               NULL);
    expect_doc(nested_doc(TDP_SCHEMA_DEFAULT_MAX_DEPTH + 1, false), NULL, TDP_ESCHEMA, "nested",
               NULL);

    /* a huge limit must not wrap around and refuse everything */
    l.max_depth = UINT32_MAX;
    expect_doc(nested_doc(3, true), &l, TDP_OK, NULL, NULL);
    l.max_depth = UINT32_MAX - 3;
    expect_doc(nested_doc(3, true), &l, TDP_OK, NULL, NULL);
}

/* Brackets inside strings are not nesting, escaped quotes included. */
static void test_brackets_in_strings(void **state)
{
    (void)state;
    tdp_schema_limits l = limits();
    l.max_depth = 1;
    expect_doc(doc("0", "", "\"s\":\"{{{{{{{{[[[[[[[[[[\",\"t\":\"\\\"{{{{{{{{{{{{\\\\\",\"u\":1"),
               &l, TDP_OK, NULL, NULL);
}

/* ---- JSON structure ------------------------------------------------------ */

static void test_duplicate_keys(void **state)
{
    (void)state;
    expect("{\"format\":\"tdpipe.schema\",\"format\":\"tdpipe.schema\",\"version\":1,"
           "\"total_bytes\":0,\"device\":\"cpu\",\"td\":{\"cls\":\"TensorDict\","
           "\"cls_metadata\":{\"batch_size\":[]}}}",
           NULL, TDP_ESCHEMA, "duplicate", "format");
    expect_doc(
        doc("64", "\"x\":[\"torch.float32\",[1],0,4,0],\"x\":[\"torch.float32\",[1],8,12,0]", ""),
        NULL, TDP_ESCHEMA, "duplicate", "x");
    expect_doc(doc("0", "", "\"v\":1,\"v\":2"), NULL, TDP_ESCHEMA, "duplicate", "v");
    /* the same key as a tensor and as a value */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[1],0,4,0]", "\"x\":1"), NULL, TDP_ESCHEMA,
               "'x'", "twice");
    /* and as a leaf and a sub-dict */
    expect_doc(
        top("64", node("", "\"k\":[\"torch.float32\",[1],0,4,0]", "",
                       "\"k\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}")),
        NULL, TDP_ESCHEMA, "'k'", "twice");
    expect_doc(
        top("0", node("", "", "\"k\":null",
                      "\"k\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}")),
        NULL, TDP_ESCHEMA, "'k'", "twice");
    /* duplicate keys in cls_metadata */
    expect(
        "{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":0,\"device\":\"cpu\","
        "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"batch_size\":[]}}}",
        NULL, TDP_ESCHEMA, "duplicate", "batch_size");
}

static void test_bad_dtype(void **state)
{
    (void)state;
    expect_doc(doc("64", "\"x\":[\"torch.float33\",[1],0,4,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "unknown dtype 'torch.float33'");
    expect_doc(doc("64", "\"x\":[\"Float32\",[1],0,4,0]", ""), NULL, TDP_ESCHEMA, "'x'", "dtype");
    expect_doc(doc("64", "\"x\":[\"\",[1],0,4,0]", ""), NULL, TDP_ESCHEMA, "'x'", "dtype");
    expect_doc(doc("64", "\"x\":[5,[1],0,4,0]", ""), NULL, TDP_ESCHEMA, "'x'", "dtype");
    /* the wrong tuple */
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[1],0,4]", ""), NULL, TDP_ESCHEMA, "'x'",
               "expected [dtype");
    expect_doc(doc("64", "\"x\":{\"dtype\":\"torch.float32\"}", ""), NULL, TDP_ESCHEMA, "'x'",
               "expected [dtype");
    expect_doc(doc("64", "\"x\":[\"torch.float32\",1,0,4,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "shape is not an array");
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[1.0],0,4,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "not an integer");
    /* aliases are read, and written back canonically */
    char *j = doc("64", "\"x\":[\"torch.half\",[2],0,4,0]", "");
    tdp_schema *s = expect(j, NULL, TDP_OK, NULL, NULL);
    free(j);
    assert_non_null(strstr(tdp_schema_json(s, NULL), "\"torch.float16\""));
    tdp_schema_unref(s);
}

static void test_negative_dims(void **state)
{
    (void)state;
    expect_doc(doc("64", "\"x\":[\"torch.float32\",[2,-1],0,0,0]", ""), NULL, TDP_ESCHEMA, "'x'",
               "shape[1] = -1 is negative");
    expect_doc(top("64", node("-2", "", "", "")), NULL, TDP_ESCHEMA, "<root>",
               "batch_size[0] = -2 is negative");
    expect_doc(top("64", node("3", "\"x\":[\"torch.float32\",[2],0,8,0]", "", "")), NULL,
               TDP_ESCHEMA, "'x'", "batch_size");
    expect_doc(
        top("0", node("3", "", "",
                      "\"sub\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[4]}}")),
        NULL, TDP_ESCHEMA, "'sub'", "batch_size");
    expect_doc(
        top("0", node("3", "", "",
                      "\"sub\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[3,4]}}")),
        NULL, TDP_OK, NULL, NULL);
}

/* ---- limits ------------------------------------------------------------ */

static void test_oversized_json(void **state)
{
    (void)state;
    size_t n = TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES + 1;
    char *big = malloc(n);
    assert_non_null(big);
    memset(big, ' ', n);
    expect_n(big, n, NULL, TDP_EMSGSIZE, "1048577", "limit 1048576");
    free(big);

    char *j = doc("64", "\"x\":[\"torch.float32\",[2,2],0,16,0]", "\"v\":\"some text\"");
    size_t len = strlen(j);
    tdp_schema_limits l = limits();
    l.max_json_bytes = 100;
    assert_true(len > 100);
    expect(j, &l, TDP_EMSGSIZE, "limit 100", NULL);

    /* a canonical document exactly at the limit is accepted */
    tdp_schema *s = expect(j, NULL, TDP_OK, NULL, NULL);
    size_t clen;
    const char *canon = tdp_schema_json(s, &clen);
    l.max_json_bytes = clen;
    tdp_schema *t = expect_n(canon, clen, &l, TDP_OK, NULL, NULL);
    tdp_schema_unref(t);
    l.max_json_bytes = clen - 1;
    expect_n(canon, clen, &l, TDP_EMSGSIZE, "limit", NULL);
    tdp_schema_unref(s);
    free(j);
}

static void test_too_many_keys(void **state)
{
    (void)state;
    tdp_schema_limits l = limits();
    l.max_keys = 3;
    /* root + 3 leaves = 4 keys */
    expect_doc(doc("0", "", "\"a\":1,\"b\":2,\"c\":3"), &l, TDP_ESCHEMA, "key limit 3", NULL);
    expect_doc(doc("0", "", "\"a\":1,\"b\":2,\"c\":3,\"d\":4,\"e\":5"), &l, TDP_ESCHEMA,
               "more than 3 keys", NULL);
    expect_doc(
        top("0", node("", "", "",
                      "\"s1\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}},"
                      "\"s2\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}},"
                      "\"s3\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}},"
                      "\"s4\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}")),
        &l, TDP_ESCHEMA, "keys", NULL);
    l.max_keys = 4;
    expect_doc(doc("0", "", "\"a\":1,\"b\":2,\"c\":3"), &l, TDP_OK, NULL, NULL);

    /* the default: 4096 */
    size_t cap = 5000 * 16 + 64;
    char *vals = malloc(cap), *p = vals;
    assert_non_null(vals);
    for (int i = 0; i < 4096; i++)
        p += sprintf(p, "%s\"k%d\":%d", i ? "," : "", i, i);
    expect_doc(doc("0", "", vals), NULL, TDP_ESCHEMA, "key", NULL);
    free(vals);
}

static void test_key_rules(void **state)
{
    (void)state;
    char longkey[300], *leaves;
    memset(longkey, 'k', 256);
    longkey[256] = '\0';
    leaves = fmt("\"%s\":[\"torch.uint8\",[1],0,1,0]", longkey);
    expect_doc(doc("64", leaves, ""), NULL, TDP_ESCHEMA, "256 bytes", "limit 255");
    free(leaves);
    longkey[255] = '\0';
    leaves = fmt("\"%s\":[\"torch.uint8\",[1],0,1,0]", longkey);
    expect_doc(doc("64", leaves, ""), NULL, TDP_OK, NULL, NULL);
    free(leaves);

    tdp_schema_limits l = limits();
    l.max_key_len = 4;
    expect_doc(doc("0", "", "\"abcde\":1"), &l, TDP_ESCHEMA, "abcde", "limit 4");
    expect_doc(doc("0", "", "\"abcd\":1"), &l, TDP_OK, NULL, NULL);
    expect_doc(
        top("0", node("", "", "",
                      "\"abcde\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}")),
        &l, TDP_ESCHEMA, "abcde", "limit 4");

    /* the separator */
    expect_doc(doc("64", "\"a.b\":[\"torch.uint8\",[1],0,1,0]", ""), NULL, TDP_ESCHEMA, "'a.b'",
               "separator");
    expect_doc(doc("0", "", "\"a.b\":1"), NULL, TDP_ESCHEMA, "'a.b'", "separator");
    expect_doc(
        top("0", node("", "", "",
                      "\"x.y\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}")),
        NULL, TDP_ESCHEMA, "'x.y'", "separator");
    /* control characters */
    expect_doc(doc("64", "\"a\\u0001b\":[\"torch.uint8\",[1],0,1,0]", ""), NULL, TDP_ESCHEMA,
               "control character 0x01", NULL);
    expect_doc(doc("0", "", "\"tab\\there\":1"), NULL, TDP_ESCHEMA, "control character 0x09", NULL);
    expect_doc(doc("0", "", "\"del\\u007f\":1"), NULL, TDP_ESCHEMA, "control character 0x7f", NULL);
    expect_doc(top("0", node("", "", "",
                             "\"n\\u001f\":{\"cls\":\"TensorDict\",\"cls_metadata\":"
                             "{\"batch_size\":[]}}")),
               NULL, TDP_ESCHEMA, "control character 0x1f", NULL);
    /* NUL cannot even be parsed as a key */
    expect_doc(doc("0", "", "\"a\\u0000b\":1"), NULL, TDP_ESCHEMA, "JSON", "NUL");
    /* empty */
    expect_doc(doc("0", "", "\"\":1"), NULL, TDP_ESCHEMA, "empty key", NULL);
    expect_doc(top("0", node("", "", "",
                             "\"\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}")),
               NULL, TDP_ESCHEMA, "empty key", NULL);
    /* UTF-8 keys are fine */
    expect_doc(doc("0", "", "\"caf\xc3\xa9\":1,\"\\u00fcber\":2"), NULL, TDP_OK, NULL, NULL);
}

static void test_rank(void **state)
{
    (void)state;
    char dims[512], *leaves;
    char *p = dims;
    for (int i = 0; i < 17; i++)
        p += sprintf(p, "%s1", i ? "," : "");
    leaves = fmt("\"x\":[\"torch.uint8\",[%s],0,1,0]", dims);
    expect_doc(doc("64", leaves, ""), NULL, TDP_ESCHEMA, "'x'", "17 dims, limit 16");
    free(leaves);
    expect_doc(top("0", node(dims, "", "", "")), NULL, TDP_ESCHEMA, "batch_size",
               "17 dims, limit 16");

    tdp_schema_limits l = limits();
    l.max_rank = 2;
    expect_doc(doc("64", "\"x\":[\"torch.uint8\",[1,1,1],0,1,0]", ""), &l, TDP_ESCHEMA, "'x'",
               "3 dims, limit 2");
    expect_doc(doc("64", "\"x\":[\"torch.uint8\",[1,1],0,1,0]", ""), &l, TDP_OK, NULL, NULL);

    /* no limit goes past TDP_MAX_RANK */
    l.max_rank = 1000;
    p = dims;
    for (int i = 0; i < TDP_MAX_RANK + 1; i++)
        p += sprintf(p, "%s1", i ? "," : "");
    leaves = fmt("\"x\":[\"torch.uint8\",[%s],0,1,0]", dims);
    expect_doc(doc("64", leaves, ""), &l, TDP_ESCHEMA, "65 dims, limit 64", NULL);
    free(leaves);
    dims[strlen(dims) - 2] = '\0'; /* 64 dims */
    leaves = fmt("\"x\":[\"torch.uint8\",[%s],0,1,0]", dims);
    expect_doc(doc("64", leaves, ""), &l, TDP_OK, NULL, NULL);
    free(leaves);
}

static void test_total_bytes_limit(void **state)
{
    (void)state;
    expect_doc(doc("68719476737", "", ""), NULL, TDP_EMSGSIZE, "total_bytes 68719476737", "limit");
    expect_doc(doc("68719476736", "", ""), NULL, TDP_OK, NULL, NULL);
    tdp_schema_limits l = limits();
    l.max_total_bytes = 1000;
    expect_doc(doc("1024", "\"x\":[\"torch.uint8\",[1000],0,1000,0]", ""), &l, TDP_EMSGSIZE,
               "total_bytes 1024", "limit 1000");
    expect_doc(doc("1000", "\"x\":[\"torch.uint8\",[1000],0,1000,0]", ""), &l, TDP_OK, NULL, NULL);
    /* malformed total_bytes */
    expect_doc(doc("-1", "", ""), NULL, TDP_ESCHEMA, "total_bytes", NULL);
    expect_doc(doc("1.5", "", ""), NULL, TDP_ESCHEMA, "total_bytes", NULL);
    expect_doc(doc("\"64\"", "", ""), NULL, TDP_ESCHEMA, "total_bytes", NULL);
}

static void test_value_limits(void **state)
{
    (void)state;
    tdp_schema_limits l = limits();
    /* the limit covers class names too: "TensorDict" needs 10 */
    l.max_value_bytes = 12;
    expect_doc(doc("0", "", "\"v\":\"1234567890123\""), &l, TDP_ESCHEMA, "'v'", "limit 12");
    expect_doc(doc("0", "", "\"v\":\"1234567890\""), &l, TDP_OK, NULL, NULL); /* 12 encoded */
    expect_doc(doc("0", "", "\"v\":\"12345678901\""), &l, TDP_ESCHEMA, "'v'", "encoded");
    /* the encoded form counts: 4 x U+00E9 is 8 bytes of UTF-8, 26 escaped */
    l.max_value_bytes = 16;
    expect_doc(doc("0", "", "\"v\":\"\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\""), &l, TDP_ESCHEMA, "'v'",
               "encoded");
    /* class names */
    l.max_value_bytes = 12;
    char *td = fmt("{\"cls\":\"VeryLongClassName\",\"cls_metadata\":{\"batch_size\":[]}}");
    expect_doc(top("0", td), &l, TDP_ESCHEMA, "class name", NULL);
    td = fmt("{\"cls\":\"\",\"cls_metadata\":{\"batch_size\":[]}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "class name", NULL);
}

/* ---- fields -------------------------------------------------------------- */

static void test_header_fields(void **state)
{
    (void)state;
    static const char *const bad_format[] = {
        "{\"format\":\"tdpipe.schemas\",\"version\":1,\"total_bytes\":0,\"device\":\"cpu\","
        "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}}",
        "{\"format\":\"safetensors\",\"version\":1,\"total_bytes\":0,\"device\":\"cpu\","
        "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}}",
        "{\"format\":1,\"version\":1,\"total_bytes\":0,\"device\":\"cpu\","
        "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}}",
        "{\"version\":1,\"total_bytes\":0,\"device\":\"cpu\","
        "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}}",
    };
    for (uint32_t i = 0; i < N(bad_format); i++)
        expect(bad_format[i], NULL, TDP_ESCHEMA, "format", NULL);

    static const char *const bad_version[] = {"2", "0", "\"1\"", "1.0", "-1", "null"};
    for (uint32_t i = 0; i < N(bad_version); i++) {
        char *j = fmt("{\"format\":\"tdpipe.schema\",\"version\":%s,\"total_bytes\":0,"
                      "\"device\":\"cpu\",\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":"
                      "{\"batch_size\":[]}}}",
                      bad_version[i]);
        expect_doc(j, NULL, TDP_ESCHEMA, "version", NULL);
    }
    expect("{\"format\":\"tdpipe.schema\",\"total_bytes\":0,\"device\":\"cpu\","
           "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}}",
           NULL, TDP_ESCHEMA, "version", NULL);

    expect("{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":0,\"device\":\"cpu\","
           "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}},\"extra\":true}",
           NULL, TDP_ESCHEMA, "unknown top-level field 'extra'", NULL);
    expect("{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":0,\"device\":\"cpu\"}",
           NULL, TDP_ESCHEMA, "'td' is not an object", NULL);
    expect("{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":0,\"device\":\"cpu\","
           "\"td\":[]}",
           NULL, TDP_ESCHEMA, "'td' is not an object", NULL);
}

static void test_node_fields(void **state)
{
    (void)state;
    char *td;
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"foo\":1}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "unknown cls_metadata field 'foo'", "<root>");
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},\"sub\":"
             "{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"bar\":null}}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "'bar'", "'sub'");
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "no batch_size", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":[]}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "cls_metadata", NULL);
    td = fmt("{\"cls\":\"TensorDict\"}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "cls_metadata", NULL);
    td = fmt("{\"cls_metadata\":{\"batch_size\":[]}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "cls is missing", NULL);
    td = fmt("{\"cls\":7,\"cls_metadata\":{\"batch_size\":[]}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "cls", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"is_locked\":1}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "is_locked", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":{}}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "batch_size is not an array", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},\"leaves\":[]}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "leaves is not an object", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},\"non_tensors\":1}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "non_tensors is not an object", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]},\"sub\":5}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "'sub' is not an object", NULL);
    /* is_locked round-trips */
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"is_locked\":true}}");
    char *j = top("0", td);
    tdp_schema *s = expect(j, NULL, TDP_OK, NULL, NULL);
    tdp_node_info n;
    OK(tdp_schema_node_at(s, 0, &n));
    assert_true(n.is_locked);
    tdp_schema_unref(s);
    free(j);
}

static void test_non_scalar_values(void **state)
{
    (void)state;
    expect_doc(doc("0", "", "\"v\":[1,2]"), NULL, TDP_ESCHEMA, "'v'", "scalar");
    expect_doc(doc("0", "", "\"w\":{\"a\":1}"), NULL, TDP_ESCHEMA, "'w'", "scalar");
    expect_doc(doc("0", "", "\"e\":[]"), NULL, TDP_ESCHEMA, "'e'", "scalar");
    /* every scalar kind is fine */
    char *j = doc("0", "", "\"s\":\"x\",\"i\":-3,\"r\":0.25,\"t\":true,\"f\":false,\"n\":null");
    tdp_schema *s = expect(j, NULL, TDP_OK, NULL, NULL);
    free(j);
    static const struct {
        const char *path, *json;
    } want[] = {{"s", "\"x\""}, {"i", "-3"},    {"r", "0.25"},
                {"t", "true"},  {"f", "false"}, {"n", "null"}};
    for (uint32_t i = 0; i < N(want); i++) {
        tdp_leaf l;
        OK(tdp_schema_find(s, want[i].path, &l));
        assert_int_equal(l.kind, TDP_LEAF_VALUE);
        assert_string_equal(l.value_json, want[i].json);
    }
    tdp_schema_unref(s);
}

static void test_names(void **state)
{
    (void)state;
    char *td;
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[2,3],\"names\":[\"a\"]}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "names", "<root>");
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[2],"
             "\"names\":[\"a\",\"b\"]}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "names", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[2],\"names\":[7]}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "names[0]", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[2],\"names\":\"a\"}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "names", NULL);
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"names\":[\"a\"]}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "names", NULL);

    /* right length, with a null entry: kept */
    td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[2,3],"
             "\"names\":[\"batch\",null]}}");
    char *j = top("0", td);
    tdp_schema *s = expect(j, NULL, TDP_OK, NULL, NULL);
    free(j);
    tdp_node_info n;
    OK(tdp_schema_node_at(s, 0, &n));
    assert_non_null(n.names);
    assert_string_equal(n.names[0], "batch");
    assert_null(n.names[1]);
    assert_non_null(strstr(tdp_schema_json(s, NULL), "\"names\":[\"batch\",null]"));
    tdp_schema_unref(s);
}

static void test_devices(void **state)
{
    (void)state;
    static const char *const bad[] = {"cuda:01", "tpu", "", "CPU", "cuda:", "cuda:-1"};
    for (uint32_t i = 0; i < N(bad); i++) {
        char *j = fmt("{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":0,"
                      "\"device\":\"%s\",\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":"
                      "{\"batch_size\":[]}}}",
                      bad[i]);
        expect_doc(j, NULL, TDP_ESCHEMA, "device", NULL);
        char *td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],"
                       "\"device\":\"%s\"}}",
                       bad[i]);
        expect_doc(top("0", td), NULL, TDP_ESCHEMA, "<root>", "device");
    }
    expect("{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":0,\"device\":null,"
           "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[]}}}",
           NULL, TDP_ESCHEMA, "device", NULL);
    char *td = fmt("{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"device\":3}}");
    expect_doc(top("0", td), NULL, TDP_ESCHEMA, "device", NULL);
    /* good ones */
    char *j = fmt("{\"format\":\"tdpipe.schema\",\"version\":1,\"total_bytes\":0,"
                  "\"device\":\"cuda:7\",\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":"
                  "{\"batch_size\":[],\"device\":\"cuda\"}}}");
    tdp_schema *s = expect(j, NULL, TDP_OK, NULL, NULL);
    free(j);
    assert_true(tdp_device_equal(tdp_schema_device(s), (tdp_device){TDP_DEVICE_CUDA, 7}));
    tdp_node_info n;
    OK(tdp_schema_node_at(s, 0, &n));
    assert_true(n.has_device);
    assert_true(tdp_device_equal(n.device, (tdp_device){TDP_DEVICE_CUDA, 0}));
    tdp_schema_unref(s);
}

/* ---- not JSON ------------------------------------------------------------ */

static void test_garbage(void **state)
{
    (void)state;
    static const char *const junk[] = {
        "hello",
        "\xff\xfe\x00\x01",
        "[]",
        "null",
        "42",
        "\"tdpipe.schema\"",
        "{",
        "}",
        "{\"format\":\"tdpipe.schema\"",
        "{} {}",
        "{\"a\":1} x",
        "\xef\xbb\xbf{}",
        "{\"format\":\"tdpipe.sch\xff\"}",
        "{'format':'tdpipe.schema'}",
    };
    for (uint32_t i = 0; i < N(junk); i++)
        expect(junk[i], NULL, TDP_ESCHEMA, NULL, NULL);
    expect("{}", NULL, TDP_ESCHEMA, "format", NULL);
    expect("[1,2,3]", NULL, TDP_ESCHEMA, "not a JSON object", NULL);
    /* NUL bytes inside the buffer */
    static const char nul[] = "{\"format\":\0\"tdpipe.schema\"}";
    expect_n(nul, sizeof(nul) - 1, NULL, TDP_ESCHEMA, "JSON", NULL);
    /* random bytes */
    unsigned seed = 12345;
    char buf[256];
    for (int round = 0; round < 200; round++) {
        size_t n = (size_t)(rand_r(&seed) % sizeof(buf));
        for (size_t i = 0; i < n; i++)
            buf[i] = (char)(rand_r(&seed) & 0xff);
        expect_n(buf, n, NULL, TDP_ESCHEMA, NULL, NULL);
    }
}

static void test_empty_and_null_input(void **state)
{
    (void)state;
    expect_n("", 0, NULL, TDP_ESCHEMA, "JSON", NULL);
    expect_n("{}", 0, NULL, TDP_ESCHEMA, "JSON", NULL); /* len wins over the text */
    expect_n("   \n\t ", 6, NULL, TDP_ESCHEMA, "JSON", NULL);

    tdp_schema *s = (tdp_schema *)&s;
    char why[64];
    assert_int_equal(tdp_schema_decode(NULL, 10, NULL, &s, why, sizeof(why)), TDP_EINVAL);
    assert_ptr_equal(s, (tdp_schema *)&s);
    assert_int_equal(tdp_schema_decode("{}", 2, NULL, NULL, why, sizeof(why)), TDP_EINVAL);
    /* no `why`: fine */
    assert_int_equal(tdp_schema_decode("{}", 2, NULL, &s, NULL, 0), TDP_ESCHEMA);
    assert_int_equal(tdp_schema_decode("{}", 2, NULL, &s, why, 0), TDP_ESCHEMA);
    /* a short `why` is truncated, NUL-terminated, and nothing past it is written */
    char small[12];
    memset(small, 'Z', sizeof(small));
    assert_int_equal(tdp_schema_decode("{}", 2, NULL, &s, small, 8), TDP_ESCHEMA);
    assert_int_equal(strlen(small), 7);
    assert_int_equal(small[8], 'Z');
    assert_ptr_equal(s, (tdp_schema *)&s);
}

/* Every proper prefix of a valid document fails cleanly. */
static void test_truncated_prefixes(void **state)
{
    (void)state;
    char *j =
        top("256",
            node("2", "\"a\":[\"torch.float32\",[2,3],0,32,8],\"b\":[\"torch.int64\",[2],64,80,0]",
                 "\"name\":\"x \\\"y\\\" \\u00e9\",\"n\":-1.5e3,\"ok\":true,\"none\":null",
                 "\"sub\":{\"cls\":\"Sub\",\"cls_metadata\":{\"batch_size\":[2,1],"
                 "\"device\":\"cpu\",\"is_locked\":false,\"names\":[\"b\",null]},"
                 "\"leaves\":{\"c\":[\"torch.bool\",[2,1,4],128,136,0]},"
                 "\"non_tensors\":{\"k\":1}}"));
    size_t len = strlen(j);
    tdp_schema *s = expect_n(j, len, NULL, TDP_OK, NULL, NULL);
    tdp_schema_unref(s);
    for (size_t n = 0; n < len; n++)
        expect_n(j, n, NULL, TDP_ESCHEMA, NULL, NULL);

    /* the canonical form of it, too */
    s = expect_n(j, len, NULL, TDP_OK, NULL, NULL);
    size_t clen;
    const char *canon = tdp_schema_json(s, &clen);
    for (size_t n = 0; n < clen; n++)
        expect_n(canon, n, NULL, TDP_ESCHEMA, NULL, NULL);
    tdp_schema_unref(s);
    free(j);
}

/* An older caller's smaller struct: fields past its size take defaults. */
static void test_limits_size(void **state)
{
    (void)state;
    char *deep = nested_doc(3, true);
    char *bigtotal = doc("1048576", "", "");

    /* only max_json_bytes is inside the declared size */
    tdp_schema_limits l;
    memset(&l, 0, sizeof(l));
    l.size = offsetof(tdp_schema_limits, max_json_bytes) + sizeof(l.max_json_bytes);
    l.max_json_bytes = 50;
    l.max_depth = 1;         /* past size: ignored */
    l.max_total_bytes = 100; /* past size: ignored */
    expect(deep, &l, TDP_EMSGSIZE, "limit 50", NULL);
    l.max_json_bytes = 1 << 20;
    tdp_schema *s = expect(deep, &l, TDP_OK, NULL, NULL);
    tdp_schema_unref(s);
    s = expect(bigtotal, &l, TDP_OK, NULL, NULL);
    tdp_schema_unref(s);

    /* the full size: the same fields are honoured */
    l.size = sizeof(l);
    expect(deep, &l, TDP_ESCHEMA, "nested", NULL);
    l.max_depth = 0; /* zero means default */
    expect(bigtotal, &l, TDP_EMSGSIZE, "limit 100", NULL);

    /* size 0: all defaults, whatever the fields say */
    memset(&l, 0xff, sizeof(l));
    l.size = 0;
    s = expect(deep, &l, TDP_OK, NULL, NULL);
    tdp_schema_unref(s);

    /* a newer caller's larger struct: known fields are read */
    struct {
        tdp_schema_limits l;
        uint64_t future[4];
    } newer;
    memset(&newer, 0xff, sizeof(newer));
    tdp_schema_limits_default(&newer.l);
    newer.l.size = sizeof(newer);
    newer.l.max_depth = 2;
    expect(deep, &newer.l, TDP_ESCHEMA, "nested", NULL);

    free(deep);
    free(bigtotal);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_baseline_accepted),
        cmocka_unit_test(test_shape_overflow),
        cmocka_unit_test(test_offset_near_max),
        cmocka_unit_test(test_stop_inconsistent),
        cmocka_unit_test(test_leaf_beyond_total),
        cmocka_unit_test(test_overlap),
        cmocka_unit_test(test_misaligned),
        cmocka_unit_test(test_deep_nesting_rejected_fast),
        cmocka_unit_test(test_depth_limit_exact),
        cmocka_unit_test(test_brackets_in_strings),
        cmocka_unit_test(test_duplicate_keys),
        cmocka_unit_test(test_bad_dtype),
        cmocka_unit_test(test_negative_dims),
        cmocka_unit_test(test_oversized_json),
        cmocka_unit_test(test_too_many_keys),
        cmocka_unit_test(test_key_rules),
        cmocka_unit_test(test_rank),
        cmocka_unit_test(test_total_bytes_limit),
        cmocka_unit_test(test_value_limits),
        cmocka_unit_test(test_header_fields),
        cmocka_unit_test(test_node_fields),
        cmocka_unit_test(test_non_scalar_values),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_devices),
        cmocka_unit_test(test_garbage),
        cmocka_unit_test(test_empty_and_null_input),
        cmocka_unit_test(test_truncated_prefixes),
        cmocka_unit_test(test_limits_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
