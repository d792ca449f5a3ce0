/*
 * cudaipc_pool.c: device pools of the cuda-ipc plane (cudaipc.h): one
 * exportable allocation each, exported once, imported once, or shared by
 * pointer between two ends in one process.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>

#include "cudaipc.h"
#include "../../core/alloc.h"
#include "../../core/log.h"

struct tdp__dpool {
    _Atomic uint32_t refs;
    _Atomic uint64_t sync; /* publish / observe, on the pool this process made */
    uint8_t id[TDP_DPOOL_ID_LEN];
    void *base;
    uint64_t bytes;
    int dev;
    bool imported;    /* from another process: close the import */
    tdp__dpool *made; /* shared by pointer: the pool this process made (holds a reference) */
    tdp__dpool *next; /* in the table of pools made here */
};

/* Pools this process made, by id: a receiver in this process shares them. */
static pthread_mutex_t tab_lock = PTHREAD_MUTEX_INITIALIZER;
static tdp__dpool *made_pools;
static _Atomic uint64_t nexports, nimports, nopens;

static void tab_remove(tdp__dpool *p)
{
    pthread_mutex_lock(&tab_lock);
    for (tdp__dpool **pp = &made_pools; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    }
    pthread_mutex_unlock(&tab_lock);
}

tdp_err tdp__dpool_new(int dev, uint64_t bytes, tdp__dpool **out)
{
    if (bytes == 0 || bytes % 4096u != 0 || bytes > SIZE_MAX)
        return TDP_EINVAL;
    tdp__dpool *p = tdp__calloc(1, sizeof(*p));
    if (p == NULL)
        return TDP_ENOMEM;
    if (getrandom(p->id, sizeof(p->id), 0) != (ssize_t)sizeof(p->id)) {
        tdp__free(p);
        return TDP_EINTERNAL;
    }
    tdp_err rc = tdp__cuda_malloc_shared(dev, (size_t)bytes, &p->base);
    if (rc != TDP_OK) {
        tdp__free(p);
        return rc;
    }
    atomic_init(&p->refs, 1);
    atomic_init(&p->sync, 0);
    p->bytes = bytes;
    p->dev = dev;
    pthread_mutex_lock(&tab_lock);
    p->next = made_pools;
    made_pools = p;
    pthread_mutex_unlock(&tab_lock);
    *out = p;
    return TDP_OK;
}

tdp_err tdp__dpool_export(tdp__dpool *p, tdp__cuda_ipc *h)
{
    tdp_err rc = tdp__cuda_export(p->base, h);
    if (rc == TDP_OK)
        atomic_fetch_add_explicit(&nexports, 1, memory_order_relaxed);
    return rc;
}

/* A pool this process made, with a reference taken, or NULL. */
static tdp__dpool *tab_find(const uint8_t id[TDP_DPOOL_ID_LEN])
{
    tdp__dpool *found = NULL;
    pthread_mutex_lock(&tab_lock);
    for (tdp__dpool *p = made_pools; p != NULL; p = p->next) {
        if (memcmp(p->id, id, TDP_DPOOL_ID_LEN) != 0)
            continue;
        /* a pool whose last reference is going (its unref waits for the
         * lock to leave the table) is no longer in reach */
        uint32_t r = atomic_load_explicit(&p->refs, memory_order_acquire);
        while (r > 0 && !atomic_compare_exchange_weak_explicit(
                            &p->refs, &r, r + 1, memory_order_acq_rel, memory_order_acquire))
            ;
        found = r > 0 ? p : NULL;
        break;
    }
    pthread_mutex_unlock(&tab_lock);
    return found;
}

tdp_err tdp__dpool_open(int dev, const uint8_t id[TDP_DPOOL_ID_LEN], const tdp__cuda_ipc *h,
                        uint64_t bytes, tdp__dpool **out)
{
    if (bytes == 0 || bytes > SIZE_MAX)
        return TDP_EPROTO;
    tdp__dpool *p = tdp__calloc(1, sizeof(*p));
    if (p == NULL)
        return TDP_ENOMEM;
    atomic_init(&p->refs, 1);
    atomic_init(&p->sync, 0);
    memcpy(p->id, id, TDP_DPOOL_ID_LEN);
    p->bytes = bytes;
    p->dev = dev;
    tdp__dpool *m = tab_find(id);
    if (m != NULL) {
        /* both ends in this process: a handle cannot be opened where it was
         * made, and the pointer is as good */
        if (m->bytes < bytes || m->dev != dev) {
            tdp__dpool_unref(m);
            tdp__free(p);
            return TDP_EPROTO;
        }
        p->made = m;
        p->base = m->base;
        atomic_fetch_add_explicit(&nopens, 1, memory_order_relaxed);
        *out = p;
        return TDP_OK;
    }
    struct stat st;
    tdp__cuda_ipc hh = *h;
    if (hh.fd < 0)
        hh.size = bytes; /* a legacy handle maps the allocation as it is */
    if (hh.size < bytes || hh.size - bytes > (64u << 20) ||
        (hh.fd >= 0 && fstat(hh.fd, &st) == 0 && S_ISREG(st.st_mode) &&
         (uint64_t)st.st_size < hh.size)) {
        /* smaller than the slots, or a memfd (the fake device's export)
         * shorter than it claims */
        tdp__free(p);
        return TDP_EPROTO;
    }
    tdp_err rc = tdp__cuda_import(dev, &hh, &p->base);
    if (rc != TDP_OK) {
        tdp__free(p);
        return rc == TDP_ENOMEM ? rc : TDP_EPROTO;
    }
    atomic_fetch_add_explicit(&nimports, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&nopens, 1, memory_order_relaxed);
    p->imported = true;
    *out = p;
    return TDP_OK;
}

void tdp__dpool_publish(tdp__dpool *p)
{
    tdp__dpool *t = p->made != NULL ? p->made : p;
    atomic_fetch_add_explicit(&t->sync, 1, memory_order_release);
}

void tdp__dpool_observe(tdp__dpool *p)
{
    tdp__dpool *t = p->made != NULL ? p->made : p;
    (void)atomic_load_explicit(&t->sync, memory_order_acquire);
}

void tdp__dpool_ref(tdp__dpool *p)
{
    atomic_fetch_add_explicit(&p->refs, 1, memory_order_relaxed);
}

void tdp__dpool_unref(tdp__dpool *p)
{
    if (p == NULL || atomic_fetch_sub_explicit(&p->refs, 1, memory_order_acq_rel) != 1)
        return;
    if (p->made != NULL) {
        tdp__dpool_unref(p->made);
    } else if (p->imported) {
        tdp__cuda_import_close(p->base);
    } else {
        tab_remove(p);
        tdp__cuda_free(p->base);
    }
    tdp__free(p);
}

void *tdp__dpool_base(const tdp__dpool *p)
{
    return p->base;
}

uint64_t tdp__dpool_bytes(const tdp__dpool *p)
{
    return p->bytes;
}

int tdp__dpool_device(const tdp__dpool *p)
{
    return p->dev;
}

const uint8_t *tdp__dpool_id(const tdp__dpool *p)
{
    return p->id;
}

bool tdp__dpool_is_shared(const tdp__dpool *p)
{
    return p->made != NULL;
}

uint64_t tdp__dpool_exports(void)
{
    return atomic_load_explicit(&nexports, memory_order_relaxed);
}

uint64_t tdp__dpool_imports(void)
{
    return atomic_load_explicit(&nimports, memory_order_relaxed);
}

uint64_t tdp__dpool_opens(void)
{
    return atomic_load_explicit(&nopens, memory_order_relaxed);
}
