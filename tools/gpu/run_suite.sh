#!/usr/bin/env bash
# shellcheck disable=SC2317  # (the parts are called as "part_$part", which shellcheck cannot follow)
# The GPU suite: named parts, each one device call of at most 10 minutes on one H200 (docs/gpu-suite.md).
# Run from the repository root on the GPU machine with the bundle in .gpu/ (tools/gpu/bundle.sh):
#
#   tools/gpu/run_suite.sh PART [PART...]      run the parts in order (one call: mind the minutes)
#   tools/gpu/run_suite.sh [--help|list]       this text
#
# Parts (minutes on 1x H200; what each gates):
#   smoke      ~1   the tiny example on the CUDA backend: succeeds, final loss <= 3.5
#   families   ~3   issue 24: tiny-qwen2 / tiny-llama / tiny-mistral on CUDA with a validation split
#                   (eval every step) and TensorBoard: at lr 0 the validation losses equal the CPU
#                   backend's (FAMILIES_TOL 5e-3), the events read back equal to the JSONL
#                   (tools/gpu/tensorboard_check.py); then 60 steps train (final loss <= 5.0)
#   kernels    ~1-4 every bundled GPU test binary (.gpu/tests/*_gpu_test, gtest XML): all pass
#   layouts    ~2   attn_layouts_check on the 1.7B fine-tune's 200 steps of document layouts: cuDNN
#                   and the own attention agree per document on every micro-batch (tolerance 2e-2)
#   hf         ~5-7 gpu_verify.sh (script tests, hf_train_reference self-test, hf_compare: loss rel
#                   <= 1e-3, every gradient rel L2 <= 2e-2 or <= 1.25x HF's own FP32-vs-autocast
#                   distance), hf_checkpoint_check selftest, tokenizer vs HF tokenizers (0 differ)
#   graddiff   ~6   Qwen3-1.7B, one fine-tuning step's gradients on our checkpoint (grad_diff.py):
#                   loss rel <= 1e-3, total gradient norm rel <= 2e-2 against HF autocast
#   curves     ~6/9 loss curves, ours vs HF + torch AdamW from our pretrain's weights on the same
#                   batches: max |dloss| <= 6e-4 over 200 fine-tuning steps (0.6B; 1.7B: CURVES_MODEL)
#   determinism ~2  runtime.deterministic: the same job twice, bitwise equal losses and unit norms
#   offload    ~2   bench_step at offload ratios 0, 0.5, 1: bitwise equal losses
#   routes     ~3   Qwen3-0.6B 20 steps: host vs device gradient staging (1 GPU) and, with 2 GPUs,
#                   every gradient route against 1 GPU: |dloss| <= 2e-4, weights rel L2 <= 1e-4
#   routespeed ~15  (2 GPUs, issue 26) each route's speed: for ROUTESPEED_MODELS ("qwen3-4b qwen3-8b") at
#                   ROUTESPEED_TOKENS ("16384 65536") per GPU, `slidedp plan --measure` of a spec with
#                   grad_reduction and param_delivery auto (each route measured by its own job): every
#                   route's step and tok/s per GPU (figures), auto's pick within 3% of the fastest
#   bench      ~6   end-to-end, Qwen3-4B 1 GPU (BENCH_MODEL): ours / compute-only >= 0.95, ours /
#                   FSDP2 GPU-resident >= 1.5, ours / FSDP2 CPU offload >= 4 (same 16K), host
#                   <= 13.1 GiB per billion parameters (bench/e2e/report.py's targets)
#   clip       ~8   issue 20, Qwen3-4B 1 GPU at 16K (CLIP_MODEL, CLIP_TOKENS): ours with clipping
#                   (speculative; and a threshold the norm never reaches), the path that waits for
#                   the norm (speculation_bytes: 0), no clipping, compute-only and FSDP2 in one
#                   run: clip / compute-only >= 0.95, clip / FSDP2 >= 1.25, clip step <= 1.05x
#                   no-clip step; host_hidden_fraction and speculation per variant (figures)
#   specbits   ~3   speculative clipping on CUDA is the path that waits for the norm, bit for bit:
#                   Qwen3-0.6B, runtime.deterministic, 6 steps, losses of speculation_bytes auto
#                   and 0 equal at a threshold never reached (every step commits) and one always
#                   reached (a redo, then speculation off)
#   mastersrc  ~6   runtime.param_source master (issue 21), cast on the GPU and on the host: Qwen3-0.6B
#                   deterministic, 6 steps, losses bitwise equal to the mirror's; Qwen3-4B 16K tok/s of
#                   each (MASTERSRC_MODEL/TOKENS/VARIANTS)
#   big        ~8   issue 21: Qwen3-14B (BIG_MODEL) int8 moments + param_source master at 64K tokens
#                   (BIG_TOKENS), with and without clipping (BIG_VARIANTS), against compute-only:
#                   >= 0.95; host state and MemAvailable drop per billion parameters (target 6 GiB/B);
#                   BIG_GPUS (1; 2: issue 26's Qwen3-32B / 14B on two GPUs, tok/s per GPU against one GPU's
#                   compute-only), BIG_STATE_DTYPE (int8; fp32: the exact state)
#   memlimit   ~3   issue 22: runtime.gpu_memory_limit (MEMLIMIT, 40GiB) on Qwen3-4B at 64K, act_policy
#                   auto (MEMLIMIT_ACT_POLICY, MEMLIMIT_RUNTIME_EXTRA, MEMLIMIT_STEPS, MEMLIMIT_STEADY_FROM:
#                   e.g. recompute, "policy: auto", 8, 5 for AutoPolicy):
#                   the limited run's GPU peak under the limit; its speed >= 0.9 of the unlimited
#   policy     ~2   issue 22: a per-layer layout file (every kind, offloads) on Qwen3-0.6B deterministic:
#                   losses bitwise (<= 1e-4) those of whole-layer recompute; GPU peaks (figures)
#   autopolicy ~7   issue 22: runtime.policy auto on Qwen3-8B (AP_MODEL) at 64K (AP_TOKENS): measured,
#                   solved and validated in the run, then again from the cache; against act_policy
#                   auto and FSDP2 GPU-resident at 16K (AP_PEER_TOKENS): / FSDP2 >= 1.65 (4B: 1.7),
#                   / act_policy auto >= 0.99, predicted step within 10%, selection <= 60 s
#                   (tools/gpu/autopolicy_check.py); AP_MAX_GRAD_NORM (1.0), AP_STATE_DTYPE (fp32) and
#                   AP_RUNTIME_EXTRA set ours' clipping, Adam moments and more runtime keys; AP_VARIANTS
#                   a subset of "auto cached today peer"; AP_SWEEP (1): the auto run then measures the
#                   fixed layouts of SweepLayouts one step each (SLIDEDP_AUTOPOLICY_SWEEP) and AutoPolicy's
#                   steady step must be within 2% of the fastest; AP_STEPS (20 with the sweep, else 8)
#   scaling    ~10  (2 GPUs) Qwen3-8B 1 -> 2 GPUs at 64K per GPU >= 1.95x (weak); at each global batch of
#                   SCALING_STRONG ("65536 16384"; empty: none) 1 GPU at G vs 2 GPUs at G / 2 >= 1.9x (strong:
#                   issue 26, the host's work does not halve); ours / FSDP2 on 2 GPUs >= 1.5
#   state      ~3   issue 21, compact Adam moments on the GPU machine's host: adam_state_test and
#                   adam_engine_test, adam_kernels_test (bundled host tests: the AVX-512 kernels bit-identical to
#                   scalar), bench_layeradam with fp32 / bf16 / int8 moments: int8 Gparam/s >= 1.5x fp32
#   host       ~5   LayerAdam / torch fused CPU AdamW >= 1.1 and >= 0.8 of copy bandwidth;
#                   bench_copy (continuous and --duty 20:20): H2D with LayerAdam + copy priority
#                   >= 0.9 of solo; warm submit -> first step (figures)
#   plan       ~7   issue 22: `slidedp plan --measure` on a node service (hostd + one worker): for PLAN_MODEL
#                   (qwen3-4b) at each of PLAN_TOKENS ("16384 65536") tokens per step, the measuring job, then
#                   for each of PLAN_POLICIES ("recompute selective auto") `slidedp plan` before the job and the
#                   job itself (PLAN_STEPS, 8): predicted step within 10% of the median from step 4
#                   (tools/gpu/plan_check.py); the measuring job's time (figure); PLAN_RUNTIME_EXTRA more
#                   runtime keys (e.g. "chunk_bytes: auto": a measuring job per chunk size)
#   restart    ~5   Qwen3-4B on a node service: hostd killed (SIGKILL) right after a step and started
#                   again resumes from shared memory; losses bitwise equal to an uninterrupted run
#                   (runtime.deterministic), restart -> next step (figure)
#   kbench     ~5   bench_kernels: cuDNN attention >= 400 TFLOP/s forward, >= 300 backward (causal,
#                   >= 4K tokens); Qwen3-8B decoder layer keep-all >= 550 at 64K; torch SDPA (figures)
#   moe        ~9   issue 23: Qwen3-30B-A3B's shape (qwen3-30b-a3b) at MOE_LAYERS (16) of its 48 layers with int8
#                   moments and param_source master, MOE_TOKENS (262144) per step: ours / compute-only >= 0.9;
#                   at MOE_PEER_LAYERS (8) ours (MOE_PEER_STATE_DTYPE fp32) / FSDP2 GPU-resident HF
#                   Qwen3-MoE >= 1.5; MOE_WHAT picks the stages ("big peer"); MOE_PARAM_SOURCE (master) the big
#                   stage's runtime.param_source (mirror: BF16 delivery, 2 B/param more host state)
#   moebench   ~2   one Qwen3-30B-A3B sparse layer at MOEBENCH_TOKENS ("16384 32768"), bench_kernels --moe:
#                   fwd+bwd TFLOP/s per policy, bucketed vs exact GEMM plans, host enqueue time (figures)
#   cp1gpu     ~2   context parallelism's CUDA path on one GPU: two CUDA workers sharing GPU 0 (keys and
#                   values through shm, staged), context_parallel 2 vs 1 worker on CP_MODEL (qwen3-0.6b), 2 x
#                   CP_SEQ (8192) tokens per step, CP_STEPS (6) deterministic steps: losses within 2e-3, gradient
#                   norms within 2e-2 relative (CP_VOCAB: the dataset's vocabulary, 512 for the tiny presets;
#                   CP_TRAIN_EXTRA more train keys, e.g. "router_aux_loss_coef: 0.05" with tiny-moe: aux 2e-3;
#                   CP_DETERMINISTIC false for head dims other than 64 / 128, the tiny presets'; CP_LAYERS a
#                   reduced depth; CP_SEQ > 32768 adds yarn RoPE, as longctx does)
#   longctx    ~9   long context: Qwen3-8B (LONGCTX_MODEL), one sequence of 262,144 tokens (LONGCTX_SEQ) per
#                   step through slidedp run (yarn RoPE to the row, int8 moments, param_source master,
#                   recompute with LONGCTX_OFFLOAD of the layers' checkpoints in pinned host memory): trains
#                   (finite loss on each of LONGCTX_STEPS steps), last step >= 450 model TFLOP/s; compute-only
#                   (bench_step on LONGCTX_COMPUTE_LAYERS layers) and FSDP2 GPU-resident at the longest of
#                   LONGCTX_PEER_SEQS that runs (figures); LONGCTX_WHAT picks and orders the stages;
#                   LONGCTX_LAYERS a reduced depth of the preset for ours (a 512K-1M step of the whole
#                   model outlasts one device call); LONGCTX_CP (1) splits the sequence over that many GPUs
#                   (runtime.context_parallel, grad_reduction gpu: NCCL; ours only, model TFLOP/s per GPU)
#
# Output: $OUT/summary.txt (one line per check: PASS / FAIL / INFO / SKIP, the figure and its
# threshold), $OUT/suite.log (everything printed), $OUT/details.tar.gz (each part's logs and result
# files, rewritten after every part). Exit status 0 when no check failed, 1 otherwise, 2 for usage.
#
# Knobs (environment):
#   SUITE_DEADLINE   seconds after the start by which every stage must have ended (570: the device
#                    tool stops a command at 600 s); stages are cut to fit, and skipped when not
#   SUITE_WORK       scratch space (/tmp/slidedp-suite; large: models, checkpoints)
#   DRY_RUN=1        print the commands each part would run, run nothing (works without a bundle);
#                    DRY_GPUS=2 as if two GPUs were visible (the two-GPU parts)
#   KERNELS_FILTER   --gtest_filter for every GPU test binary     KERNELS_CAP  per binary (300 s)
#   KERNELS_CTEST=1  `ctest -L gpu` in KERNELS_BUILD_DIR (build) instead of the bundled binaries
#   KERNELS_WRAP     a command to run each binary under, e.g. "compute-sanitizer --tool memcheck"
#   LAYOUTS_PRESET   the fine-tune whose layouts are checked (qwen3-1.7b; heads from the preset)
#   LAYOUTS_STEPS    (200)    LAYOUTS_CAP (300 s)
#   HF_SHAPES        hf_compare's --shapes (all five)
#   FAMILIES_PRESETS FAMILIES_RUNTIME_EXTRA  the families part's presets, more runtime keys for its jobs
#   CURVES_MODEL     qwen3-0.6b (pretrain 250 steps) | qwen3-1.7b (pretrain 160, deterministic)
#   CURVES_PRE CURVES_STEPS (200) CURVES_DET (0/1)  override the model's settings
#   CURVES_REFS      HF references (0.6B: "bf16-autocast bf16-mirror-fp32-norms"; 1.7B:
#                    bf16-autocast); the first is the gate, the others are INFO lines (the
#                    reference's own spread); NAME-eager runs it with eager attention
#   CURVES_HF_CAP    seconds per reference (220)
#   CURVES_BF16_GRADS=1  also ours with runtime.grad_dtype bf16 on the same batches (figure vs HF)
#   CURVES_STATES    e.g. "int8 bf16": also ours with those optimizer.state_dtype, judged against ours
#                    with FP32 moments (issue 21: max |dloss| <= 1e-2, final loss within 0.5%)
#   CURVES_DEADLINE  seconds after the start by which every HF reference stops, keeping its curve
#                    so far (SUITE_DEADLINE - 25); a reference cut short fails the 200-step gate
#   DET_MODEL DET_STEPS  the repeatability job (qwen3-0.6b, 3 steps)
#   OFFLOAD_MODEL    (qwen3-4b, 64K tokens, seq 4096)
#   CLIP_MODEL CLIP_TOKENS CLIP_POLICY  the clip part's model (qwen3-4b), batch (16384), act_policy (auto)
#   CLIP_VARIANTS    "name:max_grad_norm:runtime_key=value ..." (or state_dtype=int8) ("spec:1.0: high:1e4: wait:1.0:
#                    speculation_bytes=0 noclip:0:")    CLIP_PEERS  ("compute fsdp2")
#   ROUTES_STEPS     (20)
#   BENCH_MODEL      qwen3-4b | qwen3-8b (8B: no CPU-offload peer, it needs 128 GB of host memory)
#   BENCH_TOKENS     ours' tokens per step (65536)     BENCH_PEER_TOKENS  the peers' (16384)
#   BENCH_POLICY     ours' act_policy (auto)           BENCH_OFFLOAD  run the CPU-offload peer (4B: 1)
#   BENCH_RUNTIME_EXTRA  more runtime keys for ours, e.g. "deterministic: true" or "embedding_rows: bf16"
#   BENCH_MAX_GRAD_NORM  ours' clipping (1.0; 0 = none, as the peer)
#   RESTART_MODEL    (qwen3-4b)   RESTART_STEPS (8)   RESTART_KILL_AT  the step after which hostd is killed (3)
#   KBENCH_QUICK=1   bench_kernels --quick (8B at 4K only; the layer gate becomes a figure)
#   LONGCTX_MODEL LONGCTX_SEQ LONGCTX_STEPS  ours' model (qwen3-8b), row = step (262144), steps (2: step 1 is
#                    warm-up, the gate reads the last); yarn factor SEQ / 32768, max_position_embeddings
#                    max(SEQ, 40960)
#   LONGCTX_OFFLOAD  runtime.offload_ratio (0.4)   LONGCTX_TILE  runtime.tile_tokens (32768; empty: key left out)
#   LONGCTX_CHECKPOINT_DTYPE  runtime.checkpoint_dtype of ours and compute-only (fp32; bf16: half the layer inputs)
#   LONGCTX_RUNTIME_EXTRA  more runtime keys for ours     LONGCTX_WHAT  the stages, in order ("ours compute peer")
#   LONGCTX_POLICY  a policy file for ours (relative to the repository root; tools/gpu/layouts/), over
#                   act_policy and offload_ratio
#   LONGCTX_OURS_CAP (470) LONGCTX_COMPUTE_CAP (120) LONGCTX_PEER_CAP (150, per sequence length)  seconds
#   LONGCTX_COMPUTE_LAYERS  bench_step's depth (4; 0: all, which takes as long as ours)
#   LONGCTX_COMPUTE_OFFLOAD (0 on fewer layers, else LONGCTX_OFFLOAD)   LONGCTX_COMPUTE_STEPS (2)
#   LONGCTX_PEER_SEQS  FSDP2's row lengths, longest first; the first that runs ends the stage ("65536 32768
#                    16384")       LONGCTX_PEER_STEPS (4; the peer's median after 3 warm-up steps)
#                    Results stay in $SUITE_WORK/longctx/MODEL-sSEQ on a warm machine: a later call with
#                    LONGCTX_WHAT="compute peer" is judged with the earlier call's ours (its lines say so)
set -u
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$self")/../.." || exit 2

# Thresholds. Every gate of the suite is here, in suite_judge.py's arguments below, or (the
# end-to-end targets of issue 4) in bench/e2e/report.py. Where a number comes from:
readonly SMOKE_MAX_LOSS=3.5        # tiny example, 120 steps: ln 512 = 6.24 at the start, 3.16 measured (K9)
readonly HF_LOSS_TOL=1e-3          # hf_compare.py's tolerances (docs/verification.md)
readonly HF_GRAD_TOL=2e-2
readonly HF_FLOOR_FACTOR=1.25      # a gradient over HF_GRAD_TOL passes within this factor of HF's own
                                   # FP32-vs-autocast distance on the same tensor (the q/k-norm weights:
                                   # ours 2.04e-2 / 2.38e-2 where HF FP32 is 1.82e-2 / 2.24e-2, session 4)
readonly GRADDIFF_LOSS_TOL=1e-3    # hf_compare.py's loss tolerance, on the total of one batch
readonly GRADDIFF_NORM_TOL=2e-2    # hf_compare.py's gradient tolerance, on the total norm
readonly CURVES_TOL=6e-4           # issue 4: max |dloss| against HF autocast over 200 fine-tuning steps
readonly ROUTES_LOSS_TOL=2e-4      # 20 steps at loss ~12 (9e-6 relative): the batch split and cuDNN's
                                   # atomic dQ gave up to 1.6e-4 (sessions E, I; their scripts said 1e-4)
readonly ROUTES_WEIGHT_TOL=1e-4    # FP32 weights after 20 steps, worst tensor (sessions E, I: 6.4e-5)
readonly LAYERADAM_T_TORCH=1.1     # issue 2: LayerAdam >= 1.1x torch's fused CPU AdamW
readonly LAYERADAM_T_COPY=0.8      # ... and >= 0.8 of the host's copy bandwidth (28 B/param)
readonly KBENCH_T_FWD=400          # issue 3: attention TFLOP/s, causal, 4K+ tokens (docs/kernels.md)
readonly KBENCH_T_BWD=300
readonly KBENCH_T_LAYER=550        # Qwen3-8B decoder layer keep-all over 64K tokens
readonly LONGCTX_T_TFLOPS=450      # long context: Qwen3-8B, one 256K sequence per step, model TFLOP/s (6N + 6 L s q_dim)

PARTS_ALL="smoke families kernels layouts hf graddiff curves determinism offload routes routespeed bench clip specbits mastersrc big memlimit policy autopolicy plan scaling state host restart kbench longctx moe moebench cp1gpu"
usage() { sed -n '3,/^set -u/p' "$self" | sed '$d; s/^# \{0,1\}//'; }
if [ $# -eq 0 ] || [ "$1" = --help ] || [ "$1" = -h ] || [ "$1" = list ]; then usage; exit 0; fi
for p in "$@"; do
  case " $PARTS_ALL " in *" $p "*) ;; *) echo "run_suite: unknown part '$p' (parts: $PARTS_ALL)" >&2; exit 2 ;; esac
done

export OUT=${OUT:-/tmp/slidedp-suite-out}
SUITE_DEADLINE=${SUITE_DEADLINE:-570}
work=${SUITE_WORK:-/tmp/slidedp-suite}
rm -rf "$work/out"  # (what this call returns: its own parts only)
mkdir -p "$OUT" "$work/out"
summary=$OUT/summary.txt
: > "$summary"
exec > >(tee "$OUT/suite.log") 2>&1
# shellcheck source=tools/gpu/suite_lib.sh
source tools/gpu/suite_lib.sh
gpus=1
have_smi=0
command -v nvidia-smi > /dev/null && have_smi=1
if ! dry && [ $have_smi = 1 ]; then gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU'); fi
dry && gpus=${DRY_GPUS:-1}  # a dry run of the two-GPU parts: DRY_GPUS=2

# result STATUS PART TEXT: one summary line.
result() { printf '%-4s %-11s %s\n' "$1" "$2" "$3" | tee -a "$summary"; }
# judge CHECK ARGS...: a verdict of tools/gpu/suite_judge.py for the current part (its lines go to
# the summary; DRY_RUN prints the call).
judge() {
  local check=$1
  shift
  if dry; then
    echo "DRY  judge $check $*"
    return 0
  fi
  python3 tools/gpu/suite_judge.py "$check" --part "$part" "$@" | tee -a "$summary"
}
# judge_exit WHAT RC [GATE_TEXT]: PASS when the stage exited 0.
judge_exit() {
  dry && return 0
  if [ "$2" = 0 ]; then result PASS "$part" "$1: exit 0 (${3:-must exit 0})"
  else result FAIL "$part" "$1: exit $2 (${3:-must exit 0}; see details.tar.gz: $part/)"; fi
}
pack_details() {  # the parts' result files, small ones only (the device tool returns <= 16 MiB a file)
  dry && return 0
  (cd "$work/out" && find . -type f -size -4M -print0 | tar --null -czf "$OUT/details.tar.gz.tmp" -T - &&
    mv "$OUT/details.tar.gz.tmp" "$OUT/details.tar.gz") 2> /dev/null
}
# new_dir DIR: an empty scratch folder.
new_dir() { rm -rf "$1"; mkdir -p "$1"; }
# copy_metrics GLOB FILE: our metrics JSONL (GLOB: hostd's output.dir/metrics-*.jsonl) into FILE.
# shellcheck disable=SC2086  # (GLOB is meant to expand)
copy_metrics() { cat $1 > "$2" 2> /dev/null || true; }

# ------------------------------------------------------------------------------------------ parts

part_smoke() {
  find_cudnn
  stage tiny_data 60 make_text_dataset --input examples/tiny/corpus.txt --output build/examples/tiny-data --repeat 4
  rm -rf build/examples/tiny-out
  stage tiny_cuda 150 slidedp run examples/tiny/job.yaml --backend cuda --run-dir "$part_dir/tiny-run"
  judge tiny --log "$part_dir/tiny_cuda.log" --rc $? --max-loss "$SMOKE_MAX_LOSS" --expect-steps 120 \
    --run-dir "$part_dir/tiny-run"
}

# issue 24: each family's tiny preset on the CUDA backend through the whole pipeline (q/k/v biases,
# RoPE without q/k norm, llama3-scaled RoPE), with a validation split, eval every step and
# TensorBoard events: at lr 0 the validation losses equal the CPU backend's within FAMILIES_TOL, and
# the events file reads back in TensorBoard's own reader equal to the JSONL; then each trains.
part_families() {
  find_cudnn
  [ -f build/examples/tiny-data/manifest.json ] ||
    stage tiny_data 60 make_text_dataset --input examples/tiny/corpus.txt --output build/examples/tiny-data --repeat 4
  local preset backend d spec job
  for preset in ${FAMILIES_PRESETS:-tiny-qwen2 tiny-llama tiny-mistral}; do
    for backend in cuda cpu; do
      d=$work/families/$preset-$backend
      new_dir "$d"
      spec=$d/job.yaml
      dry || cat > "$spec" <<YAML
name: fam
model: {preset: $preset, init_seed: 2}
data: {path: $PWD/build/examples/tiny-data, validation: $PWD/build/examples/tiny-data}
output: {dir: $d/out, save_final: false, tensorboard: true}
train: {seq_len: 128, global_batch: 8, micro_batch: 2, steps: 3, seed: 0, eval_every: 1}
optimizer: {lr: 0.0}
runtime: {workers: 1${FAMILIES_RUNTIME_EXTRA:+, $FAMILIES_RUNTIME_EXTRA}}
YAML
      stage "eval_${preset}_$backend" 150 slidedp run "$spec" --backend "$backend" --run-dir "$d/run"
      copy_metrics "$d/out/metrics-*.jsonl" "$part_dir/$preset-$backend.jsonl"
    done
    judge eval-parity --cuda "$part_dir/$preset-cuda.jsonl" --cpu "$part_dir/$preset-cpu.jsonl" \
      --tol "${FAMILIES_TOL:-5e-3}" --what "$preset at lr 0"
    # The backward too: at lr 0 every step's gradient norm is the same weights' (CUDA vs CPU).
    dry || python3 - "$part_dir/$preset-cuda.jsonl" "$part_dir/$preset-cpu.jsonl" "$preset" \
      "${FAMILIES_GRAD_TOL:-2e-2}" << 'PY' | tee -a "$summary"
import json, sys
read = lambda p: {r["step"]: r for r in map(json.loads, filter(str.strip, open(p)))}
g, c = read(sys.argv[1]), read(sys.argv[2])
tol = float(sys.argv[4])
rel = [abs(g[s]["grad_norm"] - c[s]["grad_norm"]) / abs(c[s]["grad_norm"]) for s in sorted(set(g) & set(c))
       if c[s].get("grad_norm")]
worst = max(rel) if rel else float("nan")
print(f"{'PASS' if rel and worst <= tol else 'FAIL'} families    {sys.argv[3]} at lr 0: gradient norm CUDA vs CPU "
      f"backend, {len(rel)} steps, worst rel {worst:.3g} (<= {tol})")
PY
    d=$work/families/$preset-cuda
    job=$(basename "$(ls -d "$d"/out/tensorboard/* 2> /dev/null | head -1)" 2> /dev/null)
    stage "tensorboard_$preset" 60 python3 tools/gpu/tensorboard_check.py --events "$d/out/tensorboard/$job" \
      --metrics "$d/out/metrics-$job.jsonl"
    judge stages --dir "$part_dir" --names "tensorboard_$preset"
    d=$work/families/$preset-train
    new_dir "$d"
    dry || sed -e "s|lr: 0.0|lr: 3.0e-3|" -e "s|steps: 3,|steps: 60,|" -e "s|eval_every: 1|eval_every: 30|" \
      -e "s|$work/families/$preset-cuda|$d|" "$work/families/$preset-cuda/job.yaml" > "$d/job.yaml"
    stage "train_$preset" 150 slidedp run "$d/job.yaml" --backend cuda --run-dir "$d/run"
    judge tiny --log "$part_dir/train_$preset.log" --rc $? --max-loss "${FAMILIES_MAX_LOSS:-5.0}" --expect-steps 60 \
      --run-dir "$d/run"
  done
}

part_kernels() {
  find_cudnn
  local xml=$part_dir/xml rcs=() t name rc
  mkdir -p "$xml"
  if [ "${KERNELS_CTEST:-0}" = 1 ]; then
    local b=${KERNELS_BUILD_DIR:-build}
    stage ctest_gpu 540 ctest --test-dir "$b" -L gpu --output-on-failure --timeout "${KERNELS_CAP:-300}" \
      --output-junit "$xml/ctest-gpu.xml"
    judge gtest --xml-dir "$xml" --rc "ctest-gpu=$?"
    return
  fi
  local wrap=()
  read -r -a wrap <<< "${KERNELS_WRAP:-}"
  local filter=()
  [ -n "${KERNELS_FILTER:-}" ] && filter=("--gtest_filter=$KERNELS_FILTER")
  dry && echo "DRY  each .gpu/tests/*_gpu_test: env SLIDEDP_SOURCE_DIR=\$PWD SLIDEDP_BUILD_DIR=\$PWD/.gpu" \
    "${wrap[*]} BINARY --gtest_output=xml:$xml/BINARY.xml ${filter[*]}"
  for t in .gpu/tests/*_gpu_test; do
    [ -e "$t" ] || continue
    name=$(basename "$t")
    stage "$name" "${KERNELS_CAP:-300}" env SLIDEDP_SOURCE_DIR="$PWD" SLIDEDP_BUILD_DIR="$PWD/.gpu" GTEST_COLOR=no \
      "${wrap[@]}" "$t" "--gtest_output=xml:$xml/$name.xml" "${filter[@]}"
    rc=$?
    rcs+=(--rc "$name=$rc")
  done
  judge gtest --xml-dir "$xml" "${rcs[@]}" --none-why "no .gpu/tests/*_gpu_test: rebuild the bundle with tools/gpu/bundle.sh"
}

part_layouts() {
  find_cudnn
  text_dataset
  local d=$work/layouts preset=${LAYOUTS_PRESET:-qwen3-1.7b} steps=${LAYOUTS_STEPS:-200} heads
  case $preset in
    qwen3-0.6b|qwen3-1.7b) heads=16/8 ;; qwen3-4b|qwen3-8b) heads=32/8 ;; qwen3-14b) heads=40/8 ;;
    *) result FAIL layouts "LAYOUTS_PRESET=$preset: no head counts known"; return ;;
  esac
  new_dir "$d"
  spec_finetune "$d" "preset: $preset, init_seed: 0" "$steps" ""
  stage layouts_batches 120 dump_batches --job "$d/ft.yaml" --out "$d/layouts.bin"
  stage attn_layouts "${LAYOUTS_CAP:-300}" attn_layouts_check "--attn-layouts=$d/layouts.bin" "--heads=$heads" \
    --head-dim=128 --mb-rows=4
  # 8 rows per step in micro-batches of 4: two micro-batches a step
  judge layouts --log "$part_dir/attn_layouts.log" --rc $? --expect $((steps * 2))
}

part_hf() {
  find_cudnn
  local shapes=()
  [ -n "${HF_SHAPES:-}" ] && shapes=(--shapes "$HF_SHAPES")
  # gpu_verify.sh: verify_py_test, hf_train_reference --selftest, hf_compare (logs into $part_dir)
  if [ ${#shapes[@]} -eq 0 ]; then
    stage gpu_verify 420 env OUT="$part_dir" bash tools/verify/gpu_verify.sh .gpu
  else  # only the comparison, on the shapes asked for
    stage hf_compare 420 python3 tools/verify/hf_compare.py --bin .gpu/bin/model_grads --work-dir "$work/hfc" \
      --results "$part_dir/hf_compare.jsonl" --backends cuda,cpu --run-timeout 90 "${shapes[@]}"
  fi
  [ ${#shapes[@]} -eq 0 ] && judge stages --dir "$part_dir" --names verify_py_test,hf_train_selftest
  judge hf-compare --results "$part_dir/hf_compare.jsonl" --loss-tol "$HF_LOSS_TOL" --grad-tol "$HF_GRAD_TOL" \
    --floor-factor "$HF_FLOOR_FACTOR"
  stage ckpt_hf 120 python3 tools/hf_checkpoint_check.py selftest --ckpt-tool .gpu/bin/ckpt_tool
  judge_exit "hf_checkpoint_check selftest (our checkpoints load in HF bit-exactly and back)" $? \
    "must exit 0: every tensor equal"
  stage tokenizer_vs_hf 180 python3 tools/tokenizer/compare_and_bench.py --tok-bench .gpu/bin/tok_bench \
    --tokenizer tests/data/tokenizer/qwen3/tokenizer.json --build-corpus "" --fuzz-docs 20000 --fuzz-seed 7 \
    --threads "$(nproc)" --repeat 1 --corpus "$work/tok_fuzz.jsonl" --mismatches "$part_dir/tok_mismatches.jsonl" \
    --report "$part_dir/tok_report.json"
  judge tokenizer --report "$part_dir/tok_report.json" --rc $?
}

part_graddiff() {
  find_cudnn
  text_dataset
  local d=$work/graddiff
  new_dir "$d"
  spec_short_pretrain "$d" qwen3-1.7b 150
  # One fine-tuning step saving its FP32 checkpoint, then step 1's batch (0-based) from the same
  # sampler: the gradients of fine-tune step 2 on the weights after step 1 (sessions 4-6).
  spec_finetune "$d" "path: $d/pre/checkpoint-150" 1 "" "save_every: 1, save_dtype: fp32, keep_last: 1"
  stage gd_pretrain 240 slidedp run "$d/pre.yaml" --backend cuda --run-dir "$d/run-pre"
  rm -f "$d/pre/checkpoint-150/optimizer.safetensors"  # disk: the fine-tune reads the weights only
  stage gd_finetune 150 slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft"
  rm -f "$d"/ft/checkpoint-*/optimizer.safetensors
  stage gd_batches 60 dump_batches --job "$d/ft.yaml" --steps 2 --out "$d/batches.bin"
  stage grad_diff 330 python3 tools/verify/grad_diff.py --bin "$(command -v model_grads || echo model_grads)" \
    --model "$d/ft/checkpoint-1" --batches "$d/batches.bin" --step 1 --top 20
  judge graddiff --log "$part_dir/grad_diff.log" --rc $? --loss-tol "$GRADDIFF_LOSS_TOL" \
    --norm-tol "$GRADDIFF_NORM_TOL" --what "Qwen3-1.7B fine-tune step 2, ours vs HF autocast on our weights"
  dry || rm -rf "$d"  # ~35 GB of checkpoints
}

part_curves() {
  find_cudnn
  local model=${CURVES_MODEL:-qwen3-0.6b} pre det refs
  case $model in  # a Llama 3 preset trains on text in Llama 3's vocabulary
    llama3*) export SUITE_DS=/tmp/ds-llama3 SUITE_TOKENIZER=tests/data/chat_templates/llama3 ;;
    tiny*)  # the tiny presets' 512-token vocabulary: the same Python sources, one token per byte
      export SUITE_DS=/tmp/ds-bytes
      if [ ! -f "$SUITE_DS/.ready" ] && ! dry; then
        find /usr/lib/python3* -name '*.py' -size +1k 2> /dev/null | sort | head -n 3000 | xargs cat > /tmp/corpus-bytes.txt
        stage bytes_dataset 90 make_text_dataset --input /tmp/corpus-bytes.txt --output "$SUITE_DS/train" --seq-len 1024 &&
          touch "$SUITE_DS/.ready"
      fi ;;
  esac
  text_dataset
  case $model in
    qwen3-0.6b) pre=250 det=0 refs="bf16-autocast bf16-mirror-fp32-norms" ;;  # session 5: 3.5e-4
    qwen3-1.7b) pre=160 det=1 refs="bf16-autocast" ;;  # session 8: 4.5e-4 on the deterministic pretrain
    # issue 23: a MoE model within 1e-3 over 100 steps; eager attention gives HF's own spread
    tiny-moe|*-a3b) pre=160 det=0 refs="bf16-autocast bf16-autocast-eager" ;;
    *) pre=160 det=0 refs="bf16-autocast" ;;
  esac
  local tol=$CURVES_TOL
  case $model in tiny-moe|*-a3b) tol=1e-3 ;; esac
  pre=${CURVES_PRE:-$pre} det=${CURVES_DET:-$det} refs=${CURVES_REFS:-$refs}
  local steps=${CURVES_STEPS:-200} deadline=${CURVES_DEADLINE:-$((SUITE_DEADLINE - 25))}
  local d=$work/curves-$model extra=""
  [ "$det" = 1 ] && extra=", deterministic: true"
  new_dir "$d"
  spec_stable_pretrain "$d" "$model" "$pre" "$extra"
  local src=$d/pre/checkpoint-$pre
  spec_finetune "$d" "path: $src" "$steps" "$extra"
  stage curves_pretrain 330 slidedp run "$d/pre.yaml" --backend cuda --run-dir "$d/run-pre"
  copy_metrics "$d/pre/metrics-*.jsonl" "$part_dir/pretrain.jsonl"
  rm -f "$src/optimizer.safetensors"
  stage curves_ours 300 slidedp run "$d/ft.yaml" --backend cuda --run-dir "$d/run-ft"
  copy_metrics "$d/ft/metrics-*.jsonl" "$part_dir/ours.jsonl"
  if [ "${CURVES_BF16_GRADS:-0}" = 1 ]; then  # issue 20: the same fine-tune with runtime.grad_dtype bf16
    dry || sed -e 's/^name: ft$/name: ftbf16/' -e "s|dir: $d/ft,|dir: $d/ftbf16,|" -e 's/^runtime: {workers: 1/runtime: {workers: 1, grad_dtype: bf16/' \
      "$d/ft.yaml" > "$d/ft-bf16.yaml"
    stage curves_ours_bf16 300 slidedp run "$d/ft-bf16.yaml" --backend cuda --run-dir "$d/run-ft-bf16"
    copy_metrics "$d/ftbf16/metrics-*.jsonl" "$part_dir/ours-bf16.jsonl"
  fi
  local st
  for st in ${CURVES_STATES:-}; do  # issue 21: the same fine-tune with optimizer.state_dtype $st
    dry || sed -e "s/^name: ft$/name: ft$st/" -e "s|dir: $d/ft,|dir: $d/ft$st,|" \
      -e "s/^optimizer: {\(.*\)}$/optimizer: {\1, state_dtype: $st}/" "$d/ft.yaml" > "$d/ft-$st.yaml"
    stage "curves_ours_$st" 300 slidedp run "$d/ft-$st.yaml" --backend cuda --run-dir "$d/run-ft-$st"
    copy_metrics "$d/ft$st/metrics-*.jsonl" "$part_dir/ours-$st.jsonl"
  done
  stage curves_batches 60 dump_batches --job "$d/ft.yaml" --out "$d/batches.bin"
  local ref prec attn cap left
  for ref in $refs; do
    prec=${ref%-eager} attn=sdpa
    [ "$prec" != "$ref" ] && attn=eager
    cap=${CURVES_HF_CAP:-220} left=$((deadline - SECONDS))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 30 ] && ! dry; then
      echo "--- HF $ref: not started, ${left} s left before CURVES_DEADLINE"
      continue
    fi
    stage "hf_$ref" "$cap" python3 tools/verify/hf_train_reference.py --batches "$d/batches.bin" --model "$src" \
      --precision "$prec" --attn "$attn" --out "$part_dir/hf-$ref.json"
  done
  local first=${refs%% *} size=${model#qwen3-}
  local what="Qwen3-${size^^} $steps steps, pretrain $pre"
  [ "$size" = "$model" ] && what="$model $steps steps, pretrain $pre"
  [ "$det" = 1 ] && what="$what (deterministic)"
  dry || python3 tools/verify/compare_curves.py "$part_dir/ours.jsonl" "$part_dir/hf-$first.json" --tol "$tol" \
    --json "$part_dir/cmp-ours-$first.json" > "$part_dir/cmp-ours-$first.log" 2>&1
  judge curve --json "$part_dir/cmp-ours-$first.json" --expect-steps "$steps" --what "ours vs HF $first, $what"
  if [ "${CURVES_BF16_GRADS:-0}" = 1 ]; then
    if ! dry; then
      python3 tools/verify/compare_curves.py "$part_dir/ours-bf16.jsonl" "$part_dir/hf-$first.json" --tol "$tol" \
        --json "$part_dir/cmp-ours-bf16-$first.json" > "$part_dir/cmp-ours-bf16-$first.log" 2>&1
    fi
    judge curve --info --json "$part_dir/cmp-ours-bf16-$first.json" --expect-steps "$steps" \
      --what "ours with runtime.grad_dtype bf16 vs HF $first (FP32 gradients), $what"
  fi
  for st in ${CURVES_STATES:-}; do  # compact moments against ours with FP32 moments (the same batches)
    dry && continue
    python3 tools/verify/compare_curves.py "$part_dir/ours-$st.jsonl" "$part_dir/ours.jsonl" --tol 1e-2 \
      --json "$part_dir/cmp-ours-$st.json" > "$part_dir/cmp-ours-$st.log" 2>&1
    judge curve --json "$part_dir/cmp-ours-$st.json" --expect-steps "$steps" \
      --what "ours with optimizer.state_dtype $st vs ours fp32, $what (issue 21: max |dloss| <= 1e-2)"
    python3 - "$part_dir/ours-$st.jsonl" "$part_dir/ours.jsonl" "$st" << 'PY' | tee -a "$summary"
import json, sys
def final(p):
    rows = [json.loads(l) for l in open(p) if l.strip()]
    rows = [r for r in rows if "loss" in r]
    return max(rows, key=lambda r: r["step"])["loss"] if rows else float("nan")
a, b = final(sys.argv[1]), final(sys.argv[2])
rel = abs(a - b) / abs(b) if b == b and b != 0 else float("nan")
verdict = "PASS" if rel <= 0.005 else "FAIL"
print(f"{verdict} curves      final loss with {sys.argv[3]} moments {a:.5f} vs fp32 {b:.5f}: {100 * rel:.3f}% (<= 0.5%)")
PY
  done
  for ref in $refs; do
    [ "$ref" = "$first" ] && continue
    if ! dry; then
      python3 tools/verify/compare_curves.py "$part_dir/ours.jsonl" "$part_dir/hf-$ref.json" --tol "$tol" \
        --json "$part_dir/cmp-ours-$ref.json" > "$part_dir/cmp-ours-$ref.log" 2>&1
      python3 tools/verify/compare_curves.py "$part_dir/hf-$ref.json" "$part_dir/hf-$first.json" --tol "$tol" \
        --json "$part_dir/cmp-$ref-$first.json" > "$part_dir/cmp-$ref-$first.log" 2>&1
    fi
    judge curve --info --json "$part_dir/cmp-ours-$ref.json" --expect-steps "$steps" --what "ours vs HF $ref"
    judge curve --info --json "$part_dir/cmp-$ref-$first.json" --expect-steps "$steps" \
      --what "HF $ref vs HF $first (the reference's own spread)"
  done
  dry || rm -rf "$d/pre" "$d/batches.bin"
}

part_determinism() {
  find_cudnn
  text_dataset
  local model=${DET_MODEL:-qwen3-0.6b} steps=${DET_STEPS:-3} d=$work/determinism run
  new_dir "$d"
  for run in a b; do
    spec_short_job "$d/$run.yaml" "$model" "$steps" "$d/out-$run" ", deterministic: true"
    stage "det_$run" 240 env SLIDEDP_LOG_UNIT_NORMS=1 slidedp run "$d/$run.yaml" --backend cuda --run-dir "$d/run-$run"
    copy_metrics "$d/out-$run/metrics-*.jsonl" "$part_dir/det-$run.jsonl"
    dry || unit_lines "$d/run-$run" > "$part_dir/det-$run-units.txt"
  done
  dry || python3 tools/verify/compare_curves.py "$part_dir/det-a.jsonl" "$part_dir/det-b.jsonl" --tol 0 --bitwise \
    --first-units "$part_dir/det-a-units.txt" --second-units "$part_dir/det-b-units.txt" \
    --json "$part_dir/cmp-det.json" > "$part_dir/cmp-det.log" 2>&1
  judge bitwise --json "$part_dir/cmp-det.json" --expect-steps "$steps" --units-a "$part_dir/det-a-units.txt" \
    --units-b "$part_dir/det-b-units.txt" --what "$model, runtime.deterministic, run twice"
  # the same job without the switch once: its step times beside the deterministic ones (figures)
  spec_short_job "$d/c.yaml" "$model" "$steps" "$d/out-c" ""
  stage det_default 240 slidedp run "$d/c.yaml" --backend cuda --run-dir "$d/run-c"
  copy_metrics "$d/out-c/metrics-*.jsonl" "$part_dir/default.jsonl"
  dry || result INFO determinism "$model step s, deterministic / default: $(python3 -c '
import json, sys
t = lambda p: [round(json.loads(l)["step_time_s"], 3) for l in open(p) if l.strip()]
print(t(sys.argv[1]), "/", t(sys.argv[2]))' "$part_dir/det-a.jsonl" "$part_dir/default.jsonl" 2>&1 | tail -n 1)"
}

part_offload() {
  find_cudnn
  local model=${OFFLOAD_MODEL:-qwen3-4b} r logs=()
  for r in 0 0.5 1; do
    stage "offload_$r" 150 bench_step --model "$model" --seq 4096 --tokens 65536 --micro-batch-rows 4 --steps 3 \
      --offload-ratio "$r" --gpu 0
    logs+=("$part_dir/offload_$r.log")
  done
  judge offload --logs "${logs[@]}"
}

part_routes() {
  find_cudnn
  local steps=${ROUTES_STEPS:-20} d=$work/routes name g extra
  new_dir "$d"
  stage routes_data 60 python3 bench/e2e/make_dataset.py --out "$d/data" --rows $((8 * steps)) --seq-len 1024 --vocab 151936
  # NAME GPUS RUNTIME_EXTRA; the first is the reference
  local runs=("g1-host 1 , grad_staging: host" "g1-device 1 , grad_staging: device")
  if [ "$gpus" -ge 2 ]; then
    runs+=("g2-gpu 2 , grad_reduction: gpu" "g2-gpu-host 2 , grad_reduction: gpu, grad_staging: host"
           "g2-sharded 2 , grad_reduction: gpu, param_delivery: sharded" "g2-cpu 2 , grad_reduction: cpu")
  else
    result SKIP routes "the 2-GPU routes (gpu, gpu + host staging, sharded delivery, cpu): $gpus GPU visible"
  fi
  local spec
  for spec in "${runs[@]}"; do
    read -r name g extra <<< "$spec"
    mkdir -p "$d/$name"
    spec_eq "$d/$name" "$d/data" "$g" "$steps" "$extra"
    stage "routes_$name" 150 env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((g - 1)))" \
      slidedp run "$d/$name/job.yaml" --backend cuda --run-dir "$d/$name/run"
    copy_metrics "$d/$name/out/metrics-*.jsonl" "$part_dir/$name.jsonl"
    rm -f "$d/$name"/out/checkpoint-*/optimizer.safetensors  # disk; compare_params reads the weights
  done
  local ref=g1-host
  for spec in "${runs[@]:1}"; do
    read -r name _ <<< "$spec"
    if ! dry; then
      python3 tools/verify/compare_curves.py "$part_dir/$ref.jsonl" "$part_dir/$name.jsonl" --tol "$ROUTES_LOSS_TOL" \
        --json "$part_dir/cmp-$name.json" > "$part_dir/cmp-$name.log" 2>&1
      python3 tools/verify/compare_params.py "$d/$name/out/checkpoint-$steps" "$d/$ref/out/checkpoint-$steps" \
        --tol-rel "$ROUTES_WEIGHT_TOL" --json "$part_dir/params-$name.json" > "$part_dir/params-$name.log" 2>&1
    fi
    judge curve --json "$part_dir/cmp-$name.json" --expect-steps "$steps" --what "$name vs $ref, loss, $steps steps"
    judge params --json "$part_dir/params-$name.json" --tol "$ROUTES_WEIGHT_TOL" --what "$name vs $ref, FP32 weights"
  done
  dry || rm -rf "$d"
}

# Issue 26: which gradient route and parameter delivery win where, and what `runtime ... auto`
# picks. On a node service (hostd + one worker per GPU), for each model of ROUTESPEED_MODELS and
# tokens per GPU of ROUTESPEED_TOKENS, `slidedp plan --measure` of a spec whose routes are auto:
# hostd measures every route the workers can run (gpu / cpu reduction x replicated / sharded
# delivery), each by its own AutoPolicy job, then plans the job; routes_check.py reads the
# measuring jobs' metrics and the plan's route.
part_routespeed() {
  local g=${ROUTESPEED_GPUS:-2}
  if [ "$gpus" -lt "$g" ] || [ "$g" -lt 2 ]; then
    result SKIP routespeed "needs $g GPUs (nvidia-h200-x2), $gpus visible"
    return
  fi
  find_cudnn
  local d=$work/routespeed model t rows micro name cases=() pids=() i
  new_dir "$d"
  # 16 steps is the measuring job's most (it ends after ~6); the largest batch sizes the dataset
  local most=0
  for t in ${ROUTESPEED_TOKENS:-16384 65536}; do [ "$t" -gt "$most" ] && most=$t; done
  stage routespeed_data 120 python3 bench/e2e/make_dataset.py --out "$d/data" --rows $((g * most / 4096 * 16)) \
    --seq-len 4096 --vocab 151936
  for model in ${ROUTESPEED_MODELS:-qwen3-4b qwen3-8b}; do
    for t in ${ROUTESPEED_TOKENS:-16384 65536}; do
      name=$model-$t rows=$((g * t / 4096)) micro=4
      [ $((t / 4096)) -lt 4 ] && micro=$((t / 4096))
      cat > "$d/$name.yaml" << YAML
name: rs-$name
model: {preset: $model, init_seed: 0}
data: {path: $d/data}
output: {dir: $d/out-$name, save_final: false}
train: {seq_len: 4096, global_batch: $rows, micro_batch: $micro, steps: 16, max_grad_norm: ${ROUTESPEED_MAX_GRAD_NORM:-1.0}}
optimizer: {lr: 1.0e-5, weight_decay: 0.01}
runtime: {workers: $g, grad_reduction: auto, param_delivery: auto${ROUTESPEED_RUNTIME_EXTRA:+, $ROUTESPEED_RUNTIME_EXTRA}}
YAML
      cases+=("$name")
    done
  done
  if dry; then
    echo "DRY  routespeed: slidedp-hostd + slidedp-worker --gpu 0..$((g - 1)); per case: slidedp plan --measure"
    echo "DRY  routespeed: CASE.yaml --json CASE.plan.json; routes_check.py --cases ${cases[*]}"
    return
  fi
  local sock=unix:$d/hostd.sock hostd_pid
  slidedp-hostd --listen "$sock" --state-dir "$d/state" --output-root "$d" > "$part_dir/hostd.log" 2>&1 &
  hostd_pid=$!
  sleep 2
  for ((i = 0; i < g; i++)); do
    slidedp-worker --hostd "$sock" --gpu "$i" > "$part_dir/worker$i.log" 2>&1 &
    pids+=($!)
  done
  export SLIDEDP_HOSTD=$sock
  for _ in $(seq 1 90); do [ "$(slidedp workers 2> /dev/null | grep -c gpu)" -ge "$g" ] && break; sleep 1; done
  for name in "${cases[@]}"; do
    stage "routespeed_$name" $((SUITE_DEADLINE - SECONDS)) slidedp plan --measure "$d/$name.yaml" \
      --json "$part_dir/$name.plan.json"
    mkdir -p "$part_dir/$name"
    cp "$d/out-$name"/metrics-*.jsonl "$part_dir/$name/" 2> /dev/null
  done
  kill "${pids[@]}" "$hostd_pid" 2> /dev/null
  wait "${pids[@]}" "$hostd_pid" 2> /dev/null
  unset SLIDEDP_HOSTD
  python3 tools/gpu/routes_check.py --dir "$part_dir" --cases "${cases[@]}" --json "$part_dir/routes.json" \
    --part "$part" | tee -a "$summary"
  rm -rf "$d"
}

part_bench() {
  find_cudnn
  local model=${BENCH_MODEL:-qwen3-4b} tokens=${BENCH_TOKENS:-65536} peer=${BENCH_PEER_TOKENS:-16384}
  local policy=${BENCH_POLICY:-auto} offload=0 w=$work/bench what
  [ "$model" = qwen3-4b ] && offload=1
  offload=${BENCH_OFFLOAD:-$offload}
  # ours and compute-only at the bench's batch, then the peers (and ours at the peers' batch, for
  # the same-batch CPU-offload ratio) in the same WORK, so that report.py sees one run
  local ours_env=(ACT_POLICY="$policy" RUNTIME_EXTRA="${BENCH_RUNTIME_EXTRA:-}" MAX_GRAD_NORM="${BENCH_MAX_GRAD_NORM:-1.0}")
  stage bench_ours $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir" MODEL="$model" GPUS=1 TOKENS_LIST="$tokens" \
    WHAT="ours compute" "${ours_env[@]}" WORK="$w" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) \
    bash bench/e2e/run_bench.sh
  what=fsdp2
  [ "$offload" = 1 ] && what="ours fsdp2 fsdp2-offload"
  stage bench_peers $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir" MODEL="$model" GPUS=1 TOKENS_LIST="$peer" \
    WHAT="$what" "${ours_env[@]}" WORK="$w" RESUME=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) \
    bash bench/e2e/run_bench.sh
  local flags=()
  [ "$offload" = 1 ] && flags=(--offload)
  judge bench --results "$part_dir/bench-results.json" --model "$model" --tokens "$tokens" --peer-tokens "$peer" \
    "${flags[@]}"
}

# Issue 20: clipping that keeps the host hidden. Each variant of ours in its own WORK (report.py
# keys results by model, tokens and kind), the peers in one more; clip_check.py judges them.
part_clip() {
  find_cudnn
  local model=${CLIP_MODEL:-qwen3-4b} tokens=${CLIP_TOKENS:-16384} w=$work/clip v norm extra
  local variants=${CLIP_VARIANTS:-"spec:1.0: high:1e4: wait:1.0:speculation_bytes=0 noclip:0:"}
  for v in $variants; do
    IFS=: read -r name norm extra <<< "$v"
    local state=fp32
    # (state_dtype=... is the optimizer's key, not a runtime one)
    if [[ $extra == state_dtype=* ]]; then state=${extra#state_dtype=}; extra=""; fi
    stage "clip_$name" $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/$name" MODEL="$model" GPUS=1 \
      TOKENS_LIST="$tokens" WHAT=ours MAX_GRAD_NORM="$norm" RUNTIME_EXTRA="${extra/=/: }" STATE_DTYPE="$state" \
      ACT_POLICY="${CLIP_POLICY:-auto}" WORK="$w/$name" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) \
      bash bench/e2e/run_bench.sh
  done
  stage clip_peers $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/peers" MODEL="$model" GPUS=1 \
    TOKENS_LIST="$tokens" WHAT="${CLIP_PEERS:-compute fsdp2}" ACT_POLICY="${CLIP_POLICY:-auto}" WORK="$w/peers" \
    FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) \
    bash bench/e2e/run_bench.sh
  dry && return 0
  python3 tools/gpu/clip_check.py --dir "$part_dir" --model "$model" --tokens "$tokens" | tee -a "$summary"
}

part_specbits() {
  find_cudnn
  local w=$work/specbits norm v
  for norm in 1e4 1e-3; do
    for v in auto:-1 wait:0; do
      stage "specbits_${norm}_${v%%:*}" $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/${norm}_${v%%:*}" \
        MODEL=qwen3-0.6b GPUS=1 TOKENS_LIST=16384 STEPS=6 WHAT=ours MAX_GRAD_NORM="$norm" ACT_POLICY=recompute \
        RUNTIME_EXTRA="deterministic: true, speculation_bytes: ${v#*:}" WORK="$w/${norm}_${v%%:*}" FRESH=1 \
        BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
    done
  done
  dry && return 0
  for norm in 1e4 1e-3; do
    python3 - "$w/${norm}_auto" "$w/${norm}_wait" "$norm" << 'PY' | tee -a "$summary"
import glob, json, sys
sys.path.insert(0, "tools/gpu")
from bench_results import ours_metrics as run  # noqa: E402
a, b = run(sys.argv[1]), run(sys.argv[2])
la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
spec = sum(1 for r in a if r.get("speculated_fraction", 0) > 0)
redo = sum(1 for r in a if r.get("speculation_rolled_back"))
ok = len(la) == 6 and la == lb and spec > 0
print(f"{'PASS' if ok else 'FAIL'} specbits    0.6B max_grad_norm {sys.argv[3]}: {len(la)} / {len(lb)} steps, losses "
      f"{'bitwise equal' if la == lb else 'differ: ' + str(la) + ' vs ' + str(lb)} (speculation auto vs off; "
      f"{spec} step(s) speculated, {redo} redone)")
PY
  done
}

# Issue 21: mirror-free delivery. The CUDA workers cast the master themselves, on the GPU
# (cast_on device) or on the host (cast_on host): the same bits as the mirror (deterministic losses
# bitwise equal), and what the casts cost at a fine-tuning batch (MASTERSRC_VARIANTS).
mastersrc_keys() {  # mastersrc_keys VARIANT: its runtime keys
  case $1 in
    mirror) echo "param_source: mirror" ;;
    master_device) echo "param_source: master, cast_on: device" ;;
    master_host) echo "param_source: master, cast_on: host" ;;
    *) return 1 ;;
  esac
}

part_mastersrc() {
  find_cudnn
  local w=$work/mastersrc v extra
  local variants=${MASTERSRC_VARIANTS:-"mirror master_device master_host"}
  for v in $variants; do
    if ! extra=$(mastersrc_keys "$v"); then
      result FAIL mastersrc "unknown variant $v (mirror master_device master_host)"
      return
    fi
    stage "mastersrc_bits_$v" $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/bits_$v" MODEL=qwen3-0.6b GPUS=1 \
      TOKENS_LIST=16384 STEPS=6 WHAT=ours MAX_GRAD_NORM=1.0 ACT_POLICY=recompute \
      RUNTIME_EXTRA="deterministic: true, $extra" WORK="$w/bits_$v" FRESH=1 \
      BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  done
  for v in $variants; do
    extra=$(mastersrc_keys "$v")
    stage "mastersrc_speed_$v" $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/speed_$v" \
      MODEL="${MASTERSRC_MODEL:-qwen3-4b}" GPUS=1 TOKENS_LIST="${MASTERSRC_TOKENS:-16384}" WHAT=ours MAX_GRAD_NORM=0 \
      ACT_POLICY=auto RUNTIME_EXTRA="$extra" WORK="$w/speed_$v" FRESH=1 \
      BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  done
  dry && return 0
  python3 - "$w" $variants << 'PY' | tee -a "$summary"
import glob, json, sys
sys.path.insert(0, "tools/gpu")
from bench_results import ours_metrics as run  # noqa: E402
w, variants = sys.argv[1], sys.argv[2:]
base = run(f"{w}/bits_mirror")
lb = [r["loss"] for r in base]
for v in variants:
    if v == "mirror":
        continue
    b = run(f"{w}/bits_{v}")
    la = [r["loss"] for r in b]
    ok = len(lb) == 6 and la == lb and all(r.get("param_source") == "master" for r in b)
    print(f"{'PASS' if ok else 'FAIL'} mastersrc   0.6B {v}: {len(lb)} / {len(la)} steps, losses "
          f"{'bitwise equal' if la == lb else 'differ: ' + str(lb) + ' vs ' + str(la)} (param_source mirror vs {v})")
def speed(d):
    rows = [r for r in run(d) if r["step"] > 2]
    if not rows:
        return None
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return (med([r["tokens_per_s"] for r in rows]), med([r.get("busy_s", {}).get("worker_cast", 0) for r in rows]),
            med([r.get("busy_s", {}).get("worker_h2d", 0) for r in rows]), rows[-1].get("host_state_bytes", 0))
m = speed(f"{w}/speed_mirror")
for v in variants:
    s = speed(f"{w}/speed_{v}")
    if s is None:
        print(f"FAIL mastersrc  speed {v}: no metrics")
        continue
    rel = f" ({s[0] / m[0]:.3f} of the mirror's)" if m and v != "mirror" else ""
    print(f"INFO mastersrc  speed {v}: {s[0]:.0f} tok/s{rel}; worker cast {s[1]:.3f} s/step, h2d {s[2]:.3f} s/step; "
          f"host state {s[3] / 2**30:.2f} GiB")
PY
}

# Issue 21's capacity target: BIG_MODEL (qwen3-14b) on one GPU with int8 Adam moments and no BF16
# mirror (about 6 B/param of host state), BIG_TOKENS (65536) per step, with and without clipping,
# against compute-only in the same call: ours / compute-only >= 0.95 (report.py), host state and the
# sampled MemAvailable drop per billion parameters <= 6 GiB (figures: bench-summary.md).
part_big() {
  find_cudnn
  local model=${BIG_MODEL:-qwen3-14b} tokens=${BIG_TOKENS:-65536} w=$work/big v norm
  local variants=${BIG_VARIANTS:-"noclip:0 clip:1.0"} big_gpus=${BIG_GPUS:-1} state=${BIG_STATE_DTYPE:-int8}
  if [ "$gpus" -lt "$big_gpus" ]; then
    result SKIP big "BIG_GPUS=$big_gpus needs $big_gpus GPUs, $gpus visible"
    return
  fi
  for v in $variants; do
    norm=${v#*:}
    stage "big_${v%%:*}" $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/${v%%:*}" MODEL="$model" GPUS="$big_gpus" \
      TOKENS_LIST="$tokens" WHAT=ours MAX_GRAD_NORM="$norm" STATE_DTYPE="$state" ACT_POLICY="${BIG_POLICY:-recompute}" \
      RUNTIME_EXTRA="param_source: master${BIG_RUNTIME_EXTRA:+, $BIG_RUNTIME_EXTRA}" STEPS="${BIG_STEPS:-4}" \
      WORK="$w/${v%%:*}" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  done
  stage big_compute $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/compute" MODEL="$model" GPUS=1 \
    TOKENS_LIST="$tokens" WHAT=compute ACT_POLICY="${BIG_POLICY:-recompute}" STEPS="${BIG_STEPS:-4}" \
    WORK="$w/compute" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  dry && return 0
  python3 - "$w" "$model" "$tokens" "$big_gpus" "$state" << 'PY' | tee -a "$summary"
import glob, json, sys
sys.path.insert(0, "bench/e2e")
from report import preset_params
w, model, tokens, gpus, state_dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
params = preset_params(model)
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
sys.path.insert(0, "tools/gpu")
from bench_results import ours_metrics as ours  # noqa: E402
def hostmem(d):  # bytes: the drop of MemAvailable while the stage ran (run_bench's sampler, KiB)
    for p in glob.glob(f"{d}/runs/*/*/*/*/ours/hostmem"):
        f = open(p).read().split()
        if len(f) == 2:
            return max(0, int(f[0]) - int(f[1])) * 1024
    return None
comp = None
for p in glob.glob(f"{w}/compute/runs/*/*/*/compute/stage.log"):
    for l in open(p):
        if l.startswith("{") and "compute_only" in l:
            comp = json.loads(l)
cps = comp["tokens_per_s"] if comp else None
for name in ("noclip", "clip"):
    rows = ours(f"{w}/{name}")
    steady = [r for r in rows if r["step"] >= 2]
    if not steady:
        print(f"FAIL big        {model} {name}: no steps (see details)")
        continue
    tps = med([r["tokens_per_s"] for r in steady]) / gpus  # per GPU, against one GPU's compute-only
    state = rows[-1].get("host_state_bytes", 0)
    drop = hostmem(f"{w}/{name}")
    gib_b = lambda b: (b / 2**30) / (params / 1e9) if params and b else float("nan")
    ratio = tps / cps if cps else float("nan")
    verdict = "PASS" if cps and ratio >= 0.95 else "FAIL"
    where = f", {gpus} GPUs" if gpus > 1 else ""
    print(f"{verdict} big         {model} {tokens // 1024}K{' per GPU' if gpus > 1 else ''} {state_dtype} + master{where}, "
          f"{name}: {tps:.0f} tok/s{' per GPU' if gpus > 1 else ''} = {ratio:.3f} of "
          f"compute-only {cps or float('nan'):.0f} (target 0.95); host state {state / 2**30:.2f} GiB "
          f"({gib_b(state):.2f} GiB/B), MemAvailable drop {(drop or 0) / 2**30:.2f} GiB ({gib_b(drop):.2f} GiB/B; target 6)")
PY
}

# Issue 22: runtime.gpu_memory_limit. Qwen3-4B (MEMLIMIT_MODEL), 64K tokens (MEMLIMIT_TOKENS),
# act_policy auto, without a limit and with MEMLIMIT (40GiB): the limited run's peak stays under
# the limit, and its speed as a fraction of the unlimited one's (target >= 0.9, or the figure).
part_memlimit() {
  find_cudnn
  local model=${MEMLIMIT_MODEL:-qwen3-4b} tokens=${MEMLIMIT_TOKENS:-65536} limit=${MEMLIMIT:-40GiB} w=$work/memlimit v
  for v in free limited; do
    local extra=${MEMLIMIT_RUNTIME_EXTRA:-}
    [ "$v" = limited ] && extra="${extra:+$extra, }gpu_memory_limit: $limit"
    stage "memlimit_$v" $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/$v" MODEL="$model" GPUS=1 \
      TOKENS_LIST="$tokens" WHAT=ours MAX_GRAD_NORM=0 ACT_POLICY="${MEMLIMIT_ACT_POLICY:-auto}" RUNTIME_EXTRA="$extra" \
      STEPS="${MEMLIMIT_STEPS:-4}" WORK="$w/$v" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  done
  dry && return 0
  for v in free limited; do  # the runs' hostd and worker logs, for the details
    mkdir -p "$part_dir/logs/$v" && cp "$w"/$v/runs/*/*/*/*/ours/run/*.log "$part_dir/logs/$v/" 2> /dev/null
  done
  python3 - "$w" "$model" "$tokens" "$limit" "${MEMLIMIT_STEADY_FROM:-2}" << 'PY' | tee -a "$summary"
import glob, json, re, sys
w, model, tokens, limit, steady_from = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
m = re.fullmatch(r"([0-9.]+)\s*([a-zA-Z]*)", limit)
units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
limit_bytes = float(m.group(1)) * units[m.group(2).lower()] if m else None
sys.path.insert(0, "tools/gpu")
from bench_results import ours_metrics as run  # noqa: E402
res = {}
for v in ("free", "limited"):
    rows = run(f"{w}/{v}")
    steady = [r for r in rows if r["step"] >= steady_from]
    if not steady:
        print(f"FAIL memlimit    {model} {tokens // 1024}K {v}: no steps (see details)")
        continue
    res[v] = (sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2], max(r.get("gpu_peak_bytes", 0) for r in rows))
for v, (tps, peak) in res.items():
    print(f"INFO memlimit    {model} {tokens // 1024}K {v}: {tps:.0f} tok/s, GPU peak {peak / 2**30:.2f} GiB")
if "limited" in res and limit_bytes:
    peak = res["limited"][1]
    print(f"{'PASS' if 0 < peak <= limit_bytes else 'FAIL'} memlimit    peak {peak / 2**30:.2f} GiB under "
          f"runtime.gpu_memory_limit {limit} ({limit_bytes / 2**30:.2f} GiB)")
if len(res) == 2:
    x = res["limited"][0] / res["free"][0]
    print(f"{'PASS' if x >= 0.9 else 'FAIL'} memlimit    limited / unlimited speed {x:.3f} (>= 0.9)")
PY
}

# Issue 22: a per-layer layout (runtime.policy file) on CUDA: Qwen3-0.6B, runtime.deterministic,
# 6 steps at 16K tokens, whole-layer recompute against a mixed layout (every kind, some layers'
# checkpoints offloaded to pinned host memory): losses bitwise equal (or within 1e-4: the kernel
# tolerance), and the layout's GPU peak (figure).
part_policy() {
  find_cudnn
  local w=$work/policy v extra
  mkdir -p "$w"
  python3 - "$w/mixed.yaml" << 'PY'
import sys
# Each kind in turn; the first 9 layers offload all, half or a quarter of their checkpoints (inputs and
# kept pieces), the rest none.
kinds = ["recompute", "selective", "keep_all"]
shares = ["true", "0.5", "0.25"]
layers = [f"  - {{kind: {kinds[i % 3]}{', offload: ' + shares[i // 3] if i < 9 else ''}}}" for i in range(28)]
open(sys.argv[1], "w").write(
    "version: 1\nmodel: {hidden_size: 1024, num_hidden_layers: 28, num_attention_heads: 16, num_key_value_heads: 8, "
    "head_dim: 128, intermediate_size: 3072, vocab_size: 151936}\nlayers:\n" + "\n".join(layers) + "\n")
PY
  for v in recompute mixed; do
    extra="deterministic: true"
    [ "$v" = mixed ] && extra="deterministic: true, policy: $w/mixed.yaml"
    stage "policy_$v" $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/$v" MODEL=qwen3-0.6b GPUS=1 \
      TOKENS_LIST=16384 STEPS=6 WHAT=ours MAX_GRAD_NORM=1.0 ACT_POLICY=recompute RUNTIME_EXTRA="$extra" \
      WORK="$w/$v" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  done
  dry && return 0
  python3 - "$w" << 'PY' | tee -a "$summary"
import glob, json, sys
sys.path.insert(0, "tools/gpu")
from bench_results import ours_metrics as run  # noqa: E402
a, b = run(f"{sys.argv[1]}/recompute"), run(f"{sys.argv[1]}/mixed")
la, lb = [r["loss"] for r in a], [r["loss"] for r in b]
d = max((abs(x - y) for x, y in zip(la, lb)), default=float("inf"))
ok = len(la) == 6 and len(lb) == 6 and d <= 1e-4
peak = lambda rows: max((r.get("gpu_peak_bytes", 0) for r in rows), default=0) / 2**30
print(f"{'PASS' if ok else 'FAIL'} policy      0.6B mixed per-layer layout vs recompute: {len(la)} / {len(lb)} steps, "
      f"{'bitwise equal' if la == lb else f'max |dloss| {d:.2e}'} (<= 1e-4); GPU peak {peak(a):.2f} / {peak(b):.2f} GiB")
PY
}

# Issue 22: AutoPolicy. Each variant of ours in its own WORK (report.py keys results by model,
# tokens and kind); auto and cached share one policy cache (XDG_CACHE_HOME: slidedp run's default).
part_autopolicy() {
  find_cudnn
  local model=${AP_MODEL:-qwen3-8b} tokens=${AP_TOKENS:-65536} peer=${AP_PEER_TOKENS:-16384} w=$work/autopolicy v
  local variants=${AP_VARIANTS:-"auto cached today peer"}
  new_dir "$w"
  for v in auto cached today; do
    case " $variants " in *" $v "*) ;; *) continue ;; esac
    local act=recompute extra="policy: auto" steps=${AP_STEPS:-$([ "${AP_SWEEP:-1}" = 1 ] && echo 20 || echo 8)} sweep=0
    [ "$v" = auto ] && sweep=${AP_SWEEP:-1}
    [ "$v" = today ] && act=auto extra="" steps=4
    [ "$v" = cached ] && steps=4
    [ -n "${AP_RUNTIME_EXTRA:-}" ] && extra="${extra:+$extra, }$AP_RUNTIME_EXTRA"
    stage "autopolicy_$v" $((SUITE_DEADLINE - SECONDS)) env SLIDEDP_AUTOPOLICY_SWEEP=$sweep OUT="$part_dir/$v" MODEL="$model" GPUS=1 \
      TOKENS_LIST="$tokens" WHAT=ours ACT_POLICY="$act" RUNTIME_EXTRA="$extra" STEPS="$steps" \
      MAX_GRAD_NORM="${AP_MAX_GRAD_NORM:-1.0}" STATE_DTYPE="${AP_STATE_DTYPE:-fp32}" \
      XDG_CACHE_HOME="$w" WORK="$w/$v" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  done
  mkdir -p "$part_dir/cache" && cp "$w"/slidedp/policies/*.yaml "$part_dir/cache/" 2> /dev/null
  case " $variants " in *" peer "*) stage autopolicy_peer $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/peer" MODEL="$model" GPUS=1 \
    TOKENS_LIST="$peer" WHAT=fsdp2 WORK="$w/peer" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) \
    bash bench/e2e/run_bench.sh ;; esac
  dry && return 0
  mkdir -p "$w/cache" && cp "$w"/slidedp/policies/*.yaml "$w/cache/" 2> /dev/null
  for v in auto cached today; do  # the runs' hostd and worker logs, for the details
    mkdir -p "$part_dir/logs/$v" && cp "$w"/$v/runs/*/*/*/*/ours/run/*.log "$part_dir/logs/$v/" 2> /dev/null
  done
  python3 tools/gpu/autopolicy_check.py --dir "$part_dir" --work "$w" --model "$model" --tokens "$tokens" \
    --peer-tokens "$peer" | tee -a "$summary"
}

part_scaling() {
  if [ "$gpus" -lt 2 ]; then
    result SKIP scaling "needs 2 GPUs (nvidia-h200-x2), $gpus visible"
    return
  fi
  find_cudnn
  local model=${SCALING_MODEL:-qwen3-8b} w=$work/scaling strong=${SCALING_STRONG-"65536 16384"} g
  # Weak scaling at 64K per GPU; strong scaling at each global batch of SCALING_STRONG (1 GPU at G,
  # 2 GPUs at G / 2 each), every (GPUs, tokens per GPU) pair run once.
  local one="65536" two="65536"
  for g in $strong; do
    case " $one " in *" $g "*) ;; *) one="$one $g" ;; esac
    case " $two " in *" $((g / 2)) "*) ;; *) two="$two $((g / 2))" ;; esac
  done
  stage scaling_ours1 $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir" MODEL="$model" GPUS=1 TOKENS_LIST="$one" \
    WHAT=ours ACT_POLICY=auto WORK="$w" FRESH=1 BUDGET_S=$(((SUITE_DEADLINE - SECONDS - 160) * 2 / 5)) \
    bash bench/e2e/run_bench.sh
  stage scaling_ours2 $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir" MODEL="$model" GPUS=2 TOKENS_LIST="$two" \
    WHAT=ours ACT_POLICY=auto WORK="$w" RESUME=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 160)) bash bench/e2e/run_bench.sh
  stage scaling_fsdp2 $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir" MODEL="$model" GPUS=2 TOKENS_LIST=16384 \
    WHAT=fsdp2 WORK="$w" RESUME=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  judge scaling --results "$part_dir/bench-results.json" --model "$model" --tokens 65536 --peer-tokens 16384 \
    ${strong:+--strong "$(echo $strong | tr ' ' ',')"}
}

# Issue 21: compact Adam moments. The kernels' tests run here too because this host has the ISA
# the dev machine lacks (AVX-512); then LayerAdam's rate with each moment layout on the same params.
part_state() {
  local xml=$part_dir/xml rcs=() t st
  mkdir -p "$xml"
  for t in adam_state_test adam_engine_test adam_kernels_test; do
    stage "$t" 200 env GTEST_COLOR=no ".gpu/tests/$t" "--gtest_output=xml:$xml/$t.xml"
    rcs+=(--rc "$t=$?")
  done
  judge gtest --xml-dir "$xml" "${rcs[@]}" --none-why "no .gpu/tests/adam_state_test: rebuild the bundle"
  # With the mirror's stores (param_source mirror) and without them (master), STATE_MIRRORS.
  local mirrors=${STATE_MIRRORS:-"stream none"} ms
  for ms in $mirrors; do
    for st in fp32 bf16 int8; do
      stage "layeradam_${st}_$ms" 150 bench_layeradam --params "${STATE_PARAMS:-268435456}" --state "$st" \
        --mirror-store "$ms"
    done
  done
  dry && return 0
  python3 - "$part_dir" $mirrors << 'PY' | tee -a "$summary"
import json, sys
d = sys.argv[1]
for ms in sys.argv[2:]:
    rows = {}
    for st in ("fp32", "bf16", "int8"):
        try:
            last = [l for l in open(f"{d}/layeradam_{st}_{ms}.log") if l.startswith("{")][-1]
            rows[st] = json.loads(last)
        except (OSError, IndexError, ValueError):
            print(f"FAIL state       layeradam --state {st} --mirror-store {ms}: no result")
    for st, r in rows.items():
        print(f"INFO state       LayerAdam {st} moments, mirror {ms}: {r['adam_Gparam_per_s']:.3f} Gparam/s, "
              f"{r['layeradam_gbps']:.1f} GB/s at {r['layeradam_bytes_per_param']:.2f} B/param, triad "
              f"{r['triad_gbps']:.1f} GB/s (ratio {r['ratio_to_triad']:.2f}), isa {r['isa']}, {r['threads']} threads, "
              f"{r['hot_path_page_faults']} page faults")
    if "fp32" in rows:
        for st in ("bf16", "int8"):
            if st in rows:
                x = rows[st]["adam_Gparam_per_s"] / rows["fp32"]["adam_Gparam_per_s"]
                gate = st == "int8"
                verdict = ("PASS" if x >= 1.5 else "FAIL") if gate else "INFO"
                print(f"{verdict} state       LayerAdam {st} / fp32 moments, mirror {ms}: {x:.2f}x params/s"
                      + (" (>= 1.5)" if gate else ""))
PY
}

part_host() {
  find_cudnn
  stage layeradam 180 python3 bench/layeradam/torch_cpu_adamw.py --params 268435456 --threads "$(nproc)" \
    --bench "$(command -v bench_layeradam || echo bench_layeradam)"
  judge layeradam --log "$part_dir/layeradam.log" --t-torch "$LAYERADAM_T_TORCH" --t-copy "$LAYERADAM_T_COPY"
  stage bench_copy 120 bench_copy --seconds 2 --mib 256 --adam-params 268435456
  judge copy --log "$part_dir/bench_copy.log"
  # DMA before Adam with bursty copies (a step's parameter loads come in bursts): LayerAdam's rate
  # with copy priority on is then meaningful beside the copies' >= 0.9 of their solo GB/s.
  stage bench_copy_duty 120 bench_copy --seconds 2 --mib 64 --adam-params 268435456 --duty 20:20
  judge copy --log "$part_dir/bench_copy_duty.log"
  # A node service (hostd + one CUDA worker) and two Qwen3-4B jobs back to back: submit -> first
  # step cold, then warm (the pooled state segment re-laid out in place).
  local d=$work/warm id
  new_dir "$d"
  stage warm_data 60 python3 bench/e2e/make_dataset.py --out "$d/data" --rows 64 --seq-len 4096 --vocab 151936
  for id in cold warm; do
    cat > "$d/$id.yaml" <<YAML
name: $id
model: {preset: qwen3-4b, init_seed: 0}
data: {path: $d/data}
output: {dir: $d/out-$id, save_final: false}
train: {seq_len: 4096, global_batch: 4, micro_batch: 4, steps: 3, max_grad_norm: 1.0}
runtime: {workers: 1}
YAML
  done
  if dry; then
    echo "DRY  warm: slidedp-hostd --listen unix:$d/hostd.sock --state-dir $d/state --output-root $d &; slidedp-worker --hostd unix:$d/hostd.sock --gpu 0 &"
    echo "DRY  warm: slidedp submit $d/cold.yaml --id cold; slidedp status cold; the same for warm"
    return
  fi
  slidedp-hostd --listen "unix:$d/hostd.sock" --state-dir "$d/state" --output-root "$d" > "$part_dir/warm-hostd.log" 2>&1 &
  local hostd_pid=$!
  sleep 2
  CUDA_VISIBLE_DEVICES=0 slidedp-worker --hostd "unix:$d/hostd.sock" --gpu 0 > "$part_dir/warm-worker.log" 2>&1 &
  local worker_pid=$!
  export SLIDEDP_HOSTD=unix:$d/hostd.sock
  for _ in $(seq 1 60); do slidedp workers 2> /dev/null | grep -q gpu0 && break; sleep 1; done
  for id in cold warm; do
    stage "warm_submit_$id" 240 slidedp submit "$d/$id.yaml" --id "$id"
    timeout 20 slidedp status "$id" > "$part_dir/warm-status-$id.txt" 2>&1
  done
  kill "$worker_pid" "$hostd_pid" 2> /dev/null
  wait "$worker_pid" "$hostd_pid" 2> /dev/null
  unset SLIDEDP_HOSTD
  judge warm --cold "$part_dir/warm-status-cold.txt" --warm "$part_dir/warm-status-warm.txt" \
    --what "Qwen3-4B on a node service (44.4 / 16.2 s in session 3)"
  rm -rf "$d"
}

# A node service with one CUDA worker: an uninterrupted job, then the same job with hostd killed
# (SIGKILL) just after step RESTART_KILL_AT's metrics line and started again. The job must resume
# from the state segment the dead hostd left ("shared memory at step N"), and every step both
# logged must have bitwise the same loss (runtime.deterministic). Figure: restart -> next step.
part_plan() {
  find_cudnn
  local d=$work/plan model=${PLAN_MODEL:-qwen3-4b} steps=${PLAN_STEPS:-8} t pol name cases=() times=()
  new_dir "$d"
  stage plan_data 120 python3 bench/e2e/make_dataset.py --out "$d/data" --rows 256 --seq-len 4096 --vocab 151936
  for t in ${PLAN_TOKENS:-16384 65536}; do
    for pol in ${PLAN_POLICIES:-recompute selective auto}; do
      local runtime="act_policy: $pol" rows=$((t / 4096)) micro=4
      [ "$pol" = auto ] && runtime="policy: auto"
      [ "$rows" -lt 4 ] && micro=$rows
      cat > "$d/$t-$pol.yaml" <<YAML
name: plan-$t-$pol
model: {preset: $model, init_seed: 0}
data: {path: $d/data}
output: {dir: $d/out-$t-$pol, save_final: false}
train: {seq_len: 4096, global_batch: $rows, micro_batch: $micro, steps: $steps, max_grad_norm: 1.0}
optimizer: {lr: 1.0e-5, weight_decay: 0.01}
runtime: {workers: 1, $runtime${PLAN_RUNTIME_EXTRA:+, $PLAN_RUNTIME_EXTRA}}
YAML
    done
  done
  if dry; then
    echo "DRY  plan: slidedp-hostd --state-dir + slidedp-worker --gpu 0; per tokens: slidedp plan --measure, then per"
    echo "DRY  plan: policy slidedp plan JOB.yaml and slidedp submit JOB.yaml; plan_check.py"
    return
  fi
  local sock=unix:$d/hostd.sock hostd_pid worker_pid
  slidedp-hostd --listen "$sock" --state-dir "$d/state" --output-root "$d" > "$part_dir/hostd.log" 2>&1 &
  hostd_pid=$!
  sleep 2
  CUDA_VISIBLE_DEVICES=0 slidedp-worker --hostd "$sock" --gpu 0 > "$part_dir/worker.log" 2>&1 &
  worker_pid=$!
  export SLIDEDP_HOSTD=$sock
  for _ in $(seq 1 60); do slidedp workers 2> /dev/null | grep -q gpu0 && break; sleep 1; done
  for t in ${PLAN_TOKENS:-16384 65536}; do
    local first policies=${PLAN_POLICIES:-recompute selective auto}
    first=${policies%% *}
    local t0=$SECONDS
    stage "plan_measure_$t" 300 slidedp plan --measure "$d/$t-$first.yaml"
    times+=("$model-$t=$((SECONDS - t0))")
    for pol in ${PLAN_POLICIES:-recompute selective auto}; do
      name=$model-$t-$pol
      slidedp plan "$d/$t-$pol.yaml" > "$part_dir/$name.plan" 2>&1
      stage "plan_job_$t-$pol" 240 slidedp submit "$d/$t-$pol.yaml" --id "$t-$pol"
      copy_metrics "$d/out-$t-$pol/metrics-$t-$pol.jsonl" "$part_dir/$name.jsonl"
      slidedp plan "$d/$t-$pol.yaml" --compare "$part_dir/$name.jsonl" > "$part_dir/$name.compare" 2>&1
      cases+=("$name")
    done
  done
  cp "$d"/state/policies/*.yaml "$part_dir/" 2> /dev/null
  kill "$worker_pid" "$hostd_pid" 2> /dev/null
  wait "$worker_pid" "$hostd_pid" 2> /dev/null
  unset SLIDEDP_HOSTD
  python3 tools/gpu/plan_check.py --dir "$part_dir" --cases "${cases[@]}" --measure-times "${times[@]}" \
    --part "$part" | tee -a "$summary"
  rm -rf "$d"
}

part_restart() {
  find_cudnn
  local d=$work/restart id steps=${RESTART_STEPS:-8} kill_at=${RESTART_KILL_AT:-3} model=${RESTART_MODEL:-qwen3-4b}
  new_dir "$d"
  stage restart_data 60 python3 bench/e2e/make_dataset.py --out "$d/data" --rows 128 --seq-len 4096 --vocab 151936
  for id in ref crashed; do
    cat > "$d/$id.yaml" <<YAML
name: $id
model: {preset: $model, init_seed: 0$model_extra}
data: {path: $d/data}
output: {dir: $d/out-$id, save_final: false}
train: {seq_len: 4096, global_batch: 8, micro_batch: 4, steps: $steps, max_grad_norm: 1.0}
runtime: {workers: 1, deterministic: true}
YAML
  done
  if dry; then
    echo "DRY  restart: slidedp-hostd + slidedp-worker --gpu 0; slidedp submit ref.yaml; slidedp submit crashed.yaml --detach"
    echo "DRY  restart: kill -9 hostd after step $kill_at; slidedp-hostd again; slidedp status crashed; restart_check.py"
    return
  fi
  local sock=unix:$d/hostd.sock hostd_pid worker_pid
  start_hostd() {
    slidedp-hostd --listen "$sock" --state-dir "$d/state" --output-root "$d" >> "$part_dir/hostd-$1.log" 2>&1 &
    hostd_pid=$!
  }
  start_hostd first
  sleep 2
  CUDA_VISIBLE_DEVICES=0 slidedp-worker --hostd "$sock" --gpu 0 > "$part_dir/worker.log" 2>&1 &
  worker_pid=$!
  export SLIDEDP_HOSTD=$sock
  for _ in $(seq 1 60); do slidedp workers 2> /dev/null | grep -q gpu0 && break; sleep 1; done
  stage restart_ref 200 slidedp submit "$d/ref.yaml" --id ref
  copy_metrics "$d/out-ref/metrics-*.jsonl" "$part_dir/ref.jsonl"
  slidedp submit "$d/crashed.yaml" --id crashed --detach > "$part_dir/submit-crashed.txt" 2>&1
  local m=$d/out-crashed/metrics-crashed.jsonl deadline=$((SECONDS + 200)) t_kill t_next lines
  while [ $SECONDS -lt $deadline ] && [ "$(cat "$m" 2> /dev/null | wc -l)" -lt "$kill_at" ]; do sleep 0.02; done
  kill -9 "$hostd_pid"
  wait "$hostd_pid" 2> /dev/null
  t_kill=$(date +%s.%N)
  lines=$(wc -l < "$m")
  start_hostd second
  deadline=$((SECONDS + 150))
  while [ $SECONDS -lt $deadline ] && [ "$(wc -l < "$m")" -le "$lines" ]; do sleep 0.05; done
  t_next=$(date +%s.%N)
  for _ in $(seq 1 150); do
    slidedp status crashed > "$part_dir/status-crashed.txt" 2>&1
    grep -qiE " (succeeded|failed|cancelled) " "$part_dir/status-crashed.txt" && break
    sleep 1
  done
  copy_metrics "$m" "$part_dir/crashed.jsonl"
  kill "$worker_pid" "$hostd_pid" 2> /dev/null
  wait "$worker_pid" "$hostd_pid" 2> /dev/null
  unset SLIDEDP_HOSTD
  python3 tools/gpu/restart_check.py --ref "$part_dir/ref.jsonl" --resumed "$part_dir/crashed.jsonl" \
    --status "$part_dir/status-crashed.txt" --killed-after "$lines" --seconds-to-next-step \
    "$(python3 -c "print(round($t_next - $t_kill, 2))")" --steps "$steps" --what "$model" --part "$part" | tee -a "$summary"
  rm -rf "$d"
}

part_kbench() {
  find_cudnn
  local quick=()
  [ "${KBENCH_QUICK:-0}" = 1 ] && quick=(--quick)
  stage bench_kernels 300 bench_kernels "${quick[@]}"
  judge kbench --log "$part_dir/bench_kernels.log" --rc $? --t-fwd "$KBENCH_T_FWD" --t-bwd "$KBENCH_T_BWD" \
    --t-layer "$KBENCH_T_LAYER"
  stage torch_sdpa 200 python3 bench/kernels/torch_sdpa.py "${quick[@]}"
  judge sdpa --log "$part_dir/torch_sdpa.log"
}

# One sparse decoder layer of Qwen3-30B-A3B per MOEBENCH_TOKENS (bench_kernels --moe): forward +
# backward, recompute and keep-all, expert GEMMs planned per row-count bucket and per exact count,
# and the per-expert GEMM loop against one GEMM over every routed row. Figures, no gate.
part_moebench() {
  find_cudnn
  local t
  for t in ${MOEBENCH_TOKENS:-16384 32768}; do
    stage "moebench_$t" 200 bench_kernels --moe "$t" ${MOEBENCH_PRESET:-}
    dry || grep -E '^(moe_|bench_kernels|   \()' "$part_dir/moebench_$t.log" | tee -a "$summary"
  done
}

# Long context: one sequence of LONGCTX_SEQ tokens per optimizer step on one GPU. Ours is the daemon
# path (slidedp run): the model's RoPE stretched to the row (yarn from Qwen3's 32K pretraining
# context), int8 Adam moments and param_source master (host memory for the pinned checkpoints),
# whole-layer recompute with the first LONGCTX_OFFLOAD of the layers' FP32 inputs (4 GiB each at
# 256K on Qwen3-8B) in pinned host memory, the token-local work in tiles of LONGCTX_TILE tokens.
# Then the figures it is read against: bench_step (compute-only, resident weights) on the same row
# with LONGCTX_COMPUTE_LAYERS layers, and FSDP2 GPU-resident one row per step at the longest of
# LONGCTX_PEER_SEQS that runs. A stage's results replace its own folder under $w only, so a later
# call on the same warm machine can add the stages an earlier one had no time for.
longctx_sampler() {  # longctx_sampler FILE: MemAvailable at the start and its minimum so far (KiB)
  local base low now
  base=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
  low=$base
  while :; do
    now=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
    [ "$now" -lt "$low" ] && low=$now
    echo "$base $low" > "$1"
    sleep 1
  done
}

longctx_ours() {
  local d=$w/ours data=$work/longctx-data/v151936_s${seq}_r$steps rc sampler node
  new_dir "$d"
  date -u +%FT%TZ > "$d/started"
  [ -f "$data/manifest.json" ] || stage longctx_data 60 python3 bench/e2e/make_dataset.py --out "$data" \
    --rows "$steps" --seq-len "$seq" --vocab 151936
  cat > "$d/job.yaml" <<YAML
name: longctx
model: {preset: $model, init_seed: 0${LONGCTX_LAYERS:+, num_hidden_layers: $LONGCTX_LAYERS}, max_position_embeddings: $maxpos$rope_yaml}
data: {path: $data}
output: {dir: $d/out, save_final: false}
train: {seq_len: $seq, global_batch: 1, micro_batch: 1, steps: $steps, seed: 0, max_grad_norm: 0}
optimizer: {lr: 1.0e-5, weight_decay: 0.01, state_dtype: int8}
runtime: {workers: $cp,${cp_yaml} act_policy: ${LONGCTX_ACT_POLICY:-recompute}, offload_ratio: $offload, param_source: master, checkpoint_dtype: ${LONGCTX_CHECKPOINT_DTYPE:-fp32}${tile:+, tile_tokens: $tile}${LONGCTX_POLICY:+, policy: $PWD/$LONGCTX_POLICY}${LONGCTX_RUNTIME_EXTRA:+, $LONGCTX_RUNTIME_EXTRA}}
YAML
  dry && sed 's/^/DRY      /' "$d/job.yaml"
  dry || { longctx_sampler "$d/hostmem" & sampler=$!; }
  stage longctx_ours "${LONGCTX_OURS_CAP:-470}" env CUDA_VISIBLE_DEVICES="$(seq -s, 0 $((cp - 1)))" slidedp run "$d/job.yaml" --backend cuda \
    --run-dir "$d/run"
  rc=$?
  dry && return 0
  kill "$sampler" 2> /dev/null
  wait "$sampler" 2> /dev/null
  cp "$part_dir/longctx_ours.log" "$d/stage.log"
  copy_metrics "$d/out/metrics-*.jsonl" "$d/metrics.jsonl"
  if [ "$rc" != 0 ]; then
    # Cut by the time cap, hostd drains by writing a checkpoint (drain_mode) before the group's
    # SIGKILL, and a killed private node leaves its state in /dev/shm (tens of GB of host memory the
    # next stages need): both go.
    rm -rf "$d"/out/checkpoint-*
    node=$(grep -o ' node=run[0-9]*' "$d/run/hostd.log" 2> /dev/null | head -n 1 | cut -d= -f2)
    [ -n "$node" ] && rm -f /dev/shm/slidedp."$node".*
  fi
}

longctx_compute() {
  local d=$w/compute layers=${LONGCTX_COMPUTE_LAYERS:-4} extra=() coff
  new_dir "$d"
  date -u +%FT%TZ > "$d/started"
  # Fewer layers hold their checkpoints on the GPU (4 GiB each at 256K): no offload unless asked.
  coff=${LONGCTX_COMPUTE_OFFLOAD:-$([ "$layers" = 0 ] && echo "$offload" || echo 0)}
  [ -n "$rope_json" ] && extra+=(--rope-scaling "$rope_json")
  [ -n "$tile" ] && extra+=(--tile-tokens "$tile")
  extra+=(--checkpoint-dtype "${LONGCTX_CHECKPOINT_DTYPE:-fp32}")
  [ "$layers" != 0 ] && extra+=(--layers "$layers")
  stage longctx_compute "${LONGCTX_COMPUTE_CAP:-120}" bench_step --model "$model" --seq "$seq" --tokens "$seq" \
    --micro-batch-rows 1 --policy recompute --steps "${LONGCTX_COMPUTE_STEPS:-2}" --gpu 0 \
    --max-position-embeddings "$maxpos" --offload-ratio "$coff" "${extra[@]}"
  dry || cp "$part_dir/longctx_compute.log" "$d/stage.log"
}

longctx_peer() {
  local d=$w/peer s rc
  new_dir "$d"
  date -u +%FT%TZ > "$d/started"
  # expandable segments: the peer's best chance to fit a long row (less fragmentation). The peer
  # (verbatim ../shared/bench/peers/fsdp2_qwen3.py) reports the median after 3 warm-up steps: 4 steps
  # measure the 4th.
  for s in ${LONGCTX_PEER_SEQS:-65536 32768 16384}; do
    stage "longctx_peer_s$s" "${LONGCTX_PEER_CAP:-150}" env CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS="$(nproc)" \
      PYTORCH_CUDA_ALLOC_CONF="${LONGCTX_PEER_ALLOC_CONF:-expandable_segments:True}" \
      python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/e2e/fsdp2_qwen3.py --model "$model" \
      --seq "$s" --mbs 1 --steps "${LONGCTX_PEER_STEPS:-4}"
    rc=$?
    dry && continue
    cp "$part_dir/longctx_peer_s$s.log" "$d/s$s.log"
    [ "$rc" = 0 ] || [ "$rc" = 125 ] && break  # ran (the longest that fits), or no time left
  done
}
# Issue 23's targets on one GPU: a Qwen3-30B-A3B-shaped model at MOE_LAYERS of its 48 layers (as many
# as the host holds with int8 moments and no mirror), MOE_TOKENS per step, ours against our own
# compute-only mode (bench_step, the same reduced model): >= 0.9; and at MOE_PEER_LAYERS (a depth
# FSDP2 holds GPU-resident) ours against FSDP2 + HF Qwen3MoeForCausalLM (bench/e2e/fsdp2_qwen3_moe.py):
# >= 1.5. Model TFLOP/s count the active parameters (ModelLayout::ActiveParamCount).
part_moe() {
  find_cudnn
  local model=qwen3-30b-a3b tokens=${MOE_TOKENS:-262144} w=$work/moe
  local big=${MOE_LAYERS:-16} small=${MOE_PEER_LAYERS:-8} what=${MOE_WHAT:-"big peer"}
  if [[ " $what " == *" big "* ]]; then
    stage moe_big $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/big" MODEL="$model" LAYERS="$big" GPUS=1 \
      TOKENS_LIST="$tokens" WHAT="${MOE_BIG_WHAT:-ours compute}" MAX_GRAD_NORM="${MOE_MAX_GRAD_NORM:-1.0}" STATE_DTYPE=int8 \
      ACT_POLICY=recompute RUNTIME_EXTRA="param_source: ${MOE_PARAM_SOURCE:-master}${MOE_RUNTIME_EXTRA:+, $MOE_RUNTIME_EXTRA}" \
      STEPS="${MOE_STEPS:-4}" MICRO_ROWS="${MOE_MICRO_ROWS:-8}" WORK="$w/big" FRESH=1 \
      BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) bash bench/e2e/run_bench.sh
  fi
  if [[ " $what " == *" peer "* ]]; then
    stage moe_peer $((SUITE_DEADLINE - SECONDS)) env OUT="$part_dir/peer" MODEL="$model" LAYERS="$small" GPUS=1 \
      TOKENS_LIST="$tokens" WHAT="${MOE_PEER_WHAT:-ours fsdp2}" MAX_GRAD_NORM=0 STATE_DTYPE="${MOE_PEER_STATE_DTYPE:-fp32}" \
      FSDP_MICRO_ROWS="${MOE_FSDP_MICRO_ROWS:-4}" FSDP_STEPS="${MOE_FSDP_STEPS:-5}" \
      ACT_POLICY=recompute RUNTIME_EXTRA="${MOE_RUNTIME_EXTRA:-}" STEPS="${MOE_STEPS:-4}" \
      MICRO_ROWS="${MOE_MICRO_ROWS:-8}" WORK="$w/peer" FRESH=1 BUDGET_S=$((SUITE_DEADLINE - SECONDS - 20)) \
      bash bench/e2e/run_bench.sh
  fi
  dry && return 0
  for v in big peer; do  # the runs' hostd and worker logs, for the details
    mkdir -p "$part_dir/logs/$v" && cp "$w"/$v/runs/*/*/*/*/ours/run/*.log "$part_dir/logs/$v/" 2> /dev/null
  done
  python3 - "$w" "$tokens" "$big" "$small" "${MOE_PARAM_SOURCE:-master}" "$what" << 'PY' | tee -a "$summary"
import glob, json, sys
w, tokens, big, small, source, what = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6].split()
sys.path.insert(0, "tools/gpu")
from bench_results import ours_metrics  # noqa: E402
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
def last_json(pattern, key):
    found = None
    for p in glob.glob(pattern, recursive=True):
        for l in open(p, errors="replace"):
            if l.startswith("{") and key in l:
                try:
                    found = json.loads(l)
                except ValueError:
                    pass
    return found
def ours(d):
    rows = [r for r in ours_metrics(d) if r["step"] >= 2]
    if not rows:
        return None
    return {"tps": med([r["tokens_per_s"] for r in rows]), "tflops": med([r["model_tflops"] for r in rows]),
            "imb": rows[-1].get("expert_tokens", {}).get("imbalance"), "aux": rows[-1].get("router_aux_loss"),
            "state": rows[-1].get("host_state_bytes", 0), "peak": rows[-1].get("gpu_peak_bytes", 0)}
o = ours(f"{w}/big")
comp = last_json(f"{w}/big/runs/**/compute/stage.log", "compute_only")
if "big" not in what:
    pass
elif o is None:
    print(f"FAIL moe         qwen3-30b-a3b x{big} layers: no steps of ours (see details)")
else:
    cps = comp["tokens_per_s"] if comp else None
    ratio = o["tps"] / cps if cps else float("nan")
    print(f"{'PASS' if cps and ratio >= 0.9 else 'FAIL'} moe         qwen3-30b-a3b x{big} layers, {tokens // 1024}K tok/step, "
          f"int8 + {source}: {o['tps']:.0f} tok/s, {o['tflops']:.0f} model TFLOP/s (active) = {ratio:.3f} of compute-only "
          f"{cps or float('nan'):.0f} tok/s (target 0.9); host state {o['state'] / 2**30:.1f} GiB, GPU peak "
          f"{o['peak'] / 2**30:.1f} GiB, expert imbalance {o['imb']}, aux {o['aux']}")
o = ours(f"{w}/peer")
peer = last_json(f"{w}/peer/runs/**/fsdp2/stage.log", "fsdp2-moe")
if "peer" not in what:
    pass
elif o is None or peer is None:
    print(f"FAIL moe         qwen3-30b-a3b x{small} layers vs FSDP2: ours {'ran' if o else 'no steps'}, "
          f"FSDP2 {'ran' if peer else 'no result (OOM or cut; see details)'}")
else:
    ratio = o["tps"] / peer["tokens_per_s_per_gpu"]
    print(f"{'PASS' if ratio >= 1.5 else 'FAIL'} moe         qwen3-30b-a3b x{small} layers, {tokens // 1024}K tok/step: ours "
          f"{o['tps']:.0f} tok/s ({o['tflops']:.0f} TFLOP/s) / FSDP2 {peer['tokens_per_s_per_gpu']:.0f} tok/s "
          f"({peer['model_tflops_per_gpu']:.0f} TFLOP/s, experts {peer.get('experts_implementation')}, peak "
          f"{peer.get('peak_gib', 0):.0f} GiB) = {ratio:.2f} (target 1.5)")
PY
}


# Context parallelism's CUDA path on one GPU (issue 26, before a two-GPU machine): two CUDA workers
# share GPU 0 (the second named --id gpu0b), runtime.context_parallel 2 with the cpu route and
# replicated delivery, so each layer's keys and values go through the job's shm segment, staged in
# host memory (NCCL needs one GPU per rank: the two-GPU path is unrun here). Against one worker on
# the whole micro-batches, same data and seed, deterministic: each step's loss and gradient norm.
part_cp1gpu() {
  find_cudnn
  local d=$work/cp1gpu model=${CP_MODEL:-qwen3-0.6b} seq=${CP_SEQ:-8192} steps=${CP_STEPS:-6} id workers extra
  local vocab=${CP_VOCAB:-151936} train_extra=${CP_TRAIN_EXTRA:+, $CP_TRAIN_EXTRA} model_extra="" factor
  # A row beyond 32K (e.g. 131072, whose zig-zag pieces are large enough for SLIDEDP_CUDNN_CROSS):
  # Qwen3's yarn RoPE over its 32K pretraining context, as part_longctx writes it.
  if [ "$seq" -gt 32768 ]; then
    factor=$(awk -v s="$seq" 'BEGIN { f = s / 32768; fmt = f == int(f) ? "%.1f" : "%.6g"; printf fmt, f }')
    model_extra=", max_position_embeddings: $((seq > 40960 ? seq : 40960)), rope_scaling: {rope_type: yarn, factor: $factor, original_max_position_embeddings: 32768}"
  fi
  model_extra="${CP_LAYERS:+, num_hidden_layers: $CP_LAYERS}$model_extra"
  new_dir "$d"
  stage cp_data 60 python3 bench/e2e/make_dataset.py --out "$d/data" --rows 64 --seq-len "$seq" --vocab "$vocab"
  for id in one cp; do
    workers=1 extra=""
    [ "$id" = cp ] && workers=2 extra="context_parallel: 2, "
    cat > "$d/$id.yaml" << YAML
name: $id
model: {preset: $model, init_seed: 0$model_extra}
data: {path: $d/data}
output: {dir: $d/out-$id, save_final: false}
train: {seq_len: $seq, global_batch: 2, micro_batch: 1, steps: $steps, max_grad_norm: 1.0$train_extra}
runtime: {workers: $workers, ${extra}grad_reduction: cpu, deterministic: ${CP_DETERMINISTIC:-true}}
YAML
  done
  if dry; then
    echo "DRY  cp1gpu: slidedp-hostd; slidedp-worker --gpu 0; slidedp-worker --gpu 0 --id gpu0b; submit one.yaml, cp.yaml"
    return
  fi
  local sock=unix:$d/hostd.sock
  slidedp-hostd --listen "$sock" --state-dir "$d/state" --output-root "$d" > "$part_dir/hostd.log" 2>&1 &
  local hostd_pid=$!
  sleep 2
  CUDA_VISIBLE_DEVICES=0 slidedp-worker --hostd "$sock" --gpu 0 > "$part_dir/worker0.log" 2>&1 &
  local w0=$!
  CUDA_VISIBLE_DEVICES=0 slidedp-worker --hostd "$sock" --gpu 0 --id gpu0b > "$part_dir/worker1.log" 2>&1 &
  local w1=$!
  export SLIDEDP_HOSTD=$sock
  for _ in $(seq 1 60); do [ "$(slidedp workers 2> /dev/null | grep -c gpu0)" -ge 2 ] && break; sleep 1; done
  for id in one cp; do
    stage "cp1gpu_$id" 300 slidedp submit "$d/$id.yaml" --id "$id"
    copy_metrics "$d/out-$id/metrics-*.jsonl" "$part_dir/$id.jsonl"
  done
  kill "$w0" "$w1" "$hostd_pid" 2> /dev/null
  wait "$w0" "$w1" "$hostd_pid" 2> /dev/null
  unset SLIDEDP_HOSTD
  python3 - "$part_dir/one.jsonl" "$part_dir/cp.jsonl" "$model" "$seq" "$steps" << 'PY' | tee -a "$summary"
import json, sys
one, cp, model, seq, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
def rows(p):
    try:
        return {int(r["step"]): r for r in (json.loads(l) for l in open(p) if l.strip())}
    except (OSError, ValueError, KeyError):
        return {}
a, b = rows(one), rows(cp)
both = sorted(set(a) & set(b))
if len(both) < steps:
    print(f"FAIL cp1gpu      {model} seq {seq}: {len(a)} steps of one worker, {len(b)} of context parallel 2 (see logs)")
    sys.exit(0)
dl = max(abs(b[s]["loss"] - a[s]["loss"]) / abs(a[s]["loss"]) for s in both)
aux = [(a[s].get("router_aux_loss"), b[s].get("router_aux_loss")) for s in both]
da = max((abs(y - x) / abs(x) for x, y in aux if x), default=None)
dg = max(abs(b[s]["grad_norm"] - a[s]["grad_norm"]) / abs(a[s]["grad_norm"]) for s in both)
tps = [b[s]["tokens_per_s"] for s in both if s >= 2]
ok = dl <= 2e-3 and dg <= 2e-2 and (da is None or da <= 2e-3)
print(f"{'PASS' if ok else 'FAIL'} cp1gpu      {model}, 2 x {seq} tokens/step, context parallel 2 (2 CUDA workers on one "
      f"GPU, K/V through shm) vs 1 worker over {len(both)} steps: max rel |dloss| {dl:.2e} (tol 2e-3), max rel "
      f"|dgrad_norm| {dg:.2e} (tol 2e-2)" + (f", max rel |d router_aux_loss| {da:.2e} (tol 2e-3)" if da is not None else "") +
      f"; losses {[round(a[s]['loss'], 5) for s in both]} vs "
      f"{[round(b[s]['loss'], 5) for s in both]}; {sorted(tps)[len(tps) // 2] if tps else 0:.0f} tok/s (staged, not a speed figure)")
PY
  rm -rf "$d"
}

part_longctx() {
  find_cudnn
  local model=${LONGCTX_MODEL:-qwen3-8b} seq=${LONGCTX_SEQ:-262144} steps=${LONGCTX_STEPS:-2}
  local offload=${LONGCTX_OFFLOAD:-0.4} tile=${LONGCTX_TILE-32768} what=${LONGCTX_WHAT:-"ours compute peer"} k
  local cp=${LONGCTX_CP:-1} cp_yaml=""
  local w=$work/longctx/$model${LONGCTX_LAYERS:+-l$LONGCTX_LAYERS}-s$seq${LONGCTX_CP:+-cp$cp} maxpos rope_yaml="" rope_json="" factor
  if [ "$cp" -gt 1 ]; then  # one sequence over cp GPUs (issue 26), keys and values over NCCL
    if [ "$gpus" -lt "$cp" ]; then
      result SKIP longctx "LONGCTX_CP=$cp needs $cp GPUs, $gpus visible"
      return
    fi
    cp_yaml=" context_parallel: $cp, grad_reduction: gpu,"
  fi
  for k in $what; do
    case $k in
      ours|compute|peer) ;;
      *) result FAIL longctx "LONGCTX_WHAT: unknown stage '$k' (ours compute peer)"; return ;;
    esac
  done
  maxpos=$((seq > 40960 ? seq : 40960))
  if [ "$seq" -gt 32768 ]; then  # Qwen3's documented long-context RoPE: yarn over its 32K pretraining context
    factor=$(awk -v s="$seq" 'BEGIN { f = s / 32768; fmt = f == int(f) ? "%.1f" : "%.6g"; printf fmt, f }')
    rope_yaml=", rope_scaling: {rope_type: yarn, factor: $factor, original_max_position_embeddings: 32768}"
    rope_json="{\"rope_type\":\"yarn\",\"factor\":$factor,\"original_max_position_embeddings\":32768}"
  fi
  mkdir -p "$w"
  for k in $what; do "longctx_$k"; done
  judge longctx --dir "$w" --model "$model${LONGCTX_LAYERS:+ (${LONGCTX_LAYERS} layers)}" --seq "$seq" \
    --expect-steps "$steps" --t-tflops "$LONGCTX_T_TFLOPS" \
    --ran "$what"
  dry && return 0
  # the details: every small result file, this call's and an earlier call's (not the dataset, the socket)
  mkdir -p "$part_dir/results"
  (cd "$w" && find . -type f -size -4M ! -name '*.safetensors' -print0 | xargs -0 -r cp --parents -t "$part_dir/results")
}

# -------------------------------------------------------------------------------------------- run

{
  echo "=== run_suite $* at $(date -u +%FT%TZ); SUITE_DEADLINE=$SUITE_DEADLINE s$(dry && echo ', DRY_RUN')"
  cat .gpu/build-info.txt 2> /dev/null || echo "bundle: no .gpu/build-info.txt"
  if ! dry; then
    [ $have_smi = 1 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sort | uniq -c
    echo "host: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, /tmp $(df -h /tmp | awk 'NR == 2 {print $4}') free"
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -n 1
  fi
} | tee "$OUT/env.txt"
for part in "$@"; do
  part_dir=$work/out/$part
  new_dir "$part_dir"
  t0=$SECONDS
  echo "=== part $part (at ${t0} s)"
  "part_$part"
  echo "=== part $part done after $((SECONDS - t0)) s"
  pack_details
done

# the verdict per part: FAIL if any of its checks failed
echo "=== summary ($summary)"
cat "$summary" 2> /dev/null
status=0
for part in "$@"; do
  n_fail=$(grep -c "^FAIL $part " "$summary" 2> /dev/null)
  n_pass=$(grep -c "^PASS $part " "$summary" 2> /dev/null)
  if [ "${n_fail:-0}" -gt 0 ]; then verdict="FAIL ($n_fail of $((n_fail + n_pass)) checks)"; status=1
  elif [ "${n_pass:-0}" -gt 0 ]; then verdict="PASS ($n_pass checks)"
  elif dry; then verdict="DRY RUN"
  else verdict="no check ran"; fi
  echo "run_suite: $part $verdict" | tee -a "$summary"
done
exit $status

