// Gemma 3's config (gemma3_text, and the gemma3 multimodal wrapper's text_config): its fields, the
// keys this build knows, its two RoPEs, their ranges, and the scales its math reads (model_config.h;
// docs/model-families.md). The definition is transformers 5.17's configuration_gemma3.py
// (Gemma3TextConfig, Gemma3Config: defaults, convert_rope_params_to_dict, the layer_types rule) and
// modeling_gemma3.py (what each field does; which ones Gemma3ForConditionalGeneration ignores).
#include <cmath>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"
#include "common/numeric/bf16.h"
#include "common/status/status_macros.h"

namespace slidedp {
namespace {

// f rounded to IEEE half (11 significant bits, nearest even): a positive normal number in half's
// range, as sqrt(hidden_size) is (hidden_size <= 2^18 gives at most 512).
float RoundToHalf(float f) {
  int exponent = 0;
  const float mantissa = std::frexp(f, &exponent);  // f = mantissa x 2^exponent, mantissa in [0.5, 1)
  return std::ldexp(std::nearbyint(std::ldexp(mantissa, 11)), exponent - 11);
}

}  // namespace

double ModelConfig::AttentionScale() const {
  // Gemma3Attention: config.query_pre_attn_scalar ** -0.5 (a Python float); the others
  // 1 / sqrt(head_dim), the expression both backends have always used.
  if (is_gemma3()) return std::pow(query_pre_attn_scalar, -0.5);
  if (is_gemma4()) return 1.0;  // Gemma4TextAttention: scaling 1.0 (its q and k are normed)
  return 1.0 / std::sqrt(static_cast<double>(head_dim));
}

namespace {

// Gemma3TextScaledWordEmbedding / Gemma4TextScaledWordEmbedding: embed_scale = torch.tensor(n ** 0.5),
// a float32 buffer, multiplied in as embed_scale.to(weight.dtype). The model's dtype is config.json's:
// bfloat16 in every released Gemma 3 and 4 (HF runs the weights in it and the scale with them).
double SqrtInDtype(int64_t n, const std::string& dtype) {
  const float scale = static_cast<float>(std::pow(static_cast<double>(n), 0.5));
  if (dtype == "bfloat16") return Bf16ToFloat(FloatToBf16(scale));
  if (dtype == "float16") return RoundToHalf(scale);
  return scale;
}

}  // namespace

double ModelConfig::EmbeddingScale() const {
  if (!is_gemma3() && !is_gemma4()) return 1.0;
  return SqrtInDtype(hidden_size, torch_dtype);
}

double ModelConfig::PerLayerEmbeddingScale() const {
  return is_gemma4() && gemma4.ple_dim > 0 ? SqrtInDtype(gemma4.ple_dim, torch_dtype) : 1.0;
}

namespace config_internal {
namespace {

// The keys of a gemma3_text config (Gemma3TextConfig's fields, the ones its __post_init__ and
// convert_rope_params_to_dict read for transformers 4's configs, and the PreTrainedConfig fields every
// saved config carries) this build reads or knows not to change the math. Any other key is refused
// naming it, as for qwen3_5.
constexpr const char* kGemma3TextKeys[] = {
    // sizes and numerics (parsed)
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_activation",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "use_bidirectional_attention",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    // transformers 4's spellings, which 5 still reads: the global and local RoPE bases, the global
    // layers' scaling, the 5:1 pattern where layer_types is absent
    "rope_theta",
    "rope_local_base_freq",
    "rope_scaling",
    "sliding_window_pattern",
    // generation and bookkeeping (no effect on the training math); cache_implementation "hybrid" is
    // transformers 4's generate() cache
    "cache_implementation",
};

// Gemma3Config's own keys (the vision tower's config is carried unchanged); image_token_id and
// the like are its attribute_map's spellings of the *_index fields.
constexpr const char* kGemma3WrapperKeys[] = {
    "model_type",
    "architectures",
    "text_config",
    "vision_config",
    "mm_tokens_per_image",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
    "boi_token_id",
    "eoi_token_id",
    "image_token_id",
    "initializer_range",
    "tie_word_embeddings",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "name_or_path",
    "tokenizer_class",
};

// Gemma3TextConfig.default_theta: the full-attention and the sliding layers' RoPE bases.
constexpr double kGlobalTheta = 1e6;
constexpr double kLocalTheta = 1e4;

// A number field of `t` (absent or null: `absent`).
absl::StatusOr<double> Number(const nlohmann::json& t, const char* key, absl::string_view where, double absent) {
  if (!t.contains(key) || t[key].is_null()) return absent;
  if (!t[key].is_number())
    return Refuse(absl::StrCat(where, key), absl::StrCat("must be a number, got ", t[key].dump()));
  return t[key].get<double>();
}

// The two RoPEs as Gemma3TextConfig.convert_rope_params_to_dict (transformers 5.17) builds them:
// rope_parameters holds one object per layer type (either absent: {"rope_type": "default"}); a
// non-null rope_scaling updates the full-attention object, key by key; each object's rope_theta,
// where it has none, is rope_theta (full) or rope_local_base_freq (sliding), else 1e6 / 1e4.
absl::Status ParseGemma3Rope(const nlohmann::json& t, absl::string_view where, ModelConfig* c) {
  const std::string params_key = absl::StrCat(where, "rope_parameters");
  nlohmann::json full = {{"rope_type", "default"}}, sliding = {{"rope_type", "default"}};
  if (t.contains("rope_parameters") && !t["rope_parameters"].is_null()) {
    const nlohmann::json& p = t["rope_parameters"];
    if (!p.is_object()) return Refuse(params_key, "must be an object");
    for (const auto& [type, value] : p.items()) {
      if ((type != "full_attention" && type != "sliding_attention") || !(value.is_object() || value.is_null())) {
        return Refuse(absl::StrCat(params_key, ".", type),
                      "gemma3's rope_parameters holds one object per layer type (full_attention, sliding_attention)");
      }
      if (value.is_object()) (type == "full_attention" ? full : sliding) = value;
    }
  }
  if (t.contains("rope_scaling") && !t["rope_scaling"].is_null()) {
    if (!t["rope_scaling"].is_object()) return Refuse(absl::StrCat(where, "rope_scaling"), "must be an object or null");
    for (const auto& [k, v] : t["rope_scaling"].items()) full[k] = v;
  }
  // transformers 5 reads rope_type and keeps the default where a legacy "type" sits beside it: an
  // object saying both, differently, is refused rather than read one way.
  for (const auto& [type, obj] :
       {std::pair<const char*, const nlohmann::json*>{"full_attention", &full}, {"sliding_attention", &sliding}}) {
    if (obj->contains("type") && obj->contains("rope_type") && (*obj)["type"] != (*obj)["rope_type"]) {
      return Refuse(absl::StrCat(params_key, ".", type, ".type"),
                    absl::StrCat((*obj)["type"].dump(), " beside rope_type ", (*obj)["rope_type"].dump(),
                                 " (transformers 5 keeps rope_type; give rope_type alone)"));
    }
  }
  if (!full.contains("rope_theta")) {
    ASSIGN_OR_RETURN(full["rope_theta"], Number(t, "rope_theta", where, kGlobalTheta));
  }
  if (!sliding.contains("rope_theta")) {
    ASSIGN_OR_RETURN(sliding["rope_theta"], Number(t, "rope_local_base_freq", where, kLocalTheta));
  }
  RETURN_IF_ERROR(
      ParseRope(nlohmann::json{{"rope_parameters", sliding}}, c, absl::StrCat(params_key, ".sliding_attention")));
  c->sliding_rope_theta = c->rope_theta;
  c->sliding_rope_scaling = c->rope_scaling;
  return ParseRope(nlohmann::json{{"rope_parameters", full}}, c, absl::StrCat(params_key, ".full_attention"));
}

}  // namespace

absl::Span<const char* const> Gemma3WrapperKeys() { return kGemma3WrapperKeys; }

void SetGemma3Defaults(ModelConfig* c) {
  c->hidden_size = 2304;
  c->intermediate_size = 9216;
  c->num_hidden_layers = 26;
  c->num_attention_heads = 8;
  c->num_key_value_heads = 4;
  c->head_dim = 256;
  c->vocab_size = 262208;
  c->max_position_embeddings = 131072;
  c->rms_norm_eps = 1e-6;
  c->initializer_range = 0.02;
  c->tie_word_embeddings = true;
}

absl::Status ParseGemma3(const nlohmann::json& t, const nlohmann::json& wrapper, absl::string_view where,
                         ModelConfig* c) {
  RETURN_IF_ERROR(RefuseUnknownKeys(t, kGemma3TextKeys, where, "gemma3_text"));
  auto name = [&](const char* key) { return absl::StrCat(where, key); };
  if (t.contains("hidden_activation") && t["hidden_activation"] != "gelu_pytorch_tanh") {
    return Refuse(name("hidden_activation"),
                  absl::StrCat(t["hidden_activation"].dump(),
                               " is not implemented for gemma3 (gelu_pytorch_tanh: GeGLU with the tanh-approximated "
                               "GELU)"));
  }
  ASSIGN_OR_RETURN(c->query_pre_attn_scalar, Number(t, "query_pre_attn_scalar", where, 256));
  ASSIGN_OR_RETURN(c->final_logit_softcapping, Number(t, "final_logit_softcapping", where, 0));
  if (c->multimodal && c->final_logit_softcapping != 0) {
    return Refuse(name("final_logit_softcapping"),
                  absl::StrCat(t["final_logit_softcapping"].dump(),
                               ": transformers' Gemma3ForConditionalGeneration does not soft-cap its logits "
                               "(Gemma3ForCausalLM does), so this build would train another model than HF runs; "
                               "set it null"));
  }
  if (t.contains("attn_logit_softcapping") && !t["attn_logit_softcapping"].is_null()) {
    return Refuse(name("attn_logit_softcapping"),
                  absl::StrCat(t["attn_logit_softcapping"].dump(),
                               ": transformers' Gemma3Attention does not apply it (its attention call passes no "
                               "softcap), so this build would train another model than HF runs; set it null"));
  }
  if (t.contains("use_bidirectional_attention") && !t["use_bidirectional_attention"].is_null() &&
      t["use_bidirectional_attention"] != false) {
    return Refuse(name("use_bidirectional_attention"),
                  absl::StrCat(t["use_bidirectional_attention"].dump(),
                               " is not implemented (this build's attention is causal)"));
  }
  c->pad_token_id = 0;  // Gemma3TextConfig's
  if (t.contains("pad_token_id")) {
    if (t["pad_token_id"].is_null()) {
      c->pad_token_id = -1;
    } else if (!t["pad_token_id"].is_number_integer()) {
      return Refuse(name("pad_token_id"), absl::StrCat("must be an integer or null, got ", t["pad_token_id"].dump()));
    } else {
      c->pad_token_id = t["pad_token_id"].get<int64_t>();
    }
  }
  // The multimodal model is loaded in Gemma3Config's dtype (the top level's; its text_config may
  // not say): the dtype its embedding scale is cast to.
  if (c->multimodal) {
    for (const char* key : {"torch_dtype", "dtype"}) {
      if (wrapper.contains(key) && wrapper[key].is_string()) c->torch_dtype = wrapper[key].get<std::string>();
    }
  }
  return ParseGemma3Rope(t, where, c);
}

absl::Status CheckGemma3(const ModelConfig& c) {
  auto bad = [](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", field, " ", why));
  };
  if (!c.is_gemma3()) {
    if (c.query_pre_attn_scalar != 0) return bad("query_pre_attn_scalar", "is gemma3's only");
    if (c.is_gemma4()) return absl::OkStatus();  // its logit cap and sliding RoPE: CheckGemma4
    if (c.final_logit_softcapping != 0) return bad("final_logit_softcapping", "is gemma3's only");
    if (c.has_sliding_rope()) return bad("rope_parameters.sliding_attention", "a RoPE of its own is gemma3's only");
    return absl::OkStatus();
  }
  if (!(c.query_pre_attn_scalar > 0) || !(c.query_pre_attn_scalar <= 1e9)) {
    return bad("query_pre_attn_scalar", absl::StrCat("must be in (0, 1e9], got ", c.query_pre_attn_scalar));
  }
  if (!(c.final_logit_softcapping >= 0) || !(c.final_logit_softcapping <= 1e9)) {
    return bad("final_logit_softcapping",
               absl::StrCat("must be in (0, 1e9] (0: none), got ", c.final_logit_softcapping));
  }
  if (c.multimodal && c.final_logit_softcapping != 0) {
    return bad("final_logit_softcapping", "is not applied by transformers' Gemma3ForConditionalGeneration");
  }
  if (!(c.sliding_rope_theta >= 1 && c.sliding_rope_theta <= 1e15)) {
    return bad("rope_parameters.sliding_attention.rope_theta",
               absl::StrCat("must be in [1, 1e15] (gemma3's sliding layers rotate with their own), got ",
                            c.sliding_rope_theta));
  }
  if (c.pad_token_id < -1 || c.pad_token_id >= c.vocab_size) {
    return bad("pad_token_id", absl::StrCat(c.pad_token_id, " is outside the vocabulary [0, ", c.vocab_size, ")"));
  }
  return absl::OkStatus();
}

}  // namespace config_internal
}  // namespace slidedp
