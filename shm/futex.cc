// Futex-based waits with deadline, abort word and peer liveness.
#include "shm/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

#include "absl/strings/str_cat.h"

namespace slidedp::shm {

int FutexWait(const std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  if (timeout < absl::ZeroDuration()) timeout = absl::ZeroDuration();
  struct timespec ts = absl::ToTimespec(timeout);
  // Shared (not FUTEX_PRIVATE_FLAG): the kernel keys the wait on the page, so waiters and wakers
  // in different processes mapping the same segment meet.
  long rc = ::syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
  return rc == 0 ? 0 : errno;
}

void FutexWakeAll(const std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<const uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

const char* AbortReasonName(AbortReason r) {
  switch (r) {
    case AbortReason::kNone: return "none";
    case AbortReason::kCancelled: return "cancelled";
    case AbortReason::kWorkerFailed: return "worker failed";
    case AbortReason::kPeerDied: return "peer process died";
    case AbortReason::kShutdown: return "hostd shutting down";
    case AbortReason::kInternal: return "internal error";
  }
  return "unknown";
}

namespace {
constexpr uint32_t kPidMask = (1u << 24) - 1;
}

bool AbortWord::Raise(AbortReason reason) {
  if (reason == AbortReason::kNone) reason = AbortReason::kInternal;
  const uint32_t value = static_cast<uint32_t>(reason) << 24 | (static_cast<uint32_t>(::getpid()) & kPidMask);
  uint32_t expected = 0;
  const bool won = word_.compare_exchange_strong(expected, value, std::memory_order_acq_rel);
  FutexWakeAll(&word_);
  return won;
}

AbortReason AbortWord::reason() const { return static_cast<AbortReason>(word_.load(std::memory_order_acquire) >> 24); }

int32_t AbortWord::raised_by_pid() const {
  return static_cast<int32_t>(word_.load(std::memory_order_acquire) & kPidMask);
}

absl::Status AbortWord::ToStatus() const {
  const uint32_t w = word_.load(std::memory_order_acquire);
  if (w == 0) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("job aborted: ", AbortReasonName(static_cast<AbortReason>(w >> 24)),
                                         " (raised by pid ", w & kPidMask, ")"));
}

void PeerSlot::Set(const ProcessIdentity& who) {
  pid_.store(0, std::memory_order_relaxed);
  start_ticks_.store(who.start_ticks, std::memory_order_relaxed);
  pid_.store(who.pid, std::memory_order_release);
}

ProcessIdentity PeerSlot::Load() const {
  ProcessIdentity id;
  id.pid = pid_.load(std::memory_order_acquire);
  id.start_ticks = start_ticks_.load(std::memory_order_relaxed);
  return id;
}

absl::Status WaitForWord(const std::atomic<uint32_t>& word, absl::FunctionRef<bool(uint32_t)> done,
                         absl::Duration timeout, const WaitGuards& guards, absl::FunctionRef<std::string()> describe) {
  uint32_t v = word.load(std::memory_order_acquire);
  if (done(v)) return absl::OkStatus();
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  const absl::Duration slice = guards.slice > absl::ZeroDuration() ? guards.slice : absl::Milliseconds(50);
  while (true) {
    if (guards.abort != nullptr && guards.abort->raised()) {
      return absl::AbortedError(absl::StrCat(guards.abort->ToStatus().message(), " while waiting for ", describe()));
    }
    const ProcessIdentity peer = guards.peer_slot != nullptr ? guards.peer_slot->Load() : guards.peer;
    if (peer.pid > 0 && !IsProcessAlive(peer)) {
      // The peer may have finished its last write just before dying.
      v = word.load(std::memory_order_acquire);
      if (done(v)) return absl::OkStatus();
      return absl::UnavailableError(
          absl::StrCat(guards.peer_role, " pid ", peer.pid, " died while waiting for ", describe()));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("waited ", absl::ToInt64Milliseconds(now - start), " ms for ", describe()));
    }
    FutexWait(&word, v, std::min(slice, deadline - now));
    v = word.load(std::memory_order_acquire);
    if (done(v)) return absl::OkStatus();
  }
}

void VersionGate::Publish(uint32_t v) {
  version_.store(v, std::memory_order_release);
  FutexWakeAll(&version_);
}

absl::Status VersionGate::WaitAtLeast(uint32_t v, absl::Duration timeout, const AbortWord& abort,
                                      const ProcessIdentity& publisher) const {
  WaitGuards g;
  g.abort = &abort;
  g.peer = publisher;
  g.peer_role = "version publisher";
  return WaitAtLeast(v, timeout, g);
}

absl::Status VersionGate::WaitAtLeast(uint32_t v, absl::Duration timeout, const WaitGuards& guards) const {
  return WaitForWord(
      version_, [v](uint32_t cur) { return cur >= v; }, timeout, guards,
      [&] { return absl::StrCat("version >= ", v, " (now ", Load(), ")"); });
}

}  // namespace slidedp::shm
