// StepPlan: `slidedp plan JOB.yaml` — a job's step predicted before anything runs on the host
// state, in the terms of the step model (common/policy/layout_solver.h):
//
//   T = max(C, H, D, A) + E
//
// C the GPU compute, H and D the copies each way per GPU (parameters and gradients, plus the
// offloaded checkpoints), A the host's update time (LayerAdam), E what no overlap hides. Each
// resource is listed with its work per step, the rate it moves at and the busy time that makes;
// the busiest is the bottleneck, named in words. Measured costs come from AutoPolicy's record of
// this shape (the policy cache, or a policy file it wrote) and LayerAdam's rate from the jobs this
// hostd ran; what is not measured is listed with its work and said to be so, never guessed.
// The client prints it and compares it with a run's metrics (client/cli/plan_report.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/jobspec/job_spec.h"
#include "common/model/model_config.h"
#include "common/policy/layer_policy.h"
#include "hostd/engine/job_plan.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::hostd {

struct StepPredictionInputs {
  const JobSpec* spec = nullptr;
  const ModelLayout* layout = nullptr;
  const RoutePlan* plan = nullptr;
  int world = 1;
  std::optional<LayerLayout> layer_layout;  // what the job would run; with its record when measured
  std::string layout_source;                 // "policy cache <path>", "policy file <path>", ...
  double update_gparams_per_s = 0;           // LayerAdam's rate on this host for the state format; 0: not known
  // runtime.policy auto: the alternatives' layouts are solved again (AutoPolicy would choose anew
  // for another shape); otherwise the layout keeps its kinds and is predicted as it is.
  bool layout_auto = false;
  // The what-if alternatives (false: the step alone, as a comparison of routes needs); with several
  // GPUs the other gradient route among them unless `estimate_other_route` is false (that route has
  // a record of its own, which the caller lists).
  bool what_if = true;
  bool estimate_other_route = true;
  std::vector<std::string> notes;
};

v1::PlanJobResponse PredictStep(const StepPredictionInputs& in);

// A measured problem's costs at `scale` times the tokens per GPU it was measured at: the layers'
// time and bytes and the compute outside them scale linearly (rows stay seq_len long, so
// attention's quadratic part within a row does too); the parameter copies and the host's update
// do not.
PolicyProblem ScaleTokens(PolicyProblem problem, double scale);

}  // namespace slidedp::hostd
