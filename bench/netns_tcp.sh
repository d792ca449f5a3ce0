#!/usr/bin/env bash
# bench/netns_tcp.sh TDPIPE [RATE [SIZE [COUNT [RUNS]]]] [-- VAR=value ...]:
# UCX over TCP between two network namespaces joined by a veth pair (not
# loopback), `tdpipe send` to `tdpipe recv` against raw TCP
# (bench/raw_tcp.py), RUNS rounds interleaved. RATE: a tbf rate limit on
# both ends (e.g. 4gbit) or none (default); SIZE default 1MB, COUNT 1000,
# RUNS 3. Each VAR=value after -- is one more tdpipe variant (e.g.
# UCX_TCP_RX_SEG_SIZE=256k) beside the defaults, all on the ucx plane
# (--plane ucx: between two namespaces without RDMA the tcp plane is the
# default); plane:NAME is one with --plane NAME on both sides (plane:tcp:
# the tcp plane instead of UCX). Needs root; tdpipe recv
# checks every message's pattern, which raw TCP does not.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TDPIPE=$(realpath "${1:?usage: netns_tcp.sh TDPIPE [RATE [SIZE [COUNT [RUNS]]]] [-- VAR=value ...]}")
shift
ARGS=()
while [[ $# -gt 0 && $1 != -- ]]; do
    ARGS+=("$1")
    shift
done
[[ ${1:-} == -- ]] && shift
RATE=${ARGS[0]:-none} SIZE=${ARGS[1]:-1MB} COUNT=${ARGS[2]:-1000} RUNS=${ARGS[3]:-3}
VARIANTS=(DEFAULTS=1 "$@" raw)
source "$HERE/../tests/netns_lib.sh"
netns_pair tcpb 212
if [[ $RATE != none ]]; then
    ip netns exec "$NS_A" tc qdisc add dev "$IF_A" root tbf rate "$RATE" burst 1mb latency 50ms
    ip netns exec "$NS_B" tc qdisc add dev "$IF_B" root tbf rate "$RATE" burst 1mb latency 50ms
fi
export UCX_TLS=tcp UCX_NET_DEVICES=all
bytes=$(python3 -c "
import re, sys
m = re.fullmatch(r'([0-9.]+)\s*(KB|K|MB|M|GB|G)?', sys.argv[1])
print(int(float(m[1]) * {None: 1, 'K': 1e3, 'KB': 1e3, 'M': 1e6, 'MB': 1e6, 'G': 1e9, 'GB': 1e9}[m[2]]))" "$SIZE")
echo "veth pair, rate $RATE, $COUNT x $SIZE, $(uptime | sed 's/.*load/load/')"
for r in $(seq "$RUNS"); do
    for v in "${VARIANTS[@]}"; do
        if [[ $v == raw ]]; then
            start rr "$NS_A" 120 python3 "$HERE/raw_tcp.py" recv "$ADDR_A" 5999 "$bytes" "$COUNT"
            rp=$PID
            sleep 0.5
            run rs "$NS_B" 120 python3 "$HERE/raw_tcp.py" send "$ADDR_A" 5999 "$bytes" "$COUNT"
            wait "$rp"
            echo "$r raw TCP: $(tail -n1 "$WORK/rr.out")"
            continue
        fi
        opt=(--plane ucx) envv=$v # UCX over TCP (between namespaces the default is the tcp plane)
        if [[ $v == plane:* ]]; then
            opt=(--plane "${v#plane:}")
            envv=DEFAULTS=1
        fi
        start tr "$NS_A" 120 env "$envv" nice -n -19 "$TDPIPE" recv --bind "$ADDR_A" \
            --count "$COUNT" --quiet "${opt[@]}"
        rp=$PID
        port=$(port_of tr) || { fail "recv did not start"; dump "$WORK/tr.err"; exit 1; }
        run ts "$NS_B" 120 env "$envv" nice -n -19 "$TDPIPE" send "$ADDR_A:$port" --count "$COUNT" \
            --size "$SIZE" --quiet "${opt[@]}"
        wait "$rp"
        echo "$r tdpipe $v: $(grep -o 'received.*msgs/s' "$WORK/tr.out")"
    done
done
uptime | sed 's/.*load/load/'
