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

namespace {

// The activation policy of decoder unit `unit` in the forward pass (the head is unit `head`).
ActPolicy ForwardPolicy(const StepRunnerOptions& options, int unit, int head) {
  if (!options.layer_policies.empty()) return options.layer_policies[unit - 1];
  return unit >= head - options.keep_all_last_layers ? ActPolicy::kKeepAll : options.policy;
}

}  // namespace

// One step's state between Run's phases: its micro-batches on the device and what they hold.
struct StepRunner::StepPass {
  int64_t step = 0;
  uint32_t gate = 0;  // step t needs t completed updates
  float loss_scale = 0;
  int head = 0;  // the head's unit
  Dtype act = Dtype::kF32;
  int64_t act_bytes_per_token = 0;
  // The decoder layers' inputs wait in `kept` between the passes (runtime.checkpoint_dtype).
  Dtype kept = Dtype::kF32;
  std::vector<std::unique_ptr<DeviceBatch>> batches;
  // inputs[u][mb]: the input of unit u for micro-batch mb (kept for its backward); inputs[head] is the
  // head's input. saved[u][mb]: what the policy keeps beyond the input.
  std::vector<std::vector<std::unique_ptr<DeviceBuffer>>> inputs;
  std::vector<std::vector<std::unique_ptr<SavedActivations>>> saved;
  // dy[mb]: the gradient flowing back into the unit being differentiated, from the head's on.
  std::vector<std::unique_ptr<DeviceBuffer>> dy;
  // Device floats: the loss sum, then the auxiliary loss's share (MoE).
  std::unique_ptr<DeviceBuffer> loss_dev;
  float* grad_embed = nullptr;  // the embedding's gradient, once begun (the tied head begins it)

  int num_micro_batches() const { return static_cast<int>(batches.size()); }
};

absl::StatusOr<StepResult> StepRunner::Run(int64_t step, const std::vector<MicroBatch>& micro_batches,
                                           float loss_scale) {
  const absl::Time t_start = absl::Now();
  StepResult result;
  StepPass pass;
  pass.head = layout_.num_units() - 1;
  if (!options_.layer_policies.empty() && static_cast<int>(options_.layer_policies.size()) != pass.head - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("per-layer layout of ", options_.layer_policies.size(), " layers for a model of ", pass.head - 1));
  }
  pass.step = step;
  pass.gate = static_cast<uint32_t>(step);
  pass.loss_scale = loss_scale;
  pass.act = backend_->activation_dtype();
  pass.act_bytes_per_token = layout_.config.hidden_size * DtypeBytes(pass.act);
  pass.kept = CheckpointDType(*backend_, options_.checkpoint_dtype);
  for (const MicroBatch& mb : micro_batches) {
    ASSIGN_OR_RETURN(auto b, backend_->UploadBatch(mb));
    result.local_tokens += mb.num_tokens();
    pass.batches.push_back(std::move(b));
  }
  pass.inputs.resize(layout_.num_units());
  pass.saved.resize(layout_.num_units());

  RETURN_IF_ERROR(ForwardEmbedding(pass));
  for (int u = 1; u < pass.head; ++u) RETURN_IF_ERROR(ForwardLayer(pass, u));
  RETURN_IF_ERROR(StartLoss(pass, &result));
  RETURN_IF_ERROR(HeadForwardBackward(pass));
  result.times.forward_s = absl::ToDoubleSeconds(absl::Now() - t_start);

  const absl::Time t_bwd = absl::Now();
  for (int u = pass.head - 1; u >= 1; --u) RETURN_IF_ERROR(BackwardLayer(pass, u));
  RETURN_IF_ERROR(BackwardEmbedding(pass));

  float loss[2] = {0, 0};
  RETURN_IF_ERROR(backend_->CopyToHost(pass.loss_dev->data(), loss, sizeof(loss)));
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

absl::StatusOr<std::vector<std::unique_ptr<DeviceBuffer>>> StepRunner::AllocateActivations(const StepPass& pass) {
  std::vector<std::unique_ptr<DeviceBuffer>> out(pass.num_micro_batches());
  for (int i = 0; i < pass.num_micro_batches(); ++i) {
    ASSIGN_OR_RETURN(out[i], backend_->Allocate(pass.batches[i]->num_tokens() * pass.act_bytes_per_token));
  }
  return out;
}

absl::Status StepRunner::ForwardEmbedding(StepPass& pass) {
  // Unit 1 is the first decoder layer, or the head with no layers.
  ASSIGN_OR_RETURN(pass.inputs[1], AllocateActivations(pass));
  ASSIGN_OR_RETURN(UnitParams embed, Acquire(0, pass.gate));
  for (int i = 0; i < pass.num_micro_batches(); ++i) {
    RETURN_IF_ERROR(backend_->EmbeddingForward(embed, *pass.batches[i], pass.inputs[1][i]->data()));
  }
  streamer_->Release(0);
  return streamer_->Prefetch(1, pass.gate);
}

absl::Status StepRunner::ForwardLayer(StepPass& pass, int u) {
  TraceRange trace("forward layer");
  const int n_mb = pass.num_micro_batches();
  ASSIGN_OR_RETURN(UnitParams params, Acquire(u, pass.gate));
  ASSIGN_OR_RETURN(pass.inputs[u + 1], AllocateActivations(pass));
  pass.saved[u].resize(n_mb);
  const ActPolicy policy = ForwardPolicy(options_, u, pass.head);
  for (int i = 0; i < n_mb; ++i) {
    RETURN_IF_ERROR(backend_->DecoderForward(params, *pass.batches[i], pass.inputs[u][i]->data(),
                                             pass.inputs[u + 1][i]->data(), policy,
                                             policy == ActPolicy::kRecomputeLayer ? nullptr : &pass.saved[u][i]));
  }
  streamer_->Release(u);
  // The layer's forward is done with its input: from here it is a checkpoint only. (inputs[u + 1]
  // stays exact for the next layer's forward.)
  for (int i = 0; i < n_mb && pass.kept != pass.act; ++i) {
    TraceRange narrow("narrow checkpoint");
    RETURN_IF_ERROR(ConvertInput(pass.inputs[u][i], *pass.batches[i], pass.act, pass.kept));
  }
  if (activations_ && activations_->offloads(u)) {
    RETURN_IF_ERROR(activations_->Offload(u, pass.inputs[u], pass.saved[u]));
  }
  return streamer_->Prefetch(u + 1, pass.gate);
}

absl::Status StepRunner::StartLoss(StepPass& pass, StepResult* result) {
  ASSIGN_OR_RETURN(pass.dy, AllocateActivations(pass));
  ASSIGN_OR_RETURN(pass.loss_dev, backend_->Allocate(2 * sizeof(float)));
  RETURN_IF_ERROR(backend_->Memset(*pass.loss_dev, 0));
  const ModelConfig& c = layout_.config;
  if (!c.is_moe()) return absl::OkStatus();
  // Each micro-batch's load-balancing loss, as one HF forward over it adds it, averaged over the
  // step's micro-batches (all ranks): loss = CE over the global batch + coef * mean aux.
  const double share = 1.0 / static_cast<double>(std::max<int64_t>(options_.global_micro_batches, 1));
  result->expert_tokens.assign(c.NumSparseLayers() * c.num_experts, 0);
  for (const auto& batch : pass.batches) {
    RETURN_IF_ERROR(backend_->RouterAuxLoss(*batch, static_cast<float>(options_.router_aux_coef * share),
                                            static_cast<float>(share), pass.loss_dev->as<float>(),
                                            pass.loss_dev->as<float>() + 1));
    RETURN_IF_ERROR(backend_->AddExpertTokenCounts(*batch, result->expert_tokens.data()));
  }
  return absl::OkStatus();
}

absl::Status StepRunner::HeadForwardBackward(StepPass& pass) {
  TraceRange trace("head forward+backward");
  const int head = pass.head;
  const UnitLayout& hu = layout_.units[head];
  ASSIGN_OR_RETURN(UnitParams head_params, Acquire(head, pass.gate));
  const TensorSlot& norm = hu.tensors[0];
  const UnitParams norm_w = head_params.Tensor(norm);
  const bf16_t* lm_head = nullptr;
  ASSIGN_OR_RETURN(float* grad_head, grads_->Begin(head));
  float* dlm_head = nullptr;
  if (layout_.head_uses_embedding) {
    ASSIGN_OR_RETURN(UnitParams embed, Acquire(0, pass.gate));
    lm_head = embed.bf16;
    ASSIGN_OR_RETURN(pass.grad_embed, grads_->Begin(0));
    dlm_head = pass.grad_embed;
  } else {
    lm_head = head_params.bf16 + hu.tensors[1].offset_numel;
    dlm_head = grad_head + hu.tensors[1].offset_numel;
  }
  for (int i = 0; i < pass.num_micro_batches(); ++i) {
    RETURN_IF_ERROR(backend_->HeadForwardBackward(norm_w, lm_head, *pass.batches[i], pass.inputs[head][i]->data(),
                                                  pass.loss_scale, pass.dy[i]->data(), grad_head + norm.offset_numel,
                                                  dlm_head, pass.loss_dev->as<float>()));
  }
  if (layout_.head_uses_embedding) streamer_->Release(0);
  streamer_->Release(head);
  pass.inputs[head].clear();
  RETURN_IF_ERROR(FinishGradient(pass.step, head, grad_head));
  return PrefetchForBackward(head - 1, pass.gate);
}

absl::Status StepRunner::BackwardLayer(StepPass& pass, int u) {
  TraceRange trace("backward layer");
  if (activations_ && activations_->offloads(u)) {
    RETURN_IF_ERROR(activations_->Restore(u, pass.inputs[u], pass.saved[u]));
  }
  ASSIGN_OR_RETURN(UnitParams params, Acquire(u, pass.gate));
  ASSIGN_OR_RETURN(float* grad, grads_->Begin(u));
  const bool narrowed = pass.kept != pass.act;
  for (int i = 0; i < pass.num_micro_batches(); ++i) {
    SavedActivations* s = pass.saved[u].empty() ? nullptr : pass.saved[u][i].get();
    std::unique_ptr<DeviceBuffer>& input = pass.inputs[u][i];
    // A narrowed input is widened for the backward one micro-batch at a time, in place of its
    // narrow copy, and freed after it: at most one micro-batch's wide input exists at a time.
    if (narrowed) RETURN_IF_ERROR(ConvertInput(input, *pass.batches[i], pass.kept, pass.act));
    RETURN_IF_ERROR(backend_->DecoderBackward(params, *pass.batches[i], input->data(), s, pass.dy[i]->data(),
                                              pass.dy[i]->data(), grad));
    if (narrowed) input.reset();
  }
  streamer_->Release(u);
  pass.inputs[u].clear();
  pass.saved[u].clear();
  RETURN_IF_ERROR(FinishGradient(pass.step, u, grad));
  return PrefetchForBackward(u - 1, pass.gate);
}

absl::Status StepRunner::BackwardEmbedding(StepPass& pass) {
  if (pass.grad_embed == nullptr) {
    ASSIGN_OR_RETURN(pass.grad_embed, grads_->Begin(0));
  }
  for (int i = 0; i < pass.num_micro_batches(); ++i) {
    RETURN_IF_ERROR(backend_->EmbeddingBackward(pass.dy[i]->data(), *pass.batches[i], pass.grad_embed));
  }
  return FinishGradient(pass.step, 0, pass.grad_embed);
}

absl::Status StepRunner::FinishGradient(int64_t step, int unit, float* grad) {
  RETURN_IF_ERROR(InjectNonFinite(step, unit, grad));
  return grads_->Finish(unit, step);
}

absl::Status StepRunner::PrefetchForBackward(int unit, uint32_t gate) {
  if (unit < 1) return absl::OkStatus();  // the embedding's backward reads no parameters
  RETURN_IF_ERROR(streamer_->Prefetch(unit, gate));
  if (activations_) RETURN_IF_ERROR(activations_->Prefetch(unit));
  return absl::OkStatus();
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
