/*
 * server.c: tdp_server — a listener whose accepted pipes each become a
 * client: one receive op re-posted after every on_message, a fixed ring of
 * reply ops, the application's handler, limits, graceful shutdown, counters.
 *
 * Everything runs on the loop thread except tdp_server_new, _shutdown,
 * _free (they hop to it with tdp__call_on_loop) and tdp_server_stats_get
 * (it takes the lock). A client's pipe is freed only from the server's own
 * work event or a timer, never inside a callback of that pipe, and only
 * after its operations were all handed back.
 */
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <tdpipe/server.h>

#include "../core/loop_int.h"
#include "../pipe/budget.h"
#include "../pipe/listener.h"
#include "../pipe/op.h"
#include "../pipe/session.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../core/sized.h"

#define DEFAULT_MAX_CLIENTS  1024u
#define DEFAULT_IDLE_MS      300000
#define DEFAULT_HANDSHAKE_MS 5000
#define DEFAULT_REPLIES      4u
#define MAX_REPLIES          1024u
#define FREE_SHUTDOWN_MS     1000

enum client_state {
    CL_OPEN,    /* receiving; the handler sees every message */
    CL_CLOSING, /* our clean close: queued replies drain, then BYE */
    CL_ENDED,   /* gone for the application; the pipe winds down */
    CL_FREEING, /* being freed: completions do nothing */
};

typedef struct tx_slot {
    tdp_client *c;
    tdp_op *op;
    tdp_td *pin; /* the lent td this reply references, or NULL */
    bool busy;
} tx_slot;

struct tdp_client {
    tdp_server *srv;
    uint64_t id;
    tdp_pipe *pipe;
    void *data;
    enum client_state state;
    tdp_err status;     /* why it ended */
    bool greeted;       /* on_connect ran: on_close will */
    bool turned_away;   /* on_connect said no */
    bool reported;      /* on_close ran */
    bool close_started; /* pipe close requested */
    bool aborted;       /* pipe ended by the server */
    bool pipe_ended;    /* the pipe is over and its socket closed */
    bool linger_armed;  /* the timer now bounds the wait for the peer to hang up */
    bool timer_fired;
    bool unpin;          /* a reply that referenced a lent td completed */
    bool active;         /* a message came or went since the last idle check */
    bool idle;           /* closed for idleness: on_close says TDP_ETIMEDOUT */
    int64_t quiet_since; /* when the idle check last saw it active, ms */
    bool dirty;
    bool in_rop, rop_again;
    bool recv_wait; /* depth 1: the next receive waits for replies to the lent td */
    tdp_op *rop;
    tdp_td *cur;   /* the td on_message is handling */
    tdp_td **held; /* handled tds replies still reference (released after them) */
    uint32_t nheld;
    tx_slot *tx;
    uint32_t ntx;
    uint32_t *txfree;
    uint32_t nfree;
    struct event *timer;
    tdp_pipe_stats seen; /* what the totals already hold of this pipe's counters */
    tdp_client *prev, *next;
    tdp_client *dnext;
};

struct tdp_server {
    tdp_loop *loop;
    tdp_listener *lis;
    tdp_server_opts opts;
    tdp_server_handler h;
    void *arg;
    uint16_t port;
    uint32_t depth;
    int64_t linger_ms;
    struct event *work; /* runs client_step for the dirty queue on a clean stack */
    struct event *idle; /* the idle check, every idle_timeout_ms / 4 */
    tdp_client *clients;
    uint32_t nclients; /* client objects alive: each holds a slot */
    tdp_client *dhead, *dtail;
    uint64_t next_id;
    bool stopping, forcing;
    bool shut_done;
    tdp_err shut_rc;
    volatile bool all_gone;
    pthread_mutex_t mtx; /* st and all_gone */
    pthread_cond_t cond;
    tdp_server_stats st;
    tdp__budget *budget; /* opts.max_memory, shared with every client's pipe */
};

static void mark_dirty(tdp_client *c);
static void client_end(tdp_client *c, tdp_err status);

/* ---- options ---------------------------------------------------------------- */

void tdp_server_opts_default(tdp_server_opts *o)
{
    if (o == NULL)
        return;
    tdp_listener_opts lo; /* the handshake limits are the listener's: one set of defaults */
    tdp_listener_opts_default(&lo);
    *o = (tdp_server_opts){
        .size = sizeof(*o),
        .max_clients = DEFAULT_MAX_CLIENTS,
        .handshake_timeout_ms = DEFAULT_HANDSHAKE_MS,
        .max_replies_queued = 0, /* 4, or the receive depth when larger */
        .max_pending = lo.max_pending,
        .max_per_source = lo.max_per_source,
        .idle_timeout_ms = DEFAULT_IDLE_MS,
    };
    tdp_pipe_opts_default(&o->pipe);
}

static void opts_resolve(const tdp_server_opts *in, tdp_server_opts *out)
{
    tdp_server_opts_default(out);
    if (in == NULL)
        return;
    size_t n = in->size < sizeof(*in) ? in->size : sizeof(*in);
#define TAKE(f)                                                                                    \
    if (offsetof(tdp_server_opts, f) + sizeof(in->f) <= n && in->f)                                \
        out->f = in->f;
    TAKE(max_clients)
    TAKE(handshake_timeout_ms)
    TAKE(max_replies_queued)
    TAKE(max_pending)
    TAKE(max_per_source)
    TAKE(idle_timeout_ms)
    TAKE(max_memory)
#undef TAKE
    if (offsetof(tdp_server_opts, pipe) + sizeof(in->pipe) <= n && in->pipe.size != 0)
        out->pipe = in->pipe;
    if (out->handshake_timeout_ms < 0)
        out->handshake_timeout_ms = DEFAULT_HANDSHAKE_MS;
    if (out->idle_timeout_ms < 0)
        out->idle_timeout_ms = -1; /* never */
    if (out->max_replies_queued > MAX_REPLIES)
        out->max_replies_queued = MAX_REPLIES;
}

/* ---- counters --------------------------------------------------------------- */

#define STAT_ADD(s, field, v)                                                                      \
    do {                                                                                           \
        pthread_mutex_lock(&(s)->mtx);                                                             \
        (s)->st.field += (v);                                                                      \
        pthread_mutex_unlock(&(s)->mtx);                                                           \
    } while (0)

/* Add what the client's pipe counted since last time to the totals. */
static void stats_sync(tdp_client *c)
{
    tdp_server *s = c->srv;
    tdp_pipe_stats now;
    tdp_pipe_stats_get(c->pipe, &now);
    pthread_mutex_lock(&s->mtx);
    s->st.msgs_recv += now.msgs_recv - c->seen.msgs_recv;
    s->st.msgs_sent += now.msgs_sent - c->seen.msgs_sent;
    s->st.bytes_recv += now.bytes_recv - c->seen.bytes_recv;
    s->st.bytes_sent += now.bytes_sent - c->seen.bytes_sent;
    s->st.schemas_recv += now.schemas_recv - c->seen.schemas_recv;
    pthread_mutex_unlock(&s->mtx);
    c->seen = now;
}

void tdp_server_stats_get_sized(const tdp_server *s, tdp_server_stats *out, size_t size)
{
    if (s == NULL || out == NULL)
        return;
    tdp_server *m = (tdp_server *)s; /* the lock is not part of the value */
    tdp_server_stats st;
    pthread_mutex_lock(&m->mtx);
    st = m->st;
    pthread_mutex_unlock(&m->mtx);
    st.memory_used = tdp__budget_used(m->budget);
    st.memory_cap = m->budget->cap;
    st.memory_refused = tdp__budget_refused(m->budget);
    tdp__fill_sized(out, size, &st, sizeof(st));
}

/* Callers built before the macro: the struct as it was then. */
void(tdp_server_stats_get)(const tdp_server *s, tdp_server_stats *out)
{
    tdp_server_stats_get_sized(s, out, offsetof(tdp_server_stats, idle_closed) + sizeof(uint64_t));
}

/* ---- clients: creation and freeing ------------------------------------------ */

static void rop_cb(tdp_op *op, void *arg);
static void tx_cb(tdp_op *op, void *arg);

static void timer_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_client *c = arg;
    c->timer_fired = true;
    mark_dirty(c);
}

static void timer_arm(tdp_client *c, int64_t ms)
{
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    c->timer_fired = false;
    evtimer_add(c->timer, &tv);
}

static void client_release(tdp_client *c)
{
    if (c->tx != NULL)
        for (uint32_t i = 0; i < c->ntx; i++)
            tdp_op_free(c->tx[i].op);
    tdp_op_free(c->rop);
    if (c->timer != NULL)
        event_free(c->timer);
    tdp__free(c->tx);
    tdp__free(c->txfree);
    tdp__free(c->held);
    tdp__free(c);
}

/* Everything a client will ever need, allocated once, here. */
static tdp_client *client_new(tdp_server *s, tdp_pipe *p)
{
    tdp_client *c = tdp__calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->srv = s;
    c->pipe = p;
    c->ntx = s->opts.max_replies_queued;
    c->tx = tdp__alloc_array(c->ntx, sizeof(*c->tx));
    c->txfree = tdp__alloc_array(c->ntx, sizeof(*c->txfree));
    c->held = tdp__alloc_array(s->depth, sizeof(*c->held));
    c->timer = evtimer_new(tdp__loop_base(s->loop), timer_cb, c);
    if (c->tx == NULL || c->txfree == NULL || c->held == NULL || c->timer == NULL ||
        tdp_op_new(rop_cb, c, &c->rop) != TDP_OK)
        goto err_release;
    for (uint32_t i = 0; i < c->ntx; i++) {
        c->tx[i].c = c;
        if (tdp_op_new(tx_cb, &c->tx[i], &c->tx[i].op) != TDP_OK)
            goto err_release;
        c->txfree[c->nfree++] = c->ntx - 1 - i; /* slot 0 is used first */
    }
    c->id = ++s->next_id;
    return c;

err_release:
    client_release(c);
    return NULL;
}

static void dirty_unlink(tdp_client *c)
{
    tdp_server *s = c->srv;
    tdp_client *prev = NULL;
    for (tdp_client *x = s->dhead; x != NULL; prev = x, x = x->dnext) {
        if (x != c)
            continue;
        if (prev != NULL)
            prev->dnext = c->dnext;
        else
            s->dhead = c->dnext;
        if (s->dtail == c)
            s->dtail = prev;
        break;
    }
    c->dnext = NULL;
    c->dirty = false;
}

static void check_all_gone(tdp_server *s)
{
    if (!s->stopping || s->nclients != 0)
        return;
    pthread_mutex_lock(&s->mtx);
    s->all_gone = true;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mtx);
}

/*
 * Free a client: its pipe (which hands every pending op back first, to
 * callbacks that now do nothing), its ops, its slot. Only from a clean
 * stack: the work event, the shutdown task.
 */
static void client_free(tdp_client *c)
{
    tdp_server *s = c->srv;
    stats_sync(c);
    c->state = CL_FREEING;
    if (c->dirty)
        dirty_unlink(c);
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        s->clients = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    s->nclients--;
    tdp_pipe_set_end_cb(c->pipe, NULL, NULL);
    tdp_pipe_free(c->pipe);
    c->pipe = NULL;
    client_release(c);
    pthread_mutex_lock(&s->mtx);
    s->st.clients_now = s->nclients;
    pthread_mutex_unlock(&s->mtx);
    check_all_gone(s);
}

/* ---- clients: the state machine -------------------------------------------- */

static void mark_dirty(tdp_client *c)
{
    tdp_server *s = c->srv;
    if (c->dirty || c->state == CL_FREEING)
        return;
    c->dirty = true;
    c->dnext = NULL;
    if (s->dtail != NULL)
        s->dtail->dnext = c;
    else
        s->dhead = c;
    s->dtail = c;
    event_active(s->work, EV_READ, 0);
}

static void client_end(tdp_client *c, tdp_err status)
{
    if (c->state >= CL_ENDED)
        return;
    c->state = CL_ENDED;
    c->status = c->idle && status == TDP_ECLOSED ? TDP_ETIMEDOUT : status;
    mark_dirty(c);
}


static bool pinned(const tdp_client *c, const tdp_td *td)
{
    for (uint32_t i = 0; i < c->ntx; i++)
        if (c->tx[i].busy && c->tx[i].pin == td)
            return true;
    return false;
}

/* Give back the lent tds no reply references any more; resume receiving. */
static void release_unpinned(tdp_client *c)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < c->nheld; i++) {
        tdp_td *td = c->held[i];
        if (pinned(c, td))
            c->held[k++] = td;
        else if (c->state < CL_ENDED)
            tdp_pipe_release(c->pipe, td);
    }
    c->nheld = k;
    if (c->recv_wait && c->nheld == 0 && c->state < CL_ENDED) {
        c->recv_wait = false;
        tdp_pipe_recv_async(c->pipe, c->rop);
    }
}

static void client_step(tdp_client *c)
{
    tdp_server *s = c->srv;
    tdp_pipe *p = c->pipe;

    if (c->unpin) {
        c->unpin = false;
        release_unpinned(c);
    }
    if (c->state == CL_CLOSING) {
        if (!c->close_started) {
            c->close_started = true;
            timer_arm(c, s->linger_ms); /* a client that never takes its replies */
            tdp_pipe_close_async(p, -1);
        } else if (c->timer_fired && !c->pipe_ended) {
            c->timer_fired = false;
            tdp_log_info("server: client %s: replies not taken before the close deadline",
                         tdp_pipe_peer(p, (char[64]){0}, 64));
            tdp_pipe_abort(p, TDP_ETIMEDOUT);
        }
        /* a pipe that ended meanwhile completed the receive: the client is ENDED */
    }
    if (c->state != CL_ENDED)
        return;
    if (!c->reported) {
        c->reported = true;
        if (c->greeted && s->h.on_close != NULL)
            s->h.on_close(c, c->status, s->arg);
    }
    if (!c->pipe_ended) {
        if (c->status == TDP_ECLOSED && !s->forcing) {
            if (!c->close_started) {
                c->close_started = true;
                tdp_pipe_close_async(p, -1); /* answer the peer's BYE with ours */
            }
        } else if (!c->aborted) {
            tdp_err why = c->turned_away ? TDP_ELIMIT : c->status;
            c->aborted = true;
            tdp_pipe_abort(p, why == TDP_ECLOSED ? TDP_ECANCELED : why);
        }
    }
    if (!c->linger_armed) {
        c->linger_armed = true;
        timer_arm(c, s->linger_ms); /* the peer has this long to hang up */
    }
    /* free once the pipe is over and the peer hung up: it has read our last word */
    if (c->pipe_ended || c->timer_fired || s->forcing)
        client_free(c);
}

static void work_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_server *s = arg;
    tdp_client *c;
    while ((c = s->dhead) != NULL) {
        s->dhead = c->dnext;
        if (s->dhead == NULL)
            s->dtail = NULL;
        c->dnext = NULL;
        c->dirty = false;
        client_step(c);
    }
    check_all_gone(s);
}

/* ---- clients: receiving and replying ----------------------------------------- */

/* One completed receive: hand it to the handler, then receive the next. */
static void rop_handle(tdp_client *c)
{
    tdp_server *s = c->srv;
    tdp_err rc = tdp_op_result(c->rop);

    if (c->state >= CL_ENDED)
        return;
    stats_sync(c);
    c->active = true;
    if (rc != TDP_OK) {
        if (rc != TDP_ECLOSED) {
            STAT_ADD(s, client_errors, 1);
            tdp_log_debug("server: client %llu ended: %s", (unsigned long long)c->id,
                          tdp_strerror(rc));
        }
        client_end(c, rc);
        return;
    }
    tdp_td *td = tdp_op_td(c->rop);
    if (c->state == CL_OPEN && s->h.on_message != NULL) {
        c->cur = td;
        tdp_err hr = s->h.on_message(c, td, s->arg);
        c->cur = NULL;
        if (hr != TDP_OK) {
            STAT_ADD(s, handler_errors, 1);
            tdp_log_info("server: client %llu: handler returned %s: closing this client",
                         (unsigned long long)c->id, tdp_strerror(hr));
            client_end(c, hr);
            return;
        }
    }
    if (pinned(c, td)) {
        /* a reply reads this buffer: it is given back when the reply is out */
        c->held[c->nheld++] = td;
        if (s->depth == 1) {
            c->recv_wait = true; /* the next receive would overwrite it */
            return;
        }
    } else if (s->depth > 1) {
        tdp_pipe_release(c->pipe, td);
    }
    tdp_pipe_recv_async(c->pipe, c->rop); /* depth 1: this releases td */
}

static void rop_cb(tdp_op *op, void *arg)
{
    tdp_client *c = arg;
    /* a re-posted receive may complete inline: loop instead of recursing */
    if (c->in_rop) {
        c->rop_again = true;
        return;
    }
    c->in_rop = true;
    do {
        c->rop_again = false;
        rop_handle(c);
    } while (c->rop_again);
    c->in_rop = false;
}

static void tx_cb(tdp_op *op, void *arg)
{
    tx_slot *t = arg;
    tdp_client *c = t->c;
    tdp_td *pin = t->pin;
    t->busy = false;
    t->pin = NULL;
    c->txfree[c->nfree++] = (uint32_t)(t - c->tx);
    if (c->state == CL_FREEING)
        return;
    stats_sync(c);
    c->active = true;
    if (pin != NULL && !pinned(c, pin)) {
        c->unpin = true;
        mark_dirty(c); /* not here: this runs inside the pipe's send path */
    }
}

tdp_err tdp_client_send(tdp_client *c, tdp_td *td)
{
    if (c == NULL || td == NULL || !tdp_loop_on_thread(c->srv->loop))
        return TDP_EINVAL;
    if (c->state != CL_OPEN)
        return TDP_ECLOSED;
    tdp_err ps = tdp_pipe_status(c->pipe);
    if (ps != TDP_OK)
        return ps;
    if (c->nfree == 0)
        return TDP_EAGAIN;
    tx_slot *t = &c->tx[c->txfree[--c->nfree]];
    t->busy = true;
    t->pin = td == c->cur ? td : NULL;
    tdp_pipe_send_async(c->pipe, td, t->op); /* may complete (tx_cb) before returning */
    return TDP_OK;
}

void tdp_client_close(tdp_client *c)
{
    if (c == NULL || !tdp_loop_on_thread(c->srv->loop) || c->state != CL_OPEN)
        return;
    c->state = CL_CLOSING;
    mark_dirty(c);
}

tdp_pipe *tdp_client_pipe(tdp_client *c)
{
    return c ? c->pipe : NULL;
}

uint64_t tdp_client_id(const tdp_client *c)
{
    return c ? c->id : 0;
}

void tdp_client_set_data(tdp_client *c, void *data)
{
    if (c != NULL)
        c->data = data;
}

void *tdp_client_get_data(const tdp_client *c)
{
    return c ? c->data : NULL;
}

/* ---- listener hooks ------------------------------------------------------------ */

/*
 * Handshakes and clients are counted apart: sockets that never complete a
 * handshake take no client's place. The handshake limits (max_pending,
 * max_per_source) are the listener's own.
 */
static bool srv_admit(void *arg, uint32_t npending)
{
    tdp_server *s = arg;
    const char *why = NULL;
    if (s->stopping)
        why = "stopping";
    else if (s->nclients >= s->opts.max_clients)
        why = "max clients";
    if (why == NULL)
        return true;
    STAT_ADD(s, refused, 1);
    tdp_log_debug("server: refusing a client: %s (%u clients, %u handshaking)", why, s->nclients,
                  npending);
    return false;
}

static void srv_refused(void *arg, tdp_err why)
{
    tdp_server *s = arg;
    STAT_ADD(s, refused, 1);
}

static void srv_pending(void *arg, uint32_t npending)
{
    tdp_server *s = arg;
    pthread_mutex_lock(&s->mtx);
    s->st.pending_now = npending;
    pthread_mutex_unlock(&s->mtx);
}

static void srv_handshake_failed(void *arg, tdp_err why)
{
    tdp_server *s = arg;
    STAT_ADD(s, handshakes_failed, 1);
}

/* The pipe is over and its socket closed: nothing of it reaches the network any more. */
static void srv_pipe_ended(tdp_pipe *p, tdp_err status, void *arg)
{
    tdp_client *c = arg;
    c->pipe_ended = true;
    mark_dirty(c);
}

/* A handshake completed. Runs inside the pipe's HELLO handling: p must live on. */
static void srv_on_accept(tdp_pipe *p, tdp_err status, void *arg)
{
    tdp_server *s = arg;
    if (status != TDP_OK || p == NULL)
        return;
    /* handshakes are not counted in max_clients: the server may have filled meanwhile */
    if (s->nclients >= s->opts.max_clients) {
        STAT_ADD(s, refused, 1);
        tdp_log_debug("server: refusing a client: max clients (%u) after its handshake",
                      s->nclients);
        tdp_pipe_abort(p, TDP_ELIMIT);
        tdp_pipe_free(p); /* safe inside its own callback: the memory goes later */
        return;
    }
    tdp_client *c = client_new(s, p);
    if (c == NULL) {
        STAT_ADD(s, refused, 1);
        tdp_log_warn("server: no memory for a client");
        tdp_pipe_abort(p, TDP_ENOMEM);
        tdp_pipe_free(p); /* safe inside its own callback: the memory goes later */
        return;
    }
    c->next = s->clients;
    if (s->clients != NULL)
        s->clients->prev = c;
    s->clients = c;
    s->nclients++;
    c->quiet_since = tdp__now_ms();
    pthread_mutex_lock(&s->mtx);
    s->st.clients_now = s->nclients;
    pthread_mutex_unlock(&s->mtx);
    tdp_pipe_set_end_cb(p, srv_pipe_ended, c);

    c->greeted = true;
    tdp_err rc = s->h.on_connect != NULL ? s->h.on_connect(c, s->arg) : TDP_OK;
    if (rc != TDP_OK) {
        STAT_ADD(s, refused, 1);
        c->turned_away = true;
        client_end(c, rc);
        return;
    }
    STAT_ADD(s, clients_total, 1);
    if (s->stopping && c->state == CL_OPEN)
        c->state = CL_CLOSING;
    tdp_pipe_recv_async(p, c->rop);
}

/* ---- the server ------------------------------------------------------------------ */

/*
 * Close the clients that neither sent nor received anything for
 * idle_timeout_ms. One timer for all: a message marks its client active
 * and costs nothing more.
 */
static void idle_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_server *s = arg;
    int64_t now = tdp__now_ms();
    for (tdp_client *c = s->clients; c != NULL; c = c->next) {
        if (c->active) {
            c->active = false;
            c->quiet_since = now;
        } else if (c->state == CL_OPEN && now - c->quiet_since >= s->opts.idle_timeout_ms) {
            STAT_ADD(s, idle_closed, 1);
            tdp_log_info("server: client %llu (%s): idle for %lld ms: closing it",
                         (unsigned long long)c->id, tdp_pipe_peer(c->pipe, (char[64]){0}, 64),
                         (long long)(now - c->quiet_since));
            /* a clean close: the peer hears at once (TDP_ECLOSED), not at its keepalive */
            c->idle = true;
            c->state = CL_CLOSING;
            mark_dirty(c);
        }
    }
}

static void work_new_task(void *arg)
{
    tdp_server *s = arg;
    s->work = event_new(tdp__loop_base(s->loop), -1, 0, work_cb, s);
    if (s->work == NULL || s->opts.idle_timeout_ms < 0)
        return;
    int64_t ms = s->opts.idle_timeout_ms / 4 > 0 ? s->opts.idle_timeout_ms / 4 : 1;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((ms % 1000) * 1000)};
    s->idle = event_new(tdp__loop_base(s->loop), -1, EV_PERSIST, idle_cb, s);
    if (s->idle == NULL || event_add(s->idle, &tv) != 0) {
        event_free(s->work); /* the caller sees no work event: out of memory */
        s->work = NULL;
    }
}

static void work_free_task(void *arg)
{
    tdp_server *s = arg;
    if (s->idle != NULL)
        event_free(s->idle);
    s->idle = NULL;
    if (s->work != NULL)
        event_free(s->work);
    s->work = NULL;
}

static void server_release(tdp_server *s)
{
    if (s->work != NULL || s->idle != NULL)
        tdp__call_on_loop(s->loop, work_free_task, s);
    pthread_mutex_destroy(&s->mtx);
    pthread_cond_destroy(&s->cond);
    tdp__budget_unref(s->budget); /* pipes still winding down hold their own references */
    tdp__free(s);
}

/* opts.max_memory's default: half of physical memory (the rest for everything else). */
static uint64_t default_max_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0)
        return UINT64_MAX; /* unknown: no cap rather than a wrong one */
    return (uint64_t)pages * (uint64_t)page / 2;
}

tdp_err tdp_server_new(tdp_loop *loop, const char *host, uint16_t port, const tdp_server_opts *opts,
                       const tdp_server_handler *h, void *arg, tdp_server **out)
{
    if (loop == NULL || out == NULL || (h != NULL && h->size == 0))
        return TDP_EINVAL;
    tdp_server *s = tdp__calloc(1, sizeof(*s));
    if (s == NULL)
        return TDP_ENOMEM;
    s->loop = loop;
    s->arg = arg;
    opts_resolve(opts, &s->opts);
    if (h != NULL)
        memcpy(&s->h, h, h->size < sizeof(s->h) ? h->size : sizeof(s->h));
    s->h.size = sizeof(s->h);
    pthread_mutex_init(&s->mtx, NULL);
    pthread_cond_init(&s->cond, NULL);
    s->budget =
        tdp__budget_new(s->opts.max_memory != 0 ? s->opts.max_memory : default_max_memory());
    if (s->budget == NULL) {
        server_release(s);
        return TDP_ENOMEM;
    }

    /* every accepted pipe: the client's pipe options, the handshake deadline */
    tdp_pipe_opts po;
    tdp_schema_limits lim;
    tdp__opts_resolve(&s->opts.pipe, &po, &lim);
    po.limits = &lim;
    po.connect_timeout_ms = s->opts.handshake_timeout_ms > 0 ? s->opts.handshake_timeout_ms : 1;
    s->opts.pipe.limits = NULL; /* copied into lim; the caller's may not outlive this call */
    s->depth = po.recv_depth;
    s->linger_ms = po.linger_ms;
    if (s->opts.max_replies_queued == 0)
        s->opts.max_replies_queued = s->depth > DEFAULT_REPLIES ? s->depth : DEFAULT_REPLIES;

    tdp__call_on_loop(loop, work_new_task, s);
    if (s->work == NULL) {
        server_release(s);
        return TDP_ENOMEM;
    }
    tdp__listener_hooks hooks = {
        .admit = srv_admit,
        .refused = srv_refused,
        .handshake_failed = srv_handshake_failed,
        .pending = srv_pending,
        .budget = s->budget,
        .arg = s,
    };
    tdp_listener_opts lo;
    tdp_listener_opts_default(&lo);
    lo.pipe = po;
    lo.max_pending = s->opts.max_pending;
    lo.max_per_source = s->opts.max_per_source;
    tdp_err rc = tdp__listener_new(loop, host, port, &lo, srv_on_accept, s, &hooks, &s->lis);
    if (rc != TDP_OK) {
        server_release(s);
        return rc;
    }
    s->port = tdp_listener_port(s->lis);
    *out = s;
    return TDP_OK;
}

uint16_t tdp_server_port(const tdp_server *s)
{
    return s ? s->port : 0;
}

static void shutdown_begin_task(void *arg)
{
    tdp_server *s = arg;
    s->stopping = true;
    for (tdp_client *c = s->clients; c != NULL; c = c->next) {
        if (c->state == CL_OPEN) {
            c->state = CL_CLOSING;
            mark_dirty(c);
        }
    }
    check_all_gone(s);
}

typedef struct force_req {
    tdp_server *s;
    tdp_err rc;
} force_req;

/* The deadline passed: end and free whatever is left, now. */
static void shutdown_force_task(void *arg)
{
    force_req *r = arg;
    tdp_server *s = r->s;
    r->rc = TDP_OK;
    s->stopping = s->forcing = true;
    while (s->clients != NULL) {
        tdp_client *c = s->clients;
        if (c->state < CL_ENDED) {
            r->rc = TDP_ETIMEDOUT; /* its replies were still going out */
            client_end(c, TDP_ETIMEDOUT);
        }
        client_step(c); /* forcing: reports on_close if due, then frees */
    }
    check_all_gone(s);
}

tdp_err tdp_server_shutdown(tdp_server *s, int64_t timeout_ms)
{
    if (s == NULL || (tdp__loop_running(s->loop) && tdp_loop_on_thread(s->loop)))
        return TDP_EINVAL;
    if (s->shut_done)
        return s->shut_rc;
    int64_t deadline = timeout_ms < 0 ? -1 : tdp__now_ms() + timeout_ms;

    /* stop accepting: handshakes under way are dropped, refusals end */
    if (s->lis != NULL) {
        tdp_listener_free(s->lis);
        s->lis = NULL;
    }
    tdp__call_on_loop(s->loop, shutdown_begin_task, s);

    /* clients close cleanly: replies drain, BYE, the peer hangs up (if
     * nobody runs the loop, it runs here meanwhile) */
    pthread_mutex_lock(&s->mtx);
    tdp__loop_wait(s->loop, &s->mtx, &s->cond, &s->all_gone, deadline);
    pthread_mutex_unlock(&s->mtx);
    force_req r = {.s = s};
    tdp__call_on_loop(s->loop, shutdown_force_task, &r);
    s->shut_done = true;
    s->shut_rc = r.rc;
    return r.rc;
}

void tdp_server_free(tdp_server *s)
{
    if (s == NULL)
        return;
    if (tdp__loop_running(s->loop) && tdp_loop_on_thread(s->loop)) {
        tdp_log_error("tdp_server_free: called on the loop thread; the server is leaked");
        return;
    }
    if (!s->shut_done)
        tdp_server_shutdown(s, FREE_SHUTDOWN_MS);
    server_release(s);
}
