// GradConsumer: takes one step's gradients out of the ranks' rings and has them applied.
//
// Three consumers (RoutePlan::consumer, hostd/engine/job_plan.h):
// - shards: every posted part is final (gpu route, or device staging); one thread per rank takes
//   that rank's ring until its shard of every unit is in (ranks may post different numbers of
//   chunks) and applies each part from its ring slot at once, or, with host staging, copies it
//   into staging and releases the slot;
// - direct: one rank without clipping; each chunk is applied straight from its ring slot.
// Without clipping (no staging) shards and direct parts are applied with their squares summed by
// the update itself (StepUpdates::ApplySquared): hostd reads the gradient once, in LayerAdam;
// the norm (a metric then) is whole when the step's updates are, so ConsumeStep waits for them.
// - summed: rank 0's next chunk, then the same chunk from ranks 1..R-1, summed in rank order into
//   staging (results do not depend on arrival order); applied at once without clipping.
// With device staging each rank posts its squared norm first (summed in rank order), so the
// clipping coefficient is known before any part arrives. With host staging the coefficient
// follows from the whole step's norm (update::GradNormAccumulator: squares summed in (unit,
// offset) order), then every unit is applied from staging in forward order, so the next step's
// forward can start on the first units.
//
// Chunks come in the job's gradient type (runtime.grad_dtype: FP32, or BF16, which LayerAdam reads
// as it is and staging widens exactly).
//
// Nothing a worker posts is trusted: every descriptor is checked (step, unit, dtype, inside the
// rank's shard, no element twice, a slot the producer acquired) or the job fails with INTERNAL
// naming the worker (id and rank); hostd never reads or writes outside its buffers for it.
//
// Non-finite gradients never reach the master weights. The squares every chunk's norm needs show
// them at no extra cost (a sum of squares in double is finite exactly when every element is):
// - without staging each chunk is checked as it is applied (summed route: before): LayerAdam
//   forms a block's squares before it updates the block, and refuses a non-finite one; the job
//   fails with DATA_LOSS naming the step, the unit, the element and the worker (the parts applied
//   before it keep this step's update; the job's checkpoints are all from before);
// - with staging (clipping, or train.skip_nonfinite, which stages like clipping) nothing is
//   applied until the whole step is known: the staged chunks' squares (host), or every rank's
//   posted squared norm (device, whose parts are then drained and checked to name the unit). A
//   non-finite step then fails the job (DATA_LOSS, nothing of the step applied) or, with
//   NonFinitePolicy::kSkip, is skipped: nothing is applied and every unit's gate opens at t+1
//   unchanged. kSkip also skips a step whose loss is not finite on some rank (LossCheck, asked
//   once the gradient is known finite and before anything is applied);
// - device-staged parts are applied with NonFiniteGrad::kRefuse: LayerAdam checks each block as
//   it updates it, so a part with a NaN that its rank's posted norm did not show (a broken
//   worker) stops there and the step fails with DATA_LOSS (StepUpdates names unit, element and
//   worker).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model/model_config.h"
#include "hostd/engine/job_plan.h"
#include "hostd/engine/step_updates.h"
#include "hostd/engine/undo_arena.h"
#include "hostd/engine/worker_reports.h"
#include "hostd/update/grad_norm.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

// The job's rings on hostd's side: Pop waits in short slices, polling the workers' reports in
// between (rank 0's communicator id is relayed from there while the first gradients are awaited),
// and fails the job after the spec's step timeout. A corrupt descriptor is INTERNAL naming the
// worker.
class GradRings {
 public:
  GradRings(std::vector<std::unique_ptr<shm::GradRing>>& rings, WorkerReports& reports, shm::JobState& job_state,
            absl::Duration step_timeout);
  absl::StatusOr<shm::GradChunkDesc> Pop(int rank, bool first_step);
  shm::GradRing& ring(int rank) { return *rings_[rank]; }
  // The chunk's elements in its ring slot (FP32 or BF16, as d.kind; checked against the plan's
  // before this is called).
  update::GradPtr grad(int rank, const shm::GradChunkDesc& d) const {
    const void* data = rings_[rank]->slot_data(d.slot);
    if (d.kind == shm::ChunkKind::kGradBF16) return static_cast<const bf16_t*>(data);
    return static_cast<const float*>(data);
  }
  // Raises the abort word: every party (workers, the other consumers) stops waiting.
  void Abort();
  // hostd's verdict on step t for the workers (device staging with speculation).
  void PublishVerdict(int64_t t, const shm::StepVerdict& v, int speculate_from_unit) {
    job_state_.PublishVerdict(t, v, speculate_from_unit);
  }
  // Abort(), and INTERNAL: "<worker> (rank r) <what>".
  absl::Status FailRank(int rank, const std::string& what);
  std::string WorkerName(int rank) const { return reports_.WorkerName(rank); }

 private:
  std::vector<std::unique_ptr<shm::GradRing>>& rings_;
  WorkerReports& reports_;
  shm::JobState& job_state_;
  const absl::Duration step_timeout_;
};

// Where a step's host time went (the metrics' busy_s), its gradient norm, and whether it was
// skipped.
struct StepGradients {
  double grad_norm = 0;
  double wait_s = 0;       // waiting for chunks (the slowest rank's, with one consumer per rank)
  double aggregate_s = 0;  // copying, summing and squaring them
  // Waiting for the step's last updates inside ConsumeStep (clipping off: their squares make the
  // norm); the rest of the tail comes after it.
  double update_tail_s = 0;
  // NonFinitePolicy::kSkip: nothing of the step was applied, because of `skipped_because`
  // ("gradient of unit 5 (layer.3) is not finite: ...", "loss is NaN on worker w (rank 1)").
  bool skipped = false;
  std::string skipped_because;
  // Speculative clipping: elements updated before the norm was known, and whether they had to be
  // redone or restored (the norm clipped, or the step was not finite).
  int64_t speculated_numel = 0;
  bool rolled_back = false;
  // Without staging, the squares of the units SetWholeUnits named (part of grad_norm's): a sharded
  // state's units every node holds whole, which the job's norm counts once.
  double whole_unit_squares = 0;
};

// train.skip_nonfinite: each rank's loss of step t (0-based), checked before the step's updates;
// "" when every one is finite, else which is not ("loss is NaN on worker w (rank 1)").
using LossCheck = std::function<absl::StatusOr<std::string>(int64_t t)>;

class GradConsumer {
 public:
  GradConsumer(const RoutePlan& plan, const ModelLayout& layout, GradRings& rings, double max_grad_norm,
               int aggregate_threads, std::string job_id, NonFinitePolicy policy = NonFinitePolicy::kFail,
               LossCheck loss_check = nullptr);
  // Allocates and first-touches the staging buffer where the plan has one (tens of GB for large
  // models: before the workers are assigned, so neither the first step nor the id relay waits).
  void AllocateStaging(int threads);
  int64_t staging_bytes_held() const;
  // Speculative clipping (undo_arena.h) with `arena`'s units, from step `first_step` on; with device
  // staging the workers learn it from the verdict published here (and after every step).
  void EnableSpeculation(const UndoArena* arena, int64_t first_step);
  // A sharded state's units every node holds whole (StepGradients::whole_unit_squares).
  void SetWholeUnits(std::vector<int> units) { whole_units_ = std::move(units); }
  // How much to speculate is measured, not fixed: after each step the workers' waits say whether
  // the host was behind after the norm (gate waits: speculate more of the model, i.e. the first
  // speculated unit moves down) or during backward (ring waits for free slots: speculate less),
  // one step of the controller per call, within the arena. Speculating everything the arena holds
  // is not best where the host is the bottleneck (42 instead of 30 B/param during backward).
  void ObserveWaits(double gate_wait_s, double ring_wait_s);
  int speculate_from_unit() const { return speculate_from_; }
  // Takes step t's gradients out of every ring and has `updates` apply (or skip) them.
  absl::StatusOr<StepGradients> ConsumeStep(int64_t t, bool first_step, StepUpdates& updates);

 private:
  // What ConsumeRank does with each part: apply it (or stage it, with host staging), update it
  // speculatively (device staging, before the norm), or take it out of the ring unapplied,
  // checking it (device staging when the step is not applied).
  enum class PartAction { kApply, kSpeculate, kDiscard };
  // Units [begin, end) of the forward order.
  struct UnitSpan {
    int begin = 0;
    int end = 0;
  };
  // The first non-finite element the step's checks found, by (unit, offset).
  struct NonFiniteElement {
    int unit = 0;
    int64_t offset = 0;
    float value = 0;
    int rank = 0;  // who posted it (-1: only the ranks' sum is not finite)
  };

  // Rank r's squared norm of step t (device staging); a non-finite one is described in `nonfinite`.
  absl::StatusOr<double> PopRankNorm(int r, int64_t t, bool first_step, double& wait_s, std::string& nonfinite);
  // Device staging: the ranks' norms, speculative parts before them when the step speculates,
  // hostd's verdict, then the parts the verdict asks for.
  absl::StatusOr<StepGradients> ConsumeDeviceStaged(int64_t t, bool first_step, StepUpdates& updates);
  // Host staging, once the whole step is staged: commit or redo what was speculated, apply the
  // rest in forward order (or skip the step).
  absl::Status ApplyHostStaged(int64_t t, StepUpdates& updates, StepGradients& out);
  // Host staging: updates a staged range speculatively where the arena covers its unit.
  absl::Status SpeculateStaged(int unit, int64_t offset, int64_t numel, bool finite, StepUpdates& updates);
  // Runs body(r, threads, wait_s, aggregate_s) for every rank at once, one thread each.
  using RankBody = std::function<absl::Status(int r, int threads, double& wait_s, double& aggregate_s)>;
  absl::Status ForEachRank(const RankBody& body, StepGradients& out);
  absl::Status ConsumeShards(int64_t t, bool first_step, float coef, PartAction action, UnitSpan units,
                             StepUpdates& updates, update::GradNormAccumulator& norm, StepGradients& out);
  absl::Status ConsumeRank(int r, int64_t t, bool first_step, float coef, PartAction action, UnitSpan units,
                           int threads, StepUpdates& updates, update::GradNormAccumulator& norm, double& wait_s,
                           double& aggregate_s);
  // One checked part `d` of rank r (its data `src`), taken as `action` and the plan's staging say:
  // checked and skipped (kDiscard), updated speculatively (kSpeculate), applied with its squares
  // summed by the update (no staging), squared and staged (host staging) or applied with `coef`
  // (device staging). A range StepUpdates refuses fails the rank ("posted a gradient chunk twice").
  absl::Status TakePart(int r, const shm::GradChunkDesc& d, update::GradPtr src, float coef, PartAction action,
                        int threads, StepUpdates& updates, update::GradNormAccumulator& norm, double& aggregate_s);
  // Rank 0's next whole-unit chunk of step t (direct and summed consumers), checked.
  absl::StatusOr<shm::GradChunkDesc> PopRankZeroChunk(int64_t t, bool first_step, StepGradients& out);
  absl::Status ConsumeDirect(int64_t t, bool first_step, StepUpdates& updates, update::GradNormAccumulator& norm,
                             StepGradients& out);
  absl::Status ConsumeSummed(int64_t t, bool first_step, StepUpdates& updates, update::GradNormAccumulator& norm,
                             StepGradients& out);
  // Squares of src[0, numel) as elements [offset, offset + numel) of `unit` (posted by `rank`),
  // on the norm grid (update::NormBlockSquares) over `threads` threads, optionally copied into
  // dst; the chunk's sum goes to `norm`. Returns whether every element was finite (and records
  // the first that is not).
  absl::StatusOr<bool> SquarePieces(int rank, int unit, int64_t offset, int64_t numel, update::GradPtr src,
                                    float* dst, int threads, update::GradNormAccumulator& norm);
  // Records a non-finite element of `unit` in src[0, numel) (first in (unit, offset) order wins).
  void NoteNonFinite(int rank, int unit, int64_t offset, const float* src, int64_t numel);
  void NoteNonFinite(int rank, int unit, int64_t offset, update::GradPtr src, int64_t numel);
  // "gradient of unit 5 (layer.3) is not finite: <tensor>[i, j] is NaN (posted by <worker>)", or "".
  std::string NonFiniteGradient() const;
  // What to do once the step's gradient is known (staged or its norm posted) and nothing applied:
  // "" apply; a reason: skip it (kSkip); an error (kFail): DATA_LOSS, the job fails.
  absl::StatusOr<std::string> Decide(int64_t t, const std::string& gradient_nonfinite);
  absl::Status NonFiniteError(int64_t t, const std::string& what, const char* applied);

  const RoutePlan& plan_;
  const ModelLayout& layout_;
  GradRings& rings_;
  const double max_grad_norm_;
  const int aggregate_threads_;
  const std::string job_id_;
  const NonFinitePolicy policy_;
  const LossCheck loss_check_;
  std::vector<int64_t> unit_numel_;
  std::vector<int> whole_units_;  // SetWholeUnits
  std::vector<std::vector<float>> staging_;  // per unit, where the plan has host staging
  const UndoArena* arena_ = nullptr;         // speculative clipping, when enabled
  bool speculate_step_ = false;              // this step speculates (what the last verdict said)
  int speculate_from_ = 0;                   // this step speculates units [speculate_from_, num_units)
  int next_from_ = 0;                        // the next step's, as the controller has it
  std::atomic<bool> speculation_stopped_{false};  // host staging: a non-finite chunk ended it this step
  mutable absl::Mutex nonfinite_mu_;
  std::optional<NonFiniteElement> nonfinite_ ABSL_GUARDED_BY(nonfinite_mu_);  // this step's first
};

}  // namespace slidedp::hostd
