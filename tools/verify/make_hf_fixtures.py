#!/usr/bin/env python3
"""Tiny HF model directories, saved by transformers itself, with an FP32 reference step.

For each model family slidedp trains or is to train, makes a model of the family's architecture at
toy size (hidden 64, a few layers, vocabulary 512), seeded, saves it with `save_pretrained`
(safetensors, as users' checkpoints come) and computes, on the CPU in FP32, the loss, the logits
and every parameter's gradient for a fixed sequence:

  OUT/<family>/config.json, model.safetensors     what transformers wrote
  OUT/<family>/reference.safetensors              input_ids [1, T] (I64), loss [1], logits [1, T, V],
                                                  grad.<parameter name> per parameter (F32)
  OUT/<family>/reference.json                     transformers and torch versions, the family's
                                                  config arguments, the loss
  OUT/summary.json                                per family: "ok" or the error

tests/data/hf/ holds these (docs/model-families.md says how they were made): the CPU tests load
them (names, shapes, bytes) and later compare the CPU backend's loss and gradients with the
reference. Needs torch, transformers and safetensors (the GPU machine has them; nothing here uses
a GPU). A family this transformers does not know is reported and skipped.

  python3 tools/verify/make_hf_fixtures.py OUT [--families qwen3,gpt_oss] [--tokens 48]
"""
import argparse
import json
import os
import sys
import traceback

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attention_dropout=0.0)

# family -> (model_type, arguments over COMMON). Layer counts keep every layer kind of the family
# present at least once (linear and full attention; sliding and full; dense and sparse).
FAMILIES = {
    "qwen3": ("qwen3", dict(num_hidden_layers=2, rope_theta=1000000.0)),
    "qwen3_tied": ("qwen3", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(num_hidden_layers=2, rope_theta=1000000.0)),
    "llama": ("llama", dict(num_hidden_layers=2, rope_theta=500000.0)),
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=None)),
    # A window shorter than the sequence (48 tokens): every layer sliding.
    "mistral_window": ("mistral", dict(num_hidden_layers=2, sliding_window=16)),
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)),
    # Gated DeltaNet linear attention + gated full attention, one full layer in four.
    "qwen3_5": ("qwen3_5_text", dict(num_hidden_layers=4, full_attention_interval=4,
                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                     linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                     partial_rotary_factor=0.25)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_hidden_layers=4, full_attention_interval=4,
                                             linear_num_key_heads=2, linear_num_value_heads=4,
                                             linear_key_head_dim=16, linear_value_head_dim=16,
                                             linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=64)),
    # The released checkpoints' layout: Qwen3_5ForConditionalGeneration, a vision tower beside
    # model.language_model (text arguments as qwen3_5's; VISION below).
    "qwen3_5_vl": ("qwen3_5", "qwen3_5"),
    "qwen3_5_moe_vl": ("qwen3_5_moe", "qwen3_5_moe"),
    # Sliding-window and global attention layers (5 local : 1 global in Gemma 3).
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=16,
                                   rope_local_base_freq=10000.0, rope_theta=1000000.0)),
    # Gemma 4 with every piece the released checkpoints use: per-layer inputs (a 512 x (6 x 8) table),
    # sliding and full layers, the full ones at head_dim 32 with one kv head whose values are their
    # keys' projection (per_layer_config, transformers 5.15+'s spelling; 31B's attention_k_eq_v), the
    # last two layers reading layers 3's and 2's keys and values with MLPs twice as wide (E2B's),
    # proportional RoPE on the full layers, soft-capped logits; then the options some configs carry
    # (gemma4_kvshare: the same sharing in the older global_head_dim spelling).
    "gemma4": ("gemma4_text", dict(num_hidden_layers=6, sliding_window=16,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                                   vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
                                   per_layer_config={"2": dict(head_dim=32, num_key_value_heads=1),
                                                     "5": dict(head_dim=32, num_key_value_heads=1)},
                                   attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
                                   use_bidirectional_attention="vision", final_logit_softcapping=30.0)),
    "gemma4_kvshare": ("gemma4_text", dict(num_hidden_layers=6, sliding_window=16, vocab_size_per_layer_input=512,
                                           hidden_size_per_layer_input=8, global_head_dim=32, num_kv_shared_layers=2,
                                           use_double_wide_mlp=True, attention_k_eq_v=True,
                                           num_global_key_value_heads=1)),
    "gemma4_moe": ("gemma4_text", dict(num_hidden_layers=6, sliding_window=16, vocab_size_per_layer_input=512,
                                       hidden_size_per_layer_input=8, global_head_dim=32, enable_moe_block=True,
                                       num_experts=4, top_k_experts=2, moe_intermediate_size=32)),
    # The multimodal checkpoints: Gemma3ForConditionalGeneration / Gemma4 (a vision tower and a
    # projector beside the language model; VISION_BY_TYPE below).
    "gemma3_vl": ("gemma3", "gemma3"),
    "gemma4_vl": ("gemma4", "gemma4"),
    # Alternating sliding and full attention with attention sinks, MoE MLPs.
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=2, sliding_window=16, num_local_experts=4,
                                num_experts_per_tok=2, intermediate_size=64)),
}


# A toy vision tower for the multimodal layouts (its weights are passed through, never trained).
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[])


# Toy vision towers by multimodal model_type (SigLIP for Gemma 3: 32 px images of 8 px patches
# pooled to 4 soft tokens). A type missing here keeps its config's default tower.
VISION_BY_TYPE = {
    "gemma3": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    image_size=32, patch_size=8), dict(mm_tokens_per_image=4)),
    # Gemma 4: one encoder layer at hidden 32, a 2 x 64-position table (the default 10,240 would be
    # most of the fixture); no audio tower (build). Its image, video and audio placeholders inside the
    # vocabulary, so that the sequence holds them (make) and Gemma4Model's embedding of them as
    # pad_token_id is compared too.
    "gemma4": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, position_embedding_size=64),
               dict(image_token_id=500, video_token_id=501, audio_token_id=502)),
}


def build(family):
    """The family's config and an FP32 model of it, seeded."""
    import torch
    import transformers
    model_type, args = FAMILIES[family]
    if isinstance(args, str):  # multimodal: the text family's arguments as text_config
        text_type, text_args = FAMILIES[args]
        text = dict(COMMON)
        text.update(text_args)
        vision, extra = VISION_BY_TYPE.get(model_type, (dict(VISION), {}))
        kwargs = dict(text_config=text, vision_config=dict(vision), tie_word_embeddings=False, **extra)
        if model_type == "gemma4":
            kwargs["audio_config"] = None
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(1234)
        for auto in ("AutoModelForImageTextToText", "AutoModelForVision2Seq", "AutoModelForCausalLM"):
            cls = getattr(transformers, auto, None)
            if cls is None:
                continue
            try:
                return model_type, kwargs, config, cls.from_config(config, torch_dtype=torch.float32)
            except ValueError:
                continue
        raise ValueError(f"no auto class builds {model_type}")
    kwargs = dict(COMMON)
    kwargs.update(args)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    return model_type, kwargs, config, transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def make(family, out_dir, tokens):
    import torch
    import transformers
    from safetensors.torch import save_file
    model_type, kwargs, config, model = build(family)
    model.train()
    d = os.path.join(out_dir, family)
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    g = torch.Generator().manual_seed(99)
    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    # A multimodal model's placeholder ids that lie inside the vocabulary (gemma4_vl's) appear in the
    # sequence: text alone, the model embeds them as it embeds placeholders without pixels.
    for i, key in enumerate(("image_token_id", "video_token_id", "audio_token_id")):
        placeholder = getattr(config, key, None)
        if isinstance(placeholder, int) and placeholder < vocab:
            ids[0, 3 + 5 * i] = placeholder
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    tensors = {"input_ids": ids.contiguous(), "loss": out.loss.detach().reshape(1).contiguous(),
               "logits": out.logits.detach().float().contiguous()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            tensors["grad." + name] = p.grad.detach().float().contiguous()
    save_file(tensors, os.path.join(d, "reference.safetensors"))
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump({"family": family, "model_type": model_type, "arguments": kwargs, "tokens": tokens,
                   "loss": float(out.loss), "transformers": transformers.__version__,
                   "torch": torch.__version__, "class": type(model).__name__,
                   "parameters": {n: list(p.shape) for n, p in model.named_parameters()}}, f, indent=1)
    return float(out.loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    summary = {}
    for family in a.families.split(","):
        try:
            loss = make(family, a.out, a.tokens)
            summary[family] = {"ok": True, "loss": loss}
            print(f"{family}: ok, loss {loss:.6f}")
        except Exception as e:  # a family this transformers lacks, or other arguments: report, go on
            summary[family] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                               "trace": traceback.format_exc()[-2000:]}
            print(f"{family}: FAILED {type(e).__name__}: {e}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0 if all(s["ok"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
