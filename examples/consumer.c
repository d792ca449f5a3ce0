/*
 * consumer: listen on HOST:PORT, receive tensordicts until the producer
 * closes, verify each message's pattern, print what arrived.
 *
 *   consumer [HOST] PORT        (HOST defaults to all addresses)
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <tdpipe/pipe.h>
#include <tdpipe/tdpipe.h>

int main(int argc, char **argv)
{
    const char *host = argc > 2 ? argv[1] : NULL;
    int port = atoi(argc > 2 ? argv[2] : argc > 1 ? argv[1] : "0");
    tdp_loop *loop;
    tdp_listener *l;
    tdp_pipe *pipe;
    tdp_td *td;
    tdp_err rc;

    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK ||
        (rc = tdp_listener_new(loop, host, (uint16_t)port, NULL, NULL, NULL, &l)) != TDP_OK) {
        fprintf(stderr, "consumer: cannot listen: %s\n", tdp_strerror(rc));
        return 1;
    }
    printf("consumer: listening on port %u\n", tdp_listener_port(l));
    fflush(stdout);
    if ((rc = tdp_listener_accept(l, 60000, &pipe)) != TDP_OK) {
        fprintf(stderr, "consumer: no producer: %s\n", tdp_strerror(rc));
        return 1;
    }
    char peer[80];
    printf("consumer: producer %s connected\n", tdp_pipe_peer(pipe, peer, sizeof(peer)));
    uint64_t n = 0, bad = 0;
    while ((rc = tdp_pipe_recv(pipe, 30000, &td)) == TDP_OK) {
        tdp_leaf x;
        if (n == 0) {
            printf("consumer: schema of the stream:\n");
            tdp_schema_print(tdp_td_schema(td), stdout);
        }
        /* the producer fills obs with seq-dependent floats */
        if (tdp_td_get(td, "obs", &x) == TDP_OK) {
            const float *f = x.data;
            for (uint64_t i = 0; i < x.numel; i++)
                if (f[i] != (float)(n + i % 7))
                    bad++;
        }
        n++;
    }
    printf("consumer: %" PRIu64 " messages, %" PRIu64 " wrong values, ended: %s\n", n, bad,
           tdp_strerror(rc));
    tdp_pipe_free(pipe);
    tdp_listener_free(l);
    tdp_loop_free(loop);
    return rc == TDP_ECLOSED && bad == 0 ? 0 : 1;
}
