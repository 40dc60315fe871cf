// CpuWorkerPool: a fixed set of named threads consuming a FIFO of range tasks.
#include "worker/compute/cpu/cpu_worker_pool.h"

#include <pthread.h>

#include <algorithm>
#include <string>

namespace slidedp {
namespace {

thread_local bool tls_in_pool_task = false;

}  // namespace

CpuWorkerPool::CpuWorkerPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) {
    threads_.emplace_back([this, i] { WorkerLoop(i); });
    std::string name = "cpu-compute-" + std::to_string(i);
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

CpuWorkerPool::~CpuWorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void CpuWorkerPool::WorkerLoop(int index) {
  tls_in_pool_task = true;
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CpuWorkerPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stopping_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void CpuWorkerPool::ParallelFor(int64_t n, int64_t min_range, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  min_range = std::max<int64_t>(min_range, 1);
  const int64_t max_parts = (n + min_range - 1) / min_range;
  const int64_t parts = std::min<int64_t>(num_threads(), max_parts);
  if (parts <= 1 || tls_in_pool_task) {
    fn(0, n);
    return;
  }
  // Ranges of near-equal length; part p covers [p*n/parts, (p+1)*n/parts).
  struct Join {
    absl::Mutex mu;
    int64_t remaining ABSL_GUARDED_BY(mu) = 0;
  } join;
  {
    absl::MutexLock lock(&join.mu);
    join.remaining = parts - 1;
  }
  {
    absl::MutexLock lock(&mu_);
    for (int64_t p = 1; p < parts; ++p) {
      const int64_t begin = p * n / parts, end = (p + 1) * n / parts;
      queue_.push_back([&fn, &join, begin, end] {
        fn(begin, end);
        absl::MutexLock l(&join.mu);
        --join.remaining;
      });
    }
  }
  tls_in_pool_task = true;
  fn(0, n / parts);
  tls_in_pool_task = false;
  absl::MutexLock lock(&join.mu);
  join.mu.Await(absl::Condition(
      +[](Join* j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu) { return j->remaining == 0; }, &join));
}

}  // namespace slidedp
