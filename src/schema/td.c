/* td.c: a consolidated tensordict — a schema and the buffer of its leaves. */
#include <tdpipe/td.h>

#include <stdatomic.h>
#include <string.h>

#include "schema_int.h"
#include "td_int.h"
#include "../core/alloc.h"

static tdp_mem_type mem_type_of(tdp_device dev)
{
    return dev.type == TDP_DEVICE_CUDA ? TDP_MEM_CUDA : TDP_MEM_HOST;
}

tdp_err tdp_td_new(tdp_schema *s, tdp_td **out)
{
    if (s == NULL || out == NULL)
        return TDP_EINVAL;
    tdp_td *td = tdp__calloc(1, sizeof(*td));
    if (td == NULL)
        return TDP_ENOMEM;
    td->device = s->device;
    td->nbytes = s->total_bytes;
    tdp_err rc = tdp_mem_alloc(mem_type_of(td->device), td->device.index, td->nbytes, 0, &td->data);
    if (rc != TDP_OK) {
        tdp__free(td);
        return rc;
    }
    td->owned = true;
    td->schema = tdp_schema_ref(s);
    atomic_init(&td->refs, 1);
    *out = td;
    return TDP_OK;
}

tdp_err tdp_td_wrap(tdp_schema *s, void *buf, uint64_t len, tdp_device dev,
                    tdp_td_release_fn release, void *arg, tdp_td **out)
{
    if (s == NULL || out == NULL || (buf == NULL && s->total_bytes > 0) || len < s->total_bytes ||
        ((uintptr_t)buf % TDP_LEAF_ALIGN) != 0)
        return TDP_EINVAL;
    tdp_td *td = tdp__calloc(1, sizeof(*td));
    if (td == NULL)
        return TDP_ENOMEM;
    td->device = dev;
    td->nbytes = s->total_bytes;
    td->data = buf;
    td->release = release;
    td->release_arg = arg;
    td->schema = tdp_schema_ref(s);
    atomic_init(&td->refs, 1);
    *out = td;
    return TDP_OK;
}

tdp_td *tdp_td_ref(tdp_td *td)
{
    if (td != NULL)
        atomic_fetch_add_explicit(&td->refs, 1, memory_order_relaxed);
    return td;
}

void tdp_td_unref(tdp_td *td)
{
    if (td == NULL || atomic_fetch_sub_explicit(&td->refs, 1, memory_order_acq_rel) != 1)
        return;
    if (td->owned)
        tdp_mem_free(mem_type_of(td->device), td->data);
    else if (td->release != NULL)
        td->release(td->data, td->release_arg);
    tdp_schema_unref(td->schema);
    tdp__free(td);
}

tdp_schema *tdp_td_schema(const tdp_td *td)
{
    return td ? td->schema : NULL;
}

void *tdp_td_data(const tdp_td *td)
{
    return td ? td->data : NULL;
}

uint64_t tdp_td_nbytes(const tdp_td *td)
{
    return td ? td->nbytes : 0;
}

tdp_device tdp_td_device(const tdp_td *td)
{
    return td ? td->device : TDP_DEVICE_CPU_INIT;
}

uint32_t tdp_td_num_leaves(const tdp_td *td)
{
    return td ? td->schema->nleaves : 0;
}

static void td_view(const tdp_td *td, uint32_t i, tdp_leaf *out)
{
    tdp__leaf_view(td->schema, i, out);
    if (out->kind == TDP_LEAF_TENSOR)
        out->data = (char *)td->data + out->offset;
}

tdp_err tdp_td_leaf_at(const tdp_td *td, uint32_t i, tdp_leaf *out)
{
    if (td == NULL || out == NULL || i >= td->schema->nleaves)
        return TDP_EINVAL;
    td_view(td, i, out);
    return TDP_OK;
}

tdp_err tdp_td_get(const tdp_td *td, const char *path, tdp_leaf *out)
{
    if (td == NULL || path == NULL || out == NULL)
        return TDP_EINVAL;
    int64_t i = tdp__find_leaf(td->schema, path);
    if (i < 0)
        return TDP_ENOENT;
    td_view(td, (uint32_t)i, out);
    return TDP_OK;
}
