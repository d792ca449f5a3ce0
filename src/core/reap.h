/*
 * reap.h (internal): the one way an object of the library is destroyed
 * later rather than now — on a later turn of its loop, or when the loop is
 * freed if that comes first. Used for objects that may be inside one of
 * their own callbacks when they are let go (a pipe freed from its own
 * completion, a socket closed from its read callback).
 */
#ifndef TDP_CORE_REAP_H
#define TDP_CORE_REAP_H

#include "loop_int.h"

typedef struct tdp__reap {
    tdp__task task;
    void (*fn)(void *arg);
    void *arg;
    tdp_loop *loop;
    struct tdp__reap *prev, *next;
    bool queued;
} tdp__reap;

/* Loop thread (or a loop nobody runs). r lives in the object itself. */
void tdp__reap_later(tdp_loop *loop, tdp__reap *r, void (*fn)(void *arg), void *arg);

#endif
