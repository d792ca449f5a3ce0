/* cudaipc_hello.c: the TDP_HX_CUDA_IPC record and the plane's usable rule (cudaipc.h). */
#include <string.h>

#include "cudaipc.h"

tdp_err tdp__cudaipc_hello_encode(uint8_t buf[TDP_CUDAIPC_REC_MAX], const tdp__shm_hello *sock,
                                  int dev, size_t *len)
{
    int n = tdp__cuda_device_count();
    if (dev < 0 || dev >= n || dev >= (int)TDP_CUDAIPC_DEVS)
        return TDP_ENOTSUP;
    size_t off = tdp__shm_hello_encode(buf, sock);
    if (off == 0)
        return TDP_EINVAL;
    uint8_t ndev = (uint8_t)(n < (int)TDP_CUDAIPC_DEVS ? n : (int)TDP_CUDAIPC_DEVS);
    buf[off] = ndev;
    buf[off + 1] = (uint8_t)dev;
    for (int i = 0; i < ndev; i++) {
        tdp_err rc = tdp__cuda_device_uuid(i, buf + off + 2 + (size_t)i * TDP_CUDAIPC_UUID);
        if (rc != TDP_OK)
            return TDP_ENOTSUP; /* no UUID: no way to tell a peer which GPU */
    }
    *len = off + 2 + (size_t)ndev * TDP_CUDAIPC_UUID;
    return TDP_OK;
}

tdp_err tdp__cudaipc_hello_parse(const uint8_t *val, size_t len, tdp__cudaipc_hello *out)
{
    size_t used;
    if (tdp__shm_hello_decode(val, len, &out->sock, &used) != TDP_OK || len - used < 2)
        return TDP_EPROTO;
    uint8_t ndev = val[used], dev = val[used + 1];
    if (ndev == 0 || ndev > TDP_CUDAIPC_DEVS || dev >= ndev ||
        len - used - 2 != (size_t)ndev * TDP_CUDAIPC_UUID)
        return TDP_EPROTO;
    out->ndev = ndev;
    out->dev = dev;
    out->uuids = val + used + 2;
    return TDP_OK;
}

tdp_err tdp__cudaipc_hello_get(const tdp_hello *h, tdp__cudaipc_hello *out)
{
    const tdp_hx_rec *r = tdp_hello_rec(h, TDP_HX_CUDA_IPC);
    if (r == NULL)
        return TDP_ENOENT;
    return tdp__cudaipc_hello_parse(r->val, r->len, out);
}

bool tdp__cudaipc_sees(const tdp__cudaipc_hello *peer, const uint8_t uuid[TDP_CUDAIPC_UUID])
{
    for (uint8_t i = 0; i < peer->ndev; i++)
        if (memcmp(peer->uuids + (size_t)i * TDP_CUDAIPC_UUID, uuid, TDP_CUDAIPC_UUID) == 0)
            return true;
    return false;
}

bool tdp__cudaipc_reach(const tdp__cudaipc_hello *a, const tdp__cudaipc_hello *b)
{
    return tdp__cudaipc_sees(b, a->uuids + (size_t)a->dev * TDP_CUDAIPC_UUID) &&
           tdp__cudaipc_sees(a, b->uuids + (size_t)b->dev * TDP_CUDAIPC_UUID);
}

int tdp__cudaipc_local_dev(const uint8_t uuid[TDP_CUDAIPC_UUID])
{
    int n = tdp__cuda_device_count();
    for (int i = 0; i < n; i++) {
        uint8_t u[TDP_CUDAIPC_UUID];
        if (tdp__cuda_device_uuid(i, u) == TDP_OK && memcmp(u, uuid, TDP_CUDAIPC_UUID) == 0)
            return i;
    }
    return -1;
}
