/*
 * ctl.h (internal): a pipe's control channel — the TCP socket that
 * carries HELLO and BYE and whose closing is how a dead peer is seen (TCP
 * keepalive covers a peer host that vanishes). It knows nothing of pipes:
 * it reports to its owner through tdp__ctl_up, on the loop thread.
 */
#ifndef TDP_PIPE_CTL_H
#define TDP_PIPE_CTL_H

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <tdpipe/loop.h>

#include "wire.h"

#define TDP_CTL_MAX_ADDRS 4

/*
 * A listener sends its HELLO as it accepts: a peer that has sent nothing
 * this long after the connection is up is not a tdpipe listener (an HTTP
 * server waiting for a request, say), and the dial fails with TDP_EPROTO
 * rather than at the handshake deadline.
 */
#define TDP_CTL_GREETING_MS 2000

typedef struct tdp__ctl_up {
    /* dial: the socket is connected; the owner sends its HELLO */
    void (*connected)(void *owner);
    /*
     * The peer's HELLO has arrived (decoded and checked; with a secret,
     * called only once the peer has proven it holds it, just before
     * `hello`); may be NULL. Without a secret an accepting owner that waits
     * for it before sending its own HELLO does so here. It may close.
     */
    void (*hello_in)(void *owner, const tdp_hello *h);
    /*
     * The peer has proven it holds the secret and both HELLOs offered
     * TDP_HX_PROVEN: the owner adds to `out` the plane records that may exist
     * only now (h is the peer's HELLO; out starts empty); they go out in
     * this side's PROVEN frame. A failure ends the channel with it.
     */
    tdp_err (*proven)(void *owner, const tdp_hello *h, tdp_hello *out);
    /*
     * The peer's HELLO (decoded, checked; its records valid during the
     * call), with the records of its PROVEN frame added when one was due.
     */
    void (*hello)(void *owner, const tdp_hello *h);
    void (*bye)(void *owner, const tdp_bye *b);
    /* the peer's READY (after its HELLO only); may be NULL: READY is then ignored */
    void (*ready)(void *owner, const tdp_ready *r);
    /*
     * The channel ended: TDP_ECONNREFUSED / TDP_EADDR (dial failed),
     * TDP_ECONNRESET (the peer closed or vanished), TDP_EPROTO (garbage, or
     * a dialled peer silent for TDP_CTL_GREETING_MS), TDP_EVERSION (another
     * protocol version). The socket is closed.
     */
    void (*closed)(void *owner, tdp_err why);
    /* our BYE has left this process */
    void (*bye_flushed)(void *owner);
} tdp__ctl_up;

typedef struct tdp__ctl_opts {
    int keepalive_idle_s, keepalive_intvl_s, keepalive_cnt;
    /* shared secret (NULL: none); the owner keeps the bytes alive */
    const uint8_t *secret;
    size_t secret_len;
} tdp__ctl_opts;

/* Embedded in its owner; fields are the channel's own. */
typedef struct tdp__ctl {
    tdp_loop *loop;
    struct bufferevent *bev;
    struct event *greeting; /* dial: the peer's first bytes are due */
    const tdp__ctl_up *up;
    void *owner;
    tdp__ctl_opts opts;
    char peer_name[64];
    bool hello_seen, bye_sent, connected;
    bool dialer; /* this side connected (the other accepted) */
    /*
     * With a secret: both HELLOs as they went over the wire (the payloads)
     * until the peer has proven it holds the secret; its HELLO goes up only
     * then. auth_sent: our proof is out.
     */
    uint8_t *my_hello, *peer_hello;
    size_t my_hello_len, peer_hello_len;
    bool auth_sent, authed;
    /*
     * PROVEN (wire.h): proven_mine: our HELLO offered it; held: the peer's
     * HELLO, proven and kept until its PROVEN frame comes (then both go up
     * as one). Only with a secret, when both HELLOs offered it.
     */
    bool proven_mine;
    uint8_t *held;
    size_t held_len;
    bool reading;                          /* read_frames is on the stack */
    struct tdp__ctl_carry *carry;          /* carrying the tcp plane (tdp__ctl_carry) */
    const struct tdp__ctl_carry_ops *carry_ops; /* its calls, set with carry (below) */
    uint8_t my_nonce[TDP_HELLO_NONCE_LEN]; /* of the HELLO we sent */
    bool nonce_sent;
    /*
     * The socket's two ends prove the peer shares this host's network
     * stack: a Unix socket, a loopback address, or the peer's address equal
     * to ours (the kernel routes that inside the host). A HELLO's host id
     * is only a claim; this is what a remote peer cannot fake.
     */
    bool peer_local;
    struct sockaddr_storage addrs[TDP_CTL_MAX_ADDRS]; /* dial: tried in turn */
    socklen_t addrlens[TDP_CTL_MAX_ADDRS];
    int naddr, iaddr;
} tdp__ctl;

void tdp__ctl_init(tdp__ctl *c, tdp_loop *loop, const tdp__ctl_opts *o, const tdp__ctl_up *up,
                   void *owner);
/* Connect to addrs in turn (up->connected, or up->closed after the last). */
tdp_err tdp__ctl_dial(tdp__ctl *c, const struct sockaddr_storage *addrs, const socklen_t *lens,
                      int n);
/* An accepted socket (takes fd, also on failure). */
tdp_err tdp__ctl_accept(tdp__ctl *c, evutil_socket_t fd, const struct sockaddr *sa);
/* Queue a HELLO. */
tdp_err tdp__ctl_send_hello(tdp__ctl *c, const tdp_hello *h);
/* Queue a READY (only to a peer whose HELLO carried TDP_HX_READY). */
void tdp__ctl_send_ready(tdp__ctl *c, const tdp_ready *r);
/* Bytes queued for the socket that the kernel has not taken yet (0 when carried). */
size_t tdp__ctl_backlog(const tdp__ctl *c);
/* Queue BYE once; up->bye_flushed when it has left. */
void tdp__ctl_send_bye(tdp__ctl *c, const tdp_bye *b);
bool tdp__ctl_open(const tdp__ctl *c);
/* Whether the socket's two ends prove one network stack (as peer_local), asked now. */
bool tdp__ctl_local_now(const tdp__ctl *c);
/*
 * Read what the socket holds now and handle it, outside the read event:
 * a frame on a data plane may overtake the proof that came before it on
 * this socket. Nothing while the input is being handled already.
 */
void tdp__ctl_pump(tdp__ctl *c);
/* Close now (a queued BYE is pushed out first). Safe inside an up-call. */
void tdp__ctl_close(tdp__ctl *c);

/*
 * Carrying a data plane on this socket (the tcp plane, src/pipe/tcp/):
 * once both HELLOs are in, PLANE frames (wire.h) go both ways between the
 * control frames, in order. From then on the channel reads and writes the
 * socket itself, as a loop source (busy-polled where the loop spins), with
 * a fixed receive buffer and a fixed ring of frames to send: no allocation
 * per frame. Payloads are sent from the caller's memory (gathered with
 * their headers, many frames a system call) and large ones are received
 * straight into the memory the plane names. ctl_carry.c.
 */
typedef struct tdp__ctl_carrier {
    /*
     * A PLANE frame arrived (its header checked by wire.c). The plane says
     * where its h->length payload bytes go: *into (NULL: read and dropped),
     * or returns an error, with which the channel then fails. The plane
     * may close the channel inside.
     */
    tdp_err (*frame)(void *arg, const tdp_am_hdr *h, uint8_t **into);
    /* All the payload bytes of the last frame are in its *into (length > 0 only). */
    void (*payload)(void *arg);
    /*
     * Optional: bytes [0, got) of the last frame's payload are in its
     * *into, not all yet (called as reads land them; payload ends it).
     */
    void (*landing)(void *arg, uint64_t got);
    /*
     * A frame queued with a cookie has left this process (TDP_OK: the
     * kernel has its bytes, the payload may be reused) or never will (the
     * channel closed). Never inside tdp__ctl_plane_send; in queue order.
     */
    void (*sent)(void *arg, void *cookie, tdp_err st);
} tdp__ctl_carrier;

/* Most frames queued at once (sends in flight are bounded by credit far below). */
#define TDP_CTL_CARRY_QUEUE 512u

/*
 * Start carrying (the HELLOs are in; from the plane's link_start). up is
 * not copied; arg is given back in every call. `frame` and `payload` stop
 * at tdp__ctl_uncarry or when the channel closes; `sent` calls go on until
 * every frame queued with a cookie is accounted for, even after the
 * channel closed (from a loop task then).
 */
tdp_err tdp__ctl_carry(tdp__ctl *c, const tdp__ctl_carrier *up, void *arg);
/* The plane (arg) takes no more frames: payloads still due are read and dropped. */
void tdp__ctl_uncarry(tdp__ctl *c, void *arg);
/*
 * Queue a PLANE frame: h's header then h->length bytes from payload, which
 * stay valid until up->sent(cookie) when cookie is not NULL (with a NULL
 * cookie the payload must be empty). now: write at once (a blocking call
 * waits for it); else at the end of the loop's turn, with the frames queued
 * after it. TDP_ECONNRESET once the channel is closed; TDP_ELIMIT when the
 * queue is full.
 */
tdp_err tdp__ctl_plane_send(tdp__ctl *c, const tdp_am_hdr *h, const void *payload, void *cookie,
                            bool now);
/*
 * Queue a PLANE frame whose payload is not in memory yet (a GPU payload
 * still being copied to the host): its header may go, but no payload byte
 * and no frame queued after it, until tdp__ctl_plane_give hands the bytes
 * over. h->length > 0 and a cookie are required; *id names the frame.
 * Written at the end of the loop's turn. Errors as tdp__ctl_plane_send.
 */
tdp_err tdp__ctl_plane_send_held(tdp__ctl *c, const tdp_am_hdr *h, void *cookie, uint64_t *id);
/*
 * Bytes [0, avail) of held frame id's payload are at payload (given once:
 * later calls may pass NULL) and may be written; they go at once. k is the
 * channel's carrier (tdp__ctl.carry once carrying): it outlives the channel
 * until every frame queued with a cookie is reported, so it may be named
 * for as long as frame id has not been. A frame already reported, or a
 * closed channel: nothing.
 */
void tdp__ctl_plane_give(struct tdp__ctl_carry *k, uint64_t id, const void *payload,
                         uint64_t avail);
/* The same with the AM header's al bytes as they are (tests send malformed ones). */
tdp_err tdp__ctl_plane_send_raw(tdp__ctl *c, const uint8_t *am, size_t al, const void *payload,
                                uint64_t len, void *cookie, bool now);

/*
 * Sockets a listener turns away: BYE(reason) instead of HELLO, then closed
 * once the peer hangs up or after ms. Takes fd.
 */
typedef struct tdp__refusals {
    struct tdp__refusal *head;
    uint32_t n;
} tdp__refusals;
void tdp__ctl_refuse(tdp__refusals *rs, tdp_loop *loop, evutil_socket_t fd, tdp_err reason,
                     int64_t ms);
void tdp__ctl_refusals_free(tdp__refusals *rs);

/* getaddrinfo into out[0..max); *count written. */
tdp_err tdp__resolve(const char *host, uint16_t port, bool passive, struct sockaddr_storage *out,
                     socklen_t *outlen, int max, int *count);

/* ---- between ctl.c and ctl_carry.c (the channel's own two files) ---------- */

/* ctl.c: end the channel with why (a BYE first for a protocol error); up->closed. */
void tdp__ctl_fail(tdp__ctl *c, tdp_err why);
/* ctl.c: a READY or BYE frame's payload; false when the channel ended meanwhile. */
bool tdp__ctl_small(tdp__ctl *c, uint16_t type, const uint8_t *pl, size_t len);

/* ctl.c: the bufferevent reads no more; written(bev, c) when its output has drained. */
void tdp__ctl_bev_written(tdp__ctl *c, bufferevent_data_cb written);

/*
 * What ctl.c calls of the carrier, through c->carry_ops (set by
 * tdp__ctl_carry with c->carry): ctl.c names nothing of ctl_carry.c, so
 * the two files depend one way.
 */
typedef struct tdp__ctl_carry_ops {
    /* the bytes after the frame that started the carrying */
    void (*take)(tdp__ctl *c, struct evbuffer *in);
    /* read what the socket holds now */
    void (*pump)(tdp__ctl *c);
    /* queue a READY or BYE frame (whole, header included) and write it */
    void (*control)(tdp__ctl *c, const uint8_t *frame, size_t len, bool bye);
    /* the channel closes: stop, report what is queued, let go of the socket */
    void (*detach)(tdp__ctl *c);
} tdp__ctl_carry_ops;

#endif
