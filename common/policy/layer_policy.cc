// Per-layer activation layouts and their policy files; see layer_policy.h.
#include "common/policy/layer_policy.h"

#include "absl/strings/str_cat.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "yaml-cpp/yaml.h"

namespace slidedp {
namespace {

struct ShapeField {
  const char* name;
  int64_t ModelShape::*field;
};
constexpr ShapeField kShapeFields[] = {
    {"hidden_size", &ModelShape::hidden_size},
    {"num_hidden_layers", &ModelShape::num_hidden_layers},
    {"num_attention_heads", &ModelShape::num_attention_heads},
    {"num_key_value_heads", &ModelShape::num_key_value_heads},
    {"head_dim", &ModelShape::head_dim},
    {"intermediate_size", &ModelShape::intermediate_size},
    {"vocab_size", &ModelShape::vocab_size},
};

absl::Status Bad(const std::string& what, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("policy file ", what, ": ", why));
}

absl::StatusOr<int64_t> PositiveInt(const YAML::Node& n, const std::string& what, const std::string& key) {
  if (!n.IsScalar()) return Bad(what, absl::StrCat(key, ": expected a positive integer"));
  int64_t v = 0;
  try {
    v = n.as<int64_t>();
  } catch (const YAML::Exception&) {
    return Bad(what, absl::StrCat(key, ": expected a positive integer, got '", n.Scalar(), "'"));
  }
  if (v <= 0) return Bad(what, absl::StrCat(key, ": expected a positive integer, got ", v));
  return v;
}

// Unknown keys are refused: a misspelt key must not be a silently ignored one.
absl::Status OnlyKeys(const YAML::Node& map, std::initializer_list<const char*> keys, const std::string& what,
                      const std::string& where) {
  for (const auto& kv : map) {
    const std::string k = kv.first.IsScalar() ? kv.first.Scalar() : std::string("?");
    bool known = false;
    for (const char* allowed : keys) known |= k == allowed;
    if (!known) return Bad(what, absl::StrCat(where, "unknown key '", k, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

const char* LayerKindName(LayerKind k) {
  switch (k) {
    case LayerKind::kRecompute: return "recompute";
    case LayerKind::kSelective: return "selective";
    case LayerKind::kKeepAll: return "keep_all";
  }
  return "recompute";
}

ModelShape ModelShape::Of(const Qwen3Config& c) {
  return {c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
          c.head_dim,    c.intermediate_size, c.vocab_size};
}

bool ModelShape::operator==(const ModelShape& o) const {
  for (const ShapeField& f : kShapeFields) {
    if (this->*f.field != o.*f.field) return false;
  }
  return true;
}

bool LayerLayout::operator==(const LayerLayout& o) const {
  return model == o.model && device == o.device && tokens_per_step == o.tokens_per_step && layers == o.layers;
}

absl::StatusOr<LayerLayout> LayerLayout::Parse(const std::string& text, const std::string& what) {
  if (text.size() > kMaxPolicyFileBytes) {
    return Bad(what, absl::StrCat(text.size(), " bytes, more than ", kMaxPolicyFileBytes));
  }
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return Bad(what, absl::StrCat("not YAML: ", e.what()));
  }
  return FromNode(root, what);
}

absl::StatusOr<LayerLayout> LayerLayout::FromNode(const YAML::Node& root, const std::string& what) {
  if (!root.IsMap()) return Bad(what, "expected a map with version, model and layers");
  RETURN_IF_ERROR(OnlyKeys(root, {"version", "model", "device", "tokens_per_step", "layers"}, what, ""));
  if (!root["version"]) return Bad(what, "no version (this build reads version 1)");
  ASSIGN_OR_RETURN(const int64_t version, PositiveInt(root["version"], what, "version"));
  if (version != 1) return Bad(what, absl::StrCat("version ", version, " (this build reads version 1)"));
  LayerLayout l;
  const YAML::Node model = root["model"];
  if (!model || !model.IsMap()) return Bad(what, "model: expected a map of the model's sizes");
  std::initializer_list<const char*> shape_keys = {"hidden_size",         "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim",          "intermediate_size",
                                                   "vocab_size"};
  RETURN_IF_ERROR(OnlyKeys(model, shape_keys, what, "model: "));
  for (const ShapeField& f : kShapeFields) {
    if (!model[f.name]) return Bad(what, absl::StrCat("model.", f.name, " missing"));
    ASSIGN_OR_RETURN(l.model.*f.field, PositiveInt(model[f.name], what, absl::StrCat("model.", f.name)));
  }
  if (const YAML::Node d = root["device"]) {
    if (!d.IsScalar() || d.Scalar().empty() || d.Scalar().size() > 256) {
      return Bad(what, "device: expected the device's name");
    }
    l.device = d.Scalar();
  }
  if (const YAML::Node t = root["tokens_per_step"]) {
    ASSIGN_OR_RETURN(l.tokens_per_step, PositiveInt(t, what, "tokens_per_step"));
  }
  const YAML::Node layers = root["layers"];
  if (!layers || !layers.IsSequence()) return Bad(what, "layers: expected a list, one entry per decoder layer");
  if (layers.size() > static_cast<size_t>(kMaxPolicyLayers)) {
    return Bad(what, absl::StrCat("layers: ", layers.size(), " entries, more than ", kMaxPolicyLayers));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const YAML::Node e = layers[i];
    const std::string at = absl::StrCat("layers[", i, "]: ");
    if (!e.IsMap()) return Bad(what, absl::StrCat(at, "expected {kind: ..., offload: ...}"));
    RETURN_IF_ERROR(OnlyKeys(e, {"kind", "offload"}, what, at));
    LayerPolicy p;
    const YAML::Node kind = e["kind"];
    if (!kind || !kind.IsScalar()) return Bad(what, absl::StrCat(at, "kind missing (recompute, selective, keep_all)"));
    const std::string k = kind.Scalar();
    if (k == "recompute") {
      p.kind = LayerKind::kRecompute;
    } else if (k == "selective") {
      p.kind = LayerKind::kSelective;
    } else if (k == "keep_all") {
      p.kind = LayerKind::kKeepAll;
    } else {
      return Bad(what, absl::StrCat(at, "kind '", k, "' (recompute, selective, keep_all)"));
    }
    if (const YAML::Node o = e["offload"]) {
      bool v = false;
      try {
        if (!o.IsScalar()) throw YAML::Exception(YAML::Mark(), "not a scalar");
        v = o.as<bool>();
      } catch (const YAML::Exception&) {
        return Bad(what, absl::StrCat(at, "offload: expected true or false"));
      }
      p.offload = v;
    }
    l.layers.push_back(p);
  }
  if (static_cast<int64_t>(l.layers.size()) != l.model.num_hidden_layers) {
    return Bad(what, absl::StrCat("layers: ", l.layers.size(), " entries for model.num_hidden_layers ",
                                  l.model.num_hidden_layers));
  }
  return l;
}

absl::StatusOr<LayerLayout> LayerLayout::Load(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, kMaxPolicyFileBytes, "policy file"));
  return Parse(text, path);
}

std::string LayerLayout::ToYaml() const {
  YAML::Emitter e;
  e << YAML::Comment("slidedp activation policy (runtime.policy; docs/job-spec.md)");
  e << YAML::BeginMap;
  e << YAML::Key << "version" << YAML::Value << 1;
  e << YAML::Key << "model" << YAML::Value << YAML::Flow << YAML::BeginMap;
  for (const ShapeField& f : kShapeFields) e << YAML::Key << f.name << YAML::Value << model.*f.field;
  e << YAML::EndMap;
  if (!device.empty()) e << YAML::Key << "device" << YAML::Value << device;
  if (tokens_per_step > 0) e << YAML::Key << "tokens_per_step" << YAML::Value << tokens_per_step;
  e << YAML::Key << "layers" << YAML::Value << YAML::BeginSeq;
  for (const LayerPolicy& p : layers) {
    e << YAML::Flow << YAML::BeginMap << YAML::Key << "kind" << YAML::Value << LayerKindName(p.kind);
    if (p.offload) e << YAML::Key << "offload" << YAML::Value << true;
    e << YAML::EndMap;
  }
  e << YAML::EndSeq << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

absl::Status LayerLayout::CheckModel(const Qwen3Config& config) const {
  const ModelShape have = ModelShape::Of(config);
  for (const ShapeField& f : kShapeFields) {
    if (model.*f.field != have.*f.field) {
      return absl::FailedPreconditionError(absl::StrCat("runtime.policy was made for model.", f.name, " ",
                                                        model.*f.field, ", this job's model has ", have.*f.field));
    }
  }
  return absl::OkStatus();
}

absl::Status LayerLayout::CheckDevice(const std::string& device_name) const {
  if (device.empty() || device == device_name) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("runtime.policy was made for device '", device, "', this worker's is '", device_name, "'"));
}

}  // namespace slidedp
