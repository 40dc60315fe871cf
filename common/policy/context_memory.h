// The GPU memory a CUDA worker's step needs at least, by part, as a function of the tokens it
// takes per step and per micro-batch; and from it the longest sequence a model fits on a GPU
// (one row per step), with the layer inputs that do not fit offloaded to pinned host memory as far
// as the host has room. hostd refuses a job whose floor is over its workers' device memory before
// anything is allocated, naming the parts and the longest sequence (job_plan.cc), and `slidedp
// plan` reports both.
//
// The floor counts what the CUDA backend and pipeline certainly hold at the peak of a decoder
// layer's backward (worker/compute/cuda/cuda_layer_math.cc, worker/pipeline):
//   checkpoints  every layer input of the step kept on the device: (layers - offloaded) x tokens x
//                hidden x 4 B (the FP32 residual stream, the CUDA backend's default), or 2 B with
//                runtime.checkpoint_dtype bf16, which then widens one micro-batch's input back to
//                FP32 for the backward (micro-batch tokens x hidden x 2 B more than its BF16 copy);
//   attention    the intermediates attention reads and writes and their gradients, whole for the
//                micro-batch (q/k/v, the rotated q and k, the output, its LSE, and the gradients
//                of all of them) and the attention backward's workspace at its least (an FP32
//                dQ accumulator and row sums): they grow with the sequence, tiles or not;
//   tile         one tile's token-local scratch (norm outputs, h1, gate/up, the MLP's gradients;
//                ComputeBackend::TileRows): bounded by runtime.tile_tokens; in a MoE model at least
//                a sparse layer's, which runs whole: its MoE block's backward for the micro-batch's
//                tokens x num_experts_per_tok rows;
//   residual     the gradient flowing between layers and one layer's output (2 x tokens x hidden x 4 B);
//   context      context parallelism (runtime.context_parallel): the micro-batch's tokens are a
//                rank's share, and attention's backward holds the whole micro-batch's gathered keys
//                and values (BF16) and two FP32 copies of their gradients (whole order and
//                rank-major for the reduce-scatter): whole tokens x kv_dim x 20 B, in `attention`;
//   window       the parameter window's slots (3 x the largest unit in BF16).
// Left out (so the figure is a floor, never an overestimate): the rest of cuDNN's workspace,
// the gradient buffers, the head's logits chunk, the allocator's slack, CUDA's context.
#pragma once

#include <cstdint>
#include <string>

#include "common/model/model_config.h"

namespace slidedp {

// Tokens per tile when runtime.tile_tokens is auto (ComputeBackend::SetTileTokens).
inline constexpr int64_t kDefaultTileTokens = 32768;

struct ContextMemoryInputs {
  int64_t step_tokens = 0;         // tokens per worker per step (all its micro-batches)
  int64_t micro_batch_tokens = 0;  // tokens of one micro-batch (the longest sequence's row)
  int offloaded_layers = 0;        // layers whose inputs wait in host memory (ModelLayout::OffloadedLayers)
  int64_t tile_tokens = kDefaultTileTokens;  // ComputeBackend::tile_tokens()
  // Bytes of a layer input's element while it waits for its backward, on the device or offloaded:
  // 4 (FP32), or 2 with runtime.checkpoint_dtype bf16 (DtypeBytes).
  int64_t checkpoint_element_bytes = 4;
  // Context parallelism: the whole micro-batch's tokens, of which micro_batch_tokens are this
  // rank's share (0: no context parallelism).
  int64_t context_tokens = 0;
};

// Bytes per whole-micro-batch token a context-parallel rank's attention backward holds: the
// gathered keys and values in BF16 and their gradients in FP32, whole-ordered and rank-major.
int64_t ContextGatherBytesPerToken(const ModelConfig& c);

struct ContextMemory {
  int64_t checkpoints = 0;
  int64_t attention = 0;
  int64_t tile = 0;
  int64_t residual = 0;
  int64_t window = 0;
  int64_t offloaded = 0;  // pinned host bytes of the offloaded layer inputs (not device memory)
  int64_t device_total() const { return checkpoints + attention + tile + residual + window; }
  // "42.1 GiB (checkpoints 36.0, attention 4.5, tile 1.1, residual 0.5, window 0.0)"
  std::string ToString() const;
};

ContextMemory EstimateContextMemory(const ModelLayout& layout, const ContextMemoryInputs& in);

// The longest single sequence (one row per step and micro-batch) whose floor fits `device_bytes`,
// offloading the first k layers' inputs for the smallest k that fits, within `host_bytes` of
// pinned host memory for them (-1: no bound), each input element taking checkpoint_element_bytes.
// tokens 0: not even one token fits.
struct LongestSequence {
  int64_t tokens = 0;
  int offloaded_layers = 0;
  ContextMemory memory;  // at that length
};
LongestSequence FindLongestSequence(const ModelLayout& layout, int64_t device_bytes, int64_t host_bytes,
                                    int64_t tile_tokens, int64_t max_tokens, int64_t checkpoint_element_bytes);

}  // namespace slidedp
