// A small fixed pool of named threads that runs the CPU reference backend's parallel-for loops.
//
// Work over [0, n) is split into contiguous ranges and every index is processed by exactly one
// thread running the same code, so results never depend on the thread count or on scheduling.
// The backend relies on this for bitwise-identical gradients across activation policies.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace slidedp {

class CpuWorkerPool {
 public:
  // num_threads counts the calling thread too; 1 (or less) runs everything inline.
  explicit CpuWorkerPool(int num_threads);
  ~CpuWorkerPool();
  CpuWorkerPool(const CpuWorkerPool&) = delete;
  CpuWorkerPool& operator=(const CpuWorkerPool&) = delete;

  int num_threads() const { return static_cast<int>(threads_.size()) + 1; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n), each at least min_range long (except
  // possibly the last), and returns when all are done. Calls made from inside a pool task run
  // inline (no nested parallelism, so no deadlock).
  void ParallelFor(int64_t n, int64_t min_range, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void WorkerLoop(int index);

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// ParallelFor on pool, or a plain inline call when pool is null.
inline void ParallelRanges(CpuWorkerPool* pool, int64_t n, int64_t min_range,
                           const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (pool == nullptr) {
    fn(0, n);
  } else {
    pool->ParallelFor(n, min_range, fn);
  }
}

}  // namespace slidedp
