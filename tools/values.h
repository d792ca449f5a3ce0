/*
 * values.h: a tensordict's leaf values for people (`tdpipe inspect --values`).
 */
#ifndef TDPIPE_TOOLS_VALUES_H
#define TDPIPE_TOOLS_VALUES_H

#include <stdint.h>
#include <stdio.h>
#include <tdpipe/tdpipe.h>

/*
 * One line per tensor leaf, in the schema's order, abbreviated as numpy
 * prints: "  PATH DTYPE[SHAPE] = [v0, v1, ..., v(n-1), ...]", the first n
 * elements in C order ("..." when there are more). Floats with %g
 * (float16, bfloat16 and the float8 types converted to float first),
 * integers in decimal, bool as true/false, complex as (re+imj). Device
 * memory is not read: the line says so.
 */
void tdp_cli_print_values(FILE *f, const tdp_td *td, uint64_t n);

/* An element of a 16-bit or 8-bit float type as a double (exposed for tests). */
double tdp_cli_half_to_double(uint16_t h);
double tdp_cli_bf16_to_double(uint16_t b);
double tdp_cli_e4m3fn_to_double(uint8_t v);
double tdp_cli_e5m2_to_double(uint8_t v);

#endif /* TDPIPE_TOOLS_VALUES_H */
