// FloatToBf16 and Bf16ToFloat (common/numeric/bf16.h) on 16 AVX-512 lanes, bit for bit: the bf16
// moments' codec (moment_codecs_avx512.cc) and the AdamW kernels' BF16 mirror and moments
// (hostd/update) round with them. Included only by files compiled with the AVX-512 flags and
// -ffp-contract=off; internal linkage on purpose (see bf16_avx2_inl.h).
#pragma once

#include <immintrin.h>

#include "common/numeric/bf16.h"

namespace slidedp {
namespace {

inline __m512 WidenBf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

inline __mmask16 IsNan(__m512i bits) {
  return _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
}

// FloatToBf16 on 16 lanes.
inline __m256i ToBf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(IsNan(bits), rounded, quiet));
}

}  // namespace
}  // namespace slidedp
