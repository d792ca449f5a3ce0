/*
 * cuda.h: the one interface through which the library makes CUDA calls.
 *
 * Three backends sit behind it, chosen once at first use:
 *   - the driver: libcuda.so.1 loaded at run time (never linked), so one
 *     build runs on machines with and without CUDA; without a driver or a
 *     GPU it reports no device;
 *   - the fake (TDPIPE_CUDA=fake[:N]): device memory that faults when host
 *     code touches it, copies that complete later on another thread, and
 *     injected faults, so CI sees what a GPU would do (docs/gpu.md);
 *   - none (TDPIPE_CUDA=off, or no driver): no device, every call that needs
 *     one returns TDP_ENOTSUP.
 *
 * Every function is thread-safe. Errors: TDP_ENOMEM when memory ran out,
 * TDP_ENOTSUP when there is no device or no driver, TDP_ECUDA for any other
 * failure (logged once, with the driver's own message).
 */
#ifndef TDP_CORE_CUDA_H
#define TDP_CORE_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <tdpipe/err.h>

typedef struct tdp__cuda_stream tdp__cuda_stream; /* FIFO of work on one device */
typedef struct tdp__cuda_event tdp__cuda_event;   /* a point in a stream */

typedef enum tdp__cuda_backend {
    TDP__CUDA_NONE = 0,
    TDP__CUDA_DRIVER = 1,
    TDP__CUDA_FAKE = 2,
} tdp__cuda_backend;

/* The backend in use (selected on the first call of any function here). */
tdp__cuda_backend tdp__cuda_backend_get(void);

/*
 * One line for humans: "driver loaded, 1 device", "fake, 2 devices",
 * "no CUDA device (libcuda.so.1 not found)". Returns buf.
 */
const char *tdp__cuda_describe(char *buf, size_t n);

/*
 * Select a backend now, as TDPIPE_CUDA would: "driver", "fake", "fake:N",
 * "off". For tests; call it before any memory is allocated through the
 * layer (memory of the previous backend is not carried over).
 */
tdp_err tdp__cuda_select(const char *spec);

/*
 * Call statistics (TDPIPE_CUDA_STATS=1, printed to stderr at exit):
 * enable or disable them, reset them, and format the k-th kind of call
 * (false where k is out of range or had no call).
 */
void tdp__cuda_stats_enable(bool on);
void tdp__cuda_stats_reset(void);
bool tdp__cuda_stats_line(int k, char *buf, size_t n);

/* Devices usable now; 0 for none. Never fails. */
int tdp__cuda_device_count(void);

/* The device's UUID (as nvidia-smi prints it, 16 raw bytes). */
tdp_err tdp__cuda_device_uuid(int dev, uint8_t uuid[16]);

/*
 * Make `dev`'s primary context (the one cudart and PyTorch use) current on
 * the calling thread, starting it on first use: call it at connect time so
 * the first send does not pay for it.
 */
tdp_err tdp__cuda_ctx_set(int dev);

/* Device memory on `dev`, at least 256-byte aligned; size 0 allowed. */
tdp_err tdp__cuda_malloc(int dev, size_t size, void **out);
void tdp__cuda_free(void *dptr);

/* Page-locked host memory, page aligned, usable by every device. */
tdp_err tdp__cuda_host_alloc(size_t size, void **out);
void tdp__cuda_host_free(void *p);

/* Page-lock an existing host range (any mapping, a shared one included). */
tdp_err tdp__cuda_host_register(void *p, size_t size);
tdp_err tdp__cuda_host_unregister(void *p);

/*
 * A host range page-locked for as long as a pool lives, at once (now) or
 * on a thread of its own, for memory a message may need before the driver
 * is done pinning it (cuMemHostRegister of 800 MB took 449 ms on an H200):
 * copies that touch it meanwhile go at pageable speed. tdp__cuda_pin_new
 * returns the error of a registration made at once (now, or where no
 * thread could start); tdp__cuda_pin_wait waits for it to land;
 * tdp__cuda_pin_end waits, undoes a registration that landed and frees
 * the pin (before the memory goes). Both take NULL. One thread at a time
 * per pin.
 */
typedef struct tdp__cuda_pin tdp__cuda_pin;
tdp_err tdp__cuda_pin_new(void *p, size_t size, bool now, tdp__cuda_pin **out);
void tdp__cuda_pin_wait(tdp__cuda_pin *r);
void tdp__cuda_pin_end(tdp__cuda_pin *r);
/* Pins that have landed in this process so far, and those still running
 * on their threads (tests, stats). */
uint64_t tdp__cuda_pins_landed(void);
uint64_t tdp__cuda_pins_running(void);

/* Streams: work queued on one completes in order. */
tdp_err tdp__cuda_stream_create(int dev, tdp__cuda_stream **out);
void tdp__cuda_stream_destroy(tdp__cuda_stream *s); /* waits for its work */
tdp_err tdp__cuda_stream_sync(tdp__cuda_stream *s);

/*
 * Queue a copy of n bytes in any direction (host or device on either side,
 * as cudaMemcpyDefault). Host memory must stay valid until the stream has
 * passed the copy; with pageable host memory the driver may copy before
 * returning.
 */
tdp_err tdp__cuda_memcpy_async(void *dst, const void *src, size_t n, tdp__cuda_stream *s);

/*
 * Write the n bytes at src (host memory, read during the call) to dst
 * (device memory) in s's order, by the device's front end rather than a
 * copy engine: 32- and 64-bit write-value operations in one batch
 * (cuStreamBatchMemOp). For small host-to-device writes: on one GPU,
 * copy-engine writes that alternate between two processes cost ~140 us
 * each (an H200, docs/gpu.md), these do not. dst and n must be multiples
 * of 4, n at most TDP__CUDA_INLINE_MAX (TDP_EINVAL otherwise).
 * TDP_ENOTSUP where the device or backend cannot: copy instead.
 */
#define TDP__CUDA_INLINE_MAX 2032u
tdp_err tdp__cuda_write_inline(void *dst, const void *src, size_t n, tdp__cuda_stream *s);

/*
 * Whether small host-to-device writes go as tdp__cuda_write_inline: on
 * unless TDPIPE_CUDA_INLINE=0, off once a device could not; set for tests.
 */
bool tdp__cuda_inline_enabled(void);
void tdp__cuda_inline_set(bool on);

/*
 * Whether a copy of n bytes from src to dst goes as the device's own
 * writes: inline writes on, n and dst fit (tdp__cuda_inline_fits), dst in
 * device memory and src not; *dev (may be NULL) is dst's device then. Two
 * pointer lookups.
 */
bool tdp__cuda_inline_h2d(const void *dst, const void *src, size_t n, int *dev);

/*
 * A synchronous copy of n bytes from host to device memory as the device's
 * own writes, on a stream of the layer's, after the default stream's work:
 * TDP_OK once they landed; TDP_ENOTSUP where it does not apply (not host
 * to device, too big, unaligned, inline writes off): copy instead.
 */
tdp_err tdp__cuda_copy_small(void *dst, const void *src, size_t n);

/* Whether a copy of n bytes to dst could go as tdp__cuda_write_inline (size and alignment). */
static inline bool tdp__cuda_inline_fits(const void *dst, size_t n)
{
    return n > 0 && n <= TDP__CUDA_INLINE_MAX && n % 4 == 0 && ((uintptr_t)dst & 3u) == 0;
}

/* A copy or fill that has finished when the call returns. */
tdp_err tdp__cuda_memcpy(void *dst, const void *src, size_t n);
tdp_err tdp__cuda_memset(void *dptr, int byte, size_t n);

/*
 * Run fn(arg) once the stream's earlier work is done, on a thread of the
 * driver's (never the caller's). fn must not call into CUDA: it should only
 * signal (e.g. write an eventfd the loop watches).
 */
tdp_err tdp__cuda_launch_host_func(tdp__cuda_stream *s, void (*fn)(void *), void *arg);

/* Events: record marks the stream's position; query says if it was passed. */
tdp_err tdp__cuda_event_create(int dev, tdp__cuda_event **out);
void tdp__cuda_event_destroy(tdp__cuda_event *e);
tdp_err tdp__cuda_event_record(tdp__cuda_event *e, tdp__cuda_stream *s);
/* TDP_OK when done (or never recorded), TDP_EAGAIN while pending. */
tdp_err tdp__cuda_event_query(tdp__cuda_event *e);
tdp_err tdp__cuda_event_sync(tdp__cuda_event *e);
/* Later work on s waits for e (the host does not). */
tdp_err tdp__cuda_stream_wait_event(tdp__cuda_stream *s, tdp__cuda_event *e);

typedef enum tdp__cuda_mem_kind {
    TDP__CUDA_PTR_HOST = 0,   /* plain (pageable) host memory, or unknown */
    TDP__CUDA_PTR_PINNED = 1, /* page-locked or registered host memory */
    TDP__CUDA_PTR_DEVICE = 2, /* device memory */
} tdp__cuda_mem_kind;

typedef struct tdp__cuda_ptr_info {
    tdp__cuda_mem_kind kind;
    int device; /* for TDP__CUDA_PTR_DEVICE; -1 otherwise */
} tdp__cuda_ptr_info;

/* What p points into. Never fails for a host pointer; TDP_OK or TDP_ECUDA. */
tdp_err tdp__cuda_ptr_get_info(const void *p, tdp__cuda_ptr_info *out);

/*
 * Device memory another process can map. tdp__cuda_malloc_shared allocates
 * memory that can be exported (a VMM allocation with a POSIX fd handle
 * where the device supports it, else ordinary memory and a legacy IPC
 * handle); free it with tdp__cuda_free. Export fills a handle to send over
 * a UNIX socket (fd >= 0 must travel as SCM_RIGHTS; the caller owns it);
 * import maps it in this process; close unmaps it. Import takes its own
 * reference: the caller still closes h->fd.
 */
typedef struct tdp__cuda_ipc {
    int fd;             /* POSIX fd of the allocation, or -1 for legacy */
    uint64_t size;      /* bytes mapped by import */
    uint8_t legacy[64]; /* cuIpcMemHandle when fd is -1 */
} tdp__cuda_ipc;

tdp_err tdp__cuda_malloc_shared(int dev, size_t size, void **out);
tdp_err tdp__cuda_export(void *dptr, tdp__cuda_ipc *out);
tdp_err tdp__cuda_import(int dev, const tdp__cuda_ipc *h, void **out);
void tdp__cuda_import_close(void *dptr);

/* ---- the fake's fault injection (also from env, see docs/gpu.md) -------- */

typedef enum tdp__cuda_fault {
    TDP__CUDA_FAULT_OOM_AT = 0,            /* the Nth allocation fails: TDP_ENOMEM */
    TDP__CUDA_FAULT_COPY_FAIL_AT = 1,      /* the Nth copy fails: TDP_ECUDA */
    TDP__CUDA_FAULT_KILL_AFTER_COPY = 2,   /* SIGKILL once the Nth copy completed */
    TDP__CUDA_FAULT_INLINE_REFUSED_AT = 3, /* the Nth device write is refused: TDP_ENOTSUP */
    TDP__CUDA_FAULT_COUNT = 4,
} tdp__cuda_fault;

/*
 * Arm a fault for the Nth call from now (1 = the next one); 0 disarms.
 * Only the fake honours it.
 */
void tdp__cuda_fake_inject(tdp__cuda_fault f, unsigned n);

/* Delay of each fake copy, in microseconds (TDPIPE_FAKE_CUDA_DELAY_US). */
void tdp__cuda_fake_set_delay_us(unsigned us);
/* Fake: each host registration or pinned allocation takes this long (ms), as
 * cuMemHostRegister / cuMemHostAlloc of hundreds of MB do. */
void tdp__cuda_fake_set_register_ms(unsigned ms);

/* Tests: n bytes at fake device address p as they are now, without waiting
 * for any stream (TDP_ECUDA when p is not the fake's device memory). */
tdp_err tdp__cuda_fake_peek(const void *p, void *out, size_t n);

#endif /* TDP_CORE_CUDA_H */
