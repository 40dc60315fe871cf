#!/bin/bash
# GPU-machine verification of issue 3 (whole model against HF transformers) plus the checks of
# issue 4's loss-curve tooling. Run from the repository root with the build bundle in .gpu/:
#   .gpu/bin/{model_grads,dump_batches}, .gpu/lib/ (bundle-libs.sh output incl. gpu-env.sh)
#
#   bash tools/verify/gpu_verify.sh [BUNDLE_DIR]        (default .gpu; logs go to $OUT or /tmp)
#
# Stages (each logged to $OUT/<stage>.log; ~2-3 minutes in all on one H200):
#   env                 GPU, driver, torch/transformers versions
#   verify_py_test      torch-free script tests + dump_batches against the Python sampler port
#                       (here with numpy present, i.e. the numpy code paths)
#   hf_train_selftest   hf_train_reference.py end to end on a tiny model (HF loads our
#                       config.json format, schedule check, loss falls)
#   hf_compare          every shape: CUDA backend (4 runs each) and CPU backend (small shapes)
#                       against HF; per-run records in $OUT/hf_compare.jsonl
# Exit status: 0 when every stage passes, else the number of failed stages.
set -u
bdir=$(cd "${1:-.gpu}" 2>/dev/null && pwd || echo "${1:-.gpu}")
out=${OUT:-/tmp/slidedp-gpu-verify}
mkdir -p "$out"
work=$(mktemp -d /tmp/slidedp-verify.XXXXXX)  # models and gradients: large, kept out of $OUT
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
failed=0
export PYTHONDONTWRITEBYTECODE=1

if [ ! -f "$bdir/lib/gpu-env.sh" ]; then
  echo "gpu_verify: $bdir/lib/gpu-env.sh not found (build bundle missing?)" >&2
  exit 100
fi
# shellcheck disable=SC1091
source "$bdir/lib/gpu-env.sh" "$bdir/lib"  # (it sets its own $bundle)
for b in model_grads dump_batches; do
  if [ ! -x "$bdir/bin/$b" ]; then
    echo "gpu_verify: $bdir/bin/$b missing: build the targets model_grads and dump_batches" >&2
    exit 100
  fi
done

stage() {  # stage NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name: $*" | tee "$out/$name.log"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
  if [ $rc -ne 0 ]; then failed=$((failed + 1)); fi
  return 0
}

{
  date -u
  git rev-parse HEAD 2>/dev/null || echo "(no git)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c "import torch, transformers, safetensors, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| safetensors', safetensors.__version__, '| numpy', numpy.__version__)" 2>&1
  nproc
} > "$out/env.log" 2>&1
cat "$out/env.log"

stage verify_py_test 60 env SLIDEDP_DUMP_BATCHES="$bdir/bin/dump_batches" python3 "$here/verify_py_test.py" -v
stage hf_train_selftest 90 python3 "$here/hf_train_reference.py" --selftest
stage hf_compare 300 python3 "$here/hf_compare.py" --bin "$bdir/bin/model_grads" --work-dir "$work/hf_compare" \
  --results "$out/hf_compare.jsonl" --backends cuda,cpu --run-timeout 90

# The per-shape tables (the part docs/verification.md's Results quote).
grep -E "^(shape |run |hf |cuda |cpu |hf_compare:)" "$out/hf_compare.log" || true
tail -n 3 "$out/hf_train_selftest.log"
rm -rf "$work"
echo "gpu_verify: $failed failed stage(s); logs in $out"
exit $failed
