#!/usr/bin/env bash
# GPU session L (nvidia-h200-x2): cuDNN attention as the backend's attention (issue 3), in parts
# (PARTS; the parts on GPU 0 and GPU 1 run at the same time):
#   check   GPU 0: cuda_kernel_check (kernels; the backend against the CPU backend with the own
#           kernels and with cuDNN; whether cuDNN's backward is bitwise repeatable), then the tiny
#           job on CUDA (the worker log names the attention it uses).
#           GPU 1: tools/verify/gpu_verify.sh (whole models against HF; the backend's default
#           attention, i.e. cuDNN)
#   bench   GPU 0: bench_kernels (per-op, decoder layer at 8B over 64K tokens, LM head + loss)
#   e2e4b   GPU 1: bench/e2e at Qwen3-4B, 1 GPU, 64K tokens: ours, compute-only and FSDP2
#           GPU-resident in the same run (issue 4's 0.95 and 1.5x ratios)
# Output: $out/session-l.log, kcheck.log, hf_compare.log, bench_kernels.log, bench-4b.md.
set -u
PARTS=${PARTS:-"check bench e2e4b"}
source tools/gpu/lib.sh
log_session session-l
echo "=== session L $(date -u +%FT%TZ) parts: $PARTS; $(nvidia-smi -L | wc -l) GPU(s)"
find_cudnn

gpu1() {  # the GPU-1 side: verification against HF, then the end-to-end bench
  export CUDA_VISIBLE_DEVICES=1
  if has check; then
    OUT=/tmp/verify timeout 330 bash tools/verify/gpu_verify.sh .gpu > /tmp/verify.out 2>&1
    echo "--- gpu_verify: exit $?"; grep -E "^=== .*exit|hf_compare:" /tmp/verify.out
    cp /tmp/verify/hf_compare.log "$out/hf_compare.log" 2>/dev/null
  fi
  if has e2e4b; then
    MODEL=qwen3-4b GPUS=1 TOKENS_LIST=65536 WHAT="ours compute fsdp2" BUDGET_S=330 WORK=/tmp/e2e4b \
      bash bench/e2e/run_bench.sh > /tmp/e2e4b.out 2>&1
    echo "--- e2e 4B: exit $?"; cp "$out/bench-summary.md" "$out/bench-4b.md" 2>/dev/null; cat "$out/bench-4b.md"
  fi
}
gpu1 > /tmp/gpu1.out 2>&1 &
gpu1_pid=$!

export CUDA_VISIBLE_DEVICES=0
if has check; then
  timeout 300 cuda_kernel_check > "$out/kcheck.log" 2>&1
  echo "--- cuda_kernel_check: exit $?: $(grep -c '^PASS' "$out/kcheck.log") PASS, $(grep -c '^FAIL' "$out/kcheck.log") FAIL"
  grep -E "^FAIL|^SKIP|^INFO" "$out/kcheck.log" | head -n 40
  make_text_dataset --input examples/tiny/corpus.txt --output build/examples/tiny-data --repeat 4 > /dev/null 2>&1
  timeout 90 slidedp run examples/tiny/job.yaml --backend cuda --run-dir /tmp/tiny-run > /tmp/tiny.log 2>&1
  echo "--- tiny on CUDA: exit $?: $(tail -n 2 /tmp/tiny.log | tr '\n' ' ')"
  grep -rh "attention" /tmp/tiny-run 2>/dev/null | head -n 3
fi
if has bench; then
  timeout 240 bench_kernels > "$out/bench_kernels.log" 2>&1
  echo "--- bench_kernels: exit $?"
  grep -E "ceilings|attn_|layer_|head_" "$out/bench_kernels.log" | grep -v "^JSON"
fi
wait "$gpu1_pid"
cat /tmp/gpu1.out
echo "=== session L done after $SECONDS s"
