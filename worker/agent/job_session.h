// JobSession: one job on this worker, from its assignment to its last step. It owns the job's
// parts (the state mapping, the gradient ring, the data, the pipeline, the step runner, AutoPolicy)
// and releases them in reverse order when it is destroyed; what outlives the job (the compute
// backend, the NCCL communicator, the kept state mapping) belongs to the worker (JobHost) and the
// backend's PipelineFactory.
//
// The job in named parts, as docs/architecture.md "One step, worker side" tells it:
//   Open       attach the segments, take the backend, open the data, build the pipeline
//   Train      every step of the assignment, then wait for the last gradients
//   TrainStep  one step: its batch, StepRunner::Run (forward, head, backward), its report,
//              the activation layout's decisions after it, validation when due
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/model/node_shard.h"
#include "shm/futex.h"
#include "shm/grad_ring.h"
#include "slidedp/v1/slidedp.pb.h"
#include "common/collective/key_value_store.h"
#include "worker/agent/host_state_cache.h"
#include "worker/agent/job_config.h"
#include "worker/agent/step_reports.h"
#include "worker/debug/debug_switches.h"
#include "worker/pipeline/auto_policy.h"
#include "worker/pipeline/job_pipeline.h"
#include "worker/pipeline/step_data.h"
#include "worker/pipeline/step_runner.h"

namespace slidedp::worker {

// What a job borrows from the worker that runs it (WorkerAgent), which keeps these between jobs.
class JobHost {
 public:
  virtual ~JobHost() = default;
  // The mapping of the job's state segment (HostStateCache::Take).
  virtual absl::StatusOr<std::unique_ptr<HostState>> TakeHostState(const std::string& segment) = 0;
  // The warm compute backend when its model shape is `config`'s, else a new one.
  virtual absl::StatusOr<ComputeBackend*> BackendFor(const ModelConfig& config) = 0;
  // A report to hostd; false when the session with hostd is lost.
  virtual bool Send(const v1::WorkerReport& report) = 0;
  // hostd cancelled the job, or the worker stops.
  virtual bool JobCancelled() const = 0;
  // Ranks 1..R-1: rank 0's NCCL unique id for `job`, as hostd relays it.
  virtual absl::StatusOr<std::string> AwaitCommId(const WorkerJobConfig& job) = 0;
  // A job over several nodes: its rendezvous store (hostd's PeerService).
  virtual absl::StatusOr<std::shared_ptr<KeyValueStore>> NodeStore(const std::string& job_id) = 0;
};

class JobSession final : private CommIdExchange {
 public:
  // `device`: the worker's, as its factory describes it.
  JobSession(WorkerJobConfig config, JobHost& host, PipelineFactory& factory, const DebugSwitches& switches,
             DeviceDescription device);
  JobSession(const JobSession&) = delete;
  JobSession& operator=(const JobSession&) = delete;
  ~JobSession() override = default;  // the members, in reverse order: see the comment on them

  // Attaches the job's segments, takes the backend, opens the data, builds the pipeline.
  absl::Status Open();
  // Steps first_step..total_steps-1, then the last gradients out (the ring closed).
  absl::Status Train();
  // After Train succeeded: the state mapping, for the worker to keep for the next job.
  std::unique_ptr<HostState> TakeHostState() { return std::move(host_state_); }

 private:
  // The backend's context group, set for this job only: unset when the session ends, before the
  // group itself goes.
  struct ContextGroupBinding {
    ComputeBackend* backend = nullptr;
    ContextGroupBinding() = default;
    ContextGroupBinding(const ContextGroupBinding&) = delete;
    ContextGroupBinding& operator=(const ContextGroupBinding&) = delete;
    ~ContextGroupBinding() {
      if (backend != nullptr) backend->SetContextGroup(nullptr).IgnoreError();
    }
  };

  // ---- Open's parts, in order ----
  absl::Status AttachState();     // the state mapping, its layout and mirror, the gradient ring
  absl::Status PrepareBackend();  // the backend for the model, its peak, determinism and tiles
  absl::Status OpenData();        // the dataset and its sampler
  absl::Status Configure();       // the pipeline's settings: routes, staging, layer layout
  absl::Status BuildPipeline();   // the communicator, the parts, the context group
  absl::Status LimitMemory();     // runtime.gpu_memory_limit: the backend gets what the parts leave
  void MakeRunner();
  void StartAutoPolicy();

  // ---- Train's parts ----
  absl::Status TrainStep(int64_t step);
  // After step `step` was reported (`done`): act_policy auto's count after the first step, and
  // AutoPolicy's measurements, re-layouts and its report.
  absl::Status AfterStep(int64_t step, const v1::StepDone& done, const std::vector<MicroBatch>& micro_batches,
                         int64_t peak_bytes);
  void KeepAllAfterFirstStep(int64_t step, const std::vector<MicroBatch>& micro_batches, int64_t peak_bytes);
  absl::Status AdoptLayout(AutoPolicyChoice choice, const std::vector<MicroBatch>& micro_batches);
  // Validation after step `step`, when the spec asks for it then.
  absl::Status EvaluateAfter(int64_t step);

  // A failure every peer must learn at once instead of timing out: the job's abort word raised.
  absl::Status AbortPeers(absl::Status s);
  // The same, unless the failure is itself a peer's abort (ABORTED).
  absl::Status AbortPeersUnlessAborted(absl::Status s);
  shm::JobState& job_state() { return *host_state_->js; }

  // CommIdExchange: rank 0 reports its new communicator's id; the others wait for hostd's relay.
  absl::Status Publish(const std::string& id) override;
  absl::StatusOr<std::string> Await() override;

  const WorkerJobConfig config_;
  JobHost& host_;
  PipelineFactory& factory_;
  const DebugSwitches& switches_;
  const DeviceDescription device_;
  const ModelLayout layout_;
  // A job over nodes with sharded state: which units each node holds whole, and this node's host layout
  // (the job segment's: each sharded unit cut to the node's range). Otherwise not sharded and layout_.
  const NodeSharding sharding_;
  const ModelLayout host_layout_;
  const ContextPlace place_;
  StepReports reports_;

  // Destroyed bottom to top: validation, AutoPolicy and the runner, then the backend's context
  // group unset, the pipeline's parts, the data, the ring, and last the state mapping (unless
  // TakeHostState took it).
  std::unique_ptr<HostState> host_state_;
  std::unique_ptr<shm::GradRing> ring_;
  ComputeBackend* backend_ = nullptr;  // the worker's, warm between jobs
  std::unique_ptr<StepData> data_;
  PipelineSettings settings_;
  std::vector<ActPolicy> layer_policies_;  // runtime.policy's layout; empty: act_policy decides
  JobPipeline pipeline_;
  ContextGroupBinding context_binding_;
  int64_t memory_limit_bytes_ = 0;  // runtime.gpu_memory_limit; 0: none
  Dtype checkpoint_dtype_ = Dtype::kF32;
  std::unique_ptr<StepRunner> runner_;
  std::unique_ptr<AutoPolicySession> autopolicy_;
  ValidationShare validation_;
};

}  // namespace slidedp::worker
