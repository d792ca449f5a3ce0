/*
 * sized.h (internal): filling a public struct that can grow, for a caller
 * whose idea of its size may be older or newer than ours.
 */
#ifndef TDP_CORE_SIZED_H
#define TDP_CORE_SIZED_H

#include <stddef.h>
#include <string.h>

/*
 * Write the first `size` bytes of dst from src (have bytes): what both
 * know is copied, what only the caller knows (a newer header) is zeroed,
 * nothing past size is touched (an older one).
 */
static inline void tdp__fill_sized(void *dst, size_t size, const void *src, size_t have)
{
    size_t n = size < have ? size : have;
    memcpy(dst, src, n);
    if (size > n)
        memset((char *)dst + n, 0, size - n);
}

#endif
