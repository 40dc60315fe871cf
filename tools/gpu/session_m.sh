#!/usr/bin/env bash
# GPU session M (nvidia-h200-x2): the FP32 norm weights (runtime.norm_weights: fp32, the new
# default) and cuDNN attention in the fine-tuning curves (issue 4), and their kernel checks.
#   GPU 0: cuda_kernel_check (the FP32-weight RMSNorm and q/k-norm kernels, the backend against
#          the CPU backend with FP32 norms) in the background, and the Qwen3-0.6B curves
#   GPU 1: the Qwen3-1.7B curves
# Curves: session_h.sh's (pretrain 150 steps, fine-tune 200 at lr 1e-5; ours vs HF autocast,
# then vs HF bf16-mirror-fp32-norms, the reference computing our arithmetic).
# Output: $out/session-m.log, kcheck.log, the curve files.
set -u
source tools/gpu/lib.sh
log_session session-m
echo "=== session M $(date -u +%FT%TZ); $(nvidia-smi -L | wc -l) GPU(s)"
find_cudnn
( CUDA_VISIBLE_DEVICES=0 timeout 300 cuda_kernel_check > "$out/kcheck.log" 2>&1
  echo "--- cuda_kernel_check: exit $?: $(grep -c '^PASS' "$out/kcheck.log") PASS, $(grep -c '^FAIL' "$out/kcheck.log") FAIL"
  grep -E "^FAIL|gain|fp32 norms\]" "$out/kcheck.log" | head -n 30 ) > /tmp/kcheck.out 2>&1 &
kpid=$!
FP32_REF=0 PARTS=curves bash tools/gpu/session_h.sh > /tmp/curves.out 2>&1
grep -E "^---|^q06|^q17" /tmp/curves.out
wait "$kpid"; cat /tmp/kcheck.out
echo "=== session M done after $SECONDS s"
