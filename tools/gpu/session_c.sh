#!/usr/bin/env bash
# GPU-machine session C: after a change to the CUDA backend's numerics — kernel checks, the tiny
# job on the CUDA worker, Qwen3-0.6B 200 steps against HF (bf16 autocast) and HF's own FP32
# noise floor, then the whole-model HF comparison. Logs to $OUT.
set -u
out=${OUT:-/tmp/slidedp-gpu}
steps=${STEPS:-200}
mkdir -p "$out"
[ -d .gpu/bin ] || bash tools/gpu/unpack.sh
source .gpu/lib/gpu-env.sh .gpu/lib
export PATH=$PWD/.gpu/bin:$PATH PYTHONUNBUFFERED=1
stage() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" > "$out/$name.log"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
}
stage kernel_check 90 cuda_kernel_check
stage tiny_cuda 60 bash -c 'make_text_dataset --input examples/tiny/corpus.txt --output build/examples/tiny-data --repeat 4 &&
  slidedp run examples/tiny/job.yaml --backend cuda --run-dir /tmp/tiny-run 2>&1 | tail -n 4'
stage data 60 bash -c 'python3 - <<PY
import glob, json
with open("/tmp/corpus.jsonl", "w") as f:
    for p in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))[:3000]:
        try: t = open(p, encoding="utf-8").read()
        except Exception: continue
        if len(t) > 200: f.write(json.dumps({"text": t}) + "\n")
PY
slidedp prepare --model tests/data/tokenizer/qwen3 --input /tmp/corpus.jsonl --output /tmp/ds --seq-len 1024 --pack --overwrite'
cat > /tmp/q06.yaml <<YAML
name: q06
model: {preset: qwen3-0.6b, init_seed: 0}
data: {path: /tmp/ds/train}
output: {dir: /tmp/q06-out, save_final: false}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: $steps, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-4, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 10, min_lr: 1.0e-5}
runtime: {workers: 1}
YAML
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
