#!/usr/bin/env python3
"""Per-tensor gradients of one training step, ours against HF, on a saved checkpoint.

For explaining a curve gap (e.g. gradient norms that part from HF's after a few fine-tuning
steps): take the checkpoint our job saved after step k (FP32, an HF-loadable directory), the
batches file of the job (dump_batches), and compare the gradients of step k's global batch:
ours through model_grads (the CUDA backend, non-streaming, BF16 weights, FP32 norms and FP32
embedding rows as the workers compute by default) against HF autocast and HF FP32 on the same
weights. Prints the total norms and the tensors that differ most, with HF's own autocast-vs-FP32
distance beside each, and ours against "HF mirror" (autocast at BF16-rounded weights but FP32
norms: it differs from autocast only in the embedding rows, which it looks up in BF16, as our
workers do with runtime.embedding_rows: bf16).

  python3 tools/verify/grad_diff.py --bin .gpu/bin/model_grads --model CKPT_DIR \\
      --batches BATCHES.bin --step K [--top 15] [--backend cuda] [--no-hf]

--repeat N runs model_grads N more times on the same inputs and reports, per tensor, whether the
gradients are bitwise the same as the first run's (run-to-run determinism of the backend; pure
Python, no PyTorch). --no-hf runs only the conversion and model_grads (no PyTorch needed; for
tests). Step K's
labels must be the next token inside each document (every token trained), which is what
model_grads' token format can express; other batches are refused.
"""
import argparse
import array
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_common  # noqa: E402


def token_batch_of(batches, step):
    """(model_grads token JSON, HF segments, trained tokens) of the global batch of `step`."""
    tokens, labels, positions, cu, meta = batches.step(step)
    segments = hf_common.segments_of(tokens, labels, positions, cu)
    for i, (toks, labs) in enumerate(segments):
        if labs != toks[1:] + [hf_common.IGNORE_INDEX]:
            raise SystemExit(f"step {step}, document {i}: labels are not the next tokens (masked data); "
                             "model_grads' token format cannot express that")
    trained = sum(len(t) - 1 for t, _ in segments)
    if trained != meta["trained_tokens"]:
        raise SystemExit(f"step {step}: {trained} trained tokens, the header says {meta['trained_tokens']}")
    return {"rows": [t for t, _ in segments]}, segments, trained


def run_model_grads(binary, model, tok_path, backend, out_path):
    cmd = [binary, "--model", model, "--tokens", tok_path, "--backend", backend, "--out", out_path,
           "--grouping", "single", "--policy", "keep-all"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"model_grads exited {p.returncode}: {(p.stderr or p.stdout).strip()[-600:]}")
    return [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")][-1]


def bitwise_differences(first, other):
    """[(name, differing F32 elements, max |difference|)] of two model_grads outputs, for every
    tensor whose bytes differ, in file order; pure Python."""
    _, ta = hf_common.read_safetensors_header(first)
    _, tb = hf_common.read_safetensors_header(other)
    if set(ta) != set(tb):
        raise SystemExit(f"{first} and {other} hold different tensors")
    with open(first, "rb") as fa, open(other, "rb") as fb:
        base_a = 8 + struct.unpack("<Q", fa.read(8))[0]
        base_b = 8 + struct.unpack("<Q", fb.read(8))[0]
        rows = []
        for name, (dtype, _, (begin, end)) in sorted(ta.items(), key=lambda kv: kv[1][2][0]):
            fa.seek(base_a + begin)
            fb.seek(base_b + tb[name][2][0])
            a, b = fa.read(end - begin), fb.read(tb[name][2][1] - tb[name][2][0])
            if a == b:
                continue
            if dtype != "F32" or len(a) != len(b):
                rows.append((name, -1, math.inf))
                continue
            va, vb = array.array("f", a), array.array("f", b)
            diff = [abs(x - y) for x, y in zip(va, vb) if x != y]
            rows.append((name, len(diff), max(diff)))
        return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="model_grads binary")
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    ap.add_argument("--batches", required=True, help="dump_batches output of the job")
    ap.add_argument("--step", type=int, required=True, help="0-based step whose batch to use")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--token-budget", type=int, default=16384, help="padded tokens per HF forward")
    ap.add_argument("--no-hf", action="store_true", help="only convert and run model_grads")
    ap.add_argument("--repeat", type=int, default=0, help="run model_grads this many more times, compare bitwise")
    args = ap.parse_args()

    batches = hf_common.BatchesFile(args.batches)
    tok, segments, trained = token_batch_of(batches, args.step)
    work = tempfile.mkdtemp(prefix="grad-diff-")
    tok_path, ours_path = os.path.join(work, "tokens.json"), os.path.join(work, "ours.safetensors")
    with open(tok_path, "w") as f:
        json.dump(tok, f)
    summary = run_model_grads(args.bin, args.model, tok_path, args.backend, ours_path)
    print(f"step {args.step}: {len(segments)} documents, {trained} trained tokens; ours ({args.backend}): "
          f"loss {summary.get('loss')}")
    for i in range(args.repeat):
        again = os.path.join(work, f"repeat-{i + 1}.safetensors")
        run_model_grads(args.bin, args.model, tok_path, args.backend, again)
        rows = bitwise_differences(ours_path, again)
        print(f"repeat {i + 1}: {len(rows)} tensors differ bitwise from the first run" + (":" if rows else ""))
        for name, count, worst in rows[:args.top]:
            print(f"  {name}: {count} elements, max |diff| {worst:.3e}")
    if args.no_hf:
        print(f"model_grads wrote {ours_path}")
        return

    import torch
    from safetensors.torch import load_file
    ours = {k: v.double() for k, v in load_file(ours_path).items()}
    loss_ours = float(ours.pop("loss")[0])
    model = hf_common.load_hf_model(args.model, torch.float32).cuda()
    model.train()

    def grads(autocast, mirror=False):
        # mirror: HF autocast at weights rounded to BF16 except the 1-D norm weights (our workers
        # with embedding_rows: bf16; it differs from autocast in the embedding rows), restored
        # afterwards.
        model.zero_grad(set_to_none=True)
        master = {}
        if mirror:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.dim() > 1:
                        master[n] = p.detach().clone()
                        p.copy_(p.to(torch.bfloat16).to(torch.float32))
        loss = hf_common.hf_loss_backward(model, segments, trained, args.token_budget, autocast=autocast)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in master:
                    p.copy_(master[n])
        return loss, {n: p.grad.detach().double().cpu().clone() for n, p in model.named_parameters()}

    loss_hf, g_hf = grads(True)
    loss_fp32, g_fp32 = grads(False)
    loss_mirror, g_mirror = grads(True, mirror=True)

    def total(g):
        return math.sqrt(sum(float((v * v).sum()) for v in g.values()))

    def rel(a, b):
        den = float(b.norm())
        return float((a - b).norm()) / den if den > 0 else (0.0 if float(a.norm()) == 0 else math.inf)

    print(f"loss: ours {loss_ours:.6f}, HF autocast {loss_hf:.6f}, HF fp32 {loss_fp32:.6f}, "
          f"HF mirror-fp32-norms {loss_mirror:.6f}")
    print(f"gradient norm: ours {total(ours):.6f}, HF autocast {total(g_hf):.6f}, HF fp32 {total(g_fp32):.6f}, "
          f"HF mirror-fp32-norms {total(g_mirror):.6f}")
    missing = sorted(set(g_hf) ^ set(ours))
    if missing:
        print(f"tensor names differ: {missing[:8]}")
    rows = []
    for name, ref in g_hf.items():
        if name in ours:
            rows.append((rel(ours[name], ref), name, float(ours[name].norm()), float(ref.norm()),
                         rel(g_fp32[name], ref), rel(ours[name], g_mirror[name])))
    rows.sort(reverse=True)
    # Last column: ours against HF computing our arithmetic; where it is well below the first
    # column, the difference from HF autocast is the BF16 embedding rows, not our kernels.
    print(f"{'tensor':55s} {'rel L2 vs HF':>12s} {'|ours|':>11s} {'|HF|':>11s} {'HF fp32 vs HF':>13s} "
          f"{'vs HF mirror':>12s}")
    for r, name, n_ours, n_hf, floor, vs_mirror in rows[:args.top]:
        print(f"{name[-55:]:55s} {r:12.3e} {n_ours:11.4e} {n_hf:11.4e} {floor:13.3e} {vs_mirror:12.3e}")
    by_norm = sorted(rows, key=lambda x: -abs(x[2] ** 2 - x[3] ** 2))[:5]
    print("largest contributions to the squared-norm difference: " +
          ", ".join(f"{n} ({a ** 2 - b ** 2:+.4e})" for _, n, a, b, _, _ in by_norm))


if __name__ == "__main__":
    main()
