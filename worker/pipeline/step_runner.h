// StepRunner: one SlideDP training step on one worker (rank r of R), as in docs/architecture.md
// "One step, worker side": forward through the units in order, each unit's parameters
// acquired behind its version gate and applied to every micro-batch before the next unit; the
// head computes loss and its input gradient in the same pass; backward in reverse order,
// accumulating each unit's FP32 weight gradient over the micro-batches and handing it to the
// GradientPath (reduce across ranks, copy into the gradient ring). Every layer's input is kept for
// its backward (an ActivationStore may hold it in host memory meanwhile), in the activations' dtype
// or, with checkpoint_dtype BF16 on an FP32 stream, rounded to BF16 once the layer's forward is
// done and widened back one micro-batch at a time for its backward; what else is kept per layer is
// the activation policy's choice.
//
// Order per unit: acquire its parameters, queue its compute for every micro-batch, release it,
// then prefetch the next unit (waiting for that unit's gate) so its copy overlaps the queued
// compute; the same order on every rank keeps collectives matched.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model/model_config.h"
#include "worker/compute/backend.h"
#include "worker/pipeline/activation_store.h"
#include "worker/pipeline/gradient_path.h"
#include "worker/pipeline/unit_streamer.h"

namespace slidedp {

struct StepTimes {
  double total_s = 0;
  double forward_s = 0;
  double backward_s = 0;
  double flush_s = 0;  // end of step: waiting for the last gradients to reach the ring
};

struct StepResult {
  // This rank's sum of loss_scale * CE over its tokens, plus in a MoE model its micro-batches'
  // share of router_aux_coef * the mean load-balancing loss.
  double loss_sum = 0;
  // MoE: this rank's micro-batches' share of the step's mean load-balancing loss (unweighted),
  // and the tokens routed to each expert, [sparse layer, expert] (empty for a dense model).
  double router_aux_loss = 0;
  std::vector<int64_t> expert_tokens;
  int64_t local_tokens = 0;
  StepTimes times;
};

struct StepRunnerOptions {
  ActPolicy policy = ActPolicy::kRecomputeLayer;
  // The last this-many decoder layers keep all activations whatever `policy` says (their
  // backward runs first, so their memory is given back first). runtime.act_policy: auto.
  int keep_all_last_layers = 0;
  // A per-layer layout (runtime.policy): decoder layer i (unit i + 1) runs layer_policies[i],
  // whatever `policy` and keep_all_last_layers say. Empty: those decide.
  std::vector<ActPolicy> layer_policies;
  // runtime.checkpoint_dtype: the type each decoder layer's input waits in between its forward and
  // its backward (CheckpointDType: a dtype no narrower than the activations' changes nothing). BF16
  // on an FP32 stream halves the inputs' bytes on the device and in an activation store's host
  // memory; the forward, and so the step's loss, still sees the exact values, the backward's
  // recompute and gradients the rounded ones (an approximation, opt-in).
  Dtype checkpoint_dtype = Dtype::kF32;
  // MoE models: the load-balancing loss's coefficient (0: none; the model's router_aux_loss_coef
  // when its output_router_logits is set, or train.router_aux_loss_coef) and the step's micro-batches
  // over all ranks, which the mean is over.
  double router_aux_coef = 0;
  int64_t global_micro_batches = 1;
  // Fault injection for tests: a random delay in [0, max] before every gate wait (env
  // SLIDEDP_INJECT_DELAY_MS sets it in slidedp-worker, also for gradient posts). Zero in production.
  absl::Duration inject_max_delay = absl::ZeroDuration();
  // Called with the step's loss sum as soon as it is known, before the step's last gradients are
  // flushed: the worker reports it then, so a hostd that checks every rank's loss before applying
  // the step (train.skip_nonfinite) never waits on its own rings. May be empty.
  std::function<void(int64_t step, double loss_sum)> on_loss;
  // Fault injection for tests (env SLIDEDP_INJECT_NONFINITE in slidedp-worker): at `step`
  // (0-based) element 0 of `unit`'s gradient becomes NaN, or with unit -1 the loss does.
  struct NonFiniteInjection {
    int64_t step = -1;
    int unit = -1;
  };
  std::vector<NonFiniteInjection> inject_nonfinite;
};

class StepRunner {
 public:
  // `activations` may be null: every layer input stays in device memory.
  StepRunner(const ModelLayout& layout, ComputeBackend* backend, UnitStreamer* streamer, GradientPath* grads,
             StepRunnerOptions options, ActivationStore* activations = nullptr);

  // Runs step `step` (0-based) over this rank's micro-batches. loss_scale = 1 / trained tokens
  // of the whole global batch (all ranks), so the sum of every rank's loss_sum is the mean loss.
  absl::StatusOr<StepResult> Run(int64_t step, const std::vector<MicroBatch>& micro_batches, float loss_scale);
  void set_keep_all_last_layers(int n) { options_.keep_all_last_layers = n; }
  // Validation: the forward alone of every micro-batch in `micro_batches`, each on its own, with
  // the parameters after `version` updates (their gates), in `sweeps` sweeps over the units of at
  // most `per_sweep` micro-batches each (the layer inputs of one sweep's micro-batches are what
  // it holds). Every rank makes the same number of sweeps, also with fewer (or no) micro-batches:
  // the units are acquired in the same order everywhere. Returns each micro-batch's sum of token
  // cross entropy (unscaled), in order: a micro-batch's sum does not depend on the others.
  absl::StatusOr<std::vector<double>> Evaluate(uint32_t version, const std::vector<MicroBatch>& micro_batches,
                                               int per_sweep, int sweeps);
  // From the next step on, decoder layer i runs policies[i] and `activations` (may be null) holds
  // the offloaded checkpoints: AutoPolicy's layout, chosen between steps.
  void SetLayout(std::vector<ActPolicy> policies, ActivationStore* activations) {
    options_.layer_policies = std::move(policies);
    activations_ = activations;
  }

 private:
  absl::StatusOr<UnitParams> Acquire(int unit, uint32_t min_version);
  void InjectDelay();
  // The test-only NaN of inject_nonfinite into unit u's gradient at `step` (unit -1: none).
  absl::Status InjectNonFinite(int64_t step, int unit, float* grad);
  bool InjectsLoss(int64_t step) const;
  // Replaces a layer's input for `batch` (in `from`) by a copy in `to`; the original is freed
  // (stream-ordered after the conversion that reads it).
  absl::Status ConvertInput(std::unique_ptr<DeviceBuffer>& input, const DeviceBatch& batch, Dtype from, Dtype to);

  // Run's phases, in order, over one step's micro-batches and activations (StepPass, in the .cc).
  struct StepPass;
  absl::Status ForwardEmbedding(StepPass& pass);
  absl::Status ForwardLayer(StepPass& pass, int unit);
  // Allocates the head's outputs (input gradients, the device loss) and adds a MoE model's
  // load-balancing loss and expert token counts into `result`.
  absl::Status StartLoss(StepPass& pass, StepResult* result);
  absl::Status HeadForwardBackward(StepPass& pass);
  absl::Status BackwardLayer(StepPass& pass, int unit);
  absl::Status BackwardEmbedding(StepPass& pass);
  // One activation-sized buffer per micro-batch of `pass`.
  absl::StatusOr<std::vector<std::unique_ptr<DeviceBuffer>>> AllocateActivations(const StepPass& pass);
  // Hands unit's accumulated gradient to the GradientPath (after the test-only injection).
  absl::Status FinishGradient(int64_t step, int unit, float* grad);
  // Starts bringing back what `unit`'s backward needs: its parameters and offloaded checkpoints.
  absl::Status PrefetchForBackward(int unit, uint32_t gate);

  const ModelLayout& layout_;
  ComputeBackend* backend_;
  UnitStreamer* streamer_;
  GradientPath* grads_;
  ActivationStore* activations_;
  StepRunnerOptions options_;
  uint64_t rng_state_ = 0x9e3779b97f4a7c15ull;
};

}  // namespace slidedp
