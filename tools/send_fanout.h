/* send_fanout.h: `tdpipe send --to A --to B ...`: a broadcast (or, --distribute, a share each) to
 * several receivers. */
#ifndef TDP_TOOLS_SEND_FANOUT_H
#define TDP_TOOLS_SEND_FANOUT_H

#include <stdbool.h>
#include <stdint.h>
#include <tdpipe/pipe.h>

#include "cli.h"

#define TDP_CLI_FANOUT_MAX 64 /* receivers one send may name */

typedef struct tdp_cli_fanout_args {
    char host[TDP_CLI_FANOUT_MAX][TDP_CLI_HOST_LEN];
    uint16_t port[TDP_CLI_FANOUT_MAX];
    uint32_t n;
    uint64_t count;
    double rate, interval;
    int64_t timeout_ms;
    const tdp_pipe_opts *pipe; /* every receiver's pipe options */
    bool fill;                 /* synthetic: write message n's pattern before sending it */
    bool distribute;           /* --distribute: each message to one receiver */
    bool quiet, json;
} tdp_cli_fanout_args;

/* Send a->count messages of td to every receiver (or one each); returns the exit status. */
int tdp_cli_send_fanout(const tdp_cli_fanout_args *a, tdp_td *td);

#endif
