// The layer-count MILP of AutoPolicy (issue 22): given the measured candidates a decoder layer can
// run (each a LayerPolicy with its time per layer per step and the device bytes it keeps between
// forward and backward), how many layers run each, so that the step is fastest and the kept bytes
// fit the budget:
//
//   min  sum_j n_j * time_j
//   s.t. sum_j n_j * device_bytes_j <= budget_bytes,   sum_j n_j = layers,   n_j integer >= 0
//
// solved by COIN-OR CBC (docs/dependencies.md), then placed along the model (PlaceLayers). This is
// the solver alone: AutoPolicy's measurements feed it (not in this build yet); a solved layout is
// written as a policy file (LayerLayout) that a job runs with runtime.policy.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/policy/layer_policy.h"

namespace slidedp {

struct LayerCandidate {
  LayerPolicy policy;
  double time_s = 0;         // the candidate's forward + backward time for one layer (recompute included)
  int64_t device_bytes = 0;  // what one such layer keeps on the device from its forward to its backward
};

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

// The layers in model order (first decoder layer first) for `counts`: offloaded layers first (their
// backward comes last, so their checkpoints have the longest to come back, and they leave the
// device first in forward), then layers that keep only their input, then the layers that keep more
// on the device, the most at the end, where backward reaches them first and frees their memory
// soonest.
std::vector<LayerPolicy> PlaceLayers(const std::vector<LayerCandidate>& candidates, const std::vector<int64_t>& counts);

}  // namespace slidedp
