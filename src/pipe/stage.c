/*
 * stage.c: chunked host<->device copies on one stream per link, completed
 * on the loop thread.
 *
 * Each chunk is a memcpy_async followed by a host function that counts the
 * chunk finished and writes an eventfd; the stream runs its work in order,
 * so the count alone says which chunks finished (the ring keeps what each
 * one was). The eventfd's libevent event runs dispatch, which settles
 * finished chunks, queues more, and runs callbacks with the stage in a
 * consistent state (a callback may start, extend or cancel any copy).
 *
 * A small chunk queued on an idle stream is polled for instead: an event
 * recorded behind it is queried on the loop thread for up to SPIN_NS, and
 * when it has passed the chunk is counted finished and the eventfd written
 * here. A host function reaches the loop 26-44 us after a 1 KB copy on an
 * H100 where the copy itself takes 6-7 us (tdp_gpu_copy --lat); the poll
 * bounds what the loop gives up to that. A chunk not done in time gets its
 * host function as any other.
 *
 * A small copy from host to device memory is not given to a copy engine:
 * its bytes go as the device's own write-value operations
 * (tdp__cuda_write_inline). On one GPU, small copy-engine writes that
 * alternate between two processes, as a staged ping-pong's copy-ins do,
 * took ~140 us each on an H200; written by the device they do not wait
 * for the other process (docs/gpu.md).
 */
#include "stage.h"

#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <event2/event.h>
#include <tdpipe/mem.h>

#include "../core/alloc.h"
#include "../core/log.h"
#include "../core/loop_int.h"

typedef struct stage_chunk {
    tdp__stage_copy *c; /* NULL once the copy was cancelled */
    size_t end;         /* bytes of c landed when this chunk has */
} stage_chunk;

/* Polled chunks: at most this big, and polled for at most this long. */
#define SPIN_BYTES (256u << 10)
#define SPIN_NS    40000u

struct tdp__stage {
    tdp_loop *loop;
    int dev;
    tdp__cuda_stream *stream;
    tdp__cuda_event *spin_ev; /* NULL: every chunk gets a host function */
    uint64_t spin_ns;         /* SPIN_NS; 0: no polling */
    bool inline_ok;           /* small host-to-device copies written by the device */
    int efd;
    struct event *ev;
    unsigned cap;
    stage_chunk ring[TDP__STAGE_MAX_INFLIGHT];
    uint64_t issued;              /* chunks queued (loop thread) */
    uint64_t settled;             /* chunks settled by dispatch (loop thread) */
    _Atomic uint64_t finished;    /* chunks the stream passed (host functions) */
    tdp__stage_copy *head, *tail; /* active copies, in start order */
    unsigned inflight_max;
};

/* On the driver's thread: only count and wake (no CUDA call allowed). */
static void chunk_finished(void *arg)
{
    tdp__stage *st = arg;
    atomic_fetch_add_explicit(&st->finished, 1, memory_order_release);
    uint64_t one = 1;
    ssize_t w;
    do {
        w = write(st->efd, &one, sizeof(one));
    } while (w < 0 && errno == EINTR);
}

/* Dispatch will run soon even if no chunk finishes (a failure to report). */
static void self_wake(tdp__stage *st)
{
    uint64_t one = 1;
    ssize_t w;
    do {
        w = write(st->efd, &one, sizeof(one));
    } while (w < 0 && errno == EINTR);
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Whether the stream passed its last chunk within SPIN_NS (polled). */
static bool spin_done(tdp__stage *st)
{
    if (tdp__cuda_event_record(st->spin_ev, st->stream) != TDP_OK)
        return false;
    uint64_t t0 = mono_ns();
    for (;;) {
        tdp_err rc = tdp__cuda_event_query(st->spin_ev);
        if (rc != TDP_EAGAIN)
            return rc == TDP_OK;
        if (mono_ns() - t0 >= st->spin_ns)
            return false;
    }
}

/* Queue one chunk of c; false when it could not be (c->status says why). */
static bool issue_chunk(tdp__stage *st, tdp__stage_copy *c)
{
    size_t len = c->avail - c->issued;
    if (c->chunk > 0 && len > c->chunk)
        len = c->chunk;
    /* nothing queued before it: its end is the event's */
    bool idle = st->spin_ev != NULL && st->spin_ns > 0 && len <= SPIN_BYTES &&
                atomic_load_explicit(&st->finished, memory_order_acquire) == st->issued;
    tdp_err rc = TDP_ENOTSUP;
    if (c->inline_h2d && st->inline_ok && tdp__cuda_inline_fits(c->dst + c->issued, len)) {
        rc = tdp__cuda_write_inline(c->dst + c->issued, c->src + c->issued, len, st->stream);
        if (rc == TDP_ENOTSUP)
            st->inline_ok = false; /* the device cannot: copies from now on */
    }
    if (rc == TDP_ENOTSUP)
        rc = tdp__cuda_memcpy_async(c->dst + c->issued, c->src + c->issued, len, st->stream);
    if (rc != TDP_OK) {
        c->status = rc;
        self_wake(st);
        return false;
    }
    stage_chunk *k = &st->ring[st->issued % TDP__STAGE_MAX_INFLIGHT];
    k->c = c;
    k->end = c->issued + len;
    st->issued++;
    c->issued += len;
    c->inflight++;
    unsigned now = (unsigned)(st->issued - st->settled);
    if (now > st->inflight_max)
        st->inflight_max = now;
    if (idle && spin_done(st)) {
        /* what its host function would have done; no other is pending */
        chunk_finished(st);
        return true;
    }
    rc = tdp__cuda_launch_host_func(st->stream, chunk_finished, st);
    if (rc != TDP_OK) {
        /* Rare: nothing will count this chunk, so wait it out here. */
        (void)tdp__cuda_stream_sync(st->stream);
        atomic_fetch_add_explicit(&st->finished, 1, memory_order_release);
        c->status = rc;
        self_wake(st);
        return false;
    }
    return true;
}

/* Queue what may be queued, copies in start order. */
static void pump(tdp__stage *st)
{
    for (tdp__stage_copy *c = st->head; c != NULL; c = c->next) {
        while (c->status == TDP_OK && c->issued < c->avail &&
               (c->max_inflight == 0 || c->inflight < c->max_inflight) &&
               st->issued - st->settled < st->cap) {
            if (!issue_chunk(st, c))
                break;
        }
        if (c->status == TDP_OK && c->issued < c->n)
            return; /* a later copy must not overtake this one */
    }
}

static void unlink_copy(tdp__stage *st, tdp__stage_copy *c)
{
    tdp__stage_copy **pp = &st->head;
    tdp__stage_copy *prev = NULL;
    while (*pp != NULL && *pp != c) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (*pp == NULL)
        return;
    *pp = c->next;
    if (st->tail == c)
        st->tail = prev;
    c->next = NULL;
    c->active = false;
}

/* Settle the chunks the stream has passed. */
static void settle(tdp__stage *st)
{
    uint64_t fin = atomic_load_explicit(&st->finished, memory_order_acquire);
    while (st->settled < fin) {
        stage_chunk *k = &st->ring[st->settled % TDP__STAGE_MAX_INFLIGHT];
        st->settled++;
        if (k->c != NULL) {
            k->c->inflight--;
            k->c->landed = k->end;
            k->c = NULL;
        }
    }
}

/* Callbacks of the head copy, in order; re-read after each (they may change the list). */
static void deliver(tdp__stage *st)
{
    tdp__stage_copy *c;
    while ((c = st->head) != NULL) {
        if (c->status == TDP_OK && c->landed > c->reported && c->progress != NULL) {
            c->reported = c->landed;
            c->progress(c, c->landed);
            continue;
        }
        c->reported = c->landed;
        bool over = c->inflight == 0 && (c->status != TDP_OK || c->landed == c->n);
        if (!over)
            return;
        unlink_copy(st, c);
        c->done(c, c->status);
    }
}

static void dispatch(tdp__stage *st)
{
    settle(st);
    pump(st);
    deliver(st);
    pump(st); /* callbacks may have started or extended copies */
    tdp__loop_kick(st->loop);
}

static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    uint64_t v;
    while (read(fd, &v, sizeof(v)) < 0 && errno == EINTR)
        ;
    dispatch(arg);
}

tdp_err tdp__stage_new(tdp_loop *loop, int dev, unsigned max_inflight, tdp__stage **out)
{
    if (loop == NULL || out == NULL || dev < 0 || max_inflight > TDP__STAGE_MAX_INFLIGHT)
        return TDP_EINVAL;
    if (dev >= tdp__cuda_device_count())
        return TDP_ENOTSUP;
    tdp_err rc = tdp__cuda_ctx_set(dev);
    if (rc != TDP_OK)
        return rc;
    tdp__stage *st = tdp__calloc(1, sizeof(*st));
    if (st == NULL)
        return TDP_ENOMEM;
    st->loop = loop;
    st->dev = dev;
    st->cap = max_inflight == 0 ? TDP__STAGE_MAX_INFLIGHT : max_inflight;
    st->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (st->efd < 0) {
        tdp_log_error("staging: eventfd: %s", strerror(errno));
        rc = TDP_ENOMEM;
        goto err_free;
    }
    rc = tdp__cuda_stream_create(dev, &st->stream);
    if (rc != TDP_OK)
        goto err_close_efd;
    if (tdp__cuda_event_create(dev, &st->spin_ev) != TDP_OK)
        st->spin_ev = NULL; /* host functions alone */
    st->spin_ns = SPIN_NS;
    st->inline_ok = tdp__cuda_inline_enabled();
    st->ev = event_new(tdp__loop_base(loop), st->efd, EV_READ | EV_PERSIST, on_wake, st);
    if (st->ev == NULL || event_add(st->ev, NULL) != 0) {
        rc = TDP_ENOMEM;
        goto err_destroy_stream;
    }
    *out = st;
    return TDP_OK;

err_destroy_stream:
    if (st->ev != NULL)
        event_free(st->ev);
    if (st->spin_ev != NULL)
        tdp__cuda_event_destroy(st->spin_ev);
    tdp__cuda_stream_destroy(st->stream);
err_close_efd:
    close(st->efd);
err_free:
    tdp__free(st);
    return rc;
}

void tdp__stage_free(tdp__stage *st)
{
    if (st == NULL)
        return;
    while (st->head != NULL)
        unlink_copy(st, st->head);
    /* waits for every queued chunk and host function: none runs after this */
    tdp__cuda_stream_destroy(st->stream);
    if (st->spin_ev != NULL)
        tdp__cuda_event_destroy(st->spin_ev);
    event_free(st->ev);
    close(st->efd);
    tdp__free(st);
}

tdp_err tdp__stage_copy_start(tdp__stage *st, tdp__stage_copy *c, void *dst, const void *src,
                              size_t n, size_t avail, size_t chunk, unsigned max_inflight)
{
    if (st == NULL || c == NULL || c->done == NULL || c->active ||
        (n > 0 && (dst == NULL || src == NULL)))
        return TDP_EINVAL;
    c->dst = dst;
    c->src = src;
    c->n = n;
    c->avail = avail < n ? avail : n;
    c->issued = c->landed = c->reported = 0;
    c->chunk = chunk;
    c->max_inflight = max_inflight;
    c->inflight = 0;
    c->status = TDP_OK;
    c->active = true;
    c->next = NULL;
    /* small and host to device: two pointer lookups, where a copy engine would cost more */
    c->inline_h2d = st->inline_ok && tdp__cuda_inline_h2d(dst, src, n, NULL);
    if (st->tail != NULL)
        st->tail->next = c;
    else
        st->head = c;
    st->tail = c;
    if (n == 0)
        self_wake(st); /* done runs from the loop, never inside this call */
    pump(st);
    return TDP_OK;
}

void tdp__stage_copy_avail(tdp__stage *st, tdp__stage_copy *c, size_t avail)
{
    if (!c->active || avail <= c->avail)
        return;
    c->avail = avail < c->n ? avail : c->n;
    pump(st);
}

void tdp__stage_copy_cancel(tdp__stage *st, tdp__stage_copy *c)
{
    if (st == NULL || c == NULL || !c->active)
        return;
    bool queued = c->inflight > 0;
    for (uint64_t i = st->settled; i < st->issued; i++) {
        stage_chunk *k = &st->ring[i % TDP__STAGE_MAX_INFLIGHT];
        if (k->c == c)
            k->c = NULL;
    }
    unlink_copy(st, c);
    c->inflight = 0;
    if (queued)
        (void)tdp__cuda_stream_sync(st->stream);
    pump(st); /* copies behind c may go now */
}

void tdp__stage_set_inline(tdp__stage *st, bool on)
{
    st->inline_ok = on;
}

void tdp__stage_set_spin_ns(tdp__stage *st, uint64_t ns)
{
    st->spin_ns = ns;
}

tdp__cuda_stream *tdp__stage_stream(const tdp__stage *st)
{
    return st->stream;
}

int tdp__stage_device(const tdp__stage *st)
{
    return st->dev;
}

unsigned tdp__stage_inflight(const tdp__stage *st)
{
    return (unsigned)(st->issued - atomic_load(&((tdp__stage *)st)->finished));
}

unsigned tdp__stage_inflight_max(const tdp__stage *st)
{
    return st->inflight_max;
}

tdp_err tdp__stage_host_alloc(size_t size, bool now, void **p, tdp__cuda_pin **pin)
{
    *pin = NULL;
    if (size == 0)
        size = 1;
    tdp_err rc = tdp_mem_alloc(TDP_MEM_HOST, 0, size, 4096, p);
    if (rc != TDP_OK)
        return rc;
    if ((rc = tdp__cuda_pin_new(*p, size, now, pin)) != TDP_OK)
        tdp_log_debug("stage: a %zu-byte bounce not page-locked (%s): its copies go at pageable "
                      "speed",
                      size, tdp_strerror(rc));
    return TDP_OK;
}

void tdp__stage_host_free(void *p, tdp__cuda_pin *pin)
{
    tdp__cuda_pin_end(pin); /* before the memory goes */
    tdp_mem_free(TDP_MEM_HOST, p);
}
