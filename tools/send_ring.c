/* send_ring.c: sends kept in flight by the CLI (send_ring.h). */
#include <string.h>

#include "send_ring.h"

void tdp_cli_ring_free(tdp_cli_ring *r)
{
    for (uint32_t k = 0; k < r->n; k++) {
        tdp_op_free(r->op[k]);
        tdp_td_unref(r->td[k]);
    }
    r->n = 0;
}

tdp_err tdp_cli_ring_init(tdp_cli_ring *r, uint32_t n, tdp_td *proto)
{
    memset(r, 0, sizeof(*r));
    if (n > TDP_CLI_RING_MAX)
        return TDP_EINVAL;
    for (; r->n < n; r->n++) {
        if (tdp_op_new(NULL, NULL, &r->op[r->n]) != TDP_OK) {
            tdp_cli_ring_free(r);
            return TDP_ENOMEM;
        }
        if (tdp_td_new(tdp_td_schema(proto), &r->td[r->n]) != TDP_OK) {
            tdp_op_free(r->op[r->n]);
            tdp_cli_ring_free(r);
            return TDP_ENOMEM;
        }
        memcpy(tdp_td_data(r->td[r->n]), tdp_td_data(proto), tdp_td_nbytes(proto));
    }
    return TDP_OK;
}

uint32_t tdp_cli_inflight_for(uint64_t bytes, uint32_t most)
{
    if (bytes == 0 || bytes > (64u << 10))
        return 1;
    uint64_t n = (256u << 10) / bytes;
    return n < 2 ? 1 : n > most ? most : (uint32_t)n;
}
