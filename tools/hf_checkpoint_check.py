#!/usr/bin/env python3
"""Cross-checks slidedp checkpoints against HF transformers (run where torch, transformers and
safetensors are installed, e.g. the GPU machine).

  check DIR                 load a slidedp checkpoint-<step> dir (or a `slidedp export` dir) with
                            AutoModelForCausalLM.from_pretrained; every parameter must equal the
                            safetensors bytes (single or sharded with an index), no key missing or
                            unexpected, tied lm_head shares the embedding, the BF16 weights must be
                            torch's round-to-nearest-even of the FP32 master in optimizer.safetensors
                            (where there is one), and a forward pass gives finite logits. Also
                            GenerationConfig.from_pretrained, and AutoTokenizer.from_pretrained when
                            the dir holds tokenizer files (--need-tokenizer: it must).
  check-export CKPT DIR     DIR (from `slidedp export CKPT --to DIR`) holds the checkpoint's weights:
                            BF16 bit for bit those of CKPT's model files, F32 its master exactly; its
                            tokenizer files are CKPT's; no optimizer state. Then `check DIR`.
  make-random OUT           HF random Qwen3 (save_pretrained) for our loader, plus OUT/stats.json.
  compare-stats A B         compare stats.json from make-random with `ckpt_tool load-hf` output.
  selftest --ckpt-tool BIN [--slidedp BIN]
                            all of the above for tiny tied/untied, BF16/F16/F32, single/sharded,
                            both directions; checkpoints carry the Qwen3 tokenizer's files
                            (tests/data/tokenizer/qwen3) and AutoTokenizer loads them; with slidedp
                            (default: beside ckpt_tool) also `slidedp export` sharded and FP32, each
                            loaded and compared; exit status 0 when everything matches.

Example (from the repository root, after building ckpt_tool and slidedp):
  python3 tools/hf_checkpoint_check.py selftest --ckpt-tool build/bin/ckpt_tool
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(REPO, "tests", "data", "tokenizer", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "tokenizer.model")

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


def check_tokenizer(d, need_tokenizer):
    """AutoTokenizer and GenerationConfig load from the directory; the tokenizer round-trips text."""
    from transformers import AutoTokenizer, GenerationConfig
    gen = GenerationConfig.from_pretrained(d)
    print(f"{d}: generation_config loads (bos {gen.bos_token_id}, eos {gen.eos_token_id})")
    present = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(d, f))]
    if not present:
        if need_tokenizer:
            fail(f"{d}: no tokenizer files")
        print(f"{d}: no tokenizer files (a preset's checkpoint): AutoTokenizer not checked")
        return
    tok = AutoTokenizer.from_pretrained(d)
    text = "Hello, world! 你好"
    ids = tok(text)["input_ids"]
    if not ids or tok.decode(ids, skip_special_tokens=True) != text:
        fail(f"{d}: AutoTokenizer does not round-trip {text!r}: {ids} -> {tok.decode(ids)!r}")
    print(f"{d}: AutoTokenizer loads ({type(tok).__name__}, {len(tok)} tokens, files {', '.join(present)})")


def check(d, need_tokenizer=False):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    files = read_safetensors_dir(d)
    model, info = AutoModelForCausalLM.from_pretrained(d, torch_dtype="auto", output_loading_info=True)
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
    print(f"{d}: {len(files)} tensors load into {type(model).__name__} exactly (tied={cfg.tie_word_embeddings}, "
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
    check_tokenizer(d, need_tokenizer)


def check_export(ckpt, d, need_tokenizer=False):
    """`slidedp export CKPT --to D`: D's weights are the checkpoint's (BF16: its model files' bytes;
    F32: the master), its tokenizer files CKPT's, no optimizer state; then D passes check()."""
    import torch
    from safetensors import safe_open
    for f in ("optimizer.safetensors", "trainer_state.json", "COMPLETE"):
        if os.path.exists(os.path.join(d, f)):
            fail(f"{d}: an export holds {f}")
    ours, exported = read_safetensors_dir(ckpt), read_safetensors_dir(d)
    if set(ours) != set(exported):
        fail(f"{d}: tensors differ from {ckpt}'s: {sorted(set(ours) ^ set(exported))[:5]}")
    dtypes = {t.dtype for t in exported.values()}
    if dtypes == {torch.bfloat16} and next(iter(ours.values())).dtype == torch.bfloat16:
        for name, t in exported.items():
            if not torch.equal(t, ours[name]):
                fail(f"{d}: {name} differs from the checkpoint's")
        print(f"{d}: {len(exported)} BF16 tensors equal the checkpoint's")
    elif dtypes == {torch.float32}:
        with safe_open(os.path.join(ckpt, "optimizer.safetensors"), framework="pt") as f:
            for unit in json.loads(f.metadata()["layout"]):
                master = f.get_tensor(f"unit.{unit['name']}.master")
                for name, offset, numel in unit["tensors"]:
                    if not torch.equal(master[offset:offset + numel].reshape(exported[name].shape), exported[name]):
                        fail(f"{d}: {name} is not the checkpoint's FP32 master")
        print(f"{d}: {len(exported)} F32 tensors equal the checkpoint's master")
    else:
        fail(f"{d}: weights of dtypes {dtypes} against a checkpoint in {next(iter(ours.values())).dtype}")
    for f in TOKENIZER_FILES + ("generation_config.json",):
        a, b = os.path.join(ckpt, f), os.path.join(d, f)
        if os.path.exists(a) != os.path.exists(b) or (os.path.exists(a) and open(a, "rb").read() != open(b, "rb").read()):
            fail(f"{d}: {f} is not the checkpoint's")
    check(d, need_tokenizer)


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


def selftest(ckpt_tool, slidedp=None):
    if slidedp is None:
        beside = os.path.join(os.path.dirname(os.path.abspath(ckpt_tool)), "slidedp")
        slidedp = beside if os.path.exists(beside) else ""
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
            # As a job from a model directory: the model's tokenizer files travel into the checkpoint
            # (the second, as a preset's, gets only a generation_config.json).
            files_from = ["--model-files-from", TOKENIZER_DIR] if i == 0 else []
            subprocess.run([ckpt_tool, "save-random", root, "--model", "tiny", "--step", "7", "--dtype", dtype,
                            "--shard-bytes", shard, "--seed", str(i)] + files_from, check=True)
            check(os.path.join(root, "checkpoint-7"), need_tokenizer=i == 0)
        if slidedp:
            ckpt = os.path.join(tmp, "saved0", "checkpoint-7")
            for name, extra in (("export-sharded", ["--max-shard-size", "60KB"]), ("export-f32", ["--dtype", "fp32"])):
                out = os.path.join(tmp, name)
                subprocess.run([slidedp, "export", ckpt, "--to", out] + extra, check=True)
                if name == "export-sharded" and not os.path.exists(os.path.join(out, "model.safetensors.index.json")):
                    fail(f"{out}: not sharded")
                check_export(ckpt, out, need_tokenizer=True)
        else:
            print("selftest: no slidedp binary (--slidedp): `slidedp export` not checked")
    print("selftest: OK")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("dir")
    c.add_argument("--need-tokenizer", action="store_true", help="fail when the dir holds no tokenizer files")
    e = sub.add_parser("check-export")
    e.add_argument("checkpoint")
    e.add_argument("dir")
    e.add_argument("--need-tokenizer", action="store_true")
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
    t.add_argument("--slidedp", default=None, help="the slidedp binary for `export` (default: beside ckpt_tool)")
    a = p.parse_args()
    if a.cmd == "check":
        check(a.dir, a.need_tokenizer)
    elif a.cmd == "check-export":
        check_export(a.checkpoint, a.dir, a.need_tokenizer)
    elif a.cmd == "make-random":
        make_random(a.out, a.preset, a.dtype, a.max_shard_size, a.seed)
    elif a.cmd == "compare-stats":
        compare_stats(a.hf_stats, a.ours)
    else:
        selftest(a.ckpt_tool, a.slidedp)


if __name__ == "__main__":
    main()
