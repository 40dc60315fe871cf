// AutoPolicy on one worker (runtime.policy: auto, issue 22): what each decoder layer keeps for its
// backward, and which layers' checkpoints wait in pinned host memory, chosen from measurements of
// this job on this device, in seconds rather than a sweep.
//
//  1. The job's first steps run every layer as whole-layer recompute with nothing offloaded; the
//     second's figures (the first's, in a job of three steps or fewer: the first warms kernel
//     plans and the memory pool up) give the step's costs no layout changes: the compute outside the
//     layers, the parameter and gradient copies, the exposed tail, and the working set (the peak
//     less the layers' checkpoints).
//  2. ProfileLayer runs one decoder layer's forward and backward under each kind (recompute,
//     selective, keep all) over this step's micro-batches, with random weights of the real shapes,
//     and measures its time and what it keeps; the pinned-copy rates come from a probe copy.
//  3. Every kind, with 0, 1/4, 1/2, 3/4 or all of its checkpoints (input and kept pieces, in whole
//     micro-batches) offloaded, is a candidate of the step model (common/policy/layout_solver.h);
//     CBC picks how many layers run each within the device budget (the device, or
//     runtime.gpu_memory_limit, less the working set, less the room the moving checkpoints take)
//     and the pinned host memory left; PlaceLayers orders them.
//     Offloading is chosen only when it predicts a step 3% shorter than the best layout without it
//     (its copies also take host memory bandwidth from LayerAdam, which the model does not see).
//  4. The next two steps (one in a short job) run the layout and validate it, the slower counting:
//     a peak over 95% of the capacity re-solves with the overshoot taken off the budget; a layout
//     that offloads checkpoints and runs slower than predicted is solved again with none offloaded
//     (at most kMaxResolves re-solves in all); then the fastest layout measured runs from the next
//     step, or recompute when none beats the recompute step (Options::time_tolerance), which is
//     then reported and cached as the measured answer.
// The chosen layout (with its measurements, AutoPolicyRecord) goes to hostd, which caches it for
// the next job of the same shape and batch on the same build.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/batch.h"
#include "common/model/model_config.h"
#include "common/policy/layer_policy.h"
#include "worker/compute/backend.h"

namespace slidedp {

// One step's measured figures, as the worker reports them (StepDone).
struct StepObservation {
  double total_s = 0;
  double compute_s = 0;  // total less the flush and the gate waits
  double gate_s = 0;     // the worker thread's waits on version gates (the GPU may still be busy meanwhile)
  double h2d_s = 0;      // copy-engine busy time of the parameter uploads
  double d2h_s = 0;      // and of the gradient downloads
  int64_t peak_bytes = 0;
};

struct LayerProbe {
  LayerPolicy policy;       // (offload 0: a probe times what stays on the device)
  double time_s = 0;        // forward + backward of one layer over the step's micro-batches
  int64_t saved_bytes = 0;  // what the kind keeps beyond the layer input, over the micro-batches
  double forward_s = 0;     // of time_s, the forward's
};

// The kinds AutoPolicy measures: recompute, selective, the segment checkpoints that keep the
// layer's GEMM outputs largest first (gate_up; + qkv; + attention; + o_proj), keep-all; recompute
// alone for a model whose layers keep nothing (ModelShape::layers_keep_pieces).
std::vector<LayerPolicy> ProbedPolicies(const ModelConfig& config);

// Times one decoder layer of `layout` under each of `policies` (best of `repeats` after a warm-up)
// on `micro_batches`: a MoE model's first sparse layer; where layers differ in attention span
// (sliding / full), the first of each span, the probes then the layer-count-weighted mean time and
// the largest kept bytes. A kind whose memory does not fit is left out (logged); the first
// (recompute) must fit.
absl::StatusOr<std::vector<LayerProbe>> ProfileLayer(ComputeBackend* backend, const ModelLayout& layout,
                                                     const std::vector<MicroBatch>& micro_batches,
                                                     const std::vector<LayerPolicy>& policies, int repeats = 2);

struct CopyRates {
  double h2d_bytes_per_s = 0;  // 0: copies cost no time here (the CPU backend's memory is the host's)
  double d2h_bytes_per_s = 0;
};

struct AutoPolicyInputs {
  const ModelLayout* layout = nullptr;
  std::vector<LayerProbe> probes;
  int64_t checkpoint_bytes = 0;  // one layer's input over the step's micro-batches
  int micro_batches = 1;         // a layer's checkpoints per step (the offload shares' grain)
  // The largest step's tokens over the measured step's (>= 1): the layers' bytes are planned for
  // it, since rows hold only their documents' tokens and a later step may hold more.
  double largest_step_scale = 1;
  StepObservation recompute_step;  // every layer recomputed, nothing offloaded
  int64_t capacity_bytes = 0;      // device memory, or runtime.gpu_memory_limit
  int64_t host_budget_bytes = -1;  // pinned host memory for offloaded checkpoints; -1: no bound
  CopyRates rates;
  std::string device_name, build;
  int64_t tokens_per_step = 0;
};

struct AutoPolicyChoice {
  LayerLayout layout;               // with its AutoPolicyRecord
  std::vector<ActPolicy> policies;  // per decoder layer
  std::vector<double> offloaded;    // per unit, the share offloaded; empty: none
  int64_t predicted_peak_bytes = 0;
  std::string summary;  // one line: counts, predicted step and bottleneck
};

// The fraction of the capacity the layout may plan to fill: the rest absorbs the allocator's
// fragmentation and the variation between steps' batches.
inline constexpr double kAutoPolicyUsableFraction = 0.9;
inline constexpr int kMaxResolves = 2;

// Steps 3 of the header: the candidates, their costs and the solve. `device_budget_bytes` < 0:
// the capacity's usable fraction less the working set.
absl::StatusOr<AutoPolicyChoice> ChooseLayout(const AutoPolicyInputs& in, int64_t device_budget_bytes = -1);

// What the backend keeps for a layer policy.
inline ActPolicy ActPolicyOf(const LayerPolicy& p) { return ActPolicy{p.pieces()}; }

// A layout's per-layer kinds and per-unit offload shares as the step runner and the activation
// stores take them (`offloaded` empty: none).
void RunnableLayout(const LayerLayout& layout, int num_units, std::vector<ActPolicy>* policies,
                    std::vector<double>* offloaded);

// The offload shares a kind is a candidate at, for `micro_batches` checkpoints a layer: 0, a
// quarter, a half, three quarters and all of them, in whole micro-batches (fewer than 4: each count).
std::vector<double> OffloadShares(int micro_batches);

// The fixed layouts AutoPolicy is compared with (the sweep: k kept layers x kind x offload
// ratio): for each measured kind but recompute, with no layer or the first half of the layers
// offloaded whole, the last k layers of that kind (the rest recompute) for the largest k whose
// predicted peak fits the same budget as ChooseLayout's. More kept layers never compute more, so
// the largest k stands for its kind and ratio.
struct SweepLayout {
  std::string name;  // "last 20 keep_all, first 18 offloaded"
  AutoPolicyChoice choice;
  double step_s = 0;
  int64_t peak_bytes = 0;
};
std::vector<SweepLayout> SweepLayouts(const AutoPolicyInputs& in);

// The per-job run of steps 1-4: the worker calls AfterStep after each step while active().
class AutoPolicySession {
 public:
  struct Options {
    bool enabled = false;  // runtime.policy auto with no layout given (hostd sends a cached one inline)
    ComputeBackend* backend = nullptr;
    const ModelLayout* layout = nullptr;
    int64_t capacity_bytes = 0;
    int64_t host_budget_bytes = -1;
    std::function<absl::StatusOr<CopyRates>()> measure_rates;  // empty: copies cost no time
    // runtime.checkpoint_dtype: the layer inputs' bytes are planned in CheckpointDType of it.
    Dtype checkpoint_dtype = Dtype::kF32;
    std::string device_name, build;
    int world = 1;
    // The batch the layout is chosen for, all ranks: train.global_batch x train.seq_len (a step's
    // real count varies with the rows' padding; this names the job shape, as the cache key does).
    int64_t tokens_per_step = 0;
    // A layout must beat the recompute step by this fraction's noise: a fastest measured layout
    // slower than (1 + it) x the recompute step goes back to recompute. 1% on a GPU; the CPU
    // backend (CI's) times a tiny model among other processes, so it only catches gross misses.
    double time_tolerance = 0.01;
    // After the layout is validated, measure SweepLayouts one step each, log them against it, and
    // go back to it (SLIDEDP_AUTOPOLICY_SWEEP=1 on the worker: what the GPU suite compares with).
    bool sweep = false;
  };
  explicit AutoPolicySession(Options options) : options_(std::move(options)) {}

  bool active() const { return options_.enabled && phase_ != Phase::kDone; }
  // After step `step` (0-based) ran with the layout in force, `seen` its figures: the layout to run
  // from the next step on, or nullopt to keep the one in force. `steps_left`: the job's steps after
  // this one (a choice nothing runs is not made).
  absl::StatusOr<std::optional<AutoPolicyChoice>> AfterStep(int64_t step, const StepObservation& seen,
                                                            const std::vector<MicroBatch>& micro_batches,
                                                            int64_t steps_left);
  // The host could not pin what the layout AfterStep returned offloads: the layout without offload
  // to run from the next step instead (validated as any other), or every layer recomputed.
  AutoPolicyChoice WithoutOffload();
  // The layout ran its validation step within its budget and no slower than recompute.
  bool validated() const { return validated_; }
  // The step (0-based) that measured the validated layout, its time and peak.
  int64_t validated_step() const { return validated_step_; }
  double validated_step_s() const { return validated_step_s_; }
  int64_t validated_peak_bytes() const { return validated_peak_bytes_; }
  const AutoPolicyChoice& chosen() const { return choice_; }
  double selection_s() const { return selection_s_; }
  bool reported() const { return reported_; }
  void set_reported() { reported_ = true; }

 private:
  enum class Phase { kMeasure, kValidate, kSweep, kDone };
  Options options_;
  Phase phase_ = Phase::kMeasure;
  AutoPolicyInputs inputs_;
  AutoPolicyChoice choice_;
  int resolves_ = 0;
  int warmups_left_ = -1;  // steps still to pass before the measured one (-1: not decided yet)
  struct Measured {
    AutoPolicyChoice choice;
    double step_s = 0;
    int64_t peak_bytes = 0;
    int64_t step = 0;
  };
  // Every layer recomputed, with the record of what was measured (predicted as all recompute), for
  // the report and the cache; nullopt without a record.
  std::optional<AutoPolicyChoice> RecomputeWithRecord(const Measured& measured) const;

  // AfterStep in each phase. kMeasure: probes the layer and chooses the first layout. kSweep: logs
  // the sweep layout that ran, then the next one, or back to the validated layout.
  absl::StatusOr<std::optional<AutoPolicyChoice>> AfterMeasureStep(int64_t step, const StepObservation& seen,
                                                                   const std::vector<MicroBatch>& micro_batches,
                                                                   int64_t steps_left);
  std::optional<AutoPolicyChoice> AfterSweepStep(int64_t step, const StepObservation& seen, bool more_steps);
  // kValidate: a layout over max_peak is re-solved with less room; one that fit is timed, maybe
  // solved again without offload, and the fastest measured is kept.
  absl::StatusOr<std::optional<AutoPolicyChoice>> AfterValidationStep(int64_t step, const StepObservation& seen,
                                                                      int64_t steps_left);
  absl::StatusOr<std::optional<AutoPolicyChoice>> ResolveOverBudget(int64_t step, const StepObservation& seen,
                                                                    double max_peak, bool more_steps);
  // A layout slower than predicted that offloads checkpoints is solved again with every checkpoint on
  // the device: true when that gave the layout to run next (choice_).
  absl::StatusOr<bool> ResolveOnDevice(const StepObservation& timed, int64_t timed_step, bool more_steps);
  // The fastest measured layout, or recompute when none beats the recompute step; the validation ends.
  std::optional<AutoPolicyChoice> KeepFastest(int64_t step, bool more_steps);
  // ChooseLayout over inputs_, its time added to selection_s_.
  absl::StatusOr<AutoPolicyChoice> TimedChooseLayout(int64_t device_budget_bytes = -1);
  // `choice` becomes the layout in force (choice_), its record carrying the selection time so far.
  void Adopt(AutoPolicyChoice choice);
  void SetValidated(AutoPolicyChoice choice, int64_t step, double step_s, int64_t peak_bytes);

  std::vector<Measured> measured_;  // every layout validated within its memory, with its step
  int64_t measure_step_ = -1;       // the recompute step the base costs came from
  std::vector<SweepLayout> sweep_;
  size_t sweep_at_ = 0;
  std::optional<StepObservation> first_look_;  // a layout's first step, while its second runs
  int64_t first_look_step_ = -1;
  int64_t validated_step_ = -1;
  double validated_step_s_ = 0;
  int64_t validated_peak_bytes_ = 0;
  double selection_s_ = 0;
  bool validated_ = false;
  bool reported_ = false;
};

// A validation step may peak at most at this fraction of the capacity; over it the layout is re-solved.
inline constexpr double kAutoPolicyMaxPeakFraction = 0.95;
// A validation step this much slower than predicted, with checkpoints offloaded, is solved again
// with none offloaded.
inline constexpr double kAutoPolicyPredictionSlack = 0.05;
// Offloading must predict a step this much shorter than the best layout without it.
inline constexpr double kAutoPolicyOffloadGain = 0.03;
// A job of at least this many steps left at its first is measured on its third step (two warm-ups).
inline constexpr int64_t kAutoPolicyLongJobSteps = 12;

}  // namespace slidedp
