/* plane_tcp.h (internal): the tcp plane's hooks for tests (plane_tcp.c). */
#ifndef TDP_PIPE_TCP_PLANE_TCP_H
#define TDP_PIPE_TCP_PLANE_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "../plane.h"

/*
 * For tests: a PLANE frame the library would never build, from link l (a
 * tcp link): the AM header's al bytes as given, then len payload bytes
 * (copied). On l's loop thread.
 */
tdp_err tdp__tcp_rogue(tdp__link *l, const uint8_t *am, size_t al, const void *payload, size_t len);

#endif
