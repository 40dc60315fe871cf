// WorkerAgent: the session with hostd, assignments, and each job's run (JobSession).
#include "worker/agent/worker_agent.h"

#include "worker/agent/hostd_store.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status/grpc_status.h"
#include "common/status/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "worker/agent/job_config.h"
#include "worker/agent/step_reports.h"
#include "worker/pipeline/cpu_pipeline.h"
#include "worker/pipeline/cuda_pipeline.h"

namespace slidedp::worker {
namespace {

// The one place that knows which backends this binary was built with.
std::unique_ptr<PipelineFactory> MakePipelineFactory(const WorkerOptions& o) {
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  if (o.backend == BackendKind::kCuda) return MakeCudaPipelineFactory({o.index, o.switches.log_unit_norms});
  return MakeCpuPipelineFactory({o.switches.cpu_device_memory_bytes, /*mention_nccl_context_groups=*/true});
#else
  if (o.backend == BackendKind::kCuda) return MakeMissingCudaPipelineFactory();
  return MakeCpuPipelineFactory({o.switches.cpu_device_memory_bytes, /*mention_nccl_context_groups=*/false});
#endif
}

}  // namespace

WorkerAgent::WorkerAgent(WorkerOptions options)
    : options_(std::move(options)), factory_(MakePipelineFactory(options_)), host_states_(*factory_) {}

WorkerAgent::~WorkerAgent() {
  Stop();
  if (job_thread_.joinable()) job_thread_.join();
  // host_states_ (destroyed first) then stops its watcher and drops the kept mapping.
}

std::string WorkerAgent::worker_id() const {
  if (!options_.id.empty()) return options_.id;
  return absl::StrCat(options_.backend == BackendKind::kCuda ? "gpu" : "cpu", options_.index);
}

v1::DeviceInfo WorkerAgent::device() const {
  const DeviceDescription dev = factory_->Describe();
  v1::DeviceInfo d;
  d.set_kind(options_.backend == BackendKind::kCuda ? "cuda" : "cpu");
  d.set_index(options_.index);
  d.set_name(dev.name);
  d.set_numa_node(dev.numa_node);
  d.set_memory_bytes(dev.memory_bytes);
  d.set_pci_bus_id(dev.pci_bus_id);
  d.set_uuid(dev.uuid);
  return d;
}

void WorkerAgent::Stop() {
  stop_ = true;
  cancel_job_ = true;
  host_states_.StopWatching();
  absl::MutexLock l(&stream_mu_);
  if (context_) context_->TryCancel();
}

bool WorkerAgent::Send(const v1::WorkerReport& r) {
  absl::MutexLock l(&stream_mu_);
  return stream_ && stream_->Write(r);
}

absl::Status WorkerAgent::Run() {
  double backoff = 0.1;
  int failures = 0;
  absl::Status last;
  while (!stop_) {
    absl::Time t0 = absl::Now();
    last = RunSession();
    if (stop_) break;
    if (absl::Now() - t0 > absl::Seconds(5)) backoff = 0.1, failures = 0;  // it was a real session
    ++failures;
    if (options_.exit_after_disconnects >= 0 && failures > options_.exit_after_disconnects) break;
    LOG(WARNING) << "session with hostd ended (" << last << "); reconnecting in " << backoff << " s";
    absl::SleepFor(absl::Seconds(backoff));
    backoff = std::min(backoff * 2, options_.reconnect_max_s);
  }
  if (job_thread_.joinable()) job_thread_.join();
  return last;
}

absl::StatusOr<std::shared_ptr<KeyValueStore>> WorkerAgent::NodeStore(const std::string& job_id) {
  return HostdStore(options_.hostd_address, options_.credentials, job_id);
}

absl::Status WorkerAgent::RunSession() {
  // Made per session: a token file replaced while hostd was away is read again.
  ASSIGN_OR_RETURN(auto channel, auth::CreateHostdChannel(options_.hostd_address, options_.credentials));
  auto stub = v1::WorkerService::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Session(&ctx);
  {
    absl::MutexLock l(&stream_mu_);
    stream_ = stream.get();
    context_ = &ctx;
  }
  v1::WorkerReport hello;
  hello.mutable_hello()->set_worker_id(worker_id());
  hello.mutable_hello()->set_pid(getpid());
  *hello.mutable_hello()->mutable_device() = device();
  hello.mutable_hello()->set_build(BuildId());
  if (Send(hello)) ReadCommands(*stream);
  // hostd went away: a running job cannot finish (its gates and ring belong to that hostd).
  cancel_job_ = true;
  if (job_thread_.joinable()) job_thread_.join();
  host_states_.Drop("the session with hostd ended");
  {
    absl::MutexLock l(&stream_mu_);
    stream_ = nullptr;
    context_ = nullptr;
  }
  // Read also ends on a message this worker cannot parse, with hostd's side still open: Finish
  // would then wait for hostd forever (and hostd for this worker). hostd's own status (a refusal,
  // its shutdown) comes at once; past a few seconds the call is cancelled.
  absl::Notification finished;
  std::thread canceller([&] {
    if (!finished.WaitForNotificationWithTimeout(absl::Seconds(5))) ctx.TryCancel();
  });
  const grpc::Status status = stream->Finish();
  finished.Notify();
  canceller.join();
  return FromGrpc(status);
}

void WorkerAgent::ReadCommands(grpc::ClientReaderWriter<v1::WorkerReport, v1::HostCommand>& stream) {
  v1::HostCommand cmd;
  while (stream.Read(&cmd)) {
    if (cmd.has_assign()) {
      if (job_thread_.joinable()) job_thread_.join();  // the previous job has reported its end
      cancel_job_ = false;
      current_job_ = cmd.assign().job_id();
      job_thread_ = std::thread(&WorkerAgent::RunJob, this, cmd.assign());
    } else if (cmd.has_comm_id()) {
      absl::MutexLock l(&comm_mu_);
      comm_id_ = cmd.comm_id();
    } else if (cmd.has_release_host_state()) {
      host_states_.Drop("hostd removes it");
      v1::WorkerReport ack;
      *ack.mutable_host_state_released() = cmd.release_host_state();
      Send(ack);
    } else if (!cmd.cancel_job_id().empty() && cmd.cancel_job_id() == current_job_) {
      cancel_job_ = true;
    }
  }
}

void WorkerAgent::RunJob(v1::Assignment a) {
  pthread_setname_np(pthread_self(), "worker-job");
  LOG(INFO) << "job " << a.job_id() << ": rank " << a.rank() << " of " << a.world_size() << ", steps " << a.first_step()
            << ".." << a.total_steps();
  std::unique_ptr<HostState> keep;
  absl::Status s = ExecuteJob(a, &keep);
  LOG(INFO) << "job " << a.job_id() << " finished on this worker: " << s;
  if (s.ok() && keep) host_states_.Keep(std::move(keep));  // after every user of it is gone
  // After a failed or cancelled job the peers may have stopped at different collectives: never
  // reuse the communicator (hostd also changes the membership key after a failure).
  if (!s.ok()) factory_->DropCommunicator();
  Send(StepReports::JobFinished(a.job_id(), a.attempt(), s));
}

absl::Status WorkerAgent::ExecuteJob(const v1::Assignment& a, std::unique_ptr<HostState>* keep) {
  const DeviceDescription dev = factory_->Describe();
  ASSIGN_OR_RETURN(WorkerJobConfig config, WorkerJobConfigOf(a, dev.memory_bytes));
  JobSession session(std::move(config), *this, *factory_, options_.switches, dev);
  RETURN_IF_ERROR(session.Open());
  RETURN_IF_ERROR(session.Train());
  *keep = session.TakeHostState();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostState>> WorkerAgent::TakeHostState(const std::string& segment) {
  return host_states_.Take(segment);
}

absl::StatusOr<ComputeBackend*> WorkerAgent::BackendFor(const ModelConfig& c) {
  bool same = backend_ && backend_config_.ToJson() == c.ToJson();
  if (!same) {
    backend_.reset();
    ASSIGN_OR_RETURN(backend_, factory_->MakeBackend(c));
    backend_config_ = c;
  }
  return backend_.get();
}

absl::StatusOr<std::string> WorkerAgent::AwaitCommId(const WorkerJobConfig& job) {
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (true) {
    {
      absl::MutexLock l(&comm_mu_);
      auto relayed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(comm_mu_) { return comm_id_.has_value(); };
      comm_mu_.AwaitWithTimeout(absl::Condition(&relayed), absl::Milliseconds(50));
      if (comm_id_ && comm_id_->job_id() == job.job_id && comm_id_->attempt() == job.attempt &&
          comm_id_->membership_key() == job.membership_key) {
        return comm_id_->id();
      }
      comm_id_.reset();  // a stale one (an earlier job or attempt)
    }
    if (cancel_job_ || stop_) return absl::CancelledError("job cancelled while waiting for the NCCL id");
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError("rank 0's NCCL unique id did not arrive within 2 min");
  }
}

}  // namespace slidedp::worker
