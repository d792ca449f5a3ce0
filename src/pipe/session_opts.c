/* session_opts.c: a pipe's options (defaults, resolution) and the planes' names. */
#include <string.h>

#include "session.h"
#include "plane.h"
#include "../core/sized.h"
#include "../schema/schema_int.h"

void tdp_pipe_opts_default(tdp_pipe_opts *o)
{
    if (o == NULL)
        return;
    *o = (tdp_pipe_opts){
        .size = sizeof(*o),
        .recv_depth = 1,
        .connect_timeout_ms = 10000,
        .linger_ms = 5000,
        .peer_mode = TDP_PEER_AUTO,
        /* a dead host is seen within 5 + 1 x 15 = 20 s of its last answer,
         * and a link down for less than 10 s is ridden out (docs/pipe.md) */
        .keepalive_idle_s = 5,
        .keepalive_intvl_s = 1,
        .keepalive_cnt = 15,
        .plane = TDP_PLANE_AUTO,
        .cuda_device = -1,
        .recv_window_bytes = TDP_RECV_WINDOW_DEFAULT,
    };
}

void tdp__opts_resolve(const tdp_pipe_opts *in, tdp_pipe_opts *out, tdp_schema_limits *lim)
{
    tdp_pipe_opts_default(out);
    tdp__limits_resolve(NULL, lim);
    if (in == NULL)
        return;
    size_t n = in->size < sizeof(*in) ? in->size : sizeof(*in);
#define TAKE(f)                                                                                    \
    if (offsetof(tdp_pipe_opts, f) + sizeof(in->f) <= n && in->f)                                  \
        out->f = in->f;
    TAKE(recv_depth)
    TAKE(recv_device_set)
    TAKE(connect_timeout_ms)
    TAKE(linger_ms)
    TAKE(peer_mode)
    TAKE(keepalive_idle_s)
    TAKE(keepalive_intvl_s)
    TAKE(keepalive_cnt)
    TAKE(plane)
    TAKE(planes_forbidden)
    TAKE(secret)
    TAKE(secret_len)
    TAKE(reconnect_ms)
    TAKE(want_peer_depth)
    TAKE(latency_stats)
    TAKE(connect_wait_ms)
    TAKE(cuda_device_set)
    TAKE(checksum)
#undef TAKE
    /* 0 is an answer here, not "the default": it turns the window off */
    if (offsetof(tdp_pipe_opts, recv_window_bytes) + sizeof(in->recv_window_bytes) <= n)
        out->recv_window_bytes = in->recv_window_bytes;
    if (out->cuda_device_set)
        out->cuda_device = in->cuda_device;
    if (out->recv_device_set)
        out->recv_device = in->recv_device;
    if (offsetof(tdp_pipe_opts, limits) + sizeof(in->limits) <= n && in->limits != NULL)
        tdp__limits_resolve(in->limits, lim);
    out->limits = NULL; /* copied into *lim */
    if (out->recv_depth > TDP_MAX_DEPTH)
        out->recv_depth = TDP_MAX_DEPTH;
    if (out->want_peer_depth > TDP_MAX_DEPTH)
        out->want_peer_depth = TDP_MAX_DEPTH;
    if (out->recv_window_bytes != 0 && out->recv_window_bytes < TDP_HX_WINDOW_MIN)
        out->recv_window_bytes = TDP_HX_WINDOW_MIN;
    if (out->recv_window_bytes > TDP_HX_WINDOW_MAX)
        out->recv_window_bytes = TDP_HX_WINDOW_MAX;
}

const char *tdp_plane_name(tdp_plane plane)
{
    switch (plane) {
    case TDP_PLANE_AUTO:
        return "auto";
    case TDP_PLANE_UCX:
        return "ucx";
    case TDP_PLANE_SHM:
        return "shm";
    case TDP_PLANE_CUDA_IPC:
        return "cuda-ipc";
    case TDP_PLANE_TCP:
        return "tcp";
    }
    return NULL;
}

tdp_err tdp_plane_parse(const char *name, tdp_plane *out)
{
    static const tdp_plane all[] = {TDP_PLANE_AUTO, TDP_PLANE_UCX, TDP_PLANE_SHM,
                                    TDP_PLANE_CUDA_IPC, TDP_PLANE_TCP};
    if (name == NULL || out == NULL)
        return TDP_EINVAL;
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (strcmp(name, tdp_plane_name(all[i])) == 0) {
            *out = all[i];
            return TDP_OK;
        }
    }
    return TDP_EINVAL;
}
