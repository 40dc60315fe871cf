// gemma3's reference math against transformers' modeling_gemma3.py written out here op by op, in
// double: PyTorch's tanh GELU and its derivative; a whole decoder layer of each kind (the sandwich
// norms as 1 + w, q/k norms, the layer's own RoPE table, scores scaled by query_pre_attn_scalar^-0.5
// within the window, GeGLU); the head's soft-capped logits and their gradients; the scaled embedding.
// And the CPU backend on gemma3: tiled equals untiled, every policy recomputes the layer.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu/cpu_backend.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/dense_reference_math_internal.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::AwkwardGemma3Config;
using testing::MakeBatch;
using testing::RandomNormals;
using testing::RandomUnitParams;
using testing::RefGeluTanh;
using testing::RefLinear;

TEST(Gemma3Ops, GeluTanhAndItsDerivative) {
  for (double x : {-7.5, -3.0, -1.0, -0.3, 0.0, 1e-3, 0.5, 1.7, 4.0, 9.0}) {
    EXPECT_NEAR(dense_math::GeluTanh(x), RefGeluTanh(x), 1e-15 * (1 + std::fabs(x))) << x;
    const double h = 1e-6;
    const double fd = (RefGeluTanh(x + h) - RefGeluTanh(x - h)) / (2 * h);
    EXPECT_NEAR(dense_math::GeluTanhGrad(x), fd, 1e-8) << x;
    EXPECT_NEAR(dense_math::GeluTanh(static_cast<float>(x)), RefGeluTanh(x), 2e-6 * (1 + std::fabs(x))) << x;
  }
}

// transformers' Gemma3RMSNorm over each row of n: x * rsqrt(mean(x^2) + eps) * (1 + w).
std::vector<double> GemmaNorm(const double* x, const double* w, int64_t rows, int64_t n, double eps) {
  std::vector<double> y(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += x[r * n + i] * x[r * n + i];
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(n) + eps);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * rs * (1.0 + w[i]);
  }
  return y;
}

// apply_rotary_pos_emb with rotate_half on [T, heads, hd], from float tables cos/sin [T, hd / 2].
void Rotate(std::vector<double>& v, int64_t T, int64_t heads, int64_t hd, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      double* p = v.data() + (t * heads + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const double a = p[i], b = p[i + half], c = cos[t * half + i], s = sin[t * half + i];
        p[i] = a * c - b * s;
        p[i + half] = b * c + a * s;
      }
    }
}

// One Gemma3DecoderLayer, eager attention with its mask written out: key j is seen by query i iff
// j is in i's document, j <= i and (sliding) i - j < window.
std::vector<double> HfGemma3Layer(const ModelConfig& c, const UnitLayout& u, const std::vector<double>& p,
                                  const MicroBatch& mb, const RopeTables& rope, const std::vector<double>& x) {
  const int64_t T = mb.num_tokens(), H = c.hidden_size, hd = c.head_dim, nh = c.num_attention_heads;
  const int64_t nkv = c.num_key_value_heads, I = c.intermediate_size;
  const double eps = c.rms_norm_eps;
  auto w = [&](DecoderTensor t) { return p.data() + u.Find(t)->offset_numel; };
  const std::vector<double> xn = GemmaNorm(x.data(), w(kInputNorm), T, H, eps);
  std::vector<double> q = RefLinear(xn, w(kQProj), T, H, nh * hd), k = RefLinear(xn, w(kKProj), T, H, nkv * hd);
  const std::vector<double> v = RefLinear(xn, w(kVProj), T, H, nkv * hd);
  q = GemmaNorm(q.data(), w(kQNorm), T * nh, hd, eps);
  k = GemmaNorm(k.data(), w(kKNorm), T * nkv, hd, eps);
  const bool sliding = u.attention_window > 0;
  const float* cos = sliding ? rope.sliding_cos.data() : rope.cos.data();
  const float* sin = sliding ? rope.sliding_sin.data() : rope.sin.data();
  Rotate(q, T, nh, hd, cos, sin);
  Rotate(k, T, nkv, hd, cos, sin);
  std::vector<int64_t> doc(T);
  for (size_t d = 0; d + 1 < mb.cu_seqlens.size(); ++d)
    for (int32_t t = mb.cu_seqlens[d]; t < mb.cu_seqlens[d + 1]; ++t) doc[t] = static_cast<int64_t>(d);
  std::vector<double> attn(T * nh * hd, 0.0);
  const double scaling = std::pow(c.query_pre_attn_scalar, -0.5);
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t g = h / (nh / nkv);
    for (int64_t i = 0; i < T; ++i) {
      std::vector<double> s(T, -std::numeric_limits<double>::infinity());
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (int64_t j = 0; j < T; ++j) {
        if (doc[j] != doc[i] || j > i || (sliding && i - j >= u.attention_window)) continue;
        double dot = 0;
        for (int64_t e = 0; e < hd; ++e) dot += q[(i * nh + h) * hd + e] * k[(j * nkv + g) * hd + e];
        s[j] = dot * scaling;
        mx = std::max(mx, s[j]);
      }
      for (int64_t j = 0; j < T; ++j) sum += std::exp(s[j] - mx);
      for (int64_t j = 0; j < T; ++j)
        for (int64_t e = 0; e < hd; ++e)
          attn[(i * nh + h) * hd + e] += std::exp(s[j] - mx) / sum * v[(j * nkv + g) * hd + e];
    }
  }
  std::vector<double> h1 = GemmaNorm(RefLinear(attn, w(kOProj), T, nh * hd, H).data(), w(kPostNorm), T, H, eps);
  for (int64_t i = 0; i < T * H; ++i) h1[i] += x[i];
  const std::vector<double> hn = GemmaNorm(h1.data(), w(kPreFfnNorm), T, H, eps);
  const std::vector<double> gate = RefLinear(hn, w(kGateProj), T, H, I), up = RefLinear(hn, w(kUpProj), T, H, I);
  std::vector<double> m(T * I);
  for (int64_t i = 0; i < T * I; ++i) m[i] = RefGeluTanh(gate[i]) * up[i];
  std::vector<double> y = GemmaNorm(RefLinear(m, w(kDownProj), T, I, H).data(), w(kPostFfnNorm), T, H, eps);
  for (int64_t i = 0; i < T * H; ++i) y[i] += h1[i];
  return y;
}

// Layers 0 (sliding over 3 keys, the sliding RoPE) and 2 (full, the global RoPE with linear 8):
// the reference math's forward, fed the stored weights with AddNormWeightOffsets' 1 added as the
// backends feed it, equals HF's layer written out above.
TEST(Gemma3Layer, ForwardIsHfsDecoderLayer) {
  const ModelConfig c = AwkwardGemma3Config(false);
  const ModelLayout layout = ModelLayout::Build(c);
  const MicroBatch mb = MakeBatch({6, 1, 9, 4}, c.vocab_size, 5);
  const RopeTables rope = BuildRopeTables(mb.positions, c);
  ASSERT_FALSE(rope.sliding_cos.empty());
  EXPECT_NE(rope.cos, rope.sliding_cos);
  const TokenGeometry geom = MakeTokenGeometry(mb, rope);
  const DecoderDims dims = DecoderDims::From(c);
  const std::vector<std::vector<double>> params = RandomUnitParams(layout, 9);
  const int64_t n = mb.num_tokens() * c.hidden_size;
  const std::vector<double> x = RandomNormals<double>(n, 3);
  for (int unit : {1, 3}) {
    const UnitLayout& u = layout.units[unit];
    std::vector<double> shifted = params[unit];
    AddNormWeightOffsets(c, u, shifted.data());
    std::vector<double> y(n);
    DecoderActs<double> acts;
    DecoderForwardAll(dims, DecoderOffsets::Of(u), shifted.data(), geom, x.data(), y.data(), &acts, nullptr);
    const std::vector<double> want = HfGemma3Layer(c, u, params[unit], mb, rope, x);
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(y[i] - want[i]) / (1 + std::fabs(want[i])));
    EXPECT_LT(worst, 1e-12) << u.name;
  }
}

// The head with final_logit_softcapping against the capped logits and cross entropy written out;
// chunking changes nothing.
TEST(Gemma3Head, SoftCappedLogitsAndTheirGradients) {
  const ModelConfig c = AwkwardGemma3Config(false, 1.5);
  const DecoderDims dims = DecoderDims::From(c);
  const int64_t H = dims.hidden, V = dims.vocab;
  const MicroBatch mb = MakeBatch({6, 1, 8, 4}, V, 21, 3);
  const int64_t T = mb.num_tokens();
  std::vector<double> x = RandomNormals<double>(T * H, 4), norm(H), lm = RandomNormals<double>(V * H, 5);
  for (double& v : x) v *= 2;
  for (int64_t i = 0; i < H; ++i) norm[i] = 1.0 + 0.1 * std::sin(static_cast<double>(i));
  const double cap = c.final_logit_softcapping, scale = 0.3;
  double loss_ref = 0;
  std::vector<double> dx_ref(T * H, 0.0), dlm_ref(V * H, 0.0), dnorm_ref(H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (mb.labels[t] == kIgnoreIndex) continue;
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += x[t * H + i] * x[t * H + i];
    const double rs = 1.0 / std::sqrt(ss / H + dims.rms_norm_eps);
    std::vector<double> xf(H), logit(V), tanh_v(V), dxf(H, 0.0);
    for (int64_t i = 0; i < H; ++i) xf[i] = x[t * H + i] * rs * norm[i];
    double mx = -1e300, se = 0;
    for (int64_t v = 0; v < V; ++v) {
      double raw = 0;
      for (int64_t i = 0; i < H; ++i) raw += xf[i] * lm[v * H + i];
      tanh_v[v] = std::tanh(raw / cap);
      logit[v] = tanh_v[v] * cap;
      mx = std::max(mx, logit[v]);
    }
    for (int64_t v = 0; v < V; ++v) se += std::exp(logit[v] - mx);
    const double lse = mx + std::log(se);
    loss_ref += scale * (lse - logit[mb.labels[t]]);
    for (int64_t v = 0; v < V; ++v) {
      const double dl =
          scale * (std::exp(logit[v] - lse) - (v == mb.labels[t] ? 1.0 : 0.0)) * (1 - tanh_v[v] * tanh_v[v]);
      for (int64_t i = 0; i < H; ++i) {
        dxf[i] += dl * lm[v * H + i];
        dlm_ref[v * H + i] += dl * xf[i];
      }
    }
    double dot = 0;
    for (int64_t i = 0; i < H; ++i) dot += dxf[i] * norm[i] * x[t * H + i];
    for (int64_t i = 0; i < H; ++i) {
      dx_ref[t * H + i] = rs * norm[i] * dxf[i] - x[t * H + i] * rs * rs * rs * dot / H;
      dnorm_ref[i] += dxf[i] * x[t * H + i] * rs;
    }
  }
  for (HeadChunking chunking : {HeadChunking{3, 5}, HeadChunking{64, 4096}}) {
    std::vector<double> dx(T * H), dnorm(H, 0.0), dlm(V * H, 0.0);
    const double loss = HeadLossAndGrad<double, double>(dims, norm.data(), lm.data(), mb.labels.data(), T, x.data(),
                                                        scale, dx.data(), dnorm.data(), dlm.data(), chunking, nullptr);
    EXPECT_NEAR(loss, loss_ref, 1e-12 * loss_ref);
    EXPECT_LT(testing::RelativeL2(dx, dx_ref), 1e-12);
    EXPECT_LT(testing::RelativeL2(dnorm, dnorm_ref), 1e-12);
    EXPECT_LT(testing::RelativeL2(dlm, dlm_ref), 1e-12);
    // Evaluation gives the same loss.
    const double eval = HeadLossAndGrad<double, double>(dims, norm.data(), lm.data(), mb.labels.data(), T, x.data(),
                                                        scale, nullptr, nullptr, nullptr, chunking, nullptr);
    EXPECT_EQ(eval, loss);
  }
}

// Gemma3TextScaledWordEmbedding: each row times the scale; its gradient too.
TEST(Gemma3Embedding, RowsAndGradientsScaled) {
  const ModelConfig c = AwkwardGemma3Config(true);
  const double scale = c.EmbeddingScale();
  EXPECT_EQ(scale, 6.9375);  // sqrt(48) = 6.928 in bfloat16
  const int64_t V = c.vocab_size, H = c.hidden_size;
  const std::vector<float> table = RandomNormals<float>(V * H, 2);
  const std::vector<int32_t> tokens = {3, 0, 36, 3};
  std::vector<float> out(tokens.size() * H);
  EmbeddingLookup(table.data(), tokens.data(), 4, H, out.data(), nullptr, scale);
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t i = 0; i < H; ++i) EXPECT_EQ(out[t * H + i], table[tokens[t] * H + i] * 6.9375f);
  std::vector<float> dout = RandomNormals<float>(4 * H, 3), dembed(V * H, 0.0f);
  EmbeddingScatterAdd(dout.data(), tokens.data(), 4, H, dembed.data(), scale);
  for (int64_t i = 0; i < H; ++i) {
    EXPECT_EQ(dembed[3 * H + i], dout[i] * 6.9375f + dout[3 * H + i] * 6.9375f);
    EXPECT_EQ(dembed[36 * H + i], dout[2 * H + i] * 6.9375f);
  }
}

// The backend on gemma3's layers: every activation policy recomputes the layer (nothing kept),
// tiles give the untiled outputs bit for bit.
TEST(Gemma3Backend, TiledEqualsUntiledAndNothingIsKept) {
  const ModelConfig c = AwkwardGemma3Config(true);
  const ModelLayout layout = ModelLayout::Build(c);
  const std::vector<std::vector<bf16_t>> params = testing::ToBf16(RandomUnitParams(layout, 4));
  const MicroBatch mb = MakeBatch({7, 1, 10, 5}, c.vocab_size, 8);
  const int64_t n = mb.num_tokens() * c.hidden_size;
  const std::vector<float> x = RandomNormals<float>(n, 1), dy = RandomNormals<float>(n, 2);
  struct Run {
    std::vector<float> y, dx, dparams;
    int64_t saved_bytes;
  };
  auto run = [&](int64_t tile, ActPolicy policy, int unit) {
    auto be = MakeCpuBackend(c);
    EXPECT_TRUE(be.ok()) << be.status();
    (*be)->SetTileTokens(tile);
    auto batch = (*be)->UploadBatch(mb);
    EXPECT_TRUE(batch.ok()) << batch.status();
    const UnitParams p = UnitParams(params[unit].data()).OfLayer(layout.units[unit].decoder_layer);
    Run r{std::vector<float>(n), std::vector<float>(n), std::vector<float>(params[unit].size(), 0.0f), 0};
    std::unique_ptr<SavedActivations> saved;
    EXPECT_TRUE((*be)->DecoderForward(p, **batch, x.data(), r.y.data(), policy, &saved).ok());
    r.saved_bytes = saved->bytes();
    EXPECT_TRUE(
        (*be)->DecoderBackward(p, **batch, x.data(), saved.get(), dy.data(), r.dx.data(), r.dparams.data()).ok());
    return r;
  };
  for (int unit : {1, 3}) {
    const Run ref = run(1 << 20, ActPolicy::kKeepAll, unit);
    EXPECT_EQ(ref.saved_bytes, 0) << "gemma3 layers keep nothing";
    for (int64_t tile : {1, 5, 22}) {
      for (ActPolicy policy : {ActPolicy::kRecomputeLayer, ActPolicy::kSelective}) {
        const Run r = run(tile, policy, unit);
        const std::string what = absl::StrCat("unit ", unit, " tile ", tile);
        EXPECT_EQ(r.y, ref.y) << what;
        EXPECT_EQ(r.dx, ref.dx) << what;
        double worst = 0, largest = 0;
        for (size_t i = 0; i < r.dparams.size(); ++i) {
          worst = std::max(worst, static_cast<double>(std::fabs(r.dparams[i] - ref.dparams[i])));
          largest = std::max(largest, static_cast<double>(std::fabs(ref.dparams[i])));
        }
        EXPECT_LT(worst, 2e-6 * largest) << what;
      }
    }
  }
}

}  // namespace
}  // namespace slidedp
