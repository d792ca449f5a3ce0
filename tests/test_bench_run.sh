#!/usr/bin/env bash
# test_bench_run.sh BUILD_DIR: bench/run.sh, the harness behind the figures in
# docs/benchmarks.md, runs end to end on tiny sizes (event-driven and
# busy-poll, two interleaved runs, the shm plane; then event-driven alone over
# UCX's TCP, pinned, with ucx_perftest also in UCX's peer-failure mode) and
# writes a combined JSON
# with a figure for every size from tdpipe in both modes and a verdict line
# for every target; with two spinners on the CPUs, it warns that busy-poll
# figures were taken on a busy CPU. It checks that the harness works, not
# how fast anything is.
set -euo pipefail
BUILD=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mktemp -d /tmp/tdp-bench-run-XXXXXX)
trap 'rm -rf "$OUT"' EXIT
export UCX_NET_DEVICES=lo

bash "$ROOT/bench/run.sh" --build "$BUILD" --plane shm --sizes 1KB,64KB --rounds 30 \
    --busy-poll 100 --runs 2 --idle-wait 5 --out "$OUT" >"$OUT/table.txt" 2>"$OUT/log.txt" || {
    echo "bench/run.sh failed:" >&2
    cat "$OUT/log.txt" "$OUT/table.txt" >&2
    exit 1
}
grep -q "^goals" "$OUT/table.txt" || { cat "$OUT/table.txt"; exit 1; }
# first sends, plain and prepared, one line per size (the verdict is for
# 100 MB and up: these small sizes show "-")
[[ $(grep -cE "^(1000|64000) .* -$" "$OUT/table.txt") -eq 2 ]] ||
    { cat "$OUT/table.txt"; exit 1; }
# the fan-in step: its table and JSON (4 producers, 1 MB, both baselines)
grep -q "^fan-in, plane" "$OUT/table.txt" || { cat "$OUT/table.txt"; exit 1; }
python3 - "$OUT/fanin.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["mode"] == "fanin" and d["producers"] == 4 and d["size"] == 1000000, d
assert d["fanin_bytes_per_s"] > 0 and d["one_producer_bytes_per_s"] > 0, d
assert d["poll_loop_bytes_per_s"] > 0 and d["ratio_to_poll_loop"] > 0, d
PY
python3 - "$OUT/results.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["runs"] == 2, d["runs"]
assert d["busy_poll_us"] == 100
sizes = [s["bytes"] for s in d["summary"]]
assert sizes == [1000, 64000], sizes
for s in d["summary"]:
    for mode in ("tdpipe", "tdpipe_busy_poll"):
        lat = s["latency_p50_us"].get(mode)
        tput = s["throughput_Bps"].get(mode)
        assert lat is not None and lat > 0, (s["bytes"], mode, lat)
        assert tput is not None and tput > 0, (s["bytes"], mode, tput)
assert d["targets"], "no targets"
for t in d["targets"]:
    assert {"target", "ratio", "op", "goal", "met"} <= set(t), t
print("bench/run.sh: %d sizes, %d targets, JSON ok" % (len(sizes), len(d["targets"])))
PY

# the default mode: event-driven only (pinned to CPU 0), one run, the ucx plane over TCP
mkdir "$OUT/ev"
bash "$ROOT/bench/run.sh" --build "$BUILD" --tls tcp --plane ucx --sizes 1KB --rounds 30 --pin 0 \
    --out "$OUT/ev" >"$OUT/ev/table.txt" 2>"$OUT/ev/log.txt" || {
    echo "bench/run.sh (event-driven only) failed:" >&2
    cat "$OUT/ev/log.txt" "$OUT/ev/table.txt" >&2
    exit 1
}
python3 - "$OUT/ev/results.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d["summary"][0]
assert s["bytes"] == 1000 and s["latency_p50_us"]["tdpipe"] > 0, s
assert s["latency_p50_us"].get("tdpipe_busy_poll") is None, s
# the ucx plane: ucx_perftest also in UCX's peer-failure mode (-e), with its ratio
if d["inputs"].get("perftest_sleep"):
    assert s["latency_p50_us"]["perftest_sleep_err"] > 0, s
    assert s["ratio_throughput"]["event_over_perftest_sleep_err"] > 0, s
print("bench/run.sh event-driven only: JSON ok")
PY

# a busy CPU: two spinners for the length of a tiny busy-poll run; the
# warning is printed and the JSON names the steps
mkdir "$OUT/busy"
SPIN=()
for _ in 1 2; do
    timeout 60 sh -c 'while :; do :; done' &
    SPIN+=($!)
done
rc=0
bash "$ROOT/bench/run.sh" --build "$BUILD" --plane shm --sizes 1KB --rounds 20 --busy-poll 50 \
    --idle-wait 0 --out "$OUT/busy" >"$OUT/busy/table.txt" 2>"$OUT/busy/log.txt" || rc=$?
kill "${SPIN[@]}" 2>/dev/null || true
wait "${SPIN[@]}" 2>/dev/null || true
if [[ $rc -ne 0 ]]; then
    echo "bench/run.sh (busy CPU) failed:" >&2
    cat "$OUT/busy/log.txt" "$OUT/busy/table.txt" >&2
    exit 1
fi
grep -q "WARNING: the CPU is" "$OUT/busy/log.txt" || { cat "$OUT/busy/log.txt"; exit 1; }
grep -q "^busy CPU:" "$OUT/busy/table.txt" || { cat "$OUT/busy/table.txt"; exit 1; }
python3 - "$OUT/busy/results.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
b = d["busy_cpu"]
assert b["idle_min_pct"] == 90 and len(b["steps"]) >= 1, b
assert any(s.startswith("tdpipe bench --busy-poll") for s in b["steps"]), b
print("bench/run.sh busy CPU: warned for", b["steps"])
PY
