// AVX-512 (F+BW+VL) AdamW kernels: 16 elements per iteration, masked loads/stores for the
// unaligned head and the tail, so any length and alignment take the vector path.
// The mirror is written with streaming stores in the body: it is read next by the GPU's DMA, not
// by this core, and a streaming store skips the read-for-ownership (2 of ~30 bytes/param).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mfma -ffp-contract=off; only called after
// __builtin_cpu_supports says the CPU has them.
#include <immintrin.h>

#include <cstdint>

#include "hostd/update/adamw_avx512_inl.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {
namespace {

enum class MirrorWrite { kMasked, kStream, kNone };

template <MirrorWrite kStore, typename G>
inline void Step16(const Vec512Constants& c, float* master, float* m, float* v, bf16_t* mirror,
                   const G* grad, __mmask16 k) {
  const Adam16 r = AdamStep16(c, LoadGrad(grad, k), _mm512_maskz_loadu_ps(k, master), _mm512_maskz_loadu_ps(k, m),
                              _mm512_maskz_loadu_ps(k, v));
  const __m512 th = r.theta;
  _mm512_mask_storeu_ps(master, k, th);
  _mm512_mask_storeu_ps(m, k, r.m);
  _mm512_mask_storeu_ps(v, k, r.v);
  if constexpr (kStore == MirrorWrite::kNone) return;
  const __m256i b = ToBf16(th);
  if constexpr (kStore == MirrorWrite::kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(mirror), b);
  } else {
    _mm256_mask_storeu_epi16(mirror, k, b);
  }
}

inline __mmask16 FirstLanes(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// The lanes of k whose gradient is NaN or inf: |x| >= 0x7f800000 (unsigned).
template <typename G>
inline __mmask16 BadLanes(const G* g, __mmask16 k) {
  const __m512i x = _mm512_and_si512(_mm512_castps_si512(LoadGrad(g, k)), _mm512_set1_epi32(0x7fffffff));
  return _mm512_mask_cmp_epu32_mask(k, x, _mm512_set1_epi32(0x7f800000), _MM_CMPINT_NLT);
}

// kCheck: the checked kernel (returns the first non-finite gradient's index, or -1); the vector
// loops stop at the 16 elements holding one and the checked scalar loop finds it.
// kMirror: write the BF16 mirror (else mirror is nullptr: the state keeps none).
template <bool kCheck, bool kMirror, typename G>
int64_t StepImpl(const AdamWConstants& constants, float* master, float* m, float* v, bf16_t* mirror, const G* grad,
                 int64_t n) {
  constexpr MirrorWrite kCached = kMirror ? MirrorWrite::kMasked : MirrorWrite::kNone;
  const Vec512Constants c(constants);
  int64_t i = 0;
  bool stopped = false;  // kCheck: a non-finite gradient lies at or after i
  // Head: bring the mirror to a 32-byte boundary so the body can stream whole 32-byte stores.
  const auto addr = reinterpret_cast<uintptr_t>(mirror);
  if (kMirror && addr % 2 == 0 && constants.stream_mirror) {
    int64_t head = static_cast<int64_t>(((32 - addr % 32) % 32) / 2);
    if (head > n) head = n;
    if (head > 0) {
      if (kCheck && BadLanes(grad, FirstLanes(head)) != 0) {
        stopped = true;
      } else {
        Step16<MirrorWrite::kMasked>(c, master, m, v, mirror, grad, FirstLanes(head));
      }
    }
    if (!stopped) {
      i = head;
      for (; i + 16 <= n; i += 16) {
        if (kCheck && BadLanes(grad + i, 0xffff) != 0) {
          stopped = true;
          break;
        }
        Step16<MirrorWrite::kStream>(c, master + i, m + i, v + i, mirror + i, grad + i, 0xffff);
      }
    }
    _mm_sfence();  // order the streaming stores before whoever publishes this range
  }
  for (; !stopped && i + 16 <= n; i += 16) {  // cached stores, no mirror, or an odd mirror address
    if (kCheck && BadLanes(grad + i, 0xffff) != 0) break;
    Step16<kCached>(c, master + i, m + i, v + i, MirrorAt(mirror, i), grad + i, 0xffff);
  }
  if constexpr (kCheck) {
    return CheckedElements(constants, master, m, v, mirror, grad, i, n);
  } else {
    if (i < n) {
      Step16<kCached>(c, master + i, m + i, v + i, MirrorAt(mirror, i), grad + i, FirstLanes(n - i));
    }
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
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 k = (n - i >= 16) ? static_cast<__mmask16>(0xffff) : FirstLanes(n - i);
    const __m512 x = LoadGrad(g + i, k);  // masked-off lanes load as 0
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);  // exact square in double, one rounding in the add
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
}

double SumSqF32(const float* g, int64_t n) { return SumSqImpl(g, n); }
double SumSqBf16(const bf16_t* g, int64_t n) { return SumSqImpl(g, n); }

// Streaming copy: unaligned head to a 64-byte boundary of dst, streaming stores, masked tail.
void CopyStream(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  while (i < n && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0) {
    dst[i] = src[i];
    ++i;
  }
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
  _mm_sfence();
}

}  // namespace

namespace internal {
const AdamKernelTable kAvx512Kernels = {&StepF32, &StepBf16, &SumSqF32, &SumSqBf16, &StepF32Checked, &StepBf16Checked,
                                     &CopyStream};
}  // namespace internal

}  // namespace slidedp::update
