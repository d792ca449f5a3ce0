/* builder.c: declare nodes and leaves by path, then lay out and finish. */
#include <inttypes.h>
#include <jansson.h>
#include <string.h>

#include "schema_int.h"
#include "../core/alloc.h"

typedef struct b_node {
    char *path;
    char *cls;
    uint32_t batch_ndim;
    int64_t batch[TDP_MAX_RANK];
} b_node;

typedef struct b_leaf {
    char *path;
    tdp_leaf_kind kind;
    tdp_dtype dtype;
    uint32_t ndim;
    int64_t shape[TDP_MAX_RANK];
    char *value_json;
} b_leaf;

struct tdp_schema_builder {
    tdp_device device;
    b_node *nodes;
    uint32_t nnodes, cap_nodes;
    b_leaf *leaves;
    uint32_t nleaves, cap_leaves;
};

static bool grow(void **arr, uint32_t *cap, uint32_t n, size_t elem)
{
    if (n < *cap)
        return true;
    uint32_t c = *cap ? *cap * 2 : 8;
    void *p = tdp__realloc(*arr, (size_t)c * elem);
    if (p == NULL)
        return false;
    *arr = p;
    *cap = c;
    return true;
}

static int64_t find_node(const tdp_schema_builder *b, const char *path, size_t len)
{
    for (uint32_t i = 0; i < b->nnodes; i++)
        if (strlen(b->nodes[i].path) == len && strncmp(b->nodes[i].path, path, len) == 0)
            return i;
    return -1;
}

static int64_t find_leaf(const tdp_schema_builder *b, const char *path, size_t len)
{
    for (uint32_t i = 0; i < b->nleaves; i++)
        if (strlen(b->leaves[i].path) == len && strncmp(b->leaves[i].path, path, len) == 0)
            return i;
    return -1;
}

tdp_err tdp_schema_builder_new(tdp_schema_builder **out)
{
    if (out == NULL)
        return TDP_EINVAL;
    tdp_schema_builder *b = tdp__calloc(1, sizeof(*b));
    if (b == NULL)
        return TDP_ENOMEM;
    b->device = TDP_DEVICE_CPU_INIT;
    if (!grow((void **)&b->nodes, &b->cap_nodes, 0, sizeof(b_node)) ||
        (b->nodes[0] = (b_node){.path = tdp__strdup(""), .cls = tdp__strdup("TensorDict")},
         b->nodes[0].path == NULL || b->nodes[0].cls == NULL)) {
        b->nnodes = b->nodes ? 1 : 0;
        tdp_schema_builder_free(b);
        return TDP_ENOMEM;
    }
    b->nnodes = 1;
    *out = b;
    return TDP_OK;
}

void tdp_schema_builder_free(tdp_schema_builder *b)
{
    if (b == NULL)
        return;
    for (uint32_t i = 0; i < b->nnodes; i++) {
        tdp__free(b->nodes[i].path);
        tdp__free(b->nodes[i].cls);
    }
    for (uint32_t i = 0; i < b->nleaves; i++) {
        tdp__free(b->leaves[i].path);
        tdp__free(b->leaves[i].value_json);
    }
    tdp__free(b->nodes);
    tdp__free(b->leaves);
    tdp__free(b);
}

tdp_err tdp_schema_builder_set_device(tdp_schema_builder *b, tdp_device dev)
{
    if (b == NULL || (dev.type != TDP_DEVICE_CPU && dev.type != TDP_DEVICE_CUDA) || dev.index < 0)
        return TDP_EINVAL;
    b->device = dev;
    return TDP_OK;
}

/* Path syntax: components of 1..255 bytes, no control characters. */
static bool path_ok(const char *path, bool allow_root)
{
    if (path == NULL)
        return false;
    if (path[0] == '\0')
        return allow_root;
    const char *p = path;
    for (;;) {
        const char *dot = strchr(p, TDP_PATH_SEP);
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        if (n == 0 || n > TDP_SCHEMA_DEFAULT_MAX_KEY_LEN)
            return false;
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)p[i] < 0x20 || p[i] == 0x7f)
                return false;
        if (dot == NULL)
            return true;
        p = dot + 1;
    }
}

/* Make sure every node on the way to `len` bytes of path exists. */
static tdp_err ensure_nodes(tdp_schema_builder *b, const char *path, size_t len)
{
    for (size_t i = 0; i <= len; i++) {
        if (i < len && path[i] != TDP_PATH_SEP)
            continue;
        if (find_node(b, path, i) >= 0)
            continue;
        if (find_leaf(b, path, i) >= 0)
            return TDP_EINVAL; /* a leaf is in the way */
        if (!grow((void **)&b->nodes, &b->cap_nodes, b->nnodes, sizeof(b_node)))
            return TDP_ENOMEM;
        /* a created parent inherits its own parent's batch size */
        size_t pl = i;
        while (pl > 0 && path[pl - 1] != TDP_PATH_SEP)
            pl--;
        int64_t up = find_node(b, path, pl > 0 ? pl - 1 : 0);
        b_node *n = &b->nodes[b->nnodes];
        *n = (b_node){.path = tdp__strndup(path, i), .cls = tdp__strdup("TensorDict")};
        if (up >= 0) {
            n->batch_ndim = b->nodes[up].batch_ndim;
            memcpy(n->batch, b->nodes[up].batch, sizeof(n->batch));
        }
        if (n->path == NULL || n->cls == NULL) {
            tdp__free(n->path);
            tdp__free(n->cls);
            return TDP_ENOMEM;
        }
        b->nnodes++;
    }
    return TDP_OK;
}

tdp_err tdp_schema_builder_node(tdp_schema_builder *b, const char *path, const char *cls,
                                uint32_t batch_ndim, const int64_t *batch_size)
{
    if (b == NULL || !path_ok(path, true) || batch_ndim > TDP_MAX_RANK ||
        (batch_ndim > 0 && batch_size == NULL) || (cls != NULL && cls[0] == '\0'))
        return TDP_EINVAL;
    if (find_leaf(b, path, strlen(path)) >= 0)
        return TDP_EINVAL;
    tdp_err rc = ensure_nodes(b, path, strlen(path));
    if (rc != TDP_OK)
        return rc;
    b_node *n = &b->nodes[find_node(b, path, strlen(path))];
    if (cls != NULL) {
        char *c = tdp__strdup(cls);
        if (c == NULL)
            return TDP_ENOMEM;
        tdp__free(n->cls);
        n->cls = c;
    }
    n->batch_ndim = batch_ndim;
    if (batch_ndim > 0)
        memcpy(n->batch, batch_size, batch_ndim * sizeof(int64_t));
    return TDP_OK;
}

static tdp_err add_leaf(tdp_schema_builder *b, const char *path, b_leaf *proto)
{
    if (b == NULL || !path_ok(path, false))
        return TDP_EINVAL;
    size_t len = strlen(path);
    if (find_leaf(b, path, len) >= 0 || find_node(b, path, len) >= 0)
        return TDP_EINVAL;
    const char *dot = strrchr(path, TDP_PATH_SEP);
    tdp_err rc = ensure_nodes(b, path, dot ? (size_t)(dot - path) : 0);
    if (rc != TDP_OK)
        return rc;
    if (!grow((void **)&b->leaves, &b->cap_leaves, b->nleaves, sizeof(b_leaf)))
        return TDP_ENOMEM;
    if ((proto->path = tdp__strdup(path)) == NULL)
        return TDP_ENOMEM;
    b->leaves[b->nleaves++] = *proto;
    return TDP_OK;
}

tdp_err tdp_schema_builder_tensor(tdp_schema_builder *b, const char *path, tdp_dtype dtype,
                                  uint32_t ndim, const int64_t *shape)
{
    b_leaf l = {.kind = TDP_LEAF_TENSOR, .dtype = dtype, .ndim = ndim};
    if (tdp_dtype_itemsize(dtype) == 0 || ndim > TDP_MAX_RANK || (ndim > 0 && shape == NULL))
        return TDP_EINVAL;
    for (uint32_t i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return TDP_EINVAL;
        l.shape[i] = shape[i];
    }
    return add_leaf(b, path, &l);
}

tdp_err tdp_schema_builder_value(tdp_schema_builder *b, const char *path, const char *json_value)
{
    if (json_value == NULL)
        return TDP_EINVAL;
    json_t *v = json_loads(json_value, JSON_DECODE_ANY, NULL);
    if (v == NULL || json_is_object(v) || json_is_array(v)) {
        json_decref(v);
        return TDP_EINVAL;
    }
    b_leaf l = {.kind = TDP_LEAF_VALUE, .value_json = tdp__value_dump(v)};
    json_decref(v);
    if (l.value_json == NULL)
        return TDP_ENOMEM;
    tdp_err rc = add_leaf(b, path, &l);
    if (rc != TDP_OK)
        tdp__free(l.value_json);
    return rc;
}

tdp_err tdp_schema_builder_string(tdp_schema_builder *b, const char *path, const char *value)
{
    if (value == NULL)
        return TDP_EINVAL;
    json_t *v = json_string(value); /* NULL for invalid UTF-8 */
    if (v == NULL)
        return TDP_EINVAL;
    char *text = tdp__value_dump(v);
    json_decref(v);
    if (text == NULL)
        return TDP_ENOMEM;
    tdp_err rc = tdp_schema_builder_value(b, path, text);
    tdp__free(text);
    return rc;
}

tdp_err tdp_schema_builder_int(tdp_schema_builder *b, const char *path, int64_t value)
{
    char text[32];
    snprintf(text, sizeof(text), "%" PRId64, value);
    return tdp_schema_builder_value(b, path, text);
}

static const char *last_key(const char *path)
{
    const char *dot = strrchr(path, TDP_PATH_SEP);
    return dot ? dot + 1 : path;
}

tdp_err tdp_schema_builder_finish(tdp_schema_builder *b, tdp_schema **out, char *why,
                                  size_t why_len)
{
    tdp__why w = {why, why_len};
    tdp_schema_limits lim;
    tdp_err rc = TDP_ENOMEM;

    if (why != NULL && why_len > 0)
        why[0] = '\0';
    if (b == NULL || out == NULL)
        return TDP_EINVAL;
    tdp__limits_resolve(NULL, &lim);
    tdp_schema *s = tdp__schema_alloc();
    if (s == NULL)
        return TDP_ENOMEM;
    s->device = b->device;
    s->nodes = tdp__alloc_array(b->nnodes, sizeof(tdp__node));
    s->leaves = tdp__alloc_array(b->nleaves, sizeof(tdp__leaf));
    if (s->nodes == NULL || s->leaves == NULL)
        goto err_unref;
    for (uint32_t i = 0; i < b->nnodes; i++, s->nnodes++) {
        const b_node *bn = &b->nodes[i];
        tdp__node *n = &s->nodes[i];
        n->parent = TDP_NO_PARENT;
        n->has_device = true;
        n->device = b->device;
        n->batch_ndim = bn->batch_ndim;
        if ((n->path = tdp__strdup(bn->path)) == NULL || (n->cls = tdp__strdup(bn->cls)) == NULL ||
            (n->batch = tdp__alloc_array(bn->batch_ndim, sizeof(int64_t))) == NULL ||
            (i > 0 && (n->key = tdp__strdup(last_key(bn->path))) == NULL)) {
            s->nnodes++;
            goto err_unref;
        }
        memcpy(n->batch, bn->batch, bn->batch_ndim * sizeof(int64_t));
    }

    /* Layout: declaration order, each tensor aligned to TDP_LEAF_ALIGN. */
    uint64_t off = 0;
    tdp__leaf *prev = NULL;
    for (uint32_t i = 0; i < b->nleaves; i++, s->nleaves++) {
        const b_leaf *bl = &b->leaves[i];
        tdp__leaf *l = &s->leaves[i];
        l->kind = bl->kind;
        l->dtype = bl->dtype;
        l->ndim = bl->ndim;
        if ((l->path = tdp__strdup(bl->path)) == NULL ||
            (l->key = tdp__strdup(last_key(bl->path))) == NULL) {
            s->nleaves++;
            goto err_unref;
        }
        if (bl->kind == TDP_LEAF_VALUE) {
            if ((l->value_json = tdp__strdup(bl->value_json)) == NULL) {
                s->nleaves++;
                goto err_unref;
            }
            continue;
        }
        if ((l->shape = tdp__alloc_array(bl->ndim, sizeof(int64_t))) == NULL) {
            s->nleaves++;
            goto err_unref;
        }
        memcpy(l->shape, bl->shape, bl->ndim * sizeof(int64_t));
        uint64_t nbytes = tdp_dtype_itemsize(bl->dtype);
        for (uint32_t d = 0; d < bl->ndim; d++) {
            if (tdp__mul_ovf(nbytes, (uint64_t)bl->shape[d], &nbytes)) {
                s->nleaves++;
                rc = tdp__fail(&w, TDP_ESCHEMA, "leaf '%s': byte size overflows 64 bits",
                               bl->path);
                goto err_unref;
            }
        }
        if (prev != NULL)
            prev->pad = off - (prev->offset + prev->nbytes);
        l->offset = off;
        l->nbytes = nbytes;
        if (nbytes > UINT64_MAX - off - TDP_LEAF_ALIGN) {
            s->nleaves++;
            rc = tdp__fail(&w, TDP_ESCHEMA, "leaf '%s': buffer size overflows 64 bits", bl->path);
            goto err_unref;
        }
        off = (off + nbytes + TDP_LEAF_ALIGN - 1) & ~(uint64_t)(TDP_LEAF_ALIGN - 1);
        prev = l;
    }
    if (prev != NULL)
        prev->pad = off - (prev->offset + prev->nbytes);
    s->total_bytes = off;

    if ((rc = tdp__schema_finalize(s, &lim, &w)) != TDP_OK)
        goto err_unref;
    *out = s;
    return TDP_OK;

err_unref:
    tdp_schema_unref(s);
    return rc;
}
