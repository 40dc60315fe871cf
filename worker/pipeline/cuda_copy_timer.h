// CudaCopyTimer: GPU-side busy time of a copy stream, without ever waiting for it. Each timed
// span is a pair of events recorded around the copies (Begin/End); busy_s() adds the spans that
// have completed since the last call and keeps the rest for later.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "worker/kernels/cuda_check.h"

namespace slidedp {

class CudaCopyTimer {
 public:
  CudaCopyTimer() = default;
  CudaCopyTimer(const CudaCopyTimer&) = delete;
  CudaCopyTimer& operator=(const CudaCopyTimer&) = delete;
  ~CudaCopyTimer() {
    for (auto& [a, b] : spans_) {
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
    if (open_) cudaEventDestroy(open_);
  }

  // Records the start of a span on `stream` (before its copies are queued).
  absl::Status Begin(cudaStream_t stream) {
    if (!open_) SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&open_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(open_, stream));
    return absl::OkStatus();
  }
  // Records its end (after the copies are queued).
  absl::Status End(cudaStream_t stream) {
    cudaEvent_t stop;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    spans_.emplace_back(open_, stop);
    open_ = nullptr;
    return absl::OkStatus();
  }
  // Seconds of every completed span so far (cumulative).
  double busy_s() const {
    std::vector<std::pair<cudaEvent_t, cudaEvent_t>> pending;
    for (auto& [a, b] : spans_) {
      if (cudaEventQuery(b) == cudaSuccess) {
        float ms = 0;
        cudaEventElapsedTime(&ms, a, b);
        total_s_ += ms / 1000.0;
        cudaEventDestroy(a);
        cudaEventDestroy(b);
      } else {
        pending.emplace_back(a, b);
      }
    }
    spans_ = std::move(pending);
    return total_s_;
  }

 private:
  cudaEvent_t open_ = nullptr;
  mutable std::vector<std::pair<cudaEvent_t, cudaEvent_t>> spans_;
  mutable double total_s_ = 0;
};

}  // namespace slidedp
