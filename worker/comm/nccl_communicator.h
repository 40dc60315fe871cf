// NcclCommunicator: one NCCL communicator of a worker with its own communication stream, kept
// warm across jobs while the job membership stays the same (WorkerAgent compares hostd's
// membership_key). Rank 0 makes the unique id; hostd relays it to the other ranks.
//
// Every collective of a job is issued from the job's thread in the same program order on every
// rank (parameter all-gathers and gradient reduce-scatters share the one stream), which is what
// NCCL requires of collectives on one communicator.
//
// Waiting: WaitEvent() polls instead of blocking in the driver, so a job abort (a peer died,
// hostd cancelled) is seen within a millisecond; the communicator is then Abort()ed, which makes
// NCCL's kernels give up instead of spinning forever on a missing peer.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/numeric/bf16.h"

namespace slidedp {

class NcclCommunicator {
 public:
  // A fresh unique id (NCCL_UNIQUE_ID_BYTES bytes); only rank 0 calls it.
  static absl::StatusOr<std::string> NewUniqueId();
  // Joins the communicator (blocks until every rank has joined). `key` is hostd's membership key.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(int device, const std::string& unique_id, int rank,
                                                                  int world, std::string key);
  ~NcclCommunicator();

  // In place: buf holds world * shard_numel FP32 elements; afterwards its shard `rank` is the
  // sum over ranks. Queued on stream() after `after` (an event on another stream).
  absl::Status ReduceScatterF32(float* buf, int64_t shard_numel, cudaEvent_t after);
  // In place: buf holds world * shard_numel BF16 elements of which shard `rank` is filled;
  // afterwards every shard is. Queued on stream() after `after`.
  absl::Status AllGatherBF16(bf16_t* buf, int64_t shard_numel, cudaEvent_t after);
  // Makes NCCL kernels stop waiting for peers; the communicator is unusable afterwards.
  void Abort();

  // A communicator of the ranks that pass the same color, ranked by key (ncclCommSplit; every
  // rank of this one calls it, in the same order as its other collectives). Its own stream.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int device, int color, int key, std::string name);
  // On the caller's stream `on` (context parallelism, in line with compute): an all-gather of
  // `bytes` from each rank into out[rank * bytes, +bytes), and the in-place FP32 reduce-scatter.
  absl::Status AllGatherBytesOn(const void* local, int64_t bytes, void* out, cudaStream_t on);
  absl::Status ReduceScatterF32On(float* buf, int64_t shard_numel, cudaStream_t on);
  // Point to point and broadcast of n floats on `on` (the cross-node link, nccl_node_link.h).
  absl::Status SendF32On(const float* data, int64_t n, int peer, cudaStream_t on);
  absl::Status RecvF32On(float* data, int64_t n, int peer, cudaStream_t on);
  absl::Status BroadcastF32On(float* data, int64_t n, int root, cudaStream_t on);

  cudaStream_t stream() const { return stream_; }
  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::string& key() const { return key_; }
  bool broken() const { return broken_; }

 private:
  NcclCommunicator() = default;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int rank_ = 0;
  int world_ = 1;
  std::string key_;
  bool broken_ = false;
};

// Polls `event` until it completes: OK; or the status `should_stop` returns (non-OK) while
// waiting; or DEADLINE_EXCEEDED after `timeout`.
template <typename StopFn>
absl::Status WaitEvent(cudaEvent_t event, absl::Duration timeout, StopFn should_stop);

}  // namespace slidedp

#include "worker/comm/wait_event_impl.h"
