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

skip() {
    echo "SKIP: $*"
    exit 77
}
[[ $(id -u) -eq 0 ]] || skip "needs root (creates network namespaces)"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
ip netns list >/dev/null 2>&1 || skip "'ip netns' is not available"

TAG=$$
NS_A=tdp-ka-a-$TAG
NS_B=tdp-ka-b-$TAG
IF_A=tdpka${TAG}a
IF_B=tdpka${TAG}b
NET=10.203.$((TAG % 250)).
ADDR_A=${NET}1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tdp-netns.XXXXXX")
BG_PIDS=()
FAILS=0

cleanup() {
    local pid
    for pid in "${BG_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${BG_PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    timeout 10 ip netns del "$NS_A" 2>/dev/null || true
    timeout 10 ip netns del "$NS_B" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

fail() {
    echo "FAIL: $*" >&2
    FAILS=$((FAILS + 1))
}

dump() {
    local f
    for f in "$@"; do
        [[ -f $f ]] && sed "s|^|  $(basename "$f"): |" "$f" >&2
    done
}

now_ms() {
    date +%s%3N
}

# link_up NS IF: wait (bounded) until the link reports UP (carrier on both ends).
link_up() {
    for _ in $(seq 50); do
        [[ $(ip -n "$1" -br link show "$2" 2>/dev/null) == *" UP "* ]] && return 0
        sleep 0.1
    done
    return 1
}

# ns_setup: two namespaces, a veth pair between them, addresses, links up.
ns_setup() {
    # ${IF_A} is at most 15 characters: tdpka + a pid of up to 9 digits + a/b
    ip netns add "$NS_A" && ip netns add "$NS_B" &&
        ip link add "$IF_A" netns "$NS_A" type veth peer name "$IF_B" netns "$NS_B" &&
        ip -n "$NS_A" addr add "${ADDR_A}/30" dev "$IF_A" &&
        ip -n "$NS_B" addr add "${NET}2/30" dev "$IF_B" &&
        ip -n "$NS_A" link set lo up && ip -n "$NS_B" link set lo up &&
        ip -n "$NS_A" link set "$IF_A" up && ip -n "$NS_B" link set "$IF_B" up
}

if ! ns_setup 2>"$WORK/setup.err"; then
    cat "$WORK/setup.err" >&2
    skip "cannot create the namespaces and veth pair"
fi
if ! link_up "$NS_A" "$IF_A" || ! link_up "$NS_B" "$IF_B"; then
    fail "the veth pair did not come up"
    exit 1
fi

# UCX over TCP on the veth, so that the data also crosses the link that fails
export UCX_TLS=tcp UCX_NET_DEVICES=all

# start NAME NS SECONDS CMD...: background in namespace NS; sets PID.
start() {
    local name=$1 ns=$2 secs=$3
    shift 3
    ip netns exec "$ns" timeout "$secs" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    PID=$!
    BG_PIDS+=("$PID")
}

port_of() {
    local line
    for _ in $(seq 100); do
        line=$(head -n1 "$WORK/$1.out" 2>/dev/null || true)
        if [[ $line == "listening on "* ]]; then
            echo "${line##*:}"
            return 0
        fi
        sleep 0.1
    done
    return 1
}

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
