// StepRunner: the per-step schedule of one worker.
#include "worker/pipeline/step_runner.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status/status_macros.h"
#include "worker/pipeline/trace.h"

namespace slidedp {

StepRunner::StepRunner(const ModelLayout& layout, ComputeBackend* backend, UnitStreamer* streamer, GradientPath* grads,
                       StepRunnerOptions options, ActivationStore* activations)
    : layout_(layout),
      backend_(backend),
      streamer_(streamer),
      grads_(grads),
      activations_(activations),
      options_(options) {}

void StepRunner::InjectDelay() {
  if (options_.inject_max_delay <= absl::ZeroDuration()) return;
  rng_state_ ^= rng_state_ << 13;
  rng_state_ ^= rng_state_ >> 7;
  rng_state_ ^= rng_state_ << 17;
  absl::SleepFor(options_.inject_max_delay * static_cast<double>(rng_state_ % 1000) / 1000.0);
}

absl::Status StepRunner::InjectNonFinite(int64_t step, int unit, float* grad) {
  for (const auto& inj : options_.inject_nonfinite) {
    if (inj.step != step || inj.unit != unit) continue;
    // Test-only: after the unit's backward is done, so the NaN is what the path posts.
    RETURN_IF_ERROR(backend_->Synchronize());
    const float nan = std::numeric_limits<float>::quiet_NaN();
    RETURN_IF_ERROR(backend_->CopyToDevice(&nan, grad, sizeof(float)));
  }
  return absl::OkStatus();
}

bool StepRunner::InjectsLoss(int64_t step) const {
  for (const auto& inj : options_.inject_nonfinite) {
    if (inj.step == step && inj.unit < 0) return true;
  }
  return false;
}

absl::Status StepRunner::ConvertInput(std::unique_ptr<DeviceBuffer>& input, const DeviceBatch& batch, Dtype from,
                                      Dtype to) {
  const int64_t n = batch.num_tokens() * layout_.config.hidden_size;
  ASSIGN_OR_RETURN(auto converted, backend_->Allocate(n * DtypeBytes(to)));
  RETURN_IF_ERROR(backend_->ConvertActivations(input->data(), from, converted->data(), to, n));
  input = std::move(converted);
  return absl::OkStatus();
}

absl::StatusOr<UnitParams> StepRunner::Acquire(int unit, uint32_t min_version) {
  TraceRange trace("acquire (gate + load)");
  InjectDelay();
  ASSIGN_OR_RETURN(UnitParams params, streamer_->Acquire(unit, min_version));
  return params.OfLayer(layout_.units[unit].decoder_layer);  // -1 for the embedding and the head
}

absl::StatusOr<StepResult> StepRunner::Run(int64_t step, const std::vector<MicroBatch>& micro_batches,
                                           float loss_scale) {
  const absl::Time t_start = absl::Now();
  StepResult result;
  const ModelConfig& c = layout_.config;
  const int num_units = layout_.num_units();
  const int head = num_units - 1;
  if (!options_.layer_policies.empty() && static_cast<int>(options_.layer_policies.size()) != head - 1) {
    return absl::InvalidArgumentError(absl::StrCat("per-layer layout of ", options_.layer_policies.size(),
                                                   " layers for a model of ", head - 1));
  }
  const int n_mb = static_cast<int>(micro_batches.size());
  const uint32_t gate = static_cast<uint32_t>(step);  // step t needs t completed updates
  const Dtype act = backend_->activation_dtype();
  const int64_t act_bytes_per_token = c.hidden_size * DtypeBytes(act);
  // The decoder layers' inputs wait in `kept` between the passes (runtime.checkpoint_dtype).
  const Dtype kept = CheckpointDType(*backend_, options_.checkpoint_dtype);

  std::vector<std::unique_ptr<DeviceBatch>> batches;
  for (const MicroBatch& mb : micro_batches) {
    ASSIGN_OR_RETURN(auto b, backend_->UploadBatch(mb));
    result.local_tokens += mb.num_tokens();
    batches.push_back(std::move(b));
  }
  // inputs[u][mb]: the input of unit u for micro-batch mb (kept for its backward); inputs[head] is the
  // head's input. saved[u][mb]: what the policy keeps beyond the input.
  std::vector<std::vector<std::unique_ptr<DeviceBuffer>>> inputs(num_units);
  std::vector<std::vector<std::unique_ptr<SavedActivations>>> saved(num_units);
  auto alloc_acts = [&](int u) -> absl::Status {
    inputs[u].resize(n_mb);
    for (int i = 0; i < n_mb; ++i) {
      ASSIGN_OR_RETURN(inputs[u][i], backend_->Allocate(batches[i]->num_tokens() * act_bytes_per_token));
    }
    return absl::OkStatus();
  };

  // ---- forward ----
  {
    RETURN_IF_ERROR(alloc_acts(1));  // unit 1 is the first decoder layer, or the head with no layers
    ASSIGN_OR_RETURN(UnitParams embed, Acquire(0, gate));
    for (int i = 0; i < n_mb; ++i) {
      RETURN_IF_ERROR(backend_->EmbeddingForward(embed, *batches[i], inputs[1][i]->data()));
    }
    streamer_->Release(0);
    RETURN_IF_ERROR(streamer_->Prefetch(1, gate));
  }
  for (int u = 1; u < head; ++u) {
    TraceRange trace("forward layer");
    ASSIGN_OR_RETURN(UnitParams params, Acquire(u, gate));
    RETURN_IF_ERROR(alloc_acts(u + 1));
    saved[u].resize(n_mb);
    const ActPolicy policy = !options_.layer_policies.empty()          ? options_.layer_policies[u - 1]
                             : u >= head - options_.keep_all_last_layers ? ActPolicy::kKeepAll
                                                                         : options_.policy;
    for (int i = 0; i < n_mb; ++i) {
      RETURN_IF_ERROR(backend_->DecoderForward(params, *batches[i], inputs[u][i]->data(), inputs[u + 1][i]->data(),
                                               policy, policy == ActPolicy::kRecomputeLayer ? nullptr : &saved[u][i]));
    }
    streamer_->Release(u);
    // The layer's forward is done with its input: from here it is a checkpoint only. (inputs[u + 1]
    // stays exact for the next layer's forward.)
    for (int i = 0; i < n_mb && kept != act; ++i) {
      TraceRange narrow("narrow checkpoint");
      RETURN_IF_ERROR(ConvertInput(inputs[u][i], *batches[i], act, kept));
    }
    if (activations_ && activations_->offloads(u)) RETURN_IF_ERROR(activations_->Offload(u, inputs[u], saved[u]));
    RETURN_IF_ERROR(streamer_->Prefetch(u + 1, gate));
  }

  // ---- head: loss and its input gradient in one pass ----
  std::vector<std::unique_ptr<DeviceBuffer>> dy(n_mb);
  for (int i = 0; i < n_mb; ++i) {
    ASSIGN_OR_RETURN(dy[i], backend_->Allocate(batches[i]->num_tokens() * act_bytes_per_token));
  }
  // Device floats: the loss sum, then the auxiliary loss's share (MoE).
  ASSIGN_OR_RETURN(auto loss_dev, backend_->Allocate(2 * sizeof(float)));
  RETURN_IF_ERROR(backend_->Memset(*loss_dev, 0));
  if (c.is_moe()) {
    // Each micro-batch's load-balancing loss, as one HF forward over it adds it, averaged over the
    // step's micro-batches (all ranks): loss = CE over the global batch + coef * mean aux.
    const double share = 1.0 / static_cast<double>(std::max<int64_t>(options_.global_micro_batches, 1));
    result.expert_tokens.assign(c.NumSparseLayers() * c.num_experts, 0);
    for (int i = 0; i < n_mb; ++i) {
      RETURN_IF_ERROR(backend_->RouterAuxLoss(*batches[i], static_cast<float>(options_.router_aux_coef * share),
                                              static_cast<float>(share), loss_dev->as<float>(),
                                              loss_dev->as<float>() + 1));
      RETURN_IF_ERROR(backend_->AddExpertTokenCounts(*batches[i], result.expert_tokens.data()));
    }
  }
  float* grad_embed = nullptr;
  {
    TraceRange trace("head forward+backward");
    const UnitLayout& hu = layout_.units[head];
    ASSIGN_OR_RETURN(UnitParams head_params, Acquire(head, gate));
    const TensorSlot& norm = hu.tensors[0];
    const UnitParams norm_w = head_params.Tensor(norm);
    const bf16_t* lm_head = nullptr;
    ASSIGN_OR_RETURN(float* grad_head, grads_->Begin(head));
    float* dlm_head = nullptr;
    if (layout_.head_uses_embedding) {
      ASSIGN_OR_RETURN(UnitParams embed, Acquire(0, gate));
      lm_head = embed.bf16;
      ASSIGN_OR_RETURN(grad_embed, grads_->Begin(0));
      dlm_head = grad_embed;
    } else {
      lm_head = head_params.bf16 + hu.tensors[1].offset_numel;
      dlm_head = grad_head + hu.tensors[1].offset_numel;
    }
    for (int i = 0; i < n_mb; ++i) {
      RETURN_IF_ERROR(backend_->HeadForwardBackward(norm_w, lm_head, *batches[i], inputs[head][i]->data(), loss_scale,
                                                    dy[i]->data(), grad_head + norm.offset_numel, dlm_head,
                                                    loss_dev->as<float>()));
    }
    if (layout_.head_uses_embedding) streamer_->Release(0);
    streamer_->Release(head);
    inputs[head].clear();
    RETURN_IF_ERROR(InjectNonFinite(step, head, grad_head));
    RETURN_IF_ERROR(grads_->Finish(head, step));
    if (head - 1 >= 1) {
      RETURN_IF_ERROR(streamer_->Prefetch(head - 1, gate));
      if (activations_) RETURN_IF_ERROR(activations_->Prefetch(head - 1));
    }
  }
  result.times.forward_s = absl::ToDoubleSeconds(absl::Now() - t_start);

  // ---- backward ----
  const absl::Time t_bwd = absl::Now();
  for (int u = head - 1; u >= 1; --u) {
    TraceRange trace("backward layer");
    if (activations_ && activations_->offloads(u)) RETURN_IF_ERROR(activations_->Restore(u, inputs[u], saved[u]));
    ASSIGN_OR_RETURN(UnitParams params, Acquire(u, gate));
    ASSIGN_OR_RETURN(float* grad, grads_->Begin(u));
    for (int i = 0; i < n_mb; ++i) {
      SavedActivations* s = saved[u].empty() ? nullptr : saved[u][i].get();
      // A narrowed input is widened for the backward one micro-batch at a time, in place of its
      // narrow copy, and freed after it: at most one micro-batch's wide input exists at a time.
      if (kept != act) RETURN_IF_ERROR(ConvertInput(inputs[u][i], *batches[i], kept, act));
      RETURN_IF_ERROR(
          backend_->DecoderBackward(params, *batches[i], inputs[u][i]->data(), s, dy[i]->data(), dy[i]->data(), grad));
      if (kept != act) inputs[u][i].reset();
    }
    streamer_->Release(u);
    inputs[u].clear();
    saved[u].clear();
    RETURN_IF_ERROR(InjectNonFinite(step, u, grad));
    RETURN_IF_ERROR(grads_->Finish(u, step));
    if (u > 1) {
      RETURN_IF_ERROR(streamer_->Prefetch(u - 1, gate));
      if (activations_) RETURN_IF_ERROR(activations_->Prefetch(u - 1));
    }
  }
  if (grad_embed == nullptr) {
    ASSIGN_OR_RETURN(grad_embed, grads_->Begin(0));
  }
  for (int i = 0; i < n_mb; ++i) {
    RETURN_IF_ERROR(backend_->EmbeddingBackward(dy[i]->data(), *batches[i], grad_embed));
  }
  RETURN_IF_ERROR(InjectNonFinite(step, 0, grad_embed));
  RETURN_IF_ERROR(grads_->Finish(0, step));

  float loss[2] = {0, 0};
  RETURN_IF_ERROR(backend_->CopyToHost(loss_dev->data(), loss, sizeof(loss)));
  result.loss_sum = InjectsLoss(step) ? std::numeric_limits<double>::quiet_NaN() : loss[0];
  result.router_aux_loss = loss[1];
  if (options_.on_loss) options_.on_loss(step, result.loss_sum);
  TraceRange trace("flush gradients");
  const absl::Time t_flush = absl::Now();
  RETURN_IF_ERROR(grads_->Flush());
  result.times.flush_s = absl::ToDoubleSeconds(absl::Now() - t_flush);
  result.times.backward_s = absl::ToDoubleSeconds(absl::Now() - t_bwd);
  result.times.total_s = absl::ToDoubleSeconds(absl::Now() - t_start);
  return result;
}

absl::StatusOr<std::vector<double>> StepRunner::Evaluate(uint32_t version, const std::vector<MicroBatch>& micro_batches,
                                                        int per_sweep, int sweeps) {
  const int num_units = layout_.num_units();
  const int head = num_units - 1;
  const int64_t act_bytes_per_token = layout_.config.hidden_size * DtypeBytes(backend_->activation_dtype());
  per_sweep = std::max(per_sweep, 1);
  if (static_cast<int64_t>(sweeps) * per_sweep < static_cast<int64_t>(micro_batches.size())) {
    return absl::InvalidArgumentError(absl::StrCat("evaluation: ", micro_batches.size(), " micro-batches in ", sweeps,
                                                   " sweeps of at most ", per_sweep));
  }
  std::vector<double> losses;
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    TraceRange trace("evaluate");
    const size_t begin = std::min(micro_batches.size(), static_cast<size_t>(sweep) * per_sweep);
    const size_t end = std::min(micro_batches.size(), begin + per_sweep);
    const int n = static_cast<int>(end - begin);
    std::vector<std::unique_ptr<DeviceBatch>> batches;
    std::vector<std::unique_ptr<DeviceBuffer>> x(n), y(n);
    for (int i = 0; i < n; ++i) {
      ASSIGN_OR_RETURN(auto b, backend_->UploadBatch(micro_batches[begin + i]));
      ASSIGN_OR_RETURN(x[i], backend_->Allocate(b->num_tokens() * act_bytes_per_token));
      if (head > 1) {
        ASSIGN_OR_RETURN(y[i], backend_->Allocate(b->num_tokens() * act_bytes_per_token));
      }
      batches.push_back(std::move(b));
    }
    {
      ASSIGN_OR_RETURN(UnitParams embed, Acquire(0, version));
      for (int i = 0; i < n; ++i) RETURN_IF_ERROR(backend_->EmbeddingForward(embed, *batches[i], x[i]->data()));
      streamer_->Release(0);
      RETURN_IF_ERROR(streamer_->Prefetch(1, version));
    }
    for (int u = 1; u < head; ++u) {
      ASSIGN_OR_RETURN(UnitParams params, Acquire(u, version));
      for (int i = 0; i < n; ++i) {
        RETURN_IF_ERROR(backend_->DecoderForward(params, *batches[i], x[i]->data(), y[i]->data(),
                                                 ActPolicy::kRecomputeLayer, nullptr));
        std::swap(x[i], y[i]);
      }
      streamer_->Release(u);
      RETURN_IF_ERROR(streamer_->Prefetch(u + 1, version));
    }
    ASSIGN_OR_RETURN(auto loss_dev, backend_->Allocate(std::max(n, 1) * static_cast<int64_t>(sizeof(float))));
    RETURN_IF_ERROR(backend_->Memset(*loss_dev, 0));
    const UnitLayout& hu = layout_.units[head];
    ASSIGN_OR_RETURN(UnitParams head_params, Acquire(head, version));
    const bf16_t* lm_head = hu.tensors.size() > 1 ? head_params.bf16 + hu.tensors[1].offset_numel : nullptr;
    if (layout_.head_uses_embedding) {
      ASSIGN_OR_RETURN(UnitParams embed, Acquire(0, version));
      lm_head = embed.bf16;
    }
    for (int i = 0; i < n; ++i) {
      RETURN_IF_ERROR(backend_->HeadLoss(head_params.Tensor(hu.tensors[0]), lm_head, *batches[i], x[i]->data(), 1.0f,
                                         loss_dev->as<float>() + i));
    }
    if (layout_.head_uses_embedding) streamer_->Release(0);
    streamer_->Release(head);
    std::vector<float> sums(std::max(n, 1));
    RETURN_IF_ERROR(backend_->CopyToHost(loss_dev->data(), sums.data(), sums.size() * sizeof(float)));
    for (int i = 0; i < n; ++i) losses.push_back(sums[i]);
  }
  return losses;
}

}  // namespace slidedp
