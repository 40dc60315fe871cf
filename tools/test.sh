#!/usr/bin/env bash
# The README's test command: installs dependencies, builds everything, runs the test suite
# (unit tests and real-process integration tests on the CPU backend; GPU checks are separate
# binaries run on a GPU machine, see docs/gpu-results.md). Prints ctest's "N tests passed" summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/tools/build.sh"
cd "$build"
ctest --output-on-failure -j"${JOBS:-$(nproc)}" --timeout 600 "$@"
