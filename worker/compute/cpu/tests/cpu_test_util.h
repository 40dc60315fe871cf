// Shared fixtures of the CPU backend tests: small Qwen3 shapes, random parameters and packed
// micro-batches with several documents per row.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "worker/compute/backend.h"

namespace slidedp::testing {

// An awkward shape: nothing is a power of two except head_dim, odd vocabulary.
inline ModelConfig AwkwardConfig(bool tied) {
  ModelConfig c;
  c.hidden_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.intermediate_size = 40;
  c.vocab_size = 37;
  c.max_position_embeddings = 128;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.tie_word_embeddings = tied;
  return c;
}

// The awkward shape in another family: qwen2 (q/k/v biases, no q/k norm), llama (no q/k norm,
// llama3 RoPE scaling with every band present at these lengths), mistral.
inline ModelConfig AwkwardConfigOf(ModelFamily family, bool tied) {
  ModelConfig c = AwkwardConfig(tied);
  c.family = family;
  if (family == ModelFamily::kLlama) {
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = 8;
    c.rope_scaling.low_freq_factor = 1;
    c.rope_scaling.high_freq_factor = 4;
    c.rope_scaling.original_max_position_embeddings = 64;
  }
  return c;
}

// The awkward shape of `family` whose layers slide where `spans` says, over `window` keys.
inline ModelConfig AwkwardSlidingConfig(ModelFamily family, int64_t window, std::vector<AttentionSpan> spans,
                                        bool tied = false) {
  ModelConfig c = AwkwardConfigOf(family, tied);
  c.sliding_window = window;
  c.layer_spans = std::move(spans);
  return c;
}

// The awkward shape (qwen3: q/k norm) with YaRN, factor 4 over 64 original positions: at head_dim 8
// and theta 1e4 HF's correction range is [0, 2], so the 4 frequencies are one extrapolated, one
// half way along the ramp and two interpolated; cos and sin are scaled by 0.1 ln 4 + 1.
inline ModelConfig AwkwardYarnConfig(bool tied) {
  ModelConfig c = AwkwardConfig(tied);
  c.rope_scaling.type = RopeScaling::Type::kYarn;
  c.rope_scaling.factor = 4;
  c.rope_scaling.original_max_position_embeddings = 64;
  return c;
}

// The awkward shape as qwen3_moe: 3 layers, layer 1 dense (mlp_only_layers), the others with 6
// experts of width 10, top-2 (top-3 without renormalisation when norm_topk is false).
inline ModelConfig AwkwardMoeConfig(bool tied, bool norm_topk) {
  ModelConfig c = AwkwardConfig(tied);
  c.family = ModelFamily::kQwen3Moe;
  c.num_hidden_layers = 3;
  c.num_experts = 6;
  c.num_experts_per_tok = norm_topk ? 2 : 3;
  c.moe_intermediate_size = 10;
  c.norm_topk_prob = norm_topk;
  c.mlp_only_layers = {1};
  return c;
}

// The awkward shape as gemma3: three layers (sliding over 3 keys, sliding, full), the sliding ones
// rotating with theta 1e4, the full one with 1e6 and linear factor 8, query_pre_attn_scalar 24 (not
// head_dim 8), the embedding times bf16(sqrt(48)) = 6.9375, soft-capped logits (cap 2: most of
// them bend) unless `softcap` is 0.
inline ModelConfig AwkwardGemma3Config(bool tied, double softcap = 2) {
  ModelConfig c = AwkwardConfig(tied);
  c.family = ModelFamily::kGemma3;
  c.num_hidden_layers = 3;
  c.sliding_window = 3;
  c.layer_spans = {AttentionSpan::kSliding, AttentionSpan::kSliding, AttentionSpan::kFull};
  c.query_pre_attn_scalar = 24;
  c.rope_theta = 1e6;
  c.rope_scaling.type = RopeScaling::Type::kLinear;
  c.rope_scaling.factor = 8;
  c.sliding_rope_theta = 1e4;
  c.final_logit_softcapping = softcap;
  c.pad_token_id = 0;
  return c;
}

// The awkward shape as gpt_oss: layer 0 sliding over 3 keys, layer 1 full; q/k/v/o biases and
// sinks; 5 experts of width 12 (top-2) with biases; YaRN factor 4 over 64 positions, not truncated.
inline ModelConfig AwkwardGptOssConfig(bool tied) {
  ModelConfig c = AwkwardConfig(tied);
  c.family = ModelFamily::kGptOss;
  c.sliding_window = 3;
  c.layer_spans = {AttentionSpan::kSliding, AttentionSpan::kFull};
  c.intermediate_size = 12;
  c.num_experts = 5;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 12;
  c.norm_topk_prob = true;
  c.expert_storage = ExpertStorage::kFused;
  c.rope_scaling.type = RopeScaling::Type::kYarn;
  c.rope_scaling.factor = 4;
  c.rope_scaling.original_max_position_embeddings = 64;
  c.rope_scaling.truncate = false;
  return c;
}

inline ModelConfig TinyConfig() { return ModelConfig::Preset("tiny").value(); }

// Random parameters in ModelLayout order: norm weights 1 + 0.2 N(0,1), biases 0.2 N(0,1), matrices N(0, 1/in) so
// activations stay O(1) and softmaxes are far from uniform; padding stays zero.
inline std::vector<std::vector<double>> RandomUnitParams(const ModelLayout& layout, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<std::vector<double>> units;
  for (const UnitLayout& u : layout.units) {
    std::vector<double> p(u.numel, 0.0);
    for (const TensorSlot& t : u.tensors) {
      if (t.hf_name.size() > 5 && t.hf_name.compare(t.hf_name.size() - 5, 5, ".bias") == 0) {
        for (int64_t i = 0; i < t.numel; ++i) p[t.offset_numel + i] = 0.2 * normal(rng);
      } else if (t.shape.size() == 1) {
        for (int64_t i = 0; i < t.numel; ++i) p[t.offset_numel + i] = 1.0 + 0.2 * normal(rng);
      } else {
        const double sd = u.kind == UnitKind::kEmbedding ? 1.0 : 1.0 / std::sqrt(static_cast<double>(t.shape[1]));
        for (int64_t i = 0; i < t.numel; ++i) p[t.offset_numel + i] = sd * normal(rng);
      }
    }
    units.push_back(std::move(p));
  }
  return units;
}

inline std::vector<std::vector<bf16_t>> ToBf16(const std::vector<std::vector<double>>& units) {
  std::vector<std::vector<bf16_t>> out;
  for (const auto& u : units) {
    std::vector<bf16_t> b(u.size());
    for (size_t i = 0; i < u.size(); ++i) b[i] = FloatToBf16(static_cast<float>(u[i]));
    out.push_back(std::move(b));
  }
  return out;
}

inline std::vector<std::vector<double>> ToDouble(const std::vector<std::vector<bf16_t>>& units) {
  std::vector<std::vector<double>> out;
  for (const auto& u : units) {
    std::vector<double> d(u.size());
    for (size_t i = 0; i < u.size(); ++i) d[i] = Bf16ToFloat(u[i]);
    out.push_back(std::move(d));
  }
  return out;
}

// A packed micro-batch of documents with the given lengths; every ignore_every-th label (and the
// last token of each document, as a packer would do) is kIgnoreIndex.
inline MicroBatch MakeBatch(const std::vector<int32_t>& doc_lengths, int64_t vocab, uint64_t seed,
                            int ignore_every = 4) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(vocab - 1));
  MicroBatch mb;
  mb.cu_seqlens.push_back(0);
  for (int32_t len : doc_lengths) {
    for (int32_t i = 0; i < len; ++i) {
      mb.tokens.push_back(tok(rng));
      mb.positions.push_back(i);
      const bool ignored = i == len - 1 || (ignore_every > 0 && mb.tokens.size() % ignore_every == 0);
      mb.labels.push_back(ignored ? kIgnoreIndex : tok(rng));
    }
    mb.cu_seqlens.push_back(static_cast<int32_t>(mb.tokens.size()));
    mb.max_seqlen = std::max(mb.max_seqlen, len);
  }
  return mb;
}

// n draws of N(0, 1) in R from a fixed seed.
template <typename R>
std::vector<R> RandomNormals(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<R> normal;
  std::vector<R> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(rng);
  return v;
}

inline double RelativeL2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Written-out references the family math tests share (HF's layers in double):
// y[T, out] = x[T, in] Wᵀ with W [out, in] (nn.Linear without bias).
inline std::vector<double> RefLinear(const std::vector<double>& x, const double* w, int64_t T, int64_t in,
                                     int64_t out) {
  std::vector<double> y(T * out, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[t * out + o] += x[t * in + i] * w[o * in + i];
  return y;
}
// PyTorch's gelu(approximate="tanh"), straight from its definition.
inline double RefGeluTanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

}  // namespace slidedp::testing
