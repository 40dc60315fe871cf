// The step's metrics record and its JSONL line; see step_metrics.h.
#include "hostd/engine/step_metrics.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace slidedp::hostd {

StepRecord MakeStepRecord(int64_t step, const std::vector<v1::StepDone>& reports, const HostStepTimes& host,
                          double step_s, double lr, double grad_norm, int64_t total_numel, double flops_per_token,
                          int world, int64_t host_state_bytes) {
  StepRecord r;
  v1::StepMetrics& m = r.metrics;
  m.set_step(step);
  double loss = 0;
  for (const v1::StepDone& d : reports) {
    loss += d.loss_sum();
    r.tokens += d.tokens();
    m.set_worker_step_s(std::max(m.worker_step_s(), d.step_time_s()));
    m.set_worker_gate_wait_s(std::max(m.worker_gate_wait_s(), d.gate_wait_s()));
    m.set_worker_compute_s(std::max(m.worker_compute_s(), d.compute_busy_s() + d.gate_wait_s()));
    m.set_worker_ring_wait_s(std::max(m.worker_ring_wait_s(), d.ring_wait_s()));
    m.set_worker_h2d_s(std::max(m.worker_h2d_s(), d.h2d_busy_s()));
    m.set_worker_d2h_s(std::max(m.worker_d2h_s(), d.d2h_busy_s()));
    m.set_worker_cast_s(std::max(m.worker_cast_s(), d.cast_s()));
    m.set_trained_tokens(d.trained_tokens());
    m.set_gpu_peak_bytes(std::max<int64_t>(m.gpu_peak_bytes(), d.gpu_peak_bytes()));
    m.set_gpu_used_peak_bytes(std::max<int64_t>(m.gpu_used_peak_bytes(), d.gpu_used_peak_bytes()));
  }
  m.set_host_aggregate_s(host.aggregate_s);
  m.set_host_wait_s(host.wait_s);
  m.set_host_update_tail_s(host.update_tail_s);
  m.set_host_update_s(host.update_s);
  m.set_host_adam_paused_s(host.adam_paused_s);
  m.set_host_update_gparams_per_s(host.update_s > 0 ? static_cast<double>(total_numel) / host.update_s / 1e9 : 0);
  m.set_loss(loss);
  m.set_learning_rate(lr);
  m.set_grad_norm(grad_norm);
  m.set_step_time_s(step_s);
  m.set_tokens_per_s(step_s > 0 ? r.tokens / step_s : 0);
  m.set_model_tflops(step_s > 0 ? flops_per_token * r.tokens / step_s / world / 1e12 : 0);
  m.set_host_state_bytes(host_state_bytes);
  return r;
}

absl::Status AddRouterMetrics(const std::vector<v1::StepDone>& reports, const std::vector<int>& sparse_layers,
                              int64_t num_experts, v1::StepMetrics* m) {
  if (sparse_layers.empty() || num_experts <= 0) return absl::OkStatus();
  const size_t n = sparse_layers.size() * static_cast<size_t>(num_experts);
  std::vector<int64_t> tokens(n, 0);
  double aux = 0;
  for (size_t r = 0; r < reports.size(); ++r) {
    const v1::StepDone& d = reports[r];
    if (static_cast<size_t>(d.expert_tokens_size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r, " reported ", d.expert_tokens_size(),
                                                     " expert token counts for ", sparse_layers.size(),
                                                     " sparse layers of ", num_experts, " experts"));
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t c = d.expert_tokens(static_cast<int>(i));
      if (c < 0 || c > (int64_t{1} << 50)) {
        return absl::InvalidArgumentError(absl::StrCat("rank ", r, " reported ", c, " tokens for an expert"));
      }
      tokens[i] += c;
    }
    aux += d.router_aux_loss();
  }
  m->set_router_aux_loss(aux);
  int64_t lo = tokens[0], hi = tokens[0], unreached = 0;
  double sum = 0;
  for (int64_t c : tokens) {
    lo = std::min(lo, c);
    hi = std::max(hi, c);
    sum += static_cast<double>(c);
    unreached += c == 0;
  }
  m->set_experts_unreached(unreached);
  m->set_expert_tokens_min(static_cast<double>(lo));
  m->set_expert_tokens_max(static_cast<double>(hi));
  m->set_expert_tokens_mean(sum / static_cast<double>(n));
  // Per layer: its busiest expert over its mean (every layer routes the same tokens x top_k).
  double worst = 0;
  int worst_layer = sparse_layers[0];
  for (size_t l = 0; l < sparse_layers.size(); ++l) {
    int64_t layer_max = 0;
    double layer_sum = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t c = tokens[l * num_experts + e];
      layer_max = std::max(layer_max, c);
      layer_sum += static_cast<double>(c);
    }
    const double ratio = layer_sum > 0 ? layer_max / (layer_sum / static_cast<double>(num_experts)) : 0;
    if (ratio > worst) {
      worst = ratio;
      worst_layer = sparse_layers[l];
    }
  }
  m->set_expert_imbalance(worst);
  m->set_expert_imbalance_layer(worst_layer);
  return absl::OkStatus();
}

double DenseBf16PeakTflops(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("GH200")) return 989.4;
  if (has("H200") || has("H100")) {
    if (has("NVL")) return 835;
    if (has("PCIe")) return 756;
    return 989.4;  // SXM
  }
  if (has("B200")) return 2250;
  if (has("A100")) return 312;
  if (has("L40S")) return 362;
  if (has("L40")) return 181;
  if (has("L4")) return 121;
  return 0;
}

MetricsFile::MetricsFile(const std::string& output_dir, const std::string& job_id)
    : out_(std::filesystem::path(output_dir) / absl::StrCat("metrics-", job_id, ".jsonl"), std::ios::app) {}

void MetricsFile::Append(const StepRecord& r, absl::Time now, const RoutePlan& plan, const JobSpec& spec,
                         int64_t staging_bytes_held) {
  if (!out_) return;
  const v1::StepMetrics& m = r.metrics;
  const char* staging = plan.clip_staging == ClipStaging::kDevice ? "device"
                        : plan.clip_staging == ClipStaging::kHost ? "host"
                                                                  : "none";
  nlohmann::json j = {{"step", m.step()},
                      {"loss", m.loss()},
                      {"lr", m.learning_rate()},
                      {"grad_norm", m.grad_norm()},
                      {"skipped", m.skipped()},
                      {"skipped_steps", m.skipped_steps()},
                      {"tokens", r.tokens},
                      {"step_time_s", m.step_time_s()},
                      {"tokens_per_s", m.tokens_per_s()},
                      {"model_tflops", m.model_tflops()},
                      {"time_unix_ms", absl::ToUnixMillis(now)},
                      {"gpu_peak_bytes", m.gpu_peak_bytes()},
                      {"gpu_used_peak_bytes", m.gpu_used_peak_bytes()},
                      {"busy_s",
                       {{"worker_step", m.worker_step_s()},
                        {"worker_gate_wait", m.worker_gate_wait_s()},
                        {"worker_compute", m.worker_compute_s()},
                        {"worker_ring_wait", m.worker_ring_wait_s()},
                        {"worker_h2d", m.worker_h2d_s()},
                        {"worker_cast", m.worker_cast_s()},
                        {"worker_d2h", m.worker_d2h_s()},
                        {"host_aggregate", m.host_aggregate_s()},
                        {"host_wait", m.host_wait_s()},
                        {"host_update_tail", m.host_update_tail_s()},
                        {"host_update", m.host_update_s()},
                        {"host_adam_paused", m.host_adam_paused_s()}}},
                      {"host_update_gparams_per_s", m.host_update_gparams_per_s()},
                      {"host_hidden_fraction",
                       m.host_hidden_fraction() >= 0 ? nlohmann::json(m.host_hidden_fraction()) : nlohmann::json()},
                      {"speculated_fraction", m.speculated_fraction()},
                      {"speculation_rolled_back", m.speculation_rolled_back()},
                      {"host_state_bytes", m.host_state_bytes()},
                      {"host_staging_bytes", staging_bytes_held},
                      {"world_size", plan.world},
                      {"grad_reduction", ToString(plan.route)},
                      {"grad_staging", staging},
                      {"grad_dtype", ToString(spec.runtime.grad_dtype)},
                      {"state_dtype", ToString(spec.optimizer.state_dtype)},
                      {"checkpoint_dtype", ToString(spec.runtime.checkpoint_dtype)},
                      {"param_source", ToString(spec.runtime.param_source)},
                      {"param_delivery", ToString(spec.runtime.param_delivery)}};
  if (m.has_mfu()) j["mfu"] = m.mfu();
  if (m.has_router_aux_loss()) {  // a MoE model
    j["router_aux_loss"] = m.router_aux_loss();
    j["expert_tokens"] = {{"min", m.expert_tokens_min()},
                          {"max", m.expert_tokens_max()},
                          {"mean", m.expert_tokens_mean()},
                          {"imbalance", m.expert_imbalance()},
                          {"imbalance_layer", m.expert_imbalance_layer()},
                          {"unreached", m.experts_unreached()}};
  }
  if (m.has_eval_loss()) {  // a step the validation pass followed (data.validation)
    j["eval_loss"] = m.eval_loss();
    j["eval_tokens"] = m.eval_tokens();
    j["eval_s"] = m.eval_s();
  }
  out_ << j.dump() << "\n" << std::flush;
}

}  // namespace slidedp::hostd
