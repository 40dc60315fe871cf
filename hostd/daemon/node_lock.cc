// NodeLock: flock on /dev/shm/slidedp-<node>.lock; see node_lock.h.
#include "hostd/daemon/node_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status/status_macros.h"

namespace slidedp::hostd {

absl::StatusOr<NodeLock> NodeLock::Acquire(const std::string& node, const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/slidedp-", node, ".lock");
  // The holder unlinks the file when it lets go (so lock files do not pile up in /dev/shm): a
  // lock taken on a file that is no longer the one at `path` is stale, and the open is retried.
  for (int attempt = 0;; ++attempt) {
    ASSIGN_OR_RETURN(std::optional<NodeLock> lock, TryAcquire(node, path));
    if (lock) return *std::move(lock);
    if (attempt == 16) return absl::UnavailableError(absl::StrCat(path, " kept being replaced while it was locked"));
  }
}

absl::StatusOr<std::optional<NodeLock>> NodeLock::TryAcquire(const std::string& node, const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return ErrnoStatus(absl::StrCat("open ", path), errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK) return ErrnoStatus(absl::StrCat("flock ", path), err);
    const std::string holder = n > 0 ? std::string(absl::StripAsciiWhitespace(std::string(buf, n))) : "?";
    return absl::AlreadyExistsError(absl::StrCat("another slidedp-hostd (pid ", holder, ") serves node '", node, "' (",
                                                 path, " is locked); one hostd per node"));
  }
  struct stat held {}, named {};
  if (::fstat(fd, &held) != 0 || ::stat(path.c_str(), &named) != 0 || held.st_ino != named.st_ino ||
      held.st_dev != named.st_dev) {
    ::close(fd);  // the previous holder unlinked it after this open: take the file there now
    return std::optional<NodeLock>();
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(absl::StrCat("write ", path), err);
  }
  return std::optional<NodeLock>(NodeLock(fd, path));
}

NodeLock::~NodeLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // while locked: a later Acquire that opened it sees it replaced and retries
  ::close(fd_);
}

}  // namespace slidedp::hostd
