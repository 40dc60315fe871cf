// The layer-count MILP against enumeration of every mix on random small problems (the optimum's
// time, the budget kept), the infeasible and malformed problems, and the placement rule.
#include "common/policy/layout_solver.h"

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <tuple>
#include <utility>

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
      c[j].policy = {static_cast<LayerKind>(j % 3), j >= 3 ? 1.0 : 0.0};
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
    c.push_back({{static_cast<LayerKind>(j % 3), j % 2 == 1 ? 1.0 : 0.0}, 0.10 - 0.006 * j + 0.0003 * (j % 4), j * kUnit});
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

// The whole step model: random problems where offloading trades PCIe time and pinned host memory
// for device bytes, against enumeration of every mix through PredictPolicy.
TEST(LayoutSolver, StepModelMatchesEnumeration) {
  std::mt19937 rng(11);
  constexpr int64_t kMiB = 1 << 20;
  int solved = 0, copy_bound = 0, paced = 0;
  for (int trial = 0; trial < 150; ++trial) {
    PolicyProblem p;
    p.layers = 1 + rng() % 10;
    const int64_t ckpt = (64 + rng() % 512) * kMiB;
    const double rec = 0.01 * (50 + rng() % 50), sel = rec * (0.8 + 0.01 * (rng() % 10)), all = rec * 0.7;
    const int64_t sel_bytes = (rng() % 256) * kMiB, all_bytes = (1024 + rng() % 4096) * kMiB;
    for (bool off : {false, true}) {
      for (auto [kind, t, bytes] : {std::tuple{LayerKind::kRecompute, rec, int64_t{0}},
                                    std::tuple{LayerKind::kSelective, sel, sel_bytes},
                                    std::tuple{LayerKind::kKeepAll, all, all_bytes}}) {
        LayerCandidate c{{kind, off ? 1.0 : 0.0}, t, bytes + (off ? 0 : ckpt)};
        if (off) c.host_bytes = c.h2d_bytes = c.d2h_bytes = ckpt;
        if (trial % 3 != 0) c.forward_s = t * 0.01 * (25 + rng() % 15);  // a third unmeasured: no pace rows
        p.candidates.push_back(c);
      }
    }
    p.device_budget_bytes = static_cast<int64_t>(rng() % (3000 * p.layers)) * kMiB + kMiB / 2;
    p.host_budget_bytes = rng() % 2 ? -1 : static_cast<int64_t>(rng() % (600 * p.layers)) * kMiB + kMiB / 2;
    p.base.compute_s = 0.2;
    p.base.h2d_s = 0.01 * (rng() % 100);
    p.base.d2h_s = 0.01 * (rng() % 100);
    p.base.host_s = 0.01 * (rng() % 150);
    p.base.exposed_s = 0.05;
    p.base.h2d_bytes_per_s = p.base.d2h_bytes_per_s = (1 + rng() % 20) * 1e9;
    // Enumeration over the six counts.
    double want = -1;
    std::vector<int64_t> n(p.candidates.size(), 0);
    std::function<void(size_t, int64_t)> go = [&](size_t j, int64_t left) {
      if (j + 1 == n.size()) {
        n[j] = left;
        const LayoutSolution e = PredictPolicy(p, n);
        const bool fits = e.device_bytes <= p.device_budget_bytes &&
                          (p.host_budget_bytes < 0 || e.host_bytes <= p.host_budget_bytes) && CopiesKeepPace(p, n);
        paced += fits ? 0 : !CopiesKeepPace(p, n);
        if (fits && (want < 0 || e.step_s < want)) want = e.step_s;
        return;
      }
      for (int64_t k = 0; k <= left; ++k) n[j] = k, go(j + 1, left - k);
    };
    go(0, p.layers);
    auto got = SolvePolicy(p);
    if (want < 0) {
      ASSERT_FALSE(got.ok()) << "trial " << trial;
      EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
      continue;
    }
    ASSERT_TRUE(got.ok()) << "trial " << trial << ": " << got.status();
    EXPECT_NEAR(got->step_s, want, 1e-6) << "trial " << trial;
    EXPECT_LE(got->device_bytes, p.device_budget_bytes);
    if (p.host_budget_bytes >= 0) {
      EXPECT_LE(got->host_bytes, p.host_budget_bytes);
    }
    copy_bound += got->bottleneck != "GPU compute";
    ++solved;
  }
  EXPECT_GT(solved, 50);
  EXPECT_GT(copy_bound, 5);
  EXPECT_GT(paced, 100);  // mixes the copies' pace ruled out
}

TEST(LayoutSolver, PredictionNamesTheBottleneck) {
  PolicyProblem p;
  p.layers = 2;
  p.candidates = {{{LayerKind::kRecompute, true}, 1.0, 0, 100, 4'000'000'000, 4'000'000'000}};
  p.base.compute_s = 1;
  p.base.h2d_s = 1;
  p.base.h2d_bytes_per_s = p.base.d2h_bytes_per_s = 1e9;
  p.base.exposed_s = 0.5;
  const LayoutSolution e = PredictPolicy(p, {2});
  EXPECT_DOUBLE_EQ(e.compute_s, 3);
  EXPECT_DOUBLE_EQ(e.h2d_s, 9);
  EXPECT_DOUBLE_EQ(e.d2h_s, 8);
  EXPECT_DOUBLE_EQ(e.step_s, 9.5);
  EXPECT_EQ(e.bottleneck, "host-to-device copies");
  EXPECT_EQ(e.host_bytes, 200);
}

// A model whose layers keep nothing (qwen3_5): its keeping candidates hold and move exactly what
// recompute does at their offload share, so they are recompute by another name and get no layer,
// even where noise measured them faster. Where they keep more (any other model), they compete.
TEST(LayoutSolver, CandidatesKeepingNothingMoreThanRecomputeAreNotOffered) {
  constexpr int64_t kCkpt = 100 << 20;
  PolicyProblem p;
  p.layers = 8;
  p.device_budget_bytes = int64_t{64} << 30;
  p.host_budget_bytes = int64_t{64} << 30;
  p.base.compute_s = 1;
  p.base.h2d_bytes_per_s = p.base.d2h_bytes_per_s = 25e9;
  for (double off : {0.0, 1.0}) {
    for (auto [kind, time_s] : {std::pair{LayerKind::kRecompute, 0.100}, std::pair{LayerKind::kSelective, 0.099},
                                std::pair{LayerKind::kKeepAll, 0.098}}) {
      LayerCandidate c{{kind, off}, time_s, off > 0 ? 0 : kCkpt};
      if (off > 0) c.host_bytes = c.h2d_bytes = c.d2h_bytes = kCkpt;
      c.in_flight_bytes = off > 0 ? 4 * kCkpt : 0;
      p.candidates.push_back(c);
    }
  }
  auto got = SolvePolicy(p);
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t j = 0; j < p.candidates.size(); ++j) {
    if (p.candidates[j].policy.kind != LayerKind::kRecompute) {
      EXPECT_EQ(got->counts[j], 0) << LayerPolicyName(p.candidates[j].policy);
    }
  }
  EXPECT_EQ(got->counts[0], 8);  // on the device: nothing to gain by crossing PCIe
  for (const LayerPolicy& l : PlaceLayers(p.candidates, got->counts)) EXPECT_EQ(l.pieces(), 0u);
  // Keeping a byte more is a real choice, and keep_all's speed wins it.
  for (LayerCandidate& c : p.candidates) c.device_bytes += c.policy.kind == LayerKind::kKeepAll ? 1 : 0;
  got = SolvePolicy(p);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->counts[2], 8);
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
