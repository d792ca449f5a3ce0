/* plane_ucx.h (internal): what tests may ask of a ucx link. */
#ifndef TDP_PIPE_PLANE_UCX_H
#define TDP_PIPE_PLANE_UCX_H

#include <ucp/api/ucp.h>

#include "../plane.h"

ucp_ep_h tdp__ucx_link_ep(const tdp__link *l);
int tdp__ucx_link_worker(const tdp__link *l);
bool tdp__ucx_link_peer_mode(const tdp__link *l);
uint64_t tdp__ucx_link_peer_token(const tdp__link *l);
/* Messages this link sent (rx false) or received (rx true) as CHUNK frames. */
uint64_t tdp__ucx_link_chunked(const tdp__link *l, bool rx);
/* Leave TDP_HX_UCX_CHUNKS out of this process's HELLOs (an older peer's). */
void tdp__ucx_hello_no_chunks(bool on);
/* Messages this link sent (rx false) or received (rx true) inside BATCH frames. */
uint64_t tdp__ucx_link_batched(const tdp__link *l, bool rx);
/* The payload bytes of this link's batches (before its first: what it would get). */
uint32_t tdp__ucx_link_batch_bytes(const tdp__link *l);
/* Leave TDP_HX_UCX_BATCH out of this process's HELLOs (an older peer's). */
void tdp__ucx_hello_no_batch(bool on);

#endif
