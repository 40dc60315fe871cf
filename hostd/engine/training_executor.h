// TrainingExecutor: runs one training job on hostd's side. It owns the job's authoritative
// state for the job's lifetime and carries out one step loop (docs/architecture.md):
//   plan (job_plan.h) -> admission (hostd/admission) -> state segment, new or pooled
//   (host_state_pool.h) and rings -> initial weights (initial_weights.h) -> assignments ->
//   per step: gradients from the rings (grad_consumer.h) into LayerAdam, gates opened per unit
//   (step_updates.h), worker reports (worker_reports.h), metrics (step_metrics.h), checkpoints.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "checkpoint/checkpoint.h"
#include "common/data/dataset.h"
#include "hostd/core/host_core.h"
#include "hostd/engine/host_state_pool.h"
#include "hostd/engine/step_metrics.h"
#include "hostd/update/layer_adam.h"

namespace slidedp::hostd {

struct StepMeasurements;  // attempt.h

struct TrainingExecutorOptions {
  std::string node_name = "local";
  int update_threads = 0;  // 0: from the topology
  update::WorkerPinning pinning = update::WorkerPinning::kCore;
  // Keep the state segment of a job that succeeded (allocated, pre-faulted, mapped) for the next
  // job of the same model layout instead of unlinking it; at most one is pooled. A job that
  // cannot reuse it frees it before its admission check.
  bool pool_host_state = true;
  // Where AutoPolicy's layouts are cached (policy_cache.h): <state_dir>/policies; empty: nowhere.
  std::string policy_cache_dir;
};

class TrainingExecutor : public JobExecutor {
 public:
  explicit TrainingExecutor(TrainingExecutorOptions options);
  ~TrainingExecutor() override;
  absl::Status Validate(const JobSpec& spec) override;
  absl::StatusOr<v1::PlanJobResponse> Plan(const JobSpec& spec, const std::vector<v1::WorkerHello>& workers) override;
  absl::Status Run(JobContext& ctx) override;
  // Opens the job's state segment the dead hostd left, checks it (model layout, job id, every
  // unit at the same step and no update begun beyond it) and takes it over (this process becomes
  // its owner); the job's next Run continues from it without reading a checkpoint.
  absl::StatusOr<int64_t> AdoptInterruptedState(const std::string& job_id, const JobSpec& spec) override;
  void ForgetJob(const std::string& job_id) override;

 private:
  struct Attempt;  // one attempt's parts: its data, measurements, step loop, outputs, segments (attempt.h)

  absl::Status RunAttempt(JobContext& ctx);
  // The attempt's spec, layout and plan before any host state: other runs' checkpoints refused or
  // moved aside, the dataset and validation split verified, routes and layout resolved. Null:
  // nothing to run (train.measure_only on a layout measured already).
  absl::StatusOr<std::unique_ptr<Attempt>> PrepareAttempt(JobContext& ctx);
  // Opens the dataset with every check (CRC-32 of each file, token ids against the model's
  // vocabulary, the loss mask; DATA_LOSS naming the file) and returns its files' identities for
  // the workers. Resolves train.epochs into steps. Once per job (see verified_).
  absl::StatusOr<std::vector<data::FileIdentity>> VerifyDataset(JobContext& ctx, JobSpec& spec, int64_t model_vocab);
  // The validation pass after step t: every rank's sums, added in micro-batch order, into m.
  absl::Status RecordValidation(JobContext& ctx, Attempt& a, int64_t t, v1::StepMetrics& m);
  // Admission (with the pooled segment's bytes counted as available), then the job's state
  // segment: the one taken over from a dead hostd, the pooled one adopted, or a new one.
  absl::Status AcquireState(JobContext& ctx, Attempt& a);
  // The step loop's components over the written state: schedule, gates, reports, the rings'
  // consumer with its staging, speculative clipping's undo copies, LayerAdam's copy priority.
  absl::Status BuildStepLoop(JobContext& ctx, Attempt& a);
  // A job over nodes: only its coordinator writes checkpoints, metrics and events.
  static bool WritesOutputs(const JobContext& ctx);
  // A job over nodes, after step t's update: this node's losses and state digest go to the
  // coordinator; the coordinator gathers every node's, adds the job's loss in global rank order
  // into `record` and fails the job when a node's state differs from its own. A sharded state's
  // nodes hold different parts: no digest; without staging each sends its parts' squared norm
  // (less `whole_unit_squares`, the squares of the units every node holds, but on the coordinator).
  absl::Status ExchangeNodeStep(JobContext& ctx, Attempt& a, int64_t t, const std::vector<v1::StepDone>& reports,
                                double whole_unit_squares, StepRecord& record);
  absl::Status SendAssignments(JobContext& ctx, const Attempt& a);
  // One optimizer step t: gradients into LayerAdam, gates, metrics.
  absl::Status RunStep(JobContext& ctx, Attempt& a, int64_t t);
  absl::Status SaveCheckpoint(JobContext& ctx, Attempt& a, int64_t steps_done);
  // A sharded state's checkpoint (checkpoint::NodeShare): the coordinator publishes its temporary
  // directory in the job's store and waits for every other node's share; the others write theirs
  // into it (SaveNodeShare) and say so.
  static std::string ShareKey(const JobContext& ctx, int64_t step, const std::string& what);
  absl::Status AwaitNodeShares(JobContext& ctx, Attempt& a, int64_t step, const std::string& tmp);
  absl::Status SaveNodeShare(JobContext& ctx, Attempt& a, const checkpoint::SaveRequest& req);
  // The assignment's membership key for world > 1: the comm generation, this hostd instance and
  // the ordered (worker id, session serial) of the ranks. Workers keep their NCCL communicator
  // only while it matches.
  std::string MembershipKey(const JobContext& ctx) const;
  absl::StatusOr<update::LayerAdam*> Adam();
  // runtime.policy auto: the layout cached for this job's shape, batch, device and build, if any;
  // *key: its cache key, *said: a line saying which (or why none).
  std::optional<LayerLayout> CachedLayout(const JobSpec& spec, const ModelConfig& config,
                                          const std::vector<v1::WorkerHello>& hellos, std::string* key,
                                          std::string* said) const;
  // runtime.policy auto: rank 0's validated choice, logged and cached.
  // Logs AutoPolicy's validated layout and caches it; true when it is cached.
  bool RecordPolicy(JobContext& ctx, Attempt& a, const v1::PolicyChosen& chosen);
  // The job's last line on an AutoPolicy layout: its predicted step against the median measured.
  static void LogPrediction(JobContext& ctx, const StepMeasurements& m);
  // Plan for a spec with concrete routes (`what_if`, `estimate_other_route`: StepPredictionInputs').
  absl::StatusOr<v1::PlanJobResponse> PlanRoute(const JobSpec& spec, const std::vector<v1::WorkerHello>& workers,
                                                bool what_if, bool estimate_other_route);
  // runtime.grad_reduction / param_delivery `auto`: the route (RouteVariants) whose measured step
  // PlanRoute predicts shortest, or the defaults where none is measured; *said says which and why.
  // A spec without `auto` routes comes back as it is.
  JobSpec ResolveRoutes(const JobSpec& spec, const std::vector<v1::WorkerHello>& workers, std::string* said);

  TrainingExecutorOptions options_;
  HostStatePool pool_;  // only the job-runner thread touches it
  // Bumped after every attempt that did not succeed: its communicators may be broken mid-collective.
  std::atomic<int64_t> comm_generation_{0};
  std::string instance_token_;  // pid and start time of this hostd
  absl::Mutex mu_;
  std::unique_ptr<update::LayerAdam> adam_;  // warm across jobs
  struct AdoptedState {
    std::unique_ptr<shm::JobState> state;
    int64_t step = 0;
  };
  // Taken over from a dead hostd, by job id, until that job runs.
  std::map<std::string, AdoptedState> adopted_ ABSL_GUARDED_BY(mu_);
  // LayerAdam's measured rate (Gparam/s) on this host, by moment dtype: `slidedp plan`'s A.
  std::map<int, double> update_rates_ ABSL_GUARDED_BY(mu_);
  // The last dataset verified, and for which job: its later attempts compare identities only.
  // Only the job-runner thread touches it.
  struct VerifiedDataset {
    std::string job_id, data_path;
    std::vector<data::FileIdentity> files;
  } verified_;
};

}  // namespace slidedp::hostd
