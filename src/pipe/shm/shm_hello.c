/* shm_hello.c: the TDP_HX_SHM record (shm_hello.h). */
#include <string.h>

#include "shm_hello.h"

tdp_err tdp__shm_hello_put(tdp_hello *h, uint8_t buf[TDP_SHM_REC_MAX], const tdp__shm_hello *in)
{
    if (in->key == NULL || in->name == NULL || in->name_len == 0 || in->name_len > TDP_SHM_NAME_MAX)
        return TDP_EINVAL;
    memcpy(buf, in->key, TDP_SHM_KEY_LEN);
    buf[TDP_SHM_KEY_LEN] = (uint8_t)(in->name_len & 0xff); /* little-endian, as all of the wire */
    buf[TDP_SHM_KEY_LEN + 1] = (uint8_t)(in->name_len >> 8);
    memcpy(buf + TDP_SHM_KEY_LEN + 2, in->name, in->name_len);
    return tdp_hello_add_rec(h, TDP_HX_SHM, buf, TDP_SHM_KEY_LEN + 2u + in->name_len);
}

tdp_err tdp__shm_hello_get(const tdp_hello *h, tdp__shm_hello *out)
{
    const tdp_hx_rec *r = tdp_hello_rec(h, TDP_HX_SHM);
    if (r == NULL)
        return TDP_ENOENT;
    if (r->len < TDP_SHM_KEY_LEN + 2u)
        return TDP_EPROTO;
    uint16_t name_len = (uint16_t)(r->val[TDP_SHM_KEY_LEN] | r->val[TDP_SHM_KEY_LEN + 1] << 8);
    if (name_len == 0 || name_len > TDP_SHM_NAME_MAX || r->len != TDP_SHM_KEY_LEN + 2u + name_len)
        return TDP_EPROTO;
    out->key = r->val;
    out->name = (const char *)r->val + TDP_SHM_KEY_LEN + 2;
    out->name_len = name_len;
    return TDP_OK;
}
