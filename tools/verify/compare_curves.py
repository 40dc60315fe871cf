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
With per-unit squared gradient norms on both sides (our worker log's SLIDEDP_LOG_UNIT_NORMS=1
lines, given by --first-units / --second-units, or an hf_train_reference.py --unit-norms JSON),
also prints the steps whose gradient norms part most and the units that carry the difference.
--bitwise (two of our runs that should repeat bit for bit, e.g. both in deterministic mode): the
first step whose loss or any unit's squared gradient norm differs at all, and the units that do.
Exit status 0 pass, 1 fail, 2 for unusable input. Pure Python (no numpy/torch).
"""
import argparse
import json
import math
import os
import re
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
            "worst_steps": [[st, d] for d, st in sorted(diffs, reverse=True)[:5]],
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


UNIT_LINE = re.compile(r"unit norms: step (\d+) unit (\d+) squares (\S+)")


def load_unit_squares(path):
    """{step: [squares per unit]} from an hf_train_reference.py --unit-norms JSON or from text with
    our workers' "unit norms: step S unit U squares X" lines (a repeated (step, unit) keeps its
    last value); {} when the file has neither."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("{") and '"curve"' in text[:100000]:
        try:
            return {int(r["step"]): [float(x) for x in r["unit_squares"]]
                    for r in json.loads(text)["curve"] if "unit_squares" in r}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            return {}
    by_step = {}
    for m in UNIT_LINE.finditer(text):
        by_step.setdefault(int(m.group(1)), {})[int(m.group(2))] = float(m.group(3))
    return {s: [u[i] for i in range(max(u) + 1)] for s, u in by_step.items() if sorted(u) == list(range(len(u)))}


def unit_gaps(a, b, top_steps=5, top_units=3):
    """Where two runs' gradient norms part most: for the top_steps steps (common to a and b, both
    {step: [squares per unit]} with the same units) with the largest relative difference of the
    total norms, [(step, norm_a, norm_b, [(unit, unit_norm_a, unit_norm_b), ...top_units])]."""
    steps = [s for s in sorted(set(a) & set(b)) if len(a[s]) == len(b[s])]
    norm = lambda sq: math.sqrt(max(sum(sq), 0.0))  # noqa: E731
    rel = {s: abs(norm(a[s]) - norm(b[s])) / max(norm(b[s]), 1e-30) for s in steps}
    rows = []
    for s in sorted(steps, key=lambda s: -rel[s])[:top_steps]:
        units = sorted(range(len(a[s])), key=lambda u: -abs(math.sqrt(max(a[s][u], 0.0)) - math.sqrt(max(b[s][u], 0.0))))
        rows.append((s, norm(a[s]), norm(b[s]),
                     [(u, math.sqrt(max(a[s][u], 0.0)), math.sqrt(max(b[s][u], 0.0))) for u in units[:top_units]]))
    return rows


def first_difference(a, b, ua=None, ub=None):
    """The first step (common to curves a and b, {step: loss}) at which the two runs differ at all:
    its loss or, where both have per-unit squared norms ({step: [squares]}), any unit's.
    None when equal; else (step, loss_a, loss_b, [(unit, squares_a, squares_b), ...])."""
    ua, ub = ua or {}, ub or {}
    for s in sorted(set(a) & set(b)):
        units = []
        if s in ua and s in ub:
            n = max(len(ua[s]), len(ub[s]))
            units = [(u, ua[s][u] if u < len(ua[s]) else None, ub[s][u] if u < len(ub[s]) else None)
                     for u in range(n)]
            units = [x for x in units if x[1] != x[2]]
        if a[s] != b[s] or units:
            return s, a[s], b[s], units
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("first", help="our metrics JSONL (or a curve JSON)")
    ap.add_argument("second", help="the reference curve JSON (or metrics JSONL)")
    ap.add_argument("--tol", type=float, default=6e-4, help="max |loss difference| allowed")
    ap.add_argument("--steps", type=int, default=0, help="require steps 1..N in both")
    ap.add_argument("--table", action="store_true", help="print every step")
    ap.add_argument("--json", default="", help="write the summary here")
    ap.add_argument("--first-units", default="", help="per-unit squared norms of the first run (worker log)")
    ap.add_argument("--second-units", default="", help="per-unit squared norms of the second run")
    ap.add_argument("--bitwise", action="store_true", help="also the first step where the runs differ at all")
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
    try:
        ua = load_unit_squares(args.first_units or args.first)
        ub = load_unit_squares(args.second_units or args.second)
    except OSError as e:
        print(f"compare_curves: {e}", file=sys.stderr)
        return 2
    if args.bitwise:
        d = first_difference(a, b, ua, ub)
        if d is None:
            r["first_difference"] = None
            print(f"bitwise: equal at all {r['steps']} common steps (loss" + (", unit norms)" if ua and ub else ")"))
        else:
            s, la, lb, units = d
            r["first_difference"] = [s, la, lb, [list(u) for u in units]]
            print(f"bitwise: first difference at step {s}: loss {la!r}/{lb!r}; {len(units)} units differ" +
                  (": " + ", ".join(f"unit {u} {x!r}/{y!r}" for u, x, y in units[:8]) if units else ""))
    gaps = unit_gaps(ua, ub)
    if gaps:
        r["unit_gaps"] = [[s, na, nb, [list(u) for u in units]] for s, na, nb, units in gaps]
        print("where the gradient norms part most (first/second; unit 0 = embedding, i = layer i - 1): " +
              "; ".join(f"step {s}: {na:.4g}/{nb:.4g} (" +
                        ", ".join(f"unit {u} {x:.4g}/{y:.4g}" for u, x, y in units) + ")"
                        for s, na, nb, units in gaps))
    print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
