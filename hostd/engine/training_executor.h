// TrainingExecutor: runs one training job on hostd's side. It owns the job's authoritative
// state for the job's lifetime: admission, the shared-memory JobState and gradient rings,
// weight loading, assignments to workers, gradient aggregation (in rank order, so sums are
// deterministic), exact global-norm clipping, LayerAdam updates and version gates, metrics and
// checkpoints.
#pragma once

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "hostd/core/host_core.h"
#include "hostd/update/layer_adam.h"

namespace slidedp::hostd {

struct TrainingExecutorOptions {
  std::string node_name = "local";
  int update_threads = 0;  // 0: from the topology
  update::WorkerPinning pinning = update::WorkerPinning::kCore;
};

class TrainingExecutor : public JobExecutor {
 public:
  explicit TrainingExecutor(TrainingExecutorOptions options);
  ~TrainingExecutor() override;
  absl::Status Validate(const JobSpec& spec) override;
  absl::Status Run(JobContext& ctx) override;

 private:
  absl::StatusOr<update::LayerAdam*> Adam();
  TrainingExecutorOptions options_;
  absl::Mutex mu_;
  std::unique_ptr<update::LayerAdam> adam_;  // warm across jobs
};

}  // namespace slidedp::hostd
