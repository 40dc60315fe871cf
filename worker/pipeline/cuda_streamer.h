// CudaWindowStreamer: brings units' BF16 parameters from the host mirror (shared memory,
// registered with CUDA once per job) into a bounded window of GPU slots, on its own H2D stream,
// in chunks; the compute stream waits on an event per load, and a slot is reused only after the
// compute that read it has finished (a "free" event per slot).
//
// Sharded delivery (runtime.param_delivery: sharded, with a communicator): each rank copies only
// its shard (common/model/shard.h) of the unit host-to-device, into its place in the slot, and
// an in-place NCCL all-gather on the communicator's stream fills in the rest: 1/R of the host
// link's bytes per rank, the remainder over NVLink.
//
// Without a mirror (CudaStreamerOptions::source kMaster, runtime.param_source: master) the BF16
// values are cast from the FP32 master, chunk by chunk, in one of two places (runtime.cast_on):
// - on the GPU (cast_on_device, the default): the master is registered with CUDA; each FP32 chunk
//   is copied into one of kDeviceCastBuffers device buffers on the H2D stream, and a small kernel
//   (kernels::CastF32ToBf16Exact, on a stream of its own, so the next chunk's copy overlaps it)
//   casts it into the slot. The host does no work: 4 B/param cross the link and are read from
//   host memory once per upload;
// - on the host: the loading thread casts on a CastPool of cast_threads threads into a ring of kCastBuffers
//   pinned staging buffers and queues each chunk's copy while it casts the next (a buffer is cast
//   into again only after its previous copy finished). 2 B/param cross the link; host memory
//   sees 8 B/param per upload (read 4, write 2, the DMA reads 2).
// Both give FloatToBf16's bits, the mirror's.
//
// The norm weights also come in FP32 from the master (CudaStreamerOptions::norms), and the
// embedding lookup reads the FP32 master's rows in place, mapped into the device's address space
// (CudaStreamerOptions::embedding; only the batch's rows cross the host link).
//
// Within a step a unit's copy stays valid for reuse (backward after forward, or the embedding
// for a tied head) while it is resident: it is keyed by the gate value it was loaded under.
//
// DMA before Adam (CudaStreamerOptions::urgent_rank, docs/layeradam.md): a load the GPU is about
// to wait for (the host thread waited on the unit's version gate, or the compute stream has
// nothing left queued) raises the rank's urgent-copy word for as long as its copies run, and
// hostd's LayerAdam pauses some of its workers meanwhile.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/model/node_shard.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/comm/nccl_node_link.h"
#include "worker/pipeline/cast_pool.h"
#include "worker/pipeline/cuda_copy_timer.h"
#include "worker/pipeline/host_registry.h"
#include "worker/pipeline/unit_streamer.h"

namespace slidedp {

struct CudaStreamerOptions {
  int device = 0;
  int window_slots = 3;              // GPU slots, each as large as the largest unit
  int64_t chunk_bytes = 64ll << 20;  // H2D chunk
  absl::Duration gate_timeout = absl::Minutes(10);
  NcclCommunicator* sharded_with = nullptr;  // non-null: sharded delivery over this communicator
  // Where the mirrors' registrations live: the caller's (kept after the job, for the next job on
  // the same mapping) or, when null, the streamer's own (dropped with it).
  HostRegistry* registry = nullptr;
  // Deliver each unit's FP32 norm weights too (UnitParams::fp32): after the gate the host thread
  // copies them from the master into the slot's pinned staging, and the H2D stream on into the
  // slot's FP32 part (every rank copies all of it, also with sharded delivery: a few KB).
  Dtype norms = Dtype::kF32;
  // The embedding's FP32 master, registered (mapped) with CUDA once per job: its device pointer is
  // the embedding unit's UnitParams::fp32, which the lookup kernel reads over the host link.
  Dtype embedding = Dtype::kF32;
  // The rank whose urgent-copy word (shm::JobState::urgent_copy_word) this streamer raises around
  // loads the GPU waits for; -1 (or a rank without a word): none (runtime.copy_priority 0).
  int urgent_rank = -1;
  // Where the BF16 values come from; kMaster: cast here (the segment keeps no mirror).
  UploadSource source = UploadSource::kMirror;
  bool cast_on_device = true;  // kMaster: cast on the GPU (else on cast_threads host threads)
  int cast_threads = 4;
  // runtime.node_state sharded (common/model/node_shard.h): the segment holds this node's range of each
  // sharded unit. A load copies this rank's local shard of it, all-gathers that with the same local
  // index of every node over node_link, then this node's ranks all-gather every node's range over
  // `local` (null with one rank per node); the norms' FP32 side copies come over node_link, each
  // element from its owner's master. `rank` and `world`: this rank among its node's.
  const NodeSharding* sharding = nullptr;
  NcclNodeLink* node_link = nullptr;
  NcclCommunicator* local = nullptr;
  int rank = 0;
  int world = 1;
};

class CudaWindowStreamer : public UnitStreamer {
 public:
  // Registers every unit's mirror region (in options.registry, or its own) and the ring's slots
  // (ring may be null; its own, unregistered on destruction) with CUDA and allocates the window.
  static absl::StatusOr<std::unique_ptr<CudaWindowStreamer>> Create(shm::JobState* state, shm::GradRing* ring,
                                                                    const ModelLayout& layout, cudaStream_t compute,
                                                                    const CudaStreamerOptions& options);
  ~CudaWindowStreamer() override;

  absl::StatusOr<UnitParams> Acquire(int unit, uint32_t min_version) override;
  void Release(int unit) override;
  absl::Status Prefetch(int unit, uint32_t min_version) override;
  double gate_wait_s() const override { return gate_wait_s_; }
  double h2d_s() const override { return h2d_timer_.busy_s(); }
  double cast_s() const override { return cast_s_; }
  int64_t device_bytes() const override {
    return (slot_bytes_ + fp32_bytes_) * static_cast<int64_t>(slots_.size()) + device_cast_bytes_;
  }
  static constexpr int kCastBuffers = 3;  // host cast; hostd's admission counts them (AddCastStaging)
  static constexpr int kDeviceCastBuffers = 2;
  static constexpr int kDeviceCastBlocks = 32;  // the cast kernel's grid: a quarter of an H200's SMs at most

 private:
  struct Slot {
    void* data = nullptr;
    float* fp32 = nullptr;          // the FP32 norm weights (device), fp32_bytes_
    float* fp32_staging = nullptr;  // pinned host staging for them
    cudaEvent_t staged = nullptr;   // the last H2D from fp32_staging finished
    cudaEvent_t ready = nullptr;    // H2D (and all-gather) finished
    cudaEvent_t free = nullptr;     // compute done with the previous occupant
    int unit = -1;
    uint32_t gate = 0;
    int users = 0;
    uint64_t last_use = 0;
  };
  CudaWindowStreamer() = default;
  // Issues the load of `unit` into the least recently used free slot (after its gate opens).
  absl::StatusOr<Slot*> Load(int unit, uint32_t min_version);
  Slot* Resident(int unit, uint32_t gate);
  // Queues the H2D of `numel` BF16 values cast from `master` into `dst` (kMaster), in chunks: cast
  // on the host then copied, or copied then cast on the GPU.
  absl::Status CastOnHostAndCopy(const float* master, char* dst, int64_t numel);
  absl::Status CopyAndCastOnDevice(const float* master, char* dst, int64_t numel);
  // Whether the GPU is about to wait for a load whose gate wait took `gate_wait`.
  absl::StatusOr<bool> LoadIsUrgent(absl::Duration gate_wait);
  bool ShardedUnit(int unit) const { return SplitsUnit(options_.sharding, unit); }
  // Sharded nodes: queues the whole unit's gather into `slot` (and its norms' FP32 side copy); the
  // slot's `ready` is recorded where the last of it runs.
  absl::Status GatherUnit(int unit, Slot& slot);

  shm::JobState* state_ = nullptr;
  // The hostd whose gates this job waits on, as it was when the job started (a restarted hostd
  // taking the segment over must not keep a wait for a dead one alive).
  shm::ProcessIdentity publisher_;
  const ModelLayout* layout_ = nullptr;
  CudaStreamerOptions options_;
  cudaStream_t compute_ = nullptr;
  cudaStream_t h2d_ = nullptr;
  int64_t slot_bytes_ = 0;
  int64_t fp32_bytes_ = 0;             // per slot; 0 with Dtype::kBF16
  const float* embed_fp32_ = nullptr;  // device pointer of the embedding's mapped FP32 master
  // Sharded nodes: every node's piece of this local index ((nodes + 1) x the largest piece, BF16: the
  // last for this rank's own), and every node's norms ((nodes + 1) x the largest side copy, FP32).
  void* gathered_ = nullptr;
  float* side_all_ = nullptr;
  int64_t gathered_piece_ = 0;  // elements
  cudaEvent_t gather_done_ = nullptr;  // the last gather's work, all of it
  int64_t side_numel_ = 0;
  std::vector<Slot> slots_;
  HostRegistry own_registry_;  // the ring's slots, and the mirrors without options.registry
  uint64_t clock_ = 0;
  double gate_wait_s_ = 0;
  CudaCopyTimer h2d_timer_;
  std::atomic<uint32_t>* urgent_word_ = nullptr;  // this rank's, or null: no marking
  cudaEvent_t compute_probe_ = nullptr;           // recorded on compute_ to ask whether it is idle
  // kMaster: the pinned cast buffers (cast_chunk_bytes_ each) and the events of their last copies.
  int64_t cast_chunk_bytes_ = 0;
  bf16_t* cast_buffers_[kCastBuffers] = {};
  cudaEvent_t cast_copied_[kCastBuffers] = {};
  std::unique_ptr<CastPool> cast_pool_;  // cast_threads threads, started once
  int next_cast_buffer_ = 0;
  double cast_s_ = 0;
  // kMaster on the device: FP32 chunk buffers (cast_chunk_bytes_ * 2 each), the events of their
  // copies and of the casts that read them, and the cast kernels' stream.
  float* device_cast_fp32_[kDeviceCastBuffers] = {};
  cudaEvent_t device_cast_copied_[kDeviceCastBuffers] = {};
  cudaEvent_t device_cast_done_[kDeviceCastBuffers] = {};
  cudaStream_t cast_stream_ = nullptr;
  int64_t device_cast_bytes_ = 0;
};

}  // namespace slidedp
