// ModelConfig::ToJson: the HF config.json of a config (the source's, with this config's fields
// written over it, or a preset's), and the RoPE objects it writes.
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"
#include "nlohmann/json.hpp"

namespace slidedp {

using config_internal::RopeTypeName;

namespace {

// The scaling as HF's rope_scaling object (rope_theta apart), or null for plain RoPE.
nlohmann::ordered_json RopeScalingJson(const RopeScaling& s) {
  nlohmann::ordered_json r = {{"rope_type", RopeTypeName(s.type)}, {"factor", s.factor}};
  switch (s.type) {
    case RopeScaling::Type::kNone:
      return nullptr;
    case RopeScaling::Type::kLinear:
    case RopeScaling::Type::kDynamic:
      break;
    case RopeScaling::Type::kLlama3:
      r["low_freq_factor"] = s.low_freq_factor;
      r["high_freq_factor"] = s.high_freq_factor;
      r["original_max_position_embeddings"] = s.original_max_position_embeddings;
      break;
    case RopeScaling::Type::kYarn:
      r["original_max_position_embeddings"] = s.original_max_position_embeddings;
      r["beta_fast"] = s.beta_fast;
      r["beta_slow"] = s.beta_slow;
      r["truncate"] = s.truncate;
      if (s.attention_factor != 0) r["attention_factor"] = s.attention_factor;
      if (s.mscale != 0) r["mscale"] = s.mscale;
      if (s.mscale_all_dim != 0) r["mscale_all_dim"] = s.mscale_all_dim;
      break;
  }
  return r;
}

// Writes theta and the scaling so that transformers 4 (rope_theta + rope_scaling) and 5 (which
// takes a non-null rope_scaling over rope_parameters) both read them; a rope_parameters object
// already there is rewritten to agree.
// qwen3_5 (transformers 5 only) gets rope_parameters alone, keeping its partial rotation and
// multimodal sections.
void WriteRope(const ModelConfig& c, nlohmann::ordered_json& j) {
  const nlohmann::ordered_json scaling = RopeScalingJson(c.rope_scaling);
  if (!c.is_qwen3_5()) {
    j["rope_theta"] = c.rope_theta;
    j["rope_scaling"] = scaling;
  }
  if (j.contains("rope_parameters") || c.is_qwen3_5()) {
    nlohmann::ordered_json p = scaling.is_null() ? nlohmann::ordered_json{{"rope_type", "default"}} : scaling;
    p["rope_theta"] = c.rope_theta;
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
      for (const char* k : {"partial_rotary_factor", "mrope_section", "mrope_interleaved"}) {
        if (j["rope_parameters"].contains(k)) p[k] = j["rope_parameters"][k];
      }
    }
    if (c.partial_rotary_factor != 1) p["partial_rotary_factor"] = c.partial_rotary_factor;
    j["rope_parameters"] = p;
  }
}

// gemma3's RoPEs in both spellings: transformers 5's rope_parameters, one object per layer type
// (what Gemma3TextConfig.convert_rope_params_to_dict builds), and transformers 4's rope_theta,
// rope_local_base_freq and rope_scaling (the global layers'), which 5 merges into the same objects.
void WriteGemma3Rope(const ModelConfig& c, nlohmann::ordered_json& t) {
  auto object = [](const RopeScaling& s, double theta) {
    nlohmann::ordered_json r = RopeScalingJson(s);
    if (r.is_null()) r = {{"rope_type", "default"}};
    r["rope_theta"] = theta;
    return r;
  };
  t["rope_parameters"] = {{"sliding_attention", object(c.sliding_rope_scaling, c.sliding_rope_theta)},
                          {"full_attention", object(c.rope_scaling, c.rope_theta)}};
  t["rope_theta"] = c.rope_theta;
  t["rope_local_base_freq"] = c.sliding_rope_theta;
  t["rope_scaling"] = RopeScalingJson(c.rope_scaling);
}

// gemma3's own fields, as Gemma3TextConfig spells them.
void WriteGemma3Fields(const ModelConfig& c, nlohmann::ordered_json& t) {
  t["hidden_activation"] = "gelu_pytorch_tanh";
  const double q = c.query_pre_attn_scalar;
  t["query_pre_attn_scalar"] =
      q == std::floor(q) ? nlohmann::ordered_json(static_cast<int64_t>(q)) : nlohmann::ordered_json(q);
  t["final_logit_softcapping"] =
      c.final_logit_softcapping > 0 ? nlohmann::ordered_json(c.final_logit_softcapping) : nlohmann::ordered_json();
  t["attn_logit_softcapping"] = nullptr;
  t["pad_token_id"] = c.pad_token_id >= 0 ? nlohmann::ordered_json(c.pad_token_id) : nlohmann::ordered_json();
}

// Whether two configs' layers attend alike (the same window in every layer).
bool SameAttentionSpans(const ModelConfig& a, const ModelConfig& b) {
  if (a.num_hidden_layers != b.num_hidden_layers) return false;
  for (int64_t l = 0; l < a.num_hidden_layers; ++l) {
    if (a.AttentionWindow(l) != b.AttentionWindow(l)) return false;
  }
  return true;
}

}  // namespace

std::string ModelConfig::ToJson() const {
  nlohmann::ordered_json j;
  if (!source_json.empty()) {
    j = nlohmann::ordered_json::parse(source_json, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) j = nlohmann::ordered_json::object();
  }
  const bool preset = source_json.empty();
  static constexpr const char* kArchitectures[] = {"Qwen3ForCausalLM",      "Qwen2ForCausalLM",    "LlamaForCausalLM",
                                                   "MistralForCausalLM",    "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM",
                                                   "Qwen3_5MoeForCausalLM", "Gemma3ForCausalLM",     "GptOssForCausalLM",
                                                   "Gemma4ForCausalLM"};
  // The language model's object: the file, or the multimodal wrapper's text_config.
  if (multimodal) {
    if (!j.contains("architectures")) {
      j["architectures"] = {is_gemma3()                       ? "Gemma3ForConditionalGeneration"
                            : is_gemma4()                     ? "Gemma4ForConditionalGeneration"
                            : family == ModelFamily::kQwen3_5 ? "Qwen3_5ForConditionalGeneration"
                                                              : "Qwen3_5MoeForConditionalGeneration"};
    }
    j["model_type"] = ModelTypeName(family);
    if (!j.contains("text_config") || !j["text_config"].is_object()) j["text_config"] = nlohmann::ordered_json::object();
    j["tie_word_embeddings"] = tie_word_embeddings;
    j["torch_dtype"] = torch_dtype;
    if (j.contains("dtype")) j["dtype"] = torch_dtype;
  }
  nlohmann::ordered_json& t = multimodal ? j["text_config"] : j;
  auto set_default = [&](const char* key, nlohmann::ordered_json v) {
    if (!t.contains(key)) t[key] = std::move(v);
  };
  if (!multimodal) set_default("architectures", {kArchitectures[static_cast<int>(family)]});
  t["model_type"] = has_multimodal_layout() ? absl::StrCat(ModelTypeName(family), "_text") : ModelTypeName(family);
  t["hidden_size"] = hidden_size;
  t["num_hidden_layers"] = num_hidden_layers;
  t["num_attention_heads"] = num_attention_heads;
  t["num_key_value_heads"] = num_key_value_heads;
  t["head_dim"] = head_dim;
  // Qwen3_5MoeTextConfig has no intermediate_size (transformers 5.17 refuses one): written only
  // where the source had it.
  if (family != ModelFamily::kQwen3_5Moe || t.contains("intermediate_size")) t["intermediate_size"] = intermediate_size;
  t["vocab_size"] = vocab_size;
  t["max_position_embeddings"] = max_position_embeddings;
  t["rms_norm_eps"] = rms_norm_eps;
  if (!multimodal || t.contains("tie_word_embeddings")) t["tie_word_embeddings"] = tie_word_embeddings;
  t["initializer_range"] = initializer_range;
  if (!multimodal || t.contains("torch_dtype")) t["torch_dtype"] = torch_dtype;
  if (t.contains("dtype")) t["dtype"] = torch_dtype;
  if (family == ModelFamily::kQwen3Moe) {
    // Qwen3MoeConfig's field names. num_experts, which transformers 4.x and 5.17 both read (5.17's
    // own save writes num_local_experts, which 4.x ignores); num_local_experts kept in step.
    t["num_experts"] = num_experts;
    if (t.contains("num_local_experts")) t["num_local_experts"] = num_experts;
    t["num_experts_per_tok"] = num_experts_per_tok;
    t["moe_intermediate_size"] = moe_intermediate_size;
    t["norm_topk_prob"] = norm_topk_prob;
    t["decoder_sparse_step"] = decoder_sparse_step;
    t["mlp_only_layers"] = mlp_only_layers;
    t["router_aux_loss_coef"] = router_aux_loss_coef;
    t["output_router_logits"] = output_router_logits;
  }
  if (family == ModelFamily::kQwen3_5Moe) {
    t["num_experts"] = num_experts;
    t["num_experts_per_tok"] = num_experts_per_tok;
    t["moe_intermediate_size"] = moe_intermediate_size;
    t["shared_expert_intermediate_size"] = shared_expert_intermediate_size;
    t["router_aux_loss_coef"] = router_aux_loss_coef;
    t["output_router_logits"] = output_router_logits;
  }
  if (is_qwen3_5()) {
    nlohmann::ordered_json types = nlohmann::ordered_json::array();
    for (int64_t l = 0; l < num_hidden_layers; ++l) {
      types.push_back(IsLinearAttentionLayer(l) ? "linear_attention" : "full_attention");
    }
    t["layer_types"] = types;
    t["linear_num_key_heads"] = linear.num_key_heads;
    t["linear_num_value_heads"] = linear.num_value_heads;
    t["linear_key_head_dim"] = linear.key_head_dim;
    t["linear_value_head_dim"] = linear.value_head_dim;
    t["linear_conv_kernel_dim"] = linear.conv_kernel;
  }
  if (is_gemma3()) WriteGemma3Fields(*this, t);
  if (is_gpt_oss()) config_internal::WriteGptOssFields(*this, preset, t);
  if (is_gemma4()) config_internal::WriteGemma4Fields(*this, t);
  if (!preset) {
    // The source's own RoPE objects and sliding-window fields, unless this config's were changed
    // after parsing (a longer context, another depth): then the new ones, or HF would load the old.
    const absl::StatusOr<ModelConfig> parsed = FromJson(source_json);
    if (!parsed.ok() || parsed->rope_theta != rope_theta || !(parsed->rope_scaling == rope_scaling) ||
        parsed->sliding_rope_theta != sliding_rope_theta || !(parsed->sliding_rope_scaling == sliding_rope_scaling) ||
        !(parsed->gemma4.full_rope == gemma4.full_rope) || !(parsed->gemma4.sliding_rope == gemma4.sliding_rope)) {
      if (is_gemma3()) {
        WriteGemma3Rope(*this, t);
      } else if (is_gemma4()) {
        config_internal::WriteGemma4Rope(*this, t);
      } else {
        WriteRope(*this, t);
      }
    }
    if (!parsed.ok() || !SameAttentionSpans(*parsed, *this)) config_internal::WriteAttentionSpans(*this, t);
  }
  if (preset) {
    // gemma3, gemma4: hidden_activation (their Write*Fields).
    if (!is_gemma3() && !is_gemma4()) t["hidden_act"] = "silu";
    t["attention_dropout"] = 0.0;
    if (is_gemma3()) {
      WriteGemma3Rope(*this, t);
    } else if (is_gemma4()) {
      config_internal::WriteGemma4Rope(*this, t);
    } else if (is_qwen3_5()) {
      // transformers 5's form: one rope_parameters object (the multimodal sections as the hub's
      // configs give them; text reads them as plain RoPE).
      nlohmann::ordered_json r = RopeScalingJson(rope_scaling);
      if (r.is_null()) r = {{"rope_type", "default"}};
      r["rope_theta"] = rope_theta;
      r["partial_rotary_factor"] = partial_rotary_factor;
      r["mrope_section"] = {11, 11, 10};
      r["mrope_interleaved"] = true;
      t["rope_parameters"] = r;
    } else {
      WriteRope(*this, t);
    }
    t["use_cache"] = true;
    config_internal::WriteAttentionSpans(*this, t);
    switch (family) {
      case ModelFamily::kQwen3:
        t["attention_bias"] = false;
        t["bos_token_id"] = 151643;
        t["eos_token_id"] = 151645;
        break;
      case ModelFamily::kQwen2:
        t["bos_token_id"] = 151643;
        t["eos_token_id"] = 151645;
        break;
      case ModelFamily::kLlama:
        t["attention_bias"] = false;
        t["mlp_bias"] = false;
        t["bos_token_id"] = 128000;
        t["eos_token_id"] = 128001;
        break;
      case ModelFamily::kMistral:
        t["bos_token_id"] = 1;
        t["eos_token_id"] = 2;
        break;
      case ModelFamily::kQwen3Moe:
        t["attention_bias"] = false;
        t["bos_token_id"] = 151643;
        t["eos_token_id"] = 151645;
        break;
      case ModelFamily::kQwen3_5:
      case ModelFamily::kQwen3_5Moe:
        t["attention_bias"] = false;
        t["eos_token_id"] = 248044;  // <|endoftext|> of the 248,320-token vocabulary
        break;
      case ModelFamily::kGemma3:  // the released configs': <bos> 2, <eos> 1 and <end_of_turn> 106
        t["attention_bias"] = false;
        t["bos_token_id"] = 2;
        t["eos_token_id"] = {1, 106};
        break;
      case ModelFamily::kGptOss: break;  // WriteGptOssFields
      case ModelFamily::kGemma4:  // the released text configs': <bos> 2, <eos> 1
        t["attention_bias"] = false;
        t["bos_token_id"] = 2;
        t["eos_token_id"] = 1;
        break;
    }
  }
  return j.dump(2) + "\n";
}

}  // namespace slidedp
