// AVX2+FMA kernels for BF16 and int8 Adam moments: the BF16 kernel does 16 elements per
// iteration (two 8-lane halves, so each 16-element BF16 row is one 32-byte store), the int8
// kernel's update 8 (its decode needs more registers) and its requantization 16; the tails (and
// the BF16 kernel's head up to the mirror's 32-byte boundary) run the scalar element functions,
// which are bit-identical. Compiled with -mavx2 -mfma -ffp-contract=off; only called after
// __builtin_cpu_supports("avx2") and ("fma").
#include <immintrin.h>

#include <cstdint>

#include "common/moments/moment_codec_avx2_inl.h"
#include "hostd/update/adamw_avx2_inl.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_state.h"
#include "hostd/update/adamw_state_element_inl.h"

namespace slidedp::update {
namespace {

// The codec this file steps through (common/moments).
using moments::DecodeM8;
using moments::DecodeV8;
using moments::EncodeBlock;
using moments::Int8BlockScales;
using moments::Int8VStep;
using moments::MakeInt8BlockScales;
using moments::MaxLane;

// StochasticBf16 on 8 lanes with the random bits in the low 16 of each lane.
inline __m256i ToBf16StochasticWide(__m256 x, __m256i bits16) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bits16), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

inline void StoreRow16(bf16_t* dst, __m256i packed, bool stream) {
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), packed);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
  }
}

// 8 BF16 values (low halves of the lanes) packed into 16 bytes.
inline __m128i Pack8(__m256i wide) {
  return _mm_packus_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1));
}

// Mix32 (lowbias32) on 8 lanes, then the top 16 bits: RoundingBits.
inline __m256i RoundingBits8(__m256i index_lo, __m256i key) {
  __m256i x = _mm256_xor_si256(index_lo, key);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x7feb352du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  return _mm256_srli_epi32(x, 16);
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

// The int8 kernel streams 32-byte mirror rows when the range's mirror starts on a 32-byte boundary
// (every block then does: 256 elements are 512 bytes); otherwise it uses ordinary stores.
inline bool StreamMirror(const AdamWConstants& c, const bf16_t* mirror) {
  return mirror != nullptr && c.stream_mirror && reinterpret_cast<uintptr_t>(mirror) % 32 == 0;
}

// One block of len <= 256 elements at its start (codes, master, mirror, grad all at the block's
// first element): update into stack buffers, tracking the absmax, then requantize.
template <bool kMirror, typename G>
void Int8Block(const AdamWConstants& constants, const Vec256Constants& c, float* master, int8_t* m_codes,
               uint8_t* v_codes, float* m_scale_at, float* v_scale_at, bf16_t* mirror, bool stream, const G* grad,
               int64_t len) {
  const float m_scale = *m_scale_at;
  const float v_step = Int8VStep(*v_scale_at);
  const __m256 m_scale8 = _mm256_set1_ps(m_scale), v_step8 = _mm256_set1_ps(v_step);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  alignas(32) float m_new[kInt8MomentBlock];
  alignas(32) float s_new[kInt8MomentBlock];
  __m256i m_abs = _mm256_setzero_si256(), s_abs = _mm256_setzero_si256();
  int64_t i = 0;
  // 8 elements per iteration, not 16: with 16 the live values spill out of the 16 ymm registers
  // (14% slower on a Zen 3 core in L2). A streamed mirror is staged in `rows` and written as
  // whole 32-byte rows after the loop: 16-byte streaming stores spread over the loop left partial
  // write-combining lines (the kernel ran ~30% slower than without a mirror).
  alignas(32) bf16_t rows[kInt8MomentBlock];
  bf16_t* const mirror_out = stream ? rows : mirror;
  for (; i + 8 <= len; i += 8) {
    const Adam8 a = AdamStep8(c, LoadGrad8(grad + i), _mm256_loadu_ps(master + i),
                              DecodeM8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m_codes + i)), m_scale8),
                              DecodeV8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v_codes + i)), v_step8));
    _mm256_storeu_ps(master + i, a.theta);
    if constexpr (kMirror) _mm_storeu_si128(reinterpret_cast<__m128i*>(mirror_out + i), Pack8(ToBf16Wide(a.theta)));
    _mm256_store_ps(m_new + i, a.m);
    _mm256_store_ps(s_new + i, a.sqrt_v);
    m_abs = _mm256_max_epu32(m_abs, _mm256_and_si256(_mm256_castps_si256(a.m), abs_mask));
    s_abs = _mm256_max_epu32(s_abs, _mm256_and_si256(_mm256_castps_si256(a.sqrt_v), abs_mask));
  }
  if (kMirror && stream) {
    int64_t r = 0;
    for (; r + 16 <= i; r += 16) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(mirror + r),
                          _mm256_load_si256(reinterpret_cast<const __m256i*>(rows + r)));
    }
    for (; r < i; ++r) mirror[r] = rows[r];
  }
  uint32_t m_abs_bits = MaxLane(m_abs), s_abs_bits = MaxLane(s_abs);
  const LerpForm lerp = MakeLerpForm(constants);
  for (; i < len; ++i) {
    Int8Element(constants, lerp, GradAt(grad, i), &master[i], m_codes[i], v_codes[i], m_scale, v_step,
                kMirror ? &mirror[i] : nullptr, &m_new[i], &s_new[i]);
    m_abs_bits = std::max(m_abs_bits, FloatBits(m_new[i]) & 0x7fffffffu);
    s_abs_bits = std::max(s_abs_bits, FloatBits(s_new[i]) & 0x7fffffffu);
  }
  const Int8BlockScales b = MakeInt8BlockScales(m_abs_bits, s_abs_bits);
  EncodeBlock(b, m_new, s_new, len, m_codes, v_codes);
  *m_scale_at = b.m_scale;
  *v_scale_at = b.v_scale;
}

template <typename G>
int64_t FirstNonFiniteInBlock(const G* grad, int64_t len) {
  int64_t i = 0;
  while (i + 16 <= len && !Bad16(grad + i)) i += 16;
  return FirstNonFinite(grad, i, len);
}

template <bool kCheck, bool kMirror, typename G>
int64_t Int8StepImpl(const AdamWConstants& constants, float* master, const Int8Moments& s, bf16_t* mirror,
                     const G* grad, int64_t n) {
  const Vec256Constants c(constants);
  const bool stream = StreamMirror(constants, mirror);
  int64_t stop = -1;
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    if constexpr (kCheck) {
      if (const int64_t bad = FirstNonFiniteInBlock(grad + start, len); bad >= 0) {
        stop = start + bad;
        break;
      }
    }
    Int8Block<kMirror>(constants, c, master + start, s.m_codes + start, s.v_codes + start, s.m_scales + block,
                       s.v_scales + block, kMirror ? mirror + start : nullptr, stream, grad + start, len);
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

// Elements [from, to) of one rounding span (the random bits of element i hash lo + (i - from)).
template <bool kCheck, bool kMirror, typename G>
int64_t Bf16Span(const AdamWConstants& constants, const Vec256Constants& c, float* master, const Bf16Moments& s,
                 bf16_t* mirror, bool stream, const G* grad, int64_t from, int64_t to, uint32_t key, uint32_t lo) {
  const LerpForm lerp = MakeLerpForm(constants);
  auto scalar = [&](int64_t i) {
    Bf16StateElement(constants, lerp, GradAt(grad, i), &master[i], &s.m[i], &s.v[i], kMirror ? &mirror[i] : nullptr,
                     RoundingBits(key, lo + static_cast<uint32_t>(i - from)));
  };
  int64_t i = from;
  if (stream) {  // scalar head up to the mirror's 32-byte boundary
    const int64_t head =
        std::min(to, from + static_cast<int64_t>(((32 - reinterpret_cast<uintptr_t>(mirror + from) % 32) % 32) / 2));
    for (; i < head; ++i) {
      if (kCheck && IsNonFinite(GradAt(grad, i))) return i;
      scalar(i);
    }
  }
  const __m256i key8 = _mm256_set1_epi32(static_cast<int>(key));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; i + 16 <= to; i += 16) {
    if constexpr (kCheck) {
      if (Bad16(grad + i)) break;
    }
    const __m128i m_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.m + i));
    const __m128i m_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.m + i + 8));
    const __m128i v_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.v + i));
    const __m128i v_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.v + i + 8));
    const Adam8 a =
        AdamStep8(c, LoadGrad8(grad + i), _mm256_loadu_ps(master + i), WidenBf16x8(m_lo), WidenBf16x8(v_lo));
    const Adam8 b =
        AdamStep8(c, LoadGrad8(grad + i + 8), _mm256_loadu_ps(master + i + 8), WidenBf16x8(m_hi), WidenBf16x8(v_hi));
    _mm256_storeu_ps(master + i, a.theta);
    _mm256_storeu_ps(master + i + 8, b.theta);
    if constexpr (kMirror) StoreRow16(mirror + i, Pack16(ToBf16Wide(a.theta), ToBf16Wide(b.theta)), stream);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.m + i), Pack16(ToBf16Wide(a.m), ToBf16Wide(b.m)));
    const __m256i index =
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo + static_cast<uint32_t>(i - from))), lane);
    const __m256i r_lo = RoundingBits8(index, key8);
    const __m256i r_hi = RoundingBits8(_mm256_add_epi32(index, _mm256_set1_epi32(8)), key8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.v + i),
                        Pack16(ToBf16StochasticWide(a.v, r_lo), ToBf16StochasticWide(b.v, r_hi)));
  }
  for (; i < to; ++i) {
    if (kCheck && IsNonFinite(GradAt(grad, i))) return i;
    scalar(i);
  }
  return -1;
}

template <bool kCheck, bool kMirror, typename G>
int64_t Bf16StepImpl(const AdamWConstants& constants, const StochasticRounding& sr, float* master, const Bf16Moments& s,
                     bf16_t* mirror, const G* grad, int64_t n) {
  const Vec256Constants c(constants);
  // Streaming needs the mirror's rows to reach a 32-byte boundary: an even address.
  const bool stream = kMirror && constants.stream_mirror && reinterpret_cast<uintptr_t>(mirror) % 2 == 0;
  const int64_t stop = ForEachRoundingSpan(sr, n, [&](int64_t from, int64_t to, uint32_t key, uint32_t lo) {
    return Bf16Span<kCheck, kMirror>(constants, c, master, s, mirror, stream, grad, from, to, key, lo);
  });
  if (stream) _mm_sfence();
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
const AdamStateStepTable kAvx2StateSteps = {
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
