/* dlpack.c: zero-copy export of a leaf as a DLManagedTensor. */
#include <dlpack/dlpack.h>
#include <string.h>

#include "schema_int.h"
#include "td_int.h"
#include "../core/alloc.h"

/* One allocation holds the managed tensor and its shape and strides. */
typedef struct dl_export {
    DLManagedTensor mt;
    tdp_td *td;
    int64_t dims[]; /* shape[ndim], then strides[ndim] */
} dl_export;

static void dl_deleter(DLManagedTensor *self)
{
    dl_export *e = (dl_export *)self; /* mt is the first member */
    tdp_td_unref(e->td);
    tdp__free(e);
}

static bool dl_dtype(tdp_dtype dt, DLDataType *out)
{
    size_t bits = tdp_dtype_itemsize(dt) * 8;
    out->lanes = 1;
    out->bits = (uint8_t)bits;
    switch (dt) {
    case TDP_BOOL:
#if defined(DLPACK_VERSION) && DLPACK_VERSION >= 80
        out->code = kDLBool;
#else
        out->code = kDLUInt;
#endif
        return true;
    case TDP_INT8:
    case TDP_INT16:
    case TDP_INT32:
    case TDP_INT64:
        out->code = kDLInt;
        return true;
    case TDP_UINT8:
    case TDP_UINT16:
    case TDP_UINT32:
    case TDP_UINT64:
        out->code = kDLUInt;
        return true;
    case TDP_FLOAT16:
    case TDP_FLOAT32:
    case TDP_FLOAT64:
        out->code = kDLFloat;
        return true;
    case TDP_BFLOAT16:
        out->code = kDLBfloat;
        return true;
    case TDP_COMPLEX64:
    case TDP_COMPLEX128:
        out->code = kDLComplex;
        return true;
    default:
        return false; /* float8: no code in this DLPack version */
    }
}

tdp_err tdp_td_to_dlpack(tdp_td *td, const char *path, struct DLManagedTensor **out)
{
    tdp_leaf leaf;
    DLDataType dt;

    if (td == NULL || path == NULL || out == NULL)
        return TDP_EINVAL;
    tdp_err rc = tdp_td_get(td, path, &leaf);
    if (rc != TDP_OK)
        return rc;
    if (leaf.kind != TDP_LEAF_TENSOR)
        return TDP_EINVAL;
    if (!dl_dtype(leaf.dtype, &dt))
        return TDP_ENOTSUP;
    dl_export *e = tdp__malloc(sizeof(*e) + 2 * (size_t)leaf.ndim * sizeof(int64_t));
    if (e == NULL)
        return TDP_ENOMEM;
    memcpy(e->dims, leaf.shape, leaf.ndim * sizeof(int64_t));
    memcpy(e->dims + leaf.ndim, leaf.strides, leaf.ndim * sizeof(int64_t));
    e->td = tdp_td_ref(td);
    e->mt = (DLManagedTensor){
        .dl_tensor =
            {
                /* data points at the leaf itself and byte_offset is 0, as
                 * PyTorch exports: every consumer reads that form */
                .data = (char *)td->data + leaf.offset,
                .device = {td->device.type == TDP_DEVICE_CUDA ? kDLCUDA : kDLCPU,
                           td->device.index},
                .ndim = (int)leaf.ndim,
                .dtype = dt,
                .shape = e->dims,
                .strides = e->dims + leaf.ndim,
                .byte_offset = 0,
            },
        .manager_ctx = td,
        .deleter = dl_deleter,
    };
    *out = &e->mt;
    return TDP_OK;
}
