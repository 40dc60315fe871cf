// GPT-OSS's MoE block kernels (gpt_oss_moe.h) against host references at awkward sizes (5, 7, 16 and
// 130 experts; 9 to 1000 tokens; hidden 72 and 37, intermediate 24 and 13).
//
// Router: full-FP32 GEMM accumulators plus BF16 biases, rounded to BF16 as the kernel does (the same
// IEEE add and round-to-nearest-even on both sides), so the logits are bit for bit the host's and
// often equal (ties to the lower expert): the top-k must match exactly; the FP32 probabilities by
// relative error 1e-6, the BF16 routing weights 1e-3 (a double reference rounded once; a rare
// one-ulp difference is allowed). SwiGLU: gate and up spread past the limit 7 with values exactly on
// it, where the clamps must pass the gradient (zero and nonzero elements match exactly); outputs
// 2e-3 against a double reference rounded to BF16, the FP32 bias sums 1e-5. Combine (FP32
// operations in order) and the BF16 output gradient bit for bit; the routing weights' gradient and
// the down bias sums 1e-5. Router backward against a double reference that rounds where HF does, 1e-3.
#include "worker/kernels/gpt_oss_moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "worker/kernels/moe.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using GptOssMoeGpuTest = GpuTest;

constexpr double kAlpha = 1.702, kLimit = 7.0;

double RoundBf16(double v) { return Bf16ToFloat(FloatToBf16(static_cast<float>(v))); }

std::vector<int32_t> DownI32(const int32_t* p, size_t n) {
  std::vector<int32_t> h(n);
  cudaMemcpy(h.data(), p, n * sizeof(int32_t), cudaMemcpyDeviceToHost);
  return h;
}

template <typename T>
std::unique_ptr<Dev<T>> NewDev(const std::vector<T>& h) {
  auto d = std::make_unique<Dev<T>>(h.size());
  Upload(*d, h);
  return d;
}

// Experts by descending value, equal values to the lower expert (the kernels' rule).
std::vector<int32_t> Order(const double* v, int64_t E) {
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
  return order;
}

void RouteCase(int64_t T, int64_t E, int64_t k, int64_t ld) {
  const std::string name = absl::StrCat("T", T, " E", E, " k", k, " ld", ld);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<float> acc(T * ld, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) acc[t * ld + e] = n(Rng());
  const std::vector<double> bias = RandVec(E, 0.5);
  auto dacc = NewDev(acc);
  std::unique_ptr<Dev<bf16>> dbias(NewBf16(bias));
  Dev<float> probs(T * E), w(T * k);
  Dev<int32_t> sel(T * k);
  ASSERT_OK(kernels::GptOssRouteTopK(dacc->get(), ld, dbias->get(), T, E, k, probs.get(), sel.get(), w.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::vector<double> rp(T * E), rw(T * k), z(E);
  std::vector<int32_t> rsel(T * k);
  int64_t ties = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) z[e] = RoundBf16(acc[t * ld + e] + static_cast<float>(bias[e]));  // float add
    const double mx = *std::max_element(z.begin(), z.end());
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(z[e] - mx);
    for (int64_t e = 0; e < E; ++e) rp[t * E + e] = std::exp(z[e] - mx) / s;
    const std::vector<int32_t> order = Order(z.data(), E);
    double sk = 0;
    for (int64_t j = 0; j < k; ++j) sk += std::exp(z[order[j]] - z[order[0]]);
    for (int64_t j = 0; j < k; ++j) {
      rsel[t * k + j] = order[j];
      rw[t * k + j] = RoundBf16(std::exp(z[order[j]] - z[order[0]]) / sk);
      ties += j > 0 && z[order[j]] == z[order[j - 1]];
    }
  }
  std::printf("%s: %lld equal logits among the selected\n", name.c_str(), static_cast<long long>(ties));
  EXPECT_EQ(DownI32(sel.get(), T * k), rsel) << name << ": top-k experts (ties to the lower index)";
  ExpectRelErr("router probs " + name, DownF32(probs.get(), T * E), rp, 1e-6);
  ExpectRelErr("router weights (BF16) " + name, DownF32(w.get(), T * k), rw, 1e-3);
}

TEST_F(GptOssMoeGpuTest, RouteTopK) {
  RouteCase(37, 7, 2, 8);
  RouteCase(53, 16, 4, 21);
  RouteCase(1000, 130, 4, 136);
  RouteCase(9, 5, 5, 5);  // k = E: every expert, by logit
}

// m and its gradients in double, from the same FP32 pre-activations g and u.
struct GluRef {
  double m, dg, du;
};
GluRef Glu(double g, double u, double dm) {
  const double gc = std::min(g, kLimit), uc = std::clamp(u, -kLimit, kLimit);
  const double s = 1.0 / (1.0 + std::exp(-kAlpha * gc));
  GluRef r;
  r.m = (uc + 1) * gc * s;
  r.du = u >= -kLimit && u <= kLimit ? dm * gc * s : 0.0;
  r.dg = g <= kLimit ? dm * (uc + 1) * (s + gc * kAlpha * s * (1 - s)) : 0.0;
  return r;
}

void GluCase(int64_t rows, int64_t I) {
  const std::string name = absl::StrCat("(", rows, " rows, intermediate ", I, ")");
  std::vector<double> gu = RandVec(rows * 2 * I, 5.0), bias = RandVec(2 * I, 1.0), dact = RandVec(rows * I);
  // The limits themselves: pairs 0 and 1 without bias, rows 0..2 on and past the ends.
  for (int64_t c = 0; c < 4; ++c) bias[c] = 0.0;
  const double edge[3][4] = {{7.0, -7.0, 7.5, 7.0}, {-20.0, 20.0, 6.96875, -7.5}, {7.0, 7.0, -7.0, -6.96875}};
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t c = 0; c < 4; ++c) gu[r * 2 * I + c] = edge[r][c];
  std::vector<float> dbias0(2 * I);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (auto& v : dbias0) v = n(Rng());

  std::unique_ptr<Dev<bf16>> dgu_in(NewBf16(gu)), dbias_in(NewBf16(bias)), ddact(NewBf16(dact));
  Dev<bf16> act(rows * I), dgu(rows * 2 * I);
  Dev<float> ws(kernels::GptOssBiasWorkspaceNumel(rows, 2 * I));
  auto dbias = NewDev(dbias0);
  const kernels::GptOssGluParams glu{static_cast<float>(kAlpha), static_cast<float>(kLimit)};
  ASSERT_OK(kernels::GptOssGluForward(dgu_in->get(), dbias_in->get(), rows, I, glu, act.get(), nullptr));
  ASSERT_OK(kernels::GptOssGluBackward(dgu_in->get(), dbias_in->get(), ddact->get(), rows, I, glu, dgu.get(), ws.get(),
                                       dbias->get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::vector<double> ref_act(rows * I), ref_dgu(rows * 2 * I), ref_dbias(dbias0.begin(), dbias0.end());
  std::vector<double> sum(2 * I, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      // The kernel's FP32 add, bit for bit: the double sum of two BF16 values is exact, then rounded once.
      const double g = static_cast<float>(gu[r * 2 * I + 2 * i] + bias[2 * i]);
      const double u = static_cast<float>(gu[r * 2 * I + 2 * i + 1] + bias[2 * i + 1]);
      const GluRef ref = Glu(g, u, dact[r * I + i]);
      ref_act[r * I + i] = RoundBf16(ref.m);
      ref_dgu[r * 2 * I + 2 * i] = RoundBf16(ref.dg);
      ref_dgu[r * 2 * I + 2 * i + 1] = RoundBf16(ref.du);
      sum[2 * i] += ref.dg;
      sum[2 * i + 1] += ref.du;
    }
  }
  for (int64_t c = 0; c < 2 * I; ++c) ref_dbias[c] += sum[c];
  const std::vector<double> got_dgu = DownBf16(dgu.get(), rows * 2 * I);
  int64_t zero_mismatch = 0;
  for (size_t i = 0; i < got_dgu.size(); ++i) zero_mismatch += (got_dgu[i] == 0.0) != (ref_dgu[i] == 0.0);
  EXPECT_EQ(zero_mismatch, 0) << name << ": gradient elements the clamps stop (or pass) differently";
  // On the limit the gradient passes; past it, it stops.
  EXPECT_NE(got_dgu[0], 0.0) << "gate 7";
  EXPECT_NE(got_dgu[1], 0.0) << "up -7";
  EXPECT_EQ(got_dgu[2], 0.0) << "gate 7.5";
  EXPECT_NE(got_dgu[3], 0.0) << "up 7";
  EXPECT_NE(got_dgu[2 * I], 0.0) << "gate -20 (the gate's clamp is one-sided)";
  EXPECT_EQ(got_dgu[2 * I + 1], 0.0) << "up 20";
  EXPECT_EQ(got_dgu[2 * I + 3], 0.0) << "up -7.5";
  ExpectRelErr("clamped SwiGLU act " + name, DownBf16(act.get(), rows * I), ref_act, 2e-3);
  ExpectRelErr("clamped SwiGLU dgu " + name, got_dgu, ref_dgu, 2e-3);
  ExpectRelErr("gate_up bias gradient (added) " + name, DownF32(dbias->get(), 2 * I), ref_dbias, 1e-5);
}

TEST_F(GptOssMoeGpuTest, ClampedSwiGlu) {
  GluCase(37, 24);
  GluCase(300, 13);  // more rows than the bias sums' row groups; an odd intermediate size
  GluCase(3, 8);
}

// A routing of T tokens to k of E experts (expert `never` gets none) grouped on the device by the
// permutation kernel (moe.h, checked in moe_test.cc).
struct Routing {
  std::vector<int32_t> sel, counts, offsets, token_index, slot_index, row_of_slot;
};

Routing RandomRouting(int64_t T, int64_t E, int64_t k, int32_t never) {
  Routing g;
  std::vector<int32_t> all;
  for (int32_t e = 0; e < E; ++e) {
    if (e != never) all.push_back(e);
  }
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), Rng());
    g.sel.insert(g.sel.end(), all.begin(), all.begin() + k);
  }
  auto dsel = NewDev(g.sel);
  Dev<int32_t> ws(kernels::MoePermutationWorkspaceNumel(T, E)), counts(E), offsets(E + 1), token_index(T * k),
      slot_index(T * k), row_of_slot(T * k);
  const absl::Status s = kernels::MoeBuildPermutation(dsel->get(), T, k, E, ws.get(), counts.get(), offsets.get(),
                                                      token_index.get(), slot_index.get(), row_of_slot.get(), nullptr);
  EXPECT_TRUE(s.ok()) << s;
  cudaDeviceSynchronize();
  g.counts = DownI32(counts.get(), E);
  g.offsets = DownI32(offsets.get(), E + 1);
  g.token_index = DownI32(token_index.get(), T * k);
  g.slot_index = DownI32(slot_index.get(), T * k);
  g.row_of_slot = DownI32(row_of_slot.get(), T * k);
  return g;
}

TEST_F(GptOssMoeGpuTest, CombineAndBackward) {
  for (const int64_t H : {72, 37}) {
    const int64_t T = 37, E = 7, k = 3, R = T * k, stride = H + 5;  // the bias of expert e at e * stride
    const Routing g = RandomRouting(T, E, k, 2);
    const std::vector<double> eo = RandVec(R * H, 2.0), down_bias = RandVec(E * stride, 0.5);
    std::uniform_real_distribution<double> u(0.01, 1.0);
    std::vector<float> w(R), dout(T * H);
    for (auto& x : w) x = static_cast<float>(RoundBf16(u(Rng())));  // BF16 routing weights
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto& x : dout) x = n(Rng());  // full FP32 values
    std::vector<float> dbias0(E * H);
    for (auto& x : dbias0) x = n(Rng());

    std::unique_ptr<Dev<bf16>> deo(NewBf16(eo)), dbd(NewBf16(down_bias));
    auto dw_in = NewDev(w), ddout = NewDev(dout), ddbias = NewDev(dbias0);
    auto dsel = NewDev(g.sel), drow = NewDev(g.row_of_slot), dtok = NewDev(g.token_index), dslot = NewDev(g.slot_index);
    Dev<float> out(T * H), dweight(R), ws(kernels::GptOssBiasWorkspaceNumel(R, H));
    Dev<bf16> d_eo(R * H);
    ASSERT_OK(kernels::GptOssCombine(deo->get(), drow->get(), dsel->get(), dw_in->get(), dbd->get(), stride, T, k, H,
                                     out.get(), nullptr));
    ASSERT_OK(kernels::GptOssCombineBackward(ddout->get(), deo->get(), dtok->get(), dslot->get(), dsel->get(),
                                             dw_in->get(), dbd->get(), stride, R, k, H, d_eo.get(), dweight.get(),
                                             nullptr));
    for (int64_t e = 0; e < E; ++e) {
      ASSERT_OK(kernels::GptOssDownBiasBackward(ddout->get(), dtok->get() + g.offsets[e], dslot->get() + g.offsets[e],
                                                dw_in->get(), g.counts[e], k, H, ws.get(), ddbias->get() + e * H,
                                                nullptr));
    }
    ASSERT_CUDA_OK(cudaDeviceSynchronize());

    std::vector<double> ref_out(T * H), ref_deo(R * H), ref_dw(R), ref_dbias(dbias0.begin(), dbias0.end());
    for (int64_t t = 0; t < T; ++t) {
      std::vector<std::pair<int32_t, int64_t>> rows;  // (row, slot), ascending row = ascending expert
      for (int64_t j = 0; j < k; ++j) rows.push_back({g.row_of_slot[t * k + j], j});
      std::sort(rows.begin(), rows.end());
      for (int64_t i = 0; i < H; ++i) {
        float acc = 0.0f;  // the host has no FMA contraction (x86-64 baseline): each operation rounded
        for (const auto& [r, j] : rows) {
          const float o = static_cast<float>(eo[r * H + i]);
          const float b = static_cast<float>(down_bias[g.sel[t * k + j] * stride + i]);
          const float sum = o + b;
          const float prod = sum * w[t * k + j];
          acc = acc + prod;
        }
        ref_out[t * H + i] = acc;
      }
    }
    std::vector<double> bias_sum(E * H, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = g.token_index[r], j = g.slot_index[r], e = g.sel[t * k + j];
      double dot = 0;
      for (int64_t i = 0; i < H; ++i) {
        const float prod = dout[t * H + i] * w[t * k + j];
        ref_deo[r * H + i] = RoundBf16(prod);
        dot += static_cast<double>(dout[t * H + i]) * (eo[r * H + i] + down_bias[e * stride + i]);
        bias_sum[e * H + i] += prod;
      }
      ref_dw[t * k + j] = dot;
    }
    for (int64_t i = 0; i < E * H; ++i) ref_dbias[i] += bias_sum[i];
    const std::string sz = absl::StrCat("(T", T, " k", k, " H", H, ")");
    ExpectRelErr("combine with the down bias, exact " + sz, DownF32(out.get(), T * H), ref_out, 0.0);
    ExpectRelErr("combine backward d_expert_out, exact " + sz, DownBf16(d_eo.get(), R * H), ref_deo, 0.0);
    ExpectRelErr("combine backward dweight " + sz, DownF32(dweight.get(), R), ref_dw, 1e-5);
    ExpectRelErr("down bias gradient (added; expert 2 without rows) " + sz, DownF32(ddbias->get(), E * H), ref_dbias,
                 1e-5);
  }
}

void RouterBackwardCase(int64_t T, int64_t E, int64_t k, int64_t ld, bool aux) {
  const std::string name = absl::StrCat("T", T, " E", E, " k", k, aux ? " aux" : "");
  std::normal_distribution<double> n(0.0, 2.0);
  std::vector<float> probs(T * E), w(T * k), dw(T * k);
  std::vector<int32_t> sel(T * k);
  std::vector<double> z(E);
  for (int64_t t = 0; t < T; ++t) {
    for (auto& v : z) v = RoundBf16(n(Rng()));
    const double mx = *std::max_element(z.begin(), z.end());
    double s = 0;
    for (double v : z) s += std::exp(v - mx);
    for (int64_t e = 0; e < E; ++e) probs[t * E + e] = static_cast<float>(std::exp(z[e] - mx) / s);
    const std::vector<int32_t> order = Order(z.data(), E);
    double sk = 0;
    for (int64_t j = 0; j < k; ++j) sk += std::exp(z[order[j]] - mx);
    for (int64_t j = 0; j < k; ++j) {
      sel[t * k + j] = order[j];
      w[t * k + j] = static_cast<float>(RoundBf16(std::exp(z[order[j]] - mx) / sk));
      dw[t * k + j] = static_cast<float>(n(Rng()));
    }
  }
  std::vector<double> aux_grad(E);
  for (auto& v : aux_grad) v = 1e-2 * n(Rng());
  auto dprobs = NewDev(probs), dwt = NewDev(w), ddw = NewDev(dw);
  auto dsel = NewDev(sel);
  auto daux = NewDev(aux_grad);
  Dev<bf16> dz(T * ld);
  ASSERT_OK(kernels::GptOssRouterBackward(dprobs->get(), dsel->get(), dwt->get(), ddw->get(),
                                          aux ? daux->get() : nullptr, T, E, k, dz.get(), ld, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<double> got_all = DownBf16(dz.get(), T * ld);
  std::vector<double> got(T * E), ref(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const float* p = probs.data() + t * E;
    std::vector<double> d(E, 0.0);
    if (aux) {
      double pa = 0;
      for (int64_t e = 0; e < E; ++e) pa += p[e] * aux_grad[e];
      for (int64_t e = 0; e < E; ++e) d[e] = RoundBf16(p[e] * (aux_grad[e] - pa));
    }
    double gw = 0;
    for (int64_t j = 0; j < k; ++j) gw += RoundBf16(dw[t * k + j]) * w[t * k + j];
    for (int64_t j = 0; j < k; ++j) {
      const double r = RoundBf16(w[t * k + j] * (RoundBf16(dw[t * k + j]) - gw));
      d[sel[t * k + j]] = RoundBf16(d[sel[t * k + j]] + r);
    }
    for (int64_t e = 0; e < E; ++e) {
      ref[t * E + e] = d[e];
      got[t * E + e] = got_all[t * ld + e];
    }
  }
  ExpectRelErr("router backward dlogits (BF16) " + name, got, ref, 1e-3);
}

TEST_F(GptOssMoeGpuTest, RouterBackward) {
  RouterBackwardCase(37, 7, 2, 8, true);
  RouterBackwardCase(53, 16, 4, 16, false);
  RouterBackwardCase(1000, 130, 4, 136, true);
  RouterBackwardCase(9, 5, 5, 5, true);
}

TEST_F(GptOssMoeGpuTest, RejectsBadSizes) {
  EXPECT_FALSE(kernels::GptOssRouteTopK(nullptr, 8, nullptr, 4, kernels::kMoeMaxExperts + 1, 2, nullptr, nullptr,
                                        nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(kernels::GptOssRouteTopK(nullptr, 8, nullptr, 4, 8, 9, nullptr, nullptr, nullptr, nullptr).ok());
  EXPECT_FALSE(kernels::GptOssRouteTopK(nullptr, 6, nullptr, 4, 8, 2, nullptr, nullptr, nullptr, nullptr)
                   .ok());  // row stride below E
  EXPECT_FALSE(
      kernels::GptOssRouterBackward(nullptr, nullptr, nullptr, nullptr, nullptr, 4, 8, 2, nullptr, 6, nullptr).ok());
  EXPECT_FALSE(kernels::GptOssGluForward(nullptr, nullptr, -1, 8, {}, nullptr, nullptr).ok());
}

}  // namespace
}  // namespace slidedp
