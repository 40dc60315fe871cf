// HF-compatible learning-rate schedules; see schedule.h for the formulas.
#include "hostd/update/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace slidedp::update {

std::string LrScheduleKindName(LrScheduleKind kind) {
  switch (kind) {
    case LrScheduleKind::kConstant:
      return "constant";
    case LrScheduleKind::kLinear:
      return "linear";
    case LrScheduleKind::kCosine:
      return "cosine";
  }
  return "unknown";
}

absl::StatusOr<LrScheduleKind> ParseLrScheduleKind(absl::string_view name) {
  if (name == "constant" || name == "constant_with_warmup") return LrScheduleKind::kConstant;
  if (name == "linear") return LrScheduleKind::kLinear;
  if (name == "cosine" || name == "cosine_with_min_lr") return LrScheduleKind::kCosine;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown lr schedule '", name, "' (expected constant, linear or cosine)"));
}

absl::StatusOr<LrSchedule> LrSchedule::Create(const LrScheduleConfig& c) {
  if (!std::isfinite(c.base_lr) || c.base_lr < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr schedule: base_lr must be finite and >= 0, got ", c.base_lr));
  }
  if (!std::isfinite(c.min_lr) || c.min_lr < 0 || c.min_lr > c.base_lr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lr schedule: min_lr must be in [0, base_lr=", c.base_lr, "], got ", c.min_lr));
  }
  if (c.warmup_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr schedule: warmup_steps must be >= 0, got ", c.warmup_steps));
  }
  if (c.total_steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr schedule: total_steps must be >= 0, got ", c.total_steps));
  }
  if (c.kind != LrScheduleKind::kConstant && c.total_steps == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("lr schedule: ", LrScheduleKindName(c.kind), " needs total_steps > 0"));
  }
  if (c.total_steps > 0 && c.warmup_steps > c.total_steps) {
    return absl::InvalidArgumentError(absl::StrCat("lr schedule: warmup_steps (", c.warmup_steps,
                                                   ") exceeds total_steps (", c.total_steps, ")"));
  }
  return LrSchedule(c);
}

double LrSchedule::MultiplierAt(int64_t step) const {
  const LrScheduleConfig& c = config_;
  step = std::max<int64_t>(step, 0);
  if (step < c.warmup_steps) {
    return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, c.warmup_steps));
  }
  if (c.kind == LrScheduleKind::kConstant) return 1.0;
  const double floor_rate = c.base_lr > 0 ? c.min_lr / c.base_lr : 0.0;
  const double decay_steps =
      static_cast<double>(std::max<int64_t>(1, c.total_steps - c.warmup_steps));
  double factor;
  if (c.kind == LrScheduleKind::kLinear) {
    factor = std::max(0.0, static_cast<double>(c.total_steps - step) / decay_steps);
  } else {
    const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) / decay_steps);
    factor = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
  if (floor_rate > 0) factor = factor * (1.0 - floor_rate) + floor_rate;
  return std::max(0.0, factor);
}

double LrSchedule::LrAt(int64_t step) const { return config_.base_lr * MultiplierAt(step); }

}  // namespace slidedp::update
