// WorkerReports: what a job's workers tell hostd while it runs, one handler per report kind.
//
// Poll() drains every rank's report channel without blocking:
// - comm_id (rank 0 made its NCCL communicator's unique id): forwarded unchanged to ranks
//   1..R-1, which wait for it before ncclCommInitRank; ids of other jobs or attempts are stale;
// - step_done: kept per step for the step's metrics (TakeStep);
// - job_finished: the rank is done; a non-zero code fails the job with the worker's status;
// and a rank whose session is gone before it finished fails the job with UNAVAILABLE. Every
// failure raises the job's abort word first, so no other party waits out a timeout.
// Reports of earlier jobs or attempts are dropped. Poll() may be called from several threads.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "hostd/core/host_core.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

class WorkerReports {
 public:
  WorkerReports(JobContext& ctx, shm::JobState& job_state);

  absl::Status Poll();
  // Polls until every rank reported step `t` (0-based) or `timeout` passes; then returns what came.
  absl::StatusOr<std::vector<v1::StepDone>> WaitForStep(int64_t t, absl::Duration timeout);
  // Polls until every rank reported the end of the job or `timeout` passes.
  absl::Status WaitForEnd(absl::Duration timeout);
  bool all_finished() const;
  // Cancel between steps: raises the abort word and tells every worker.
  void StopWorkers();

 private:
  absl::Status OnCommId(int rank, const v1::CommId& id);
  void OnStepDone(const v1::StepDone& done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status OnJobFinished(int rank, const v1::JobFinished& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CurrentJob(const std::string& job_id, int attempt) const;

  JobContext& ctx_;
  shm::JobState& job_state_;
  const int world_;
  mutable absl::Mutex mu_;
  std::map<int64_t, std::vector<v1::StepDone>> steps_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> finished_ ABSL_GUARDED_BY(mu_);
};

}  // namespace slidedp::hostd
