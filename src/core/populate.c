/* populate.c: fault pages in ahead of their first use (populate.h). */
#include "populate.h"

#include <stdint.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack it */
#endif

static size_t page_size(void)
{
    long ps = sysconf(_SC_PAGESIZE);
    return ps > 0 ? (size_t)ps : 4096u;
}

/* Touch each page: one fault each, but all of them here rather than later. */
static void touch_pages(volatile unsigned char *b, size_t n, size_t ps)
{
    for (size_t off = 0; off < n; off += ps)
        b[off] = b[off];
    if (n > 0)
        b[n - 1] = b[n - 1];
}

void tdp__populate_write(void *p, size_t n)
{
    if (p == NULL || n == 0)
        return;
    size_t ps = page_size();
#ifdef __linux__
    /* madvise wants a page-aligned start: round it down (the page is ours too) */
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(ps - 1);
    if (madvise((void *)a, n + ((uintptr_t)p - a), MADV_POPULATE_WRITE) == 0)
        return;
        /* EINVAL: a kernel before 5.14; anything else: let the pages fault one by one */
#endif
    touch_pages(p, n, ps);
}
