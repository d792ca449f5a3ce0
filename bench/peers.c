/*
 * peers.c: `tdp_peers`, the command that measures tdpipe's reference points
 * and assembles the comparison table. See docs/benchmarks.md.
 *
 *   tdp_peers memcpy|tcp|zmq|perftest [--sizes LIST] [--rounds N] [--json FILE]
 *   tdp_peers table FILE... [--json OUT]
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peers.h"

static const peer_ops *const peers[] = {&peer_memcpy, &peer_tcp, &peer_zmq, &peer_perftest};
#define NPEERS (sizeof(peers) / sizeof(peers[0]))

static void usage(FILE *f)
{
    fprintf(f, "usage: tdp_peers PEER [options]\n"
               "       tdp_peers table FILE.json... [--json OUT.json]\n"
               "       tdp_peers check FILE.json...\n"
               "\n"
               "Measure one of tdpipe's reference points on loopback, on the payloads and\n"
               "with the method of `tdpipe bench` (docs/benchmarks.md):\n"
               "  memcpy     single-thread memcpy: the copy limit\n"
               "  tcp        raw TCP socket loop over 127.0.0.1 (TCP_NODELAY, length-prefixed)\n"
               "  zmq        ZeroMQ: REQ/REP for latency, PUSH/PULL for throughput\n"
               "  perftest   ucx_perftest ucp_am_lat / ucp_am_bw with the UCX_TLS of the\n"
               "             environment: the transport's own limit\n"
               "\n"
               "  --sizes LIST     payload sizes (default 1KB,1MB,100MB; KB = 1000, KiB = 1024)\n"
               "  --rounds N       ping-pongs and messages per repeat (default: scaled by\n"
               "                   size exactly as tdpipe bench; at least 3)\n"
               "  --wait MODE      perftest: poll (default, busy-polling) or sleep (-E sleep)\n"
               "  --perftest PATH  the ucx_perftest to run (default: from PATH)\n"
               "  --err-mode       perftest: endpoints in UCX's peer-failure mode (-e), the\n"
               "                   mode of tdpipe's endpoints over TCP (docs/pipe.md)\n"
               "  --transport T    zmq: tcp (default, tcp://127.0.0.1) or ipc (a Unix socket)\n"
               "  --json FILE      write the results as JSON (the shape of tdpipe bench --json)\n"
               "  --quiet          no progress on stderr\n"
               "\n"
               "`table` reads the JSON files of tdpipe bench and of the peers (bench/run.sh\n"
               "writes them) and prints one table with tdpipe's ratio to each peer.\n"
               "`check` exits 0 when every file has results with positive figures.\n"
               "\n"
               "Exit status: 0 ok, 1 failure, 2 usage error, 3 peer not available here.\n");
}

static int parse_args(int argc, char **argv, peer_cfg *cfg)
{
    static const struct option opts[] = {
        {"sizes", required_argument, NULL, 's'},
        {"rounds", required_argument, NULL, 'r'},
        {"wait", required_argument, NULL, 'w'},
        {"perftest", required_argument, NULL, 'p'},
        {"json", required_argument, NULL, 'j'},
        {"quiet", no_argument, NULL, 'q'},
        {"transport", required_argument, NULL, 't'},
        {"err-mode", no_argument, NULL, 'e'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            if (!peers_parse_sizes(optarg, cfg))
                return 2;
            break;
        case 'r':
            cfg->rounds = atoi(optarg);
            if (cfg->rounds < 3) {
                fprintf(stderr, "tdp_peers: --rounds must be at least 3\n");
                return 2;
            }
            break;
        case 'w':
            if (strcmp(optarg, "poll") != 0 && strcmp(optarg, "sleep") != 0) {
                fprintf(stderr, "tdp_peers: --wait is poll or sleep\n");
                return 2;
            }
            cfg->wait_mode = optarg;
            break;
        case 't':
            if (strcmp(optarg, "tcp") != 0 && strcmp(optarg, "ipc") != 0) {
                fprintf(stderr, "tdp_peers: --transport is tcp or ipc\n");
                return 2;
            }
            cfg->zmq_ipc = strcmp(optarg, "ipc") == 0;
            break;
        case 'e':
            cfg->err_mode = true;
            break;
        case 'p':
            cfg->perftest_bin = optarg;
            break;
        case 'j':
            cfg->json_path = optarg;
            break;
        case 'q':
            cfg->quiet = true;
            break;
        case 'h':
            usage(stdout);
            return -1;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tdp_peers: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    return 0;
}

static void print_results(const peer_ops *p, const size_result *r, int n)
{
    printf("%-9s %-10s %11s %11s %11s %13s %s\n", p->name, "size", "lat mean", "lat p50", "lat p99",
           "throughput", "(min..max of 3)");
    for (int i = 0; i < n; i++) {
        char sz[32];
        peers_format_size(r[i].bytes, sz, sizeof(sz));
        printf("%-9s %-10s %8.2f us %8.2f us %8.2f us %8.3f GB/s (%.3f..%.3f)\n", "", sz,
               r[i].lat_mean, r[i].lat_p50, r[i].lat_p99, r[i].tp_median / 1e9, r[i].tp_min / 1e9,
               r[i].tp_max / 1e9);
    }
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "table") == 0)
        return peers_table_main(argc - 1, argv + 1);
    if (strcmp(argv[1], "check") == 0)
        return peers_check_main(argc - 1, argv + 1);

    const peer_ops *peer = NULL;
    for (size_t i = 0; i < NPEERS; i++)
        if (strcmp(argv[1], peers[i]->name) == 0)
            peer = peers[i];
    if (peer == NULL) {
        fprintf(stderr, "tdp_peers: unknown peer '%s' (memcpy, tcp, zmq, perftest, table)\n",
                argv[1]);
        return 2;
    }
    peer_cfg cfg = {
        .sizes = {1000, 1000 * 1000, 100 * 1000 * 1000}, /* as tdpipe bench */
        .nsizes = 3,
        .wait_mode = "poll",
        .perftest_bin = "ucx_perftest",
    };
    int rc = parse_args(argc - 1, argv + 1, &cfg);
    if (rc != 0)
        return rc < 0 ? 0 : rc;

    /* loopback only: UCX's TCP transport would otherwise try every interface */
    setenv("UCX_NET_DEVICES", "lo", 0);
    signal(SIGPIPE, SIG_IGN);

    size_result res[PEERS_MAX_SIZES];
    rc = peer->run(&cfg, res);
    if (rc != 0)
        return rc;
    print_results(peer, res, cfg.nsizes);
    if (cfg.json_path != NULL && peers_write_json(&cfg, peer, res, cfg.nsizes) != 0)
        return 1;
    return 0;
}
