// The int8 moments' encode and decode on 16 AVX-512 lanes, op for op the scalar functions of
// moment_codec_inl.h, masked for heads and tails, and the encoding of a whole block: shared by the
// AVX-512 codec (moment_codecs_avx512.cc) and LayerAdam's AVX-512 compact-moment kernels
// (hostd/update/adamw_state_avx512.cc). Included only by files compiled with the AVX-512 flags and
// -ffp-contract=off; internal linkage on purpose (see moment_codec_inl.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "common/moments/bf16_avx512_inl.h"
#include "common/moments/moment_codec_inl.h"

namespace slidedp::moments {
namespace {

// The first `count` lanes (all 16 from 16 on).
inline __mmask16 FirstLanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

inline __m512 DecodeM16(__m128i codes, __m512 m_scale) {
  const __m512i c = _mm512_cvtepi8_epi32(codes);
  const __m512i mag = _mm512_abs_epi32(c);
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(mag, _mm512_set1_epi32(kMCodeOffset)), kMCodeShift);
  const __m512i unit = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(mag, mag), bits);
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(unit), m_scale);
  const __m512i sign = _mm512_and_si512(c, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(value), sign));
}

inline __m512 DecodeV16(__m128i codes, __m512 v_step) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  const __m512 s = _mm512_mul_ps(_mm512_mul_ps(q, q), v_step);
  return _mm512_mul_ps(s, s);
}

inline __m512i EncodeM16(__m512 x, __m512 m_inv) {
  const __m512i xb = _mm512_castps_si512(x);
  const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32(0x7fffffff)));
  const __m512i rb = _mm512_castps_si512(_mm512_mul_ps(a, m_inv));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(rb, kMCodeShift), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(rb, _mm512_set1_epi32((1 << (kMCodeShift - 1)) - 1)), lsb), kMCodeShift);
  const __m512i c = _mm512_min_epi32(
      _mm512_max_epi32(_mm512_sub_epi32(rounded, _mm512_set1_epi32(kMCodeOffset)), _mm512_setzero_si512()),
      _mm512_set1_epi32(kMCodeMax));
  const __m512i sign = _mm512_srai_epi32(xb, 31);
  return _mm512_sub_epi32(_mm512_xor_si512(c, sign), sign);
}

// EncodeV on 16 lanes, as EncodeV8 (adamw_state_avx2.cc).
inline __m512i EncodeV16(__m512 s, __m512 v_k) {
  const __m512i rounded = _mm512_cvtps_epi32(_mm512_sqrt_ps(_mm512_mul_ps(s, v_k)));
  const __m512i floor =
      _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_epi32(1));
  return _mm512_max_epi32(_mm512_min_epi32(rounded, _mm512_set1_epi32(kVCodeMax)), floor);
}

void EncodeBlock(const Int8BlockScales& b, const float* m_new, const float* s_new, int64_t len, int8_t* m_codes,
                 uint8_t* v_codes) {
  if (b.m_poisoned || b.v_poisoned) {  // rare: the scalar encoder writes the zero codes
    EncodeInt8Elements(b, m_new, s_new, 0, len, m_codes, v_codes);
    return;
  }
  const __m512 m_inv = _mm512_set1_ps(b.m_inv), v_k = _mm512_set1_ps(b.v_k);
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 k = FirstLanes(len - i);
    _mm512_mask_cvtepi32_storeu_epi8(m_codes + i, k, EncodeM16(_mm512_maskz_loadu_ps(k, m_new + i), m_inv));
    _mm512_mask_cvtepi32_storeu_epi8(v_codes + i, k, EncodeV16(_mm512_maskz_loadu_ps(k, s_new + i), v_k));
  }
}

}  // namespace
}  // namespace slidedp::moments
