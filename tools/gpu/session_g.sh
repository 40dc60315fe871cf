#!/usr/bin/env bash
# GPU session G (nvidia-h200-x2), in parts (PARTS, several calls on a warm machine):
#   copy      bench_copy: per-GPU H2D/D2H with 1 and 2 GPUs copying at once, with and without
#             LayerAdam (issue 7's host contention, on the kinds lent)
#   warm      a node service (slidedp-hostd + one CUDA worker) and two Qwen3-4B jobs back to back:
#             submit -> first step, cold then warm (issue 6)
#   curves    Qwen3-0.6B, 200 steps against HF + torch AdamW (issue 4's loss-curve target), through
#             the current pipeline (session_d.sh's stages with STEPS=200)
#   policy    bench/e2e at Qwen3-4B 64K with act_policy selective (ours and the same bench_step)
# Output: $out/session-g.log (+ the benchmark's and curves' files).
set -u
PARTS=${PARTS:-"copy warm"}
if [ "${DEV_BOX:-0}" = 1 ]; then  # a dry run of the script logic here: our build, no bundle
  out=${OUT:-/tmp/session-g}; mkdir -p "$out"; export PATH=$PWD/build/bin:$PATH
else
  source tools/gpu/lib.sh
fi
log=$out/session-g.log
exec > >(tee -a "$log") 2>&1
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
echo "=== session G $(date -u +%FT%TZ) parts: $PARTS"

if has copy; then
  timeout 90 bench_copy --seconds 2 --mib 256 --adam-params 268435456 > "$out/bench_copy.jsonl" 2> /tmp/bench_copy.err
  echo "--- bench_copy: exit $?"; cat "$out/bench_copy.jsonl"; tail -n 3 /tmp/bench_copy.err
fi

if has warm; then
  # WARM_MODEL/WARM_SEQ/WARM_VOCAB/WORKER_ARGS let the same stage run on a dev box (tiny, CPU worker).
  model=${WARM_MODEL:-qwen3-4b} seq=${WARM_SEQ:-4096} vocab=${WARM_VOCAB:-151936}
  worker_args=${WORKER_ARGS:-"--gpu 0"}
  d=/tmp/warm; rm -rf $d; mkdir -p $d
  python3 bench/e2e/make_dataset.py --out $d/data --rows 64 --seq-len "$seq" --vocab "$vocab" > /dev/null
  for id in cold warm; do
    cat > $d/$id.yaml <<YAML
name: $id
model: {preset: $model, init_seed: 0}
data: {path: $d/data}
output: {dir: $d/out-$id, save_final: false}
train: {seq_len: $seq, global_batch: 4, micro_batch: 4, steps: 3, max_grad_norm: 1.0}
runtime: {workers: 1}
YAML
  done
  slidedp-hostd --listen unix:$d/hostd.sock --state-dir $d/state > $d/hostd.log 2>&1 &
  hostd_pid=$!
  sleep 2
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 slidedp-worker --hostd unix:$d/hostd.sock $worker_args > $d/worker.log 2>&1 &
  worker_pid=$!
  export SLIDEDP_HOSTD=unix:$d/hostd.sock
  for _ in $(seq 1 60); do slidedp workers 2>/dev/null | grep -q -E "gpu0|cpu0" && break; sleep 1; done
  for id in cold warm; do
    timeout 240 slidedp submit $d/$id.yaml --id $id > $d/$id.progress 2>&1
    echo "--- $id: exit $?: $(tail -n 2 $d/$id.progress | tr '\n' ' ')"
    slidedp status $id | grep -E "first step|state"
  done
  grep -h "reused pooled\|state segment\|host state" $d/hostd.log | tail -n 6
  grep -h "still mapped\|dropped the kept" $d/worker.log | tail -n 3
  kill $worker_pid $hostd_pid; wait
fi

if has curves; then
  STEPS=200 Q06_LR=1.0e-5 Q06_SCHEDULE=constant Q06_WARMUP=0 bash tools/gpu/session_d.sh
fi

if has policy; then
  MODEL=qwen3-4b GPUS=1 TOKENS_LIST=65536 WHAT=ours ACT_POLICY=selective WORK=/tmp/slidedp-e2e-selective \
    bash bench/e2e/run_bench.sh
  timeout 90 bench_step --model qwen3-4b --seq 4096 --tokens 65536 --micro-batch-rows 4 --policy selective --steps 3 \
    2>/dev/null | tail -n 1
fi
echo "=== session G done after $SECONDS s"
