#!/usr/bin/env bash
# test.sh: everything CI checks, from a fresh Debian bookworm machine.
#
#   1. setup       install missing Debian packages (scripts/setup.sh)
#   2. build       RelWithDebInfo build in build/, then ctest (the Python
#                  package's pytest suite included: the ctest test "python")
#   3. install     install build/ into a scratch prefix and compile a small
#                  program against it, through find_package and pkg-config
#   4. asan        ASan + UBSan Debug build in build-asan/, then ctest
#   5. tsan        ThreadSanitizer Debug build in build-tsan/, then ctest of
#                  the suites that run threads: the pipe and fan-out suites in every
#                  transport configuration (host and device buffers), the
#                  fan-in suite per plane, the
#                  server, the loop, the shared-memory rings, the CUDA
#                  layer's fake device and the staging engine, the same-host
#                  GPU plane (test_cuda_ipc), the payload
#                  checksum, the pre-auth attacker and the allocation counts
#   6. fuzz        libFuzzer build in build-fuzz/ (clang), then timed runs of
#                  the schema and frame decoder fuzzers and of the HELLO
#                  handler fuzzer over scratch copies of their corpora
#
# Every stage runs even if an earlier one failed (except that nothing runs
# without setup); the script exits non-zero if any stage failed and ends
# with a one-line summary.
#
# Environment:
#   TDP_SKIP_FUZZ=1       skip stage 6
#   TDP_FUZZ_SECONDS=N    length of the fuzz run (default 60)
#   ASAN_OPTIONS, UBSAN_OPTIONS, TSAN_OPTIONS   override the defaults set below
#   UCX_MEM_EVENTS        the tsan stage sets it to "no" unless it is set

# The stage_* functions are called indirectly, through run_stage.
# shellcheck disable=SC2317
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

JOBS=$(nproc 2>/dev/null || echo 2)
FUZZ_SECONDS=${TDP_FUZZ_SECONDS:-60}
SKIP_FUZZ=${TDP_SKIP_FUZZ:-0}

if ! [[ "$FUZZ_SECONDS" =~ ^[0-9]+$ ]] || [[ "$FUZZ_SECONDS" -eq 0 ]]; then
    echo "test.sh: TDP_FUZZ_SECONDS must be a positive integer, got '$FUZZ_SECONDS'" >&2
    exit 2
fi

# Sanitizers stop at the first error, with a stack, and check for leaks.
# protect_shadow_gap=0 lets the CUDA runtime map memory where ASan would
# otherwise reserve its shadow gap (needed on GPU machines, harmless elsewhere).
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=0:print_stacktrace=1:detect_leaks=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1:protect_shadow_gap=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-print_suppressions=0}
# ThreadSanitizer stops at the first report, shows both stacks of a lock
# order inversion, and reads the suppressions for UCX's own internals (each
# one explained in the file; nothing of tdpipe is ever suppressed).
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$ROOT/tests/tsan.supp}

T0=$SECONDS
RESULTS=()
FAILED=0

section() {
    printf '\n'
    printf '=%.0s' {1..78}
    printf '\n== %s\n' "$*"
    printf '=%.0s' {1..78}
    printf '\n'
}

# run_stage KEY TITLE FUNCTION: run FUNCTION in a subshell with errexit in
# force, time it and record the outcome under KEY.
run_stage() {
    local name=$1 title=$2 fn=$3 start=$SECONDS rc
    section "$title"
    set +e
    (
        set -euo pipefail
        "$fn"
    )
    rc=$?
    set -e
    local took=$((SECONDS - start))
    if [[ $rc -eq 0 ]]; then
        echo ">> $name: ok (${took}s)"
        RESULTS+=("$name ok ${took}s")
    else
        echo ">> $name: FAILED (exit $rc, ${took}s)" >&2
        RESULTS+=("$name FAILED ${took}s")
        FAILED=1
    fi
    return 0
}

skip_stage() {
    section "$2"
    echo ">> $1: skipped ($3)"
    RESULTS+=("$1 skipped ($3)")
}

# ---- stages --------------------------------------------------------------------

stage_setup() {
    "$ROOT/scripts/setup.sh"
}

stage_build() {
    cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
    cmake --build build -j"$JOBS"
    ctest --test-dir build --output-on-failure -j"$JOBS"
}

# The README says users consume the installed library with find_package or
# pkg-config: prove both work against a scratch install of build/.
stage_install() {
    local prefix="$ROOT/build/_install-check"
    rm -rf "$prefix"
    cmake --install build --prefix "$prefix/usr"
    mkdir -p "$prefix/consumer"
    cat >"$prefix/consumer/main.c" <<'EOF'
#include <stdio.h>
#include <tdpipe/tdpipe.h>

int main(void)
{
    tdp_schema_builder *b;
    tdp_schema *s;
    const int64_t shape[] = {2, 3};

    if (tdp_schema_builder_new(&b) != TDP_OK ||
        tdp_schema_builder_tensor(b, "x", TDP_FLOAT32, 2, shape) != TDP_OK ||
        tdp_schema_builder_finish(b, &s, NULL, 0) != TDP_OK)
        return 1;
    tdp_schema_builder_free(b);
    printf("tdpipe %s: %u leaf, %llu bytes\n", tdp_version_string(), tdp_schema_num_leaves(s),
           (unsigned long long)tdp_schema_total_bytes(s));
    tdp_schema_unref(s);
    return 0;
}
EOF
    cat >"$prefix/consumer/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.18)
project(tdpipe_consumer C)
find_package(tdpipe REQUIRED)
add_executable(consumer main.c)
target_link_libraries(consumer PRIVATE tdpipe::tdpipe)
EOF
    echo ">> find_package(tdpipe)"
    cmake -S "$prefix/consumer" -B "$prefix/consumer/build" -DCMAKE_PREFIX_PATH="$prefix/usr"
    cmake --build "$prefix/consumer/build"
    "$prefix/consumer/build/consumer"

    echo ">> pkg-config tdpipe"
    local pcdir
    pcdir=$(dirname "$(find "$prefix/usr" -name tdpipe.pc -print -quit)")
    # --define-prefix: the .pc file names the configured prefix; relocate it
    # to where this scratch install actually is.
    local flags
    flags=$(PKG_CONFIG_PATH="$pcdir" pkg-config --define-prefix --cflags --libs tdpipe)
    echo "pkg-config: $flags"
    # shellcheck disable=SC2086 # flags are meant to split
    cc "$prefix/consumer/main.c" -o "$prefix/consumer/consumer-pc" $flags
    LD_LIBRARY_PATH="$(dirname "$pcdir")" "$prefix/consumer/consumer-pc"
}

stage_asan() {
    cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DTDP_SANITIZE=address,undefined
    cmake --build build-asan -j"$JOBS"
    ctest --test-dir build-asan --output-on-failure -j"$JOBS"
}

# ThreadSanitizer over the suites that run threads. About 3 minutes on two
# cores, build included (TSan slows the tests 5-15x; they take about 2).
# Left out, deliberately:
#   - the suites without threads (schema, td, wire, ... : nothing to race)
#     and the command-line and benchmark scripts (processes, not threads);
#     build/ and build-asan/ run all of them;
#   - test_server's test_kill_client: it SIGKILLs a client process, and
#     a client killed in the middle of a send over UCX's shared-memory
#     transports can leave the server's worker stalled for the other
#     clients (UCX's receive FIFO waits for the dead writer) — a flake in
#     every build, not a threading question; build/ and build-asan/ keep it.
# The suite's device-memory runs (test_pipe_cuda_*, TDP_TEST_MEM=cuda, on the
# fake device without a GPU) match the pattern, as do test_pipe_alloc's
# device cases; the asan stage runs every test, them included.
# test_pipe_alloc runs with the library's allocation counter only: its
# process-wide count replaces malloc, which TSan must own.
# UCX_MEM_EVENTS=no: UCX's memory hooks patch the allocator's symbols
# under TSan's interceptors and crash the process before main.
TSAN_TESTS='^test_(pipe_.*|prepare.*|fanin_.*|fanout_.*|window_.*|server|loop|shm|cuda|cuda_ipc|stage|gpu_shm|gpu_pin|checksum_.*|preauth|ucx_chunks)$'
TSAN_TARGETS=(test_pipe test_prepare test_pipe_alloc test_fanin test_fanout test_window test_server test_loop test_shm test_cuda test_cuda_ipc test_stage test_gpu_shm test_gpu_pin test_checksum test_preauth test_ucx_chunks)

stage_tsan() {
    export UCX_MEM_EVENTS=${UCX_MEM_EVENTS:-no}
    export TDP_TEST_SKIP=${TDP_TEST_SKIP:-test_kill_client}
    cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DTDP_SANITIZE=thread \
        -DTDP_BUILD_EXAMPLES=OFF -DTDP_BUILD_BENCH=OFF -DTDP_BUILD_TOOLS=OFF
    cmake --build build-tsan -j"$JOBS" --target "${TSAN_TARGETS[@]}"
    ctest --test-dir build-tsan --output-on-failure -j"$JOBS" -R "$TSAN_TESTS"
}

# fuzz_one NAME SECONDS [FLAGS...]: run build-fuzz/fuzz/NAME over a scratch copy of
# fuzz/corpus/<corpus of NAME>. libFuzzer writes new inputs into its first
# corpus directory: that is a fresh temporary one, so the repository's corpus
# is never written. New inputs are kept in build-fuzz/corpus-new/NAME and
# crash reproducers in build-fuzz/artifacts/<time>/ for inspection.
fuzz_one() {
    local name=$1 secs=$2 corpus=${1#fuzz_} rc=0
    shift 2
    local artifacts scratch
    artifacts="$ROOT/build-fuzz/artifacts/$(date +%Y%m%d-%H%M%S)-$name"
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/tdp-fuzz.XXXXXX")
    mkdir -p "$scratch/new" "$scratch/seed" "$artifacts"
    if [[ -d fuzz/corpus/$corpus ]]; then
        cp -R "fuzz/corpus/$corpus/." "$scratch/seed/"
    fi
    echo ">> $name for ${secs}s over $(find "$scratch/seed" -type f | wc -l) seed inputs"
    "build-fuzz/fuzz/$name" -max_total_time="$secs" -timeout=10 \
        -print_final_stats=1 -artifact_prefix="$artifacts/" "$@" \
        "$scratch/new" "$scratch/seed" || rc=$?
    # Keep what was found (outside the source tree) for a deliberate merge:
    #   build-fuzz/fuzz/NAME -merge=1 fuzz/corpus/CORPUS build-fuzz/corpus-new/NAME
    mkdir -p build-fuzz/corpus-new
    rm -rf "build-fuzz/corpus-new/$name"
    mv "$scratch/new" "build-fuzz/corpus-new/$name"
    rm -rf "$scratch"
    echo ">> $name: $(find "build-fuzz/corpus-new/$name" -type f | wc -l) new inputs" \
        "in build-fuzz/corpus-new/$name"
    if [[ $rc -ne 0 ]]; then
        echo ">> $name found a failure (exit $rc); reproducer(s):" >&2
        ls -l "$artifacts" >&2 || true
        return "$rc"
    fi
    rmdir "$artifacts" 2>/dev/null || true
}

stage_fuzz() {
    CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -g" \
        -DTDP_BUILD_FUZZ=ON -DTDP_SANITIZE=address,undefined \
        -DTDP_BUILD_TESTS=OFF -DTDP_BUILD_EXAMPLES=OFF -DTDP_BUILD_BENCH=OFF \
        -DTDP_BUILD_TOOLS=OFF
    cmake --build build-fuzz -j"$JOBS"
    # the schema decoder gets half the time, the frame decoders and the
    # HELLO handler a quarter each
    local s1=$(( FUZZ_SECONDS / 2 )) s2 s3
    (( s1 > 0 )) || s1=1
    s2=$(( FUZZ_SECONDS / 4 ))
    (( s2 > 0 )) || s2=1
    s3=$(( FUZZ_SECONDS - s1 - s2 ))
    (( s3 > 0 )) || s3=1
    fuzz_one fuzz_schema "$s1"
    fuzz_one fuzz_frames "$s2"
    # the HELLO handler drives real UCX workers: leak checks are left to the
    # asan stage, which replays fuzz/corpus/hello (UCX keeps the unpaired half
    # of a connection a worker makes to itself, which this fuzzer does often)
    fuzz_one fuzz_hello "$s3" -detect_leaks=0
}

# ---- main ------------------------------------------------------------------------

echo "tdpipe tests in $ROOT with -j$JOBS"
run_stage setup "setup: Debian packages" stage_setup
if [[ $FAILED -ne 0 ]]; then
    echo "test.sh: FAIL — setup failed, nothing else run ($((SECONDS - T0))s)"
    exit 1
fi
run_stage build "build + ctest: build/, RelWithDebInfo" stage_build
run_stage install "install + consume: find_package(tdpipe), pkg-config tdpipe" stage_install
run_stage asan "ASan+UBSan build + ctest: build-asan/, Debug" stage_asan
run_stage tsan "TSan build + ctest of the threaded suites: build-tsan/, Debug" stage_tsan
if [[ "$SKIP_FUZZ" == 1 ]]; then
    skip_stage fuzz "fuzz: build-fuzz/" "TDP_SKIP_FUZZ=1"
elif ! command -v clang >/dev/null 2>&1; then
    skip_stage fuzz "fuzz: build-fuzz/" "clang not found"
else
    run_stage fuzz "fuzz: build-fuzz/, schema and frame decoders, HELLO handler for ${FUZZ_SECONDS}s" stage_fuzz
fi

section "summary"
summary=""
for r in "${RESULTS[@]}"; do
    summary+="${summary:+; }$r"
done
if [[ $FAILED -eq 0 ]]; then
    echo "test.sh: PASS — $summary — total $((SECONDS - T0))s"
else
    echo "test.sh: FAIL — $summary — total $((SECONDS - T0))s"
fi
exit "$FAILED"
