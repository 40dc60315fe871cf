// ShmCollective: barrier and rank-ordered reduce-scatter in shared memory.
#include "shm/shm_collective.h"

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp::shm {

namespace {

constexpr char kControlRegion[] = "control";
constexpr char kBuffersRegion[] = "buffers";

uint64_t BufferStride(uint64_t buffer_bytes) { return (buffer_bytes + kPageBytes - 1) / kPageBytes * kPageBytes; }

std::vector<RegionSpec> Regions(int world, uint64_t buffer_bytes) {
  return {RegionSpec{kControlRegion, sizeof(ShmCollective::Control), ShmDtype::kBytes},
          RegionSpec{kBuffersRegion, BufferStride(buffer_bytes) * world, ShmDtype::kF32}};
}

}  // namespace

uint64_t ShmCollective::SegmentBytes(int world, uint64_t buffer_bytes) {
  return ShmSegment::RequiredBytes(Regions(world, buffer_bytes));
}

absl::StatusOr<std::unique_ptr<ShmCollective>> ShmCollective::Create(const std::string& node, const std::string& job_id,
                                                                     int world, uint64_t buffer_bytes,
                                                                     const AbortWord* abort,
                                                                     const std::string& shm_dir,
                                                                     const std::string& kind) {
  if (world < 1 || buffer_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("collective: world ", world, ", buffer bytes ", buffer_bytes));
  }
  ASSIGN_OR_RETURN(std::string name, MakeSegmentName(node, job_id, kind));
  ShmCreateOptions opts;
  opts.shm_dir = shm_dir;
  ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg, ShmSegment::Create(name, Regions(world, buffer_bytes), opts));
  ASSIGN_OR_RETURN(Region control, seg->FindRegion(kControlRegion));
  auto* c = new (seg->data(control)) Control();
  c->world = static_cast<uint32_t>(world);
  c->buffer_bytes = BufferStride(buffer_bytes);
  std::unique_ptr<ShmCollective> coll(new ShmCollective(std::move(seg), abort));
  absl::Status s = coll->Bind();
  if (s.ok()) s = coll->segment_->PrefaultAll();
  if (!s.ok()) {
    coll->Unlink().IgnoreError();
    return s;
  }
  return coll;
}

absl::StatusOr<std::unique_ptr<ShmCollective>> ShmCollective::Attach(const std::string& segment_name, int rank,
                                                                     const AbortWord* abort) {
  ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg, ShmSegment::Open(segment_name, Access::kReadWrite));
  std::unique_ptr<ShmCollective> coll(new ShmCollective(std::move(seg), abort));
  RETURN_IF_ERROR(coll->Bind());
  if (rank < 0 || rank >= coll->world_) {
    return absl::InvalidArgumentError(
        absl::StrCat("collective ", segment_name, ": rank ", rank, " outside [0, ", coll->world_, ")"));
  }
  coll->rank_ = rank;
  return coll;
}

absl::Status ShmCollective::Bind() {
  ASSIGN_OR_RETURN(Region control, segment_->FindRegion(kControlRegion));
  ASSIGN_OR_RETURN(Region buffers, segment_->FindRegion(kBuffersRegion));
  if (control.bytes < sizeof(Control))
    return absl::DataLossError(absl::StrCat(segment_->name(), ": control region too small"));
  control_ = static_cast<Control*>(segment_->data(control));
  world_ = static_cast<int>(control_->world);
  buffer_bytes_ = control_->buffer_bytes;
  if (world_ < 1 || buffer_bytes_ * world_ > buffers.bytes) {
    return absl::DataLossError(absl::StrCat(segment_->name(), ": ", world_, " buffers of ", buffer_bytes_,
                                            " bytes do not fit the ", buffers.bytes, "-byte region"));
  }
  buffers_ = static_cast<uint8_t*>(segment_->data(buffers));
  return absl::OkStatus();
}

absl::Status ShmCollective::Barrier(absl::Duration timeout) {
  const uint32_t gen = control_->generation.load(std::memory_order_acquire);
  if (control_->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(world_)) {
    control_->arrived.store(0, std::memory_order_relaxed);
    control_->generation.store(gen + 1, std::memory_order_release);
    FutexWakeAll(&control_->generation);
    return absl::OkStatus();
  }
  WaitGuards guards;
  guards.abort = abort_;
  return WaitForWord(
      control_->generation, [gen](uint32_t now) { return now != gen; }, timeout, guards,
      [&] { return absl::StrCat("the other ranks at collective ", segment_->name()); });
}

absl::Status ShmCollective::ReduceScatterF32(float* buf, int64_t shard_numel, absl::Duration timeout,
                                              const float* init) {
  const uint64_t padded_bytes = static_cast<uint64_t>(shard_numel) * world_ * sizeof(float);
  if (shard_numel < 0 || padded_bytes > buffer_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("reduce-scatter of ", padded_bytes,
                                                   " bytes exceeds the collective's ", buffer_bytes_, "-byte buffers"));
  }
  std::memcpy(buffer(rank_), buf, padded_bytes);
  RETURN_IF_ERROR(Barrier(timeout));
  float* out = buf + static_cast<int64_t>(rank_) * shard_numel;
  const int64_t off = static_cast<int64_t>(rank_) * shard_numel;
  int r = 1;
  if (init != nullptr) {
    std::memcpy(out, init, shard_numel * sizeof(float));
    r = 0;
  } else {
    std::memcpy(out, buffer(0) + off, shard_numel * sizeof(float));
  }
  for (; r < world_; ++r) {
    const float* src = buffer(r) + off;
    for (int64_t i = 0; i < shard_numel; ++i) out[i] += src[i];
  }
  return Barrier(timeout);
}

absl::Status ShmCollective::AllGatherF32(const float* local, int64_t numel, float* out, absl::Duration timeout) {
  const uint64_t bytes = static_cast<uint64_t>(numel) * sizeof(float);
  if (numel < 0 || bytes > buffer_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("all-gather of ", bytes, " bytes per rank exceeds the collective's ", buffer_bytes_, "-byte buffers"));
  }
  std::memmove(buffer(rank_), local, bytes);
  RETURN_IF_ERROR(Barrier(timeout));
  for (int r = 0; r < world_; ++r) std::memcpy(out + static_cast<int64_t>(r) * numel, buffer(r), bytes);
  return Barrier(timeout);  // nobody refills a buffer another rank still reads
}

}  // namespace slidedp::shm
