// HostStatePool: keeps the state segment of a job that succeeded (allocated, pre-faulted, mapped,
// registered with CUDA by its workers) for the next job, at most one at a time.
//
// Life of a segment: a job creates "/slidedp.<node>.<job>.state" (shm::JobState::Create), or
// Take()s the pooled one and Adopt()s it under its own name; when the job ends, Finish() either
// returns it to the pool (renamed "/slidedp.<node>.pool.pooled") or unlinks it. Workers keep a
// pooled segment mapped; whenever a segment they may hold goes away, they are told
// (ReleaseHostState) and hostd waits briefly for their acks, so its memory is really free before
// the next admission check. Only the job-runner thread uses the pool.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "hostd/core/host_core.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

class HostStatePool {
 public:
  using Holders = std::vector<std::shared_ptr<WorkerSession>>;

  // enabled = false: Finish() always unlinks (hostd --pool-host-state=false).
  HostStatePool(std::string node_name, bool enabled);
  ~HostStatePool();  // unlinks the pooled segment and tells its holders (no wait)
  HostStatePool(const HostStatePool&) = delete;
  HostStatePool& operator=(const HostStatePool&) = delete;

  // The pooled segment when `layout` fits it (made for the same layout, or a smaller state that
  // needs at least half of it: a tiny job should not pin a huge segment), taking it out of the
  // pool; otherwise frees the pool (its memory may be what the job needs) and returns null.
  std::unique_ptr<shm::JobState> Take(const ModelLayout& layout, const shm::StateFormat& format);
  // A segment Take() gave out that the job did not adopt (e.g. refused at admission): back into
  // the pool, under the pool's name, with its holders.
  void PutBack(std::unique_ptr<shm::JobState> js);
  // Renames a segment Take() gave out to `job_id`'s state segment and resets it for a new job
  // (control block, abort word, gates, step) by laying it out again for `layout` in place. On
  // error the segment is unlinked.
  absl::StatusOr<std::unique_ptr<shm::JobState>> Adopt(std::unique_ptr<shm::JobState> pooled, const std::string& job_id,
                                                       const ModelLayout& layout, const shm::StateFormat& format,
                                                       int prefault_threads);
  // The end of a job's segment: into the pool when `poolable` (the job succeeded and every
  // worker reported its end) and pooling is on, else unlinked. `workers`: the job's ranks; the
  // holders of an adopted pooled segment are added to them.
  void Finish(std::unique_ptr<shm::JobState> js, bool poolable, const Holders& workers);

 private:
  void ReturnToPool(std::unique_ptr<shm::JobState> js, Holders holders);
  void Discard(std::unique_ptr<shm::JobState> js, const Holders& holders);
  // Tells `holders` that a segment they may keep mapped is being removed and waits (at most a
  // few seconds) for their acks.
  static void ReleaseWorkerMappings(const Holders& holders, const std::string& segment);

  const std::string node_name_;
  const bool enabled_;
  std::unique_ptr<shm::JobState> pooled_;
  std::string pooled_name_;
  Holders pooled_holders_;  // workers that may keep the pooled segment mapped
  // The holders of the pooled segment the running job took (they may not all be its workers).
  Holders taken_holders_;
};

}  // namespace slidedp::hostd
