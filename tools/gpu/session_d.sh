#!/usr/bin/env bash
# GPU-machine session D: a short loss-curve comparison in a fine-tuning regime (low constant LR)
# where two correct BF16 implementations should not diverge: slidedp vs HF autocast.
set -u
export STEPS=${STEPS:-50} Q06_LR=${Q06_LR:-1.0e-5} Q06_SCHEDULE=${Q06_SCHEDULE:-constant} Q06_WARMUP=${Q06_WARMUP:-0} Q06_MIN_LR=0
source tools/gpu/lib.sh
q06_data_and_spec
stage ours_q06 120 bash -c 'slidedp run /tmp/q06.yaml --backend cuda --run-dir /tmp/q06-run > /tmp/q06-progress.log 2>&1; rc=$?;
  tail -n 2 /tmp/q06-progress.log; cp /tmp/q06-out/metrics-*.jsonl '"$out"'/ 2>/dev/null; exit $rc'
stage hf_q06 90 bash -c 'dump_batches --job /tmp/q06.yaml --out /tmp/q06-batches.bin --write-init /tmp/q06-init &&
  python3 tools/verify/hf_train_reference.py --batches /tmp/q06-batches.bin --out '"$out"'/hf_q06_curve.json --model /tmp/q06-init'
stage curves 20 python3 tools/verify/compare_curves.py /tmp/q06-out/metrics-q06-1.jsonl "$out/hf_q06_curve.json" --tol 6e-4 --steps "$STEPS"
