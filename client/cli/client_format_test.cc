// The CLI's progress line (FormatProgress): what a step's record shows, MoE fields included.
#include "gtest/gtest.h"
#include "absl/strings/match.h"
#include "client/cli/client.h"

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

}  // namespace
}  // namespace slidedp::client
