#!/usr/bin/env bash
# test_netns_keepalive.sh TDPIPE: a pipe between two network namespaces
# joined by a veth pair rides out a 3 s link outage with the default
# keepalive, and a peer whose link goes down for good is seen as dead within
# the documented bound (docs/pipe.md, "Peer failure": 20 s after its last
# answer).
#
# Needs root and `ip netns`; exits 77 (skipped) without them. It creates two
# namespaces and a veth pair of its own, with 10.203.N.1/30 and .2/30 inside
# them, and deletes them on every exit path. Every process runs under
# `timeout`; the whole test takes about 35 s.
set -uo pipefail

TDPIPE=${1:?usage: test_netns_keepalive.sh TDPIPE}
BOUND_S=20  # the default keepalive's bound: 5 s idle + 15 probes 1 s apart
SLACK_S=4   # scheduling, the probe timer's granularity, process exit

# shellcheck source=netns_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/netns_lib.sh"

now_ms() {
    date +%s%3N
}

netns_pair ka 203

# UCX over TCP on the veth, so that the data also crosses the link that fails
export UCX_TLS=tcp UCX_NET_DEVICES=all

# ---- a 3 s outage in the middle of a stream is ridden out ----------------------------

start flap_recv "$NS_A" 60 "$TDPIPE" recv --bind "$ADDR_A" --count 60 --quiet
rpid=$PID
port=$(port_of flap_recv) || {
    fail "recv did not start"
    dump "$WORK/flap_recv.out" "$WORK/flap_recv.err"
    exit 1
}
start flap_send "$NS_B" 60 "$TDPIPE" send "$ADDR_A:$port" --count 60 --rate 10 --size 10KB \
    --timeout 30000 --quiet
spid=$PID
sleep 1.5
t0=$(now_ms)
ip -n "$NS_B" link set "$IF_B" down
sleep 3
ip -n "$NS_B" link set "$IF_B" up
echo "link down for $(($(now_ms) - t0)) ms, mid-stream"
wait "$spid"
src=$?
wait "$rpid"
rrc=$?
if [[ $src -ne 0 || $rrc -ne 0 ]]; then
    fail "the stream did not survive a 3 s outage: send exit $src, recv exit $rrc"
    dump "$WORK/flap_send.out" "$WORK/flap_send.err" "$WORK/flap_recv.out" "$WORK/flap_recv.err"
elif ! grep -q "received 60 messages" "$WORK/flap_recv.out" ||
    ! grep -q "verify ok" "$WORK/flap_recv.out"; then
    fail "recv did not get the 60 messages intact"
    dump "$WORK/flap_recv.out" "$WORK/flap_recv.err"
else
    echo "ok: 60 messages through a 3 s outage: $(tail -n1 "$WORK/flap_recv.out")"
fi

# ---- a peer whose link goes down for good is dead within the bound -------------------

start dead_recv "$NS_A" 60 "$TDPIPE" recv --bind "$ADDR_A" --timeout 50000 --quiet
rpid=$PID
port=$(port_of dead_recv) || {
    fail "recv did not start"
    dump "$WORK/dead_recv.out" "$WORK/dead_recv.err"
    exit 1
}
start dead_send "$NS_B" 60 "$TDPIPE" send "$ADDR_A:$port" --count 1000 --rate 10 --size 10KB \
    --timeout 50000 --quiet
spid=$PID
sleep 1.5
t0=$(now_ms)
ip -n "$NS_B" link set "$IF_B" down
wait "$rpid"
rrc=$?
t_recv=$(($(now_ms) - t0))
wait "$spid"
src=$?
t_send=$(($(now_ms) - t0))
echo "link down for good: recv ended after ${t_recv} ms (exit $rrc), send after ${t_send} ms" \
    "(exit $src); bound ${BOUND_S} s"
# exit 4: the peer ended with an error (here: vanished); 124 would be our timeout
for side in recv:$rrc:$t_recv send:$src:$t_send; do
    IFS=: read -r name rc ms <<<"$side"
    if [[ $rc -ne 4 ]]; then
        fail "$name: exit $rc, expected 4 (peer vanished)"
        dump "$WORK/dead_$name.out" "$WORK/dead_$name.err"
    elif ((ms > (BOUND_S + SLACK_S) * 1000)); then
        fail "$name: the dead peer was seen after $ms ms, over the ${BOUND_S} s bound"
    elif ((ms < 10000)); then
        fail "$name: ended after $ms ms: an outage this short must be ridden out"
        dump "$WORK/dead_$name.out" "$WORK/dead_$name.err"
    fi
done

if [[ $FAILS -ne 0 ]]; then
    echo "$FAILS check(s) failed" >&2
    exit 1
fi
echo "all checks passed"
