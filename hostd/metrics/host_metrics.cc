// Collector from HostCore snapshots to hostd's metric families (see host_metrics.h).
#include "hostd/metrics/host_metrics.h"

#include <map>

#include "common/status/status_macros.h"

namespace slidedp::metrics {

namespace {

struct HostFamilies {
  MetricFamily* jobs;
  MetricFamily* steps_total;
  MetricFamily* workers;
  MetricFamily* draining;
  MetricFamily* host_state_bytes;
  MetricFamily* host_memory_available;
  MetricFamily* shm_free;
  // Per active job.
  MetricFamily* job_step;
  MetricFamily* job_total_steps;
  MetricFamily* job_loss;
  MetricFamily* job_lr;
  MetricFamily* job_grad_norm;
  MetricFamily* job_tokens_per_s;
  MetricFamily* job_tflops;
  MetricFamily* job_step_s;
  MetricFamily* job_eta_s;
  MetricFamily* job_gpu_peak;
  MetricFamily* job_host_state;
  MetricFamily* job_workers;
  MetricFamily* job_skipped_steps;
};


void Collect(const HostFamilies& f, const hostd::HostCore& core) {
  const std::vector<v1::Job> jobs = core.ListJobs();
  const v1::NodeInfo node = core.GetNode();

  std::map<std::string, int> by_state;
  for (v1::JobState s : {v1::JOB_STATE_QUEUED, v1::JOB_STATE_STARTING, v1::JOB_STATE_RUNNING, v1::JOB_STATE_SAVING,
                         v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED}) {
    by_state[hostd::JobStateName(s)] = 0;
  }
  double steps = 0, host_state = 0;
  for (MetricFamily* m :
       {f.job_step, f.job_total_steps, f.job_loss, f.job_lr, f.job_grad_norm, f.job_tokens_per_s, f.job_tflops,
        f.job_step_s, f.job_eta_s, f.job_gpu_peak, f.job_host_state, f.job_workers, f.job_skipped_steps}) {
    m->Clear();
  }
  for (const v1::Job& j : jobs) {
    by_state[hostd::JobStateName(j.state())]++;
    steps += static_cast<double>(j.last().step());
    if (hostd::IsFinal(j.state()) || j.state() == v1::JOB_STATE_QUEUED) continue;
    host_state += static_cast<double>(j.host_state_bytes());
    const std::vector<std::string> l = {j.job_id()};
    const v1::StepMetrics& m = j.last();
    f.job_step->Set(l, static_cast<double>(m.step()));
    f.job_total_steps->Set(l, static_cast<double>(j.total_steps()));
    f.job_host_state->Set(l, static_cast<double>(j.host_state_bytes()));
    f.job_workers->Set(l, j.num_workers());
    if (m.step() > 0) {  // before the first step these would read as real zeros
      f.job_loss->Set(l, m.loss());
      f.job_lr->Set(l, m.learning_rate());
      f.job_grad_norm->Set(l, m.grad_norm());
      f.job_tokens_per_s->Set(l, m.tokens_per_s());
      f.job_tflops->Set(l, m.model_tflops());
      f.job_step_s->Set(l, m.step_time_s());
      f.job_eta_s->Set(l, m.eta_s());
      f.job_gpu_peak->Set(l, static_cast<double>(m.gpu_peak_bytes()));
      f.job_skipped_steps->Set(l, static_cast<double>(m.skipped_steps()));
    }
  }
  for (const auto& [state, n] : by_state) f.jobs->Set({state}, n);
  // Mirrors a monotonic sum (the job table keeps finished jobs), hence Set on a counter.
  f.steps_total->Set({}, steps);
  f.workers->Clear();
  for (const char* s : {"idle", "assigned", "running"}) f.workers->Set({s}, 0);
  for (const v1::WorkerInfo& w : node.workers()) f.workers->Add({w.state().empty() ? "unknown" : w.state()}, 1);
  f.draining->Set({}, node.draining() ? 1 : 0);
  f.host_state_bytes->Set({}, host_state);
  f.host_memory_available->Set({}, static_cast<double>(node.host_memory_available_bytes()));
  f.shm_free->Set({}, static_cast<double>(node.shm_free_bytes()));
}

}  // namespace

absl::Status RegisterHostMetrics(MetricsRegistry* r, const hostd::HostCore* core) {
  HostFamilies f;
  const std::vector<std::string> job = {"job"};
  ASSIGN_OR_RETURN(f.jobs, r->Gauge("slidedp_jobs", "Jobs known to hostd, by state.", {"state"}));
  ASSIGN_OR_RETURN(f.steps_total, r->Counter("slidedp_steps_total", "Optimizer steps completed by all jobs."));
  ASSIGN_OR_RETURN(f.workers, r->Gauge("slidedp_workers", "Attached workers, by state.", {"state"}));
  ASSIGN_OR_RETURN(f.draining, r->Gauge("slidedp_draining", "1 while hostd drains and admits no jobs."));
  ASSIGN_OR_RETURN(f.host_state_bytes, r->Gauge("slidedp_host_state_bytes", "Host training state of active jobs, bytes."));
  ASSIGN_OR_RETURN(f.host_memory_available,
                   r->Gauge("slidedp_host_memory_available_bytes", "MemAvailable of the host, bytes."));
  ASSIGN_OR_RETURN(f.shm_free, r->Gauge("slidedp_shm_free_bytes", "Free space in /dev/shm, bytes."));
  ASSIGN_OR_RETURN(f.job_step, r->Gauge("slidedp_job_step", "Completed optimizer steps of an active job.", job));
  ASSIGN_OR_RETURN(f.job_total_steps, r->Gauge("slidedp_job_total_steps", "Steps an active job will run.", job));
  ASSIGN_OR_RETURN(f.job_loss, r->Gauge("slidedp_job_loss", "Loss of the last step (mean over trained tokens).", job));
  ASSIGN_OR_RETURN(f.job_lr, r->Gauge("slidedp_job_learning_rate", "Learning rate of the last step.", job));
  ASSIGN_OR_RETURN(f.job_grad_norm, r->Gauge("slidedp_job_grad_norm", "Global gradient norm of the last step (before clipping).", job));
  ASSIGN_OR_RETURN(f.job_tokens_per_s, r->Gauge("slidedp_job_tokens_per_second", "Trained tokens per second, all ranks.", job));
  ASSIGN_OR_RETURN(f.job_tflops, r->Gauge("slidedp_job_model_tflops", "Model TFLOP/s per GPU of the last step.", job));
  ASSIGN_OR_RETURN(f.job_step_s, r->Gauge("slidedp_job_step_seconds", "Wall time of the last step.", job));
  ASSIGN_OR_RETURN(f.job_eta_s, r->Gauge("slidedp_job_eta_seconds", "Estimated time to the end of the job.", job));
  ASSIGN_OR_RETURN(f.job_gpu_peak, r->Gauge("slidedp_job_gpu_peak_bytes", "Peak GPU memory of the last step, bytes.", job));
  ASSIGN_OR_RETURN(f.job_host_state, r->Gauge("slidedp_job_host_state_bytes", "Host state of the job, bytes.", job));
  ASSIGN_OR_RETURN(f.job_workers, r->Gauge("slidedp_job_workers", "Workers (ranks) of the job.", job));
  ASSIGN_OR_RETURN(f.job_skipped_steps,
                   r->Gauge("slidedp_job_skipped_steps",
                            "Steps of an active job skipped as non-finite (train.skip_nonfinite).", job));
  r->AddCollector([f, core] { Collect(f, *core); });
  return absl::OkStatus();
}

}  // namespace slidedp::metrics
