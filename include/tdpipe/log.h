/*
 * log.h: leveled logging with an application-installable handler.
 *
 * The library is quiet by default: nothing is printed unless the application
 * raises the level (tdp_log_set_level) or sets TDP_LOG_LEVEL in the
 * environment (error, warn, info, debug, trace). Errors are reported through
 * return codes first; logs carry the detail of where and why.
 */
#ifndef TDPIPE_LOG_H
#define TDPIPE_LOG_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdp_log_level {
    TDP_LOG_OFF = 0,
    TDP_LOG_ERROR = 1,
    TDP_LOG_WARN = 2,
    TDP_LOG_INFO = 3,
    TDP_LOG_DEBUG = 4,
    TDP_LOG_TRACE = 5,
} tdp_log_level;

/*
 * A log handler receives one formatted line without trailing newline. It may
 * be called from any thread that calls into the library (the loop thread
 * included), so it must be thread-safe. `msg` is valid only for the call.
 */
typedef void (*tdp_log_fn)(tdp_log_level level, const char *file, int line, const char *msg,
                           void *arg);

/*
 * Install a handler (NULL restores the default, which writes to stderr).
 * Not synchronised with concurrent logging: install it before starting loops.
 */
TDP_API void tdp_log_set_handler(tdp_log_fn fn, void *arg);

/* Set the threshold; messages above it are dropped before formatting. */
TDP_API void tdp_log_set_level(tdp_log_level level);
TDP_API tdp_log_level tdp_log_get_level(void);

/* Parse "off", "error", "warn", "info", "debug", "trace" (case-insensitive). */
TDP_API tdp_err tdp_log_level_parse(const char *name, tdp_log_level *out);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_LOG_H */
