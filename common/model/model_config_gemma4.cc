// Gemma 4's config (gemma4_text, and the gemma4 multimodal wrapper's text_config): its fields, the
// keys this build knows, its per-layer sizes, per-layer inputs, shared keys and values, its two
// RoPEs and which layers slide (ModelConfig::gemma4, model_config.h; docs/model-families.md,
// "Gemma 4"); the options it refuses, by field; its config.json fields written back; its presets;
// and a decoder unit's tensors (ModelLayout::Build). The definition is transformers 5.17's configuration_gemma4.py
// (Gemma4TextConfig.__post_init__: the layer_types rule, the forced full last layer, the default
// RoPEs, global_head_dim / num_global_key_value_heads into per_layer_config) and modeling_gemma4.py
// (what each field does), with modeling_rope_utils.py's proportional RoPE.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"
#include "common/status/status_macros.h"

namespace slidedp {

int64_t ModelConfig::LayerHeadDim(int64_t layer) const {
  return is_gemma4() && !IsSlidingLayer(layer) && gemma4.full_head_dim > 0 ? gemma4.full_head_dim : head_dim;
}

int64_t ModelConfig::LayerKvHeads(int64_t layer) const {
  return is_gemma4() && !IsSlidingLayer(layer) && gemma4.full_kv_heads > 0 ? gemma4.full_kv_heads
                                                                            : num_key_value_heads;
}

int64_t ModelConfig::LayerIntermediate(int64_t layer) const {
  // Gemma4TextMLP: use_double_wide_mlp widens the kv-shared layers (layer >= first > 0).
  const int64_t first = num_hidden_layers - gemma4.kv_shared_layers;
  const bool wide = is_gemma4() && gemma4.double_wide_mlp && first > 0 && layer >= first;
  return wide ? 2 * intermediate_size : intermediate_size;
}

int64_t ModelConfig::KvSourceLayer(int64_t layer) const {
  // Gemma4TextAttention: layers from num_hidden_layers - num_kv_shared_layers on read
  // shared_kv_states[their type], which the last earlier layer of that type stored.
  if (!is_gemma4() || gemma4.kv_shared_layers <= 0) return -1;
  const int64_t first = num_hidden_layers - gemma4.kv_shared_layers;
  if (layer < first) return -1;
  for (int64_t l = first - 1; l >= 0; --l) {
    if (IsSlidingLayer(l) == IsSlidingLayer(layer)) return l;
  }
  return -1;  // refused by CheckGemma4
}

namespace config_internal {
namespace {

// The keys of a gemma4_text config: Gemma4TextConfig's fields, the kwargs its __post_init__ reads
// (global_head_dim, num_global_key_value_heads, per_layer_config), and the PreTrainedConfig fields
// every saved config carries. Any other key is refused naming it.
constexpr const char* kGemma4TextKeys[] = {
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
    "sliding_window",
    "layer_types",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    "vocab_size_per_layer_input",
    "hidden_size_per_layer_input",
    "attention_k_eq_v",
    "num_kv_shared_layers",
    "enable_moe_block",
    "use_double_wide_mlp",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "global_head_dim",
    "num_global_key_value_heads",
    "per_layer_config",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    // Not a Gemma4TextConfig field: layer_types (or the fixed 5:1 rule) decides, whatever it says.
    "sliding_window_pattern",
};

// Gemma4Config's own keys (the vision and audio towers' configs are carried unchanged).
constexpr const char* kGemma4WrapperKeys[] = {
    "model_type",
    "architectures",
    "text_config",
    "vision_config",
    "audio_config",
    "boi_token_id",
    "eoi_token_id",
    "image_token_id",
    "video_token_id",
    "boa_token_id",
    "eoa_token_index",
    "eoa_token_id",
    "audio_token_id",
    "vision_soft_tokens_per_image",
    "initializer_range",
    "chunk_size_feed_forward",
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

// Gemma4TextConfig's defaults that ModelConfig's own fields do not carry.
constexpr int64_t kDefaultWindow = 512;
constexpr int64_t kDefaultPattern = 6;  // __post_init__: five sliding layers, then a full one
constexpr int64_t kDefaultGlobalHeadDim = 512;
constexpr int64_t kDefaultPleDim = 256;
constexpr int64_t kDefaultPleVocab = 262144;
// Gemma4Config's placeholder ids (image, video, audio), which Gemma4Model embeds as pad_token_id.
constexpr int64_t kDefaultPlaceholders[] = {258880, 258884, 258881};

absl::StatusOr<double> Number(const nlohmann::json& t, const char* key, absl::string_view where, double absent) {
  if (!t.contains(key) || t[key].is_null()) return absent;
  if (!t[key].is_number())
    return Refuse(absl::StrCat(where, key), absl::StrCat("must be a number, got ", t[key].dump()));
  return t[key].get<double>();
}

absl::StatusOr<int64_t> Integer(const nlohmann::json& t, const char* key, absl::string_view where, int64_t absent) {
  if (!t.contains(key)) return absent;
  if (!t[key].is_number_integer())
    return Refuse(absl::StrCat(where, key), absl::StrCat("must be an integer, got ", t[key].dump()));
  return t[key].get<int64_t>();
}

absl::StatusOr<bool> Boolean(const nlohmann::json& t, const char* key, absl::string_view where) {
  if (!t.contains(key) || t[key].is_null()) return false;
  if (!t[key].is_boolean())
    return Refuse(absl::StrCat(where, key), absl::StrCat("must be a boolean, got ", t[key].dump()));
  return t[key].get<bool>();
}

const char* SpanName(AttentionSpan s) { return s == AttentionSpan::kSliding ? "sliding_attention" : "full_attention"; }

// layer_types and sliding_window as Gemma4TextConfig.__post_init__ applies them: the list, else
// (l + 1) % 6 != 0 slides; the last layer is made full attention whatever the list says (transformers
// warns and forces it); sliding_window absent is 512, and HF's strict int refuses null.
absl::Status ParseGemma4Spans(const nlohmann::json& t, absl::string_view where, ModelConfig* c) {
  const int64_t layers = c->num_hidden_layers;
  if (layers <= 0 || layers > 4096) return absl::OkStatus();  // Validate refuses the depth
  std::vector<AttentionSpan> spans;
  if (t.contains("layer_types") && !t["layer_types"].is_null()) {
    const nlohmann::json& types = t["layer_types"];
    if (!types.is_array()) return Refuse(absl::StrCat(where, "layer_types"), "must be a list");
    for (const nlohmann::json& type : types) {
      if (type == "sliding_attention") {
        spans.push_back(AttentionSpan::kSliding);
      } else if (type == "full_attention") {
        spans.push_back(AttentionSpan::kFull);
      } else {
        return Refuse(absl::StrCat(where, "layer_types"),
                      absl::StrCat(type.dump(), " is not supported (full_attention, sliding_attention)"));
      }
    }
    if (static_cast<int64_t>(spans.size()) != layers) {
      return Refuse(absl::StrCat(where, "layer_types"),
                    absl::StrCat("has ", spans.size(), " entries for num_hidden_layers ", layers));
    }
  } else {
    for (int64_t l = 0; l < layers; ++l) {
      spans.push_back((l + 1) % kDefaultPattern != 0 ? AttentionSpan::kSliding : AttentionSpan::kFull);
    }
  }
  spans.back() = AttentionSpan::kFull;
  ASSIGN_OR_RETURN(const int64_t window, Integer(t, "sliding_window", where, kDefaultWindow));
  if (window <= 0) {
    return Refuse(absl::StrCat(where, "sliding_window"), absl::StrCat("must be a positive integer, got ", window));
  }
  c->layer_spans = std::move(spans);
  c->sliding_window = c->NumSlidingLayers() > 0 ? window : 0;
  if (c->sliding_window == 0) c->layer_spans.clear();
  return absl::OkStatus();
}

// One layer type's RoPE object: "default" (theta) or "proportional" (theta, partial_rotary_factor,
// factor), as Gemma4TextRotaryEmbedding computes them (default: compute_default_rope_parameters,
// which reads rope_theta alone; proportional: _compute_proportional_rope_parameters).
absl::Status ParseGemma4RopeObject(const nlohmann::json& r, const std::string& name, double* theta, Gemma4Rope* rope) {
  if (!r.is_object()) {
    return Refuse(name, "must be an object (transformers' rotary embedding of this layer type needs one)");
  }
  const std::string type = r.contains("rope_type") && r["rope_type"].is_string() ? r["rope_type"].get<std::string>()
                                                                                   : "default";
  if (type != "default" && type != "proportional") {
    return Refuse(absl::StrCat(name, ".rope_type"),
                  absl::StrCat("\"", type, "\" is not implemented for gemma4 (default, proportional)"));
  }
  for (const auto& [key, value] : r.items()) {
    if (key != "rope_type" && key != "rope_theta" && key != "partial_rotary_factor" && key != "factor") {
      return Refuse(absl::StrCat(name, ".", key), "is not implemented by this build for gemma4's RoPE");
    }
  }
  if (!r.contains("rope_theta") || !r["rope_theta"].is_number()) {
    return Refuse(absl::StrCat(name, ".rope_theta"), "must be a number (transformers 5.17 reads it)");
  }
  *theta = r["rope_theta"].get<double>();
  *rope = Gemma4Rope{};
  if (type == "default") return absl::OkStatus();  // partial_rotary_factor and factor: not read
  rope->proportional = true;
  for (const auto& [key, out] : {std::pair<const char*, double*>{"partial_rotary_factor", &rope->fraction},
                                 {"factor", &rope->factor}}) {
    if (!r.contains(key) || r[key].is_null()) continue;  // 1.0, as transformers defaults them
    if (!r[key].is_number()) {
      return Refuse(absl::StrCat(name, ".", key), absl::StrCat("must be a number, got ", r[key].dump()));
    }
    *out = r[key].get<double>();
  }
  return absl::OkStatus();
}

// rope_parameters: Gemma4TextConfig.convert_rope_params_to_dict keeps it as given; absent or null it
// is {"sliding_attention": default 1e4, "full_attention": proportional 0.25 at 1e6}. Every layer type
// present needs its object (the rotary embedding indexes it).
absl::Status ParseGemma4Rope(const nlohmann::json& t, absl::string_view where, ModelConfig* c) {
  const std::string key = absl::StrCat(where, "rope_parameters");
  c->rope_theta = 1e6;
  c->sliding_rope_theta = 1e4;
  c->gemma4.full_rope = Gemma4Rope{true, 0.25, 1};
  c->gemma4.sliding_rope = Gemma4Rope{};
  c->rope_scaling = RopeScaling{};
  c->sliding_rope_scaling = RopeScaling{};
  if (!t.contains("rope_parameters") || t["rope_parameters"].is_null()) return absl::OkStatus();
  const nlohmann::json& p = t["rope_parameters"];
  if (!p.is_object()) return Refuse(key, "must be an object");
  for (const auto& [type, value] : p.items()) {
    if (type != "full_attention" && type != "sliding_attention") {
      return Refuse(absl::StrCat(key, ".", type),
                    "gemma4's rope_parameters holds one object per layer type (full_attention, sliding_attention)");
    }
  }
  const bool any_sliding = c->NumSlidingLayers() > 0;
  for (const char* type : {"full_attention", "sliding_attention"}) {
    const bool sliding = std::string(type) == "sliding_attention";
    const std::string name = absl::StrCat(key, ".", type);
    if (!p.contains(type)) {
      if (sliding && !any_sliding) continue;  // no layer reads it
      return Refuse(name, "missing (transformers' rotary embedding reads one object per layer type present)");
    }
    RETURN_IF_ERROR(ParseGemma4RopeObject(p[type], name, sliding ? &c->sliding_rope_theta : &c->rope_theta,
                                          sliding ? &c->gemma4.sliding_rope : &c->gemma4.full_rope));
  }
  return absl::OkStatus();
}

// The full-attention layers' head_dim and kv heads. per_layer_config (transformers 5.15+'s
// heterogeneous configs: {"<layer>": {"head_dim": .., "num_key_value_heads": ..}}, keys zero-padded
// or not) when present; else Gemma4TextConfig.__post_init__'s: head_dim global_head_dim (absent:
// 512) on every full layer, and num_key_value_heads num_global_key_value_heads there when
// attention_k_eq_v. The layers of one type must agree (each RoPE is computed per layer type), and
// a sliding layer keeps the global sizes.
absl::Status ParseGemma4LayerSizes(const nlohmann::json& t, absl::string_view where, ModelConfig* c) {
  Gemma4Fields& g = c->gemma4;
  const int64_t layers = c->num_hidden_layers;
  if (!t.contains("per_layer_config") || t["per_layer_config"].is_null()) {
    ASSIGN_OR_RETURN(g.full_head_dim, Integer(t, "global_head_dim", where, kDefaultGlobalHeadDim));
    g.full_kv_heads = c->num_key_value_heads;
    if (g.k_eq_v && t.contains("num_global_key_value_heads") && !t["num_global_key_value_heads"].is_null()) {
      ASSIGN_OR_RETURN(g.full_kv_heads, Integer(t, "num_global_key_value_heads", where, c->num_key_value_heads));
    }
    return absl::OkStatus();
  }
  const std::string key = absl::StrCat(where, "per_layer_config");
  const nlohmann::json& plc = t["per_layer_config"];
  if (!plc.is_object()) return Refuse(key, "must be an object of layer index -> sizes");
  std::map<int64_t, std::pair<int64_t, int64_t>> sizes;  // layer -> (head_dim, kv heads)
  for (const auto& [index, value] : plc.items()) {
    const std::string name = absl::StrCat(key, ".", index);
    int64_t layer = -1;
    if (!absl::SimpleAtoi(index, &layer) || layer < 0 || layer >= layers) {
      return Refuse(name, absl::StrCat("must name a layer in [0, ", layers, ")"));
    }
    if (!value.is_object()) return Refuse(name, "must be an object");
    std::pair<int64_t, int64_t> s = {c->head_dim, c->num_key_value_heads};
    for (const auto& [field, v] : value.items()) {
      if (field != "head_dim" && field != "num_key_value_heads") {
        return Refuse(absl::StrCat(name, ".", field),
                      "is not implemented by this build (gemma4 layers differ in head_dim and num_key_value_heads)");
      }
      if (!v.is_number_integer() || v.get<int64_t>() <= 0) {
        return Refuse(absl::StrCat(name, ".", field), absl::StrCat("must be a positive integer, got ", v.dump()));
      }
      (field == "head_dim" ? s.first : s.second) = v.get<int64_t>();
    }
    sizes[layer] = s;
  }
  std::pair<int64_t, int64_t> full = {-1, -1};
  int64_t first_full = -1;
  for (int64_t l = 0; l < layers; ++l) {
    const auto it = sizes.find(l);
    const std::pair<int64_t, int64_t> s =
        it != sizes.end() ? it->second : std::make_pair(c->head_dim, c->num_key_value_heads);
    if (c->IsSlidingLayer(l)) {
      if (s != std::make_pair(c->head_dim, c->num_key_value_heads)) {
        return Refuse(absl::StrCat(key, ".", l),
                      "sizes of a sliding_attention layer other than head_dim / num_key_value_heads are not "
                      "implemented");
      }
      continue;
    }
    if (full.first < 0) {
      full = s;
      first_full = l;
    }
    if (s != full) {
      return Refuse(absl::StrCat(key, ".", l),
                    absl::StrCat("head_dim ", s.first, " and ", s.second, " kv heads, but full_attention layer ",
                                 first_full, " has ", full.first, " and ", full.second,
                                 ": full_attention layers of different sizes are not implemented (one RoPE per "
                                 "layer type)"));
    }
  }
  if (full.first > 0) {
    g.full_head_dim = full.first;
    g.full_kv_heads = full.second;
  } else {
    g.full_head_dim = c->head_dim;
    g.full_kv_heads = c->num_key_value_heads;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Span<const char* const> Gemma4WrapperKeys() { return kGemma4WrapperKeys; }

void SetGemma4Defaults(ModelConfig* c) {
  c->vocab_size = 262144;
  c->hidden_size = 2304;
  c->intermediate_size = 9216;
  c->num_hidden_layers = 30;
  c->num_attention_heads = 8;
  c->num_key_value_heads = 4;
  c->head_dim = 256;
  c->max_position_embeddings = 131072;
  c->rms_norm_eps = 1e-6;
  c->initializer_range = 0.02;
  c->tie_word_embeddings = true;
}

absl::Status ParseGemma4(const nlohmann::json& t, const nlohmann::json& wrapper, absl::string_view where,
                         ModelConfig* c) {
  RETURN_IF_ERROR(RefuseUnknownKeys(t, kGemma4TextKeys, where, "gemma4_text"));
  auto name = [&](const char* key) { return absl::StrCat(where, key); };
  Gemma4Fields& g = c->gemma4;
  g = Gemma4Fields{};
  if (t.contains("hidden_activation") && t["hidden_activation"] != "gelu_pytorch_tanh") {
    return Refuse(name("hidden_activation"),
                  absl::StrCat(t["hidden_activation"].dump(),
                               " is not implemented for gemma4 (gelu_pytorch_tanh: GeGLU with the tanh-approximated "
                               "GELU)"));
  }
  ASSIGN_OR_RETURN(const bool moe, Boolean(t, "enable_moe_block", where));
  if (moe) {
    return Refuse(name("enable_moe_block"),
                  "true is not implemented: Gemma 4's MoE block (26B-A4B's router with its scales, experts beside "
                  "the dense MLP and their extra norms) is not built yet");
  }
  if (t.contains("use_bidirectional_attention") && !t["use_bidirectional_attention"].is_null() &&
      t["use_bidirectional_attention"] != "vision") {
    // "vision" opens the attention among an image's soft tokens, which text never has; "all" makes
    // every layer bidirectional (and halves the window).
    return Refuse(name("use_bidirectional_attention"),
                  absl::StrCat(t["use_bidirectional_attention"].dump(),
                               " is not implemented (this build's attention is causal; null or \"vision\": text "
                               "attends causally either way)"));
  }
  ASSIGN_OR_RETURN(c->final_logit_softcapping, Number(t, "final_logit_softcapping", where, 0));
  ASSIGN_OR_RETURN(g.k_eq_v, Boolean(t, "attention_k_eq_v", where));
  ASSIGN_OR_RETURN(g.double_wide_mlp, Boolean(t, "use_double_wide_mlp", where));
  ASSIGN_OR_RETURN(g.kv_shared_layers, Integer(t, "num_kv_shared_layers", where, 0));
  // hidden_size_per_layer_input: absent 256 (the class default); null or 0: no per-layer inputs
  // (the modeling code tests it for truth).
  g.ple_dim = kDefaultPleDim;
  if (t.contains("hidden_size_per_layer_input")) {
    if (t["hidden_size_per_layer_input"].is_null()) {
      g.ple_dim = 0;
    } else {
      ASSIGN_OR_RETURN(g.ple_dim, Integer(t, "hidden_size_per_layer_input", where, kDefaultPleDim));
    }
  }
  ASSIGN_OR_RETURN(g.ple_vocab, Integer(t, "vocab_size_per_layer_input", where, kDefaultPleVocab));
  if (g.ple_dim == 0) g.ple_vocab = 0;
  c->pad_token_id = 0;  // Gemma4TextConfig's
  if (t.contains("pad_token_id")) {
    if (t["pad_token_id"].is_null()) {
      c->pad_token_id = -1;
    } else {
      ASSIGN_OR_RETURN(c->pad_token_id, Integer(t, "pad_token_id", where, 0));
    }
  }
  if (c->multimodal) {
    // Gemma4ForConditionalGeneration runs in the wrapper's dtype; Gemma4Model embeds the placeholder
    // ids as pad_token_id (torch.where with None fails, so it needs one).
    for (const char* key : {"torch_dtype", "dtype"}) {
      if (wrapper.contains(key) && wrapper[key].is_string()) c->torch_dtype = wrapper[key].get<std::string>();
    }
    const char* keys[] = {"image_token_id", "video_token_id", "audio_token_id"};
    for (int i = 0; i < 3; ++i) {
      if (wrapper.contains(keys[i]) && wrapper[keys[i]].is_null()) continue;  // none of that kind
      ASSIGN_OR_RETURN(const int64_t id, Integer(wrapper, keys[i], "", kDefaultPlaceholders[i]));
      g.placeholder_tokens.push_back(id);
    }
    if (c->pad_token_id < 0) {
      return Refuse(name("pad_token_id"),
                    "null: transformers' Gemma4Model embeds the image, video and audio placeholders as "
                    "pad_token_id and fails without one");
    }
  }
  RETURN_IF_ERROR(ParseGemma4Spans(t, where, c));
  RETURN_IF_ERROR(ParseGemma4LayerSizes(t, where, c));
  return ParseGemma4Rope(t, where, c);
}

absl::Status CheckGemma4(const ModelConfig& c) {
  auto bad = [](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("config: ", field, " ", why));
  };
  const Gemma4Fields& g = c.gemma4;
  if (!c.is_gemma4()) {
    if (g.full_head_dim != 0 || g.full_kv_heads != 0 || g.k_eq_v || g.ple_dim != 0 || g.kv_shared_layers != 0 ||
        g.double_wide_mlp || !g.placeholder_tokens.empty()) {
      return bad("gemma4 fields", absl::StrCat("are gemma4's only, not ", ModelTypeName(c.family), "'s"));
    }
    return absl::OkStatus();
  }
  const int64_t layers = c.num_hidden_layers;
  if (c.IsSlidingLayer(layers - 1)) {  // what transformers would load is another model
    return bad("layer_types", "ends in sliding_attention; Gemma4TextConfig makes the last layer full_attention");
  }
  for (const auto& [field, v] : {std::pair<const char*, int64_t>{"full-attention head_dim", c.LayerHeadDim(layers - 1)},
                                 {"full-attention num_key_value_heads", c.LayerKvHeads(layers - 1)}}) {
    if (v <= 0 || v > 4096) return bad(field, absl::StrCat("must be in [1, 4096], got ", v));
  }
  if (c.LayerHeadDim(layers - 1) % 2 != 0) return bad("full-attention head_dim", "must be even for RoPE");
  if (c.num_attention_heads % c.LayerKvHeads(layers - 1) != 0) {
    return bad("full-attention num_key_value_heads",
               absl::StrCat(c.LayerKvHeads(layers - 1), " does not divide num_attention_heads ", c.num_attention_heads));
  }
  if (g.ple_dim < 0 || g.ple_dim > 65536) return bad("hidden_size_per_layer_input", "must be in [0, 65536]");
  if (g.ple_dim > 0 && (g.ple_vocab < c.vocab_size || g.ple_vocab > (int64_t{1} << 31))) {
    // Both tables are indexed by the same token ids.
    return bad("vocab_size_per_layer_input",
               absl::StrCat(g.ple_vocab, " must be at least vocab_size ", c.vocab_size, " (and at most 2^31)"));
  }
  if (g.ple_dim > 0 && static_cast<double>(g.ple_vocab) * layers * g.ple_dim > 1e13) {
    return bad("embed_tokens_per_layer", "exceeds this build's limit of 1e13 parameters");
  }
  if (g.kv_shared_layers < 0 || g.kv_shared_layers >= layers) {
    return bad("num_kv_shared_layers", absl::StrCat(g.kv_shared_layers, " must be in [0, num_hidden_layers ", layers,
                                                    ") (a shared layer reuses an earlier layer's keys and values)"));
  }
  for (int64_t l = layers - g.kv_shared_layers; l < layers; ++l) {
    if (c.KvSourceLayer(l) < 0) {
      return bad("num_kv_shared_layers",
                 absl::StrCat(g.kv_shared_layers, ": shared layer ", l, " (", SpanName(c.IsSlidingLayer(l) ?
                              AttentionSpan::kSliding : AttentionSpan::kFull), ") has no earlier layer of its type "
                              "to take keys and values from (transformers fails on it)"));
    }
  }
  for (const Gemma4Rope* r : {&g.full_rope, &g.sliding_rope}) {
    if (!(r->fraction >= 0 && r->fraction <= 1)) {
      return bad("rope_parameters.partial_rotary_factor", absl::StrCat("must be in [0, 1], got ", r->fraction));
    }
    if (!(r->factor > 0 && r->factor <= 1e6)) {
      return bad("rope_parameters.factor", absl::StrCat("must be in (0, 1e6], got ", r->factor));
    }
  }
  if (!(c.rope_theta >= 1 && c.rope_theta <= 1e15) || !(c.sliding_rope_theta >= 1 && c.sliding_rope_theta <= 1e15)) {
    return bad("rope_parameters.rope_theta", "must be in [1, 1e15]");
  }
  if (c.rope_scaling.type != RopeScaling::Type::kNone || c.sliding_rope_scaling.type != RopeScaling::Type::kNone) {
    return bad("rope_scaling",
               "is not applied to gemma4 (its RoPEs are rope_parameters' default and proportional types)");
  }
  if (c.partial_rotary_factor != 1 || c.query_pre_attn_scalar != 0) {
    return bad("partial_rotary_factor / query_pre_attn_scalar", "are not gemma4's (its RoPE: rope_parameters)");
  }
  if (!(c.final_logit_softcapping >= 0) || !(c.final_logit_softcapping <= 1e9)) {
    return bad("final_logit_softcapping", absl::StrCat("must be in (0, 1e9] (0: none), got ", c.final_logit_softcapping));
  }
  if (c.pad_token_id < -1 || c.pad_token_id >= c.vocab_size) {
    return bad("pad_token_id", absl::StrCat(c.pad_token_id, " is outside the vocabulary [0, ", c.vocab_size, ")"));
  }
  if (c.multimodal && c.pad_token_id < 0) return bad("pad_token_id", "is needed by gemma4's multimodal model");
  return absl::OkStatus();
}

std::vector<float> Gemma4InverseFrequencies(const ModelConfig& c, AttentionSpan span) {
  // The layer type's head_dim: LayerHeadDim of a layer of that type.
  const bool sliding = span == AttentionSpan::kSliding;
  const int64_t hd = sliding ? c.head_dim : (c.gemma4.full_head_dim > 0 ? c.gemma4.full_head_dim : c.head_dim);
  const Gemma4Rope& r = sliding ? c.gemma4.sliding_rope : c.gemma4.full_rope;
  const double theta = sliding && c.has_sliding_rope() ? c.sliding_rope_theta : c.rope_theta;
  const int64_t half = hd / 2;
  // proportional: rope_angles = int(partial_rotary_factor * head_dim // 2) pairs at
  // base ** (arange(0, 2 * rope_angles, 2).float() / head_dim), zeros after, all / factor (float32).
  const int64_t rotated =
      r.proportional ? std::clamp<int64_t>(static_cast<int64_t>(std::floor(r.fraction * hd / 2.0)), 0, half) : half;
  std::vector<float> inv(half, 0.0f);
  for (int64_t i = 0; i < rotated; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(hd);
    inv[i] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  if (r.proportional && r.factor != 1) {
    for (float& f : inv) f = f / static_cast<float>(r.factor);
  }
  return inv;
}

namespace {

nlohmann::ordered_json RopeObject(const Gemma4Rope& r, double theta) {
  nlohmann::ordered_json o = {{"rope_type", r.proportional ? "proportional" : "default"}, {"rope_theta", theta}};
  if (r.proportional) {
    o["partial_rotary_factor"] = r.fraction;
    if (r.factor != 1) o["factor"] = r.factor;
  }
  return o;
}

}  // namespace

void WriteGemma4Fields(const ModelConfig& c, nlohmann::ordered_json& t) {
  const Gemma4Fields& g = c.gemma4;
  t["hidden_activation"] = "gelu_pytorch_tanh";
  t["final_logit_softcapping"] =
      c.final_logit_softcapping > 0 ? nlohmann::ordered_json(c.final_logit_softcapping) : nlohmann::ordered_json();
  t["pad_token_id"] = c.pad_token_id >= 0 ? nlohmann::ordered_json(c.pad_token_id) : nlohmann::ordered_json();
  t["attention_k_eq_v"] = g.k_eq_v;
  t["num_kv_shared_layers"] = g.kv_shared_layers;
  t["use_double_wide_mlp"] = g.double_wide_mlp;
  t["enable_moe_block"] = false;
  t["hidden_size_per_layer_input"] = g.ple_dim;
  if (g.ple_dim > 0) t["vocab_size_per_layer_input"] = g.ple_vocab;
  // Both spellings of the full layers' sizes: transformers 5.15+ reads per_layer_config (keys
  // zero-padded as it writes them) and ignores global_head_dim beside it; earlier 5.x read
  // global_head_dim and num_global_key_value_heads (the kv heads only under attention_k_eq_v).
  const int64_t full_hd = g.full_head_dim > 0 ? g.full_head_dim : c.head_dim;
  const int64_t full_kv = g.full_kv_heads > 0 ? g.full_kv_heads : c.num_key_value_heads;
  nlohmann::ordered_json plc = nlohmann::ordered_json::object();
  const int digits = static_cast<int>(absl::StrCat(c.num_hidden_layers - 1).size());
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.IsSlidingLayer(l)) continue;
    nlohmann::ordered_json o = nlohmann::ordered_json::object();
    if (full_hd != c.head_dim) o["head_dim"] = full_hd;
    if (full_kv != c.num_key_value_heads) o["num_key_value_heads"] = full_kv;
    if (o.empty()) continue;
    std::string key = absl::StrCat(l);
    key.insert(0, static_cast<size_t>(std::max<int>(0, digits - static_cast<int>(key.size()))), '0');
    plc[key] = o;
  }
  t["per_layer_config"] = plc;
  t["global_head_dim"] = full_hd;
  if (g.k_eq_v) {
    t["num_global_key_value_heads"] = full_kv;
  } else {
    t.erase("num_global_key_value_heads");
  }
}

void WriteGemma4Rope(const ModelConfig& c, nlohmann::ordered_json& t) {
  nlohmann::ordered_json p = nlohmann::ordered_json::object();
  if (c.NumSlidingLayers() > 0) p["sliding_attention"] = RopeObject(c.gemma4.sliding_rope, c.sliding_rope_theta);
  p["full_attention"] = RopeObject(c.gemma4.full_rope, c.rope_theta);
  t["rope_parameters"] = p;
}

// The released Gemma 4 language models (google/gemma-4-<size>-it / its base checkpoint share the
// config.json; docs/model-families.md lists the copies each field was read from), and the CI-sized one.
// All: vocabulary 262,144, head_dim 256 on sliding layers and 512 on full ones, RoPE theta 1e4 sliding
// (default) and 1e6 full (proportional, a quarter of the pairs), eps 1e-6, tied embeddings, logits
// capped at 30, pad 0, bfloat16.
bool Gemma4Preset(absl::string_view name, ModelConfig* c) {
  struct Shape {
    const char* name;
    int64_t hidden, layers, heads, kv_heads, full_kv_heads, intermediate, ple_dim, kv_shared, window, max_positions;
    int64_t pattern;  // a full layer after pattern - 1 sliding ones
    bool k_eq_v, double_wide;
  };
  static constexpr Shape kHub[] = {
      {"gemma4-e2b", 1536, 35, 8, 1, 1, 6144, 256, 20, 512, 131072, 5, false, true},       // google/gemma-4-E2B
      {"gemma4-e4b", 2560, 42, 8, 2, 2, 10240, 256, 18, 512, 131072, 6, false, false},     // google/gemma-4-E4B
      {"gemma4-31b", 5376, 60, 32, 16, 4, 21504, 0, 0, 1024, 262144, 6, true, false},      // google/gemma-4-31B
  };
  *c = ModelConfig{};
  c->family = ModelFamily::kGemma4;
  c->vocab_size = 262144;
  c->head_dim = 256;
  c->gemma4.full_head_dim = 512;
  c->rope_theta = 1e6;
  c->sliding_rope_theta = 1e4;
  c->gemma4.full_rope = Gemma4Rope{true, 0.25, 1};
  c->rms_norm_eps = 1e-6;
  c->tie_word_embeddings = true;
  c->final_logit_softcapping = 30;
  c->pad_token_id = 0;
  c->torch_dtype = "bfloat16";
  int64_t pattern = 0;
  const auto* hub = std::find_if(std::begin(kHub), std::end(kHub), [&](const Shape& s) { return name == s.name; });
  if (hub != std::end(kHub)) {
    c->hidden_size = hub->hidden;
    c->num_hidden_layers = hub->layers;
    c->num_attention_heads = hub->heads;
    c->num_key_value_heads = hub->kv_heads;
    c->gemma4.full_kv_heads = hub->full_kv_heads;
    c->intermediate_size = hub->intermediate;
    c->gemma4.ple_dim = hub->ple_dim;
    c->gemma4.ple_vocab = hub->ple_dim > 0 ? 262144 : 0;
    c->gemma4.kv_shared_layers = hub->kv_shared;
    c->gemma4.k_eq_v = hub->k_eq_v;
    c->gemma4.double_wide_mlp = hub->double_wide;
    c->sliding_window = hub->window;
    c->max_position_embeddings = hub->max_positions;
    pattern = hub->pattern;
  } else if (name == "tiny-gemma4") {
    // CI-sized, with every piece the released checkpoints use: six layers (sliding, sliding, full)
    // twice, a window of 16, full layers of head_dim 32 with one kv head whose values are its keys'
    // projection (31B's attention_k_eq_v), per-layer inputs of 8 (E2B / E4B's), the last two layers
    // reading layers 3's and 2's keys and values with MLPs twice as wide (E2B's sharing).
    c->hidden_size = 64;
    c->num_hidden_layers = 6;
    c->num_attention_heads = 4;
    c->num_key_value_heads = 2;
    c->head_dim = 16;
    c->gemma4.full_head_dim = 32;
    c->gemma4.full_kv_heads = 1;
    c->gemma4.k_eq_v = true;
    c->intermediate_size = 128;
    c->vocab_size = 512;
    c->gemma4.ple_dim = 8;
    c->gemma4.ple_vocab = 512;
    c->gemma4.kv_shared_layers = 2;
    c->gemma4.double_wide_mlp = true;
    c->sliding_window = 16;
    c->max_position_embeddings = 4096;
    c->torch_dtype = "float32";
    pattern = 3;
  } else {
    return false;
  }
  for (int64_t l = 0; l < c->num_hidden_layers; ++l) {
    c->layer_spans.push_back((l + 1) % pattern != 0 ? AttentionSpan::kSliding : AttentionSpan::kFull);
  }
  c->layer_spans.back() = AttentionSpan::kFull;
  return true;
}

void AddGemma4DecoderTensors(const ModelConfig& c, int64_t layer, const AddDecoderTensor& add) {
  const std::string p = absl::StrCat(c.WeightPrefix(), "layers.", layer, ".");
  const int64_t h = c.hidden_size, hd = c.LayerHeadDim(layer), q_dim = c.num_attention_heads * hd;
  const int64_t kv_dim = c.LayerKvHeads(layer) * hd, inter = c.LayerIntermediate(layer), ple = c.gemma4.ple_dim;
  const bool own_kv = c.KvSourceLayer(layer) < 0;
  const bool values = own_kv && !(c.gemma4.k_eq_v && !c.IsSlidingLayer(layer));
  add(kInputNorm, p + "input_layernorm.weight", {h}, true);
  add(kQProj, p + "self_attn.q_proj.weight", {q_dim, h}, false);
  if (own_kv) add(kKProj, p + "self_attn.k_proj.weight", {kv_dim, h}, false);
  if (values) add(kVProj, p + "self_attn.v_proj.weight", {kv_dim, h}, false);
  add(kOProj, p + "self_attn.o_proj.weight", {h, q_dim}, false);
  add(kQNorm, p + "self_attn.q_norm.weight", {hd}, true);
  if (own_kv) add(kKNorm, p + "self_attn.k_norm.weight", {hd}, true);
  add(kPostNorm, p + "post_attention_layernorm.weight", {h}, true);
  add(kPreFfnNorm, p + "pre_feedforward_layernorm.weight", {h}, true);
  add(kPostFfnNorm, p + "post_feedforward_layernorm.weight", {h}, true);
  add(kGateProj, p + "mlp.gate_proj.weight", {inter, h}, false);
  add(kUpProj, p + "mlp.up_proj.weight", {inter, h}, false);
  add(kDownProj, p + "mlp.down_proj.weight", {h, inter}, false);
  if (ple > 0) {
    add(kPleGate, p + "per_layer_input_gate.weight", {ple, h}, false);
    add(kPleProj, p + "per_layer_projection.weight", {h, ple}, false);
    add(kPlePostNorm, p + "post_per_layer_input_norm.weight", {h}, true);
  }
  add(kLayerScalar, p + "layer_scalar", {1}, true).trainable = false;  // nn.Buffer: never trained
  if (layer == 0 && ple > 0) {
    add(kPleModelProj, c.WeightPrefix() + "per_layer_model_projection.weight", {c.num_hidden_layers * ple, h}, false);
    add(kPleModelNorm, c.WeightPrefix() + "per_layer_projection_norm.weight", {ple}, true);
  }
}

}  // namespace config_internal
}  // namespace slidedp
