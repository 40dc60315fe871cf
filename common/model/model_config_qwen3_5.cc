// Qwen3.5's config (qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text): its fields, the keys this
// build knows, and their ranges (model_config.h; docs/model-families.md).
#include <algorithm>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"
#include "common/status/status_macros.h"

namespace slidedp::config_internal {

// The keys of a qwen3_5 / qwen3_5_moe text config (HF Qwen3_5TextConfig, Qwen3_5MoeTextConfig and
// the PreTrainedConfig fields every saved config carries) this build reads or knows not to change
// the math. Any other key is refused naming it: these families are new enough that an unknown
// field is more likely a variant this build does not compute than noise.
constexpr const char* kQwen3_5TextKeys[] = {
    // sizes and numerics (parsed)
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "attention_bias",
    "attention_dropout", "layer_types", "full_attention_interval", "attn_output_gate", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "dtype", "torch_dtype",
    // qwen3_5_moe (parsed; refused for the dense family by ParseQwen3_5)
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "router_aux_loss_coef", "output_router_logits", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    // multi-token prediction: its weights (mtp.*) pass through untrained; the LM's math is unchanged
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
    // the dtype inference engines cache the Gated DeltaNet's state in (the released configs say
    // float32); training here keeps the state in FP32 throughout, as HF's torch path does
    "mamba_ssm_dtype",
    "pad_token_id", "use_sliding_window", "sliding_window", "max_window_layers",
};

// The wrapper of the multimodal layout (Qwen3_5Config / Qwen3_5MoeConfig): its own keys; the
// vision tower's config is carried unchanged.
constexpr const char* kQwen3_5WrapperKeys[] = {
    "model_type", "architectures", "text_config", "vision_config", "image_token_id", "video_token_id",
    "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings", "transformers_version", "dtype",
    "torch_dtype", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "name_or_path", "tokenizer_class",
};

// PreTrainedConfig's generation and bookkeeping fields, which every saved config may carry and none
// changes the training math: known to every family's whitelist.
constexpr const char* kBookkeepingKeys[] = {
    "use_cache", "bos_token_id", "eos_token_id", "transformers_version", "architectures", "output_attentions",
    "output_hidden_states", "return_dict", "use_return_dict", "torchscript", "is_decoder", "is_encoder_decoder",
    "add_cross_attention", "tie_encoder_decoder", "chunk_size_feed_forward", "problem_type", "id2label", "label2id",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "base_config_key", "name_or_path",
    "sep_token_id", "decoder_start_token_id", "cross_attention_hidden_size", "pruned_heads",
};

absl::Status RefuseUnknownKeys(const nlohmann::json& j, absl::Span<const char* const> known, absl::string_view where,
                               absl::string_view model_type) {
  auto in = [](absl::Span<const char* const> keys, const std::string& k) {
    return std::find_if(keys.begin(), keys.end(), [&](const char* n) { return k == n; }) != keys.end();
  };
  for (const auto& [k, v] : j.items()) {
    if (absl::StartsWith(k, "_")) continue;  // HF's private bookkeeping (_name_or_path, _attn_implementation...)
    if (in(known, k) || in(kBookkeepingKeys, k)) continue;
    return Refuse(absl::StrCat(where, k), absl::StrCat("is not implemented by this build for ", model_type,
                                                       " (a field it does not know could change the model's math)"));
  }
  return absl::OkStatus();
}

// qwen3_5 / qwen3_5_moe's own fields (text config `t`), each checked and refused naming the field.
// HF defaults (Qwen3_5TextConfig / Qwen3_5MoeTextConfig, transformers 5.17) where a key is absent.
absl::Status ParseQwen3_5(const nlohmann::json& t, absl::string_view where, ModelConfig* c) {
  auto integer = [&](const char* key, int64_t* out) -> absl::Status {
    if (!t.contains(key) || t[key].is_null()) return absl::OkStatus();
    if (!t[key].is_number_integer()) {
      return Refuse(absl::StrCat(where, key), absl::StrCat("must be an integer, got ", t[key].dump()));
    }
    *out = t[key].get<int64_t>();
    return absl::OkStatus();
  };
  const std::string type = ModelTypeName(c->family);
  RETURN_IF_ERROR(RefuseUnknownKeys(t, kQwen3_5TextKeys, where, type));
  LinearAttentionConfig& la = c->linear;
  la = LinearAttentionConfig{};
  RETURN_IF_ERROR(integer("linear_num_key_heads", &la.num_key_heads));
  RETURN_IF_ERROR(integer("linear_num_value_heads", &la.num_value_heads));
  RETURN_IF_ERROR(integer("linear_key_head_dim", &la.key_head_dim));
  RETURN_IF_ERROR(integer("linear_value_head_dim", &la.value_head_dim));
  RETURN_IF_ERROR(integer("linear_conv_kernel_dim", &la.conv_kernel));
  // HF's q_proj always emits the output gate (Qwen3NextAttention); a config saying otherwise
  // describes a model HF itself would not load as it was trained.
  if (t.contains("attn_output_gate") && !t["attn_output_gate"].is_null() && t["attn_output_gate"] != true) {
    return Refuse(absl::StrCat(where, "attn_output_gate"),
                  absl::StrCat(t["attn_output_gate"].dump(), " is not implemented (qwen3_5's attention is gated)"));
  }
  int64_t interval = 4;
  RETURN_IF_ERROR(integer("full_attention_interval", &interval));
  c->layer_mixers.clear();
  if (t.contains("layer_types") && !t["layer_types"].is_null()) {
    if (!t["layer_types"].is_array()) return Refuse(absl::StrCat(where, "layer_types"), "must be a list");
    for (const nlohmann::json& v : t["layer_types"]) {
      if (v == "linear_attention") {
        c->layer_mixers.push_back(TokenMixer::kLinearAttention);
      } else if (v == "full_attention") {
        c->layer_mixers.push_back(TokenMixer::kAttention);
      } else {
        return Refuse(absl::StrCat(where, "layer_types"),
                      absl::StrCat(v.dump(), " is not implemented for ", type, " (linear_attention, full_attention)"));
      }
    }
    if (static_cast<int64_t>(c->layer_mixers.size()) != c->num_hidden_layers) {
      return Refuse(absl::StrCat(where, "layer_types"), absl::StrCat("has ", c->layer_mixers.size(),
                                                                     " entries for num_hidden_layers ",
                                                                     c->num_hidden_layers));
    }
  } else {
    // HF: full attention where (i + 1) % full_attention_interval == 0.
    if (interval < 1 || interval > 4096) {
      return Refuse(absl::StrCat(where, "full_attention_interval"), absl::StrCat("must be in [1, 4096], got ", interval));
    }
    for (int64_t l = 0; l < c->num_hidden_layers && l < 4096; ++l) {
      c->layer_mixers.push_back((l + 1) % interval == 0 ? TokenMixer::kAttention : TokenMixer::kLinearAttention);
    }
  }
  for (const char* key : {"use_sliding_window"}) {
    if (t.contains(key) && !t[key].is_null() && t[key] != false) {
      return Refuse(absl::StrCat(where, key), "sliding-window attention is not implemented for qwen3_5");
    }
  }
  if (t.contains("sliding_window") && !t["sliding_window"].is_null()) {
    return Refuse(absl::StrCat(where, "sliding_window"), "sliding-window attention is not implemented for qwen3_5");
  }
  if (c->family == ModelFamily::kQwen3_5) {
    for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "shared_expert_intermediate_size", "decoder_sparse_step", "norm_topk_prob",
                            "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"}) {
      if (t.contains(key) && !t[key].is_null()) {
        return Refuse(absl::StrCat(where, key), "is a mixture-of-experts field; qwen3_5 is dense (qwen3_5_moe is not)");
      }
    }
    return absl::OkStatus();
  }
  // qwen3_5_moe: Qwen3_5MoeTextConfig's defaults (35B-A3B's shapes); every layer sparse, the top-k
  // weights always renormalised (its router has no norm_topk_prob switch), one shared expert.
  nlohmann::json moe = t;
  for (const auto& [key, value] : {std::pair<const char*, nlohmann::json>{"num_experts", 256},
                                   {"num_experts_per_tok", 8},
                                   {"moe_intermediate_size", 512}}) {
    if (!moe.contains(key) || moe[key].is_null()) moe[key] = value;
  }
  if (moe.contains("norm_topk_prob") && !moe["norm_topk_prob"].is_null() && moe["norm_topk_prob"] != true) {
    return Refuse(absl::StrCat(where, "norm_topk_prob"),
                  "false is not implemented (qwen3_5_moe's router always renormalises its top-k weights)");
  }
  if (moe.contains("decoder_sparse_step") && !moe["decoder_sparse_step"].is_null() && moe["decoder_sparse_step"] != 1) {
    return Refuse(absl::StrCat(where, "decoder_sparse_step"), "must be 1 (every qwen3_5_moe layer is sparse)");
  }
  if (moe.contains("mlp_only_layers") && !moe["mlp_only_layers"].is_null() &&
      !(moe["mlp_only_layers"].is_array() && moe["mlp_only_layers"].empty())) {
    return Refuse(absl::StrCat(where, "mlp_only_layers"), "dense layers are not part of qwen3_5_moe");
  }
  nlohmann::json plain = moe;
  plain.erase("shared_expert_intermediate_size");
  plain.erase("norm_topk_prob");
  plain.erase("decoder_sparse_step");
  plain.erase("mlp_only_layers");
  RETURN_IF_ERROR(ParseMoe(plain, c));
  c->norm_topk_prob = true;
  c->shared_expert_intermediate_size = 512;
  RETURN_IF_ERROR(integer("shared_expert_intermediate_size", &c->shared_expert_intermediate_size));
  if (c->shared_expert_intermediate_size < 1) {
    return Refuse(absl::StrCat(where, "shared_expert_intermediate_size"),
                  absl::StrCat("must be >= 1 (qwen3_5_moe has a shared expert), got ", c->shared_expert_intermediate_size));
  }
  return absl::OkStatus();
}

absl::Span<const char* const> Qwen3_5WrapperKeys() { return kQwen3_5WrapperKeys; }

// qwen3_5's fields in range (the other families: at their defaults), each refused naming the field.
absl::Status CheckQwen3_5(const ModelConfig& c) {
  auto bad = [](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", field, " ", why));
  };
  if (!c.is_qwen3_5()) {
    if (!c.layer_mixers.empty()) return bad("layer_types", "linear_attention layers are qwen3_5's only");
    if (c.partial_rotary_factor != 1) return bad("partial_rotary_factor", "must be 1 for this model_type");
    if (c.shared_expert_intermediate_size != 0) return bad("shared_expert_intermediate_size", "is qwen3_5_moe's only");
    if (c.multimodal && !c.has_multimodal_layout()) {
      return bad("text_config", "the multimodal layout is qwen3_5's and gemma3's only");
    }
    return absl::OkStatus();
  }
  if (static_cast<int64_t>(c.layer_mixers.size()) != c.num_hidden_layers) {
    return bad("layer_types", absl::StrCat("has ", c.layer_mixers.size(), " entries for num_hidden_layers ",
                                           c.num_hidden_layers));
  }
  const LinearAttentionConfig& la = c.linear;
  for (auto [field, v, most] : {std::tuple<const char*, int64_t, int64_t>{"linear_num_key_heads", la.num_key_heads, 4096},
                                {"linear_num_value_heads", la.num_value_heads, 4096},
                                {"linear_key_head_dim", la.key_head_dim, 1024},
                                {"linear_value_head_dim", la.value_head_dim, 1024},
                                {"linear_conv_kernel_dim", la.conv_kernel, 8}}) {
    if (v < 1 || v > most) return bad(field, absl::StrCat("must be in [1, ", most, "], got ", v));
  }
  if (la.num_value_heads % la.num_key_heads != 0) {
    return bad("linear_num_value_heads", absl::StrCat(la.num_value_heads, " is not a multiple of linear_num_key_heads ",
                                                      la.num_key_heads));
  }
  const int64_t rot = c.rotary_dim();
  if (rot < 2 || rot % 2 != 0 || rot > c.head_dim) {
    return bad("partial_rotary_factor", absl::StrCat(c.partial_rotary_factor, " x head_dim ", c.head_dim,
                                                     " gives ", rot, " rotary dimensions (must be even, >= 2)"));
  }
  if (c.family == ModelFamily::kQwen3_5Moe && c.shared_expert_intermediate_size < 1) {
    return bad("shared_expert_intermediate_size", "must be >= 1 for qwen3_5_moe");
  }
  if (c.shared_expert_intermediate_size > (int64_t{1} << 21)) {
    return bad("shared_expert_intermediate_size", "exceeds this build's limit of 2^21");
  }
  return absl::OkStatus();
}

}  // namespace slidedp::config_internal
