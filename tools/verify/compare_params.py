#!/usr/bin/env python3
"""Compares the weights of two checkpoints (our checkpoint-<N> directories or HF model dirs):
every tensor in model*.safetensors of both, by max |a-b| and relative L2 error ||a-b|| / ||b||.

  python3 tools/verify/compare_params.py DIR_A DIR_B [--tol-rel 1e-5] [--json OUT.json]

Prints the worst tensors and a verdict (max relative L2 <= tol). Exit 0 pass, 1 fail, 2 unusable
input. Needs torch and safetensors (the GPU machine has both).
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol-rel", type=float, default=1e-5)
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        a, b = load(args.a), load(args.b)
    except Exception as e:  # noqa: BLE001
        print(f"compare_params: {e}", file=sys.stderr)
        return 2
    if set(a) != set(b):
        print(f"compare_params: tensor names differ: {sorted(set(a) ^ set(b))[:5]}", file=sys.stderr)
        return 2
    rows = []
    for k in sorted(a):
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"worst_rel_l2": worst[0], "worst_tensor": worst[2], "max_abs": max(r[1] for r in rows),
                       "pass": ok}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
