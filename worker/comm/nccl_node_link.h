// The cross-node link of a CUDA worker (common/collective/node_link.h): one NCCL communicator of
// the ranks of one local index, one per node (NCCL picks IB/RoCE or sockets between the nodes),
// over device buffers. Every call only queues work on the link's stream (set_stream: the stream
// the gradient's earlier work is on), so ChainReduce's steps run in order on the GPU while the
// worker's thread goes on. Node 0 makes the NCCL unique id and sets it in the job's rendezvous store.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/collective/key_value_store.h"
#include "common/collective/node_link.h"
#include "worker/comm/nccl_communicator.h"

namespace slidedp {

class NcclNodeLink final : public NodeLink {
 public:
  // Joins the link of `group` (a name unique to the job, attempt and local rank) as `node` of `nodes`.
  static absl::StatusOr<std::unique_ptr<NcclNodeLink>> Join(int device, int node, int nodes, const std::string& group,
                                                            KeyValueStore& store, absl::Duration timeout);

  int node() const override { return comm_->rank(); }
  int nodes() const override { return comm_->world(); }
  absl::Status Send(const float* data, int64_t n, int to_node) override;
  absl::Status Recv(float* data, int64_t n, int from_node) override;
  absl::Status Broadcast(float* data, int64_t n, int root) override;
  absl::Status AllGather(const float* mine, int64_t n, float* out) override;

  // Where the calls above queue their work (the gradient path's reduction stream).
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  // The link's own stream (for a part no reduce-scatter stream precedes).
  cudaStream_t own_stream() const { return comm_->stream(); }
  void Abort() { comm_->Abort(); }

 private:
  explicit NcclNodeLink(std::unique_ptr<NcclCommunicator> comm) : comm_(std::move(comm)), stream_(comm_->stream()) {}
  std::unique_ptr<NcclCommunicator> comm_;
  cudaStream_t stream_;
};

}  // namespace slidedp
