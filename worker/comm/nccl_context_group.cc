#include "worker/comm/nccl_context_group.h"

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp {
namespace {

absl::Status CudaOk(cudaError_t e) {
  return e == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(e));
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclContextGroup>> NcclContextGroup::Create(NcclCommunicator& world, int device,
                                                                           int group, int rank, absl::Duration timeout,
                                                                           const shm::AbortWord* abort) {
  ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> comm,
                   world.Split(device, group, rank, absl::StrCat("context group ", group)));
  std::unique_ptr<NcclContextGroup> g(new NcclContextGroup(std::move(comm), timeout, abort));
  RETURN_IF_ERROR(CudaOk(cudaEventCreateWithFlags(&g->done_, cudaEventDisableTiming)));
  return g;
}

NcclContextGroup::~NcclContextGroup() {
  if (done_ != nullptr) cudaEventDestroy(done_);
}

absl::Status NcclContextGroup::AllGather(const float*, int64_t, float*) {
  return absl::UnimplementedError("NCCL context group: host buffers (device collectives only)");
}

absl::Status NcclContextGroup::ReduceScatter(float*, int64_t) {
  return absl::UnimplementedError("NCCL context group: host buffers (device collectives only)");
}

absl::Status NcclContextGroup::AllGatherDevice(const void* local, int64_t bytes, void* out, void* stream) {
  return Waited(comm_->AllGatherBytesOn(local, bytes, out, static_cast<cudaStream_t>(stream)), stream);
}

absl::Status NcclContextGroup::ReduceScatterDeviceF32(float* buf, int64_t shard_numel, void* stream) {
  return Waited(comm_->ReduceScatterF32On(buf, shard_numel, static_cast<cudaStream_t>(stream)), stream);
}

absl::Status NcclContextGroup::Waited(absl::Status issued, void* stream) {
  absl::Status s = issued;
  if (s.ok()) s = CudaOk(cudaEventRecord(done_, static_cast<cudaStream_t>(stream)));
  if (s.ok()) {
    s = WaitEvent(done_, timeout_, [this] { return abort_ != nullptr ? abort_->ToStatus() : absl::OkStatus(); });
  }
  if (!s.ok()) {
    comm_->Abort();  // peers may be stuck in this collective: release them and this stream
    return Annotate(s, "context-parallel collective");
  }
  return s;
}

}  // namespace slidedp
