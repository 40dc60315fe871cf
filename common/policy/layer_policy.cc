// Per-layer activation layouts and their policy files; see layer_policy.h.
#include "common/policy/layer_policy.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
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

// A value read from the file, fit to quote in an error: a short name or number. hostd reads the
// file as its own user wherever the client points, so anything else (which could be the first
// bytes of a file the client cannot read) is not echoed back.
std::string Shown(const std::string& v) {
  const bool plain = !v.empty() && v.size() <= 32 && std::all_of(v.begin(), v.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
  return plain ? absl::StrCat("'", v, "'") : std::string("(a value not shown)");
}

absl::Status Bad(const std::string& what, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("policy file ", what, ": ", why));
}

absl::StatusOr<int64_t> PositiveInt(const YAML::Node& n, const std::string& what, const std::string& key) {
  if (!n.IsScalar()) return Bad(what, absl::StrCat(key, ": expected a positive integer"));
  int64_t v = 0;
  try {
    v = n.as<int64_t>();
  } catch (const YAML::Exception&) {
    return Bad(what, absl::StrCat(key, ": expected a positive integer, got ", Shown(n.Scalar())));
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
    if (!known) return Bad(what, absl::StrCat(where, "unknown key ", Shown(k)));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> NonNegDouble(const YAML::Node& n, const std::string& what, const std::string& key) {
  double v = -1;
  if (n && n.IsScalar()) {
    try {
      v = n.as<double>();
    } catch (const YAML::Exception&) {
      v = -1;
    }
  }
  if (!(v >= 0) || !std::isfinite(v)) return Bad(what, absl::StrCat(key, ": expected a number >= 0"));
  return v;
}

absl::StatusOr<int64_t> NonNegInt(const YAML::Node& n, const std::string& what, const std::string& key) {
  if (n && n.IsScalar() && n.Scalar() == "0") return 0;
  return PositiveInt(n, what, key);
}

absl::StatusOr<LayerKind> KindOf(const YAML::Node& kind, const std::string& what, const std::string& at) {
  if (!kind || !kind.IsScalar()) {
    return Bad(what, absl::StrCat(at, "kind missing (recompute, selective, segment, keep_all)"));
  }
  const std::string k = kind.Scalar();
  if (k == "recompute") return LayerKind::kRecompute;
  if (k == "selective") return LayerKind::kSelective;
  if (k == "keep_all") return LayerKind::kKeepAll;
  if (k == "segment") return LayerKind::kSegment;
  return Bad(what, absl::StrCat(at, "kind ", Shown(k), " (recompute, selective, segment, keep_all)"));
}

// `offload`: true (1), false (0), or a share in [0, 1].
absl::StatusOr<double> OffloadOf(const YAML::Node& o, const std::string& what, const std::string& at) {
  if (!o) return 0.0;
  const std::string bad = absl::StrCat(at, "offload: expected true, false or a share in [0, 1]");
  if (!o.IsScalar()) return Bad(what, bad);
  bool flag = false;
  if (YAML::convert<bool>::decode(o, flag)) return flag ? 1.0 : 0.0;
  double r = 0;
  if (!absl::SimpleAtod(o.Scalar(), &r) || !std::isfinite(r) || r < 0 || r > 1) return Bad(what, bad);
  return r;
}

// A segment's `keep: [qkv, attention, o_proj, gate_up]` (at least one, each once).
absl::StatusOr<uint32_t> KeepOf(const YAML::Node& k, LayerKind kind, const std::string& what, const std::string& at) {
  if (kind != LayerKind::kSegment) {
    if (k) return Bad(what, absl::StrCat(at, "keep: only a segment layer names the pieces it keeps"));
    return 0u;
  }
  if (!k || !k.IsSequence() || k.size() == 0 || k.size() > 4) {
    return Bad(what, absl::StrCat(at,
                                  "keep: a segment needs a list of the pieces it keeps (qkv, attention, o_proj, "
                                  "gate_up)"));
  }
  uint32_t mask = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    const std::string name = k[i].IsScalar() ? k[i].Scalar() : std::string("?");
    uint32_t bit = 0;
    for (const LayerPieceName& p : kLayerPieceNames) {
      if (name == p.name) bit = p.piece;
    }
    if (bit == 0)
      return Bad(what, absl::StrCat(at, "keep: ", Shown(name), " is not a piece (qkv, attention, o_proj, gate_up)"));
    if (mask & bit) return Bad(what, absl::StrCat(at, "keep: ", Shown(name), " twice"));
    mask |= bit;
  }
  return mask;
}

struct BaseField {
  const char* name;
  double StepBase::*field;
};
constexpr BaseField kBaseFields[] = {
    {"compute_s", &StepBase::compute_s},
    {"h2d_s", &StepBase::h2d_s},
    {"d2h_s", &StepBase::d2h_s},
    {"host_s", &StepBase::host_s},
    {"exposed_s", &StepBase::exposed_s},
    {"h2d_bytes_per_s", &StepBase::h2d_bytes_per_s},
    {"d2h_bytes_per_s", &StepBase::d2h_bytes_per_s},
};
struct CandidateBytes {
  const char* name;
  int64_t LayerCandidate::*field;
};
constexpr CandidateBytes kCandidateBytes[] = {{"device_bytes", &LayerCandidate::device_bytes},
                                              {"host_bytes", &LayerCandidate::host_bytes},
                                              {"h2d_bytes", &LayerCandidate::h2d_bytes},
                                              {"d2h_bytes", &LayerCandidate::d2h_bytes},
                                              {"in_flight_bytes", &LayerCandidate::in_flight_bytes}};

// The autopolicy: section (AutoPolicyRecord).
absl::StatusOr<AutoPolicyRecord> RecordFromNode(const YAML::Node& n, int64_t layers, const std::string& what) {
  if (!n.IsMap()) return Bad(what, "autopolicy: expected a map");
  RETURN_IF_ERROR(OnlyKeys(n,
                           {"build", "working_set_bytes", "capacity_bytes", "selection_s", "device_budget_bytes",
                            "host_budget_bytes", "base", "candidates", "predicted"},
                           what, "autopolicy: "));
  AutoPolicyRecord r;
  if (const YAML::Node b = n["build"]; b && b.IsScalar() && b.Scalar().size() <= 256) r.build = b.Scalar();
  ASSIGN_OR_RETURN(r.working_set_bytes, NonNegInt(n["working_set_bytes"], what, "autopolicy.working_set_bytes"));
  ASSIGN_OR_RETURN(r.capacity_bytes, NonNegInt(n["capacity_bytes"], what, "autopolicy.capacity_bytes"));
  ASSIGN_OR_RETURN(r.selection_s, NonNegDouble(n["selection_s"], what, "autopolicy.selection_s"));
  r.problem.layers = layers;
  ASSIGN_OR_RETURN(r.problem.device_budget_bytes,
                   NonNegInt(n["device_budget_bytes"], what, "autopolicy.device_budget_bytes"));
  if (n["host_budget_bytes"]) {
    ASSIGN_OR_RETURN(r.problem.host_budget_bytes,
                     NonNegInt(n["host_budget_bytes"], what, "autopolicy.host_budget_bytes"));
  }
  const YAML::Node base = n["base"];
  if (!base || !base.IsMap()) return Bad(what, "autopolicy.base: expected a map");
  for (const BaseField& f : kBaseFields) {
    ASSIGN_OR_RETURN(r.problem.base.*f.field,
                     NonNegDouble(base[f.name], what, absl::StrCat("autopolicy.base.", f.name)));
  }
  const YAML::Node cands = n["candidates"];
  if (!cands || !cands.IsSequence() || cands.size() == 0 || cands.size() > 128) {
    return Bad(what, "autopolicy.candidates: expected a list of 1 to 128 candidates");
  }
  for (size_t i = 0; i < cands.size(); ++i) {
    const YAML::Node c = cands[i];
    const std::string at = absl::StrCat("autopolicy.candidates[", i, "]: ");
    if (!c.IsMap()) return Bad(what, absl::StrCat(at, "expected a map"));
    RETURN_IF_ERROR(OnlyKeys(
        c, {"kind", "offload", "keep", "time_s", "device_bytes", "host_bytes", "h2d_bytes", "d2h_bytes", "in_flight_bytes",
         "forward_s"},
        what, at));
    LayerCandidate lc;
    ASSIGN_OR_RETURN(lc.policy.kind, KindOf(c["kind"], what, at));
    ASSIGN_OR_RETURN(lc.policy.offload, OffloadOf(c["offload"], what, at));
    ASSIGN_OR_RETURN(lc.policy.keep, KeepOf(c["keep"], lc.policy.kind, what, at));
    ASSIGN_OR_RETURN(lc.time_s, NonNegDouble(c["time_s"], what, absl::StrCat(at, "time_s")));
    if (c["forward_s"]) {
      ASSIGN_OR_RETURN(lc.forward_s, NonNegDouble(c["forward_s"], what, absl::StrCat(at, "forward_s")));
    }
    for (const CandidateBytes& f : kCandidateBytes) {
      if (!c[f.name]) continue;  // 0
      ASSIGN_OR_RETURN(lc.*f.field, NonNegInt(c[f.name], what, absl::StrCat(at, f.name)));
    }
    r.problem.candidates.push_back(lc);
  }
  const YAML::Node p = n["predicted"];
  if (!p || !p.IsMap() || !p["counts"] || !p["counts"].IsSequence() || p["counts"].size() != cands.size()) {
    return Bad(what, "autopolicy.predicted: expected a map with one count per candidate");
  }
  for (size_t i = 0; i < cands.size(); ++i) {
    ASSIGN_OR_RETURN(const int64_t c, NonNegInt(p["counts"][i], what, "autopolicy.predicted.counts"));
    r.predicted.counts.push_back(c);
  }
  ASSIGN_OR_RETURN(r.predicted.step_s, NonNegDouble(p["step_s"], what, "autopolicy.predicted.step_s"));
  RETURN_IF_ERROR(OnlyKeys(p, {"counts", "step_s", "bottleneck"}, what, "autopolicy.predicted: "));
  if (const YAML::Node b = p["bottleneck"]; b && b.IsScalar() && b.Scalar().size() <= 64) {
    r.predicted.bottleneck = b.Scalar();
  }
  return r;
}

void EmitKeep(YAML::Emitter& e, const LayerPolicy& p) {
  if (p.kind != LayerKind::kSegment) return;
  e << YAML::Key << "keep" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (const LayerPieceName& n : kLayerPieceNames) {
    if (p.keep & n.piece) e << n.name;
  }
  e << YAML::EndSeq;
}

void EmitRecord(YAML::Emitter& e, const AutoPolicyRecord& r) {
  e << YAML::Key << "autopolicy" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "build" << YAML::Value << r.build;
  e << YAML::Key << "working_set_bytes" << YAML::Value << r.working_set_bytes;
  e << YAML::Key << "capacity_bytes" << YAML::Value << r.capacity_bytes;
  e << YAML::Key << "selection_s" << YAML::Value << r.selection_s;
  e << YAML::Key << "device_budget_bytes" << YAML::Value << r.problem.device_budget_bytes;
  if (r.problem.host_budget_bytes >= 0) {
    e << YAML::Key << "host_budget_bytes" << YAML::Value << r.problem.host_budget_bytes;
  }
  e << YAML::Key << "base" << YAML::Value << YAML::Flow << YAML::BeginMap;
  for (const BaseField& f : kBaseFields) e << YAML::Key << f.name << YAML::Value << r.problem.base.*f.field;
  e << YAML::EndMap;
  e << YAML::Key << "candidates" << YAML::Value << YAML::BeginSeq;
  for (const LayerCandidate& c : r.problem.candidates) {
    e << YAML::Flow << YAML::BeginMap << YAML::Key << "kind" << YAML::Value << LayerKindName(c.policy.kind);
    EmitKeep(e, c.policy);
    e << YAML::Key << "offload" << YAML::Value << c.policy.offload;
    e << YAML::Key << "time_s" << YAML::Value << c.time_s;
    if (c.forward_s > 0) e << YAML::Key << "forward_s" << YAML::Value << c.forward_s;
    for (const CandidateBytes& f : kCandidateBytes) {
      if (c.*f.field != 0) e << YAML::Key << f.name << YAML::Value << c.*f.field;
    }
    e << YAML::EndMap;
  }
  e << YAML::EndSeq;
  e << YAML::Key << "predicted" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "counts" << YAML::Value << YAML::Flow << r.predicted.counts;
  e << YAML::Key << "step_s" << YAML::Value << r.predicted.step_s;
  e << YAML::Key << "bottleneck" << YAML::Value << r.predicted.bottleneck;
  e << YAML::EndMap << YAML::EndMap;
}

}  // namespace

const char* LayerKindName(LayerKind k) {
  switch (k) {
    case LayerKind::kRecompute: return "recompute";
    case LayerKind::kSelective: return "selective";
    case LayerKind::kSegment: return "segment";
    case LayerKind::kKeepAll: return "keep_all";
  }
  return "recompute";
}

uint32_t LayerPolicy::pieces() const {
  switch (kind) {
    case LayerKind::kRecompute: return 0;
    case LayerKind::kSelective: return kPieceAttention;
    case LayerKind::kSegment: return keep & kExpensivePieces;
    case LayerKind::kKeepAll: return kAllPieces;
  }
  return 0;
}

std::string LayerPolicyName(const LayerPolicy& p) {
  std::string out = LayerKindName(p.kind);
  if (p.kind == LayerKind::kSegment) out += "(" + LayerPiecesName(p.keep) + ")";
  if (p.offload >= 1) {
    out += "+offload";
  } else if (p.offload > 0) {
    out += absl::StrCat("+offload(", p.offload, ")");
  }
  return out;
}

int64_t KeptElementsPerToken(const ModelShape& m, uint32_t pieces) {
  if (!m.layers_keep_pieces()) return 0;
  const int64_t qd = m.num_attention_heads * m.head_dim, kvd = m.num_key_value_heads * m.head_dim;
  int64_t n = 0;
  if (pieces & kPieceQkv) n += qd + 2 * kvd;                        // q, k, v before their norms
  if (pieces & kPieceAttention) n += qd + m.num_attention_heads;    // the output and its log-sum-exp
  if (pieces & kPieceOProj) n += m.hidden_size;                     // h1
  if (pieces & kPieceGateUp) {
    const int64_t k = m.num_experts_per_tok;
    const int64_t moe = m.num_experts > 0 ? m.num_experts + 5 * k + k * (2 * m.moe_intermediate_size + m.hidden_size) : 0;
    n += std::max(2 * m.intermediate_size, moe);  // gate, up; or a sparse layer's routing and experts
  }
  // The norms' outputs and rsqrt, q/k after their norms and RoPE.
  if (pieces & kPieceCheap) n += 2 + 2 * m.hidden_size + m.num_attention_heads + m.num_key_value_heads + qd + kvd;
  return n;
}

int64_t CudaKeptBytesPerToken(const ModelShape& m, uint32_t pieces, int64_t residual_bytes) {
  if (!m.layers_keep_pieces()) return 0;
  const int64_t qd = m.num_attention_heads * m.head_dim, kvd = m.num_key_value_heads * m.head_dim;
  const int64_t H = m.hidden_size, I = m.intermediate_size;
  int64_t n = 0;
  if ((pieces & kPieceQkv) == kPieceQkv) n += 2 * (qd + 2 * kvd);
  if ((pieces & kPieceAttention) == kPieceAttention) n += 2 * qd + 4 * m.num_attention_heads;  // o, lse
  if ((pieces & kPieceOProj) == kPieceOProj) n += residual_bytes * H;                           // h1
  if ((pieces & kPieceGateUp) == kPieceGateUp) n += 2 * 2 * I;
  // xn1, qr, kr, xn2, act (BF16); rstd1, rstd2 (FP32)
  if ((pieces & kPieceCheap) == kPieceCheap) n += 2 * (H + qd + kvd + H + I) + 4 * 2;
  return n;
}

ModelShape ModelShape::Of(const ModelConfig& c) {
  ModelShape m{ModelTypeName(c.family), c.hidden_size,       c.num_hidden_layers, c.num_attention_heads,
               c.num_key_value_heads,   c.head_dim,          c.intermediate_size, c.vocab_size};
  if (c.is_moe()) {
    m.num_experts = c.num_experts;
    m.num_experts_per_tok = c.num_experts_per_tok;
    m.moe_intermediate_size = c.moe_intermediate_size;
  }
  return m;
}

bool ModelShape::operator==(const ModelShape& o) const {
  if (model_type != o.model_type) return false;
  for (const ShapeField& f : kShapeFields) {
    if (this->*f.field != o.*f.field) return false;
  }
  return num_experts == o.num_experts && num_experts_per_tok == o.num_experts_per_tok &&
         moe_intermediate_size == o.moe_intermediate_size;
}

bool ModelShape::layers_keep_pieces() const {
  for (const ModelFamily f : {ModelFamily::kQwen3_5, ModelFamily::kQwen3_5Moe, ModelFamily::kGemma3, ModelFamily::kGemma4}) {
    if (model_type == ModelTypeName(f)) return false;
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
  RETURN_IF_ERROR(OnlyKeys(root, {"version", "model", "device", "tokens_per_step", "layers", "autopolicy"}, what, ""));
  if (!root["version"]) return Bad(what, "no version (this build reads version 1)");
  ASSIGN_OR_RETURN(const int64_t version, PositiveInt(root["version"], what, "version"));
  if (version != 1) return Bad(what, absl::StrCat("version ", version, " (this build reads version 1)"));
  LayerLayout l;
  const YAML::Node model = root["model"];
  if (!model || !model.IsMap()) return Bad(what, "model: expected a map of the model's sizes");
  std::initializer_list<const char*> shape_keys = {"model_type",          "hidden_size",       "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                                   "intermediate_size",   "vocab_size"};
  RETURN_IF_ERROR(OnlyKeys(model, shape_keys, what, "model: "));
  if (const YAML::Node t = model["model_type"]) {
    if (!t.IsScalar() || t.Scalar().empty() || t.Scalar().size() > 32) {
      return Bad(what, "model.model_type: expected the HF model_type (qwen3, qwen2, llama, mistral)");
    }
    l.model.model_type = t.Scalar();
  }
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
    RETURN_IF_ERROR(OnlyKeys(e, {"kind", "offload", "keep"}, what, at));
    LayerPolicy p;
    ASSIGN_OR_RETURN(p.kind, KindOf(e["kind"], what, at));
    ASSIGN_OR_RETURN(p.offload, OffloadOf(e["offload"], what, at));
    ASSIGN_OR_RETURN(p.keep, KeepOf(e["keep"], p.kind, what, at));
    l.layers.push_back(p);
  }
  if (static_cast<int64_t>(l.layers.size()) != l.model.num_hidden_layers) {
    return Bad(what, absl::StrCat("layers: ", l.layers.size(), " entries for model.num_hidden_layers ",
                                  l.model.num_hidden_layers));
  }
  if (const YAML::Node r = root["autopolicy"]) {
    ASSIGN_OR_RETURN(l.autopolicy, RecordFromNode(r, l.model.num_hidden_layers, what));
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
  e << YAML::Key << "model_type" << YAML::Value << model.model_type;
  for (const ShapeField& f : kShapeFields) e << YAML::Key << f.name << YAML::Value << model.*f.field;
  e << YAML::EndMap;
  if (!device.empty()) e << YAML::Key << "device" << YAML::Value << device;
  if (tokens_per_step > 0) e << YAML::Key << "tokens_per_step" << YAML::Value << tokens_per_step;
  e << YAML::Key << "layers" << YAML::Value << YAML::BeginSeq;
  for (const LayerPolicy& p : layers) {
    e << YAML::Flow << YAML::BeginMap << YAML::Key << "kind" << YAML::Value << LayerKindName(p.kind);
    EmitKeep(e, p);
    if (p.offload >= 1) {
      e << YAML::Key << "offload" << YAML::Value << true;
    } else if (p.offload > 0) {
      e << YAML::Key << "offload" << YAML::Value << p.offload;
    }
    e << YAML::EndMap;
  }
  e << YAML::EndSeq;
  if (autopolicy) EmitRecord(e, *autopolicy);
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

absl::Status LayerLayout::CheckModel(const ModelConfig& config) const {
  const ModelShape have = ModelShape::Of(config);
  if (model.model_type != have.model_type) {
    return absl::FailedPreconditionError(absl::StrCat("runtime.policy was made for model.model_type ", model.model_type,
                                                      ", this job's model is ", have.model_type));
  }
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
