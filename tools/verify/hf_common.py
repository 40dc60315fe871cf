"""Shared pieces of the HF transformers comparisons (tools/verify/hf_compare.py,
tools/verify/hf_train_reference.py, tools/verify/compare_curves.py).

Everything that does not need torch lives here too and runs with a bare python3 (tests on the
dev machine): segment chunking, the dump_batches file reader (numpy when present, else the array
module), the LR schedule formula of hostd/update/schedule.h, HF config fix-ups for our loader and
loss-curve files.

How HF sees a packed row: every document piece (a row split at its document boundaries; attention
never crosses them and positions restart at 0) is run as its own causal sequence. Pieces are
grouped into right-padded batches of at most `token_budget` padded tokens; with causal attention
and no attention mask, real tokens never see the padding after them, padded positions carry label
-100, so the result equals running every piece alone (this is exact, unlike a 4D mask).
"""
import json
import math
import os
import struct
import sys

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- pure Python

def chunk_segments(lengths, token_budget):
    """Groups segment indices into batches whose padded size (count x longest) stays within
    token_budget (a single longer segment gets a batch of its own). Longest first, so padding is
    small. Returns a list of index lists covering every segment exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    chunks, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and new_max * (len(cur) + 1) > token_budget:
            chunks.append(cur)
            cur, cur_max = [], 0
            new_max = lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        chunks.append(cur)
    return chunks


def _int32_array(buf, offset, count):
    try:
        import numpy as np
        return np.frombuffer(buf, dtype="<i4", count=count, offset=offset)
    except ImportError:
        import array
        a = array.array("i")
        a.frombytes(buf[offset:offset + 4 * count])
        if sys.byteorder != "little":
            a.byteswap()
        return a


class BatchesFile:
    """Reader of dump_batches output (format in tools/verify/dump_batches.cc)."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            data = f.read()
        nl = data.index(b"\n")
        self.header = json.loads(data[:nl].decode("utf-8"))
        if self.header.get("format") != "slidedp-batches" or self.header.get("version") != 1:
            raise ValueError(f"{path}: not a slidedp-batches v1 file")
        self._data = memoryview(data)[nl + 1:]
        self.steps = self.header["steps"]

    @property
    def job(self):
        return self.header.get("job")

    @property
    def model_dir(self):
        return self.header.get("model_dir")

    def step(self, t):
        """(tokens, labels, positions, cu_seqlens, meta) of step t (int32 arrays)."""
        meta = self.steps[t]
        if meta["step"] != t:
            raise ValueError(f"{self.path}: entry {t} is step {meta['step']}")
        n, d, off = meta["num_tokens"], meta["num_segments"], meta["offset"]
        end = off + 4 * (3 * n + d + 1)
        if end > len(self._data):
            raise ValueError(f"{self.path}: step {t} needs bytes up to {end}, the data area has {len(self._data)}")
        tokens = _int32_array(self._data, off, n)
        labels = _int32_array(self._data, off + 4 * n, n)
        positions = _int32_array(self._data, off + 8 * n, n)
        cu = _int32_array(self._data, off + 12 * n, d + 1)
        return tokens, labels, positions, cu, meta


def segments_of(tokens, labels, positions, cu_seqlens):
    """Splits a flat micro-batch into its document pieces: list of (tokens, labels) lists.
    Checks the invariants the HF side relies on (positions 0..len-1 per piece, last label -100)."""
    segs = []
    cu = [int(x) for x in cu_seqlens]
    if cu[0] != 0 or cu[-1] != len(tokens):
        raise ValueError(f"cu_seqlens {cu[:3]}...{cu[-1]} do not cover {len(tokens)} tokens")
    for b, e in zip(cu[:-1], cu[1:]):
        if e <= b:
            raise ValueError(f"empty document piece at {b}")
        pos = [int(x) for x in positions[b:e]]
        if pos != list(range(e - b)):
            raise ValueError(f"positions of piece [{b}, {e}) do not restart at 0")
        lab = [int(x) for x in labels[b:e]]
        if lab[-1] != IGNORE_INDEX:
            raise ValueError(f"piece [{b}, {e}) has a label on its last token")
        segs.append(([int(x) for x in tokens[b:e]], lab))
    return segs


def segments_from_rows(rows, doc_lens):
    """The token batch file of model_grads (tools/verify/token_batch.h) as pieces with HF's shift."""
    segs = []
    for r, row in enumerate(rows):
        lens = doc_lens[r] if doc_lens and doc_lens[r] else [len(row)]
        b = 0
        for n in lens:
            doc = row[b:b + n]
            segs.append((list(doc), list(doc[1:]) + [IGNORE_INDEX]))
            b += n
        if b != len(row):
            raise ValueError(f"row {r}: doc_lens sum to {b}, row has {len(row)} tokens")
    return segs


def lr_multiplier(step, schedule, warmup_steps, total_steps, base_lr, min_lr):
    """LrAt(step) / base_lr exactly as hostd/update/schedule.h (HF semantics; step = completed
    updates)."""
    s = max(step, 0)
    if base_lr == 0:
        return 0.0
    if warmup_steps > 0 and s < warmup_steps:
        return s / warmup_steps
    r = min_lr / base_lr if min_lr > 0 else 0.0
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        f = max(0.0, (total_steps - s) / max(1, total_steps - warmup_steps))
        return r + (1 - r) * f
    if schedule == "cosine":
        p = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        p = min(p, 1.0)
        return r + (1 - r) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown schedule {schedule}")


# The RoPE types common/model/model_config.cc computes (RopeScaling).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def config_for_our_loader(hf_config):
    """An HF config.json dict as our parser (common/model/model_config.cc) reads it: rope_theta also
    at the top level (transformers 5 keeps it in "rope_parameters"), RoPE scaling of the types it
    computes (ROPE_TYPES; kept in rope_parameters, or in rope_scaling where that holds a scaled
    one); other RoPE types are errors here, as they are for slidedp."""
    c = dict(hf_config)
    rope = c.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):  # Gemma 3: a RoPE per layer type, which our parser reads
        return c
    scaling = c.get("rope_scaling")
    for src in (rope, scaling if isinstance(scaling, dict) else {}):
        rtype = src.get("rope_type", src.get("type", "default"))
        if rtype is not None and rtype not in ROPE_TYPES:
            raise ValueError(f"RoPE type {rtype} is not supported by slidedp")
    theta = rope.get("rope_theta")  # what transformers 5 computes with
    if theta is None:
        theta = c.get("rope_theta")
    if theta is None and isinstance(scaling, dict):
        theta = scaling.get("rope_theta")
    if theta is None:
        raise ValueError("config.json has no rope_theta (top level or rope_parameters)")
    c["rope_theta"] = float(theta)
    if not (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ROPE_TYPES[1:]):
        c["rope_scaling"] = None
    if "tie_word_embeddings" not in c:
        c["tie_word_embeddings"] = False
    return c


def make_our_model_dir(hf_dir, our_dir, config=None):
    """our_dir = hf_dir's weights (symlinked) + config_for_our_loader(config), config defaulting
    to hf_dir's config.json."""
    os.makedirs(our_dir, exist_ok=True)
    cfg = config
    if cfg is None:
        with open(os.path.join(hf_dir, "config.json")) as f:
            cfg = json.load(f)
    with open(os.path.join(our_dir, "config.json"), "w") as f:
        json.dump(config_for_our_loader(cfg), f, indent=1)
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            dst = os.path.join(our_dir, name)
            if os.path.lexists(dst):
                os.remove(dst)
            os.symlink(os.path.abspath(os.path.join(hf_dir, name)), dst)


def read_safetensors_header(path):
    """(metadata, {name: (dtype, shape, (begin, end))}) of a safetensors file, pure Python."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    meta = h.pop("__metadata__", {})
    return meta, {k: (v["dtype"], v["shape"], tuple(v["data_offsets"])) for k, v in h.items()}


def load_probe(path):
    """{step: loss_fp32_probe} of an hf_train_reference.py JSON run with --probe-fp32 (the same
    batch's loss in FP32 at the weights the step trained on), or {} when it has none."""
    try:
        with open(path) as f:
            doc = json.load(f)
        return {int(r["step"]): float(r["loss_fp32_probe"]) for r in doc["curve"] if "loss_fp32_probe" in r}
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return {}


def load_curve(path):
    """{step: loss} from our metrics JSONL (hostd's metrics-<job>.jsonl; a repeated step, e.g.
    after a restart, keeps its last record) or an hf_train_reference.py JSON file."""
    with open(path) as f:
        text = f.read()
    stripped = text.lstrip()
    curve = {}
    if stripped.startswith("{") and '"curve"' in stripped[:100000]:
        try:
            doc = json.loads(text)
            for rec in doc["curve"]:
                curve[int(rec["step"])] = float(rec["loss"])
            return curve
        except (json.JSONDecodeError, KeyError, TypeError):
            curve = {}
    for i, line in enumerate(text.splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: not JSON ({e})")
        if "step" in rec and "loss" in rec:
            curve[int(rec["step"])] = float(rec["loss"])
    if not curve:
        raise ValueError(f"{path}: no step/loss records")
    return curve


# ----------------------------------------------------------------------------- torch

def _causal_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention for long single-document rows: the k/v heads repeated to the query heads as HF's
    repeat_kv does, then torch's SDPA with is_causal and only its flash / memory-efficient kernels
    (FP32 runs the latter), so no [T, T] score matrix exists at 64K tokens. A padding or document
    mask goes to torch's SDPA as HF's own 'sdpa' passes it."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if attention_mask is not None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    else:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_causal_sdpa():
    """Registers _causal_sdpa_attention as attn_implementation 'causal_sdpa' (with SDPA's mask
    builder, which leaves a plain causal mask out), once."""
    from transformers import AttentionInterface
    AttentionInterface.register("causal_sdpa", _causal_sdpa_attention)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
        AttentionMaskInterface.register("causal_sdpa", sdpa_mask)
    except ImportError:  # older transformers: the mask defaults to SDPA's
        pass
    return "causal_sdpa"


def load_hf_model(model_dir, dtype, attn="sdpa"):
    """AutoModelForCausalLM.from_pretrained (Qwen3, Qwen2, Llama, Mistral: the config's
    model_type) with the dtype argument of transformers 5 (falls back to torch_dtype on older
    versions)."""
    from transformers import AutoModelForCausalLM
    kwargs = {"attn_implementation": attn}
    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type in ("qwen3_moe", "gpt_oss"):
        # The experts' eager loop (BF16 GEMMs under autocast, a token's experts summed in
        # expert order): the numerics slidedp implements; transformers 5 defaults to grouped_mm.
        kwargs["experts_implementation"] = "eager"
    if model_type == "gpt_oss":  # its sinks: HF's eager attention (SDPA has no sink term)
        kwargs["attn_implementation"] = "eager"
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    except TypeError:
        return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype, **kwargs)


def hf_loss_backward(model, segments, total_trained, token_budget, autocast=True, backward=True):
    """Runs every piece through the HF model (right-padded batches, see the module comment),
    accumulates d(sum CE / total_trained)/dparams into .grad and returns (sum CE / total_trained)
    as a float. Logits are upcast to FP32 for the cross entropy, as HF's ForCausalLMLoss does.
    backward=False: the loss only (no graph, .grad untouched)."""
    import torch
    if not backward:
        with torch.no_grad():
            return _hf_loss(model, segments, total_trained, token_budget, autocast, False)
    return _hf_loss(model, segments, total_trained, token_budget, autocast, True)


def _hf_loss(model, segments, total_trained, token_budget, autocast, backward):
    import torch
    import torch.nn.functional as F
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    total = 0.0
    for chunk in chunk_segments([len(s[0]) for s in segments], token_budget):
        width = max(len(segments[i][0]) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        lab = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        for r, i in enumerate(chunk):
            toks, labs = segments[i]
            ids[r, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            lab[r, :len(labs)] = torch.tensor(labs, dtype=torch.long)
        ids, lab = ids.to(device), lab.to(device)
        hook = getattr(model, "_slidedp_routing_hook", None)  # MoE: MoeRoutingHook
        if hook is not None:
            hook.begin_chunk(chunk, width, [len(segments[i][0]) for i in chunk])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, use_cache=False)
        logits = out.logits
        ce = F.cross_entropy(logits.float().reshape(-1, vocab), lab.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="sum")
        loss = ce / total_trained
        total += ce.item() / total_trained
        # A MoE model with output_router_logits: HF adds router_aux_loss_coef x the load-balancing
        # loss of the forward (over every token it saw) to the loss it trains on.
        aux = getattr(out, "aux_loss", None)
        if aux is not None and getattr(model.config, "output_router_logits", False):
            weighted = model.config.router_aux_loss_coef * aux.float()
            loss = loss + weighted
            total += weighted.item()
        if backward:
            loss.backward()
        del logits, ce, out, loss
    return total


# ----------------------------------------------------------------------------- sampler (cross-check)
# A pure-Python port of common/data/sampler.cc and micro_batch.cc, used only to cross-check a
# dump_batches file (the training reference itself reads the dumped batches, which come from the
# trainer's own code). Algorithm: epoch e's permutation of [0, n) is Fisher-Yates from i = n-1
# down to 1, swapping perm[i] with perm[j], j = Below(i + 1), drawn from a splitmix64 stream whose
# state starts at seed ^ (0xD1B54A32D192ED03 * (e + 1)) (mod 2^64) and is advanced once before
# the first draw; Below(b) rejects draws >= 2^64 - 1 - ((2^64 - 1) mod b) and returns x mod b.
# Step t reads global positions [t*B, (t+1)*B); position p is row perm_{p // n}[p % n].

_M64 = (1 << 64) - 1


def _splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def epoch_permutation(n, seed, epoch):
    perm = list(range(n))
    state = (seed ^ ((0xD1B54A32D192ED03 * (epoch + 1)) & _M64)) & _M64
    state, _ = _splitmix64(state)
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = _M64 - _M64 % bound
        while True:
            state, x = _splitmix64(state)
            if x < limit:
                break
        j = x % bound
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def global_rows(num_rows, global_batch, seed, step, _cache={}):
    rows = []
    for p in range(step * global_batch, (step + 1) * global_batch):
        e = p // num_rows
        key = (num_rows, seed, e)
        if key not in _cache:
            _cache.clear()
            _cache[key] = epoch_permutation(num_rows, seed, e)
        rows.append(_cache[key][p % num_rows])
    return rows


def read_dataset(dataset_dir):
    """(manifest, tokens, loss_mask, doc_offsets, row_offsets) of a slidedp dataset
    (docs/dataset-format.md); numpy memory maps when numpy is present, else arrays."""
    with open(os.path.join(dataset_dir, "manifest.json")) as f:
        manifest = json.load(f)
    try:
        import numpy as np
        tokens = np.memmap(os.path.join(dataset_dir, "tokens.bin"), dtype="<u4", mode="r")
        mask = np.memmap(os.path.join(dataset_dir, "loss_mask.bin"), dtype="u1", mode="r")
        docs = np.memmap(os.path.join(dataset_dir, "doc_offsets.bin"), dtype="<u8", mode="r")
        rows = np.memmap(os.path.join(dataset_dir, "row_offsets.bin"), dtype="<u8", mode="r")
    except ImportError:
        import array

        def load(name, code):
            a = array.array(code)
            with open(os.path.join(dataset_dir, name), "rb") as f:
                a.frombytes(f.read())
            return a
        tokens, mask, docs, rows = load("tokens.bin", "I"), load("loss_mask.bin", "B"), load(
            "doc_offsets.bin", "Q"), load("row_offsets.bin", "Q")
    return manifest, tokens, mask, docs, rows


def build_microbatch(dataset, rows):
    """common/data/micro_batch.cc's BuildMicroBatch in Python: (tokens, labels, positions, cu)."""
    _, tokens, mask, docs, row_off = dataset
    doc_list = [int(x) for x in docs]
    out_t, out_l, out_p, cu = [], [], [], [0]
    import bisect
    for r in rows:
        b, e = int(row_off[r]), int(row_off[r + 1])
        cuts = [b] + [d for d in doc_list[bisect.bisect_right(doc_list, b):bisect.bisect_left(doc_list, e)]] + [e]
        for sb, se in zip(cuts[:-1], cuts[1:]):
            for t in range(sb, se):
                out_t.append(int(tokens[t]))
                out_p.append(t - sb)
                out_l.append(int(tokens[t + 1]) if t + 1 < se and mask[t + 1] else IGNORE_INDEX)
            cu.append(len(out_t))
    return out_t, out_l, out_p, cu


class MoeRoutingHook:
    """Qwen3-MoE routing in HF's model, seen and (optionally) forced, token by token.

    Expert gradients are discontinuous in the routing: a token whose k-th and (k+1)-th probabilities
    are within rounding of each other goes to either expert, and two correct BF16 implementations
    (HF's FP32 and autocast runs among them) then disagree on that expert's gradient by O(1/its
    tokens). To compare the continuous math exactly, the HF run can follow slidedp's routing: each
    router's top-k indices are replaced by the given ones (the probabilities, renormalisation and
    experts stay HF's own), while HF's own choice is recorded for the agreement figure.
    Tokens are numbered globally: rows x seq in order (the token batch file's), segment i (a
    document, hf_common.segments_from_rows) starting at seg_offsets[i]."""

    def __init__(self, model, seg_offsets):
        import torch
        import torch.nn.functional as F
        self.seg_offsets = seg_offsets
        self.total = (seg_offsets[-1] if seg_offsets else 0)
        self.forced = None  # {sparse ordinal: LongTensor [total, k]} or None
        self.own = {}       # {sparse ordinal: LongTensor [total, k]} HF's own choices, last run
        self._gidx = None
        self.unsupported = None  # why the routing cannot be seen (a router of another form), or None
        ordinal = 0
        for layer in model.model.layers:
            # Qwen3-MoE / Qwen3.5-MoE: mlp.gate; GPT-OSS: mlp.router (biased, softmax over the top-k logits)
            gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
            if gate is None or not hasattr(gate, "top_k"):
                continue
            top_k_softmax = type(gate).__name__ == "GptOssTopKRouter"
            orig = gate.forward

            def fwd(hidden_states, gate=gate, orig=orig, l=ordinal, top_k_softmax=top_k_softmax):
                out = orig(hidden_states)
                if not (isinstance(out, tuple) and len(out) == 3):
                    self.unsupported = (f"the router returns {type(out).__name__}, not (logits, scores, "
                                        "indices) as transformers 5's Qwen3MoeTopKRouter")
                    return out
                first, scores, idx = out
                hs = hidden_states.reshape(-1, gate.weight.shape[1])
                gidx = self._gidx
                if gidx is not None and gidx.numel() == idx.shape[0]:
                    mask = gidx >= 0
                    own = self.own.setdefault(l, torch.full((self.total, idx.shape[1]), -1, dtype=torch.long))
                    own[gidx[mask].cpu()] = idx[mask].detach().cpu()
                    if self.forced is not None and l in self.forced:
                        forced = idx.clone()
                        forced[mask] = self.forced[l][gidx[mask].cpu()].to(idx.device)
                        if top_k_softmax:  # GPT-OSS: the softmax of the chosen logits, in their dtype
                            logits = F.linear(hs, gate.weight, gate.bias)
                            val = F.softmax(logits.gather(-1, forced), dim=1, dtype=logits.dtype)
                            return first, val.to(scores.dtype), forced
                        probs = F.softmax(F.linear(hs, gate.weight), dtype=torch.float, dim=-1)
                        val = probs.gather(-1, forced)
                        if getattr(gate, "norm_topk_prob", True):  # (Qwen3.5-MoE's router always renormalises)
                            val = val / val.sum(dim=-1, keepdim=True)
                        return first, val.to(scores.dtype), forced
                return first, scores, idx

            gate.forward = fwd
            ordinal += 1
        self.num_sparse = ordinal
        model._slidedp_routing_hook = self

    def begin_chunk(self, chunk, width, lengths):
        import torch
        g = torch.full((len(chunk), width), -1, dtype=torch.long)
        for r, (i, n) in enumerate(zip(chunk, lengths)):
            g[r, :n] = torch.arange(self.seg_offsets[i], self.seg_offsets[i] + n)
        self._gidx = g.reshape(-1).cuda()

    def agreement(self, other):
        """Fraction of (token, sparse layer) whose top-k set is the same in self.own and `other`
        ({ordinal: [total, k]})."""
        import torch
        same = count = 0
        for l, mine in self.own.items():
            if l not in other:
                continue
            a, b = torch.sort(mine, dim=1).values, torch.sort(other[l].cpu().long(), dim=1).values
            valid = (a >= 0).all(dim=1)
            same += int(((a == b).all(dim=1) & valid).sum())
            count += int(valid.sum())
        return same / count if count else float("nan")
