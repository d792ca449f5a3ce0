/*
 * schema.h: the layout of a consolidated tensordict — nested keys, per-leaf
 * dtype, shape and byte range in one buffer, batch sizes, class names and
 * small non-tensor values — with its canonical JSON form, its hash and the
 * validation applied to every schema that arrives from a peer.
 *
 * A tdp_schema is immutable and reference-counted: once built or decoded it
 * can be shared between threads and pipes. Its canonical JSON and hash are
 * computed once, when it is created.
 *
 * Paths name leaves and nodes by their keys joined with '.', e.g.
 * "obs.pixels". The root node's path is "". Keys therefore cannot contain
 * '.', and are 1..max_key_len bytes of UTF-8 without control characters.
 */
#ifndef TDPIPE_SCHEMA_H
#define TDPIPE_SCHEMA_H

#include <stdio.h>
#include <tdpipe/common.h>
#include <tdpipe/err.h>
#include <tdpipe/dtype.h>
#include <tdpipe/mem.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdp_schema tdp_schema;
typedef struct tdp_schema_builder tdp_schema_builder;

/* Separator of path components. */
#define TDP_PATH_SEP '.'

/* Hard ceiling of a leaf's rank, whatever the limits say. */
#define TDP_MAX_RANK 64

/*
 * Alignment of every tensor leaf the builder lays out (bytes). 64 is a cache
 * line: a leaf never shares a line with its neighbour (no false sharing when
 * threads fill different leaves), it satisfies every dtype's alignment (16 at
 * most) and the widest SIMD loads (AVX-512), and it costs at most 63 bytes of
 * padding per leaf. Decoded schemas need only each dtype's own alignment, so
 * a producer padding to 8 bytes (as tensordict's consolidate does) is fine.
 */
#define TDP_LEAF_ALIGN 64u

/* Version of the schema JSON format (the "version" field). */
#define TDP_SCHEMA_FORMAT_VERSION 1

/*
 * Limits applied when a schema is decoded or built. The struct can grow:
 * set `size` to sizeof(tdp_schema_limits) as you compiled it, and fields
 * past that size take their defaults. A zero field also means "default".
 */
typedef struct tdp_schema_limits {
    size_t size;
    uint64_t max_json_bytes;  /* schema JSON text, bytes. Default 1 MiB. */
    uint32_t max_depth;       /* node nesting below the root. Default 32. */
    uint32_t max_keys;        /* nodes + leaves. Default 4096. */
    uint32_t max_key_len;     /* bytes of one key. Default 255. */
    uint32_t max_rank;        /* dims of one leaf (<= TDP_MAX_RANK). Default 16. */
    uint32_t max_value_bytes; /* encoded non-tensor value or class name. Default 4096. */
    uint64_t max_total_bytes; /* consolidated buffer size. Default 64 GiB. */
} tdp_schema_limits;

#define TDP_SCHEMA_DEFAULT_MAX_JSON_BYTES  (1u << 20)
#define TDP_SCHEMA_DEFAULT_MAX_DEPTH       32u
#define TDP_SCHEMA_DEFAULT_MAX_KEYS        4096u
#define TDP_SCHEMA_DEFAULT_MAX_KEY_LEN     255u
#define TDP_SCHEMA_DEFAULT_MAX_RANK        16u
#define TDP_SCHEMA_DEFAULT_MAX_VALUE_BYTES 4096u
#define TDP_SCHEMA_DEFAULT_MAX_TOTAL_BYTES (64ull << 30)

/* Fill *out with the defaults above (size included). */
TDP_API void tdp_schema_limits_default(tdp_schema_limits *out);

/* What a leaf holds. */
typedef enum tdp_leaf_kind {
    TDP_LEAF_TENSOR = 0, /* bytes in the consolidated buffer */
    TDP_LEAF_VALUE = 1,  /* a small JSON scalar carried in the schema itself */
} tdp_leaf_kind;

/*
 * A view of one leaf. Pointers point into the schema (or the tensordict) and
 * stay valid while it is referenced. Strides are in elements, C-contiguous.
 * `data` is NULL for schema-level queries and for VALUE leaves.
 */
typedef struct tdp_leaf {
    const char *path;
    const char *key;
    tdp_leaf_kind kind;
    tdp_dtype dtype; /* TDP_DTYPE_INVALID for VALUE leaves */
    uint32_t ndim;
    const int64_t *shape;
    const int64_t *strides;
    uint64_t numel;
    uint64_t offset; /* byte offset in the consolidated buffer */
    uint64_t nbytes; /* numel * itemsize */
    void *data;
    const char *value_json; /* VALUE leaves: canonical JSON text of the value */
} tdp_leaf;

/* A view of one node (a dict in the tree). Valid while the schema lives. */
typedef struct tdp_node_info {
    const char *path; /* "" for the root */
    const char *cls;  /* class name, "TensorDict" unless set */
    uint32_t depth;   /* 0 for the root */
    uint32_t batch_ndim;
    const int64_t *batch_size;
    const char *const *names; /* NULL, or batch_ndim entries (an entry may be NULL) */
    bool has_device;          /* node's own device is set */
    tdp_device device;
    bool is_locked;
    uint32_t num_children; /* sub-nodes */
    uint32_t num_leaves;   /* direct leaves */
} tdp_node_info;

/* ---- reference counting ------------------------------------------------ */

/* Take another reference; returns s. Thread-safe. */
TDP_API tdp_schema *tdp_schema_ref(tdp_schema *s);

/* Drop a reference; the last one frees. NULL is a no-op. Thread-safe. */
TDP_API void tdp_schema_unref(tdp_schema *s);

/* ---- queries ------------------------------------------------------------- */

/* XXH3-64 of the canonical JSON. Equal schemas have equal hashes. */
TDP_API uint64_t tdp_schema_hash(const tdp_schema *s);

/*
 * The canonical JSON: keys sorted by bytes, no whitespace, ASCII-escaped
 * strings. The same schema always gives the same bytes. The text is owned by
 * the schema and NUL-terminated; *len (if not NULL) gets its length.
 */
TDP_API const char *tdp_schema_json(const tdp_schema *s, size_t *len);

/* Size in bytes of the consolidated buffer. */
TDP_API uint64_t tdp_schema_total_bytes(const tdp_schema *s);

/* Device of the consolidated buffer. */
TDP_API tdp_device tdp_schema_device(const tdp_schema *s);

/* True when a and b describe the same layout (same canonical bytes). */
TDP_API bool tdp_schema_equal(const tdp_schema *a, const tdp_schema *b);

/*
 * Leaves in their defined order: tensor leaves by ascending offset (the
 * builder's declaration order), then value leaves by path (bytewise).
 */
TDP_API uint32_t tdp_schema_num_leaves(const tdp_schema *s);
TDP_API uint32_t tdp_schema_num_tensors(const tdp_schema *s);
TDP_API tdp_err tdp_schema_leaf_at(const tdp_schema *s, uint32_t i, tdp_leaf *out);

/* Find a leaf by path. TDP_ENOENT when there is none. */
TDP_API tdp_err tdp_schema_find(const tdp_schema *s, const char *path, tdp_leaf *out);

/* Nodes in depth-first pre-order, siblings by key; node 0 is the root. */
TDP_API uint32_t tdp_schema_num_nodes(const tdp_schema *s);
TDP_API tdp_err tdp_schema_node_at(const tdp_schema *s, uint32_t i, tdp_node_info *out);
TDP_API tdp_err tdp_schema_find_node(const tdp_schema *s, const char *path, tdp_node_info *out);

/*
 * A copy of `s` whose buffer lives on `dev` (the receive-device override):
 * the schema device and every node device equal to the old one change.
 */
TDP_API tdp_err tdp_schema_with_device(const tdp_schema *s, tdp_device dev, tdp_schema **out);

/* Print the tree (keys, classes, batch sizes, dtypes, shapes, byte ranges). */
TDP_API tdp_err tdp_schema_print(const tdp_schema *s, FILE *f);

/* ---- codec --------------------------------------------------------------- */

/*
 * Decode and validate a schema from untrusted JSON. Nothing is allocated
 * before the length and nesting depth are checked; every rule in
 * docs/schema.md is applied before the schema is returned. `limits` may be
 * NULL for the defaults. On failure returns TDP_ESCHEMA (or TDP_EMSGSIZE for
 * text over max_json_bytes, TDP_ENOMEM) and, when `why` is not NULL, writes
 * a NUL-terminated message naming the key and the rule. *out is written only
 * on success and holds one reference.
 */
TDP_API tdp_err tdp_schema_decode(const void *json, size_t len, const tdp_schema_limits *limits,
                                  tdp_schema **out, char *why, size_t why_len);

/* ---- builder ------------------------------------------------------------- */

/*
 * The builder collects nodes and leaves; tdp_schema_builder_finish lays the
 * tensor leaves out in declaration order, each aligned to TDP_LEAF_ALIGN,
 * validates the result with the default limits and returns the schema. The
 * builder stays usable (finish may be called again) until freed.
 */
TDP_API tdp_err tdp_schema_builder_new(tdp_schema_builder **out);
/* Free the builder; schemas it finished live on. NULL is a no-op. */
TDP_API void tdp_schema_builder_free(tdp_schema_builder *b);

/* Device of the buffer (default cpu); also the device of every node. */
TDP_API tdp_err tdp_schema_builder_set_device(tdp_schema_builder *b, tdp_device dev);

/*
 * Create (or update) the node at `path` ("" is the root), creating missing
 * parents as plain "TensorDict" nodes with their parent's batch size (as
 * it is at that moment; leaves create their parents the same way). `cls` NULL keeps the current class
 * name. batch_ndim 0 means batch_size []. A tensorclass keeps its name here
 * ("MyData") so it survives the trip.
 */
TDP_API tdp_err tdp_schema_builder_node(tdp_schema_builder *b, const char *path,
                                        const char *cls, uint32_t batch_ndim,
                                        const int64_t *batch_size);

/* Add a tensor leaf; parents are created as needed. Duplicate paths: EINVAL. */
TDP_API tdp_err tdp_schema_builder_tensor(tdp_schema_builder *b, const char *path,
                                          tdp_dtype dtype, uint32_t ndim, const int64_t *shape);

/*
 * Add a non-tensor leaf whose value is the JSON scalar in `json_value`
 * ("\"text\"", "3", "2.5", "true", "null"). Arrays and objects are refused.
 */
TDP_API tdp_err tdp_schema_builder_value(tdp_schema_builder *b, const char *path,
                                         const char *json_value);

/* Convenience forms of tdp_schema_builder_value. */
TDP_API tdp_err tdp_schema_builder_string(tdp_schema_builder *b, const char *path,
                                          const char *value);
TDP_API tdp_err tdp_schema_builder_int(tdp_schema_builder *b, const char *path, int64_t value);

/*
 * Lay out, encode, hash and validate. On success *out holds one reference.
 * On failure returns the error (TDP_ESCHEMA for a rule broken) and writes a
 * message into `why` when given.
 */
TDP_API tdp_err tdp_schema_builder_finish(tdp_schema_builder *b, tdp_schema **out, char *why,
                                          size_t why_len);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_SCHEMA_H */
