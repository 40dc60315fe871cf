// WorkerAgent: the body of slidedp-worker. Keeps a gRPC session with hostd (re-registering when
// hostd restarts), receives assignments, and runs each assigned job's steps with a compute
// backend that stays warm between jobs.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/auth/hostd_channel.h"
#include "common/jobspec/job_spec.h"
#include "slidedp/v1/slidedp.grpc.pb.h"
#include "worker/compute/backend.h"

namespace slidedp {
class NcclCommunicator;
namespace state {
class JobState;
}
}  // namespace slidedp

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
};

class WorkerAgent {
 public:
  explicit WorkerAgent(WorkerOptions options);
  ~WorkerAgent();
  // Runs sessions until Stop() (or exit_after_disconnects). Returns the last session's status.
  absl::Status Run();
  void Stop();  // async-signal-unsafe: call from a normal thread

  std::string worker_id() const;
  v1::DeviceInfo device() const;

 private:
  absl::Status RunSession();
  void RunJob(v1::Assignment a);
  struct HostState;
  // Runs the job; on success hands its host state mapping to *keep (for KeepHostState).
  absl::Status ExecuteJob(const v1::Assignment& a, std::unique_ptr<HostState>* keep);
  absl::StatusOr<ComputeBackend*> BackendFor(const ModelConfig& config);
  // The job's NCCL communicator: the warm one when hostd's membership key is unchanged, else a
  // new one (rank 0 makes the unique id and reports it; the others wait for hostd to relay it).
  absl::StatusOr<NcclCommunicator*> CommunicatorFor(const v1::Assignment& a);
  absl::StatusOr<std::string> AwaitCommId(const v1::Assignment& a);
  bool Send(const v1::WorkerReport& r);

  // A job's mapping of its state segment and (CUDA) the registrations of its mirrors. After a
  // job that succeeded on this worker it is kept (cached_), because hostd pools the segment for
  // the next job of the same size: that job then finds it mapped and registered. It is dropped
  // when hostd releases the segment (HostCommand.release_host_state), when the file loses its
  // name (checked every second: a hostd that unlinks without telling), when the next job uses
  // another segment, and when the session with hostd ends.
  absl::StatusOr<std::unique_ptr<HostState>> TakeHostState(const std::string& segment);
  void KeepHostState(std::unique_ptr<HostState> hs);
  void DropHostState(const char* why);
  void WatchHostState();

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
  std::shared_ptr<NcclCommunicator> comm_;  // warm between jobs with the same membership (job thread)

  absl::Mutex comm_mu_;
  std::optional<v1::CommId> comm_id_ ABSL_GUARDED_BY(comm_mu_);  // last relayed by hostd

  absl::Mutex cache_mu_;
  std::unique_ptr<HostState> cached_ ABSL_GUARDED_BY(cache_mu_);
  std::thread cache_watcher_;
};

}  // namespace slidedp::worker
