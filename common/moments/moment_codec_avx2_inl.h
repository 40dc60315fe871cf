// The int8 moments' encode and decode on 8 AVX2 lanes, op for op the scalar functions of
// moment_codec_inl.h, and the encoding of a whole block: shared by the AVX2 codec
// (moment_codecs_avx2.cc) and LayerAdam's AVX2 compact-moment kernels
// (hostd/update/adamw_state_avx2.cc). Included only by files compiled with -mavx2 -mfma
// -ffp-contract=off; internal linkage on purpose (see moment_codec_inl.h).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "common/moments/bf16_avx2_inl.h"
#include "common/moments/moment_codec_inl.h"

namespace slidedp::moments {
namespace {

// DecodeM on 8 lanes from 8 int8 codes in the low 8 bytes of `codes`.
inline __m256 DecodeM8(__m128i codes, __m256 m_scale) {
  const __m256i c = _mm256_cvtepi8_epi32(codes);
  const __m256i mag = _mm256_abs_epi32(c);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(kMCodeOffset)), kMCodeShift);
  const __m256i unit = _mm256_and_si256(bits, _mm256_cmpgt_epi32(mag, _mm256_setzero_si256()));
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(unit), m_scale);
  const __m256i sign = _mm256_and_si256(c, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_xor_ps(value, _mm256_castsi256_ps(sign));
}

// DecodeV on 8 lanes from 8 uint8 codes in the low 8 bytes of `codes`.
inline __m256 DecodeV8(__m128i codes, __m256 v_step) {
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  const __m256 s = _mm256_mul_ps(_mm256_mul_ps(q, q), v_step);
  return _mm256_mul_ps(s, s);
}

// EncodeM on 8 lanes: int32 codes in [-127, 127].
inline __m256i EncodeM8(__m256 x, __m256 m_inv) {
  const __m256i xb = _mm256_castps_si256(x);
  const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(xb, _mm256_set1_epi32(0x7fffffff)));
  const __m256i rb = _mm256_castps_si256(_mm256_mul_ps(a, m_inv));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(rb, kMCodeShift), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(rb, _mm256_set1_epi32((1 << (kMCodeShift - 1)) - 1)), lsb), kMCodeShift);
  const __m256i c = _mm256_min_epi32(
      _mm256_max_epi32(_mm256_sub_epi32(rounded, _mm256_set1_epi32(kMCodeOffset)), _mm256_setzero_si256()),
      _mm256_set1_epi32(kMCodeMax));
  const __m256i sign = _mm256_srai_epi32(xb, 31);
  return _mm256_sub_epi32(_mm256_xor_si256(c, sign), sign);
}

// EncodeV on 8 lanes: int32 codes in [0, 255]. (An rsqrt guess with an exact nearest-root test
// instead of the sqrt was 15% slower on a Zen 3 core: more instructions than the sqrt costs.)
inline __m256i EncodeV8(__m256 s, __m256 v_k) {
  const __m256i rounded = _mm256_cvtps_epi32(_mm256_sqrt_ps(_mm256_mul_ps(s, v_k)));
  const __m256i floor =
      _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ)), _mm256_set1_epi32(1));
  return _mm256_max_epi32(_mm256_min_epi32(rounded, _mm256_set1_epi32(kVCodeMax)), floor);
}

inline uint32_t MaxLane(__m256i x) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
  uint32_t out = 0;
  for (uint32_t l : lanes) out = std::max(out, l);
  return out;
}

// Codes of a block from its new m and sqrt(v); len <= 256.
void EncodeBlock(const Int8BlockScales& b, const float* m_new, const float* s_new, int64_t len, int8_t* m_codes,
                 uint8_t* v_codes) {
  if (b.m_poisoned || b.v_poisoned) {  // rare: the scalar encoder writes the zero codes
    EncodeInt8Elements(b, m_new, s_new, 0, len, m_codes, v_codes);
    return;
  }
  const __m256 m_inv = _mm256_set1_ps(b.m_inv), v_k = _mm256_set1_ps(b.v_k);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m256i m16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(EncodeM8(_mm256_loadu_ps(m_new + i), m_inv),
                                                                    EncodeM8(_mm256_loadu_ps(m_new + i + 8), m_inv)),
                                                 _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i v16 =
        Pack16(EncodeV8(_mm256_loadu_ps(s_new + i), v_k), EncodeV8(_mm256_loadu_ps(s_new + i + 8), v_k));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m_codes + i),
                     _mm_packs_epi16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v_codes + i),
                     _mm_packus_epi16(_mm256_castsi256_si128(v16), _mm256_extracti128_si256(v16, 1)));
  }
  EncodeInt8Elements(b, m_new, s_new, i, len, m_codes, v_codes);
}

}  // namespace
}  // namespace slidedp::moments
