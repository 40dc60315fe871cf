#!/usr/bin/env bash
# GPU session E (nvidia-h200-x2): the NCCL routes of issue 4.
#   1. Qwen3-0.6B, 20 steps at the same global batch: 1 GPU, and 2 GPUs with gradient reduction
#      on the GPU (reduce-scatter), with sharded parameter delivery (all-gather), and with the CPU
#      route; loss curves and final FP32 weights compared against the 1-GPU run.
#   2. the end-to-end benchmark (bench/e2e/run_bench.sh) with E2E_ARGS.
# Everything lands in $out/session-e.log (+ the benchmark's three files).
set -u
source tools/gpu/lib.sh
STEPS=${EQ_STEPS:-20}  # not exported: run_bench.sh has its own STEPS
log_session session-e
echo "=== session E $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader | paste -sd,)"
nvidia-smi topo -m 2>/dev/null | head -5

eq() { eq_run /tmp/eq "$1" "$2" "$3" "$STEPS"; }  # eq NAME GPUS RUNTIME_EXTRA

if [ "${SKIP_EQ:-0}" != 1 ]; then
  mkdir -p /tmp/eq
  python3 bench/e2e/make_dataset.py --out /tmp/eq/data --rows $((8 * STEPS)) --seq-len 1024 --vocab 151936 > /dev/null
  eq g1 1 ""
  eq g2-gpu 2 ", grad_reduction: gpu"
  eq g2-sharded 2 ", grad_reduction: gpu, param_delivery: sharded"
  eq g2-cpu 2 ", grad_reduction: cpu"
  for r in g2-gpu g2-sharded g2-cpu; do
    echo "--- curves g1 vs $r"
    python3 tools/verify/compare_curves.py /tmp/eq/g1/out/metrics-*.jsonl /tmp/eq/$r/out/metrics-*.jsonl --tol 1e-4 --steps "$STEPS"
    echo "--- weights g1 vs $r"
    python3 tools/verify/compare_params.py /tmp/eq/$r/out/checkpoint-$STEPS /tmp/eq/g1/out/checkpoint-$STEPS --tol-rel 1e-4
  done
  for r in g1 g2-gpu g2-sharded g2-cpu; do
    echo "--- busy $r (last step)"; tail -n 1 /tmp/eq/$r/out/metrics-*.jsonl | python3 -c 'import json,sys; j=json.loads(sys.stdin.read()); print(j["step_time_s"], j["busy_s"])'
  done
  grep -h "NCCL communicator\|WARN\|error" /tmp/eq/*/run/*.log 2>/dev/null | head -20
fi

if [ -n "${E2E_ARGS:-}" ]; then
  echo "=== bench: $E2E_ARGS"
  # shellcheck disable=SC2086
  env $E2E_ARGS bash bench/e2e/run_bench.sh
fi
echo "=== session E done after $SECONDS s"
