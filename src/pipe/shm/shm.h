/*
 * shm.h (internal): primitives of the same-host zero-copy data plane. Linux
 * only (memfd_create, eventfd, abstract Unix sockets).
 *
 * The model
 * ---------
 * The producer owns a pool of `nslots` equal slots in one memfd segment. It
 * fills a slot in place, then pushes a DATA descriptor ("slot i holds message
 * seq s of schema hash h") on the data ring; the consumer pops it, reads the
 * slot where it lies (nothing is copied) and, when done, pushes a RELEASE
 * descriptor ("slot i is free again") on the release ring. A slot belongs to
 * the producer until it sends it and again once it comes back; in between it
 * is lent. The segment and two eventfds travel once over a Unix socket
 * (SCM_RIGHTS); after that only descriptors move, and only through memory.
 *
 * Layout: a header page, the data ring, the release ring (each ring's
 * indices and doorbell word on cache lines of their own), then the slots,
 * page-aligned with a stride that is a multiple of 4096 bytes.
 *
 * Trust: each side treats the other as hostile. Both map the segment
 * writable, so the peer can write anything into it at any time: the header,
 * the indices, the descriptors, the slots. Hence:
 *  - the consumer reads the header once (pread, into a private copy) and
 *    accepts it only if every field matches the layout it recomputes itself,
 *    with checked arithmetic, and the file's size; afterwards only the
 *    private copy is used;
 *  - each side keeps a private copy of the index it owns and only reads the
 *    peer's, which must move forward and stay within the capacity, else
 *    TDP_EPROTO;
 *  - a descriptor is copied out of shared memory before it is looked at, so
 *    the peer cannot change it between the check and the use. Its fields are
 *    the caller's to check (tdp__shm_seg_slot gives NULL for a slot out of
 *    range; whether that slot is lent, and the seq and hash, are the plane's
 *    business);
 *  - slot contents are data, never trusted as structure, and may change
 *    while being read: anything to be validated (a schema, a length) is
 *    copied out first;
 *  - the fds received must be what they claim: a memfd (F_GET_SEALS works)
 *    on shmem, not hugetlbfs (see below), and two eventfds (a socket or
 *    pipe as a doorbell could raise SIGPIPE or block);
 *  - only a process of our own uid can hold the other end of the Unix
 *    socket (SO_PEERCRED, both ways). Anyone of that uid who learns the
 *    abstract name can connect, so the plane should prove the peer (e.g. a
 *    token from the HELLO as the first message). Abstract names live in the
 *    network namespace: same host but another namespace means no shm.
 *
 * No SIGBUS: the producer seals the memfd against shrinking and growing
 * before it is shared, and the consumer refuses a segment without those
 * seals. A mapping can then never extend past the file's end, whatever the
 * producer does later, and the pages live as long as any mapping or fd does:
 * the consumer keeps reading slots it holds after the producer died. A
 * memfd on hugetlbfs (MFD_HUGETLB) is refused although it takes the same
 * seals: the producer could punch a hole in it and take the host's last
 * free huge page, and the consumer's read there would raise SIGBUS. The
 * producer also sets F_SEAL_SEAL, so the consumer cannot add a seal (a write
 * seal) that would lock the producer out. A dead peer is not seen through
 * the segment or the doorbells: the plane watches the socket (or the
 * control channel) for that.
 *
 * Threads: a segment is used by one thread per side (SPSC). Nothing here
 * allocates after create/map; push, pop, arm and notify make no allocation
 * and at most one system call (an eventfd read or write).
 */
#ifndef TDP_PIPE_SHM_H
#define TDP_PIPE_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <tdpipe/err.h>

/* ---- layout -------------------------------------------------------------- */

#define TDP__SHM_MAGIC     0x0031474553504454ull /* "TDPSEG1" little-endian */
#define TDP__SHM_VERSION   1u
#define TDP__SHM_PAGE      4096u
#define TDP__SHM_LINE      64u
#define TDP__SHM_MAX_SLOTS 65536u     /* a receiver's depth is far smaller */
#define TDP__SHM_MAX_RING  (1u << 20) /* descriptors per ring (32 MiB) */

/* The two rings of a segment. */
enum tdp__shm_ring_id {
    TDP__SHM_RING_DATA = 0,    /* producer -> consumer */
    TDP__SHM_RING_RELEASE = 1, /* consumer -> producer */
};

/*
 * The header as it lies at offset 0 of the segment (64 bytes, host byte
 * order: both sides run on one host). The producer writes it once; the
 * consumer reads it once and checks every field.
 */
typedef struct tdp__shm_hdr {
    uint64_t magic;       /* TDP__SHM_MAGIC */
    uint32_t version;     /* TDP__SHM_VERSION */
    uint32_t generation;  /* chosen by the producer, expected by the consumer */
    uint32_t nslots;      /* 1 .. TDP__SHM_MAX_SLOTS */
    uint32_t ring_cap;    /* descriptors per ring: a power of two >= nslots */
    uint64_t slot_bytes;  /* slot stride: a nonzero multiple of TDP__SHM_PAGE */
    uint64_t ring_off[2]; /* by tdp__shm_ring_id */
    uint64_t slots_off;   /* slot 0, page-aligned */
    uint64_t total_bytes; /* the segment's size */
} tdp__shm_hdr;

/* Geometry of a segment; everything in it follows from the first three. */
typedef struct tdp__shm_geom {
    uint32_t nslots;
    uint32_t ring_cap;
    uint64_t slot_bytes; /* stride, rounded up to TDP__SHM_PAGE */
    uint64_t ring_off[2];
    uint64_t slots_off;
    uint64_t total_bytes;
} tdp__shm_geom;

/*
 * Compute the layout for `nslots` slots of at least `slot_bytes` bytes each
 * (rounded up to a page; 0 gives one page) and rings of `ring_cap`
 * descriptors (0: the smallest power of two >= nslots). TDP_EINVAL for
 * nslots out of 1..TDP__SHM_MAX_SLOTS or a ring_cap that is not a power of
 * two in nslots..TDP__SHM_MAX_RING; TDP_EMSGSIZE when the size overflows or
 * exceeds what mmap can take. *out is written only on success.
 */
tdp_err tdp__shm_geom_compute(uint32_t nslots, uint64_t slot_bytes, uint32_t ring_cap,
                              tdp__shm_geom *out);

/* ---- descriptors and rings ----------------------------------------------- */

/* Descriptor types the plane may use; the ring itself does not look at them. */
enum tdp__shm_desc_type {
    TDP__SHM_DESC_DATA = 1,    /* slot holds message seq of schema hash; arg: bytes */
    TDP__SHM_DESC_RELEASE = 2, /* slot is free again */
    /* as DATA, sent while the slot still fills: the bytes there so far are
     * in the sender's progress word for seq (plane_shm.c) */
    TDP__SHM_DESC_DATA_STREAM = 3,
};

/* A descriptor: 32 bytes in the ring, a plain private struct outside it. */
typedef struct tdp__shm_desc {
    uint32_t type;
    uint32_t slot;
    uint64_t seq;
    uint64_t hash;
    uint64_t arg;
} tdp__shm_desc;

#define TDP__SHM_DESC_BYTES 32u

/*
 * A ring in the segment: three cache lines (the tx index "tail", the rx
 * index "head", the rx side's "waiting" word), then ring_cap descriptors of
 * four 64-bit words. Offsets from the ring's start:
 */
#define TDP__SHM_RING_TAIL_OFF    0u
#define TDP__SHM_RING_HEAD_OFF    64u
#define TDP__SHM_RING_WAITING_OFF 128u
#define TDP__SHM_RING_DESC_OFF    192u

struct tdp__shm_ring_ctl; /* the shared part, defined in shm_ring.c */

/*
 * One side's end of a ring: the transmitting end (tx: push, notify) or the
 * receiving end (rx: pop, arm, drain, fd). Plain data, embedded in the
 * segment; fields are private to shm_ring.c.
 */
typedef struct tdp__shm_ring {
    struct tdp__shm_ring_ctl *ctl; /* shared: indices and doorbell word */
    uint64_t *desc;                /* shared: ring_cap descriptors of 4 words */
    uint64_t mask;                 /* ring_cap - 1 */
    uint64_t own;                  /* private copy of the index this side writes */
    uint64_t peer;                 /* last accepted value of the peer's index */
    uint32_t cap;
    bool tx;
    int efd; /* the doorbell: tx writes it, rx waits on it; owned by the segment */
} tdp__shm_ring;

/* Bytes a ring takes in the segment (control lines + descriptors). */
uint64_t tdp__shm_ring_bytes(uint32_t ring_cap);

/*
 * Set up one end of the ring whose shared part starts at `base` (zeroed by
 * the producer's create; both indices start at 0). Used by the segment.
 */
void tdp__shm_ring_init(tdp__shm_ring *r, void *base, uint32_t ring_cap, bool tx, int efd);

/*
 * tx: append a copy of *d. TDP_OK; TDP_EAGAIN when the ring is full (the
 * peer has not popped yet); TDP_EPROTO when the peer's index is impossible
 * (moved back or past ours): the peer is broken or hostile, drop the link.
 * The peer sees the descriptor at once when it polls; call
 * tdp__shm_ring_notify after a push or a batch of pushes to wake it if it
 * sleeps.
 */
tdp_err tdp__shm_ring_push(tdp__shm_ring *r, const tdp__shm_desc *d);

/*
 * rx: take the oldest descriptor into *out (a private copy). TDP_OK;
 * TDP_EAGAIN when empty; TDP_EPROTO as for push. The fields are unchecked.
 */
tdp_err tdp__shm_ring_pop(tdp__shm_ring *r, tdp__shm_desc *out);

/*
 * tx: ring the doorbell if the receiving side said it is about to sleep.
 * TDP_OK, or TDP_EINTERNAL if the eventfd write fails for a reason other
 * than a full counter (which already means "wake up").
 */
tdp_err tdp__shm_ring_notify(tdp__shm_ring *r);

/*
 * rx: announce that this side will sleep on tdp__shm_ring_fd, then look at
 * the ring once more. Returns 0 when armed (empty: wait for the fd), 1 when
 * busy (a descriptor came in meanwhile: pop it instead of sleeping), or
 * TDP_EPROTO. A receiver's loop:
 *
 *     for (;;) {
 *         while (tdp__shm_ring_pop(r, &d) == TDP_OK) handle(&d);
 *         if (tdp__shm_ring_arm(r) == 0) { poll(fd); tdp__shm_ring_drain(r); }
 *     }
 *
 * Why no wakeup is lost: the receiver stores waiting = 1, issues a seq_cst
 * fence, then loads the producer's index; the sender stores its index
 * (release), issues a seq_cst fence, then loads the waiting word. Two seq_cst
 * fences order these four accesses in one total order, so at least one side
 * sees the other's store: either the receiver sees the new descriptor (arm
 * says busy) or the sender sees waiting = 1 (and writes the eventfd), or
 * both (one spurious wakeup). The eventfd keeps its count until drained, so
 * a write made before the receiver calls poll is not lost either; draining
 * before popping means a write after the drain wakes the next poll.
 * A hostile peer can set or clear the waiting word: the first costs the
 * sender an eventfd write per notify, the second only delays a receiver
 * whose sender is the hostile party anyway.
 */
int tdp__shm_ring_arm(tdp__shm_ring *r);

/* rx: reset the doorbell after poll said it is readable (never blocks). */
void tdp__shm_ring_drain(tdp__shm_ring *r);

/*
 * rx, after an arm that said 0 and a wakeup: false when the sender has not
 * rung this ring's doorbell since (the waiting word is still set), so there
 * is nothing to drain. The peer can lie either way: a false "rung" costs a
 * needless read, a false "not rung" leaves its own write undrained (a
 * spurious wakeup, which a caller bounds by draining now and then anyway).
 */
bool tdp__shm_ring_rung(const tdp__shm_ring *r);

/* rx: the fd to poll for POLLIN. Owned by the segment. */
int tdp__shm_ring_fd(const tdp__shm_ring *r);

/* Descriptors the ring holds as far as this side knows (tx: not yet popped
 * when last looked; rx: known to be waiting). Never reads shared memory. */
uint32_t tdp__shm_ring_known(const tdp__shm_ring *r);

/* ---- the segment ----------------------------------------------------------- */

typedef struct tdp__shm_seg tdp__shm_seg;

/*
 * Producer: create a sealed memfd segment with the geometry of
 * tdp__shm_geom_compute, map it, write its header, and make the two
 * doorbell eventfds. The memory is sparse: a page is allocated when first
 * touched, so only slots in use cost memory. The size follows from the
 * peer's depth: check tdp__shm_geom_compute's total_bytes against this
 * side's own limit before creating. Errors as tdp__shm_geom_compute, TDP_ENOMEM when the
 * system refuses memory, fds or the mapping. *out is written only on
 * success; the segment owns the memfd and eventfds.
 */
tdp_err tdp__shm_seg_create(uint32_t generation, uint32_t nslots, uint64_t slot_bytes,
                            uint32_t ring_cap, tdp__shm_seg **out);

/*
 * Consumer: map a segment received from a producer. `memfd` must be a memfd
 * sealed against shrinking and growing whose header is consistent with its
 * size and carries `generation`; `data_efd` and `release_efd` must be
 * eventfds (they are set non-blocking). `max_bytes` caps the size this side
 * accepts to map (0: no cap). On success the segment owns the three fds; on
 * failure they stay the caller's. Errors: TDP_EPROTO for anything not
 * right (logged once, with the reason), TDP_EMSGSIZE over max_bytes,
 * TDP_EINVAL for negative fds, TDP_ENOMEM when mapping or allocating fails.
 */
tdp_err tdp__shm_seg_map(int memfd, int data_efd, int release_efd, uint32_t generation,
                         uint64_t max_bytes, tdp__shm_seg **out);

/* Unmap and close the fds. NULL is a no-op. Slot pointers die with it. */
void tdp__shm_seg_close(tdp__shm_seg *seg);

/* Start of slot i (page-aligned), or NULL when i >= nslots. */
void *tdp__shm_seg_slot(const tdp__shm_seg *seg, uint32_t i);

/* The private (checked) geometry and the generation. */
const tdp__shm_geom *tdp__shm_seg_geom(const tdp__shm_seg *seg);
uint32_t tdp__shm_seg_generation(const tdp__shm_seg *seg);

/* true for a segment made by tdp__shm_seg_create. */
bool tdp__shm_seg_is_producer(const tdp__shm_seg *seg);

/*
 * The fds to pass to the consumer, in this order: memfd, data doorbell,
 * release doorbell. Still owned by the segment (SCM_RIGHTS duplicates them).
 */
void tdp__shm_seg_fds(const tdp__shm_seg *seg, int fds[3]);

/*
 * This side's ring ends. Producer: tx = data ring, rx = release ring.
 * Consumer: tx = release ring, rx = data ring.
 */
tdp__shm_ring *tdp__shm_seg_tx(tdp__shm_seg *seg);
tdp__shm_ring *tdp__shm_seg_rx(tdp__shm_seg *seg);

/* The whole mapping (tests poke at shared memory through it). */
void *tdp__shm_seg_base(const tdp__shm_seg *seg);

/* ---- Unix sockets: fd passing and the abstract listener ------------------ */

#define TDP__SHM_MAX_FDS  8u   /* fds one message may carry */
#define TDP__SHM_NAME_MAX 107u /* abstract name bytes (sun_path less the NUL) */
#define TDP__SHM_NAME_LEN 39u  /* "tdpipe." + 32 hex digits */

/*
 * Send `len` (>= 1) bytes and `nfds` (<= TDP__SHM_MAX_FDS) fds in one
 * message, MSG_NOSIGNAL. The fds stay the caller's. On SOCK_SEQPACKET the
 * message is atomic; on SOCK_STREAM the fds ride with the first byte and the
 * rest of a partial write is finished here, waiting up to a second at a time
 * for the socket to drain. TDP_OK; TDP_EAGAIN when a non-blocking socket
 * took nothing; TDP_ECONNRESET when the peer is gone; TDP_EINVAL;
 * TDP_ETIMEDOUT if a stream never drains; TDP_EINTERNAL otherwise.
 */
tdp_err tdp__shm_sock_send(int sock, const void *buf, size_t len, const int *fds, size_t nfds);

/*
 * Receive one message (SOCK_SEQPACKET) or what is available (SOCK_STREAM:
 * the caller frames) into buf[cap], and up to `maxfds` fds, which arrive
 * close-on-exec. *len and *nfds are written only on success; the fds then
 * belong to the caller. Every fd received is closed when the call fails:
 * more fds than maxfds (TDP_EPROTO), a truncated control message
 * (TDP_EPROTO), a truncated datagram (TDP_EMSGSIZE). TDP_EAGAIN when a
 * non-blocking socket has nothing; TDP_ECLOSED at end of stream;
 * TDP_ECONNRESET when the peer failed.
 */
tdp_err tdp__shm_sock_recv(int sock, void *buf, size_t cap, size_t *len, int *fds, size_t maxfds,
                           size_t *nfds);

/*
 * Listen on a fresh random abstract name ("tdpipe." + 32 hex digits from
 * getrandom): no filesystem entry, gone when the fd closes or the process
 * dies. `type` is SOCK_SEQPACKET or SOCK_STREAM. name[] receives the name
 * bytes (TDP__SHM_NAME_LEN of them, no NUL, no leading zero byte). The fd
 * is close-on-exec, and non-blocking when `nonblock`. *fd and name are
 * written only on success; TDP_EADDR if the name is taken (retried a few
 * times first), TDP_ENOMEM / TDP_EINTERNAL on system failures.
 */
tdp_err tdp__shm_listen(int type, bool nonblock, char name[TDP__SHM_NAME_LEN], int *fd);

/*
 * Accept one connection: close-on-exec, non-blocking when `nonblock`. The
 * peer's uid (SO_PEERCRED) must be this process's euid, else the connection
 * is closed and TDP_ECONNREFUSED returned (logged). *peer_pid (optional)
 * gets the peer's pid. TDP_EAGAIN when none is pending on a non-blocking
 * listener.
 */
tdp_err tdp__shm_accept(int lfd, bool nonblock, int *fd, pid_t *peer_pid);

/*
 * Connect to the abstract name `name` (len bytes, 1..TDP__SHM_NAME_MAX) with
 * a socket of `type`. The listener's uid must be our euid, as for accept.
 * TDP_ECONNREFUSED when nobody listens (or the uid differs); TDP_EAGAIN when
 * a non-blocking connect finds the backlog full; TDP_EINVAL for a bad name.
 */
tdp_err tdp__shm_connect(int type, const char *name, size_t len, bool nonblock, int *fd,
                         pid_t *peer_pid);

#endif
