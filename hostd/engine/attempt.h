// TrainingExecutor::Attempt: one attempt of a job as the executor's files share it (the step loop,
// training_executor.cc; its setup, training_executor_setup.cc; the predictions,
// training_executor_plan.cc), split by concern: the spec, layout and plan it runs, the data it
// verified, what its steps measured, the step loop's components, its outputs, and its
// shared-memory segments, which release themselves when the attempt ends. Internal to hostd/engine.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "common/data/dataset.h"
#include "common/jobspec/job_spec.h"
#include "common/model/model_config.h"
#include "common/model/node_shard.h"
#include "checkpoint/checkpoint.h"
#include "hostd/engine/grad_consumer.h"
#include "hostd/engine/host_state_pool.h"
#include "hostd/engine/job_plan.h"
#include "hostd/engine/step_metrics.h"
#include "hostd/engine/training_executor.h"
#include "hostd/engine/undo_arena.h"
#include "hostd/engine/worker_reports.h"
#include "hostd/metrics/tensorboard_sink.h"
#include "hostd/update/layer_adam.h"
#include "hostd/update/schedule.h"
#include "hostd/update/unit_tracker.h"
#include "hostd/update/weight_decay.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"
#include "shm/shm_collective.h"

namespace slidedp::hostd {

// The attempt's shared-memory segments: the job's state (taken over from a dead hostd, a pooled
// one adopted, or new), the per-rank gradient rings and the CPU workers' collectives. They live as
// long as the attempt: whatever ends it, the destructor releases them (ReleaseAll). Only the
// job-runner thread uses them.
class AttemptSegments {
 public:
  // `workers`: the job's ranks (the context's list, read at the end), told to drop their mappings
  // of a state segment that goes away.
  AttemptSegments(HostStatePool& pool, const HostStatePool::Holders& workers);
  ~AttemptSegments() { ReleaseAll(); }
  AttemptSegments(const AttemptSegments&) = delete;
  AttemptSegments& operator=(const AttemptSegments&) = delete;

  // The pooled segment when it fits `layout` (HostStatePool::Take), held until AdoptPooled; one
  // never adopted (the job refused at admission) goes back into the pool at the end. Null: none.
  const shm::JobState* TakePooled(const ModelLayout& layout, const shm::StateFormat& format);
  // The taken pooled segment becomes the job's state (HostStatePool::Adopt: renamed, laid out
  // again for `layout`); on error it is unlinked and no state is held.
  absl::Status AdoptPooled(const std::string& job_id, const ModelLayout& layout, const shm::StateFormat& format,
                           int prefault_threads);
  // A new state segment of the job's own.
  void Hold(std::unique_ptr<shm::JobState> state) { state_ = std::move(state); }
  // The state a dead hostd left for this job (TrainingExecutor::AdoptInterruptedState), at `step`.
  void HoldTakenOver(std::unique_ptr<shm::JobState> state, int64_t step);
  shm::JobState& state() { return *state_; }
  const shm::JobState& state() const { return *state_; }
  bool reused() const { return reused_; }  // the state is a pooled segment: its moments need zeroing
  // Taken over from a dead hostd: the step its state holds exactly.
  std::optional<int64_t> taken_over_step() const { return taken_over_step_; }

  // The plan's rings (one per rank), CPU collective and context groups' collectives, on the
  // state's abort word.
  absl::Status CreateExchange(const std::string& node_name, const std::string& job_id, const RoutePlan& plan);
  std::vector<std::unique_ptr<shm::GradRing>>& rings() { return rings_; }
  // Rank r's segments, named in its assignment.
  void NameSegments(int rank, v1::Assignment& assignment) const;

  // DMA before Adam: `adam` pauses while a rank's urgent-copy word in the state is raised
  // (update::LayerAdam::SetCopyPriority), until the release clears it before the state goes.
  absl::Status PrioritizeCopies(update::LayerAdam& adam, int world, double yield_fraction, absl::Duration max_pause);
  // The job succeeded and every worker reported its end: the state goes back into the pool.
  void MarkPoolable() { poolable_ = true; }

 private:
  // The attempt's end: LayerAdam stops reading the state's urgent-copy words, the abort word wakes
  // every worker still waiting, the rings and collectives are unlinked, and the state is pooled
  // or unlinked (HostStatePool::Finish, which tells the workers to drop their mappings); then a
  // pooled segment that was never adopted goes back into the pool.
  void ReleaseAll();

  HostStatePool& pool_;
  const HostStatePool::Holders& workers_;
  std::unique_ptr<shm::JobState> pooled_;  // taken from the pool and not (yet) adopted
  std::unique_ptr<shm::JobState> state_;
  bool reused_ = false;
  std::optional<int64_t> taken_over_step_;
  update::LayerAdam* copy_priority_reader_ = nullptr;  // reads the state's urgent-copy words
  std::vector<std::unique_ptr<shm::GradRing>> rings_;
  std::unique_ptr<shm::ShmCollective> collective_;
  std::vector<std::unique_ptr<shm::ShmCollective>> context_collectives_;  // per context group
  int context_ranks_ = 1;
  bool poolable_ = false;
};

// What the attempt's steps measured, and AutoPolicy's prediction the job's last line compares them
// with (an AutoPolicy layout's predicted step, cached or chosen by this attempt).
struct StepMeasurements {
  double predicted_step_s = 0;
  std::string predicted_bottleneck;
  int64_t layout_from_step = 0;                        // 1-based: the first step that ran the layout
  std::vector<std::pair<int64_t, double>> step_times;  // (1-based step, seconds)
  double peak_tflops = 0;     // the slowest rank's dense BF16 peak (DenseBf16PeakTflops), 0: unknown
  int64_t skipped_steps = 0;  // train.skip_nonfinite: steps that changed nothing
  double prev_update_s = -1;  // the step before's host_update_s (-1: none yet)
  absl::Time run_start, step_start;
};

// The step loop's components on hostd's side: LayerAdam and the units' state it updates, the
// schedule, the gates (UnitTracker), the workers' reports, the rings' consumer and speculative
// clipping's undo copies. Built over the attempt's segments once its state is written.
struct StepLoop {
  // NUMA placement: each unit's state lives on the node of the LayerAdam threads that own it; the
  // owners touch (and, where pages already sit elsewhere, migrate) it before use.
  absl::Status PlaceUnits(const ModelLayout& layout, const JobSpec& spec, shm::JobState& js);

  update::LayerAdam* adam = nullptr;
  int bulk_threads = 1;                    // prefault, zeroing, conversion, staging first touch
  std::vector<update::UnitMemory> memory;  // per unit, placed on its LayerAdam threads' node
  // Per unit, its tensors' element ranges and weight decay (optimizer.no_decay): LayerAdam updates
  // these and never the padding.
  std::vector<std::vector<update::ElementRange>> tensor_ranges;
  int64_t first_step = 0;
  std::optional<update::LrSchedule> schedule;
  std::unique_ptr<update::UnitTracker> tracker;  // opens each unit's gate when its update is done
  std::unique_ptr<WorkerReports> reports;
  std::unique_ptr<GradRings> grad_rings;
  std::unique_ptr<GradConsumer> consumer;
  std::unique_ptr<UndoArena> undo;  // speculative clipping's undo copies, where the plan has them
};

// The data the attempt trains and validates on, as verified at its start (the workers check their
// files against these identities).
struct AttemptData {
  std::vector<data::FileIdentity> dataset_files;
  // Validation (data.validation): the split's files, its micro-batches (common/data/validation.h)
  // and trained tokens; none when validation is empty.
  std::vector<data::FileIdentity> validation_files;
  int64_t validation_micro_batches = 0;
  int64_t validation_tokens = 0;
};

// What the attempt writes: its metrics, TensorBoard events and checkpoints.
struct AttemptOutputs {
  std::unique_ptr<MetricsFile> metrics;
  std::unique_ptr<metrics::TensorBoardSink> tensorboard;  // output.tensorboard
  std::string last_checkpoint;
  // The model's tokenizer files and generation_config.json, read once at the attempt's start (a
  // hostile one fails the job there, not at its first save) and copied into every checkpoint.
  std::vector<checkpoint::ModelDirFile> model_files;
  // The model's untrained tensors, written into every checkpoint (InitialState::pass_through).
  checkpoint::PassThrough pass_through;
};

// One attempt of a job.
struct TrainingExecutor::Attempt {
  // `model`: the model's layout; `sharding` (runtime.node_state sharded) cuts it to this node's ranges.
  Attempt(JobSpec s, ModelLayout model, NodeSharding sh, RoutePlan p, HostStatePool& pool,
          const HostStatePool::Holders& workers)
      : spec(std::move(s)),
        model_layout(std::move(model)),
        sharding(std::move(sh)),
        layout(NodeLayout(model_layout, sharding)),
        plan(std::move(p)),
        segments(pool, workers) {}
  const JobSpec spec;
  const ModelLayout model_layout;  // the whole model's (the workers', the checkpoints')
  const NodeSharding sharding;     // not sharded() unless runtime.node_state sharded over nodes
  const ModelLayout layout;        // what this hostd holds: model_layout, or its ranges of a sharded state
  RoutePlan plan;          // (SizeSpeculation completes it after admission)
  std::string policy_key;  // runtime.policy auto, measured by this attempt: its cache key (policy_cache.h)
  StepMeasurements measured;
  StepLoop loop;
  AttemptData data;
  AttemptOutputs outputs;
  // Last, so that it goes first: whatever ends the attempt, the segments are released before the
  // outputs and the loop's components are destroyed (those refer to the segments, and use none of
  // them when destroyed).
  AttemptSegments segments;
};

}  // namespace slidedp::hostd
