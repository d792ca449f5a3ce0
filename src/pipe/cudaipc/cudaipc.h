/*
 * cudaipc.h (internal): the pieces of the same-host GPU plane (cuda-ipc)
 * that are not the shm plane's. The cuda-ipc plane is the shm plane's link
 * (its Unix socket, control segment, rings, loans and release ring:
 * plane_shm.c) with pools of device memory for GPU payloads; this is where
 * those pools are made, exported, imported and shared within one process,
 * and where the GPUs part of the plane's HELLO record is read and written
 * (the record is put together in shm/shm_hello.h).
 *
 * Device pools (tdp__dpool). A sender's pool of device slots is one
 * exportable allocation (tdp__cuda_malloc_shared), exported once when it is
 * made and announced; the receiver imports it once when the announcement
 * comes. Each pool has a random 16-byte id. A process cannot import a
 * handle it exported itself, so the ids of the pools this process made are
 * kept in a table: a receiver that finds the announced id there (both ends
 * in one process, as in the test suites) shares the sender's pointer
 * instead of importing. An id found there names memory this process owns;
 * its size is checked against what the announcement claims.
 *
 * Threads: every function is thread-safe (the last reference to a pool may
 * go with a view released on any thread).
 */
#ifndef TDP_PIPE_CUDAIPC_H
#define TDP_PIPE_CUDAIPC_H

#include <stdbool.h>
#include <stdint.h>

#include "../../core/cuda.h"

#define TDP_DPOOL_ID_LEN     16u
#define TDP_CUDAIPC_DEVS     16u /* device UUIDs a record lists, at most */
#define TDP_CUDAIPC_UUID     16u
#define TDP_CUDAIPC_GPUS_MAX (2u + TDP_CUDAIPC_DEVS * TDP_CUDAIPC_UUID)

/* ---- device pools ------------------------------------------------------------ */

typedef struct tdp__dpool tdp__dpool;

/*
 * A pool of `bytes` (a nonzero multiple of 4096) on device dev, made
 * exportable and entered in the process's table. TDP_ENOTSUP without the
 * device; TDP_ENOMEM / TDP_ECUDA as the CUDA layer says.
 */
tdp_err tdp__dpool_new(int dev, uint64_t bytes, tdp__dpool **out);

/* Export the pool's memory (once per pool: counted, see tdp__dpool_exports). */
tdp_err tdp__dpool_export(tdp__dpool *p, tdp__cuda_ipc *h);

/*
 * The receiver's side: the pool announced with id, handle h and `bytes`,
 * on local device dev. Shared by pointer when id names a pool of this
 * process (of at least `bytes` on dev: else TDP_EPROTO), imported
 * otherwise: h->size is what the export said it maps (the driver rounds an
 * allocation up to its granularity), at least `bytes` and at most 64 MiB
 * more, else TDP_EPROTO. The caller keeps h->fd.
 */
tdp_err tdp__dpool_open(int dev, const uint8_t id[TDP_DPOOL_ID_LEN], const tdp__cuda_ipc *h,
                        uint64_t bytes, tdp__dpool **out);

/*
 * Within one process the two ends share the pool's memory at one address,
 * while the rings that order their accesses are mapped twice (at two
 * addresses), so C11 sees no order between them (nor does ThreadSanitizer).
 * publish (release) after this side's last access to a slot and before its
 * descriptor goes; observe (acquire) when the peer's descriptor for a slot
 * is taken. One atomic each; on a pool of another process they touch this
 * side's own object only.
 */
void tdp__dpool_publish(tdp__dpool *p);
void tdp__dpool_observe(tdp__dpool *p);

void tdp__dpool_ref(tdp__dpool *p);
void tdp__dpool_unref(tdp__dpool *p); /* NULL is a no-op */

void *tdp__dpool_base(const tdp__dpool *p);
uint64_t tdp__dpool_bytes(const tdp__dpool *p);
int tdp__dpool_device(const tdp__dpool *p);
const uint8_t *tdp__dpool_id(const tdp__dpool *p);
bool tdp__dpool_is_shared(const tdp__dpool *p); /* opened by sharing this process's pointer */

/* Exports and imports made by this process so far (tests: none per message). */
uint64_t tdp__dpool_exports(void);
uint64_t tdp__dpool_imports(void);
/* Pools opened by a receiver in this process: imported, or shared by id. */
uint64_t tdp__dpool_opens(void);

/* ---- the GPUs a process sees, in the cuda-ipc HELLO record ---------------------
 * ndev u8 | dev u8 | uuid[ndev][16]
 * uuids: every device this process sees, by its own index; dev: the index
 * of the pipe's device (tdp_pipe_opts.cuda_device) among them. The record
 * (TDP_HX_CUDA_IPC) is the shm plane's socket record followed by this part:
 * it is put together in shm/shm_hello.h.
 */
typedef struct tdp__cudaipc_gpus {
    uint8_t ndev, dev;
    const uint8_t *uuids; /* ndev x 16 bytes */
} tdp__cudaipc_gpus;

/*
 * This side's part for a pipe on device dev, written into buf (*len
 * bytes): TDP_ENOTSUP when the device or a UUID is not there (the plane is
 * then not offered).
 */
tdp_err tdp__cudaipc_gpus_encode(uint8_t buf[TDP_CUDAIPC_GPUS_MAX], int dev, size_t *len);
/* Decode a part of exactly len bytes: TDP_OK, or TDP_EPROTO when malformed. */
tdp_err tdp__cudaipc_gpus_parse(const uint8_t *val, size_t len, tdp__cudaipc_gpus *out);

/*
 * Whether each side's pipe device is one the other side sees: the same
 * answer on both sides (the plane's usable rule).
 */
bool tdp__cudaipc_reach(const tdp__cudaipc_gpus *a, const tdp__cudaipc_gpus *b);

/* Whether the peer sees the device with this UUID (a pool there can go to it). */
bool tdp__cudaipc_sees(const tdp__cudaipc_gpus *peer, const uint8_t uuid[TDP_CUDAIPC_UUID]);

/* This process's index of the device with that UUID, or -1. */
int tdp__cudaipc_local_dev(const uint8_t uuid[TDP_CUDAIPC_UUID]);

#endif
