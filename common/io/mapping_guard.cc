// The SIGBUS guard of read-only file mappings (mapping_guard.h).
//
// The registry is a fixed array of slots the signal handler reads without locks: a slot is claimed
// by compare-and-swap on `claimed`, then its range published by storing `end` before `begin`
// (release); the handler loads `begin` (acquire), then `end`. Only atomics and mmap(2), a plain
// system call, run inside the handler.
#include "common/io/mapping_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"

namespace slidedp {
namespace {

struct Slot {
  std::atomic<bool> claimed{false};
  std::atomic<uintptr_t> begin{0};  // 0: no range
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> faulted{false};
};

Slot g_slots[kMaxGuardedMappings];
uintptr_t g_page_bytes = 4096;
struct sigaction g_previous {};
std::once_flag g_install_once;
int g_install_errno = 0;

// Hands a fault that is not ours to whoever handled SIGBUS before: their handler, or the default
// action (set back, so that the faulting read runs again and ends the process as it would have).
void ForwardToPrevious(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN && g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  // A memory fault cannot be ignored (the read would fault forever): SIG_IGN ends it too.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, nullptr);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Slot& s : g_slots) {
    const uintptr_t begin = s.begin.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= s.end.load(std::memory_order_relaxed)) continue;
    // The page lies past the file's new end: put a private page of zeros in its place.
    void* page = reinterpret_cast<void*>(addr & ~(g_page_bytes - 1));
    if (mmap(page, g_page_bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
      s.faulted.store(true, std::memory_order_relaxed);
      return;
    }
    break;  // cannot replace the page: end as the default would
  }
  ForwardToPrevious(sig, info, context);
}

void Install() {
  const long page = sysconf(_SC_PAGESIZE);
  if (page > 0) g_page_bytes = static_cast<uintptr_t>(page);
  struct sigaction sa {};
  sa.sa_sigaction = OnSigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGBUS, &sa, &g_previous) != 0) g_install_errno = errno;
}

}  // namespace

absl::StatusOr<MappingGuard> MappingGuard::Register(const void* base, size_t bytes, std::string path) {
  std::call_once(g_install_once, Install);
  if (g_install_errno != 0) {
    return absl::InternalError(absl::StrCat("installing the SIGBUS handler that guards file mappings: errno ",
                                            g_install_errno));
  }
  for (int i = 0; i < kMaxGuardedMappings; ++i) {
    bool expected = false;
    if (!g_slots[i].claimed.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) continue;
    Slot& s = g_slots[i];
    s.faulted.store(false, std::memory_order_relaxed);
    s.end.store(reinterpret_cast<uintptr_t>(base) + bytes, std::memory_order_relaxed);
    s.begin.store(reinterpret_cast<uintptr_t>(base), std::memory_order_release);
    MappingGuard g;
    g.slot_ = i;
    g.path_ = std::move(path);
    return g;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat(path, ": ", kMaxGuardedMappings, " file mappings are open already (the most this process guards)"));
}

MappingGuard::MappingGuard(MappingGuard&& other) noexcept
    : slot_(std::exchange(other.slot_, -1)), path_(std::move(other.path_)) {}

MappingGuard& MappingGuard::operator=(MappingGuard&& other) noexcept {
  if (this != &other) {
    Release();
    slot_ = std::exchange(other.slot_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

MappingGuard::~MappingGuard() { Release(); }

void MappingGuard::Release() {
  if (slot_ < 0) return;
  Slot& s = g_slots[slot_];
  s.begin.store(0, std::memory_order_release);
  s.end.store(0, std::memory_order_relaxed);
  s.faulted.store(false, std::memory_order_relaxed);
  s.claimed.store(false, std::memory_order_release);
  slot_ = -1;
}

absl::Status MappingGuard::Intact() const {
  if (slot_ < 0 || !g_slots[slot_].faulted.load(std::memory_order_relaxed)) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      path_, ": the file shrank while it was being read (truncated or rewritten in place after it was checked); what "
             "was read from it is discarded"));
}

}  // namespace slidedp
