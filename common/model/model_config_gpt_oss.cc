// GPT-OSS's config (gpt_oss): its fields, the keys this build knows, its RoPE, its MXFP4
// quantization_config, their ranges, and what config.json gets back (model_config.h;
// docs/model-families.md). The definition is transformers 5.17's configuration_gpt_oss.py
// (GptOssConfig: defaults, __post_init__'s layer_types and default YaRN) and modeling_gpt_oss.py
// (what each field does: GptOssExperts hard-codes its SwiGLU's alpha 1.702 and limit 7.0, whatever
// swiglu_limit says).
#include <string>

#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"
#include "common/status/status_macros.h"

namespace slidedp::config_internal {
namespace {

// The keys of a gpt_oss config this build reads or knows not to change the math: GptOssConfig's
// fields, the hub configs' extra ones (written by OpenAI's conversion, read by no transformers
// code: experts_per_token, initial_context_length, swiglu_limit; each checked against what HF does),
// and the PreTrainedConfig fields every saved config carries. Any other key is refused naming it.
constexpr const char* kGptOssKeys[] = {
    // sizes and numerics (parsed)
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "attention_bias",
    "attention_dropout",
    "sliding_window",
    "layer_types",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "router_aux_loss_coef",
    "output_router_logits",
    "swiglu_limit",
    "initial_context_length",
    "quantization_config",
    "pad_token_id",
    "dtype",
    "torch_dtype",
};

// transformers' Mxfp4Config fields (quantization_config of the released checkpoints).
constexpr const char* kMxfp4Keys[] = {"quant_method", "modules_to_not_convert", "dequantize"};

// GptOssConfig.default_theta, and GptOssExperts' clamp (modeling_gpt_oss.py: self.limit = 7.0).
constexpr double kGptOssTheta = 150000.0;
constexpr double kGptOssSwigluLimit = 7.0;

// An integer field (absent or null: unchanged).
absl::Status Integer(const nlohmann::json& t, const char* key, int64_t* out) {
  if (!t.contains(key) || t[key].is_null()) return absl::OkStatus();
  if (!t[key].is_number_integer()) return Refuse(key, absl::StrCat("must be an integer, got ", t[key].dump()));
  *out = t[key].get<int64_t>();
  return absl::OkStatus();
}

// The RoPE as GptOssConfig builds it: rope_scaling when it is a non-empty object (transformers 5's
// convert_rope_params_to_dict takes it over rope_parameters), else rope_parameters, else
// __post_init__'s default YaRN (factor 32 over 4096 positions, beta_fast 32, beta_slow 1, truncate
// false); the object's rope_theta, else the top level's, else 150000.
absl::Status ParseGptOssRope(const nlohmann::json& t, ModelConfig* c) {
  for (const char* k : {"rope_scaling", "rope_parameters"}) {
    if (t.contains(k) && !t[k].is_null() && !t[k].is_object()) return Refuse(k, "must be an object or null");
  }
  nlohmann::json rope;
  std::string label;
  if (t.contains("rope_scaling") && t["rope_scaling"].is_object() && !t["rope_scaling"].empty()) {
    rope = t["rope_scaling"];
    label = "rope_scaling";
  } else if (t.contains("rope_parameters") && t["rope_parameters"].is_object()) {
    rope = t["rope_parameters"];
    label = "rope_parameters";
  } else {
    rope = {{"rope_type", "yarn"}, {"factor", 32.0},    {"beta_fast", 32.0},
            {"beta_slow", 1.0},    {"truncate", false}, {"original_max_position_embeddings", 4096}};
    label = "rope_parameters (GptOssConfig's default)";
  }
  if (!rope.contains("rope_theta") || rope["rope_theta"].is_null()) {
    double theta = kGptOssTheta;
    if (t.contains("rope_theta") && !t["rope_theta"].is_null()) {
      if (!t["rope_theta"].is_number()) {
        return Refuse("rope_theta", absl::StrCat("must be a number, got ", t["rope_theta"].dump()));
      }
      theta = t["rope_theta"].get<double>();
    }
    rope["rope_theta"] = theta;
  }
  return ParseRope(nlohmann::json{{"rope_parameters", rope}}, c, label);
}

}  // namespace

void SetGptOssDefaults(ModelConfig* c) {
  // GptOssConfig's field defaults (transformers 5.17): the 120B's shape.
  c->hidden_size = 2880;
  c->num_hidden_layers = 36;
  c->num_attention_heads = 64;
  c->num_key_value_heads = 8;
  c->head_dim = 64;
  c->intermediate_size = 2880;
  c->vocab_size = 201088;
  c->max_position_embeddings = 131072;
  c->rms_norm_eps = 1e-5;
  c->initializer_range = 0.02;
  c->tie_word_embeddings = false;
  c->rope_theta = kGptOssTheta;
}

absl::Status ParseGptOss(const nlohmann::json& t, ModelConfig* c) {
  RETURN_IF_ERROR(RefuseUnknownKeys(t, kGptOssKeys, "", "gpt_oss"));
  // __post_init__: a null num_key_value_heads is num_attention_heads, a null head_dim
  // hidden_size // num_attention_heads (absent: the field defaults, 8 and 64).
  if (t.contains("num_key_value_heads") && t["num_key_value_heads"].is_null()) {
    c->num_key_value_heads = c->num_attention_heads;
  }
  if (t.contains("head_dim") && t["head_dim"].is_null() && c->num_attention_heads > 0) {
    c->head_dim = c->hidden_size / c->num_attention_heads;
  }
  // GptOssAttention puts attention_bias on q, k, v and o alike; this build lays out all four.
  if (t.contains("attention_bias") && !t["attention_bias"].is_null() && t["attention_bias"] != true) {
    return Refuse("attention_bias", absl::StrCat(t["attention_bias"].dump(),
                                                 " is not implemented for gpt_oss (its q/k/v/o projections "
                                                 "carry biases here, as in every released checkpoint)"));
  }
  if (t.contains("swiglu_limit") && !t["swiglu_limit"].is_null() && t["swiglu_limit"] != kGptOssSwigluLimit) {
    return Refuse("swiglu_limit",
                  absl::StrCat(t["swiglu_limit"].dump(),
                               ": transformers' GptOssExperts clamps at 7.0 whatever the config says, so this build "
                               "would train another model than HF runs"));
  }
  // The experts (every layer): GptOssConfig's names and defaults; num_experts is its attribute_map's
  // spelling of num_local_experts.
  c->num_experts = 128;
  c->num_experts_per_tok = 4;
  c->router_aux_loss_coef = 0.001;
  c->output_router_logits = false;
  RETURN_IF_ERROR(Integer(t, "num_local_experts", &c->num_experts));
  if (t.contains("num_experts") && !t["num_experts"].is_null()) {
    int64_t alias = 0;
    RETURN_IF_ERROR(Integer(t, "num_experts", &alias));
    if (t.contains("num_local_experts") && !t["num_local_experts"].is_null() && alias != c->num_experts) {
      return Refuse("num_experts", absl::StrCat(alias, " differs from num_local_experts ", c->num_experts,
                                                " (the same field in HF's GptOssConfig)"));
    }
    c->num_experts = alias;
  }
  RETURN_IF_ERROR(Integer(t, "num_experts_per_tok", &c->num_experts_per_tok));
  if (t.contains("experts_per_token") && !t["experts_per_token"].is_null()) {
    int64_t k = 0;
    RETURN_IF_ERROR(Integer(t, "experts_per_token", &k));
    if (k != c->num_experts_per_tok) {
      return Refuse("experts_per_token",
                    absl::StrCat(k, " differs from num_experts_per_tok ", c->num_experts_per_tok,
                                 " (transformers routes by num_experts_per_tok and ignores experts_per_token)"));
    }
  }
  if (t.contains("router_aux_loss_coef") && !t["router_aux_loss_coef"].is_null()) {
    if (!t["router_aux_loss_coef"].is_number()) {
      return Refuse("router_aux_loss_coef", absl::StrCat("must be a number, got ", t["router_aux_loss_coef"].dump()));
    }
    c->router_aux_loss_coef = t["router_aux_loss_coef"].get<double>();
  }
  if (t.contains("output_router_logits") && !t["output_router_logits"].is_null()) {
    if (!t["output_router_logits"].is_boolean()) return Refuse("output_router_logits", "must be a boolean");
    c->output_router_logits = t["output_router_logits"].get<bool>();
  }
  // GptOssExperts is as wide as the dense MLP field says; every layer is sparse.
  c->moe_intermediate_size = c->intermediate_size;
  c->norm_topk_prob = true;  // softmax over the top-k logits: the top-k probabilities renormalised
  c->decoder_sparse_step = 1;
  c->mlp_only_layers.clear();
  c->expert_storage = ExpertStorage::kFused;
  c->pad_token_id = -1;
  if (t.contains("pad_token_id") && !t["pad_token_id"].is_null()) {
    RETURN_IF_ERROR(Integer(t, "pad_token_id", &c->pad_token_id));
  }
  c->mxfp4_experts = false;
  if (t.contains("quantization_config") && !t["quantization_config"].is_null()) {
    const nlohmann::json& q = t["quantization_config"];
    if (!q.is_object()) return Refuse("quantization_config", "must be an object or null");
    RETURN_IF_ERROR(RefuseUnknownKeys(q, kMxfp4Keys, "quantization_config.", "gpt_oss"));
    if (!q.contains("quant_method") || q["quant_method"] != "mxfp4") {
      return Refuse("quantization_config.quant_method",
                    absl::StrCat(q.contains("quant_method") ? q["quant_method"].dump() : std::string("(absent)"),
                                 " is not implemented (mxfp4: the experts dequantized at load)"));
    }
    c->mxfp4_experts = true;
  }
  return ParseGptOssRope(t, c);
}

absl::Status CheckGptOss(const ModelConfig& c) {
  auto bad = [](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", field, " ", why));
  };
  if (!c.is_gpt_oss()) {
    if (c.mxfp4_experts) return bad("quantization_config", "(MXFP4 experts) is gpt_oss's only");
    return absl::OkStatus();
  }
  if (c.moe_intermediate_size != c.intermediate_size) {
    return bad("intermediate_size",
               absl::StrCat("is gpt_oss's expert width: moe_intermediate_size ", c.moe_intermediate_size,
                            " must equal it (", c.intermediate_size, ")"));
  }
  if (c.decoder_sparse_step != 1 || !c.mlp_only_layers.empty() || c.shared_expert_intermediate_size != 0) {
    return bad("num_local_experts", "gpt_oss has experts in every layer and no shared expert");
  }
  if (c.pad_token_id < -1 || c.pad_token_id >= c.vocab_size) {
    return bad("pad_token_id", absl::StrCat(c.pad_token_id, " is outside the vocabulary [0, ", c.vocab_size, ")"));
  }
  return absl::OkStatus();
}

void WriteGptOssFields(const ModelConfig& c, bool preset, nlohmann::ordered_json& t) {
  t["num_local_experts"] = c.num_experts;
  if (t.contains("num_experts")) t["num_experts"] = c.num_experts;
  t["num_experts_per_tok"] = c.num_experts_per_tok;
  if (t.contains("experts_per_token")) t["experts_per_token"] = c.num_experts_per_tok;
  t["router_aux_loss_coef"] = c.router_aux_loss_coef;
  t["output_router_logits"] = c.output_router_logits;
  t["attention_bias"] = true;
  // The weights this build writes are never quantized: transformers must not look for *_blocks.
  t.erase("quantization_config");
  if (preset) {
    // The released configs' tokens (o200k_harmony: <|endoftext|> pads, <|return|> ends) and clamp.
    t["pad_token_id"] = c.pad_token_id >= 0 ? nlohmann::ordered_json(c.pad_token_id) : nlohmann::ordered_json();
    t["eos_token_id"] = 200002;
    t["swiglu_limit"] = kGptOssSwigluLimit;
  }
}

}  // namespace slidedp::config_internal
