/*
 * test_cuda: the CUDA layer on the fake device (faults on host access,
 * late copies, host functions, events, injected faults, export/import),
 * with CUDA off, and the driver backend on whatever this machine has.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <tdpipe/mem.h>

#include "core/cuda.h"
#include "core/cuda_int.h" /* tdp__cuda_fake_ops: the fake's calls without the layer's wait */

#include "test_skip.h" /* UNDER_TSAN */

#define OK(x) assert_int_equal((x), TDP_OK)
#define N     65536u
/* long enough that the main thread looks before the engine copies, even on a loaded machine */
#define DELAY_US 100000u

static int fake_setup(void **state)
{
    (void)state;
    OK(tdp__cuda_select("fake"));
    tdp__cuda_fake_set_delay_us(0);
    for (int f = 0; f < TDP__CUDA_FAULT_COUNT; f++)
        tdp__cuda_fake_inject((tdp__cuda_fault)f, 0);
    return 0;
}

static int open_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

/* Wait for pid (bounded by the ctest timeout); its wait status. */
static int reap(pid_t pid)
{
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return status;
}

/* SIGSEGV's default action, past any sanitizer's handler: the kernel's call. */
static void segv_default(void)
{
    struct {
        void *handler;
        unsigned long flags;
        void *restorer;
        uint64_t mask;
    } ksa = {0};
    (void)syscall(SYS_rt_sigaction, SIGSEGV, &ksa, NULL, sizeof(ksa.mask));
}

static void test_host_touch_faults(void **state)
{
    (void)state;
    char *d = NULL;
    OK(tdp__cuda_malloc(0, 4096, (void **)&d));
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        segv_default();
        volatile char c = d[17]; /* host code reading device memory */
        (void)c;
        _exit(0);
    }
    int status = reap(pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGSEGV);
    tdp__cuda_free(d);
}

static void test_copy_is_late_until_sync(void **state)
{
    (void)state;
    unsigned char *src = malloc(N), *out = malloc(N), *d = NULL;
    assert_non_null(src);
    assert_non_null(out);
    memset(src, 0x11, N);
    memset(out, 0, N);
    tdp__cuda_stream *s = NULL;
    OK(tdp__cuda_stream_create(0, &s));
    OK(tdp__cuda_malloc(0, N, (void **)&d));
    tdp__cuda_fake_set_delay_us(DELAY_US);
    OK(tdp__cuda_memcpy_async(d, src, N, s));
    OK(tdp__cuda_memcpy_async(out, d, N, s));
#ifndef UNDER_TSAN
    /* a reader that does not wait sees the old bytes (TSan calls this read a race) */
    assert_int_equal(out[0], 0);
    assert_int_equal(out[N - 1], 0);
#endif
    OK(tdp__cuda_stream_sync(s));
    assert_memory_equal(out, src, N);
    tdp__cuda_fake_set_delay_us(0);

    /* device to device, and a fill */
    unsigned char *d2 = NULL;
    OK(tdp__cuda_malloc(0, N, (void **)&d2));
    OK(tdp__cuda_memset(d, 0x7e, N));
    OK(tdp__cuda_memcpy_async(d2, d, N, s));
    OK(tdp__cuda_memcpy_async(out, d2, N, s));
    OK(tdp__cuda_stream_sync(s));
    for (size_t i = 0; i < N; i += 4099)
        assert_int_equal(out[i], 0x7e);
    /* past the end of an allocation: refused, as a GPU would fault */
    assert_int_equal(tdp__cuda_memcpy(out, d2 + 4096, N), TDP_ECUDA);

    tdp__cuda_free(d2);
    tdp__cuda_free(d);
    tdp__cuda_stream_destroy(s);
    free(src);
    free(out);
}

/*
 * The synchronous calls are done when they return. A GPU's are not all:
 * cuMemcpy from pageable host memory to the device returns once the bytes
 * are in the driver's staging buffer, a device to device copy and cuMemset
 * at once, and the rest runs on the default stream. On an H100 a loaned
 * slot whose header was written so and sent at once was read stale by the
 * peer. The fake leaves the same work on its default stream (shown first,
 * through its own calls); the layer waits for it.
 */
static void test_sync_calls_done_on_return(void **state)
{
    (void)state;
    enum { M = 4096 };
    unsigned char host[M], got[M], *d = NULL, *d2 = NULL;
    OK(tdp__cuda_malloc(0, M, (void **)&d));
    OK(tdp__cuda_malloc(0, M, (void **)&d2));
    OK(tdp__cuda_memset(d, 0, M));
    OK(tdp__cuda_memset(d2, 0, M));
    /* the fake's own call returns before the bytes land, as the driver's */
    memset(host, 0x3a, M);
    OK(tdp__cuda_fake_ops.memcpy(d, host, M));
    memset(host, 0, M); /* the source is the caller's again: staged */
    OK(tdp__cuda_fake_peek(d, got, M));
    assert_int_equal(got[0], 0);
    assert_int_equal(got[M - 1], 0);
    OK(tdp__cuda_fake_ops.sync_default());
    OK(tdp__cuda_fake_peek(d, got, M));
    assert_int_equal(got[0], 0x3a);
    assert_int_equal(got[M - 1], 0x3a);

    /* through the layer: landed when the call returns */
    memset(host, 0x5c, M);
    OK(tdp__cuda_memcpy(d, host, M));
    memset(host, 0, M);
    OK(tdp__cuda_fake_peek(d, got, M));
    assert_int_equal(got[0], 0x5c);
    assert_int_equal(got[M - 1], 0x5c);
    OK(tdp__cuda_memset(d, 0x6d, M));
    OK(tdp__cuda_fake_peek(d, got, M));
    assert_int_equal(got[0], 0x6d);
    assert_int_equal(got[M - 1], 0x6d);
    OK(tdp__cuda_memcpy(d2, d, M)); /* device to device */
    OK(tdp__cuda_fake_peek(d2, got, M));
    assert_int_equal(got[0], 0x6d);
    assert_int_equal(got[M - 1], 0x6d);
    /* the public calls too */
    memset(host, 0x21, M);
    OK(tdp_mem_copy(d, host, M));
    OK(tdp__cuda_fake_peek(d, got, M));
    assert_int_equal(got[M - 1], 0x21);
    OK(tdp_mem_set(d, 0x43, M));
    OK(tdp__cuda_fake_peek(d, got, M));
    assert_int_equal(got[M - 1], 0x43);
    /* and a copy back to the host is in order after them */
    OK(tdp__cuda_fake_ops.memset(d2, 0x19, M));
    OK(tdp__cuda_memcpy(host, d2, M));
    assert_int_equal(host[0], 0x19);
    assert_int_equal(host[M - 1], 0x19);

    assert_int_equal(tdp__cuda_fake_peek(host, got, 1), TDP_ECUDA); /* not device memory */
    tdp__cuda_free(d2);
    tdp__cuda_free(d);
}

/* Bytes written by the device: in stream order, late until the stream is
 * waited for, read from the source at the call; sizes and addresses in
 * multiples of 4, at most TDP__CUDA_INLINE_MAX. */
static void test_write_inline(void **state)
{
    (void)state;
    enum { M = 4096 };
    unsigned char *d = NULL, src[M], got[M];
    tdp__cuda_stream *s = NULL;
    OK(tdp__cuda_malloc(0, M, (void **)&d));
    OK(tdp__cuda_memset(d, 0, M));
    OK(tdp__cuda_stream_create(0, &s));
    for (size_t i = 0; i < M; i++)
        src[i] = (unsigned char)(i * 7 + 1);
    tdp__cuda_fake_set_delay_us(DELAY_US);
    /* 4 bytes past an 8-byte boundary, an odd count of words: 32-bit head and tail */
    OK(tdp__cuda_write_inline(d + 4, src, 1004, s));
    memset(src, 0, 1004); /* read at the call: the source is the caller's again */
#ifndef UNDER_TSAN
    /* a reader that does not wait sees the old bytes (TSan calls this read a race) */
    OK(tdp__cuda_fake_peek(d + 4, got, 1004));
    assert_int_equal(got[0], 0);
#endif
    OK(tdp__cuda_stream_sync(s));
    OK(tdp__cuda_fake_peek(d, got, 1012));
    assert_int_equal(got[0], 0);
    assert_int_equal(got[3], 0);
    for (size_t i = 0; i < 1004; i++)
        assert_int_equal(got[4 + i], (unsigned char)(i * 7 + 1));
    assert_int_equal(got[1008], 0);
    tdp__cuda_fake_set_delay_us(0);
    /* the largest */
    memset(src, 0x5a, M);
    OK(tdp__cuda_write_inline(d + 2048, src, TDP__CUDA_INLINE_MAX, s));
    OK(tdp__cuda_stream_sync(s));
    OK(tdp__cuda_fake_peek(d + 2048, got, TDP__CUDA_INLINE_MAX + 4));
    assert_int_equal(got[TDP__CUDA_INLINE_MAX - 1], 0x5a);
    assert_int_equal(got[TDP__CUDA_INLINE_MAX], 0);
    assert_int_equal(tdp__cuda_write_inline(d, src, TDP__CUDA_INLINE_MAX + 4, s), TDP_EINVAL);
    assert_int_equal(tdp__cuda_write_inline(d + 2, src, 8, s), TDP_EINVAL);
    assert_int_equal(tdp__cuda_write_inline(d, src, 6, s), TDP_EINVAL);
    assert_int_equal(tdp__cuda_write_inline(d, src, 0, s), TDP_EINVAL);
    assert_int_equal(tdp__cuda_write_inline(NULL, src, 8, s), TDP_EINVAL);
    assert_int_equal(tdp__cuda_write_inline(d, NULL, 8, s), TDP_EINVAL);
    assert_int_equal(tdp__cuda_write_inline(d, src, 8, NULL), TDP_EINVAL);
    tdp__cuda_stream_destroy(s);
    tdp__cuda_free(d);
}

/* Each kind of call in its own line; "name calls N mean M us ...", or false. */
static bool stat_of(const char *name, unsigned long long *calls, double *mean_us)
{
    char line[160], key[32];
    for (int k = 0; k < 64; k++) { /* past the last kind: false */
        if (!tdp__cuda_stats_line(k, line, sizeof(line)))
            continue;
        if (sscanf(line, "%31s calls %llu mean %lf us", key, calls, mean_us) == 3 &&
            strcmp(key, name) == 0)
            return true;
    }
    return false;
}

/*
 * tdp_mem_copy of a few bytes to the device: written by the device on the
 * layer's stream, landed on return even when the device is late; the
 * other way, or with inline writes off, a copy.
 */
static void test_mem_copy_small(void **state)
{
    (void)state;
    unsigned long long calls = 0;
    double mean = 0;
    unsigned char host[64], got[64], *d = NULL;
    OK(tdp__cuda_malloc(0, 4096, (void **)&d));
    OK(tdp__cuda_memset(d, 0, 4096));
    for (int i = 0; i < 64; i++)
        host[i] = (unsigned char)(i + 100);
    tdp__cuda_stats_enable(true);
    tdp__cuda_stats_reset();
    tdp__cuda_fake_set_delay_us(DELAY_US);
    OK(tdp_mem_copy(d + 8, host, 32));
    OK(tdp__cuda_fake_peek(d + 8, got, 32)); /* landed on return */
    assert_memory_equal(got, host, 32);
    tdp__cuda_fake_set_delay_us(0);
    assert_true(stat_of("write_inline", &calls, &mean));
    assert_int_equal(calls, 1);
    assert_false(stat_of("memcpy", &calls, &mean));
    OK(tdp_mem_copy(got, d + 8, 32)); /* back: a copy */
    assert_memory_equal(got, host, 32);
    assert_true(stat_of("memcpy", &calls, &mean));
    assert_int_equal(calls, 1);
    OK(tdp_mem_copy(d + 1, host, 32)); /* unaligned: a copy */
    assert_true(stat_of("memcpy", &calls, &mean));
    assert_int_equal(calls, 2);
    tdp__cuda_inline_set(false);
    OK(tdp_mem_copy(d + 512, host, 32));
    tdp__cuda_inline_set(true);
    assert_true(stat_of("memcpy", &calls, &mean));
    assert_int_equal(calls, 3);
    assert_true(stat_of("write_inline", &calls, &mean));
    assert_int_equal(calls, 1);
    OK(tdp__cuda_fake_peek(d + 512, got, 32));
    assert_memory_equal(got, host, 32);
    /* refused by the device: copied, and copies from then on */
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_INLINE_REFUSED_AT, 1);
    OK(tdp_mem_copy(d + 768, host, 32));
    OK(tdp__cuda_fake_peek(d + 768, got, 32));
    assert_memory_equal(got, host, 32);
    assert_false(tdp__cuda_inline_enabled());
    OK(tdp_mem_copy(d + 800, host, 32));
    assert_true(stat_of("write_inline", &calls, &mean));
    assert_int_equal(calls, 2);
    assert_true(stat_of("memcpy", &calls, &mean));
    assert_int_equal(calls, 5);
    tdp__cuda_inline_set(true);
#ifndef UNDER_TSAN /* a child that starts a thread after a multi-threaded fork: TSan refuses */
    /* in a forked child (the fake survives fork): the layer's stream is made again */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        unsigned char c[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {0};
        bool ok = tdp_mem_copy(d + 1024, c, 8) == TDP_OK &&
                  tdp_mem_copy(b, d + 1024, 8) == TDP_OK && memcmp(b, c, 8) == 0;
        _exit(ok ? 0 : 1);
    }
    int st = reap(pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
#endif
    tdp__cuda_stats_enable(false);
    tdp__cuda_free(d);
}

/* TDPIPE_CUDA_STATS: each call through the layer counted and timed, the
 * wait that follows a synchronous call on its own; nothing while off. */
static void test_call_stats(void **state)
{
    (void)state;
    unsigned long long calls = 0;
    double mean = 0;
    unsigned char host[64] = {0}, *d = NULL;
    tdp__cuda_stats_enable(true);
    tdp__cuda_stats_reset();
    assert_false(stat_of("memcpy", &calls, &mean));
    OK(tdp__cuda_malloc(0, sizeof(host), (void **)&d));
    tdp__cuda_fake_set_delay_us(20000); /* the copy lands 20 ms later */
    OK(tdp__cuda_memcpy(d, host, sizeof(host)));
    OK(tdp__cuda_memcpy(host, d, sizeof(host)));
    tdp__cuda_fake_set_delay_us(0);
    assert_true(stat_of("malloc", &calls, &mean));
    assert_int_equal(calls, 1);
    assert_true(stat_of("memcpy", &calls, &mean));
    assert_int_equal(calls, 2);
    assert_true(stat_of("sync_default", &calls, &mean));
    assert_int_equal(calls, 2);
    assert_true(mean >= 10000.0); /* the wait for the late copy is counted where it happens */
    assert_false(stat_of("event_query", &calls, &mean));
    char line[160];
    assert_false(tdp__cuda_stats_line(-1, line, sizeof(line)));
    assert_false(tdp__cuda_stats_line(1000, line, sizeof(line)));
    /* export_ is named without its underscore */
    tdp__cuda_ipc h;
    void *shared = NULL;
    OK(tdp__cuda_malloc_shared(0, 4096, &shared));
    OK(tdp__cuda_export(shared, &h));
    assert_true(stat_of("export", &calls, &mean));
    assert_int_equal(calls, 1);
    if (h.fd >= 0)
        close(h.fd);
    tdp__cuda_free(shared);

    tdp__cuda_stats_enable(false);
    OK(tdp__cuda_memcpy(d, host, sizeof(host)));
    assert_true(stat_of("memcpy", &calls, &mean));
    assert_int_equal(calls, 2);
    tdp__cuda_stats_reset();
    assert_false(stat_of("memcpy", &calls, &mean));
    tdp__cuda_free(d);
}

typedef struct hostfn_probe {
    pthread_t thread;
    const unsigned char *out;
    _Atomic int ran;
    _Atomic int saw_copy;
} hostfn_probe;

static void hostfn(void *arg)
{
    hostfn_probe *p = arg;
    p->thread = pthread_self();
    atomic_store(&p->saw_copy, p->out[0] == 0x22 && p->out[N - 1] == 0x22);
    atomic_store(&p->ran, 1);
}

static void test_host_func_after_copies(void **state)
{
    (void)state;
    unsigned char *src = malloc(N), *out = malloc(N), *d = NULL;
    assert_non_null(src);
    assert_non_null(out);
    memset(src, 0x22, N);
    memset(out, 0, N);
    hostfn_probe probe = {.out = out};
    tdp__cuda_stream *s = NULL;
    OK(tdp__cuda_stream_create(0, &s));
    OK(tdp__cuda_malloc(0, N, (void **)&d));
    tdp__cuda_fake_set_delay_us(DELAY_US / 10);
    OK(tdp__cuda_memcpy_async(d, src, N, s));
    OK(tdp__cuda_memcpy_async(out, d, N, s));
    OK(tdp__cuda_launch_host_func(s, hostfn, &probe));
    OK(tdp__cuda_stream_sync(s));
    assert_int_equal(atomic_load(&probe.ran), 1);
    assert_int_equal(atomic_load(&probe.saw_copy), 1);
    assert_false(pthread_equal(probe.thread, pthread_self()));
    tdp__cuda_fake_set_delay_us(0);
    tdp__cuda_free(d);
    tdp__cuda_stream_destroy(s);
    free(src);
    free(out);
}

/* Host function that breaks the rule: CUDA calls from inside it. */
typedef struct hostfn_calls {
    void *d;
    tdp__cuda_stream *s;
    tdp_err copy, async, event;
} hostfn_calls;

static void hostfn_calls_cuda(void *arg)
{
    hostfn_calls *c = arg;
    unsigned char b[16] = {0};
    tdp__cuda_event *e = NULL;
    c->copy = tdp__cuda_memcpy(b, c->d, sizeof(b));
    c->async = tdp__cuda_memcpy_async(c->d, b, sizeof(b), c->s);
    c->event = tdp__cuda_event_create(0, &e);
    if (e != NULL)
        tdp__cuda_event_destroy(e);
}

/* A GPU refuses any CUDA call from a host function (or deadlocks): so does the fake. */
static void test_host_func_makes_no_cuda_call(void **state)
{
    (void)state;
    hostfn_calls c = {.copy = TDP_OK, .async = TDP_OK, .event = TDP_OK};
    OK(tdp__cuda_stream_create(0, &c.s));
    OK(tdp__cuda_malloc(0, 4096, &c.d));
    OK(tdp__cuda_launch_host_func(c.s, hostfn_calls_cuda, &c));
    OK(tdp__cuda_stream_sync(c.s));
    assert_int_equal(c.copy, TDP_ECUDA);
    assert_int_equal(c.async, TDP_ECUDA);
    assert_int_equal(c.event, TDP_ECUDA);
    /* the same calls from an ordinary thread go through */
    unsigned char b[16];
    OK(tdp__cuda_memcpy(b, c.d, sizeof(b)));
    tdp__cuda_free(c.d);
    tdp__cuda_stream_destroy(c.s);
}

/* Host function: hold the stream until *arg is set (at most 10 s). */
static void gate_wait(void *arg)
{
    _Atomic int *gate = arg;
    struct timespec ms = {0, 1000 * 1000};
    for (int i = 0; i < 10000 && atomic_load(gate) == 0; i++)
        nanosleep(&ms, NULL);
}

static void test_events(void **state)
{
    (void)state;
    unsigned char *src = malloc(N), *out = malloc(N), *d = NULL;
    assert_non_null(src);
    assert_non_null(out);
    memset(src, 0x33, N);
    memset(out, 0, N);
    tdp__cuda_stream *a = NULL, *b = NULL;
    tdp__cuda_event *e = NULL;
    OK(tdp__cuda_stream_create(0, &a));
    OK(tdp__cuda_stream_create(0, &b));
    OK(tdp__cuda_event_create(0, &e));
    OK(tdp__cuda_event_query(e)); /* never recorded: done */
    OK(tdp__cuda_malloc(0, N, (void **)&d));

    /* a is held at a gate before it fills d: b, told to wait, must not copy d out yet */
    _Atomic int gate = 0;
    OK(tdp__cuda_launch_host_func(a, gate_wait, &gate));
    OK(tdp__cuda_memcpy_async(d, src, N, a));
    OK(tdp__cuda_event_record(e, a));
    OK(tdp__cuda_stream_wait_event(b, e));
    OK(tdp__cuda_memcpy_async(out, d, N, b));
    struct timespec pause = {0, 50 * 1000 * 1000};
    nanosleep(&pause, NULL); /* time enough for b to copy, had it not waited */
    assert_int_equal(tdp__cuda_event_query(e), TDP_EAGAIN);
    atomic_store(&gate, 1);
    OK(tdp__cuda_stream_sync(b));
    assert_memory_equal(out, src, N);
    OK(tdp__cuda_event_query(e));

    tdp__cuda_fake_set_delay_us(DELAY_US);
    OK(tdp__cuda_memcpy_async(d, out, N, a));
    OK(tdp__cuda_event_record(e, a));
    assert_int_equal(tdp__cuda_event_query(e), TDP_EAGAIN);
    OK(tdp__cuda_event_sync(e));
    OK(tdp__cuda_event_query(e));
    tdp__cuda_fake_set_delay_us(0);

    tdp__cuda_free(d);
    tdp__cuda_event_destroy(e);
    tdp__cuda_stream_destroy(b);
    tdp__cuda_stream_destroy(a);
    free(src);
    free(out);
}

static void test_oom_injected(void **state)
{
    (void)state;
    tdp_mem_stats s0, s1;
    int fds = open_fds();
    tdp_mem_stats_get(&s0);
    void *p = (void *)&p;
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_OOM_AT, 1);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, 0, N, 0, &p), TDP_ENOMEM);
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_OOM_AT, 2); /* the second from now */
    void *ok = NULL;
    OK(tdp_mem_alloc(TDP_MEM_HOST_PINNED, 0, N, 0, &ok));
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST_PINNED, 0, N, 0, &p), TDP_ENOMEM);
    assert_ptr_equal(p, (void *)&p);
    tdp_mem_free(TDP_MEM_HOST_PINNED, ok);
    tdp_mem_stats_get(&s1);
    /* nothing leaked: counters back where they were, no memfd left open */
    assert_int_equal(s1.allocs[TDP_MEM_CUDA], s0.allocs[TDP_MEM_CUDA]);
    assert_int_equal(s1.live_bytes[TDP_MEM_CUDA], s0.live_bytes[TDP_MEM_CUDA]);
    assert_int_equal(s1.allocs[TDP_MEM_HOST_PINNED] - s0.allocs[TDP_MEM_HOST_PINNED], 1);
    assert_int_equal(s1.live_bytes[TDP_MEM_HOST_PINNED], s0.live_bytes[TDP_MEM_HOST_PINNED]);
    assert_int_equal(s1.small_allocs - s1.small_frees, s0.small_allocs - s0.small_frees);
    assert_int_equal(open_fds(), fds);
    /* and the next allocation works again */
    OK(tdp_mem_alloc(TDP_MEM_CUDA, 0, N, 0, &p));
    tdp_mem_free(TDP_MEM_CUDA, p);
    assert_int_equal(open_fds(), fds);
}

static void test_copy_fail_injected(void **state)
{
    (void)state;
    unsigned char host[256] = {1}, *d = NULL;
    tdp__cuda_stream *s = NULL;
    OK(tdp__cuda_stream_create(0, &s));
    OK(tdp__cuda_malloc(0, sizeof(host), (void **)&d));
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_COPY_FAIL_AT, 2);
    OK(tdp__cuda_memcpy_async(d, host, sizeof(host), s));
    assert_int_equal(tdp__cuda_memcpy_async(host, d, sizeof(host), s), TDP_ECUDA);
    OK(tdp__cuda_memcpy_async(host, d, sizeof(host), s));
    tdp__cuda_fake_inject(TDP__CUDA_FAULT_COPY_FAIL_AT, 1);
    assert_int_equal(tdp_mem_copy(host, d, sizeof(host)), TDP_ECUDA);
    OK(tdp__cuda_stream_sync(s));
    tdp__cuda_free(d);
    tdp__cuda_stream_destroy(s);
}

static void test_kill_after_copy(void **state)
{
    (void)state;
    unsigned char host[64] = {0}, *d = NULL;
    OK(tdp__cuda_malloc(0, sizeof(host), (void **)&d));
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        tdp__cuda_fake_inject(TDP__CUDA_FAULT_KILL_AFTER_COPY, 2);
        if (tdp__cuda_memcpy(d, host, sizeof(host)) != TDP_OK)
            _exit(3);
        if (tdp__cuda_memcpy(host, d, sizeof(host)) != TDP_OK)
            _exit(4);
        _exit(5); /* should have been killed after the second copy */
    }
    int status = reap(pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGKILL);
    tdp__cuda_free(d);
}

static void test_export_import_across_fork(void **state)
{
    (void)state;
    unsigned char host[8192];
    unsigned char *d = NULL;
    OK(tdp__cuda_malloc_shared(0, sizeof(host), (void **)&d));
    memset(host, 0x5c, sizeof(host));
    OK(tdp__cuda_memcpy(d, host, sizeof(host)));
    tdp__cuda_ipc h;
    OK(tdp__cuda_export(d, &h));
    assert_true(h.fd >= 0);
    assert_true(h.size >= sizeof(host));

    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* a process of its own: the import maps the parent's bytes */
        unsigned char got[sizeof(host)];
        void *p = NULL;
        if (tdp__cuda_import(0, &h, &p) != TDP_OK)
            _exit(2);
        if (p == (void *)d)
            _exit(3); /* must be a mapping of its own */
        if (tdp__cuda_memcpy(got, p, sizeof(got)) != TDP_OK)
            _exit(4);
        for (size_t i = 0; i < sizeof(got); i++)
            if (got[i] != 0x5c)
                _exit(5);
        memset(got, 0xa7, sizeof(got));
        if (tdp__cuda_memcpy(p, got, sizeof(got)) != TDP_OK)
            _exit(6);
        tdp__cuda_import_close(p);
        _exit(0);
    }
    int status = reap(pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* and the child's writes are the parent's bytes */
    OK(tdp__cuda_memcpy(host, d, sizeof(host)));
    assert_int_equal(host[0], 0xa7);
    assert_int_equal(host[sizeof(host) - 1], 0xa7);
    close(h.fd);
    tdp__cuda_free(d);
}

static void test_devices_and_uuids(void **state)
{
    (void)state;
    OK(tdp__cuda_select("fake:3"));
    assert_int_equal(tdp__cuda_device_count(), 3);
    assert_int_equal(tdp_cuda_device_count(), 3);
    assert_int_equal(tdp__cuda_backend_get(), TDP__CUDA_FAKE);
    uint8_t u[3][16];
    for (int i = 0; i < 3; i++)
        OK(tdp__cuda_device_uuid(i, u[i]));
    assert_memory_not_equal(u[0], u[1], 16);
    assert_memory_not_equal(u[0], u[2], 16);
    assert_memory_not_equal(u[1], u[2], 16);
    uint8_t again[16];
    OK(tdp__cuda_device_uuid(1, again));
    assert_memory_equal(again, u[1], 16);
    assert_int_equal(tdp__cuda_device_uuid(3, again), TDP_EINVAL);
    OK(tdp__cuda_ctx_set(2));

    char buf[128];
    assert_string_equal(tdp_cuda_describe(buf, sizeof(buf)), "fake, 3 devices");
    void *d = NULL;
    OK(tdp__cuda_malloc(2, 100, &d));
    tdp__cuda_ptr_info info;
    OK(tdp__cuda_ptr_get_info((char *)d + 99, &info));
    assert_int_equal(info.kind, TDP__CUDA_PTR_DEVICE);
    assert_int_equal(info.device, 2);
    tdp__cuda_free(d);
    assert_int_equal(tdp__cuda_malloc(3, 100, &d), TDP_EINVAL);
    assert_int_equal(tdp__cuda_select("fake:0"), TDP_EINVAL);
    assert_int_equal(tdp__cuda_select("fake2"), TDP_EINVAL);
    assert_int_equal(tdp__cuda_select("gpu"), TDP_EINVAL);
}

static void test_pointer_kinds(void **state)
{
    (void)state;
    tdp__cuda_ptr_info info;
    void *pinned = NULL;
    int plain = 0;
    OK(tdp__cuda_host_alloc(1000, &pinned));
    OK(tdp__cuda_ptr_get_info(pinned, &info));
    assert_int_equal(info.kind, TDP__CUDA_PTR_PINNED);
    OK(tdp__cuda_ptr_get_info(&plain, &info));
    assert_int_equal(info.kind, TDP__CUDA_PTR_HOST);
    assert_int_equal(info.device, -1);
    /* a shared mapping, as the shm plane's slots are, registered and unregistered */
    size_t len = 1 << 16;
    char *shm = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    assert_true(shm != MAP_FAILED);
    OK(tdp__cuda_host_register(shm, len));
    OK(tdp__cuda_ptr_get_info(shm + len - 1, &info));
    assert_int_equal(info.kind, TDP__CUDA_PTR_PINNED);
    assert_int_equal(tdp__cuda_host_register(shm + 4096, 4096), TDP_ECUDA); /* overlaps */
    OK(tdp__cuda_host_unregister(shm));
    OK(tdp__cuda_ptr_get_info(shm, &info));
    assert_int_equal(info.kind, TDP__CUDA_PTR_HOST);
    assert_int_equal(tdp__cuda_host_unregister(shm), TDP_ECUDA);
    munmap(shm, len);
    tdp__cuda_host_free(pinned);
}

static void test_off(void **state)
{
    (void)state;
    OK(tdp__cuda_select("off"));
    assert_int_equal(tdp__cuda_backend_get(), TDP__CUDA_NONE);
    assert_int_equal(tdp_cuda_device_count(), 0);
    void *p = (void *)&p;
    assert_int_equal(tdp__cuda_malloc(0, 64, &p), TDP_ENOTSUP);
    assert_int_equal(tdp__cuda_host_alloc(64, &p), TDP_ENOTSUP);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, 0, 64, 0, &p), TDP_ENOTSUP);
    assert_ptr_equal(p, (void *)&p);
    tdp__cuda_stream *s = NULL;
    assert_int_equal(tdp__cuda_stream_create(0, &s), TDP_ENOTSUP);
    uint8_t u[16];
    assert_int_equal(tdp__cuda_device_uuid(0, u), TDP_ENOTSUP);
    char buf[128];
    assert_string_equal(tdp_cuda_describe(buf, sizeof(buf)), "no CUDA device (TDPIPE_CUDA=off)");
    /* host to host copies need no device */
    char a[8] = "abcdefg", b[8] = {0};
    OK(tdp_mem_copy(b, a, sizeof(a)));
    assert_string_equal(b, "abcdefg");
}

static void test_driver_backend_here(void **state)
{
    (void)state;
    OK(tdp__cuda_select("driver"));
    char buf[128];
    tdp_cuda_describe(buf, sizeof(buf));
    print_message("[  INFO    ] driver backend: %s\n", buf);
    int n = tdp_cuda_device_count();
    assert_true(n >= 0);
    if (n > 0) {
        assert_int_equal(tdp__cuda_backend_get(), TDP__CUDA_DRIVER);
        void *d = NULL;
        OK(tdp__cuda_malloc(0, 4096, &d));
        tdp__cuda_free(d);
        return;
    }
    /* no driver or no GPU: reported, never a crash */
    assert_non_null(strstr(buf, "no CUDA device"));
    void *p = (void *)&p;
    assert_int_equal(tdp__cuda_malloc(0, 64, &p), TDP_ENOTSUP);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST_PINNED, 0, 64, 0, &p), TDP_ENOTSUP);
    assert_ptr_equal(p, (void *)&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_host_touch_faults, fake_setup),
        cmocka_unit_test_setup(test_copy_is_late_until_sync, fake_setup),
        cmocka_unit_test_setup(test_sync_calls_done_on_return, fake_setup),
        cmocka_unit_test_setup(test_call_stats, fake_setup),
        cmocka_unit_test_setup(test_write_inline, fake_setup),
        cmocka_unit_test_setup(test_mem_copy_small, fake_setup),
        cmocka_unit_test_setup(test_host_func_after_copies, fake_setup),
        cmocka_unit_test_setup(test_host_func_makes_no_cuda_call, fake_setup),
        cmocka_unit_test_setup(test_events, fake_setup),
        cmocka_unit_test_setup(test_oom_injected, fake_setup),
        cmocka_unit_test_setup(test_copy_fail_injected, fake_setup),
        cmocka_unit_test_setup(test_kill_after_copy, fake_setup),
        cmocka_unit_test_setup(test_export_import_across_fork, fake_setup),
        cmocka_unit_test_setup(test_devices_and_uuids, fake_setup),
        cmocka_unit_test_setup(test_pointer_kinds, fake_setup),
        cmocka_unit_test_setup(test_off, fake_setup),
        cmocka_unit_test_setup(test_driver_backend_here, fake_setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
