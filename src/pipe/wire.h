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
#include <tdpipe/pipe.h>

/* ---- control socket ------------------------------------------------------ */

#define TDP_CTL_MAGIC    0x43504454u /* "TDPC" */
#define TDP_CTL_HDR_LEN  16u
#define TDP_HOST_ID_LEN  16u
#define TDP_MAX_UCX_ADDR 65536u /* a worker address is a few hundred bytes */

enum tdp_ctl_type {
    TDP_CTL_HELLO = 1,
    TDP_CTL_BYE = 2,
    TDP_CTL_AUTH = 3, /* tag[32]: the sender's proof that it holds the shared secret */
    /* plane records sent once the peer's proof checked out (TDP_HX_PROVEN) */
    TDP_CTL_PROVEN = 4,
    /*
     * hash u64 | count u64: the receiver has put in force, with its storage
     * ready, the count-th prepared SCHEMA (TDP_AM_F_PREPARE) of this
     * connection, of that hash. Sent only to a peer whose HELLO carried
     * TDP_HX_READY.
     */
    TDP_CTL_READY = 5,
    /*
     * A frame of the tcp plane, which rides this socket once the HELLOs
     * chose it: an AM header (TDP_AM_HDR_LEN, or TDP_AM_HDR_SUM_LEN with
     * TDP_AM_F_SUM) as `length`, then the header's `length` payload bytes,
     * which the control header does not count (a payload may pass 4 GiB).
     */
    TDP_CTL_PLANE = 6,
};

#define TDP_AUTH_TAG_LEN   32u
#define TDP_RESUME_MAX     (UINT64_C(1) << 62) /* far past any stream; room to add to */
#define TDP_AUTH_HMAC_SHA256 1u /* the one method: TDP_HX_AUTH's value */

/* Capability bits of HELLO; unknown bits are ignored. */
#define TDP_CAP_MEM_HOST (1u << 0)
#define TDP_CAP_MEM_CUDA (1u << 1)

typedef struct tdp_ctl_hdr {
    uint32_t magic;
    uint16_t version;
    uint16_t type;
    uint32_t length; /* payload bytes after the header */
} tdp_ctl_hdr;

/*
 * HELLO (protocol 2): a fixed part, then extension records. A record is
 * {type u16, flags u16, length u32} and `length` value bytes, zero-padded
 * so the next record starts 8-aligned. A record flagged TDP_HX_CRITICAL
 * that the receiver does not know makes it refuse the HELLO
 * (TDP_EVERSION); other unknown records are skipped. docs/wire-format.md
 * has the bytes and the rules for adding records.
 */
#define TDP_HELLO_FIXED_LEN 72u
#define TDP_HELLO_NONCE_LEN 16u
/* Both UCX addresses at their largest, and room for the other records. */
#define TDP_HELLO_MAX_LEN (2u * TDP_MAX_UCX_ADDR + 4096u)

#define TDP_HX_HDR_LEN     8u
#define TDP_HX_ALIGN       8u
#define TDP_HX_MAX_RECORDS 64u
#define TDP_HX_CRITICAL    (1u << 0) /* record flag; the other bits are ignored */
#define TDP_HX_MAX_DEPTH   64u       /* receive depths, in the fixed part and records */
#define TDP_HX_WINDOW_MIN  4096ull   /* TDP_HX_WINDOW's bounds */
#define TDP_HX_WINDOW_MAX  (1ull << 30)

/* Extension record types. 0 is never a record type. */
enum tdp_hx_type {
    TDP_HX_PLANES = 1,         /* plane ids, the sender's preference first */
    TDP_HX_UCX_ADDR = 2,       /* worker address for any peer */
    TDP_HX_UCX_LOCAL_ADDR = 3, /* shared-memory worker's address, same-host peers */
    TDP_HX_SHM = 4,            /* key[16] | name_len u16 | name: the same-host plane's socket */
    TDP_HX_AUTH = 5,           /* critical; method u8: the sender requires a shared secret */
    TDP_HX_RESUME = 6,      /* critical; u64: seq of the next DATA the sender sends (reconnected) */
    TDP_HX_WANT_DEPTH = 7,  /* u32 1..64: the receive depth the sender asks the peer to hold */
    TDP_HX_CHECKSUM = 8,    /* u8 algorithm: the sender offers a payload checksum */
    TDP_HX_PROVEN = 9,      /* u8 version: the sender speaks TDP_CTL_PROVEN (with AUTH) */
    TDP_HX_CUDA_IPC = 10,   /* the shm record, then the GPUs this side sees (cudaipc.h) */
    TDP_HX_READY = 11,      /* u8 version: the sender speaks TDP_CTL_READY and TDP_AM_F_PREPARE */
    TDP_HX_UCX_CHUNKS = 12, /* u8 version: the ucx plane reads staged DATA as CHUNK frames */
    /* u64 TDP_HX_WINDOW_MIN..MAX: the sender's receive window in bytes: small
     * layouts may have more than recv_depth messages in flight (tdp__window) */
    TDP_HX_WINDOW = 13,
    TDP_HX_UCX_BATCH = 14, /* u8 version: the ucx plane reads BATCH frames */
    TDP_HX_TCP = 15,       /* u8 flags (TDP_TCP_*): the tcp plane's */
};

/* TDP_HX_TCP's flags (unknown bits ignored). */
#define TDP_TCP_OFF_HOST 1u /* TCP is the sender's way to other hosts: it has no RDMA device */

/* TDP_HX_READY's value: the one version of READY and prepared SCHEMAs. */
#define TDP_READY_V1 1u

/* TDP_HX_PROVEN's value: the one version of the PROVEN frame. */
#define TDP_PROVEN_V1 1u

/* TDP_HX_CHECKSUM's value: the one algorithm, XXH3-64 of the DATA payload. */
#define TDP_SUM_XXH3_64 1u

/*
 * Data plane ids, one byte each in TDP_HX_PLANES. 0 is "none" (never on
 * the wire); ids are below 64 so a uint64_t mask can name any set.
 */
/*
 * Plane ids on the wire are tdp_plane values (include/tdpipe/pipe.h), one
 * byte each in TDP_HX_PLANES; 0 is "none" (never on the wire); ids are
 * below 64 so a uint64_t mask can name any set. Reserved for planes to come:
 */
#define TDP_PLANE_CUDA_STAGED 4 /* (cuda-ipc, 3, is a tdp_plane now) */
#define TDP_PLANE_BIT(id) (UINT64_C(1) << (id))
#define TDP_MAX_PLANES    16u

/*
 * A plane's record in a HELLO. wire.c frames it and checks only what every
 * record obeys (a known plane type, 1..TDP_HX_PLANE_REC_MAX bytes, not
 * repeated); what the value means, and whether it is well formed, is the
 * owning plane's to decide (src/pipe/<plane>/).
 */
typedef struct tdp_hx_rec {
    uint16_t type; /* a plane record type: tdp_wire_hx_is_plane */
    uint32_t len;
    const uint8_t *val;
} tdp_hx_rec;

#define TDP_HX_PLANE_RECS    8u               /* plane records in one HELLO, at most */
#define TDP_HX_PLANE_REC_MAX TDP_MAX_UCX_ADDR /* a plane record's value, at most */

/* Whether type is a plane's record (carried opaquely in tdp_hello.recs). */
bool tdp_wire_hx_is_plane(uint16_t type);

/*
 * A HELLO, both ways. Records are optional: a NULL pointer means absent,
 * and only present records are encoded. Decoded pointers point into the
 * decoder's input and live as long as it does.
 */
typedef struct tdp_hello {
    uint32_t recv_depth;    /* credits this side grants, 1..64 */
    uint32_t peer_mode;     /* tdp_peer_mode requested */
    uint64_t caps;          /* TDP_CAP_* */
    uint64_t max_msg_bytes; /* largest buffer this side accepts */
    uint64_t token;         /* put in every AM frame sent to this side */
    uint8_t host_id[TDP_HOST_ID_LEN];
    uint64_t flags;                     /* none defined yet: sent as 0, unknown bits ignored */
    uint8_t nonce[TDP_HELLO_NONCE_LEN]; /* random per HELLO */

    const uint8_t *planes; /* TDP_HX_PLANES: nplanes (1..16) distinct ids, 0 excluded */
    uint32_t nplanes;
    /* the planes' records (TDP_HX_UCX_ADDR, _UCX_LOCAL_ADDR, _SHM), one per type */
    tdp_hx_rec recs[TDP_HX_PLANE_RECS];
    uint32_t nrecs;
    uint8_t auth; /* TDP_HX_AUTH: 0 (none) or TDP_AUTH_HMAC_SHA256 */
    uint64_t resume; /* TDP_HX_RESUME: 0 (a fresh stream) or 2..2^62 */
    uint32_t want_depth; /* TDP_HX_WANT_DEPTH: 0 (no wish) or 1..64 */
    uint8_t checksum;    /* TDP_HX_CHECKSUM: 0 (not offered) or the algorithm offered */
    uint8_t proven;      /* TDP_HX_PROVEN: 0 (not spoken) or the version spoken */
    uint8_t ready;       /* TDP_HX_READY: 0 (not spoken) or the version spoken */
    uint64_t window;     /* TDP_HX_WINDOW: 0 (none) or its bytes */

    /* Set by the decoder, ignored by the encoder. */
    uint32_t nskipped;         /* unknown non-critical records skipped */
    uint16_t unknown_critical; /* with TDP_EVERSION: the unknown critical type */
} tdp_hello;

#define TDP_BYE_LEN 16u
#define TDP_READY_LEN 16u

typedef struct tdp_ready {
    uint64_t hash;  /* the prepared schema's hash */
    uint64_t count; /* prepared SCHEMAs received on this connection, this one included (>= 1) */
} tdp_ready;

void tdp_wire_ready_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_READY_LEN], const tdp_ready *r);
/* TDP_EPROTO: a length other than TDP_READY_LEN, or a count of 0. */
tdp_err tdp_wire_ready_decode(const uint8_t *in, size_t len, tdp_ready *r);

typedef struct tdp_bye {
    uint64_t last_seq; /* seq of the last DATA this side sent */
    int32_t reason;    /* TDP_OK for a clean end, else why (ELIMIT, EVERSION...) */
} tdp_bye;

/* The plane record of that type in h, or NULL. */
const tdp_hx_rec *tdp_hello_rec(const tdp_hello *h, uint16_t type);
/*
 * Add a plane record to h (val must outlive h's encoding). TDP_EINVAL: not
 * a plane type, a length out of bounds, or one of that type already there;
 * TDP_ELIMIT: TDP_HX_PLANE_RECS already.
 */
tdp_err tdp_hello_add_rec(tdp_hello *h, uint16_t type, const void *val, uint32_t len);

void tdp_wire_ctl_hdr_encode(uint8_t out[TDP_CTL_HDR_LEN], uint16_t type, uint32_t length);

/*
 * Check a control header: magic, type and length bounds. A version other
 * than ours gives TDP_EVERSION (with *hdr filled so the caller can say
 * which); anything else malformed gives TDP_EPROTO.
 */
tdp_err tdp_wire_ctl_hdr_decode(const uint8_t in[TDP_CTL_HDR_LEN], tdp_ctl_hdr *hdr);

/*
 * Bytes needed to encode h, header included; 0 when h cannot be encoded
 * (a field out of the bounds the decoder enforces).
 */
size_t tdp_wire_hello_size(const tdp_hello *h);
/*
 * Write h (header included) into out, which holds tdp_wire_hello_size(h)
 * bytes. TDP_EINVAL, and nothing written, when h cannot be encoded: what
 * is encoded always decodes.
 */
tdp_err tdp_wire_hello_encode(uint8_t *out, const tdp_hello *h);
/*
 * Decode a HELLO payload of `len` bytes into *h; record pointers point into
 * `in`. TDP_EPROTO when malformed: a fixed field out of bounds, a record
 * truncated, overrunning or with non-zero padding, a known record repeated
 * or malformed, more than TDP_HX_MAX_RECORDS records. TDP_EVERSION when
 * well-formed but carrying a critical record of a type this side does not
 * know (h->unknown_critical names it; the rest of *h is not to be used on
 * any failure).
 */
tdp_err tdp_wire_hello_decode(const uint8_t *in, size_t len, tdp_hello *h);

/*
 * The data plane two peers use, from their TDP_HX_PLANES lists: among the
 * ids in both lists and in `allowed` (TDP_PLANE_BIT mask), the one with the
 * smallest sum of its positions in a and b; a tie goes to the smaller id.
 * Symmetric: swapping a and b gives the same answer, so both sides agree
 * as long as they pass the same `allowed` (computed from what both know,
 * e.g. same host or not). A repeated id counts at its first position; ids
 * of 64 and above are never chosen. 0 when nothing is common.
 */
int tdp_wire_plane_choose(const uint8_t *a, size_t na, const uint8_t *b, size_t nb,
                          uint64_t allowed);

void tdp_wire_bye_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_BYE_LEN], const tdp_bye *b);
tdp_err tdp_wire_bye_decode(const uint8_t *in, size_t len, tdp_bye *b);

void tdp_wire_auth_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_AUTH_TAG_LEN],
                          const uint8_t tag[TDP_AUTH_TAG_LEN]);

/*
 * PROVEN: plane records a side may send only once the peer's proof has
 * checked out (what must not exist for a peer before it: a same-host
 * worker's address). Sent once each way, after the sender's AUTH, when both
 * HELLOs carry TDP_HX_PROVEN and a secret. The payload is records framed as
 * in HELLO (0..TDP_PROVEN_MAX_LEN bytes), plane records only.
 */
#define TDP_PROVEN_MAX_LEN (TDP_HELLO_MAX_LEN - TDP_HELLO_FIXED_LEN)

/* Bytes of h's plane records as a PROVEN frame, header included; 0 if they cannot be encoded. */
size_t tdp_wire_proven_size(const tdp_hello *h);
/* Write h's plane records (only) as a PROVEN frame of tdp_wire_proven_size(h) bytes. */
tdp_err tdp_wire_proven_encode(uint8_t *out, const tdp_hello *h);
/*
 * Add the records of a PROVEN payload to h, the peer's decoded HELLO
 * (record pointers point into `in`). TDP_EPROTO: malformed as a HELLO's
 * records would be, a record of a type the HELLO already has, or a known
 * record that is not a plane's; TDP_EVERSION: an unknown critical record.
 * On failure h is not to be used.
 */
tdp_err tdp_wire_proven_decode(const uint8_t *in, size_t len, tdp_hello *h);

/* ---- active-message frames ------------------------------------------------ */

#define TDP_AM_ID       0x7d
#define TDP_AM_MAGIC    0x50445454u /* "TTDP" */
#define TDP_AM_HDR_LEN  48u
/* A DATA header with TDP_AM_F_SUM: the payload's checksum follows, u64. */
#define TDP_AM_HDR_SUM_LEN 56u
#define TDP_AM_HDR_MAX_LEN TDP_AM_HDR_SUM_LEN
#define TDP_AM_HDR_ARG_OFF 40u /* where arg lies in the header, u64 little-endian */
#define TDP_AM_F_SUM       (1u << 0) /* DATA only, when both HELLOs offered TDP_HX_CHECKSUM */
/* SCHEMA only, to a peer whose HELLO carried TDP_HX_READY: sent by
 * tdp_pipe_prepare ahead of any DATA; the receiver answers TDP_CTL_READY */
#define TDP_AM_F_PREPARE (1u << 1)
/* DATA only: no payload of its own; the bytes follow in CHUNK frames (TDP_HX_UCX_CHUNKS) */
#define TDP_AM_F_CHUNKED (1u << 2)
/* TDP_HX_UCX_CHUNKS's value: the one version of chunked DATA. */
#define TDP_UCX_CHUNKS_V1 1u
/* TDP_HX_UCX_BATCH's value: the one version of BATCH frames. */
#define TDP_UCX_BATCH_V1 1u
/* A BATCH's entries: at least 2, at most this many (a batch fits one eager AM) */
#define TDP_AM_BATCH_MAX 64u

enum tdp_am_type {
    TDP_AM_SCHEMA = 1, /* payload: canonical schema JSON; arg = total bytes */
    TDP_AM_DATA = 2,   /* payload: the consolidated buffer; arg = as CREDIT's, riding along */
    TDP_AM_CREDIT = 3, /* no payload; arg = buffers released, cumulative */
    TDP_AM_CHUNK = 4,  /* payload: bytes of a CHUNKED DATA; seq, hash as its; arg = offset */
    /* payload: arg DATA frames (header, then its bytes) back to back; seq = the first one's */
    TDP_AM_BATCH = 5,
};

typedef struct tdp_am_hdr {
    uint8_t type;
    uint16_t flags;
    uint64_t token; /* the receiver's pipe token */
    uint64_t seq;
    uint64_t hash;   /* schema hash */
    uint64_t length; /* payload bytes */
    uint64_t arg;
    uint64_t sum; /* with TDP_AM_F_SUM: XXH3-64 of the payload */
} tdp_am_hdr;

/* Header bytes for h: TDP_AM_HDR_LEN, or TDP_AM_HDR_SUM_LEN with TDP_AM_F_SUM. */
size_t tdp_wire_am_len(const tdp_am_hdr *h);
/* Write tdp_wire_am_len(h) bytes (out holds TDP_AM_HDR_MAX_LEN); returns that length. */
size_t tdp_wire_am_encode(uint8_t *out, const tdp_am_hdr *h);
/*
 * Check magic, version, type, flags and length; TDP_EPROTO when malformed.
 * len is TDP_AM_HDR_LEN, or TDP_AM_HDR_SUM_LEN for a DATA with TDP_AM_F_SUM.
 */
tdp_err tdp_wire_am_decode(const void *in, size_t len, tdp_am_hdr *h);

/*
 * The DATA frame at the start of a BATCH payload's remaining `left` bytes:
 * its header in *h, its bytes at *data, and the bytes it takes in all in
 * *used. TDP_EPROTO unless it is a DATA (no CHUNKED flag) for token with
 * sequence number seq whose bytes lie within left.
 */
tdp_err tdp_wire_batch_entry(const uint8_t *in, size_t left, uint64_t token, uint64_t seq,
                             tdp_am_hdr *h, const uint8_t **data, size_t *used);

#endif
