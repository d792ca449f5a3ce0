/* log.c: leveled logging, quiet by default, with a replaceable handler. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

_Atomic int tdp__log_level = TDP_LOG_OFF;

static tdp_log_fn log_fn;
static void *log_arg;

static const char *const level_names[] = {"off", "error", "warn", "info", "debug", "trace"};

tdp_err tdp_log_level_parse(const char *name, tdp_log_level *out)
{
    if (name == NULL || out == NULL)
        return TDP_EINVAL;
    for (int i = 0; i <= TDP_LOG_TRACE; i++) {
        if (strcasecmp(name, level_names[i]) == 0) {
            *out = (tdp_log_level)i;
            return TDP_OK;
        }
    }
    return TDP_EINVAL;
}

/* Runs before main: the environment can turn logging on without code. */
__attribute__((constructor)) static void log_init_from_env(void)
{
    const char *env = getenv("TDP_LOG_LEVEL");
    tdp_log_level lvl;
    if (env != NULL && tdp_log_level_parse(env, &lvl) == TDP_OK)
        atomic_store_explicit(&tdp__log_level, (int)lvl, memory_order_relaxed);
}

void tdp_log_set_handler(tdp_log_fn fn, void *arg)
{
    log_fn = fn;
    log_arg = arg;
}

void tdp_log_set_level(tdp_log_level level)
{
    int l = (int)level; /* the enum may be unsigned: compare as int */
    if (l < TDP_LOG_OFF)
        l = TDP_LOG_OFF;
    if (l > TDP_LOG_TRACE)
        l = TDP_LOG_TRACE;
    atomic_store_explicit(&tdp__log_level, l, memory_order_relaxed);
}

tdp_log_level tdp_log_get_level(void)
{
    return (tdp_log_level)atomic_load_explicit(&tdp__log_level, memory_order_relaxed);
}

void tdp__log(tdp_log_level level, const char *file, int line, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);

    if (log_fn != NULL) {
        log_fn(level, file, line, msg, log_arg);
        return;
    }
    const char *base = strrchr(file, '/');
    fprintf(stderr, "tdpipe %-5s %s:%d: %s\n", level_names[level], base ? base + 1 : file, line,
            msg);
}
