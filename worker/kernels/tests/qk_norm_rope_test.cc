// Fused q/k RMSNorm + RoPE (qk_norm_rope.h) against an FP64 reference: forward q and k, backward
// dq/dk raw and the norm-weight gradients, for head dims 128, 64 and 16 and BF16 or FP32 norm
// weights; three packed documents at large positions, GQA 4/2 heads, a padded qkv row stride.
// RoPE alone with llama3's and yarn's frequency tables; both kinds with HF's attention scaling.
#include "worker/kernels/qk_norm_rope.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "common/model/model_config.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using QkNormRopeGpuTest = GpuTest;

// TW: the q_norm / k_norm weight type, as in rmsnorm_test.cc. attention_scaling: RopeArgs', which
// multiplies cos and sin (yarn's attention factor).
template <typename TW>
void CheckQkRope(int hd, float attention_scaling = 1.0f) {
  constexpr bool f32w = std::is_same_v<TW, float>;
  const int nq = 4, nkv = 2;
  const std::vector<int> docs = {13, 40, 24};
  int64_t T = 0;
  std::vector<int32_t> pos;
  for (int d : docs) {
    for (int i = 0; i < d; ++i) pos.push_back(i * 37 + 5);  // large positions exercise the angles
    T += d;
  }
  const int64_t ld = (nq + 2 * nkv) * hd + 8;
  const double eps = 1e-6, theta = 1e6;
  auto qkv = RandVec(T * ld, 1.3);
  auto qw = f32w ? RandF32NormWeights(hd, 0.2, 1.0) : RandVec(hd, 0.2, 1.0);
  auto kw = f32w ? RandF32NormWeights(hd, 0.2, 1.0) : RandVec(hd, 0.2, 1.0);
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
  a.attention_scaling = attention_scaling;
  Dev<float> accq(hd), acck(hd), ws(kernels::QkNormRopeBackwardWorkspaceNumel(a));
  Upload(accq, ToF32(dqw0));
  Upload(acck, ToF32(dkw0));
  ASSERT_OK(kernels::QkNormRopeForward(a, dqkv_in->get(), ld, dqw->get(), dkw->get(), dpos.get(), qo.get(), ko.get(),
                                       nullptr));
  ASSERT_OK(kernels::QkNormRopeBackward(a, dgq->get(), dgk->get(), dqkv_in->get(), ld, dqw->get(), dkw->get(),
                                        dpos.get(), dqkv.get(), ld, accq.get(), acck.get(), ws.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rq(T * nq * hd), rk(T * nkv * hd), rdq, gotdq, rdqw = dqw0, rdkw = dkw0;
  auto got_dqkv = DownBf16(dqkv.get(), T * ld);
  const int half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < nq + nkv; ++h) {
      const bool isq = h < nq;
      const double* xw = isq ? qw.data() : kw.data();
      std::vector<double> xv(hd), n(hd), out(hd), g(hd), dn(hd), c(half), s(half);
      double ss = 0;
      for (int i = 0; i < hd; ++i) {
        xv[i] = qkv[t * ld + h * hd + i];
        ss += xv[i] * xv[i];
      }
      const double r = 1.0 / std::sqrt(ss / hd + eps);
      for (int i = 0; i < hd; ++i) n[i] = xv[i] * r * xw[i];
      for (int i = 0; i < half; ++i) {
        const double ang = pos[t] / std::pow(theta, 2.0 * i / hd);
        c[i] = std::cos(ang) * attention_scaling;
        s[i] = std::sin(ang) * attention_scaling;
        out[i] = n[i] * c[i] - n[i + half] * s[i];
        out[i + half] = n[i + half] * c[i] + n[i] * s[i];
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
      for (int i = 0; i < half; ++i) {
        dn[i] = g[i] * c[i] + g[i + half] * s[i];
        dn[i + half] = g[i + half] * c[i] - g[i] * s[i];
      }
      double dot = 0;
      for (int i = 0; i < hd; ++i) dot += dn[i] * xw[i] * xv[i];
      for (int i = 0; i < hd; ++i) {
        rdq.push_back(r * xw[i] * dn[i] - xv[i] * r * r * r * dot / hd);
        gotdq.push_back(got_dqkv[t * ld + h * hd + i]);
        (isq ? rdqw : rdkw)[i] += dn[i] * xv[i] * r;
      }
    }
  const std::string tag = " (hd=" + std::to_string(hd) + ")" + (f32w ? " [fp32 w]" : "") +
                          (attention_scaling != 1.0f ? " [scaled " + std::to_string(attention_scaling) + "]" : "");
  const auto got_q = DownBf16(qo.get(), T * nq * hd), got_k = DownBf16(ko.get(), T * nkv * hd);
  ExpectRelErr("qk-norm+rope fwd q" + tag, got_q, rq, 5e-3);
  ExpectRelErr("qk-norm+rope fwd k" + tag, got_k, rk, 5e-3);
  ExpectRelErr("qk-norm+rope bwd dq,dk raw" + tag, gotdq, rdq, 5e-3);
  ExpectRelErr("qk-norm+rope bwd dq_norm_w +=" + tag, DownF32(accq.get(), hd), rdqw, 1e-4);
  ExpectRelErr("qk-norm+rope bwd dk_norm_w +=" + tag, DownF32(acck.get(), hd), rdkw, 1e-4);
  if (f32w) {
    // As in rmsnorm_test.cc: per-dimension gains (rows = token x head) show a weight rounded to BF16.
    // RoPE's FP32 angle error rotates the output, orthogonal to it, so it adds little here.
    const std::vector<double> ones(hd, 1.0);
    ExpectRelErr("qk-norm+rope fwd q per-dim gain" + tag, ColumnGain(got_q, rq, hd), ones, 6e-4);
    ExpectRelErr("qk-norm+rope fwd k per-dim gain" + tag, ColumnGain(got_k, rk, hd), ones, 6e-4);
    ExpectRelErr("qk-norm+rope bwd dq,dk raw per-dim gain" + tag, ColumnGain(gotdq, rdq, hd), ones, 6e-4);
  }
}

// RoPE alone (qwen2 / llama / mistral: no q/k norm) with a table of scaled inverse frequencies
// (ModelConfig::RopeInverseFrequencies: llama3's bands, or yarn's ramp) and the config's attention
// scaling, against FP64 rotations by those frequencies: forward q and k, backward dq/dk raw into a
// strided dqkv.
void CheckRopeAlone(int hd, RopeScaling::Type type) {
  const int nq = 4, nkv = 2;
  const std::vector<int> docs = {13, 40, 24};
  int64_t T = 0;
  std::vector<int32_t> pos;
  for (int d : docs) {
    for (int i = 0; i < d; ++i) pos.push_back(i * 251 + 3);  // up to ~10K: the low band turns
    T += d;
  }
  ModelConfig cfg;
  cfg.head_dim = hd;
  cfg.rope_theta = 500000;
  cfg.rope_scaling.type = type;
  cfg.rope_scaling.factor = 8;
  cfg.rope_scaling.original_max_position_embeddings = type == RopeScaling::Type::kYarn ? 1024 : 8192;
  const std::vector<float> inv = cfg.RopeInverseFrequencies();
  const float scaling = static_cast<float>(cfg.RopeAttentionScaling());
  if (type == RopeScaling::Type::kYarn) {
    EXPECT_GT(scaling, 1.2f);  // 0.1 ln 8 + 1
  }
  const int64_t ld = (nq + 2 * nkv) * hd + 8;
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
  ASSERT_OK(kernels::RopeForward(a, dqkv_in->get(), ld, dpos.get(), qo.get(), ko.get(), nullptr));
  ASSERT_OK(kernels::RopeBackward(a, dgq->get(), dgk->get(), dpos.get(), dqkv.get(), ld, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const int half = hd / 2;
  std::vector<double> rq(T * nq * hd), rk(T * nkv * hd), rd, gotd;
  const auto got_dqkv = DownBf16(dqkv.get(), T * ld);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < nq + nkv; ++h) {
      const bool isq = h < nq;
      const double* g = isq ? &gq[t * nq * hd + h * hd] : &gk[t * nkv * hd + (h - nq) * hd];
      double* out = isq ? &rq[t * nq * hd + h * hd] : &rk[t * nkv * hd + (h - nq) * hd];
      const double* x = &qkv[t * ld + h * hd];
      std::vector<double> d(hd);
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
        gotd.push_back(got_dqkv[t * ld + h * hd + i]);
      }
    }
  const std::string tag =
      " (hd=" + std::to_string(hd) + (type == RopeScaling::Type::kYarn ? ", yarn table, scaled)" : ", llama3 table)");
  ExpectRelErr("rope fwd q" + tag, DownBf16(qo.get(), T * nq * hd), rq, 5e-3);
  ExpectRelErr("rope fwd k" + tag, DownBf16(ko.get(), T * nkv * hd), rk, 5e-3);
  ExpectRelErr("rope bwd dq,dk raw" + tag, gotd, rd, 5e-3);
}

TEST_F(QkNormRopeGpuTest, RopeAloneScaledHeadDim128) { CheckRopeAlone(128, RopeScaling::Type::kLlama3); }
TEST_F(QkNormRopeGpuTest, RopeAloneScaledHeadDim64) { CheckRopeAlone(64, RopeScaling::Type::kLlama3); }
TEST_F(QkNormRopeGpuTest, RopeAloneYarnHeadDim128) { CheckRopeAlone(128, RopeScaling::Type::kYarn); }
TEST_F(QkNormRopeGpuTest, RopeAloneYarnHeadDim64) { CheckRopeAlone(64, RopeScaling::Type::kYarn); }

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

}  // namespace
}  // namespace slidedp
