// cuDNN's fused attention (cudnn_attention.h) through the same check as the own kernels
// (attention_check.h): same inputs, FP64 reference and tolerances. Skips where libcudnn cannot be
// loaded (set SLIDEDP_CUDNN_LIB) and for head dims other than 128 that its engines reject; prints,
// without asserting, whether the backward is bitwise repeatable (cuDNN 9.19's Hopper engines add dQ
// with atomics).
#include "worker/kernels/cudnn_attention.h"

#include <cstdio>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/attention_check.h"
#include "worker/kernels/tests/gpu_test.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

struct CudnnCase {
  int hd, nq, nkv;
  std::vector<int> docs;
};

std::string Name(const CudnnCase& c) {
  const int T = std::accumulate(c.docs.begin(), c.docs.end(), 0);
  return "Hd" + std::to_string(c.hd) + "_Heads" + std::to_string(c.nq) + "x" + std::to_string(c.nkv) + "_T" +
         std::to_string(T);
}
std::string CaseName(const ::testing::TestParamInfo<CudnnCase>& info) { return Name(info.param); }
void PrintTo(const CudnnCase& c, std::ostream* os) { *os << Name(c); }

class CudnnAttentionGpuTest : public GpuTest, public ::testing::WithParamInterface<CudnnCase> {};

TEST_P(CudnnAttentionGpuTest, MatchesReference) {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  std::printf("cudnn attention: cuDNN %lld\n", static_cast<long long>((*cudnn)->version()));
  const CudnnCase& c = GetParam();
  CheckAttention(c.hd, c.nq, c.nkv, c.docs, kernels::AttnArgs::BwdSplit::kAuto, cudnn->get());
}

INSTANTIATE_TEST_SUITE_P(Cases, CudnnAttentionGpuTest,
                         ::testing::Values(CudnnCase{128, 4, 2, {1, 130, 67, 200, 5}}, CudnnCase{128, 8, 1, {64, 192}},
                                           CudnnCase{128, 2, 2, {300, 17}}, CudnnCase{64, 4, 2, {64, 129, 31}},
                                           CudnnCase{16, 4, 2, {17, 40}},
                                           // Training-sized documents: many key/value tiles per query tile, where an
                                           // engine that adds dQ with atomics shows up as not repeatable.
                                           CudnnCase{128, 8, 2, {1024, 900, 700}}),
                         CaseName);

}  // namespace
}  // namespace slidedp
