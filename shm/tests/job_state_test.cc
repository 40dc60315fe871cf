// JobState: region layout, attach from another process, version gates and abort through the
// segment, deferred first touch by owner threads, layout mismatch, the per-rank urgent-copy words.
#include "shm/job_state.h"

#include <cstdio>
#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "shm/tests/test_util.h"

namespace slidedp::shm {
namespace {

using testing::ChildGuard;
using testing::ForkChild;
using testing::ScopedUnlink;
using testing::WaitChild;

ModelLayout TinyLayout(int layers = 2) {
  ModelConfig c = ModelConfig::Preset("tiny").value();
  c.num_hidden_layers = layers;
  return ModelLayout::Build(c);
}

int ResidentPages(const void* p, uint64_t bytes) {
  std::vector<unsigned char> vec((bytes + kPageBytes - 1) / kPageBytes);
  if (::mincore(const_cast<void*>(p), bytes, vec.data()) != 0) return -1;
  int n = 0;
  for (unsigned char c : vec) n += c & 1;
  return n;
}

TEST(JobState, LayoutOfRegions) {
  const ModelLayout layout = TinyLayout();
  const std::string job = testing::UniqueJob();
  auto state = JobState::Create(testing::TestNode(), job, layout);
  ASSERT_TRUE(state.ok()) << state.status();
  JobState& js = **state;
  ScopedUnlink cleanup(js.segment_name());
  EXPECT_EQ(js.segment_name(), absl::StrCat("/slidedp.", testing::TestNode(), ".", job, ".state"));
  EXPECT_EQ(js.bytes(), JobState::SegmentBytes(layout));
  ASSERT_EQ(js.num_units(), layout.num_units());
  EXPECT_GE(js.bytes(), static_cast<uint64_t>(layout.total_numel) * 14);
  const uint8_t* prev_end = nullptr;
  for (int u = 0; u < js.num_units(); ++u) {
    EXPECT_EQ(js.unit_numel(u), layout.units[u].numel);
    const uint64_t n = js.unit_numel(u);
    const std::pair<const void*, uint64_t> regions[] = {
        {js.master(u), n * 4}, {js.m(u), n * 4}, {js.v(u), n * 4}, {js.mirror(u), n * 2}};
    for (auto [p, bytes] : regions) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kPageBytes, 0u);
      EXPECT_GE(static_cast<const uint8_t*>(p), prev_end) << "unit " << u << " overlaps";
      prev_end = static_cast<const uint8_t*>(p) + bytes;
    }
    EXPECT_EQ(js.version(u).Load(), 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(&js.version(u)) % 64, 0u);
    if (u > 0) {
      EXPECT_EQ(reinterpret_cast<uint8_t*>(&js.version(u)) - reinterpret_cast<uint8_t*>(&js.version(u - 1)), 64);
    }
  }
  EXPECT_LE(prev_end, js.segment().base() + js.bytes());
  EXPECT_FALSE(js.abort().raised());
  EXPECT_TRUE(js.CheckMatches(layout).ok());
  EXPECT_EQ(js.CheckMatches(TinyLayout(3)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(js.owner().pid, ::getpid());
  // Everything was prefaulted at Create.
  EXPECT_EQ(ResidentPages(js.master(0), js.unit_numel(0) * 4),
            static_cast<int>((js.unit_numel(0) * 4 + kPageBytes - 1) / kPageBytes));
}

TEST(JobState, WorkerAttachesAndSeesUpdatesThroughVersionGates) {
  const ModelLayout layout = TinyLayout();
  auto state = JobState::Create(testing::TestNode(), testing::UniqueJob(), layout);
  ASSERT_TRUE(state.ok()) << state.status();
  JobState& js = **state;
  ScopedUnlink cleanup(js.segment_name());
  const std::string name = js.segment_name();

  // The child is the "worker": it waits for each unit's version 1, then checks the mirror the
  // parent ("LayerAdam") wrote before publishing it.
  pid_t child = ForkChild([&] {
    auto w = JobState::Attach(name, Access::kReadOnly);
    if (!w.ok() || !(*w)->CheckMatches(layout).ok()) return 1;
    for (int u = 0; u < (*w)->num_units(); ++u) {
      absl::Status s = (*w)->version(u).WaitAtLeast(1, absl::Seconds(10), (*w)->abort(), (*w)->owner());
      if (!s.ok()) return 2;
      for (int64_t i = 0; i < (*w)->unit_numel(u); i += 97) {
        if ((*w)->mirror(u)[i] != FloatToBf16(u + i * 0.25f)) return 3;
      }
    }
    return (*w)->step_counter().load() == 1 ? 0 : 4;
  });
  ChildGuard guard(child);
  js.step_counter().store(1);
  for (int u = 0; u < js.num_units(); ++u) {
    ::usleep(10'000);
    for (int64_t i = 0; i < js.unit_numel(u); ++i) {
      js.master(u)[i] = u + i * 0.25f;
      js.mirror(u)[i] = FloatToBf16(js.master(u)[i]);
    }
    js.version(u).Publish(1);
  }
  EXPECT_EQ(guard.Wait(), 0);
}

// DMA before Adam: each rank's urgent-copy word is its own, shared across mappings (a worker
// raises it, hostd's LayerAdam reads it), wakes a futex waiter when lowered, and starts at zero in
// a re-laid-out pooled segment and after a take-over.
TEST(JobState, UrgentCopyWordsPerRankThroughTheSegment) {
  const ModelLayout layout = TinyLayout();
  auto state = JobState::Create(testing::TestNode(), testing::UniqueJob(), layout);
  ASSERT_TRUE(state.ok()) << state.status();
  JobState& js = **state;
  ScopedUnlink cleanup(js.segment_name());
  EXPECT_EQ(js.urgent_copy_word(-1), nullptr);
  EXPECT_EQ(js.urgent_copy_word(kMaxUrgentCopyRanks), nullptr);
  const std::vector<const std::atomic<uint32_t>*> words = js.UrgentCopyWords(4);
  ASSERT_EQ(words.size(), 4u);
  EXPECT_EQ(js.UrgentCopyWords(kMaxUrgentCopyRanks + 3).size(), static_cast<size_t>(kMaxUrgentCopyRanks));
  // On their own cache line, apart from the words hostd writes every step.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(js.urgent_copy_word(0)) % 64, 0u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(words[r], js.urgent_copy_word(r));
    EXPECT_EQ(words[r]->load(), 0u);
  }
  for (int r = 0; r < 4; ++r) {
    for (int q = r + 1; q < 4; ++q) EXPECT_NE(words[r], words[q]);
  }
  const std::string name = js.segment_name();

  // The child is rank 2's worker: it raises its word twice (two overlapping urgent loads), then
  // lowers both and wakes the waiter; the parent plays LayerAdam and waits on the word.
  pid_t child = ForkChild([&] {
    auto w = JobState::Attach(name, Access::kReadWrite);
    if (!w.ok()) return 1;
    std::atomic<uint32_t>* mine = (*w)->urgent_copy_word(2);
    if (mine == nullptr || mine->load() != 0) return 2;
    mine->fetch_add(1);
    mine->fetch_add(1);
    ::usleep(100'000);
    mine->fetch_sub(1);
    ::usleep(20'000);
    if (mine->fetch_sub(1) == 1) FutexWakeAll(mine);
    return 0;
  });
  ChildGuard guard(child);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (words[2]->load() == 0 && absl::Now() < deadline) ::usleep(1000);
  EXPECT_GE(words[2]->load(), 1u) << "the worker's raise is not visible to hostd";
  EXPECT_EQ(words[1]->load(), 0u);
  EXPECT_EQ(words[3]->load(), 0u);
  WaitGuards g;
  g.abort = &js.abort();
  auto lowered = [](uint32_t v) { return v == 0; };
  auto describe = [] { return std::string("rank 2's urgent word"); };
  EXPECT_TRUE(WaitForWord(*words[2], lowered, absl::Seconds(10), g, describe).ok());
  EXPECT_EQ(guard.Wait(), 0);

  // Left raised (a worker died mid-copy): reset by hostd at the next start.
  js.urgent_copy_word(1)->store(3);
  js.ResetUrgentCopies();
  EXPECT_EQ(words[1]->load(), 0u);
  js.urgent_copy_word(0)->store(1);
  const std::string next = name + "-next";
  ScopedUnlink cleanup_next(next);
  ASSERT_EQ(::rename(("/dev/shm" + name).c_str(), ("/dev/shm" + next).c_str()), 0);
  auto relaid = JobState::Relayout(std::move(*state), next, "next", layout);
  ASSERT_TRUE(relaid.ok()) << relaid.status();
  EXPECT_EQ((*relaid)->urgent_copy_word(0)->load(), 0u) << "a pooled segment kept a raised word";
}

TEST(JobState, RaiseAbortWakesWorkerWaitingOnAVersion) {
  auto state = JobState::Create(testing::TestNode(), testing::UniqueJob(), TinyLayout());
  ASSERT_TRUE(state.ok()) << state.status();
  ScopedUnlink cleanup((*state)->segment_name());
  const std::string name = (*state)->segment_name();
  pid_t child = ForkChild([&] {
    auto w = JobState::Attach(name, Access::kReadWrite);
    if (!w.ok()) return 1;
    WaitGuards g;
    g.abort = &(*w)->abort();
    g.slice = absl::Seconds(5);  // so only RaiseAbort's wake can end the wait quickly
    const absl::Time start = absl::Now();
    absl::Status s = (*w)->version(1).WaitAtLeast(7, absl::Seconds(20), g);
    if (s.code() != absl::StatusCode::kAborted) return 2;
    return absl::Now() - start < absl::Seconds(2) ? 0 : 3;
  });
  ChildGuard guard(child);
  ::usleep(200'000);
  EXPECT_TRUE((*state)->RaiseAbort(AbortReason::kCancelled));
  EXPECT_EQ(guard.Wait(), 0);
  EXPECT_EQ((*state)->abort().reason(), AbortReason::kCancelled);
}

TEST(JobState, OwnerThreadsFirstTouchTheirUnits) {
  const ModelLayout layout = TinyLayout();
  JobStateOptions opts;
  opts.first_touch = FirstTouch::kByOwner;
  auto state = JobState::Create(testing::TestNode(), testing::UniqueJob(), layout, opts);
  ASSERT_TRUE(state.ok()) << state.status();
  JobState& js = **state;
  ScopedUnlink cleanup(js.segment_name());
  for (int u = 0; u < js.num_units(); ++u) {
    EXPECT_EQ(ResidentPages(js.master(u), js.unit_numel(u) * 4), 0) << "unit " << u;
  }
  // Control block is usable right away.
  js.version(0).Publish(2);
  EXPECT_EQ(js.version(0).Load(), 2u);

  std::thread owner([&] { ASSERT_TRUE(js.PrefaultUnit(1).ok()); });
  owner.join();
  const int pages = static_cast<int>((js.unit_numel(1) * 4 + kPageBytes - 1) / kPageBytes);
  EXPECT_EQ(ResidentPages(js.master(1), js.unit_numel(1) * 4), pages);
  EXPECT_EQ(ResidentPages(js.mirror(1), js.unit_numel(1) * 2),
            static_cast<int>((js.unit_numel(1) * 2 + kPageBytes - 1) / kPageBytes));
  EXPECT_EQ(ResidentPages(js.master(2), js.unit_numel(2) * 4), 0) << "other units untouched";
  EXPECT_EQ(js.PrefaultUnit(js.num_units()).code(), absl::StatusCode::kOutOfRange);
}

TEST(JobState, AttachRejectsMissingOrForeignSegments) {
  EXPECT_EQ(JobState::Attach("/slidedp.nosuch.job.state", Access::kReadOnly).status().code(),
            absl::StatusCode::kNotFound);
  const std::string name = MakeSegmentName(testing::TestNode(), testing::UniqueJob(), "x").value();
  ScopedUnlink cleanup(name);
  ASSERT_TRUE(ShmSegment::Create(name, {RegionSpec{"control", 8}}).ok());
  EXPECT_EQ(JobState::Attach(name, Access::kReadOnly).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(JobState::Create(testing::TestNode(), "bad.job", TinyLayout()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp::shm

namespace slidedp::shm {
namespace {

// A pooled segment re-laid out for a smaller model keeps its file (and pages) but has a fresh
// layout, control block and gates; a larger layout does not fit.
TEST(JobState, ReformatLaysAPooledSegmentOutForASmallerModel) {
  const ModelLayout big = TinyLayout(4), small = TinyLayout(3);
  ASSERT_LT(JobState::SegmentBytes(small), JobState::SegmentBytes(big));
  auto created = JobState::Create(testing::TestNode(), testing::UniqueJob(), big);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string name = (*created)->segment_name();
  testing::ScopedUnlink cleanup(name);
  (*created)->version(1).Publish(7);
  (*created)->step_counter().store(7);
  (*created)->RaiseAbort(AbortReason::kCancelled);
  std::memset((*created)->master(0), 0x5a, 64);
  created->reset();  // the old mapping goes; the file stays

  EXPECT_EQ(JobState::Reformat(name, "next", TinyLayout(5)).status().code(), absl::StatusCode::kFailedPrecondition);
  auto again = JobState::Create(testing::TestNode(), testing::UniqueJob(), big);  // a sibling, to re-pool below
  ASSERT_TRUE(again.ok());
  testing::ScopedUnlink cleanup2((*again)->segment_name());

  auto reused = JobState::Reformat((*again)->segment_name(), "next", small);
  ASSERT_TRUE(reused.ok()) << reused.status();
  EXPECT_TRUE((*reused)->CheckMatches(small).ok());
  EXPECT_EQ((*reused)->bytes(), JobState::SegmentBytes(small));
  EXPECT_EQ((*reused)->num_units(), small.num_units());
  EXPECT_FALSE((*reused)->abort().raised());
  EXPECT_EQ((*reused)->step_counter().load(), 0u);
  for (int u = 0; u < (*reused)->num_units(); ++u) EXPECT_EQ((*reused)->version(u).Load(), 0u);
  // Every region is usable end to end, and a worker attaching by name sees the new layout.
  for (int u = 0; u < small.num_units(); ++u) {
    const int64_t n = small.units[u].numel;
    (*reused)->master(u)[n - 1] = 1.0f;
    (*reused)->v(u)[n - 1] = 2.0f;
    (*reused)->mirror(u)[n - 1] = 3;
  }
  auto worker = JobState::Attach((*reused)->segment_name(), Access::kReadWrite);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_TRUE((*worker)->CheckMatches(small).ok());
  EXPECT_EQ((*worker)->mirror(small.num_units() - 1)[small.units.back().numel - 1], 3);

  // The first segment (with a raised abort word and gates at 7) is reformatted just the same.
  auto first = JobState::Reformat(name, "third", small);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE((*first)->abort().raised());
  EXPECT_EQ((*first)->version(1).Load(), 0u);
}

// A pooled segment of the same size is laid out again through the mapping hostd kept (no
// remap): a fresh control block under the new name; a worker's kept mapping of the same file
// re-reads the layout with Rebind(), and its data pointers still show the same pages.
// runtime.param_source master: no "u<i>.mirror" regions, for every moment layout; the control
// block says so to a worker that attaches, and a pooled segment with a mirror can be reformatted
// without one (and its size is then the smaller one).
TEST(JobState, SegmentsWithoutAMirror) {
  const ModelLayout layout = TinyLayout(3);
  uint64_t elements = 0;
  for (const UnitLayout& u : layout.units) elements += static_cast<uint64_t>(u.numel);
  for (MomentForm moments : {MomentForm::kF32, MomentForm::kBF16, MomentForm::kInt8}) {
    SCOPED_TRACE(ToString(moments));
    const StateFormat with{moments, true}, without{moments, false};
    const uint64_t with_bytes = JobState::SegmentBytes(layout, with), without_bytes = JobState::SegmentBytes(layout, without);
    EXPECT_GE(with_bytes - without_bytes, elements * 2);
    EXPECT_LE(with_bytes - without_bytes, elements * 2 + layout.units.size() * kPageBytes);
    JobStateOptions opts;
    opts.format = without;
    auto state = JobState::Create(testing::TestNode(), testing::UniqueJob(), layout, opts);
    ASSERT_TRUE(state.ok()) << state.status();
    ScopedUnlink cleanup((*state)->segment_name());
    EXPECT_EQ((*state)->bytes(), without_bytes);
    EXPECT_FALSE((*state)->has_mirror());
    EXPECT_EQ((*state)->moment_form(), moments);
    for (int u = 0; u < (*state)->num_units(); ++u) {
      EXPECT_EQ((*state)->mirror(u), nullptr);
      ASSERT_NE((*state)->master(u), nullptr);
      (*state)->master(u)[(*state)->unit_numel(u) - 1] = 3.0f;
      EXPECT_TRUE((*state)->PrefaultUnit(u).ok());
    }
    auto worker = JobState::Attach((*state)->segment_name(), Access::kReadOnly);
    ASSERT_TRUE(worker.ok()) << worker.status();
    EXPECT_FALSE((*worker)->has_mirror());
    EXPECT_EQ((*worker)->mirror(1), nullptr);
    EXPECT_EQ((*worker)->master(1)[(*worker)->unit_numel(1) - 1], 3.0f);

    // A pooled segment laid out with a mirror, reformatted for a job without one.
    auto pooled = JobState::Create(testing::TestNode(), testing::UniqueJob(), layout);
    ASSERT_TRUE(pooled.ok()) << pooled.status();
    const std::string name = (*pooled)->segment_name();
    ScopedUnlink cleanup_pooled(name);
    EXPECT_TRUE((*pooled)->has_mirror());
    pooled->reset();
    auto reformatted = JobState::Reformat(name, "next", layout, opts);
    ASSERT_TRUE(reformatted.ok()) << reformatted.status();
    EXPECT_FALSE((*reformatted)->has_mirror());
    EXPECT_EQ((*reformatted)->mirror(0), nullptr);
    EXPECT_EQ((*reformatted)->format().moments, moments);
  }
}

TEST(JobState, RelayoutReusesTheMappingAndAKeptWorkerMappingRebinds) {
  const ModelLayout layout = TinyLayout(4);
  auto created = JobState::Create(testing::TestNode(), testing::UniqueJob(), layout);
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string old_name = (*created)->segment_name();
  const std::string new_name = old_name + "-next";
  testing::ScopedUnlink cleanup(new_name);
  (*created)->version(2).Publish(9);
  (*created)->RaiseAbort(AbortReason::kCancelled);
  (*created)->master(1)[5] = 42.0f;
  const float* before = (*created)->master(1);
  auto worker = JobState::Attach(old_name, Access::kReadWrite);  // a worker keeps this across jobs
  ASSERT_TRUE(worker.ok()) << worker.status();

  ASSERT_EQ(::rename(("/dev/shm" + old_name).c_str(), ("/dev/shm" + new_name).c_str()), 0);
  auto sibling = JobState::Create(testing::TestNode(), testing::UniqueJob(), TinyLayout(3));
  ASSERT_TRUE(sibling.ok()) << sibling.status();
  testing::ScopedUnlink cleanup_sibling((*sibling)->segment_name());
  EXPECT_EQ(JobState::Relayout(std::move(*sibling), "/unused", "x", layout).status().code(),
            absl::StatusCode::kFailedPrecondition);  // another size
  auto relaid = JobState::Relayout(std::move(*created), new_name, "next", layout);
  ASSERT_TRUE(relaid.ok()) << relaid.status();
  EXPECT_EQ((*relaid)->segment_name(), new_name);
  EXPECT_EQ((*relaid)->master(1), before);  // the same mapping
  EXPECT_EQ((*relaid)->master(1)[5], 42.0f);
  EXPECT_FALSE((*relaid)->abort().raised());
  EXPECT_EQ((*relaid)->version(2).Load(), 0u);
  EXPECT_TRUE((*relaid)->CheckMatches(layout).ok());

  ASSERT_TRUE((*worker)->Rebind().ok());
  EXPECT_FALSE((*worker)->abort().raised());
  EXPECT_EQ((*worker)->version(2).Load(), 0u);
  (*relaid)->version(2).Publish(1);
  EXPECT_EQ((*worker)->version(2).Load(), 1u);
  EXPECT_EQ((*worker)->master(1)[5], 42.0f);
  auto a = (*worker)->segment().Identity(), b = (*relaid)->segment().Identity();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(a->SameFile(*b));
  EXPECT_EQ(a->links, 1u);
  ASSERT_TRUE((*relaid)->Unlink().ok());
  a = (*worker)->segment().Identity();
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->links, 0u);  // what the worker's watcher looks for
}

// A hostd that died (the child) left its job's state: the restarted one (this process) reads
// whether it holds a whole step, and takes it over.
TEST(JobState, ConsistentStepAndTakeOverOfADeadCreatorsSegment) {
  const ModelLayout layout = TinyLayout(3);
  const std::string job = testing::UniqueJob();
  const std::string node = testing::TestNode();  // of this process: the child's would differ
  const std::string name = absl::StrCat("/slidedp.", node, ".", job, ".state");
  ScopedUnlink cleanup(name);
  // Child: 5 steps done, then the updates of step 6 begin on unit 0 only; it dies (exits) there.
  // mode 0: 5 whole steps; 1: step 6's updates begun, no gate moved; 2: unit 0 at 6, others at 5;
  // 3: it died while writing the initial state (every gate at 0, the state never marked written).
  for (int mode = 0; mode < 4; ++mode) {
    (void)UnlinkSegment(name);
    pid_t child = ForkChild([&] {
      auto s = JobState::Create(node, job, layout);
      if (!s.ok()) return 1;
      if (mode == 3) return 0;
      (*s)->state_written().store(1);
      for (int u = 0; u < (*s)->num_units(); ++u) (*s)->version(u).Publish(5);
      (*s)->step_counter().store(5);
      (*s)->updating_step().store(5);
      if (mode >= 1) (*s)->updating_step().store(6);
      if (mode == 2) (*s)->version(0).Publish(6);
      (*s)->RaiseAbort(AbortReason::kWorkerFailed);  // a worker noticed the death
      return 0;
    });
    ASSERT_EQ(WaitChild(child), 0);
    auto js = JobState::Attach(name, Access::kReadWrite);
    ASSERT_TRUE(js.ok()) << js.status();
    EXPECT_EQ((*js)->job_id(), job);
    EXPECT_TRUE((*js)->CheckMatches(layout).ok());
    absl::StatusOr<int64_t> step = (*js)->ConsistentStep();
    if (mode == 0) {
      ASSERT_TRUE(step.ok()) << step.status();
      EXPECT_EQ(*step, 5);
      EXPECT_EQ((*js)->owner().pid, child);
      ASSERT_TRUE((*js)->TakeOver().ok());
      EXPECT_EQ((*js)->owner().pid, getpid());
      EXPECT_FALSE((*js)->abort().raised());
      // Another process sees the new owner (workers check its liveness in their waits).
      auto again = JobState::Attach(name, Access::kReadOnly);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ((*again)->owner().pid, getpid());
    } else {
      EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(step.status().message().find(mode == 1   ? "updates of step 6"
                                             : mode == 2 ? "unit 0 is at step 6"
                                                         : "never completely written"),
                std::string::npos)
          << step.status();
    }
  }
}

// Only a dead creator's segment can be taken over.
TEST(JobState, TakeOverRefusesALiveCreator) {
  const ModelLayout layout = TinyLayout();
  const std::string job = testing::UniqueJob();
  const std::string node = testing::TestNode();  // of this process: the child's would differ
  const std::string name = absl::StrCat("/slidedp.", node, ".", job, ".state");
  ScopedUnlink cleanup(name);
  int ready[2], hold[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(hold), 0);
  pid_t child = ForkChild([&] {
    ::close(hold[1]);  // else the child holds its own pipe open
    auto s = JobState::Create(node, job, layout);
    char c = s.ok() ? 'y' : 'n';
    if (::write(ready[1], &c, 1) != 1) return 1;
    (void)::read(hold[0], &c, 1);  // lives until the parent closes the pipe
    return 0;
  });
  ChildGuard guard(child);
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  auto js = JobState::Attach(name, Access::kReadWrite);
  ASSERT_TRUE(js.ok()) << js.status();
  EXPECT_EQ((*js)->TakeOver().code(), absl::StatusCode::kFailedPrecondition);
  ::close(hold[1]);
  EXPECT_EQ(guard.Wait(), 0);
  EXPECT_TRUE((*js)->TakeOver().ok());
  for (int fd : {ready[0], ready[1], hold[0]}) ::close(fd);
}

}  // namespace
}  // namespace slidedp::shm
