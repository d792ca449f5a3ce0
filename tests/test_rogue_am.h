/*
 * test_rogue_am.h: a hostile peer's raw active message. The suites that
 * check what the ucx plane refuses (test_pipe, test_server, test_ucx_chunks,
 * test_ucx_batch) send frames the library would never build, on the client
 * pipe's own UCX endpoint, from its loop. Include after <cmocka.h>.
 */
#ifndef TDP_TEST_ROGUE_AM_H
#define TDP_TEST_ROGUE_AM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include <tdpipe/tdpipe.h>

#include "core/loop_int.h"
#include "pipe/op.h"
#include "pipe/session.h"
#include "pipe/tcp/plane_tcp.h"
#include "pipe/ucx/plane_ucx.h"
#include "pipe/wire.h"

/*
 * done is atomic: the sender polls it from its own thread, and its release
 * orders UCX's last read of hdr and payload before the caller's stack
 * moves on.
 */
typedef struct rogue {
    tdp_pipe *cli;
    uint8_t hdr[TDP_AM_HDR_LEN];
    const void *payload;
    size_t len;
    atomic_bool done;
} rogue;

static void rogue_cb(void *req, ucs_status_t st, void *user)
{
    (void)st;
    atomic_store(&((rogue *)user)->done, true);
    ucp_request_free(req);
}

static void rogue_task(void *arg)
{
    rogue *r = arg;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
        .cb.send = rogue_cb,
        .user_data = r,
    };
    if (tdp_pipe_plane(r->cli) == TDP_PLANE_TCP) {
        /* the same frame on the tcp plane's socket (it is copied) */
        (void)tdp__tcp_rogue(tdp__session_link(r->cli), r->hdr, TDP_AM_HDR_LEN, r->payload, r->len);
        atomic_store(&r->done, true);
        return;
    }
    ucp_ep_h ep = tdp__ucx_link_ep(tdp__session_link(r->cli));
    if (ep == NULL) { /* the pipe ended already (the server refused an earlier frame) */
        atomic_store(&r->done, true);
        return;
    }
    void *q = ucp_am_send_nbx(ep, TDP_AM_ID, r->hdr, TDP_AM_HDR_LEN, r->payload, r->len, &prm);
    if (q == NULL || UCS_PTR_IS_ERR(q))
        atomic_store(&r->done, true);
    tdp__loop_kick(tdp__session_loop(r->cli));
}

/*
 * One raw AM with header h (its magic spoiled with corrupt_magic) from cli,
 * whose loop is cl; returns once UCX let go of it, asserting that it did
 * within tmo_ms.
 */
static inline void rogue_am_send(tdp_loop *cl, tdp_pipe *cli, const tdp_am_hdr *h,
                                 const void *payload, size_t len, bool corrupt_magic, int tmo_ms)
{
    rogue r = {.cli = cli, .payload = payload, .len = len};
    atomic_init(&r.done, false);
    tdp_wire_am_encode(r.hdr, h);
    if (corrupt_magic)
        r.hdr[0] ^= 0xff;
    tdp__call_on_loop(cl, rogue_task, &r);
    for (int i = 0; i < tmo_ms && !atomic_load(&r.done); i++)
        usleep(1000);
    assert_true(atomic_load(&r.done));
}

#endif
