// NodeLock: one slidedp-hostd per node name. Two daemons of one node would reclaim, pool and
// unlink each other's shared-memory segments; the lock is an flock(2) on
// /dev/shm/slidedp-<node>.lock (next to the segments, outside their "slidedp.<node>." names so the
// stale-segment scan never sees it), held for the process's life and released by the kernel when
// it dies, however it dies. The holder's pid is written into the file for the refusal message; a
// holder that exits normally unlinks the file (a later Acquire that raced with it retries).
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace slidedp::hostd {

class NodeLock {
 public:
  // ALREADY_EXISTS naming the holder's pid when another live process holds the node.
  static absl::StatusOr<NodeLock> Acquire(const std::string& node, const std::string& dir = "/dev/shm");
  NodeLock(NodeLock&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  NodeLock& operator=(NodeLock&&) = delete;
  ~NodeLock();
  const std::string& path() const { return path_; }

 private:
  NodeLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  // One open-and-lock; nullopt when the file locked was unlinked (replaced) after the open.
  static absl::StatusOr<std::optional<NodeLock>> TryAcquire(const std::string& node, const std::string& path);
  int fd_ = -1;
  std::string path_;
};

}  // namespace slidedp::hostd
