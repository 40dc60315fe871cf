#!/usr/bin/env python3
"""Checks LayerAdam's output against torch.optim.AdamW (single-tensor path) on the same inputs.

    build/bin/bench_layeradam --dump /tmp/adam_dump [--isa avx2]
    python3 bench/layeradam/torch_adamw_compare.py /tmp/adam_dump

The dump (meta.json, theta0.f32, grad<t>.f32, theta.f32, m.f32, v.f32, mirror.bf16) holds the
initial weights, each step's gradient and hyper-parameters, and LayerAdam's state after the last
step. The script replays the steps with torch (clip coefficient applied as clip_grad_norm_ does,
p.grad.mul_(scale)), then reports bit-exact fractions and the largest differences in ULPs. It fails
(exit 1) if any element differs by more than --max-ulp or the mirror is not p.to(bfloat16).
"""
import argparse
import json
import os
import sys

import torch


def load(path, dtype, n):
    return torch.from_file(path, shared=False, size=n, dtype=dtype)


def ulp_diff(a, b):
    ia = a.view(torch.int32).to(torch.int64)
    ib = b.view(torch.int32).to(torch.int64)
    # map sign-magnitude to a monotonic integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return (ia - ib).abs()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--max-ulp", type=int, default=4)
    args = ap.parse_args()
    meta = json.load(open(os.path.join(args.dump, "meta.json")))
    n = meta["numel"]
    torch.set_num_threads(1)  # ATen's scalar/vector split does not depend on threads, but be plain
    p = torch.nn.Parameter(load(os.path.join(args.dump, "theta0.f32"), torch.float32, n).clone())
    opt = None
    for t, hp in enumerate(meta["per_step"], start=1):
        grad = load(os.path.join(args.dump, f"grad{t}.f32"), torch.float32, n).clone()
        if opt is None:
            opt = torch.optim.AdamW([p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]),
                                    eps=hp["eps"], weight_decay=hp["weight_decay"], foreach=False)
        g = opt.param_groups[0]
        g["lr"], g["weight_decay"], g["eps"] = hp["lr"], hp["weight_decay"], hp["eps"]
        g["betas"] = (hp["beta1"], hp["beta2"])
        p.grad = grad
        if hp["grad_scale"] != 1.0:
            p.grad.mul_(torch.tensor(hp["grad_scale"], dtype=torch.float32))
        opt.step()
    st = opt.state[p]
    ours = {name: load(os.path.join(args.dump, f"{name}.f32"), torch.float32, n)
            for name in ("theta", "m", "v")}
    theirs = {"theta": p.detach(), "m": st["exp_avg"], "v": st["exp_avg_sq"]}
    report = {"numel": n, "isa": meta.get("isa"), "torch": torch.__version__}
    ok = True
    for name in ("theta", "m", "v"):
        d = ulp_diff(ours[name], theirs[name])
        report[f"{name}_bit_exact_fraction"] = float((d == 0).double().mean())
        report[f"{name}_max_ulp"] = int(d.max())
        report[f"{name}_max_abs"] = float((ours[name] - theirs[name]).abs().max())
        ok &= int(d.max()) <= args.max_ulp
    mirror = load(os.path.join(args.dump, "mirror.bf16"), torch.int16, n)
    want = ours["theta"].to(torch.bfloat16).view(torch.int16)
    report["mirror_equals_theta_bf16"] = bool(torch.equal(mirror, want))
    ok &= report["mirror_equals_theta_bf16"]
    report["ok"] = bool(ok)
    print(json.dumps(report))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
