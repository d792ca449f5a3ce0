/*
 * session_query.c: what the application may ask of a pipe — statistics,
 * status, latency, the receive schema, the peer, the plane. Each answer is
 * read on the loop thread (tdp__call_on_loop), where the state lives.
 */
#include <stddef.h>
#include <string.h>

#include "session.h"
#include "session_int.h"
#include "../core/sized.h"
#include "../schema/schema_int.h"

static void stats_task(void *arg)
{
    void **a = arg;
    *(tdp_pipe_stats *)a[1] = ((tdp_pipe *)a[0])->stats;
}

void tdp_pipe_stats_get_sized(const tdp_pipe *pipe, tdp_pipe_stats *out, size_t size)
{
    if (pipe == NULL || out == NULL)
        return;
    tdp_pipe_stats st;
    void *a[2] = {(void *)pipe, &st};
    tdp__call_on_loop(pipe->loop, stats_task, a);
    tdp__fill_sized(out, size, &st, sizeof(st));
}

/* Callers built before the macro: the struct as it was then. */
void(tdp_pipe_stats_get)(const tdp_pipe *pipe, tdp_pipe_stats *out)
{
    tdp_pipe_stats_get_sized(pipe, out, offsetof(tdp_pipe_stats, resumed_from) + sizeof(uint64_t));
}

static void status_task(void *arg)
{
    void **a = arg;
    *(tdp_err *)a[1] = ((tdp_pipe *)a[0])->status;
}

typedef struct lat_copy {
    const tdp_pipe *pipe;
    tdp_latency which;
    tdp_hist *out;
    tdp_err rc;
} lat_copy;

static void latency_task(void *arg)
{
    lat_copy *c = arg;
    if (c->pipe->lat == NULL) {
        c->rc = TDP_ENOTSUP;
        return;
    }
    *c->out = c->pipe->lat[c->which];
    c->rc = TDP_OK;
}

tdp_err tdp_pipe_latency_get(const tdp_pipe *pipe, tdp_latency which, tdp_hist *out)
{
    if (pipe == NULL || out == NULL || (which != TDP_LAT_SEND && which != TDP_LAT_RECV_WAIT))
        return TDP_EINVAL;
    if (pipe->lat == NULL)
        return TDP_ENOTSUP;
    /* copied on the loop thread, which alone records */
    lat_copy c = {.pipe = pipe, .which = which, .out = out, .rc = TDP_EINVAL};
    tdp__call_on_loop(pipe->loop, latency_task, &c);
    return c.rc;
}

tdp_err tdp_pipe_status(const tdp_pipe *pipe)
{
    if (pipe == NULL)
        return TDP_EINVAL;
    void *a[2] = {(void *)pipe, NULL};
    tdp_err st = TDP_OK;
    a[1] = &st;
    tdp__call_on_loop(pipe->loop, status_task, a);
    return st;
}

static void recv_schema_task(void *arg)
{
    void **a = arg;
    *(tdp_schema **)a[1] = ((tdp_pipe *)a[0])->rx_schema;
}

tdp_schema *tdp_pipe_recv_schema(const tdp_pipe *pipe)
{
    if (pipe == NULL)
        return NULL;
    /* read on the loop thread: it replaces the schema when a new one arrives */
    tdp_schema *sc = NULL;
    void *a[2] = {(void *)pipe, &sc};
    tdp__call_on_loop(pipe->loop, recv_schema_task, a);
    return sc;
}

const char *tdp_pipe_peer(const tdp_pipe *pipe, char *buf, size_t len)
{
    if (buf != NULL && len > 0)
        snprintf(buf, len, "%s", pipe ? pipe->ctl.peer_name : "?");
    return buf;
}

bool tdp_pipe_same_host(const tdp_pipe *pipe)
{
    return pipe && pipe->same_host;
}

tdp_plane tdp_pipe_plane(const tdp_pipe *pipe)
{
    return pipe && pipe->plane ? (tdp_plane)pipe->plane->id : TDP_PLANE_AUTO;
}

struct tdp__link *tdp__session_link(const tdp_pipe *p)
{
    return p->link;
}

tdp_loop *tdp__session_loop(const tdp_pipe *p)
{
    return p->loop;
}

bool tdp__session_send_waiting(const tdp_pipe *p, const tdp_op *op)
{
    for (const tdp_op *o = p->sendq.head; o != NULL; o = o->next)
        if (o == op)
            return true;
    return false;
}

void tdp__session_set_credit_cb(tdp_pipe *p, void (*cb)(void *arg), void *arg)
{
    p->credit_cb = cb;
    p->credit_arg = arg;
}

bool tdp__session_send_credit(const tdp_pipe *p)
{
    return p->state == PIPE_OPEN && !p->peer_bye && !p->link_failed && p->sendq.head == NULL &&
           p->free_tickets != NULL && p->send_seq - p->credit_base - p->peer_credit < p->peer_depth;
}

void tdp__session_keep_window(tdp_pipe *p, uint64_t window)
{
    if (p != NULL && window < p->peer_window)
        p->peer_window = window;
}
