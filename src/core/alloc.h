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

/*
 * Copy n bytes between any two buffers tdp_mem_alloc can make (host or
 * CUDA, either way): memcpy for host to host, cudaMemcpy otherwise (the
 * driver tells which is which). TDP_ENOTSUP when a side is a GPU buffer and
 * this build has no CUDA; TDP_ECUDA when the copy fails. Blocking.
 */
#include <stdbool.h>
#include <tdpipe/err.h>
tdp_err tdp__mem_copy(void *dst, bool dst_gpu, const void *src, bool src_gpu, size_t n);

/* Allocate an array of `count` elements of `size`, with overflow checked. */
static inline void *tdp__alloc_array(size_t count, size_t size)
{
    return tdp__calloc(count, size);
}

#endif
