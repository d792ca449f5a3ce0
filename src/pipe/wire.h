/*
 * wire.h (internal): the frames of the protocol, encoded explicitly
 * (little-endian, fixed offsets) and decoded with every field checked.
 * docs/wire-format.md describes the same bytes for readers.
 *
 * Two channels per pipe:
 *  - the control socket (TCP) carries HELLO and BYE, and its closing is how
 *    a dead peer is seen;
 *  - UCX active messages carry SCHEMA, DATA and CREDIT, in order per
 *    direction, payloads received in place.
 */
#ifndef TDP_PIPE_WIRE_H
#define TDP_PIPE_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <tdpipe/err.h>

/* ---- control socket ------------------------------------------------------ */

#define TDP_CTL_MAGIC    0x43504454u /* "TDPC" */
#define TDP_CTL_HDR_LEN  16u
#define TDP_HOST_ID_LEN  16u
#define TDP_MAX_UCX_ADDR 65536u /* a worker address is a few hundred bytes */

enum tdp_ctl_type {
    TDP_CTL_HELLO = 1,
    TDP_CTL_BYE = 2,
};

/* Capability bits of HELLO. */
#define TDP_CAP_MEM_HOST  (1u << 0)
#define TDP_CAP_MEM_CUDA  (1u << 1)
#define TDP_CAP_PLANE_UCX (1u << 8)

typedef struct tdp_ctl_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    uint32_t length; /* payload bytes after the header */
} tdp_ctl_hdr;

#define TDP_HELLO_FIXED_LEN 64u

typedef struct tdp_hello {
    uint32_t recv_depth;    /* credits this side grants */
    uint32_t peer_mode;     /* tdp_peer_mode requested */
    uint64_t caps;          /* TDP_CAP_* */
    uint64_t max_msg_bytes; /* largest buffer this side accepts */
    uint64_t token;         /* put in every AM frame sent to this side */
    uint8_t host_id[TDP_HOST_ID_LEN];
    uint32_t addr_len; /* UCX address of the worker for any peer */
    const void *addr;
    uint32_t local_addr_len; /* of the shared-memory worker for same-host peers; 0: none */
    const void *local_addr;
} tdp_hello;

#define TDP_BYE_LEN 16u

typedef struct tdp_bye {
    uint64_t last_seq; /* seq of the last DATA this side sent */
    int32_t reason;    /* TDP_OK for a clean end, else why (ELIMIT, EVERSION...) */
} tdp_bye;

void tdp_wire_ctl_hdr_encode(uint8_t out[TDP_CTL_HDR_LEN], uint16_t type, uint32_t length);

/*
 * Check a control header: magic, type and length bounds. A version other
 * than ours gives TDP_EVERSION (with *hdr filled so the caller can say
 * which); anything else malformed gives TDP_EPROTO.
 */
tdp_err tdp_wire_ctl_hdr_decode(const uint8_t in[TDP_CTL_HDR_LEN], tdp_ctl_hdr *hdr);

/* Bytes needed to encode h (header included). */
size_t tdp_wire_hello_size(const tdp_hello *h);
void tdp_wire_hello_encode(uint8_t *out, const tdp_hello *h);
/* Decode a HELLO payload of `len` bytes; h->addr points into `in`. */
tdp_err tdp_wire_hello_decode(const uint8_t *in, size_t len, tdp_hello *h);

void tdp_wire_bye_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_BYE_LEN], const tdp_bye *b);
tdp_err tdp_wire_bye_decode(const uint8_t *in, size_t len, tdp_bye *b);

/* ---- active-message frames ------------------------------------------------ */

#define TDP_AM_ID       0x7d
#define TDP_AM_MAGIC    0x50445454u /* "TTDP" */
#define TDP_AM_HDR_LEN  48u

enum tdp_am_type {
    TDP_AM_SCHEMA = 1, /* payload: canonical schema JSON; arg = total bytes */
    TDP_AM_DATA = 2,   /* payload: the consolidated buffer; arg = flags */
    TDP_AM_CREDIT = 3, /* no payload; arg = buffers released, cumulative */
};

typedef struct tdp_am_hdr {
    uint8_t type;
    uint16_t flags;
    uint64_t token; /* the receiver's pipe token */
    uint64_t seq;
    uint64_t hash;   /* schema hash */
    uint64_t length; /* payload bytes */
    uint64_t arg;
} tdp_am_hdr;

void tdp_wire_am_encode(uint8_t out[TDP_AM_HDR_LEN], const tdp_am_hdr *h);
/* Check magic, version, type and length; TDP_EPROTO when malformed. */
tdp_err tdp_wire_am_decode(const void *in, size_t len, tdp_am_hdr *h);

#endif
