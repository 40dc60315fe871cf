// ShmContextGroup: context parallelism's keys and values (runtime.context_parallel) through the
// job's "ctx" shared-memory collective (shm/shm_collective.h), which hostd creates for the job; any
// worker, CPU or CUDA (a CUDA backend stages its buffers through host memory for it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shm/futex.h"
#include "shm/shm_collective.h"
#include "worker/compute/backend.h"

namespace slidedp {

class ShmContextGroup final : public ContextGroup {
 public:
  // Maps the collective `segment` as `rank` of its group; every wait gives up after `timeout` or when
  // `abort` (the job's abort word) is raised.
  static absl::StatusOr<std::unique_ptr<ShmContextGroup>> Attach(const std::string& segment, int rank,
                                                                 const shm::AbortWord* abort, absl::Duration timeout);
  ShmContextGroup(std::unique_ptr<shm::ShmCollective> coll, absl::Duration timeout)
      : coll_(std::move(coll)), timeout_(timeout) {}

  int ranks() const override { return coll_->world(); }
  absl::Status AllGather(const float* local, int64_t numel, float* out) override;
  absl::Status ReduceScatter(float* buf, int64_t shard_numel) override;

 private:
  std::unique_ptr<shm::ShmCollective> coll_;
  absl::Duration timeout_;
};

}  // namespace slidedp
