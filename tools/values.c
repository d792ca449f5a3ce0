/*
 * values.c: leaf values for people (values.h).
 */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "values.h"

double tdp_cli_half_to_double(uint16_t h)
{
    unsigned e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0    ? ldexp(m, -24)
               : e == 31 ? (m ? NAN : INFINITY)
                         : ldexp(1024 + m, (int)e - 25);
    return h & 0x8000 ? -v : v;
}

double tdp_cli_bf16_to_double(uint16_t b)
{
    uint32_t bits = (uint32_t)b << 16; /* the top half of a float32 */
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

double tdp_cli_e4m3fn_to_double(uint8_t x)
{
    /* bias 7, no infinities: all-ones exponent and mantissa is the one NaN */
    unsigned e = (x >> 3) & 0xf, m = x & 7;
    double v = e == 15 && m == 7 ? NAN : e == 0 ? ldexp(m, -9) : ldexp(8 + m, (int)e - 10);
    return x & 0x80 ? -v : v;
}

double tdp_cli_e5m2_to_double(uint8_t x)
{
    return tdp_cli_half_to_double((uint16_t)(x << 8)); /* float16 with 2 mantissa bits */
}

/* Element i of a leaf of dtype dt at p. */
static void print_elem(FILE *f, tdp_dtype dt, const uint8_t *p, uint64_t i)
{
    size_t sz = tdp_dtype_itemsize(dt);
    union {
        int8_t i8;
        int16_t i16;
        int32_t i32;
        int64_t i64;
        uint8_t u8;
        uint16_t u16;
        uint32_t u32;
        uint64_t u64;
        float f32;
        double f64;
        float c64[2];
        double c128[2];
    } u;
    memcpy(&u, p + i * sz, sz); /* no alignment assumed */
    switch (dt) {
    case TDP_BOOL:
        fputs(u.u8 ? "true" : "false", f);
        break;
    case TDP_INT8:
        fprintf(f, "%d", u.i8);
        break;
    case TDP_INT16:
        fprintf(f, "%d", u.i16);
        break;
    case TDP_INT32:
        fprintf(f, "%" PRId32, u.i32);
        break;
    case TDP_INT64:
        fprintf(f, "%" PRId64, u.i64);
        break;
    case TDP_UINT8:
        fprintf(f, "%u", u.u8);
        break;
    case TDP_UINT16:
        fprintf(f, "%u", u.u16);
        break;
    case TDP_UINT32:
        fprintf(f, "%" PRIu32, u.u32);
        break;
    case TDP_UINT64:
        fprintf(f, "%" PRIu64, u.u64);
        break;
    case TDP_FLOAT16:
        fprintf(f, "%g", tdp_cli_half_to_double(u.u16));
        break;
    case TDP_BFLOAT16:
        fprintf(f, "%g", tdp_cli_bf16_to_double(u.u16));
        break;
    case TDP_FLOAT32:
        fprintf(f, "%g", u.f32);
        break;
    case TDP_FLOAT64:
        fprintf(f, "%g", u.f64);
        break;
    case TDP_COMPLEX64:
        fprintf(f, "(%g%+gj)", u.c64[0], u.c64[1]);
        break;
    case TDP_COMPLEX128:
        fprintf(f, "(%g%+gj)", u.c128[0], u.c128[1]);
        break;
    case TDP_FLOAT8_E4M3FN:
        fprintf(f, "%g", tdp_cli_e4m3fn_to_double(u.u8));
        break;
    case TDP_FLOAT8_E5M2:
        fprintf(f, "%g", tdp_cli_e5m2_to_double(u.u8));
        break;
    default:
        fputs("?", f);
        break;
    }
}

void tdp_cli_print_values(FILE *f, const tdp_td *td, uint64_t n)
{
    bool host = tdp_td_device(td).type == TDP_DEVICE_CPU;
    for (uint32_t i = 0; i < tdp_td_num_leaves(td); i++) {
        tdp_leaf l;
        if (tdp_td_leaf_at(td, i, &l) != TDP_OK || l.kind != TDP_LEAF_TENSOR)
            continue;
        const char *name = tdp_dtype_name(l.dtype);
        if (name != NULL && strncmp(name, "torch.", 6) == 0)
            name += 6;
        fprintf(f, "  %s %s[", l.path, name ? name : "?");
        for (uint32_t d = 0; d < l.ndim; d++)
            fprintf(f, "%s%" PRId64, d ? "," : "", l.shape[d]);
        fputs("] = ", f);
        if (!host) {
            fputs("(device memory: not shown)\n", f);
            continue;
        }
        fputc('[', f);
        uint64_t shown = l.numel < n ? l.numel : n;
        for (uint64_t k = 0; k < shown; k++) {
            if (k > 0)
                fputs(", ", f);
            print_elem(f, l.dtype, l.data, k);
        }
        if (l.numel > shown)
            fputs(shown ? ", ...]\n" : "...]\n", f);
        else
            fputs("]\n", f);
    }
}
