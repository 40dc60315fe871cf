// Compact Adam moments (issue 21): m and v held as BF16 or as block-quantized 8-bit codes instead
// of FP32, and the fused AdamW kernels that step them. The FP32 master stays exact; only the two
// moments shrink: 8 B/param of state become 4 (bf16) or 2.03 (int8). docs/optimizer-state.md has
// the layouts, why these code maps and roundings, and the measured drift against FP32 state.
//
// Each kernel is the FP32 kernel's one-pass step (adamw_kernels.h) with a decode before and an
// encode after: it widens the element's stored m and v to FP32, runs AdamW on them with exactly
// the op order of AdamElement (adamw_element_inl.h; torch's _single_tensor_adam), writes the new
// master and the BF16 upload mirror, and stores the new m and v back in the compact form. The
// scalar, AVX2 and AVX-512 kernels compile with -ffp-contract=off and give identical bits.
//
// Layouts (n elements):
//   bf16: m[n], v[n] as bf16_t. m rounds to nearest even; v rounds stochastically with a
//         counter-based hash of (seed, step, global element index): with beta2 = 0.999 the
//         per-step change of v is ~0.1%, below half a BF16 ulp (0.2-0.4%), so round to nearest
//         would freeze v. The hash makes the rounding a pure function of its inputs: a resumed
//         run repeats it bit for bit, however the range is split.
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
//         with the correctly rounded sqrt): deterministic. A block is requantized as a whole,
//         with the absmax of its new values.
//
// Ranges: an int8 kernel's range starts at a block boundary of the arrays it is given (element 0
// of the range is code 0 and scale 0 of the pointers passed; Int8MomentsAt advances them); any
// length, the last block may be partial. A block must not be split between two calls: each call
// recomputes the scale of every block it touches from the elements it is given, so callers split
// work at multiples of 256 elements. A range that ends inside a block (a tensor's end before its
// 256-aligned padding) leaves the codes of the rest of that block alone and scales the block by
// the elements it was given. BF16 ranges have no alignment rule. All kernels take any pointer
// alignment and are thread-safe on disjoint ranges.
//
// Non-finite values: a NaN or inf in a block's new m (or new sqrt(v)) poisons that block: its
// scale becomes NaN and its codes 0, so every element of the block dequantizes as NaN (the FP32
// kernel would poison only the element). A finite gradient whose square overflows FP32 (|g| above
// ~1.8e19) does the same to its v block. LayerAdam never hands the unchecked kernels a non-finite
// gradient; the checked kernels refuse it before touching its block (int8) or element (bf16).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/numeric/bf16.h"
#include "common/numeric/dtype.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {

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

// Inputs of the stochastic rounding of BF16 v. The 16 random bits added below v's kept bits are
// lowbias32(index_lo ^ key(seed, step, index_hi)) >> 16 (StochasticRoundingKey); a resumed run
// passes the same three and gets the same bits.
struct StochasticRounding {
  uint64_t seed = 0;        // fixed for a job (e.g. its seed); changes the random stream only
  int64_t step = 1;         // the Adam step t of this update (AdamWStepParams::step)
  int64_t first_index = 0;  // global element index of element 0 of the range
};

// The kernels of one ISA. Shapes follow AdamKernelTable: `n` elements from the given pointers;
// `mirror` may be nullptr (no mirror is written: mirror-free delivery). The checked variants test
// each gradient element for NaN/inf before the scale and return the index (0-based in the range)
// of the first non-finite one, -1 when there is none:
//   bf16: elements before it are updated bit for bit as the unchecked kernel does, it and
//         everything after are left untouched;
//   int8: the block holding it and every block after are left untouched (master, mirror, codes,
//         scales); the blocks before it are updated bit for bit as the unchecked kernel does.
struct AdamStateKernelTable {
  void (*int8_step_f32)(const AdamWConstants& c, float* master, const Int8Moments& state, bf16_t* mirror,
                        const float* grad, int64_t n);
  void (*int8_step_bf16)(const AdamWConstants& c, float* master, const Int8Moments& state, bf16_t* mirror,
                         const bf16_t* grad, int64_t n);
  int64_t (*int8_step_f32_checked)(const AdamWConstants& c, float* master, const Int8Moments& state, bf16_t* mirror,
                                   const float* grad, int64_t n);
  int64_t (*int8_step_bf16_checked)(const AdamWConstants& c, float* master, const Int8Moments& state, bf16_t* mirror,
                                    const bf16_t* grad, int64_t n);

  void (*bf16_step_f32)(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& state,
                        bf16_t* mirror, const float* grad, int64_t n);
  void (*bf16_step_bf16)(const AdamWConstants& c, const StochasticRounding& sr, float* master, const Bf16Moments& state,
                         bf16_t* mirror, const bf16_t* grad, int64_t n);
  int64_t (*bf16_step_f32_checked)(const AdamWConstants& c, const StochasticRounding& sr, float* master,
                                   const Bf16Moments& state, bf16_t* mirror, const float* grad, int64_t n);
  int64_t (*bf16_step_bf16_checked)(const AdamWConstants& c, const StochasticRounding& sr, float* master,
                                    const Bf16Moments& state, bf16_t* mirror, const bf16_t* grad, int64_t n);

  // Conversions (checkpoints that change the state dtype; tests). FP32 -> int8 is the kernels'
  // encoder (same block rule and range alignment); FP32 -> bf16 rounds both moments to nearest
  // even (one rounding, not a running EMA: nothing to stagnate). Back to FP32 is the kernels'
  // decoder, exact in the sense that re-encoding the result gives the same codes and scales.
  void (*int8_from_f32)(const float* m, const float* v, const Int8Moments& out, int64_t n);
  void (*int8_to_f32)(const Int8MomentsView& in, float* m, float* v, int64_t n);
  void (*bf16_from_f32)(const float* m, const float* v, const Bf16Moments& out, int64_t n);
  void (*bf16_to_f32)(const Bf16MomentsView& in, float* m, float* v, int64_t n);
};

// The table for an ISA; nullptr when this build or CPU lacks it (AdamIsaSupported).
const AdamStateKernelTable* AdamStateKernelsFor(AdamIsa isa);
// The table of ActiveAdamIsa() (SLIDEDP_ADAM_ISA applies as for the FP32 kernels).
const AdamStateKernelTable& ActiveAdamStateKernels();

// The per-range key of the stochastic rounding: mixes seed, step and the high 32 bits of the
// element index. Exposed for tests and for a reference implementation.
uint32_t StochasticRoundingKey(uint64_t seed, int64_t step, uint32_t index_hi);

namespace internal {
// Defined in adamw_state_scalar.cc / adamw_state_avx2.cc / adamw_state_avx512.cc.
extern const AdamStateKernelTable kScalarStateKernels;
extern const AdamStateKernelTable kAvx2StateKernels;
extern const AdamStateKernelTable kAvx512StateKernels;
}  // namespace internal

}  // namespace slidedp::update
