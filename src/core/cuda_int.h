/* cuda_int.h: what a CUDA backend provides to the dispatcher in cuda.c. */
#ifndef TDP_CORE_CUDA_INT_H
#define TDP_CORE_CUDA_INT_H

#include "cuda.h"

typedef struct tdp__cuda_ops {
    const char *name;
    /* 0 or more devices; *why says why there are none (static string) */
    int (*init)(unsigned ndev, const char **why);
    tdp_err (*uuid)(int dev, uint8_t uuid[16]);
    tdp_err (*ctx_set)(int dev);
    tdp_err (*malloc)(int dev, size_t size, bool shared, void **out);
    void (*free)(void *p);
    tdp_err (*host_alloc)(size_t size, void **out);
    void (*host_free)(void *p);
    tdp_err (*host_register)(void *p, size_t size);
    tdp_err (*host_unregister)(void *p);
    tdp_err (*stream_create)(int dev, tdp__cuda_stream **out);
    void (*stream_destroy)(tdp__cuda_stream *s);
    tdp_err (*stream_sync)(tdp__cuda_stream *s);
    tdp_err (*memcpy_async)(void *dst, const void *src, size_t n, tdp__cuda_stream *s);
    tdp_err (*memcpy)(void *dst, const void *src, size_t n);
    tdp_err (*memset)(void *p, int byte, size_t n);
    /* n bytes of host memory, read now, written on s by the device itself (no copy
     * engine); checked by the layer (aligned, at most TDP__CUDA_INLINE_MAX); NULL: not offered */
    tdp_err (*write_inline)(void *dst, const void *src, size_t n, tdp__cuda_stream *s);
    /* wait for what memcpy and memset left on the default stream (the
     * driver's cuMemcpy and cuMemset may return before their bytes land) */
    tdp_err (*sync_default)(void);
    tdp_err (*host_func)(tdp__cuda_stream *s, void (*fn)(void *), void *arg);
    tdp_err (*event_create)(int dev, tdp__cuda_event **out);
    void (*event_destroy)(tdp__cuda_event *e);
    tdp_err (*event_record)(tdp__cuda_event *e, tdp__cuda_stream *s);
    tdp_err (*event_query)(tdp__cuda_event *e);
    tdp_err (*event_sync)(tdp__cuda_event *e);
    tdp_err (*stream_wait)(tdp__cuda_stream *s, tdp__cuda_event *e);
    tdp_err (*ptr_info)(const void *p, tdp__cuda_ptr_info *out);
    tdp_err (*export_)(void *p, tdp__cuda_ipc *out);
    tdp_err (*import)(int dev, const tdp__cuda_ipc *h, void **out);
    void (*import_close)(void *p);
} tdp__cuda_ops;

extern const tdp__cuda_ops tdp__cuda_fake_ops;
/* Whether this thread is running one of the fake's host functions. */
bool tdp__cuda_fake_in_host_fn(void);
#ifdef TDP_HAVE_CUDA_H
extern const tdp__cuda_ops tdp__cuda_driver_ops;
#endif

#endif /* TDP_CORE_CUDA_INT_H */
