#!/usr/bin/env bash
# bench/fanout.sh: the fan-out figures (issue 17), on this host.
#
#   bench/fanout.sh [--build DIR] [--plane NAME] [--count K] [--runs K]
#
# 1. A broadcast of 100 MB messages to 1, 2 and 4 consumer processes
#    (build/bench/tdp_fanout_bench), loaned slots (tdp_fanout_loan: the
#    hand-off), loaned slots to consumers that run no loop thread (their
#    receiving thread drives the loop: --drive) and plain buffers (one
#    copy into the pool): the one-way p50
#    to the last consumer, its ratio to one consumer's, the producer's RSS
#    and the shared memory it maps (pool bytes and mappings).
# 2. 1 MB to 4 consumers: tdp_fanout_bench's throughput (4 sends in flight),
#    loaned and plain, against ZeroMQ's PUB over ipc:// to 4 SUB processes,
#    without drops (build/bench/tdp_zmq_fan broadcast).
# 2b. The hand-off from idle: one 100 MB message a millisecond (--gap 1000),
#    so that every process sleeps when the next comes, to 1 and 4
#    consumers, loaned slots (consumers with and without a loop thread, and
#    with neither side running one), against the floor of this machine: the
#    same processes woken through an eventfd each with no library in
#    between (tdp_fanout_bench --floor). The ratio to one consumer, and to
#    the floor.
# 3. `tdpipe bench --fanout 4 --sizes 1MB,100MB`: the same broadcast from one
#    process to 4 consumer pipes of its own, loaned slots against plain
#    buffers (one run).
# Each figure of 1 and 2 is the median of --runs runs (default 3). The CPU idle
# share before and after says whether the machine was quiet. It builds
# nothing. Method: docs/benchmarks.md, "Fan-out".
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=${TDP_BUILD_DIR:-$ROOT/build}
PLANE=shm
COUNT=20
RUNS=3
while [[ $# -gt 0 ]]; do
    case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --plane) PLANE=$2; shift 2 ;;
    --count) COUNT=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    -h | --help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/fanout.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
done
export UCX_NET_DEVICES=lo
FB=$BUILD/bench/tdp_fanout_bench
FZ=$BUILD/bench/tdp_zmq_fan
[[ -x $FB ]] || { echo "bench/fanout.sh: $FB is missing; build first" >&2; exit 2; }

cpu_idle() {
    local a b
    read -r -a a </proc/stat
    sleep 1
    read -r -a b </proc/stat
    local idle=$(((b[4] + b[5]) - (a[4] + a[5]))) total=0 i
    for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
    echo $((total > 0 ? 100 * idle / total : 0))
}

# med CMD...: run CMD RUNS times; print the JSON line of the run with the median KEY
med() {
    local key=$1
    shift
    local i
    for ((i = 0; i < RUNS; i++)); do "$@"; done |
        python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
rows.sort(key=lambda r: r[sys.argv[1]])
print(json.dumps(rows[len(rows) // 2]))' "$key"
}

echo "== bench/fanout.sh: plane $PLANE, $RUNS run(s) each, $(nproc) CPUs; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "== CPU idle before: $(cpu_idle)%"
declare -A P50
for kind in loan loan-driven plain; do
    flag=
    [[ $kind == loan ]] && flag=--loan
    [[ $kind == loan-driven ]] && flag="--loan --drive"
    echo "100 MB broadcast, $kind:"
    printf '%-10s %14s %10s %12s %14s %9s\n' consumers "p50 last (ms)" "x one" "RSS (MB)" "shm (MB)" mappings
    for n in 1 2 4; do
        row=$(med p50_last_ns "$FB" --consumers "$n" --size 100000000 --count "$COUNT" --plane "$PLANE" $flag)
        read -r p50 rss shm maps < <(python3 -c '
import json, sys
r = json.loads(sys.argv[1])
print(r["p50_last_ns"], r["producer_rss_bytes"], r["producer_shm_bytes"], r["producer_shm_mappings"])' "$row")
        P50[$n]=$p50
        printf '%-10s %14.3f %10.2f %12.1f %14.1f %9s\n' "$n" "$(echo "$p50 / 1000000" | bc -l)" \
            "$(echo "$p50 / ${P50[1]}" | bc -l)" "$(echo "$rss / 1000000" | bc -l)" \
            "$(echo "$shm / 1000000" | bc -l)" "$maps"
    done
done
echo
zm=
if [[ -x $FZ ]]; then
    # the slowest subscriber's message rate: every consumer gets every message
    z=$(med slowest_consumer_Bps "$FZ" broadcast --peers 4 --size 1000000 --count 2000 --json)
    zm=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["slowest_consumer_Bps"] / r["bytes"])' "$z")
fi
for kind in loan plain; do
    flag=
    [[ $kind == loan ]] && flag=--loan
    t=$(med msgs_per_s "$FB" --consumers 4 --size 1000000 --count 2000 --plane "$PLANE" --inflight 4 $flag)
    tm=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["msgs_per_s"])' "$t")
    if [[ -n $zm ]]; then
        printf '1 MB to 4 consumers, %s: tdp_fanout %.0f msgs/s, ZeroMQ PUB/SUB ipc %.0f msgs/s: %.2fx\n' \
            "$kind" "$tm" "$zm" "$(echo "$tm / $zm" | bc -l)"
    else
        printf '1 MB to 4 consumers, %s: tdp_fanout %.0f msgs/s (no ZeroMQ peer built)\n' "$kind" "$tm"
    fi
done
echo
echo "The hand-off from idle (100 MB, 1 message per ms, $((COUNT * 25)) messages), one-way p50 to the last consumer:"
printf '%-18s %10s %10s %8s %14s\n' kind "1 (us)" "4 (us)" "x one" "4: x floor"
declare -A H
for kind in floor loan-no-threads loan-driven loan; do
    flag=--floor
    [[ $kind == loan ]] && flag=--loan
    [[ $kind == loan-driven ]] && flag="--loan --drive"
    [[ $kind == loan-no-threads ]] && flag="--loan --drive --drive-producer"
    for n in 1 4; do
        row=$(med p50_last_ns "$FB" --consumers "$n" --size 100000000 --count $((COUNT * 25)) --gap 1000 \
            --plane "$PLANE" $flag)
        H[$kind$n]=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["p50_last_ns"])' "$row")
    done
    printf '%-18s %10.1f %10.1f %8.2f %14.2f\n' "$kind" "$(echo "${H[${kind}1]} / 1000" | bc -l)" \
        "$(echo "${H[${kind}4]} / 1000" | bc -l)" "$(echo "${H[${kind}4]} / ${H[${kind}1]}" | bc -l)" \
        "$(echo "${H[${kind}4]} / ${H[floor4]}" | bc -l)"
done
TD=$BUILD/tools/tdpipe
if [[ -x $TD ]]; then
    echo
    "$TD" bench --fanout 4 --sizes 1MB,100MB --rounds 20 --plane "$PLANE" --quiet
fi
echo "== CPU idle after: $(cpu_idle)%; load: $(cut -d' ' -f1-3 /proc/loadavg)"
