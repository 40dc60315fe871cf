// CudaActivationStore: D2H after forward, H2D one layer ahead of backward, on one copy stream
// ordered against the compute stream by events. A device copy is freed in the compute stream's
// order after its D2H: as soon as the D2H is seen finished, else when more than kInTransit units'
// copies wait (the compute stream then waits for the oldest D2H, which has run beside the layers
// since), and all of them when the backward begins. The host thread runs ahead of the GPU (at a
// long sequence, layers ahead), so waiting only for copies already seen finished kept the last
// offloaded layers' copies on the device through the whole backward of the resident layers
// (S26a: 5 layers, 20 GiB, at Qwen3-8B 256K).
#include "worker/pipeline/cuda_activation_store.h"

#include <cmath>
#include <deque>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/kernels/cuda_check.h"
#include "worker/pipeline/cuda_copy_timer.h"

namespace slidedp {
namespace {

struct PinnedBlock {
  void* data = nullptr;
  int64_t bytes = 0;
};

class CudaActivationStore final : public ActivationStore {
 public:
  CudaActivationStore(ComputeBackend* backend, std::vector<double> offloaded)
      : backend_(backend),
        offloaded_(std::move(offloaded)),
        compute_(static_cast<cudaStream_t>(backend->native_stream())) {}

  ~CudaActivationStore() override {
    if (copy_) cudaStreamSynchronize(copy_);
    pending_free_.clear();
    restored_.clear();
    for (auto& [u, unit] : host_) {
      for (PinnedBlock& b : unit.blocks) cudaFreeHost(b.data);
    }
    for (auto& [u, ev] : events_) cudaEventDestroy(ev);
    if (copy_) cudaStreamDestroy(copy_);
  }

  absl::Status Init(int device) {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
    return absl::OkStatus();
  }

  double ratio(int unit) const override {
    return unit >= 0 && unit < static_cast<int>(offloaded_.size()) ? offloaded_[unit] : 0.0;
  }

  absl::Status Reserve(int unit, const std::vector<CheckpointBytes>& checkpoints) override {
    const int k = OffloadedCheckpoints(ratio(unit), static_cast<int>(checkpoints.size()));
    std::vector<int64_t> sizes;
    for (int i = 0; i < k; ++i) {
      sizes.push_back(checkpoints[i].input);
      if (checkpoints[i].kept > 0) sizes.push_back(checkpoints[i].kept);
    }
    std::vector<PinnedBlock>& blocks = host_[unit].blocks;
    if (blocks.size() < sizes.size()) blocks.resize(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) RETURN_IF_ERROR(Pin(blocks[i], sizes[i]));
    return absl::OkStatus();
  }

  absl::Status Offload(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                       std::vector<std::unique_ptr<SavedActivations>>& saved) override {
    RETURN_IF_ERROR(FreeFinished(/*all=*/false));
    MovedCheckpoints moved =
        TakeCheckpoints(OffloadedCheckpoints(ratio(unit), static_cast<int>(inputs.size())), inputs, saved);
    ASSIGN_OR_RETURN(cudaEvent_t ev, Event(unit));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, compute_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_, ev, 0));
    Unit& h = host_[unit];
    if (h.blocks.size() < moved.buffers.size()) h.blocks.resize(moved.buffers.size());
    h.has_kept = std::move(moved.has_kept);
    h.sizes.clear();
    RETURN_IF_ERROR(timer_.Begin(copy_));
    for (size_t i = 0; i < moved.buffers.size(); ++i) {
      const int64_t bytes = moved.buffers[i]->bytes();
      RETURN_IF_ERROR(Pin(h.blocks[i], bytes));
      SLIDEDP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(h.blocks[i].data, moved.buffers[i]->data(), bytes, cudaMemcpyDeviceToHost, copy_));
      h.sizes.push_back(bytes);
    }
    RETURN_IF_ERROR(timer_.End(copy_));
    cudaEvent_t done;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(done, copy_));
    pending_free_.push_back(Pending{done, std::move(moved.buffers)});
    while (pending_free_.size() > kInTransit) RETURN_IF_ERROR(FreeOldest());
    return absl::OkStatus();
  }

  absl::Status Prefetch(int unit) override {
    // The backward has begun (Prefetch follows the head and each layer's backward): no offload
    // copy is needed on the device any more.
    RETURN_IF_ERROR(FreeFinished(/*all=*/true));
    if (!offloads(unit) || restored_.count(unit)) return absl::OkStatus();
    auto it = host_.find(unit);
    if (it == host_.end() || it->second.has_kept.empty()) {
      return absl::InternalError(absl::StrCat("the checkpoints of unit ", unit, " were never offloaded"));
    }
    Unit& h = it->second;
    Restored r;
    r.has_kept = std::move(h.has_kept);
    h.has_kept.clear();
    for (int64_t bytes : h.sizes) {
      ASSIGN_OR_RETURN(auto b, backend_->Allocate(bytes));  // ordered on the compute stream
      r.buffers.push_back(std::move(b));
    }
    ASSIGN_OR_RETURN(cudaEvent_t ev, Event(unit));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, compute_));  // the allocations exist from here
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_, ev, 0));
    for (size_t i = 0; i < r.buffers.size(); ++i) {
      SLIDEDP_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(r.buffers[i]->data(), h.blocks[i].data, h.sizes[i], cudaMemcpyHostToDevice, copy_));
    }
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, copy_));
    restored_[unit] = std::move(r);
    return absl::OkStatus();
  }

  absl::Status Restore(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                       std::vector<std::unique_ptr<SavedActivations>>& saved) override {
    RETURN_IF_ERROR(Prefetch(unit));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, events_[unit], 0));
    Restored r = std::move(restored_[unit]);
    restored_.erase(unit);
    // (Prefetch, above, has freed every offload copy: none waits in the backward.)
    return PutCheckpoints(r.has_kept, std::move(r.buffers), inputs, saved);
  }

  int64_t host_bytes() const override { return host_bytes_; }
  double copy_s() const override { return timer_.busy_s(); }

 private:
  struct Pending {
    cudaEvent_t done;
    std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  };
  // A unit's pinned blocks, in TakeCheckpoints' order, and what its last offload put there.
  struct Unit {
    std::vector<PinnedBlock> blocks;
    std::vector<int64_t> sizes;
    std::vector<bool> has_kept;  // empty: nothing waiting
  };
  struct Restored {
    std::vector<bool> has_kept;
    std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  };

  absl::StatusOr<cudaEvent_t> Event(int unit) {
    auto it = events_.find(unit);
    if (it != events_.end()) return it->second;
    cudaEvent_t ev;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    events_[unit] = ev;
    return ev;
  }

  // Makes `b` hold at least `bytes` of pinned host memory.
  absl::Status Pin(PinnedBlock& b, int64_t bytes) {
    if (b.bytes >= bytes) return absl::OkStatus();
    if (b.data) {
      cudaFreeHost(b.data);
      host_bytes_ -= b.bytes;
    }
    b = PinnedBlock{};
    cudaError_t e = cudaMallocHost(&b.data, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      b.data = nullptr;
      return absl::ResourceExhaustedError(absl::StrCat("activation offload: pinning ", bytes,
                                                       " bytes of host memory failed (", cudaGetErrorString(e),
                                                       "); offload less (runtime.offload_ratio or the "
                                                       "layout's offload shares)"));
    }
    b.bytes = bytes;
    host_bytes_ += bytes;
    return absl::OkStatus();
  }

  // Frees the device copies whose D2H has finished (all: every one, after its D2H in the compute
  // stream's order). Neither blocks the host.
  absl::Status FreeFinished(bool all) {
    while (!pending_free_.empty()) {
      if (!all && cudaEventQuery(pending_free_.front().done) != cudaSuccess) break;
      RETURN_IF_ERROR(FreeOldest());
    }
    return absl::OkStatus();
  }
  // The oldest waiting device copy, freed after its D2H in the compute stream's order (the
  // compute stream waits for the D2H if it is still running).
  absl::Status FreeOldest() {
    Pending& p = pending_free_.front();
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, p.done, 0));
    p.buffers.clear();
    cudaEventDestroy(p.done);
    pending_free_.pop_front();
    return absl::OkStatus();
  }

  // Offloaded units whose device copies may wait for their D2H at once, in the forward.
  static constexpr size_t kInTransit = 2;

  ComputeBackend* backend_;
  std::vector<double> offloaded_;  // per unit
  cudaStream_t compute_;
  cudaStream_t copy_ = nullptr;
  std::map<int, Unit> host_;
  std::map<int, cudaEvent_t> events_;
  std::map<int, Restored> restored_;
  std::deque<Pending> pending_free_;
  int64_t host_bytes_ = 0;
  CudaCopyTimer timer_;  // D2H spans (offload copies)
};

}  // namespace

absl::StatusOr<std::unique_ptr<ActivationStore>> MakeCudaActivationStore(const ModelLayout& layout,
                                                                         ComputeBackend* backend, double ratio,
                                                                         int device) {
  return MakeCudaActivationStore(backend, OffloadedUnits(layout, ratio), device);
}

absl::StatusOr<std::unique_ptr<ActivationStore>> MakeCudaActivationStore(ComputeBackend* backend,
                                                                         std::vector<double> offloaded, int device) {
  auto store = std::make_unique<CudaActivationStore>(backend, std::move(offloaded));
  RETURN_IF_ERROR(store->Init(device));
  return std::unique_ptr<ActivationStore>(std::move(store));
}

absl::StatusOr<CopyRates> MeasurePinnedCopyRates(int device, int64_t bytes) {
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void* host = nullptr;
  void* dev = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr;
  auto release = [&]() {
    if (stream) cudaStreamSynchronize(stream);
    if (host) cudaFreeHost(host);
    if (dev) cudaFree(dev);
    if (begin) cudaEventDestroy(begin);
    if (end) cudaEventDestroy(end);
    if (stream) cudaStreamDestroy(stream);
  };
  auto measure = [&]() -> absl::StatusOr<CopyRates> {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, bytes));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&dev, bytes));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&begin));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&end));
    CopyRates rates;
    for (cudaMemcpyKind kind : {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost}) {
      float best_ms = 0;
      for (int r = 0; r < 4; ++r) {  // the first warms the path
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(begin, stream));
        SLIDEDP_CUDA_RETURN_IF_ERROR(kind == cudaMemcpyHostToDevice
                                         ? cudaMemcpyAsync(dev, host, bytes, kind, stream)
                                         : cudaMemcpyAsync(host, dev, bytes, kind, stream));
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(end, stream));
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(end));
        float ms = 0;
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, begin, end));
        if (r > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
      }
      const double rate = best_ms > 0 ? static_cast<double>(bytes) / (best_ms / 1e3) : 0;
      (kind == cudaMemcpyHostToDevice ? rates.h2d_bytes_per_s : rates.d2h_bytes_per_s) = rate;
    }
    return rates;
  };
  absl::StatusOr<CopyRates> out = measure();
  release();
  return out;
}

}  // namespace slidedp
