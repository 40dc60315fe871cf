#!/usr/bin/env bash
# GPU session K (nvidia-h200-x2), the next one, in parts (PARTS; several calls on a warm machine):
#   cudnn    cuda_kernel_check and bench_kernels --quick with the cuDNN attention path
#            (worker/kernels/cudnn_attention.cu: first run on a GPU); libcudnn from the system,
#            else from PyTorch's pip package; cuDNN's own error log on
#   curves   session_h.sh curves: the fine-tuning regime for 0.6B and 1.7B against HF autocast
#            and HF bf16-mirror (the reference computing what our workers compute)
#   routes   bench/e2e/scaling.sh's routes part on 2 GPUs (Qwen3-8B, 16K and 128K tokens per GPU:
#            replicated/sharded delivery x GPU/CPU reduction), issue 7
# Output: $out/session-k.log and the parts' files.
set -u
PARTS=${PARTS:-"cudnn"}
source tools/gpu/lib.sh
log_session session-k
echo "=== session K $(date -u +%FT%TZ) parts: $PARTS"

if has cudnn; then
  find_cudnn
  CUDNN_LOGERR_DBG=1 CUDNN_LOGDEST_DBG=stderr timeout 240 cuda_kernel_check --kernels-only > /tmp/kcheck.log 2> /tmp/kcheck.err
  echo "--- cuda_kernel_check: exit $?: $(grep -c '^PASS' /tmp/kcheck.log) PASS, $(grep -c '^FAIL' /tmp/kcheck.log) FAIL"
  grep -E "^FAIL|^SKIP|cudnn" /tmp/kcheck.log | head -n 40
  grep -i -m 20 "error\|unsupported" /tmp/kcheck.err
  timeout 200 bench_kernels --quick > /tmp/bench_kernels.log 2>&1
  echo "--- bench_kernels --quick: exit $?"
  grep -E "ceilings|attn_" /tmp/bench_kernels.log | grep -v "^JSON"
fi

if has curves; then
  PARTS=curves bash tools/gpu/session_h.sh > /tmp/curves.out 2>&1
  grep -E "^---|vs HF|q06:|q17:" /tmp/curves.out
fi

if has routes; then
  PARTS=routes bash bench/e2e/scaling.sh > /tmp/routes.out 2>&1
  echo "--- routes: exit $?"; grep -E "Targets|^\| |MET|NOT" "$out"/routes-*.md 2>/dev/null | head -n 40
fi
echo "=== session K done after $SECONDS s"
