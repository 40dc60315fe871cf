// The RoPE frequencies and attention scaling a config's rope_scaling gives (default, linear,
// dynamic, llama3, yarn), as HF's _compute_*_rope_parameters compute them (see model_config.h).
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"

namespace slidedp {
namespace {

// One RoPE's frequencies: base `rope_theta` with scaling `s` over the config's rotary dims (a
// gemma3 model has two: its full-attention layers' and its sliding layers').
std::vector<float> InverseFrequencies(const ModelConfig& c, double rope_theta, const RopeScaling& s) {
  const int64_t max_position_embeddings = c.max_position_embeddings;
  // HF rotates dim = int(head_dim x partial_rotary_factor) dimensions of each head and computes
  // every scaling's frequencies over that dim (qwen3_5: 64 of 256).
  const int64_t rot = c.rotary_dim();
  const int64_t half = rot / 2;
  double base = rope_theta;
  if (s.type == RopeScaling::Type::kDynamic) {
    // _compute_dynamic_ntk_parameters at init (seq_len = max_position_embeddings, see RopeScaling).
    const double len = static_cast<double>(max_position_embeddings), dim = static_cast<double>(rot);
    base = rope_theta * std::pow(s.factor * len / len - (s.factor - 1), dim / (dim - 2));
  }
  // HF: base ** (arange(0, dim, 2, dtype=int64).float() / dim), then 1.0 / that.
  std::vector<float> pos_freq(half), inv(half);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rot);
    pos_freq[i] = std::pow(static_cast<float>(base), exponent);
    inv[i] = 1.0f / pos_freq[i];
  }
  switch (s.type) {
    case RopeScaling::Type::kNone:
    case RopeScaling::Type::kDynamic:
      break;
    case RopeScaling::Type::kLinear: {  // _compute_linear_scaling_rope_parameters: inv_freq /= factor
      const float factor = static_cast<float>(s.factor);
      for (float& f : inv) f = f / factor;
      break;
    }
    case RopeScaling::Type::kLlama3: {  // _compute_llama3_parameters
      const float factor = static_cast<float>(s.factor);
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      const float low_wavelen = static_cast<float>(old_len / s.low_freq_factor);
      const float high_wavelen = static_cast<float>(old_len / s.high_freq_factor);
      const float two_pi = static_cast<float>(2 * M_PI);
      const float low = static_cast<float>(s.low_freq_factor);
      const float band = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
      for (float& f : inv) {
        const float wavelen = two_pi / f;
        const float scaled = wavelen > low_wavelen ? f / factor : f;
        const float smooth = (static_cast<float>(old_len) / wavelen - low) / band;
        const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        f = medium ? smoothed : scaled;
      }
      break;
    }
    case RopeScaling::Type::kYarn: {  // _compute_yarn_parameters
      // find_correction_dim: the dimension whose frequency turns `rotations` times over the
      // original context; find_correction_range: floor / ceil (truncate), clamped to [0, dim - 1].
      const double dim = static_cast<double>(rot);
      const double original = static_cast<double>(s.original_max_position_embeddings);
      auto correction_dim = [&](double rotations) {
        return (dim * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(rope_theta));
      };
      double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1);
      if (low == high) high += 0.001;  // linear_ramp_factor: "prevent singularity"
      const float ramp_low = static_cast<float>(low), ramp_span = static_cast<float>(high - low);
      const float factor = static_cast<float>(s.factor);
      for (int64_t i = 0; i < half; ++i) {
        const float ramp = std::clamp((static_cast<float>(i) - ramp_low) / ramp_span, 0.0f, 1.0f);
        const float extrapolation_weight = 1.0f - ramp;  // HF's inv_freq_extrapolation_factor
        const float interpolation = 1.0f / (factor * pos_freq[i]);
        inv[i] = interpolation * (1.0f - extrapolation_weight) + inv[i] * extrapolation_weight;
      }
      break;
    }
  }
  return inv;
}

double AttentionScalingOf(const RopeScaling& s) {
  if (s.type != RopeScaling::Type::kYarn) return 1.0;
  if (s.attention_factor != 0) return s.attention_factor;
  // _compute_yarn_parameters' get_mscale: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1).
  auto mscale_of = [&](double mscale) { return s.factor <= 1 ? 1.0 : 0.1 * mscale * std::log(s.factor) + 1.0; };
  if (s.mscale != 0 && s.mscale_all_dim != 0) return mscale_of(s.mscale) / mscale_of(s.mscale_all_dim);
  return mscale_of(1);
}

}  // namespace

std::vector<float> ModelConfig::RopeInverseFrequencies(AttentionSpan span) const {
  // gemma4: per layer type, over that type's head_dim (default or proportional).
  if (is_gemma4()) return config_internal::Gemma4InverseFrequencies(*this, span);
  if (span == AttentionSpan::kSliding && has_sliding_rope()) {
    return InverseFrequencies(*this, sliding_rope_theta, sliding_rope_scaling);
  }
  return InverseFrequencies(*this, rope_theta, rope_scaling);
}

double ModelConfig::RopeAttentionScaling(AttentionSpan span) const {
  return AttentionScalingOf(span == AttentionSpan::kSliding && has_sliding_rope() ? sliding_rope_scaling
                                                                                  : rope_scaling);
}

}  // namespace slidedp
