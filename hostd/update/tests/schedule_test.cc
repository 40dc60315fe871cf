// LR schedules against values computed by hand from Hugging Face transformers' formulas, and the
// config validation.
#include "hostd/update/schedule.h"

#include <cmath>
#include <numbers>

#include "gtest/gtest.h"

namespace slidedp::update {
namespace {

LrSchedule Make(LrScheduleKind kind, double lr, int64_t warmup, int64_t total, double min_lr = 0) {
  absl::StatusOr<LrSchedule> s = LrSchedule::Create({kind, lr, warmup, total, min_lr});
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

TEST(LrSchedule, ConstantWithWarmup) {
  LrSchedule s = Make(LrScheduleKind::kConstant, 2e-5, 4, 0);
  EXPECT_EQ(s.LrAt(0), 0.0);  // HF: the first update of a warmup schedule uses lr 0
  EXPECT_DOUBLE_EQ(s.LrAt(1), 0.5e-5);
  EXPECT_DOUBLE_EQ(s.LrAt(3), 1.5e-5);
  EXPECT_DOUBLE_EQ(s.LrAt(4), 2e-5);
  EXPECT_DOUBLE_EQ(s.LrAt(1000000), 2e-5);
  LrSchedule flat = Make(LrScheduleKind::kConstant, 1e-4, 0, 10);
  EXPECT_DOUBLE_EQ(flat.LrAt(0), 1e-4);
  EXPECT_DOUBLE_EQ(flat.LrAt(-3), 1e-4);
}

TEST(LrSchedule, LinearMatchesHf) {
  // get_linear_schedule_with_warmup(warmup=10, total=100): max(0, (100 - s) / 90) after warmup.
  LrSchedule s = Make(LrScheduleKind::kLinear, 1e-3, 10, 100);
  EXPECT_EQ(s.LrAt(0), 0.0);
  EXPECT_DOUBLE_EQ(s.LrAt(5), 5e-4);
  EXPECT_DOUBLE_EQ(s.LrAt(10), 1e-3);
  EXPECT_DOUBLE_EQ(s.LrAt(55), 1e-3 * 45.0 / 90.0);
  EXPECT_DOUBLE_EQ(s.LrAt(99), 1e-3 / 90.0);
  EXPECT_EQ(s.LrAt(100), 0.0);
  EXPECT_EQ(s.LrAt(150), 0.0);
  // No warmup: the first update uses the full lr.
  EXPECT_DOUBLE_EQ(Make(LrScheduleKind::kLinear, 1e-3, 0, 4).LrAt(0), 1e-3);
  EXPECT_DOUBLE_EQ(Make(LrScheduleKind::kLinear, 1e-3, 0, 4).LrAt(1), 0.75e-3);
}

TEST(LrSchedule, LinearWithFloor) {
  LrSchedule s = Make(LrScheduleKind::kLinear, 1.0, 0, 10, 0.2);
  EXPECT_DOUBLE_EQ(s.LrAt(5), 0.5 * 0.8 + 0.2);
  EXPECT_DOUBLE_EQ(s.LrAt(10), 0.2);
  EXPECT_DOUBLE_EQ(s.LrAt(30), 0.2);
}

TEST(LrSchedule, CosineMatchesHf) {
  // get_cosine_schedule_with_warmup(warmup=10, total=110, num_cycles=0.5).
  LrSchedule s = Make(LrScheduleKind::kCosine, 1.0, 10, 110);
  EXPECT_DOUBLE_EQ(s.LrAt(3), 0.3);
  EXPECT_DOUBLE_EQ(s.LrAt(10), 1.0);
  EXPECT_NEAR(s.LrAt(35), 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-15);  // 0.85355...
  EXPECT_NEAR(s.LrAt(35), 0.8535533905932737, 1e-15);
  EXPECT_NEAR(s.LrAt(60), 0.5, 1e-15);
  EXPECT_NEAR(s.LrAt(85), 0.1464466094067262, 1e-15);
  EXPECT_NEAR(s.LrAt(110), 0.0, 1e-15);
  EXPECT_NEAR(s.LrAt(200), 0.0, 1e-15);  // clamped past total (HF would rise again)
}

TEST(LrSchedule, CosineWithMinLrMatchesHf) {
  // get_cosine_with_min_lr_schedule_with_warmup(min_lr_rate = 1e-6 / 1e-5 = 0.1).
  LrSchedule s = Make(LrScheduleKind::kCosine, 1e-5, 10, 110, 1e-6);
  EXPECT_EQ(s.LrAt(0), 0.0);  // warmup starts at 0, not at min_lr (as HF)
  EXPECT_DOUBLE_EQ(s.LrAt(5), 0.5e-5);
  EXPECT_NEAR(s.LrAt(60), 1e-5 * (0.5 * 0.9 + 0.1), 1e-20);
  EXPECT_NEAR(s.LrAt(110), 1e-6, 1e-20);
  EXPECT_NEAR(s.LrAt(500), 1e-6, 1e-20);
}

TEST(LrSchedule, RejectsBadConfigs) {
  auto code = [](LrScheduleConfig c) { return LrSchedule::Create(c).status().code(); };
  const auto kBad = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code({LrScheduleKind::kLinear, 1e-3, 20, 10, 0}), kBad);  // warmup > total
  EXPECT_EQ(code({LrScheduleKind::kConstant, 1e-3, 20, 10, 0}), kBad);
  EXPECT_EQ(code({LrScheduleKind::kCosine, 1e-3, -1, 10, 0}), kBad);
  EXPECT_EQ(code({LrScheduleKind::kCosine, 1e-3, 0, -5, 0}), kBad);
  EXPECT_EQ(code({LrScheduleKind::kCosine, 1e-3, 0, 0, 0}), kBad);  // decay needs a length
  EXPECT_EQ(code({LrScheduleKind::kCosine, -1e-3, 0, 10, 0}), kBad);
  EXPECT_EQ(code({LrScheduleKind::kCosine, NAN, 0, 10, 0}), kBad);
  EXPECT_EQ(code({LrScheduleKind::kCosine, 1e-3, 0, 10, 2e-3}), kBad);  // min_lr > lr
  EXPECT_EQ(code({LrScheduleKind::kCosine, 1e-3, 0, 10, -1e-9}), kBad);
  EXPECT_TRUE(LrSchedule::Create({LrScheduleKind::kConstant, 1e-3, 5, 0, 0}).ok());
  EXPECT_TRUE(LrSchedule::Create({LrScheduleKind::kLinear, 1e-3, 10, 10, 0}).ok());
  absl::Status s = LrSchedule::Create({LrScheduleKind::kLinear, 1e-3, 20, 10, 0}).status();
  EXPECT_NE(s.message().find("warmup_steps (20) exceeds total_steps (10)"), absl::string_view::npos)
      << s;
}

TEST(LrSchedule, ParsesKinds) {
  EXPECT_EQ(*ParseLrScheduleKind("cosine"), LrScheduleKind::kCosine);
  EXPECT_EQ(*ParseLrScheduleKind("cosine_with_min_lr"), LrScheduleKind::kCosine);
  EXPECT_EQ(*ParseLrScheduleKind("linear"), LrScheduleKind::kLinear);
  EXPECT_EQ(*ParseLrScheduleKind("constant_with_warmup"), LrScheduleKind::kConstant);
  EXPECT_EQ(ParseLrScheduleKind("polynomial").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LrScheduleKindName(LrScheduleKind::kLinear), "linear");
}

}  // namespace
}  // namespace slidedp::update
