/*
 * registry.c: per-loop state of the pipe layer — the table that maps the
 * token in every incoming frame to its pipe, the one AM handler, the
 * worker's address — and this host's identity for same-host detection.
 */
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>
#include <xxhash.h>

#include "pipe_int.h"
#include "../core/alloc.h"
#include "../core/log.h"

typedef struct grave {
    tdp_td *td;
    ucp_mem_h memh;
    struct grave *next;
} grave;

typedef struct pipe_reg {
    tdp_loop *loop;
    grave *graves;
    tdp_pipe **tab;
    uint32_t cap;
    ucp_address_t *addr;
    size_t addr_len;
} pipe_reg;

/* Before the worker goes: give its address back, drop abandoned pipes' eps. */
static void reg_pre_fini(void *ext)
{
    pipe_reg *r = ext;
    ucp_worker_h w = tdp__loop_worker(r->loop);
    if (r->addr != NULL)
        ucp_worker_release_address(w, r->addr);
    r->addr = NULL;
}

/* After the worker is gone: nothing can touch the buried buffers any more. */
static void reg_fini(void *ext)
{
    pipe_reg *r = ext;
    while (r->graves != NULL) {
        grave *g = r->graves;
        r->graves = g->next;
        if (g->memh != NULL)
            ucp_mem_unmap(tdp__loop_context(r->loop), g->memh);
        tdp_td_unref(g->td);
        tdp__free(g);
    }
    tdp__free(r->tab);
    tdp__free(r);
}

void tdp__reg_bury(tdp_loop *loop, tdp_td *td, ucp_mem_h memh)
{
    pipe_reg *r = tdp__loop_pipe_ext(loop);
    grave *g = r ? tdp__calloc(1, sizeof(*g)) : NULL;
    if (g == NULL) {
        /* cannot keep it safely: leaking beats a write into freed memory */
        tdp_log_error("cannot keep a buffer UCX may still use; leaking it");
        return;
    }
    g->td = td;
    g->memh = memh;
    g->next = r->graves;
    r->graves = g;
}

static pipe_reg *reg_get(tdp_loop *loop)
{
    pipe_reg *r = tdp__loop_pipe_ext(loop);
    if (r != NULL)
        return r;
    r = tdp__calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    r->loop = loop;
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = TDP_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = tdp__pipe_am_cb,
        .arg = loop,
    };
    ucs_status_t st = ucp_worker_set_am_recv_handler(tdp__loop_worker(loop), &hp);
    if (st != UCS_OK) {
        tdp_log_error("ucp_worker_set_am_recv_handler: %s", ucs_status_string(st));
        tdp__free(r);
        return NULL;
    }
    tdp__loop_set_pipe_ext(loop, r, reg_pre_fini, reg_fini);
    return r;
}

static uint64_t random64(void)
{
    uint64_t v;
    if (getrandom(&v, sizeof(v), 0) != (ssize_t)sizeof(v)) {
        static _Atomic uint64_t ctr;
        v = XXH3_64bits_withSeed(&v, sizeof(v), (uint64_t)getpid() ^ atomic_fetch_add(&ctr, 1));
    }
    return v;
}

tdp_err tdp__reg_add(tdp_pipe *p)
{
    pipe_reg *r = reg_get(p->loop);
    if (r == NULL)
        return TDP_EUCX;
    uint32_t i;
    for (i = 0; i < r->cap; i++)
        if (r->tab[i] == NULL)
            break;
    if (i == r->cap) {
        uint32_t cap = r->cap ? r->cap * 2 : 16;
        tdp_pipe **t = tdp__realloc(r->tab, cap * sizeof(*t));
        if (t == NULL)
            return TDP_ENOMEM;
        memset(t + r->cap, 0, (cap - r->cap) * sizeof(*t));
        r->tab = t;
        r->cap = cap;
    }
    r->tab[i] = p;
    p->reg_index = i;
    /* high half random: a stale or forged token names no live pipe */
    p->token = (random64() & 0xffffffff00000000ull) | i;
    return TDP_OK;
}

void tdp__reg_remove(tdp_pipe *p)
{
    pipe_reg *r = tdp__loop_pipe_ext(p->loop);
    if (r != NULL && p->reg_index < r->cap && r->tab[p->reg_index] == p)
        r->tab[p->reg_index] = NULL;
}

tdp_pipe *tdp__reg_lookup(tdp_loop *loop, uint64_t token)
{
    pipe_reg *r = tdp__loop_pipe_ext(loop);
    uint32_t i = (uint32_t)token;
    if (r == NULL || i >= r->cap || r->tab[i] == NULL || r->tab[i]->token != token)
        return NULL;
    return r->tab[i];
}

tdp_err tdp__reg_worker_address(tdp_loop *loop, const void **addr, size_t *len)
{
    pipe_reg *r = reg_get(loop);
    if (r == NULL)
        return TDP_EUCX;
    if (r->addr == NULL) {
        ucs_status_t st = ucp_worker_get_address(tdp__loop_worker(loop), &r->addr, &r->addr_len);
        if (st != UCS_OK) {
            tdp_log_error("ucp_worker_get_address: %s", ucs_status_string(st));
            return TDP_EUCX;
        }
    }
    *addr = r->addr;
    *len = r->addr_len;
    return TDP_OK;
}

/*
 * Host identity: the kernel's boot id, the host name and the IPC namespace.
 * Two processes with the same id share a kernel and shared memory.
 */
static uint8_t host_id[TDP_HOST_ID_LEN];
static pthread_once_t host_once = PTHREAD_ONCE_INIT;

static void host_id_init(void)
{
    char buf[512] = {0};
    size_t n = 0;
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t r = read(fd, buf, 64);
        n = r > 0 ? (size_t)r : 0;
        close(fd);
    }
    gethostname(buf + n, 128);
    n += strlen(buf + n);
    ssize_t r = readlink("/proc/self/ns/ipc", buf + n, sizeof(buf) - n - 1);
    n += r > 0 ? (size_t)r : 0;
    XXH128_hash_t h = XXH3_128bits(buf, n);
    memcpy(host_id, &h.low64, 8);
    memcpy(host_id + 8, &h.high64, 8);
}

const uint8_t *tdp__host_id(void)
{
    pthread_once(&host_once, host_id_init);
    return host_id;
}
