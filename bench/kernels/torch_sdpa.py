#!/usr/bin/env python3
"""Attention references for issue 3's choice "own kernels or cuDNN's fused attention": PyTorch's
scaled_dot_product_attention through its cuDNN backend (cuDNN's fused flash attention, the
engine a graph-API integration would get) and its flash backend (FlashAttention-2), on the same
cases bench_kernels times for our kernels: one causal document of T tokens, BF16, head_dim 128,
the q/kv head counts of Qwen3-4B/8B/14B; FLOPs 4*nq*hd*T(T+1)/2 forward and 2.5x that backward.

Prints one JSON line per (backend, model, T, direction), fields as bench_kernels' JSON lines:
  {"op": "torch_cudnn_attn_fwd_causal", "model": "qwen3-8b", "tokens": 4096, "ms": ..., "tflops": ...}
Usage (GPU machine): python3 bench/kernels/torch_sdpa.py [--quick]
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS = {"qwen3-4b": (32, 8), "qwen3-8b": (32, 8), "qwen3-14b": (40, 8)}
HEAD_DIM = 128


def time_ms(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def bench(backend, name, model, T, expand_kv=False):
    """expand_kv: K/V repeated to nq heads (same FLOPs) for a backend that refuses GQA."""
    nq, nkv = HEADS[model]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, nq, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(1, nkv, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(1, nkv, T, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    if expand_kv:
        k = k.detach().repeat_interleave(nq // nkv, dim=1).requires_grad_()
        v = v.detach().repeat_interleave(nq // nkv, dim=1).requires_grad_()
    fwd_flops = 4.0 * nq * HEAD_DIM * T * (T + 1) / 2
    rows = []
    try:
        with sdpa_kernel([backend]):
            def fwd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not expand_kv)

            ms_f = time_ms(lambda: fwd())
            o = fwd()
            do = torch.randn_like(o)

            def fwd_bwd():
                out = fwd()
                torch.autograd.backward(out, do)

            ms_fb = time_ms(fwd_bwd)
    except RuntimeError as e:  # the backend refused the case (e.g. GQA unsupported)
        print(f"# {name} {model} T={T} expand_kv={expand_kv}: {str(e).splitlines()[0]}", file=sys.stderr)
        return rows if expand_kv else bench(backend, name, model, T, expand_kv=True)
    ms_b = max(ms_fb - ms_f, 1e-6)
    for direction, ms, flops in (("fwd", ms_f, fwd_flops), ("bwd", ms_b, 2.5 * fwd_flops)):
        rows.append({"op": f"torch_{name}_attn_{direction}_causal", "model": model, "tokens": T, "ms": round(ms, 4),
                     "tflops": round(flops / ms / 1e9, 2), "gqa": "expanded" if expand_kv else "native"})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    models = ["qwen3-8b"] if args.quick else list(HEADS)
    tokens = [4096] if args.quick else [4096, 16384, 32768]
    print(f"# torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}",
          file=sys.stderr)
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
        for model in models:
            for T in tokens:
                for row in bench(backend, name, model, T):
                    print("JSON " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
