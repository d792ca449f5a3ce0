#!/usr/bin/env bash
# gpu-check.sh: everything the GPU targets need, in one call on a machine
# with a GPU (docs/gpu.md). It
#   1. builds in build-gpu/ (-DTDP_CUDA=ON), with the Debian packages that
#      .gpu/env.sh brings where the machine lacks them (../shared/gpu/pack);
#   2. runs the GPU test suites on the real device (the pipe conformance
#      suite in device mode on every plane, the CUDA layer, staging, the
#      CLI), or the whole suite with --full;
#   3. (after 4 and 5, so that the figures come first) runs the Python
#      package's GPU tests and GPU example
#      (tests/python/test_gpu.py, examples/python/gpu_dataloader.py: torch
#      CUDA tensors on every plane, loans on cuda-ipc) with the interpreter
#      the package was built for; their torch cases need that Python's
#      torch to have CUDA (TDP_PYTHON=/path/to/python3 picks it; else the
#      first python3 on PATH with torch, NumPy and pytest);
#   4. runs `tdpipe bench --mem cuda` on each plane from 1 KB to 1 GB, the
#      same plane with host memory, and UCX over TCP both ways;
#   5. measures the copy limits in the same run (tdp_gpu_copy, and the
#      latency of one small copy: --lat), where a 1 KB ping-pong's time
#      goes on each plane (TDPIPE_BENCH_PHASES), and the
#      same-host hand-off peers (tdp_gpu_ipc: a pool exported once and a
#      CPU-side stream wait per message; PyTorch's CUDA IPC through
#      torch.multiprocessing, bench/torch_cuda_ipc.py, where torch has
#      CUDA), and prints one table with tdpipe's ratios to them;
#   5a. 1 KB on each plane with small host-to-device writes done by the
#      device (the default) and by the copy engine (TDPIPE_CUDA_INLINE=0);
#   5b. on the host side, what 2 vCPUs could not show: the fan-out hand-off
#      from idle to 1 and 4 consumers against the wake-up floor
#      (tdp_fanout_bench --floor), and 100 MB first sends with and without
#      huge pages;
#   6. last, runs one bench per plane under compute-sanitizer memcheck,
#      side by side with 3 (neither gives figures), so a slow sanitizer
#      cannot keep the figures out. It ends with the seconds each stage took.
# Every stage has a time limit.
# Meant to finish in under 5 minutes on a 16-core machine. Exit status:
# non-zero when a stage failed (every stage runs regardless).
#
#   scripts/gpu-check.sh [--full] [--quick] [--fake] [--out DIR]
#     --full   the whole ctest suite instead of the GPU suites
#     --fake   run it all on the fake device (TDPIPE_CUDA=fake): checks the
#              script and the paths on a machine without a GPU; its figures
#              say nothing of a GPU
#     --quick  sizes 1 KB and 1 MB only (no 100 MB / 1 GB)
#     --out    where the JSON and logs go (default build-gpu/gpu-check)
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1

FULL=0 QUICK=0 FAKE=0 OUT=
while [[ $# -gt 0 ]]; do
    case $1 in
    --full) FULL=1 ;;
    --quick) QUICK=1 ;;
    --fake) FAKE=1 ;;
    --out) OUT=$2; shift ;;
    *) echo "usage: $0 [--full] [--quick] [--fake] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done

if ! pkg-config --exists ucx libevent jansson libxxhash libsodium cmocka 2>/dev/null &&
    [[ -f .gpu/env.sh ]]; then
    # shellcheck disable=SC1091
    source .gpu/env.sh
fi
B=build-gpu
OUT=${OUT:-$B/gpu-check}
mkdir -p "$OUT"
JOBS=$(nproc 2>/dev/null || echo 4)
FAILED=()
T0=$SECONDS
STAGES=() STAGE_AT=()
say() { # a stage begins: its name, and the seconds since the start
    printf '\n== %s (%ds)\n' "$*" $((SECONDS - T0))
    STAGES+=("$*")
    STAGE_AT+=($((SECONDS - T0)))
}

say "build"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
# the Python package is built for TDP_PYTHON, else for the first python3
# on PATH that has torch, NumPy and pytest (a GPU machine's torch often
# lives in a virtual environment, not in /usr/bin/python3)
if [[ -z ${TDP_PYTHON:-} ]]; then
    for c in $(type -ap python3) /usr/bin/python3; do
        if "$c" -c 'import torch, numpy, pytest' >/dev/null 2>&1; then
            TDP_PYTHON=$c
            break
        fi
    done
fi
pyexe=()
[[ -n ${TDP_PYTHON:-} ]] && pyexe=(-DPython3_EXECUTABLE="$TDP_PYTHON")
if ! cmake -S . -B "$B" "${gen[@]}" -DTDP_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo "${pyexe[@]}" \
    >"$OUT/cmake.log" 2>&1 || ! cmake --build "$B" -j"$JOBS" >"$OUT/build.log" 2>&1; then
    tail -30 "$OUT/cmake.log" "$OUT/build.log"
    echo "gpu-check: the build failed" >&2
    exit 1
fi
TDPIPE=$B/tools/tdpipe
if [[ $FAKE -eq 1 ]]; then
    export TDPIPE_CUDA=fake
else
    export TDPIPE_CUDA=driver
fi
"$TDPIPE" version | sed 's/^/  /'
if ! "$TDPIPE" version | grep -Eq "cuda: *(driver loaded|fake)"; then
    echo "gpu-check: no GPU through the driver here; nothing to check (--fake runs on the fake)" >&2
    exit 3
fi

say "tests"
if [[ $FULL -eq 1 ]]; then
    ctest --test-dir "$B" -j"$JOBS" --output-on-failure --timeout 150 >"$OUT/ctest.log" 2>&1 ||
        FAILED+=(tests)
else
    ctest --test-dir "$B" -j"$JOBS" --output-on-failure --timeout 150 \
        -R 'cuda|gpu|stage|test_mem|test_td|test_pipe_alloc|test_cli$|test_log' \
        >"$OUT/ctest.log" 2>&1 || FAILED+=(tests)
fi
grep -E "tests passed|Failed|\*\*\*" "$OUT/ctest.log" | sed 's/^/  /'
gzip -c "$B/Testing/Temporary/LastTest.log" >"$OUT/LastTest.log.gz" 2>/dev/null

say "copy limits"
$B/bench/tdp_gpu_copy --size 100000000 --json >"$OUT/copy.json" 2>"$OUT/copy.err" ||
    FAILED+=(copy_limits)
cat "$OUT/copy.json"

say "one small copy, and the ways to learn it finished (tdp_gpu_copy --lat, 32 bytes)"
$B/bench/tdp_gpu_copy --lat --reps 1000 >"$OUT/lat.txt" 2>&1 || FAILED+=(copy_lat)
cat "$OUT/lat.txt"

say "same-host hand-off peers: tdp_gpu_ipc, torch.multiprocessing CUDA IPC"
$B/bench/tdp_gpu_ipc --sizes 1000,1000000,100000000 --rounds 1000 --json >"$OUT/ipc_floor.json" \
    2>"$OUT/ipc_floor.err" || FAILED+=(ipc_floor)
cat "$OUT/ipc_floor.json"
# the floor with the answer written back through the consumer's own pool, and
# with synchronous copies from pageable memory (as the bench's control words)
for f in --both-ways --sync-copies "--both-ways --sync-copies" --device-writes \
    "--both-ways --device-writes"; do
    # shellcheck disable=SC2086
    $B/bench/tdp_gpu_ipc --sizes 1000 --rounds 1000 $f 2>&1 | sed -n '1p;3p' | sed 's/^/  /'
done
if [[ $FAKE -eq 1 ]]; then
    echo "  torch CUDA IPC: skipped on the fake device"
else
    timeout 150 "${TDP_PYTHON:-python3}" bench/torch_cuda_ipc.py --rounds 300 --json "$OUT/torch_ipc.json" \
        >"$OUT/torch_ipc.log" 2>&1
    case $? in
    0) cat "$OUT/torch_ipc.log" ;;
    3) echo "  torch CUDA IPC: skipped ($(tail -1 "$OUT/torch_ipc.log"))" ;;
    *) FAILED+=(torch_ipc); tail -5 "$OUT/torch_ipc.log" ;;
    esac
fi

# 1 GB goes in a run of its own with few rounds (its target is only that it
# completes; default rounds move ~60 GB per plane and memory kind)
SIZES=1KB,1MB,100MB
[[ $QUICK -eq 1 ]] && SIZES=1KB,1MB
bench() { # name, then bench arguments
    local name=$1
    shift
    if ! timeout 150 "$TDPIPE" bench --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1; then
        FAILED+=("bench_$name")
        tail -5 "$OUT/$name.log"
    fi
}
say "bench --mem cuda, each plane"
for plane in $("$TDPIPE" version | sed -n 's/^planes: *//p' | tr ',' ' '); do
    [[ $plane == auto ]] && continue
    for mem in cuda cpu; do
        # cuda-ipc is offered only by pipes that name a GPU: no host-memory run
        [[ $plane == cuda-ipc && $mem == cpu ]] && continue
        bench "${mem}_$plane" --mem "$mem" --plane "$plane" --sizes "$SIZES"
        [[ $QUICK -eq 1 ]] || bench "big_${mem}_$plane" --mem "$mem" --plane "$plane" --sizes 1GB --rounds 4
    done
done
say "where a 1 KB ping-pong's time goes, each side (TDPIPE_BENCH_PHASES)"
for plane in cuda-ipc shm ucx tcp; do
    echo "  $plane:"
    TDPIPE_BENCH_PHASES=1 timeout 60 "$TDPIPE" bench --quiet --mem cuda --plane "$plane" \
        --sizes 1KB --rounds 2000 2>&1 | grep "per ping" | sed 's/^tdpipe bench: /    /'
done

say "small host-to-device writes by the device (default) and by the copy engine (TDPIPE_CUDA_INLINE=0), 1 KB p50"
for plane in cuda-ipc shm ucx tcp; do
    for inl in 1 0; do
        r=$(TDPIPE_CUDA_INLINE=$inl timeout 60 "$TDPIPE" bench --quiet --mem cuda --plane "$plane" \
            --sizes 1KB --rounds 2000 2>&1 | grep '^1.00 KB' | awk '{print "p50", $8, "us, p99", $10, "us"}')
        echo "  $plane, TDPIPE_CUDA_INLINE=$inl: ${r:-failed}"
    done
done

say "UCX over TCP, 100 MB: device vs host"
if [[ $QUICK -eq 0 ]]; then
    UCX_TLS=tcp bench cuda_ucx_tcp --mem cuda --plane ucx --sizes 100MB
    UCX_TLS=tcp bench cpu_ucx_tcp --mem cpu --plane ucx --sizes 100MB
fi

say "first sends, prepared (tdp_pipe_prepare before the first send), 100 MB"
if [[ $QUICK -eq 0 ]]; then
    for plane in shm ucx tcp cuda-ipc; do
        bench "prep_cuda_$plane" --mem cuda --plane "$plane" --sizes 100MB --rounds 20 --prepare
    done
fi

say "host paths on many cores: the fan-out hand-off from idle, first sends with huge pages"
# issue targets measured on 2 vCPUs so far, where 4 consumers cannot all run at once
FB=$B/bench/tdp_fanout_bench
for kind in "--floor" "--loan --drive" "--loan"; do
    for n in 1 4; do
        # shellcheck disable=SC2086
        r=$(timeout 60 "$FB" --consumers "$n" --size 1000000 --count 500 --gap 1000 $kind 2>&1 | tail -1)
        echo "  fan-out $kind, $n consumer(s): $(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("p50 to the last %.1f us, all %.1f us" % (r["p50_last_ns"]/1e3, r["p50_all_ns"]/1e3))' "$r" 2>/dev/null || echo "failed: $r")"
    done
done
rep=0 # virtio balloons with free page reporting (feature bit 5)
for d in /sys/bus/virtio/devices/*; do
    [[ $(cat "$d/device" 2>/dev/null) == 0x0005 && $(cut -c6 "$d/features" 2>/dev/null) == 1 ]] && rep=$((rep + 1))
done
echo "  THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null); virtio balloons reporting free pages: $rep"
if [[ $QUICK -eq 0 ]]; then
    for hp in 0 auto; do
        for tls in all tcp; do
            echo "  first send, host 100 MB, ucx ($tls), TDPIPE_HUGE_PAGES=$hp: $(TDPIPE_HUGE_PAGES=$hp UCX_TLS=$tls timeout 60 "$TDPIPE" bench --quiet --mem cpu --plane ucx --sizes 100MB --rounds 10 2>&1 | grep '^100 MB' | awk '{print "first", $3, $4, "p50", $6, $7}')"
        done
    done
fi

say "table"
python3 - "$OUT" "$QUICK" <<'EOF'
import glob, json, os, sys
out, quick = sys.argv[1], sys.argv[2] == "1"
def load1(name):
    try:
        return json.load(open(os.path.join(out, name + '.json')))
    except (OSError, ValueError):
        return None
def load(name):
    """A run's JSON, with the rows of its 1 GB run (big_NAME) added."""
    d, big = load1(name), load1('big_' + name)
    if d and big:
        d = dict(d, results=d.get('results', []) + big.get('results', []))
    return d or big
copy = load('copy') or {}
h2d = copy.get('h2d_pinned_gbps')
print('copy limits (100 MB): ' + ', '.join('%s %.1f GB/s' % (k[:-5], v)
      for k, v in copy.items() if k.endswith('_gbps')))
def rows(d):
    return {r['bytes']: r for r in (d or {}).get('results', [])}
def steady_us(r):
    """A steady send of r's size: bytes over the median throughput. The
    first send is a plain send, so where slots were lent (the throughput a
    hand-off rate) it is the plain send's time, as bench/run.sh counts it."""
    if not r:
        return None
    bps = (r.get('plain_send_Bps') or r['throughput_Bps'])['median']
    return r['bytes'] / bps * 1e6
hdr = '%-16s %10s %11s %10s %11s %9s %9s %10s' % ('run', 'bytes', 'first us', 'p50 us',
      'GB/s', 'x h2d', 'x host', 'first/st')
print(hdr)
for path in sorted(glob.glob(os.path.join(out, 'cuda_*.json'))):
    name = os.path.basename(path)[:-5]
    dev, host = rows(load(name)), rows(load('cpu_' + name[5:]))
    for b, r in sorted(dev.items()):
        gbps = r['throughput_Bps']['median'] / 1e9
        st_us = steady_us(r)
        hr = host.get(b)
        xh = gbps / hr['throughput_Bps']['median'] * 1e9 if hr else float('nan')
        print('%-16s %10d %11.1f %10.2f %11.3f %9.2f %9.2f %10.1f' % (
            name, b, r['first_send_us'], r['latency_us']['p50'], gbps,
            gbps / h2d if h2d else float('nan'), xh, r['first_send_us'] / max(
                r['latency_us']['p50'], st_us)))
        if hr:
            print('%-16s %10s %11.1f %10.2f %11.3f' % ('  host', '', hr['first_send_us'],
                  hr['latency_us']['p50'], hr['throughput_Bps']['median'] / 1e9))

# the cuda-ipc plane against its peers (issue targets: p50 <= 1.5 x the floor
# at 1 KB and 100 MB, 100 MB <= 1.5 x 1 KB, >= 10 x faster than torch's queue,
# first send <= 2 x steady)
floor = {r['bytes']: r for r in (load('ipc_floor') or {}).get('results', [])}
torch_ipc = {r['bytes']: r for r in (load('torch_ipc') or {}).get('results', [])}
ipc = rows(load('cuda_cuda-ipc'))
if ipc:
    print()
    print('%-10s %10s %10s %10s %10s %10s %10s' % ('cuda-ipc', 'p50 us', 'floor us', 'x floor',
          'torch us', 'torch/x', 'first/st'))
    for b, r in sorted(ipc.items()):
        p50 = r['latency_us']['p50']
        f = floor.get(b, {}).get('p50_us')
        t = torch_ipc.get(b, {}).get('p50_us')
        st_us = steady_us(r)
        nan = float('nan')
        print('%-10d %10.2f %10.2f %10.2f %10.1f %10.1f %10.1f' % (
            b, p50, f or nan, p50 / f if f else nan, t or nan, t / p50 if t else nan,
            r['first_send_us'] / max(p50, st_us)))
    if 1000 in ipc and 100000000 in ipc:
        print('100 MB / 1 KB p50: %.2f' % (ipc[100000000]['latency_us']['p50'] /
                                          ipc[1000]['latency_us']['p50']))

# the issues' targets, each met, missed or not measured in this run
print()
print('targets (this run):')
def verdict(what, value, limit, at_least):
    if value is None:
        print('  %-56s not measured' % what)
        return
    ok = value >= limit if at_least else value <= limit
    print('  %-56s %8.2f %s %-5g %s' % (what, value, '>=' if at_least else '<=', limit,
                                       'met' if ok else 'MISSED'))
def get(d, b, *keys):
    r = d.get(b)
    for k in keys:
        if r is None:
            return None
        r = r.get(k)
    return r
def ratio(a, b):
    return a / b if a is not None and b else None
sizes = (1000, 1000000) if quick else (1000, 1000000, 100000000, 1000000000)
for path in sorted(glob.glob(os.path.join(out, 'cuda_*.json'))):
    name = os.path.basename(path)[:-5]
    if name == 'cuda_ucx_tcp':
        continue  # 100 MB only, by design: its own line below
    have = rows(load(name))
    print('  %-56s %s' % ('%s completes at %s' % (name, ', '.join(str(b) for b in sizes)),
          'met' if all(b in have for b in sizes) else 'MISSED (%s)' %
          ', '.join(str(b) for b in sizes if b not in have)))
shm, shm_h = rows(load('cuda_shm')), rows(load('cpu_shm'))
verdict('staged shm, 100 MB: x pinned H2D', ratio(get(shm, 100000000, 'throughput_Bps',
        'median'), h2d * 1e9 if h2d else None), 0.7, True)
verdict('staged shm, 1 KB p50: x host memory', ratio(get(shm, 1000, 'latency_us', 'p50'),
        get(shm_h, 1000, 'latency_us', 'p50')), 2.0, False)
tcp, tcp_h = rows(load('cuda_ucx_tcp')), rows(load('cpu_ucx_tcp'))
verdict('ucx plane over TCP, 100 MB: x host memory', ratio(get(tcp, 100000000, 'throughput_Bps',
        'median'), get(tcp_h, 100000000, 'throughput_Bps', 'median')), 0.8, True)
tcpp, tcpp_h = rows(load('cuda_tcp')), rows(load('cpu_tcp'))
verdict('tcp plane, 100 MB: x host memory', ratio(get(tcpp, 100000000, 'throughput_Bps',
        'median'), get(tcpp_h, 100000000, 'throughput_Bps', 'median')), 0.8, True)
for plane in ('shm', 'ucx', 'tcp'):
    d = rows(load('cuda_' + plane))
    verdict('%s, first send of 100 MB: x a steady send' % plane,
            ratio(get(d, 100000000, 'first_send_us'), steady_us(d.get(100000000))), 3.0, False)
for plane in ('shm', 'ucx', 'tcp', 'cuda-ipc'):
    d = rows(load('prep_cuda_' + plane))
    r = d.get(100000000)
    verdict('%s, prepared first send of 100 MB: x a steady send' % plane,
            ratio(get(d, 100000000, 'first_send_us'),
                  max(r['latency_us']['p50'], steady_us(r)) if r else None),
            2.0 if plane == 'cuda-ipc' else 3.0, False)
def ipc_p50(b):
    return get(ipc, b, 'latency_us', 'p50')
for b, label in ((1000, '1 KB'), (100000000, '100 MB')):
    verdict('cuda-ipc %s p50: x tdp_gpu_ipc floor' % label,
            ratio(ipc_p50(b), floor.get(b, {}).get('p50_us')), 1.5, False)
verdict('cuda-ipc 100 MB p50: x its 1 KB p50', ratio(ipc_p50(100000000), ipc_p50(1000)), 1.5,
        False)
for b, label in ((1000, '1 KB'), (1000000, '1 MB'), (100000000, '100 MB')):
    verdict('cuda-ipc %s: PyTorch CUDA IPC p50 / ours' % label,
            ratio(torch_ipc.get(b, {}).get('p50_us'), ipc_p50(b)), 10.0, True)
r = ipc.get(100000000)
verdict('cuda-ipc, first send of 100 MB: x a steady one',
        ratio(get(ipc, 100000000, 'first_send_us'),
              max(r['latency_us']['p50'], steady_us(r)) if r else None), 2.0, False)
EOF

say "side by side: the Python GPU tests and example; compute-sanitizer memcheck, bench --mem cuda at 1 MB on each plane"
# Neither gives figures, so they share the machine: the Python stage (most
# of it a child process per fake-device case) and one sanitized bench per
# plane run at once, and their results are printed in this order after.
# the interpreter CMake built the package for (FindPython's cache entry)
PY=$(grep -m1 -E '^_?Python3_EXECUTABLE:' "$B/CMakeCache.txt" | cut -d= -f2-)
PY_RUN=0
if [[ -d $B/python/tdpipe && -n $PY ]]; then
    PY_RUN=1
    # the fake-device cases pick their backend themselves; the torch CUDA
    # cases and the example skip (saying why) without torch's CUDA, or on
    # the fake (torch's device pointers are not the fake's memory).
    # pytest-xdist, where that Python has it, spreads the cases over 4 workers.
    xdist=()
    "$PY" -c 'import xdist' >/dev/null 2>&1 && xdist=(-n 4)
    (
        PYTHONPATH=$B/python PYTHONDONTWRITEBYTECODE=1 timeout 200 "$PY" -m pytest -q -rs \
            -p no:cacheprovider "${xdist[@]}" tests/python/test_gpu.py \
            tests/python/test_examples.py::test_gpu_dataloader_example \
            >"$OUT/python_gpu.log" 2>&1
        echo $? >"$OUT/python_gpu.rc"
    ) &
fi
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
MC_PLANES=(cuda-ipc shm ucx tcp)
if [[ $FAKE -eq 0 && -n $CS ]]; then
    for plane in "${MC_PLANES[@]}"; do
        (
            timeout 150 "$CS" --tool memcheck --error-exitcode 9 --target-processes all \
                "$TDPIPE" bench --mem cuda --plane "$plane" --sizes 1MB --rounds 50 \
                >"$OUT/memcheck_$plane.log" 2>&1
            echo $? >"$OUT/memcheck_$plane.rc"
        ) &
    done
fi
wait

echo "  Python:"
if [[ $PY_RUN -eq 0 ]]; then
    echo "    the Python package was not built here (no Python development files): skipped"
else
    echo "    $PY: $("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.cuda.is_available())' 2>&1 | tail -1)"
    grep -E "passed|failed|error|SKIPPED|Timeout" "$OUT/python_gpu.log" | sed 's/^/    /'
    if [[ $(cat "$OUT/python_gpu.rc" 2>/dev/null) != 0 ]]; then
        FAILED+=(python_gpu)
        tail -15 "$OUT/python_gpu.log" | sed 's/^/    | /'
    fi
fi
echo "  compute-sanitizer memcheck:"
if [[ $FAKE -eq 1 ]]; then
    echo "    the fake device: skipped"
elif [[ -z $CS ]]; then
    echo "    compute-sanitizer not found: skipped"
else
    for plane in "${MC_PLANES[@]}"; do
        if [[ $(cat "$OUT/memcheck_$plane.rc" 2>/dev/null) == 0 ]]; then
            echo "    $plane: $(grep -m1 'ERROR SUMMARY' "$OUT/memcheck_$plane.log" || echo clean)"
        else
            FAILED+=("memcheck_$plane")
            tail -20 "$OUT/memcheck_$plane.log" | sed 's/^/    | /'
        fi
    done
fi

say "done"
echo "  seconds per stage:"
for ((k = 0; k + 1 < ${#STAGES[@]}; k++)); do
    printf '    %5d  %s\n' $((STAGE_AT[k + 1] - STAGE_AT[k])) "${STAGES[k]:0:90}"
done
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu-check: FAILED: ${FAILED[*]} (logs in $OUT)"
    exit 1
fi
echo "gpu-check: all stages passed (logs and JSON in $OUT)"
