/*
 * env.c: tuning knobs read from the environment (env.h).
 */
#include <stdlib.h>

#include "env.h"

size_t tdp__env_kib(const char *name, size_t def, unsigned long min_kib, unsigned long max_kib,
                    bool zero_ok)
{
    const char *e = getenv(name);
    if (e == NULL || *e < '0' || *e > '9')
        return def;
    char *end = NULL;
    unsigned long v = strtoul(e, &end, 10);
    if (*end != '\0' || !((v == 0 && zero_ok) || (v >= min_kib && v <= max_kib)))
        return def;
    return (size_t)v << 10;
}
