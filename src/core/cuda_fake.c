/*
 * cuda_fake.c: a CUDA device for machines without one (TDPIPE_CUDA=fake).
 *
 * Device memory is a memfd mapped twice: PROT_NONE at the address handed
 * out (so host code that touches "device memory" faults, as it would on a
 * GPU), and read-write for the copy engine, which finds the second view by
 * looking the address up. Each stream has an engine thread that runs its
 * work in order, after an optional delay, so a missing wait reads stale
 * bytes. Host functions run on that thread, as CUDA's run on a driver
 * thread. The synchronous calls leave work on a default stream where a
 * GPU's do (see fake_memcpy). Faults are injected by count (docs/gpu.md).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cuda_int.h"
#include "log.h"

#define FAKE_PAGE 4096u

/* ---- the tables of memory ------------------------------------------------ */

typedef struct fake_dev_mem {
    char *dev;  /* PROT_NONE view: the pointer callers hold */
    char *eng;  /* read-write view: what the engine copies through */
    size_t len; /* both views' length, whole pages */
    int fd;     /* the memfd, for export; -1 for an imported mapping */
    int device;
    struct fake_dev_mem *next;
} fake_dev_mem;

typedef struct fake_host_mem {
    char *p;
    size_t size;
    bool owned; /* from host_alloc (freed by us) or host_register (not) */
    struct fake_host_mem *next;
} fake_host_mem;

static pthread_mutex_t tab_lock = PTHREAD_MUTEX_INITIALIZER;
static fake_dev_mem *dev_mems;
static fake_host_mem *host_mems;
static _Atomic unsigned ndev;
static _Atomic unsigned delay_us;
static _Atomic unsigned register_ms; /* each host registration takes this long */
static _Atomic unsigned fault_left[TDP__CUDA_FAULT_COUNT];

/* True when the armed count of fault f reaches zero with this call. */
static bool fault_fires(tdp__cuda_fault f)
{
    unsigned v = atomic_load(&fault_left[f]);
    while (v > 0) {
        if (atomic_compare_exchange_weak(&fault_left[f], &v, v - 1))
            return v == 1;
    }
    return false;
}

void tdp__cuda_fake_inject(tdp__cuda_fault f, unsigned n)
{
    if ((unsigned)f < TDP__CUDA_FAULT_COUNT)
        atomic_store(&fault_left[f], n);
}

void tdp__cuda_fake_set_delay_us(unsigned us)
{
    atomic_store(&delay_us, us);
}

void tdp__cuda_fake_set_register_ms(unsigned ms)
{
    atomic_store(&register_ms, ms);
}

static unsigned env_uint(const char *name)
{
    const char *s = getenv(name);
    if (s == NULL || *s == '\0')
        return 0;
    char *end = NULL;
    unsigned long v = strtoul(s, &end, 10);
    if (*end != '\0' || v > 1000000000ul) {
        tdp_log_warn("%s=%s is not a count: ignored", name, s);
        return 0;
    }
    return (unsigned)v;
}

static void dflt_forget(void);

static void env_once(void)
{
    /* a forked child may find the default stream's lock taken by a thread it lacks */
    pthread_atfork(NULL, NULL, dflt_forget);
    atomic_store(&delay_us, env_uint("TDPIPE_FAKE_CUDA_DELAY_US"));
    atomic_store(&register_ms, env_uint("TDPIPE_FAKE_CUDA_REGISTER_MS"));
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_OOM_AT, env_uint("TDPIPE_FAKE_CUDA_OOM_AT"));
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_COPY_FAIL_AT, env_uint("TDPIPE_FAKE_CUDA_COPY_FAIL_AT"));
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_KILL_AFTER_COPY,
                          env_uint("TDPIPE_FAKE_CUDA_KILL_AFTER_COPY"));
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_INLINE_REFUSED_AT,
                          env_uint("TDPIPE_FAKE_CUDA_INLINE_REFUSED_AT"));
}

static int fake_init(unsigned n, const char **why)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, env_once);
    atomic_store(&ndev, n);
    (void)why;
    return (int)n;
}

/* The allocation holding p (tab_lock held), or NULL for host memory. */
static fake_dev_mem *dev_find(const void *p)
{
    for (fake_dev_mem *m = dev_mems; m != NULL; m = m->next)
        if ((const char *)p >= m->dev && (const char *)p < m->dev + m->len)
            return m;
    return NULL;
}

/*
 * Where the engine reads or writes n bytes at p: the read-write view for
 * device memory, p itself for host memory. TDP_ECUDA for a range that runs
 * off the end of its allocation (a GPU would fault).
 */
static tdp_err engine_addr(const void *p, size_t n, char **out)
{
    tdp_err rc = TDP_OK;
    pthread_mutex_lock(&tab_lock);
    fake_dev_mem *m = dev_find(p);
    if (m == NULL) {
        *out = (char *)(uintptr_t)p;
    } else if (n > (size_t)(m->dev + m->len - (const char *)p)) {
        rc = TDP_ECUDA;
    } else {
        *out = m->eng + ((const char *)p - m->dev);
    }
    pthread_mutex_unlock(&tab_lock);
    if (rc != TDP_OK)
        tdp_log_error("fake CUDA: %zu bytes at %p run past the end of the allocation", n, p);
    return rc;
}

static tdp_err fake_uuid(int dev, uint8_t uuid[16])
{
    /* fixed and distinct: "fake-gpu" and the ordinal, in the last bytes */
    static const uint8_t base[12] = {'t', 'd', 'p', '-', 'f', 'a', 'k', 'e', '-', 'g', 'p', 'u'};
    memcpy(uuid, base, sizeof(base));
    uuid[12] = 0;
    uuid[13] = 0;
    uuid[14] = (uint8_t)(dev >> 8);
    uuid[15] = (uint8_t)dev;
    return TDP_OK;
}

static tdp_err fake_ctx_set(int dev)
{
    (void)dev;
    return TDP_OK;
}

/* Map both views of fd (len bytes) and enter them in the table. */
static tdp_err map_views(int fd, size_t len, int device, void **out)
{
    fake_dev_mem *m = malloc(sizeof(*m));
    if (m == NULL)
        return TDP_ENOMEM;
    m->dev = mmap(NULL, len, PROT_NONE, MAP_SHARED, fd, 0);
    m->eng = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m->dev == MAP_FAILED || m->eng == MAP_FAILED) {
        if (m->dev != MAP_FAILED)
            munmap(m->dev, len);
        if (m->eng != MAP_FAILED)
            munmap(m->eng, len);
        free(m);
        return TDP_ENOMEM;
    }
    m->len = len;
    m->fd = fd;
    m->device = device;
    pthread_mutex_lock(&tab_lock);
    m->next = dev_mems;
    dev_mems = m;
    pthread_mutex_unlock(&tab_lock);
    *out = m->dev;
    return TDP_OK;
}

static tdp_err fake_malloc(int dev, size_t size, bool shared, void **out)
{
    (void)shared; /* every fake allocation can be exported */
    if (fault_fires(TDP__CUDA_FAULT_OOM_AT)) {
        tdp_log_debug("fake CUDA: out of memory (injected)");
        return TDP_ENOMEM;
    }
    size_t len = size == 0 ? FAKE_PAGE : size;
    if (len > SIZE_MAX - FAKE_PAGE)
        return TDP_ENOMEM;
    len = (len + FAKE_PAGE - 1) & ~(size_t)(FAKE_PAGE - 1);
    int fd = memfd_create("tdpipe-fake-cuda", MFD_CLOEXEC);
    if (fd < 0)
        return TDP_ENOMEM;
    if (ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        return TDP_ENOMEM;
    }
    tdp_err rc = map_views(fd, len, dev, out);
    if (rc != TDP_OK)
        close(fd);
    return rc;
}

static tdp_err fake_sync_default(void);

static void fake_free(void *p)
{
    /* as cuMemFree, after the default stream's work (which may write p) */
    (void)fake_sync_default();
    fake_dev_mem **pp, *m = NULL;
    pthread_mutex_lock(&tab_lock);
    for (pp = &dev_mems; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->dev == p) {
            m = *pp;
            *pp = m->next;
            break;
        }
    }
    pthread_mutex_unlock(&tab_lock);
    if (m == NULL) {
        tdp_log_error("fake CUDA: free of %p, which is no allocation", p);
        return;
    }
    munmap(m->dev, m->len);
    munmap(m->eng, m->len);
    if (m->fd >= 0)
        close(m->fd);
    free(m);
}

static tdp_err fake_export(void *p, tdp__cuda_ipc *out)
{
    int fd = -1;
    size_t len = 0;
    pthread_mutex_lock(&tab_lock);
    for (fake_dev_mem *m = dev_mems; m != NULL; m = m->next) {
        if (m->dev == p && m->fd >= 0) {
            fd = fcntl(m->fd, F_DUPFD_CLOEXEC, 0);
            len = m->len;
            break;
        }
    }
    pthread_mutex_unlock(&tab_lock);
    if (fd < 0) {
        tdp_log_error("fake CUDA: export of %p, which is no exportable allocation", p);
        return TDP_ECUDA;
    }
    memset(out, 0, sizeof(*out));
    out->fd = fd;
    out->size = len;
    return TDP_OK;
}

static tdp_err fake_import(int dev, const tdp__cuda_ipc *h, void **out)
{
    if (h->fd < 0 || h->size == 0 || h->size % FAKE_PAGE != 0 || h->size > SIZE_MAX) {
        tdp_log_error("fake CUDA: import of an invalid handle");
        return TDP_ECUDA;
    }
    /* the mappings hold the memfd: the caller's fd stays the caller's */
    tdp_err rc = map_views(h->fd, (size_t)h->size, dev, out);
    if (rc == TDP_OK) {
        pthread_mutex_lock(&tab_lock);
        dev_find(*out)->fd = -1;
        pthread_mutex_unlock(&tab_lock);
    }
    return rc;
}

/* ---- pinned and registered host memory ----------------------------------- */

static tdp_err host_add(char *p, size_t size, bool owned)
{
    fake_host_mem *h = malloc(sizeof(*h));
    if (h == NULL)
        return TDP_ENOMEM;
    h->p = p;
    h->size = size;
    h->owned = owned;
    pthread_mutex_lock(&tab_lock);
    for (fake_host_mem *o = host_mems; o != NULL; o = o->next) {
        if (p < o->p + o->size && o->p < p + size) {
            pthread_mutex_unlock(&tab_lock);
            free(h);
            tdp_log_error("fake CUDA: host memory %p is already registered", (void *)p);
            return TDP_ECUDA;
        }
    }
    h->next = host_mems;
    host_mems = h;
    pthread_mutex_unlock(&tab_lock);
    return TDP_OK;
}

/* Remove the range starting at p; its record, or NULL. */
static fake_host_mem *host_take(void *p)
{
    fake_host_mem **pp, *h = NULL;
    pthread_mutex_lock(&tab_lock);
    for (pp = &host_mems; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->p == p) {
            h = *pp;
            *pp = h->next;
            break;
        }
    }
    pthread_mutex_unlock(&tab_lock);
    return h;
}

/* Page-locking takes register_ms (a registration, or a pinned allocation). */
static void pin_delay(void)
{
    unsigned ms = atomic_load(&register_ms);
    if (ms > 0) {
        struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}

static tdp_err fake_host_alloc(size_t size, void **out)
{
    pin_delay();
    if (fault_fires(TDP__CUDA_FAULT_OOM_AT)) {
        tdp_log_debug("fake CUDA: out of pinned memory (injected)");
        return TDP_ENOMEM;
    }
    void *p = NULL;
    if (posix_memalign(&p, FAKE_PAGE, size ? size : 1) != 0)
        return TDP_ENOMEM;
    tdp_err rc = host_add(p, size ? size : 1, true);
    if (rc != TDP_OK)
        free(p);
    else
        *out = p;
    return rc;
}

static void fake_host_free(void *p)
{
    fake_host_mem *h = host_take(p);
    if (h == NULL || !h->owned) {
        tdp_log_error("fake CUDA: host free of %p, which is no pinned allocation", p);
        if (h != NULL)
            free(h); /* it was registered: the registration goes, the memory stays */
        return;
    }
    free(h->p);
    free(h);
}

static tdp_err fake_host_register(void *p, size_t size)
{
    pin_delay();
    return host_add(p, size, false);
}

static tdp_err fake_host_unregister(void *p)
{
    fake_host_mem *h = host_take(p);
    if (h == NULL || h->owned) {
        if (h != NULL) { /* put an allocation back: unregistering it is an error */
            pthread_mutex_lock(&tab_lock);
            h->next = host_mems;
            host_mems = h;
            pthread_mutex_unlock(&tab_lock);
        }
        tdp_log_error("fake CUDA: unregister of %p, which is not registered", p);
        return TDP_ECUDA;
    }
    free(h);
    return TDP_OK;
}

static tdp_err fake_ptr_info(const void *p, tdp__cuda_ptr_info *out)
{
    *out = (tdp__cuda_ptr_info){TDP__CUDA_PTR_HOST, -1};
    pthread_mutex_lock(&tab_lock);
    fake_dev_mem *m = dev_find(p);
    if (m != NULL) {
        *out = (tdp__cuda_ptr_info){TDP__CUDA_PTR_DEVICE, m->device};
    } else {
        for (fake_host_mem *h = host_mems; h != NULL; h = h->next)
            if ((const char *)p >= h->p && (const char *)p < h->p + h->size)
                out->kind = TDP__CUDA_PTR_PINNED;
    }
    pthread_mutex_unlock(&tab_lock);
    return TDP_OK;
}

/* ---- copies ------------------------------------------------------------- */

/* Both ends of a copy as the engine sees them, and the injected failure. */
static tdp_err copy_prepare(void *dst, const void *src, size_t n, char **d, char **s)
{
    if (fault_fires(TDP__CUDA_FAULT_COPY_FAIL_AT)) {
        tdp_log_error("fake CUDA: copy of %zu bytes failed (injected)", n);
        return TDP_ECUDA;
    }
    tdp_err rc = engine_addr(dst, n, d);
    if (rc == TDP_OK)
        rc = engine_addr(src, n, s);
    return rc;
}

/* After a copy completed: the peer killed between copy and hand-off. */
static void copy_done(void)
{
    if (fault_fires(TDP__CUDA_FAULT_KILL_AFTER_COPY))
        kill(getpid(), SIGKILL);
}

static void copy_delay(void)
{
    unsigned us = atomic_load(&delay_us);
    if (us > 0) {
        struct timespec ts = {us / 1000000u, (long)(us % 1000000u) * 1000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
            ;
    }
}

/* ---- streams, the copy engine, events ------------------------------------ */

struct tdp__cuda_event {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t recorded; /* records made */
    uint64_t passed;   /* records the stream has passed */
};

typedef enum op_kind { OP_COPY, OP_SET, OP_WRITE_VALUE, OP_HOST_FN, OP_RECORD, OP_WAIT } op_kind;

typedef struct fake_op {
    op_kind kind;
    char *dst;
    const char *src;
    size_t n;
    void (*fn)(void *);
    void *arg;
    tdp__cuda_event *ev;
    uint64_t gen;
    int byte;       /* OP_SET */
    uint64_t value; /* OP_WRITE_VALUE: its first n bytes */
    bool lead;      /* OP_WRITE_VALUE: the first of its batch (the one that waits) */
} fake_op;

/*
 * Work a stream holds at once, as a driver's command queue: queueing more
 * waits for the engine (nothing is allocated per operation, so the pipe's
 * no-allocation checks hold on the fake as they would on a GPU).
 */
#define FAKE_STREAM_OPS 1024u

struct tdp__cuda_stream {
    pthread_t engine;
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* work queued, or stop */
    pthread_cond_t idle_cv; /* work done */
    fake_op ring[FAKE_STREAM_OPS];
    uint64_t queued, taken, done;
    bool stop;
    int device;
};

static void event_pass(tdp__cuda_event *e, uint64_t gen)
{
    pthread_mutex_lock(&e->mu);
    if (gen > e->passed)
        e->passed = gen;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void event_wait_gen(tdp__cuda_event *e, uint64_t gen)
{
    pthread_mutex_lock(&e->mu);
    while (e->passed < gen)
        pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
}

static _Thread_local bool in_host_fn;

bool tdp__cuda_fake_in_host_fn(void)
{
    return in_host_fn;
}

static void op_run(fake_op *op)
{
    switch (op->kind) {
    case OP_COPY:
        copy_delay();
        memmove(op->dst, op->src, op->n);
        copy_done();
        break;
    case OP_SET:
        copy_delay();
        memset(op->dst, op->byte, op->n);
        break;
    case OP_WRITE_VALUE: /* 4 or 8 bytes: op->n; a batch is late once, as a copy */
        if (op->lead)
            copy_delay();
        memcpy(op->dst, &op->value, op->n);
        break;
    case OP_HOST_FN:
        in_host_fn = true; /* no CUDA call from here (cuda.c refuses it) */
        op->fn(op->arg);
        in_host_fn = false;
        break;
    case OP_RECORD:
        event_pass(op->ev, op->gen);
        break;
    case OP_WAIT:
        event_wait_gen(op->ev, op->gen);
        break;
    }
}

static void *engine_main(void *arg)
{
    tdp__cuda_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->taken == s->queued && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->taken == s->queued)
            break; /* stop, and nothing left */
        fake_op op = s->ring[s->taken++ % FAKE_STREAM_OPS];
        pthread_mutex_unlock(&s->mu);
        op_run(&op);
        pthread_mutex_lock(&s->mu);
        s->done++;
        pthread_cond_broadcast(&s->idle_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static tdp_err enqueue(tdp__cuda_stream *s, const fake_op *tmpl)
{
    pthread_mutex_lock(&s->mu);
    while (s->queued - s->taken >= FAKE_STREAM_OPS) /* full: wait for the engine */
        pthread_cond_wait(&s->idle_cv, &s->mu);
    s->ring[s->queued++ % FAKE_STREAM_OPS] = *tmpl;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return TDP_OK;
}

static tdp_err fake_stream_create(int dev, tdp__cuda_stream **out)
{
    tdp__cuda_stream *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return TDP_ENOMEM;
    s->device = dev;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->idle_cv, NULL);
    if (pthread_create(&s->engine, NULL, engine_main, s) != 0) {
        pthread_cond_destroy(&s->idle_cv);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        tdp_log_error("fake CUDA: cannot start a copy engine thread");
        return TDP_ECUDA;
    }
    *out = s;
    return TDP_OK;
}

static tdp_err fake_stream_sync(tdp__cuda_stream *s)
{
    pthread_mutex_lock(&s->mu);
    uint64_t want = s->queued;
    while (s->done < want)
        pthread_cond_wait(&s->idle_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return TDP_OK;
}

static void fake_stream_destroy(tdp__cuda_stream *s)
{
    pthread_mutex_lock(&s->mu);
    s->stop = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->engine, NULL); /* the engine drains the queue first */
    pthread_cond_destroy(&s->idle_cv);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static tdp_err fake_memcpy_async(void *dst, const void *src, size_t n, tdp__cuda_stream *s)
{
    fake_op op = {.kind = OP_COPY, .n = n};
    char *d, *sp;
    tdp_err rc = copy_prepare(dst, src, n, &d, &sp);
    if (rc != TDP_OK)
        return rc;
    op.dst = d;
    op.src = sp;
    return enqueue(s, &op);
}

/*
 * Written by the device itself, late as a copy, in 4- and 8-byte
 * operations whose values are read from src now (as the driver's batch
 * carries them); dst must lie inside one allocation.
 */
static tdp_err fake_write_inline(void *dst, const void *src, size_t n, tdp__cuda_stream *s)
{
    if (fault_fires(TDP__CUDA_FAULT_INLINE_REFUSED_AT))
        return TDP_ENOTSUP; /* as a driver that refuses the batch: nothing queued */
    if (fault_fires(TDP__CUDA_FAULT_COPY_FAIL_AT)) {
        tdp_log_error("fake CUDA: a write of %zu bytes failed (injected)", n);
        return TDP_ECUDA;
    }
    char *d;
    tdp_err rc = engine_addr(dst, n, &d);
    const unsigned char *in = src;
    for (size_t off = 0; rc == TDP_OK && off < n;) {
        size_t w = n - off >= 8 && ((uintptr_t)(d + off) & 7u) == 0 ? 8 : 4;
        fake_op op = {.kind = OP_WRITE_VALUE, .dst = d + off, .n = w, .lead = off == 0};
        memcpy(&op.value, in + off, w);
        rc = enqueue(s, &op);
        off += w;
    }
    return rc;
}

/*
 * ---- the default stream: what the synchronous calls leave unfinished ----
 *
 * A GPU's "synchronous" calls are not all synchronous: cuMemcpy from
 * pageable host memory to the device returns once the bytes are in the
 * driver's staging buffer, before they reach the device; a device to
 * device copy and cuMemset return at once. The rest runs on the default
 * stream, which the library's streams (non-blocking) are not ordered
 * after, nor is a peer process. The fake leaves that work pending, at its
 * latest (a GPU finishes it within microseconds, the fake only when made
 * to): a host source of up to FAKE_STAGE_BYTES goes through one staging
 * buffer, as the driver's (a larger one is copied at once), and the work
 * lands when sync_default waits for it (cuStreamSynchronize(NULL)), or
 * before the next call that the default stream orders after it: another
 * synchronous copy or fill. A copy on another stream does not wait for it.
 * No thread: forked children and the no-allocation checks see nothing new.
 */
#define FAKE_STAGE_BYTES 65536u

static pthread_mutex_t dflt_lock = PTHREAD_MUTEX_INITIALIZER;
static fake_op dflt_pending; /* .n == 0: nothing pending */
static char dflt_stage[FAKE_STAGE_BYTES];

/* In a forked child: the lock may have been held by a thread that is gone. */
static void dflt_forget(void)
{
    pthread_mutex_init(&dflt_lock, NULL);
}

/* Land the pending work (dflt_lock held). */
static void dflt_land(void)
{
    if (dflt_pending.n > 0) {
        op_run(&dflt_pending);
        dflt_pending.n = 0;
    }
}

static tdp_err fake_memcpy(void *dst, const void *src, size_t n)
{
    char *d, *s;
    tdp_err rc = copy_prepare(dst, src, n, &d, &s);
    if (rc != TDP_OK)
        return rc;
    bool to_dev = d != (char *)dst, from_dev = s != (const char *)src;
    tdp__cuda_ptr_info src_kind;
    (void)fake_ptr_info(src, &src_kind);
    pthread_mutex_lock(&dflt_lock);
    dflt_land(); /* in order after the earlier calls; the staging buffer free */
    if (to_dev && (from_dev || (n <= FAKE_STAGE_BYTES && src_kind.kind != TDP__CUDA_PTR_PINNED))) {
        dflt_pending = (fake_op){.kind = OP_COPY, .dst = d, .src = s, .n = n};
        if (!from_dev) {
            memcpy(dflt_stage, s, n); /* the source is the caller's again at return */
            dflt_pending.src = dflt_stage;
        }
        pthread_mutex_unlock(&dflt_lock);
        return TDP_OK;
    }
    pthread_mutex_unlock(&dflt_lock);
    copy_delay();
    memmove(d, s, n);
    copy_done();
    return TDP_OK;
}

static tdp_err fake_memset(void *p, int byte, size_t n)
{
    char *d;
    tdp_err rc = engine_addr(p, n, &d);
    if (rc != TDP_OK)
        return rc;
    pthread_mutex_lock(&dflt_lock);
    dflt_land();
    dflt_pending = (fake_op){.kind = OP_SET, .dst = d, .n = n, .byte = byte};
    pthread_mutex_unlock(&dflt_lock);
    return TDP_OK;
}

static tdp_err fake_sync_default(void)
{
    pthread_mutex_lock(&dflt_lock);
    dflt_land();
    pthread_mutex_unlock(&dflt_lock);
    return TDP_OK;
}

/* Tests: n bytes at device address p as the device holds them now, without waiting. */
tdp_err tdp__cuda_fake_peek(const void *p, void *out, size_t n)
{
    char *e;
    tdp_err rc = engine_addr(p, n, &e);
    if (rc == TDP_OK && e == (const char *)p)
        return TDP_ECUDA; /* host memory: the engine's view is the pointer itself */
    if (rc == TDP_OK)
        memcpy(out, e, n);
    return rc;
}

static tdp_err fake_host_func(tdp__cuda_stream *s, void (*fn)(void *), void *arg)
{
    fake_op op = {.kind = OP_HOST_FN, .fn = fn, .arg = arg};
    return enqueue(s, &op);
}

static tdp_err fake_event_create(int dev, tdp__cuda_event **out)
{
    (void)dev;
    tdp__cuda_event *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return TDP_ENOMEM;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    *out = e;
    return TDP_OK;
}

static void fake_event_destroy(tdp__cuda_event *e)
{
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

static tdp_err fake_event_record(tdp__cuda_event *e, tdp__cuda_stream *s)
{
    pthread_mutex_lock(&e->mu);
    uint64_t gen = ++e->recorded;
    pthread_mutex_unlock(&e->mu);
    fake_op op = {.kind = OP_RECORD, .ev = e, .gen = gen};
    tdp_err rc = enqueue(s, &op);
    if (rc != TDP_OK)
        event_pass(e, gen); /* nothing queued: the record must not stay pending */
    return rc;
}

static tdp_err fake_event_query(tdp__cuda_event *e)
{
    pthread_mutex_lock(&e->mu);
    bool done = e->passed >= e->recorded;
    pthread_mutex_unlock(&e->mu);
    return done ? TDP_OK : TDP_EAGAIN;
}

static tdp_err fake_event_sync(tdp__cuda_event *e)
{
    pthread_mutex_lock(&e->mu);
    uint64_t gen = e->recorded;
    pthread_mutex_unlock(&e->mu);
    event_wait_gen(e, gen);
    return TDP_OK;
}

static tdp_err fake_stream_wait(tdp__cuda_stream *s, tdp__cuda_event *e)
{
    pthread_mutex_lock(&e->mu);
    uint64_t gen = e->recorded;
    pthread_mutex_unlock(&e->mu);
    fake_op op = {.kind = OP_WAIT, .ev = e, .gen = gen};
    return enqueue(s, &op);
}

const tdp__cuda_ops tdp__cuda_fake_ops = {
    .name = "fake",
    .init = fake_init,
    .uuid = fake_uuid,
    .ctx_set = fake_ctx_set,
    .malloc = fake_malloc,
    .free = fake_free,
    .host_alloc = fake_host_alloc,
    .host_free = fake_host_free,
    .host_register = fake_host_register,
    .host_unregister = fake_host_unregister,
    .stream_create = fake_stream_create,
    .stream_destroy = fake_stream_destroy,
    .stream_sync = fake_stream_sync,
    .memcpy_async = fake_memcpy_async,
    .write_inline = fake_write_inline,
    .memcpy = fake_memcpy,
    .memset = fake_memset,
    .sync_default = fake_sync_default,
    .host_func = fake_host_func,
    .event_create = fake_event_create,
    .event_destroy = fake_event_destroy,
    .event_record = fake_event_record,
    .event_query = fake_event_query,
    .event_sync = fake_event_sync,
    .stream_wait = fake_stream_wait,
    .ptr_info = fake_ptr_info,
    .export_ = fake_export,
    .import = fake_import,
    .import_close = fake_free,
};
