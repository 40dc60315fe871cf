// CUDA implementation of ComputeBackend (worker/compute/backend.h): BF16 activations and
// parameters, FP32 accumulation, cuBLASLt GEMMs and the kernels in worker/kernels/.
//
// Temporaries and saved activations come from the device's stream-ordered memory pool
// (cudaMallocAsync on the compute stream, release threshold raised so memory stays cached), so
// ops never synchronize. Options below exist for tests and benchmarks.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"

namespace slidedp {

struct CudaBackendOptions {
  // Upper bound on the BF16 logits chunk [tokens_per_chunk, vocab] the fused head keeps at once.
  int64_t head_logits_budget_bytes = 1ll << 30;
};

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeCudaBackendWithOptions(const Qwen3Config& config, int device,
                                                                          const CudaBackendOptions& options);

}  // namespace slidedp
