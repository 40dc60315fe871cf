// GradientPath: how a unit's FP32 weight gradient, accumulated over the step's micro-batches,
// leaves the worker for hostd's gradient ring. Two routes (JobSpec runtime.grad_reduction):
//
//   cpu: every rank posts the whole unit; hostd sums the ranks' copies in rank order.
//   (a multi-node job sums each posted part over the nodes first: `nodes` below)
//   gpu: the ranks reduce-scatter the unit first (NCCL on CUDA; a shared-memory collective for
//        CPU-backend workers), and each posts only its own summed shard (common/model/shard.h),
//        so the host link carries 1/R of the bytes per rank and hostd adds nothing up.
//
// The step runner calls Begin(unit) for a zeroed buffer, lets backward add into it, then
// Finish(unit, step); Flush() at the end of the step returns once every chunk is in the ring.
//
// Device staging (GradientPathOptions::stage_until_norm, assignment grad_staging "device", for
// exact clipping where each rank's part is final: the gpu route, or one rank): Finish keeps the
// rank's final part in device memory (one persistent buffer for all units) and takes its squared
// norm there; Flush posts the rank's sum of squares (Dtype::kSumSquares) and then queues every
// unit's part in forward order, returning without waiting for those posts (hostd applies them with
// the clipping coefficient as they arrive, and the next step's forward follows its gates). Drain()
// waits for them; the gates order the next step's writes into the buffer after the posts.
// Speculative clipping (docs/layeradam.md; options speculate_from_unit and job_state): when hostd's
// verdict on the step before says this step speculates, the parts of the units it names (>= the
// first unit published with it, never below speculate_from_unit) are posted as soon as they are final (still kept, in
// case the norm clips); after the squared norm the path waits for hostd's verdict on the step and posts the other
// parts, or (post_all: the norm clipped, or was not finite) every part again, in forward order. On CUDA, Finish only
// queues work (the collective on the communication stream, the copies on a D2H stream fed by a poster thread): the
// thread issuing compute never waits for a copy, only, through the poster, for free ring slots.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/collective/node_link.h"
#include "common/model/model_config.h"
#include "common/model/node_shard.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"
#include "shm/shm_collective.h"

namespace slidedp {

enum class GradRoute { kCpu, kGpu };

class GradientPath {
 public:
  virtual ~GradientPath() = default;
  // A zeroed FP32 buffer of PaddedNumel(unit numel, world) elements (device memory), valid
  // until Finish(unit). Several units may be open at once (the tied embedding during backward).
  virtual absl::StatusOr<float*> Begin(int unit) = 0;
  // The unit's gradient is complete once the work queued so far on the compute stream is done.
  virtual absl::Status Finish(int unit, int64_t step) = 0;
  // Returns once everything Finish()ed has been posted to the ring (or the first error); with
  // device staging, once the rank's norm is posted and its parts are queued.
  virtual absl::Status Flush() = 0;
  // Returns once everything is posted (the end of a job).
  virtual absl::Status Drain() { return Flush(); }
  // Cumulative seconds: waiting for free ring slots, and copying device-to-host.
  virtual double ring_wait_s() const = 0;
  virtual double d2h_s() const = 0;
  // Device memory the path holds (gradient buffers), for the reported GPU peak.
  virtual int64_t device_bytes() const { return 0; }
};

struct GradientPathOptions {
  GradRoute route = GradRoute::kCpu;
  int rank = 0;
  int world = 1;
  absl::Duration ring_timeout = absl::Minutes(10);
  // Device staging (see above); needs route kGpu or world 1.
  bool stage_until_norm = false;
  // Speculative clipping with device staging (see above); job_state carries hostd's verdicts.
  int speculate_from_unit = std::numeric_limits<int>::max();
  const shm::JobState* job_state = nullptr;
  shm::ProcessIdentity hostd;  // the job's hostd (job_state->owner() at the job's start)
  // runtime.grad_dtype: kBF16 rounds the rank's final part (after the reduce-scatter, before
  // device staging's norm) to BF16 and posts it in BF16, half the bytes; kF32 as it is.
  Dtype dtype = Dtype::kF32;
  // A multi-node job (runtime.nodes): this rank's link to the same local rank on the other nodes.
  // The rank's part (its shard on the gpu route, the whole unit with one rank per node) is summed
  // over every node's ranks in global rank order (ChainReduce) before it is posted, so every node's
  // hostd gets the same global gradient. Null or one node: the node's own ranks only.
  NodeLink* nodes = nullptr;
  // runtime.node_state sharded (common/model/node_shard.h): node n's hostd holds only its range of each
  // sharded unit. The ranks reduce-scatter every node's range of the unit and the nodes chain the pieces
  // (ChainReduceScatter), so this rank ends with the global sum of its local shard of its own node's
  // range and posts it at offsets counted from the range's start (the node's host layout). Null: every
  // node holds every unit whole.
  const NodeSharding* sharding = nullptr;
  // Fault injection for tests: a random delay in [0, max] before every chunk post.
  absl::Duration inject_max_delay = absl::ZeroDuration();
};

// CPU backend: buffers are host memory; the gpu route reduces through `collective` (required
// when route is kGpu and world > 1). Synchronous.
std::unique_ptr<GradientPath> MakeHostGradientPath(const ModelLayout& layout, shm::GradRing* ring,
                                                   shm::ShmCollective* collective, const GradientPathOptions& options);

// Compute-only benchmarks: buffers on the backend, nothing leaves the device.
class ComputeBackend;
std::unique_ptr<GradientPath> MakeDiscardGradientPath(const ModelLayout& layout, ComputeBackend* backend);

// The most elements of `dtype` one ring slot holds (a posted chunk's size).
int64_t GradChunkNumel(const shm::GradRing& ring, Dtype dtype = Dtype::kF32);

}  // namespace slidedp
