// UnitStreamer: how a unit's BF16 parameters reach the compute device (gradients leave through
// worker/pipeline/gradient_path.h). The version gate is checked here: Acquire(unit, t) returns
// only once step t-1's update of the unit is published (version >= t).
//
// HostMirrorStreamer (CPU backend): the device IS host memory, so parameters are read in place
// from the shared-memory mirror. The CUDA streamer
// (worker/pipeline/cuda_streamer.*) copies through a bounded window of GPU slots instead.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/collective/node_link.h"
#include "common/model/model_config.h"
#include "common/model/node_shard.h"
#include "common/numeric/bf16.h"
#include "shm/job_state.h"
#include "shm/shm_collective.h"
#include "worker/pipeline/cast_pool.h"
#include "worker/compute/backend.h"

namespace slidedp {

// Where a unit's BF16 array comes from (runtime.param_source): hostd's mirror, or the FP32 master
// cast to BF16 (FloatToBf16, the same bits) by the streamer after the unit's gate, when the
// segment keeps no mirror.
enum class UploadSource { kMirror, kMaster };

class UnitStreamer {
 public:
  virtual ~UnitStreamer() = default;
  // The unit's parameters on the device, valid until Release(unit): its BF16 array, and (unless
  // the streamer was made without) the FP32 side copy of its norm weights, read from the master
  // after the same gate (TensorSlot::fp32_offset). Waits for the gate.
  virtual absl::StatusOr<UnitParams> Acquire(int unit, uint32_t min_version) = 0;
  virtual void Release(int unit) = 0;
  // Starts bringing `unit` in while the compute already queued runs: waits for its gate, then
  // queues the copy. The step runner calls it right after queuing the previous unit's compute,
  // at the same point of the program on every rank, so loads (and, with sharded delivery, their
  // all-gathers) are issued in the same order everywhere.
  virtual absl::Status Prefetch(int unit, uint32_t min_version) { return absl::OkStatus(); }
  // Seconds spent blocked on version gates, and copying host-to-device, since construction.
  virtual double gate_wait_s() const = 0;
  virtual double h2d_s() const = 0;
  // Host seconds spent casting the master to BF16 (UploadSource::kMaster), since construction.
  virtual double cast_s() const { return 0; }
  // Device memory the streamer holds (its parameter window), for the reported GPU peak.
  virtual int64_t device_bytes() const { return 0; }
};

class HostMirrorStreamer : public UnitStreamer {
 public:
  // kFp32FromMaster: the FP32 side copies are copied from the master at each Acquire; the
  // embedding's FP32 rows are the master itself.
  // UploadSource::kMaster: Acquire casts the unit's master into a buffer held until its last
  // Release (an acquire of a held unit under the same gate reuses it), so memory is bounded by the
  // units held at once.
  // kMaster casts on `cast_threads` threads (a CastPool).
  HostMirrorStreamer(shm::JobState* state, const ModelLayout& layout, absl::Duration gate_timeout,
                     Dtype norms = Dtype::kF32, Dtype embedding = Dtype::kF32,
                     UploadSource source = UploadSource::kMirror, int cast_threads = 1);
  absl::StatusOr<UnitParams> Acquire(int unit, uint32_t min_version) override;
  void Release(int unit) override;
  double gate_wait_s() const override { return gate_wait_s_; }
  double h2d_s() const override { return 0; }
  double cast_s() const override { return cast_s_; }

  // runtime.node_state sharded (common/model/node_shard.h): the segment holds this node's range of each
  // sharded unit. Acquire then assembles the whole unit: this rank's local shard of the node's range
  // goes to the same local rank of every node over `link` (an all-gather), then this node's ranks
  // all-gather each node's range through `collective` (null with one rank); the FP32 side copies of the
  // norm weights come from their owners' masters the same way. Every rank calls Acquire in the same order.
  void ShardOverNodes(const NodeSharding* sharding, NodeLink* link, shm::ShmCollective* collective, int rank,
                      int world);

 private:
  // The whole BF16 unit into `values` (PaddedNumel over every rank of the job) and its norms' FP32 side
  // copy into `side`, from every node's range.
  absl::Status GatherUnit(int unit, std::vector<bf16_t>& values, std::vector<float>& side);
  bool ShardedUnit(int unit) const { return SplitsUnit(sharding_, unit); }

  shm::JobState* state_;
  // The hostd whose gates this job waits on, as it was when the job started (a restarted hostd
  // taking the segment over must not keep a wait for a dead one alive).
  shm::ProcessIdentity publisher_;
  const ModelLayout& layout_;
  absl::Duration gate_timeout_;
  Dtype norms_;
  Dtype embedding_;
  std::vector<std::vector<float>> side_;  // per unit
  UploadSource source_;
  struct Cast {
    std::vector<bf16_t> values;
    uint32_t gate = 0;
    int users = 0;
  };
  std::vector<Cast> casts_;                  // per unit (kMaster): empty while not held
  std::vector<std::vector<bf16_t>> spare_;   // released buffers, reused
  std::unique_ptr<CastPool> cast_pool_;      // kMaster
  const NodeSharding* sharding_ = nullptr;   // ShardOverNodes
  NodeLink* link_ = nullptr;
  shm::ShmCollective* collective_ = nullptr;
  int rank_ = 0;
  int world_ = 1;
  std::vector<bf16_t> contribution_, gathered_;  // GatherUnit's scratch
  std::vector<float> side_mine_, side_all_;
  double gate_wait_s_ = 0;
  double cast_s_ = 0;
};

}  // namespace slidedp
