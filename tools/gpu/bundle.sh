#!/usr/bin/env bash
# Packs the binaries a GPU-machine session needs into .gpu/ (git-ignored; carried by the device
# tool): stripped executables in .gpu/bin, their non-system libraries and gpu-env.sh in .gpu/lib.
# Usage: tools/gpu/bundle.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
out=$root/.gpu
rm -rf "$out/bin" "$out/lib"
mkdir -p "$out/bin"
bins=(slidedp slidedp-hostd slidedp-worker make_text_dataset cuda_kernel_check bench_kernels bench_layeradam
      ckpt_tool tok_bench model_grads dump_batches bench_step bench_copy)
for b in "${bins[@]}"; do
  if [ -x "$build/bin/$b" ]; then
    strip -o "$out/bin/$b" "$build/bin/$b"
  else
    echo "bundle: $b not built, skipped" >&2
  fi
done
"$root/../shared/gpu/bundle-libs.sh" "$out/lib" "$out"/bin/*

# The libraries are large (ICU alone is 31 MB); the device tool carries at most 64 MiB, so ship
# one xz archive and unpack it there with tools/gpu/unpack.sh.
(cd "$out" && tar -cf - bin lib | xz -6 -T2 > bundle.tar.xz && rm -rf bin lib)
ls -la "$out/bundle.tar.xz"
