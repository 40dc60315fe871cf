// The spec's enums as the YAML spells them, and JobSpec::ToYaml (the resolved spec hostd records and
// sends the workers); see job_spec.h.
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

const char* ToString(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kConstant: return "constant";
    case ScheduleKind::kLinear: return "linear";
    case ScheduleKind::kCosine: return "cosine";
  }
  return "?";
}
const char* ToString(ParamDelivery k) { return k == ParamDelivery::kReplicated ? "replicated" : "sharded"; }
const char* ToString(NodeState k) { return k == NodeState::kReplicated ? "replicated" : "sharded"; }
const char* ToString(GradReduction k) { return k == GradReduction::kGpu ? "gpu" : "cpu"; }
const char* ToString(GradStaging k) {
  switch (k) {
    case GradStaging::kAuto: return "auto";
    case GradStaging::kDevice: return "device";
    case GradStaging::kHost: return "host";
  }
  return "?";
}
const char* ToString(ParamSource k) { return k == ParamSource::kMaster ? "master" : "mirror"; }
const char* ToString(CastOn k) { return k == CastOn::kHost ? "host" : "device"; }
const char* ToString(NoDecay k) { return k == NoDecay::kNorm ? "norm" : "bias"; }

int64_t GpuMemoryLimitBytes(const JobSpec& spec, int64_t device_bytes) {
  if (spec.runtime.gpu_memory_limit_bytes > 0) return spec.runtime.gpu_memory_limit_bytes;
  if (spec.runtime.gpu_memory_limit_fraction > 0)
    return static_cast<int64_t>(spec.runtime.gpu_memory_limit_fraction * device_bytes);
  return 0;
}
int64_t GpuCapacityBytes(const JobSpec& spec, int64_t device_bytes) {
  const int64_t limit = GpuMemoryLimitBytes(spec, device_bytes);
  return limit > 0 ? std::min(limit, device_bytes) : device_bytes;
}
const char* ToString(ActivationPolicy k) {
  switch (k) {
    case ActivationPolicy::kKeepAll: return "keep_all";
    case ActivationPolicy::kRecomputeLayer: return "recompute";
    case ActivationPolicy::kSelective: return "selective";
    case ActivationPolicy::kAuto: return "auto";
  }
  return "?";
}
const char* ToString(Backend k) {
  switch (k) {
    case Backend::kAuto: return "auto";
    case Backend::kCuda: return "cuda";
    case Backend::kCpu: return "cpu";
  }
  return "?";
}

std::string JobSpec::ToYaml() const {
  YAML::Emitter e;
  e << YAML::BeginMap;
  e << YAML::Key << "name" << YAML::Value << name;
  e << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  if (!model.path.empty()) e << YAML::Key << "path" << YAML::Value << model.path;
  if (!model.preset.empty()) e << YAML::Key << "preset" << YAML::Value << model.preset;
  e << YAML::Key << "init_seed" << YAML::Value << model.init_seed;
  if (model.max_position_embeddings > 0)
    e << YAML::Key << "max_position_embeddings" << YAML::Value << model.max_position_embeddings;
  if (model.num_hidden_layers > 0) e << YAML::Key << "num_hidden_layers" << YAML::Value << model.num_hidden_layers;
  if (!model.rope_scaling_json.empty()) {
    e << YAML::Key << "rope_scaling" << YAML::Value << YAML::Flow << YAML::BeginMap;
    const nlohmann::json rope = nlohmann::json::parse(model.rope_scaling_json, nullptr, /*allow_exceptions=*/false);
    if (rope.is_object()) {  // it is: RopeScalingMap wrote it
      for (const auto& [k, v] : rope.items()) {
        e << YAML::Key << k << YAML::Value << (v.is_string() ? v.get<std::string>() : v.dump());
      }
    }
    e << YAML::EndMap;
  }
  e << YAML::EndMap;
  e << YAML::Key << "data" << YAML::Value << YAML::BeginMap << YAML::Key << "path" << YAML::Value << data.path
    << YAML::Key << "validation" << YAML::Value << (data.validation.empty() ? std::string("none") : data.validation)
    << YAML::Key << "tokenizer_check" << YAML::Value << data.tokenizer_check << YAML::EndMap;
  e << YAML::Key << "output" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "dir" << YAML::Value << output.dir;
  e << YAML::Key << "save_every" << YAML::Value << output.save_every;
  e << YAML::Key << "keep_last" << YAML::Value << output.keep_last;
  e << YAML::Key << "save_dtype" << YAML::Value << ToString(output.save_dtype);
  e << YAML::Key << "save_final" << YAML::Value << output.save_final;
  e << YAML::Key << "tensorboard" << YAML::Value << output.tensorboard;
  e << YAML::Key << "overwrite" << YAML::Value << output.overwrite << YAML::EndMap;
  e << YAML::Key << "train" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "seq_len" << YAML::Value << train.seq_len;
  e << YAML::Key << "global_batch" << YAML::Value << train.global_batch;
  e << YAML::Key << "micro_batch" << YAML::Value << train.micro_batch;
  if (train.steps > 0) e << YAML::Key << "steps" << YAML::Value << train.steps;
  if (train.epochs > 0) e << YAML::Key << "epochs" << YAML::Value << train.epochs;
  e << YAML::Key << "seed" << YAML::Value << train.seed;
  e << YAML::Key << "eval_every" << YAML::Value << train.eval_every;
  e << YAML::Key << "max_grad_norm" << YAML::Value << train.max_grad_norm;
  e << YAML::Key << "skip_nonfinite" << YAML::Value << train.skip_nonfinite;
  if (train.measure_only) e << YAML::Key << "measure_only" << YAML::Value << true;
  if (train.router_aux_loss_coef >= 0)
    e << YAML::Key << "router_aux_loss_coef" << YAML::Value << train.router_aux_loss_coef;
  e << YAML::EndMap;
  e << YAML::Key << "optimizer" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "lr" << YAML::Value << optimizer.lr;
  e << YAML::Key << "beta1" << YAML::Value << optimizer.beta1;
  e << YAML::Key << "beta2" << YAML::Value << optimizer.beta2;
  e << YAML::Key << "eps" << YAML::Value << optimizer.eps;
  e << YAML::Key << "weight_decay" << YAML::Value << optimizer.weight_decay;
  e << YAML::Key << "no_decay" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (NoDecay g : optimizer.no_decay) e << ToString(g);
  e << YAML::EndSeq;
  e << YAML::Key << "state_dtype" << YAML::Value << ToString(optimizer.state_dtype) << YAML::EndMap;
  e << YAML::Key << "schedule" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "kind" << YAML::Value << ToString(schedule.kind);
  e << YAML::Key << "warmup_steps" << YAML::Value << schedule.warmup_steps;
  e << YAML::Key << "min_lr" << YAML::Value << schedule.min_lr << YAML::EndMap;
  e << YAML::Key << "runtime" << YAML::Value << YAML::BeginMap;
  e << YAML::Key << "backend" << YAML::Value << ToString(runtime.backend);
  e << YAML::Key << "workers" << YAML::Value << runtime.workers;
  if (runtime.chunk_bytes_auto) {
    e << YAML::Key << "chunk_bytes" << YAML::Value << "auto";
  } else {
    e << YAML::Key << "chunk_bytes" << YAML::Value << runtime.chunk_bytes;
  }
  e << YAML::Key << "param_delivery" << YAML::Value
    << (runtime.param_delivery_auto ? "auto" : ToString(runtime.param_delivery));
  e << YAML::Key << "grad_reduction" << YAML::Value
    << (runtime.grad_reduction_auto ? "auto" : ToString(runtime.grad_reduction));
  e << YAML::Key << "grad_staging" << YAML::Value << ToString(runtime.grad_staging);
  e << YAML::Key << "grad_dtype" << YAML::Value << ToString(runtime.grad_dtype);
  e << YAML::Key << "param_source" << YAML::Value << ToString(runtime.param_source);
  e << YAML::Key << "cast_on" << YAML::Value << ToString(runtime.cast_on);
  e << YAML::Key << "cast_threads" << YAML::Value << runtime.cast_threads;
  e << YAML::Key << "act_policy" << YAML::Value << ToString(runtime.act_policy);
  e << YAML::Key << "norm_weights" << YAML::Value << ToString(runtime.norm_weights);
  e << YAML::Key << "embedding_rows" << YAML::Value << ToString(runtime.embedding_rows);
  e << YAML::Key << "deterministic" << YAML::Value << runtime.deterministic;
  e << YAML::Key << "offload_ratio" << YAML::Value << runtime.offload_ratio;
  e << YAML::Key << "checkpoint_dtype" << YAML::Value << ToString(runtime.checkpoint_dtype);
  if (runtime.tile_tokens > 0) e << YAML::Key << "tile_tokens" << YAML::Value << runtime.tile_tokens;
  e << YAML::Key << "speculation_bytes" << YAML::Value << runtime.speculation_bytes;
  if (runtime.policy_auto) {
    e << YAML::Key << "policy" << YAML::Value << "auto";
  } else if (!runtime.policy_file.empty()) {
    e << YAML::Key << "policy" << YAML::Value << runtime.policy_file;
  }
  if (runtime.layer_layout)
    e << YAML::Key << "layer_policy" << YAML::Value << YAML::Load(runtime.layer_layout->ToYaml());
  if (runtime.gpu_memory_limit_bytes > 0) {
    e << YAML::Key << "gpu_memory_limit" << YAML::Value << runtime.gpu_memory_limit_bytes;
  } else if (runtime.gpu_memory_limit_fraction > 0) {
    e << YAML::Key << "gpu_memory_limit" << YAML::Value << absl::StrCat(runtime.gpu_memory_limit_fraction);
  }
  e << YAML::Key << "copy_priority" << YAML::Value << runtime.copy_priority;
  e << YAML::Key << "ring_slots" << YAML::Value << runtime.ring_slots;
  if (runtime.context_parallel != 1) e << YAML::Key << "context_parallel" << YAML::Value << runtime.context_parallel;
  if (!runtime.nodes.empty()) {
    e << YAML::Key << "nodes" << YAML::Value << YAML::Flow << YAML::BeginSeq;
    for (const std::string& n : runtime.nodes) e << n;
    e << YAML::EndSeq;
    e << YAML::Key << "node_state" << YAML::Value << ToString(runtime.node_state);
  }
  e << YAML::Key << "step_timeout_ms" << YAML::Value << runtime.step_timeout_ms;
  e << YAML::Key << "max_restarts" << YAML::Value << runtime.max_restarts << YAML::EndMap;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace slidedp
