/* test_mem: host, pinned and device allocation, counters, device names. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <malloc.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <stdbool.h>
#include <unistd.h>
#include <stdlib.h>
#include <tdpipe/mem.h>

#include "core/alloc.h"

#include "core/cuda.h"
#include "core/populate.h"

static bool aligned_to(const void *p, size_t a)
{
    return ((uintptr_t)p % a) == 0;
}

/* ---- host allocations ---------------------------------------------------- */

static void test_host_alignment(void **state)
{
    (void)state;
    static const size_t aligns[] = {1, 2, 8, 16, 32, 64, 128, 256, 4096, 65536};
    for (size_t i = 0; i < sizeof(aligns) / sizeof(aligns[0]); i++) {
        void *p = NULL;
        assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 1000, aligns[i], &p), TDP_OK);
        assert_non_null(p);
        assert_true(aligned_to(p, aligns[i]));
        memset(p, 0xab, 1000); /* the whole range is ours (ASan checks) */
        tdp_mem_free(TDP_MEM_HOST, p);
    }
}

static void test_host_default_alignment_is_page(void **state)
{
    (void)state;
    assert_int_equal(TDP_BUFFER_ALIGN, 4096);
    for (int i = 0; i < 8; i++) {
        void *p = NULL;
        size_t size = (size_t)1 << (i * 3); /* 1 .. 2 MiB */
        assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, size, 0, &p), TDP_OK);
        assert_true(aligned_to(p, TDP_BUFFER_ALIGN));
        memset(p, i, size);
        tdp_mem_free(TDP_MEM_HOST, p);
    }
}

static void test_host_size_zero(void **state)
{
    (void)state;
    tdp_mem_stats before, mid, after;
    void *a = NULL, *b = NULL;

    tdp_mem_stats_get(&before);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 0, 64, &a), TDP_OK);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 0, 0, &b), TDP_OK);
    assert_non_null(a);
    assert_non_null(b);
    assert_ptr_not_equal(a, b); /* unique */
    assert_true(aligned_to(a, 64));
    assert_true(aligned_to(b, TDP_BUFFER_ALIGN));
    tdp_mem_stats_get(&mid);
    assert_int_equal(mid.allocs[TDP_MEM_HOST] - before.allocs[TDP_MEM_HOST], 2);
    assert_int_equal(mid.live_bytes[TDP_MEM_HOST], before.live_bytes[TDP_MEM_HOST]);
    tdp_mem_free(TDP_MEM_HOST, a);
    tdp_mem_free(TDP_MEM_HOST, b);
    tdp_mem_stats_get(&after);
    assert_int_equal(after.frees[TDP_MEM_HOST] - before.frees[TDP_MEM_HOST], 2);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    static const size_t bad_align[] = {3, 6, 12, 48, 100, 4095, 4097, 3 * 4096};
    tdp_mem_stats before, after;
    void *p = (void *)&p;

    tdp_mem_stats_get(&before);
    for (size_t i = 0; i < sizeof(bad_align) / sizeof(bad_align[0]); i++) {
        assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 64, bad_align[i], &p), TDP_EINVAL);
        assert_ptr_equal(p, (void *)&p); /* output untouched */
    }
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 64, 64, NULL), TDP_EINVAL);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_TYPE_COUNT, 0, 64, 64, &p), TDP_EINVAL);
    assert_int_equal(tdp_mem_alloc((tdp_mem_type)-1, 0, 64, 64, &p), TDP_EINVAL);
    assert_ptr_equal(p, (void *)&p);
    /* size + header would wrap: refused before the allocator is asked */
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, SIZE_MAX - 10, 64, &p), TDP_ENOMEM);
    assert_ptr_equal(p, (void *)&p);
    /* freeing NULL or an unknown type is a no-op */
    tdp_mem_free(TDP_MEM_HOST, NULL);
    tdp_mem_free(TDP_MEM_CUDA, NULL);
    tdp_mem_free(TDP_MEM_TYPE_COUNT, &p);
    tdp_mem_stats_get(&after);
    assert_memory_equal(&before, &after, sizeof(before));
}

static void test_counters_move_exactly(void **state)
{
    (void)state;
    tdp_mem_stats s0, s1, s2, s3;
    void *a = NULL, *b = NULL;

    tdp_mem_stats_get(&s0);
    uint64_t total0 = tdp_mem_total_allocs();
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 1234, 64, &a), TDP_OK);
    tdp_mem_stats_get(&s1);
    assert_int_equal(s1.allocs[TDP_MEM_HOST], s0.allocs[TDP_MEM_HOST] + 1);
    assert_int_equal(s1.frees[TDP_MEM_HOST], s0.frees[TDP_MEM_HOST]);
    assert_int_equal(s1.live_bytes[TDP_MEM_HOST], s0.live_bytes[TDP_MEM_HOST] + 1234);
    assert_int_equal(tdp_mem_total_allocs(), total0 + 1);

    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 100000, 4096, &b), TDP_OK);
    tdp_mem_stats_get(&s2);
    assert_int_equal(s2.allocs[TDP_MEM_HOST], s0.allocs[TDP_MEM_HOST] + 2);
    assert_int_equal(s2.live_bytes[TDP_MEM_HOST], s0.live_bytes[TDP_MEM_HOST] + 101234);

    tdp_mem_free(TDP_MEM_HOST, a);
    tdp_mem_stats_get(&s3);
    assert_int_equal(s3.frees[TDP_MEM_HOST], s0.frees[TDP_MEM_HOST] + 1);
    assert_int_equal(s3.live_bytes[TDP_MEM_HOST], s0.live_bytes[TDP_MEM_HOST] + 100000);

    tdp_mem_free(TDP_MEM_HOST, b);
    tdp_mem_stats_get(&s3);
    assert_int_equal(s3.frees[TDP_MEM_HOST], s0.frees[TDP_MEM_HOST] + 2);
    assert_int_equal(s3.live_bytes[TDP_MEM_HOST], s0.live_bytes[TDP_MEM_HOST]);
    /* host operations leave the other kinds alone */
    for (int t = 1; t < TDP_MEM_TYPE_COUNT; t++) {
        assert_int_equal(s3.allocs[t], s0.allocs[t]);
        assert_int_equal(s3.frees[t], s0.frees[t]);
        assert_int_equal(s3.live_bytes[t], s0.live_bytes[t]);
    }
    tdp_mem_stats_get(NULL); /* no crash */
}

static void test_small_object_counters(void **state)
{
    (void)state;
    tdp_mem_stats s0, s1;

    tdp_mem_stats_get(&s0);
    uint64_t total0 = tdp_mem_total_allocs();
    char *a = tdp__malloc(10);
    char *b = tdp__calloc(3, 7);
    char *c = tdp__strdup("hello");
    char *d = tdp__strndup("hello world", 5);
    assert_non_null(a);
    assert_non_null(b);
    assert_string_equal(c, "hello");
    assert_string_equal(d, "hello");
    for (int i = 0; i < 21; i++)
        assert_int_equal(b[i], 0);
    tdp_mem_stats_get(&s1);
    assert_int_equal(s1.small_allocs - s0.small_allocs, 4);
    assert_int_equal(s1.small_frees, s0.small_frees);
    assert_int_equal(tdp_mem_total_allocs() - total0, 4);

    a = tdp__realloc(a, 4000); /* growing counts as free + alloc */
    assert_non_null(a);
    tdp_mem_stats_get(&s1);
    assert_int_equal(s1.small_allocs - s0.small_allocs, 5);
    assert_int_equal(s1.small_frees - s0.small_frees, 1);

    tdp__free(a);
    tdp__free(b);
    tdp__free(c);
    tdp__free(d);
    tdp__free(NULL); /* not counted */
    tdp_mem_stats_get(&s1);
    assert_int_equal(s1.small_frees - s0.small_frees, 5);
    assert_int_equal(s1.small_allocs - s1.small_frees, s0.small_allocs - s0.small_frees);
}

/* ---- CUDA kinds ---------------------------------------------------------- */

/* A device to allocate on: the machine's GPU where there is one, else the fake. */
static int use_device(void **state)
{
    (void)state;
    if (tdp__cuda_select("driver") != TDP_OK || tdp_cuda_device_count() == 0)
        assert_int_equal(tdp__cuda_select("fake"), TDP_OK);
    return 0;
}

static int use_no_device(void **state)
{
    (void)state;
    assert_int_equal(tdp__cuda_select("off"), TDP_OK);
    return 0;
}

static void test_cuda_kinds_without_gpu(void **state)
{
    (void)state;
    assert_int_equal(tdp_cuda_device_count(), 0);

    tdp_mem_stats before, after;
    tdp_mem_stats_get(&before);
    void *p = (void *)&p;
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, 0, 1024, 0, &p), TDP_ENOTSUP);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, 0, 1024, 256, &p), TDP_ENOTSUP);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST_PINNED, 0, 1024, 0, &p), TDP_ENOTSUP);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST_PINNED, 0, 0, 64, &p), TDP_ENOTSUP);
    assert_ptr_equal(p, (void *)&p);
    tdp_mem_stats_get(&after);
    assert_memory_equal(&before, &after, sizeof(before));
}

static void test_cuda_alloc_free(void **state)
{
    (void)state;
    tdp_mem_stats s0, s1;
    void *d = NULL, *h = NULL;
    const size_t n = 1 << 20;

    assert_true(tdp_cuda_device_count() > 0);
    tdp_mem_stats_get(&s0);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, 0, n, 0, &d), TDP_OK);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST_PINNED, 0, n, 0, &h), TDP_OK);
    assert_true(aligned_to(d, 256));
    assert_true(aligned_to(h, 256));
    /* larger than the runtime guarantees: refused */
    void *x = (void *)&x;
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, 0, n, 4096, &x), TDP_EINVAL);
    assert_ptr_equal(x, (void *)&x);

    tdp__cuda_ptr_info info;
    assert_int_equal(tdp__cuda_ptr_get_info(d, &info), TDP_OK);
    assert_int_equal(info.kind, TDP__CUDA_PTR_DEVICE);
    assert_int_equal(info.device, 0);
    assert_int_equal(tdp__cuda_ptr_get_info(h, &info), TDP_OK);
    assert_int_equal(info.kind, TDP__CUDA_PTR_PINNED);

    tdp_mem_stats_get(&s1);
    assert_int_equal(s1.allocs[TDP_MEM_CUDA] - s0.allocs[TDP_MEM_CUDA], 1);
    assert_int_equal(s1.live_bytes[TDP_MEM_CUDA] - s0.live_bytes[TDP_MEM_CUDA], n);
    assert_int_equal(s1.allocs[TDP_MEM_HOST_PINNED] - s0.allocs[TDP_MEM_HOST_PINNED], 1);
    assert_int_equal(s1.live_bytes[TDP_MEM_HOST_PINNED] - s0.live_bytes[TDP_MEM_HOST_PINNED], n);
    /* one bookkeeping record per allocation, the refused one none */
    assert_int_equal(s1.small_allocs - s0.small_allocs, 2);

    /* the memory works: device -> pinned host round trip */
    assert_int_equal(tdp_mem_set(d, 0x5a, n), TDP_OK);
    memset(h, 0, n);
    assert_int_equal(tdp_mem_copy(h, d, n), TDP_OK);
    assert_int_equal(((unsigned char *)h)[0], 0x5a);
    assert_int_equal(((unsigned char *)h)[n - 1], 0x5a);

    tdp_mem_free(TDP_MEM_CUDA, d);
    tdp_mem_free(TDP_MEM_HOST_PINNED, h);
    tdp_mem_stats_get(&s1);
    assert_int_equal(s1.frees[TDP_MEM_CUDA] - s0.frees[TDP_MEM_CUDA], 1);
    assert_int_equal(s1.frees[TDP_MEM_HOST_PINNED] - s0.frees[TDP_MEM_HOST_PINNED], 1);
    assert_int_equal(s1.live_bytes[TDP_MEM_CUDA], s0.live_bytes[TDP_MEM_CUDA]);
    assert_int_equal(s1.live_bytes[TDP_MEM_HOST_PINNED], s0.live_bytes[TDP_MEM_HOST_PINNED]);
    assert_int_equal(s1.small_allocs - s1.small_frees, s0.small_allocs - s0.small_frees);

    /* size 0 gives a valid pointer that can be freed */
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, 0, 0, 0, &d), TDP_OK);
    assert_non_null(d);
    tdp_mem_free(TDP_MEM_CUDA, d);
    tdp_mem_stats_get(&s1);
    assert_int_equal(s1.allocs[TDP_MEM_CUDA] - s0.allocs[TDP_MEM_CUDA], 2);
    assert_int_equal(s1.frees[TDP_MEM_CUDA] - s0.frees[TDP_MEM_CUDA], 2);
    assert_int_equal(s1.live_bytes[TDP_MEM_CUDA], s0.live_bytes[TDP_MEM_CUDA]);
    /* a device that does not exist */
    x = (void *)&x;
    assert_int_equal(tdp_mem_alloc(TDP_MEM_CUDA, tdp_cuda_device_count(), 64, 0, &x), TDP_EINVAL);
    assert_ptr_equal(x, (void *)&x);
}

/* ---- devices ------------------------------------------------------------- */

static void test_device_parse_good(void **state)
{
    (void)state;
    static const struct {
        const char *s;
        tdp_device_type type;
        int index;
        const char *canon;
    } good[] = {
        {"cpu", TDP_DEVICE_CPU, 0, "cpu"},
        {"cuda", TDP_DEVICE_CUDA, 0, "cuda:0"},
        {"cuda:0", TDP_DEVICE_CUDA, 0, "cuda:0"},
        {"cuda:3", TDP_DEVICE_CUDA, 3, "cuda:3"},
        {"cuda:10", TDP_DEVICE_CUDA, 10, "cuda:10"},
        {"cuda:999999999", TDP_DEVICE_CUDA, 999999999, "cuda:999999999"},
    };
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        tdp_device d = {(tdp_device_type)7, -7};
        char buf[TDP_DEVICE_STRLEN];
        assert_int_equal(tdp_device_parse(good[i].s, &d), TDP_OK);
        assert_int_equal(d.type, good[i].type);
        assert_int_equal(d.index, good[i].index);
        assert_ptr_equal(tdp_device_format(d, buf), buf);
        assert_string_equal(buf, good[i].canon);
        /* the canonical name parses back to the same device */
        tdp_device again;
        assert_int_equal(tdp_device_parse(buf, &again), TDP_OK);
        assert_true(tdp_device_equal(d, again));
    }
}

static void test_device_parse_bad(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "cuda:",    "cuda:01", "gpu",
        "cuda:-1",  "cuda:1x", "cuda:1234567890",
        "",         "CPU",     "Cuda",
        "cuda:+1",  " cpu",    "cpu ",
        "cpu:0",    "cuda:0 ", "cuda:00",
        "cuda0",    "cuda::1", "cuda:0x1",
        "cuda:1.0", "mps",     "cuda:9999999999",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tdp_device d = {(tdp_device_type)7, -7};
        if (tdp_device_parse(bad[i], &d) != TDP_EINVAL)
            fail_msg("device '%s' was accepted", bad[i]);
        assert_int_equal(d.type, 7); /* untouched */
        assert_int_equal(d.index, -7);
    }
    tdp_device d;
    assert_int_equal(tdp_device_parse(NULL, &d), TDP_EINVAL);
    assert_int_equal(tdp_device_parse("cpu", NULL), TDP_EINVAL);
}

static void test_device_format_and_equal(void **state)
{
    (void)state;
    char buf[TDP_DEVICE_STRLEN];
    assert_string_equal(tdp_device_format(TDP_DEVICE_CPU_INIT, buf), "cpu");
    assert_string_equal(tdp_device_format((tdp_device){TDP_DEVICE_CUDA, 3}, buf), "cuda:3");
    assert_string_equal(tdp_device_format((tdp_device){TDP_DEVICE_CUDA, INT_MAX}, buf),
                        "cuda:2147483647");
    assert_true(strlen(buf) < TDP_DEVICE_STRLEN);

    tdp_device cpu = TDP_DEVICE_CPU_INIT, cpu_junk = {TDP_DEVICE_CPU, 5};
    tdp_device c0 = {TDP_DEVICE_CUDA, 0}, c1 = {TDP_DEVICE_CUDA, 1};
    assert_true(tdp_device_equal(cpu, cpu));
    assert_true(tdp_device_equal(cpu, cpu_junk)); /* the index means nothing on cpu */
    assert_true(tdp_device_equal(c0, (tdp_device){TDP_DEVICE_CUDA, 0}));
    assert_false(tdp_device_equal(c0, c1));
    assert_false(tdp_device_equal(cpu, c0));
    assert_false(tdp_device_equal(c0, cpu));
}

/* ---- huge pages for large host buffers --------------------------------------- */

static char huge_dir[64];

static void put_file(const char *rel, const char *text)
{
    char path[256], cmd[320];
    snprintf(path, sizeof(path), "%s%s", huge_dir, rel);
    snprintf(cmd, sizeof(cmd), "mkdir -p \"$(dirname '%s')\"", path);
    assert_int_equal(system(cmd), 0);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* A buddyinfo whose Normal zone has `blocks` free 4 MiB blocks (order 10). */
static void put_buddyinfo(unsigned blocks)
{
    char text[512];
    snprintf(text, sizeof(text),
             "Node 0, zone      DMA      0      0      0      0      0      0      0      0      "
             "1      1      3\n"
             "Node 0, zone    DMA32      2      2      4      2      5      4      3      3      "
             "4      0      0\n"
             "Node 0, zone   Normal   3106   5106   6562   5686   4054   2810   1729    979    "
             "462      0 %6u\n",
             blocks);
    put_file("/proc/buddyinfo", text);
}

/* Whether the mapping holding p was advised MADV_HUGEPAGE ("hg" in its VmFlags). */
static bool vma_has_hg(const void *p)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    assert_non_null(f);
    char line[512];
    bool in = false, hg = false;
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
        else if (in && strncmp(line, "VmFlags:", 8) == 0)
            hg = strstr(line, " hg") != NULL;
    }
    fclose(f);
    return hg;
}

/* Can this kernel take MADV_HUGEPAGE at all (THP built in)? */
static bool kernel_has_thp(void)
{
    return access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
}

static int huge_setup(void **state)
{
    (void)state;
    /* large blocks from mmap, never from the heap, whatever was freed before:
     * a heap range advised by an earlier test could come back to a later one */
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    snprintf(huge_dir, sizeof(huge_dir), "/tmp/tdp-huge-XXXXXX");
    assert_non_null(mkdtemp(huge_dir));
    unsetenv("TDPIPE_HUGE_PAGES");
    put_file("/sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n");
    put_buddyinfo(1000); /* 2000 free 2 MiB blocks */
    tdp__huge_set_root(huge_dir);
    return 0;
}

static int huge_teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", huge_dir);
    assert_int_equal(system(cmd), 0);
    unsetenv("TDPIPE_HUGE_PAGES");
    tdp__huge_set_root(NULL);
    return 0;
}

/*
 * A fresh 2 MiB-aligned mapping of n bytes, not advised yet: a mapping of
 * its own (not the heap, which malloc would hand out again later with the
 * advice still on it), unmapped whole by region_free.
 */
static void *region(size_t n)
{
    size_t span = n + TDP__HUGE_PAGE;
    char *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(m != MAP_FAILED);
    char *p = (char *)(((uintptr_t)m + TDP__HUGE_PAGE - 1) & ~(uintptr_t)(TDP__HUGE_PAGE - 1));
    if (p > m)
        assert_int_equal(munmap(m, (size_t)(p - m)), 0);
    size_t tail = (size_t)(m + span - (p + n));
    if (tail > 0)
        assert_int_equal(munmap(p + n, tail), 0);
    return p;
}

static void region_free(void *p, size_t n)
{
    assert_int_equal(munmap(p, n), 0);
}

static void test_huge_decision(void **state)
{
    (void)state;
    const size_t n = 8u << 20; /* 4 blocks: 8 free ones are enough */
    bool thp = kernel_has_thp();

    /* plenty of free blocks, no balloon: asked (where the kernel can) */
    void *p = region(n);
    assert_int_equal(tdp__huge_advise(p, n), thp);
    assert_int_equal(vma_has_hg(p), thp);
    region_free(p, n);

    /* not aligned, or smaller than one huge page: never */
    p = region(n);
    assert_false(tdp__huge_advise((char *)p + 4096, n - 4096));
    assert_false(tdp__huge_advise(p, TDP__HUGE_PAGE - 1));
    region_free(p, n);

    /* fewer free blocks than twice the need: small pages, no compaction */
    put_buddyinfo(3); /* 6 blocks < 8 */
    p = region(n);
    assert_false(tdp__huge_advise(p, n));
    assert_false(vma_has_hg(p));
    /* ... unless asked for whatever the state of memory */
    setenv("TDPIPE_HUGE_PAGES", "1", 1);
    assert_int_equal(tdp__huge_advise(p, n), thp);
    region_free(p, n);
    unsetenv("TDPIPE_HUGE_PAGES");
    put_buddyinfo(4); /* exactly 8 */
    p = region(n);
    assert_int_equal(tdp__huge_advise(p, n), thp);
    region_free(p, n);

    /* THP off in the system: never, even when asked */
    put_file("/sys/kernel/mm/transparent_hugepage/enabled", "always madvise [never]\n");
    tdp__huge_set_root(huge_dir); /* read once per process: look again */
    setenv("TDPIPE_HUGE_PAGES", "1", 1);
    p = region(n);
    assert_false(tdp__huge_advise(p, n));
    region_free(p, n);
    unsetenv("TDPIPE_HUGE_PAGES");
    put_file("/sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n");
    tdp__huge_set_root(huge_dir); /* read once per process: look again */

    /* TDPIPE_HUGE_PAGES=0: never */
    setenv("TDPIPE_HUGE_PAGES", "0", 1);
    p = region(n);
    assert_false(tdp__huge_advise(p, n));
    assert_false(vma_has_hg(p));
    region_free(p, n);
    unsetenv("TDPIPE_HUGE_PAGES");

    /* a balloon that reports free pages to its host: not in auto, yes when asked */
    put_file("/sys/bus/virtio/devices/virtio0/device", "0x0001\n");
    put_file("/sys/bus/virtio/devices/virtio0/features", "1111110000\n"); /* not a balloon */
    put_file("/sys/bus/virtio/devices/virtio1/device", "0x0005\n");
    put_file("/sys/bus/virtio/devices/virtio1/features", "0110000000\n"); /* no reporting */
    tdp__huge_set_root(huge_dir);                                         /* forget what it saw */
    p = region(n);
    assert_int_equal(tdp__huge_advise(p, n), thp);
    region_free(p, n);
    put_file("/sys/bus/virtio/devices/virtio1/features", "0110010100\n"); /* bit 5 */
    tdp__huge_set_root(huge_dir);
    p = region(n);
    assert_false(tdp__huge_advise(p, n));
    setenv("TDPIPE_HUGE_PAGES", "on", 1);
    assert_int_equal(tdp__huge_advise(p, n), thp);
    region_free(p, n);
}

/* tdp_mem_huge_describe: the line `tdpipe version` prints, one per case. */
static void test_huge_describe(void **state)
{
    (void)state;
    char buf[128];
    assert_string_equal(tdp_mem_huge_describe(buf, sizeof(buf)),
                        "asked for when 2 MiB blocks are free (2000 now)");
    setenv("TDPIPE_HUGE_PAGES", "0", 1);
    assert_string_equal(tdp_mem_huge_describe(buf, sizeof(buf)),
                        "not asked for: TDPIPE_HUGE_PAGES=0");
    setenv("TDPIPE_HUGE_PAGES", "on", 1);
    assert_string_equal(tdp_mem_huge_describe(buf, sizeof(buf)), "asked for (TDPIPE_HUGE_PAGES=1)");
    setenv("TDPIPE_HUGE_PAGES", "auto", 1);
    put_file("/sys/bus/virtio/devices/virtio0/device", "0x0005\n");
    put_file("/sys/bus/virtio/devices/virtio0/features", "0110010100\n");
    tdp__huge_set_root(huge_dir);
    assert_string_equal(tdp_mem_huge_describe(buf, sizeof(buf)),
                        "not asked for: a virtio balloon reports free pages to its host");
    put_file("/sys/kernel/mm/transparent_hugepage/enabled", "always madvise [never]\n");
    tdp__huge_set_root(huge_dir); /* read once per process: look again */
    assert_non_null(strstr(tdp_mem_huge_describe(buf, sizeof(buf)), "are off (never)"));
    /* truncated to fit, and terminated */
    char small[8];
    assert_int_equal(strlen(tdp_mem_huge_describe(small, sizeof(small))), 7);
    assert_null(tdp_mem_huge_describe(NULL, 10));
}

/* tdp_mem_alloc: a large host buffer gets the advice, a small one never. */
static void test_huge_host_alloc(void **state)
{
    (void)state;
    bool thp = kernel_has_thp();
    void *big = NULL, *small = NULL;
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, TDP__HUGE_MIN, 0, &big), TDP_OK);
    assert_int_equal((uintptr_t)big % TDP_BUFFER_ALIGN, 0);
    assert_int_equal(vma_has_hg(big), thp);
    memset(big, 0x5a, TDP__HUGE_MIN); /* all of it ours to write */
    tdp_mem_free(TDP_MEM_HOST, big);

    /* just below the threshold: as before, page-aligned, no advice */
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, TDP__HUGE_MIN - 1, 0, &small), TDP_OK);
    assert_int_equal((uintptr_t)small % TDP_BUFFER_ALIGN, 0);
    assert_false(vma_has_hg(small));
    tdp_mem_free(TDP_MEM_HOST, small);

    /* the advice withheld: a large buffer as any other */
    setenv("TDPIPE_HUGE_PAGES", "0", 1);
    assert_int_equal(tdp_mem_alloc(TDP_MEM_HOST, 0, 3 * TDP__HUGE_MIN, 0, &big), TDP_OK);
    assert_false(vma_has_hg(big));
    tdp_mem_free(TDP_MEM_HOST, big);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_alignment),
        cmocka_unit_test(test_host_default_alignment_is_page),
        cmocka_unit_test(test_host_size_zero),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_counters_move_exactly),
        cmocka_unit_test(test_small_object_counters),
        cmocka_unit_test_setup(test_cuda_kinds_without_gpu, use_no_device),
        cmocka_unit_test_setup(test_cuda_alloc_free, use_device),
        cmocka_unit_test(test_device_parse_good),
        cmocka_unit_test(test_device_parse_bad),
        cmocka_unit_test(test_device_format_and_equal),
        cmocka_unit_test_setup_teardown(test_huge_decision, huge_setup, huge_teardown),
        cmocka_unit_test_setup_teardown(test_huge_host_alloc, huge_setup, huge_teardown),
        cmocka_unit_test_setup_teardown(test_huge_describe, huge_setup, huge_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
