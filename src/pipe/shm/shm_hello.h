/*
 * shm_hello.h (internal): the shm plane's HELLO record, TDP_HX_SHM —
 * key[16] | name_len u16 | name: the socket a same-host peer connects to,
 * and the key that proves it is the peer of this pipe. wire.c carries it
 * as opaque bytes; this is where it is read and checked.
 */
#ifndef TDP_PIPE_SHM_HELLO_H
#define TDP_PIPE_SHM_HELLO_H

#include <stdint.h>

#include "../wire.h"
#include "../cudaipc/cudaipc.h"

#define TDP_SHM_KEY_LEN  16u
#define TDP_SHM_NAME_MAX 107u /* sun_path less the abstract namespace's leading NUL */
#define TDP_SHM_REC_MAX  (TDP_SHM_KEY_LEN + 2u + TDP_SHM_NAME_MAX)

typedef struct tdp__shm_hello {
    const uint8_t *key; /* TDP_SHM_KEY_LEN bytes */
    const char *name;   /* abstract socket name, not NUL-terminated */
    uint16_t name_len;  /* 1..TDP_SHM_NAME_MAX */
} tdp__shm_hello;

/*
 * Add this side's record to h, its value written into buf (which must
 * outlive h's encoding). TDP_EINVAL for a name out of bounds.
 */
tdp_err tdp__shm_hello_put(tdp_hello *h, uint8_t buf[TDP_SHM_REC_MAX], const tdp__shm_hello *in);
/*
 * The record's value alone, for a plane whose record starts with it
 * (cuda-ipc): encode returns the bytes written to buf (0: TDP_EINVAL's
 * cases); decode reads val[0..len) and sets *used to the bytes it took
 * (TDP_EPROTO when malformed).
 */
size_t tdp__shm_hello_encode(uint8_t buf[TDP_SHM_REC_MAX], const tdp__shm_hello *in);
tdp_err tdp__shm_hello_decode(const uint8_t *val, size_t len, tdp__shm_hello *out, size_t *used);
/*
 * The peer's record: TDP_OK (*out points into h's record), TDP_ENOENT when
 * h has none, TDP_EPROTO when it is malformed.
 */
tdp_err tdp__shm_hello_get(const tdp_hello *h, tdp__shm_hello *out);

/* ---- the cuda-ipc plane's record, TDP_HX_CUDA_IPC ------------------------------
 * this plane's record (the socket and proof), then the GPUs the process
 * sees (cudaipc.h: ndev u8 | dev u8 | uuid[ndev][16]).
 */
#define TDP_SHM_IPC_REC_MAX (TDP_SHM_REC_MAX + TDP_CUDAIPC_GPUS_MAX)

typedef struct tdp__shm_ipc_hello {
    tdp__shm_hello sock;
    tdp__cudaipc_gpus gpus;
} tdp__shm_ipc_hello;

/* This side's record for a pipe on device dev (*len bytes): TDP_ENOTSUP
 * when the device or a UUID is not there (the plane is then not offered). */
tdp_err tdp__shm_ipc_hello_encode(uint8_t buf[TDP_SHM_IPC_REC_MAX], const tdp__shm_hello *sock,
                                  int dev, size_t *len);
/* Decode a record value (this side's own, kept in the link, or the peer's). */
tdp_err tdp__shm_ipc_hello_parse(const uint8_t *val, size_t len, tdp__shm_ipc_hello *out);
/* The peer's: TDP_OK, TDP_ENOENT (none), TDP_EPROTO (malformed). */
tdp_err tdp__shm_ipc_hello_get(const tdp_hello *h, tdp__shm_ipc_hello *out);

#endif
