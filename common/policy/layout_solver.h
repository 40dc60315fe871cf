// The layer-count MILP of AutoPolicy (issue 22): given the measured candidates a decoder layer can
// run (each a LayerPolicy with its time per layer per step and the device bytes it keeps between
// forward and backward), how many layers run each, so that the step is fastest and the kept bytes
// fit the budget:
//
//   min  sum_j n_j * time_j
//   s.t. sum_j n_j * device_bytes_j <= budget_bytes,   sum_j n_j = layers,   n_j integer >= 0
//
// solved by COIN-OR CBC (docs/dependencies.md), then placed along the model (PlaceLayers).
//
// SolvePolicy is the whole step model AutoPolicy solves (worker/pipeline/auto_policy.h measures
// its inputs): the step takes T = max(C, H, D, A) + E, where the GPU compute C, the H2D copies H
// and the D2H copies D each have a part the layout does not change (StepBase) and a part each layer
// adds by its candidate (an offloaded checkpoint crosses PCIe twice), A is the host's update time
// and E what no overlap hides. It minimises T over the integer counts, subject to the device
// budget and the pinned host memory the offloaded checkpoints take:
//
//   min  T
//   s.t. T >= C0 + sum_j n_j time_j,  T >= H0 + sum_j n_j h2d_j / beta_h2d,  T >= D0 + ...,  T >= A
//        sum_j n_j device_bytes_j + M <= device budget,  sum_j n_j host_bytes_j <= host budget,
//        sum_j n_j = layers,  the copies keep pace with the passes (CopiesKeepPace),
//        M >= in_flight_j y_j,  n_j <= layers y_j,  y_j binary  (for each candidate that moves
//        checkpoints: M is the device room its checkpoints take while they cross, counted once, for
//        the largest the layout uses)
//
// then, among the layouts within a hair of the least T, the one with the least compute and copy time
// (a second solve), so no checkpoint crosses PCIe for nothing when the step is bound elsewhere.
// A candidate that names pieces to keep but keeps and moves exactly the bytes of recompute at its
// offload share (a model whose layers keep nothing: qwen3_5, ModelShape::layers_keep_pieces) is
// recompute by another name and is left at 0 layers: keeping saves its layers no recompute.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/policy/layer_policy.h"

namespace slidedp {

// The predicted step of `counts` (one per candidate) under `problem`'s costs; no budget check.
LayoutSolution PredictPolicy(const PolicyProblem& problem, const std::vector<int64_t>& counts);

// Whether the offload copies keep pace with the passes (a constraint of SolvePolicy when copies cost
// time and the candidates' forward was measured): what the layers send out crosses PCIe within
// the forward's time (else the device copies wait to be freed and the forward's peak grows past
// the plan), and what comes back within the backward's (else the backward waits for it):
//   sum_j n_j (d2h_j / beta_d2h - forward_j) <= 0,  sum_j n_j (h2d_j / beta_h2d - backward_j) <= 0.
bool CopiesKeepPace(const PolicyProblem& problem, const std::vector<int64_t>& counts, double slack_s = 0);

// INVALID_ARGUMENT for a malformed problem (no candidates or layers, negative or non-finite costs);
// RESOURCE_EXHAUSTED when no mix fits the budgets; DEADLINE_EXCEEDED without a proven optimum in
// max_seconds.
absl::StatusOr<LayoutSolution> SolvePolicy(const PolicyProblem& problem, double max_seconds = 10);

struct LayerCounts {
  std::vector<int64_t> counts;  // per candidate, summing to the layer count
  double time_s = 0;            // sum of counts x time
  int64_t device_bytes = 0;     // sum of counts x device bytes
};

// INVALID_ARGUMENT for an empty or malformed problem (negative or non-finite costs, no layers);
// RESOURCE_EXHAUSTED when no mix fits the budget (naming the smallest the layers could keep);
// DEADLINE_EXCEEDED if the solver takes longer than `max_seconds` without a proven optimum.
absl::StatusOr<LayerCounts> SolveLayerCounts(const std::vector<LayerCandidate>& candidates, int64_t layers,
                                             int64_t budget_bytes, double max_seconds = 10);

// "28 selective, 8 segment(qkv+gate_up)+offload": the candidates a mix uses, with their counts.
std::string MixName(const std::vector<LayerCandidate>& candidates, const std::vector<int64_t>& counts);

// The layers in model order (first decoder layer first) for `counts`: offloaded layers first, the
// largest share first (their backward comes last, so their checkpoints have the longest to come
// back, and they leave the device first in forward), then layers that keep only their input, then
// the layers that keep more on the device, the most at the end, where backward reaches them first
// and frees their memory soonest.
std::vector<LayerPolicy> PlaceLayers(const std::vector<LayerCandidate>& candidates, const std::vector<int64_t>& counts);

}  // namespace slidedp
