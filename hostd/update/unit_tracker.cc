// UnitTracker: per-unit coverage of the current step's chunks; see unit_tracker.h.
#include "hostd/update/unit_tracker.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace slidedp::update {

UnitTracker::UnitTracker(std::vector<int64_t> unit_numel, UnitDoneFn on_unit_done,
                         int64_t completed_step)
    : on_unit_done_(std::move(on_unit_done)) {
  units_.resize(unit_numel.size());
  for (size_t u = 0; u < unit_numel.size(); ++u) {
    units_[u].numel = unit_numel[u];
    units_[u].completed_step = completed_step;
  }
}

absl::StatusOr<std::function<void(absl::Status)>> UnitTracker::Track(int unit, int64_t step,
                                                                     int64_t offset,
                                                                     int64_t numel) {
  absl::MutexLock l(&mu_);
  if (unit < 0 || unit >= static_cast<int>(units_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("UnitTracker: unit ", unit, " not in [0, ", units_.size(), ")"));
  }
  UnitState& s = units_[unit];
  if (numel <= 0 || offset < 0 || offset > s.numel || numel > s.numel - offset) {
    return absl::InvalidArgumentError(absl::StrCat("UnitTracker: chunk [", offset, ", +", numel,
                                                   ") of unit ", unit, " outside its ", s.numel,
                                                   " elements"));
  }
  if (step != s.completed_step + 1) {
    return absl::FailedPreconditionError(absl::StrCat("UnitTracker: unit ", unit, " got step ",
                                                      step, " but its next step is ",
                                                      s.completed_step + 1));
  }
  const int64_t end = offset + numel;
  auto it = std::lower_bound(s.ranges.begin(), s.ranges.end(), std::make_pair(offset, end));
  const bool overlaps_next = it != s.ranges.end() && it->first < end;
  const bool overlaps_prev = it != s.ranges.begin() && std::prev(it)->second > offset;
  if (overlaps_next || overlaps_prev) {
    return absl::AlreadyExistsError(absl::StrCat("UnitTracker: chunk [", offset, ", ", end,
                                                 ") of unit ", unit, " step ", step,
                                                 " overlaps a chunk already registered"));
  }
  s.ranges.insert(it, {offset, end});
  s.registered += numel;
  return std::function<void(absl::Status)>(
      [this, unit, step, numel](absl::Status status) { ChunkFinished(unit, step, numel, status); });
}

void UnitTracker::ChunkFinished(int unit, int64_t step, int64_t numel, const absl::Status& status) {
  absl::Status unit_status;
  {
    absl::MutexLock l(&mu_);
    UnitState& s = units_[unit];
    s.finished += numel;
    if (!status.ok() && s.first_error.ok()) {
      s.first_error = Annotate(status, unit, step);
    }
    if (s.finished < s.numel) return;
    // Registration refuses overlaps and ranges outside the unit, so finished == numel means every
    // element was covered exactly once.
    unit_status = s.first_error;
    if (unit_status.ok()) s.completed_step = step;
    s.registered = 0;
    s.finished = 0;
    s.ranges.clear();
    s.first_error = absl::OkStatus();
  }
  if (on_unit_done_) on_unit_done_(unit, step, unit_status);
}

absl::Status UnitTracker::Annotate(const absl::Status& s, int unit, int64_t step) {
  return absl::Status(s.code(), absl::StrCat("unit ", unit, " step ", step, ": ", s.message()));
}

int64_t UnitTracker::completed_step(int unit) const {
  absl::MutexLock l(&mu_);
  return units_[unit].completed_step;
}

bool UnitTracker::WaitForStep(int unit, int64_t step, absl::Duration timeout) const {
  absl::MutexLock l(&mu_);
  auto done = [this, unit, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return units_[unit].completed_step >= step;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

}  // namespace slidedp::update
