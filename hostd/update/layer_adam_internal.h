// What LayerAdam's two files share (layer_adam.cc: the work; layer_adam_workers.cc: the workers):
// the per-chunk completion record, RunOnEachWorker's call record, the copy-priority configuration and
// a worker's pacer. Internal to hostd/update.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "hostd/update/layer_adam.h"
#include "shm/futex.h"

namespace slidedp::update {

struct LayerAdam::ChunkState {
  std::atomic<int> remaining{0};
  DoneFn done;
  absl::Mutex mu;
  absl::Status status ABSL_GUARDED_BY(mu);
};

// One RunOnEachWorker call, shared by the caller and the workers (shared_ptr: the last worker may
// still be unlocking `mu` when the caller, woken by it, returns).
struct LayerAdam::EachWorkerCall {
  EachWorkerCall(absl::FunctionRef<void(int, int, int)> f, int n) : fn(f), num_workers(n) {}
  absl::FunctionRef<void(int, int, int)> fn;  // callable until `finished` reaches num_workers
  const int num_workers;
  absl::Mutex mu;
  int arrived ABSL_GUARDED_BY(mu) = 0;
  int finished ABSL_GUARDED_BY(mu) = 0;
};

// What SetCopyPriority installed: immutable, shared by the workers' pacers.
struct LayerAdam::CopyPriority {
  std::vector<const std::atomic<uint32_t>*> words;
  std::vector<int> yielders;  // per NodeQueue: how many of its workers pause (the highest slots)
  absl::Duration max_pause;
};

// A worker's side of copy priority: whether it is one of its node's yielding workers under the
// configuration in force for its current piece, and the pause between blocks.
class LayerAdam::BlockPacer {
 public:
  BlockPacer(LayerAdam& engine, int queue, int slot, int queue_workers)
      : engine_(engine), queue_(queue), slot_(slot), queue_workers_(queue_workers) {}

  // Before each piece: the configuration it runs under (the words stay mapped until the caller
  // clears it, which it does only with none of its chunks in flight).
  void StartPiece() {
    config_ = engine_.copy_priority();
    active_ = config_ != nullptr && slot_ >= queue_workers_ - config_->yielders[queue_];
  }
  bool active() const { return active_; }

  // Before each block of the piece: pauses while an urgent copy is in flight (bounded), unless
  // the previous block was preceded by a pause.
  void BeforeBlock() {
    if (!active_) return;
    if (just_paused_) {
      just_paused_ = false;
      return;
    }
    const std::atomic<uint32_t>* raised = FirstRaised();
    if (raised == nullptr) return;
    engine_.workers_paused_.fetch_add(1, std::memory_order_relaxed);
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + config_->max_pause;
    while (raised != nullptr) {
      const absl::Time now = absl::Now();
      if (now >= deadline) break;
      // The word's writer wakes it when it drops to zero; the slice bounds a missed wake-up.
      if (const uint32_t v = raised->load(std::memory_order_acquire); v != 0) {
        shm::FutexWait(raised, v, std::min(kYieldSlice, deadline - now));
      }
      raised = FirstRaised();
    }
    engine_.paused_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
    engine_.workers_paused_.fetch_sub(1, std::memory_order_relaxed);
    just_paused_ = true;
  }

 private:
  const std::atomic<uint32_t>* FirstRaised() const {
    for (const std::atomic<uint32_t>* w : config_->words) {
      if (w->load(std::memory_order_relaxed) != 0) return w;
    }
    return nullptr;
  }

  LayerAdam& engine_;
  const int queue_, slot_, queue_workers_;
  std::shared_ptr<const CopyPriority> config_;
  bool active_ = false;
  bool just_paused_ = false;
};

}  // namespace slidedp::update
