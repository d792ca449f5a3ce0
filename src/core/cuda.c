/* cuda.c: picks the CUDA backend once and forwards every call to it. */
#include "cuda.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tdpipe/mem.h>
#include <time.h>
#include <unistd.h>

#include "cuda_int.h"
#include "log.h"

/*
 * The backend and its device count. Written under sel_lock, read without:
 * `active` is published with release order once the backend is ready.
 */
static pthread_mutex_t sel_lock = PTHREAD_MUTEX_INITIALIZER;
static const tdp__cuda_ops *_Atomic active;
static _Atomic int ndevices;
static _Atomic tdp__cuda_backend backend_kind;
static const char *_Atomic none_why = "not selected";

/* Backend of nothing: no device, every call TDP_ENOTSUP. */
static int none_init(unsigned ndev, const char **why)
{
    (void)ndev;
    (void)why;
    return 0;
}
static const tdp__cuda_ops none_ops = {.name = "none", .init = none_init};

/* Parse "driver" | "fake" | "fake:N" | "off"; sel_lock held. */
static tdp_err select_locked(const char *spec)
{
    const tdp__cuda_ops *ops = NULL;
    tdp__cuda_backend kind = TDP__CUDA_NONE;
    unsigned n = 0;
    const char *why = "TDPIPE_CUDA=off";

    if (spec == NULL || *spec == '\0' || strcmp(spec, "driver") == 0) {
#ifdef TDP_HAVE_CUDA_H
        ops = &tdp__cuda_driver_ops;
        kind = TDP__CUDA_DRIVER;
#else
        why = "built without CUDA";
#endif
    } else if (strncmp(spec, "fake", 4) == 0) {
        n = 1;
        if (spec[4] == ':') {
            char *end = NULL;
            unsigned long v = strtoul(spec + 5, &end, 10);
            if (end == spec + 5 || *end != '\0' || v == 0 || v > 16)
                return TDP_EINVAL;
            n = (unsigned)v;
        } else if (spec[4] != '\0') {
            return TDP_EINVAL;
        }
        ops = &tdp__cuda_fake_ops;
        kind = TDP__CUDA_FAKE;
    } else if (strcmp(spec, "off") != 0) {
        return TDP_EINVAL;
    }
    int count = 0;
    if (ops != NULL) {
        count = ops->init(n, &why);
        if (count <= 0) {
            count = 0;
            ops = NULL;
            kind = TDP__CUDA_NONE;
        }
    }
    atomic_store(&none_why, why);
    atomic_store(&ndevices, count);
    atomic_store(&backend_kind, kind);
    atomic_store_explicit(&active, ops != NULL ? ops : &none_ops, memory_order_release);
    return TDP_OK;
}

static const tdp__cuda_ops *be(void)
{
    const tdp__cuda_ops *ops = atomic_load_explicit(&active, memory_order_acquire);
    if (ops != NULL)
        return ops;
    pthread_mutex_lock(&sel_lock);
    if (atomic_load(&active) == NULL) {
        const char *env = getenv("TDPIPE_CUDA");
        if (select_locked(env) != TDP_OK) {
            tdp_log_warn("TDPIPE_CUDA=%s not understood (driver, fake, fake:N or off): "
                         "using the driver",
                         env);
            (void)select_locked(NULL);
        }
    }
    pthread_mutex_unlock(&sel_lock);
    return atomic_load_explicit(&active, memory_order_acquire);
}

tdp_err tdp__cuda_select(const char *spec)
{
    pthread_mutex_lock(&sel_lock);
    tdp_err rc = select_locked(spec);
    pthread_mutex_unlock(&sel_lock);
    return rc;
}

tdp__cuda_backend tdp__cuda_backend_get(void)
{
    (void)be();
    return atomic_load(&backend_kind);
}

int tdp__cuda_device_count(void)
{
    (void)be();
    return atomic_load(&ndevices);
}

const char *tdp__cuda_describe(char *buf, size_t n)
{
    const tdp__cuda_ops *ops = be();
    int count = atomic_load(&ndevices);
    if (ops == &none_ops)
        snprintf(buf, n, "no CUDA device (%s)", atomic_load(&none_why));
    else
        snprintf(buf, n, "%s, %d device%s",
                 atomic_load(&backend_kind) == TDP__CUDA_FAKE ? "fake" : "driver loaded", count,
                 count == 1 ? "" : "s");
    return buf;
}

/* The backend is chosen first: this may be the process's first CUDA call. */
static bool dev_ok(int dev)
{
    (void)be();
    return dev >= 0 && dev < atomic_load(&ndevices);
}

/*
 * A host function may make no CUDA call (the driver answers
 * CUDA_ERROR_NOT_PERMITTED, or deadlocks): on the fake, whose host
 * functions run on its engine threads, such a call is refused and logged,
 * so that it fails in CI as it would on a GPU.
 */
static bool refused_in_host_fn(const tdp__cuda_ops *o, const char *what)
{
    if (o != &tdp__cuda_fake_ops || !tdp__cuda_fake_in_host_fn())
        return false;
    tdp_log_error("CUDA call %s from inside a host function: not permitted", what);
    return true;
}

/*
 * TDPIPE_CUDA_STATS=1: every call into the backend is counted and timed,
 * and the process prints one line per kind of call to stderr when it
 * exits (where a GPU pipe's time goes, on a machine without a profiler).
 * Off, each call pays one relaxed load.
 */
#define STAT_OPS(X)                                                                                \
    X(uuid)                                                                                        \
    X(ctx_set)                                                                                     \
    X(malloc)                                                                                      \
    X(free)                                                                                        \
    X(host_alloc)                                                                                  \
    X(host_free)                                                                                   \
    X(host_register) X(host_unregister) X(stream_create) X(stream_destroy) X(stream_sync)          \
        X(memcpy_async) X(memcpy) X(memset) X(write_inline) X(sync_default) X(host_func)           \
            X(event_create) X(event_destroy) X(event_record) X(event_query) X(event_sync)          \
                X(stream_wait) X(ptr_info) X(export_) X(import) X(import_close)
#define STAT_ENUM(fn) ST_##fn,
enum { STAT_OPS(STAT_ENUM) ST_COUNT };
#define STAT_NAME(fn) #fn,
static const char *const stat_name[ST_COUNT] = {STAT_OPS(STAT_NAME)};
static struct {
    _Atomic uint64_t calls, ns, max_ns;
} stat[ST_COUNT];
static _Atomic int stats_on = -1; /* -1: TDPIPE_CUDA_STATS not read yet */

static void stats_print(void)
{
    char line[128];
    for (int k = 0; k < ST_COUNT; k++) {
        if (tdp__cuda_stats_line(k, line, sizeof(line)))
            fprintf(stderr, "tdpipe cuda stats (pid %ld): %s\n", (long)getpid(), line);
    }
}

static bool stats_enabled(void)
{
    int on = atomic_load_explicit(&stats_on, memory_order_relaxed);
    if (on >= 0)
        return on;
    const char *env = getenv("TDPIPE_CUDA_STATS");
    bool want = env != NULL && *env != '\0' && strcmp(env, "0") != 0;
    int expect = -1;
    if (atomic_compare_exchange_strong(&stats_on, &expect, want) && want)
        atexit(stats_print);
    return atomic_load(&stats_on) > 0;
}

void tdp__cuda_stats_enable(bool on)
{
    atomic_store(&stats_on, on);
}

static uint64_t stat_begin(void)
{
    if (!stats_enabled())
        return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void stat_end(int k, uint64_t t0)
{
    if (t0 == 0)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t d = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec - t0;
    atomic_fetch_add_explicit(&stat[k].calls, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&stat[k].ns, d, memory_order_relaxed);
    uint64_t m = atomic_load_explicit(&stat[k].max_ns, memory_order_relaxed);
    while (d > m && !atomic_compare_exchange_weak_explicit(
                        &stat[k].max_ns, &m, d, memory_order_relaxed, memory_order_relaxed))
        ;
}

bool tdp__cuda_stats_line(int k, char *buf, size_t n)
{
    if (k < 0 || k >= ST_COUNT)
        return false;
    uint64_t calls = atomic_load(&stat[k].calls);
    if (calls == 0)
        return false;
    const char *name = stat_name[k];
    size_t len = strlen(name);
    snprintf(buf, n, "%-.*s calls %llu mean %.2f us max %.2f us total %.3f ms",
             (int)(name[len - 1] == '_' ? len - 1 : len), name, (unsigned long long)calls,
             (double)atomic_load(&stat[k].ns) / (double)calls / 1e3,
             (double)atomic_load(&stat[k].max_ns) / 1e3, (double)atomic_load(&stat[k].ns) / 1e6);
    return true;
}

void tdp__cuda_stats_reset(void)
{
    for (int k = 0; k < ST_COUNT; k++) {
        atomic_store(&stat[k].calls, 0);
        atomic_store(&stat[k].ns, 0);
        atomic_store(&stat[k].max_ns, 0);
    }
}

/* ops_, the backend for a call of fn; or return TDP_ENOTSUP where it has no
 * such call, TDP_ECUDA from inside a host function. */
#define BACKEND_FOR(fn)                                                                            \
    const tdp__cuda_ops *ops_ = be();                                                              \
    if (ops_->fn == NULL)                                                                          \
        return TDP_ENOTSUP;                                                                        \
    if (refused_in_host_fn(ops_, #fn))                                                             \
        return TDP_ECUDA;                                                                          \
    (void)0

/* Forward to the backend. */
#define CALL(fn, ...)                                                                              \
    do {                                                                                           \
        BACKEND_FOR(fn);                                                                           \
        uint64_t t_ = stat_begin();                                                                \
        tdp_err rc_ = ops_->fn(__VA_ARGS__);                                                       \
        stat_end(ST_##fn, t_);                                                                     \
        return rc_;                                                                                \
    } while (0)

#define CALL_VOID(fn, ...)                                                                         \
    do {                                                                                           \
        const tdp__cuda_ops *ops_ = be();                                                          \
        if (ops_->fn != NULL && !refused_in_host_fn(ops_, #fn)) {                                  \
            uint64_t t_ = stat_begin();                                                            \
            ops_->fn(__VA_ARGS__);                                                                 \
            stat_end(ST_##fn, t_);                                                                 \
        }                                                                                          \
    } while (0)

tdp_err tdp__cuda_device_uuid(int dev, uint8_t uuid[16])
{
    if (uuid == NULL)
        return TDP_EINVAL;
    if (!dev_ok(dev))
        return tdp__cuda_device_count() == 0 ? TDP_ENOTSUP : TDP_EINVAL;
    CALL(uuid, dev, uuid);
}

tdp_err tdp__cuda_ctx_set(int dev)
{
    if (!dev_ok(dev))
        return tdp__cuda_device_count() == 0 ? TDP_ENOTSUP : TDP_EINVAL;
    CALL(ctx_set, dev);
}

tdp_err tdp__cuda_malloc(int dev, size_t size, void **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    if (!dev_ok(dev))
        return tdp__cuda_device_count() == 0 ? TDP_ENOTSUP : TDP_EINVAL;
    CALL(malloc, dev, size, false, out);
}

tdp_err tdp__cuda_malloc_shared(int dev, size_t size, void **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    if (!dev_ok(dev))
        return tdp__cuda_device_count() == 0 ? TDP_ENOTSUP : TDP_EINVAL;
    CALL(malloc, dev, size, true, out);
}

void tdp__cuda_free(void *p)
{
    if (p != NULL)
        CALL_VOID(free, p);
}

tdp_err tdp__cuda_host_alloc(size_t size, void **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    CALL(host_alloc, size, out);
}

void tdp__cuda_host_free(void *p)
{
    if (p != NULL)
        CALL_VOID(host_free, p);
}

tdp_err tdp__cuda_host_register(void *p, size_t size)
{
    if (p == NULL || size == 0)
        return TDP_EINVAL;
    CALL(host_register, p, size);
}

tdp_err tdp__cuda_host_unregister(void *p)
{
    if (p == NULL)
        return TDP_EINVAL;
    CALL(host_unregister, p);
}

struct tdp__cuda_pin {
    void *p;
    size_t size;
    pthread_t th;
    bool joined;
    _Atomic int state; /* 0 pinning, 1 pinned, 2 failed */
};

static _Atomic uint64_t pins_landed, pins_running;

uint64_t tdp__cuda_pins_landed(void)
{
    return atomic_load_explicit(&pins_landed, memory_order_relaxed);
}

uint64_t tdp__cuda_pins_running(void)
{
    return atomic_load_explicit(&pins_running, memory_order_relaxed);
}

static void *pin_main(void *arg)
{
    tdp__cuda_pin *r = arg;
    tdp_err rc = tdp__cuda_host_register(r->p, r->size);
    if (rc != TDP_OK)
        tdp_log_debug("cuda: %zu bytes at %p not page-locked (%s): copies stay at pageable speed",
                      r->size, r->p, tdp_strerror(rc));
    if (rc == TDP_OK)
        atomic_fetch_add_explicit(&pins_landed, 1, memory_order_relaxed);
    atomic_store_explicit(&r->state, rc == TDP_OK ? 1 : 2, memory_order_release);
    atomic_fetch_sub_explicit(&pins_running, 1, memory_order_relaxed);
    return NULL;
}

tdp_err tdp__cuda_pin_new(void *p, size_t size, bool now, tdp__cuda_pin **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    *out = NULL;
    if (p == NULL || size == 0)
        return TDP_EINVAL;
    tdp__cuda_pin *r = calloc(1, sizeof(*r)); /* not per message */
    if (r == NULL)
        return TDP_ENOMEM;
    r->p = p;
    r->size = size;
    atomic_init(&r->state, 0);
    bool started = false;
    pthread_attr_t at;
    if (!now && pthread_attr_init(&at) == 0) {
        (void)pthread_attr_setstacksize(&at, 256u << 10);
        atomic_fetch_add_explicit(&pins_running, 1, memory_order_relaxed);
        started = pthread_create(&r->th, &at, pin_main, r) == 0;
        if (!started)
            atomic_fetch_sub_explicit(&pins_running, 1, memory_order_relaxed);
        pthread_attr_destroy(&at);
    }
    if (!started) { /* now, or no thread: pinned on this one */
        r->joined = true;
        tdp_err rc = tdp__cuda_host_register(p, size);
        if (rc != TDP_OK) {
            free(r);
            return rc;
        }
        atomic_fetch_add_explicit(&pins_landed, 1, memory_order_relaxed);
        atomic_store_explicit(&r->state, 1, memory_order_relaxed);
    }
    *out = r;
    return TDP_OK;
}

void tdp__cuda_pin_wait(tdp__cuda_pin *r)
{
    if (r != NULL && !r->joined) {
        (void)pthread_join(r->th, NULL);
        r->joined = true;
    }
}

void tdp__cuda_pin_end(tdp__cuda_pin *r)
{
    if (r == NULL)
        return;
    tdp__cuda_pin_wait(r);
    if (atomic_load_explicit(&r->state, memory_order_acquire) == 1)
        (void)tdp__cuda_host_unregister(r->p);
    free(r);
}

tdp_err tdp__cuda_stream_create(int dev, tdp__cuda_stream **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    if (!dev_ok(dev))
        return tdp__cuda_device_count() == 0 ? TDP_ENOTSUP : TDP_EINVAL;
    CALL(stream_create, dev, out);
}

void tdp__cuda_stream_destroy(tdp__cuda_stream *s)
{
    if (s != NULL)
        CALL_VOID(stream_destroy, s);
}

tdp_err tdp__cuda_stream_sync(tdp__cuda_stream *s)
{
    if (s == NULL)
        return TDP_EINVAL;
    CALL(stream_sync, s);
}

tdp_err tdp__cuda_memcpy_async(void *dst, const void *src, size_t n, tdp__cuda_stream *s)
{
    if (s == NULL || ((dst == NULL || src == NULL) && n > 0))
        return TDP_EINVAL;
    if (n == 0)
        return TDP_OK;
    CALL(memcpy_async, dst, src, n, s);
}

tdp_err tdp__cuda_write_inline(void *dst, const void *src, size_t n, tdp__cuda_stream *s)
{
    if (s == NULL || dst == NULL || src == NULL || !tdp__cuda_inline_fits(dst, n))
        return TDP_EINVAL;
    CALL(write_inline, dst, src, n, s);
}

/*
 * The synchronous calls are done when they return, which the driver's are
 * not: cuMemcpy from pageable host memory to the device returns once the
 * bytes are in its staging buffer, a device to device copy and cuMemset at
 * once; the rest runs on the default stream, which the library's streams
 * (non-blocking) are not ordered after, nor is a peer process. A loaned
 * slot filled this way and sent at once was read stale on an H100. So
 * they go as CALL, then wait for the default stream.
 */
#define CALL_SYNC(fn, ...)                                                                         \
    do {                                                                                           \
        BACKEND_FOR(fn);                                                                           \
        uint64_t t_ = stat_begin();                                                                \
        tdp_err rc_ = ops_->fn(__VA_ARGS__);                                                       \
        stat_end(ST_##fn, t_);                                                                     \
        if (rc_ != TDP_OK || ops_->sync_default == NULL)                                           \
            return rc_;                                                                            \
        t_ = stat_begin();                                                                         \
        rc_ = ops_->sync_default();                                                                \
        stat_end(ST_sync_default, t_);                                                             \
        return rc_;                                                                                \
    } while (0)

tdp_err tdp__cuda_memcpy(void *dst, const void *src, size_t n)
{
    if ((dst == NULL || src == NULL) && n > 0)
        return TDP_EINVAL;
    if (n == 0)
        return TDP_OK;
    CALL_SYNC(memcpy, dst, src, n);
}

tdp_err tdp__cuda_memset(void *p, int byte, size_t n)
{
    if (p == NULL && n > 0)
        return TDP_EINVAL;
    if (n == 0)
        return TDP_OK;
    CALL_SYNC(memset, p, byte, n);
}

tdp_err tdp__cuda_launch_host_func(tdp__cuda_stream *s, void (*fn)(void *), void *arg)
{
    if (s == NULL || fn == NULL)
        return TDP_EINVAL;
    CALL(host_func, s, fn, arg);
}

tdp_err tdp__cuda_event_create(int dev, tdp__cuda_event **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    if (!dev_ok(dev))
        return tdp__cuda_device_count() == 0 ? TDP_ENOTSUP : TDP_EINVAL;
    CALL(event_create, dev, out);
}

void tdp__cuda_event_destroy(tdp__cuda_event *e)
{
    if (e != NULL)
        CALL_VOID(event_destroy, e);
}

tdp_err tdp__cuda_event_record(tdp__cuda_event *e, tdp__cuda_stream *s)
{
    if (e == NULL || s == NULL)
        return TDP_EINVAL;
    CALL(event_record, e, s);
}

tdp_err tdp__cuda_event_query(tdp__cuda_event *e)
{
    if (e == NULL)
        return TDP_EINVAL;
    CALL(event_query, e);
}

tdp_err tdp__cuda_event_sync(tdp__cuda_event *e)
{
    if (e == NULL)
        return TDP_EINVAL;
    CALL(event_sync, e);
}

tdp_err tdp__cuda_stream_wait_event(tdp__cuda_stream *s, tdp__cuda_event *e)
{
    if (s == NULL || e == NULL)
        return TDP_EINVAL;
    CALL(stream_wait, s, e);
}

tdp_err tdp__cuda_ptr_get_info(const void *p, tdp__cuda_ptr_info *out)
{
    if (out == NULL)
        return TDP_EINVAL;
    const tdp__cuda_ops *ops = be();
    if (ops->ptr_info == NULL || p == NULL) {
        *out = (tdp__cuda_ptr_info){TDP__CUDA_PTR_HOST, -1};
        return TDP_OK;
    }
    uint64_t t = stat_begin();
    tdp_err rc = ops->ptr_info(p, out);
    stat_end(ST_ptr_info, t);
    return rc;
}

tdp_err tdp__cuda_export(void *p, tdp__cuda_ipc *out)
{
    if (p == NULL || out == NULL)
        return TDP_EINVAL;
    CALL(export_, p, out);
}

tdp_err tdp__cuda_import(int dev, const tdp__cuda_ipc *h, void **out)
{
    if (h == NULL || out == NULL)
        return TDP_EINVAL;
    if (!dev_ok(dev))
        return tdp__cuda_device_count() == 0 ? TDP_ENOTSUP : TDP_EINVAL;
    CALL(import, dev, h, out);
}

void tdp__cuda_import_close(void *p)
{
    if (p != NULL)
        CALL_VOID(import_close, p);
}

/* ---- small synchronous host-to-device writes ----------------------------- */

/*
 * One stream per device for them, made at the first, kept for the
 * process (remade in a forked child, where the fake's engine is gone).
 */
#define INL_DEVS 64
static struct {
    pthread_mutex_t mu;
    tdp__cuda_stream *s;
    pid_t pid;
} inl[INL_DEVS] = {[0 ... INL_DEVS - 1] = {.mu = PTHREAD_MUTEX_INITIALIZER}};
static _Atomic int inline_on = -1; /* -1: TDPIPE_CUDA_INLINE not read yet */

bool tdp__cuda_inline_enabled(void)
{
    int on = atomic_load_explicit(&inline_on, memory_order_relaxed);
    if (on < 0) {
        const char *env = getenv("TDPIPE_CUDA_INLINE");
        on = env == NULL || strcmp(env, "0") != 0;
        atomic_store(&inline_on, on);
    }
    return on;
}

void tdp__cuda_inline_set(bool on)
{
    atomic_store(&inline_on, on);
}

bool tdp__cuda_inline_h2d(const void *dst, const void *src, size_t n, int *dev)
{
    tdp__cuda_ptr_info di, si;
    if (src == NULL || !tdp__cuda_inline_fits(dst, n) || !tdp__cuda_inline_enabled() ||
        tdp__cuda_ptr_get_info(dst, &di) != TDP_OK || di.kind != TDP__CUDA_PTR_DEVICE ||
        tdp__cuda_ptr_get_info(src, &si) != TDP_OK || si.kind == TDP__CUDA_PTR_DEVICE)
        return false;
    if (dev != NULL)
        *dev = di.device;
    return true;
}

tdp_err tdp__cuda_copy_small(void *dst, const void *src, size_t n)
{
    int d = -1;
    if (!tdp__cuda_inline_h2d(dst, src, n, &d) || d < 0 || d >= INL_DEVS)
        return TDP_ENOTSUP;
    const tdp__cuda_ops *ops = be();
    tdp_err rc = TDP_OK;
    pthread_mutex_lock(&inl[d].mu);
    if (inl[d].s == NULL || inl[d].pid != getpid()) {
        inl[d].s = NULL;
        rc = tdp__cuda_stream_create(d, &inl[d].s);
        inl[d].pid = getpid();
    }
    /* after what the default stream holds, as a synchronous copy would be */
    if (rc == TDP_OK && ops->sync_default != NULL) {
        uint64_t t = stat_begin();
        rc = ops->sync_default();
        stat_end(ST_sync_default, t);
    }
    if (rc == TDP_OK)
        rc = tdp__cuda_write_inline(dst, src, n, inl[d].s);
    if (rc == TDP_OK)
        rc = tdp__cuda_stream_sync(inl[d].s);
    pthread_mutex_unlock(&inl[d].mu);
    if (rc == TDP_ENOTSUP)
        atomic_store(&inline_on, 0); /* the device cannot: copies from now on */
    return rc;
}

/* ---- the public view ---------------------------------------------------- */

bool tdp_cuda_built(void)
{
#ifdef TDP_HAVE_CUDA_H
    return true;
#else
    return false;
#endif
}

int tdp_cuda_device_count(void)
{
    return tdp__cuda_device_count();
}
