// UnitTracker: knows when every element of a unit has been updated for step t, so the caller can
// publish the unit's version gate exactly once per step.
//
// A chunk is registered with Track() before it is submitted (overlaps, out-of-range chunks and
// out-of-order steps are refused there, synchronously); the returned callback is LayerAdam's
// `done`. When the registered chunks of a unit cover it completely and all have finished, the
// unit-done callback fires once, with OK or with the first chunk error. On OK the unit's completed
// step advances to t; on error it stays at t - 1 and the step's registrations are cleared (the job
// is expected to abort or retry the step).
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace slidedp::update {

class UnitTracker {
 public:
  // Called without the tracker's lock held, on whichever thread finished the last chunk.
  using UnitDoneFn = std::function<void(int unit, int64_t step, const absl::Status& status)>;

  // unit_numel[u] = elements of unit u. completed_step = the step every unit has already finished
  // (0 for a fresh job, k when resuming after k steps); the next step of every unit is then k+1.
  UnitTracker(std::vector<int64_t> unit_numel, UnitDoneFn on_unit_done, int64_t completed_step = 0);

  // Registers [offset, offset + numel) of `unit` for `step` and returns the completion callback
  // to hand to LayerAdam::SubmitChunk. INVALID_ARGUMENT: bad unit or range, numel <= 0;
  // ALREADY_EXISTS: overlaps a chunk already registered for this step; FAILED_PRECONDITION: step is
  // not the unit's completed step + 1.
  absl::StatusOr<std::function<void(absl::Status)>> Track(int unit, int64_t step, int64_t offset,
                                                          int64_t numel);

  // The last step whose update of `unit` finished successfully.
  int64_t completed_step(int unit) const;
  // Waits until completed_step(unit) >= step; false on timeout.
  bool WaitForStep(int unit, int64_t step, absl::Duration timeout) const;

  int num_units() const { return static_cast<int>(units_.size()); }

 private:
  struct UnitState {
    int64_t numel = 0;
    int64_t completed_step = 0;
    int64_t registered = 0;  // elements registered for step completed_step + 1
    int64_t finished = 0;    // of those, elements whose chunk has finished
    std::vector<std::pair<int64_t, int64_t>> ranges;  // registered [begin, end), sorted
    absl::Status first_error;
  };
  void ChunkFinished(int unit, int64_t step, int64_t numel, const absl::Status& status);
  static absl::Status Annotate(const absl::Status& s, int unit, int64_t step);

  UnitDoneFn on_unit_done_;
  mutable absl::Mutex mu_;
  std::vector<UnitState> units_ ABSL_GUARDED_BY(mu_);
};

}  // namespace slidedp::update
