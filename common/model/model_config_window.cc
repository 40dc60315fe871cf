// Sliding-window attention in a config: which layers slide and how far (ModelConfig::layer_spans,
// sliding_window), read from and written to config.json as transformers 5.17 applies the fields of
// each family, and checked. The definition (HF's configuration_mistral.py, configuration_qwen2.py,
// configuration_qwen3.py, configuration_qwen3_moe.py and each model's mask choice):
//   mistral  : sliding_window (absent: 4096, null: none) slides every layer; MistralForCausalLM
//              ignores layer_types (it warns and attends by sliding_window alone).
//   qwen2, qwen3: sliding_window is kept only under use_sliding_window (absent: 4096, null: none);
//              the sliding layers are layer_types' sliding_attention entries, or, without
//              layer_types, those at or past max_window_layers (default 28). A sliding_attention
//              layer without a window makes HF's forward fail ("Could not find a sliding_window").
//   qwen3_moe: no layer_types or max_window_layers; use_sliding_window slides every layer.
//   gemma3   : sliding_window (absent: 4096, null: none) slides the layers layer_types names, or
//              without layer_types those where (l + 1) % sliding_window_pattern != 0 (default 6:
//              five sliding layers, then a full one; Gemma3TextConfig.__post_init__).
//   gpt_oss  : sliding_window (absent: 128, null: none) slides the layers layer_types names, or
//              without layer_types every other one from layer 0 (GptOssConfig.__post_init__:
//              (l + 1) % 2 != 0 slides).
//   llama    : no sliding window.
// qwen3_5's fields are its own file's (model_config_qwen3_5.cc refuses a window).
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"
#include "common/status/status_macros.h"

namespace slidedp::config_internal {
namespace {

// HF's defaults: sliding_window in MistralConfig, Qwen2Config, Qwen3Config and Qwen3MoeConfig;
// max_window_layers in Qwen2Config and Qwen3Config.
constexpr int64_t kHfDefaultWindow = 4096;
constexpr int64_t kHfDefaultMaxWindowLayers = 28;
constexpr int64_t kHfDefaultGemma3Pattern = 6;  // Gemma3TextConfig's sliding_window_pattern
constexpr int64_t kHfDefaultGptOssWindow = 128;  // GptOssConfig's sliding_window
constexpr int64_t kMaxLayers = 4096;  // ModelConfig::Validate's limit on num_hidden_layers

// sliding_window as HF's configs read it: absent is the default, null is none (0).
absl::StatusOr<int64_t> WindowField(const nlohmann::json& j) {
  if (!j.contains("sliding_window")) return kHfDefaultWindow;
  const nlohmann::json& w = j["sliding_window"];
  if (w.is_null()) return 0;
  if (!w.is_number_integer() || w.get<int64_t>() <= 0) {
    return Refuse("sliding_window", absl::StrCat("must be a positive integer or null, got ", w.dump()));
  }
  return w.get<int64_t>();
}

// A boolean field (null and absent: false).
absl::StatusOr<bool> Flag(const nlohmann::json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return false;
  if (!j[key].is_boolean()) return Refuse(key, absl::StrCat("must be a boolean, got ", j[key].dump()));
  return j[key].get<bool>();
}

// layer_types as spans, one per layer (nullopt when absent or null).
absl::StatusOr<std::optional<std::vector<AttentionSpan>>> LayerTypes(const nlohmann::json& j, int64_t layers) {
  if (!j.contains("layer_types") || j["layer_types"].is_null()) return std::nullopt;
  if (!j["layer_types"].is_array()) return Refuse("layer_types", "must be a list");
  std::vector<AttentionSpan> spans;
  for (const nlohmann::json& t : j["layer_types"]) {
    if (t == "sliding_attention") {
      spans.push_back(AttentionSpan::kSliding);
    } else if (t == "full_attention") {
      spans.push_back(AttentionSpan::kFull);
    } else {
      return Refuse("layer_types", absl::StrCat(t.dump(), " is not supported (full_attention, sliding_attention)"));
    }
  }
  if (static_cast<int64_t>(spans.size()) != layers) {
    return Refuse("layer_types", absl::StrCat("has ", spans.size(), " entries for num_hidden_layers ", layers));
  }
  return spans;
}

const char* SpanName(AttentionSpan s) { return s == AttentionSpan::kSliding ? "sliding_attention" : "full_attention"; }

// The families whose HF model class applies one span to every layer and never reads layer_types:
// a layer_types that says otherwise describes another model than the one HF would train, refused.
absl::Status CheckIgnoredLayerTypes(const std::optional<std::vector<AttentionSpan>>& types, AttentionSpan applied,
                                    ModelFamily family) {
  if (!types.has_value()) return absl::OkStatus();
  const char* by = family == ModelFamily::kLlama      ? "it has no sliding window"
                   : family == ModelFamily::kQwen3Moe ? "by use_sliding_window and sliding_window"
                                                      : "by sliding_window";
  for (size_t l = 0; l < types->size(); ++l) {
    if ((*types)[l] == applied) continue;
    return Refuse("layer_types",
                  absl::StrCat("layer ", l, " is ", SpanName((*types)[l]), ", but transformers' ",
                               ModelTypeName(family), " model does not read layer_types and attends with ",
                               SpanName(applied), " in every layer (", by, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseAttentionSpans(const nlohmann::json& j, ModelConfig* c) {
  if (c->is_gemma4()) return absl::OkStatus();  // parsed with its other fields: model_config_gemma4.cc
  c->sliding_window = 0;
  c->layer_spans.clear();
  // A depth out of range is Validate's to refuse; nothing is sized by it before.
  if (c->num_hidden_layers <= 0 || c->num_hidden_layers > kMaxLayers) return absl::OkStatus();
  if (c->is_qwen3_5()) return absl::OkStatus();  // its layer_types and window: model_config_qwen3_5.cc
  ASSIGN_OR_RETURN(const std::optional<std::vector<AttentionSpan>> types, LayerTypes(j, c->num_hidden_layers));
  int64_t window = 0;
  std::vector<AttentionSpan> spans;
  switch (c->family) {
    case ModelFamily::kLlama:
      RETURN_IF_ERROR(CheckIgnoredLayerTypes(types, AttentionSpan::kFull, c->family));
      return absl::OkStatus();
    case ModelFamily::kMistral:
    case ModelFamily::kQwen3Moe: {
      bool use = true;
      if (c->family == ModelFamily::kQwen3Moe) {
        ASSIGN_OR_RETURN(use, Flag(j, "use_sliding_window"));
      }
      if (use) {
        ASSIGN_OR_RETURN(window, WindowField(j));
      }
      const AttentionSpan every = window > 0 ? AttentionSpan::kSliding : AttentionSpan::kFull;
      RETURN_IF_ERROR(CheckIgnoredLayerTypes(types, every, c->family));
      spans.assign(c->num_hidden_layers, every);
      break;
    }
    case ModelFamily::kQwen2:
    case ModelFamily::kQwen3: {
      ASSIGN_OR_RETURN(const bool use, Flag(j, "use_sliding_window"));
      if (use) {
        ASSIGN_OR_RETURN(window, WindowField(j));
      }
      int64_t max_window_layers = kHfDefaultMaxWindowLayers;
      if (j.contains("max_window_layers") && !j["max_window_layers"].is_null()) {
        if (!j["max_window_layers"].is_number_integer()) {
          return Refuse("max_window_layers", absl::StrCat("must be an integer, got ", j["max_window_layers"].dump()));
        }
        max_window_layers = j["max_window_layers"].get<int64_t>();
      }
      if (types.has_value()) {
        spans = *types;
      } else {
        for (int64_t l = 0; l < c->num_hidden_layers; ++l) {
          spans.push_back(window > 0 && l >= max_window_layers ? AttentionSpan::kSliding : AttentionSpan::kFull);
        }
      }
      const auto sliding = std::find(spans.begin(), spans.end(), AttentionSpan::kSliding);
      if (sliding != spans.end() && window == 0) {
        return Refuse("layer_types", absl::StrCat("layer ", sliding - spans.begin(),
                                                  " is sliding_attention but the config has no "
                                                  "window (",
                                                  use ? "sliding_window is null" : "use_sliding_window is not true",
                                                  "; transformers' forward fails on such a layer)"));
      }
      break;
    }
    case ModelFamily::kGemma3: {
      ASSIGN_OR_RETURN(window, WindowField(j));
      int64_t pattern = kHfDefaultGemma3Pattern;
      if (j.contains("sliding_window_pattern") && !j["sliding_window_pattern"].is_null()) {
        const nlohmann::json& p = j["sliding_window_pattern"];
        if (!p.is_number_integer() || p.get<int64_t>() < 1) {
          return Refuse("sliding_window_pattern", absl::StrCat("must be a positive integer, got ", p.dump()));
        }
        pattern = p.get<int64_t>();
      }
      if (types.has_value()) {
        spans = *types;
      } else {
        for (int64_t l = 0; l < c->num_hidden_layers; ++l) {
          spans.push_back((l + 1) % pattern != 0 ? AttentionSpan::kSliding : AttentionSpan::kFull);
        }
      }
      const auto sliding = std::find(spans.begin(), spans.end(), AttentionSpan::kSliding);
      if (sliding != spans.end() && window == 0) {
        return Refuse("sliding_window", absl::StrCat("is null but layer ", sliding - spans.begin(),
                                                     " is sliding_attention (transformers' mask needs a window)"));
      }
      break;
    }
    case ModelFamily::kGptOss: {
      if (j.contains("sliding_window")) {
        ASSIGN_OR_RETURN(window, WindowField(j));
      } else {
        window = kHfDefaultGptOssWindow;
      }
      if (types.has_value()) {
        spans = *types;
      } else {
        for (int64_t l = 0; l < c->num_hidden_layers; ++l) {
          spans.push_back((l + 1) % 2 != 0 ? AttentionSpan::kSliding : AttentionSpan::kFull);
        }
      }
      const auto sliding = std::find(spans.begin(), spans.end(), AttentionSpan::kSliding);
      if (sliding != spans.end() && window == 0) {
        return Refuse("sliding_window", absl::StrCat("is null but layer ", sliding - spans.begin(),
                                                     " is sliding_attention (transformers' mask needs a window)"));
      }
      break;
    }
    case ModelFamily::kQwen3_5:
    case ModelFamily::kQwen3_5Moe:
    case ModelFamily::kGemma4: return absl::OkStatus();
  }
  if (std::find(spans.begin(), spans.end(), AttentionSpan::kSliding) == spans.end()) return absl::OkStatus();
  c->sliding_window = window;
  c->layer_spans = std::move(spans);
  return absl::OkStatus();
}

absl::Status CheckAttentionSpans(const ModelConfig& c) {
  auto bad = [](absl::string_view why) { return absl::InvalidArgumentError(absl::StrCat("config: ", why)); };
  const int64_t n = static_cast<int64_t>(c.layer_spans.size()), sliding = c.NumSlidingLayers();
  if (n != 0 && n != c.num_hidden_layers) {
    return bad(
        absl::StrCat("layer_types (layer_spans) has ", n, " entries for num_hidden_layers ", c.num_hidden_layers));
  }
  if (c.sliding_window < 0) return bad(absl::StrCat("sliding_window must be >= 0, got ", c.sliding_window));
  if (sliding == 0) {
    if (c.sliding_window != 0) {
      return bad(absl::StrCat("sliding_window ", c.sliding_window, " but no layer slides (layer_spans)"));
    }
    return absl::OkStatus();
  }
  if (c.sliding_window == 0) return bad(absl::StrCat(sliding, " sliding layer(s) without a sliding_window"));
  // What config.json can say for each family (WriteAttentionSpans), and what its HF class reads.
  switch (c.family) {
    case ModelFamily::kLlama:
    case ModelFamily::kQwen3_5:
    case ModelFamily::kQwen3_5Moe:
      return bad(absl::StrCat("sliding-window attention is not implemented for ", ModelTypeName(c.family)));
    case ModelFamily::kMistral:
    case ModelFamily::kQwen3Moe:
      if (sliding != c.num_hidden_layers) {
        return bad(absl::StrCat(ModelTypeName(c.family), " slides every layer or none; ", sliding, " of ",
                                c.num_hidden_layers, " slide"));
      }
      return absl::OkStatus();
    case ModelFamily::kQwen2:
    case ModelFamily::kQwen3:
    case ModelFamily::kGemma3:
    case ModelFamily::kGptOss:
    case ModelFamily::kGemma4: return absl::OkStatus();
  }
  return absl::OkStatus();
}

void WriteAttentionSpans(const ModelConfig& c, nlohmann::ordered_json& t) {
  const bool sliding = c.NumSlidingLayers() > 0;
  const nlohmann::ordered_json window = sliding ? nlohmann::ordered_json(c.sliding_window) : nlohmann::ordered_json();
  switch (c.family) {
    case ModelFamily::kLlama:
    case ModelFamily::kQwen3_5:
    case ModelFamily::kQwen3_5Moe: return;
    case ModelFamily::kMistral:
    case ModelFamily::kGptOss: t["sliding_window"] = window; break;
    case ModelFamily::kGemma4:  // an int in Gemma4TextConfig (absent: 512): kept where no layer slides
      if (sliding) t["sliding_window"] = window;
      break;
    case ModelFamily::kQwen3Moe:
      t["use_sliding_window"] = sliding;
      t["sliding_window"] = window;
      break;
    case ModelFamily::kQwen2:
    case ModelFamily::kQwen3: {
      t["use_sliding_window"] = sliding;
      t["sliding_window"] = window;
      if (!sliding) break;
      // transformers 5 reads layer_types; 4.x reads max_window_layers, written where the sliding
      // layers are the suffix it describes.
      const int64_t first = c.num_hidden_layers - c.NumSlidingLayers();
      bool suffix = true;
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) suffix = suffix && c.IsSlidingLayer(l) == (l >= first);
      if (suffix) t["max_window_layers"] = first;
      break;
    }
    case ModelFamily::kGemma3: {
      t["sliding_window"] = window;
      // transformers 4.50's Gemma3TextConfig reads sliding_window_pattern, not layer_types: written
      // where the layers follow its rule ((l + 1) % pattern != 0 slides), else dropped.
      int64_t pattern = c.num_hidden_layers + 1;
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        if (!c.IsSlidingLayer(l)) {
          pattern = l + 1;
          break;
        }
      }
      bool follows = true;
      for (int64_t l = 0; l < c.num_hidden_layers; ++l)
        follows = follows && c.IsSlidingLayer(l) == ((l + 1) % pattern != 0);
      if (follows) {
        t["sliding_window_pattern"] = pattern;
      } else {
        t.erase("sliding_window_pattern");
      }
      break;
    }
  }
  // A layer_types the source carried is rewritten to agree; qwen2 / qwen3 with a window, gemma3,
  // gpt_oss and gemma4 always get one.
  const bool per_layer = c.family == ModelFamily::kQwen2 || c.family == ModelFamily::kQwen3;
  if (t.contains("layer_types") || (per_layer && sliding) || c.is_gemma3() || c.is_gpt_oss() || c.is_gemma4()) {
    nlohmann::ordered_json types = nlohmann::ordered_json::array();
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      types.push_back(SpanName(c.IsSlidingLayer(l) ? AttentionSpan::kSliding : AttentionSpan::kFull));
    }
    t["layer_types"] = types;
  }
}

}  // namespace slidedp::config_internal
