/*
 * fake_plane.c: the in-memory data plane of fake_plane.h. It mirrors what
 * the ucx plane does at the session's edge (credit riding on DATA, a
 * length check before a receive, no up-call after link_close, a closed
 * link freed once nothing is in flight) and counts every call the
 * session should never make.
 */
#include <stdlib.h>
#include <string.h>

#include "fake_plane.h"
#include "core/reap.h"
#include "pipe/session.h"

#define GUARD_LEN  64u
#define GUARD_BYTE 0xA5u

typedef struct fmsg {
    tdp__task task;
    struct fmsg *next; /* held queue */
    uint64_t to;       /* the receiving link's token */
    tdp__frame f;
    bool rides_credit; /* DATA: f.arg is the sender's released count */
    bool taken;        /* a receive in progress owns it */
    size_t len;
    uint8_t payload[];
} fmsg;

typedef struct fsend {
    struct fsend *next;
    void *cookie;
    tdp_td *td; /* held until completion, as a transport would */
    bool go;    /* may complete */
} fsend;

/* Receive storage: the schema's bytes, then a guard zone. */
typedef struct fbuf {
    uint8_t *buf;
    size_t n;
} fbuf;

typedef struct fslot {
    struct tdp__link *l;
    tdp_td *td;
    fbuf *fb; /* td's storage */
    bool lent, filling;
    fmsg *msg; /* the landing's payload */
    bool land_posted;
    tdp__task land;
} fslot;

struct tdp__link {
    tdp_loop *loop;
    void *owner;
    const tdp__plane_up *up;
    uint64_t token, peer_token;
    bool closed;
    fake_cfg cfg;
    fake_stats st;
    uint64_t last_seq;
    uint64_t released; /* without ops->credit: what release() tells the peer */
    fmsg *held, *held_tail;
    unsigned nheld;
    fsend *sends, *sends_tail;
    unsigned nsends;
    bool done_posted;
    tdp__task done;
    unsigned landings;
    tdp_schema *rx_schema;
    fslot rx[TDP_MAX_DEPTH];
    tdp__reap reap;
    struct tdp__link *next, *prev;
};

static struct {
    bool with_credit;
    bool usable;
    uint32_t mem; /* what links carry (TDP__MEM_*) */
    tdp_err link_new_rc;
    fake_cfg defaults;
    struct tdp__link *links;
    uint64_t next_token;
    unsigned live, pending;
    uint64_t guard_errors, contract;
} g;

#define CONTRACT(l)                                                                                \
    do {                                                                                           \
        (l)->st.contract++;                                                                        \
        g.contract++;                                                                              \
    } while (0)

static void maybe_free(struct tdp__link *l);

/* ---- receive storage -------------------------------------------------------------- */

static bool guard_ok(const fbuf *fb)
{
    for (size_t i = 0; i < GUARD_LEN; i++)
        if (fb->buf[fb->n + i] != GUARD_BYTE)
            return false;
    return true;
}

static void fbuf_release(void *buf, void *arg)
{
    fbuf *fb = arg;
    if (!guard_ok(fb))
        g.guard_errors++;
    free(fb->buf);
    free(fb);
}

static void guard_check(const fslot *s)
{
    if (s->fb != NULL && !guard_ok(s->fb))
        g.guard_errors++;
}

static tdp_err slot_build(struct tdp__link *l, fslot *s)
{
    tdp_schema *sc = l->rx_schema;
    if (s->td != NULL && tdp_td_schema(s->td) == sc)
        return TDP_OK;
    tdp_device dev = tdp_schema_device(sc);
    if (dev.type != TDP_DEVICE_CPU)
        return TDP_ENOTSUP;
    size_t n = (size_t)tdp_schema_total_bytes(sc);
    size_t cap = (n + GUARD_LEN + TDP_LEAF_ALIGN - 1) / TDP_LEAF_ALIGN * TDP_LEAF_ALIGN;
    fbuf *fb = calloc(1, sizeof(*fb));
    uint8_t *buf = aligned_alloc(TDP_LEAF_ALIGN, cap);
    if (fb == NULL || buf == NULL) {
        free(fb);
        free(buf);
        return TDP_ENOMEM;
    }
    memset(buf, 0, n);
    memset(buf + n, GUARD_BYTE, cap - n);
    fb->buf = buf;
    fb->n = n;
    tdp_td *td;
    tdp_err rc = tdp_td_wrap(sc, buf, n, dev, fbuf_release, fb, &td);
    if (rc != TDP_OK) {
        fbuf_release(buf, fb);
        return rc;
    }
    tdp_td_unref(s->td);
    s->td = td;
    s->fb = fb;
    return TDP_OK;
}

/* ---- frames ------------------------------------------------------------------------ */

static fmsg *msg_new(uint8_t type, const tdp__frame *f, const void *payload, size_t len)
{
    fmsg *m = calloc(1, sizeof(*m) + len);
    if (m == NULL)
        abort(); /* a test machine out of memory: nothing to learn */
    if (f != NULL)
        m->f = *f;
    m->f.type = type;
    m->len = len;
    if (len > 0)
        memcpy(m->payload, payload, len);
    return m;
}

static struct tdp__link *find(uint64_t token)
{
    for (struct tdp__link *l = g.links; l != NULL; l = l->next)
        if (l->token == token && !l->closed)
            return l;
    return NULL;
}

static void deliver_task(void *arg)
{
    fmsg *m = arg;
    g.pending--;
    struct tdp__link *l = find(m->to);
    if (l == NULL) { /* the receiver has gone: the frame is lost */
        free(m);
        return;
    }
    void *owner = l->owner;
    if (!l->st.started)
        l->st.rx_early++;
    switch (m->f.type) {
    case TDP_AM_CREDIT:
        l->st.rx_credit++;
        l->up->credit(owner, l, m->f.arg);
        break;
    case TDP_AM_SCHEMA:
        l->st.rx_schema++;
        l->up->schema(owner, l, &m->f, m->payload, m->len);
        break;
    case TDP_AM_DATA:
        l->st.rx_data++;
        if (m->len != m->f.length) {
            l->up->failed(owner, l, TDP_EMSGSIZE, "data length differs from its frame");
            break;
        }
        if (m->rides_credit)
            l->up->credit(owner, l, m->f.arg);
        if (!l->closed)
            l->up->data(owner, l, &m->f, m);
        break;
    default:
        l->up->failed(owner, l, TDP_EPROTO, "malformed frame header");
        break;
    }
    if (!m->taken)
        free(m);
}

static void post_msg(struct tdp__link *from, fmsg *m)
{
    g.pending++;
    m->task = (tdp__task){.fn = deliver_task, .arg = m};
    tdp__loop_post_task(from->loop, &m->task);
}

static void frame_out(struct tdp__link *l, fmsg *m)
{
    m->to = l->peer_token;
    if (m->f.type == TDP_AM_CREDIT && l->cfg.drop_credit) {
        l->st.credit_dropped++;
        free(m);
        return;
    }
    if (l->cfg.hold_frames) {
        if (l->held_tail != NULL)
            l->held_tail->next = m;
        else
            l->held = m;
        l->held_tail = m;
        l->nheld++;
        return;
    }
    if (l->cfg.sync_frames) {
        g.pending++; /* deliver_task takes it back */
        deliver_task(m);
        return;
    }
    post_msg(l, m);
}

/* ---- sends ------------------------------------------------------------------------- */

static void complete(struct tdp__link *l, fsend *s)
{
    void *cookie = s->cookie;
    l->nsends--;
    tdp_td_unref(s->td);
    free(s);
    if (!l->closed)
        l->up->sent(l->owner, l, cookie, l->cfg.sent_status);
}

static void done_task(void *arg)
{
    struct tdp__link *l = arg;
    g.pending--;
    l->done_posted = false;
    /* in order: a held send holds back the ones after it */
    while (l->sends != NULL && l->sends->go) {
        fsend *s = l->sends;
        l->sends = s->next;
        if (l->sends == NULL)
            l->sends_tail = NULL;
        complete(l, s);
    }
    maybe_free(l);
}

static void post_done(struct tdp__link *l)
{
    if (l->done_posted)
        return;
    l->done_posted = true;
    g.pending++;
    l->done = (tdp__task){.fn = done_task, .arg = l};
    tdp__loop_post_task(l->loop, &l->done);
}

static tdp_err f_send(tdp__link *l, const tdp__tx *tx)
{
    if (l->cfg.send_rc != TDP_OK)
        return l->cfg.send_rc;
    if (!l->st.started || l->closed)
        CONTRACT(l);
    if (tx->seq != l->last_seq + 1)
        CONTRACT(l);
    l->last_seq = tx->seq;
    /* queued before any frame goes: a synchronous peer may make us send again */
    fsend *s = calloc(1, sizeof(*s));
    if (s == NULL)
        abort();
    s->cookie = tx->cookie;
    s->td = tdp_td_ref(tx->td);
    s->go = !l->cfg.hold_sent;
    if (l->sends_tail != NULL)
        l->sends_tail->next = s;
    else
        l->sends = s;
    l->sends_tail = s;
    l->nsends++;

    if (tx->schema != NULL) {
        size_t jl;
        const char *json = tdp_schema_json(tx->schema, &jl);
        tdp__frame f = {.seq = tx->seq,
                        .hash = tdp_schema_hash(tx->schema),
                        .length = jl,
                        .arg = tdp_schema_total_bytes(tx->schema)};
        l->st.tx_schema++;
        frame_out(l, msg_new(TDP_AM_SCHEMA, &f, json, jl));
    }
    tdp__frame f = {.seq = tx->seq,
                    .hash = tdp_schema_hash(tdp_td_schema(tx->td)),
                    .length = tdp_td_nbytes(tx->td),
                    .arg = tx->credit};
    fmsg *m = msg_new(TDP_AM_DATA, &f, tdp_td_data(tx->td), (size_t)tdp_td_nbytes(tx->td));
    m->rides_credit = g.with_credit;
    l->st.tx_data++;
    frame_out(l, m);

    if (!s->go)
        return TDP_OK;
    if (l->cfg.sent_inline && l->sends == s) {
        /* nothing ahead of it: the transport is done before send returns */
        l->sends = NULL;
        l->sends_tail = NULL;
        complete(l, s);
        return TDP_OK;
    }
    post_done(l);
    return TDP_OK;
}

static void credit_out(struct tdp__link *l, uint64_t total)
{
    l->st.tx_credit++;
    l->st.last_credit_tx = total;
    tdp__frame f = {.arg = total};
    frame_out(l, msg_new(TDP_AM_CREDIT, &f, NULL, 0));
}

static tdp_err f_credit(tdp__link *l, uint64_t total)
{
    if (!l->st.started || l->closed)
        CONTRACT(l);
    if (l->cfg.credit_rc != TDP_OK)
        return l->cfg.credit_rc;
    credit_out(l, total);
    return TDP_OK;
}

/* ---- receives ------------------------------------------------------------------------ */

static tdp_err f_rx_schema(tdp__link *l, tdp_schema *sc, uint32_t depth)
{
    if (l->cfg.rx_schema_rc != TDP_OK)
        return l->cfg.rx_schema_rc;
    if (depth == 0 || depth > TDP_MAX_DEPTH)
        CONTRACT(l);
    l->st.rx_schemas++;
    if (l->rx_schema != sc) {
        tdp_schema_unref(l->rx_schema);
        l->rx_schema = tdp_schema_ref(sc);
    }
    /* buffers lent or filling keep their layout until they come back */
    for (uint32_t i = 0; i < depth && i < TDP_MAX_DEPTH; i++) {
        fslot *s = &l->rx[i];
        if (s->lent || s->filling)
            continue;
        tdp_err rc = slot_build(l, s);
        if (rc != TDP_OK)
            return rc;
    }
    return TDP_OK;
}

static void landing_task(void *arg)
{
    fslot *s = arg;
    struct tdp__link *l = s->l;
    g.pending--;
    s->land_posted = false;
    s->filling = false;
    l->landings--;
    fmsg *m = s->msg;
    s->msg = NULL;
    if (l->closed) {
        free(m);
        maybe_free(l);
        return;
    }
    tdp_err st = l->cfg.land_status;
    /* a transfer cut short leaves half the bytes behind */
    size_t n = st == TDP_OK ? m->len : m->len / 2;
    if (n > 0)
        memcpy(tdp_td_data(s->td), m->payload, n);
    guard_check(s);
    free(m);
    l->up->landed(l->owner, l, (uint32_t)(s - l->rx), st);
}

static void post_landing(fslot *s)
{
    s->land_posted = true;
    g.pending++;
    s->land = (tdp__task){.fn = landing_task, .arg = s};
    tdp__loop_post_task(s->l->loop, &s->land);
}

static tdp_err f_recv(tdp__link *l, void *desc, uint32_t slot, tdp_td **td)
{
    fmsg *m = desc;
    if (slot >= TDP_MAX_DEPTH || l->rx_schema == NULL) {
        CONTRACT(l);
        return TDP_EINVAL;
    }
    fslot *s = &l->rx[slot];
    if (s->lent || s->filling) { /* the session gave a slot still in use */
        CONTRACT(l);
        return TDP_EPROTO;
    }
    tdp_err rc = slot_build(l, s);
    if (rc != TDP_OK)
        return rc;
    if (m->len != tdp_td_nbytes(s->td))
        return TDP_EMSGSIZE;
    l->st.recvs++;
    s->lent = true;
    *td = s->td;
    if (!l->cfg.rndv) {
        if (m->len > 0)
            memcpy(tdp_td_data(s->td), m->payload, m->len);
        guard_check(s);
        return TDP_OK;
    }
    s->filling = true;
    s->msg = m;
    m->taken = true;
    l->landings++;
    if (!l->cfg.hold_landing)
        post_landing(s);
    return TDP_EAGAIN;
}

static void f_release(tdp__link *l, uint32_t slot)
{
    if (slot >= TDP_MAX_DEPTH || !l->rx[slot].lent || l->rx[slot].filling) {
        CONTRACT(l);
        return;
    }
    l->rx[slot].lent = false;
    l->st.releases++;
    if (!g.with_credit && l->st.started && !l->closed)
        credit_out(l, ++l->released); /* no ops->credit: the release itself tells the peer */
}

static tdp_err f_loan(tdp__link *l, tdp_schema *sc, tdp_td **out)
{
    if (l->cfg.loan_rc != TDP_OK)
        return l->cfg.loan_rc;
    l->st.loans++;
    return tdp_td_new(sc, out);
}

/* ---- links ---------------------------------------------------------------------------- */

static tdp_err f_link_new(tdp_loop *loop, void *owner, const tdp__plane_up *up, tdp__link **out)
{
    if (g.link_new_rc != TDP_OK)
        return g.link_new_rc;
    struct tdp__link *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return TDP_ENOMEM;
    l->loop = loop;
    l->owner = owner;
    l->up = up;
    l->token = ++g.next_token;
    l->cfg = g.defaults;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++)
        l->rx[i].l = l;
    l->next = g.links;
    if (g.links != NULL)
        g.links->prev = l;
    g.links = l;
    g.live++;
    *out = l;
    return TDP_OK;
}

static tdp_err f_hello_fill(tdp__link *l, tdp_hello *h)
{
    if (l->cfg.fill_rc != TDP_OK)
        return l->cfg.fill_rc;
    h->token = l->token;
    return TDP_OK;
}

static bool f_usable(const tdp_hello *peer, bool same_host)
{
    return g.usable;
}

static tdp_err f_link_start(tdp__link *l, const tdp__link_peer *peer)
{
    if (l->cfg.start_rc != TDP_OK)
        return l->cfg.start_rc;
    if (l->closed || l->st.started)
        CONTRACT(l);
    l->peer_token = peer->hello->token;
    l->st.peer_depth = peer->peer_depth;
    l->st.peer_caps = peer->peer_caps;
    l->st.started = true;
    return TDP_OK;
}

static bool f_link_busy(const tdp__link *l)
{
    return l->nsends > 0 || l->nheld > 0 || l->landings > 0 || l->done_posted;
}

static void link_free(void *arg)
{
    struct tdp__link *l = arg;
    while (l->held != NULL) { /* never flushed: lost with the link */
        fmsg *m = l->held;
        l->held = m->next;
        free(m);
    }
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        guard_check(&l->rx[i]);
        tdp_td_unref(l->rx[i].td); /* a td the application still holds keeps its storage */
    }
    tdp_schema_unref(l->rx_schema);
    if (l->prev != NULL)
        l->prev->next = l->next;
    else
        g.links = l->next;
    if (l->next != NULL)
        l->next->prev = l->prev;
    g.live--;
    free(l);
}

static void maybe_free(struct tdp__link *l)
{
    if (!l->closed || f_link_busy(l) || l->reap.queued)
        return;
    tdp__reap_later(l->loop, &l->reap, link_free, l);
}

static void f_link_close(tdp__link *l, bool peer_gone)
{
    (void)peer_gone;
    if (l->closed)
        CONTRACT(l);
    l->closed = true;
    maybe_free(l);
}

static uint32_t f_link_mem(const tdp__link *l)
{
    (void)l;
    return g.mem;
}

static const tdp__plane_ops fake_ops = {
    .name = "fake",
    .id = TDP__PLANE_TEST,
    .mem = TDP__MEM_HOST | TDP__MEM_CUDA,
    .link_mem = f_link_mem,
    .hello_fill = f_hello_fill,
    .usable = f_usable,
    .link_new = f_link_new,
    .link_start = f_link_start,
    .link_close = f_link_close,
    .link_busy = f_link_busy,
    .send = f_send,
    .credit = f_credit,
    .rx_schema = f_rx_schema,
    .recv = f_recv,
    .release = f_release,
    .loan = f_loan,
};

/* A plane that tells credit through its releases and lends nothing of its own. */
static const tdp__plane_ops fake_ops_nocredit = {
    .name = "fake",
    .id = TDP__PLANE_TEST,
    .mem = TDP__MEM_HOST | TDP__MEM_CUDA,
    .link_mem = f_link_mem,
    .hello_fill = f_hello_fill,
    .usable = f_usable,
    .link_new = f_link_new,
    .link_start = f_link_start,
    .link_close = f_link_close,
    .link_busy = f_link_busy,
    .send = f_send,
    .credit = NULL,
    .rx_schema = f_rx_schema,
    .recv = f_recv,
    .release = f_release,
    .loan = NULL,
};

/* ---- the test's side ---------------------------------------------------------------- */

void fake_plane_install(bool with_credit)
{
    /* links a failed test left behind belong to its abandoned loop: forget them */
    g.links = NULL;
    g.live = g.pending = 0;
    g.with_credit = with_credit;
    g.usable = true;
    g.mem = TDP__MEM_HOST | TDP__MEM_CUDA;
    g.link_new_rc = TDP_OK;
    g.defaults = (fake_cfg){0};
    g.guard_errors = 0;
    g.contract = 0;
    tdp__plane_register_test(with_credit ? &fake_ops : &fake_ops_nocredit);
}

void fake_plane_uninstall(void)
{
    tdp__plane_register_test(NULL);
}

fake_cfg *fake_defaults(void)
{
    return &g.defaults;
}

void fake_set_usable(bool usable)
{
    g.usable = usable;
}

void fake_set_mem(uint32_t mem)
{
    g.mem = mem;
}

const tdp__plane_ops *fake_plane_ops(void)
{
    return g.with_credit ? &fake_ops : &fake_ops_nocredit;
}

void fake_set_link_new_rc(tdp_err rc)
{
    g.link_new_rc = rc;
}

tdp__link *fake_link_of(const tdp_pipe *p)
{
    tdp__link *l = tdp__session_link(p);
    if (l != NULL)
        return l;
    for (l = g.links; l != NULL; l = l->next)
        if (l->owner == p && !l->closed)
            return l;
    return NULL;
}

fake_cfg *fake_cfg_of(tdp__link *l)
{
    return &l->cfg;
}

const fake_stats *fake_stats_of(const tdp__link *l)
{
    return &l->st;
}

unsigned fake_flush(tdp__link *l)
{
    unsigned n = 0;
    while (l->held != NULL) {
        fmsg *m = l->held;
        l->held = m->next;
        m->next = NULL;
        l->nheld--;
        post_msg(l, m);
        n++;
    }
    l->held_tail = NULL;
    maybe_free(l);
    return n;
}

unsigned fake_held(const tdp__link *l)
{
    return l->nheld;
}

unsigned fake_complete_sends(tdp__link *l)
{
    unsigned n = 0;
    for (fsend *s = l->sends; s != NULL; s = s->next) {
        if (!s->go) {
            s->go = true;
            n++;
        }
    }
    if (l->sends != NULL)
        post_done(l);
    return n;
}

unsigned fake_land(tdp__link *l)
{
    unsigned n = 0;
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        fslot *s = &l->rx[i];
        if (s->filling && !s->land_posted) {
            post_landing(s);
            n++;
        }
    }
    return n;
}

void fake_release_all(void)
{
    for (struct tdp__link *l = g.links; l != NULL; l = l->next) {
        l->cfg.hold_frames = l->cfg.hold_sent = l->cfg.hold_landing = false;
        fake_flush(l);
        fake_complete_sends(l);
        fake_land(l);
    }
}

void fake_fail(tdp__link *l, tdp_err st, const char *why)
{
    if (!l->closed)
        l->up->failed(l->owner, l, st, why);
}

void fake_inject(tdp__link *l, const tdp__frame *f, const void *payload, size_t len)
{
    fmsg *m = msg_new(f->type, f, payload, len);
    m->to = l->token;
    post_msg(l, m);
}

unsigned fake_live_links(void)
{
    return g.live;
}

unsigned fake_pending(void)
{
    return g.pending;
}

uint64_t fake_guard_errors(void)
{
    return g.guard_errors;
}

uint64_t fake_contract_errors(void)
{
    return g.contract;
}
