// Device memory of the CUDA backend, all stream-ordered on its compute stream: the DeviceBuffer it
// hands out, a pool block freed when it goes out of scope, and the carver that cuts one block into
// 256-byte aligned pieces (a layer's activations, a step's scratch). Internal to
// worker/compute/cuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <source_location>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"
#include "worker/compute/backend.h"
#include "worker/compute/cuda/memory_ledger.h"
#include "worker/kernels/cuda_check.h"

namespace slidedp::cuda_backend_internal {

inline int64_t Align256(int64_t b) { return (b + 255) / 256 * 256; }

// A stream-ordered allocation on the compute stream (cudaMallocAsync from the device pool, which
// keeps freed memory cached): neither allocating nor freeing synchronizes the device, so the
// pipeline's copy and communication streams keep running while buffers come and go. Only the
// compute stream may use it (it is freed in that stream's order).
class CudaBuffer final : public DeviceBuffer {
 public:
  CudaBuffer(void* p, int64_t bytes, cudaStream_t stream) : p_(p), bytes_(bytes), stream_(stream) {}
  ~CudaBuffer() override {
    if (p_ == nullptr) return;
    if (MemoryLedger* ledger = MemoryLedger::Get()) ledger->Remove(p_);
    cudaFreeAsync(p_, stream_);
  }
  void* data() override { return p_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* p_;
  int64_t bytes_;
  cudaStream_t stream_;
};

// A stream-ordered allocation from the device pool, freed (stream-ordered) when destroyed.
// cudaMallocAsync on the device's current pool; when the pool cannot map the block (its cached
// free memory lies in pieces too small for it: a long sequence's backward asks for more at once
// than the forward's freed blocks hold), the stream is synchronized, the pool's unused memory
// released (cudaMemPoolTrimTo) and the allocation tried once more. An error is left cleared.
inline cudaError_t MallocAsyncOrTrim(void** p, int64_t bytes, cudaStream_t stream) {
  cudaError_t e = cudaMallocAsync(p, static_cast<size_t>(bytes), stream);
  if (e != cudaErrorMemoryAllocation) return e;
  cudaGetLastError();
  int device = 0;
  cudaMemPool_t pool = nullptr;
  if (cudaStreamSynchronize(stream) == cudaSuccess && cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetMemPool(&pool, device) == cudaSuccess && cudaMemPoolTrimTo(pool, 0) == cudaSuccess) {
    e = cudaMallocAsync(p, static_cast<size_t>(bytes), stream);
  }
  if (e != cudaSuccess) cudaGetLastError();
  return e;
}

// "; memory ledger: ..." (what was live at the backend's peak) under SLIDEDP_GPU_MEMORY_LEDGER=1,
// for out-of-memory errors; else empty.
inline std::string LedgerNote() {
  MemoryLedger* ledger = MemoryLedger::Get();
  return ledger != nullptr ? "; memory ledger: " + ledger->TakePeakReport() : std::string();
}

class PoolBlock {
 public:
  PoolBlock() = default;
  PoolBlock(const PoolBlock&) = delete;
  PoolBlock& operator=(const PoolBlock&) = delete;
  ~PoolBlock() { Release(); }
  // `site` names the allocating line in the memory ledger (SLIDEDP_GPU_MEMORY_LEDGER).
  absl::Status Alloc(int64_t bytes, cudaStream_t stream,
                     const std::source_location& site = std::source_location::current()) {
    Release();
    stream_ = stream;
    bytes_ = bytes;
    if (bytes == 0) return absl::OkStatus();
    cudaError_t e = MallocAsyncOrTrim(&p_, bytes, stream);
    if (e == cudaErrorMemoryAllocation) {
      // The error users meet when a batch or activation policy does not fit: give the numbers.
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      p_ = nullptr;
      return absl::ResourceExhaustedError(
          absl::StrFormat("GPU memory exhausted: needed %.2f GiB more, %.2f GiB free of %.2f GiB; "
                          "lower the tokens per step per worker (train.global_batch), raise runtime.offload_ratio, or "
                          "use runtime.act_policy: recompute or a smaller train.micro_batch%s",
                          bytes / 1073741824.0, free_bytes / 1073741824.0, total_bytes / 1073741824.0, LedgerNote()));
    }
    SLIDEDP_CUDA_RETURN_IF_ERROR(e);
    if (MemoryLedger* ledger = MemoryLedger::Get()) ledger->Add(p_, bytes, site);
    return absl::OkStatus();
  }
  void Release() {
    if (p_ == nullptr) return;
    if (MemoryLedger* ledger = MemoryLedger::Get()) ledger->Remove(p_);
    cudaFreeAsync(p_, stream_);
    p_ = nullptr;
  }
  char* get() const { return static_cast<char*>(p_); }
  int64_t bytes() const { return bytes_; }
  // The allocation as a buffer the caller owns (freed stream-ordered when it goes); this block is
  // left empty.
  std::unique_ptr<DeviceBuffer> TakeBuffer() {
    auto out = std::make_unique<CudaBuffer>(p_, bytes_, stream_);
    p_ = nullptr;
    bytes_ = 0;
    return out;
  }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int64_t bytes_ = 0;
};

// Carves 256-byte aligned pieces out of one PoolBlock: first Reserve() every piece, then Alloc().
class Carver {
 public:
  template <typename T>
  void Reserve(T** slot, int64_t numel) {
    pieces_.push_back({reinterpret_cast<void**>(slot), offset_});
    offset_ += Align256(numel * static_cast<int64_t>(sizeof(T)));
  }
  // An untyped piece (activations whose dtype depends on the residual mode).
  void ReserveBytes(void** slot, int64_t bytes) {
    pieces_.push_back({slot, offset_});
    offset_ += Align256(bytes);
  }
  absl::Status Alloc(PoolBlock& block, cudaStream_t stream,
                     const std::source_location& site = std::source_location::current()) {
    RETURN_IF_ERROR(block.Alloc(offset_, stream, site));
    for (auto& p : pieces_) *p.slot = block.get() + p.offset;
    return absl::OkStatus();
  }
  int64_t bytes() const { return offset_; }

 private:
  struct Piece {
    void** slot;
    int64_t offset;
  };
  std::vector<Piece> pieces_;
  int64_t offset_ = 0;
};

}  // namespace slidedp::cuda_backend_internal
