/*
 * cuda_drv.c: the CUDA driver (libcuda.so.1), loaded at run time.
 *
 * Nothing links against libcuda or cudart: the driver is opened with
 * dlopen on first use, as UCX and NCCL do, so a machine without it loads
 * the library and reports no device. cuda.h gives the types; its macros
 * rename many entry points (cuMemAlloc -> cuMemAlloc_v2), so each symbol
 * is looked up by its name after macro expansion. Work runs in the
 * devices' primary contexts, the ones cudart and PyTorch use.
 */
#ifdef TDP_HAVE_CUDA_H

#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_int.h"
#include "log.h"

#define DRV_STR_(x) #x
#define DRV_STR(x)  DRV_STR_(x) /* expands cuda.h's renames first */

/* Entry points every use needs. */
#define DRV_REQUIRED(X)                                                                            \
    X(cuInit)                                                                                      \
    X(cuGetErrorString)                                                                            \
    X(cuDeviceGetCount)                                                                            \
    X(cuDeviceGet)                                                                                 \
    X(cuDeviceGetUuid)                                                                             \
    X(cuDeviceGetAttribute)                                                                        \
    X(cuDevicePrimaryCtxRetain)                                                                    \
    X(cuCtxSetCurrent)                                                                             \
    X(cuCtxGetCurrent)                                                                             \
    X(cuMemAlloc)                                                                                  \
    X(cuMemFree)                                                                                   \
    X(cuMemHostAlloc)                                                                              \
    X(cuMemFreeHost)                                                                               \
    X(cuMemHostRegister)                                                                           \
    X(cuMemHostUnregister)                                                                         \
    X(cuStreamCreate)                                                                              \
    X(cuStreamDestroy)                                                                             \
    X(cuStreamSynchronize)                                                                         \
    X(cuMemcpyAsync)                                                                               \
    X(cuMemcpy)                                                                                    \
    X(cuMemsetD8)                                                                                  \
    X(cuLaunchHostFunc)                                                                            \
    X(cuEventCreate)                                                                               \
    X(cuEventDestroy)                                                                              \
    X(cuEventRecord)                                                                               \
    X(cuEventQuery)                                                                                \
    X(cuEventSynchronize)                                                                          \
    X(cuStreamWaitEvent)                                                                           \
    X(cuPointerGetAttribute)                                                                       \
    X(cuIpcGetMemHandle)                                                                           \
    X(cuIpcOpenMemHandle)                                                                          \
    X(cuIpcCloseMemHandle)

/* Virtual memory management: shareable allocations (optional). */
#define DRV_VMM(X)                                                                                 \
    X(cuMemCreate)                                                                                 \
    X(cuMemRelease)                                                                                \
    X(cuMemAddressReserve)                                                                         \
    X(cuMemAddressFree)                                                                            \
    X(cuMemMap)                                                                                    \
    X(cuMemUnmap)                                                                                  \
    X(cuMemSetAccess)                                                                              \
    X(cuMemGetAllocationGranularity)                                                               \
    X(cuMemExportToShareableHandle)                                                                \
    X(cuMemImportFromShareableHandle)

/* Stream memory operations (optional: write_inline is not offered without them). */
#define DRV_MEMOPS(X) X(cuStreamBatchMemOp)

#define DRV_FIELD(name) __typeof__(&name) name;
static struct {
    DRV_REQUIRED(DRV_FIELD)
    DRV_MEMOPS(DRV_FIELD)
    DRV_VMM(DRV_FIELD)
} drv;
static bool have_vmm;
/* TDPIPE_CUDA_VMM=0: memory made to be exported is ordinary device memory,
 * shared by legacy IPC handles (a peer's fd handles are still imported) */
static bool vmm_export = true;

#define DRV_MAX_DEVICES 64
static CUdevice devices[DRV_MAX_DEVICES];
static CUcontext contexts[DRV_MAX_DEVICES]; /* retained primary contexts, or NULL */
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;

/* Map a driver result to tdp_err; failures other than exhaustion are logged. */
static tdp_err drv_err(CUresult r, const char *what)
{
    if (r == CUDA_SUCCESS)
        return TDP_OK;
    const char *msg = NULL;
    if (drv.cuGetErrorString(r, &msg) != CUDA_SUCCESS || msg == NULL)
        msg = "unknown CUDA error";
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        tdp_log_debug("%s: %s", what, msg);
        return TDP_ENOMEM;
    }
    if (r == CUDA_ERROR_NO_DEVICE || r == CUDA_ERROR_NOT_SUPPORTED) {
        tdp_log_debug("%s: %s", what, msg);
        return TDP_ENOTSUP;
    }
    tdp_log_error("%s: %s (CUDA error %d)", what, msg, (int)r);
    return TDP_ECUDA;
}

static bool load_syms(void *lib, const char **why)
{
#define DRV_LOAD(name)                                                                             \
    if ((*(void **)&drv.name = dlsym(lib, DRV_STR(name))) == NULL) {                               \
        *why = "libcuda.so.1 lacks " DRV_STR(name);                                                \
        return false;                                                                              \
    }
    DRV_REQUIRED(DRV_LOAD)
#undef DRV_LOAD
    have_vmm = true;
#define DRV_LOAD_VMM(name)                                                                         \
    if ((*(void **)&drv.name = dlsym(lib, DRV_STR(name))) == NULL)                                 \
        have_vmm = false;
    DRV_VMM(DRV_LOAD_VMM)
#undef DRV_LOAD_VMM
#define DRV_LOAD_OPT(name) *(void **)&drv.name = dlsym(lib, DRV_STR(name));
    DRV_MEMOPS(DRV_LOAD_OPT)
#undef DRV_LOAD_OPT
    const char *env = getenv("TDPIPE_CUDA_VMM");
    vmm_export = env == NULL || strcmp(env, "0") != 0;
    return true;
}

static int drv_init(unsigned want, const char **why)
{
    (void)want;
    static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
    static bool tried;
    static int count;
    static const char *reason;

    pthread_mutex_lock(&init_lock);
    if (!tried) {
        tried = true;
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL) {
            reason = "libcuda.so.1 not found";
        } else if (!load_syms(lib, &reason)) {
            dlclose(lib);
        } else {
            CUresult r = drv.cuInit(0);
            int n = 0;
            if (r == CUDA_SUCCESS)
                r = drv.cuDeviceGetCount(&n);
            if (r != CUDA_SUCCESS) {
                reason = r == CUDA_ERROR_NO_DEVICE ? "the driver finds no GPU"
                                                   : "the driver failed to start";
                (void)drv_err(r, "cuInit");
                n = 0;
            } else if (n == 0) {
                reason = "the driver finds no GPU";
            }
            if (n > DRV_MAX_DEVICES)
                n = DRV_MAX_DEVICES;
            for (int i = 0; i < n; i++) {
                if (drv.cuDeviceGet(&devices[i], i) != CUDA_SUCCESS) {
                    n = i;
                    break;
                }
            }
            count = n;
            /* the library stays loaded: handles of it may outlive any user */
        }
    }
    if (count == 0)
        *why = reason;
    pthread_mutex_unlock(&init_lock);
    return count;
}

static tdp_err drv_ctx_set(int dev)
{
    CUcontext ctx;
    tdp_err rc = TDP_OK;
    pthread_mutex_lock(&ctx_lock);
    if (contexts[dev] == NULL)
        rc = drv_err(drv.cuDevicePrimaryCtxRetain(&contexts[dev], devices[dev]),
                     "cuDevicePrimaryCtxRetain");
    ctx = contexts[dev];
    pthread_mutex_unlock(&ctx_lock);
    if (rc != TDP_OK)
        return rc;
    CUcontext cur = NULL;
    if (drv.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == ctx)
        return TDP_OK;
    return drv_err(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

/* Some context current for calls that are not tied to a device. */
static tdp_err ctx_any(void)
{
    CUcontext cur = NULL;
    if (drv.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur != NULL)
        return TDP_OK;
    return drv_ctx_set(0);
}

static tdp_err drv_uuid(int dev, uint8_t uuid[16])
{
    CUuuid u;
    tdp_err rc = drv_err(drv.cuDeviceGetUuid(&u, devices[dev]), "cuDeviceGetUuid");
    if (rc == TDP_OK)
        memcpy(uuid, u.bytes, 16);
    return rc;
}

/* ---- device memory: ordinary, or VMM with a POSIX fd handle -------------- */

typedef struct drv_vmm {
    CUdeviceptr ptr;
    size_t len;
    CUmemGenericAllocationHandle h; /* 0 once released (imported mappings) */
    bool legacy_import;             /* from cuIpcOpenMemHandle */
    struct drv_vmm *next;
} drv_vmm;
static drv_vmm *vmms;
static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;

static void vmm_add(drv_vmm *v)
{
    pthread_mutex_lock(&vmm_lock);
    v->next = vmms;
    vmms = v;
    pthread_mutex_unlock(&vmm_lock);
}

static drv_vmm *vmm_take(CUdeviceptr p)
{
    drv_vmm **pp, *v = NULL;
    pthread_mutex_lock(&vmm_lock);
    for (pp = &vmms; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->ptr == p) {
            v = *pp;
            *pp = v->next;
            break;
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return v;
}

static bool vmm_fd_supported(int dev)
{
    int vmm = 0, fd = 0;
    if (!have_vmm || !vmm_export)
        return false;
    if (drv.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                 devices[dev]) != CUDA_SUCCESS ||
        drv.cuDeviceGetAttribute(&fd,
                                 CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                 devices[dev]) != CUDA_SUCCESS)
        return false;
    return vmm && fd;
}

static CUmemAllocationProp vmm_prop(int dev)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return prop;
}

/* Reserve an address range for h, map it and open it to dev. */
static tdp_err vmm_map(int dev, CUmemGenericAllocationHandle h, size_t len, CUdeviceptr *out)
{
    CUdeviceptr p = 0;
    tdp_err rc = drv_err(drv.cuMemAddressReserve(&p, len, 0, 0, 0), "cuMemAddressReserve");
    if (rc != TDP_OK)
        return rc;
    rc = drv_err(drv.cuMemMap(p, len, 0, h, 0), "cuMemMap");
    if (rc == TDP_OK) {
        CUmemAccessDesc acc;
        memset(&acc, 0, sizeof(acc));
        acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        acc.location.id = dev;
        acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        rc = drv_err(drv.cuMemSetAccess(p, len, &acc, 1), "cuMemSetAccess");
        if (rc != TDP_OK)
            (void)drv.cuMemUnmap(p, len);
    }
    if (rc != TDP_OK) {
        (void)drv.cuMemAddressFree(p, len);
        return rc;
    }
    *out = p;
    return TDP_OK;
}

static tdp_err vmm_alloc(int dev, size_t size, void **out)
{
    CUmemAllocationProp prop = vmm_prop(dev);
    size_t gran = 0;
    tdp_err rc =
        drv_err(drv.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity");
    if (rc != TDP_OK)
        return rc;
    size_t len = size == 0 ? gran : size;
    if (gran == 0 || len > SIZE_MAX - gran)
        return TDP_ENOMEM;
    len = (len + gran - 1) / gran * gran;
    drv_vmm *v = calloc(1, sizeof(*v));
    if (v == NULL)
        return TDP_ENOMEM;
    rc = drv_err(drv.cuMemCreate(&v->h, len, &prop, 0), "cuMemCreate");
    if (rc == TDP_OK) {
        rc = vmm_map(dev, v->h, len, &v->ptr);
        if (rc != TDP_OK)
            (void)drv.cuMemRelease(v->h);
    }
    if (rc != TDP_OK) {
        free(v);
        return rc;
    }
    v->len = len;
    vmm_add(v);
    *out = (void *)(uintptr_t)v->ptr;
    return TDP_OK;
}

static tdp_err drv_malloc(int dev, size_t size, bool shared, void **out)
{
    tdp_err rc = drv_ctx_set(dev);
    if (rc != TDP_OK)
        return rc;
    if (shared && vmm_fd_supported(dev))
        return vmm_alloc(dev, size, out);
    CUdeviceptr p = 0;
    rc = drv_err(drv.cuMemAlloc(&p, size ? size : 1), "cuMemAlloc");
    if (rc == TDP_OK)
        *out = (void *)(uintptr_t)p;
    return rc;
}

static void drv_free(void *p)
{
    if (ctx_any() != TDP_OK)
        return;
    drv_vmm *v = vmm_take((CUdeviceptr)(uintptr_t)p);
    if (v == NULL) {
        (void)drv_err(drv.cuMemFree((CUdeviceptr)(uintptr_t)p), "cuMemFree");
        return;
    }
    if (v->legacy_import) {
        (void)drv_err(drv.cuIpcCloseMemHandle(v->ptr), "cuIpcCloseMemHandle");
    } else {
        (void)drv_err(drv.cuMemUnmap(v->ptr, v->len), "cuMemUnmap");
        (void)drv_err(drv.cuMemAddressFree(v->ptr, v->len), "cuMemAddressFree");
        if (v->h != 0)
            (void)drv_err(drv.cuMemRelease(v->h), "cuMemRelease");
    }
    free(v);
}

static tdp_err drv_export(void *p, tdp__cuda_ipc *out)
{
    tdp_err rc = ctx_any();
    if (rc != TDP_OK)
        return rc;
    memset(out, 0, sizeof(*out));
    out->fd = -1;
    CUmemGenericAllocationHandle h = 0;
    size_t len = 0;
    pthread_mutex_lock(&vmm_lock);
    for (drv_vmm *v = vmms; v != NULL; v = v->next) {
        if (v->ptr == (CUdeviceptr)(uintptr_t)p && v->h != 0 && !v->legacy_import) {
            h = v->h;
            len = v->len;
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    if (h != 0) {
        int fd = -1;
        rc = drv_err(
            drv.cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle");
        if (rc == TDP_OK) {
            out->fd = fd;
            out->size = len;
        }
        return rc;
    }
    /* ordinary memory: the legacy IPC handle (same node, not across containers) */
    CUipcMemHandle ih;
    rc = drv_err(drv.cuIpcGetMemHandle(&ih, (CUdeviceptr)(uintptr_t)p), "cuIpcGetMemHandle");
    if (rc == TDP_OK) {
        _Static_assert(sizeof(ih.reserved) <= sizeof(out->legacy), "IPC handle size");
        memcpy(out->legacy, ih.reserved, sizeof(ih.reserved));
    }
    return rc;
}

static tdp_err drv_import(int dev, const tdp__cuda_ipc *hd, void **out)
{
    tdp_err rc = drv_ctx_set(dev);
    if (rc != TDP_OK)
        return rc;
    drv_vmm *v = calloc(1, sizeof(*v));
    if (v == NULL)
        return TDP_ENOMEM;
    if (hd->fd >= 0) {
        CUmemGenericAllocationHandle h = 0;
        if (!have_vmm || hd->size == 0 || hd->size > SIZE_MAX) {
            free(v);
            return TDP_ENOTSUP;
        }
        rc = drv_err(drv.cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)hd->fd,
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                     "cuMemImportFromShareableHandle");
        if (rc == TDP_OK) {
            rc = vmm_map(dev, h, (size_t)hd->size, &v->ptr);
            (void)drv.cuMemRelease(h); /* the mapping keeps the memory */
        }
        v->len = (size_t)hd->size;
    } else {
        CUipcMemHandle ih;
        memcpy(ih.reserved, hd->legacy, sizeof(ih.reserved));
        rc = drv_err(drv.cuIpcOpenMemHandle(&v->ptr, ih, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                     "cuIpcOpenMemHandle");
        v->legacy_import = true;
    }
    if (rc != TDP_OK) {
        free(v);
        return rc;
    }
    vmm_add(v);
    *out = (void *)(uintptr_t)v->ptr;
    return TDP_OK;
}

/* ---- host memory ---------------------------------------------------------- */

static tdp_err drv_host_alloc(size_t size, void **out)
{
    tdp_err rc = ctx_any();
    if (rc == TDP_OK)
        rc = drv_err(drv.cuMemHostAlloc(out, size ? size : 1, CU_MEMHOSTALLOC_PORTABLE),
                     "cuMemHostAlloc");
    return rc;
}

static void drv_host_free(void *p)
{
    if (ctx_any() == TDP_OK)
        (void)drv_err(drv.cuMemFreeHost(p), "cuMemFreeHost");
}

static tdp_err drv_host_register(void *p, size_t size)
{
    tdp_err rc = ctx_any();
    if (rc == TDP_OK)
        rc = drv_err(drv.cuMemHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE),
                     "cuMemHostRegister");
    return rc;
}

static tdp_err drv_host_unregister(void *p)
{
    tdp_err rc = ctx_any();
    if (rc == TDP_OK)
        rc = drv_err(drv.cuMemHostUnregister(p), "cuMemHostUnregister");
    return rc;
}

static tdp_err drv_ptr_info(const void *p, tdp__cuda_ptr_info *out)
{
    *out = (tdp__cuda_ptr_info){TDP__CUDA_PTR_HOST, -1};
    unsigned int type = 0;
    /* an error here means memory the driver does not know: plain host memory */
    if (ctx_any() != TDP_OK || drv.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                                         (CUdeviceptr)(uintptr_t)p) != CUDA_SUCCESS)
        return TDP_OK;
    if (type == CU_MEMORYTYPE_HOST) {
        out->kind = TDP__CUDA_PTR_PINNED;
    } else if (type == CU_MEMORYTYPE_DEVICE) {
        int ord = 0;
        out->kind = TDP__CUDA_PTR_DEVICE;
        if (drv.cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                      (CUdeviceptr)(uintptr_t)p) == CUDA_SUCCESS)
            out->device = ord;
    }
    return TDP_OK;
}

/* ---- streams, copies, events ---------------------------------------------- */

struct tdp__cuda_stream {
    CUstream s;
    int dev;
};

struct tdp__cuda_event {
    CUevent e;
    int dev;
};

static tdp_err drv_stream_create(int dev, tdp__cuda_stream **out)
{
    tdp_err rc = drv_ctx_set(dev);
    if (rc != TDP_OK)
        return rc;
    tdp__cuda_stream *s = malloc(sizeof(*s));
    if (s == NULL)
        return TDP_ENOMEM;
    s->dev = dev;
    /* non-blocking: no implicit sync with the legacy default stream (PyTorch's) */
    rc = drv_err(drv.cuStreamCreate(&s->s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    if (rc != TDP_OK) {
        free(s);
        return rc;
    }
    *out = s;
    return TDP_OK;
}

static void drv_stream_destroy(tdp__cuda_stream *s)
{
    if (drv_ctx_set(s->dev) == TDP_OK) {
        (void)drv.cuStreamSynchronize(s->s);
        (void)drv_err(drv.cuStreamDestroy(s->s), "cuStreamDestroy");
    }
    free(s);
}

static tdp_err drv_stream_sync(tdp__cuda_stream *s)
{
    tdp_err rc = drv_ctx_set(s->dev);
    return rc != TDP_OK ? rc : drv_err(drv.cuStreamSynchronize(s->s), "cuStreamSynchronize");
}

static tdp_err drv_memcpy_async(void *dst, const void *src, size_t n, tdp__cuda_stream *s)
{
    tdp_err rc = drv_ctx_set(s->dev);
    if (rc != TDP_OK)
        return rc;
    return drv_err(
        drv.cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n, s->s),
        "cuMemcpyAsync");
}

/* Per device, what its write-value operations are (0 until asked). */
enum { MEMOPS_UNKNOWN, MEMOPS_32, MEMOPS_64, MEMOPS_REFUSED };
static _Atomic int memops[DRV_MAX_DEVICES];

static tdp_err drv_write_inline(void *dst, const void *src, size_t n, tdp__cuda_stream *s)
{
    int kind = atomic_load(&memops[s->dev]);
    if (drv.cuStreamBatchMemOp == NULL || kind == MEMOPS_REFUSED)
        return TDP_ENOTSUP;
    tdp_err rc = drv_ctx_set(s->dev);
    if (rc != TDP_OK)
        return rc;
    if (kind == MEMOPS_UNKNOWN) {
        int v = 0;
        if (drv.cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                     devices[s->dev]) != CUDA_SUCCESS)
            v = 0;
        kind = v ? MEMOPS_64 : MEMOPS_32;
        atomic_store(&memops[s->dev], kind);
    }
    /* at most 255 operations a batch: 64-bit words between a 32-bit head and tail */
    CUstreamBatchMemOpParams ops[255];
    unsigned k = 0;
    const unsigned char *in = src;
    CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst;
    size_t off = 0;
    while (off < n) {
        if (k == 255)
            return TDP_ENOTSUP; /* only 32-bit operations here: too long for one batch */
        memset(&ops[k], 0, sizeof(ops[k]));
        ops[k].writeValue.address = d + off;
        /* fenced after the stream's earlier work: the v2 API (cuStreamBatchMemOp_v2)
         * has no unfenced write (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER is refused
         * as an invalid value, as an H200 did) */
        ops[k].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
        if (kind == MEMOPS_64 && ((d + off) & 7u) == 0 && n - off >= 8) {
            uint64_t v;
            memcpy(&v, in + off, 8);
            ops[k].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
            ops[k].writeValue.value64 = v;
            off += 8;
        } else {
            uint32_t v;
            memcpy(&v, in + off, 4);
            ops[k].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
            ops[k].writeValue.value = v;
            off += 4;
        }
        k++;
    }
    CUresult r = drv.cuStreamBatchMemOp(s->s, k, ops, 0);
    if (r == CUDA_SUCCESS)
        return TDP_OK;
    /*
     * Refused (nothing was queued): the caller copies, now and from now on
     * on this device. Said once; a wrong write is never the outcome.
     */
    if (atomic_exchange(&memops[s->dev], MEMOPS_REFUSED) != MEMOPS_REFUSED)
        tdp_log_warn("cuStreamBatchMemOp refused %u writes on device %d (CUDA error %d): small "
                     "host-to-device writes go through the copy engine",
                     k, s->dev, (int)r);
    return TDP_ENOTSUP;
}

static tdp_err drv_memcpy(void *dst, const void *src, size_t n)
{
    tdp_err rc = ctx_any();
    if (rc != TDP_OK)
        return rc;
    return drv_err(drv.cuMemcpy((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n),
                   "cuMemcpy");
}

/* The default (NULL) stream of the current context, where cuMemcpy and cuMemset run. */
static tdp_err drv_sync_default(void)
{
    tdp_err rc = ctx_any();
    return rc != TDP_OK ? rc : drv_err(drv.cuStreamSynchronize(NULL), "cuStreamSynchronize");
}

static tdp_err drv_memset(void *p, int byte, size_t n)
{
    tdp_err rc = ctx_any();
    if (rc != TDP_OK)
        return rc;
    /* may return before it finished: the layer waits (sync_default) */
    return drv_err(drv.cuMemsetD8((CUdeviceptr)(uintptr_t)p, (unsigned char)byte, n), "cuMemsetD8");
}

static tdp_err drv_host_func(tdp__cuda_stream *s, void (*fn)(void *), void *arg)
{
    tdp_err rc = drv_ctx_set(s->dev);
    return rc != TDP_OK ? rc : drv_err(drv.cuLaunchHostFunc(s->s, fn, arg), "cuLaunchHostFunc");
}

static tdp_err drv_event_create(int dev, tdp__cuda_event **out)
{
    tdp_err rc = drv_ctx_set(dev);
    if (rc != TDP_OK)
        return rc;
    tdp__cuda_event *e = malloc(sizeof(*e));
    if (e == NULL)
        return TDP_ENOMEM;
    e->dev = dev;
    rc = drv_err(drv.cuEventCreate(&e->e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    if (rc != TDP_OK) {
        free(e);
        return rc;
    }
    *out = e;
    return TDP_OK;
}

static void drv_event_destroy(tdp__cuda_event *e)
{
    if (drv_ctx_set(e->dev) == TDP_OK)
        (void)drv_err(drv.cuEventDestroy(e->e), "cuEventDestroy");
    free(e);
}

static tdp_err drv_event_record(tdp__cuda_event *e, tdp__cuda_stream *s)
{
    tdp_err rc = drv_ctx_set(s->dev);
    return rc != TDP_OK ? rc : drv_err(drv.cuEventRecord(e->e, s->s), "cuEventRecord");
}

static tdp_err drv_event_query(tdp__cuda_event *e)
{
    tdp_err rc = drv_ctx_set(e->dev);
    if (rc != TDP_OK)
        return rc;
    CUresult r = drv.cuEventQuery(e->e);
    return r == CUDA_ERROR_NOT_READY ? TDP_EAGAIN : drv_err(r, "cuEventQuery");
}

static tdp_err drv_event_sync(tdp__cuda_event *e)
{
    tdp_err rc = drv_ctx_set(e->dev);
    return rc != TDP_OK ? rc : drv_err(drv.cuEventSynchronize(e->e), "cuEventSynchronize");
}

static tdp_err drv_stream_wait(tdp__cuda_stream *s, tdp__cuda_event *e)
{
    tdp_err rc = drv_ctx_set(s->dev);
    return rc != TDP_OK ? rc : drv_err(drv.cuStreamWaitEvent(s->s, e->e, 0), "cuStreamWaitEvent");
}

const tdp__cuda_ops tdp__cuda_driver_ops = {
    .name = "driver",
    .init = drv_init,
    .uuid = drv_uuid,
    .ctx_set = drv_ctx_set,
    .malloc = drv_malloc,
    .free = drv_free,
    .host_alloc = drv_host_alloc,
    .host_free = drv_host_free,
    .host_register = drv_host_register,
    .host_unregister = drv_host_unregister,
    .stream_create = drv_stream_create,
    .stream_destroy = drv_stream_destroy,
    .stream_sync = drv_stream_sync,
    .memcpy_async = drv_memcpy_async,
    .write_inline = drv_write_inline,
    .memcpy = drv_memcpy,
    .memset = drv_memset,
    .sync_default = drv_sync_default,
    .host_func = drv_host_func,
    .event_create = drv_event_create,
    .event_destroy = drv_event_destroy,
    .event_record = drv_event_record,
    .event_query = drv_event_query,
    .event_sync = drv_event_sync,
    .stream_wait = drv_stream_wait,
    .ptr_info = drv_ptr_info,
    .export_ = drv_export,
    .import = drv_import,
    .import_close = drv_free,
};

#endif /* TDP_HAVE_CUDA_H */
