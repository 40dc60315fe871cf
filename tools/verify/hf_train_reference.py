#!/usr/bin/env python3
"""HF transformers loss-curve reference for issue 4: train Qwen3ForCausalLM from the same initial
weights on exactly the global batches our job trains on, with torch.optim.AdamW and the job's LR
schedule and clipping, and write the loss per step.

Inputs come from `dump_batches --job JOB.yaml --out BATCHES.bin [--write-init INIT_DIR]`
(tools/verify/dump_batches.cc): the batches (tokens, shifted labels, document pieces) built by the
trainer's own sampler and micro-batch code, the optimizer/schedule settings of the job, and the
model directory (the job's model.path, or the F32 random init written by --write-init for a
model.preset job). Flags override the job's settings.

Training step t (t = 0 .. N-1), matching hostd (hostd/engine/training_executor.cc):
  loss_t = sum of token CE over the global batch / its trained tokens (HF: FP32 master weights,
           forward under torch.autocast(bf16), each document piece its own causal sequence, see
           tools/verify/hf_common.py); backward
  grad_norm = clip_grad_norm_(params, max_grad_norm)   (skipped when max_grad_norm is 0)
  AdamW(lr = base_lr * multiplier(t), betas, eps, weight_decay; foreach=False, the single-tensor
        path docs/layeradam.md matches) step; LambdaLR step. Two parameter groups, as HF's Trainer
        and hostd (optimizer.no_decay, hostd/update/weight_decay.h): the groups the job exempts
        (norm weights, biases; both by default) have weight_decay 0, every other tensor the job's.
The curve records {"step": t + 1, "loss": loss_t, "lr", "grad_norm"}, the numbering of hostd's
metrics-<job>.jsonl. Compare with tools/verify/compare_curves.py.

--precision bf16-mirror keeps the FP32 master for AdamW but runs forward and backward at the
BF16-rounded weights, as SlideDP's workers do (autocast alone leaves the RMSNorm weights and the
embedding lookup in FP32): the reference for our arithmetic with runtime.norm_weights: bf16.
--precision bf16-mirror-fp32-norms rounds every weight but the (1-D) norm weights: the reference
for our workers with runtime.embedding_rows: bf16; it differs from plain autocast only in the
embedding rows, which autocast looks up in FP32 (as our default, embedding_rows: fp32, does).

--probe-fp32 also records, at every step, the same batch's loss in FP32 (no autocast, no TF32) at
the weights that step trains on ("loss_fp32_probe"; one extra forward per step): how much that
batch's loss moves with the arithmetic alone. compare_curves.py shows it beside the steps where
two curves differ most.

--precision bf16-autocast-fp32-residual is autocast except that the two projections feeding the
residual stream (o_proj, down_proj) return their FP32 sums instead of BF16-rounded outputs (autocast
and our workers round them to BF16 before the FP32 residual add): the same function rounded more
finely, for the reference's own spread.

--unit-norms also records each step's squared gradient norm per SlideDP unit, before clipping
("unit_squares": embedding (with a tied head), decoder layers in order, final norm (with an
untied head)), the split our workers log with SLIDEDP_LOG_UNIT_NORMS=1; compare_curves.py
--first-units shows where two runs' gradient norms part. --save-final DIR saves the FP32 weights
after the last step (HF format), for compare_params.py --rows against ours.

Usage (GPU machine):
  python3 tools/verify/hf_train_reference.py --batches BATCHES.bin --out hf_curve.json [--steps N]
  python3 tools/verify/hf_train_reference.py --selftest     (tiny synthetic run, a few seconds)
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_common  # noqa: E402

SETTINGS = ("lr", "beta1", "beta2", "eps", "weight_decay", "no_decay", "max_grad_norm", "schedule", "warmup_steps",
            "min_lr", "total_steps")
DEFAULTS = {"lr": 1e-5, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "no_decay": ["norm", "bias"],
            "max_grad_norm": 1.0, "schedule": "constant", "warmup_steps": 0, "min_lr": 0.0, "total_steps": None}
NO_DECAY_GROUPS = ("norm", "bias")


def is_norm_weight(name):
    """hostd's rule (hostd/update/weight_decay.h), HF Trainer's name patterns: the weight of a
    module named norm, *_norm, *layernorm* or *rmsnorm*."""
    module, _, last = name.rpartition(".")
    if last != "weight":
        return False
    m = module.rpartition(".")[2].lower()
    return m == "norm" or m.endswith("_norm") or "layernorm" in m or "rmsnorm" in m


def is_bias(name):
    return "bias" in name.lower()  # HF Trainer's rule (get_decay_parameter_names)


def no_decay_list(text):
    """--no-decay: "norm,bias", "bias", or "none" (decay every tensor)."""
    groups = [] if text.strip() in ("", "none") else [g.strip() for g in text.split(",")]
    for g in groups:
        if g not in NO_DECAY_GROUPS:
            raise argparse.ArgumentTypeError(f"unknown no_decay group {g!r} (norm, bias or none)")
    return groups


def decay_groups(named, weight_decay, no_decay):
    """torch.optim.AdamW parameter groups for the job: (decayed, exempt) lists of parameters, as
    param-group dicts (the exempt group with weight_decay 0; empty groups left out)."""
    exempt = []
    decayed = []
    for name, p in named:
        out = ("norm" in no_decay and is_norm_weight(name)) or ("bias" in no_decay and is_bias(name))
        (exempt if out else decayed).append(p)
    groups = []
    if decayed:
        groups.append({"params": decayed, "weight_decay": weight_decay})
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def resolve_settings(args, batches):
    """Flags > the job in the batches file > defaults (the job spec's defaults)."""
    job = batches.job or {}
    s = {}
    for k in SETTINGS:
        v = getattr(args, k)
        s[k] = v if v is not None else job.get(k, DEFAULTS[k])
    n = args.steps if args.steps else (job.get("steps") or len(batches.steps))
    if n > len(batches.steps):
        raise SystemExit(f"{batches.path} holds {len(batches.steps)} steps, {n} requested")
    s["steps"] = n
    if not s["total_steps"]:
        s["total_steps"] = max(job.get("steps") or n, 1)
    return s


def make_scheduler(optimizer, s):
    """transformers' scheduler for the job's kind, checked against hostd's formula."""
    import torch
    import transformers
    base, warm, total, min_lr = s["lr"], s["warmup_steps"], s["total_steps"], s["min_lr"]
    kind = s["schedule"]
    if kind == "constant":
        sched = transformers.get_constant_schedule_with_warmup(optimizer, warm)
    elif kind == "linear" and min_lr == 0:
        sched = transformers.get_linear_schedule_with_warmup(optimizer, warm, total)
    elif kind == "cosine" and min_lr == 0:
        sched = transformers.get_cosine_schedule_with_warmup(optimizer, warm, total)
    elif kind == "cosine":
        from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup
        sched = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warm, total, min_lr=min_lr)
    else:  # linear with a floor: hostd's extension of HF's linear schedule
        sched = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda st: hf_common.lr_multiplier(st, kind, warm, total, base, min_lr))
    # The multipliers HF's lambda gives must be hostd's (schedule.h); cosine is clamped past total
    # by hostd only, and a job never runs past total_steps. (With lr 0 every rate is 0 whatever
    # the multiplier.)
    for lam in (sched.lr_lambdas if base else []):
        for st in range(min(s["steps"], total) + 1):
            ours = hf_common.lr_multiplier(st, kind, warm, total, base, min_lr)
            if abs(lam(st) - ours) > 1e-12:
                raise SystemExit(f"LR schedule mismatch at step {st}: transformers {lam(st)!r}, hostd {ours!r}")
    return sched


def fp32_loss(model, segments, trained, token_budget):
    """The batch's loss in FP32 (no autocast, no TF32) at the model's current weights, no grad."""
    import torch
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return hf_common.hf_loss_backward(model, segments, trained, token_budget, autocast=False, backward=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def unit_of(name, num_layers):
    """The SlideDP unit of an HF Qwen3 parameter name: 0 embedding (and a tied head), 1 + i
    decoder layer i, num_layers + 1 the final norm and an untied head."""
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith("model.layers."):
        return 1 + int(name.split(".")[2])
    if name.startswith("model.norm.") or name.startswith("lm_head."):
        return num_layers + 1
    raise ValueError(f"no unit for parameter {name}")


def unit_squares(named_params, num_layers):
    """Per-unit sum of squared gradients (FP64 sums of the FP32 gradients), in unit order."""
    import torch
    sums = [torch.zeros((), dtype=torch.float64, device="cuda") for _ in range(num_layers + 2)]
    for name, p in named_params:
        if p.grad is not None:
            sums[unit_of(name, num_layers)] += (p.grad.double() ** 2).sum()
    return [float(x) for x in sums]


def fp32_residual_linears(model):
    """--precision bf16-autocast-fp32-residual: the projections whose output joins the residual
    stream (o_proj, down_proj) keep their BF16 inputs and weights but return the FP32 sum instead
    of autocast's BF16-rounded output; their backward stays autocast's (BF16 operands, BF16 input
    gradient, weight gradient to FP32)."""
    import torch

    class Bf16LinearFp32Out(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
            ctx.save_for_backward(xb, wb)
            ctx.x_dtype = x.dtype
            with torch.autocast("cuda", enabled=False):
                # exact BF16 products summed in FP32 (TF32 is off for this precision)
                return torch.nn.functional.linear(xb.float(), wb.float())

        @staticmethod
        def backward(ctx, gy):
            xb, wb = ctx.saved_tensors
            with torch.autocast("cuda", enabled=False):
                gyb = gy.to(torch.bfloat16)
                gx = torch.matmul(gyb, wb).to(ctx.x_dtype)
                gw = torch.matmul(gyb.reshape(-1, gyb.shape[-1]).t(), xb.reshape(-1, xb.shape[-1])).float()
            return gx, gw

    def patch(linear):
        if linear.bias is not None:
            raise ValueError("fp32-residual: a projection with a bias")
        linear.forward = lambda x, w=linear.weight: Bf16LinearFp32Out.apply(x, w)

    for layer in model.model.layers:
        patch(layer.self_attn.o_proj)
        patch(layer.mlp.down_proj)


def train(model_dir, batches, s, token_budget, out_path, log_every=10, precision="bf16-autocast", probe_fp32=False,
          unit_norms=False, attn="sdpa", save_final=""):
    import torch
    if precision in ("fp32", "bf16-autocast-fp32-residual"):  # fp32: the reference's noise floor; no TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = hf_common.load_hf_model(model_dir, torch.float32, attn=attn).cuda()
    if precision == "bf16-autocast-fp32-residual":
        if probe_fp32:
            raise ValueError("--probe-fp32 needs unpatched projections: use it with another precision")
        fp32_residual_linears(model)
    model.train()
    model.config.use_cache = False
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # a tied head appears once
    params = [p for _, p in named]
    opt = torch.optim.AdamW(decay_groups(named, s["weight_decay"], s["no_decay"]), lr=s["lr"],
                            betas=(s["beta1"], s["beta2"]), eps=s["eps"], weight_decay=s["weight_decay"], foreach=False)
    sched = make_scheduler(opt, s)
    curve = []

    def write_doc():
        doc = {"format": "slidedp-hf-curve", "model_dir": os.path.abspath(model_dir), "batches": batches.path,
               "precision": precision, "attn": attn,
               "settings": s, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "device": torch.cuda.get_device_name(0), "seconds": time.time() - t_start, "curve": curve}
        if out_path:
            with open(out_path + ".tmp", "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(out_path + ".tmp", out_path)
        return doc
    t_start = time.time()
    for t in range(s["steps"]):
        tokens, labels, positions, cu, meta = batches.step(t)
        segments = hf_common.segments_of(tokens, labels, positions, cu)
        trained = meta["trained_tokens"]
        if trained != sum(1 for _, lab in segments for x in lab if x != hf_common.IGNORE_INDEX):
            raise SystemExit(f"step {t}: trained_tokens in the header disagrees with the labels")
        lr = sched.get_last_lr()[0]
        # --probe-fp32: how much this batch's loss moves with the arithmetic alone, at the same
        # (FP32 master) weights: the reference's own precision sensitivity, step by step.
        probe = fp32_loss(model, segments, trained, token_budget) if probe_fp32 else None
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        if precision.startswith("bf16-mirror"):
            # Forward and backward at the BF16-rounded weights (what SlideDP's workers read from the
            # mirror: also the norm weights and embedding rows, which autocast leaves in FP32); the
            # gradients then update the FP32 master, restored here.
            master = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p in params:
                    if precision == "bf16-mirror" or p.dim() > 1:
                        p.copy_(p.to(torch.bfloat16).to(torch.float32))
        loss = hf_common.hf_loss_backward(model, segments, trained, token_budget, autocast=precision != "fp32")
        if precision.startswith("bf16-mirror"):
            with torch.no_grad():
                for p, m in zip(params, master):
                    p.copy_(m)
            del master
        units = unit_squares(named, model.config.num_hidden_layers) if unit_norms else None
        if s["max_grad_norm"] > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, s["max_grad_norm"]))
        else:
            grad_norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params if p.grad is not None)))
        opt.step()
        sched.step()
        torch.cuda.synchronize()
        rec = {"step": t + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "trained_tokens": trained,
               "tokens": meta["num_tokens"], "time_s": time.time() - t0}
        if probe is not None:
            rec["loss_fp32_probe"] = probe
        if units is not None:
            rec["unit_squares"] = units
        curve.append(rec)
        if log_every and (t % log_every == 0 or t + 1 == s["steps"]):
            print(json.dumps(rec), flush=True)
            write_doc()  # a run stopped by a time cap still leaves its curve so far
    if save_final:  # the FP32 master after the last step, for compare_params.py against ours
        model.save_pretrained(save_final, safe_serialization=True)
    return write_doc()


def write_synthetic_batches(path, steps, rows, seq, vocab, seed):
    """A dump_batches-format file without a dataset (selftest): packed rows of random documents
    drawn from a small repeating vocabulary pattern, so the loss can fall quickly."""
    import random
    import struct
    rng = random.Random(seed)
    data = bytearray()
    metas = []
    for t in range(steps):
        toks, labs, poss, cu = [], [], [], [0]
        for _ in range(rows):
            left = seq
            while left > 0:
                n = min(left, rng.randint(2, seq // 2))
                start = rng.randrange(vocab)
                doc = [(start + 3 * i) % vocab for i in range(n)]
                toks += doc
                labs += doc[1:] + [hf_common.IGNORE_INDEX]
                poss += list(range(n))
                cu.append(len(toks))
                left -= n
        off = len(data)
        for arr in (toks, labs, poss, cu):
            data += struct.pack(f"<{len(arr)}i", *arr)
        metas.append({"step": t, "epoch": 0, "rows": list(range(rows)), "num_tokens": len(toks),
                      "num_segments": len(cu) - 1,
                      "trained_tokens": sum(1 for x in labs if x != hf_common.IGNORE_INDEX), "offset": off})
    header = {"format": "slidedp-batches", "version": 1, "dataset": "synthetic", "num_rows": rows,
              "global_batch": rows, "seed": seed, "shuffle": False, "model_dir": None,
              "job": {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01,
                      "max_grad_norm": 1.0, "schedule": "cosine", "warmup_steps": 2, "min_lr": 3e-4,
                      "steps": steps, "total_steps": steps},
              "steps": metas}
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n")
        f.write(bytes(data))


def selftest():
    """Tiny random model + synthetic batches: the script runs end to end, HF loads a config.json
    in our loader's format, the schedule check passes and the loss falls."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    with tempfile.TemporaryDirectory() as d:
        cfg = Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
                          max_position_embeddings=4096, rms_norm_eps=1e-6)
        torch.manual_seed(0)
        model_dir = os.path.join(d, "model")
        Qwen3ForCausalLM(cfg).save_pretrained(model_dir)
        # Our loader's config.json (top-level rope_theta, rope_scaling null) must load in HF too.
        with open(os.path.join(model_dir, "config.json")) as f:
            c = hf_common.config_for_our_loader(json.load(f))
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(c, f)
        path = os.path.join(d, "batches.bin")
        write_synthetic_batches(path, steps=12, rows=4, seq=128, vocab=512, seed=1)
        batches = hf_common.BatchesFile(path)
        ns = argparse.Namespace(steps=0, **{k: None for k in SETTINGS})
        s = resolve_settings(ns, batches)
        doc = train(model_dir, batches, s, token_budget=4096, out_path=None, log_every=0, probe_fp32=True,
                    unit_norms=True)
        losses = [r["loss"] for r in doc["curve"]]
        probes = [r["loss_fp32_probe"] for r in doc["curve"]]
        lrs = [r["lr"] for r in doc["curve"]]
        print("selftest losses", " ".join(f"{x:.3f}" for x in losses))
        # The FP32 probe sees the same weights as the step: its loss is close to the autocast one.
        # The units' squares add up to the clipping norm (tied head: 2 layers + embedding + norm).
        units_ok = all(len(r["unit_squares"]) == 4 and r["unit_squares"][0] > 0 and
                       abs(math.sqrt(sum(r["unit_squares"])) - r["grad_norm"]) <= 1e-4 * r["grad_norm"]
                       for r in doc["curve"])
        # Unrounded residual adds with eager attention: the same function rounded another way, so
        # close to autocast's curve but not bitwise equal to it.
        saved = os.path.join(d, "alt-final")
        alt = train(model_dir, batches, s, token_budget=4096, out_path=None, log_every=0,
                    precision="bf16-autocast-fp32-residual", attn="eager", save_final=saved)
        alt_losses = [r["loss"] for r in alt["curve"]]
        print("selftest fp32-residual + eager losses", " ".join(f"{x:.3f}" for x in alt_losses))
        alt_ok = (all(abs(a - x) < 5e-2 for a, x in zip(alt_losses, losses)) and alt_losses[0] != losses[0]
                  and alt["attn"] == "eager" and os.path.exists(os.path.join(saved, "model.safetensors")))
        ok = (all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1 and lrs[0] == 0.0
              and abs(lrs[2] - 3e-3) < 1e-12 and all(abs(p - x) < 5e-2 for p, x in zip(probes, losses))
              and units_ok and alt_ok)
        print("hf_train_reference selftest:", "PASS" if ok else "FAIL")
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", help="dump_batches output")
    ap.add_argument("--model", help="HF model dir (default: the batches file's model_dir)")
    ap.add_argument("--out", default="hf_curve.json")
    ap.add_argument("--steps", type=int, default=0, help="default: the job's steps")
    ap.add_argument("--token-budget", type=int, default=16384, help="padded tokens per HF forward")
    for k in SETTINGS:
        typ = (str if k == "schedule" else int if k in ("warmup_steps", "total_steps") else
               no_decay_list if k == "no_decay" else float)
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=typ, default=None,
                        help="override the job's no_decay: norm,bias | norm | bias | none" if k == "no_decay"
                        else f"override the job's {k}")
    ap.add_argument("--precision", choices=["bf16-autocast", "bf16-autocast-fp32-residual", "bf16-mirror",
                                            "bf16-mirror-fp32-norms", "fp32"],
                    default="bf16-autocast",
                    help="fp32: the reference's own noise floor (no autocast, no TF32); bf16-mirror: autocast "
                         "with every weight rounded to BF16 for forward and backward (the norm weights and "
                         "embedding rows too, as SlideDP's mirror gives them), FP32 master for AdamW; "
                         "bf16-mirror-fp32-norms: the same but the norm weights stay FP32 (our workers with "
                         "runtime.embedding_rows: bf16; our default, FP32 rows, is bf16-autocast's arithmetic); "
                         "bf16-autocast-fp32-residual: autocast, but o_proj and down_proj add their unrounded FP32 "
                         "output to the residual stream (a finer rounding of the same function)")
    ap.add_argument("--probe-fp32", action="store_true",
                    help="also record each batch's FP32 loss at the step's weights (loss_fp32_probe)")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="HF's attention implementation; eager (softmax in FP32 from BF16 scores) gives a second, "
                         "equally valid rounding of the same arithmetic: the reference's own spread")
    ap.add_argument("--unit-norms", action="store_true",
                    help="also record each step's squared gradient norm per SlideDP unit (unit_squares)")
    ap.add_argument("--save-final", default="", help="save the FP32 weights after the last step here (HF format)")
    ap.add_argument("--selftest", action="store_true")
    args = ap.parse_args()
    if args.selftest:
        return selftest()
    if not args.batches:
        ap.error("--batches is required")
    batches = hf_common.BatchesFile(args.batches)
    model_dir = args.model or batches.model_dir
    if not model_dir:
        ap.error("no model directory: give --model (the batches file names none)")
    s = resolve_settings(args, batches)
    print(f"model {model_dir}, {s['steps']} steps, settings {json.dumps(s)}", flush=True)
    doc = train(model_dir, batches, s, args.token_budget, args.out, precision=args.precision,
                probe_fp32=args.probe_fp32, unit_norms=args.unit_norms, attn=args.attn, save_final=args.save_final)
    print(f"wrote {args.out}: {len(doc['curve'])} steps in {doc['seconds']:.1f} s, "
          f"loss {doc['curve'][0]['loss']:.4f} -> {doc['curve'][-1]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
