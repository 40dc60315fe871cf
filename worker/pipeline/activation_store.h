// ActivationStore: where a decoder layer's saved inputs (one per micro-batch; the pipeline
// keeps them from forward to backward) wait between the two passes. Without a store they stay in
// device memory; the CUDA store (runtime.offload_ratio > 0) moves the saved inputs of the first
// round(ratio x layers) layers to pinned host memory after their forward and brings each back one
// layer ahead of its backward, trading PCIe time for GPU memory at large batches. The first
// layers are chosen because their backward comes last, so their copies have the most time.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/model/qwen3_config.h"
#include "worker/compute/backend.h"

namespace slidedp {

class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  virtual bool offloads(int unit) const = 0;
  // The compute queued so far is the last reader of `inputs` until backward: copy them to host
  // memory and free them on the device (the store takes the buffers; `inputs` is left empty).
  virtual absl::Status Offload(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs) = 0;
  // Starts copying the unit's saved inputs back (a no-op if already started).
  virtual absl::Status Prefetch(int unit) = 0;
  // Hands the saved inputs back as device buffers usable by the compute stream from now on.
  virtual absl::Status Restore(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs) = 0;
  // Sets the host memory of every offloaded unit up front for inputs of these sizes (one per
  // micro-batch), so the first step that offloads does not pin memory as it goes (AutoPolicy calls
  // it between steps). Larger inputs later still get larger blocks.
  virtual absl::Status Reserve(const std::vector<int64_t>& input_bytes) { return absl::OkStatus(); }
  // Pinned host memory held, and seconds the offload copies took (cumulative).
  virtual int64_t host_bytes() const = 0;
  virtual double copy_s() const = 0;
};

}  // namespace slidedp

namespace slidedp {

// CPU backend: "device" buffers are host memory already, so offloading gains nothing; this store
// still moves the saved inputs out (copies them into its own buffers and frees the originals) and
// back through the backend, so CI exercises the step runner's offload/restore order with the
// same ratio semantics as the CUDA store.
std::unique_ptr<ActivationStore> MakeHostActivationStore(const ModelLayout& layout, ComputeBackend* backend,
                                                         double ratio);
// The units whose saved inputs a store offloads: the first round(ratio x layers) decoder layers
// (runtime.offload_ratio), indexed by unit.
std::vector<bool> OffloadedUnits(const ModelLayout& layout, double ratio);
// A store offloading exactly the units marked (a per-layer layout, runtime.policy).
std::unique_ptr<ActivationStore> MakeHostActivationStore(ComputeBackend* backend, std::vector<bool> offloaded);

}  // namespace slidedp
