# Shared by the GPU session scripts (source it from the repo root on the GPU machine): unpack the
# bundle, set the environment, and the stages used by more than one session.
out=${OUT:-/tmp/slidedp-gpu}
steps=${STEPS:-200}
mkdir -p "$out"
[ -d .gpu/bin ] || bash tools/gpu/unpack.sh
source .gpu/lib/gpu-env.sh .gpu/lib
export PATH=$PWD/.gpu/bin:$PATH PYTHONUNBUFFERED=1

# find_cudnn: libcudnn.so.9 for the CUDA backend's attention: the system's, else PyTorch's pip
# package (exported as SLIDEDP_CUDNN_LIB); prints which.
find_cudnn() {
  if ! ldconfig -p 2>/dev/null | grep -q "libcudnn.so.9" && [ -z "${SLIDEDP_CUDNN_LIB:-}" ]; then
    local d
    d=$(python3 -c "import nvidia.cudnn, os; print(os.path.dirname(nvidia.cudnn.__file__))" 2>/dev/null)/lib
    [ -d "$d" ] && export SLIDEDP_CUDNN_LIB=$d LD_LIBRARY_PATH=$d:${LD_LIBRARY_PATH:-}
  fi
  echo "libcudnn: ${SLIDEDP_CUDNN_LIB:-system}"
}

# has PART: whether the session's PARTS names it.
has() { case " ${PARTS:-} " in *" $1 "*) return 0 ;; esac; return 1; }
# log_session NAME: from here on, everything the session prints also goes to $out/NAME.log.
# LOG_NAME overrides NAME (two sessions side by side, one per GPU).
log_session() { exec > >(tee -a "$out/${LOG_NAME:-$1}.log") 2>&1; }

stage() {  # stage NAME LIMIT_S CMD... : runs with a time cap, logs to $out/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" > "$out/$name.log"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
}

# Real text (the Python standard library's sources) tokenized with the Qwen3 tokenizer into
# /tmp/ds, and the Qwen3-0.6B job spec /tmp/q06.yaml that trains on it for $steps steps
# (Q06_LR, Q06_SCHEDULE, Q06_WARMUP, Q06_MIN_LR override the optimizer settings). The data is made
# once per machine (/tmp/ds/.ready), so parts running side by side on two GPUs can share it.
q06_data_and_spec() {
  [ -f /tmp/ds/.ready ] || stage data 60 bash -c 'python3 - <<PY
import glob, json
with open("/tmp/corpus.jsonl", "w") as f:
    for p in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))[:3000]:
        try: t = open(p, encoding="utf-8").read()
        except Exception: continue
        if len(t) > 200: f.write(json.dumps({"text": t}) + "\n")
PY
slidedp prepare --model tests/data/tokenizer/qwen3 --input /tmp/corpus.jsonl --output /tmp/ds --seq-len 1024 --pack --overwrite && touch /tmp/ds/.ready'
  cat > /tmp/q06.yaml <<YAML
name: q06
model: {preset: qwen3-0.6b, init_seed: 0}
data: {path: /tmp/ds/train}
output: {dir: /tmp/q06-out, save_final: false}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: $steps, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: ${Q06_LR:-1.0e-4}, weight_decay: 0.01}
schedule: {kind: ${Q06_SCHEDULE:-cosine}, warmup_steps: ${Q06_WARMUP:-10}, min_lr: ${Q06_MIN_LR:-1.0e-5}}
runtime: {workers: 1}
YAML
}

# pretrain_spec DIR TAG PRESET STEPS: DIR/pre.yaml, the fine-tuning regime's pretrain (random init,
# lr 1e-4 cosine, clip 1.0, global batch 8 x 1,024 tokens of /tmp/ds/train, FP32 checkpoint in
# DIR/pre/checkpoint-STEPS).
pretrain_spec() {
  cat > "$1/pre.yaml" <<YAML
name: $2-pre
model: {preset: $3, init_seed: 0}
data: {path: /tmp/ds/train}
output: {dir: $1/pre, save_final: true, save_dtype: fp32}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: $4, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-4, weight_decay: 0.01}
schedule: {kind: cosine, warmup_steps: 10, min_lr: 1.0e-5}
runtime: {workers: 1}
YAML
}

# finetune_spec DIR TAG MODEL_DIR STEPS: DIR/ft.yaml, the fine-tuning regime's fine-tune (from the
# FP32 checkpoint MODEL_DIR, constant lr 1e-5, clip 1.0, global batch 8 x 1,024 tokens of
# /tmp/ds/train in another data order (seed 1), nothing saved).
finetune_spec() {
  cat > "$1/ft.yaml" <<YAML
name: $2-ft
model: {path: $3}
data: {path: /tmp/ds/train}
output: {dir: $1/ft, save_final: false}
train: {seq_len: 1024, global_batch: 8, micro_batch: 4, steps: $4, seed: 1, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-5, weight_decay: 0.01}
schedule: {kind: constant}
runtime: {workers: 1}
YAML
}

# eq_run ROOT NAME GPUS RUNTIME_EXTRA STEPS: Qwen3-0.6B on ROOT/data (random tokens, seq 1024,
# global batch 8, micro-batch 2, clip 1.0, lr 1e-5, FP32 checkpoints) on the first GPUS GPUs, in
# ROOT/NAME; prints the progress summary and the last metrics line. For 1-vs-2-GPU comparisons.
eq_run() {
  local root=$1 name=$2 g=$3 extra=$4 steps=$5 d=$1/$2
  mkdir -p "$d"
  cat > "$d/job.yaml" <<YAML
name: eq
model: {preset: qwen3-0.6b, init_seed: 0}
data: {path: $root/data}
output: {dir: $d/out, save_final: true, save_dtype: fp32}
train: {seq_len: 1024, global_batch: 8, micro_batch: 2, steps: $steps, seed: 0, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-5, weight_decay: 0.01}
runtime: {workers: $g, act_policy: recompute$extra}
YAML
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((g - 1))) timeout 150 slidedp run "$d/job.yaml" --backend cuda --run-dir "$d/run" \
    > "$d/progress.log" 2>&1
  echo "--- $name: exit $? after $((SECONDS - t0)) s: $(tail -n 2 "$d/progress.log" | tr '\n' ' ')"
  tail -n 1 "$d"/out/metrics-*.jsonl 2>/dev/null
}
