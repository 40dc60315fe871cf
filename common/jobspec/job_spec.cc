// Strict YAML job-spec parsing with yaml-cpp (a maintained YAML 1.2 parser; JSON is a subset).
#include "common/jobspec/job_spec.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/io/json_depth.h"
#include "common/io/small_file.h"
#include "common/model/model_dir.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "common/status/utf8_prefix.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace slidedp {
namespace {

namespace fs = std::filesystem;
// Reads one key's value into a section of the spec (`Sec`: one of JobSpec's sections, or JobSpec
// itself for the top-level name).
template <typename Sec>
using SetterOf = std::function<absl::Status(const YAML::Node&, const std::string& path, Sec&)>;
using Setter = SetterOf<JobSpec>;

absl::Status TypeError(const std::string& path, const char* want, const YAML::Node& n) {
  std::string got = n.IsScalar()     ? absl::StrCat("'", n.Scalar(), "'")
                    : n.IsSequence() ? "a list"
                    : n.IsMap()      ? "a map"
                                     : "null";
  return absl::InvalidArgumentError(absl::StrCat(path, ": expected ", want, ", got ", got));
}

template <typename T>
absl::Status ReadScalar(const YAML::Node& n, const std::string& path, const char* want, T* out) {
  if (!n.IsScalar()) return TypeError(path, want, n);
  try {
    *out = n.as<T>();
  } catch (const YAML::Exception&) {
    return TypeError(path, want, n);
  }
  return absl::OkStatus();
}

template <typename Sec>
SetterOf<Sec> Int(int64_t Sec::*field, int64_t min_value) {
  return [field, min_value](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    int64_t v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "an integer", &v));
    if (v < min_value) return absl::InvalidArgumentError(absl::StrCat(path, ": must be >= ", min_value, ", got ", v));
    s.*field = v;
    return absl::OkStatus();
  };
}

template <typename Sec>
SetterOf<Sec> Int32(int32_t Sec::*field, int32_t min_value) {
  return [field, min_value](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    int32_t v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "an integer", &v));
    if (v < min_value) return absl::InvalidArgumentError(absl::StrCat(path, ": must be >= ", min_value, ", got ", v));
    s.*field = v;
    return absl::OkStatus();
  };
}

// runtime.tile_tokens: `auto` (0) or a token count of at least kMinTileTokens.
SetterOf<RuntimeSection> TileTokens() {
  return [](const YAML::Node& n, const std::string& path, RuntimeSection& s) -> absl::Status {
    if (n.IsScalar() && n.Scalar() == "auto") {
      s.tile_tokens = 0;
      return absl::OkStatus();
    }
    int64_t v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "auto or a token count", &v));
    if (v < kMinTileTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": must be auto or at least ", kMinTileTokens, " tokens, got ", v));
    }
    s.tile_tokens = v;
    return absl::OkStatus();
  };
}

template <typename Sec>
SetterOf<Sec> U64(uint64_t Sec::*field) {
  return [field](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    int64_t v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "a non-negative integer", &v));
    if (v < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": must be >= 0, got ", v));
    s.*field = static_cast<uint64_t>(v);
    return absl::OkStatus();
  };
}

template <typename Sec>
SetterOf<Sec> Real(double Sec::*field, double min_value, double max_value) {
  return [=](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    double v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "a number", &v));
    if (!(v >= min_value && v <= max_value)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: must be in [%.10g, %.10g], got %.10g", path, min_value, max_value, v));
    }
    s.*field = v;
    return absl::OkStatus();
  };
}

template <typename Sec>
SetterOf<Sec> Str(std::string Sec::*field) {
  return [field](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    std::string v;
    RETURN_IF_ERROR(ReadScalar(n, path, "a string", &v));
    if (v.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": must not be empty"));
    s.*field = v;
    return absl::OkStatus();
  };
}

template <typename Sec>
SetterOf<Sec> Bool(bool Sec::*field) {
  return [field](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    return ReadScalar(n, path, "true or false", &(s.*field));
  };
}

// runtime.gpu_memory_limit: bytes (an integer above 1, or a number with a unit: B, KB, MB, GB, TB
// in powers of 1000, KiB, MiB, GiB, TiB in powers of 1024) or a fraction of the device's memory in
// (0, 1].
SetterOf<RuntimeSection> MemoryLimit() {
  return [](const YAML::Node& n, const std::string& path, RuntimeSection& s) -> absl::Status {
    std::string text;
    RETURN_IF_ERROR(ReadScalar(n, path, "bytes (e.g. 40GiB) or a fraction in (0, 1]", &text));
    text = std::string(absl::StripAsciiWhitespace(text));
    size_t unit_at = text.size();
    while (unit_at > 0 && absl::ascii_isalpha(static_cast<unsigned char>(text[unit_at - 1]))) --unit_at;
    const std::string number(absl::StripAsciiWhitespace(text.substr(0, unit_at)));
    const std::string unit = absl::AsciiStrToLower(text.substr(unit_at));
    double v = 0;
    auto bad = [&] {
      return absl::InvalidArgumentError(absl::StrCat(path,
                                                     ": expected bytes (e.g. 40GiB, 42949672960) or a fraction of "
                                                     "the device's memory in (0, 1], got '",
                                                     text, "'"));
    };
    if (number.empty() || !absl::SimpleAtod(number, &v) || !std::isfinite(v) || v <= 0) return bad();
    static const std::vector<std::pair<std::string, double>> kUnits = {
        {"b", 1},           {"kb", 1e3},           {"mb", 1e6},
        {"gb", 1e9},        {"tb", 1e12},          {"kib", 1024.0},
        {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
    double scale = 0;
    for (const auto& [name, factor] : kUnits) scale = unit == name ? factor : scale;
    if (unit.empty() && v <= 1) {
      s.gpu_memory_limit_fraction = v;
      s.gpu_memory_limit_bytes = 0;
      return absl::OkStatus();
    }
    if (!unit.empty() && scale == 0) return bad();
    const double bytes = v * (unit.empty() ? 1 : scale);
    if (bytes < kMinGpuMemoryLimitBytes || bytes > 9.0e18) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: %s is %.6g bytes; a limit must be in [%d (1 MiB), 9e18]",
                                                        path, text, bytes, kMinGpuMemoryLimitBytes));
    }
    s.gpu_memory_limit_bytes = static_cast<int64_t>(bytes);
    s.gpu_memory_limit_fraction = 0;
    return absl::OkStatus();
  };
}

// runtime.nodes: 2 to kMaxJobNodes distinct hostd addresses.
SetterOf<RuntimeSection> Nodes() {
  return [](const YAML::Node& n, const std::string& path, RuntimeSection& s) -> absl::Status {
    if (!n.IsSequence()) return TypeError(path, "a list of hostd addresses (HOST:PORT or unix:PATH)", n);
    if (n.size() < 2 || n.size() > kMaxJobNodes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", n.size(), " nodes; a job over nodes names 2 to ", kMaxJobNodes, " of them"));
    }
    s.nodes.clear();
    for (size_t i = 0; i < n.size(); ++i) {
      std::string v;
      RETURN_IF_ERROR(ReadScalar(n[i], absl::StrCat(path, "[", i, "]"), "a hostd address", &v));
      RETURN_IF_ERROR(CheckNodeAddress(v, absl::StrCat(path, "[", i, "]")));
      if (std::find(s.nodes.begin(), s.nodes.end(), v) != s.nodes.end()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": '", v, "' is listed twice"));
      }
      s.nodes.push_back(v);
    }
    return absl::OkStatus();
  };
}

// runtime.policy: fixed, auto, or a policy file's path.
SetterOf<RuntimeSection> Policy() {
  return [](const YAML::Node& n, const std::string& path, RuntimeSection& s) -> absl::Status {
    std::string v;
    RETURN_IF_ERROR(ReadScalar(n, path, "fixed, auto or a policy file's path", &v));
    if (v.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": must not be empty"));
    s.policy_auto = v == "auto";
    s.policy_file = v == "fixed" || v == "auto" ? std::string() : v;
    return absl::OkStatus();
  };
}

// runtime.layer_policy: a policy file's content inline (what a resolved spec carries to workers).
SetterOf<RuntimeSection> InlineLayout() {
  return [](const YAML::Node& n, const std::string& path, RuntimeSection& s) -> absl::Status {
    if (!n.IsMap()) return TypeError(path, "a policy (version, model, layers)", n);
    ASSIGN_OR_RETURN(s.layer_layout, LayerLayout::FromNode(n, path));
    return absl::OkStatus();
  };
}

template <typename E, typename Sec>
SetterOf<Sec> Enum(E Sec::*field, std::vector<std::pair<std::string, E>> names) {
  return [field, names](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    std::string v;
    RETURN_IF_ERROR(ReadScalar(n, path, "a string", &v));
    std::vector<std::string> known;
    for (const auto& [name, value] : names) {
      if (name == v) {
        s.*field = value;
        return absl::OkStatus();
      }
      known.push_back(name);
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unknown value '", v, "' (one of: ", absl::StrJoin(known, ", "), ")"));
  };
}

// `auto` sets `flag` (the value is chosen later); any other value goes to `concrete`.
template <typename Sec>
SetterOf<Sec> AutoOr(SetterOf<Sec> concrete, bool Sec::*flag) {
  return [concrete, flag](const YAML::Node& n, const std::string& path, Sec& s) -> absl::Status {
    if (n.IsScalar() && n.Scalar() == "auto") {
      s.*flag = true;
      return absl::OkStatus();
    }
    s.*flag = false;
    return concrete(n, path, s);
  };
}

// model.rope_scaling: a flat map of scalars (HF's rope_scaling object), kept as JSON text; its
// keys and values are checked when the model config applies it (ModelConfig::OverrideContext).
SetterOf<ModelSection> RopeScalingMap() {
  return [](const YAML::Node& n, const std::string& path, ModelSection& s) -> absl::Status {
    if (!n.IsMap()) return TypeError(path, "a map such as {rope_type: yarn, factor: 4.0}", n);
    nlohmann::json j = nlohmann::json::object();
    for (const auto& kv : n) {
      if (!kv.first.IsScalar() || !kv.second.IsScalar()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": expected scalar keys and values"));
      }
      const std::string key = kv.first.Scalar(), v = kv.second.Scalar();
      // The keys some RoPE type reads (ModelConfig's rope parser): a misspelt one would be
      // ignored there, so it is refused here (a model's config.json may carry others).
      static constexpr const char* kKnown[] = {"rope_type",        "type",
                                               "factor",           "original_max_position_embeddings",
                                               "attention_factor", "beta_fast",
                                               "beta_slow",        "mscale",
                                               "mscale_all_dim",   "truncate",
                                               "low_freq_factor",  "high_freq_factor",
                                               "rope_theta",       "partial_rotary_factor"};
      if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown)) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": unknown key '", key.substr(0, 64), "' (known: ", absl::StrJoin(kKnown, ", "), ")"));
      }
      if (j.contains(key)) return absl::InvalidArgumentError(absl::StrCat(path, ".", key, " is given twice"));
      char* end = nullptr;
      errno = 0;
      const long long i = std::strtoll(v.c_str(), &end, 10);
      if (!v.empty() && *end == '\0' && errno == 0) {
        j[key] = static_cast<int64_t>(i);
        continue;
      }
      errno = 0;
      const double d = std::strtod(v.c_str(), &end);
      if (!v.empty() && *end == '\0' && errno == 0) {
        j[key] = d;
      } else if (v == "true" || v == "false") {
        j[key] = v == "true";
      } else {
        j[key] = v;
      }
    }
    s.rope_scaling_json = j.dump();
    return absl::OkStatus();
  };
}

// optimizer.no_decay: a list of tensor groups exempt from weight decay, each at most once.
SetterOf<OptimizerSection> NoDecayGroups() {
  return [](const YAML::Node& n, const std::string& path, OptimizerSection& s) -> absl::Status {
    if (!n.IsSequence()) return TypeError(path, "a list of norm, bias (or [])", n);
    bool norm = false, bias = false;
    for (const YAML::Node& item : n) {
      std::string v;
      RETURN_IF_ERROR(ReadScalar(item, path, "norm or bias", &v));
      if (v != "norm" && v != "bias") {
        return absl::InvalidArgumentError(absl::StrCat(path, ": unknown value '", v, "' (one of: norm, bias)"));
      }
      bool& seen = v == "norm" ? norm : bias;
      if (seen) return absl::InvalidArgumentError(absl::StrCat(path, ": '", v, "' is given twice"));
      seen = true;
    }
    s.no_decay.clear();
    if (norm) s.no_decay.push_back(NoDecay::kNorm);
    if (bias) s.no_decay.push_back(NoDecay::kBias);
    return absl::OkStatus();
  };
}

// One section's keys as setters on the whole spec.
template <typename Sec>
std::map<std::string, Setter> Section(Sec JobSpec::*section,
                                      std::map<std::string, SetterOf<std::type_identity_t<Sec>>> keys) {
  std::map<std::string, Setter> out;
  for (auto& [key, set] : keys) {
    out[key] = [section, set = std::move(set)](const YAML::Node& n, const std::string& path, JobSpec& s) {
      return set(n, path, s.*section);
    };
  }
  return out;
}

// fp32 | bf16 for the keys whose value is a Dtype.
template <typename Sec>
SetterOf<Sec> DtypeKey(Dtype Sec::*field) {
  return Enum<Dtype>(field, {{"fp32", Dtype::kF32}, {"bf16", Dtype::kBF16}});
}

const std::map<std::string, std::map<std::string, Setter>>& Schema() {
  static const auto* schema = new std::map<std::string, std::map<std::string, Setter>>{
      {"model", Section(&JobSpec::model, {{"path", Str(&ModelSection::path)},
                                          {"preset", Str(&ModelSection::preset)},
                                          {"init_seed", U64(&ModelSection::init_seed)},
                                          {"max_position_embeddings", Int(&ModelSection::max_position_embeddings, 1)},
                                          {"num_hidden_layers", Int(&ModelSection::num_hidden_layers, 1)},
                                          {"rope_scaling", RopeScalingMap()}})},
      {"data", Section(&JobSpec::data, {{"path", Str(&DataSection::path)},
                                        {"validation", Str(&DataSection::validation)},
                                        {"tokenizer_check", Bool(&DataSection::tokenizer_check)}})},
      {"output", Section(&JobSpec::output, {{"dir", Str(&OutputSection::dir)},
                                            {"save_every", Int(&OutputSection::save_every, 0)},
                                            {"keep_last", Int(&OutputSection::keep_last, 1)},
                                            {"save_dtype", DtypeKey(&OutputSection::save_dtype)},
                                            {"save_final", Bool(&OutputSection::save_final)},
                                            {"tensorboard", Bool(&OutputSection::tensorboard)},
                                            {"overwrite", Bool(&OutputSection::overwrite)}})},
      {"train",
       Section(&JobSpec::train, {{"seq_len", Int(&TrainSection::seq_len, 1)},
                                 {"global_batch", Int(&TrainSection::global_batch, 1)},
                                 {"micro_batch", Int(&TrainSection::micro_batch, 1)},
                                 {"steps", Int(&TrainSection::steps, 0)},
                                 {"epochs", Real(&TrainSection::epochs, 0, 1e6)},
                                 {"seed", U64(&TrainSection::seed)},
                                 {"eval_every", Int(&TrainSection::eval_every, 0)},
                                 {"max_grad_norm", Real(&TrainSection::max_grad_norm, 0, 1e30)},
                                 {"skip_nonfinite", Bool(&TrainSection::skip_nonfinite)},
                                 {"measure_only", Bool(&TrainSection::measure_only)},
                                 {"router_aux_loss_coef", Real(&TrainSection::router_aux_loss_coef, 0, 1e3)}})},
      {"optimizer", Section(&JobSpec::optimizer, {{"lr", Real(&OptimizerSection::lr, 0, 10)},
                                                  {"beta1", Real(&OptimizerSection::beta1, 0, 0.999999999)},
                                                  {"beta2", Real(&OptimizerSection::beta2, 0, 0.999999999)},
                                                  {"eps", Real(&OptimizerSection::eps, 0, 1)},
                                                  {"weight_decay", Real(&OptimizerSection::weight_decay, 0, 1e3)},
                                                  {"no_decay", NoDecayGroups()},
                                                  {"state_dtype", Enum<MomentForm>(&OptimizerSection::state_dtype,
                                                                                   {{"fp32", MomentForm::kF32},
                                                                                    {"bf16", MomentForm::kBF16},
                                                                                    {"int8", MomentForm::kInt8}})}})},
      {"schedule", Section(&JobSpec::schedule,
                           {{"kind", Enum<ScheduleKind>(&ScheduleSection::kind, {{"constant", ScheduleKind::kConstant},
                                                                                 {"linear", ScheduleKind::kLinear},
                                                                                 {"cosine", ScheduleKind::kCosine}})},
                            {"warmup_steps", Int(&ScheduleSection::warmup_steps, 0)},
                            {"min_lr", Real(&ScheduleSection::min_lr, 0, 10)}})},
      {"runtime",
       Section(
           &JobSpec::runtime,
           {{"backend", Enum<Backend>(&RuntimeSection::backend,
                                      {{"auto", Backend::kAuto}, {"cuda", Backend::kCuda}, {"cpu", Backend::kCpu}})},
            {"workers", Int32(&RuntimeSection::workers, 0)},
            {"chunk_bytes", AutoOr(Int(&RuntimeSection::chunk_bytes, 4096), &RuntimeSection::chunk_bytes_auto)},
            {"param_delivery",
             AutoOr(Enum<ParamDelivery>(&RuntimeSection::param_delivery, {{"replicated", ParamDelivery::kReplicated},
                                                                          {"sharded", ParamDelivery::kSharded}}),
                    &RuntimeSection::param_delivery_auto)},
            {"grad_reduction", AutoOr(Enum<GradReduction>(&RuntimeSection::grad_reduction,
                                                          {{"gpu", GradReduction::kGpu}, {"cpu", GradReduction::kCpu}}),
                                      &RuntimeSection::grad_reduction_auto)},
            {"grad_staging", Enum<GradStaging>(&RuntimeSection::grad_staging, {{"auto", GradStaging::kAuto},
                                                                               {"device", GradStaging::kDevice},
                                                                               {"host", GradStaging::kHost}})},
            {"grad_dtype", DtypeKey(&RuntimeSection::grad_dtype)},
            {"param_source", Enum<ParamSource>(&RuntimeSection::param_source,
                                               {{"mirror", ParamSource::kMirror}, {"master", ParamSource::kMaster}})},
            {"cast_on", Enum<CastOn>(&RuntimeSection::cast_on, {{"device", CastOn::kDevice}, {"host", CastOn::kHost}})},
            {"cast_threads", Int32(&RuntimeSection::cast_threads, 0)},
            {"act_policy",
             Enum<ActivationPolicy>(&RuntimeSection::act_policy, {{"keep_all", ActivationPolicy::kKeepAll},
                                                                  {"recompute", ActivationPolicy::kRecomputeLayer},
                                                                  {"selective", ActivationPolicy::kSelective},
                                                                  {"auto", ActivationPolicy::kAuto}})},
            {"norm_weights", DtypeKey(&RuntimeSection::norm_weights)},
            {"deterministic", Bool(&RuntimeSection::deterministic)},
            {"embedding_rows", DtypeKey(&RuntimeSection::embedding_rows)},
            {"offload_ratio", Real(&RuntimeSection::offload_ratio, 0, 1)},
            {"checkpoint_dtype", DtypeKey(&RuntimeSection::checkpoint_dtype)},
            {"tile_tokens", TileTokens()},
            {"speculation_bytes", Int(&RuntimeSection::speculation_bytes, -1)},
            {"gpu_memory_limit", MemoryLimit()},
            {"policy", Policy()},
            {"layer_policy", InlineLayout()},
            {"copy_priority", Real(&RuntimeSection::copy_priority, 0, 1)},
            {"ring_slots", Int32(&RuntimeSection::ring_slots, 2)},
            {"context_parallel", Int32(&RuntimeSection::context_parallel, 1)},
            {"nodes", Nodes()},
            {"node_state", Enum<NodeState>(&RuntimeSection::node_state,
                                           {{"replicated", NodeState::kReplicated}, {"sharded", NodeState::kSharded}})},
            {"step_timeout_ms", Int(&RuntimeSection::step_timeout_ms, 100)},
            {"max_restarts", Int32(&RuntimeSection::max_restarts, 0)}})},
  };
  return *schema;
}

std::string Resolve(const std::string& base_dir, const std::string& p) {
  if (p.empty()) return p;
  fs::path path(p);
  if (path.is_relative() && !base_dir.empty()) path = fs::path(base_dir) / path;
  return path.lexically_normal().string();
}

}  // namespace

absl::Status CheckNodeAddress(const std::string& address, const std::string& path) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": '", absl::CHexEscape(address.substr(0, 256)),
                                                   "' is not a hostd address (HOST:PORT or unix:PATH): ", why));
  };
  if (address.empty() || address.size() > 1024) return bad("1 to 1024 characters");
  for (unsigned char c : address) {
    if (c < 0x21 || c > 0x7e) return bad("printable ASCII without spaces");
  }
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() < 7 || address[5] != '/') return bad("a Unix socket's path is absolute");
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) return bad("no port");
  std::string host = address.substr(0, colon);
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) return bad("a port in 1-65535");
  if (host.front() == '[') {
    if (host.back() != ']' || host.size() < 4) return bad("an IPv6 address in brackets");
    for (char c : host.substr(1, host.size() - 2)) {
      if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) && c != ':' && c != '.') return bad("an IPv6 address");
    }
    return absl::OkStatus();
  }
  if (host.size() > 253) return bad("a host name of at most 253 characters");
  for (char c : host) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' && c != '_') {
      return bad("a host name of letters, digits, '-', '_' and '.'");
    }
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<JobSpec> ParseUnchecked(absl::string_view yaml_text, const std::string& base_dir,
                                       JobSpec::FileCheck check_files, JobSpec::OutputDirBase output_base);
}  // namespace

// yaml-cpp throws on conversions it cannot do (e.g. a map used as a key, found by the fuzzer);
// every exception becomes INVALID_ARGUMENT with its position.
absl::StatusOr<JobSpec> JobSpec::Parse(absl::string_view yaml_text, const std::string& base_dir, FileCheck check_files,
                                       OutputDirBase output_base) {
  try {
    return ParseUnchecked(yaml_text, base_dir, check_files, output_base);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: line ", e.mark.line + 1, ", column ", e.mark.column + 1,
                                                   ": ", e.msg, " (keys must be plain strings)"));
  }
}

namespace {
// The spec's text as one YAML map: bounded, UTF-8, one document.
absl::StatusOr<YAML::Node> ReadRoot(absl::string_view yaml_text) {
  if (yaml_text.size() > kMaxSpecBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec is ", yaml_text.size(), " bytes; the limit is ", kMaxSpecBytes));
  }
  if (const size_t bad = FirstInvalidUtf8(yaml_text); bad != yaml_text.size()) {
    return absl::InvalidArgumentError(absl::StrCat("job spec is not UTF-8 text: invalid byte 0x",
                                                   absl::Hex(static_cast<uint8_t>(yaml_text[bad])), " at offset ",
                                                   bad));
  }
  YAML::Node root;
  try {
    // One document: a second one (after `---`) would otherwise be dropped unread.
    std::vector<YAML::Node> docs = YAML::LoadAll(std::string(yaml_text));
    if (docs.size() > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec holds ", docs.size(), " YAML documents (separated by ---); give one"));
    }
    if (!docs.empty()) root = docs[0];
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec is not valid YAML: line ", e.mark.line + 1, ", column ",
                                                   e.mark.column + 1, ": ", e.msg));
  }
  if (!root.IsMap()) return absl::InvalidArgumentError("job spec: the top level must be a map of sections");
  return root;
}

// Each section's keys through the schema: unknown or repeated keys refused naming the line.
absl::StatusOr<JobSpec> ReadSections(const YAML::Node& root) {
  JobSpec s;
  s.data.validation = "auto";  // a spec's default; a JobSpec made in code has none
  const auto& schema = Schema();
  std::set<std::string> seen;  // YAML allows a key twice (the last would win): refused
  for (const auto& kv : root) {
    if (!kv.first.IsScalar()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec: line ", kv.first.Mark().line + 1, ": keys must be plain strings, not a map or list"));
    }
    std::string section = kv.first.as<std::string>();
    if (!seen.insert(section).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec: line ", kv.first.Mark().line + 1, ": '", section, "' is given twice"));
    }
    if (section == "name") {
      RETURN_IF_ERROR(Str(&JobSpec::name)(kv.second, "name", s));
      continue;
    }
    auto sec = schema.find(section);
    if (sec == schema.end()) {
      std::vector<std::string> known = {"name"};
      for (const auto& [k, v] : schema) known.push_back(k);
      return absl::InvalidArgumentError(
          absl::StrCat("job spec: unknown key '", section, "' (known: ", absl::StrJoin(known, ", "), ")"));
    }
    if (!kv.second.IsMap()) return TypeError(section, "a map", kv.second);
    for (const auto& field : kv.second) {
      if (!field.first.IsScalar()) {
        return absl::InvalidArgumentError(absl::StrCat("job spec: in '", section, "', line ",
                                                       field.first.Mark().line + 1,
                                                       ": keys must be plain strings, not a map or list"));
      }
      std::string key = field.first.as<std::string>();
      std::string path = absl::StrCat(section, ".", key);
      if (!seen.insert(path).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("job spec: line ", field.first.Mark().line + 1, ": '", path, "' is given twice"));
      }
      auto f = sec->second.find(key);
      if (f == sec->second.end()) {
        std::vector<std::string> known;
        for (const auto& [k, v] : sec->second) known.push_back(k);
        return absl::InvalidArgumentError(absl::StrCat("job spec: unknown key '", path, "' (known in ", section, ": ",
                                                       absl::StrJoin(known, ", "), ")"));
      }
      RETURN_IF_ERROR(f->second(field.second, path, s));
    }
  }

  return s;
}

// What no key alone can check: the name, required keys, the batch against micro-batches and context
// groups, the schedule against the steps, the route choices.
// runtime.nodes: what the first multi-node build runs (docs/multi-node.md); the rest refused by key.
absl::Status CheckMultiNode(const JobSpec& s) {
  const RuntimeSection& r = s.runtime;
  if (r.workers <= 0) {
    return absl::InvalidArgumentError(
        "job spec: runtime.nodes needs runtime.workers > 0: the ranks each node runs (the same on every node)");
  }
  if (r.grad_reduction_auto || r.param_delivery_auto || r.chunk_bytes_auto) {
    return absl::InvalidArgumentError(
        "job spec: runtime.nodes takes no `auto` routes (grad_reduction, param_delivery, chunk_bytes): each node "
        "would measure its own; name them");
  }
  if (r.grad_reduction == GradReduction::kCpu && r.workers > 1) {
    return absl::InvalidArgumentError(
        "job spec: runtime.nodes with several workers per node needs runtime.grad_reduction gpu: a node's ranks "
        "reduce their gradients before the nodes add theirs");
  }
  if (r.context_parallel > 1) {
    return absl::InvalidArgumentError("job spec: runtime.nodes with runtime.context_parallel is not built");
  }
  if (!s.data.validation.empty() && s.data.validation != "auto" && s.data.validation != "none") {
    return absl::InvalidArgumentError("job spec: runtime.nodes with data.validation is not built");
  }
  if (r.policy_auto || r.act_policy == ActivationPolicy::kAuto) {
    return absl::InvalidArgumentError(
        "job spec: runtime.nodes needs the same layer policies on every node: a fixed act_policy or policy file, "
        "not auto");
  }
  if (r.node_state == NodeState::kSharded && r.grad_staging == GradStaging::kHost) {
    return absl::InvalidArgumentError(
        "job spec: runtime.node_state sharded clips on the devices (each rank posts its squared norm, the nodes add "
        "theirs); runtime.grad_staging host would need the whole gradient on one host");
  }
  const int64_t ranks = static_cast<int64_t>(r.workers) * static_cast<int64_t>(r.nodes.size());
  if (s.train.global_batch % (ranks * s.train.micro_batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: train.global_batch ", s.train.global_batch,
                                                   " is not divisible by the ranks of all nodes x train.micro_batch = ",
                                                   ranks, " x ", s.train.micro_batch));
  }
  return absl::OkStatus();
}

absl::Status CheckAcrossKeys(const JobSpec& s) {
  RETURN_IF_ERROR(ValidateJobName(s.name));
  // Cross-field checks.
  if (s.model.path.empty() == s.model.preset.empty()) {
    return absl::InvalidArgumentError(
        "job spec: give exactly one of model.path (a HF model directory) or model.preset");
  }
  if (s.model.num_hidden_layers > 0 && s.model.preset.empty()) {
    return absl::InvalidArgumentError(
        "job spec: model.num_hidden_layers reduces a preset's depth; a model.path model has the layers its weights "
        "have");
  }
  if (s.data.path.empty()) return absl::InvalidArgumentError("job spec: data.path is required");
  if (s.train.seq_len == 0) return absl::InvalidArgumentError("job spec: train.seq_len is required");
  if (s.train.global_batch == 0) return absl::InvalidArgumentError("job spec: train.global_batch is required");
  if ((s.train.steps > 0) == (s.train.epochs > 0)) {
    return absl::InvalidArgumentError("job spec: give exactly one of train.steps or train.epochs (> 0)");
  }
  if (s.train.global_batch % s.train.micro_batch != 0) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: train.global_batch ", s.train.global_batch,
                                                   " is not a multiple of train.micro_batch ", s.train.micro_batch));
  }
  // A micro-batch indexes its tokens with int32 (cu_seqlens, positions: common/data/batch.h).
  if (s.train.seq_len > std::numeric_limits<int32_t>::max() / s.train.micro_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: train.micro_batch x train.seq_len = ", s.train.micro_batch, " x ", s.train.seq_len,
                     " is over ", std::numeric_limits<int32_t>::max(), " tokens, the most one micro-batch holds"));
  }
  if (s.runtime.context_parallel > 1) {
    if (s.runtime.workers < s.runtime.context_parallel || s.runtime.workers % s.runtime.context_parallel != 0) {
      return absl::InvalidArgumentError(absl::StrCat("job spec: runtime.context_parallel ", s.runtime.context_parallel,
                                                     " needs runtime.workers a multiple of it (got ", s.runtime.workers,
                                                     "): each group of that many workers splits its micro-batches"));
    }
    if (static_cast<int64_t>(s.train.micro_batch) * s.train.seq_len < 2 * int64_t{s.runtime.context_parallel}) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec: runtime.context_parallel ", s.runtime.context_parallel, " splits a micro-batch into ",
                       2 * int64_t{s.runtime.context_parallel}, " chunks; train.micro_batch x train.seq_len is ",
                       int64_t{s.train.micro_batch} * s.train.seq_len));
    }
    if (s.runtime.act_policy == ActivationPolicy::kAuto || s.runtime.policy_auto) {
      return absl::InvalidArgumentError(
          "job spec: runtime.context_parallel needs the same layer policies on every rank: a fixed act_policy or "
          "policy file, not auto (each rank would choose from its own measurements)");
    }
  }
  const int64_t dp_ranks =
      s.runtime.context_parallel > 1 ? s.runtime.workers / s.runtime.context_parallel : s.runtime.workers;
  if (s.runtime.context_parallel > 1 && s.train.global_batch % (dp_ranks * s.train.micro_batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: train.global_batch ", s.train.global_batch,
        " is not divisible by the data-parallel ranks x train.micro_batch = ", dp_ranks, " x ", s.train.micro_batch));
  }
  if (s.runtime.context_parallel == 1 && s.runtime.workers > 0 &&
      s.train.global_batch % (int64_t{s.runtime.workers} * s.train.micro_batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: train.global_batch ", s.train.global_batch,
        " is not divisible by runtime.workers x train.micro_batch = ", s.runtime.workers, " x ", s.train.micro_batch));
  }
  // (With runtime.workers 0 the count is known when the job starts: the job plan refuses it then.)
  if (!s.runtime.nodes.empty()) RETURN_IF_ERROR(CheckMultiNode(s));
  if (s.runtime.node_state == NodeState::kSharded && s.runtime.nodes.empty()) {
    return absl::InvalidArgumentError(
        "job spec: runtime.node_state sharded splits the host state over runtime.nodes; this job names no nodes");
  }
  if (s.runtime.grad_staging == GradStaging::kDevice && s.runtime.grad_reduction == GradReduction::kCpu &&
      !s.runtime.grad_reduction_auto && s.runtime.workers > 1) {
    return absl::InvalidArgumentError(
        "job spec: runtime.grad_staging device needs runtime.grad_reduction gpu (or one worker): with "
        "grad_reduction cpu hostd sums the ranks' gradients, so only it knows the norm");
  }
  if (s.runtime.cast_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: runtime.cast_threads ", s.runtime.cast_threads, " is more than 256 (0: auto)"));
  }
  if (s.train.steps > 0 && s.schedule.warmup_steps > s.train.steps) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: schedule.warmup_steps ", s.schedule.warmup_steps,
                                                   " exceeds train.steps ", s.train.steps));
  }
  if (!(s.optimizer.eps > 0)) {
    // AdamW divides by sqrt(v) + eps: with 0 an element whose gradient is always 0 (padding between
    // tensors, an unused embedding row) becomes 0/0 = NaN.
    return absl::InvalidArgumentError(absl::StrCat("job spec: optimizer.eps must be > 0, got ", s.optimizer.eps));
  }
  if (s.schedule.min_lr > s.optimizer.lr) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: schedule.min_lr ", s.schedule.min_lr, " exceeds optimizer.lr ", s.optimizer.lr));
  }
  return absl::OkStatus();
}

// The paths: text checked, resolved against the spec's directory, the validation split found, the
// policy file loaded, and (kCheck) the files there.
absl::Status ResolvePaths(JobSpec& s, const std::string& base_dir, JobSpec::FileCheck check_files,
                          JobSpec::OutputDirBase output_base) {
  if (s.output.dir.empty()) s.output.dir = absl::StrCat("out/", s.name);

  if (!base_dir.empty()) RETURN_IF_ERROR(CheckPathText(base_dir, "the spec's directory (base_dir)"));
  for (const auto& [path, key] : {std::pair<const std::string*, const char*>{&s.model.path, "model.path"},
                                  {&s.data.path, "data.path"},
                                  {&s.output.dir, "output.dir"},
                                  {&s.runtime.policy_file, "runtime.policy"}}) {
    if (!path->empty()) RETURN_IF_ERROR(CheckPathText(*path, absl::StrCat("job spec: ", key)));
  }
  if (s.data.validation != "auto" && s.data.validation != "none" && !s.data.validation.empty()) {
    RETURN_IF_ERROR(CheckPathText(s.data.validation, "job spec: data.validation"));
  }
  s.model.path = Resolve(base_dir, s.model.path);
  s.data.path = Resolve(base_dir, s.data.path);
  if (s.data.validation == "auto") {
    // `slidedp prepare` writes <output>/train and <output>/validation: a training split named
    // train/ with a validation/ beside it that holds a dataset is validated on.
    const fs::path data(s.data.path);
    const fs::path sibling = data.parent_path() / "validation";
    std::error_code ec;
    const bool split =
        (data.filename() == "train" || (data.filename().empty() && data.parent_path().filename() == "train"));
    s.data.validation = split && fs::is_regular_file(sibling / "manifest.json", ec) ? sibling.string() : std::string();
    if (!s.data.validation.empty() && !s.runtime.nodes.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("job spec: runtime.nodes with data.validation is not built (",
                                                     s.data.path, " has a validation split beside it; set "
                                                     "data.validation: none)"));
    }
  } else if (s.data.validation == "none") {
    s.data.validation.clear();
  } else if (!s.data.validation.empty()) {
    s.data.validation = Resolve(base_dir, s.data.validation);
  }
  if (s.train.eval_every > 0 && s.data.validation.empty() && check_files == JobSpec::FileCheck::kCheck) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: train.eval_every ", s.train.eval_every,
                                                   " but no validation split: data.validation names none and ",
                                                   s.data.path, " has no validation/ beside it"));
  }
  if (output_base == JobSpec::OutputDirBase::kBaseDir) s.output.dir = Resolve(base_dir, s.output.dir);
  if (!s.runtime.policy_file.empty()) s.runtime.policy_file = Resolve(base_dir, s.runtime.policy_file);
  if (s.runtime.policy_auto &&
      (s.runtime.act_policy != ActivationPolicy::kRecomputeLayer || s.runtime.offload_ratio > 0)) {
    return absl::InvalidArgumentError(
        "job spec: runtime.policy auto chooses every layer's activations and offload itself; remove "
        "runtime.act_policy and runtime.offload_ratio (or use runtime.policy: fixed)");
  }
  if (s.train.measure_only && !s.runtime.policy_auto) {
    return absl::InvalidArgumentError(
        "job spec: train.measure_only measures AutoPolicy's layout: it needs runtime.policy auto");
  }
  if (check_files == JobSpec::FileCheck::kCheck && !s.runtime.policy_file.empty() && !s.runtime.layer_layout) {
    auto layout = LayerLayout::Load(s.runtime.policy_file);
    if (!layout.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("runtime.policy: ", layout.status().message()));
    }
    s.runtime.layer_layout = std::move(*layout);
  }
  if (check_files == JobSpec::FileCheck::kCheck) {
    // The non-throwing forms: a path too long or unreadable is "not there", never an exception.
    std::error_code ec;
    if (!s.model.path.empty() && !fs::exists(fs::path(s.model.path) / "config.json", ec)) {
      return absl::InvalidArgumentError(absl::StrCat("model.path: no config.json in ", s.model.path));
    }
    if (!fs::is_directory(s.data.path, ec)) {
      return absl::InvalidArgumentError(absl::StrCat("data.path: ", s.data.path, " is not a directory"));
    }
    if (!s.data.validation.empty() && !fs::is_directory(s.data.validation, ec)) {
      return absl::InvalidArgumentError(absl::StrCat("data.validation: ", s.data.validation, " is not a directory"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<JobSpec> ParseUnchecked(absl::string_view yaml_text, const std::string& base_dir,
                                       JobSpec::FileCheck check_files, JobSpec::OutputDirBase output_base) {
  ASSIGN_OR_RETURN(YAML::Node root, ReadRoot(yaml_text));
  ASSIGN_OR_RETURN(JobSpec s, ReadSections(root));
  RETURN_IF_ERROR(CheckAcrossKeys(s));
  RETURN_IF_ERROR(ResolvePaths(s, base_dir, check_files, output_base));
  return s;
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfigOf(const JobSpec& spec) {
  absl::StatusOr<ModelConfig> c = !spec.model.preset.empty() ? ModelConfig::Preset(spec.model.preset)
                                                             : ModelConfig::FromFile(spec.model.path + "/config.json");
  if (!c.ok()) return c.status();
  if (spec.model.num_hidden_layers > 0) {
    if (spec.model.num_hidden_layers > c->num_hidden_layers) {
      return absl::InvalidArgumentError(absl::StrCat("model.num_hidden_layers ", spec.model.num_hidden_layers, ": ",
                                                     spec.model.preset, " has ", c->num_hidden_layers,
                                                     " (the key only reduces a preset's depth)"));
    }
    RETURN_IF_ERROR(c->ReduceDepth(spec.model.num_hidden_layers));
  }
  // Names the directory's weights decide (experts fused or per expert, gemma3's hub spelling): the
  // layout's names follow the directory's, so its checkpoints keep them.
  if (spec.model.preset.empty()) RETURN_IF_ERROR(AdoptDirNaming(spec.model.path, &*c));
  if (spec.model.max_position_embeddings > 0 || !spec.model.rope_scaling_json.empty()) {
    RETURN_IF_ERROR(c->OverrideContext(spec.model.max_position_embeddings, spec.model.rope_scaling_json));
  }
  return c;
}

}  // namespace slidedp
