// CudaWindowStreamer: bounded window of GPU parameter slots fed from the host mirror.
#include "worker/pipeline/cuda_streamer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model/shard.h"
#include "common/status/status_macros.h"
#include "shm/futex.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/reductions.h"
#include "worker/pipeline/urgent_copy.h"

namespace slidedp {
namespace {

// A gate wait longer than this means the update was still running when the unit was needed: the
// GPU is about to wait for this load. (A gate already open returns in well under a microsecond.)
constexpr absl::Duration kUrgentGateWait = absl::Microseconds(20);

}  // namespace

absl::StatusOr<std::unique_ptr<CudaWindowStreamer>> CudaWindowStreamer::Create(shm::JobState* state,
                                                                               shm::GradRing* ring,
                                                                               const ModelLayout& layout,
                                                                               cudaStream_t compute,
                                                                               const CudaStreamerOptions& options) {
  std::unique_ptr<CudaWindowStreamer> s(new CudaWindowStreamer());
  s->state_ = state;
  s->publisher_ = state->owner();
  s->layout_ = &layout;
  s->options_ = options;
  s->compute_ = compute;
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s->h2d_, cudaStreamNonBlocking));
  s->urgent_word_ = state->urgent_copy_word(options.urgent_rank);
  if (s->urgent_word_ != nullptr) {
    // This rank's word is ours alone: whatever an earlier worker of the rank left is stale.
    s->urgent_word_->store(0, std::memory_order_release);
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->compute_probe_, cudaEventDisableTiming));
  }
  const int world = options.sharded_with ? options.sharded_with->world() : 1;
  const bool sharded = options.sharding != nullptr && options.sharding->sharded();
  if (sharded && (options.node_link == nullptr || (options.world > 1 && options.local == nullptr))) {
    return absl::FailedPreconditionError("runtime.node_state sharded without the links to the other ranks");
  }
  for (const UnitLayout& u : layout.units) {
    s->slot_bytes_ = std::max<int64_t>(s->slot_bytes_, PaddedNumel(u.numel, world) * 2);
    if (options.norms == Dtype::kF32) s->fp32_bytes_ = std::max<int64_t>(s->fp32_bytes_, u.fp32_numel * 4);
    if (sharded && !options.sharding->IsReplicated(u.index)) {
      const int64_t piece = ShardNumel(u.numel, options.sharding->nodes * options.world);
      s->slot_bytes_ = std::max<int64_t>(s->slot_bytes_, PaddedNumel(u.numel, options.sharding->nodes * options.world) * 2);
      s->gathered_piece_ = std::max(s->gathered_piece_, piece);
      s->side_numel_ = std::max(s->side_numel_, u.fp32_numel);
    }
  }
  if (s->gathered_piece_ > 0) {
    const int nodes = options.sharding->nodes;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&s->gathered_, (nodes + 1) * s->gathered_piece_ * 2));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->gather_done_, cudaEventDisableTiming));
    if (s->side_numel_ > 0 && options.norms == Dtype::kF32) {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&s->side_all_, (nodes + 1) * s->side_numel_ * sizeof(float)));
    }
  }
  // The segment's own regions (a sharded state's node ranges are smaller than the model's units).
  HostRegistry* registry = options.registry != nullptr ? options.registry : &s->own_registry_;
  if (options.source == UploadSource::kMirror) {
    for (int u = 0; u < layout.num_units(); ++u) {
      if (state->mirror(u) == nullptr) return absl::FailedPreconditionError("the job segment keeps no BF16 mirror");
      RETURN_IF_ERROR(registry->Ensure(state->mirror(u), state->unit_numel(u) * 2));
    }
  } else {
    // One chunk: chunk_bytes, at most the largest unit, whole pages (hostd's CastStagingChunkBytes).
    int64_t largest = 0;
    for (const UnitLayout& u : layout.units) largest = std::max(largest, u.numel * 2);
    s->cast_chunk_bytes_ = std::max<int64_t>(4096, (std::min(options.chunk_bytes, largest) + 4095) / 4096 * 4096);
    if (options.cast_on_device) {
      // The master is read by DMA (registered once per job segment, kept with the mirrors').
      for (int u = 0; u < layout.num_units(); ++u) {
        RETURN_IF_ERROR(registry->Ensure(state->master(u), state->unit_numel(u) * 4));
      }
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s->cast_stream_, cudaStreamNonBlocking));
      for (int b = 0; b < kDeviceCastBuffers; ++b) {
        const cudaError_t e = cudaMalloc(&s->device_cast_fp32_[b], s->cast_chunk_bytes_ * 2);
        if (e != cudaSuccess) {
          return absl::ResourceExhaustedError(absl::StrCat("GPU cast staging: cudaMalloc of ", s->cast_chunk_bytes_ * 2,
                                                           " bytes failed: ", cudaGetErrorString(e)));
        }
        s->device_cast_bytes_ += s->cast_chunk_bytes_ * 2;
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->device_cast_copied_[b], cudaEventDisableTiming));
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->device_cast_done_[b], cudaEventDisableTiming));
      }
    } else {
      s->cast_pool_ = std::make_unique<CastPool>(std::max(1, options.cast_threads));
      for (int b = 0; b < kCastBuffers; ++b) {
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&s->cast_buffers_[b], s->cast_chunk_bytes_));
        SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&s->cast_copied_[b], cudaEventDisableTiming));
      }
    }
  }
  if (options.embedding == Dtype::kF32) {
    const UnitLayout& e = layout.units[0];
    if (e.kind != UnitKind::kEmbedding) return absl::InternalError("unit 0 is not the embedding");
    RETURN_IF_ERROR(registry->Ensure(state->master(0), e.numel * 4));
    void* dev = nullptr;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev, state->master(0), 0));
    s->embed_fp32_ = static_cast<const float*>(dev);
  }
  if (ring != nullptr) RETURN_IF_ERROR(s->own_registry_.Ensure(ring->slots_base(), ring->slots_bytes()));
  s->slots_.resize(std::max(2, options.window_slots));
  for (Slot& slot : s->slots_) {
    cudaError_t e = cudaMalloc(&slot.data, s->slot_bytes_);
    if (e != cudaSuccess) {
      return absl::ResourceExhaustedError(absl::StrCat("GPU parameter window: cudaMalloc of ", s->slot_bytes_,
                                                       " bytes x ", s->slots_.size(),
                                                       " slots failed: ", cudaGetErrorString(e)));
    }
    if (s->fp32_bytes_ > 0) {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMalloc(&slot.fp32, s->fp32_bytes_));
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&slot.fp32_staging, s->fp32_bytes_));
    }
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.staged, cudaEventDisableTiming));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.ready, cudaEventDisableTiming));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.free, cudaEventDisableTiming));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.free, s->compute_));
  }
  return s;
}

CudaWindowStreamer::~CudaWindowStreamer() {
  cudaStreamSynchronize(compute_);
  if (h2d_) cudaStreamSynchronize(h2d_);  // (urgent loads' callbacks have run: the word is lowered)
  if (urgent_word_ != nullptr) {
    // Also when a stream failed and its callbacks never ran: LayerAdam must not keep pausing.
    if (urgent_word_->exchange(0, std::memory_order_release) != 0) shm::FutexWakeAll(urgent_word_);
  }
  if (compute_probe_) cudaEventDestroy(compute_probe_);
  if (cast_stream_) cudaStreamSynchronize(cast_stream_);
  for (int b = 0; b < kCastBuffers; ++b) {
    if (cast_buffers_[b]) cudaFreeHost(cast_buffers_[b]);
    if (cast_copied_[b]) cudaEventDestroy(cast_copied_[b]);
  }
  for (int b = 0; b < kDeviceCastBuffers; ++b) {
    if (device_cast_fp32_[b]) cudaFree(device_cast_fp32_[b]);
    if (device_cast_copied_[b]) cudaEventDestroy(device_cast_copied_[b]);
    if (device_cast_done_[b]) cudaEventDestroy(device_cast_done_[b]);
  }
  if (cast_stream_) cudaStreamDestroy(cast_stream_);
  for (Slot& slot : slots_) {
    if (slot.data) cudaFree(slot.data);
    if (slot.fp32) cudaFree(slot.fp32);
    if (slot.fp32_staging) cudaFreeHost(slot.fp32_staging);
    if (slot.staged) cudaEventDestroy(slot.staged);
    if (slot.ready) cudaEventDestroy(slot.ready);
    if (slot.free) cudaEventDestroy(slot.free);
  }
  if (gathered_) cudaFree(gathered_);
  if (gather_done_) cudaEventDestroy(gather_done_);
  if (side_all_) cudaFree(side_all_);
  if (h2d_) cudaStreamDestroy(h2d_);
}

CudaWindowStreamer::Slot* CudaWindowStreamer::Resident(int unit, uint32_t gate) {
  for (Slot& s : slots_) {
    if (s.unit == unit && s.gate == gate) return &s;
  }
  return nullptr;
}

absl::Status CudaWindowStreamer::CopyAndCastOnDevice(const float* master, char* dst, int64_t numel) {
  const int64_t chunk = cast_chunk_bytes_ / 2;
  int b = next_cast_buffer_;
  for (int64_t off = 0; off < numel; off += chunk) {
    const int64_t n = std::min(chunk, numel - off);
    b = next_cast_buffer_;
    next_cast_buffer_ = (next_cast_buffer_ + 1) % kDeviceCastBuffers;
    // The cast that read the buffer last must be done before the copy overwrites it (an event never
    // recorded is complete).
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(h2d_, device_cast_done_[b], 0));
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device_cast_fp32_[b], master + off, n * 4, cudaMemcpyHostToDevice, h2d_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(device_cast_copied_[b], h2d_));
    // The slot's previous readers: the H2D stream waited for them before the first copy above.
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(cast_stream_, device_cast_copied_[b], 0));
    RETURN_IF_ERROR(kernels::CastF32ToBf16Exact(device_cast_fp32_[b], n, reinterpret_cast<kernels::bf16*>(dst) + off,
                                                kDeviceCastBlocks, cast_stream_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(device_cast_done_[b], cast_stream_));
  }
  // The slot's `ready`, recorded on the H2D stream, covers the last cast (and so all of them).
  if (numel > 0) SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(h2d_, device_cast_done_[b], 0));
  return absl::OkStatus();
}

absl::Status CudaWindowStreamer::CastOnHostAndCopy(const float* master, char* dst, int64_t numel) {
  const int64_t chunk = cast_chunk_bytes_ / 2;
  for (int64_t off = 0; off < numel; off += chunk) {
    const int64_t n = std::min(chunk, numel - off);
    const int b = next_cast_buffer_;
    next_cast_buffer_ = (next_cast_buffer_ + 1) % kCastBuffers;
    // The buffer's previous copy must be done before it is cast into again.
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(cast_copied_[b]));
    const absl::Time t0 = absl::Now();
    cast_pool_->Cast(master + off, cast_buffers_[b], n);
    cast_s_ += absl::ToDoubleSeconds(absl::Now() - t0);
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + off * 2, cast_buffers_[b], n * 2, cudaMemcpyHostToDevice, h2d_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(cast_copied_[b], h2d_));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaWindowStreamer::LoadIsUrgent(absl::Duration gate_wait) {
  if (urgent_word_ == nullptr) return false;
  if (gate_wait > kUrgentGateWait) return true;
  // Everything queued on the compute stream so far has finished: it would start on this unit now.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(compute_probe_, compute_));
  const cudaError_t e = cudaEventQuery(compute_probe_);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;
  return cuda_internal::CudaErrorStatus(e, "cudaEventQuery(compute probe)", __FILE__, __LINE__);
}

absl::StatusOr<CudaWindowStreamer::Slot*> CudaWindowStreamer::Load(int unit, uint32_t gate) {
  // Least recently used slot that nobody holds.
  Slot* victim = nullptr;
  for (Slot& s : slots_) {
    if (s.users == 0 && (!victim || s.last_use < victim->last_use)) victim = &s;
  }
  if (!victim) return absl::InternalError("GPU parameter window exhausted: every slot is held");
  absl::Time t0 = absl::Now();
  absl::Status s = state_->version(unit).WaitAtLeast(gate, options_.gate_timeout, state_->abort(), publisher_);
  const absl::Duration gate_wait = absl::Now() - t0;
  gate_wait_s_ += absl::ToDoubleSeconds(gate_wait);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("version gate of unit ", unit, ": ", s.message()));
  ASSIGN_OR_RETURN(const bool urgent, LoadIsUrgent(gate_wait));
  // Raised from before the first copy is queued until the stream has run the last one; lowered
  // at once on any error return below.
  UrgentCopyMark mark(urgent ? urgent_word_ : nullptr);

  // The previous occupant's readers must be done before we overwrite the slot.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(h2d_, victim->free, 0));
  if (ShardedUnit(unit)) {
    RETURN_IF_ERROR(GatherUnit(unit, *victim));
    RETURN_IF_ERROR(mark.LowerAfter(h2d_));
    victim->unit = unit;
    victim->gate = gate;
    victim->last_use = ++clock_;
    return victim;
  }
  RETURN_IF_ERROR(h2d_timer_.Begin(h2d_));
  const int64_t numel = layout_->units[unit].numel;
  NcclCommunicator* comm = options_.sharded_with;
  const ShardRange part = comm ? ShardOf(numel, comm->world(), comm->rank()) : ShardRange{0, numel};
  char* dst = static_cast<char*>(victim->data) + part.offset * 2;
  if (options_.source == UploadSource::kMaster) {
    const float* master = state_->master(unit) + part.offset;
    RETURN_IF_ERROR(options_.cast_on_device ? CopyAndCastOnDevice(master, dst, part.numel)
                                            : CastOnHostAndCopy(master, dst, part.numel));
  } else {
    const char* src = reinterpret_cast<const char*>(state_->mirror(unit) + part.offset);
    const int64_t bytes = part.numel * 2;
    for (int64_t off = 0; off < bytes; off += options_.chunk_bytes) {
      const int64_t n = std::min(options_.chunk_bytes, bytes - off);
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + off, src + off, n, cudaMemcpyHostToDevice, h2d_));
    }
  }
  const UnitLayout& ul = layout_->units[unit];
  if (fp32_bytes_ > 0 && ul.fp32_numel > 0) {
    // Read after the gate: the unit's next update needs this step's gradients, which come only
    // after the compute that reads these values. The staging's previous copy must be done.
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(victim->staged));
    CopyNormsFromMaster(ul, state_->master(unit), victim->fp32_staging);
    SLIDEDP_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(victim->fp32, victim->fp32_staging, ul.fp32_numel * 4, cudaMemcpyHostToDevice, h2d_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(victim->staged, h2d_));
  }
  RETURN_IF_ERROR(h2d_timer_.End(h2d_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(victim->ready, h2d_));
  // After `ready`: compute waits for the copies only, not for the callback that lowers the word.
  RETURN_IF_ERROR(mark.LowerAfter(h2d_));
  if (comm != nullptr) {
    RETURN_IF_ERROR(
        comm->AllGatherBF16(static_cast<bf16_t*>(victim->data), ShardNumel(numel, comm->world()), victim->ready));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(victim->ready, comm->stream()));
  }
  victim->unit = unit;
  victim->gate = gate;
  victim->last_use = ++clock_;
  return victim;
}

absl::Status CudaWindowStreamer::GatherUnit(int unit, Slot& slot) {
  const NodeSharding& sh = *options_.sharding;
  const UnitLayout& ul = layout_->units[unit];
  const int64_t numel = ul.numel;
  const int nodes = sh.nodes, world = options_.world;
  const int64_t piece = ShardNumel(numel, nodes * world);
  const ShardRange own = NodeRangeOf(numel, nodes, world, sh.node);
  const ShardRange mine = ShardOf(own.numel, world, options_.rank);  // inside the node's range
  auto* gathered = static_cast<bf16_t*>(gathered_);
  bf16_t* contribution = gathered + nodes * gathered_piece_;
  // The previous gather's reads of the scratch are done before it is written again.
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(h2d_, gather_done_, 0));
  // This rank's local shard of its node's range, as the node's hostd published it (zero padded).
  RETURN_IF_ERROR(h2d_timer_.Begin(h2d_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(contribution, 0, piece * 2, h2d_));
  if (options_.source == UploadSource::kMaster) {
    const float* master = state_->master(unit) + mine.offset;
    char* dst = reinterpret_cast<char*>(contribution);
    RETURN_IF_ERROR(options_.cast_on_device ? CopyAndCastOnDevice(master, dst, mine.numel)
                                            : CastOnHostAndCopy(master, dst, mine.numel));
  } else {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(contribution, state_->mirror(unit) + mine.offset, mine.numel * 2,
                                                 cudaMemcpyHostToDevice, h2d_));
  }
  // The norms: this node's elements of the FP32 side copy, read from its master after the gate.
  const bool side = fp32_bytes_ > 0 && ul.fp32_numel > 0 && side_all_ != nullptr;
  if (side) {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.staged));  // its previous copy is done
    std::fill_n(slot.fp32_staging, ul.fp32_numel, 0.0f);
    const float* master = state_->master(unit);
    ForEachSidePart(ul, own, [&](int64_t at, int64_t element, int64_t n) {
      std::copy_n(master + (element - own.offset), n, slot.fp32_staging + at);
    });
    float* side_mine = side_all_ + nodes * side_numel_;
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(side_mine, slot.fp32_staging, ul.fp32_numel * sizeof(float),
                                                 cudaMemcpyHostToDevice, h2d_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.staged, h2d_));
  }
  RETURN_IF_ERROR(h2d_timer_.End(h2d_));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.ready, h2d_));
  // Every node's piece of this local index, then every node's norms, on the link's stream.
  NcclNodeLink& link = *options_.node_link;
  cudaStream_t across = link.own_stream();
  link.set_stream(across);
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(across, slot.ready, 0));
  RETURN_IF_ERROR(link.AllGather(reinterpret_cast<const float*>(contribution), piece / 2,
                                 reinterpret_cast<float*>(gathered)));
  if (side) {
    RETURN_IF_ERROR(link.AllGather(side_all_ + nodes * side_numel_, ul.fp32_numel, side_all_));
    for (int m = 0; m < nodes; ++m) {  // each element from its owner
      cudaError_t copied = cudaSuccess;
      ForEachSidePart(ul, NodeRangeOf(numel, nodes, world, m), [&](int64_t at, int64_t, int64_t n) {
        if (copied == cudaSuccess) {
          copied = cudaMemcpyAsync(slot.fp32 + at, side_all_ + m * side_numel_ + at, n * sizeof(float),
                                   cudaMemcpyDeviceToDevice, across);
        }
      });
      SLIDEDP_CUDA_RETURN_IF_ERROR(copied);
    }
  }
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.ready, across));
  // This node's ranks: every node's range from their pieces.
  cudaStream_t last = across;
  if (world > 1) {
    last = options_.local->stream();
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(last, slot.ready, 0));
  }
  auto* dst = static_cast<bf16_t*>(slot.data);
  for (int m = 0; m < nodes; ++m) {
    const ShardRange range = NodeRangeOf(numel, nodes, world, m);
    const int64_t local = ShardNumel(range.numel, world);
    if (world > 1) {
      RETURN_IF_ERROR(options_.local->AllGatherBytesOn(gathered + m * piece, local * 2,
                                                       dst + range.offset, last));
    } else {
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + range.offset, gathered + m * piece, local * 2,
                                                   cudaMemcpyDeviceToDevice, last));
    }
  }
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.ready, last));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaEventRecord(gather_done_, last));
  return absl::OkStatus();
}

absl::StatusOr<UnitParams> CudaWindowStreamer::Acquire(int unit, uint32_t gate) {
  Slot* slot = Resident(unit, gate);
  if (!slot) {
    ASSIGN_OR_RETURN(slot, Load(unit, gate));
  }
  slot->users++;
  slot->last_use = ++clock_;
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, slot->ready, 0));
  if (layout_->units[unit].kind == UnitKind::kEmbedding) {
    return UnitParams(static_cast<const bf16_t*>(slot->data), embed_fp32_);
  }
  const bool side = fp32_bytes_ > 0 && layout_->units[unit].fp32_numel > 0;
  return UnitParams(static_cast<const bf16_t*>(slot->data), side ? slot->fp32 : nullptr);
}

void CudaWindowStreamer::Release(int unit) {
  for (Slot& s : slots_) {
    if (s.unit == unit && s.users > 0) {
      // Everything compute has queued so far may read the slot; the next load waits for it.
      cudaEventRecord(s.free, compute_);
      s.users--;
      return;
    }
  }
}

absl::Status CudaWindowStreamer::Prefetch(int unit, uint32_t gate) {
  if (unit < 0 || unit >= layout_->num_units() || Resident(unit, gate)) return absl::OkStatus();
  return Load(unit, gate).status();
}

}  // namespace slidedp
