// The CPU reference backend of worker/compute/backend.h: plain FP32 C++ (BF16 parameters upcast,
// FP32 activations, FP32 gradients), run inline on the calling thread plus a small worker pool.
//
// It is the oracle for the CUDA kernels and the engine of CI's end-to-end tests. Results are
// deterministic and do not depend on the thread count; the three activation policies give
// bitwise-identical gradients.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"
#include "worker/compute/cpu/dense_reference_math.h"

namespace slidedp {

struct CpuBackendOptions {
  // Threads including the caller's; 0 picks min(4, hardware concurrency).
  int num_threads = 0;
  // Token and vocabulary chunk sizes of HeadForwardBackward.
  HeadChunking head_chunking;
  // "Device memory" capacity in bytes (0: unlimited). Allocations beyond it fail with
  // RESOURCE_EXHAUSTED and the numbers, as a GPU's would: slidedp-worker sets it from
  // SLIDEDP_CPU_DEVICE_MEMORY_BYTES so CI can drive the out-of-GPU-memory path end to end.
  int64_t device_memory_bytes = 0;
};

// MakeCpuBackend(config) (declared in backend.h) uses default options.
absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCpuBackend(const ModelConfig& config,
                                                               const CpuBackendOptions& options);

}  // namespace slidedp
