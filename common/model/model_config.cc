// Model config parsing and serialization (the five families); the presets are model_presets.cc,
// the streamed-unit layout model_layout.cc, sliding windows model_config_window.cc.
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"
#include "common/io/json_depth.h"

#include "common/io/small_file.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "common/status/status_macros.h"
#include "nlohmann/json.hpp"

namespace slidedp {
namespace config_internal {

absl::Status Refuse(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", field, ": ", why));
}

const char* RopeTypeName(RopeScaling::Type type) {
  switch (type) {
    case RopeScaling::Type::kNone:
      return "default";
    case RopeScaling::Type::kLinear:
      return "linear";
    case RopeScaling::Type::kDynamic:
      return "dynamic";
    case RopeScaling::Type::kLlama3:
      return "llama3";
    case RopeScaling::Type::kYarn:
      return "yarn";
  }
  return "?";
}

}  // namespace config_internal

namespace {

using config_internal::ParseRope;
using config_internal::Refuse;
using config_internal::RopeTypeName;

// The scaling's parameters in range, each refused naming `key`.<field> (key: the JSON object they
// came from, or "rope_scaling" for a config built in code).
absl::Status CheckRopeScaling(const ModelConfig& c, absl::string_view key) {
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScaling::Type::kNone) return absl::OkStatus();
  auto bad = [&](absl::string_view field, absl::string_view why, double got) {
    return Refuse(absl::StrCat(key, ".", field),
                  absl::StrCat(why, " for ", RopeTypeName(s.type), " scaling, got ", got));
  };
  if (!(s.factor >= 1) || !(s.factor <= 1e6)) return bad("factor", "must be a number in [1, 1e6]", s.factor);
  if (s.type == RopeScaling::Type::kDynamic && c.head_dim <= 2) {
    return bad("rope_type", "needs head_dim > 2 (the exponent d / (d - 2))", static_cast<double>(c.head_dim));
  }
  if (s.type != RopeScaling::Type::kLlama3 && s.type != RopeScaling::Type::kYarn) return absl::OkStatus();
  if (s.original_max_position_embeddings < 1 || s.original_max_position_embeddings > 1000000000) {
    return bad("original_max_position_embeddings", "must be an integer in [1, 1e9]",
               static_cast<double>(s.original_max_position_embeddings));
  }
  if (s.type == RopeScaling::Type::kLlama3) {
    if (!(s.low_freq_factor > 0)) return bad("low_freq_factor", "must be > 0", s.low_freq_factor);
    if (!(s.high_freq_factor > s.low_freq_factor) || !std::isfinite(s.high_freq_factor)) {
      return bad("high_freq_factor", absl::StrCat("must be finite and > low_freq_factor ", s.low_freq_factor),
                 s.high_freq_factor);
    }
    return absl::OkStatus();
  }
  if (!(s.beta_fast > 0) || !std::isfinite(s.beta_fast)) {
    return bad("beta_fast", "must be a finite number > 0", s.beta_fast);
  }
  if (!(s.beta_slow > 0) || !(s.beta_slow <= s.beta_fast)) {
    return bad("beta_slow", absl::StrCat("must be > 0 and <= beta_fast ", s.beta_fast), s.beta_slow);
  }
  if (!(s.attention_factor >= 0) || !std::isfinite(s.attention_factor)) {
    return bad("attention_factor", "must be a finite number > 0", s.attention_factor);
  }
  for (auto [field, v] : {std::pair<const char*, double>{"mscale", s.mscale}, {"mscale_all_dim", s.mscale_all_dim}}) {
    if (!std::isfinite(v)) return bad(field, "must be finite", v);
  }
  const double scaling = c.RopeAttentionScaling();
  if (!(scaling > 0) || !std::isfinite(scaling)) {
    return bad(s.mscale != 0 ? "mscale" : "attention_factor", "gives an attention factor that is not finite and > 0",
               scaling);
  }
  return absl::OkStatus();
}

// The MoE fields in range (qwen3_moe), or at their dense defaults (the other families), each
// refused naming the field.
absl::Status CheckMoe(const ModelConfig& c) {
  auto bad = [](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", field, " ", why));
  };
  if (!c.is_moe()) {
    if (c.num_experts != 0) {
      return bad("num_experts", absl::StrCat("must be 0 for model_type ", ModelTypeName(c.family),
                                             " (mixture-of-experts layers are qwen3_moe's), got ", c.num_experts));
    }
    return absl::OkStatus();
  }
  if (c.num_experts < 1) return bad("num_experts", absl::StrCat("must be >= 1, got ", c.num_experts));
  if (c.num_experts > (int64_t{1} << 20)) return bad("num_experts", absl::StrCat("too large, got ", c.num_experts));
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.num_experts) {
    return bad("num_experts_per_tok",
               absl::StrCat("must be in [1, num_experts ", c.num_experts, "], got ", c.num_experts_per_tok));
  }
  if (c.moe_intermediate_size <= 0) {
    return bad("moe_intermediate_size", absl::StrCat("must be > 0, got ", c.moe_intermediate_size));
  }
  if (c.decoder_sparse_step < 1) {
    return bad("decoder_sparse_step", absl::StrCat("must be >= 1, got ", c.decoder_sparse_step));
  }
  std::vector<int64_t> seen;
  for (int64_t l : c.mlp_only_layers) {
    if (l < 0 || l >= c.num_hidden_layers) {
      return bad("mlp_only_layers",
                 absl::StrCat("holds layer ", l, ", outside [0, num_hidden_layers ", c.num_hidden_layers, ")"));
    }
    if (std::find(seen.begin(), seen.end(), l) != seen.end()) {
      return bad("mlp_only_layers", absl::StrCat("holds layer ", l, " twice"));
    }
    seen.push_back(l);
  }
  if (!(c.router_aux_loss_coef >= 0) || !std::isfinite(c.router_aux_loss_coef)) {
    return bad("router_aux_loss_coef", absl::StrCat("must be a finite number >= 0, got ", c.router_aux_loss_coef));
  }
  return absl::OkStatus();
}


}  // namespace

absl::Status ModelConfig::Validate() const {
  auto positive = [](const char* name, int64_t v) -> absl::Status {
    if (v <= 0) return absl::InvalidArgumentError(absl::StrCat("config: ", name, " must be > 0, got ", v));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(positive("hidden_size", hidden_size));
  RETURN_IF_ERROR(positive("num_hidden_layers", num_hidden_layers));
  RETURN_IF_ERROR(positive("num_attention_heads", num_attention_heads));
  RETURN_IF_ERROR(positive("num_key_value_heads", num_key_value_heads));
  RETURN_IF_ERROR(positive("head_dim", head_dim));
  RETURN_IF_ERROR(positive("intermediate_size", intermediate_size));
  RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  RETURN_IF_ERROR(positive("max_position_embeddings", max_position_embeddings));
  if (num_attention_heads % num_key_value_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config: num_attention_heads ", num_attention_heads,
                                                   " is not a multiple of num_key_value_heads ",
                                                   num_key_value_heads));
  }
  if (head_dim % 2 != 0) return absl::InvalidArgumentError("config: head_dim must be even for RoPE");
  // (A base below 1 or past 1e15 belongs to no model and makes RoPE's frequencies overflow.)
  if (!(rope_theta >= 1 && rope_theta <= 1e15)) {
    return absl::InvalidArgumentError(absl::StrCat("config: rope_theta must be in [1, 1e15], got ", rope_theta));
  }
  if (!(rms_norm_eps > 0)) return absl::InvalidArgumentError("config: rms_norm_eps must be > 0");
  if (vocab_size > (int64_t{1} << 31)) return absl::InvalidArgumentError("config: vocab_size too large");
  // Upper bounds far above any model this tool trains (the largest dims of today's 70B-400B
  // models are a few tens of thousands), so that a hostile config.json cannot make the layout's
  // sizes overflow or its tables grow without end before admission weighs the model.
  auto at_most = [](const char* name, int64_t v, int64_t most) -> absl::Status {
    if (v > most) {
      return absl::InvalidArgumentError(absl::StrCat("config: ", name, " ", v, " exceeds this build's limit of ", most));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(at_most("hidden_size", hidden_size, int64_t{1} << 18));
  RETURN_IF_ERROR(at_most("num_hidden_layers", num_hidden_layers, 4096));
  RETURN_IF_ERROR(at_most("num_attention_heads", num_attention_heads, 4096));
  RETURN_IF_ERROR(at_most("head_dim", head_dim, 4096));
  RETURN_IF_ERROR(at_most("intermediate_size", intermediate_size, int64_t{1} << 21));
  RETURN_IF_ERROR(at_most("max_position_embeddings", max_position_embeddings, int64_t{1} << 32));
  if (is_moe()) {
    RETURN_IF_ERROR(at_most("moe_intermediate_size", moe_intermediate_size, int64_t{1} << 21));
    // One layout entry per expert and layer.
    if (num_experts > 0 && num_hidden_layers * num_experts > (int64_t{1} << 20)) {
      return absl::InvalidArgumentError(absl::StrCat("config: num_hidden_layers ", num_hidden_layers, " x num_experts ",
                                                     num_experts, " exceeds this build's limit of 2^20 experts"));
    }
  }
  // The parameter count in floating point (no overflow): at most 10 trillion.
  const double attn = static_cast<double>(hidden_size) * head_dim * (2.0 * num_attention_heads + 2.0 * num_key_value_heads);
  const double mlp = 3.0 * hidden_size * intermediate_size +
                     (is_moe() ? 3.0 * hidden_size * moe_intermediate_size * static_cast<double>(num_experts) : 0.0);
  const double params = static_cast<double>(vocab_size) * hidden_size * 2.0 + num_hidden_layers * (attn + mlp);
  if (params > 1e13) {
    return absl::InvalidArgumentError(
        absl::StrFormat("config: a model of about %.3g parameters exceeds this build's limit of 1e13", params));
  }
  RETURN_IF_ERROR(CheckMoe(*this));
  RETURN_IF_ERROR(config_internal::CheckQwen3_5(*this));
  RETURN_IF_ERROR(config_internal::CheckGemma3(*this));
  RETURN_IF_ERROR(config_internal::CheckGptOss(*this));
  RETURN_IF_ERROR(config_internal::CheckGemma4(*this));
  RETURN_IF_ERROR(config_internal::CheckAttentionSpans(*this));
  if (has_sliding_rope()) {  // gemma3's sliding layers' RoPE, checked as the global one is
    ModelConfig sliding;
    sliding.head_dim = head_dim;
    sliding.max_position_embeddings = max_position_embeddings;
    sliding.rope_theta = sliding_rope_theta;
    sliding.rope_scaling = sliding_rope_scaling;
    RETURN_IF_ERROR(CheckRopeScaling(sliding, "rope_parameters.sliding_attention"));
  }
  return CheckRopeScaling(*this, "rope_scaling");
}

int64_t ModelConfig::NumLinearAttentionLayers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += IsLinearAttentionLayer(l) ? 1 : 0;
  return n;
}

int64_t ModelConfig::NumSlidingLayers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += IsSlidingLayer(l) ? 1 : 0;
  return n;
}

bool ModelConfig::IsSparseLayer(int64_t layer) const {
  if (!is_moe() || num_experts <= 0 || decoder_sparse_step <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::NumSparseLayers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_hidden_layers; ++l) n += IsSparseLayer(l) ? 1 : 0;
  return n;
}

absl::Status ModelConfig::CheckTrainable() const {
  // Every family this build describes trains (qwen3_moe: the CPU backend; hostd's job plan says
  // which backends run MoE layers).
  return absl::OkStatus();
}

namespace {

constexpr ModelFamily kFamilies[] = {ModelFamily::kQwen3,      ModelFamily::kQwen2,    ModelFamily::kLlama,
                                     ModelFamily::kMistral,    ModelFamily::kQwen3Moe, ModelFamily::kQwen3_5,
                                     ModelFamily::kQwen3_5Moe, ModelFamily::kGemma3, ModelFamily::kGptOss,
                                     ModelFamily::kGemma4};

}  // namespace

// rope_parameters (transformers 5) or rope_scaling (older): the rope type, theta, and the
// scaling's parameters, read as HF's RotaryEmbeddingConfigMixin reads them (convert_rope_params_to_dict,
// standardize_rope_params): rope_scaling when it is a non-empty object, else rope_parameters;
// rope_type, else type, else "default"; theta from the object, else the top level. Types this build
// does not compute, and parameters out of range, are refused naming the key (or `label`).
absl::Status config_internal::ParseRope(const nlohmann::json& j, ModelConfig* c, absl::string_view label) {
  for (const char* k : {"rope_scaling", "rope_parameters"}) {
    if (j.contains(k) && !j[k].is_null() && !j[k].is_object()) return Refuse(k, "must be an object or null");
  }
  const char* key = j.contains("rope_scaling") && j["rope_scaling"].is_object() && !j["rope_scaling"].empty()
                        ? "rope_scaling"
                    : j.contains("rope_parameters") && j["rope_parameters"].is_object() ? "rope_parameters"
                                                                                        : nullptr;
  const std::string shown = !label.empty() ? std::string(label) : key != nullptr ? key : "";
  auto field = [&](absl::string_view name) { return absl::StrCat(shown, ".", name); };
  // partial_rotary_factor rotates only the first part of each head: qwen3_5's (HF reads the
  // object's, else the top level's); refused for the families whose HF code rotates whole heads.
  c->partial_rotary_factor = 1;
  for (const nlohmann::json* o : {&j, key != nullptr ? &j[key] : &j}) {
    if (!o->contains("partial_rotary_factor") || (*o)["partial_rotary_factor"].is_null()) continue;
    const nlohmann::json& f = (*o)["partial_rotary_factor"];
    const std::string name = o == &j ? std::string("partial_rotary_factor") : field("partial_rotary_factor");
    if (!c->is_qwen3_5()) {
      if (f != 1.0) return Refuse(name, absl::StrCat(f.dump(), " is not supported (RoPE over the whole head)"));
      continue;
    }
    if (!f.is_number() || !(f.get<double>() > 0 && f.get<double>() <= 1)) {
      return Refuse(name, absl::StrCat("must be a number in (0, 1], got ", f.dump()));
    }
    c->partial_rotary_factor = f.get<double>();
  }
  if (key == nullptr) return absl::OkStatus();
  const nlohmann::json& r = j[key];
  // Multimodal RoPE (qwen3_5): sections of the rotary half that take the temporal, height and width
  // positions. Text has one position for all three, so any split is plain RoPE (HF's interleaving
  // picks among three equal angle tables); only its form is checked.
  if (r.contains("mrope_section") && !r["mrope_section"].is_null()) {
    if (!c->is_qwen3_5()) return Refuse(field("mrope_section"), "multimodal RoPE is qwen3_5's only");
    if (!r["mrope_section"].is_array()) return Refuse(field("mrope_section"), "must be a list of integers");
    for (const nlohmann::json& v : r["mrope_section"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 4096) {
        return Refuse(field("mrope_section"), absl::StrCat("must hold integers in [0, 4096], got ", v.dump()));
      }
    }
  }
  if (r.contains("mrope_interleaved") && !r["mrope_interleaved"].is_null() && !r["mrope_interleaved"].is_boolean()) {
    return Refuse(field("mrope_interleaved"), "must be a boolean");
  }
  for (const auto& [name, value] : r.items()) {
    if (value.is_object()) {
      return Refuse(field(name), "RoPE parameters per layer type are not supported (one set for every layer)");
    }
  }
  const std::string type = r.contains("rope_type") && r["rope_type"].is_string() ? r["rope_type"].get<std::string>()
                           : r.contains("type") && r["type"].is_string()         ? r["type"].get<std::string>()
                                                                                 : "default";
  // number: required unless `fallback` is given (used when the key is absent or null).
  auto number = [&](const char* name, double* out, std::optional<double> fallback = std::nullopt) -> absl::Status {
    if (!r.contains(name) || r[name].is_null()) {
      if (!fallback.has_value()) return Refuse(field(name), "missing");
      *out = *fallback;
      return absl::OkStatus();
    }
    if (!r[name].is_number()) return Refuse(field(name), absl::StrCat("must be a number, got ", r[name].dump()));
    *out = r[name].get<double>();
    return absl::OkStatus();
  };
  if (r.contains("rope_theta")) RETURN_IF_ERROR(number("rope_theta", &c->rope_theta));
  RopeScaling& s = c->rope_scaling;
  s = RopeScaling{};
  if (type == "default") return absl::OkStatus();
  if (type == "linear") {
    s.type = RopeScaling::Type::kLinear;
  } else if (type == "dynamic") {
    s.type = RopeScaling::Type::kDynamic;
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::kLlama3;
  } else if (type == "yarn") {
    s.type = RopeScaling::Type::kYarn;
  } else {
    return Refuse(field("rope_type"),
                  absl::StrCat("\"", type, "\" is not supported (supported: default, linear, dynamic, llama3, yarn)"));
  }
  const bool yarn = s.type == RopeScaling::Type::kYarn;
  // HF's yarn computes the factor (the ratio of the context lengths) only where it is null; an
  // explicit factor is checked as given, so a 0 is refused (CheckRopeScaling), never replaced.
  const bool computed_factor = yarn && r.contains("factor") && r["factor"].is_null();
  if (computed_factor) {
    s.factor = 0;  // set below, once the original context length is known
  } else {
    RETURN_IF_ERROR(number("factor", &s.factor));
    if (!(s.factor >= 1) || !(s.factor <= 1e6)) {
      return Refuse(field("factor"), absl::StrCat("must be a number in [1, 1e6], got ", r.contains("factor")
                                                                                        ? r["factor"].dump()
                                                                                        : absl::StrCat(s.factor)));
    }
  }
  if (s.type == RopeScaling::Type::kLlama3) {
    RETURN_IF_ERROR(number("low_freq_factor", &s.low_freq_factor));
    RETURN_IF_ERROR(number("high_freq_factor", &s.high_freq_factor));
  }
  if (s.type == RopeScaling::Type::kLlama3 || yarn) {
    // HF (standardize_rope_params): the object's value, else max_position_embeddings; a top-level
    // original_max_position_embeddings takes over for some model classes only, so one that
    // disagrees with the object's is refused rather than guessed.
    double original = 0;
    RETURN_IF_ERROR(number("original_max_position_embeddings", &original,
                           static_cast<double>(c->max_position_embeddings)));
    if (!(original >= 1 && original <= 1e9) || original != std::floor(original)) {
      return Refuse(field("original_max_position_embeddings"),
                    absl::StrCat("must be an integer in [1, 1e9], got ", original,
                                 r.contains("original_max_position_embeddings") ? "" : " (max_position_embeddings)"));
    }
    if (j.contains("original_max_position_embeddings") && !j["original_max_position_embeddings"].is_null() &&
        (!r.contains("original_max_position_embeddings") ||
         j["original_max_position_embeddings"] != r["original_max_position_embeddings"])) {
      return Refuse(
          "original_max_position_embeddings",
          absl::StrCat(j["original_max_position_embeddings"].dump(), " at the top level differs from ",
                       field("original_max_position_embeddings"), " ",
                       r.contains("original_max_position_embeddings") ? r["original_max_position_embeddings"].dump()
                                                                      : std::string("(absent)"),
                       "; give it in ", shown, " only"));
    }
    s.original_max_position_embeddings = static_cast<int64_t>(original);
  }
  if (yarn) {
    if (computed_factor) {
      s.factor =
          static_cast<double>(c->max_position_embeddings) / static_cast<double>(s.original_max_position_embeddings);
    }
    // HF: `beta_fast or 32`, `beta_slow or 1` (0 is the default too); `attention_factor is None`;
    // `mscale and mscale_all_dim` (0 is not given).
    RETURN_IF_ERROR(number("beta_fast", &s.beta_fast, 32.0));
    RETURN_IF_ERROR(number("beta_slow", &s.beta_slow, 1.0));
    if (s.beta_fast == 0) s.beta_fast = 32;
    if (s.beta_slow == 0) s.beta_slow = 1;
    RETURN_IF_ERROR(number("mscale", &s.mscale, 0.0));
    RETURN_IF_ERROR(number("mscale_all_dim", &s.mscale_all_dim, 0.0));
    RETURN_IF_ERROR(number("attention_factor", &s.attention_factor, 0.0));
    if (r.contains("attention_factor") && !r["attention_factor"].is_null() && !(s.attention_factor > 0)) {
      return Refuse(field("attention_factor"), absl::StrCat("must be > 0, got ", r["attention_factor"].dump()));
    }
    if (r.contains("truncate") && !r["truncate"].is_null()) {
      if (!r["truncate"].is_boolean()) {
        return Refuse(field("truncate"), absl::StrCat("must be a boolean, got ", r["truncate"].dump()));
      }
      s.truncate = r["truncate"].get<bool>();
    }
  }
  return CheckRopeScaling(*c, shown);
}

namespace {

// MoE model types this build does not compute, and what is missing for each.
struct UnbuiltMoe {
  const char* model_type;
  const char* why;
};
constexpr UnbuiltMoe kUnbuiltMoe[] = {
    {"qwen2_moe", "its shared expert (shared_expert_intermediate_size) is not built"},
    {"mixtral", "mixtral's experts (num_local_experts, block_sparse_moe) are not built"},
    {"qwen3_next", "its shared expert and linear attention are not built"},
};

// qwen3_moe's MoE fields with Qwen3MoeConfig's defaults (transformers 5.17,
// configuration_qwen3_moe.py) where a key is absent or null, and the keys of other MoE designs
// refused by name.
}  // namespace

absl::Status config_internal::ParseMoe(const nlohmann::json& j, ModelConfig* c) {
  auto integer = [&](const char* key, int64_t* out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_number_integer()) return Refuse(key, absl::StrCat("must be an integer, got ", j[key].dump()));
    *out = j[key].get<int64_t>();
    return absl::OkStatus();
  };
  auto boolean = [&](const char* key, bool* out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_boolean()) return Refuse(key, absl::StrCat("must be a boolean, got ", j[key].dump()));
    *out = j[key].get<bool>();
    return absl::OkStatus();
  };
  c->num_experts = 128;
  c->num_experts_per_tok = 8;
  c->moe_intermediate_size = 768;
  c->norm_topk_prob = false;
  c->decoder_sparse_step = 1;
  c->mlp_only_layers.clear();
  c->router_aux_loss_coef = 0.001;
  c->output_router_logits = false;
  RETURN_IF_ERROR(integer("num_experts", &c->num_experts));
  // Qwen3MoeConfig.attribute_map = {"num_experts": "num_local_experts"} in transformers 5.17: its
  // save_pretrained writes num_local_experts, and either key loads. Both, disagreeing, is refused
  // rather than guessed (5.17 takes num_local_experts, 4.x num_experts).
  if (j.contains("num_local_experts") && !j["num_local_experts"].is_null()) {
    int64_t local = 0;
    RETURN_IF_ERROR(integer("num_local_experts", &local));
    if (j.contains("num_experts") && !j["num_experts"].is_null() && local != c->num_experts) {
      return Refuse("num_local_experts", absl::StrCat(local, " differs from num_experts ", c->num_experts,
                                                      " (the same field in HF's Qwen3MoeConfig)"));
    }
    c->num_experts = local;
  }
  RETURN_IF_ERROR(integer("num_experts_per_tok", &c->num_experts_per_tok));
  RETURN_IF_ERROR(integer("moe_intermediate_size", &c->moe_intermediate_size));
  RETURN_IF_ERROR(integer("decoder_sparse_step", &c->decoder_sparse_step));
  RETURN_IF_ERROR(boolean("norm_topk_prob", &c->norm_topk_prob));
  RETURN_IF_ERROR(boolean("output_router_logits", &c->output_router_logits));
  if (j.contains("router_aux_loss_coef") && !j["router_aux_loss_coef"].is_null()) {
    if (!j["router_aux_loss_coef"].is_number()) {
      return Refuse("router_aux_loss_coef", absl::StrCat("must be a number, got ", j["router_aux_loss_coef"].dump()));
    }
    c->router_aux_loss_coef = j["router_aux_loss_coef"].get<double>();
  }
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    if (!j["mlp_only_layers"].is_array()) {
      return Refuse("mlp_only_layers",
                    absl::StrCat("must be a list of layer indices, got ", j["mlp_only_layers"].dump()));
    }
    for (const nlohmann::json& l : j["mlp_only_layers"]) {
      if (!l.is_number_integer()) {
        return Refuse("mlp_only_layers", absl::StrCat("must hold integers, got ", l.dump()));
      }
      c->mlp_only_layers.push_back(l.get<int64_t>());
    }
  }
  // Other MoE designs' keys, which HF's qwen3_moe would ignore: a config carrying one is another
  // architecture under this model_type. Null, and the value meaning "none", pass.
  struct Foreign {
    const char* key;
    nlohmann::json none;
    const char* what;
  };
  const Foreign foreign[] = {
      {"shared_expert_intermediate_size", 0, "shared experts (qwen2_moe's) are not built"},
      {"n_shared_experts", 0, "shared experts are not built"},
      {"num_shared_experts", 0, "shared experts are not built"},
      {"first_k_dense_replace", 0, "dense-first layer placement is not built (qwen3_moe: mlp_only_layers)"},
      {"moe_layer_freq", 1, "another sparse-layer rule is not built (qwen3_moe: decoder_sparse_step)"},
      {"n_routed_experts", nullptr, "is another model's expert count (qwen3_moe: num_experts)"},
      {"routed_scaling_factor", 1.0, "scaled routing weights are not built"},
      {"scoring_func", "softmax", "routers other than softmax are not built"},
      {"topk_method", "greedy", "routers other than softmax top-k are not built"},
  };
  for (const Foreign& f : foreign) {
    if (!j.contains(f.key) || j[f.key].is_null() || j[f.key] == f.none) continue;
    return Refuse(f.key, absl::StrCat(j[f.key].dump(), ": ", f.what));
  }
  return absl::OkStatus();
}


const char* ModelTypeName(ModelFamily family) {
  switch (family) {
    case ModelFamily::kQwen3:
      return "qwen3";
    case ModelFamily::kQwen2:
      return "qwen2";
    case ModelFamily::kLlama:
      return "llama";
    case ModelFamily::kMistral:
      return "mistral";
    case ModelFamily::kQwen3Moe:
      return "qwen3_moe";
    case ModelFamily::kQwen3_5:
      return "qwen3_5";
    case ModelFamily::kQwen3_5Moe:
      return "qwen3_5_moe";
    case ModelFamily::kGemma3: return "gemma3";
    case ModelFamily::kGptOss: return "gpt_oss";
    case ModelFamily::kGemma4: return "gemma4";
  }
  return "?";
}

absl::StatusOr<ModelConfig> ModelConfig::FromJson(absl::string_view json_text) {
  RETURN_IF_ERROR(CheckJsonDepth(json_text, "config.json"));
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  ModelConfig c;
  // The language model's config: the file itself, or the multimodal wrapper's text_config
  // (qwen3_5, qwen3_5_moe), whose fields are then named text_config.<field> in messages.
  const nlohmann::json* text = &j;
  std::string where;
  if (j.contains("model_type")) {
    bool known = false;
    for (ModelFamily f : kFamilies) {
      if (j["model_type"] == ModelTypeName(f)) {
        c.family = f;
        known = true;
      } else if (j["model_type"] == absl::StrCat(ModelTypeName(f), "_text") &&
                 (f == ModelFamily::kQwen3_5 || f == ModelFamily::kQwen3_5Moe || f == ModelFamily::kGemma3 ||
                  f == ModelFamily::kGemma4)) {
        c.family = f;  // Qwen3_5ForCausalLM's, Gemma3ForCausalLM's text-only config
        known = true;
      }
    }
    if (!known) {
      std::string why;
      for (const UnbuiltMoe& m : kUnbuiltMoe) {
        if (j["model_type"] == m.model_type) why = absl::StrCat(": ", m.why);
      }
      return Refuse("model_type",
                    absl::StrCat(j["model_type"].dump(), " is not supported", why,
                                 " (supported: \"qwen3\", \"qwen2\", \"llama\", \"mistral\", \"qwen3_moe\", "
                                 "\"qwen3_5\", \"qwen3_5_text\", \"qwen3_5_moe\", \"qwen3_5_moe_text\", \"gemma3\", "
                                 "\"gemma3_text\", \"gpt_oss\", \"gemma4\", \"gemma4_text\")"));
    }
    if (c.has_multimodal_layout() && j["model_type"] == ModelTypeName(c.family)) {
      c.multimodal = true;
      const std::string type = ModelTypeName(c.family);
      if (!j.contains("text_config") || !j["text_config"].is_object()) {
        return Refuse("text_config", absl::StrCat("missing: a ", type, " config.json holds the language model's "
                                                  "config there (or is a ", type, "_text config)"));
      }
      RETURN_IF_ERROR(config_internal::RefuseUnknownKeys(
          j,
          c.is_gemma3()   ? config_internal::Gemma3WrapperKeys()
          : c.is_gemma4() ? config_internal::Gemma4WrapperKeys()
                          : config_internal::Qwen3_5WrapperKeys(),
          "", type));
      if (j.contains("vision_config") && !j["vision_config"].is_null() && !j["vision_config"].is_object()) {
        return Refuse("vision_config", "must be an object");
      }
      text = &j["text_config"];
      where = "text_config.";
      if (text->contains("model_type") && (*text)["model_type"] != absl::StrCat(type, "_text")) {
        return Refuse("text_config.model_type",
                      absl::StrCat((*text)["model_type"].dump(), " under model_type \"", type, "\" (expected \"", type,
                                   "_text\")"));
      }
    }
  }
  const nlohmann::json& t = *text;
  auto get_int = [&](const char* key, int64_t* out, bool required) -> absl::Status {
    if (!t.contains(key) || t[key].is_null()) {
      if (required) return absl::InvalidArgumentError(absl::StrCat("config.json: missing \"", key, "\""));
      return absl::OkStatus();
    }
    if (!t[key].is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: \"", key, "\" must be an integer, got ", t[key].dump()));
    }
    *out = t[key].get<int64_t>();
    return absl::OkStatus();
  };
  auto get_double = [&](const char* key, double* out) -> absl::Status {
    if (!t.contains(key) || t[key].is_null()) return absl::OkStatus();
    if (!t[key].is_number()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: \"", key, "\" must be a number, got ", t[key].dump()));
    }
    *out = t[key].get<double>();
    return absl::OkStatus();
  };
  auto flag = [&](const char* key) { return t.contains(key) && t[key].is_boolean() && t[key].get<bool>(); };
  // Gemma3TextConfig has a default for every size (the hub's multimodal configs leave the heads and
  // the vocabulary to them), as GptOssConfig and Gemma4TextConfig do; the other families' configs
  // must give theirs.
  const bool sizes_required = !c.is_gemma3() && !c.is_gpt_oss() && !c.is_gemma4();
  if (c.is_gemma3()) config_internal::SetGemma3Defaults(&c);
  if (c.is_gpt_oss()) config_internal::SetGptOssDefaults(&c);
  if (c.is_gemma4()) config_internal::SetGemma4Defaults(&c);
  RETURN_IF_ERROR(get_int("hidden_size", &c.hidden_size, sizes_required));
  RETURN_IF_ERROR(get_int("num_hidden_layers", &c.num_hidden_layers, sizes_required));
  RETURN_IF_ERROR(get_int("num_attention_heads", &c.num_attention_heads, sizes_required));
  if (sizes_required) c.num_key_value_heads = c.num_attention_heads;
  RETURN_IF_ERROR(get_int("num_key_value_heads", &c.num_key_value_heads, false));
  if (sizes_required) {
    c.head_dim = c.is_qwen3_5() ? 256 : c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  }
  RETURN_IF_ERROR(get_int("head_dim", &c.head_dim, false));
  if (c.is_moe() && !c.is_gpt_oss()) c.intermediate_size = 6144;  // Qwen3MoeConfig's: only its dense layers read it
  RETURN_IF_ERROR(get_int("intermediate_size", &c.intermediate_size, !c.is_moe() && sizes_required));
  RETURN_IF_ERROR(get_int("vocab_size", &c.vocab_size, sizes_required));
  RETURN_IF_ERROR(get_int("max_position_embeddings", &c.max_position_embeddings, false));
  RETURN_IF_ERROR(get_double("rope_theta", &c.rope_theta));
  RETURN_IF_ERROR(get_double("rms_norm_eps", &c.rms_norm_eps));
  RETURN_IF_ERROR(get_double("initializer_range", &c.initializer_range));
  if (t.contains("tie_word_embeddings")) {
    if (!t["tie_word_embeddings"].is_boolean()) {
      return absl::InvalidArgumentError("config.json: \"tie_word_embeddings\" must be a boolean");
    }
    c.tie_word_embeddings = t["tie_word_embeddings"].get<bool>();
  }
  // The multimodal wrapper's own tie_word_embeddings is what its ForConditionalGeneration ties by.
  if (c.multimodal && j.contains("tie_word_embeddings") && !j["tie_word_embeddings"].is_null()) {
    if (!j["tie_word_embeddings"].is_boolean()) {
      return absl::InvalidArgumentError("config.json: \"tie_word_embeddings\" must be a boolean");
    }
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  if (t.contains("torch_dtype") && t["torch_dtype"].is_string()) c.torch_dtype = t["torch_dtype"];
  if (t.contains("dtype") && t["dtype"].is_string()) c.torch_dtype = t["dtype"];
  // Fields that would change the math this build computes: refused, never ignored (gemma3's
  // activation: ParseGemma3).
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    if (!c.is_gemma3() && !c.is_gemma4() && t.contains(key) && !t[key].is_null() && t[key] != "silu") {
      return Refuse(key, absl::StrCat(t[key].dump(), " is not supported (only silu: the SwiGLU MLP)"));
    }
  }
  // qwen2's q/k/v projections always carry biases (HF hard-codes them); elsewhere
  // attention_bias would also put one on o_proj, which this build does not compute.
  if (c.family != ModelFamily::kQwen2 && !c.is_gpt_oss() && flag("attention_bias")) {
    return Refuse("attention_bias", absl::StrCat("true is not supported for ", ModelTypeName(c.family),
                                                 " (biases on the attention projections)"));
  }
  if (flag("mlp_bias")) return Refuse("mlp_bias", "true is not supported (biases on the MLP projections)");
  for (const char* key : {"attention_dropout", "hidden_dropout", "dropout"}) {
    double p = 0;
    RETURN_IF_ERROR(get_double(key, &p));
    if (p != 0) return Refuse(key, absl::StrCat(p, " is not supported (training here runs without dropout)"));
  }
  if (c.is_gemma3()) {
    RETURN_IF_ERROR(config_internal::ParseGemma3(t, j, where, &c));  // its two RoPEs included
  } else if (c.is_qwen3_5()) {
    RETURN_IF_ERROR(config_internal::ParseQwen3_5(t, where, &c));
  } else if (c.is_gpt_oss()) {
    RETURN_IF_ERROR(config_internal::ParseGptOss(t, &c));  // its RoPE included
  } else if (c.is_gemma4()) {
    RETURN_IF_ERROR(config_internal::ParseGemma4(t, j, where, &c));  // its RoPEs and layer_types included
  } else if (c.is_moe()) {
    RETURN_IF_ERROR(config_internal::ParseMoe(t, &c));
  } else if (t.contains("num_experts") || t.contains("num_local_experts")) {
    return Refuse(t.contains("num_experts") ? "num_experts" : "num_local_experts",
                  absl::StrCat("mixture-of-experts layers are not supported by model_type ", ModelTypeName(c.family),
                               " (they are by qwen3_moe)"));
  }
  if (!c.is_gemma3() && !c.is_gpt_oss() && !c.is_gemma4()) RETURN_IF_ERROR(ParseRope(t, &c));
  RETURN_IF_ERROR(config_internal::ParseAttentionSpans(t, &c));
  RETURN_IF_ERROR(c.Validate());
  c.source_json = j.dump();
  return c;
}

absl::Status ModelConfig::ReduceDepth(int64_t layers) {
  if (layers <= 0 || layers > num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat(layers, " layers of a model that has ", num_hidden_layers,
                                                   " (the depth can only be reduced)"));
  }
  const int64_t first_shared = num_hidden_layers - gemma4.kv_shared_layers;
  num_hidden_layers = layers;
  if (!layer_mixers.empty()) layer_mixers.resize(static_cast<size_t>(num_hidden_layers));
  if (!layer_spans.empty()) layer_spans.resize(static_cast<size_t>(num_hidden_layers));
  if (is_gemma4()) {  // the same layers share keys and values; the last is full (Gemma4TextConfig's rule)
    gemma4.kv_shared_layers = std::max<int64_t>(0, num_hidden_layers - first_shared);
    if (!layer_spans.empty()) layer_spans.back() = AttentionSpan::kFull;
  }
  if (NumSlidingLayers() == 0) {  // the sliding layers were all past the new depth
    layer_spans.clear();
    sliding_window = 0;
  }
  std::erase_if(mlp_only_layers, [&](int64_t l) { return l >= num_hidden_layers; });
  return Validate();
}

absl::Status ModelConfig::OverrideContext(int64_t max_positions, absl::string_view rope_scaling_json) {
  if (!rope_scaling_json.empty()) {
    RETURN_IF_ERROR(CheckJsonDepth(rope_scaling_json, "model.rope_scaling"));
    nlohmann::json r = nlohmann::json::parse(rope_scaling_json, nullptr, /*allow_exceptions=*/false);
    if (r.is_discarded() || !r.is_object()) {
      return absl::InvalidArgumentError("model.rope_scaling: expected a map (HF's rope_scaling object)");
    }
    ModelConfig c = *this;  // the config's own max_position_embeddings is the default original context
    c.rope_scaling = RopeScaling{};
    absl::Status s = ParseRope(nlohmann::json{{"rope_scaling", r}}, &c);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("model.rope_scaling (job spec): ", s.message()));
    rope_scaling = c.rope_scaling;
    rope_theta = c.rope_theta;
  }
  if (max_positions > 0) max_position_embeddings = max_positions;
  absl::Status v = Validate();
  if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat("model (job spec override): ", v.message()));
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxConfigFileBytes, "model config"));
  auto c = FromJson(text);
  if (!c.ok()) return Annotate(c.status(), path);
  return c;
}

// HF modeling_rope_utils.py (transformers 5.17), function by function. Every tensor there is
// float32 and the Python scalars it meets take the tensor's type in each operation (on the CPU,
// where HF computes these at init, a division stays a division); the scalars' own arithmetic
// (yarn's correction range, dynamic's base) is in double.


}  // namespace slidedp
