/* shm_seg.c: the shared-memory segment: geometry, creation, checked mapping. */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <linux/magic.h>

#include "../../core/alloc.h"
#include "../../core/log.h"

_Static_assert(sizeof(tdp__shm_hdr) == 64, "the header is 64 bytes");
_Static_assert(sizeof(tdp__shm_desc) == TDP__SHM_DESC_BYTES, "a descriptor is 32 bytes");

/* Largest segment: whatever both size_t and off_t can hold. */
#define SEG_MAX_BYTES                                                                              \
    ((uint64_t)INT64_MAX < (uint64_t)SIZE_MAX ? (uint64_t)INT64_MAX : (uint64_t)SIZE_MAX)

struct tdp__shm_seg {
    tdp__shm_geom geom; /* private: never read back from the segment */
    uint32_t generation;
    bool producer;
    int memfd;
    int efd[2]; /* doorbells, by tdp__shm_ring_id */
    void *base;
    tdp__shm_ring tx;
    tdp__shm_ring rx;
};

tdp_err tdp__shm_geom_compute(uint32_t nslots, uint64_t slot_bytes, uint32_t ring_cap,
                              tdp__shm_geom *out)
{
    if (nslots == 0 || nslots > TDP__SHM_MAX_SLOTS)
        return TDP_EINVAL;
    if (ring_cap == 0) {
        ring_cap = 1;
        while (ring_cap < nslots)
            ring_cap <<= 1;
    }
    /* ring_cap >= nslots: with each slot in at most one descriptor, an
     * honest peer never finds a ring full */
    if ((ring_cap & (ring_cap - 1)) != 0 || ring_cap < nslots || ring_cap > TDP__SHM_MAX_RING)
        return TDP_EINVAL;

    tdp__shm_geom g = {.nslots = nslots, .ring_cap = ring_cap};
    if (slot_bytes == 0)
        slot_bytes = 1;
    if (__builtin_add_overflow(slot_bytes, (uint64_t)TDP__SHM_PAGE - 1, &g.slot_bytes))
        return TDP_EMSGSIZE;
    g.slot_bytes &= ~(uint64_t)(TDP__SHM_PAGE - 1);

    /* the rings are small (ring_cap is capped), so the header and rings
     * cannot overflow; the slots can */
    uint64_t ring = tdp__shm_ring_bytes(ring_cap);
    g.ring_off[TDP__SHM_RING_DATA] = TDP__SHM_PAGE;
    g.ring_off[TDP__SHM_RING_RELEASE] = TDP__SHM_PAGE + ring;
    uint64_t rings_end = TDP__SHM_PAGE + 2 * ring;
    g.slots_off = (rings_end + TDP__SHM_PAGE - 1) & ~(uint64_t)(TDP__SHM_PAGE - 1);
    uint64_t slots;
    if (__builtin_mul_overflow((uint64_t)nslots, g.slot_bytes, &slots) ||
        __builtin_add_overflow(g.slots_off, slots, &g.total_bytes) || g.total_bytes > SEG_MAX_BYTES)
        return TDP_EMSGSIZE;
    *out = g;
    return TDP_OK;
}

static void seg_rings(tdp__shm_seg *seg)
{
    const tdp__shm_geom *g = &seg->geom;
    char *b = seg->base;
    int tx_id = seg->producer ? TDP__SHM_RING_DATA : TDP__SHM_RING_RELEASE;
    int rx_id = seg->producer ? TDP__SHM_RING_RELEASE : TDP__SHM_RING_DATA;
    tdp__shm_ring_init(&seg->tx, b + g->ring_off[tx_id], g->ring_cap, true, seg->efd[tx_id]);
    tdp__shm_ring_init(&seg->rx, b + g->ring_off[rx_id], g->ring_cap, false, seg->efd[rx_id]);
}

static void write_hdr(void *base, const tdp__shm_geom *g, uint32_t generation)
{
    tdp__shm_hdr h = {
        .magic = TDP__SHM_MAGIC,
        .version = TDP__SHM_VERSION,
        .generation = generation,
        .nslots = g->nslots,
        .ring_cap = g->ring_cap,
        .slot_bytes = g->slot_bytes,
        .ring_off = {g->ring_off[0], g->ring_off[1]},
        .slots_off = g->slots_off,
        .total_bytes = g->total_bytes,
    };
    memcpy(base, &h, sizeof(h));
}

static tdp_err errno_to_err(int e)
{
    return (e == ENOMEM || e == EMFILE || e == ENFILE || e == ENOSPC || e == EFBIG) ? TDP_ENOMEM
                                                                                    : TDP_EINTERNAL;
}

tdp_err tdp__shm_seg_create(uint32_t generation, uint32_t nslots, uint64_t slot_bytes,
                            uint32_t ring_cap, tdp__shm_seg **out)
{
    tdp__shm_geom g;
    tdp_err err = tdp__shm_geom_compute(nslots, slot_bytes, ring_cap, &g);
    if (err != TDP_OK)
        return err;

    void *base;
    tdp__shm_seg *seg = tdp__calloc(1, sizeof(*seg));
    if (seg == NULL)
        return TDP_ENOMEM;
    seg->geom = g;
    seg->generation = generation;
    seg->producer = true;
    seg->memfd = seg->efd[0] = seg->efd[1] = -1;

    const char *what = "memfd_create";
    seg->memfd = memfd_create("tdpipe-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (seg->memfd < 0)
        goto err_sys;
    what = "ftruncate";
    if (ftruncate(seg->memfd, (off_t)g.total_bytes) != 0)
        goto err_sys;
    /* Before anyone else sees the fd: no size change ever (no SIGBUS for a
     * mapping), and no further seal (the consumer cannot seal us out of
     * writing) */
    what = "F_ADD_SEALS";
    if (fcntl(seg->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        goto err_sys;
    what = "mmap";
    base = mmap(NULL, (size_t)g.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, seg->memfd, 0);
    if (base == MAP_FAILED)
        goto err_sys;
    seg->base = base;
    what = "eventfd";
    for (int i = 0; i < 2; i++) {
        seg->efd[i] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (seg->efd[i] < 0)
            goto err_sys;
    }

    write_hdr(base, &g, generation); /* the rest is zero: both rings start empty */
    seg_rings(seg);
    *out = seg;
    return TDP_OK;

err_sys:
    err = errno_to_err(errno);
    tdp_log_error("shm segment (%llu bytes): %s: %s", (unsigned long long)g.total_bytes, what,
                  strerror(errno));
    tdp__shm_seg_close(seg);
    return err;
}

/* Refuse a segment offered by the peer: log why once, return EPROTO. */
static tdp_err refuse(const char *fmt, ...) TDP_CHECK_FMT(1, 2);
static tdp_err refuse(const char *fmt, ...)
{
    if (TDP_LOG_WARN <= tdp__log_level) {
        char why[256];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, sizeof(why), fmt, ap);
        va_end(ap);
        tdp_log_warn("shm segment refused: %s", why);
    }
    return TDP_EPROTO;
}

/* Every field must be what this side computes from nslots, slot_bytes and
 * ring_cap, and the total the file's size: one rule, no partial trust. */
static tdp_err check_hdr(const tdp__shm_hdr *h, uint32_t generation, uint64_t size,
                         tdp__shm_geom *out)
{
    tdp__shm_geom g;
    if (h->magic != TDP__SHM_MAGIC)
        return refuse("bad magic %#llx", (unsigned long long)h->magic);
    if (h->version != TDP__SHM_VERSION)
        return refuse("layout version %u, this side knows %u", h->version, TDP__SHM_VERSION);
    if (h->generation != generation)
        return refuse("generation %u, expected %u", h->generation, generation);
    if (h->ring_cap == 0 || h->slot_bytes == 0 ||
        tdp__shm_geom_compute(h->nslots, h->slot_bytes, h->ring_cap, &g) != TDP_OK)
        return refuse("impossible geometry: %u slots of %llu bytes, rings of %u", h->nslots,
                      (unsigned long long)h->slot_bytes, h->ring_cap);
    if (g.slot_bytes != h->slot_bytes)
        return refuse("slot stride %llu is not a multiple of %u", (unsigned long long)h->slot_bytes,
                      TDP__SHM_PAGE);
    if (g.ring_off[0] != h->ring_off[0] || g.ring_off[1] != h->ring_off[1] ||
        g.slots_off != h->slots_off || g.total_bytes != h->total_bytes)
        return refuse("offsets %llu/%llu/%llu/%llu differ from the layout's %llu/%llu/%llu/%llu",
                      (unsigned long long)h->ring_off[0], (unsigned long long)h->ring_off[1],
                      (unsigned long long)h->slots_off, (unsigned long long)h->total_bytes,
                      (unsigned long long)g.ring_off[0], (unsigned long long)g.ring_off[1],
                      (unsigned long long)g.slots_off, (unsigned long long)g.total_bytes);
    if (g.total_bytes != size)
        return refuse("header says %llu bytes, the memfd has %llu",
                      (unsigned long long)g.total_bytes, (unsigned long long)size);
    *out = g;
    return TDP_OK;
}

/*
 * A doorbell must be an eventfd: anything else (a socket that raises
 * SIGPIPE, a pipe that blocks) would let the peer stall or kill us. Where
 * /proc is missing, at least refuse the kinds of fd that could.
 */
static tdp_err check_eventfd(int fd, const char *what)
{
    char path[64], link[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof(link) - 1);
    if (n >= 0) {
        link[n] = '\0';
        if (strcmp(link, "anon_inode:[eventfd]") != 0)
            return refuse("the %s doorbell is %s, not an eventfd", what, link);
    } else {
        struct stat st;
        if (fstat(fd, &st) != 0)
            return refuse("the %s doorbell: %s", what, strerror(errno));
        if (S_ISSOCK(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISCHR(st.st_mode) ||
            S_ISBLK(st.st_mode) || S_ISDIR(st.st_mode))
            return refuse("the %s doorbell is not an eventfd (mode %o)", what,
                          (unsigned)st.st_mode);
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || ((fl & O_NONBLOCK) == 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0))
        return refuse("the %s doorbell: cannot make it non-blocking: %s", what, strerror(errno));
    return TDP_OK;
}

tdp_err tdp__shm_seg_map(int memfd, int data_efd, int release_efd, uint32_t generation,
                         uint64_t max_bytes, tdp__shm_seg **out)
{
    if (memfd < 0 || data_efd < 0 || release_efd < 0 || out == NULL)
        return TDP_EINVAL;

    /* Seals first: once SHRINK and GROW are there, they stay (seals are
     * only ever added), so the size read next cannot change under us */
    int seals = fcntl(memfd, F_GET_SEALS);
    if (seals < 0)
        return refuse("not a memfd (F_GET_SEALS: %s)", strerror(errno));
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
        return refuse("the memfd may still be resized (seals %#x)", (unsigned)seals);
    int write_seals = F_SEAL_WRITE;
#ifdef F_SEAL_FUTURE_WRITE
    write_seals |= F_SEAL_FUTURE_WRITE;
#endif
    if (seals & write_seals)
        return refuse("the memfd is sealed against writing (seals %#x)", (unsigned)seals);
    /* shmem only: a hugetlbfs memfd takes the same seals, but its pages come
     * from the host's pool of huge pages, and a read of one the producer
     * punched out while that pool is empty raises SIGBUS */
    struct statfs sf;
    if (fstatfs(memfd, &sf) != 0)
        return refuse("fstatfs: %s", strerror(errno));
    if (sf.f_type != TMPFS_MAGIC)
        return refuse("the memfd is not shared memory (file system %#llx)",
                      (unsigned long long)sf.f_type);

    struct stat st;
    if (fstat(memfd, &st) != 0)
        return refuse("fstat: %s", strerror(errno));
    if (!S_ISREG(st.st_mode) || st.st_size < (off_t)TDP__SHM_PAGE)
        return refuse("%lld bytes: not a segment", (long long)st.st_size);
    uint64_t size = (uint64_t)st.st_size;
    if (max_bytes != 0 && size > max_bytes) {
        tdp_log_warn("shm segment refused: %llu bytes, this side maps at most %llu",
                     (unsigned long long)size, (unsigned long long)max_bytes);
        return TDP_EMSGSIZE;
    }

    /* One read into private memory: the peer may rewrite the header any
     * time after, it no longer matters */
    tdp__shm_hdr h;
    ssize_t n;
    do {
        n = pread(memfd, &h, sizeof(h), 0);
    } while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof(h))
        return refuse("header read: %s", n < 0 ? strerror(errno) : "short");
    tdp__shm_geom g;
    tdp_err err = check_hdr(&h, generation, size, &g);
    if (err != TDP_OK)
        return err;
    if ((err = check_eventfd(data_efd, "data")) != TDP_OK ||
        (err = check_eventfd(release_efd, "release")) != TDP_OK)
        return err;

    void *base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        if (e == EACCES || e == EPERM || e == ENODEV || e == EINVAL)
            return refuse("mmap: %s", strerror(e));
        tdp_log_error("shm segment (%llu bytes): mmap: %s", (unsigned long long)size, strerror(e));
        return errno_to_err(e);
    }
    tdp__shm_seg *seg = tdp__calloc(1, sizeof(*seg));
    if (seg == NULL) {
        munmap(base, (size_t)size);
        return TDP_ENOMEM;
    }
    seg->geom = g;
    seg->generation = generation;
    seg->producer = false;
    seg->memfd = memfd;
    seg->efd[TDP__SHM_RING_DATA] = data_efd;
    seg->efd[TDP__SHM_RING_RELEASE] = release_efd;
    seg->base = base;
    seg_rings(seg);
    *out = seg;
    return TDP_OK;
}

void tdp__shm_seg_close(tdp__shm_seg *seg)
{
    if (seg == NULL)
        return;
    if (seg->base != NULL)
        munmap(seg->base, (size_t)seg->geom.total_bytes);
    for (int i = 0; i < 2; i++)
        if (seg->efd[i] >= 0)
            close(seg->efd[i]);
    if (seg->memfd >= 0)
        close(seg->memfd);
    tdp__free(seg);
}

void *tdp__shm_seg_slot(const tdp__shm_seg *seg, uint32_t i)
{
    if (i >= seg->geom.nslots)
        return NULL;
    return (char *)seg->base + seg->geom.slots_off + (uint64_t)i * seg->geom.slot_bytes;
}

const tdp__shm_geom *tdp__shm_seg_geom(const tdp__shm_seg *seg)
{
    return &seg->geom;
}

uint32_t tdp__shm_seg_generation(const tdp__shm_seg *seg)
{
    return seg->generation;
}

bool tdp__shm_seg_is_producer(const tdp__shm_seg *seg)
{
    return seg->producer;
}

void tdp__shm_seg_fds(const tdp__shm_seg *seg, int fds[3])
{
    fds[0] = seg->memfd;
    fds[1] = seg->efd[TDP__SHM_RING_DATA];
    fds[2] = seg->efd[TDP__SHM_RING_RELEASE];
}

tdp__shm_ring *tdp__shm_seg_tx(tdp__shm_seg *seg)
{
    return &seg->tx;
}

tdp__shm_ring *tdp__shm_seg_rx(tdp__shm_seg *seg)
{
    return &seg->rx;
}

void *tdp__shm_seg_base(const tdp__shm_seg *seg)
{
    return seg->base;
}
