// Portable scalar AdamW kernels: the fallback and the reference the vector kernels must match
// bit for bit. Compiled with -ffp-contract=off (see CMakeLists.txt).
#include <cstdint>
#include <cstring>

#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {
namespace {

void StepF32(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
             const float* grad, int64_t n) {
  const LerpForm lerp = MakeLerpForm(c);
  for (int64_t i = 0; i < n; ++i)
    AdamElement(c, lerp, grad[i], &master[i], &m[i], &v[i], MirrorAt(mirror, i));
}

void StepBf16(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
              const bf16_t* grad, int64_t n) {
  const LerpForm lerp = MakeLerpForm(c);
  for (int64_t i = 0; i < n; ++i) {
    AdamElement(c, lerp, Bf16ToFloat(grad[i]), &master[i], &m[i], &v[i], MirrorAt(mirror, i));
  }
}

// Four partial sums so the loop is not one long dependency chain.
template <typename Load>
double SumSq(int64_t n, Load load) {
  double acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double x = load(i + k);
      acc[k] += x * x;
    }
  }
  for (; i < n; ++i) {
    const double x = load(i);
    acc[0] += x * x;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

double SumSqF32(const float* g, int64_t n) {
  return SumSq(n, [g](int64_t i) { return static_cast<double>(g[i]); });
}
double SumSqBf16(const bf16_t* g, int64_t n) {
  return SumSq(n, [g](int64_t i) { return static_cast<double>(Bf16ToFloat(g[i])); });
}

int64_t StepF32Checked(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror, const float* grad,
                       int64_t n) {
  return CheckedElements(c, master, m, v, mirror, grad, 0, n);
}
int64_t StepBf16Checked(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror, const bf16_t* grad,
                        int64_t n) {
  return CheckedElements(c, master, m, v, mirror, grad, 0, n);
}

void CopyStream(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

}  // namespace

namespace internal {
const AdamKernelTable kScalarKernels = {&StepF32, &StepBf16, &SumSqF32, &SumSqBf16, &StepF32Checked, &StepBf16Checked,
                                     &CopyStream};
}  // namespace internal

}  // namespace slidedp::update
