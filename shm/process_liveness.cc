// Reads /proc/<pid>/stat to tell a live peer from a dead, zombie or reused pid.
#include "shm/process_liveness.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace slidedp::shm {
namespace {

enum class StatRead { kOk, kNoSuchProcess, kUnreadable };

// Parses state and starttime from /proc/<pid>/stat. The comm field may contain spaces and
// parentheses, so parsing starts after the last ')'.
StatRead ReadStat(int32_t pid, char* state, uint64_t* start_ticks) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? StatRead::kNoSuchProcess : StatRead::kUnreadable;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return n == 0 ? StatRead::kNoSuchProcess : StatRead::kUnreadable;
  buf[n] = '\0';
  char* p = std::strrchr(buf, ')');
  if (p == nullptr || p[1] != ' ') return StatRead::kUnreadable;
  p += 2;  // field 3: state
  *state = *p;
  // Skip to field 22 (starttime): 19 more space-separated fields after the state.
  for (int field = 3; field < 22; ++field) {
    p = std::strchr(p, ' ');
    if (p == nullptr) return StatRead::kUnreadable;
    ++p;
  }
  *start_ticks = std::strtoull(p, nullptr, 10);
  return StatRead::kOk;
}

}  // namespace

ProcessIdentity SelfIdentity() { return IdentityOf(static_cast<int32_t>(::getpid())); }

ProcessIdentity IdentityOf(int32_t pid) {
  ProcessIdentity id;
  id.pid = pid;
  char state = 0;
  uint64_t ticks = 0;
  if (ReadStat(pid, &state, &ticks) == StatRead::kOk) id.start_ticks = ticks;
  return id;
}

bool IsProcessAlive(const ProcessIdentity& who) {
  if (who.pid <= 0) return true;
  char state = 0;
  uint64_t ticks = 0;
  switch (ReadStat(who.pid, &state, &ticks)) {
    case StatRead::kNoSuchProcess: return false;
    case StatRead::kUnreadable:
      // No usable /proc: fall back to signal 0 (cannot see zombies or pid reuse).
      return ::kill(who.pid, 0) == 0 || errno == EPERM;
    case StatRead::kOk: break;
  }
  if (state == 'Z' || state == 'X' || state == 'x') return false;
  if (who.start_ticks != 0 && ticks != who.start_ticks) return false;  // pid reused
  return true;
}

}  // namespace slidedp::shm
