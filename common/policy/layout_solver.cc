// The layer-count MILP on COIN-OR CBC, and the placement of its counts; see layout_solver.h.
#include "common/policy/layout_solver.h"

#include <Cbc_C_Interface.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace slidedp {
namespace {

// CBC's model, deleted on every return.
struct CbcModel {
  Cbc_Model* m = Cbc_newModel();
  ~CbcModel() { Cbc_deleteModel(m); }
};

}  // namespace

absl::StatusOr<LayerCounts> SolveLayerCounts(const std::vector<LayerCandidate>& candidates, int64_t layers,
                                             int64_t budget_bytes, double max_seconds) {
  if (candidates.empty()) return absl::InvalidArgumentError("layout solver: no candidates");
  if (layers <= 0 || layers > kMaxPolicyLayers) {
    return absl::InvalidArgumentError(absl::StrCat("layout solver: ", layers, " layers"));
  }
  if (budget_bytes < 0) return absl::InvalidArgumentError(absl::StrCat("layout solver: budget ", budget_bytes));
  int64_t least_bytes = candidates[0].device_bytes;
  for (const LayerCandidate& c : candidates) {
    if (!std::isfinite(c.time_s) || c.time_s < 0 || c.device_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("layout solver: candidate ", LayerKindName(c.policy.kind),
                                                     " has time ", c.time_s, " s and ", c.device_bytes, " bytes"));
    }
    least_bytes = std::min(least_bytes, c.device_bytes);
  }
  // Bytes in units of the largest candidate's keep the coefficients in [0, 1] for the LP
  // relaxation; the answer is checked on exact integers below, up to the solver's tolerance.
  int64_t most_bytes = 1;
  for (const LayerCandidate& c : candidates) most_bytes = std::max(most_bytes, c.device_bytes);
  const double kScale = 1.0 / static_cast<double>(most_bytes);
  const int n = static_cast<int>(candidates.size());
  std::vector<CoinBigIndex> start(n + 1);
  std::vector<int> index;
  std::vector<double> value, col_lb(n, 0.0), col_ub(n, static_cast<double>(layers)), obj(n);
  for (int j = 0; j < n; ++j) {
    start[j] = static_cast<CoinBigIndex>(index.size());
    index.push_back(0);  // row 0: the layer count
    value.push_back(1.0);
    index.push_back(1);  // row 1: the kept bytes
    value.push_back(static_cast<double>(candidates[j].device_bytes) * kScale);
    obj[j] = candidates[j].time_s;
  }
  start[n] = static_cast<CoinBigIndex>(index.size());
  const double rows_lb[] = {static_cast<double>(layers), -std::numeric_limits<double>::max()};
  const double rows_ub[] = {static_cast<double>(layers), static_cast<double>(budget_bytes) * kScale};
  CbcModel model;
  Cbc_loadProblem(model.m, n, 2, start.data(), index.data(), value.data(), col_lb.data(), col_ub.data(), obj.data(),
                  rows_lb, rows_ub);
  for (int j = 0; j < n; ++j) Cbc_setInteger(model.m, j);
  Cbc_setLogLevel(model.m, 0);
  Cbc_setMaximumSeconds(model.m, max_seconds);
  Cbc_solve(model.m);
  if (Cbc_isProvenInfeasible(model.m) || static_cast<double>(least_bytes) * layers > budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("layout solver: no layout of ", layers, " layers fits ",
                                                     budget_bytes, " bytes; the leanest candidate keeps ", least_bytes,
                                                     " bytes a layer (", least_bytes * layers, " for all)"));
  }
  if (!Cbc_isProvenOptimal(model.m)) {
    return absl::DeadlineExceededError(absl::StrCat("layout solver: no proven optimum in ", max_seconds, " s (", n,
                                                    " candidates, ", layers, " layers)"));
  }
  const double* x = Cbc_getColSolution(model.m);
  LayerCounts out;
  for (int j = 0; j < n; ++j) {
    const int64_t c = std::llround(x[j]);
    out.counts.push_back(c);
    out.time_s += static_cast<double>(c) * candidates[j].time_s;
    out.device_bytes += c * candidates[j].device_bytes;
  }
  // The solver works in floating point: check the answer exactly.
  const double tolerance = 1e-6 * static_cast<double>(most_bytes);
  if (std::accumulate(out.counts.begin(), out.counts.end(), int64_t{0}) != layers ||
      static_cast<double>(out.device_bytes) > static_cast<double>(budget_bytes) + tolerance) {
    return absl::InternalError(absl::StrCat("layout solver: CBC's answer keeps ", out.device_bytes, " bytes over ",
                                            layers, " layers against a budget of ", budget_bytes));
  }
  return out;
}

std::vector<LayerPolicy> PlaceLayers(const std::vector<LayerCandidate>& candidates,
                                     const std::vector<int64_t>& counts) {
  std::vector<size_t> order(std::min(candidates.size(), counts.size()));
  std::iota(order.begin(), order.end(), 0);
  // Offloaded first, then by the device bytes kept, least first; ties keep the candidates' order.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (candidates[a].policy.offload != candidates[b].policy.offload) return candidates[a].policy.offload;
    return candidates[a].device_bytes < candidates[b].device_bytes;
  });
  std::vector<LayerPolicy> out;
  for (size_t j : order) {
    for (int64_t k = 0; k < counts[j]; ++k) out.push_back(candidates[j].policy);
  }
  return out;
}

}  // namespace slidedp
