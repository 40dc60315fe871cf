# The GPU machine's shared shell code, sourced from the repository root by bench/e2e/run_bench.sh and
# bench/e2e/scaling.sh, and by tools/gpu/run_suite.py (which takes the environment it leaves).
# Sourcing it unpacks the bundle (.gpu/bundle.tar.xz, made by tools/gpu/bundle.sh) unless it is
# unpacked already, sets the CUDA environment and PATH, and sets $out (= $OUT, the folder whose files
# the device tool returns). With DRY_RUN=1 nothing is unpacked.
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
