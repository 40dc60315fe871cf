// NcclCommunicator: communicator lifetime and the two in-place collectives of the pipeline.
#include "worker/comm/nccl_communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace slidedp {
namespace {

absl::Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  const absl::StatusCode code =
      (r == ncclSystemError || r == ncclRemoteError) ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", ncclGetErrorString(r), " (", ncclGetLastError(nullptr), ")"));
}

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

}  // namespace

absl::StatusOr<std::string> NcclCommunicator::NewUniqueId() {
  ncclUniqueId id;
  absl::Status s = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId");
  if (!s.ok()) return s;
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(int device, const std::string& unique_id,
                                                                           int rank, int world, std::string key) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL unique id of ", unique_id.size(), " bytes, expected ", sizeof(id.internal)));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->rank_ = rank;
  c->world_ = world;
  c->key_ = std::move(key);
  absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  if (s.ok()) s = CudaStatus(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  if (!s.ok()) return s;
  const absl::Time t0 = absl::Now();
  s = NcclStatus(ncclCommInitRank(&c->comm_, world, id, rank), "ncclCommInitRank");
  if (!s.ok()) return s;
  LOG(INFO) << "NCCL communicator: rank " << rank << " of " << world << " on GPU " << device << " in "
            << absl::FormatDuration(absl::Now() - t0);
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) {
    if (broken_) {
      ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void NcclCommunicator::Abort() {
  if (comm_ != nullptr && !broken_) {
    broken_ = true;
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

absl::Status NcclCommunicator::ReduceScatterF32(float* buf, int64_t shard_numel, cudaEvent_t after) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  absl::Status s = CudaStatus(cudaStreamWaitEvent(stream_, after, 0), "cudaStreamWaitEvent");
  if (!s.ok()) return s;
  return NcclStatus(ncclReduceScatter(buf, buf + static_cast<int64_t>(rank_) * shard_numel,
                                      static_cast<size_t>(shard_numel), ncclFloat32, ncclSum, comm_, stream_),
                    "ncclReduceScatter");
}

absl::Status NcclCommunicator::AllGatherBF16(bf16_t* buf, int64_t shard_numel, cudaEvent_t after) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  absl::Status s = CudaStatus(cudaStreamWaitEvent(stream_, after, 0), "cudaStreamWaitEvent");
  if (!s.ok()) return s;
  return NcclStatus(ncclAllGather(buf + static_cast<int64_t>(rank_) * shard_numel, buf,
                                  static_cast<size_t>(shard_numel), ncclBfloat16, comm_, stream_),
                    "ncclAllGather");
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Split(int device, int color, int key,
                                                                          std::string name) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->key_ = std::move(name);
  absl::Status s = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  if (s.ok()) s = CudaStatus(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  if (s.ok()) s = NcclStatus(ncclCommSplit(comm_, color, key, &c->comm_, nullptr), "ncclCommSplit");
  if (s.ok()) s = NcclStatus(ncclCommUserRank(c->comm_, &c->rank_), "ncclCommUserRank");
  if (s.ok()) s = NcclStatus(ncclCommCount(c->comm_, &c->world_), "ncclCommCount");
  if (!s.ok()) return s;
  LOG(INFO) << "NCCL communicator " << c->key_ << ": rank " << c->rank_ << " of " << c->world_ << " (split from "
            << world_ << ")";
  return c;
}

absl::Status NcclCommunicator::AllGatherBytesOn(const void* local, int64_t bytes, void* out, cudaStream_t on) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  return NcclStatus(ncclAllGather(local, out, static_cast<size_t>(bytes), ncclChar, comm_, on), "ncclAllGather");
}

absl::Status NcclCommunicator::ReduceScatterF32On(float* buf, int64_t shard_numel, cudaStream_t on) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  return NcclStatus(ncclReduceScatter(buf, buf + static_cast<int64_t>(rank_) * shard_numel,
                                      static_cast<size_t>(shard_numel), ncclFloat32, ncclSum, comm_, on),
                    "ncclReduceScatter");
}

absl::Status NcclCommunicator::SendF32On(const float* data, int64_t n, int peer, cudaStream_t on) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  return NcclStatus(ncclSend(data, static_cast<size_t>(n), ncclFloat32, peer, comm_, on), "ncclSend");
}

absl::Status NcclCommunicator::RecvF32On(float* data, int64_t n, int peer, cudaStream_t on) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  return NcclStatus(ncclRecv(data, static_cast<size_t>(n), ncclFloat32, peer, comm_, on), "ncclRecv");
}

absl::Status NcclCommunicator::BroadcastF32On(float* data, int64_t n, int root, cudaStream_t on) {
  if (broken_) return absl::AbortedError("NCCL communicator was aborted");
  return NcclStatus(ncclBroadcast(data, data, static_cast<size_t>(n), ncclFloat32, root, comm_, on), "ncclBroadcast");
}

}  // namespace slidedp
