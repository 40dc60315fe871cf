// POSIX shm segment: create/open/validate/prefault/unlink and stale reclaim.
#include "shm/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::shm {
namespace {

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

std::string Gib(uint64_t bytes) {
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
}

// Layout shared by Create and RequiredBytes: table after the header, regions after the table.
struct Placement {
  uint64_t table_offset = 0;
  uint64_t data_offset = 0;
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
};

Placement Place(const std::vector<RegionSpec>& regions, uint64_t alignment) {
  Placement p;
  p.table_offset = sizeof(ShmHeader);
  p.data_offset = AlignUp(p.table_offset + regions.size() * sizeof(ShmRegionEntry), alignment);
  uint64_t at = p.data_offset;
  for (const RegionSpec& r : regions) {
    p.offsets.push_back(at);
    at = AlignUp(at + r.bytes, alignment);
  }
  p.total = std::max<uint64_t>(at, p.data_offset);
  return p;
}

bool ValidComponent(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

std::atomic_ref<uint64_t> MagicRef(void* base) {
  return std::atomic_ref<uint64_t>(reinterpret_cast<ShmHeader*>(base)->magic);
}

}  // namespace

const char* ShmDtypeName(ShmDtype d) {
  switch (d) {
    case ShmDtype::kBytes: return "bytes";
    case ShmDtype::kF32: return "f32";
    case ShmDtype::kBF16: return "bf16";
    case ShmDtype::kU32: return "u32";
    case ShmDtype::kI8: return "i8";
    case ShmDtype::kU8: return "u8";
  }
  return "?";
}

uint64_t ShmSegment::RequiredBytes(const std::vector<RegionSpec>& regions, uint64_t alignment) {
  return Place(regions, alignment).total;
}

absl::StatusOr<uint64_t> ShmFreeBytes(const std::string& shm_dir) {
  struct statvfs st;
  if (::statvfs(shm_dir.c_str(), &st) != 0) return ErrnoStatus(absl::StrCat("statvfs ", shm_dir), errno);
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

ShmSegment::ShmSegment(std::string name, int fd, uint8_t* base, uint64_t bytes, Access access)
    : name_(std::move(name)), fd_(fd), base_(base), bytes_(bytes), access_(access) {}

ShmSegment::~ShmSegment() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

ProcessIdentity ShmSegment::creator() const {
  return ProcessIdentity{header().creator_pid, header().creator_start_ticks};
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(const std::string& name,
                                                               const std::vector<RegionSpec>& regions,
                                                               const ShmCreateOptions& options) {
  return CreateOrReformat(name, regions, options, /*reformat=*/false);
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Reformat(const std::string& name,
                                                                 const std::vector<RegionSpec>& regions,
                                                                 const ShmCreateOptions& options) {
  return CreateOrReformat(name, regions, options, /*reformat=*/true);
}

// Region names: 1..kRegionNameBytes-1 characters, no duplicates.
static absl::Status ValidateRegions(const std::string& name, const std::vector<RegionSpec>& regions) {
  for (size_t i = 0; i < regions.size(); ++i) {
    if (regions[i].name.empty() || regions[i].name.size() >= kRegionNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("segment ", name, ": region name '", regions[i].name,
                                                     "' must be 1..", kRegionNameBytes - 1, " characters"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (regions[j].name == regions[i].name) {
        return absl::InvalidArgumentError(absl::StrCat("segment ", name, ": duplicate region '", regions[i].name, "'"));
      }
    }
  }
  return absl::OkStatus();
}

// Writes the header (magic excluded) and region table of `place` at `base`.
static void WriteLayout(void* base, const Placement& place, const std::vector<RegionSpec>& regions,
                        uint64_t alignment) {
  auto* h = reinterpret_cast<ShmHeader*>(base);
  std::memset(h, 0, sizeof(ShmHeader));
  h->layout_version = kShmLayoutVersion;
  h->header_bytes = sizeof(ShmHeader);
  h->total_bytes = place.total;
  ProcessIdentity self = SelfIdentity();
  h->creator_pid = self.pid;
  h->creator_start_ticks = self.start_ticks;
  h->region_count = static_cast<uint32_t>(regions.size());
  h->table_offset = place.table_offset;
  h->data_offset = place.data_offset;
  h->alignment = alignment;
  h->created_unix_ns = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  auto* table = reinterpret_cast<ShmRegionEntry*>(static_cast<uint8_t*>(base) + place.table_offset);
  for (size_t i = 0; i < regions.size(); ++i) {
    ShmRegionEntry& e = table[i];
    std::memset(&e, 0, sizeof(e));
    std::memcpy(e.name, regions[i].name.data(), regions[i].name.size());
    e.dtype = static_cast<uint32_t>(regions[i].dtype);
    e.offset = place.offsets[i];
    e.bytes = regions[i].bytes;
  }
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::CreateOrReformat(const std::string& name,
                                                                         const std::vector<RegionSpec>& regions,
                                                                         const ShmCreateOptions& options,
                                                                         bool reformat) {
  if (options.alignment < kCacheLineBytes || (options.alignment & (options.alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("segment ", name, ": alignment ", options.alignment,
                                                   " must be a power of two >= ", kCacheLineBytes));
  }
  RETURN_IF_ERROR(ValidateRegions(name, regions));
  const Placement place = Place(regions, options.alignment);

  // Refuse before touching anything: fallocate would fail too, but this gives the numbers.
  ASSIGN_OR_RETURN(uint64_t free_bytes, ShmFreeBytes(options.shm_dir));
  if (!reformat && place.total > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("segment ", name, " needs ", place.total, " bytes (",
                                                     Gib(place.total), ") but ", options.shm_dir, " has ", free_bytes,
                                                     " bytes (", Gib(free_bytes), ") free"));
  }

  int fd = reformat ? ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0)
                    : ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(absl::StrCat("shm_open ", name), errno);
  if (reformat) {
    struct stat st;
    if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < place.total) {
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat("segment ", name, " is smaller than the ", place.total,
                                                        " bytes of its new layout (it can only shrink)"));
    }
    // Only the magic first: an opener racing the re-layout sees "still being created".
    void* head = ::mmap(nullptr, sizeof(ShmHeader), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (head != MAP_FAILED) {
      MagicRef(head).store(0, std::memory_order_release);
      ::munmap(head, sizeof(ShmHeader));
    }
  }
  auto fail = [&](absl::Status s) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return s;
  };
  ::fchmod(fd, 0600);  // the umask may only remove bits, but make the mode explicit
  if (::ftruncate(fd, static_cast<off_t>(place.total)) != 0) {
    return fail(ErrnoStatus(absl::StrCat("ftruncate ", name, " to ", place.total), errno));
  }
  // A reformatted segment keeps the pages it already has (ftruncate dropped those past the end).
  const bool parallel_alloc = options.allocation == Allocation::kAll && options.allocate_threads > 1 && !reformat;
  const uint64_t first_alloc =
      options.allocation == Allocation::kAll && !parallel_alloc ? place.total : place.data_offset;
  if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(first_alloc)); err != 0) {
    if (err == ENOSPC) {
      uint64_t now_free = ShmFreeBytes(options.shm_dir).value_or(0);
      return fail(
          absl::ResourceExhaustedError(absl::StrCat("fallocate ", name, ": /dev/shm full; requested ", first_alloc,
                                                    " bytes (", Gib(first_alloc), "), ", now_free, " bytes free")));
    }
    return fail(ErrnoStatus(absl::StrCat("fallocate ", name), err));
  }
  void* base = ::mmap(nullptr, place.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail(ErrnoStatus(absl::StrCat("mmap ", name), errno));

  WriteLayout(base, place, regions, options.alignment);
  MagicRef(base).store(kShmMagic, std::memory_order_release);  // publish: header complete

  std::unique_ptr<ShmSegment> seg(
      new ShmSegment(name, fd, static_cast<uint8_t*>(base), place.total, Access::kReadWrite));
  absl::Status s = seg->LoadRegionTable();
  if (s.ok() && parallel_alloc) {
    s = seg->Prefault(place.data_offset, place.total - place.data_offset, options.allocate_threads);
  }
  if (!s.ok()) {
    ::shm_unlink(name.c_str());
    return s;
  }
  VLOG(1) << "created shm segment " << name << " (" << Gib(place.total) << ", " << regions.size() << " regions)";
  return seg;
}

absl::Status ShmSegment::Relayout(const std::string& new_name, const std::vector<RegionSpec>& regions,
                                  uint64_t alignment) {
  if (access_ != Access::kReadWrite)
    return absl::FailedPreconditionError(absl::StrCat("segment ", name_, " is read-only"));
  RETURN_IF_ERROR(ValidateRegions(new_name, regions));
  const Placement place = Place(regions, alignment);
  if (place.total != bytes_) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", name_, " is ", bytes_,
                                                      " bytes; the new layout needs ", place.total,
                                                      " (relayout in place needs the same size)"));
  }
  MagicRef(base_).store(0, std::memory_order_release);  // an opener racing it sees "still being created"
  WriteLayout(base_, place, regions, alignment);
  MagicRef(base_).store(kShmMagic, std::memory_order_release);
  name_ = new_name;
  return LoadRegionTable();
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Open(const std::string& name, Access access) {
  const bool rw = access == Access::kReadWrite;
  int fd = ::shm_open(name.c_str(), (rw ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(absl::StrCat("shm_open ", name), errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(absl::StrCat("fstat ", name), err);
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < sizeof(ShmHeader)) {
    ::close(fd);
    return absl::DataLossError(absl::StrCat("segment ", name, " is ", file_bytes, " bytes, smaller than its ",
                                            sizeof(ShmHeader), "-byte header: truncated or not a slidedp segment"));
  }
  void* base = ::mmap(nullptr, file_bytes, PROT_READ | (rw ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(absl::StrCat("mmap ", name), err);
  }
  std::unique_ptr<ShmSegment> seg(new ShmSegment(name, fd, static_cast<uint8_t*>(base), file_bytes, access));
  const ShmHeader& h = seg->header();
  const uint64_t magic = MagicRef(base).load(std::memory_order_acquire);
  if (magic == 0) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", name, " is not initialized (creator pid ",
                                                      h.creator_pid,
                                                      " has not finished creating it, or died doing so)"));
  }
  if (magic != kShmMagic) {
    return absl::DataLossError(absl::StrFormat(
        "segment %s: bad magic 0x%016x (expected 0x%016x): corrupt or not a slidedp segment", name, magic, kShmMagic));
  }
  if (h.layout_version != kShmLayoutVersion) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", name, " has layout version ", h.layout_version,
                                                      "; this build reads version ", kShmLayoutVersion));
  }
  if (h.header_bytes != sizeof(ShmHeader)) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", name, ": header is ", h.header_bytes,
                                                      " bytes; this build expects ", sizeof(ShmHeader)));
  }
  if (h.total_bytes != file_bytes) {
    return absl::DataLossError(absl::StrCat("segment ", name, ": header says ", h.total_bytes,
                                            " bytes but the file has ", file_bytes, " (truncated or corrupt)"));
  }
  RETURN_IF_ERROR(seg->LoadRegionTable());
  return seg;
}

// Validates the table against the mapping and copies it out (so later corruption of the shared
// table cannot redirect this process's accesses).
absl::StatusOr<ShmSegment::FileId> ShmSegment::Identity() const {
  struct stat st;
  if (fstat(fd_, &st) != 0) return ErrnoStatus(absl::StrCat("fstat of segment ", name_), errno);
  return FileId{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_nlink),
                static_cast<uint64_t>(st.st_size)};
}

absl::Status ShmSegment::Reload() {
  ASSIGN_OR_RETURN(FileId id, Identity());
  if (id.size != bytes_) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment ", name_, ": the file is ", id.size, " bytes now, mapped with ", bytes_));
  }
  return LoadRegionTable();
}

absl::Status ShmSegment::LoadRegionTable() {
  const ShmHeader& h = header();
  const uint64_t n = h.region_count;
  if (h.table_offset < sizeof(ShmHeader) || h.table_offset > bytes_ ||
      n > (bytes_ - h.table_offset) / sizeof(ShmRegionEntry) ||
      h.data_offset < h.table_offset + n * sizeof(ShmRegionEntry) || h.data_offset > bytes_) {
    return absl::DataLossError(absl::StrCat("segment ", name_, ": region table (offset ", h.table_offset, ", ", n,
                                            " entries, data at ", h.data_offset, ") does not fit in ", bytes_,
                                            " bytes"));
  }
  const auto* table = reinterpret_cast<const ShmRegionEntry*>(base_ + h.table_offset);
  regions_.clear();
  regions_.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    const ShmRegionEntry& e = table[i];
    const void* nul = std::memchr(e.name, '\0', kRegionNameBytes);
    if (nul == nullptr) {
      return absl::DataLossError(absl::StrCat("segment ", name_, ": region ", i, " name is not terminated"));
    }
    if (e.offset < h.data_offset || e.offset > bytes_ || e.bytes > bytes_ - e.offset ||
        e.dtype > static_cast<uint32_t>(ShmDtype::kU8)) {
      return absl::DataLossError(absl::StrCat("segment ", name_, ": region '", e.name, "' (offset ", e.offset, ", ",
                                              e.bytes, " bytes, dtype ", e.dtype, ") lies outside the ", bytes_,
                                              "-byte segment or is invalid"));
    }
    regions_.push_back(Region{std::string(e.name), e.offset, e.bytes, static_cast<ShmDtype>(e.dtype)});
  }
  return absl::OkStatus();
}

absl::StatusOr<Region> ShmSegment::FindRegion(absl::string_view name) const {
  for (const Region& r : regions_) {
    if (r.name == name) return r;
  }
  return absl::NotFoundError(absl::StrCat("segment ", name_, " has no region '", name, "'"));
}

absl::Status ShmSegment::Allocate(uint64_t offset, uint64_t bytes) {
  if (access_ != Access::kReadWrite) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", name_, " is mapped read-only"));
  }
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return absl::OutOfRangeError(
        absl::StrCat("segment ", name_, ": range [", offset, ", +", bytes, ") exceeds ", bytes_, " bytes"));
  }
  if (bytes == 0) return absl::OkStatus();
  if (int err = ::posix_fallocate(fd_, static_cast<off_t>(offset), static_cast<off_t>(bytes)); err != 0) {
    if (err == ENOSPC) {
      return absl::ResourceExhaustedError(absl::StrCat("fallocate ", name_, ": /dev/shm full; requested ", bytes,
                                                       " bytes (", Gib(bytes), ") at offset ", offset, ", ",
                                                       ShmFreeBytes().value_or(0), " bytes free"));
    }
    return ErrnoStatus(absl::StrCat("fallocate ", name_), err);
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::Prefault(uint64_t offset, uint64_t bytes, int threads) {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return absl::OutOfRangeError(
        absl::StrCat("segment ", name_, ": range [", offset, ", +", bytes, ") exceeds ", bytes_, " bytes"));
  }
  const uint64_t begin = offset / kPageBytes * kPageBytes;
  const uint64_t end = AlignUp(offset + bytes, kPageBytes);
  if (end <= begin) return absl::OkStatus();
  const uint64_t pages = (end - begin) / kPageBytes;
  const int n = static_cast<int>(std::clamp<uint64_t>(threads < 1 ? 1 : threads, 1, pages));
  const int advice = access_ == Access::kReadWrite ? MADV_POPULATE_WRITE : MADV_POPULATE_READ;
  std::vector<int> errs(n, 0);
  auto work = [&](int t) {
    uint64_t lo = begin + pages * t / n * kPageBytes;
    uint64_t hi = begin + pages * (t + 1) / n * kPageBytes;
    if (::madvise(base_ + lo, hi - lo, advice) == 0) return;
    if (errno != EINVAL) {
      errs[t] = errno;
      return;
    }
    // Kernel before 5.14: touch each page without changing its data.
    for (uint64_t at = lo; at < hi; at += kPageBytes) {
      if (access_ == Access::kReadWrite) {
        __atomic_fetch_add(base_ + at, 0, __ATOMIC_RELAXED);
      } else {
        (void)*static_cast<volatile uint8_t*>(base_ + at);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  for (int err : errs) {
    if (err == ENOMEM || err == EFAULT) {
      return absl::ResourceExhaustedError(absl::StrCat("prefault ", name_, " [", offset, ", +", bytes,
                                                       "): ", std::strerror(err),
                                                       " (range not allocated and /dev/shm or memory full?)"));
    }
    if (err != 0) return ErrnoStatus(absl::StrCat("madvise(POPULATE) ", name_), err);
  }
  return absl::OkStatus();
}

absl::Status ShmSegment::TakeOwnership() {
  if (access_ != Access::kReadWrite) {
    return absl::FailedPreconditionError(absl::StrCat("segment ", name_, " is mapped read-only"));
  }
  const ProcessIdentity self = SelfIdentity();
  const ProcessIdentity old = creator();
  if (old.pid == self.pid && old.start_ticks == self.start_ticks) return absl::OkStatus();
  if (old.pid > 0 && IsProcessAlive(old)) {
    return absl::FailedPreconditionError(
        absl::StrCat("segment ", name_, ": its creator (pid ", old.pid, ") is still running"));
  }
  auto* h = reinterpret_cast<ShmHeader*>(base_);
  h->creator_pid = self.pid;
  h->creator_start_ticks = self.start_ticks;
  return absl::OkStatus();
}

absl::Status ShmSegment::Unlink() { return UnlinkSegment(name_); }

absl::Status UnlinkSegment(const std::string& name) {
  if (::shm_unlink(name.c_str()) != 0) return ErrnoStatus(absl::StrCat("shm_unlink ", name), errno);
  return absl::OkStatus();
}

absl::Status RenameSegment(const std::string& from, const std::string& to, const std::string& shm_dir) {
  const std::string a = shm_dir + from, b = shm_dir + to;
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_NOREPLACE) != 0) {
    return ErrnoStatus(absl::StrCat("rename ", a, " to ", b), errno);
  }
  return absl::OkStatus();
}

std::string SanitizeNameComponent(absl::string_view s) {
  std::string out;
  for (char c : s) {
    out.push_back(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' ? c : '-');
  }
  return out.empty() ? "x" : out;
}

absl::StatusOr<std::string> MakeSegmentName(absl::string_view node, absl::string_view job, absl::string_view purpose) {
  for (auto [what, v] : {std::pair<const char*, absl::string_view>{"node", node}, {"job", job}, {"purpose", purpose}}) {
    if (!ValidComponent(v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("segment name ", what, " '", v, "' must be non-empty [A-Za-z0-9_-]"));
    }
  }
  std::string name = absl::StrCat("/slidedp.", node, ".", job, ".", purpose);
  if (name.size() > 200) {
    return absl::InvalidArgumentError(absl::StrCat("segment name too long: ", name));
  }
  return name;
}

absl::StatusOr<std::vector<ReclaimedSegment>> ReclaimStaleSegments(absl::string_view node, ReclaimMode mode,
                                                                   const std::string& shm_dir, int incomplete_grace_s) {
  if (!ValidComponent(node)) {
    return absl::InvalidArgumentError(absl::StrCat("node '", node, "' must be [A-Za-z0-9_-]"));
  }
  const std::string prefix = absl::StrCat("slidedp.", node, ".");
  DIR* dir = ::opendir(shm_dir.c_str());
  if (dir == nullptr) return ErrnoStatus(absl::StrCat("opendir ", shm_dir), errno);
  std::vector<std::string> names;
  while (struct dirent* d = ::readdir(dir)) {
    if (absl::StartsWith(d->d_name, prefix)) names.emplace_back(d->d_name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());

  std::vector<ReclaimedSegment> removed;
  const time_t now = ::time(nullptr);
  for (const std::string& file : names) {
    const std::string path = absl::StrCat(shm_dir, "/", file);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;  // raced with another unlink
    struct stat st;
    ShmHeader h;
    std::memset(&h, 0, sizeof(h));
    bool have_stat = ::fstat(fd, &st) == 0;
    ssize_t got = ::pread(fd, &h, sizeof(h), 0);
    ::close(fd);
    if (!have_stat) continue;
    ReclaimedSegment r;
    r.name = absl::StrCat("/", file);
    r.bytes = static_cast<uint64_t>(st.st_size);
    const bool header_ok = got == static_cast<ssize_t>(sizeof(h)) && h.magic == kShmMagic;
    r.creator_pid = got == static_cast<ssize_t>(sizeof(h)) ? h.creator_pid : 0;
    if (mode == ReclaimMode::kAll) {
      r.reason = "reclaim-all requested";
    } else if (header_ok) {
      if (IsProcessAlive(ProcessIdentity{h.creator_pid, h.creator_start_ticks})) continue;
      r.reason = absl::StrCat("creator pid ", h.creator_pid, " is gone");
    } else {
      // A creator that died inside Create leaves no magic; a live one finishes in well under
      // the grace period.
      if (r.creator_pid > 0 && IsProcessAlive(ProcessIdentity{h.creator_pid, h.creator_start_ticks})) continue;
      if (now - st.st_mtime < incomplete_grace_s) continue;
      r.reason = "incomplete or corrupt header, older than the grace period";
    }
    if (::unlink(path.c_str()) != 0) {
      if (errno == ENOENT) continue;
      return ErrnoStatus(absl::StrCat("unlink ", path), errno);
    }
    LOG(INFO) << "reclaimed stale shm segment " << r.name << " (" << Gib(r.bytes) << "): " << r.reason;
    removed.push_back(std::move(r));
  }
  return removed;
}

}  // namespace slidedp::shm
