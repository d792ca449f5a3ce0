#!/usr/bin/env bash
# bench/smoke.sh TDP_PEERS [TDPIPE]: the bench_smoke test. Every peer of
# tdp_peers, and tdpipe bench when given, on tiny sizes and few rounds; each
# must write JSON whose figures are all positive (tdp_peers check). It checks
# that the benchmark runs, not how fast anything is.
set -euo pipefail
PEERS=$1
TDPIPE=${2:-}
export UCX_NET_DEVICES=lo
DIR=$(mktemp -d /tmp/tdp-bench-smoke-XXXXXX)
trap 'rm -rf "$DIR"' EXIT
ARGS=(--sizes 1KB,64KB --rounds 20 --quiet)

"$PEERS" memcpy "${ARGS[@]}" --json "$DIR/memcpy.json"
"$PEERS" tcp "${ARGS[@]}" --json "$DIR/tcp.json"
rc=0
"$PEERS" zmq "${ARGS[@]}" --json "$DIR/zmq.json" || rc=$?
if [[ $rc -eq 3 ]]; then
    echo "bench_smoke: tdp_peers was built without ZeroMQ; zmq skipped"
elif [[ $rc -ne 0 ]]; then
    exit "$rc"
fi
if command -v ucx_perftest >/dev/null; then
    UCX_TLS=tcp "$PEERS" perftest "${ARGS[@]}" --json "$DIR/perftest.json"
    UCX_TLS=tcp "$PEERS" perftest "${ARGS[@]}" --wait sleep --json "$DIR/perftest-sleep.json"
    UCX_TLS=tcp "$PEERS" perftest "${ARGS[@]}" --wait sleep --err-mode --json "$DIR/perftest-err.json"
    grep -q '"err_mode": true' "$DIR/perftest-err.json"
else
    echo "bench_smoke: ucx_perftest not installed; perftest skipped"
fi
if [[ -n $TDPIPE ]]; then
    UCX_TLS=tcp "$TDPIPE" bench --sizes 1KB,64KB --rounds 20 --quiet --json "$DIR/tdpipe.json"
else
    echo "bench_smoke: no tdpipe command in this build; tdpipe bench skipped"
fi
# the fan-out bench: the floor and a loaned hand-off from idle, 2 consumers
FB=$(dirname "$PEERS")/tdp_fanout_bench
if [[ -x $FB ]]; then
    for mode in --floor "--loan --drive"; do
        # shellcheck disable=SC2086
        "$FB" --consumers 2 --size 4096 --count 20 --gap 200 $mode >"$DIR/fanout.out"
        python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
assert r["failed_consumers"] == 0 and r["p50_last_ns"] >= r["p50_all_ns"] > 0, r' "$DIR/fanout.out"
    done
    rm -f "$DIR/fanout.out"
fi
"$PEERS" check "$DIR"/*.json
if [[ -n $TDPIPE ]]; then # the table wants tdpipe's results
    "$PEERS" table "$DIR"/*.json --json "$DIR/results.json" >/dev/null
fi
echo "bench_smoke: ok ($(ls "$DIR" | wc -l) files)"
