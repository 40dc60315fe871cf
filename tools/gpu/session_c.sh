#!/usr/bin/env bash
# GPU-machine session C: after a change to the CUDA backend's numerics — kernel checks, the tiny
# job on the CUDA worker, Qwen3-0.6B 200 steps against HF (bf16 autocast) and HF's own FP32
# noise floor, then the whole-model HF comparison. Logs to $OUT.
set -u
source tools/gpu/lib.sh
stage kernel_check 90 cuda_kernel_check
stage tiny_cuda 60 bash -c 'make_text_dataset --input examples/tiny/corpus.txt --output build/examples/tiny-data --repeat 4 &&
  slidedp run examples/tiny/job.yaml --backend cuda --run-dir /tmp/tiny-run 2>&1 | tail -n 4'
q06_data_and_spec
stage ours_q06 250 bash -c 'slidedp run /tmp/q06.yaml --backend cuda --run-dir /tmp/q06-run > /tmp/q06-progress.log 2>&1; rc=$?;
  tail -n 3 /tmp/q06-progress.log; cp /tmp/q06-out/metrics-*.jsonl '"$out"'/ 2>/dev/null; exit $rc'
stage hf_q06 120 bash -c 'dump_batches --job /tmp/q06.yaml --out /tmp/q06-batches.bin --write-init /tmp/q06-init &&
  python3 tools/verify/hf_train_reference.py --batches /tmp/q06-batches.bin --out '"$out"'/hf_q06_curve.json --model /tmp/q06-init'
stage hf_q06_fp32 100 python3 tools/verify/hf_train_reference.py --batches /tmp/q06-batches.bin --out "$out/hf_q06_fp32_curve.json" \
  --model /tmp/q06-init --precision fp32
stage curves 20 bash -c 'for pair in "/tmp/q06-out/metrics-q06-1.jsonl '"$out"'/hf_q06_curve.json" \
    "'"$out"'/hf_q06_fp32_curve.json '"$out"'/hf_q06_curve.json" "/tmp/q06-out/metrics-q06-1.jsonl '"$out"'/hf_q06_fp32_curve.json"; do
  echo "--- $pair"; python3 tools/verify/compare_curves.py $pair --tol 6e-4 --steps '"$steps"'; done'
stage hf_verify 150 bash tools/verify/gpu_verify.sh .gpu
ls -la "$out"
