#include "worker/agent/step_reports.h"

namespace slidedp::worker {

v1::WorkerReport StepReports::Loss(int64_t step, double loss_sum) const {
  v1::WorkerReport r;
  v1::StepLoss* l = r.mutable_step_loss();
  l->set_job_id(job_id_);
  l->set_attempt(attempt_);
  l->set_step(step);
  l->set_loss_sum(loss_sum);
  return r;
}

v1::WorkerReport StepReports::Done(int64_t step, const StepResult& result, int64_t trained_tokens,
                                   const PipelineCounters& now, int64_t gpu_peak_bytes, int64_t gpu_used_peak_bytes) {
  v1::WorkerReport r;
  v1::StepDone* d = r.mutable_step_done();
  d->set_job_id(job_id_);
  d->set_attempt(attempt_);
  d->set_step(step);
  d->set_loss_sum(result.loss_sum);
  d->set_router_aux_loss(result.router_aux_loss);
  for (int64_t c : result.expert_tokens) d->add_expert_tokens(c);
  d->set_trained_tokens(trained_tokens);
  d->set_tokens(result.local_tokens);
  d->set_step_time_s(result.times.total_s);
  const double gate_s = now.gate_wait_s - last_.gate_wait_s;
  d->set_gate_wait_s(gate_s);
  d->set_ring_wait_s(now.ring_wait_s - last_.ring_wait_s);
  d->set_compute_busy_s(result.times.total_s - result.times.flush_s - gate_s);
  d->set_d2h_busy_s(now.d2h_s - last_.d2h_s);
  d->set_h2d_busy_s(now.h2d_s - last_.h2d_s);
  d->set_cast_s(now.cast_s - last_.cast_s);
  last_ = now;
  d->set_gpu_peak_bytes(gpu_peak_bytes);
  d->set_gpu_used_peak_bytes(gpu_used_peak_bytes);
  return r;
}

v1::WorkerReport StepReports::Eval(int64_t step, const std::vector<double>& loss_sums, double eval_s) const {
  v1::WorkerReport r;
  v1::EvalDone* e = r.mutable_eval_done();
  e->set_job_id(job_id_);
  e->set_attempt(attempt_);
  e->set_step(step);
  for (double l : loss_sums) e->add_loss_sums(l);
  e->set_eval_s(eval_s);
  return r;
}

v1::WorkerReport StepReports::PolicyChosen(const AutoPolicySession& autopolicy) const {
  v1::WorkerReport r;
  v1::PolicyChosen* pc = r.mutable_policy_chosen();
  pc->set_job_id(job_id_);
  pc->set_attempt(attempt_);
  pc->set_policy_yaml(autopolicy.chosen().layout.ToYaml());
  pc->set_step(autopolicy.validated_step());
  pc->set_step_time_s(autopolicy.validated_step_s());
  pc->set_gpu_peak_bytes(autopolicy.validated_peak_bytes());
  pc->set_selection_s(autopolicy.selection_s());
  return r;
}

v1::WorkerReport StepReports::CommId(const std::string& membership_key, const std::string& id) const {
  v1::WorkerReport r;
  v1::CommId* c = r.mutable_comm_id();
  c->set_job_id(job_id_);
  c->set_attempt(attempt_);
  c->set_membership_key(membership_key);
  c->set_id(id);
  return r;
}

v1::WorkerReport StepReports::JobFinished(const std::string& job_id, int32_t attempt, const absl::Status& status) {
  v1::WorkerReport r;
  r.mutable_job_finished()->set_job_id(job_id);
  r.mutable_job_finished()->set_code(static_cast<int>(status.code()));
  r.mutable_job_finished()->set_message(std::string(status.message()));
  r.mutable_job_finished()->set_attempt(attempt);
  return r;
}

}  // namespace slidedp::worker
