// CudaActivationStore: ActivationStore over pinned host memory and its own copy stream.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "worker/pipeline/activation_store.h"
#include "worker/pipeline/auto_policy.h"

namespace slidedp {

// Offloads every checkpoint of the first round(ratio * num_hidden_layers) decoder units (1..k).
absl::StatusOr<std::unique_ptr<ActivationStore>> MakeCudaActivationStore(const ModelLayout& layout,
                                                                         ComputeBackend* backend, double ratio,
                                                                         int device);
// Offloads each unit's share of its checkpoints as given (a per-layer layout, runtime.policy).
absl::StatusOr<std::unique_ptr<ActivationStore>> MakeCudaActivationStore(ComputeBackend* backend,
                                                                         std::vector<double> offloaded, int device);

// AutoPolicy's probe: the rates a store's copies reach between pinned host memory and `device`
// (the best of a few copies of `bytes` each way, on a stream of their own).
absl::StatusOr<CopyRates> MeasurePinnedCopyRates(int device, int64_t bytes = 256ll << 20);

}  // namespace slidedp
