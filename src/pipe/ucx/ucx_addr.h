/*
 * ucx_addr.h (internal): the guard between a peer's HELLO and UCX.
 *
 * A peer's UCX worker address is a packed structure that ucp_ep_create
 * parses without being told its length; UCX 1.13's parser asserts (the
 * process aborts) on an unknown address version, reads past the end of a
 * short buffer, and indexes arrays with counts and indices it never bounds
 * (devices past 64, memory domains past 63). What it accepts then goes to
 * the transports (UCT), which read each device and interface address with
 * the length their own format implies, not the one the address carries.
 *
 * So no byte of a peer's address is given to UCX. The guard parses it
 * completely, against its length, and builds a new one — the canonical
 * address — from the parts it checked, keeping only what this side's own
 * worker could have produced:
 *  - the layout of UCX 1.13 (address versions 1 and 2, not "unified
 *    mode", which tdpipe's workers never use); another UCX release is
 *    refused when the profile is made;
 *  - every length, count and index inside the buffer and inside the bounds
 *    UCX relies on; no endpoint addresses (a worker address has none); the
 *    interface attributes finite and positive; nothing after the end;
 *  - only interfaces of a transport this worker has, whose device and
 *    interface addresses have the length this worker's own interface of
 *    that transport has (so a transport reads exactly what it was given);
 *  - unless the control socket proved the peer is on this host, no device
 *    whose address is one of this worker's own (a remote peer claiming
 *    this host's shared memory or loopback device).
 * The canonical address is followed by zero bytes (TDP_UCXA_PAD).
 *
 * What remains a peer's choice: which interfaces of the kinds above it
 * lists and the addresses in them (where UCX connects to, e.g. an IP and
 * port). docs/security.md describes what that leaves open.
 */
#ifndef TDP_PIPE_UCX_ADDR_H
#define TDP_PIPE_UCX_ADDR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <tdpipe/err.h>

#define TDP_UCXA_MAX_DEVS 64u  /* UCX keeps a peer's devices in a 64-bit map */
#define TDP_UCXA_MAX_TLS  128u /* UCP_MAX_RESOURCES */
#define TDP_UCXA_MAX_MD   64u  /* a memory domain index is a bit of a 64-bit map */
#define TDP_UCXA_PAD      64u  /* zero bytes after a canonical address */

/* One interface of a parsed address; pointers into the parsed buffer. */
typedef struct tdp__ucxa_tl {
    uint16_t csum; /* checksum of the transport's name */
    const uint8_t *attr;
    uint8_t attr_len;
    const uint8_t *iface;
    uint8_t iface_len;
} tdp__ucxa_tl;

typedef struct tdp__ucxa_dev {
    uint8_t md_index;
    uint8_t md_flags; /* version 1: the "can allocate / register" bits, kept as sent */
    bool has_paths, has_sys_dev;
    uint8_t num_paths, sys_dev;
    const uint8_t *addr;
    uint8_t addr_len;
    uint32_t tl0, ntl; /* its interfaces: tl[tl0 .. tl0 + ntl) */
} tdp__ucxa_dev;

/* A parsed address: what UCX 1.13's parser would see, every field bounded. */
typedef struct tdp__ucxa {
    uint8_t version;                 /* 0: address version 1; 1: version 2 */
    uint8_t flags;                   /* header flags */
    const uint8_t *uuid, *client_id; /* 8 bytes each, or NULL */
    uint32_t ndev, ntl;
    tdp__ucxa_dev dev[TDP_UCXA_MAX_DEVS];
    tdp__ucxa_tl tl[TDP_UCXA_MAX_TLS];
} tdp__ucxa;

/*
 * Parse a worker address of `len` bytes. TDP_EPROTO, with *why saying
 * what (a static string), when it is not an address UCX 1.13 would parse
 * within `len` bytes and within its own bounds, or carries what a worker
 * address never does.
 */
tdp_err tdp__ucxa_parse(const uint8_t *a, size_t len, tdp__ucxa *out, const char **why);

/* The shapes this side's worker produces; made from its own address. */
typedef struct tdp__ucxa_profile {
    uint32_t nshape;
    struct {
        uint16_t csum;
        uint8_t dev_len, iface_len;
    } shape[TDP_UCXA_MAX_TLS];
    uint32_t ndev;
    struct {
        uint8_t len;
        uint8_t bytes[255];
    } dev[TDP_UCXA_MAX_DEVS];
} tdp__ucxa_profile;

/*
 * Learn the profile from this worker's own address. TDP_ENOTSUP (logged)
 * when the UCX library is not a 1.13 release or its own address does not
 * parse: peers' addresses could not be checked.
 */
tdp_err tdp__ucxa_profile_init(tdp__ucxa_profile *p, const void *own, size_t len);

/*
 * The canonical address for a peer's `len` bytes, into out (cap bytes,
 * at least len + TDP_UCXA_PAD), *out_len its length before the padding.
 * `local`: the control socket proved the peer is on this host. TDP_EPROTO
 * when the address does not parse; TDP_ENOTSUP when it parses but lists no
 * interface this worker can use; *why says what (a static string).
 */
tdp_err tdp__ucxa_canonical(const tdp__ucxa_profile *p, const void *peer, size_t len, bool local,
                            uint8_t *out, size_t cap, size_t *out_len, const char **why);

#endif
