#!/usr/bin/env bash
# test_netns_bench.sh TDPIPE: `tdpipe bench --server` in one network
# namespace and `tdpipe bench --client` in another, joined by a veth pair:
# the client prints the loopback bench's table for its sizes and writes JSON
# that says mode "client"; the server serves clients one after another and
# ends on SIGTERM with 143; a client of a port nobody listens on exits 3.
#
# Needs root and `ip netns`; exits 77 (skipped) without them. It creates two
# namespaces and a veth pair of its own, with 10.204.N.1/30 and .2/30 inside
# them (test_netns_keepalive uses 10.203.N.0/30 and other names), and deletes
# them on every exit path. Every process runs under `timeout`; the whole
# test takes about 10 s.
set -uo pipefail

TDPIPE=${1:?usage: test_netns_bench.sh TDPIPE}

# shellcheck source=netns_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/netns_lib.sh"
command -v python3 >/dev/null || skip "no python3 (reads the JSON)"
netns_pair bn 204

# UCX over TCP on the veth: the data crosses the link as it would between hosts
# (the namespaces share /dev/shm, so --plane ucx keeps the shm plane out)
export UCX_TLS=tcp UCX_NET_DEVICES=all

# ---- one client, --once: the table, the JSON, both exit 0 -----------------------------

start once_srv "$NS_A" 60 "$TDPIPE" bench --server --bind "$ADDR_A" --once
spid=$PID
port=$(port_of once_srv) || {
    fail "bench --server did not start"
    dump "$WORK/once_srv.out" "$WORK/once_srv.err"
    exit 1
}
run once_cli "$NS_B" 60 "$TDPIPE" bench --client "$ADDR_A:$port" --sizes 1KB,1MB --rounds 50 \
    --plane ucx --json "$WORK/client.json" --quiet
crc=$RC
wait "$spid"
src=$?
if [[ $crc -ne 0 || $src -ne 0 ]]; then
    fail "client exit $crc, server exit $src (both should be 0)"
    dump "$WORK/once_cli.out" "$WORK/once_cli.err" "$WORK/once_srv.out" "$WORK/once_srv.err"
else
    for want in "client of $ADDR_A:$port" "plane ucx" "1.00 KB            1000" \
        "1.00 MB         1000000"; do
        grep -qF "$want" "$WORK/once_cli.out" || fail "the client's table lacks '$want'"
    done
    if ! python3 - "$WORK/client.json" "$ADDR_A:$port" >"$WORK/json.err" 2>&1 <<'EOF'; then
import json, sys
d = json.load(open(sys.argv[1]))
assert d["mode"] == "client", d["mode"]
assert d["peer"] == sys.argv[2], d["peer"]
assert d["config"]["plane"] == "ucx", d["config"]
assert d["server"]["depth"] == 4, d["server"]
assert [r["bytes"] for r in d["results"]] == [1000, 1000000], d["results"]
for r in d["results"]:
    assert r["latency_us"]["p50"] > 0 and r["throughput_Bps"]["median"] > 0, r
EOF
        fail "the client's JSON is not as expected"
        dump "$WORK/json.err" "$WORK/client.json"
    fi
    grep -q "client ${NET}2:[0-9]* connected" "$WORK/once_srv.err" ||
        fail "the server did not name its client"
    echo "ok: client in $NS_B against server in $NS_A over veth:"
    sed 's/^/  /' "$WORK/once_cli.out"
fi

# ---- clients one after another, then SIGTERM: 143 -----------------------------------

start many_srv "$NS_A" 60 "$TDPIPE" bench --server --bind "$ADDR_A" --quiet
spid=$PID
port=$(port_of many_srv) || {
    fail "bench --server did not start"
    dump "$WORK/many_srv.out" "$WORK/many_srv.err"
    exit 1
}
for i in 1 2; do
    run "many_cli$i" "$NS_B" 30 "$TDPIPE" bench --client "$ADDR_A:$port" --sizes 1KB \
        --rounds 20 --quiet
    if [[ $RC -ne 0 ]] || ! grep -qF "1.00 KB" "$WORK/many_cli$i.out"; then
        fail "client $i of one server: exit $RC"
        dump "$WORK/many_cli$i.out" "$WORK/many_cli$i.err" "$WORK/many_srv.err"
    fi
done
kill -TERM "$spid"
wait "$spid"
src=$?
if [[ $src -ne 143 ]] || ! grep -q "interrupted (SIGTERM) after 2 clients" "$WORK/many_srv.err"; then
    fail "server after SIGTERM: exit $src, expected 143 and 'after 2 clients'"
    dump "$WORK/many_srv.out" "$WORK/many_srv.err"
else
    echo "ok: two clients in a row, then SIGTERM: exit 143"
fi

# ---- nobody listening: exit 3 -------------------------------------------------------

run none_cli "$NS_B" 30 "$TDPIPE" bench --client "$ADDR_A:$port" --sizes 1KB --rounds 20 --quiet
if [[ $RC -ne 3 ]] || ! grep -q "cannot connect to $ADDR_A:$port" "$WORK/none_cli.err"; then
    fail "client of a closed port: exit $RC, expected 3 and 'cannot connect'"
    dump "$WORK/none_cli.out" "$WORK/none_cli.err"
else
    echo "ok: client of a closed port: exit 3"
fi

if [[ $FAILS -ne 0 ]]; then
    echo "$FAILS check(s) failed" >&2
    exit 1
fi
echo "all checks passed"
