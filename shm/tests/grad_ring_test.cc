// GradRing with real processes: a producer child streams 10k chunks through a 4-slot ring
// (order, content, backpressure), and a peer that dies (SIGKILL) on either side turns the other
// side's wait into an error within a bounded time.
#include "shm/grad_ring.h"

#include <signal.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "shm/tests/test_util.h"

namespace slidedp::shm {
namespace {

using testing::ChildGuard;
using testing::ForkChild;
using testing::ScopedUnlink;
using testing::WaitChild;

// Deterministic chunk content: element j of chunk i.
float ChunkValue(uint32_t i, int64_t j) {
  return static_cast<float>((i * 131 + j * 7) % 256) - 128.0f;
}  // exact in bf16
int64_t ChunkNumel(uint32_t i, uint64_t slot_bytes) {
  return 1 + static_cast<int64_t>((i * 7919ull) % (slot_bytes / 4));
}

// Pipe for "child is ready" handshakes.
struct Pipe {
  int fds[2] = {-1, -1};
  Pipe() { EXPECT_EQ(::pipe(fds), 0); }
  ~Pipe() {
    ::close(fds[0]);
    ::close(fds[1]);
  }
  void Signal() {
    char c = 1;
    (void)!::write(fds[1], &c, 1);
  }
  void Await() {
    char c;
    (void)!::read(fds[0], &c, 1);
  }
};

class GradRingTest : public ::testing::Test {
 protected:
  std::unique_ptr<GradRing> NewRing(const GradRingConfig& config, RingRole role, const AbortWord* abort = nullptr) {
    auto ring = GradRing::Create(testing::TestNode(), testing::UniqueJob(), 0, config, role, abort);
    EXPECT_TRUE(ring.ok()) << ring.status();
    if (!ring.ok()) return nullptr;
    cleanup_.push_back(std::make_unique<ScopedUnlink>((*ring)->segment_name()));
    return std::move(*ring);
  }
  std::vector<std::unique_ptr<ScopedUnlink>> cleanup_;
};

TEST_F(GradRingTest, SingleProcessContract) {
  GradRingConfig config{4, 1000};
  auto consumer = NewRing(config, RingRole::kConsumer);
  ASSERT_NE(consumer, nullptr);
  EXPECT_TRUE(absl::StrContains(consumer->segment_name(), ".ring0"));
  EXPECT_EQ(consumer->bytes(), GradRing::SegmentBytes(config));
  EXPECT_EQ(consumer->consumer().pid, ::getpid());
  EXPECT_EQ(consumer->producer().pid, 0);
  auto producer = GradRing::Attach(consumer->segment_name(), RingRole::kProducer, nullptr);
  ASSERT_TRUE(producer.ok()) << producer.status();
  GradRing& p = **producer;
  EXPECT_EQ(consumer->producer().pid, ::getpid());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p.slot_data(1)) % kPageBytes, 0u);

  std::vector<uint32_t> slots;
  for (int i = 0; i < 4; ++i) slots.push_back(p.AcquireSlot(absl::Seconds(1)).value());
  std::sort(slots.begin(), slots.end());
  EXPECT_EQ(slots, (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(p.free_slots(), 0u);
  const absl::Time start = absl::Now();
  auto none = p.AcquireSlot(absl::Milliseconds(100));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded) << none.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));

  EXPECT_EQ(p.Post({0, 9, 0, 1, 0, ChunkKind::kGradF32}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.Post({0, 2, 0, 251, 0, ChunkKind::kGradF32}).code(), absl::StatusCode::kInvalidArgument)
      << "1004 bytes do not fit a 1000-byte slot";
  EXPECT_TRUE(p.Post({0, 2, 0, 500, 0, ChunkKind::kGradBF16}).ok());
  EXPECT_TRUE(p.Post({1, 0, 64, 250, 0, ChunkKind::kGradF32}).ok());
  EXPECT_EQ(consumer->queued(), 2u);

  auto d1 = consumer->Pop(absl::Seconds(1));
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(d1->slot, 2u);
  EXPECT_EQ(d1->kind, ChunkKind::kGradBF16);
  auto d2 = consumer->Pop(absl::Seconds(1));
  ASSERT_TRUE(d2.ok());
  EXPECT_EQ(d2->unit, 1);
  EXPECT_EQ(d2->offset_numel, 64);
  EXPECT_EQ(consumer->Pop(absl::Milliseconds(50)).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(consumer->Release(2).ok());
  EXPECT_EQ(consumer->Release(2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(p.Post({0, 2, 0, 1, 0, ChunkKind::kGradF32}).code(), absl::StatusCode::kInvalidArgument)
      << "posting a released slot";
  EXPECT_EQ(p.AcquireSlot(absl::Seconds(1)).value(), 2u);

  p.Close();
  EXPECT_EQ(consumer->Pop(absl::Seconds(1)).status().code(), absl::StatusCode::kOutOfRange);
}

TEST_F(GradRingTest, AbortWordEndsWaitsOnBothSides) {
  AbortWord abort;  // in-process is enough here; cross-process abort is in futex_test
  auto ring = NewRing({1, 64}, RingRole::kConsumer, &abort);
  ASSERT_NE(ring, nullptr);
  ASSERT_TRUE(ring->AcquireSlot(absl::Seconds(1)).ok());
  abort.Raise(AbortReason::kShutdown);
  EXPECT_EQ(ring->AcquireSlot(absl::Seconds(10)).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(ring->Pop(absl::Seconds(10)).status().code(), absl::StatusCode::kAborted);
}

TEST_F(GradRingTest, ProducerProcessStreams10kChunksThroughFourSlots) {
  const GradRingConfig config{4, 16 << 10};
  auto ring = NewRing(config, RingRole::kConsumer);
  ASSERT_NE(ring, nullptr);
  const std::string name = ring->segment_name();
  constexpr uint32_t kChunks = 10000;

  pid_t child = ForkChild([&] {
    auto p = GradRing::Attach(name, RingRole::kProducer, nullptr);
    if (!p.ok()) return 1;
    int blocked = 0;
    for (uint32_t i = 0; i < kChunks; ++i) {
      const absl::Time t0 = absl::Now();
      auto slot = (*p)->AcquireSlot(absl::Seconds(10));
      if (!slot.ok()) return 2;
      if (absl::Now() - t0 > absl::Milliseconds(5)) ++blocked;
      GradChunkDesc d;
      d.unit = static_cast<int32_t>(i % 30);
      d.slot = *slot;
      d.offset_numel = i;
      d.step = i;
      d.kind = i % 2 ? ChunkKind::kGradBF16 : ChunkKind::kGradF32;
      d.numel = ChunkNumel(i, config.slot_bytes) * (d.kind == ChunkKind::kGradBF16 ? 2 : 1);
      void* data = (*p)->slot_data(*slot);
      for (int64_t j = 0; j < d.numel; ++j) {
        if (d.kind == ChunkKind::kGradF32) {
          static_cast<float*>(data)[j] = ChunkValue(i, j);
        } else {
          static_cast<bf16_t*>(data)[j] = FloatToBf16(ChunkValue(i, j));
        }
      }
      if (!(*p)->Post(d).ok()) return 3;
    }
    (*p)->Close();
    return blocked > 0 ? 0 : 4;  // 4: the consumer's pauses never caused backpressure
  });
  ChildGuard guard(child);

  uint32_t expected = 0;
  double checksum_seen = 0, checksum_expected = 0;
  while (true) {
    auto d = ring->Pop(absl::Seconds(10));
    if (d.status().code() == absl::StatusCode::kOutOfRange) break;
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_LE(ring->queued(), config.num_slots);
    ASSERT_EQ(d->step, expected) << "chunks out of order";
    ASSERT_EQ(d->offset_numel, expected);
    ASSERT_EQ(d->unit, static_cast<int32_t>(expected % 30));
    const void* data = ring->slot_data(d->slot);
    for (int64_t j = 0; j < d->numel; ++j) {
      const float want = ChunkValue(expected, j);
      const float got = d->kind == ChunkKind::kGradF32 ? static_cast<const float*>(data)[j]
                                                       : Bf16ToFloat(static_cast<const bf16_t*>(data)[j]);
      checksum_seen += got * (j + 1);
      checksum_expected += want * (j + 1);
      ASSERT_EQ(got, want) << "chunk " << expected << " element " << j << " overwritten?";
    }
    if (expected % 1000 == 999) ::usleep(20'000);  // a slow consumer: the producer must wait
    ASSERT_TRUE(ring->Release(d->slot).ok());
    ++expected;
  }
  EXPECT_EQ(expected, kChunks);
  EXPECT_EQ(checksum_seen, checksum_expected);
  EXPECT_EQ(guard.Wait(), 0);
}

TEST_F(GradRingTest, SigkilledProducerMakesPopFailWithinTwoSeconds) {
  const GradRingConfig config{4, 4096};
  auto ring = NewRing(config, RingRole::kConsumer);
  ASSERT_NE(ring, nullptr);
  const std::string name = ring->segment_name();
  pid_t child = ForkChild([&] {
    auto p = GradRing::Attach(name, RingRole::kProducer, nullptr);
    if (!p.ok()) return 1;
    for (uint32_t i = 0;; ++i) {
      auto slot = (*p)->AcquireSlot(absl::Seconds(30));
      if (!slot.ok()) return 2;
      if (!(*p)->Post({0, *slot, 0, 16, i, ChunkKind::kGradF32}).ok()) return 3;
      ::usleep(1000);
    }
  });
  ChildGuard guard(child);
  for (int i = 0; i < 100; ++i) {
    auto d = ring->Pop(absl::Seconds(10));
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_TRUE(ring->Release(d->slot).ok());
  }
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  const absl::Time killed = absl::Now();
  absl::Status end;
  while (true) {  // drain what it posted before dying, then expect the error
    auto d = ring->Pop(absl::Seconds(30));
    if (!d.ok()) {
      end = d.status();
      break;
    }
    ASSERT_TRUE(ring->Release(d->slot).ok());
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(2)) << end;
  EXPECT_TRUE(end.code() == absl::StatusCode::kUnavailable || end.code() == absl::StatusCode::kAborted) << end;
  EXPECT_NE(end.message().find(absl::StrCat("pid ", child)), absl::string_view::npos) << end;
  EXPECT_EQ(guard.Wait(), 128 + SIGKILL);
}

TEST_F(GradRingTest, DeadConsumerMakesAcquireSlotFailWithinTwoSeconds) {
  const GradRingConfig config{4, 4096};
  auto ring = NewRing(config, RingRole::kProducer);
  ASSERT_NE(ring, nullptr);
  const std::string name = ring->segment_name();
  Pipe ready;
  pid_t child = ForkChild([&] {
    auto c = GradRing::Attach(name, RingRole::kConsumer, nullptr);
    if (!c.ok()) return 1;
    ready.Signal();
    // Consume two chunks (without releasing them), then die hard.
    for (int i = 0; i < 2; ++i) {
      if (!(*c)->Pop(absl::Seconds(10)).ok()) return 2;
    }
    ::usleep(200'000);
    ::raise(SIGKILL);
    return 3;
  });
  ChildGuard guard(child);
  ready.Await();
  EXPECT_EQ(ring->consumer().pid, child);
  for (int i = 0; i < 4; ++i) {
    auto slot = ring->AcquireSlot(absl::Seconds(1));
    ASSERT_TRUE(slot.ok()) << slot.status();
    ASSERT_TRUE(ring->Post({0, *slot, 0, 1, 0, ChunkKind::kGradF32}).ok());
  }
  const absl::Time start = absl::Now();
  auto blocked = ring->AcquireSlot(absl::Seconds(30));  // ring full; consumer dies in ~200 ms
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(blocked.status().code(), absl::StatusCode::kUnavailable) << blocked.status();
  EXPECT_NE(blocked.status().message().find("consumer pid"), absl::string_view::npos) << blocked.status();
  EXPECT_GE(waited, absl::Milliseconds(100)) << "it should have waited for the consumer";
  EXPECT_LT(waited, absl::Seconds(2));
  EXPECT_EQ(guard.Wait(), 128 + SIGKILL);
}

}  // namespace
}  // namespace slidedp::shm
