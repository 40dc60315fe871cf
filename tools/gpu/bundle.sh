#!/usr/bin/env bash
# Packs what the GPU suite (tools/gpu/run_suite.sh) runs into .gpu/bundle.tar.xz (git-ignored;
# carried by the device tool as `.gpu`): stripped executables in bin/, every GPU test binary
# (BUILD_DIR/tests/*_gpu_test, registered in ctest with label gpu) and the host tests the suite's
# `state` part runs (adam_state_test, adam_engine_test, adam_kernels_test) in tests/, their non-system
# libraries and gpu-env.sh in lib/, and .gpu/build-info.txt (the commit the bundle was built at).
# tools/gpu/unpack.sh (called by suite_lib.sh) unpacks it on the GPU machine.
# Usage: tools/gpu/bundle.sh [BUILD_DIR] [--tests-only]   (default: build; build it with SLIDEDP_CUDA on, sm_90)
#        BUNDLE_BINS="slidedp ..." BUNDLE_TESTS="x_gpu_test ..." tools/gpu/bundle.sh   (a chosen subset)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
out=$root/.gpu
rm -rf "${out:?}/bin" "${out:?}/lib" "${out:?}/tests"
mkdir -p "$out/bin" "$out/tests"
bins=(slidedp slidedp-hostd slidedp-worker make_text_dataset attn_layouts_check bench_kernels bench_layeradam
      ckpt_tool tok_bench model_grads dump_batches bench_step bench_copy bench_gated_delta)
# --tests-only: the daemons, the CLI and the tests, no benchmarks (about 33 MB instead of 42: the
# device tool carries at most 64 MiB with the tree).
if [ "${2:-}" = "--tests-only" ] || [ "${1:-}" = "--tests-only" ]; then
  bins=(slidedp slidedp-hostd slidedp-worker make_text_dataset attn_layouts_check ckpt_tool)
  [ "${1:-}" = "--tests-only" ] && build=$root/build
fi
# BUNDLE_BINS / BUNDLE_TESTS (space-separated names): only these executables / GPU tests, so that one
# call's bundle fits the carry limit beside the tree.
[ -n "${BUNDLE_BINS:-}" ] && read -r -a bins <<< "$BUNDLE_BINS"
for b in "${bins[@]}"; do
  if [ -x "$build/bin/$b" ]; then
    strip -o "$out/bin/$b" "$build/bin/$b"
  else
    echo "bundle: $b not built, skipped" >&2
  fi
done
n_tests=0
for t in "$build"/tests/*_gpu_test; do
  [ -x "$t" ] || continue
  [ -n "${BUNDLE_TESTS:-}" ] && [[ " $BUNDLE_TESTS " != *" $(basename "$t") "* ]] && continue
  strip -o "$out/tests/$(basename "$t")" "$t"
  n_tests=$((n_tests + 1))
done
[ "$n_tests" -gt 0 ] || echo "bundle: no $build/tests/*_gpu_test built (run_suite.sh kernels will fail)" >&2
# Host tests the GPU machine's CPU runs for an ISA this machine may lack (run_suite.sh state).
for t in adam_state_test adam_engine_test adam_kernels_test; do
  [ -n "${BUNDLE_TESTS:-}" ] && [[ " $BUNDLE_TESTS " != *" $t "* ]] && continue
  [ -x "$build/tests/$t" ] && strip -o "$out/tests/$t" "$build/tests/$t" && n_tests=$((n_tests + 1))
done
shopt -s nullglob
exes=("$out"/bin/* "$out"/tests/*)
[ ${#exes[@]} -gt 0 ] || { echo "bundle: nothing built in $build" >&2; exit 1; }
"$root/../shared/gpu/bundle-libs.sh" "$out/lib" "${exes[@]}"
commit=$(git -C "$root" rev-parse --short HEAD 2> /dev/null || echo unknown)
git -C "$root" diff --quiet HEAD 2> /dev/null || commit="$commit + working-tree changes"
echo "bundle: $(date -u +%FT%TZ), commit $commit, $((${#exes[@]} - n_tests)) binaries, $n_tests GPU test binaries" |
  tee "$out/build-info.txt"

# The libraries are large (ICU alone is 31 MB); the device tool carries at most 64 MiB, so ship
# one xz archive and unpack it there with tools/gpu/unpack.sh.
(cd "$out" && tar -cf - bin lib tests build-info.txt | xz -6 -T2 > bundle.tar.xz && rm -rf bin lib tests)
size=$(stat -c %s "$out/bundle.tar.xz")
ls -la "$out/bundle.tar.xz"
[ "$size" -lt $((60 * 1024 * 1024)) ] || echo "bundle: $((size >> 20)) MiB: near the device tool's 64 MiB carry limit" >&2
