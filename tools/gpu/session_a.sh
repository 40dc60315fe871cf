#!/usr/bin/env bash
# GPU-machine session, part A (run from the repo root with the bundle in .gpu/, logs to $OUT):
# kernel checks, the CUDA worker end to end on the tiny example, the whole model against HF
# transformers, LayerAdam against torch's CPU AdamW. Each stage has a time cap.
set -u
source tools/gpu/lib.sh
{ date -u; nvidia-smi -L; nproc; free -g | head -2; } > "$out/env.log" 2>&1
stage kernel_check 150 cuda_kernel_check
stage tiny_cuda 120 bash -c 'make_text_dataset --input examples/tiny/corpus.txt --output build/examples/tiny-data --repeat 4 &&
  slidedp run examples/tiny/job.yaml --backend cuda --run-dir /tmp/tiny-run; rc=$?; tail -n 30 /tmp/tiny-run/*.log; exit $rc'
stage hf_verify 320 bash tools/verify/gpu_verify.sh .gpu
stage layeradam 90 python3 bench/layeradam/torch_cpu_adamw.py --params 268435456 --threads 16 --bench .gpu/bin/bench_layeradam
ls -la "$out"
