// cuBLASLt GEMM (gemm.h) against an FP64 host product: forward X·Wᵀ into a column slice of a wider
// output, dgrad A·B + C, and wgrad Aᵀ·B accumulated into FP32 twice; odd sizes throughout.
#include "worker/kernels/gemm.h"

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

using GemmGpuTest = GpuTest;

// Forward NT, output into a column slice of a wider buffer; the columns outside it stay NaN.
TEST_F(GemmGpuTest, ForwardIntoStridedColumnSlice) {
  GemmRunner runner;
  ASSERT_OK(runner.Init());
  cudaStream_t s = nullptr;
  const int64_t M = 77, N = 136, K = 264, LDD = 200, COL = 24;
  auto x = RandVec(M * K), w = RandVec(N * K);
  std::unique_ptr<Dev<bf16>> dx(NewBf16(x)), dw(NewBf16(w));
  Dev<bf16> y(M * LDD);
  GemmArgs g;
  g.m = M;
  g.n = N;
  g.k = K;
  g.a = dx->get();
  g.lda = K;
  g.b = dw->get();
  g.ldb = K;
  g.d = y.get() + COL;
  g.ldd = LDD;
  ASSERT_OK(runner.Run(g, s));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  auto got_all = DownBf16(y.get(), M * LDD);
  std::vector<double> got, ref;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double r = 0;
      for (int64_t k = 0; k < K; ++k) r += x[i * K + k] * w[j * K + k];
      ref.push_back(r);
      got.push_back(got_all[i * LDD + COL + j]);
    }
  ExpectRelErr("gemm fwd X·Wᵀ bf16 (77x136x264, strided out)", got, ref, 5e-3);
  EXPECT_TRUE(std::isnan(got_all[0]) && std::isnan(got_all[M * LDD - 1]))
      << "gemm leaves columns outside its slice alone";
}

// Forward NT with the bias epilogue (qwen2's q/k/v biases), into a column slice, twice on one cached
// plan with different biases: D = X·Wᵀ + b, rounded to BF16 once.
TEST_F(GemmGpuTest, ForwardWithBiasEpilogue) {
  GemmRunner runner;
  ASSERT_OK(runner.Init());
  const int64_t M = 77, N = 136, K = 264, LDD = 200, COL = 24;
  auto x = RandVec(M * K), w = RandVec(N * K);
  std::unique_ptr<Dev<bf16>> dx(NewBf16(x)), dw(NewBf16(w));
  Dev<bf16> y(M * LDD);
  for (int round = 0; round < 2; ++round) {
    auto b = RandVec(N, 2.0);
    std::unique_ptr<Dev<bf16>> db(NewBf16(b));
    GemmArgs g;
    g.m = M;
    g.n = N;
    g.k = K;
    g.a = dx->get();
    g.lda = K;
    g.b = dw->get();
    g.ldb = K;
    g.d = y.get() + COL;
    g.ldd = LDD;
    g.bias = db->get();
    ASSERT_OK(runner.Run(g, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    auto got_all = DownBf16(y.get(), M * LDD);
    std::vector<double> got, ref;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double r = b[j];
        for (int64_t k = 0; k < K; ++k) r += x[i * K + k] * w[j * K + k];
        ref.push_back(r);
        got.push_back(got_all[i * LDD + COL + j]);
      }
    ExpectRelErr("gemm fwd X·Wᵀ + bias (77x136x264, round " + std::to_string(round) + ")", got, ref, 5e-3);
  }
}

// dgrad NN with a residual C.
TEST_F(GemmGpuTest, DgradWithResidual) {
  GemmRunner runner;
  ASSERT_OK(runner.Init());
  cudaStream_t s = nullptr;
  const int64_t M = 301, N = 264, K = 136;
  auto a = RandVec(M * K), b = RandVec(K * N), c = RandVec(M * N);
  std::unique_ptr<Dev<bf16>> da(NewBf16(a)), db(NewBf16(b)), dc(NewBf16(c));
  Dev<bf16> d(M * N);
  GemmArgs g;
  g.op_b = GemmOp::kN;
  g.m = M;
  g.n = N;
  g.k = K;
  g.a = da->get();
  g.lda = K;
  g.b = db->get();
  g.ldb = N;
  g.c = dc->get();
  g.ldc = N;
  g.d = d.get();
  g.ldd = N;
  g.beta = 1.0f;
  ASSERT_OK(runner.Run(g, s));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ref(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double r = c[i * N + j];
      for (int64_t k = 0; k < K; ++k) r += a[i * K + k] * b[k * N + j];
      ref[i * N + j] = r;
    }
  ExpectRelErr("gemm dgrad A·B + C bf16 (301x264x136)", DownBf16(d.get(), M * N), ref, 5e-3);
}

// wgrad TN into FP32 with beta = 1, twice (accumulation across micro-batches).
TEST_F(GemmGpuTest, WgradAccumulatesIntoFp32Twice) {
  GemmRunner runner;
  ASSERT_OK(runner.Init());
  cudaStream_t s = nullptr;
  const int64_t M = 136, N = 72, K = 515;
  auto a = RandVec(K * M), b = RandVec(K * N), d0 = RandVec(M * N);
  std::unique_ptr<Dev<bf16>> da(NewBf16(a)), db(NewBf16(b));
  Dev<float> d(M * N);
  Upload(d, ToF32(d0));
  GemmArgs g;
  g.op_a = GemmOp::kT;
  g.op_b = GemmOp::kN;
  g.m = M;
  g.n = N;
  g.k = K;
  g.a = da->get();
  g.lda = M;
  g.b = db->get();
  g.ldb = N;
  g.c = d.get();
  g.ldc = N;
  g.d = d.get();
  g.ldd = N;
  g.out_type = GemmOutType::kF32;
  g.beta = 1.0f;
  ASSERT_OK(runner.Run(g, s));
  ASSERT_OK(runner.Run(g, s));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ref(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double r = 0;
      for (int64_t k = 0; k < K; ++k) r += a[k * M + i] * b[k * N + j];
      ref[i * N + j] = d0[i * N + j] + 2 * r;
    }
  ExpectRelErr("gemm wgrad Aᵀ·B fp32 += (136x72x515, twice)", DownF32(d.get(), M * N), ref, 1e-5);
}

}  // namespace
}  // namespace slidedp
