# The GPU suite's shared shell code, sourced from the repository root on the GPU machine by
# tools/gpu/run_suite.sh and by bench/e2e/run_bench.sh and bench/e2e/scaling.sh. Sourcing it unpacks
# the bundle (.gpu/bundle.tar.xz, made by tools/gpu/bundle.sh) unless it is unpacked already, sets
# the CUDA environment and PATH, and sets $out (= $OUT, the folder whose files the device tool
# returns). With DRY_RUN=1 nothing is unpacked (run_suite.sh then prints commands instead).
# shellcheck shell=bash

out=${OUT:-/tmp/slidedp-gpu}
mkdir -p "$out"
if [ "${DRY_RUN:-0}" != 1 ]; then
  if [ ! -f .gpu/.unpacked ] || [ .gpu/bundle.tar.xz -nt .gpu/.unpacked ]; then
    bash tools/gpu/unpack.sh
  fi
  # shellcheck source=/dev/null
  source .gpu/lib/gpu-env.sh .gpu/lib
  export PATH=$PWD/.gpu/bin:$PATH
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# has WORD: whether $PARTS names WORD (bench/e2e/scaling.sh's parts).
has() { case " ${PARTS:-} " in *" $1 "*) return 0 ;; esac; return 1; }

# find_cudnn: libcudnn.so.9 for the CUDA backend's attention: the system's, else PyTorch's pip
# package (exported as SLIDEDP_CUDNN_LIB, docs/environment.md); prints which.
find_cudnn() {
  if ! ldconfig -p 2>/dev/null | grep -q "libcudnn.so.9" && [ -z "${SLIDEDP_CUDNN_LIB:-}" ]; then
    local d
    d=$(python3 -c "import nvidia.cudnn, os; print(os.path.dirname(nvidia.cudnn.__file__))" 2>/dev/null)/lib
    [ -d "$d" ] && export SLIDEDP_CUDNN_LIB=$d LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
  fi
  echo "libcudnn: ${SLIDEDP_CUDNN_LIB:-system}"
}

dry() { [ "${DRY_RUN:-0}" = 1 ]; }

# stage NAME CAP_S CMD...: runs CMD with a time cap, cut to what is left before SUITE_DEADLINE
# (seconds of $SECONDS, i.e. since the suite started), output in $part_dir/NAME.log. Returns CMD's
# exit status (124: the time cap), 125 when no time was left to start it. DRY_RUN=1 prints CMD.
stage() {
  local name=$1 cap=$2
  shift 2
  # shellcheck disable=SC2154  # (part_dir: the running part's output folder, set by run_suite.sh)
  local log=$part_dir/$name.log left=$((${SUITE_DEADLINE:-570} - SECONDS - 10))
  if dry; then
    printf 'DRY  %-18s cap %4ss:' "$name" "$cap"
    printf ' %q' "$@"
    echo
    return 0
  fi
  if [ "$left" -lt 15 ]; then
    echo "=== $name: not started, ${left} s left before SUITE_DEADLINE" | tee "$log"
    return 125
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "=== $name (cap ${cap} s): $*" > "$log"
  local t0=$SECONDS
  timeout --kill-after=15 "$cap" "$@" >> "$log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (time cap)')" | tee -a "$log"
  return $rc
}

# Real text for the fine-tuning regime: the Python standard library's sources (the first 3,000
# files over 200 bytes, sorted) tokenized with the Qwen3 tokenizer, packed into rows of 1,024
# tokens in /tmp/ds/train. Made once per machine (/tmp/ds/.ready), so later parts and calls on a
# warm machine share it.
# SUITE_TOKENIZER (a tokenizer directory, default the Qwen3 one) and SUITE_DS (default /tmp/ds) pick
# another vocabulary, e.g. Llama 3's for a llama preset (part curves sets them).
text_dataset() {
  local ds=${SUITE_DS:-/tmp/ds} tok=${SUITE_TOKENIZER:-tests/data/tokenizer/qwen3}
  [ -f "$ds/.ready" ] && return 0
  if dry; then
    echo "DRY  text_dataset: the Python standard library's sources -> slidedp prepare ($tok) -> $ds/train"
    return 0
  fi
  stage text_dataset 90 env DS="$ds" TOK="$tok" bash -c 'python3 - <<PY
import glob, json
with open("/tmp/corpus.jsonl", "w") as f:
    for p in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))[:3000]:
        try: t = open(p, encoding="utf-8").read()
        except Exception: continue
        if len(t) > 200: f.write(json.dumps({"text": t}) + "\n")
PY
slidedp prepare --model "$TOK" --input /tmp/corpus.jsonl --output "$DS" --seq-len 1024 --pack --overwrite && touch "$DS/.ready"'
}

# spec_stable_pretrain DIR PRESET STEPS RUNTIME_EXTRA: DIR/pre.yaml, the steadier regime's pretrain
# (sessions 5-8): random init, STEPS of 32 x 1,024 tokens of /tmp/ds/train at lr 3e-4 cosine
# (warm-up 25, min 3e-5), clip 1.0, FP32 checkpoint in DIR/pre/checkpoint-STEPS.
spec_stable_pretrain() {
  cat > "$1/pre.yaml" <<YAML
name: stable-pre
model: {preset: $2, init_seed: 0}
data: {path: ${SUITE_DS:-/tmp/ds}/train}
output: {dir: $1/pre, save_final: true, save_dtype: fp32}
train: {seq_len: 1024, global_batch: 32, micro_batch: 8, steps: $3, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 3.0e-4, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 25, min_lr: 3.0e-5}
runtime: {workers: 1$4}
YAML
}

# spec_short_pretrain DIR PRESET STEPS: DIR/pre.yaml, the first fine-tuning regime's pretrain
# (sessions 3-4; graddiff): random init, STEPS of 8 x 1,024 tokens at lr 1e-4 cosine (warm-up 10,
# min 1e-5), clip 1.0, FP32 checkpoint in DIR/pre/checkpoint-STEPS.
spec_short_pretrain() {
  cat > "$1/pre.yaml" <<YAML
name: short-pre
model: {preset: $2, init_seed: 0}
data: {path: ${SUITE_DS:-/tmp/ds}/train}
output: {dir: $1/pre, save_final: true, save_dtype: fp32}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: $3, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-4, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 10, min_lr: 1.0e-5}
runtime: {workers: 1}
YAML
}

# spec_finetune DIR MODEL STEPS RUNTIME_EXTRA [OUTPUT_EXTRA]: DIR/ft.yaml, the fine-tune of every
# curve comparison: model MODEL (a YAML mapping body, e.g. "path: DIR"), STEPS of 8 x 1,024 tokens
# of /tmp/ds/train in another data order (seed 1), constant lr 1e-5, clip 1.0, into DIR/ft
# (OUTPUT_EXTRA: more output keys; default nothing saved).
spec_finetune() {
  cat > "$1/ft.yaml" <<YAML
name: ft
model: {$2}
data: {path: ${SUITE_DS:-/tmp/ds}/train}
output: {dir: $1/ft, ${5:-save_final: false}}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: $3, seed: 1, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-5, weight_decay: 0.01}
schedule: {kind: constant}
runtime: {workers: 1$4}
YAML
}

# spec_short_job FILE PRESET STEPS OUT_DIR RUNTIME_EXTRA: a short job on /tmp/ds/train from random
# init (8 x 1,024 tokens, lr 1e-4 cosine without warm-up, clip 1.0, nothing saved): the
# repeatability check's job.
spec_short_job() {
  cat > "$1" <<YAML
name: short
model: {preset: $2, init_seed: 0}
data: {path: ${SUITE_DS:-/tmp/ds}/train}
output: {dir: $4, save_final: false}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: $3, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-4, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 0, min_lr: 1.0e-5}
runtime: {workers: 1$5}
YAML
}

# spec_eq DIR DATA GPUS STEPS RUNTIME_EXTRA: DIR/job.yaml, the route-equivalence job (sessions E,
# I): Qwen3-0.6B on DATA (random tokens, seq 1024), global batch 8, micro-batch 2, clip 1.0,
# lr 1e-5, FP32 weights saved in DIR/out/checkpoint-STEPS.
spec_eq() {
  cat > "$1/job.yaml" <<YAML
name: eq
model: {preset: qwen3-0.6b, init_seed: 0}
data: {path: $2}
output: {dir: $1/out, save_final: true, save_dtype: fp32}
train: {seq_len: 1024, global_batch: 8, micro_batch: 2, steps: $4, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-5, weight_decay: 0.01}
runtime: {workers: $3, act_policy: recompute$5}
YAML
}

# unit_lines RUN_DIR: the workers' SLIDEDP_LOG_UNIT_NORMS=1 lines of a run without the log prefix
# (what compare_curves.py --first-units reads).
unit_lines() { grep -rh "unit norms:" "$1" 2>/dev/null | sed 's/^.*unit norms:/unit norms:/'; }
