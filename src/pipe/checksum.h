/*
 * checksum.h (internal): the optional payload checksum (tdp_pipe_opts.
 * checksum): XXH3-64 of a DATA payload. The sending plane computes it over
 * the host bytes it hands to the transport and carries it in its DATA
 * frame; the session checks it over the bytes that arrived before the
 * message is handed out. docs/pipe.md#payload-checksum.
 */
#ifndef TDP_PIPE_CHECKSUM_H
#define TDP_PIPE_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* XXH3-64 of len bytes of host memory (never device memory). */
uint64_t tdp__sum(const void *buf, size_t len);

/*
 * The sender's side, for a plane: the sum of the host bytes about to leave
 * as message seq. Then, in test builds that set one, the corruption hook
 * runs on the same bytes — after the sum, as a fault on the way would.
 */
uint64_t tdp__sum_tx(void *buf, size_t len, uint64_t seq);

/*
 * For tests: called by tdp__sum_tx after every sum (NULL: none). It may
 * change the bytes to model corruption in transit. Set while no pipe
 * exists; it runs on the loop thread of the sending pipe.
 */
typedef void (*tdp__sum_corrupt_fn)(void *buf, size_t len, uint64_t seq, void *arg);
void tdp__sum_set_corrupt_hook(tdp__sum_corrupt_fn fn, void *arg);

#endif
