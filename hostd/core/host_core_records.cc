// HostCore's job records: kept in <state_dir>/jobs/<id>.json, loaded at start, and the jobs a dead
// hostd left running or queued put back (see host_core.h).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "hostd/admission/admission.h"
#include "hostd/core/host_core.h"
#include "hostd/core/host_core_internal.h"
#include "shm/process_liveness.h"

namespace slidedp::hostd {

void HostCore::PersistLocked(const JobRecord& rec) {
  if (options_.state_dir.empty()) return;
  std::string json;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(rec.job, &json, o).ok()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path dir = fs::path(options_.state_dir) / "jobs";
  fs::create_directories(dir, ec);
  fs::path tmp = dir / (rec.job.job_id() + ".json.tmp");
  {
    std::ofstream out(tmp);
    out << json << "\n";
    if (!out) {
      LOG(WARNING) << "cannot write job record " << tmp;
      return;
    }
  }
  fs::rename(tmp, dir / (rec.job.job_id() + ".json"), ec);  // atomic: a reader sees old or new
}

void HostCore::LoadPersisted() {
  if (options_.state_dir.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::pair<int64_t, v1::Job>> loaded;
  for (const auto& e : fs::directory_iterator(fs::path(options_.state_dir) / "jobs", ec)) {
    if (e.path().extension() != ".json") continue;
    absl::StatusOr<std::string> text = ReadSmallFile(e.path().string(), kMaxConfigFileBytes, "job record");
    v1::Job job;
    if (!text.ok() || !google::protobuf::util::JsonStringToMessage(*text, &job).ok() || job.job_id().empty()) {
      LOG(WARNING) << "ignoring unreadable job record " << e.path();
      continue;
    }
    loaded.emplace_back(job.submit_time_unix_ms(), std::move(job));
  }
  std::sort(loaded.begin(), loaded.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  absl::MutexLock l(&mu_);
  for (auto& [t, job] : loaded) {
    if (jobs_.count(job.job_id())) continue;
    auto rec = std::make_unique<JobRecord>();
    auto spec = JobSpec::Parse(job.resolved_spec_yaml(), "", JobSpec::FileCheck::kSkip);
    if (spec.ok()) rec->spec = *spec;
    if (!IsFinal(job.state())) {
      // hostd stopped while this job was queued or running. A job over nodes is not resumed by one
      // node's hostd (the other nodes' parts ended with it: it would train alone, and a node that does
      // not coordinate writes nothing): reported interrupted, resumed by a submit with --resume.
      const bool over_nodes = spec.ok() && !spec->runtime.nodes.empty();
      if (spec.ok() && !over_nodes && options_.resume_interrupted && job.hostd_restarts() < kMaxHostdRestartsPerJob) {
        ResumeInterruptedLocked(job, *spec, *rec);
      } else {
        ReportInterrupted(job, spec.ok() ? spec->output.dir : std::string());
        if (over_nodes) {
          job.set_error(absl::StrCat(job.error(), " (a job over nodes: resume it on its nodes with a submit to any of "
                                                  "them, --resume CHECKPOINT)"));
        }
      }
    }
    rec->job = job;
    rec->spec_hash = SpecHash(job.resolved_spec_yaml());
    rec->spec_size = job.resolved_spec_yaml().size();
    if (rec->resume_from.empty()) rec->resume_from = job.resume_from();
    rec->submit_ms = job.submit_time_unix_ms();
    job_order_.push_back(job.job_id());
    if (job.state() == v1::JOB_STATE_QUEUED) queue_.push_back(job.job_id());
    PersistLocked(*rec);
    jobs_[job.job_id()] = std::move(rec);
  }
}

// Reported FAILED ("interrupted") with the checkpoint it can resume from (slidedp submit
// --resume <job id>).
void HostCore::ReportInterrupted(v1::Job& job, const std::string& output_dir) {
  if (!output_dir.empty()) {
    auto latest = checkpoint::FindLatestCheckpoint(output_dir, job.job_id());
    if (latest.ok()) job.set_last_checkpoint(*latest);
  }
  job.set_error(absl::StrCat(
      "interrupted: hostd stopped while the job was ", job.state() == v1::JOB_STATE_QUEUED ? "queued" : "running",
      job.hostd_restarts() >= kMaxHostdRestartsPerJob && options_.resume_interrupted
          ? absl::StrCat(" (", job.hostd_restarts(), " hostd restarts interrupted it; not resumed again)")
          : std::string(),
      job.last_checkpoint().empty() ? "" : "; resume from " + job.last_checkpoint()));
  job.set_state(v1::JOB_STATE_FAILED);
  job.set_error_code(static_cast<int>(absl::StatusCode::kAborted));
  job.set_end_time_unix_ms(NowMs());
  LOG(WARNING) << "job " << job.job_id() << " was interrupted by a hostd restart; last checkpoint: "
               << (job.last_checkpoint().empty() ? "none" : job.last_checkpoint());
}

// Back into the queue, resuming where the dead hostd left it: from the state it left in shared
// memory when that is consistent (the executor takes the segment over now, before stale
// segments are reclaimed), else from the job's newest checkpoint, else from where it was
// submitted to start.
void HostCore::ResumeInterruptedLocked(v1::Job& job, const JobSpec& spec, JobRecord& rec) {
  const bool was_queued = job.state() == v1::JOB_STATE_QUEUED;
  job.set_hostd_restarts(job.hostd_restarts() + 1);
  // Counted on disk before anything below can fail hard (a job whose files crash hostd is
  // resumed at most kMaxHostdRestartsPerJob times, not on every start).
  rec.job = job;
  PersistLocked(rec);
  rec.resume_from = job.resume_from();
  std::string how;
  absl::StatusOr<int64_t> shm_step = executor_->AdoptInterruptedState(job.job_id(), spec);
  if (shm_step.ok()) {
    how = absl::StrCat("shared memory at step ", *shm_step);
  } else {
    const std::string why_not = absl::IsNotFound(shm_step.status()) ? std::string("no state in shared memory")
                                                                    : std::string(shm_step.status().message());
    auto latest = checkpoint::FindLatestCheckpoint(spec.output.dir, job.job_id());
    if (latest.ok()) {
      rec.resume_from = *latest;
      how = absl::StrCat("checkpoint ", *latest, " (", why_not, ")");
    } else if (!rec.resume_from.empty()) {
      how = absl::StrCat("its --resume checkpoint ", rec.resume_from, " (", why_not, "; no checkpoint of its own)");
    } else {
      how = absl::StrCat("the start (", why_not, "; no checkpoint)");
    }
  }
  job.set_recovery(how);
  job.set_state(v1::JOB_STATE_QUEUED);
  LOG(WARNING) << "job " << job.job_id() << " was " << (was_queued ? "queued" : "running")
               << " when hostd stopped; queued again, resuming from " << how;
}

}  // namespace slidedp::hostd
