/*
 * listener.h (internal): what a server adds to a listener — an admission
 * check consulted for every accepted socket before any handshake, and a
 * report of handshakes that failed. Both run on the loop thread.
 */
#ifndef TDP_PIPE_LISTENER_H
#define TDP_PIPE_LISTENER_H

#include <tdpipe/pipe.h>

typedef struct tdp__listener_hooks {
    /* false: refuse the socket (BYE with TDP_ELIMIT instead of HELLO) */
    bool (*admit)(void *arg, uint32_t npending);
    /* a handshake ended without a pipe (timed out, garbage, version) */
    void (*handshake_failed)(void *arg, tdp_err why);
    void *arg;
} tdp__listener_hooks;

/* tdp_listener_new with hooks (may be NULL). */
tdp_err tdp__listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                          const tdp_pipe_opts *opts, tdp_pipe_cb on_accept, void *arg,
                          const tdp__listener_hooks *hooks, tdp_listener **out);

#endif
