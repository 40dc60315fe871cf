#!/usr/bin/env bash
# Issue 7's runs, one command per machine (nvidia-h200-x4 / -x8), with the same harness as the
# 1-2 GPU benchmark (bench/e2e/run_bench.sh); everything lands in run_bench's three files plus
# $out/bench_copy.jsonl. Each part is capped so the whole fits the device tool's 10 minutes only
# when PARTS names a subset; run it as several calls on a warm machine (RESUME=1 keeps results).
#   PARTS="copy weak8 weak14 strong14 routes"   (default: all)
#   copy      bench_copy: per-GPU H2D/D2H with 1, 2, 4, 8 GPUs copying at once, with and without
#             LayerAdam running (host contention)
#   weak8     Qwen3-8B, 64K tokens per GPU, 1/2/4/8 GPUs: tokens/s and parallel efficiency
#   weak14    Qwen3-14B, the same
#   strong14  Qwen3-14B, global batch 256 x 4096 = 1M tokens: 4 and 8 GPUs (256K and 128K per GPU)
#   routes    Qwen3-8B on all GPUs: replicated vs sharded delivery x GPU vs CPU reduction, at 16K
#             (host-bound) and 128K (GPU-bound) tokens per GPU
set -u
cd "$(dirname "$0")/../.." || exit 2
source tools/gpu/suite_lib.sh
PARTS=${PARTS:-"copy weak8 weak14 strong14 routes"}
n=$(nvidia-smi -L | wc -l)
counts="1"; c=2; while [ "$c" -le "$n" ]; do counts="$counts $c"; c=$((c * 2)); done
export RESUME=${RESUME:-1}
if has copy; then
  timeout 120 bench_copy --seconds 2 --mib 256 --adam-params 268435456 > "$out/bench_copy.jsonl" 2> "$out/bench_copy.err"
fi
has weak8 && MODEL=qwen3-8b GPUS="$counts" TOKENS_LIST=65536 WHAT=ours bash bench/e2e/run_bench.sh
# 14B on one GPU: auto would stage the 59 GB gradient on the host (+4 B/param: 250 GB with the
# state, more than a 256 GB host has); on the device it fits next to the 64K activations.
has weak14 && MODEL=qwen3-14b GPUS="$counts" TOKENS_LIST=65536 WHAT=ours RUNTIME_EXTRA="grad_staging: device" \
  bash bench/e2e/run_bench.sh
if has strong14; then
  for g in 4 8; do
    [ "$g" -le "$n" ] && MODEL=qwen3-14b GPUS=$g TOKENS_LIST=$((256 * 4096 / g)) WHAT="ours compute" bash bench/e2e/run_bench.sh
  done
fi
if has routes; then
  for route in "grad_reduction: gpu, param_delivery: replicated" "grad_reduction: gpu, param_delivery: sharded" \
               "grad_reduction: cpu, param_delivery: replicated"; do
    tag=$(echo "$route" | tr -cd 'a-z' | sed 's/gradreduction//; s/paramdelivery/-/')
    WORK=/tmp/slidedp-e2e-routes-$tag MODEL=qwen3-8b GPUS=$n TOKENS_LIST="16384 131072" \
      WHAT=ours RUNTIME_EXTRA="$route" bash bench/e2e/run_bench.sh
    cp "$out/bench-summary.md" "$out/routes-$tag.md"
  done
  # The main summary again (each route run above rewrote it with its own results).
  python3 bench/e2e/report.py --work /tmp/slidedp-e2e --out "$out"
fi
