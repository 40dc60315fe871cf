// HostCore without gRPC: queueing, idempotent submit, cancel, watch, drain, worker attach.
#include "hostd/core/host_core.h"

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

// Test executor: runs `steps` steps of 5 ms each, reporting metrics, honouring cancel.
class StepExecutor : public JobExecutor {
 public:
  absl::Status Run(JobContext& ctx) override {
    runs++;
    ctx.SetState(v1::JOB_STATE_RUNNING);
    for (int64_t s = 0; s < ctx.spec().train.steps; ++s) {
      if (ctx.cancel_requested()) {
        saw_checkpoint_on_cancel = ctx.checkpoint_on_cancel();
        return absl::CancelledError("cancelled");
      }
      absl::SleepFor(absl::Milliseconds(5));
      v1::StepMetrics m;
      m.set_step(s + 1);
      m.set_loss(1.0 / (s + 1));
      if (tokens_per_step > 0) {
        m.set_step_time_s(0.005);
        m.set_tokens_per_s(tokens_per_step / 0.005);
        m.set_mfu(0.1 * (s + 1));
        if (s == 1) m.set_eval_loss(0.5);
      }
      ctx.ReportStep(m);
    }
    if (ctx.spec().name == "failing") return absl::InternalError("boom");
    if (ctx.spec().name == "noisy") {
      return absl::InternalError(std::string("line one\nE0101 forged log line\n") + std::string(100000, 'x'));
    }
    if (ctx.spec().name == "stalls") {
      // A step that never ends: a cancel meets it, then the step times out.
      while (!ctx.cancel_requested()) absl::SleepFor(absl::Milliseconds(2));
      return absl::DeadlineExceededError("no gradient from worker cpu0 (rank 0) for 600s");
    }
    if (ctx.spec().name == "holding") {
      // Holds its worker until released, reporting which reports the session queued.
      while (!release.load()) absl::SleepFor(absl::Milliseconds(2));
    }
    return absl::OkStatus();
  }
  std::atomic<int> runs{0};
  std::atomic<bool> release{false};
  std::atomic<bool> saw_checkpoint_on_cancel{false};
  std::atomic<int64_t> tokens_per_step{0};
};

std::string Spec(const std::string& name, int steps) {
  return "name: " + name + "\nmodel: {preset: tiny}\ndata: {path: /tmp}\ntrain: {seq_len: 8, global_batch: 2, steps: " +
         std::to_string(steps) + "}\n";
}

class HostCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto ex = std::make_unique<StepExecutor>();
    executor = ex.get();
    HostCoreOptions opt;
    opt.worker_wait = absl::Milliseconds(300);
    auto policy = OutputPolicy::Create(::testing::TempDir() + "/host-core-outputs", {}, OutputAnywhere::kNo);
    ASSERT_TRUE(policy.ok()) << policy.status();
    opt.output_policy = *policy;
    output_root = policy->root;
    core = std::make_unique<HostCore>(opt, std::move(ex));
    core->Start();
  }
  void AttachCpuWorker(const std::string& id) {
    v1::WorkerHello h;
    h.set_worker_id(id);
    h.set_pid(1);
    h.mutable_device()->set_kind("cpu");
    auto w = core->AttachWorker(h);
    ASSERT_TRUE(w.ok()) << w.status();
    workers.push_back(*w);
  }
  // Submits Spec(name, steps) with the job id `name`.
  void SubmitNamed(const std::string& name, int steps) {
    v1::SubmitJobRequest req;
    req.set_job_id(name);
    req.set_spec_yaml(Spec(name, steps));
    auto r = core->Submit(req);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  void WaitRunning(const std::string& id) {
    for (int i = 0; i < 200 && core->GetJob(id)->state() != v1::JOB_STATE_RUNNING; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  v1::Job WaitFinal(const std::string& id) {
    for (int i = 0; i < 400; ++i) {
      auto j = core->GetJob(id);
      if (j.ok() && IsFinal(j->state())) return *j;
      absl::SleepFor(absl::Milliseconds(10));
    }
    ADD_FAILURE() << "job " << id << " did not finish";
    return {};
  }
  StepExecutor* executor;
  std::string output_root;
  std::unique_ptr<HostCore> core;
  std::vector<std::shared_ptr<WorkerSession>> workers;
};

TEST_F(HostCoreTest, JobsRunOneAfterAnotherAndSubmitIsIdempotent) {
  AttachCpuWorker("cpu0");
  v1::SubmitJobRequest req;
  req.set_job_id("a");
  req.set_spec_yaml(Spec("a", 3));
  auto r1 = core->Submit(req);
  ASSERT_TRUE(r1.ok()) << r1.status();
  auto r2 = core->Submit(req);
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(r2->already_existed());
  req.set_spec_yaml(Spec("a", 4));
  EXPECT_EQ(core->Submit(req).status().code(), absl::StatusCode::kAlreadyExists);

  v1::SubmitJobRequest req_b;
  req_b.set_spec_yaml(Spec("b", 2));
  auto rb = core->Submit(req_b);
  ASSERT_TRUE(rb.ok());
  EXPECT_EQ(WaitFinal("a").state(), v1::JOB_STATE_SUCCEEDED);
  v1::Job b = WaitFinal(rb->job().job_id());
  EXPECT_EQ(b.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(b.last().step(), 2);
  EXPECT_EQ(executor->runs.load(), 2);
  EXPECT_EQ(core->ListJobs().size(), 2u);
}

TEST_F(HostCoreTest, BadSpecsAreInvalidArgument) {
  v1::SubmitJobRequest req;
  req.set_spec_yaml("train: {seq_len: -1}\n");
  EXPECT_EQ(core->Submit(req).status().code(), absl::StatusCode::kInvalidArgument);
  req.set_job_id("bad id!");
  req.set_spec_yaml(Spec("x", 1));
  EXPECT_EQ(core->Submit(req).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core->GetJob("nope").status().code(), absl::StatusCode::kNotFound);
}

// output.dir goes through the output policy at submit: a relative one lands in the root (not in
// the client's base_dir), one outside it is PERMISSION_DENIED, and the record shows the result.
TEST_F(HostCoreTest, OutputDirsAreResolvedByTheOutputPolicy) {
  v1::SubmitJobRequest req;
  req.set_job_id("rel");
  req.set_base_dir("/somewhere/the/client/is");
  req.set_spec_yaml(Spec("rel", 1) + "output: {dir: ckpt/rel}\n");
  req.set_dry_run(true);
  auto r = core->Submit(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->job().resolved_spec_yaml().find("dir: " + output_root + "/ckpt/rel"), std::string::npos)
      << r->job().resolved_spec_yaml();
  req.set_spec_yaml(Spec("dflt", 1));  // the default out/<name>
  r = core->Submit(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(r->job().resolved_spec_yaml().find("dir: " + output_root + "/out/dflt"), std::string::npos);
  for (const std::string dir : {"/etc/slidedp-test", "../escape"}) {
    req.set_spec_yaml(Spec("abs", 1) + "output: {dir: " + dir + "}\n");
    auto denied = core->Submit(req);
    EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << dir << ": " << denied.status();
    EXPECT_NE(denied.status().message().find(output_root), absl::string_view::npos) << denied.status();
  }
}

TEST_F(HostCoreTest, WatchStreamsStepsAndEndsWithFinalState) {
  AttachCpuWorker("cpu0");
  v1::SubmitJobRequest req;
  req.set_job_id("w");
  req.set_spec_yaml(Spec("w", 5));
  ASSERT_TRUE(core->Submit(req).ok());
  auto ch = core->Watch("w");
  ASSERT_TRUE(ch.ok());
  int steps = 0;
  v1::JobState last_state = v1::JOB_STATE_UNSPECIFIED;
  while (auto ev = (*ch)->Pop(absl::Seconds(5))) {
    if (ev->has_step()) steps++;
    if (ev->has_state_change()) last_state = ev->state_change().state();
  }
  EXPECT_EQ(last_state, v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(steps, 5);
}

TEST_F(HostCoreTest, CancelQueuedAndRunning) {
  AttachCpuWorker("cpu0");
  v1::SubmitJobRequest req;
  req.set_job_id("long");
  req.set_spec_yaml(Spec("long", 100000));
  ASSERT_TRUE(core->Submit(req).ok());
  v1::SubmitJobRequest req2;
  req2.set_job_id("queued");
  req2.set_spec_yaml(Spec("queued", 1));
  ASSERT_TRUE(core->Submit(req2).ok());
  EXPECT_EQ(core->Cancel("queued")->state(), v1::JOB_STATE_CANCELLED);
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(core->Cancel("long").ok());
  EXPECT_EQ(WaitFinal("long").state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(executor->runs.load(), 1);
}

TEST_F(HostCoreTest, FailedJobKeepsErrorAndNoWorkersFailsUnavailable) {
  v1::SubmitJobRequest req;
  req.set_job_id("orphan");
  req.set_spec_yaml(Spec("orphan", 1));
  ASSERT_TRUE(core->Submit(req).ok());
  v1::Job j = WaitFinal("orphan");
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(j.error_code(), static_cast<int>(absl::StatusCode::kUnavailable));

  AttachCpuWorker("cpu0");
  req.set_job_id("failing");
  req.set_spec_yaml(Spec("failing", 1));
  ASSERT_TRUE(core->Submit(req).ok());
  j = WaitFinal("failing");
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(j.error(), "boom");
}

TEST_F(HostCoreTest, DrainRefusesNewJobs) {
  AttachCpuWorker("cpu0");
  core->Drain(HostCore::DrainMode::kFinishRunning);
  v1::SubmitJobRequest req;
  req.set_spec_yaml(Spec("late", 1));
  EXPECT_EQ(core->Submit(req).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(core->GetNode().draining());
}

// A hello's worker_id is a name for logs and messages: hostile ones (too long, control
// characters, path separators) are refused.
TEST_F(HostCoreTest, MalformedWorkerIdsAreInvalidArgument) {
  for (const std::string& id : {std::string(), std::string(65, 'a'), std::string("gpu0\nFAKE LOG LINE"),
                                std::string("../gpu0"), std::string("gpu 0")}) {
    v1::WorkerHello h;
    h.set_worker_id(id);
    h.mutable_device()->set_kind("cpu");
    EXPECT_EQ(core->AttachWorker(h).status().code(), absl::StatusCode::kInvalidArgument) << id;
  }
  AttachCpuWorker(std::string(64, 'w'));
  AttachCpuWorker("gpu0b.node-1_x");
  // The other names of a hello: a device kind hostd knows, bounded printable strings.
  auto bad = [&](auto mutate) {
    v1::WorkerHello h;
    h.set_worker_id("gpu9");
    h.mutable_device()->set_kind("cuda");
    mutate(h);
    return core->AttachWorker(h).status().code();
  };
  EXPECT_EQ(bad([](v1::WorkerHello& h) { h.mutable_device()->set_kind("tpu"); }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](v1::WorkerHello& h) { h.mutable_device()->set_name(std::string(300, 'x')); }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](v1::WorkerHello& h) { h.mutable_device()->set_uuid("GPU-\x1b[31m"); }),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](v1::WorkerHello& h) { h.set_build(std::string("v1\0x", 4)); }), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad([](v1::WorkerHello& h) { h.mutable_device()->set_name("NVIDIA H200"); }), absl::StatusCode::kOk);
}

TEST_F(HostCoreTest, DuplicateWorkerIdIsRefusedUntilDetached) {
  AttachCpuWorker("cpu0");
  v1::WorkerHello h;
  h.set_worker_id("cpu0");
  h.mutable_device()->set_kind("cpu");
  EXPECT_EQ(core->AttachWorker(h).status().code(), absl::StatusCode::kAlreadyExists);
  core->DetachWorker(workers[0]);
  EXPECT_TRUE(core->AttachWorker(h).ok());
  EXPECT_EQ(core->ListWorkers().size(), 1u);
}

// A failed job's error is one bounded line, whatever the failure said (a worker's message is
// untrusted text): no forged log lines, no multi-megabyte records.
TEST_F(HostCoreTest, FailedJobErrorIsOneBoundedLine) {
  AttachCpuWorker("cpu0");
  SubmitNamed("noisy", 1);
  v1::Job j = WaitFinal("noisy");
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_LE(j.error().size(), kMaxJobErrorBytes + 40);
  EXPECT_EQ(j.error().find('\n'), std::string::npos) << j.error().substr(0, 80);
  EXPECT_NE(j.error().find("more bytes)"), std::string::npos);
}

// Reports reach the runner's queue only for the job the worker is assigned (or the ack of a
// release between jobs), within the byte budget; an idle worker's reports are dropped.
TEST_F(HostCoreTest, WorkerReportsQueueOnlyForTheAssignedJob) {
  AttachCpuWorker("cpu0");
  WorkerSession& w = *workers[0];
  auto step_loss = [](const std::string& job) {
    v1::WorkerReport r;
    r.mutable_step_loss()->set_job_id(job);
    return r;
  };
  EXPECT_FALSE(w.QueueReport(step_loss("nobody")));  // idle
  v1::WorkerReport ack;
  ack.mutable_host_state_released()->set_segment("/x");
  EXPECT_TRUE(w.QueueReport(ack));
  v1::WorkerReport hello;
  hello.mutable_hello()->set_worker_id("cpu0");
  EXPECT_FALSE(w.QueueReport(hello));

  SubmitNamed("holding", 1);
  WaitRunning("holding");
  EXPECT_TRUE(w.QueueReport(step_loss("holding")));
  EXPECT_FALSE(w.QueueReport(step_loss("other")));
  // The byte budget: a flood of large reports for its own job stops at kMaxQueuedReportBytes.
  v1::WorkerReport big;
  big.mutable_policy_chosen()->set_job_id("holding");
  big.mutable_policy_chosen()->set_policy_yaml(std::string(1 << 20, 'p'));
  int queued = 0;
  while (queued < 200 && w.QueueReport(big)) ++queued;
  EXPECT_LT(queued, 70);
  EXPECT_GE(queued, 60);
  executor->release = true;
  EXPECT_EQ(WaitFinal("holding").state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_FALSE(w.QueueReport(step_loss("holding")));  // idle again
}

// A job cancelled that then fails on its way to the safe point ends CANCELLED, the failure kept.
TEST_F(HostCoreTest, CancelledJobThatThenFailsEndsCancelled) {
  AttachCpuWorker("cpu0");
  SubmitNamed("stalls", 1);
  WaitRunning("stalls");
  ASSERT_TRUE(core->Cancel("stalls").ok());
  v1::Job j = WaitFinal("stalls");
  EXPECT_EQ(j.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(j.error_code(), static_cast<int>(absl::StatusCode::kCancelled));
  EXPECT_NE(j.error().find("no gradient from worker cpu0"), std::string::npos) << j.error();
}

// Ids a client sent are quoted printable and short in errors.
TEST_F(HostCoreTest, UnknownJobIdsAreQuotedPrintable) {
  const std::string id = "x\x1b]0;pwned\x07\x1b[2J\nsecond" + std::string(500, 'y');
  for (absl::Status s : {core->GetJob(id).status(), core->Cancel(id).status(), core->Watch(id).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
    for (char c : s.message()) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << s.message();
    EXPECT_LT(s.message().size(), 120u);
  }
  v1::SubmitJobRequest req;
  req.set_job_id(id);
  req.set_spec_yaml(Spec("a", 1));
  absl::Status s = core->Submit(req).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  for (char c : s.message()) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << s.message();
}

// A queue of kMaxQueuedJobs is full: the next submit is RESOURCE_EXHAUSTED (no worker attached,
// so nothing leaves the queue but the first job, which waits for one).
TEST_F(HostCoreTest, QueueIsBounded) {
  v1::SubmitJobRequest req;
  req.set_spec_yaml(Spec("q", 1));
  absl::Status last;
  size_t accepted = 0;
  for (size_t i = 0; i < kMaxQueuedJobs + 2 && last.ok(); ++i) {
    last = core->Submit(req).status();
    accepted += last.ok();
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  // (The runner may fail the first job for want of workers meanwhile, freeing one place.)
  EXPECT_GE(accepted, kMaxQueuedJobs);
  EXPECT_LE(accepted, kMaxQueuedJobs + 1);
}

// The cap is checked again where a job is queued: a burst of concurrent submits does not pass it.
TEST_F(HostCoreTest, QueueBoundHoldsUnderConcurrentSubmits) {
  AttachCpuWorker("cpu0");
  SubmitNamed("holding", 1);  // holds the runner: nothing leaves the queue meanwhile
  WaitRunning("holding");
  std::atomic<size_t> accepted{0}, exhausted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      v1::SubmitJobRequest req;
      req.set_spec_yaml(Spec("burst", 1));
      for (size_t i = 0; i < kMaxQueuedJobs / 4; ++i) {
        const absl::Status s = core->Submit(req).status();
        accepted += s.ok();
        exhausted += s.code() == absl::StatusCode::kResourceExhausted;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(accepted.load(), kMaxQueuedJobs);
  EXPECT_EQ(exhausted.load(), 2 * kMaxQueuedJobs - kMaxQueuedJobs);
  for (const v1::Job& j : core->ListJobs()) {
    if (j.state() == v1::JOB_STATE_QUEUED) {
      ASSERT_TRUE(core->Cancel(j.job_id()).ok());
    }
  }
  executor->release = true;
}

// A checkpoint directory as a save leaves it, owned by `job` (of run `run`, if given).
void WriteOwnedCheckpoint(const std::string& dir, int64_t step, const std::string& job, const std::string& run = "") {
  namespace fs = std::filesystem;
  const fs::path d = fs::path(dir) / ("checkpoint-" + std::to_string(step));
  fs::create_directories(d);
  std::ofstream(d / "trainer_state.json") << "{\"format\": \"slidedp-checkpoint\", \"step\": " << step
                                          << ", \"trainer_state\": {\"job_id\": \"" << job << "\""
                                          << (run.empty() ? std::string() : ", \"run_id\": \"" + run + "\"")
                                          << "}}";
  std::ofstream(d / "COMPLETE") << "{\"step\": " << step << ", \"files\": {}}";
}

// A job whose output.dir holds another run's checkpoints is refused at submit and dry run, naming
// that job and the ways on; output.overwrite: true lets it in (the executor moves them aside).
TEST_F(HostCoreTest, OutputDirOfAnotherRunIsRefused) {
  const std::string dir = output_root + "/out/owned";
  std::filesystem::remove_all(dir);  // a run before left its files
  WriteOwnedCheckpoint(dir, 120, "owned-1");
  for (bool dry : {true, false}) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(Spec("owned", 10));
    req.set_dry_run(dry);
    const absl::Status s = core->Submit(req).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("job owned-1 (checkpoint-120)"), std::string::npos) << s;
    EXPECT_NE(s.message().find("--resume"), std::string::npos) << s;
    EXPECT_NE(s.message().find("output.overwrite: true"), std::string::npos) << s;
  }
  v1::SubmitJobRequest over;
  over.set_spec_yaml(Spec("owned", 10) + "output: {overwrite: true}\n");
  over.set_dry_run(true);
  EXPECT_TRUE(core->Submit(over).ok());
  // Resuming that run is no conflict: the job continues its run_id.
  v1::SubmitJobRequest resume;
  resume.set_spec_yaml(Spec("owned", 200));
  resume.set_resume_from(dir + "/checkpoint-120");
  resume.set_dry_run(true);
  auto r = core->Submit(resume);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->job().run_id(), "owned-1");
  // ... but another run beside it still is.
  WriteOwnedCheckpoint(dir, 7, "intruder-3", "intruder-1");
  const absl::Status s = core->Submit(resume).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("job intruder-1 (checkpoint-7)"), std::string::npos) << s;
}

// hostd's ids skip those that wrote into the output directory before (a private hostd of
// `slidedp run` counts from 1 each time), and a client's id that did is refused.
TEST_F(HostCoreTest, JobIdsDoNotRepeatInAnOutputDir) {
  const std::string dir = output_root + "/out/again";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/tensorboard/again-2");
  std::ofstream(dir + "/metrics-again-1.jsonl") << "{}\n";
  v1::SubmitJobRequest req;
  req.set_spec_yaml(Spec("again", 1));
  auto r = core->Submit(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->job().job_id(), "again-3");
  EXPECT_EQ(r->job().output_dir(), dir);
  EXPECT_EQ(r->job().run_id(), "again-3");
  req.set_job_id("again-1");
  EXPECT_EQ(core->Submit(req).status().code(), absl::StatusCode::kFailedPrecondition);
}

// The batch must split over the workers the job will get: known at submit.
TEST_F(HostCoreTest, BatchNotDivisibleByTheWorkersIsRefusedAtSubmit) {
  AttachCpuWorker("cpu0");
  AttachCpuWorker("cpu1");
  AttachCpuWorker("cpu2");
  v1::SubmitJobRequest req;
  req.set_spec_yaml(Spec("split", 1));  // global_batch 2 over 3 workers
  req.set_dry_run(true);
  const absl::Status s = core->Submit(req).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("3 worker(s)"), std::string::npos) << s;
  req.set_spec_yaml(Spec("split", 1) + "runtime: {workers: 2}\n");
  EXPECT_TRUE(core->Submit(req).ok());
}

// A queued job says why it waits; the run's means and last validation loss are kept.
TEST_F(HostCoreTest, QueuedJobSaysWhyAndRunMeansAreKept) {
  SubmitNamed("waits", 3);
  v1::Job j = *core->GetJob("waits");
  for (int i = 0; i < 100 && j.wait_reason().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    j = *core->GetJob("waits");
  }
  EXPECT_NE(j.wait_reason().find("needs 1 worker(s), 0 attached"), std::string::npos) << j.wait_reason();
  EXPECT_EQ(WaitFinal("waits").state(), v1::JOB_STATE_FAILED);

  executor->tokens_per_step = 1000;
  AttachCpuWorker("cpu0");
  SubmitNamed("means", 4);
  v1::Job done = WaitFinal("means");
  EXPECT_EQ(done.run_steps(), 4);
  EXPECT_NEAR(done.mean_tokens_per_s(), 1000 / 0.005, 1);
  EXPECT_TRUE(done.has_mean_mfu());
  EXPECT_NEAR(done.mean_mfu(), (0.1 + 0.2 + 0.3 + 0.4) / 4, 1e-12);
  EXPECT_EQ(done.last_eval_step(), 2);
  EXPECT_EQ(done.last_eval_loss(), 0.5);
  EXPECT_EQ(done.compute_backend(), "cpu");
  EXPECT_TRUE(done.wait_reason().empty());
}

// CancelJob's save_checkpoint reaches the executor as checkpoint_on_cancel.
TEST_F(HostCoreTest, CancelWithSaveAsksForACheckpoint) {
  AttachCpuWorker("cpu0");
  SubmitNamed("long", 100000);
  WaitRunning("long");
  ASSERT_TRUE(core->Cancel("long", HostCore::CancelSave::kCheckpoint).ok());
  EXPECT_EQ(WaitFinal("long").state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(executor->saw_checkpoint_on_cancel.load());
}

}  // namespace
}  // namespace slidedp::hostd
