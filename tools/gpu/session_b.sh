#!/usr/bin/env bash
# GPU-machine session, part B: Qwen3-0.6B trained by slidedp (CUDA worker, 1 GPU) and by HF
# transformers + torch.optim.AdamW from the same initial weights and batches on real text;
# checkpoint interoperability with HF; tokenizer fuzz comparison.
set -u
source tools/gpu/lib.sh
# Real text: the Python standard library's sources, tokenized with the Qwen3 tokenizer.
q06_data_and_spec
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
