#!/usr/bin/env bash
# test_netns_clean_end.sh TDPIPE: a stream of 10 MB messages over UCX's TCP
# transport across a 1 Gbit/s link (two network namespaces joined by a veth
# pair, shaped with tc) ends cleanly on both sides, every time: the sender
# tears its UCX endpoint down right after its BYE, and the receiver must
# still report "producer closed", not a reset (it once did, 2 times in 6).
#
# Needs root, `ip netns` and `tc`; exits 77 (skipped) without them. The
# namespaces, the veth pair and 10.205.N.1/30, .2/30 are its own (the other
# netns tests use 10.203 and 10.204) and go on every exit path. Every process
# runs under `timeout`; the test takes about 15 s.
set -uo pipefail

TDPIPE=${1:?usage: test_netns_clean_end.sh TDPIPE}
RUNS=${RUNS:-6}

skip() {
    echo "SKIP: $*"
    exit 77
}
[[ $(id -u) -eq 0 ]] || skip "needs root (creates network namespaces)"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
command -v tc >/dev/null || skip "no 'tc' command (iproute2)"
ip netns list >/dev/null 2>&1 || skip "'ip netns' is not available"

TAG=$$
NS_A=tdp-ce-a-$TAG
NS_B=tdp-ce-b-$TAG
IF_A=tdpce${TAG}a
IF_B=tdpce${TAG}b
NET=10.205.$((TAG % 250)).
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tdp-netns-clean.XXXXXX")

cleanup() {
    timeout 10 ip netns del "$NS_A" 2>/dev/null || true
    timeout 10 ip netns del "$NS_B" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

if ! { ip netns add "$NS_A" && ip netns add "$NS_B" &&
    ip link add "$IF_A" netns "$NS_A" type veth peer name "$IF_B" netns "$NS_B" &&
    ip -n "$NS_A" addr add "${NET}1/30" dev "$IF_A" &&
    ip -n "$NS_B" addr add "${NET}2/30" dev "$IF_B" &&
    ip -n "$NS_A" link set lo up && ip -n "$NS_B" link set lo up &&
    ip -n "$NS_A" link set "$IF_A" up && ip -n "$NS_B" link set "$IF_B" up; }; then
    skip "cannot create the namespaces and veth pair"
fi
for ns_if in "$NS_A $IF_A" "$NS_B $IF_B"; do
    set -- $ns_if
    ip netns exec "$1" tc qdisc add dev "$2" root tbf rate 1gbit burst 256kb latency 50ms ||
        skip "cannot shape the veth link with tc"
done
for _ in $(seq 50); do
    [[ $(ip -n "$NS_A" -br link show "$IF_A") == *" UP "* &&
        $(ip -n "$NS_B" -br link show "$IF_B") == *" UP "* ]] && break
    sleep 0.1
done

# ctest keeps UCX on loopback for the other tests; this one crosses the veth
export UCX_TLS=tcp UCX_NET_DEVICES=all
FAILS=0
for i in $(seq "$RUNS"); do
    ip netns exec "$NS_A" timeout 60 "$TDPIPE" recv --bind "${NET}1" --port 17901 \
        --plane ucx >"$WORK/recv.out" 2>"$WORK/recv.err" &
    rpid=$!
    for _ in $(seq 100); do
        grep -q "listening on" "$WORK/recv.out" 2>/dev/null && break
        sleep 0.1
    done
    src=0
    ip netns exec "$NS_B" timeout 60 "$TDPIPE" send "${NET}1:17901" --plane ucx \
        --size 10MB --count 20 --quiet >"$WORK/send.out" 2>"$WORK/send.err" || src=$?
    rrc=0
    wait "$rpid" || rrc=$?
    if [[ $src -ne 0 || $rrc -ne 0 ]] || ! grep -q "end: producer closed" "$WORK/recv.out"; then
        echo "FAIL: run $i: send exit $src, recv exit $rrc"
        sed 's/^/  /' "$WORK/send.out" "$WORK/send.err" "$WORK/recv.out" "$WORK/recv.err"
        FAILS=$((FAILS + 1))
    else
        echo "run $i: $(tail -n1 "$WORK/recv.out")"
    fi
done
echo "test_netns_clean_end: $((RUNS - FAILS)) of $RUNS clean"
[[ $FAILS -eq 0 ]]
