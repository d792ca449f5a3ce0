/*
 * producer: connect to a consumer at HOST:PORT and stream COUNT tensordicts
 * (obs: float32 [B, 84], label: int64 [B], a nested "meta" dict), then close
 * cleanly.
 *
 *   producer HOST PORT [COUNT]
 */
#include <stdio.h>
#include <stdlib.h>
#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: producer HOST PORT [COUNT]\n");
        return 2;
    }
    long count = argc > 3 ? atol(argv[3]) : 100;
    const int64_t batch[] = {32}, obs[] = {32, 84}, lab[] = {32};
    tdp_schema_builder *b;
    tdp_schema *s;
    tdp_loop *loop;
    tdp_pipe *pipe;
    tdp_td *td;
    tdp_err rc;

    tdp_schema_builder_new(&b);
    tdp_schema_builder_node(b, "", NULL, 1, batch);
    tdp_schema_builder_tensor(b, "obs", TDP_FLOAT32, 2, obs);
    tdp_schema_builder_tensor(b, "label", TDP_INT64, 1, lab);
    tdp_schema_builder_node(b, "meta", "Meta", 1, batch);
    tdp_schema_builder_tensor(b, "meta.weight", TDP_FLOAT32, 1, lab);
    tdp_schema_builder_string(b, "meta.source", "producer example");
    if ((rc = tdp_schema_builder_finish(b, &s, NULL, 0)) != TDP_OK || tdp_td_new(s, &td) != TDP_OK)
        return 1;
    tdp_schema_builder_free(b);

    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK ||
        (rc = tdp_pipe_connect(loop, argv[1], (uint16_t)atoi(argv[2]), NULL, &pipe)) != TDP_OK) {
        fprintf(stderr, "producer: cannot connect to %s:%s: %s\n", argv[1], argv[2],
                tdp_strerror(rc));
        return 1;
    }
    tdp_leaf x;
    tdp_td_get(td, "obs", &x);
    for (long n = 0; n < count; n++) {
        float *f = x.data;
        for (uint64_t i = 0; i < x.numel; i++)
            f[i] = (float)(n + (long)(i % 7));
        if ((rc = tdp_pipe_send(pipe, td, 30000)) != TDP_OK) {
            fprintf(stderr, "producer: send %ld: %s\n", n, tdp_strerror(rc));
            return 1;
        }
    }
    rc = tdp_pipe_close(pipe, 10000);
    printf("producer: sent %ld messages, close: %s\n", count, tdp_strerror(rc));
    tdp_pipe_free(pipe);
    tdp_loop_free(loop);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    return rc == TDP_OK ? 0 : 1;
}
