/*
 * budget.h (internal): a memory budget shared by several pipes — a
 * server's cap on the receive storage of all its clients together
 * (tdp_server_opts.max_memory). A pipe takes what a new receive layout
 * needs before it prepares storage, and gives it all back when it is
 * freed. Thread-safe: pipes of one budget may run on different loops.
 * Reference-counted: a pipe's memory goes on a later loop turn, possibly
 * after the server that made the budget.
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
    _Atomic uint32_t refs;
} tdp__budget;

/* A budget of cap bytes, one reference held by the caller; NULL: no memory. */
tdp__budget *tdp__budget_new(uint64_t cap);
tdp__budget *tdp__budget_ref(tdp__budget *b);
void tdp__budget_unref(tdp__budget *b); /* NULL is a no-op */
/* Take n bytes: true, or false (nothing taken, refused counted) over the cap. */
bool tdp__budget_take(tdp__budget *b, uint64_t n);
/* Give back n bytes taken earlier. */
void tdp__budget_give(tdp__budget *b, uint64_t n);
uint64_t tdp__budget_used(const tdp__budget *b);
uint64_t tdp__budget_refused(const tdp__budget *b);

#endif
