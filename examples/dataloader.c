/*
 * dataloader: an embedded data-loader consumer, the way a training loop
 * uses tdpipe.
 *
 *   dataloader [HOST] PORT        (HOST: all addresses when omitted;
 *                                  PORT 0 picks a free port and prints it)
 *
 * Run dataloader_producer against it. The pattern:
 *
 *  - the event loop runs on a thread of its own (tdp_loop_start_thread) and
 *    receives batches in the background, straight into a ring of
 *    RECV_DEPTH buffers allocated once, when the first batch (and its
 *    schema) arrives;
 *  - the training thread (main) takes batches with tdp_pipe_recv. Each one
 *    is lent: it stays intact until tdp_pipe_release hands the buffer back
 *    and the producer gets a credit to send another;
 *  - the training thread keeps one batch in hand ahead of the one it trains
 *    on (so two are lent at once), and hands each leaf to the "framework"
 *    through DLPack, without a copy;
 *  - the producer's close ends the stream: tdp_pipe_recv returns
 *    TDP_ECLOSED after the last batch.
 */
#include <dlpack/dlpack.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <tdpipe/tdpipe.h>

#define RECV_DEPTH 4   /* receive buffers in the ring */
#define HELD 2         /* batches the training thread holds at once */
#define STEP_US 2000   /* a training step's duration, simulated */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/*
 * One "training step" on batch number n (from 0). Returns the number of
 * values that break the producer's pattern, and the mean of obs in *mean.
 */
static uint64_t train_step(tdp_td *td, uint64_t n, double *mean)
{
    uint64_t bad = 0;
    tdp_leaf label, source;

    /*
     * Zero-copy hand-off: obs as a DLPack tensor pointing into the received
     * buffer. A framework takes it here (torch.from_dlpack, jax.dlpack,
     * cupy.from_dlpack...) and calls the deleter when its tensor dies. The
     * tensor holds a reference, so the memory outlives the pipe; its contents
     * are only stable until tdp_pipe_release, after which the next batch
     * lands in the same buffer. Each export allocates one small block.
     */
    struct DLManagedTensor *dl;
    if (tdp_td_to_dlpack(td, "obs", &dl) != TDP_OK)
        return 1;
    const DLTensor *t = &dl->dl_tensor;
    int64_t numel = 1;
    for (int d = 0; d < t->ndim; d++)
        numel *= t->shape[d];
    if (n == 0)
        printf("dataloader: obs via DLPack: %s:%d, dtype code %u bits %u, shape [%" PRId64
               ", %" PRId64 ", %" PRId64 ", %" PRId64 "]\n",
               t->device.device_type == kDLCPU ? "cpu" : "gpu", t->device.device_id,
               t->dtype.code, t->dtype.bits, t->shape[0], t->shape[1], t->shape[2], t->shape[3]);

    /* The "model": the mean of obs, and a check of every value. */
    const float *x = (const float *)t->data;
    int64_t batch = t->shape[0], per_sample = numel / batch;
    double sum = 0;
    tdp_td_get(td, "label", &label);
    for (int64_t b = 0; b < batch; b++) {
        int64_t id = ((const int64_t *)label.data)[b];
        bad += id != (int64_t)n * batch + b;
        for (int64_t i = 0; i < per_sample; i++) {
            float v = x[b * per_sample + i];
            bad += v != (float)(id % 4096);
            sum += v;
        }
    }
    *mean = sum / (double)numel;
    dl->deleter(dl); /* the framework is done with its tensor */

    /* Non-tensor values travel in the schema, sent once, not with every batch. */
    if (tdp_td_get(td, "info.source", &source) != TDP_OK ||
        strcmp(source.value_json, "\"dataloader_producer\"") != 0)
        bad++;

    struct timespec step = {0, STEP_US * 1000L};
    nanosleep(&step, NULL); /* forward, backward, optimizer... */
    return bad;
}

int main(int argc, char **argv)
{
    const char *host = argc > 2 ? argv[1] : NULL;
    uint16_t port = (uint16_t)atoi(argc > 2 ? argv[2] : argc > 1 ? argv[1] : "0");
    tdp_loop *loop = NULL;
    tdp_listener *l = NULL;
    tdp_pipe *pipe = NULL;
    tdp_err rc;

    /* The loop receives in the background, on a thread of its own. */
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK ||
        (rc = tdp_loop_start_thread(loop)) != TDP_OK) {
        fprintf(stderr, "dataloader: cannot start the loop: %s\n", tdp_strerror(rc));
        goto out;
    }

    /* A ring of RECV_DEPTH buffers: the producer may run that far ahead. */
    tdp_pipe_opts opts;
    tdp_pipe_opts_default(&opts);
    opts.recv_depth = RECV_DEPTH;
    if ((rc = tdp_listener_new(loop, host, port, &opts, NULL, NULL, &l)) != TDP_OK) {
        fprintf(stderr, "dataloader: cannot listen: %s\n", tdp_strerror(rc));
        goto out;
    }
    printf("dataloader: listening on port %u\n", tdp_listener_port(l));
    fflush(stdout);
    if ((rc = tdp_listener_accept(l, 60000, &pipe)) != TDP_OK) {
        fprintf(stderr, "dataloader: no producer: %s\n", tdp_strerror(rc));
        goto out;
    }
    char peer[80];
    printf("dataloader: producer %s connected\n", tdp_pipe_peer(pipe, peer, sizeof(peer)));

    /*
     * held[0] is trained on while held[1], taken already, waits its turn:
     * two batches are lent at once, and the loop thread meanwhile fills the
     * other RECV_DEPTH - HELD buffers.
     */
    tdp_td *held[HELD];
    int nheld = 0;
    uint64_t batches = 0, bad = 0;
    double mean = 0, t0 = 0;
    for (;;) {
        tdp_td *td;
        if ((rc = tdp_pipe_recv(pipe, 30000, &td)) != TDP_OK)
            break; /* TDP_ECLOSED after the last batch; anything else is a failure */
        if (batches == 0 && nheld == 0)
            t0 = now_s(); /* from the first batch: connecting is not throughput */
        held[nheld++] = td;
        if (nheld < HELD)
            continue; /* take the next batch too before training */
        bad += train_step(held[0], batches++, &mean);
        tdp_pipe_release(pipe, held[0]); /* the buffer goes back: a credit for the producer */
        memmove(held, held + 1, (HELD - 1) * sizeof(held[0]));
        nheld--;
    }
    /* The stream ended: the batches still in hand are whole; use them too. */
    for (int i = 0; i < nheld; i++) {
        bad += train_step(held[i], batches++, &mean);
        tdp_pipe_release(pipe, held[i]);
    }
    double dt = now_s() - t0;

    tdp_pipe_stats st;
    tdp_pipe_stats_get(pipe, &st);
    printf("dataloader: stream ended: %s\n", tdp_strerror(rc));
    printf("dataloader: %" PRIu64 " batches, %" PRIu64 " wrong values, last mean obs %.1f\n",
           batches, bad, mean);
    printf("dataloader: received %" PRIu64 " messages, %" PRIu64 " bytes, %" PRIu64
           " schema frame(s)\n",
           st.msgs_recv, st.bytes_recv, st.schemas_recv);
    if (batches > 0)
        printf("dataloader: %.2f s, %.0f batches/s, %.1f MB/s (training step %d us)\n", dt,
               (double)batches / dt, (double)st.bytes_recv / dt / 1e6, STEP_US);
    if (rc == TDP_ECLOSED && bad == 0)
        rc = TDP_OK;
out:
    tdp_pipe_free(pipe); /* NULL-safe, as are the calls below */
    tdp_listener_free(l);
    tdp_loop_free(loop); /* stops and joins the loop thread */
    return rc == TDP_OK ? 0 : 1;
}
