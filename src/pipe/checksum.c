/* checksum.c: the optional payload checksum (checksum.h). */
#include <xxhash.h>

#include "checksum.h"

static tdp__sum_corrupt_fn corrupt_fn;
static void *corrupt_arg;

uint64_t tdp__sum(const void *buf, size_t len)
{
    return XXH3_64bits(buf, len);
}

uint64_t tdp__sum_tx(void *buf, size_t len, uint64_t seq)
{
    uint64_t sum = XXH3_64bits(buf, len);
    if (corrupt_fn != NULL)
        corrupt_fn(buf, len, seq, corrupt_arg);
    return sum;
}

void tdp__sum_set_corrupt_hook(tdp__sum_corrupt_fn fn, void *arg)
{
    corrupt_arg = arg;
    corrupt_fn = fn;
}
