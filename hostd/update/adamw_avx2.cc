// AVX2+FMA AdamW kernels: 16 elements per iteration (two 8-lane halves, so the BF16 mirror is one
// 32-byte streaming store); the unaligned head and the tail (< 16 elements) run the scalar element
// function, which is bit-identical. Compiled with -mavx2 -mfma -ffp-contract=off; only called
// after __builtin_cpu_supports("avx2") and ("fma").
#include <immintrin.h>

#include <cstdint>

#include "hostd/update/adamw_avx2_inl.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {
namespace {

// Updates 8 elements and returns the new theta.
template <typename G>
inline __m256 Step8(const Vec256Constants& c, float* master, float* m, float* v, const G* grad) {
  const Adam8 r = AdamStep8(c, LoadGrad8(grad), _mm256_loadu_ps(master), _mm256_loadu_ps(m), _mm256_loadu_ps(v));
  _mm256_storeu_ps(master, r.theta);
  _mm256_storeu_ps(m, r.m);
  _mm256_storeu_ps(v, r.v);
  return r.theta;
}

// Whether any of the 16 gradient elements at g is NaN or inf: |x| as int32 > 0x7f7fffff.
template <typename G>
inline bool Bad16(const G* g) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff);
  const __m256i lo = _mm256_and_si256(_mm256_castps_si256(LoadGrad8(g)), abs_mask);
  const __m256i hi = _mm256_and_si256(_mm256_castps_si256(LoadGrad8(g + 8)), abs_mask);
  const __m256i bad = _mm256_or_si256(_mm256_cmpgt_epi32(lo, max_finite), _mm256_cmpgt_epi32(hi, max_finite));
  return !_mm256_testz_si256(bad, bad);
}

// kCheck: the checked kernel (returns the first non-finite gradient's index, or -1); the vector
// loop stops at the 16 elements holding one and the checked scalar loop finds it.
// kMirror: write the BF16 mirror (else mirror is nullptr: the state keeps none).
template <bool kCheck, bool kMirror, typename G>
int64_t StepImpl(const AdamWConstants& constants, float* master, float* m, float* v, bf16_t* mirror, const G* grad,
                 int64_t n) {
  const Vec256Constants c(constants);
  const LerpForm lerp = MakeLerpForm(constants);
  int64_t i = 0;
  const auto addr = reinterpret_cast<uintptr_t>(mirror);
  const bool stream = kMirror && addr % 2 == 0 && constants.stream_mirror;
  if (stream) {  // scalar head up to the mirror's 32-byte boundary
    int64_t head = static_cast<int64_t>(((32 - addr % 32) % 32) / 2);
    if (head > n) head = n;
    if constexpr (kCheck) {
      if (const int64_t bad = CheckedElements(constants, master, m, v, mirror, grad, 0, head); bad >= 0) return bad;
      i = head;
    } else {
      for (; i < head; ++i) AdamElement(constants, lerp, GradAt(grad, i), &master[i], &m[i], &v[i], MirrorAt(mirror, i));
    }
  }
  for (; i + 16 <= n; i += 16) {
    if constexpr (kCheck) {
      if (Bad16(grad + i)) break;
    }
    const __m256 lo = Step8(c, master + i, m + i, v + i, grad + i);
    const __m256 hi = Step8(c, master + i + 8, m + i + 8, v + i + 8, grad + i + 8);
    if constexpr (!kMirror) continue;
    // packus interleaves 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7]; the permute restores order.
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(ToBf16Wide(lo), ToBf16Wide(hi)), _MM_SHUFFLE(3, 1, 2, 0));
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(mirror + i), packed);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mirror + i), packed);
    }
  }
  if (stream) _mm_sfence();
  if constexpr (kCheck) {
    return CheckedElements(constants, master, m, v, mirror, grad, i, n);
  } else {
    for (; i < n; ++i) AdamElement(constants, lerp, GradAt(grad, i), &master[i], &m[i], &v[i], MirrorAt(mirror, i));
    return -1;
  }
}

template <bool kCheck, typename G>
int64_t Step(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror, const G* grad, int64_t n) {
  if (mirror == nullptr) return StepImpl<kCheck, false>(c, master, m, v, mirror, grad, n);
  return StepImpl<kCheck, true>(c, master, m, v, mirror, grad, n);
}

void StepF32(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
             const float* grad, int64_t n) {
  Step<false>(c, master, m, v, mirror, grad, n);
}
void StepBf16(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
              const bf16_t* grad, int64_t n) {
  Step<false>(c, master, m, v, mirror, grad, n);
}
int64_t StepF32Checked(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror, const float* grad,
                       int64_t n) {
  return Step<true>(c, master, m, v, mirror, grad, n);
}
int64_t StepBf16Checked(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror, const bf16_t* grad,
                        int64_t n) {
  return Step<true>(c, master, m, v, mirror, grad, n);
}

template <typename G>
double SumSqImpl(const G* g, int64_t n) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = LoadGrad8(g + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) {
    const double x = GradAt(g, i);
    sum += x * x;
  }
  return sum;
}

double SumSqF32(const float* g, int64_t n) { return SumSqImpl(g, n); }
double SumSqBf16(const bf16_t* g, int64_t n) { return SumSqImpl(g, n); }

// Streaming copy: unaligned head to a 32-byte boundary of dst, streaming stores, scalar tail.
void CopyStream(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  while (i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31) != 0) {
    dst[i] = src[i];
    ++i;
  }
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
  _mm_sfence();
}

}  // namespace

namespace internal {
const AdamKernelTable kAvx2Kernels = {&StepF32, &StepBf16, &SumSqF32, &SumSqBf16, &StepF32Checked, &StepBf16Checked,
                                     &CopyStream};
}  // namespace internal

}  // namespace slidedp::update
