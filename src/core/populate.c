/* populate.c: fault pages in ahead of their first use (populate.h). */
#include "populate.h"

#include <tdpipe/mem.h>

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older headers lack it */
#endif

static size_t page_size(void)
{
    long ps = sysconf(_SC_PAGESIZE);
    return ps > 0 ? (size_t)ps : 4096u;
}

/* Touch each page: one fault each, but all of them here rather than later. */
static void touch_pages(volatile unsigned char *b, size_t n, size_t ps)
{
    for (size_t off = 0; off < n; off += ps)
        b[off] = b[off];
    if (n > 0)
        b[n - 1] = b[n - 1];
}

void tdp__populate_write(void *p, size_t n)
{
    if (p == NULL || n == 0)
        return;
    size_t ps = page_size();
#ifdef __linux__
    /* madvise wants a page-aligned start: round it down (the page is ours too) */
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(ps - 1);
    if (madvise((void *)a, n + ((uintptr_t)p - a), MADV_POPULATE_WRITE) == 0)
        return;
        /* EINVAL: a kernel before 5.14; anything else: let the pages fault one by one */
#endif
    touch_pages(p, n, ps);
}

/* ---- transparent huge pages ----------------------------------------------- */

/* Where /proc and /sys are: "" but in tests (tdp__huge_set_root). */
static char huge_root[256];
/*
 * What the system is, looked up once (a large buffer may be allocated per
 * message: a loan on the ucx plane): -1 not looked yet, 0 no, 1 yes.
 */
static _Atomic int thp_on = -1;    /* transparent huge pages enabled */
static _Atomic int reporting = -1; /* free pages go back to a hypervisor */

void tdp__huge_set_root(const char *root)
{
    snprintf(huge_root, sizeof(huge_root), "%s", root != NULL ? root : "");
    atomic_store(&thp_on, -1);
    atomic_store(&reporting, -1);
}

static FILE *open_at_root(const char *path)
{
    char full[512];
    snprintf(full, sizeof(full), "%s%s", huge_root, path);
    return fopen(full, "r");
}

/* transparent_hugepage/enabled is "always" or "madvise" (not "never", not absent). */
static bool thp_enabled(void)
{
    int on = atomic_load(&thp_on);
    if (on >= 0)
        return on == 1;
    char buf[128] = {0};
    FILE *f = open_at_root("/sys/kernel/mm/transparent_hugepage/enabled");
    bool ok = f != NULL && fgets(buf, sizeof(buf), f) != NULL && strstr(buf, "[never]") == NULL &&
              (strstr(buf, "[always]") != NULL || strstr(buf, "[madvise]") != NULL);
    if (f != NULL)
        fclose(f);
    atomic_store(&thp_on, ok ? 1 : 0);
    return ok;
}

/*
 * A virtio balloon that reports free pages (feature bit 5,
 * VIRTIO_BALLOON_F_REPORTING): the guest hands free blocks of 2 MiB and
 * more back to the host, which drops them; a huge page taken from one is
 * faulted in again by the host, 4 KiB at a time, which on the development
 * VM made a first touch of 100 MB cost 330 ms instead of 20 (4 KiB pages,
 * taken from smaller blocks the host still backs: 80 ms). There, huge
 * pages are a gamble, and tdpipe does not ask for them.
 */
static bool reports_free_pages(void)
{
    int r = atomic_load(&reporting);
    if (r >= 0)
        return r == 1;
    r = 0;
    for (int i = 0; i < 64 && r == 0; i++) {
        char path[96], buf[160] = {0};
        snprintf(path, sizeof(path), "/sys/bus/virtio/devices/virtio%d/device", i);
        FILE *f = open_at_root(path);
        if (f == NULL)
            continue;
        bool balloon = fgets(buf, sizeof(buf), f) != NULL && strtoul(buf, NULL, 0) == 5;
        fclose(f);
        if (!balloon)
            continue;
        snprintf(path, sizeof(path), "/sys/bus/virtio/devices/virtio%d/features", i);
        if ((f = open_at_root(path)) == NULL)
            continue;
        /* one character per feature bit, bit 0 first */
        if (fgets(buf, sizeof(buf), f) != NULL && strlen(buf) > 5 && buf[5] == '1')
            r = 1;
        fclose(f);
    }
    atomic_store(&reporting, r);
    return r == 1;
}

/*
 * Free 2 MiB blocks now, from /proc/buddyinfo: per zone, the free blocks
 * of each order from 0 up; an order-k block (k >= 9) holds 2^(k-9) of them.
 * The DMA zone (16 MiB) is left out.
 */
static uint64_t free_huge_blocks(void)
{
    FILE *f = open_at_root("/proc/buddyinfo");
    if (f == NULL)
        return 0;
    char line[512];
    uint64_t blocks = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        char *z = strstr(line, "zone");
        if (z == NULL)
            continue;
        z += 4;
        while (*z == ' ')
            z++;
        size_t zl = strcspn(z, " \n");
        if (zl == 3 && strncmp(z, "DMA", 3) == 0)
            continue;
        char *s = z + zl, *end;
        for (int order = 0; order < 20; order++) {
            unsigned long long c = strtoull(s, &end, 10);
            if (end == s)
                break;
            s = end;
            if (order >= 9 && c < (UINT64_MAX >> 20))
                blocks += (uint64_t)c << (order - 9);
        }
    }
    fclose(f);
    return blocks;
}

/* TDPIPE_HUGE_PAGES: -1 unset or "auto", 0 off, 1 on. */
static int huge_env(void)
{
    const char *env = getenv("TDPIPE_HUGE_PAGES");
    if (env == NULL || strcmp(env, "auto") == 0 || *env == '\0')
        return -1;
    if (strcmp(env, "0") == 0 || strcmp(env, "off") == 0)
        return 0;
    if (strcmp(env, "1") == 0 || strcmp(env, "on") == 0)
        return 1;
    return -1;
}

const char *tdp_mem_huge_describe(char *buf, size_t n)
{
    if (buf == NULL || n == 0)
        return buf;
    int env = huge_env();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (env == 0)
        snprintf(buf, n, "not asked for: TDPIPE_HUGE_PAGES=0");
    else if (!thp_enabled())
        snprintf(buf, n, "not asked for: transparent huge pages are off (never) or absent");
    else if (env == 1)
        snprintf(buf, n, "asked for (TDPIPE_HUGE_PAGES=1)");
    else if (reports_free_pages())
        snprintf(buf, n, "not asked for: a virtio balloon reports free pages to its host");
    else
        snprintf(buf, n, "asked for when 2 MiB blocks are free (%llu now)",
                 (unsigned long long)free_huge_blocks());
#else
    (void)env;
    snprintf(buf, n, "not asked for: no transparent huge pages on this system");
#endif
    return buf;
}

bool tdp__huge_advise(void *p, size_t n)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    int env = huge_env();
    if (p == NULL || n < TDP__HUGE_PAGE || ((uintptr_t)p & (TDP__HUGE_PAGE - 1)) != 0)
        return false;
    if (env == 0 || !thp_enabled())
        return false;
    if (env != 1) {
        uint64_t need = ((uint64_t)n + TDP__HUGE_PAGE - 1) / TDP__HUGE_PAGE;
        if (reports_free_pages() || free_huge_blocks() < 2 * need)
            return false; /* a host fault per 4 KiB, or compaction: small pages */
    }
    return madvise(p, n, MADV_HUGEPAGE) == 0;
#else
    (void)p;
    (void)n;
    return false;
#endif
}
