#!/usr/bin/env bash
# GPU session P (nvidia-h200 or -x2; session 5), in parts (PARTS):
#   probe    what the machine offers for a stable fine-tuning regime: pretrained Qwen3 weights in
#            the HF cache (a real checkpoint instead of a 150-step pretrain from random weights)
#   determ   bitwise repeatability: cuda_kernel_check's attention cases with and without
#            SLIDEDP_DETERMINISTIC=1, and the same 30-step Qwen3-0.6B job twice per setting
#            (metrics files compared bitwise). (Session 5 ran this and detgrads with the former
#            SLIDEDP_DETERMINISTIC, cuDNN engines chosen by their notes, since removed.)
#   graddiff the 1.7B gradient-norm gap (session 4: 18% at fine-tune step 2 while the losses
#            agree): pretrain 150 steps, fine-tune 2 steps saving the FP32 checkpoint after each,
#            then tools/verify/grad_diff.py on checkpoint-1 with step 1's batch: ours against HF
#            autocast and HF FP32 on the same weights, per tensor (the last GPU)
#   ratio    issue 4's 1.5x FSDP2: Qwen3-4B, 1 GPU, act_policy auto with the layer inputs offloaded
#            (offload_ratio 1.0 frees ~24/48 GB at 64K/128K for more keep-all layers), 64K and
#            128K, and FSDP2 GPU-resident at 16K in the same run; also measures the new default
#            rings (4 x 32 MiB: host_state_bytes should read 13.07 GiB/B) (GPU 0)
#   detgrads where the runs stop being repeatable, with and without SLIDEDP_DETERMINISTIC:
#            model_grads (the backend without the pipeline) three times on one 0.6B batch, tensors
#            compared bitwise (grad_diff.py --repeat); the 0.6B job twice for 3 steps with
#            SLIDEDP_LOG_UNIT_NORMS=1, the units whose squared gradient norms differ
#   detblock the 0.6B job twice for 2 steps as launched, then twice with CUDA_LAUNCH_BLOCKING=1 (no
#            kernel overlaps another): every unit's squared gradient norm at step 1 compared
#   ordered  SLIDEDP_DETERMINISTIC=1 (attention backward through our kernels with dQ added in a fixed
#            order): the kernel check's ordered-dQ cases, bench_kernels --quick's attention
#            backwards (ordered, atomics, cuDNN), then the 0.6B job twice for 3 steps with it (every
#            unit's squared gradient norm compared) and once without (step times)
#   stable   issue 4's curves in a steadier regime: Qwen3-0.6B (or STABLE_PRESET) pretrained longer
#            (STABLE_PRE steps of 32 x 1,024 tokens at lr 3e-4 cosine, ~1 epoch of the text,
#            instead of 150 x 8 x 1,024)
#            or the pretrained weights in $PRETRAINED when the probe found some; then the same
#            200-step fine-tune as before (lr 1e-5, 8 x 1,024, clip 1.0): ours against HF autocast,
#            and HF bf16-mirror-fp32-norms against HF autocast (the reference's own spread;
#            STABLE_REFS picks the HF precisions, STABLE_HF_CAP their time cap; STABLE_PROBE=1 has
#            the autocast reference record each batch's FP32 loss too, which compare_curves shows
#            beside the steps that differ most)
#            STABLE_DET=1 runs the pretrain and our fine-tune in deterministic mode (repeatable
#            across calls); STABLE_UNITS, STABLE_OURS, STABLE_WEIGHTS, STABLE_REPEAT,
#            STABLE_DEADLINE, STABLE_FT_LR, STABLE_LAYOUTS: see the part
#   stableat one step of a STABLE_DET=1 run taken apart (STABLE_AT=step): the same pretrain and our
#            fine-tune to the step before, bit for bit, then that step's gradients and loss, ours
#            against HF on the same weights (grad_diff.py)
#   layouts  cuda_kernel_check --attn-layouts on the 1.7B fine-tune's 200 steps of batches: each
#            micro-batch's document layout through cuDNN's attention and the own kernels, compared
#            per document (LAYOUTS_CAP seconds, default 300)
#   routes   issue 7: bench/e2e/scaling.sh routes on 2 GPUs (Qwen3-8B, 16K and 128K per GPU)
#   weak14   issue 7: bench/e2e/scaling.sh weak14 on 1 and 2 GPUs (Qwen3-14B, 64K per GPU)
# Output: $out/session-p.log and the parts' files.
set -u
PARTS=${PARTS:-"probe determ"}
source tools/gpu/lib.sh
log_session session-p
echo "=== session P $(date -u +%FT%TZ) parts: $PARTS; $(nvidia-smi -L | wc -l) GPU(s)"
find_cudnn

if has probe; then
  for d in "${HF_HOME:-$HOME/.cache/huggingface}/hub" /root/.cache/huggingface/hub /models /data; do
    [ -d "$d" ] && ls "$d" 2>/dev/null | grep -i -E "qwen" | sed "s#^#$d: #" | head -n 20
  done
  timeout 30 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name config.json -path "*[Qq]wen*" -print 2>/dev/null | head -n 20
  python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
  df -h / /tmp | tail -n 2; free -g | head -n 2
  echo "--- probe done"
fi

if has determ; then
  steps=30 q06_data_and_spec > /dev/null  # (lib.sh reads $steps into the spec)
  for det in 0 1; do
    SLIDEDP_DETERMINISTIC=$det timeout 300 cuda_kernel_check --kernels-only > /tmp/kcheck-$det.log 2>&1
    echo "--- kernel check, SLIDEDP_DETERMINISTIC=$det: exit $?: $(grep -c '^PASS' /tmp/kcheck-$det.log) PASS, $(grep -c '^FAIL' /tmp/kcheck-$det.log) FAIL"
    grep -E "^FAIL|repeatable" /tmp/kcheck-$det.log
    for run in a b; do
      rm -rf /tmp/q06-out
      SLIDEDP_DETERMINISTIC=$det slidedp run /tmp/q06.yaml --backend cuda --run-dir /tmp/rep-$det-$run > /dev/null 2>&1
      python3 -c 'import json,sys; print(json.dumps([(j["loss"], j["grad_norm"]) for j in map(json.loads, open(sys.argv[1]))]))' \
        /tmp/q06-out/metrics-*.jsonl > /tmp/rep-$det-$run.json
    done
    if cmp -s /tmp/rep-$det-a.json /tmp/rep-$det-b.json; then echo "--- 0.6B x2, deterministic=$det: bitwise equal losses and grad norms"
    else echo "--- 0.6B x2, deterministic=$det: differ"; fi
  done
fi

if has graddiff; then
  q06_data_and_spec > /dev/null
  d=/tmp/gd-q17; rm -rf "$d"; mkdir -p "$d"
  pretrain_spec "$d" q17 qwen3-1.7b 150
  # One fine-tuning step saving its FP32 checkpoint (two would not fit the disk with the
  # pretrain's), then step 1's batch (0-based) from the same sampler.
  cat > "$d/ft.yaml" <<YAML
name: q17-ft
model: {path: $d/pre/checkpoint-150}
data: {path: /tmp/ds/train}
output: {dir: $d/ft, save_every: 1, save_dtype: fp32, keep_last: 1}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: 1, seed: 1, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-5, weight_decay: 0.01}
schedule: {kind: constant}
runtime: {workers: 1}
YAML
  restore_visible=${CUDA_VISIBLE_DEVICES-unset}
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(( $(nvidia-smi -L | wc -l) - 1 ))}  # (default: the last GPU)
  slidedp run "$d/pre.yaml" --backend cuda --run-dir "$d/run-pre" > "$d/pre.progress" 2>&1 &&
    slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft" > "$d/ft.progress" 2>&1 &&
    dump_batches --job "$d/ft.yaml" --steps 2 --out "$d/batches.bin" > /dev/null 2>&1
  echo "--- graddiff runs: exit $?: $(tail -n 1 "$d/ft.progress")"
  cat "$d"/ft/metrics-*.jsonl 2>/dev/null | cut -c1-160
  timeout 300 python3 tools/verify/grad_diff.py --bin "$(command -v model_grads)" --model "$d/ft/checkpoint-1" \
    --batches "$d/batches.bin" --step 1 --top 20
  [ "$restore_visible" = unset ] && unset CUDA_VISIBLE_DEVICES
  rm -rf "$d"  # 55 GB of checkpoints
fi

if has ratio; then
  CUDA_VISIBLE_DEVICES=0 MODEL=qwen3-4b GPUS=1 TOKENS_LIST="${RATIO_TOKENS:-65536 131072}" WHAT=ours ACT_POLICY=auto \
    RUNTIME_EXTRA="${RATIO_RUNTIME_EXTRA-offload_ratio: 1.0}" BUDGET_S=300 WORK=/tmp/e2e-ratio \
    bash bench/e2e/run_bench.sh > /tmp/ratio.out 2>&1
  rc=$?; tag=4b-auto; [ -n "${RATIO_RUNTIME_EXTRA-offload}" ] && tag=4b-auto-offload
  echo "--- 4B auto (${RATIO_RUNTIME_EXTRA-offload_ratio: 1.0}): exit $rc"; cp "$out/bench-summary.md" "$out/bench-$tag.md"
  grep -rh "act_policy auto" /tmp/e2e-ratio 2>/dev/null | head -n 2
  if [ "${RATIO_FSDP2:-1}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 MODEL=qwen3-4b GPUS=1 TOKENS_LIST=16384 WHAT=fsdp2 BUDGET_S=120 WORK=/tmp/e2e-ratio-fsdp2 \
      bash bench/e2e/run_bench.sh > /tmp/ratio-fsdp2.out 2>&1
    echo "--- 4B FSDP2 16K: exit $?"; cp "$out/bench-summary.md" "$out/bench-4b-fsdp2-16k.md"
  fi
  grep -E "^\| [0-9]" "$out/bench-$tag.md" "$out/bench-4b-fsdp2-16k.md" 2>/dev/null | head -n 12
  rm -f "$out/bench-summary.md" "$out/bench-results.json" "$out/bench-logs.txt"
fi

if has detgrads; then
  steps=3 Q06_WARMUP=1 q06_data_and_spec > /dev/null
  d=/tmp/det; rm -rf "$d"; mkdir -p "$d"
  dump_batches --job /tmp/q06.yaml --steps 1 --out "$d/batches.bin" --write-init "$d/init" > "$d/dump.log" 2>&1
  echo "--- detgrads init: exit $?: $(tail -n 1 "$d/dump.log")"
  for det in 0 1; do
    echo "--- model_grads x3, SLIDEDP_DETERMINISTIC=$det"
    SLIDEDP_DETERMINISTIC=$det timeout 120 python3 tools/verify/grad_diff.py --bin "$(command -v model_grads)" \
      --model "$d/init" --batches "$d/batches.bin" --step 0 --no-hf --repeat 2 --top 8 2>&1 | grep -v "wrote"
    for run in a b; do
      rm -rf /tmp/q06-out
      SLIDEDP_LOG_UNIT_NORMS=1 SLIDEDP_DETERMINISTIC=$det slidedp run /tmp/q06.yaml --backend cuda \
        --run-dir "$d/run-$det$run" > /dev/null 2>&1
      echo "--- 0.6B 3 steps, deterministic=$det, run $run: $(python3 -c 'import json,sys; print([(j["loss"], j["grad_norm"]) for j in map(json.loads, open(sys.argv[1]))])' /tmp/q06-out/metrics-*.jsonl)"
      grep -rh "unit norms:" "$d/run-$det$run" | sed 's/.*unit norms: //' > "$d/units-$det$run.txt"
    done
    echo "units differing (step unit: run a / run b), $(wc -l < "$d/units-${det}a.txt") lines:"
    paste -d'|' "$d/units-${det}a.txt" "$d/units-${det}b.txt" | awk -F'|' '$1 != $2' | head -n 12
  done
  grep -rh -i "attention\|determin" "$d/run-1a" 2>/dev/null | sed 's/^.*\] //' | sort | uniq -c | head -n 6
fi

if has detblock; then  # the 0.6B job twice for 2 steps, as launched and with CUDA_LAUNCH_BLOCKING=1
  steps=2 Q06_WARMUP=0 q06_data_and_spec > /dev/null
  d=/tmp/detb; rm -rf "$d"; mkdir -p "$d"
  for blocking in 0 1; do
    for run in a b; do
      rm -rf /tmp/q06-out
      CUDA_LAUNCH_BLOCKING=$blocking SLIDEDP_LOG_UNIT_NORMS=1 timeout 100 slidedp run /tmp/q06.yaml --backend cuda \
        --run-dir "$d/run-$blocking$run" > /dev/null 2>&1
      echo "--- 0.6B 2 steps, CUDA_LAUNCH_BLOCKING=$blocking, run $run: exit $?: $(python3 -c 'import json,sys; print([(j["loss"], j["grad_norm"]) for j in map(json.loads, open(sys.argv[1]))])' /tmp/q06-out/metrics-*.jsonl)"
      grep -rh "unit norms:" "$d/run-$blocking$run" | sed 's/.*unit norms: //' > "$d/units-$blocking$run.txt"
    done
    echo "units differing at step 1, CUDA_LAUNCH_BLOCKING=$blocking (of $(wc -l < "$d/units-${blocking}a.txt") lines):"
    paste -d'|' "$d/units-${blocking}a.txt" "$d/units-${blocking}b.txt" | awk -F'|' '$1 != $2' | grep "^step 1 " |
      sed 's/ squares /:/g' | awk -F'|' '{print $1, "/", $2}' | sed 's/step 1 unit //' | tr '\n' ';' | cut -c1-2500
    echo
  done
fi

if has ordered; then  # SLIDEDP_DETERMINISTIC: the ordered-dQ kernel check, then the 0.6B job twice
  timeout 60 cuda_kernel_check --kernels-only > /tmp/kcheck.log 2>&1
  echo "--- kernel check: exit $?: $(grep -c '^PASS' /tmp/kcheck.log) PASS, $(grep -c '^FAIL' /tmp/kcheck.log) FAIL"
  grep -E "^FAIL|ordered|repeatable" /tmp/kcheck.log | cut -c1-150
  timeout 120 bench_kernels --quick 2>&1 | grep -E "ceilings|attn_bwd" | grep -v "^JSON"
  steps=3 Q06_WARMUP=0 q06_data_and_spec > /dev/null
  d=/tmp/ord; rm -rf "$d"; mkdir -p "$d"
  for det in 1 0; do
    for run in a b; do
      [ $det = 0 ] && [ $run = b ] && continue
      rm -rf /tmp/q06-out
      SLIDEDP_DETERMINISTIC=$det SLIDEDP_LOG_UNIT_NORMS=1 timeout 60 slidedp run /tmp/q06.yaml --backend cuda \
        --run-dir "$d/run-$det$run" > /dev/null 2>&1
      echo "--- 0.6B 3 steps, SLIDEDP_DETERMINISTIC=$det, run $run: exit $?: $(python3 -c 'import json,sys; print([(j["loss"], j["grad_norm"], round(j["step_time_s"], 3)) for j in map(json.loads, open(sys.argv[1]))])' /tmp/q06-out/metrics-*.jsonl)"
      grep -rh "unit norms:" "$d/run-$det$run" | sed 's/.*unit norms: //' > "$d/units-$det$run.txt"
    done
  done
  echo "unit norm lines differing between the two deterministic runs: $(paste -d'|' "$d/units-1a.txt" "$d/units-1b.txt" | awk -F'|' '$1 != $2' | wc -l) of $(wc -l < "$d/units-1a.txt")"
  grep -rh "CUDA backend on GPU" "$d/run-1a" | sed 's/^.*\] //' | head -n 1
fi

# stable_pretrain DIR PRESET STEPS RUNTIME_EXTRA: the steadier regime's pretrain (STEPS of 32 x
# 1,024 tokens of /tmp/ds/train at lr 3e-4 cosine, FP32 checkpoint) into DIR/pre; sets $src.
stable_pretrain() {
  local d=$1 preset=$2 pre=$3 extra=$4
  cat > "$d/pre.yaml" <<YAML
name: stable-pre
model: {preset: $preset, init_seed: 0}
data: {path: /tmp/ds/train}
output: {dir: $d/pre, save_final: true, save_dtype: fp32}
train: {seq_len: 1024, global_batch: 32, micro_batch: 8, steps: $pre, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 3.0e-4, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 25, min_lr: 3.0e-5}
runtime: {workers: 1$extra}
YAML
  local t0=$SECONDS
  slidedp run "$d/pre.yaml" --backend cuda --run-dir "$d/run-pre" > "$d/pre.progress" 2>&1
  echo "--- stable pretrain ($pre steps): exit $? after $((SECONDS - t0)) s: $(tail -n 1 "$d/pre.progress")"
  python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print("pretrain loss/grad norm at", [(j["step"], round(j["loss"],3), round(j["grad_norm"],3)) for j in r[::25]])' \
    "$d"/pre/metrics-*.jsonl
  src=$d/pre/checkpoint-$pre
}

# unit_lines RUN_DIR: the workers' SLIDEDP_LOG_UNIT_NORMS=1 lines of a run, without the log prefix
# (what compare_curves.py --first-units reads).
unit_lines() { grep -rh "unit norms:" "$1" | sed 's/^.*unit norms:/unit norms:/'; }

# layouts_check BATCHES LIMIT_S: every micro-batch's document layout in a dump_batches file through
# cuDNN's attention and the own kernels, compared per document (cuda_kernel_check --attn-layouts;
# Qwen3-0.6B/1.7B heads: 16 q, 8 kv, head dim 128).
layouts_check() {
  local t0=$SECONDS log=${1%.bin}-layouts.log
  timeout "$2" cuda_kernel_check --attn-layouts="$1" --heads=16/8 --head-dim=128 > "$log" 2>&1
  echo "--- attention layouts: exit $? after $((SECONDS - t0)) s"
  grep -E "^(PASS|FAIL|INFO)|layouts:" "$log" | head -n 30 | cut -c1-250
}

if has stable; then
  q06_data_and_spec > /dev/null
  preset=${STABLE_PRESET:-qwen3-0.6b}
  d=/tmp/st-$preset; rm -rf "$d"; mkdir -p "$d"
  # STABLE_DET=1: pretrain and our fine-tune in deterministic mode, so that a later call
  # (PARTS=stableat) rebuilds the same weights bit for bit
  det_extra=""; [ "${STABLE_DET:-0}" = 1 ] && det_extra=", deterministic: true"
  if [ -n "${PRETRAINED:-}" ]; then
    src=$PRETRAINED
  else
    stable_pretrain "$d" "$preset" "${STABLE_PRE:-250}" "$det_extra"
  fi
  finetune_spec "$d" stable "$src" 200
  [ -n "$det_extra" ] && sed -i "s/runtime: {workers: 1}/runtime: {workers: 1$det_extra}/" "$d/ft.yaml"
  # STABLE_FT_LR=0: the weights stay at the pretrain's (AdamW with lr 0 moves nothing), so each
  # step is one batch's loss and gradients at the same weights on both sides: a batch that ours
  # computes differently shows without any trajectory in between
  [ -n "${STABLE_FT_LR:-}" ] && sed -i "s/optimizer: {lr: 1.0e-5,/optimizer: {lr: $STABLE_FT_LR,/" "$d/ft.yaml"
  # STABLE_WEIGHTS=1: both sides keep their FP32 weights after step 200, and compare_params.py
  # places the rows of the steps that differ most (and of ordinary steps) in the embedding's
  # per-row drift between the two runs
  weights=${STABLE_WEIGHTS:-0}
  [ "$weights" = 1 ] && sed -i 's/save_final: false}/save_final: true, save_dtype: fp32}/' "$d/ft.yaml"
  t0=$SECONDS
  # STABLE_UNITS=1: both sides record every step's squared gradient norm per unit, and the
  # comparison names the units where the gradient norms part
  # STABLE_OURS=0: only the references (their own spread; when the call has no time for ours).
  units=${STABLE_UNITS:-0} ours=${STABLE_OURS:-1}
  if [ "$ours" = 1 ]; then
    SLIDEDP_LOG_UNIT_NORMS=$units slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft" > "$d/ft.progress" 2>&1
    echo "--- stable ours fine-tune: exit $? after $((SECONDS - t0)) s"
    cp "$d"/ft/metrics-*.jsonl "$out/stable-ours.jsonl"
    [ "$units" = 1 ] && unit_lines "$d/run-ft" > "$out/stable-ours-units.txt"
    # STABLE_REPEAT=1 (with STABLE_DET=1): the same fine-tune again; in deterministic mode every
    # kernel repeats bit for bit, so any difference between the two runs is the pipeline's timing
    # (a read racing a write), and the first step and units that differ say where
    if [ "${STABLE_REPEAT:-0}" = 1 ]; then
      t0=$SECONDS
      rm -f "$d"/ft/metrics-*.jsonl
      SLIDEDP_LOG_UNIT_NORMS=$units slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft-b" > "$d/ft-b.progress" 2>&1
      echo "--- stable ours fine-tune, second run: exit $? after $((SECONDS - t0)) s"
      cp "$d"/ft/metrics-*.jsonl "$out/stable-ours-b.jsonl"
      rep_units=()
      if [ "$units" = 1 ]; then
        unit_lines "$d/run-ft-b" > "$d/units-b.txt"
        rep_units=(--first-units "$out/stable-ours-units.txt" --second-units "$d/units-b.txt")
      fi
      python3 tools/verify/compare_curves.py "$out/stable-ours.jsonl" "$out/stable-ours-b.jsonl" --tol 0 --bitwise \
        "${rep_units[@]}" | grep -v '^{' | sed "s/^/stable ours run a vs run b: /"
    fi
    # (the references read only the pretrain's weights: drop the optimizer states for disk room)
    # (not in $PRETRAINED, which is not ours to change)
    if [ "$weights" = 1 ]; then
      rm -f "$d"/ft/checkpoint-*/optimizer.safetensors
      [ -z "${PRETRAINED:-}" ] && rm -f "$src/optimizer.safetensors"
    fi
  fi
  unit_args=()
  # (with STABLE_DEADLINE a reference may stop early: compare the steps both sides have)
  steps_req=(--steps 200); [ -n "${STABLE_DEADLINE:-}" ] && steps_req=()
  if [ "$units" = 1 ] && [ "$ours" = 1 ]; then
    unit_args=(--first-units "$out/stable-ours-units.txt")
  fi
  dump_batches --job "$d/ft.yaml" --out "$d/batches.bin" > /dev/null 2>&1
  # STABLE_LAYOUTS=1: every micro-batch's document layout of the fine-tune through cuDNN's
  # attention and the own kernels, compared per document (cuda_kernel_check --attn-layouts)
  [ "${STABLE_LAYOUTS:-0}" = 1 ] && layouts_check "$d/batches.bin" 240
  # A reference named PRECISION-eager runs HF with eager attention (softmax in FP32 from BF16
  # scores): the same arithmetic rounded another way, the reference's own spread.
  for ref in ${STABLE_REFS:-bf16-autocast bf16-mirror-fp32-norms}; do
    prec=${ref%-eager}; attn=sdpa; [ "$prec" != "$ref" ] && attn=eager
    t0=$SECONDS
    # STABLE_PROBE=1: the autocast reference also records each batch's FP32 loss (--probe-fp32)
    probe=(); cap=${STABLE_HF_CAP:-200}
    # STABLE_DEADLINE=S: no reference runs past S seconds into the session (it keeps its curve so far)
    if [ -n "${STABLE_DEADLINE:-}" ]; then
      left=$((STABLE_DEADLINE - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
      [ "$cap" -lt 30 ] && { echo "--- stable HF $ref: skipped, ${left} s left before STABLE_DEADLINE"; continue; }
    fi
    if [ "${STABLE_PROBE:-0}" = 1 ] && [ "$prec" = bf16-autocast ]; then probe=(--probe-fp32); cap=$((cap + 150)); fi
    [ "$units" = 1 ] && probe+=(--unit-norms)
    [ "$weights" = 1 ] && [ "$ref" = bf16-autocast ] && probe+=(--save-final "$d/hf-final")
    timeout "$cap" python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" --model "$src" --precision $prec \
      --attn $attn "${probe[@]}" --out "$out/stable-hf-$ref.json" > "$d/hf-$ref.log" 2>&1
    echo "--- stable HF $ref: exit $? after $((SECONDS - t0)) s: $(tail -n 1 "$d/hf-$ref.log")"
  done
  if [ "$ours" = 1 ]; then
    python3 tools/verify/compare_curves.py "$out/stable-ours.jsonl" "$out/stable-hf-bf16-autocast.json" --tol 6e-4 "${steps_req[@]}" \
      "${unit_args[@]}" --json "$d/cmp-ours.json" | grep -v '^{' | sed "s/^/stable ours vs HF autocast: /"
    if [ "$weights" = 1 ] && [ -f "$d/cmp-ours.json" ]; then
      # the five steps that differ most, then five ordinary ones for comparison
      steps=$(python3 -c 'import json,sys; w=[s for s, _ in json.load(open(sys.argv[1]))["worst_steps"]]; print(",".join(str(s) for s in w + [s for s in (40, 80, 120, 160, 190, 30, 70) if s not in w][:5]))' "$d/cmp-ours.json")
      timeout 120 python3 tools/verify/compare_params.py "$d"/ft/checkpoint-200 "$d/hf-final" --common-only --tol-rel 1 \
        --rows model.embed_tokens.weight --batches "$d/batches.bin" --steps "$steps" 2>&1 | sed "s/^/stable weights ours vs HF autocast: /"
    fi
  fi
  for ref in ${STABLE_REFS:-bf16-autocast bf16-mirror-fp32-norms}; do
    [ "$ref" = bf16-autocast ] || [ ! -f "$out/stable-hf-$ref.json" ] && continue
    [ "$ours" = 1 ] && python3 tools/verify/compare_curves.py "$out/stable-ours.jsonl" "$out/stable-hf-$ref.json" --tol 6e-4 \
      "${steps_req[@]}" "${unit_args[@]}" | grep -v '^{' | sed "s/^/stable ours vs HF $ref: /"
    python3 tools/verify/compare_curves.py "$out/stable-hf-$ref.json" "$out/stable-hf-bf16-autocast.json" \
      --tol 6e-4 "${steps_req[@]}" | grep -v '^{' | sed "s/^/stable HF $ref vs HF autocast: /"
  done
  curve=$out/stable-ours.jsonl; [ "$ours" = 1 ] || curve=$out/stable-hf-bf16-autocast.json
  python3 - "$curve" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
try:
    r = json.loads(text)["curve"]  # an HF reference curve
except ValueError:
    r = [json.loads(line) for line in text.splitlines() if line.strip()]  # our metrics JSONL
print("ft grad norms max", max(j["grad_norm"] for j in r), "first", [round(j["grad_norm"], 3) for j in r[:8]])
PY
fi

if has stableat; then
  # One step of a deterministic `stable` run (STABLE_DET=1, same STABLE_PRESET / STABLE_PRE) taken
  # apart: rebuild the pretrain and our fine-tune up to step STABLE_AT - 1 bit for bit (both in
  # deterministic mode), then step STABLE_AT's gradients and loss, ours against HF autocast, HF
  # FP32 and HF mirror on those same weights (grad_diff.py). Whether a step where the curves
  # part is ours computing that batch differently, or the weights having drifted.
  at=${STABLE_AT:?STABLE_AT=step (1-based) to take apart}
  q06_data_and_spec > /dev/null
  preset=${STABLE_PRESET:-qwen3-0.6b}
  d=/tmp/sa-$preset; rm -rf "$d"; mkdir -p "$d"
  stable_pretrain "$d" "$preset" "${STABLE_PRE:-250}" ", deterministic: true"
  rm -f "$src/optimizer.safetensors"  # disk room; the fine-tune reads the weights only
  finetune_spec "$d" stableat "$src" $((at - 1))
  sed -i "s/runtime: {workers: 1}/runtime: {workers: 1, deterministic: true}/; s/save_final: false}/save_final: true, save_dtype: fp32}/" \
    "$d/ft.yaml"
  t0=$SECONDS
  SLIDEDP_LOG_UNIT_NORMS=1 slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft" > "$d/ft.progress" 2>&1
  echo "--- stableat fine-tune to step $((at - 1)): exit $? after $((SECONDS - t0)) s"
  tail -n 1 "$d"/ft/metrics-*.jsonl | cut -c1-200
  # (the curve to step STABLE_AT - 1 must equal the STABLE_DET=1 stable run's bit for bit)
  cp "$d"/ft/metrics-*.jsonl "$out/stableat-ours.jsonl"
  unit_lines "$d/run-ft" > "$out/stableat-ours-units.txt"
  sed -i "s/steps: $((at - 1)),/steps: $at,/" "$d/ft.yaml"  # the batches up to step STABLE_AT
  dump_batches --job "$d/ft.yaml" --out "$d/batches.bin" > /dev/null 2>&1
  t0=$SECONDS
  SLIDEDP_DETERMINISTIC=1 timeout 300 python3 tools/verify/grad_diff.py --bin "$(command -v model_grads)" \
    --model "$d/ft/checkpoint-$((at - 1))" --batches "$d/batches.bin" --step $((at - 1)) --top 20
  echo "--- stableat grad_diff: exit $? after $((SECONDS - t0)) s"
  # HF's own trajectory from the same pretrain to step STABLE_AT (is the step there too?)
  t0=$SECONDS
  timeout 150 python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" --model "$src" \
    --precision bf16-autocast --unit-norms --out "$out/stableat-hf.json" > "$d/hf.log" 2>&1
  echo "--- stableat HF autocast to step $at: exit $? after $((SECONDS - t0)) s: $(tail -n 1 "$d/hf.log" | cut -c1-200)"
  python3 tools/verify/compare_curves.py "$out/stableat-ours.jsonl" "$out/stableat-hf.json" --tol 6e-4 \
    --first-units "$out/stableat-ours-units.txt" | grep -v '^{' | sed "s/^/stableat ours vs HF autocast: /"
  python3 - "$out/stableat-hf.json" "$at" <<'PY'
import json, math, sys
c = {r["step"]: r for r in json.load(open(sys.argv[1]))["curve"]}
for s in range(max(1, int(sys.argv[2]) - 2), int(sys.argv[2]) + 1):
    if s in c:
        u = c[s].get("unit_squares", [])
        print(f"stableat HF step {s}: loss {c[s]['loss']:.6f} grad norm {c[s]['grad_norm']:.4f}; units 0-3",
              [round(math.sqrt(x), 4) for x in u[:4]])
PY
  # STABLE_LAYOUTS=1: the fine-tune's 200 steps of document layouts through cuDNN and the own attention
  if [ "${STABLE_LAYOUTS:-0}" = 1 ]; then
    dump_batches --job "$d/ft.yaml" --steps 200 --out "$d/layouts.bin" > /dev/null 2>&1
    layouts_check "$d/layouts.bin" 200
  fi
  rm -rf "$d"
fi

if has layouts; then  # the fine-tune's 200 steps of document layouts alone (no pretrain needed)
  q06_data_and_spec > /dev/null
  d=/tmp/lay; rm -rf "$d"; mkdir -p "$d"
  finetune_spec "$d" layouts none 200
  sed -i "s|model: {path: none}|model: {preset: qwen3-1.7b, init_seed: 0}|" "$d/ft.yaml"
  dump_batches --job "$d/ft.yaml" --out "$d/layouts.bin" > "$d/dump.log" 2>&1
  echo "--- layouts batches: exit $?: $(tail -n 1 "$d/dump.log" | cut -c1-150)"
  layouts_check "$d/layouts.bin" "${LAYOUTS_CAP:-300}"
fi

if has routes; then
  PARTS=routes bash bench/e2e/scaling.sh > /tmp/routes.out 2>&1
  echo "--- routes: exit $?"; grep -E "^\| " "$out"/routes-*.md 2>/dev/null | head -n 40
fi
if has weak14; then
  PARTS=weak14 bash bench/e2e/scaling.sh > /tmp/weak14.out 2>&1
  echo "--- weak14: exit $?"; grep -E "^\| |1 to 2" "$out/bench-summary.md" 2>/dev/null | head -n 20
fi
echo "=== session P done after $SECONDS s"
