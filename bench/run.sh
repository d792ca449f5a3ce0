#!/usr/bin/env bash
# bench/run.sh: tdpipe and its reference points, in one run, on the same
# payloads, over loopback — then one table with tdpipe's ratio to each.
#
#   bench/run.sh [--tls tcp|shm|default] [--plane NAME] [--sizes LIST] [--busy-poll US]
#                [--runs K] [--rounds N] [--inflight N] [--pin CPUS] [--json FILE] [--out DIR] [--build DIR]
#   bench/run.sh --fanout [bench/fanout.sh's options]   (the fan-out figures instead)
#
# In order: tdpipe bench (event-driven; and busy-poll with --busy-poll),
# ucx_perftest ucp_am_lat/ucp_am_bw (busy-polling, and -E sleep; with
# --plane ucx also -E sleep -e, the peer-failure mode of tdpipe's endpoints),
# ZeroMQ, raw TCP, memcpy (all through build/bench/tdp_peers); then
# `tdp_peers table` prints the table and writes the combined JSON; last the
# fan-in (`tdpipe bench --fanin 4`, its own table and OUT/fanin.json; then
# with --fanin-procs, OUT/fanin_procs.json). With
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
INFLIGHT=64
RUNS=1
PIN=
JSON=
OUT=
IDLE_MIN=90
IDLE_WAIT=20

usage() {
    cat <<EOF
usage: bench/run.sh [options]

Runs tdpipe bench, ucx_perftest (UCP am_lat/am_bw), ZeroMQ, a raw TCP loop
and memcpy on the same payload sizes over loopback, and prints one table with
tdpipe's ratio to each (docs/benchmarks.md).

  --tls MODE       UCX transports for tdpipe and ucx_perftest: tcp (UCX_TLS=tcp),
                   shm (UCX_TLS=shm,self) or default (UCX_TLS unset: UCX picks)
  --plane NAME     tdpipe's data plane: auto (default: shm on one host), ucx,
                   shm (loaned slots, no copy) or tcp (the pipe's own TCP
                   connection; docs/planes.md)
  --sizes LIST     payload sizes (default 1KB,1MB,100MB; KB = 1000 B)
  --busy-poll US   also run tdpipe with this busy-poll window, the progress
                   mode of ucx_perftest (the event-driven run is always made)
  --inflight N     tdpipe's throughput streams as N async sends in flight
                   (tdpipe bench --inflight; default 64; 1: blocking sends),
                   as ZeroMQ's PUSH and ucp_am_bw keep several in flight
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
  --idle-min PCT   the CPU idle a busy-polling step needs (default 90): below
                   it, two spinning peers and the other work take turns and
                   the figures mean little (p99 near 1 ms on 2 CPUs)
  --idle-wait S    wait up to S seconds for that idle before each busy-polling
                   step (default 20); if it does not come, the step still runs,
                   and a warning before it, under the table and in the JSON
                   ("busy_cpu") says its figures were taken on a busy CPU
  --json FILE      the combined results (default: OUT/results.json)
  --out DIR        where each tool's JSON goes (default: BUILD/bench-results/DATE-TLS)
  --build DIR      the build directory (default: build/, or \$TDP_BUILD_DIR)
  --fanout ...     instead: the fan-out figures (bench/fanout.sh, with the
                   options after --fanout: broadcast of 100 MB to 1, 2, 4
                   consumers; 1 MB to 4 consumers against ZeroMQ PUB/SUB)
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
    --tls) TLS=$2; shift 2 ;;
    --sizes) SIZES=$2; shift 2 ;;
    --plane) PLANE=$2; shift 2 ;;
    --busy-poll) BUSY_POLL=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --inflight) INFLIGHT=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --pin) PIN=$2; shift 2 ;;
    --idle-min) IDLE_MIN=$2; shift 2 ;;
    --idle-wait) IDLE_WAIT=$2; shift 2 ;;
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

if ! [[ $IDLE_MIN =~ ^[0-9]+$ && $IDLE_MIN -le 100 && $IDLE_WAIT =~ ^[0-9]+$ ]]; then
    echo "bench/run.sh: --idle-min is 0..100 and --idle-wait a number of seconds" >&2
    exit 2
fi

if ! [[ $INFLIGHT =~ ^[1-9][0-9]*$ && $INFLIGHT -le 64 ]]; then
    echo "bench/run.sh: --inflight is 1..64" >&2
    exit 2
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

# Before a busy-polling step: wait (up to IDLE_WAIT s) for an idle CPU, and
# say so when it does not come (BUSY holds "step: idle%" for the summary).
BUSY=()
want_idle() {
    local name=$1 idle t0=$SECONDS
    idle=$(cpu_idle)
    while [[ $idle -lt $IDLE_MIN && $((SECONDS - t0)) -lt $IDLE_WAIT ]]; do
        idle=$(cpu_idle)
    done
    if [[ $idle -lt $IDLE_MIN ]]; then
        echo "== WARNING: the CPU is $idle% idle before $name (it needs $IDLE_MIN%):" \
            "busy-polling peers take turns with the other work, and its figures mean little" >&2
        BUSY+=("$name: $idle%")
    fi
}

STAMP=$(date -u +%Y%m%dT%H%M%SZ)
# ZeroMQ on the transport that matches tdpipe's plane: a Unix socket (ipc)
# next to a same-host plane, TCP next to the ucx and tcp planes
case $PLANE in
    ucx | tcp) ZMQ_TRANSPORT=tcp ;;
    *) ZMQ_TRANSPORT=ipc ;;
esac
OUT=${OUT:-$BUILD/bench-results/$STAMP-$TLS-$PLANE$([[ $BUSY_POLL == 0 ]] || echo "-bp$BUSY_POLL")}
mkdir -p "$OUT"
JSON=${JSON:-$OUT/results.json}
COMMON=(--sizes "$SIZES")
PREP_FILES=()
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
SKIPPED=()
FILES=()
step() { # step NAME FILE COMMAND...: run it; a failure is reported and the run goes on
    local name=$1 file=$2
    shift 2
    echo "== $name"
    local t0=$SECONDS rc=0
    rm -f "$file"
    "$@" --json "$file" || rc=$?
    if [[ $rc -eq 77 ]]; then
        # a peer this build left out (tdp_peers zmq without libzmq): said, not a failure
        echo "== $name: not built here, skipped; its figures will be missing" >&2
        SKIPPED+=("$name")
    elif [[ $rc -ne 0 ]]; then
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
        "${EV[@]}" "$TDPIPE" bench "${COMMON[@]}" --plane "$PLANE" --inflight "$INFLIGHT" --quiet
    # the same with each layout prepared first (its own JSON: first sends only)
    echo "== tdpipe bench --prepare (event-driven)"
    rm -f "$D/tdpipe-prepare.json"
    "${EV[@]}" "$TDPIPE" bench "${COMMON[@]}" --plane "$PLANE" --prepare --quiet \
        --json "$D/tdpipe-prepare.json" >/dev/null || FAILED+=("tdpipe bench --prepare")
    PREP_FILES+=("$D/tdpipe.json" "$D/tdpipe-prepare.json")
    if [[ $BUSY_POLL != 0 ]]; then
        want_idle "tdpipe bench --busy-poll $BUSY_POLL"
        step "tdpipe bench --busy-poll $BUSY_POLL" "$D/tdpipe-busy-poll.json" \
            "$TDPIPE" bench "${COMMON[@]}" --plane "$PLANE" --busy-poll "$BUSY_POLL" \
            --inflight "$INFLIGHT" --quiet
    fi
    if [[ $HAVE_PERFTEST -eq 1 ]]; then
        want_idle "ucx_perftest (poll)"
        step "ucx_perftest ucp_am_lat/ucp_am_bw (poll)" "$D/perftest-poll.json" \
            "$PEERS" perftest "${COMMON[@]}" --wait poll --quiet
        step "ucx_perftest ucp_am_lat/ucp_am_bw (-E sleep)" "$D/perftest-sleep.json" \
            "${EV[@]}" "$PEERS" perftest "${COMMON[@]}" --wait sleep --quiet
        # the ucx plane's endpoints are in UCX's peer-failure mode (docs/pipe.md,
        # "Peer failure"): the transport's own figures in that mode, beside the
        # plain ones (over TCP it has no put_zcopy rendezvous); on shared memory
        # that mode needs its error handling asked for, as tdpipe asks
        if [[ $PLANE == ucx ]]; then
            step "ucx_perftest -e (UCX's peer-failure mode, -E sleep)" "$D/perftest-err.json" \
                env UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y \
                "${EV[@]}" "$PEERS" perftest "${COMMON[@]}" --wait sleep --err-mode --quiet
        fi
    fi
    step "ZeroMQ (REQ/REP, PUSH/PULL) over $ZMQ_TRANSPORT" "$D/zmq.json" "${EV[@]}" "$PEERS" zmq \
        "${COMMON[@]}" --transport "$ZMQ_TRANSPORT" --quiet
    step "raw TCP" "$D/tcp.json" "${EV[@]}" "$PEERS" tcp "${COMMON[@]}" --quiet
    step "memcpy" "$D/memcpy.json" "$PEERS" memcpy "${COMMON[@]}" --quiet
done
echo "== CPU idle after: $(cpu_idle)%"

# First sends (docs/benchmarks.md, "First sends"): a new layout's first
# message, plain and prepared (tdp_pipe_prepare), against a steady send of
# the same size: the one-way latency p50, or on a plane that lends slots the
# plain send's time (bytes / its rate; the first send is a plain send).
# Goal (issue 20, for 100 MB, a layout sent rarely): prepared first send
# <= 2 x steady. Smaller sizes are shown without a verdict: a first send
# of 1 MB or less is a round trip or two, whatever is prepared.
echo
echo "== first sends, plane $PLANE; load: $(cut -d' ' -f1-3 /proc/loadavg)"
if command -v python3 >/dev/null && [[ ${#PREP_FILES[@]} -gt 0 ]]; then
    python3 - "${PREP_FILES[@]}" <<'PY' || FAILED+=("first sends")
import json, os, sys
files = sys.argv[1:]
rows = {}
for plain, prep in zip(files[0::2], files[1::2]):
    if not (os.path.exists(plain) and os.path.exists(prep)):
        continue
    a, b = json.load(open(plain))["results"], json.load(open(prep))["results"]
    for ra, rb in zip(a, b):
        if "plain_send_Bps" in ra and ra["plain_send_Bps"]["median"] > 0:
            steady = ra["bytes"] / ra["plain_send_Bps"]["median"] * 1e6
        else:
            steady = ra["latency_us"]["p50"]
        rows.setdefault(ra["bytes"], []).append(
            (ra["first_send_us"], rb["first_send_us"], rb.get("prepare_us", 0.0), steady))
print("%-12s %14s %14s %14s %14s %10s  %s" % ("bytes", "first (plain)", "first (prep.)",
      "prepare", "steady send", "prep/steady", "goal <= 2 (100 MB and up)"))
for n in sorted(rows):
    rs = sorted(rows[n], key=lambda r: r[1])
    fa, fb, pr, st = rs[len(rs) // 2]  # the run with the median prepared first send
    ratio = fb / st if st > 0 else float("inf")
    print("%-12d %11.1f us %11.1f us %11.1f us %11.1f us %10.2f  %s" % (
        n, fa, fb, pr, st, ratio,
        "-" if n < 100000000 else "met" if ratio <= 2 else "NOT met"))
PY
fi

"$PEERS" table "${FILES[@]}" --json "$JSON" || FAILED+=(table)
if [[ ${#BUSY[@]} -gt 0 ]]; then
    echo
    echo "busy CPU: these busy-polling steps ran below $IDLE_MIN% idle, and their figures mean little:"
    printf '  %s\n' "${BUSY[@]}"
    if [[ -f $JSON ]] && command -v python3 >/dev/null; then
        python3 - "$JSON" "$IDLE_MIN" "${BUSY[@]}" <<'PY' || true
import json, sys
path, need, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
d = json.load(open(path))
d["busy_cpu"] = {"idle_min_pct": need, "steps": steps}
json.dump(d, open(path, "w"), indent=1)
PY
    fi
fi
echo
echo "combined JSON: $JSON"

# Fan-in: 4 producers into one consumer, 1 MB, against one producer alone
# and against the same four on their own pipes drained by a hand-written
# poll loop (bench/fanin_poll.c); the producers as pipes of one process,
# then as processes of their own. Its own table: the figures are aggregate
# throughput at the consumer, with the load they were taken under.
echo
echo "== fan-in: 4 producers -> 1 consumer, 1 MB, plane $PLANE; load: $(cut -d' ' -f1-3 /proc/loadavg)"
if [[ -x $BUILD/bench/tdp_fanin_poll ]]; then
    # --rounds: the messages of each of its three runs (else about 4 GiB)
    FANIN_ROUNDS=()
    [[ -n $ROUNDS ]] && FANIN_ROUNDS=(--rounds "$ROUNDS")
    "$TDPIPE" bench --fanin 4 --sizes 1MB --plane "$PLANE" --quiet "${FANIN_ROUNDS[@]}" \
        --fanin-baseline "$BUILD/bench/tdp_fanin_poll" --json "$OUT/fanin.json" ||
        FAILED+=(fanin)
    echo "fan-in JSON: $OUT/fanin.json"
    # the same with each producer a process of its own, as a data loader's workers
    "$TDPIPE" bench --fanin 4 --fanin-procs --sizes 1MB --plane "$PLANE" --quiet \
        "${FANIN_ROUNDS[@]}" --fanin-baseline "$BUILD/bench/tdp_fanin_poll" \
        --json "$OUT/fanin_procs.json" || FAILED+=(fanin-procs)
    echo "fan-in (producer processes) JSON: $OUT/fanin_procs.json"
else
    echo "(no $BUILD/bench/tdp_fanin_poll: fan-in not measured)"
    FAILED+=(fanin)
fi
[[ ${#SKIPPED[@]} -gt 0 ]] && echo "skipped (not built here): ${SKIPPED[*]}" >&2
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "failed: ${FAILED[*]}" >&2
    exit 1
fi
