// AVX-512 (F+BW+VL) conversions between FP32 and the compact moments: 16 elements per iteration,
// masked loads and stores for the tails. Compiled with -mavx512f -mavx512bw -mavx512vl -mfma
// -ffp-contract=off; only called after __builtin_cpu_supports says the CPU has them.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "common/moments/moment_codec_avx512_inl.h"
#include "common/moments/moments.h"

namespace slidedp::moments {
namespace {

// ---- int8 ----

void Int8FromF32(const float* m, const float* v, const Int8Moments& out, int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    alignas(64) float s_new[kInt8MomentBlock];
    __m512i m_abs = _mm512_setzero_si512(), s_abs = _mm512_setzero_si512();
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = FirstLanes(len - i);
      const __m512 root = _mm512_sqrt_ps(_mm512_maskz_loadu_ps(k, v + start + i));
      _mm512_store_ps(s_new + i, root);
      const __m512i mb = _mm512_and_si512(_mm512_castps_si512(_mm512_maskz_loadu_ps(k, m + start + i)), abs_mask);
      m_abs = _mm512_mask_max_epu32(m_abs, k, m_abs, mb);
      s_abs = _mm512_mask_max_epu32(s_abs, k, s_abs, _mm512_and_si512(_mm512_castps_si512(root), abs_mask));
    }
    const Int8BlockScales b = MakeInt8BlockScales(_mm512_reduce_max_epu32(m_abs), _mm512_reduce_max_epu32(s_abs));
    EncodeBlock(b, m + start, s_new, len, out.m_codes + start, out.v_codes + start);
    out.m_scales[block] = b.m_scale;
    out.v_scales[block] = b.v_scale;
  }
}

void Int8ToF32(const Int8MomentsView& in, float* m, float* v, int64_t n) {
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    const __m512 m_scale = _mm512_set1_ps(in.m_scales[block]);
    const __m512 v_step = _mm512_set1_ps(Int8VStep(in.v_scales[block]));
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = FirstLanes(len - i);
      const int64_t at = start + i;
      _mm512_mask_storeu_ps(m + at, k, DecodeM16(_mm_maskz_loadu_epi8(k, in.m_codes + at), m_scale));
      _mm512_mask_storeu_ps(v + at, k, DecodeV16(_mm_maskz_loadu_epi8(k, in.v_codes + at), v_step));
    }
  }
}

// ---- bf16 ----

void Bf16FromF32(const float* m, const float* v, const Bf16Moments& out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = FirstLanes(n - i);
    _mm256_mask_storeu_epi16(out.m + i, k, ToBf16(_mm512_maskz_loadu_ps(k, m + i)));
    _mm256_mask_storeu_epi16(out.v + i, k, ToBf16(_mm512_maskz_loadu_ps(k, v + i)));
  }
}

void Bf16ToF32(const Bf16MomentsView& in, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = FirstLanes(n - i);
    _mm512_mask_storeu_ps(m + i, k, WidenBf16(_mm256_maskz_loadu_epi16(k, in.m + i)));
    _mm512_mask_storeu_ps(v + i, k, WidenBf16(_mm256_maskz_loadu_epi16(k, in.v + i)));
  }
}

}  // namespace

namespace internal {
const MomentCodecTable kAvx512MomentCodecs = {
    .int8_from_f32 = &Int8FromF32,
    .int8_to_f32 = &Int8ToF32,
    .bf16_from_f32 = &Bf16FromF32,
    .bf16_to_f32 = &Bf16ToF32,
};
}  // namespace internal

}  // namespace slidedp::moments
