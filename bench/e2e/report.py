#!/usr/bin/env python3
"""Summarizes the end-to-end benchmark's raw outputs (written by bench/e2e/run_bench.sh under
WORK/runs/MODEL/sSEQ/tTOKENS/{compute,gN/{ours,fsdp2,fsdp2-offload}}) into three files in OUT:

  bench-summary.md    targets met / not met, one table per model and GPU count, busy times,
                      1 -> 2 GPU scaling, stage status
  bench-results.json  every parsed stage result (machine-readable)
  bench-logs.txt      the progress log and every stage's log (long logs cut in the middle),
                      ours' metrics JSONL and the tails of hostd's and the workers' logs

Figures: "ours" is the median over optimizer steps >= 2 of the job's metrics JSONL (step 1 is the
warm-up); compute-only and the FSDP2 peers print one JSON line each. Tokens/s are per GPU. Host
GiB per billion parameters is the job's host_state_bytes / 2^30 / (params / 1e9); "sampled" is the
drop of the machine's MemAvailable while the stage ran (everything the stage took from the host).

Usage: report.py --work WORK --out OUT
"""
import argparse
import glob
import json
import os
import re
import statistics
import sys

GIB = 2.0 ** 30
KINDS = ("ours", "compute", "fsdp2", "fsdp2-offload")

# Targets of issue 4.
T_COMPUTE, T_COMPUTE_MIN_TOKENS = 0.95, 65536
T_FSDP2, T_OFFLOAD, T_SCALING, T_HOST = 1.5, 4.0, 1.95, 13.1

# hidden, layers, heads, kv heads, intermediate, tied, vocab, head_dim (common/model/qwen3_config.cc)
PRESETS = {
    "qwen3-0.6b": (1024, 28, 16, 8, 3072, True, 151936, 128),
    "qwen3-1.7b": (2048, 28, 16, 8, 6144, True, 151936, 128),
    "qwen3-4b": (2560, 36, 32, 8, 9728, True, 151936, 128),
    "qwen3-8b": (4096, 36, 32, 8, 12288, False, 151936, 128),
    "qwen3-14b": (5120, 40, 40, 8, 17408, False, 151936, 128),
    "qwen3-32b": (5120, 64, 64, 8, 25600, False, 151936, 128),
    "tiny": (64, 2, 4, 2, 128, True, 512, 16),
}


def preset_params(model):
    """Parameter count as HF counts it (tied head counted once)."""
    if model not in PRESETS:
        return None
    h, layers, nh, kv, inter, tied, vocab, hd = PRESETS[model]
    per_layer = h * nh * hd + 2 * h * kv * hd + nh * hd * h + 2 * hd + 3 * h * inter + 2 * h
    return layers * per_layer + vocab * h + h + (0 if tied else vocab * h)


def read(path, default=None):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return default


def json_lines(text):
    out = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


ERROR_RE = re.compile(r"error|exception|failed|fatal|traceback|killed|abort|^[EF]\d{4} ", re.IGNORECASE)


def error_text(log, rc, extra_logs=()):
    """A short reason for a failed stage: OOM first, then the time cap, then the last error line."""
    texts = [log or ""] + [t or "" for t in extra_logs]
    for t in texts:
        for line in t.splitlines():
            if "out of memory" in line.lower() or "outofmemory" in line.lower():
                return "OOM: " + line.strip()[:200]
    if rc in (124, 137):
        last = ""
        for t in texts[1:]:
            hits = [l.strip() for l in t.splitlines() if re.match(r"^[EF]\d{4} ", l)]
            if hits:
                last = "; last logged error: " + hits[-1][:160]
        return f"hit its time cap (exit {rc}){last}"
    for t in texts:
        lines = [l.strip() for l in t.splitlines() if l.strip() and not l.startswith("===")]
        hits = [l for l in lines if ERROR_RE.search(l)]
        if hits:
            return hits[-1][:200]
    lines = [l.strip() for l in (log or "").splitlines() if l.strip() and not l.startswith("===")]
    return (lines[-1][:200] if lines else "no output") + (f" (exit {rc})" if rc is not None else "")


def stage_common(d):
    meta = json.loads(read(os.path.join(d, "meta.json"), "{}") or "{}")
    r = dict(meta)
    r["dir"] = d
    rc_text = read(os.path.join(d, "rc"))
    r["rc"], r["wall_s"] = None, None
    if rc_text:
        parts = rc_text.split()
        r["rc"] = int(parts[0])
        r["wall_s"] = int(parts[1]) if len(parts) > 1 else None
    skipped = read(os.path.join(d, "skipped"))
    if skipped:
        r["error"] = skipped.strip()
    mem = read(os.path.join(d, "hostmem"))
    if mem and len(mem.split()) == 2:
        base, low = (int(x) for x in mem.split())
        r["host_sampled_gib"] = max(0, base - low) / 2 ** 20
    return r


def parse_ours(d):
    r = stage_common(d)
    log = read(os.path.join(d, "stage.log"), "")
    rows = []
    for p in sorted(glob.glob(os.path.join(d, "out", "metrics-*.jsonl"))):
        rows += json_lines(read(p, ""))
    r["steps_seen"] = len(rows)
    steady = [m for m in rows if m.get("step", 0) >= 2]
    if not steady and rows:
        steady = rows
        r["note"] = "only the warm-up step finished"
    if steady:
        med = lambda k: statistics.median(float(m.get(k, 0) or 0) for m in steady)  # noqa: E731
        gpus = steady[-1].get("world_size", r.get("gpus", 1)) or 1
        r["gpus"] = gpus
        r["step_s"] = med("step_time_s")
        r["tokens_per_s"] = med("tokens_per_s")
        r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / gpus
        r["model_tflops"] = med("model_tflops")
        r["update_gparams_per_s"] = med("host_update_gparams_per_s")  # LayerAdam's rate in place
        # Whether the host is hidden (issue 20) and what speculative clipping did.
        hidden = [float(m["host_hidden_fraction"]) for m in steady if m.get("host_hidden_fraction") is not None]
        r["host_hidden_fraction"] = statistics.median(hidden) if hidden else None
        r["speculated_fraction"] = med("speculated_fraction")
        r["rolled_back_steps"] = sum(1 for m in steady if m.get("speculation_rolled_back"))
        r["grad_norm"] = med("grad_norm")
        r["gpu_peak_gib"] = max(float(m.get("gpu_peak_bytes", 0) or 0) for m in rows) / GIB
        hs = [float(m["host_state_bytes"]) for m in rows if m.get("host_state_bytes")]
        r["host_state_gib"] = max(hs) / GIB if hs else None
        keys = []
        for m in steady:
            for k in (m.get("busy_s") or {}):
                if k not in keys:
                    keys.append(k)
        r["busy_s"] = {k: statistics.median(float((m.get("busy_s") or {}).get(k, 0) or 0) for m in steady) for k in keys}
        r["loss_first"], r["loss_last"] = rows[0].get("loss"), rows[-1].get("loss")
        r["tokens_per_step"] = steady[-1].get("tokens")
        want = r.get("tokens_per_gpu", 0) * gpus
        if r["tokens_per_step"] is not None and want and r["tokens_per_step"] != want:
            r["note"] = f"the job reports {r['tokens_per_step']} tokens per step, expected {want}"
    run_logs = [read(p, "") for p in sorted(glob.glob(os.path.join(d, "run", "*.log")))]
    if "error" not in r and (r["rc"] != 0 or not steady):
        r["error"] = error_text(log, r["rc"], run_logs) if r["rc"] is not None else "did not run"
    return r


def parse_json_stage(d, want, fields):
    """compute / fsdp2 stages: the last JSON line for which want(json) holds, its values copied
    into the result under our names (fields: {our name: its JSON key})."""
    r = stage_common(d)
    log = read(os.path.join(d, "stage.log"), "")
    found = [j for j in json_lines(log) if want(j)]
    if found:
        r["json"] = found[-1]
        for ours, theirs in fields.items():
            r[ours] = r["json"].get(theirs)
        r["tokens_per_s_per_gpu"] = float(r.get("tokens_per_s_per_gpu") or 0)
    elif "error" not in r:
        r["error"] = error_text(log, r["rc"]) if r["rc"] is not None else "did not run"
    return r


def parse_compute(d):
    return parse_json_stage(d, lambda j: j.get("mode") == "compute_only" or "tokens_per_s" in j,
                            {"tokens_per_s_per_gpu": "tokens_per_s", "model_tflops": "model_tflops",
                             "gpu_peak_gib": "peak_gib", "step_s": "step_s"})


def parse_fsdp(d):
    return parse_json_stage(d, lambda j: "peer" in j,
                            {"tokens_per_s_per_gpu": "tokens_per_s_per_gpu", "model_tflops": "model_tflops_per_gpu",
                             "gpu_peak_gib": "peak_gib", "step_s": "step_s", "params_b": "params_b"})


def collect(work):
    """{(model, seq, tokens): {"compute": r, gpus: {kind: r}}}"""
    res = {}
    for tdir in glob.glob(os.path.join(work, "runs", "*", "s*", "t*")):
        model = os.path.basename(os.path.dirname(os.path.dirname(tdir)))
        try:
            seq = int(os.path.basename(os.path.dirname(tdir))[1:])
            tokens = int(os.path.basename(tdir)[1:])
        except ValueError:
            continue
        entry = res.setdefault((model, seq, tokens), {"by_gpus": {}})
        if os.path.isdir(os.path.join(tdir, "compute")):
            entry["compute"] = parse_compute(os.path.join(tdir, "compute"))
        for gdir in glob.glob(os.path.join(tdir, "g*")):
            try:
                g = int(os.path.basename(gdir)[1:])
            except ValueError:
                continue
            kinds = entry["by_gpus"].setdefault(g, {})
            for kind in ("ours", "fsdp2", "fsdp2-offload"):
                d = os.path.join(gdir, kind)
                if os.path.isdir(d):
                    kinds[kind] = parse_ours(d) if kind == "ours" else parse_fsdp(d)
    return res


def tok_label(t):
    return f"{t // 1024}K" if t >= 1024 and t % 1024 == 0 else str(t)


def fmt(x, spec=".1f", none="—"):
    if x is None:
        return none
    if spec == "int":
        return f"{x:,.0f}"
    return format(x, spec)


def ok(r):
    return r is not None and "error" not in r and r.get("tokens_per_s_per_gpu")


def cell(r, key, spec=".1f"):
    if r is None:
        return "—"
    if "error" in r:
        if key != "tokens_per_s_per_gpu":
            return "—"
        return "skipped" if r["error"].startswith("skipped") else "OOM" if r["error"].startswith("OOM") else "FAIL"
    return fmt(r.get(key), spec)


def verdict(value, target, higher=True):
    if value is None:
        return "—"
    met = value >= target if higher else value <= target
    return f"{value:.2f} ({'met' if met else 'NOT met'})"


def params_for(model, entry):
    p = preset_params(model)
    if p:
        return p
    for kinds in entry["by_gpus"].values():
        for kind in ("fsdp2", "fsdp2-offload"):
            r = kinds.get(kind)
            if r and r.get("params_b"):
                return r["params_b"] * 1e9
    return None


def ratio_cell(value, target, peer):
    """The ratio against a peer, or why there is none when ours ran and the peer did not."""
    if value is None and peer is not None and "error" in peer and peer["error"].startswith("OOM"):
        return "peer OOM"
    return verdict(value, target)


def ratio(a, b):
    if not ok(a) or not ok(b):
        return None
    return a["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]


def summarize(work, res):
    md = ["# End-to-end benchmark (bench/e2e/run_bench.sh)", ""]
    env = read(os.path.join(work, "env.txt"), "")
    md += [f"    {l}" for l in env.strip().splitlines()] + [""]
    md += ["Tokens/s are per GPU; ours = median over steps >= 2 of the job's metrics (step 1 is the "
           "warm-up); model TFLOP/s count no recompute (same convention as fsdp2_qwen3.py). "
           "\"FAIL\": see the stage status below and bench-logs.txt.", ""]
    targets = {"compute": [], "fsdp2": [], "offload": [], "host": [], "scaling": []}
    sections = []
    configs = sorted({(m, s, g) for (m, s, _t), e in res.items() for g in e["by_gpus"]})
    for model, seq, g in configs:
        toks = sorted(t for (m, s, t), e in res.items() if m == model and s == seq and g in e["by_gpus"])
        sec = [f"## {model}, {g} GPU{'s' if g > 1 else ''}, seq {seq}", "",
               "| tokens/GPU/step | ours tok/s/GPU | ours TFLOP/s | ours GPU peak GiB | host GiB/B (≤ 13.1) "
               "| compute-only tok/s | ours/compute (≥ 0.95 at ≥ 64K) | FSDP2 tok/s/GPU | ours/FSDP2 (≥ 1.5) "
               "| FSDP2-offload tok/s/GPU | ours/offload (≥ 4) |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        busy_rows, detail_rows, busy_keys = [], [], []
        for t in toks:
            e = res[(model, seq, t)]
            kinds = e["by_gpus"][g]
            ours, comp = kinds.get("ours"), e.get("compute")
            f2, off = kinds.get("fsdp2"), kinds.get("fsdp2-offload")
            params = params_for(model, e)
            host_b = None
            if ours and ours.get("host_state_gib") and params:
                host_b = ours["host_state_gib"] / (params / 1e9)
            rc, rf, ro = ratio(ours, comp), ratio(ours, f2), ratio(ours, off)
            label = f"{model} {g} GPU {tok_label(t)}"
            if rc is not None:
                if t >= T_COMPUTE_MIN_TOKENS:
                    targets["compute"].append((label, rc, rc >= T_COMPUTE))
                rc_cell = verdict(rc, T_COMPUTE) if t >= T_COMPUTE_MIN_TOKENS else f"{rc:.2f} (below 64K)"
            else:
                rc_cell = "—"
            if rf is not None:
                targets["fsdp2"].append((label, rf, rf >= T_FSDP2))
            if ro is not None:
                targets["offload"].append((label, ro, ro >= T_OFFLOAD))
            if host_b is not None:
                targets["host"].append((label, host_b, host_b <= T_HOST))
            sec.append(f"| {t:,} | {cell(ours, 'tokens_per_s_per_gpu', 'int')} | {cell(ours, 'model_tflops')} "
                       f"| {cell(ours, 'gpu_peak_gib')} | {verdict(host_b, T_HOST, higher=False)} "
                       f"| {cell(comp, 'tokens_per_s_per_gpu', 'int')} | {rc_cell} "
                       f"| {cell(f2, 'tokens_per_s_per_gpu', 'int')} | {ratio_cell(rf, T_FSDP2, f2)} "
                       f"| {cell(off, 'tokens_per_s_per_gpu', 'int')} | {ratio_cell(ro, T_OFFLOAD, off)} |")
            if ok(ours):
                for k in ours.get("busy_s", {}):
                    if k not in busy_keys:
                        busy_keys.append(k)
                busy_rows.append((t, ours))
            host_s = lambda r: fmt(r.get("host_sampled_gib")) if r and "host_sampled_gib" in r else "—"  # noqa: E731
            detail_rows.append(
                f"| {t:,} | {cell(ours, 'step_s', '.2f')} | {host_s(ours)} | {fmt(ours.get('host_state_gib') if ours else None)} "
                f"| {cell(comp, 'step_s', '.2f')} | {cell(comp, 'model_tflops')} | {cell(comp, 'gpu_peak_gib')} "
                f"| {cell(f2, 'step_s', '.2f')} | {cell(f2, 'model_tflops')} | {cell(f2, 'gpu_peak_gib')} "
                f"| {cell(off, 'step_s', '.2f')} | {cell(off, 'model_tflops')} | {cell(off, 'gpu_peak_gib')} | {host_s(off)} |")
        sec += ["", "Step times, model TFLOP/s per GPU, GPU peak GiB, host memory (GiB: ours' host_state_bytes, "
                "and the sampled drop of MemAvailable while the stage ran):", "",
                "| tokens/GPU | ours step s | ours host sampled | ours host_state | compute step s | compute TFLOP/s "
                "| compute peak | FSDP2 step s | FSDP2 TFLOP/s | FSDP2 peak | offload step s | offload TFLOP/s "
                "| offload peak | offload host sampled |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + detail_rows
        if busy_rows:
            sec += ["", "Ours, per-resource busy time per step (s, median over steps >= 2; worker_* are the "
                    "slowest rank's):", "",
                    "| tokens/GPU | step | " + " | ".join(busy_keys) + " |",
                    "|---:|---:|" + "---:|" * len(busy_keys)]
            for t, r in busy_rows:
                sec.append(f"| {t:,} | {r['step_s']:.3f} | " +
                           " | ".join(f"{r['busy_s'].get(k, 0):.3f}" for k in busy_keys) + " |")
        sections += sec + [""]

    # Each system at its best batch: the peer often cannot fit the batches we run (it keeps the
    # whole model state on the GPU), so the same-batch ratios above understate the comparison.
    best_rows = []
    for model, seq, g in configs:
        def best(kind):
            rs = [e["by_gpus"][g].get(kind) for (m, s, _t), e in res.items() if m == model and s == seq and g in e["by_gpus"]]
            rs = [r for r in rs if ok(r) and r.get("tokens_per_s_per_gpu")]
            return max(rs, key=lambda r: r["tokens_per_s_per_gpu"]) if rs else None
        ours = best("ours")
        if not ours:
            continue
        for kind, target, key in (("fsdp2", T_FSDP2, "fsdp2"), ("fsdp2-offload", T_OFFLOAD, "offload")):
            peer = best(kind)
            if not peer:
                continue
            r = ours["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"]
            label = f"{model} {g} GPU best vs best"
            targets[key].append((label, r, r >= target))
            best_rows.append(f"| {model} | {g} | {kind} | {ours['tokens_per_s_per_gpu']:,.0f} "
                             f"({tok_label(ours.get('tokens_per_gpu', 0))}) | {peer['tokens_per_s_per_gpu']:,.0f} "
                             f"({tok_label(peer.get('tokens_per_gpu', 0))}) | {verdict(r, target)} |")
    if best_rows:
        sections += ["## Each system at its best batch (tokens/s/GPU)", "",
                     "| model | GPUs | peer | ours (tokens/GPU) | peer (tokens/GPU) | ours/peer |",
                     "|---|---:|---|---:|---:|---:|"] + best_rows + [""]

    # 1 -> 2 GPU scaling at the same tokens per GPU.
    scaling = []
    for (model, seq, t), e in sorted(res.items()):
        one, two = e["by_gpus"].get(1, {}).get("ours"), e["by_gpus"].get(2, {}).get("ours")
        if ok(one) and ok(two):
            s = two["tokens_per_s"] / one["tokens_per_s"]
            scaling.append(f"| {model} | {seq} | {t:,} | {one['tokens_per_s']:,.0f} | {two['tokens_per_s']:,.0f} "
                           f"| {verdict(s, T_SCALING)} |")
            targets["scaling"].append((f"{model} {tok_label(t)}/GPU", s, s >= T_SCALING))
    if scaling:
        sections += ["## Scaling 1 -> 2 GPUs (ours, same tokens per GPU)", "",
                     "| model | seq | tokens/GPU | 1 GPU tok/s | 2 GPUs tok/s (total) | ratio (≥ 1.95) |",
                     "|---|---:|---:|---:|---:|---:|"] + scaling + [""]

    md += ["## Targets", ""]
    names = [("compute", f"≥ {T_COMPUTE} of the compute-only mode at ≥ 64K tokens/GPU"),
             ("fsdp2", f"≥ {T_FSDP2}x FSDP2 GPU-resident tokens/s/GPU"),
             ("offload", f"≥ {T_OFFLOAD}x FSDP2 CPU-offload tokens/s/GPU"),
             ("scaling", f"≥ {T_SCALING}x from 1 to 2 GPUs at fixed per-GPU batch"),
             ("host", f"host memory ≤ {T_HOST} GiB per billion params")]
    for key, text in names:
        pts = targets[key]
        if not pts:
            md.append(f"- {text}: not measured")
            continue
        state = "MET" if all(p[2] for p in pts) else ("NOT met" if not any(p[2] for p in pts) else "partly met")
        md.append(f"- {text}: **{state}** — " + ", ".join(f"{l}: {v:.2f}{'' if m else ' ✗'}" for l, v, m in pts))
    md += [""] + sections

    md += ["## Stage status", "", "| stage | exit | wall s | result |", "|---|---:|---:|---|"]
    for (model, seq, t), e in sorted(res.items()):
        stages = [("compute", e.get("compute"))] + [
            (f"g{g}/{k}", r) for g, kinds in sorted(e["by_gpus"].items()) for k, r in kinds.items()]
        for name, r in stages:
            if r is None:
                continue
            what = f"error: {r['error']}" if "error" in r else "ok"
            if "error" not in r and r.get("note"):
                what += f" ({r['note']})"
            if r.get("loss_first") is not None:
                what += f"; loss {r['loss_first']:.4f} -> {r['loss_last']:.4f} over {r['steps_seen']} steps"
            what = what.replace("|", "/")
            md.append(f"| {model}/s{seq}/t{t}/{name} | {fmt(r.get('rc'), 'd')} | {fmt(r.get('wall_s'), 'd')} "
                      f"| {what} (started {r.get('started', '?')}) |")
    return "\n".join(md) + "\n"


def cut(text, head=40, tail=160):
    lines = text.splitlines()
    if len(lines) <= head + tail:
        return text
    return "\n".join(lines[:head] + [f"... [{len(lines) - head - tail} lines cut] ..."] + lines[-tail:]) + "\n"


def write_logs(work, path):
    with open(path, "w") as f:
        f.write("##### progress\n" + (read(os.path.join(work, "progress.log"), "") or "") + "\n")
        for d in sorted(glob.glob(os.path.join(work, "runs", "*", "s*", "t*", "**"), recursive=True)):
            if not os.path.isfile(os.path.join(d, "meta.json")):
                continue
            rel = os.path.relpath(d, os.path.join(work, "runs"))
            for name in ("meta.json", "job.yaml", "data.log", "stage.log"):
                text = read(os.path.join(d, name))
                if text:
                    f.write(f"\n##### {rel}/{name}\n{cut(text)}\n")
            for p in sorted(glob.glob(os.path.join(d, "out", "metrics-*.jsonl"))):
                f.write(f"\n##### {rel}/out/{os.path.basename(p)}\n{cut(read(p, ''), 20, 60)}\n")
            for p in sorted(glob.glob(os.path.join(d, "run", "*.log"))):
                f.write(f"\n##### {rel}/run/{os.path.basename(p)} (tail)\n{cut(read(p, ''), 0, 60)}\n")


def main():
    ap = argparse.ArgumentParser(description="summarize bench/e2e results")
    ap.add_argument("--work", required=True, help="run_bench.sh's WORK directory")
    ap.add_argument("--out", required=True, help="where bench-summary.md, bench-results.json, bench-logs.txt go")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = collect(a.work)
    with open(os.path.join(a.out, "bench-summary.md"), "w") as f:
        f.write(summarize(a.work, res))
    flat = []
    for (model, seq, t), e in sorted(res.items()):
        if e.get("compute"):
            flat.append(e["compute"])
        for _g, kinds in sorted(e["by_gpus"].items()):
            flat += list(kinds.values())
    with open(os.path.join(a.out, "bench-results.json"), "w") as f:
        json.dump(flat, f, indent=1, default=str)
    write_logs(a.work, os.path.join(a.out, "bench-logs.txt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
