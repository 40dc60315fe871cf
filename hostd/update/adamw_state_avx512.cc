// AVX-512 (F+BW+VL) kernels for BF16 and int8 Adam moments: 16 elements per iteration, masked
// loads/stores for heads and tails, so any length and alignment take the vector path (the checked
// BF16 kernel finishes a group holding a non-finite gradient with the scalar element function).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mfma -ffp-contract=off; only called after
// __builtin_cpu_supports says the CPU has them.
#include <immintrin.h>

#include <cstdint>

#include "common/moments/moment_codec_avx512_inl.h"
#include "hostd/update/adamw_avx512_inl.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_state.h"
#include "hostd/update/adamw_state_element_inl.h"

namespace slidedp::update {
namespace {

// The codec this file steps through (common/moments).
using moments::DecodeM16;
using moments::DecodeV16;
using moments::EncodeBlock;
using moments::FirstLanes;
using moments::Int8BlockScales;
using moments::Int8VStep;
using moments::MakeInt8BlockScales;

inline __m512 LoadBf16(const bf16_t* p, __mmask16 k) { return WidenBf16(_mm256_maskz_loadu_epi16(k, p)); }

// StochasticBf16 on 16 lanes with the random bits in the low 16 of each lane.
inline __m256i ToBf16Stochastic(__m512 x, __m512i bits16) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bits16), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(IsNan(bits), rounded, quiet));
}

enum class RowWrite { kMasked, kStream };

template <RowWrite kWrite>
inline void StoreRow(bf16_t* dst, __m256i row, __mmask16 k) {
  if constexpr (kWrite == RowWrite::kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), row);
  } else {
    _mm256_mask_storeu_epi16(dst, k, row);
  }
}

// Mix32 (lowbias32) on 16 lanes, then the top 16 bits: RoundingBits.
inline __m512i RoundingBits16(__m512i index_lo, __m512i key) {
  __m512i x = _mm512_xor_si512(index_lo, key);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x7feb352du)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  return _mm512_srli_epi32(x, 16);
}

// The lanes of k whose gradient is NaN or inf: |x| >= 0x7f800000 (unsigned).
template <typename G>
inline __mmask16 BadLanes(const G* g, __mmask16 k) {
  const __m512i x = _mm512_and_si512(_mm512_castps_si512(LoadGrad(g, k)), _mm512_set1_epi32(0x7fffffff));
  return _mm512_mask_cmp_epu32_mask(k, x, _mm512_set1_epi32(0x7f800000), _MM_CMPINT_NLT);
}

template <RowWrite kWrite, bool kMirror, typename G>
inline void Int8Row(const Vec512Constants& c, float* master, const int8_t* m_codes, const uint8_t* v_codes,
                    __m512 m_scale, __m512 v_step, bf16_t* mirror, const G* grad, __mmask16 k, float* m_new,
                    float* s_new, __m512i* m_abs, __m512i* s_abs) {
  const Adam16 a = AdamStep16(c, LoadGrad(grad, k), _mm512_maskz_loadu_ps(k, master),
                              DecodeM16(_mm_maskz_loadu_epi8(k, m_codes), m_scale),
                              DecodeV16(_mm_maskz_loadu_epi8(k, v_codes), v_step));
  _mm512_mask_storeu_ps(master, k, a.theta);
  if constexpr (kMirror) StoreRow<kWrite>(mirror, ToBf16(a.theta), k);
  _mm512_store_ps(m_new, a.m);  // the buffers hold 256: a partial row's extra lanes are ignored
  _mm512_store_ps(s_new, a.sqrt_v);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  *m_abs = _mm512_mask_max_epu32(*m_abs, k, *m_abs, _mm512_and_si512(_mm512_castps_si512(a.m), abs_mask));
  *s_abs = _mm512_mask_max_epu32(*s_abs, k, *s_abs, _mm512_and_si512(_mm512_castps_si512(a.sqrt_v), abs_mask));
}

template <bool kMirror, typename G>
void Int8Block(const Vec512Constants& c, float* master, int8_t* m_codes, uint8_t* v_codes, float* m_scale_at,
               float* v_scale_at, bf16_t* mirror, bool stream, const G* grad, int64_t len) {
  const __m512 m_scale = _mm512_set1_ps(*m_scale_at), v_step = _mm512_set1_ps(Int8VStep(*v_scale_at));
  alignas(64) float m_new[kInt8MomentBlock];
  alignas(64) float s_new[kInt8MomentBlock];
  __m512i m_abs = _mm512_setzero_si512(), s_abs = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    if (stream) {
      Int8Row<RowWrite::kStream, kMirror>(c, master + i, m_codes + i, v_codes + i, m_scale, v_step,
                                          kMirror ? mirror + i : nullptr, grad + i, 0xffff, m_new + i, s_new + i,
                                          &m_abs, &s_abs);
    } else {
      Int8Row<RowWrite::kMasked, kMirror>(c, master + i, m_codes + i, v_codes + i, m_scale, v_step,
                                          kMirror ? mirror + i : nullptr, grad + i, 0xffff, m_new + i, s_new + i,
                                          &m_abs, &s_abs);
    }
  }
  if (i < len) {
    Int8Row<RowWrite::kMasked, kMirror>(c, master + i, m_codes + i, v_codes + i, m_scale, v_step,
                                        kMirror ? mirror + i : nullptr, grad + i, FirstLanes(len - i), m_new + i,
                                        s_new + i, &m_abs, &s_abs);
  }
  const Int8BlockScales b = MakeInt8BlockScales(_mm512_reduce_max_epu32(m_abs), _mm512_reduce_max_epu32(s_abs));
  EncodeBlock(b, m_new, s_new, len, m_codes, v_codes);
  *m_scale_at = b.m_scale;
  *v_scale_at = b.v_scale;
}

template <typename G>
int64_t FirstNonFiniteInBlock(const G* grad, int64_t len) {
  for (int64_t i = 0; i < len; i += 16) {
    if (const __mmask16 bad = BadLanes(grad + i, FirstLanes(len - i)); bad != 0) {
      return i + __builtin_ctz(static_cast<unsigned>(bad));
    }
  }
  return -1;
}

template <bool kCheck, bool kMirror, typename G>
int64_t Int8StepImpl(const AdamWConstants& constants, float* master, const Int8Moments& s, bf16_t* mirror,
                     const G* grad, int64_t n) {
  const Vec512Constants c(constants);
  const bool stream = kMirror && constants.stream_mirror && reinterpret_cast<uintptr_t>(mirror) % 32 == 0;
  int64_t stop = -1;
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    if constexpr (kCheck) {
      if (const int64_t bad = FirstNonFiniteInBlock(grad + start, len); bad >= 0) {
        stop = start + bad;
        break;
      }
    }
    Int8Block<kMirror>(c, master + start, s.m_codes + start, s.v_codes + start, s.m_scales + block, s.v_scales + block,
                       kMirror ? mirror + start : nullptr, stream, grad + start, len);
  }
  if (stream) _mm_sfence();
  return stop;
}

template <bool kCheck, typename G>
int64_t Int8Step(const AdamWConstants& c, float* master, const Int8Moments& s, bf16_t* mirror, const G* grad,
                 int64_t n) {
  if (mirror == nullptr) return Int8StepImpl<kCheck, false>(c, master, s, mirror, grad, n);
  return Int8StepImpl<kCheck, true>(c, master, s, mirror, grad, n);
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

template <RowWrite kWrite, bool kMirror, typename G>
inline void Bf16Row(const Vec512Constants& c, float* master, const Bf16Moments& s, bf16_t* mirror, const G* grad,
                    __m512i index_lo, __m512i key, __mmask16 k) {
  const Adam16 a =
      AdamStep16(c, LoadGrad(grad, k), _mm512_maskz_loadu_ps(k, master), LoadBf16(s.m, k), LoadBf16(s.v, k));
  _mm512_mask_storeu_ps(master, k, a.theta);
  if constexpr (kMirror) StoreRow<kWrite>(mirror, ToBf16(a.theta), k);
  _mm256_mask_storeu_epi16(s.m, k, ToBf16(a.m));
  _mm256_mask_storeu_epi16(s.v, k, ToBf16Stochastic(a.v, RoundingBits16(index_lo, key)));
}

// Elements [from, to) of one rounding span (the random bits of element i hash lo + (i - from)).
template <bool kCheck, bool kMirror, typename G>
int64_t Bf16Span(const AdamWConstants& constants, const Vec512Constants& c, float* master, const Bf16Moments& s,
                 bf16_t* mirror, const G* grad, int64_t from, int64_t to, uint32_t key, uint32_t lo) {
  const __m512i key16 = _mm512_set1_epi32(static_cast<int>(key));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto index_at = [&](int64_t i) {
    return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo + static_cast<uint32_t>(i - from))), lane);
  };
  auto at = [&](int64_t i) { return Bf16Moments{s.m + i, s.v + i}; };
  int64_t i = from;
  bool stopped = false;  // kCheck: a non-finite gradient lies at or after i
  const auto addr = reinterpret_cast<uintptr_t>(kMirror ? mirror + from : nullptr);
  if (kMirror && addr % 2 == 0 && constants.stream_mirror) {
    // Head: bring the mirror to a 32-byte boundary so the body can stream whole 32-byte rows.
    const int64_t head = std::min(to - from, static_cast<int64_t>(((32 - addr % 32) % 32) / 2));
    if (head > 0) {
      if (kCheck && BadLanes(grad + i, FirstLanes(head)) != 0) {
        stopped = true;
      } else {
        Bf16Row<RowWrite::kMasked, kMirror>(c, master + i, at(i), mirror + i, grad + i, index_at(i), key16,
                                            FirstLanes(head));
        i += head;
      }
    }
    for (; !stopped && i + 16 <= to; i += 16) {
      if (kCheck && BadLanes(grad + i, 0xffff) != 0) {
        stopped = true;
        break;
      }
      Bf16Row<RowWrite::kStream, kMirror>(c, master + i, at(i), mirror + i, grad + i, index_at(i), key16, 0xffff);
    }
  }
  for (; !stopped && i + 16 <= to; i += 16) {  // cached stores, no mirror, or an odd mirror address
    if (kCheck && BadLanes(grad + i, 0xffff) != 0) {
      stopped = true;
      break;
    }
    Bf16Row<RowWrite::kMasked, kMirror>(c, master + i, at(i), kMirror ? mirror + i : nullptr, grad + i, index_at(i),
                                        key16, 0xffff);
  }
  if constexpr (kCheck) {
    const LerpForm lerp = MakeLerpForm(constants);
    for (; i < to; ++i) {
      const float g = GradAt(grad, i);
      if (IsNonFinite(g)) return i;
      Bf16StateElement(constants, lerp, g, &master[i], &s.m[i], &s.v[i], kMirror ? &mirror[i] : nullptr,
                       RoundingBits(key, lo + static_cast<uint32_t>(i - from)));
    }
  } else if (i < to) {
    Bf16Row<RowWrite::kMasked, kMirror>(c, master + i, at(i), kMirror ? mirror + i : nullptr, grad + i, index_at(i),
                                        key16, FirstLanes(to - i));
  }
  return -1;
}

template <bool kCheck, bool kMirror, typename G>
int64_t Bf16StepImpl(const AdamWConstants& constants, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                     bf16_t* mirror, const G* grad, int64_t n) {
  const Vec512Constants c(constants);
  const int64_t stop = ForEachRoundingSpan(sr, n, [&](int64_t from, int64_t to, uint32_t key, uint32_t lo) {
    return Bf16Span<kCheck, kMirror>(constants, c, master, s, mirror, grad, from, to, key, lo);
  });
  if (kMirror) _mm_sfence();  // order the streaming stores before whoever publishes this range
  return stop;
}

template <bool kCheck, typename G>
int64_t Bf16Step(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                 bf16_t* mirror, const G* grad, int64_t n) {
  if (mirror == nullptr) return Bf16StepImpl<kCheck, false>(c, sr, master, s, mirror, grad, n);
  return Bf16StepImpl<kCheck, true>(c, sr, master, s, mirror, grad, n);
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
const AdamStateStepTable kAvx512StateSteps = {
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
