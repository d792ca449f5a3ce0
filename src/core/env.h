/*
 * env.h (internal): tuning knobs read from the environment.
 */
#ifndef TDP_CORE_ENV_H
#define TDP_CORE_ENV_H

#include <stdbool.h>
#include <stddef.h>

/*
 * The environment variable name as a size in KiB, returned in bytes: a
 * whole decimal number in [min_kib, max_kib], or 0 when zero_ok. Unset or
 * anything else: def (bytes). Callers that read it per message cache it.
 */
size_t tdp__env_kib(const char *name, size_t def, unsigned long min_kib, unsigned long max_kib,
                    bool zero_ok);

#endif
