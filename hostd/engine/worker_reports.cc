// WorkerReports: the job's report handlers; see worker_reports.h.
#include "hostd/engine/worker_reports.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace slidedp::hostd {

WorkerReports::WorkerReports(JobContext& ctx, shm::JobState& job_state)
    : ctx_(ctx), job_state_(job_state), world_(static_cast<int>(ctx.workers().size())), finished_(world_, false) {}

bool WorkerReports::CurrentJob(const std::string& job_id, int attempt) const {
  return job_id == ctx_.job_id() && attempt == ctx_.attempt();
}

absl::Status WorkerReports::OnCommId(int rank, const v1::CommId& id) {
  if (rank != 0 || !CurrentJob(id.job_id(), id.attempt())) return absl::OkStatus();
  for (int k = 1; k < world_; ++k) {
    v1::HostCommand c;
    *c.mutable_comm_id() = id;
    if (!ctx_.workers()[k]->commands().Push(c)) {
      job_state_.RaiseAbort(shm::AbortReason::kPeerDied);
      return absl::UnavailableError(
          absl::StrCat("worker ", ctx_.workers()[k]->id(), " (rank ", k, ") disconnected before its communicator id"));
    }
  }
  return absl::OkStatus();
}

void WorkerReports::OnStepDone(const v1::StepDone& done) {
  if (CurrentJob(done.job_id(), done.attempt())) steps_[done.step()].push_back(done);
}

absl::Status WorkerReports::OnJobFinished(int rank, const v1::JobFinished& finished) {
  if (!CurrentJob(finished.job_id(), finished.attempt())) return absl::OkStatus();
  finished_[rank] = true;
  if (finished.code() == 0) return absl::OkStatus();
  job_state_.RaiseAbort(shm::AbortReason::kWorkerFailed);
  return absl::Status(static_cast<absl::StatusCode>(finished.code()),
                      absl::StrCat("worker ", ctx_.workers()[rank]->id(), " (rank ", rank, "): ", finished.message()));
}

absl::Status WorkerReports::Poll() {
  absl::MutexLock l(&mu_);
  for (int r = 0; r < world_; ++r) {
    const auto& w = ctx_.workers()[r];
    while (auto rep = w->reports().Pop(absl::ZeroDuration())) {
      if (rep->has_comm_id()) {
        if (absl::Status s = OnCommId(r, rep->comm_id()); !s.ok()) return s;
      } else if (rep->has_step_done()) {
        OnStepDone(rep->step_done());
      } else if (rep->has_job_finished()) {
        if (absl::Status s = OnJobFinished(r, rep->job_finished()); !s.ok()) return s;
      }
    }
    if (w->gone() && !finished_[r]) {
      job_state_.RaiseAbort(shm::AbortReason::kPeerDied);
      return absl::UnavailableError(
          absl::StrCat("worker ", w->id(), " (rank ", r, ", pid ", w->hello().pid(), ") disconnected during the job"));
    }
  }
  return absl::OkStatus();
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
          out = std::move(it->second);
          steps_.erase(it);
        }
        return out;
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
