/* dtype.c: the dtype table — sizes, alignments and PyTorch names. */
#include <tdpipe/dtype.h>

#include <string.h>

typedef struct dtype_info {
    const char *name; /* canonical, as str(torch.dtype) prints it */
    uint8_t itemsize;
    uint8_t align;
} dtype_info;

static const dtype_info dtypes[TDP_DTYPE_COUNT] = {
    [TDP_BOOL] = {"torch.bool", 1, 1},
    [TDP_INT8] = {"torch.int8", 1, 1},
    [TDP_INT16] = {"torch.int16", 2, 2},
    [TDP_INT32] = {"torch.int32", 4, 4},
    [TDP_INT64] = {"torch.int64", 8, 8},
    [TDP_UINT8] = {"torch.uint8", 1, 1},
    [TDP_UINT16] = {"torch.uint16", 2, 2},
    [TDP_UINT32] = {"torch.uint32", 4, 4},
    [TDP_UINT64] = {"torch.uint64", 8, 8},
    [TDP_FLOAT16] = {"torch.float16", 2, 2},
    [TDP_BFLOAT16] = {"torch.bfloat16", 2, 2},
    [TDP_FLOAT32] = {"torch.float32", 4, 4},
    [TDP_FLOAT64] = {"torch.float64", 8, 8},
    [TDP_COMPLEX64] = {"torch.complex64", 8, 4},
    [TDP_COMPLEX128] = {"torch.complex128", 16, 8},
    [TDP_FLOAT8_E4M3FN] = {"torch.float8_e4m3fn", 1, 1},
    [TDP_FLOAT8_E5M2] = {"torch.float8_e5m2", 1, 1},
};

/* PyTorch's alternative spellings of the same dtypes. */
static const struct {
    const char *name;
    tdp_dtype dt;
} aliases[] = {
    {"torch.float", TDP_FLOAT32},   {"torch.double", TDP_FLOAT64},
    {"torch.half", TDP_FLOAT16},    {"torch.int", TDP_INT32},
    {"torch.long", TDP_INT64},      {"torch.short", TDP_INT16},
    {"torch.cfloat", TDP_COMPLEX64}, {"torch.cdouble", TDP_COMPLEX128},
};

static bool valid(tdp_dtype dt)
{
    return dt > TDP_DTYPE_INVALID && dt < TDP_DTYPE_COUNT;
}

size_t tdp_dtype_itemsize(tdp_dtype dt)
{
    return valid(dt) ? dtypes[dt].itemsize : 0;
}

size_t tdp_dtype_align(tdp_dtype dt)
{
    return valid(dt) ? dtypes[dt].align : 0;
}

const char *tdp_dtype_name(tdp_dtype dt)
{
    return valid(dt) ? dtypes[dt].name : NULL;
}

tdp_err tdp_dtype_parse(const char *name, tdp_dtype *out)
{
    if (name == NULL || out == NULL)
        return TDP_EINVAL;
    for (int i = 1; i < TDP_DTYPE_COUNT; i++) {
        const char *full = dtypes[i].name;
        if (strcmp(name, full) == 0 || strcmp(name, full + 6) == 0) { /* skip "torch." */
            *out = (tdp_dtype)i;
            return TDP_OK;
        }
    }
    for (size_t i = 0; i < sizeof(aliases) / sizeof(aliases[0]); i++) {
        if (strcmp(name, aliases[i].name) == 0 || strcmp(name, aliases[i].name + 6) == 0) {
            *out = aliases[i].dt;
            return TDP_OK;
        }
    }
    return TDP_EINVAL;
}
