// WaitEvent's template body (included by nccl_communicator.h).
#pragma once

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace slidedp {

template <typename StopFn>
absl::Status WaitEvent(cudaEvent_t event, absl::Duration timeout, StopFn should_stop) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  for (int spin = 0;; ++spin) {
    cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return absl::InternalError(absl::StrCat("CUDA error while waiting for an event: ", cudaGetErrorString(e)));
    }
    if ((spin & 63) == 0) {
      absl::Status s = should_stop();
      if (!s.ok()) return s;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("GPU work not done after ", absl::FormatDuration(timeout)));
      }
    }
    // Short copies finish within microseconds; longer waits should not burn a core.
    if (spin < 200) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(100));
    }
  }
}

}  // namespace slidedp
