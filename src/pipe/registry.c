/*
 * registry.c: per-loop state of the pipe layer — the table that maps the
 * token in every incoming frame to its pipe, the one AM handler, the
 * worker's address — and this host's identity for same-host detection.
 */
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "pipe_int.h"
#include "../core/alloc.h"
#include "../core/log.h"

typedef struct grave {
    tdp_td *td;
    ucp_mem_h memh;
    int wi; /* the worker (and context) memh belongs to */
    struct grave *next;
} grave;

struct tdp__shared_ep {
    tdp_loop *loop;
    int wi;
    bool peer_mode;
    bool failed;
    uint32_t refs;
    ucp_ep_h ep;
    size_t alen;
    uint8_t *addr;
    struct tdp__shared_ep *next;
};

typedef struct pipe_reg {
    tdp_loop *loop;
    tdp__ucx *ucx; /* the loop's workers: made before this, freed after */
    grave *graves;
    tdp_pipe *doomed; /* freed pipes whose memory waits for a later turn */
    tdp__shared_ep *eps; /* live shared endpoints */
    tdp__shared_ep *dead_eps; /* failed, still referenced by pipes */
    tdp__am_arg args[TDP_LOOP_WORKERS]; /* each worker's handler knows which it is */
    void **closing;   /* endpoint closes still in progress */
    uint32_t nclosing, capclosing;
    tdp_pipe **tab;
    uint32_t cap;
    ucp_address_t *addr[TDP_LOOP_WORKERS];
    size_t addr_len[TDP_LOOP_WORKERS];
} pipe_reg;

/* Forget the closes UCX has finished. */
static void purge_closing(pipe_reg *r)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < r->nclosing; i++) {
        if (ucp_request_check_status(r->closing[i]) != UCS_INPROGRESS)
            ucp_request_free(r->closing[i]);
        else
            r->closing[k++] = r->closing[i];
    }
    r->nclosing = k;
}

void tdp__reg_track_close(tdp_loop *loop, void *req)
{
    pipe_reg *r = tdp__loop_ext(loop, TDP__EXT_PIPE);
    purge_closing(r);
    if (r->nclosing == r->capclosing) {
        uint32_t cap = r->capclosing ? r->capclosing * 2 : 16;
        void **c = tdp__realloc(r->closing, cap * sizeof(*c));
        if (c == NULL) {
            ucp_request_free(req); /* cannot wait for it: let UCX finish alone */
            return;
        }
        r->closing = c;
        r->capclosing = cap;
    }
    r->closing[r->nclosing++] = req;
}

/*
 * Before the workers go: let endpoint closes (and abandoned requests) finish
 * — destroying a worker with a close in progress can crash UCX 1.13 — then
 * give the addresses back.
 */
static void reg_pre_fini(void *ext)
{
    pipe_reg *r = ext;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t end = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + 1000;
    for (;;) {
        purge_closing(r);
        clock_gettime(CLOCK_MONOTONIC, &ts);
        if (r->nclosing == 0 || (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 > end)
            break;
        for (int i = 0; i < r->ucx->nworkers; i++)
            ucp_worker_progress(r->ucx->worker[i]);
    }
    if (r->nclosing > 0)
        tdp_log_warn("%u endpoint close(s) still in progress as the loop goes", r->nclosing);
    for (uint32_t i = 0; i < r->nclosing; i++)
        ucp_request_free(r->closing[i]);
    r->nclosing = 0;
    tdp__free(r->closing);
    r->closing = NULL;
    for (int i = 0; i < TDP_LOOP_WORKERS; i++) {
        if (r->addr[i] != NULL)
            ucp_worker_release_address(r->ucx->worker[i], r->addr[i]);
        r->addr[i] = NULL;
    }
}

/* After the workers are gone (the contexts still stand): nothing can touch
 * the buried buffers any more. */
static void reg_fini(void *ext)
{
    pipe_reg *r = ext;
    while (r->doomed != NULL) { /* the loop stopped before their turn came */
        tdp_pipe *p = r->doomed;
        r->doomed = p->doomed_next;
        tdp__pipe_destroy(p);
    }
    while (r->graves != NULL) {
        grave *g = r->graves;
        r->graves = g->next;
        if (g->memh != NULL)
            ucp_mem_unmap(r->ucx->context[g->wi], g->memh);
        tdp_td_unref(g->td);
        tdp__free(g);
    }
    tdp__shared_ep *lists[2] = {r->eps, r->dead_eps};
    for (int k = 0; k < 2; k++) { /* pipes never freed: the workers took their eps */
        while (lists[k] != NULL) {
            tdp__shared_ep *e = lists[k];
            lists[k] = e->next;
            tdp__free(e->addr);
            tdp__free(e);
        }
    }
    tdp__free(r->tab);
    tdp__free(r);
}

void tdp__reg_bury(tdp_loop *loop, tdp_td *td, ucp_mem_h memh, int wi)
{
    pipe_reg *r = tdp__loop_ext(loop, TDP__EXT_PIPE);
    grave *g = r ? tdp__calloc(1, sizeof(*g)) : NULL;
    if (g == NULL) {
        /* cannot keep it safely: leaking beats a write into freed memory */
        tdp_log_error("cannot keep a buffer UCX may still use; leaking it");
        return;
    }
    g->td = td;
    g->memh = memh;
    g->wi = wi;
    g->next = r->graves;
    r->graves = g;
}

/* The loop's registry, made (with the loop's UCX workers) on first use. */
static pipe_reg *reg_get(tdp_loop *loop)
{
    pipe_reg *r = tdp__loop_ext(loop, TDP__EXT_PIPE);
    if (r != NULL)
        return r;
    tdp__ucx *ucx;
    if (tdp__ucx_get(loop, &ucx) != TDP_OK)
        return NULL;
    r = tdp__calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    r->loop = loop;
    r->ucx = ucx;
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = TDP_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = tdp__pipe_am_cb,
    };
    for (int i = 0; i < ucx->nworkers; i++) {
        r->args[i] = (tdp__am_arg){.loop = loop, .wi = i};
        hp.arg = &r->args[i];
        ucs_status_t st = ucp_worker_set_am_recv_handler(ucx->worker[i], &hp);
        if (st != UCS_OK) {
            tdp_log_error("ucp_worker_set_am_recv_handler: %s", ucs_status_string(st));
            tdp__free(r);
            return NULL;
        }
    }
    tdp__loop_set_ext(loop, TDP__EXT_PIPE, r, reg_pre_fini, reg_fini);
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
    pipe_reg *r = tdp__loop_ext(p->loop, TDP__EXT_PIPE);
    if (r != NULL && p->reg_index < r->cap && r->tab[p->reg_index] == p)
        r->tab[p->reg_index] = NULL;
}

tdp_pipe *tdp__reg_lookup(tdp_loop *loop, uint64_t token)
{
    pipe_reg *r = tdp__loop_ext(loop, TDP__EXT_PIPE);
    uint32_t i = (uint32_t)token;
    if (r == NULL || i >= r->cap || r->tab[i] == NULL || r->tab[i]->token != token)
        return NULL;
    return r->tab[i];
}

tdp_err tdp__reg_worker_address(tdp_loop *loop, int wi, const void **addr, size_t *len)
{
    pipe_reg *r = reg_get(loop);
    if (r == NULL)
        return TDP_EUCX;
    if (r->ucx->worker[wi] == NULL) {
        *addr = NULL; /* no such worker: an empty address */
        *len = 0;
        return TDP_OK;
    }
    if (r->addr[wi] == NULL) {
        ucs_status_t st =
            ucp_worker_get_address(r->ucx->worker[wi], &r->addr[wi], &r->addr_len[wi]);
        if (st != UCS_OK) {
            tdp_log_error("ucp_worker_get_address: %s", ucs_status_string(st));
            return TDP_EUCX;
        }
    }
    *addr = r->addr[wi];
    *len = r->addr_len[wi];
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

static void destroy_task(void *arg)
{
    tdp_pipe *p = arg;
    pipe_reg *r = tdp__loop_ext(p->loop, TDP__EXT_PIPE);
    for (tdp_pipe **pp = &r->doomed; *pp != NULL; pp = &(*pp)->doomed_next) {
        if (*pp == p) {
            *pp = p->doomed_next;
            break;
        }
    }
    tdp__pipe_destroy(p);
}

void tdp__reg_defer_destroy(tdp_pipe *p)
{
    pipe_reg *r = tdp__loop_ext(p->loop, TDP__EXT_PIPE);
    tdp__reg_remove(p); /* no frame may find it any more */
    tdp__conn_close(p); /* nor its socket: libevent allows this inside its callback */
    p->doomed_next = r->doomed;
    r->doomed = p;
    p->free_task = (tdp__task){.fn = destroy_task, .arg = p};
    tdp__loop_post_task(p->loop, &p->free_task);
}

/* ---- shared endpoints ------------------------------------------------------- */

static void ep_unref(tdp__shared_ep *e);

static void unlink_ep(tdp__shared_ep **list, tdp__shared_ep *e)
{
    for (tdp__shared_ep **pp = list; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == e) {
            *pp = e->next;
            return;
        }
    }
}

/* UCX says the peer behind this endpoint failed: every pipe on it ends. */
static void shared_ep_err(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    tdp__shared_ep *e = arg;
    pipe_reg *r = tdp__loop_ext(e->loop, TDP__EXT_PIPE);
    if (e->failed)
        return;
    e->failed = true;
    unlink_ep(&r->eps, e); /* new pipes to that peer get a fresh endpoint */
    e->next = r->dead_eps;
    r->dead_eps = e;
    e->refs++; /* hold it while the pipes let go */
    for (uint32_t i = 0; i < r->cap; i++) {
        tdp_pipe *p = r->tab[i];
        if (p != NULL && p->sep == e) {
            p->ep_failed = true;
            tdp__pipe_fail(p, TDP_ECONNRESET, ucs_status_string(st));
        }
    }
    ep_unref(e);
}

tdp_err tdp__reg_ep_acquire(tdp_pipe *p, const void *addr, size_t alen, bool peer_mode)
{
    pipe_reg *r = reg_get(p->loop);
    if (r == NULL)
        return TDP_EUCX;
    for (tdp__shared_ep *e = r->eps; e != NULL; e = e->next) {
        if (e->wi == p->wi && e->peer_mode == peer_mode && e->alen == alen &&
            memcmp(e->addr, addr, alen) == 0) {
            e->refs++;
            p->sep = e;
            p->ep = e->ep;
            return TDP_OK;
        }
    }
    tdp__shared_ep *e = tdp__calloc(1, sizeof(*e));
    if (e == NULL || (e->addr = tdp__malloc(alen)) == NULL) {
        tdp__free(e);
        return TDP_ENOMEM;
    }
    memcpy(e->addr, addr, alen);
    e->alen = alen;
    e->loop = p->loop;
    e->wi = p->wi;
    e->peer_mode = peer_mode;
    ucp_ep_params_t prm = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = (const ucp_address_t *)e->addr,
        .err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
    };
    if (peer_mode) {
        prm.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        prm.err_handler.cb = shared_ep_err;
        prm.err_handler.arg = e;
    }
    ucs_status_t st = ucp_ep_create(tdp__ucx_peek(p->loop)->worker[p->wi], &prm, &e->ep);
    if (st != UCS_OK) {
        tdp_log_error("ucp_ep_create: %s", ucs_status_string(st));
        tdp__free(e->addr);
        tdp__free(e);
        return TDP_EUCX;
    }
    e->refs = 1;
    e->next = r->eps;
    r->eps = e;
    p->sep = e;
    p->ep = e->ep;
    return TDP_OK;
}

void tdp__reg_ep_release(tdp_pipe *p)
{
    tdp__shared_ep *e = p->sep;
    p->sep = NULL;
    p->ep = NULL;
    if (e != NULL)
        ep_unref(e);
}

static void ep_unref(tdp__shared_ep *e)
{
    if (--e->refs > 0)
        return;
    pipe_reg *r = tdp__loop_ext(e->loop, TDP__EXT_PIPE);
    unlink_ep(e->failed ? &r->dead_eps : &r->eps, e);
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
        /* in peer-failure mode a forced close releases everything at once
         * (a flush close there keeps TCP sockets open); UCX 1.13 allows it
         * only in that mode */
        .flags = e->peer_mode ? UCP_EP_CLOSE_FLAG_FORCE : 0,
    };
    void *req = ucp_ep_close_nbx(e->ep, &prm);
    if (UCS_PTR_IS_ERR(req))
        tdp_log_debug("ucp_ep_close_nbx: %s", ucs_status_string(UCS_PTR_STATUS(req)));
    else if (req != NULL)
        tdp__reg_track_close(e->loop, req); /* finished before the worker goes */
    tdp__loop_kick(e->loop);
    tdp__free(e->addr);
    tdp__free(e);
}
