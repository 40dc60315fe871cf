// Cross entropy in place over BF16 logits (cross_entropy.h) against an FP64 reference, and
// SumInto adding its row losses: 37 rows, vocab 1003 (a scalar tail past the 8-wide loads) in rows
// of stride 1008, every fifth row ignored and one label in the tail.
#include "worker/kernels/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/backend.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using CrossEntropyGpuTest = GpuTest;

TEST_F(CrossEntropyGpuTest, InPlaceWithIgnoredRowsAndLossSum) {
  const int64_t R = 37, V = 1003, LD = 1008;
  const float scale = 0.37f;
  auto logits = RandVec(R * LD, 3.0);
  std::vector<int32_t> labels(R);
  std::uniform_int_distribution<int> ud(0, V - 1);
  for (int64_t r = 0; r < R; ++r) labels[r] = (r % 5 == 3) ? kIgnoreIndex : ud(Rng());
  labels[1] = V - 1;  // in the scalar tail
  std::unique_ptr<Dev<bf16>> dl(NewBf16(logits));
  Dev<int32_t> dlab(R);
  Upload(dlab, labels);
  Dev<float> rl(R), total(1);
  float init = 1.25f;
  cudaMemcpy(total.get(), &init, 4, cudaMemcpyHostToDevice);
  ASSERT_OK(kernels::CrossEntropyInPlace(dl->get(), R, V, LD, dlab.get(), kIgnoreIndex, scale, rl.get(), nullptr));
  ASSERT_OK(kernels::SumInto(rl.get(), R, total.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  auto got = DownBf16(dl->get(), R * LD);
  std::vector<double> gd, rd, rloss(R);
  double rtotal = init;
  for (int64_t r = 0; r < R; ++r) {
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, logits[r * LD + j]);
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(logits[r * LD + j] - m);
    const double lse = m + std::log(s);
    const bool ign = labels[r] == kIgnoreIndex;
    rloss[r] = ign ? 0 : scale * (lse - logits[r * LD + labels[r]]);
    rtotal += rloss[r];
    for (int64_t j = 0; j < V; ++j) {
      rd.push_back(ign ? 0 : scale * (std::exp(logits[r * LD + j] - lse) - (j == labels[r] ? 1 : 0)));
      gd.push_back(got[r * LD + j]);
    }
  }
  ExpectRelErr("cross-entropy row loss (37 rows, vocab 1003, ignore)", DownF32(rl.get(), R), rloss, 1e-5);
  ExpectRelErr("cross-entropy dlogits in place", gd, rd, 1e-2);
  ExpectRelErr("cross-entropy loss sum +=", DownF32(total.get(), 1), {rtotal}, 1e-5);
}

// Soft-capped logits (Gemma's final_logit_softcapping, cap 3 with logits up to ~5 so tanh bends):
// the loss over cap tanh(l / cap) and the gradient with respect to the stored logits l.
TEST_F(CrossEntropyGpuTest, SoftCapped) {
  const int64_t R = 19, V = 515, LD = 520;
  const float scale = 0.5f, cap = 3.0f;
  auto logits = RandVec(R * LD, 2.5);
  std::vector<int32_t> labels(R);
  std::uniform_int_distribution<int> ud(0, V - 1);
  for (int64_t r = 0; r < R; ++r) labels[r] = (r % 7 == 2) ? kIgnoreIndex : ud(Rng());
  labels[0] = V - 1;
  std::unique_ptr<Dev<bf16>> dl(NewBf16(logits));
  Dev<int32_t> dlab(R);
  Upload(dlab, labels);
  Dev<float> rl(R);
  ASSERT_OK(
      kernels::CrossEntropyInPlace(dl->get(), R, V, LD, dlab.get(), kIgnoreIndex, scale, rl.get(), nullptr, cap));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  auto got = DownBf16(dl->get(), R * LD);
  std::vector<double> gd, rd, rloss(R);
  for (int64_t r = 0; r < R; ++r) {
    std::vector<double> z(V);
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, z[j] = cap * std::tanh(logits[r * LD + j] / cap));
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(z[j] - m);
    const double lse = m + std::log(s);
    const bool ign = labels[r] == kIgnoreIndex;
    rloss[r] = ign ? 0 : scale * (lse - z[labels[r]]);
    for (int64_t j = 0; j < V; ++j) {
      const double t = z[j] / cap;
      rd.push_back(ign ? 0 : scale * (std::exp(z[j] - lse) - (j == labels[r] ? 1 : 0)) * (1 - t * t));
      gd.push_back(got[r * LD + j]);
    }
  }
  ExpectRelErr("soft-capped cross-entropy row loss", DownF32(rl.get(), R), rloss, 1e-5);
  ExpectRelErr("soft-capped cross-entropy dlogits", gd, rd, 1e-2);
  EXPECT_FALSE(
      kernels::CrossEntropyInPlace(dl->get(), R, V, LD, dlab.get(), kIgnoreIndex, scale, rl.get(), nullptr, -1.0f).ok());
}

}  // namespace
}  // namespace slidedp
