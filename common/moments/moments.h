// Compact Adam moments (issue 21): m and v held as BF16 or as block-quantized 8-bit codes instead
// of FP32 (the FP32 master stays exact; only the two moments shrink: 8 B/param of state become 4
// (bf16) or 2.03 (int8)), the types that point at a range of them, and the conversions from and
// to FP32. docs/optimizer-state.md has the layouts, why these code maps and roundings, and the
// measured drift against FP32 state.
//
// The conversions are the codec of LayerAdam's compact-moment kernels (hostd/update/adamw_state.h
// steps them: decode, AdamW, encode): a checkpoint loaded into a job of another state dtype
// (checkpoint/) converts with them, so a converted state is what the kernels would make. The
// scalar, AVX2 and AVX-512 tables compile with -ffp-contract=off and give identical bits.
//
// Layouts (n elements):
//   bf16: m[n], v[n] as bf16_t. FP32 -> bf16 here rounds both to nearest even (one rounding,
//         not a running EMA: nothing to stagnate); the kernels round v stochastically
//         (adamw_state.h).
//   int8: blocks of kInt8MomentBlock = 256 consecutive elements; per block two FP32 scales in
//         separate arrays (Int8MomentBlocks(n) each, the last block may be partial):
//           m_scale[b] = max |m| over the block; m_code[i] int8 in [-127, 127]: the sign and a
//                        7-bit magnitude c on a float grid with 3 mantissa bits, m = +-m_scale *
//                        bits_to_float((c + 889) << 20) (relative spacing 1/16..1/8, c = 127 is
//                        1.0, c = 1 is 1.25 * 2^-16), c = 0 is zero (|m| below ~2^-16 of the
//                        block maximum flushes to 0);
//           v_scale[b] = max sqrt(v) over the block; v_code[i] uint8: q = 255 * (sqrt(v) /
//                        v_scale)^(1/2), so v = v_scale^2 * (q/255)^4: a power map, finer near the
//                        block maximum, 9.6 decades of v below it. A non-zero v never encodes as 0
//                        (q >= 1): a zero denominator would turn m into m/eps. Decoded in FP32 as
//                        ((q*q) * f32(v_scale / 255^2))^2.
//         Rounding is to nearest, ties to even (m on its float grid; v of q computed in FP32
//         with the correctly rounded sqrt): deterministic. A block is encoded as a whole, with
//         the absmax of its values.
//
// Ranges: an int8 range starts at a block boundary of the arrays it is given (element 0 of the
// range is code 0 and scale 0 of the pointers passed; Int8MomentsAt advances them); any length,
// the last block may be partial. A block must not be split between two calls: each call computes
// the scale of every block it touches from the elements it is given, so callers split work at
// multiples of 256 elements. BF16 ranges have no alignment rule. All conversions take any pointer
// alignment and are thread-safe on disjoint ranges.
//
// Non-finite values: a NaN or inf among a block's m (or sqrt(v)) poisons that block: its scale
// becomes NaN and its codes 0, so every element of the block decodes as NaN.
#pragma once

#include <cstdint>

#include "common/moments/adam_isa.h"
#include "common/numeric/bf16.h"
#include "common/numeric/dtype.h"

namespace slidedp::moments {

// One range of int8 moments: codes for its n elements and scales for its Int8MomentBlocks(n)
// blocks; element 0 of the range is the first element of block 0.
struct Int8Moments {
  int8_t* m_codes;
  uint8_t* v_codes;
  float* m_scales;
  float* v_scales;
};
struct Int8MomentsView {  // the same, read-only
  const int8_t* m_codes;
  const uint8_t* v_codes;
  const float* m_scales;
  const float* v_scales;
};
// The range starting `offset` elements into `base`; offset must be a multiple of kInt8MomentBlock.
Int8Moments Int8MomentsAt(const Int8Moments& base, int64_t offset);

struct Bf16Moments {
  bf16_t* m;
  bf16_t* v;
};
struct Bf16MomentsView {
  const bf16_t* m;
  const bf16_t* v;
};

// The conversions of one ISA, `n` elements each. FP32 -> int8 is the kernels' encoder (same block
// rule and range alignment); back to FP32 is their decoder, exact in the sense that re-encoding
// the result gives the same codes and scales.
struct MomentCodecTable {
  void (*int8_from_f32)(const float* m, const float* v, const Int8Moments& out, int64_t n);
  void (*int8_to_f32)(const Int8MomentsView& in, float* m, float* v, int64_t n);
  void (*bf16_from_f32)(const float* m, const float* v, const Bf16Moments& out, int64_t n);
  void (*bf16_to_f32)(const Bf16MomentsView& in, float* m, float* v, int64_t n);
};

// The table for an ISA; nullptr when this build or CPU lacks it (AdamIsaSupported).
const MomentCodecTable* MomentCodecsFor(AdamIsa isa);
// The table of ActiveAdamIsa() (SLIDEDP_ADAM_ISA applies).
const MomentCodecTable& ActiveMomentCodecs();

namespace internal {
// Defined in moment_codecs_scalar.cc / moment_codecs_avx2.cc / moment_codecs_avx512.cc.
extern const MomentCodecTable kScalarMomentCodecs;
extern const MomentCodecTable kAvx2MomentCodecs;
extern const MomentCodecTable kAvx512MomentCodecs;
}  // namespace internal

}  // namespace slidedp::moments
