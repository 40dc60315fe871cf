"""The GPU suite as data (docs/gpu-suite.md): one row per part, in the order `--help` lists them.

Each Part says what runs (`runs`, and `recipe`: the function in suite_recipes*.py that builds its
command lines), what it is held to (`gate`, and `thresholds`: the one place every number the suite
judges by is written), what it is compared with (`peer`), how many GPUs it needs (`gpus`; fewer
visible: SKIP) and the environment knobs it takes with their defaults (`knobs`). A knob's value is
the environment's when set and not empty (`empty_ok`: when set at all), else its default; a default
of None is worked out by the recipe (the knob's text says how). A threshold with a `knob` may be
overridden from the environment. `suite_judge.py`, `clip_check.py`, `autopolicy_check.py`,
`routes_check.py` and `plan_check.py` read their thresholds from here (`threshold(part, name)`);
issue 4's end-to-end targets stay in bench/e2e/report.py, named here by `Report("T_...")`.

Python 3.11 standard library only: imported by the runner (tools/gpu/run_suite.py), the judges and
the tests (tools/gpu/run_suite_test.py).
"""
from dataclasses import dataclass, field
import importlib.util
import os

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


@dataclass(frozen=True)
class Knob:
    name: str                 # the environment variable
    default: str | None       # None: the recipe works it out (see doc)
    doc: str = ""
    empty_ok: bool = False    # set but empty is a value (bash's ${X-default}), e.g. LONGCTX_TILE=


@dataclass(frozen=True)
class T:
    """A threshold: the value, where it comes from, and the knob that may override it."""
    value: float | int
    doc: str = ""
    knob: str | None = None


@dataclass(frozen=True)
class Report:
    """A target written in bench/e2e/report.py (issue 4's), read from there."""
    name: str
    doc: str = ""
    knob = None

    @property
    def value(self):
        return getattr(report_module(), self.name)


@dataclass(frozen=True)
class Part:
    name: str
    minutes: str              # on one H200, as last measured
    runs: str                 # what runs (the recipe builds the exact command lines)
    gate: str                 # what it is held to, thresholds as {name}
    peer: str = ""            # the reference it is compared with ("" : none, or itself)
    gpus: int = 1             # fewer visible: the part prints SKIP (routes: its two-GPU half)
    knobs: tuple = ()
    thresholds: dict = field(default_factory=dict)


    def gate_text(self):
        """The gate with the thresholds' values in it (`gate` names them as {name})."""
        return self.gate.format(**{k: fmt(t.value) for k, t in self.thresholds.items()})


def K(name, default, doc="", empty_ok=False):
    return Knob(name, default, doc, empty_ok)


# Suite-wide knobs (every part). OUT and SUITE_WORK are folders; DRY_RUN prints instead of running.
SUITE_KNOBS = (
    K("SUITE_DEADLINE", "570", "seconds after the start by which every stage must have ended (the device tool stops "
      "a command at 600 s); stages are cut to fit, and skipped when not"),
    K("SUITE_WORK", "/tmp/slidedp-suite", "scratch space (large: models, checkpoints)"),
    K("OUT", "/tmp/slidedp-suite-out", "what the device tool returns: summary.txt, suite.log, env.txt, details.tar.gz"),
    K("DRY_RUN", "0", "1: print the commands each part would run, run nothing (works without a bundle)"),
    K("DRY_GPUS", "1", "with DRY_RUN: as if this many GPUs were visible (the two-GPU parts)"),
    K("SUITE_BUNDLE", "1", "0: no bundle (.gpu/ left alone): the binaries on PATH, e.g. a local build or the "
      "runner's tests"),
    K("SUITE_DS", "/tmp/ds", "the text dataset (suite_lib.sh; curves sets it for llama3 and tiny presets)"),
    K("SUITE_TOKENIZER", "tests/data/tokenizer/qwen3", "the text dataset's tokenizer (suite_lib.sh)"),
)

PARTS = (
    Part("smoke", "1", "`slidedp run examples/tiny/job.yaml --backend cuda` (private hostd + one CUDA worker)",
         "succeeds, 120 steps, final loss <= {max_loss}",
         thresholds={"max_loss": T(3.5, "tiny example, 120 steps: ln 512 = 6.24 at the start, 3.16 measured (K9)")}),
    Part("families", "3", "issue 24: tiny-qwen2 / tiny-llama / tiny-mistral on CUDA and on the CPU backend at lr 0 "
         "with a validation split (eval every step) and TensorBoard (tools/gpu/tensorboard_check.py), then 60 steps "
         "of training on CUDA", "validation losses CUDA vs CPU within {tol}, gradient norms within {grad_tol} (relative), "
         "the events equal the JSONL; the training's final loss <= {max_loss}", peer="the CPU backend",
         knobs=(K("FAMILIES_PRESETS", "tiny-qwen2 tiny-llama tiny-mistral", "the presets"),
                K("FAMILIES_RUNTIME_EXTRA", "", "more runtime keys for the jobs")),
         thresholds={"tol": T(5e-3, "validation loss CUDA vs CPU, relative", knob="FAMILIES_TOL"),
                     "grad_tol": T(2e-2, "gradient norm CUDA vs CPU at lr 0, relative", knob="FAMILIES_GRAD_TOL"),
                     "max_loss": T(5.0, "final loss after 60 steps at lr 3e-3", knob="FAMILIES_MAX_LOSS")}),
    Part("kernels", "1-4", "every bundled GPU test binary (.gpu/tests/*_gpu_test) with --gtest_output=xml "
         "(KERNELS_CTEST=1: `ctest -L gpu` in a build tree)", "every binary exits 0, no failed test",
         knobs=(K("KERNELS_FILTER", "", "--gtest_filter for every GPU test binary"),
                K("KERNELS_CAP", "300", "seconds per binary (KERNELS_CTEST: ctest's --timeout)"),
                K("KERNELS_CTEST", "0", "1: `ctest -L gpu` in KERNELS_BUILD_DIR instead of the bundled binaries"),
                K("KERNELS_BUILD_DIR", "build", "the build tree for KERNELS_CTEST"),
                K("KERNELS_WRAP", "", "a command to run each binary under, e.g. \"compute-sanitizer --tool memcheck\""))),
    Part("layouts", "2", "dump_batches of a fine-tune's steps, then attn_layouts_check (cuDNN vs the own attention, "
         "per document, with the backend's strides)", "0 of 2 x LAYOUTS_STEPS micro-batches differ beyond 2e-2 "
         "(attn_layouts_check's own tolerance)", peer="the own attention",
         knobs=(K("LAYOUTS_PRESET", "qwen3-1.7b", "the fine-tune whose layouts are checked (heads from the preset)"),
                K("LAYOUTS_STEPS", "200"), K("LAYOUTS_CAP", "300", "seconds for attn_layouts_check"))),
    Part("hf", "5-7", "tools/verify/gpu_verify.sh (script tests, hf_train_reference --selftest, hf_compare on 5 "
         "shapes), hf_checkpoint_check selftest, tokenizer vs HF tokenizers on 20,000 fuzz documents",
         "stages exit 0; loss rel <= {loss_tol} and every gradient rel L2 <= {grad_tol}, or <= {floor_factor}x HF's "
         "own FP32-vs-autocast distance; checkpoints bit-exact; 0 documents differ", peer="HF transformers (autocast), HF tokenizers",
         knobs=(K("HF_SHAPES", "", "hf_compare's --shapes (empty: all five, through gpu_verify.sh)"),),
         thresholds={"loss_tol": T(1e-3, "hf_compare.py's loss tolerance (docs/verification.md)"),
                     "grad_tol": T(2e-2, "hf_compare.py's gradient tolerance"),
                     "floor_factor": T(1.25, "a gradient over grad_tol passes within this factor of HF's own "
                                       "FP32-vs-autocast distance (q/k-norm weights, session 4)")}),
    Part("graddiff", "6", "Qwen3-1.7B: 150-step pretrain, one fine-tune step saved in FP32, grad_diff.py on step "
         "2's batch", "loss rel <= {loss_tol}, total gradient norm rel <= {norm_tol}", peer="HF autocast on the same weights",
         thresholds={"loss_tol": T(1e-3, "hf_compare.py's loss tolerance, on the total of one batch"),
                     "norm_tol": T(2e-2, "hf_compare.py's gradient tolerance, on the total norm")}),
    Part("curves", "6 (0.6B), 9 (1.7B)", "ours pretrains, then ours and hf_train_reference.py fine-tune CURVES_STEPS "
         "at lr 1e-5 on the same batches; compare_curves.py", "max |dloss| vs HF autocast <= {tol} over all steps "
         "(MoE presets: {moe_tol}); other references INFO; CURVES_STATES: max |dloss| <= {states_tol}, final loss "
         "within {states_final_rel} relative",
         peer="HF + torch AdamW (hf_train_reference.py) from our pretrain's weights",
         knobs=(K("CURVES_MODEL", "qwen3-0.6b", "qwen3-0.6b (pretrain 250) | qwen3-1.7b (160, deterministic) | "
                  "tiny* (byte-level data) | tiny-moe, *-a3b (tol 1e-3) | llama3* (Llama 3 vocabulary)"),
                K("CURVES_PRE", None, "pretrain steps (by model: 250 for 0.6B, else 160)"),
                K("CURVES_LAYERS", None, "a reduced depth of CURVES_MODEL (model.num_hidden_layers; empty: the "
                  "preset's)"),
                K("CURVES_STEPS", "200", "fine-tuning steps"),
                K("CURVES_DET", None, "runtime.deterministic 0/1 (by model: 1 for 1.7B)"),
                K("CURVES_REFS", None, "HF references, the first is the gate (0.6B: \"bf16-autocast "
                  "bf16-mirror-fp32-norms\"; MoE: \"bf16-autocast bf16-autocast-eager\"; else bf16-autocast); "
                  "NAME-eager runs it with eager attention"),
                K("CURVES_HF_CAP", "220", "seconds per reference"),
                K("CURVES_DEADLINE", None, "seconds after the start by which every HF reference stops "
                  "(SUITE_DEADLINE - 25); a reference cut short fails the gate"),
                K("CURVES_BF16_GRADS", "0", "1: also ours with runtime.grad_dtype bf16 (figure vs HF)"),
                K("CURVES_STATES", "", "e.g. \"int8 bf16\": also ours with those optimizer.state_dtype, judged "
                  "against ours with FP32 moments")),
         thresholds={"tol": T(6e-4, "issue 4: max |dloss| against HF autocast over 200 fine-tuning steps"),
                     "moe_tol": T(1e-3, "issue 23: a MoE preset's max |dloss| (HF eager attention as its spread)"),
                     "states_tol": T(1e-2, "issue 21: compact moments' max |dloss| against FP32 moments"),
                     "states_final_rel": T(0.005, "issue 21: compact moments' final loss, relative")}),
    Part("determinism", "2", "the same Qwen3-0.6B job twice with runtime.deterministic and SLIDEDP_LOG_UNIT_NORMS=1, "
         "then once without", "bitwise equal losses and unit norms at every step", peer="itself",
         knobs=(K("DET_MODEL", "qwen3-0.6b"), K("DET_STEPS", "3"))),
    Part("offload", "2", "bench_step Qwen3-4B 64K at --offload-ratio 0, 0.5, 1", "bitwise equal losses",
         peer="itself at offload ratio 0", knobs=(K("OFFLOAD_MODEL", "qwen3-4b", "(64K tokens, seq 4096)"),)),
    Part("routes", "3", "Qwen3-0.6B ROUTES_STEPS steps: host vs device gradient staging; with 2 GPUs also "
         "grad_reduction gpu (device and host staging), param_delivery sharded, grad_reduction cpu",
         "|dloss| <= {loss_tol}, FP32 weights rel L2 <= {weight_tol}", peer="1 GPU, host staging",
         knobs=(K("ROUTES_STEPS", "20"),),
         thresholds={"loss_tol": T(2e-4, "20 steps at loss ~12: the batch split and cuDNN's atomic dQ gave up to "
                                  "1.6e-4 (sessions E, I)"),
                     "weight_tol": T(1e-4, "FP32 weights after 20 steps, worst tensor (sessions E, I: 6.4e-5)")}),
    Part("routespeed", "15", "(2 GPUs, issue 26) `slidedp plan --measure` of a spec with grad_reduction and "
         "param_delivery auto on a node service, per model and tokens per GPU: every route measured by its own job; "
         "tools/gpu/routes_check.py", "every route measured; auto's pick within {tolerance} (relative) of the fastest measured",
         peer="the other routes", gpus=2,
         knobs=(K("ROUTESPEED_GPUS", "2"), K("ROUTESPEED_MODELS", "qwen3-4b qwen3-8b"),
                K("ROUTESPEED_TOKENS", "16384 65536", "tokens per GPU"),
                K("ROUTESPEED_MAX_GRAD_NORM", "1.0"), K("ROUTESPEED_RUNTIME_EXTRA", "", "more runtime keys")),
         thresholds={"tolerance": T(0.03, "auto's pick / the fastest measured route, minus 1")}),
    Part("bench", "6", "bench/e2e/run_bench.sh: ours and compute-only at BENCH_TOKENS, then ours, FSDP2 GPU-resident "
         "and FSDP2 CPU offload at BENCH_PEER_TOKENS, one WORK", "ours / compute-only >= {compute}; ours / FSDP2 "
         "GPU-resident >= {fsdp2}; ours / FSDP2 CPU offload >= {offload} at the same batch; host <= {host} GiB per "
         "billion parameters (bench/e2e/report.py)", peer="compute-only, FSDP2 GPU-resident, FSDP2 CPU offload",
         knobs=(K("BENCH_MODEL", "qwen3-4b", "qwen3-4b | qwen3-8b (no CPU-offload peer: it needs 128 GB host)"),
                K("BENCH_TOKENS", "65536", "ours' tokens per step"), K("BENCH_PEER_TOKENS", "16384"),
                K("BENCH_POLICY", "auto", "ours' act_policy"),
                K("BENCH_OFFLOAD", None, "1: run the CPU-offload peer (default 1 for qwen3-4b)"),
                K("BENCH_RUNTIME_EXTRA", "", "more runtime keys for ours"),
                K("BENCH_MAX_GRAD_NORM", "1.0", "ours' clipping (0: none, as the peer)")),
         thresholds={"compute": Report("T_COMPUTE", "ours / compute-only (from 64K tokens)"),
                     "fsdp2": Report("T_FSDP2", "ours / FSDP2 GPU-resident, each at its best batch"),
                     "offload": Report("T_OFFLOAD", "ours / FSDP2 CPU offload at the same batch"),
                     "host": Report("T_HOST", "host GiB per billion parameters")}),
    Part("clip", "5-6", "issue 20: one run_bench.sh per variant of ours (CLIP_VARIANTS), then compute-only and "
         "FSDP2; tools/gpu/clip_check.py", "clip / compute-only >= {compute}, clip / FSDP2 >= {fsdp2}, clip step <= "
         "{step}x the no-clip step", peer="compute-only, FSDP2 GPU-resident, ours without clipping",
         knobs=(K("CLIP_MODEL", "qwen3-4b"), K("CLIP_TOKENS", "16384"), K("CLIP_POLICY", "auto", "act_policy"),
                K("CLIP_VARIANTS", "spec:1.0: high:1e4: wait:1.0:speculation_bytes=0 noclip:0:",
                  "NAME:MAX_GRAD_NORM:RUNTIME_KEY=VALUE (or state_dtype=int8) ..."),
                K("CLIP_PEERS", "compute fsdp2")),
         thresholds={"compute": T(0.95, "clip / compute-only"), "fsdp2": T(1.25, "clip / FSDP2 GPU-resident"),
                     "step": T(1.05, "clip step / no-clip step")}),
    Part("specbits", "2", "Qwen3-0.6B, runtime.deterministic, 6 steps at thresholds 1e4 and 1e-3, "
         "speculation_bytes auto and 0", "losses bitwise equal at both (commits; a redo)",
         peer="speculation off (speculation_bytes 0)"),
    Part("mastersrc", "3-6", "issue 21: runtime.param_source master, cast on the GPU and on the host, each against "
         "the mirror: Qwen3-0.6B deterministic 6 steps, then MASTERSRC_MODEL at MASTERSRC_TOKENS",
         "losses bitwise equal to the mirror's; speed, cast and H2D seconds per step, host state (figures)",
         peer="param_source mirror",
         knobs=(K("MASTERSRC_VARIANTS", "mirror master_device master_host"), K("MASTERSRC_MODEL", "qwen3-4b"),
                K("MASTERSRC_TOKENS", "16384"))),
    Part("big", "6", "issue 21: BIG_MODEL random init with int8 moments + param_source master at BIG_TOKENS, "
         "without and with clipping (BIG_VARIANTS), then compute-only", "ours / compute-only >= {compute}; host state "
         "and MemAvailable drop per billion parameters (target {host_gib_per_b} GiB/B)", peer="compute-only (one GPU)",
         knobs=(K("BIG_MODEL", "qwen3-14b"), K("BIG_TOKENS", "65536"), K("BIG_VARIANTS", "noclip:0 clip:1.0",
                  "NAME:MAX_GRAD_NORM ..."),
                K("BIG_GPUS", "1", "2: issue 26's runs on two GPUs, tok/s per GPU against one GPU's compute-only"),
                K("BIG_STATE_DTYPE", "int8", "fp32: the exact state"), K("BIG_POLICY", "recompute"),
                K("BIG_RUNTIME_EXTRA", ""), K("BIG_STEPS", "4")),
         thresholds={"compute": T(0.95, "ours / compute-only"),
                     "host_gib_per_b": T(6, "host GiB per billion parameters (a figure's target)")}),
    Part("memlimit", "2", "issue 22: MEMLIMIT_MODEL at MEMLIMIT_TOKENS, act_policy MEMLIMIT_ACT_POLICY, without a "
         "limit and with runtime.gpu_memory_limit MEMLIMIT", "the limited run's GPU peak under the limit; its speed "
         ">= {speed} of the unlimited", peer="the same job without the limit",
         knobs=(K("MEMLIMIT_MODEL", "qwen3-4b"), K("MEMLIMIT_TOKENS", "65536"), K("MEMLIMIT", "40GiB"),
                K("MEMLIMIT_ACT_POLICY", "auto"), K("MEMLIMIT_RUNTIME_EXTRA", "", "e.g. \"policy: auto\""),
                K("MEMLIMIT_STEPS", "4"), K("MEMLIMIT_STEADY_FROM", "2", "speed from this step")),
         thresholds={"speed": T(0.9, "limited / unlimited tokens/s")}),
    Part("policy", "2", "issue 22: a per-layer layout file (every kind, offloads) on Qwen3-0.6B deterministic, "
         "6 steps at 16K", "losses bitwise (<= {loss_tol}) those of whole-layer recompute; GPU peaks (figures)",
         peer="act_policy recompute", thresholds={"loss_tol": T(1e-4, "the kernel tolerance")}),
    Part("autopolicy", "7", "issue 22: runtime.policy auto on AP_MODEL at AP_TOKENS, measured and solved in the run, "
         "then again from the policy cache, against act_policy auto and FSDP2 GPU-resident at AP_PEER_TOKENS; "
         "tools/gpu/autopolicy_check.py", "auto / FSDP2 >= {fsdp2_8b} (4B: {fsdp2_4b}); auto / act_policy "
         "auto >= {today}; predicted step within {predict} (relative); selection <= {select} s; the cached job runs "
         "without probes; AutoPolicy's steady step within {sweep} of the sweep's fastest", peer="act_policy auto, FSDP2 GPU-resident",
         knobs=(K("AP_MODEL", "qwen3-8b"), K("AP_TOKENS", "65536"), K("AP_PEER_TOKENS", "16384"),
                K("AP_VARIANTS", "auto cached today peer", "a subset"),
                K("AP_SWEEP", "1", "the auto run also measures SweepLayouts one step each (SLIDEDP_AUTOPOLICY_SWEEP)"),
                K("AP_STEPS", None, "ours' steps (20 with the sweep, else 8)"), K("AP_MAX_GRAD_NORM", "1.0"),
                K("AP_STATE_DTYPE", "fp32"), K("AP_RUNTIME_EXTRA", "")),
         thresholds={"fsdp2_8b": T(1.65, "auto / FSDP2 at 64K, Qwen3-8B"),
                     "fsdp2_4b": T(1.7, "auto / FSDP2 at 64K, Qwen3-4B"),
                     "today": T(0.99, "auto / act_policy auto (one run's noise)"),
                     "predict": T(0.10, "|predicted / measured step - 1|"), "select": T(60.0, "selection seconds"),
                     "sweep": T(0.02, "AutoPolicy's steady step / the sweep's fastest, minus 1")}),
    Part("plan", "7", "issue 22: `slidedp plan --measure` on a node service: per PLAN_TOKENS the measuring job, then "
         "per PLAN_POLICIES `slidedp plan`, the job and `slidedp plan --compare`; tools/gpu/plan_check.py",
         "predicted step within {max_error} (relative) of the median from step 4; the measuring job's time is a "
         "figure",
         peer="the measured step",
         knobs=(K("PLAN_MODEL", "qwen3-4b"), K("PLAN_TOKENS", "16384 65536"),
                K("PLAN_POLICIES", "recompute selective auto"), K("PLAN_STEPS", "8"),
                K("PLAN_RUNTIME_EXTRA", "", "e.g. \"chunk_bytes: auto\"")),
         thresholds={"max_error": T(0.10, "|predicted / measured step - 1|")}),
    Part("scaling", "10", "(2 GPUs) SCALING_MODEL ours at 64K per GPU on 1 and 2 GPUs (weak), at each global batch of "
         "SCALING_STRONG 1 GPU at G and 2 GPUs at G / 2 (strong), FSDP2 on 2 GPUs at 16K", "1 -> 2 GPUs >= {weak}x "
         "(weak), >= {t_strong}x (strong); ours / FSDP2 >= {fsdp2}", peer="ours on 1 GPU, FSDP2 on 2 GPUs", gpus=2,
         knobs=(K("SCALING_MODEL", "qwen3-8b"),
                K("SCALING_STRONG", "65536 16384", "global batches (empty: none)", empty_ok=True)),
         thresholds={"weak": Report("T_SCALING", "total tokens/s 1 -> 2 GPUs at the same tokens per GPU"),
                     "t_strong": T(1.9, "1 -> 2 GPUs at one global batch: the compute window halves, the host's "
                                   "work does not (the published runtime's 4 -> 8: 1.94x)"),
                     "fsdp2": Report("T_FSDP2", "ours / FSDP2 on 2 GPUs")}),
    Part("state", "1-3", "issue 21: adam_state_test, adam_engine_test, adam_kernels_test on the GPU host's CPU "
         "(AVX-512), then bench_layeradam with fp32 / bf16 / int8 moments per STATE_MIRRORS", "the tests pass; "
         "int8 / fp32 params/s >= {int8} (per mirror setting)", peer="fp32 moments",
         knobs=(K("STATE_MIRRORS", "stream none", "--mirror-store settings"), K("STATE_PARAMS", "268435456")),
         thresholds={"int8": T(1.5, "int8 / fp32 moments, params/s")}),
    Part("host", "5", "bench/layeradam/torch_cpu_adamw.py, bench_copy (continuous, then --duty 20:20 --mib 64), a "
         "node service with two Qwen3-4B jobs back to back", "LayerAdam / torch fused CPU AdamW >= {t_torch}, >= "
         "{t_copy} of copy bandwidth, >= {t_triad} of the same-run triad; H2D with LayerAdam + copy priority >= "
         "{t_ratio} of solo",
         peer="torch fused CPU AdamW, memcpy",
         thresholds={"t_torch": T(1.1, "issue 2: LayerAdam / torch's fused CPU AdamW"),
                     "t_copy": T(0.8, "LayerAdam traffic / the host's copy bandwidth (28 B/param)"),
                     "t_triad": T(0.85, "LayerAdam / the same-run triad (\"LayerAdam at the memory wall\")"),
                     "t_ratio": T(0.9, "H2D with LayerAdam + copy priority / alone (\"DMA before Adam\")")}),
    Part("restart", "4", "a node service with one CUDA worker: a deterministic job, then the same job with hostd "
         "SIGKILLed after step RESTART_KILL_AT and started again; tools/gpu/restart_check.py", "resumed from shared "
         "memory and succeeded; every step's loss bitwise equal; restart -> next step is a figure",
         peer="the uninterrupted run",
         knobs=(K("RESTART_MODEL", "qwen3-4b"), K("RESTART_STEPS", "8"),
                K("RESTART_KILL_AT", "3", "the step after which hostd is killed"))),
    Part("kbench", "5", "bench_kernels (KBENCH_QUICK=1: --quick), bench/kernels/torch_sdpa.py", "cuDNN attention "
         ">= {t_fwd} TFLOP/s forward, >= {t_bwd} backward (causal, >= 4K tokens); Qwen3-8B layer keep-all >= "
         "{t_layer} at 64K",
         peer="torch SDPA (figures)",
         knobs=(K("KBENCH_QUICK", "0", "1: --quick (8B at 4K only; the layer gate becomes a figure)"),),
         thresholds={"t_fwd": T(400, "issue 3: attention TFLOP/s forward, causal, 4K+ tokens (docs/kernels.md)"),
                     "t_bwd": T(300, "issue 3: attention TFLOP/s backward"),
                     "t_layer": T(550, "Qwen3-8B decoder layer keep-all over 64K tokens")}),
    Part("longctx", "9", "long context: LONGCTX_MODEL, one sequence of LONGCTX_SEQ tokens per step through slidedp run "
         "(yarn RoPE to the row, int8 moments, param_source master, recompute with LONGCTX_OFFLOAD of the layers' "
         "checkpoints in pinned host memory), then bench_step compute-only on LONGCTX_COMPUTE_LAYERS and FSDP2 "
         "GPU-resident at the longest of LONGCTX_PEER_SEQS that runs; results stay in SUITE_WORK/longctx/MODEL-sSEQ "
         "(a later call with LONGCTX_WHAT=\"compute peer\" is judged with the earlier ours)", "ours trains (finite "
         "loss on each of LONGCTX_STEPS steps); last step >= {t_tflops} model TFLOP/s; the rest are figures",
         peer="compute-only (bench_step), FSDP2 GPU-resident (figures)",
         knobs=(K("LONGCTX_MODEL", "qwen3-8b"), K("LONGCTX_SEQ", "262144", "row = step; yarn factor SEQ / 32768, "
                  "max_position_embeddings max(SEQ, 40960)"),
                K("LONGCTX_STEPS", "2", "step 1 is warm-up, the gate reads the last"),
                K("LONGCTX_LAYERS", "", "a reduced depth of the preset for ours"),
                K("LONGCTX_OFFLOAD", "0.4", "runtime.offload_ratio"),
                K("LONGCTX_TILE", "32768", "runtime.tile_tokens (empty: key left out)", empty_ok=True),
                K("LONGCTX_CHECKPOINT_DTYPE", "fp32", "ours' and compute-only's checkpoint_dtype"),
                K("LONGCTX_ACT_POLICY", "recompute"), K("LONGCTX_POLICY", "", "a policy file (repository-relative)"),
                K("LONGCTX_RUNTIME_EXTRA", ""), K("LONGCTX_CP", "1", "context_parallel over this many GPUs "
                  "(grad_reduction gpu; ours only)"),
                K("LONGCTX_WHAT", "ours compute peer", "the stages, in order"),
                K("LONGCTX_OURS_CAP", "470"), K("LONGCTX_COMPUTE_CAP", "120"),
                K("LONGCTX_PEER_CAP", "150", "per sequence length"),
                K("LONGCTX_COMPUTE_LAYERS", "4", "bench_step's depth (0: all)"),
                K("LONGCTX_COMPUTE_OFFLOAD", None, "0 on fewer layers, else LONGCTX_OFFLOAD"),
                K("LONGCTX_COMPUTE_STEPS", "2"),
                K("LONGCTX_PEER_SEQS", "65536 32768 16384", "FSDP2's row lengths, longest first"),
                K("LONGCTX_PEER_STEPS", "4", "the peer's median after 3 warm-up steps"),
                K("LONGCTX_PEER_ALLOC_CONF", "expandable_segments:True", "the peer's PYTORCH_CUDA_ALLOC_CONF")),
         thresholds={"t_tflops": T(450, "Qwen3-8B, one 256K sequence per step, model TFLOP/s (6N + 6 L s q_dim)")}),
    Part("moe", "9", "issue 23: Qwen3-30B-A3B's shape at MOE_LAYERS of its 48 layers, MOE_TOKENS per step: ours and "
         "compute-only; at MOE_PEER_LAYERS ours and FSDP2 GPU-resident HF Qwen3-MoE", "ours / compute-only >= {compute}; "
         "ours / FSDP2 >= {fsdp2}", peer="compute-only, FSDP2 GPU-resident (HF Qwen3MoeForCausalLM)",
         knobs=(K("MOE_TOKENS", "262144"), K("MOE_LAYERS", "16"), K("MOE_PEER_LAYERS", "8"),
                K("MOE_WHAT", "big peer", "the stages"), K("MOE_BIG_WHAT", "ours compute"),
                K("MOE_PEER_WHAT", "ours fsdp2"), K("MOE_MAX_GRAD_NORM", "1.0"),
                K("MOE_PARAM_SOURCE", "master", "the big stage's runtime.param_source"),
                K("MOE_RUNTIME_EXTRA", ""), K("MOE_STEPS", "4"), K("MOE_MICRO_ROWS", "8", "rows of 4,096"),
                K("MOE_PEER_STATE_DTYPE", "fp32"), K("MOE_FSDP_MICRO_ROWS", "4"), K("MOE_FSDP_STEPS", "5")),
         thresholds={"compute": T(0.9, "ours / compute-only"), "fsdp2": T(1.5, "ours / FSDP2 GPU-resident")}),
    Part("moebench", "2", "bench_kernels --moe T for each of MOEBENCH_TOKENS: one sparse decoder layer forward + "
         "backward, recompute and keep-all, bucketed vs exact expert GEMM plans", "figures only",
         knobs=(K("MOEBENCH_TOKENS", "16384 32768"), K("MOEBENCH_PRESET", "", "more bench_kernels arguments"))),
    Part("cp1gpu", "2", "issue 26 on one GPU: a node service with two CUDA workers on GPU 0, "
         "runtime.context_parallel 2 with the cpu route and replicated delivery, against one worker",
         "every step's loss within {loss_tol} and gradient norm within {grad_tol} relative (the aux loss within "
         "{aux_tol})",
         peer="one worker on the whole micro-batches",
         knobs=(K("CP_MODEL", "qwen3-0.6b"), K("CP_SEQ", "8192", "tokens per row (2 rows a step); > 32768 adds "
                  "yarn RoPE over 32K"), K("CP_STEPS", "6"),
                K("CP_DETERMINISTIC", "true", "false for head dims other than 64 / 128"),
                K("CP_VOCAB", "151936", "the dataset's vocabulary (512 for the tiny presets)"),
                K("CP_TRAIN_EXTRA", "", "more train keys, e.g. \"router_aux_loss_coef: 0.05\""),
                K("CP_LAYERS", "", "a reduced depth")),
         thresholds={"loss_tol": T(2e-3, "relative, per step"), "grad_tol": T(2e-2, "relative, per step"),
                     "aux_tol": T(2e-3, "router aux loss, relative")}),
)

BY_NAME = {p.name: p for p in PARTS}


def part(name):
    return BY_NAME[name]


def knob(part_name, name):
    """The Knob `name` of a part (or a suite-wide one); KeyError when the table does not list it."""
    for k in (BY_NAME[part_name].knobs if part_name in BY_NAME else ()) + SUITE_KNOBS:
        if k.name == name:
            return k
    raise KeyError(f"knob {name} is not in suite_parts.py for part {part_name}")


def threshold(part_name, name, env=None):
    """The float value of a part's threshold (its knob's value from `env` when set)."""
    t = BY_NAME[part_name].thresholds[name]
    env = os.environ if env is None else env
    if t.knob and env.get(t.knob):
        return float(env[t.knob])
    return float(t.value)


def fmt(x):
    """A threshold as the command lines write it: 5e-3 and 2e-2 (not 0.005), 3.5, 450, 5.0."""
    if isinstance(x, float) and 0 < abs(x) < 0.1:
        m, e = f"{x:.6e}".split("e")
        return f"{m.rstrip('0').rstrip('.')}e{int(e)}"
    return repr(x)


_report = None


def report_module():
    """bench/e2e/report.py (issue 4's targets), imported by path once."""
    global _report
    if _report is None:
        spec = importlib.util.spec_from_file_location("e2e_report", os.path.join(ROOT, "bench", "e2e", "report.py"))
        _report = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_report)
    return _report
