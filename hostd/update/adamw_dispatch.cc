// Run-time choice among the scalar, AVX2 and AVX-512 kernel tables, and the step constants they
// share. Compiled without ISA flags: it must run on any x86-64 CPU.
#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {

std::string AdamIsaName(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kScalar:
      return "scalar";
    case AdamIsa::kAvx2:
      return "avx2";
    case AdamIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

absl::StatusOr<AdamIsa> ParseAdamIsa(absl::string_view name) {
  if (name == "scalar") return AdamIsa::kScalar;
  if (name == "avx2") return AdamIsa::kAvx2;
  if (name == "avx512") return AdamIsa::kAvx512;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown AdamW ISA '", name, "' (expected scalar, avx2 or avx512)"));
}

bool AdamIsaSupported(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kScalar:
      return true;
    case AdamIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case AdamIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  }
  return false;
}

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

AdamIsa BestSupportedIsa() {
  if (AdamIsaSupported(AdamIsa::kAvx512)) return AdamIsa::kAvx512;
  if (AdamIsaSupported(AdamIsa::kAvx2)) return AdamIsa::kAvx2;
  return AdamIsa::kScalar;
}

AdamIsa ChooseIsa() {
  const AdamIsa best = BestSupportedIsa();
  const char* forced = std::getenv("SLIDEDP_ADAM_ISA");
  if (forced == nullptr || *forced == '\0') return best;
  absl::StatusOr<AdamIsa> isa = ParseAdamIsa(forced);
  if (!isa.ok()) {
    LOG(WARNING) << "SLIDEDP_ADAM_ISA: " << isa.status().message() << "; using "
                 << AdamIsaName(best);
    return best;
  }
  if (!AdamIsaSupported(*isa)) {
    LOG(WARNING) << "SLIDEDP_ADAM_ISA=" << forced << " is not supported by this CPU; using "
                 << AdamIsaName(best);
    return best;
  }
  return *isa;
}

const AdamKernelTable& ActiveKernels() {
  static const AdamKernelTable* table = AdamKernelsFor(ActiveAdamIsa());
  return *table;
}

}  // namespace

AdamIsa ActiveAdamIsa() {
  static const AdamIsa isa = ChooseIsa();
  return isa;
}

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
