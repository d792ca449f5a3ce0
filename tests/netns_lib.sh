# netns_lib.sh: sourced by the network-namespace tests (test_netns_*.sh).
# `netns_pair TAG OCTET` makes two namespaces joined by a veth pair with
# 10.OCTET.N.1/30 (NS_A, IF_A, ADDR_A) and 10.OCTET.N.2/30 (NS_B, IF_B,
# ADDR_B), links up and waited for; every exit path kills what `start`-ed
# processes registered in BG_PIDS and deletes the namespaces and WORK. Each
# test gives its own TAG and OCTET, so two of them never collide. Exits 77
# (skipped) without root, `ip netns`, or when the pair cannot be made.

skip() {
    echo "SKIP: $*"
    exit 77
}
[[ $(id -u) -eq 0 ]] || skip "needs root (creates network namespaces)"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
ip netns list >/dev/null 2>&1 || skip "'ip netns' is not available"

BG_PIDS=()
FAILS=0
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tdp-netns.XXXXXX")

netns_cleanup() {
    local pid
    for pid in "${BG_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${BG_PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    [[ -n ${NS_A:-} ]] && { timeout 10 ip netns del "$NS_A" 2>/dev/null || true; }
    [[ -n ${NS_B:-} ]] && { timeout 10 ip netns del "$NS_B" 2>/dev/null || true; }
    rm -rf "$WORK"
}
trap netns_cleanup EXIT
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

# start NAME NS SECONDS CMD...: background in namespace NS; sets PID.
start() {
    local name=$1 ns=$2 secs=$3
    shift 3
    ip netns exec "$ns" timeout "$secs" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    PID=$!
    BG_PIDS+=("$PID")
}

# run NAME NS SECONDS CMD...: in the foreground; sets RC.
run() {
    local name=$1 ns=$2 secs=$3
    shift 3
    ip netns exec "$ns" timeout "$secs" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
    RC=$?
}

# port_of NAME: the port of NAME's first line 'listening on HOST:PORT' (bounded wait).
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

# link_up NS IF: wait (bounded) until the link reports UP (carrier on both ends).
link_up() {
    for _ in $(seq 50); do
        [[ $(ip -n "$1" -br link show "$2" 2>/dev/null) == *" UP "* ]] && return 0
        sleep 0.1
    done
    return 1
}

# netns_pair TAG OCTET: the two namespaces and the veth pair, up.
netns_pair() {
    local tag=$1 id=$$
    NS_A=tdp-$tag-a-$id
    NS_B=tdp-$tag-b-$id
    # at most 15 characters: tdp + a 2-letter tag + a pid of up to 9 digits + a/b
    IF_A=tdp$tag${id}a
    IF_B=tdp$tag${id}b
    NET=10.$2.$((id % 250)).
    ADDR_A=${NET}1
    ADDR_B=${NET}2
    if ! { ip netns add "$NS_A" && ip netns add "$NS_B" &&
        ip link add "$IF_A" netns "$NS_A" type veth peer name "$IF_B" netns "$NS_B" &&
        ip -n "$NS_A" addr add "${ADDR_A}/30" dev "$IF_A" &&
        ip -n "$NS_B" addr add "${ADDR_B}/30" dev "$IF_B" &&
        ip -n "$NS_A" link set lo up && ip -n "$NS_B" link set lo up &&
        ip -n "$NS_A" link set "$IF_A" up && ip -n "$NS_B" link set "$IF_B" up; } \
        2>"$WORK/setup.err"; then
        cat "$WORK/setup.err" >&2
        skip "cannot create the namespaces and veth pair"
    fi
    if ! link_up "$NS_A" "$IF_A" || ! link_up "$NS_B" "$IF_B"; then
        fail "the veth pair did not come up"
        exit 1
    fi
}
