/*
 * stage.h (internal): the staging engine. A plane that moves GPU payloads
 * through host memory (the shm plane's slots, the ucx plane's bounce
 * buffers) copies them here: one CUDA stream per link, copies cut into
 * chunks with a bounded number in flight, and the loop thread told of each
 * finished chunk by an eventfd that a host function queued behind the chunk
 * writes (a small chunk on an idle stream is polled for, briefly: stage.c).
 * Nothing blocks the loop for a copy beyond that poll, and
 * nothing is allocated per copy once the stage exists.
 *
 * Threads: every function runs on the loop's thread (or while nobody runs
 * the loop); callbacks run on the loop's thread, never from inside the call
 * that started or extended a copy.
 */
#ifndef TDP_PIPE_STAGE_H
#define TDP_PIPE_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <tdpipe/err.h>
#include <tdpipe/loop.h>

#include "../core/cuda.h"

typedef struct tdp__stage tdp__stage;
typedef struct tdp__stage_copy tdp__stage_copy;

/*
 * The copy is over: every byte landed (TDP_OK), or a chunk could not be
 * queued (TDP_ECUDA, TDP_ENOMEM; the bytes of dst are then undefined). The
 * stage is done with c, which the callback may reuse or free.
 */
typedef void (*tdp__stage_done_fn)(tdp__stage_copy *c, tdp_err status);

/* Bytes [0, landed) of dst hold their final value (called as chunks land). */
typedef void (*tdp__stage_progress_fn)(tdp__stage_copy *c, size_t landed);

/*
 * One copy, embedded in the caller's own object (a send, a receive slot):
 * fill done, progress and arg, then start it. The rest is the stage's.
 */
struct tdp__stage_copy {
    tdp__stage_done_fn done;
    tdp__stage_progress_fn progress; /* NULL: not told */
    void *arg;
    /* the stage's */
    char *dst;
    const char *src;
    size_t n, avail, issued, landed, reported, chunk;
    unsigned max_inflight, inflight;
    tdp_err status;
    bool active;
    bool inline_h2d; /* host to device, small: written by the device, no copy engine */
    tdp__stage_copy *next;
};

/* Chunks in flight on one stage, across its copies, at most. */
enum { TDP__STAGE_MAX_INFLIGHT = 64 };

/*
 * A stage on `loop` for device `dev`: makes the device's context current,
 * creates the stream and the wake event. max_inflight: chunks in flight
 * across all copies (1..TDP__STAGE_MAX_INFLIGHT; 0 = the maximum). Errors:
 * TDP_ENOTSUP (no such device), TDP_ECUDA, TDP_ENOMEM, TDP_EINVAL.
 * *out is written only on success.
 */
tdp_err tdp__stage_new(tdp_loop *loop, int dev, unsigned max_inflight, tdp__stage **out);

/*
 * Cancel every copy (no callback runs, now or later), wait for the stream
 * to pass what was queued, and free the stage. NULL is a no-op.
 */
void tdp__stage_free(tdp__stage *st);

/*
 * Copy n bytes from src to dst (host or device on either side) in chunks
 * of `chunk` bytes (0: one chunk), at most max_inflight chunks of this copy
 * queued at once (0: no limit but the stage's). avail: bytes of src that
 * may be copied now (n: all); tdp__stage_copy_avail raises it, so a copy
 * can follow a producer chunk by chunk. Copies finish in the order they
 * were started: a later copy queues nothing until the earlier ones have
 * queued all their bytes, and its done runs after theirs. Both buffers
 * must stay valid until done runs or the copy is cancelled. Returns
 * TDP_EINVAL (bad arguments, c already active) without starting; otherwise
 * TDP_OK and done will run, failures included.
 */
tdp_err tdp__stage_copy_start(tdp__stage *st, tdp__stage_copy *c, void *dst, const void *src,
                              size_t n, size_t avail, size_t chunk, unsigned max_inflight);

/* More of src is ready: bytes [0, avail) may be copied (capped at n). */
void tdp__stage_copy_avail(tdp__stage *st, tdp__stage_copy *c, size_t avail);

/*
 * Forget c: its callbacks never run. When chunks of it are still queued
 * this waits for the stream to pass them, so dst and src may be freed or
 * unmapped on return (a close path, not a per-message one). Not active: a
 * no-op. Safe inside any of the stage's callbacks.
 */
void tdp__stage_copy_cancel(tdp__stage *st, tdp__stage_copy *c);

/*
 * How long a small chunk queued on an idle stream is polled for before it
 * gets a host function (default 40 us; 0: never polled). For tests.
 */
void tdp__stage_set_spin_ns(tdp__stage *st, uint64_t ns);
/*
 * Whether small host-to-device copies (at most TDP__CUDA_INLINE_MAX bytes)
 * go as the device's own writes (tdp__cuda_write_inline; default on, off
 * by itself where the device cannot) rather than through a copy engine.
 * For tests and measurements.
 */
void tdp__stage_set_inline(tdp__stage *st, bool on);
/* The stage's stream (for an event or a wait ordered after its copies). */
tdp__cuda_stream *tdp__stage_stream(const tdp__stage *st);
int tdp__stage_device(const tdp__stage *st);

/*
 * Host memory a link stages GPU payloads through (its bounces): page
 * aligned, page-locked at once (now: a prepare, off the messages' path) or
 * on a thread of its own (made by a layout's first message, whose copies
 * meanwhile go at pageable speed rather than wait: page-locking hundreds
 * of MB takes hundreds of ms). *pin NULL where it could not be pinned:
 * the memory works, copies at pageable speed. Freed with
 * tdp__stage_host_free (waits for the pin first).
 */
tdp_err tdp__stage_host_alloc(size_t size, bool now, void **p, tdp__cuda_pin **pin);
void tdp__stage_host_free(void *p, tdp__cuda_pin *pin);

/* Chunks queued now, and the most ever queued at once. */
unsigned tdp__stage_inflight(const tdp__stage *st);
unsigned tdp__stage_inflight_max(const tdp__stage *st);

#endif /* TDP_PIPE_STAGE_H */
