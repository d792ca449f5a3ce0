/*
 * encode.c: the schema's canonical JSON form (jansson). Keys sorted,
 * compact separators, ASCII-escaped: one schema gives one byte string and
 * one hash. The decoder (json.c) and the model (schema.c) both use it.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "schema_int.h"
#include "../core/alloc.h"

#define DUMP_FLAGS (JSON_SORT_KEYS | JSON_COMPACT | JSON_ENSURE_ASCII | JSON_REAL_PRECISION(17))

static json_t *dims_json(const int64_t *d, uint32_t n)
{
    json_t *a = json_array();
    for (uint32_t i = 0; a != NULL && i < n; i++)
        if (json_array_append_new(a, json_integer(d[i])) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static json_t *node_json(const tdp_schema *s, uint32_t idx)
{
    const tdp__node *n = &s->nodes[idx];
    char dev[TDP_DEVICE_STRLEN];
    json_t *o = json_object(), *meta = json_object(), *leaves = json_object(),
           *nont = json_object(), *names = NULL;
    bool ok = o && meta && leaves && nont;

    if (ok && n->names != NULL) {
        names = json_array();
        for (uint32_t d = 0; names != NULL && d < n->batch_ndim; d++)
            json_array_append_new(names, n->names[d] ? json_string(n->names[d]) : json_null());
        ok = names != NULL;
    }
    ok = ok && json_object_set_new(meta, "batch_size", dims_json(n->batch, n->batch_ndim)) == 0 &&
         json_object_set_new(meta, "device",
                             n->has_device ? json_string(tdp_device_format(n->device, dev))
                                           : json_null()) == 0 &&
         json_object_set_new(meta, "names", names ? names : json_null()) == 0 &&
         json_object_set_new(meta, "is_locked", json_boolean(n->is_locked)) == 0;
    names = NULL;
    for (uint32_t i = 0; ok && i < s->nleaves; i++) {
        const tdp__leaf *l = &s->leaves[i];
        if (l->node != idx)
            continue;
        if (l->kind == TDP_LEAF_VALUE) {
            json_t *v = json_loads(l->value_json, JSON_DECODE_ANY, NULL);
            ok = v != NULL && json_object_set_new(nont, l->key, v) == 0;
            continue;
        }
        json_t *t = json_pack("[s o I I I]", tdp_dtype_name(l->dtype), dims_json(l->shape, l->ndim),
                              (json_int_t)l->offset, (json_int_t)(l->offset + l->nbytes + l->pad),
                              (json_int_t)l->pad);
        ok = t != NULL && json_object_set_new(leaves, l->key, t) == 0;
    }
    ok = ok && json_object_set_new(o, TDP_F_CLS, json_string(n->cls)) == 0 &&
         json_object_set_new(o, TDP_F_CLSMETA, meta) == 0;
    meta = NULL;
    ok = ok && json_object_set_new(o, TDP_F_LEAVES, leaves) == 0;
    leaves = NULL;
    ok = ok && json_object_set_new(o, TDP_F_NONTENS, nont) == 0;
    nont = NULL;
    for (uint32_t c = idx + 1; ok && c < s->nnodes; c++) {
        if (s->nodes[c].parent != idx)
            continue;
        ok = json_object_set_new(o, s->nodes[c].key, node_json(s, c)) == 0;
    }
    json_decref(meta);
    json_decref(leaves);
    json_decref(nont);
    if (!ok) {
        json_decref(o);
        return NULL;
    }
    return o;
}

tdp_err tdp__schema_encode(tdp_schema *s, tdp__why *w)
{
    char dev[TDP_DEVICE_STRLEN];
    json_t *top = json_pack("{s:s s:i s:I s:s s:o}", "format", TDP_SCHEMA_FORMAT_NAME, "version",
                            TDP_SCHEMA_FORMAT_VERSION, "total_bytes", (json_int_t)s->total_bytes,
                            "device", tdp_device_format(s->device, dev), "td", node_json(s, 0));
    if (top == NULL)
        return tdp__fail(w, TDP_ENOMEM, "cannot encode schema");
    char *text = json_dumps(top, DUMP_FLAGS);
    json_decref(top);
    if (text == NULL)
        return tdp__fail(w, TDP_ENOMEM, "cannot encode schema");
    tdp__free(s->json);
    s->json_len = strlen(text);
    s->json = tdp__strndup(text, s->json_len);
    free(text); /* jansson's default allocator */
    return s->json ? TDP_OK : TDP_ENOMEM;
}

char *tdp__value_dump(const void *value)
{
    char *text = json_dumps((const json_t *)value, DUMP_FLAGS | JSON_ENCODE_ANY);
    if (text == NULL)
        return NULL;
    char *out = tdp__strdup(text);
    free(text);
    return out;
}
