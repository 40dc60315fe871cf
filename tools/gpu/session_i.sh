#!/usr/bin/env bash
# GPU session I (nvidia-h200-x2): device gradient staging for exact clipping (issue 4's host
# memory target), in parts (PARTS):
#   check   cuda_kernel_check (incl. the FP64 sum-of-squares kernel) and the tiny job on CUDA
#   eq      Qwen3-0.6B, 20 steps, clip 1.0: 1 GPU device vs host staging, 2 GPUs (reduce-scatter)
#           device vs host staging; curves and FP32 weights against the 1-GPU host-staged run
#   bench4b bench/e2e at Qwen3-4B 64K on 1 GPU: ours (device staging: the default), ours with
#           host staging, and compute-only (the ratio's reference, same run)
#   bench8b Qwen3-8B 64K on 2 GPUs, ours (device staging)
#   floor   (GPU 1, in the background while the other parts use GPU 0) session_h.sh's 0.6B noise
#           floor: HF FP32 against HF autocast in the fine-tuning regime
#   warm, copy  session_g.sh's parts (cold/warm submit -> first step on GPU 0; bench_copy)
# Output: $out/session-i.log and the parts' files.
set -u
PARTS=${PARTS:-"check eq bench4b"}
source tools/gpu/lib.sh
log_session session-i
echo "=== session I $(date -u +%FT%TZ) parts: $PARTS"
if has floor; then
  PARTS=floor FLOOR_GPU=1 bash tools/gpu/session_h.sh > /tmp/floor.out 2>&1 &
  floor_pid=$!
fi

if has check; then
  timeout 200 cuda_kernel_check > /tmp/kcheck.log 2>&1
  echo "--- cuda_kernel_check: exit $?: $(grep -c '^PASS' /tmp/kcheck.log) PASS, $(grep -c '^FAIL' /tmp/kcheck.log) FAIL"
  grep -E "^FAIL|sum of squares" /tmp/kcheck.log
  CUDA_VISIBLE_DEVICES=0 timeout 60 slidedp run examples/tiny/job.yaml --backend cuda --run-dir /tmp/tiny-run > /tmp/tiny.log 2>&1
  echo "--- tiny on CUDA: exit $?: $(tail -n 2 /tmp/tiny.log | tr '\n' ' ')"
fi

if has eq; then
  STEPS=20
  eq() {  # eq NAME GPUS RUNTIME_EXTRA: lib.sh's run, then where the last step's time went
    eq_run /tmp/eqi "$1" "$2" "$3" "$STEPS" | python3 -c 'import json,sys
lines = sys.stdin.read().splitlines()
print(lines[0])
if len(lines) > 1:
    j = json.loads(lines[-1])
    print("   ", j["grad_staging"], "step", j["step_time_s"], "host_state_bytes", j["host_state_bytes"],
          "gpu_peak", j["gpu_peak_bytes"], j["busy_s"])'
  }
  mkdir -p /tmp/eqi
  python3 bench/e2e/make_dataset.py --out /tmp/eqi/data --rows $((8 * STEPS)) --seq-len 1024 --vocab 151936 > /dev/null
  eq g1-host 1 ", grad_staging: host"
  eq g1-device 1 ", grad_staging: device"
  eq g2-host 2 ", grad_staging: host"
  eq g2-device 2 ", grad_staging: device"
  for r in g1-device g2-host g2-device; do
    echo "--- curves g1-host vs $r"
    python3 tools/verify/compare_curves.py /tmp/eqi/g1-host/out/metrics-*.jsonl /tmp/eqi/$r/out/metrics-*.jsonl --tol 1e-4 --steps $STEPS
    echo "--- weights g1-host vs $r"
    python3 tools/verify/compare_params.py /tmp/eqi/$r/out/checkpoint-$STEPS /tmp/eqi/g1-host/out/checkpoint-$STEPS --tol-rel 1e-4 | tail -n 3
  done
fi

if has warm; then PARTS=warm bash tools/gpu/session_g.sh > /tmp/warm.out 2>&1; cat /tmp/warm.out; fi
if has copy; then PARTS=copy bash tools/gpu/session_g.sh > /tmp/copy.out 2>&1; cat /tmp/copy.out; fi

if has bench4b; then
  MODEL=qwen3-4b GPUS=1 TOKENS_LIST=65536 WHAT="ours compute" BUDGET_S=260 bash bench/e2e/run_bench.sh
  cp "$out/bench-summary.md" /tmp/bench-4b-device.md
  MODEL=qwen3-4b GPUS=1 TOKENS_LIST=65536 WHAT=ours RUNTIME_EXTRA="grad_staging: host" WORK=/tmp/slidedp-e2e-host \
    BUDGET_S=150 bash bench/e2e/run_bench.sh
  cp "$out/bench-summary.md" "$out/bench-4b-host-staging.md"
  cp /tmp/bench-4b-device.md "$out/bench-4b-device-staging.md"
fi
if has bench8b; then
  MODEL=qwen3-8b GPUS=2 TOKENS_LIST=65536 WHAT=ours BUDGET_S=200 WORK=/tmp/slidedp-e2e-8b bash bench/e2e/run_bench.sh
  cp "$out/bench-summary.md" "$out/bench-8b-device-staging.md"
fi
if has floor; then wait "$floor_pid"; cat /tmp/floor.out; fi
echo "=== session I done after $SECONDS s"
