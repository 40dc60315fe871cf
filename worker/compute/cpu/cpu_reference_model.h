// The whole non-streaming Qwen3 model run through the CPU backend: the oracle the CUDA backend's
// and the pipeline's tests compare a full step against.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "worker/compute/backend.h"

namespace slidedp {

// Runs embedding -> every decoder layer (kKeepAll) -> head forward/backward, then the decoder
// backwards and the embedding backward, for each micro-batch in turn. unit_params_bf16 holds one
// flat BF16 array per unit in ModelLayout order (each of the unit's numel). unit_grads is resized
// and overwritten with the FP32 gradients summed over the micro-batches; with tied embeddings the
// LM head's gradient is added into the embedding unit's. Returns
// sum over micro-batches and trained tokens of loss_scale * CE (pass 1 / trained tokens for a mean).
// fp32_norms (optional): per unit, the FP32 side copy of its norm weights (UnitLayout::fp32_numel;
// empty for units without), used instead of their BF16 values, as the workers do by default.
// embed_fp32 (optional): the embedding's FP32 table, whose rows the lookup then reads (the workers'
// default, runtime.embedding_rows: fp32); the tied LM head still uses the BF16 table.
absl::StatusOr<double> ReferenceLossAndGrads(const ModelLayout& layout,
                                             const std::vector<std::vector<bf16_t>>& unit_params_bf16,
                                             const std::vector<MicroBatch>& batches, float loss_scale,
                                             std::vector<std::vector<float>>* unit_grads,
                                             const std::vector<std::vector<float>>* fp32_norms = nullptr,
                                             const float* embed_fp32 = nullptr);

}  // namespace slidedp
