#!/usr/bin/env python3
"""Issue 20's verdicts from the `clip` part: ours with clipping against ours without, our own
compute-only mode and FSDP2 GPU-resident, all at one batch in one run.

Reads DIR/<variant>/bench-results.json (bench/e2e/run_bench.sh with OUT=DIR/<variant>) for the
variants spec (clipping at 1.0, speculative), high (clipping with a threshold the norm never
reaches: every step commits), wait (speculation_bytes 0: the updates wait for the norm), noclip,
and peers (compute-only and FSDP2). Prints summary lines: PASS/FAIL for the targets, INFO for
the figures (step time, gate wait, host_update, host_hidden_fraction, speculated fraction,
rolled-back steps, median grad norm).

    clip_check.py --dir DIR --model qwen3-4b --tokens 16384
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_results import load, pick, usable  # noqa: E402
from suite_parts import threshold  # noqa: E402

T_COMPUTE = threshold("clip", "compute")   # clip / compute-only
T_FSDP2 = threshold("clip", "fsdp2")       # clip / FSDP2 GPU-resident, same batch
T_STEP = threshold("clip", "step")         # clip step / no-clip step


def line(status, text):
    return f"{status:<4} {'clip':<11} {text}"


def figures(name, r):
    busy = r.get("busy_s") or {}
    hidden = r.get("host_hidden_fraction")
    return (f"{name}: {r['tokens_per_s_per_gpu']:,.0f} tok/s, step {r.get('step_s', 0):.3f} s, gate wait "
            f"{busy.get('worker_gate_wait', 0):.3f} s, host_update {busy.get('host_update', 0):.3f} s, "
            f"host hidden {'—' if hidden is None else f'{hidden:.2f}'}, speculated "
            f"{r.get('speculated_fraction') or 0:.2f}, rolled back {r.get('rolled_back_steps', 0)} step(s), "
            f"grad norm {r.get('grad_norm') or 0:.3g}")


def check(args):
    out = []
    rec = {}
    for v in ("spec", "high", "wait", "noclip"):
        rec[v] = pick(load(os.path.join(args.dir, v, "bench-results.json")), "ours", args.model, args.tokens)
    peers = load(os.path.join(args.dir, "peers", "bench-results.json"))
    comp = pick(peers, "compute", args.model, args.tokens)
    fsdp = pick(peers, "fsdp2", args.model, args.tokens)
    k = f"{args.model} {args.tokens // 1024}K"
    for v, r in rec.items():
        if usable(r):
            out.append(line("INFO", f"{k} {figures(v, r)}"))
        elif r is not None or v in ("spec", "noclip"):
            out.append(line("FAIL" if v in ("spec", "noclip") else "INFO",
                            f"{k} {v}: {(r or {}).get('error', 'did not run')}"[:300]))
    if usable(comp):
        out.append(line("INFO", f"{k} compute-only: {comp['tokens_per_s_per_gpu']:,.0f} tok/s"))
    if usable(fsdp):
        out.append(line("INFO", f"{k} FSDP2 GPU-resident: {fsdp['tokens_per_s_per_gpu']:,.0f} tok/s"))
    # The gates: clipping on with the default threshold (spec), and the same where the norm never
    # clips (high), which is what a fine-tune below its threshold sees.
    for v in ("spec", "high"):
        r = rec[v]
        if not usable(r):
            continue
        if usable(comp):
            x = r["tokens_per_s_per_gpu"] / comp["tokens_per_s_per_gpu"]
            out.append(line("PASS" if x >= T_COMPUTE else "FAIL",
                            f"{k} {v} / compute-only: {x:.3f} (>= {T_COMPUTE:g})"))
        if usable(fsdp):
            x = r["tokens_per_s_per_gpu"] / fsdp["tokens_per_s_per_gpu"]
            out.append(line("PASS" if x >= T_FSDP2 else "FAIL", f"{k} {v} / FSDP2 GPU-resident: {x:.3f} (>= {T_FSDP2:g})"))
        if usable(rec["noclip"]):
            x = r["step_s"] / rec["noclip"]["step_s"]
            out.append(line("PASS" if x <= T_STEP else "FAIL", f"{k} {v} step / no-clip step: {x:.3f} (<= {T_STEP:g})"))
    # Further variants (CLIP_VARIANTS names beyond the four, e.g. bf16 gradients): figures and
    # their ratios, for the record.
    extra = sorted(d for d in (os.listdir(args.dir) if os.path.isdir(args.dir) else [])
                   if d not in rec and d != "peers" and os.path.isfile(os.path.join(args.dir, d, "bench-results.json")))
    for v in extra:
        r = pick(load(os.path.join(args.dir, v, "bench-results.json")), "ours", args.model, args.tokens)
        if not usable(r):
            out.append(line("INFO", f"{k} {v}: {(r or {}).get('error', 'did not run')}"[:300]))
            continue
        ratios = []
        if usable(comp):
            ratios.append(f"/ compute-only {r['tokens_per_s_per_gpu'] / comp['tokens_per_s_per_gpu']:.3f}")
        if usable(fsdp):
            ratios.append(f"/ FSDP2 {r['tokens_per_s_per_gpu'] / fsdp['tokens_per_s_per_gpu']:.3f}")
        if usable(rec["noclip"]):
            ratios.append(f"step / no-clip step {r['step_s'] / rec['noclip']['step_s']:.3f}")
        out.append(line("INFO", f"{k} {figures(v, r)}; {', '.join(ratios)}"))
    if usable(rec["wait"]) and usable(rec["spec"]):
        x = rec["wait"]["step_s"] / rec["spec"]["step_s"]
        out.append(line("INFO", f"{k} step of the path that waits for the norm / speculative: {x:.3f}"))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--model", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args(argv)
    lines = check(args)
    print("\n".join(lines))
    return 1 if any(x.startswith("FAIL") for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
