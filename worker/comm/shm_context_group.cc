#include "worker/comm/shm_context_group.h"

#include "common/status/status_macros.h"

namespace slidedp {

absl::StatusOr<std::unique_ptr<ShmContextGroup>> ShmContextGroup::Attach(const std::string& segment, int rank,
                                                                         const shm::AbortWord* abort,
                                                                         absl::Duration timeout) {
  ASSIGN_OR_RETURN(std::unique_ptr<shm::ShmCollective> coll, shm::ShmCollective::Attach(segment, rank, abort));
  return std::make_unique<ShmContextGroup>(std::move(coll), timeout);
}

absl::Status ShmContextGroup::AllGather(const float* local, int64_t numel, float* out) {
  return coll_->AllGatherF32(local, numel, out, timeout_);
}

absl::Status ShmContextGroup::ReduceScatter(float* buf, int64_t shard_numel) {
  return coll_->ReduceScatterF32(buf, shard_numel, timeout_);
}

}  // namespace slidedp
