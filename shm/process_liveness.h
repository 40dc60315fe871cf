// Identity and liveness of peer processes that share a segment (hostd, workers).
//
// A pid alone is not an identity: pids are reused, and a dead child stays a zombie (kill(pid, 0)
// still succeeds) until its parent reaps it. So a peer is {pid, start time in clock ticks since
// boot} read from /proc/<pid>/stat, and a zombie counts as dead. Limit: peers must share a pid
// namespace (hostd and workers on one host, not in separate containers).
#pragma once

#include <cstdint>

namespace slidedp::shm {

struct ProcessIdentity {
  int32_t pid = 0;
  uint64_t start_ticks = 0;  // /proc/<pid>/stat field 22; 0 = unknown (only the pid is checked)
};

// The calling process (after fork, the child's own identity).
ProcessIdentity SelfIdentity();

// The identity of a running process; {pid, 0} if /proc could not be read.
ProcessIdentity IdentityOf(int32_t pid);

// False when the process has exited (also as an unreaped zombie) or its pid now belongs to a
// process started at another time. pid <= 0 means "no peer recorded" and counts as alive.
bool IsProcessAlive(const ProcessIdentity& who);

}  // namespace slidedp::shm
