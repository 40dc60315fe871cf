// What HostCore's files share (host_core.cc: jobs, queue, runner; host_core_records.cc: job records
// on disk and jobs a dead hostd left; host_core_workers.cc: worker sessions and the node): the job
// record and small helpers. Internal to hostd/core.
#pragma once

#include <cctype>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "common/jobspec/job_spec.h"
#include "hostd/core/host_core.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::hostd {

inline int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// A job id: 1-64 of [A-Za-z0-9_-] (it names shm segments and record files).
inline bool ValidJobId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')) return false;
  }
  return true;
}

inline size_t SpecHash(const std::string& text) { return std::hash<std::string>()(text); }

struct HostCore::JobRecord {
  v1::Job job;
  JobSpec spec;
  // The submitted text's hash and size (a resubmit with the same id must bring the same text):
  // a spec may be 1 MiB of comments, which hostd need not keep for every job it remembers.
  size_t spec_hash = 0;
  size_t spec_size = 0;
  std::string resume_from;
  bool cancel = false;
  bool checkpoint_on_cancel = false;  // hostd draining with a checkpoint, or CancelJob's save_checkpoint
  int restarts = 0;
  // The run's means (Job.mean_tokens_per_s, mean_mfu): tokens and seconds of this job's steps.
  double run_tokens = 0, run_seconds = 0, mfu_sum = 0;
  int64_t mfu_steps = 0;
  std::vector<std::shared_ptr<Channel<v1::JobEvent>>> watchers;
  int64_t submit_ms = 0;
  // A job over several nodes: its nodes (also registered with the mesh while it is pending), and
  // what another node said when its part ended (this node's then stops).
  std::optional<JobNodes> nodes;
  absl::Status peer_abort;
};

}  // namespace slidedp::hostd
