// The CLI's text: the progress line (FormatProgress: what a step's record shows, MoE fields
// included, fitted to 40/80/200 columns, CPU and CUDA), the summary, `jobs`, `status`, `--json`,
// the report after `slidedp run` stopped on Ctrl-C, the version string; `slidedp plan --json`
// (WritePlanJson); the flags checked in the client: --timeout's range and --resume's path made
// absolute.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <regex>

#include "gtest/gtest.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "client/cli/client.h"
#include "client/cli/plan_report.h"
#include "common/version.h"
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

// A step of a CUDA job with every field a line can show, and one of a CPU-backend job.
v1::StepMetrics FullStep() {
  v1::StepMetrics m;
  m.set_step(30);
  m.set_loss(3.21);
  m.set_learning_rate(3e-3);
  m.set_grad_norm(0.512);
  m.set_tokens_per_s(12345);
  m.set_model_tflops(350.2);
  m.set_mfu(0.354);
  m.set_gpu_peak_bytes(int64_t{61} << 30);
  m.set_host_state_bytes(int64_t{40} << 30);
  m.set_eta_s(80);
  m.set_step_time_s(0.33);
  return m;
}

v1::Job JobOn(const std::string& backend) {
  v1::Job job;
  job.set_job_id("tiny-1");
  job.set_total_steps(120);
  job.set_compute_backend(backend);
  return job;
}

// The whole line (no width) has every field that applies; on the CPU backend no GPU memory,
// TFLOP/s or MFU, which mean nothing there.
TEST(FormatProgress, ShowsOnlyWhatApplies) {
  const std::string cuda = FormatProgress(JobOn("cuda"), FullStep());
  for (const char* part : {"step 30/120", "loss 3.2100", "lr 3.00e-03", "gnorm 0.512", "12345 tok/s",
                           "350.2 TFLOP/s (MFU 35%)", "GPU 61.0 GiB", "host 40.0 GiB", "ETA 1m20s"}) {
    EXPECT_TRUE(absl::StrContains(cuda, part)) << part << " in " << cuda;
  }
  EXPECT_TRUE(absl::StartsWith(cuda, "[######..................] step 30/120")) << cuda;
  const std::string cpu = FormatProgress(JobOn("cpu"), FullStep());
  for (const char* part : {"TFLOP/s", "MFU", "GPU"}) EXPECT_FALSE(absl::StrContains(cpu, part)) << cpu;
  EXPECT_TRUE(absl::StrContains(cpu, "12345 tok/s")) << cpu;
  // Zero values are not shown either (a backend not yet known: as CUDA).
  v1::StepMetrics bare;
  bare.set_step(1);
  bare.set_loss(6.2);
  const std::string zero = FormatProgress(JobOn(""), bare);
  for (const char* part : {"TFLOP/s", "GPU", "host", "tok/s"}) EXPECT_FALSE(absl::StrContains(zero, part)) << zero;
}

// Fitted to a width the line never exceeds it; what is dropped is the least important.
TEST(FormatProgress, FitsTheWidthKeepingTheMostImportant) {
  for (const std::string backend : {"cuda", "cpu"}) {
    for (int width : {40, 80, 200}) {
      const std::string line = FormatProgress(JobOn(backend), FullStep(), width);
      EXPECT_LE(line.size(), static_cast<size_t>(width)) << backend << " " << width << ": " << line;
      EXPECT_EQ(line.find('\n'), std::string::npos);
      for (const char* part : {"step 30/120", "loss 3.2100", "ETA 1m20s"}) {
        EXPECT_TRUE(absl::StrContains(line, part)) << backend << " " << width << ": " << line;
      }
      if (width >= 80) {
        EXPECT_TRUE(absl::StrContains(line, "12345 tok/s")) << line;
        EXPECT_TRUE(absl::StrContains(line, "lr 3.00e-03")) << line;
        EXPECT_TRUE(absl::StrContains(line, "[")) << "the bar: " << line;
      }
      if (width == 40) {
        EXPECT_FALSE(absl::StrContains(line, "GiB")) << line;
      }
      if (width == 200) {
        EXPECT_EQ(line, FormatProgress(JobOn(backend), FullStep())) << "200 columns hold the whole line";
      }
    }
  }
  // 80 columns on CUDA: memory and the grad norm go before the bar, tokens/s and lr stay.
  const std::string cuda80 = FormatProgress(JobOn("cuda"), FullStep(), 80);
  EXPECT_FALSE(absl::StrContains(cuda80, "host")) << cuda80;
  EXPECT_FALSE(absl::StrContains(cuda80, "GPU ")) << cuda80;
  // A width narrower than the step itself: cut, never wrapped.
  EXPECT_EQ(FormatProgress(JobOn("cpu"), FullStep(), 6), "step 3");
  // A validation loss outranks tokens/s.
  v1::StepMetrics m = FullStep();
  m.set_eval_loss(3.3);
  const std::string narrow = FormatProgress(JobOn("cpu"), m, 48);
  EXPECT_TRUE(absl::StrContains(narrow, "val 3.3000")) << narrow;
}

TEST(FormatDuration, ReadsAsADuration) {
  EXPECT_EQ(FormatDuration(2.54), "2.5 s");
  EXPECT_EQ(FormatDuration(185), "3m05s");
  EXPECT_EQ(FormatDuration(7625), "2h07m");
  EXPECT_EQ(FormatDuration(-1), "?");
  EXPECT_EQ(FormatDuration(std::nan("")), "?");
}

// The summary: wall time from start to end, the run's mean speed besides the last step's, the
// validation loss and checkpoint; tools/gpu/suite_judge.py's form kept.
TEST(FormatSummary, MeansBesidesTheLastStep) {
  v1::Job j = JobOn("cuda");
  j.set_state(v1::JOB_STATE_SUCCEEDED);
  j.set_submit_time_unix_ms(1'700'000'000'000);
  j.set_start_time_unix_ms(1'700'000'001'000);
  j.set_end_time_unix_ms(1'700'000'032'500);
  *j.mutable_last() = FullStep();
  j.mutable_last()->set_step(120);
  j.set_mean_tokens_per_s(11000);
  j.set_mean_mfu(0.33);
  j.set_run_steps(120);
  j.set_last_eval_loss(3.3);
  j.set_last_eval_step(100);
  j.set_last_checkpoint("/out/checkpoint-120");
  const std::string s = FormatSummary(j);
  EXPECT_TRUE(absl::StartsWith(
      s, "summary: succeeded after 120 step(s) in 31.5 s, final loss 3.2100, 11000 tokens/s mean (last step 12345), "
         "MFU 33% mean (last step 35%), validation loss 3.3000 (step 100), checkpoint /out/checkpoint-120\n"))
      << s;
  const std::regex judge(R"(summary: (\w+) after (\d+) step\(s\) in [0-9.]+ s, final loss ([-+0-9.eEnaif]+))");
  EXPECT_TRUE(std::regex_search(s, judge)) << s;
  EXPECT_TRUE(absl::StrContains(s, "last step: ")) << s;
  // A resumed job says which steps this run made; on the CPU backend no GPU figures.
  j.set_run_steps(60);
  j.set_compute_backend("cpu");
  j.clear_mean_mfu();
  j.mutable_last()->clear_mfu();
  const std::string cpu = FormatSummary(j);
  EXPECT_TRUE(absl::StrContains(cpu, ", this run steps 61-120")) << cpu;
  EXPECT_FALSE(absl::StrContains(cpu, "MFU")) << cpu;
  EXPECT_FALSE(absl::StrContains(cpu, "GPU")) << cpu;
  EXPECT_FALSE(absl::StrContains(cpu, "TFLOP")) << cpu;
}

// A job that failed before it started has no start time: the summary says so and counts from the
// submit, not from 1970.
TEST(FormatSummary, AJobThatNeverStarted) {
  v1::Job j = JobOn("");
  j.set_state(v1::JOB_STATE_FAILED);
  j.set_submit_time_unix_ms(1'796'589'144'000);
  j.set_end_time_unix_ms(1'796'589'146'100);
  j.set_error("train.global_batch 5 is not divisible by 2 worker(s)");
  const std::string s = FormatSummary(j);
  EXPECT_EQ(s,
            "summary: failed before it started, 2.1 s after it was submitted\n"
            "error: train.global_batch 5 is not divisible by 2 worker(s)\n");
}

TEST(FormatJobsTable, HeaderRowsAndEmpty) {
  EXPECT_EQ(FormatJobsTable({}), "no jobs\n");
  v1::Job running = JobOn("cpu");
  running.set_state(v1::JOB_STATE_RUNNING);
  *running.mutable_last() = FullStep();
  v1::Job queued = JobOn("");
  queued.set_job_id("tiny-2");
  queued.set_state(v1::JOB_STATE_QUEUED);
  queued.set_wait_reason("behind the running job tiny-1");
  v1::Job failed = JobOn("");
  failed.set_job_id("tiny-3");
  failed.set_state(v1::JOB_STATE_FAILED);
  failed.set_error("first line\nsecond line");
  const std::string t = FormatJobsTable({running, queued, failed});
  const std::vector<std::string> lines = absl::StrSplit(t, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 4u) << t;
  EXPECT_TRUE(absl::StartsWith(lines[0], "JOB ")) << t;
  EXPECT_TRUE(absl::StrContains(lines[0], "STATE")) << t;
  EXPECT_TRUE(absl::StrContains(lines[1], "running")) << t;
  EXPECT_TRUE(absl::StrContains(lines[1], "30/120")) << t;
  EXPECT_TRUE(absl::StrContains(lines[1], "3.2100")) << t;
  EXPECT_TRUE(absl::StrContains(lines[2], "behind the running job tiny-1")) << t;
  EXPECT_TRUE(absl::StrContains(lines[3], "error: first line ...")) << t;
  // The columns line up: STATE starts where each row's state does.
  EXPECT_EQ(lines[0].find("STATE"), lines[1].find("running")) << t;
}

TEST(FormatJobStatus, TimesOutputCheckpointValidationSpeed) {
  v1::Job j = JobOn("cpu");
  j.set_state(v1::JOB_STATE_SUCCEEDED);
  j.set_submit_time_unix_ms(1'700'000'000'000);  // 2023-11-14 22:13:20 UTC
  j.set_start_time_unix_ms(1'700'000'001'000);
  j.set_end_time_unix_ms(1'700'000'091'000);
  j.set_output_dir("/home/u/out/tiny");
  j.set_last_checkpoint("/home/u/out/tiny/checkpoint-120");
  j.set_last_eval_loss(3.25);
  j.set_last_eval_step(120);
  j.set_mean_tokens_per_s(9876);
  j.set_run_steps(120);
  const std::string s = FormatJobStatus(j, absl::UTCTimeZone());
  for (const char* part :
       {"job tiny-1: succeeded, step 0/120\n", "submitted:       2023-11-14 22:13:20 +0000",
        "started:         2023-11-14 22:13:21 +0000", "ended:           2023-11-14 22:14:51 +0000 (1m30s running)",
        "output dir:      /home/u/out/tiny", "last checkpoint: /home/u/out/tiny/checkpoint-120",
        "validation loss: 3.2500 at step 120", "speed:           9876 tokens/s mean over 120 step(s) (cpu backend)"}) {
    EXPECT_TRUE(absl::StrContains(s, part)) << part << " in\n" << s;
  }
}

// `--json`: protobuf's mapping with the proto's names, fields at their defaults included.
TEST(ToJson, ProtoFieldNamesForScripts) {
  v1::Job j = JobOn("cpu");
  j.set_state(v1::JOB_STATE_QUEUED);
  j.set_wait_reason("needs 2 workers");
  auto text = ToJson(j);
  ASSERT_TRUE(text.ok()) << text.status();
  const nlohmann::json parsed = nlohmann::json::parse(*text);
  EXPECT_EQ(parsed.at("job_id"), "tiny-1");
  EXPECT_EQ(parsed.at("state"), "JOB_STATE_QUEUED");
  EXPECT_EQ(parsed.at("wait_reason"), "needs 2 workers");
  EXPECT_EQ(parsed.at("total_steps"), "120");  // int64 as a string: protobuf's mapping
  EXPECT_TRUE(parsed.contains("run_steps"));
  EXPECT_EQ(text->back(), '\n');
}

// After `slidedp run` stopped on Ctrl-C: the checkpoint and the exact command, or why there is
// none to resume.
TEST(FormatStopReport, CheckpointAndTheCommandOrWhyNone) {
  v1::Job j = JobOn("cpu");
  j.set_state(v1::JOB_STATE_CANCELLED);
  j.mutable_last()->set_step(37);
  j.set_last_checkpoint("/home/u/out/checkpoint-37");
  EXPECT_EQ(FormatStopReport(j, "job.yaml"),
            "stopped after step 37 of 120; checkpoint saved: /home/u/out/checkpoint-37\n"
            "resume with: slidedp run job.yaml --resume /home/u/out/checkpoint-37\n");
  EXPECT_TRUE(absl::StrContains(FormatStopReport(j, "my job.yaml"), "slidedp run 'my job.yaml' --resume"));
  // The stop came before the boundary could be saved: an older checkpoint is named as such.
  j.set_last_checkpoint("/home/u/out/checkpoint-20");
  std::string r = FormatStopReport(j, "job.yaml");
  EXPECT_TRUE(absl::StrContains(r, "stopped after step 37 of 120 without a checkpoint there")) << r;
  EXPECT_TRUE(absl::StrContains(r, "--resume /home/u/out/checkpoint-20")) << r;
  // Cancelled during step 1 of a fresh run: nothing to resume, and no resume command.
  j.clear_last();
  j.clear_last_checkpoint();
  r = FormatStopReport(j, "job.yaml");
  EXPECT_TRUE(absl::StrContains(r, "no checkpoint saved")) << r;
  EXPECT_TRUE(absl::StrContains(r, "nothing to resume")) << r;
  EXPECT_FALSE(absl::StrContains(r, "--resume")) << r;
  // A resumed run stopped before its first step ended: its own checkpoint still resumes it.
  j.set_resume_from("/home/u/out/checkpoint-37");
  r = FormatStopReport(j, "job.yaml");
  EXPECT_TRUE(absl::StrContains(r, "--resume /home/u/out/checkpoint-37")) << r;
  j.set_state(v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(FormatStopReport(j, "job.yaml"), "");
}

TEST(ShellQuote, QuotesOnlyWhatNeedsIt) {
  EXPECT_EQ(ShellQuote("out/run-1/checkpoint-3"), "out/run-1/checkpoint-3");
  EXPECT_EQ(ShellQuote("a b"), "'a b'");
  EXPECT_EQ(ShellQuote("it's"), "'it'\\''s'");
  EXPECT_EQ(ShellQuote(""), "''");
}

// One version string for the three binaries: "slidedp X.Y.Z (commit abc1234)", the commit from
// git at build time or "unknown"; the binary's digest on a line of its own.
TEST(Version, StringAndReport) {
  const std::regex version(R"(slidedp \d+\.\d+\.\d+ \(commit ([0-9a-f]{7,}|unknown)\))");
  EXPECT_TRUE(std::regex_match(VersionString(), version)) << VersionString();
  EXPECT_TRUE(absl::StartsWith(VersionString(), kVersion));
  const std::string report = VersionReport();
  EXPECT_TRUE(std::regex_match(report, std::regex(VersionString().substr(0, 13) + R"(.*\nbuild digest [0-9a-f]{16})")))
      << report;
  EXPECT_EQ(BuildId(), absl::StrCat(kVersion, " ", BinaryDigest()));
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
