// TrainingExecutor: runs one training job on hostd's side. It owns the job's authoritative
// state for the job's lifetime: admission, the shared-memory JobState and gradient rings,
// weight loading, assignments to workers, gradient aggregation (in rank order, so sums are
// deterministic), exact global-norm clipping, LayerAdam updates and version gates, metrics and
// checkpoints.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "hostd/core/host_core.h"
#include "hostd/state/job_state.h"
#include "hostd/update/layer_adam.h"

namespace slidedp::hostd {

struct TrainingExecutorOptions {
  std::string node_name = "local";
  int update_threads = 0;  // 0: from the topology
  update::WorkerPinning pinning = update::WorkerPinning::kCore;
  // Keep the state segment of a job that succeeded (allocated, pre-faulted, mapped) for the next
  // job of the same model layout instead of unlinking it; at most one is pooled. A job that
  // cannot reuse it frees it before its admission check.
  bool pool_host_state = true;
};

class TrainingExecutor : public JobExecutor {
 public:
  explicit TrainingExecutor(TrainingExecutorOptions options);
  ~TrainingExecutor() override;
  absl::Status Validate(const JobSpec& spec) override;
  absl::Status Run(JobContext& ctx) override;

 private:
  absl::Status RunAttempt(JobContext& ctx);
  // The assignment's membership key for world > 1: the comm generation, this hostd instance and
  // the ordered (worker id, session serial) of the ranks. Workers keep their NCCL communicator
  // only while it matches.
  std::string MembershipKey(const JobContext& ctx) const;
  absl::StatusOr<update::LayerAdam*> Adam();
  // The pooled segment when `layout` fits it (made for the same layout, or a smaller state that
  // needs at least half of it: a tiny job should not pin a huge segment), taking it out of the
  // pool; otherwise frees the pool (its memory may be what the job needs) and returns null.
  std::unique_ptr<state::JobState> TakePooled(const ModelLayout& layout);
  // Renames a pooled segment to `job_id`'s state segment and resets it for a new job (control
  // block, abort word, gates, step) by laying it out again for `layout` in place
  // (state::JobState::Reformat). On error the segment is unlinked.
  absl::StatusOr<std::unique_ptr<state::JobState>> AdoptPooled(std::unique_ptr<state::JobState> pooled,
                                                               const std::string& job_id, const ModelLayout& layout,
                                                               int prefault_threads);
  // Puts a finished job's segment into the pool (renamed to the pool's name), or unlinks it.
  // `holders`: the workers that ran the job (they keep it mapped and registered for the next).
  void ReturnToPool(std::unique_ptr<state::JobState> js, std::vector<std::shared_ptr<WorkerSession>> holders);
  // Tells `holders` that a segment they may keep mapped is being removed and waits (at most a
  // few seconds) for their acks, so its memory is really free before the next admission check.
  void ReleaseWorkerMappings(const std::vector<std::shared_ptr<WorkerSession>>& holders, const std::string& segment);
  TrainingExecutorOptions options_;
  // The pooled state segment (mapped here, renamed to "/slidedp.<node>.pool.pooled"); only the
  // job-runner thread touches it, and the destructor unlinks it.
  std::unique_ptr<state::JobState> pooled_;
  std::string pooled_name_;
  std::vector<std::shared_ptr<WorkerSession>> pooled_holders_;  // workers that may keep it mapped
  // The holders of the pooled segment the running job adopted (they may not all be its workers).
  std::vector<std::shared_ptr<WorkerSession>> adopted_holders_;
  // Bumped after every attempt that did not succeed: its communicators may be broken mid-collective.
  std::atomic<int64_t> comm_generation_{0};
  std::string instance_token_;  // pid and start time of this hostd
  absl::Mutex mu_;
  std::unique_ptr<update::LayerAdam> adam_;  // warm across jobs
};

}  // namespace slidedp::hostd
