#!/usr/bin/env bash
# The README's test command: installs dependencies, builds everything, runs the test suite
# (unit tests and real-process integration tests on the CPU backend). Tests labelled gpu (the
# *_gpu_test binaries) are left out: they need a GPU and fail without one; run them on a GPU
# machine with `ctest -L gpu` (see docs/kernels.md). Prints ctest's "N tests passed" summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/tools/build.sh"
cd "$build"
ctest --output-on-failure -j"${JOBS:-$(nproc)}" --timeout 600 -LE gpu "$@"
