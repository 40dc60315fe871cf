// AVX2+FMA kernels for BF16 and int8 Adam moments: the BF16 kernel does 16 elements per
// iteration (two 8-lane halves, so each 16-element BF16 row is one 32-byte store), the int8
// kernel's update 8 (its decode needs more registers) and its requantization 16; the tails (and
// the BF16 kernel's head up to the mirror's 32-byte boundary) run the scalar element functions,
// which are bit-identical. Compiled with -mavx2 -mfma -ffp-contract=off; only called after
// __builtin_cpu_supports("avx2") and ("fma").
#include <immintrin.h>

#include <cstdint>

#include "hostd/update/adamw_avx2_inl.h"
#include "hostd/update/adamw_element_inl.h"
#include "hostd/update/adamw_state.h"
#include "hostd/update/adamw_state_element_inl.h"

namespace slidedp::update {
namespace {

// StochasticBf16 on 8 lanes with the random bits in the low 16 of each lane.
inline __m256i ToBf16StochasticWide(__m256 x, __m256i bits16) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bits16), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

// Two 8-lane halves of 16-bit values (low half of each lane) -> 16 ordered uint16.
inline __m256i Pack16(__m256i lo, __m256i hi) {
  // packus interleaves 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7]; the permute restores order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), _MM_SHUFFLE(3, 1, 2, 0));
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

// ---- int8 codes ----

// DecodeM on 8 lanes from 8 int8 codes in the low 8 bytes of `codes`.
inline __m256 DecodeM8(__m128i codes, __m256 m_scale) {
  const __m256i c = _mm256_cvtepi8_epi32(codes);
  const __m256i mag = _mm256_abs_epi32(c);
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(kMCodeOffset)), kMCodeShift);
  const __m256i unit = _mm256_and_si256(bits, _mm256_cmpgt_epi32(mag, _mm256_setzero_si256()));
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(unit), m_scale);
  const __m256i sign = _mm256_and_si256(c, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_xor_ps(value, _mm256_castsi256_ps(sign));
}

// DecodeV on 8 lanes from 8 uint8 codes in the low 8 bytes of `codes`.
inline __m256 DecodeV8(__m128i codes, __m256 v_step) {
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  const __m256 s = _mm256_mul_ps(_mm256_mul_ps(q, q), v_step);
  return _mm256_mul_ps(s, s);
}

// EncodeM on 8 lanes: int32 codes in [-127, 127].
inline __m256i EncodeM8(__m256 x, __m256 m_inv) {
  const __m256i xb = _mm256_castps_si256(x);
  const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(xb, _mm256_set1_epi32(0x7fffffff)));
  const __m256i rb = _mm256_castps_si256(_mm256_mul_ps(a, m_inv));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(rb, kMCodeShift), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(rb, _mm256_set1_epi32((1 << (kMCodeShift - 1)) - 1)), lsb), kMCodeShift);
  const __m256i c = _mm256_min_epi32(
      _mm256_max_epi32(_mm256_sub_epi32(rounded, _mm256_set1_epi32(kMCodeOffset)), _mm256_setzero_si256()),
      _mm256_set1_epi32(kMCodeMax));
  const __m256i sign = _mm256_srai_epi32(xb, 31);
  return _mm256_sub_epi32(_mm256_xor_si256(c, sign), sign);
}

// EncodeV on 8 lanes: int32 codes in [0, 255]. (An rsqrt guess with an exact nearest-root test
// instead of the sqrt was 15% slower on a Zen 3 core: more instructions than the sqrt costs.)
inline __m256i EncodeV8(__m256 s, __m256 v_k) {
  const __m256i rounded = _mm256_cvtps_epi32(_mm256_sqrt_ps(_mm256_mul_ps(s, v_k)));
  const __m256i floor =
      _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ)), _mm256_set1_epi32(1));
  return _mm256_max_epi32(_mm256_min_epi32(rounded, _mm256_set1_epi32(kVCodeMax)), floor);
}

inline uint32_t MaxLane(__m256i x) {
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
  uint32_t out = 0;
  for (uint32_t l : lanes) out = std::max(out, l);
  return out;
}

// Codes of a block from its new m and sqrt(v); len <= 256.
void EncodeBlock(const Int8BlockScales& b, const float* m_new, const float* s_new, int64_t len, int8_t* m_codes,
                 uint8_t* v_codes) {
  if (b.m_poisoned || b.v_poisoned) {  // rare: the scalar encoder writes the zero codes
    EncodeInt8Elements(b, m_new, s_new, 0, len, m_codes, v_codes);
    return;
  }
  const __m256 m_inv = _mm256_set1_ps(b.m_inv), v_k = _mm256_set1_ps(b.v_k);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m256i m16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(EncodeM8(_mm256_loadu_ps(m_new + i), m_inv),
                                                                    EncodeM8(_mm256_loadu_ps(m_new + i + 8), m_inv)),
                                                 _MM_SHUFFLE(3, 1, 2, 0));
    const __m256i v16 =
        Pack16(EncodeV8(_mm256_loadu_ps(s_new + i), v_k), EncodeV8(_mm256_loadu_ps(s_new + i + 8), v_k));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m_codes + i),
                     _mm_packs_epi16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v_codes + i),
                     _mm_packus_epi16(_mm256_castsi256_si128(v16), _mm256_extracti128_si256(v16, 1)));
  }
  EncodeInt8Elements(b, m_new, s_new, i, len, m_codes, v_codes);
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

void Int8FromF32(const float* m, const float* v, const Int8Moments& out, int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    alignas(32) float s_new[kInt8MomentBlock];
    __m256i m_abs = _mm256_setzero_si256(), s_abs = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
      const __m256 root = _mm256_sqrt_ps(_mm256_loadu_ps(v + start + i));
      _mm256_store_ps(s_new + i, root);
      m_abs = _mm256_max_epu32(m_abs, _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(m + start + i)), abs_mask));
      s_abs = _mm256_max_epu32(s_abs, _mm256_and_si256(_mm256_castps_si256(root), abs_mask));
    }
    uint32_t m_abs_bits = MaxLane(m_abs), s_abs_bits = MaxLane(s_abs);
    for (; i < len; ++i) {
      s_new[i] = std::sqrt(v[start + i]);
      m_abs_bits = std::max(m_abs_bits, FloatBits(m[start + i]) & 0x7fffffffu);
      s_abs_bits = std::max(s_abs_bits, FloatBits(s_new[i]) & 0x7fffffffu);
    }
    const Int8BlockScales b = MakeInt8BlockScales(m_abs_bits, s_abs_bits);
    EncodeBlock(b, m + start, s_new, len, out.m_codes + start, out.v_codes + start);
    out.m_scales[block] = b.m_scale;
    out.v_scales[block] = b.v_scale;
  }
}

void Int8ToF32(const Int8MomentsView& in, float* m, float* v, int64_t n) {
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    const float m_scale = in.m_scales[block];
    const float v_step = Int8VStep(in.v_scales[block]);
    const __m256 m_scale8 = _mm256_set1_ps(m_scale), v_step8 = _mm256_set1_ps(v_step);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
      const int64_t at = start + i;
      _mm256_storeu_ps(m + at, DecodeM8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in.m_codes + at)), m_scale8));
      _mm256_storeu_ps(v + at, DecodeV8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in.v_codes + at)), v_step8));
    }
    for (; i < len; ++i) {
      m[start + i] = DecodeM(in.m_codes[start + i], m_scale);
      v[start + i] = DecodeV(in.v_codes[start + i], v_step);
    }
  }
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

void Bf16FromF32(const float* m, const float* v, const Bf16Moments& out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.m + i),
                        Pack16(ToBf16Wide(_mm256_loadu_ps(m + i)), ToBf16Wide(_mm256_loadu_ps(m + i + 8))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.v + i),
                        Pack16(ToBf16Wide(_mm256_loadu_ps(v + i)), ToBf16Wide(_mm256_loadu_ps(v + i + 8))));
  }
  for (; i < n; ++i) {
    out.m[i] = FloatToBf16(m[i]);
    out.v[i] = FloatToBf16(v[i]);
  }
}

void Bf16ToF32(const Bf16MomentsView& in, float* m, float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(m + i, WidenBf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in.m + i))));
    _mm256_storeu_ps(v + i, WidenBf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in.v + i))));
  }
  for (; i < n; ++i) {
    m[i] = Bf16ToFloat(in.m[i]);
    v[i] = Bf16ToFloat(in.v[i]);
  }
}

}  // namespace

namespace internal {
const AdamStateKernelTable kAvx2StateKernels = {
    .int8_step_f32 = &Int8StepF32,
    .int8_step_bf16 = &Int8StepBf16,
    .int8_step_f32_checked = &Int8StepF32Checked,
    .int8_step_bf16_checked = &Int8StepBf16Checked,
    .bf16_step_f32 = &Bf16StepF32,
    .bf16_step_bf16 = &Bf16StepBf16,
    .bf16_step_f32_checked = &Bf16StepF32Checked,
    .bf16_step_bf16_checked = &Bf16StepBf16Checked,
    .int8_from_f32 = &Int8FromF32,
    .int8_to_f32 = &Int8ToF32,
    .bf16_from_f32 = &Bf16FromF32,
    .bf16_to_f32 = &Bf16ToF32,
};
}  // namespace internal

}  // namespace slidedp::update
