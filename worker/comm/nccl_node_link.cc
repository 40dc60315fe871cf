#include "worker/comm/nccl_node_link.h"

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp {

absl::StatusOr<std::unique_ptr<NcclNodeLink>> NcclNodeLink::Join(int device, int node, int nodes,
                                                                  const std::string& group, KeyValueStore& store,
                                                                  absl::Duration timeout) {
  const std::string key = absl::StrCat(group, "/nccl-unique-id");
  std::string id;
  if (node == 0) {
    ASSIGN_OR_RETURN(id, NcclCommunicator::NewUniqueId());
    RETURN_IF_ERROR(store.Set(key, id));
  } else {
    ASSIGN_OR_RETURN(id, store.Get(key, timeout));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> comm, NcclCommunicator::Create(device, id, node, nodes, group));
  return std::unique_ptr<NcclNodeLink>(new NcclNodeLink(std::move(comm)));
}

absl::Status NcclNodeLink::Send(const float* data, int64_t n, int to_node) {
  return comm_->SendF32On(data, n, to_node, stream_);
}

absl::Status NcclNodeLink::Recv(float* data, int64_t n, int from_node) {
  return comm_->RecvF32On(data, n, from_node, stream_);
}

absl::Status NcclNodeLink::AllGather(const float* mine, int64_t n, float* out) {
  return comm_->AllGatherBytesOn(mine, n * static_cast<int64_t>(sizeof(float)), out, stream_);
}

absl::Status NcclNodeLink::Broadcast(float* data, int64_t n, int root) {
  return comm_->BroadcastF32On(data, n, root, stream_);
}

}  // namespace slidedp
