"""The GPU suite's recipes, part 2: the parts that run whole jobs through bench/e2e/run_bench.sh or a
node service (hostd + CUDA workers) and compare them with their peers. Same shape as
suite_recipes.py: a function of the running Suite `s` per part, knobs from s.k, thresholds from s.t."""
import os
import re
import shutil
import subprocess
import time

from suite_recipes import nproc, opt, which, yarn
from suite_recipes_longctx import longctx  # (its own module: three stages and their folders)


class Service:
    """A node service in folder d: slidedp-hostd on d/hostd.sock (state in d/state), CUDA workers,
    SLIDEDP_HOSTD exported for the slidedp commands until stop()."""

    def __init__(self, s, d, hostd_log, append=False):
        self.s, self.d, self.sock, self.workers = s, d, f"unix:{d}/hostd.sock", []
        self.start_hostd(hostd_log, append)
        time.sleep(2)

    def start_hostd(self, log, append=False):
        with open(log, "a" if append else "w") as f:
            self.hostd = subprocess.Popen(["slidedp-hostd", "--listen", self.sock, "--state-dir", f"{self.d}/state",
                                           "--output-root", self.d], stdout=f, stderr=subprocess.STDOUT)

    def worker(self, gpu, log, visible=None, wid=None):
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}))
        with open(log, "w") as f:
            self.workers.append(subprocess.Popen(["slidedp-worker", "--hostd", self.sock, "--gpu", str(gpu)]
                                                 + (["--id", wid] if wid else []), stdout=f,
                                                 stderr=subprocess.STDOUT, env=env))

    def wait_workers(self, word, count, tries):
        """Until `slidedp workers` lists count lines with word (at most tries seconds)."""
        os.environ["SLIDEDP_HOSTD"] = self.sock
        for _ in range(tries):
            r = subprocess.run(["slidedp", "workers"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            if sum(word in line for line in r.stdout.splitlines()) >= count:
                return
            time.sleep(1)

    def kill_hostd(self):
        self.hostd.kill()
        self.hostd.wait()

    def stop(self):
        for p in self.workers + [self.hostd]:
            p.terminate()
        for p in self.workers + [self.hostd]:
            p.wait()
        os.environ.pop("SLIDEDP_HOSTD", None)


def copy_run_logs(s, w, variants):
    """The run_bench runs' hostd and worker logs, for the details."""
    for v in variants:
        s.copy_globs(f"{w}/{v}/runs/*/*/*/*/ours/run/*.log", f"{s.part_dir}/logs/{v}")


# ---------------------------------------------------------------------------------- parts

def routespeed(s):
    """Issue 26: which gradient route and parameter delivery win where, and what `auto` picks: on a node
    service, `slidedp plan --measure` of a spec whose routes are auto (hostd measures every route the
    workers can run, each by its own AutoPolicy job); routes_check.py reads the jobs' metrics."""
    g = int(s.k("ROUTESPEED_GPUS"))
    if s.gpus < g or g < 2:
        s.result("SKIP", f"needs {g} GPUs (nvidia-h200-x2), {s.gpus} visible")
        return
    s.find_cudnn()
    d, pd, cases = f"{s.work}/routespeed", s.part_dir, []
    s.new_dir(d)
    tokens = [int(t) for t in s.k("ROUTESPEED_TOKENS").split()]
    # 16 steps is the measuring job's most (it ends after ~6); the largest batch sizes the dataset
    s.stage("routespeed_data", 120, "python3", "bench/e2e/make_dataset.py", "--out", f"{d}/data", "--rows",
            g * max([0] + tokens) // 4096 * 16, "--seq-len", 4096, "--vocab", 151936)
    for model in s.k("ROUTESPEED_MODELS").split():
        for t in tokens:
            name, rows, micro = f"{model}-{t}", g * t // 4096, min(4, t // 4096)
            s.write(f"{d}/{name}.yaml", f"""name: rs-{name}
model: {{preset: {model}, init_seed: 0}}
data: {{path: {d}/data}}
output: {{dir: {d}/out-{name}, save_final: false}}
train: {{seq_len: 4096, global_batch: {rows}, micro_batch: {micro}, steps: 16, max_grad_norm: {s.k("ROUTESPEED_MAX_GRAD_NORM")}}}
optimizer: {{lr: 1.0e-5, weight_decay: 0.01}}
runtime: {{workers: {g}, grad_reduction: auto, param_delivery: auto{opt(", ", s.k("ROUTESPEED_RUNTIME_EXTRA"))}}}
""")
            cases.append(name)
    if s.dry:
        s.note(f"routespeed: slidedp-hostd + slidedp-worker --gpu 0..{g - 1}; per case: slidedp plan --measure")
        s.note(f"routespeed: CASE.yaml --json CASE.plan.json; routes_check.py --cases {' '.join(cases)}")
        return
    svc = Service(s, d, f"{pd}/hostd.log")
    for i in range(g):
        svc.worker(i, f"{pd}/worker{i}.log")
    svc.wait_workers("gpu", g, 90)
    for name in cases:
        s.stage(f"routespeed_{name}", s.left(), "slidedp", "plan", "--measure", f"{d}/{name}.yaml", "--json",
                f"{pd}/{name}.plan.json")
        s.copy_globs(f"{d}/out-{name}/metrics-*.jsonl", f"{pd}/{name}")
    svc.stop()
    s.check("tools/gpu/routes_check.py", "--dir", pd, "--cases", *cases, "--json", f"{pd}/routes.json",
            "--part", s.part)
    shutil.rmtree(d, ignore_errors=True)


def bench(s):
    """Ours and compute-only at the bench's batch, then the peers (and ours at the peers' batch, for the
    same-batch CPU-offload ratio) in the same WORK, so that report.py sees one run."""
    s.find_cudnn()
    model, tokens, peer, w = s.k("BENCH_MODEL"), s.k("BENCH_TOKENS"), s.k("BENCH_PEER_TOKENS"), f"{s.work}/bench"
    offload = s.k("BENCH_OFFLOAD") or ("1" if model == "qwen3-4b" else "0")
    ours = dict(ACT_POLICY=s.k("BENCH_POLICY"), RUNTIME_EXTRA=s.k("BENCH_RUNTIME_EXTRA"),
                MAX_GRAD_NORM=s.k("BENCH_MAX_GRAD_NORM"))
    s.run_bench("bench_ours", OUT=s.part_dir, MODEL=model, GPUS=1, TOKENS_LIST=tokens, WHAT="ours compute", **ours,
                WORK=w, FRESH=1)
    s.run_bench("bench_peers", OUT=s.part_dir, MODEL=model, GPUS=1, TOKENS_LIST=peer,
                WHAT="ours fsdp2 fsdp2-offload" if offload == "1" else "fsdp2", **ours, WORK=w, RESUME=1)
    s.judge("bench", "--results", f"{s.part_dir}/bench-results.json", "--model", model, "--tokens", tokens,
            "--peer-tokens", peer, *(["--offload"] if offload == "1" else []))


def clip(s):
    """Issue 20: clipping that keeps the host hidden. Each variant of ours in its own WORK (report.py
    keys results by model, tokens and kind), the peers in one more; clip_check.py judges them."""
    s.find_cudnn()
    model, tokens, w, policy = s.k("CLIP_MODEL"), s.k("CLIP_TOKENS"), f"{s.work}/clip", s.k("CLIP_POLICY")
    for v in s.k("CLIP_VARIANTS").split():
        name, norm, extra = (v.split(":", 2) + ["", ""])[:3]
        st = "fp32"
        if extra.startswith("state_dtype="):  # (the optimizer's key, not a runtime one)
            st, extra = extra[len("state_dtype="):], ""
        s.run_bench(f"clip_{name}", OUT=f"{s.part_dir}/{name}", MODEL=model, GPUS=1, TOKENS_LIST=tokens, WHAT="ours",
                    MAX_GRAD_NORM=norm, RUNTIME_EXTRA=extra.replace("=", ": ", 1), STATE_DTYPE=st, ACT_POLICY=policy,
                    WORK=f"{w}/{name}", FRESH=1)
    s.run_bench("clip_peers", OUT=f"{s.part_dir}/peers", MODEL=model, GPUS=1, TOKENS_LIST=tokens,
                WHAT=s.k("CLIP_PEERS"), ACT_POLICY=policy, WORK=f"{w}/peers", FRESH=1)
    if not s.dry:
        s.check("tools/gpu/clip_check.py", "--dir", s.part_dir, "--model", model, "--tokens", tokens)


def specbits(s):
    """Speculative clipping on CUDA is the path that waits for the norm, bit for bit."""
    s.find_cudnn()
    w = f"{s.work}/specbits"
    for norm in ("1e4", "1e-3"):
        for v, sb in (("auto", "-1"), ("wait", "0")):
            s.run_bench(f"specbits_{norm}_{v}", OUT=f"{s.part_dir}/{norm}_{v}", MODEL="qwen3-0.6b", GPUS=1,
                        TOKENS_LIST=16384, STEPS=6, WHAT="ours", MAX_GRAD_NORM=norm, ACT_POLICY="recompute",
                        RUNTIME_EXTRA=f"deterministic: true, speculation_bytes: {sb}", WORK=f"{w}/{norm}_{v}", FRESH=1)
    for norm in ("1e4", "1e-3"):
        s.judge("specbits", "--auto", f"{w}/{norm}_auto", "--wait", f"{w}/{norm}_wait", "--norm", norm)


MASTERSRC_KEYS = {"mirror": "param_source: mirror", "master_device": "param_source: master, cast_on: device",
                  "master_host": "param_source: master, cast_on: host"}


def mastersrc(s):
    """Issue 21: mirror-free delivery, the master cast on the GPU or on the host: the mirror's bits
    (deterministic losses bitwise equal) and what the casts cost at a fine-tuning batch."""
    s.find_cudnn()
    w, variants = f"{s.work}/mastersrc", s.k("MASTERSRC_VARIANTS").split()
    for v in variants:
        if v not in MASTERSRC_KEYS:
            s.result("FAIL", f"unknown variant {v} (mirror master_device master_host)")
            return
        s.run_bench(f"mastersrc_bits_{v}", OUT=f"{s.part_dir}/bits_{v}", MODEL="qwen3-0.6b", GPUS=1,
                    TOKENS_LIST=16384, STEPS=6, WHAT="ours", MAX_GRAD_NORM="1.0", ACT_POLICY="recompute",
                    RUNTIME_EXTRA=f"deterministic: true, {MASTERSRC_KEYS[v]}", WORK=f"{w}/bits_{v}", FRESH=1)
    for v in variants:
        s.run_bench(f"mastersrc_speed_{v}", OUT=f"{s.part_dir}/speed_{v}", MODEL=s.k("MASTERSRC_MODEL"), GPUS=1,
                    TOKENS_LIST=s.k("MASTERSRC_TOKENS"), WHAT="ours", MAX_GRAD_NORM=0, ACT_POLICY="auto",
                    RUNTIME_EXTRA=MASTERSRC_KEYS[v], WORK=f"{w}/speed_{v}", FRESH=1)
    s.judge("mastersrc", "--work", w, "--variants", " ".join(variants))


def big(s):
    """Issue 21's capacity target: BIG_MODEL with int8 moments and no BF16 mirror, with and without
    clipping, against compute-only in the same call."""
    s.find_cudnn()
    model, tokens, w, gpus = s.k("BIG_MODEL"), s.k("BIG_TOKENS"), f"{s.work}/big", int(s.k("BIG_GPUS"))
    if s.gpus < gpus:
        s.result("SKIP", f"BIG_GPUS={gpus} needs {gpus} GPUs, {s.gpus} visible")
        return
    for v in s.k("BIG_VARIANTS").split():
        name, norm = v.split(":", 1)[0], v.split(":", 1)[-1]
        s.run_bench(f"big_{name}", OUT=f"{s.part_dir}/{name}", MODEL=model, GPUS=gpus, TOKENS_LIST=tokens,
                    WHAT="ours", MAX_GRAD_NORM=norm, STATE_DTYPE=s.k("BIG_STATE_DTYPE"), ACT_POLICY=s.k("BIG_POLICY"),
                    RUNTIME_EXTRA="param_source: master" + opt(", ", s.k("BIG_RUNTIME_EXTRA")),
                    STEPS=s.k("BIG_STEPS"), WORK=f"{w}/{name}", FRESH=1)
    s.run_bench("big_compute", OUT=f"{s.part_dir}/compute", MODEL=model, GPUS=1, TOKENS_LIST=tokens, WHAT="compute",
                ACT_POLICY=s.k("BIG_POLICY"), STEPS=s.k("BIG_STEPS"), WORK=f"{w}/compute", FRESH=1)
    s.judge("big", "--work", w, "--model", model, "--tokens", tokens, "--gpus", gpus, "--state-dtype",
            s.k("BIG_STATE_DTYPE"), "--compute", s.t("compute"), "--host-gib-per-b", s.t("host_gib_per_b"))


def memlimit(s):
    """Issue 22: runtime.gpu_memory_limit; the limited run's peak under the limit and its speed."""
    s.find_cudnn()
    model, tokens, limit, w = s.k("MEMLIMIT_MODEL"), s.k("MEMLIMIT_TOKENS"), s.k("MEMLIMIT"), f"{s.work}/memlimit"
    for v in ("free", "limited"):
        extra = s.k("MEMLIMIT_RUNTIME_EXTRA")
        if v == "limited":
            extra = (extra + ", " if extra else "") + f"gpu_memory_limit: {limit}"
        s.run_bench(f"memlimit_{v}", OUT=f"{s.part_dir}/{v}", MODEL=model, GPUS=1, TOKENS_LIST=tokens, WHAT="ours",
                    MAX_GRAD_NORM=0, ACT_POLICY=s.k("MEMLIMIT_ACT_POLICY"), RUNTIME_EXTRA=extra,
                    STEPS=s.k("MEMLIMIT_STEPS"), WORK=f"{w}/{v}", FRESH=1)
    if not s.dry:
        copy_run_logs(s, w, ("free", "limited"))
    s.judge("memlimit", "--work", w, "--model", model, "--tokens", tokens, "--limit", limit, "--steady-from",
            s.k("MEMLIMIT_STEADY_FROM"), "--speed", s.t("speed"))


def policy_file():
    """A 28-layer Qwen3-0.6B layout: each kind in turn; the first 9 layers offload all, half or a
    quarter of their checkpoints (inputs and kept pieces), the rest none."""
    kinds, shares = ["recompute", "selective", "keep_all"], ["true", "0.5", "0.25"]
    layers = [f"  - {{kind: {kinds[i % 3]}{', offload: ' + shares[i // 3] if i < 9 else ''}}}" for i in range(28)]
    return ("version: 1\nmodel: {hidden_size: 1024, num_hidden_layers: 28, num_attention_heads: 16, "
            "num_key_value_heads: 8, head_dim: 128, intermediate_size: 3072, vocab_size: 151936}\nlayers:\n"
            + "\n".join(layers) + "\n")


def policy(s):
    """Issue 22: a per-layer layout (runtime.policy file) on CUDA against whole-layer recompute."""
    s.find_cudnn()
    w = f"{s.work}/policy"
    s.write(f"{w}/mixed.yaml", policy_file())
    for v in ("recompute", "mixed"):
        extra = "deterministic: true" + (f", policy: {w}/mixed.yaml" if v == "mixed" else "")
        s.run_bench(f"policy_{v}", OUT=f"{s.part_dir}/{v}", MODEL="qwen3-0.6b", GPUS=1, TOKENS_LIST=16384, STEPS=6,
                    WHAT="ours", MAX_GRAD_NORM="1.0", ACT_POLICY="recompute", RUNTIME_EXTRA=extra, WORK=f"{w}/{v}",
                    FRESH=1)
    s.judge("policy", "--work", w, "--loss-tol", s.t("loss_tol"))


def autopolicy(s):
    """Issue 22: AutoPolicy. Each variant of ours in its own WORK; auto and cached share one policy
    cache (XDG_CACHE_HOME: slidedp run's default)."""
    s.find_cudnn()
    model, tokens, peer, w = s.k("AP_MODEL"), s.k("AP_TOKENS"), s.k("AP_PEER_TOKENS"), f"{s.work}/autopolicy"
    variants = s.k("AP_VARIANTS").split()
    s.new_dir(w)
    for v in ("auto", "cached", "today"):
        if v not in variants:
            continue
        act, extra, sweep = "recompute", "policy: auto", "0"
        steps = s.k("AP_STEPS") or ("20" if s.k("AP_SWEEP") == "1" else "8")
        if v == "auto":
            sweep = s.k("AP_SWEEP")
        if v == "today":
            act, extra, steps = "auto", "", "4"
        if v == "cached":
            steps = "4"
        if s.k("AP_RUNTIME_EXTRA"):
            extra = (extra + ", " if extra else "") + s.k("AP_RUNTIME_EXTRA")
        s.run_bench(f"autopolicy_{v}", SLIDEDP_AUTOPOLICY_SWEEP=sweep, OUT=f"{s.part_dir}/{v}", MODEL=model, GPUS=1,
                    TOKENS_LIST=tokens, WHAT="ours", ACT_POLICY=act, RUNTIME_EXTRA=extra, STEPS=steps,
                    MAX_GRAD_NORM=s.k("AP_MAX_GRAD_NORM"), STATE_DTYPE=s.k("AP_STATE_DTYPE"), XDG_CACHE_HOME=w,
                    WORK=f"{w}/{v}", FRESH=1)
    s.copy_globs(f"{w}/slidedp/policies/*.yaml", f"{s.part_dir}/cache")
    if "peer" in variants:
        s.run_bench("autopolicy_peer", OUT=f"{s.part_dir}/peer", MODEL=model, GPUS=1, TOKENS_LIST=peer, WHAT="fsdp2",
                    WORK=f"{w}/peer", FRESH=1)
    if s.dry:
        return
    s.copy_globs(f"{w}/slidedp/policies/*.yaml", f"{w}/cache")
    copy_run_logs(s, w, ("auto", "cached", "today"))
    s.check("tools/gpu/autopolicy_check.py", "--dir", s.part_dir, "--work", w, "--model", model, "--tokens", tokens,
            "--peer-tokens", peer)


def plan(s):
    """Issue 22: `slidedp plan` against the job it predicts, on a node service with one CUDA worker."""
    s.find_cudnn()
    d, pd, model, steps = f"{s.work}/plan", s.part_dir, s.k("PLAN_MODEL"), s.k("PLAN_STEPS")
    tokens, policies = s.k("PLAN_TOKENS").split(), s.k("PLAN_POLICIES").split()
    s.new_dir(d)
    s.stage("plan_data", 120, "python3", "bench/e2e/make_dataset.py", "--out", f"{d}/data", "--rows", 256,
            "--seq-len", 4096, "--vocab", 151936)
    for t in tokens:
        for pol in policies:
            rows = int(t) // 4096
            runtime = "policy: auto" if pol == "auto" else f"act_policy: {pol}"
            s.write(f"{d}/{t}-{pol}.yaml", f"""name: plan-{t}-{pol}
model: {{preset: {model}, init_seed: 0}}
data: {{path: {d}/data}}
output: {{dir: {d}/out-{t}-{pol}, save_final: false}}
train: {{seq_len: 4096, global_batch: {rows}, micro_batch: {min(rows, 4)}, steps: {steps}, max_grad_norm: 1.0}}
optimizer: {{lr: 1.0e-5, weight_decay: 0.01}}
runtime: {{workers: 1, {runtime}{opt(", ", s.k("PLAN_RUNTIME_EXTRA"))}}}
""")
    if s.dry:
        s.note("plan: slidedp-hostd --state-dir + slidedp-worker --gpu 0; per tokens: slidedp plan --measure, then per")
        s.note("plan: policy slidedp plan JOB.yaml and slidedp submit JOB.yaml; plan_check.py")
        return
    svc = Service(s, d, f"{pd}/hostd.log")
    svc.worker(0, f"{pd}/worker.log", visible="0")
    svc.wait_workers("gpu0", 1, 60)
    cases, times = [], []
    for t in tokens:
        t0 = s.seconds()
        s.stage(f"plan_measure_{t}", 300, "slidedp", "plan", "--measure", f"{d}/{t}-{policies[0]}.yaml")
        times.append(f"{model}-{t}={s.seconds() - t0}")
        for pol in policies:
            name, job = f"{model}-{t}-{pol}", f"{d}/{t}-{pol}.yaml"
            s.sh(["slidedp", "plan", job], out_file=f"{pd}/{name}.plan")
            s.stage(f"plan_job_{t}-{pol}", 240, "slidedp", "submit", job, "--id", f"{t}-{pol}")
            s.copy_metrics(f"{d}/out-{t}-{pol}/metrics-{t}-{pol}.jsonl", f"{pd}/{name}.jsonl")
            s.sh(["slidedp", "plan", job, "--compare", f"{pd}/{name}.jsonl"], out_file=f"{pd}/{name}.compare")
            cases.append(name)
    s.copy_globs(f"{d}/state/policies/*.yaml", pd)
    svc.stop()
    s.check("tools/gpu/plan_check.py", "--dir", pd, "--cases", *cases, "--measure-times", *times, "--part", s.part)
    shutil.rmtree(d, ignore_errors=True)


def idiv(a, b):
    """bash's $((a / b)): truncated toward zero."""
    q = abs(a) // b
    return q if a >= 0 else -q


def scaling(s):
    """Weak scaling at 64K per GPU; strong scaling at each global batch of SCALING_STRONG (1 GPU at G,
    2 GPUs at G / 2 each), every (GPUs, tokens per GPU) pair run once; FSDP2 on 2 GPUs."""
    if s.gpus < 2:
        s.result("SKIP", f"needs 2 GPUs (nvidia-h200-x2), {s.gpus} visible")
        return
    s.find_cudnn()
    model, w, strong = s.k("SCALING_MODEL"), f"{s.work}/scaling", s.k("SCALING_STRONG").split()
    one, two = ["65536"], ["65536"]
    for g in strong:
        one += [g] if g not in one else []
        two += [str(int(g) // 2)] if str(int(g) // 2) not in two else []
    s.run_bench("scaling_ours1", budget=idiv((s.left() - 160) * 2, 5), OUT=s.part_dir, MODEL=model, GPUS=1,
                TOKENS_LIST=" ".join(one), WHAT="ours", ACT_POLICY="auto", WORK=w, FRESH=1)
    s.run_bench("scaling_ours2", budget_margin=160, OUT=s.part_dir, MODEL=model, GPUS=2, TOKENS_LIST=" ".join(two),
                WHAT="ours", ACT_POLICY="auto", WORK=w, RESUME=1)
    s.run_bench("scaling_fsdp2", OUT=s.part_dir, MODEL=model, GPUS=2, TOKENS_LIST=16384, WHAT="fsdp2", WORK=w,
                RESUME=1)
    s.judge("scaling", "--results", f"{s.part_dir}/bench-results.json", "--model", model, "--tokens", 65536,
            "--peer-tokens", 16384, *(["--strong", ",".join(strong)] if strong else []))


def host(s):
    s.find_cudnn()
    pd = s.part_dir
    s.stage("layeradam", 180, "python3", "bench/layeradam/torch_cpu_adamw.py", "--params", 268435456, "--threads",
            nproc(), "--bench", which("bench_layeradam"))
    s.judge("layeradam", "--log", f"{pd}/layeradam.log", "--t-torch", s.t("t_torch"), "--t-copy", s.t("t_copy"))
    s.stage("bench_copy", 120, "bench_copy", "--seconds", 2, "--mib", 256, "--adam-params", 268435456)
    s.judge("copy", "--log", f"{pd}/bench_copy.log")
    # DMA before Adam with bursty copies (a step's parameter loads come in bursts): LayerAdam's rate
    # with copy priority on is then meaningful beside the copies' >= 0.9 of their solo GB/s.
    s.stage("bench_copy_duty", 120, "bench_copy", "--seconds", 2, "--mib", 64, "--adam-params", 268435456, "--duty",
            "20:20")
    s.judge("copy", "--log", f"{pd}/bench_copy_duty.log")
    # A node service (hostd + one CUDA worker) and two Qwen3-4B jobs back to back: submit -> first
    # step cold, then warm (the pooled state segment re-laid out in place).
    d = f"{s.work}/warm"
    s.new_dir(d)
    s.stage("warm_data", 60, "python3", "bench/e2e/make_dataset.py", "--out", f"{d}/data", "--rows", 64, "--seq-len",
            4096, "--vocab", 151936)
    for jid in ("cold", "warm"):
        s.write(f"{d}/{jid}.yaml", f"""name: {jid}
model: {{preset: qwen3-4b, init_seed: 0}}
data: {{path: {d}/data}}
output: {{dir: {d}/out-{jid}, save_final: false}}
train: {{seq_len: 4096, global_batch: 4, micro_batch: 4, steps: 3, max_grad_norm: 1.0}}
runtime: {{workers: 1}}
""")
    if s.dry:
        s.note(f"warm: slidedp-hostd --listen unix:{d}/hostd.sock --state-dir {d}/state --output-root {d} &; "
               f"slidedp-worker --hostd unix:{d}/hostd.sock --gpu 0 &")
        s.note(f"warm: slidedp submit {d}/cold.yaml --id cold; slidedp status cold; the same for warm")
        return
    svc = Service(s, d, f"{pd}/warm-hostd.log")
    svc.worker(0, f"{pd}/warm-worker.log", visible="0")
    svc.wait_workers("gpu0", 1, 60)
    for jid in ("cold", "warm"):
        s.stage(f"warm_submit_{jid}", 240, "slidedp", "submit", f"{d}/{jid}.yaml", "--id", jid)
        s.sh(["slidedp", "status", jid], out_file=f"{pd}/warm-status-{jid}.txt", timeout=20)
    svc.stop()
    s.judge("warm", "--cold", f"{pd}/warm-status-cold.txt", "--warm", f"{pd}/warm-status-warm.txt", "--what",
            "Qwen3-4B on a node service (44.4 / 16.2 s in session 3)")
    shutil.rmtree(d, ignore_errors=True)


def line_count(path):
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def restart(s):
    """A node service with one CUDA worker: an uninterrupted job, then the same job with hostd killed
    (SIGKILL) just after step RESTART_KILL_AT's metrics line and started again. The job must resume
    from the state segment the dead hostd left, every step's loss bitwise the same (deterministic)."""
    s.find_cudnn()
    d, pd, steps, model = f"{s.work}/restart", s.part_dir, s.k("RESTART_STEPS"), s.k("RESTART_MODEL")
    kill_at = int(s.k("RESTART_KILL_AT"))
    s.new_dir(d)
    s.stage("restart_data", 60, "python3", "bench/e2e/make_dataset.py", "--out", f"{d}/data", "--rows", 128,
            "--seq-len", 4096, "--vocab", 151936)
    for jid in ("ref", "crashed"):
        s.write(f"{d}/{jid}.yaml", f"""name: {jid}
model: {{preset: {model}, init_seed: 0}}
data: {{path: {d}/data}}
output: {{dir: {d}/out-{jid}, save_final: false}}
train: {{seq_len: 4096, global_batch: 8, micro_batch: 4, steps: {steps}, max_grad_norm: 1.0}}
runtime: {{workers: 1, deterministic: true}}
""")
    if s.dry:
        s.note("restart: slidedp-hostd + slidedp-worker --gpu 0; slidedp submit ref.yaml; slidedp submit crashed.yaml "
               "--detach")
        s.note(f"restart: kill -9 hostd after step {kill_at}; slidedp-hostd again; slidedp status crashed; "
               "restart_check.py")
        return
    svc = Service(s, d, f"{pd}/hostd-first.log", append=True)
    svc.worker(0, f"{pd}/worker.log", visible="0")
    svc.wait_workers("gpu0", 1, 60)
    s.stage("restart_ref", 200, "slidedp", "submit", f"{d}/ref.yaml", "--id", "ref")
    s.copy_metrics(f"{d}/out-ref/metrics-*.jsonl", f"{pd}/ref.jsonl")
    s.sh(["slidedp", "submit", f"{d}/crashed.yaml", "--id", "crashed", "--detach"], out_file=f"{pd}/submit-crashed.txt")
    m, deadline = f"{d}/out-crashed/metrics-crashed.jsonl", time.monotonic() + 200
    while time.monotonic() < deadline and line_count(m) < kill_at:
        time.sleep(0.02)
    svc.kill_hostd()
    t_kill, lines = time.time(), line_count(m)
    svc.start_hostd(f"{pd}/hostd-second.log", append=True)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and line_count(m) <= lines:
        time.sleep(0.05)
    t_next = time.time()
    for _ in range(150):
        s.sh(["slidedp", "status", "crashed"], out_file=f"{pd}/status-crashed.txt")
        with open(f"{pd}/status-crashed.txt", errors="replace") as f:
            if re.search(r" (succeeded|failed|cancelled) ", f.read(), re.I):
                break
        time.sleep(1)
    s.copy_metrics(m, f"{pd}/crashed.jsonl")
    svc.stop()
    s.check("tools/gpu/restart_check.py", "--ref", f"{pd}/ref.jsonl", "--resumed", f"{pd}/crashed.jsonl", "--status",
            f"{pd}/status-crashed.txt", "--killed-after", lines, "--seconds-to-next-step", round(t_next - t_kill, 2),
            "--steps", steps, "--what", model, "--part", s.part)
    shutil.rmtree(d, ignore_errors=True)


def moe(s):
    """Issue 23's targets on one GPU: a Qwen3-30B-A3B-shaped model at MOE_LAYERS of its 48 layers,
    ours against compute-only; at MOE_PEER_LAYERS (a depth FSDP2 holds GPU-resident) ours against
    FSDP2 + HF Qwen3MoeForCausalLM. Model TFLOP/s count the active parameters."""
    s.find_cudnn()
    model, tokens, w, what = "qwen3-30b-a3b", s.k("MOE_TOKENS"), f"{s.work}/moe", s.k("MOE_WHAT")
    big, small, extra = s.k("MOE_LAYERS"), s.k("MOE_PEER_LAYERS"), s.k("MOE_RUNTIME_EXTRA")
    if "big" in what.split():
        s.run_bench("moe_big", OUT=f"{s.part_dir}/big", MODEL=model, LAYERS=big, GPUS=1, TOKENS_LIST=tokens,
                    WHAT=s.k("MOE_BIG_WHAT"), MAX_GRAD_NORM=s.k("MOE_MAX_GRAD_NORM"), STATE_DTYPE="int8",
                    ACT_POLICY="recompute", RUNTIME_EXTRA=f"param_source: {s.k('MOE_PARAM_SOURCE')}" + opt(", ", extra),
                    STEPS=s.k("MOE_STEPS"), MICRO_ROWS=s.k("MOE_MICRO_ROWS"), WORK=f"{w}/big", FRESH=1)
    if "peer" in what.split():
        s.run_bench("moe_peer", OUT=f"{s.part_dir}/peer", MODEL=model, LAYERS=small, GPUS=1, TOKENS_LIST=tokens,
                    WHAT=s.k("MOE_PEER_WHAT"), MAX_GRAD_NORM=0, STATE_DTYPE=s.k("MOE_PEER_STATE_DTYPE"),
                    FSDP_MICRO_ROWS=s.k("MOE_FSDP_MICRO_ROWS"), FSDP_STEPS=s.k("MOE_FSDP_STEPS"),
                    ACT_POLICY="recompute", RUNTIME_EXTRA=extra, STEPS=s.k("MOE_STEPS"),
                    MICRO_ROWS=s.k("MOE_MICRO_ROWS"), WORK=f"{w}/peer", FRESH=1)
    if not s.dry:
        copy_run_logs(s, w, ("big", "peer"))
    s.judge("moe", "--work", w, "--tokens", tokens, "--big", big, "--small", small, "--source",
            s.k("MOE_PARAM_SOURCE"), "--what", what, "--compute", s.t("compute"), "--fsdp2", s.t("fsdp2"))


def cp1gpu(s):
    """Context parallelism's CUDA path on one GPU (issue 26): two CUDA workers share GPU 0 (the second
    --id gpu0b), context_parallel 2 with the cpu route and replicated delivery (keys and values through
    the job's shm segment), against one worker on the whole micro-batches: each step's loss and norm."""
    s.find_cudnn()
    d, pd, model, seq, steps = f"{s.work}/cp1gpu", s.part_dir, s.k("CP_MODEL"), int(s.k("CP_SEQ")), s.k("CP_STEPS")
    # A row beyond 32K (e.g. 131072, whose zig-zag pieces suit SLIDEDP_CUDNN_CROSS): yarn, as longctx
    rope = f", max_position_embeddings: {max(seq, 40960)}{yarn(seq)[0]}" if seq > 32768 else ""
    model_extra = opt(", num_hidden_layers: ", s.k("CP_LAYERS")) + rope
    s.new_dir(d)
    s.stage("cp_data", 60, "python3", "bench/e2e/make_dataset.py", "--out", f"{d}/data", "--rows", 64, "--seq-len",
            seq, "--vocab", s.k("CP_VOCAB"))
    for jid, workers, extra in (("one", 1, ""), ("cp", 2, "context_parallel: 2, ")):
        s.write(f"{d}/{jid}.yaml", f"""name: {jid}
model: {{preset: {model}, init_seed: 0{model_extra}}}
data: {{path: {d}/data}}
output: {{dir: {d}/out-{jid}, save_final: false}}
train: {{seq_len: {seq}, global_batch: 2, micro_batch: 1, steps: {steps}, max_grad_norm: 1.0{opt(", ", s.k("CP_TRAIN_EXTRA"))}}}
runtime: {{workers: {workers}, {extra}grad_reduction: cpu, deterministic: {s.k("CP_DETERMINISTIC")}}}
""")
    if s.dry:
        s.note("cp1gpu: slidedp-hostd; slidedp-worker --gpu 0; slidedp-worker --gpu 0 --id gpu0b; submit one.yaml, "
               "cp.yaml")
        return
    svc = Service(s, d, f"{pd}/hostd.log")
    svc.worker(0, f"{pd}/worker0.log", visible="0")
    svc.worker(0, f"{pd}/worker1.log", visible="0", wid="gpu0b")
    svc.wait_workers("gpu0", 2, 60)
    for jid in ("one", "cp"):
        s.stage(f"cp1gpu_{jid}", 300, "slidedp", "submit", f"{d}/{jid}.yaml", "--id", jid)
        s.copy_metrics(f"{d}/out-{jid}/metrics-*.jsonl", f"{pd}/{jid}.jsonl")
    svc.stop()
    s.judge("cp1gpu", "--one", f"{pd}/one.jsonl", "--cp", f"{pd}/cp.jsonl", "--model", model, "--seq", seq,
            "--steps", steps, "--loss-tol", s.t("loss_tol"), "--grad-tol", s.t("grad_tol"), "--aux-tol", s.t("aux_tol"))
    shutil.rmtree(d, ignore_errors=True)


RECIPES = {"routespeed": routespeed, "bench": bench, "clip": clip, "specbits": specbits, "mastersrc": mastersrc,
           "big": big, "memlimit": memlimit, "policy": policy, "autopolicy": autopolicy, "plan": plan,
           "scaling": scaling, "host": host, "restart": restart, "moe": moe, "cp1gpu": cp1gpu, "longctx": longctx}
