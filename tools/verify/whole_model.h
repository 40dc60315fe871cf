// The whole Qwen3 model, non-streaming, on any ComputeBackend: the driver model_grads runs for
// the comparison against HF transformers (docs/verification.md).
//
// Same order as the CPU oracle (worker/compute/cpu/cpu_reference_model.h), but written only
// against the backend interface (Allocate / CopyToDevice / CopyToHost), so the identical code
// runs the CPU and the CUDA backend: for each micro-batch, embedding -> every decoder layer ->
// final norm + LM head + loss (fused forward and backward) -> decoder layers backward in reverse
// -> embedding backward. Gradients accumulate in FP32 across micro-batches; with tied embeddings
// the LM head's gradient goes into the embedding's.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "common/safetensors/safetensors.h"
#include "worker/compute/backend.h"

namespace slidedp::verify {

struct WholeModelResult {
  double loss = 0;                             // sum over micro-batches of the head's loss_sum
  std::vector<std::vector<float>> unit_grads;  // per unit, layout.units[u].numel FP32 (padding 0)
  // MoE: routing[i][l] the experts micro-batch i's tokens were routed to in sparse layer l (its
  // ordinal), [num_tokens, num_experts_per_tok] row-major (ComputeBackend::RoutedExperts).
  std::vector<std::vector<std::vector<int32_t>>> routing;
};

// unit_params: one BF16 array per unit in layout order (each of the unit's numel). policy is
// the decoder layers' activation policy (kRecomputeLayer/kSelective exercise the recompute
// paths of backward). loss_scale multiplies every token's loss (1 / trained labels for a mean).
// fp32_norms (optional): per unit, the FP32 side copy of its norm weights (UnitLayout::
// fp32_numel), as the workers get them from the master; without it, the BF16 values upcast.
// embed_fp32 (optional): the embedding's FP32 table, whose rows the lookup reads (the workers'
// runtime.embedding_rows: fp32); without it, the BF16 rows.
// router_aux_coef (MoE): each micro-batch's load-balancing loss, averaged over the micro-batches,
// times this is added to the loss and its gradient to the routers' (the workers' rule).
absl::StatusOr<WholeModelResult> RunWholeModel(ComputeBackend& backend, const ModelLayout& layout,
                                               const std::vector<std::vector<bf16_t>>& unit_params,
                                               const std::vector<MicroBatch>& batches, float loss_scale,
                                               ActPolicy policy,
                                               const std::vector<std::vector<float>>* fp32_norms = nullptr,
                                               const std::vector<float>* embed_fp32 = nullptr,
                                               double router_aux_coef = 0);

// Per-unit FP32 arrays (master weights, gradients; layout.units[u].numel each) as safetensors
// sources under their HF tensor names. The arrays must outlive the sources.
std::vector<safetensors::TensorSource> HfTensorsF32(const ModelLayout& layout,
                                                    const std::vector<std::vector<float>>& per_unit);

}  // namespace slidedp::verify
