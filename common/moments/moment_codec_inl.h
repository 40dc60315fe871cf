// Per-element encode/decode of the compact Adam moments (moments.h has the layouts), shared by
// the codec files for their scalar parts and by LayerAdam's compact-moment kernels
// (hostd/update/adamw_state_*.cc), which decode, step and re-encode with them. Internal linkage on
// purpose: each file compiles it with its own -m flags, and one shared (inline) definition could
// let the linker hand an AVX-512 copy to the scalar fallback.
//
// The vector codecs (moment_codec_avx2_inl.h, moment_codec_avx512_inl.h) repeat these functions
// op for op; any change here must be made there too (adam_state_test and common_moments_test check
// every ISA against the scalar code bit for bit).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/moments/moments.h"

namespace slidedp::moments {
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

}  // namespace
}  // namespace slidedp::moments
