#!/usr/bin/env bash
# demo.sh: install what is missing, build in build/ and run the main job.
#
# The main job is the loopback benchmark, `build/tools/tdpipe bench`, when
# the tdpipe command has been built; until then it is the schema demo
# (build/examples/schema_demo). Extra arguments are passed through to it.
#
# ./scripts/demo.sh --python runs the Python examples instead (with Debian's
# /usr/bin/python3 and the package built in build/python): a PyTorch
# DataLoader fed by a producer process, then an inference server and client.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
JOBS=$(nproc 2>/dev/null || echo 2)

echo "== setup"
"$ROOT/scripts/setup.sh"

echo "== build (build/, RelWithDebInfo)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j"$JOBS"

if [[ "${1:-}" == "--python" ]]; then
    shift
    export PYTHONPATH="$ROOT/build/python${PYTHONPATH:+:$PYTHONPATH}"
    echo "== examples/python/dataloader.py $*"
    /usr/bin/python3 examples/python/dataloader.py "$@"
    echo "== examples/python/infer_server.py + infer_client.py"
    exec /usr/bin/python3 examples/python/infer_client.py --spawn-server
fi

if [[ -x build/tools/tdpipe ]]; then
    echo "== tdpipe bench $*"
    exec build/tools/tdpipe bench "$@"
fi
echo "== schema_demo $*"
exec build/examples/schema_demo "$@"
