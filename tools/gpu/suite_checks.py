"""suite_judge.py's checks of long context (longctx) and of the parts whose verdicts were inline
Python in run_suite.sh (families' gradient norms, curves' compact moments, determinism's step times,
specbits, mastersrc, big, memlimit, policy, state, moe, cp1gpu). Same (args, verdicts) shape as suite_judge.py's checks;
thresholds come from suite_parts.py through suite_judge's --part (`register` names them)."""
import glob
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_results import ours_metrics  # noqa: E402
from suite_judge import json_lines, last_line, read, report_module  # noqa: E402
from suite_parts import fmt  # noqa: E402


def jsonl(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def check_grad_parity(a, v):
    """At lr 0 every step's gradient norm is the same weights': CUDA vs the CPU backend within --tol."""
    read = lambda p: {r["step"]: r for r in jsonl(p)}  # noqa: E731
    g, c = read(a.cuda), read(a.cpu)
    rel = [abs(g[s]["grad_norm"] - c[s]["grad_norm"]) / abs(c[s]["grad_norm"]) for s in sorted(set(g) & set(c))
           if c[s].get("grad_norm")]
    worst = max(rel) if rel else float("nan")
    v.gate(bool(rel) and worst <= a.tol, f"{a.what} at lr 0: gradient norm CUDA vs CPU backend, {len(rel)} steps, "
                                         f"worst rel {worst:.3g} (<= {a.tol:g})")


def check_final_loss(a, v):
    """The final loss of a run with compact moments (--a) against FP32 moments (--b), relative."""
    def final(p):
        rows = [r for r in jsonl(p) if "loss" in r]
        return max(rows, key=lambda r: r["step"])["loss"] if rows else float("nan")
    x, y = final(a.a), final(a.b)
    rel = abs(x - y) / abs(y) if y == y and y != 0 else float("nan")
    v.gate(rel <= a.rel, f"final loss with {a.state} moments {x:.5f} vs fp32 {y:.5f}: {100 * rel:.3f}% "
                         f"(<= {100 * a.rel:g}%)")


def check_step_times(a, v):
    """Step seconds of the deterministic run beside the default one (a figure)."""
    t = lambda p: [round(r["step_time_s"], 3) for r in jsonl(p)]  # noqa: E731
    v.info(f"{a.model} step s, deterministic / default: {t(a.det)} / {t(a.default)}")


def check_specbits(a, v):
    """Speculation auto (--auto WORK) against off (--wait WORK): losses bitwise equal, some step speculated."""
    x, y = ours_metrics(a.auto), ours_metrics(a.wait)
    la, lb = [r["loss"] for r in x], [r["loss"] for r in y]
    spec = sum(1 for r in x if r.get("speculated_fraction", 0) > 0)
    redo = sum(1 for r in x if r.get("speculation_rolled_back"))
    ok = len(la) == a.steps and la == lb and spec > 0
    v.gate(ok, f"0.6B max_grad_norm {a.norm}: {len(la)} / {len(lb)} steps, losses "
               f"{'bitwise equal' if la == lb else 'differ: ' + str(la) + ' vs ' + str(lb)} (speculation auto vs "
               f"off; {spec} step(s) speculated, {redo} redone)")


def check_mastersrc(a, v):
    """param_source master (per variant) against the mirror: bitwise losses, then speed figures."""
    w, variants = a.work, a.variants.split()
    lb = [r["loss"] for r in ours_metrics(f"{w}/bits_mirror")]
    for name in variants:
        if name == "mirror":
            continue
        b = ours_metrics(f"{w}/bits_{name}")
        la = [r["loss"] for r in b]
        ok = len(lb) == a.steps and la == lb and all(r.get("param_source") == "master" for r in b)
        v.gate(ok, f"0.6B {name}: {len(lb)} / {len(la)} steps, losses "
                   f"{'bitwise equal' if la == lb else 'differ: ' + str(lb) + ' vs ' + str(la)} (param_source mirror "
                   f"vs {name})")

    def speed(d):
        rows = [r for r in ours_metrics(d) if r["step"] > 2]
        if not rows:
            return None
        return (med([r["tokens_per_s"] for r in rows]), med([r.get("busy_s", {}).get("worker_cast", 0) for r in rows]),
                med([r.get("busy_s", {}).get("worker_h2d", 0) for r in rows]), rows[-1].get("host_state_bytes", 0))
    m = speed(f"{w}/speed_mirror")
    for name in variants:
        s = speed(f"{w}/speed_{name}")
        if s is None:
            v.gate(False, f"speed {name}: no metrics")
            continue
        rel = f" ({s[0] / m[0]:.3f} of the mirror's)" if m and name != "mirror" else ""
        v.info(f"speed {name}: {s[0]:.0f} tok/s{rel}; worker cast {s[1]:.3f} s/step, h2d {s[2]:.3f} s/step; "
               f"host state {s[3] / 2**30:.2f} GiB")


def hostmem(d):
    """Bytes: the drop of MemAvailable while a run_bench stage ran (its sampler's file, KiB)."""
    for p in glob.glob(f"{d}/runs/*/*/*/*/ours/hostmem"):
        with open(p) as f:
            x = f.read().split()
        if len(x) == 2:
            return max(0, int(x[0]) - int(x[1])) * 1024
    return None


def last_json(pattern, key):
    found = None
    for p in glob.glob(pattern, recursive=True):
        with open(p, errors="replace") as f:
            for line in f:
                if line.startswith("{") and key in line:
                    try:
                        found = json.loads(line)
                    except ValueError:
                        pass
    return found


def check_big(a, v):
    """Issue 21's capacity run: ours (noclip, clip) / compute-only, host state per billion parameters."""
    import suite_parts
    params = suite_parts.report_module().preset_params(a.model)
    comp = last_json(f"{a.work}/compute/runs/*/*/*/compute/stage.log", "compute_only")
    cps = comp["tokens_per_s"] if comp else None
    for name in ("noclip", "clip"):
        rows = ours_metrics(f"{a.work}/{name}")
        steady = [r for r in rows if r["step"] >= 2]
        if not steady:
            v.gate(False, f"{a.model} {name}: no steps (see details)")
            continue
        tps = med([r["tokens_per_s"] for r in steady]) / a.gpus  # per GPU, against one GPU's compute-only
        state = rows[-1].get("host_state_bytes", 0)
        drop = hostmem(f"{a.work}/{name}")
        gib_b = lambda b: (b / 2**30) / (params / 1e9) if params and b else float("nan")  # noqa: E731
        ratio = tps / cps if cps else float("nan")
        where, per = (f", {a.gpus} GPUs", " per GPU") if a.gpus > 1 else ("", "")
        v.gate(bool(cps) and ratio >= a.compute,
               f"{a.model} {a.tokens // 1024}K{per} {a.state_dtype} + master{where}, {name}: {tps:.0f} tok/s{per} = "
               f"{ratio:.3f} of compute-only {cps or float('nan'):.0f} (target {a.compute:g}); host state "
               f"{state / 2**30:.2f} GiB ({gib_b(state):.2f} GiB/B), MemAvailable drop {(drop or 0) / 2**30:.2f} GiB "
               f"({gib_b(drop):.2f} GiB/B; target {a.host_gib_per_b:g})")


def check_memlimit(a, v):
    """runtime.gpu_memory_limit: the limited run's GPU peak under it, its speed against the unlimited."""
    m = re.fullmatch(r"([0-9.]+)\s*([a-zA-Z]*)", a.limit)
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9,
             "tb": 1e12}
    limit_bytes = float(m.group(1)) * units[m.group(2).lower()] if m and m.group(2).lower() in units else None
    res = {}
    for name in ("free", "limited"):
        rows = ours_metrics(f"{a.work}/{name}")
        steady = [r for r in rows if r["step"] >= a.steady_from]
        if not steady:
            v.gate(False, f"{a.model} {a.tokens // 1024}K {name}: no steps (see details)")
            continue
        res[name] = (med([r["tokens_per_s"] for r in steady]), max(r.get("gpu_peak_bytes", 0) for r in rows))
    for name, (tps, peak) in res.items():
        v.info(f"{a.model} {a.tokens // 1024}K {name}: {tps:.0f} tok/s, GPU peak {peak / 2**30:.2f} GiB")
    if "limited" in res and limit_bytes:
        peak = res["limited"][1]
        v.gate(0 < peak <= limit_bytes, f"peak {peak / 2**30:.2f} GiB under runtime.gpu_memory_limit {a.limit} "
                                        f"({limit_bytes / 2**30:.2f} GiB)")
    if len(res) == 2:
        x = res["limited"][0] / res["free"][0]
        v.gate(x >= a.speed, f"limited / unlimited speed {x:.3f} (>= {a.speed:g})")


def check_policy(a, v):
    """A mixed per-layer layout against whole-layer recompute: losses within --loss-tol."""
    x, y = ours_metrics(f"{a.work}/recompute"), ours_metrics(f"{a.work}/mixed")
    la, lb = [r["loss"] for r in x], [r["loss"] for r in y]
    d = max((abs(p - q) for p, q in zip(la, lb)), default=float("inf"))
    ok = len(la) == a.steps and len(lb) == a.steps and d <= a.loss_tol
    peak = lambda rows: max((r.get("gpu_peak_bytes", 0) for r in rows), default=0) / 2**30  # noqa: E731
    v.gate(ok, f"0.6B mixed per-layer layout vs recompute: {len(la)} / {len(lb)} steps, "
               f"{'bitwise equal' if la == lb else f'max |dloss| {d:.2e}'} (<= {fmt(a.loss_tol)}); GPU peak "
               f"{peak(x):.2f} / {peak(y):.2f} GiB")


def check_layeradam_states(a, v):
    """bench_layeradam per moment layout and mirror setting: int8 / fp32 params/s >= --int8."""
    for ms in a.mirrors.split():
        rows = {}
        for st in ("fp32", "bf16", "int8"):
            try:
                with open(f"{a.dir}/layeradam_{st}_{ms}.log") as f:
                    rows[st] = json.loads([line for line in f if line.startswith("{")][-1])
            except (OSError, IndexError, ValueError):
                v.gate(False, f"layeradam --state {st} --mirror-store {ms}: no result")
        for st, r in rows.items():
            v.info(f"LayerAdam {st} moments, mirror {ms}: {r['adam_Gparam_per_s']:.3f} Gparam/s, "
                   f"{r['layeradam_gbps']:.1f} GB/s at {r['layeradam_bytes_per_param']:.2f} B/param, triad "
                   f"{r['triad_gbps']:.1f} GB/s (ratio {r['ratio_to_triad']:.2f}), isa {r['isa']}, {r['threads']} "
                   f"threads, {r['hot_path_page_faults']} page faults")
        if "fp32" in rows:
            for st in ("bf16", "int8"):
                if st in rows:
                    x = rows[st]["adam_Gparam_per_s"] / rows["fp32"]["adam_Gparam_per_s"]
                    text = f"LayerAdam {st} / fp32 moments, mirror {ms}: {x:.2f}x params/s"
                    if st == "int8":
                        v.gate(x >= a.int8, text + f" (>= {a.int8:g})")
                    else:
                        v.info(text)


def check_moe(a, v):
    """Issue 23: ours / compute-only at --big layers, ours / FSDP2 (HF Qwen3-MoE) at --small layers."""
    what = a.what.split()

    def ours(d):
        rows = [r for r in ours_metrics(d) if r["step"] >= 2]
        if not rows:
            return None
        return {"tps": med([r["tokens_per_s"] for r in rows]), "tflops": med([r["model_tflops"] for r in rows]),
                "imb": rows[-1].get("expert_tokens", {}).get("imbalance"), "aux": rows[-1].get("router_aux_loss"),
                "state": rows[-1].get("host_state_bytes", 0), "peak": rows[-1].get("gpu_peak_bytes", 0)}
    o = ours(f"{a.work}/big")
    comp = last_json(f"{a.work}/big/runs/**/compute/stage.log", "compute_only")
    if "big" in what and o is None:
        v.gate(False, f"qwen3-30b-a3b x{a.big} layers: no steps of ours (see details)")
    elif "big" in what:
        cps = comp["tokens_per_s"] if comp else None
        ratio = o["tps"] / cps if cps else float("nan")
        v.gate(bool(cps) and ratio >= a.compute,
               f"qwen3-30b-a3b x{a.big} layers, {a.tokens // 1024}K tok/step, int8 + {a.source}: {o['tps']:.0f} tok/s, "
               f"{o['tflops']:.0f} model TFLOP/s (active) = {ratio:.3f} of compute-only {cps or float('nan'):.0f} tok/s "
               f"(target {a.compute:g}); host state {o['state'] / 2**30:.1f} GiB, GPU peak {o['peak'] / 2**30:.1f} "
               f"GiB, expert imbalance {o['imb']}, aux {o['aux']}")
    o = ours(f"{a.work}/peer")
    peer = last_json(f"{a.work}/peer/runs/**/fsdp2/stage.log", "fsdp2-moe")
    if "peer" in what and (o is None or peer is None):
        v.gate(False, f"qwen3-30b-a3b x{a.small} layers vs FSDP2: ours {'ran' if o else 'no steps'}, "
                      f"FSDP2 {'ran' if peer else 'no result (OOM or cut; see details)'}")
    elif "peer" in what:
        ratio = o["tps"] / peer["tokens_per_s_per_gpu"]
        v.gate(ratio >= a.fsdp2,
               f"qwen3-30b-a3b x{a.small} layers, {a.tokens // 1024}K tok/step: ours {o['tps']:.0f} tok/s "
               f"({o['tflops']:.0f} TFLOP/s) / FSDP2 {peer['tokens_per_s_per_gpu']:.0f} tok/s "
               f"({peer['model_tflops_per_gpu']:.0f} TFLOP/s, experts {peer.get('experts_implementation')}, peak "
               f"{peer.get('peak_gib', 0):.0f} GiB) = {ratio:.2f} (target {a.fsdp2:g})")


def check_cp1gpu(a, v):
    """Context parallel 2 (two workers on one GPU) against one worker: per-step loss, gradient norm, aux."""
    def rows(p):
        try:
            return {int(r["step"]): r for r in jsonl(p)}
        except (KeyError, ValueError):
            return {}
    x, y = rows(a.one), rows(a.cp)
    both = sorted(set(x) & set(y))
    if len(both) < a.steps:
        v.gate(False, f"{a.model} seq {a.seq}: {len(x)} steps of one worker, {len(y)} of context parallel 2 (see logs)")
        return
    dl = max(abs(y[s]["loss"] - x[s]["loss"]) / abs(x[s]["loss"]) for s in both)
    aux = [(x[s].get("router_aux_loss"), y[s].get("router_aux_loss")) for s in both]
    da = max((abs(q - p) / abs(p) for p, q in aux if p), default=None)
    dg = max(abs(y[s]["grad_norm"] - x[s]["grad_norm"]) / abs(x[s]["grad_norm"]) for s in both)
    tps = [y[s]["tokens_per_s"] for s in both if s >= 2]
    ok = dl <= a.loss_tol and dg <= a.grad_tol and (da is None or da <= a.aux_tol)
    v.gate(ok, f"{a.model}, 2 x {a.seq} tokens/step, context parallel 2 (2 CUDA workers on one GPU, K/V through shm) "
               f"vs 1 worker over {len(both)} steps: max rel |dloss| {dl:.2e} (tol {fmt(a.loss_tol)}), max rel "
               f"|dgrad_norm| {dg:.2e} (tol {fmt(a.grad_tol)})"
               + (f", max rel |d router_aux_loss| {da:.2e} (tol {fmt(a.aux_tol)})" if da is not None else "")
               + f"; losses {[round(x[s]['loss'], 5) for s in both]} vs {[round(y[s]['loss'], 5) for s in both]}; "
               f"{med(tps) or 0:.0f} tok/s (staged, not a speed figure)")


# ------------------------------------------------------------------------------------ longctx

def stage_exit(log_text, name=None):
    """(rc, seconds) of a run_suite.sh stage log's "=== NAME: exit RC after S s" line; None when the
    stage did not finish (or was not started)."""
    who = re.escape(name) if name else r"\S+"
    m = re.findall(rf"^=== {who}: exit (\d+) after (\d+) s", log_text, re.M)
    return (int(m[-1][0]), int(m[-1][1])) if m else None


def longctx_when(d, kind, ran):
    """"" for a stage this call ran, else where its result comes from (an earlier call on this machine)."""
    if kind in ran:
        return ""
    started = read(os.path.join(d, kind, "started")).strip()
    return f" [from an earlier call on this machine{', ' + started if started else ''}]"


def longctx_ours(a, v, seq_k):
    """Ours: the gates, then figures. Returns the last step's metrics (or None)."""
    d = os.path.join(a.dir, "ours")
    when = longctx_when(a.dir, "ours", a.ran)
    log = read(os.path.join(d, "stage.log"))
    what = f"{a.model} ours, one sequence of {a.seq:,} tokens per step"
    if not log:
        status = "FAIL" if "ours" in a.ran else "SKIP"
        text = "did not run" + (" (no log)" if status == "FAIL" else " (not in LONGCTX_WHAT, no earlier result)")
        v.line(status, f"{what}: {text}")
        return None
    ex = stage_exit(log)
    by_step = {}
    for j in json_lines(read(os.path.join(d, "metrics.jsonl"))):
        if isinstance(j, dict) and "step" in j:
            by_step[int(j["step"])] = j  # a step run again: its last line counts
    rows = [by_step[k] for k in sorted(by_step)]
    finite = [r for r in rows if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    # the job's own words when it failed: the final "error:" line, a refusal ("slidedp: CODE: ...") and
    # a private process that died ("slidedp: worker 0 was killed ... (logs in ...)")
    errors = [l.strip() for l in log.splitlines() if l.startswith("error:") or re.match(r"slidedp: [A-Z_]+: ", l)
              or (l.startswith("slidedp: ") and "(logs in" in l)]
    rc_text = "did not finish" if ex is None else \
        f"exit {ex[0]} after {ex[1]} s" + (" (time cap)" if ex[0] == 124 else "")
    ok = ex is not None and ex[0] == 0 and sorted(by_step) == list(range(1, a.expect_steps + 1)) \
        and len(finite) == len(rows)
    losses = ", ".join(f"{r['loss']:.4f}" if r in finite else str(r.get("loss")) for r in rows) or "none"
    v.gate(ok, f"{what} trains: {rc_text}, {len(rows)} of {a.expect_steps} steps, losses {losses} "
               f"(finite loss on every step, {a.expect_steps} steps){when}")
    for e in errors[-2:]:
        v.info(f"{a.model} ours {seq_k}: {e[:400]}")
    if not rows:
        v.gate(False, f"{what}: model TFLOP/s: no step finished (>= {a.t_tflops:g}){when}")
        return None
    last = rows[-1]
    mfu = f", MFU {last['mfu']:.3f}" if last.get("mfu") else ""
    # the gate reads the last step of the run asked for (step 1 is the warm-up)
    short = "" if last["step"] == a.expect_steps else f"; step {a.expect_steps} did not finish"
    v.gate(not short and last.get("model_tflops", 0) >= a.t_tflops,
           f"{what}: step {last['step']} {last.get('model_tflops', 0):.1f} model TFLOP/s "
           f"({last.get('step_time_s', 0):.1f} s, {last.get('tokens_per_s', 0):,.0f} tok/s{mfu}; "
           f"6N + 6 L seq q_dim per token{short}) (>= {a.t_tflops:g} on step {a.expect_steps}){when}")
    busy = last.get("busy_s") or {}
    peak = max(float(r.get("gpu_peak_bytes", 0) or 0) for r in rows) / 2**30
    used = max(float(r.get("gpu_used_peak_bytes", 0) or 0) for r in rows) / 2**30
    mem = [f"GPU peak {peak:.1f} GiB" + (f" (buffers at most {used:.1f})" if used > 0 else ""), f"host state {float(last.get('host_state_bytes', 0) or 0) / 2**30:.1f} GiB"]
    # hostd's memory plan (JobPlan::MemoryLine: the job's log, in hostd.log and in slidedp run's output)
    plan = re.search(r"host state: ([0-9.]+) GiB \(.*?activation offload ([0-9.]+)",
                     "\n".join([log] + [read(p) for p in sorted(glob.glob(os.path.join(d, "run", "*.log")))]))
    if plan:
        mem.append(f"hostd's plan {plan.group(1)} GiB of it {plan.group(2)} GiB activation offload (pinned)")
    drop = read(os.path.join(d, "hostmem")).split()
    if len(drop) == 2:
        mem.append(f"MemAvailable drop {max(0, int(drop[0]) - int(drop[1])) / 2**20:.1f} GiB")
    v.info(f"{a.model} ours {seq_k} memory: " + ", ".join(mem) + when)
    if busy:
        v.info(f"{a.model} ours {seq_k} step {last['step']} busy s: worker step {busy.get('worker_step', 0):.1f}, "
               f"gate wait {busy.get('worker_gate_wait', 0):.2f}, H2D {busy.get('worker_h2d', 0):.2f}, "
               f"cast {busy.get('worker_cast', 0):.2f}, D2H {busy.get('worker_d2h', 0):.2f}, host update "
               f"{busy.get('host_update', 0):.2f} (tail {busy.get('host_update_tail', 0):.2f})")
    return last


def check_longctx(a, v):
    """Long context (one sequence of --seq tokens per step): ours trains and reaches --t-tflops model
    TFLOP/s on its last step; against compute-only (bench_step, possibly fewer layers) and FSDP2
    GPU-resident at the longest sequence it fits (figures). Reads a run_suite.sh longctx folder:
    ours/{stage.log,metrics.jsonl,run/*.log,hostmem}, compute/stage.log, peer/s<SEQ>.log."""
    a.ran = set(a.ran.split())
    seq_k = f"{a.seq // 1024}K"
    ours = longctx_ours(a, v, seq_k)
    # compute-only: the ceiling, in model TFLOP/s (tok/s only compares at the same depth)
    when = longctx_when(a.dir, "compute", a.ran)
    log = read(os.path.join(a.dir, "compute", "stage.log"))
    comp = next((j for j in reversed(json_lines(log)) if j.get("mode") == "compute_only"), None) if log else None
    if not log:
        if "compute" in a.ran:
            v.info(f"{a.model} compute-only {seq_k}: did not run (no log)")
    elif not comp or comp.get("error") or not comp.get("model_tflops"):
        ex = stage_exit(log)
        v.info(f"{a.model} compute-only (bench_step) {seq_k}: no result, "
               f"{'did not finish' if ex is None else f'exit {ex[0]}'}: "
               f"{(comp or {}).get('error') or last_line(log, 300)}{when}")
    else:
        full = (report_module().PRESETS.get(a.model) or (0, 0))[1]
        depth = comp.get("layers", full)
        v.info(f"{a.model} compute-only (bench_step, {depth} of {full or '?'} layers, resident weights, offload "
               f"{comp.get('offload_ratio', 0):g}) {seq_k}: {comp['model_tflops']:.1f} model TFLOP/s, step "
               f"{comp['step_s']:.2f} s, {comp['tokens_per_s']:,.0f} tok/s, peak {comp.get('peak_gib', 0):.1f} GiB"
               f"{when}")
        if ours and ours.get("model_tflops"):
            text = (f"{a.model} ours / compute-only at {seq_k}: model TFLOP/s {ours['model_tflops']:.1f} / "
                    f"{comp['model_tflops']:.1f} = {ours['model_tflops'] / comp['model_tflops']:.3f}")
            if depth == full and comp.get("tokens_per_s"):
                text += f"; tok/s {ours['tokens_per_s']:,.0f} / {comp['tokens_per_s']:,.0f} = " \
                        f"{ours['tokens_per_s'] / comp['tokens_per_s']:.3f}"
            else:
                text += f" (compute-only on {depth} of {full or '?'} layers: per-layer rate, tok/s not comparable)"
            v.info(text)
    # FSDP2 GPU-resident: the longest sequence that ran
    when = longctx_when(a.dir, "peer", a.ran)
    tried = []
    for p in glob.glob(os.path.join(a.dir, "peer", "s*.log")):
        m = re.search(r"s(\d+)\.log$", p)
        if m:
            tried.append((int(m.group(1)), read(p)))
    tried.sort(key=lambda t: -t[0])
    fits, notes = None, []
    for s, text in tried:
        j = next((j for j in reversed(json_lines(text)) if str(j.get("peer", "")).startswith("fsdp2")), None)
        if j and j.get("tokens_per_s_per_gpu"):
            fits = fits or j
            continue
        ex = stage_exit(text)
        if re.search(r"OutOfMemoryError|CUDA out of memory", text):
            why_not = "out of GPU memory"
        elif ex is None:
            why_not = "not started" if "not started" in text else "did not finish"
        elif ex[0] == 124:
            why_not = "time cap"
        else:
            why_not = f"exit {ex[0]}: {last_line(text, 100)}"
        notes.append(f"{s // 1024}K {why_not}")
    if not tried:
        if "peer" in a.ran:
            v.info(f"{a.model} FSDP2 GPU-resident: no attempt ran")
        return
    failed = f" ({', '.join(notes)})" if notes else ""
    if not fits:
        v.info(f"{a.model} FSDP2 GPU-resident, one row per step: no sequence length ran{failed}{when}")
        return
    pk = f"{fits['seq'] // 1024}K"
    v.info(f"{a.model} FSDP2 GPU-resident at its longest sequence that ran, {pk} x 1 row{failed}: "
           f"{fits['tokens_per_s_per_gpu']:,.0f} tok/s, {fits['model_tflops_per_gpu']:.1f} model TFLOP/s, step "
           f"{fits['step_s']:.2f} s, peak {fits.get('peak_gib', 0):.1f} GiB{when}")
    if ours and ours.get("tokens_per_s"):
        v.info(f"{a.model} ours ({seq_k}) / FSDP2 GPU-resident ({pk}): tok/s {ours['tokens_per_s']:,.0f} / "
               f"{fits['tokens_per_s_per_gpu']:,.0f} = {ours['tokens_per_s'] / fits['tokens_per_s_per_gpu']:.2f}x; "
               f"model TFLOP/s {ours.get('model_tflops', 0):.1f} / {fits['model_tflops_per_gpu']:.1f} = "
               f"{ours.get('model_tflops', 0) / fits['model_tflops_per_gpu']:.2f}x ({a.seq // fits['seq']}x the "
               "sequence: a token costs more attention FLOPs at ours' length)")


# ------------------------------------------------------------------------------------ main

def register(add):
    """Adds these checks to suite_judge.py's command line: add(name, fn, *options, th={dest: threshold})."""
    F, I = {"type": float}, {"type": int}
    add("longctx", check_longctx, ("--dir",), ("--model",), ("--seq", I), ("--expect-steps", I), ("--t-tflops", F),
        ("--ran", {"default": "ours compute peer"}), th={"t_tflops": "t_tflops"})
    add("grad-parity", check_grad_parity, ("--cuda",), ("--cpu",), ("--tol", F), ("--what",), th={"tol": "grad_tol"})
    add("final-loss", check_final_loss, ("--a",), ("--b",), ("--state",), ("--rel", F),
        th={"rel": "states_final_rel"})
    add("step-times", check_step_times, ("--det",), ("--default",), ("--model",))
    add("specbits", check_specbits, ("--auto",), ("--wait",), ("--norm",), ("--steps", {"type": int, "default": 6}))
    add("mastersrc", check_mastersrc, ("--work",), ("--variants",), ("--steps", {"type": int, "default": 6}))
    add("big", check_big, ("--work",), ("--model",), ("--tokens", I), ("--gpus", I), ("--state-dtype",),
        ("--compute", F), ("--host-gib-per-b", F), th={"compute": "compute", "host_gib_per_b": "host_gib_per_b"})
    add("memlimit", check_memlimit, ("--work",), ("--model",), ("--tokens", I), ("--limit",), ("--steady-from", I),
        ("--speed", F), th={"speed": "speed"})
    add("policy", check_policy, ("--work",), ("--loss-tol", F), ("--steps", {"type": int, "default": 6}),
        th={"loss_tol": "loss_tol"})
    add("layeradam-states", check_layeradam_states, ("--dir",), ("--mirrors",), ("--int8", F), th={"int8": "int8"})
    add("moe", check_moe, ("--work",), ("--tokens", I), ("--big",), ("--small",), ("--source",), ("--what",),
        ("--compute", F), ("--fsdp2", F), th={"compute": "compute", "fsdp2": "fsdp2"})
    add("cp1gpu", check_cp1gpu, ("--one",), ("--cp",), ("--model",), ("--seq", I), ("--steps", I),
        ("--loss-tol", F), ("--grad-tol", F), ("--aux-tol", F),
        th={"loss_tol": "loss_tol", "grad_tol": "grad_tol", "aux_tol": "aux_tol"})

