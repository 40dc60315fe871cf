// A tiny fork-join loop for the checkpoint code: runs fn(i) for i in [0, n) on up to `threads`
// threads (the caller's included). Results must not depend on which thread ran which index.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace slidedp::checkpoint {

inline int ResolveThreads(int threads) {
  if (threads > 0) return threads;
  return static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 16));
}

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

}  // namespace slidedp::checkpoint
