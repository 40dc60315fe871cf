// Cross-process waits on 32-bit words in shared memory (Linux futex, shared, not PRIVATE).
//
// Every wait has a deadline and wakes at least every `slice` (50 ms) to check the job-wide
// AbortWord and, when given, that the peer process which should change the word is still alive:
// a dead peer becomes UNAVAILABLE within about one slice, never a hang. Publishers store with
// release order and then FUTEX_WAKE all waiters; waiters load with acquire order.
//
// The classes below live inside shared segments: standard layout, fixed size, lock-free atomics,
// each on its own cache line (no false sharing between a publisher and another word's waiters).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "shm/process_liveness.h"

namespace slidedp::shm {

static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

// Raw futex calls. FutexWait returns 0 (woken, maybe spuriously), ETIMEDOUT, EAGAIN (the word
// was no longer `expected`) or EINTR.
int FutexWait(const std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout);
void FutexWakeAll(const std::atomic<uint32_t>* word);

enum class AbortReason : uint32_t {
  kNone = 0,
  kCancelled = 1,     // user cancelled the job
  kWorkerFailed = 2,  // a worker reported an error
  kPeerDied = 3,      // a worker or hostd process disappeared
  kShutdown = 4,      // hostd is stopping
  kInternal = 5,      // a bug or unexpected state
};
const char* AbortReasonName(AbortReason r);

// Job-wide abort flag with its reason and the pid that raised it, packed into one word
// (reason << 24 | pid) so the first Raise wins atomically. pids fit 22 bits (pid_max <= 2^22).
class alignas(64) AbortWord {
 public:
  // Returns true when this call raised it; false when it was already raised (first reason kept).
  bool Raise(AbortReason reason);
  bool raised() const { return word_.load(std::memory_order_acquire) != 0; }
  AbortReason reason() const;
  int32_t raised_by_pid() const;
  // OK while not raised; ABORTED "job aborted: <reason> (raised by pid N)" after.
  absl::Status ToStatus() const;
  // For a pooled segment reused by the next job; only while nobody waits.
  void Reset() { word_.store(0, std::memory_order_release); }
  const std::atomic<uint32_t>* word() const { return &word_; }

 private:
  std::atomic<uint32_t> word_{0};
  uint8_t pad_[60];
};
static_assert(sizeof(AbortWord) == 64 && std::is_standard_layout_v<AbortWord>);

// A process identity stored in shared memory, set when a peer attaches (e.g. a ring's producer).
class alignas(16) PeerSlot {
 public:
  void Set(const ProcessIdentity& who);
  ProcessIdentity Load() const;  // {0,0} until set

 private:
  std::atomic<uint64_t> start_ticks_{0};
  std::atomic<int32_t> pid_{0};  // written last (release)
  uint32_t pad_ = 0;
};
static_assert(sizeof(PeerSlot) == 16 && std::is_standard_layout_v<PeerSlot>);

// What a wait watches besides its own word.
struct WaitGuards {
  const AbortWord* abort = nullptr;     // job-wide abort word (usually required)
  ProcessIdentity peer;                 // pid 0: none
  const PeerSlot* peer_slot = nullptr;  // re-read every slice; used when set
  const char* peer_role = "peer";       // for messages: "producer pid 123 died"
  absl::Duration slice = absl::Milliseconds(50);
};

// Blocks until done(word) holds. Returns OK, DEADLINE_EXCEEDED ("waited X ms for <describe()>"),
// ABORTED (the abort word's reason) or UNAVAILABLE ("<role> pid N died while waiting for ...").
// `done` may also read other shared words; a change to those is noticed within one slice unless
// their writer also wakes `word`.
absl::Status WaitForWord(const std::atomic<uint32_t>& word, absl::FunctionRef<bool(uint32_t)> done,
                         absl::Duration timeout, const WaitGuards& guards, absl::FunctionRef<std::string()> describe);

// Per-unit parameter version: step t may upload unit u only when version(u) >= t, i.e. after t
// completed updates. Written by the LayerAdam owner of the unit, waited on by workers.
// Versions are step numbers and never wrap (2^32 steps).
class alignas(64) VersionGate {
 public:
  uint32_t Load() const { return version_.load(std::memory_order_acquire); }
  // Makes every write before it visible to a waiter that sees >= v, then wakes all waiters.
  void Publish(uint32_t v);
  absl::Status WaitAtLeast(uint32_t v, absl::Duration timeout, const AbortWord& abort,
                           const ProcessIdentity& publisher = {}) const;
  absl::Status WaitAtLeast(uint32_t v, absl::Duration timeout, const WaitGuards& guards) const;
  // Wakes waiters without changing the version (so they see an abort at once).
  void WakeAll() const { FutexWakeAll(&version_); }
  const std::atomic<uint32_t>* word() const { return &version_; }

 private:
  std::atomic<uint32_t> version_{0};
  uint8_t pad_[60];
};
static_assert(sizeof(VersionGate) == 64 && std::is_standard_layout_v<VersionGate>);

}  // namespace slidedp::shm
