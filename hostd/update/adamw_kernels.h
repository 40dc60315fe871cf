// Fused AdamW + BF16-mirror kernels and the squared-sum reduction for the global gradient norm.
//
// One pass per element reads master, m, v and the gradient, writes master, m, v and the BF16
// upload mirror (round to nearest even). The arithmetic follows torch.optim.AdamW's non-fused,
// single-tensor path (torch/optim/adam.py `_single_tensor_adam`, decoupled weight decay) op by
// op, in FP32 with the step constants computed in double and rounded to float once, as PyTorch
// does when it passes Python floats to ATen kernels:
//
//   g      = grad * grad_scale                       (clip_grad_norm_'s in-place multiply)
//   theta  = theta * f32(1 - lr*wd)                  (param.mul_(1 - lr*wd))
//   m      = fma(f32(1-b1), g - m, m)                (exp_avg.lerp_(g, 1-b1); ATen's vectorized
//                                                     lerp for weight < 0.5 is one fmadd)
//   v      = v*f32(b2) + (f32(1-b2)*g)*g             (exp_avg_sq.mul_(b2).addcmul_(g, g, 1-b2))
//   denom  = sqrt(v) / f32(sqrt(1-b2^t)) + f32(eps)  ((exp_avg_sq.sqrt() / bc2_sqrt).add_(eps))
//   theta  = theta + (f32(-lr/(1-b1^t)) * m) / denom (param.addcdiv_(m, denom, -step_size))
//   mirror = FloatToBf16(theta)
//
// All three implementations (scalar, AVX2, AVX-512) compile with -ffp-contract=off and use an
// explicit FMA only where ATen does, so they produce bit-identical results to each other. The
// remaining differences from PyTorch are ATen build details (a compiler may contract ATen's scalar
// tail loops); the tests bound the result against a double-precision reference.
//
// Non-finite values propagate as in PyTorch: a NaN/inf gradient makes m, v and theta NaN/inf for
// that element (there is no skip); the mirror of a NaN is a quiet NaN, as FloatToBf16.
//
// Any length and any alignment are handled (masked or scalar tails). Thread-safe on disjoint
// ranges; the caller splits work (LayerAdam does).
#pragma once

#include <cstdint>

#include "common/moments/adam_isa.h"
#include "common/numeric/bf16.h"

namespace slidedp::update {

// What an update does with a NaN or infinite gradient element.
enum class NonFiniteGrad {
  kApply,   // as PyTorch: that element's m, v and theta become NaN/inf
  kRefuse,  // LayerAdam's checked kernels stop before the first non-finite element: DATA_LOSS
            // with kNonFiniteGradPayload; nothing of that piece from it on is written
};

// Hyper-parameters of one optimizer step for one tensor range (PyTorch AdamW defaults).
struct AdamWStepParams {
  double lr = 1e-3;  // the scheduled learning rate of this step (LrSchedule::LrAt)
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  // decoupled: theta *= 1 - lr*wd
  int64_t step = 1;            // t >= 1: number of updates including this one (bias correction)
  float grad_scale = 1.0f;     // clip coefficient (ClipCoefficient), applied as g*scale in fp32
  NonFiniteGrad nonfinite_grad = NonFiniteGrad::kApply;  // LayerAdam only (the kernels apply)
  uint64_t rounding_seed = 0;  // BF16 moments' stochastic rounding (LayerAdam; adamw_state.h)
};

// The ISA a kernel table was built for, and the one the entry points below use (ActiveAdamIsa:
// the best supported one, or SLIDEDP_ADAM_ISA), shared with the moment codecs.
using moments::ActiveAdamIsa;
using moments::AdamIsa;
using moments::AdamIsaName;
using moments::AdamIsaSupported;
using moments::ParseAdamIsa;

// theta, m, v updated in place for n elements; mirror[i] = FloatToBf16(new theta[i]).
void AdamWStep(const AdamWStepParams& p, float* master, float* m, float* v, bf16_t* mirror,
               const float* grad, int64_t n);
// Same with a BF16 gradient (widened exactly to fp32 before the scale).
void AdamWStepBf16Grad(const AdamWStepParams& p, float* master, float* m, float* v, bf16_t* mirror,
                       const bf16_t* grad, int64_t n);

// Sum of g[i]^2 accumulated in double (squares formed in double, so exact per element).
double SumSquares(const float* g, int64_t n);
double SumSquaresBf16(const bf16_t* g, int64_t n);

// ---- Per-ISA entry points (tests and benchmarks call them directly). ----

// Step constants rounded to float once, shared by every implementation.
struct AdamWConstants {
  float decay;  // f32(1 - lr*wd)
  float one_minus_b1;
  float b2;
  float one_minus_b2;
  float bc2_sqrt;  // f32(sqrt(1 - b2^t))
  float eps;
  float neg_step_size;  // f32(-lr / (1 - b1^t))
  float grad_scale;
  // Write the mirror with streaming (non-temporal) stores in the vector body: skips the
  // read-for-ownership of a line the CPU will not read again (DMA reads it). Off = cached stores.
  bool stream_mirror = true;
};
AdamWConstants MakeAdamWConstants(const AdamWStepParams& p);

struct AdamKernelTable {
  void (*step_f32)(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
                   const float* grad, int64_t n);
  void (*step_bf16)(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
                    const bf16_t* grad, int64_t n);
  double (*sumsq_f32)(const float* g, int64_t n);
  double (*sumsq_bf16)(const bf16_t* g, int64_t n);
  // As step_f32 / step_bf16, but checking each gradient element (NaN or +-inf, before the scale)
  // as the vector loop loads it: stops before the first non-finite one and returns its index, the
  // elements before it updated bit for bit as the unchecked kernels do; -1 when all n are
  // (LayerAdam's refusing updates, NonFiniteGrad::kRefuse). The check is fused: no second pass.
  int64_t (*step_f32_checked)(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
                              const float* grad, int64_t n);
  int64_t (*step_bf16_checked)(const AdamWConstants& c, float* master, float* m, float* v, bf16_t* mirror,
                               const bf16_t* grad, int64_t n);
  // dst[i] = src[i] for n floats with streaming (non-temporal) stores where the ISA has them: the
  // undo copies of speculative updates, written once and read back only on a rollback, skip the
  // read-for-ownership of their lines and stay out of the cache. Ends with a store fence.
  void (*copy_stream)(const float* src, float* dst, int64_t n);
};

// The table for an ISA; nullptr when this build or CPU lacks it.
const AdamKernelTable* AdamKernelsFor(AdamIsa isa);

namespace internal {
// Defined in adamw_scalar.cc / adamw_avx2.cc / adamw_avx512.cc.
extern const AdamKernelTable kScalarKernels;
extern const AdamKernelTable kAvx2Kernels;
extern const AdamKernelTable kAvx512Kernels;
}  // namespace internal

}  // namespace slidedp::update
