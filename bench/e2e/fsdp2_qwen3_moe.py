"""Peer baseline for Qwen3-MoE: HF transformers Qwen3MoeForCausalLM (random init, the hub's
Qwen3-30B-A3B shape at --layers depth) trained with PyTorch FSDP2, GPU-resident, activation
checkpointing on every layer, FP32 master weights with BF16 compute (MixedPrecisionPolicy), fused
torch AdamW. HF's experts run with transformers 5's default experts implementation (grouped_mm where
torch has it): the peer's fastest. Launch with torchrun. Prints one JSON line: tokens/s per GPU
(median step after 3 warm-up steps) and model TFLOP/s of the active parameters.

Model FLOPs per token, the convention of fsdp2_qwen3.py and of slidedp's ModelFlopsPerToken with
ModelLayout::ActiveParamCount: 6 x the matmul parameters a token meets (attention, router, the
num_experts_per_tok experts of each sparse layer, the LM head; not the embedding lookup) +
6 * L * seq * q_dim (causal attention, forward and backward). No recompute is counted."""
import json

import torch
import torch.distributed as dist

import fsdp2_train  # bench/e2e, the script's folder
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SIZES = {  # hidden, layers, heads, kv, head_dim, moe_intermediate, experts, top_k, vocab, tied
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 768, 128, 8, 151936, False),
}


def main():
    a = fsdp2_train.peer_args(None, "qwen3-30b-a3b")
    rank, world = fsdp2_train.start()
    h, L, nh, kv, hd, moe_i, E, k, vocab, tied = SIZES[a.model]
    if a.layers:
        L = a.layers
    cfg = Qwen3MoeConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=nh, num_key_value_heads=kv,
                         head_dim=hd, intermediate_size=6144, moe_intermediate_size=moe_i, num_experts=E,
                         num_experts_per_tok=k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=40960, rope_theta=1e6,
                         rms_norm_eps=1e-6, attn_implementation="sdpa", use_cache=False, output_router_logits=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg)
    nparam = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    steady, peak = fsdp2_train.train(model, vocab, a.seq, a.mbs, a.steps, a.accum, rank)
    tok = a.mbs * a.seq * a.accum / steady
    q_dim = nh * hd
    attn = h * q_dim * 2 + h * kv * hd * 2  # q, o; k, v
    expert = 3 * h * moe_i
    active_matmul = L * (attn + E * h + k * expert) + vocab * h  # + the LM head (tied or not)
    flops_tok = 6 * active_matmul + 6 * L * a.seq * q_dim
    if rank == 0:
        print(json.dumps({"peer": "fsdp2-moe", "model": a.model, "layers": L, "params_b": nparam / 1e9,
                          "active_matmul_b": active_matmul / 1e9, "gpus": world, "seq": a.seq, "mbs": a.mbs, "accum": a.accum,
                          "experts_implementation": getattr(model.config, "_experts_implementation", None),
                          "step_s": steady, "tokens_per_s_per_gpu": tok,
                          "model_tflops_per_gpu": tok * flops_tok / 1e12, "peak_gib": peak}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
