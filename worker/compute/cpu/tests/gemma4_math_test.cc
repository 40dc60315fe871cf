// gemma4's reference math against transformers' modeling_gemma4.py (5.17) written out here op by op,
// in double: proportional RoPE's frequencies; every kind of decoder layer (sliding with its own keys,
// full with attention_k_eq_v and wider heads, both kinds reading a source layer's keys and values,
// layer 0 computing the per-layer inputs); the whole model's loss with its per-layer inputs and kv
// sharing; the analytic gradients of the whole model against central differences; the multimodal
// placeholders' embedding. And the CPU backend (FP32, BF16 weights) on the whole model, step by step
// as the pipeline drives it, against the double math.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu/cpu_backend.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/gemma4_math.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::AwkwardConfig;
using testing::MakeBatch;
using testing::RandomNormals;
using testing::RandomUnitParams;
using testing::RefGeluTanh;
using testing::RefLinear;

// The awkward shape as gemma4, every feature on: five layers sliding (window 3), full, sliding,
// sliding, full; the full layers with head_dim 12 (sliding 8) and 3 kv heads (sliding 2) whose values
// are their keys' projection; the last two layers reading layers 2's and 1's keys and values, their
// MLPs twice as wide; per-layer inputs of 5 from a table of 41 rows (more than the vocabulary's 37);
// proportional RoPE on the full layers rotating half of the pairs, divided by 2; logits capped at 2.
ModelConfig AwkwardGemma4Config(bool tied) {
  ModelConfig c = AwkwardConfig(tied);
  c.family = ModelFamily::kGemma4;
  c.num_hidden_layers = 5;
  c.sliding_window = 3;
  c.layer_spans = {AttentionSpan::kSliding, AttentionSpan::kFull, AttentionSpan::kSliding, AttentionSpan::kSliding,
                   AttentionSpan::kFull};
  c.gemma4.full_head_dim = 12;
  c.gemma4.full_kv_heads = 3;
  c.gemma4.k_eq_v = true;
  c.gemma4.kv_shared_layers = 2;
  c.gemma4.double_wide_mlp = true;
  c.gemma4.ple_dim = 5;
  c.gemma4.ple_vocab = 41;
  c.rope_theta = 1e6;
  c.sliding_rope_theta = 1e4;
  c.gemma4.full_rope = Gemma4Rope{true, 0.5, 2};
  c.final_logit_softcapping = 2;
  c.pad_token_id = 0;
  c.torch_dtype = "float32";
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  return c;
}

// Random parameters, as RandomUnitParams; layer_scalar away from 1 so that it matters.
std::vector<std::vector<double>> Params(const ModelLayout& layout, uint64_t seed) {
  std::vector<std::vector<double>> p = RandomUnitParams(layout, seed);
  for (const UnitLayout& u : layout.units) {
    if (const TensorSlot* s = u.Find(kLayerScalar)) p[u.index][s->offset_numel] = 0.6 + 0.1 * u.index;
  }
  return p;
}

// ---- transformers' Gemma 4, written out ----

// Gemma4RMSNorm over rows of n: x * pow(mean(x^2) + eps, -0.5) * w (w null: with_scale=False).
std::vector<double> Norm(const double* x, const double* w, int64_t rows, int64_t n, double eps) {
  std::vector<double> y(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += x[r * n + i] * x[r * n + i];
    const double rs = std::pow(ss / static_cast<double>(n) + eps, -0.5);
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * rs * (w != nullptr ? w[i] : 1.0);
  }
  return y;
}

// Gemma4TextRotaryEmbedding's inverse frequencies for one layer type, in float32 as torch computes
// them: compute_default_rope_parameters (every pair of head_dim) or _compute_proportional_rope_
// parameters (rope_angles = int(partial_rotary_factor * head_dim // 2) pairs, zeros after, / factor).
std::vector<float> HfInverseFrequencies(int64_t head_dim, double theta, const Gemma4Rope& r) {
  const int64_t angles = r.proportional ? static_cast<int64_t>(std::floor(r.fraction * head_dim / 2.0)) : head_dim / 2;
  std::vector<float> inv(head_dim / 2, 0.0f);
  for (int64_t i = 0; i < angles; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(theta), e);
  }
  if (r.proportional) {
    for (float& f : inv) f /= static_cast<float>(r.factor);
  }
  return inv;
}

// cos and sin [T, head_dim / 2] (emb = cat(freqs, freqs): the same for both halves).
struct HfRope {
  std::vector<double> cos, sin;
  int64_t half = 0;
};
HfRope HfRopeOf(const std::vector<int32_t>& positions, const std::vector<float>& inv) {
  HfRope r;
  r.half = static_cast<int64_t>(inv.size());
  for (int32_t p : positions) {
    for (float f : inv) {
      const float angle = static_cast<float>(p) * f;
      r.cos.push_back(std::cos(angle));
      r.sin.push_back(std::sin(angle));
    }
  }
  return r;
}

// apply_rotary_pos_emb: x * cos + rotate_half(x) * sin over [T, heads, head_dim].
void Rotate(std::vector<double>& v, int64_t T, int64_t heads, const HfRope& rope) {
  const int64_t half = rope.half, hd = 2 * half;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      double* p = v.data() + (t * heads + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const double a = p[i], b = p[i + half], c = rope.cos[t * half + i], s = rope.sin[t * half + i];
        p[i] = a * c - b * s;
        p[i + half] = b * c + a * s;
      }
    }
}

struct HfKv {
  std::vector<double> k, v;
};

// One Gemma4TextDecoderLayer (eager attention, scaling 1.0, its mask: j in i's document, j <= i and
// in a sliding layer i - j < window), given its per-layer input ple [T, P] (null: none) and, for a
// kv-shared layer, the source layer's keys and values; *kv_out receives its own keys and values.
std::vector<double> HfLayer(const ModelConfig& c, const UnitLayout& u, const std::vector<double>& p,
                            const MicroBatch& mb, const HfRope& rope, const std::vector<double>& x, const double* ple,
                            const HfKv* shared, HfKv* kv_out) {
  const int64_t l = u.decoder_layer, T = mb.num_tokens(), H = c.hidden_size, nh = c.num_attention_heads;
  const int64_t hd = c.LayerHeadDim(l), nkv = c.LayerKvHeads(l), I = c.LayerIntermediate(l), P = c.gemma4.ple_dim;
  const double eps = c.rms_norm_eps;
  const bool sliding = c.IsSlidingLayer(l);
  auto w = [&](DecoderTensor t) { return u.Find(t) != nullptr ? p.data() + u.Find(t)->offset_numel : nullptr; };
  const std::vector<double> xn = Norm(x.data(), w(kInputNorm), T, H, eps);
  std::vector<double> q = Norm(RefLinear(xn, w(kQProj), T, H, nh * hd).data(), w(kQNorm), T * nh, hd, eps);
  Rotate(q, T, nh, rope);
  HfKv kv;
  if (shared != nullptr) {
    kv = *shared;
  } else {
    const std::vector<double> k_proj = RefLinear(xn, w(kKProj), T, H, nkv * hd);
    // value_states = v_proj(...) if v_proj is not None else key_states (before k_norm)
    const std::vector<double> v_proj = w(kVProj) != nullptr ? RefLinear(xn, w(kVProj), T, H, nkv * hd) : k_proj;
    kv.k = Norm(k_proj.data(), w(kKNorm), T * nkv, hd, eps);
    Rotate(kv.k, T, nkv, rope);
    kv.v = Norm(v_proj.data(), nullptr, T * nkv, hd, eps);
  }
  if (kv_out != nullptr) *kv_out = kv;
  std::vector<int64_t> doc(T);
  for (size_t d = 0; d + 1 < mb.cu_seqlens.size(); ++d)
    for (int32_t t = mb.cu_seqlens[d]; t < mb.cu_seqlens[d + 1]; ++t) doc[t] = static_cast<int64_t>(d);
  std::vector<double> attn(T * nh * hd, 0.0);
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t g = h / (nh / nkv);
    for (int64_t i = 0; i < T; ++i) {
      std::vector<double> s(T, -std::numeric_limits<double>::infinity());
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (int64_t j = 0; j < T; ++j) {
        if (doc[j] != doc[i] || j > i || (sliding && i - j >= c.sliding_window)) continue;
        double dot = 0;
        for (int64_t e = 0; e < hd; ++e) dot += q[(i * nh + h) * hd + e] * kv.k[(j * nkv + g) * hd + e];
        s[j] = dot;
        mx = std::max(mx, s[j]);
      }
      for (int64_t j = 0; j < T; ++j) sum += std::exp(s[j] - mx);
      for (int64_t j = 0; j < T; ++j)
        for (int64_t e = 0; e < hd; ++e)
          attn[(i * nh + h) * hd + e] += std::exp(s[j] - mx) / sum * kv.v[(j * nkv + g) * hd + e];
    }
  }
  std::vector<double> h = Norm(RefLinear(attn, w(kOProj), T, nh * hd, H).data(), w(kPostNorm), T, H, eps);
  for (int64_t i = 0; i < T * H; ++i) h[i] += x[i];
  const std::vector<double> m = Norm(h.data(), w(kPreFfnNorm), T, H, eps);
  const std::vector<double> gate = RefLinear(m, w(kGateProj), T, H, I), up = RefLinear(m, w(kUpProj), T, H, I);
  std::vector<double> act(T * I);
  for (int64_t i = 0; i < T * I; ++i) act[i] = RefGeluTanh(gate[i]) * up[i];
  const std::vector<double> f = Norm(RefLinear(act, w(kDownProj), T, I, H).data(), w(kPostFfnNorm), T, H, eps);
  for (int64_t i = 0; i < T * H; ++i) h[i] += f[i];
  if (P > 0) {
    std::vector<double> g = RefLinear(h, w(kPleGate), T, H, P);
    for (int64_t i = 0; i < T * P; ++i) g[i] = RefGeluTanh(g[i]) * ple[i];
    const std::vector<double> r = Norm(RefLinear(g, w(kPleProj), T, P, H).data(), w(kPlePostNorm), T, H, eps);
    for (int64_t i = 0; i < T * H; ++i) h[i] += r[i];
  }
  for (double& v : h) v *= w(kLayerScalar)[0];
  return h;
}

// Gemma4TextModel.get_per_layer_inputs + project_per_layer_inputs: [T, L x P] from x0 (the scaled
// embedding) and the ids.
std::vector<double> HfPerLayerInputs(const ModelConfig& c, const ModelLayout& layout,
                                     const std::vector<std::vector<double>>& p, const MicroBatch& mb,
                                     const std::vector<double>& x0) {
  const int64_t T = mb.num_tokens(), H = c.hidden_size, L = c.num_hidden_layers, P = c.gemma4.ple_dim;
  const UnitLayout& l0 = layout.units[1];
  const double* table = p[0].data() + layout.embedding().tensors[1].offset_numel;
  std::vector<double> proj = RefLinear(x0, p[1].data() + l0.Find(kPleModelProj)->offset_numel, T, H, L * P);
  for (double& v : proj) v *= std::pow(static_cast<double>(H), -0.5);
  std::vector<double> ple = Norm(proj.data(), p[1].data() + l0.Find(kPleModelNorm)->offset_numel, T * L, P,
                                 c.rms_norm_eps);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < L * P; ++i) {
      const double token = table[mb.tokens[t] * L * P + i] * c.PerLayerEmbeddingScale();
      ple[t * L * P + i] = (ple[t * L * P + i] + token) * std::pow(2.0, -0.5);
    }
  return ple;
}

// Gemma4ForCausalLM's loss: the layers (kv states shared as shared_kv_states does), the final norm,
// the LM head, the soft cap, the mean cross entropy times `scale` over the trained tokens.
double HfLoss(const ModelConfig& c, const ModelLayout& layout, const std::vector<std::vector<double>>& p,
              const MicroBatch& mb, double scale, std::vector<std::vector<double>>* layer_outputs = nullptr) {
  const int64_t T = mb.num_tokens(), H = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const int64_t P = c.gemma4.ple_dim;
  std::vector<double> x(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) x[t * H + i] = p[0][mb.tokens[t] * H + i] * c.EmbeddingScale();
  const std::vector<double> ple = P > 0 ? HfPerLayerInputs(c, layout, p, mb, x) : std::vector<double>();
  const HfRope full = HfRopeOf(mb.positions, HfInverseFrequencies(c.LayerHeadDim(L - 1), c.rope_theta,
                                                                  c.gemma4.full_rope));
  const HfRope sliding = HfRopeOf(mb.positions, HfInverseFrequencies(c.head_dim, c.sliding_rope_theta,
                                                                     c.gemma4.sliding_rope));
  std::map<int64_t, HfKv> stored;
  for (int64_t l = 0; l < L; ++l) {
    std::vector<double> ple_l;
    for (int64_t t = 0; t < T && P > 0; ++t)
      for (int64_t i = 0; i < P; ++i) ple_l.push_back(ple[t * L * P + l * P + i]);
    const int64_t source = c.KvSourceLayer(l);
    HfKv mine;
    x = HfLayer(c, layout.units[l + 1], p[l + 1], mb, c.IsSlidingLayer(l) ? sliding : full, x,
                P > 0 ? ple_l.data() : nullptr, source >= 0 ? &stored.at(source) : nullptr, &mine);
    stored[l] = mine;
    if (layer_outputs != nullptr) layer_outputs->push_back(x);
  }
  const UnitLayout& head = layout.head();
  const std::vector<double> xf = Norm(x.data(), p.back().data(), T, H, c.rms_norm_eps);
  const double* lm = layout.head_uses_embedding ? p[0].data() : p.back().data() + head.tensors[1].offset_numel;
  double loss = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (mb.labels[t] == kIgnoreIndex) continue;
    std::vector<double> logit(V);
    double mx = -1e300, se = 0;
    for (int64_t v = 0; v < V; ++v) {
      double raw = 0;
      for (int64_t i = 0; i < H; ++i) raw += xf[t * H + i] * lm[v * H + i];
      const double cap = c.final_logit_softcapping;
      logit[v] = cap > 0 ? std::tanh(raw / cap) * cap : raw;
      mx = std::max(mx, logit[v]);
    }
    for (int64_t v = 0; v < V; ++v) se += std::exp(logit[v] - mx);
    loss += scale * (mx + std::log(se) - logit[mb.labels[t]]);
  }
  return loss;
}

// ---- the tests ----

// Proportional RoPE: the first int(fraction * head_dim // 2) pairs at theta^(-2i / head_dim), the
// rest at frequency 0 (cos 1, sin 0: those dimensions pass unrotated), all divided by factor; the
// default type over the layer type's own head_dim. The backend's tables are exactly these.
TEST(Gemma4Rope, ProportionalAndDefaultFrequencies) {
  ModelConfig c = AwkwardGemma4Config(false);
  const std::vector<float> full = c.RopeInverseFrequencies(AttentionSpan::kFull);
  ASSERT_EQ(full.size(), 6u);  // full head_dim 12
  EXPECT_EQ(full, HfInverseFrequencies(12, 1e6, Gemma4Rope{true, 0.5, 2}));
  EXPECT_EQ(full[3], 0.0f);
  EXPECT_EQ(full[5], 0.0f);
  EXPECT_EQ(full[0], 0.5f);
  EXPECT_FLOAT_EQ(full[1], static_cast<float>(std::pow(1e6, -2.0 / 12) / 2));
  const std::vector<float> sliding = c.RopeInverseFrequencies(AttentionSpan::kSliding);
  ASSERT_EQ(sliding.size(), 4u);
  EXPECT_EQ(sliding, HfInverseFrequencies(8, 1e4, Gemma4Rope{}));
  // The released shape: head_dim 512, a quarter of the 256 pairs rotate.
  c.gemma4.full_head_dim = 512;
  c.gemma4.full_rope = Gemma4Rope{true, 0.25, 1};
  const std::vector<float> wide = c.RopeInverseFrequencies(AttentionSpan::kFull);
  ASSERT_EQ(wide.size(), 256u);
  EXPECT_EQ(wide, HfInverseFrequencies(512, 1e6, Gemma4Rope{true, 0.25, 1}));
  EXPECT_GT(wide[63], 0.0f);
  EXPECT_EQ(wide[64], 0.0f);
  // The batch's tables: one per layer type, each of its own width.
  const MicroBatch mb = MakeBatch({5, 3}, c.vocab_size, 1);
  const RopeTables rope = BuildRopeTables(mb.positions, AwkwardGemma4Config(false));
  EXPECT_EQ(rope.half, 6);
  EXPECT_EQ(rope.sliding_half, 4);
  const HfRope hf = HfRopeOf(mb.positions, HfInverseFrequencies(12, 1e6, Gemma4Rope{true, 0.5, 2}));
  for (size_t i = 0; i < hf.cos.size(); ++i) {
    EXPECT_EQ(rope.cos[i], static_cast<float>(hf.cos[i]));
    EXPECT_EQ(rope.sin[i], static_cast<float>(hf.sin[i]));
  }
}

// Each layer of the awkward model against Gemma4TextDecoderLayer written out, in double, on the same
// input: the per-layer inputs and shared keys and values as the whole model's forward leaves them.
TEST(Gemma4Layer, EveryLayerKindIsHfsDecoderLayer) {
  const ModelConfig c = AwkwardGemma4Config(false);
  const ModelLayout layout = ModelLayout::Build(c);
  const std::vector<std::vector<double>> params = Params(layout, 9);
  const MicroBatch mb = MakeBatch({6, 1, 9, 4}, c.vocab_size, 5);
  const int64_t T = mb.num_tokens(), H = c.hidden_size;
  std::vector<std::vector<double>> hf_outputs;
  HfLoss(c, layout, params, mb, 1.0, &hf_outputs);

  const RopeTables rope = BuildRopeTables(mb.positions, c);
  const TokenGeometry batch_geom = MakeTokenGeometry(mb, rope);
  Gemma4BatchState<double> state;
  std::vector<double> x(T * H);
  Gemma4EmbeddingForward(c, layout.embedding(), params[0].data(), mb.tokens.data(), T, x.data(), &state, nullptr);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const Gemma4LayerDims d = Gemma4LayerDims::Of(c, l);
    const UnitLayout& u = layout.units[l + 1];
    std::vector<double> y(T * H);
    Gemma4LayerForward(d, DecoderOffsets::Of(u), params[l + 1].data(), Gemma4LayerGeometry(batch_geom, rope, d.sliding),
                       x.data(), &state, y.data(), nullptr);
    double worst = 0;
    for (int64_t i = 0; i < T * H; ++i) {
      worst = std::max(worst, std::fabs(y[i] - hf_outputs[l][i]) / (1 + std::fabs(hf_outputs[l][i])));
    }
    EXPECT_LT(worst, 1e-12) << u.name;
    x = hf_outputs[l];  // each layer on HF's own input
  }
  // The layers' roles: 3 and 4 read 2's and 1's keys and values; 1 has no v_proj; 3 and 4 no k_proj.
  EXPECT_EQ(Gemma4LayerDims::Of(c, 3).kv_source, 2);
  EXPECT_EQ(Gemma4LayerDims::Of(c, 4).kv_source, 1);
  EXPECT_TRUE(Gemma4LayerDims::Of(c, 1).kv_stored && Gemma4LayerDims::Of(c, 1).k_eq_v);
  EXPECT_EQ(layout.units[2].Find(kVProj), nullptr);
  EXPECT_EQ(layout.units[4].Find(kKProj), nullptr);
  EXPECT_EQ(layout.units[4].Find(kGateProj)->shape[0], 80);
}

// The whole model's loss (both micro-batches) equals Gemma4ForCausalLM's written out, tied and not.
TEST(Gemma4Model, LossIsHfs) {
  for (bool tied : {false, true}) {
    const ModelConfig c = AwkwardGemma4Config(tied);
    const ModelLayout layout = ModelLayout::Build(c);
    const std::vector<std::vector<double>> params = Params(layout, 3);
    const std::vector<MicroBatch> batches = {MakeBatch({5, 1, 9, 6}, c.vocab_size, 11),
                                             MakeBatch({7, 4}, c.vocab_size, 12)};
    std::vector<std::vector<double>> grads;
    const double loss = ModelLossAndGrads<double>(layout, params, batches, 0.05, &grads, nullptr);
    const double want = HfLoss(c, layout, params, batches[0], 0.05) + HfLoss(c, layout, params, batches[1], 0.05);
    EXPECT_NEAR(loss, want, 1e-12 * want) << "tied " << tied;
  }
}

// The analytic gradients of the whole model against central differences of its loss, in double:
// every trainable tensor, entries of the table rows the tokens use; layer_scalar (a buffer in HF)
// gets none, nor does the tables' pad row from its lookups (nn.Embedding(padding_idx)).
TEST(Gemma4Model, GradientsMatchCentralDifferences) {
  constexpr double kStep = 1e-5, kRelTol = 1e-5;
  for (bool tied : {false, true}) {
    const ModelConfig c = AwkwardGemma4Config(tied);
    const ModelLayout layout = ModelLayout::Build(c);
    std::vector<std::vector<double>> params = Params(layout, 7);
    std::vector<MicroBatch> batches = {MakeBatch({5, 1, 9, 6}, c.vocab_size, 11), MakeBatch({7, 4}, c.vocab_size, 12)};
    batches[0].tokens[4] = static_cast<int32_t>(c.pad_token_id);
    batches[1].tokens[0] = static_cast<int32_t>(c.pad_token_id);
    const double scale = 1.0 / 20;
    std::vector<std::vector<double>> grads;
    ModelLossAndGrads<double>(layout, params, batches, scale, &grads, nullptr);
    auto loss_at = [&](int unit, int64_t index, double value) {
      const double saved = params[unit][index];
      params[unit][index] = value;
      std::vector<std::vector<double>> unused;
      const double l = ModelLossAndGrads<double>(layout, params, batches, scale, &unused, nullptr);
      params[unit][index] = saved;
      return l;
    };
    std::mt19937_64 rng(3);
    int checked = 0, significant = 0;
    double worst = 0;
    for (const UnitLayout& unit : layout.units) {
      for (const TensorSlot& t : unit.tensors) {
        if (!t.trainable) {
          for (int64_t i = 0; i < t.numel; ++i) EXPECT_EQ(grads[unit.index][t.offset_numel + i], 0.0) << t.hf_name;
          continue;
        }
        std::uniform_int_distribution<int64_t> pick(0, t.numel - 1);
        std::vector<int64_t> indices;
        for (int i = 0; i < 4; ++i) indices.push_back(pick(rng));
        const int64_t width = t.shape.size() == 2 ? t.shape[1] : 1;
        if (unit.kind == UnitKind::kEmbedding) {
          // Entries of rows the tokens use. The pad row's lookups give it nothing (HF's gradient, not
          // the loss's derivative): it holds the tied head's share alone.
          for (int i = 0; i < 4; ++i) indices.push_back(batches[0].tokens[i * 3] * width + pick(rng) % width);
          std::erase_if(indices, [&](int64_t i) { return i / width == c.pad_token_id; });
          for (int64_t i = 0; i < width && !(tied && &t == &unit.tensors[0]); ++i) {
            EXPECT_EQ(grads[unit.index][t.offset_numel + c.pad_token_id * width + i], 0.0) << t.hf_name << ": pad row";
          }
        }
        double tensor_max = 0;
        for (int64_t i = 0; i < t.numel; ++i) {
          tensor_max = std::max(tensor_max, std::abs(grads[unit.index][t.offset_numel + i]));
        }
        ASSERT_GT(tensor_max, 0) << t.hf_name << " has an all-zero gradient";
        for (int64_t i : indices) {
          const int64_t at = t.offset_numel + i;
          const double p = params[unit.index][at];
          const double fd = (loss_at(unit.index, at, p + kStep) - loss_at(unit.index, at, p - kStep)) / (2 * kStep);
          const double an = grads[unit.index][at];
          const double rel = std::abs(fd - an) / std::max({std::abs(an), std::abs(fd), 1e-3 * tensor_max});
          worst = std::max(worst, rel);
          EXPECT_LT(rel, kRelTol) << t.hf_name << "[" << i << "]: analytic " << an << " vs finite difference " << fd;
          ++checked;
          if (std::abs(an) > 1e-2 * tensor_max) ++significant;
        }
      }
    }
    EXPECT_GT(significant, checked * 2 / 3);
    std::printf("gemma4 (tied %d): %d entries checked (%d significant), worst relative error %.3g\n", tied, checked,
                significant, worst);
  }
}

// Documents packed into one micro-batch give what they give in two (nothing crosses a document but
// through the batch state, which is per micro-batch): tiny-gemma4 with rows of 64 tokens.
TEST(Gemma4Model, PackingDoesNotChangeTheGradients) {
  const ModelConfig c = *ModelConfig::Preset("tiny-gemma4");
  const ModelLayout layout = ModelLayout::Build(c);
  const std::vector<std::vector<double>> params = Params(layout, 3);
  const MicroBatch a = MakeBatch({20, 44}, c.vocab_size, 1), b = MakeBatch({30, 34}, c.vocab_size, 2);
  MicroBatch ab = a;
  for (size_t i = 0; i < b.tokens.size(); ++i) {
    ab.tokens.push_back(b.tokens[i]);
    ab.positions.push_back(b.positions[i]);
    ab.labels.push_back(b.labels[i]);
  }
  for (size_t i = 1; i < b.cu_seqlens.size(); ++i) ab.cu_seqlens.push_back(b.cu_seqlens[i] + a.num_tokens());
  ab.max_seqlen = std::max(a.max_seqlen, b.max_seqlen);
  std::vector<std::vector<double>> split, packed;
  const double l_split = ModelLossAndGrads<double>(layout, params, {a, b}, 0.01, &split, nullptr);
  const double l_packed = ModelLossAndGrads<double>(layout, params, {ab}, 0.01, &packed, nullptr);
  EXPECT_NEAR(l_split, l_packed, 1e-13 * l_split);
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      double diff = 0, largest = 0;
      for (int64_t i = t.offset_numel; i < t.offset_numel + t.numel; ++i) {
        diff = std::max(diff, std::abs(split[u.index][i] - packed[u.index][i]));
        largest = std::max(largest, std::abs(split[u.index][i]));
      }
      EXPECT_LE(diff, 1e-12 * largest) << t.hf_name;
    }
  }
}

// Without per-layer inputs (31B's shape): the layers alone, and no table in the embedding unit.
TEST(Gemma4Model, WithoutPerLayerInputs) {
  ModelConfig c = AwkwardGemma4Config(false);
  c.gemma4.ple_dim = 0;
  c.gemma4.ple_vocab = 0;
  c.gemma4.kv_shared_layers = 0;
  c.gemma4.double_wide_mlp = false;
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  const ModelLayout layout = ModelLayout::Build(c);
  EXPECT_EQ(layout.embedding().tensors.size(), 1u);
  EXPECT_EQ(layout.units[1].Find(kPleModelProj), nullptr);
  const std::vector<std::vector<double>> params = Params(layout, 4);
  const MicroBatch mb = MakeBatch({8, 5}, c.vocab_size, 2);
  std::vector<std::vector<double>> grads;
  const double loss = ModelLossAndGrads<double>(layout, params, {mb}, 0.1, &grads, nullptr);
  const double want = HfLoss(c, layout, params, mb, 0.1);
  EXPECT_NEAR(loss, want, 1e-12 * want);
}

// Gemma4Model (multimodal) embeds the image, video and audio placeholders as pad_token_id, in both
// tables; the gradient reaches the pad rows.
TEST(Gemma4Embedding, MultimodalPlaceholdersEmbedAsPad) {
  ModelConfig c = AwkwardGemma4Config(false);
  c.multimodal = true;
  c.gemma4.placeholder_tokens = {30, 31, 36};
  c.pad_token_id = 2;
  const std::vector<int32_t> tokens = {30, 5, 31, 36, 2, 7};
  EXPECT_EQ(Gemma4EmbeddingTokens(c, tokens.data(), 6), (std::vector<int32_t>{2, 5, 2, 2, 2, 7}));
  c.multimodal = false;
  EXPECT_EQ(Gemma4EmbeddingTokens(c, tokens.data(), 6), tokens);
}

// The CPU backend on the whole model, driven as the pipeline drives it (every unit's forward over
// two micro-batches, the head, every unit's backward in reverse, the embedding's), FP32 with BF16
// weights, against the double math on the same (BF16-exact) weights; tied and untied, each policy.
TEST(Gemma4Backend, WholeModelStepMatchesTheDoubleMath) {
  for (bool tied : {false, true}) {
    for (ActPolicy policy : {ActPolicy::kKeepAll, ActPolicy::kRecomputeLayer}) {
      const ModelConfig c = AwkwardGemma4Config(tied);
      const ModelLayout layout = ModelLayout::Build(c);
      const std::vector<std::vector<bf16_t>> bf16 = testing::ToBf16(Params(layout, 5));
      const std::vector<std::vector<double>> exact = testing::ToDouble(bf16);
      const std::vector<MicroBatch> batches = {MakeBatch({5, 1, 9, 6, 64, 30}, c.vocab_size, 11),
                                               MakeBatch({7, 4, 50}, c.vocab_size, 12)};
      const double scale = 1.0 / 20;
      std::vector<std::vector<double>> want;
      const double want_loss = ModelLossAndGrads<double>(layout, exact, batches, scale, &want, nullptr);

      auto be = MakeCpuBackend(c);
      ASSERT_TRUE(be.ok()) << be.status();
      const int L = static_cast<int>(c.num_hidden_layers), head = L + 1;
      const int64_t H = c.hidden_size;
      std::vector<std::unique_ptr<DeviceBatch>> dev;
      for (const MicroBatch& mb : batches) dev.push_back(*(*be)->UploadBatch(mb));
      // xs[mb][u]: the input of unit u (u = 1: the first layer's).
      std::vector<std::vector<std::vector<float>>> xs(2, std::vector<std::vector<float>>(head + 1));
      std::vector<std::vector<std::unique_ptr<SavedActivations>>> saved(2);
      std::vector<std::vector<float>> grads(layout.num_units());
      for (int u = 0; u < layout.num_units(); ++u) grads[u].assign(layout.units[u].numel, 0.0f);
      for (int m = 0; m < 2; ++m) {
        const int64_t T = batches[m].num_tokens();
        for (auto& x : xs[m]) x.assign(T * H, 0.0f);
        saved[m].resize(head);
        ASSERT_TRUE((*be)->EmbeddingForward(UnitParams(bf16[0].data()), *dev[m], xs[m][1].data()).ok());
      }
      for (int u = 1; u < head; ++u) {
        for (int m = 0; m < 2; ++m) {
          const UnitParams p = UnitParams(bf16[u].data()).OfLayer(u - 1);
          ASSERT_TRUE((*be)->DecoderForward(p, *dev[m], xs[m][u].data(), xs[m][u + 1].data(), policy,
                                            &saved[m][u]).ok());
        }
      }
      float loss = 0;
      std::vector<std::vector<float>> dy(2);
      for (int m = 0; m < 2; ++m) {
        dy[m].assign(batches[m].num_tokens() * H, 0.0f);
        const UnitParams norm(bf16[head].data() + layout.head().tensors[0].offset_numel);
        const bf16_t* lm = tied ? bf16[0].data() : bf16[head].data() + layout.head().tensors[1].offset_numel;
        float* dlm = tied ? grads[0].data() : grads[head].data() + layout.head().tensors[1].offset_numel;
        ASSERT_TRUE((*be)->HeadForwardBackward(norm, lm, *dev[m], xs[m][head].data(), static_cast<float>(scale),
                                               dy[m].data(), grads[head].data(), dlm, &loss).ok());
      }
      for (int u = head - 1; u >= 1; --u) {
        for (int m = 0; m < 2; ++m) {
          const UnitParams p = UnitParams(bf16[u].data()).OfLayer(u - 1);
          ASSERT_TRUE((*be)->DecoderBackward(p, *dev[m], xs[m][u].data(), saved[m][u].get(), dy[m].data(),
                                             dy[m].data(), grads[u].data()).ok());
        }
      }
      for (int m = 0; m < 2; ++m) ASSERT_TRUE((*be)->EmbeddingBackward(dy[m].data(), *dev[m], grads[0].data()).ok());
      const std::string what = absl::StrCat("tied ", tied, " policy ", policy.pieces);
      EXPECT_NEAR(loss, want_loss, 2e-5 * want_loss) << what;
      for (const UnitLayout& u : layout.units) {
        for (const TensorSlot& t : u.tensors) {
          double scale_max = 0, diff = 0;
          for (int64_t i = 0; i < t.numel; ++i) {
            scale_max = std::max(scale_max, std::abs(want[u.index][t.offset_numel + i]));
            diff = std::max(diff, std::abs(grads[u.index][t.offset_numel + i] - want[u.index][t.offset_numel + i]));
          }
          EXPECT_LE(diff, 1e-4 * scale_max + 1e-9) << what << " " << t.hf_name;
        }
        for (int m = 0; m < 2 && u.kind == UnitKind::kDecoder; ++m) {
          EXPECT_EQ(saved[m][u.index]->bytes(), 0) << "gemma4 layers keep nothing";
        }
      }
    }
  }
}

}  // namespace
}  // namespace slidedp
