/*
 * infer_server: a tdp_server that answers inference requests.
 *
 * A request is {"x": float32 [B, D]}; the reply is {"logits": float32
 * [B, K], "label": int64 [B]} computed with a fixed linear layer (the
 * weights are a formula, so infer_client can check every value). Each
 * client may send any batch size and width; its reply buffers are rebuilt
 * only when the request's shape changes. Stops on SIGINT/SIGTERM or after
 * COUNT requests in total, with a graceful shutdown, and prints totals.
 *
 *   infer_server [-b HOST] [-p PORT] [-n COUNT] [-c MAX_CLIENTS]
 */
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <tdpipe/tdpipe.h>

#define K 4 /* classes */

/* The model: logits[b][k] = sum_d x[b][d] * w(d, k) + k. */
static float weight(int64_t d, int64_t k)
{
    return (float)((d * 7 + k * 13) % 11 - 5) / 8.0f;
}

typedef struct server_ctx {
    uint64_t count; /* stop after this many requests (0: never) */
    pthread_t main_thread;
    atomic_uint_fast64_t requests, bad;
} server_ctx;

/*
 * Per client: a ring of reply buffers one longer than the replies that may
 * be in flight, so the one written next is never being sent.
 */
#define RING 5 /* max_replies_queued (4) + 1 */

typedef struct client_ctx {
    tdp_schema *req; /* the request layout the ring was built for */
    tdp_td *ring[RING];
    unsigned next;
    uint64_t served;
} client_ctx;

static void ring_free(client_ctx *cc)
{
    for (int i = 0; i < RING; i++) {
        tdp_td_unref(cc->ring[i]);
        cc->ring[i] = NULL;
    }
    tdp_schema_unref(cc->req);
    cc->req = NULL;
}

/* Build the reply layout for a request layout (only when it changes). */
static tdp_err ring_build(client_ctx *cc, tdp_schema *req)
{
    tdp_leaf x;
    tdp_err rc = tdp_schema_find(req, "x", &x);
    if (rc != TDP_OK || x.dtype != TDP_FLOAT32 || x.ndim != 2)
        return TDP_ESCHEMA; /* not a request: the client is closed */
    const int64_t logits[2] = {x.shape[0], K}, batch[1] = {x.shape[0]};
    tdp_schema_builder *b;
    tdp_schema *s = NULL;
    if ((rc = tdp_schema_builder_new(&b)) != TDP_OK)
        return rc;
    tdp_schema_builder_node(b, "", NULL, 1, batch);
    tdp_schema_builder_tensor(b, "logits", TDP_FLOAT32, 2, logits);
    tdp_schema_builder_tensor(b, "label", TDP_INT64, 1, batch);
    tdp_schema_builder_string(b, "model", "linear-4");
    rc = tdp_schema_builder_finish(b, &s, NULL, 0);
    tdp_schema_builder_free(b);
    if (rc != TDP_OK)
        return rc;
    ring_free(cc);
    for (int i = 0; i < RING && rc == TDP_OK; i++)
        rc = tdp_td_new(s, &cc->ring[i]);
    tdp_schema_unref(s); /* the tds hold it */
    cc->req = tdp_schema_ref(req);
    return rc;
}

static tdp_err on_connect(tdp_client *c, void *arg)
{
    char peer[80];
    client_ctx *cc = calloc(1, sizeof(*cc));
    if (cc == NULL)
        return TDP_ENOMEM;
    tdp_client_set_data(c, cc);
    printf("client %" PRIu64 " connected from %s\n", tdp_client_id(c),
           tdp_pipe_peer(tdp_client_pipe(c), peer, sizeof(peer)));
    fflush(stdout);
    return TDP_OK;
}

static tdp_err on_message(tdp_client *c, tdp_td *td, void *arg)
{
    server_ctx *sc = arg;
    client_ctx *cc = tdp_client_get_data(c);
    tdp_err rc;

    if (cc->req != tdp_td_schema(td) && (rc = ring_build(cc, tdp_td_schema(td))) != TDP_OK)
        return rc;
    tdp_td *rep = cc->ring[cc->next];
    tdp_leaf x, logits, label;
    tdp_td_get(td, "x", &x);
    tdp_td_get(rep, "logits", &logits);
    tdp_td_get(rep, "label", &label);
    const float *in = x.data;
    float *out = logits.data;
    int64_t *lab = label.data;
    int64_t rows = x.shape[0], d = x.shape[1];
    for (int64_t b = 0; b < rows; b++) {
        int64_t best = 0;
        for (int64_t k = 0; k < K; k++) {
            float acc = (float)k;
            for (int64_t j = 0; j < d; j++)
                acc += in[b * d + j] * weight(j, k);
            out[b * K + k] = acc;
            if (acc > out[b * K + best])
                best = k;
        }
        lab[b] = best;
    }
    if ((rc = tdp_client_send(c, rep)) != TDP_OK)
        return rc; /* EAGAIN: the client does not read its replies; drop it */
    cc->next = (cc->next + 1) % RING;
    cc->served++;
    uint64_t n = atomic_fetch_add(&sc->requests, 1) + 1;
    if (sc->count != 0 && n == sc->count)
        pthread_kill(sc->main_thread, SIGUSR1);
    return TDP_OK;
}

static void on_close(tdp_client *c, tdp_err status, void *arg)
{
    client_ctx *cc = tdp_client_get_data(c);
    printf("client %" PRIu64 " closed (%s) after %" PRIu64 " requests\n", tdp_client_id(c),
           status == TDP_ECLOSED ? "clean" : tdp_strerror(status), cc ? cc->served : 0);
    fflush(stdout);
    if (cc != NULL) {
        ring_free(cc);
        free(cc);
    }
}

static void print_stats(tdp_server *s)
{
    tdp_server_stats st;
    tdp_server_stats_get(s, &st);
    printf("stats: clients %" PRIu64 " now, %" PRIu64 " total, %" PRIu64 " refused, %" PRIu64
           " failed handshakes; requests %" PRIu64 " (%" PRIu64 " bytes), replies %" PRIu64
           " (%" PRIu64 " bytes), schemas %" PRIu64 "; errors: %" PRIu64 " client, %" PRIu64
           " handler\n",
           st.clients_now, st.clients_total, st.refused, st.handshakes_failed, st.msgs_recv,
           st.bytes_recv, st.msgs_sent, st.bytes_sent, st.schemas_recv, st.client_errors,
           st.handler_errors);
}

int main(int argc, char **argv)
{
    const char *host = NULL;
    int port = 0, opt;
    long max_clients = 0;
    server_ctx sc = {.main_thread = pthread_self()};

    while ((opt = getopt(argc, argv, "b:p:n:c:h")) != -1) {
        switch (opt) {
        case 'b':
            host = optarg;
            break;
        case 'p':
            port = atoi(optarg);
            break;
        case 'n':
            sc.count = strtoull(optarg, NULL, 10);
            break;
        case 'c':
            max_clients = atol(optarg);
            break;
        default:
            fprintf(stderr, "usage: infer_server [-b HOST] [-p PORT] [-n COUNT] "
                            "[-c MAX_CLIENTS]\n");
            return opt == 'h' ? 0 : 2;
        }
    }
    /* signals are taken on this thread only: block them before any thread starts */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, NULL);

    static const tdp_server_handler h = {
        .size = sizeof(tdp_server_handler),
        .on_connect = on_connect,
        .on_message = on_message,
        .on_close = on_close,
    };
    tdp_server_opts o;
    tdp_server_opts_default(&o);
    o.max_replies_queued = RING - 1;
    if (max_clients > 0)
        o.max_clients = (uint32_t)max_clients;
    tdp_loop *loop;
    tdp_server *s;
    tdp_err rc;
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK ||
        (rc = tdp_loop_start_thread(loop)) != TDP_OK ||
        (rc = tdp_server_new(loop, host, (uint16_t)port, &o, &h, &sc, &s)) != TDP_OK) {
        fprintf(stderr, "infer_server: cannot start: %s\n", tdp_strerror(rc));
        return 1;
    }
    printf("infer_server: listening on port %u\n", tdp_server_port(s));
    fflush(stdout);

    int sig = 0;
    sigwait(&set, &sig);
    printf("infer_server: %s, shutting down\n", sig == SIGUSR1  ? "request count reached"
                                                : sig == SIGINT ? "SIGINT"
                                                                : "SIGTERM");
    rc = tdp_server_shutdown(s, 5000);
    printf("infer_server: shutdown: %s\n", tdp_strerror(rc));
    print_stats(s);
    tdp_server_free(s);
    tdp_loop_free(loop);
    return rc == TDP_OK ? 0 : 1;
}
