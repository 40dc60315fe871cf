// UrgentCopyMark: marks host-to-device copies that the GPU is waiting for ("DMA before Adam",
// docs/layeradam.md). It raises the rank's urgent-copy word in the job's control block
// (shm::JobControlBlock::urgent_copies) before the copies are issued and lowers it from the copy
// stream once they are done (cudaLaunchHostFunc), so hostd's LayerAdam pauses some of its workers
// exactly while those copies need the host's memory bandwidth. Raising increments and lowering
// decrements, so overlapping urgent copies nest; lowering to zero FUTEX_WAKEs the paused workers.
// Used by CudaWindowStreamer and bench_copy.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"

namespace slidedp {

// Decrements `word` (release) and, at zero, wakes its futex waiters. What the stream callback
// runs: no CUDA call, no lock, no allocation.
void LowerUrgentCopy(std::atomic<uint32_t>* word);

class UrgentCopyMark {
 public:
  // Raises `word` now; null marks nothing (every call is then a no-op).
  explicit UrgentCopyMark(std::atomic<uint32_t>* word);
  // Lowers the word now unless LowerAfter handed it to a stream: an error between raising and
  // queueing the copies never leaves it raised.
  ~UrgentCopyMark();
  UrgentCopyMark(const UrgentCopyMark&) = delete;
  UrgentCopyMark& operator=(const UrgentCopyMark&) = delete;

  // Lowers the word from `stream` once everything queued on it so far has run. The stream's
  // later work waits for the (tiny) callback. On failure the word is lowered now.
  absl::Status LowerAfter(cudaStream_t stream);

 private:
  std::atomic<uint32_t>* word_;
};

}  // namespace slidedp
