// StepUpdates: the LayerAdam updates of one optimizer step.
//
// Apply() submits a range of a unit to LayerAdam (Skip() marks one done unchanged); the job's
// UnitTracker (hostd/update) knows when every element of the unit is done and then opens its
// version gate (t+1), so the
// workers' next forward can read it while later units are still being updated. A gradient read
// straight from a ring slot releases that slot once its update is done. Drain() (also run by the
// destructor: updates may read staging or ring memory) waits for every submitted update.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/model/model_config.h"
#include "hostd/update/adamw_kernels.h"
#include "hostd/update/grad_norm.h"
#include "hostd/update/layer_adam.h"
#include "hostd/update/unit_tracker.h"
#include "shm/grad_ring.h"

namespace slidedp::hostd {

// A chunk StepUpdates refuses before it submits anything: a range outside its unit, or one already
// taken this step (applied, speculated or skipped). Only a broken worker posts one, so the caller
// fails the job naming that worker. INTERNAL, marked with a payload: IsRangeRefusal tells it from
// LayerAdam's own failures without reading the message or reinterpreting the code.
absl::Status RangeRefusal(absl::string_view what);
bool IsRangeRefusal(const absl::Status& s);

class StepUpdates {
 public:
  // `version`: the 1-based optimizer step these updates make (every unit's gate opens at it when
  // its elements are done). `params.step` is AdamW's step count for the bias correction, which
  // counts only applied updates: version minus the steps skipped before (train.skip_nonfinite).
  // `layout` (may be null) names units and tensors in errors. `updating_step` (the job state's
  // word, may be null) is set to `version` before the first update begins: a restarted hostd then
  // knows the state may be half updated.
  StepUpdates(update::LayerAdam& adam, absl::Span<const update::UnitMemory> memory, update::UnitTracker& tracker,
              int64_t version, const update::AdamWStepParams& params, const ModelLayout* layout = nullptr,
              std::atomic<uint64_t>* updating_step = nullptr);
  ~StepUpdates();
  StepUpdates(const StepUpdates&) = delete;
  StepUpdates& operator=(const StepUpdates&) = delete;

  // Updates [offset, offset + numel) of unit u with grad_scale * grad (grad: numel FP32 or BF16
  // values that stay valid until the update is done). With `release_ring`, its `release_slot` is released
  // once the update has read it. With `check` kRefuse LayerAdam checks the gradient as it
  // updates (hostd has not seen it: device staging) and stops at a NaN or inf: the step's Drain
  // is then DATA_LOSS naming the step, unit, element and `origin` (the worker that posted it).
  // With `redo_from` (the unit's undo copy, after a speculative update of the range this step)
  // the update starts from the saved state: the step's update with `grad_scale` instead of 1.
  // A RangeRefusal for a range outside the unit or one already updated this step.
  absl::Status Apply(int u, int64_t offset, int64_t numel, float grad_scale, update::GradPtr grad,
                     shm::GradRing* release_ring = nullptr, uint32_t release_slot = 0,
                     update::NonFiniteGrad check = update::NonFiniteGrad::kApply, std::string origin = "",
                     const update::UndoMemory* redo_from = nullptr);

  // Clipping off: updates [offset, offset + numel) of unit u with `grad` unscaled and adds its
  // squares to `norm` as one chunk (the step's norm, a metric then), summed inside the update
  // (LayerAdam::SubmitGradSquared), so no pass of its own reads the gradient. A gradient hostd has
  // not checked: a NaN or inf stops the update of its block as Apply's kRefuse does, naming
  // `origin`. A RangeRefusal for a range outside the unit or one already updated this step (so
  // the norm counts each element once).
  absl::Status ApplySquared(int u, int64_t offset, int64_t numel, update::GradPtr grad, shm::GradRing* release_ring,
                            uint32_t release_slot, std::string origin, update::GradNormAccumulator& norm);

  // ---- Speculative clipping (docs/layeradam.md) ----
  // Updates [offset, offset + numel) of unit u with grad_scale 1 before the step's norm is known,
  // saving what it overwrites in `undo` (the unit's undo copy); the unit's gate stays closed until
  // CommitSpeculation. A RangeRefusal for a range outside the unit or one speculated before this
  // step.
  absl::Status Speculate(int u, const update::UndoMemory& undo, int64_t offset, int64_t numel, update::GradPtr grad,
                         shm::GradRing* release_ring = nullptr, uint32_t release_slot = 0,
                         update::NonFiniteGrad check = update::NonFiniteGrad::kApply, std::string origin = "");
  // Waits for every speculative update of the step; the first error of any of them.
  absl::Status WaitSpeculation();
  // The norm says c == 1: the speculative updates are the step's (bit for bit what Apply with
  // grad_scale 1 gives): every speculated range counts as done and the gates open. After
  // WaitSpeculation.
  absl::Status CommitSpeculation();
  // Puts every speculated range back as it was before the step (master, m, v from the undo
  // copies, the mirror from master) and waits. After WaitSpeculation.
  absl::Status RestoreSpeculation();
  // Whether every element of unit u was speculated this step (then a redo must start from its
  // undo copy), and how many elements were in all.
  bool Speculated(int u) const;
  int64_t speculated_numel() const;
  // Marks [offset, offset + numel) of unit u done for this step without changing it (a skipped
  // step): the unit's gate opens when all its elements are done, applied or skipped. A
  // RangeRefusal for a range outside the unit or one already done this step.
  // Runs once, before the first Skip() of the step opens any gate (hostd counts the skipped step in
  // the job state there, so a restarted hostd never sees the gates of a skipped step without it).
  void SetBeforeFirstSkip(std::function<void()> fn) { before_first_skip_ = std::move(fn); }
  absl::Status Skip(int u, int64_t offset, int64_t numel);
  // Waits for every submitted update; the first error of any of them.
  absl::Status Drain();
  // When the step's first update was submitted (InfiniteFuture before any).
  absl::Time first_submit() const;

 private:
  // `as_applied`: LayerAdam's checked kernels found it (hostd's squares did not show it first).
  absl::Status NonFiniteError(int u, const update::NonFiniteGradElement& e, const std::string& origin,
                              bool as_applied) const;
  // An update's end: releases its ring slot (if any) and names a refused non-finite element.
  absl::Status Completed(int u, shm::GradRing* release_ring, uint32_t release_slot, const std::string& origin,
                         absl::Status s, bool as_applied = true) const;
  // Counts a submission; the first one stores updating_step.
  void BeginSubmit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct SpecRange {
    int unit;
    int64_t offset;
    int64_t numel;
    update::UndoMemory undo;
  };

  update::LayerAdam& adam_;
  absl::Span<const update::UnitMemory> memory_;
  update::UnitTracker& tracker_;
  const int64_t version_;
  const update::AdamWStepParams params_;
  const ModelLayout* layout_;
  std::function<void()> before_first_skip_;
  std::atomic<uint64_t>* const updating_step_;
  mutable absl::Mutex mu_;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  int spec_pending_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status spec_error_ ABSL_GUARDED_BY(mu_);
  std::vector<SpecRange> spec_ranges_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> spec_numel_ ABSL_GUARDED_BY(mu_);  // per unit
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  absl::Time first_submit_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

}  // namespace slidedp::hostd
