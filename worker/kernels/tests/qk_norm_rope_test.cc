// Fused q/k RMSNorm + RoPE (qk_norm_rope.h) against an FP64 reference: forward q and k, backward
// dq/dk raw and the norm-weight gradients, for head dims 256, 128, 64 and 16 and BF16 or FP32 norm
// weights; three packed documents at large positions, GQA 4/2 heads, a padded qkv row stride.
// Qwen3.5's gated full attention: (1 + w) weights, RoPE on 64 of 256 dims, q heads interleaved
// with their gates (q stride 2 * hd; the backward must leave the gate columns alone), T = 1, 7, 129.
// RoPE alone with llama3's and yarn's frequency tables, also partial and strided; both kinds with
// HF's attention scaling. q alone (no kv heads: Gemma 4's kv-shared layers).
#include "worker/kernels/qk_norm_rope.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "common/model/model_config.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using QkNormRopeGpuTest = GpuTest;

// One layout and weight mode of the fused check. The defaults are Qwen3's: contiguous q heads, k
// right after them, RoPE on the whole head, plain weights, three packed documents.
struct QkCase {
  int hd = 128;
  int rotary_dim = 0;      // RopeArgs::rotary_dim (0: hd)
  int q_stride_heads = 1;  // q head stride in head dims: 2 is Qwen3.5's [query | gate] per head
  int k_gap = 0;           // > 0: k_column set explicitly, this many columns past the q heads
  kernels::NormWeight weight = kernels::NormWeight::kPlain;
  float attention_scaling = 1.0f;  // RopeArgs' (yarn's attention factor on cos and sin)
  std::vector<int> docs = {13, 40, 24};
  int nkv = 2;  // 0: q alone (Gemma 4's kv-shared layers): the k arguments null, dqkv's k columns untouched
};

// TW: the q_norm / k_norm weight type, as in rmsnorm_test.cc. qkv rows hold the q heads (and the
// gates between them), k and v, padded; dqkv's columns the kernels must not write (gates, the gap,
// v, the padding) must keep their NaN poison.
template <typename TW>
void CheckQkRopeCase(const QkCase& cs) {
  constexpr bool f32w = std::is_same_v<TW, float>;
  const int hd = cs.hd, nq = 4, nkv = cs.nkv;
  const int rot = cs.rotary_dim == 0 ? hd : cs.rotary_dim, rh = rot / 2;
  const int64_t qs = static_cast<int64_t>(cs.q_stride_heads) * hd, kcol = nq * qs + cs.k_gap;
  const bool one_plus = cs.weight == kernels::NormWeight::kOnePlus;
  int64_t T = 0;
  std::vector<int32_t> pos;
  for (int d : cs.docs) {
    for (int i = 0; i < d; ++i) pos.push_back(i * 37 + 5);  // large positions exercise the angles
    T += d;
  }
  const int64_t ld = kcol + 2 * std::max(nkv, 2) * hd + 8;  // q alone: k's columns stay, unread
  const double eps = 1e-6, theta = 1e6;
  const double w_mean = one_plus ? 0.0 : 1.0, w_scale = one_plus ? 0.1 : 0.2;
  auto qkv = RandVec(T * ld, 1.3);
  auto qw = f32w ? RandF32NormWeights(hd, w_scale, w_mean) : RandVec(hd, w_scale, w_mean);
  auto kw = f32w ? RandF32NormWeights(hd, w_scale, w_mean) : RandVec(hd, w_scale, w_mean);
  auto gq = RandVec(T * nq * hd), gk = RandVec(T * nkv * hd), dqw0 = RandVec(hd), dkw0 = RandVec(hd);
  std::unique_ptr<Dev<bf16>> dqkv_in(NewBf16(qkv)), dgq(NewBf16(gq)), dgk(NewBf16(gk));
  std::unique_ptr<Dev<TW>> dqw(NewAct<TW>(qw)), dkw(NewAct<TW>(kw));
  Dev<int32_t> dpos(T);
  Upload(dpos, pos);
  Dev<bf16> qo(T * nq * hd), ko(T * nkv * hd), dqkv(T * ld);
  kernels::RopeArgs a;
  a.tokens = T;
  a.num_q_heads = nq;
  a.num_kv_heads = nkv;
  a.head_dim = hd;
  a.eps = eps;
  a.theta = theta;
  a.attention_scaling = cs.attention_scaling;
  a.norm_weight = cs.weight;
  a.rotary_dim = cs.rotary_dim;
  if (cs.q_stride_heads != 1) a.q_head_stride = qs;
  if (cs.k_gap > 0) a.k_column = kcol;
  Dev<float> accq(hd), acck(hd), ws(kernels::QkNormRopeBackwardWorkspaceNumel(a));
  Upload(accq, ToF32(dqw0));
  Upload(acck, ToF32(dkw0));
  const bool k = nkv > 0;
  ASSERT_OK(kernels::QkNormRopeForward(a, dqkv_in->get(), ld, dqw->get(), k ? dkw->get() : nullptr, dpos.get(),
                                       qo.get(), k ? ko.get() : nullptr, nullptr));
  ASSERT_OK(kernels::QkNormRopeBackward(a, dgq->get(), k ? dgk->get() : nullptr, dqkv_in->get(), ld, dqw->get(),
                                        k ? dkw->get() : nullptr, dpos.get(), dqkv.get(), ld, accq.get(),
                                        k ? acck.get() : nullptr, ws.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rq(T * nq * hd), rk(T * nkv * hd), rdq, gotdq, rdqw = dqw0, rdkw = dkw0;
  auto got_dqkv = DownBf16(dqkv.get(), T * ld);
  std::vector<bool> written(ld, false);  // the dqkv columns the backward writes
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < nq + nkv; ++h) {
      const bool isq = h < nq;
      const int64_t col = isq ? h * qs : kcol + (h - nq) * hd;
      const double* xw = isq ? qw.data() : kw.data();
      std::vector<double> wa(hd), xv(hd), n(hd), out(hd), g(hd), dn(hd), c(rh), s(rh);
      double ss = 0;
      for (int i = 0; i < hd; ++i) {
        wa[i] = one_plus ? 1.0 + xw[i] : xw[i];
        xv[i] = qkv[t * ld + col + i];
        ss += xv[i] * xv[i];
      }
      const double r = 1.0 / std::sqrt(ss / hd + eps);
      for (int i = 0; i < hd; ++i) n[i] = xv[i] * r * wa[i];
      for (int i = rot; i < hd; ++i) out[i] = n[i];  // past rotary_dim: passed through
      for (int i = 0; i < rh; ++i) {
        const double ang = pos[t] / std::pow(theta, 2.0 * i / rot);
        c[i] = std::cos(ang) * cs.attention_scaling;
        s[i] = std::sin(ang) * cs.attention_scaling;
        out[i] = n[i] * c[i] - n[i + rh] * s[i];
        out[i + rh] = n[i + rh] * c[i] + n[i] * s[i];
      }
      for (int i = 0; i < hd; ++i) {
        if (isq) {
          rq[t * nq * hd + h * hd + i] = out[i];
          g[i] = gq[t * nq * hd + h * hd + i];
        } else {
          rk[t * nkv * hd + (h - nq) * hd + i] = out[i];
          g[i] = gk[t * nkv * hd + (h - nq) * hd + i];
        }
      }
      for (int i = rot; i < hd; ++i) dn[i] = g[i];
      for (int i = 0; i < rh; ++i) {
        dn[i] = g[i] * c[i] + g[i + rh] * s[i];
        dn[i + rh] = g[i + rh] * c[i] - g[i] * s[i];
      }
      double dot = 0;
      for (int i = 0; i < hd; ++i) dot += dn[i] * wa[i] * xv[i];
      for (int i = 0; i < hd; ++i) {
        rdq.push_back(r * wa[i] * dn[i] - xv[i] * r * r * r * dot / hd);
        gotdq.push_back(got_dqkv[t * ld + col + i]);
        written[col + i] = true;
        (isq ? rdqw : rdkw)[i] += dn[i] * xv[i] * r;
      }
    }
  int64_t clobbered = 0;  // a written value (not NaN) in a column the backward must leave alone
  for (int64_t t = 0; t < T; ++t)
    for (int64_t col = 0; col < ld; ++col) clobbered += !written[col] && !std::isnan(got_dqkv[t * ld + col]);
  EXPECT_EQ(clobbered, 0) << "dqkv values written outside the q and k heads (gates, gap, v, padding)";
  std::string tag = " (hd=" + std::to_string(hd) + ", T=" + std::to_string(T);
  if (rot != hd) tag += ", rotary " + std::to_string(rot);
  if (cs.q_stride_heads != 1) tag += ", q stride " + std::to_string(qs);
  if (cs.k_gap > 0) tag += ", k_column " + std::to_string(kcol);
  tag += ")";
  if (f32w) tag += " [fp32 w]";
  if (one_plus) tag += " [1 + w]";
  if (cs.attention_scaling != 1.0f) tag += " [scaled " + std::to_string(cs.attention_scaling) + "]";
  if (!k) tag += " [q alone]";
  const auto got_q = DownBf16(qo.get(), T * nq * hd), got_k = DownBf16(ko.get(), T * nkv * hd);
  ExpectRelErr("qk-norm+rope fwd q" + tag, got_q, rq, 5e-3);
  if (k) ExpectRelErr("qk-norm+rope fwd k" + tag, got_k, rk, 5e-3);
  ExpectRelErr("qk-norm+rope bwd dq,dk raw" + tag, gotdq, rdq, 5e-3);
  ExpectRelErr("qk-norm+rope bwd dq_norm_w +=" + tag, DownF32(accq.get(), hd), rdqw, 1e-4);
  // q alone leaves dk_norm_w's accumulator as it was (the kernel is given none; nothing may land there).
  ExpectRelErr("qk-norm+rope bwd dk_norm_w +=" + tag, DownF32(acck.get(), hd), rdkw, k ? 1e-4 : 0.0);
  if (f32w && T >= 64) {
    // As in rmsnorm_test.cc: per-dimension gains (rows = token x head) show a weight rounded to BF16
    // (or 1 + w formed in BF16). RoPE's FP32 angle error rotates the output, orthogonal to it, so it
    // adds little here. Fewer rows leave the BF16 output rounding in the gains.
    const std::vector<double> ones(hd, 1.0);
    ExpectRelErr("qk-norm+rope fwd q per-dim gain" + tag, ColumnGain(got_q, rq, hd), ones, 6e-4);
    ExpectRelErr("qk-norm+rope fwd k per-dim gain" + tag, ColumnGain(got_k, rk, hd), ones, 6e-4);
    ExpectRelErr("qk-norm+rope bwd dq,dk raw per-dim gain" + tag, ColumnGain(gotdq, rdq, hd), ones, 6e-4);
  }
}

// Qwen3's layout at head dim hd (the cases that predate the layout options).
template <typename TW>
void CheckQkRope(int hd, float attention_scaling = 1.0f) {
  QkCase c;
  c.hd = hd;
  c.attention_scaling = attention_scaling;
  CheckQkRopeCase<TW>(c);
}

// Qwen3.5's full attention: head dim 256, RoPE on the first 64 dims, q heads 2 * hd apart ([query |
// gate] per head), (1 + w) weights ~ N(0, 0.1), at T = 1, 7 and 129 (two documents).
template <typename TW>
void CheckQwen35Rows(QkCase c) {
  for (const std::vector<int>& docs : {std::vector<int>{1}, std::vector<int>{7}, std::vector<int>{50, 79}}) {
    c.docs = docs;
    CheckQkRopeCase<TW>(c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}
QkCase Qwen35Case() {
  QkCase c;
  c.hd = 256;
  c.rotary_dim = 64;
  c.q_stride_heads = 2;
  c.weight = kernels::NormWeight::kOnePlus;
  return c;
}

// RoPE alone (qwen2 / llama / mistral: no q/k norm) with a table of scaled inverse frequencies
// (ModelConfig::RopeInverseFrequencies: llama3's bands, or yarn's ramp) and the config's attention
// scaling, against FP64 rotations by those frequencies: forward q and k, backward dq/dk raw into a
// strided dqkv. rotary_dim > 0: RoPE on that many dims of each head (ModelConfig's
// partial_rotary_factor, whose table has rotary_dim / 2 entries), the rest passed through;
// q_stride_heads 2: q heads 2 * hd apart, as in Qwen3.5's [query | gate] rows.
void CheckRopeAlone(int hd, RopeScaling::Type type, int rotary_dim = 0, int q_stride_heads = 1) {
  const int nq = 4, nkv = 2;
  const std::vector<int> docs = {13, 40, 24};
  int64_t T = 0;
  std::vector<int32_t> pos;
  for (int d : docs) {
    for (int i = 0; i < d; ++i) pos.push_back(i * 251 + 3);  // up to ~10K: the low band turns
    T += d;
  }
  const int rot = rotary_dim == 0 ? hd : rotary_dim;
  const int64_t qs = static_cast<int64_t>(q_stride_heads) * hd, kcol = nq * qs;
  ModelConfig cfg;
  cfg.head_dim = hd;
  cfg.partial_rotary_factor = static_cast<double>(rot) / hd;
  cfg.rope_theta = 500000;
  cfg.rope_scaling.type = type;
  cfg.rope_scaling.factor = 8;
  cfg.rope_scaling.original_max_position_embeddings = type == RopeScaling::Type::kYarn ? 1024 : 8192;
  const std::vector<float> inv = cfg.RopeInverseFrequencies();
  ASSERT_EQ(static_cast<int>(inv.size()), rot / 2);
  const float scaling = static_cast<float>(cfg.RopeAttentionScaling());
  if (type == RopeScaling::Type::kYarn) {
    EXPECT_GT(scaling, 1.2f);  // 0.1 ln 8 + 1
  }
  const int64_t ld = kcol + 2 * nkv * hd + 8;
  auto qkv = RandVec(T * ld, 1.3);
  auto gq = RandVec(T * nq * hd), gk = RandVec(T * nkv * hd);
  std::unique_ptr<Dev<bf16>> dqkv_in(NewBf16(qkv)), dgq(NewBf16(gq)), dgk(NewBf16(gk));
  Dev<int32_t> dpos(T);
  Upload(dpos, pos);
  Dev<float> dinv(inv.size());
  Upload(dinv, inv);
  Dev<bf16> qo(T * nq * hd), ko(T * nkv * hd), dqkv(T * ld);
  kernels::RopeArgs a;
  a.tokens = T;
  a.num_q_heads = nq;
  a.num_kv_heads = nkv;
  a.head_dim = hd;
  a.theta = 500000;
  a.inv_freq = dinv.get();
  a.attention_scaling = scaling;
  a.rotary_dim = rotary_dim;
  a.q_head_stride = q_stride_heads == 1 ? 0 : qs;
  ASSERT_OK(kernels::RopeForward(a, dqkv_in->get(), ld, dpos.get(), qo.get(), ko.get(), nullptr));
  ASSERT_OK(kernels::RopeBackward(a, dgq->get(), dgk->get(), dpos.get(), dqkv.get(), ld, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const int half = rot / 2;  // rotate_half within the rotated dims
  std::vector<double> rq(T * nq * hd), rk(T * nkv * hd), rd, gotd;
  const auto got_dqkv = DownBf16(dqkv.get(), T * ld);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < nq + nkv; ++h) {
      const bool isq = h < nq;
      const double* g = isq ? &gq[t * nq * hd + h * hd] : &gk[t * nkv * hd + (h - nq) * hd];
      double* out = isq ? &rq[t * nq * hd + h * hd] : &rk[t * nkv * hd + (h - nq) * hd];
      const int64_t col = isq ? h * qs : kcol + (h - nq) * hd;
      const double* x = &qkv[t * ld + col];
      std::vector<double> d(hd);
      for (int i = rot; i < hd; ++i) {  // passed through
        out[i] = x[i];
        d[i] = g[i];
      }
      for (int i = 0; i < half; ++i) {
        const double ang = static_cast<double>(pos[t]) * inv[i];
        const double c = std::cos(ang) * scaling, s = std::sin(ang) * scaling;
        out[i] = x[i] * c - x[i + half] * s;
        out[i + half] = x[i + half] * c + x[i] * s;
        d[i] = g[i] * c + g[i + half] * s;
        d[i + half] = g[i + half] * c - g[i] * s;
      }
      for (int i = 0; i < hd; ++i) {
        rd.push_back(d[i]);
        gotd.push_back(got_dqkv[t * ld + col + i]);
      }
    }
  const std::string tag = " (hd=" + std::to_string(hd) +
                          (rot != hd ? ", rotary " + std::to_string(rot) : std::string()) +
                          (q_stride_heads != 1 ? ", q stride " + std::to_string(qs) : std::string()) +
                          (type == RopeScaling::Type::kYarn ? ", yarn table, scaled)" : ", llama3 table)");
  ExpectRelErr("rope fwd q" + tag, DownBf16(qo.get(), T * nq * hd), rq, 5e-3);
  ExpectRelErr("rope fwd k" + tag, DownBf16(ko.get(), T * nkv * hd), rk, 5e-3);
  ExpectRelErr("rope bwd dq,dk raw" + tag, gotd, rd, 5e-3);
}

TEST_F(QkNormRopeGpuTest, RopeAloneScaledHeadDim128) { CheckRopeAlone(128, RopeScaling::Type::kLlama3); }
TEST_F(QkNormRopeGpuTest, RopeAloneScaledHeadDim64) { CheckRopeAlone(64, RopeScaling::Type::kLlama3); }
TEST_F(QkNormRopeGpuTest, RopeAloneYarnHeadDim128) { CheckRopeAlone(128, RopeScaling::Type::kYarn); }
TEST_F(QkNormRopeGpuTest, RopeAloneYarnHeadDim64) { CheckRopeAlone(64, RopeScaling::Type::kYarn); }
// Partial rotation (a table of rotary_dim / 2 entries, attention scaling on the rotated dims only)
// with q heads 2 * hd apart.
TEST_F(QkNormRopeGpuTest, RopeAloneYarnHeadDim256Rotary64QStride512) {
  CheckRopeAlone(256, RopeScaling::Type::kYarn, 64, 2);
}
TEST_F(QkNormRopeGpuTest, RopeAloneLlama3HeadDim128Rotary32) { CheckRopeAlone(128, RopeScaling::Type::kLlama3, 32); }

TEST_F(QkNormRopeGpuTest, Bf16WeightsHeadDim128) { CheckQkRope<bf16>(128); }
// Half the lanes idle: catches use of unset per-lane state.
TEST_F(QkNormRopeGpuTest, Bf16WeightsHeadDim64) { CheckQkRope<bf16>(64); }
TEST_F(QkNormRopeGpuTest, Bf16WeightsHeadDim16) { CheckQkRope<bf16>(16); }
TEST_F(QkNormRopeGpuTest, Fp32WeightsHeadDim128) { CheckQkRope<float>(128); }
TEST_F(QkNormRopeGpuTest, Fp32WeightsHeadDim64) { CheckQkRope<float>(64); }
TEST_F(QkNormRopeGpuTest, Fp32WeightsHeadDim16) { CheckQkRope<float>(16); }
// yarn's attention factor for factor 4 (0.1 ln 4 + 1) on cos and sin, forward and backward.
TEST_F(QkNormRopeGpuTest, AttentionScalingBf16WeightsHeadDim128) { CheckQkRope<bf16>(128, 1.1386294f); }
TEST_F(QkNormRopeGpuTest, AttentionScalingFp32WeightsHeadDim64) { CheckQkRope<float>(64, 1.1386294f); }
// Head dim 256 with RoPE on all of it (two groups per lane, the forward's 2-iteration kernel).
TEST_F(QkNormRopeGpuTest, Bf16WeightsHeadDim256) { CheckQkRope<bf16>(256); }
TEST_F(QkNormRopeGpuTest, Fp32WeightsHeadDim256) { CheckQkRope<float>(256); }

// Qwen3.5's gated full attention (Qwen35Case: hd 256, rotary 64, q stride 512, 1 + w), T = 1, 7, 129.
TEST_F(QkNormRopeGpuTest, Qwen35Bf16Weights) { CheckQwen35Rows<bf16>(Qwen35Case()); }
TEST_F(QkNormRopeGpuTest, Qwen35Fp32Weights) { CheckQwen35Rows<float>(Qwen35Case()); }
// The same with k at an explicit k_column (8 columns past the q heads) and yarn's attention factor.
TEST_F(QkNormRopeGpuTest, Qwen35ExplicitKColumnScaled) {
  QkCase c = Qwen35Case();
  c.k_gap = 8;
  c.attention_scaling = 1.1386294f;
  CheckQwen35Rows<float>(c);
}
// Each option alone at a smaller head: (1 + w) weights on Qwen3's layout; partial rotation (half of
// the groups pass through, the other half rotate); q stride 2 * hd.
TEST_F(QkNormRopeGpuTest, OnePlusWeightsHeadDim128) {
  QkCase c;
  c.weight = kernels::NormWeight::kOnePlus;
  CheckQkRopeCase<bf16>(c);
}
TEST_F(QkNormRopeGpuTest, PartialRotaryHeadDim128Rotary64) {
  QkCase c;
  c.rotary_dim = 64;
  CheckQkRopeCase<float>(c);
}
TEST_F(QkNormRopeGpuTest, QStrideHeadDim64) {
  QkCase c;
  c.hd = 64;
  c.q_stride_heads = 2;
  CheckQkRopeCase<bf16>(c);
}
// q alone (num_kv_heads 0: Gemma 4's kv-shared layers, which attend with an earlier layer's keys):
// the k arguments null, k's columns of dqkv left as they were (NaN), at hd 32 and 256.
TEST_F(QkNormRopeGpuTest, QAloneHeadDim32) {
  QkCase c;
  c.hd = 32;
  c.nkv = 0;
  CheckQkRopeCase<float>(c);
}
TEST_F(QkNormRopeGpuTest, QAloneHeadDim256) {
  QkCase c;
  c.hd = 256;
  c.nkv = 0;
  CheckQkRopeCase<bf16>(c);
}

// Arguments the lane layout cannot serve are refused before any launch.
TEST_F(QkNormRopeGpuTest, RefusesBadRotaryDimAndStride) {
  kernels::RopeArgs a;
  a.tokens = 4;
  a.num_q_heads = 2;
  a.num_kv_heads = 1;
  a.head_dim = 256;
  a.rotary_dim = 66;  // not a multiple of 4
  Dev<bf16> buf(4 * 2048);
  Dev<int32_t> pos(4);
  EXPECT_TRUE(
      absl::IsInvalidArgument(kernels::RopeForward(a, buf.get(), 2048, pos.get(), buf.get(), buf.get(), nullptr)));
  a.rotary_dim = 512;  // wider than the head
  EXPECT_TRUE(
      absl::IsInvalidArgument(kernels::RopeForward(a, buf.get(), 2048, pos.get(), buf.get(), buf.get(), nullptr)));
  a.rotary_dim = 64;
  a.q_head_stride = 128;  // narrower than the head
  EXPECT_TRUE(
      absl::IsInvalidArgument(kernels::RopeForward(a, buf.get(), 2048, pos.get(), buf.get(), buf.get(), nullptr)));
  a.head_dim = 260;  // over 256
  a.q_head_stride = 0;
  EXPECT_TRUE(
      absl::IsInvalidArgument(kernels::RopeForward(a, buf.get(), 2048, pos.get(), buf.get(), buf.get(), nullptr)));
}

}  // namespace
}  // namespace slidedp
