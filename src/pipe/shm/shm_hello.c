/* shm_hello.c: the TDP_HX_SHM record (shm_hello.h). */
#include <string.h>

#include "shm_hello.h"

size_t tdp__shm_hello_encode(uint8_t buf[TDP_SHM_REC_MAX], const tdp__shm_hello *in)
{
    if (in->key == NULL || in->name == NULL || in->name_len == 0 || in->name_len > TDP_SHM_NAME_MAX)
        return 0;
    memcpy(buf, in->key, TDP_SHM_KEY_LEN);
    buf[TDP_SHM_KEY_LEN] = (uint8_t)(in->name_len & 0xff); /* little-endian, as all of the wire */
    buf[TDP_SHM_KEY_LEN + 1] = (uint8_t)(in->name_len >> 8);
    memcpy(buf + TDP_SHM_KEY_LEN + 2, in->name, in->name_len);
    return TDP_SHM_KEY_LEN + 2u + in->name_len;
}

tdp_err tdp__shm_hello_decode(const uint8_t *val, size_t len, tdp__shm_hello *out, size_t *used)
{
    if (len < TDP_SHM_KEY_LEN + 2u)
        return TDP_EPROTO;
    uint16_t name_len = (uint16_t)(val[TDP_SHM_KEY_LEN] | val[TDP_SHM_KEY_LEN + 1] << 8);
    if (name_len == 0 || name_len > TDP_SHM_NAME_MAX || len < TDP_SHM_KEY_LEN + 2u + name_len)
        return TDP_EPROTO;
    out->key = val;
    out->name = (const char *)val + TDP_SHM_KEY_LEN + 2;
    out->name_len = name_len;
    *used = TDP_SHM_KEY_LEN + 2u + name_len;
    return TDP_OK;
}

tdp_err tdp__shm_hello_put(tdp_hello *h, uint8_t buf[TDP_SHM_REC_MAX], const tdp__shm_hello *in)
{
    size_t n = tdp__shm_hello_encode(buf, in);
    return n == 0 ? TDP_EINVAL : tdp_hello_add_rec(h, TDP_HX_SHM, buf, n);
}

tdp_err tdp__shm_hello_get(const tdp_hello *h, tdp__shm_hello *out)
{
    const tdp_hx_rec *r = tdp_hello_rec(h, TDP_HX_SHM);
    size_t used;
    if (r == NULL)
        return TDP_ENOENT;
    tdp_err rc = tdp__shm_hello_decode(r->val, r->len, out, &used);
    return rc == TDP_OK && used != r->len ? TDP_EPROTO : rc;
}

tdp_err tdp__shm_ipc_hello_encode(uint8_t buf[TDP_SHM_IPC_REC_MAX], const tdp__shm_hello *sock,
                                  int dev, size_t *len)
{
    size_t off = tdp__shm_hello_encode(buf, sock), glen = 0;
    if (off == 0)
        return TDP_EINVAL;
    tdp_err rc = tdp__cudaipc_gpus_encode(buf + off, dev, &glen);
    if (rc == TDP_OK)
        *len = off + glen;
    return rc;
}

tdp_err tdp__shm_ipc_hello_parse(const uint8_t *val, size_t len, tdp__shm_ipc_hello *out)
{
    size_t used;
    if (tdp__shm_hello_decode(val, len, &out->sock, &used) != TDP_OK)
        return TDP_EPROTO;
    return tdp__cudaipc_gpus_parse(val + used, len - used, &out->gpus);
}

tdp_err tdp__shm_ipc_hello_get(const tdp_hello *h, tdp__shm_ipc_hello *out)
{
    const tdp_hx_rec *r = tdp_hello_rec(h, TDP_HX_CUDA_IPC);
    if (r == NULL)
        return TDP_ENOENT;
    return tdp__shm_ipc_hello_parse(r->val, r->len, out);
}
