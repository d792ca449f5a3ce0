/*
 * test_shm: the shm plane's primitives: segment geometry and checked
 * mapping, SPSC rings and doorbells, fd passing, the abstract listener;
 * across processes, and against a hostile peer.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <tdpipe/mem.h>

#include "pipe/shm/shm.h"

/* ---- helpers ----------------------------------------------------------- */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n;
}

static bool fd_closed(int fd)
{
    return fcntl(fd, F_GETFD) == -1 && errno == EBADF;
}

/* The k numbers the kernel will give the next k fds: the lowest free ones. */
static void next_free_fds(int *out, int k)
{
    int n = 0;
    for (int fd = 0; n < k && fd < 4096; fd++)
        if (fd_closed(fd))
            out[n++] = fd;
    assert_int_equal(n, k);
}

/* Wait for a child with a deadline; kill it when it overstays. Returns its
 * wait status. */
static int reap(pid_t pid, int timeout_ms)
{
    int st = 0;
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return st;
        if (r < 0 && errno != EINTR)
            return -1;
        if (now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        usleep(1000);
    }
}

static void dup3fds(const tdp__shm_seg *seg, int out[3])
{
    int fds[3];
    tdp__shm_seg_fds(seg, fds);
    for (int i = 0; i < 3; i++) {
        out[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0);
        assert_true(out[i] >= 0);
    }
}

static void close3(const int fds[3])
{
    for (int i = 0; i < 3; i++)
        close(fds[i]);
}

/* A producer's segment and a consumer's mapping of it, in one process. */
static void pair(uint32_t gen, uint32_t nslots, uint64_t slot_bytes, uint32_t cap,
                 tdp__shm_seg **prod, tdp__shm_seg **cons)
{
    assert_int_equal(tdp__shm_seg_create(gen, nslots, slot_bytes, cap, prod), TDP_OK);
    int fds[3];
    dup3fds(*prod, fds);
    assert_int_equal(tdp__shm_seg_map(fds[0], fds[1], fds[2], gen, 0, cons), TDP_OK);
}

static _Atomic uint64_t *ring_word(tdp__shm_seg *seg, int ring, unsigned off)
{
    char *b = tdp__shm_seg_base(seg);
    return (_Atomic uint64_t *)(b + tdp__shm_seg_geom(seg)->ring_off[ring] + off);
}

/* Byte j of message seq: differs per message and per position. */
static uint8_t pattern(uint64_t seq, uint64_t j)
{
    return (uint8_t)(seq * 131u + j * 7u + (j >> 8));
}

static uint64_t fill(void *slot, uint64_t seq, uint64_t len)
{
    uint8_t *p = slot;
    uint64_t sum = 0;
    for (uint64_t j = 0; j < len; j++) {
        p[j] = pattern(seq, j);
        sum += p[j];
    }
    return sum;
}

/* ---- geometry ------------------------------------------------------------ */

static void test_geom(void **state)
{
    (void)state;
    tdp__shm_geom g;
    assert_int_equal(tdp__shm_geom_compute(5, 1000, 0, &g), TDP_OK);
    assert_int_equal(g.nslots, 5);
    assert_int_equal(g.ring_cap, 8);
    assert_int_equal(g.slot_bytes, 4096);
    assert_int_equal(g.ring_off[0], 4096);
    assert_true(g.ring_off[1] >= g.ring_off[0] + TDP__SHM_RING_DESC_OFF + 8 * 32);
    assert_int_equal(g.ring_off[1] % 64, 0);
    assert_int_equal(g.slots_off % 4096, 0);
    assert_true(g.slots_off >= g.ring_off[1] + TDP__SHM_RING_DESC_OFF + 8 * 32);
    assert_int_equal(g.total_bytes, g.slots_off + 5 * 4096);

    assert_int_equal(tdp__shm_geom_compute(1, 0, 0, &g), TDP_OK);
    assert_int_equal(g.slot_bytes, 4096);
    assert_int_equal(g.ring_cap, 1);
    assert_int_equal(tdp__shm_geom_compute(3, 4096, 64, &g), TDP_OK);
    assert_int_equal(g.slot_bytes, 4096);
    assert_int_equal(g.ring_cap, 64);
    assert_int_equal(tdp__shm_geom_compute(3, 4097, 0, &g), TDP_OK);
    assert_int_equal(g.slot_bytes, 8192);

    assert_int_equal(tdp__shm_geom_compute(0, 100, 0, &g), TDP_EINVAL);
    assert_int_equal(tdp__shm_geom_compute(TDP__SHM_MAX_SLOTS + 1, 100, 0, &g), TDP_EINVAL);
    assert_int_equal(tdp__shm_geom_compute(4, 100, 3, &g), TDP_EINVAL);
    assert_int_equal(tdp__shm_geom_compute(4, 100, 2, &g), TDP_EINVAL);
    assert_int_equal(tdp__shm_geom_compute(4, 100, TDP__SHM_MAX_RING * 2, &g), TDP_EINVAL);
    assert_int_equal(tdp__shm_geom_compute(1, UINT64_MAX - 10, 0, &g), TDP_EMSGSIZE);
    assert_int_equal(tdp__shm_geom_compute(65536, (uint64_t)1 << 50, 0, &g), TDP_EMSGSIZE);
    assert_int_equal(tdp__shm_geom_compute(2, (uint64_t)1 << 62, 0, &g), TDP_EMSGSIZE);
}

/* ---- one process: create, map, geometry, slots, rings -------------------- */

static void test_create_map(void **state)
{
    (void)state;
    tdp__shm_seg *p = NULL, *c = NULL;
    pair(7, 5, 1000, 0, &p, &c);
    const tdp__shm_geom *gp = tdp__shm_seg_geom(p), *gc = tdp__shm_seg_geom(c);
    assert_memory_equal(gp, gc, sizeof(*gp));
    assert_int_equal(tdp__shm_seg_generation(c), 7);
    assert_true(tdp__shm_seg_is_producer(p));
    assert_false(tdp__shm_seg_is_producer(c));
    assert_ptr_not_equal(tdp__shm_seg_base(p), tdp__shm_seg_base(c));

    /* slots: aligned, in bounds, shared */
    for (uint32_t i = 0; i < 5; i++) {
        uint8_t *sp = tdp__shm_seg_slot(p, i), *sc = tdp__shm_seg_slot(c, i);
        assert_non_null(sp);
        assert_non_null(sc);
        assert_int_equal((uintptr_t)sp % 64, 0);
        assert_int_equal((uintptr_t)sc % 4096, 0);
        assert_ptr_equal(sp, (uint8_t *)tdp__shm_seg_base(p) + gp->slots_off + i * 4096ull);
        fill(sp, i, 4096);
        for (uint64_t j = 0; j < 4096; j += 511)
            assert_int_equal(sc[j], pattern(i, j));
        sc[4095] = 0x5a; /* the last byte is mapped (ASan has no say: mmap) */
        assert_int_equal(sp[4095], 0x5a);
    }
    assert_null(tdp__shm_seg_slot(p, 5));
    assert_null(tdp__shm_seg_slot(c, 5));
    assert_null(tdp__shm_seg_slot(c, UINT32_MAX));

    /* data ring: producer -> consumer, FIFO, full at capacity */
    tdp__shm_ring *ptx = tdp__shm_seg_tx(p), *crx = tdp__shm_seg_rx(c);
    tdp__shm_desc d, o;
    assert_int_equal(tdp__shm_ring_pop(crx, &o), TDP_EAGAIN);
    for (uint32_t i = 0; i < 8; i++) {
        d = (tdp__shm_desc){TDP__SHM_DESC_DATA, i % 5, 100 + i, 0xabcdef0123456789ull, i * 3};
        assert_int_equal(tdp__shm_ring_push(ptx, &d), TDP_OK);
    }
    assert_int_equal(tdp__shm_ring_known(ptx), 8);
    assert_int_equal(tdp__shm_ring_push(ptx, &d), TDP_EAGAIN);
    for (uint32_t i = 0; i < 8; i++) {
        assert_int_equal(tdp__shm_ring_pop(crx, &o), TDP_OK);
        assert_int_equal(o.type, TDP__SHM_DESC_DATA);
        assert_int_equal(o.slot, i % 5);
        assert_int_equal(o.seq, 100 + i);
        assert_int_equal(o.hash, 0xabcdef0123456789ull);
        assert_int_equal(o.arg, i * 3);
    }
    assert_int_equal(tdp__shm_ring_pop(crx, &o), TDP_EAGAIN);
    /* room again, seen once the producer looks at the consumer's index */
    assert_int_equal(tdp__shm_ring_push(ptx, &d), TDP_OK);
    assert_int_equal(tdp__shm_ring_pop(crx, &o), TDP_OK);

    /* release ring: consumer -> producer; wraps many times */
    tdp__shm_ring *ctx = tdp__shm_seg_tx(c), *prx = tdp__shm_seg_rx(p);
    for (uint32_t i = 0; i < 1000; i++) {
        d = (tdp__shm_desc){TDP__SHM_DESC_RELEASE, i % 5, i, 0, 0};
        assert_int_equal(tdp__shm_ring_push(ctx, &d), TDP_OK);
        assert_int_equal(tdp__shm_ring_pop(prx, &o), TDP_OK);
        assert_int_equal(o.type, TDP__SHM_DESC_RELEASE);
        assert_int_equal(o.seq, i);
    }

    /* the consumer cannot resize the segment: it is sealed */
    int fds[3];
    tdp__shm_seg_fds(c, fds);
    assert_int_equal(ftruncate(fds[0], 0), -1);
    assert_int_equal(errno, EPERM);
    assert_int_equal(ftruncate(fds[0], (off_t)gp->total_bytes * 2), -1);
    assert_int_equal(errno, EPERM);
    /* nor add a seal (the producer's F_SEAL_SEAL) */
    assert_int_equal(fcntl(fds[0], F_ADD_SEALS, F_SEAL_WRITE), -1);

    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);
}

static void test_map_limit(void **state)
{
    (void)state;
    tdp__shm_seg *p = NULL, *c = NULL;
    assert_int_equal(tdp__shm_seg_create(1, 4, 64 << 10, 0, &p), TDP_OK);
    uint64_t total = tdp__shm_seg_geom(p)->total_bytes;
    int fds[3];
    dup3fds(p, fds);
    assert_int_equal(tdp__shm_seg_map(fds[0], fds[1], fds[2], 1, total - 1, &c), TDP_EMSGSIZE);
    assert_null(c);
    assert_int_equal(tdp__shm_seg_map(fds[0], fds[1], fds[2], 2, 0, &c), TDP_EPROTO);
    assert_int_equal(tdp__shm_seg_map(-1, fds[1], fds[2], 1, 0, &c), TDP_EINVAL);
    assert_null(c);
    /* the failures left the fds to us, open */
    for (int i = 0; i < 3; i++)
        assert_false(fd_closed(fds[i]));
    assert_int_equal(tdp__shm_seg_map(fds[0], fds[1], fds[2], 1, total, &c), TDP_OK);
    tdp__shm_seg_close(c);
    for (int i = 0; i < 3; i++)
        assert_true(fd_closed(fds[i]));
    tdp__shm_seg_close(p);
    tdp__shm_seg_close(NULL);
}

/* ---- doorbells -------------------------------------------------------------- */

static int readable(int fd, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, timeout_ms);
}

static void test_doorbell(void **state)
{
    (void)state;
    tdp__shm_seg *p = NULL, *c = NULL;
    pair(3, 2, 100, 0, &p, &c);
    tdp__shm_desc d = {TDP__SHM_DESC_DATA, 0, 1, 2, 3}, o;

    /* both directions: producer -> consumer and back */
    tdp__shm_ring *txs[2] = {tdp__shm_seg_tx(p), tdp__shm_seg_tx(c)};
    tdp__shm_ring *rxs[2] = {tdp__shm_seg_rx(c), tdp__shm_seg_rx(p)};
    for (int k = 0; k < 2; k++) {
        tdp__shm_ring *tx = txs[k], *rx = rxs[k];
        int fd = tdp__shm_ring_fd(rx);

        /* not armed: a push rings nothing */
        assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
        assert_int_equal(tdp__shm_ring_notify(tx), TDP_OK);
        assert_int_equal(readable(fd, 0), 0);
        /* armed on a non-empty ring: busy, and the word is left clear */
        assert_int_equal(tdp__shm_ring_arm(rx), 1);
        assert_int_equal(tdp__shm_ring_notify(tx), TDP_OK);
        assert_int_equal(readable(fd, 0), 0);
        assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK);
        assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_EAGAIN);

        /* armed on an empty ring: the next notify rings, once */
        assert_int_equal(tdp__shm_ring_arm(rx), 0);
        assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
        assert_int_equal(tdp__shm_ring_notify(tx), TDP_OK);
        assert_int_equal(readable(fd, 0), 1);
        tdp__shm_ring_drain(rx);
        assert_int_equal(readable(fd, 0), 0);
        assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
        assert_int_equal(tdp__shm_ring_notify(tx), TDP_OK); /* the word was cleared */
        assert_int_equal(readable(fd, 0), 0);
        tdp__shm_ring_drain(rx); /* nothing pending: must not block */
        assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK);
        assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK);
        assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_EAGAIN);
    }
    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);
}

/* ---- two processes ---------------------------------------------------------- */

#define XP_MESSAGES 10000u
#define XP_SLOTS    4u
#define XP_SLOT_MAX (3 * 4096u)
#define XP_WAIT_MS  5000 /* a poll that sleeps this long lost a wakeup */
#define XP_DEADLINE 60000

typedef struct xp_hello {
    uint32_t generation;
    uint32_t nslots;
} xp_hello;

/* Sleep on a ring's doorbell; false when the wakeup never came. */
static bool doorbell_wait(tdp__shm_ring *rx, unsigned *sleeps)
{
    int a = tdp__shm_ring_arm(rx);
    if (a < 0)
        return false;
    if (a == 1)
        return true;
    (*sleeps)++;
    if (readable(tdp__shm_ring_fd(rx), XP_WAIT_MS) != 1)
        return false;
    tdp__shm_ring_drain(rx);
    return true;
}

/*
 * The consumer's loop: check every byte of every message where the
 * producer wrote it, give the slots back. Returns 0 or a code that names the
 * failure (a child's exit status, a thread's result).
 */
static int consume(const tdp__shm_seg *seg, tdp__shm_ring *rx, tdp__shm_ring *tx, const char *who)
{
    uint64_t next = 0;
    unsigned sleeps = 0;
    int64_t end = now_ms() + XP_DEADLINE;
    int rc = 0;
    uint64_t allocs = tdp_mem_total_allocs();
    for (;;) {
        if (now_ms() > end) {
            rc = 13;
            break;
        }
        tdp__shm_desc d;
        tdp_err e = tdp__shm_ring_pop(rx, &d);
        if (e == TDP_EAGAIN) {
            if (!doorbell_wait(rx, &sleeps)) {
                rc = 14;
                break;
            }
            continue;
        }
        if (e != TDP_OK) {
            rc = 15;
            break;
        }
        if (d.type == 99 && d.seq == XP_MESSAGES)
            break; /* the end */
        const uint8_t *s = tdp__shm_seg_slot(seg, d.slot);
        if (d.type != TDP__SHM_DESC_DATA || s == NULL || d.seq != next || d.arg > XP_SLOT_MAX ||
            d.hash != 0x1234) {
            rc = 16;
            break;
        }
        uint64_t sum = 0;
        for (uint64_t j = 0; j < d.arg; j++) {
            if (s[j] != pattern(d.seq, j)) {
                rc = 17;
                break;
            }
            sum += s[j];
        }
        if (rc != 0)
            break;
        next++;
        tdp__shm_desc r = {TDP__SHM_DESC_RELEASE, d.slot, d.seq, 0, sum};
        if (tdp__shm_ring_push(tx, &r) != TDP_OK || tdp__shm_ring_notify(tx) != TDP_OK) {
            rc = 18;
            break;
        }
    }
    if (rc == 0 && next != XP_MESSAGES)
        rc = 19;
    if (rc == 0 && tdp_mem_total_allocs() != allocs)
        rc = 22; /* the steady state allocates nothing */
    printf("%s: %llu messages, %u sleeps on the doorbell, result %d\n", who,
           (unsigned long long)next, sleeps, rc);
    fflush(stdout);
    return rc;
}

/* The child: receive the segment over the socket, map it, consume. */
static int consumer_main(int sock)
{
    xp_hello h;
    size_t len = 0, nfds = 0;
    int fds[3];
    if (tdp__shm_sock_recv(sock, &h, sizeof(h), &len, fds, 3, &nfds) != TDP_OK ||
        len != sizeof(h) || nfds != 3)
        return 10;
    tdp__shm_seg *seg = NULL;
    if (tdp__shm_seg_map(fds[0], fds[1], fds[2], h.generation, 64 << 20, &seg) != TDP_OK)
        return 11;
    if (tdp__shm_seg_geom(seg)->nslots != h.nslots)
        return 12;
    int rc = consume(seg, tdp__shm_seg_rx(seg), tdp__shm_seg_tx(seg), "consumer");
    tdp__shm_seg_close(seg);
    return rc;
}

/* The producer's loop: lend XP_SLOTS slots, XP_MESSAGES times, then wait
 * for every slot to come back and send the end. */
static void produce(tdp__shm_seg *seg)
{
    tdp__shm_ring *tx = tdp__shm_seg_tx(seg), *rx = tdp__shm_seg_rx(seg);
    uint32_t free_slots[XP_SLOTS], nfree = XP_SLOTS;
    bool lent[XP_SLOTS] = {false};
    uint64_t lent_seq[XP_SLOTS], lent_sum[XP_SLOTS];
    for (uint32_t i = 0; i < XP_SLOTS; i++)
        free_slots[i] = XP_SLOTS - 1 - i;
    unsigned sleeps = 0;
    int64_t end = now_ms() + XP_DEADLINE;
    uint64_t allocs = tdp_mem_total_allocs();

    uint64_t seq = 0;
    while (seq < XP_MESSAGES || nfree < XP_SLOTS) {
        assert_true(now_ms() < end);
        /* take back what the consumer released; check it was lent */
        tdp__shm_desc r;
        tdp_err e;
        while ((e = tdp__shm_ring_pop(rx, &r)) == TDP_OK) {
            assert_int_equal(r.type, TDP__SHM_DESC_RELEASE);
            assert_true(r.slot < XP_SLOTS);
            assert_true(lent[r.slot]);
            assert_int_equal(r.seq, lent_seq[r.slot]);
            assert_int_equal(r.arg, lent_sum[r.slot]); /* the consumer read our bytes */
            lent[r.slot] = false;
            free_slots[nfree++] = r.slot;
        }
        assert_int_equal(e, TDP_EAGAIN);
        if (nfree == 0 || seq == XP_MESSAGES) {
            if (nfree < XP_SLOTS)
                assert_true(doorbell_wait(rx, &sleeps));
            continue;
        }
        uint32_t slot = free_slots[--nfree];
        uint64_t len = 1 + (seq * 977) % XP_SLOT_MAX;
        lent_sum[slot] = fill(tdp__shm_seg_slot(seg, slot), seq, len);
        lent_seq[slot] = seq;
        lent[slot] = true;
        tdp__shm_desc d = {TDP__SHM_DESC_DATA, slot, seq, 0x1234, len};
        assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
        assert_int_equal(tdp__shm_ring_notify(tx), TDP_OK);
        seq++;
    }
    assert_int_equal(tdp_mem_total_allocs(), allocs); /* the steady state allocates nothing */
    tdp__shm_desc fin = {99, 0, XP_MESSAGES, 0, 0};
    assert_int_equal(tdp__shm_ring_push(tx, &fin), TDP_OK);
    assert_int_equal(tdp__shm_ring_notify(tx), TDP_OK);
    printf("producer: %llu messages, %u sleeps on the doorbell\n", (unsigned long long)seq, sleeps);
}

/* The parent: create the segment, pass it, produce, reap the child. */
static void producer_run(int sock, pid_t child)
{
    tdp__shm_seg *seg = NULL;
    /* made after the fork: the child can only reach it through the socket */
    assert_int_equal(tdp__shm_seg_create(42, XP_SLOTS, XP_SLOT_MAX, 0, &seg), TDP_OK);
    int fds[3];
    tdp__shm_seg_fds(seg, fds);
    xp_hello h = {42, XP_SLOTS};
    assert_int_equal(tdp__shm_sock_send(sock, &h, sizeof(h), fds, 3), TDP_OK);
    produce(seg);
    int st = reap(child, XP_DEADLINE);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    tdp__shm_seg_close(seg);
}

static void test_cross_process_socketpair(void **state)
{
    (void)state;
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    fflush(stdout);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        _exit(consumer_main(sv[1]));
    }
    close(sv[1]);
    producer_run(sv[0], pid);
    close(sv[0]);
}

static void test_cross_process_listener(void **state)
{
    (void)state;
    char name[TDP__SHM_NAME_LEN];
    int lfd = -1;
    assert_int_equal(tdp__shm_listen(SOCK_SEQPACKET, true, name, &lfd), TDP_OK);
    fflush(stdout);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(lfd);
        int s = -1;
        pid_t peer = 0;
        if (tdp__shm_connect(SOCK_SEQPACKET, name, sizeof(name), false, &s, &peer) != TDP_OK)
            _exit(20);
        if (peer != getppid())
            _exit(21);
        _exit(consumer_main(s));
    }
    assert_int_equal(readable(lfd, XP_WAIT_MS), 1);
    int s = -1;
    pid_t peer = 0;
    assert_int_equal(tdp__shm_accept(lfd, false, &s, &peer), TDP_OK);
    assert_int_equal(peer, pid);
    close(lfd);
    producer_run(s, pid);
    close(s);
}

/*
 * The same exchange between two threads over one mapping: the consumer's
 * ring ends are set up over the producer's own addresses, so a
 * ThreadSanitizer build checks the ordering of slot bytes, descriptors and
 * indices (across processes it sees nothing).
 */
typedef struct thread_consumer {
    tdp__shm_seg *seg;
    tdp__shm_ring rx, tx;
    int rc;
} thread_consumer;

static void *consumer_thread(void *arg)
{
    thread_consumer *tc = arg;
    tc->rc = consume(tc->seg, &tc->rx, &tc->tx, "consumer thread");
    return NULL;
}

static void test_threads_one_mapping(void **state)
{
    (void)state;
    tdp__shm_seg *seg = NULL;
    assert_int_equal(tdp__shm_seg_create(8, XP_SLOTS, XP_SLOT_MAX, 0, &seg), TDP_OK);
    const tdp__shm_geom *g = tdp__shm_seg_geom(seg);
    char *base = tdp__shm_seg_base(seg);
    int fds[3];
    tdp__shm_seg_fds(seg, fds);
    thread_consumer tc = {.seg = seg, .rc = -1};
    tdp__shm_ring_init(&tc.rx, base + g->ring_off[TDP__SHM_RING_DATA], g->ring_cap, false, fds[1]);
    tdp__shm_ring_init(&tc.tx, base + g->ring_off[TDP__SHM_RING_RELEASE], g->ring_cap, true,
                       fds[2]);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, consumer_thread, &tc), 0);
    produce(seg);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(tc.rc, 0);
    tdp__shm_seg_close(seg);
}

/* The producer dies (SIGKILL) while the consumer holds the mapping: the
 * bytes stay readable, and nothing can make the mapping fault. */
static void test_producer_killed(void **state)
{
    (void)state;
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    fflush(stdout);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        alarm(30); /* never outlive a parent that failed to kill us */
        tdp__shm_seg *seg = NULL;
        if (tdp__shm_seg_create(5, 3, 10000, 0, &seg) != TDP_OK)
            _exit(30);
        for (uint32_t i = 0; i < 3; i++)
            fill(tdp__shm_seg_slot(seg, i), 1000 + i, 10000);
        int fds[3];
        tdp__shm_seg_fds(seg, fds);
        /* even the producer cannot shrink it now */
        uint8_t ok = ftruncate(fds[0], 4096) == -1 && errno == EPERM;
        if (tdp__shm_sock_send(sv[1], &ok, 1, fds, 3) != TDP_OK)
            _exit(31);
        for (;;)
            pause();
    }
    close(sv[1]);
    uint8_t ok = 0;
    size_t len = 0, nfds = 0;
    int fds[3];
    assert_int_equal(tdp__shm_sock_recv(sv[0], &ok, 1, &len, fds, 3, &nfds), TDP_OK);
    assert_int_equal(nfds, 3);
    assert_int_equal(ok, 1);
    tdp__shm_seg *c = NULL;
    assert_int_equal(tdp__shm_seg_map(fds[0], fds[1], fds[2], 5, 0, &c), TDP_OK);

    assert_int_equal(kill(pid, SIGKILL), 0);
    int st = reap(pid, 10000);
    assert_true(WIFSIGNALED(st));
    assert_int_equal(WTERMSIG(st), SIGKILL);

    for (uint32_t i = 0; i < 3; i++) {
        uint8_t *s = tdp__shm_seg_slot(c, i);
        for (uint64_t j = 0; j < 10000; j++)
            assert_int_equal(s[j], pattern(1000 + i, j));
        s[12287] ^= 0xff; /* the slot's last byte: written, no fault */
    }
    int mine[3];
    tdp__shm_seg_fds(c, mine);
    assert_int_equal(ftruncate(mine[0], 0), -1);
    assert_int_equal(errno, EPERM);
    /* the dead producer's doorbell can still be rung and drained */
    tdp__shm_desc d = {TDP__SHM_DESC_RELEASE, 0, 0, 0, 0};
    assert_int_equal(tdp__shm_ring_push(tdp__shm_seg_tx(c), &d), TDP_OK);
    assert_int_equal(tdp__shm_ring_notify(tdp__shm_seg_tx(c)), TDP_OK);
    /* and the socket says the peer is gone */
    assert_int_equal(tdp__shm_sock_recv(sv[0], &ok, 1, &len, fds, 3, &nfds), TDP_ECLOSED);
    tdp__shm_seg_close(c);
    close(sv[0]);
}

/* ---- hostile segments ------------------------------------------------------- */

typedef struct corruption {
    const char *what;
    size_t off;
    size_t size; /* 4 or 8 */
    uint64_t value;
    bool add; /* add value to the field instead of replacing it */
} corruption;

#define HOFF(f) offsetof(tdp__shm_hdr, f)

static void test_hostile_header(void **state)
{
    (void)state;
    const uint64_t big = ~(uint64_t)4095; /* a multiple of a page, huge */
    const corruption cases[] = {
        {"magic", HOFF(magic), 8, 1, true},
        {"version", HOFF(version), 4, 2, false},
        {"generation", HOFF(generation), 4, 1, true},
        {"nslots 0", HOFF(nslots), 4, 0, false},
        {"nslots +1", HOFF(nslots), 4, 1, true},
        {"nslots -1", HOFF(nslots), 4, 2, false},
        {"nslots max+1", HOFF(nslots), 4, TDP__SHM_MAX_SLOTS + 1, false},
        {"nslots ~0", HOFF(nslots), 4, UINT32_MAX, false},
        {"ring_cap 0", HOFF(ring_cap), 4, 0, false},
        {"ring_cap 3", HOFF(ring_cap), 4, 3, false},
        {"ring_cap 2 < nslots", HOFF(ring_cap), 4, 2, false},
        {"ring_cap 8", HOFF(ring_cap), 4, 8, false},
        {"ring_cap 2^31", HOFF(ring_cap), 4, 1u << 31, false},
        {"slot_bytes 0", HOFF(slot_bytes), 8, 0, false},
        {"slot_bytes +1", HOFF(slot_bytes), 8, 1, true},
        {"slot_bytes +4096", HOFF(slot_bytes), 8, 4096, true},
        {"slot_bytes -4096", HOFF(slot_bytes), 8, 4096, false},
        {"slot_bytes ~0", HOFF(slot_bytes), 8, UINT64_MAX, false},
        {"slot_bytes huge (nslots * overflows)", HOFF(slot_bytes), 8, big, false},
        {"slot_bytes 2^62", HOFF(slot_bytes), 8, (uint64_t)1 << 62, false},
        {"ring_off[0] +64", HOFF(ring_off[0]), 8, 64, true},
        {"ring_off[0] 0", HOFF(ring_off[0]), 8, 0, false},
        {"ring_off[1] -64", HOFF(ring_off[1]), 8, (uint64_t)-64, true},
        {"ring_off[1] ~0", HOFF(ring_off[1]), 8, UINT64_MAX, false},
        {"slots_off 0", HOFF(slots_off), 8, 0, false},
        {"slots_off +4096", HOFF(slots_off), 8, 4096, true},
        {"slots_off +64", HOFF(slots_off), 8, 64, true},
        {"total_bytes +4096", HOFF(total_bytes), 8, 4096, true},
        {"total_bytes -1", HOFF(total_bytes), 8, (uint64_t)-1, true},
        {"total_bytes ~0", HOFF(total_bytes), 8, UINT64_MAX, false},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        const corruption *cs = &cases[k];
        tdp__shm_seg *p = NULL, *c = NULL;
        /* 3 slots of 2 pages, rings of 4 */
        assert_int_equal(tdp__shm_seg_create(9, 3, 8000, 0, &p), TDP_OK);
        int fds[3];
        dup3fds(p, fds);
        uint8_t *hdr = tdp__shm_seg_base(p);
        if (cs->size == 4) {
            uint32_t v;
            memcpy(&v, hdr + cs->off, 4);
            v = cs->add ? v + (uint32_t)cs->value : (uint32_t)cs->value;
            memcpy(hdr + cs->off, &v, 4);
        } else {
            uint64_t v;
            memcpy(&v, hdr + cs->off, 8);
            v = cs->add ? v + cs->value : cs->value;
            memcpy(hdr + cs->off, &v, 8);
        }
        tdp_err e = tdp__shm_seg_map(fds[0], fds[1], fds[2], 9, 0, &c);
        if (e != TDP_EPROTO)
            fail_msg("corrupted %s: map gave %s", cs->what, tdp_errname(e));
        assert_null(c);
        close3(fds);
        tdp__shm_seg_close(p);
    }

    /* a header consistent in itself, for a file larger than the real one */
    tdp__shm_seg *p = NULL, *c = NULL;
    assert_int_equal(tdp__shm_seg_create(9, 3, 8000, 0, &p), TDP_OK);
    tdp__shm_geom g4;
    assert_int_equal(tdp__shm_geom_compute(4, 8000, 4, &g4), TDP_OK);
    tdp__shm_hdr *h = tdp__shm_seg_base(p);
    assert_int_equal(h->ring_off[1], g4.ring_off[1]);
    h->nslots = 4;
    h->total_bytes = g4.total_bytes;
    int fds[3];
    dup3fds(p, fds);
    assert_int_equal(tdp__shm_seg_map(fds[0], fds[1], fds[2], 9, 0, &c), TDP_EPROTO);
    /* restored, it maps */
    h->nslots = 3;
    h->total_bytes = tdp__shm_seg_geom(p)->total_bytes;
    assert_int_equal(tdp__shm_seg_map(fds[0], fds[1], fds[2], 9, 0, &c), TDP_OK);
    /* and the consumer kept its own copy: rewriting the header later
     * changes nothing it sees */
    h->nslots = 1000;
    assert_int_equal(tdp__shm_seg_geom(c)->nslots, 3);
    assert_null(tdp__shm_seg_slot(c, 3));
    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);
}

/* A memfd with a copy of a good header, and the given seals (-1: sealing
 * not allowed at all). */
static int fake_memfd(const tdp__shm_seg *model, int seals)
{
    int fd = memfd_create("fake", MFD_CLOEXEC | (seals >= 0 ? MFD_ALLOW_SEALING : 0));
    assert_true(fd >= 0);
    uint64_t total = tdp__shm_seg_geom(model)->total_bytes;
    assert_int_equal(ftruncate(fd, (off_t)total), 0);
    assert_int_equal(pwrite(fd, tdp__shm_seg_base(model), sizeof(tdp__shm_hdr), 0),
                     (ssize_t)sizeof(tdp__shm_hdr));
    if (seals > 0)
        assert_int_equal(fcntl(fd, F_ADD_SEALS, seals), 0);
    return fd;
}

static void expect_refused(int memfd, int efd1, int efd2, uint32_t gen)
{
    tdp__shm_seg *c = NULL;
    assert_int_equal(tdp__shm_seg_map(memfd, efd1, efd2, gen, 0, &c), TDP_EPROTO);
    assert_null(c);
}

static void test_hostile_fds(void **state)
{
    (void)state;
    tdp__shm_seg *p = NULL, *c = NULL;
    assert_int_equal(tdp__shm_seg_create(4, 2, 100, 0, &p), TDP_OK);
    int e1 = eventfd(0, EFD_CLOEXEC), e2 = eventfd(0, EFD_CLOEXEC); /* blocking ones */
    assert_true(e1 >= 0 && e2 >= 0);

    int fd = fake_memfd(p, -1); /* no sealing at all */
    expect_refused(fd, e1, e2, 4);
    close(fd);
    fd = fake_memfd(p, 0); /* sealable, unsealed */
    expect_refused(fd, e1, e2, 4);
    close(fd);
    fd = fake_memfd(p, F_SEAL_GROW); /* may still shrink */
    expect_refused(fd, e1, e2, 4);
    close(fd);
    fd = fake_memfd(p, F_SEAL_SHRINK); /* may still grow */
    expect_refused(fd, e1, e2, 4);
    close(fd);
    fd = fake_memfd(p, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE); /* not writable */
    expect_refused(fd, e1, e2, 4);
    close(fd);

    /* not a memfd: a pipe, a temporary file */
    int pp[2];
    assert_int_equal(pipe2(pp, O_CLOEXEC), 0);
    expect_refused(pp[0], e1, e2, 4);
    fd = open("/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) {
        assert_int_equal(ftruncate(fd, (off_t)tdp__shm_seg_geom(p)->total_bytes), 0);
        expect_refused(fd, e1, e2, 4);
        close(fd);
    }

    /* doorbells that are not eventfds */
    fd = fake_memfd(p, F_SEAL_SHRINK | F_SEAL_GROW); /* acceptable as a segment */
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    expect_refused(fd, pp[1], e2, 4);
    expect_refused(fd, e1, sv[0], 4);
    expect_refused(fd, fd, e2, 4);

    /* the real thing maps, and the blocking eventfds became non-blocking */
    assert_int_equal(tdp__shm_seg_map(fd, e1, e2, 4, 0, &c), TDP_OK);
    assert_true(fcntl(e1, F_GETFL) & O_NONBLOCK);
    assert_true(fcntl(e2, F_GETFL) & O_NONBLOCK);
    tdp__shm_ring_drain(tdp__shm_seg_rx(c)); /* returns at once */
    tdp__shm_seg_close(c);
    close(sv[0]);
    close(sv[1]);
    close(pp[0]);
    close(pp[1]);
    tdp__shm_seg_close(p);
}

/*
 * A sealed memfd on hugetlbfs (MFD_HUGETLB) looks like a shmem one (it
 * takes the same seals and maps writable), but its pages come from the
 * host's pool of huge pages: once mapped, the producer can punch a hole
 * (which no seal but F_SEAL_WRITE forbids) and take the pool's last page,
 * and the consumer's next read there dies of SIGBUS. Refused, whether or
 * not this host has huge pages free to give it a real header.
 */
static void test_hostile_hugetlb(void **state)
{
    (void)state;
    const uint64_t huge = 2u << 20;
    tdp__shm_geom g; /* two slots, slot 1 in the file's second huge page */
    assert_int_equal(tdp__shm_geom_compute(2, huge - 4096, 0, &g), TDP_OK);
    assert_int_equal(g.total_bytes, 2 * huge);
    int fd = memfd_create("hostile-huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
    if (fd < 0) {
        print_message("no hugetlbfs memfd here (%s): nothing to check\n", strerror(errno));
        return;
    }
    assert_int_equal(ftruncate(fd, (off_t)g.total_bytes), 0);
    /* the header, when a huge page is free for it (allocated first: no fault here) */
    bool header = fallocate(fd, 0, 0, (off_t)huge) == 0;
    if (header) {
        tdp__shm_hdr h = {.magic = TDP__SHM_MAGIC,
                          .version = TDP__SHM_VERSION,
                          .generation = 7,
                          .nslots = g.nslots,
                          .ring_cap = g.ring_cap,
                          .slot_bytes = g.slot_bytes,
                          .ring_off = {g.ring_off[0], g.ring_off[1]},
                          .slots_off = g.slots_off,
                          .total_bytes = g.total_bytes};
        void *b = mmap(NULL, (size_t)huge, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        assert_true(b != MAP_FAILED);
        memcpy(b, &h, sizeof(h));
        munmap(b, (size_t)huge);
    }
    bool both = header && fallocate(fd, 0, (off_t)huge, (off_t)huge) == 0;
    print_message("hugetlbfs memfd %s\n", both     ? "with its header and both pages"
                                          : header ? "with its header"
                                                   : "without a header (no huge page free)");
    assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
    int e1 = eventfd(0, EFD_CLOEXEC), e2 = eventfd(0, EFD_CLOEXEC);
    assert_true(e1 >= 0 && e2 >= 0);
    tdp__shm_seg *c = NULL;
    tdp_err rc = tdp__shm_seg_map(fd, e1, e2, 7, 0, &c);
    if (rc == TDP_OK) {
        if (both) {
            /* what the producer can do now: the consumer reads slot 1 in a child */
            int hog = memfd_create("hog", MFD_CLOEXEC | MFD_HUGETLB);
            if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)huge,
                          (off_t)huge) == 0 &&
                hog >= 0 && ftruncate(hog, (off_t)huge) == 0 &&
                fallocate(hog, 0, 0, (off_t)huge) == 0) {
                pid_t pid = fork();
                if (pid == 0) {
                    signal(SIGBUS, SIG_DFL);
                    _exit(*(volatile uint8_t *)tdp__shm_seg_slot(c, 1));
                }
                int st = reap(pid, 5000);
                print_message("the consumer's read of slot 1: %s\n",
                              WIFSIGNALED(st) ? strsignal(WTERMSIG(st)) : "fine");
            }
            if (hog >= 0)
                close(hog);
        }
        tdp__shm_seg_close(c); /* closes the three fds */
        fail_msg("a segment on hugetlbfs was mapped");
    }
    assert_int_equal(rc, TDP_EPROTO);
    assert_null(c);
    close(fd);
    close(e1);
    close(e2);
}

static void test_hostile_ring(void **state)
{
    (void)state;
    tdp__shm_seg *p = NULL, *c = NULL;
    tdp__shm_desc d = {TDP__SHM_DESC_DATA, 0, 0, 0, 0}, o;

    /* the producer's index jumps past the capacity */
    pair(1, 4, 100, 0, &p, &c);
    atomic_store(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_TAIL_OFF), 5);
    assert_int_equal(tdp__shm_ring_pop(tdp__shm_seg_rx(c), &o), TDP_EPROTO);
    assert_int_equal(tdp__shm_ring_arm(tdp__shm_seg_rx(c)), TDP_EPROTO);
    atomic_store(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_TAIL_OFF), UINT64_MAX);
    assert_int_equal(tdp__shm_ring_pop(tdp__shm_seg_rx(c), &o), TDP_EPROTO);
    /* exactly the capacity is fine: four descriptors (zeroes) */
    atomic_store(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_TAIL_OFF), 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tdp__shm_ring_pop(tdp__shm_seg_rx(c), &o), TDP_OK);
    assert_int_equal(tdp__shm_ring_pop(tdp__shm_seg_rx(c), &o), TDP_EAGAIN);
    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);

    /* the producer's index moves back */
    pair(1, 4, 100, 0, &p, &c);
    tdp__shm_ring *tx = tdp__shm_seg_tx(p), *rx = tdp__shm_seg_rx(c);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
    assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK);
    atomic_store(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_TAIL_OFF), 1);
    assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK); /* known: seen before */
    assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_EPROTO);
    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);

    /* the consumer's index passes the producer's, or moves back */
    pair(1, 4, 100, 0, &p, &c);
    tx = tdp__shm_seg_tx(p);
    rx = tdp__shm_seg_rx(c);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
    atomic_store(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_HEAD_OFF), 5);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_EPROTO);
    atomic_store(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_HEAD_OFF), 0);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_EAGAIN);
    assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK);
    assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK); /* sees head 2 */
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
    atomic_store(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_HEAD_OFF), 1);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_EPROTO);
    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);

    /* the release ring, the other way: the producer checks the consumer */
    pair(1, 2, 100, 0, &p, &c);
    atomic_store(ring_word(c, TDP__SHM_RING_RELEASE, TDP__SHM_RING_TAIL_OFF), 3);
    assert_int_equal(tdp__shm_ring_pop(tdp__shm_seg_rx(p), &o), TDP_EPROTO);
    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);

    /* scribbling on an index the victim owns changes nothing: it writes
     * its private copy back with the next push */
    pair(1, 2, 100, 0, &p, &c);
    tx = tdp__shm_seg_tx(p);
    rx = tdp__shm_seg_rx(c);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
    atomic_store(ring_word(c, TDP__SHM_RING_DATA, TDP__SHM_RING_TAIL_OFF), 12345);
    assert_int_equal(tdp__shm_ring_push(tx, &d), TDP_OK);
    assert_int_equal(atomic_load(ring_word(p, TDP__SHM_RING_DATA, TDP__SHM_RING_TAIL_OFF)), 2);

    /* descriptors are the caller's to check; the slot accessor bounds them */
    uint64_t *desc = (uint64_t *)ring_word(c, TDP__SHM_RING_DATA, TDP__SHM_RING_DESC_OFF);
    desc[0] = TDP__SHM_DESC_DATA | ((uint64_t)999 << 32);
    assert_int_equal(tdp__shm_ring_pop(rx, &o), TDP_OK);
    assert_int_equal(o.slot, 999);
    assert_null(tdp__shm_seg_slot(c, o.slot));
    tdp__shm_seg_close(c);
    tdp__shm_seg_close(p);
}

/* ---- fd passing ------------------------------------------------------------ */

static void make_efds(int *fds, int n)
{
    for (int i = 0; i < n; i++) {
        fds[i] = eventfd(0, EFD_CLOEXEC);
        assert_true(fds[i] >= 0);
    }
}

static void test_fd_passing(void **state)
{
    (void)state;
    int types[2] = {SOCK_SEQPACKET, SOCK_STREAM};
    for (int t = 0; t < 2; t++) {
        int sv[2];
        assert_int_equal(socketpair(AF_UNIX, types[t] | SOCK_CLOEXEC, 0, sv), 0);
        int out[3], in[3];
        make_efds(out, 3);
        char msg[5] = "hello", buf[16];
        size_t len = 0, n = 0;
        assert_int_equal(tdp__shm_sock_send(sv[0], msg, 5, out, 3), TDP_OK);
        assert_int_equal(tdp__shm_sock_recv(sv[1], buf, sizeof(buf), &len, in, 3, &n), TDP_OK);
        assert_int_equal(len, 5);
        assert_memory_equal(buf, "hello", 5);
        assert_int_equal(n, 3);
        for (int i = 0; i < 3; i++) {
            assert_true(fcntl(in[i], F_GETFD) & FD_CLOEXEC);
            /* the same eventfd: a write on one side reads on the other */
            uint64_t v = 7 + i, r = 0;
            assert_int_equal(write(out[i], &v, 8), 8);
            assert_int_equal(read(in[i], &r, 8), 8);
            assert_int_equal(r, v);
        }
        close3(in);
        /* bytes alone */
        assert_int_equal(tdp__shm_sock_send(sv[0], msg, 2, NULL, 0), TDP_OK);
        assert_int_equal(tdp__shm_sock_recv(sv[1], buf, sizeof(buf), &len, in, 3, &n), TDP_OK);
        assert_int_equal(len, 2);
        assert_int_equal(n, 0);
        close3(out);

        assert_int_equal(tdp__shm_sock_send(sv[0], msg, 0, NULL, 0), TDP_EINVAL);
        int many[TDP__SHM_MAX_FDS + 1] = {0};
        assert_int_equal(tdp__shm_sock_send(sv[0], msg, 1, many, TDP__SHM_MAX_FDS + 1), TDP_EINVAL);

        /* non-blocking and empty, then closed */
        assert_int_equal(fcntl(sv[1], F_SETFL, O_NONBLOCK), 0);
        assert_int_equal(tdp__shm_sock_recv(sv[1], buf, sizeof(buf), &len, in, 3, &n), TDP_EAGAIN);
        close(sv[0]);
        assert_int_equal(tdp__shm_sock_recv(sv[1], buf, sizeof(buf), &len, in, 3, &n), TDP_ECLOSED);
        /* and sending to a closed peer is an error, not SIGPIPE */
        assert_int_equal(tdp__shm_sock_send(sv[1], msg, 1, NULL, 0), TDP_ECONNRESET);
        close(sv[1]);
    }
}

/* Raw sendmsg of n fds (more than tdp__shm_sock_send allows). */
static void send_raw(int sock, const void *buf, size_t len, const int *fds, size_t n)
{
    char ctl[CMSG_SPACE(sizeof(int) * 32)];
    assert_true(n <= 32);
    memset(ctl, 0, sizeof(ctl));
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = ctl,
                         .msg_controllen = CMSG_SPACE(sizeof(int) * n)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * n);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * n);
    assert_int_equal(sendmsg(sock, &msg, MSG_NOSIGNAL), (ssize_t)len);
}

/* Every failing receive closes what it received: the fd numbers the kernel
 * handed out are free again, and the count of open fds is unchanged. */
static void expect_recv_closes(int sock, size_t cap, size_t maxfds, tdp_err want)
{
    int before = count_fds();
    int next[32];
    next_free_fds(next, 32);
    char buf[256];
    int in[TDP__SHM_MAX_FDS];
    size_t len = 77, n = 77;
    assert_int_equal(tdp__shm_sock_recv(sock, buf, cap, &len, in, maxfds, &n), want);
    assert_int_equal(len, 77); /* outputs untouched */
    assert_int_equal(n, 77);
    for (int i = 0; i < 32; i++)
        assert_true(fd_closed(next[i]));
    assert_int_equal(count_fds(), before);
}

static void test_fd_passing_errors(void **state)
{
    (void)state;
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    int out[32];
    make_efds(out, 32);

    /* surplus: 3 fds where 1 is expected */
    assert_int_equal(tdp__shm_sock_send(sv[0], "x", 1, out, 3), TDP_OK);
    expect_recv_closes(sv[1], 16, 1, TDP_EPROTO);
    /* fds where none is expected */
    assert_int_equal(tdp__shm_sock_send(sv[0], "x", 1, out, 2), TDP_OK);
    expect_recv_closes(sv[1], 16, 0, TDP_EPROTO);
    /* more fds than the control buffer holds: MSG_CTRUNC */
    send_raw(sv[0], "x", 1, out, 20);
    expect_recv_closes(sv[1], 16, TDP__SHM_MAX_FDS, TDP_EPROTO);
    /* a datagram larger than the buffer, with fds */
    char big[100] = {0};
    assert_int_equal(tdp__shm_sock_send(sv[0], big, sizeof(big), out, 2), TDP_OK);
    expect_recv_closes(sv[1], 10, 3, TDP_EMSGSIZE);
    /* a zero-byte datagram that carries fds: treated as the end */
    send_raw(sv[0], "", 0, out, 2);
    expect_recv_closes(sv[1], 16, 3, TDP_ECLOSED);

    /* the socket still works after all that */
    int in[3];
    size_t len = 0, n = 0;
    char buf[8];
    assert_int_equal(tdp__shm_sock_send(sv[0], "ok", 2, out, 3), TDP_OK);
    assert_int_equal(tdp__shm_sock_recv(sv[1], buf, sizeof(buf), &len, in, 3, &n), TDP_OK);
    assert_int_equal(n, 3);
    close3(in);
    for (int i = 0; i < 32; i++)
        close(out[i]);
    close(sv[0]);
    close(sv[1]);
}

/* ---- the abstract listener ---------------------------------------------- */

static bool in_proc_net_unix(const char *name, size_t len)
{
    FILE *f = fopen("/proc/net/unix", "r");
    if (f == NULL)
        return false;
    char line[512], want[TDP__SHM_NAME_MAX + 2];
    want[0] = '@';
    memcpy(want + 1, name, len);
    want[len + 1] = '\0';
    bool found = false;
    while (!found && fgets(line, sizeof(line), f) != NULL)
        found = strstr(line, want) != NULL;
    fclose(f);
    return found;
}

static void test_listener(void **state)
{
    (void)state;
    int types[2] = {SOCK_SEQPACKET, SOCK_STREAM};
    for (int t = 0; t < 2; t++) {
        char name[TDP__SHM_NAME_LEN];
        int lfd = -1;
        assert_int_equal(tdp__shm_listen(types[t], true, name, &lfd), TDP_OK);
        assert_memory_equal(name, "tdpipe.", 7);
        for (size_t i = 7; i < sizeof(name); i++)
            assert_non_null(strchr("0123456789abcdef", name[i]));
        bool have_proc = access("/proc/net/unix", R_OK) == 0;
        if (have_proc)
            assert_true(in_proc_net_unix(name, sizeof(name)));

        int s = -1, a = -1;
        pid_t peer = 0;
        assert_int_equal(tdp__shm_accept(lfd, true, &a, &peer), TDP_EAGAIN);
        assert_int_equal(tdp__shm_connect(types[t], name, sizeof(name), false, &s, &peer), TDP_OK);
        assert_int_equal(peer, getpid());
        peer = 0;
        assert_int_equal(tdp__shm_accept(lfd, true, &a, &peer), TDP_OK);
        assert_int_equal(peer, getpid());
        assert_true(fcntl(a, F_GETFD) & FD_CLOEXEC);
        assert_true(fcntl(a, F_GETFL) & O_NONBLOCK);
        int type = 0;
        socklen_t tl = sizeof(type);
        assert_int_equal(getsockopt(a, SOL_SOCKET, SO_TYPE, &type, &tl), 0);
        assert_int_equal(type, types[t]);

        int e[1], in[1];
        make_efds(e, 1);
        size_t len = 0, n = 0;
        char buf[4];
        assert_int_equal(tdp__shm_sock_send(s, "abc", 3, e, 1), TDP_OK);
        assert_int_equal(tdp__shm_sock_recv(a, buf, sizeof(buf), &len, in, 1, &n), TDP_OK);
        assert_int_equal(len, 3);
        assert_int_equal(n, 1);
        close(in[0]);
        close(e[0]);
        close(a);
        close(s);
        close(lfd);
        /* nothing left behind */
        if (have_proc)
            assert_false(in_proc_net_unix(name, sizeof(name)));
        assert_int_equal(tdp__shm_connect(types[t], name, sizeof(name), false, &s, NULL),
                         TDP_ECONNREFUSED);
    }

    int s = -1;
    char longname[TDP__SHM_NAME_MAX + 1];
    memset(longname, 'a', sizeof(longname));
    assert_int_equal(tdp__shm_connect(SOCK_SEQPACKET, longname, 0, false, &s, NULL), TDP_EINVAL);
    assert_int_equal(tdp__shm_connect(SOCK_SEQPACKET, longname, sizeof(longname), false, &s, NULL),
                     TDP_EINVAL);
    /* the longest name is allowed (nobody listens on it) */
    assert_int_equal(tdp__shm_connect(SOCK_SEQPACKET, longname, TDP__SHM_NAME_MAX, false, &s, NULL),
                     TDP_ECONNREFUSED);
    assert_int_equal(tdp__shm_connect(SOCK_DGRAM, longname, 10, false, &s, NULL), TDP_EINVAL);
    char name[TDP__SHM_NAME_LEN];
    assert_int_equal(tdp__shm_listen(SOCK_DGRAM, false, name, &s), TDP_EINVAL);
}

/* A process of another user is refused at accept (needs root to test). */
static void test_listener_other_user(void **state)
{
    (void)state;
    if (geteuid() != 0)
        skip();
    char name[TDP__SHM_NAME_LEN];
    int lfd = -1;
    assert_int_equal(tdp__shm_listen(SOCK_SEQPACKET, true, name, &lfd), TDP_OK);
    fflush(stdout);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(lfd);
        if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0)
            _exit(40);
        int s = -1;
        /* the child refuses the root listener too */
        tdp_err e = tdp__shm_connect(SOCK_SEQPACKET, name, sizeof(name), false, &s, NULL);
        _exit(e == TDP_ECONNREFUSED ? 0 : 41);
    }
    assert_int_equal(readable(lfd, XP_WAIT_MS), 1);
    int a = -1;
    assert_int_equal(tdp__shm_accept(lfd, true, &a, NULL), TDP_ECONNREFUSED);
    assert_int_equal(a, -1);
    int st = reap(pid, 10000);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    close(lfd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_geom),
        cmocka_unit_test(test_create_map),
        cmocka_unit_test(test_map_limit),
        cmocka_unit_test(test_doorbell),
        cmocka_unit_test(test_cross_process_socketpair),
        cmocka_unit_test(test_cross_process_listener),
        cmocka_unit_test(test_threads_one_mapping),
        cmocka_unit_test(test_producer_killed),
        cmocka_unit_test(test_hostile_header),
        cmocka_unit_test(test_hostile_fds),
        cmocka_unit_test(test_hostile_hugetlb),
        cmocka_unit_test(test_hostile_ring),
        cmocka_unit_test(test_fd_passing),
        cmocka_unit_test(test_fd_passing_errors),
        cmocka_unit_test(test_listener),
        cmocka_unit_test(test_listener_other_user),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
