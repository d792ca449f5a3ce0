/*
 * plane_shm.h (internal): test hooks of the same-host plane (plane_shm.c).
 * The plane itself is reached through its ops table, tdp__plane_shm.
 * Every hook runs on the loop thread.
 */
#ifndef TDP_PIPE_PLANE_SHM_H
#define TDP_PIPE_PLANE_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../plane.h"
#include "shm.h"

/*
 * Act as a hostile sender on link l (whose socket is up): send a SCHEMA
 * message with `json` for `seq` when json is not NULL, then push *d on the
 * data ring as it is.
 */
tdp_err tdp__shm_rogue_data(tdp__link *l, const tdp__shm_desc *d, const char *json, size_t jlen,
                            uint64_t seq, uint64_t total);

/*
 * Act as a hostile sender on link l (whose socket is up): announce for
 * `seq` a POOL of slots of `bytes` each (a new generation), or a SCHEMA
 * whose `bytes` of JSON (not a schema: it is never read before its DATA)
 * travel in a sealed memfd; no DATA follows.
 */
tdp_err tdp__shm_rogue_announce(tdp__link *l, bool pool, uint64_t seq, uint64_t bytes);

/*
 * Act as a hostile sender on link l (whose socket is up and which has not
 * sent yet): announce a control segment whose rings hold ring_cap
 * descriptors, whatever this side's depth asks for.
 */
tdp_err tdp__shm_rogue_ctl(tdp__link *l, uint32_t ring_cap);

/*
 * Act as a hostile cuda-ipc sender on l: make a device pool of `bytes` on
 * dev and announce it for `seq` as `nslots` slots of `stride` bytes on the
 * device with UUID uuid (NULL: dev's), whatever the truth. keep: the pool
 * stays alive for the caller to unref (a same-process receiver then finds
 * it by id); NULL: it goes at once (the receiver must import the handle).
 */
struct tdp__dpool;
tdp_err tdp__shm_rogue_dpool(tdp__link *l, uint64_t seq, int dev, uint64_t bytes, uint64_t nslots,
                             uint64_t stride, const uint8_t *uuid, struct tdp__dpool **keep);

/* Act as a hostile receiver: push *d on the release ring of what l receives. */
tdp_err tdp__shm_rogue_release(tdp__link *l, const tdp__shm_desc *d);

/* A descriptor's type word: type in the low byte, pool generation above. */
uint32_t tdp__shm_desc_word(uint32_t type, uint32_t gen);

/*
 * Run one piece of a loop turn for l, so a test can order them: read what
 * its socket holds now (as the socket's event does), or pop its data ring
 * (as the doorbell's progress does).
 */
void tdp__shm_step_socket(tdp__link *l);
void tdp__shm_step_ring(tdp__link *l);

/* True when p lies in a pool segment the link has mapped, its own (sending)
 * or the peer's (receiving): the zero-copy proof. */
bool tdp__shm_view_in_pool(tdp__link *l, const void *p);

/*
 * Make link l send from the pools of link `with` (both of one loop, on the
 * shm plane): a loan of that group goes to each of their peers without a
 * copy. l must hold no slot in flight (TDP_EAGAIN). At most 64 links share
 * a group (TDP_ELIMIT). A group's pools are sized for one receive window
 * (the peers' depths, or the window they granted): l keeps to the group's
 * from then on when its peer granted more (a sender may always send less
 * than its peer grants: tdp__session_keep_window tells the session), and
 * cannot join when its peer granted less (TDP_ENOTSUP).
 */
tdp_err tdp__shm_link_share(tdp__link *l, tdp__link *with);

/* The receive window l's sends keep to (its peer's grant, or its group's). */
uint64_t tdp__shm_link_peer_window(const tdp__link *l);

/*
 * Lend a slot of l's group as a tensordict of host layout sc, with no slot
 * kept back for plain sends: for links that send nothing but the group's
 * loans (a fan-out's). TDP_EAGAIN: none free now (a release will wake the
 * loop), or l's socket is not up yet.
 */
tdp_err tdp__shm_group_loan(tdp__link *l, tdp_schema *sc, tdp_td **out);

/*
 * No slot of l's group is free, and l holds fewer slots than its peer may
 * have in flight for layout sc: the other links' peers hold them. Mark the
 * group's pool stale, so that the next tdp__shm_group_loan on l makes a
 * fresh one (announced to l's peer; the old one goes once its slots are
 * released), as for parked slots: for a sender that must not wait for
 * peers that lag (a fan-out's drop-oldest). TDP_OK: marked (or a slot is
 * free); TDP_EAGAIN: l itself holds its window, or its peer cannot take
 * one more announcement now; TDP_EINVAL: not a link of a group.
 */
tdp_err tdp__shm_group_restock(tdp__link *l, tdp_schema *sc);

/*
 * Whether l's socket to its peer is up and proven: until then a loan of
 * its group is refused (TDP_EAGAIN) and no release can come to end that.
 */
bool tdp__shm_link_up(const tdp__link *l);

/* Whether td is a loan of l's group that l can send as it is. */
bool tdp__shm_group_lent(tdp__link *l, const tdp_td *td);

/* The bytes of the pool segments l sends from (its group's), and how many. */
uint64_t tdp__shm_pool_bytes(tdp__link *l, uint32_t *npools);

/*
 * Pools a receiver of this process mapped (as their announcement came, or
 * at their first DATA), and pool mappings page-locked for GPU copies,
 * either side. Any thread.
 */
uint64_t tdp__shm_rx_pools_mapped(void);
uint64_t tdp__shm_pools_pinned(void);

#endif
