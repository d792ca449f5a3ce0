#!/usr/bin/env bash
# bench/run.sh: tdpipe and its reference points, in one run, on the same
# payloads, over loopback — then one table with tdpipe's ratio to each.
#
#   bench/run.sh [--tls tcp|shm|default] [--plane NAME] [--sizes LIST] [--busy-poll US]
#                [--runs K] [--rounds N] [--pin CPUS] [--json FILE] [--out DIR] [--build DIR]
#   bench/run.sh --fanout [bench/fanout.sh's options]   (the fan-out figures instead)
#
# In order: tdpipe bench (event-driven; and busy-poll with --busy-poll),
# ucx_perftest ucp_am_lat/ucp_am_bw (busy-polling, and -E sleep), ZeroMQ,
# raw TCP, memcpy (all through build/bench/tdp_peers); then
# `tdp_peers table` prints the table and writes the combined JSON. With
# --runs K the whole sequence is made K times, one after the other, and the
# table shows the median of the K runs and their spread.
# It builds nothing. Method and results: docs/benchmarks.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${TDP_BUILD_DIR:-$ROOT/build}
TLS=default
SIZES=1KB,1MB,100MB
BUSY_POLL=0
PLANE=auto
ROUNDS=
RUNS=1
PIN=
JSON=
OUT=

usage() {
    cat <<EOF
usage: bench/run.sh [options]

Runs tdpipe bench, ucx_perftest (UCP am_lat/am_bw), ZeroMQ, a raw TCP loop
and memcpy on the same payload sizes over loopback, and prints one table with
tdpipe's ratio to each (docs/benchmarks.md).

  --tls MODE       UCX transports for tdpipe and ucx_perftest: tcp (UCX_TLS=tcp),
                   shm (UCX_TLS=shm,self) or default (UCX_TLS unset: UCX picks)
  --plane NAME     tdpipe's data plane: auto (default: shm on one host), ucx
                   or shm (loaned slots, no copy; docs/planes.md)
  --sizes LIST     payload sizes (default 1KB,1MB,100MB; KB = 1000 B)
  --busy-poll US   also run tdpipe with this busy-poll window, the progress
                   mode of ucx_perftest (the event-driven run is always made)
  --runs K         make the whole sequence K times (interleaved: tdpipe, peers,
                   tdpipe, peers, ...); the table shows medians over the runs
  --rounds N       ping-pongs and messages per repeat for every tool
                   (default: scaled by size, as tdpipe bench)
  --pin CPUS       run the event-driven tools (tdpipe without busy-poll,
                   perftest -E sleep, ZeroMQ, raw TCP) under taskset -c CPUS,
                   both peers alike; busy-polling ones are never pinned (two
                   spinning peers on one CPU would take turns). On a small VM
                   a wakeup across CPUs can cost 15-20 us and comes and goes
                   from run to run; --pin 0 measures every tool's same-CPU
                   wakeup instead (docs/benchmarks.md)
  --json FILE      the combined results (default: OUT/results.json)
  --out DIR        where each tool's JSON goes (default: BUILD/bench-results/DATE-TLS)
  --build DIR      the build directory (default: build/, or \$TDP_BUILD_DIR)
  --fanout ...     instead: the fan-out figures (bench/fanout.sh, with the
                   options after --fanout: broadcast of 100 MB to 1, 2, 4
                   consumers; 1 MB to 4 consumers against ZeroMQ XPUB/SUB)
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
    --tls) TLS=$2; shift 2 ;;
    --sizes) SIZES=$2; shift 2 ;;
    --plane) PLANE=$2; shift 2 ;;
    --busy-poll) BUSY_POLL=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --pin) PIN=$2; shift 2 ;;
    --json) JSON=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --fanout) shift; exec "$ROOT/bench/fanout.sh" --build "$BUILD" "$@" ;;
    -h | --help) usage; exit 0 ;;
    *) echo "bench/run.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
done

# Loopback only, for UCX (tdpipe and ucx_perftest) and everything else.
export UCX_NET_DEVICES=lo
case "$TLS" in
tcp) export UCX_TLS=tcp ;;
shm) export UCX_TLS=shm,self ;;
default) unset UCX_TLS ;;
*) echo "bench/run.sh: --tls is tcp, shm or default" >&2; exit 2 ;;
esac

TDPIPE=$BUILD/tools/tdpipe
PEERS=$BUILD/bench/tdp_peers
for exe in "$TDPIPE" "$PEERS"; do
    if [[ ! -x $exe ]]; then
        echo "bench/run.sh: $exe is missing; build first: scripts/demo.sh, or" >&2
        echo "  cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo && cmake --build build -j" >&2
        exit 2
    fi
done

EV=() # the prefix of the event-driven tools' commands
if [[ -n $PIN ]]; then
    if ! command -v taskset >/dev/null || ! taskset -c "$PIN" true 2>/dev/null; then
        echo "bench/run.sh: --pin $PIN: taskset cannot pin to that CPU list here" >&2
        exit 2
    fi
    EV=(taskset -c "$PIN")
fi

if ! [[ $RUNS =~ ^[1-9][0-9]*$ ]]; then
    echo "bench/run.sh: --runs is a positive integer" >&2
    exit 2
fi

# Percentage of CPU time idle over one second: the figures assume an
# otherwise idle machine, and this says whether it was.
cpu_idle() {
    local a b
    read -r -a a </proc/stat
    sleep 1
    read -r -a b </proc/stat
    local busy=0 idle=$(((b[4] + b[5]) - (a[4] + a[5]))) total=0 i
    for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
    echo $((total > 0 ? 100 * idle / total : 0))
}

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-$BUILD/bench-results/$STAMP-$TLS-$PLANE$([[ $BUSY_POLL == 0 ]] || echo "-bp$BUSY_POLL")}
mkdir -p "$OUT"
JSON=${JSON:-$OUT/results.json}
COMMON=(--sizes "$SIZES")
[[ -n $ROUNDS ]] && COMMON+=(--rounds "$ROUNDS")

echo "== bench/run.sh: UCX_TLS=${UCX_TLS:-default} UCX_NET_DEVICES=lo, tdpipe plane $PLANE, sizes $SIZES," \
    "$RUNS run(s), $(nproc) CPUs, results in $OUT"
[[ -z $PIN ]] || echo "== event-driven tools pinned to CPU(s) $PIN (taskset -c $PIN); busy-polling ones not"
if REV=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); then
    git -C "$ROOT" diff --quiet HEAD -- src include tools 2>/dev/null || REV="$REV + local changes"
    echo "== tdpipe source: commit $REV"
fi
echo "== CPU idle before: $(cpu_idle)% (the figures assume an otherwise idle machine)"
FAILED=()
FILES=()
step() { # step NAME FILE COMMAND...: run it; a failure is reported and the run goes on
    local name=$1 file=$2
    shift 2
    echo "== $name"
    local t0=$SECONDS rc=0
    rm -f "$file"
    "$@" --json "$file" || rc=$?
    if [[ $rc -ne 0 ]]; then
        echo "== $name failed (exit $rc); its figures will be missing" >&2
        FAILED+=("$name")
    else
        echo "== $name: $((SECONDS - t0)) s"
        FILES+=("$file")
    fi
}

HAVE_PERFTEST=1
if ! command -v ucx_perftest >/dev/null; then
    echo "== ucx_perftest not found (apt-get install ucx-utils); its columns will be empty" >&2
    HAVE_PERFTEST=0
    FAILED+=(ucx_perftest)
fi
for ((run = 1; run <= RUNS; run++)); do
    D=$OUT
    if [[ $RUNS -gt 1 ]]; then
        D=$OUT/run$run
        mkdir -p "$D"
        echo "== run $run of $RUNS"
    fi
    step "tdpipe bench (event-driven)" "$D/tdpipe.json" \
        "${EV[@]}" "$TDPIPE" bench "${COMMON[@]}" --plane "$PLANE" --quiet
    if [[ $BUSY_POLL != 0 ]]; then
        step "tdpipe bench --busy-poll $BUSY_POLL" "$D/tdpipe-busy-poll.json" \
            "$TDPIPE" bench "${COMMON[@]}" --plane "$PLANE" --busy-poll "$BUSY_POLL" --quiet
    fi
    if [[ $HAVE_PERFTEST -eq 1 ]]; then
        step "ucx_perftest ucp_am_lat/ucp_am_bw (poll)" "$D/perftest-poll.json" \
            "$PEERS" perftest "${COMMON[@]}" --wait poll --quiet
        step "ucx_perftest ucp_am_lat/ucp_am_bw (-E sleep)" "$D/perftest-sleep.json" \
            "${EV[@]}" "$PEERS" perftest "${COMMON[@]}" --wait sleep --quiet
    fi
    step "ZeroMQ (REQ/REP, PUSH/PULL)" "$D/zmq.json" "${EV[@]}" "$PEERS" zmq "${COMMON[@]}" --quiet
    step "raw TCP" "$D/tcp.json" "${EV[@]}" "$PEERS" tcp "${COMMON[@]}" --quiet
    step "memcpy" "$D/memcpy.json" "$PEERS" memcpy "${COMMON[@]}" --quiet
done
echo "== CPU idle after: $(cpu_idle)%"

"$PEERS" table "${FILES[@]}" --json "$JSON" || FAILED+=(table)
echo
echo "combined JSON: $JSON"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "failed: ${FAILED[*]}" >&2
    exit 1
fi
