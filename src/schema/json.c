/*
 * json.c: the schema from its JSON form (jansson; the canonical encoding is
 * encode.c). Decoding is strict and bounded: length and nesting are checked
 * before jansson allocates anything, duplicate keys and unknown fields are
 * rejected, and the model is validated before it is returned.
 */
#include <inttypes.h>
#include <jansson.h>
#include <string.h>
#include <xxhash.h>

#include "schema_int.h"
#include "../core/alloc.h"

/* ---- decode -------------------------------------------------------------- */

/*
 * Deepest bracket nesting of the text, strings skipped. Runs before jansson
 * so that a hostile 10 000-deep document costs one pass and no allocation.
 */
static uint32_t scan_depth(const char *p, size_t len, uint32_t stop_at)
{
    uint32_t depth = 0, max = 0;
    bool in_str = false;

    for (size_t i = 0; i < len; i++) {
        char c = p[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
            continue;
        }
        if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            if (++depth > max && (max = depth) > stop_at)
                return max;
        } else if ((c == '}' || c == ']') && depth > 0) {
            depth--;
        }
    }
    return max;
}

typedef struct decoder {
    tdp_schema *s;
    const tdp_schema_limits *lim;
    tdp__why *w;
    uint32_t cap_nodes, cap_leaves;
    uint64_t count;
} decoder;

static char *join_path(const char *parent, const char *key)
{
    size_t pl = strlen(parent), kl = strlen(key);
    char *p = tdp__malloc(pl + kl + 2);
    if (p == NULL)
        return NULL;
    if (pl == 0) {
        memcpy(p, key, kl + 1);
    } else {
        memcpy(p, parent, pl);
        p[pl] = TDP_PATH_SEP;
        memcpy(p + pl + 1, key, kl + 1);
    }
    return p;
}

/* Count a key against the limit before anything is allocated for it. */
static tdp_err count_key(decoder *d, const char *where)
{
    if (++d->count > d->lim->max_keys)
        return tdp__fail(d->w, TDP_ESCHEMA, "more than %u keys (at '%s')", d->lim->max_keys,
                         where);
    return TDP_OK;
}

static tdp_err dims_from(decoder *d, json_t *arr, const char *what, const char *path,
                         uint32_t *ndim, int64_t **dims)
{
    if (!json_is_array(arr))
        return tdp__fail(d->w, TDP_ESCHEMA, "'%s': %s is not an array", path, what);
    size_t n = json_array_size(arr);
    if (n > d->lim->max_rank)
        return tdp__fail(d->w, TDP_ESCHEMA, "'%s': %s has %zu dims, limit %u", path, what, n,
                         d->lim->max_rank);
    int64_t *v = tdp__alloc_array(n, sizeof(int64_t));
    if (v == NULL)
        return TDP_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(arr, i);
        if (!json_is_integer(x)) {
            tdp__free(v);
            return tdp__fail(d->w, TDP_ESCHEMA, "'%s': %s[%zu] is not an integer", path, what,
                             i);
        }
        v[i] = json_integer_value(x);
        if (v[i] < 0) {
            tdp__free(v);
            return tdp__fail(d->w, TDP_ESCHEMA, "'%s': %s[%zu] = %" PRId64 " is negative", path,
                             what, i, (int64_t)json_integer_value(x));
        }
    }
    *ndim = (uint32_t)n;
    *dims = v;
    return TDP_OK;
}

static tdp__leaf *new_leaf(decoder *d)
{
    tdp_schema *s = d->s;
    if (s->nleaves == d->cap_leaves) {
        uint32_t cap = d->cap_leaves ? d->cap_leaves * 2 : 8;
        tdp__leaf *nl = tdp__realloc(s->leaves, (size_t)cap * sizeof(*nl));
        if (nl == NULL)
            return NULL;
        s->leaves = nl;
        d->cap_leaves = cap;
    }
    tdp__leaf *l = &s->leaves[s->nleaves++];
    memset(l, 0, sizeof(*l));
    return l;
}

static tdp_err leaf_from(decoder *d, const char *parent, const char *key, json_t *t)
{
    tdp_err rc = count_key(d, parent);
    if (rc != TDP_OK)
        return rc;
    if ((rc = tdp__check_key(key, d->lim->max_key_len, d->w, parent)) != TDP_OK)
        return rc;
    tdp__leaf *l = new_leaf(d);
    if (l == NULL)
        return TDP_ENOMEM;
    l->kind = TDP_LEAF_TENSOR;
    if ((l->key = tdp__strdup(key)) == NULL || (l->path = join_path(parent, key)) == NULL)
        return TDP_ENOMEM;
    if (!json_is_array(t) || json_array_size(t) != 5)
        return tdp__fail(d->w, TDP_ESCHEMA,
                         "leaf '%s': expected [dtype, shape, start, stop, pad]", l->path);
    json_t *dt = json_array_get(t, 0), *st = json_array_get(t, 2), *sp = json_array_get(t, 3),
           *pd = json_array_get(t, 4);
    if (!json_is_string(dt) || tdp_dtype_parse(json_string_value(dt), &l->dtype) != TDP_OK)
        return tdp__fail(d->w, TDP_ESCHEMA, "leaf '%s': unknown dtype %s%.40s%s", l->path,
                         json_is_string(dt) ? "'" : "", json_is_string(dt) ? json_string_value(dt) : "(not a string)",
                         json_is_string(dt) ? "'" : "");
    if ((rc = dims_from(d, json_array_get(t, 1), "shape", l->path, &l->ndim, &l->shape)) != TDP_OK)
        return rc;
    if (!json_is_integer(st) || !json_is_integer(sp) || !json_is_integer(pd) ||
        json_integer_value(st) < 0 || json_integer_value(sp) < 0 || json_integer_value(pd) < 0)
        return tdp__fail(d->w, TDP_ESCHEMA,
                         "leaf '%s': start, stop and pad must be non-negative integers", l->path);
    uint64_t start = (uint64_t)json_integer_value(st), stop = (uint64_t)json_integer_value(sp),
             pad = (uint64_t)json_integer_value(pd);
    if (stop < start || pad > stop - start)
        return tdp__fail(d->w, TDP_ESCHEMA,
                         "leaf '%s': stop %" PRIu64 " < start %" PRIu64 " + pad %" PRIu64,
                         l->path, stop, start, pad);
    l->offset = start;
    l->pad = pad;
    /* nbytes comes from the shape, with checked arithmetic, in validation;
     * the declared stop must then agree with it. */
    l->has_stop = true;
    l->stop = stop;
    return TDP_OK;
}

static tdp_err value_from(decoder *d, const char *parent, const char *key, json_t *v)
{
    tdp_err rc = count_key(d, parent);
    if (rc != TDP_OK)
        return rc;
    if ((rc = tdp__check_key(key, d->lim->max_key_len, d->w, parent)) != TDP_OK)
        return rc;
    tdp__leaf *l = new_leaf(d);
    if (l == NULL)
        return TDP_ENOMEM;
    l->kind = TDP_LEAF_VALUE;
    if ((l->key = tdp__strdup(key)) == NULL || (l->path = join_path(parent, key)) == NULL)
        return TDP_ENOMEM;
    if (json_is_object(v) || json_is_array(v))
        return tdp__fail(d->w, TDP_ESCHEMA, "value '%s' is not a JSON scalar", l->path);
    if (json_is_string(v) && json_string_length(v) > d->lim->max_value_bytes)
        return tdp__fail(d->w, TDP_ESCHEMA, "value '%s' is %zu bytes, limit %u", l->path,
                         json_string_length(v), d->lim->max_value_bytes);
    if ((l->value_json = tdp__value_dump(v)) == NULL)
        return TDP_ENOMEM;
    return TDP_OK;
}

static tdp_err meta_from(decoder *d, tdp__node *n, json_t *meta)
{
    const char *where = n->path[0] ? n->path : "<root>";
    const char *k;
    json_t *v;
    tdp_err rc;

    if (!json_is_object(meta))
        return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': cls_metadata is not an object", where);
    json_object_foreach(meta, k, v)
    {
        if (strcmp(k, "batch_size") == 0) {
            if ((rc = dims_from(d, v, "batch_size", where, &n->batch_ndim, &n->batch)) != TDP_OK)
                return rc;
        } else if (strcmp(k, "device") == 0) {
            if (json_is_null(v))
                continue;
            if (!json_is_string(v) || tdp_device_parse(json_string_value(v), &n->device) != TDP_OK)
                return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': device is not cpu or cuda:N",
                                 where);
            n->has_device = true;
        } else if (strcmp(k, "is_locked") == 0) {
            if (!json_is_boolean(v))
                return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': is_locked is not a boolean",
                                 where);
            n->is_locked = json_is_true(v);
        } else if (strcmp(k, "names") != 0) {
            return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': unknown cls_metadata field '%.64s'",
                             where, k);
        }
    }
    if (json_object_get(meta, "batch_size") == NULL)
        return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': cls_metadata has no batch_size", where);
    json_t *names = json_object_get(meta, "names");
    if (names == NULL || json_is_null(names))
        return TDP_OK;
    if (!json_is_array(names) || json_array_size(names) != n->batch_ndim)
        return tdp__fail(d->w, TDP_ESCHEMA,
                         "node '%s': names must be null or one entry per batch dim", where);
    if ((n->names = tdp__alloc_array(n->batch_ndim, sizeof(char *))) == NULL)
        return TDP_ENOMEM;
    for (uint32_t i = 0; i < n->batch_ndim; i++) {
        json_t *x = json_array_get(names, i);
        if (json_is_null(x))
            continue;
        if (!json_is_string(x) || json_string_length(x) > d->lim->max_key_len ||
            json_string_length(x) != strlen(json_string_value(x)))
            return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': names[%u] is not a short string",
                             where, i);
        if ((n->names[i] = tdp__strdup(json_string_value(x))) == NULL)
            return TDP_ENOMEM;
    }
    return TDP_OK;
}

static tdp_err node_from(decoder *d, const char *parent, const char *key, json_t *o,
                         uint32_t depth)
{
    tdp_schema *s = d->s;
    tdp_err rc;
    const char *k;
    json_t *v;

    if (!json_is_object(o))
        return tdp__fail(d->w, TDP_ESCHEMA, "'%s%s%s' is not an object", parent,
                         parent[0] && key ? "." : "", key ? key : "td");
    if (depth > d->lim->max_depth)
        return tdp__fail(d->w, TDP_ESCHEMA, "node under '%s' is nested deeper than %u", parent,
                         d->lim->max_depth);
    if (key != NULL) {
        if ((rc = count_key(d, parent)) != TDP_OK ||
            (rc = tdp__check_key(key, d->lim->max_key_len, d->w, parent)) != TDP_OK)
            return rc;
    }
    if (s->nnodes == d->cap_nodes) {
        uint32_t cap = d->cap_nodes ? d->cap_nodes * 2 : 8;
        tdp__node *nn = tdp__realloc(s->nodes, (size_t)cap * sizeof(*nn));
        if (nn == NULL)
            return TDP_ENOMEM;
        s->nodes = nn;
        d->cap_nodes = cap;
    }
    uint32_t idx = s->nnodes++;
    tdp__node *n = &s->nodes[idx];
    memset(n, 0, sizeof(*n));
    n->parent = TDP_NO_PARENT;
    if (key != NULL && (n->key = tdp__strdup(key)) == NULL)
        return TDP_ENOMEM;
    if ((n->path = key ? join_path(parent, key) : tdp__strdup("")) == NULL)
        return TDP_ENOMEM;
    const char *where = key ? n->path : "<root>";
    char *path = n->path; /* n moves if the node array grows: keep the path */

    json_t *cls = json_object_get(o, TDP_F_CLS);
    if (!json_is_string(cls) || json_string_length(cls) != strlen(json_string_value(cls)))
        return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': cls is missing or not a string", where);
    if (json_string_length(cls) > d->lim->max_value_bytes)
        return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': class name over %u bytes", where,
                         d->lim->max_value_bytes);
    if ((n->cls = tdp__strdup(json_string_value(cls))) == NULL)
        return TDP_ENOMEM;
    if ((rc = meta_from(d, n, json_object_get(o, TDP_F_CLSMETA))) != TDP_OK)
        return rc;

    json_object_foreach(o, k, v)
    {
        if (strcmp(k, TDP_F_CLS) == 0 || strcmp(k, TDP_F_CLSMETA) == 0)
            continue;
        if (strcmp(k, TDP_F_LEAVES) == 0 || strcmp(k, TDP_F_NONTENS) == 0) {
            bool tensors = k[0] == 'l';
            const char *lk;
            json_t *lv;
            if (!json_is_object(v))
                return tdp__fail(d->w, TDP_ESCHEMA, "node '%s': %s is not an object", where, k);
            json_object_foreach(v, lk, lv)
            {
                rc = tensors ? leaf_from(d, path, lk, lv) : value_from(d, path, lk, lv);
                if (rc != TDP_OK)
                    return rc;
            }
            continue;
        }
        if ((rc = node_from(d, path, k, v, depth + 1)) != TDP_OK)
            return rc;
    }
    return TDP_OK;
}

tdp_err tdp_schema_decode(const void *json, size_t len, const tdp_schema_limits *limits,
                          tdp_schema **out, char *why, size_t why_len)
{
    tdp_schema_limits lim;
    tdp__why w = {why, why_len};
    json_error_t jerr;
    tdp_err rc;

    if (why != NULL && why_len > 0)
        why[0] = '\0';
    if (json == NULL || out == NULL)
        return tdp__fail(&w, TDP_EINVAL, "null argument");
    tdp__limits_resolve(limits, &lim);
    if (len > lim.max_json_bytes)
        return tdp__fail(&w, TDP_EMSGSIZE, "schema JSON is %zu bytes, limit %" PRIu64, len,
                         lim.max_json_bytes);
    /* top object + td node + nested nodes + leaves object, tuple and shape */
    uint32_t max_nest = lim.max_depth > UINT32_MAX - 5 ? UINT32_MAX : lim.max_depth + 5;
    uint32_t nest = scan_depth(json, len, max_nest);
    if (nest > max_nest)
        return tdp__fail(&w, TDP_ESCHEMA, "JSON nested more than %u levels", max_nest);

    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return tdp__fail(&w, TDP_ESCHEMA, "JSON error at line %d column %d: %s", jerr.line,
                         jerr.column, jerr.text);

    tdp_schema *s = tdp__schema_alloc();
    decoder d = {.s = s, .lim = &lim, .w = &w};
    if (s == NULL) {
        json_decref(root);
        return TDP_ENOMEM;
    }
    const char *k;
    json_t *v;
    if (!json_is_object(root)) {
        rc = tdp__fail(&w, TDP_ESCHEMA, "schema is not a JSON object");
        goto err_free;
    }
    json_object_foreach(root, k, v)
    {
        if (strcmp(k, "format") && strcmp(k, "version") && strcmp(k, "total_bytes") &&
            strcmp(k, "device") && strcmp(k, "td")) {
            rc = tdp__fail(&w, TDP_ESCHEMA, "unknown top-level field '%.64s'", k);
            goto err_free;
        }
    }
    json_t *fmt = json_object_get(root, "format"), *ver = json_object_get(root, "version"),
           *tot = json_object_get(root, "total_bytes"), *dev = json_object_get(root, "device");
    if (!json_is_string(fmt) || strcmp(json_string_value(fmt), TDP_SCHEMA_FORMAT_NAME) != 0) {
        rc = tdp__fail(&w, TDP_ESCHEMA, "format is not \"" TDP_SCHEMA_FORMAT_NAME "\"");
        goto err_free;
    }
    if (!json_is_integer(ver) || json_integer_value(ver) != TDP_SCHEMA_FORMAT_VERSION) {
        rc = tdp__fail(&w, TDP_ESCHEMA, "unsupported schema version (this library reads %d)",
                       TDP_SCHEMA_FORMAT_VERSION);
        goto err_free;
    }
    if (!json_is_integer(tot) || json_integer_value(tot) < 0) {
        rc = tdp__fail(&w, TDP_ESCHEMA, "total_bytes is not a non-negative integer");
        goto err_free;
    }
    s->total_bytes = (uint64_t)json_integer_value(tot);
    if (s->total_bytes > lim.max_total_bytes) {
        rc = tdp__fail(&w, TDP_EMSGSIZE, "total_bytes %" PRIu64 " over the limit %" PRIu64,
                       s->total_bytes, lim.max_total_bytes);
        goto err_free;
    }
    if (!json_is_string(dev) || tdp_device_parse(json_string_value(dev), &s->device) != TDP_OK) {
        rc = tdp__fail(&w, TDP_ESCHEMA, "device is not cpu or cuda:N");
        goto err_free;
    }
    if ((rc = node_from(&d, "", NULL, json_object_get(root, "td"), 0)) != TDP_OK)
        goto err_free;
    json_decref(root);
    root = NULL;

    if ((rc = tdp__schema_finalize(s, &lim, &w)) != TDP_OK)
        goto err_free;
    *out = s;
    return TDP_OK;

err_free:
    json_decref(root);
    tdp_schema_unref(s);
    return rc;
}

tdp_err tdp_schema_with_device(const tdp_schema *s, tdp_device dev, tdp_schema **out)
{
    tdp_schema_limits lim = {
        .size = sizeof(lim),
        .max_json_bytes = UINT64_MAX,
        .max_depth = UINT32_MAX - 8,
        .max_keys = UINT32_MAX,
        .max_key_len = UINT32_MAX,
        .max_rank = TDP_MAX_RANK,
        .max_value_bytes = UINT32_MAX,
        .max_total_bytes = UINT64_MAX,
    };
    tdp_schema *c;
    tdp_err rc;

    if (s == NULL || out == NULL || (dev.type != TDP_DEVICE_CPU && dev.type != TDP_DEVICE_CUDA))
        return TDP_EINVAL;
    if ((rc = tdp_schema_decode(s->json, s->json_len, &lim, &c, NULL, 0)) != TDP_OK)
        return rc;
    for (uint32_t i = 0; i < c->nnodes; i++)
        if (c->nodes[i].has_device && tdp_device_equal(c->nodes[i].device, s->device))
            c->nodes[i].device = dev;
    c->device = dev;
    if ((rc = tdp__schema_encode(c, NULL)) != TDP_OK) {
        tdp_schema_unref(c);
        return rc;
    }
    c->hash = XXH3_64bits(c->json, c->json_len);
    *out = c;
    return TDP_OK;
}
