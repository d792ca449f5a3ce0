/*
 * session.c: the pipe's state machine — a pipe's creation (candidate
 * links, control channel, timers), then dialing or accepting.
 * The states' work lives beside it, one concern a file: session_hello.c
 * (negotiation and plane choice), session_data.c (the data path),
 * session_reconnect.c (outages), session_end.c (failure, BYE, close,
 * teardown), session_prepare.c, session_opts.c and session_query.c.
 * They call the control channel (ctl.h) and the chosen data plane
 * (plane.h, through its ops table) and hear from them through callbacks;
 * they make no transport call themselves.
 *
 * Everything runs on the loop thread except the public entry points, which
 * hop to it (ops through op.c, the rest through tdp__call_on_loop).
 */
#include <sodium.h>
#include <string.h>

#include "session.h"
#include "session_int.h"
#include "budget.h"
#include "op.h"
#include "../core/alloc.h"

tdp_pipe *tdp__session_new(tdp_loop *loop, const tdp_pipe_opts *opts, const tdp_schema_limits *lim,
                           tdp_err *err)
{
    tdp_pipe *p = tdp__calloc(1, sizeof(*p));
    *err = TDP_ENOMEM;
    if (p == NULL)
        return NULL;
    p->loop = loop;
    p->opts = *opts;
    p->limits = *lim;
    if (opts->secret != NULL) {
        /* a copy: the caller's bytes may go once the pipe is made */
        if (opts->secret_len < TDP_SECRET_MIN || opts->secret_len > TDP_SECRET_MAX ||
            sodium_init() < 0) {
            *err = opts->secret_len < TDP_SECRET_MIN || opts->secret_len > TDP_SECRET_MAX
                       ? TDP_EINVAL
                       : TDP_EINTERNAL;
            tdp__free(p);
            return NULL;
        }
        memcpy(p->secret, opts->secret, opts->secret_len);
        p->secret_len = opts->secret_len;
    }
    p->opts.secret = p->secret_len > 0 ? p->secret : NULL;
    p->opts.secret_len = p->secret_len;
    p->depth = p->opts.recv_depth;
    p->lent1 = -1;
    p->status = TDP_OK;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        p->slots[i].pipe = p;
    p->rel_task = (tdp__task){.fn = tdp__pipe_release_task, .arg = p};
    tdp__waiter_init(&p->w);
    tdp__pipe_ctl_setup(p);
    p->timer = evtimer_new(tdp__loop_base(loop), tdp__pipe_linger_cb, p);
    p->credit_ev = evtimer_new(tdp__loop_base(loop), tdp__pipe_credit_ev_cb, p);
    if (p->opts.latency_stats)
        p->lat = tdp__alloc_array(TDP_LAT_RECV_WAIT + 1, sizeof(*p->lat));
    if (p->timer == NULL || p->credit_ev == NULL || (p->opts.latency_stats && p->lat == NULL) ||
        tdp_op_new(NULL, NULL, &p->sync_send) != TDP_OK ||
        tdp_op_new(NULL, NULL, &p->sync_recv) != TDP_OK)
        goto err_free;
    p->sync_send->waiter = p->sync_recv->waiter = &p->w;
    p->sync_send->owner = p->sync_recv->owner = p;
    p->sync_send->take_back = p->sync_recv->take_back = tdp__pipe_take_back;

    p->retry_ev = evtimer_new(tdp__loop_base(loop), tdp__pipe_retry_cb, p);
    if (p->retry_ev == NULL || (*err = tdp__pipe_make_links(p)) != TDP_OK)
        goto err_free;
    return p;

err_free:
    tdp__session_destroy(p);
    return NULL;
}

static void ready_deadline(tdp_pipe *p)
{
    tdp__pipe_arm_timer(p, p->opts.connect_timeout_ms);
}

tdp_err tdp__session_dial(tdp_pipe *p, const struct sockaddr_storage *addrs, const socklen_t *lens,
                          int n, tdp_pipe_cb ready, void *arg)
{
    if (n <= 0 || n > TDP_CTL_MAX_ADDRS)
        return TDP_EINVAL;
    /* kept: a reconnecting pipe dials them again */
    memcpy(p->addrs, addrs, (size_t)n * sizeof(*addrs));
    memcpy(p->addrlens, lens, (size_t)n * sizeof(*lens));
    p->naddr = n;
    tdp_err rc = tdp__ctl_dial(&p->ctl, addrs, lens, n);
    if (rc != TDP_OK)
        return rc;
    p->ready_cb = ready;
    p->ready_arg = arg;
    ready_deadline(p);
    return TDP_OK;
}

tdp_err tdp__session_accept(tdp_pipe *p, evutil_socket_t fd, const struct sockaddr *sa,
                            tdp_pipe_cb ready, void *arg)
{
    tdp_err rc = tdp__ctl_accept(&p->ctl, fd, sa);
    if (rc != TDP_OK)
        return rc;
    p->ready_cb = ready;
    p->ready_arg = arg;
    ready_deadline(p);
    if (p->hello_hook == NULL || p->secret_len > 0)
        tdp__pipe_send_hello(p); /* a failure here is reported through ready */
    return TDP_OK;
}

void tdp__session_answer_hello(tdp_pipe *p, tdp__hello_hook fn, void *arg)
{
    p->hello_hook = fn;
    p->hello_hook_arg = arg;
}

const char *tdp__session_peer(const tdp_pipe *p)
{
    return p->ctl.peer_name;
}

void tdp__session_set_budget(tdp_pipe *p, struct tdp__budget *b)
{
    tdp__budget_unref(p->budget);
    p->budget = b != NULL ? tdp__budget_ref(b) : NULL;
}
