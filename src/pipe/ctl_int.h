/*
 * ctl_int.h (internal to the control channel): what ctl.c and ctl_carry.c,
 * the channel carrying the tcp plane, call of each other.
 */
#ifndef TDP_PIPE_CTL_INT_H
#define TDP_PIPE_CTL_INT_H

#include <event2/buffer.h>

#include "ctl.h"

/* ctl.c: end the channel with why (a BYE first for a protocol error); up->closed. */
void tdp__ctl_fail(tdp__ctl *c, tdp_err why);
/* ctl.c: a READY or BYE frame's payload; false when the channel ended meanwhile. */
bool tdp__ctl_small(tdp__ctl *c, uint16_t type, const uint8_t *pl, size_t len);

/* ctl.c: the bufferevent reads no more; written(bev, c) when its output has drained. */
void tdp__ctl_bev_written(tdp__ctl *c, bufferevent_data_cb written);

/* ctl_carry.c: the bytes after the frame that started the carrying. */
void tdp__ctl_carry_take(tdp__ctl *c, struct evbuffer *in);
/* ctl_carry.c: read what the socket holds now. */
void tdp__ctl_carry_pump(tdp__ctl *c);
/* ctl_carry.c: queue a READY or BYE frame (whole, header included) and write it. */
void tdp__ctl_carry_control(tdp__ctl *c, const uint8_t *frame, size_t len, bool bye);
/* ctl_carry.c: the channel closes: stop, report what is queued, let go of the socket. */
void tdp__ctl_carry_detach(tdp__ctl *c);

#endif
