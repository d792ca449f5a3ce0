/* host.h (internal): this host's identity, for same-host detection at HELLO. */
#ifndef TDP_PIPE_HOST_H
#define TDP_PIPE_HOST_H

#include <stdint.h>

#include "wire.h"

void tdp__host_id(uint8_t out[TDP_HOST_ID_LEN]);

#endif
