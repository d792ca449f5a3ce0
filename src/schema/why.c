/* why.c: the schema layer's error text, for the caller's buffer and the log. */
#include <stdarg.h>
#include <stdio.h>

#include "schema_int.h"
#include "../core/log.h"

tdp_err tdp__fail(tdp__why *w, tdp_err err, const char *fmt, ...)
{
    char msg[512];
    va_list ap;

    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    tdp_log_debug("schema: %s", msg);
    if (w != NULL && w->buf != NULL && w->len > 0 && w->buf[0] == '\0')
        snprintf(w->buf, w->len, "%s", msg);
    return err;
}
