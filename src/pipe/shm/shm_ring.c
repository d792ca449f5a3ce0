/* shm_ring.c: SPSC descriptor rings in shared memory, and their doorbells. */
#include "shm.h"

#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include "../../core/log.h"

/* The indices are shared with another process: they must be real atomics. */
_Static_assert(__atomic_always_lock_free(sizeof(uint64_t), 0), "64-bit atomics must be lock-free");
_Static_assert(__atomic_always_lock_free(sizeof(uint32_t), 0), "32-bit atomics must be lock-free");

/*
 * The shared part of a ring, each word on its own cache line so the two
 * sides never write the same line. Indices count descriptors since the
 * start and never wrap in practice (2^64).
 */
struct tdp__shm_ring_ctl {
    _Alignas(TDP__SHM_LINE) _Atomic uint64_t tail;    /* tx: descriptors pushed */
    _Alignas(TDP__SHM_LINE) _Atomic uint64_t head;    /* rx: descriptors popped */
    _Alignas(TDP__SHM_LINE) _Atomic uint32_t waiting; /* rx sets 1 before sleeping, tx clears */
};

_Static_assert(offsetof(struct tdp__shm_ring_ctl, tail) == TDP__SHM_RING_TAIL_OFF, "layout");
_Static_assert(offsetof(struct tdp__shm_ring_ctl, head) == TDP__SHM_RING_HEAD_OFF, "layout");
_Static_assert(offsetof(struct tdp__shm_ring_ctl, waiting) == TDP__SHM_RING_WAITING_OFF, "layout");
_Static_assert(sizeof(struct tdp__shm_ring_ctl) == TDP__SHM_RING_DESC_OFF, "one line per word");

uint64_t tdp__shm_ring_bytes(uint32_t ring_cap)
{
    uint64_t b = sizeof(struct tdp__shm_ring_ctl) + (uint64_t)ring_cap * TDP__SHM_DESC_BYTES;
    return (b + TDP__SHM_LINE - 1) & ~(uint64_t)(TDP__SHM_LINE - 1);
}

void tdp__shm_ring_init(tdp__shm_ring *r, void *base, uint32_t ring_cap, bool tx, int efd)
{
    memset(r, 0, sizeof(*r));
    r->ctl = base;
    r->desc = (uint64_t *)((char *)base + TDP__SHM_RING_DESC_OFF);
    r->cap = ring_cap;
    r->mask = (uint64_t)ring_cap - 1;
    r->tx = tx;
    r->efd = efd;
}

static tdp_err ring_broken(const tdp__shm_ring *r, uint64_t seen)
{
    tdp_log_warn("shm ring: the peer's %s index %llu is impossible (own %llu, last seen %llu, "
                 "capacity %u): peer broken or hostile",
                 r->tx ? "read" : "write", (unsigned long long)seen, (unsigned long long)r->own,
                 (unsigned long long)r->peer, r->cap);
    return TDP_EPROTO;
}

/*
 * Descriptor words are stored and loaded one by one with relaxed atomics:
 * the index's release/acquire orders them, and the atomics keep the
 * compiler from reading shared memory twice (the peer may change it
 * between two reads).
 */
tdp_err tdp__shm_ring_push(tdp__shm_ring *r, const tdp__shm_desc *d)
{
    if (r->own - r->peer >= r->cap) {
        uint64_t head = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
        uint64_t used = r->own - head;
        /* head may only move forward from what we saw and never pass our tail;
         * in unsigned terms both are "used <= used as last known" */
        if (used > r->own - r->peer)
            return ring_broken(r, head);
        r->peer = head;
        if (used >= r->cap)
            return TDP_EAGAIN;
    }
    uint64_t *w = r->desc + (r->own & r->mask) * 4;
    __atomic_store_n(&w[0], (uint64_t)d->type | ((uint64_t)d->slot << 32), __ATOMIC_RELAXED);
    __atomic_store_n(&w[1], d->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&w[2], d->hash, __ATOMIC_RELAXED);
    __atomic_store_n(&w[3], d->arg, __ATOMIC_RELAXED);
    r->own++;
    atomic_store_explicit(&r->ctl->tail, r->own, memory_order_release);
    return TDP_OK;
}

/* Read the producer's index and check it: forward from what we saw, at
 * most `cap` ahead of what we consumed. */
static tdp_err load_tail(tdp__shm_ring *r)
{
    uint64_t tail = atomic_load_explicit(&r->ctl->tail, memory_order_acquire);
    uint64_t avail = tail - r->own;
    if (avail > r->cap || avail < r->peer - r->own)
        return ring_broken(r, tail);
    r->peer = tail;
    return TDP_OK;
}

tdp_err tdp__shm_ring_pop(tdp__shm_ring *r, tdp__shm_desc *out)
{
    if (r->peer == r->own) {
        tdp_err e = load_tail(r);
        if (e != TDP_OK)
            return e;
        if (r->peer == r->own)
            return TDP_EAGAIN;
    }
    const uint64_t *w = r->desc + (r->own & r->mask) * 4;
    uint64_t w0 = __atomic_load_n(&w[0], __ATOMIC_RELAXED);
    out->type = (uint32_t)w0;
    out->slot = (uint32_t)(w0 >> 32);
    out->seq = __atomic_load_n(&w[1], __ATOMIC_RELAXED);
    out->hash = __atomic_load_n(&w[2], __ATOMIC_RELAXED);
    out->arg = __atomic_load_n(&w[3], __ATOMIC_RELAXED);
    r->own++;
    /* release: our loads of the descriptor happen before the producer may
     * reuse its place */
    atomic_store_explicit(&r->ctl->head, r->own, memory_order_release);
    return TDP_OK;
}

/* The lost-wakeup argument is in shm.h, above tdp__shm_ring_arm. */
tdp_err tdp__shm_ring_notify(tdp__shm_ring *r)
{
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&r->ctl->waiting, memory_order_relaxed) == 0)
        return TDP_OK;
    if (atomic_exchange_explicit(&r->ctl->waiting, 0, memory_order_relaxed) == 0)
        return TDP_OK;
    uint64_t one = 1;
    ssize_t n;
    do {
        n = write(r->efd, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
    /* EAGAIN: the counter is full, the reader has plenty to wake up for */
    if (n == (ssize_t)sizeof(one) || (n < 0 && errno == EAGAIN))
        return TDP_OK;
    tdp_log_error("shm doorbell write: %s", n < 0 ? strerror(errno) : "short write");
    return TDP_EINTERNAL;
}

int tdp__shm_ring_arm(tdp__shm_ring *r)
{
    if (r->peer != r->own)
        return 1;
    atomic_store_explicit(&r->ctl->waiting, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    tdp_err e = load_tail(r);
    if (e != TDP_OK)
        return e;
    if (r->peer != r->own) {
        /* not sleeping after all: spare the sender a needless write */
        atomic_store_explicit(&r->ctl->waiting, 0, memory_order_relaxed);
        return 1;
    }
    return 0;
}

void tdp__shm_ring_drain(tdp__shm_ring *r)
{
    uint64_t v;
    ssize_t n;
    do {
        n = read(r->efd, &v, sizeof(v));
    } while (n < 0 && errno == EINTR);
    (void)n; /* EAGAIN: nothing was pending, which is fine */
}

bool tdp__shm_ring_rung(const tdp__shm_ring *r)
{
    return atomic_load_explicit(&r->ctl->waiting, memory_order_acquire) == 0;
}

int tdp__shm_ring_fd(const tdp__shm_ring *r)
{
    return r->efd;
}

uint32_t tdp__shm_ring_known(const tdp__shm_ring *r)
{
    return (uint32_t)(r->tx ? r->own - r->peer : r->peer - r->own);
}
