// LayerAdam's fused AdamW kernels for compact Adam moments (issue 21): m and v held as BF16 or as
// block-quantized 8-bit codes (common/moments/moments.h has the layouts and the codec; the FP32
// master stays exact). docs/optimizer-state.md has why these code maps and roundings, and the
// measured drift against FP32 state.
//
// Each kernel is the FP32 kernel's one-pass step (adamw_kernels.h) with a decode before and an
// encode after: it widens the element's stored m and v to FP32, runs AdamW on them with exactly
// the op order of AdamElement (adamw_element_inl.h; torch's _single_tensor_adam), writes the new
// master and the BF16 upload mirror, and stores the new m and v back in the compact form with the
// codec's encoders (common/moments/moment_codec*_inl.h). The scalar, AVX2 and AVX-512 kernels
// compile with -ffp-contract=off and give identical bits.
//
// Rounding of the stored moments:
//   bf16: m rounds to nearest even; v rounds stochastically with a counter-based hash of (seed,
//         step, global element index): with beta2 = 0.999 the per-step change of v is ~0.1%,
//         below half a BF16 ulp (0.2-0.4%), so round to nearest would freeze v. The hash makes
//         the rounding a pure function of its inputs: a resumed run repeats it bit for bit,
//         however the range is split.
//   int8: a block is requantized as a whole, with the absmax of its new values (nearest, ties to
//         even: deterministic).
//
// Ranges follow the codec's rule (moments.h): an int8 kernel's range starts at a block boundary
// and a block must not be split between two calls. A range that ends inside a block (a tensor's
// end before its 256-aligned padding) leaves the codes of the rest of that block alone and scales
// the block by the elements it was given. BF16 ranges have no alignment rule. All kernels take
// any pointer alignment and are thread-safe on disjoint ranges.
//
// Non-finite values: a NaN or inf in a block's new m (or new sqrt(v)) poisons that block: its
// scale becomes NaN and its codes 0, so every element of the block dequantizes as NaN (the FP32
// kernel would poison only the element). A finite gradient whose square overflows FP32 (|g| above
// ~1.8e19) does the same to its v block. LayerAdam never hands the unchecked kernels a non-finite
// gradient; the checked kernels refuse it before touching its block (int8) or element (bf16).
#pragma once

#include <cstdint>

#include "common/moments/moments.h"
#include "common/numeric/bf16.h"
#include "common/numeric/dtype.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {

// The compact moments' types, as LayerAdam's callers name them.
using moments::Bf16Moments;
using moments::Bf16MomentsView;
using moments::Int8Moments;
using moments::Int8MomentsAt;
using moments::Int8MomentsView;

// Inputs of the stochastic rounding of BF16 v. The 16 random bits added below v's kept bits are
// lowbias32(index_lo ^ key(seed, step, index_hi)) >> 16 (StochasticRoundingKey); a resumed run
// passes the same three and gets the same bits.
struct StochasticRounding {
  uint64_t seed = 0;        // fixed for a job (e.g. its seed); changes the random stream only
  int64_t step = 1;         // the Adam step t of this update (AdamWStepParams::step)
  int64_t first_index = 0;  // global element index of element 0 of the range
};

// The step kernels of one ISA. Shapes follow AdamKernelTable: `n` elements from the given
// pointers; `mirror` may be nullptr (no mirror is written: mirror-free delivery). The checked
// variants test each gradient element for NaN/inf before the scale and return the index (0-based
// in the range) of the first non-finite one, -1 when there is none:
//   bf16: elements before it are updated bit for bit as the unchecked kernel does, it and
//         everything after are left untouched;
//   int8: the block holding it and every block after are left untouched (master, mirror, codes,
//         scales); the blocks before it are updated bit for bit as the unchecked kernel does.
struct AdamStateStepTable {
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
};

// The kernels of one ISA: the codec's conversions of the same ISA (int8_from_f32, int8_to_f32,
// bf16_from_f32, bf16_to_f32: checkpoints that change the state dtype, tests) and the steps, so
// that a state converted on load is what the steps would make.
struct AdamStateKernelTable : moments::MomentCodecTable, AdamStateStepTable {};

// The table for an ISA; nullptr when this build or CPU lacks it (AdamIsaSupported).
const AdamStateKernelTable* AdamStateKernelsFor(AdamIsa isa);
// The table of ActiveAdamIsa() (SLIDEDP_ADAM_ISA applies as for the FP32 kernels).
const AdamStateKernelTable& ActiveAdamStateKernels();

// The per-range key of the stochastic rounding: mixes seed, step and the high 32 bits of the
// element index. Exposed for tests and for a reference implementation.
uint32_t StochasticRoundingKey(uint64_t seed, int64_t step, uint32_t index_hi);

namespace internal {
// Defined in adamw_state_scalar.cc / adamw_state_avx2.cc / adamw_state_avx512.cc.
extern const AdamStateStepTable kScalarStateSteps;
extern const AdamStateStepTable kAvx2StateSteps;
extern const AdamStateStepTable kAvx512StateSteps;
}  // namespace internal

}  // namespace slidedp::update
