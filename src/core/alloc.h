/*
 * alloc.h (internal): counted small-object allocation. Every heap object the
 * library creates goes through these, so tests can prove a path allocates
 * nothing. Buffers go through tdp_mem_alloc instead.
 */
#ifndef TDP_CORE_ALLOC_H
#define TDP_CORE_ALLOC_H

#include <stddef.h>

void *tdp__malloc(size_t n);
void *tdp__calloc(size_t count, size_t n);
void *tdp__realloc(void *p, size_t n); /* counted as free + alloc */
char *tdp__strdup(const char *s);
char *tdp__strndup(const char *s, size_t n);
void tdp__free(void *p);

/* Allocate an array of `count` elements of `size`, with overflow checked. */
static inline void *tdp__alloc_array(size_t count, size_t size)
{
    return tdp__calloc(count, size);
}

#endif
