#!/usr/bin/env bash
# test_netns_clean_end.sh TDPIPE: a stream of 10 MB messages over UCX's TCP
# transport across a 1 Gbit/s link (two network namespaces joined by a veth
# pair, shaped with tc) ends cleanly on both sides, every time: the sender
# tears its UCX endpoint down right after its BYE, and the receiver must
# still report "producer closed", not a reset (it once did, 2 times in 6).
# Then the same with no --plane: the tcp plane, chosen by default between
# two network stacks without RDMA, ends as cleanly.
#
# Needs root, `ip netns` and `tc`; exits 77 (skipped) without them. The
# namespaces, the veth pair and 10.205.N.1/30, .2/30 are its own (the other
# netns tests use 10.203 and 10.204) and go on every exit path. Every process
# runs under `timeout`; the test takes about 15 s.
set -uo pipefail

TDPIPE=${1:?usage: test_netns_clean_end.sh TDPIPE}
RUNS=${RUNS:-6}

# shellcheck source=netns_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/netns_lib.sh"
command -v tc >/dev/null || skip "no 'tc' command (iproute2)"
netns_pair ce 205
for ns_if in "$NS_A $IF_A" "$NS_B $IF_B"; do
    set -- $ns_if
    ip netns exec "$1" tc qdisc add dev "$2" root tbf rate 1gbit burst 256kb latency 50ms ||
        skip "cannot shape the veth link with tc"
done

# ctest keeps UCX on loopback for the other tests; this one crosses the veth
export UCX_TLS=tcp UCX_NET_DEVICES=all
# the last runs name no plane: between two network stacks, with no RDMA
# device on either side, the HELLOs choose the tcp plane
DEFAULT_RUNS=${DEFAULT_RUNS:-2}
want_default=tcp
[[ -n $(ls /sys/class/infiniband 2>/dev/null) ]] && want_default=ucx
for i in $(seq $((RUNS + DEFAULT_RUNS))); do
    plane=(--plane ucx)
    want=ucx
    if [[ $i -gt $RUNS ]]; then
        plane=()
        want=$want_default
    fi
    # emptied here, not by the background job's redirection: that one may
    # run after the wait below has read the previous run's line
    : >"$WORK/recv.out"
    ip netns exec "$NS_A" timeout 60 "$TDPIPE" recv --bind "$ADDR_A" --port 17901 \
        "${plane[@]}" >"$WORK/recv.out" 2>"$WORK/recv.err" &
    rpid=$!
    BG_PIDS+=("$rpid")
    for _ in $(seq 100); do
        grep -q "listening on" "$WORK/recv.out" 2>/dev/null && break
        sleep 0.1
    done
    src=0
    ip netns exec "$NS_B" timeout 60 "$TDPIPE" send "$ADDR_A:17901" "${plane[@]}" \
        --size 10MB --count 20 --quiet >"$WORK/send.out" 2>"$WORK/send.err" || src=$?
    rrc=0
    wait "$rpid" || rrc=$?
    if [[ $src -ne 0 || $rrc -ne 0 ]] || ! grep -q "end: producer closed" "$WORK/recv.out" ||
        ! grep -q "plane $want," "$WORK/recv.out"; then
        echo "FAIL: run $i: send exit $src, recv exit $rrc, plane ${want} expected"
        sed 's/^/  /' "$WORK/send.out" "$WORK/send.err" "$WORK/recv.out" "$WORK/recv.err"
        FAILS=$((FAILS + 1))
    else
        echo "run $i: $(tail -n1 "$WORK/recv.out")"
    fi
done
echo "test_netns_clean_end: $((RUNS + DEFAULT_RUNS - FAILS)) of $((RUNS + DEFAULT_RUNS)) clean"
[[ $FAILS -eq 0 ]]
