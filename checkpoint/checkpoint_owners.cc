// Which run a checkpoint belongs to, the bounded listing of a root's checkpoints with their
// owners, and moving other runs' checkpoints aside for output.overwrite (checkpoint.h,
// "Ownership"). The listing runs inside hostd's submit handler on a directory a client may have
// filled, so it reads only COMPLETE's type and a bounded trainer_state.json per entry.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <filesystem>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_files.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr char kSupersededPrefix[] = "superseded-";

bool ValidJobIdText(const std::string& id) {
  if (id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// "20261203T141502Z": now, UTC.
std::string UtcStamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

}  // namespace

std::string RunIdOf(const nlohmann::json& trainer_state) {
  if (!trainer_state.is_object()) return "";
  for (const char* key : {"run_id", "job_id"}) {
    auto it = trainer_state.find(key);
    if (it != trainer_state.end() && it->is_string() && !it->get_ref<const std::string&>().empty()) {
      return it->get<std::string>();
    }
  }
  return "";
}

absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& root) {
  const int root_fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root_fd < 0) return ErrnoStatus(absl::StrCat("list checkpoints in ", root), errno);
  absl::Cleanup close_root = [root_fd] { ::close(root_fd); };
  const int list_fd = ::dup(root_fd);
  if (list_fd < 0) return ErrnoStatus(absl::StrCat("list checkpoints in ", root), errno);
  DIR* dir = ::fdopendir(list_fd);  // owns list_fd from here
  if (dir == nullptr) {
    const int err = errno;
    ::close(list_fd);
    return ErrnoStatus(absl::StrCat("list checkpoints in ", root), err);
  }
  absl::Cleanup close_dir = [dir] { ::closedir(dir); };
  std::vector<std::pair<int64_t, std::string>> named;  // (step, name)
  size_t entries = 0;
  for (;;) {
    errno = 0;
    const dirent* d = ::readdir(dir);
    if (d == nullptr) {
      if (errno != 0) return ErrnoStatus(absl::StrCat("list checkpoints in ", root), errno);
      break;
    }
    if (++entries > kMaxListedDirEntries) {
      return absl::FailedPreconditionError(absl::StrCat(root, " holds more than ", kMaxListedDirEntries,
                                                        " entries; not an output directory slidedp examines"));
    }
    const std::string name = d->d_name;
    const int64_t step = internal::StepOfDirName(name);
    if (step < 0) continue;
    if (named.size() == kMaxListedCheckpoints) {
      return absl::FailedPreconditionError(absl::StrCat(root, " holds more than ", kMaxListedCheckpoints,
                                                        " checkpoint-<N> entries; not an output directory slidedp "
                                                        "examines (move some away)"));
    }
    named.emplace_back(step, name);
  }
  // Newest first; the same step twice (checkpoint-7, checkpoint-007) by name.
  std::sort(named.begin(), named.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  std::vector<CheckpointEntry> out;
  out.reserve(named.size());
  uint64_t budget = kMaxListedStateTotalBytes;
  for (const auto& [step, name] : named) {
    ASSIGN_OR_RETURN(CheckpointEntry e, internal::ExamineCheckpointEntry(root_fd, root, name, step, &budget));
    out.push_back(std::move(e));
  }
  return out;
}

absl::StatusOr<MovedAside> MoveCheckpointsAside(const std::string& root, const std::vector<std::string>& dirs,
                                                const std::string& job_id) {
  if (!ValidJobIdText(job_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("moving checkpoints aside: job id '", job_id, "' is not 0-128 characters of [A-Za-z0-9_-]"));
  }
  const fs::path root_path = fs::absolute(root).lexically_normal();
  const fs::path root_dir = root_path.filename().empty() ? root_path.parent_path() : root_path;
  std::vector<std::string> names;
  for (const std::string& d : dirs) {
    const fs::path p = fs::absolute(d).lexically_normal();
    if (p.parent_path() != root_dir || internal::StepOfDirName(p.filename().string()) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("moving checkpoints aside: ", d, " is not a checkpoint-<N> entry of ", root_dir.string()));
    }
    names.push_back(p.filename().string());
  }
  MovedAside result;
  if (names.empty()) return result;

  const int root_fd = ::open(root_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root_fd < 0) return ErrnoStatus(absl::StrCat("open ", root_dir.string()), errno);
  absl::Cleanup close_root = [root_fd] { ::close(root_fd); };
  // A new directory of its own: two overwrites within a second get -2, -3, ...
  const std::string base = absl::StrCat(kSupersededPrefix, UtcStamp(), job_id.empty() ? "" : "-", job_id);
  std::string aside;
  for (int k = 1; k <= 100 && aside.empty(); ++k) {
    const std::string name = k == 1 ? base : absl::StrCat(base, "-", k);
    if (::mkdirat(root_fd, name.c_str(), 0755) == 0) {
      aside = name;
    } else if (errno != EEXIST) {
      return ErrnoStatus(absl::StrCat("moving checkpoints aside: create ", (root_dir / name).string()), errno);
    }
  }
  if (aside.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("moving checkpoints aside: ", (root_dir / base).string(), "-2 ... -100 all exist"));
  }
  result.dir = (root_dir / aside).string();
  const int aside_fd = ::openat(root_fd, aside.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (aside_fd < 0) return ErrnoStatus(absl::StrCat("open ", result.dir), errno);
  absl::Cleanup close_aside = [aside_fd] { ::close(aside_fd); };
  for (const std::string& name : names) {
    const std::string from = (root_dir / name).string(), to = (fs::path(result.dir) / name).string();
    int renamed = ::renameat2(root_fd, name.c_str(), aside_fd, name.c_str(), RENAME_NOREPLACE);
    // A file system without RENAME_NOREPLACE (NFS): the directory is new and its names unique.
    if (renamed != 0 && errno == EINVAL) renamed = ::renameat(root_fd, name.c_str(), aside_fd, name.c_str());
    if (renamed == 0) {
      result.moved.emplace_back(from, to);
      continue;
    }
    const int err = errno;
    if (err == ENOENT) continue;  // gone meanwhile (or named twice): nothing to keep
    std::vector<std::string> done;
    for (const auto& [f, t] : result.moved) done.push_back(absl::StrCat(f, " -> ", t));
    return Annotate(ErrnoStatus(absl::StrCat("rename ", from, " to ", to), err),
                    absl::StrCat("moving checkpoints aside (", done.empty() ? "none moved yet" : "moved already: ",
                                 absl::StrJoin(done, ", "), "; nothing was removed)"));
  }
  if (result.moved.empty()) {  // every one was gone: leave no empty directory behind
    ::unlinkat(root_fd, aside.c_str(), AT_REMOVEDIR);
    result.dir.clear();
    return result;
  }
  if (::fsync(aside_fd) != 0) return ErrnoStatus(absl::StrCat("fsync ", result.dir), errno);
  if (::fsync(root_fd) != 0) return ErrnoStatus(absl::StrCat("fsync ", root_dir.string()), errno);
  for (const auto& [from, to] : result.moved) LOG(INFO) << "moved " << from << " aside to " << to;
  return result;
}

}  // namespace slidedp::checkpoint
