/*
 * dtype.h: element types of tensor leaves, named as PyTorch names them.
 */
#ifndef TDPIPE_DTYPE_H
#define TDPIPE_DTYPE_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Values are stable; they never appear on the wire (names do). */
typedef enum tdp_dtype {
    TDP_DTYPE_INVALID = 0,
    TDP_BOOL,
    TDP_INT8,
    TDP_INT16,
    TDP_INT32,
    TDP_INT64,
    TDP_UINT8,
    TDP_UINT16,
    TDP_UINT32,
    TDP_UINT64,
    TDP_FLOAT16,
    TDP_BFLOAT16,
    TDP_FLOAT32,
    TDP_FLOAT64,
    TDP_COMPLEX64,
    TDP_COMPLEX128,
    TDP_FLOAT8_E4M3FN,
    TDP_FLOAT8_E5M2,
    TDP_DTYPE_COUNT
} tdp_dtype;

/* Bytes per element; 0 for an invalid value. */
TDP_API size_t tdp_dtype_itemsize(tdp_dtype dt);

/*
 * Required alignment of an element's address (its C alignment: complex128 is
 * two doubles, so 8). Leaf offsets must be multiples of it.
 */
TDP_API size_t tdp_dtype_align(tdp_dtype dt);

/* Canonical name, "torch.float32"; NULL for an invalid value. */
TDP_API const char *tdp_dtype_name(tdp_dtype dt);

/*
 * Parse a dtype name. Accepts the canonical "torch.float32" and the short
 * "float32"; also PyTorch's aliases ("torch.float", "torch.half",
 * "torch.double", "torch.int", "torch.long", "torch.short",
 * "torch.cfloat", "torch.cdouble"). Anything else is TDP_EINVAL.
 */
TDP_API tdp_err tdp_dtype_parse(const char *name, tdp_dtype *out);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_DTYPE_H */
