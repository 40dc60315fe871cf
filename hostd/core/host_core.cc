// HostCore: job table, queue and runner, worker sessions, watchers.
#include "hostd/core/host_core.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "hostd/admission/admission.h"
#include "hostd/core/host_core_internal.h"
#include "hostd/core/output_ownership.h"
#include "shm/process_liveness.h"

namespace slidedp::hostd {
bool IsFinal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}



// The executor's view of one running job.
class HostCore::RecordContext : public JobContext {
 public:
  RecordContext(HostCore* core, JobRecord* rec, std::vector<std::shared_ptr<WorkerSession>> workers)
      : core_(core),
        rec_(rec),
        job_id_(rec->job.job_id()),
        spec_(rec->spec),
        resume_from_(rec->resume_from),
        run_id_(rec->job.run_id().empty() ? rec->job.job_id() : rec->job.run_id()),
        workers_(std::move(workers)),
        attempt_(rec->restarts),
        nodes_(rec->nodes) {}
  const std::string& job_id() const override { return job_id_; }
  const JobSpec& spec() const override { return spec_; }
  const std::string& resume_from() const override { return resume_from_; }
  const std::string& run_id() const override { return run_id_; }
  int attempt() const override { return attempt_; }
  const std::vector<std::shared_ptr<WorkerSession>>& workers() const override { return workers_; }
  std::optional<JobNodes> job_nodes() const override { return nodes_; }
  NodeMesh* mesh() const override { return core_->options_.mesh; }
  bool cancel_requested() const override {
    absl::MutexLock l(&core_->mu_);
    return rec_->cancel;
  }
  bool checkpoint_on_cancel() const override {
    absl::MutexLock l(&core_->mu_);
    return rec_->checkpoint_on_cancel;
  }
  void SetState(v1::JobState s) override {
    absl::MutexLock l(&core_->mu_);
    core_->SetStateLocked(*rec_, s);
  }
  void SetTotalSteps(int64_t steps) override {
    absl::MutexLock l(&core_->mu_);
    rec_->job.set_total_steps(steps);
  }
  void SetHostStateBytes(int64_t bytes) override {
    absl::MutexLock l(&core_->mu_);
    rec_->job.set_host_state_bytes(bytes);
  }
  void ReportStep(const v1::StepMetrics& m) override {
    absl::MutexLock l(&core_->mu_);
    if (!rec_->job.has_last() && rec_->job.submit_to_first_step_s() == 0) {
      rec_->job.set_submit_to_first_step_s((NowMs() - rec_->submit_ms) / 1000.0);
    }
    *rec_->job.mutable_last() = m;
    v1::Job& job = rec_->job;
    job.set_run_steps(job.run_steps() + 1);
    if (m.step_time_s() > 0 && std::isfinite(m.tokens_per_s())) {
      rec_->run_tokens += m.tokens_per_s() * m.step_time_s();
      rec_->run_seconds += m.step_time_s();
      job.set_mean_tokens_per_s(rec_->run_tokens / rec_->run_seconds);
    }
    if (m.has_mfu()) {
      rec_->mfu_sum += m.mfu();
      job.set_mean_mfu(rec_->mfu_sum / static_cast<double>(++rec_->mfu_steps));
    }
    if (m.has_eval_loss()) {
      job.set_last_eval_loss(m.eval_loss());
      job.set_last_eval_step(m.step());
    }
    v1::JobEvent ev;
    *ev.mutable_step() = m;
    core_->Publish(*rec_, std::move(ev));
  }
  void Log(const std::string& line) override {
    LOG(INFO) << "job " << job_id_ << ": " << line;
    absl::MutexLock l(&core_->mu_);
    v1::JobEvent ev;
    ev.set_log(PrintableUtf8(line));
    core_->Publish(*rec_, std::move(ev));
  }
  void SetLastCheckpoint(const std::string& path) override {
    absl::MutexLock l(&core_->mu_);
    rec_->job.set_last_checkpoint(path);
    core_->PersistLocked(*rec_);
  }

 private:
  HostCore* core_;
  JobRecord* rec_;  // owned by core_->jobs_, never erased while running
  std::string job_id_;
  JobSpec spec_;
  std::string resume_from_;
  std::string run_id_;
  std::vector<std::shared_ptr<WorkerSession>> workers_;
  int attempt_;
  const std::optional<JobNodes> nodes_;
};

HostCore::HostCore(HostCoreOptions options, std::unique_ptr<JobExecutor> executor)
    : options_(std::move(options)), executor_(std::move(executor)) {}

HostCore::~HostCore() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    if (!running_.empty()) jobs_[running_]->cancel = true;
  }
  if (runner_.joinable()) runner_.join();
}


void HostCore::Start() {
  LoadPersisted();
  if (options_.before_first_job) options_.before_first_job();
  runner_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "job-runner");
    RunnerLoop();
  });
}

void HostCore::Drain(DrainMode mode) {
  absl::MutexLock l(&mu_);
  draining_ = true;
  for (const std::string& id : queue_) {
    JobRecord& rec = *jobs_[id];
    rec.job.set_error("hostd is draining; the job was not started");
    rec.job.set_error_code(static_cast<int>(absl::StatusCode::kUnavailable));
    SetStateLocked(rec, v1::JOB_STATE_CANCELLED);
    executor_->ForgetJob(id);
  }
  queue_.clear();
  if (mode != DrainMode::kFinishRunning && !running_.empty()) {
    jobs_[running_]->cancel = true;
    jobs_[running_]->checkpoint_on_cancel = mode == DrainMode::kCheckpointRunning;
  }
}

bool HostCore::draining() const {
  absl::MutexLock l(&mu_);
  return draining_;
}

bool HostCore::WaitIdle(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_.empty() && queue_.empty(); };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void HostCore::Publish(JobRecord& rec, v1::JobEvent ev) {
  for (auto& w : rec.watchers) w->Push(ev);
}

void HostCore::SetStateLocked(JobRecord& rec, v1::JobState s) {
  if (IsFinal(rec.job.state())) return;
  rec.job.set_state(s);
  if (s != v1::JOB_STATE_QUEUED) rec.job.clear_wait_reason();
  if (s == v1::JOB_STATE_STARTING) rec.job.set_start_time_unix_ms(NowMs());
  if (IsFinal(s)) rec.job.set_end_time_unix_ms(NowMs());
  PersistLocked(rec);
  v1::JobEvent ev;
  *ev.mutable_state_change() = rec.job;
  Publish(rec, std::move(ev));
  if (IsFinal(s)) {
    for (auto& w : rec.watchers) w->Close();
    rec.watchers.clear();
  }
}

namespace {
// `--resume PATH` (not a job of this hostd): a checkpoint directory, or a directory holding
// checkpoints (the newest complete one is taken when the job starts), checked at submit so that
// a path that cannot be one is the client's error now. A relative path is the client's: it
// resolves against the spec's directory, never against hostd's working directory.
absl::StatusOr<std::string> CheckResumePath(const std::string& given, const std::string& base_dir) {
  RETURN_IF_ERROR(CheckPathText(given, "--resume"));
  namespace fs = std::filesystem;
  fs::path p(given);
  if (p.is_relative()) {
    if (base_dir.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--resume ", given,
                                                     ": neither a job of this hostd nor an absolute path to a checkpoint"));
    }
    p = fs::path(base_dir) / p;  // (JobSpec::Parse has checked base_dir's text)
  }
  const std::string dir = p.lexically_normal().string();
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("--resume ", given, ": neither a job of this hostd nor a directory (", dir,
                                            ec ? ": " + ec.message() : std::string(), ")"));
  }
  const absl::Status found = fs::exists(fs::path(dir) / "COMPLETE", ec) ? checkpoint::VerifyCheckpoint(dir).status()
                                                                         : checkpoint::FindLatestCheckpoint(dir).status();
  if (!found.ok()) {
    return absl::Status(found.code() == absl::StatusCode::kNotFound ? absl::StatusCode::kNotFound
                                                                     : absl::StatusCode::kFailedPrecondition,
                        absl::StrCat("--resume ", given, ": ", found.message()));
  }
  return dir;
}
}  // namespace

absl::Status HostCore::CheckBeforeQueueing(const JobSpec& spec, const std::string& run_id) const {
  int workers = spec.runtime.workers;  // runtime.workers, else every worker attached when it starts
  if (workers == 0) {
    absl::MutexLock l(&mu_);
    for (const auto& [wid, w] : workers_) workers += !w->gone();
  }
  const int cp = std::max(1, spec.runtime.context_parallel);
  if (workers > 0 && workers % cp == 0 &&
      spec.train.global_batch % (int64_t{workers / cp} * spec.train.micro_batch) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.global_batch ", spec.train.global_batch, " is not divisible by ", workers / cp,
                     cp > 1 ? " context-parallel group(s)" : " worker(s)", " x train.micro_batch ",
                     spec.train.micro_batch, ": the job gets ", workers, " worker(s) (",
                     spec.runtime.workers > 0 ? "runtime.workers" : "the workers attached now",
                     "); give a global_batch that is a multiple of ", int64_t{workers / cp} * spec.train.micro_batch));
  }
  // Another run's checkpoints there, for a job that saves any. (A job queued before this one with
  // the same output.dir has written none yet: the check runs again when this job starts.)
  if (!SavesCheckpoints(spec)) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::vector<checkpoint::CheckpointEntry> others, OtherRunsCheckpoints(spec.output.dir, run_id));
  if (!spec.output.overwrite) RETURN_IF_ERROR(RefuseOtherRuns(spec.output.dir, others));
  return absl::OkStatus();
}

v1::Job HostCore::ShownLocked(const JobRecord& rec) const {
  v1::Job job = rec.job;
  if (job.state() != v1::JOB_STATE_QUEUED || !job.wait_reason().empty()) return job;
  // Queued behind others: the runner takes one job at a time, in queue order.
  size_t ahead = 0;
  for (const std::string& id : queue_) {
    if (id == job.job_id()) break;
    ++ahead;
  }
  if (!running_.empty()) {
    job.set_wait_reason(absl::StrCat("behind the running job ", running_,
                                     ahead > 0 ? absl::StrCat(" and ", ahead, " queued job(s)") : std::string()));
  } else if (ahead > 0) {
    job.set_wait_reason(absl::StrCat("behind ", ahead, " queued job(s) (next: ", queue_.front(), ")"));
  }
  return job;
}

// A new job's record: its id, spec (and the text's hash and size, for resubmits), resume point and run.
void HostCore::FillJobRecord(JobRecord& rec, const std::string& id, const JobSpec& spec, const std::string& spec_text,
                             const std::string& resume_from, const std::string& run_id) {
  rec.job.set_job_id(id);
  rec.job.set_resolved_spec_yaml(spec.ToYaml());
  rec.job.set_submit_time_unix_ms(NowMs());
  rec.job.set_total_steps(spec.train.steps);
  rec.job.set_output_dir(spec.output.dir);
  rec.job.set_run_id(run_id.empty() ? id : run_id);
  rec.submit_ms = NowMs();
  rec.spec = spec;
  rec.spec_hash = SpecHash(spec_text);
  rec.spec_size = spec_text.size();
  rec.resume_from = resume_from;
  rec.job.set_resume_from(resume_from);
}

absl::StatusOr<v1::SubmitJobResponse> HostCore::Submit(const v1::SubmitJobRequest& req) {
  ASSIGN_OR_RETURN(v1::SubmitJobResponse resp, SubmitRecord(req));
  if (req.dry_run() || resp.already_existed() || resp.job().state() != v1::JOB_STATE_QUEUED) return resp;
  bool over_nodes = false;
  {
    absl::MutexLock l(&mu_);
    auto it = jobs_.find(resp.job().job_id());
    over_nodes = it != jobs_.end() && it->second->nodes.has_value();
  }
  if (over_nodes) RETURN_IF_ERROR(StartOverNodes(resp.job().job_id()));
  return resp;
}

absl::StatusOr<v1::SubmitJobResponse> HostCore::SubmitRecord(const v1::SubmitJobRequest& req) {
  if (!req.job_id().empty() && !ValidJobId(req.job_id())) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id '", ShownId(req.job_id()), "' is not valid: use 1-64 characters of [A-Za-z0-9_-]"));
  }
  // model.path and data.path resolve against the client's directory; output.dir is the output
  // policy's to resolve (inside hostd's output root), and the job record shows its result.
  ASSIGN_OR_RETURN(JobSpec spec, JobSpec::Parse(req.spec_yaml(), req.base_dir(), JobSpec::FileCheck::kCheck,
                                                JobSpec::OutputDirBase::kAsWritten));
  ASSIGN_OR_RETURN(spec.output.dir, ResolveOutputDir(options_.output_policy, spec.output.dir));
  std::string resume_from = req.resume_from();
  // --resume JOB_ID: that job's own newest checkpoint (the file reads happen outside the lock).
  std::string resume_job, resume_last, resume_root;
  {
    absl::MutexLock l(&mu_);
    auto it = jobs_.find(resume_from);
    if (!resume_from.empty() && it != jobs_.end()) {
      resume_job = it->first;
      resume_last = it->second->job.last_checkpoint();
      resume_root = it->second->spec.output.dir;
    }
  }
  if (!resume_job.empty()) {
    // Its last checkpoint, if no other job sharing the output directory has replaced it since,
    // else the newest one it saved there.
    absl::StatusOr<std::string> saved_by =
        resume_last.empty() ? absl::NotFoundError("") : checkpoint::CheckpointJobId(resume_last);
    if (saved_by.ok() && *saved_by == resume_job) {
      resume_from = resume_last;
    } else {
      absl::StatusOr<std::string> own = checkpoint::FindLatestCheckpoint(resume_root, resume_job);
      if (!own.ok()) {
        return absl::FailedPreconditionError(absl::StrCat("--resume ", resume_job, ": ", own.status().message(),
                                                          " (another job sharing the output directory may have "
                                                          "replaced its checkpoints)"));
      }
      resume_from = *own;
    }
  } else if (!resume_from.empty()) {
    ASSIGN_OR_RETURN(resume_from, CheckResumePath(resume_from, req.base_dir()));
  }
  // The run the job continues (its checkpoints' run_id), and what the output directory holds.
  std::string run_id;
  if (!resume_from.empty()) {
    absl::StatusOr<std::string> run = RunOfCheckpoint(resume_from);
    if (!run.ok()) return Annotate(run.status(), "--resume");
    run_id = *run;
  }
  RETURN_IF_ERROR(CheckBeforeQueueing(spec, run_id));
  {
    absl::MutexLock l(&mu_);
    if (!req.job_id().empty()) {
      auto it = jobs_.find(req.job_id());
      if (it != jobs_.end()) {
        if (it->second->spec_hash != SpecHash(req.spec_yaml()) || it->second->spec_size != req.spec_yaml().size() ||
            it->second->resume_from != resume_from) {
          return absl::AlreadyExistsError(absl::StrCat("job '", req.job_id(), "' exists with a different spec"));
        }
        v1::SubmitJobResponse resp;
        *resp.mutable_job() = it->second->job;
        resp.set_already_existed(true);
        return resp;
      }
    }
    if (draining_ && !req.dry_run()) return absl::UnavailableError("hostd is draining and admits no new jobs");
    if (!req.dry_run() && queue_.size() >= kMaxQueuedJobs) {
      return absl::ResourceExhaustedError(
          absl::StrCat(queue_.size(), " jobs are queued already (the most hostd takes); submit again later"));
    }
  }
  RETURN_IF_ERROR(executor_->Validate(spec));
  // A job over nodes: which of them this hostd is (asked of each; before the lock, for GetNode).
  std::optional<JobNodes> nodes;
  if (!spec.runtime.nodes.empty()) {
    if (options_.mesh == nullptr) {
      return absl::FailedPreconditionError("runtime.nodes: this hostd runs no jobs over several nodes");
    }
    ASSIGN_OR_RETURN(int self, options_.mesh->FindSelf(spec.runtime.nodes));
    nodes = JobNodes{spec.runtime.nodes, self, self};
  }

  absl::MutexLock l(&mu_);
  auto rec = std::make_unique<JobRecord>();
  rec->nodes = nodes;
  std::string id = req.job_id();
  if (id.empty()) {
    // From the name (ValidateJobName: at most 48 of [A-Za-z0-9._-]); ids take no '.' (they name
    // shm segments), so the id is as valid as one given with --id.
    // Ids do not repeat in an output directory either (a private hostd of `slidedp run` starts
    // counting at 1 every time): two jobs never share a metrics or events file.
    const std::string stem = absl::StrReplaceAll(spec.name, {{".", "_"}});
    do {
      id = absl::StrCat(stem, "-", next_job_number_++);
    } while (jobs_.count(id) || JobIdUsedIn(spec.output.dir, id));
    if (!ValidJobId(id)) return absl::InternalError(absl::StrCat("job id '", id, "' made from the name is not valid"));
  } else if (jobs_.count(id)) {  // raced with an identical submit
    v1::SubmitJobResponse resp;
    *resp.mutable_job() = jobs_[id]->job;
    resp.set_already_existed(true);
    return resp;
  } else if (JobIdUsedIn(spec.output.dir, id)) {
    return absl::FailedPreconditionError(absl::StrCat("job id '", id, "': output.dir ", spec.output.dir,
                                                      " holds the metrics or TensorBoard events of an earlier job "
                                                      "with this id (metrics-",
                                                      id, ".jsonl); give another --id, or another output.dir"));
  }
  if (!req.dry_run() && queue_.size() >= kMaxQueuedJobs) {  // again: submits raced since the first look
    return absl::ResourceExhaustedError(
        absl::StrCat(queue_.size(), " jobs are queued already (the most hostd takes); submit again later"));
  }
  FillJobRecord(*rec, id, spec, req.spec_yaml(), resume_from, run_id);
  v1::SubmitJobResponse resp;
  if (req.dry_run()) {
    *resp.mutable_job() = rec->job;
    return resp;
  }
  rec->job.set_state(v1::JOB_STATE_QUEUED);
  *resp.mutable_job() = rec->job;
  PersistLocked(*rec);
  const bool over_nodes = rec->nodes.has_value();
  jobs_[id] = std::move(rec);
  job_order_.push_back(id);
  if (over_nodes) return resp;  // queued once every node has joined (StartOverNodes)
  queue_.push_back(id);
  LOG(INFO) << "job " << id << " queued";
  return resp;
}

absl::Status HostCore::StartOverNodes(const std::string& id, absl::Time retry_until) {
  v1::JoinJobRequest join;
  JobNodes nodes;
  absl::StatusOr<std::string> kind;
  {
    absl::MutexLock l(&mu_);
    kind = WorkerKindLocked();
    JobRecord& rec = *jobs_.at(id);
    nodes = *rec.nodes;
    join.set_job_id(id);
    join.set_spec_yaml(rec.job.resolved_spec_yaml());
    join.set_coordinator(nodes.self);
    join.set_resume_from(rec.resume_from);
    join.set_run_id(rec.job.run_id());
    join.set_attempt(rec.restarts);
  }
  options_.mesh->Register(id, nodes);
  absl::Status joined = kind.status();
  for (int n = 0; n < nodes.count() && joined.ok(); ++n) {
    if (n == nodes.self) continue;
    join.set_node(n);
    absl::StatusOr<v1::JoinJobResponse> resp = options_.mesh->Join(nodes.nodes[n], join);
    // A restart: a node that is not back yet (down, or still ending its attempt) is asked again.
    while (!resp.ok() && absl::Now() < retry_until &&
           (absl::IsUnavailable(resp.status()) || absl::IsDeadlineExceeded(resp.status()))) {
      {
        absl::MutexLock l(&mu_);
        if (stop_ || jobs_.at(id)->cancel) break;
      }
      absl::SleepFor(absl::Milliseconds(500));
      resp = options_.mesh->Join(nodes.nodes[n], join);
    }
    joined = resp.status();
    // One engine links the nodes' ranks: Gloo between CPU workers, NCCL between CUDA workers.
    if (joined.ok() && resp->backend() != *kind) {
      joined = absl::FailedPreconditionError(absl::StrCat("node ", n, " (", nodes.nodes[n], ") has ", resp->backend(),
                                                          " workers, this node (", nodes.self, ") ", *kind,
                                                          ": a job over nodes runs on one kind"));
    }
  }
  if (!joined.ok()) {
    options_.mesh->AbortOthers(id, joined);  // the nodes that joined stop (the others know no such job)
    options_.mesh->Unregister(id);
    absl::MutexLock l(&mu_);
    JobRecord& rec = *jobs_.at(id);
    rec.job.set_error(BoundedLine(joined.message(), kMaxJobErrorBytes));
    rec.job.set_error_code(static_cast<int>(joined.code()));
    SetStateLocked(rec, v1::JOB_STATE_FAILED);
    return joined;
  }
  {
    absl::MutexLock l(&mu_);
    JobRecord& rec = *jobs_.at(id);
    if (!rec.cancel && !IsFinal(rec.job.state())) {
      queue_.push_back(id);
      LOG(INFO) << "job " << id << " queued over " << nodes.count() << " nodes (this one is node " << nodes.self << ")";
      return absl::OkStatus();
    }
    if (!IsFinal(rec.job.state())) SetStateLocked(rec, v1::JOB_STATE_CANCELLED);  // cancelled while joining
  }
  options_.mesh->AbortOthers(id, absl::CancelledError("cancelled before it started"));
  options_.mesh->Unregister(id);
  return absl::OkStatus();
}

absl::StatusOr<std::string> HostCore::WorkerKindLocked() const {
  std::string kind;
  for (const auto& [wid, w] : workers_) {
    if (w->gone()) continue;
    const std::string& k = w->hello().device().kind();
    if (!kind.empty() && k != kind) {
      return absl::FailedPreconditionError("a job over nodes needs workers of one kind on each node (cpu and cuda attached)");
    }
    kind = k;
  }
  if (kind.empty()) return absl::UnavailableError("no worker is attached");
  return kind;
}

absl::StatusOr<std::string> HostCore::JoinJob(const v1::JoinJobRequest& req) {
  if (options_.mesh == nullptr) return absl::FailedPreconditionError("this hostd runs no jobs over several nodes");
  if (!ValidJobId(req.job_id())) return absl::InvalidArgumentError("join: the job id is not valid");
  if (req.spec_yaml().size() > kMaxSpecBytes) return absl::InvalidArgumentError("join: the spec is too large");
  // The coordinator resolved the spec (absolute paths); this node checks it as its own submit would,
  // on its own files. Its output directory is the coordinator's: this node writes none.
  ASSIGN_OR_RETURN(JobSpec spec, JobSpec::Parse(req.spec_yaml(), "/", JobSpec::FileCheck::kCheck,
                                                JobSpec::OutputDirBase::kAsWritten));
  const int count = static_cast<int>(spec.runtime.nodes.size());
  if (count < 2 || req.node() < 0 || req.node() >= count || req.coordinator() < 0 || req.coordinator() >= count ||
      req.node() == req.coordinator()) {
    return absl::InvalidArgumentError(absl::StrCat("join: node ", req.node(), " / coordinator ", req.coordinator(),
                                                   " of ", count, " nodes"));
  }
  std::string resume_from;
  if (!req.resume_from().empty()) {
    ASSIGN_OR_RETURN(resume_from, CheckResumePath(req.resume_from(), "/"));
  }
  RETURN_IF_ERROR(executor_->Validate(spec));
  absl::MutexLock l(&mu_);
  if (draining_) return absl::UnavailableError("hostd is draining and admits no new jobs");
  // An automatic restart of a job over nodes: this node's attempt of it ended; it joins the next.
  auto existing = jobs_.find(req.job_id());
  const bool rejoin = existing != jobs_.end() && existing->second->nodes &&
                      existing->second->nodes->coordinator == req.coordinator() &&
                      existing->second->nodes->self == req.node() && req.attempt() > existing->second->restarts;
  if (rejoin && !IsFinal(existing->second->job.state())) {
    return absl::UnavailableError(absl::StrCat("job '", req.job_id(), "' is still ending its attempt here"));
  }
  if (existing != jobs_.end() && !rejoin) {
    return absl::AlreadyExistsError(absl::StrCat("job '", req.job_id(), "' exists here"));
  }
  // A job over nodes starts on every node at once: a node busy with another job would leave the
  // others waiting in their rendezvous.
  if (!running_.empty() || !queue_.empty()) {
    return absl::UnavailableError(absl::StrCat("busy: job '", running_.empty() ? queue_.front() : running_,
                                               "' is ", running_.empty() ? "queued" : "running",
                                               " here; a job over nodes starts on idle nodes"));
  }
  ASSIGN_OR_RETURN(std::string kind, WorkerKindLocked());
  if (rejoin) {
    JobRecord& rec = *existing->second;
    rec.restarts = req.attempt();
    rec.resume_from = resume_from;
    rec.job.set_resume_from(resume_from);
    rec.job.clear_error();
    rec.job.set_error_code(0);
    rec.cancel = false;
    rec.peer_abort = absl::OkStatus();
    rec.job.set_state(v1::JOB_STATE_QUEUED);
    options_.mesh->Register(req.job_id(), *rec.nodes);
    PersistLocked(rec);
    queue_.push_back(req.job_id());
    LOG(INFO) << "job " << req.job_id() << " rejoined as node " << req.node() << " for its attempt " << req.attempt()
              << (resume_from.empty() ? std::string(" from the start") : absl::StrCat(" from ", resume_from));
    return kind;
  }
  auto rec = std::make_unique<JobRecord>();
  rec->nodes = JobNodes{spec.runtime.nodes, req.node(), req.coordinator()};
  FillJobRecord(*rec, req.job_id(), spec, req.spec_yaml(), resume_from, req.run_id());
  rec->restarts = req.attempt();
  rec->job.set_state(v1::JOB_STATE_QUEUED);
  options_.mesh->Register(req.job_id(), *rec->nodes);
  PersistLocked(*rec);
  jobs_[req.job_id()] = std::move(rec);
  job_order_.push_back(req.job_id());
  queue_.push_back(req.job_id());
  LOG(INFO) << "job " << req.job_id() << " joined as node " << req.node() << " of " << count << " (coordinator: node "
            << req.coordinator() << ")";
  return kind;
}

void HostCore::AbortFromPeer(const v1::AbortJobRequest& req) {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(req.job_id());
  if (it == jobs_.end() || !it->second->nodes || IsFinal(it->second->job.state())) return;
  JobRecord& rec = *it->second;
  if (req.node() < 0 || req.node() >= rec.nodes->count() || req.node() == rec.nodes->self) return;
  const auto code = static_cast<absl::StatusCode>(req.code());
  rec.peer_abort = absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kAborted : code,
                                absl::StrCat("node ", req.node(), " (", rec.nodes->nodes[req.node()],
                                             "): ", BoundedLine(req.message(), kMaxJobErrorBytes / 2)));
  rec.cancel = true;
  auto queued = std::find(queue_.begin(), queue_.end(), req.job_id());
  if (queued != queue_.end()) {  // not started: it ends here
    queue_.erase(queued);
    rec.job.set_error(std::string(rec.peer_abort.message()));
    rec.job.set_error_code(static_cast<int>(rec.peer_abort.code()));
    SetStateLocked(rec, rec.peer_abort.code() == absl::StatusCode::kCancelled ? v1::JOB_STATE_CANCELLED
                                                                              : v1::JOB_STATE_FAILED);
    options_.mesh->Unregister(req.job_id());
  }
}

absl::StatusOr<v1::PlanJobResponse> HostCore::Plan(const v1::PlanJobRequest& req) {
  ASSIGN_OR_RETURN(JobSpec spec, JobSpec::Parse(req.spec_yaml(), req.base_dir(), JobSpec::FileCheck::kCheck,
                                                JobSpec::OutputDirBase::kAsWritten));
  ASSIGN_OR_RETURN(spec.output.dir, ResolveOutputDir(options_.output_policy, spec.output.dir));
  RETURN_IF_ERROR(executor_->Validate(spec));
  std::vector<v1::WorkerHello> hellos;
  {
    absl::MutexLock l(&mu_);
    for (auto& [wid, w] : workers_) {
      if (w->gone()) continue;
      if (spec.runtime.workers > 0 && static_cast<int>(hellos.size()) >= spec.runtime.workers) break;
      hellos.push_back(w->hello());
    }
  }
  if (hellos.empty() || (spec.runtime.workers > 0 && static_cast<int>(hellos.size()) < spec.runtime.workers)) {
    return absl::FailedPreconditionError(absl::StrCat("plan: the job needs ", std::max(1, spec.runtime.workers),
                                                      " attached worker(s) to plan on, ", hellos.size(),
                                                      " attached now"));
  }
  if (!spec.runtime.nodes.empty()) return PlanOverNodes(spec, hellos);
  ASSIGN_OR_RETURN(v1::PlanJobResponse plan, executor_->Plan(spec, hellos));
  if (!req.measure()) return plan;
  if (spec.runtime.context_parallel > 1) {
    plan.add_notes("runtime.context_parallel: AutoPolicy does not measure such jobs (--measure does nothing)");
    return plan;
  }
  // The routes to measure: the job's own, or each route `auto` (or --routes) leaves open.
  const bool cuda = std::all_of(hellos.begin(), hellos.end(),
                                [](const v1::WorkerHello& h) { return h.device().kind() == "cuda"; });
  std::vector<JobSpec> targets = {spec};
  if (req.routes() || spec.runtime.grad_reduction_auto || spec.runtime.param_delivery_auto ||
      spec.runtime.chunk_bytes_auto) {
    targets = RouteVariants(spec, static_cast<int>(hellos.size()), cuda, req.routes());
  }
  for (const JobSpec& t : targets) {
    absl::StatusOr<v1::PlanJobResponse> p =
        targets.size() == 1 ? absl::StatusOr<v1::PlanJobResponse>(plan) : executor_->Plan(t, hellos);
    if (!p.ok()) {  // a route these workers cannot run (e.g. with this grad_staging): said, not measured
      plan.add_notes(absl::StrCat(RouteName(t), ": not measured: ", p.status().message()));
      continue;
    }
    if (p->step_s() > 0) continue;  // measured already
    // The measuring job goes through Submit as any other: queued, listed, watchable, cancellable.
    v1::SubmitJobRequest measure;
    measure.set_spec_yaml(PolicyMeasureSpec(t).ToYaml());
    measure.set_base_dir(req.base_dir());
    // One measuring job per spec: a plan asked again while its measuring job is queued or
    // running names that job instead of queueing another.
    measure.set_dry_run(true);
    ASSIGN_OR_RETURN(v1::SubmitJobResponse resolved, Submit(measure));
    if (std::optional<std::string> pending = PendingJobWithSpec(resolved.job().resolved_spec_yaml())) {
      plan.add_measure_job_ids(*pending);
      continue;
    }
    measure.set_dry_run(false);
    ASSIGN_OR_RETURN(v1::SubmitJobResponse queued, Submit(measure));
    plan.add_measure_job_ids(queued.job().job_id());
    LOG(INFO) << "plan: job " << queued.job().job_id() << " measures " << RouteName(t) << " for a planned job";
  }
  return plan;
}

absl::StatusOr<v1::PlanJobResponse> HostCore::PlanOverNodes(const JobSpec& spec,
                                                            const std::vector<v1::WorkerHello>& hellos) {
  if (options_.mesh == nullptr) return absl::FailedPreconditionError("runtime.nodes: this hostd runs no jobs over nodes");
  const int count = static_cast<int>(spec.runtime.nodes.size());
  ASSIGN_OR_RETURN(int self, options_.mesh->FindSelf(spec.runtime.nodes));
  // This node's share of the global batch on its workers: each node runs the same.
  JobSpec share = spec;
  share.runtime.nodes.clear();
  share.runtime.node_state = NodeState::kReplicated;  // planned as one node holding it all, then cut below
  share.train.global_batch = spec.train.global_batch / count;
  const bool sharded = spec.runtime.node_state == NodeState::kSharded;
  ASSIGN_OR_RETURN(v1::PlanJobResponse plan, executor_->Plan(share, hellos));
  plan.set_world(plan.world() * count);
  double gparams = 0;
  for (v1::PlanResource& r : *plan.mutable_resources()) {
    if (r.unit() != "Gparam") continue;
    gparams = std::max(gparams, r.work());
    if (sharded) {  // a node updates its ranges only: about 1/N of the parameters
      r.set_work(r.work() / count);
      if (r.busy_s() > 0) r.set_busy_s(r.busy_s() / count);
    }
  }
  // The slowest link from here to another node (gRPC over the hostds' own listeners: TLS on TCP).
  double gbps = 0;
  std::string slowest;
  for (int n = 0; n < count; ++n) {
    if (n == self) continue;
    ASSIGN_OR_RETURN(double bytes_per_s, options_.mesh->MeasureBandwidth(spec.runtime.nodes[n], int64_t{64} << 20));
    if (gbps == 0 || bytes_per_s / 1e9 < gbps) {
      gbps = bytes_per_s / 1e9;
      slowest = spec.runtime.nodes[n];
    }
  }
  // Each node's FP32 gradient parts cross its link about twice a step (the chain in and out, and the
  // total's broadcast, or with sharded state the totals sent to their nodes): 8 bytes a parameter; a
  // sharded state's BF16 weights come in from the other nodes too, 2 (N-1)/N (docs/multi-node.md).
  const double gb = (8.0 + (sharded ? 2.0 * (count - 1) / count : 0.0)) * gparams;
  const double busy = gbps > 0 ? gb / gbps : -1;
  v1::PlanResource* net = plan.add_resources();
  net->set_name("network between nodes");
  net->set_work(gb);
  net->set_unit("GB");
  net->set_rate(gbps);
  net->set_busy_s(busy);
  net->set_source(absl::StrCat("measured now: 64 MiB streamed to each node over gRPC; slowest ", slowest));
  // The gradients leave during the backward (about 2/3 of the step), so the network stretches the
  // step past a third of it plus its own time.
  if (plan.step_s() > 0 && busy > 0 && plan.step_s() / 3 + busy > plan.step_s()) {
    plan.set_step_s(plan.step_s() / 3 + busy);
    plan.set_bottleneck("network between nodes");
  }
  plan.add_notes(absl::StrCat(count, " nodes of ", hellos.size(), " worker(s), this node ", self,
                              ": each node's step as this node's share of the global batch (",
                              share.train.global_batch, " rows) on its workers, with the network term; the "
                              "chain's per-unit latency (N-1 hops) and the other nodes' own speeds are not counted"));
  if (sharded) {
    plan.add_notes(absl::StrCat("sharded state: each node holds and updates about 1/", count,
                                " of the state (the host update above is this node's share; the step is predicted "
                                "with the whole update, an upper bound), and gathers the rest of each unit's weights "
                                "from the other nodes"));
  }
  return plan;
}

std::optional<std::string> HostCore::PendingJobWithSpec(const std::string& resolved_spec_yaml) const {
  absl::MutexLock l(&mu_);
  std::vector<std::string> pending(queue_.begin(), queue_.end());
  if (!running_.empty()) pending.push_back(running_);
  for (const std::string& id : pending) {
    if (jobs_.at(id)->job.resolved_spec_yaml() == resolved_spec_yaml) return id;
  }
  return std::nullopt;
}

absl::StatusOr<v1::Job> HostCore::GetJob(const std::string& job_id) const {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", ShownId(job_id), "'"));
  return ShownLocked(*it->second);
}

std::vector<v1::Job> HostCore::ListJobs() const {
  absl::MutexLock l(&mu_);
  std::vector<v1::Job> out;
  for (const std::string& id : job_order_) {
    out.push_back(ShownLocked(*jobs_.at(id)));
    // The specs stay with GetJob: a listing of every job ever run must not carry each one's spec
    // (thousands of jobs would pass gRPC's message limit).
    out.back().clear_resolved_spec_yaml();
  }
  return out;
}

absl::StatusOr<v1::Job> HostCore::Cancel(const std::string& job_id, CancelSave save) {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", ShownId(job_id), "'"));
  JobRecord& rec = *it->second;
  if (IsFinal(rec.job.state())) return rec.job;
  if (rec.job.state() == v1::JOB_STATE_QUEUED) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), job_id), queue_.end());
    SetStateLocked(rec, v1::JOB_STATE_CANCELLED);
    executor_->ForgetJob(job_id);
    return rec.job;
  }
  rec.cancel = true;  // the executor stops at the next safe point
  if (save == CancelSave::kCheckpoint) rec.checkpoint_on_cancel = true;
  v1::JobEvent ev;
  ev.set_log(rec.checkpoint_on_cancel ? "cancel requested: the job saves a checkpoint at the next step boundary"
                                      : "cancel requested");
  Publish(rec, std::move(ev));
  return rec.job;
}

absl::StatusOr<std::shared_ptr<Channel<v1::JobEvent>>> HostCore::Watch(const std::string& job_id) {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", ShownId(job_id), "'"));
  if (!IsFinal(it->second->job.state()) && it->second->watchers.size() >= kMaxWatchersPerJob) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job_id, "' has ", kMaxWatchersPerJob, " watchers already; try again later"));
  }
  if (!IsFinal(it->second->job.state())) {
    // Each watch stream holds a gRPC thread while it lasts: a bound over all jobs too.
    size_t total = 0;
    for (const std::string& id : queue_) total += jobs_.at(id)->watchers.size();
    if (!running_.empty()) total += jobs_.at(running_)->watchers.size();
    if (total >= kMaxWatchers) {
      return absl::ResourceExhaustedError(
          absl::StrCat("hostd has ", kMaxWatchers, " job watchers already; try again later"));
    }
  }
  auto ch = std::make_shared<Channel<v1::JobEvent>>();
  v1::JobEvent ev;
  *ev.mutable_state_change() = ShownLocked(*it->second);
  ch->Push(std::move(ev));
  if (IsFinal(it->second->job.state())) {
    ch->Close();
  } else {
    it->second->watchers.push_back(ch);
  }
  return ch;
}

void HostCore::Unwatch(const std::string& job_id, const std::shared_ptr<Channel<v1::JobEvent>>& ch) {
  absl::MutexLock l(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  auto& w = it->second->watchers;
  w.erase(std::remove(w.begin(), w.end(), ch), w.end());
}


void HostCore::RunnerLoop() {
  while (true) {
    std::string id;
    JobRecord* rec = nullptr;
    std::vector<std::shared_ptr<WorkerSession>> assigned;
    {
      absl::MutexLock l(&mu_);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&has_work));
      if (stop_) return;
      id = queue_.front();
      rec = jobs_[id].get();
      // Wait for enough live workers (the job stays queued meanwhile).
      const int wanted = rec->spec.runtime.workers;
      absl::Time deadline = absl::Now() + options_.worker_wait;
      auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (stop_ || rec->cancel || queue_.empty() || queue_.front() != id) return true;
        int live = 0;
        for (auto& [wid, w] : workers_) live += !w->gone();
        return live > 0 && (wanted == 0 || live >= wanted);
      };
      while (!enough() && absl::Now() < deadline) {
        // Watchers and `slidedp status` see why it waits; a new reason is a state-change event.
        int live = 0;
        for (auto& [wid, w] : workers_) live += !w->gone();
        std::string reason = absl::StrCat("needs ", wanted > 0 ? wanted : 1, " worker(s), ", live,
                                          " attached; waiting up to ",
                                          absl::ToInt64Seconds(options_.worker_wait), " s (hostd --worker-wait-s)");
        if (reason != rec->job.wait_reason()) {
          rec->job.set_wait_reason(std::move(reason));
          v1::JobEvent ev;
          *ev.mutable_state_change() = rec->job;
          Publish(*rec, std::move(ev));
        }
        mu_.AwaitWithDeadline(absl::Condition(&enough), std::min(deadline, absl::Now() + absl::Milliseconds(200)));
      }
      if (stop_) return;
      if (queue_.empty() || queue_.front() != id) continue;  // cancelled while waiting
      queue_.pop_front();
      for (auto& [wid, w] : workers_) {
        if (w->gone()) continue;
        if (wanted > 0 && static_cast<int>(assigned.size()) >= wanted) break;
        assigned.push_back(w);
      }
      if (assigned.empty() || (wanted > 0 && static_cast<int>(assigned.size()) < wanted)) {
        rec->job.set_error(absl::StrCat("needs ", wanted > 0 ? wanted : 1, " attached worker(s), ", assigned.size(),
                                        " attached after waiting ", absl::FormatDuration(options_.worker_wait)));
        rec->job.set_error_code(static_cast<int>(absl::StatusCode::kUnavailable));
        SetStateLocked(*rec, v1::JOB_STATE_FAILED);
        executor_->ForgetJob(id);
        continue;
      }
      running_ = id;
      rec->job.set_num_workers(static_cast<int>(assigned.size()));
      rec->job.set_compute_backend(assigned.front()->hello().device().kind());
      for (auto& w : assigned) {
        worker_job_[w->id()] = id;
        w->SetAssignedJob(id);
      }
      SetStateLocked(*rec, v1::JOB_STATE_STARTING);
    }
    LOG(INFO) << "job " << id << " starting on " << assigned.size() << " worker(s)";
    RecordContext ctx(this, rec, assigned);
    absl::Status status = executor_->Run(ctx);
    std::string ended = "OK";  // for the log: the error as the job keeps it
    executor_->ForgetJob(id);  // state adopted for the job and not used (the attempt failed before)
    if (rec->nodes) {
      // Another node's end stopped this one: that is the job's error. Else this node's end stops
      // the others (a failure, or a cancel here).
      absl::Status peer;
      {
        absl::MutexLock l(&mu_);
        peer = rec->peer_abort;
      }
      if (!peer.ok()) {
        status = peer;
      } else if (!status.ok()) {
        options_.mesh->AbortOthers(id, status);
      }
      options_.mesh->Unregister(id);
    }
    bool restart_over_nodes = false;
    {
      absl::MutexLock l(&mu_);
      for (auto& w : assigned) {
        worker_job_.erase(w->id());
        w->SetAssignedJob("");
      }
      // A job over nodes that lost a worker or a node (UNAVAILABLE, or a node that stopped answering:
      // DEADLINE_EXCEEDED) restarts the same way, driven by its coordinator: once every node has
      // joined the next attempt (each waits for its workers), from the newest checkpoint.
      const bool lost = status.code() == absl::StatusCode::kUnavailable ||
                        status.code() == absl::StatusCode::kDeadlineExceeded;
      const bool user_cancel = rec->cancel && rec->peer_abort.ok();
      if (lost && rec->nodes && rec->nodes->coordinating() && !user_cancel && !stop_ &&
          rec->restarts < rec->spec.runtime.max_restarts) {
        rec->restarts++;
        for (auto& w : assigned) {
          if (!w->process_alive()) w->MarkGone();
        }
        auto latest = checkpoint::FindLatestCheckpoint(rec->spec.output.dir, rec->job.job_id());
        rec->resume_from = latest.ok() ? *latest : rec->resume_from;
        rec->job.set_resume_from(rec->resume_from);
        rec->cancel = false;
        rec->peer_abort = absl::OkStatus();
        v1::JobEvent ev;
        ev.set_log(absl::StrCat("restart ", rec->restarts, " of ", rec->spec.runtime.max_restarts, " over ",
                                rec->nodes->count(), " nodes after: ", BoundedLine(status.message(), kMaxJobErrorBytes),
                                latest.ok() ? absl::StrCat("; resuming from ", *latest) : std::string("; from the start"),
                                " once every node has joined again"));
        LOG(WARNING) << "job " << id << ": " << ev.log();
        Publish(*rec, ev);
        rec->job.set_state(v1::JOB_STATE_QUEUED);
        PersistLocked(*rec);
        running_.clear();
        restart_over_nodes = true;
      }
    }
    if (restart_over_nodes) {
      // The nodes come back within the time a job waits for its workers (or the step timeout).
      const absl::Duration wait =
          std::max(options_.worker_wait, absl::Milliseconds(rec->spec.runtime.step_timeout_ms));
      if (absl::Status s = StartOverNodes(id, absl::Now() + wait); !s.ok()) {
        LOG(WARNING) << "job " << id << ": its restart over nodes failed: " << s;
      }
      continue;
    }
    {
      absl::MutexLock l(&mu_);
      // A worker that died (UNAVAILABLE) is survivable when the spec asks for automatic
      // restarts: the job goes back to the front of the queue and resumes from its newest
      // complete checkpoint (or from the start) on the workers still attached.
      const bool worker_lost = status.code() == absl::StatusCode::kUnavailable;
      if (worker_lost && !rec->cancel && !stop_ && !rec->nodes && rec->restarts < rec->spec.runtime.max_restarts) {
        rec->restarts++;
        // The dead worker's session may not have broken yet (the job noticed first, through the
        // ring's liveness check): drop every assigned worker whose process is gone, so the
        // restart does not pick it again.
        for (auto& w : assigned) {
          if (!w->process_alive()) w->MarkGone();
        }
        auto latest = checkpoint::FindLatestCheckpoint(rec->spec.output.dir, rec->job.job_id());
        rec->resume_from = latest.ok() ? *latest : rec->resume_from;
        v1::JobEvent ev;
        ev.set_log(
            absl::StrCat("restart ", rec->restarts, " of ", rec->spec.runtime.max_restarts,
                         " after: ", BoundedLine(status.message(), kMaxJobErrorBytes),
                         latest.ok() ? absl::StrCat("; resuming from ", *latest) : std::string("; from the start")));
        LOG(WARNING) << "job " << id << ": " << ev.log();
        Publish(*rec, ev);
        rec->job.set_state(v1::JOB_STATE_QUEUED);
        PersistLocked(*rec);
        queue_.push_front(id);
        running_.clear();
        continue;
      }
      if (!status.ok() && rec->cancel && rec->peer_abort.ok() && status.code() != absl::StatusCode::kCancelled) {
        // Cancelled, and it then failed on its way to the safe point (a stalled worker timed
        // out, say): the user's cancel is what ended it.
        status = absl::CancelledError(absl::StrCat("cancelled; the job stopped with: ", status.ToString()));
      }
      if (status.ok()) {
        SetStateLocked(*rec, v1::JOB_STATE_SUCCEEDED);
      } else {
        const std::string error = BoundedLine(status.message(), kMaxJobErrorBytes);
        ended = absl::StrCat(absl::StatusCodeToString(status.code()), ": ", error);
        rec->job.set_error(error);
        rec->job.set_error_code(static_cast<int>(status.code()));
        SetStateLocked(*rec,
                       status.code() == absl::StatusCode::kCancelled ? v1::JOB_STATE_CANCELLED : v1::JOB_STATE_FAILED);
      }
      running_.clear();
    }
    LOG(INFO) << "job " << id << " ended: " << ended;
  }
}

}  // namespace slidedp::hostd
