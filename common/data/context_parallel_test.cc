// The zig-zag split of context parallelism (context_parallel.h): who holds which tokens, the local
// pieces, causal balance, the gather positions and the refusals.
#include "common/data/context_parallel.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace slidedp::data {
namespace {

// A packed micro-batch of T tokens with documents ending at `ends` (the last must be T).
MicroBatch Packed(int64_t T, std::vector<int32_t> ends) {
  MicroBatch m;
  m.cu_seqlens = {0};
  int32_t start = 0;
  for (int32_t e : ends) {
    for (int32_t t = start; t < e; ++t) {
      m.tokens.push_back(1000 + t);
      m.labels.push_back(t + 1 < e ? 1000 + t + 1 : kIgnoreIndex);
      m.positions.push_back(t - start);
    }
    m.cu_seqlens.push_back(e);
    m.max_seqlen = std::max(m.max_seqlen, e - start);
    start = e;
  }
  EXPECT_EQ(m.num_tokens(), T);
  return m;
}

TEST(ContextParallelTest, OneRankKeepsTheMicroBatch) {
  const MicroBatch m = Packed(10, {3, 10});
  auto s = SplitForContextParallel(m, 1);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->shards.size(), 1u);
  EXPECT_EQ(s->shards[0].local.tokens, m.tokens);
  EXPECT_EQ(s->shards[0].local.labels, m.labels);
  EXPECT_EQ(s->shards[0].local.positions, m.positions);
  EXPECT_EQ(s->shards[0].local.cu_seqlens, m.cu_seqlens);
  EXPECT_EQ(s->shards[0].local.max_seqlen, 7);
}

TEST(ContextParallelTest, TwoRanksTakeZigZagChunksWithLocalPieces) {
  const MicroBatch m = Packed(16, {5, 16});
  auto s = SplitForContextParallel(m, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  // Chunks of 4: rank 0 takes [0, 4) and [12, 16), rank 1 [4, 12).
  EXPECT_EQ(s->shards[0].global_index, (std::vector<int64_t>{0, 1, 2, 3, 12, 13, 14, 15}));
  EXPECT_EQ(s->shards[1].global_index, (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(s->shards[0].local.cu_seqlens, (std::vector<int32_t>{0, 4, 8}));  // two runs apart
  EXPECT_EQ(s->shards[1].local.cu_seqlens, (std::vector<int32_t>{0, 1, 8}));  // token 4 ends document 0
  EXPECT_EQ(s->shards[1].local.max_seqlen, 7);
  // Ids, labels (formed on the whole row: token 3's label is token 4) and positions travel along.
  EXPECT_EQ(s->shards[0].local.labels[3], m.labels[3]);
  EXPECT_EQ(s->shards[0].local.labels[3], 1004);
  EXPECT_EQ(s->shards[1].local.positions, (std::vector<int32_t>{4, 0, 1, 2, 3, 4, 5, 6}));
}

TEST(ContextParallelTest, RowsOfOddLengthsAreEachSplitAndBalanced) {
  const std::vector<int64_t> rows = {1200, 37, 611};
  const MicroBatch m = Packed(1848, {500, 1200, 1210, 1237, 1848});
  for (int ranks : {2, 3, 5}) {
    auto s = SplitForContextParallel(m, ranks, rows);
    ASSERT_TRUE(s.ok()) << s.status();
    std::vector<int> seen(m.num_tokens(), 0);
    std::vector<double> work(ranks, 0);  // causal work of the first row: its tokens' index + 1
    for (int r = 0; r < ranks; ++r) {
      const ContextShard& sh = s->shards[r];
      ASSERT_TRUE(std::is_sorted(sh.global_index.begin(), sh.global_index.end()));
      ASSERT_EQ(sh.local.num_tokens(), static_cast<int64_t>(sh.global_index.size()));
      for (size_t i = 0; i < sh.global_index.size(); ++i) {
        const int64_t g = sh.global_index[i];
        ++seen[g];
        EXPECT_EQ(sh.local.tokens[i], m.tokens[g]);
        EXPECT_EQ(sh.local.labels[i], m.labels[g]);
        EXPECT_EQ(sh.local.positions[i], m.positions[g]);
        if (g < 1200) work[r] += g + 1;
      }
      EXPECT_EQ(sh.local.cu_seqlens.back(), sh.local.num_tokens());
      // Shares differ by at most a token per chunk boundary: 2 per row.
      EXPECT_LE(std::abs(sh.local.num_tokens() - m.num_tokens() / ranks), 2 * static_cast<int64_t>(rows.size()));
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << ranks << " ranks";
    const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
    EXPECT_LE(*hi / *lo, 1.01) << "causal work of a row is balanced, " << ranks << " ranks";
    // One rank's share built alone is the split's.
    for (int r = 0; r < ranks; ++r) {
      auto one = ContextShareOf(m, ranks, r, rows);
      ASSERT_TRUE(one.ok()) << one.status();
      EXPECT_EQ(one->global_index, s->shards[r].global_index);
      EXPECT_EQ(one->local.tokens, s->shards[r].local.tokens);
      EXPECT_EQ(one->local.cu_seqlens, s->shards[r].local.cu_seqlens);
      EXPECT_EQ(one->local.context.gathered_position, s->GatheredPosition());
      EXPECT_EQ(one->local.context.part, s->max_local_tokens());
    }
    EXPECT_EQ(ContextShareOf(m, ranks, ranks, rows).status().code(), absl::StatusCode::kInvalidArgument);
    // The padded gather places every token once.
    const std::vector<int64_t> pos = s->GatheredPosition();
    std::vector<int64_t> sorted = pos;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
    EXPECT_GE(sorted.front(), 0);
    EXPECT_LT(sorted.back(), ranks * s->max_local_tokens());
  }
}

TEST(ContextParallelTest, RefusesWhatCannotBeSplit) {
  const MicroBatch m = Packed(8, {8});
  EXPECT_EQ(SplitForContextParallel(m, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitForContextParallel(m, 2, std::vector<int64_t>{3, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);  // rows add up to 7
  EXPECT_EQ(SplitForContextParallel(m, 2, std::vector<int64_t>{8, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitForContextParallel(m, 9).status().code(), absl::StatusCode::kInvalidArgument);  // 8 tokens, 9 ranks
  MicroBatch bad = m;
  bad.labels.pop_back();
  EXPECT_EQ(SplitForContextParallel(bad, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SplitForContextParallel(m, 5).ok());  // uneven chunks, but every rank holds a token
}

// The key ranges of each share's pieces and the inverse gather rows (CUDA's cross attention).
TEST(ContextParallelTest, AttentionOfAShareNamesEachPiecesKeysAndTheGatherRows) {
  const MicroBatch m = Packed(16, {5, 16});
  for (int rank : {0, 1}) {
    auto share = ContextShareOf(m, 2, rank);
    ASSERT_TRUE(share.ok()) << share.status();
    auto a = ContextAttentionOf(share->local);
    ASSERT_TRUE(a.ok()) << a.status();
    if (rank == 0) {  // pieces [0, 4) of document 0 and [12, 16) of document 1 (from 5)
      EXPECT_EQ(a->kv_bounds, (std::vector<int32_t>{0, 4, 5, 16}));
      EXPECT_EQ(a->max_keys, 11);
    } else {  // [4, 5) of document 0 and [5, 12) of document 1
      EXPECT_EQ(a->kv_bounds, (std::vector<int32_t>{0, 5, 5, 12}));
      EXPECT_EQ(a->max_keys, 7);
    }
    // Part 8: rank 0's rows hold tokens 0-3, 12-15; rank 1's 4-11.
    EXPECT_EQ(a->gather_rows, (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11}));
  }
  // Uneven parts leave padding rows (-1).
  auto odd = ContextShareOf(Packed(9, {9}), 2, 0);
  ASSERT_TRUE(odd.ok());
  auto a = ContextAttentionOf(odd->local);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(std::count(a->gather_rows.begin(), a->gather_rows.end(), -1), 2 * odd->local.context.part - 9);
  // A micro-batch of its own has no context attention.
  EXPECT_EQ(ContextAttentionOf(m).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ContextParallelTest, ShareValidationRefusesInconsistentContexts) {
  const MicroBatch m = Packed(16, {5, 16});
  auto share = ContextShareOf(m, 2, 1);
  ASSERT_TRUE(share.ok());
  EXPECT_TRUE(ValidateContextShare(share->local).ok());
  auto broken = [&](auto mutate) {
    MicroBatch b = share->local;
    mutate(b);
    return ValidateContextShare(b).code();
  };
  EXPECT_EQ(broken([](MicroBatch& b) { b.context.rank = 2; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](MicroBatch& b) { b.context.global_index[2] = 3; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](MicroBatch& b) { b.context.gathered_position[0] = 99; }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](MicroBatch& b) {
              b.context.full_cu_seqlens = {0, 16};
            }),                      // piece 4..5 would span
            absl::StatusCode::kOk);  // one document: still a run
  EXPECT_EQ(broken([](MicroBatch& b) {
              b.cu_seqlens = {0, 8};
            }),  // 4..11 crosses document 0's end
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(broken([](MicroBatch& b) { b.context.part = 7; }), absl::StatusCode::kInvalidArgument);
  // Two tokens gathering from the same row.
  MicroBatch dup = share->local;
  dup.context.gathered_position[0] = dup.context.gathered_position[1];
  EXPECT_EQ(ContextAttentionOf(dup).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp::data
