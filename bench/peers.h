/*
 * peers.h: `tdp_peers`, the reference points `tdpipe bench` is compared
 * with (docs/benchmarks.md). Each peer measures, for each payload size, what
 * `tdpipe bench` measures, the same way:
 *
 *   latency     one-way time = half the round trip of a ping-pong, after a
 *               warm-up; mean, p50, p99, min;
 *   throughput  messages back to back, timed by the receiver from the
 *               completion of the first counted message to the last; the
 *               bytes counted are exactly messages x size; 3 repeats,
 *               median, min, max.
 *
 * The number of rounds scales with the size exactly as in tools/cmd_bench.c
 * (lat_rounds, tp_count), so the peers move the same bytes as tdpipe.
 *
 * The program does not link the tdpipe library: the peers are measured
 * without it.
 */
#ifndef TDPIPE_BENCH_PEERS_H
#define TDPIPE_BENCH_PEERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

#define PEERS_MAX_SIZES 16
#define PEERS_REPEATS   3
#define PEERS_MIN_SIZE  128 /* as tdpipe bench: room for the control words */
#define PEERS_TMO_MS    120000

typedef struct peer_cfg {
    uint64_t sizes[PEERS_MAX_SIZES];
    int nsizes;
    int rounds; /* 0: scaled by size, as tdpipe bench */
    bool quiet;
    const char *json_path;
    /* perftest only */
    const char *wait_mode;    /* "poll" (ucx_perftest's default) or "sleep" */
    const char *perftest_bin; /* default "ucx_perftest" from PATH */
    bool err_mode;            /* -e: endpoints in UCX's peer-failure mode, as tdpipe's */
    /* zmq only */
    bool zmq_ipc; /* ipc:// (an abstract socket) instead of tcp://127.0.0.1 */
} peer_cfg;

/* One size's figures; a field a peer cannot measure stays negative. */
typedef struct size_result {
    uint64_t bytes;
    double lat_mean, lat_p50, lat_p99, lat_min; /* microseconds */
    int lat_n;
    double tp_bps[PEERS_REPEATS]; /* bytes per second, each repeat */
    double tp_median, tp_min, tp_max;
    uint64_t tp_msgs; /* messages timed in each repeat */
} size_result;

/*
 * A peer: run() measures every size of cfg into res[0..cfg->nsizes) and
 * returns 0, or prints why on stderr and returns an exit status (1 failure,
 * 3 the peer is not available in this build or on this machine).
 */
typedef struct peer_ops {
    const char *name;
    const char *method; /* one line for the JSON: what is measured, how */
    int (*run)(const peer_cfg *cfg, size_result *res);
    void (*describe)(const peer_cfg *cfg, json_t *obj); /* extra JSON fields, or NULL */
} peer_ops;

extern const peer_ops peer_memcpy;
extern const peer_ops peer_tcp;
extern const peer_ops peer_zmq;
extern const peer_ops peer_perftest;

/* ---- shared by the peers (common.c) ----------------------------------------- */

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t peers_now_ns(void);

/* Ping-pongs timed for a size, and the untimed warm-up before them. */
int peers_lat_rounds(const peer_cfg *cfg, uint64_t bytes);
int peers_lat_warm(int rounds);

/* Messages per throughput repeat, and the index of the first one timed. */
int peers_tp_count(const peer_cfg *cfg, uint64_t bytes);
int peers_tp_warm(int count);

/* Fill res's latency fields from n samples (sorted in place). */
void peers_lat_summary(double *samples, int n, size_result *res);

/* Fill res's median/min/max from res->tp_bps. */
void peers_tp_summary(size_result *res);

/* Empty result for `bytes`: every figure -1 (not measured). */
void peers_result_init(size_result *res, uint64_t bytes);

/* Parse "1KB,1MB,100MB" (KB/MB/GB = 1000^n, KiB/MiB/GiB = 1024^n) as tdpipe bench. */
bool peers_parse_sizes(const char *list, peer_cfg *cfg);

/* "1.00 KB", "100 MB": for progress lines. */
const char *peers_format_size(uint64_t bytes, char *buf, size_t len);

/* Progress on stderr unless quiet: "  tcp  1.00 KB  latency ...". */
void peers_progress(const peer_cfg *cfg, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Write the results as JSON (the shape of `tdpipe bench --json`). 0 on success. */
int peers_write_json(const peer_cfg *cfg, const peer_ops *peer, const size_result *res, int n);

/* ---- loopback helpers (net.c) ---------------------------------------------------- */

/* A TCP socket listening on 127.0.0.1 at an ephemeral port; -1 on error. */
int net_listen_loopback(uint16_t *port);

/* Connect to 127.0.0.1:port with TCP_NODELAY; -1 on error. */
int net_connect_loopback(uint16_t port);

/* accept() with a deadline; -1 on error or timeout. */
int net_accept_timeout(int lfd, int timeout_ms);

/* A port that was free a moment ago on 127.0.0.1 (bind port 0, read, close); 0 on error. */
uint16_t net_free_port(void);

/* Write exactly len bytes (blocking socket); false on error. */
bool net_send_all(int fd, const void *buf, size_t len);

/* Wait for a child with a deadline; kills it (SIGKILL) when it passes. Returns the status. */
int peers_wait_child(int pid, int timeout_ms, bool *timed_out);

/* ---- `tdp_peers table` (table.c) ------------------------------------------------- */

int peers_table_main(int argc, char **argv);

/* `tdp_peers check FILE...`: every figure present and positive (the smoke test). */
int peers_check_main(int argc, char **argv);

#endif /* TDPIPE_BENCH_PEERS_H */
