// ShmCollective: the reduce-scatter of the GPU gradient route for CPU-backend workers (and the
// all-gather of context parallelism), in one
// shared-memory segment "/slidedp.<node>.<job>.coll" that hostd creates per job and every rank
// attaches. It lets CI run the same route real GPUs take through NCCL (each rank posts only its
// own, already summed shard of every unit; common/model/shard.h), with real processes.
//
// Layout: a control block (a barrier: arrival counter and a generation word) and one staging
// buffer of buffer_bytes per rank. ReduceScatterF32: every rank copies its padded gradient into
// its buffer; barrier; rank r sums shard r over the ranks in rank order (the result does not
// depend on timing); barrier (nobody refills a buffer another rank still reads).
//
// Waits are futex waits with the job's abort word: a rank that dies makes hostd raise it, and the
// others return ABORTED within one wait slice instead of hanging.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shm/futex.h"
#include "shm/shm_segment.h"

namespace slidedp::shm {

class ShmCollective {
 public:
  // hostd: creates (allocated and prefaulted) the segment for `world` ranks of buffer_bytes each;
  // kind names it among the job's segments ("coll": the gradient route's, "ctx": context parallelism's).
  static absl::StatusOr<std::unique_ptr<ShmCollective>> Create(const std::string& node, const std::string& job_id,
                                                               int world, uint64_t buffer_bytes, const AbortWord* abort,
                                                               const std::string& shm_dir = "/dev/shm",
                                                               const std::string& kind = "coll");
  // A worker: maps it as `rank`. INVALID_ARGUMENT for a rank outside [0, world).
  static absl::StatusOr<std::unique_ptr<ShmCollective>> Attach(const std::string& segment_name, int rank,
                                                               const AbortWord* abort);
  static uint64_t SegmentBytes(int world, uint64_t buffer_bytes);

  // In place over buf[0, world * shard_numel): afterwards buf[rank * shard_numel, +shard_numel)
  // holds the sum over ranks (the rest of buf is unchanged). INVALID_ARGUMENT when the padded
  // array does not fit a buffer; ABORTED / DEADLINE_EXCEEDED from the waits.
  // With `init` (shard_numel floats: the partial sum of a multi-node job's earlier nodes,
  // common/collective/node_link.h), this rank's shard is init + the ranks' shards, in rank order.
  absl::Status ReduceScatterF32(float* buf, int64_t shard_numel, absl::Duration timeout, const float* init = nullptr);
  // out[r * numel, +numel) = rank r's `local` for every rank r (context parallelism's gather of a
  // layer's keys and values). local may alias this rank's slice of out. INVALID_ARGUMENT when one
  // rank's part does not fit a buffer; ABORTED / DEADLINE_EXCEEDED from the waits.
  absl::Status AllGatherF32(const float* local, int64_t numel, float* out, absl::Duration timeout);

  int world() const { return world_; }
  int rank() const { return rank_; }
  uint64_t buffer_bytes() const { return buffer_bytes_; }
  const std::string& segment_name() const { return segment_->name(); }
  absl::Status Unlink() { return segment_->Unlink(); }

  struct Control;  // the shared layout, below

 private:
  ShmCollective(std::unique_ptr<ShmSegment> segment, const AbortWord* abort)
      : segment_(std::move(segment)), abort_(abort) {}
  absl::Status Bind();
  absl::Status Barrier(absl::Duration timeout);
  float* buffer(int r) const { return reinterpret_cast<float*>(buffers_ + static_cast<uint64_t>(r) * buffer_bytes_); }

  std::unique_ptr<ShmSegment> segment_;
  const AbortWord* abort_ = nullptr;
  Control* control_ = nullptr;
  uint8_t* buffers_ = nullptr;
  int world_ = 0;
  int rank_ = -1;
  uint64_t buffer_bytes_ = 0;
};

// The collective segment's "control" region; the "buffers" region holds world buffers of
// buffer_bytes each.
struct ShmCollective::Control {
  uint32_t world;
  uint32_t reserved;
  uint64_t buffer_bytes;  // stride between rank buffers (page multiple)
  alignas(64) std::atomic<uint32_t> arrived{0};
  alignas(64) std::atomic<uint32_t> generation{0};  // the futex word: +1 each time all arrive
  uint8_t pad[60];
};
static_assert(std::is_standard_layout_v<ShmCollective::Control> && sizeof(ShmCollective::Control) % 64 == 0);

}  // namespace slidedp::shm
