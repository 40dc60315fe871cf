#!/usr/bin/env bash
# GPU session F (nvidia-h200-x2): activation offload (runtime.offload_ratio) on the GPU.
#   1. bench_step (compute-only) Qwen3-4B, 64K tokens: offload ratio 0 vs 0.5 vs 1 — same loss
#      (offload only moves the layer-input checkpoints), step time and GPU peak.
#   2. Qwen3-0.6B on 2 GPUs (gpu gradient route), 10 steps: offload_ratio 1.0 vs 0 through the
#      whole service: identical loss curves; NCCL communicator setup times from the worker logs.
set -u
source tools/gpu/lib.sh
log_session session-f
echo "=== session F $(date -u +%FT%TZ)"
for r in 0 0.5 1; do
  timeout 60 bench_step --model qwen3-4b --seq 4096 --tokens 65536 --micro-batch-rows 4 --steps 3 --offload-ratio $r 2>/dev/null | tail -n 1
done
mkdir -p /tmp/f
python3 bench/e2e/make_dataset.py --out /tmp/f/data --rows 80 --seq-len 1024 --vocab 151936 > /dev/null
for r in 0 1.0; do
  d=/tmp/f/r$r
  mkdir -p $d
  cat > $d/job.yaml <<YAML
name: off
model: {preset: qwen3-0.6b, init_seed: 0}
data: {path: /tmp/f/data}
output: {dir: $d/out, save_final: false}
train: {seq_len: 1024, global_batch: 8, micro_batch: 2, steps: 10, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-5}
runtime: {workers: 2, offload_ratio: $r}
YAML
  CUDA_VISIBLE_DEVICES=0,1 timeout 90 slidedp run $d/job.yaml --backend cuda --run-dir $d/run > $d/progress.log 2>&1
  echo "--- offload $r: exit $?: $(tail -n 1 $d/progress.log)"
  grep -h "NCCL communicator" $d/run/*.log
  tail -n 1 $d/out/metrics-*.jsonl
done
python3 tools/verify/compare_curves.py /tmp/f/r0/out/metrics-*.jsonl /tmp/f/r1.0/out/metrics-*.jsonl --tol 0 --steps 10
echo "=== session F done after $SECONDS s"
