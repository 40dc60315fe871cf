// Learning-rate schedules of a job: constant, linear or cosine decay after a linear warmup, with an
// optional floor (min_lr), defined exactly as Hugging Face transformers' schedulers
// (get_constant_schedule_with_warmup, get_linear_schedule_with_warmup,
// get_cosine_with_min_lr_schedule_with_warmup) so a job reproduces an HF Trainer run.
//
// Step numbering follows HF: LrAt(s) is the LR used by the update that follows s completed
// updates. The first update uses LrAt(0), which is 0 whenever warmup_steps > 0 (HF's LambdaLR
// evaluates the multiplier at step 0 before the first optimizer.step()). Adam's bias-correction
// exponent for that update is s + 1.
//
//   warmup (s < warmup_steps):  base_lr * s / warmup_steps
//   constant:                   base_lr
//   linear:                     base_lr * (r + (1 - r) * max(0, (total - s) / (total - warmup)))
//   cosine:                     base_lr * (r + (1 - r) * 0.5 * (1 + cos(pi * p))),
//                               p = (s - warmup) / (total - warmup)
// with r = min_lr / base_lr (0 when min_lr is 0; HF's linear schedule has no floor, this is the
// natural extension). Deviation from HF: beyond total_steps the cosine keeps its final value
// instead of rising again (p is clamped to 1); a job never runs that far.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp::update {

enum class LrScheduleKind { kConstant, kLinear, kCosine };

std::string LrScheduleKindName(LrScheduleKind kind);
// "constant" | "linear" | "cosine" (HF's names "constant_with_warmup" and
// "cosine_with_min_lr" are accepted as aliases).
absl::StatusOr<LrScheduleKind> ParseLrScheduleKind(absl::string_view name);

struct LrScheduleConfig {
  LrScheduleKind kind = LrScheduleKind::kConstant;
  double base_lr = 1e-5;
  int64_t warmup_steps = 0;
  // Number of updates of the job. Required (> 0) for linear and cosine; for constant, 0 means
  // unbounded.
  int64_t total_steps = 0;
  double min_lr = 0.0;  // floor of the decay, 0 <= min_lr <= base_lr
};

class LrSchedule {
 public:
  // INVALID_ARGUMENT naming the field for: non-finite or negative base_lr/min_lr,
  // min_lr > base_lr, negative warmup/total, total == 0 for linear/cosine,
  // warmup_steps > total_steps (when total_steps > 0).
  static absl::StatusOr<LrSchedule> Create(const LrScheduleConfig& config);

  // Learning rate of the update after `step` completed updates (step >= 0; negative is treated
  // as 0).
  double LrAt(int64_t step) const;
  // LrAt(step) / base_lr (HF's lr_lambda); 0 when base_lr is 0.
  double MultiplierAt(int64_t step) const;

  const LrScheduleConfig& config() const { return config_; }

 private:
  explicit LrSchedule(const LrScheduleConfig& config) : config_(config) {}
  LrScheduleConfig config_;
};

}  // namespace slidedp::update
