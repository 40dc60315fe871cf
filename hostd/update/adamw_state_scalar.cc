// Portable scalar kernels for BF16 and int8 Adam moments: the fallback and the reference the
// vector kernels must match bit for bit. Compiled with -ffp-contract=off (see CMakeLists.txt).
#include <cstdint>

#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_state.h"
#include "hostd/update/adamw_state_element_inl.h"

namespace slidedp::update {
namespace {

// The codec this file steps through (common/moments).
using moments::EncodeInt8Elements;
using moments::Int8BlockScales;
using moments::Int8VStep;
using moments::MakeInt8BlockScales;

// ---- int8 ----

// One block of len <= 256 elements: update into stack buffers (tracking the new absmax), then
// requantize with it.
template <typename G>
void Int8Block(const AdamWConstants& c, const LerpForm& lerp, float* master, const Int8Moments& s, int64_t block,
               bf16_t* mirror, const G* grad, int64_t len) {
  const float m_scale = s.m_scales[block];
  const float v_step = Int8VStep(s.v_scales[block]);
  float m_new[kInt8MomentBlock], s_new[kInt8MomentBlock];
  uint32_t m_abs = 0, s_abs = 0;
  for (int64_t i = 0; i < len; ++i) {
    Int8Element(c, lerp, GradAt(grad, i), &master[i], s.m_codes[i], s.v_codes[i], m_scale, v_step,
                mirror == nullptr ? nullptr : &mirror[i], &m_new[i], &s_new[i]);
    m_abs = std::max(m_abs, FloatBits(m_new[i]) & 0x7fffffffu);
    s_abs = std::max(s_abs, FloatBits(s_new[i]) & 0x7fffffffu);
  }
  const Int8BlockScales b = MakeInt8BlockScales(m_abs, s_abs);
  EncodeInt8Elements(b, m_new, s_new, 0, len, s.m_codes, s.v_codes);
  s.m_scales[block] = b.m_scale;
  s.v_scales[block] = b.v_scale;
}

// kCheck: stop before the block holding the first non-finite gradient and return its index.
template <bool kCheck, typename G>
int64_t Int8Step(const AdamWConstants& c, float* master, const Int8Moments& s, bf16_t* mirror, const G* grad,
                 int64_t n) {
  const LerpForm lerp = MakeLerpForm(c);
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    if constexpr (kCheck) {
      if (const int64_t bad = FirstNonFinite(grad + start, 0, len); bad >= 0) return start + bad;
    }
    const Int8Moments at{s.m_codes + start, s.v_codes + start, s.m_scales, s.v_scales};
    Int8Block(c, lerp, master + start, at, block, mirror == nullptr ? nullptr : mirror + start, grad + start, len);
  }
  return -1;
}

void Int8StepF32(const AdamWConstants& c, float* master, const Int8Moments& s, bf16_t* mirror, const float* grad,
                 int64_t n) {
  Int8Step<false>(c, master, s, mirror, grad, n);
}
void Int8StepBf16(const AdamWConstants& c, float* master, const Int8Moments& s, bf16_t* mirror, const bf16_t* grad,
                  int64_t n) {
  Int8Step<false>(c, master, s, mirror, grad, n);
}
int64_t Int8StepF32Checked(const AdamWConstants& c, float* master, const Int8Moments& s, bf16_t* mirror,
                           const float* grad, int64_t n) {
  return Int8Step<true>(c, master, s, mirror, grad, n);
}
int64_t Int8StepBf16Checked(const AdamWConstants& c, float* master, const Int8Moments& s, bf16_t* mirror,
                            const bf16_t* grad, int64_t n) {
  return Int8Step<true>(c, master, s, mirror, grad, n);
}

// ---- bf16 ----

template <bool kCheck, typename G>
int64_t Bf16Step(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                 bf16_t* mirror, const G* grad, int64_t n) {
  const LerpForm lerp = MakeLerpForm(c);
  return ForEachRoundingSpan(sr, n, [&](int64_t from, int64_t to, uint32_t key, uint32_t lo) -> int64_t {
    for (int64_t i = from; i < to; ++i) {
      const float g = GradAt(grad, i);
      if (kCheck && IsNonFinite(g)) return i;
      Bf16StateElement(c, lerp, g, &master[i], &s.m[i], &s.v[i], mirror == nullptr ? nullptr : &mirror[i],
                       RoundingBits(key, lo + static_cast<uint32_t>(i - from)));
    }
    return -1;
  });
}

void Bf16StepF32(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                 bf16_t* mirror, const float* grad, int64_t n) {
  Bf16Step<false>(c, sr, master, s, mirror, grad, n);
}
void Bf16StepBf16(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                  bf16_t* mirror, const bf16_t* grad, int64_t n) {
  Bf16Step<false>(c, sr, master, s, mirror, grad, n);
}
int64_t Bf16StepF32Checked(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                           bf16_t* mirror, const float* grad, int64_t n) {
  return Bf16Step<true>(c, sr, master, s, mirror, grad, n);
}
int64_t Bf16StepBf16Checked(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                            bf16_t* mirror, const bf16_t* grad, int64_t n) {
  return Bf16Step<true>(c, sr, master, s, mirror, grad, n);
}

}  // namespace

namespace internal {
const AdamStateStepTable kScalarStateSteps = {
    .int8_step_f32 = &Int8StepF32,
    .int8_step_bf16 = &Int8StepBf16,
    .int8_step_f32_checked = &Int8StepF32Checked,
    .int8_step_bf16_checked = &Int8StepBf16Checked,
    .bf16_step_f32 = &Bf16StepF32,
    .bf16_step_bf16 = &Bf16StepBf16,
    .bf16_step_f32_checked = &Bf16StepF32Checked,
    .bf16_step_bf16_checked = &Bf16StepBf16Checked,
};
}  // namespace internal

}  // namespace slidedp::update
