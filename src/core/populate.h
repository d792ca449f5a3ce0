/*
 * populate.h (internal): fault memory in ahead of its use. A page touched
 * for the first time costs a page fault (several microseconds each on a
 * virtual machine: 80-100 ms for 100 MB); tdp_pipe_prepare moves that cost
 * off the first message's path.
 */
#ifndef TDP_CORE_POPULATE_H
#define TDP_CORE_POPULATE_H

#include <stdbool.h>
#include <stddef.h>

/*
 * Make every page of [p, p + n) present and writable: MADV_POPULATE_WRITE
 * (Linux 5.14) where the kernel has it, else one write per page of the
 * byte already there (the memory must be this process's to write, and no
 * other process may be writing it meanwhile). Best effort: nothing fails.
 */
void tdp__populate_write(void *p, size_t n);

/*
 * Large host buffers (TDP__HUGE_MIN bytes and more) are allocated aligned
 * to TDP__HUGE_PAGE so that transparent huge pages can back them: a first
 * touch of 100 MB then costs 50 faults instead of 25,600 (18-20 ms instead
 * of 80 ms on the development VM, when its host still backed the memory).
 */
#define TDP__HUGE_PAGE (2u << 20)
#define TDP__HUGE_MIN  (8u << 20)

/*
 * Ask for transparent huge pages for [p, p + n) (p aligned to
 * TDP__HUGE_PAGE) when they can come without a stall: the system has them
 * (transparent_hugepage/enabled is not "never") and enough free 2 MiB
 * blocks that the kernel need not compact memory to find them
 * (/proc/buddyinfo: twice the blocks n needs), and free memory is not
 * handed back to a hypervisor (a virtio balloon with free page reporting:
 * populate.c says why). TDPIPE_HUGE_PAGES=0 or "off" never asks, =1 or
 * "on" asks whenever the system has them, anything else as above. Whether it asked. Best
 * effort: nothing fails.
 */
bool tdp__huge_advise(void *p, size_t n);

/* Tests: read /proc and /sys under root instead ("" or NULL: the real ones). */
void tdp__huge_set_root(const char *root);

#endif
