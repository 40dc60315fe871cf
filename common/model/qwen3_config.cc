// Qwen3 config parsing/serialization and the streamed-unit layout.
#include "common/model/qwen3_config.h"

#include "common/io/small_file.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "nlohmann/json.hpp"

namespace slidedp {
namespace {

int64_t AlignUp(int64_t n) { return (n + kTensorAlignNumel - 1) / kTensorAlignNumel * kTensorAlignNumel; }

void AddTensor(UnitLayout& unit, std::string name, std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const bool norm = shape.size() == 1;
  unit.tensors.push_back(TensorSlot{std::move(name), std::move(shape), unit.numel, numel, norm ? unit.fp32_numel : -1});
  unit.numel += AlignUp(numel);
  if (norm) unit.fp32_numel += (numel + kFp32SideAlignNumel - 1) / kFp32SideAlignNumel * kFp32SideAlignNumel;
}

}  // namespace

absl::Status Qwen3Config::Validate() const {
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
  if (!(rope_theta > 0)) return absl::InvalidArgumentError("config: rope_theta must be > 0");
  if (!(rms_norm_eps > 0)) return absl::InvalidArgumentError("config: rms_norm_eps must be > 0");
  if (vocab_size > (int64_t{1} << 31)) return absl::InvalidArgumentError("config: vocab_size too large");
  return absl::OkStatus();
}

absl::StatusOr<Qwen3Config> Qwen3Config::FromJson(absl::string_view json_text) {
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("config.json: not a JSON object");
  if (j.contains("model_type") && j["model_type"] != "qwen3") {
    return absl::InvalidArgumentError(absl::StrCat("config.json: model_type ", j["model_type"].dump(),
                                                   " is not supported (supported: \"qwen3\")"));
  }
  Qwen3Config c;
  auto get_int = [&](const char* key, int64_t* out, bool required) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) return absl::InvalidArgumentError(absl::StrCat("config.json: missing \"", key, "\""));
      return absl::OkStatus();
    }
    if (!j[key].is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: \"", key, "\" must be an integer, got ", j[key].dump()));
    }
    *out = j[key].get<int64_t>();
    return absl::OkStatus();
  };
  auto get_double = [&](const char* key, double* out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_number()) {
      return absl::InvalidArgumentError(absl::StrCat("config.json: \"", key, "\" must be a number, got ", j[key].dump()));
    }
    *out = j[key].get<double>();
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(get_int("hidden_size", &c.hidden_size, true));
  RETURN_IF_ERROR(get_int("num_hidden_layers", &c.num_hidden_layers, true));
  RETURN_IF_ERROR(get_int("num_attention_heads", &c.num_attention_heads, true));
  c.num_key_value_heads = c.num_attention_heads;
  RETURN_IF_ERROR(get_int("num_key_value_heads", &c.num_key_value_heads, false));
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  RETURN_IF_ERROR(get_int("head_dim", &c.head_dim, false));
  RETURN_IF_ERROR(get_int("intermediate_size", &c.intermediate_size, true));
  RETURN_IF_ERROR(get_int("vocab_size", &c.vocab_size, true));
  RETURN_IF_ERROR(get_int("max_position_embeddings", &c.max_position_embeddings, false));
  RETURN_IF_ERROR(get_double("rope_theta", &c.rope_theta));
  RETURN_IF_ERROR(get_double("rms_norm_eps", &c.rms_norm_eps));
  RETURN_IF_ERROR(get_double("initializer_range", &c.initializer_range));
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean()) {
      return absl::InvalidArgumentError("config.json: \"tie_word_embeddings\" must be a boolean");
    }
    c.tie_word_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) c.torch_dtype = j["torch_dtype"];
  if (j.contains("attention_bias") && j["attention_bias"].is_boolean() && j["attention_bias"].get<bool>()) {
    return absl::InvalidArgumentError("config.json: attention_bias=true is not supported for qwen3");
  }
  // transformers 5 writes RoPE settings as rope_parameters {rope_type, rope_theta}; older
  // configs use rope_theta and rope_scaling. Only plain ("default") RoPE is supported.
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    const nlohmann::json& r = j[key];
    if (!r.is_object()) return absl::InvalidArgumentError(absl::StrCat("config.json: \"", key, "\" must be an object"));
    std::string type = r.contains("rope_type") && r["rope_type"].is_string() ? r["rope_type"].get<std::string>()
                       : r.contains("type") && r["type"].is_string()     ? r["type"].get<std::string>()
                                                                          : "default";
    if (type != "default") {
      return absl::InvalidArgumentError(absl::StrCat("config.json: ", key, ".rope_type \"", type,
                                                     "\" is not supported (only default RoPE)"));
    }
    if (r.contains("rope_theta")) {
      if (!r["rope_theta"].is_number()) return absl::InvalidArgumentError("config.json: rope_theta must be a number");
      c.rope_theta = r["rope_theta"].get<double>();
    }
  }
  RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::StatusOr<Qwen3Config> Qwen3Config::FromFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxConfigFileBytes, "model config"));
  auto c = FromJson(text);
  if (!c.ok()) return Annotate(c.status(), path);
  return c;
}

std::string Qwen3Config::ToJson() const {
  nlohmann::ordered_json j;
  j["architectures"] = {"Qwen3ForCausalLM"};
  j["model_type"] = "qwen3";
  j["hidden_size"] = hidden_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["intermediate_size"] = intermediate_size;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rope_theta"] = rope_theta;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["rope_scaling"] = nullptr;
  j["use_cache"] = true;
  j["torch_dtype"] = torch_dtype;
  j["bos_token_id"] = 151643;
  j["eos_token_id"] = 151645;
  return j.dump(2) + "\n";
}

absl::StatusOr<Qwen3Config> Qwen3Config::Preset(absl::string_view name) {
  Qwen3Config c;
  c.vocab_size = 151936;
  c.head_dim = 128;
  c.num_key_value_heads = 8;
  auto set = [&](int64_t h, int64_t l, int64_t nh, int64_t inter, bool tied) {
    c.hidden_size = h;
    c.num_hidden_layers = l;
    c.num_attention_heads = nh;
    c.intermediate_size = inter;
    c.tie_word_embeddings = tied;
  };
  if (name == "qwen3-0.6b") {
    set(1024, 28, 16, 3072, true);
  } else if (name == "qwen3-1.7b") {
    set(2048, 28, 16, 6144, true);
  } else if (name == "qwen3-4b") {
    set(2560, 36, 32, 9728, true);
  } else if (name == "qwen3-8b") {
    set(4096, 36, 32, 12288, false);
  } else if (name == "qwen3-14b") {
    set(5120, 40, 40, 17408, false);
  } else if (name == "tiny") {
    set(64, 2, 4, 128, true);
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.vocab_size = 512;
    c.max_position_embeddings = 4096;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown model preset \"", name,
                                                   "\" (known: qwen3-0.6b, qwen3-1.7b, qwen3-4b, "
                                                   "qwen3-8b, qwen3-14b, tiny)"));
  }
  return c;
}

std::string TensorIndexString(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] <= 0) return absl::StrCat("[", flat, "]");
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  std::string s = "[";
  for (size_t d = 0; d < index.size(); ++d) absl::StrAppend(&s, d > 0 ? ", " : "", index[d]);
  return s + "]";
}

std::string DescribeUnitElement(const UnitLayout& unit, int64_t offset) {
  const TensorSlot* before = nullptr;
  for (const TensorSlot& t : unit.tensors) {
    if (offset >= t.offset_numel && offset < t.offset_numel + t.numel) {
      return t.hf_name + TensorIndexString(t.shape, offset - t.offset_numel);
    }
    if (t.offset_numel + t.numel <= offset) before = &t;
  }
  return before != nullptr ? absl::StrCat("the padding after ", before->hf_name)
                           : absl::StrCat("element ", offset, " of ", unit.name);
}

void CopyNormsFromMaster(const UnitLayout& unit, const float* master, float* side) {
  for (const TensorSlot& t : unit.tensors) {
    if (t.fp32_offset >= 0) std::copy_n(master + t.offset_numel, t.numel, side + t.fp32_offset);
  }
}

ModelLayout ModelLayout::Build(const Qwen3Config& c) {
  ModelLayout m;
  m.config = c;
  m.head_uses_embedding = c.tie_word_embeddings;
  const int64_t h = c.hidden_size;

  UnitLayout embed;
  embed.kind = UnitKind::kEmbedding;
  embed.name = "embed";
  AddTensor(embed, "model.embed_tokens.weight", {c.vocab_size, h});
  m.units.push_back(std::move(embed));

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    UnitLayout u;
    u.kind = UnitKind::kDecoder;
    u.decoder_layer = static_cast<int>(l);
    u.name = absl::StrCat("layer.", l);
    const std::string p = absl::StrCat("model.layers.", l, ".");
    AddTensor(u, p + "input_layernorm.weight", {h});
    AddTensor(u, p + "self_attn.q_proj.weight", {c.q_dim(), h});
    AddTensor(u, p + "self_attn.k_proj.weight", {c.kv_dim(), h});
    AddTensor(u, p + "self_attn.v_proj.weight", {c.kv_dim(), h});
    AddTensor(u, p + "self_attn.o_proj.weight", {h, c.q_dim()});
    AddTensor(u, p + "self_attn.q_norm.weight", {c.head_dim});
    AddTensor(u, p + "self_attn.k_norm.weight", {c.head_dim});
    AddTensor(u, p + "post_attention_layernorm.weight", {h});
    AddTensor(u, p + "mlp.gate_proj.weight", {c.intermediate_size, h});
    AddTensor(u, p + "mlp.up_proj.weight", {c.intermediate_size, h});
    AddTensor(u, p + "mlp.down_proj.weight", {h, c.intermediate_size});
    m.units.push_back(std::move(u));
  }

  UnitLayout head;
  head.kind = UnitKind::kHead;
  head.name = "head";
  AddTensor(head, "model.norm.weight", {h});
  if (!c.tie_word_embeddings) AddTensor(head, "lm_head.weight", {c.vocab_size, h});
  m.units.push_back(std::move(head));

  for (size_t i = 0; i < m.units.size(); ++i) {
    m.units[i].index = static_cast<int>(i);
    m.total_numel += m.units[i].numel;
  }
  return m;
}

const TensorSlot* ModelLayout::Find(absl::string_view hf_name, int* unit_index) const {
  for (const UnitLayout& u : units) {
    for (const TensorSlot& t : u.tensors) {
      if (t.hf_name == hf_name) {
        if (unit_index) *unit_index = u.index;
        return &t;
      }
    }
  }
  return nullptr;
}

int64_t ModelLayout::param_count() const {
  int64_t n = 0;
  for (const UnitLayout& u : units)
    for (const TensorSlot& t : u.tensors) n += t.numel;
  return n;
}

int ModelLayout::OffloadedLayers(double ratio) const {
  const int layers = static_cast<int>(config.num_hidden_layers);
  return std::clamp(static_cast<int>(std::lround(ratio * layers)), 0, layers);
}

double ModelLayout::ModelFlopsPerToken(int64_t seq_len) const {
  const Qwen3Config& c = config;
  double matmul = static_cast<double>(param_count()) - static_cast<double>(c.vocab_size * c.hidden_size);
  if (c.tie_word_embeddings) matmul += static_cast<double>(c.vocab_size * c.hidden_size);
  return 6.0 * matmul + 6.0 * c.num_hidden_layers * seq_len * c.q_dim();
}

}  // namespace slidedp
