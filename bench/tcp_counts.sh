#!/usr/bin/env bash
# bench/tcp_counts.sh TDPIPE [VAR=value ...] [-- BENCH_ARGS...]: where a 1 MB
# message's time goes over UCX TCP, in counts that do not depend on how busy
# the machine is. Runs `TDPIPE bench --tls tcp --plane ucx --sizes 1MB
# --rounds 200` under strace -f (both processes) with the given environment
# (e.g. UCX_TCP_RX_SEG_SIZE=256k) and extra bench arguments (e.g.
# --peer-mode socket), and prints per 1 MB message: sendmsg calls (about one
# per UCX fragment, plus the rendezvous' control messages), receive calls,
# epoll_wait calls that may sleep (wake-ups of a loop) and those with a zero
# timeout (UCX's TCP transport polls its own epoll set on every progress call).
# Messages: 200 + 22 warm-up ping-pongs of two messages, 3 repeats of 200 + 21
# one-way, the first send: 1108. strace slows both sides; compare runs of this
# script with each other, not with untraced timings.
set -euo pipefail
TDPIPE=${1:?usage: tcp_counts.sh TDPIPE [VAR=value ...] [-- BENCH_ARGS...]}
shift
ENVS=()
while [[ $# -gt 0 && $1 != -- ]]; do
    ENVS+=("$1")
    shift
done
[[ ${1:-} == -- ]] && shift
MSGS=1108
OUT=$(mktemp /tmp/tdp-tcp-counts-XXXXXX)
trap 'rm -f "$OUT"' EXIT
strace -f -qq -e trace=epoll_wait,sendmsg,recvfrom,recvmsg,readv -o "$OUT" \
    env "${ENVS[@]}" "$TDPIPE" bench --tls tcp --plane ucx --sizes 1MB --rounds 200 --quiet "$@" \
    >/dev/null
# a call interrupted by another thread's line appears twice (unfinished,
# resumed): count the resumed half, which carries the arguments' tail
awk -v m=$MSGS '
/unfinished/ { next }
/epoll_wait/ { if ($0 ~ /, 0\) +=/) z++; else s++ }
/sendmsg/ { snd++ }
/recvfrom|recvmsg|readv/ { rcv++ }
END {
    printf "per 1 MB message (%d messages): sendmsg %.1f, recv %.1f, ", m, snd / m, rcv / m
    printf "epoll_wait that may sleep %.1f, zero-timeout epoll_wait %.1f\n", s / m, z / m
}' "$OUT"
