// The own flash attention (attention.h) against an FP64 reference: the tensor-core path (head dims
// 128 and 64, both backward work splits, GQA and MHA, 1-token and odd-length documents) and the
// slow path (head dims 16, 48 and 256: eight dims per lane, its limit), plus the ordered-dQ backward
// (AttnArgs::ordered_dq, what SLIDEDP_DETERMINISTIC selects), which must also be bitwise repeatable
// and which the slow path (head dim 256 among them) refuses.
#include "worker/kernels/attention.h"

#include <cstdint>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "worker/kernels/tests/attention_check.h"
#include "worker/kernels/tests/gpu_test.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)
using Split = kernels::AttnArgs::BwdSplit;

struct AttnCase {
  int hd, nq, nkv;
  std::vector<int> docs;
  Split split = Split::kAuto;
  bool ordered = false;
  int window = 0;
  bool sinks = false;
};

// e.g. Hd128_Heads4x2_T403_PerKvHead_OrderedDq
std::string Name(const AttnCase& c) {
  const int T = std::accumulate(c.docs.begin(), c.docs.end(), 0);
  return "Hd" + std::to_string(c.hd) + "_Heads" + std::to_string(c.nq) + "x" + std::to_string(c.nkv) + "_T" +
         std::to_string(T) +
         (c.split == Split::kPerKvHead  ? "_PerKvHead"
          : c.split == Split::kPerQHead ? "_PerQHead"
                                        : "") +
         (c.ordered ? "_OrderedDq" : "") + (c.window > 0 ? "_Window" + std::to_string(c.window) : "") +
         (c.sinks ? "_Sinks" : "");
}
std::string CaseName(const ::testing::TestParamInfo<AttnCase>& info) { return Name(info.param); }
void PrintTo(const AttnCase& c, std::ostream* os) { *os << Name(c); }

class AttentionGpuTest : public GpuTest, public ::testing::WithParamInterface<AttnCase> {};

TEST_P(AttentionGpuTest, MatchesReference) {
  const AttnCase& c = GetParam();
  CheckAttention(c.hd, c.nq, c.nkv, c.docs, c.split, nullptr, c.ordered, c.window, c.sinks);
}

INSTANTIATE_TEST_SUITE_P(Atomic, AttentionGpuTest,
                         ::testing::Values(AttnCase{128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerKvHead},
                                           AttnCase{128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerQHead},
                                           AttnCase{128, 8, 1, {64, 192}, Split::kPerKvHead},
                                           AttnCase{128, 8, 1, {64, 192}, Split::kPerQHead},
                                           AttnCase{64, 4, 2, {64, 129, 31}, Split::kPerKvHead},
                                           AttnCase{64, 4, 2, {64, 129, 31}, Split::kPerQHead},
                                           AttnCase{128, 2, 2, {300, 17}}, AttnCase{16, 4, 2, {17, 40}},
                                           AttnCase{48, 2, 2, {33}}, AttnCase{256, 4, 2, {1, 7, 129}}),
                         CaseName);

// Ordered dQ (SLIDEDP_DETERMINISTIC): both work splits, both head dims, 1-token documents, and
// training-sized documents where many key blocks add into each query block.
INSTANTIATE_TEST_SUITE_P(OrderedDq, AttentionGpuTest,
                         ::testing::Values(AttnCase{128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerKvHead, true},
                                           AttnCase{128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerQHead, true},
                                           AttnCase{64, 4, 2, {64, 129, 31}, Split::kAuto, true},
                                           AttnCase{128, 8, 2, {1024, 900, 700}, Split::kAuto, true}),
                         CaseName);

// Sliding windows (HF's sliding_window: a query sees the `window` keys ending at its own) and
// attention sinks (GPT-OSS), on awkward lengths: window 1 (the token alone), windows shorter than a
// key block, between blocks, longer than some documents and at least the longest; documents shorter
// and longer than the window; both paths, both splits, ordered dQ.
INSTANTIATE_TEST_SUITE_P(
    Window, AttentionGpuTest,
    ::testing::Values(AttnCase{128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerKvHead, false, 1},
                      AttnCase{128, 4, 2, {1, 130, 67, 200, 5}, Split::kPerQHead, false, 17},
                      AttnCase{128, 4, 2, {300, 17, 129}, Split::kAuto, false, 64},
                      AttnCase{128, 8, 2, {1024, 700}, Split::kAuto, false, 128},
                      AttnCase{128, 8, 2, {1024, 700}, Split::kAuto, true, 100},
                      AttnCase{64, 4, 2, {64, 129, 31}, Split::kPerKvHead, false, 33},
                      AttnCase{64, 4, 2, {64, 129, 31}, Split::kPerQHead, false, 200},
                      AttnCase{64, 4, 2, {513, 31}, Split::kAuto, true, 128},
                      AttnCase{16, 4, 2, {17, 40}, Split::kAuto, false, 5}, AttnCase{256, 4, 2, {1, 7, 129}, Split::kAuto, false, 16},
                      AttnCase{64, 8, 2, {300, 17, 129}, Split::kAuto, false, 0, true},
                      AttnCase{64, 8, 2, {300, 17, 129}, Split::kAuto, false, 128, true},
                      AttnCase{64, 8, 2, {300, 17, 129}, Split::kPerQHead, true, 128, true},
                      AttnCase{128, 4, 2, {1, 130, 67}, Split::kAuto, false, 40, true},
                      AttnCase{16, 4, 2, {17, 40}, Split::kAuto, false, 8, true}),
    CaseName);

// The output's low half (AttnArgs::o_lo): values dominated by a shared component (GPT-OSS's v bias),
// both head dims of the tensor-core path and the slow path, with and without sinks.
TEST_F(GpuTest, OutputLowHalfKeepsTheRowDotsExact) {
  CheckOutputLowHalf(64, 4, 2, {384, 200, 17}, /*sinks=*/true, /*bias=*/1.0, /*gain=*/3.0);
  CheckOutputLowHalf(64, 4, 2, {384, 200, 17}, /*sinks=*/false, /*bias=*/1.0, /*gain=*/3.0);
  CheckOutputLowHalf(128, 8, 2, {700, 129}, /*sinks=*/true, /*bias=*/1.0, /*gain=*/3.0);
  CheckOutputLowHalf(32, 4, 2, {130, 40}, /*sinks=*/true, /*bias=*/1.0, /*gain=*/3.0);
}

// Cross attention (context parallelism's zig-zag shares against the gathered keys): both head
// dims of the tensor-core path, the slow path, 2 and 3 ranks, ordered dQ, shares whose pieces
// begin mid-document and documents shorter than a chunk.
struct CrossCase {
  int hd, nq, nkv;
  std::vector<int> docs;
  int ranks;
  bool ordered = false;
};
class CrossAttentionGpuTest : public GpuTest, public ::testing::WithParamInterface<CrossCase> {};
TEST_P(CrossAttentionGpuTest, SharesMatchTheWholeBatch) {
  const CrossCase& c = GetParam();
  CheckCrossAttention(c.hd, c.nq, c.nkv, c.docs, c.ranks, c.ordered);
}
std::string CrossName(const ::testing::TestParamInfo<CrossCase>& info) {
  const CrossCase& c = info.param;
  const int T = std::accumulate(c.docs.begin(), c.docs.end(), 0);
  return "Hd" + std::to_string(c.hd) + "_Heads" + std::to_string(c.nq) + "x" + std::to_string(c.nkv) + "_T" +
         std::to_string(T) + "_Ranks" + std::to_string(c.ranks) + (c.ordered ? "_OrderedDq" : "");
}
INSTANTIATE_TEST_SUITE_P(Cross, CrossAttentionGpuTest,
                         ::testing::Values(CrossCase{128, 4, 2, {700}, 2},
                                           CrossCase{128, 4, 2, {1, 130, 67, 300, 5}, 2},
                                           CrossCase{128, 8, 2, {513, 260}, 3}, CrossCase{64, 4, 2, {450, 70}, 2},
                                           CrossCase{128, 4, 2, {1024, 300}, 2, true},
                                           CrossCase{64, 4, 4, {200, 77}, 3, true}, CrossCase{16, 4, 2, {90, 40}, 2},
                                           CrossCase{48, 2, 2, {61}, 3}),
                         CrossName);

// The slow path adds dK/dV with atomics, so the ordered (bitwise repeatable) backward refuses it
// with FAILED_PRECONDITION rather than run unordered: under SLIDEDP_DETERMINISTIC (the worker's
// backward on the own kernels, ordered dQ) head dim 256 has no backward.
TEST_F(GpuTest, OrderedDqRefusesTheSlowPathAtHeadDim256) {
  const int hd = 256, nq = 2, nkv = 1, T = 8;
  const std::vector<int32_t> cu = {0, T};
  Dev<int32_t> dcu(cu.size());
  Upload(dcu, cu);
  kernels::AttnArgs a;
  a.tokens = T;
  a.num_docs = 1;
  a.max_seqlen = T;
  a.num_q_heads = nq;
  a.num_kv_heads = nkv;
  a.head_dim = hd;
  a.softmax_scale = 1.0f / 16;
  a.cu_seqlens = dcu.get();
  a.ordered_dq = true;
  EXPECT_FALSE(kernels::FlashAttentionFastPath(hd));
  Dev<bf16> q(T * nq * hd), kv(T * nkv * hd), dq(T * nq * hd), dk(T * nkv * hd), dv(T * nkv * hd);
  Dev<float> lse(nq * T);
  Dev<char> ws(kernels::FlashAttentionBackwardWorkspaceBytes(a));
  const absl::Status s = kernels::FlashAttentionBackward(
      a, {q.get(), nq * hd}, {kv.get(), nkv * hd}, {kv.get(), nkv * hd}, {q.get(), nq * hd}, lse.get(),
      {q.get(), nq * hd}, {dq.get(), nq * hd}, {dk.get(), nkv * hd}, {dv.get(), nkv * hd}, ws.get(), nullptr);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s.ToString();
}

}  // namespace
}  // namespace slidedp
