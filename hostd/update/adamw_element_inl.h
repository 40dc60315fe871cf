// Per-element AdamW and BF16 rounding shared by every kernel file for its scalar tails.
// Private to hostd/update. Everything here has internal linkage on purpose: each kernel file
// compiles it with its own -m flags, and one shared (inline) definition could let the linker
// hand an AVX-512 copy to the scalar fallback.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/numeric/bf16.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {
namespace {

// ATen's lerp(self=m, end=g, w): for |w| < 0.5 it is fma(w, g - m, m), else fma(w - 1, g - m, g).
struct LerpForm {
  float coeff;
  bool from_grad;
};

[[maybe_unused]] inline LerpForm MakeLerpForm(const AdamWConstants& c) {
  const float w = c.one_minus_b1;
  if (std::fabs(w) < 0.5f) return {w, false};
  return {w - 1.0f, true};
}

// One element of the fused step; see adamw_kernels.h for the formula and its PyTorch source.
// mirror may be nullptr (a state without a BF16 mirror).
[[maybe_unused]] inline void AdamElement(const AdamWConstants& c, const LerpForm& lerp, float grad,
                                         float* theta, float* m, float* v, bf16_t* mirror) {
  const float g = grad * c.grad_scale;
  float th = *theta * c.decay;
  const float mm = std::fma(lerp.coeff, g - *m, lerp.from_grad ? g : *m);
  const float vv = *v * c.b2 + (c.one_minus_b2 * g) * g;
  const float denom = std::sqrt(vv) / c.bc2_sqrt + c.eps;
  th = th + (c.neg_step_size * mm) / denom;
  *theta = th;
  *m = mm;
  *v = vv;
  if (mirror != nullptr) *mirror = FloatToBf16(th);
}

// &mirror[i], or nullptr without a mirror.
[[maybe_unused]] inline bf16_t* MirrorAt(bf16_t* mirror, int64_t i) { return mirror != nullptr ? mirror + i : nullptr; }

[[maybe_unused]] inline bool IsNonFinite(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x7fffffffu) >= 0x7f800000u;
}

template <typename G>
inline float GradAt(const G* g, int64_t i) {
  if constexpr (sizeof(G) == 2) {
    return Bf16ToFloat(g[i]);
  } else {
    return g[i];
  }
}

// The checked kernels' scalar part: elements [from, n) with the check, stopping at a non-finite
// gradient (its index), else -1.
template <typename G>
inline int64_t CheckedElements(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
                               const G* grad, int64_t from, int64_t n) {
  const LerpForm lerp = MakeLerpForm(c);
  for (int64_t i = from; i < n; ++i) {
    const float g = GradAt(grad, i);
    if (IsNonFinite(g)) return i;
    AdamElement(c, lerp, g, &master[i], &m[i], &v[i], MirrorAt(mirror, i));
  }
  return -1;
}

}  // namespace
}  // namespace slidedp::update
