#!/usr/bin/env bash
# setup.sh: install the Debian packages tdpipe needs to build, test, fuzz and
# benchmark. Installs only what is missing, so running it again is a no-op.
# Works as root, or through sudo when not root. Debian bookworm.
set -euo pipefail

# The one list of build and test dependencies.
PACKAGES=(
    build-essential      # gcc, make, libc headers
    cmake                # build system (>= 3.18)
    pkg-config           # how CMake finds the libraries below
    libucx-dev           # transport (UCP API)
    ucx-utils            # ucx_info, for diagnosing the transport
    libevent-dev         # event loop
    libxxhash-dev        # XXH3 schema hash and payload checksum
    libjansson-dev       # JSON schema codec
    libsodium-dev        # HMAC-SHA256 and constant-time compare: shared-secret authentication
    libcmocka-dev        # unit and integration tests
    libdlpack-dev        # DLPack header (zero-copy hand-off to frameworks)
    clang                # libFuzzer targets and sanitizer builds
    libclang-rt-14-dev   # clang's sanitizer and libFuzzer runtimes
    libzmq3-dev          # benchmark peer for comparison
    gnuplot-nox          # benchmark plots
    iproute2             # ip/ss, for picking interfaces and inspecting sockets
    groff-base           # groff: test_install checks the generated man page tdpipe.1 renders without warnings
    python3-dev          # the Python package's C extension (python/)
    python3-numpy        # received leaves as NumPy arrays; Python tests
    python3-torch        # received leaves as PyTorch tensors; Python tests and examples
    python3-pytest       # the Python test suite (tests/python)
)

missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$pkg" 2>/dev/null || true)
    if [[ "$status" != ii* ]]; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "setup: all ${#PACKAGES[@]} packages already installed"
    exit 0
fi

echo "setup: installing ${missing[*]}"
if [[ $(id -u) -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "setup: not root and sudo is not available; install as root: ${missing[*]}" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
echo "setup: done"
