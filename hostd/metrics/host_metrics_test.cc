// hostd metrics from a real HostCore (with a test executor instead of training): jobs by state,
// steps, per-job values of active jobs only, workers, all scraped in the text format.
#include "hostd/metrics/host_metrics.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Reports `steps` steps, then (for job "held") waits until released, so a scrape sees it running.
class ScriptedExecutor : public hostd::JobExecutor {
 public:
  absl::Status Run(hostd::JobContext& ctx) override {
    ctx.SetState(v1::JOB_STATE_RUNNING);
    ctx.SetHostStateBytes(4096);
    for (int64_t s = 0; s < ctx.spec().train.steps; ++s) {
      v1::StepMetrics m;
      m.set_step(s + 1);
      m.set_loss(2.5);
      m.set_skipped_steps(1);
      m.set_learning_rate(1e-4);
      m.set_tokens_per_s(1234.5);
      ctx.ReportStep(m);
    }
    if (ctx.job_id() == "held") {
      reported.Notify();
      while (!release.load() && !ctx.cancel_requested()) absl::SleepFor(absl::Milliseconds(2));
    }
    if (ctx.job_id() == "bad") return absl::InvalidArgumentError("bad input");
    return absl::OkStatus();
  }
  absl::Notification reported;
  std::atomic<bool> release{false};
};

std::string Spec(int steps) {
  return "model: {preset: tiny}\ndata: {path: /tmp}\ntrain: {seq_len: 8, global_batch: 2, steps: " + std::to_string(steps) + "}\n";
}

TEST(HostMetrics, ExportsJobsStepsWorkersAndActiveJobValues) {
  auto ex = std::make_unique<ScriptedExecutor>();
  ScriptedExecutor* executor = ex.get();
  hostd::HostCoreOptions opt;
  opt.worker_wait = absl::Seconds(5);
  auto policy =
      hostd::OutputPolicy::Create(::testing::TempDir() + "/host-metrics-outputs", {}, hostd::OutputAnywhere::kNo);
  ASSERT_TRUE(policy.ok()) << policy.status();
  opt.output_policy = *policy;
  hostd::HostCore core(opt, std::move(ex));
  core.Start();
  v1::WorkerHello h;
  h.set_worker_id("cpu0");
  h.mutable_device()->set_kind("cpu");
  auto worker = core.AttachWorker(h);
  ASSERT_TRUE(worker.ok()) << worker.status();

  MetricsRegistry reg;
  ASSERT_TRUE(RegisterHostMetrics(&reg, &core).ok());
  std::string text = reg.Scrape();
  EXPECT_THAT(text, HasSubstr("slidedp_jobs{state=\"running\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_steps_total 0\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE slidedp_steps_total counter\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_draining 0\n"));

  auto submit = [&](const std::string& id, int steps) {
    v1::SubmitJobRequest req;
    req.set_job_id(id);
    req.set_spec_yaml(Spec(steps));
    ASSERT_TRUE(core.Submit(req).ok());
  };
  auto wait_final = [&](const std::string& id) {
    for (int i = 0; i < 500; ++i) {
      auto j = core.GetJob(id);
      if (j.ok() && hostd::IsFinal(j->state())) return;
      absl::SleepFor(absl::Milliseconds(10));
    }
    FAIL() << id << " did not finish";
  };
  submit("done", 3);
  wait_final("done");
  submit("bad", 1);
  wait_final("bad");
  submit("held", 2);
  ASSERT_TRUE(executor->reported.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(20));

  text = reg.Scrape();
  EXPECT_THAT(text, HasSubstr("slidedp_jobs{state=\"succeeded\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_jobs{state=\"failed\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_jobs{state=\"running\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_steps_total 6\n"));  // 3 + 1 + 2
  EXPECT_THAT(text, HasSubstr("slidedp_job_step{job=\"held\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_job_total_steps{job=\"held\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_job_loss{job=\"held\"} 2.5\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_job_tokens_per_second{job=\"held\"} 1234.5\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_job_skipped_steps{job=\"held\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_job_host_state_bytes{job=\"held\"} 4096\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_host_state_bytes 4096\n"));
  EXPECT_THAT(text, Not(HasSubstr("job=\"done\"")));  // finished jobs have no per-job series
  int attached = 0;
  for (const char* s : {"idle", "assigned", "running"}) {
    const std::string key = std::string("slidedp_workers{state=\"") + s + "\"} 1\n";
    if (text.find(key) != std::string::npos) attached++;
  }
  EXPECT_EQ(attached, 1) << text;

  executor->release = true;
  wait_final("held");
  text = reg.Scrape();
  EXPECT_THAT(text, HasSubstr("slidedp_jobs{state=\"succeeded\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("slidedp_host_state_bytes 0\n"));
  EXPECT_THAT(text, Not(HasSubstr("job=\"held\"")));
}

}  // namespace
}  // namespace slidedp::metrics
