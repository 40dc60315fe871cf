#!/usr/bin/env bash
# Configures and builds slidedp into ${BUILD_DIR:-build} (Ninja, ccache when present).
# Extra arguments are build targets (default: all).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/tools/install-deps.sh"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} ${CMAKE_ARGS:-}
fi
cmake --build "$build" -j"${JOBS:-$(nproc)}" ${*:+--target "$@"}
