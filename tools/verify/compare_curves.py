#!/usr/bin/env python3
"""Compares two loss curves step by step (issue 4's GPU verification): ours (hostd's
<output_dir>/metrics-<job>.jsonl) against the HF reference (hf_train_reference.py's JSON), or two
of ours (1 GPU against 2 GPUs at the same global batch). Either file may be in either format.

  python3 tools/verify/compare_curves.py OURS.jsonl REFERENCE.json [--tol 6e-4] [--steps N]
      [--table] [--json OUT.json]

Prints the maximum and mean absolute loss difference over the common steps (and where the
maximum is), and the verdict max |diff| <= tol. --steps N requires steps 1..N in both files.
When a file is an hf_train_reference.py run with --probe-fp32, also prints the steps that differ
most with that reference's own |loss - FP32 loss| on the same batch and weights beside each (how
much the batch's loss moves with the arithmetic alone), and that sensitivity's median.
Exit status 0 pass, 1 fail, 2 for unusable input. Pure Python (no numpy/torch).
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_common  # noqa: E402


def compare(a, b, steps=0):
    """Summary dict of curves a, b ({step: loss})."""
    if steps:
        want = set(range(1, steps + 1))
        missing_a, missing_b = sorted(want - set(a)), sorted(want - set(b))
        if missing_a or missing_b:
            raise ValueError(f"missing steps: first file {missing_a[:5]}, second file {missing_b[:5]}")
        common = sorted(want)
    else:
        common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two curves have no step in common")
    diffs = [(abs(a[s] - b[s]), s) for s in common]
    nonfinite = [s for s in common if not (math.isfinite(a[s]) and math.isfinite(b[s]))]
    worst, worst_step = max(diffs)
    return {"steps": len(common), "first_step": common[0], "last_step": common[-1],
            "max_abs_diff": worst, "max_at_step": worst_step,
            "mean_abs_diff": sum(d for d, _ in diffs) / len(diffs),
            "first_loss": [a[common[0]], b[common[0]]], "last_loss": [a[common[-1]], b[common[-1]]],
            "nonfinite_steps": nonfinite[:10], "only_in_first": len(set(a) - set(common)),
            "only_in_second": len(set(b) - set(common))}


def sensitivity(a, b, ref, probe, top=5):
    """Where curves a and b differ most, the reference's (ref, a {step: loss} that holds probe's
    steps) |loss - FP32 probe| on the same batch: [(step, |a - b|, sensitivity)], and the median
    sensitivity over the probed steps."""
    steps = sorted(set(a) & set(b) & set(probe) & set(ref))
    if not steps:
        return [], None
    sens = {s: abs(ref[s] - probe[s]) for s in steps}
    worst = sorted(steps, key=lambda s: -abs(a[s] - b[s]))[:top]
    ordered = sorted(sens.values())
    return [(s, abs(a[s] - b[s]), sens[s]) for s in worst], ordered[len(ordered) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("first", help="our metrics JSONL (or a curve JSON)")
    ap.add_argument("second", help="the reference curve JSON (or metrics JSONL)")
    ap.add_argument("--tol", type=float, default=6e-4, help="max |loss difference| allowed")
    ap.add_argument("--steps", type=int, default=0, help="require steps 1..N in both")
    ap.add_argument("--table", action="store_true", help="print every step")
    ap.add_argument("--json", default="", help="write the summary here")
    args = ap.parse_args()
    try:
        a, b = hf_common.load_curve(args.first), hf_common.load_curve(args.second)
        r = compare(a, b, args.steps)
    except (OSError, ValueError) as e:
        print(f"compare_curves: {e}", file=sys.stderr)
        return 2
    if args.table:
        print(f"{'step':>6s} {'first':>12s} {'second':>12s} {'diff':>10s}")
        for s in range(r["first_step"], r["last_step"] + 1):
            if s in a and s in b:
                print(f"{s:6d} {a[s]:12.6f} {b[s]:12.6f} {a[s] - b[s]:10.2e}")
    ok = r["max_abs_diff"] <= args.tol and not r["nonfinite_steps"]
    r.update({"tol": args.tol, "pass": ok, "first": args.first, "second": args.second})
    print(f"{r['steps']} common steps ({r['first_step']}..{r['last_step']}): max |loss diff| {r['max_abs_diff']:.3e} "
          f"at step {r['max_at_step']}, mean {r['mean_abs_diff']:.3e}; loss {r['first_loss'][0]:.4f}/"
          f"{r['first_loss'][1]:.4f} -> {r['last_loss'][0]:.4f}/{r['last_loss'][1]:.4f}")
    print(f"verdict: max |diff| {'<=' if ok else '>'} {args.tol:g} -> {'PASS' if ok else 'FAIL'}")
    for path, ref in ((args.second, b), (args.first, a)):
        probe = hf_common.load_probe(path)
        rows, median = sensitivity(a, b, ref, probe)
        if rows:
            r["probe_median"] = median
            r["probe_at_worst"] = [[s, d, v] for s, d, v in rows]
            print(f"where they differ most, {os.path.basename(path)}'s own |loss - FP32 loss| on the batch "
                  f"(median {median:.2e}): " + ", ".join(f"step {s}: {d:.2e} vs {v:.2e}" for s, d, v in rows))
            break
    print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
