/*
 * tdpipe — stream tensordicts between processes and hosts.
 *
 * common.h: version, symbol export and compiler helpers shared by every
 * public header. Include <tdpipe/tdpipe.h> rather than this file.
 */
#ifndef TDPIPE_COMMON_H
#define TDPIPE_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

/* Version of the library and its headers. CMake reads these three lines. */
#define TDP_VERSION_MAJOR 0
#define TDP_VERSION_MINOR 1
#define TDP_VERSION_PATCH 0

#define TDP_VERSION_ENCODE(maj, min, pat) (((maj) * 1000000) + ((min) * 1000) + (pat))
#define TDP_VERSION TDP_VERSION_ENCODE(TDP_VERSION_MAJOR, TDP_VERSION_MINOR, TDP_VERSION_PATCH)

/*
 * Symbols are hidden by default; TDP_API marks the public ones. Static builds
 * define TDP_STATIC so nothing is decorated.
 */
#if defined(TDP_STATIC)
#define TDP_API
#elif defined(_WIN32)
#if defined(TDP_BUILDING)
#define TDP_API __declspec(dllexport)
#else
#define TDP_API __declspec(dllimport)
#endif
#else
#define TDP_API __attribute__((visibility("default")))
#endif

/* printf-style format checking for log helpers. */
#if defined(__GNUC__) || defined(__clang__)
#define TDP_CHECK_FMT(a, b) __attribute__((format(printf, a, b)))
#define TDP_WARN_UNUSED     __attribute__((warn_unused_result))
#else
#define TDP_CHECK_FMT(a, b)
#define TDP_WARN_UNUSED
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the library actually linked, encoded as TDP_VERSION. */
TDP_API uint32_t tdp_version(void);

/* Human-readable version string of the linked library, e.g. "0.1.0". */
TDP_API const char *tdp_version_string(void);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_COMMON_H */
