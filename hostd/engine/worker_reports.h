// WorkerReports: what a job's workers tell hostd while it runs, one handler per report kind.
//
// Poll() drains every rank's report channel without blocking:
// - comm_id (rank 0 made its NCCL communicator's unique id): forwarded unchanged to ranks
//   1..R-1, which wait for it before ncclCommInitRank; ids of other jobs or attempts are stale;
// - step_loss (sent before the step's last gradients) and step_done: kept per step and rank, for
//   the finiteness check of the loss and the step's metrics (TakeStep);
// - eval_done: a rank's share of a validation pass (data.validation), kept for WaitForEval;
// - job_finished: the rank is done; a non-zero code fails the job with the worker's status;
// and a rank whose session is gone before it finished fails the job with UNAVAILABLE. Every
// failure raises the job's abort word first, so no other party waits out a timeout.
//
// Nothing a worker sends is trusted: a step outside the job's [first_step, total_steps), a step
// reported twice by one rank, a step far ahead of the one hostd is at (kReportWindowSteps), or
// a status code that is not one is INTERNAL naming the worker
// (its id and rank). A non-finite loss fails the job with DATA_LOSS naming the step and rank,
// unless the job skips such steps (train.skip_nonfinite: the executor decides, WaitForLosses).
// Reports of earlier jobs or attempts are dropped. Poll() may be called from several threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "hostd/core/host_core.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

// What a non-finite loss or gradient does to a job (train.skip_nonfinite).
enum class NonFinitePolicy {
  kFail,  // DATA_LOSS naming the step and where
  kSkip,  // the step changes nothing; the job goes on
};

class WorkerReports {
 public:
  static constexpr int64_t kReportWindowSteps = 8;

  // Steps of this attempt are [first_step, total_steps) (0-based).
  WorkerReports(JobContext& ctx, shm::JobState& job_state, int64_t first_step, int64_t total_steps,
                NonFinitePolicy policy);

  absl::Status Poll();
  // Polls until every rank reported step `t` (0-based) or `timeout` passes; then returns what came.
  absl::StatusOr<std::vector<v1::StepDone>> WaitForStep(int64_t t, absl::Duration timeout);
  // Polls until every rank reported its loss of step `t` (StepLoss, or StepDone), in rank order;
  // DEADLINE_EXCEEDED naming the ranks still missing after `timeout`.
  absl::StatusOr<std::vector<double>> WaitForLosses(int64_t t, absl::Duration timeout);
  // Polls until every rank reported its validation pass after step `t` (EvalDone), in rank order;
  // DEADLINE_EXCEEDED naming the ranks still missing after `timeout`.
  absl::StatusOr<std::vector<v1::EvalDone>> WaitForEval(int64_t t, absl::Duration timeout);
  // Polls until every rank reported the end of the job or `timeout` passes.
  absl::Status WaitForEnd(absl::Duration timeout);
  bool all_finished() const;
  // Cancel between steps: raises the abort word and tells every worker.
  void StopWorkers();
  // A cancel takes effect between steps; when the step in flight has not ended `grace` after the
  // cancel was requested (a stalled worker), Poll raises the abort word and returns CANCELLED:
  // the job stops mid-step. Not while hostd drains with a checkpoint at the cancel (that needs the
  // step's end). kMinCancelGrace until the executor sets it from the step times (twice the
  // last, at least kMinCancelGrace).
  void SetCancelGrace(absl::Duration grace);
  static constexpr absl::Duration kMinCancelGrace = absl::Seconds(30);
  // Rank 0's AutoPolicy report of the current attempt (runtime.policy auto), once, if it came.
  std::optional<v1::PolicyChosen> TakePolicyChosen();
  // "worker <id> (rank r)", how every message about a rank names it.
  std::string WorkerName(int rank) const;
  // A worker reported a failure (its JobFinished with an error was taken by some Poll).
  bool worker_failure_seen() const { return worker_failure_seen_.load(std::memory_order_acquire); }

 private:
  absl::Status OnCommId(int rank, const v1::CommId& id);
  absl::Status OnStepLoss(int rank, int64_t step, double loss_sum, const char* report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status OnStepDone(int rank, const v1::StepDone& done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status OnJobFinished(int rank, const v1::JobFinished& finished) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status OnEvalDone(int rank, const v1::EvalDone& done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CurrentJob(const std::string& job_id, int attempt) const;
  // INTERNAL naming the worker; raises the abort word.
  absl::Status Misbehaved(int rank, const std::string& what);

  JobContext& ctx_;
  shm::JobState& job_state_;
  const int world_;
  const int64_t first_step_, total_steps_;
  const NonFinitePolicy policy_;
  mutable absl::Mutex mu_;
  // The step WaitForStep takes next: a correct worker is at most one step ahead of it (its next
  // step needs gates this step's updates open), so reports further ahead than a small window are
  // refused, which also bounds what is kept.
  int64_t next_step_ ABSL_GUARDED_BY(mu_);
  // Per step, per rank: the report (StepDone) and the loss (StepLoss or StepDone).
  std::map<int64_t, std::map<int, v1::StepDone>> steps_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::PolicyChosen> policy_chosen_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::map<int, double>> losses_ ABSL_GUARDED_BY(mu_);
  // Validation passes per step and rank, until WaitForEval takes them (steps before evals_from_
  // are taken: a report of one is late or repeated).
  std::map<int64_t, std::map<int, v1::EvalDone>> evals_ ABSL_GUARDED_BY(mu_);
  int64_t evals_from_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> finished_ ABSL_GUARDED_BY(mu_);
  // A worker that stopped because another raised the job's abort reports ABORTED; the one that
  // raised it reports the cause, perhaps a moment later. The first ABORTED waits here up to
  // kRootCauseGrace (or until every worker has finished) for a cause to report instead.
  static constexpr absl::Duration kRootCauseGrace = absl::Seconds(2);
  std::optional<absl::Status> aborted_failure_ ABSL_GUARDED_BY(mu_);
  absl::Time aborted_since_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> worker_failure_seen_{false};
  absl::Duration cancel_grace_ ABSL_GUARDED_BY(mu_) = kMinCancelGrace;
  std::optional<absl::Time> cancel_seen_ ABSL_GUARDED_BY(mu_);
  absl::Time next_cancel_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// "loss is NaN on worker w0 (rank 1)" style text for a non-finite loss sum: "NaN", "inf", "-inf".
std::string NonFiniteName(double x);

}  // namespace slidedp::hostd
