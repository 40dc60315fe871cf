// WorkerReports: the job's report handlers; see worker_reports.h.
#include "hostd/engine/worker_reports.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/jobspec/job_spec.h"
#include "common/policy/layer_policy.h"

namespace slidedp::hostd {
namespace {
// A worker's failure message as it enters the job's error: one line, cut (the worker is a
// process hostd does not trust; its message reaches every watcher, the job record and the log).
constexpr size_t kMaxWorkerMessageBytes = 4096;
}  // namespace

std::string NonFiniteName(double x) {
  if (std::isnan(x)) return "NaN";
  return x > 0 ? "inf" : "-inf";
}

WorkerReports::WorkerReports(JobContext& ctx, shm::JobState& job_state, int64_t first_step, int64_t total_steps,
                             NonFinitePolicy policy)
    : ctx_(ctx),
      job_state_(job_state),
      world_(static_cast<int>(ctx.workers().size())),
      first_step_(first_step),
      total_steps_(total_steps),
      policy_(policy),
      next_step_(first_step),
      evals_from_(first_step),
      finished_(world_, false) {}

bool WorkerReports::CurrentJob(const std::string& job_id, int attempt) const {
  return job_id == ctx_.job_id() && attempt == ctx_.attempt();
}

std::string WorkerReports::WorkerName(int rank) const {
  if (rank < 0 || rank >= world_) return absl::StrCat("rank ", rank);
  return absl::StrCat("worker ", ctx_.workers()[rank]->id(), " (rank ", rank, ")");
}

absl::Status WorkerReports::Misbehaved(int rank, const std::string& what) {
  job_state_.RaiseAbort(shm::AbortReason::kInternal);
  return absl::InternalError(absl::StrCat(WorkerName(rank), " ", what));
}

absl::Status WorkerReports::OnCommId(int rank, const v1::CommId& id) {
  if (rank != 0 || !CurrentJob(id.job_id(), id.attempt())) return absl::OkStatus();
  for (int k = 1; k < world_; ++k) {
    v1::HostCommand c;
    *c.mutable_comm_id() = id;
    if (!ctx_.workers()[k]->commands().Push(c)) {
      job_state_.RaiseAbort(shm::AbortReason::kPeerDied);
      return absl::UnavailableError(absl::StrCat(WorkerName(k), " disconnected before its communicator id"));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkerReports::OnStepLoss(int rank, int64_t step, double loss_sum, const char* report) {
  if (step < first_step_ || step >= total_steps_ || step > next_step_ + kReportWindowSteps) {
    return Misbehaved(rank,
                      absl::StrCat("reported ", report, " for step ", step, " (0-based), outside the steps [",
                                   std::max(first_step_, next_step_), ", ",
                                   std::min(total_steps_, next_step_ + kReportWindowSteps + 1), ") it may report now"));
  }
  if (step < next_step_) return absl::OkStatus();  // late: the step's metrics are taken already
  auto [it, inserted] = losses_[step].emplace(rank, loss_sum);
  if (!inserted && it->second != loss_sum && !(std::isnan(it->second) && std::isnan(loss_sum))) {
    return Misbehaved(rank,
                      absl::StrCat("reported two losses for step ", step + 1, ": ", it->second, " and ", loss_sum));
  }
  if (!std::isfinite(loss_sum) && policy_ == NonFinitePolicy::kFail) {
    job_state_.RaiseAbort(shm::AbortReason::kInternal);
    return absl::DataLossError(absl::StrCat("step ", step + 1, ": loss is ", NonFiniteName(loss_sum), " on ",
                                            WorkerName(rank), " (train.skip_nonfinite: true skips such steps)"));
  }
  return absl::OkStatus();
}

absl::Status WorkerReports::OnStepDone(int rank, const v1::StepDone& done) {
  if (!CurrentJob(done.job_id(), done.attempt())) return absl::OkStatus();
  if (absl::Status s = OnStepLoss(rank, done.step(), done.loss_sum(), "StepDone"); !s.ok()) return s;
  if (done.step() < next_step_) return absl::OkStatus();
  if (!steps_[done.step()].emplace(rank, done).second) {
    return Misbehaved(rank, absl::StrCat("reported step ", done.step() + 1, " done twice"));
  }
  return absl::OkStatus();
}

absl::Status WorkerReports::OnEvalDone(int rank, const v1::EvalDone& done) {
  if (!CurrentJob(done.job_id(), done.attempt())) return absl::OkStatus();
  const int64_t step = done.step();
  if (step < evals_from_ || step >= total_steps_ || step > next_step_ + kReportWindowSteps) {
    return Misbehaved(rank, absl::StrCat("reported a validation pass after step ", step + 1,
                                         ", outside the steps it may report one for now"));
  }
  if (done.loss_sums_size() > (int64_t{1} << 24)) {
    return Misbehaved(rank, absl::StrCat("reported ", done.loss_sums_size(), " validation micro-batches"));
  }
  if (!evals_[step].emplace(rank, done).second) {
    return Misbehaved(rank, absl::StrCat("reported the validation pass after step ", step + 1, " twice"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::EvalDone>> WorkerReports::WaitForEval(int64_t t, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (absl::Status s = Poll(); !s.ok()) return s;
    {
      absl::MutexLock l(&mu_);
      auto it = evals_.find(t);
      const int have = it == evals_.end() ? 0 : static_cast<int>(it->second.size());
      if (have >= world_) {
        std::vector<v1::EvalDone> out;
        for (auto& [rank, done] : it->second) out.push_back(std::move(done));  // rank order
        evals_.erase(evals_.begin(), evals_.upper_bound(t));
        evals_from_ = t + 1;
        return out;
      }
      if (absl::Now() >= deadline) {
        std::vector<std::string> missing;
        for (int r = 0; r < world_; ++r) {
          if (it == evals_.end() || !it->second.count(r)) missing.push_back(WorkerName(r));
        }
        job_state_.RaiseAbort(shm::AbortReason::kInternal);
        return absl::DeadlineExceededError(absl::StrCat("the validation pass after step ", t + 1, " did not end in ",
                                                        absl::FormatDuration(timeout), " on ",
                                                        absl::StrJoin(missing, ", "), " (runtime.step_timeout_ms)"));
      }
    }
    if (job_state_.abort().raised()) return absl::AbortedError("job aborted during its validation pass");
    absl::SleepFor(absl::Milliseconds(1));
  }
}

absl::Status WorkerReports::OnJobFinished(int rank, const v1::JobFinished& finished) {
  if (!CurrentJob(finished.job_id(), finished.attempt())) return absl::OkStatus();
  finished_[rank] = true;
  if (finished.code() == 0) return absl::OkStatus();
  worker_failure_seen_.store(true, std::memory_order_release);
  job_state_.RaiseAbort(shm::AbortReason::kWorkerFailed);
  // Only the standard codes (1..16) map to a status; anything else is UNKNOWN with the number.
  const bool known = finished.code() > 0 && finished.code() <= static_cast<int>(absl::StatusCode::kUnauthenticated);
  const absl::StatusCode code = known ? static_cast<absl::StatusCode>(finished.code()) : absl::StatusCode::kUnknown;
  absl::Status failure(
      code, absl::StrCat(WorkerName(rank), ": ", known ? "" : absl::StrCat("(status code ", finished.code(), ") "),
                         BoundedLine(finished.message(), kMaxWorkerMessageBytes)));
  if (code == absl::StatusCode::kAborted) {  // stopped by another's abort: wait for the cause (Poll)
    if (!aborted_failure_) {
      aborted_failure_ = std::move(failure);
      aborted_since_ = absl::Now();
    }
    return absl::OkStatus();
  }
  return failure;
}

std::optional<v1::PolicyChosen> WorkerReports::TakePolicyChosen() {
  absl::MutexLock l(&mu_);
  std::optional<v1::PolicyChosen> out = std::move(policy_chosen_);
  policy_chosen_.reset();
  return out;
}

absl::Status WorkerReports::Poll() {
  absl::MutexLock l(&mu_);
  for (int r = 0; r < world_; ++r) {
    const auto& w = ctx_.workers()[r];
    while (auto rep = w->reports().Pop(absl::ZeroDuration())) {
      absl::Status s;
      if (rep->has_comm_id()) {
        s = OnCommId(r, rep->comm_id());
      } else if (rep->has_step_loss()) {
        const v1::StepLoss& loss = rep->step_loss();
        if (CurrentJob(loss.job_id(), loss.attempt())) s = OnStepLoss(r, loss.step(), loss.loss_sum(), "StepLoss");
      } else if (rep->has_step_done()) {
        s = OnStepDone(r, rep->step_done());
      } else if (rep->has_policy_chosen()) {
        const v1::PolicyChosen& pc = rep->policy_chosen();
        // Only rank 0 reports; a report over a policy file's size is dropped, not cached.
        if (r == 0 && CurrentJob(pc.job_id(), pc.attempt()) && pc.policy_yaml().size() <= kMaxPolicyFileBytes) {
          policy_chosen_ = pc;
        }
      } else if (rep->has_eval_done()) {
        s = OnEvalDone(r, rep->eval_done());
      } else if (rep->has_job_finished()) {
        s = OnJobFinished(r, rep->job_finished());
      }
      if (!s.ok()) return s;
    }
    if (w->gone() && !finished_[r]) {
      job_state_.RaiseAbort(shm::AbortReason::kPeerDied);
      return absl::UnavailableError(
          absl::StrCat(WorkerName(r), ", pid ", w->hello().pid(), ", disconnected during the job"));
    }
  }
  if (aborted_failure_) {
    const bool all_finished = std::all_of(finished_.begin(), finished_.end(), [](bool f) { return f; });
    if (all_finished || absl::Now() - aborted_since_ >= kRootCauseGrace) return *aborted_failure_;
  }
  // The cancel flag lives under HostCore's lock, which every gRPC handler takes: looked at ten
  // times a second, not on every Poll of the waits' millisecond loops.
  const absl::Time now = absl::Now();
  if (now >= next_cancel_check_) {
    next_cancel_check_ = now + absl::Milliseconds(100);
    if (ctx_.cancel_requested() && !ctx_.checkpoint_on_cancel()) {
      if (!cancel_seen_) cancel_seen_ = now;
      if (now - *cancel_seen_ >= cancel_grace_) {
        job_state_.RaiseAbort(shm::AbortReason::kCancelled);
        return absl::CancelledError(absl::StrCat("cancelled mid-step: the step in flight did not end within ",
                                                 absl::FormatDuration(cancel_grace_),
                                                 " of the cancel (a stalled worker?)"));
      }
    }
  }
  return absl::OkStatus();
}

void WorkerReports::SetCancelGrace(absl::Duration grace) {
  absl::MutexLock l(&mu_);
  cancel_grace_ = grace;
}

absl::StatusOr<std::vector<v1::StepDone>> WorkerReports::WaitForStep(int64_t t, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (absl::Status s = Poll(); !s.ok()) return s;
    {
      absl::MutexLock l(&mu_);
      auto it = steps_.find(t);
      if ((it != steps_.end() && static_cast<int>(it->second.size()) >= world_) || absl::Now() >= deadline) {
        std::vector<v1::StepDone> out;
        if (it != steps_.end()) {
          for (auto& [rank, done] : it->second) out.push_back(std::move(done));  // rank order
        }
        steps_.erase(steps_.begin(), steps_.upper_bound(t));
        losses_.erase(losses_.begin(), losses_.upper_bound(t));
        next_step_ = std::max(next_step_, t + 1);
        return out;
      }
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

absl::StatusOr<std::vector<double>> WorkerReports::WaitForLosses(int64_t t, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (absl::Status s = Poll(); !s.ok()) return s;
    {
      absl::MutexLock l(&mu_);
      auto it = losses_.find(t);
      if (it != losses_.end() && static_cast<int>(it->second.size()) >= world_) {
        std::vector<double> out;
        for (const auto& [rank, loss] : it->second) out.push_back(loss);
        return out;
      }
      if (absl::Now() >= deadline) {
        std::vector<std::string> missing;
        for (int r = 0; r < world_; ++r) {
          if (it == losses_.end() || !it->second.count(r)) missing.push_back(WorkerName(r));
        }
        job_state_.RaiseAbort(shm::AbortReason::kInternal);
        return absl::DeadlineExceededError(absl::StrCat("step ", t + 1, ": no loss from ", absl::StrJoin(missing, ", "),
                                                        " for ", absl::FormatDuration(timeout),
                                                        " (runtime.step_timeout_ms)"));
      }
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

absl::Status WorkerReports::WaitForEnd(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!all_finished() && absl::Now() < deadline) {
    if (absl::Status s = Poll(); !s.ok()) return s;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return absl::OkStatus();
}

bool WorkerReports::all_finished() const {
  absl::MutexLock l(&mu_);
  return std::count(finished_.begin(), finished_.end(), true) == world_;
}

void WorkerReports::StopWorkers() {
  job_state_.RaiseAbort(shm::AbortReason::kCancelled);
  for (auto& w : ctx_.workers()) {
    v1::HostCommand c;
    c.set_cancel_job_id(ctx_.job_id());
    w->commands().Push(c);
  }
}

}  // namespace slidedp::hostd
