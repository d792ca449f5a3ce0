/* mem.c: counted host, pinned and device allocations; device names. */
#include <tdpipe/mem.h>

#include <errno.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cuda.h"
#include "log.h"
#include "populate.h"

static _Atomic uint64_t stat_allocs[TDP_MEM_TYPE_COUNT];
static _Atomic uint64_t stat_frees[TDP_MEM_TYPE_COUNT];
static _Atomic uint64_t stat_live[TDP_MEM_TYPE_COUNT];
static _Atomic uint64_t stat_small_allocs;
static _Atomic uint64_t stat_small_frees;

/*
 * Host buffers carry their size in a header one alignment unit before the
 * returned pointer so tdp_mem_free can keep live_bytes exact without a table.
 */
typedef struct mem_hdr {
    size_t size;
    size_t offset; /* from the start of the allocation to the user pointer */
} mem_hdr;

static tdp_err host_alloc(size_t size, size_t align, void **out)
{
    size_t off = align >= sizeof(mem_hdr) ? align : sizeof(mem_hdr);
    void *base = NULL;

    if (size > SIZE_MAX - off)
        return TDP_ENOMEM;
    /* large: on a huge-page boundary, so that huge pages can back it (populate.h) */
    bool huge = size >= TDP__HUGE_MIN && align <= TDP__HUGE_PAGE;
    size_t a = huge ? TDP__HUGE_PAGE : align < sizeof(void *) ? sizeof(void *) : align;
    if (posix_memalign(&base, a, size + off) != 0)
        return TDP_ENOMEM;
    if (huge)
        tdp__huge_advise(base, size + off);
    char *p = (char *)base + off;
    mem_hdr *h = (mem_hdr *)(void *)(p - sizeof(mem_hdr));
    h->size = size;
    h->offset = off;
    *out = p;
    return TDP_OK;
}

static size_t host_size(void *p, void **base)
{
    mem_hdr *h = (mem_hdr *)(void *)((char *)p - sizeof(mem_hdr));
    *base = (char *)p - h->offset;
    return h->size;
}

/*
 * Sizes of pinned and device allocations, which carry no header: a side list,
 * so that tdp_mem_free keeps live_bytes exact. Allocating device memory is
 * never on a per-message path.
 */
typedef struct cuda_blk {
    void *ptr;
    size_t size;
    struct cuda_blk *next;
} cuda_blk;
static cuda_blk *cuda_blocks;
static atomic_flag cuda_lock = ATOMIC_FLAG_INIT;

static void blocks_lock(void)
{
    while (atomic_flag_test_and_set_explicit(&cuda_lock, memory_order_acquire))
        ;
}
static void blocks_unlock(void)
{
    atomic_flag_clear_explicit(&cuda_lock, memory_order_release);
}

/* Pinned or device memory through the CUDA layer, its size remembered. */
static tdp_err cuda_alloc(tdp_mem_type type, int device, size_t size, size_t align, void **out)
{
    if (align > TDP_CUDA_ALIGN && !(type == TDP_MEM_HOST_PINNED && align <= 4096))
        return TDP_EINVAL;
    if (tdp__cuda_device_count() == 0)
        return TDP_ENOTSUP;
    cuda_blk *blk = tdp__malloc(sizeof(*blk));
    if (blk == NULL)
        return TDP_ENOMEM;
    void *p = NULL;
    tdp_err rc =
        type == TDP_MEM_CUDA ? tdp__cuda_malloc(device, size, &p) : tdp__cuda_host_alloc(size, &p);
    if (rc != TDP_OK) {
        tdp__free(blk);
        return rc;
    }
    blk->ptr = p;
    blk->size = size;
    blocks_lock();
    blk->next = cuda_blocks;
    cuda_blocks = blk;
    blocks_unlock();
    *out = p;
    return TDP_OK;
}

/* Free what cuda_alloc gave; its size, or false for an unknown pointer. */
static bool cuda_release(tdp_mem_type type, void *ptr, size_t *size)
{
    cuda_blk **pp, *blk = NULL;
    blocks_lock();
    for (pp = &cuda_blocks; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->ptr == ptr) {
            blk = *pp;
            *pp = blk->next;
            break;
        }
    }
    blocks_unlock();
    if (blk == NULL)
        return false;
    *size = blk->size;
    tdp__free(blk);
    if (type == TDP_MEM_CUDA)
        tdp__cuda_free(ptr);
    else
        tdp__cuda_host_free(ptr);
    return true;
}

tdp_err tdp_mem_alloc(tdp_mem_type type, int device, size_t size, size_t align, void **out)
{
    tdp_err rc;
    void *p = NULL;

    if (out == NULL || (unsigned)type >= TDP_MEM_TYPE_COUNT)
        return TDP_EINVAL;
    if (align == 0) /* device memory: the runtime's guarantee, not a page */
        align = type == TDP_MEM_CUDA ? TDP_CUDA_ALIGN : TDP_BUFFER_ALIGN;
    if ((align & (align - 1)) != 0)
        return TDP_EINVAL;

    switch (type) {
    case TDP_MEM_HOST:
        rc = host_alloc(size, align, &p);
        break;
    case TDP_MEM_HOST_PINNED:
    case TDP_MEM_CUDA:
        rc = cuda_alloc(type, device, size, align, &p);
        break;
    default:
        return TDP_EINVAL;
    }
    if (rc != TDP_OK)
        return rc;
    atomic_fetch_add(&stat_allocs[type], 1);
    atomic_fetch_add(&stat_live[type], size);
    *out = p;
    return TDP_OK;
}

void tdp_mem_free(tdp_mem_type type, void *ptr)
{
    size_t size = 0;

    if (ptr == NULL || (unsigned)type >= TDP_MEM_TYPE_COUNT)
        return;
    if (type == TDP_MEM_HOST) {
        void *base;
        size = host_size(ptr, &base);
        free(base);
    } else if (!cuda_release(type, ptr, &size)) {
        tdp_log_error("tdp_mem_free: %p was not allocated by tdp_mem_alloc", ptr);
        return;
    }
    atomic_fetch_add(&stat_frees[type], 1);
    atomic_fetch_sub(&stat_live[type], size);
}

void tdp_mem_stats_get(tdp_mem_stats *out)
{
    if (out == NULL)
        return;
    for (int i = 0; i < TDP_MEM_TYPE_COUNT; i++) {
        out->allocs[i] = atomic_load(&stat_allocs[i]);
        out->frees[i] = atomic_load(&stat_frees[i]);
        out->live_bytes[i] = atomic_load(&stat_live[i]);
    }
    out->small_allocs = atomic_load(&stat_small_allocs);
    out->small_frees = atomic_load(&stat_small_frees);
}

uint64_t tdp_mem_total_allocs(void)
{
    uint64_t n = atomic_load(&stat_small_allocs);
    for (int i = 0; i < TDP_MEM_TYPE_COUNT; i++)
        n += atomic_load(&stat_allocs[i]);
    return n;
}

tdp_err tdp__mem_copy(void *dst, bool dst_gpu, const void *src, bool src_gpu, size_t n)
{
    if (n == 0)
        return TDP_OK;
    if (!dst_gpu && !src_gpu) {
        memcpy(dst, src, n);
        return TDP_OK;
    }
    return tdp__cuda_memcpy(dst, src, n);
}

tdp_err tdp_mem_copy(void *dst, const void *src, size_t n)
{
    if (n == 0)
        return TDP_OK;
    if (dst == NULL || src == NULL)
        return TDP_EINVAL;
    /* without a device there is no device memory: skip the layer's lookups */
    if (tdp__cuda_device_count() == 0) {
        memmove(dst, src, n);
        return TDP_OK;
    }
    /* small, to the device: written by the device, not a copy engine (docs/gpu.md) */
    if (n <= TDP__CUDA_INLINE_MAX) {
        tdp_err rc = tdp__cuda_copy_small(dst, src, n);
        if (rc != TDP_ENOTSUP)
            return rc;
    }
    return tdp__cuda_memcpy(dst, src, n);
}

tdp_err tdp_mem_set(void *dst, int byte, size_t n)
{
    if (n == 0)
        return TDP_OK;
    if (dst == NULL)
        return TDP_EINVAL;
    tdp__cuda_ptr_info info = {TDP__CUDA_PTR_HOST, -1};
    if (tdp__cuda_device_count() > 0)
        (void)tdp__cuda_ptr_get_info(dst, &info);
    if (info.kind != TDP__CUDA_PTR_DEVICE) {
        memset(dst, byte, n);
        return TDP_OK;
    }
    return tdp__cuda_memset(dst, byte, n);
}

const char *tdp_cuda_describe(char *buf, size_t n)
{
    if (buf == NULL || n == 0)
        return "";
    return tdp__cuda_describe(buf, n);
}

/* ---- small objects ------------------------------------------------------ */

void *tdp__malloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p != NULL)
        atomic_fetch_add_explicit(&stat_small_allocs, 1, memory_order_relaxed);
    return p;
}

void *tdp__calloc(size_t count, size_t n)
{
    void *p = calloc(count ? count : 1, n ? n : 1);
    if (p != NULL)
        atomic_fetch_add_explicit(&stat_small_allocs, 1, memory_order_relaxed);
    return p;
}

void *tdp__realloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (q == NULL)
        return NULL;
    /* growing an object is an allocation too: count it as free + alloc */
    atomic_fetch_add_explicit(&stat_small_allocs, 1, memory_order_relaxed);
    if (p != NULL)
        atomic_fetch_add_explicit(&stat_small_frees, 1, memory_order_relaxed);
    return q;
}

char *tdp__strndup(const char *s, size_t n)
{
    char *p = tdp__malloc(n + 1);
    if (p != NULL) {
        memcpy(p, s, n);
        p[n] = '\0';
    }
    return p;
}

char *tdp__strdup(const char *s)
{
    return tdp__strndup(s, strlen(s));
}

void tdp__free(void *p)
{
    if (p == NULL)
        return;
    atomic_fetch_add_explicit(&stat_small_frees, 1, memory_order_relaxed);
    free(p);
}

/* ---- devices ------------------------------------------------------------- */

tdp_err tdp_device_parse(const char *s, tdp_device *out)
{
    if (s == NULL || out == NULL)
        return TDP_EINVAL;
    if (strcmp(s, "cpu") == 0) {
        *out = TDP_DEVICE_CPU_INIT;
        return TDP_OK;
    }
    if (strcmp(s, "cuda") == 0) {
        *out = (tdp_device){TDP_DEVICE_CUDA, 0};
        return TDP_OK;
    }
    if (strncmp(s, "cuda:", 5) != 0)
        return TDP_EINVAL;
    const char *d = s + 5;
    size_t n = strlen(d);
    if (n == 0 || n > 9)
        return TDP_EINVAL;
    int idx = 0;
    for (size_t i = 0; i < n; i++) {
        if (d[i] < '0' || d[i] > '9')
            return TDP_EINVAL;
        idx = idx * 10 + (d[i] - '0');
    }
    if (n > 1 && d[0] == '0')
        return TDP_EINVAL; /* one spelling per device keeps the hash canonical */
    *out = (tdp_device){TDP_DEVICE_CUDA, idx};
    return TDP_OK;
}

const char *tdp_device_format(tdp_device dev, char buf[TDP_DEVICE_STRLEN])
{
    if (dev.type == TDP_DEVICE_CUDA)
        snprintf(buf, TDP_DEVICE_STRLEN, "cuda:%d", dev.index);
    else
        snprintf(buf, TDP_DEVICE_STRLEN, "cpu");
    return buf;
}

bool tdp_device_equal(tdp_device a, tdp_device b)
{
    if (a.type != b.type)
        return false;
    return a.type == TDP_DEVICE_CPU || a.index == b.index;
}
