/* cudaipc_hello.c: the GPUs part of the TDP_HX_CUDA_IPC record and the plane's reach rule (cudaipc.h). */
#include <string.h>

#include "cudaipc.h"

tdp_err tdp__cudaipc_gpus_encode(uint8_t buf[TDP_CUDAIPC_GPUS_MAX], int dev, size_t *len)
{
    int n = tdp__cuda_device_count();
    if (dev < 0 || dev >= n || dev >= (int)TDP_CUDAIPC_DEVS)
        return TDP_ENOTSUP;
    uint8_t ndev = (uint8_t)(n < (int)TDP_CUDAIPC_DEVS ? n : (int)TDP_CUDAIPC_DEVS);
    buf[0] = ndev;
    buf[1] = (uint8_t)dev;
    for (int i = 0; i < ndev; i++) {
        tdp_err rc = tdp__cuda_device_uuid(i, buf + 2 + (size_t)i * TDP_CUDAIPC_UUID);
        if (rc != TDP_OK)
            return TDP_ENOTSUP; /* no UUID: no way to tell a peer which GPU */
    }
    *len = 2 + (size_t)ndev * TDP_CUDAIPC_UUID;
    return TDP_OK;
}

tdp_err tdp__cudaipc_gpus_parse(const uint8_t *val, size_t len, tdp__cudaipc_gpus *out)
{
    if (len < 2)
        return TDP_EPROTO;
    uint8_t ndev = val[0], dev = val[1];
    if (ndev == 0 || ndev > TDP_CUDAIPC_DEVS || dev >= ndev ||
        len - 2 != (size_t)ndev * TDP_CUDAIPC_UUID)
        return TDP_EPROTO;
    out->ndev = ndev;
    out->dev = dev;
    out->uuids = val + 2;
    return TDP_OK;
}

bool tdp__cudaipc_sees(const tdp__cudaipc_gpus *peer, const uint8_t uuid[TDP_CUDAIPC_UUID])
{
    for (uint8_t i = 0; i < peer->ndev; i++)
        if (memcmp(peer->uuids + (size_t)i * TDP_CUDAIPC_UUID, uuid, TDP_CUDAIPC_UUID) == 0)
            return true;
    return false;
}

bool tdp__cudaipc_reach(const tdp__cudaipc_gpus *a, const tdp__cudaipc_gpus *b)
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
