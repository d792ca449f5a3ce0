/*
 * recv_fanin.h: `tdpipe recv --producers N` — several producers into one
 * stream (tdp_fanin), with per-producer figures in the rate lines and the
 * summary (docs/cli.md, "recv").
 */
#ifndef TDPIPE_TOOLS_RECV_FANIN_H
#define TDPIPE_TOOLS_RECV_FANIN_H

#include <stdbool.h>
#include <stdint.h>
#include <tdpipe/tdpipe.h>

typedef struct tdp_cli_fanin_args {
    const char *bind; /* NULL: all addresses */
    uint16_t port;
    uint32_t depth; /* per producer */
    tdp_plane plane;
    int64_t timeout_ms; /* for the first producer, and for each message; -1 forever */
    tdp_pipe_opts ka;   /* --keepalive, --secret-file, --checksum */
    uint32_t producers; /* the run ends when this many have left */
    uint64_t count;     /* 0: no limit on messages */
    bool verify, json;
    double interval; /* seconds between rate lines; 0: none */
} tdp_cli_fanin_args;

/* Run it; returns the exit status (tdp_cli_exit). */
int tdp_cli_recv_fanin(const tdp_cli_fanin_args *a);

#endif
