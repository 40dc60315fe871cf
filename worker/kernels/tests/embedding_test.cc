// Embedding gather and its deterministic backward (embedding.h) against the host, into a BF16 and
// an FP32 residual stream: 517 tokens over 60 distinct ids (many duplicates), width 136, plus FP32
// rows read in place from mapped host memory.
#include "worker/kernels/embedding.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

using EmbeddingGpuTest = GpuTest;

// TA: the output / dout type (BF16 or FP32 residual stream).
template <typename TA>
void CheckEmbedding() {
  const int64_t V = 300, H = 136, T = 517;
  auto table = RandVec(V * H), dout = RandVec(T * H), acc0 = RandVec(V * H);
  std::vector<int32_t> tok(T);
  std::uniform_int_distribution<int> ud(0, 59);  // only 60 ids used: many duplicates
  for (auto& t : tok) t = ud(Rng()) * 5;
  std::vector<int32_t> order(T);
  for (int i = 0; i < T; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return tok[a] < tok[b]; });
  std::vector<int32_t> uniq, seg;
  for (int i = 0; i < T; ++i)
    if (i == 0 || tok[order[i]] != tok[order[i - 1]]) {
      uniq.push_back(tok[order[i]]);
      seg.push_back(i);
    }
  seg.push_back(T);
  std::unique_ptr<Dev<bf16>> dtab(NewBf16(table));
  std::unique_ptr<Dev<TA>> ddout(NewAct<TA>(dout));
  Dev<int32_t> dtok(T), duniq(uniq.size()), dseg(seg.size()), dord(T);
  Upload(dtok, tok);
  Upload(duniq, uniq);
  Upload(dseg, seg);
  Upload(dord, order);
  Dev<TA> out(T * H);
  Dev<float> acc(V * H);
  Upload(acc, ToF32(acc0));
  ASSERT_OK(kernels::EmbeddingForward(dtab->get(), dtok.get(), T, H, out.get(), nullptr));
  ASSERT_OK(kernels::EmbeddingBackward(ddout->get(), duniq.get(), dseg.get(), dord.get(), uniq.size(), H, acc.get(),
                                       nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> rf(T * H), rb = acc0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      rf[t * H + c] = table[tok[t] * H + c];
      rb[tok[t] * H + c] += dout[t * H + c];
    }
  const std::string tag = std::string(" [") + ActName<TA>() + "]";
  ExpectRelErr("embedding fwd gather (517 tokens, 136 wide)" + tag, Down(out.get(), T * H), rf, 0.0);
  ExpectRelErr("embedding bwd += (deterministic grouping)" + tag, DownF32(acc.get(), V * H), rb, 1e-6);

  // FP32 rows (runtime.embedding_rows: fp32) read in place from registered host memory through
  // its mapped device pointer, as the workers read the master; values off the BF16 grid, so the
  // FP32 output must be exact and the BF16 one their round-to-nearest-even.
  std::vector<float> table32(V * H);
  std::uniform_real_distribution<float> jitter(-1e-3f, 1e-3f);
  for (int64_t i = 0; i < V * H; ++i) table32[i] = static_cast<float>(table[i]) * (1.0f + jitter(Rng())) + 1e-4f;
  ASSERT_CUDA_OK(cudaHostRegister(table32.data(), table32.size() * 4, cudaHostRegisterDefault));
  float* mapped = nullptr;
  ASSERT_CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), table32.data(), 0));
  ASSERT_OK(kernels::EmbeddingForward(mapped, dtok.get(), T, H, out.get(), nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<double> r32(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < H; ++c) {
      const float v = table32[tok[t] * H + c];
      r32[t * H + c] = std::is_same_v<TA, float> ? v : Bf16ToFloat(FloatToBf16(v));
    }
  ExpectRelErr("embedding fwd gather, FP32 rows from mapped host memory" + tag, Down(out.get(), T * H), r32, 0.0);
  ASSERT_CUDA_OK(cudaHostUnregister(table32.data()));
}

TEST_F(EmbeddingGpuTest, Bf16Output) { CheckEmbedding<bf16>(); }
TEST_F(EmbeddingGpuTest, Fp32Output) { CheckEmbedding<float>(); }

}  // namespace
}  // namespace slidedp
