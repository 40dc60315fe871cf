// HostCore: hostd's control-plane state without gRPC — the job table and queue, worker
// sessions, watchers, draining. The gRPC services (hostd/service) are thin translations of it.
//
// Threads: gRPC handler threads call in; one named "job-runner" thread takes queued jobs one at a
// time and runs them through a JobExecutor (hostd/engine) on the attached workers. All state is
// guarded by mu_.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/jobspec/job_spec.h"
#include "hostd/core/output_policy.h"
#include "hostd/mesh/node_mesh.h"
#include "shm/process_liveness.h"
#include "slidedp/v1/job_state_name.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::hostd {

class WorkerSession;

// A bounded queue of messages with blocking pop; Close() wakes everyone. Used for watcher event
// streams, commands to a worker, and reports from a worker.
template <typename T>
class Channel {
 public:
  // At most `capacity` messages and, counting what callers give Push as each one's size,
  // `max_bytes` bytes.
  explicit Channel(size_t capacity = 4096, size_t max_bytes = SIZE_MAX) : capacity_(capacity), max_bytes_(max_bytes) {}
  // Returns false when closed or full (a slow watcher drops events rather than blocking hostd).
  bool Push(T v, size_t bytes = 0) {
    absl::MutexLock l(&mu_);
    if (closed_ || q_.size() >= capacity_ || bytes > max_bytes_ - bytes_) return false;
    q_.push_back({std::move(v), bytes});
    bytes_ += bytes;
    return true;
  }
  // Waits up to timeout; nullopt on timeout or when closed and drained.
  std::optional<T> Pop(absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return closed_ || !q_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    if (q_.empty()) return std::nullopt;
    T v = std::move(q_.front().value);
    bytes_ -= q_.front().bytes;
    q_.pop_front();
    return v;
  }
  void Close() {
    absl::MutexLock l(&mu_);
    closed_ = true;
  }
  bool closed() const {
    absl::MutexLock l(&mu_);
    return closed_;
  }

 private:
  struct Item {
    T value;
    size_t bytes;
  };
  mutable absl::Mutex mu_;
  std::deque<Item> q_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  size_t capacity_;
  size_t max_bytes_;
};

// The most bytes of reports one worker session holds unread: a step's reports are a few KiB, an
// AutoPolicy layout at most 1 MiB, and the runner drains them every millisecond.
inline constexpr size_t kMaxQueuedReportBytes = size_t{64} << 20;

// One attached slidedp-worker process (its gRPC session stream).
class WorkerSession {
 public:
  // `serial`: unique per session within this hostd (a worker that reconnects gets a new one), so
  // a job's membership key changes whenever any of its ranks is a different process session.
  explicit WorkerSession(v1::WorkerHello hello, int64_t serial = 0);
  const std::string& id() const { return hello_.worker_id(); }
  int64_t serial() const { return serial_; }
  const v1::WorkerHello& hello() const { return hello_; }
  int64_t connected_unix_ms() const { return connected_unix_ms_; }

  // hostd -> worker commands; the session's gRPC writer drains this.
  Channel<v1::HostCommand>& commands() { return commands_; }
  // worker -> hostd reports (StepDone, JobFinished) for the executor running its job.
  Channel<v1::WorkerReport>& reports() { return reports_; }
  // The session's reader: queues `report` when it is one hostd waits for — about the job this
  // worker is assigned (SetAssignedJob), or the ack of a release between jobs — within
  // kMaxQueuedReportBytes; anything else (a report while idle, for another job, a second hello)
  // is dropped and false returned. An idle or misbehaving worker cannot make hostd hold memory.
  bool QueueReport(v1::WorkerReport report);
  // The job whose reports this worker's session queues ("" : none); set by the runner.
  void SetAssignedJob(const std::string& job_id);

  // The stream ended (process gone or disconnected).
  void MarkGone();
  // False once the worker's process (same host, by pid and start time) has exited.
  bool process_alive() const;
  bool gone() const { return commands_.closed(); }

 private:
  v1::WorkerHello hello_;
  int64_t serial_;
  int64_t connected_unix_ms_;
  Channel<v1::HostCommand> commands_;
  Channel<v1::WorkerReport> reports_;
  shm::ProcessIdentity process_;
  mutable absl::Mutex assigned_mu_;
  std::string assigned_job_ ABSL_GUARDED_BY(assigned_mu_);
};

// What a running job may do and see; handed to the executor by the runner.
class JobContext {
 public:
  virtual ~JobContext() = default;
  virtual const std::string& job_id() const = 0;
  virtual const JobSpec& spec() const = 0;
  virtual const std::string& resume_from() const = 0;
  // The run the job's checkpoints belong to (trainer_state.json "run_id"; Job.run_id): the run of
  // the checkpoint it resumes, else its own id.
  virtual const std::string& run_id() const { return job_id(); }
  // 0 for the first run of a job, then one more per automatic restart.
  virtual int attempt() const = 0;
  virtual const std::vector<std::shared_ptr<WorkerSession>>& workers() const = 0;
  virtual bool cancel_requested() const = 0;
  // Save a checkpoint at the safe point where the cancel takes effect (hostd draining, or a cancel
  // with save_checkpoint).
  virtual bool checkpoint_on_cancel() const = 0;
  virtual void SetState(v1::JobState state) = 0;
  virtual void SetTotalSteps(int64_t steps) = 0;
  virtual void SetHostStateBytes(int64_t bytes) = 0;
  virtual void ReportStep(const v1::StepMetrics& m) = 0;
  virtual void Log(const std::string& line) = 0;
  virtual void SetLastCheckpoint(const std::string& path) = 0;
  // A job over several nodes (runtime.nodes): its nodes as this hostd sees them, and the mesh that
  // reaches the others; none for a job of this node only. A node that does not coordinate writes no
  // outputs (the coordinator's checkpoints, metrics and events are the job's).
  virtual std::optional<JobNodes> job_nodes() const { return std::nullopt; }
  virtual NodeMesh* mesh() const { return nullptr; }
};

class JobExecutor {
 public:
  virtual ~JobExecutor() = default;
  // Runs the job to completion on ctx.workers(); returns its final status (CANCELLED if it
  // stopped because cancel_requested()).
  virtual absl::Status Run(JobContext& ctx) = 0;
  // Validates a spec beyond syntax (model config readable, data matches vocab, memory admission)
  // so bad jobs are refused at submit with the right code. Optional.
  virtual absl::Status Validate(const JobSpec& spec) { return absl::OkStatus(); }
  // `slidedp plan`: the job's predicted step on these workers (the ones it would get), before
  // anything runs. Optional.
  virtual absl::StatusOr<v1::PlanJobResponse> Plan(const JobSpec& spec, const std::vector<v1::WorkerHello>& workers) {
    return absl::UnimplementedError("this executor makes no plans");
  }
  // A job the previous hostd left running or queued when it died: takes over the state it left
  // in shared memory for the job's next Run when that state is consistent, and returns the
  // number of steps it holds. An error says why not (NOT_FOUND: no state segment); the job then
  // resumes from its newest checkpoint instead. Optional.
  virtual absl::StatusOr<int64_t> AdoptInterruptedState(const std::string& job_id, const JobSpec& spec) {
    return absl::UnimplementedError("this executor cannot resume from shared memory");
  }
  // The job will not run after all (cancelled while queued): drops what AdoptInterruptedState took.
  virtual void ForgetJob(const std::string& job_id) {}
};

struct HostCoreOptions {
  std::string node_name = "local";
  // Jobs wait at most this long for their workers to attach before failing.
  absl::Duration worker_wait = absl::Minutes(5);
  // Job records are kept here (<state_dir>/jobs/<id>.json) so a restarted hostd still lists
  // them; a job that was running when hostd died is reported FAILED ("interrupted") with its last
  // complete checkpoint. Empty: records live in memory only.
  std::string state_dir;
  // At Start, resume the jobs that were running or queued when the previous hostd died: the
  // running one from its state in shared memory when consistent (JobExecutor::
  // AdoptInterruptedState), else from its newest checkpoint (or its --resume checkpoint, or the
  // start). At most kMaxHostdRestartsPerJob times per job. false: they are reported FAILED
  // ("interrupted") with their last checkpoint.
  bool resume_interrupted = true;
  // Called by Start after the job records are loaded and before the runner starts any job
  // (hostd reclaims dead processes' segments there, sparing the ones it took over).
  std::function<void()> before_first_job;
  // Where jobs may write: every submitted output.dir is resolved by it (relative: inside
  // output_policy.root), and one it refuses is PERMISSION_DENIED. The default has no root and
  // refuses every job.
  OutputPolicy output_policy;
  // Reported by GetNode (the host side's topology and LayerAdam sizing).
  int numa_nodes = 1;
  int update_threads = 0;
  // Jobs over several nodes (runtime.nodes): this hostd's peers. Null: such jobs are refused.
  NodeMesh* mesh = nullptr;
};

// A job resumed after this many hostd restarts that interrupted it is not resumed again (a job
// that crashes hostd would otherwise crash it forever).
inline constexpr int kMaxHostdRestartsPerJob = 3;
// Watchers of one job at a time (each holds a channel of up to 4,096 queued events).
inline constexpr size_t kMaxWatchersPerJob = 256;
inline constexpr size_t kMaxWatchers = 1024;  // over all jobs
// Jobs waiting to run: a queue is a day's work, not thousands of submits.
inline constexpr size_t kMaxQueuedJobs = 1024;
// A failed job's error as kept, shown and logged (one line; a worker's message is cut before).
inline constexpr size_t kMaxJobErrorBytes = 8192;
// The longest worker_id a worker's hello may carry.
inline constexpr size_t kMaxWorkerIdChars = 64;
// The longest of the hello's other names (build, device name, UUID, PCI bus id).
inline constexpr size_t kMaxHelloStringChars = 256;

class HostCore {
 public:
  HostCore(HostCoreOptions options, std::unique_ptr<JobExecutor> executor);
  ~HostCore();  // stops the runner (cancels the running job)

  void Start();
  // Stops admitting jobs and cancels queued ones; the running job finishes, or stops at its
  // next step boundary (after saving a checkpoint with kCheckpointRunning).
  enum class DrainMode { kFinishRunning, kCheckpointRunning, kCancelRunning };
  void Drain(DrainMode mode);
  bool draining() const;
  // Blocks until no job is running or queued (after Drain), or timeout.
  bool WaitIdle(absl::Duration timeout);

  // JobService
  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::SubmitJobRequest& req);
  // `slidedp plan`: the spec checked as Submit checks it, then the executor's prediction on the
  // workers attached now (the first runtime.workers of them).
  absl::StatusOr<v1::PlanJobResponse> Plan(const v1::PlanJobRequest& req);
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) const;
  // A queued or running job whose resolved spec is this one (the id), if any.
  std::optional<std::string> PendingJobWithSpec(const std::string& resolved_spec_yaml) const;
  // Every job, without resolved_spec_yaml (GetJob has it).
  std::vector<v1::Job> ListJobs() const;
  // A queued job ends CANCELLED at once; a running one at its next step boundary, after saving a
  // checkpoint there when `save` is kCheckpoint (and it has run a step since it started or resumed).
  enum class CancelSave { kNone, kCheckpoint };
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, CancelSave save = CancelSave::kNone);
  // Subscribes to a job's events: the current state first. The channel closes after the final
  // state. NOT_FOUND for unknown ids.
  absl::StatusOr<std::shared_ptr<Channel<v1::JobEvent>>> Watch(const std::string& job_id);
  // The watcher's RPC ended (the client went away or the job ended): its channel stops
  // receiving the job's events.
  void Unwatch(const std::string& job_id, const std::shared_ptr<Channel<v1::JobEvent>>& ch);

  // PeerService (a job over several nodes): another node's hostd, coordinating a job, asks this one
  // to run its part (checked and admitted as a submit is, on an idle node; it starts at once).
  // Returns the kind of this node's attached workers ("cpu" or "cuda").
  absl::StatusOr<std::string> JoinJob(const v1::JoinJobRequest& req);
  // Another node's part of a job ended (failed or cancelled): this node's stops, FAILED naming it.
  void AbortFromPeer(const v1::AbortJobRequest& req);

  // WorkerService
  absl::StatusOr<std::shared_ptr<WorkerSession>> AttachWorker(const v1::WorkerHello& hello);
  void DetachWorker(const std::shared_ptr<WorkerSession>& w);

  // NodeService
  std::vector<v1::WorkerInfo> ListWorkers() const;
  v1::NodeInfo GetNode() const;

 private:
  struct JobRecord;
  class RecordContext;
  void RunnerLoop();
  void Publish(JobRecord& rec, v1::JobEvent ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetStateLocked(JobRecord& rec, v1::JobState s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PersistLocked(const JobRecord& rec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LoadPersisted();
  void ReportInterrupted(v1::Job& job, const std::string& output_dir);
  void ResumeInterruptedLocked(v1::Job& job, const JobSpec& spec, JobRecord& rec) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job as clients see it: a queued one says why it waits (Job.wait_reason).
  v1::Job ShownLocked(const JobRecord& rec) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void FillJobRecord(JobRecord& rec, const std::string& id, const JobSpec& spec, const std::string& spec_text,
                            const std::string& resume_from, const std::string& run_id);
  // Submit up to the job's record (queued, unless it runs over nodes: StartOverNodes queues it).
  absl::StatusOr<v1::SubmitJobResponse> SubmitRecord(const v1::SubmitJobRequest& req);
  // Refusals Submit can know before a job is queued: another run's checkpoints in the output
  // directory, and the batch against the workers the job will get. `run_id`: the run the job
  // continues ("" for a new run).
  absl::Status CheckBeforeQueueing(const JobSpec& spec, const std::string& run_id) const;
  // Submit of a job over nodes, once its record exists (not queued): finds this node among them,
  // has every other node join, then queues it. On an error the record ends FAILED and the nodes that
  // joined stop.
  // retry_until (an automatic restart): a node that does not answer or is still ending its attempt is
  // asked again until then.
  absl::Status StartOverNodes(const std::string& id, absl::Time retry_until = absl::InfinitePast());
  // The kind of the attached live workers ("cpu", "cuda"); FAILED_PRECONDITION when mixed or none.
  absl::StatusOr<std::string> WorkerKindLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `slidedp plan` of a job over nodes: this node's share predicted on its workers, the bandwidth
  // to the other nodes measured, and the network term added (docs/multi-node.md's model).
  absl::StatusOr<v1::PlanJobResponse> PlanOverNodes(const JobSpec& spec, const std::vector<v1::WorkerHello>& hellos);

  HostCoreOptions options_;
  std::unique_ptr<JobExecutor> executor_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobRecord>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> job_order_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);
  std::string running_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<WorkerSession>> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> worker_job_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_job_number_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_session_serial_ ABSL_GUARDED_BY(mu_) = 1;
  std::thread runner_;
};

using v1::JobStateName;
bool IsFinal(v1::JobState s);

}  // namespace slidedp::hostd
