/* test_td: the consolidated tensordict — buffers, views, wrapping, DLPack export. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlpack/dlpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tdpipe/mem.h>
#include <tdpipe/td.h>

#include "core/cuda.h"

#define N(a)     (uint32_t)(sizeof(a) / sizeof((a)[0]))
#define OK(call) assert_int_equal((call), TDP_OK)

static tdp_schema *finish(tdp_schema_builder *b)
{
    tdp_schema *s = NULL;
    char why[256];
    tdp_err rc = tdp_schema_builder_finish(b, &s, why, sizeof(why));
    if (rc != TDP_OK)
        fail_msg("finish: %s: %s", tdp_errname(rc), why);
    tdp_schema_builder_free(b);
    return s;
}

/* Every DLPack-relevant dtype, a scalar, an empty leaf, a value and a float8. */
static tdp_schema *mixed_schema(tdp_device dev)
{
    tdp_schema_builder *b;
    const int64_t s23[] = {2, 3}, s4[] = {4}, s22[] = {2, 2}, s3[] = {3}, s2[] = {2},
                  s234[] = {2, 3, 4}, s0[] = {0, 3};
    OK(tdp_schema_builder_new(&b));
    OK(tdp_schema_builder_set_device(b, dev));
    OK(tdp_schema_builder_tensor(b, "f32", TDP_FLOAT32, 2, s23));
    OK(tdp_schema_builder_tensor(b, "i64", TDP_INT64, 1, s4));
    OK(tdp_schema_builder_tensor(b, "flag", TDP_BOOL, 2, s22));
    OK(tdp_schema_builder_tensor(b, "bf16", TDP_BFLOAT16, 1, s3));
    OK(tdp_schema_builder_tensor(b, "c64", TDP_COMPLEX64, 1, s2));
    OK(tdp_schema_builder_tensor(b, "c128", TDP_COMPLEX128, 1, s2));
    OK(tdp_schema_builder_tensor(b, "nested.u8", TDP_UINT8, 3, s234));
    OK(tdp_schema_builder_tensor(b, "nested.deeper.f16", TDP_FLOAT16, 1, s3));
    OK(tdp_schema_builder_tensor(b, "i8", TDP_INT8, 1, s2));
    OK(tdp_schema_builder_tensor(b, "u16", TDP_UINT16, 1, s2));
    OK(tdp_schema_builder_tensor(b, "f64", TDP_FLOAT64, 1, s2));
    OK(tdp_schema_builder_tensor(b, "scalar", TDP_FLOAT32, 0, NULL));
    OK(tdp_schema_builder_tensor(b, "empty", TDP_INT32, 2, s0));
    OK(tdp_schema_builder_tensor(b, "f8", TDP_FLOAT8_E4M3FN, 1, s4));
    OK(tdp_schema_builder_tensor(b, "f8b", TDP_FLOAT8_E5M2, 1, s4));
    OK(tdp_schema_builder_string(b, "name", "episode-1"));
    return finish(b);
}

static tdp_schema *cpu_schema(void)
{
    return mixed_schema(TDP_DEVICE_CPU_INIT);
}

typedef struct live {
    uint64_t host_bytes, host_live_allocs, small_live;
} live;

static live live_now(void)
{
    tdp_mem_stats st;
    tdp_mem_stats_get(&st);
    return (live){st.live_bytes[TDP_MEM_HOST], st.allocs[TDP_MEM_HOST] - st.frees[TDP_MEM_HOST],
                  st.small_allocs - st.small_frees};
}

static void assert_live_equal(live a, live b)
{
    assert_int_equal(a.host_bytes, b.host_bytes);
    assert_int_equal(a.host_live_allocs, b.host_live_allocs);
    assert_int_equal(a.small_live, b.small_live);
}

/* ---- owned buffers ------------------------------------------------------------ */

static void test_new_cpu(void **state)
{
    (void)state;
    live l0 = live_now();
    tdp_schema *s = cpu_schema();
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    assert_non_null(td);
    assert_non_null(tdp_td_data(td));
    assert_int_equal((uintptr_t)tdp_td_data(td) % TDP_BUFFER_ALIGN, 0);
    assert_int_equal(tdp_td_nbytes(td), tdp_schema_total_bytes(s));
    assert_true(tdp_device_equal(tdp_td_device(td), TDP_DEVICE_CPU_INIT));
    assert_ptr_equal(tdp_td_schema(td), s);
    assert_int_equal(tdp_td_num_leaves(td), tdp_schema_num_leaves(s));
    live l1 = live_now();
    assert_int_equal(l1.host_bytes - l0.host_bytes, tdp_schema_total_bytes(s));
    assert_int_equal(l1.host_live_allocs - l0.host_live_allocs, 1);
    memset(tdp_td_data(td), 0x11, tdp_td_nbytes(td)); /* the whole buffer is ours */

    /* the td holds its own reference on the schema */
    tdp_schema_unref(s);
    assert_int_equal(tdp_schema_num_leaves(tdp_td_schema(td)), 16);
    tdp_td_unref(td);
    assert_live_equal(live_now(), l0);
}

static void test_empty_td(void **state)
{
    (void)state;
    tdp_schema_builder *b;
    OK(tdp_schema_builder_new(&b));
    tdp_schema *s = finish(b);
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    assert_non_null(tdp_td_data(td));
    assert_int_equal(tdp_td_nbytes(td), 0);
    assert_int_equal(tdp_td_num_leaves(td), 0);
    tdp_leaf l;
    assert_int_equal(tdp_td_leaf_at(td, 0, &l), TDP_EINVAL);
    tdp_td_unref(td);

    /* an empty schema can wrap no buffer at all */
    OK(tdp_td_wrap(s, NULL, 0, TDP_DEVICE_CPU_INIT, NULL, NULL, &td));
    assert_null(tdp_td_data(td));
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_leaf_views(void **state)
{
    (void)state;
    tdp_schema *s = cpu_schema();
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    char *base = tdp_td_data(td);
    uint32_t tensors = 0;
    for (uint32_t i = 0; i < tdp_td_num_leaves(td); i++) {
        tdp_leaf v, sv, g;
        OK(tdp_td_leaf_at(td, i, &v));
        OK(tdp_schema_leaf_at(s, i, &sv));
        OK(tdp_td_get(td, v.path, &g));
        assert_string_equal(v.path, sv.path);
        assert_ptr_equal(g.path, v.path);
        assert_ptr_equal(g.data, v.data);
        if (v.kind == TDP_LEAF_VALUE) {
            assert_null(v.data);
            assert_string_equal(v.value_json, "\"episode-1\"");
            continue;
        }
        tensors++;
        assert_ptr_equal(v.data, base + v.offset);
        assert_int_equal(v.offset, sv.offset);
        assert_int_equal(v.offset % TDP_LEAF_ALIGN, 0);
        uint64_t numel = 1;
        int64_t stride = 1;
        for (uint32_t d = v.ndim; d-- > 0;) {
            assert_int_equal(v.strides[d], stride);
            stride *= v.shape[d] > 0 ? v.shape[d] : 1;
            numel *= (uint64_t)v.shape[d];
        }
        assert_int_equal(v.numel, numel);
        assert_int_equal(v.nbytes, numel * tdp_dtype_itemsize(v.dtype));
        assert_true(v.offset + v.nbytes <= tdp_td_nbytes(td));
    }
    assert_int_equal(tensors, tdp_schema_num_tensors(s));

    tdp_leaf l;
    OK(tdp_td_get(td, "nested.u8", &l));
    assert_int_equal(l.numel, 24);
    assert_int_equal(l.strides[0], 12);
    assert_int_equal(l.strides[1], 4);
    assert_int_equal(l.strides[2], 1);
    OK(tdp_td_get(td, "scalar", &l));
    assert_int_equal(l.ndim, 0);
    assert_int_equal(l.numel, 1);
    assert_int_equal(l.nbytes, 4);
    OK(tdp_td_get(td, "empty", &l));
    assert_int_equal(l.numel, 0);
    assert_int_equal(l.nbytes, 0);

    assert_int_equal(tdp_td_get(td, "missing", &l), TDP_ENOENT);
    assert_int_equal(tdp_td_get(td, "nested", &l), TDP_ENOENT); /* a node */
    assert_int_equal(tdp_td_get(td, NULL, &l), TDP_EINVAL);
    assert_int_equal(tdp_td_get(NULL, "f32", &l), TDP_EINVAL);
    assert_int_equal(tdp_td_get(td, "f32", NULL), TDP_EINVAL);
    assert_int_equal(tdp_td_leaf_at(td, tdp_td_num_leaves(td), &l), TDP_EINVAL);
    assert_int_equal(tdp_td_leaf_at(NULL, 0, &l), TDP_EINVAL);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_writes_land_in_place(void **state)
{
    (void)state;
    tdp_schema *s = cpu_schema();
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    unsigned char *base = tdp_td_data(td);
    memset(base, 0, tdp_td_nbytes(td));

    tdp_leaf f, i, u;
    OK(tdp_td_get(td, "f32", &f));
    OK(tdp_td_get(td, "i64", &i));
    OK(tdp_td_get(td, "nested.u8", &u));
    for (uint64_t k = 0; k < f.numel; k++)
        ((float *)f.data)[k] = 1.5f * (float)k;
    for (uint64_t k = 0; k < i.numel; k++)
        ((int64_t *)i.data)[k] = -(int64_t)k - 1;
    /* element [1][2][3] through the strides */
    ((uint8_t *)u.data)[1 * u.strides[0] + 2 * u.strides[1] + 3 * u.strides[2]] = 0xee;

    float fw[6];
    for (int k = 0; k < 6; k++)
        fw[k] = 1.5f * (float)k;
    assert_memory_equal(base + f.offset, fw, sizeof(fw));
    int64_t iw[4] = {-1, -2, -3, -4};
    assert_memory_equal(base + i.offset, iw, sizeof(iw));
    assert_int_equal(base[u.offset + 23], 0xee);

    /* nothing else was touched */
    size_t touched = 0;
    for (uint64_t k = 0; k < tdp_td_nbytes(td); k++) {
        bool in_f = k >= f.offset && k < f.offset + f.nbytes;
        bool in_i = k >= i.offset && k < i.offset + i.nbytes;
        if (!in_f && !in_i && k != u.offset + 23)
            assert_int_equal(base[k], 0);
        else
            touched++;
    }
    assert_int_equal(touched, f.nbytes + i.nbytes + 1);
    tdp_td_unref(td);
    tdp_schema_unref(s);
}

static void test_refcount(void **state)
{
    (void)state;
    live l0 = live_now();
    tdp_schema *s = cpu_schema();
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    assert_ptr_equal(tdp_td_ref(td), td);
    assert_ptr_equal(tdp_td_ref(td), td);
    tdp_td_unref(td);
    tdp_td_unref(td);
    memset(tdp_td_data(td), 1, tdp_td_nbytes(td)); /* still alive */
    tdp_td_unref(td);
    tdp_td_unref(NULL);
    assert_null(tdp_td_ref(NULL));
    tdp_schema_unref(s);
    assert_live_equal(live_now(), l0);

    /* NULL-safe queries */
    assert_null(tdp_td_schema(NULL));
    assert_null(tdp_td_data(NULL));
    assert_int_equal(tdp_td_nbytes(NULL), 0);
    assert_int_equal(tdp_td_num_leaves(NULL), 0);

    td = (tdp_td *)&td;
    assert_int_equal(tdp_td_new(NULL, &td), TDP_EINVAL);
    assert_ptr_equal(td, (tdp_td *)&td);
    s = cpu_schema();
    assert_int_equal(tdp_td_new(s, NULL), TDP_EINVAL);
    tdp_schema_unref(s);
}

/* ---- wrapped buffers ------------------------------------------------------------ */

typedef struct release_log {
    int calls;
    void *buf;
    void *arg;
} release_log;

static void on_release(void *buf, void *arg)
{
    release_log *r = arg;
    r->calls++;
    r->buf = buf;
    r->arg = arg;
}

static void test_wrap_release_once(void **state)
{
    (void)state;
    live l0 = live_now();
    tdp_schema *s = cpu_schema();
    uint64_t total = tdp_schema_total_bytes(s);
    void *buf = aligned_alloc(TDP_LEAF_ALIGN, total + TDP_LEAF_ALIGN);
    assert_non_null(buf);
    release_log r = {0};
    tdp_td *td = NULL;

    OK(tdp_td_wrap(s, buf, total + TDP_LEAF_ALIGN, TDP_DEVICE_CPU_INIT, on_release, &r, &td));
    assert_ptr_equal(tdp_td_data(td), buf);
    assert_int_equal(tdp_td_nbytes(td), total);
    live l1 = live_now(); /* no buffer allocated */
    assert_int_equal(l1.host_bytes, l0.host_bytes);
    assert_int_equal(l1.host_live_allocs, l0.host_live_allocs);
    tdp_leaf l;
    OK(tdp_td_get(td, "c64", &l));
    assert_ptr_equal(l.data, (char *)buf + l.offset);

    tdp_td_ref(td);
    tdp_td_ref(td);
    tdp_td_unref(td);
    tdp_td_unref(td);
    assert_int_equal(r.calls, 0);
    tdp_td_unref(td);
    assert_int_equal(r.calls, 1);
    assert_ptr_equal(r.buf, buf);
    assert_ptr_equal(r.arg, &r);

    /* exactly the size is enough; no callback is fine */
    OK(tdp_td_wrap(s, buf, total, TDP_DEVICE_CPU_INIT, NULL, NULL, &td));
    tdp_td_unref(td);
    assert_int_equal(r.calls, 1);

    free(buf);
    tdp_schema_unref(s);
    assert_live_equal(live_now(), l0);
}

static void test_wrap_rejects(void **state)
{
    (void)state;
    tdp_schema *s = cpu_schema();
    uint64_t total = tdp_schema_total_bytes(s);
    unsigned char *buf = aligned_alloc(TDP_LEAF_ALIGN, total + TDP_LEAF_ALIGN);
    assert_non_null(buf);
    release_log r = {0};
    tdp_td *td = (tdp_td *)&td;

    assert_int_equal(tdp_td_wrap(s, buf, total - 1, TDP_DEVICE_CPU_INIT, on_release, &r, &td),
                     TDP_EINVAL);
    assert_int_equal(tdp_td_wrap(s, buf, 0, TDP_DEVICE_CPU_INIT, on_release, &r, &td), TDP_EINVAL);
    static const size_t skew[] = {1, 8, 16, 32, 63};
    for (uint32_t i = 0; i < N(skew); i++)
        assert_int_equal(
            tdp_td_wrap(s, buf + skew[i], total, TDP_DEVICE_CPU_INIT, on_release, &r, &td),
            TDP_EINVAL);
    assert_int_equal(tdp_td_wrap(s, NULL, total, TDP_DEVICE_CPU_INIT, on_release, &r, &td),
                     TDP_EINVAL);
    assert_int_equal(tdp_td_wrap(NULL, buf, total, TDP_DEVICE_CPU_INIT, on_release, &r, &td),
                     TDP_EINVAL);
    assert_int_equal(tdp_td_wrap(s, buf, total, TDP_DEVICE_CPU_INIT, on_release, &r, NULL),
                     TDP_EINVAL);
    assert_ptr_equal(td, (tdp_td *)&td);
    assert_int_equal(r.calls, 0); /* a failed wrap never releases */
    /* aligned to 64 but not more: accepted */
    OK(tdp_td_wrap(s, buf + TDP_LEAF_ALIGN, total, TDP_DEVICE_CPU_INIT, on_release, &r, &td));
    tdp_td_unref(td);
    assert_int_equal(r.calls, 1);
    free(buf);
    tdp_schema_unref(s);
}

/* ---- DLPack ------------------------------------------------------------ */

static void check_dl(tdp_td *td, const char *path, uint8_t code, uint8_t bits)
{
    DLManagedTensor *dl = NULL;
    tdp_leaf l;
    OK(tdp_td_get(td, path, &l));
    tdp_err rc = tdp_td_to_dlpack(td, path, &dl);
    if (rc != TDP_OK)
        fail_msg("export '%s': %s", path, tdp_errname(rc));
    assert_non_null(dl);
    DLTensor *t = &dl->dl_tensor;
    if (t->dtype.code != code || t->dtype.bits != bits)
        fail_msg("'%s': code %u bits %u, want %u %u", path, t->dtype.code, t->dtype.bits, code,
                 bits);
    assert_int_equal(t->dtype.lanes, 1);
    assert_int_equal(t->ndim, (int)l.ndim);
    for (uint32_t d = 0; d < l.ndim; d++) {
        assert_int_equal(t->shape[d], l.shape[d]);
        assert_int_equal(t->strides[d], l.strides[d]);
    }
    assert_ptr_equal(t->data, l.data);
    assert_int_equal(t->byte_offset, 0);
    tdp_device dev = tdp_td_device(td);
    assert_int_equal(t->device.device_type, dev.type == TDP_DEVICE_CUDA ? kDLCUDA : kDLCPU);
    assert_int_equal(t->device.device_id, dev.type == TDP_DEVICE_CUDA ? dev.index : 0);
    assert_non_null(dl->deleter);
    dl->deleter(dl);
}

static void test_dlpack_export(void **state)
{
    (void)state;
    live l0 = live_now();
    tdp_schema *s = cpu_schema();
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    check_dl(td, "f32", kDLFloat, 32);
    check_dl(td, "i64", kDLInt, 64);
    /* DLPack 0.6 has no kDLBool: 8-bit unsigned, as PyTorch exported it */
    assert_int_equal(DLPACK_VERSION, 60);
    check_dl(td, "flag", kDLUInt, 8);
    assert_int_equal(kDLUInt, 1);
    check_dl(td, "bf16", kDLBfloat, 16);
    check_dl(td, "c64", kDLComplex, 64);
    check_dl(td, "c128", kDLComplex, 128);
    check_dl(td, "nested.u8", kDLUInt, 8);
    check_dl(td, "nested.deeper.f16", kDLFloat, 16);
    check_dl(td, "i8", kDLInt, 8);
    check_dl(td, "u16", kDLUInt, 16);
    check_dl(td, "f64", kDLFloat, 64);
    check_dl(td, "scalar", kDLFloat, 32);
    check_dl(td, "empty", kDLInt, 32);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    assert_live_equal(live_now(), l0);
}

static void test_dlpack_errors(void **state)
{
    (void)state;
    live l0 = live_now();
    tdp_schema *s = cpu_schema();
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    DLManagedTensor *dl = (DLManagedTensor *)&dl;
    assert_int_equal(tdp_td_to_dlpack(td, "f8", &dl), TDP_ENOTSUP);
    assert_int_equal(tdp_td_to_dlpack(td, "f8b", &dl), TDP_ENOTSUP);
    assert_int_equal(tdp_td_to_dlpack(td, "name", &dl), TDP_EINVAL);
    assert_int_equal(tdp_td_to_dlpack(td, "nope", &dl), TDP_ENOENT);
    assert_int_equal(tdp_td_to_dlpack(td, "nested", &dl), TDP_ENOENT);
    assert_int_equal(tdp_td_to_dlpack(td, "", &dl), TDP_ENOENT);
    assert_int_equal(tdp_td_to_dlpack(NULL, "f32", &dl), TDP_EINVAL);
    assert_int_equal(tdp_td_to_dlpack(td, NULL, &dl), TDP_EINVAL);
    assert_int_equal(tdp_td_to_dlpack(td, "f32", NULL), TDP_EINVAL);
    assert_ptr_equal(dl, (DLManagedTensor *)&dl);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    /* a failed export holds nothing */
    assert_live_equal(live_now(), l0);
}

/* DLPack tensors keep the td (and its buffer) alive after the handle goes. */
static void test_dlpack_outlives_td(void **state)
{
    (void)state;
    live l0 = live_now();
    tdp_schema *s = cpu_schema();
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    tdp_schema_unref(s); /* only the td holds it now */
    uint64_t total = tdp_td_nbytes(td);

    DLManagedTensor *a = NULL, *b = NULL;
    OK(tdp_td_to_dlpack(td, "f32", &a));
    OK(tdp_td_to_dlpack(td, "i64", &b));
    tdp_td_unref(td);

    live l1 = live_now();
    assert_int_equal(l1.host_bytes - l0.host_bytes, total); /* not freed */
    float *f = a->dl_tensor.data;
    for (int k = 0; k < 6; k++)
        f[k] = (float)k; /* ASan: the buffer is still live */
    assert_true(f[5] == 5.0f);
    assert_int_equal(a->dl_tensor.shape[0], 2); /* shape storage is the tensor's own */
    assert_int_equal(a->dl_tensor.shape[1], 3);

    a->deleter(a);
    l1 = live_now();
    assert_int_equal(l1.host_bytes - l0.host_bytes, total); /* b still holds it */
    ((int64_t *)b->dl_tensor.data)[3] = 42;
    b->deleter(b);
    assert_live_equal(live_now(), l0);

    /* the same with a wrapped buffer: released only after the last tensor */
    s = cpu_schema();
    void *buf = aligned_alloc(TDP_LEAF_ALIGN, tdp_schema_total_bytes(s));
    assert_non_null(buf);
    release_log r = {0};
    OK(tdp_td_wrap(s, buf, tdp_schema_total_bytes(s), TDP_DEVICE_CPU_INIT, on_release, &r, &td));
    tdp_schema_unref(s);
    OK(tdp_td_to_dlpack(td, "c64", &a));
    tdp_td_unref(td);
    assert_int_equal(r.calls, 0);
    a->deleter(a);
    assert_int_equal(r.calls, 1);
    assert_ptr_equal(r.buf, buf);
    free(buf);
    assert_live_equal(live_now(), l0);
}

/* ---- CUDA ----------------------------------------------------------------- */

/* A device: the machine's GPU where there is one, else the fake. */
static int use_device(void **state)
{
    (void)state;
    if (tdp__cuda_select("driver") != TDP_OK || tdp_cuda_device_count() == 0)
        assert_int_equal(tdp__cuda_select("fake"), TDP_OK);
    return 0;
}

static int use_no_device(void **state)
{
    (void)state;
    assert_int_equal(tdp__cuda_select("off"), TDP_OK);
    return 0;
}

static void test_cuda_td_without_gpu(void **state)
{
    (void)state;
    assert_int_equal(tdp_cuda_device_count(), 0);
    live l0 = live_now();
    tdp_schema *s = mixed_schema((tdp_device){TDP_DEVICE_CUDA, 0});
    tdp_td *td = (tdp_td *)&td;
    assert_int_equal(tdp_td_new(s, &td), TDP_ENOTSUP);
    assert_ptr_equal(td, (tdp_td *)&td);
    tdp_schema_unref(s);
    assert_live_equal(live_now(), l0);
}

static void test_cuda_td(void **state)
{
    (void)state;
    assert_true(tdp_cuda_device_count() > 0);
    tdp_mem_stats m0, m1;
    tdp_mem_stats_get(&m0);
    const tdp_device dev = {TDP_DEVICE_CUDA, 0};
    tdp_schema *s = mixed_schema(dev);
    tdp_td *td = NULL;
    OK(tdp_td_new(s, &td));
    assert_true(tdp_device_equal(tdp_td_device(td), dev));
    assert_int_equal((uintptr_t)tdp_td_data(td) % TDP_LEAF_ALIGN, 0);
    tdp__cuda_ptr_info info;
    OK(tdp__cuda_ptr_get_info(tdp_td_data(td), &info));
    assert_int_equal(info.kind, TDP__CUDA_PTR_DEVICE);
    tdp_mem_stats_get(&m1);
    assert_int_equal(m1.live_bytes[TDP_MEM_CUDA] - m0.live_bytes[TDP_MEM_CUDA],
                     tdp_schema_total_bytes(s));

    /* a leaf written on the device reads back */
    tdp_leaf l;
    OK(tdp_td_get(td, "i64", &l));
    const int64_t want[4] = {7, 8, 9, 10};
    int64_t got[4] = {0};
    OK(tdp_mem_copy(l.data, want, sizeof(want)));
    OK(tdp_mem_copy(got, (char *)tdp_td_data(td) + l.offset, sizeof(got)));
    assert_memory_equal(got, want, sizeof(want));

    check_dl(td, "f32", kDLFloat, 32);
    DLManagedTensor *dl = NULL;
    OK(tdp_td_to_dlpack(td, "c64", &dl));
    assert_int_equal(dl->dl_tensor.device.device_type, kDLCUDA);
    assert_int_equal(dl->dl_tensor.device.device_id, 0);
    tdp_td_unref(td);
    tdp_mem_stats_get(&m1);
    assert_int_equal(m1.live_bytes[TDP_MEM_CUDA] - m0.live_bytes[TDP_MEM_CUDA],
                     tdp_schema_total_bytes(s));
    dl->deleter(dl);
    tdp_mem_stats_get(&m1);
    assert_int_equal(m1.live_bytes[TDP_MEM_CUDA], m0.live_bytes[TDP_MEM_CUDA]);
    tdp_schema_unref(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_new_cpu),
        cmocka_unit_test(test_empty_td),
        cmocka_unit_test(test_leaf_views),
        cmocka_unit_test(test_writes_land_in_place),
        cmocka_unit_test(test_refcount),
        cmocka_unit_test(test_wrap_release_once),
        cmocka_unit_test(test_wrap_rejects),
        cmocka_unit_test(test_dlpack_export),
        cmocka_unit_test(test_dlpack_errors),
        cmocka_unit_test(test_dlpack_outlives_td),
        cmocka_unit_test_setup(test_cuda_td_without_gpu, use_no_device),
        cmocka_unit_test_setup(test_cuda_td, use_device),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
