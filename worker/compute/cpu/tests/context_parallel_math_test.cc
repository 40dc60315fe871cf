// AttentionForwardRows / AttentionBackwardRows (dense_reference_math.h) on the zig-zag split of a
// packed micro-batch (common/data/context_parallel.h) against the whole micro-batch's
// AttentionForward / AttentionBackward: each rank's output, lse and dq rows bit for bit the whole
// attention's, and the ranks' dk and dv summed in rank order within summation-order tolerance; full
// causal attention and a sliding window shorter than most documents.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/data/context_parallel.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu/dense_reference_math.h"

namespace slidedp {
namespace {

template <typename R>
std::vector<R> Random(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<R> v(n);
  for (R& x : v) x = static_cast<R>(dist(gen));
  return v;
}

template <typename R>
void CheckSplit(int ranks, double tol, int64_t window = 0) {
  DecoderDims d;
  d.heads = 4;
  d.kv_heads = 2;
  d.head_dim = 8;
  const int64_t qd = d.q_dim(), kvd = d.kv_dim();
  // Packed documents crossing the chunk boundaries, in two rows (39 + 28 tokens).
  MicroBatch mb;
  const std::vector<int32_t> ends = {7, 30, 39, 50, 67};
  mb.cu_seqlens = {0};
  for (int32_t e : ends) {
    for (int32_t t = mb.cu_seqlens.back(); t < e; ++t) {
      mb.tokens.push_back(t);
      mb.labels.push_back(t);
      mb.positions.push_back(t - mb.cu_seqlens.back());
    }
    mb.cu_seqlens.push_back(e);
  }
  const int64_t T = mb.num_tokens();
  TokenGeometry geom;
  geom.num_tokens = T;
  geom.num_docs = static_cast<int64_t>(ends.size());
  geom.cu_seqlens = mb.cu_seqlens.data();

  const std::vector<R> q = Random<R>(T * qd, 1), k = Random<R>(T * kvd, 2), v = Random<R>(T * kvd, 3),
                       dout = Random<R>(T * qd, 4);
  std::vector<R> attn(T * qd), lse(T * d.heads), dq(T * qd), dk(T * kvd), dv(T * kvd);
  AttentionForward(d, geom, window, q.data(), k.data(), v.data(), attn.data(), lse.data(), nullptr);
  AttentionBackward(d, geom, window, q.data(), k.data(), v.data(), attn.data(), lse.data(), dout.data(), dq.data(),
                    dk.data(), dv.data(), nullptr);

  auto split = data::SplitForContextParallel(mb, ranks, std::vector<int64_t>{39, 28});
  ASSERT_TRUE(split.ok()) << split.status();
  std::vector<R> dk_sum(T * kvd, R(0)), dv_sum(T * kvd, R(0));
  for (int r = 0; r < ranks; ++r) {
    const std::vector<int64_t>& rows = split->shards[r].global_index;
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<R> lq(n * qd), ldout(n * qd);
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(q.begin() + rows[i] * qd, qd, lq.begin() + i * qd);
      std::copy_n(dout.begin() + rows[i] * qd, qd, ldout.begin() + i * qd);
    }
    std::vector<R> lattn(n * qd), llse(n * d.heads), ldq(n * qd), ldk(T * kvd, R(7)), ldv(T * kvd, R(7));
    AttentionForwardRows(d, geom, window, rows.data(), n, lq.data(), k.data(), v.data(), lattn.data(), llse.data(),
                         nullptr);
    AttentionBackwardRows(d, geom, window, rows.data(), n, lq.data(), k.data(), v.data(), lattn.data(), llse.data(),
                          ldout.data(), ldq.data(), ldk.data(), ldv.data(), nullptr);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < qd; ++c) {
        ASSERT_EQ(lattn[i * qd + c], attn[rows[i] * qd + c]) << "rank " << r << " row " << rows[i];
        ASSERT_EQ(ldq[i * qd + c], dq[rows[i] * qd + c]) << "rank " << r << " row " << rows[i];
      }
      for (int64_t h = 0; h < d.heads; ++h) ASSERT_EQ(llse[i * d.heads + h], lse[rows[i] * d.heads + h]);
    }
    for (int64_t i = 0; i < T * kvd; ++i) {  // rank order, as the group's reduce-scatter sums
      dk_sum[i] += ldk[i];
      dv_sum[i] += ldv[i];
    }
  }
  double worst = 0;
  for (int64_t i = 0; i < T * kvd; ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(dk_sum[i] - dk[i])) / (1e-3 + std::abs(dk[i])));
    worst = std::max(worst, std::abs(static_cast<double>(dv_sum[i] - dv[i])) / (1e-3 + std::abs(dv[i])));
  }
  EXPECT_LE(worst, tol) << ranks << " ranks";
}

TEST(ContextParallelMathTest, RowsOfTwoRanksAreTheWholeAttentionsFloat) { CheckSplit<float>(2, 1e-4); }
TEST(ContextParallelMathTest, RowsOfThreeRanksAreTheWholeAttentionsFloat) { CheckSplit<float>(3, 1e-4); }
TEST(ContextParallelMathTest, RowsOfFourRanksAreTheWholeAttentionsDouble) { CheckSplit<double>(4, 1e-12); }
TEST(ContextParallelMathTest, OneRankIsTheWholeAttention) { CheckSplit<double>(1, 0); }
TEST(ContextParallelMathTest, SlidingWindowRowsAreTheWholeAttentions) {
  CheckSplit<float>(2, 1e-4, 5);
  CheckSplit<double>(3, 1e-12, 5);
  CheckSplit<double>(1, 0, 1);
}

}  // namespace
}  // namespace slidedp
