#!/usr/bin/env bash
# bench/rss_killed_clients.sh: does a long-running `tdpipe serve` keep flat
# memory when its clients die in the middle of large transfers?
#
# usage: bench/rss_killed_clients.sh [options]
#   -b, --build DIR       build directory holding tools/tdpipe and
#                         bench/tdp_stream_client (default: build)
#   -P, --plane NAME      data plane the clients force: auto (default: shm on
#                         this host), shm or ucx
#       --tls LIST        UCX_TLS for the server and the clients (default: the
#                         environment's; e.g. tcp)
#   -d, --depth D         the server's receive depth (default 1)
#   -n, --clients N       clients killed (default 500, at most 100000)
#   -j, --parallel P      clients alive at once (default 1, at most 16)
#   -s, --size BYTES      message size (default 100MB)
#       --min-ms MS       shortest delay from a client's "connected" to its
#                         SIGKILL (default 20)
#       --max-ms MS       longest delay (default 300)
#   -w, --warmup W        clean clients (10 messages each) before the baseline
#                         (default 3)
#   -e, --every K         sample the server every K killed clients (default 50)
#       --settle S        seconds to wait before each sample (default 1; the
#                         first and the last wait 3 x S)
#       --max-seconds T   stop starting clients after T seconds (default 3600)
#       --seed X          seed of the random delays (default 1)
#       --json FILE       append the JSON line to FILE as well
#       --keep            keep the scratch folder (server output, failed
#                         clients' output) and print its path
#   -h, --help
#
# What it does, on 127.0.0.1 only (UCX confined with UCX_NET_DEVICES=lo
# unless the environment sets it):
#   1. starts `tdpipe serve -m sink -d D` in the background;
#   2. runs W clean clients, then samples the server: VmRSS, VmHWM, RssAnon,
#      RssFile, RssShmem (/proc/PID/status), open fds (/proc/PID/fd),
#      mappings (/proc/PID/maps) and memfd mappings among them;
#   3. runs N clients (bench/tdp_stream_client, streaming SIZE messages with
#      the plane forced), each killed with SIGKILL MIN..MAX ms after it
#      printed "connected", so most die in the middle of a message;
#      samples every K clients and at the end, after a settle;
#   4. runs one good client (10 messages) and requires exit status 0; the
#      sink checks the pattern of every message that arrives whole;
#   5. stops the server (SIGTERM), prints a table and one JSON line.
# Exit status: 0 done, the good client passed, the server exited 0 and
# its pattern check says ok; 1 otherwise; 2 usage.
# Every loop is bounded in count and in time; an EXIT trap kills every
# child still alive (server and clients) and removes the scratch folder.
set -uo pipefail

BUILD=build PLANE=auto TLS='' DEPTH=1 N=500 PAR=1 SIZE=100MB MIN_MS=20 MAX_MS=300
WARMUP=3 EVERY=50 SETTLE=1 MAX_SECONDS=3600 SEED=1 JSON_OUT='' KEEP=0

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die_usage() {
    echo "rss_killed_clients: $*" >&2
    exit 2
}
isnum() { [[ $1 =~ ^[0-9]+$ ]]; }

while (($#)); do
    case $1 in
    -b | --build) BUILD=${2:?}; shift ;;
    -P | --plane) PLANE=${2:?}; shift ;;
    --tls) TLS=${2:?}; shift ;;
    -d | --depth) DEPTH=${2:?}; shift ;;
    -n | --clients) N=${2:?}; shift ;;
    -j | --parallel) PAR=${2:?}; shift ;;
    -s | --size) SIZE=${2:?}; shift ;;
    --min-ms) MIN_MS=${2:?}; shift ;;
    --max-ms) MAX_MS=${2:?}; shift ;;
    -w | --warmup) WARMUP=${2:?}; shift ;;
    -e | --every) EVERY=${2:?}; shift ;;
    --settle) SETTLE=${2:?}; shift ;;
    --max-seconds) MAX_SECONDS=${2:?}; shift ;;
    --seed) SEED=${2:?}; shift ;;
    --json) JSON_OUT=${2:?}; shift ;;
    --keep) KEEP=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die_usage "unknown option '$1' (--help)" ;;
    esac
    shift
done
for v in DEPTH N PAR MIN_MS MAX_MS WARMUP EVERY SETTLE MAX_SECONDS SEED; do
    isnum "${!v}" || die_usage "$v must be a whole number, not '${!v}'"
done
((N >= 1 && N <= 100000)) || die_usage "clients: 1..100000"
((PAR >= 1 && PAR <= 16)) || die_usage "parallel: 1..16"
((EVERY >= 1)) || die_usage "every: at least 1"
((MIN_MS <= MAX_MS)) || die_usage "min-ms above max-ms"
((WARMUP <= 100)) || die_usage "warmup: at most 100"
case $PLANE in auto | shm | ucx) ;; *) die_usage "plane: auto, shm or ucx" ;; esac

TDPIPE=$BUILD/tools/tdpipe
CLIENT=$BUILD/bench/tdp_stream_client
[[ -x $TDPIPE && -x $CLIENT ]] || die_usage "no $TDPIPE or $CLIENT: build first"

export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
[[ -n $TLS ]] && export UCX_TLS=$TLS
RANDOM=$SEED

DIR=$(mktemp -d /tmp/tdp-rss-XXXXXX)
SERVER_PID=
declare -A ALIVE=() # client pid -> 1

cleanup() {
    local p f
    trap - INT TERM
    # the clients (each one_client subshell notes its client's pid), then the subshells
    for f in "$DIR"/c*.pid; do [[ -e $f ]] && kill -KILL "$(<"$f")" 2>/dev/null; done
    for p in "${!ALIVE[@]}"; do kill -KILL "$p" 2>/dev/null; done
    for p in "${!ALIVE[@]}"; do wait "$p" 2>/dev/null; done
    if [[ -n $SERVER_PID ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$SERVER_PID" 2>/dev/null
        wait "$SERVER_PID" 2>/dev/null
    fi
    if ((KEEP)); then echo "rss_killed_clients: kept $DIR" >&2; else rm -rf "$DIR"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

now_s() { date +%s; }
T0=$(now_s)

# ---- the server -------------------------------------------------------------

"$TDPIPE" serve -b 127.0.0.1 -m sink -d "$DEPTH" -q >"$DIR/server.out" 2>"$DIR/server.err" &
SERVER_PID=$!
PORT=
for _ in $(seq 100); do # 10 s
    PORT=$(sed -n 's/^listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$DIR/server.out" 2>/dev/null)
    [[ -n $PORT ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.1
done
if [[ -z $PORT ]]; then
    echo "rss_killed_clients: the server did not start" >&2
    cat "$DIR/server.out" "$DIR/server.err" >&2
    exit 1
fi
ADDR=127.0.0.1:$PORT

# ---- samples ----------------------------------------------------------------

SAMPLES=() # "clients rss hwm anon file shmem fds maps memfd"
sample() {
    local st=/proc/$SERVER_PID/status f
    [[ -r $st ]] || { echo "rss_killed_clients: the server is gone" >&2; exit 1; }
    local -A kb=()
    while read -r f v _; do kb[${f%:}]=$v; done < <(grep -E '^(VmRSS|VmHWM|RssAnon|RssFile|RssShmem):' "$st")
    local fds maps memfd
    fds=$(find "/proc/$SERVER_PID/fd" -mindepth 1 -maxdepth 1 | wc -l)
    maps=$(wc -l <"/proc/$SERVER_PID/maps")
    memfd=$(grep -c 'memfd:' "/proc/$SERVER_PID/maps")
    SAMPLES+=("$1 ${kb[VmRSS]} ${kb[VmHWM]} ${kb[RssAnon]} ${kb[RssFile]} ${kb[RssShmem]} $fds $maps $memfd")
    if [[ -t 2 ]]; then
        printf 'rss_killed_clients: %5s clients: VmRSS %s kB, fds %s, maps %s\n' "$1" "${kb[VmRSS]}" "$fds" "$maps" >&2
    fi
}

# ---- clients ----------------------------------------------------------------

STARTED=0 KILLED_CONNECTED=0 DIED_EARLY=0 NOT_CONNECTED=0

# One client: start, wait for "connected" (at most 10 s), sleep DELAY ms,
# SIGKILL. Runs in a subshell per client so that P run at once.
one_client() {
    local i=$1 delay=$2 out=$DIR/c$1.out pid
    "$CLIENT" "$ADDR" -P "$PLANE" -s "$SIZE" -n 0 >"$out" 2>"$DIR/c$i.err" &
    pid=$!
    echo "$pid" >"$DIR/c$i.pid"
    for _ in $(seq 1000); do # 10 s
        grep -q '^connected' "$out" 2>/dev/null && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.01
    done
    if ! grep -q '^connected' "$out" 2>/dev/null; then
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        rm -f "$DIR/c$i.pid"
        echo notconnected >"$DIR/c$i.res"
        return
    fi
    sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
    if kill -KILL "$pid" 2>/dev/null; then
        wait "$pid" 2>/dev/null
        echo killed >"$DIR/c$i.res"
        rm -f "$out" "$DIR/c$i.err"
    else
        wait "$pid" 2>/dev/null
        echo early >"$DIR/c$i.res" # it ended on its own: a failure to look at
    fi
    rm -f "$DIR/c$i.pid"
}

reap_one() { # wait for any client subshell, forget it
    local p
    wait -n 2>/dev/null
    for p in "${!ALIVE[@]}"; do kill -0 "$p" 2>/dev/null || unset "ALIVE[$p]"; done
}

for ((w = 1; w <= WARMUP; w++)); do
    timeout 120 "$CLIENT" "$ADDR" -P "$PLANE" -s "$SIZE" -n 10 >"$DIR/warm.out" 2>&1 ||
        { echo "rss_killed_clients: warm-up client $w failed" >&2; cat "$DIR/warm.out" >&2; exit 1; }
done
PLANE_USED=$(sed -n 's/^connected on the \(.*\) plane$/\1/p' "$DIR/warm.out")
sleep $((3 * SETTLE))
sample 0

for ((i = 1; i <= N; i++)); do
    if (($(now_s) - T0 > MAX_SECONDS)); then
        echo "rss_killed_clients: time limit reached after $((i - 1)) clients" >&2
        break
    fi
    while ((${#ALIVE[@]} >= PAR)); do reap_one; done
    # drawn here: a subshell's $RANDOM would not follow --seed
    one_client "$i" $((MIN_MS + RANDOM % (MAX_MS - MIN_MS + 1))) &
    ALIVE[$!]=1
    STARTED=$i
    if ((i % EVERY == 0 || i == N)); then
        while ((${#ALIVE[@]} > 0)); do reap_one; done
        if ((i == N)); then sleep $((3 * SETTLE)); else sleep "$SETTLE"; fi
        sample "$i"
    fi
done
while ((${#ALIVE[@]} > 0)); do reap_one; done
if ((STARTED % EVERY != 0 && STARTED != N)); then # stopped by the time limit
    sleep $((3 * SETTLE))
    sample "$STARTED"
fi
for f in "$DIR"/c*.res; do
    [[ -e $f ]] || continue
    case $(<"$f") in
    killed) ((KILLED_CONNECTED++)) ;;
    early) ((DIED_EARLY++)) ;;
    notconnected) ((NOT_CONNECTED++)) ;;
    esac
done

# ---- a good client at the end -----------------------------------------------

GOOD_RC=0
timeout 120 "$CLIENT" "$ADDR" -P "$PLANE" -s "$SIZE" -n 10 >"$DIR/good.out" 2>&1 || GOOD_RC=$?
if ((GOOD_RC != 0)); then
    echo "rss_killed_clients: the good client failed (exit $GOOD_RC)" >&2
    cat "$DIR/good.out" >&2
fi
sleep "$SETTLE"
sample good

kill -TERM "$SERVER_PID"
for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
SERVER_RC=0
wait "$SERVER_PID" || SERVER_RC=$?
SERVER_PID=
SERVED=$(grep -h '^served' "$DIR/server.out" "$DIR/server.err" | tail -1)
VERIFY=$(sed -n 's/.*; verify \([A-Za-z]*\).*/\1/p' <<<"$SERVED")
if ((SERVER_RC != 0)); then
    echo "rss_killed_clients: the server exited with status $SERVER_RC; its last words:" >&2
    grep -v 'was not returned to mpool' "$DIR/server.err" | tail -20 >&2
fi

# ---- report -----------------------------------------------------------------

CONF="plane ${PLANE_USED:-$PLANE}, UCX_TLS=${UCX_TLS:-default}, depth $DEPTH, $SIZE messages"
echo "rss_killed_clients: $CONF; $STARTED clients killed with SIGKILL ${MIN_MS}..${MAX_MS} ms after connecting"
echo "  ($KILLED_CONNECTED killed while streaming, $DIED_EARLY ended before the kill, $NOT_CONNECTED never connected)"
printf '%8s %10s %10s %10s %10s %10s %6s %6s %6s\n' clients VmRSS_kB VmHWM_kB RssAnon RssFile RssShmem fds maps memfd
for s in "${SAMPLES[@]}"; do
    # shellcheck disable=SC2086
    printf '%8s %10s %10s %10s %10s %10s %6s %6s %6s\n' $s
done
echo "good client: exit $GOOD_RC; server: exit $SERVER_RC, pattern check ${VERIFY:-unknown}"
echo "server: $SERVED"

json_samples=
for s in "${SAMPLES[@]}"; do
    read -r c rss hwm anon file shm fds maps memfd <<<"$s"
    [[ $c =~ ^[0-9]+$ ]] || c="\"$c\""
    json_samples+="${json_samples:+,}{\"clients\":$c,\"vmrss_kb\":$rss,\"vmhwm_kb\":$hwm,\"rss_anon_kb\":$anon,\"rss_file_kb\":$file,\"rss_shmem_kb\":$shm,\"fds\":$fds,\"maps\":$maps,\"memfd_maps\":$memfd}"
done
JSON="{\"bench\":\"rss_killed_clients\",\"plane\":\"${PLANE_USED:-$PLANE}\",\"ucx_tls\":\"${UCX_TLS:-default}\",\"depth\":$DEPTH,\"size\":\"$SIZE\",\"clients\":$STARTED,\"killed_streaming\":$KILLED_CONNECTED,\"ended_early\":$DIED_EARLY,\"not_connected\":$NOT_CONNECTED,\"kill_ms\":[$MIN_MS,$MAX_MS],\"parallel\":$PAR,\"good_client_rc\":$GOOD_RC,\"server_rc\":$SERVER_RC,\"verify\":\"${VERIFY:-unknown}\",\"seconds\":$(($(now_s) - T0)),\"samples\":[$json_samples]}"
echo "$JSON"
[[ -n $JSON_OUT ]] && echo "$JSON" >>"$JSON_OUT"
((GOOD_RC == 0 && SERVER_RC == 0)) && [[ $VERIFY == ok ]]
