/*
 * test_schema: the builder, the canonical JSON, the hash, the layout and the
 * queries of a schema. Hostile input to the decoder is test_validate's.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>
#include <tdpipe/mem.h>
#include <tdpipe/schema.h>

#define N(a)     (uint32_t)(sizeof(a) / sizeof((a)[0]))
#define OK(call) assert_int_equal((call), TDP_OK)

static tdp_schema *finish(tdp_schema_builder *b)
{
    tdp_schema *s = NULL;
    char why[256];
    tdp_err rc = tdp_schema_builder_finish(b, &s, why, sizeof(why));
    if (rc != TDP_OK)
        fail_msg("finish: %s: %s", tdp_errname(rc), why);
    assert_non_null(s);
    tdp_schema_builder_free(b);
    return s;
}

static tdp_schema *decode(const char *json)
{
    tdp_schema *s = NULL;
    char why[256];
    tdp_err rc = tdp_schema_decode(json, strlen(json), NULL, &s, why, sizeof(why));
    if (rc != TDP_OK)
        fail_msg("decode: %s: %s\n%s", tdp_errname(rc), why, json);
    return s;
}

/* ---- schemas used throughout ------------------------------------------- */

static tdp_schema *flat_schema(void)
{
    tdp_schema_builder *b;
    const int64_t s3[] = {3}, s22[] = {2, 2};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "a", TDP_FLOAT32, 1, s3));
    OK(tdp_schema_builder_tensor(b, "b", TDP_INT64, 2, s22));
    OK(tdp_schema_builder_tensor(b, "c", TDP_BOOL, 0, NULL));
    return finish(b);
}

static tdp_schema *nested_schema(void)
{
    tdp_schema_builder *b;
    const int64_t bs[] = {2, 3}, sh[] = {2, 3, 4}, sh2[] = {2, 3, 5, 5};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", "Root", 1, bs));
    OK(tdp_schema_builder_node(b, "x", "X", 2, bs));
    OK(tdp_schema_builder_node(b, "x.y", NULL, 2, bs));
    OK(tdp_schema_builder_node(b, "x.y.z", "Leafy", 2, bs));
    OK(tdp_schema_builder_tensor(b, "x.y.z.w", TDP_FLOAT64, 3, sh));
    OK(tdp_schema_builder_tensor(b, "x.y.v", TDP_UINT8, 4, sh2));
    OK(tdp_schema_builder_tensor(b, "top", TDP_FLOAT16, 1, bs));
    OK(tdp_schema_builder_string(b, "x.y.z.label", "deep"));
    return finish(b);
}

static tdp_schema *values_schema(void)
{
    tdp_schema_builder *b;
    const int64_t one[] = {1};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "t", TDP_INT32, 1, one));
    OK(tdp_schema_builder_string(b, "s", "hello \"world\" \xc3\xa9"));
    OK(tdp_schema_builder_int(b, "i", -42));
    OK(tdp_schema_builder_int(b, "big", INT64_MIN));
    OK(tdp_schema_builder_value(b, "r", "2.5"));
    OK(tdp_schema_builder_value(b, "yes", "true"));
    OK(tdp_schema_builder_value(b, "no", " false "));
    OK(tdp_schema_builder_value(b, "nothing", "null"));
    OK(tdp_schema_builder_string(b, "meta.env", "CartPole-v1"));
    return finish(b);
}

static tdp_schema *empty_schema(void)
{
    tdp_schema_builder *b;
    OK(tdp_schema_builder_new(&b));
    return finish(b);
}

static tdp_schema *zero_dims_schema(void)
{
    tdp_schema_builder *b;
    const int64_t z0[] = {0, 5}, z1[] = {3, 0, 2}, one[] = {7}, z2[] = {0};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "e0", TDP_FLOAT32, 2, z0));
    OK(tdp_schema_builder_tensor(b, "full", TDP_FLOAT32, 1, one));
    OK(tdp_schema_builder_tensor(b, "e1", TDP_COMPLEX128, 3, z1));
    OK(tdp_schema_builder_tensor(b, "e2", TDP_INT16, 1, z2));
    OK(tdp_schema_builder_tensor(b, "a_last", TDP_INT8, 1, one));
    return finish(b);
}

/*
 * An empty leaf declared before a non-empty one at the same offset whose
 * path sorts first: the layout must still validate.
 */
static tdp_schema *empty_first_schema(void)
{
    tdp_schema_builder *b;
    const int64_t z[] = {0}, four[] = {4};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "b_empty", TDP_FLOAT32, 1, z));
    OK(tdp_schema_builder_tensor(b, "a_full", TDP_FLOAT32, 1, four));
    return finish(b);
}

static tdp_schema *batch_class_schema(void)
{
    tdp_schema_builder *b;
    const int64_t bs[] = {4, 2}, obs[] = {4, 2, 84, 84}, act[] = {4, 2};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", "MyData", 2, bs));
    OK(tdp_schema_builder_node(b, "next", "Transition", 2, bs));
    OK(tdp_schema_builder_node(b, "stats", NULL, 2, bs));
    OK(tdp_schema_builder_tensor(b, "obs", TDP_UINT8, 4, obs));
    OK(tdp_schema_builder_tensor(b, "next.obs", TDP_UINT8, 4, obs));
    OK(tdp_schema_builder_tensor(b, "action", TDP_BFLOAT16, 2, act));
    OK(tdp_schema_builder_tensor(b, "stats.mean", TDP_FLOAT64, 2, act));
    return finish(b);
}

static tdp_schema *all_dtypes_schema(void)
{
    tdp_schema_builder *b;
    const int64_t sh[] = {3};
    OK(tdp_schema_builder_new(&b));
    for (int dt = 1; dt < TDP_DTYPE_COUNT; dt++) {
        char path[64];
        snprintf(path, sizeof(path), "t%02d", dt);
        OK(tdp_schema_builder_tensor(b, path, (tdp_dtype)dt, 1, sh));
    }
    return finish(b);
}

typedef tdp_schema *(*schema_fn)(void);
static const schema_fn all_schemas[] = {flat_schema,        nested_schema,    values_schema,
                                        empty_schema,       zero_dims_schema, empty_first_schema,
                                        batch_class_schema, all_dtypes_schema};

/* ---- round trip ---------------------------------------------------------- */

static void assert_same_views(const tdp_schema *a, const tdp_schema *b)
{
    assert_int_equal(tdp_schema_num_leaves(a), tdp_schema_num_leaves(b));
    assert_int_equal(tdp_schema_num_tensors(a), tdp_schema_num_tensors(b));
    assert_int_equal(tdp_schema_num_nodes(a), tdp_schema_num_nodes(b));
    assert_int_equal(tdp_schema_total_bytes(a), tdp_schema_total_bytes(b));
    assert_true(tdp_device_equal(tdp_schema_device(a), tdp_schema_device(b)));
    for (uint32_t i = 0; i < tdp_schema_num_leaves(a); i++) {
        tdp_leaf x, y;
        OK(tdp_schema_leaf_at(a, i, &x));
        OK(tdp_schema_leaf_at(b, i, &y));
        assert_string_equal(x.path, y.path);
        assert_string_equal(x.key, y.key);
        assert_int_equal(x.kind, y.kind);
        assert_int_equal(x.dtype, y.dtype);
        assert_int_equal(x.ndim, y.ndim);
        assert_int_equal(x.numel, y.numel);
        assert_int_equal(x.offset, y.offset);
        assert_int_equal(x.nbytes, y.nbytes);
        assert_null(x.data);
        assert_null(y.data);
        if (x.ndim > 0) {
            assert_memory_equal(x.shape, y.shape, x.ndim * sizeof(int64_t));
            assert_memory_equal(x.strides, y.strides, x.ndim * sizeof(int64_t));
        }
        if (x.kind == TDP_LEAF_VALUE)
            assert_string_equal(x.value_json, y.value_json);
        else
            assert_null(x.value_json);
    }
    for (uint32_t i = 0; i < tdp_schema_num_nodes(a); i++) {
        tdp_node_info x, y;
        OK(tdp_schema_node_at(a, i, &x));
        OK(tdp_schema_node_at(b, i, &y));
        assert_string_equal(x.path, y.path);
        assert_string_equal(x.cls, y.cls);
        assert_int_equal(x.depth, y.depth);
        assert_int_equal(x.batch_ndim, y.batch_ndim);
        if (x.batch_ndim > 0)
            assert_memory_equal(x.batch_size, y.batch_size, x.batch_ndim * sizeof(int64_t));
        assert_int_equal(x.num_children, y.num_children);
        assert_int_equal(x.num_leaves, y.num_leaves);
        assert_int_equal(x.has_device, y.has_device);
        assert_true(tdp_device_equal(x.device, y.device));
    }
}

static void test_roundtrip(void **state)
{
    (void)state;
    for (uint32_t k = 0; k < N(all_schemas); k++) {
        tdp_schema *s = all_schemas[k]();
        size_t len = 0;
        const char *json = tdp_schema_json(s, &len);
        assert_non_null(json);
        assert_int_equal(strlen(json), len);
        assert_int_equal(tdp_schema_hash(s), XXH3_64bits(json, len));

        tdp_schema *back = NULL;
        char why[256] = "untouched";
        assert_int_equal(tdp_schema_decode(json, len, NULL, &back, why, sizeof(why)), TDP_OK);
        assert_string_equal(why, ""); /* cleared, no message on success */
        assert_true(tdp_schema_equal(s, back));
        assert_true(tdp_schema_equal(back, s));
        assert_int_equal(tdp_schema_hash(s), tdp_schema_hash(back));
        size_t len2;
        const char *json2 = tdp_schema_json(back, &len2);
        assert_int_equal(len, len2);
        assert_memory_equal(json, json2, len);
        assert_same_views(s, back);
        tdp_schema_unref(back);
        tdp_schema_unref(s);
    }
}

static void test_golden_canonical_json(void **state)
{
    (void)state;
    tdp_schema_builder *b;
    const int64_t bs[] = {2}, sh[] = {2, 3};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    OK(tdp_schema_builder_tensor(b, "x", TDP_FLOAT32, 2, sh));
    OK(tdp_schema_builder_node(b, "sub", "Sub", 1, bs));
    OK(tdp_schema_builder_tensor(b, "sub.y", TDP_INT64, 1, bs));
    OK(tdp_schema_builder_int(b, "n", 7));
    tdp_schema *s = finish(b);
    static const char golden[] =
        "{\"device\":\"cpu\",\"format\":\"tdpipe.schema\",\"td\":{\"cls\":\"TensorDict\","
        "\"cls_metadata\":{\"batch_size\":[2],\"device\":\"cpu\",\"is_locked\":false,"
        "\"names\":null},\"leaves\":{\"x\":[\"torch.float32\",[2,3],0,64,40]},"
        "\"non_tensors\":{\"n\":7},\"sub\":{\"cls\":\"Sub\",\"cls_metadata\":{\"batch_size\":[2],"
        "\"device\":\"cpu\",\"is_locked\":false,\"names\":null},\"leaves\":{\"y\":"
        "[\"torch.int64\",[2],64,128,48]},\"non_tensors\":{}}},\"total_bytes\":128,\"version\":1}";
    assert_string_equal(tdp_schema_json(s, NULL), golden);
    assert_int_equal(tdp_schema_hash(s), XXH3_64bits(golden, strlen(golden)));
    tdp_schema_unref(s);
}

static void test_values_canonical(void **state)
{
    (void)state;
    tdp_schema *s = values_schema();
    static const struct {
        const char *path, *json;
    } want[] = {
        {"s", "\"hello \\\"world\\\" \\u00E9\""}, /* ASCII-escaped */
        {"i", "-42"},
        {"big", "-9223372036854775808"},
        {"r", "2.5"},
        {"yes", "true"},
        {"no", "false"},
        {"nothing", "null"},
        {"meta.env", "\"CartPole-v1\""},
    };
    for (uint32_t i = 0; i < N(want); i++) {
        tdp_leaf l;
        OK(tdp_schema_find(s, want[i].path, &l));
        assert_int_equal(l.kind, TDP_LEAF_VALUE);
        assert_int_equal(l.dtype, TDP_DTYPE_INVALID);
        assert_null(l.data);
        assert_string_equal(l.value_json, want[i].json);
    }
    assert_int_equal(tdp_schema_num_tensors(s), 1);
    assert_int_equal(tdp_schema_num_leaves(s), 9);
    assert_int_equal(tdp_schema_total_bytes(s), TDP_LEAF_ALIGN);
    tdp_schema_unref(s);
}

static void test_empty_root(void **state)
{
    (void)state;
    tdp_schema *s = empty_schema();
    assert_int_equal(tdp_schema_total_bytes(s), 0);
    assert_int_equal(tdp_schema_num_leaves(s), 0);
    assert_int_equal(tdp_schema_num_tensors(s), 0);
    assert_int_equal(tdp_schema_num_nodes(s), 1);
    tdp_node_info n;
    OK(tdp_schema_node_at(s, 0, &n));
    assert_string_equal(n.path, "");
    assert_string_equal(n.cls, "TensorDict");
    assert_int_equal(n.depth, 0);
    assert_int_equal(n.batch_ndim, 0);
    assert_null(n.names);
    assert_true(n.has_device);
    assert_false(n.is_locked);
    tdp_leaf l;
    assert_int_equal(tdp_schema_leaf_at(s, 0, &l), TDP_EINVAL);
    tdp_schema_unref(s);
}

static void test_zero_sized_dims(void **state)
{
    (void)state;
    tdp_schema *s = zero_dims_schema();
    tdp_leaf l;
    OK(tdp_schema_find(s, "e0", &l));
    assert_int_equal(l.numel, 0);
    assert_int_equal(l.nbytes, 0);
    assert_int_equal(l.strides[0], 5);
    assert_int_equal(l.strides[1], 1);
    OK(tdp_schema_find(s, "e1", &l));
    assert_int_equal(l.numel, 0);
    assert_int_equal(l.nbytes, 0);
    /* PyTorch's contiguous strides of (3, 0, 2): (2, 2, 1) */
    assert_int_equal(l.strides[0], 2);
    assert_int_equal(l.strides[1], 2);
    assert_int_equal(l.strides[2], 1);
    /* declaration order is kept even where empty leaves share an offset */
    static const char *const order[] = {"e0", "full", "e1", "e2", "a_last"};
    for (uint32_t i = 0; i < N(order); i++) {
        OK(tdp_schema_leaf_at(s, i, &l));
        assert_string_equal(l.path, order[i]);
    }
    tdp_schema_unref(s);

    s = empty_first_schema();
    OK(tdp_schema_leaf_at(s, 0, &l));
    assert_string_equal(l.path, "b_empty");
    assert_int_equal(l.offset, 0);
    OK(tdp_schema_leaf_at(s, 1, &l));
    assert_string_equal(l.path, "a_full");
    assert_int_equal(l.offset, 0);
    assert_int_equal(tdp_schema_total_bytes(s), TDP_LEAF_ALIGN);
    tdp_schema_unref(s);

    /* a zero dim must not hide an int64 stride overflow */
    tdp_schema_builder *b;
    const int64_t huge[] = {0, (int64_t)1 << 40, (int64_t)1 << 40};
    char why[256];
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "h", TDP_FLOAT32, 3, huge));
    s = NULL;
    assert_int_equal(tdp_schema_builder_finish(b, &s, why, sizeof(why)), TDP_ESCHEMA);
    assert_null(s);
    assert_non_null(strstr(why, "'h'"));
    assert_non_null(strstr(why, "stride"));
    tdp_schema_builder_free(b);
}

static void test_batch_and_classes(void **state)
{
    (void)state;
    tdp_schema *s = batch_class_schema();
    tdp_node_info n;
    OK(tdp_schema_find_node(s, "", &n));
    assert_string_equal(n.cls, "MyData");
    assert_int_equal(n.batch_ndim, 2);
    assert_int_equal(n.batch_size[0], 4);
    assert_int_equal(n.batch_size[1], 2);
    assert_int_equal(n.num_children, 2);
    assert_int_equal(n.num_leaves, 2);
    OK(tdp_schema_find_node(s, "next", &n));
    assert_string_equal(n.cls, "Transition");
    assert_int_equal(n.depth, 1);
    assert_int_equal(n.num_leaves, 1);
    OK(tdp_schema_find_node(s, "stats", &n));
    assert_string_equal(n.cls, "TensorDict"); /* cls NULL keeps the default */
    assert_int_equal(n.batch_ndim, 2);

    /* cls NULL on an existing node keeps its class, a new cls replaces it */
    tdp_schema_builder *b;
    const int64_t bs[] = {5};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "n", "First", 0, NULL));
    OK(tdp_schema_builder_node(b, "n", NULL, 1, bs));
    OK(tdp_schema_builder_node(b, "m", "Old", 0, NULL));
    OK(tdp_schema_builder_node(b, "m", "New", 0, NULL));
    tdp_schema *t = finish(b);
    OK(tdp_schema_find_node(t, "n", &n));
    assert_string_equal(n.cls, "First");
    assert_int_equal(n.batch_ndim, 1);
    assert_int_equal(n.batch_size[0], 5);
    OK(tdp_schema_find_node(t, "m", &n));
    assert_string_equal(n.cls, "New");
    tdp_schema_unref(t);
    tdp_schema_unref(s);
}

/* ---- canonical bytes ----------------------------------------------------- */

static void test_build_twice_same_bytes(void **state)
{
    (void)state;
    for (uint32_t k = 0; k < N(all_schemas); k++) {
        tdp_schema *a = all_schemas[k](), *b = all_schemas[k]();
        size_t la, lb;
        const char *ja = tdp_schema_json(a, &la), *jb = tdp_schema_json(b, &lb);
        assert_ptr_not_equal(a, b);
        assert_int_equal(la, lb);
        assert_memory_equal(ja, jb, la);
        assert_int_equal(tdp_schema_hash(a), tdp_schema_hash(b));
        assert_true(tdp_schema_equal(a, b));
        tdp_schema_unref(a);
        tdp_schema_unref(b);
    }
}

static void test_finish_twice(void **state)
{
    (void)state;
    tdp_schema_builder *b;
    const int64_t sh[] = {4};
    tdp_schema *a = NULL, *c = NULL;
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "a", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_finish(b, &a, NULL, 0));
    OK(tdp_schema_builder_finish(b, &c, NULL, 0));
    assert_ptr_not_equal(a, c);
    assert_true(tdp_schema_equal(a, c));
    /* still usable: add a leaf and finish again */
    OK(tdp_schema_builder_tensor(b, "b", TDP_FLOAT32, 1, sh));
    tdp_schema *d = finish(b);
    assert_false(tdp_schema_equal(a, d));
    assert_int_equal(tdp_schema_num_leaves(d), 2);
    tdp_schema_unref(a);
    tdp_schema_unref(c);
    tdp_schema_unref(d);
}

/* Values and nodes are ordered by path, so declaring them in another order
 * gives the same schema; tensors are laid out in declaration order. */
static void test_declaration_order(void **state)
{
    (void)state;
    tdp_schema_builder *b;
    const int64_t sh[] = {2};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "p", "P", 0, NULL));
    OK(tdp_schema_builder_node(b, "q", "Q", 0, NULL));
    OK(tdp_schema_builder_tensor(b, "t", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_int(b, "v1", 1));
    OK(tdp_schema_builder_string(b, "v2", "two"));
    tdp_schema *x = finish(b);

    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_string(b, "v2", "two"));
    OK(tdp_schema_builder_node(b, "q", "Q", 0, NULL));
    OK(tdp_schema_builder_int(b, "v1", 1));
    OK(tdp_schema_builder_tensor(b, "t", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_node(b, "p", "P", 0, NULL));
    tdp_schema *y = finish(b);
    assert_true(tdp_schema_equal(x, y));
    tdp_schema_unref(x);
    tdp_schema_unref(y);
}

/* The flat schema, written by hand: keys out of order, whitespace, an alias
 * dtype name; decoding and re-encoding gives the canonical bytes. */
static void test_decode_reordered_whitespace(void **state)
{
    (void)state;
    static const char messy[] =
        "\n{ \"version\" : 1,\r\n  \"td\": {\n"
        "    \"non_tensors\": { },\n"
        "    \"leaves\": {\n"
        "      \"c\": [\"torch.bool\", [], 128, 192, 63],\n"
        "      \"b\": [\"long\", [2, 2], 64, 128, 32],\n"
        "      \"a\": [\"torch.float\", [ 3 ], 0, 64, 52]\n"
        "    },\n"
        "    \"cls_metadata\": {\"names\": null, \"is_locked\": false,\n"
        "                     \"device\": \"cpu\", \"batch_size\": []},\n"
        "    \"cls\": \"TensorDict\"\n"
        "  },\n"
        "  \"total_bytes\": 192,\t\"format\": \"tdpipe.schema\", \"device\": \"cpu\"\n"
        "}\n";
    tdp_schema *ref = flat_schema();
    tdp_schema *s = decode(messy);
    size_t la, lb;
    const char *ja = tdp_schema_json(ref, &la), *jb = tdp_schema_json(s, &lb);
    if (la != lb || memcmp(ja, jb, la) != 0)
        fail_msg("not canonical:\n%s\n%s", ja, jb);
    assert_true(tdp_schema_equal(ref, s));
    assert_int_equal(tdp_schema_hash(ref), tdp_schema_hash(s));
    tdp_schema_unref(s);
    tdp_schema_unref(ref);
}

/* ---- layout -------------------------------------------------------------- */

static void test_layout(void **state)
{
    (void)state;
    for (uint32_t k = 0; k < N(all_schemas); k++) {
        tdp_schema *s = all_schemas[k]();
        uint64_t total = tdp_schema_total_bytes(s), prev_end = 0, max_end = 0;
        uint32_t nt = tdp_schema_num_tensors(s);
        assert_int_equal(total % TDP_LEAF_ALIGN, 0);
        const char *prev_value = NULL;
        for (uint32_t i = 0; i < tdp_schema_num_leaves(s); i++) {
            tdp_leaf l;
            OK(tdp_schema_leaf_at(s, i, &l));
            if (i < nt) {
                assert_int_equal(l.kind, TDP_LEAF_TENSOR);
                assert_int_equal(l.offset % TDP_LEAF_ALIGN, 0);
                assert_int_equal(l.offset % tdp_dtype_align(l.dtype), 0);
                assert_true(l.offset >= prev_end); /* ascending, no overlap */
                assert_true(l.offset + l.nbytes <= total);
                uint64_t numel = 1;
                for (uint32_t d = 0; d < l.ndim; d++)
                    numel *= (uint64_t)l.shape[d];
                assert_int_equal(l.numel, numel);
                assert_int_equal(l.nbytes, numel * tdp_dtype_itemsize(l.dtype));
                /* C-contiguous strides */
                int64_t st = 1;
                for (uint32_t d = l.ndim; d-- > 0;) {
                    assert_int_equal(l.strides[d], st);
                    st *= l.shape[d] > 0 ? l.shape[d] : 1;
                }
                prev_end = l.offset + l.nbytes;
                if (prev_end > max_end)
                    max_end = prev_end;
            } else {
                /* then values, by path */
                assert_int_equal(l.kind, TDP_LEAF_VALUE);
                if (prev_value != NULL)
                    assert_true(strcmp(prev_value, l.path) < 0);
                prev_value = l.path;
            }
        }
        /* total is the end of the last leaf rounded up, nothing more */
        assert_int_equal(total, (max_end + TDP_LEAF_ALIGN - 1) / TDP_LEAF_ALIGN * TDP_LEAF_ALIGN);
        tdp_schema_unref(s);
    }
}

static void test_layout_exact_offsets(void **state)
{
    (void)state;
    tdp_schema *s = flat_schema();
    static const struct {
        const char *path;
        uint64_t offset, nbytes;
    } want[] = {{"a", 0, 12}, {"b", 64, 32}, {"c", 128, 1}};
    for (uint32_t i = 0; i < N(want); i++) {
        tdp_leaf l;
        OK(tdp_schema_leaf_at(s, i, &l));
        assert_string_equal(l.path, want[i].path);
        assert_int_equal(l.offset, want[i].offset);
        assert_int_equal(l.nbytes, want[i].nbytes);
    }
    assert_int_equal(tdp_schema_total_bytes(s), 192);
    tdp_schema_unref(s);
}

/* ---- hash ---------------------------------------------------------------- */

enum variant {
    V_BASE,
    V_RENAMED,
    V_DTYPE,
    V_SHAPE,
    V_ORDER,
    V_BATCH,
    V_CUDA0,
    V_CUDA1,
    V_ROOT_CLS,
    V_NODE_CLS,
    V_VALUE_INT,
    V_VALUE_STR,
    V_VALUE_REAL,
    V_ADD_LEAF,
    V_ADD_VALUE,
    V_REMOVE_LEAF,
    V_REMOVE_VALUE,
    V_NODE_BATCH,
    V_NESTED_KEY,
    V_COUNT
};

static tdp_schema *variant_schema(enum variant v)
{
    tdp_schema_builder *b;
    const int64_t bs[] = {2}, bs2[] = {2, 1}, obs[] = {2, 3}, obs2[] = {2, 4}, act[] = {2};
    OK(tdp_schema_builder_new(&b));
    if (v == V_CUDA0)
        OK(tdp_schema_builder_set_device(b, (tdp_device){TDP_DEVICE_CUDA, 0}));
    if (v == V_CUDA1)
        OK(tdp_schema_builder_set_device(b, (tdp_device){TDP_DEVICE_CUDA, 1}));
    if (v == V_BATCH) {
        /* batch [2, 1]: every batch-sized shape gains the dim */
        const int64_t o[] = {2, 1, 3}, a[] = {2, 1}, r[] = {2, 1, 1};
        OK(tdp_schema_builder_node(b, "", NULL, 2, bs2));
        OK(tdp_schema_builder_node(b, "next", "Step", 2, bs2));
        OK(tdp_schema_builder_tensor(b, "obs", TDP_FLOAT32, 3, o));
        OK(tdp_schema_builder_tensor(b, "act", TDP_INT64, 2, a));
        OK(tdp_schema_builder_tensor(b, "next.r", TDP_FLOAT32, 3, r));
        OK(tdp_schema_builder_value(b, "v", "true"));
        return finish(b);
    }
    OK(tdp_schema_builder_node(b, "", v == V_ROOT_CLS ? "Root" : NULL, 1, bs));
    OK(tdp_schema_builder_node(b, "next", v == V_NODE_CLS ? "Step2" : "Step",
                               v == V_NODE_BATCH ? 2 : 1, v == V_NODE_BATCH ? bs2 : bs));
    const char *obs_name = v == V_RENAMED ? "observation" : "obs";
    tdp_dtype obs_dt = v == V_DTYPE ? TDP_FLOAT64 : TDP_FLOAT32;
    const int64_t *obs_sh = v == V_SHAPE ? obs2 : obs;
    const int64_t r[] = {2, 1, 1}, r1[] = {2, 1};
    if (v == V_ORDER) {
        OK(tdp_schema_builder_tensor(b, "act", TDP_INT64, 1, act));
        OK(tdp_schema_builder_tensor(b, obs_name, obs_dt, 2, obs_sh));
    } else {
        OK(tdp_schema_builder_tensor(b, obs_name, obs_dt, 2, obs_sh));
        if (v != V_REMOVE_LEAF)
            OK(tdp_schema_builder_tensor(b, "act", TDP_INT64, 1, act));
    }
    if (v == V_NODE_BATCH)
        OK(tdp_schema_builder_tensor(b, "next.r", TDP_FLOAT32, 3, r));
    else
        OK(tdp_schema_builder_tensor(b, v == V_NESTED_KEY ? "next.reward" : "next.r", TDP_FLOAT32,
                                     2, r1));
    if (v == V_ADD_LEAF)
        OK(tdp_schema_builder_tensor(b, "extra", TDP_UINT8, 1, act));
    if (v == V_ADD_VALUE)
        OK(tdp_schema_builder_value(b, "next.extra", "null"));
    switch (v) {
    case V_VALUE_INT:
        OK(tdp_schema_builder_int(b, "v", 1));
        break;
    case V_VALUE_STR:
        OK(tdp_schema_builder_string(b, "v", "1"));
        break;
    case V_VALUE_REAL:
        OK(tdp_schema_builder_value(b, "v", "1.0"));
        break;
    case V_REMOVE_VALUE:
        break;
    default:
        OK(tdp_schema_builder_value(b, "v", "true"));
    }
    return finish(b);
}

static void test_hash_changes_on_every_change(void **state)
{
    (void)state;
    tdp_schema *s[V_COUNT];
    for (int v = 0; v < V_COUNT; v++)
        s[v] = variant_schema((enum variant)v);
    for (int i = 0; i < V_COUNT; i++) {
        for (int j = i + 1; j < V_COUNT; j++) {
            if (tdp_schema_hash(s[i]) == tdp_schema_hash(s[j]) || tdp_schema_equal(s[i], s[j]))
                fail_msg("variants %d and %d hash alike:\n%s\n%s", i, j,
                         tdp_schema_json(s[i], NULL), tdp_schema_json(s[j], NULL));
        }
    }
    /* rebuilt identically: the same hash */
    for (int v = 0; v < V_COUNT; v++) {
        tdp_schema *again = variant_schema((enum variant)v);
        assert_int_equal(tdp_schema_hash(again), tdp_schema_hash(s[v]));
        assert_true(tdp_schema_equal(again, s[v]));
        tdp_schema_unref(again);
    }
    /* the reorder variant really moved the offsets */
    tdp_leaf a, b;
    OK(tdp_schema_find(s[V_BASE], "act", &a));
    OK(tdp_schema_find(s[V_ORDER], "act", &b));
    assert_int_not_equal(a.offset, b.offset);
    for (int v = 0; v < V_COUNT; v++)
        tdp_schema_unref(s[v]);
}

/* Built in a freshly exec'd process: the same hash (nothing per-process). */
static void test_hash_stable_across_processes(void **state)
{
    (void)state;
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        if (dup2(fds[1], STDOUT_FILENO) < 0)
            _exit(126);
        char *const argv[] = {(char *)"test_schema", (char *)"--print-hash", NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(fds[1]);
    char buf[64] = {0};
    size_t got = 0;
    ssize_t n;
    while (got < sizeof(buf) - 1 && (n = read(fds[0], buf + got, sizeof(buf) - 1 - got)) > 0)
        got += (size_t)n;
    close(fds[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);

    tdp_schema *s = nested_schema();
    char mine[64];
    snprintf(mine, sizeof(mine), "%016" PRIx64 "\n", tdp_schema_hash(s));
    assert_string_equal(buf, mine);
    tdp_schema_unref(s);

    /* and a plain forked child agrees too */
    assert_int_equal(pipe(fds), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        tdp_schema_builder *b;
        const int64_t sh[] = {5, 5};
        uint64_t h = 0;
        if (tdp_schema_builder_new(&b) == TDP_OK &&
            tdp_schema_builder_tensor(b, "k.m", TDP_COMPLEX64, 2, sh) == TDP_OK) {
            tdp_schema *c = NULL;
            if (tdp_schema_builder_finish(b, &c, NULL, 0) == TDP_OK)
                h = tdp_schema_hash(c);
            tdp_schema_unref(c);
        }
        tdp_schema_builder_free(b);
        _exit(write(fds[1], &h, sizeof(h)) == (ssize_t)sizeof(h) ? 0 : 1);
    }
    close(fds[1]);
    uint64_t child_hash = 0;
    assert_int_equal(read(fds[0], &child_hash, sizeof(child_hash)), sizeof(child_hash));
    close(fds[0]);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    tdp_schema_builder *b;
    const int64_t sh[] = {5, 5};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "k.m", TDP_COMPLEX64, 2, sh));
    s = finish(b);
    assert_int_not_equal(child_hash, 0);
    assert_int_equal(child_hash, tdp_schema_hash(s));
    tdp_schema_unref(s);
}

/* ---- device -------------------------------------------------------------- */

static void test_with_device(void **state)
{
    (void)state;
    tdp_schema *cpu = nested_schema(), *c1 = NULL, *back = NULL, *c1b = NULL;
    const tdp_device cuda1 = {TDP_DEVICE_CUDA, 1};

    OK(tdp_schema_with_device(cpu, cuda1, &c1));
    assert_true(tdp_device_equal(tdp_schema_device(c1), cuda1));
    assert_false(tdp_schema_equal(cpu, c1));
    assert_int_not_equal(tdp_schema_hash(cpu), tdp_schema_hash(c1));
    assert_int_equal(tdp_schema_total_bytes(cpu), tdp_schema_total_bytes(c1));
    for (uint32_t i = 0; i < tdp_schema_num_nodes(c1); i++) {
        tdp_node_info n;
        OK(tdp_schema_node_at(c1, i, &n));
        assert_true(n.has_device);
        assert_true(tdp_device_equal(n.device, cuda1));
    }
    const char *j = tdp_schema_json(c1, NULL);
    assert_non_null(strstr(j, "\"device\":\"cuda:1\""));
    assert_null(strstr(j, "\"cpu\""));
    assert_int_equal(tdp_schema_hash(c1), XXH3_64bits(j, strlen(j)));

    /* the same as building it on cuda:1 from the start */
    tdp_schema *built = variant_schema(V_CUDA1), *base = variant_schema(V_BASE);
    OK(tdp_schema_with_device(base, cuda1, &c1b));
    assert_true(tdp_schema_equal(built, c1b));
    assert_int_equal(tdp_schema_hash(built), tdp_schema_hash(c1b));

    /* and back */
    OK(tdp_schema_with_device(c1, TDP_DEVICE_CPU_INIT, &back));
    assert_true(tdp_schema_equal(cpu, back));
    assert_int_equal(tdp_schema_hash(cpu), tdp_schema_hash(back));
    assert_same_views(cpu, back);

    tdp_schema *out = (tdp_schema *)&out;
    assert_int_equal(tdp_schema_with_device(NULL, cuda1, &out), TDP_EINVAL);
    assert_int_equal(tdp_schema_with_device(cpu, cuda1, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_with_device(cpu, (tdp_device){(tdp_device_type)5, 0}, &out),
                     TDP_EINVAL);
    assert_ptr_equal(out, (tdp_schema *)&out);

    tdp_schema_unref(built);
    tdp_schema_unref(base);
    tdp_schema_unref(c1b);
    tdp_schema_unref(back);
    tdp_schema_unref(c1);
    tdp_schema_unref(cpu);
}

/* Nodes whose device differs from the buffer's (or is unset) keep it. */
static void test_with_device_keeps_other_nodes(void **state)
{
    (void)state;
    static const char json[] =
        "{\"device\":\"cpu\",\"format\":\"tdpipe.schema\",\"total_bytes\":0,\"version\":1,"
        "\"td\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"device\":\"cpu\"},"
        "\"leaves\":{},\"non_tensors\":{},"
        "\"a\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"device\":null}},"
        "\"b\":{\"cls\":\"TensorDict\",\"cls_metadata\":{\"batch_size\":[],\"device\":\"cuda:2\"}}"
        "}}";
    tdp_schema *s = decode(json), *c = NULL;
    OK(tdp_schema_with_device(s, (tdp_device){TDP_DEVICE_CUDA, 0}, &c));
    tdp_node_info n;
    OK(tdp_schema_find_node(c, "", &n));
    assert_true(n.has_device);
    assert_true(tdp_device_equal(n.device, (tdp_device){TDP_DEVICE_CUDA, 0}));
    OK(tdp_schema_find_node(c, "a", &n));
    assert_false(n.has_device);
    OK(tdp_schema_find_node(c, "b", &n));
    assert_true(n.has_device);
    assert_true(tdp_device_equal(n.device, (tdp_device){TDP_DEVICE_CUDA, 2}));
    tdp_schema_unref(c);
    tdp_schema_unref(s);
}

/* ---- queries ------------------------------------------------------------- */

static void test_find_and_nodes(void **state)
{
    (void)state;
    tdp_schema_builder *b;
    const int64_t sh[] = {2};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "b.t", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_tensor(b, "a-b.t", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_tensor(b, "a.c.t", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_node(b, "a", "A", 0, NULL));
    OK(tdp_schema_builder_string(b, "a.v", "x"));
    OK(tdp_schema_builder_tensor(b, "root_t", TDP_INT32, 1, sh));
    tdp_schema *s = finish(b);

    /* pre-order, siblings by key: "a.c" (inside a) comes before "a-b" */
    static const struct {
        const char *path;
        uint32_t depth, children, leaves;
    } pre[] = {{"", 0, 3, 1}, {"a", 1, 1, 1}, {"a.c", 2, 0, 1}, {"a-b", 1, 0, 1}, {"b", 1, 0, 1}};
    assert_int_equal(tdp_schema_num_nodes(s), N(pre));
    for (uint32_t i = 0; i < N(pre); i++) {
        tdp_node_info n, m;
        OK(tdp_schema_node_at(s, i, &n));
        assert_string_equal(n.path, pre[i].path);
        assert_int_equal(n.depth, pre[i].depth);
        assert_int_equal(n.num_children, pre[i].children);
        assert_int_equal(n.num_leaves, pre[i].leaves);
        OK(tdp_schema_find_node(s, pre[i].path, &m));
        assert_ptr_equal(m.path, n.path);
    }
    tdp_node_info n;
    OK(tdp_schema_find_node(s, "a", &n));
    assert_string_equal(n.cls, "A");
    assert_int_equal(tdp_schema_node_at(s, N(pre), &n), TDP_EINVAL);
    assert_int_equal(tdp_schema_find_node(s, "a.c.t", &n), TDP_ENOENT); /* a leaf */
    assert_int_equal(tdp_schema_find_node(s, "zz", &n), TDP_ENOENT);
    assert_int_equal(tdp_schema_find_node(s, NULL, &n), TDP_EINVAL);
    assert_int_equal(tdp_schema_find_node(s, "", NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_node_at(NULL, 0, &n), TDP_EINVAL);

    /* leaves: tensors in declaration order, then values */
    static const char *const order[] = {"b.t", "a-b.t", "a.c.t", "root_t", "a.v"};
    assert_int_equal(tdp_schema_num_leaves(s), N(order));
    assert_int_equal(tdp_schema_num_tensors(s), 4);
    for (uint32_t i = 0; i < N(order); i++) {
        tdp_leaf l, f;
        OK(tdp_schema_leaf_at(s, i, &l));
        assert_string_equal(l.path, order[i]);
        OK(tdp_schema_find(s, order[i], &f));
        assert_ptr_equal(f.path, l.path);
        assert_int_equal(f.offset, l.offset);
        const char *dot = strrchr(order[i], '.');
        assert_string_equal(l.key, dot ? dot + 1 : order[i]);
    }
    tdp_leaf l;
    assert_int_equal(tdp_schema_leaf_at(s, N(order), &l), TDP_EINVAL);
    assert_int_equal(tdp_schema_leaf_at(s, 0, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_find(s, "a", &l), TDP_ENOENT); /* a node */
    assert_int_equal(tdp_schema_find(s, "a.c", &l), TDP_ENOENT);
    assert_int_equal(tdp_schema_find(s, "nope", &l), TDP_ENOENT);
    assert_int_equal(tdp_schema_find(s, "", &l), TDP_ENOENT);
    assert_int_equal(tdp_schema_find(s, "A.V", &l), TDP_ENOENT); /* case matters */
    assert_int_equal(tdp_schema_find(s, NULL, &l), TDP_EINVAL);
    assert_int_equal(tdp_schema_find(NULL, "a.v", &l), TDP_EINVAL);

    /* NULL schemas are harmless in the queries */
    assert_int_equal(tdp_schema_num_leaves(NULL), 0);
    assert_int_equal(tdp_schema_num_nodes(NULL), 0);
    assert_int_equal(tdp_schema_hash(NULL), 0);
    assert_null(tdp_schema_json(NULL, NULL));
    assert_false(tdp_schema_equal(s, NULL));
    assert_true(tdp_schema_equal(s, s));
    tdp_schema_unref(s);
}

static void test_refcount(void **state)
{
    (void)state;
    tdp_schema *s = flat_schema();
    assert_ptr_equal(tdp_schema_ref(s), s);
    assert_ptr_equal(tdp_schema_ref(s), s);
    tdp_schema_unref(s);
    tdp_schema_unref(s);
    assert_int_equal(tdp_schema_num_leaves(s), 3); /* one reference left */
    tdp_schema_unref(s);
    tdp_schema_unref(NULL);
    assert_null(tdp_schema_ref(NULL));
}

/* ---- builder errors ------------------------------------------------------- */

static void test_builder_errors(void **state)
{
    (void)state;
    tdp_schema_builder *b;
    const int64_t sh[] = {2}, neg[] = {2, -1};
    char long_key[300];

    assert_int_equal(tdp_schema_builder_new(NULL), TDP_EINVAL);
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "a", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_node(b, "n", NULL, 0, NULL));
    OK(tdp_schema_builder_int(b, "v", 3));

    /* duplicate path */
    assert_int_equal(tdp_schema_builder_tensor(b, "a", TDP_FLOAT32, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_int(b, "a", 1), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_int(b, "v", 1), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, "v", TDP_FLOAT32, 1, sh), TDP_EINVAL);
    /* leaf where a node exists */
    assert_int_equal(tdp_schema_builder_tensor(b, "n", TDP_FLOAT32, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_string(b, "n", "x"), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, "", TDP_FLOAT32, 1, sh), TDP_EINVAL);
    /* node where a leaf exists, itself or on the way */
    assert_int_equal(tdp_schema_builder_node(b, "a", NULL, 0, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_node(b, "a.sub", NULL, 0, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, "a.x", TDP_FLOAT32, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_node(b, "v", NULL, 0, NULL), TDP_EINVAL);
    /* empty keys */
    static const char *const bad_paths[] = {"a..b", ".a", "a.", ".", "x..", "p.\x01q", "t\x7f"};
    for (uint32_t i = 0; i < N(bad_paths); i++) {
        assert_int_equal(tdp_schema_builder_tensor(b, bad_paths[i], TDP_FLOAT32, 1, sh),
                         TDP_EINVAL);
        assert_int_equal(tdp_schema_builder_node(b, bad_paths[i], NULL, 0, NULL), TDP_EINVAL);
        assert_int_equal(tdp_schema_builder_int(b, bad_paths[i], 1), TDP_EINVAL);
    }
    /* key length: 255 is fine, 256 is not */
    memset(long_key, 'k', 256);
    long_key[256] = '\0';
    assert_int_equal(tdp_schema_builder_tensor(b, long_key, TDP_FLOAT32, 1, sh), TDP_EINVAL);
    long_key[255] = '\0';
    OK(tdp_schema_builder_tensor(b, long_key, TDP_FLOAT32, 1, sh));
    /* dtypes and shapes */
    assert_int_equal(tdp_schema_builder_tensor(b, "d0", TDP_DTYPE_INVALID, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, "d1", TDP_DTYPE_COUNT, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, "d2", (tdp_dtype)-3, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, "neg", TDP_FLOAT32, 2, neg), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, "nul", TDP_FLOAT32, 1, NULL), TDP_EINVAL);
    int64_t rank[TDP_MAX_RANK + 1];
    for (int i = 0; i <= TDP_MAX_RANK; i++)
        rank[i] = 1;
    assert_int_equal(tdp_schema_builder_tensor(b, "r", TDP_FLOAT32, TDP_MAX_RANK + 1, rank),
                     TDP_EINVAL);
    /* NULL arguments */
    assert_int_equal(tdp_schema_builder_tensor(NULL, "x", TDP_FLOAT32, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_tensor(b, NULL, TDP_FLOAT32, 1, sh), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_node(NULL, "x", NULL, 0, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_node(b, NULL, NULL, 0, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_node(b, "x", NULL, 1, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_node(b, "x", "", 0, NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_node(b, "x", NULL, TDP_MAX_RANK + 1, rank), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_value(NULL, "x", "1"), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_value(b, NULL, "1"), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_value(b, "x", NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_string(b, "x", NULL), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_string(NULL, "x", "s"), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_int(NULL, "x", 1), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_set_device(NULL, TDP_DEVICE_CPU_INIT), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_set_device(b, (tdp_device){TDP_DEVICE_CUDA, -1}),
                     TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_set_device(b, (tdp_device){(tdp_device_type)9, 0}),
                     TDP_EINVAL);
    /* values must be one JSON scalar */
    static const char *const bad_values[] = {
        "[1]", "{}", "{\"a\":1}", "", "nope", "1 2", "\"unterminated", "1e999", "NaN"};
    for (uint32_t i = 0; i < N(bad_values); i++)
        if (tdp_schema_builder_value(b, "x", bad_values[i]) != TDP_EINVAL)
            fail_msg("value '%s' accepted", bad_values[i]);
    assert_int_equal(tdp_schema_builder_string(b, "x", "bad utf-8 \xff"), TDP_EINVAL);
    tdp_schema *out = (tdp_schema *)&out;
    assert_int_equal(tdp_schema_builder_finish(NULL, &out, NULL, 0), TDP_EINVAL);
    assert_int_equal(tdp_schema_builder_finish(b, NULL, NULL, 0), TDP_EINVAL);
    assert_ptr_equal(out, (tdp_schema *)&out);

    /* none of the failures left anything behind */
    tdp_schema *s = finish(b);
    assert_int_equal(tdp_schema_num_leaves(s), 3);
    assert_int_equal(tdp_schema_num_nodes(s), 2);
    tdp_leaf l;
    OK(tdp_schema_find(s, long_key, &l));
    assert_int_equal(tdp_schema_find(s, "x", &l), TDP_ENOENT);
    tdp_schema_unref(s);
    tdp_schema_builder_free(NULL);
}

static void expect_finish_fails(tdp_schema_builder *b, tdp_err want, const char *needle1,
                                const char *needle2)
{
    tdp_schema *s = (tdp_schema *)&s;
    char why[256] = "junk";
    tdp_err rc = tdp_schema_builder_finish(b, &s, why, sizeof(why));
    if (rc != want)
        fail_msg("finish gave %s, want %s (%s)", tdp_errname(rc), tdp_errname(want), why);
    assert_ptr_equal(s, (tdp_schema *)&s);
    if (needle1 != NULL && strstr(why, needle1) == NULL)
        fail_msg("'%s' not in '%s'", needle1, why);
    if (needle2 != NULL && strstr(why, needle2) == NULL)
        fail_msg("'%s' not in '%s'", needle2, why);
    tdp_schema_builder_free(b);
}

static void test_reserved_node_names(void **state)
{
    (void)state;
    static const char *const paths[] = {"cls",         "cls_metadata", "leaves",
                                        "non_tensors", "ok.leaves",    "ok.deeper.cls"};
    for (uint32_t i = 0; i < N(paths); i++) {
        tdp_schema_builder *b;
        OK(tdp_schema_builder_new(&b));
        OK(tdp_schema_builder_node(b, paths[i], NULL, 0, NULL));
        char quoted[64];
        snprintf(quoted, sizeof(quoted), "'%s'", paths[i]);
        expect_finish_fails(b, TDP_ESCHEMA, quoted, "reserved");
    }
    /* reserved only as a sub-dict: a leaf may be called "cls" or "leaves" */
    tdp_schema_builder *b;
    const int64_t sh[] = {1};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "cls", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_tensor(b, "sub.leaves", TDP_FLOAT32, 1, sh));
    OK(tdp_schema_builder_string(b, "non_tensors", "fine"));
    OK(tdp_schema_builder_int(b, "sub.cls_metadata", 1));
    tdp_schema *s = finish(b);
    size_t len;
    const char *json = tdp_schema_json(s, &len);
    tdp_schema *back = NULL;
    OK(tdp_schema_decode(json, len, NULL, &back, NULL, 0));
    assert_true(tdp_schema_equal(s, back));
    assert_same_views(s, back);
    tdp_schema_unref(back);
    tdp_schema_unref(s);
}

static void test_batch_size_rules(void **state)
{
    (void)state;
    tdp_schema_builder *b;
    const int64_t bs[] = {4}, bad[] = {3, 2}, good[] = {4, 2}, bs2[] = {5};

    /* leaf shape must start with its node's batch_size */
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    OK(tdp_schema_builder_tensor(b, "ok", TDP_FLOAT32, 2, good));
    OK(tdp_schema_builder_tensor(b, "bad", TDP_FLOAT32, 2, bad));
    expect_finish_fails(b, TDP_ESCHEMA, "leaf 'bad': shape [3, 2]",
                        "the batch_size [4] of node '<root>'");

    /* the node whose batch_size applies is named, with its value */
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    OK(tdp_schema_builder_node(b, "meta", NULL, 2, good));
    OK(tdp_schema_builder_tensor(b, "meta.step", TDP_INT64, 1, bs));
    expect_finish_fails(b, TDP_ESCHEMA, "leaf 'meta.step': shape [4]",
                        "the batch_size [4, 2] of node 'meta'");

    /* long batch sizes are cut short, not the message */
    {
        const int64_t big[8] = {1000000000000, 1000000000000, 1000000000000, 1000000000000,
                                1000000000000, 1000000000000, 1000000000000, 0};
        OK(tdp_schema_builder_new(&b));
        OK(tdp_schema_builder_node(b, "", NULL, 8, big));
        OK(tdp_schema_builder_tensor(b, "x", TDP_FLOAT32, 1, bs));
        expect_finish_fails(b, TDP_ESCHEMA, "[1000000000000, 1000000000000, ",
                            ", ...] of node '<root>'");
    }

    /* a scalar leaf under a batched node */
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    OK(tdp_schema_builder_tensor(b, "scalar", TDP_FLOAT32, 0, NULL));
    expect_finish_fails(b, TDP_ESCHEMA, "'scalar'", "batch_size");

    /* a sub-node's batch_size must start with its parent's */
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    OK(tdp_schema_builder_node(b, "child", NULL, 1, bs2));
    expect_finish_fails(b, TDP_ESCHEMA, "node 'child': batch_size [5]",
                        "the batch_size [4] of its parent '<root>'");

    /* an implicitly created parent inherits its parent's batch_size */
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    OK(tdp_schema_builder_tensor(b, "auto.deeper.x", TDP_FLOAT32, 2, good));
    {
        tdp_schema *si = finish(b);
        tdp_node_info ni;
        OK(tdp_schema_find_node(si, "auto.deeper", &ni));
        assert_int_equal(ni.batch_ndim, 1);
        assert_int_equal(ni.batch_size[0], 4);
        tdp_schema_unref(si);
    }
    /* ... as it is when the parent is created: a later root change breaks it */
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "auto.x", TDP_FLOAT32, 2, good));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    expect_finish_fails(b, TDP_ESCHEMA, "'auto'", "batch_size");

    /* node batch_size may be longer than the parent's */
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_node(b, "", NULL, 1, bs));
    OK(tdp_schema_builder_node(b, "child", NULL, 2, good));
    OK(tdp_schema_builder_tensor(b, "child.x", TDP_FLOAT32, 2, good));
    tdp_schema *s = finish(b);
    tdp_schema_unref(s);

    /* byte size overflow is caught when laying out */
    const int64_t huge[] = {(int64_t)1 << 62, 8};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "huge", TDP_FLOAT64, 2, huge));
    expect_finish_fails(b, TDP_ESCHEMA, "'huge'", "overflow");

    /* over the default 64 GiB buffer limit */
    const int64_t big[] = {(int64_t)1 << 34};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_tensor(b, "big", TDP_FLOAT64, 1, big));
    expect_finish_fails(b, TDP_EMSGSIZE, "total_bytes", "limit");
}

/* ---- print --------------------------------------------------------------- */

static void test_print(void **state)
{
    (void)state;
    tdp_schema *s = batch_class_schema();
    FILE *f = tmpfile();
    assert_non_null(f);
    OK(tdp_schema_print(s, f));
    char text[4096] = {0};
    rewind(f);
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = '\0';
    static const char *const needles[] = {"MyData",
                                          "Transition",
                                          "next:",
                                          "stats:",
                                          "obs:",
                                          "action:",
                                          "mean:",
                                          "torch.uint8",
                                          "torch.bfloat16",
                                          "[4, 2, 84, 84]",
                                          "batch_size=[4, 2]",
                                          "on cpu"};
    for (uint32_t i = 0; i < N(needles); i++)
        if (strstr(text, needles[i]) == NULL)
            fail_msg("'%s' missing from:\n%s", needles[i], text);
    char hash[32];
    snprintf(hash, sizeof(hash), "%016" PRIx64, tdp_schema_hash(s));
    assert_non_null(strstr(text, hash));
    /* nested entries are indented under their node */
    assert_non_null(strstr(text, "\n  next: (Transition)"));
    assert_non_null(strstr(text, "\n    obs: torch.uint8"));
    assert_int_equal(tdp_schema_print(NULL, stdout), TDP_EINVAL);
    assert_int_equal(tdp_schema_print(s, NULL), TDP_EINVAL);
    tdp_schema_unref(s);
}

static void test_limits_default(void **state)
{
    (void)state;
    tdp_schema_limits l;
    memset(&l, 0xee, sizeof(l));
    tdp_schema_limits_default(&l);
    assert_int_equal(l.size, sizeof(l));
    assert_int_equal(l.max_json_bytes, TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES);
    assert_int_equal(l.max_depth, TDP_SCHEMA_DEFAULT_MAX_DEPTH);
    assert_int_equal(l.max_keys, TDP_SCHEMA_DEFAULT_MAX_KEYS);
    assert_int_equal(l.max_key_len, TDP_SCHEMA_DEFAULT_MAX_KEY_LEN);
    assert_int_equal(l.max_rank, TDP_SCHEMA_DEFAULT_MAX_RANK);
    assert_int_equal(l.max_value_bytes, TDP_SCHEMA_DEFAULT_MAX_VALUE_BYTES);
    assert_int_equal(l.max_total_bytes, TDP_SCHEMA_DEFAULT_MAX_TOTAL_BYTES);
    tdp_schema_limits_default(NULL);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--print-hash") == 0) {
        tdp_schema_builder *b;
        const int64_t bs[] = {2, 3}, sh[] = {2, 3, 4}, sh2[] = {2, 3, 5, 5};
        tdp_schema *s = NULL;
        /* nested_schema(), without cmocka */
        if (tdp_schema_builder_new(&b) != TDP_OK ||
            tdp_schema_builder_node(b, "", "Root", 1, bs) != TDP_OK ||
            tdp_schema_builder_node(b, "x", "X", 2, bs) != TDP_OK ||
            tdp_schema_builder_node(b, "x.y", NULL, 2, bs) != TDP_OK ||
            tdp_schema_builder_node(b, "x.y.z", "Leafy", 2, bs) != TDP_OK ||
            tdp_schema_builder_tensor(b, "x.y.z.w", TDP_FLOAT64, 3, sh) != TDP_OK ||
            tdp_schema_builder_tensor(b, "x.y.v", TDP_UINT8, 4, sh2) != TDP_OK ||
            tdp_schema_builder_tensor(b, "top", TDP_FLOAT16, 1, bs) != TDP_OK ||
            tdp_schema_builder_string(b, "x.y.z.label", "deep") != TDP_OK ||
            tdp_schema_builder_finish(b, &s, NULL, 0) != TDP_OK)
            return 1;
        printf("%016" PRIx64 "\n", tdp_schema_hash(s));
        tdp_schema_unref(s);
        tdp_schema_builder_free(b);
        return 0;
    }

    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_golden_canonical_json),
        cmocka_unit_test(test_values_canonical),
        cmocka_unit_test(test_empty_root),
        cmocka_unit_test(test_zero_sized_dims),
        cmocka_unit_test(test_batch_and_classes),
        cmocka_unit_test(test_build_twice_same_bytes),
        cmocka_unit_test(test_finish_twice),
        cmocka_unit_test(test_declaration_order),
        cmocka_unit_test(test_decode_reordered_whitespace),
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_layout_exact_offsets),
        cmocka_unit_test(test_hash_changes_on_every_change),
        cmocka_unit_test(test_hash_stable_across_processes),
        cmocka_unit_test(test_with_device),
        cmocka_unit_test(test_with_device_keeps_other_nodes),
        cmocka_unit_test(test_find_and_nodes),
        cmocka_unit_test(test_refcount),
        cmocka_unit_test(test_builder_errors),
        cmocka_unit_test(test_reserved_node_names),
        cmocka_unit_test(test_batch_size_rules),
        cmocka_unit_test(test_print),
        cmocka_unit_test(test_limits_default),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
