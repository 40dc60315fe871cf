// ShmCollective with real processes: sums in rank order, repeated calls, abort while waiting.
#include "shm/shm_collective.h"

#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "shm/tests/test_util.h"

namespace slidedp::shm {
namespace {

using testing::ChildGuard;
using testing::ForkChild;
using testing::TestNode;
using testing::UniqueJob;

float Value(int rank, int call, int64_t i) { return 0.25f * rank + 0.001f * static_cast<float>(i % 97) + call; }

// Creates a collective of `world` ranks with buffer_bytes each, runs body(collective, rank) in one
// child process per rank (its exit code: 0 for success), expects every child to exit 0, unlinks.
void OnEveryRank(int world, uint64_t buffer_bytes, int (*body)(ShmCollective&, int)) {
  AbortWord abort;
  auto coll = ShmCollective::Create(TestNode(), UniqueJob(), world, buffer_bytes, &abort);
  ASSERT_TRUE(coll.ok()) << coll.status();
  std::vector<std::unique_ptr<ChildGuard>> children;  // ChildGuard kills on destruction: no copies
  for (int r = 0; r < world; ++r) {
    const std::string name = (*coll)->segment_name();
    children.push_back(std::make_unique<ChildGuard>(ForkChild([name, r, body]() -> int {
      AbortWord child_abort;
      auto c = ShmCollective::Attach(name, r, &child_abort);
      if (!c.ok()) return 10;
      return body(**c, r);
    })));
  }
  for (auto& c : children) EXPECT_EQ(c->Wait(), 0);
  EXPECT_TRUE((*coll)->Unlink().ok());
}

TEST(ShmCollectiveTest, ReduceScatterSumsEveryShardAcrossProcesses) {
  constexpr int kWorld = 3;
  constexpr int64_t kShard = 1000;
  OnEveryRank(kWorld, kShard * kWorld * 4, [](ShmCollective& c, int r) -> int {
    for (int call = 0; call < 5; ++call) {
      std::vector<float> buf(kShard * kWorld);
      for (int64_t i = 0; i < static_cast<int64_t>(buf.size()); ++i) buf[i] = Value(r, call, i);
      if (!c.ReduceScatterF32(buf.data(), kShard, absl::Seconds(10)).ok()) return 11;
      for (int64_t i = r * kShard; i < (r + 1) * kShard; ++i) {
        float want = Value(0, call, i);
        for (int q = 1; q < kWorld; ++q) want += Value(q, call, i);
        if (buf[i] != want) return 12;
      }
      // Other shards are left as they were.
      if (r > 0 && buf[0] != Value(r, call, 0)) return 13;
    }
    return 0;
  });
}

TEST(ShmCollectiveTest, AllGatherGivesEveryRankEveryPartAcrossProcesses) {
  constexpr int kWorld = 3;
  constexpr int64_t kPart = 777;
  OnEveryRank(kWorld, kPart * 4, [](ShmCollective& c, int r) -> int {
    for (int call = 0; call < 4; ++call) {
      std::vector<float> out(kPart * kWorld, -1.0f);
      float* local = out.data() + r * kPart;  // in place: the rank's part already in its slice
      for (int64_t i = 0; i < kPart; ++i) local[i] = Value(r, call, i);
      if (!c.AllGatherF32(local, kPart, out.data(), absl::Seconds(10)).ok()) return 11;
      for (int q = 0; q < kWorld; ++q)
        for (int64_t i = 0; i < kPart; ++i)
          if (out[q * kPart + i] != Value(q, call, i)) return 12;
      // A part larger than a buffer (page-rounded) is refused before any wait.
      const int64_t too_many = static_cast<int64_t>(c.buffer_bytes() / sizeof(float)) + 1;
      std::vector<float> big(too_many);
      if (c.AllGatherF32(big.data(), too_many, out.data(), absl::Seconds(1)).code() !=
          absl::StatusCode::kInvalidArgument) {
        return 13;
      }
    }
    return 0;
  });
}

TEST(ShmCollectiveTest, AbortWakesAWaitingRank) {
  AbortWord abort;
  auto coll = ShmCollective::Create(TestNode(), UniqueJob(), 2, 4096, &abort);
  ASSERT_TRUE(coll.ok()) << coll.status();
  auto rank0 = ShmCollective::Attach((*coll)->segment_name(), 0, &abort);
  ASSERT_TRUE(rank0.ok());
  std::thread raiser([&] {
    absl::SleepFor(absl::Milliseconds(100));
    abort.Raise(AbortReason::kPeerDied);
  });
  std::vector<float> buf(256);
  const absl::Time t0 = absl::Now();
  absl::Status s = (*rank0)->ReduceScatterF32(buf.data(), 128, absl::Seconds(30));
  raiser.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_EQ((*rank0)->ReduceScatterF32(buf.data(), 4096, absl::Seconds(1)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmCollective::Attach((*coll)->segment_name(), 2, &abort).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*coll)->Unlink().ok());
}

}  // namespace
}  // namespace slidedp::shm
