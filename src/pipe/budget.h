/*
 * budget.h (internal): a memory budget shared by several pipes — a
 * server's cap on the receive storage of all its clients together
 * (tdp_server_opts.max_memory). A pipe takes what a new receive layout
 * needs before it prepares storage, and gives it all back when it is
 * freed. Thread-safe: pipes of one budget may run on different loops.
 */
#ifndef TDP_PIPE_BUDGET_H
#define TDP_PIPE_BUDGET_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct tdp__budget {
    uint64_t cap;             /* bytes; UINT64_MAX: no cap */
    _Atomic uint64_t used;    /* bytes taken */
    _Atomic uint64_t refused; /* takes that would have gone over the cap */
} tdp__budget;

void tdp__budget_init(tdp__budget *b, uint64_t cap);
/* Take n bytes: true, or false (nothing taken, refused counted) over the cap. */
bool tdp__budget_take(tdp__budget *b, uint64_t n);
/* Give back n bytes taken earlier. */
void tdp__budget_give(tdp__budget *b, uint64_t n);
uint64_t tdp__budget_used(const tdp__budget *b);

#endif
