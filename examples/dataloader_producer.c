/*
 * dataloader_producer: connect to a dataloader at HOST:PORT and stream COUNT
 * batches as fast as the consumer's credits allow, then close cleanly.
 *
 *   dataloader_producer HOST PORT [COUNT]        (COUNT defaults to 500)
 *
 * Each batch is a nested tensordict with batch size [B]:
 *
 *   obs          float32 [B, 3, 32, 32]
 *   label        int64   [B]
 *   info         a nested "Info" node holding two non-tensor values:
 *     source     "dataloader_producer"
 *     epoch      0
 *
 * The values follow a pattern the dataloader checks: in batch n (counted
 * from 0), sample b has label n * B + b, and every element of its obs is
 * (float)(label % 4096).
 *
 * The loop is driven by the blocking calls on this thread: no loop thread is
 * needed when one thread does everything.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <tdpipe/tdpipe.h>

#define B 64 /* samples per batch */

/* The layout, built once. The schema goes over the wire once, with batch 0. */
static tdp_err make_schema(tdp_schema **out)
{
    const int64_t batch[] = {B}, obs[] = {B, 3, 32, 32}, label[] = {B};
    tdp_schema_builder *b;
    tdp_err rc;

    if ((rc = tdp_schema_builder_new(&b)) != TDP_OK)
        return rc;
    if ((rc = tdp_schema_builder_node(b, "", NULL, 1, batch)) != TDP_OK ||
        (rc = tdp_schema_builder_tensor(b, "obs", TDP_FLOAT32, 4, obs)) != TDP_OK ||
        (rc = tdp_schema_builder_tensor(b, "label", TDP_INT64, 1, label)) != TDP_OK ||
        (rc = tdp_schema_builder_node(b, "info", "Info", 1, batch)) != TDP_OK ||
        (rc = tdp_schema_builder_string(b, "info.source", "dataloader_producer")) != TDP_OK ||
        (rc = tdp_schema_builder_int(b, "info.epoch", 0)) != TDP_OK)
        goto out;
    rc = tdp_schema_builder_finish(b, out, NULL, 0);
out:
    tdp_schema_builder_free(b);
    return rc;
}

/* Write batch n into the consolidated buffer, in place. */
static void fill_batch(tdp_td *td, long n)
{
    tdp_leaf obs, label;
    tdp_td_get(td, "obs", &obs);
    tdp_td_get(td, "label", &label);
    uint64_t per_sample = obs.numel / B;
    for (int b = 0; b < B; b++) {
        int64_t id = (int64_t)n * B + b;
        ((int64_t *)label.data)[b] = id;
        float *x = (float *)obs.data + (uint64_t)b * per_sample;
        for (uint64_t i = 0; i < per_sample; i++)
            x[i] = (float)(id % 4096);
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: dataloader_producer HOST PORT [COUNT]\n");
        return 2;
    }
    const char *host = argv[1];
    uint16_t port = (uint16_t)atoi(argv[2]);
    long count = argc > 3 ? atol(argv[3]) : 500;
    tdp_schema *s = NULL;
    tdp_td *td = NULL;
    tdp_loop *loop = NULL;
    tdp_pipe *pipe = NULL;
    tdp_err rc;
    long n = 0;

    /* One send buffer, allocated once and refilled for every batch. */
    if ((rc = make_schema(&s)) != TDP_OK || (rc = tdp_td_new(s, &td)) != TDP_OK) {
        fprintf(stderr, "dataloader_producer: cannot build the batch: %s\n", tdp_strerror(rc));
        goto out;
    }
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK ||
        (rc = tdp_pipe_connect(loop, host, port, NULL, &pipe)) != TDP_OK) {
        fprintf(stderr, "dataloader_producer: cannot connect to %s:%u: %s\n", host, port,
                tdp_strerror(rc));
        goto out;
    }
    printf("dataloader_producer: connected, %" PRIu64 " bytes per batch\n", tdp_td_nbytes(td));

    for (n = 0; n < count; n++) {
        fill_batch(td, n);
        /*
         * Returns once the transport is done with the buffer, so the next
         * fill_batch may overwrite it. When the dataloader holds all of its
         * receive buffers, this waits for one to be released (a credit):
         * the consumer sets the pace and nothing piles up in memory.
         */
        if ((rc = tdp_pipe_send(pipe, td, 30000)) != TDP_OK) {
            fprintf(stderr, "dataloader_producer: batch %ld: %s\n", n, tdp_strerror(rc));
            goto out;
        }
    }

    /* Clean end: BYE goes after the last batch; the dataloader then sees TDP_ECLOSED. */
    rc = tdp_pipe_close(pipe, 10000);

    tdp_pipe_stats st;
    tdp_pipe_stats_get(pipe, &st);
    printf("dataloader_producer: sent %" PRIu64 " batches (%" PRIu64 " bytes), %" PRIu64
           " schema frame(s); waited for credit %" PRIu64 " times; close: %s\n",
           st.msgs_sent, st.bytes_sent, st.schemas_sent, st.credit_waits, tdp_strerror(rc));
out:
    tdp_pipe_free(pipe); /* NULL-safe, as are the calls below */
    tdp_loop_free(loop);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    return rc == TDP_OK ? 0 : 1;
}
