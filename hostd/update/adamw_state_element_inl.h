// Per-element encode/decode of the compact Adam moments and the stochastic-rounding hash, shared
// by the state kernel files for their scalar parts (the scalar kernels, the vector kernels' tails).
// Private to hostd/update; internal linkage on purpose, as adamw_element_inl.h explains.
//
// The vector kernels repeat these functions op for op; any change here must be made there too
// (adamw_state_test checks every ISA against the scalar kernels bit for bit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/numeric/bf16.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_state.h"

namespace slidedp::update {
namespace {

// m code: 7-bit magnitude c in [0, 127]; c >= 1 is the float with bits (c + kMCodeOffset) << 20,
// i.e. a float grid with 3 mantissa bits whose top code 127 is exactly 1.0 and whose code 1 is
// 1.25 * 2^-16.
constexpr int kMCodeMantissaBits = 3;
constexpr int kMCodeShift = 23 - kMCodeMantissaBits;
constexpr int32_t kMCodeMax = 127;
constexpr int32_t kMCodeOffset = (127 << kMCodeMantissaBits) - kMCodeMax;  // 889
// v code: q in [0, 255], sqrt(v) = v_scale * (q / 255)^2.
constexpr int32_t kVCodeMax = 255;
constexpr float kVCodeMaxSquared = 65025.0f;        // 255^2, exact
constexpr float kRoundMagic = 8388608.0f;           // 2^23
constexpr uint32_t kNonFiniteBits = 0x7f800000u;    // |x| bits at or above this: inf or NaN
constexpr uint32_t kMinNormalBits = 0x00800000u;    // FLT_MIN
constexpr uint32_t kPoisonScaleBits = 0x7fc00000u;  // the scale of a poisoned block: quiet NaN

[[maybe_unused]] inline uint32_t FloatBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
[[maybe_unused]] inline float BitsFloat(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

[[maybe_unused]] inline float DecodeM(int8_t code, float m_scale) {
  const int32_t c = code;
  const uint32_t mag = static_cast<uint32_t>(c < 0 ? -c : c);
  const float unit = mag == 0 ? 0.0f : BitsFloat((mag + kMCodeOffset) << kMCodeShift);
  const float value = unit * m_scale;
  return c < 0 ? -value : value;
}

// v_step = v_scale / 255^2, once per block.
[[maybe_unused]] inline float DecodeV(uint8_t code, float v_step) {
  const float q = static_cast<float>(code);
  const float s = (q * q) * v_step;
  return s * s;
}

// x's code with m_inv = 1 / m_scale (0 when the block's absmax is 0 or subnormal: all codes 0).
[[maybe_unused]] inline int8_t EncodeM(float x, float m_inv) {
  const uint32_t xb = FloatBits(x);
  const uint32_t rb = FloatBits(BitsFloat(xb & 0x7fffffffu) * m_inv);
  const int32_t rounded =
      static_cast<int32_t>((rb + ((1u << (kMCodeShift - 1)) - 1u) + ((rb >> kMCodeShift) & 1u)) >> kMCodeShift);
  const int32_t c = std::min(std::max(rounded - kMCodeOffset, int32_t{0}), kMCodeMax);
  return static_cast<int8_t>((xb >> 31) != 0 ? -c : c);
}

// s = sqrt(v) >= 0 with v_k = 255^2 / v_scale (0 for an all-zero block): 255 * sqrt(s / v_scale)
// = sqrt(s * v_k) rounded to an integer. (q + 2^23) - 2^23 rounds 0 <= q < 2^23 in the current
// rounding mode, as the vector kernels' cvtps2dq does, so they agree in any mode (nearest even by
// default). Non-zero s gives code >= 1.
[[maybe_unused]] inline uint8_t EncodeV(float s, float v_k) {
  const float q = std::sqrt(s * v_k);
  const int32_t rounded = static_cast<int32_t>((q + kRoundMagic) - kRoundMagic);
  const int32_t floor = s > 0.0f ? 1 : 0;
  return static_cast<uint8_t>(std::max(std::min(rounded, kVCodeMax), floor));
}

// What a block's new absmax (as |x| bits: an integer max is exact, order-free and sees NaN) gives.
struct Int8BlockScales {
  float m_scale;  // stored: absmax of m, NaN when poisoned
  float m_inv;
  float v_scale;  // stored: absmax of sqrt(v), NaN when poisoned
  float v_k;
  bool m_poisoned;  // a NaN/inf among the new m: codes 0, scale NaN
  bool v_poisoned;
};

[[maybe_unused]] inline Int8BlockScales MakeInt8BlockScales(uint32_t m_abs_bits, uint32_t s_abs_bits) {
  Int8BlockScales b;
  b.m_poisoned = m_abs_bits >= kNonFiniteBits;
  b.v_poisoned = s_abs_bits >= kNonFiniteBits;
  b.m_scale = b.m_poisoned ? BitsFloat(kPoisonScaleBits) : BitsFloat(m_abs_bits);
  b.m_inv = (b.m_poisoned || m_abs_bits < kMinNormalBits) ? 0.0f : 1.0f / b.m_scale;
  b.v_scale = b.v_poisoned ? BitsFloat(kPoisonScaleBits) : BitsFloat(s_abs_bits);
  // sqrt of the smallest positive float is ~3.7e-23, so a non-zero v_scale is normal and v_k finite.
  b.v_k = (b.v_poisoned || s_abs_bits == 0) ? 0.0f : kVCodeMaxSquared / b.v_scale;
  return b;
}

[[maybe_unused]] inline float Int8VStep(float v_scale) { return v_scale / kVCodeMaxSquared; }

// Elements [from, len) of a block: codes from the new m and sqrt(v) (the vector kernels' tails).
[[maybe_unused]] inline void EncodeInt8Elements(const Int8BlockScales& b, const float* m_new, const float* s_new,
                                                int64_t from, int64_t len, int8_t* m_codes, uint8_t* v_codes) {
  for (int64_t i = from; i < len; ++i) {
    m_codes[i] = b.m_poisoned ? int8_t{0} : EncodeM(m_new[i], b.m_inv);
    v_codes[i] = b.v_poisoned ? uint8_t{0} : EncodeV(s_new[i], b.v_k);
  }
}

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
