"""Peer baseline for the sliding-window families (issue 51): HF transformers Gemma3ForCausalLM and
GptOssForCausalLM (random init, the released shapes as slidedp's presets give them, at --layers
depth) trained with PyTorch FSDP2, GPU-resident, activation checkpointing on every layer, FP32
master weights with BF16 compute (MixedPrecisionPolicy), fused torch AdamW: the setup of
fsdp2_qwen3.py (the loop is fsdp2_train.py). Launch with torchrun. Prints one JSON line: tokens/s
per GPU (median step after 3 warm-up steps), model TFLOP/s, the attention and experts
implementations transformers ran.

Model FLOPs per token, slidedp's convention (ModelLayout::ModelFlopsPerToken): 6 x the matmul
parameters a token meets (every parameter but the embedding lookup, the LM head counted when tied;
a MoE layer's num_experts_per_tok experts of its num_local_experts) + 12 x q_dim per key a query
sees: seq / 2 on average in a full layer, W - W^2 / (2 seq) in a sliding layer of window W < seq.
No recompute is counted."""
import json

import torch
import torch.distributed as dist

import fsdp2_train  # bench/e2e, the script's folder
import transformers

ROPE_GEMMA3 = {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
# common/model/model_presets.cc (kGemma3Hub, the GPT-OSS presets): the hub's config.json shapes.
SIZES = {
    "gemma3-1b": ("gemma3_text", dict(hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                                      num_key_value_heads=1, head_dim=256, intermediate_size=6912,
                                      query_pre_attn_scalar=256, vocab_size=262144, sliding_window=512,
                                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                       "sliding_attention": ROPE_GEMMA3["sliding_attention"]})),
    "gemma3-4b": ("gemma3_text", dict(hidden_size=2560, num_hidden_layers=34, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=256, intermediate_size=10240,
                                      query_pre_attn_scalar=256, vocab_size=262208, sliding_window=1024,
                                      rope_parameters=ROPE_GEMMA3)),
    "gemma3-12b": ("gemma3_text", dict(hidden_size=3840, num_hidden_layers=48, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=256, intermediate_size=15360,
                                       query_pre_attn_scalar=256, vocab_size=262208, sliding_window=1024,
                                       rope_parameters=ROPE_GEMMA3)),
    "gemma3-27b": ("gemma3_text", dict(hidden_size=5376, num_hidden_layers=62, num_attention_heads=32,
                                       num_key_value_heads=16, head_dim=128, intermediate_size=21504,
                                       query_pre_attn_scalar=168, vocab_size=262208, sliding_window=1024,
                                       rope_parameters=ROPE_GEMMA3)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64, intermediate_size=2880, vocab_size=201088,
                                    num_local_experts=32, num_experts_per_tok=4, sliding_window=128)),
    "gpt-oss-120b": ("gpt_oss", dict(hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
                                     num_key_value_heads=8, head_dim=64, intermediate_size=2880, vocab_size=201088,
                                     num_local_experts=128, num_experts_per_tok=4, sliding_window=128)),
}


def main():
    a = fsdp2_train.peer_args(SIZES, "gemma3-4b")
    rank, world = fsdp2_train.start()
    model_type, shape = SIZES[a.model]
    kwargs = dict(shape, max_position_embeddings=131072, use_cache=False)
    if a.layers:
        kwargs["num_hidden_layers"] = a.layers
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    # Gemma 3: SDPA with the sliding mask (HF's recommended training attention); GPT-OSS: eager (its
    # sinks), experts as transformers 5 picks them (grouped_mm where it dispatches).
    cfg._attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    nparam = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = cfg.vocab_size
    steady, peak = fsdp2_train.train(model, vocab, a.seq, a.mbs, a.steps, a.accum, rank)
    tok = a.mbs * a.seq * a.accum / steady
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    embed = vocab * h
    matmul = nparam - embed + (embed if cfg.tie_word_embeddings else 0)
    experts = getattr(cfg, "num_local_experts", 0) or 0
    if experts:  # every layer sparse: the idle experts' parameters (gate_up, down and their biases)
        per_expert = 3 * h * cfg.intermediate_size + 2 * cfg.intermediate_size + h
        matmul -= L * (experts - cfg.num_experts_per_tok) * per_expert
    keys = 0.0
    for t in cfg.layer_types:
        w = cfg.sliding_window if t == "sliding_attention" else 0
        keys += w - w * w / (2.0 * a.seq) if 0 < w < a.seq else a.seq / 2.0
    flops_tok = 6 * matmul + 12 * keys * cfg.num_attention_heads * cfg.head_dim
    if rank == 0:
        print(json.dumps({"peer": f"fsdp2-{model_type}", "model": a.model, "layers": L, "params_b": nparam / 1e9,
                          "active_matmul_b": matmul / 1e9, "gpus": world, "seq": a.seq, "mbs": a.mbs,
                          "accum": a.accum, "attention": cfg._attn_implementation,
                          "experts_implementation": getattr(model.config, "_experts_implementation", None),
                          "step_s": steady, "tokens_per_s_per_gpu": tok,
                          "model_tflops_per_gpu": tok * flops_tok / 1e12, "peak_gib": peak}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
