"""Peer baseline for Qwen3.5 (dense and MoE): HF transformers Qwen3_5ForCausalLM /
Qwen3_5MoeForCausalLM (random init, the hub's text shapes as slidedp's presets give them, at
--layers depth) trained with PyTorch FSDP2, GPU-resident, activation checkpointing on every layer,
FP32 master weights with BF16 compute (MixedPrecisionPolicy), fused torch AdamW: the setup of
fsdp2_qwen3.py. Launch with torchrun. Prints one JSON line: tokens/s per GPU (median step after 3
warm-up steps), model TFLOP/s, and which Gated DeltaNet implementation transformers ran (its
flash-linear-attention kernels when `fla` and `causal_conv1d` are installed, else its torch
fallback, torch_chunk_gated_delta_rule).

Model FLOPs per token, slidedp's convention (ModelLayout::ModelFlopsPerToken): 6 x the matmul
parameters a token meets (every parameter but the embedding lookup, the LM head counted when tied;
a MoE layer's num_experts_per_tok experts of its num_experts) + 6 x full-attention layers x seq x
q_dim (causal attention, forward and backward) + 18 x linear layers x value heads x key_head_dim x
value_head_dim (the gated delta rule's recurrence). No recompute is counted."""
import json

import torch
import torch.distributed as dist

import fsdp2_train  # bench/e2e, the script's folder
import transformers

# The hub's Qwen3.5 text configs (common/model/model_presets.cc, kQwen3_5Hub).
LINEAR = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4)
SIZES = {
    "qwen3.5-2b": ("qwen3_5_text", dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8,
                                        num_key_value_heads=2, intermediate_size=6144, tie_word_embeddings=True,
                                        linear_num_value_heads=16)),
    "qwen3.5-4b": ("qwen3_5_text", dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16,
                                        num_key_value_heads=4, intermediate_size=9216, tie_word_embeddings=True)),
    "qwen3.5-9b": ("qwen3_5_text", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16,
                                        num_key_value_heads=4, intermediate_size=12288, tie_word_embeddings=False)),
    "qwen3.5-35b-a3b": ("qwen3_5_moe_text", dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                                 num_key_value_heads=2, num_experts=256, num_experts_per_tok=8,
                                                 moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                                 tie_word_embeddings=False, output_router_logits=False)),
}


def gdn_implementation(model):
    """The gated delta rule transformers' Gated DeltaNet layers call (fla's kernel or its torch fallback)."""
    for m in model.modules():
        fn = getattr(m, "chunk_gated_delta_rule", None)
        if fn is not None:
            return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', type(fn).__name__)}"
    return None


def main():
    a = fsdp2_train.peer_args(SIZES, "qwen3.5-4b")
    rank, world = fsdp2_train.start()
    model_type, shape = SIZES[a.model]
    kwargs = dict(LINEAR, vocab_size=248320, head_dim=256, partial_rotary_factor=0.25, max_position_embeddings=262144,
                  rms_norm_eps=1e-6, use_cache=False)
    kwargs.update(shape)
    if a.layers:
        kwargs["num_hidden_layers"] = a.layers
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    nparam = sum(p.numel() for p in model.parameters())
    impl = gdn_implementation(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = cfg.vocab_size
    steady, peak = fsdp2_train.train(model, vocab, a.seq, a.mbs, a.steps, a.accum, rank)
    tok = a.mbs * a.seq * a.accum / steady
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    full = sum(1 for t in cfg.layer_types if t == "full_attention")
    embed = vocab * h
    matmul = nparam - embed + (embed if cfg.tie_word_embeddings else 0)
    experts = getattr(cfg, "num_experts", 0) or 0
    if experts:  # every layer sparse in qwen3_5_moe: the idle experts' parameters
        matmul -= L * (experts - cfg.num_experts_per_tok) * 3 * h * cfg.moe_intermediate_size
    recurrence = 18 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    flops_tok = 6 * matmul + 6 * full * a.seq * cfg.num_attention_heads * cfg.head_dim + (L - full) * recurrence
    if rank == 0:
        print(json.dumps({"peer": "fsdp2-qwen3.5", "model": a.model, "layers": L, "params_b": nparam / 1e9,
                          "active_matmul_b": matmul / 1e9, "gpus": world, "seq": a.seq, "mbs": a.mbs,
                          "accum": a.accum, "gated_delta_rule": impl,
                          "experts_implementation": getattr(model.config, "_experts_implementation", None),
                          "step_s": steady, "tokens_per_s_per_gpu": tok,
                          "model_tflops_per_gpu": tok * flops_tok / 1e12, "peak_gib": peak}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
