// AVX2 pieces shared by adamw_avx2.cc (FP32 moments) and adamw_state_avx2.cc (compact moments):
// the step constants on 8 lanes, gradient loads, and the AdamElement arithmetic op for op (BF16
// widening and rounding: common/moments/bf16_avx2_inl.h). Private to hostd/update, included only
// by files compiled with -mavx2 -mfma -ffp-contract=off; internal linkage on purpose (see
// adamw_element_inl.h).
#pragma once

#include <immintrin.h>

#include "common/moments/bf16_avx2_inl.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {
namespace {

struct Vec256Constants {
  __m256 grad_scale, decay, lerp_coeff, b2, one_minus_b2, bc2_sqrt, eps, neg_step_size;
  bool lerp_from_grad;
  explicit Vec256Constants(const AdamWConstants& c) {
    const LerpForm lerp = MakeLerpForm(c);
    grad_scale = _mm256_set1_ps(c.grad_scale);
    decay = _mm256_set1_ps(c.decay);
    lerp_coeff = _mm256_set1_ps(lerp.coeff);
    lerp_from_grad = lerp.from_grad;
    b2 = _mm256_set1_ps(c.b2);
    one_minus_b2 = _mm256_set1_ps(c.one_minus_b2);
    bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
    eps = _mm256_set1_ps(c.eps);
    neg_step_size = _mm256_set1_ps(c.neg_step_size);
  }
};

inline __m256 LoadGrad8(const float* g) { return _mm256_loadu_ps(g); }
inline __m256 LoadGrad8(const bf16_t* g) {
  return WidenBf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
}

// The AdamElement arithmetic on 8 lanes, op for op (scalar: AdamElement); also returns sqrt(v).
struct Adam8 {
  __m256 theta, m, v, sqrt_v;
};
inline Adam8 AdamStep8(const Vec256Constants& c, __m256 grad, __m256 theta, __m256 m0, __m256 v0) {
  const __m256 g = _mm256_mul_ps(grad, c.grad_scale);
  __m256 th = _mm256_mul_ps(theta, c.decay);
  const __m256 mm = _mm256_fmadd_ps(c.lerp_coeff, _mm256_sub_ps(g, m0), c.lerp_from_grad ? g : m0);
  const __m256 vv = _mm256_add_ps(_mm256_mul_ps(v0, c.b2), _mm256_mul_ps(_mm256_mul_ps(c.one_minus_b2, g), g));
  const __m256 root = _mm256_sqrt_ps(vv);
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(root, c.bc2_sqrt), c.eps);
  th = _mm256_add_ps(th, _mm256_div_ps(_mm256_mul_ps(c.neg_step_size, mm), denom));
  return {th, mm, vv, root};
}

}  // namespace
}  // namespace slidedp::update
