// Decoder model configuration (HF config.json of the families below) and the streamed-unit layout
// shared by hostd (state segments, checkpoints, LayerAdam) and workers (compute, streaming).
//
// Families: one decoder layer shape (pre-norm RMSNorm, GQA attention with RoPE, SwiGLU MLP) with
// the differences HF's modeling code has between them:
//   qwen3     : per-head q/k RMSNorm before RoPE, no biases
//   qwen2     : Qwen2 / Qwen2.5: q/k/v projections with biases, no q/k norm
//   llama     : Llama 2/3.x: no biases, no q/k norm (RoPE scaling of type llama3 in 3.1+)
//   mistral   : as llama, with sliding-window attention in every layer where sliding_window is set
//   qwen3_moe : Qwen3's attention; in the sparse layers (IsSparseLayer) a router and experts in
//               place of the MLP (docs/moe.md).
//   qwen3_5   : Qwen3.5 (HF qwen3_5 / qwen3_5_text, and the multimodal checkpoint's language model):
//               two token mixers by layer (layer_mixers): Gated DeltaNet linear attention and gated
//               full attention (q_proj emits a sigmoid output gate per head beside the query, q/k
//               norms, RoPE on a partial_rotary_factor share of head_dim); every RMSNorm but the
//               linear attention's gated one computes x * (1 + w) (docs/model-families.md).
//   qwen3_5_moe: qwen3_5's mixers; every layer a MoE block of routed experts plus a shared expert
//               with its own sigmoid gate (qwen3_5_moe / qwen3_5_moe_text).
//   gemma3    : Gemma 3 (HF gemma3_text, and the language model of gemma3 multimodal checkpoints):
//               (1 + w) RMSNorms, four per block (input, post-attention on the attention output,
//               pre- and post-feedforward around the MLP), q/k norms, GeGLU with tanh-approximated
//               GELU, the embedding times sqrt(hidden) (EmbeddingScale), scores scaled by
//               query_pre_attn_scalar^-0.5, sliding layers with their own RoPE base beside the
//               global ones, optional soft-capped logits (docs/model-families.md).
//   gpt_oss   : GPT-OSS (HF gpt_oss): q/k/v/o biases, a learned sink logit per head in the attention
//               softmax, sliding layers beside full ones (layer_types), YaRN RoPE, and in every
//               layer a biased router (softmax over the top-k logits) and experts with biases and
//               a clamped SwiGLU, stored fused as transformers holds them (GptOssExpertTensor);
//               MXFP4 experts are dequantized at load (mxfp4_experts; docs/model-families.md).
//   gemma4    : Gemma 4 (HF gemma4_text, and the language model of gemma4 multimodal checkpoints):
//               Gemma 3's block with plain x * w norms, q/k norms and an unscaled v norm, scores
//               unscaled, full-attention layers with their own head_dim and kv heads (values = keys'
//               projection under attention_k_eq_v) and proportional RoPE, per-layer inputs gated in
//               after the MLP, a frozen layer_scalar, layers sharing an earlier layer's keys and
//               values (Gemma4Fields; docs/model-families.md).
// Any family may scale its RoPE (RopeScaling: linear, dynamic, llama3, yarn). qwen2, qwen3, mistral,
// qwen3_moe, gemma3 and gpt_oss may slide some or all of their attention layers (layer_spans,
// sliding_window). A config field this build does not implement is refused when parsed, naming the
// field.
//
// A model is streamed as units: the embedding, each decoder layer, and the head (final norm +
// LM head). Each unit's parameters are one flat array; tensors sit at fixed offsets inside it,
// each aligned to kTensorAlignNumel elements so vector loads and DMA chunks stay aligned.
// With tied embeddings the head unit holds only the final norm and reads the LM head weight from
// the embedding unit; the two gradient contributions are summed into the embedding's gradient.
// A sparse decoder unit keeps its experts as the hub's checkpoints name them, one expert after
// another (UnitLayout::experts).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp {

enum class ModelFamily { kQwen3, kQwen2, kLlama, kMistral, kQwen3Moe, kQwen3_5, kQwen3_5Moe, kGemma3, kGptOss, kGemma4 };
// HF's model_type: "qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
// "gemma3" (the multimodal wrapper's; a text-only checkpoint says "qwen3_5_text",
// "qwen3_5_moe_text", "gemma3_text": ModelConfig::multimodal false), "gpt_oss", "gemma4"
// (text-only: "gemma4_text").
const char* ModelTypeName(ModelFamily family);

// The gated MLP's activation: SwiGLU (silu), or gemma3's GeGLU with PyTorch's tanh-approximated
// GELU (HF hidden_activation "gelu_pytorch_tanh").
enum class MlpActivation { kSilu, kGeluTanh };

// A decoder layer's token mixer (HF layer_types): softmax attention, or qwen3_5's Gated DeltaNet.
enum class TokenMixer { kAttention, kLinearAttention };

// An attention layer's span (HF layer_types: full_attention, sliding_attention): every key of the
// query's document up to the query itself, or only the last ModelConfig::sliding_window of them.
enum class AttentionSpan { kFull, kSliding };

// qwen3_5's Gated DeltaNet sizes (HF linear_* fields): key heads of key_head_dim (q and k), value
// heads of value_head_dim (v, the state's columns, the output), a causal depthwise conv1d of
// conv_kernel taps over q|k|v. Each value head reads key head h / (value_heads / key_heads).
struct LinearAttentionConfig {
  int64_t num_key_heads = 16;
  int64_t num_value_heads = 32;
  int64_t key_head_dim = 128;
  int64_t value_head_dim = 128;
  int64_t conv_kernel = 4;

  int64_t key_dim() const { return num_key_heads * key_head_dim; }
  int64_t value_dim() const { return num_value_heads * value_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }  // q | k | v channels
  bool operator==(const LinearAttentionConfig& o) const {
    return num_key_heads == o.num_key_heads && num_value_heads == o.num_value_heads &&
           key_head_dim == o.key_head_dim && value_head_dim == o.value_head_dim && conv_kernel == o.conv_kernel;
  }
};

// How a checkpoint stores a MoE layer's experts: one tensor per expert and matrix
// (mlp.experts.{e}.gate_proj.weight, ...; Qwen3-MoE's hub layout) or fused over the experts
// (mlp.experts.gate_up_proj [E, 2 x moe_I, hidden], mlp.experts.down_proj [E, hidden, moe_I]:
// transformers 5's own layout, which its save_pretrained writes for qwen3_5_moe). The unit's layout
// is the same either way (ExpertLayout); only the names and slices the tensors map to differ.
enum class ExpertStorage { kPerExpert, kFused };

// RoPE scaling as HF's rope_parameters / rope_scaling give it (transformers 5.17,
// modeling_rope_utils.py; ModelConfig::RopeInverseFrequencies and RopeAttentionScaling compute it):
//   kLinear : every inverse frequency divided by factor (_compute_linear_scaling_rope_parameters).
//   kDynamic: dynamic NTK (_compute_dynamic_ntk_parameters). HF recomputes the frequencies only when
//             a forward sees a position >= max_position_embeddings; below that they are the ones
//             computed at init (theta * 1^(d/(d-2)) = theta). Exact here because hostd refuses
//             train.seq_len > max_position_embeddings (training_executor.cc) and the backends refuse
//             positions past it: that check must stay for this type.
//   kLlama3 : Llama 3.1's smooth per-band rescaling (_compute_llama3_parameters).
//   kYarn   : YaRN (_compute_yarn_parameters): interpolated (divided by factor) below the beta_slow
//             rotations over original_max_position_embeddings, untouched above beta_fast, a linear
//             ramp between; cos and sin are multiplied by an attention factor (default
//             0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio, or attention_factor).
struct RopeScaling {
  enum class Type { kNone, kLinear, kDynamic, kLlama3, kYarn };
  Type type = Type::kNone;
  double factor = 1;
  double low_freq_factor = 1;                       // llama3
  double high_freq_factor = 4;                      // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3, yarn: the pretraining context
  // yarn: the ramp's bounds in rotations over the original context (HF: a missing or 0 value is the
  // default), whether they are rounded outward to whole dimensions, and the attention factor's
  // inputs (0: not given, as HF's falsy None).
  double beta_fast = 32;
  double beta_slow = 1;
  bool truncate = true;
  double mscale = 0;
  double mscale_all_dim = 0;
  double attention_factor = 0;

  // Written out: CUDA translation units include this header as C++17 (no defaulted ==).
  bool operator==(const RopeScaling& o) const {
    return type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor &&
           high_freq_factor == o.high_freq_factor &&
           original_max_position_embeddings == o.original_max_position_embeddings && beta_fast == o.beta_fast &&
           beta_slow == o.beta_slow && truncate == o.truncate && mscale == o.mscale &&
           mscale_all_dim == o.mscale_all_dim && attention_factor == o.attention_factor;
  }
};

// gemma4's own structure (HF Gemma4TextConfig, transformers 5.17; docs/model-families.md, "Gemma 4"),
// zero / off for every other family. (Its sliding layers' RoPE base, window and logit cap are
// ModelConfig's sliding_rope_theta, sliding_window, final_logit_softcapping, as gemma3's.)
//   - Full-attention layers with their own head_dim and kv heads (per_layer_config, or the
//     global_head_dim / num_global_key_value_heads older configs spell), and under attention_k_eq_v
//     no v_proj: their values are the k_proj output through the unscaled v_norm.
//   - Per-layer inputs (ple_dim = hidden_size_per_layer_input > 0): a table of ple_vocab rows
//     (embed_tokens_per_layer, in the embedding unit) and a projection of the embedding output
//     (per_layer_model_projection and per_layer_projection_norm, in layer 0's unit: that output is
//     layer 0's input, and the projection's gradient is whole when layer 0's backward runs) give every
//     layer ple_dim inputs per token, which it gates in after its MLP.
//   - The last kv_shared_layers layers take the keys and values of the last earlier layer of their
//     attention type (KvSourceLayer) and have no k_proj / v_proj / k_norm; with double_wide_mlp their
//     MLP is twice intermediate_size wide.
//   - Each RoPE (full-attention layers', sliding layers'): "default" (every pair of the layer's head
//     rotates), or "proportional" (the first int(fraction x head_dim / 2) pairs rotate with
//     theta^(-2i / head_dim), the others not at all; every frequency divided by factor).
//   - Multimodal: the image, video and audio placeholder ids, which Gemma4Model embeds (in both
//     tables) as pad_token_id.
struct Gemma4Rope {
  bool proportional = false;
  double fraction = 1;  // partial_rotary_factor (proportional)
  double factor = 1;    // proportional
  bool operator==(const Gemma4Rope& o) const {
    return proportional == o.proportional && fraction == o.fraction && factor == o.factor;
  }
};
struct Gemma4Fields {
  int64_t full_head_dim = 0;  // 0: head_dim
  int64_t full_kv_heads = 0;  // 0: num_key_value_heads
  bool k_eq_v = false;
  int64_t ple_dim = 0;
  int64_t ple_vocab = 0;
  int64_t kv_shared_layers = 0;
  bool double_wide_mlp = false;
  Gemma4Rope full_rope, sliding_rope;
  std::vector<int64_t> placeholder_tokens;
};

struct ModelConfig {
  ModelFamily family = ModelFamily::kQwen3;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 128;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 40960;
  double rope_theta = 1e6;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  std::string torch_dtype = "bfloat16";
  RopeScaling rope_scaling;
  // Sliding-window attention as transformers 5.17 applies it (masking_utils.py:
  // sliding_window_overlay and causal_mask_function, and'ed with the packed documents' mask): in a
  // sliding layer query i sees key j of its own document iff i - sliding_window < j <= i, that is
  // sliding_window keys, itself included. layer_spans says which layers slide, one entry per layer
  // (empty: none); sliding_window is 0 when none does. Parsed per family as HF's configs apply
  // their fields (model_config_window.cc): mistral's sliding_window slides every layer; qwen2 and
  // qwen3's use_sliding_window slides the layers from max_window_layers on, or those layer_types
  // names; qwen3_moe's every layer.
  int64_t sliding_window = 0;
  std::vector<AttentionSpan> layer_spans;
  // Mixture of experts: qwen3_moe only (HF Qwen3MoeConfig's fields and, when parsed, its defaults);
  // the dense families keep num_experts 0. A sparse layer (IsSparseLayer) routes each token to
  // num_experts_per_tok of num_experts SwiGLU experts of width moe_intermediate_size; the other
  // layers keep a dense MLP of intermediate_size.
  int64_t num_experts = 0;          // HF 5.x's attribute_map also spells it num_local_experts
  int64_t num_experts_per_tok = 0;  // k, the experts each token reaches
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;           // renormalise the k routing weights to sum to 1
  int64_t decoder_sparse_step = 1;       // layer l is sparse when (l + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and l is not listed here
  // HF adds router_aux_loss_coef x the load-balancing loss to the training loss only when
  // output_router_logits is true (Qwen3MoeForCausalLM.forward); both are kept for that.
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;
  // qwen3_5 / qwen3_5_moe (empty elsewhere: every layer attention): each layer's token mixer.
  std::vector<TokenMixer> layer_mixers;
  LinearAttentionConfig linear;
  // The share of head_dim RoPE rotates (HF partial_rotary_factor; rotary_dim() = int(head_dim x it)).
  double partial_rotary_factor = 1;
  // qwen3_5_moe: the shared expert's width (HF shared_expert_intermediate_size); its gate is
  // mlp.shared_expert_gate.weight [1, hidden].
  int64_t shared_expert_intermediate_size = 0;
  ExpertStorage expert_storage = ExpertStorage::kPerExpert;
  // A gemma3 multimodal directory named as the hub's original files and transformers 5.17's
  // save_pretrained name it (language_model.model.*, language_model.lm_head.weight, vision_tower.*,
  // multi_modal_projector.*) rather than as its modules are named (model.language_model.*, lm_head.weight,
  // model.vision_tower.*): set from the directory's tensor names (AdoptDirNaming), so that its
  // checkpoints keep the spelling the user's files had.
  bool hub_wrapper_names = false;
  // gemma3 (Gemma3TextConfig; at these defaults for every other family): attention scores scaled by
  // query_pre_attn_scalar^-0.5 (0: head_dim^-0.5); logits soft-capped to cap * tanh(logits / cap)
  // (final_logit_softcapping, 0: none; Gemma3ForCausalLM applies it, the multimodal class does
  // not, so a multimodal config's is refused); the sliding layers' own RoPE (rope_local_base_freq or
  // rope_parameters.sliding_attention; sliding_rope_theta 0: every layer rotates with rope_theta and
  // rope_scaling, which are the full-attention layers' in gemma3); the embedding row HF's
  // Embedding(padding_idx = pad_token_id) zeroes at init and gives no gradient (-1: none; only the
  // families that read it set it: gemma3, gemma4, gpt_oss).
  double query_pre_attn_scalar = 0;
  double final_logit_softcapping = 0;
  double sliding_rope_theta = 0;
  RopeScaling sliding_rope_scaling;
  int64_t pad_token_id = -1;
  // gpt_oss: config.json's quantization_config is MXFP4 (quant_method "mxfp4"): the directory keeps
  // the experts as *_blocks / *_scales, dequantized at load as transformers does; checkpoints save
  // them unquantized (the model's dtype) and config.json without quantization_config.
  bool mxfp4_experts = false;
  Gemma4Fields gemma4;
  // The multimodal checkpoint layout (HF Qwen3_5ForConditionalGeneration,
  // Gemma3ForConditionalGeneration): config.json nests the language model's config in text_config
  // and its weights are model.language_model.*; the vision tower (qwen3_5: model.visual.*, mtp.*;
  // gemma3: model.vision_tower.*, model.multi_modal_projector.*) is not trained and passes through
  // unchanged.
  bool multimodal = false;
  // The source config.json as parsed (empty for a preset): what ToJson writes back, so the saved
  // directory keeps the fields HF reads that do not shape the math (token ids, generation
  // settings, architectures).
  std::string source_json;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  bool is_qwen3_5() const { return family == ModelFamily::kQwen3_5 || family == ModelFamily::kQwen3_5Moe; }
  bool is_gemma3() const { return family == ModelFamily::kGemma3; }
  bool is_gpt_oss() const { return family == ModelFamily::kGptOss; }
  bool is_gemma4() const { return family == ModelFamily::kGemma4; }
  bool has_qk_norm() const {
    return family == ModelFamily::kQwen3 || family == ModelFamily::kQwen3Moe || is_qwen3_5() || is_gemma3() ||
           is_gemma4();
  }
  // gpt_oss (attention_bias): biases on q/k/v and on o_proj, and a learned sink logit per head
  // (self_attn.sinks) in every softmax's denominator.
  bool has_qkv_bias() const { return family == ModelFamily::kQwen2 || is_gpt_oss(); }
  bool has_o_bias() const { return is_gpt_oss(); }
  bool has_attention_sinks() const { return is_gpt_oss(); }
  bool is_moe() const {
    return family == ModelFamily::kQwen3Moe || family == ModelFamily::kQwen3_5Moe || is_gpt_oss();
  }
  // qwen3_5: q_proj emits [query | gate] per head (2 x q_dim rows) and the attention output is
  // multiplied by sigmoid(gate) before o_proj.
  bool has_attention_output_gate() const { return is_qwen3_5(); }
  // qwen3_5, gemma3: every RMSNorm weight but the linear attention's gated norm acts as (1 + w).
  bool norms_add_one() const { return is_qwen3_5() || is_gemma3(); }
  // gemma3: the attention output is normed (post_attention_layernorm) before the residual add, the
  // MLP's input (pre_feedforward_layernorm) and output (post_feedforward_layernorm) too.
  bool has_sandwich_norms() const { return is_gemma3(); }
  MlpActivation mlp_activation() const {
    return is_gemma3() || is_gemma4() ? MlpActivation::kGeluTanh : MlpActivation::kSilu;
  }
  // The families whose multimodal checkpoints this build reads (text_config, model.language_model.*).
  bool has_multimodal_layout() const { return is_qwen3_5() || is_gemma3() || is_gemma4(); }
  // The factor the attention scores are multiplied by: query_pre_attn_scalar ** -0.5 as Python
  // computes it (gemma3), 1 (gemma4), else 1 / sqrt(head_dim).
  double AttentionScale() const;
  // gemma3's and gemma4's embedding scale (their ScaledWordEmbedding): sqrt(hidden_size) as a float32
  // tensor, cast to the model's dtype (torch_dtype: bfloat16 rounds it, e.g. sqrt(3072) = 55.43 ->
  // 55.5) as HF's embed_scale.to(weight.dtype) does; 1 for the other families.
  double EmbeddingScale() const;
  // gemma4's per-layer embedding scale: sqrt(hidden_size_per_layer_input) in the model's dtype, as
  // EmbeddingScale (1 without per-layer inputs and for the other families).
  double PerLayerEmbeddingScale() const;
  // gemma3: the sliding layers rotate with their own RoPE (sliding_rope_theta, sliding_rope_scaling).
  bool has_sliding_rope() const { return sliding_rope_theta > 0; }
  bool UsesSlidingRope(int64_t layer) const { return has_sliding_rope() && IsSlidingLayer(layer); }
  bool has_shared_expert() const { return shared_expert_intermediate_size > 0; }
  // The dimensions of each head RoPE rotates: int(head_dim x partial_rotary_factor) (HF), even.
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor); }
  TokenMixer MixerOf(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(layer_mixers.size()) ? layer_mixers[layer] : TokenMixer::kAttention;
  }
  bool IsLinearAttentionLayer(int64_t layer) const { return MixerOf(layer) == TokenMixer::kLinearAttention; }
  int64_t NumLinearAttentionLayers() const;
  bool IsSlidingLayer(int64_t layer) const {
    return layer >= 0 && layer < static_cast<int64_t>(layer_spans.size()) &&
           layer_spans[layer] == AttentionSpan::kSliding;
  }
  int64_t NumSlidingLayers() const;
  // How many keys a query of this layer sees at most, itself included: sliding_window in a sliding
  // layer, 0 (no limit but the document's start) in any other.
  int64_t AttentionWindow(int64_t layer) const { return IsSlidingLayer(layer) ? sliding_window : 0; }
  // A decoder layer's attention and MLP sizes: head_dim, num_key_value_heads and intermediate_size,
  // but in gemma4's full-attention layers and double-wide MLPs (Gemma4Fields).
  int64_t LayerHeadDim(int64_t layer) const;
  int64_t LayerKvHeads(int64_t layer) const;
  int64_t LayerIntermediate(int64_t layer) const;
  // gemma4: the layer whose keys and values this one attends with (HF's shared_kv_states: the last
  // layer of its type before the first of the num_kv_shared_layers), -1 where it computes its own.
  int64_t KvSourceLayer(int64_t layer) const;
  // Where the language model's weights live: "model." (a causal LM), "model.language_model."
  // (the multimodal layout), "language_model.model." (the hub's gemma3 spelling); the LM head is
  // lm_head.weight, or language_model.lm_head.weight in the hub's gemma3 spelling.
  std::string WeightPrefix() const {
    if (hub_wrapper_names) return "language_model.model.";
    return multimodal ? "model.language_model." : "model.";
  }
  std::string HeadWeightName() const { return hub_wrapper_names ? "language_model.lm_head.weight" : "lm_head.weight"; }
  // Where the multimodal checkpoint's towers and projector live ("model." beside model.language_model,
  // "" in the hub's gemma3 spelling).
  std::string WrapperPrefix() const { return hub_wrapper_names ? "" : "model."; }
  // HF's Qwen3MoeDecoderLayer: layer l has a router and experts iff l is not in mlp_only_layers,
  // num_experts > 0 and (l + 1) % decoder_sparse_step == 0. Always false for the dense families.
  bool IsSparseLayer(int64_t layer) const;
  int64_t NumSparseLayers() const;
  // OK when the compute backends can train this model; UNIMPLEMENTED naming what is missing
  // otherwise (qwen3_moe: its layers are described and stored, not yet computed): the status for
  // hostd to refuse such a job with at submit.
  absl::Status CheckTrainable() const;
  bool trainable() const { return CheckTrainable().ok(); }
  // RoPE's inverse frequencies [rotary_dim / 2] in float32, computed as HF computes them (the
  // default theta^(-2i/d) in float32, then the scaling's float32 arithmetic): rope_theta and
  // rope_scaling's, or with kSliding a gemma3 sliding layer's (sliding_rope_theta and scaling; the
  // same as kFull without has_sliding_rope).
  std::vector<float> RopeInverseFrequencies(AttentionSpan span = AttentionSpan::kFull) const;
  // The factor HF multiplies into cos and sin (its attention_scaling): 1 except for yarn. Both
  // backends apply it as HF does, cos_f32 * float(factor); 1 leaves them bit-identical.
  double RopeAttentionScaling(AttentionSpan span = AttentionSpan::kFull) const;
  // True when rows of seq_len tokens see no difference from full causal attention: no sliding
  // layer, or a window at least as wide as the row (a document is never longer than its row).
  bool SlidingWindowCovers(int64_t seq_len) const { return NumSlidingLayers() == 0 || sliding_window >= seq_len; }

  // Checks internal consistency (positive sizes, heads divisible by kv heads, the MoE fields in
  // range, ...).
  absl::Status Validate() const;

  // Parses HF config.json text. Keys that do not change the math are ignored (HF configs carry
  // many; qwen3_5 and gemma3 refuse any key they do not know); a model_type other than the
  // families above (qwen2_moe, mixtral, ... included), a field
  // that would change the math this build does not implement (another rope type, biases
  // elsewhere, another activation, shared experts, ...), or missing required sizes is
  // INVALID_ARGUMENT naming the field. qwen3_moe's MoE fields take Qwen3MoeConfig's defaults when
  // absent (docs/moe.md), and so does its intermediate_size (6144).
  static absl::StatusOr<ModelConfig> FromJson(absl::string_view json_text);
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);
  // A job's context override (model.max_position_embeddings, model.rope_scaling): fine-tuning a
  // model to a longer context than its config says. max_position_embeddings > 0 replaces the
  // config's; a non-empty rope_scaling_json (an object as HF's rope_scaling) replaces its RoPE,
  // read as config.json's is (a missing original_max_position_embeddings is the config's
  // max_position_embeddings before the override). ToJson then writes the overridden values.
  absl::Status OverrideContext(int64_t max_position_embeddings, absl::string_view rope_scaling_json);
  // The first `layers` decoder layers alone (a job's model.num_hidden_layers, bench_step --layers):
  // the per-layer lists cut to them, gemma4's shared layers kept the same layers with a full last
  // one, the window dropped where no sliding layer is left, mlp_only_layers past the depth dropped;
  // validated. INVALID_ARGUMENT for more layers than the model has (the caller names the key).
  absl::Status ReduceDepth(int64_t layers);
  // HF-loadable config.json text: the source config with this config's fields written over it,
  // or, for a preset, the family's (architectures <Family>ForCausalLM). qwen3_moe's MoE fields are
  // written as Qwen3MoeConfig spells them.
  std::string ToJson() const;

  // Reference shapes (random init): "qwen3-0.6b" ... "qwen3-14b", "qwen2.5-0.5b" ... "qwen2.5-14b",
  // "llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "mistral-7b" (v0.3), "qwen3-30b-a3b", and the
  // CI-sized "tiny" (Qwen3-shaped: hidden 64, 2 layers, vocab 512), "tiny-qwen2",
  // "tiny-qwen2-window" (its layer 1 sliding over 16 keys), "tiny-llama", "tiny-mistral",
  // "tiny-mistral-window" (both layers sliding over 16), "tiny-moe" (qwen3_moe: 3 layers, the
  // middle one dense, 8 experts, top 2),
  // "qwen3.5-4b", "qwen3.5-35b-a3b" (the hub's text configs), "tiny-qwen3.5", "tiny-qwen3.5-moe",
  // "gemma3-1b" ... "gemma3-27b" (the hub's language models), "tiny-gemma3" (six layers, 5:1 sliding
  // over 16 keys, soft-capped logits), "gpt-oss-20b", "gpt-oss-120b" (the hub's configs),
  // "tiny-gpt-oss" (a sliding layer over 16 keys, then a full one; 4 experts, top 2), "gemma4-e2b",
  // "gemma4-e4b", "gemma4-31b" (the hub's language models), "tiny-gemma4" (every gemma4 feature the
  // released checkpoints use, at CI size).
  static absl::StatusOr<ModelConfig> Preset(absl::string_view name);
  // The preset names, for messages.
  static std::string PresetNames();
};

enum class UnitKind { kEmbedding, kDecoder, kHead };

// Tensor order inside a decoder unit. Compute backends index tensors by these values.
enum DecoderTensor : int {
  kInputNorm = 0,  // [hidden]
  kQProj,          // [q_dim, hidden]
  kKProj,          // [kv_dim, hidden]
  kVProj,          // [kv_dim, hidden]
  kOProj,          // [hidden, q_dim]
  kQNorm,          // [head_dim]
  kKNorm,          // [head_dim]
  kPostNorm,       // [hidden]
  kGateProj,       // [intermediate, hidden]
  kUpProj,         // [intermediate, hidden]
  kDownProj,       // [hidden, intermediate]
  kQBias,          // [q_dim]   (qwen2 only)
  kKBias,          // [kv_dim]  (qwen2 only)
  kVBias,          // [kv_dim]  (qwen2 only)
  kRouter,         // [num_experts, hidden]  (sparse layers only: mlp.gate.weight)
  // qwen3_5's Gated DeltaNet (linear_attention layers, in place of kQProj..kKNorm): linear_attn.*
  kLinearInProjQkv,  // in_proj_qkv [conv_dim, hidden]
  kLinearInProjZ,    // in_proj_z [value_dim, hidden]
  kLinearInProjB,    // in_proj_b [value_heads, hidden]
  kLinearInProjA,    // in_proj_a [value_heads, hidden]
  kLinearConv,       // conv1d.weight [conv_dim, 1, conv_kernel]
  kLinearDtBias,     // dt_bias [value_heads]    (FP32 side copy)
  kLinearALog,       // A_log [value_heads]      (FP32 side copy)
  kLinearNorm,       // norm.weight [value_head_dim]: the gated RMSNorm's (plain w, not 1 + w)
  kLinearOutProj,    // out_proj [hidden, value_dim]
  // qwen3_5_moe's shared expert (every layer, beside the routed experts): mlp.shared_expert.*
  kSharedGateProj,    // [shared_I, hidden]
  kSharedUpProj,      // [shared_I, hidden]
  kSharedDownProj,    // [hidden, shared_I]
  kSharedExpertGate,  // mlp.shared_expert_gate.weight [1, hidden]
  // gemma3's norms around the MLP (kPostNorm is its post_attention_layernorm, which norms the
  // attention output before the residual add): pre_feedforward_layernorm [hidden] on the MLP's
  // input, post_feedforward_layernorm [hidden] on its output.
  kPreFfnNorm,
  kPostFfnNorm,
  // gpt_oss: self_attn.o_proj.bias [hidden], self_attn.sinks [heads] (a learned logit per head in
  // every query's softmax denominator), mlp.router.bias [num_experts] (its router is
  // mlp.router.weight, at kRouter).
  kOBias,
  kSinks,
  kRouterBias,
  // gemma4: the per-layer input's gate per_layer_input_gate [ple_dim, hidden], projection
  // per_layer_projection [hidden, ple_dim] and its norm post_per_layer_input_norm [hidden];
  // layer_scalar [1] (a buffer transformers does not train: TensorSlot::trainable false); and in
  // layer 0's unit alone the model's per_layer_model_projection [layers x ple_dim, hidden] and
  // per_layer_projection_norm [ple_dim] (Gemma4Fields).
  kPleGate,
  kPleProj,
  kPlePostNorm,
  kLayerScalar,
  kPleModelProj,
  kPleModelNorm,
  kNumDecoderTensors
};
// A decoder unit holds only its family's tensors (UnitLayout::slot maps these values to them):
// qwen3 has no biases, the other families no q/k norms. A sparse unit has kRouter and its experts
// in place of kGateProj, kUpProj and kDownProj.

// One expert's matrices, in their order inside its block (HF's Qwen3MoeMLP of
// moe_intermediate_size): mlp.experts.{e}.gate_proj.weight [moe_I, hidden], up_proj [moe_I,
// hidden], down_proj [hidden, moe_I].
enum ExpertTensor : int { kExpertGateProj = 0, kExpertUpProj, kExpertDownProj, kNumExpertTensors };
// gpt_oss's expert block (HF GptOssExperts, whose parameters are fused over the experts): expert
// e's slices of mlp.experts.gate_up_proj [E, hidden, 2 I] (x @ W: gate in the even columns, up in
// the odd ones), gate_up_proj_bias [E, 2 I], down_proj [E, I, hidden], down_proj_bias [E, hidden].
enum GptOssExpertTensor : int {
  kGptOssGateUp = 0,
  kGptOssGateUpBias,
  kGptOssDown,
  kGptOssDownBias,
  kNumGptOssExpertTensors
};
inline constexpr int kMaxExpertTensors = kNumGptOssExpertTensors;
// Embedding unit: tensor 0 = embed_tokens [vocab, hidden]; gemma4 with per-layer inputs: tensor 1 =
// embed_tokens_per_layer [ple_vocab, layers x ple_dim].
// Head unit: tensor 0 = final norm [hidden]; tensor 1 = lm_head [vocab, hidden] when untied.

inline constexpr int64_t kTensorAlignNumel = 256;

struct TensorSlot {
  std::string hf_name;          // e.g. "model.layers.3.mlp.up_proj.weight"
  std::vector<int64_t> shape;   // row-major, HF's shape
  int64_t offset_numel = 0;     // from the start of the unit
  int64_t numel = 0;
  // Norm weights (the 1-D tensors) also reach the workers in FP32, read from the master, in a
  // side copy of UnitLayout::fp32_numel floats: this tensor's offset there, -1 for the others.
  // HF under bf16 autocast computes RMSNorm with the FP32 weights; near 1.0 BF16's spacing
  // (2^-8) would swallow fine-tuning updates of ~1e-5 for hundreds of steps.
  int64_t fp32_offset = -1;
  // A slice of a larger checkpoint tensor (ExpertStorage::kFused: one expert's matrix of
  // mlp.experts.gate_up_proj / down_proj): that tensor's full shape and this slice's first element
  // in it (row-major, contiguous). Empty: the checkpoint tensor hf_name is this slot, whole.
  std::vector<int64_t> hf_shape;
  int64_t hf_offset_numel = 0;
  bool is_slice() const { return !hf_shape.empty(); }
  // A buffer the checkpoint carries and the math reads but HF never trains (gemma4's layer_scalar):
  // loaded, streamed and saved as every tensor, but no optimizer step writes it, and it is not
  // among ModelLayout::param_count's parameters.
  bool trainable = true;
  // Unique among a layout's slots: hf_name, with "@<offset>" for a slice.
  std::string Key() const;
};

inline constexpr int64_t kFp32SideAlignNumel = 64;  // 256 B per side-copy entry

// Where a sparse decoder unit keeps its experts. The router (kRouter) comes first, after the
// attention tensors; then expert 0's block, expert 1's, ..., in index order, back to back: each
// block holds the expert's three matrices (ExpertTensor order) with their alignment padding, all
// blocks are expert_numel long, and the last one ends the unit. So the grouped GEMMs see one
// stride between experts, and streaming a subset of experts is one range per expert.
struct ExpertLayout {
  int64_t num_experts = 0;   // 0: a dense unit
  int64_t first_offset = 0;  // expert 0's block, from the start of the unit
  // One block, padding included: the stride from expert e to e + 1.
  int64_t expert_numel = 0;
  // The tensors of one block: kNumExpertTensors (ExpertTensor), or gpt_oss's
  // kNumGptOssExpertTensors (GptOssExpertTensor).
  int tensors_per_expert = kNumExpertTensors;
  // Each tensor's offset from the start of its block (in that order).
  int64_t offset_in_expert[kMaxExpertTensors] = {};
  // The UnitLayout::tensors index of expert 0's first tensor; expert e's tensor t is at
  // first_tensor + tensors_per_expert * e + t.
  int first_tensor = -1;
};

struct UnitLayout {
  UnitKind kind = UnitKind::kDecoder;
  int index = 0;                // position in ModelLayout::units (forward order)
  int decoder_layer = -1;       // HF layer index for decoder units
  // Decoder units: the keys a query sees at most, itself included (ModelConfig::AttentionWindow:
  // the sliding window of a sliding layer; 0, full causal attention, for any other).
  int64_t attention_window = 0;
  // Decoder units: the layer rotates q and k with the sliding layers' RoPE (ModelConfig::UsesSlidingRope).
  bool sliding_rope = false;
  std::string name;             // "embed", "layer.3", "head"
  std::vector<TensorSlot> tensors;
  int64_t numel = 0;            // padded total, a multiple of kTensorAlignNumel
  int64_t fp32_numel = 0;       // the FP32 side copy of the norm weights (TensorSlot::fp32_offset)
  // Decoder units: tensors[slot[t]] is DecoderTensor t, -1 where the family has none.
  int slot[kNumDecoderTensors];
  UnitLayout() { std::fill(std::begin(slot), std::end(slot), -1); }
  ExpertLayout experts;  // num_experts 0 except in a sparse decoder unit
  const TensorSlot* Find(DecoderTensor t) const { return slot[t] >= 0 ? &tensors[slot[t]] : nullptr; }

  bool sparse() const { return experts.num_experts > 0; }
  int64_t num_experts() const { return experts.num_experts; }
  // Expert e's block: [ExpertOffset(e), ExpertOffset(e) + ExpertNumel()) of the unit.
  int64_t ExpertOffset(int64_t e) const { return experts.first_offset + e * experts.expert_numel; }
  int64_t ExpertNumel() const { return experts.expert_numel; }
  // Expert e's tensor t; nullptr when the unit is dense, e is out of range or its blocks are not
  // of that kind (ExpertTensor: qwen3_moe, qwen3_5_moe; GptOssExpertTensor: gpt_oss).
  const TensorSlot* FindExpert(int64_t e, ExpertTensor t) const { return ExpertSlot(e, t, kNumExpertTensors); }
  const TensorSlot* FindExpert(int64_t e, GptOssExpertTensor t) const {
    return ExpertSlot(e, t, kNumGptOssExpertTensors);
  }
  const TensorSlot* ExpertSlot(int64_t e, int t, int per_expert) const {
    if (e < 0 || e >= experts.num_experts || experts.tensors_per_expert != per_expert) return nullptr;
    return &tensors[experts.first_tensor + per_expert * e + t];
  }
};

// "[i, j]": the row-major index of flat element `flat` of a tensor of `shape`.
std::string TensorIndexString(const std::vector<int64_t>& shape, int64_t flat);
// What element `offset` of the unit is, for error messages: "model.layers.3.mlp.up_proj.weight[5, 17]",
// or "the padding after model.layers.3.input_layernorm.weight" (or "at the start of the unit").
std::string DescribeUnitElement(const UnitLayout& unit, int64_t offset);

// Fills the unit's FP32 side copy (unit.fp32_numel floats) from its FP32 values in the unit's
// layout (the master): each norm weight at its TensorSlot::fp32_offset.
void CopyNormsFromMaster(const UnitLayout& unit, const float* master, float* side);

struct ModelLayout {
  ModelConfig config;
  std::vector<UnitLayout> units;  // forward order: embed, layer.0 .. layer.L-1, head
  int64_t total_numel = 0;
  bool head_uses_embedding = false;  // tied: the head's LM head weight is the embedding's

  static ModelLayout Build(const ModelConfig& config);

  const UnitLayout& embedding() const { return units.front(); }
  const UnitLayout& head() const { return units.back(); }
  int num_units() const { return static_cast<int>(units.size()); }
  // Looks up a tensor by its HF name; nullptr if absent. Also returns the unit index.
  const TensorSlot* Find(absl::string_view hf_name, int* unit_index) const;
  // Trainable parameter count (no padding; tied weights counted once): HF's num_parameters().
  int64_t param_count() const;
  // The parameters one token's forward reads: param_count less, in each sparse layer, the
  // num_experts - num_experts_per_tok experts it is not routed to (the router and the embedding
  // row lookup count). Equal to param_count for a dense model.
  int64_t ActiveParamCount() const;
  // Model FLOPs per trained token at sequence length seq_len, the convention of
  // ../shared/bench/peers/fsdp2_qwen3.py (so our TFLOP/s and the peer's compare): 6 x matmul
  // parameters a token meets (ActiveParamCount: the LM head counts, the embedding lookup does not;
  // in a MoE model the router and k experts per sparse layer) + causal attention
  // 6 * attention layers * seq_len * q_dim, + per qwen3_5 linear-attention layer 18 x value_heads x
  // key_head_dim x value_head_dim (its recurrence's three products, forward and backward);
  // recompute is not counted.
  double ModelFlopsPerToken(int64_t seq_len) const;
  // runtime.offload_ratio's layers: round(ratio x decoder layers), clamped; the workers offload
  // the inputs of units 1..k, and hostd's memory plan counts them.
  int OffloadedLayers(double ratio) const;
};

}  // namespace slidedp
