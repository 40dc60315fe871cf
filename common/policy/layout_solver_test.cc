// The layer-count MILP against enumeration of every mix on random small problems (the optimum's
// time, the budget kept), the infeasible and malformed problems, and the placement rule.
#include "common/policy/layout_solver.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>

namespace slidedp {
namespace {

// The best time of any mix of `layers` layers fitting the budget, by enumeration; -1 if none fits.
double BestByEnumeration(const std::vector<LayerCandidate>& c, int64_t layers, int64_t budget) {
  double best = -1;
  std::vector<int64_t> n(c.size(), 0);
  std::function<void(size_t, int64_t)> go = [&](size_t j, int64_t left) {
    if (j + 1 == c.size()) {
      n[j] = left;
      double t = 0;
      int64_t bytes = 0;
      for (size_t k = 0; k < c.size(); ++k) {
        t += n[k] * c[k].time_s;
        bytes += n[k] * c[k].device_bytes;
      }
      if (bytes <= budget && (best < 0 || t < best)) best = t;
      return;
    }
    for (int64_t k = 0; k <= left; ++k) {
      n[j] = k;
      go(j + 1, left - k);
    }
  };
  go(0, layers);
  return best;
}

TEST(LayoutSolver, MatchesEnumerationOnRandomProblems) {
  std::mt19937 rng(5);
  constexpr int64_t kMiB = 1 << 20;
  int solved = 0, infeasible = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int k = 2 + static_cast<int>(rng() % 4);
    const int64_t layers = 1 + rng() % 12;
    std::vector<LayerCandidate> c(k);
    for (int j = 0; j < k; ++j) {
      c[j].policy = {static_cast<LayerKind>(j % 3), j >= 3};
      c[j].time_s = 0.001 * (1 + rng() % 1000);
      c[j].device_bytes = static_cast<int64_t>(rng() % 2048) * kMiB;
    }
    // Half a MiB off any sum of whole MiBs: the optimum never sits on the boundary.
    const int64_t budget = static_cast<int64_t>(rng() % (2048 * layers)) * kMiB + kMiB / 2;
    const double want = BestByEnumeration(c, layers, budget);
    auto got = SolveLayerCounts(c, layers, budget);
    if (want < 0) {
      ASSERT_FALSE(got.ok()) << "trial " << trial;
      EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
      ++infeasible;
      continue;
    }
    ASSERT_TRUE(got.ok()) << "trial " << trial << ": " << got.status();
    EXPECT_NEAR(got->time_s, want, 1e-9) << "trial " << trial;
    EXPECT_LE(got->device_bytes, budget) << "trial " << trial;
    int64_t total = 0;
    for (int64_t n : got->counts) total += n;
    EXPECT_EQ(total, layers);
    ++solved;
  }
  EXPECT_GT(solved, 50);
  EXPECT_GT(infeasible, 5);
}

TEST(LayoutSolver, ModelSizedProblemIsOptimal) {
  // 64 layers, 12 candidates (the size AutoPolicy poses for a Qwen3-32B-class model), candidate j
  // keeping j units of 700 MiB: the optimum by dynamic programming over (layers, units).
  constexpr int64_t kUnit = 700ll << 20;
  constexpr int kLayers = 64, kCands = 12;
  const int64_t budget = 100ll << 30;
  std::vector<LayerCandidate> c;
  for (int j = 0; j < kCands; ++j) {
    c.push_back({{static_cast<LayerKind>(j % 3), j % 2 == 1}, 0.10 - 0.006 * j + 0.0003 * (j % 4), j * kUnit});
  }
  const int units = static_cast<int>(budget / kUnit);
  // best[l][u]: the least time of l layers keeping at most u units.
  std::vector<std::vector<double>> best(kLayers + 1, std::vector<double>(units + 1, 1e30));
  for (int u = 0; u <= units; ++u) best[0][u] = 0;
  for (int l = 1; l <= kLayers; ++l) {
    for (int u = 0; u <= units; ++u) {
      for (int j = 0; j < kCands; ++j) {
        if (j <= u) best[l][u] = std::min(best[l][u], best[l - 1][u - j] + c[j].time_s);
      }
    }
  }
  auto got = SolveLayerCounts(c, kLayers, budget, 5);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LE(got->device_bytes, budget);
  EXPECT_NEAR(got->time_s, best[kLayers][units], 1e-9);
}

TEST(LayoutSolver, MalformedProblemsAreInvalidArgument) {
  const std::vector<LayerCandidate> ok = {{{LayerKind::kRecompute, false}, 1.0, 10}};
  EXPECT_EQ(SolveLayerCounts({}, 4, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SolveLayerCounts(ok, 0, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SolveLayerCounts(ok, 4, -1).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<LayerCandidate> bad = ok;
  bad[0].time_s = std::nan("");
  EXPECT_EQ(SolveLayerCounts(bad, 4, 100).status().code(), absl::StatusCode::kInvalidArgument);
  bad[0].time_s = 1;
  bad[0].device_bytes = -5;
  EXPECT_EQ(SolveLayerCounts(bad, 4, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SolveLayerCounts(ok, 11, 100).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(LayoutSolver, PlacementPutsOffloadFirstAndTheMostKeptLast) {
  const std::vector<LayerCandidate> c = {
      {{LayerKind::kKeepAll, false}, 1.0, 900},
      {{LayerKind::kRecompute, true}, 1.5, 0},
      {{LayerKind::kRecompute, false}, 1.4, 10},
      {{LayerKind::kSelective, false}, 1.2, 300},
  };
  const std::vector<LayerPolicy> got = PlaceLayers(c, {2, 1, 2, 1});
  const std::vector<LayerPolicy> want = {{LayerKind::kRecompute, true},  {LayerKind::kRecompute, false},
                                         {LayerKind::kRecompute, false}, {LayerKind::kSelective, false},
                                         {LayerKind::kKeepAll, false},   {LayerKind::kKeepAll, false}};
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace slidedp
