/*
 * test_skip.h: TDP_TEST_SKIP, a ':'-separated list of exact test names to
 * leave out, for the suites that take it (the TSan stage uses it), and
 * UNDER_TSAN for suites that size their work to ThreadSanitizer. Include
 * after <cmocka.h>.
 */
#ifndef TDP_TEST_SKIP_H
#define TDP_TEST_SKIP_H

#include <stdbool.h>
#include <string.h>

/* UNDER_TSAN: this build runs under ThreadSanitizer (GCC or Clang). */
#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif

/* Drop the tests named in list from t[0..n); returns how many are left. */
static inline size_t skip_named(struct CMUnitTest *t, size_t n, const char *list)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(t[i].name);
        bool drop = false;
        for (const char *p = list; p != NULL && *p != '\0';) {
            const char *e = strchr(p, ':');
            size_t pl = e != NULL ? (size_t)(e - p) : strlen(p);
            drop |= pl == len && strncmp(p, t[i].name, len) == 0;
            p = e != NULL ? e + 1 : NULL;
        }
        if (!drop)
            t[k++] = t[i];
    }
    return k;
}

#endif
