// StepReports: the WorkerReport messages a job sends hostd (StepLoss, StepDone, EvalDone,
// PolicyChosen, CommId, JobFinished), made in one place. StepDone reports each step's share of the
// pipeline's cumulative counters: the builder keeps the last step's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "slidedp/v1/slidedp.pb.h"
#include "worker/pipeline/auto_policy.h"
#include "worker/pipeline/job_pipeline.h"
#include "worker/pipeline/step_runner.h"

namespace slidedp::worker {

class StepReports {
 public:
  StepReports(std::string job_id, int32_t attempt) : job_id_(std::move(job_id)), attempt_(attempt) {}

  // The step's loss as soon as it is known (StepRunnerOptions::on_loss).
  v1::WorkerReport Loss(int64_t step, double loss_sum) const;
  // The step done: `result` as StepRunner::Run gave it, `now` the pipeline's counters after it,
  // the device's peaks (the backend's and the pipeline's bytes together).
  v1::WorkerReport Done(int64_t step, const StepResult& result, int64_t trained_tokens, const PipelineCounters& now,
                        int64_t gpu_peak_bytes, int64_t gpu_used_peak_bytes);
  // The validation losses after step `step`, one per micro-batch of this rank, and the pass's time.
  v1::WorkerReport Eval(int64_t step, const std::vector<double>& loss_sums, double eval_s) const;
  // AutoPolicy's validated layout (rank 0).
  v1::WorkerReport PolicyChosen(const AutoPolicySession& autopolicy) const;
  // Rank 0's new NCCL unique id, for hostd to relay to the other ranks.
  v1::WorkerReport CommId(const std::string& membership_key, const std::string& id) const;
  // The job's end on this worker.
  static v1::WorkerReport JobFinished(const std::string& job_id, int32_t attempt, const absl::Status& status);

 private:
  std::string job_id_;
  int32_t attempt_;
  PipelineCounters last_;  // after the previous step
};

}  // namespace slidedp::worker
