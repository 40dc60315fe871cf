// GradRing: SPSC descriptor queue + free-slot bitmap over futex words in a shared segment.
#include "shm/grad_ring.h"

#include <bit>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp::shm {
namespace {

// A gradient chunk, or a rank's squared norm (one double).
bool KnownDtype(const GradChunkDesc& d) {
  return d.kind == ChunkKind::kGradF32 || d.kind == ChunkKind::kGradBF16 ||
         (d.kind == ChunkKind::kSumSquares && d.numel == 1);
}

constexpr const char* kControlRegion = "ring_control";
constexpr const char* kSlotsRegion = "slots";

uint64_t SlotStride(const GradRingConfig& c) { return (c.slot_bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }

std::vector<RegionSpec> RingRegions(const GradRingConfig& c) {
  return {RegionSpec{kControlRegion, sizeof(GradRing::Control) + c.num_slots * sizeof(GradChunkDesc), ShmDtype::kBytes},
          RegionSpec{kSlotsRegion, SlotStride(c) * c.num_slots, ShmDtype::kBytes}};
}

absl::Status ValidateConfig(const GradRingConfig& c) {
  if (c.num_slots < 1 || c.num_slots > kMaxRingSlots || c.slot_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("grad ring: num_slots ", c.num_slots, " must be 1..", kMaxRingSlots,
                                                   " and slot_bytes ", c.slot_bytes, " > 0"));
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t GradRing::SegmentBytes(const GradRingConfig& config) { return ShmSegment::RequiredBytes(RingRegions(config)); }

absl::StatusOr<std::string> GradRing::SegmentName(const std::string& node, const std::string& job_id, int rank) {
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("grad ring: rank ", rank, " < 0"));
  return MakeSegmentName(node, job_id, absl::StrCat("ring", rank));
}

absl::StatusOr<std::unique_ptr<GradRing>> GradRing::Create(const std::string& node, const std::string& job_id, int rank,
                                                           const GradRingConfig& config, RingRole creator_role,
                                                           const AbortWord* abort, const std::string& shm_dir) {
  RETURN_IF_ERROR(ValidateConfig(config));
  ASSIGN_OR_RETURN(std::string name, SegmentName(node, job_id, rank));
  ShmCreateOptions opts;
  opts.shm_dir = shm_dir;
  ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg, ShmSegment::Create(name, RingRegions(config), opts));
  ASSIGN_OR_RETURN(Region control, seg->FindRegion(kControlRegion));
  auto* c = new (seg->data(control)) Control();
  c->num_slots = config.num_slots;
  c->desc_capacity = config.num_slots;  // every queued descriptor holds a distinct slot
  c->slot_bytes = config.slot_bytes;
  c->slot_stride = SlotStride(config);
  for (uint32_t s = 0; s < config.num_slots; ++s) {
    c->free_bits[s / 64].fetch_or(uint64_t{1} << (s % 64), std::memory_order_relaxed);
  }
  (creator_role == RingRole::kProducer ? c->producer : c->consumer).Set(SelfIdentity());
  std::unique_ptr<GradRing> ring(new GradRing(std::move(seg), abort));
  absl::Status s = ring->Bind();
  if (s.ok()) s = ring->segment_->PrefaultAll();
  if (!s.ok()) {
    ring->Unlink().IgnoreError();
    return s;
  }
  return ring;
}

absl::StatusOr<std::unique_ptr<GradRing>> GradRing::Attach(const std::string& segment_name, RingRole role,
                                                           const AbortWord* abort) {
  ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg, ShmSegment::Open(segment_name, Access::kReadWrite));
  std::unique_ptr<GradRing> ring(new GradRing(std::move(seg), abort));
  RETURN_IF_ERROR(ring->Bind());
  (role == RingRole::kProducer ? ring->control_->producer : ring->control_->consumer).Set(SelfIdentity());
  return ring;
}

absl::Status GradRing::Bind() {
  const std::string& name = segment_->name();
  ASSIGN_OR_RETURN(Region control, segment_->FindRegion(kControlRegion));
  ASSIGN_OR_RETURN(Region slots, segment_->FindRegion(kSlotsRegion));
  if (control.bytes < sizeof(Control)) {
    return absl::DataLossError(absl::StrCat("grad ring ", name, ": control region too small"));
  }
  control_ = static_cast<Control*>(segment_->data(control));
  config_.num_slots = control_->num_slots;
  config_.slot_bytes = control_->slot_bytes;
  stride_ = control_->slot_stride;
  if (!ValidateConfig(config_).ok() || control_->desc_capacity != config_.num_slots || stride_ != SlotStride(config_) ||
      control.bytes != sizeof(Control) + config_.num_slots * sizeof(GradChunkDesc) ||
      slots.bytes != stride_ * config_.num_slots) {
    return absl::DataLossError(absl::StrCat("grad ring ", name, ": control block (", config_.num_slots, " slots of ",
                                            config_.slot_bytes, " bytes) disagrees with its regions"));
  }
  descs_ = reinterpret_cast<GradChunkDesc*>(static_cast<uint8_t*>(segment_->data(control)) + sizeof(Control));
  slots_ = static_cast<uint8_t*>(segment_->data(slots));
  return absl::OkStatus();
}

WaitGuards GradRing::Guards(RingRole waiting_for) const {
  WaitGuards g;
  g.abort = abort_;
  g.peer_slot = waiting_for == RingRole::kProducer ? &control_->producer : &control_->consumer;
  g.peer_role = waiting_for == RingRole::kProducer ? "gradient ring producer" : "gradient ring consumer";
  return g;
}

absl::StatusOr<uint32_t> GradRing::AcquireSlot(absl::Duration timeout) {
  const uint32_t words = (config_.num_slots + 63) / 64;
  while (true) {
    // Read the sequence before scanning: a Release after the scan changes it, so the wait below
    // returns at once instead of missing that slot.
    const uint32_t seq = control_->release_seq.load(std::memory_order_acquire);
    for (uint32_t w = 0; w < words; ++w) {
      uint64_t bits = control_->free_bits[w].load(std::memory_order_relaxed);
      while (bits != 0) {
        const int b = std::countr_zero(bits);
        const uint64_t mask = uint64_t{1} << b;
        const uint64_t prev = control_->free_bits[w].fetch_and(~mask, std::memory_order_acquire);
        if (prev & mask) return w * 64 + static_cast<uint32_t>(b);
        bits = prev & ~mask;
      }
    }
    absl::Status s = WaitForWord(
        control_->release_seq, [seq](uint32_t now) { return now != seq; }, timeout, Guards(RingRole::kConsumer),
        [&] {
          return absl::StrCat("a free slot in gradient ring ", segment_->name(), " (all ", config_.num_slots,
                              " in use)");
        });
    if (!s.ok()) return s;
  }
}

absl::Status GradRing::Post(const GradChunkDesc& desc) {
  if (desc.slot >= config_.num_slots || desc.numel <= 0 || desc.offset_numel < 0 || !KnownDtype(desc) ||
      static_cast<uint64_t>(desc.numel) > config_.slot_bytes / ChunkKindBytes(desc.kind)) {
    return absl::InvalidArgumentError(absl::StrCat("grad ring ", segment_->name(), ": bad chunk (unit ", desc.unit,
                                                   ", slot ", desc.slot, " of ", config_.num_slots, ", numel ",
                                                   desc.numel, ", offset ", desc.offset_numel, ") for slots of ",
                                                   config_.slot_bytes, " bytes"));
  }
  const uint64_t mask = uint64_t{1} << (desc.slot % 64);
  if (control_->free_bits[desc.slot / 64].load(std::memory_order_relaxed) & mask) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad ring ", segment_->name(), ": slot ", desc.slot, " posted without AcquireSlot"));
  }
  const uint32_t tail = control_->tail.load(std::memory_order_relaxed);  // only we write it
  const uint32_t head = control_->head.load(std::memory_order_acquire);
  if (tail - head >= control_->desc_capacity) {
    return absl::FailedPreconditionError(
        absl::StrCat("grad ring ", segment_->name(), ": descriptor queue full (", tail - head,
                     " queued) although every entry holds a slot: a slot was posted twice"));
  }
  descs_[tail % control_->desc_capacity] = desc;
  control_->tail.store(tail + 1, std::memory_order_release);
  FutexWakeAll(&control_->tail);
  return absl::OkStatus();
}

void GradRing::Close() {
  control_->closed.store(1, std::memory_order_release);
  FutexWakeAll(&control_->tail);
}

absl::StatusOr<GradChunkDesc> GradRing::Pop(absl::Duration timeout) {
  const uint32_t head = control_->head.load(std::memory_order_relaxed);  // only we write it
  absl::Status s = WaitForWord(
      control_->tail,
      [&](uint32_t tail) { return tail != head || control_->closed.load(std::memory_order_acquire) != 0; }, timeout,
      Guards(RingRole::kProducer),
      [&] {
        return absl::StrCat("a gradient chunk in ring ", segment_->name(), " (", control_->tail.load() - head,
                            " queued)");
      });
  if (!s.ok()) return s;
  if (control_->tail.load(std::memory_order_acquire) == head) {
    return absl::OutOfRangeError(absl::StrCat("grad ring ", segment_->name(), " closed by the producer and drained"));
  }
  const GradChunkDesc desc = descs_[head % control_->desc_capacity];
  control_->head.store(head + 1, std::memory_order_release);
  // The producer may be broken (or another build): nothing it wrote is trusted. The size check
  // divides, so a huge numel cannot wrap the product into range.
  if (desc.slot >= config_.num_slots || desc.numel <= 0 || !KnownDtype(desc) ||
      static_cast<uint64_t>(desc.numel) > config_.slot_bytes / ChunkKindBytes(desc.kind)) {
    return absl::DataLossError(absl::StrCat("grad ring ", segment_->name(), ": corrupt descriptor (slot ", desc.slot,
                                            ", numel ", desc.numel, ", dtype ", static_cast<uint32_t>(desc.kind), ")"));
  }
  // The slot must be one the producer acquired (its free bit clear) and not one the consumer still
  // holds from an earlier descriptor: otherwise two updates would read one slot, or the producer
  // could overwrite a slot that is being read.
  const uint64_t mask = uint64_t{1} << (desc.slot % 64);
  if (control_->free_bits[desc.slot / 64].load(std::memory_order_acquire) & mask) {
    return absl::DataLossError(absl::StrCat("grad ring ", segment_->name(), ": descriptor names slot ", desc.slot,
                                            ", which the producer did not acquire"));
  }
  if (held_[desc.slot / 64].fetch_or(mask, std::memory_order_acq_rel) & mask) {
    return absl::DataLossError(absl::StrCat("grad ring ", segment_->name(), ": descriptor names slot ", desc.slot,
                                            ", which an earlier descriptor holds (not yet released)"));
  }
  return desc;
}

absl::Status GradRing::PostUncheckedForTest(const GradChunkDesc& desc) {
  const uint32_t tail = control_->tail.load(std::memory_order_relaxed);
  const uint32_t head = control_->head.load(std::memory_order_acquire);
  if (tail - head >= control_->desc_capacity) return absl::ResourceExhaustedError("descriptor queue full");
  descs_[tail % control_->desc_capacity] = desc;
  control_->tail.store(tail + 1, std::memory_order_release);
  FutexWakeAll(&control_->tail);
  return absl::OkStatus();
}

absl::Status GradRing::Release(uint32_t slot) {
  if (slot >= config_.num_slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad ring ", segment_->name(), ": slot ", slot, " >= ", config_.num_slots));
  }
  const uint64_t mask = uint64_t{1} << (slot % 64);
  held_[slot / 64].fetch_and(~mask, std::memory_order_acq_rel);
  const uint64_t prev = control_->free_bits[slot / 64].fetch_or(mask, std::memory_order_release);
  if (prev & mask) {
    return absl::FailedPreconditionError(
        absl::StrCat("grad ring ", segment_->name(), ": slot ", slot, " released twice"));
  }
  control_->release_seq.fetch_add(1, std::memory_order_release);
  FutexWakeAll(&control_->release_seq);
  return absl::OkStatus();
}

uint32_t GradRing::free_slots() const {
  uint32_t n = 0;
  for (uint32_t w = 0; w < (config_.num_slots + 63) / 64; ++w) {
    n += std::popcount(control_->free_bits[w].load(std::memory_order_relaxed));
  }
  return n;
}

uint32_t GradRing::queued() const {
  return control_->tail.load(std::memory_order_acquire) - control_->head.load(std::memory_order_acquire);
}

ProcessIdentity GradRing::producer() const { return control_->producer.Load(); }
ProcessIdentity GradRing::consumer() const { return control_->consumer.Load(); }

}  // namespace slidedp::shm
