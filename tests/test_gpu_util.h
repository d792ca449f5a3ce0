/*
 * test_gpu_util.h: what the GPU suites on the fake device share: a one-tensor
 * layout on a device, and a tagged byte pattern written into and checked in
 * a tensordict, host or device (device memory through copies: the fake's
 * device memory faults when host code touches it). Include after <cmocka.h>.
 */
#ifndef TDP_TEST_GPU_UTIL_H
#define TDP_TEST_GPU_UTIL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <tdpipe/tdpipe.h>

#include "core/cuda.h"

/* A layout of one uint8 tensor "x" of n bytes on dev. */
static inline tdp_schema *gpu_schema_of(uint64_t n, tdp_device dev)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    int64_t shape[] = {(int64_t)n};
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_set_device(b, dev), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, shape), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    return s;
}

static inline void gpu_pattern(unsigned char *p, size_t n, uint64_t tag)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 7u + tag * 13u + (i >> 12));
}

/* Fill a tensordict (host or device) with the pattern for tag. */
static inline void gpu_fill(tdp_td *td, uint64_t tag)
{
    size_t n = tdp_td_nbytes(td);
    if (tdp_td_device(td).type == TDP_DEVICE_CPU) {
        gpu_pattern(tdp_td_data(td), n, tag);
        return;
    }
    unsigned char *h = malloc(n);
    gpu_pattern(h, n, tag);
    assert_int_equal(tdp__cuda_memcpy(tdp_td_data(td), h, n), TDP_OK);
    free(h);
}

/* Whether td holds the pattern for tag (device memory read through a copy). */
static inline bool gpu_holds(const tdp_td *td, uint64_t tag)
{
    size_t n = tdp_td_nbytes(td);
    unsigned char *want = malloc(n), *got = malloc(n);
    gpu_pattern(want, n, tag);
    if (tdp_td_device(td).type == TDP_DEVICE_CPU)
        memcpy(got, tdp_td_data(td), n);
    else
        assert_int_equal(tdp__cuda_memcpy(got, tdp_td_data(td), n), TDP_OK);
    bool same = memcmp(want, got, n) == 0;
    free(want);
    free(got);
    return same;
}

#endif
