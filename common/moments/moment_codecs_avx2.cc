// AVX2 conversions between FP32 and the compact moments: 8 elements per iteration (16 for the
// BF16 ones and the int8 encoding), the tails with the scalar element functions, which are
// bit-identical. Compiled with -mavx2 -mfma -ffp-contract=off; only called after
// __builtin_cpu_supports("avx2") and ("fma").
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "common/moments/moment_codec_avx2_inl.h"
#include "common/moments/moments.h"

namespace slidedp::moments {
namespace {

// ---- int8 ----

void Int8FromF32(const float* m, const float* v, const Int8Moments& out, int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    alignas(32) float s_new[kInt8MomentBlock];
    __m256i m_abs = _mm256_setzero_si256(), s_abs = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
      const __m256 root = _mm256_sqrt_ps(_mm256_loadu_ps(v + start + i));
      _mm256_store_ps(s_new + i, root);
      m_abs = _mm256_max_epu32(m_abs, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(m + start + i)), abs_mask));
      s_abs = _mm256_max_epu32(s_abs, _mm256_and_si256(_mm256_castps_si256(root), abs_mask));
    }
    uint32_t m_abs_bits = MaxLane(m_abs), s_abs_bits = MaxLane(s_abs);
    for (; i < len; ++i) {
      s_new[i] = std::sqrt(v[start + i]);
      m_abs_bits = std::max(m_abs_bits, FloatBits(m[start + i]) & 0x7fffffffu);
      s_abs_bits = std::max(s_abs_bits, FloatBits(s_new[i]) & 0x7fffffffu);
    }
    const Int8BlockScales b = MakeInt8BlockScales(m_abs_bits, s_abs_bits);
    EncodeBlock(b, m + start, s_new, len, out.m_codes + start, out.v_codes + start);
    out.m_scales[block] = b.m_scale;
    out.v_scales[block] = b.v_scale;
  }
}

void Int8ToF32(const Int8MomentsView& in, float* m, float* v, int64_t n) {
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    const float m_scale = in.m_scales[block];
    const float v_step = Int8VStep(in.v_scales[block]);
    const __m256 m_scale8 = _mm256_set1_ps(m_scale), v_step8 = _mm256_set1_ps(v_step);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
      const int64_t at = start + i;
      _mm256_storeu_ps(m + at, DecodeM8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in.m_codes + at)), m_scale8));
      _mm256_storeu_ps(v + at, DecodeV8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in.v_codes + at)), v_step8));
    }
    for (; i < len; ++i) {
      m[start + i] = DecodeM(in.m_codes[start + i], m_scale);
      v[start + i] = DecodeV(in.v_codes[start + i], v_step);
    }
  }
}

// ---- bf16 ----

void Bf16FromF32(const float* m, const float* v, const Bf16Moments& out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.m + i),
                        Pack16(ToBf16Wide(_mm256_loadu_ps(m + i)), ToBf16Wide(_mm256_loadu_ps(m + i + 8))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.v + i),
                        Pack16(ToBf16Wide(_mm256_loadu_ps(v + i)), ToBf16Wide(_mm256_loadu_ps(v + i + 8))));
  }
  for (; i < n; ++i) {
    out.m[i] = FloatToBf16(m[i]);
    out.v[i] = FloatToBf16(v[i]);
  }
}

void Bf16ToF32(const Bf16MomentsView& in, float* m, float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(m + i, WidenBf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in.m + i))));
    _mm256_storeu_ps(v + i, WidenBf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in.v + i))));
  }
  for (; i < n; ++i) {
    m[i] = Bf16ToFloat(in.m[i]);
    v[i] = Bf16ToFloat(in.v[i]);
  }
}

}  // namespace

namespace internal {
const MomentCodecTable kAvx2MomentCodecs = {
    .int8_from_f32 = &Int8FromF32,
    .int8_to_f32 = &Int8ToF32,
    .bf16_from_f32 = &Bf16FromF32,
    .bf16_to_f32 = &Bf16ToF32,
};
}  // namespace internal

}  // namespace slidedp::moments
