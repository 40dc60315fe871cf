// UrgentCopyMark: raise now, lower from the copy stream's host callback.
#include "worker/pipeline/urgent_copy.h"

#include "shm/futex.h"
#include "worker/kernels/cuda_check.h"

namespace slidedp {
namespace {

void CUDART_CB LowerFromStream(void* word) { LowerUrgentCopy(static_cast<std::atomic<uint32_t>*>(word)); }

}  // namespace

void LowerUrgentCopy(std::atomic<uint32_t>* word) {
  if (word->fetch_sub(1, std::memory_order_release) == 1) shm::FutexWakeAll(word);
}

UrgentCopyMark::UrgentCopyMark(std::atomic<uint32_t>* word) : word_(word) {
  if (word_ != nullptr) word_->fetch_add(1, std::memory_order_relaxed);
}

UrgentCopyMark::~UrgentCopyMark() {
  if (word_ != nullptr) LowerUrgentCopy(word_);
}

absl::Status UrgentCopyMark::LowerAfter(cudaStream_t stream) {
  if (word_ == nullptr) return absl::OkStatus();
  std::atomic<uint32_t>* word = word_;
  word_ = nullptr;
  if (cudaError_t e = cudaLaunchHostFunc(stream, LowerFromStream, word); e != cudaSuccess) {
    LowerUrgentCopy(word);
    return cuda_internal::CudaErrorStatus(e, "cudaLaunchHostFunc(LowerUrgentCopy)", __FILE__, __LINE__);
  }
  return absl::OkStatus();
}

}  // namespace slidedp
