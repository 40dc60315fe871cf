// FloatToBf16 and Bf16ToFloat (common/numeric/bf16.h) on 8 AVX2 lanes, bit for bit: the bf16
// moments' codec (moment_codecs_avx2.cc) and the AdamW kernels' BF16 mirror and moments
// (hostd/update) round with them. Included only by files compiled with -mavx2 -mfma
// -ffp-contract=off; internal linkage on purpose: one shared (inline) definition could let the
// linker hand an AVX2 copy to a file built for any x86-64.
#pragma once

#include <immintrin.h>

#include "common/numeric/bf16.h"

namespace slidedp {
namespace {

inline __m256 WidenBf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

// FloatToBf16 on 8 lanes, result in the low 16 bits of each 32-bit lane.
inline __m256i ToBf16Wide(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

// Two 8-lane halves of 16-bit values (low half of each lane) -> 16 ordered uint16.
inline __m256i Pack16(__m256i lo, __m256i hi) {
  // packus interleaves 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7]; the permute restores order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0));
}

}  // namespace
}  // namespace slidedp
