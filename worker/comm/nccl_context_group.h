// NcclContextGroup: context parallelism's keys and values over NCCL, for CUDA workers whose job has
// a communicator (hostd then sends no context segment): one communicator per group, split from
// the job's. Each collective runs on the compute stream and is waited for here with the job's
// timeout and abort word, so a peer that died aborts the communicator instead of hanging the stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shm/futex.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/compute/backend.h"

namespace slidedp {

class NcclContextGroup final : public ContextGroup {
 public:
  // Splits `world` (every rank of it calls this, in the same order as its other collectives):
  // the ranks of context group `group`, ranked by `rank` in it.
  static absl::StatusOr<std::unique_ptr<NcclContextGroup>> Create(NcclCommunicator& world, int device, int group,
                                                                  int rank, absl::Duration timeout,
                                                                  const shm::AbortWord* abort);
  ~NcclContextGroup() override;

  int ranks() const override { return comm_->world(); }
  // Host buffers: UNIMPLEMENTED (the group has device collectives only).
  absl::Status AllGather(const float*, int64_t, float*) override;
  absl::Status ReduceScatter(float*, int64_t) override;
  bool device_collectives() const override { return true; }
  absl::Status AllGatherDevice(const void* local, int64_t bytes, void* out, void* stream) override;
  absl::Status ReduceScatterDeviceF32(float* buf, int64_t shard_numel, void* stream) override;

 private:
  NcclContextGroup(std::unique_ptr<NcclCommunicator> comm, absl::Duration timeout, const shm::AbortWord* abort)
      : comm_(std::move(comm)), timeout_(timeout), abort_(abort) {}
  // Waits for the collective `issued` queued on `stream`; on a failure aborts the communicator.
  absl::Status Waited(absl::Status issued, void* stream);

  std::unique_ptr<NcclCommunicator> comm_;
  absl::Duration timeout_;
  const shm::AbortWord* abort_;
  cudaEvent_t done_ = nullptr;
};

}  // namespace slidedp
