/* schema.c: the schema model — ordering, validation, queries, printing. */
#include "schema_int.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "../core/alloc.h"
#include "../core/log.h"

void tdp_schema_limits_default(tdp_schema_limits *out)
{
    if (out == NULL)
        return;
    *out = (tdp_schema_limits){
        .size = sizeof(tdp_schema_limits),
        .max_json_bytes = TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES,
        .max_depth = TDP_SCHEMA_DEFAULT_MAX_DEPTH,
        .max_keys = TDP_SCHEMA_DEFAULT_MAX_KEYS,
        .max_key_len = TDP_SCHEMA_DEFAULT_MAX_KEY_LEN,
        .max_rank = TDP_SCHEMA_DEFAULT_MAX_RANK,
        .max_value_bytes = TDP_SCHEMA_DEFAULT_MAX_VALUE_BYTES,
        .max_total_bytes = TDP_SCHEMA_DEFAULT_MAX_TOTAL_BYTES,
    };
}

void tdp__limits_resolve(const tdp_schema_limits *in, tdp_schema_limits *out)
{
    tdp_schema_limits_default(out);
    if (in == NULL)
        return;
    size_t n = in->size < sizeof(*in) ? in->size : sizeof(*in);
#define TAKE(f)                                                                                    \
    if (offsetof(tdp_schema_limits, f) + sizeof(in->f) <= n && in->f != 0)                         \
        out->f = in->f;
    TAKE(max_json_bytes)
    TAKE(max_depth)
    TAKE(max_keys)
    TAKE(max_key_len)
    TAKE(max_rank)
    TAKE(max_value_bytes)
    TAKE(max_total_bytes)
#undef TAKE
    if (out->max_rank > TDP_MAX_RANK)
        out->max_rank = TDP_MAX_RANK;
}

tdp_err tdp__check_key(const char *key, size_t max_len, tdp__why *w, const char *where)
{
    size_t n = strlen(key);
    if (n == 0)
        return tdp__fail(w, TDP_ESCHEMA, "empty key under '%s'", where);
    if (n > max_len)
        return tdp__fail(w, TDP_ESCHEMA, "key '%.40s...' under '%s' is %zu bytes, limit %zu", key,
                         where, n, max_len);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)key[i];
        if (c == TDP_PATH_SEP)
            return tdp__fail(w, TDP_ESCHEMA, "key '%s' under '%s' contains the path separator '.'",
                             key, where);
        if (c < 0x20 || c == 0x7f)
            return tdp__fail(w, TDP_ESCHEMA,
                             "key under '%s' contains control character 0x%02x", where, c);
    }
    return TDP_OK;
}

int tdp__path_cmp(const char *a, const char *b)
{
    /* '.' sorts below every key byte, so "a" < "a.b" < "a-c" (pre-order). */
    for (;; a++, b++) {
        unsigned ca = (unsigned char)*a, cb = (unsigned char)*b;
        if (ca == TDP_PATH_SEP)
            ca = 1;
        if (cb == TDP_PATH_SEP)
            cb = 1;
        if (ca != cb)
            return ca < cb ? -1 : 1;
        if (ca == 0)
            return 0;
    }
}

tdp_schema *tdp__schema_alloc(void)
{
    tdp_schema *s = tdp__calloc(1, sizeof(*s));
    if (s != NULL)
        atomic_init(&s->refs, 1);
    return s;
}

static void schema_destroy(tdp_schema *s)
{
    for (uint32_t i = 0; i < s->nnodes; i++) {
        tdp__node *n = &s->nodes[i];
        tdp__free(n->key);
        tdp__free(n->path);
        tdp__free(n->cls);
        tdp__free(n->batch);
        if (n->names != NULL) {
            for (uint32_t d = 0; d < n->batch_ndim; d++)
                tdp__free(n->names[d]);
            tdp__free(n->names);
        }
    }
    for (uint32_t i = 0; i < s->nleaves; i++) {
        tdp__leaf *l = &s->leaves[i];
        tdp__free(l->key);
        tdp__free(l->path);
        tdp__free(l->shape);
        tdp__free(l->strides);
        tdp__free(l->value_json);
    }
    tdp__free(s->nodes);
    tdp__free(s->leaves);
    tdp__free(s->json);
    tdp__free(s);
}

tdp_schema *tdp_schema_ref(tdp_schema *s)
{
    if (s != NULL)
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
    return s;
}

void tdp_schema_unref(tdp_schema *s)
{
    if (s == NULL)
        return;
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1)
        schema_destroy(s);
}

/* ---- ordering ------------------------------------------------------------ */

static int node_cmp(const void *a, const void *b)
{
    return tdp__path_cmp(((const tdp__node *)a)->path, ((const tdp__node *)b)->path);
}

/* End of a tensor leaf's range, padding included (decoded: the declared stop). */
static uint64_t leaf_end(const tdp__leaf *l)
{
    return l->has_stop ? l->stop : l->offset + l->nbytes + l->pad;
}

static int leaf_cmp(const void *pa, const void *pb)
{
    const tdp__leaf *a = pa, *b = pb;
    if (a->kind != b->kind)
        return a->kind == TDP_LEAF_TENSOR ? -1 : 1;
    if (a->kind == TDP_LEAF_TENSOR && a->offset != b->offset)
        return a->offset < b->offset ? -1 : 1;
    /* an empty leaf shares its offset with the next one: it goes first */
    if (a->kind == TDP_LEAF_TENSOR && leaf_end(a) != leaf_end(b))
        return leaf_end(a) < leaf_end(b) ? -1 : 1;
    return tdp__path_cmp(a->path, b->path);
}

static int str_ptr_cmp(const void *a, const void *b)
{
    return tdp__path_cmp(*(char *const *)a, *(char *const *)b);
}

/* Compare the first `alen` bytes of a, as a whole path, with path b. */
static int path_cmp_n(const char *a, size_t alen, const char *b)
{
    for (size_t i = 0;; i++, b++) {
        unsigned ca = i < alen ? (unsigned char)a[i] : 0, cb = (unsigned char)*b;
        if (ca == TDP_PATH_SEP)
            ca = 1;
        if (cb == TDP_PATH_SEP)
            cb = 1;
        if (ca != cb)
            return ca < cb ? -1 : 1;
        if (ca == 0)
            return 0;
    }
}

/* Index of the node whose path is `path` minus its last component. */
static uint32_t find_parent(const tdp_schema *s, const char *path)
{
    const char *dot = strrchr(path, TDP_PATH_SEP);
    size_t plen = dot ? (size_t)(dot - path) : 0;
    uint32_t lo = 0, hi = s->nnodes;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = path_cmp_n(path, plen, s->nodes[mid].path);
        if (c == 0)
            return mid;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return TDP_NO_PARENT;
}

/*
 * Sort nodes pre-order and leaves canonically; fix up parent/node indices.
 * Parents are found by path, so callers need not fill them in any order.
 */
static tdp_err schema_order(tdp_schema *s, tdp__why *w)
{
    /* a decoded schema without leaves has leaves == NULL: qsort must not see it */
    if (s->nnodes > 1)
        qsort(s->nodes, s->nnodes, sizeof(*s->nodes), node_cmp);
    if (s->nleaves > 1)
        qsort(s->leaves, s->nleaves, sizeof(*s->leaves), leaf_cmp);

    if (s->nnodes == 0 || s->nodes[0].path[0] != '\0')
        return tdp__fail(w, TDP_ESCHEMA, "schema has no root node");
    for (uint32_t i = 0; i < s->nnodes; i++) {
        s->nodes[i].num_children = 0;
        s->nodes[i].num_leaves = 0;
    }
    /* Parent of each node and leaf: binary search of its path's prefix. */
    for (uint32_t i = 1; i < s->nnodes; i++) {
        tdp__node *n = &s->nodes[i];
        if (strcmp(n->path, s->nodes[i - 1].path) == 0)
            return tdp__fail(w, TDP_ESCHEMA, "duplicate node '%s'", n->path);
        uint32_t p = find_parent(s, n->path);
        if (p == TDP_NO_PARENT || p >= i)
            return tdp__fail(w, TDP_ESCHEMA, "node '%s' has no parent", n->path);
        n->parent = p;
        n->depth = s->nodes[p].depth + 1;
        s->nodes[p].num_children++;
    }
    s->ntensors = 0;
    for (uint32_t i = 0; i < s->nleaves; i++) {
        tdp__leaf *l = &s->leaves[i];
        uint32_t p = find_parent(s, l->path);
        if (p == TDP_NO_PARENT)
            return tdp__fail(w, TDP_ESCHEMA, "leaf '%s' has no parent node", l->path);
        l->node = p;
        s->nodes[p].num_leaves++;
        if (l->kind == TDP_LEAF_TENSOR)
            s->ntensors++;
    }
    return TDP_OK;
}

/* Every path names one thing: no two leaves, nor a leaf and a node, share one. */
static tdp_err check_unique_paths(const tdp_schema *s, tdp__why *w)
{
    size_t n = (size_t)s->nnodes + s->nleaves;
    const char **paths = tdp__alloc_array(n, sizeof(*paths));
    tdp_err rc = TDP_OK;

    if (paths == NULL)
        return TDP_ENOMEM;
    for (uint32_t i = 0; i < s->nnodes; i++)
        paths[i] = s->nodes[i].path;
    for (uint32_t i = 0; i < s->nleaves; i++)
        paths[s->nnodes + i] = s->leaves[i].path;
    qsort(paths, n, sizeof(*paths), str_ptr_cmp);
    for (size_t i = 1; i < n; i++) {
        if (strcmp(paths[i], paths[i - 1]) == 0) {
            rc = tdp__fail(w, TDP_ESCHEMA, "key '%s' is defined twice", paths[i]);
            break;
        }
    }
    tdp__free(paths);
    return rc;
}

static bool has_prefix(const int64_t *shape, uint32_t ndim, const int64_t *prefix, uint32_t pn)
{
    if (pn > ndim)
        return false;
    for (uint32_t i = 0; i < pn; i++)
        if (shape[i] != prefix[i])
            return false;
    return true;
}

/* Dims for a message: "[32, 84]"; "[32, 84, ...]" when they do not fit (len >= 16). */
static const char *fmt_dims(const int64_t *d, uint32_t n, char *buf, size_t len)
{
    size_t used = (size_t)snprintf(buf, len, "[");
    for (uint32_t i = 0; i < n; i++) {
        char one[32];
        int w = snprintf(one, sizeof(one), "%s%" PRId64, i ? ", " : "", d[i]);
        if (used + (size_t)w + sizeof(", ...]") > len) { /* keep room for the ellipsis */
            snprintf(buf + used, len - used, "%s...]", i ? ", " : "");
            return buf;
        }
        memcpy(buf + used, one, (size_t)w + 1);
        used += (size_t)w;
    }
    snprintf(buf + used, len - used, "]");
    return buf;
}

static tdp_err validate_nodes(const tdp_schema *s, const tdp_schema_limits *lim, tdp__why *w)
{
    for (uint32_t i = 0; i < s->nnodes; i++) {
        const tdp__node *n = &s->nodes[i];
        const char *where = i == 0 ? "<root>" : n->path;
        if (n->depth > lim->max_depth)
            return tdp__fail(w, TDP_ESCHEMA, "node '%s' is nested %u deep, limit %u", where,
                             n->depth, lim->max_depth);
        if (i > 0) {
            tdp_err rc = tdp__check_key(n->key, lim->max_key_len, w, s->nodes[n->parent].path);
            if (rc != TDP_OK)
                return rc;
            if (!strcmp(n->key, TDP_F_CLS) || !strcmp(n->key, TDP_F_CLSMETA) ||
                !strcmp(n->key, TDP_F_LEAVES) || !strcmp(n->key, TDP_F_NONTENS))
                return tdp__fail(w, TDP_ESCHEMA,
                                 "sub-dict key '%s' collides with a reserved field name", where);
        }
        size_t cl = strlen(n->cls);
        if (cl == 0 || cl > lim->max_value_bytes)
            return tdp__fail(w, TDP_ESCHEMA, "node '%s': class name length %zu not in 1..%u",
                             where, cl, lim->max_value_bytes);
        if (n->batch_ndim > lim->max_rank)
            return tdp__fail(w, TDP_ESCHEMA, "node '%s': batch_size has %u dims, limit %u", where,
                             n->batch_ndim, lim->max_rank);
        for (uint32_t d = 0; d < n->batch_ndim; d++)
            if (n->batch[d] < 0)
                return tdp__fail(w, TDP_ESCHEMA, "node '%s': batch_size[%u] = %" PRId64 " < 0",
                                 where, d, n->batch[d]);
        if (i > 0) {
            const tdp__node *p = &s->nodes[n->parent];
            char mine[64], theirs[64];
            if (!has_prefix(n->batch, n->batch_ndim, p->batch, p->batch_ndim))
                return tdp__fail(w, TDP_ESCHEMA,
                                 "node '%s': batch_size %s does not start with the batch_size "
                                 "%s of its parent '%s'",
                                 where, fmt_dims(n->batch, n->batch_ndim, mine, sizeof(mine)),
                                 fmt_dims(p->batch, p->batch_ndim, theirs, sizeof(theirs)),
                                 n->parent == 0 ? "<root>" : p->path);
        }
    }
    return TDP_OK;
}

static tdp_err validate_leaves(tdp_schema *s, const tdp_schema_limits *lim, tdp__why *w)
{
    uint64_t total = s->total_bytes;
    uint64_t prev_stop = 0;
    const char *prev = NULL;

    if (total > lim->max_total_bytes)
        return tdp__fail(w, TDP_EMSGSIZE, "total_bytes %" PRIu64 " over the limit %" PRIu64,
                         total, lim->max_total_bytes);
    for (uint32_t i = 0; i < s->nleaves; i++) {
        tdp__leaf *l = &s->leaves[i];
        const tdp__node *n = &s->nodes[l->node];
        tdp_err rc = tdp__check_key(l->key, lim->max_key_len, w, n->path);
        if (rc != TDP_OK)
            return rc;
        if (l->kind == TDP_LEAF_VALUE) {
            if (strlen(l->value_json) > lim->max_value_bytes)
                return tdp__fail(w, TDP_ESCHEMA, "value '%s' is %zu bytes encoded, limit %u",
                                 l->path, strlen(l->value_json), lim->max_value_bytes);
            continue;
        }
        size_t isz = tdp_dtype_itemsize(l->dtype);
        if (isz == 0)
            return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': invalid dtype", l->path);
        if (l->ndim > lim->max_rank)
            return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': rank %u over the limit %u", l->path,
                             l->ndim, lim->max_rank);
        uint64_t numel = 1;
        for (uint32_t d = 0; d < l->ndim; d++) {
            if (l->shape[d] < 0)
                return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': shape[%u] = %" PRId64 " < 0",
                                 l->path, d, l->shape[d]);
            if (tdp__mul_ovf(numel, (uint64_t)l->shape[d], &numel))
                return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': element count overflows 64 bits",
                                 l->path);
        }
        /* strides are int64 products of max(dim, 1): with a zero dim they can
         * overflow although numel is 0 */
        uint64_t span = 1;
        for (uint32_t d = 0; d < l->ndim; d++) {
            if (tdp__mul_ovf(span, l->shape[d] > 0 ? (uint64_t)l->shape[d] : 1, &span) ||
                span > INT64_MAX)
                return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': strides overflow 64 bits",
                                 l->path);
        }
        uint64_t nbytes;
        if (tdp__mul_ovf(numel, isz, &nbytes))
            return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': byte size overflows 64 bits", l->path);
        if (!has_prefix(l->shape, l->ndim, n->batch, n->batch_ndim)) {
            char shape[64], batch[64];
            return tdp__fail(w, TDP_ESCHEMA,
                             "leaf '%s': shape %s does not start with the batch_size %s of node "
                             "'%s'",
                             l->path, fmt_dims(l->shape, l->ndim, shape, sizeof(shape)),
                             fmt_dims(n->batch, n->batch_ndim, batch, sizeof(batch)),
                             l->node == 0 ? "<root>" : n->path);
        }
        /* Ranges in the overflow-safe form: nbytes <= total - offset. */
        if (l->offset > total || nbytes > total - l->offset)
            return tdp__fail(w, TDP_ESCHEMA,
                             "leaf '%s': bytes [%" PRIu64 ", +%" PRIu64
                             ") fall outside the %" PRIu64 "-byte buffer",
                             l->path, l->offset, nbytes, total);
        if (l->has_stop && l->stop - l->offset - l->pad != nbytes)
            return tdp__fail(w, TDP_ESCHEMA,
                             "leaf '%s': stop - start - pad = %" PRIu64
                             " but shape x itemsize = %" PRIu64,
                             l->path, l->stop - l->offset - l->pad, nbytes);
        if (l->pad > total - l->offset - nbytes)
            return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': padding runs past the buffer", l->path);
        if (l->offset % tdp_dtype_align(l->dtype) != 0)
            return tdp__fail(w, TDP_ESCHEMA, "leaf '%s': offset %" PRIu64
                             " is not a multiple of the %s alignment %zu",
                             l->path, l->offset, tdp_dtype_name(l->dtype),
                             tdp_dtype_align(l->dtype));
        if (l->offset < prev_stop)
            return tdp__fail(w, TDP_ESCHEMA, "leaf '%s' overlaps leaf '%s'", l->path, prev);
        l->numel = numel;
        l->nbytes = nbytes;
        prev_stop = l->offset + nbytes + l->pad;
        prev = l->path;
    }
    return TDP_OK;
}

static tdp_err fill_strides(tdp_schema *s)
{
    for (uint32_t i = 0; i < s->nleaves; i++) {
        tdp__leaf *l = &s->leaves[i];
        if (l->kind != TDP_LEAF_TENSOR || l->strides != NULL)
            continue;
        l->strides = tdp__alloc_array(l->ndim, sizeof(int64_t));
        if (l->strides == NULL)
            return TDP_ENOMEM;
        int64_t st = 1;
        for (uint32_t d = l->ndim; d-- > 0;) {
            l->strides[d] = st;
            st *= l->shape[d] > 0 ? l->shape[d] : 1; /* fits in int64: checked */
        }
    }
    return TDP_OK;
}

tdp_err tdp__schema_finalize(tdp_schema *s, const tdp_schema_limits *lim, tdp__why *w)
{
    tdp_err rc;

    if ((uint64_t)s->nnodes + s->nleaves > lim->max_keys)
        return tdp__fail(w, TDP_ESCHEMA, "%u nodes + %u leaves over the key limit %u", s->nnodes,
                         s->nleaves, lim->max_keys);
    if ((rc = schema_order(s, w)) != TDP_OK || (rc = check_unique_paths(s, w)) != TDP_OK ||
        (rc = validate_nodes(s, lim, w)) != TDP_OK || (rc = validate_leaves(s, lim, w)) != TDP_OK ||
        (rc = fill_strides(s)) != TDP_OK || (rc = tdp__schema_encode(s, w)) != TDP_OK)
        return rc;
    if (s->json_len > lim->max_json_bytes)
        return tdp__fail(w, TDP_EMSGSIZE, "canonical JSON is %zu bytes, limit %" PRIu64,
                         s->json_len, lim->max_json_bytes);
    s->hash = XXH3_64bits(s->json, s->json_len);
    return TDP_OK;
}

/* ---- queries ------------------------------------------------------------- */

uint64_t tdp_schema_hash(const tdp_schema *s)
{
    return s ? s->hash : 0;
}

const char *tdp_schema_json(const tdp_schema *s, size_t *len)
{
    if (s == NULL)
        return NULL;
    if (len != NULL)
        *len = s->json_len;
    return s->json;
}

uint64_t tdp_schema_total_bytes(const tdp_schema *s)
{
    return s ? s->total_bytes : 0;
}

tdp_device tdp_schema_device(const tdp_schema *s)
{
    return s ? s->device : TDP_DEVICE_CPU_INIT;
}

bool tdp_schema_equal(const tdp_schema *a, const tdp_schema *b)
{
    if (a == b)
        return true;
    if (a == NULL || b == NULL)
        return false;
    return a->hash == b->hash && a->json_len == b->json_len &&
           memcmp(a->json, b->json, a->json_len) == 0;
}

uint32_t tdp_schema_num_leaves(const tdp_schema *s)
{
    return s ? s->nleaves : 0;
}

uint32_t tdp_schema_num_tensors(const tdp_schema *s)
{
    return s ? s->ntensors : 0;
}

void tdp__leaf_view(const tdp_schema *s, uint32_t i, tdp_leaf *out)
{
    const tdp__leaf *l = &s->leaves[i];
    *out = (tdp_leaf){
        .path = l->path,
        .key = l->key,
        .kind = l->kind,
        .dtype = l->dtype,
        .ndim = l->ndim,
        .shape = l->shape,
        .strides = l->strides,
        .numel = l->numel,
        .offset = l->offset,
        .nbytes = l->nbytes,
        .data = NULL,
        .value_json = l->value_json,
    };
}

tdp_err tdp_schema_leaf_at(const tdp_schema *s, uint32_t i, tdp_leaf *out)
{
    if (s == NULL || out == NULL || i >= s->nleaves)
        return TDP_EINVAL;
    tdp__leaf_view(s, i, out);
    return TDP_OK;
}

int64_t tdp__find_leaf(const tdp_schema *s, const char *path)
{
    for (uint32_t i = 0; i < s->nleaves; i++)
        if (strcmp(s->leaves[i].path, path) == 0)
            return i;
    return -1;
}

tdp_err tdp_schema_find(const tdp_schema *s, const char *path, tdp_leaf *out)
{
    if (s == NULL || path == NULL || out == NULL)
        return TDP_EINVAL;
    int64_t i = tdp__find_leaf(s, path);
    if (i < 0)
        return TDP_ENOENT;
    tdp__leaf_view(s, (uint32_t)i, out);
    return TDP_OK;
}

uint32_t tdp_schema_num_nodes(const tdp_schema *s)
{
    return s ? s->nnodes : 0;
}

tdp_err tdp_schema_node_at(const tdp_schema *s, uint32_t i, tdp_node_info *out)
{
    if (s == NULL || out == NULL || i >= s->nnodes)
        return TDP_EINVAL;
    const tdp__node *n = &s->nodes[i];
    *out = (tdp_node_info){
        .path = n->path,
        .cls = n->cls,
        .depth = n->depth,
        .batch_ndim = n->batch_ndim,
        .batch_size = n->batch,
        .names = (const char *const *)n->names,
        .has_device = n->has_device,
        .device = n->device,
        .is_locked = n->is_locked,
        .num_children = n->num_children,
        .num_leaves = n->num_leaves,
    };
    return TDP_OK;
}

tdp_err tdp_schema_find_node(const tdp_schema *s, const char *path, tdp_node_info *out)
{
    if (s == NULL || path == NULL || out == NULL)
        return TDP_EINVAL;
    for (uint32_t i = 0; i < s->nnodes; i++)
        if (strcmp(s->nodes[i].path, path) == 0)
            return tdp_schema_node_at(s, i, out);
    return TDP_ENOENT;
}

static void print_dims(FILE *f, const int64_t *d, uint32_t n)
{
    fputc('[', f);
    for (uint32_t i = 0; i < n; i++)
        fprintf(f, "%s%" PRId64, i ? ", " : "", d[i]);
    fputc(']', f);
}

tdp_err tdp_schema_print(const tdp_schema *s, FILE *f)
{
    char dev[TDP_DEVICE_STRLEN];

    if (s == NULL || f == NULL)
        return TDP_EINVAL;
    fprintf(f, "schema %016" PRIx64 "  %" PRIu64 " bytes on %s  (%u tensors, %u values)\n",
            s->hash, s->total_bytes, tdp_device_format(s->device, dev), s->ntensors,
            s->nleaves - s->ntensors);
    for (uint32_t i = 0; i < s->nnodes; i++) {
        const tdp__node *n = &s->nodes[i];
        int ind = (int)n->depth * 2;
        fprintf(f, "%*s%s%s (%s) batch_size=", ind, "", i == 0 ? "" : n->key, i == 0 ? "." : ":",
                n->cls);
        print_dims(f, n->batch, n->batch_ndim);
        fputc('\n', f);
        for (uint32_t j = 0; j < s->nleaves; j++) {
            const tdp__leaf *l = &s->leaves[j];
            if (l->node != i)
                continue;
            fprintf(f, "%*s  %s: ", ind, "", l->key);
            if (l->kind == TDP_LEAF_VALUE) {
                fprintf(f, "%s\n", l->value_json);
                continue;
            }
            fprintf(f, "%s ", tdp_dtype_name(l->dtype));
            print_dims(f, l->shape, l->ndim);
            fprintf(f, " @ %" PRIu64 "+%" PRIu64 "\n", l->offset, l->nbytes);
        }
    }
    return TDP_OK;
}
