#!/usr/bin/env python3
"""Compares the weights of two checkpoints (our checkpoint-<N> directories or HF model dirs):
every tensor in model*.safetensors of both, by max |a-b| and relative L2 error ||a-b|| / ||b||.

  python3 tools/verify/compare_params.py DIR_A DIR_B [--tol-rel 1e-5] [--json OUT.json]
      [--common-only] [--rows TENSOR --batches BATCHES.bin --steps 139,199]

Prints the worst tensors and a verdict (max relative L2 <= tol). Exit 0 pass, 1 fail, 2 unusable
input. --common-only compares the tensors both directories hold (e.g. ours against an HF
save_pretrained, which may name a tied head differently) instead of failing on the difference.

--rows TENSOR (a 2-D tensor, e.g. model.embed_tokens.weight) also reports how far each row has
drifted (||a_r - b_r|| / ||b_r||): the distribution over rows, and with --batches (dump_batches
output) and --steps (1-based, as in the metrics) where the rows of each step's input tokens fall
in it: whether the batches on which two runs' losses part are the ones holding their most
drifted rows. Needs torch and safetensors (the GPU machine has both); the row report itself is
pure Python (tested in verify_py_test.py).
"""
import argparse
import glob
import json
import os
import sys


def load(d):
    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(d, "model*.safetensors")))
    if not files:
        raise ValueError(f"{d}: no model*.safetensors")
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def percentile_ranks(values):
    """Each value's fraction of values strictly below it (0 = smallest, close to 1 = largest)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    n = len(values)
    below = 0
    for pos, i in enumerate(order):
        if pos > 0 and values[i] > values[order[pos - 1]]:
            below = pos
        ranks[i] = below / n
    return ranks


def row_report(drift, step_tokens, top=5):
    """drift: per-row relative drift; step_tokens: {step: token ids of its batch}. Returns the
    distribution ({"median", "p99", "max", "max_row"}) and per step {"rows": distinct rows,
    "median_rank": the median percentile rank of its rows' drift, "top": [(row, drift)...]}."""
    ordered = sorted(drift)
    n = len(ordered)
    summary = {"rows": n, "median": ordered[n // 2], "p99": ordered[min(n - 1, (99 * n) // 100)],
               "max": ordered[-1], "max_row": max(range(n), key=lambda r: drift[r])}
    ranks = percentile_ranks(drift)
    per_step = {}
    for step, tokens in sorted(step_tokens.items()):
        rows = sorted(set(int(t) for t in tokens if 0 <= int(t) < n))
        if not rows:
            continue
        rr = sorted(ranks[r] for r in rows)
        per_step[step] = {"rows": len(rows), "median_rank": rr[len(rr) // 2],
                          "top": sorted(((r, drift[r]) for r in rows), key=lambda x: -x[1])[:top]}
    return summary, per_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol-rel", type=float, default=1e-5)
    ap.add_argument("--json")
    ap.add_argument("--common-only", action="store_true", help="compare the tensors both hold")
    ap.add_argument("--rows", default="", help="2-D tensor whose per-row drift to report")
    ap.add_argument("--batches", default="", help="dump_batches output, for --steps")
    ap.add_argument("--steps", default="", help="1-based steps whose batches' rows to place in the drift")
    args = ap.parse_args()
    try:
        a, b = load(args.a), load(args.b)
    except Exception as e:  # noqa: BLE001
        print(f"compare_params: {e}", file=sys.stderr)
        return 2
    if set(a) != set(b):
        print(f"compare_params: tensor names differ: {sorted(set(a) ^ set(b))[:5]}", file=sys.stderr)
        if not args.common_only or not set(a) & set(b):
            return 2
    rows = []
    for k in sorted(set(a) & set(b)):
        x, y = a[k].double(), b[k].double()
        diff = (x - y)
        rel = (diff.norm() / max(y.norm().item(), 1e-30)).item()
        rows.append((rel, diff.abs().max().item(), k))
    rows.sort(reverse=True)
    worst = rows[0]
    ok = worst[0] <= args.tol_rel
    print(f"{len(rows)} tensors; worst relative L2 {worst[0]:.3e} ({worst[2]}), max |diff| over all "
          f"{max(r[1] for r in rows):.3e}; tol {args.tol_rel:g}: {'PASS' if ok else 'FAIL'}")
    for rel, mx, k in rows[:5]:
        print(f"  {k}: rel L2 {rel:.3e}, max |diff| {mx:.3e}")
    result = {"worst_rel_l2": worst[0], "worst_tensor": worst[2], "max_abs": max(r[1] for r in rows), "pass": ok}
    if args.rows:
        if args.rows not in a or args.rows not in b or a[args.rows].dim() != 2:
            print(f"compare_params: --rows {args.rows}: not a 2-D tensor of both", file=sys.stderr)
            return 2
        x, y = a[args.rows].double(), b[args.rows].double()
        drift = ((x - y).norm(dim=1) / y.norm(dim=1).clamp_min(1e-30)).tolist()
        step_tokens = {}
        if args.batches and args.steps:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import hf_common
            batches = hf_common.BatchesFile(args.batches)
            for step in (int(v) for v in args.steps.split(",") if v.strip()):
                step_tokens[step] = list(batches.step(step - 1)[0])
        summary, per_step = row_report(drift, step_tokens)
        print(f"{args.rows}: per-row relative drift over {summary['rows']} rows: median {summary['median']:.3e}, "
              f"p99 {summary['p99']:.3e}, max {summary['max']:.3e} (row {summary['max_row']})")
        for step, r in per_step.items():
            print(f"  step {step}: {r['rows']} distinct rows, median drift rank {r['median_rank']:.2f}; most drifted: " +
                  ", ".join(f"row {row} {d:.2e}" for row, d in r["top"]))
        result["rows"] = {"tensor": args.rows, **summary, "steps": per_step}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
