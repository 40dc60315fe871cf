"""The GPU suite's longctx recipe: one sequence of LONGCTX_SEQ tokens per optimizer step. Ours is the
daemon path (slidedp run): the model's RoPE stretched to the row (yarn from Qwen3's 32K pretraining
context), int8 Adam moments and param_source master, whole-layer recompute with the first
LONGCTX_OFFLOAD of the layers' FP32 inputs in pinned host memory, the token-local work in tiles of
LONGCTX_TILE tokens. Then what it is read against: bench_step (compute-only, resident weights) on
the same row with LONGCTX_COMPUTE_LAYERS layers, and FSDP2 GPU-resident one row per step at the
longest of LONGCTX_PEER_SEQS that runs. A stage's results replace its own folder under w only, so a
later call on the same warm machine can add the stages an earlier one had no time for."""
import datetime
import glob
import os
import re
import shutil
import subprocess

from suite_recipes import gpu_list, nproc, opt, yarn

# MemAvailable at the start and its minimum so far (KiB) into $1, every second.
SAMPLER = """base=$(awk '/MemAvailable/ {print $2}' /proc/meminfo); low=$base
while :; do now=$(awk '/MemAvailable/ {print $2}' /proc/meminfo); [ "$now" -lt "$low" ] && low=$now
  echo "$base $low" > "$1"; sleep 1; done"""


def started(s, d):
    s.new_dir(d)
    s.write(f"{d}/started", f"{datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%SZ}\n")


def ours(s, c):
    d, seq, steps = f"{c['w']}/ours", c["seq"], c["steps"]
    data = f"{s.work}/longctx-data/v151936_s{seq}_r{steps}"
    started(s, d)
    if not os.path.isfile(f"{data}/manifest.json"):
        s.stage("longctx_data", 60, "python3", "bench/e2e/make_dataset.py", "--out", data, "--rows", steps,
                "--seq-len", seq, "--vocab", 151936)
    policy = opt(f", policy: {s.root}/", s.k("LONGCTX_POLICY"))
    runtime = (f"workers: {c['cp']},{c['cp_yaml']} act_policy: {s.k('LONGCTX_ACT_POLICY')}, offload_ratio: "
               f"{c['offload']}, param_source: master, checkpoint_dtype: {s.k('LONGCTX_CHECKPOINT_DTYPE')}"
               f"{opt(', tile_tokens: ', c['tile'])}{policy}{opt(', ', s.k('LONGCTX_RUNTIME_EXTRA'))}")
    job = f"""name: longctx
model: {{preset: {c['model']}, init_seed: 0{opt(", num_hidden_layers: ", s.k("LONGCTX_LAYERS"))}, max_position_embeddings: {c['maxpos']}{c['rope_yaml']}}}
data: {{path: {data}}}
output: {{dir: {d}/out, save_final: false}}
train: {{seq_len: {seq}, global_batch: 1, micro_batch: 1, steps: {steps}, seed: 0, max_grad_norm: 0}}
optimizer: {{lr: 1.0e-5, weight_decay: 0.01, state_dtype: int8}}
runtime: {{{runtime}}}
"""
    s.write(f"{d}/job.yaml", job)
    if s.dry:
        s.say("".join(f"DRY      {line}\n" for line in job.splitlines()).rstrip("\n"))
    else:
        sampler = subprocess.Popen(["bash", "-c", SAMPLER, "sampler", f"{d}/hostmem"])
    rc = s.stage("longctx_ours", s.k("LONGCTX_OURS_CAP"), "env", f"CUDA_VISIBLE_DEVICES={gpu_list(c['cp'])}",
                 "slidedp", "run", f"{d}/job.yaml", "--backend", "cuda", "--run-dir", f"{d}/run")
    if s.dry:
        return
    sampler.kill()
    sampler.wait()
    shutil.copy(f"{s.part_dir}/longctx_ours.log", f"{d}/stage.log")
    s.copy_metrics(f"{d}/out/metrics-*.jsonl", f"{d}/metrics.jsonl")
    if rc != 0:
        # Cut by the time cap, hostd drains by writing a checkpoint (drain_mode) before the group's
        # SIGKILL, and a killed private node leaves its state in /dev/shm (tens of GB of host memory
        # the next stages need): both go.
        for p in glob.glob(f"{d}/out/checkpoint-*"):
            shutil.rmtree(p, ignore_errors=True)
        try:
            with open(f"{d}/run/hostd.log", errors="replace") as f:
                m = re.search(r" node=(run[0-9]*)", f.read())
        except OSError:
            m = None
        node = m.group(1) if m else ""
        for p in glob.glob(f"/dev/shm/slidedp.{node}.*") if node else []:
            os.remove(p)


def compute(s, c):
    d, layers = f"{c['w']}/compute", s.k("LONGCTX_COMPUTE_LAYERS")
    started(s, d)
    # Fewer layers hold their checkpoints on the GPU (4 GiB each at 256K): no offload unless asked.
    coff = s.k("LONGCTX_COMPUTE_OFFLOAD") or (c["offload"] if layers == "0" else "0")
    extra = (["--rope-scaling", c["rope_json"]] if c["rope_json"] else []) + \
        (["--tile-tokens", c["tile"]] if c["tile"] else []) + \
        ["--checkpoint-dtype", s.k("LONGCTX_CHECKPOINT_DTYPE")] + (["--layers", layers] if layers != "0" else [])
    s.stage("longctx_compute", s.k("LONGCTX_COMPUTE_CAP"), "bench_step", "--model", c["model"], "--seq", c["seq"],
            "--tokens", c["seq"], "--micro-batch-rows", 1, "--policy", "recompute", "--steps",
            s.k("LONGCTX_COMPUTE_STEPS"), "--gpu", 0, "--max-position-embeddings", c["maxpos"], "--offload-ratio",
            coff, *extra)
    if not s.dry:
        shutil.copy(f"{s.part_dir}/longctx_compute.log", f"{d}/stage.log")


def peer(s, c):
    """FSDP2 GPU-resident (bench/e2e/fsdp2_qwen3.py), longest row first; expandable segments: the peer's
    best chance to fit a long row. It reports the median after 3 warm-up steps."""
    d = f"{c['w']}/peer"
    started(s, d)
    for seq in s.k("LONGCTX_PEER_SEQS").split():
        rc = s.stage(f"longctx_peer_s{seq}", s.k("LONGCTX_PEER_CAP"), "env", "CUDA_VISIBLE_DEVICES=0",
                     f"OMP_NUM_THREADS={nproc()}", f"PYTORCH_CUDA_ALLOC_CONF={s.k('LONGCTX_PEER_ALLOC_CONF')}",
                     "python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                     "bench/e2e/fsdp2_qwen3.py", "--model", c["model"], "--seq", seq, "--mbs", 1, "--steps",
                     s.k("LONGCTX_PEER_STEPS"))
        if s.dry:
            continue
        shutil.copy(f"{s.part_dir}/longctx_peer_s{seq}.log", f"{d}/s{seq}.log")
        if rc in (0, 125):  # ran (the longest that fits), or no time left
            break


STAGES = {"ours": ours, "compute": compute, "peer": peer}


def longctx(s):
    s.find_cudnn()
    model, seq, steps, cp = s.k("LONGCTX_MODEL"), int(s.k("LONGCTX_SEQ")), s.k("LONGCTX_STEPS"), int(s.k("LONGCTX_CP"))
    layers, what = s.k("LONGCTX_LAYERS"), s.k("LONGCTX_WHAT")
    w = f"{s.work}/longctx/{model}{opt('-l', layers)}-s{seq}" + (f"-cp{cp}" if s.has("LONGCTX_CP") else "")
    cp_yaml = ""
    if cp > 1:  # one sequence over cp GPUs (issue 26), keys and values over NCCL
        if s.gpus < cp:
            s.result("SKIP", f"LONGCTX_CP={cp} needs {cp} GPUs, {s.gpus} visible")
            return
        cp_yaml = f" context_parallel: {cp}, grad_reduction: gpu,"
    for k in what.split():
        if k not in STAGES:
            s.result("FAIL", f"LONGCTX_WHAT: unknown stage '{k}' (ours compute peer)")
            return
    rope_yaml, rope_json = yarn(seq)
    c = dict(model=model, seq=seq, steps=steps, cp=cp, cp_yaml=cp_yaml, w=w, maxpos=max(seq, 40960),
             offload=s.k("LONGCTX_OFFLOAD"), tile=s.k("LONGCTX_TILE"), rope_yaml=rope_yaml, rope_json=rope_json)
    os.makedirs(w, exist_ok=True)
    for k in what.split():
        STAGES[k](s, c)
    s.judge("longctx", "--dir", w, "--model", model + opt(" (", layers) + (" layers)" if layers else ""), "--seq",
            seq, "--expect-steps", steps, "--t-tflops", s.t("t_tflops"), "--ran", what)
    if s.dry:
        return
    # the details: every small result file, this call's and an earlier call's (not the dataset, the socket)
    s.sh(["bash", "-c", f'mkdir -p "{s.part_dir}/results" && cd "{w}" && find . -type f -size -4M ! -name '
          f"'*.safetensors' -print0 | xargs -0 -r cp --parents -t \"{s.part_dir}/results\""])
