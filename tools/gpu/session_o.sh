#!/usr/bin/env bash
# GPU session O (nvidia-h200-x2):
#   GPU 0: Qwen3-4B, ours with act_policy auto at 128K tokens (the host update amortised over
#          twice the tokens of session N's 64K run), against session N's FSDP2 (same machine type)
#   GPU 1: the Qwen3-1.7B fine-tuning curves again, ours and HF autocast in the same run
#          (session N's own pretrain did not reproduce session M's checkpoint bit for bit)
# Output: $out/session-o.log, bench-4b-auto-128k.md, q17-ours.jsonl, q17-hf.json, q17-pre.jsonl.
set -u
source tools/gpu/lib.sh
log_session session-o
echo "=== session O $(date -u +%FT%TZ); $(nvidia-smi -L | wc -l) GPU(s)"
find_cudnn
q17() {
  export CUDA_VISIBLE_DEVICES=1
  MIRROR_REF=0 FP32_REF=0 PARTS=none bash -c 'source tools/gpu/session_h.sh; q06_data_and_spec > /dev/null; finetune_curves q17 qwen3-1.7b 1' 
}
q17 > /tmp/q17.out 2>&1 &
qpid=$!
export CUDA_VISIBLE_DEVICES=0
MODEL=qwen3-4b GPUS=1 TOKENS_LIST=131072 WHAT=ours ACT_POLICY=auto BUDGET_S=240 WORK=/tmp/e2e-auto \
  bash bench/e2e/run_bench.sh > /tmp/e2e-auto.out 2>&1
echo "--- 4B ours act_policy auto 128K: exit $?"; cp "$out/bench-summary.md" "$out/bench-4b-auto-128k.md"
grep -rh "act_policy auto" /tmp/e2e-auto 2>/dev/null | head -n 2
grep -E "^\| [0-9]" "$out/bench-4b-auto-128k.md" | head -n 6
rm -f "$out/bench-summary.md" "$out/bench-results.json" "$out/bench-logs.txt"
wait "$qpid"; grep -E "^---|^q17" /tmp/q17.out
cp /tmp/ft-q17/pre/metrics-*.jsonl "$out/q17-pre.jsonl" 2>/dev/null
echo "=== session O done after $SECONDS s"
