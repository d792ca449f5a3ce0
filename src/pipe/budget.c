/* budget.c: a memory budget shared by pipes (budget.h). */
#include "budget.h"
#include "../core/alloc.h"

tdp__budget *tdp__budget_new(uint64_t cap)
{
    tdp__budget *b = tdp__calloc(1, sizeof(*b));
    if (b == NULL)
        return NULL;
    b->cap = cap;
    atomic_init(&b->used, 0);
    atomic_init(&b->refused, 0);
    atomic_init(&b->refs, 1);
    return b;
}

tdp__budget *tdp__budget_ref(tdp__budget *b)
{
    atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
    return b;
}

void tdp__budget_unref(tdp__budget *b)
{
    if (b != NULL && atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) == 1)
        tdp__free(b);
}

bool tdp__budget_take(tdp__budget *b, uint64_t n)
{
    uint64_t cur = atomic_load_explicit(&b->used, memory_order_relaxed);
    do {
        if (n > b->cap || cur > b->cap - n) {
            atomic_fetch_add_explicit(&b->refused, 1, memory_order_relaxed);
            return false;
        }
    } while (!atomic_compare_exchange_weak_explicit(&b->used, &cur, cur + n, memory_order_relaxed,
                                                    memory_order_relaxed));
    return true;
}

void tdp__budget_give(tdp__budget *b, uint64_t n)
{
    atomic_fetch_sub_explicit(&b->used, n, memory_order_relaxed);
}

uint64_t tdp__budget_used(const tdp__budget *b)
{
    return atomic_load_explicit(&((tdp__budget *)b)->used, memory_order_relaxed);
}

uint64_t tdp__budget_refused(const tdp__budget *b)
{
    return atomic_load_explicit(&((tdp__budget *)b)->refused, memory_order_relaxed);
}
