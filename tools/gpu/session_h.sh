#!/usr/bin/env bash
# GPU session H (nvidia-h200-x2), in parts (PARTS; several calls on a warm machine):
#   attn     bench_kernels (our attention with the same-run GEMM/copy ceilings) and
#            bench/kernels/torch_sdpa.py (cuDNN fused attention and FlashAttention-2 through
#            PyTorch's SDPA on the same cases): issue 3's "own kernels or cuDNN, by measurement"
#   curves   issue 4's loss curves in a fine-tuning regime: Qwen3-0.6B (GPU 0) and Qwen3-1.7B
#            (GPU 1) at once. Each: ours trains the random init PRE steps (lr 1e-4 cosine) and saves
#            FP32 weights; from them, ours and HF + torch AdamW fine-tune STEPS steps (lr 1e-5
#            constant, another data order) on the same batches; compare_curves.py at 6e-4. Then
#            (MIRROR_REF=1) HF computing our arithmetic (MIRROR_PRECISION, default
#            bf16-mirror-fp32-norms: BF16 weights but FP32 norms, our default). For 0.6B
#            (FP32_REF=1) also HF FP32 against HF autocast (the reference's own noise).
#   service  session_g.sh's copy and warm parts (bench_copy; cold/warm submit -> first step)
#   floor    only the 0.6B noise floor: the same pretrain (deterministic), then HF FP32 for
#            FLOOR_STEPS steps on the fine-tuning batches (compare with the autocast curve of a
#            "curves" run); on the visible GPU
# Output: $out/session-h.log and the parts' files.
set -u
PARTS=${PARTS:-"attn curves service"}
PRE=${PRE:-150}
STEPS=${STEPS:-200}
source tools/gpu/lib.sh
log_session session-h
echo "=== session H $(date -u +%FT%TZ) parts: $PARTS; $(nvidia-smi -L | wc -l) GPU(s)"

if has attn; then
  timeout 200 bench_kernels > /tmp/bench_kernels.log 2>&1
  echo "--- bench_kernels: exit $?"
  grep -E "ceilings|attn_|layer|head" /tmp/bench_kernels.log | grep -v "^JSON" | head -n 60
  grep "^JSON" /tmp/bench_kernels.log > "$out/bench_kernels.jsonl"
  timeout 200 python3 bench/kernels/torch_sdpa.py > "$out/torch_sdpa.jsonl" 2> /tmp/torch_sdpa.err
  echo "--- torch_sdpa: exit $?"; cat "$out/torch_sdpa.jsonl"; tail -n 5 /tmp/torch_sdpa.err
fi

# finetune_curves TAG PRESET GPU: pretrain, fine-tune (ours, HF), compare; logs /tmp/ft-TAG/*.
finetune_curves() {
  local tag=$1 preset=$2 gpu=$3 d=/tmp/ft-$1
  rm -rf "$d"; mkdir -p "$d"
  pretrain_spec "$d" "$tag" "$preset" "$PRE"
  finetune_spec "$d" "$tag" "$d/pre/checkpoint-$PRE" "$STEPS"
  export CUDA_VISIBLE_DEVICES=$gpu
  local t0=$SECONDS
  slidedp run "$d/pre.yaml" --backend cuda --run-dir "$d/run-pre" > "$d/pre.progress" 2>&1
  echo "--- $tag pretrain: exit $? after $((SECONDS - t0)) s: $(tail -n 2 "$d/pre.progress" | tr '\n' ' ')"
  if [ "${FLOOR_ONLY:-0}" = 1 ]; then
    dump_batches --job "$d/ft.yaml" --out "$d/batches.bin" > "$d/dump.log" 2>&1
    t0=$SECONDS
    # Both precisions on this checkpoint (a pretrain on another run may differ: our attention
    # backward accumulates dQ with atomics, so runs are not bitwise repeatable).
    timeout 60 python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" \
      --model "$d/pre/checkpoint-$PRE" --steps "${FLOOR_STEPS:-100}" --out "$out/$tag-floor-autocast.json" \
      > "$d/hf-autocast.log" 2>&1
    echo "--- $tag HF autocast (${FLOOR_STEPS:-100} steps): exit $? after $((SECONDS - t0)) s"
    t0=$SECONDS
    timeout "${FLOOR_CAP:-300}" python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" \
      --model "$d/pre/checkpoint-$PRE" --precision fp32 --steps "${FLOOR_STEPS:-100}" --out "$out/$tag-floor-fp32.json" \
      > "$d/hf-fp32.log" 2>&1
    echo "--- $tag HF fp32 (${FLOOR_STEPS:-100} steps): exit $? after $((SECONDS - t0)) s: $(tail -n 1 "$d/hf-fp32.log")"
    python3 tools/verify/compare_curves.py "$out/$tag-floor-fp32.json" "$out/$tag-floor-autocast.json" --tol 6e-4 2>&1 |
      head -n 2 | sed "s/^/$tag floor, HF fp32 vs HF autocast: /"
    return
  fi
  t0=$SECONDS
  slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft" > "$d/ft.progress" 2>&1
  echo "--- $tag ours fine-tune: exit $? after $((SECONDS - t0)) s: $(tail -n 2 "$d/ft.progress" | tr '\n' ' ')"
  t0=$SECONDS
  dump_batches --job "$d/ft.yaml" --out "$d/batches.bin" > "$d/dump.log" 2>&1 &&
    python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" --model "$d/pre/checkpoint-$PRE" \
      --out "$d/hf.json" > "$d/hf.log" 2>&1
  echo "--- $tag HF fine-tune: exit $? after $((SECONDS - t0)) s: $(tail -n 1 "$d/hf.log")"
  cp "$d"/ft/metrics-*.jsonl "$out/$tag-ours.jsonl" 2>/dev/null; cp "$d/hf.json" "$out/$tag-hf.json" 2>/dev/null
  python3 tools/verify/compare_curves.py "$out/$tag-ours.jsonl" "$out/$tag-hf.json" --tol 6e-4 --steps "$STEPS" \
    --json "$d/compare.json" 2>&1 | sed "s/^/$tag: /"
  if [ "${MIRROR_REF:-1}" = 1 ]; then  # HF computing what our workers compute (MIRROR_PRECISION)
    local mp=${MIRROR_PRECISION:-bf16-mirror-fp32-norms}
    t0=$SECONDS
    python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" --model "$d/pre/checkpoint-$PRE" \
      --precision "$mp" --out "$out/$tag-hf-mirror.json" > "$d/hf-mirror.log" 2>&1
    echo "--- $tag HF $mp fine-tune: exit $? after $((SECONDS - t0)) s"
    python3 tools/verify/compare_curves.py "$out/$tag-ours.jsonl" "$out/$tag-hf-mirror.json" --tol 6e-4 --steps "$STEPS" \
      2>&1 | head -n 2 | sed "s/^/$tag vs HF $mp: /"
    python3 tools/verify/compare_curves.py "$out/$tag-hf-mirror.json" "$out/$tag-hf.json" --tol 6e-4 --steps "$STEPS" \
      2>&1 | head -n 2 | sed "s/^/$tag HF $mp vs HF autocast: /"
  fi
  if [ "$tag" = q06 ] && [ "${FP32_REF:-1}" = 1 ]; then
    t0=$SECONDS
    timeout 150 python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" --model "$d/pre/checkpoint-$PRE" \
      --precision fp32 --steps 60 --out "$d/hf-fp32.json" > "$d/hf-fp32.log" 2>&1
    echo "--- $tag HF fp32 (60 steps): exit $? after $((SECONDS - t0)) s"
    python3 tools/verify/compare_curves.py "$d/hf-fp32.json" "$d/hf.json" --tol 6e-4 2>&1 | sed "s/^/$tag HF fp32 vs autocast: /"
    python3 tools/verify/compare_curves.py "$d/hf-fp32.json" "$out/$tag-ours.jsonl" --tol 6e-4 2>&1 | sed "s/^/$tag HF fp32 vs ours: /"
  fi
}

if has curves; then
  q06_data_and_spec
  cat "$out/data.log" | tail -n 2
  finetune_curves q06 qwen3-0.6b 0 > /tmp/curves-q06.log 2>&1 &
  p06=$!
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then finetune_curves q17 qwen3-1.7b 1 > /tmp/curves-q17.log 2>&1 & fi
  wait
  cat /tmp/curves-q06.log /tmp/curves-q17.log 2>/dev/null
fi

if has floor; then
  q06_data_and_spec
  FLOOR_ONLY=1 finetune_curves q06 qwen3-0.6b "${FLOOR_GPU:-0}"
fi

if has service; then
  PARTS="copy warm" bash tools/gpu/session_g.sh > /tmp/session-g.out 2>&1
  cat /tmp/session-g.out
fi
echo "=== session H done after $SECONDS s"
