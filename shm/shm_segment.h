// One POSIX shared-memory segment of slidedp host state: create (sized with fallocate, so a full
// /dev/shm fails here and not with SIGBUS later), open and validate, prefault, unlink, and
// reclaim of segments left behind by dead processes.
//
// File format (offsets, never pointers, so every process may map it at another address):
//   offset 0: ShmHeader (magic, layout version, sizeof, total bytes, creator, region table info)
//   table_offset: region_count x ShmRegionEntry {name, offset, bytes, dtype}
//   data_offset..: the regions, each aligned to the creator's alignment (4096 by default)
// The creator writes the magic last (release store), so an opener either sees a complete header
// or magic 0 ("still being created").
//
// Names: "/slidedp.<node>.<job>.<purpose>" (MakeSegmentName); the components contain no '.' or
// '/', so "/dev/shm/slidedp.<node>." lists exactly one node's segments.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "shm/process_liveness.h"

namespace slidedp::shm {

enum class Access { kReadOnly, kReadWrite };

// When the segment's pages are allocated.
//   kAll: posix_fallocate of the whole file at Create (clean RESOURCE_EXHAUSTED on a full /dev/shm;
//         pages land on the creating thread's NUMA node).
//   kHeaderOnly: only the header/table pages now; owners call Allocate()/Prefault() on their ranges
//         later, from the thread whose NUMA node should hold them (a failure there is still a
//         clean Status, never SIGBUS, as long as ranges are Allocate()d before use).
enum class Allocation { kAll, kHeaderOnly };

enum class ShmDtype : uint32_t { kBytes = 0, kF32 = 1, kBF16 = 2, kU32 = 3, kI8 = 4, kU8 = 5 };
const char* ShmDtypeName(ShmDtype d);

inline constexpr uint64_t kShmMagic = 0x3170'6464'696c'7300ull;  // "\0slidedp1" little-endian
// 2: JobControlBlock::updating_step; 3: clip_verdict; 4: urgent_copies; 5: moment_form (compact
// Adam moments: I8/U8 regions and their scales); 6: JobControlBlock::has_mirror (mirror-free
// segments, runtime.param_source: master)
inline constexpr uint32_t kShmLayoutVersion = 6;
inline constexpr size_t kRegionNameBytes = 40;  // including the terminating NUL
inline constexpr uint64_t kCacheLineBytes = 64;
inline constexpr uint64_t kPageBytes = 4096;

struct ShmRegionEntry {
  char name[kRegionNameBytes];
  uint32_t dtype;  // ShmDtype
  uint32_t reserved;
  uint64_t offset;  // from the start of the segment
  uint64_t bytes;
};

struct ShmHeader {
  uint64_t magic;  // kShmMagic once complete; accessed with std::atomic_ref
  uint32_t layout_version;
  uint32_t header_bytes;  // sizeof(ShmHeader) of the writer
  uint64_t total_bytes;   // must equal the file size
  int32_t creator_pid;
  uint32_t region_count;
  uint64_t creator_start_ticks;
  uint64_t table_offset;
  uint64_t data_offset;
  uint64_t created_unix_ns;
  uint64_t alignment;
  uint8_t reserved[184];
};

static_assert(sizeof(ShmRegionEntry) == 64);
static_assert(sizeof(ShmHeader) == 256);
static_assert(std::is_standard_layout_v<ShmHeader> && std::is_trivially_copyable_v<ShmHeader>);
static_assert(std::is_standard_layout_v<ShmRegionEntry>);
static_assert(std::atomic_ref<uint64_t>::required_alignment <= alignof(ShmHeader));

struct RegionSpec {
  std::string name;  // < kRegionNameBytes, unique within the segment
  uint64_t bytes = 0;
  ShmDtype dtype = ShmDtype::kBytes;
};

struct Region {
  std::string name;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  ShmDtype dtype = ShmDtype::kBytes;
};

struct ShmCreateOptions {
  uint64_t alignment = kPageBytes;  // power of two >= 64
  Allocation allocation = Allocation::kAll;
  std::string shm_dir = "/dev/shm";  // where statvfs looks for free space
  // kAll with more than one thread: instead of one posix_fallocate (which tmpfs runs in a single
  // thread, ~1.3 GB/s: a minute for a 4B model's state), the data pages are allocated by
  // MADV_POPULATE_WRITE from this many threads; a full /dev/shm is still a clean
  // RESOURCE_EXHAUSTED (the populate fails with EFAULT instead of a later SIGBUS).
  int allocate_threads = 1;
};

class ShmSegment {
 public:
  // Creates and maps a new segment (O_EXCL; ALREADY_EXISTS if the name is taken), mode 0600.
  // Refuses with RESOURCE_EXHAUSTED (requested and free bytes) before allocating anything when
  // statvfs says /dev/shm cannot hold it; a failed fallocate unlinks the half-made file.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(const std::string& name,
                                                            const std::vector<RegionSpec>& regions,
                                                            const ShmCreateOptions& options = {});
  // Lays an existing segment (one this process owns and nobody else maps, e.g. a pooled one
  // renamed for its next job) out again for new regions: rewrites the header and table and
  // shrinks the file to the new size, keeping its allocated pages (FAILED_PRECONDITION if the
  // file is smaller than the new layout). Region contents are whatever the file held.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Reformat(const std::string& name,
                                                              const std::vector<RegionSpec>& regions,
                                                              const ShmCreateOptions& options = {});
  // Lays this mapping's segment out again for regions of exactly its size, through this mapping
  // (its page tables stay populated: no re-prefault), after the file was renamed to `new_name`
  // (a pooled segment adopted by the next job). FAILED_PRECONDITION for another size.
  absl::Status Relayout(const std::string& new_name, const std::vector<RegionSpec>& regions, uint64_t alignment);
  // Maps an existing segment and validates its header against the file: NOT_FOUND, DATA_LOSS
  // (bad magic, truncated, region out of bounds), FAILED_PRECONDITION (other layout version or
  // header size, or creation not finished).
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Open(const std::string& name, Access access);
  // File size Create() will use for these regions.
  static uint64_t RequiredBytes(const std::vector<RegionSpec>& regions, uint64_t alignment = kPageBytes);

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // unmaps; never unlinks (segments outlive a crashed hostd on purpose)

  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }
  Access access() const { return access_; }
  uint8_t* base() const { return base_; }
  const ShmHeader& header() const { return *reinterpret_cast<const ShmHeader*>(base_); }
  ProcessIdentity creator() const;
  const std::vector<Region>& regions() const { return regions_; }
  // The region called `name`; NOT_FOUND otherwise.
  absl::StatusOr<Region> FindRegion(absl::string_view name) const;
  void* data(const Region& r) const { return base_ + r.offset; }

  // Allocates backing pages for [offset, offset+bytes) with fallocate from the calling thread
  // (its NUMA node). RESOURCE_EXHAUSTED when /dev/shm is full. Needs kReadWrite.
  absl::Status Allocate(uint64_t offset, uint64_t bytes);
  // Maps every page of the range into this process (MADV_POPULATE_WRITE/READ, without changing
  // data), split over `threads` threads. Call Allocate first for kHeaderOnly segments.
  absl::Status Prefault(uint64_t offset, uint64_t bytes, int threads = 1);
  absl::Status PrefaultAll(int threads = 1) { return Prefault(0, bytes_, threads); }
  // Makes the calling process the segment's creator in its header (pid and start time, what
  // liveness checks and stale-segment reclaim look at): a restarted hostd adopting the state of
  // its dead predecessor. FAILED_PRECONDITION while the recorded creator is alive; needs kReadWrite.
  absl::Status TakeOwnership();
  // Removes the name; existing mappings stay valid until unmapped. NOT_FOUND if already gone.
  absl::Status Unlink();

  // The mapped file: which one (a renamed file keeps it), whether it still has a name, its size.
  struct FileId {
    uint64_t device = 0, inode = 0, links = 0, size = 0;
    bool SameFile(const FileId& o) const { return device == o.device && inode == o.inode; }
  };
  absl::StatusOr<FileId> Identity() const;
  // Reads the header and region table again (the owner re-laid the file out in place, e.g.
  // Reformat of a pooled segment this mapping still shows); FAILED_PRECONDITION when the file's
  // size is no longer the mapped size.
  absl::Status Reload();

 private:
  ShmSegment(std::string name, int fd, uint8_t* base, uint64_t bytes, Access access);
  static absl::StatusOr<std::unique_ptr<ShmSegment>> CreateOrReformat(const std::string& name,
                                                                      const std::vector<RegionSpec>& regions,
                                                                      const ShmCreateOptions& options, bool reformat);
  absl::Status LoadRegionTable();

  std::string name_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0;
  Access access_ = Access::kReadOnly;
  std::vector<Region> regions_;
};

// "/slidedp.<node>.<job>.<purpose>". Components: non-empty, [A-Za-z0-9_-] only.
absl::StatusOr<std::string> MakeSegmentName(absl::string_view node, absl::string_view job, absl::string_view purpose);
// Maps a host name to a valid node component ("gpu01.lab" -> "gpu01-lab").
std::string SanitizeNameComponent(absl::string_view s);

absl::Status UnlinkSegment(const std::string& name);
// Renames segment `from` to `to` (both "/slidedp...." names) inside `shm_dir`: tmpfs keeps the
// pages and every mapping as they are. ALREADY_EXISTS rather than replacing another segment.
absl::Status RenameSegment(const std::string& from, const std::string& to, const std::string& shm_dir = "/dev/shm");

// Free bytes of the filesystem holding the segments (statvfs f_bavail * f_frsize).
absl::StatusOr<uint64_t> ShmFreeBytes(const std::string& shm_dir = "/dev/shm");

enum class ReclaimMode {
  kDeadCreators,  // segments whose creator exited (or whose header is unreadable and that are
                  // older than the grace period: a creator that died mid-Create)
  kAll,           // every segment of the node (daemon start with --reclaim-all)
};

struct ReclaimedSegment {
  std::string name;  // "/slidedp.<node>...."
  int32_t creator_pid = 0;
  uint64_t bytes = 0;
  std::string reason;
};

// Lists <shm_dir>/slidedp.<node>.* and unlinks the stale ones. Returns what it removed.
absl::StatusOr<std::vector<ReclaimedSegment>> ReclaimStaleSegments(absl::string_view node,
                                                                   ReclaimMode mode = ReclaimMode::kDeadCreators,
                                                                   const std::string& shm_dir = "/dev/shm",
                                                                   int incomplete_grace_s = 10);

}  // namespace slidedp::shm
