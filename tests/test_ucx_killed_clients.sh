#!/usr/bin/env bash
# test_ucx_killed_clients.sh TDPIPE STREAM_CLIENT [secret]: clients on the
# same-host ucx plane killed in the middle of 100 MB messages stop no other
# client, and leave the server's memory where it was.
#
#   TDPIPE         the built tdpipe binary (ctest passes it)
#   STREAM_CLIENT  bench/tdp_stream_client (streams until killed, prints
#                  "connected" once its pipe is up)
#   secret         every process (server and clients) uses one shared
#                  secret (--secret-file): the same-host worker of each
#                  link is then made only after both proofs, and its
#                  address travels in the post-proof PROVEN frame
#
# On 127.0.0.1 only:
#   1. `tdpipe serve -m sink -d 1`; one clean ucx client (two 100 MB
#      messages), then the server's VmRSS is the baseline;
#   2. a rate-limited ucx client (`tdpipe send`, 5 s per-message deadline)
#      streams through all of step 3 and must still be alive after it;
#   3. KILLS ucx clients, one after the other, each SIGKILLed 50..300 ms
#      after it printed "connected" while streaming 100 MB messages;
#   4. good clients, each under a deadline: ucx (1 KB and 1 MB messages)
#      and shm (1 KB), every message delivered and checked by the sink;
#   5. the server's VmRSS comes back within RSS_BOUND_MB of the baseline
#      (polled for at most 10 s), and the server exits 0 on SIGTERM with
#      its pattern check ok.
# A server whose same-host UCX worker is shared by every client fails 2
# (a killed sender leaves a claimed, never-filled slot in the one receive
# FIFO: the rate-limited client and every later ucx client time out) and
# 5 (each dead peer's rendezvous receive keeps its 100 MB buffer).
# Every loop is bounded in count and time; every process runs under
# `timeout` or is killed by its pid on exit.
set -uo pipefail

TDPIPE=${1:?usage: test_ucx_killed_clients.sh TDPIPE STREAM_CLIENT}
CLIENT=${2:?usage: test_ucx_killed_clients.sh TDPIPE STREAM_CLIENT}
MODE=${3:-}
KILLS=${TDP_TEST_KILLS:-40}
RSS_BOUND_MB=16
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tdp-kill.XXXXXX")
SERVER=
STEADY=
VICTIM=
FAILS=0

cleanup() {
    local p
    for p in $VICTIM $STEADY $SERVER; do
        kill -KILL "$p" 2>/dev/null && wait "$p" 2>/dev/null
    done
    if [[ -n ${TDP_TEST_KEEP:-} ]]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

# SECRET: the --secret-file option every process gets (none without "secret")
SECRET=()
if [[ $MODE == secret ]]; then
    head -c 32 /dev/urandom >"$WORK/secret"
    SECRET=(--secret-file "$WORK/secret")
elif [[ -n $MODE ]]; then
    echo "usage: test_ucx_killed_clients.sh TDPIPE STREAM_CLIENT [secret]" >&2
    exit 2
fi

fail() {
    echo "FAIL: $*" >&2
    FAILS=$((FAILS + 1))
}

dump() {
    local f
    for f in "$@"; do
        [[ -f $f ]] && tail -5 "$f" | sed "s|^|  $(basename "$f"): |" >&2
    done
}

rss_kb() { sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\) kB$/\1/p' "/proc/$SERVER/status" 2>/dev/null; }

# good NAME SECONDS ARGS...: a stream client that must exit 0 in time.
good() {
    local name=$1 secs=$2 rc=0
    shift 2
    timeout "$secs" "$CLIENT" "$ADDR" -t 5000 "${SECRET[@]}" "$@" >"$WORK/$name.out" 2>&1 || rc=$?
    if ((rc != 0)); then
        fail "$name: exit $rc"
        dump "$WORK/$name.out"
    fi
    grep -q '^connected on the ' "$WORK/$name.out" || fail "$name: never connected"
}

# ---- 1. the server and its baseline ---------------------------------------------

# Under AddressSanitizer freed memory waits in a quarantine (256 MB by
# default) before it goes back, so VmRSS would not show a buffer given back:
# no quarantine for the server here (an ordinary build ignores the variable).
ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=0" \
    "$TDPIPE" serve -b 127.0.0.1 -m sink -d 1 -q "${SECRET[@]}" \
    >"$WORK/server.out" 2>"$WORK/server.err" &
SERVER=$!
PORT=
for _ in $(seq 100); do # 10 s
    PORT=$(sed -n 's/^listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$WORK/server.out")
    [[ -n $PORT ]] && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.1
done
if [[ -z $PORT ]]; then
    echo "FAIL: the server did not start" >&2
    dump "$WORK/server.out" "$WORK/server.err"
    exit 1
fi
ADDR=127.0.0.1:$PORT

good warmup 60 -P ucx -s 100MB -n 2
grep -q '^connected on the ucx plane' "$WORK/warmup.out" || fail "warm-up: not on the ucx plane"
sleep 1
BASE=$(rss_kb)
echo "server VmRSS after the warm-up: $BASE kB"

# ---- 2. a client that keeps going through the kills ---------------------------

"$TDPIPE" send "$ADDR" --plane ucx -s 4KB -n 1000000 -r 100 -t 5000 -q "${SECRET[@]}" \
    >"$WORK/steady.out" 2>"$WORK/steady.err" &
STEADY=$!

# ---- 3. the kills --------------------------------------------------------------

MID=0 EARLY=0 NOCONN=0
T0=$SECONDS
for ((i = 1; i <= KILLS && SECONDS - T0 < 60; i++)); do
    # a fresh file before the client starts: the last one's "connected" is gone
    : >"$WORK/victim.out"
    "$CLIENT" "$ADDR" -P ucx -s 100MB -n 0 -t 10000 "${SECRET[@]}" >>"$WORK/victim.out" 2>&1 &
    VICTIM=$!
    for _ in $(seq 1000); do # 10 s
        grep -q '^connected' "$WORK/victim.out" && break
        kill -0 "$VICTIM" 2>/dev/null || break
        sleep 0.01
    done
    if ! grep -q '^connected' "$WORK/victim.out"; then
        NOCONN=$((NOCONN + 1))
        kill -KILL "$VICTIM" 2>/dev/null
        wait "$VICTIM" 2>/dev/null
        echo "client $i: exit $? before it connected" >>"$WORK/victim.out"
        cp "$WORK/victim.out" "$WORK/noconn$i.out"
        dump "$WORK/noconn$i.out"
    else
        sleep "0.$(printf '%03d' $((50 + RANDOM % 251)))"
        if kill -0 "$VICTIM" 2>/dev/null; then
            MID=$((MID + 1))
        else
            EARLY=$((EARLY + 1))
            cp "$WORK/victim.out" "$WORK/early$i.out"
            dump "$WORK/early$i.out"
        fi
    fi
    kill -KILL "$VICTIM" 2>/dev/null
    wait "$VICTIM" 2>/dev/null
    VICTIM=
done
echo "killed $MID clients while streaming in $((SECONDS - T0)) s ($EARLY ended before, $NOCONN never connected)"
((NOCONN == 0)) || fail "$NOCONN killed clients never connected"
((EARLY == 0)) || fail "$EARLY clients ended before their kill"
((MID >= KILLS * 3 / 4)) || fail "only $MID of $KILLS clients killed while streaming"

if kill -0 "$STEADY" 2>/dev/null; then
    kill -KILL "$STEADY" 2>/dev/null
    wait "$STEADY" 2>/dev/null
else
    wait "$STEADY"
    fail "the client streaming through the kills ended with exit $?"
    dump "$WORK/steady.out" "$WORK/steady.err"
fi
STEADY=

# ---- 4. good clients on both planes -----------------------------------------------

good ucx_1k 20 -P ucx -s 1KB -n 50
good ucx_1m 20 -P ucx -s 1MB -n 20
good shm_1k 20 -P shm -s 1KB -n 50
grep -q '^connected on the shm plane' "$WORK/shm_1k.out" || fail "shm client: not on the shm plane"

# ---- 5. memory given back, a clean end -------------------------------------------

RSS=$(rss_kb)
for _ in $(seq 100); do # 10 s
    ((RSS <= BASE + RSS_BOUND_MB * 1024)) && break
    sleep 0.1
    RSS=$(rss_kb)
done
echo "server VmRSS after the kills: $RSS kB (baseline $BASE kB, bound +$RSS_BOUND_MB MB)"
((RSS <= BASE + RSS_BOUND_MB * 1024)) || fail "server VmRSS grew by $(((RSS - BASE) / 1024)) MB"

kill -TERM "$SERVER"
RC=
for _ in $(seq 100); do # 10 s
    kill -0 "$SERVER" 2>/dev/null || { wait "$SERVER"; RC=$?; break; }
    sleep 0.1
done
SERVER_PID=$SERVER
SERVER=
if [[ $RC != 0 ]]; then
    fail "server: exit ${RC:-none (still running)}"
    kill -KILL "$SERVER_PID" 2>/dev/null
    dump "$WORK/server.err"
fi
grep -q 'verify ok' "$WORK/server.out" "$WORK/server.err" || {
    fail "server: pattern check not ok"
    dump "$WORK/server.out" "$WORK/server.err"
}

if ((FAILS)); then
    echo "test_ucx_killed_clients${MODE:+ ($MODE)}: $FAILS failure(s)" >&2
    exit 1
fi
echo "test_ucx_killed_clients${MODE:+ ($MODE)}: ok"
