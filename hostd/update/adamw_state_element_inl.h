// Per-element AdamW of the compact moments and the stochastic-rounding hash, shared by the state
// kernel files for their scalar parts (the scalar kernels, the vector kernels' tails). The codes'
// encode and decode are common/moments/moment_codec_inl.h. Private to hostd/update; internal
// linkage on purpose, as adamw_element_inl.h explains.
//
// The vector kernels repeat these functions op for op; any change here must be made there too
// (adamw_state_test checks every ISA against the scalar kernels bit for bit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/moments/moment_codec_inl.h"
#include "common/numeric/bf16.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_state.h"

namespace slidedp::update {
namespace {

using moments::DecodeM;
using moments::DecodeV;
using moments::FloatBits;
using moments::kNonFiniteBits;

// One element of the int8 step, before its block is requantized: decodes m and v, runs AdamW on
// them, writes theta and (unless nullptr) the mirror, and leaves the new m and sqrt(v).
[[maybe_unused]] inline void Int8Element(const AdamWConstants& c, const LerpForm& lerp, float grad, float* theta,
                                         int8_t m_code, uint8_t v_code, float m_scale, float v_step, bf16_t* mirror,
                                         float* m_new, float* s_new) {
  float m = DecodeM(m_code, m_scale);
  float v = DecodeV(v_code, v_step);
  bf16_t mir;
  AdamElement(c, lerp, grad, theta, &m, &v, &mir);
  if (mirror != nullptr) *mirror = mir;
  *m_new = m;
  *s_new = std::sqrt(v);
}

// lowbias32 (C. Wellons' integer hash; bijective, full avalanche): two multiplies.
[[maybe_unused]] inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

[[maybe_unused]] inline uint32_t RoundingKey(uint64_t seed, int64_t step, uint32_t index_hi) {
  uint32_t k = Mix32(static_cast<uint32_t>(seed) ^ 0x9e3779b9u);
  k = Mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = Mix32(k ^ static_cast<uint32_t>(step));
  k = Mix32(k ^ static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32));
  return Mix32(k ^ index_hi);
}

// The 16 random bits of the element whose global index has low half `index_lo`.
[[maybe_unused]] inline uint32_t RoundingBits(uint32_t key, uint32_t index_lo) { return Mix32(index_lo ^ key) >> 16; }

// x rounded to BF16 stochastically: up with probability (dropped bits) / 2^16. NaN -> quiet NaN as
// FloatToBf16; inf stays inf.
[[maybe_unused]] inline bf16_t StochasticBf16(float x, uint32_t bits16) {
  const uint32_t b = FloatBits(x);
  if ((b & 0x7fffffffu) > kNonFiniteBits) return static_cast<bf16_t>((b >> 16) | 0x40u);
  return static_cast<bf16_t>((b + bits16) >> 16);
}

// One element of the bf16 step: m to nearest even, v stochastically with `bits16`.
[[maybe_unused]] inline void Bf16StateElement(const AdamWConstants& c, const LerpForm& lerp, float grad, float* theta,
                                              bf16_t* m, bf16_t* v, bf16_t* mirror, uint32_t bits16) {
  float mm = Bf16ToFloat(*m);
  float vv = Bf16ToFloat(*v);
  bf16_t mir;
  AdamElement(c, lerp, grad, theta, &mm, &vv, &mir);
  *m = FloatToBf16(mm);
  *v = StochasticBf16(vv, bits16);
  if (mirror != nullptr) *mirror = mir;
}

// Splits [0, n) where the global index's high 32 bits change, so the kernels hash only the low
// half per element. fn(from, to, key, lo_of_from) returns -1 to go on or an index to stop at.
template <typename Fn>
inline int64_t ForEachRoundingSpan(const StochasticRounding& sr, int64_t n, Fn fn) {
  int64_t from = 0;
  while (from < n) {
    const uint64_t global = static_cast<uint64_t>(sr.first_index + from);
    const uint64_t to_boundary = (uint64_t{1} << 32) - (global & 0xffffffffu);
    const int64_t to = static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(n), from + to_boundary));
    const uint32_t key = RoundingKey(sr.seed, sr.step, static_cast<uint32_t>(global >> 32));
    if (const int64_t stop = fn(from, to, key, static_cast<uint32_t>(global)); stop >= 0) return stop;
    from = to;
  }
  return -1;
}

// The first element of [from, to) with a non-finite gradient, or -1.
template <typename G>
inline int64_t FirstNonFinite(const G* grad, int64_t from, int64_t to) {
  for (int64_t i = from; i < to; ++i) {
    if (IsNonFinite(GradAt(grad, i))) return i;
  }
  return -1;
}

}  // namespace
}  // namespace slidedp::update
