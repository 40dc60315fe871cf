// AVX-512 pieces shared by adamw_avx512.cc (FP32 moments) and adamw_state_avx512.cc (compact
// moments): the step constants on 16 lanes, masked gradient loads, and the AdamElement arithmetic
// op for op (BF16 widening and rounding: common/moments/bf16_avx512_inl.h). Private to
// hostd/update, included only by files compiled with the AVX-512 flags and -ffp-contract=off;
// internal linkage on purpose (see adamw_element_inl.h).
#pragma once

#include <immintrin.h>

#include "common/moments/bf16_avx512_inl.h"
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

}  // namespace
}  // namespace slidedp::update
