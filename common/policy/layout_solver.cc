// The layer-count MILP on COIN-OR CBC, and the placement of its counts; see layout_solver.h.
#include "common/policy/layout_solver.h"

#include <Cbc_C_Interface.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp {
namespace {

// CBC's model, deleted on every return.
struct CbcModel {
  Cbc_Model* m = Cbc_newModel();
  ~CbcModel() { Cbc_deleteModel(m); }
};

}  // namespace

namespace {

// Whether the pace rows apply: copies cost time and the forward was measured.
bool PacedCopies(const PolicyProblem& problem) {
  const StepBase& b = problem.base;
  if (b.h2d_bytes_per_s <= 0 || b.d2h_bytes_per_s <= 0) return false;
  for (const LayerCandidate& c : problem.candidates) {
    if (c.forward_s > 0) return true;
  }
  return false;
}

}  // namespace

bool CopiesKeepPace(const PolicyProblem& problem, const std::vector<int64_t>& counts, double slack_s) {
  if (!PacedCopies(problem)) return true;
  const StepBase& b = problem.base;
  double out = 0, back = 0;
  for (size_t j = 0; j < counts.size() && j < problem.candidates.size(); ++j) {
    const LayerCandidate& c = problem.candidates[j];
    const double n = static_cast<double>(counts[j]);
    out += n * (static_cast<double>(c.d2h_bytes) / b.d2h_bytes_per_s - c.forward_s);
    back += n * (static_cast<double>(c.h2d_bytes) / b.h2d_bytes_per_s - (c.time_s - c.forward_s));
  }
  return out <= slack_s && back <= slack_s;
}

LayoutSolution PredictPolicy(const PolicyProblem& problem, const std::vector<int64_t>& counts) {
  const StepBase& b = problem.base;
  LayoutSolution p;
  p.counts = counts;
  double h2d_bytes = 0, d2h_bytes = 0;
  p.compute_s = b.compute_s;
  for (size_t j = 0; j < counts.size() && j < problem.candidates.size(); ++j) {
    const LayerCandidate& c = problem.candidates[j];
    const double n = static_cast<double>(counts[j]);
    p.compute_s += n * c.time_s;
    h2d_bytes += n * static_cast<double>(c.h2d_bytes);
    d2h_bytes += n * static_cast<double>(c.d2h_bytes);
    p.device_bytes += counts[j] * c.device_bytes;
    p.host_bytes += counts[j] * c.host_bytes;
  }
  int64_t in_flight = 0;
  for (size_t j = 0; j < counts.size() && j < problem.candidates.size(); ++j) {
    if (counts[j] > 0) in_flight = std::max(in_flight, problem.candidates[j].in_flight_bytes);
  }
  p.device_bytes += in_flight;
  p.h2d_s = b.h2d_s + (b.h2d_bytes_per_s > 0 ? h2d_bytes / b.h2d_bytes_per_s : 0);
  p.d2h_s = b.d2h_s + (b.d2h_bytes_per_s > 0 ? d2h_bytes / b.d2h_bytes_per_s : 0);
  p.host_s = b.host_s;
  const std::pair<double, const char*> busy[] = {{p.compute_s, "GPU compute"},
                                                 {p.h2d_s, "host-to-device copies"},
                                                 {p.d2h_s, "device-to-host copies"},
                                                 {p.host_s, "host updates"}};
  double most = -1;
  for (const auto& [t, name] : busy) {
    if (t > most) most = t, p.bottleneck = name;
  }
  p.step_s = most + b.exposed_s;
  return p;
}

namespace {

constexpr double kSolverGap = 1e-4;
// A solve out of time keeps its best layout when it is within this fraction of the bound.
constexpr double kAcceptedGap = 5e-3;
// The in-flight levels SolvePolicy tries at most (quantiles of the candidates', always the largest).
constexpr size_t kMaxInFlightLevels = 6;
// The time one CBC solve may take.
constexpr double kSolveSeconds = 2.0;

// The MILP without in-flight room: `problem`'s candidates, its budgets as given. Returns the
// counts of the least T, then the least compute and copy time among the layouts within a hair of it.
absl::StatusOr<std::vector<int64_t>> SolveCounts(const PolicyProblem& problem, double max_seconds) {
  const std::vector<LayerCandidate>& candidates = problem.candidates;
  const int64_t layers = problem.layers;
  const StepBase& b = problem.base;
  const bool host_bounded = problem.host_budget_bytes >= 0;
  int64_t least_bytes = candidates[0].device_bytes, least_host = candidates[0].host_bytes;
  int64_t most_bytes = 1, most_host = 1;
  for (const LayerCandidate& c : candidates) {
    least_bytes = std::min(least_bytes, c.device_bytes);
    least_host = std::min(least_host, c.host_bytes);
    most_bytes = std::max(most_bytes, c.device_bytes);
    most_host = std::max(most_host, c.host_bytes);
  }
  // Bytes in units of the largest candidate's keep the coefficients in [0, 1] for the LP
  // relaxation; the answer is checked on exact integers by SolvePolicy.
  const double kScale = 1.0 / static_cast<double>(most_bytes), kHostScale = 1.0 / static_cast<double>(most_host);
  const int n = static_cast<int>(candidates.size());
  const int t_col = n;  // T, the step's bound
  const bool paced = PacedCopies(problem);
  // Rows: 0 layer count, 1 device bytes, 2 host bytes, 3 compute, 4 H2D, 5 D2H (the last three as
  // T - sum_j n_j x_j >= base), 6 and 7 the copies' pace (CopiesKeepPace).
  std::vector<CoinBigIndex> start(n + 2);
  std::vector<int> index;
  std::vector<double> value, col_lb(n + 1, 0.0), col_ub(n + 1, static_cast<double>(layers)), obj(n + 1, 0.0);
  auto add = [&](int row, double v) {
    if (v != 0) index.push_back(row), value.push_back(v);
  };
  for (int j = 0; j < n; ++j) {
    const LayerCandidate& c = candidates[j];
    start[j] = static_cast<CoinBigIndex>(index.size());
    add(0, 1.0);
    add(1, static_cast<double>(c.device_bytes) * kScale);
    add(2, static_cast<double>(c.host_bytes) * kHostScale);
    add(3, -c.time_s);
    add(4, b.h2d_bytes_per_s > 0 ? -static_cast<double>(c.h2d_bytes) / b.h2d_bytes_per_s : 0);
    add(5, b.d2h_bytes_per_s > 0 ? -static_cast<double>(c.d2h_bytes) / b.d2h_bytes_per_s : 0);
    if (paced) {
      add(6, static_cast<double>(c.d2h_bytes) / b.d2h_bytes_per_s - c.forward_s);
      add(7, static_cast<double>(c.h2d_bytes) / b.h2d_bytes_per_s - (c.time_s - c.forward_s));
    }
  }
  start[n] = static_cast<CoinBigIndex>(index.size());
  for (int row = 3; row <= 5; ++row) add(row, 1.0);
  start[n + 1] = static_cast<CoinBigIndex>(index.size());
  col_lb[t_col] = b.host_s;
  col_ub[t_col] = std::numeric_limits<double>::max();
  obj[t_col] = 1.0;
  const double inf = std::numeric_limits<double>::max();
  const double rows_lb[] = {static_cast<double>(layers), -inf, -inf, b.compute_s, b.h2d_s, b.d2h_s, -inf, -inf};
  const double rows_ub[] = {static_cast<double>(layers),
                            static_cast<double>(problem.device_budget_bytes) * kScale,
                            host_bounded ? static_cast<double>(problem.host_budget_bytes) * kHostScale : inf,
                            inf,
                            inf,
                            inf,
                            paced ? 0.0 : inf,
                            paced ? 0.0 : inf};
  auto solve = [&](const std::vector<double>& objective, double t_upper) -> absl::StatusOr<std::vector<double>> {
    CbcModel model;
    std::vector<double> ub = col_ub;
    ub[t_col] = t_upper;
    Cbc_loadProblem(model.m, n + 1, 8, start.data(), index.data(), value.data(), col_lb.data(), ub.data(),
                    objective.data(), rows_lb, rows_ub);
    for (int j = 0; j < n; ++j) Cbc_setInteger(model.m, j);
    Cbc_setLogLevel(model.m, 0);
    Cbc_setMaximumSeconds(model.m, max_seconds);
    // Optimal within kSolverGap of the objective: the copies' pace rows make proving the last
    // fraction of a percent slow, far below what the measurements resolve.
    Cbc_setAllowableFractionGap(model.m, kSolverGap);
    Cbc_solve(model.m);
    if (Cbc_isProvenInfeasible(model.m) || static_cast<double>(least_bytes) * layers > problem.device_budget_bytes ||
        (host_bounded && static_cast<double>(least_host) * layers > problem.host_budget_bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "layout solver: no layout of ", layers, " layers fits ", problem.device_budget_bytes, " device bytes",
          host_bounded ? absl::StrCat(" and ", problem.host_budget_bytes, " pinned host bytes") : "",
          "; the leanest candidate keeps ", least_bytes, " bytes a layer on the device (", least_bytes * layers,
          " for all)"));
    }
    if (!Cbc_isProvenOptimal(model.m)) {
      // Out of time: the best layout found stands when it is provably within kAcceptedGap.
      const double* incumbent = Cbc_bestSolution(model.m);
      const double value = Cbc_getObjValue(model.m), bound = Cbc_getBestPossibleObjValue(model.m);
      if (incumbent == nullptr || !(value - bound <= kAcceptedGap * std::max(std::fabs(value), 1e-12))) {
        return absl::DeadlineExceededError(absl::StrCat("layout solver: no layout within ", 100 * kAcceptedGap,
                                                        "% of the optimum in ", max_seconds, " s (", n,
                                                        " candidates, ", layers, " layers)"));
      }
      return std::vector<double>(incumbent, incumbent + n + 1);
    }
    const double* x = Cbc_getColSolution(model.m);
    return std::vector<double>(x, x + n + 1);
  };
  ASSIGN_OR_RETURN(std::vector<double> first, solve(obj, std::numeric_limits<double>::max()));
  std::vector<double> busy(n + 1, 0.0);
  for (int j = 0; j < n; ++j) {
    const LayerCandidate& c = candidates[j];
    // A backend without a copy rate (the CPU backend) still prefers not to copy: 10 GB/s nominal.
    busy[j] = c.time_s + static_cast<double>(c.h2d_bytes) / (b.h2d_bytes_per_s > 0 ? b.h2d_bytes_per_s : 1e10) +
              static_cast<double>(c.d2h_bytes) / (b.d2h_bytes_per_s > 0 ? b.d2h_bytes_per_s : 1e10);
  }
  const double t_best = first[t_col];
  absl::StatusOr<std::vector<double>> second = solve(busy, t_best + std::max(1e-9, 1e-7 * t_best));
  const std::vector<double>& x = second.ok() ? *second : first;
  std::vector<int64_t> counts;
  for (int j = 0; j < n; ++j) counts.push_back(std::llround(x[j]));
  return counts;
}

// The compute and copy time of `counts`, SolveCounts' second objective.
double BusyTime(const PolicyProblem& problem, const std::vector<int64_t>& counts) {
  const LayoutSolution p = PredictPolicy(problem, counts);
  return p.compute_s + p.h2d_s + p.d2h_s;
}

// Whether candidate j is recompute under another name: it names pieces to keep, yet holds and moves
// exactly the bytes of a recompute candidate of its offload share, so its layers keep nothing
// (qwen3_5's: ModelShape::layers_keep_pieces) and it recomputes as much; a measured difference in
// time is noise. Such a candidate is not offered.
bool KeepsNothingMore(const std::vector<LayerCandidate>& candidates, size_t j) {
  const LayerCandidate& c = candidates[j];
  if (c.policy.pieces() == 0) return false;
  return std::any_of(candidates.begin(), candidates.end(), [&c](const LayerCandidate& r) {
    return r.policy.kind == LayerKind::kRecompute && r.policy.offload == c.policy.offload &&
           r.device_bytes == c.device_bytes && r.host_bytes == c.host_bytes && r.h2d_bytes == c.h2d_bytes &&
           r.d2h_bytes == c.d2h_bytes && r.in_flight_bytes == c.in_flight_bytes;
  });
}

}  // namespace

absl::StatusOr<LayoutSolution> SolvePolicy(const PolicyProblem& problem, double max_seconds) {
  const std::vector<LayerCandidate>& candidates = problem.candidates;
  const int64_t layers = problem.layers;
  const StepBase& b = problem.base;
  if (candidates.empty()) return absl::InvalidArgumentError("layout solver: no candidates");
  if (layers <= 0 || layers > kMaxPolicyLayers) {
    return absl::InvalidArgumentError(absl::StrCat("layout solver: ", layers, " layers"));
  }
  if (problem.device_budget_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("layout solver: budget ", problem.device_budget_bytes));
  }
  for (double v : {b.compute_s, b.h2d_s, b.d2h_s, b.host_s, b.exposed_s, b.h2d_bytes_per_s, b.d2h_bytes_per_s}) {
    if (!std::isfinite(v) || v < 0) return absl::InvalidArgumentError(absl::StrCat("layout solver: step cost ", v));
  }
  std::vector<int64_t> in_flight = {0};
  for (const LayerCandidate& c : candidates) {
    if (!std::isfinite(c.time_s) || c.time_s < 0 || !std::isfinite(c.forward_s) || c.forward_s < 0 ||
        c.forward_s > c.time_s || c.device_bytes < 0 || c.host_bytes < 0 || c.h2d_bytes < 0 || c.d2h_bytes < 0 ||
        c.in_flight_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat("layout solver: candidate ", LayerPolicyName(c.policy),
                                                     " has time ", c.time_s, " s (forward ", c.forward_s, " s) and ",
                                                     c.device_bytes, " bytes"));
    }
    in_flight.push_back(c.in_flight_bytes);
  }
  std::sort(in_flight.begin(), in_flight.end());
  in_flight.erase(std::unique(in_flight.begin(), in_flight.end()), in_flight.end());
  if (in_flight.size() > kMaxInFlightLevels) {
    // None, the largest, and quantiles between: a candidate moving less than a level counts at it.
    std::vector<int64_t> levels;
    for (size_t q = 0; q < kMaxInFlightLevels; ++q) {
      levels.push_back(in_flight[q * (in_flight.size() - 1) / (kMaxInFlightLevels - 1)]);
    }
    levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
    in_flight = std::move(levels);
  }
  // The in-flight room is the most of the candidates a layout uses: for each level m, the layouts
  // of the candidates moving at most m, in the budget less m; the best of the levels wins.
  std::optional<LayoutSolution> best;
  double best_busy = 0;
  absl::Status last = absl::OkStatus();
  for (int64_t m : in_flight) {
    if (m > problem.device_budget_bytes) break;
    PolicyProblem sub = problem;
    sub.device_budget_bytes -= m;
    std::vector<int> index;  // sub's candidate -> problem's
    sub.candidates.clear();
    for (size_t j = 0; j < candidates.size(); ++j) {
      if (candidates[j].in_flight_bytes <= m && !KeepsNothingMore(candidates, j)) {
        LayerCandidate c = candidates[j];
        c.in_flight_bytes = 0;
        sub.candidates.push_back(c);
        index.push_back(static_cast<int>(j));
      }
    }
    absl::StatusOr<std::vector<int64_t>> got = SolveCounts(sub, std::min(max_seconds, kSolveSeconds));
    if (!got.ok()) {
      if (got.status().code() != absl::StatusCode::kResourceExhausted || last.ok()) last = got.status();
      continue;
    }
    std::vector<int64_t> counts(candidates.size(), 0);
    for (size_t k = 0; k < index.size(); ++k) counts[index[k]] = (*got)[k];
    LayoutSolution plan = PredictPolicy(problem, counts);
    const double busy = BusyTime(problem, counts);
    const double tie = std::max(1e-9, 1e-7 * plan.step_s);
    if (!best || plan.step_s < best->step_s - tie || (plan.step_s <= best->step_s + tie && busy < best_busy)) {
      best = std::move(plan);
      best_busy = busy;
    }
  }
  if (!best) {
    if (!last.ok() && last.code() != absl::StatusCode::kResourceExhausted) return last;
    return absl::ResourceExhaustedError(absl::StrCat("layout solver: no layout of ", layers, " layers fits ",
                                                     problem.device_budget_bytes, " device bytes",
                                                     problem.host_budget_bytes >= 0
                                                         ? absl::StrCat(" and ", problem.host_budget_bytes,
                                                                        " pinned host bytes")
                                                         : "",
                                                     last.ok() ? "" : absl::StrCat(" (", last.message(), ")")));
  }
  LayoutSolution& out = *best;
  int64_t most_bytes = 1, most_host = 1;
  for (const LayerCandidate& c : candidates) {
    most_bytes = std::max({most_bytes, c.device_bytes, c.in_flight_bytes});
    most_host = std::max(most_host, c.host_bytes);
  }
  // The solver works in floating point: check the answer exactly.
  if (std::accumulate(out.counts.begin(), out.counts.end(), int64_t{0}) != layers ||
      !CopiesKeepPace(problem, out.counts, 1e-6) ||
      static_cast<double>(out.device_bytes) > problem.device_budget_bytes + 1e-6 * static_cast<double>(most_bytes) ||
      (problem.host_budget_bytes >= 0 &&
       static_cast<double>(out.host_bytes) > problem.host_budget_bytes + 1e-6 * static_cast<double>(most_host))) {
    return absl::InternalError(absl::StrCat("layout solver: CBC's answer keeps ", out.device_bytes, " device and ",
                                            out.host_bytes, " host bytes over ", layers, " layers against budgets of ",
                                            problem.device_budget_bytes, " and ", problem.host_budget_bytes));
  }
  return out;
}

absl::StatusOr<LayerCounts> SolveLayerCounts(const std::vector<LayerCandidate>& candidates, int64_t layers,
                                             int64_t budget_bytes, double max_seconds) {
  PolicyProblem problem;
  problem.candidates = candidates;
  problem.layers = layers;
  problem.device_budget_bytes = budget_bytes;
  ASSIGN_OR_RETURN(LayoutSolution plan, SolvePolicy(problem, max_seconds));
  LayerCounts out;
  out.counts = plan.counts;
  out.time_s = plan.compute_s;
  out.device_bytes = plan.device_bytes;
  return out;
}

std::string MixName(const std::vector<LayerCandidate>& candidates, const std::vector<int64_t>& counts) {
  std::string out;
  for (size_t j = 0; j < candidates.size() && j < counts.size(); ++j) {
    if (counts[j] == 0) continue;
    absl::StrAppend(&out, out.empty() ? "" : ", ", counts[j], " ", LayerPolicyName(candidates[j].policy));
  }
  return out;
}

std::vector<LayerPolicy> PlaceLayers(const std::vector<LayerCandidate>& candidates,
                                     const std::vector<int64_t>& counts) {
  std::vector<size_t> order(std::min(candidates.size(), counts.size()));
  std::iota(order.begin(), order.end(), 0);
  // The most offloaded first, then by the device bytes kept, least first; ties keep the
  // candidates' order.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (candidates[a].policy.offload != candidates[b].policy.offload) {
      return candidates[a].policy.offload > candidates[b].policy.offload;
    }
    return candidates[a].device_bytes < candidates[b].device_bytes;
  });
  std::vector<LayerPolicy> out;
  for (size_t j : order) {
    for (int64_t k = 0; k < counts[j]; ++k) out.push_back(candidates[j].policy);
  }
  return out;
}

}  // namespace slidedp
