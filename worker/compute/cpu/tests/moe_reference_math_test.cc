// Tests of the Qwen3-MoE block reference math on awkward sizes (hidden 24, moe_intermediate 10,
// 7 experts, 13 tokens, top-2 and top-3), each with a fixed seed: forward against a naive
// per-token double implementation, gradients against finite differences, top-k tie order, experts
// that receive no token, HF's auxiliary loss written out directly, and thread-count independence.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/cpu/cpu_worker_pool.h"
#include "worker/compute/cpu/moe_reference_math.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

constexpr int64_t kHidden = 24;
constexpr int64_t kIntermediate = 10;
constexpr int64_t kExperts = 7;
constexpr int64_t kTokens = 13;

MoeDims Dims(int64_t top_k, bool norm_topk_prob) {
  MoeDims d;
  d.hidden = kHidden;
  d.intermediate = kIntermediate;
  d.num_experts = kExperts;
  d.top_k = top_k;
  d.norm_topk_prob = norm_topk_prob;
  return d;
}

// Router N(0, router_scale^2 / hidden) so the softmax is far from uniform; gate/up N(0, 1/hidden)
// and down N(0, 1/intermediate) keep the expert outputs O(1).
std::vector<double> RandomParams(const MoeDims& d, const MoeOffsets& o, uint64_t seed, double router_scale = 2.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  const int64_t E = d.num_experts, H = d.hidden, I = d.intermediate;
  std::vector<double> p(o.block_numel, 0.0);
  for (int64_t i = 0; i < E * H; ++i) p[o.router + i] = router_scale / std::sqrt(double(H)) * normal(rng);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I * H; ++i) p[o.gate_at(e) + i] = normal(rng) / std::sqrt(double(H));
    for (int64_t i = 0; i < I * H; ++i) p[o.up_at(e) + i] = normal(rng) / std::sqrt(double(H));
    for (int64_t i = 0; i < H * I; ++i) p[o.down_at(e) + i] = normal(rng) / std::sqrt(double(I));
  }
  return p;
}

template <typename To, typename From>
std::vector<To> Cast(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// max |a - b| / max |b|.
template <typename A>
double MaxRelative(const std::vector<A>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / std::max(den, 1e-300);
}

// ---- Naive double reference: one token at a time, its k experts computed directly ----

struct NaiveRouting {
  std::vector<double> logits;   // [T, E]
  std::vector<double> probs;    // [T, E]
  std::vector<int32_t> experts; // [T, k]
  std::vector<double> weights;  // [T, k]
};

NaiveRouting NaiveRoute(const MoeDims& d, const MoeOffsets& o, const std::vector<double>& params,
                        const std::vector<double>& x, int64_t T) {
  const int64_t E = d.num_experts, H = d.hidden, k = d.top_k;
  NaiveRouting r;
  r.logits.assign(T * E, 0.0);
  r.probs.assign(T * E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t i = 0; i < H; ++i) r.logits[t * E + e] += x[t * H + i] * params[o.router + e * H + i];
    }
    const double mx = *std::max_element(r.logits.begin() + t * E, r.logits.begin() + (t + 1) * E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(r.logits[t * E + e] - mx);
    for (int64_t e = 0; e < E; ++e) r.probs[t * E + e] = std::exp(r.logits[t * E + e] - mx) / sum;
    // A stable sort by descending probability: equal values keep ascending expert index.
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return r.probs[t * E + a] > r.probs[t * E + b]; });
    double s = 0;
    for (int64_t j = 0; j < k; ++j) s += r.probs[t * E + order[j]];
    for (int64_t j = 0; j < k; ++j) {
      r.experts.push_back(order[j]);
      r.weights.push_back(r.probs[t * E + order[j]] / (d.norm_topk_prob ? s : 1.0));
    }
  }
  return r;
}

std::vector<double> NaiveForward(const MoeDims& d, const MoeOffsets& o, const std::vector<double>& params,
                                 const std::vector<double>& x, int64_t T) {
  const int64_t H = d.hidden, I = d.intermediate, k = d.top_k;
  const NaiveRouting r = NaiveRoute(d, o, params, x, T);
  std::vector<double> y(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = r.experts[t * k + j];
      std::vector<double> m(I);
      for (int64_t n = 0; n < I; ++n) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < H; ++i) {
          g += params[o.gate_at(e) + n * H + i] * xt[i];
          u += params[o.up_at(e) + n * H + i] * xt[i];
        }
        m[n] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t h = 0; h < H; ++h) {
        double out = 0;
        for (int64_t n = 0; n < I; ++n) out += params[o.down_at(e) + h * I + n] * m[n];
        y[t * H + h] += r.weights[t * k + j] * out;
      }
    }
  }
  return y;
}

// Smallest gap between the k-th and (k+1)-th largest probability over tokens: finite
// differences are only meaningful when no perturbation can switch the routing.
double MinTopkMargin(const MoeDims& d, const std::vector<double>& probs, int64_t T) {
  double margin = 1.0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> p(probs.begin() + t * d.num_experts, probs.begin() + (t + 1) * d.num_experts);
    std::sort(p.begin(), p.end(), std::greater<double>());
    margin = std::min(margin, p[d.top_k - 1] - p[d.top_k]);
  }
  return margin;
}

struct MoeCase {
  std::string name;
  int64_t top_k;
  bool norm_topk_prob;
  double aux_coef;
};

void PrintTo(const MoeCase& c, std::ostream* os) { *os << c.name; }

// ---- 1. Forward against the naive reference ----

class MoeForward : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeForward, MatchesNaivePerTokenReference) {
  const MoeDims d = Dims(GetParam().top_k, GetParam().norm_topk_prob);
  const MoeOffsets o = MoeOffsets::Stacked(d);
  const int64_t T = kTokens, H = d.hidden, k = d.top_k;
  const std::vector<double> params = RandomParams(d, o, 101);
  const std::vector<double> x = testing::RandomNormals<double>(T * H, 102);
  const NaiveRouting ref_route = NaiveRoute(d, o, params, x, T);
  const std::vector<double> y_ref = NaiveForward(d, o, params, x, T);

  std::vector<double> y(T * H);
  MoeActs<double> acts;
  MoeBlockForward(d, o, params.data(), x.data(), T, y.data(), &acts, nullptr);
  EXPECT_EQ(acts.topk_expert, ref_route.experts);
  EXPECT_LT(MaxRelative(acts.router_probs, ref_route.probs), 1e-14);
  EXPECT_LT(MaxRelative(acts.topk_weight, ref_route.weights), 1e-14);
  EXPECT_LT(MaxRelative(y, y_ref), 1e-12);
  if (d.norm_topk_prob) {
    for (int64_t t = 0; t < T; ++t) {
      double s = 0;
      for (int64_t j = 0; j < k; ++j) s += acts.topk_weight[t * k + j];
      EXPECT_NEAR(s, 1.0, 1e-15);
    }
  }

  // float: same routing, outputs within float rounding.
  const std::vector<float> params_f = Cast<float>(params), x_f = Cast<float>(x);
  std::vector<float> y_f(T * H);
  MoeActs<float> acts_f;
  MoeBlockForward(d, o, params_f.data(), x_f.data(), T, y_f.data(), &acts_f, nullptr);
  EXPECT_EQ(acts_f.topk_expert, ref_route.experts);
  EXPECT_LT(MaxRelative(y_f, y_ref), 1e-5);

  // HF 5.x's fused gate_up_proj layout holds the same numbers elsewhere: bitwise equal output.
  const MoeOffsets fused = MoeOffsets::FusedGateUp(d);
  ASSERT_EQ(fused.block_numel, o.block_numel);
  std::vector<double> params_fused(fused.block_numel);
  std::copy_n(params.data() + o.router, d.num_experts * H, params_fused.data() + fused.router);
  for (int64_t e = 0; e < d.num_experts; ++e) {
    const int64_t n = d.intermediate * H;
    std::copy_n(params.data() + o.gate_at(e), n, params_fused.data() + fused.gate_at(e));
    std::copy_n(params.data() + o.up_at(e), n, params_fused.data() + fused.up_at(e));
    std::copy_n(params.data() + o.down_at(e), n, params_fused.data() + fused.down_at(e));
    EXPECT_EQ(fused.up_at(e), fused.gate_at(e) + n);  // rows [I, 2I) of expert e's gate_up_proj
  }
  std::vector<double> y_fused(T * H);
  MoeActs<double> acts_fused;
  MoeBlockForward(d, fused, params_fused.data(), x.data(), T, y_fused.data(), &acts_fused, nullptr);
  EXPECT_EQ(y_fused, y);
}

// The block runs on a sparse unit of the model layout as it is (common/model: router, then each
// expert's gate/up/down in one padded block): the same outputs and gradients bit for bit as on the
// stacked arrays of the same numbers, and the layout's own sizes through MoeDims::Of.
TEST(MoeInUnit, TheLayoutsSparseUnitGivesTheStackedResultsBitForBit) {
  const ModelConfig config = ModelConfig::Preset("tiny-moe").value();
  const ModelLayout layout = ModelLayout::Build(config);
  const UnitLayout* unit = nullptr;
  for (const UnitLayout& u : layout.units) {
    if (u.sparse()) {
      unit = &u;
      break;
    }
  }
  ASSERT_NE(unit, nullptr);
  const MoeDims d = MoeDims::Of(config);
  EXPECT_EQ(d.num_experts, unit->num_experts());
  const MoeOffsets in_unit = MoeOffsets::InUnit(*unit), stacked = MoeOffsets::Stacked(d);
  EXPECT_EQ(in_unit.block_numel, unit->numel);
  const std::vector<double> p_stacked = RandomParams(d, stacked, 901);
  std::vector<double> p_unit(unit->numel, 0.0);
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts;
  std::copy_n(p_stacked.data() + stacked.router, E * H, p_unit.data() + in_unit.router);
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(in_unit.gate_at(e), unit->FindExpert(e, kExpertGateProj)->offset_numel);
    EXPECT_EQ(in_unit.up_at(e), unit->FindExpert(e, kExpertUpProj)->offset_numel);
    EXPECT_EQ(in_unit.down_at(e), unit->FindExpert(e, kExpertDownProj)->offset_numel);
    std::copy_n(p_stacked.data() + stacked.gate_at(e), I * H, p_unit.data() + in_unit.gate_at(e));
    std::copy_n(p_stacked.data() + stacked.up_at(e), I * H, p_unit.data() + in_unit.up_at(e));
    std::copy_n(p_stacked.data() + stacked.down_at(e), H * I, p_unit.data() + in_unit.down_at(e));
  }
  const int64_t T = 23;
  const std::vector<double> x = testing::RandomNormals<double>(T * H, 902), dy = testing::RandomNormals<double>(T * H, 903);
  std::vector<double> y_s(T * H), y_u(T * H), dx_s(T * H), dx_u(T * H);
  std::vector<double> g_s(stacked.block_numel, 0.0), g_u(in_unit.block_numel, 0.0);
  MoeActs<double> a_s, a_u;
  MoeBlockForward(d, stacked, p_stacked.data(), x.data(), T, y_s.data(), &a_s, nullptr);
  MoeBlockForward(d, in_unit, p_unit.data(), x.data(), T, y_u.data(), &a_u, nullptr);
  EXPECT_EQ(y_u, y_s);
  MoeBlockBackward(d, stacked, p_stacked.data(), x.data(), T, a_s, dy.data(), nullptr, dx_s.data(), g_s.data(), nullptr);
  MoeBlockBackward(d, in_unit, p_unit.data(), x.data(), T, a_u, dy.data(), nullptr, dx_u.data(), g_u.data(), nullptr);
  EXPECT_EQ(dx_u, dx_s);
  for (int64_t i = 0; i < E * H; ++i) ASSERT_EQ(g_u[in_unit.router + i], g_s[stacked.router + i]) << i;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I * H; ++i) {
      ASSERT_EQ(g_u[in_unit.gate_at(e) + i], g_s[stacked.gate_at(e) + i]) << e;
      ASSERT_EQ(g_u[in_unit.up_at(e) + i], g_s[stacked.up_at(e) + i]) << e;
      ASSERT_EQ(g_u[in_unit.down_at(e) + i], g_s[stacked.down_at(e) + i]) << e;
    }
  }
  // A dense layer of the model (tiny-moe's mlp_only_layers) has no block.
  int dense = 0;
  for (const UnitLayout& u : layout.units) {
    if (u.kind != UnitKind::kDecoder || u.sparse()) continue;
    ++dense;
    EXPECT_EQ(MoeOffsets::InUnit(u).block_numel, 0);
  }
  EXPECT_GT(dense, 0);
}

INSTANTIATE_TEST_SUITE_P(Routing, MoeForward,
                         ::testing::Values(MoeCase{"top2_norm", 2, true, 0.0}, MoeCase{"top2_raw", 2, false, 0.0},
                                           MoeCase{"top3_norm", 3, true, 0.0}, MoeCase{"top3_raw", 3, false, 0.0}),
                         [](const auto& info) { return info.param.name; });

// ---- 2. Gradients against finite differences ----

// Fourth-order central difference, (8(f(h) - f(-h)) - (f(2h) - f(-2h))) / 12h: at h = 1e-4 its
// truncation error (~h^4) is negligible and its rounding error (~1e-16 |L| / h) stays near 1e-11,
// so a 1e-6 relative tolerance holds with margin while a wrong backward term errs by O(1).
constexpr double kStep = 1e-4;
constexpr double kRelTol = 1e-6;

template <typename F>
double CentralDifference(F&& f, double* v) {
  const double v0 = *v;
  auto at = [&](double delta) {
    *v = v0 + delta;
    const double r = f();
    *v = v0;
    return r;
  };
  return (8.0 * (at(kStep) - at(-kStep)) - (at(2 * kStep) - at(-2 * kStep))) / (12.0 * kStep);
}

// Compares every entry of analytic against finite differences of loss() wrt values; the relative
// error is floored at 1e-3 of the tensor's largest gradient. Returns the worst relative error.
template <typename F>
double CheckTensor(const std::string& name, F&& loss, double* values, const double* analytic, int64_t n) {
  double tensor_max = 0;
  for (int64_t i = 0; i < n; ++i) tensor_max = std::max(tensor_max, std::abs(analytic[i]));
  EXPECT_GT(tensor_max, 0) << name << " has an all-zero gradient";
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double fd = CentralDifference(loss, values + i);
    const double denom = std::max({std::abs(analytic[i]), std::abs(fd), 1e-3 * tensor_max});
    const double rel = std::abs(fd - analytic[i]) / denom;
    worst = std::max(worst, rel);
    EXPECT_LT(rel, kRelTol) << name << "[" << i << "]: analytic " << analytic[i] << " vs finite difference " << fd;
  }
  return worst;
}

// One MoE layer under test: its parameters, input, and the random cotangent r of L = sum(y * r).
struct Layer {
  std::vector<double> params, x, r;
};

Layer RandomLayer(const MoeDims& d, const MoeOffsets& o, uint64_t seed) {
  return Layer{RandomParams(d, o, seed), testing::RandomNormals<double>(kTokens * d.hidden, seed + 1),
               testing::RandomNormals<double>(kTokens * d.hidden, seed + 2)};
}

// L = sum_l sum(y_l * r_l) + coef * aux(all layers), the routing checked unchanged from `routing`.
double LayersLoss(const MoeDims& d, const MoeOffsets& o, const std::vector<Layer>& layers, double coef,
                  const std::vector<std::vector<int32_t>>& routing) {
  const int64_t T = kTokens, H = d.hidden;
  double loss = 0;
  std::vector<MoeRouterStats> stats;
  for (size_t l = 0; l < layers.size(); ++l) {
    std::vector<double> y(T * H);
    MoeActs<double> acts;
    MoeBlockForward(d, o, layers[l].params.data(), layers[l].x.data(), T, y.data(), &acts, nullptr);
    EXPECT_EQ(acts.topk_expert, routing[l]) << "a perturbation switched the routing";
    for (int64_t i = 0; i < T * H; ++i) loss += y[i] * layers[l].r[i];
    stats.push_back(acts.stats);
  }
  return loss + coef * LoadBalancingLoss(stats);
}

void CheckLayersGradients(const MoeDims& d, std::vector<Layer> layers, double coef, const std::string& name) {
  const MoeOffsets o = MoeOffsets::Stacked(d);
  const int64_t T = kTokens, H = d.hidden, E = d.num_experts, I = d.intermediate;
  std::vector<MoeActs<double>> acts(layers.size());
  std::vector<MoeRouterStats> stats;
  std::vector<std::vector<int32_t>> routing;
  for (size_t l = 0; l < layers.size(); ++l) {
    std::vector<double> y(T * H);
    MoeBlockForward(d, o, layers[l].params.data(), layers[l].x.data(), T, y.data(), &acts[l], nullptr);
    ASSERT_GT(MinTopkMargin(d, acts[l].router_probs, T), 2e-3) << "pick a seed without near-ties";
    stats.push_back(acts[l].stats);
    routing.push_back(acts[l].topk_expert);
  }
  const std::vector<double> aux_grad = LoadBalancingProbGrad(stats, coef);
  auto loss = [&] { return LayersLoss(d, o, layers, coef, routing); };

  double worst = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    std::vector<double> dx(T * H), dparams(o.block_numel, 0.0);
    MoeBlockBackward(d, o, layers[l].params.data(), layers[l].x.data(), T, acts[l], layers[l].r.data(),
                     coef != 0.0 ? aux_grad.data() : nullptr, dx.data(), dparams.data(), nullptr);
    const std::string at = name + " layer " + std::to_string(l) + " ";
    worst = std::max(worst, CheckTensor(at + "dx", loss, layers[l].x.data(), dx.data(), T * H));
    double* p = layers[l].params.data();
    worst = std::max(worst, CheckTensor(at + "router", loss, p + o.router, dparams.data() + o.router, E * H));
    for (int64_t e = 0; e < E; ++e) {
      // An expert without tokens has (correctly) zero expert gradients; the data routes to all.
      ASSERT_GT(acts[l].perm.expert_counts[e], 0);
      const std::string ex = at + "expert " + std::to_string(e);
      worst = std::max(worst, CheckTensor(ex + " gate", loss, p + o.gate_at(e), dparams.data() + o.gate_at(e), I * H));
      worst = std::max(worst, CheckTensor(ex + " up", loss, p + o.up_at(e), dparams.data() + o.up_at(e), I * H));
      worst = std::max(worst, CheckTensor(ex + " down", loss, p + o.down_at(e), dparams.data() + o.down_at(e), H * I));
    }
  }
  ::testing::Test::RecordProperty("worst_relative_error", std::to_string(worst));
  std::printf("%s: every entry checked, worst relative error %.3g\n", name.c_str(), worst);
}

class MoeGradCheck : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeGradCheck, AnalyticGradientsMatchFiniteDifferences) {
  const MoeDims d = Dims(GetParam().top_k, GetParam().norm_topk_prob);
  CheckLayersGradients(d, {RandomLayer(d, MoeOffsets::Stacked(d), 201)}, GetParam().aux_coef, GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(Routing, MoeGradCheck,
                         ::testing::Values(MoeCase{"top2_norm", 2, true, 0.0}, MoeCase{"top2_raw", 2, false, 0.0},
                                           MoeCase{"top3_norm", 3, true, 0.0}, MoeCase{"top3_raw", 3, false, 0.0},
                                           MoeCase{"top2_norm_aux", 2, true, 0.37},
                                           MoeCase{"top3_raw_aux", 3, false, 0.37}),
                         [](const auto& info) { return info.param.name; });

// The aux loss over concatenated layers couples them (C_e of one layer weighs S_e of another):
// each layer's gradient must use the combined counts.
TEST(MoeGradCheckLayers, AuxLossOverTwoLayersMatchesFiniteDifferences) {
  const MoeDims d = Dims(2, true);
  const MoeOffsets o = MoeOffsets::Stacked(d);
  CheckLayersGradients(d, {RandomLayer(d, o, 301), RandomLayer(d, o, 311)}, 0.5, "two_layers_aux");
}

// ---- 3. Tie-breaking ----

TEST(MoeTopK, EqualProbabilitiesPickTheLowerExpertIndexDeterministically) {
  for (int64_t k : {2, 3}) {
    const MoeDims d = Dims(k, true);
    const MoeOffsets o = MoeOffsets::Stacked(d);
    const int64_t T = kTokens, H = d.hidden, E = d.num_experts;
    std::vector<double> params = RandomParams(d, o, 401, 0.05);
    // Experts 1, 4 and 6 share one router row pointing along every token's input: their logits
    // are bitwise equal and the largest.
    const std::vector<double> dir = testing::RandomNormals<double>(H, 402);
    for (int64_t e : {1, 4, 6}) std::copy(dir.begin(), dir.end(), params.begin() + o.router + e * H);
    std::vector<double> x = testing::RandomNormals<double>(T * H, 403);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < H; ++i) x[t * H + i] = 0.1 * x[t * H + i] + dir[i];
    const std::vector<int32_t> expected = k == 2 ? std::vector<int32_t>{1, 4} : std::vector<int32_t>{1, 4, 6};

    CpuWorkerPool pool(3);
    for (CpuWorkerPool* p : {static_cast<CpuWorkerPool*>(nullptr), &pool}) {
      std::vector<double> y(T * H);
      MoeActs<double> acts;
      MoeBlockForward(d, o, params.data(), x.data(), T, y.data(), &acts, p);
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(acts.router_logits[t * E + 1], acts.router_logits[t * E + 4]);
        const std::vector<int32_t> got(acts.topk_expert.begin() + t * k, acts.topk_expert.begin() + (t + 1) * k);
        EXPECT_EQ(got, expected) << "token " << t;
        EXPECT_EQ(acts.topk_weight[t * k], acts.topk_weight[t * k + 1]);
      }
    }

    // HF initialises the router weight to zeros: all probabilities equal, experts 0..k-1 chosen.
    std::fill(params.begin() + o.router, params.begin() + o.router + E * H, 0.0);
    std::vector<float> params_f = Cast<float>(params), x_f = Cast<float>(x), y_f(T * H);
    MoeActs<float> acts_f;
    MoeBlockForward(d, o, params_f.data(), x_f.data(), T, y_f.data(), &acts_f, nullptr);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(acts_f.topk_expert[t * k + j], j);
        EXPECT_FLOAT_EQ(acts_f.topk_weight[t * k + j], 1.0f / static_cast<float>(k));
      }
    }
  }
}

// ---- 4. Experts that receive no token ----

TEST(MoeEmptyExpert, CountsAreReportedAndUnusedExpertGradientsAreUntouched) {
  const MoeDims d = Dims(2, true);
  const MoeOffsets o = MoeOffsets::Stacked(d);
  const int64_t T = kTokens, H = d.hidden, E = d.num_experts, I = d.intermediate, k = d.top_k;
  std::vector<double> params = RandomParams(d, o, 501);
  std::vector<double> x = testing::RandomNormals<double>(T * H, 502);
  // x[t][0] >= 2 for every token and the router rows of experts 3 and 5 are -20 e_0: their logits
  // are below -40, so no token picks them.
  for (int64_t t = 0; t < T; ++t) x[t * H] = 2.0 + std::abs(x[t * H]);
  for (int64_t e : {3, 5}) {
    std::fill_n(params.begin() + o.router + e * H, H, 0.0);
    params[o.router + e * H] = -20.0;
  }
  std::vector<double> y(T * H);
  MoeActs<double> acts;
  MoeBlockForward(d, o, params.data(), x.data(), T, y.data(), &acts, nullptr);
  const MoePermutation& perm = acts.perm;

  std::vector<int64_t> counted(E, 0);
  for (int32_t e : acts.topk_expert) ++counted[e];
  EXPECT_EQ(perm.expert_counts, counted);
  EXPECT_EQ(acts.stats.expert_counts, counted);
  EXPECT_EQ(acts.stats.num_tokens, T);
  EXPECT_EQ(perm.expert_counts[3], 0);
  EXPECT_EQ(perm.expert_counts[5], 0);
  EXPECT_EQ(std::accumulate(perm.expert_counts.begin(), perm.expert_counts.end(), int64_t{0}), T * k);
  EXPECT_EQ(perm.expert_offsets.front(), 0);
  EXPECT_EQ(perm.expert_offsets.back(), T * k);
  // The permutation: each row is its expert's, in token order, and row_of_slot inverts it.
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = perm.expert_offsets[e]; r < perm.expert_offsets[e + 1]; ++r) {
      EXPECT_EQ(acts.topk_expert[perm.token_index[r] * k + perm.slot_index[r]], e);
      EXPECT_EQ(perm.row_of_slot[perm.token_index[r] * k + perm.slot_index[r]], r);
      if (r > perm.expert_offsets[e]) {
        EXPECT_LT(perm.token_index[r - 1], perm.token_index[r]);
      }
    }
  }

  // Gradients land on a buffer holding earlier values: experts without tokens (3, 5 and any the
  // data happens to leave empty) keep theirs bitwise.
  const std::vector<double> before = testing::RandomNormals<double>(o.block_numel, 503);
  std::vector<double> dparams = before, dx(T * H);
  const std::vector<double> r = testing::RandomNormals<double>(T * H, 504);
  const std::vector<double> aux = LoadBalancingProbGrad({acts.stats}, 0.1);
  MoeBlockBackward(d, o, params.data(), x.data(), T, acts, r.data(), aux.data(), dx.data(), dparams.data(), nullptr);
  for (int64_t e = 0; e < E; ++e) {
    const bool unused = perm.expert_counts[e] == 0;
    for (int64_t off : {o.gate_at(e), o.up_at(e), o.down_at(e)}) {
      const std::vector<double> was(before.begin() + off, before.begin() + off + I * H);
      const std::vector<double> now(dparams.begin() + off, dparams.begin() + off + I * H);
      if (unused) {
        EXPECT_EQ(now, was) << "expert " << e;
      } else {
        EXPECT_NE(now, was) << "expert " << e;
      }
    }
  }
}

// ---- 5. Auxiliary loss against HF's load_balancing_loss_func written out ----

// HF, no attention mask: concatenate the layers' logits [N, E]; probs = softmax; selected =
// topk(probs, k); mask = one_hot(selected) [N, k, E]; tokens_per_expert = mean(mask, dim 0)
// [k, E]; router_prob_per_expert = mean(probs, dim 0) [E];
// loss = E * sum(tokens_per_expert * router_prob_per_expert[None, :]).
double HfLoadBalancingLoss(const MoeDims& d, const std::vector<double>& logits) {
  const int64_t E = d.num_experts, k = d.top_k, N = static_cast<int64_t>(logits.size()) / E;
  std::vector<double> tokens_per_expert(k * E, 0.0), prob_per_expert(E, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> p(E);
    double mx = logits[n * E], sum = 0;
    for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[n * E + e]);
    for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[n * E + e] - mx);
    for (int64_t e = 0; e < E; ++e) p[e] = std::exp(logits[n * E + e] - mx) / sum;
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    for (int64_t j = 0; j < k; ++j) tokens_per_expert[j * E + order[j]] += 1.0 / N;
    for (int64_t e = 0; e < E; ++e) prob_per_expert[e] += p[e] / N;
  }
  double loss = 0;
  for (int64_t j = 0; j < k; ++j)
    for (int64_t e = 0; e < E; ++e) loss += tokens_per_expert[j * E + e] * prob_per_expert[e];
  return loss * E;
}

TEST(MoeAuxLoss, EqualsHfFormulaOverConcatenatedLayers) {
  for (int64_t k : {2, 3}) {
    const MoeDims d = Dims(k, true);
    const MoeOffsets o = MoeOffsets::Stacked(d);
    const int64_t T = kTokens, H = d.hidden;
    std::vector<MoeRouterStats> stats;
    std::vector<double> concatenated;
    double sum_of_layer_losses = 0;
    for (uint64_t layer = 0; layer < 3; ++layer) {
      const std::vector<double> params = RandomParams(d, o, 601 + 10 * layer);
      const std::vector<double> x = testing::RandomNormals<double>(T * H, 602 + 10 * layer);
      const NaiveRouting ref = NaiveRoute(d, o, params, x, T);
      std::vector<double> y(T * H);
      MoeActs<double> acts;
      MoeBlockForward(d, o, params.data(), x.data(), T, y.data(), &acts, nullptr);
      stats.push_back(acts.stats);
      concatenated.insert(concatenated.end(), ref.logits.begin(), ref.logits.end());

      const double one = LoadBalancingLoss({acts.stats});
      EXPECT_NEAR(one, HfLoadBalancingLoss(d, ref.logits), 1e-12 * one) << "k " << k << " layer " << layer;
      sum_of_layer_losses += one;
    }
    const double all = LoadBalancingLoss(stats);
    EXPECT_NEAR(all, HfLoadBalancingLoss(d, concatenated), 1e-12 * all) << "k " << k;
    // The concatenation is not the sum (nor the mean) of the per-layer losses.
    EXPECT_GT(std::abs(all - sum_of_layer_losses / 3), 1e-6);
  }
  EXPECT_EQ(LoadBalancingLoss({}), 0.0);
}

// ---- 6. Thread-count independence ----

TEST(MoeThreads, OneAndThreeThreadsGiveBitwiseEqualResults) {
  const MoeDims d = Dims(3, true);
  const MoeOffsets o = MoeOffsets::Stacked(d);
  const int64_t T = 61, H = d.hidden;  // enough rows per expert for several ranges per GEMM
  const std::vector<float> params = Cast<float>(RandomParams(d, o, 701));
  const std::vector<float> x = Cast<float>(testing::RandomNormals<double>(T * H, 702));
  const std::vector<float> dy = Cast<float>(testing::RandomNormals<double>(T * H, 703));

  struct Result {
    std::vector<float> y, dx, dparams;
    MoeActs<float> acts;
  };
  auto run = [&](int threads) {
    CpuWorkerPool pool(threads);
    Result r;
    r.y.resize(T * H);
    r.dx.resize(T * H);
    r.dparams.assign(o.block_numel, 0.0f);
    MoeBlockForward(d, o, params.data(), x.data(), T, r.y.data(), &r.acts, &pool);
    const std::vector<double> aux = LoadBalancingProbGrad({r.acts.stats}, 0.01);
    MoeBlockBackward(d, o, params.data(), x.data(), T, r.acts, dy.data(), aux.data(), r.dx.data(), r.dparams.data(),
                     &pool);
    return r;
  };
  const Result one = run(1), three = run(3);
  EXPECT_EQ(one.y, three.y);
  EXPECT_EQ(one.acts.router_logits, three.acts.router_logits);
  EXPECT_EQ(one.acts.topk_weight, three.acts.topk_weight);
  EXPECT_EQ(one.acts.gate, three.acts.gate);
  EXPECT_EQ(one.acts.expert_out, three.acts.expert_out);
  EXPECT_EQ(one.acts.stats.prob_sums, three.acts.stats.prob_sums);
  EXPECT_EQ(one.dx, three.dx);
  EXPECT_EQ(one.dparams, three.dparams);

  // dx may alias dy.
  std::vector<float> inplace = dy, dparams(o.block_numel, 0.0f);
  const std::vector<double> aux = LoadBalancingProbGrad({one.acts.stats}, 0.01);
  MoeBlockBackward(d, o, params.data(), x.data(), T, one.acts, inplace.data(), aux.data(), inplace.data(),
                   dparams.data(), nullptr);
  EXPECT_EQ(inplace, one.dx);
  EXPECT_EQ(dparams, one.dparams);
}

}  // namespace
}  // namespace slidedp
