// SwiGLU forward and backward (swiglu.h) against an FP64 reference at 77 tokens of width 200.
#include "worker/kernels/swiglu.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using SwiGluGpuTest = GpuTest;

TEST_F(SwiGluGpuTest, ForwardBackward) {
  const int64_t T = 77, I = 200;
  auto gu = RandVec(T * 2 * I, 2.0), da = RandVec(T * I);
  std::unique_ptr<Dev<bf16>> dgu_in(NewBf16(gu)), dda(NewBf16(da));
  Dev<bf16> act(T * I), dgu(T * 2 * I);
  ASSERT_OK(kernels::SwiGluForward(dgu_in->get(), T, I, act.get(), nullptr));
  ASSERT_OK(kernels::SwiGluBackward(dgu_in->get(), dda->get(), T, I, dgu.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ra(T * I), rg(T * 2 * I);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const double g = gu[t * 2 * I + i], u = gu[t * 2 * I + I + i], sg = 1 / (1 + std::exp(-g));
      ra[t * I + i] = g * sg * u;
      rg[t * 2 * I + i] = da[t * I + i] * u * sg * (1 + g * (1 - sg));
      rg[t * 2 * I + I + i] = da[t * I + i] * g * sg;
    }
  ExpectRelErr("swiglu fwd (77x200)", DownBf16(act.get(), T * I), ra, 5e-3);
  ExpectRelErr("swiglu bwd", DownBf16(dgu.get(), T * 2 * I), rg, 5e-3);
}

// GeGLU with the tanh GELU (Gemma's gelu_pytorch_tanh), the gate over a wide range (the tanh's
// flat ends included).
TEST_F(SwiGluGpuTest, GeluTanhForwardBackward) {
  const int64_t T = 61, I = 136;
  auto gu = RandVec(T * 2 * I, 4.0), da = RandVec(T * I);
  std::unique_ptr<Dev<bf16>> dgu_in(NewBf16(gu)), dda(NewBf16(da));
  Dev<bf16> act(T * I), dgu(T * 2 * I);
  const auto f = kernels::GluActivation::kGeluTanh;
  ASSERT_OK(kernels::SwiGluForward(dgu_in->get(), T, I, act.get(), nullptr, f));
  ASSERT_OK(kernels::SwiGluBackward(dgu_in->get(), dda->get(), T, I, dgu.get(), nullptr, f));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const double c = std::sqrt(2.0 / M_PI);
  std::vector<double> ra(T * I), rg(T * 2 * I);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const double g = gu[t * 2 * I + i], u = gu[t * 2 * I + I + i], d = da[t * I + i];
      const double th = std::tanh(c * (g + 0.044715 * g * g * g));
      const double fg = 0.5 * g * (1 + th);
      const double dfg = 0.5 * (1 + th) + 0.5 * g * (1 - th * th) * c * (1 + 3 * 0.044715 * g * g);
      ra[t * I + i] = fg * u;
      rg[t * 2 * I + i] = d * u * dfg;
      rg[t * 2 * I + I + i] = d * fg;
    }
  ExpectRelErr("geglu-tanh fwd (61x136)", DownBf16(act.get(), T * I), ra, 5e-3);
  ExpectRelErr("geglu-tanh bwd", DownBf16(dgu.get(), T * 2 * I), rg, 5e-3);
}

}  // namespace
}  // namespace slidedp
