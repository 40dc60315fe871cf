// GradRing: the gradient staging ring of one worker, in its own segment
// "/slidedp.<node>.<job>.ring<rank>": num_slots chunk slots of slot_bytes each (the worker's D2H
// target; register slots_base()/slots_bytes() with cudaHostRegister), a descriptor queue from the
// worker (single producer) to hostd (single consumer), and a bitmap of free slots.
//
//   producer (worker):  slot = AcquireSlot(timeout); write slot_data(slot); Post(desc)
//   consumer (hostd):   desc = Pop(timeout); read slot_data(desc.slot); Release(desc.slot)
//
// A full ring is backpressure: AcquireSlot blocks until the consumer releases a slot, so nothing
// is ever overwritten. Release may come from any consumer thread and in any order (several
// LayerAdam threads); Pop and Post are each called by one thread at a time. Every wait is a futex
// wait with a deadline, the job-wide abort word, and a liveness check of the process on the other
// side (its pid and start time are recorded in the segment when it creates or attaches).
//
// Memory order: slot writes happen-before Post's release store of the tail, which Pop acquires;
// the consumer's reads happen-before Release's release RMW of the free bitmap, which AcquireSlot
// acquires before the producer writes the slot again.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/numeric/dtype.h"
#include "shm/futex.h"
#include "shm/shm_segment.h"

namespace slidedp::shm {

inline constexpr uint32_t kMaxRingSlots = 4096;

struct GradRingConfig {
  uint32_t num_slots = 8;             // 1..kMaxRingSlots
  uint64_t slot_bytes = 64ull << 20;  // capacity of one chunk; slots are 4096-byte aligned
};

// What a posted chunk carries: a gradient range in FP32 or BF16, or (kSumSquares) the posting
// rank's squared norm of its final gradient parts for the step, one double at the start of the
// slot (unit -1, offset 0, numel 1); device-staged clipping posts it before the step's chunks.
enum class ChunkKind : uint32_t { kGradF32 = 0, kGradBF16 = 1, kSumSquares = 2 };
// The gradient chunk kind of a dtype.
inline ChunkKind GradChunkKind(Dtype d) { return d == Dtype::kBF16 ? ChunkKind::kGradBF16 : ChunkKind::kGradF32; }
// "F32", "BF16" (the gradient types), "sum of squares".
inline const char* ChunkKindName(ChunkKind k) {
  return k == ChunkKind::kGradF32 ? "F32" : k == ChunkKind::kGradBF16 ? "BF16" : "sum of squares";
}
inline uint64_t ChunkKindBytes(ChunkKind d) {
  return d == ChunkKind::kGradF32 ? 4 : d == ChunkKind::kGradBF16 ? 2 : sizeof(double);
}

// One posted chunk: numel gradient elements of `unit`, starting at offset_numel inside the unit's
// flat parameter array, for optimizer step `step`, stored in slot `slot`, of `kind`.
struct GradChunkDesc {
  int32_t unit = 0;
  uint32_t slot = 0;
  int64_t offset_numel = 0;
  int64_t numel = 0;
  uint32_t step = 0;
  ChunkKind kind = ChunkKind::kGradF32;
};
static_assert(sizeof(GradChunkDesc) == 32 && std::is_trivially_copyable_v<GradChunkDesc>);

enum class RingRole { kProducer, kConsumer };

class GradRing {
 public:
  // Creates the ring segment (allocated and prefaulted) and records the caller as `creator_role`
  // (hostd: kConsumer). `abort` (may be null) must outlive the ring: usually JobState::abort().
  static absl::StatusOr<std::unique_ptr<GradRing>> Create(const std::string& node, const std::string& job_id, int rank,
                                                          const GradRingConfig& config, RingRole creator_role,
                                                          const AbortWord* abort,
                                                          const std::string& shm_dir = "/dev/shm");
  // Maps an existing ring and records the caller as `role` (replacing a previous one: a restarted
  // worker takes over as producer).
  static absl::StatusOr<std::unique_ptr<GradRing>> Attach(const std::string& segment_name, RingRole role,
                                                          const AbortWord* abort);
  static uint64_t SegmentBytes(const GradRingConfig& config);
  static absl::StatusOr<std::string> SegmentName(const std::string& node, const std::string& job_id, int rank);

  // --- producer ---
  // A free slot, waiting while all are in use. DEADLINE_EXCEEDED, ABORTED, or UNAVAILABLE when the
  // consumer died.
  absl::StatusOr<uint32_t> AcquireSlot(absl::Duration timeout);
  // Queues a chunk whose data is in desc.slot (acquired, not yet posted). INVALID_ARGUMENT for a
  // bad slot, numel or size larger than slot_bytes.
  absl::Status Post(const GradChunkDesc& desc);
  // No more posts: the consumer's Pop returns OUT_OF_RANGE once the queue is drained.
  void Close();

  // --- consumer ---
  // The next chunk in posting order. DEADLINE_EXCEEDED, ABORTED, UNAVAILABLE (producer died and
  // the queue is empty), OUT_OF_RANGE (closed and drained), DATA_LOSS (corrupt descriptor: bad
  // slot, numel, dtype or size, a slot the producer did not acquire, or one still held).
  absl::StatusOr<GradChunkDesc> Pop(absl::Duration timeout);
  // Returns a slot to the producer. FAILED_PRECONDITION if it is not in use (double release).
  absl::Status Release(uint32_t slot);

  // Fault injection for tests and fuzzers: queues `desc` as a broken producer could, without
  // Post's checks (the consumer must refuse whatever it holds).
  absl::Status PostUncheckedForTest(const GradChunkDesc& desc);

  void* slot_data(uint32_t slot) const { return slots_ + static_cast<uint64_t>(slot) * stride_; }
  uint8_t* slots_base() const { return slots_; }
  uint64_t slots_bytes() const { return stride_ * config_.num_slots; }
  const GradRingConfig& config() const { return config_; }
  uint32_t free_slots() const;
  uint32_t queued() const;  // posted, not yet popped
  ProcessIdentity producer() const;
  ProcessIdentity consumer() const;
  const std::string& segment_name() const { return segment_->name(); }
  uint64_t bytes() const { return segment_->bytes(); }
  absl::Status Unlink() { return segment_->Unlink(); }

  struct Control;  // the shared layout, below

 private:
  GradRing(std::unique_ptr<ShmSegment> segment, const AbortWord* abort) : segment_(std::move(segment)), abort_(abort) {}
  absl::Status Bind();
  WaitGuards Guards(RingRole waiting_for) const;

  std::unique_ptr<ShmSegment> segment_;
  const AbortWord* abort_ = nullptr;
  Control* control_ = nullptr;
  GradChunkDesc* descs_ = nullptr;
  uint8_t* slots_ = nullptr;
  uint64_t stride_ = 0;
  GradRingConfig config_;
  // Consumer side, this process only: slots named by a popped descriptor and not yet released
  // (Pop refuses a descriptor naming one of them).
  std::unique_ptr<std::atomic<uint64_t>[]> held_ = std::make_unique<std::atomic<uint64_t>[]>(kMaxRingSlots / 64);
};

// The ring segment's "ring_control" region: this block, then desc_capacity GradChunkDescs (the
// queue); the "slots" region holds num_slots slots of slot_stride bytes (4096-byte multiples).
// Shared words each on their own cache line: the producer writes tail, the consumer head and
// release_seq, so neither side's stores invalidate the line the other spins on.
struct GradRing::Control {
  uint32_t num_slots;
  uint32_t desc_capacity;
  uint64_t slot_bytes;
  uint64_t slot_stride;
  uint8_t pad0[40];
  PeerSlot producer;
  PeerSlot consumer;
  uint8_t pad1[32];
  alignas(64) std::atomic<uint32_t> tail;         // descriptors posted (mod 2^32)
  alignas(64) std::atomic<uint32_t> head;         // descriptors popped
  alignas(64) std::atomic<uint32_t> release_seq;  // bumped by every Release; producer waits on it
  alignas(64) std::atomic<uint32_t> closed;
  alignas(64) std::atomic<uint64_t> free_bits[kMaxRingSlots / 64];  // 1 = slot free
};
static_assert(std::is_standard_layout_v<GradRing::Control>);
static_assert(sizeof(GradRing::Control) % 64 == 0);

}  // namespace slidedp::shm
