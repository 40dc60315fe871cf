// AVX-512 (F+BW+VL) AdamW kernels: 16 elements per iteration, masked loads/stores for the
// unaligned head and the tail, so any length and alignment take the vector path.
// The mirror is written with streaming stores in the body: it is read next by the GPU's DMA, not
// by this core, and a streaming store skips the read-for-ownership (2 of ~30 bytes/param).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mfma -ffp-contract=off; only called after
// __builtin_cpu_supports says the CPU has them.
#include <immintrin.h>

#include <cstdint>

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

// FloatToBf16 on 16 lanes: round to nearest even, NaN -> quiet NaN with the same sign/payload top.
inline __m256i ToBf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet));
}

inline __m512 LoadGrad(const float* g, __mmask16 k) { return _mm512_maskz_loadu_ps(k, g); }
inline __m512 LoadGrad(const bf16_t* g, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, g);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

enum class MirrorWrite { kMasked, kStream };

template <MirrorWrite kStore, typename G>
inline void Step16(const Vec512Constants& c, float* master, float* m, float* v, bf16_t* mirror,
                   const G* grad, __mmask16 k) {
  const __m512 g = _mm512_mul_ps(LoadGrad(grad, k), c.grad_scale);
  __m512 th = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, master), c.decay);
  const __m512 m0 = _mm512_maskz_loadu_ps(k, m);
  const __m512 mm = _mm512_fmadd_ps(c.lerp_coeff, _mm512_sub_ps(g, m0), c.lerp_from_grad ? g : m0);
  const __m512 vv = _mm512_add_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, v), c.b2),
                                  _mm512_mul_ps(_mm512_mul_ps(c.one_minus_b2, g), g));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), c.bc2_sqrt), c.eps);
  th = _mm512_add_ps(th, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, mm), denom));
  _mm512_mask_storeu_ps(master, k, th);
  _mm512_mask_storeu_ps(m, k, mm);
  _mm512_mask_storeu_ps(v, k, vv);
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
template <bool kCheck, typename G>
int64_t StepImpl(const AdamWConstants& constants, float* master, float* m, float* v, bf16_t* mirror, const G* grad,
                 int64_t n) {
  const Vec512Constants c(constants);
  int64_t i = 0;
  bool stopped = false;  // kCheck: a non-finite gradient lies at or after i
  // Head: bring the mirror to a 32-byte boundary so the body can stream whole 32-byte stores.
  const auto addr = reinterpret_cast<uintptr_t>(mirror);
  if (addr % 2 == 0 && constants.stream_mirror) {
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
  for (; !stopped && i + 16 <= n; i += 16) {  // cached stores, or an odd mirror address
    if (kCheck && BadLanes(grad + i, 0xffff) != 0) break;
    Step16<MirrorWrite::kMasked>(c, master + i, m + i, v + i, mirror + i, grad + i, 0xffff);
  }
  if constexpr (kCheck) {
    return CheckedElements(constants, master, m, v, mirror, grad, i, n);
  } else {
    if (i < n) {
      Step16<MirrorWrite::kMasked>(c, master + i, m + i, v + i, mirror + i, grad + i, FirstLanes(n - i));
    }
    return -1;
  }
}

void StepF32(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
             const float* grad, int64_t n) {
  StepImpl<false>(c, master, m, v, mirror, grad, n);
}
void StepBf16(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
              const bf16_t* grad, int64_t n) {
  StepImpl<false>(c, master, m, v, mirror, grad, n);
}
int64_t StepF32Checked(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror, const float* grad,
                       int64_t n) {
  return StepImpl<true>(c, master, m, v, mirror, grad, n);
}
int64_t StepBf16Checked(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror, const bf16_t* grad,
                        int64_t n) {
  return StepImpl<true>(c, master, m, v, mirror, grad, n);
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
