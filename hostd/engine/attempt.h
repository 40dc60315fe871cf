// TrainingExecutor::Attempt: one attempt of a job as the executor's files share it (the step loop,
// training_executor.cc, and the predictions, training_executor_plan.cc): the spec, layout and plan
// it runs, the segments and components it owns, and what its steps measured. Internal to
// hostd/engine.
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
#include "hostd/checkpoint/checkpoint.h"
#include "hostd/engine/grad_consumer.h"
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

// One attempt of a job: what its steps need, and the segments its end releases.
struct TrainingExecutor::Attempt {
  Attempt(JobSpec s, ModelLayout l, RoutePlan p) : spec(std::move(s)), layout(std::move(l)), plan(std::move(p)) {}
  const JobSpec spec;
  const ModelLayout layout;
  RoutePlan plan;  // (SizeSpeculation completes it after admission)
  std::string policy_key;  // runtime.policy auto, measured by this attempt: its cache key (policy_cache.h)
  // An AutoPolicy layout's predicted step (cached, or chosen by this attempt) and the steps that
  // ran it: the job's final line compares them.
  double predicted_step_s = 0;
  std::string predicted_bottleneck;
  int64_t layout_from_step = 0;  // 1-based: the first step that ran the layout
  std::vector<std::pair<int64_t, double>> step_times;  // (1-based step, seconds)
  update::LayerAdam* adam = nullptr;
  int bulk_threads = 1;                   // prefault, zeroing, conversion, staging first touch
  std::unique_ptr<shm::JobState> pooled;  // taken from the pool and not (yet) adopted
  std::unique_ptr<shm::JobState> job_state;
  bool reused_state = false;
  std::optional<int64_t> shm_step;  // resumed from the state a dead hostd left: its step
  std::vector<std::unique_ptr<shm::GradRing>> rings;
  std::unique_ptr<shm::ShmCollective> collective;
  std::vector<std::unique_ptr<shm::ShmCollective>> context_collectives;  // per context group
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
  std::unique_ptr<MetricsFile> metrics;
  std::unique_ptr<metrics::TensorBoardSink> tensorboard;  // output.tensorboard
  std::string last_checkpoint;
  std::vector<data::FileIdentity> dataset_files;  // as verified at the attempt's start
  // Validation (data.validation): the split's files as verified at the attempt's start, its
  // micro-batches (common/data/validation.h) and trained tokens; none when validation is empty.
  std::vector<data::FileIdentity> validation_files;
  int64_t validation_micro_batches = 0;
  double peak_tflops = 0;  // the slowest rank's dense BF16 peak (DenseBf16PeakTflops), 0: unknown
  int64_t validation_tokens = 0;
  // The model's tokenizer files and generation_config.json, read once at the attempt's start (a
  // hostile one fails the job there, not at its first save) and copied into every checkpoint.
  std::vector<checkpoint::ModelDirFile> model_files;
  int64_t skipped_steps = 0;                      // train.skip_nonfinite: steps that changed nothing
  double prev_update_s = -1;                      // the step before's host_update_s (-1: none yet)
  absl::Time run_start, step_start;
  bool poolable = false;  // the job succeeded and every worker reported its end
};

}  // namespace slidedp::hostd
