// Finite-difference checks of the reference math in double: the analytic gradients of a whole
// small model (embedding -> 2 decoder layers -> head, two packed micro-batches) against central
// differences of the scalar loss, every family (gemma3 and gpt_oss included), sliding windows included, plus
// per-op convention checks (RoPE pairing, head chunking).
#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::AwkwardConfig;
using testing::AwkwardConfigOf;
using testing::AwkwardSlidingConfig;
using testing::MakeBatch;
using testing::RandomUnitParams;

// Central difference step and tolerance: in double the truncation error (~h^2) and rounding
// error (~1e-16/h) are both below 1e-9 relative to the O(1e-3..1) gradients checked here, while
// a wrong or missing backward term (e.g. RoPE's) gives O(1) relative errors.
constexpr double kStep = 1e-5;
constexpr double kRelTol = 1e-5;

struct GradCheckCase {
  std::string name;
  ModelConfig config;
  double router_aux_weight = 0;  // MoE: the load-balancing loss's weight
};

void PrintTo(const GradCheckCase& c, std::ostream* os) { *os << c.name; }

class ModelGradCheck : public ::testing::TestWithParam<GradCheckCase> {};

TEST_P(ModelGradCheck, AnalyticGradientsMatchCentralDifferences) {
  const ModelConfig config = GetParam().config;
  const ModelLayout layout = ModelLayout::Build(config);
  std::vector<std::vector<double>> params = RandomUnitParams(layout, 7);
  // Odd lengths, a one-token document, several documents per row, two micro-batches.
  const std::vector<MicroBatch> batches = {MakeBatch({5, 1, 9, 6}, config.vocab_size, 11),
                                           MakeBatch({7, 4}, config.vocab_size, 12)};
  int64_t trained = 0;
  for (const auto& b : batches) trained += b.num_trained();
  ASSERT_GT(trained, 10);
  const double scale = 1.0 / static_cast<double>(trained);

  std::vector<std::vector<double>> grads;
  const double aux = GetParam().router_aux_weight;
  const double loss = ModelLossAndGrads<double>(layout, params, batches, scale, &grads, nullptr, aux);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_GT(loss, 0.5);

  auto loss_at = [&](int unit, int64_t index, double value) {
    const double saved = params[unit][index];
    params[unit][index] = value;
    std::vector<std::vector<double>> unused;
    const double l = ModelLossAndGrads<double>(layout, params, batches, scale, &unused, nullptr, aux);
    params[unit][index] = saved;
    return l;
  };

  std::mt19937_64 rng(3);
  int checked = 0, significant = 0;
  double worst = 0;
  for (const UnitLayout& unit : layout.units) {
    for (const TensorSlot& t : unit.tensors) {
      std::uniform_int_distribution<int64_t> pick(0, t.numel - 1);
      std::vector<int64_t> indices;
      for (int i = 0; i < 4; ++i) indices.push_back(pick(rng));
      if (unit.kind == UnitKind::kEmbedding) {  // rows of tokens that occur get the input gradient
        for (int i = 0; i < 4; ++i) {
          const int32_t tok = batches[0].tokens[i * 3];
          indices.push_back(tok * config.hidden_size + pick(rng) % config.hidden_size);
        }
      }
      double tensor_max = 0;
      for (int64_t i = 0; i < t.numel; ++i) tensor_max = std::max(tensor_max, std::abs(grads[unit.index][t.offset_numel + i]));
      ASSERT_GT(tensor_max, 0) << t.hf_name << " has an all-zero gradient";
      for (int64_t i : indices) {
        const int64_t at = t.offset_numel + i;
        const double p = params[unit.index][at];
        const double fd = (loss_at(unit.index, at, p + kStep) - loss_at(unit.index, at, p - kStep)) / (2 * kStep);
        const double an = grads[unit.index][at];
        // Relative to the entry, floored at 1e-3 of the tensor's largest gradient.
        const double denom = std::max({std::abs(an), std::abs(fd), 1e-3 * tensor_max});
        const double rel = std::abs(fd - an) / denom;
        worst = std::max(worst, rel);
        EXPECT_LT(rel, kRelTol) << t.hf_name << "[" << i << "]: analytic " << an << " vs finite difference " << fd;
        ++checked;
        if (std::abs(an) > 1e-2 * tensor_max) ++significant;
      }
    }
  }
  // The sample must mostly consist of entries with real gradients, or the check proves little.
  EXPECT_GT(significant, checked * 2 / 3);
  RecordProperty("worst_relative_error", std::to_string(worst));
  std::printf("%s: %d entries checked (%d significant), worst relative error %.3g\n", GetParam().name.c_str(),
              checked, significant, worst);
}

// The awkward shape of `family` (2 layers) sliding both layers over `window` keys.
ModelConfig SlidingConfig(ModelFamily family, int64_t window) {
  return AwkwardSlidingConfig(family, window, {AttentionSpan::kSliding, AttentionSpan::kSliding});
}

// qwen2, tied: layer 0 sliding over 2 keys, layer 1 full.
ModelConfig MixedWindowConfig() {
  return AwkwardSlidingConfig(ModelFamily::kQwen2, 2, {AttentionSpan::kSliding, AttentionSpan::kFull}, true);
}

// qwen3_5 at CI size: Gated DeltaNet and gated attention layers, (1 + w) norms, partial RoPE; the
// MoE with its shared expert. Smaller than the presets so that the central differences stay quick.
ModelConfig SmallQwen3_5(const char* preset, bool tied) {
  ModelConfig c = *ModelConfig::Preset(preset);
  c.hidden_size = 32;
  c.vocab_size = 96;
  c.intermediate_size = 48;
  c.head_dim = 16;  // rotary 4 of 16
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.linear = LinearAttentionConfig{1, 2, 8, 6, 4};  // two value heads share one key head
  c.num_hidden_layers = 3;
  c.layer_mixers = {TokenMixer::kLinearAttention, TokenMixer::kAttention, TokenMixer::kLinearAttention};
  c.tie_word_embeddings = tied;
  if (c.is_moe()) {
    c.num_experts = 4;
    c.moe_intermediate_size = 16;
    c.shared_expert_intermediate_size = 24;
  }
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ModelGradCheck,
    ::testing::Values(GradCheckCase{"awkward_untied", AwkwardConfig(false)},
                      GradCheckCase{"awkward_tied", AwkwardConfig(true)}, GradCheckCase{"tiny", testing::TinyConfig()},
                      GradCheckCase{"qwen2_tied", AwkwardConfigOf(ModelFamily::kQwen2, true)},
                      GradCheckCase{"llama3_untied", AwkwardConfigOf(ModelFamily::kLlama, false)},
                      GradCheckCase{"mistral_untied", AwkwardConfigOf(ModelFamily::kMistral, false)},
                      // Sliding windows over documents of 1 to 9 tokens: 3 in
                      // every layer; 2 beside a full layer; one the row's length.
                      GradCheckCase{"mistral_window3", SlidingConfig(ModelFamily::kMistral, 3)},
                      GradCheckCase{"qwen2_window2_then_full", MixedWindowConfig()},
                      GradCheckCase{"mistral_window_row", SlidingConfig(ModelFamily::kMistral, 64)},
                      GradCheckCase{"yarn_tied", testing::AwkwardYarnConfig(true)},
                      // The router through the routing weights, and with the
                      // aux loss's weight large enough that its gradient counts.
                      GradCheckCase{"moe_untied", testing::AwkwardMoeConfig(false, true)},
                      GradCheckCase{"moe_aux_tied", testing::AwkwardMoeConfig(true, true), 0.5},
                      GradCheckCase{"moe_topk_unnormalised_aux", testing::AwkwardMoeConfig(false, false), 0.5},
                      GradCheckCase{"qwen3_5_tied", SmallQwen3_5("tiny-qwen3.5", true)},
                      GradCheckCase{"qwen3_5_untied", SmallQwen3_5("tiny-qwen3.5", false)},
                      GradCheckCase{"qwen3_5_moe_aux", SmallQwen3_5("tiny-qwen3.5-moe", false), 0.5},
                      // gemma3: sandwich norms, GeGLU, scaled embedding, two
                      // RoPEs, window 3 beside a full layer, capped logits.
                      GradCheckCase{"gemma3_tied_softcap", testing::AwkwardGemma3Config(true)},
                      GradCheckCase{"gemma3_untied", testing::AwkwardGemma3Config(false, 0)},
                      // gpt_oss: sinks, q/k/v/o biases, window 3 beside a full layer,
                      // YaRN, the biased router and experts (with the aux loss).
                      GradCheckCase{"gpt_oss_untied", testing::AwkwardGptOssConfig(false)},
                      GradCheckCase{"gpt_oss_aux_tied", testing::AwkwardGptOssConfig(true), 0.5}),
    [](const auto& info) { return info.param.name; });

// dL/dx of one decoder layer for L = sum(c * y), against central differences on x.
TEST(DecoderLayerGradCheck, InputGradientMatchesCentralDifferences) {
  const ModelConfig config = AwkwardConfig(false);
  const ModelLayout layout = ModelLayout::Build(config);
  const DecoderDims dims = DecoderDims::From(config);
  const DecoderOffsets offs = DecoderOffsets::From(config);
  const std::vector<double> params = RandomUnitParams(layout, 5)[1];
  const MicroBatch mb = MakeBatch({3, 8, 1, 6}, config.vocab_size, 9);
  const RopeTables rope = BuildRopeTables(mb.positions, dims.head_dim, dims.rope_theta);
  const TokenGeometry geom = MakeTokenGeometry(mb, rope);
  const int64_t n = mb.num_tokens() * dims.hidden;
  std::mt19937_64 rng(1);
  std::normal_distribution<double> normal;
  std::vector<double> x(n), c(n);
  for (auto& v : x) v = normal(rng);
  for (auto& v : c) v = normal(rng);

  auto objective = [&](const std::vector<double>& in) {
    std::vector<double> y(n);
    DecoderActs<double> acts;
    DecoderForwardAll(dims, offs, params.data(), geom, in.data(), y.data(), &acts, nullptr);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += c[i] * y[i];
    return s;
  };
  std::vector<double> y(n), dx(n), dparams(params.size(), 0.0);
  DecoderActs<double> acts;
  DecoderForwardAll(dims, offs, params.data(), geom, x.data(), y.data(), &acts, nullptr);
  DecoderBackward(dims, offs, params.data(), geom, x.data(), acts, c.data(), dx.data(), dparams.data(), nullptr);
  double max_dx = 0;
  for (double v : dx) max_dx = std::max(max_dx, std::abs(v));
  for (int64_t i = 0; i < n; i += 7) {
    std::vector<double> xp = x, xm = x;
    xp[i] += kStep;
    xm[i] -= kStep;
    const double fd = (objective(xp) - objective(xm)) / (2 * kStep);
    const double denom = std::max({std::abs(dx[i]), std::abs(fd), 1e-3 * max_dx});
    EXPECT_LT(std::abs(fd - dx[i]) / denom, kRelTol) << "x[" << i << "]: " << dx[i] << " vs " << fd;
  }
}

// RoPE pairs element i with i + head_dim/2 (HF rotate_half) at angle pos * theta^(-2i/d).
TEST(RopeConvention, RotatesHalfPairsByPositionTimesInverseFrequency) {
  const int64_t head_dim = 8, half = 4;
  const double theta = 10000.0;
  MicroBatch mb;
  mb.tokens = {0, 0};
  mb.positions = {0, 5};
  mb.cu_seqlens = {0, 2};
  const RopeTables rope = BuildRopeTables(mb.positions, head_dim, theta);
  const TokenGeometry geom = MakeTokenGeometry(mb, rope);
  for (int64_t i = 0; i < half; ++i) {
    std::vector<double> x(2 * head_dim, 0.0);
    x[i] = 1.0;                        // token 0 (position 0): unchanged
    x[head_dim + i] = 1.0;             // token 1 (position 5): e_i -> cos e_i + sin e_{i+half}
    x[head_dim + i + half] = 0.0;
    ApplyRope(x.data(), 2, 1, head_dim, geom, RopeDirection::kForward, nullptr);
    const double angle = 5.0 * std::pow(theta, -2.0 * static_cast<double>(i) / head_dim);
    EXPECT_DOUBLE_EQ(x[i], 1.0);
    EXPECT_NEAR(x[head_dim + i], std::cos(angle), 1e-6);
    EXPECT_NEAR(x[head_dim + i + half], std::sin(angle), 1e-6);
    for (int64_t j = 0; j < head_dim; ++j) {
      if (j != i && j != i + half) {
        EXPECT_EQ(x[head_dim + j], 0.0);
      }
    }
    ApplyRope(x.data(), 2, 1, head_dim, geom, RopeDirection::kBackward, nullptr);
    EXPECT_NEAR(x[head_dim + i], 1.0, 1e-6);  // float tables: cos^2 + sin^2 != 1 exactly
    EXPECT_NEAR(x[head_dim + i + half], 0.0, 1e-6);
  }
}

// HF's attention_scaling (yarn) multiplies cos and sin: the tables are the plain ones times the
// factor in FP32, 1 leaves them bit-identical, and backward after forward scales by its square.
TEST(RopeConvention, AttentionScalingMultipliesCosAndSin) {
  const std::vector<int32_t> positions = {0, 3, 17, 40};
  ModelConfig c = testing::AwkwardYarnConfig(false);
  const std::vector<float> inv = c.RopeInverseFrequencies();
  const float s = static_cast<float>(c.RopeAttentionScaling());
  EXPECT_FLOAT_EQ(s, static_cast<float>(0.1 * std::log(4.0) + 1.0));
  const RopeTables plain = BuildRopeTables(positions, inv, 1.0f), scaled = BuildRopeTables(positions, c);
  ASSERT_EQ(plain.cos.size(), scaled.cos.size());
  for (size_t i = 0; i < plain.cos.size(); ++i) {
    EXPECT_EQ(scaled.cos[i], plain.cos[i] * s) << i;
    EXPECT_EQ(scaled.sin[i], plain.sin[i] * s) << i;
  }
  ModelConfig unscaled = c;
  unscaled.rope_scaling.attention_factor = 1;
  const RopeTables one = BuildRopeTables(positions, unscaled);
  EXPECT_EQ(one.cos, plain.cos);
  EXPECT_EQ(one.sin, plain.sin);

  MicroBatch mb;
  mb.tokens = {0, 0, 0, 0};
  mb.positions = positions;
  mb.cu_seqlens = {0, 4};
  const TokenGeometry geom = MakeTokenGeometry(mb, scaled);
  std::mt19937_64 rng(2);
  std::normal_distribution<double> normal;
  std::vector<double> x(4 * 2 * c.head_dim);
  for (double& v : x) v = normal(rng);
  std::vector<double> y = x;
  ApplyRope(y.data(), 4, 2, c.head_dim, geom, RopeDirection::kForward, nullptr);
  ApplyRope(y.data(), 4, 2, c.head_dim, geom, RopeDirection::kBackward, nullptr);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i] * s * s, 1e-5) << i;
}

// The chunked head against a direct computation over the full [T, vocab] logits.
TEST(HeadChunking, ChunkedEqualsDirectAndIgnoredTokensContributeNothing) {
  const ModelConfig config = AwkwardConfig(false);
  const DecoderDims dims = DecoderDims::From(config);
  const int64_t H = dims.hidden, V = dims.vocab;
  const MicroBatch mb = MakeBatch({6, 1, 8, 4}, V, 21, /*ignore_every=*/3);
  const int64_t T = mb.num_tokens();
  std::mt19937_64 rng(2);
  std::normal_distribution<double> normal;
  std::vector<double> x(T * H), norm_w(H), lm(V * H);
  for (auto& v : x) v = 2.0 * normal(rng);
  for (auto& v : norm_w) v = 1.0 + 0.3 * normal(rng);
  for (auto& v : lm) v = normal(rng) / std::sqrt(static_cast<double>(H));
  const double scale = 0.37;

  // Direct: full logits, softmax, CE, gradients.
  double loss_ref = 0;
  std::vector<double> dx_ref(T * H, 0.0), dnorm_ref(H, 0.0), dlm_ref(V * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    if (mb.labels[t] == kIgnoreIndex) continue;
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += x[t * H + i] * x[t * H + i];
    const double rs = 1.0 / std::sqrt(ss / H + dims.rms_norm_eps);
    std::vector<double> xf(H), logit(V), dxf(H, 0.0);
    for (int64_t i = 0; i < H; ++i) xf[i] = x[t * H + i] * rs * norm_w[i];
    double mx = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      logit[v] = 0;
      for (int64_t i = 0; i < H; ++i) logit[v] += xf[i] * lm[v * H + i];
      mx = std::max(mx, logit[v]);
    }
    double se = 0;
    for (int64_t v = 0; v < V; ++v) se += std::exp(logit[v] - mx);
    const double lse = mx + std::log(se);
    loss_ref += scale * (lse - logit[mb.labels[t]]);
    for (int64_t v = 0; v < V; ++v) {
      const double dl = scale * (std::exp(logit[v] - lse) - (v == mb.labels[t] ? 1.0 : 0.0));
      for (int64_t i = 0; i < H; ++i) {
        dxf[i] += dl * lm[v * H + i];
        dlm_ref[v * H + i] += dl * xf[i];
      }
    }
    double dot = 0;
    for (int64_t i = 0; i < H; ++i) dot += dxf[i] * norm_w[i] * x[t * H + i];
    for (int64_t i = 0; i < H; ++i) {
      dx_ref[t * H + i] = rs * norm_w[i] * dxf[i] - x[t * H + i] * rs * rs * rs * dot / H;
      dnorm_ref[i] += dxf[i] * x[t * H + i] * rs;
    }
  }

  for (HeadChunking chunking : {HeadChunking{3, 5}, HeadChunking{1, 37}, HeadChunking{64, 4096}, HeadChunking{4, 36}}) {
    std::vector<double> dx(T * H, 123.0), dnorm(H, 0.0), dlm(V * H, 0.0);
    const double loss = HeadLossAndGrad<double, double>(dims, norm_w.data(), lm.data(), mb.labels.data(), T, x.data(),
                                                        scale, dx.data(), dnorm.data(), dlm.data(), chunking, nullptr);
    SCOPED_TRACE(::testing::Message() << "chunks " << chunking.token_chunk << "x" << chunking.vocab_chunk);
    EXPECT_NEAR(loss, loss_ref, 1e-12 * std::abs(loss_ref));
    EXPECT_LT(testing::RelativeL2(dx, dx_ref), 1e-12);
    EXPECT_LT(testing::RelativeL2(dnorm, dnorm_ref), 1e-12);
    EXPECT_LT(testing::RelativeL2(dlm, dlm_ref), 1e-12);
    for (int64_t t = 0; t < T; ++t) {
      if (mb.labels[t] != kIgnoreIndex) continue;
      for (int64_t i = 0; i < H; ++i) ASSERT_EQ(dx[t * H + i], 0.0) << "ignored token " << t << " got a gradient";
    }
  }
}

}  // namespace
}  // namespace slidedp
