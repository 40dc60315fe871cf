// The FP32 kernel table of the active ISA (common/moments/adam_isa.h chooses it), and the step
// constants every table shares. Compiled without ISA flags: it must run on any x86-64 CPU.
#include <cmath>

#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {

const AdamKernelTable* AdamKernelsFor(AdamIsa isa) {
  if (!AdamIsaSupported(isa)) return nullptr;
  switch (isa) {
    case AdamIsa::kScalar:
      return &internal::kScalarKernels;
    case AdamIsa::kAvx2:
      return &internal::kAvx2Kernels;
    case AdamIsa::kAvx512:
      return &internal::kAvx512Kernels;
  }
  return nullptr;
}

namespace {

const AdamKernelTable& ActiveKernels() {
  static const AdamKernelTable* table = AdamKernelsFor(ActiveAdamIsa());
  return *table;
}

}  // namespace

AdamWConstants MakeAdamWConstants(const AdamWStepParams& p) {
  // Python-float (double) arithmetic as in torch/optim/adam.py, each rounded to float once when it
  // reaches an ATen kernel. pow(x, 0.5) rather than sqrt mirrors `bias_correction2 ** 0.5`.
  const double t = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(p.beta1, t);
  const double bc2 = 1.0 - std::pow(p.beta2, t);
  AdamWConstants c;
  c.decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  c.one_minus_b1 = static_cast<float>(1.0 - p.beta1);
  c.b2 = static_cast<float>(p.beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - p.beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  c.eps = static_cast<float>(p.eps);
  c.neg_step_size = static_cast<float>(-(p.lr / bc1));
  c.grad_scale = p.grad_scale;
  return c;
}

void AdamWStep(const AdamWStepParams& p, float* master, float* m, float* v, bf16_t* mirror,
               const float* grad, int64_t n) {
  if (n <= 0) return;
  ActiveKernels().step_f32(MakeAdamWConstants(p), master, m, v, mirror, grad, n);
}

void AdamWStepBf16Grad(const AdamWStepParams& p, float* master, float* m, float* v, bf16_t* mirror,
                       const bf16_t* grad, int64_t n) {
  if (n <= 0) return;
  ActiveKernels().step_bf16(MakeAdamWConstants(p), master, m, v, mirror, grad, n);
}

double SumSquares(const float* g, int64_t n) {
  return n <= 0 ? 0.0 : ActiveKernels().sumsq_f32(g, n);
}

double SumSquaresBf16(const bf16_t* g, int64_t n) {
  return n <= 0 ? 0.0 : ActiveKernels().sumsq_bf16(g, n);
}

}  // namespace slidedp::update
