// ActivationStore: where a decoder layer's checkpoints wait between the two passes. A layer has
// one checkpoint per micro-batch: its input, and what its forward kept beyond it (its
// SavedActivations, under a policy that keeps more than the input). Without a store they stay in
// device memory. A store moves a share of each unit's checkpoints to host memory after the
// forward (the first OffloadedCheckpoints(ratio, micro-batches) of them, input and kept block
// alike) and brings them back one layer ahead of the backward, trading PCIe time for GPU memory:
// runtime.offload_ratio (every checkpoint of the first round(ratio x layers) layers; the first
// layers because their backward comes last, so their copies have the most time), or a per-layer
// layout's `offload: r` (runtime.policy).
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/model/model_config.h"
#include "worker/compute/backend.h"

namespace slidedp {

// The type a decoder layer's input waits in between its forward and its backward
// (runtime.checkpoint_dtype, StepRunnerOptions::checkpoint_dtype): `wanted` where it is narrower
// than the backend's activations (BF16 on an FP32 stream), else the activations' own.
inline Dtype CheckpointDType(const ComputeBackend& backend, Dtype wanted) {
  return DtypeBytes(wanted) < DtypeBytes(backend.activation_dtype()) ? wanted : backend.activation_dtype();
}

// What one checkpoint takes: the layer input's bytes and the kept block's (0: none).
struct CheckpointBytes {
  int64_t input = 0;
  int64_t kept = 0;
};

class ActivationStore {
 public:
  virtual ~ActivationStore() = default;
  // The share of the unit's checkpoints that waits in host memory (0: none).
  virtual double ratio(int unit) const = 0;
  bool offloads(int unit) const { return ratio(unit) > 0; }
  // The compute queued so far is the last reader of the unit's checkpoints until backward: copy
  // the store's share of them (inputs[i] and what saved[i] keeps, one per micro-batch; saved may
  // hold nulls) to host memory and free them on the device. The moved inputs are left null and
  // the moved saved activations detached, until Restore.
  virtual absl::Status Offload(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                               std::vector<std::unique_ptr<SavedActivations>>& saved) = 0;
  // Starts copying the unit's checkpoints back (a no-op if already started).
  virtual absl::Status Prefetch(int unit) = 0;
  // Puts the checkpoints back in place, usable by the compute stream from now on.
  virtual absl::Status Restore(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                               std::vector<std::unique_ptr<SavedActivations>>& saved) = 0;
  // Sets the unit's host memory up front for checkpoints of these sizes (one per micro-batch), so
  // the first step that offloads does not pin memory as it goes (AutoPolicy calls it between
  // steps). Larger checkpoints later still get larger blocks.
  virtual absl::Status Reserve(int unit, const std::vector<CheckpointBytes>& checkpoints) {
    return absl::OkStatus();
  }
  // Pinned host memory held, and seconds the offload copies took (cumulative).
  virtual int64_t host_bytes() const = 0;
  virtual double copy_s() const = 0;
};

// Reserves the host memory of every unit `store` offloads for these micro-batches, each decoder
// layer keeping what policies[layer] keeps (with room for the backend's alignment of the pieces)
// and its input in CheckpointDType(backend, checkpoint_dtype).
absl::Status ReserveCheckpoints(ActivationStore& store, const ComputeBackend& backend,
                                const std::vector<ActPolicy>& policies, const std::vector<MicroBatch>& micro_batches,
                                Dtype checkpoint_dtype);

// How many of a unit's `n` checkpoints an offload ratio moves: round(ratio x n), at least one when
// the ratio is above 0, at most n.
int OffloadedCheckpoints(double ratio, int n);

// The device buffers of a unit's moved checkpoints as one list a store copies out and back: per
// checkpoint its input, then its kept block when it has one.
struct MovedCheckpoints {
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<bool> has_kept;  // per checkpoint
};
// Takes the first `count` checkpoints out of `inputs` and `saved` (detaching the saved ones).
MovedCheckpoints TakeCheckpoints(int count, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                                 std::vector<std::unique_ptr<SavedActivations>>& saved);
// Puts them back: `buffers` in TakeCheckpoints' order, of the same sizes, holding the same bytes.
absl::Status PutCheckpoints(const std::vector<bool>& has_kept, std::vector<std::unique_ptr<DeviceBuffer>> buffers,
                            std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                            std::vector<std::unique_ptr<SavedActivations>>& saved);

}  // namespace slidedp

namespace slidedp {

// CPU backend: "device" buffers are host memory already, so offloading gains nothing; this store
// still moves the checkpoints out (copies them into its own buffers and frees the originals) and
// back through the backend, so CI exercises the step runner's offload/restore order with the
// same ratio semantics as the CUDA store.
std::unique_ptr<ActivationStore> MakeHostActivationStore(const ModelLayout& layout, ComputeBackend* backend,
                                                         double ratio);
// The share of each unit's checkpoints a store offloads for runtime.offload_ratio: all of the first
// round(ratio x layers) decoder layers', indexed by unit.
std::vector<double> OffloadedUnits(const ModelLayout& layout, double ratio);
// A store offloading each unit's share as given (a per-layer layout, runtime.policy).
std::unique_ptr<ActivationStore> MakeHostActivationStore(ComputeBackend* backend, std::vector<double> offloaded);

}  // namespace slidedp
