// Strict YAML job-spec parsing with yaml-cpp (a maintained YAML 1.2 parser; JSON is a subset).
#include "common/jobspec/job_spec.h"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status/status_macros.h"
#include "common/status/utf8_prefix.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace slidedp {
namespace {

namespace fs = std::filesystem;
using Setter = std::function<absl::Status(const YAML::Node&, const std::string& path, JobSpec&)>;

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

Setter Int(int64_t JobSpec::*field, int64_t min_value) {
  return [field, min_value](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    int64_t v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "an integer", &v));
    if (v < min_value) return absl::InvalidArgumentError(absl::StrCat(path, ": must be >= ", min_value, ", got ", v));
    s.*field = v;
    return absl::OkStatus();
  };
}

Setter Int32(int32_t JobSpec::*field, int32_t min_value) {
  return [field, min_value](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    int32_t v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "an integer", &v));
    if (v < min_value) return absl::InvalidArgumentError(absl::StrCat(path, ": must be >= ", min_value, ", got ", v));
    s.*field = v;
    return absl::OkStatus();
  };
}

// runtime.tile_tokens: `auto` (0) or a token count of at least kMinTileTokens.
Setter TileTokens() {
  return [](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
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

Setter U64(uint64_t JobSpec::*field) {
  return [field](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    int64_t v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "a non-negative integer", &v));
    if (v < 0) return absl::InvalidArgumentError(absl::StrCat(path, ": must be >= 0, got ", v));
    s.*field = static_cast<uint64_t>(v);
    return absl::OkStatus();
  };
}

Setter Real(double JobSpec::*field, double min_value, double max_value) {
  return [=](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    double v = 0;
    RETURN_IF_ERROR(ReadScalar(n, path, "a number", &v));
    if (!(v >= min_value && v <= max_value)) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: must be in [%.10g, %.10g], got %.10g", path, min_value,
                                                        max_value, v));
    }
    s.*field = v;
    return absl::OkStatus();
  };
}

Setter Str(std::string JobSpec::*field) {
  return [field](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    std::string v;
    RETURN_IF_ERROR(ReadScalar(n, path, "a string", &v));
    if (v.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": must not be empty"));
    s.*field = v;
    return absl::OkStatus();
  };
}

Setter Bool(bool JobSpec::*field) {
  return [field](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    return ReadScalar(n, path, "true or false", &(s.*field));
  };
}

// runtime.gpu_memory_limit: bytes (an integer above 1, or a number with a unit: B, KB, MB, GB, TB
// in powers of 1000, KiB, MiB, GiB, TiB in powers of 1024) or a fraction of the device's memory in
// (0, 1].
Setter MemoryLimit() {
  return [](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    std::string text;
    RETURN_IF_ERROR(ReadScalar(n, path, "bytes (e.g. 40GiB) or a fraction in (0, 1]", &text));
    text = std::string(absl::StripAsciiWhitespace(text));
    size_t unit_at = text.size();
    while (unit_at > 0 && absl::ascii_isalpha(static_cast<unsigned char>(text[unit_at - 1]))) --unit_at;
    const std::string number(absl::StripAsciiWhitespace(text.substr(0, unit_at)));
    const std::string unit = absl::AsciiStrToLower(text.substr(unit_at));
    double v = 0;
    auto bad = [&] {
      return absl::InvalidArgumentError(absl::StrCat(path, ": expected bytes (e.g. 40GiB, 42949672960) or a fraction of "
                                                     "the device's memory in (0, 1], got '", text, "'"));
    };
    if (number.empty() || !absl::SimpleAtod(number, &v) || !std::isfinite(v) || v <= 0) return bad();
    static const std::vector<std::pair<std::string, double>> kUnits = {
        {"b", 1},          {"kb", 1e3},       {"mb", 1e6},       {"gb", 1e9},          {"tb", 1e12},
        {"kib", 1024.0},   {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0}};
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

// runtime.policy: fixed, auto, or a policy file's path.
Setter Policy() {
  return [](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    std::string v;
    RETURN_IF_ERROR(ReadScalar(n, path, "fixed, auto or a policy file's path", &v));
    if (v.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": must not be empty"));
    s.policy_auto = v == "auto";
    s.policy_file = v == "fixed" || v == "auto" ? std::string() : v;
    return absl::OkStatus();
  };
}

// runtime.layer_policy: a policy file's content inline (what a resolved spec carries to workers).
Setter InlineLayout() {
  return [](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    if (!n.IsMap()) return TypeError(path, "a policy (version, model, layers)", n);
    ASSIGN_OR_RETURN(s.layer_layout, LayerLayout::FromNode(n, path));
    return absl::OkStatus();
  };
}

template <typename E>
Setter Enum(E JobSpec::*field, std::vector<std::pair<std::string, E>> names) {
  return [field, names](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
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
Setter AutoOr(Setter concrete, bool JobSpec::*flag) {
  return [concrete, flag](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
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
Setter RopeScalingMap() {
  return [](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
    if (!n.IsMap()) return TypeError(path, "a map such as {rope_type: yarn, factor: 4.0}", n);
    nlohmann::json j = nlohmann::json::object();
    for (const auto& kv : n) {
      if (!kv.first.IsScalar() || !kv.second.IsScalar()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": expected scalar keys and values"));
      }
      const std::string key = kv.first.Scalar(), v = kv.second.Scalar();
      // The keys some RoPE type reads (ModelConfig's rope parser): a misspelt one would be
      // ignored there, so it is refused here (a model's config.json may carry others).
      static constexpr const char* kKnown[] = {"rope_type", "type", "factor", "original_max_position_embeddings",
                                               "attention_factor", "beta_fast", "beta_slow", "mscale",
                                               "mscale_all_dim", "truncate", "low_freq_factor", "high_freq_factor",
                                               "rope_theta", "partial_rotary_factor"};
      if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": unknown key '", key.substr(0, 64),
                                                       "' (known: ", absl::StrJoin(kKnown, ", "), ")"));
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
Setter NoDecayGroups() {
  return [](const YAML::Node& n, const std::string& path, JobSpec& s) -> absl::Status {
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

const std::map<std::string, std::map<std::string, Setter>>& Schema() {
  static const auto* schema = new std::map<std::string, std::map<std::string, Setter>>{
      {"model",
       {{"path", Str(&JobSpec::model_path)},
        {"preset", Str(&JobSpec::model_preset)},
        {"init_seed", U64(&JobSpec::init_seed)},
        {"max_position_embeddings", Int(&JobSpec::max_position_embeddings, 1)},
        {"num_hidden_layers", Int(&JobSpec::num_hidden_layers, 1)},
        {"rope_scaling", RopeScalingMap()}}},
      {"data",
       {{"path", Str(&JobSpec::data_path)},
        {"validation", Str(&JobSpec::validation)},
        {"tokenizer_check", Bool(&JobSpec::tokenizer_check)}}},
      {"output",
       {{"dir", Str(&JobSpec::output_dir)},
        {"save_every", Int(&JobSpec::save_every_steps, 0)},
        {"keep_last", Int(&JobSpec::keep_last, 1)},
        {"save_dtype", Enum<SaveDtype>(&JobSpec::save_dtype, {{"bf16", SaveDtype::kBf16}, {"fp32", SaveDtype::kF32}})},
        {"save_final", Bool(&JobSpec::save_final)},
        {"tensorboard", Bool(&JobSpec::tensorboard)},
        {"overwrite", Bool(&JobSpec::overwrite)}}},
      {"train",
       {{"seq_len", Int(&JobSpec::seq_len, 1)},
        {"global_batch", Int(&JobSpec::global_batch, 1)},
        {"micro_batch", Int(&JobSpec::micro_batch, 1)},
        {"steps", Int(&JobSpec::steps, 0)},
        {"epochs", Real(&JobSpec::epochs, 0, 1e6)},
        {"seed", U64(&JobSpec::seed)},
        {"eval_every", Int(&JobSpec::eval_every, 0)},
        {"max_grad_norm", Real(&JobSpec::max_grad_norm, 0, 1e30)},
        {"skip_nonfinite", Bool(&JobSpec::skip_nonfinite)},
        {"measure_only", Bool(&JobSpec::measure_only)},
        {"router_aux_loss_coef", Real(&JobSpec::router_aux_loss_coef, 0, 1e3)}}},
      {"optimizer",
       {{"lr", Real(&JobSpec::lr, 0, 10)},
        {"beta1", Real(&JobSpec::beta1, 0, 0.999999999)},
        {"beta2", Real(&JobSpec::beta2, 0, 0.999999999)},
        {"eps", Real(&JobSpec::eps, 0, 1)},
        {"weight_decay", Real(&JobSpec::weight_decay, 0, 1e3)},
        {"no_decay", NoDecayGroups()},
        {"state_dtype", Enum<StateDtype>(&JobSpec::state_dtype, {{"fp32", StateDtype::kFp32},
                                                                 {"bf16", StateDtype::kBf16},
                                                                 {"int8", StateDtype::kInt8}})}}},
      {"schedule",
       {{"kind", Enum<ScheduleKind>(&JobSpec::schedule, {{"constant", ScheduleKind::kConstant},
                                                         {"linear", ScheduleKind::kLinear},
                                                         {"cosine", ScheduleKind::kCosine}})},
        {"warmup_steps", Int(&JobSpec::warmup_steps, 0)},
        {"min_lr", Real(&JobSpec::min_lr, 0, 10)}}},
      {"runtime",
       {{"backend", Enum<Backend>(&JobSpec::backend,
                                  {{"auto", Backend::kAuto}, {"cuda", Backend::kCuda}, {"cpu", Backend::kCpu}})},
        {"workers", Int32(&JobSpec::num_workers, 0)},
        {"chunk_bytes", AutoOr(Int(&JobSpec::chunk_bytes, 4096), &JobSpec::chunk_bytes_auto)},
        {"param_delivery",
         AutoOr(Enum<ParamDelivery>(&JobSpec::param_delivery,
                                    {{"replicated", ParamDelivery::kReplicated}, {"sharded", ParamDelivery::kSharded}}),
                &JobSpec::param_delivery_auto)},
        {"grad_reduction",
         AutoOr(Enum<GradReduction>(&JobSpec::grad_reduction, {{"gpu", GradReduction::kGpu}, {"cpu", GradReduction::kCpu}}),
                &JobSpec::grad_reduction_auto)},
        {"grad_staging", Enum<GradStaging>(&JobSpec::grad_staging, {{"auto", GradStaging::kAuto},
                                                                    {"device", GradStaging::kDevice},
                                                                    {"host", GradStaging::kHost}})},
        {"grad_dtype", Enum<GradDtype>(&JobSpec::grad_dtype, {{"fp32", GradDtype::kFp32}, {"bf16", GradDtype::kBf16}})},
        {"param_source",
         Enum<ParamSource>(&JobSpec::param_source, {{"mirror", ParamSource::kMirror}, {"master", ParamSource::kMaster}})},
        {"cast_on", Enum<CastOn>(&JobSpec::cast_on, {{"device", CastOn::kDevice}, {"host", CastOn::kHost}})},
        {"cast_threads", Int32(&JobSpec::cast_threads, 0)},
        {"act_policy", Enum<ActivationPolicy>(&JobSpec::act_policy, {{"keep_all", ActivationPolicy::kKeepAll},
                                                                     {"recompute", ActivationPolicy::kRecomputeLayer},
                                                                     {"selective", ActivationPolicy::kSelective},
                                                                     {"auto", ActivationPolicy::kAuto}})},
        {"norm_weights",
         Enum<NormWeights>(&JobSpec::norm_weights, {{"fp32", NormWeights::kFp32}, {"bf16", NormWeights::kBf16}})},
        {"deterministic", Bool(&JobSpec::deterministic)},
        {"embedding_rows", Enum<EmbeddingRows>(&JobSpec::embedding_rows,
                                               {{"fp32", EmbeddingRows::kFp32}, {"bf16", EmbeddingRows::kBf16}})},
        {"offload_ratio", Real(&JobSpec::offload_ratio, 0, 1)},
        {"checkpoint_dtype", Enum<CheckpointDtype>(&JobSpec::checkpoint_dtype, {{"fp32", CheckpointDtype::kFp32},
                                                                                {"bf16", CheckpointDtype::kBf16}})},
        {"tile_tokens", TileTokens()},
        {"speculation_bytes", Int(&JobSpec::speculation_bytes, -1)},
        {"gpu_memory_limit", MemoryLimit()},
        {"policy", Policy()},
        {"layer_policy", InlineLayout()},
        {"copy_priority", Real(&JobSpec::copy_priority, 0, 1)},
        {"ring_slots", Int32(&JobSpec::ring_slots, 2)},
        {"context_parallel", Int32(&JobSpec::context_parallel, 1)},
        {"step_timeout_ms", Int(&JobSpec::step_timeout_ms, 100)},
        {"max_restarts", Int32(&JobSpec::max_restarts, 0)}}},
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
  s.validation = "auto";  // a spec's default; a JobSpec made in code has none
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
absl::Status CheckAcrossKeys(const JobSpec& s) {
  RETURN_IF_ERROR(ValidateJobName(s.name));
  // Cross-field checks.
  if (s.model_path.empty() == s.model_preset.empty()) {
    return absl::InvalidArgumentError(
        "job spec: give exactly one of model.path (a HF model directory) or model.preset");
  }
  if (s.num_hidden_layers > 0 && s.model_preset.empty()) {
    return absl::InvalidArgumentError(
        "job spec: model.num_hidden_layers reduces a preset's depth; a model.path model has the layers its weights have");
  }
  if (s.data_path.empty()) return absl::InvalidArgumentError("job spec: data.path is required");
  if (s.seq_len == 0) return absl::InvalidArgumentError("job spec: train.seq_len is required");
  if (s.global_batch == 0) return absl::InvalidArgumentError("job spec: train.global_batch is required");
  if ((s.steps > 0) == (s.epochs > 0)) {
    return absl::InvalidArgumentError("job spec: give exactly one of train.steps or train.epochs (> 0)");
  }
  if (s.global_batch % s.micro_batch != 0) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: train.global_batch ", s.global_batch,
                                                   " is not a multiple of train.micro_batch ", s.micro_batch));
  }
  // A micro-batch indexes its tokens with int32 (cu_seqlens, positions: common/data/batch.h).
  if (s.seq_len > std::numeric_limits<int32_t>::max() / s.micro_batch) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: train.micro_batch x train.seq_len = ", s.micro_batch,
                                                   " x ", s.seq_len, " is over ", std::numeric_limits<int32_t>::max(),
                                                   " tokens, the most one micro-batch holds"));
  }
  if (s.context_parallel > 1) {
    if (s.num_workers < s.context_parallel || s.num_workers % s.context_parallel != 0) {
      return absl::InvalidArgumentError(absl::StrCat("job spec: runtime.context_parallel ", s.context_parallel,
                                                     " needs runtime.workers a multiple of it (got ", s.num_workers,
                                                     "): each group of that many workers splits its micro-batches"));
    }
    if (static_cast<int64_t>(s.micro_batch) * s.seq_len < 2 * int64_t{s.context_parallel}) {
      return absl::InvalidArgumentError(absl::StrCat("job spec: runtime.context_parallel ", s.context_parallel,
                                                     " splits a micro-batch into ", 2 * int64_t{s.context_parallel},
                                                     " chunks; train.micro_batch x train.seq_len is ",
                                                     int64_t{s.micro_batch} * s.seq_len));
    }
    if (s.act_policy == ActivationPolicy::kAuto || s.policy_auto) {
      return absl::InvalidArgumentError(
          "job spec: runtime.context_parallel needs the same layer policies on every rank: a fixed act_policy or "
          "policy file, not auto (each rank would choose from its own measurements)");
    }
  }
  const int64_t dp_ranks = s.context_parallel > 1 ? s.num_workers / s.context_parallel : s.num_workers;
  if (s.context_parallel > 1 && s.global_batch % (dp_ranks * s.micro_batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: train.global_batch ", s.global_batch,
                                                   " is not divisible by the data-parallel ranks x train.micro_batch = ",
                                                   dp_ranks, " x ", s.micro_batch));
  }
  if (s.context_parallel == 1 && s.num_workers > 0 &&
      s.global_batch % (int64_t{s.num_workers} * s.micro_batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: train.global_batch ", s.global_batch,
        " is not divisible by runtime.workers x train.micro_batch = ", s.num_workers, " x ", s.micro_batch));
  }
  // (With runtime.workers 0 the count is known when the job starts: the job plan refuses it then.)
  if (s.grad_staging == GradStaging::kDevice && s.grad_reduction == GradReduction::kCpu && !s.grad_reduction_auto &&
      s.num_workers > 1) {
    return absl::InvalidArgumentError(
        "job spec: runtime.grad_staging device needs runtime.grad_reduction gpu (or one worker): with "
        "grad_reduction cpu hostd sums the ranks' gradients, so only it knows the norm");
  }
  if (s.cast_threads > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: runtime.cast_threads ", s.cast_threads, " is more than 256 (0: auto)"));
  }
  if (s.steps > 0 && s.warmup_steps > s.steps) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: schedule.warmup_steps ", s.warmup_steps, " exceeds train.steps ", s.steps));
  }
  if (!(s.eps > 0)) {
    // AdamW divides by sqrt(v) + eps: with 0 an element whose gradient is always 0 (padding between
    // tensors, an unused embedding row) becomes 0/0 = NaN.
    return absl::InvalidArgumentError(absl::StrCat("job spec: optimizer.eps must be > 0, got ", s.eps));
  }
  if (s.min_lr > s.lr) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: schedule.min_lr ", s.min_lr, " exceeds optimizer.lr ", s.lr));
  }
  return absl::OkStatus();
}

// The paths: text checked, resolved against the spec's directory, the validation split found, the
// policy file loaded, and (kCheck) the files there.
absl::Status ResolvePaths(JobSpec& s, const std::string& base_dir, JobSpec::FileCheck check_files,
                          JobSpec::OutputDirBase output_base) {
  if (s.output_dir.empty()) s.output_dir = absl::StrCat("out/", s.name);

  if (!base_dir.empty()) RETURN_IF_ERROR(CheckPathText(base_dir, "the spec's directory (base_dir)"));
  for (const auto& [path, key] : {std::pair<const std::string*, const char*>{&s.model_path, "model.path"},
                                  {&s.data_path, "data.path"},
                                  {&s.output_dir, "output.dir"},
                                  {&s.policy_file, "runtime.policy"}}) {
    if (!path->empty()) RETURN_IF_ERROR(CheckPathText(*path, absl::StrCat("job spec: ", key)));
  }
  if (s.validation != "auto" && s.validation != "none" && !s.validation.empty()) {
    RETURN_IF_ERROR(CheckPathText(s.validation, "job spec: data.validation"));
  }
  s.model_path = Resolve(base_dir, s.model_path);
  s.data_path = Resolve(base_dir, s.data_path);
  if (s.validation == "auto") {
    // `slidedp prepare` writes <output>/train and <output>/validation: a training split named
    // train/ with a validation/ beside it that holds a dataset is validated on.
    const fs::path data(s.data_path);
    const fs::path sibling = data.parent_path() / "validation";
    std::error_code ec;
    const bool split = (data.filename() == "train" || (data.filename().empty() && data.parent_path().filename() == "train"));
    s.validation = split && fs::is_regular_file(sibling / "manifest.json", ec) ? sibling.string() : std::string();
  } else if (s.validation == "none") {
    s.validation.clear();
  } else if (!s.validation.empty()) {
    s.validation = Resolve(base_dir, s.validation);
  }
  if (s.eval_every > 0 && s.validation.empty() && check_files == JobSpec::FileCheck::kCheck) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: train.eval_every ", s.eval_every,
                                                   " but no validation split: data.validation names none and ",
                                                   s.data_path, " has no validation/ beside it"));
  }
  if (output_base == JobSpec::OutputDirBase::kBaseDir) s.output_dir = Resolve(base_dir, s.output_dir);
  if (!s.policy_file.empty()) s.policy_file = Resolve(base_dir, s.policy_file);
  if (s.policy_auto && (s.act_policy != ActivationPolicy::kRecomputeLayer || s.offload_ratio > 0)) {
    return absl::InvalidArgumentError(
        "job spec: runtime.policy auto chooses every layer's activations and offload itself; remove "
        "runtime.act_policy and runtime.offload_ratio (or use runtime.policy: fixed)");
  }
  if (s.measure_only && !s.policy_auto) {
    return absl::InvalidArgumentError(
        "job spec: train.measure_only measures AutoPolicy's layout: it needs runtime.policy auto");
  }
  if (check_files == JobSpec::FileCheck::kCheck && !s.policy_file.empty() && !s.layer_layout) {
    auto layout = LayerLayout::Load(s.policy_file);
    if (!layout.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("runtime.policy: ", layout.status().message()));
    }
    s.layer_layout = std::move(*layout);
  }
  if (check_files == JobSpec::FileCheck::kCheck) {
    // The non-throwing forms: a path too long or unreadable is "not there", never an exception.
    std::error_code ec;
    if (!s.model_path.empty() && !fs::exists(fs::path(s.model_path) / "config.json", ec)) {
      return absl::InvalidArgumentError(absl::StrCat("model.path: no config.json in ", s.model_path));
    }
    if (!fs::is_directory(s.data_path, ec)) {
      return absl::InvalidArgumentError(absl::StrCat("data.path: ", s.data_path, " is not a directory"));
    }
    if (!s.validation.empty() && !fs::is_directory(s.validation, ec)) {
      return absl::InvalidArgumentError(absl::StrCat("data.validation: ", s.validation, " is not a directory"));
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
  absl::StatusOr<ModelConfig> c = !spec.model_preset.empty() ? ModelConfig::Preset(spec.model_preset)
                                                              : ModelConfig::FromFile(spec.model_path + "/config.json");
  if (!c.ok()) return c.status();
  if (spec.num_hidden_layers > 0) {
    if (spec.num_hidden_layers > c->num_hidden_layers) {
      return absl::InvalidArgumentError(absl::StrCat("model.num_hidden_layers ", spec.num_hidden_layers, ": ",
                                                     spec.model_preset, " has ", c->num_hidden_layers,
                                                     " (the key only reduces a preset's depth)"));
    }
    c->num_hidden_layers = spec.num_hidden_layers;
    // mlp_only_layers past the new depth no longer exist.
    std::erase_if(c->mlp_only_layers, [&](int64_t l) { return l >= c->num_hidden_layers; });
    RETURN_IF_ERROR(c->Validate());
  }
  if (spec.max_position_embeddings > 0 || !spec.rope_scaling_json.empty()) {
    RETURN_IF_ERROR(c->OverrideContext(spec.max_position_embeddings, spec.rope_scaling_json));
  }
  return c;
}

}  // namespace slidedp
