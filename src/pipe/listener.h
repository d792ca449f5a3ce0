/*
 * listener.h (internal): what a server adds to a listener — an admission
 * check consulted for every accepted socket before any handshake, and a
 * report of handshakes that failed. Both run on the loop thread.
 */
#ifndef TDP_PIPE_LISTENER_H
#define TDP_PIPE_LISTENER_H

#include <tdpipe/pipe.h>

enum tdp__admit {
    TDP__ADMIT,       /* handshake with it */
    TDP__ADMIT_EVICT, /* handshake with it, dropping the oldest handshake first */
    TDP__REFUSE,      /* BYE with TDP_ELIMIT instead of HELLO */
};

typedef struct tdp__listener_hooks {
    /*
     * A socket was accepted: npending handshakes are under way, nsource of
     * them from the same source (the same IPv4 address, or the same IPv6
     * /64: one host's share of addresses).
     */
    enum tdp__admit (*admit)(void *arg, uint32_t npending, uint32_t nsource);
    /* a handshake ended without a pipe (timed out, garbage, version, evicted) */
    void (*handshake_failed)(void *arg, tdp_err why);
    /* the number of handshakes under way changed (may be NULL) */
    void (*pending)(void *arg, uint32_t npending);
    void *arg;
} tdp__listener_hooks;

/* tdp_listener_new with hooks (may be NULL). */
tdp_err tdp__listener_new(tdp_loop *loop, const char *bind_host, uint16_t port,
                          const tdp_pipe_opts *opts, tdp_pipe_cb on_accept, void *arg,
                          const tdp__listener_hooks *hooks, tdp_listener **out);

#endif
