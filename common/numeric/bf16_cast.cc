// FP32 -> BF16 casts on scalar, AVX2 and AVX-512; see bf16_cast.h.
#include "common/numeric/bf16_cast.h"

#include <immintrin.h>

namespace slidedp {
namespace {

void CastScalar(const float* in, bf16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(in[i]);
}

// Per lane, as FloatToBf16: (x + 0x7fff + bit 16 of x) >> 16, or (x >> 16) | 0x40 for a NaN.
__attribute__((target("avx512f"))) void CastAvx512(const float* in, bf16_t* out, int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000),
                bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i x = _mm512_loadu_si512(in + i);
    const __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_and_si512(hi, one)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs_mask), inf);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, quiet));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(r));
  }
  CastScalar(in + i, out + i, n - i);
}

// Eight lanes; the NaN test is a signed compare, which is exact here: |x| has a clear sign bit.
__attribute__((target("avx2"))) void CastAvx2(const float* in, bf16_t* out, int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000),
                bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    const __m256i hi = _mm256_srli_epi32(x, 16);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_and_si256(hi, one)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
    const __m256i v = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), nan);
    // Every lane is below 0x10000: an unsigned-saturating pack keeps it; the pack works within
    // 128-bit halves, so the 64-bit quarters come out in the order 0, 2, 1, 3.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
  CastScalar(in + i, out + i, n - i);
}

bool Has(CastIsa isa) {
  switch (isa) {
    case CastIsa::kScalar: return true;
    case CastIsa::kAvx2: return __builtin_cpu_supports("avx2");
    case CastIsa::kAvx512: return __builtin_cpu_supports("avx512f");
  }
  return false;
}

}  // namespace

bool CastF32ToBf16On(CastIsa isa, const float* in, bf16_t* out, int64_t n) {
  if (!Has(isa)) return false;
  switch (isa) {
    case CastIsa::kScalar: CastScalar(in, out, n); break;
    case CastIsa::kAvx2: CastAvx2(in, out, n); break;
    case CastIsa::kAvx512: CastAvx512(in, out, n); break;
  }
  return true;
}

void CastF32ToBf16(const float* in, bf16_t* out, int64_t n) {
  static const CastIsa best = Has(CastIsa::kAvx512) ? CastIsa::kAvx512
                              : Has(CastIsa::kAvx2) ? CastIsa::kAvx2
                                                    : CastIsa::kScalar;
  CastF32ToBf16On(best, in, out, n);
}

}  // namespace slidedp
