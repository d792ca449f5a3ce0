/* td_int.h (internal): the tensordict object, shared with the pipe. */
#ifndef TDP_TD_INT_H
#define TDP_TD_INT_H

#include <stdatomic.h>
#include <tdpipe/td.h>

struct tdp_td {
    _Atomic uint32_t refs;
    tdp_schema *schema;
    void *data;
    uint64_t nbytes;
    tdp_device device;
    bool owned;
    tdp_td_release_fn release;
    void *release_arg;
};

#endif
