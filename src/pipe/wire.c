/* wire.c: frame encoding and strict decoding. */
#include "wire.h"

#include <endian.h>

#include <string.h>
#include <tdpipe/pipe.h>

/* Little-endian fields at fixed offsets (memcpy: no alignment assumed). */
static void put16(uint8_t *p, uint16_t v)
{
    v = htole16(v);
    memcpy(p, &v, 2);
}
static void put32(uint8_t *p, uint32_t v)
{
    v = htole32(v);
    memcpy(p, &v, 4);
}
static void put64(uint8_t *p, uint64_t v)
{
    v = htole64(v);
    memcpy(p, &v, 8);
}
static uint16_t get16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return le16toh(v);
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return le32toh(v);
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return le64toh(v);
}

void tdp_wire_ctl_hdr_encode(uint8_t out[TDP_CTL_HDR_LEN], uint16_t type, uint32_t length)
{
    put32(out, TDP_CTL_MAGIC);
    put16(out + 4, TDP_PROTOCOL_VERSION);
    put16(out + 6, type);
    put32(out + 8, length);
    put32(out + 12, 0);
}

tdp_err tdp_wire_ctl_hdr_decode(const uint8_t in[TDP_CTL_HDR_LEN], tdp_ctl_hdr *hdr)
{
    hdr->magic = get32(in);
    hdr->version = get16(in + 4);
    hdr->type = get16(in + 6);
    hdr->length = get32(in + 8);
    if (hdr->magic != TDP_CTL_MAGIC || get32(in + 12) != 0)
        return TDP_EPROTO;
    if (hdr->version != TDP_PROTOCOL_VERSION)
        return TDP_EVERSION;
    switch (hdr->type) {
    case TDP_CTL_HELLO:
        if (hdr->length < TDP_HELLO_FIXED_LEN ||
            hdr->length > TDP_HELLO_FIXED_LEN + 2 * TDP_MAX_UCX_ADDR)
            return TDP_EPROTO;
        return TDP_OK;
    case TDP_CTL_BYE:
        return hdr->length == TDP_BYE_LEN ? TDP_OK : TDP_EPROTO;
    default:
        return TDP_EPROTO;
    }
}

size_t tdp_wire_hello_size(const tdp_hello *h)
{
    return TDP_CTL_HDR_LEN + TDP_HELLO_FIXED_LEN + h->addr_len + h->local_addr_len;
}

/*
 * HELLO payload: recv_depth u32 | peer_mode u32 | caps u64 | max_msg u64 |
 * token u64 | host_id[16] | addr_len u32 | local_addr_len u32 | reserved u64
 * (0) | addr bytes | local addr bytes.
 */
void tdp_wire_hello_encode(uint8_t *out, const tdp_hello *h)
{
    tdp_wire_ctl_hdr_encode(out, TDP_CTL_HELLO,
                            TDP_HELLO_FIXED_LEN + h->addr_len + h->local_addr_len);
    uint8_t *p = out + TDP_CTL_HDR_LEN;
    put32(p, h->recv_depth);
    put32(p + 4, h->peer_mode);
    put64(p + 8, h->caps);
    put64(p + 16, h->max_msg_bytes);
    put64(p + 24, h->token);
    memcpy(p + 32, h->host_id, TDP_HOST_ID_LEN);
    put32(p + 48, h->addr_len);
    put32(p + 52, h->local_addr_len);
    put64(p + 56, 0);
    memcpy(p + TDP_HELLO_FIXED_LEN, h->addr, h->addr_len);
    if (h->local_addr_len > 0)
        memcpy(p + TDP_HELLO_FIXED_LEN + h->addr_len, h->local_addr, h->local_addr_len);
}

tdp_err tdp_wire_hello_decode(const uint8_t *in, size_t len, tdp_hello *h)
{
    if (len < TDP_HELLO_FIXED_LEN)
        return TDP_EPROTO;
    h->recv_depth = get32(in);
    h->peer_mode = get32(in + 4);
    h->caps = get64(in + 8);
    h->max_msg_bytes = get64(in + 16);
    h->token = get64(in + 24);
    memcpy(h->host_id, in + 32, TDP_HOST_ID_LEN);
    h->addr_len = get32(in + 48);
    h->local_addr_len = get32(in + 52);
    if (get64(in + 56) != 0)
        return TDP_EPROTO;
    if (h->recv_depth == 0 || h->recv_depth > 64 || h->peer_mode > TDP_PEER_SOCKET ||
        h->addr_len == 0 || h->addr_len > TDP_MAX_UCX_ADDR ||
        h->local_addr_len > TDP_MAX_UCX_ADDR ||
        (uint64_t)h->addr_len + h->local_addr_len != len - TDP_HELLO_FIXED_LEN ||
        (h->caps & TDP_CAP_PLANE_UCX) == 0)
        return TDP_EPROTO;
    h->addr = in + TDP_HELLO_FIXED_LEN;
    h->local_addr = h->local_addr_len > 0 ? in + TDP_HELLO_FIXED_LEN + h->addr_len : NULL;
    return TDP_OK;
}

void tdp_wire_bye_encode(uint8_t out[TDP_CTL_HDR_LEN + TDP_BYE_LEN], const tdp_bye *b)
{
    tdp_wire_ctl_hdr_encode(out, TDP_CTL_BYE, TDP_BYE_LEN);
    put64(out + TDP_CTL_HDR_LEN, b->last_seq);
    put32(out + TDP_CTL_HDR_LEN + 8, (uint32_t)b->reason);
    put32(out + TDP_CTL_HDR_LEN + 12, 0);
}

tdp_err tdp_wire_bye_decode(const uint8_t *in, size_t len, tdp_bye *b)
{
    if (len != TDP_BYE_LEN || get32(in + 12) != 0)
        return TDP_EPROTO;
    b->last_seq = get64(in);
    b->reason = (int32_t)get32(in + 8);
    if (b->reason > 0 || b->reason < -1000)
        return TDP_EPROTO;
    return TDP_OK;
}

/*
 * AM header: magic u32 | version u8 | type u8 | flags u16 | token u64 |
 * seq u64 | hash u64 | length u64 | arg u64.
 */
void tdp_wire_am_encode(uint8_t out[TDP_AM_HDR_LEN], const tdp_am_hdr *h)
{
    put32(out, TDP_AM_MAGIC);
    out[4] = TDP_PROTOCOL_VERSION;
    out[5] = h->type;
    put16(out + 6, h->flags);
    put64(out + 8, h->token);
    put64(out + 16, h->seq);
    put64(out + 24, h->hash);
    put64(out + 32, h->length);
    put64(out + 40, h->arg);
}

tdp_err tdp_wire_am_decode(const void *in, size_t len, tdp_am_hdr *h)
{
    const uint8_t *p = in;
    if (in == NULL || len != TDP_AM_HDR_LEN || get32(p) != TDP_AM_MAGIC)
        return TDP_EPROTO;
    if (p[4] != TDP_PROTOCOL_VERSION)
        return TDP_EVERSION;
    h->type = p[5];
    h->flags = get16(p + 6);
    h->token = get64(p + 8);
    h->seq = get64(p + 16);
    h->hash = get64(p + 24);
    h->length = get64(p + 32);
    h->arg = get64(p + 40);
    switch (h->type) {
    case TDP_AM_SCHEMA:
    case TDP_AM_DATA:
        return h->flags == 0 ? TDP_OK : TDP_EPROTO;
    case TDP_AM_CREDIT:
        return h->flags == 0 && h->length == 0 ? TDP_OK : TDP_EPROTO;
    default:
        return TDP_EPROTO;
    }
}
