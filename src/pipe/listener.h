/*
 * listener.h (internal): what a server adds to a listener — its own
 * admission check (clients, shutdown) consulted for every accepted socket
 * before any handshake, and reports of refusals, failed handshakes and
 * handshakes under way. All run on the loop thread.
 */
#ifndef TDP_PIPE_LISTENER_H
#define TDP_PIPE_LISTENER_H

#include <tdpipe/pipe.h>

typedef struct tdp__listener_hooks {
    /*
     * A socket was accepted: false refuses it (BYE with TDP_ELIMIT) before
     * the listener's own limits and admit hook are asked. npending
     * handshakes are under way.
     */
    bool (*admit)(void *arg, uint32_t npending);
    /* the listener refused a socket itself (max_per_source, its admit hook) */
    void (*refused)(void *arg, tdp_err why);
    /* a handshake ended without a pipe (timed out, garbage, version, evicted) */
    void (*handshake_failed)(void *arg, tdp_err why);
    /* the number of handshakes under way changed (may be NULL) */
    void (*pending)(void *arg, uint32_t npending);
    /* receive storage of every pipe accepted is charged to it (may be NULL;
     * each pipe holds a reference): tdp__session_set_budget */
    struct tdp__budget *budget;
    void *arg;
} tdp__listener_hooks;

/* tdp_listener_new_opts with hooks (may be NULL). */
tdp_err tdp__listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                          const tdp_listener_opts *opts, tdp_pipe_cb on_accept, void *arg,
                          const tdp__listener_hooks *hooks, tdp_listener **out);

#endif
