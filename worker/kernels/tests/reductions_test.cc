// The reductions and casts of reductions.h against the host: the FP32 residual add of a BF16
// branch (out of place and in place, exact), the casts and the widening bit for bit, and the FP64
// sum of squares at sizes 0, 1 and two odd large ones, from aligned and unaligned starts. (SumInto
// is checked with the cross entropy, whose row losses it adds; ReducePartialsInto with the RMSNorm
// weight gradient.)
#include "worker/kernels/reductions.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using ReductionsGpuTest = GpuTest;

// FP32 residual add.
TEST_F(ReductionsGpuTest, AddBf16ToF32) {
  const int64_t n = 1000003;  // odd: the grid-stride tail
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> res(n);
  for (auto& v : res) v = d(Rng());  // full FP32 values, not BF16-representable
  auto branch = RandVec(n, 0.5);
  std::unique_ptr<Dev<bf16>> db(NewBf16(branch));
  Dev<float> dres(n), out(n);
  Upload(dres, res);
  ASSERT_OK(kernels::AddBf16ToF32(dres.get(), db->get(), n, out.get(), nullptr));
  ASSERT_OK(kernels::AddBf16ToF32(dres.get(), db->get(), n, dres.get(), nullptr));  // in place (out aliases res)
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ref(n);  // one FP32 add each: exact agreement expected
  for (int64_t i = 0; i < n; ++i) ref[i] = static_cast<double>(res[i] + static_cast<float>(branch[i]));
  ExpectRelErr("residual add fp32 += bf16 (n=1000003)", DownF32(out.get(), n), ref, 0.0);
  ExpectRelErr("residual add fp32 += bf16 in place", DownF32(dres.get(), n), ref, 0.0);
}

// Bias gradients: column sums of a strided BF16 matrix added into FP32, at a row count past the
// row groups and an odd column count; twice (it adds).
TEST_F(ReductionsGpuTest, ColumnSumsInto) {
  const int64_t rows = 1001, cols = 333, ld = 400;
  auto x = RandVec(rows * ld, 1.0);
  std::unique_ptr<Dev<bf16>> dx(NewBf16(x));
  auto start = RandVec(cols);
  Dev<float> out(cols), ws(kernels::ColumnSumsWorkspaceNumel(rows, cols));
  Upload(out, ToF32(start));
  ASSERT_OK(kernels::ColumnSumsInto(dx->get(), rows, cols, ld, ws.get(), out.get(), nullptr));
  ASSERT_OK(kernels::ColumnSumsInto(dx->get(), rows, cols, ld, ws.get(), out.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> ref(cols);
  for (int64_t c = 0; c < cols; ++c) {
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) s += static_cast<double>(Bf16ToFloat(FloatToBf16(static_cast<float>(x[r * ld + c]))));
    ref[c] = static_cast<double>(static_cast<float>(start[c])) + 2 * s;
  }
  ExpectRelErr("column sums into fp32 (1001x333, ld 400, twice)", DownF32(out.get(), cols), ref, 1e-5);
}

// BF16 gradients (runtime.grad_dtype bf16): rounded in place, bit for bit the host's FloatToBf16
// (which LayerAdam's kernels and the CPU backend use), ties to even included.
TEST_F(ReductionsGpuTest, RoundToBf16InPlaceIsTheHostRounding) {
  const int64_t n = 1000003;
  std::normal_distribution<float> d(0.0f, 1e-3f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(Rng());
  x[0] = Bf16ToFloat(0x3f80) + 0x1p-8f;  // a tie: 1 + half an ulp of BF16 rounds to even (1.0)
  x[1] = Bf16ToFloat(0x3f81) + 0x1p-8f;  // a tie above an odd mantissa rounds up
  x[2] = 3.0e38f;                        // rounds to a finite or inf value as the host does
  Dev<float> dx(n);
  Upload(dx, x);
  ASSERT_OK(kernels::RoundToBf16InPlace(dx.get(), n, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<double> got = DownF32(dx.get(), n);
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want = Bf16ToFloat(FloatToBf16(x[i]));
    const float g = static_cast<float>(got[i]);
    differ += std::memcmp(&want, &g, 4) != 0;
  }
  EXPECT_EQ(differ, 0);
  EXPECT_EQ(got[0], 1.0);
}

// The upload cast (param_source master, cast_on device): bit for bit FloatToBf16 on random bit
// patterns (NaNs of every payload, infinities, subnormals, ties), from aligned and unaligned
// starts (the vector and the one-by-one paths), odd lengths, one block and many.
TEST_F(ReductionsGpuTest, CastF32ToBf16ExactIsFloatToBf16BitForBit) {
  const int64_t n = 1000003;
  std::vector<uint32_t> bits(n);
  for (auto& b : bits) b = static_cast<uint32_t>(Rng()());
  for (uint32_t i = 0; i < 4096; ++i) bits[i] = 0x3f800000u + (i << 4);  // ties and near-ties
  const uint32_t special[] = {0x7f800000u, 0xff800000u, 0x7f800001u, 0xffffffffu, 0x7fc00000u, 0x00000001u,
                              0x80000000u, 0x7f7fffffu, 0x3f808000u, 0x3f818000u};
  for (size_t i = 0; i < sizeof(special) / 4; ++i) bits[5000 + i] = special[i];
  Dev<uint32_t> src(n + 1);
  Dev<uint16_t> dst(n + 2);
  ASSERT_CUDA_OK(cudaMemcpy(src.get(), bits.data(), n * 4, cudaMemcpyHostToDevice));
  for (int offset : {0, 1}) {
    for (int blocks : {1, 64}) {
      const int64_t len = n - offset;
      ASSERT_CUDA_OK(cudaMemset(dst.get(), 0xff, (n + 2) * 2));
      ASSERT_OK(kernels::CastF32ToBf16Exact(reinterpret_cast<const float*>(src.get() + offset), len,
                                            reinterpret_cast<bf16*>(dst.get() + offset), blocks, nullptr));
      std::vector<uint16_t> got(n + 2);
      ASSERT_CUDA_OK(cudaMemcpy(got.data(), dst.get(), (n + 2) * 2, cudaMemcpyDeviceToHost));
      int64_t differ = 0;
      for (int64_t i = 0; i < len; ++i) {
        float f;
        std::memcpy(&f, &bits[offset + i], 4);
        differ += got[offset + i] != FloatToBf16(f);
      }
      EXPECT_EQ(differ, 0) << "offset " << offset << ", " << blocks << " block(s)";
      EXPECT_EQ(got[offset + len], 0xffff) << "wrote past the end";
    }
  }
  EXPECT_FALSE(kernels::CastF32ToBf16Exact(nullptr, 1, nullptr, 0, nullptr).ok());
}

// The checkpoint widening (runtime.checkpoint_dtype bf16): every BF16 bit pattern (NaNs of every
// payload, infinities, subnormals, signed zeros) widened exactly to Bf16ToFloat's FP32 bits, from
// aligned and unaligned starts (the vector and the one-by-one paths), an odd length, and nothing
// written past the end.
TEST_F(ReductionsGpuTest, WidenBf16ToF32IsExactForEveryBitPattern) {
  const int64_t n = 65536 * 3 + 7;
  std::vector<uint16_t> bits(n);
  for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint16_t>(i < 3 * 65536 ? i % 65536 : Rng()());
  Dev<uint16_t> src(n + 1);
  Dev<uint32_t> dst(n + 2);
  ASSERT_CUDA_OK(cudaMemcpy(src.get(), bits.data(), n * 2, cudaMemcpyHostToDevice));
  for (int offset : {0, 1}) {
    const int64_t len = n - offset;
    ASSERT_CUDA_OK(cudaMemset(dst.get(), 0xff, (n + 2) * 4));
    ASSERT_OK(kernels::WidenBf16ToF32(reinterpret_cast<const bf16*>(src.get() + offset), len,
                                      reinterpret_cast<float*>(dst.get() + offset), nullptr));
    std::vector<uint32_t> got(n + 2);
    ASSERT_CUDA_OK(cudaMemcpy(got.data(), dst.get(), (n + 2) * 4, cudaMemcpyDeviceToHost));
    int64_t differ = 0;
    for (int64_t i = 0; i < len; ++i) {
      const float want = Bf16ToFloat(bits[offset + i]);
      differ += std::memcmp(&want, &got[offset + i], 4) != 0;
    }
    EXPECT_EQ(differ, 0) << "offset " << offset;
    EXPECT_EQ(got[offset + len], 0xffffffffu) << "wrote past the end";
  }
  EXPECT_TRUE(kernels::WidenBf16ToF32(nullptr, 0, nullptr, nullptr).ok());
  EXPECT_FALSE(kernels::WidenBf16ToF32(nullptr, 1, nullptr, nullptr).ok());
}

// Squared norm (device-staged clipping).
TEST_F(ReductionsGpuTest, SumSquaresF32) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000003}, int64_t{9437187}}) {
    std::normal_distribution<float> d(0.0f, 1e-3f);
    std::vector<float> x(n + 1);
    for (auto& v : x) v = d(Rng());
    Dev<float> dx(n + 1);
    Upload(dx, x);
    Dev<double> partials(kernels::kSumSquaresBlocks), out(2);
    for (int misaligned = 0; misaligned <= 1; ++misaligned) {  // the scalar path: x not 16-byte aligned
      ASSERT_OK(kernels::SumSquaresF32(dx.get() + misaligned, n, partials.get(), out.get() + misaligned, nullptr));
    }
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    double got[2];
    ASSERT_CUDA_OK(cudaMemcpy(got, out.get(), sizeof(got), cudaMemcpyDeviceToHost));
    for (int misaligned = 0; misaligned <= 1; ++misaligned) {
      long double ref = 0;
      for (int64_t i = 0; i < n; ++i) ref += static_cast<long double>(x[i + misaligned]) * x[i + misaligned];
      ExpectRelErr("sum of squares fp64 (n=" + std::to_string(n) + (misaligned ? ", unaligned)" : ")"),
                   {got[misaligned]}, {static_cast<double>(ref)}, 1e-12);
    }
  }
}

}  // namespace
}  // namespace slidedp
