// Futex waits across processes: VersionGate publish/wait, timeouts, the abort word, and a dead
// publisher turning into UNAVAILABLE instead of a hang.
#include "shm/futex.h"

#include <unistd.h>

#include <new>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "shm/shm_segment.h"
#include "shm/tests/test_util.h"

namespace slidedp::shm {
namespace {

using testing::ChildGuard;
using testing::ForkChild;
using testing::ScopedUnlink;
using testing::WaitChild;

// A segment holding one AbortWord and one VersionGate, shared with forked children.
struct SharedWords {
  AbortWord abort;
  VersionGate gate;
};

class FutexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = MakeSegmentName(testing::TestNode(), testing::UniqueJob(), "futex").value();
    cleanup_ = std::make_unique<ScopedUnlink>(name_);
    auto seg = ShmSegment::Create(name_, {RegionSpec{"words", sizeof(SharedWords)}});
    ASSERT_TRUE(seg.ok()) << seg.status();
    seg_ = std::move(*seg);
    words_ = new (seg_->data(*seg_->FindRegion("words"))) SharedWords();
  }
  // The child's own mapping (at another address), as a real peer would have.
  SharedWords* ChildWords(std::unique_ptr<ShmSegment>* keep) {
    *keep = std::move(ShmSegment::Open(name_, Access::kReadWrite)).value();
    return static_cast<SharedWords*>((*keep)->data(*(*keep)->FindRegion("words")));
  }

  std::string name_;
  std::unique_ptr<ScopedUnlink> cleanup_;
  std::unique_ptr<ShmSegment> seg_;
  SharedWords* words_ = nullptr;
};

TEST_F(FutexTest, VersionGateWaitsForChildPublish) {
  pid_t child = ForkChild([&] {
    std::unique_ptr<ShmSegment> keep;
    SharedWords* w = ChildWords(&keep);
    ::usleep(50'000);
    w->gate.Publish(3);  // not enough for the waiter
    ::usleep(100'000);
    w->gate.Publish(5);
    return 0;
  });
  ChildGuard guard(child);
  const absl::Time start = absl::Now();
  absl::Status s = words_->gate.WaitAtLeast(5, absl::Seconds(10), words_->abort, IdentityOf(child));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(words_->gate.Load(), 5u);
  EXPECT_GE(waited, absl::Milliseconds(120)) << "returned before version 5 was published";
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_EQ(guard.Wait(), 0);
  // Already satisfied: returns at once.
  EXPECT_TRUE(words_->gate.WaitAtLeast(4, absl::ZeroDuration(), words_->abort).ok());
}

TEST_F(FutexTest, PublishWakesWaitersInSeveralProcesses) {
  std::vector<pid_t> children;
  for (int i = 0; i < 4; ++i) {
    children.push_back(ForkChild([&] {
      std::unique_ptr<ShmSegment> keep;
      SharedWords* w = ChildWords(&keep);
      const absl::Time start = absl::Now();
      // Long slice: the wake must come from FUTEX_WAKE, not from polling.
      WaitGuards g;
      g.abort = &w->abort;
      g.slice = absl::Seconds(5);
      absl::Status s = w->gate.WaitAtLeast(1, absl::Seconds(10), g);
      if (!s.ok()) return 1;
      return absl::Now() - start < absl::Seconds(3) ? 0 : 2;
    }));
  }
  ::usleep(200'000);
  words_->gate.Publish(1);
  for (pid_t c : children) EXPECT_EQ(WaitChild(c), 0);
}

TEST_F(FutexTest, TimeoutIsDeadlineExceededWithTheWaitTime) {
  const absl::Time start = absl::Now();
  absl::Status s = words_->gate.WaitAtLeast(1, absl::Milliseconds(150), words_->abort);
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("waited"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("version >= 1"), absl::string_view::npos) << s;
  EXPECT_GE(waited, absl::Milliseconds(150));
  EXPECT_LT(waited, absl::Seconds(1));
}

TEST_F(FutexTest, AbortFromAnotherProcessWakesWaiterQuickly) {
  pid_t child = ForkChild([&] {
    std::unique_ptr<ShmSegment> keep;
    SharedWords* w = ChildWords(&keep);
    ::usleep(100'000);
    return w->abort.Raise(AbortReason::kCancelled) ? 0 : 1;
  });
  ChildGuard guard(child);
  const absl::Time start = absl::Now();
  absl::Status s = words_->gate.WaitAtLeast(1, absl::Seconds(10), words_->abort);
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("cancelled"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find(absl::StrCat("pid ", child)), absl::string_view::npos) << s;
  EXPECT_LT(waited, absl::Milliseconds(500));
  EXPECT_EQ(guard.Wait(), 0);
}

TEST_F(FutexTest, DeadPublisherIsUnavailableNotAHang) {
  pid_t child = ForkChild([] {
    ::usleep(100'000);
    return 0;  // exits without publishing; stays a zombie until reaped below
  });
  ChildGuard guard(child);
  const absl::Time start = absl::Now();
  absl::Status s = words_->gate.WaitAtLeast(1, absl::Seconds(30), words_->abort, IdentityOf(child));
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(absl::StrCat("pid ", child, " died")), absl::string_view::npos) << s;
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_EQ(guard.Wait(), 0);
}

TEST(AbortWord, FirstRaiseWins) {
  AbortWord w;
  EXPECT_FALSE(w.raised());
  EXPECT_TRUE(w.ToStatus().ok());
  EXPECT_TRUE(w.Raise(AbortReason::kWorkerFailed));
  EXPECT_FALSE(w.Raise(AbortReason::kShutdown));
  EXPECT_TRUE(w.raised());
  EXPECT_EQ(w.reason(), AbortReason::kWorkerFailed);
  EXPECT_EQ(w.raised_by_pid(), ::getpid());
  EXPECT_EQ(w.ToStatus().code(), absl::StatusCode::kAborted);
  w.Reset();
  EXPECT_FALSE(w.raised());
}

}  // namespace
}  // namespace slidedp::shm
