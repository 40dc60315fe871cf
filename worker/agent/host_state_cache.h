// HostStateCache: a job's mapping of its state segment and (CUDA) the registrations of its mirrors,
// kept after a job that succeeded on this worker, because hostd pools the segment for the next job
// of the same size: that job then finds it mapped and registered. The kept one is dropped when
// hostd releases the segment (HostCommand.release_host_state), when the file loses its name
// (checked every second by the "state-watch" thread: a hostd that unlinks without telling), when
// the next job uses another segment, and when the session with hostd ends.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "shm/job_state.h"
#include "worker/pipeline/job_pipeline.h"

namespace slidedp::worker {

// One job's mapping of its state segment.
struct HostState {
  std::unique_ptr<shm::JobState> js;
  std::shared_ptr<HostRegistry> registry;  // CUDA workers; destroyed (unregistered) before js unmaps
};

class HostStateCache {
 public:
  // `factory` makes the registries and the device current before they are released.
  explicit HostStateCache(PipelineFactory& factory);
  ~HostStateCache();  // stops the watcher and drops the kept mapping ("the worker stops")

  // The mapping of `segment` for a job: the kept one when it is the same file (hostd renamed the
  // pooled file for this job), else a new one (and the kept one is dropped).
  absl::StatusOr<std::unique_ptr<HostState>> Take(const std::string& segment);
  // Keeps a job's mapping for the next job (unless hostd removed the file already).
  void Keep(std::unique_ptr<HostState> hs);
  void Drop(const char* why);
  // The watcher stops within 100 ms (the worker is stopping).
  void StopWatching() { stop_ = true; }

 private:
  void Watch();

  PipelineFactory& factory_;
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::unique_ptr<HostState> cached_ ABSL_GUARDED_BY(mu_);
  std::thread watcher_;
};

}  // namespace slidedp::worker
