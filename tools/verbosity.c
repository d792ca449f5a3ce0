/*
 * verbosity.c: how much the command says. -v raises tdpipe's log level and
 * UCX's; UCX's own log goes to stderr in its own words, never to stdout,
 * where results that scripts read are printed.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>

#include "cli.h"

/*
 * UCX's own log level, unless the user chose one (UCX_LOG_LEVEL): by
 * default only fatal errors, so that UCX's warnings and errors about a
 * peer that died (which tdpipe reports in its own words) do not reach the
 * terminal; each -v shows more. libucs read its environment when it was
 * loaded, so the value is set in its global options; nothing of UCX has
 * been initialised yet (the first loop does that).
 */
static const char *ucx_level; /* what we set, for the programs bench starts */

static void set_ucx_log_level(int verbose)
{
    static const char *const levels[] = {"fatal", "warn", "info", "debug"};
    const char *level = levels[verbose < 0 ? 0 : verbose > 3 ? 3 : verbose];
    if (getenv("UCX_LOG_LEVEL") != NULL)
        return;
    ucs_global_opts_set_value("LOG_LEVEL", level);
    ucx_level = level;
}

/*
 * In a child about to exec: the level in its environment, read as libucs
 * loads there. Not set in this process's own environment: UCX would warn
 * ("unused env variable") at each context it makes, its options having
 * been read before.
 */
void tdp_cli_ucx_log_env(void)
{
    if (ucx_level != NULL)
        setenv("UCX_LOG_LEVEL", ucx_level, 1);
}

/*
 * UCX prints its log on stdout unless told otherwise (UCX_LOG_FILE), where
 * it would mix with results that scripts read: put it on stderr, in UCX's
 * words, whatever the level. Runs only for messages at or above UCX's log
 * level.
 */
static ucs_log_func_rc_t ucx_log_to_stderr(const char *file, unsigned line, const char *function,
                                           ucs_log_level_t level,
                                           const ucs_log_component_config_t *comp_conf,
                                           const char *message, va_list ap) TDP_CHECK_FMT(6, 0);

static ucs_log_func_rc_t ucx_log_to_stderr(const char *file, unsigned line, const char *function,
                                           ucs_log_level_t level,
                                           const ucs_log_component_config_t *comp_conf,
                                           const char *message, va_list ap)
{
    (void)file, (void)line, (void)function, (void)comp_conf;
    fprintf(stderr, "UCX  %s: ", ucs_log_level_names[level]);
    vfprintf(stderr, message, ap);
    fputc('\n', stderr);
    return UCS_LOG_FUNC_RC_STOP;
}

void tdp_cli_route_ucx_log(void)
{
    if (getenv("UCX_LOG_FILE") == NULL)
        ucs_log_push_handler(ucx_log_to_stderr);
}

/* -v given so far, before the subcommand and after it. */
static int verbosity;

/* Each -v raises the library's level one step, starting from info. */
static void raise_verbosity(int verbose)
{
    set_ucx_log_level(verbose);
    if (verbose <= 0)
        return;
    int level = TDP_LOG_INFO + verbose - 1;
    if (level > TDP_LOG_TRACE)
        level = TDP_LOG_TRACE;
    if (level > (int)tdp_log_get_level())
        tdp_log_set_level((tdp_log_level)level);
}

void tdp_cli_set_verbosity(int verbose)
{
    verbosity = verbose;
    raise_verbosity(verbose);
}

void tdp_cli_more_verbose(void)
{
    raise_verbosity(++verbosity);
}
