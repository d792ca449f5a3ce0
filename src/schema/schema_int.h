/* schema_int.h (internal): the schema model shared by builder, codec and td. */
#ifndef TDP_SCHEMA_INT_H
#define TDP_SCHEMA_INT_H

#include <stdatomic.h>
#include <tdpipe/schema.h>

#define TDP_NO_PARENT UINT32_MAX

/* Field names of a node object; a sub-node may not be called one of these. */
#define TDP_F_CLS      "cls"
#define TDP_F_CLSMETA  "cls_metadata"
#define TDP_F_LEAVES   "leaves"
#define TDP_F_NONTENS  "non_tensors"
#define TDP_SCHEMA_FORMAT_NAME "tdpipe.schema"

typedef struct tdp__node {
    char *key;  /* NULL for the root */
    char *path; /* "" for the root */
    uint32_t parent;
    uint32_t depth;
    char *cls;
    uint32_t batch_ndim;
    int64_t *batch;
    char **names; /* NULL or batch_ndim entries, each may be NULL */
    bool has_device;
    tdp_device device;
    bool is_locked;
    uint32_t num_children;
    uint32_t num_leaves;
} tdp__node;

typedef struct tdp__leaf {
    uint32_t node;
    char *key;
    char *path;
    tdp_leaf_kind kind;
    tdp_dtype dtype;
    uint32_t ndim;
    int64_t *shape;
    int64_t *strides;
    uint64_t numel;
    uint64_t offset;
    uint64_t nbytes;
    uint64_t pad;     /* bytes after the leaf up to its stop */
    bool has_stop;    /* decoded: the producer declared a stop to check */
    uint64_t stop;
    char *value_json; /* VALUE leaves: canonical JSON of the scalar */
} tdp__leaf;

struct tdp_schema {
    _Atomic uint32_t refs;
    tdp__node *nodes;
    uint32_t nnodes;
    tdp__leaf *leaves; /* tensors by offset, then values by path */
    uint32_t nleaves;
    uint32_t ntensors;
    uint64_t total_bytes;
    tdp_device device;
    char *json;
    size_t json_len;
    uint64_t hash;
};

/* An error message sink: writes "why" once, keeps the first. */
typedef struct tdp__why {
    char *buf;
    size_t len;
} tdp__why;

tdp_err tdp__fail(tdp__why *w, tdp_err err, const char *fmt, ...) TDP_CHECK_FMT(3, 4);

/* Resolve limits: NULL or short structs take defaults for missing/zero fields. */
void tdp__limits_resolve(const tdp_schema_limits *in, tdp_schema_limits *out);

/* Check one key: length, characters, separator. */
tdp_err tdp__check_key(const char *key, size_t max_len, tdp__why *w, const char *where);

/* Compare paths component-wise (pre-order, siblings by bytes). */
int tdp__path_cmp(const char *a, const char *b);

/* Allocate an empty schema (refs = 1). */
tdp_schema *tdp__schema_alloc(void);

/*
 * Given nodes and leaves filled in (paths, parents, shapes, offsets),
 * order them canonically, validate every rule, encode the canonical JSON and
 * hash it. On failure the schema is left for the caller to unref.
 */
tdp_err tdp__schema_finalize(tdp_schema *s, const tdp_schema_limits *lim, tdp__why *w);

/* Canonical JSON of a scalar value (jansson json_t*); caller frees with tdp__free. */
char *tdp__value_dump(const void *json_value);

/* Encode s as canonical JSON into s->json / s->json_len. */
tdp_err tdp__schema_encode(tdp_schema *s, tdp__why *w);

/* Fill a public view of leaf i (data left NULL). */
void tdp__leaf_view(const tdp_schema *s, uint32_t i, tdp_leaf *out);

/* Index of the leaf at `path`, or -1. */
int64_t tdp__find_leaf(const tdp_schema *s, const char *path);

/* Checked arithmetic. */
static inline bool tdp__mul_ovf(uint64_t a, uint64_t b, uint64_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}

#endif
