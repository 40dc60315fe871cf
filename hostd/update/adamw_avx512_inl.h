// AVX-512 pieces shared by adamw_avx512.cc (FP32 moments) and adamw_state_avx512.cc (compact
// moments): the step constants on 16 lanes, masked gradient loads, BF16 widening and rounding, and
// the AdamElement arithmetic op for op. Private to hostd/update, included only by files compiled
// with the AVX-512 flags and -ffp-contract=off; internal linkage on purpose (see
// adamw_element_inl.h).
#pragma once

#include <immintrin.h>

#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {
namespace {

struct Vec512Constants {
  __m512 grad_scale, decay, lerp_coeff, b2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
  bool lerp_from_grad;
  explicit Vec512Constants(const AdamWConstants& c) {
    const LerpForm lerp = MakeLerpForm(c);
    grad_scale = _mm512_set1_ps(c.grad_scale);
    decay = _mm512_set1_ps(c.decay);
    lerp_coeff = _mm512_set1_ps(lerp.coeff);
    lerp_from_grad = lerp.from_grad;
    b2 = _mm512_set1_ps(c.b2);
    one_minus_b2 = _mm512_set1_ps(c.one_minus_b2);
    bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
    eps = _mm512_set1_ps(c.eps);
    neg_step_size = _mm512_set1_ps(c.neg_step_size);
  }
};

inline __m512 LoadGrad(const float* g, __mmask16 k) { return _mm512_maskz_loadu_ps(k, g); }
inline __m512 WidenBf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m512 LoadGrad(const bf16_t* g, __mmask16 k) { return WidenBf16(_mm256_maskz_loadu_epi16(k, g)); }
// The AdamElement arithmetic on 16 lanes, op for op (scalar: AdamElement); also sqrt(v).
struct Adam16 {
  __m512 theta, m, v, sqrt_v;
};
inline Adam16 AdamStep16(const Vec512Constants& c, __m512 grad, __m512 theta, __m512 m0, __m512 v0) {
  const __m512 g = _mm512_mul_ps(grad, c.grad_scale);
  __m512 th = _mm512_mul_ps(theta, c.decay);
  const __m512 mm = _mm512_fmadd_ps(c.lerp_coeff, _mm512_sub_ps(g, m0), c.lerp_from_grad ? g : m0);
  const __m512 vv = _mm512_add_ps(_mm512_mul_ps(v0, c.b2), _mm512_mul_ps(_mm512_mul_ps(c.one_minus_b2, g), g));
  const __m512 root = _mm512_sqrt_ps(vv);
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(root, c.bc2_sqrt), c.eps);
  th = _mm512_add_ps(th, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, mm), denom));
  return {th, mm, vv, root};
}

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
}  // namespace slidedp::update
