// Helpers for the state tests: unique segment names, forked children, cleanup.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <string>

#include "absl/strings/str_cat.h"

namespace slidedp::shm::testing {

// A node component unique to this test process, so parallel test binaries never collide and
// ReclaimStaleSegments(node) only sees this process's segments.
inline std::string TestNode() { return absl::StrCat("t", ::getpid()); }

inline std::string UniqueJob() {
  static std::atomic<int> counter{0};
  return absl::StrCat("job", counter.fetch_add(1));
}

// shm_unlink on scope exit (ignores "already gone").
class ScopedUnlink {
 public:
  explicit ScopedUnlink(std::string name) : name_(std::move(name)) {}
  ~ScopedUnlink() { ::shm_unlink(name_.c_str()); }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// Runs fn() in a forked child that exits with fn's return value (never returns to gtest).
inline pid_t ForkChild(const std::function<int()>& fn) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 99;
    try {
      rc = fn();
    } catch (...) {
      rc = 98;
    }
    ::_exit(rc);
  }
  return pid;
}

// Exit code of the child, or 128 + signal number.
inline int WaitChild(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -2;
}

// Kills (SIGKILL) and reaps the child on scope exit unless Wait() already reaped it, so a
// failed ASSERT in the parent never leaves a child behind.
class ChildGuard {
 public:
  explicit ChildGuard(pid_t pid) : pid_(pid) {}
  ~ChildGuard() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      WaitChild(pid_);
    }
  }
  int Wait() {
    const int rc = WaitChild(pid_);
    pid_ = -1;
    return rc;
  }

 private:
  pid_t pid_;
};

}  // namespace slidedp::shm::testing
