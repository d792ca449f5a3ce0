/*
 * populate.h (internal): fault memory in ahead of its use. A page touched
 * for the first time costs a page fault (several microseconds each on a
 * virtual machine: 80-100 ms for 100 MB); tdp_pipe_prepare moves that cost
 * off the first message's path.
 */
#ifndef TDP_CORE_POPULATE_H
#define TDP_CORE_POPULATE_H

#include <stddef.h>

/*
 * Make every page of [p, p + n) present and writable: MADV_POPULATE_WRITE
 * (Linux 5.14) where the kernel has it, else one write per page of the
 * byte already there (the memory must be this process's to write, and no
 * other process may be writing it meanwhile). Best effort: nothing fails.
 */
void tdp__populate_write(void *p, size_t n);

#endif
