#!/usr/bin/env bash
# The README's main command: builds slidedp, writes the bundled tiny dataset, and runs the tiny
# Qwen3-shaped example job on a private hostd with one worker per GPU (CPU backend workers where
# there is no GPU). Extra arguments go to `slidedp run` (e.g. --backend cpu).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/tools/build.sh" slidedp slidedp-hostd slidedp-worker make_text_dataset
"$build/bin/make_text_dataset" --input "$root/examples/tiny/corpus.txt" --output "$build/examples/tiny-data" --repeat 4
exec "$build/bin/slidedp" run "$root/examples/tiny/job.yaml" "$@"
