// ShmSegment: create/open/validate, corrupt and truncated headers, /dev/shm exhaustion, prefault,
// stale-segment reclaim across processes, and process liveness (zombies, pid reuse).
#include "shm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "gtest/gtest.h"
#include "shm/process_liveness.h"
#include "shm/tests/test_util.h"

namespace slidedp::shm {
namespace {

using testing::ForkChild;
using testing::ScopedUnlink;
using testing::TestNode;
using testing::UniqueJob;
using testing::WaitChild;

std::string NewName(const std::string& purpose = "seg") {
  return MakeSegmentName(TestNode(), UniqueJob(), purpose).value();
}

std::vector<RegionSpec> SomeRegions() {
  return {RegionSpec{"alpha", 100 * 4, ShmDtype::kF32}, RegionSpec{"beta", 5000, ShmDtype::kBytes},
          RegionSpec{"gamma", 3 * 2, ShmDtype::kBF16}};
}

TEST(SegmentName, FormatAndValidation) {
  EXPECT_EQ(MakeSegmentName("node1", "j-7", "state").value(), "/slidedp.node1.j-7.state");
  EXPECT_EQ(MakeSegmentName("a.b", "j", "s").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeSegmentName("a", "", "s").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeSegmentName("a", "j/x", "s").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SanitizeNameComponent("gpu01.lab"), "gpu01-lab");
}

TEST(ShmSegment, CreateOpenRoundTripAcrossProcesses) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  auto created = ShmSegment::Create(name, SomeRegions());
  ASSERT_TRUE(created.ok()) << created.status();
  ShmSegment& seg = **created;
  EXPECT_EQ(seg.header().creator_pid, ::getpid());
  EXPECT_EQ(seg.bytes(), ShmSegment::RequiredBytes(SomeRegions()));
  ASSERT_EQ(seg.regions().size(), 3u);
  uint64_t prev_end = seg.header().data_offset;
  for (const Region& r : seg.regions()) {
    EXPECT_EQ(r.offset % kPageBytes, 0u) << r.name;
    EXPECT_GE(r.offset, prev_end) << r.name << " overlaps the previous region";
    prev_end = r.offset + r.bytes;
    EXPECT_LE(prev_end, seg.bytes());
  }
  EXPECT_EQ(seg.FindRegion("beta")->bytes, 5000u);
  EXPECT_EQ(seg.FindRegion("gamma")->dtype, ShmDtype::kBF16);
  EXPECT_EQ(seg.FindRegion("delta").status().code(), absl::StatusCode::kNotFound);

  struct stat st;
  ASSERT_EQ(::stat(("/dev/shm" + name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  auto* alpha = static_cast<float*>(seg.data(*seg.FindRegion("alpha")));
  for (int i = 0; i < 100; ++i) alpha[i] = i * 0.5f;

  // A child maps it read-write, checks the parent's data and writes into beta.
  pid_t child = ForkChild([&] {
    auto opened = ShmSegment::Open(name, Access::kReadWrite);
    if (!opened.ok()) return 1;
    auto* a = static_cast<float*>((*opened)->data(*(*opened)->FindRegion("alpha")));
    for (int i = 0; i < 100; ++i) {
      if (a[i] != i * 0.5f) return 2;
    }
    std::memset((*opened)->data(*(*opened)->FindRegion("beta")), 0x5a, 5000);
    return 0;
  });
  ASSERT_EQ(WaitChild(child), 0);
  auto ro = ShmSegment::Open(name, Access::kReadOnly);
  ASSERT_TRUE(ro.ok()) << ro.status();
  const auto* beta = static_cast<const uint8_t*>((*ro)->data(*(*ro)->FindRegion("beta")));
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(beta[i], 0x5a) << i;
  EXPECT_EQ((*ro)->creator().pid, ::getpid());
  EXPECT_EQ((*ro)->access(), Access::kReadOnly);
  EXPECT_EQ((*ro)->Allocate(0, 4096).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShmSegment, CreateRefusesExistingNameAndKeepsIt) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  auto first = ShmSegment::Create(name, SomeRegions());
  ASSERT_TRUE(first.ok());
  auto second = ShmSegment::Create(name, SomeRegions());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(ShmSegment::Open(name, Access::kReadOnly).ok()) << "the first one must survive";
}

TEST(ShmSegment, CreateRejectsBadRegions) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  EXPECT_EQ(ShmSegment::Create(name, {RegionSpec{"a", 1}, RegionSpec{"a", 2}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmSegment::Create(name, {RegionSpec{std::string(40, 'x'), 1}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmSegment::Open(name, Access::kReadOnly).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmSegment, OpenMissingIsNotFound) {
  EXPECT_EQ(ShmSegment::Open(NewName(), Access::kReadOnly).status().code(), absl::StatusCode::kNotFound);
}

// Raw read-write mapping of a segment, bypassing validation, for corrupting it.
class RawMapping {
 public:
  explicit RawMapping(const std::string& name) {
    fd_ = ::shm_open(name.c_str(), O_RDWR, 0);
    struct stat st;
    ::fstat(fd_, &st);
    bytes_ = st.st_size;
    base_ = static_cast<uint8_t*>(::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
  }
  ~RawMapping() {
    ::munmap(base_, bytes_);
    ::close(fd_);
  }
  ShmHeader* header() { return reinterpret_cast<ShmHeader*>(base_); }
  ShmRegionEntry* entry(int i) { return reinterpret_cast<ShmRegionEntry*>(base_ + header()->table_offset) + i; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
};

TEST(ShmSegment, CorruptHeadersAreRejectedWithClearErrors) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  ASSERT_TRUE(ShmSegment::Create(name, SomeRegions()).ok());
  RawMapping raw(name);

  raw.header()->magic = 0xdeadbeefull;
  auto s = ShmSegment::Open(name, Access::kReadOnly).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("magic"), absl::string_view::npos) << s;
  raw.header()->magic = kShmMagic;
  ASSERT_TRUE(ShmSegment::Open(name, Access::kReadOnly).ok());

  raw.header()->layout_version = kShmLayoutVersion + 1;
  s = ShmSegment::Open(name, Access::kReadOnly).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("layout version"), absl::string_view::npos) << s;
  raw.header()->layout_version = kShmLayoutVersion;

  raw.header()->header_bytes = 128;
  EXPECT_EQ(ShmSegment::Open(name, Access::kReadOnly).status().code(), absl::StatusCode::kFailedPrecondition);
  raw.header()->header_bytes = sizeof(ShmHeader);

  const uint64_t saved_bytes = raw.entry(1)->bytes;
  raw.entry(1)->bytes = 1ull << 40;  // region past the end
  s = ShmSegment::Open(name, Access::kReadOnly).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("beta"), absl::string_view::npos) << s;
  raw.entry(1)->bytes = saved_bytes;

  raw.header()->region_count = 1u << 30;  // table past the end
  EXPECT_EQ(ShmSegment::Open(name, Access::kReadOnly).status().code(), absl::StatusCode::kDataLoss);
  raw.header()->region_count = 3;

  std::memset(raw.entry(2)->name, 'x', kRegionNameBytes);  // unterminated name
  EXPECT_EQ(ShmSegment::Open(name, Access::kReadOnly).status().code(), absl::StatusCode::kDataLoss);
  std::strcpy(raw.entry(2)->name, "gamma");
  EXPECT_TRUE(ShmSegment::Open(name, Access::kReadOnly).ok());
}

TEST(ShmSegment, TruncatedSegmentsAreDataLoss) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  auto seg = ShmSegment::Create(name, SomeRegions());
  ASSERT_TRUE(seg.ok());
  const uint64_t full = (*seg)->bytes();
  seg->reset();
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, full / 2), 0);
  auto s = ShmSegment::Open(name, Access::kReadOnly).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("truncated"), absl::string_view::npos) << s;
  ASSERT_EQ(::ftruncate(fd, 10), 0);
  s = ShmSegment::Open(name, Access::kReadOnly).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("smaller than"), absl::string_view::npos) << s;
  ::close(fd);
}

TEST(ShmSegment, UninitializedSegmentIsFailedPrecondition) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 8192), 0);
  ::close(fd);
  EXPECT_EQ(ShmSegment::Open(name, Access::kReadOnly).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ShmSegment, FullDevShmIsResourceExhaustedBeforeAnyAllocation) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  const uint64_t free_bytes = ShmFreeBytes().value();
  const uint64_t ask = free_bytes + (1ull << 30);
  for (Allocation mode : {Allocation::kAll, Allocation::kHeaderOnly}) {
    ShmCreateOptions opts;
    opts.allocation = mode;
    auto s = ShmSegment::Create(name, {RegionSpec{"huge", ask, ShmDtype::kBytes}}, opts).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("free"), absl::string_view::npos) << s;
    const uint64_t requested = ShmSegment::RequiredBytes({RegionSpec{"huge", ask, ShmDtype::kBytes}});
    EXPECT_NE(s.message().find(absl::StrCat(requested)), absl::string_view::npos) << s;
    EXPECT_EQ(ShmSegment::Open(name, Access::kReadOnly).status().code(), absl::StatusCode::kNotFound)
        << "a refused Create must leave nothing behind";
  }
}

TEST(ShmSegment, DeferredAllocationAndMultiThreadedPrefault) {
  const std::string name = NewName();
  ScopedUnlink cleanup(name);
  ShmCreateOptions opts;
  opts.allocation = Allocation::kHeaderOnly;
  auto seg = ShmSegment::Create(name, {RegionSpec{"big", 8 << 20, ShmDtype::kBytes}}, opts);
  ASSERT_TRUE(seg.ok()) << seg.status();
  const Region big = *(*seg)->FindRegion("big");
  // Header-only: the region's pages are not resident yet.
  std::vector<unsigned char> vec(big.bytes / kPageBytes);
  ASSERT_EQ(::mincore((*seg)->data(big), big.bytes, vec.data()), 0);
  int resident = 0;
  for (unsigned char c : vec) resident += c & 1;
  EXPECT_EQ(resident, 0);

  ASSERT_TRUE((*seg)->Allocate(big.offset, big.bytes).ok());
  ASSERT_TRUE((*seg)->Prefault(big.offset, big.bytes, /*threads=*/4).ok());
  ASSERT_EQ(::mincore((*seg)->data(big), big.bytes, vec.data()), 0);
  resident = 0;
  for (unsigned char c : vec) resident += c & 1;
  EXPECT_EQ(resident, static_cast<int>(vec.size())) << "every page mapped after Prefault";
  EXPECT_EQ((*seg)->Prefault(big.offset, 1ull << 40).code(), absl::StatusCode::kOutOfRange);
}

TEST(ProcessLiveness, ZombiesAndReusedPidsCountAsDead) {
  EXPECT_TRUE(IsProcessAlive(SelfIdentity()));
  ProcessIdentity wrong = SelfIdentity();
  wrong.start_ticks += 1;
  EXPECT_FALSE(IsProcessAlive(wrong)) << "a pid with another start time is another process";
  pid_t child = ForkChild([] { return 0; });
  const ProcessIdentity id = IdentityOf(child);
  siginfo_t info;
  ASSERT_EQ(::waitid(P_PID, child, &info, WEXITED | WNOWAIT), 0);  // exited, not reaped: zombie
  EXPECT_FALSE(IsProcessAlive(id));
  EXPECT_EQ(WaitChild(child), 0);
  EXPECT_FALSE(IsProcessAlive(id));
}

TEST(ReclaimStaleSegments, RemovesSegmentsOfDeadCreatorsOnly) {
  const std::string node = TestNode();
  const std::string dead_name = MakeSegmentName(node, UniqueJob(), "state").value();
  const std::string live_name = MakeSegmentName(node, UniqueJob(), "state").value();
  const std::string other_node = MakeSegmentName(node + "x", UniqueJob(), "state").value();
  ScopedUnlink c1(dead_name), c2(live_name), c3(other_node);

  pid_t child = ForkChild([&] {
    auto seg = ShmSegment::Create(dead_name, SomeRegions());
    return seg.ok() ? 0 : 1;  // exits without unlinking: a crashed hostd
  });
  ASSERT_EQ(WaitChild(child), 0);
  auto live = ShmSegment::Create(live_name, SomeRegions());
  ASSERT_TRUE(live.ok());
  auto other = ShmSegment::Create(other_node, SomeRegions());
  ASSERT_TRUE(other.ok());

  auto removed = ReclaimStaleSegments(node);
  ASSERT_TRUE(removed.ok()) << removed.status();
  ASSERT_EQ(removed->size(), 1u);
  EXPECT_EQ((*removed)[0].name, dead_name);
  EXPECT_EQ((*removed)[0].creator_pid, child);
  EXPECT_EQ(ShmSegment::Open(dead_name, Access::kReadOnly).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ShmSegment::Open(live_name, Access::kReadOnly).ok());
  EXPECT_TRUE(ShmSegment::Open(other_node, Access::kReadOnly).ok()) << "other node untouched";

  // An incomplete segment (creator died inside Create) goes once older than the grace period.
  const std::string incomplete = MakeSegmentName(node, UniqueJob(), "state").value();
  ScopedUnlink c4(incomplete);
  int fd = ::shm_open(incomplete.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  removed = ReclaimStaleSegments(node, ReclaimMode::kDeadCreators, "/dev/shm", 3600);
  ASSERT_TRUE(removed.ok());
  EXPECT_TRUE(removed->empty()) << "still within the grace period";
  removed = ReclaimStaleSegments(node, ReclaimMode::kDeadCreators, "/dev/shm", 0);
  ASSERT_TRUE(removed.ok());
  ASSERT_EQ(removed->size(), 1u);
  EXPECT_EQ((*removed)[0].name, incomplete);

  removed = ReclaimStaleSegments(node, ReclaimMode::kAll);
  ASSERT_TRUE(removed.ok());
  ASSERT_EQ(removed->size(), 1u);
  EXPECT_EQ((*removed)[0].name, live_name);
  EXPECT_EQ(ShmSegment::Open(live_name, Access::kReadOnly).status().code(), absl::StatusCode::kNotFound);
  // The live mapping stays usable after its name is gone.
  EXPECT_EQ((*live)->header().creator_pid, ::getpid());
}

}  // namespace
}  // namespace slidedp::shm
