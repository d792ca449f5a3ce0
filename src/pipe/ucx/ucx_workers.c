/*
 * ucx_workers.c: the pipe layer's UCP contexts and workers, one set per
 * loop, each worker a progress source of the loop (event fd, arm,
 * progress), made on first use and freed with the loop.
 */
#include "ucx_workers.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "../../core/alloc.h"
#include "../../core/log.h"

typedef struct ucx_worker_src {
    ucp_worker_h worker;
    tdp__ucx *u;
    tdp__source *const *src; /* its loop source, once added */
    bool arm_error_logged;
} ucx_worker_src;

typedef struct ucx_state {
    tdp__ucx pub; /* what tdp__ucx_get hands out */
    tdp_loop *loop;
    tdp__source *src[TDP_LOOP_WORKERS];
    ucx_worker_src ws[TDP_LOOP_WORKERS];
} ucx_state;

static tdp_err ucx_fail(const char *what, ucs_status_t st)
{
    tdp_log_error("%s: %s", what, ucs_status_string(st));
    return TDP_EUCX;
}

/* ---- the workers as loop sources ---------------------------------------------- */

static unsigned worker_progress(void *arg)
{
    ucx_worker_src *w = arg;
    w->u->progressing++;
    unsigned n = ucp_worker_progress(w->worker);
    w->u->progressing--;
    return n;
}

static int worker_arm(void *arg)
{
    ucx_worker_src *w = arg;
    if (w->u->in_use == NULL || !w->u->in_use(w->u->in_use_arg)) {
        /* nothing to wake up for: sleep without arming, and without
         * watching its fd (unarmed, UCX's shared-memory transports leave
         * their signal sockets readable, which would make the loop spin) */
        tdp__loop_source_watch(*w->src, false);
        return 0;
    }
    tdp__loop_source_watch(*w->src, true);
    ucs_status_t st = ucp_worker_arm(w->worker);

    if (st == UCS_OK)
        return 0;
    if (st == UCS_ERR_BUSY)
        return 1;             /* events arrived since the last progress */
    if (!w->arm_error_logged) /* the loop logs the failure; this says which */
        tdp_log_debug("ucp_worker_arm: %s", ucs_status_string(st));
    w->arm_error_logged = true;
    return st < 0 ? (int)st : -1;
}

static const tdp__source_ops worker_ops = {
    .progress = worker_progress,
    .arm = worker_arm,
};

/* ---- creating ------------------------------------------------------------------ */

/*
 * The shared-memory transports of UCX_TLS for the same-host worker, or NULL
 * when the user's list leaves none. cma is never among them: it reads a
 * peer's memory with process_vm_readv, and in UCX 1.13 a peer that dies
 * during such a read is a fatal error in the reading process whenever the
 * endpoint has no peer-failure mode (with it, untried here: posix and sysv
 * carry rendezvous data well enough).
 */
static char *local_tls(const char *user)
{
    static const char all[] = "posix,sysv";
    if (user == NULL || user[0] == '\0' || strcmp(user, "all") == 0 || user[0] == '^')
        return tdp__strdup(all); /* an exclusion list keeps these, unless it names them */
    char *out = tdp__calloc(1, sizeof(all));
    char *copy = tdp__strdup(user), *save = NULL;
    if (out == NULL || copy == NULL) {
        tdp__free(out);
        tdp__free(copy);
        return NULL;
    }
    bool posix = false, sysv = false, self = false;
    for (char *t = strtok_r(copy, ",", &save); t != NULL; t = strtok_r(NULL, ",", &save)) {
        posix |= !strcmp(t, "shm") || !strcmp(t, "posix") || !strcmp(t, "sm");
        sysv |= !strcmp(t, "shm") || !strcmp(t, "sysv") || !strcmp(t, "sm");
        self |= !strcmp(t, "self");
    }
    tdp__free(copy);
    if (!posix && !sysv) {
        tdp__free(out);
        return NULL;
    }
    (void)self; /* never "self": a worker's rendezvous to itself leaves requests behind
                 * that crash ucp_worker_destroy in UCX 1.13 */
    snprintf(out, sizeof(all), "%s%s%s", posix ? "posix" : "", posix && sysv ? "," : "",
             sysv ? "sysv" : "");
    return out;
}

/* A worker of context ci as a loop source; on failure nothing is left. */
static tdp_err worker_open(ucx_state *u, int ci, ucx_worker_src *ws, tdp__source **src)
{
    ucp_worker_params_t wparams = {
        .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
        .thread_mode = UCS_THREAD_MODE_SINGLE,
    };
    ucp_worker_h w;
    int efd;
    ucs_status_t st = ucp_worker_create(u->pub.context[ci], &wparams, &w);
    if (st != UCS_OK)
        return ucx_fail("ucp_worker_create", st);
    st = ucp_worker_get_efd(w, &efd);
    if (st != UCS_OK) {
        ucp_worker_destroy(w);
        return ucx_fail("ucp_worker_get_efd", st);
    }
    *ws = (ucx_worker_src){.worker = w, .u = &u->pub, .src = src};
    tdp_err rc = tdp__loop_source_add(u->loop, efd, &worker_ops, ws, src);
    if (rc != TDP_OK) {
        ucp_worker_destroy(w);
        return rc;
    }
    return TDP_OK;
}

/* Context, worker and loop source number i; on failure nothing of i is left. */
static tdp_err worker_init(ucx_state *u, int i, const char *tls)
{
    ucp_config_t *config;
    ucs_status_t st;
    tdp_err rc;

    /* NULL env prefix: UCX_* variables (UCX_TLS, ...) apply as usual */
    st = ucp_config_read(NULL, NULL, &config);
    if (st != UCS_OK)
        return ucx_fail("ucp_config_read", st);
    if (tls != NULL && (st = ucp_config_modify(config, "TLS", tls)) != UCS_OK) {
        ucp_config_release(config);
        return ucx_fail("ucp_config_modify(TLS)", st);
    }
    /* never unified mode: its addresses index this side's resources with
     * numbers a peer chooses, and ucx_addr.c checks the other layout only */
    if ((st = ucp_config_modify(config, "UNIFIED_MODE", "n")) != UCS_OK) {
        ucp_config_release(config);
        return ucx_fail("ucp_config_modify(UNIFIED_MODE)", st);
    }
    /* the shared-memory transports support peer failure only when asked:
     * (UCX_POSIX_ERROR_HANDLING, UCX_SYSV_ERROR_HANDLING: "MM_" names both
     * here); without it an endpoint to a killed peer keeps what it holds forever */
    if (tls != NULL && (st = ucp_config_modify(config, "MM_ERROR_HANDLING", "y")) != UCS_OK) {
        ucp_config_release(config);
        return ucx_fail("ucp_config_modify(ERROR_HANDLING)", st);
    }
    ucp_params_t params = {
        .field_mask = UCP_PARAM_FIELD_FEATURES,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
    };
    st = ucp_init(&params, config, &u->pub.context[i]);
    ucp_config_release(config);
    if (st != UCS_OK) {
        u->pub.context[i] = NULL;
        return ucx_fail("ucp_init", st);
    }
    rc = worker_open(u, i, &u->ws[i], &u->src[i]);
    if (rc != TDP_OK)
        goto err_cleanup_context;
    u->pub.worker[i] = u->ws[i].worker;
    u->pub.nworkers = i + 1;
    return TDP_OK;

err_cleanup_context:
    ucp_cleanup(u->pub.context[i]);
    u->pub.context[i] = NULL;
    return rc;
}

/* Loop free, first round (after the pipe layer's): the workers go. */
static void ucx_pre_fini(void *ext)
{
    ucx_state *u = ext;

    for (int i = u->pub.nworkers - 1; i >= 0; i--) {
        /* the source first: its fd must leave epoll before the worker closes it */
        tdp__loop_source_remove(u->loop, u->src[i]);
        u->src[i] = NULL;
        ucp_worker_destroy(u->pub.worker[i]);
        u->pub.worker[i] = NULL;
    }
    u->pub.nworkers = 0;
}

/* Loop free, last: the contexts, after the pipe layer unmapped its memory. */
static void ucx_fini(void *ext)
{
    ucx_state *u = ext;

    for (int i = TDP_LOOP_WORKERS - 1; i >= 0; i--)
        if (u->pub.context[i] != NULL)
            ucp_cleanup(u->pub.context[i]);
    tdp__free(u);
}

tdp_err tdp__ucx_get(tdp_loop *loop, tdp__ucx **out)
{
    ucx_state *u = tdp__loop_ext(loop, TDP__EXT_UCX);
    tdp_err rc;

    if (u != NULL) {
        *out = &u->pub;
        return TDP_OK;
    }
    u = tdp__calloc(1, sizeof(*u));
    if (u == NULL)
        return TDP_ENOMEM;
    u->loop = loop;
    rc = worker_init(u, TDP_WORKER_ANY, NULL);
    if (rc != TDP_OK)
        goto err_free;
    char *tls = local_tls(getenv("UCX_TLS"));
    if (tls != NULL) {
        /* without it, same-host pipes use worker 0 */
        if (worker_init(u, TDP_WORKER_LOCAL, tls) != TDP_OK)
            tdp_log_info("no same-host shared-memory worker (%s); peers on this host use TCP", tls);
        else
            tdp_log_debug("same-host worker transports: %s", tls);
        tdp__free(tls);
    }
    tdp__loop_set_ext(loop, TDP__EXT_UCX, u, ucx_pre_fini, ucx_fini);
    *out = &u->pub;
    return TDP_OK;

err_free:
    tdp__free(u);
    return rc;
}

tdp__ucx *tdp__ucx_peek(tdp_loop *loop)
{
    ucx_state *u = tdp__loop_ext(loop, TDP__EXT_UCX);
    return u != NULL ? &u->pub : NULL;
}

/* ---- private same-host workers -------------------------------------------------- */

struct tdp__ucx_private {
    ucx_state *u;
    ucx_worker_src ws;
    tdp__source *src;
};

/*
 * Whether this process can open PRIVATE_FDS more descriptors now. A worker
 * of the same-host context opens about 7 (shared-memory segments, signal
 * sockets, event fds); UCX 1.13 leaks memory, and logs a screenful, when
 * that runs out halfway, so a worker is not tried without the headroom.
 */
#define PRIVATE_FDS 12
static bool fds_to_spare(void)
{
    int fd[PRIVATE_FDS], n = 0;
    while (n < PRIVATE_FDS && (fd[n] = eventfd(0, EFD_CLOEXEC)) >= 0)
        n++;
    for (int i = 0; i < n; i++)
        close(fd[i]);
    return n == PRIVATE_FDS;
}

/* private workers alive in the process (tdp__ucx_private_live) */
static atomic_uint private_live;

unsigned tdp__ucx_private_live(void)
{
    return atomic_load(&private_live);
}

tdp_err tdp__ucx_private_new(tdp__ucx *pub, tdp__ucx_private **out)
{
    ucx_state *u = (ucx_state *)pub; /* pub is ucx_state's first member */
    if (pub->nworkers <= TDP_WORKER_LOCAL || pub->context[TDP_WORKER_LOCAL] == NULL)
        return TDP_EINVAL;
    if (!fds_to_spare())
        return TDP_ENOMEM;
    tdp__ucx_private *p = tdp__calloc(1, sizeof(*p));
    if (p == NULL)
        return TDP_ENOMEM;
    p->u = u;
    tdp_err rc = worker_open(u, TDP_WORKER_LOCAL, &p->ws, &p->src);
    if (rc != TDP_OK) {
        tdp__free(p);
        return rc;
    }
    atomic_fetch_add(&private_live, 1);
    *out = p;
    return TDP_OK;
}

ucp_worker_h tdp__ucx_private_worker(const tdp__ucx_private *p)
{
    return p->ws.worker;
}

void tdp__ucx_private_free(tdp__ucx_private *p)
{
    if (p == NULL)
        return;
    /* the source first: its fd must leave epoll before the worker closes it */
    tdp__loop_source_remove(p->u->loop, p->src);
    ucp_worker_destroy(p->ws.worker);
    tdp__free(p);
    atomic_fetch_sub(&private_live, 1);
}
