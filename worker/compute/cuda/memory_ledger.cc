#include "worker/compute/cuda/memory_ledger.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "worker/debug/debug_switches.h"

namespace slidedp::cuda_backend_internal {

MemoryLedger* MemoryLedger::Get() {
  static MemoryLedger* const ledger = [] {
    const absl::StatusOr<DebugSwitches>& switches = ProcessDebugSwitches();  // malformed: no ledger
    return switches.ok() && switches->gpu_memory_ledger ? new MemoryLedger() : nullptr;
  }();
  return ledger;
}

std::string SiteName(const std::source_location& site) {
  const char* file = site.file_name();
  const char* slash = std::strrchr(file, '/');
  return absl::StrCat(slash != nullptr ? slash + 1 : file, ":", site.line());
}

void MemoryLedger::Add(const void* p, int64_t bytes, const std::source_location& site) {
  if (p == nullptr || bytes <= 0) return;
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = live_.try_emplace(p, Buffer{bytes, SiteName(site)});
  if (!inserted) {  // a pointer the pool handed out again before its free was seen: replace it
    live_bytes_ -= it->second.bytes;
    it->second = Buffer{bytes, SiteName(site)};
  }
  live_bytes_ += bytes;
  if (live_bytes_ <= peak_bytes_) return;
  peak_bytes_ = live_bytes_;
  RecordPeak();
}

void MemoryLedger::Remove(const void* p) {
  if (p == nullptr) return;
  absl::MutexLock lock(&mu_);
  auto it = live_.find(p);
  if (it == live_.end()) return;
  live_bytes_ -= it->second.bytes;
  live_.erase(it);
}

void MemoryLedger::RecordPeak() {
  absl::flat_hash_map<std::string, std::pair<int64_t, int>> sites;
  for (const auto& [ptr, buffer] : live_) {
    auto& use = sites[buffer.site];
    use.first += buffer.bytes;
    ++use.second;
  }
  at_peak_.assign(sites.begin(), sites.end());
}

int64_t MemoryLedger::live_bytes() const {
  absl::MutexLock lock(&mu_);
  return live_bytes_;
}

int64_t MemoryLedger::peak_bytes() const {
  absl::MutexLock lock(&mu_);
  return peak_bytes_;
}

std::string MemoryLedger::TakePeakReport() {
  absl::MutexLock lock(&mu_);
  std::sort(at_peak_.begin(), at_peak_.end(), [](const auto& a, const auto& b) {
    return a.second.first != b.second.first ? a.second.first > b.second.first : a.first < b.first;
  });
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  std::string out = absl::StrFormat("%.2f GiB live at the peak:", peak_bytes_ / kGiB);
  for (const auto& [site, use] : at_peak_) {
    absl::StrAppend(&out, absl::StrFormat(" %.2f GiB %s (%d buffer%s);", use.first / kGiB, site, use.second,
                                          use.second == 1 ? "" : "s"));
  }
  peak_bytes_ = live_bytes_;
  RecordPeak();
  return out;
}

}  // namespace slidedp::cuda_backend_internal
