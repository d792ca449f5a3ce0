/*
 * td.h: a consolidated tensordict — one schema and the one buffer every
 * tensor leaf lives in.
 *
 * A tdp_td is reference-counted. It either owns its buffer (tdp_td_new,
 * allocated with tdp_mem_alloc on the schema's device) or borrows one
 * (tdp_td_wrap; a release callback runs when the last reference goes).
 * DLPack tensors exported from it hold a reference, so the buffer outlives
 * the tdp_td handle as long as a framework still uses a leaf.
 */
#ifndef TDPIPE_TD_H
#define TDPIPE_TD_H

#include <tdpipe/common.h>
#include <tdpipe/err.h>
#include <tdpipe/schema.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdp_td tdp_td;
struct DLManagedTensor; /* <dlpack/dlpack.h> */

/* Called once with the wrapped buffer when the last reference is dropped. */
typedef void (*tdp_td_release_fn)(void *buf, void *arg);

/*
 * Allocate a consolidated buffer for `s` on the schema's device (contents
 * undefined) and take a reference on `s`. On success *out holds one
 * reference. TDP_ENOTSUP if the device is a GPU and CUDA is unavailable.
 */
TDP_API tdp_err tdp_td_new(tdp_schema *s, tdp_td **out);

/*
 * Wrap a caller's buffer of `len` bytes on `dev` (len must be at least the
 * schema's total bytes and `buf` aligned to TDP_LEAF_ALIGN). The caller keeps
 * ownership of the memory; `release` (may be NULL) is called when the last
 * reference is dropped.
 */
TDP_API tdp_err tdp_td_wrap(tdp_schema *s, void *buf, uint64_t len, tdp_device dev,
                            tdp_td_release_fn release, void *arg, tdp_td **out);

/* Reference counting; thread-safe. unref(NULL) is a no-op. */
TDP_API tdp_td *tdp_td_ref(tdp_td *td);
TDP_API void tdp_td_unref(tdp_td *td);

/* The schema (borrowed: valid while td is referenced). */
TDP_API tdp_schema *tdp_td_schema(const tdp_td *td);
TDP_API void *tdp_td_data(const tdp_td *td);
TDP_API uint64_t tdp_td_nbytes(const tdp_td *td);
TDP_API tdp_device tdp_td_device(const tdp_td *td);

/* Leaves, in the schema's order, with `data` pointing into the buffer. */
TDP_API uint32_t tdp_td_num_leaves(const tdp_td *td);
TDP_API tdp_err tdp_td_leaf_at(const tdp_td *td, uint32_t i, tdp_leaf *out);
TDP_API tdp_err tdp_td_get(const tdp_td *td, const char *path, tdp_leaf *out);

/*
 * Export a tensor leaf as a DLManagedTensor that points into the buffer (no
 * copy). The tensor holds a reference on td; the consumer calls its deleter
 * exactly once when done. VALUE leaves give TDP_EINVAL; dtypes DLPack 0.6
 * cannot name (float8) give TDP_ENOTSUP. bool is exported as kDLBool when
 * the header has it, else as 8-bit unsigned.
 */
TDP_API tdp_err tdp_td_to_dlpack(tdp_td *td, const char *path, struct DLManagedTensor **out);

#ifdef __cplusplus
}
#endif

#endif /* TDPIPE_TD_H */
