/*
 * infer_client: send COUNT inference requests to infer_server, check every
 * reply against the same linear model, print the round-trip latency.
 *
 *   infer_client HOST PORT [COUNT [BATCH [WIDTH]]]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <tdpipe/tdpipe.h>

#define K 4

static float weight(int64_t d, int64_t k)
{
    return (float)((d * 7 + k * 13) % 11 - 5) / 8.0f;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Check one reply; returns the number of wrong values. */
static uint64_t check(const float *x, int64_t rows, int64_t d, tdp_td *rep)
{
    tdp_leaf logits, label;
    uint64_t bad = 0;
    if (tdp_td_get(rep, "logits", &logits) != TDP_OK ||
        tdp_td_get(rep, "label", &label) != TDP_OK || logits.numel != (uint64_t)(rows * K) ||
        label.numel != (uint64_t)rows)
        return (uint64_t)rows * (K + 1);
    const float *out = logits.data;
    const int64_t *lab = label.data;
    for (int64_t b = 0; b < rows; b++) {
        int64_t best = 0;
        float want[K];
        for (int64_t k = 0; k < K; k++) {
            float acc = (float)k; /* the same order of operations as the server */
            for (int64_t j = 0; j < d; j++)
                acc += x[b * d + j] * weight(j, k);
            want[k] = acc;
            if (acc > want[best])
                best = k;
            bad += out[b * K + k] != acc;
        }
        bad += lab[b] != best;
    }
    return bad;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: infer_client HOST PORT [COUNT [BATCH [WIDTH]]]\n");
        return 2;
    }
    long count = argc > 3 ? atol(argv[3]) : 1000;
    int64_t rows = argc > 4 ? atol(argv[4]) : 8, d = argc > 5 ? atol(argv[5]) : 256;
    if (count <= 0 || rows <= 0 || d <= 0)
        return 2;

    const int64_t shape[2] = {rows, d}, batch[1] = {rows};
    tdp_schema_builder *b;
    tdp_schema *s;
    tdp_td *req, *rep;
    tdp_schema_builder_new(&b);
    tdp_schema_builder_node(b, "", NULL, 1, batch);
    tdp_schema_builder_tensor(b, "x", TDP_FLOAT32, 2, shape);
    if (tdp_schema_builder_finish(b, &s, NULL, 0) != TDP_OK || tdp_td_new(s, &req) != TDP_OK)
        return 1;
    tdp_schema_builder_free(b);

    tdp_loop *loop;
    tdp_pipe *p;
    tdp_err rc;
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK ||
        (rc = tdp_pipe_connect(loop, argv[1], (uint16_t)atoi(argv[2]), NULL, &p)) != TDP_OK) {
        fprintf(stderr, "infer_client: cannot connect to %s:%s: %s\n", argv[1], argv[2],
                tdp_strerror(rc));
        return 1;
    }
    double *lat = malloc((size_t)count * sizeof(*lat));
    if (lat == NULL)
        return 1;
    tdp_leaf x;
    tdp_td_get(req, "x", &x);
    float *xf = x.data;
    uint64_t bad = 0;
    long n;
    double t_start = now_us();
    for (n = 0; n < count; n++) {
        for (int64_t i = 0; i < rows * d; i++)
            xf[i] = (float)((n * 131 + i * 17) % 97) / 32.0f - 1.5f;
        double t0 = now_us();
        if ((rc = tdp_pipe_send(p, req, 10000)) != TDP_OK ||
            (rc = tdp_pipe_recv(p, 10000, &rep)) != TDP_OK) {
            fprintf(stderr, "infer_client: request %ld: %s\n", n, tdp_strerror(rc));
            break;
        }
        lat[n] = now_us() - t0;
        bad += check(xf, rows, d, rep);
    }
    double total_s = (now_us() - t_start) / 1e6;
    if (n > 0) {
        double sum = 0;
        for (long i = 0; i < n; i++)
            sum += lat[i];
        qsort(lat, (size_t)n, sizeof(*lat), cmp_double);
        printf("infer_client: %ld requests of %" PRId64 "x%" PRId64 " float32 in %.3f s "
               "(%.0f req/s), %" PRIu64 " wrong values\n",
               n, rows, d, total_s, (double)n / total_s, bad);
        printf("infer_client: latency us: min %.1f  p50 %.1f  p99 %.1f  max %.1f  mean %.1f\n",
               lat[0], lat[n / 2], lat[(n - 1) * 99 / 100], lat[n - 1], sum / (double)n);
    }
    tdp_err cl = tdp_pipe_close(p, 5000);
    tdp_pipe_free(p);
    tdp_loop_free(loop);
    tdp_td_unref(req);
    tdp_schema_unref(s);
    free(lat);
    return rc == TDP_OK && cl == TDP_OK && bad == 0 && n == count ? 0 : 1;
}
