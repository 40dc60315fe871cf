#!/usr/bin/env bash
# End-to-end throughput benchmark (issue 4, "Benchmark"), run on the GPU machine from the repo
# root: for each tokens-per-GPU value, side by side,
#   ours           slidedp run (hostd + one streaming worker per GPU) on a synthetic dataset
#   compute        bench_step: our GPU-resident compute-only mode, same kernels, no streaming (1 GPU)
#   fsdp2          bench/e2e/fsdp2_qwen3.py (PyTorch FSDP2, GPU-resident)
#   fsdp2-offload  the same with CPUOffloadPolicy
# Every stage has a time cap and the whole run a budget (the device tool stops a command at 600 s);
# a failing stage is recorded and the run goes on. Raw outputs go to $WORK (kept between runs on
# the same machine, so a later call can add results); after every stage bench/e2e/report.py
# rewrites $out/bench-summary.md, $out/bench-results.json and $out/bench-logs.txt (the device
# tool returns at most 8 files, so nothing else is written under $out).
#
# Settings (environment or KEY=VALUE arguments):
#   MODEL        qwen3-4b | qwen3-8b | qwen3-0.6b | qwen3-1.7b | qwen3-14b | tiny | any preset  (qwen3-4b)
#   GPUS         GPUs per run; a list ("1 2") runs each, for the scaling ratio        (1)
#   TOKENS_LIST  tokens per GPU per optimizer step                 ("16384 65536 262144")
#   SEQ          row length (4096)    STEPS  optimizer steps, step 1 is warm-up (4)
#   MICRO_ROWS   rows per micro-batch (4)     FSDP_STEPS  peer steps, median after 3 (6)
#   WHAT         subset of "ours compute fsdp2 fsdp2-offload" (all)
#   BACKEND      cuda | cpu (cpu: a functional dry run of "ours" with the CPU backend)  (cuda)
#   OURS_CAP COMPUTE_CAP FSDP2_CAP OFFLOAD_CAP DATA_CAP   per-stage caps in s (300 120 240 300 60)
#   BUDGET_S     seconds for the whole invocation; stages are cut to fit (560)
#   WORK         raw outputs (/tmp/slidedp-e2e)      FRESH=1  forget earlier results in $WORK
#   RESUME=1     skip stages that already succeeded in $WORK (a follow-up call on a warm machine)
#   SLIDEDP_BIN  where slidedp/bench_step are when there is no .gpu bundle (build/bin)
#   ACT_POLICY   recompute | selective | keep_all for ours (recompute, like the peer's checkpointing)
#   RUNTIME_EXTRA  more runtime keys for ours, e.g. "grad_reduction: cpu, param_delivery: sharded"
#   MAX_GRAD_NORM  ours' train.max_grad_norm (1.0); 0 = no clipping, as the FSDP2 peer (which
#                  never clips): updates then start during the backward
#   STATE_DTYPE  ours' optimizer.state_dtype (fp32; bf16 | int8: compact Adam moments)
#   LAYERS       a reduced depth of MODEL for every stage (model.num_hidden_layers, bench_step --layers,
#                the peer's --layers); empty: the preset's. MODEL qwen3-30b-a3b (MoE) runs the peer
#                bench/e2e/fsdp2_qwen3_moe.py, qwen3.5-4b and qwen3.5-35b-a3b bench/e2e/fsdp2_qwen3_5.py,
#                gemma3-* and gpt-oss-* bench/e2e/fsdp2_sliding.py (no offload variant)
set -u
cd "$(dirname "$0")/../.." || exit 2

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
for arg in "$@"; do
  case $arg in
    -h|--help) usage; exit 0 ;;
    MODEL=*|LAYERS=*|FSDP_MICRO_ROWS=*|GPUS=*|TOKENS_LIST=*|RUNTIME_EXTRA=*|MAX_GRAD_NORM=*|STATE_DTYPE=*|ACT_POLICY=*|SEQ=*|STEPS=*|MICRO_ROWS=*|FSDP_STEPS=*|WHAT=*|BACKEND=*|*_CAP=*|BUDGET_S=*|WORK=*|FRESH=*|RESUME=*|SLIDEDP_BIN=*)
      export "${arg?}" ;;
    *) echo "run_bench: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

MODEL=${MODEL:-qwen3-4b}
GPUS=${GPUS:-1}
TOKENS_LIST=${TOKENS_LIST:-"16384 65536 262144"}
SEQ=${SEQ:-4096}
STEPS=${STEPS:-4}
MICRO_ROWS=${MICRO_ROWS:-4}
FSDP_STEPS=${FSDP_STEPS:-6}
WHAT=${WHAT:-"ours compute fsdp2 fsdp2-offload"}
BACKEND=${BACKEND:-cuda}
OURS_CAP=${OURS_CAP:-300}
COMPUTE_CAP=${COMPUTE_CAP:-120}
FSDP2_CAP=${FSDP2_CAP:-240}
OFFLOAD_CAP=${OFFLOAD_CAP:-300}
DATA_CAP=${DATA_CAP:-60}
BUDGET_S=${BUDGET_S:-560}
WORK=${WORK:-/tmp/slidedp-e2e}
T0=$SECONDS

log() { echo "[$(date -u +%H:%M:%S) +$((SECONDS - T0))s] $*" | tee -a "$WORK/progress.log"; }

# Binaries: for BACKEND=cuda the unpacked GPU bundle (tools/gpu/suite_lib.sh also sets $out and the
# CUDA environment), else a local build (CPU dry runs; the bundle is left alone).
if [ "$BACKEND" = cuda ] && { [ -e .gpu/bundle.tar.xz ] || [ -d .gpu/bin ]; }; then
  # shellcheck source=/dev/null
  source tools/gpu/suite_lib.sh
else
  out=${OUT:-/tmp/slidedp-e2e-out}
  mkdir -p "$out"
  export PATH=$PWD/${SLIDEDP_BIN:-build/bin}:$PATH PYTHONUNBUFFERED=1
fi
[ "${FRESH:-0}" = 1 ] && rm -rf "$WORK"
mkdir -p "$WORK/runs" "$WORK/data"

case $MODEL in
  tiny*) VOCAB=512 ;;
  *) VOCAB=151936 ;;  # (below every other preset's vocabulary)
esac
num_gpus=0
if command -v nvidia-smi >/dev/null; then num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); fi

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(nproc) cores, $(awk '/MemTotal/ {printf "%.1f GiB", $2 / 1048576}' /proc/meminfo)"
  if [ "$num_gpus" -gt 0 ]; then
    echo "gpus: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sort | uniq -c | xargs)"
  else
    echo "gpus: none visible"
  fi
  echo "python: $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -n 1)"
  echo "code: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' + working-tree changes')"
} > "$WORK/env.txt" 2>&1
log "run_bench: MODEL=$MODEL GPUS='$GPUS' TOKENS_LIST='$TOKENS_LIST' SEQ=$SEQ STEPS=$STEPS MICRO_ROWS=$MICRO_ROWS WHAT='$WHAT' BACKEND=$BACKEND budget ${BUDGET_S}s out=$out work=$WORK"

report() {
  python3 bench/e2e/report.py --work "$WORK" --out "$out" >> "$WORK/progress.log" 2>&1 ||
    echo "run_bench: report.py failed (see $WORK/progress.log)" >&2
}

# Host memory sampler: MemAvailable at the start and its minimum while a stage runs (KiB), so the
# summary can show what the whole stage took from the host (shared memory, pinned buffers, heaps).
start_mem_sampler() {  # start_mem_sampler FILE; sets sampler_pid
  local file=$1
  (
    base=$(awk '/MemAvailable/ {print $2}' /proc/meminfo); low=$base
    while :; do
      now=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
      [ "$now" -lt "$low" ] && low=$now
      echo "$base $low" > "$file"
      sleep 0.5
    done
  ) &
  sampler_pid=$!
}

# run_stage DIR CAP_S CMD...: runs CMD with a cap (cut to what is left of the budget), output in
# DIR/stage.log, "rc seconds" in DIR/rc; a stage that no longer fits writes DIR/skipped instead.
run_stage() {
  local dir=$1 cap=$2; shift 2
  local name=${dir#"$WORK/runs/"}
  mkdir -p "$dir"
  local left=$((BUDGET_S - (SECONDS - T0) - 15))
  if [ "$left" -lt 20 ]; then
    echo "skipped: the run's time budget (BUDGET_S=$BUDGET_S s) was spent" > "$dir/skipped"
    log "skip  $name (budget spent)"
    return 0
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  log "start $name (cap ${cap}s)"
  echo "=== $(date -u +%FT%TZ) cap ${cap}s: $*" > "$dir/stage.log"
  start_mem_sampler "$dir/hostmem"
  local t0=$SECONDS
  timeout --kill-after=20 "$cap" "$@" >> "$dir/stage.log" 2>&1
  local rc=$?
  kill "$sampler_pid" 2>/dev/null
  wait "$sampler_pid" 2>/dev/null
  echo "$rc $((SECONDS - t0))" > "$dir/rc"
  echo "=== exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (time cap)')" >> "$dir/stage.log"
  local gpu_mem=""
  if [ "$num_gpus" -gt 0 ]; then gpu_mem=", GPU memory in use now: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | paste -sd' ')"; fi
  log "end   $name: exit $rc after $((SECONDS - t0)) s$gpu_mem"
  report
}

write_meta() {  # write_meta DIR KIND GPUS TOKENS_PER_GPU MICRO_ROWS
  rm -rf "$1"
  mkdir -p "$1"
  cat > "$1/meta.json" <<JSON
{"kind": "$2", "model": "$MODEL", "gpus": $3, "seq": $SEQ, "tokens_per_gpu": $4, "micro_rows": $5,
 "steps": $STEPS, "fsdp_steps": $FSDP_STEPS, "backend": "$BACKEND", "started": "$(date -u +%FT%TZ)"}
JSON
}

succeeded() {  # succeeded DIR: RESUME=1 and DIR holds a successful result from an earlier call
  [ "${RESUME:-0}" = 1 ] && [ -f "$1/rc" ] && [ "$(cut -d' ' -f1 "$1/rc")" = 0 ] || return 1
  log "keep  ${1#"$WORK/runs/"} (succeeded earlier; RESUME=1)"
}

wants() { case " $WHAT " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

visible() {  # visible N: CUDA_VISIBLE_DEVICES for the first N GPUs (unless the caller set one)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "$CUDA_VISIBLE_DEVICES"; else seq -s, 0 $(($1 - 1)); fi
}

stage_ours() {  # stage_ours DIR GPUS TOKENS_PER_GPU
  local d=$1 g=$2 tok=$3
  succeeded "$d" && return 0
  local rows_per_gpu=$((tok / SEQ)) micro=$MICRO_ROWS
  [ "$micro" -gt "$rows_per_gpu" ] && micro=$rows_per_gpu
  while [ $((rows_per_gpu % micro)) -ne 0 ]; do micro=$((micro - 1)); done
  write_meta "$d" ours "$g" "$tok" "$micro"
  local global=$((g * rows_per_gpu))
  local rows=$((STEPS * global))
  local data=$WORK/data/v${VOCAB}_s${SEQ}_r${rows}
  if [ ! -f "$data/manifest.json" ]; then
    log "data  $rows rows x $SEQ -> $data"
    timeout "$DATA_CAP" python3 bench/e2e/make_dataset.py --out "$data" --rows "$rows" --seq-len "$SEQ" --vocab "$VOCAB" \
      > "$d/data.log" 2>&1 || { log "data generation failed: $(tail -n 1 "$d/data.log")"; }
  fi
  cat > "$d/job.yaml" <<YAML
name: e2e
model: {preset: $MODEL, init_seed: 0${LAYERS:+, num_hidden_layers: $LAYERS}}
data: {path: $data}
output: {dir: $d/out, save_final: false}
train: {seq_len: $SEQ, global_batch: $global, micro_batch: $micro, steps: $STEPS, seed: 0, max_grad_norm: ${MAX_GRAD_NORM:-1.0}}
optimizer: {lr: 1.0e-5, weight_decay: 0.01, state_dtype: ${STATE_DTYPE:-fp32}}
runtime: {workers: $g, act_policy: ${ACT_POLICY:-recompute}${RUNTIME_EXTRA:+, $RUNTIME_EXTRA}}
YAML
  local extra=()
  [ "$BACKEND" = cpu ] && extra=(--cpu-workers "$g")
  if [ "$BACKEND" = cuda ]; then
    run_stage "$d" "$OURS_CAP" env CUDA_VISIBLE_DEVICES="$(visible "$g")" \
      slidedp run "$d/job.yaml" --backend cuda --run-dir "$d/run"
  else
    run_stage "$d" "$OURS_CAP" slidedp run "$d/job.yaml" --backend "$BACKEND" --run-dir "$d/run" "${extra[@]}"
  fi
}

stage_compute() {  # stage_compute DIR TOKENS_PER_GPU
  local d=$1 tok=$2
  succeeded "$d" && return 0
  write_meta "$d" compute 1 "$tok" "$MICRO_ROWS"
  if ! command -v bench_step >/dev/null; then
    echo "bench_step not found on PATH (not built or not in the .gpu bundle)" > "$d/stage.log"
    echo "127 0" > "$d/rc"
    log "skip  compute: bench_step not found"
    return 0
  fi
  run_stage "$d" "$COMPUTE_CAP" bench_step --model "$MODEL" --seq "$SEQ" --tokens "$tok" \
    --micro-batch-rows "$MICRO_ROWS" --policy recompute --steps "$STEPS" --gpu 0 ${LAYERS:+--layers "$LAYERS"}
}

stage_fsdp2() {  # stage_fsdp2 DIR GPUS TOKENS_PER_GPU [--offload]
  local d=$1 g=$2 tok=$3; shift 3
  local peer=bench/e2e/fsdp2_qwen3.py rows=$((tok / SEQ)) accum=()
  case $MODEL in
    qwen3.5-*) peer=bench/e2e/fsdp2_qwen3_5.py ;;
    *-a3b) peer=bench/e2e/fsdp2_qwen3_moe.py ;;
    gemma3-*|gpt-oss-*) peer=bench/e2e/fsdp2_sliding.py ;;
  esac
  # FSDP_MICRO_ROWS (MoE and Qwen3.5 peers): the step's rows in micro-batches of that many (gradient
  # accumulation)
  if [ -n "${FSDP_MICRO_ROWS:-}" ] && [ "$peer" != bench/e2e/fsdp2_qwen3.py ]; then
    accum=(--accum $((rows / FSDP_MICRO_ROWS)))
    rows=$FSDP_MICRO_ROWS
  fi
  local kind=fsdp2 cap=$FSDP2_CAP
  if [ "${1:-}" = --offload ]; then kind=fsdp2-offload; cap=$OFFLOAD_CAP; fi
  succeeded "$d" && return 0
  write_meta "$d" "$kind" "$g" "$tok" $((tok / SEQ))
  run_stage "$d" "$cap" env CUDA_VISIBLE_DEVICES="$(visible "$g")" OMP_NUM_THREADS=$(($(nproc) / g)) \
    python3 -m torch.distributed.run --standalone --nproc_per_node="$g" "$peer" \
    --model "$MODEL" --seq "$SEQ" --mbs "$rows" "${accum[@]}" --steps "$FSDP_STEPS" ${LAYERS:+--layers "$LAYERS"} "$@"
}

for tok in $TOKENS_LIST; do
  if [ $((tok % SEQ)) -ne 0 ] || [ "$tok" -lt "$SEQ" ]; then
    log "tokens per GPU $tok is not a positive multiple of SEQ=$SEQ: skipped"
    continue
  fi
  base=$WORK/runs/$MODEL/s$SEQ/t$tok
  compute_done=0
  for g in $GPUS; do
    if [ "$BACKEND" = cuda ] && [ "$g" -gt "$num_gpus" ]; then
      log "GPUS=$g but $num_gpus GPU(s) visible: $MODEL at $tok tokens/GPU skipped"
      continue
    fi
    wants ours && stage_ours "$base/g$g/ours" "$g" "$tok"
    if wants compute && [ "$compute_done" = 0 ] && [ "$BACKEND" = cuda ]; then
      stage_compute "$base/compute" "$tok"
      compute_done=1
    fi
    [ "$BACKEND" = cuda ] && wants fsdp2 && stage_fsdp2 "$base/g$g/fsdp2" "$g" "$tok"
    [ "$BACKEND" = cuda ] && wants fsdp2-offload && stage_fsdp2 "$base/g$g/fsdp2-offload" "$g" "$tok" --offload
  done
done
report
log "run_bench: done in $((SECONDS - T0)) s; summary in $out/bench-summary.md"
sed -n '1,200p' "$out/bench-summary.md" 2>/dev/null
