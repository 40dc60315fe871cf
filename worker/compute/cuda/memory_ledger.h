// A ledger of the CUDA backend's pool buffers by the line that allocated them, kept only when the
// worker runs with SLIDEDP_GPU_MEMORY_LEDGER=1: which buffers were live when the backend's buffers
// held the most at once. It answers "where does a long sequence's GPU memory go" on the GPU
// machine, where the pool's high-water alone (gpu_used_peak_bytes) says only how much.
// Internal to worker/compute/cuda; plain C++ (tested without a GPU).
#pragma once

#include <cstdint>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace slidedp::cuda_backend_internal {

class MemoryLedger {
 public:
  // The process's ledger when SLIDEDP_GPU_MEMORY_LEDGER is 1 (ProcessDebugSwitches), else nullptr
  // (no bookkeeping).
  static MemoryLedger* Get();

  void Add(const void* p, int64_t bytes, const std::source_location& site);
  void Remove(const void* p);  // unknown pointers are ignored

  int64_t live_bytes() const;
  int64_t peak_bytes() const;
  // The peak and what made it, largest site first: "28.50 GiB live at the peak: 8.00 GiB
  // cuda_layer_math.cc:512 (1 buffer); ...". The peak restarts from what is live now.
  std::string TakePeakReport();

 private:
  struct Buffer {
    int64_t bytes;
    std::string site;
  };
  // at_peak_ := what is live now, by site.
  void RecordPeak() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<const void*, Buffer> live_ ABSL_GUARDED_BY(mu_);
  int64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Site -> (bytes, buffers) live at the peak.
  std::vector<std::pair<std::string, std::pair<int64_t, int>>> at_peak_ ABSL_GUARDED_BY(mu_);
};

// "file.cc:123" of a source location (the file's base name).
std::string SiteName(const std::source_location& site);

}  // namespace slidedp::cuda_backend_internal
