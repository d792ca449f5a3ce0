/*
 * test_util.h: small helpers several suites share. Include after <cmocka.h>
 * (the schema helper asserts with it).
 */
#ifndef TDP_TEST_UTIL_H
#define TDP_TEST_UTIL_H

#include <stdint.h>
#include <time.h>
#include <tdpipe/tdpipe.h>

/* Milliseconds of CLOCK_MONOTONIC: deadlines of bounded waits. */
static inline int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A layout of one uint8 tensor "x" of nbytes bytes, on the host. */
static inline tdp_schema *host_bytes_schema(int64_t nbytes)
{
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    assert_int_equal(tdp_schema_builder_new(&b), TDP_OK);
    assert_int_equal(tdp_schema_builder_tensor(b, "x", TDP_UINT8, 1, &nbytes), TDP_OK);
    assert_int_equal(tdp_schema_builder_finish(b, &s, NULL, 0), TDP_OK);
    tdp_schema_builder_free(b);
    return s;
}

#endif
