/*
 * send_ring.h: the CLI's sends kept in flight (tdpipe send --inflight,
 * tdpipe bench --inflight): a buffer and an op per slot, reused round
 * robin, so that a stream of small messages is sent the way
 * docs/pipe.md ("Streams of small messages") says, with nothing allocated
 * per message.
 */
#ifndef TDPIPE_TOOLS_SEND_RING_H
#define TDPIPE_TOOLS_SEND_RING_H

#include <stdint.h>
#include <tdpipe/tdpipe.h>

#define TDP_CLI_RING_MAX 64u /* most sends in flight */

typedef struct tdp_cli_ring {
    uint32_t n;
    tdp_op *op[TDP_CLI_RING_MAX];
    tdp_td *td[TDP_CLI_RING_MAX];
} tdp_cli_ring;

/* n (1..TDP_CLI_RING_MAX) slots, each a copy of proto's bytes; TDP_ENOMEM leaves none. */
tdp_err tdp_cli_ring_init(tdp_cli_ring *r, uint32_t n, tdp_td *proto);
/* After the pipe that used it (its close ended any send still out). */
void tdp_cli_ring_free(tdp_cli_ring *r);

/*
 * How many messages of `bytes` to keep in flight, at most `most`: as many
 * as 256 KiB holds (the receive window's default) for messages up to 64
 * KiB, else 1. A buffer of its own per send is a cold buffer each time:
 * larger messages gain nothing from it (docs/cli.md, --inflight).
 */
uint32_t tdp_cli_inflight_for(uint64_t bytes, uint32_t most);

#endif
