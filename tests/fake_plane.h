/*
 * fake_plane.h: an in-memory data plane for tests of the pipe's state
 * machine (session.c) — no UCX, no shared memory, no sockets.
 *
 * Links pair up in-process: a link's HELLO carries its token, and
 * link_start finds the peer's link by the token in the peer's HELLO.
 * Frames are copied into messages and delivered on a later loop turn (a
 * posted task), in order; a test can hold, drop, fail or forge them, and
 * make sends and receives complete late or fail. Receive buffers have a
 * guard zone after them that is checked whenever a buffer is written or
 * freed, so a write past the end is counted (and ASan sees it too).
 *
 * One loop, one thread: every pipe of a test shares a loop that only the
 * test's own thread runs (tdp__loop_run_until, or the blocking calls that
 * drive a loop nobody runs). Not thread-safe. Force the plane
 * (tdp_pipe_opts.plane = TDP__PLANE_TEST): its token uses the HELLO's token
 * field, as the ucx plane does, so the two cannot be candidates together.
 */
#ifndef TDP_TEST_FAKE_PLANE_H
#define TDP_TEST_FAKE_PLANE_H

#include <stdbool.h>
#include <stdint.h>

#include "pipe/plane.h"

/* Behaviour of a link; every new link starts from fake_defaults(). */
typedef struct fake_cfg {
    tdp_err fill_rc, start_rc, rx_schema_rc, loan_rc, credit_rc;
    tdp_err send_rc;     /* ops->send returns it (not TDP_OK: nothing taken) */
    tdp_err sent_status; /* status of each up->sent */
    bool sent_inline;    /* up->sent inside ops->send, as a transport that finished at once */
    bool hold_sent;      /* completions wait for fake_complete_sends */
    bool hold_frames;    /* frames this link sends wait for fake_flush */
    bool sync_frames;    /* frames reach the peer inside ops->send (no loop turn) */
    bool drop_credit;    /* CREDIT frames this link sends are lost */
    bool rndv;           /* receives land later, through up->landed */
    bool hold_landing;   /* ... and wait for fake_land */
    tdp_err land_status; /* status of those landings (not TDP_OK: half the bytes land) */
} fake_cfg;

typedef struct fake_stats {
    uint32_t peer_depth;                    /* from link_start */
    uint64_t peer_caps;                     /* from link_start: the peer's HELLO caps */
    uint32_t max_send_depth;                /* deepest nesting of ops->send seen */
    bool started;                           /* link_start succeeded */
    uint64_t tx_schema, tx_data, tx_credit; /* frames sent, by type */
    uint64_t rx_schema, rx_data, rx_credit; /* frames delivered to the session */
    uint64_t rx_early;                      /* ... of those, before link_start */
    uint64_t last_credit_tx;                /* last cumulative credit this side sent */
    uint64_t credit_dropped;
    uint64_t recvs, releases, loans, rx_schemas;
    uint64_t contract; /* calls the session should never make (checked in every test) */
} fake_stats;

/*
 * Register the fake (with_credit: an ops->credit; without, releases send
 * the credit) and reset its state; links a failed test left are forgotten.
 */
void fake_plane_install(bool with_credit);
void fake_plane_uninstall(void);

/* Defaults for new links, and the plane-wide answers. */
fake_cfg *fake_defaults(void);
void fake_set_usable(bool usable);
void fake_set_link_new_rc(tdp_err rc);
/* What new links say they carry (TDP__MEM_*; installed: host and CUDA). */
void fake_set_mem(uint32_t mem);
/* The ops installed (to register copies under other ids). */
const tdp__plane_ops *fake_plane_ops(void);

/* The chosen link of a pipe (after the HELLO), or the only live link of a pipe. */
tdp__link *fake_link_of(const tdp_pipe *p);
fake_cfg *fake_cfg_of(tdp__link *l);
const fake_stats *fake_stats_of(const tdp__link *l);

/* Release held frames / send completions / landings; each returns how many. */
unsigned fake_flush(tdp__link *l);
unsigned fake_complete_sends(tdp__link *l);
unsigned fake_land(tdp__link *l);
/* Every link, closed ones included: stop holding and let everything go (teardown). */
void fake_release_all(void);
/* Held frames right now. */
unsigned fake_held(const tdp__link *l);

/* The transport reports the link failed (up->failed), now. */
void fake_fail(tdp__link *l, tdp_err st, const char *why);

/*
 * A frame as if the peer had sent it, delivered to l on a later loop turn.
 * f->type is TDP_AM_SCHEMA, TDP_AM_DATA, TDP_AM_CREDIT or anything else (the
 * plane then reports a malformed frame). payload is copied.
 */
void fake_inject(tdp__link *l, const tdp__frame *f, const void *payload, size_t len);

/* Links not yet freed; messages, completions and landings not yet run; guard-zone hits. */
unsigned fake_live_links(void);
unsigned fake_pending(void);
uint64_t fake_guard_errors(void);
uint64_t fake_contract_errors(void); /* all links, freed ones included */

#endif
