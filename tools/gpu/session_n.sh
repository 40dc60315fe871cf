#!/usr/bin/env bash
# GPU session N (nvidia-h200-x2):
#   GPU 0: issue 4's FSDP2 ratio in one run: Qwen3-4B, ours with act_policy auto at 64K tokens
#          (recompute on step 1, then keep-all for the last layers that fit) and FSDP2
#          GPU-resident at 16K and 32K (64K does not fit it)
#   GPU 1: the Qwen3-1.7B fine-tuning curve of ours again (session M's was not fetched): pretrain
#          150 + fine-tune 200 steps, the same specs; ours is deterministic now (cuDNN backward),
#          so it is compared with session M's HF curves on the same checkpoint
# Output: $out/session-n.log, bench-4b-auto.md, bench-4b-fsdp2.md, q17-ours.jsonl, q17-pre.jsonl.
set -u
source tools/gpu/lib.sh
log_session session-n
echo "=== session N $(date -u +%FT%TZ); $(nvidia-smi -L | wc -l) GPU(s)"
find_cudnn
q17() {
  export CUDA_VISIBLE_DEVICES=1
  q06_data_and_spec > /dev/null
  local d=/tmp/ft-q17 t0=$SECONDS
  rm -rf "$d"; mkdir -p "$d"
  pretrain_spec "$d" q17 qwen3-1.7b 150
  finetune_spec "$d" q17 "$d/pre/checkpoint-150" 200
  slidedp run "$d/pre.yaml" --backend cuda --run-dir "$d/run-pre" > "$d/pre.progress" 2>&1
  echo "--- q17 pretrain: exit $? after $((SECONDS - t0)) s: $(tail -n 1 "$d/pre.progress")"
  cp "$d"/pre/metrics-*.jsonl "$out/q17-pre.jsonl" 2>/dev/null
  t0=$SECONDS
  slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft" > "$d/ft.progress" 2>&1
  echo "--- q17 fine-tune: exit $? after $((SECONDS - t0)) s: $(tail -n 1 "$d/ft.progress")"
  cp "$d"/ft/metrics-*.jsonl "$out/q17-ours.jsonl" 2>/dev/null
}
q17 > /tmp/q17.out 2>&1 &
qpid=$!
export CUDA_VISIBLE_DEVICES=0
MODEL=qwen3-4b GPUS=1 TOKENS_LIST=65536 WHAT=ours ACT_POLICY=auto BUDGET_S=200 WORK=/tmp/e2e-auto \
  bash bench/e2e/run_bench.sh > /tmp/e2e-auto.out 2>&1
echo "--- 4B ours act_policy auto: exit $?"; cp "$out/bench-summary.md" "$out/bench-4b-auto.md"
grep -rh "act_policy auto" /tmp/e2e-auto 2>/dev/null | head -n 2
MODEL=qwen3-4b GPUS=1 TOKENS_LIST="16384 32768" WHAT=fsdp2 BUDGET_S=240 WORK=/tmp/e2e-fsdp2 \
  bash bench/e2e/run_bench.sh > /tmp/e2e-fsdp2.out 2>&1
echo "--- 4B FSDP2: exit $?"; cp "$out/bench-summary.md" "$out/bench-4b-fsdp2.md"
grep -E "^\| [0-9]" "$out/bench-4b-auto.md" "$out/bench-4b-fsdp2.md" | head -n 12
rm -f "$out/bench-summary.md" "$out/bench-results.json" "$out/bench-logs.txt"
wait "$qpid"; cat /tmp/q17.out
echo "=== session N done after $SECONDS s"
