// The Qwen3.5 Gated DeltaNet reference math (gated_delta_math.h): each op and the whole mixer
// against central differences in double, the forward against independent literal transcriptions
// of HF's definitions, float against double, packed documents against documents run alone (bit for
// bit), the checkpointed backward against the store-every-state one (bit for bit), and a long row.
#include "worker/compute/cpu/gated_delta_math.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::RandomNormals;

// Five-point central differences: truncation O(h^4) times the fifth derivative, which is steep where
// a head's delta-rule output is small and the gated RMSNorm rescales it (h = 1e-3 gave 1e-5 errors
// there, h = 1e-4 gives 1e-8), and rounding ~ 1e-16 |L| / h ~ 1e-11; a wrong or missing backward
// term gives O(1) relative errors.
constexpr double kStep = 1e-4;
constexpr double kRelTol = 1e-6;

// A packed row of documents and its geometry (RoPE fields unused).
struct Row {
  std::vector<int32_t> cu_seqlens;
  TokenGeometry geom;

  explicit Row(const std::vector<int32_t>& doc_lengths) {
    cu_seqlens.push_back(0);
    for (int32_t n : doc_lengths) cu_seqlens.push_back(cu_seqlens.back() + n);
    geom.num_tokens = cu_seqlens.back();
    geom.num_docs = static_cast<int64_t>(doc_lengths.size());
    geom.cu_seqlens = cu_seqlens.data();
  }
  Row(const Row& other) : Row(Lengths(other)) {}
  Row& operator=(const Row&) = delete;
  int64_t T() const { return geom.num_tokens; }

 private:
  static std::vector<int32_t> Lengths(const Row& r) {
    std::vector<int32_t> n;
    for (size_t d = 0; d + 1 < r.cu_seqlens.size(); ++d) n.push_back(r.cu_seqlens[d + 1] - r.cu_seqlens[d]);
    return n;
  }
};

// The brief's rows: one token; two documents; three documents with a one-token one in the middle.
const std::vector<std::vector<int32_t>>& GradRows() {
  static const std::vector<std::vector<int32_t>> rows = {{1}, {3, 2}, {4, 1, 4}};
  return rows;
}

std::string RowName(const std::vector<int32_t>& docs) {
  std::string s;
  for (int32_t n : docs) s += (s.empty() ? "" : "_") + std::to_string(n);
  return s;
}

double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

std::vector<double> Uniform(int64_t n, double lo, double hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

std::vector<double> Scaled(std::vector<double> v, double s) {
  for (auto& x : v) x *= s;
  return v;
}

template <typename To, typename From>
std::vector<To> Cast(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// Every element of *x: analytic[i] against five-point central differences of loss() in x[i],
// relative to the entry, floored at 1e-3 of the largest analytic entry. Returns the worst error.
double ExpectMatchesCentralDifferences(const std::string& what, std::vector<double>* x,
                                       const std::vector<double>& analytic, const std::function<double()>& loss) {
  EXPECT_EQ(x->size(), analytic.size()) << what;
  double max_an = 0;
  for (double v : analytic) max_an = std::max(max_an, std::abs(v));
  double worst = 0;
  for (size_t i = 0; i < x->size(); ++i) {
    const double x0 = (*x)[i];
    auto at = [&](double v) {
      (*x)[i] = v;
      const double l = loss();
      (*x)[i] = x0;
      return l;
    };
    const double fd = (8 * (at(x0 + kStep) - at(x0 - kStep)) - (at(x0 + 2 * kStep) - at(x0 - 2 * kStep))) /
                      (12 * kStep);
    const double denom = std::max({std::abs(analytic[i]), std::abs(fd), 1e-3 * max_an, 1e-12});
    const double rel = std::abs(fd - analytic[i]) / denom;
    worst = std::max(worst, rel);
    EXPECT_LT(rel, kRelTol) << what << "[" << i << "]: analytic " << analytic[i] << " vs finite difference " << fd;
  }
  return worst;
}

// ---- Ops ----

class OpGradCheck : public ::testing::TestWithParam<std::vector<int32_t>> {};

TEST_P(OpGradCheck, CausalConv1dSilu) {
  const Row row(GetParam());
  const int64_t T = row.T(), C = 5, K = 4;
  std::vector<double> x = RandomNormals<double>(T * C, 1), w = Scaled(RandomNormals<double>(C * K, 2), 0.6);
  const std::vector<double> c = RandomNormals<double>(T * C, 3);
  auto loss = [&] {
    std::vector<double> y(T * C);
    CausalConv1dSiluForward(x.data(), w.data(), C, K, row.geom, static_cast<double*>(nullptr), y.data(), nullptr);
    return Dot(c, y);
  };
  std::vector<double> pre(T * C), y(T * C), dx(T * C), dw(C * K, 0.0);
  CausalConv1dSiluForward(x.data(), w.data(), C, K, row.geom, pre.data(), y.data(), nullptr);
  CausalConv1dSiluBackward(x.data(), w.data(), pre.data(), c.data(), C, K, row.geom, dx.data(), dw.data(), nullptr);
  ExpectMatchesCentralDifferences("conv dx", &x, dx, loss);
  ExpectMatchesCentralDifferences("conv dw", &w, dw, loss);
}

TEST_P(OpGradCheck, HeadL2Norm) {
  const int64_t rows = Row(GetParam()).T() * 3, dim = 4;
  std::vector<double> x = RandomNormals<double>(rows * dim, 4);
  const std::vector<double> c = RandomNormals<double>(rows * dim, 5);
  auto loss = [&] {
    std::vector<double> y(rows * dim), inv(rows);
    HeadL2NormForward(x.data(), rows, dim, 1e-6, y.data(), inv.data(), nullptr);
    return Dot(c, y);
  };
  std::vector<double> y(rows * dim), inv(rows), dx(rows * dim);
  HeadL2NormForward(x.data(), rows, dim, 1e-6, y.data(), inv.data(), nullptr);
  HeadL2NormBackward(y.data(), inv.data(), c.data(), rows, dim, dx.data(), nullptr);
  ExpectMatchesCentralDifferences("l2norm dx", &x, dx, loss);
}

TEST_P(OpGradCheck, DecayAndBeta) {
  const int64_t T = Row(GetParam()).T(), nv = 3;
  std::vector<double> a = RandomNormals<double>(T * nv, 6), b = RandomNormals<double>(T * nv, 7);
  std::vector<double> a_log = Scaled(RandomNormals<double>(nv, 8), 0.5), dt_bias = RandomNormals<double>(nv, 9);
  a[nv - 1] = 25.0 - dt_bias[nv - 1];  // softplus's linear branch (x > 20)
  const std::vector<double> cg = RandomNormals<double>(T * nv, 10), cb = RandomNormals<double>(T * nv, 11);
  auto loss = [&] {
    std::vector<double> g(T * nv), beta(T * nv);
    DecayAndBetaForward(a.data(), b.data(), a_log.data(), dt_bias.data(), T, nv, g.data(), beta.data(), nullptr);
    return Dot(cg, g) + Dot(cb, beta);
  };
  std::vector<double> g(T * nv), beta(T * nv), da(T * nv), db(T * nv), da_log(nv, 0.0), ddt(nv, 0.0);
  DecayAndBetaForward(a.data(), b.data(), a_log.data(), dt_bias.data(), T, nv, g.data(), beta.data(), nullptr);
  DecayAndBetaBackward(a.data(), beta.data(), a_log.data(), dt_bias.data(), cg.data(), cb.data(), T, nv, da.data(),
                       db.data(), da_log.data(), ddt.data(), nullptr);
  ExpectMatchesCentralDifferences("da", &a, da, loss);
  ExpectMatchesCentralDifferences("db", &b, db, loss);
  ExpectMatchesCentralDifferences("dA_log", &a_log, da_log, loss);
  ExpectMatchesCentralDifferences("ddt_bias", &dt_bias, ddt, loss);
}

TEST_P(OpGradCheck, GatedRmsNorm) {
  const int64_t rows = Row(GetParam()).T() * 2, dim = 4;
  std::vector<double> x = RandomNormals<double>(rows * dim, 12), z = RandomNormals<double>(rows * dim, 13);
  std::vector<double> w = RandomNormals<double>(dim, 14);
  for (auto& v : w) v = 1 + 0.2 * v;
  const std::vector<double> c = RandomNormals<double>(rows * dim, 15);
  const double eps = 1e-6;
  auto loss = [&] {
    std::vector<double> y(rows * dim), rstd(rows);
    GatedRmsNormForward(x.data(), z.data(), w.data(), rows, dim, eps, y.data(), rstd.data(), nullptr);
    return Dot(c, y);
  };
  std::vector<double> y(rows * dim), rstd(rows), dx(rows * dim), dz(rows * dim), dw(dim, 0.0);
  GatedRmsNormForward(x.data(), z.data(), w.data(), rows, dim, eps, y.data(), rstd.data(), nullptr);
  GatedRmsNormBackward(x.data(), z.data(), w.data(), rstd.data(), c.data(), rows, dim, dx.data(), dz.data(),
                       dw.data(), nullptr);
  ExpectMatchesCentralDifferences("gated norm dx", &x, dx, loss);
  ExpectMatchesCentralDifferences("gated norm dz", &z, dz, loss);
  ExpectMatchesCentralDifferences("gated norm dw", &w, dw, loss);
}

INSTANTIATE_TEST_SUITE_P(Rows, OpGradCheck, ::testing::ValuesIn(GradRows()),
                         [](const auto& info) { return RowName(info.param); });

// ---- The recurrence and the mixer, over head shapes ----

LinearAttentionDims TinyDims(int64_t nk, int64_t nv, int64_t dk = 4, int64_t dv = 4) {
  LinearAttentionDims d;
  d.hidden = 8;
  d.num_k_heads = nk;
  d.num_v_heads = nv;
  d.k_dim = dk;
  d.v_dim = dv;
  d.conv_kernel = 4;
  d.norm_eps = 1e-6;
  return d;
}

struct DeltaInputsD {
  std::vector<double> q, k, v, g, beta;
};

// Unit-scale q, k (as after the L2 norm, though any values are valid), decays in (0.2, 0.95).
DeltaInputsD RandomDeltaInputs(const LinearAttentionDims& d, int64_t T, uint64_t seed) {
  DeltaInputsD in;
  const double s = 1 / std::sqrt(static_cast<double>(d.k_dim));
  in.q = Scaled(RandomNormals<double>(T * d.key_dim(), seed), s);
  in.k = Scaled(RandomNormals<double>(T * d.key_dim(), seed + 1), s);
  in.v = RandomNormals<double>(T * d.value_dim(), seed + 2);
  in.g = Uniform(T * d.num_v_heads, -1.6, -0.05, seed + 3);
  in.beta = Uniform(T * d.num_v_heads, 0.1, 0.9, seed + 4);
  return in;
}

// HF's torch_recurrent_gated_delta_rule written out literally per document (state reset to zero),
// key heads repeat-interleaved over value heads: the independent forward reference.
std::vector<double> LiteralDeltaRule(const LinearAttentionDims& d, const Row& row, const DeltaInputsD& in) {
  const int64_t nv = d.num_v_heads, dk = d.k_dim, dv = d.v_dim;
  std::vector<double> o(row.T() * d.value_dim());
  for (int64_t doc = 0; doc < row.geom.num_docs; ++doc) {
    for (int64_t h = 0; h < nv; ++h) {
      const int64_t kh = h / (nv / d.num_k_heads);
      std::vector<std::vector<double>> S(dk, std::vector<double>(dv, 0.0));
      for (int64_t t = row.cu_seqlens[doc]; t < row.cu_seqlens[doc + 1]; ++t) {
        const double* q = &in.q[(t * d.num_k_heads + kh) * dk];
        const double* k = &in.k[(t * d.num_k_heads + kh) * dk];
        const double* v = &in.v[(t * nv + h) * dv];
        const double decay = std::exp(in.g[t * nv + h]), beta = in.beta[t * nv + h];
        for (auto& r : S) {
          for (auto& e : r) e *= decay;
        }
        std::vector<double> delta(dv);
        for (int64_t j = 0; j < dv; ++j) {
          double kv_mem = 0;
          for (int64_t i = 0; i < dk; ++i) kv_mem += S[i][j] * k[i];
          delta[j] = (v[j] - kv_mem) * beta;
        }
        for (int64_t i = 0; i < dk; ++i) {
          for (int64_t j = 0; j < dv; ++j) S[i][j] += k[i] * delta[j];
        }
        for (int64_t j = 0; j < dv; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < dk; ++i) acc += S[i][j] * q[i] / std::sqrt(static_cast<double>(dk));
          o[(t * nv + h) * dv + j] = acc;
        }
      }
    }
  }
  return o;
}

struct HeadShape {
  std::string name;
  int64_t nk, nv, dk, dv;
};

void PrintTo(const HeadShape& s, std::ostream* os) { *os << s.name; }

class DeltaGradCheck : public ::testing::TestWithParam<HeadShape> {};

TEST_P(DeltaGradCheck, GatedDeltaRuleMatchesLiteralAndCentralDifferences) {
  const HeadShape s = GetParam();
  const LinearAttentionDims d = TinyDims(s.nk, s.nv, s.dk, s.dv);
  for (const auto& docs : GradRows()) {
    SCOPED_TRACE(RowName(docs));
    const Row row(docs);
    const int64_t T = row.T(), nv = d.num_v_heads;
    DeltaInputsD in = RandomDeltaInputs(d, T, 20);
    const std::vector<double> c = RandomNormals<double>(T * d.value_dim(), 25);
    auto forward = [&] {
      std::vector<double> o(T * d.value_dim());
      GatedDeltaRuleForward(d, row.geom, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                            o.data(), nullptr);
      return o;
    };
    const std::vector<double> o = forward(), literal = LiteralDeltaRule(d, row, in);
    EXPECT_LT(testing::RelativeL2(o, literal), 1e-13);
    auto loss = [&] { return Dot(c, forward()); };
    std::vector<double> dq(T * d.key_dim()), dk(T * d.key_dim()), dv(T * d.value_dim()), dg(T * nv), dbeta(T * nv);
    GatedDeltaRuleBackward(d, row.geom, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), c.data(),
                           dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), nullptr, 2);
    ExpectMatchesCentralDifferences("dq", &in.q, dq, loss);
    ExpectMatchesCentralDifferences("dk", &in.k, dk, loss);
    ExpectMatchesCentralDifferences("dv", &in.v, dv, loss);
    ExpectMatchesCentralDifferences("dg", &in.g, dg, loss);
    ExpectMatchesCentralDifferences("dbeta", &in.beta, dbeta, loss);
  }
}

// Random mixer parameters in the packed layout: projections N(0, 1/in), conv N(0, 0.36), dt_bias
// N(0, 0.25), A_log N(-0.5, 0.09) (decays exp(g) around 0.5), norm 1 + 0.2 N(0, 1).
std::vector<double> RandomMixerParams(const LinearAttentionDims& d, const LinearAttentionOffsets& o, int64_t numel,
                                      uint64_t seed) {
  std::vector<double> p = RandomNormals<double>(numel, seed);
  auto scale = [&](int64_t at, int64_t n, double mul, double add) {
    for (int64_t i = 0; i < n; ++i) p[at + i] = add + mul * p[at + i];
  };
  const double in_h = 1 / std::sqrt(static_cast<double>(d.hidden));
  scale(o.in_proj_qkv, d.conv_dim() * d.hidden, in_h, 0);
  scale(o.in_proj_z, d.value_dim() * d.hidden, in_h, 0);
  scale(o.in_proj_b, d.num_v_heads * d.hidden, in_h, 0);
  scale(o.in_proj_a, d.num_v_heads * d.hidden, in_h, 0);
  scale(o.conv1d, d.conv_dim() * d.conv_kernel, 0.6, 0);
  scale(o.dt_bias, d.num_v_heads, 0.5, 0);
  scale(o.a_log, d.num_v_heads, 0.3, -0.5);
  scale(o.norm, d.v_dim, 0.2, 1);
  scale(o.out_proj, d.hidden * d.value_dim(), 1 / std::sqrt(static_cast<double>(d.value_dim())), 0);
  return p;
}

TEST_P(DeltaGradCheck, MixerMatchesCentralDifferences) {
  const HeadShape s = GetParam();
  const LinearAttentionDims d = TinyDims(s.nk, s.nv, s.dk, s.dv);
  ASSERT_TRUE(d.Validate().ok());
  int64_t numel = 0;
  const LinearAttentionOffsets offs = LinearAttentionOffsets::Packed(d, 0, &numel);
  for (const auto& docs : GradRows()) {
    SCOPED_TRACE(RowName(docs));
    const Row row(docs);
    const int64_t T = row.T(), H = d.hidden;
    std::vector<double> params = RandomMixerParams(d, offs, numel, 30);
    std::vector<double> xn = RandomNormals<double>(T * H, 31);
    const std::vector<double> c = RandomNormals<double>(T * H, 32);
    auto loss = [&] {
      std::vector<double> out(T * H);
      LinearAttentionForward(d, offs, params.data(), row.geom, xn.data(), out.data(),
                             static_cast<LinearAttentionActs<double>*>(nullptr), nullptr);
      return Dot(c, out);
    };
    std::vector<double> out(T * H), dxn(T * H), dparams(numel, 0.0);
    LinearAttentionActs<double> acts;
    LinearAttentionForward(d, offs, params.data(), row.geom, xn.data(), out.data(), &acts, nullptr);
    EXPECT_EQ(acts.num_elements(), T * (d.conv_dim() + 2 * d.value_dim() + 3 * d.num_v_heads));
    LinearAttentionBackward(d, offs, params.data(), row.geom, xn.data(), acts, c.data(), dxn.data(), dparams.data(),
                            nullptr);
    double worst = ExpectMatchesCentralDifferences("dxn", &xn, dxn, loss);
    worst = std::max(worst, ExpectMatchesCentralDifferences("dparams", &params, dparams, loss));
    std::printf("%s docs %s: worst relative error %.3g\n", s.name.c_str(), RowName(docs).c_str(), worst);
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, DeltaGradCheck,
                         ::testing::Values(HeadShape{"nk1_nv2", 1, 2, 4, 4}, HeadShape{"nk2_nv2", 2, 2, 4, 4},
                                           HeadShape{"nk2_nv4", 2, 4, 4, 4}, HeadShape{"nk1_nv3", 1, 3, 4, 4},
                                           // dk != dv catches a transposed state.
                                           HeadShape{"nk2_nv4_dk3_dv5", 2, 4, 3, 5}),
                         [](const auto& info) { return info.param.name; });

// ---- Semantics against HF's definitions ----

TEST(GatedDeltaSemantics, ConvReadsZerosBeforeTheDocumentStart) {
  // HF: F.conv1d over the document left-padded with K-1 zeros (cross-correlation), then silu.
  const Row row({3, 6});
  const int64_t T = row.T(), C = 3, K = 4;
  const std::vector<double> x = RandomNormals<double>(T * C, 40), w = RandomNormals<double>(C * K, 41);
  std::vector<double> pre(T * C), y(T * C);
  CausalConv1dSiluForward(x.data(), w.data(), C, K, row.geom, pre.data(), y.data(), nullptr);
  for (int64_t doc = 0; doc < 2; ++doc) {
    const int64_t s0 = row.cu_seqlens[doc], n = row.cu_seqlens[doc + 1] - s0;
    for (int64_t ch = 0; ch < C; ++ch) {
      std::vector<double> padded(K - 1, 0.0);
      for (int64_t t = 0; t < n; ++t) padded.push_back(x[(s0 + t) * C + ch]);
      for (int64_t t = 0; t < n; ++t) {
        double acc = 0;
        for (int64_t j = 0; j < K; ++j) acc += w[ch * K + j] * padded[t + j];
        EXPECT_NEAR(pre[(s0 + t) * C + ch], acc, 1e-14);
        EXPECT_NEAR(y[(s0 + t) * C + ch], acc / (1 + std::exp(-acc)), 1e-14);
      }
    }
  }
}

TEST(GatedDeltaSemantics, DecayIsMinusExpALogTimesSoftplus) {
  const std::vector<double> a = {0.0, 30.0, -3.0}, b = {0.0, 2.0, -1.0}, a_log = {0.0, 0.0, std::log(3.0)};
  const std::vector<double> dt = {0.0, 0.0, 1.0};
  std::vector<double> g(3), beta(3);
  // One token, three heads.
  DecayAndBetaForward(a.data(), b.data(), a_log.data(), dt.data(), 1, 3, g.data(), beta.data(), nullptr);
  EXPECT_DOUBLE_EQ(g[0], -std::log(2.0));
  EXPECT_DOUBLE_EQ(g[1], -30.0);  // softplus(30) = 30 (threshold 20)
  EXPECT_NEAR(g[2], -3.0 * std::log1p(std::exp(-2.0)), 1e-15);
  EXPECT_DOUBLE_EQ(beta[0], 0.5);
  EXPECT_NEAR(beta[1], 1 / (1 + std::exp(-2.0)), 1e-15);
}

TEST(GatedDeltaSemantics, GatedNormWeightMultipliesPlainly) {
  // norm.weight initialises to ones and is used as is (not 1 + w): with w = 1 the output is
  // x / rms(x) * silu(z); with w = 0 it is zero.
  const int64_t dim = 4;
  const std::vector<double> x = {1, -2, 3, 0.5}, z = {0.3, -1, 2, 0};
  std::vector<double> ones(dim, 1.0), zeros(dim, 0.0), y(dim), rstd(1);
  GatedRmsNormForward(x.data(), z.data(), ones.data(), 1, dim, 1e-6, y.data(), rstd.data(), nullptr);
  const double rms = std::sqrt((1 + 4 + 9 + 0.25) / 4 + 1e-6);
  for (int64_t i = 0; i < dim; ++i) EXPECT_NEAR(y[i], x[i] / rms * z[i] / (1 + std::exp(-z[i])), 1e-15);
  GatedRmsNormForward(x.data(), z.data(), zeros.data(), 1, dim, 1e-6, y.data(), rstd.data(), nullptr);
  for (int64_t i = 0; i < dim; ++i) EXPECT_EQ(y[i], 0.0);
}

TEST(GatedDeltaSemantics, OneTokenOutputIsBetaTimesScaledQueryKeyOverlapTimesValue) {
  // S = k (beta v)^T from the zero state, so o = beta (k . q) / sqrt(dk) v.
  const LinearAttentionDims d = TinyDims(1, 1, 4, 3);
  const Row row({1});
  const DeltaInputsD in = RandomDeltaInputs(d, 1, 50);
  std::vector<double> o(3);
  GatedDeltaRuleForward(d, row.geom, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), o.data(),
                        nullptr);
  const double overlap = Dot(in.q, in.k) / 2.0;
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(o[j], in.beta[0] * overlap * in.v[j], 1e-15);
}

// ---- Precision, packing, threads, checkpoints, length ----

struct MixerCase {
  LinearAttentionDims dims;
  LinearAttentionOffsets offs;
  int64_t numel = 0;
  std::vector<double> params;

  MixerCase(const LinearAttentionDims& d, uint64_t seed) : dims(d) {
    offs = LinearAttentionOffsets::Packed(dims, 0, &numel);
    params = RandomMixerParams(dims, offs, numel, seed);
  }
};

// Forward and backward of the mixer in R: out, dxn and dparams (from zero).
template <typename R>
struct MixerRun {
  std::vector<R> out, dxn, dparams;
};

template <typename R>
MixerRun<R> RunMixer(const MixerCase& m, const TokenGeometry& geom, const std::vector<R>& xn,
                     const std::vector<R>& dout, CpuWorkerPool* pool, int64_t checkpoint_interval = 0) {
  const std::vector<R> params = Cast<R>(m.params);
  const int64_t T = geom.num_tokens, H = m.dims.hidden;
  MixerRun<R> r{std::vector<R>(T * H), std::vector<R>(T * H), std::vector<R>(m.numel, R(0))};
  LinearAttentionActs<R> acts;
  LinearAttentionForward(m.dims, m.offs, params.data(), geom, xn.data(), r.out.data(), &acts, pool);
  LinearAttentionBackward(m.dims, m.offs, params.data(), geom, xn.data(), acts, dout.data(), r.dxn.data(),
                          r.dparams.data(), pool, checkpoint_interval);
  return r;
}

// Awkward sizes for the float tests: dk != dv, head dims and hidden past the 8-wide dot's tail.
LinearAttentionDims AwkwardDims() {
  LinearAttentionDims d;
  d.hidden = 19;
  d.num_k_heads = 2;
  d.num_v_heads = 6;
  d.k_dim = 10;
  d.v_dim = 12;
  d.conv_kernel = 4;
  d.norm_eps = 1e-6;
  return d;
}

TEST(GatedDeltaPrecision, FloatAgreesWithDouble) {
  const MixerCase m(AwkwardDims(), 60);
  const Row row({11, 1, 23, 6});
  const int64_t n = row.T() * m.dims.hidden;
  const std::vector<double> xn = RandomNormals<double>(n, 61), dout = RandomNormals<double>(n, 62);
  const MixerRun<double> d = RunMixer<double>(m, row.geom, xn, dout, nullptr);
  const MixerRun<float> f = RunMixer<float>(m, row.geom, Cast<float>(xn), Cast<float>(dout), nullptr);
  const double e_out = testing::RelativeL2(Cast<double>(f.out), d.out);
  const double e_dx = testing::RelativeL2(Cast<double>(f.dxn), d.dxn);
  const double e_dp = testing::RelativeL2(Cast<double>(f.dparams), d.dparams);
  std::printf("float vs double relative L2: out %.3g, dxn %.3g, dparams %.3g\n", e_out, e_dx, e_dp);
  EXPECT_LT(e_out, 1e-5);
  EXPECT_LT(e_dx, 1e-5);
  EXPECT_LT(e_dp, 1e-5);
}

template <typename R>
bool BitwiseEqual(const R* a, const R* b, int64_t n) {
  return std::memcmp(a, b, n * sizeof(R)) == 0;
}

TEST(GatedDeltaPacking, PackedDocumentsEqualEachDocumentAloneBitwise) {
  const MixerCase m(AwkwardDims(), 70);
  const std::vector<int32_t> docs = {7, 1, 12, 5, 30};
  const Row row(docs);
  const int64_t H = m.dims.hidden, n = row.T() * H;
  const std::vector<float> xn = Cast<float>(RandomNormals<double>(n, 71));
  const std::vector<float> dout = Cast<float>(RandomNormals<double>(n, 72));
  CpuWorkerPool pool(3);
  const MixerRun<float> packed = RunMixer<float>(m, row.geom, xn, dout, &pool);
  for (size_t doc = 0; doc < docs.size(); ++doc) {
    const Row alone({docs[doc]});
    const int64_t at = row.cu_seqlens[doc] * H, len = docs[doc] * H;
    const std::vector<float> x1(xn.begin() + at, xn.begin() + at + len);
    const std::vector<float> d1(dout.begin() + at, dout.begin() + at + len);
    const MixerRun<float> one = RunMixer<float>(m, alone.geom, x1, d1, nullptr);
    EXPECT_TRUE(BitwiseEqual(packed.out.data() + at, one.out.data(), len)) << "forward, document " << doc;
    EXPECT_TRUE(BitwiseEqual(packed.dxn.data() + at, one.dxn.data(), len)) << "dxn, document " << doc;
  }
}

TEST(GatedDeltaDeterminism, ThreadCountDoesNotChangeAnyBit) {
  const MixerCase m(AwkwardDims(), 80);
  const Row row({9, 40, 2});
  const int64_t n = row.T() * m.dims.hidden;
  const std::vector<float> xn = Cast<float>(RandomNormals<double>(n, 81));
  const std::vector<float> dout = Cast<float>(RandomNormals<double>(n, 82));
  const MixerRun<float> serial = RunMixer<float>(m, row.geom, xn, dout, nullptr);
  CpuWorkerPool pool(4);
  const MixerRun<float> threaded = RunMixer<float>(m, row.geom, xn, dout, &pool);
  EXPECT_TRUE(BitwiseEqual(serial.out.data(), threaded.out.data(), n));
  EXPECT_TRUE(BitwiseEqual(serial.dxn.data(), threaded.dxn.data(), n));
  EXPECT_TRUE(BitwiseEqual(serial.dparams.data(), threaded.dparams.data(), m.numel));
}

TEST(GatedDeltaDeterminism, BackwardAddsIntoParameterGradients) {
  const MixerCase m(AwkwardDims(), 85);
  const Row row({5, 8});
  const int64_t n = row.T() * m.dims.hidden;
  const std::vector<float> xn = Cast<float>(RandomNormals<double>(n, 86));
  const std::vector<float> dout = Cast<float>(RandomNormals<double>(n, 87));
  const std::vector<float> params = Cast<float>(m.params);
  LinearAttentionActs<float> acts;
  std::vector<float> out(n), dxn(n), dparams(m.numel, 0.0f);
  LinearAttentionForward(m.dims, m.offs, params.data(), row.geom, xn.data(), out.data(), &acts, nullptr);
  LinearAttentionBackward(m.dims, m.offs, params.data(), row.geom, xn.data(), acts, dout.data(), dxn.data(),
                          dparams.data(), nullptr);
  const std::vector<float> once = dparams;
  LinearAttentionBackward(m.dims, m.offs, params.data(), row.geom, xn.data(), acts, dout.data(), dxn.data(),
                          dparams.data(), nullptr);
  for (int64_t i = 0; i < m.numel; ++i) ASSERT_EQ(dparams[i], 2 * once[i]) << i;  // s + s = 2s exactly
}

TEST(GatedDeltaCheckpoints, EveryIntervalEqualsStoringEveryState) {
  LinearAttentionDims d = AwkwardDims();
  const Row row({37, 1, 64, 20, 100});
  const int64_t T = row.T(), nv = d.num_v_heads;
  const DeltaInputsD in64 = RandomDeltaInputs(d, T, 90);
  const std::vector<float> q = Cast<float>(in64.q), k = Cast<float>(in64.k), v = Cast<float>(in64.v);
  const std::vector<float> g = Cast<float>(in64.g), beta = Cast<float>(in64.beta);
  const std::vector<float> dout = Cast<float>(RandomNormals<double>(T * d.value_dim(), 91));
  auto backward = [&](int64_t interval) {
    std::vector<float> grads(2 * T * d.key_dim() + T * d.value_dim() + 2 * T * nv);
    float* dq = grads.data();
    float* dk = dq + T * d.key_dim();
    float* dv = dk + T * d.key_dim();
    float* dg = dv + T * d.value_dim();
    float* dbeta = dg + T * nv;
    CpuWorkerPool pool(2);
    GatedDeltaRuleBackward(d, row.geom, q.data(), k.data(), v.data(), g.data(), beta.data(), dout.data(), dq, dk, dv,
                           dg, dbeta, &pool, interval);
    return grads;
  };
  const std::vector<float> every_state = backward(int64_t{1} << 40);  // one chunk per document
  for (int64_t interval : {0, 1, 3, 8, 64}) {
    const std::vector<float> chunked = backward(interval);
    EXPECT_TRUE(BitwiseEqual(chunked.data(), every_state.data(), static_cast<int64_t>(chunked.size())))
        << "checkpoint interval " << interval;
  }
}

TEST(GatedDeltaLength, LongRowIsFiniteAndFast) {
  LinearAttentionDims d;
  d.hidden = 32;
  d.num_k_heads = 2;
  d.num_v_heads = 4;
  d.k_dim = 16;
  d.v_dim = 16;
  d.conv_kernel = 4;
  const MixerCase m(d, 100);
  const Row row({3000, 1999, 1});
  const int64_t n = row.T() * d.hidden;
  const std::vector<float> xn = Cast<float>(RandomNormals<double>(n, 101));
  const std::vector<float> dout = Cast<float>(RandomNormals<double>(n, 102));
  CpuWorkerPool pool(2);
  const auto start = std::chrono::steady_clock::now();
  const MixerRun<float> r = RunMixer<float>(m, row.geom, xn, dout, &pool);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("T=%lld mixer forward + backward: %.3f s\n", static_cast<long long>(row.T()), seconds);
  auto finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  };
  EXPECT_TRUE(finite(r.out));
  EXPECT_TRUE(finite(r.dxn));
  EXPECT_TRUE(finite(r.dparams));
  double norm = 0;
  for (float x : r.dxn) norm += static_cast<double>(x) * x;
  EXPECT_GT(norm, 0);
  EXPECT_LT(seconds, 10.0);
}

TEST(GatedDeltaDims, ValidateRejectsUngroupedHeads) {
  LinearAttentionDims d = TinyDims(2, 3);
  EXPECT_FALSE(d.Validate().ok());
  d = TinyDims(2, 4);
  EXPECT_TRUE(d.Validate().ok());
  d.conv_kernel = 0;
  EXPECT_FALSE(d.Validate().ok());
}

}  // namespace
}  // namespace slidedp
