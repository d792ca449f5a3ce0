/*
 * mem.h: devices and memory allocation (host, pinned host, CUDA device).
 *
 * Every allocation the library makes goes through these helpers or the
 * internal small-object allocator, and each is counted. Tests read the
 * counters to prove that a steady-state path allocates nothing.
 */
#ifndef TDPIPE_MEM_H
#define TDPIPE_MEM_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where a buffer lives. */
typedef enum tdp_device_type {
    TDP_DEVICE_CPU = 0,
    TDP_DEVICE_CUDA = 1,
} tdp_device_type;

typedef struct tdp_device {
    tdp_device_type type;
    int index; /* CUDA ordinal; 0 for CPU */
} tdp_device;

#define TDP_DEVICE_CPU_INIT ((tdp_device){TDP_DEVICE_CPU, 0})

/* Longest device string tdp_device_format writes, NUL included ("cuda:2147483647"). */
#define TDP_DEVICE_STRLEN 24

/*
 * Parse "cpu" or "cuda:N" (N a non-negative decimal, at most 9 digits) as
 * PyTorch prints them; "cuda" alone means "cuda:0". Returns TDP_EINVAL for
 * anything else; *out is written only on success.
 */
TDP_API tdp_err tdp_device_parse(const char *s, tdp_device *out);

/* Write the canonical name ("cpu", "cuda:0") into buf; returns buf. */
TDP_API const char *tdp_device_format(tdp_device dev, char buf[TDP_DEVICE_STRLEN]);

/* True when both name the same device. */
TDP_API bool tdp_device_equal(tdp_device a, tdp_device b);

/* Kinds of memory the helpers allocate. */
typedef enum tdp_mem_type {
    TDP_MEM_HOST = 0,        /* pageable host memory, aligned */
    TDP_MEM_HOST_PINNED = 1, /* page-locked host memory (cuMemHostAlloc); needs a device */
    TDP_MEM_CUDA = 2,        /* device memory (cuMemAlloc) on one GPU; needs a device */
    TDP_MEM_TYPE_COUNT = 3,
} tdp_mem_type;

/*
 * Allocate `size` bytes aligned to `align` (a power of two; 0 means the
 * default: TDP_BUFFER_ALIGN, or TDP_CUDA_ALIGN for TDP_MEM_CUDA). size 0
 * returns a valid unique pointer.
 * For TDP_MEM_CUDA, `device` selects the GPU; it is ignored otherwise.
 * Returns TDP_ENOTSUP for CUDA kinds when no device is present (see
 * tdp_cuda_device_count), TDP_ECUDA when the runtime fails, TDP_ENOMEM on
 * exhaustion. CUDA allocations are at least 256-byte aligned; a larger
 * `align` than the runtime guarantees gives TDP_EINVAL.
 */
TDP_API tdp_err tdp_mem_alloc(tdp_mem_type type, int device, size_t size, size_t align, void **out);

/* Free memory from tdp_mem_alloc with the same type. NULL is a no-op. */
TDP_API void tdp_mem_free(tdp_mem_type type, void *ptr);

/* Default alignment of host (and pinned) buffers from tdp_mem_alloc: one page. */
#define TDP_BUFFER_ALIGN 4096u

/* Alignment cudaMalloc guarantees, the default (and the most) for TDP_MEM_CUDA. */
#define TDP_CUDA_ALIGN 256u

/*
 * Allocation counters, cumulative since process start. `allocs` and `frees`
 * count calls that succeeded; `live_bytes` is what is held now. The
 * `small_*` fields count the library's internal small-object allocations
 * (schema nodes, frames, requests).
 */
typedef struct tdp_mem_stats {
    uint64_t allocs[TDP_MEM_TYPE_COUNT];
    uint64_t frees[TDP_MEM_TYPE_COUNT];
    uint64_t live_bytes[TDP_MEM_TYPE_COUNT];
    uint64_t small_allocs;
    uint64_t small_frees;
} tdp_mem_stats;

/* Snapshot the counters (each field read atomically). Thread-safe. */
TDP_API void tdp_mem_stats_get(tdp_mem_stats *out);

/* Total allocations of every kind: handy for "no allocation happened" checks. */
TDP_API uint64_t tdp_mem_total_allocs(void);

/*
 * Copy n bytes between any two buffers: host, pinned host or device memory,
 * either way (as cudaMemcpyDefault). Synchronous: the bytes are in place when
 * it returns, for every stream and process (the driver's own copy may return
 * before they reach the device; this waits for them), so a loaned slot or a
 * device buffer filled with it may be sent at once. A small copy from host
 * to device memory (at most 2032 bytes, address and size multiples of 4)
 * is written by the device itself rather than a copy engine, on a stream
 * of the library's, after the work of the default stream: on one GPU such
 * writes do not wait for another process's copies (docs/gpu.md);
 * TDPIPE_CUDA_INLINE=0 makes it a copy. Work the application queued on its
 * own streams must be finished first, as for a send. TDP_ECUDA when the
 * driver fails, TDP_EINVAL for NULL.
 */
TDP_API tdp_err tdp_mem_copy(void *dst, const void *src, size_t n);

/* Set n bytes of host or device memory to `byte`; synchronous, as tdp_mem_copy. */
TDP_API tdp_err tdp_mem_set(void *dst, int byte, size_t n);

/*
 * CUDA is never linked: the library loads the driver (libcuda.so.1) at run
 * time, so the same build runs with and without a GPU. The environment
 * variable TDPIPE_CUDA picks what stands behind the CUDA kinds above, once,
 * at first use: unset or "driver" for the driver, "fake" or "fake:N" for a
 * fake device for tests (docs/gpu.md), "off" for none.
 */

/* True when the driver backend is compiled in (the build found cuda.h). */
TDP_API bool tdp_cuda_built(void);

/*
 * Number of CUDA devices usable now: the driver's GPUs, the fake's devices,
 * or 0 (no driver, no GPU, TDPIPE_CUDA=off, or built without the driver
 * backend and no fake selected). Never fails.
 */
TDP_API int tdp_cuda_device_count(void);

/*
 * One line on the backend in use, into buf (n bytes, truncated to fit):
 * "driver loaded, 1 device", "fake, 2 devices", "no CUDA device
 * (libcuda.so.1 not found)". Returns buf.
 */
TDP_API const char *tdp_cuda_describe(char *buf, size_t n);

/*
 * One line on huge pages for large host buffers (tdp_mem_alloc of 8 MiB and
 * more, docs/pipe.md "Preparing a layout"), into buf (n bytes, truncated
 * to fit): whether they are asked for and why not, e.g. "asked for when
 * 2 MiB blocks are free (1200 now)", "not asked for: a virtio balloon
 * reports free pages to its host", "not asked for: TDPIPE_HUGE_PAGES=0".
 * Returns buf.
 */
TDP_API const char *tdp_mem_huge_describe(char *buf, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_MEM_H */
