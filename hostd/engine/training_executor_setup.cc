// TrainingExecutor's setup of an attempt on hostd's side (see training_executor.h): the state a
// dead hostd left, taken over and kept for its job; the attempt's state segment behind admission
// (taken over, pooled or new); and the step loop's components over it. The step loop itself is
// training_executor.cc.
#include "hostd/engine/training_executor.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/admission/admission.h"
#include "hostd/engine/attempt.h"
#include "hostd/engine/job_checks.h"

namespace slidedp::hostd {

absl::StatusOr<int64_t> TrainingExecutor::AdoptInterruptedState(const std::string& job_id, const JobSpec& spec) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfigOf(spec));
  const ModelLayout layout = ModelLayout::Build(config);
  ASSIGN_OR_RETURN(std::string name, shm::MakeSegmentName(options_.node_name, job_id, "state"));
  ASSIGN_OR_RETURN(std::unique_ptr<shm::JobState> js, shm::JobState::Attach(name, shm::Access::kReadWrite));
  RETURN_IF_ERROR(js->CheckMatches(layout));
  const char* want = ToString(spec.optimizer.state_dtype);
  if (absl::string_view(ToString(js->moment_form())) != want) {
    return absl::FailedPreconditionError(absl::StrCat("state segment ", name, " keeps ", ToString(js->moment_form()),
                                                      " Adam moments, the job's optimizer.state_dtype is ", want));
  }
  if (js->has_mirror() != (spec.runtime.param_source == ParamSource::kMirror)) {
    return absl::FailedPreconditionError(absl::StrCat("state segment ", name, js->has_mirror() ? " keeps" : " has no",
                                                      " BF16 mirror, the job's runtime.param_source is ",
                                                      ToString(spec.runtime.param_source)));
  }
  if (js->job_id() != job_id) {
    return absl::FailedPreconditionError(absl::StrCat("state segment ", name, " belongs to job '", js->job_id(), "'"));
  }
  ASSIGN_OR_RETURN(int64_t step, js->ConsistentStep());
  if (spec.train.steps > 0 && step > spec.train.steps) {
    return absl::FailedPreconditionError(
        absl::StrCat("state segment ", name, " is at step ", step, ", beyond the job's ", spec.train.steps));
  }
  RETURN_IF_ERROR(js->TakeOver());
  LOG(INFO) << "job " << job_id << ": took over its state segment " << name << " (" << js->bytes() << " bytes) at step "
            << step << " from the previous hostd";
  absl::MutexLock l(&mu_);
  adopted_[job_id] = AdoptedState{std::move(js), step};
  return step;
}

void TrainingExecutor::ForgetJob(const std::string& job_id) {
  std::unique_ptr<shm::JobState> js;
  {
    absl::MutexLock l(&mu_);
    auto it = adopted_.find(job_id);
    if (it == adopted_.end()) return;
    js = std::move(it->second.state);
    adopted_.erase(it);
  }
  LOG(INFO) << "job " << job_id << " will not run: removing the state segment taken over for it";
  (void)js->Unlink();
}

absl::Status TrainingExecutor::AcquireState(JobContext& ctx, Attempt& a) {
  // The state a dead hostd left for this job (AdoptInterruptedState), else a pooled segment of
  // this layout; either one's memory counts as available to this job. Any other pooled segment
  // is freed first, as this job may need its memory.
  std::unique_ptr<shm::JobState> adopted;
  int64_t adopted_step = 0;
  {
    absl::MutexLock l(&mu_);
    if (auto it = adopted_.find(ctx.job_id()); it != adopted_.end()) {
      adopted = std::move(it->second.state);
      adopted_step = it->second.step;
      adopted_.erase(it);
    }
  }
  const shm::JobState* held = adopted ? adopted.get() : a.segments.TakePooled(a.layout, a.plan.state_format());
  ASSIGN_OR_RETURN(HostMemoryInfo host, ReadHostMemoryInfo());
  if (held) {
    host.mem_available_bytes += held->bytes();
    host.shm_free_bytes += held->bytes();
  }
  if (absl::Status s = CheckAdmission(a.plan.memory, host); !s.ok()) {
    if (adopted) (void)adopted->Unlink();
    return s;
  }
  SizeSpeculation(a.layout, host.mem_available_bytes, host.mem_total_bytes, a.plan);
  ctx.SetHostStateBytes(static_cast<int64_t>(a.plan.memory.total_bytes));
  ctx.Log(a.plan.MemoryLine());
  ctx.Log(a.plan.RoutesLine(a.spec.runtime.param_delivery));

  ASSIGN_OR_RETURN(a.loop.adam, Adam());
  a.loop.bulk_threads = std::max(1, std::min(16, a.loop.adam->num_threads()));
  if (adopted) {
    adopted->abort().Reset();  // a worker may have raised it when the previous hostd died
    a.segments.HoldTakenOver(std::move(adopted), adopted_step);
    return absl::OkStatus();
  }
  if (held) {  // the pooled segment
    const uint64_t bytes = held->bytes();
    const absl::Time t0 = absl::Now();
    absl::Status reused = a.segments.AdoptPooled(ctx.job_id(), a.layout, a.plan.state_format(), a.loop.bulk_threads);
    if (reused.ok()) {
      ctx.Log(absl::StrFormat("reused pooled host state (%.2f GB, %.2f s)", bytes / 1e9,
                              absl::ToDoubleSeconds(absl::Now() - t0)));
      return absl::OkStatus();
    }
    LOG(WARNING) << "job " << ctx.job_id() << ": cannot reuse the pooled host state: " << reused;
  }
  shm::JobStateOptions sopt;
  sopt.format = a.plan.state_format();
  sopt.prefault_threads = a.loop.bulk_threads;
  ASSIGN_OR_RETURN(std::unique_ptr<shm::JobState> created,
                   shm::JobState::Create(options_.node_name, ctx.job_id(), a.layout, sopt));
  a.segments.Hold(std::move(created));
  return absl::OkStatus();
}

absl::Status TrainingExecutor::BuildStepLoop(JobContext& ctx, Attempt& a) {
  StepLoop& loop = a.loop;
  ASSIGN_OR_RETURN(loop.schedule, ScheduleOf(a.spec, a.spec.train.steps));
  std::vector<int64_t> unit_numel;
  for (const UnitLayout& u : a.layout.units) unit_numel.push_back(u.numel);
  shm::JobState* js = &a.segments.state();
  loop.tracker = std::make_unique<update::UnitTracker>(
      unit_numel,
      [js](int u, int64_t step, const absl::Status& s) {
        if (s.ok()) js->version(u).Publish(static_cast<uint32_t>(step));  // the unit's next forward may read it
      },
      loop.first_step);
  const NonFinitePolicy policy = a.spec.train.skip_nonfinite ? NonFinitePolicy::kSkip : NonFinitePolicy::kFail;
  loop.reports = std::make_unique<WorkerReports>(ctx, *js, loop.first_step, a.spec.train.steps, policy);
  const absl::Duration step_timeout = absl::Milliseconds(a.spec.runtime.step_timeout_ms);
  loop.grad_rings = std::make_unique<GradRings>(a.segments.rings(), *loop.reports, *js, step_timeout);
  // Skipping jobs check every rank's loss before a step's updates (the workers send it before
  // their step's last gradients, so waiting for it never waits on hostd).
  WorkerReports* reports = loop.reports.get();
  LossCheck loss_check = [reports, step_timeout](int64_t t) -> absl::StatusOr<std::string> {
    ASSIGN_OR_RETURN(std::vector<double> losses, reports->WaitForLosses(t, step_timeout));
    for (size_t r = 0; r < losses.size(); ++r) {
      if (!std::isfinite(losses[r])) {
        return absl::StrCat("loss is ", NonFiniteName(losses[r]), " on ", reports->WorkerName(static_cast<int>(r)));
      }
    }
    return std::string();
  };
  loop.consumer = std::make_unique<GradConsumer>(a.plan, a.layout, *loop.grad_rings, a.spec.train.max_grad_norm,
                                                 std::clamp(loop.adam->num_threads(), 1, 8), ctx.job_id(), policy,
                                                 std::move(loss_check));
  loop.consumer->AllocateStaging(loop.bulk_threads);
  if (a.sharding.sharded()) {
    std::vector<int> whole;
    for (int u = 0; u < a.layout.num_units(); ++u) {
      if (a.sharding.IsReplicated(u)) whole.push_back(u);
    }
    loop.consumer->SetWholeUnits(std::move(whole));
  }
  if (a.plan.speculate_from_unit < a.layout.num_units()) {
    const absl::Time t0 = absl::Now();
    int64_t covered = 0;
    for (int u = a.plan.speculate_from_unit; u < a.layout.num_units(); ++u) covered += a.layout.units[u].numel;
    ASSIGN_OR_RETURN(loop.undo, UndoArena::Create(a.layout, a.plan.speculate_from_unit, loop.memory, *loop.adam));
    ctx.Log(absl::StrFormat(
        "speculative clipping: units %d..%d (%.1f%% of the parameters) update before the step's norm is known; "
        "undo copies %.2f GiB, ready in %.2f s",
        a.plan.speculate_from_unit, a.layout.num_units() - 1,
        100.0 * static_cast<double>(covered) / static_cast<double>(a.layout.total_numel),
        loop.undo->bytes() / double(1ull << 30), absl::ToDoubleSeconds(absl::Now() - t0)));
  } else if (a.plan.stages_whole_step()) {
    ctx.Log(a.spec.runtime.speculation_bytes == 0
                ? "speculative clipping off (runtime.speculation_bytes: 0): updates wait for the step's norm"
                : "speculative clipping off: no host memory left for undo copies (runtime.speculation_bytes)");
  }
  loop.consumer->EnableSpeculation(loop.undo.get(), loop.first_step);
  // DMA before Adam: the ranks' urgent-copy words start lowered (a worker of an earlier attempt
  // may have died with its word raised), and LayerAdam yields to them from the first step.
  js->ResetUrgentCopies();
  if (a.spec.runtime.copy_priority > 0) {
    // A pause ends after 2 ms even with the word still raised: about one 64 MiB chunk's copy at
    // the link's ~30-50 GB/s, so a copy gets the bandwidth and a stuck word costs LayerAdam little.
    const absl::Duration max_pause = absl::Milliseconds(2);
    RETURN_IF_ERROR(a.segments.PrioritizeCopies(*loop.adam, a.plan.world, a.spec.runtime.copy_priority, max_pause));
    ctx.Log(absl::StrFormat(
        "copy priority %g (runtime.copy_priority): %d of %d LayerAdam workers on NUMA node 0 pause while a "
        "parameter copy the GPU waits for is in flight (up to %s at a time)",
        a.spec.runtime.copy_priority,
        update::YieldingWorkers(loop.adam->workers_on_node(0), a.spec.runtime.copy_priority),
        loop.adam->workers_on_node(0), absl::FormatDuration(max_pause)));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
