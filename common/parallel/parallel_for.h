// Fork-join loops for bulk host work (checkpoint I/O, weight conversion, gradient sums,
// benchmarks). Threads are made per call: for loops of milliseconds or more, not a hot inner
// loop (the CPU backend's kernels use their persistent CpuWorkerPool).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

namespace slidedp {

// threads > 0 as given, else the hardware's threads (1..16).
inline int ResolveThreads(int threads) {
  if (threads > 0) return threads;
  return static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 16));
}

// Runs fn(i) for i in [0, n) on up to `threads` threads (the caller's included), each taking the
// next index. Results must not depend on which thread ran which index.
template <typename Fn>
void ParallelFor(size_t n, int threads, Fn&& fn) {
  std::atomic<size_t> next{0};
  auto run = [&] {
    for (size_t i = next++; i < n; i = next++) fn(i);
  };
  const size_t workers = std::min<size_t>(static_cast<size_t>(ResolveThreads(threads)), n);
  std::vector<std::thread> pool;
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(run);
  run();
  for (std::thread& th : pool) th.join();
}

// Runs fn(begin, end) over [0, n) split into `threads` equal ranges, one new thread each (for
// measuring what exactly that many threads achieve).
template <typename Fn>
void ParallelForRanges(int threads, int64_t n, Fn fn) {
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const int64_t b = n * t / threads, e = n * (t + 1) / threads;
    pool.emplace_back([=] { fn(b, e); });
  }
  for (auto& th : pool) th.join();
}

}  // namespace slidedp
