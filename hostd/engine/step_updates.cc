// StepUpdates: one step's LayerAdam updates and gate openings; see step_updates.h.
#include "hostd/engine/step_updates.h"

#include <cmath>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace slidedp::hostd {

StepUpdates::StepUpdates(update::LayerAdam& adam, absl::Span<const update::UnitMemory> memory,
                         update::UnitTracker& tracker, int64_t version, const update::AdamWStepParams& params,
                         const ModelLayout* layout, std::atomic<uint64_t>* updating_step)
    : adam_(adam),
      memory_(memory),
      tracker_(tracker),
      version_(version),
      params_(params),
      layout_(layout),
      updating_step_(updating_step),
      spec_numel_(memory.size(), 0) {}

StepUpdates::~StepUpdates() { (void)Drain(); }

void StepUpdates::BeginSubmit() {
  pending_++;
  if (first_submit_ == absl::InfiniteFuture()) {
    first_submit_ = absl::Now();
    // Before LayerAdam writes anything of this step (its queue orders the store before).
    if (updating_step_ != nullptr) updating_step_->store(static_cast<uint64_t>(version_));
  }
}

namespace {
constexpr char kRangeRefusalPayload[] = "slidedp.hostd/step_updates.range_refused";
}  // namespace

absl::Status RangeRefusal(absl::string_view what) {
  absl::Status s = absl::InternalError(what);
  s.SetPayload(kRangeRefusalPayload, absl::Cord());
  return s;
}

bool IsRangeRefusal(const absl::Status& s) { return s.GetPayload(kRangeRefusalPayload).has_value(); }

absl::Status StepUpdates::Apply(int u, int64_t offset, int64_t numel, float grad_scale, update::GradPtr grad,
                                shm::GradRing* release_ring, uint32_t release_slot, update::NonFiniteGrad check,
                                std::string origin, const update::UndoMemory* redo_from) {
  // Registered before submission: a range outside the unit, or one already updated this step,
  // is refused here (a worker that posted it is broken).
  absl::StatusOr<std::function<void(absl::Status)>> unit_done = tracker_.Track(u, version_, offset, numel);
  if (!unit_done.ok()) {
    if (release_ring != nullptr) (void)release_ring->Release(release_slot);
    return RangeRefusal(unit_done.status().message());
  }
  update::AdamWStepParams p = params_;
  p.grad_scale = grad_scale;
  p.nonfinite_grad = check;
  {
    absl::MutexLock l(&mu_);
    BeginSubmit();
  }
  absl::Status submitted = adam_.SubmitGrad(
      memory_[u], offset, numel, grad, p,
      [this, u, release_ring, release_slot, origin = std::move(origin), done = std::move(*unit_done)](absl::Status s) {
        s = Completed(u, release_ring, release_slot, origin, std::move(s));
        done(s);  // the unit's gate opens when this was its last range
        absl::MutexLock l(&mu_);
        if (!s.ok() && first_error_.ok()) first_error_ = s;
        pending_--;
      },
      redo_from, redo_from != nullptr ? update::UndoMode::kRedo : update::UndoMode::kNone);
  if (!submitted.ok()) {  // `done` will not run
    absl::MutexLock l(&mu_);
    pending_--;
  }
  return submitted;
}

absl::Status StepUpdates::ApplySquared(int u, int64_t offset, int64_t numel, update::GradPtr grad,
                                       shm::GradRing* release_ring, uint32_t release_slot, std::string origin,
                                       update::GradNormAccumulator& norm) {
  absl::StatusOr<std::function<void(absl::Status)>> unit_done = tracker_.Track(u, version_, offset, numel);
  if (!unit_done.ok()) {
    if (release_ring != nullptr) (void)release_ring->Release(release_slot);
    return RangeRefusal(unit_done.status().message());
  }
  update::AdamWStepParams p = params_;
  p.nonfinite_grad = update::NonFiniteGrad::kRefuse;
  {
    absl::MutexLock l(&mu_);
    BeginSubmit();
  }
  auto squares = std::make_shared<std::vector<double>>(update::NormBlockCount(offset, numel));
  double* block_squares = squares->data();
  absl::Status submitted = adam_.SubmitGradSquared(
      memory_[u], offset, numel, grad, p, block_squares,
      [this, u, offset, numel, release_ring, release_slot, origin = std::move(origin), squares = std::move(squares),
       &norm, done = std::move(*unit_done)](absl::Status s) {
        s = Completed(u, release_ring, release_slot, origin, std::move(s), /*as_applied=*/false);
        if (s.ok()) {
          s = norm.AddPartial(u, offset, numel, update::SumBlockSquares(squares->data(), squares->size()));
          if (!s.ok()) s = absl::InternalError(s.message());  // (the tracker refuses overlaps first)
        }
        done(s);  // the unit's gate opens when this was its last range
        absl::MutexLock l(&mu_);
        if (!s.ok() && first_error_.ok()) first_error_ = s;
        pending_--;
      });
  if (!submitted.ok()) {  // `done` will not run
    absl::MutexLock l(&mu_);
    pending_--;
  }
  return submitted;
}

absl::Status StepUpdates::Speculate(int u, const update::UndoMemory& undo, int64_t offset, int64_t numel,
                                    update::GradPtr grad, shm::GradRing* release_ring, uint32_t release_slot,
                                    update::NonFiniteGrad check, std::string origin) {
  auto refuse = [&](std::string what) {
    if (release_ring != nullptr) (void)release_ring->Release(release_slot);
    return RangeRefusal(what);
  };
  if (u < 0 || u >= static_cast<int>(memory_.size()) || numel <= 0 || offset < 0 ||
      offset > memory_[u].numel - numel) {
    return refuse(absl::StrCat("speculative update of unit ", u, " [", offset, ", +", numel, ") outside the unit"));
  }
  update::AdamWStepParams p = params_;
  p.grad_scale = 1.0f;
  p.nonfinite_grad = check;
  {
    absl::MutexLock l(&mu_);
    for (const SpecRange& r : spec_ranges_) {
      if (r.unit == u && offset < r.offset + r.numel && r.offset < offset + numel) {
        return refuse(absl::StrCat("unit ", u, " [", offset, ", +", numel, ") speculated twice in step ", version_));
      }
    }
    spec_ranges_.push_back(SpecRange{u, offset, numel, undo});
    spec_numel_[u] += numel;
    BeginSubmit();
    spec_pending_++;
  }
  absl::Status submitted = adam_.SubmitGrad(
      memory_[u], offset, numel, grad, p,
      [this, u, release_ring, release_slot, origin = std::move(origin)](absl::Status s) {
        s = Completed(u, release_ring, release_slot, origin, std::move(s));
        absl::MutexLock l(&mu_);
        if (!s.ok() && spec_error_.ok()) spec_error_ = s;
        spec_pending_--;
        pending_--;
      },
      &undo, update::UndoMode::kSave);
  if (!submitted.ok()) {
    absl::MutexLock l(&mu_);
    spec_pending_--;
    pending_--;
  }
  return submitted;
}

absl::Status StepUpdates::WaitSpeculation() {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return spec_pending_ == 0; };
  mu_.Await(absl::Condition(&idle));
  return spec_error_;
}

absl::Status StepUpdates::CommitSpeculation() {
  std::vector<SpecRange> ranges;
  {
    absl::MutexLock l(&mu_);
    if (spec_pending_ != 0) return absl::InternalError("CommitSpeculation before WaitSpeculation");
    ranges = spec_ranges_;
  }
  for (const SpecRange& r : ranges) {
    absl::StatusOr<std::function<void(absl::Status)>> unit_done = tracker_.Track(r.unit, version_, r.offset, r.numel);
    if (!unit_done.ok()) return absl::InternalError(unit_done.status().message());
    (*unit_done)(absl::OkStatus());  // the unit's gate opens when this was its last range
  }
  return absl::OkStatus();
}

absl::Status StepUpdates::RestoreSpeculation() {
  std::vector<SpecRange> ranges;
  {
    absl::MutexLock l(&mu_);
    if (spec_pending_ != 0) return absl::InternalError("RestoreSpeculation before WaitSpeculation");
    ranges = spec_ranges_;
  }
  absl::Mutex done_mu;
  int left = static_cast<int>(ranges.size());
  absl::Status first;
  for (const SpecRange& r : ranges) {
    absl::Status s = adam_.SubmitRestore(memory_[r.unit], r.offset, r.numel, r.undo, [&](absl::Status st) {
      absl::MutexLock l(&done_mu);
      if (!st.ok() && first.ok()) first = st;
      left--;
    });
    if (!s.ok()) {
      absl::MutexLock l(&done_mu);
      if (first.ok()) first = s;
      left--;
    }
  }
  absl::MutexLock l(&done_mu);
  auto all = [&left]() { return left == 0; };
  done_mu.Await(absl::Condition(&all));
  return first;
}

bool StepUpdates::Speculated(int u) const {
  absl::MutexLock l(&mu_);
  return u >= 0 && u < static_cast<int>(spec_numel_.size()) && spec_numel_[u] == memory_[u].numel;
}

int64_t StepUpdates::speculated_numel() const {
  absl::MutexLock l(&mu_);
  int64_t n = 0;
  for (int64_t x : spec_numel_) n += x;
  return n;
}

absl::Status StepUpdates::Completed(int u, shm::GradRing* release_ring, uint32_t release_slot,
                                    const std::string& origin, absl::Status s, bool as_applied) const {
  if (release_ring != nullptr) {
    absl::Status released = release_ring->Release(release_slot);
    if (s.ok()) s = released;
  }
  if (std::optional<update::NonFiniteGradElement> e = update::NonFiniteGradOf(s)) s = NonFiniteError(u, *e, origin, as_applied);
  return s;
}

absl::Status StepUpdates::NonFiniteError(int u, const update::NonFiniteGradElement& e, const std::string& origin,
                                         bool as_applied) const {
  const UnitLayout* unit = layout_ != nullptr && u < layout_->num_units() ? &layout_->units[u] : nullptr;
  const char* value = std::isnan(e.value) ? "NaN" : e.value > 0 ? "inf" : "-inf";
  return absl::DataLossError(absl::StrCat(
      "step ", version_, ": gradient of unit ", u, unit != nullptr ? absl::StrCat(" (", unit->name, ")") : "",
      " is not finite: ", unit != nullptr ? DescribeUnitElement(*unit, e.offset) : absl::StrCat("element ", e.offset),
      " is ", value, origin.empty() ? "" : absl::StrCat(" (posted by ", origin, as_applied ? ", found as it was applied)" : ")"),
      "; the parts applied before it keep this step's update"));
}

absl::Status StepUpdates::Skip(int u, int64_t offset, int64_t numel) {
  if (before_first_skip_) {
    before_first_skip_();
    before_first_skip_ = nullptr;
  }
  absl::StatusOr<std::function<void(absl::Status)>> unit_done = tracker_.Track(u, version_, offset, numel);
  if (!unit_done.ok()) return RangeRefusal(unit_done.status().message());
  (*unit_done)(absl::OkStatus());  // the unit's gate opens when this was its last range
  return absl::OkStatus();
}

absl::Status StepUpdates::Drain() {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ == 0; };
  mu_.Await(absl::Condition(&idle));
  return first_error_;
}

absl::Time StepUpdates::first_submit() const {
  absl::MutexLock l(&mu_);
  return first_submit_;
}

}  // namespace slidedp::hostd
