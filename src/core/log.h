/* log.h (internal): logging macros. Log once, where an error is detected. */
#ifndef TDP_CORE_LOG_H
#define TDP_CORE_LOG_H

#include <stdatomic.h>
#include <tdpipe/log.h>

/*
 * Read on every log call from any thread, set by tdp_log_set_level at any
 * time: atomic, relaxed (a stale level only drops or keeps one line).
 */
extern _Atomic int tdp__log_level;

void tdp__log(tdp_log_level level, const char *file, int line, const char *fmt, ...)
    TDP_CHECK_FMT(4, 5);

#define TDP_LOG(lvl, ...)                                                                          \
    do {                                                                                           \
        if ((int)(lvl) <= atomic_load_explicit(&tdp__log_level, memory_order_relaxed))             \
            tdp__log((lvl), __FILE__, __LINE__, __VA_ARGS__);                                      \
    } while (0)

#define tdp_log_error(...) TDP_LOG(TDP_LOG_ERROR, __VA_ARGS__)
#define tdp_log_warn(...)  TDP_LOG(TDP_LOG_WARN, __VA_ARGS__)
#define tdp_log_info(...)  TDP_LOG(TDP_LOG_INFO, __VA_ARGS__)
#define tdp_log_debug(...) TDP_LOG(TDP_LOG_DEBUG, __VA_ARGS__)
#define tdp_log_trace(...) TDP_LOG(TDP_LOG_TRACE, __VA_ARGS__)

#endif
