/*
 * stream_client.c: `tdp_stream_client`, a producer for bench/rss_killed_clients.sh.
 * It is `tdpipe send` reduced to what that script needs, plus a forced data
 * plane: it connects, then sends the synthetic tensordict of `tdpipe send`
 * (same schema, same pattern, so `tdpipe serve -m sink` verifies it) COUNT
 * times, or until it is killed when COUNT is 0, then closes cleanly. It
 * prints "connected on the PLANE plane" once the HELLO is done.
 *
 *   tdp_stream_client HOST:PORT [--plane auto|ucx|shm] [--size BYTES] [--count N]
 *                     [--timeout MS] [--secret-file F] [--peer-mode auto|ucx|socket]
 *
 * Exit status as `tdpipe send`: 0 ok, 1 failure, 2 usage, 3 cannot connect,
 * 4 peer ended with an error, 5 timed out.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tdpipe/tdpipe.h>

#include "cli.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: tdp_stream_client HOST:PORT [options]\n"
               "\n"
               "Send `tdpipe send`'s synthetic tensordict COUNT times (0: until killed),\n"
               "then close cleanly. For bench/rss_killed_clients.sh.\n"
               "\n"
               "  -P, --plane NAME   data plane: auto (default), ucx or shm\n"
               "  -s, --size BYTES   payload size (default 100MB)\n"
               "  -n, --count N      messages (default 0: until killed)\n"
               "  -t, --timeout MS   connect and per-message deadline (default 10000)\n"
               "  -S, --secret-file F  shared secret, as `tdpipe send --secret-file`\n"
               "  -M, --peer-mode MODE auto (default), ucx or socket (docs/pipe.md)\n"
               "\n"
               "Exit status: 0 ok, 1 failure, 2 usage, 3 cannot connect, 4 peer error,\n"
               "5 timed out.\n");
}

typedef struct args {
    char host[TDP_CLI_HOST_LEN];
    uint16_t port;
    tdp_plane plane;
    uint64_t size, count;
    int64_t timeout_ms;
    tdp_pipe_opts net; /* what --secret-file sets */
    tdp_peer_mode peer_mode;
} args;

static int parse(int argc, char **argv, args *a)
{
    static const struct option opts[] = {
        {"plane", required_argument, NULL, 'P'}, {"size", required_argument, NULL, 's'},
        {"count", required_argument, NULL, 'n'}, {"timeout", required_argument, NULL, 't'},
        {"secret-file", required_argument, NULL, 'S'},
        {"peer-mode", required_argument, NULL, 'M'},
        {"help", no_argument, NULL, 'h'},        {NULL, 0, NULL, 0},
    };
    static const char *const cmd = "tdp_stream_client";
    int c;

    *a = (args){.plane = TDP_PLANE_AUTO, .size = 100 * 1000 * 1000, .timeout_ms = 10000};
    tdp_pipe_opts_default(&a->net);
    tdp_cli_getopt_reset();
    while ((c = getopt_long(argc, argv, ":P:s:n:t:S:M:h", opts, NULL)) != -1) {
        switch (c) {
        case 'P':
            if (tdp_plane_parse(optarg, &a->plane) != TDP_OK)
                return tdp_cli_usage_error(cmd, "unknown plane '%s'", optarg);
            break;
        case 's': {
            const char *why = "zero";
            if (!tdp_cli_parse_size(optarg, &a->size, &why) || a->size == 0)
                return tdp_cli_usage_error(cmd, "invalid size '%s': %s", optarg, why);
            break;
        }
        case 'n':
            if (!tdp_cli_parse_u64(optarg, 0, UINT64_MAX, &a->count))
                return tdp_cli_usage_error(cmd, "bad count '%s'", optarg);
            break;
        case 't':
            if (!tdp_cli_parse_timeout(optarg, &a->timeout_ms))
                return tdp_cli_usage_error(cmd, "bad timeout '%s'", optarg);
            break;
        case 'S':
            if (!tdp_cli_read_secret(cmd, optarg, &a->net))
                return TDP_EXIT_USAGE;
            break;
        case 'M':
            if (strcmp(optarg, "auto") == 0)
                a->peer_mode = TDP_PEER_AUTO;
            else if (strcmp(optarg, "ucx") == 0)
                a->peer_mode = TDP_PEER_UCX;
            else if (strcmp(optarg, "socket") == 0)
                a->peer_mode = TDP_PEER_SOCKET;
            else
                return tdp_cli_usage_error(cmd, "unknown peer mode '%s'", optarg);
            break;
        case 'h':
            usage(stdout);
            return TDP_EXIT_OK;
        default:
            return tdp_cli_bad_option(cmd, argv, c);
        }
    }
    if (optind != argc - 1)
        return tdp_cli_usage_error(cmd, "one HOST:PORT expected");
    if (!tdp_cli_parse_hostport(argv[optind], false, a->host, sizeof(a->host), &a->port))
        return tdp_cli_usage_error(cmd, "bad address '%s'", argv[optind]);
    return -1;
}

int main(int argc, char **argv)
{
    args a;
    tdp_schema *s;
    tdp_loop *loop;
    tdp_pipe *pipe;
    tdp_td *td;
    tdp_pipe_opts opts;
    tdp_err rc;
    uint64_t seq;
    int ec = parse(argc, argv, &a);

    if (ec >= 0)
        return ec;
    /* `tdpipe send`'s schema, marked as reading no replies: serve checks the pattern */
    if ((rc = tdp_cli_send_schema(a.size, TDP_DEVICE_CPU_INIT, false, &s)) != TDP_OK)
        goto fail;
    rc = tdp_td_new(s, &td);
    tdp_schema_unref(s); /* td holds it */
    if (rc != TDP_OK)
        goto fail;
    if ((rc = tdp_loop_new(NULL, &loop)) != TDP_OK) {
        tdp_cli_error("tdp_stream_client", "cannot create the loop: %s", tdp_strerror(rc));
        goto err_free_td;
    }
    tdp_pipe_opts_default(&opts);
    opts.connect_timeout_ms = a.timeout_ms < 0 ? 365LL * 24 * 3600 * 1000 : a.timeout_ms;
    opts.plane = a.plane;
    tdp_cli_apply_net_opts(&a.net, &opts);
    opts.peer_mode = a.peer_mode;
    if ((rc = tdp_pipe_connect(loop, a.host, a.port, &opts, &pipe)) != TDP_OK) {
        tdp_cli_error("tdp_stream_client", "cannot connect: %s", tdp_strerror(rc));
        goto err_free_loop;
    }
    /* the script that kills this process times its delay from this line */
    printf("connected on the %s plane\n", tdp_plane_name(tdp_pipe_plane(pipe)));
    fflush(stdout);
    for (seq = 1; a.count == 0 || seq <= a.count; seq++) {
        tdp_cli_fill(td, seq);
        if ((rc = tdp_pipe_send(pipe, td, a.timeout_ms)) != TDP_OK) {
            tdp_cli_error("tdp_stream_client", "message %" PRIu64 ": %s", seq, tdp_strerror(rc));
            break;
        }
    }
    if (rc == TDP_OK && (rc = tdp_pipe_close(pipe, a.timeout_ms)) != TDP_OK)
        tdp_cli_error("tdp_stream_client", "close: %s", tdp_strerror(rc));
    if (rc == TDP_OK)
        printf("sent %" PRIu64 " messages on the %s plane\n", a.count,
               tdp_plane_name(tdp_pipe_plane(pipe)));
    tdp_pipe_free(pipe);
err_free_loop:
    tdp_loop_free(loop);
err_free_td:
    tdp_td_unref(td);
    return tdp_cli_exit_for(rc);
fail:
    tdp_cli_error("tdp_stream_client", "cannot make the message: %s", tdp_strerror(rc));
    return TDP_EXIT_FAIL;
}
