/*
 * session_reconnect.c: a dialed pipe with reconnect_ms whose peer went —
 * back to connecting, keeping what the application holds, and dialing
 * again with a backoff until the outage's time is up.
 *
 * Loop thread only.
 */
#include <inttypes.h>
#include <string.h>
#include <time.h>

#include "session_int.h"
#include "budget.h"
#include "checksum.h"
#include "op.h"
#include "plane.h"
#include "host.h"
#include "../core/alloc.h"
#include "../core/log.h"
#include "../core/reap.h"
#include "../core/sized.h"
#include "../schema/schema_int.h"

void tdp__pipe_retry_cb(evutil_socket_t fd, short what, void *arg)
{
    tdp_pipe *p = arg;
    if (!p->reconnecting || p->state != PIPE_CONNECTING || p->freed)
        return;
    int64_t now = tdp__now_ms();
    if (now >= p->outage_end_ms) {
        tdp__pipe_fail(p, p->lost, "reconnect time passed");
        return;
    }
    tdp_err rc = tdp__pipe_make_links(p);
    if (rc != TDP_OK) {
        tdp__pipe_fail(p, rc, "no data plane to reconnect with");
        return;
    }
    tdp__pipe_ctl_setup(p);
    rc = tdp__ctl_dial(&p->ctl, p->addrs, p->addrlens, p->naddr);
    if (rc != TDP_OK) {
        tdp__pipe_fail(p, rc, "cannot dial");
        return;
    }
    /* this attempt's handshake ends within the outage's time */
    int64_t left = p->outage_end_ms - now + 1;
    tdp__pipe_arm_timer(p, left < p->opts.connect_timeout_ms ? left : p->opts.connect_timeout_ms);
}

/*
 * The link is gone: put the pipe back to connecting, keep what the
 * application holds (queued sends, messages lent), and dial again after a
 * backoff. Sends the old link held end with TDP_ECONNRESET: they may or may
 * not have arrived. The next HELLO says where the stream goes on.
 */
void tdp__pipe_begin_reconnect(tdp_pipe *p, tdp_err err, const char *why)
{
    int64_t now = tdp__now_ms();
    if (!p->reconnecting) {
        int64_t span = p->was_open                   ? p->opts.reconnect_ms
                       : p->opts.connect_wait_ms > 0 ? p->opts.connect_wait_ms
                                                     : p->opts.connect_timeout_ms;
        p->reconnecting = true;
        p->lost = err;
        p->outage_end_ms = now + span;
        p->backoff_ms = 50;
        if (p->was_open) {
            p->stats.reconnects++;
            tdp_log_info("pipe %s: %s (%s); reconnecting for up to %" PRId64 " ms",
                         p->ctl.peer_name, why, tdp_strerror(err), span);
        }
    } else {
        tdp_log_debug("pipe %s: reconnect attempt failed: %s (%s)", p->ctl.peer_name, why,
                      tdp_strerror(err));
        p->backoff_ms = p->backoff_ms * 2 > 1000 ? 1000 : p->backoff_ms * 2;
    }
    p->state = PIPE_CONNECTING;
    tdp__pipe_timer_del(p);
    tdp__pipe_close_links(p, true);
    tdp__ctl_close(&p->ctl);
    tdp__loop_idle_cancel(p->loop, &p->credit_idle);

    /* sending: what the old link held is lost to us; the rest waits */
    tdp__pipe_fail_ops_sent(p, TDP_ECONNRESET);
    tdp__prep_reset(p);
    if (p->prep_ev != NULL)
        event_del(p->prep_ev);
    tdp__free(p->tickets);
    p->tickets = NULL;
    p->free_tickets = NULL;
    p->done_head = p->done_tail = NULL; /* the old link's: nothing to give back */
    p->nticket = 0;
    p->tx_inflight = 0;
    tdp_schema_unref(p->sent_schema);
    p->sent_schema = NULL; /* the schema goes again */
    /* what the old link carried that its peer never gave back */
    p->stats.unconfirmed += p->send_seq - p->credit_base - p->peer_credit;
    p->credit_base = p->send_seq;
    p->peer_credit = 0;
    p->sum_on = false; /* the next peer's HELLO says again */

    /* receiving: a new peer starts its own stream; views lent stay valid */
    for (uint32_t i = 0; i < TDP_MAX_DEPTH; i++) {
        rx_slot *s = &p->slots[i];
        if (s->state == SLOT_FILLING || s->state == SLOT_READY) {
            if (s->state == SLOT_READY)
                p->stats.msgs_recv--; /* never handed out */
            tdp__pipe_slot_free(s);
        }
    }
    p->ready_count = 0;
    p->ready_head = 0;
    p->rx_inflight = 0;
    p->rx_seq = 0;
    p->rx_hash = 0; /* a DATA before the new peer's SCHEMA is refused */
    p->released = p->credit_sent = p->rx_link = 0;
    p->peer_bye = false;
    p->peer_last_seq = 0;
    p->stats.resumed_from = 0; /* the next link's peer says for itself */
    p->link_failed = false;
    p->epoch++;

    int64_t left_ms = p->outage_end_ms - now;
    int64_t wait = p->backoff_ms < left_ms ? p->backoff_ms : left_ms > 0 ? left_ms : 0;
    struct timeval tv = {(time_t)(wait / 1000), (suseconds_t)((wait % 1000) * 1000)};
    evtimer_add(p->retry_ev, &tv);
}
