// WorkerJobConfigOf (the worker's one reading of the job config hostd sent) and StepReports (per-step shares
// of the pipeline's cumulative counters).
#include "worker/agent/job_config.h"

#include "gtest/gtest.h"
#include "worker/agent/step_reports.h"

namespace slidedp::worker {
namespace {

constexpr char kSpec[] = R"(
name: tiny
model: {preset: tiny, init_seed: 3}
data: {path: /data/tiny}
train: {seq_len: 128, global_batch: 8, micro_batch: 2, steps: 20, seed: 7, eval_every: 5}
runtime: {backend: cpu, workers: 2, act_policy: selective, deterministic: true, embedding_rows: bf16,
          gpu_memory_limit: 0.5, step_timeout_ms: 1500, param_source: master, cast_threads: 3}
)";

// What hostd sends: the parsed spec with the routes it chose (RoutePlan::WorkerSpec).
v1::JobConfig TinyConfig() {
  absl::StatusOr<JobSpec> spec = JobSpec::Parse(kSpec, "/", JobSpec::FileCheck::kSkip);
  EXPECT_TRUE(spec.ok()) << spec.status();
  spec->runtime.grad_reduction = GradReduction::kGpu;
  spec->runtime.param_delivery = ParamDelivery::kSharded;
  spec->runtime.grad_staging = GradStaging::kDevice;
  return JobConfigOf(*spec);
}

v1::Assignment TinyAssignment() {
  v1::Assignment a;
  a.set_job_id("job-1");
  a.set_attempt(2);
  a.set_rank(1);
  a.set_world_size(2);
  *a.mutable_config() = TinyConfig();
  a.set_state_segment("/slidedp.n.job-1.state");
  a.set_ring_segment("/slidedp.n.job-1.ring1");
  a.set_first_step(4);
  a.set_total_steps(20);
  a.set_membership_key("g1.x|cpu0#1,cpu1#1");
  a.set_speculate_from_unit(3);
  v1::DatasetFile* f = a.add_dataset_files();
  f->set_dev(1);
  f->set_inode(2);
  f->set_size(3);
  return a;
}

TEST(WorkerJobConfig, TakesTheAssignmentAndTheSpec) {
  absl::StatusOr<WorkerJobConfig> c = WorkerJobConfigOf(TinyAssignment(), int64_t{8} << 30);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->job_id, "job-1");
  EXPECT_EQ(c->attempt, 2);
  EXPECT_EQ(c->rank, 1);
  EXPECT_EQ(c->world, 2);
  EXPECT_EQ(c->first_step, 4);
  EXPECT_EQ(c->total_steps, 20);
  EXPECT_TRUE(c->gpu_route);
  EXPECT_TRUE(c->sharded_delivery);
  EXPECT_TRUE(c->device_staging);
  EXPECT_EQ(c->speculate_from_unit, 3);
  ASSERT_EQ(c->dataset_files.size(), 1u);
  EXPECT_EQ(c->dataset_files[0].ino, 2u);
  EXPECT_TRUE(c->validation_path.empty());
  EXPECT_GT(c->model.num_hidden_layers, 0);
  EXPECT_EQ(c->data_path, "/data/tiny");
  EXPECT_EQ(c->seq_len, 128);
  EXPECT_EQ(c->global_batch, 8);
  EXPECT_EQ(c->micro_batch, 2);
  EXPECT_EQ(c->seed, 7u);
  EXPECT_EQ(c->eval_every, 5);
  EXPECT_EQ(c->step_timeout, absl::Milliseconds(1500));
  EXPECT_EQ(c->act_policy, ActivationPolicy::kSelective);
  EXPECT_TRUE(c->deterministic);
  EXPECT_EQ(c->embedding_rows, Dtype::kBF16);
  EXPECT_EQ(c->param_source, ParamSource::kMaster);
  EXPECT_EQ(c->cast_threads, 3);
  EXPECT_EQ(c->gpu_memory_limit_bytes, int64_t{4} << 30);  // half of this device
}

TEST(WorkerJobConfig, OneRankHasNoRoutesAndABadSpecFails) {
  v1::Assignment a = TinyAssignment();
  a.set_world_size(1);
  a.set_rank(0);
  a.clear_speculate_from_unit();
  absl::StatusOr<WorkerJobConfig> c = WorkerJobConfigOf(a, 0);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->gpu_route);
  EXPECT_FALSE(c->sharded_delivery);
  EXPECT_FALSE(c->speculate_from_unit.has_value());
  a.mutable_config()->mutable_runtime()->set_backend(static_cast<v1::Backend>(7));  // a hostd of another version
  EXPECT_FALSE(WorkerJobConfigOf(a, 0).ok());
  a.clear_config();
  EXPECT_FALSE(WorkerJobConfigOf(a, 0).ok());
}

TEST(StepReports, StepDoneReportsEachStepsShareOfTheCounters) {
  StepReports reports("job-1", 2);
  StepResult result;
  result.loss_sum = 1.5;
  result.local_tokens = 256;
  result.times.total_s = 2.0;
  result.times.flush_s = 0.25;
  PipelineCounters now;
  now.gate_wait_s = 0.5;
  now.h2d_s = 0.75;
  now.ring_wait_s = 0.125;
  v1::WorkerReport r = reports.Done(4, result, 1000, now, 100, 90);
  ASSERT_TRUE(r.has_step_done());
  EXPECT_EQ(r.step_done().job_id(), "job-1");
  EXPECT_EQ(r.step_done().attempt(), 2);
  EXPECT_EQ(r.step_done().step(), 4);
  EXPECT_EQ(r.step_done().trained_tokens(), 1000);
  EXPECT_EQ(r.step_done().tokens(), 256);
  EXPECT_EQ(r.step_done().gate_wait_s(), 0.5);
  EXPECT_EQ(r.step_done().compute_busy_s(), 2.0 - 0.25 - 0.5);
  EXPECT_EQ(r.step_done().gpu_peak_bytes(), 100);
  EXPECT_EQ(r.step_done().gpu_used_peak_bytes(), 90);
  now.gate_wait_s = 0.75;
  now.h2d_s = 1.0;
  r = reports.Done(5, result, 1000, now, 100, 90);
  EXPECT_EQ(r.step_done().gate_wait_s(), 0.25);
  EXPECT_EQ(r.step_done().h2d_busy_s(), 0.25);
  EXPECT_EQ(r.step_done().ring_wait_s(), 0.0);

  const v1::WorkerReport finished = StepReports::JobFinished("job-1", 2, absl::CancelledError("job cancelled"));
  EXPECT_EQ(finished.job_finished().code(), static_cast<int>(absl::StatusCode::kCancelled));
  EXPECT_EQ(finished.job_finished().message(), "job cancelled");
  EXPECT_EQ(reports.Loss(3, 0.5).step_loss().loss_sum(), 0.5);
  EXPECT_EQ(reports.Eval(3, {1.0, 2.0}, 0.1).eval_done().loss_sums_size(), 2);
}

}  // namespace
}  // namespace slidedp::worker
