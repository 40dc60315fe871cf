// cuDNN's fused attention (cudnn_attention.h) through the same check as the own kernels
// (attention_check.h): same inputs, FP64 reference and tolerances. Skips where libcudnn cannot be
// loaded (set SLIDEDP_CUDNN_LIB) and for head dims other than 128 and 256 that its engines reject
// (256: Qwen3.5's full attention, which cuDNN 9 serves on Hopper forward and backward); prints,
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
  // Options: a one-document call ragged rather than dense, dense with the padding mask, and the
  // ragged offset limit in rows of the widest tensor (0: INT32's), which cuts the call into groups.
  bool ragged_single = false, dense_padding = false;
  int limit_rows = 0;
  int window = 0;  // AttnArgs::window: the left-bound mask (0: none)
};

std::string Name(const CudnnCase& c) {
  const int T = std::accumulate(c.docs.begin(), c.docs.end(), 0);
  return "Hd" + std::to_string(c.hd) + "_Heads" + std::to_string(c.nq) + "x" + std::to_string(c.nkv) + "_T" +
         std::to_string(T) + (c.docs.size() == 1 ? "_OneDoc" : "") + (c.ragged_single ? "_Ragged" : "") +
         (c.dense_padding ? "_DensePadding" : "") + (c.limit_rows > 0 ? "_Limit" + std::to_string(c.limit_rows) : "") +
         (c.window > 0 ? "_Window" + std::to_string(c.window) : "");
}
std::string CaseName(const ::testing::TestParamInfo<CudnnCase>& info) { return Name(info.param); }
void PrintTo(const CudnnCase& c, std::ostream* os) { *os << Name(c); }

class CudnnAttentionGpuTest : public GpuTest, public ::testing::WithParamInterface<CudnnCase> {};

TEST_P(CudnnAttentionGpuTest, MatchesReference) {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  std::printf("cudnn attention: cuDNN %lld\n", static_cast<long long>((*cudnn)->version()));
  const CudnnCase& c = GetParam();
  kernels::CudnnAttentionOptions opt;
  opt.dense_single_document = !c.ragged_single;
  opt.dense_min_tokens = 0;  // the cases' documents are short
  opt.dense_padding_mask = c.dense_padding;
  opt.window_mask = c.window > 0;
  // The widest row of CheckAttention's tensors is v's (nkv·hd + 24).
  if (c.limit_rows > 0) opt.ragged_offset_limit = int64_t{c.limit_rows} * (c.nkv * c.hd + 24);
  (*cudnn)->set_options(opt);
  CheckAttention(c.hd, c.nq, c.nkv, c.docs, kernels::AttnArgs::BwdSplit::kAuto, cudnn->get(), false, c.window);
}

// Sliding windows through cuDNN's left-bound mask (Gemma 3's head_dim 256 and 128): ragged
// documents shorter and longer than the window, one dense document, window 1, a window longer than
// every document (the causal mask alone).
INSTANTIATE_TEST_SUITE_P(Windows, CudnnAttentionGpuTest,
                         ::testing::Values(CudnnCase{256, 8, 4, {1, 130, 67, 300, 5}, false, false, 0, 100},
                                           CudnnCase{256, 4, 1, {777}, false, false, 0, 512},
                                           CudnnCase{128, 8, 2, {1024, 300}, false, false, 0, 333},
                                           CudnnCase{128, 4, 2, {200, 64}, false, false, 0, 1},
                                           CudnnCase{128, 4, 2, {200, 64}, false, false, 0, 4096}),
                         CaseName);

INSTANTIATE_TEST_SUITE_P(Cases, CudnnAttentionGpuTest,
                         ::testing::Values(CudnnCase{128, 4, 2, {1, 130, 67, 200, 5}}, CudnnCase{128, 8, 1, {64, 192}},
                                           CudnnCase{128, 2, 2, {300, 17}}, CudnnCase{64, 4, 2, {64, 129, 31}},
                                           CudnnCase{16, 4, 2, {17, 40}},
                                           // Qwen3.5's full attention (head dim 256): ragged documents
                                           // of awkward lengths, and one dense document.
                                           CudnnCase{256, 8, 2, {1, 130, 67, 7}}, CudnnCase{256, 4, 1, {777}},
                                           // Training-sized documents: many key/value tiles per query tile, where an
                                           // engine that adds dQ with atomics shows up as not repeatable.
                                           CudnnCase{128, 8, 2, {1024, 900, 700}},
                                           // One document: dense (odd length), ragged, dense with the padding mask.
                                           CudnnCase{128, 8, 2, {777}}, CudnnCase{128, 8, 2, {777}, true},
                                           CudnnCase{128, 4, 4, {1000}, false, true},
                                           // Offsets over the limit: groups of documents, a document too long for
                                           // any group alone (dense), one that fills a group by itself.
                                           CudnnCase{
                                               128, 4, 2, {1, 130, 67, 200, 5, 400, 90, 250, 3}, false, false, 256},
                                           CudnnCase{128, 8, 2, {1024, 300}, false, false, 512}),
                         CaseName);

// Cross attention (context parallelism's zig-zag shares against the gathered keys) on cuDNN: each
// query piece one dense entry with the bottom-right causal diagonal; the shares' O, LSE, dQ and
// the dK / dV they add against the whole batch's FP64 reference (attention_check.h).
struct CudnnCrossCase {
  int nq, nkv;
  std::vector<int> docs;
  int ranks;
};
class CudnnCrossAttentionGpuTest : public GpuTest, public ::testing::WithParamInterface<CudnnCrossCase> {};
TEST_P(CudnnCrossAttentionGpuTest, SharesMatchTheWholeBatch) {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  kernels::CudnnAttentionOptions opt;
  opt.cross = true;
  opt.cross_min_tokens = 0;  // the cases' pieces are short
  (*cudnn)->set_options(opt);
  const CudnnCrossCase& c = GetParam();
  CheckCrossAttention(128, c.nq, c.nkv, c.docs, c.ranks, /*ordered=*/false, cudnn->get());
}
INSTANTIATE_TEST_SUITE_P(Cross, CudnnCrossAttentionGpuTest,
                         ::testing::Values(CudnnCrossCase{4, 2, {700}, 2}, CudnnCrossCase{8, 2, {1024, 300}, 2},
                                           CudnnCrossCase{8, 2, {513, 260}, 3}, CudnnCrossCase{4, 4, {777}, 2}),
                         [](const ::testing::TestParamInfo<CudnnCrossCase>& info) {
                           const CudnnCrossCase& c = info.param;
                           std::string name = "Heads" + std::to_string(c.nq) + "x" + std::to_string(c.nkv);
                           for (int d : c.docs) name += "_" + std::to_string(d);
                           return name + "_Ranks" + std::to_string(c.ranks);
                         });

// `docs` documents of `tokens` in all (max_seqlen: all of them), 2 heads of 128, rows 256 wide.
kernels::AttnArgs TwoHeads(const int32_t* cu_seqlens, int docs, int tokens) {
  kernels::AttnArgs a;
  a.tokens = a.max_seqlen = tokens;
  a.num_docs = docs;
  a.num_q_heads = a.num_kv_heads = 2;
  a.head_dim = 128;
  a.softmax_scale = 0.1f;
  a.cu_seqlens = cu_seqlens;
  return a;
}

// A dense plan serves one length: past kMaxDensePlans lengths the least recently used go, and a
// call after that still runs (its plan built again).
TEST_F(GpuTest, CudnnDensePlansStayBounded) {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  kernels::CudnnAttentionOptions opt;
  opt.dense_min_tokens = 0;
  (*cudnn)->set_options(opt);
  const int lengths = kernels::CudnnAttention::kMaxDensePlans + 4;
  Dev<int32_t> cu(2);
  const kernels::AttnRowStrides ld{256, 256, 256, 256, 256, 256, 256, 256};
  kernels::AttnArgs a = TwoHeads(cu.get(), 1, 64);
  for (int i = 0; i < lengths; ++i) {
    a.tokens = a.max_seqlen = 64 + i;
    ASSERT_TRUE((*cudnn)->ForwardWorkspaceBytes(a, ld).ok());
    EXPECT_LE((*cudnn)->cached_plans(/*dense_only=*/true), kernels::CudnnAttention::kMaxDensePlans) << i;
  }
  EXPECT_EQ((*cudnn)->cached_plans(true), kernels::CudnnAttention::kMaxDensePlans);
  // The first length's plan went; running it again builds it anew.
  a.tokens = a.max_seqlen = 64;
  Upload(cu, std::vector<int32_t>{0, 64});
  Dev<bf16> q(64 * 256), o(64 * 256);
  Dev<float> lse(2 * 64);
  absl::StatusOr<int64_t> ws = (*cudnn)->ForwardWorkspaceBytes(a, ld);
  ASSERT_TRUE(ws.ok()) << ws.status();
  Dev<char> w(*ws);
  ASSERT_TRUE(
      (*cudnn)
          ->Forward(a, {q.get(), 256}, {q.get(), 256}, {q.get(), 256}, {o.get(), 256}, lse.get(), w.get(), nullptr)
          .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ((*cudnn)->cached_plans(true), kernels::CudnnAttention::kMaxDensePlans);
}

// A long call of several documents without their host copy cannot be grouped: UNIMPLEMENTED (the
// backend then runs the own kernels), not a wrong answer.
TEST_F(GpuTest, CudnnLongCallWithoutHostBoundariesIsUnimplemented) {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  kernels::CudnnAttentionOptions opt;
  opt.ragged_offset_limit = 64 * 256;
  (*cudnn)->set_options(opt);
  Dev<int32_t> cu(3);
  Upload(cu, std::vector<int32_t>{0, 100, 200});
  kernels::AttnArgs a = TwoHeads(cu.get(), 2, 200);
  a.max_seqlen = 100;
  const kernels::AttnRowStrides ld{256, 256, 256, 256, 256, 256, 256, 256};
  absl::StatusOr<int64_t> ws = (*cudnn)->ForwardWorkspaceBytes(a, ld);
  EXPECT_TRUE(absl::IsUnimplemented(ws.status())) << ws.status();
  const int32_t host[3] = {0, 100, 200};
  a.cu_seqlens_host = host;
  EXPECT_TRUE((*cudnn)->ForwardWorkspaceBytes(a, ld).ok());
}

// Off by default, and for pieces under cross_min_tokens: UNIMPLEMENTED (the own kernels run them).
TEST_F(GpuTest, CudnnCrossAttentionNeedsTheOptionAndLongPieces) {
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  const int32_t cu[3] = {0, 100, 200}, bounds[4] = {0, 100, 0, 400};
  Dev<int32_t> dcu(3), dbounds(4);
  Upload(dcu, std::vector<int32_t>(cu, cu + 3));
  Upload(dbounds, std::vector<int32_t>(bounds, bounds + 4));
  kernels::AttnArgs a = TwoHeads(dcu.get(), 2, 200);
  a.max_seqlen = 100;
  a.cu_seqlens_host = cu;
  a.kv_bounds = dbounds.get();
  a.kv_bounds_host = bounds;
  a.kv_tokens = 400;
  a.max_seqlen_kv = 400;
  const kernels::AttnRowStrides ld{256, 256, 256, 256, 256, 256, 0, 0};
  EXPECT_TRUE(absl::IsUnimplemented((*cudnn)->ForwardWorkspaceBytes(a, ld).status()));
  kernels::CudnnAttentionOptions opt;
  opt.cross = true;
  (*cudnn)->set_options(opt);  // cross_min_tokens 32768
  EXPECT_TRUE(absl::IsUnimplemented((*cudnn)->ForwardWorkspaceBytes(a, ld).status()));
  opt.cross_min_tokens = 100;
  (*cudnn)->set_options(opt);
  EXPECT_TRUE((*cudnn)->ForwardWorkspaceBytes(a, ld).ok());
  // Keys fewer than the queries: a bad call, not a fallback.
  const int32_t short_keys[4] = {0, 100, 0, 50};
  a.kv_bounds_host = short_keys;
  EXPECT_TRUE(absl::IsInvalidArgument((*cudnn)->ForwardWorkspaceBytes(a, ld).status()));
}

}  // namespace
}  // namespace slidedp
