// The MoE block kernels (moe.h) against host references at awkward sizes (7, 16 and 130 experts;
// 37, 53 and 1000 tokens, past one 64-token permutation chunk and one 256-token sum chunk with
// partial last chunks; hidden 72 and 37 for the vector and scalar row paths). Router: logits on a
// 0.125 grid, so equal logits (ties, broken to the lower expert) are frequent and unequal ones far
// apart; the top-k must match exactly. Permutation, gather, combine (FP32 product then add, in
// ascending expert order), the combine backward's BF16 gradient and the scatter-add are checked bit
// for bit; the sums and the router backward by relative error.
#include "worker/kernels/moe.h"

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
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using MoeGpuTest = GpuTest;

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

// Each token's k distinct experts, drawn uniformly from [0, E) without `never` (-1: none).
std::vector<int32_t> RandomTopK(int64_t T, int64_t E, int64_t k, int32_t never) {
  std::vector<int32_t> sel;
  std::vector<int32_t> all;
  for (int32_t e = 0; e < E; ++e) {
    if (e != never) all.push_back(e);
  }
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(all.begin(), all.end(), Rng());
    sel.insert(sel.end(), all.begin(), all.begin() + k);
  }
  return sel;
}

struct HostPerm {
  std::vector<int32_t> counts, offsets, token_index, slot_index, row_of_slot;
};

HostPerm Permute(const std::vector<int32_t>& sel, int64_t T, int64_t E, int64_t k) {
  HostPerm p;
  p.counts.assign(E, 0);
  for (int32_t e : sel) ++p.counts[e];
  p.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) p.offsets[e + 1] = p.offsets[e] + p.counts[e];
  p.token_index.resize(T * k);
  p.slot_index.resize(T * k);
  p.row_of_slot.resize(T * k);
  std::vector<int32_t> cursor(p.offsets.begin(), p.offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = cursor[sel[t * k + j]]++;
      p.token_index[r] = static_cast<int32_t>(t);
      p.slot_index[r] = static_cast<int32_t>(j);
      p.row_of_slot[t * k + j] = r;
    }
  }
  return p;
}

void RouteCase(int64_t T, int64_t E, int64_t k, int64_t ld, kernels::MoeTopKNorm norm) {
  const std::string name = absl::StrCat("T", T, " E", E, " k", k, " ld", ld,
                                        norm == kernels::MoeTopKNorm::kRenormalized ? " renorm" : " raw");
  std::uniform_int_distribution<int> grid(-20, 20);
  std::vector<double> logits(T * ld, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) logits[t * ld + e] = 0.125 * grid(Rng());
  }
  std::unique_ptr<Dev<bf16>> dl(NewBf16(logits));
  Dev<float> probs(T * E), w(T * k);
  Dev<int32_t> sel(T * k);
  ASSERT_OK(kernels::MoeRouteTopK(dl->get(), ld, T, E, k, norm, probs.get(), sel.get(), w.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::vector<double> rp(T * E), rw(T * k);
  std::vector<int32_t> rsel(T * k);
  for (int64_t t = 0; t < T; ++t) {
    const double* z = logits.data() + t * ld;
    const double mx = *std::max_element(z, z + E);
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(z[e] - mx);
    for (int64_t e = 0; e < E; ++e) rp[t * E + e] = std::exp(z[e] - mx) / s;
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return z[a] > z[b]; });
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += rp[t * E + order[j]];
    for (int64_t j = 0; j < k; ++j) {
      rsel[t * k + j] = order[j];
      rw[t * k + j] = rp[t * E + order[j]] / (norm == kernels::MoeTopKNorm::kRenormalized ? sum : 1.0);
    }
  }
  EXPECT_EQ(DownI32(sel.get(), T * k), rsel) << name << ": top-k experts (ties to the lower index)";
  ExpectRelErr("router probs " + name, DownF32(probs.get(), T * E), rp, 1e-6);
  ExpectRelErr("router weights " + name, DownF32(w.get(), T * k), rw, 1e-6);
}

TEST_F(MoeGpuTest, RouteTopK) {
  RouteCase(37, 7, 2, 8, kernels::MoeTopKNorm::kRenormalized);
  RouteCase(53, 16, 4, 19, kernels::MoeTopKNorm::kProbabilities);
  RouteCase(1000, 130, 5, 136, kernels::MoeTopKNorm::kRenormalized);
  RouteCase(9, 7, 7, 7, kernels::MoeTopKNorm::kProbabilities);  // k = E: every expert, in order
}

void PermutationCase(int64_t T, int64_t E, int64_t k, int32_t never) {
  const std::string name = absl::StrCat("T", T, " E", E, " k", k);
  const std::vector<int32_t> sel = RandomTopK(T, E, k, never);
  const HostPerm ref = Permute(sel, T, E, k);
  auto dsel = NewDev(sel.empty() ? std::vector<int32_t>{0} : sel);
  Dev<int32_t> ws(kernels::MoePermutationWorkspaceNumel(T, E)), counts(E), offsets(E + 1);
  Dev<int32_t> token_index(std::max<int64_t>(1, T * k)), slot_index(std::max<int64_t>(1, T * k)),
      row_of_slot(std::max<int64_t>(1, T * k));
  ASSERT_OK(kernels::MoeBuildPermutation(dsel->get(), T, k, E, ws.get(), counts.get(), offsets.get(), token_index.get(),
                                         slot_index.get(), row_of_slot.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(DownI32(counts.get(), E), ref.counts) << name;
  EXPECT_EQ(DownI32(offsets.get(), E + 1), ref.offsets) << name;
  if (T == 0) return;
  EXPECT_EQ(DownI32(token_index.get(), T * k), ref.token_index) << name;
  EXPECT_EQ(DownI32(slot_index.get(), T * k), ref.slot_index) << name;
  EXPECT_EQ(DownI32(row_of_slot.get(), T * k), ref.row_of_slot) << name;
  if (never >= 0) {
    EXPECT_EQ(DownI32(counts.get(), E)[never], 0) << name;
  }
}

TEST_F(MoeGpuTest, BuildPermutation) {
  PermutationCase(1000, 37, 3, 5);  // 16 chunks, the last of 40 tokens; expert 5 gets no row
  PermutationCase(37, 7, 2, -1);
  PermutationCase(5, 7, 7, -1);  // k = E
  PermutationCase(0, 7, 2, -1);  // no tokens: zero counts and offsets
}

TEST_F(MoeGpuTest, ProbSums) {
  for (const auto& [T, E] : {std::pair<int64_t, int64_t>{1000, 130}, {37, 7}, {0, 16}}) {
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    std::vector<float> p(std::max<int64_t>(1, T * E));
    for (auto& x : p) x = u(Rng());
    auto dp = NewDev(p);
    Dev<double> ws(kernels::MoeProbSumsWorkspaceNumel(T, E)), out(E);
    ASSERT_OK(kernels::MoeProbSums(dp->get(), T, E, ws.get(), out.get(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<double> got(E), ref(E, 0.0);
    cudaMemcpy(got.data(), out.get(), E * sizeof(double), cudaMemcpyDeviceToHost);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t e = 0; e < E; ++e) ref[e] += p[t * E + e];
    ExpectRelErr(absl::StrCat("prob sums T", T, " E", E), got, ref, 1e-12);
  }
}

TEST_F(MoeGpuTest, GatherRows) {
  for (const int64_t cols : {72, 37}) {  // 8-wide vectors, and the scalar path
    const int64_t T = 41, rows = 101;
    auto x = RandVec(T * cols);
    std::uniform_int_distribution<int32_t> pick(0, T - 1);
    std::vector<int32_t> index(rows);
    for (auto& i : index) i = pick(Rng());
    std::unique_ptr<Dev<bf16>> dx(NewBf16(x));
    auto di = NewDev(index);
    Dev<bf16> out(rows * cols);
    ASSERT_OK(kernels::MoeGatherRows(dx->get(), di->get(), rows, cols, out.get(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<double> ref(rows * cols);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) ref[r * cols + c] = x[index[r] * cols + c];
    ExpectRelErr(absl::StrCat("gather rows (", rows, "x", cols, ")"), DownBf16(out.get(), rows * cols), ref, 0.0);
  }
}

// Combine and its backward on one random routing.
TEST_F(MoeGpuTest, CombineAndBackward) {
  for (const int64_t H : {72, 37}) {
    const int64_t T = 37, E = 7, k = 3, R = T * k;
    const std::vector<int32_t> sel = RandomTopK(T, E, k, 2);
    const HostPerm perm = Permute(sel, T, E, k);
    auto eo = RandVec(R * H);
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    std::vector<float> w(R), dout(T * H);
    for (auto& x : w) x = u(Rng());
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto& x : dout) x = n(Rng());  // full FP32 values
    std::unique_ptr<Dev<bf16>> deo(NewBf16(eo));
    auto dw_in = NewDev(w), ddout = NewDev(dout);
    auto drow = NewDev(perm.row_of_slot), dtok = NewDev(perm.token_index), dslot = NewDev(perm.slot_index);
    Dev<float> out(T * H), dweight(R);
    Dev<bf16> d_eo(R * H);
    ASSERT_OK(kernels::MoeCombine(deo->get(), drow->get(), dw_in->get(), T, k, H, out.get(), nullptr));
    ASSERT_OK(kernels::MoeCombineBackward(ddout->get(), deo->get(), dtok->get(), dslot->get(), dw_in->get(), R, k, H,
                                          d_eo.get(), dweight.get(), nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());

    std::vector<double> ref_out(T * H), ref_deo(R * H), ref_dw(R);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<std::pair<int32_t, int64_t>> rows;  // (row, slot), ascending row = ascending expert
      for (int64_t j = 0; j < k; ++j) rows.push_back({perm.row_of_slot[t * k + j], j});
      std::sort(rows.begin(), rows.end());
      for (int64_t i = 0; i < H; ++i) {
        float acc = 0.0f;  // the host has no FMA contraction (x86-64 baseline): product, then add
        for (const auto& [r, j] : rows) {
          const float prod = static_cast<float>(eo[r * H + i]) * w[t * k + j];
          acc = acc + prod;
        }
        ref_out[t * H + i] = acc;
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = perm.token_index[r], j = perm.slot_index[r];
      double dot = 0;
      for (int64_t i = 0; i < H; ++i) {
        ref_deo[r * H + i] = Bf16ToFloat(FloatToBf16(dout[t * H + i] * w[t * k + j]));
        dot += static_cast<double>(dout[t * H + i]) * eo[r * H + i];
      }
      ref_dw[t * k + j] = dot;
    }
    const std::string sz = absl::StrCat("(T", T, " k", k, " H", H, ")");
    ExpectRelErr("combine, exact " + sz, DownF32(out.get(), T * H), ref_out, 0.0);
    ExpectRelErr("combine backward d_expert_out, exact " + sz, DownBf16(d_eo.get(), R * H), ref_deo, 0.0);
    ExpectRelErr("combine backward dweight " + sz, DownF32(dweight.get(), R), ref_dw, 1e-5);
  }
}

void RouterBackwardCase(int64_t T, int64_t E, int64_t k, int64_t ld, kernels::MoeTopKNorm norm, bool aux) {
  const bool renorm = norm == kernels::MoeTopKNorm::kRenormalized;
  const std::string name = absl::StrCat("T", T, " E", E, " k", k, renorm ? " renorm" : " raw", aux ? " aux" : "");
  std::normal_distribution<double> n(0.0, 2.0);
  std::vector<float> probs(T * E), w(T * k), dw(T * k);
  std::vector<int32_t> sel(T * k);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> z(E);
    double mx = -INFINITY, s = 0;
    for (auto& v : z) v = n(Rng()), mx = std::max(mx, v);
    for (auto& v : z) s += std::exp(v - mx);
    for (int64_t e = 0; e < E; ++e) probs[t * E + e] = static_cast<float>(std::exp(z[e] - mx) / s);
    std::vector<int32_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return probs[t * E + a] > probs[t * E + b]; });
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += probs[t * E + order[j]];
    for (int64_t j = 0; j < k; ++j) {
      sel[t * k + j] = order[j];
      w[t * k + j] = renorm ? probs[t * E + order[j]] / sum : probs[t * E + order[j]];
      dw[t * k + j] = static_cast<float>(n(Rng()));
    }
  }
  std::vector<double> aux_grad(E);
  for (auto& v : aux_grad) v = 1e-2 * n(Rng());
  auto dprobs = NewDev(probs), dwt = NewDev(w), ddw = NewDev(dw);
  auto dsel = NewDev(sel);
  auto daux = NewDev(aux_grad);
  Dev<bf16> dz(T * ld);
  ASSERT_OK(kernels::MoeRouterBackward(dprobs->get(), dsel->get(), dwt->get(), ddw->get(), aux ? daux->get() : nullptr,
                                       T, E, k, norm, dz.get(), ld, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> got_all = DownBf16(dz.get(), T * ld), got(T * E), ref(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const float* p = probs.data() + t * E;
    std::vector<double> dp(E, 0.0);
    if (aux) dp.assign(aux_grad.begin(), aux_grad.end());
    double s = 0, dww = 0;
    for (int64_t j = 0; j < k; ++j) s += p[sel[t * k + j]], dww += double(dw[t * k + j]) * w[t * k + j];
    for (int64_t j = 0; j < k; ++j) dp[sel[t * k + j]] += renorm ? (dw[t * k + j] - dww) / s : dw[t * k + j];
    double pd = 0;
    for (int64_t e = 0; e < E; ++e) pd += p[e] * dp[e];
    for (int64_t e = 0; e < E; ++e) {
      ref[t * E + e] = p[e] * (dp[e] - pd);
      got[t * E + e] = got_all[t * ld + e];
    }
  }
  ExpectRelErr("router backward dlogits (BF16) " + name, got, ref, 5e-3);
}

TEST_F(MoeGpuTest, RouterBackward) {
  RouterBackwardCase(37, 7, 2, 8, kernels::MoeTopKNorm::kRenormalized, true);
  RouterBackwardCase(53, 16, 4, 16, kernels::MoeTopKNorm::kProbabilities, false);
  RouterBackwardCase(1000, 130, 5, 136, kernels::MoeTopKNorm::kRenormalized, false);
  RouterBackwardCase(41, 16, 4, 21, kernels::MoeTopKNorm::kProbabilities, true);
}

TEST_F(MoeGpuTest, ScatterAddRows) {
  const int64_t T = 61, rows = 29, cols = 72;
  std::vector<int32_t> index(T);
  std::iota(index.begin(), index.end(), 0);
  std::shuffle(index.begin(), index.end(), Rng());
  index.resize(rows);  // distinct tokens, as one expert's rows
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> dst(T * cols), src(rows * cols);
  for (auto& v : dst) v = n(Rng());
  for (auto& v : src) v = n(Rng());
  auto ddst = NewDev(dst), dsrc = NewDev(src);
  auto di = NewDev(index);
  ASSERT_OK(kernels::MoeScatterAddRows(dsrc->get(), di->get(), rows, cols, ddst->get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ref(dst.begin(), dst.end());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ref[index[r] * cols + c] = dst[index[r] * cols + c] + src[r * cols + c];
  ExpectRelErr("scatter-add rows, exact (29 of 61 rows, 72 wide)", DownF32(ddst->get(), T * cols), ref, 0.0);
}

TEST_F(MoeGpuTest, RejectsBadSizes) {
  EXPECT_FALSE(kernels::MoeRouteTopK(nullptr, 8, 4, kernels::kMoeMaxExperts + 1, 2,
                                     kernels::MoeTopKNorm::kProbabilities, nullptr, nullptr, nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(kernels::MoeRouteTopK(nullptr, 8, 4, 8, 9, kernels::MoeTopKNorm::kProbabilities, nullptr, nullptr,
                                     nullptr, nullptr)
                   .ok());
  EXPECT_FALSE(kernels::MoeRouteTopK(nullptr, 6, 4, 8, 2, kernels::MoeTopKNorm::kProbabilities, nullptr, nullptr,
                                     nullptr, nullptr)
                   .ok());  // row stride below E
}

}  // namespace
}  // namespace slidedp
