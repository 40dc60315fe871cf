"""The GPU suite's recipes, part 1 (numerics, kernels, the host): for each part of suite_parts.py a
function of the running Suite `s` (tools/gpu/run_suite.py) that builds the part's command lines
from its knobs (s.k) and thresholds (s.t) and runs them through s.stage / s.judge (a dry run
prints them). The job specs the parts write are the spec_* functions below."""
import os
import re
import shutil


def nproc():
    return str(len(os.sched_getaffinity(0)))


def which(name):
    """`command -v NAME || echo NAME`."""
    return shutil.which(name) or name


def gpu_list(n):
    """`seq -s, 0 N-1`: CUDA_VISIBLE_DEVICES for the first n GPUs."""
    return ",".join(str(i) for i in range(int(n)))


def yarn(seq):
    """Qwen3's long-context RoPE over its 32K pretraining context: (yaml, json) for a row of seq tokens,
    ("", "") up to 32K. The factor as awk printed it: %.1f when whole, else %.6g."""
    if seq <= 32768:
        return "", ""
    f = seq / 32768
    factor = f"{f:.1f}" if f == int(f) else f"{f:.6g}"
    return (f", rope_scaling: {{rope_type: yarn, factor: {factor}, original_max_position_embeddings: 32768}}",
            f'{{"rope_type":"yarn","factor":{factor},"original_max_position_embeddings":32768}}')


def opt(prefix, value):
    """bash's ${X:+PREFIX$X}."""
    return f"{prefix}{value}" if value else ""


# ---------------------------------------------------------------------------------- job specs

def ds():
    return os.environ.get("SUITE_DS") or "/tmp/ds"


def spec_stable_pretrain(s, d, preset, steps, runtime_extra, layers=""):
    """d/pre.yaml, the steadier regime's pretrain (sessions 5-8): random init, steps of 32 x 1,024
    tokens at lr 3e-4 cosine (warm-up 25, min 3e-5), clip 1.0, FP32 checkpoint in d/pre/checkpoint-N;
    layers: a reduced depth of the preset (empty: the preset's)."""
    depth = f", num_hidden_layers: {layers}" if layers else ""
    s.write(f"{d}/pre.yaml", f"""name: stable-pre
model: {{preset: {preset}, init_seed: 0{depth}}}
data: {{path: {ds()}/train}}
output: {{dir: {d}/pre, save_final: true, save_dtype: fp32}}
train: {{seq_len: 1024, global_batch: 32, micro_batch: 8, steps: {steps}, seed: 0, max_grad_norm: 1.0}}
optimizer: {{lr: 3.0e-4, weight_decay: 0.01}}
schedule: {{kind: cosine, warmup_steps: 25, min_lr: 3.0e-5}}
runtime: {{workers: 1{runtime_extra}}}
""")


def spec_short_pretrain(s, d, preset, steps):
    """d/pre.yaml, the first fine-tuning regime's pretrain (sessions 3-4; graddiff): 8 x 1,024 tokens
    a step at lr 1e-4 cosine (warm-up 10, min 1e-5), clip 1.0, FP32 checkpoint."""
    s.write(f"{d}/pre.yaml", f"""name: short-pre
model: {{preset: {preset}, init_seed: 0}}
data: {{path: {ds()}/train}}
output: {{dir: {d}/pre, save_final: true, save_dtype: fp32}}
train: {{seq_len: 1024, global_batch: 8, micro_batch: 4, steps: {steps}, seed: 0, max_grad_norm: 1.0}}
optimizer: {{lr: 1.0e-4, weight_decay: 0.01}}
schedule: {{kind: cosine, warmup_steps: 10, min_lr: 1.0e-5}}
runtime: {{workers: 1}}
""")


def spec_finetune(s, d, model, steps, runtime_extra, output_extra="save_final: false", name="ft", opt_extra=""):
    """d/ft.yaml, every curve comparison's fine-tune: model (a YAML mapping body), steps of 8 x 1,024
    tokens in another data order (seed 1), constant lr 1e-5, clip 1.0, into d/ft (another name: the
    same job as d/ft-<name without "ft">.yaml into d/<name>)."""
    s.write(f"{d}/ft.yaml" if name == "ft" else f"{d}/ft-{name[2:]}.yaml", f"""name: {name}
model: {{{model}}}
data: {{path: {ds()}/train}}
output: {{dir: {d}/{name}, {output_extra}}}
train: {{seq_len: 1024, global_batch: 8, micro_batch: 4, steps: {steps}, seed: 1, max_grad_norm: 1.0}}
optimizer: {{lr: 1.0e-5, weight_decay: 0.01{opt_extra}}}
schedule: {{kind: constant}}
runtime: {{workers: 1{runtime_extra}}}
""")


def spec_short_job(s, path, preset, steps, out_dir, runtime_extra):
    """The repeatability check's job: random init, 8 x 1,024 tokens, lr 1e-4 cosine, nothing saved."""
    s.write(path, f"""name: short
model: {{preset: {preset}, init_seed: 0}}
data: {{path: {ds()}/train}}
output: {{dir: {out_dir}, save_final: false}}
train: {{seq_len: 1024, global_batch: 8, micro_batch: 4, steps: {steps}, seed: 0, max_grad_norm: 1.0}}
optimizer: {{lr: 1.0e-4, weight_decay: 0.01}}
schedule: {{kind: cosine, warmup_steps: 0, min_lr: 1.0e-5}}
runtime: {{workers: 1{runtime_extra}}}
""")


def spec_eq(s, d, data, gpus, steps, runtime_extra):
    """d/job.yaml, the route-equivalence job (sessions E, I): Qwen3-0.6B, global batch 8, micro-batch
    2, lr 1e-5, FP32 weights saved in d/out/checkpoint-STEPS."""
    s.write(f"{d}/job.yaml", f"""name: eq
model: {{preset: qwen3-0.6b, init_seed: 0}}
data: {{path: {data}}}
output: {{dir: {d}/out, save_final: true, save_dtype: fp32}}
train: {{seq_len: 1024, global_batch: 8, micro_batch: 2, steps: {steps}, seed: 0, max_grad_norm: 1.0}}
optimizer: {{lr: 1.0e-5, weight_decay: 0.01}}
runtime: {{workers: {gpus}, act_policy: recompute{runtime_extra}}}
""")


def unit_lines(run_dir):
    """The workers' SLIDEDP_LOG_UNIT_NORMS=1 lines without the log prefix (compare_curves --first-units)."""
    out = []
    for root, _, files in sorted(os.walk(run_dir)):
        for name in sorted(files):
            with open(os.path.join(root, name), errors="replace") as f:
                out += [re.sub(r"^.*unit norms:", "unit norms:", line) for line in f if "unit norms:" in line]
    return "".join(out)


# ---------------------------------------------------------------------------------- parts

TINY_DATA = ("make_text_dataset", "--input", "examples/tiny/corpus.txt", "--output", "build/examples/tiny-data",
             "--repeat", "4")


def smoke(s):
    s.find_cudnn()
    s.stage("tiny_data", 60, *TINY_DATA)
    if not s.dry:
        shutil.rmtree("build/examples/tiny-out", ignore_errors=True)
    rc = s.stage("tiny_cuda", 150, "slidedp", "run", "examples/tiny/job.yaml", "--backend", "cuda",
                 "--run-dir", f"{s.part_dir}/tiny-run")
    s.judge("tiny", "--log", f"{s.part_dir}/tiny_cuda.log", "--rc", rc, "--max-loss", s.t("max_loss"),
            "--expect-steps", 120, "--run-dir", f"{s.part_dir}/tiny-run")


def families_spec(s, d, preset, lr="0.0", steps=3, eval_every=1):
    data = f"{s.root}/build/examples/tiny-data"
    s.write(f"{d}/job.yaml", f"""name: fam
model: {{preset: {preset}, init_seed: 2}}
data: {{path: {data}, validation: {data}}}
output: {{dir: {d}/out, save_final: false, tensorboard: true}}
train: {{seq_len: 128, global_batch: 8, micro_batch: 2, steps: {steps}, seed: 0, eval_every: {eval_every}}}
optimizer: {{lr: {lr}}}
runtime: {{workers: 1{opt(", ", s.k("FAMILIES_RUNTIME_EXTRA"))}}}
""")


def families(s):
    """Issue 24: each family's tiny preset through the whole pipeline, CUDA against the CPU backend."""
    s.find_cudnn()
    if not os.path.isfile("build/examples/tiny-data/manifest.json"):
        s.stage("tiny_data", 60, *TINY_DATA)
    pd, fam = s.part_dir, f"{s.work}/families"
    for preset in s.k("FAMILIES_PRESETS").split():
        for backend in ("cuda", "cpu"):
            d = f"{fam}/{preset}-{backend}"
            s.new_dir(d)
            if not s.dry:
                families_spec(s, d, preset)
            s.stage(f"eval_{preset}_{backend}", 150, "slidedp", "run", f"{d}/job.yaml", "--backend", backend,
                    "--run-dir", f"{d}/run")
            s.copy_metrics(f"{d}/out/metrics-*.jsonl", f"{pd}/{preset}-{backend}.jsonl")
        s.judge("eval-parity", "--cuda", f"{pd}/{preset}-cuda.jsonl", "--cpu", f"{pd}/{preset}-cpu.jsonl",
                "--tol", s.t("tol"), "--what", f"{preset} at lr 0")
        s.judge("grad-parity", "--cuda", f"{pd}/{preset}-cuda.jsonl", "--cpu", f"{pd}/{preset}-cpu.jsonl",
                "--tol", s.t("grad_tol"), "--what", preset)
        d = f"{fam}/{preset}-cuda"
        boards = sorted(os.listdir(f"{d}/out/tensorboard")) if os.path.isdir(f"{d}/out/tensorboard") else []
        job = boards[0] if boards else ""
        s.stage(f"tensorboard_{preset}", 60, "python3", "tools/gpu/tensorboard_check.py", "--events",
                f"{d}/out/tensorboard/{job}", "--metrics", f"{d}/out/metrics-{job}.jsonl")
        s.judge("stages", "--dir", pd, "--names", f"tensorboard_{preset}")
        d = f"{fam}/{preset}-train"
        s.new_dir(d)
        if not s.dry:
            families_spec(s, d, preset, lr="3.0e-3", steps=60, eval_every=30)
        rc = s.stage(f"train_{preset}", 150, "slidedp", "run", f"{d}/job.yaml", "--backend", "cuda", "--run-dir",
                     f"{d}/run")
        s.judge("tiny", "--log", f"{pd}/train_{preset}.log", "--rc", rc, "--max-loss", s.t("max_loss"),
                "--expect-steps", 60, "--run-dir", f"{d}/run")


def kernels(s):
    s.find_cudnn()
    xml = f"{s.part_dir}/xml"
    os.makedirs(xml, exist_ok=True)
    if s.k("KERNELS_CTEST") == "1":
        rc = s.stage("ctest_gpu", 540, "ctest", "--test-dir", s.k("KERNELS_BUILD_DIR"), "-L", "gpu",
                     "--output-on-failure", "--timeout", s.k("KERNELS_CAP"), "--output-junit", f"{xml}/ctest-gpu.xml")
        s.judge("gtest", "--xml-dir", xml, "--rc", f"ctest-gpu={rc}")
        return
    wrap = s.k("KERNELS_WRAP").split()
    filt = [f"--gtest_filter={s.k('KERNELS_FILTER')}"] if s.k("KERNELS_FILTER") else []
    s.note(f"each .gpu/tests/*_gpu_test: env SLIDEDP_SOURCE_DIR=$PWD SLIDEDP_BUILD_DIR=$PWD/.gpu {' '.join(wrap)} "
           f"BINARY --gtest_output=xml:{xml}/BINARY.xml {' '.join(filt)}")
    rcs = []
    for t in sorted(p for p in os.listdir(".gpu/tests") if p.endswith("_gpu_test")) \
            if os.path.isdir(".gpu/tests") else []:
        rc = s.stage(t, s.k("KERNELS_CAP"), "env", f"SLIDEDP_SOURCE_DIR={s.root}", f"SLIDEDP_BUILD_DIR={s.root}/.gpu",
                     "GTEST_COLOR=no", *wrap, f".gpu/tests/{t}", f"--gtest_output=xml:{xml}/{t}.xml", *filt)
        rcs += ["--rc", f"{t}={rc}"]
    s.judge("gtest", "--xml-dir", xml, *rcs, "--none-why",
            "no .gpu/tests/*_gpu_test: rebuild the bundle with tools/gpu/bundle.sh")


LAYOUT_HEADS = {"qwen3-0.6b": "16/8", "qwen3-1.7b": "16/8", "qwen3-4b": "32/8", "qwen3-8b": "32/8",
                "qwen3-14b": "40/8"}


def layouts(s):
    s.find_cudnn()
    s.text_dataset()
    d, preset, steps = f"{s.work}/layouts", s.k("LAYOUTS_PRESET"), int(s.k("LAYOUTS_STEPS"))
    if preset not in LAYOUT_HEADS:
        s.result("FAIL", f"LAYOUTS_PRESET={preset}: no head counts known")
        return
    s.new_dir(d)
    spec_finetune(s, d, f"preset: {preset}, init_seed: 0", steps, "")
    s.stage("layouts_batches", 120, "dump_batches", "--job", f"{d}/ft.yaml", "--out", f"{d}/layouts.bin")
    rc = s.stage("attn_layouts", s.k("LAYOUTS_CAP"), "attn_layouts_check", f"--attn-layouts={d}/layouts.bin",
                 f"--heads={LAYOUT_HEADS[preset]}", "--head-dim=128", "--mb-rows=4")
    # 8 rows per step in micro-batches of 4: two micro-batches a step
    s.judge("layouts", "--log", f"{s.part_dir}/attn_layouts.log", "--rc", rc, "--expect", steps * 2)


def hf(s):
    s.find_cudnn()
    pd, shapes = s.part_dir, s.k("HF_SHAPES")
    if not shapes:  # gpu_verify.sh: verify_py_test, hf_train_reference --selftest, hf_compare (logs into pd)
        s.stage("gpu_verify", 420, "env", f"OUT={pd}", "bash", "tools/verify/gpu_verify.sh", ".gpu")
        s.judge("stages", "--dir", pd, "--names", "verify_py_test,hf_train_selftest")
    else:  # only the comparison, on the shapes asked for
        s.stage("hf_compare", 420, "python3", "tools/verify/hf_compare.py", "--bin", ".gpu/bin/model_grads",
                "--work-dir", f"{s.work}/hfc", "--results", f"{pd}/hf_compare.jsonl", "--backends", "cuda,cpu",
                "--run-timeout", 90, "--shapes", shapes)
    s.judge("hf-compare", "--results", f"{pd}/hf_compare.jsonl", "--loss-tol", s.t("loss_tol"), "--grad-tol",
            s.t("grad_tol"), "--floor-factor", s.t("floor_factor"))
    rc = s.stage("ckpt_hf", 120, "python3", "tools/hf_checkpoint_check.py", "selftest", "--ckpt-tool",
                 ".gpu/bin/ckpt_tool")
    s.judge_exit("hf_checkpoint_check selftest (our checkpoints load in HF bit-exactly and back)", rc,
                 "must exit 0: every tensor equal")
    rc = s.stage("tokenizer_vs_hf", 180, "python3", "tools/tokenizer/compare_and_bench.py", "--tok-bench",
                 ".gpu/bin/tok_bench", "--tokenizer", "tests/data/tokenizer/qwen3/tokenizer.json", "--build-corpus", "",
                 "--fuzz-docs", 20000, "--fuzz-seed", 7, "--threads", nproc(), "--repeat", 1, "--corpus",
                 f"{s.work}/tok_fuzz.jsonl", "--mismatches", f"{pd}/tok_mismatches.jsonl", "--report",
                 f"{pd}/tok_report.json")
    s.judge("tokenizer", "--report", f"{pd}/tok_report.json", "--rc", rc)


def graddiff(s):
    s.find_cudnn()
    s.text_dataset()
    d = f"{s.work}/graddiff"
    s.new_dir(d)
    spec_short_pretrain(s, d, "qwen3-1.7b", 150)
    # One fine-tuning step saving its FP32 checkpoint, then step 1's batch (0-based) from the same
    # sampler: the gradients of fine-tune step 2 on the weights after step 1 (sessions 4-6).
    spec_finetune(s, d, f"path: {d}/pre/checkpoint-150", 1, "", "save_every: 1, save_dtype: fp32, keep_last: 1")
    s.stage("gd_pretrain", 240, "slidedp", "run", f"{d}/pre.yaml", "--backend", "cuda", "--run-dir", f"{d}/run-pre")
    s.sh(["rm", "-f", f"{d}/pre/checkpoint-150/optimizer.safetensors"])  # disk: the fine-tune reads the weights
    s.stage("gd_finetune", 150, "slidedp", "run", f"{d}/ft.yaml", "--backend", "cuda", "--run-dir", f"{d}/run-ft")
    s.sh(["bash", "-c", f'rm -f "{d}"/ft/checkpoint-*/optimizer.safetensors'])
    s.stage("gd_batches", 60, "dump_batches", "--job", f"{d}/ft.yaml", "--steps", 2, "--out", f"{d}/batches.bin")
    rc = s.stage("grad_diff", 330, "python3", "tools/verify/grad_diff.py", "--bin", which("model_grads"), "--model",
                 f"{d}/ft/checkpoint-1", "--batches", f"{d}/batches.bin", "--step", 1, "--top", 20)
    s.judge("graddiff", "--log", f"{s.part_dir}/grad_diff.log", "--rc", rc, "--loss-tol", s.t("loss_tol"),
            "--norm-tol", s.t("norm_tol"), "--what", "Qwen3-1.7B fine-tune step 2, ours vs HF autocast on our weights")
    if not s.dry:
        shutil.rmtree(d, ignore_errors=True)  # ~35 GB of checkpoints


CURVES_BY_MODEL = {  # pretrain steps, deterministic, HF references (the first is the gate)
    "qwen3-0.6b": ("250", "0", "bf16-autocast bf16-mirror-fp32-norms"),  # session 5: 3.5e-4
    "qwen3-1.7b": ("160", "1", "bf16-autocast"),  # session 8: 4.5e-4 on the deterministic pretrain
}


def curves_data(s, model):
    """A Llama 3 preset trains on text in Llama 3's vocabulary; the tiny presets (512 tokens) on the
    same Python sources, one token per byte (exported: later parts of the call use it too)."""
    if model.startswith("llama3"):
        os.environ.update(SUITE_DS="/tmp/ds-llama3", SUITE_TOKENIZER="tests/data/chat_templates/llama3")
    elif model.startswith("tiny"):
        os.environ["SUITE_DS"] = "/tmp/ds-bytes"
        if not os.path.isfile("/tmp/ds-bytes/.ready") and not s.dry:
            s.sh(["bash", "-c", "find /usr/lib/python3* -name '*.py' -size +1k 2> /dev/null | sort | head -n 3000 | "
                  "xargs cat > /tmp/corpus-bytes.txt"])
            if s.stage("bytes_dataset", 90, "make_text_dataset", "--input", "/tmp/corpus-bytes.txt", "--output",
                       "/tmp/ds-bytes/train", "--seq-len", 1024) == 0:
                open("/tmp/ds-bytes/.ready", "w").close()
    s.text_dataset()


def compare(s, a, b, tol, name):
    s.sh(["python3", "tools/verify/compare_curves.py", a, b, "--tol", tol, "--json", f"{s.part_dir}/{name}.json"],
         out_file=f"{s.part_dir}/{name}.log")


def curves(s):
    s.find_cudnn()
    model, pd = s.k("CURVES_MODEL"), s.part_dir
    curves_data(s, model)
    # issue 23: eager attention gives HF's own spread
    moe = model == "tiny-moe" or model.endswith("-a3b") or model.endswith("-moe") or "gpt-oss" in model
    pre, det, refs = CURVES_BY_MODEL.get(model, ("160", "0", "bf16-autocast bf16-autocast-eager" if moe
                                                 else "bf16-autocast"))
    tol = s.t("moe_tol") if moe else s.t("tol")
    pre, det, refs = s.k("CURVES_PRE") or pre, s.k("CURVES_DET") or det, (s.k("CURVES_REFS") or refs).split()
    steps = s.k("CURVES_STEPS")
    deadline = int(s.k("CURVES_DEADLINE") or s.deadline - 25)
    d, extra = f"{s.work}/curves-{model}", ", deterministic: true" if det == "1" else ""
    s.new_dir(d)
    spec_stable_pretrain(s, d, model, pre, extra, s.k("CURVES_LAYERS"))
    src = f"{d}/pre/checkpoint-{pre}"
    spec_finetune(s, d, f"path: {src}", steps, extra)
    s.stage("curves_pretrain", 330, "slidedp", "run", f"{d}/pre.yaml", "--backend", "cuda", "--run-dir", f"{d}/run-pre")
    s.copy_metrics(f"{d}/pre/metrics-*.jsonl", f"{pd}/pretrain.jsonl")
    s.sh(["rm", "-f", f"{src}/optimizer.safetensors"])
    s.stage("curves_ours", 300, "slidedp", "run", f"{d}/ft.yaml", "--backend", "cuda", "--run-dir", f"{d}/run-ft")
    s.copy_metrics(f"{d}/ft/metrics-*.jsonl", f"{pd}/ours.jsonl")
    bf16 = s.k("CURVES_BF16_GRADS") == "1"
    if bf16:  # issue 20: the same fine-tune with runtime.grad_dtype bf16
        if not s.dry:
            spec_finetune(s, d, f"path: {src}", steps, ", grad_dtype: bf16" + extra, name="ftbf16")
        s.stage("curves_ours_bf16", 300, "slidedp", "run", f"{d}/ft-bf16.yaml", "--backend", "cuda", "--run-dir",
                f"{d}/run-ft-bf16")
        s.copy_metrics(f"{d}/ftbf16/metrics-*.jsonl", f"{pd}/ours-bf16.jsonl")
    states = s.k("CURVES_STATES").split()
    for st in states:  # issue 21: the same fine-tune with optimizer.state_dtype st
        if not s.dry:
            spec_finetune(s, d, f"path: {src}", steps, extra, name=f"ft{st}", opt_extra=f", state_dtype: {st}")
        s.stage(f"curves_ours_{st}", 300, "slidedp", "run", f"{d}/ft-{st}.yaml", "--backend", "cuda", "--run-dir",
                f"{d}/run-ft-{st}")
        s.copy_metrics(f"{d}/ft{st}/metrics-*.jsonl", f"{pd}/ours-{st}.jsonl")
    s.stage("curves_batches", 60, "dump_batches", "--job", f"{d}/ft.yaml", "--out", f"{d}/batches.bin")
    for ref in refs:
        prec = ref.removesuffix("-eager")
        cap, left = int(s.k("CURVES_HF_CAP")), deadline - s.seconds()
        cap = min(cap, left)
        if cap < 30 and not s.dry:
            s.say(f"--- HF {ref}: not started, {left} s left before CURVES_DEADLINE")
            continue
        s.stage(f"hf_{ref}", cap, "python3", "tools/verify/hf_train_reference.py", "--batches", f"{d}/batches.bin",
                "--model", src, "--precision", prec, "--attn", "sdpa" if prec == ref else "eager", "--out",
                f"{pd}/hf-{ref}.json")
    first, size = refs[0], model.removeprefix("qwen3-")
    what = f"Qwen3-{size.upper()} {steps} steps, pretrain {pre}" if size != model else \
        f"{model} {steps} steps, pretrain {pre}"
    what += " (deterministic)" if det == "1" else ""
    compare(s, f"{pd}/ours.jsonl", f"{pd}/hf-{first}.json", tol, f"cmp-ours-{first}")
    s.judge("curve", "--json", f"{pd}/cmp-ours-{first}.json", "--expect-steps", steps, "--what",
            f"ours vs HF {first}, {what}")
    if bf16:
        compare(s, f"{pd}/ours-bf16.jsonl", f"{pd}/hf-{first}.json", tol, f"cmp-ours-bf16-{first}")
        s.judge("curve", "--info", "--json", f"{pd}/cmp-ours-bf16-{first}.json", "--expect-steps", steps, "--what",
                f"ours with runtime.grad_dtype bf16 vs HF {first} (FP32 gradients), {what}")
    for st in [] if s.dry else states:  # compact moments against ours with FP32 moments (the same batches)
        compare(s, f"{pd}/ours-{st}.jsonl", f"{pd}/ours.jsonl", s.t("states_tol"), f"cmp-ours-{st}")
        s.judge("curve", "--json", f"{pd}/cmp-ours-{st}.json", "--expect-steps", steps, "--what",
                f"ours with optimizer.state_dtype {st} vs ours fp32, {what} (issue 21: max |dloss| <= "
                f"{s.t('states_tol')})")
        s.judge("final-loss", "--a", f"{pd}/ours-{st}.jsonl", "--b", f"{pd}/ours.jsonl", "--state", st, "--rel",
                s.t("states_final_rel"))
    for ref in refs[1:]:
        compare(s, f"{pd}/ours.jsonl", f"{pd}/hf-{ref}.json", tol, f"cmp-ours-{ref}")
        compare(s, f"{pd}/hf-{ref}.json", f"{pd}/hf-{first}.json", tol, f"cmp-{ref}-{first}")
        s.judge("curve", "--info", "--json", f"{pd}/cmp-ours-{ref}.json", "--expect-steps", steps, "--what",
                f"ours vs HF {ref}")
        s.judge("curve", "--info", "--json", f"{pd}/cmp-{ref}-{first}.json", "--expect-steps", steps, "--what",
                f"HF {ref} vs HF {first} (the reference's own spread)")
    if not s.dry:
        shutil.rmtree(f"{d}/pre", ignore_errors=True)
        s.sh(["rm", "-f", f"{d}/batches.bin"])


def determinism(s):
    s.find_cudnn()
    s.text_dataset()
    model, steps, d, pd = s.k("DET_MODEL"), s.k("DET_STEPS"), f"{s.work}/determinism", s.part_dir
    s.new_dir(d)
    for run in ("a", "b"):
        spec_short_job(s, f"{d}/{run}.yaml", model, steps, f"{d}/out-{run}", ", deterministic: true")
        s.stage(f"det_{run}", 240, "env", "SLIDEDP_LOG_UNIT_NORMS=1", "slidedp", "run", f"{d}/{run}.yaml", "--backend",
                "cuda", "--run-dir", f"{d}/run-{run}")
        s.copy_metrics(f"{d}/out-{run}/metrics-*.jsonl", f"{pd}/det-{run}.jsonl")
        if not s.dry:
            s.write(f"{pd}/det-{run}-units.txt", unit_lines(f"{d}/run-{run}"))
    s.sh(["python3", "tools/verify/compare_curves.py", f"{pd}/det-a.jsonl", f"{pd}/det-b.jsonl", "--tol", "0",
          "--bitwise", "--first-units", f"{pd}/det-a-units.txt", "--second-units", f"{pd}/det-b-units.txt", "--json",
          f"{pd}/cmp-det.json"], out_file=f"{pd}/cmp-det.log")
    s.judge("bitwise", "--json", f"{pd}/cmp-det.json", "--expect-steps", steps, "--units-a", f"{pd}/det-a-units.txt",
            "--units-b", f"{pd}/det-b-units.txt", "--what", f"{model}, runtime.deterministic, run twice")
    # the same job without the switch once: its step times beside the deterministic ones (figures)
    spec_short_job(s, f"{d}/c.yaml", model, steps, f"{d}/out-c", "")
    s.stage("det_default", 240, "slidedp", "run", f"{d}/c.yaml", "--backend", "cuda", "--run-dir", f"{d}/run-c")
    s.copy_metrics(f"{d}/out-c/metrics-*.jsonl", f"{pd}/default.jsonl")
    s.judge("step-times", "--det", f"{pd}/det-a.jsonl", "--default", f"{pd}/default.jsonl", "--model", model)


def offload(s):
    s.find_cudnn()
    logs = []
    for r in ("0", "0.5", "1"):
        s.stage(f"offload_{r}", 150, "bench_step", "--model", s.k("OFFLOAD_MODEL"), "--seq", 4096, "--tokens", 65536,
                "--micro-batch-rows", 4, "--steps", 3, "--offload-ratio", r, "--gpu", 0)
        logs.append(f"{s.part_dir}/offload_{r}.log")
    s.judge("offload", "--logs", *logs)


def routes(s):
    s.find_cudnn()
    steps, d, pd = int(s.k("ROUTES_STEPS")), f"{s.work}/routes", s.part_dir
    s.new_dir(d)
    s.stage("routes_data", 60, "python3", "bench/e2e/make_dataset.py", "--out", f"{d}/data", "--rows", 8 * steps,
            "--seq-len", 1024, "--vocab", 151936)
    # (name, GPUs, runtime keys); the first is the reference
    runs = [("g1-host", 1, ", grad_staging: host"), ("g1-device", 1, ", grad_staging: device")]
    if s.gpus >= 2:
        runs += [("g2-gpu", 2, ", grad_reduction: gpu"), ("g2-gpu-host", 2, ", grad_reduction: gpu, grad_staging: host"),
                 ("g2-sharded", 2, ", grad_reduction: gpu, param_delivery: sharded"),
                 ("g2-cpu", 2, ", grad_reduction: cpu")]
    else:
        s.result("SKIP", f"the 2-GPU routes (gpu, gpu + host staging, sharded delivery, cpu): {s.gpus} GPU visible")
    for name, g, extra in runs:
        os.makedirs(f"{d}/{name}", exist_ok=True)
        spec_eq(s, f"{d}/{name}", f"{d}/data", g, steps, extra)
        s.stage(f"routes_{name}", 150, "env", f"CUDA_VISIBLE_DEVICES={gpu_list(g)}", "slidedp", "run",
                f"{d}/{name}/job.yaml", "--backend", "cuda", "--run-dir", f"{d}/{name}/run")
        s.copy_metrics(f"{d}/{name}/out/metrics-*.jsonl", f"{pd}/{name}.jsonl")
        s.sh(["bash", "-c", f'rm -f "{d}/{name}"/out/checkpoint-*/optimizer.safetensors'])
    ref = "g1-host"
    for name, _, _ in runs[1:]:
        s.sh(["python3", "tools/verify/compare_curves.py", f"{pd}/{ref}.jsonl", f"{pd}/{name}.jsonl", "--tol",
              s.t("loss_tol"), "--json", f"{pd}/cmp-{name}.json"], out_file=f"{pd}/cmp-{name}.log")
        s.sh(["python3", "tools/verify/compare_params.py", f"{d}/{name}/out/checkpoint-{steps}",
              f"{d}/{ref}/out/checkpoint-{steps}", "--tol-rel", s.t("weight_tol"), "--json",
              f"{pd}/params-{name}.json"], out_file=f"{pd}/params-{name}.log")
        s.judge("curve", "--json", f"{pd}/cmp-{name}.json", "--expect-steps", steps, "--what",
                f"{name} vs {ref}, loss, {steps} steps")
        s.judge("params", "--json", f"{pd}/params-{name}.json", "--tol", s.t("weight_tol"), "--what",
                f"{name} vs {ref}, FP32 weights")
    if not s.dry:
        shutil.rmtree(d, ignore_errors=True)


def state(s):
    """Issue 21: the compact-moment kernels' tests on this host's ISA (AVX-512), then LayerAdam's rate
    with each moment layout, with and without the mirror's stores."""
    xml, rcs = f"{s.part_dir}/xml", []
    os.makedirs(xml, exist_ok=True)
    for t in ("adam_state_test", "adam_engine_test", "adam_kernels_test"):
        rc = s.stage(t, 200, "env", "GTEST_COLOR=no", f".gpu/tests/{t}", f"--gtest_output=xml:{xml}/{t}.xml")
        rcs += ["--rc", f"{t}={rc}"]
    s.judge("gtest", "--xml-dir", xml, *rcs, "--none-why", "no .gpu/tests/adam_state_test: rebuild the bundle")
    mirrors = s.k("STATE_MIRRORS")
    for ms in mirrors.split():
        for st in ("fp32", "bf16", "int8"):
            s.stage(f"layeradam_{st}_{ms}", 150, "bench_layeradam", "--params", s.k("STATE_PARAMS"), "--state", st,
                    "--mirror-store", ms)
    s.judge("layeradam-states", "--dir", s.part_dir, "--mirrors", mirrors, "--int8", s.t("int8"))


def kbench(s):
    s.find_cudnn()
    quick = ["--quick"] if s.k("KBENCH_QUICK") == "1" else []
    rc = s.stage("bench_kernels", 300, "bench_kernels", *quick)
    s.judge("kbench", "--log", f"{s.part_dir}/bench_kernels.log", "--rc", rc, "--t-fwd", s.t("t_fwd"), "--t-bwd",
            s.t("t_bwd"), "--t-layer", s.t("t_layer"))
    s.stage("torch_sdpa", 200, "python3", "bench/kernels/torch_sdpa.py", *quick)
    s.judge("sdpa", "--log", f"{s.part_dir}/torch_sdpa.log")


def moebench(s):
    """One sparse decoder layer of Qwen3-30B-A3B per MOEBENCH_TOKENS (bench_kernels --moe): figures."""
    s.find_cudnn()
    for t in s.k("MOEBENCH_TOKENS").split():
        s.stage(f"moebench_{t}", 200, "bench_kernels", "--moe", t, *s.k("MOEBENCH_PRESET").split())
        if not s.dry:
            with open(f"{s.part_dir}/moebench_{t}.log", errors="replace") as f:
                s.summary_lines("".join(line for line in f if re.match(r"(moe_|bench_kernels|   \()", line)))


RECIPES = {"smoke": smoke, "families": families, "kernels": kernels, "layouts": layouts, "hf": hf,
           "graddiff": graddiff, "curves": curves, "determinism": determinism, "offload": offload, "routes": routes, "state": state,
           "kbench": kbench, "moebench": moebench}
