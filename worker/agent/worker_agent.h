// WorkerAgent: the body of slidedp-worker. Keeps a gRPC session with hostd (re-registering when
// hostd restarts), receives assignments, and runs each assigned job (JobSession) with a compute
// backend that stays warm between jobs. Everything that differs per device kind comes from the
// backend's PipelineFactory (worker/pipeline/job_pipeline.h), chosen once at start.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/auth/hostd_channel.h"
#include "slidedp/v1/slidedp.grpc.pb.h"
#include "worker/agent/host_state_cache.h"
#include "worker/agent/job_session.h"
#include "worker/compute/backend.h"
#include "worker/debug/debug_switches.h"
#include "worker/pipeline/job_pipeline.h"

namespace slidedp::worker {

enum class BackendKind { kCpu, kCuda };

struct WorkerOptions {
  std::string hostd_address = "unix:/tmp/slidedp-hostd.sock";
  auth::ClientCredentialsOptions credentials;  // TCP addresses: TLS roots, client certificate, token
  BackendKind backend = BackendKind::kCpu;
  int index = 0;                    // GPU ordinal (cuda) or worker number (cpu)
  std::string id;                   // the worker's name at hostd; empty: gpu<index> / cpu<index>
  double reconnect_max_s = 5;       // backoff cap while hostd is away
  int exit_after_disconnects = -1;  // tests: give up after N failed sessions (-1: never)
  DebugSwitches switches;           // the environment's (main: ProcessDebugSwitches)
};

class WorkerAgent final : private JobHost {
 public:
  explicit WorkerAgent(WorkerOptions options);
  ~WorkerAgent() override;
  // Runs sessions until Stop() (or exit_after_disconnects). Returns the last session's status.
  absl::Status Run();
  void Stop();  // async-signal-unsafe: call from a normal thread

  std::string worker_id() const;
  v1::DeviceInfo device() const;

 private:
  absl::Status RunSession();
  // The commands of one session's stream, until it ends.
  void ReadCommands(grpc::ClientReaderWriter<v1::WorkerReport, v1::HostCommand>& stream);
  void RunJob(v1::Assignment a);
  // Runs the job; on success hands its host state mapping to *keep (for HostStateCache::Keep).
  absl::Status ExecuteJob(const v1::Assignment& a, std::unique_ptr<HostState>* keep);

  // JobHost
  absl::StatusOr<std::unique_ptr<HostState>> TakeHostState(const std::string& segment) override;
  absl::StatusOr<ComputeBackend*> BackendFor(const ModelConfig& config) override;
  bool Send(const v1::WorkerReport& r) override;
  bool JobCancelled() const override { return cancel_job_ || stop_; }
  absl::StatusOr<std::string> AwaitCommId(const WorkerJobConfig& job) override;
  absl::StatusOr<std::shared_ptr<KeyValueStore>> NodeStore(const std::string& job_id) override;

  WorkerOptions options_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cancel_job_{false};
  std::string current_job_;

  absl::Mutex stream_mu_;
  grpc::ClientReaderWriter<v1::WorkerReport, v1::HostCommand>* stream_ ABSL_GUARDED_BY(stream_mu_) = nullptr;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(stream_mu_) = nullptr;

  std::thread job_thread_;
  std::unique_ptr<ComputeBackend> backend_;  // warm between jobs with the same model shape
  ModelConfig backend_config_;
  // The device kind's parts; keeps the NCCL communicator warm between jobs with the same
  // membership (job thread).
  std::unique_ptr<PipelineFactory> factory_;

  absl::Mutex comm_mu_;
  std::optional<v1::CommId> comm_id_ ABSL_GUARDED_BY(comm_mu_);  // last relayed by hostd

  HostStateCache host_states_;  // destroyed first: it drops the kept mapping through factory_
};

}  // namespace slidedp::worker
