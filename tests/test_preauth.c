/*
 * test_preauth: what one hostile peer can make a listener hold.
 *
 * Before its proof: a peer that has not proven it holds the shared secret
 * gets nothing from a listener but its HELLO. The attacker reads the listener's
 * HELLO (its UCX worker address, pipe token, shared-memory socket name and
 * key), sends a HELLO of its own that asks for authentication, and never
 * sends its proof; then it speaks to the data planes directly:
 *  - ucx: its own UCX endpoint to the listener's worker, a SCHEMA for a
 *    large message and a DATA by rendezvous;
 *  - shm: a connection to the listener's socket with the PROOF message
 *    (the keys are in the HELLOs) and a POOL announcement with 1 GiB memfds.
 * The listener's process must allocate nothing (tdp_mem_stats), map nothing
 * (/proc/self/maps), keep its RSS and fds flat, end the attacker's pipe on
 * the first data-plane frame with TDP_EAUTH, and serve a good client. Its
 * HELLO has no same-host UCX address (that worker is made after the proofs,
 * its address sent in PROVEN), and a PROVEN before the proofs is EPROTO.
 *
 * After it (a same-user peer on the shm plane): POOL and SCHEMA
 * announcements whose DATA never comes are held unmapped and unread, and
 * only so many per link (by this side's depth); one more ends the link.
 */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <dirent.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>
#include <ucp/api/ucp.h>

#include <tdpipe/pipe.h>
#include <tdpipe/server.h>
#include <tdpipe/tdpipe.h>

#include "pipe/op.h"
#include "pipe/plane.h"
#include "pipe/shm/plane_shm.h"
#include "pipe/session.h"
#include "pipe/shm/shm.h"
#include "pipe/shm/shm_hello.h"
#include "pipe/wire.h"
#include "test_util.h"
#include "test_ctl_frame.h"

#define TMO 20000

static const char secret[] = "the listener's secret, 32 bytes";

/* VmRSS of this process, bytes. */
static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t kb = 0;
    assert_non_null(f);
    while (fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "VmRSS: %" SCNu64, &kb) == 1)
            break;
    fclose(f);
    return kb * 1024;
}

/* Mappings of this process: how many, and their total size. */
static void maps(uint64_t *n, uint64_t *bytes)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    *n = *bytes = 0;
    assert_non_null(f);
    while (fgets(line, sizeof(line), f) != NULL) {
        unsigned long a, b;
        if (sscanf(line, "%lx-%lx", &a, &b) == 2) {
            (*n)++;
            *bytes += b - a;
        }
    }
    fclose(f);
}

static int nfds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    assert_non_null(d);
    while (readdir(d) != NULL)
        n++;
    closedir(d);
    return n;
}

/* Allocations not yet freed, of every kind (tdp_mem_stats counts small ones apart). */
static int64_t outstanding(void)
{
    tdp_mem_stats m;
    tdp_mem_stats_get(&m);
    int64_t n = (int64_t)m.small_allocs - (int64_t)m.small_frees;
    for (int i = 0; i < TDP_MEM_TYPE_COUNT; i++)
        n += (int64_t)m.allocs[i] - (int64_t)m.frees[i];
    return n;
}

static uint64_t live_bytes(void)
{
    tdp_mem_stats m;
    tdp_mem_stats_get(&m);
    uint64_t t = 0;
    for (int i = 0; i < TDP_MEM_TYPE_COUNT; i++)
        t += m.live_bytes[i];
    return t;
}

typedef struct attacker {
    int fd;
    uint8_t hello[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN]; /* the listener's, as read */
    tdp_hello h;                                        /* decoded from it */
    uint8_t key[TDP_SHM_KEY_LEN];                       /* our HELLO's shm key */
} attacker;

/*
 * Connect, read the listener's HELLO, send ours (authentication asked for,
 * no proof; with proven, offering PROVEN as a same-host peer does).
 */
static void attacker_hello_as(attacker *a, uint16_t port, bool proven)
{
    a->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {
        .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(port)};
    assert_int_equal(connect(a->fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    ssize_t n = read_ctl_frame(a->fd, a->hello, sizeof(a->hello), 5000);
    assert_true(n > (ssize_t)TDP_CTL_HDR_LEN);
    assert_int_equal(
        tdp_wire_hello_decode(a->hello + TDP_CTL_HDR_LEN, (size_t)n - TDP_CTL_HDR_LEN, &a->h),
        TDP_OK);
    assert_int_equal(a->h.auth, TDP_AUTH_HMAC_SHA256);

    static const uint8_t planes[] = {TDP_PLANE_SHM, TDP_PLANE_UCX};
    static const char name[TDP__SHM_NAME_LEN] = "tdpipe.0123456789abcdef0123456789abcdef";
    memset(a->key, 0x5a, sizeof(a->key));
    tdp_hello mine = {
        .recv_depth = 1,
        .max_msg_bytes = 1u << 20,
        .planes = planes,
        .nplanes = 2,
        .auth = TDP_AUTH_HMAC_SHA256,
        .proven = proven ? TDP_PROVEN_V1 : 0,
    };
    /* the UCX address is never looked at before a proof */
    assert_int_equal(tdp_hello_add_rec(&mine, TDP_HX_UCX_ADDR, "x", 1), TDP_OK);
    static uint8_t shm_rec[TDP_SHM_REC_MAX];
    tdp__shm_hello sh = {.key = a->key, .name = name, .name_len = TDP__SHM_NAME_LEN};
    assert_int_equal(tdp__shm_hello_put(&mine, shm_rec, &sh), TDP_OK);
    memcpy(mine.host_id, a->h.host_id, TDP_HOST_ID_LEN);
    for (size_t i = 0; i < TDP_HELLO_NONCE_LEN; i++)
        mine.nonce[i] = (uint8_t)(i * 37 + 11);
    uint8_t buf[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN];
    size_t len = tdp_wire_hello_size(&mine);
    assert_true(len > 0 && len <= sizeof(buf));
    assert_int_equal(tdp_wire_hello_encode(buf, &mine), TDP_OK);
    assert_int_equal(send(a->fd, buf, len, MSG_NOSIGNAL), (ssize_t)len);
}

static void attacker_hello(attacker *a, uint16_t port)
{
    attacker_hello_as(a, port, false);
}

/*
 * What the listener says next, within ms: the BYE's reason, or 0 for none.
 * *proof: whether it sent its AUTH (it must not, before the dialer's).
 */
static int attacker_bye(attacker *a, int64_t ms, bool *proof)
{
    uint8_t buf[TDP_CTL_HDR_LEN + TDP_HELLO_MAX_LEN];
    for (;;) {
        ssize_t n = read_ctl_frame(a->fd, buf, sizeof(buf), ms);
        if (n < 0)
            return 0;
        tdp_ctl_hdr h;
        assert_int_equal(tdp_wire_ctl_hdr_decode(buf, &h), TDP_OK);
        *proof |= h.type == TDP_CTL_AUTH;
        if (h.type == TDP_CTL_BYE) {
            tdp_bye b;
            assert_int_equal(tdp_wire_bye_decode(buf + TDP_CTL_HDR_LEN, h.length, &b), TDP_OK);
            return b.reason;
        }
    }
}

/* ---- the UCX attack ------------------------------------------------------------- */

typedef struct ucx_side {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_ep_h ep;
} ucx_side;

static void ucx_up(ucx_side *u, const void *addr)
{
    ucp_config_t *cfg;
    assert_int_equal(ucp_config_read(NULL, NULL, &cfg), UCS_OK);
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    assert_int_equal(ucp_init(&p, cfg, &u->ctx), UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    assert_int_equal(ucp_worker_create(u->ctx, &wp, &u->w), UCS_OK);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .address = addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER};
    assert_int_equal(ucp_ep_create(u->w, &ep, &u->ep), UCS_OK);
}

static void ucx_down(ucx_side *u)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *r = ucp_ep_close_nbx(u->ep, &prm);
    int64_t end = mono_ms() + 2000;
    while (r != NULL && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS &&
           mono_ms() < end)
        ucp_worker_progress(u->w);
    if (r != NULL && !UCS_PTR_IS_ERR(r))
        ucp_request_free(r);
    ucp_worker_destroy(u->w);
    ucp_cleanup(u->ctx);
}

/* Send one active message; progress until it is done or ms passed. */
static void ucx_am(ucx_side *u, const tdp_am_hdr *h, const void *payload, size_t len, int64_t ms)
{
    uint8_t hdr[TDP_AM_HDR_LEN];
    tdp_wire_am_encode(hdr, h);
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_AM_SEND_FLAG_REPLY};
    void *r = ucp_am_send_nbx(u->ep, TDP_AM_ID, hdr, sizeof(hdr), payload, len, &prm);
    int64_t end = mono_ms() + ms;
    while (r != NULL && !UCS_PTR_IS_ERR(r) && ucp_request_check_status(r) == UCS_INPROGRESS &&
           mono_ms() < end)
        ucp_worker_progress(u->w);
    if (r != NULL && !UCS_PTR_IS_ERR(r)) {
        if (ucp_request_check_status(r) == UCS_INPROGRESS)
            ucp_request_cancel(u->w, r);
        ucp_request_free(r);
    }
}

/* A good client with the secret: connects, and a message goes through. */
static void good_client(tdp_loop *cl, tdp_listener *l)
{
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.secret = secret;
    o.secret_len = sizeof(secret) - 1;
    tdp_pipe *c, *p;
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), &o, &c), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_schema *s = host_bytes_schema(4096);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    memset(tdp_td_data(td), 7, 4096);
    assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    assert_int_equal(((uint8_t *)tdp_td_data(got))[4095], 7);
    tdp_pipe_release(p, got);
    tdp_td_unref(td);
    tdp_schema_unref(s);
    tdp_pipe_close(c, TMO);
    tdp_pipe_free(c);
    tdp_pipe_free(p);
}

typedef struct server {
    tdp_loop *sl, *cl;
    tdp_listener *l;
} server;

static void server_up(server *s)
{
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.secret = secret;
    o.secret_len = sizeof(secret) - 1;
    o.recv_depth = 4;
    o.connect_timeout_ms = 15000; /* what the attacker holds lasts this long at most */
    assert_int_equal(tdp_loop_new(NULL, &s->sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(s->sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &s->cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(s->cl), TDP_OK);
    assert_int_equal(tdp_listener_new(s->sl, "127.0.0.1", 0, &o, NULL, NULL, &s->l), TDP_OK);
    /* the loops' planes and workers exist before anything is measured */
    good_client(s->cl, s->l);
}

static void server_down(server *s)
{
    tdp_listener_free(s->l);
    tdp_loop_free(s->cl);
    tdp_loop_free(s->sl);
}

/*
 * ucx: a SCHEMA for a 64 MiB message (a listener that took it would hold
 * depth 4 of them), then its 64 MiB of DATA by rendezvous, all before a proof.
 */
/* The attack on port; the listener's process is this one. */
static void ucx_attack(uint16_t port, const char *who)
{
    enum { DATA = 64 << 20 };
    uint8_t *payload = malloc(DATA);
    assert_non_null(payload);
    memset(payload, 0xa5, DATA); /* resident before the baseline */
    tdp_schema *big = host_bytes_schema(DATA);
    size_t jl;
    const char *json = tdp_schema_json(big, &jl);

    attacker a;
    attacker_hello(&a, port);
    const tdp_hx_rec *addr = tdp_hello_rec(&a.h, TDP_HX_UCX_ADDR);
    assert_non_null(addr);
    uint64_t live0 = live_bytes(), allocs0 = tdp_mem_total_allocs(), rss0 = rss_bytes();
    ucx_side u;
    ucx_up(&u, addr->val);
    tdp_am_hdr h = {.type = TDP_AM_SCHEMA,
                    .token = a.h.token,
                    .seq = 1,
                    .hash = tdp_schema_hash(big),
                    .length = jl,
                    .arg = tdp_schema_total_bytes(big)};
    ucx_am(&u, &h, json, jl, 2000);
    h = (tdp_am_hdr){.type = TDP_AM_DATA,
                     .token = a.h.token,
                     .seq = 1, /* a schema comes into force at its data's seq */
                     .hash = tdp_schema_hash(big),
                     .length = DATA};
    ucx_am(&u, &h, payload, DATA, 2000);
    /* the listener ends the pipe on the first frame, and says why */
    bool proof = false;
    int reason = attacker_bye(&a, 3000, &proof);
    uint64_t live1 = live_bytes(), allocs1 = tdp_mem_total_allocs(), rss1 = rss_bytes();
    print_message("ucx pre-auth attack on a %s: BYE reason %d; live bytes %+" PRId64
                  ", allocations %+" PRId64 ", RSS %+" PRId64 " KiB\n",
                  who, reason, (int64_t)(live1 - live0), (int64_t)(allocs1 - allocs0),
                  ((int64_t)rss1 - (int64_t)rss0) / 1024);
    /* nothing for the schema (64 MiB x 4), nothing for the data (64 MiB) */
    assert_true(live1 <= live0 + (64u << 10));
    assert_true(allocs1 <= allocs0 + 2);
    assert_true(rss1 <= rss0 + (24u << 20)); /* our own UCX worker's share included */
    assert_int_equal(reason, TDP_EAUTH);
    assert_false(proof); /* the listener proves itself only after the dialer */
    ucx_down(&u);
    close(a.fd);
    tdp_schema_unref(big);
    free(payload);
}

static void test_preauth_ucx(void **state)
{
    (void)state;
    server s;
    server_up(&s);
    ucx_attack(tdp_listener_port(s.l), "listener");
    good_client(s.cl, s.l);
    server_down(&s);
}

/*
 * PROVEN before the proofs: the listener's HELLO offers PROVEN (a peer on
 * its host) but has no same-host UCX address — its pipe's own worker does
 * not exist before the peer's proof — and a PROVEN frame from a peer that
 * has not proven itself ends the handshake with TDP_EPROTO, with nothing
 * made for it (a same-host worker costs about 7 fds) and no proof sent.
 */
static void test_preauth_proven(void **state)
{
    (void)state;
    server s;
    server_up(&s);
    int fds0 = nfds();
    uint64_t live0 = live_bytes();
    attacker a;
    attacker_hello_as(&a, tdp_listener_port(s.l), true);
    assert_int_equal(a.h.proven, TDP_PROVEN_V1);
    assert_null(tdp_hello_rec(&a.h, TDP_HX_UCX_LOCAL_ADDR));
    static const uint8_t laddr[] = "a same-host worker address";
    tdp_hello recs = {0};
    assert_int_equal(tdp_hello_add_rec(&recs, TDP_HX_UCX_LOCAL_ADDR, laddr, sizeof(laddr)), TDP_OK);
    uint8_t buf[256];
    size_t n = tdp_wire_proven_size(&recs);
    assert_true(n > 0 && n <= sizeof(buf));
    assert_int_equal(tdp_wire_proven_encode(buf, &recs), TDP_OK);
    assert_int_equal(send(a.fd, buf, n, MSG_NOSIGNAL), (ssize_t)n);
    bool proof = false;
    int reason = attacker_bye(&a, 3000, &proof);
    int fds1 = nfds();
    uint64_t live1 = live_bytes();
    print_message("PROVEN before the proofs: BYE reason %d; fds %+d, live bytes %+" PRId64 "\n",
                  reason, fds1 - fds0, (int64_t)(live1 - live0));
    assert_int_equal(reason, TDP_EPROTO);
    assert_false(proof);
    assert_true(fds1 <= fds0 + 2); /* the attacker's socket, both ends */
    assert_true(live1 <= live0 + (64u << 10));
    close(a.fd);
    good_client(s.cl, s.l);
    server_down(&s);
}

/* A tdp_server (what `tdpipe serve` runs) that echoes: the same attack, then a good client. */
static tdp_err echo_msg(tdp_client *c, tdp_td *td, void *arg)
{
    (void)arg;
    return tdp_client_send(c, td);
}

static void test_preauth_ucx_server(void **state)
{
    (void)state;
    tdp_loop *sl, *cl;
    tdp_server *srv;
    tdp_server_opts so;
    tdp_server_opts_default(&so);
    so.pipe.secret = secret;
    so.pipe.secret_len = sizeof(secret) - 1;
    so.pipe.recv_depth = 4;
    static const tdp_server_handler h = {.size = sizeof(h), .on_message = echo_msg};
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_server_new(sl, "127.0.0.1", 0, &so, &h, NULL, &srv), TDP_OK);
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.secret = secret;
    o.secret_len = sizeof(secret) - 1;
    tdp_schema *s = host_bytes_schema(4096);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    for (int round = 0; round < 2; round++) {
        if (round == 1)
            ucx_attack(tdp_server_port(srv), "server");
        /* a good client is served (before the attack: the planes are up) */
        tdp_pipe *c;
        assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_server_port(srv), &o, &c), TDP_OK);
        memset(tdp_td_data(td), 3 + round, 4096);
        assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(c, TMO, &got), TDP_OK);
        assert_int_equal(((uint8_t *)tdp_td_data(got))[4095], 3 + round);
        tdp_pipe_release(c, got);
        tdp_pipe_close(c, TMO);
        tdp_pipe_free(c);
    }
    tdp_server_stats st;
    tdp_server_stats_get(srv, &st);
    assert_int_equal(st.clients_total, 2); /* the attacker never became a client */
    tdp_td_unref(td);
    tdp_schema_unref(s);
    assert_int_equal(tdp_server_shutdown(srv, TMO), TDP_OK);
    tdp_server_free(srv);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/* ---- the shm attack ----------------------------------------------------------------- */

/* The shm plane's socket message header (plane_shm.c), as an attacker writes it. */
typedef struct shm_msg {
    uint32_t magic;
    uint16_t type;
    uint16_t flags;
    uint32_t gen;
    uint32_t pad;
    uint64_t seq;
    uint64_t hash;
    uint64_t json_len;
    uint64_t total;
    uint8_t key[TDP_SHM_KEY_LEN];
    uint8_t peer_key[TDP_SHM_KEY_LEN];
} shm_msg;
#define SHM_MAGIC 0x314d5350u

/* A PROOF naming the listener's link, then 32 POOL announcements of 1 GiB memfds. */
static void test_preauth_shm(void **state)
{
    (void)state;
    server s;
    server_up(&s);
    attacker a;
    attacker_hello(&a, tdp_listener_port(s.l));
    tdp__shm_hello peer_shm;
    assert_int_equal(tdp__shm_hello_get(&a.h, &peer_shm), TDP_OK);
    uint64_t live0 = live_bytes(), rss0 = rss_bytes(), nmap0, mbytes0;
    maps(&nmap0, &mbytes0);
    int fds0 = nfds();

    int sock;
    assert_int_equal(
        tdp__shm_connect(SOCK_SEQPACKET, peer_shm.name, peer_shm.name_len, false, &sock, NULL),
        TDP_OK);
    shm_msg m = {.magic = SHM_MAGIC, .type = 1};
    memcpy(m.key, peer_shm.key, TDP_SHM_KEY_LEN);
    memcpy(m.peer_key, a.key, TDP_SHM_KEY_LEN);
    assert_int_equal(tdp__shm_sock_send(sock, &m, sizeof(m), NULL, 0), TDP_OK);
    int mfd = memfd_create("attack", MFD_CLOEXEC);
    assert_true(mfd >= 0);
    assert_int_equal(ftruncate(mfd, (off_t)1 << 30), 0);
    int sent = 0;
    for (uint32_t g = 1; g <= 32; g++) {
        shm_msg pm = {.magic = SHM_MAGIC, .type = 3, .gen = g, .seq = 1};
        int three[3] = {mfd, mfd, mfd};
        if (tdp__shm_sock_send(sock, &pm, sizeof(pm), three, 3) != TDP_OK)
            break; /* the socket is full: nobody reads it */
        sent++;
    }
    close(mfd);
    usleep(300 * 1000);
    uint64_t nmap1, mbytes1;
    maps(&nmap1, &mbytes1);
    uint64_t live1 = live_bytes(), rss1 = rss_bytes();
    int fds1 = nfds();
    print_message("shm pre-auth attack: %d POOLs sent; mappings %+" PRId64 " (%+" PRId64
                  " MiB), fds %+d, live bytes %+" PRId64 ", RSS %+" PRId64 " KiB\n",
                  sent, (int64_t)(nmap1 - nmap0), ((int64_t)mbytes1 - (int64_t)mbytes0) >> 20,
                  fds1 - fds0, (int64_t)(live1 - live0), ((int64_t)rss1 - (int64_t)rss0) / 1024);
    assert_true(sent >= 1);
    /* our socket, and the listener's end of it: nothing else */
    assert_true(fds1 <= fds0 + 2);
    assert_true(mbytes1 <= mbytes0 + (4u << 20));
    assert_true(live1 <= live0 + (64u << 10));
    assert_true(rss1 <= rss0 + (8u << 20));
    /* the attacker gives up: everything goes */
    close(sock);
    close(a.fd);
    int64_t end = mono_ms() + 5000;
    while (nfds() > fds0 && mono_ms() < end)
        usleep(10 * 1000);
    assert_true(nfds() <= fds0);
    good_client(s.cl, s.l);
    server_down(&s);
}

/*
 * What unauthenticated peers hold: N of them, each with its HELLO sent, a
 * connection to the shm socket proving the keys, and a UCX frame; the
 * listener's growth per peer while they wait (for the handshake deadline).
 */
static void test_preauth_many(void **state)
{
    (void)state;
    enum { N = 24 };
    server s;
    server_up(&s);
    static attacker a[N];
    int socks[N];
    uint64_t live0 = live_bytes(), rss0 = rss_bytes(), nmap0, mbytes0;
    int64_t out0 = outstanding();
    maps(&nmap0, &mbytes0);
    int fds0 = nfds();
    for (int i = 0; i < N; i++) {
        attacker_hello(&a[i], tdp_listener_port(s.l));
        tdp__shm_hello ps;
        assert_int_equal(tdp__shm_hello_get(&a[i].h, &ps), TDP_OK);
        assert_int_equal(
            tdp__shm_connect(SOCK_SEQPACKET, ps.name, ps.name_len, false, &socks[i], NULL),
            TDP_OK);
        shm_msg m = {.magic = SHM_MAGIC, .type = 1};
        memcpy(m.key, ps.key, TDP_SHM_KEY_LEN);
        memcpy(m.peer_key, a[i].key, TDP_SHM_KEY_LEN);
        assert_int_equal(tdp__shm_sock_send(socks[i], &m, sizeof(m), NULL, 0), TDP_OK);
    }
    usleep(300 * 1000);
    uint64_t nmap1, mbytes1;
    maps(&nmap1, &mbytes1);
    uint64_t live1 = live_bytes(), rss1 = rss_bytes();
    int64_t out1 = outstanding();
    int fds1 = nfds();
    print_message("%d unauthenticated peers waiting: per peer fds %.1f (ours included: 2), "
                  "allocations held %.1f, live buffer bytes %" PRIu64 ", RSS %" PRId64
                  " KiB, mappings %.1f (%+" PRId64 " KiB in all)\n",
                  N, (double)(fds1 - fds0) / N, (double)(out1 - out0) / N, (live1 - live0) / N,
                  ((int64_t)rss1 - (int64_t)rss0) / 1024 / N, (double)(nmap1 - nmap0) / N,
                  ((int64_t)mbytes1 - (int64_t)mbytes0) / 1024);
    /* each: its TCP socket and shm connection, two ends of each in this process */
    assert_true(fds1 - fds0 <= 4 * N);
    assert_true(out1 - out0 <= 64 * N);
    assert_true(live1 - live0 <= (uint64_t)N * (256u << 10));
    assert_true(mbytes1 <= mbytes0 + (4u << 20));
    for (int i = 0; i < N; i++) {
        close(socks[i]);
        close(a[i].fd);
    }
    int64_t end = mono_ms() + 5000;
    while (nfds() > fds0 && mono_ms() < end)
        usleep(10 * 1000);
    assert_true(nfds() <= fds0);
    good_client(s.cl, s.l);
    server_down(&s);
}

/* ---- announcements that never come into force -------------------------------------- */

typedef struct announce {
    tdp__link *l;
    bool pool;
    uint64_t seq, bytes;
    tdp_err rc;
} announce;

static void announce_task(void *arg)
{
    announce *a = arg;
    a->rc = tdp__shm_rogue_announce(a->l, a->pool, a->seq, a->bytes);
}

typedef struct peak {
    int fds;
    uint64_t nmap, mbytes, rss, live;
} peak;

static void peak_take(peak *p, bool first)
{
    uint64_t n, b, r = rss_bytes(), lb = live_bytes();
    int f = nfds();
    maps(&n, &b);
    if (first || f > p->fds)
        p->fds = f;
    if (first || n > p->nmap)
        p->nmap = n;
    if (first || b > p->mbytes)
        p->mbytes = b;
    if (first || r > p->rss)
        p->rss = r;
    if (first || lb > p->live)
        p->live = lb;
}

/*
 * A same-user sender on an open shm pipe (depth 4) announces POOLs of
 * 2 x depth slots of 1 GiB, or SCHEMAs of 1 MiB of JSON in memfds, all for
 * a DATA that never comes, until the receiver ends the link. What the receiver's
 * process holds meanwhile is sampled after every announcement.
 */
static void flood_case(bool pool)
{
    enum { DEPTH = 4, MAX_SENT = 200 };
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.recv_depth = DEPTH;
    o.plane = TDP_PLANE_SHM;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, &o, NULL, NULL, &l), TDP_OK);
    tdp_pipe *c, *p;
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), &o, &c), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    if (tdp_pipe_plane(c) != TDP_PLANE_SHM) {
        print_message("not the shm plane: nothing to do\n");
        goto out;
    }
    /* one real message: the socket and rings are up on both sides */
    tdp_schema *s = host_bytes_schema(4096);
    tdp_td *td, *got;
    assert_int_equal(tdp_td_new(s, &td), TDP_OK);
    assert_int_equal(tdp_pipe_send(c, td, TMO), TDP_OK);
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
    tdp_pipe_release(p, got);
    tdp_td_unref(td);
    tdp_schema_unref(s);

    peak base, top;
    peak_take(&base, true);
    top = base;
    announce a = {.l = tdp__session_link(c),
                  .pool = pool,
                  .seq = 100,
                  .bytes = pool ? (uint64_t)1 << 30 : (uint64_t)1 << 20};
    int sent = 0;
    for (; sent < MAX_SENT; sent++) {
        tdp__call_on_loop(cl, announce_task, &a);
        if (a.rc != TDP_OK)
            break; /* the receiver hung up */
        usleep(2000);
        peak_take(&top, false);
        if (tdp_pipe_status(p) != TDP_OK)
            break;
    }
    tdp_err rc = tdp_pipe_recv(p, TMO, &got);
    print_message("%s flood: %d sent until the receiver ended the link (%s); peak over the "
                  "baseline: fds %+d, mappings %+" PRId64 " (%+" PRId64 " MiB), RSS %+" PRId64
                  " KiB, live bytes %+" PRId64 "\n",
                  pool ? "POOL" : "SCHEMA", sent, tdp_strerror(rc), top.fds - base.fds,
                  (int64_t)(top.nmap - base.nmap),
                  ((int64_t)top.mbytes - (int64_t)base.mbytes) >> 20,
                  ((int64_t)top.rss - (int64_t)base.rss) / 1024, (int64_t)(top.live - base.live));
    assert_int_equal(rc, TDP_EPROTO);
    /* at most 2 x depth + 1 POOLs (3 fds each), or a SCHEMA for each message
     * the window lets be in flight, and one (1 fd each) */
    const int inflight = (int)tdp__window(DEPTH, o.recv_window_bytes, 1);
    assert_true(sent <= (pool ? 2 * DEPTH + 1 : inflight + 1) + 1);
    assert_true(top.fds <= base.fds + (pool ? 3 * (2 * DEPTH + 1) : inflight + 1) + 4);
    /*
     * Nothing mapped for them but the first, mapped as it comes (what a
     * prepared layout's first message needs: one pool of 2 x depth slots of
     * 1 GiB); the sender's own segment is mapped while it is made.
     */
    assert_true(top.mbytes <= base.mbytes + ((uint64_t)(4 + (pool ? 2 * DEPTH : 0)) << 30));
    assert_true(top.live <= base.live + (256u << 10));
    assert_true(top.rss <= base.rss + (16u << 20));
out:
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

static void test_pool_flood(void **state)
{
    (void)state;
    flood_case(true);
}

static void test_schema_flood(void **state)
{
    (void)state;
    flood_case(false);
}

/*
 * An honest sender stays within the bound however it lends: at depth 1, six
 * loans of growing size held at once (each would need a new pool), then
 * sent; every message arrives intact and the link stays up.
 */
static void test_growing_loans(void **state)
{
    (void)state;
    enum { N = 6 };
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.plane = TDP_PLANE_SHM;
    o.recv_window_bytes = 0; /* the bound at depth 1 itself */
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, &o, NULL, NULL, &l), TDP_OK);
    tdp_pipe *c, *p;
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), &o, &c), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    tdp_schema *s[N];
    tdp_td *loan[N];
    for (int i = 0; i < N; i++) {
        s[i] = host_bytes_schema((int64_t)4096 << i);
        tdp_err rc = TDP_EAGAIN;
        for (int k = 0; k < 1000 && rc == TDP_EAGAIN; k++) /* the shm proof may be on its way */
            if ((rc = tdp_pipe_loan(c, s[i], &loan[i])) == TDP_EAGAIN)
                usleep(1000);
        assert_int_equal(rc, TDP_OK);
        memset(tdp_td_data(loan[i]), 'a' + i, tdp_td_nbytes(loan[i]));
    }
    for (int i = 0; i < N; i++) {
        tdp_td *got;
        assert_int_equal(tdp_pipe_send(c, loan[i], TMO), TDP_OK);
        assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_OK);
        assert_int_equal(tdp_td_nbytes(got), (uint64_t)4096 << i);
        const uint8_t *b = tdp_td_data(got);
        assert_int_equal(b[0], 'a' + i);
        assert_int_equal(b[tdp_td_nbytes(got) - 1], 'a' + i);
        tdp_pipe_release(p, got);
        tdp_td_unref(loan[i]);
        tdp_schema_unref(s[i]);
    }
    assert_int_equal(tdp_pipe_status(c), TDP_OK);
    assert_int_equal(tdp_pipe_status(p), TDP_OK);
    tdp_pipe_close(c, TMO);
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

/* ---- a control segment out of bounds ----------------------------------------------- */

/*
 * This program is linked with --wrap=close: every close of the library
 * comes here, and one of a descriptor that is not open (closed twice: the
 * second close would hit whatever another thread opened meanwhile) counts.
 */
static atomic_int closed_twice;

int __real_close(int fd);
int __wrap_close(int fd);
int __wrap_close(int fd)
{
    int rc = __real_close(fd);
    if (rc != 0 && errno == EBADF && fd >= 0)
        atomic_fetch_add(&closed_twice, 1);
    return rc;
}

typedef struct rogue_ctl {
    tdp__link *l;
    uint32_t ring_cap;
    tdp_err rc;
} rogue_ctl;

static void rogue_ctl_task(void *arg)
{
    rogue_ctl *r = arg;
    r->rc = tdp__shm_rogue_ctl(r->l, r->ring_cap);
}

/*
 * A same-user sender's first message on the shm socket is a CTL whose
 * rings are larger than this side's depth asks for: a valid segment,
 * mapped, then refused. The link ends with TDP_EPROTO and each of the
 * three fds that came with it is closed once.
 */
static void test_ctl_rings_too_large(void **state)
{
    (void)state;
    tdp_loop *sl, *cl;
    tdp_listener *l;
    tdp_pipe_opts o;
    tdp_pipe_opts_default(&o);
    o.recv_depth = 4;
    o.plane = TDP_PLANE_SHM;
    assert_int_equal(tdp_loop_new(NULL, &sl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(sl), TDP_OK);
    assert_int_equal(tdp_loop_new(NULL, &cl), TDP_OK);
    assert_int_equal(tdp_loop_start_thread(cl), TDP_OK);
    assert_int_equal(tdp_listener_new(sl, "127.0.0.1", 0, &o, NULL, NULL, &l), TDP_OK);
    tdp_pipe *c, *p;
    assert_int_equal(tdp_pipe_connect(cl, "127.0.0.1", tdp_listener_port(l), &o, &c), TDP_OK);
    assert_int_equal(tdp_listener_accept(l, TMO, &p), TDP_OK);
    if (tdp_pipe_plane(c) != TDP_PLANE_SHM) {
        print_message("not the shm plane: nothing to do\n");
        goto out;
    }
    int before = atomic_load(&closed_twice);
    /* rings of 4096: the most depth 4 (with its window) asks for is 256 */
    rogue_ctl r = {.l = tdp__session_link(c), .ring_cap = 4096, .rc = TDP_EINVAL};
    for (int k = 0; k < 1000 && r.rc == TDP_EINVAL; k++) { /* the shm proof may be on its way */
        tdp__call_on_loop(cl, rogue_ctl_task, &r);
        if (r.rc == TDP_EINVAL)
            usleep(1000);
    }
    assert_int_equal(r.rc, TDP_OK);
    tdp_td *got;
    assert_int_equal(tdp_pipe_recv(p, TMO, &got), TDP_EPROTO);
    assert_int_equal(atomic_load(&closed_twice), before);
out:
    tdp_pipe_free(c);
    tdp_pipe_free(p);
    tdp_listener_free(l);
    tdp_loop_free(cl);
    tdp_loop_free(sl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_preauth_ucx),         cmocka_unit_test(test_preauth_ucx_server),
        cmocka_unit_test(test_preauth_shm),         cmocka_unit_test(test_preauth_many),
        cmocka_unit_test(test_pool_flood),          cmocka_unit_test(test_schema_flood),
        cmocka_unit_test(test_growing_loans),       cmocka_unit_test(test_preauth_proven),
        cmocka_unit_test(test_ctl_rings_too_large),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
