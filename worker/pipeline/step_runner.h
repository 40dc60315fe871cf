// StepRunner: one SlideDP training step on one worker (rank r of R), as in docs/design.md
// "One training step on one worker": forward through the units in order, each unit's parameters
// acquired behind its version gate and applied to every micro-batch before the next unit; the
// head computes loss and its input gradient in the same pass; backward in reverse order,
// accumulating each unit's FP32 weight gradient over the micro-batches and posting it to the
// gradient ring in chunks. The layer inputs are the checkpoints; what else is kept per layer is
// the activation policy's choice.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model/qwen3_config.h"
#include "hostd/state/grad_ring.h"
#include "worker/compute/backend.h"
#include "worker/pipeline/unit_streamer.h"

namespace slidedp {

struct StepTimes {
  double total_s = 0;
  double forward_s = 0;
  double backward_s = 0;
  double ring_wait_s = 0;  // blocked on a free ring slot (hostd behind)
};

struct StepResult {
  double loss_sum = 0;        // this rank's sum of loss_scale * CE over its tokens
  int64_t local_tokens = 0;
  StepTimes times;
};

struct StepRunnerOptions {
  ActPolicy policy = ActPolicy::kRecomputeLayer;
  absl::Duration ring_timeout = absl::Minutes(10);
  // Fault injection for tests: a random delay in [0, max] before every gate wait and every
  // gradient post (env SLIDEDP_INJECT_DELAY_MS sets it in slidedp-worker). Zero in production.
  absl::Duration inject_max_delay = absl::ZeroDuration();
};

class StepRunner {
 public:
  StepRunner(const ModelLayout& layout, ComputeBackend* backend, UnitStreamer* streamer, state::GradRing* ring,
             StepRunnerOptions options);

  // Runs step `step` (0-based) over this rank's micro-batches. loss_scale = 1 / trained tokens
  // of the whole global batch (all ranks), so the sum of every rank's loss_sum is the mean loss.
  absl::StatusOr<StepResult> Run(int64_t step, const std::vector<MicroBatch>& micro_batches, float loss_scale);

 private:
  absl::Status PostGradient(int unit, const float* grad_device, int64_t step, double* ring_wait_s);
  absl::StatusOr<std::unique_ptr<DeviceBuffer>> ZeroedGrad(int unit);
  absl::StatusOr<const bf16_t*> Acquire(int unit, uint32_t min_version);
  void InjectDelay();

  const ModelLayout& layout_;
  ComputeBackend* backend_;
  UnitStreamer* streamer_;
  state::GradRing* ring_;
  StepRunnerOptions options_;
  uint64_t rng_state_ = 0x9e3779b97f4a7c15ull;
};

}  // namespace slidedp
