#!/usr/bin/env python3
"""torch's CPU AdamW throughput (fused / foreach / single-tensor) beside bench_layeradam, same
parameter count and thread count, in one command, for the issue's >= 1.1x target.

    python3 bench/layeradam/torch_cpu_adamw.py --params 268435456 --threads 16 \
        --bench build/bin/bench_layeradam

Traffic convention: 28 B/param (read p, g, m, v; write p, m, v), as ../shared/bench/peers/cpu_probe.py.
Copy bandwidth: torch's y.copy_(x), counted read + write. The last line is one JSON object.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def run_layeradam(binary, params, threads, reps):
    cmd = [binary, "--params", str(params), "--threads", str(threads), "--reps", str(reps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    sys.stdout.write(out)
    return json.loads(out.strip().splitlines()[-1])


def timed(fn, reps):
    fn()  # warm-up (allocates optimizer state on the first step)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=1 << 27)
    ap.add_argument("--threads", type=int, default=0, help="0 = os.cpu_count()")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bench", default="", help="path of bench_layeradam to run first")
    args = ap.parse_args()
    threads = args.threads or os.cpu_count()
    n = args.params

    res = {"bench": "torch_cpu_adamw", "params": n, "threads": threads}
    if args.bench:
        res["layeradam"] = run_layeradam(args.bench, n, threads, args.reps)

    import torch  # after the C++ run, so the two never hold memory at once

    torch.set_num_threads(threads)
    res["torch"] = torch.__version__
    x = torch.empty(n)
    x.uniform_()
    y = torch.empty(n)
    dt = timed(lambda: y.copy_(x), args.reps)
    res["copy_GBps_rw"] = 2 * 4 * n / dt / 1e9
    del x, y

    p = torch.nn.Parameter(torch.randn(n) * 0.02)
    p.grad = torch.randn(n) * 1e-2
    for name, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}),
                     ("single_tensor", {"foreach": False})):
        try:
            opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, **kw)
            dt = timed(opt.step, args.reps)
            res[f"adamw_{name}_Gparam_per_s"] = n / dt / 1e9
            res[f"adamw_{name}_GBps_28B"] = 28 * n / dt / 1e9
            del opt
        except Exception as e:  # e.g. fused CPU AdamW missing in old torch
            res[f"adamw_{name}_error"] = str(e)[:200]
    if "layeradam" in res and "adamw_fused_Gparam_per_s" in res:
        res["layeradam_over_torch_fused"] = (res["layeradam"]["adam_Gparam_per_s"] /
                                             res["adamw_fused_Gparam_per_s"])
        res["layeradam_over_copy"] = res["layeradam"]["ratio_no_mirror"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
