#!/usr/bin/env python3
"""Cross-checks slidedp checkpoints against HF transformers (run where torch, transformers and
safetensors are installed, e.g. the GPU machine).

  check DIR                 load a slidedp checkpoint-<step> dir with Qwen3ForCausalLM.from_pretrained;
                            every parameter must equal the safetensors bytes, no key missing or
                            unexpected, tied lm_head shares the embedding, the BF16 weights must be
                            torch's round-to-nearest-even of the FP32 master in optimizer.safetensors,
                            and a forward pass gives finite logits.
  make-random OUT           HF random Qwen3 (save_pretrained) for our loader, plus OUT/stats.json.
  compare-stats A B         compare stats.json from make-random with `ckpt_tool load-hf` output.
  selftest --ckpt-tool BIN  all of the above for tiny tied/untied, BF16/F16/F32, single/sharded,
                            both directions; exit status 0 when everything matches.

Example (from the repository root, after building ckpt_tool):
  python3 tools/hf_checkpoint_check.py selftest --ckpt-tool build/bin/ckpt_tool
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

PRESETS = {
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied
    "tiny": (64, 2, 4, 2, 16, 128, 512, True),
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
}
DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def read_safetensors_dir(d):
    """All weight tensors of an HF dir (single or sharded) as {name: tensor}."""
    from safetensors import safe_open
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(os.path.join(d, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        fail(f"{d}: no weights")
    out = {}
    for name in files:
        with safe_open(os.path.join(d, name), framework="pt") as f:
            for k in f.keys():
                if k in out:
                    fail(f"{k} appears in two shards")
                out[k] = f.get_tensor(k)
    return out


def check(d):
    import torch
    from safetensors import safe_open
    from transformers import Qwen3ForCausalLM

    files = read_safetensors_dir(d)
    model, info = Qwen3ForCausalLM.from_pretrained(d, torch_dtype="auto", output_loading_info=True)
    cfg = model.config
    missing = [k for k in info["missing_keys"] if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or info["unexpected_keys"] or info.get("mismatched_keys"):
        fail(f"loading info: missing {missing} unexpected {info['unexpected_keys']} "
             f"mismatched {info.get('mismatched_keys')}")
    state = model.state_dict()
    for name, t in files.items():
        if name not in state:
            fail(f"{name} in safetensors but not a model parameter")
        if state[name].dtype != t.dtype or not torch.equal(state[name], t):
            fail(f"{name}: model parameter differs from the file")
    for name in state:
        if name not in files and not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            fail(f"model parameter {name} not in the files")
    if cfg.tie_word_embeddings:
        if "lm_head.weight" in files:
            fail("tied checkpoint should not store lm_head.weight")
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            fail("lm_head is not tied to the embedding")
    print(f"{d}: {len(files)} tensors load into Qwen3ForCausalLM exactly (tied={cfg.tie_word_embeddings}, "
          f"dtype={next(iter(files.values())).dtype})")

    opt = os.path.join(d, "optimizer.safetensors")
    if os.path.exists(opt):
        with safe_open(opt, framework="pt") as f:
            layout = json.loads(f.metadata()["layout"])
            checked = 0
            for unit in layout:
                master = f.get_tensor(f"unit.{unit['name']}.master")
                for name, offset, numel in unit["tensors"]:
                    w = files[name]
                    m = master[offset:offset + numel].reshape(w.shape)
                    if not torch.equal(m.to(w.dtype), w):
                        bad = (m.to(w.dtype) != w).sum().item()
                        fail(f"{name}: {bad} weights differ from the master rounded by torch to {w.dtype}")
                    checked += 1
        print(f"{opt}: {checked} weight tensors equal torch's rounding of the FP32 master")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    ids = torch.arange(0, min(16, cfg.vocab_size), device=device).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits
    if not torch.isfinite(logits.float()).all():
        fail("forward pass gives non-finite logits")
    print(f"forward on {device}: logits finite, shape {tuple(logits.shape)}")


def make_random(out, preset, dtype, max_shard_size, seed, tied=None):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    h, layers, heads, kv, hd, inter, vocab, preset_tied = PRESETS[preset]
    cfg = Qwen3Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=hd, intermediate_size=inter, vocab_size=vocab,
                      tie_word_embeddings=preset_tied if tied is None else tied,
                      max_position_embeddings=4096 if preset == "tiny" else 40960,
                      rope_theta=1e6, rms_norm_eps=1e-6, initializer_range=0.02)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, DTYPES[dtype]))
    # Norm weights are 1 after init; perturb them so a loader that skips them is caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    stats = {}
    for name, t in read_safetensors_dir(out).items():
        v = t.double().flatten()
        stats[name] = {"numel": v.numel(), "sum": v.sum().item(), "sum_sq": (v * v).sum().item(),
                       "first": v[0].item(), "last": v[-1].item()}
    with open(os.path.join(out, "stats.json"), "w") as f:
        json.dump(stats, f)
    print(f"{out}: random {preset} {dtype} tied={cfg.tie_word_embeddings}, {len(stats)} tensors")


def compare_stats(hf_stats_path, ours_path):
    with open(hf_stats_path) as f:
        hf = json.load(f)
    with open(ours_path) as f:
        ours = json.load(f)
    if set(hf) != set(ours):
        fail(f"tensor sets differ: only HF {sorted(set(hf) - set(ours))[:5]}, only ours {sorted(set(ours) - set(hf))[:5]}")
    for name in hf:
        a, b = hf[name], ours[name]
        if a["first"] != b["first"] or a["last"] != b["last"]:
            fail(f"{name}: first/last {a['first']},{a['last']} vs {b['first']},{b['last']}")
        # Same FP32 values, summed in double in a different order: the difference is bounded by
        # ~n * eps * sum|x| <= n * eps * sqrt(n * sum_sq); allow far more than that.
        tol = 1e-9 * math.sqrt(a["numel"] * a["sum_sq"]) + 1e-12
        if a["numel"] != b["numel"]:
            fail(f"{name}: numel {a['numel']} vs {b['numel']}")
        for k in ("sum", "sum_sq"):
            if abs(a[k] - b[k]) > tol:
                fail(f"{name}: {k} {a[k]} vs {b[k]}")
    print(f"{ours_path}: {len(hf)} tensors match HF's values")


def selftest(ckpt_tool):
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("bf16", None, "5GB"), ("f16", False, "5GB"), ("f32", True, "200KB"), ("bf16", False, "100KB")]
        for i, (dtype, tied, shard) in enumerate(cases):
            d = os.path.join(tmp, f"hf{i}")
            make_random(d, "tiny", dtype, shard, seed=i, tied=tied)
            ours = os.path.join(tmp, f"ours{i}.json")
            with open(ours, "w") as f:
                subprocess.run([ckpt_tool, "load-hf", d], stdout=f, check=True)
            compare_stats(os.path.join(d, "stats.json"), ours)
        for i, (dtype, shard) in enumerate([("bf16", "5000000000"), ("f32", "100000")]):
            root = os.path.join(tmp, f"saved{i}")
            subprocess.run([ckpt_tool, "save-random", root, "--model", "tiny", "--step", "7", "--dtype", dtype,
                            "--shard-bytes", shard, "--seed", str(i)], check=True)
            check(os.path.join(root, "checkpoint-7"))
    print("selftest: OK")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("dir")
    m = sub.add_parser("make-random")
    m.add_argument("out")
    m.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    m.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    m.add_argument("--max-shard-size", default="5GB")
    m.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("compare-stats")
    s.add_argument("hf_stats")
    s.add_argument("ours")
    t = sub.add_parser("selftest")
    t.add_argument("--ckpt-tool", required=True)
    a = p.parse_args()
    if a.cmd == "check":
        check(a.dir)
    elif a.cmd == "make-random":
        make_random(a.out, a.preset, a.dtype, a.max_shard_size, a.seed)
    elif a.cmd == "compare-stats":
        compare_stats(a.hf_stats, a.ours)
    else:
        selftest(a.ckpt_tool)


if __name__ == "__main__":
    main()
