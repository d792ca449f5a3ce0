#!/usr/bin/env bash
# test_cli.sh TDPIPE [PRODUCER]: the tdpipe command end to end, on loopback.
#
#   TDPIPE     path of the built tdpipe binary (ctest passes it)
#   PRODUCER   optional: examples/producer, a peer whose payload is not
#              tdpipe's pattern (for the verification-failure case)
#
# Every process runs under `timeout`, so a hang fails the test instead of
# stalling it; servers and receivers started in the background are killed
# (by their own pid) on exit. Only 127.0.0.1 and ::1 are ever used.
set -uo pipefail

TDPIPE=${1:?usage: test_cli.sh TDPIPE [PRODUCER]}
PRODUCER=${2:-}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tdp-cli.XXXXXX")
BG_PIDS=()
declare -A RCS # exit status of each run, by name
FAILS=0
CHECKS=0

cleanup() {
    for pid in "${BG_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $*" >&2
    FAILS=$((FAILS + 1))
}

# Show what a process printed, for a failure's context.
dump() {
    local f
    for f in "$@"; do
        [[ -f $f ]] && sed "s|^|  $(basename "$f"): |" "$f" >&2
    done
}

# run NAME SECONDS CMD...: run in the foreground; out/err in $WORK/NAME.{out,err}.
run() {
    local name=$1 secs=$2 rc=0
    shift 2
    timeout "$secs" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" || rc=$?
    RCS[$name]=$rc
}

# expect_rc NAME WANT: run NAME's exit status must be WANT.
expect_rc() {
    CHECKS=$((CHECKS + 1))
    if [[ ${RCS[$1]:-none} != "$2" ]]; then
        fail "$1: exit ${RCS[$1]:-none}, expected $2"
        dump "$WORK/$1.out" "$WORK/$1.err"
    fi
}

# expect_in NAME out|err TEXT: run NAME's stdout/stderr contains TEXT.
expect_in() {
    CHECKS=$((CHECKS + 1))
    if ! grep -qF -- "$3" "$WORK/$1.$2"; then
        fail "$1: std$2 lacks '$3'"
        dump "$WORK/$1.out" "$WORK/$1.err"
    fi
}

# start NAME SECONDS CMD...: run in the background; sets PID.
start() {
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    PID=$!
    BG_PIDS+=("$PID")
}

# finish NAME PID: wait for a background run and record its exit status.
finish() {
    local rc=0
    wait "$2" || rc=$?
    RCS[$1]=$rc
}

# port_of NAME: wait (10 s at most) for "listening on HOST:PORT"; prints PORT.
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
    fail "$1: no 'listening on' line"
    dump "$WORK/$1.out" "$WORK/$1.err"
    echo 0
    return 1
}

# ---- a peer killed: the survivor ends at once ----------------------------------

test_peer_killed() {
    local port rpid spid pl t0 ms
    for pl in ucx shm; do
        # the receiver is SIGKILLed mid-stream: the sender reports the reset
        # and exits without waiting for anything the dead process held (it
        # once waited a second for UCX endpoint closes that never end)
        start kill_recv_$pl 30 "$TDPIPE" recv --bind 127.0.0.1 --plane "$pl" --quiet
        rpid=$PID
        port=$(port_of kill_recv_$pl) || return
        start kill_send_$pl 30 "$TDPIPE" send "127.0.0.1:$port" --plane "$pl" --size 10MB \
            --count 1000000 --quiet
        spid=$PID
        sleep 1
        pkill -KILL -P "$rpid" # the receiver itself, not the timeout around it
        t0=$(date +%s%N)
        finish kill_send_$pl "$spid"
        ms=$((($(date +%s%N) - t0) / 1000000))
        wait "$rpid" 2>/dev/null || true
        expect_rc kill_send_$pl 4
        expect_in kill_send_$pl err "connection reset"
        CHECKS=$((CHECKS + 1))
        if ((ms > 500)); then
            fail "kill_send_$pl: the sender took $ms ms to exit after its receiver died"
            dump "$WORK/kill_send_$pl.out" "$WORK/kill_send_$pl.err"
        fi
    done
}

# ---- a clean end over UCX's TCP transport is a clean end -------------------------

test_clean_end_tcp() {
    local port rpid i
    # the sender closes its UCX endpoint right after BYE; the receiver must
    # still report the clean end (it once saw a reset 3 times in 3 at 2 x 1 GB)
    for i in 1 2; do
        start tcp_end_recv_$i 60 env UCX_TLS=tcp "$TDPIPE" recv --bind 127.0.0.1 --plane ucx \
            --quiet
        rpid=$PID
        port=$(port_of tcp_end_recv_$i) || return
        run tcp_end_send_$i 60 env UCX_TLS=tcp "$TDPIPE" send "127.0.0.1:$port" --plane ucx \
            --size 200MB --count 3 --quiet
        finish tcp_end_recv_$i "$rpid"
        expect_rc tcp_end_send_$i 0
        expect_rc tcp_end_recv_$i 0
        expect_in tcp_end_recv_$i out "end: producer closed"
    done
}

# ---- send --reconnect ----------------------------------------------------------------

test_reconnect() {
    local port spid r1 r2
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # the sender starts first and waits; the first receiver takes 10 and
    # goes; a second one on the same port gets the rest, from where it resumed
    start rc_send 60 "$TDPIPE" send "127.0.0.1:$port" --reconnect 10000 --count 40 --rate 20 \
        --size 64KB --quiet
    spid=$PID
    sleep 0.5
    run rc_recv1 20 "$TDPIPE" recv --bind 127.0.0.1 --port "$port" --count 10 --quiet
    sleep 0.3
    run rc_recv2 20 "$TDPIPE" recv --bind 127.0.0.1 --port "$port" --quiet
    finish rc_send "$spid"
    expect_rc rc_recv1 0
    expect_in rc_recv1 out "received 10 messages"
    expect_in rc_recv1 out "verify ok"
    expect_rc rc_recv2 0
    expect_in rc_recv2 out "verify ok; end: producer closed"
    expect_in rc_recv2 out "the producer resumed at message"
    expect_rc rc_send 0
    expect_in rc_send out "sent 40 messages"
    expect_in rc_send out "reconnects: 1"
    # a bad value is a usage error
    run rc_bad 10 "$TDPIPE" send "127.0.0.1:$port" --reconnect soon
    expect_rc rc_bad 2
}

# ---- --secret-file -----------------------------------------------------------------

test_secret() {
    local port rpid
    head -c 32 /dev/urandom >"$WORK/secret1"
    head -c 32 /dev/urandom >"$WORK/secret2"
    echo short >"$WORK/secret_short"
    # the same secret on both sides: a normal stream
    start sec_recv 30 "$TDPIPE" recv --bind 127.0.0.1 --secret-file "$WORK/secret1" --quiet
    rpid=$PID
    port=$(port_of sec_recv) || return
    run sec_send 30 "$TDPIPE" send "127.0.0.1:$port" --secret-file "$WORK/secret1" --count 5 \
        --size 1KB --quiet
    finish sec_recv "$rpid"
    expect_rc sec_send 0
    expect_rc sec_recv 0
    expect_in sec_recv out "received 5 messages"
    # another secret, or none: refused at the handshake, and said so
    start sec_recv2 30 "$TDPIPE" recv --bind 127.0.0.1 --secret-file "$WORK/secret1" \
        --timeout 3000 --quiet
    rpid=$PID
    port=$(port_of sec_recv2) || return
    run sec_wrong 10 "$TDPIPE" send "127.0.0.1:$port" --secret-file "$WORK/secret2" --count 1
    expect_rc sec_wrong 3
    expect_in sec_wrong err "authentication failed"
    run sec_none 10 "$TDPIPE" send "127.0.0.1:$port" --count 1
    expect_rc sec_none 3
    expect_in sec_none err "authentication failed"
    finish sec_recv2 "$rpid"
    # a file too short to be a secret is a usage error
    run sec_short 10 "$TDPIPE" send "127.0.0.1:$port" --secret-file "$WORK/secret_short"
    expect_rc sec_short 2
    expect_in sec_short err "too short"
    # a FIFO (nobody writing) is refused at once, before serve listens
    mkfifo "$WORK/secret_fifo"
    run sec_fifo 10 "$TDPIPE" serve --bind 127.0.0.1 --port 0 --secret-file "$WORK/secret_fifo"
    expect_rc sec_fifo 2
    expect_in sec_fifo err "not a regular file"
    run sec_dir 10 "$TDPIPE" send "127.0.0.1:1" --secret-file "$WORK"
    expect_rc sec_dir 2
    expect_in sec_dir err "not a regular file"
}

# ---- usage and help ------------------------------------------------------------

test_usage() {
    run help 10 "$TDPIPE" --help
    expect_rc help 0
    for sub in bench serve send recv inspect version help; do
        expect_in help out "  $sub "
    done
    run help_cmd 10 "$TDPIPE" help
    expect_rc help_cmd 0
    run help_send 10 "$TDPIPE" help send
    expect_rc help_send 0
    expect_in help_send out "usage: tdpipe send"
    # the list scripts read (tools/mkman.sh): NAME<TAB>SUMMARY, one a line
    run help_list 10 "$TDPIPE" help --list
    expect_rc help_list 0
    for sub in bench serve send recv inspect version help; do
        expect_in help_list out "$sub"$'\t'
    done

    for sub in serve send recv inspect version; do
        run "help_$sub" 10 "$TDPIPE" "$sub" --help
        expect_rc "help_$sub" 0
        expect_in "help_$sub" out "usage: tdpipe $sub"
    done

    run noargs 10 "$TDPIPE"
    expect_rc noargs 2
    run badsub 10 "$TDPIPE" frobnicate
    expect_rc badsub 2
    expect_in badsub err "unknown subcommand 'frobnicate'"
    run badglobal 10 "$TDPIPE" --frobnicate
    expect_rc badglobal 2
    run badopt 10 "$TDPIPE" send --bogus 127.0.0.1:1
    expect_rc badopt 2
    expect_in badopt err "unknown option '--bogus'"
    run noval 10 "$TDPIPE" recv --count
    expect_rc noval 2
    expect_in noval err "needs a value"
    run noaddr 10 "$TDPIPE" send
    expect_rc noaddr 2
    expect_in noaddr err "missing HOST:PORT"
    run badaddr 10 "$TDPIPE" send ::1:5000
    expect_rc badaddr 2
    run port0 10 "$TDPIPE" send 127.0.0.1:0
    expect_rc port0 2
    run badsize 10 "$TDPIPE" send --size 12XB 127.0.0.1:1
    expect_rc badsize 2
    expect_in badsize err "invalid size '12XB': unknown unit"
    run size0 10 "$TDPIPE" send --size 0 127.0.0.1:1
    expect_rc size0 2
    expect_in size0 err "invalid size '0': at least 1 B"
    # 0 ms would fail every wait at once: refused, -1 is "none"
    for sub in "send 127.0.0.1:1" recv inspect; do
        # shellcheck disable=SC2086 # the address is a separate word
        run "tmo0_${sub%% *}" 10 "$TDPIPE" $sub --timeout 0
        expect_rc "tmo0_${sub%% *}" 2
        expect_in "tmo0_${sub%% *}" err "invalid timeout '0' (ms >= 1, or -1 for none)"
    done
    run maxmem0 10 "$TDPIPE" serve --max-memory 0
    expect_rc maxmem0 2
    expect_in maxmem0 err "invalid max-memory '0': no client could be served"
    for h in --help -h; do
        run "helphelp$h" 10 "$TDPIPE" help "$h"
        expect_rc "helphelp$h" 0
        expect_in "helphelp$h" out "usage: tdpipe"
    done
    run bits 10 "$TDPIPE" send --size 1Mb 127.0.0.1:1
    expect_rc bits 2
    expect_in bits err "a lower-case b means bits"
    run emptysize 10 "$TDPIPE" bench --sizes 1KB,,1MB
    expect_rc emptysize 2
    expect_in emptysize err "--sizes: empty size in the list '1KB,,1MB'"
    run smallsize 10 "$TDPIPE" bench --sizes 64
    expect_rc smallsize 2
    expect_in smallsize err "size '64' is out of range (128 B .. 64 GiB)"
    run badrounds 10 "$TDPIPE" bench --rounds many
    expect_rc badrounds 2
    expect_in badrounds err "--rounds must be 3.."
    run baddepth 10 "$TDPIPE" recv --depth 65
    expect_rc baddepth 2
    run extra 10 "$TDPIPE" recv stray
    expect_rc extra 2
    # --plane takes what the library knows and lists it otherwise
    for sub in "send 127.0.0.1:1" recv inspect serve bench; do
        # shellcheck disable=SC2086 # the address is a separate word
        run "badplane_${sub%% *}" 10 "$TDPIPE" $sub --plane warp
        expect_rc "badplane_${sub%% *}" 2
        expect_in "badplane_${sub%% *}" err "unknown plane 'warp' (valid: auto, ucx"
    done

    # --keepalive IDLE,INTVL,CNT on every pipe-making subcommand; server limits
    for sub in "send 127.0.0.1:1" recv inspect serve; do
        # shellcheck disable=SC2086 # the address is a separate word
        run "badka_${sub%% *}" 10 "$TDPIPE" $sub --keepalive 5,1
        expect_rc "badka_${sub%% *}" 2
        expect_in "badka_${sub%% *}" err "invalid keepalive '5,1' (IDLE,INTVL,CNT)"
    done
    run badka_cnt 10 "$TDPIPE" serve --keepalive 5,1,128
    expect_rc badka_cnt 2
    run badidle 10 "$TDPIPE" serve --idle-timeout 0
    expect_rc badidle 2
    expect_in badidle err "invalid idle-timeout '0'"
    run badpending 10 "$TDPIPE" serve --max-pending 0
    expect_rc badpending 2

    run version 10 "$TDPIPE" version
    expect_rc version 0
    expect_in version out "protocol: 2"
    expect_in version out "ucx:"
    expect_in version out "cuda:"
    expect_in version out "planes:   auto, ucx"
    expect_in version out "huge pages: "
    run verbose 10 "$TDPIPE" -vv version
    expect_rc verbose 0
    # global options after the subcommand too
    for sub in version "recv --help" "send --help" "inspect --help" "serve --help" "bench --help"; do
        # shellcheck disable=SC2086 # the subcommand and its option are words
        run "late_v_${sub%% *}" 10 "$TDPIPE" $sub -v --verbose
        expect_rc "late_v_${sub%% *}" 0
    done
}

# ---- recv + send ---------------------------------------------------------------

test_recv_send() {
    local port rpid
    start recv 60 "$TDPIPE" recv --bind 127.0.0.1 --port 0 --quiet --plane ucx
    rpid=$PID
    port=$(port_of recv) || return
    run send 60 "$TDPIPE" send "127.0.0.1:$port" --count 50 --size 64KB --quiet --plane ucx -v
    expect_rc send 0
    expect_in send out "sent 50 messages (3.20 MB)"
    expect_in send out "; plane ucx"
    finish recv "$rpid"
    expect_rc recv 0
    expect_in recv out "received 50 messages (3.20 MB)"
    expect_in recv out "verify ok"
    expect_in recv out "; plane ucx, depth 4"
}

# recv --window: 1 KB messages into a receiver that grants a window, on each
# plane; bad windows refused
test_recv_window() {
    local port rpid plane
    for plane in shm ucx; do
        start "recvw_$plane" 60 "$TDPIPE" recv --bind 127.0.0.1 --port 0 --quiet --plane "$plane" \
            --window 256KiB --count 3000
        rpid=$PID
        port=$(port_of "recvw_$plane") || return
        run "sendw_$plane" 60 "$TDPIPE" send "127.0.0.1:$port" --count 3000 --size 1KB --quiet \
            --plane "$plane"
        expect_rc "sendw_$plane" 0
        finish "recvw_$plane" "$rpid"
        expect_rc "recvw_$plane" 0
        expect_in "recvw_$plane" out "received 3000 messages"
        expect_in "recvw_$plane" out "verify ok"
        expect_in "recvw_$plane" out "; plane $plane, depth 4, window 262144 B"
    done
    run recvw_small 10 "$TDPIPE" recv --window 4000
    expect_rc recvw_small 2
    expect_in recvw_small err "--window wants 0 (off) or a size from 4 KiB to 1 GiB, not '4000'"
    run servew_big 10 "$TDPIPE" serve --window 2GiB
    expect_rc servew_big 2
    expect_in servew_big err "not '2GiB'"
}

# recv --producers: three senders into one stream, each verified with its
# own numbering (one paced, so that rate lines see it); --json names each.
test_recv_producers() {
    local port rpid s1 s2 s3
    start recvp 60 "$TDPIPE" recv --bind 127.0.0.1 --port 0 --producers 3 --json --interval 0.2
    rpid=$PID
    port=$(port_of recvp) || return
    start sendp1 60 "$TDPIPE" send "127.0.0.1:$port" --count 200 --size 64KB --rate 400 --quiet
    s1=$PID
    start sendp2 60 "$TDPIPE" send "127.0.0.1:$port" --count 100 --size 64KB --quiet
    s2=$PID
    start sendp3 60 "$TDPIPE" send "127.0.0.1:$port" --count 50 --size 1KB --quiet
    s3=$PID
    finish sendp1 "$s1"
    finish sendp2 "$s2"
    finish sendp3 "$s3"
    expect_rc sendp1 0
    expect_rc sendp2 0
    expect_rc sendp3 0
    finish recvp "$rpid"
    expect_rc recvp 0
    expect_in recvp out '"msgs":350'
    expect_in recvp out '"verify":"ok"'
    expect_in recvp out '"producers_joined":3'
    expect_in recvp out '"msgs":200,'
    expect_in recvp out '"msgs":100,'
    expect_in recvp out '"msgs":50,'
    expect_in recvp out '"end":"producer closed"'
    expect_in recvp err '"producers":[{"id":'
    run recvp_usage 10 "$TDPIPE" recv --producers 2 --dump "$WORK/d"
    expect_rc recvp_usage 2
}

# --checksum: in force when both sides offer it, said when only one does;
# serve --max-memory refuses a client whose buffers would go over the cap.
test_checksum_and_cap() {
    local port rpid
    start ck_recv 60 "$TDPIPE" recv --bind 127.0.0.1 --quiet --checksum -v
    rpid=$PID
    port=$(port_of ck_recv) || return
    run ck_send 60 "$TDPIPE" send "127.0.0.1:$port" --count 20 --size 256KB --quiet --checksum -v
    expect_rc ck_send 0
    finish ck_recv "$rpid"
    expect_rc ck_recv 0
    expect_in ck_recv out "received 20 messages"
    expect_in ck_recv out "verify ok"
    CHECKS=$((CHECKS + 1))
    if grep -qF "does not offer the payload checksum" "$WORK/ck_recv.err" "$WORK/ck_send.err"; then
        fail "checksum: both offered it, yet one side says the other does not"
    fi

    start ck1_recv 60 "$TDPIPE" recv --bind 127.0.0.1 --quiet -v
    rpid=$PID
    port=$(port_of ck1_recv) || return
    run ck1_send 60 "$TDPIPE" send "127.0.0.1:$port" --count 5 --size 1KB --quiet --checksum -v
    expect_rc ck1_send 0
    expect_in ck1_send err "does not offer the payload checksum"
    finish ck1_recv "$rpid"
    expect_rc ck1_recv 0

    # 4 x 1 MB would go over 2 MB; 4 x 100 KB fits
    start cap_serve 60 "$TDPIPE" serve --bind 127.0.0.1 --depth 4 --max-memory 2MB --count 10 \
        --json --quiet
    rpid=$PID
    port=$(port_of cap_serve) || return
    # more messages than the depth: the refusal reaches the sender while it
    # still sends (a close can finish before the receiver has read the
    # layout it refuses; see the note in docs/server.md#memory-cap)
    run cap_big 30 "$TDPIPE" send "127.0.0.1:$port" --count 12 --size 1MB --quiet
    expect_rc cap_big 3
    expect_in cap_big err "peer limit reached"
    run cap_small 30 "$TDPIPE" send "127.0.0.1:$port" --count 10 --size 100KB --quiet
    expect_rc cap_small 0
    finish cap_serve "$rpid"
    expect_rc cap_serve 0
    expect_in cap_serve out '"memory_refused":1'
    expect_in cap_serve out '"max_memory":2000000'
    run cap_bad 10 "$TDPIPE" serve --max-memory 0
    expect_rc cap_bad 2
}

# recv --count ends the stream early: the sender hears the receiver closed.
test_recv_count() {
    local port rpid
    start recv_count 60 "$TDPIPE" recv --bind 127.0.0.1 --count 5 --depth 2 --quiet
    rpid=$PID
    port=$(port_of recv_count) || return
    run send_more 60 "$TDPIPE" send "127.0.0.1:$port" --count 100000 --size 4KiB --quiet
    expect_rc send_more 4
    expect_in send_more err "the receiver closed the stream"
    finish recv_count "$rpid"
    expect_rc recv_count 0
    expect_in recv_count out "received 5 messages"
    expect_in recv_count out ", depth 2"
}

# send and bench round a size the same way (up, to whole float32 elements);
# bench warns when --rounds leaves the figures to chance.
test_sizes() {
    local port rpid
    start odd_recv 30 "$TDPIPE" recv --bind 127.0.0.1 --quiet
    rpid=$PID
    port=$(port_of odd_recv) || return
    run odd_send 30 "$TDPIPE" send "127.0.0.1:$port" --count 2 --size 1001
    expect_rc odd_send 0
    expect_in odd_send err "each message is 1004 bytes (1001 rounded up"
    finish odd_recv "$rpid"
    expect_in odd_recv out "received 2 messages (2.01 KB)"

    # one is one: "1 message", "1 client"
    start one_serve 30 "$TDPIPE" serve --bind 127.0.0.1 --count 1 --quiet
    rpid=$PID
    port=$(port_of one_serve) || return
    run one_send 30 "$TDPIPE" send "127.0.0.1:$port" --count 1 --size 1KB --quiet
    expect_in one_send out "sent 1 message (1.00 KB)"
    finish one_serve "$rpid"
    expect_in one_serve out "stopping: 1 message handled"
    expect_in one_serve out "1 message (1.00 KB), sunk"
    expect_in one_serve out "served 1 client in"
    expect_in one_serve out ": 1 message in"

    run odd_bench 30 "$TDPIPE" bench --sizes 1001 --rounds 5 --quiet
    expect_rc odd_bench 0
    expect_in odd_bench out "1.00 KB            1004"
    expect_in odd_bench err "warning: --rounds 5 times 3 messages per throughput repeat"
    # 1 KB: up to 64 in the receive window, 43 timed: a queue draining
    run few_bench 30 "$TDPIPE" bench --sizes 1KB --rounds 50 --quiet
    expect_rc few_bench 0
    expect_in few_bench err "times 43 messages per throughput repeat at 1.00 KB, where up to 64 may be in flight"
}

test_ipv6() {
    if ! grep -q '^0\{31\}1 ' /proc/net/if_inet6 2>/dev/null; then
        echo "skip: no ::1"
        return
    fi
    local port rpid
    start recv6 60 "$TDPIPE" recv --bind ::1 --quiet
    rpid=$PID
    port=$(port_of recv6) || return
    expect_in recv6 out "listening on [::1]:"
    run send6 60 "$TDPIPE" send "[::1]:$port" --count 10 --size 1000 --quiet
    expect_rc send6 0
    finish recv6 "$rpid"
    expect_rc recv6 0
    expect_in recv6 out "received 10 messages (10.0 KB)"
}

# A receiver nobody connects to times out (5); its port, now closed, refuses (3);
# a port in use cannot be listened on (3).
test_errors() {
    local port rpid hpid
    start lonely 30 "$TDPIPE" recv --bind 127.0.0.1 --timeout 300
    rpid=$PID
    port=$(port_of lonely) || return
    finish lonely "$rpid"
    expect_rc lonely 5
    expect_in lonely err "no producer connected within 300 ms"

    run refused 30 "$TDPIPE" send "127.0.0.1:$port" --count 1
    expect_rc refused 3
    expect_in refused err "cannot connect to 127.0.0.1:$port: connection refused"

    start hold 30 "$TDPIPE" recv --bind 127.0.0.1 --timeout 5000
    hpid=$PID
    port=$(port_of hold) || return
    run inuse 30 "$TDPIPE" recv --bind 127.0.0.1 --port "$port"
    expect_rc inuse 3
    expect_in inuse err "cannot listen on 127.0.0.1:$port: port $port is in use"
    run inuse_serve 30 "$TDPIPE" serve --bind 127.0.0.1 --port "$port"
    expect_rc inuse_serve 3
    expect_in inuse_serve err "port $port is in use"
    kill "$hpid" 2>/dev/null
    finish hold "$hpid"

    # an address of another host (TEST-NET-1: binding sends nothing), a bad name
    run notlocal 30 "$TDPIPE" recv --bind 192.0.2.1
    expect_rc notlocal 3
    expect_in notlocal err "'192.0.2.1' is not an address of this host"
    run noname 30 "$TDPIPE" inspect --bind no-such-host.invalid
    expect_rc noname 3
    expect_in noname err "cannot resolve 'no-such-host.invalid'"
}

# Something that is not a tdpipe peer fails the connect at once, not at its
# deadline: a server that waits for a request (HTTP), one that answers with
# something else, one that hangs up. The fake peers need python3.
test_not_a_peer() {
    if ! command -v python3 >/dev/null; then
        echo "skip: no python3 for the fake peers"
        return
    fi
    local pid port
    # each fake: listen on 127.0.0.1, print the port, serve one connection, exit
    local silent='c.recv(100); time.sleep(20)'
    local talker='c.recv(100); c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n"); time.sleep(20)'
    local closer='c.close()'
    for kind in silent talker closer; do
        start "fake_$kind" 30 python3 -u -c "
import socket, time
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)
print('listening on 127.0.0.1:%d' % s.getsockname()[1])
c, _ = s.accept()
${!kind}"
        pid=$PID
        port=$(port_of "fake_$kind") || return
        local t0=$SECONDS
        run "np_$kind" 30 "$TDPIPE" send "127.0.0.1:$port" --count 1
        expect_rc "np_$kind" 3
        CHECKS=$((CHECKS + 1))
        if ((SECONDS - t0 > 6)); then
            fail "np_$kind: took $((SECONDS - t0)) s"
        fi
        kill "$pid" 2>/dev/null
        finish "fake_$kind" "$pid"
    done
    expect_in np_silent err "not a tdpipe peer"
    expect_in np_talker err "not a tdpipe peer"
    expect_in np_closer err "closed during handshake"
}

# A producer other than tdpipe send: its payload is not the pattern, so it is
# not checked (as serve does).
test_verify_fail() {
    if [[ -z $PRODUCER ]]; then
        echo "skip: no producer example"
        return
    fi
    local port rpid
    start badrecv 60 "$TDPIPE" recv --bind 127.0.0.1 --quiet
    rpid=$PID
    port=$(port_of badrecv) || return
    run producer 60 "$PRODUCER" 127.0.0.1 "$port" 3
    expect_rc producer 0
    finish badrecv "$rpid"
    expect_rc badrecv 0
    expect_in badrecv out "verify skipped (not the send pattern)"
}

# recv checks 'tdpipe send's own stream: the same schema with other bytes fails
# the check (the schema is taken from 'inspect', the bytes are all zero)
test_verify_mismatch() {
    local port ipid rpid
    start vm_inspect 60 "$TDPIPE" inspect --bind 127.0.0.1 --count 1
    ipid=$PID
    port=$(port_of vm_inspect) || return
    run vm_send 60 "$TDPIPE" send "127.0.0.1:$port" --count 1 --size 1000 --quiet
    finish vm_inspect "$ipid"
    sed -n 's/^ *json: //p' "$WORK/vm_inspect.out" >"$WORK/send_schema.json"
    head -c 1000 /dev/zero >"$WORK/zeros.raw"
    start vm_recv 60 "$TDPIPE" recv --bind 127.0.0.1 --quiet
    rpid=$PID
    port=$(port_of vm_recv) || return
    run vm_send2 60 "$TDPIPE" send "127.0.0.1:$port" --schema "$WORK/send_schema.json" \
        --file "$WORK/zeros.raw" --count 2 --quiet
    expect_rc vm_send2 0
    finish vm_recv "$rpid"
    expect_rc vm_recv 1
    expect_in vm_recv out "verify FAILED"
}

# ---- inspect ---------------------------------------------------------------------

test_inspect() {
    local port ipid
    start inspect 60 "$TDPIPE" inspect --bind 127.0.0.1 --count 2
    ipid=$PID
    port=$(port_of inspect) || return
    run send_i 60 "$TDPIPE" send "127.0.0.1:$port" --count 2 --size 1000 --quiet
    expect_rc send_i 0
    finish inspect "$ipid"
    expect_rc inspect 0
    expect_in inspect out "data: torch.float32 [250] @ 0+1000"
    expect_in inspect out "meta: (TensorDict)"
    expect_in inspect out 'source: "tdpipe"'
    expect_in inspect out 'json: {"device":"cpu","format":"tdpipe.schema"'
    expect_in inspect out "hash: "
    expect_in inspect out "message 1: 1000 bytes, schema "
    expect_in inspect out "message 2: 1000 bytes, schema "
}

# ---- real data: send --file, recv --dump, inspect --values, send --wait -----------

# make_st PATH KIND: write a safetensors file with python3 (struct and json only).
# good: nested names, eight dtypes, metadata; the others are hostile.
make_st() {
    python3 - "$1" "$2" <<'PY'
import json, struct, sys
path, kind = sys.argv[1], sys.argv[2]
def st(hdr, data):
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data
def entry(dt, shape, b, e):
    return {"dtype": dt, "shape": shape, "data_offsets": [b, e]}
if kind == "good":
    w = struct.pack("<8f", *[0.5 * i for i in range(8)])
    tensors = [("layer.0.weight", "F32", [2, 4], w),
               ("layer.0.bias", "BF16", [3], struct.pack("<3H", 0x3F80, 0x4000, 0xC040)),
               ("step", "I64", [], struct.pack("<q", -42)),
               ("mask", "BOOL", [3], bytes([1, 0, 1])),
               ("half", "F16", [2], struct.pack("<2H", 0x3C00, 0xC000)),
               ("empty", "U8", [0], b""),
               ("f8.e4m3", "F8_E4M3", [2], bytes([0x38, 0x7E])),
               ("f8.e5m2", "F8_E5M2", [2], bytes([0x3C, 0xC0]))]
    hdr, data = {"__metadata__": {"format": "pt", "note.x": "dotted key"}}, b""
    for name, dt, shape, blob in tensors:
        hdr[name] = entry(dt, shape, len(data), len(data) + len(blob))
        data += blob
    out = st(hdr, data)
elif kind == "hlen":  # a header length past the end of the file
    out = struct.pack("<Q", 1 << 40) + b'{"x":1}'
elif kind == "range":  # offsets past the data
    out = st({"x": entry("F32", [4], 0, 16)}, b"\0" * 8)
elif kind == "overlap":
    out = st({"x": entry("F32", [2], 0, 8), "y": entry("F32", [2], 4, 12)}, b"\0" * 12)
elif kind == "shape":  # shape * itemsize != end - begin
    out = st({"x": entry("F32", [3], 0, 8)}, b"\0" * 8)
elif kind == "dtype":
    out = st({"x": entry("F4", [2], 0, 1)}, b"\0")
elif kind == "short":
    out = b"\x10\0\0"
open(path, "wb").write(out)
PY
}

# same_tensors A B: the two safetensors files hold the same tensors (names,
# dtypes, shapes, bytes) and metadata, and their data sections are identical.
same_tensors() {
    python3 - "$1" "$2" <<'PY'
import json, struct, sys
def load(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    meta = h.pop("__metadata__", None)
    d = b[8 + n:]
    return {k: (v["dtype"], v["shape"], d[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in h.items()}, meta, d
a, b = load(sys.argv[1]), load(sys.argv[2])
sys.exit(0 if a == b else 1)
PY
}

test_file() {
    if ! command -v python3 >/dev/null; then
        echo "skip: no python3 to write safetensors files"
        return
    fi
    local port rpid kind
    make_st "$WORK/good.safetensors" good
    # send --file -> recv --dump: the same tensors come back, and are not
    # checked against the synthetic pattern
    start f_recv 30 "$TDPIPE" recv --bind 127.0.0.1 --dump "$WORK/dump/sub" --quiet
    rpid=$PID
    port=$(port_of f_recv) || return
    run f_send 30 "$TDPIPE" send "127.0.0.1:$port" --file "$WORK/good.safetensors" -n 2
    finish f_recv "$rpid"
    expect_rc f_send 0
    expect_in f_send out "sent 2 messages"
    expect_in f_send err "8 tensors"
    expect_rc f_recv 0
    expect_in f_recv out "received 2 messages"
    expect_in f_recv out "verify skipped (not the send pattern); end: producer closed"
    expect_in f_recv out "dumped 2 messages to $WORK/dump/sub"
    for n in 1 2; do
        CHECKS=$((CHECKS + 1))
        if ! same_tensors "$WORK/good.safetensors" "$WORK/dump/sub/msg-00000$n.safetensors"; then
            fail "recv --dump: msg-00000$n.safetensors differs from what was sent"
        fi
    done
    # the dump is a file send takes again
    start f_recv2 30 "$TDPIPE" recv --bind 127.0.0.1 --dump "$WORK/dump2" --quiet
    rpid=$PID
    port=$(port_of f_recv2) || return
    run f_send2 30 "$TDPIPE" send "127.0.0.1:$port" --file "$WORK/dump/sub/msg-000001.safetensors"
    finish f_recv2 "$rpid"
    expect_rc f_send2 0
    expect_in f_send2 out "sent 1 message " # --file sends once unless -n says otherwise
    expect_rc f_recv2 0
    CHECKS=$((CHECKS + 1))
    cmp -s "$WORK/dump/sub/msg-000001.safetensors" "$WORK/dump2/msg-000001.safetensors" ||
        fail "a dump sent again and dumped again is not byte-identical"

    # inspect --values: the first N values of each tensor, by dtype
    start f_insp 30 "$TDPIPE" inspect --bind 127.0.0.1 --values 3
    rpid=$PID
    port=$(port_of f_insp) || return
    run f_send3 30 "$TDPIPE" send "127.0.0.1:$port" --file "$WORK/good.safetensors" --quiet
    finish f_insp "$rpid"
    expect_rc f_insp 0
    expect_in f_insp out "layer.0.weight float32[2,4] = [0, 0.5, 1, ...]"
    expect_in f_insp out "layer.0.bias bfloat16[3] = [1, 2, -3]"
    expect_in f_insp out "step int64[] = [-42]"
    expect_in f_insp out "mask bool[3] = [true, false, true]"
    expect_in f_insp out "half float16[2] = [1, -2]"
    expect_in f_insp out "empty uint8[0] = []"
    expect_in f_insp out "f8.e4m3 float8_e4m3fn[2] = [1, 448]"
    expect_in f_insp out "f8.e5m2 float8_e5m2[2] = [1, -2]"
    expect_in f_insp out 'format: "pt"'
    expect_in f_insp out "producer closed after 1 message"

    # hostile files: exit 2 and what is wrong, before any connect
    for kind in hlen range overlap shape dtype short; do
        make_st "$WORK/bad_$kind.safetensors" $kind
        run "f_bad_$kind" 10 "$TDPIPE" send 127.0.0.1:1 --file "$WORK/bad_$kind.safetensors"
        expect_rc "f_bad_$kind" 2
    done
    expect_in f_bad_hlen err "header length (1099511627776 bytes) goes past the end of the file"
    expect_in f_bad_range err "tensor 'x': data_offsets [0, 16] go past the end of the data"
    expect_in f_bad_overlap err "tensors 'x' and 'y' overlap"
    expect_in f_bad_shape err "data_offsets span 8 bytes, but 3 elements of F32 take 12"
    expect_in f_bad_dtype err "tensor 'x': dtype 'F4' is not supported"
    expect_in f_bad_short err "too short for a safetensors file"
    run f_missing 10 "$TDPIPE" send 127.0.0.1:1 --file "$WORK/no-such.safetensors"
    expect_rc f_missing 2
    expect_in f_missing err "cannot open: No such file or directory"

    # a raw buffer and its schema JSON
    printf '%s\n' '{"device":"cpu","format":"tdpipe.schema","td":{"cls":"TensorDict","cls_metadata":{"batch_size":[],"device":"cpu","is_locked":false,"names":null},"leaves":{"x":["torch.int32",[3],0,12,0]},"non_tensors":{}},"total_bytes":12,"version":1}' >"$WORK/raw.json"
    python3 -c 'import struct, sys; sys.stdout.buffer.write(struct.pack("<3i", 7, -1, 5))' >"$WORK/raw.bin"
    start f_insp_raw 30 "$TDPIPE" inspect --bind 127.0.0.1 --values
    rpid=$PID
    port=$(port_of f_insp_raw) || return
    run f_send_raw 30 "$TDPIPE" send "127.0.0.1:$port" --file "$WORK/raw.bin" \
        --schema "$WORK/raw.json" --quiet
    finish f_insp_raw "$rpid"
    expect_rc f_send_raw 0
    expect_in f_insp_raw out "x int32[3] = [7, -1, 5]"
    head -c 8 "$WORK/raw.bin" >"$WORK/raw_short.bin"
    run f_raw_short 10 "$TDPIPE" send 127.0.0.1:1 --file "$WORK/raw_short.bin" \
        --schema "$WORK/raw.json"
    expect_rc f_raw_short 2
    expect_in f_raw_short err "8 bytes, but the schema's buffer (total_bytes) is 12"

    # usage: what does not go with --file; a --dump DIR that cannot be made
    run f_size 10 "$TDPIPE" send 127.0.0.1:1 --file "$WORK/good.safetensors" --size 1KB
    expect_rc f_size 2
    run f_echo 10 "$TDPIPE" send 127.0.0.1:1 --file "$WORK/good.safetensors" --echo
    expect_rc f_echo 2
    run f_schema_only 10 "$TDPIPE" send 127.0.0.1:1 --schema "$WORK/raw.json"
    expect_rc f_schema_only 2
    expect_in f_schema_only err "--schema needs --file"
    run f_dump_bad 10 "$TDPIPE" recv --bind 127.0.0.1 --dump "$WORK/good.safetensors/d"
    expect_rc f_dump_bad 2
    expect_in f_dump_bad err "--dump $WORK/good.safetensors/d: cannot create"
    run f_values_bad 10 "$TDPIPE" inspect --values=0
    expect_rc f_values_bad 2
}

# send --wait: a receiver that starts after its sender is waited for; without
# --wait a refusal fails at once and names the flag.
test_wait() {
    local port spid t0
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    t0=$SECONDS
    run w_refused 10 "$TDPIPE" send "127.0.0.1:$port" --count 1
    expect_rc w_refused 3
    expect_in w_refused err "connection refused"
    expect_in w_refused err "--wait SECONDS"
    CHECKS=$((CHECKS + 1))
    ((SECONDS - t0 <= 2)) || fail "w_refused: a refused connect took $((SECONDS - t0)) s"
    start w_send 30 "$TDPIPE" send "127.0.0.1:$port" --wait 20 --count 5 --size 4KB --quiet
    spid=$PID
    sleep 0.7
    run w_recv 30 "$TDPIPE" recv --bind 127.0.0.1 --port "$port" --quiet
    finish w_send "$spid"
    expect_rc w_send 0
    expect_in w_send out "sent 5 messages"
    expect_rc w_recv 0
    expect_in w_recv out "received 5 messages"
    expect_in w_recv out "verify ok"
    # nobody comes: refused after the wait, and said so
    run w_gone 10 "$TDPIPE" send "127.0.0.1:$port" --wait 0.3 --count 1
    expect_rc w_gone 3
    expect_in w_gone err "nothing listened there within --wait 0.3 s"
    run w_bad 10 "$TDPIPE" send "127.0.0.1:$port" --wait soon
    expect_rc w_bad 2
}

# ---- bench outputs -------------------------------------------------------------------

# --plot: the format from the name, the real cause of a failure, a non-zero
# exit; never image bytes on stdout.
test_bench_outputs() {
    local b=(bench --sizes 1KB --rounds 20 --quiet)
    run plot_ext 10 "$TDPIPE" "${b[@]}" --plot "$WORK/x.gif"
    expect_rc plot_ext 2
    expect_in plot_ext err "must end in .png or .svg"
    run plot_dir 10 "$TDPIPE" "${b[@]}" --plot "$WORK/missing/x.png"
    expect_rc plot_dir 1
    expect_in plot_dir err "cannot write in $WORK/missing: No such file or directory"
    CHECKS=$((CHECKS + 1))
    [[ -s $WORK/plot_dir.out ]] && fail "plot_dir: wrote to stdout"
    run json_dir 10 "$TDPIPE" "${b[@]}" --json "$WORK/missing/x.json"
    expect_rc json_dir 1
    expect_in json_dir err "No such file or directory"

    # gnuplot fails: its words, exit 1, no file left, the table still printed
    mkdir -p "$WORK/bin"
    printf '#!/bin/sh\ncat >/dev/null\necho "no such terminal" >&2\nexit 1\n' >"$WORK/bin/gnuplot"
    chmod +x "$WORK/bin/gnuplot"
    run plot_fail 30 env PATH="$WORK/bin:$PATH" "$TDPIPE" "${b[@]}" --plot "$WORK/f.png"
    expect_rc plot_fail 1
    expect_in plot_fail err "gnuplot failed (exit status 1)"
    expect_in plot_fail err "gnuplot: no such terminal"
    expect_in plot_fail out "1.00 KB            1000"
    CHECKS=$((CHECKS + 1))
    [[ -e $WORK/f.png ]] && fail "plot_fail: left $WORK/f.png"

    # --inflight: async sends in flight for the plain streams, on both planes; the header
    # line and the JSON say so; out of range is a usage error
    for plane in ucx shm; do
        run "infl_$plane" 60 "$TDPIPE" bench --sizes 1KB,2MB --rounds 200 --plane "$plane" \
            --no-loan --inflight 8 --json "$WORK/infl_$plane.json" --quiet
        expect_rc "infl_$plane" 0
        expect_in "infl_$plane" out "plain streams 8 in flight"
        expect_in "infl_$plane" out "2.00 MB         2000000"
        CHECKS=$((CHECKS + 1))
        grep -q '"inflight": 8' "$WORK/infl_$plane.json" || fail "infl_$plane: JSON config lacks inflight 8"
    done
    run infl_zero 10 "$TDPIPE" bench --inflight 0
    expect_rc infl_zero 2
    expect_in infl_zero err "--inflight must be 1..64"
    run infl_big 10 "$TDPIPE" bench --inflight 65
    expect_rc infl_big 2

    if ! command -v gnuplot >/dev/null; then
        echo "skip: no gnuplot"
        return
    fi
    run plot_svg 30 "$TDPIPE" "${b[@]}" --plot "$WORK/x.svg"
    expect_rc plot_svg 0
    CHECKS=$((CHECKS + 1))
    if ! grep -q "<svg" "$WORK/x.svg" 2>/dev/null || grep -q "<svg" "$WORK/plot_svg.out"; then
        fail "plot_svg: no SVG in the file, or SVG on stdout"
    fi
}

# ---- bench --server / --client on loopback ----------------------------------------

# The two-host mode on 127.0.0.1 (tests/test_netns_bench.sh runs it across
# two network namespaces where it can): the same table, JSON saying mode
# client, the options each side refuses, a client of something that is not a
# bench server.
test_bench_two_hosts() {
    local port spid
    start bsrv_once 60 "$TDPIPE" bench --server --bind 127.0.0.1 --once
    spid=$PID
    port=$(port_of bsrv_once) || return
    run bcli 60 "$TDPIPE" bench --client "127.0.0.1:$port" --sizes 1KB,200KB --rounds 20 \
        --json "$WORK/bcli.json" --quiet
    expect_rc bcli 0
    expect_in bcli out "client of 127.0.0.1:$port: server depth 4"
    expect_in bcli out "1.00 KB            1000"
    expect_in bcli out "200 KB           200000"
    finish bsrv_once "$spid"
    expect_rc bsrv_once 0
    expect_in bsrv_once err "tdpipe bench: client 127.0.0.1:"
    CHECKS=$((CHECKS + 1))
    if ! python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))
assert d["mode"] == "client" and d["peer"] == sys.argv[2], d
assert [r["bytes"] for r in d["results"]] == [1000, 200000]' \
        "$WORK/bcli.json" "127.0.0.1:$port" 2>"$WORK/bcli_json.err"; then
        fail "bcli: the JSON is not as expected"
        dump "$WORK/bcli_json.err" "$WORK/bcli.json"
    fi
    # the loopback bench's JSON says its mode too
    run bloop 60 "$TDPIPE" bench --sizes 1KB --rounds 20 --json "$WORK/bloop.json" --quiet
    expect_rc bloop 0
    CHECKS=$((CHECKS + 1))
    python3 -c 'import json,sys; d = json.load(open(sys.argv[1]))
assert d["mode"] == "loopback" and "asked for" in d["huge_pages"], d' \
        "$WORK/bloop.json" 2>/dev/null || fail "bloop: the JSON does not say mode loopback and huge pages"

    # what goes with which side
    run bsrv_sizes 10 "$TDPIPE" bench --server --sizes 1KB
    expect_rc bsrv_sizes 2
    expect_in bsrv_sizes err "--sizes is the client's to give"
    run bsrv_json 10 "$TDPIPE" bench --server --json "$WORK/s.json"
    expect_rc bsrv_json 2
    expect_in bsrv_json err "--json is the client's to give"
    run bboth 10 "$TDPIPE" bench --server --client 127.0.0.1:1
    expect_rc bboth 2
    expect_in bboth err "--server and --client exclude each other"
    run bonce 10 "$TDPIPE" bench --once
    expect_rc bonce 2
    expect_in bonce err "--once goes with --server"
    run bcli_clients 10 "$TDPIPE" bench --client 127.0.0.1:1 --clients 2
    expect_rc bcli_clients 2
    expect_in bcli_clients err "--clients starts its own server and clients on loopback"
    run bcli_bad 10 "$TDPIPE" bench --client 127.0.0.1
    expect_rc bcli_bad 2
    expect_in bcli_bad err "--client wants HOST:PORT"

    # a tdpipe peer that is not a bench server: recv takes SETUP and never answers
    start brecv 60 "$TDPIPE" recv --bind 127.0.0.1 --quiet
    spid=$PID
    port=$(port_of brecv) || return
    run bcli_recv 40 "$TDPIPE" bench --client "127.0.0.1:$port" --sizes 1KB --rounds 20 --quiet
    expect_rc bcli_recv 5
    expect_in bcli_recv err "is 127.0.0.1:$port a 'tdpipe bench --server'?"
    kill "$spid" 2>/dev/null
    finish brecv "$spid"

    # SIGTERM during a client's run: the server exits 143, the client 4
    local cpid
    start bsrv_term 60 "$TDPIPE" bench --server --bind 127.0.0.1
    spid=$PID
    port=$(port_of bsrv_term) || return
    start bcli_term 60 "$TDPIPE" bench --client "127.0.0.1:$port" --sizes 1KB --rounds 2000000 \
        --quiet
    cpid=$PID
    for _ in $(seq 100); do
        grep -q "connected" "$WORK/bsrv_term.err" && break
        sleep 0.1
    done
    sleep 0.3
    kill -TERM "$spid"
    finish bsrv_term "$spid"
    finish bcli_term "$cpid"
    expect_rc bsrv_term 143
    expect_in bsrv_term err "interrupted (SIGTERM) after 1 client"
    expect_rc bcli_term 4
    expect_in bcli_term err "the server closed the pipe mid-run"

    # SIGINT while waiting for a client: 130
    start bsrv_int 60 "$TDPIPE" bench --server --bind 127.0.0.1
    spid=$PID
    port=$(port_of bsrv_int) || return
    kill -INT "$spid"
    finish bsrv_int "$spid"
    expect_rc bsrv_int 130
    expect_in bsrv_int err "interrupted (SIGINT) after 0 clients"
}

# A bench server follows each client's --depth and measures one client at a
# time: a second client that comes meanwhile is refused at once ("busy",
# exit 3) and the first one's run goes on undisturbed; the next client gets
# the depth it asks for.
test_bench_busy() {
    local port spid cpid t0 ms
    start bsrv_busy 120 "$TDPIPE" bench --server --bind 127.0.0.1
    spid=$PID
    port=$(port_of bsrv_busy) || return
    start bcli_one 100 "$TDPIPE" bench --client "127.0.0.1:$port" --depth 2 --sizes 1KB \
        --rounds 60000 --json "$WORK/bcli_one.json" --quiet
    cpid=$PID
    for _ in $(seq 100); do
        grep -q "connected" "$WORK/bsrv_busy.err" && break
        sleep 0.1
    done
    t0=$(date +%s%N)
    run bcli_two 30 "$TDPIPE" bench --client "127.0.0.1:$port" --sizes 1KB --rounds 20 --quiet
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    expect_rc bcli_two 3
    expect_in bcli_two err "busy: a bench is running on 127.0.0.1:$port for another client, try again"
    CHECKS=$((CHECKS + 1))
    (( ms < 5000 )) || fail "bcli_two: the refusal took $ms ms"
    finish bcli_one "$cpid"
    expect_rc bcli_one 0
    expect_in bcli_one out "server depth 2"
    expect_in bsrv_busy err "depth 2, event-driven"
    run bcli_eight 60 "$TDPIPE" bench --client "127.0.0.1:$port" --depth 8 --sizes 1KB \
        --rounds 20 --json "$WORK/bcli_eight.json" --quiet
    expect_rc bcli_eight 0
    CHECKS=$((CHECKS + 1))
    if ! python3 -c 'import json,sys
for f, d in ((sys.argv[1], 2), (sys.argv[2], 8)):
    j = json.load(open(f))
    assert j["server"]["depth"] == d and j["config"]["depth"] == d, (f, j)' \
        "$WORK/bcli_one.json" "$WORK/bcli_eight.json" 2>"$WORK/bcli_depth.err"; then
        fail "bench: the JSON does not report the depths the clients asked for"
        dump "$WORK/bcli_depth.err" "$WORK/bcli_eight.json"
    fi
    kill -TERM "$spid"
    finish bsrv_busy "$spid"
    expect_rc bsrv_busy 143
    expect_in bsrv_busy err "turned away 1 client while busy"
}

# --mem cuda: GPU buffers where a CUDA device is present (`tdpipe version`
# says whether one is); otherwise a clear refusal (exit 2) before anything
# starts. The client's to give, not the server's; not with --clients.
test_bench_mem() {
    run bmem_ver 10 "$TDPIPE" version
    expect_rc bmem_ver 0
    if grep -qE '^cuda: +(driver loaded|fake), [1-9][0-9]* devices?$' "$WORK/bmem_ver.out"; then
        run bmem 120 "$TDPIPE" bench --mem cuda --sizes 1KB --rounds 20 --quiet
        expect_rc bmem 0
        expect_in bmem out "mem cuda:0"
    else
        expect_in bmem_ver out "no CUDA device"
        run bmem 120 "$TDPIPE" bench --mem cuda --sizes 1KB --rounds 20 --quiet
        expect_rc bmem 2
        expect_in bmem err "--mem cuda: no CUDA device"
        run bmem_cli 10 "$TDPIPE" bench --client 127.0.0.1:1 --mem cuda
        expect_rc bmem_cli 2
        expect_in bmem_cli err "--mem cuda: "
    fi
    # the fake device on any machine: device memory that faults when host code
    # touches it, so a device pointer handed to a UCX without CUDA crashes
    # here as it did on a GPU; the ucx plane stages it through host memory
    local tls
    for tls in "-u UCX_TLS" "UCX_TLS=tcp"; do
        # shellcheck disable=SC2086 # two words for env: -u NAME, or one NAME=value
        run bmem_fake 240 env $tls TDPIPE_CUDA=fake \
            "$TDPIPE" bench --mem cuda --plane ucx --sizes 1KB,1MB,100MB --rounds 20 --quiet
        expect_rc bmem_fake 0
        expect_in bmem_fake out "plane ucx"
        expect_in bmem_fake out "mem cuda:0"
        expect_in bmem_fake out "1.00 MB         1000000"
        expect_in bmem_fake out "100 MB        100000000"
    done
    run bmem_srv 10 "$TDPIPE" bench --server --mem cuda
    expect_rc bmem_srv 2
    expect_in bmem_srv err "--mem is the client's to give"
    run bmem_clients 10 "$TDPIPE" bench --clients 2 --mem cuda
    expect_rc bmem_clients 2
    run bmem_bad 10 "$TDPIPE" bench --mem gpu
    expect_rc bmem_bad 2
    expect_in bmem_bad err "--mem is cpu or cuda[:N], not 'gpu'"
}

# --mem cuda over the shm plane on the fake device (its device memory faults
# when host code touches it): GPU payloads staged through the slots, small,
# multi-chunk and 100 MB, with and without loans on the host side.
test_bench_mem_fake() {
    local v p
    for p in shm cuda-ipc; do
        for v in loan no_loan; do
            run "bfake_${p}_$v" 120 env TDPIPE_CUDA=fake "$TDPIPE" bench --mem cuda --plane "$p" \
                --sizes 1KB,1MB,100MB --rounds 5 $([[ $v == no_loan ]] && echo --no-loan)
            expect_rc "bfake_${p}_$v" 0
            expect_in "bfake_${p}_$v" out "mem cuda:0"
            expect_in "bfake_${p}_$v" out "plane $p"
            expect_in "bfake_${p}_$v" out "100 MB"
        done
    done
    # the cuda-ipc plane lends device slots: a hand-off rate beside the plain sends
    expect_in bfake_cuda-ipc_loan out "hand-off"
    # TDPIPE_CUDA_STATS: each process counts its CUDA calls and prints them at exit
    run bfake_stats 120 env TDPIPE_CUDA=fake TDPIPE_CUDA_STATS=1 "$TDPIPE" bench --mem cuda \
        --plane cuda-ipc --sizes 1KB --rounds 20 --quiet
    expect_rc bfake_stats 0
    expect_in bfake_stats err "tdpipe cuda stats (pid "
    expect_in bfake_stats err "export calls "
    expect_in bfake_stats err "import calls "
    expect_in bfake_stats err "memcpy calls "
}

# ---- serve -----------------------------------------------------------------------

test_serve() {
    local port spid
    # echo: ends by itself after --count messages
    start serve_echo 60 "$TDPIPE" serve --bind 127.0.0.1 --mode echo --count 20 --quiet
    spid=$PID
    port=$(port_of serve_echo) || return
    run send_echo 60 "$TDPIPE" send "127.0.0.1:$port" --echo --count 20 --size 64KB --quiet
    expect_rc send_echo 0
    expect_in send_echo out "sent 20 messages"
    expect_in send_echo out "round trip:"
    finish serve_echo "$spid"
    expect_rc serve_echo 0
    expect_in serve_echo out "client 1 connected from 127.0.0.1:"
    expect_in serve_echo out ", plane "
    expect_in serve_echo out "stopping: 20 messages handled"
    expect_in serve_echo out "served 1 client in"
    expect_in serve_echo out "20 messages in"

    # sink: two clients, verified, then SIGINT
    start serve_sink 60 "$TDPIPE" serve --bind 127.0.0.1 --mode sink --quiet
    spid=$PID
    port=$(port_of serve_sink) || return
    run sink1 60 "$TDPIPE" send "127.0.0.1:$port" --count 30 --size 10KB --quiet
    expect_rc sink1 0
    run sink2 60 "$TDPIPE" send "127.0.0.1:$port" --count 30 --size 10KB --quiet
    expect_rc sink2 0
    kill -INT "$spid"
    finish serve_sink "$spid"
    expect_rc serve_sink 0
    expect_in serve_sink out "stopping: SIGINT"
    expect_in serve_sink out "served 2 clients"
    expect_in serve_sink out "60 messages in"
    expect_in serve_sink out "verify ok; depth 4"

    # --max-clients: one over the limit is refused (3); --duration ends it
    start serve_one 60 "$TDPIPE" serve --bind 127.0.0.1 --mode sink --max-clients 1 \
        --duration 4 --quiet
    spid=$PID
    port=$(port_of serve_one) || return
    start holder 60 "$TDPIPE" send "127.0.0.1:$port" --count 40 --rate 20 --size 1KB --quiet
    local hpid=$PID
    sleep 0.5
    run over 30 "$TDPIPE" send "127.0.0.1:$port" --count 1 --quiet
    expect_rc over 3
    finish holder "$hpid"
    expect_rc holder 0
    finish serve_one "$spid"
    expect_rc serve_one 0
    expect_in serve_one out "stopping: 4 s elapsed"

    # the limits and keepalive flags reach a working server and client
    start serve_lim 60 "$TDPIPE" serve --bind 127.0.0.1 --mode sink --max-pending 4 \
        --max-per-source 2 --idle-timeout 2000 --keepalive 2,1,3 --quiet
    spid=$PID
    port=$(port_of serve_lim) || return
    run lim_send 30 "$TDPIPE" send "127.0.0.1:$port" --count 10 --rate 50 --size 1KB \
        --keepalive 2,1,3 --quiet
    expect_rc lim_send 0
    kill -INT "$spid"
    finish serve_lim "$spid"
    expect_rc serve_lim 0
    expect_in serve_lim out "10 messages in"
}

# ---- live figures: rate lines and --json --------------------------------------------

# json_check NAME FILE CODE: FILE (a path) holds one JSON object (d) for which
# the Python CODE (asserts) holds; "-" in FILE's place: the last line of
# NAME's stdout.
json_check() {
    local name=$1 file=$2 code=$3 out
    CHECKS=$((CHECKS + 1))
    if [[ $file == - ]]; then
        file=$WORK/$name.last
        tail -n 1 "$WORK/$name.out" >"$file"
    fi
    if ! out=$(/usr/bin/python3 -c "import json,sys
d = json.load(open(sys.argv[1]))
$code" "$file" 2>&1); then
        fail "$name: JSON check failed: $out"
        dump "$WORK/$name.out" "$WORK/$name.err"
    fi
}

# count_lines NAME out|err REGEX: how many lines of NAME's output match
count_lines() {
    grep -cE -- "$3" "$WORK/$1.$2" || true
}

# A receiver that keeps up costs no credit waits, whatever the plane: a
# rate-limited sender sleeps between sends, and the releases that came back
# meanwhile count before a send is said to wait (on the shm plane they used
# to sit in the ring: 4 of 20 sends "waited")
test_credit_kept_up() {
    local port rpid plane
    for plane in shm ucx; do
        start ku_recv_$plane 60 "$TDPIPE" recv --bind 127.0.0.1 --count 20 --plane "$plane"
        rpid=$PID
        port=$(port_of ku_recv_$plane) || return
        run ku_send_$plane 60 "$TDPIPE" send "127.0.0.1:$port" --count 20 --size 1000 --rate 20 \
            --plane "$plane" --depth-hint --quiet
        expect_rc ku_send_$plane 0
        finish ku_recv_$plane "$rpid"
        expect_in ku_send_$plane out "credit waits: 0 of 20 sends"
    done
}

test_live() {
    local port rpid spid n out
    # --json on both ends; rate-limited send with --interval: rate lines as JSON
    start live_recv 60 "$TDPIPE" recv --bind 127.0.0.1 --json --count 12
    rpid=$PID
    port=$(port_of live_recv) || return
    run live_send 60 "$TDPIPE" send "127.0.0.1:$port" --count 12 --size 4KB --rate 15 \
        --interval 0.2 --json
    expect_rc live_send 0
    finish live_recv "$rpid"
    expect_rc live_recv 0
    CHECKS=$((CHECKS + 1))
    if [[ $(wc -l <"$WORK/live_send.out") != 1 ]]; then
        fail "live_send: --json stdout is not one line"
        dump "$WORK/live_send.out"
    fi
    json_check live_send - '
assert d["cmd"] == "send" and d["msgs"] == 12 and d["bytes"] == 12 * 4000, d
assert d["size"] == 4000 and d["end"] == "ok" and d["plane"] in ("ucx", "shm"), d
assert 0.5 < d["elapsed_s"] < 30 and 5 < d["msgs_per_s"] < 20, d
assert d["bytes_per_s"] > 0 and d["credit_waits"] >= 0 and d["peer"].startswith("127.0.0.1:"), d
assert d["prepare_ms"] is not None and d["prepare_ms"] >= 0, d  # the layout went first
h = d["send_ns"]
assert h["count"] == 12 and 0 < h["min"] <= h["p50"] <= h["p99"] <= h["p999"] <= h["max"], h
assert h["max"] < 10e9 and h["min"] <= h["mean"] <= h["max"], h
assert "rtt_ns" not in d, d'
    n=$(count_lines live_send err '^\{"cmd":"send",')
    CHECKS=$((CHECKS + 1))
    if ((n < 2)); then
        fail "live_send: $n JSON rate lines with --interval 0.2 over 0.8 s"
        dump "$WORK/live_send.err"
    fi
    grep -E '^\{' "$WORK/live_send.err" | head -n 1 >"$WORK/live_rate.json"
    json_check live_send "$WORK/live_rate.json" '
assert d["cmd"] == "send" and 0 < d["elapsed_s"] < 30 and 0 <= d["msgs"] <= 12, d
for k in ("bytes", "msgs_per_s", "bytes_per_s", "credit_waits"):
    assert k in d and d[k] >= 0, (k, d)'
    json_check live_recv - '
assert d["cmd"] == "recv" and d["msgs"] == 12 and d["bytes"] == 12 * 4000, d
assert d["verify"] == "ok" and d["bad"] == 0 and d["depth"] == 4, d
assert d["end"] in ("count reached", "producer closed") and d["resumed_from"] == 0, d
assert d["elapsed_s"] > 0 and d["msgs_per_s"] > 0 and d["plane"] in ("ucx", "shm"), d
h = d["recv_wait_ns"]
assert h["count"] >= 12 and h["min"] <= h["p50"] <= h["p99"] <= h["max"], h'
    expect_in live_recv out "listening on 127.0.0.1:"

    # --no-prepare, and a single message: the layout goes with the first message
    local how
    for how in "--count 3 --no-prepare" "--count 1"; do
        start live_np_recv 60 "$TDPIPE" recv --bind 127.0.0.1 --quiet
        rpid=$PID
        port=$(port_of live_np_recv) || return
        # shellcheck disable=SC2086
        run live_np 60 "$TDPIPE" send "127.0.0.1:$port" --size 4KB --json $how
        expect_rc live_np 0
        finish live_np_recv "$rpid"
        expect_rc live_np_recv 0
        json_check live_np - '
assert d["end"] == "ok" and d["prepare_ms"] is None, d'
    done

    # sends in flight: by default for small messages, each checked by recv
    local nfl
    for nfl in "" "--inflight 3" "--inflight 1"; do
        start live_fl_recv 60 "$TDPIPE" recv --bind 127.0.0.1 --count 500 --json
        rpid=$PID
        port=$(port_of live_fl_recv) || return
        # shellcheck disable=SC2086
        run live_fl 60 "$TDPIPE" send "127.0.0.1:$port" --size 1KB --count 500 --json $nfl
        expect_rc live_fl 0
        finish live_fl_recv "$rpid"
        expect_rc live_fl_recv 0
        json_check live_fl - "
want = {'': 64, '--inflight 3': 3, '--inflight 1': 1}['$nfl']
assert d['end'] == 'ok' and d['msgs'] == 500 and d['inflight'] == want, d"
        json_check live_fl_recv - '
assert d["msgs"] == 500 and d["verify"] == "ok" and d["bad"] == 0, d'
    done
    run live_fl_bad 10 "$TDPIPE" send 127.0.0.1:1 --inflight 0
    expect_rc live_fl_bad 2

    # text rate lines with --interval; none by default when stderr is a file
    start live_recv2 60 "$TDPIPE" recv --bind 127.0.0.1 --interval 0.2
    rpid=$PID
    port=$(port_of live_recv2) || return
    run live_text 60 "$TDPIPE" send "127.0.0.1:$port" --count 8 --size 4KB --rate 10 \
        --interval 0.2
    expect_rc live_text 0
    finish live_recv2 "$rpid"
    expect_rc live_recv2 0
    start live_recv3 60 "$TDPIPE" recv --bind 127.0.0.1
    rpid=$PID
    port=$(port_of live_recv3) || return
    run live_plain 60 "$TDPIPE" send "127.0.0.1:$port" --count 8 --size 4KB --rate 10
    expect_rc live_plain 0
    finish live_recv3 "$rpid"
    expect_rc live_recv3 0
    n=$(count_lines live_text err '^send: [0-9.]+ s, [0-9]+ messages?, [0-9]+ msgs/s, .*/s, [0-9]+ credit waits?$')
    CHECKS=$((CHECKS + 1))
    if ((n < 2)); then
        fail "live_text: $n rate lines with --interval 0.2 over 0.7 s"
        dump "$WORK/live_text.err"
    fi
    n=$(count_lines live_recv2 err '^recv: [0-9.]+ s, [0-9]+ messages?, [0-9]+ msgs/s')
    CHECKS=$((CHECKS + 1))
    if ((n < 2)); then
        fail "live_recv2: $n rate lines with --interval 0.2"
        dump "$WORK/live_recv2.err"
    fi
    n=$(($(count_lines live_plain err 'msgs/s') + $(count_lines live_recv3 err 'msgs/s')))
    CHECKS=$((CHECKS + 1))
    if ((n != 0)); then
        fail "live_plain: $n rate lines with stderr not a terminal and no --interval"
        dump "$WORK/live_plain.err" "$WORK/live_recv3.err"
    fi
    expect_in live_text out "send time: min "
    expect_in live_text out ", p99.9 "
    # a negative interval is a usage error
    run live_bad 10 "$TDPIPE" send 127.0.0.1:1 --interval -1
    expect_rc live_bad 2
    expect_in live_bad err "invalid interval '-1'"

    # serve --json: every line after 'listening on' is an object; --echo's round trips
    start live_serve 60 "$TDPIPE" serve --bind 127.0.0.1 --json --count 10 --interval 0
    spid=$PID
    port=$(port_of live_serve) || return
    run live_echo 60 "$TDPIPE" send "127.0.0.1:$port" --echo --count 10 --size 8KB --json
    expect_rc live_echo 0
    finish live_serve "$spid"
    expect_rc live_serve 0
    json_check live_echo - '
assert d["cmd"] == "send" and d["msgs"] == 10 and d["end"] == "ok", d
h = d["rtt_ns"]
assert h["count"] == 10 and 0 < h["min"] <= h["p50"] <= h["p99"] <= h["p999"] <= h["max"], h
assert d["send_ns"]["count"] == 10, d'
    tail -n +2 "$WORK/live_serve.out" >"$WORK/live_serve.lines"
    CHECKS=$((CHECKS + 1))
    if ! out=$(/usr/bin/python3 -c '
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
kinds = [e["event"] for e in ev]
assert kinds[0] == "connect" and kinds[-1] == "summary", kinds
assert set(kinds) == {"connect", "close", "stopping", "summary"}, kinds
c = [e for e in ev if e["event"] == "connect"][0]
assert c["client"] == 1 and c["peer"].startswith("127.0.0.1:") and c["plane"], c
x = [e for e in ev if e["event"] == "close"][0]
assert x["client"] == 1 and x["status"] == "clean" and x["msgs"] == 10, x
assert x["bytes"] == 80000 and x["mode"] == "echo", x
s = [e for e in ev if e["event"] == "stopping"][0]
assert s["why"] == "10 messages handled", s
d = ev[-1]
assert d["cmd"] == "serve" and d["clients"] == 1 and d["msgs_in"] == 10, d
assert d["msgs_out"] == 10 and d["bytes_in"] == 80000 and d["depth"] == 4, d
assert d["elapsed_s"] > 0 and d["refused"] == 0 and d["verify"] == "off", d
' "$WORK/live_serve.lines" 2>&1); then
        fail "live_serve: JSON lines: $out"
        dump "$WORK/live_serve.out" "$WORK/live_serve.err"
    fi
    n=$(count_lines live_serve err 'msgs/s|"cmd"')
    CHECKS=$((CHECKS + 1))
    if ((n != 0)); then
        fail "live_serve: $n rate lines with --interval 0"
        dump "$WORK/live_serve.err"
    fi
}

# ---- defaults that work together ---------------------------------------------------

# pair NAME RECEIVER... -- SENDER-ARGS...: start the receiver on 127.0.0.1, run
# `send` against it (NAME_send), stop a server with SIGINT, record both.
pair() {
    local name=$1 recv=() port pid
    shift
    while [[ $1 != -- ]]; do
        recv+=("$1")
        shift
    done
    shift
    start "$name" 30 "$TDPIPE" "${recv[@]}" --bind 127.0.0.1
    pid=$PID
    port=$(port_of "$name") || return
    run "${name}_send" 30 "$TDPIPE" send "127.0.0.1:$port" --quiet "$@"
    [[ ${recv[0]} == serve ]] && kill -INT "$pid" 2>/dev/null
    finish "$name" "$pid"
}

# Each receiver with its defaults works with `send`, or both fail at once
# saying which flag to change.
test_defaults() {
    pair d_serve serve --quiet -- --count 5 --size 1KB
    expect_rc d_serve_send 0
    expect_rc d_serve 0
    expect_in d_serve out "5 messages (5.00 KB), sunk"
    expect_in d_serve out "verify ok"

    pair d_serve_echo serve --quiet -- --count 5 --size 1KB --echo
    expect_rc d_serve_echo_send 0
    expect_in d_serve_echo_send out "round trip:"
    expect_in d_serve_echo out "5 messages (5.00 KB), echoed"

    pair d_inspect inspect -- --count 3 --size 1KB
    expect_rc d_inspect_send 0
    expect_rc d_inspect 0
    expect_in d_inspect out "message 3: 1000 bytes"
    expect_in d_inspect out "producer closed after 3 messages"

    pair d_recv_echo recv --quiet -- --count 5 --size 1KB --echo
    expect_rc d_recv_echo_send 2
    expect_in d_recv_echo_send err "receiver (tdpipe recv) does not send messages back"
    expect_in d_recv_echo_send err "drop --echo"
    expect_rc d_recv_echo 1
    expect_in d_recv_echo err "waits for each message to come back"

    pair d_inspect_echo inspect -- --count 5 --size 1KB --echo
    expect_rc d_inspect_echo_send 2
    expect_in d_inspect_echo_send err "drop --echo"
    expect_rc d_inspect_echo 1

    pair d_sink_echo serve --mode sink --quiet -- --count 5 --size 1KB --echo
    expect_rc d_sink_echo_send 2
    expect_in d_sink_echo_send err "drop --echo, or start the server with '--mode auto'"
    expect_in d_sink_echo out "client 1 closed: refused"

    # more than the default window lets the sender have in flight: it waits for the refusal
    pair d_echo_sink serve --mode echo --quiet -- --count 500 --size 1KB
    expect_rc d_echo_sink_send 2
    expect_in d_echo_sink_send err "add --echo"
    expect_in d_echo_sink out "client 1 closed: refused"
}

# ---- interruption ----------------------------------------------------------------------

# SIGINT/SIGTERM: a clean close, the summary, exit 128 + signal.
test_signals() {
    local port rpid spid
    # the receiver is interrupted: it closes cleanly, the sender hears so
    start sig_recv 30 "$TDPIPE" recv --bind 127.0.0.1 --quiet
    rpid=$PID
    port=$(port_of sig_recv) || return
    start sig_recv_send 30 "$TDPIPE" send "127.0.0.1:$port" --rate 100 --count 1000 --size 1KB \
        --quiet
    spid=$PID
    sleep 0.5
    kill -INT "$rpid"
    finish sig_recv "$rpid"
    finish sig_recv_send "$spid"
    expect_rc sig_recv 130
    expect_in sig_recv out "end: interrupted (SIGINT)"
    expect_in sig_recv out "verify ok"
    expect_rc sig_recv_send 4
    expect_in sig_recv_send err "the receiver closed the stream"

    # the sender is interrupted: it closes cleanly, the receiver ends with 0
    start sig_send_recv 30 "$TDPIPE" recv --bind 127.0.0.1 --quiet
    rpid=$PID
    port=$(port_of sig_send_recv) || return
    start sig_send 30 "$TDPIPE" send "127.0.0.1:$port" --rate 100 --count 1000 --size 1KB --quiet
    spid=$PID
    sleep 0.5
    kill -TERM "$spid"
    finish sig_send "$spid"
    finish sig_send_recv "$rpid"
    expect_rc sig_send 143
    expect_in sig_send err "interrupted (SIGTERM)"
    expect_in sig_send out "sent "
    expect_rc sig_send_recv 0
    expect_in sig_send_recv out "end: producer closed"

    # nobody connected yet
    start sig_inspect 30 "$TDPIPE" inspect --bind 127.0.0.1
    rpid=$PID
    port_of sig_inspect >/dev/null || return
    kill -INT "$rpid"
    finish sig_inspect "$rpid"
    expect_rc sig_inspect 130
    expect_in sig_inspect err "interrupted (SIGINT) before a producer connected"

    # UCX's own warnings stay quiet unless asked for (-v) or set (UCX_LOG_LEVEL)
    run ucx_quiet 10 env -u UCX_LOG_LEVEL UCX_TLS=bogus "$TDPIPE" recv --bind 127.0.0.1
    expect_rc ucx_quiet 1
    CHECKS=$((CHECKS + 1))
    if grep -q "UCX  WARN\|UCX  ERROR" "$WORK/ucx_quiet.out" "$WORK/ucx_quiet.err"; then
        fail "ucx_quiet: UCX's log reached the terminal"
        dump "$WORK/ucx_quiet.out" "$WORK/ucx_quiet.err"
    fi
    # and with -v it goes to stderr, never into the results on stdout
    run ucx_loud 10 env -u UCX_LOG_LEVEL UCX_TLS=bogus "$TDPIPE" -v recv --bind 127.0.0.1
    expect_in ucx_loud err "UCX  WARN: transport 'bogus' is not available"
    CHECKS=$((CHECKS + 1))
    if grep -q "UCX" "$WORK/ucx_loud.out"; then
        fail "ucx_loud: UCX's log on stdout"
        dump "$WORK/ucx_loud.out"
    fi
}

# ---- send to several receivers: each gets and checks every message --------------

test_fanout_send() {
    local pl i port to=() pids=()
    for pl in ucx shm; do
        to=()
        pids=()
        for i in 1 2 3; do
            start fo_recv_${pl}_$i 60 "$TDPIPE" recv --bind 127.0.0.1 --plane "$pl" --quiet
            pids+=("$PID")
            port=$(port_of fo_recv_${pl}_$i) || return
            to+=(--to "127.0.0.1:$port")
        done
        run fo_send_$pl 60 "$TDPIPE" send "${to[@]}" --plane "$pl" --size 100KB --count 300 --rate 2000 \
            --interval 0.05 --json
        expect_rc fo_send_$pl 0
        expect_in fo_send_$pl out '"mode":"broadcast"'
        expect_in fo_send_$pl err '"peers":[{'
        CHECKS=$((CHECKS + 1))
        if [[ $(grep -o '"msgs":300,' "$WORK/fo_send_$pl.out" | wc -l) -ne 4 ]]; then
            fail "fo_send_$pl: not 300 messages to each of 3 receivers and in all"
            dump "$WORK/fo_send_$pl.out"
        fi
        for i in 1 2 3; do
            finish fo_recv_${pl}_$i "${pids[$((i - 1))]}"
            expect_rc fo_recv_${pl}_$i 0
            expect_in fo_recv_${pl}_$i out "received 300 messages"
            expect_in fo_recv_${pl}_$i out "verify ok"
        done
    done
    # several receivers do not take --echo
    run fo_echo 10 "$TDPIPE" send --to 127.0.0.1:1 --to 127.0.0.1:2 --echo
    expect_rc fo_echo 2
}

# --distribute: each message to one receiver; the shares add up to the count
test_fanout_distribute() {
    local i port to=() pids=() total=0 n
    for i in 1 2 3; do
        start fd_recv_$i 60 "$TDPIPE" recv --bind 127.0.0.1 --no-verify --quiet
        pids+=("$PID")
        port=$(port_of fd_recv_$i) || return
        to+=(--to "127.0.0.1:$port")
    done
    run fd_send 60 "$TDPIPE" send "${to[@]}" --distribute --size 100KB --count 300 --json
    expect_rc fd_send 0
    expect_in fd_send out '"mode":"distribute"'
    expect_in fd_send out '"peers":[{'
    for i in 1 2 3; do
        finish fd_recv_$i "${pids[$((i - 1))]}"
        expect_rc fd_recv_$i 0
        n=$(sed -n 's/^received \([0-9]*\) messages.*/\1/p' "$WORK/fd_recv_$i.out")
        total=$((total + ${n:-0}))
    done
    CHECKS=$((CHECKS + 1))
    if [[ $total -ne 300 ]]; then
        fail "fd_send: the receivers got $total messages in all, not 300"
    fi
    # --distribute needs two or more receivers; it is not a single-pipe option
    run fd_one 10 "$TDPIPE" send --to 127.0.0.1:1 --distribute
    expect_rc fd_one 2
    expect_in fd_one err "name two or more"
    run fd_plain 10 "$TDPIPE" send 127.0.0.1:1 --distribute
    expect_rc fd_plain 2
    run fd_echo 10 "$TDPIPE" send --to 127.0.0.1:1 --to 127.0.0.1:2 --distribute --echo
    expect_rc fd_echo 2
}

# bench --fanout N: loaned and plain broadcasts to N consumers, figures per size; refusals
test_bench_fanout() {
    run bfo 120 "$TDPIPE" bench --fanout 3 --sizes 1KB,64KB --rounds 10 --quiet \
        --json "$WORK/bfo.json"
    expect_rc bfo 0
    expect_in bfo out "fan-out broadcast to 3 consumers"
    expect_in bfo out "64.0 KB    loan"
    expect_in bfo out "64.0 KB    plain"
    CHECKS=$((CHECKS + 1))
    if ! python3 - "$WORK/bfo.json" <<'PY'; then
import json, sys
r = json.load(open(sys.argv[1]))
assert r["mode"] == "fanout" and r["consumers"] == 3, r
rows = r["results"]
assert [(x["size"], x["send"]) for x in rows] == [(1000, "loan"), (1000, "plain"),
                                                  (64000, "loan"), (64000, "plain")], rows
for x in rows:
    assert x["msgs"] == 10 and x["bytes_per_s_per_consumer"] > 0, x
    assert 0 < x["p50_all_ns"] <= x["p50_last_ns"] < 60e9, x
    agg, one = x["bytes_per_s_aggregate"], x["bytes_per_s_per_consumer"]
    assert x["rss_bytes"] > 0 and abs(agg - 3 * one) <= 1e-6 * agg, x
PY
        fail "bfo: the JSON figures are not what --fanout 3 should write"
        dump "$WORK/bfo.json"
    fi
    run bfo_nl 60 "$TDPIPE" bench --fanout 2 --sizes 1KB --rounds 10 --no-loan --quiet
    expect_rc bfo_nl 0
    CHECKS=$((CHECKS + 1))
    if grep -q " loan " "$WORK/bfo_nl.out"; then
        fail "bfo_nl: --no-loan still measured loans"
    fi
    run bfo_zero 10 "$TDPIPE" bench --fanout 0
    expect_rc bfo_zero 2
    run bfo_many 10 "$TDPIPE" bench --fanout 65
    expect_rc bfo_many 2
    run bfo_clients 10 "$TDPIPE" bench --fanout 2 --clients 2
    expect_rc bfo_clients 2
    expect_in bfo_clients err "does not go with --clients"
    run bfo_fanin 10 "$TDPIPE" bench --fanout 2 --fanin 2
    expect_rc bfo_fanin 2
    run bfo_server 10 "$TDPIPE" bench --fanout 2 --server
    expect_rc bfo_server 2
    run bfo_mem 10 "$TDPIPE" bench --fanout 2 --mem cpu
    expect_rc bfo_mem 2
}

# --fanin N: producers as pipes of the bench's process, and with
# --fanin-procs as processes of their own; the JSON says which, and the
# figures are real (a consumer that timed what it received).
test_bench_fanin() {
    local mode
    for mode in pipes procs; do
        local extra=()
        [[ $mode == procs ]] && extra=(--fanin-procs)
        run "bfi_$mode" 120 "$TDPIPE" bench --fanin 2 --sizes 4KB --rounds 400 --quiet \
            "${extra[@]}" --json "$WORK/bfi_$mode.json"
        expect_rc "bfi_$mode" 0
        if [[ $mode == procs ]]; then
            expect_in "bfi_$mode" out "producers in processes of their own"
        else
            expect_in "bfi_$mode" out "producers on one loop of one process"
        fi
        CHECKS=$((CHECKS + 1))
        if ! python3 - "$WORK/bfi_$mode.json" "$mode" <<'PY'; then
import json, sys
r = json.load(open(sys.argv[1]))
assert r["mode"] == "fanin" and r["producers"] == 2 and r["messages"] == 400, r
assert r["producer_processes"] == (sys.argv[2] == "procs"), r
assert r["size"] == 4000 and r["one_producer_bytes_per_s"] > 0 and r["fanin_bytes_per_s"] > 0, r
one, many = r["one_producer_bytes_per_s"], r["fanin_bytes_per_s"]
assert abs(r["ratio_to_one"] - many / one) <= 1e-6 * r["ratio_to_one"], r
PY
            fail "bfi_$mode: the JSON figures are not what --fanin 2 should write"
            dump "$WORK/bfi_$mode.json"
        fi
    done
    run bfi_alone 10 "$TDPIPE" bench --fanin-procs
    expect_rc bfi_alone 2
    expect_in bfi_alone err "goes with --fanin N"
    run bfi_fanout 10 "$TDPIPE" bench --fanout 2 --fanin-procs
    expect_rc bfi_fanout 2
}

test_usage
test_signals
test_peer_killed
test_clean_end_tcp
test_secret
test_reconnect
test_defaults
test_recv_send
test_recv_window
test_recv_producers
test_checksum_and_cap
test_recv_count
test_sizes
test_ipv6
test_errors
test_not_a_peer
test_verify_fail
test_verify_mismatch
test_inspect
test_file
test_wait
test_bench_outputs
test_bench_two_hosts
test_bench_busy
test_bench_mem
test_bench_mem_fake
test_serve
test_credit_kept_up
test_live
test_fanout_send
test_fanout_distribute
test_bench_fanout
test_bench_fanin

if [[ $FAILS -ne 0 ]]; then
    echo "test_cli: $FAILS of $CHECKS checks failed"
    exit 1
fi
echo "test_cli: all $CHECKS checks passed"
