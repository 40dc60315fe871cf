// GradConsumer: takes one step's gradients out of the ranks' rings and has them applied.
//
// Three consumers (JobPlan::consumer, hostd/engine/job_plan.h):
// - shards: every posted part is final (gpu route, or device staging); one thread per rank takes
//   that rank's ring until its shard of every unit is in (ranks may post different numbers of
//   chunks) and applies each part from its ring slot at once, or, with host staging, copies it
//   into staging and releases the slot;
// - direct: one rank without clipping; each chunk is applied straight from its ring slot;
// - summed: rank 0's next chunk, then the same chunk from ranks 1..R-1, summed in rank order into
//   staging (results do not depend on arrival order); applied at once without clipping.
// With device staging each rank posts its squared norm first (summed in rank order), so the
// clipping coefficient is known before any part arrives. With host staging the coefficient
// follows from the whole step's norm (update::GradNormAccumulator: squares summed in (unit,
// offset) order), then every unit is applied from staging in forward order, so the next step's
// forward can start on the first units. Every chunk is checked (step, unit, dtype, range) or the
// job fails with INTERNAL.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model/qwen3_config.h"
#include "hostd/engine/job_plan.h"
#include "hostd/engine/step_updates.h"
#include "hostd/engine/worker_reports.h"
#include "hostd/update/grad_norm.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

// The job's rings on hostd's side: Pop waits in short slices, polling the workers' reports in
// between (rank 0's communicator id is relayed from there while the first gradients are awaited),
// and fails the job after the spec's step timeout.
class GradRings {
 public:
  GradRings(std::vector<std::unique_ptr<shm::GradRing>>& rings, WorkerReports& reports, shm::JobState& job_state,
            absl::Duration step_timeout);
  absl::StatusOr<shm::GradChunkDesc> Pop(int rank, bool first_step);
  shm::GradRing& ring(int rank) { return *rings_[rank]; }
  const float* f32(int rank, const shm::GradChunkDesc& d) const {
    return static_cast<const float*>(rings_[rank]->slot_data(d.slot));
  }
  // Raises the abort word: every party (workers, the other consumers) stops waiting.
  void Abort();
  // Abort(), and INTERNAL with `what`.
  absl::Status Fail(const std::string& what);

 private:
  std::vector<std::unique_ptr<shm::GradRing>>& rings_;
  WorkerReports& reports_;
  shm::JobState& job_state_;
  const absl::Duration step_timeout_;
};

// Where a step's host time went (the metrics' busy_s), and its gradient norm.
struct StepGradients {
  double grad_norm = 0;
  double wait_s = 0;       // waiting for chunks (the slowest rank's, with one consumer per rank)
  double aggregate_s = 0;  // copying, summing and squaring them
};

class GradConsumer {
 public:
  GradConsumer(const JobPlan& plan, const ModelLayout& layout, GradRings& rings, double max_grad_norm,
               int aggregate_threads, std::string job_id);
  // Allocates and first-touches the staging buffer where the plan has one (tens of GB for large
  // models: before the workers are assigned, so neither the first step nor the id relay waits).
  void AllocateStaging(int threads);
  int64_t staging_bytes_held() const;
  // Takes step t's gradients out of every ring and has `updates` apply them.
  absl::StatusOr<StepGradients> ConsumeStep(int64_t t, bool first_step, StepUpdates& updates);

 private:
  absl::StatusOr<double> PopRankNorms(int64_t t, bool first_step, StepGradients& out);
  absl::Status ConsumeShards(int64_t t, bool first_step, float coef, StepUpdates& updates,
                             update::GradNormAccumulator& norm, StepGradients& out);
  absl::Status ConsumeRank(int r, int64_t t, bool first_step, float coef, int threads, StepUpdates& updates,
                           update::GradNormAccumulator& norm, double& wait_s, double& aggregate_s);
  // Rank 0's next whole-unit chunk of step t (direct and summed consumers), checked.
  absl::StatusOr<shm::GradChunkDesc> PopRankZeroChunk(int64_t t, bool first_step, StepGradients& out);
  absl::Status ConsumeDirect(int64_t t, bool first_step, StepUpdates& updates, update::GradNormAccumulator& norm,
                             StepGradients& out);
  absl::Status ConsumeSummed(int64_t t, bool first_step, StepUpdates& updates, update::GradNormAccumulator& norm,
                             StepGradients& out);
  // Squares of src[0, numel) as elements [offset, offset + numel) of `unit`, in 4 MiB pieces on
  // `threads` threads, optionally copied into dst; each piece's sum goes to `norm`.
  absl::Status SquarePieces(int unit, int64_t offset, int64_t numel, const float* src, float* dst, int threads,
                            update::GradNormAccumulator& norm);

  const JobPlan& plan_;
  const ModelLayout& layout_;
  GradRings& rings_;
  const double max_grad_norm_;
  const int aggregate_threads_;
  const std::string job_id_;
  std::vector<int64_t> unit_numel_;
  std::vector<std::vector<float>> staging_;  // per unit, where the plan has host staging
};

}  // namespace slidedp::hostd
