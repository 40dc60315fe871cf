"""The FSDP2 peers' shared command line, start and training loop (fsdp2_qwen3_moe.py, fsdp2_qwen3_5.py,
fsdp2_sliding.py; fsdp2_qwen3.py is the shared peer's verbatim copy and keeps its own): every decoder
layer and the model fully_shard-ed with BF16 compute over FP32 master weights (MixedPrecisionPolicy),
fused torch AdamW at lr 1e-5, random ids with labels on every token; `accum` micro-batches of `mbs`
rows per optimizer step, gradients reduced once per step. train() returns (median step seconds after
3 warm-up steps, GPU peak GiB)."""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def peer_args(models, default):
    """The peers' command line: --model (one of `models`, or any where models is None), --seq, --mbs,
    --steps, --layers (a reduced depth; 0: the model's), --accum."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=default, choices=sorted(models) if models is not None else None)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--accum", type=int, default=1,
                    help="micro-batches of --mbs rows per optimizer step (gradient accumulation: the step's "
                         "tokens are mbs x seq x accum, its logits one micro-batch's)")
    return ap.parse_args()


def start():
    """The process group over NCCL and this rank's GPU (torchrun's LOCAL_RANK): (rank, world)."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


def train(model, vocab, seq, mbs, steps, accum, rank):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    times, peak = [], 0.0
    for step in range(steps):
        torch.cuda.synchronize()
        t0 = time.time()
        for m in range(accum):
            ids = torch.randint(0, vocab, (mbs, seq), device="cuda")
            if accum > 1 and hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(m == accum - 1)  # reduce-scatter once per step
            out = model(input_ids=ids, labels=ids)
            (out.loss / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.time() - t0)
        peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
        if rank == 0:
            print(f"step {step} loss {out.loss.item():.4f} {times[-1]:.3f}s", flush=True)
    return sorted(times[3:])[len(times[3:]) // 2], peak
