// GlobalBatchSampler: determinism, rank slices, epoch wraparound, resume positions.
#include "common/data/sampler.h"

#include <algorithm>
#include <set>

#include "gtest/gtest.h"

namespace slidedp::data {
namespace {

TEST(Sampler, SameSeedSameRowsDifferentSeedDifferentRows) {
  auto a = GlobalBatchSampler::Create(1000, 32, 1, 7);
  auto b = GlobalBatchSampler::Create(1000, 32, 1, 7);
  auto c = GlobalBatchSampler::Create(1000, 32, 1, 8);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (int64_t step : {0, 1, 5, 30, 31, 100}) {
    EXPECT_EQ(a->GlobalRows(step), b->GlobalRows(step)) << step;
  }
  EXPECT_NE(a->GlobalRows(0), c->GlobalRows(0));
}

TEST(Sampler, PermutationIsStableAcrossBuilds) {
  // Pinned values: a change here silently changes every resumed run's data order.
  EXPECT_EQ(EpochPermutation(8, 42, 0), (std::vector<int64_t>{6, 5, 2, 0, 4, 3, 7, 1}));
}

TEST(Sampler, UnionOfRankSlicesIsTheOneRankBatch) {
  auto one = GlobalBatchSampler::Create(101, 24, 1, 3);
  auto four = GlobalBatchSampler::Create(101, 24, 4, 3);
  ASSERT_TRUE(one.ok() && four.ok());
  for (int64_t step = 0; step < 12; ++step) {
    std::vector<int64_t> joined;
    for (int r = 0; r < 4; ++r) {
      auto part = four->RankRows(step, r);
      EXPECT_EQ(part.size(), 6u);
      joined.insert(joined.end(), part.begin(), part.end());
    }
    EXPECT_EQ(joined, one->GlobalRows(step)) << step;
  }
}

TEST(Sampler, EveryRowOncePerEpochAndWraparoundStraddles) {
  // 10 rows, batch 4: step 2 takes positions 8..11 = epoch 0 [8, 9] + epoch 1 [0, 1].
  auto s = GlobalBatchSampler::Create(10, 4, 2, 11);
  ASSERT_TRUE(s.ok());
  std::vector<int64_t> seen;
  for (int64_t step = 0; step < 5; ++step) {
    auto rows = s->GlobalRows(step);
    seen.insert(seen.end(), rows.begin(), rows.end());
  }
  std::set<int64_t> epoch0(seen.begin(), seen.begin() + 10), epoch1(seen.begin() + 10, seen.begin() + 20);
  EXPECT_EQ(epoch0.size(), 10u);
  EXPECT_EQ(epoch1.size(), 10u);
  const auto p0 = EpochPermutation(10, 11, 0), p1 = EpochPermutation(10, 11, 1);
  EXPECT_NE(p0, p1);
  EXPECT_EQ(s->GlobalRows(2), (std::vector<int64_t>{p0[8], p0[9], p1[0], p1[1]}));
  EXPECT_EQ(s->PositionOfStep(2), (SamplePosition{0, 8}));
  EXPECT_EQ(s->PositionOfStep(3), (SamplePosition{1, 2}));
}

TEST(Sampler, ResumePositionRoundTrips) {
  auto s = GlobalBatchSampler::Create(37, 8, 2, 1);
  ASSERT_TRUE(s.ok());
  for (int64_t step = 0; step < 40; ++step) {
    auto back = s->StepOfPosition(s->PositionOfStep(step));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, step);
  }
  EXPECT_FALSE(s->StepOfPosition({0, 3}).ok());  // not a step boundary
  // A fresh sampler (new process) resumes at the same rows.
  auto fresh = GlobalBatchSampler::Create(37, 8, 2, 1);
  EXPECT_EQ(fresh->RankRows(17, 1), s->RankRows(17, 1));
}

TEST(Sampler, RejectsIndivisibleBatch) {
  EXPECT_EQ(GlobalBatchSampler::Create(10, 6, 4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GlobalBatchSampler::Create(0, 4, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Sampler, NoShuffleIsSequential) {
  auto s = GlobalBatchSampler::Create(5, 3, 1, 0, Shuffle::kNo);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->GlobalRows(1), (std::vector<int64_t>{3, 4, 0}));
}

}  // namespace
}  // namespace slidedp::data
