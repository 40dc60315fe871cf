// TrainingExecutor's predictions: the layout a job runs (cached, fixed or measured), the routes
// `auto` resolves to, `slidedp plan`'s step prediction per route, and AutoPolicy's record of the
// layout a job chose (see training_executor.h). The step loop is training_executor.cc, its setup
// training_executor_setup.cc.
#include "hostd/engine/training_executor.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/policy/layout_solver.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/admission/admission.h"
#include "hostd/engine/attempt.h"
#include "hostd/engine/job_checks.h"
#include "hostd/engine/job_plan.h"
#include "hostd/engine/policy_cache.h"
#include "hostd/engine/step_prediction.h"
#include "hostd/engine/worker_reports.h"

namespace slidedp::hostd {

std::optional<LayerLayout> TrainingExecutor::CachedLayout(const JobSpec& spec, const ModelConfig& config,
                                                          const std::vector<v1::WorkerHello>& hellos, std::string* key,
                                                          std::string* said) const {
  const PolicyCache cache(options_.policy_cache_dir);
  *key = PolicyCache::KeyText(spec, config, hellos);
  std::string why_not;
  std::optional<LayerLayout> cached = hellos.empty() ? std::nullopt : cache.Find(*key, config, hellos[0], &why_not);
  if (cached) {
    *said = absl::StrFormat(
        "runtime.policy auto: the layout cached at %s (predicted step %.3f s, bound by %s); no probes",
        cache.PathOf(*key), cached->autopolicy->predicted.step_s,
        cached->autopolicy->predicted.bottleneck.empty() ? std::string("?") : cached->autopolicy->predicted.bottleneck);
  } else {
    *said = absl::StrCat("runtime.policy auto: the workers measure the first step and choose a layout",
                         !cache.enabled()  ? " (no policy cache: hostd has no --state-dir or --policy-cache)"
                         : why_not.empty() ? ""
                                           : absl::StrCat(" (cached layout not used: ", why_not, ")"));
  }
  return cached;
}

void TrainingExecutor::LogPrediction(JobContext& ctx, const StepMeasurements& m) {
  if (m.predicted_step_s <= 0 || m.layout_from_step <= 0) return;
  std::vector<double> ran;
  for (const auto& [step, s] : m.step_times) {
    if (step >= m.layout_from_step) ran.push_back(s);
  }
  if (ran.empty()) return;
  std::sort(ran.begin(), ran.end());
  const double measured = ran[ran.size() / 2];
  ctx.Log(absl::StrFormat(
      "AutoPolicy's layout: predicted %.3f s per step (bound by %s), measured %.3f s (median of %d step(s) from "
      "step %d): %+.1f%%",
      m.predicted_step_s, m.predicted_bottleneck.empty() ? std::string("?") : m.predicted_bottleneck, measured,
      ran.size(), m.layout_from_step, 100 * (measured - m.predicted_step_s) / m.predicted_step_s));
}

// `slidedp plan`'s line on GPU memory: the step's floor and the longest single sequence the model
// fits on the first CUDA worker's device, with what this host has free for offloaded layer inputs.
std::string LongestSequenceNote(const JobSpec& spec, const ModelLayout& layout, const RoutePlan& plan,
                                const std::vector<v1::WorkerHello>& hellos) {
  const v1::DeviceInfo* gpu = nullptr;
  for (const auto& h : hellos) {
    if (h.device().kind() == "cuda" && h.device().memory_bytes() > 0) {
      gpu = &h.device();
      break;
    }
  }
  std::string note =
      absl::StrCat("GPU memory floor of the step (a CUDA worker, context_memory.h): ", plan.device_floor.ToString());
  if (gpu == nullptr) return absl::StrCat(note, "; no CUDA worker attached to size the longest sequence against");
  const int64_t limit = GpuMemoryLimitBytes(spec, gpu->memory_bytes());
  const int64_t capacity = GpuCapacityBytes(spec, gpu->memory_bytes());
  int64_t host_room = -1;
  if (absl::StatusOr<HostMemoryInfo> host = ReadHostMemoryInfo(); host.ok()) {
    const uint64_t used = plan.memory.total_bytes - plan.memory.offload_bytes + AdmissionPolicy{}.reserve_bytes;
    host_room = host->mem_available_bytes > used ? static_cast<int64_t>(host->mem_available_bytes - used) : 0;
  }
  const int64_t tile = spec.runtime.tile_tokens > 0 ? spec.runtime.tile_tokens : kDefaultTileTokens;
  const LongestSequence longest = FindLongestSequence(layout, capacity, host_room, tile, int64_t{1} << 24,
                                                      DtypeBytes(spec.runtime.checkpoint_dtype));
  return absl::StrFormat(
      "%s; the longest single sequence this model fits on %s (%.1f GiB%s) with %s for offloaded layer inputs: %d "
      "tokens (%d of %d layers' inputs offloaded)",
      note, gpu->name(), capacity / 1073741824.0, limit > 0 ? ", runtime.gpu_memory_limit" : "",
      host_room < 0 ? std::string("unknown host memory")
                    : absl::StrFormat("%.1f GiB of host memory", host_room / 1073741824.0),
      longest.tokens, longest.offloaded_layers, layout.config.num_hidden_layers);
}

namespace {
// A fixed act_policy as a policy file's layers: every layer of its kind, the first
// OffloadedLayers(offload_ratio) offloaded whole. nullopt for act_policy auto (which keeps what
// the job's first step leaves room for).
std::optional<LayerLayout> FixedLayout(const JobSpec& spec, const ModelLayout& layout) {
  LayerKind kind;
  switch (spec.runtime.act_policy) {
    case ActivationPolicy::kRecomputeLayer: kind = LayerKind::kRecompute; break;
    case ActivationPolicy::kSelective: kind = LayerKind::kSelective; break;
    case ActivationPolicy::kKeepAll: kind = LayerKind::kKeepAll; break;
    default: return std::nullopt;
  }
  LayerLayout out;
  out.model = ModelShape::Of(layout.config);
  out.tokens_per_step = spec.train.global_batch * spec.train.seq_len;
  const int64_t layers = layout.config.num_hidden_layers;
  const int64_t offloaded = layout.OffloadedLayers(spec.runtime.offload_ratio);
  for (int64_t l = 0; l < layers; ++l) out.layers.push_back(LayerPolicy{kind, l < offloaded ? 1.0 : 0.0, 0});
  return out;
}
bool AllCuda(const std::vector<v1::WorkerHello>& hellos) {
  return !hellos.empty() && std::all_of(hellos.begin(), hellos.end(),
                                        [](const v1::WorkerHello& h) { return h.device().kind() == "cuda"; });
}
}  // namespace

JobSpec TrainingExecutor::ResolveRoutes(const JobSpec& spec, const std::vector<v1::WorkerHello>& hellos,
                                        std::string* said) {
  said->clear();
  if (!spec.runtime.grad_reduction_auto && !spec.runtime.param_delivery_auto && !spec.runtime.chunk_bytes_auto)
    return spec;
  const int world = static_cast<int>(hellos.size());
  std::vector<JobSpec> variants = RouteVariants(spec, world, AllCuda(hellos), /*all=*/false);
  std::optional<size_t> best;
  double best_s = 0;
  std::string measured;
  for (size_t i = 0; i < variants.size() && variants.size() > 1; ++i) {
    absl::StatusOr<v1::PlanJobResponse> p = PlanRoute(variants[i], hellos, /*what_if=*/false, false);
    if (!p.ok() || p->step_s() <= 0) continue;
    absl::StrAppend(&measured, measured.empty() ? "" : ", ", RouteName(variants[i]),
                    absl::StrFormat(" %.3f s", p->step_s()));
    if (!best || p->step_s() < best_s) {
      best = i;
      best_s = p->step_s();
    }
  }
  if (best) {
    *said = absl::StrCat("runtime routes auto: ", RouteName(variants[*best]), ", the shortest measured step (",
                         measured, ")");
    return variants[*best];
  }
  // Nothing measured: the defaults for what `auto` leaves open.
  JobSpec d = spec;
  if (d.runtime.grad_reduction_auto) d.runtime.grad_reduction = GradReduction::kGpu;
  if (d.runtime.param_delivery_auto) d.runtime.param_delivery = ParamDelivery::kReplicated;
  if (d.runtime.chunk_bytes_auto) d.runtime.chunk_bytes = JobSpec{}.runtime.chunk_bytes;
  d.runtime.grad_reduction_auto = d.runtime.param_delivery_auto = d.runtime.chunk_bytes_auto = false;
  *said = absl::StrCat("runtime routes auto: ", RouteName(d),
                       variants.size() > 1
                           ? " (no route of this shape measured yet: `slidedp plan --measure --routes` measures them)"
                           : " (one worker: the routes do not differ)");
  return d;
}

absl::StatusOr<v1::PlanJobResponse> TrainingExecutor::Plan(const JobSpec& spec_in,
                                                           const std::vector<v1::WorkerHello>& hellos) {
  std::string said;
  const JobSpec spec = ResolveRoutes(spec_in, hellos, &said);
  // The other routes this shape has measurements of, each predicted from its own record; the other
  // gradient reduction, measured, takes the place of its estimate from this route's record.
  const int world = static_cast<int>(hellos.size());
  std::vector<std::pair<JobSpec, v1::PlanJobResponse>> measured;
  bool other_reduction_measured = false;
  for (const JobSpec& v :
       world > 1 ? RouteVariants(spec, world, AllCuda(hellos), /*all=*/true) : std::vector<JobSpec>{}) {
    if (RouteName(v) == RouteName(spec)) continue;
    absl::StatusOr<v1::PlanJobResponse> other = PlanRoute(v, hellos, /*what_if=*/false, false);
    if (!other.ok() || other->step_s() <= 0) continue;
    other_reduction_measured |=
        v.runtime.param_delivery == spec.runtime.param_delivery && v.runtime.chunk_bytes == spec.runtime.chunk_bytes;
    measured.emplace_back(v, *std::move(other));
  }
  ASSIGN_OR_RETURN(v1::PlanJobResponse r, PlanRoute(spec, hellos, /*what_if=*/true, !other_reduction_measured));
  if (!said.empty()) r.add_notes(said);
  r.set_route(RouteName(spec));
  for (const auto& [v, other] : measured) {
    v1::PlanAlternative* a = r.add_alternatives();
    a->set_what(absl::StrCat(RouteName(v), " (measured by its own job)"));
    a->set_step_s(other.step_s());
    a->set_bottleneck(other.bottleneck());
    a->set_tokens_per_s(static_cast<double>(other.tokens_per_step()) * other.world() / other.step_s());
  }
  return r;
}

absl::StatusOr<v1::PlanJobResponse> TrainingExecutor::PlanRoute(const JobSpec& spec_in,
                                                                const std::vector<v1::WorkerHello>& hellos,
                                                                bool what_if, bool estimate_other_route) {
  JobSpec spec = spec_in;
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfigOf(spec));
  ModelLayout layout = ModelLayout::Build(config);
  StepPredictionInputs in;
  if (spec.runtime.layer_layout) {
    in.layout_source = spec.runtime.policy_file.empty() ? "runtime.layer_policy (inline)"
                                                        : absl::StrCat("policy file ", spec.runtime.policy_file);
    RETURN_IF_ERROR(spec.runtime.layer_layout->CheckModel(config));
    if (!hellos.empty()) RETURN_IF_ERROR(spec.runtime.layer_layout->CheckDevice(hellos[0].device().name()));
  } else if (spec.runtime.policy_auto) {
    std::string key, said;
    spec.runtime.layer_layout = CachedLayout(spec, config, hellos, &key, &said);
    in.layout_source = spec.runtime.layer_layout
                           ? absl::StrCat("the policy cache, ", PolicyCache(options_.policy_cache_dir).PathOf(key))
                           : "none yet";
    in.notes.push_back(said);
  } else {
    in.layout_source = absl::StrCat(
        "runtime.policy fixed: act_policy ", ToString(spec.runtime.act_policy),
        spec.runtime.offload_ratio > 0 ? absl::StrCat(", offload_ratio ", spec.runtime.offload_ratio) : "");
    spec.runtime.layer_layout = FixedLayout(spec, layout);
    if (!spec.runtime.layer_layout)
      in.notes.push_back("act_policy auto keeps what the job's first step leaves room for: not predicted");
  }
  // A layout with no measurements of its own (a fixed policy, a hand-written file) is predicted
  // from AutoPolicy's record of the same shape, batch and settings, as `slidedp plan --measure`
  // (PolicyMeasureSpec) caches it.
  if (spec.runtime.layer_layout && !spec.runtime.layer_layout->autopolicy) {
    std::string key, said;
    std::optional<LayerLayout> measured = CachedLayout(PolicyMeasureSpec(spec), config, hellos, &key, &said);
    if (measured) {
      spec.runtime.layer_layout->autopolicy = measured->autopolicy;
      spec.runtime.layer_layout->tokens_per_step = measured->tokens_per_step;
      absl::StrAppend(&in.layout_source, "; costs from AutoPolicy's measurements of this shape, ",
                      PolicyCache(options_.policy_cache_dir).PathOf(key));
    }
  }
  ASSIGN_OR_RETURN(RoutePlan plan, PlanRoutes(spec, layout, WorkerDevicesOf(hellos)));
  in.notes.push_back(LongestSequenceNote(spec, layout, plan, hellos));
  in.spec = &spec;
  in.layout = &layout;
  in.plan = &plan;
  in.world = plan.world;
  in.layer_layout = spec.runtime.layer_layout;
  in.layout_auto = spec.runtime.policy_auto;
  in.what_if = what_if;
  in.estimate_other_route = estimate_other_route;
  {
    absl::MutexLock l(&mu_);
    auto it = update_rates_.find(static_cast<int>(plan.moments));
    if (it != update_rates_.end()) in.update_gparams_per_s = it->second;
  }
  return PredictStep(in);
}

bool TrainingExecutor::RecordPolicy(JobContext& ctx, Attempt& a, const v1::PolicyChosen& chosen) {
  absl::StatusOr<LayerLayout> layout = LayerLayout::Parse(chosen.policy_yaml(), "AutoPolicy's report");
  if (!layout.ok() || !layout->autopolicy) {
    ctx.Log(absl::StrCat("warning: AutoPolicy's report is not a policy with measurements (",
                         layout.ok() ? "none" : layout.status().message(), "); not cached"));
    return false;
  }
  const AutoPolicyRecord& r = *layout->autopolicy;
  const double error = r.predicted.step_s > 0 ? (chosen.step_time_s() - r.predicted.step_s) / r.predicted.step_s : 0;
  a.measured.predicted_step_s = r.predicted.step_s;
  a.measured.predicted_bottleneck = r.predicted.bottleneck;
  a.measured.layout_from_step = chosen.step() + 2;  // after its validation step
  std::string line = absl::StrFormat(
      "AutoPolicy chose %s in %.2f s; step %d ran it in %.3f s against %.3f s predicted (%+.1f%%, bound by %s), "
      "GPU peak %.2f GiB",
      MixName(r.problem.candidates, r.predicted.counts), chosen.selection_s(), chosen.step() + 1, chosen.step_time_s(),
      r.predicted.step_s, 100 * error, r.predicted.bottleneck, chosen.gpu_peak_bytes() / 1073741824.0);
  const PolicyCache cache(options_.policy_cache_dir);
  bool cached = false;
  if (cache.enabled() && !a.policy_key.empty()) {
    absl::Status stored = cache.Store(a.policy_key, chosen.policy_yaml(), a.layout.config);
    cached = stored.ok();
    absl::StrAppend(&line, stored.ok() ? absl::StrCat("; cached at ", cache.PathOf(a.policy_key))
                                       : absl::StrCat("; not cached: ", stored.message()));
  }
  ctx.Log(line);
  return cached;
}

}  // namespace slidedp::hostd
