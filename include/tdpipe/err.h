/*
 * err.h: the one error enum every tdpipe function returns.
 *
 * Functions return TDP_OK (0) on success and a negative tdp_err on failure.
 * Outputs are written only on success. tdp_strerror() is thread-safe and
 * returns static strings.
 */
#ifndef TDPIPE_ERR_H
#define TDPIPE_ERR_H

#include <tdpipe/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * X-macro table: name, value, message. One place defines the codes and the
 * strings so they can never drift apart. Values are stable: they may be
 * logged, compared across versions and sent by a peer in a BYE frame.
 */
#define TDP_ERR_TABLE(X)                                                                           \
    X(OK, 0, "success")                                                                            \
    X(EINVAL, -1, "invalid argument")                                                              \
    X(ESCHEMA, -2, "schema invalid")                                                               \
    X(EMISMATCH, -3, "schema mismatch")                                                            \
    X(EMSGSIZE, -4, "message too large")                                                           \
    X(ENOMEM, -5, "out of memory")                                                                 \
    X(ECLOSED, -6, "closed (clean end of stream)")                                                 \
    X(ECONNRESET, -7, "connection reset (peer failed)")                                            \
    X(ETIMEDOUT, -8, "timed out")                                                                  \
    X(ENOTSUP, -9, "not supported")                                                                \
    X(ECUDA, -10, "CUDA error")                                                                    \
    X(EUCX, -11, "UCX error")                                                                      \
    X(EAGAIN, -12, "would block / busy")                                                           \
    X(ENOENT, -13, "no such key")                                                                  \
    X(EPROTO, -14, "protocol error (malformed frame)")                                             \
    X(EVERSION, -15, "protocol version mismatch")                                                  \
    X(ECONNREFUSED, -16, "connection refused")                                                     \
    X(EADDR, -17, "address invalid or unresolvable")                                               \
    X(ECANCELED, -18, "operation canceled")                                                        \
    X(ELIMIT, -19, "peer limit reached")                                                           \
    X(EINTERNAL, -20, "internal error")                                                            \
    X(EAUTH, -21, "authentication failed (shared secret wrong or missing)")                        \
    X(ECHECKSUM, -22, "payload checksum mismatch (message dropped)")

typedef enum tdp_err {
#define TDP__ERR_ENUM(name, value, msg) TDP_##name = (value),
    TDP_ERR_TABLE(TDP__ERR_ENUM)
#undef TDP__ERR_ENUM
} tdp_err;

/*
 * Static, thread-safe description of an error code. Unknown values give
 * "unknown error"; the result is never NULL.
 */
TDP_API const char *tdp_strerror(int err);

/* The code's name without prefix ("ECLOSED"), or "UNKNOWN". Never NULL. */
TDP_API const char *tdp_errname(int err);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_ERR_H */
