// StepPlan: see step_prediction.h.
#include "hostd/engine/step_prediction.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/policy/layout_solver.h"

namespace slidedp::hostd {
namespace {

constexpr double kGB = 1e9;

v1::PlanResource* Add(v1::PlanJobResponse& r, const std::string& name, double work, const std::string& unit,
                      double rate, double busy_s, const std::string& source) {
  v1::PlanResource* x = r.add_resources();
  x->set_name(name);
  x->set_work(work);
  x->set_unit(unit);
  x->set_rate(rate);
  x->set_busy_s(busy_s);
  x->set_source(source);
  return x;
}

// LayerAdam's host memory traffic per parameter (reads and writes): master, moments, gradient,
// and the BF16 mirror it writes when the segment keeps one.
double AdamBytesPerParam(const RoutePlan& plan) {
  const double moments = plan.moments == MomentForm::kF32 ? 8 : plan.moments == MomentForm::kBF16 ? 4 : 2;
  return 4 + moments + 4 + 4 + moments + (plan.mirror ? 2 : 0);
}

// The step of `counts` (the layout's kinds) or, with `solve`, of the layout SolvePolicy finds, under
// `problem`, as an alternative named `what` for `tokens` tokens per step over all GPUs.
void AddAlternative(v1::PlanJobResponse& r, const std::string& what, const PolicyProblem& problem,
                    const std::vector<int64_t>& counts, bool solve, int64_t tokens, const std::string& note) {
  v1::PlanAlternative* a = r.add_alternatives();
  a->set_what(what);
  a->set_note(note);
  absl::StatusOr<LayoutSolution> plan = solve ? SolvePolicy(problem, 5) : PredictPolicy(problem, counts);
  if (!plan.ok()) {
    a->set_note(absl::StrCat(std::string(plan.status().message()), note.empty() ? "" : "; ", note));
    return;
  }
  if (!solve && plan->device_bytes > problem.device_budget_bytes) {
    a->set_note(absl::StrFormat("the layout keeps %.1f GiB, over the %.1f GiB the device leaves it%s%s",
                                plan->device_bytes / 1073741824.0, problem.device_budget_bytes / 1073741824.0,
                                note.empty() ? "" : "; ", note));
    return;
  }
  a->set_step_s(plan->step_s);
  a->set_bottleneck(plan->bottleneck);
  a->set_tokens_per_s(plan->step_s > 0 ? static_cast<double>(tokens) / plan->step_s : 0);
  a->set_layout(MixName(problem.candidates, plan->counts));
}

}  // namespace

PolicyProblem ScaleTokens(PolicyProblem problem, double s) {
  for (LayerCandidate& c : problem.candidates) {
    c.time_s *= s;
    c.forward_s *= s;
    c.device_bytes = static_cast<int64_t>(static_cast<double>(c.device_bytes) * s);
    c.host_bytes = static_cast<int64_t>(static_cast<double>(c.host_bytes) * s);
    c.h2d_bytes = static_cast<int64_t>(static_cast<double>(c.h2d_bytes) * s);
    c.d2h_bytes = static_cast<int64_t>(static_cast<double>(c.d2h_bytes) * s);
    c.in_flight_bytes = static_cast<int64_t>(static_cast<double>(c.in_flight_bytes) * s);
  }
  problem.base.compute_s *= s;
  return problem;
}

v1::PlanJobResponse PredictStep(const StepPredictionInputs& in) {
  const JobSpec& spec = *in.spec;
  const ModelLayout& layout = *in.layout;
  const RoutePlan& plan = *in.plan;
  v1::PlanJobResponse r;
  const int world = std::max(1, in.world);
  const int64_t tokens = spec.train.global_batch / world * spec.train.seq_len;  // per GPU
  r.set_tokens_per_step(tokens);
  r.set_world(world);
  r.set_host_bytes(static_cast<int64_t>(plan.memory.total_bytes));
  for (const std::string& n : in.notes) r.add_notes(n);
  r.set_layout_source(in.layout_source);
  if (in.layer_layout) r.set_layout_yaml(in.layer_layout->ToYaml());

  // The analytic work of a step, per GPU: every unit's BF16 parameters up in forward and again in
  // backward (FP32 master values when the segment keeps no mirror), its gradient down (the rank's
  // shard on the GPU route), and what LayerAdam moves through host memory.
  const double params = static_cast<double>(layout.total_numel);
  const double param_bytes = params * (plan.mirror ? 2.0 : 4.0) * 2;
  const double grad_bytes =
      params * (static_cast<double>(DtypeBytes(plan.grad_dtype))) / (plan.route == GradReduction::kGpu ? world : 1);
  const double adam_bytes = params * AdamBytesPerParam(plan);

  std::optional<LayoutSolution> predicted;
  const AutoPolicyRecord* rec =
      in.layer_layout && in.layer_layout->autopolicy ? &*in.layer_layout->autopolicy : nullptr;
  PolicyProblem problem;
  if (rec != nullptr) {
    problem = rec->problem;
    // The layout's counts per measured candidate.
    std::vector<int64_t> counts(problem.candidates.size(), 0);
    bool all_measured = true;
    for (const LayerPolicy& l : in.layer_layout->layers) {
      auto it = std::find_if(problem.candidates.begin(), problem.candidates.end(),
                             [&](const LayerCandidate& c) { return c.policy == l; });
      if (it == problem.candidates.end()) {
        all_measured = false;
        break;
      }
      ++counts[it - problem.candidates.begin()];
    }
    const int64_t measured_tokens = in.layer_layout->tokens_per_step / world;
    if (measured_tokens > 0 && measured_tokens != tokens) {
      problem = ScaleTokens(std::move(problem), static_cast<double>(tokens) / static_cast<double>(measured_tokens));
      r.add_notes(absl::StrFormat("measured at %d tokens per GPU, scaled to %d", measured_tokens, tokens));
    }
    if (in.update_gparams_per_s > 0) problem.base.host_s = params / 1e9 / in.update_gparams_per_s;
    if (all_measured) predicted = PredictPolicy(problem, counts);
    if (all_measured && in.what_if) {
      // What would change it: another batch, more GPUs at this global batch, the other gradient
      // route. The copies per GPU follow the route: replicated delivery uploads every parameter on
      // each GPU; the gpu route downloads a 1/world shard of each gradient, the cpu route all of it.
      const int64_t global_tokens = tokens * world;
      const std::string kinds = in.layout_auto ? "" : "the same layer kinds";
      for (const double f : {2.0, 0.5}) {
        AddAlternative(r,
                       absl::StrFormat("%gx the tokens per step (%d per GPU)", f,
                                       static_cast<int64_t>(static_cast<double>(tokens) * f)),
                       ScaleTokens(problem, f), counts, in.layout_auto,
                       static_cast<int64_t>(static_cast<double>(global_tokens) * f), kinds);
      }
      const bool gpu_route = plan.route == GradReduction::kGpu;
      {
        PolicyProblem more = ScaleTokens(problem, 0.5);  // each GPU takes half the rows
        if (gpu_route) more.base.d2h_s *= 0.5;           // and posts half the shard
        AddAlternative(r, absl::StrFormat("%d GPUs, the same global batch", 2 * world), more, counts, in.layout_auto,
                       global_tokens,
                       absl::StrCat("each GPU as this one; NVLink's reduce-scatter not counted",
                                    kinds.empty() ? "" : "; ", kinds));
      }
      if (world > 1 && in.estimate_other_route) {
        PolicyProblem other = problem;
        other.base.d2h_s *= gpu_route ? world : 1.0 / world;
        AddAlternative(r,
                       gpu_route ? "grad_reduction: cpu (each GPU downloads whole gradients; hostd sums them)"
                                 : "grad_reduction: gpu (each GPU downloads its 1/world shard)",
                       other, counts, in.layout_auto, global_tokens,
                       gpu_route ? "hostd's summing of the ranks' copies not counted"
                                 : "NVLink's reduce-scatter not counted");
      }
    }
    if (!all_measured) r.add_notes("the layout has a layer kind AutoPolicy did not measure: no prediction");
  }

  if (predicted) {
    const LayoutSolution& e = *predicted;
    const double offload_up = (e.h2d_s - problem.base.h2d_s) * problem.base.h2d_bytes_per_s;
    const double offload_down = (e.d2h_s - problem.base.d2h_s) * problem.base.d2h_bytes_per_s;
    Add(r, "GPU compute", e.compute_s, "s", 0, e.compute_s,
        "AutoPolicy: a recompute step's compute outside the layers, one layer's probe per kind");
    Add(r, "host-to-device copies", (param_bytes + offload_up) / kGB, "GB", problem.base.h2d_bytes_per_s / kGB, e.h2d_s,
        "parameters: a recompute step's copy-engine time; checkpoints: the pinned-copy probe's rate");
    Add(r, "device-to-host copies", (grad_bytes + offload_down) / kGB, "GB", problem.base.d2h_bytes_per_s / kGB,
        e.d2h_s, "gradients: a recompute step's copy-engine time; checkpoints: the pinned-copy probe's rate");
    r.set_step_s(e.step_s);
    r.set_bottleneck(e.bottleneck);
    r.set_exposed_s(problem.base.exposed_s);
    r.set_gpu_peak_bytes(rec->working_set_bytes + e.device_bytes);
  } else {
    Add(r, "GPU compute", -1, "s", 0, -1, "not measured for this shape");
    Add(r, "host-to-device copies", param_bytes / kGB, "GB", 0, -1, "not measured for this shape");
    Add(r, "device-to-host copies", grad_bytes / kGB, "GB", 0, -1, "not measured for this shape");
    r.add_notes(
        "no measurement of this shape, batch and device by this build: `slidedp plan --measure` measures it (a short "
        "job that saves nothing), as does any run of it with runtime.policy: auto; plan predicts from what they cache");
  }
  const double host_busy = in.update_gparams_per_s > 0 ? params / 1e9 / in.update_gparams_per_s : -1;
  Add(r, "host updates (LayerAdam)", params / 1e9, "Gparam", in.update_gparams_per_s, host_busy,
      in.update_gparams_per_s > 0 ? "the last job on this hostd with these Adam moments"
                                  : "not measured on this hostd yet (a job's metrics give it)");
  Add(r, "host memory (DMA and LayerAdam)", (adam_bytes + world * (param_bytes + grad_bytes)) / kGB, "GB", 0, -1,
      "not measured: shared by every GPU's copies and LayerAdam's passes");
  if (world > 1 && plan.route == GradReduction::kGpu) {
    Add(r, "NVLink (gradient reduce-scatter)", params * 4.0 * (world - 1) / world / kGB, "GB", 0, -1, "not measured");
  }
  return r;
}

}  // namespace slidedp::hostd
