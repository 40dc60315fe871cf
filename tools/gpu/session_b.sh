#!/usr/bin/env bash
# GPU-machine session, part B: Qwen3-0.6B trained by slidedp (CUDA worker, 1 GPU) and by HF
# transformers + torch.optim.AdamW from the same initial weights and batches on real text;
# checkpoint interoperability with HF; tokenizer fuzz comparison.
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
# Real text: the Python standard library's sources, tokenized with the Qwen3 tokenizer.
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
stage ours_q06 280 bash -c 'slidedp run /tmp/q06.yaml --backend cuda --run-dir /tmp/q06-run > /tmp/q06-progress.log 2>&1; rc=$?;
  tail -n 5 /tmp/q06-progress.log; tail -n 20 /tmp/q06-run/*.log; cp /tmp/q06-out/metrics-*.jsonl '"$out"'/ 2>/dev/null; exit $rc'
stage hf_q06 150 bash -c 'dump_batches --job /tmp/q06.yaml --out /tmp/q06-batches.bin --write-init /tmp/q06-init &&
  python3 tools/verify/hf_train_reference.py --batches /tmp/q06-batches.bin --out '"$out"'/hf_q06_curve.json --model /tmp/q06-init'
stage curves 20 bash -c 'python3 tools/verify/compare_curves.py /tmp/q06-out/metrics-*.jsonl '"$out"'/hf_q06_curve.json --tol 6e-4 --steps '"$steps"
stage ckpt_hf 60 python3 tools/hf_checkpoint_check.py selftest --ckpt-tool .gpu/bin/ckpt_tool
stage tok_fuzz 30 python3 tools/tokenizer/compare_and_bench.py --tok-bench .gpu/bin/tok_bench \
  --tokenizer tests/data/tokenizer/qwen3/tokenizer.json --build-corpus "" --fuzz-docs 20000 --fuzz-seed 7 \
  --threads 16 --repeat 1 --corpus /tmp/fuzz.jsonl --mismatches "$out/tok_mismatches.jsonl"
ls -la "$out"
