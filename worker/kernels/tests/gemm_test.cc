// cuBLASLt GEMM (gemm.h) against an FP64 host product: forward X·Wᵀ into a column slice of a wider
// output, dgrad A·B + C, and wgrad Aᵀ·B accumulated into FP32 twice; odd sizes throughout.
#include "worker/kernels/gemm.h"

#include <algorithm>
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
  g.out_type = Dtype::kF32;
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

TEST(GemmRowBucketTest, TwoBucketsPerOctaveAtMostOneAndAHalfTimesTheRows) {
  EXPECT_EQ(GemmRowBucket(1), 16);
  EXPECT_EQ(GemmRowBucket(16), 16);
  EXPECT_EQ(GemmRowBucket(17), 24);
  EXPECT_EQ(GemmRowBucket(25), 32);
  EXPECT_EQ(GemmRowBucket(2048), 2048);
  EXPECT_EQ(GemmRowBucket(2049), 3072);
  EXPECT_EQ(GemmRowBucket(3073), 4096);
  for (int64_t r = 1; r < 100000; r += 37) {
    const int64_t b = GemmRowBucket(r);
    EXPECT_GE(b, r);
    EXPECT_LE(b, std::max<int64_t>(16, r + r / 2 + 1)) << r;
  }
}

// A MoE expert's GEMMs: the row count varies (forward/dgrad in m, wgrad in k). Each size runs its
// bucket's plan at its own size: right against FP64, bitwise repeatable, a handful of plans for many
// counts, and the same values whether the runner buckets or plans every shape exactly.
TEST_F(GemmGpuTest, VaryingRowCountsShareABucketsPlan) {
  GemmRunner bucketed, exact;
  ASSERT_OK(bucketed.Init());
  ASSERT_OK(exact.Init());
  exact.set_row_buckets(false);
  const int64_t N = 96, K = 136, kMaxRows = 700;
  auto x = RandVec(kMaxRows * K), w = RandVec(N * K);
  std::unique_ptr<Dev<bf16>> dx(NewBf16(x)), dw(NewBf16(w));
  Dev<bf16> y(kMaxRows * N), y2(kMaxRows * N);
  Dev<float> dwg(N * K);
  const std::vector<int64_t> rows = {1, 3, 17, 100, 129, 255, 256, 257, 511, 600, 699, 700};
  for (int64_t M : rows) {
    GemmArgs g;  // forward: Y[M, N] = X[M, K] · Wᵀ, rows in m
    g.m = M;
    g.n = N;
    g.k = K;
    g.a = dx->get();
    g.lda = K;
    g.b = dw->get();
    g.ldb = K;
    g.d = y.get();
    g.ldd = N;
    g.varies = GemmArgs::Varies::kM;
    ASSERT_OK(bucketed.Run(g, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    auto got = DownBf16(y.get(), M * N);
    std::vector<double> ref(M * N);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double r = 0;
        for (int64_t k = 0; k < K; ++k) r += x[i * K + k] * w[j * K + k];
        ref[i * N + j] = r;
      }
    ExpectRelErr("bucketed fwd rows " + std::to_string(M), got, ref, 5e-3);
    ASSERT_OK(bucketed.Run(g, nullptr));  // again, after other sizes used the bucket: the same bits
    g.d = y2.get();
    ASSERT_OK(exact.Run(g, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(DownBf16(y.get(), M * N), got) << "rows " << M;
    ExpectRelErr("exact plan vs bucketed, rows " + std::to_string(M), DownBf16(y2.get(), M * N), ref, 5e-3);

    GemmArgs wg;  // wgrad: dW[N, K] += Y[M, N]ᵀ · X[M, K], rows in k
    wg.op_a = GemmOp::kT;
    wg.op_b = GemmOp::kN;
    wg.m = N;
    wg.n = K;
    wg.k = M;
    wg.a = y.get();
    wg.lda = N;
    wg.b = dx->get();
    wg.ldb = K;
    wg.c = dwg.get();
    wg.ldc = K;
    wg.d = dwg.get();
    wg.ldd = K;
    wg.out_type = Dtype::kF32;
    wg.beta = 1.0f;
    wg.varies = GemmArgs::Varies::kK;
    ASSERT_CUDA_OK(cudaMemset(dwg.get(), 0, N * K * sizeof(float)));
    ASSERT_OK(bucketed.Run(wg, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<double> wref(N * K);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < K; ++j) {
        double r = 0;
        for (int64_t t = 0; t < M; ++t) r += static_cast<double>(got[t * N + i]) * x[t * K + j];
        wref[i * K + j] = r;
      }
    ExpectRelErr("bucketed wgrad rows " + std::to_string(M), DownF32(dwg.get(), N * K), wref, 1e-5);
  }
  // 12 counts in 8 buckets (16, 24, 128, 192, 256, 384, 512, 768), two kinds of GEMM: at most 16
  // plans (plus exact ones where a bucket's algorithm refused a size); the exact runner made one per
  // count (forward only).
  EXPECT_LE(bucketed.plans_made(), 16 + static_cast<int64_t>(rows.size()));
  EXPECT_EQ(exact.plans_made(), static_cast<int64_t>(rows.size()));
}

}  // namespace
}  // namespace slidedp
