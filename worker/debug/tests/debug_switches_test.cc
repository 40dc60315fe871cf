// DebugSwitches: defaults, each switch read, and a malformed value an error naming its variable.
#include "worker/debug/debug_switches.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<DebugSwitches> ReadFrom(const std::map<std::string, std::string>& env) {
  return DebugSwitches::Read([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(DebugSwitches, DefaultsWithoutVariables) {
  absl::StatusOr<DebugSwitches> s = ReadFrom({});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->cpu_device_memory_bytes, 0);
  EXPECT_EQ(s->inject_max_delay, absl::ZeroDuration());
  EXPECT_TRUE(s->inject_nonfinite.empty());
  EXPECT_FALSE(s->autopolicy_sweep);
  EXPECT_FALSE(s->log_unit_norms);
  EXPECT_TRUE(s->cuda_fp32_residual);
  EXPECT_EQ(s->attention, DebugSwitches::Attention::kAuto);
  EXPECT_FALSE(s->deterministic);
  EXPECT_TRUE(s->cudnn_cross_attention);
  EXPECT_TRUE(s->cudnn_window);
  EXPECT_FALSE(s->gpu_memory_ledger);
  EXPECT_EQ(s->cudnn_library, "");
}

TEST(DebugSwitches, ReadsEverySwitch) {
  absl::StatusOr<DebugSwitches> s = ReadFrom({{"SLIDEDP_CPU_DEVICE_MEMORY_BYTES", "123456"},
                                              {"SLIDEDP_INJECT_DELAY_MS", "2.5"},
                                              {"SLIDEDP_INJECT_NONFINITE", "grad:3:2@1,loss:4"},
                                              {"SLIDEDP_AUTOPOLICY_SWEEP", "1"},
                                              {"SLIDEDP_LOG_UNIT_NORMS", "1"},
                                              {"SLIDEDP_CUDA_FP32_RESIDUAL", "0"},
                                              {"SLIDEDP_ATTENTION", "own"},
                                              {"SLIDEDP_DETERMINISTIC", "1"},
                                              {"SLIDEDP_CUDNN_CROSS", "0"},
                                              {"SLIDEDP_CUDNN_WINDOW", "0"},
                                              {"SLIDEDP_GPU_MEMORY_LEDGER", "1"},
                                              {"SLIDEDP_CUDNN_LIB", "/opt/cudnn/lib"}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->cpu_device_memory_bytes, 123456);
  EXPECT_EQ(s->inject_max_delay, absl::Microseconds(2500));
  EXPECT_EQ(s->inject_nonfinite_text, "grad:3:2@1,loss:4");
  ASSERT_EQ(s->inject_nonfinite.size(), 2u);
  EXPECT_EQ(s->inject_nonfinite[0].step, 2);
  EXPECT_EQ(s->inject_nonfinite[0].unit, 2);
  EXPECT_EQ(s->inject_nonfinite[0].rank, 1);
  EXPECT_EQ(s->inject_nonfinite[1].step, 3);
  EXPECT_EQ(s->inject_nonfinite[1].unit, -1);
  EXPECT_EQ(s->inject_nonfinite[1].rank, -1);
  EXPECT_TRUE(s->autopolicy_sweep);
  EXPECT_TRUE(s->log_unit_norms);
  EXPECT_FALSE(s->cuda_fp32_residual);
  EXPECT_EQ(s->attention, DebugSwitches::Attention::kOwn);
  EXPECT_TRUE(s->deterministic);
  EXPECT_FALSE(s->cudnn_cross_attention);
  EXPECT_FALSE(s->cudnn_window);
  EXPECT_TRUE(s->gpu_memory_ledger);
  EXPECT_EQ(s->cudnn_library, "/opt/cudnn/lib");
}

TEST(DebugSwitches, EmptyCountsAsUnset) {
  absl::StatusOr<DebugSwitches> s = ReadFrom({{"SLIDEDP_DETERMINISTIC", ""}, {"SLIDEDP_INJECT_DELAY_MS", ""}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->deterministic);
  EXPECT_EQ(s->inject_max_delay, absl::ZeroDuration());
}

TEST(DebugSwitches, MalformedValueNamesItsVariable) {
  const std::map<std::string, std::string> bad[] = {
      {{"SLIDEDP_CPU_DEVICE_MEMORY_BYTES", "12GiB"}},
      {{"SLIDEDP_CPU_DEVICE_MEMORY_BYTES", "0"}},
      {{"SLIDEDP_INJECT_DELAY_MS", "fast"}},
      {{"SLIDEDP_INJECT_DELAY_MS", "-1"}},
      {{"SLIDEDP_INJECT_NONFINITE", "grad:0:1"}},
      {{"SLIDEDP_AUTOPOLICY_SWEEP", "yes"}},
      {{"SLIDEDP_LOG_UNIT_NORMS", "2"}},
      {{"SLIDEDP_CUDA_FP32_RESIDUAL", "off"}},
      {{"SLIDEDP_ATTENTION", "flash"}},
      {{"SLIDEDP_DETERMINISTIC", "true"}},
      {{"SLIDEDP_CUDNN_CROSS", "no"}},
      {{"SLIDEDP_GPU_MEMORY_LEDGER", "on"}},
  };
  for (const auto& env : bad) {
    absl::StatusOr<DebugSwitches> s = ReadFrom(env);
    ASSERT_FALSE(s.ok()) << env.begin()->first;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(env.begin()->first + ": '" + env.begin()->second + "'"));
  }
}

TEST(DebugSwitches, KeepsTheInjectionMessage) {
  absl::StatusOr<DebugSwitches> s = ReadFrom({{"SLIDEDP_INJECT_NONFINITE", "loss:2,grad:x:1"}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(),
            "SLIDEDP_INJECT_NONFINITE: 'grad:x:1' is not grad:STEP:UNIT[@RANK] or loss:STEP[@RANK]");
  s = ReadFrom({{"SLIDEDP_ATTENTION", "fa3"}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "SLIDEDP_ATTENTION: 'fa3' is not one of auto, cudnn, own");
}

}  // namespace
}  // namespace slidedp
