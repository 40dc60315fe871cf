// The CLI's progress line (FormatProgress): what a step's record shows, MoE fields included;
// `slidedp plan --json` (WritePlanJson); the flags checked in the client: --timeout's range and
// --resume's path made absolute.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "gtest/gtest.h"
#include "absl/strings/match.h"
#include "client/cli/client.h"
#include "client/cli/plan_report.h"
#include "nlohmann/json.hpp"

namespace slidedp::client {
namespace {

TEST(FormatProgress, DenseStepHasNoRouterFields) {
  v1::Job job;
  job.set_total_steps(10);
  v1::StepMetrics m;
  m.set_step(3);
  m.set_loss(2.5);
  const std::string line = FormatProgress(job, m);
  EXPECT_TRUE(absl::StrContains(line, "step 3/10  loss 2.5000")) << line;
  EXPECT_FALSE(absl::StrContains(line, "experts")) << line;
}

// A MoE model's line says the router's balance: the aux loss, the busiest expert over its layer's
// mean and which layer, and how many (layer, expert) pairs no token reached.
TEST(FormatProgress, MoeStepShowsTheRoutersBalance) {
  v1::Job job;
  job.set_total_steps(10);
  v1::StepMetrics m;
  m.set_step(4);
  m.set_router_aux_loss(2.125);
  m.set_expert_imbalance(2.85);
  m.set_expert_imbalance_layer(7);
  std::string line = FormatProgress(job, m);
  EXPECT_TRUE(absl::StrContains(line, "aux 2.125  experts max/mean 2.85 (layer 7)")) << line;
  EXPECT_FALSE(absl::StrContains(line, "unreached")) << line;
  m.set_experts_unreached(3);
  line = FormatProgress(job, m);
  EXPECT_TRUE(absl::StrContains(line, "(layer 7), 3 unreached")) << line;
}

// The plan's JSON names the route, the step and the alternatives with the proto's field names,
// and lands whole (no .tmp left); a folder that does not exist is an error naming the path.
TEST(WritePlanJson, WritesTheRouteStepAndAlternatives) {
  v1::PlanJobResponse p;
  p.set_step_s(2.5);
  p.set_tokens_per_step(16384);
  p.set_world(2);
  p.set_route("grad_reduction gpu, param_delivery sharded, chunk_bytes 67108864");
  v1::PlanAlternative* a = p.add_alternatives();
  a->set_what("grad_reduction cpu, param_delivery replicated, chunk_bytes 67108864 (measured by its own job)");
  a->set_step_s(2.75);
  const std::string path = ::testing::TempDir() + "/plan-" + std::to_string(getpid()) + ".json";
  ASSERT_TRUE(WritePlanJson(p, path).ok());
  std::ifstream f(path);
  const nlohmann::json j = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(f), {}));
  EXPECT_EQ(j.at("route"), "grad_reduction gpu, param_delivery sharded, chunk_bytes 67108864");
  EXPECT_DOUBLE_EQ(j.at("step_s").get<double>(), 2.5);
  EXPECT_EQ(j.at("tokens_per_step"), "16384");  // int64 as a JSON string: protobuf's mapping
  ASSERT_EQ(j.at("alternatives").size(), 1u);
  EXPECT_DOUBLE_EQ(j.at("alternatives")[0].at("step_s").get<double>(), 2.75);
  EXPECT_FALSE(std::ifstream(path + ".tmp").good());
  const absl::Status bad = WritePlanJson(p, ::testing::TempDir() + "/no-such-dir/plan.json");
  EXPECT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.message(), "no-such-dir")) << bad;
}

// inf, 1e300 or NaN would make every deadline lie in the past (DEADLINE_EXCEEDED at once).
TEST(CheckTimeout, RefusesNonFiniteHugeAndNonPositive) {
  EXPECT_TRUE(CheckTimeout(10).ok());
  EXPECT_TRUE(CheckTimeout(0.5).ok());
  EXPECT_TRUE(CheckTimeout(kMaxTimeoutS).ok());
  for (double t : {std::numeric_limits<double>::infinity(), 1e300, 1e6 + 1, std::nan(""), 0.0, -1.0}) {
    const absl::Status s = CheckTimeout(t);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << t;
    EXPECT_TRUE(absl::StrContains(s.message(), "--timeout")) << s;
  }
}

// A relative checkpoint path is sent absolute (hostd resolves it against its own working
// directory); a job id is sent as is.
TEST(ResumeTarget, RelativePathsBecomeAbsoluteJobIdsStay) {
  namespace fs = std::filesystem;
  const fs::path before = fs::current_path();
  const fs::path dir = fs::path(::testing::TempDir()) / ("resume-" + std::to_string(getpid()));
  fs::create_directories(dir / "ckpt-dir");
  fs::current_path(dir);
  const std::string cwd = fs::current_path().string();
  EXPECT_EQ(ResumeTarget("out/job-1/checkpoints/step-10"), cwd + "/out/job-1/checkpoints/step-10");
  EXPECT_EQ(ResumeTarget("ckpt-dir"), cwd + "/ckpt-dir");  // no '/', but a directory here
  EXPECT_EQ(ResumeTarget("job-20240101-abc"), "job-20240101-abc");
  EXPECT_EQ(ResumeTarget("/abs/ckpt"), "/abs/ckpt");
  EXPECT_EQ(ResumeTarget(""), "");
  fs::current_path(before);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::client
