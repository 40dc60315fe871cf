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
// qwen3_5 / qwen3_5_moe (worker/compute/cuda/cuda_qwen3_5_layer.cc) keep nothing from a layer's
// forward and run a layer untiled: its backward recomputes the forward for the whole micro-batch into
// one block, with the layer's gradients beside it, then runs the mixer's backward scratch (or the MoE
// block's and the shared expert's, one after the other) on top. `attention` and `tile` are then the
// parts of the layer kind whose backward peaks higher (the layers' backwards run one at a time):
//   attention  the mixer's, whole for the micro-batch: a Gated DeltaNet layer's projections
//              (q|k|v, z, b, a) and their gradient, the conv outputs, q and k after their L2 norm,
//              g and beta (FP32), the core's and the gated norm's outputs and the latter's gradient
//              (BF16); GdnBackward's FP32 gradients of the core's inputs; the chunked kernel's
//              backward workspace (W, U and dU per token, an FP32 state and its gradient per 64
//              tokens; the recurrent fallback's state per token): O(T). A gated attention layer's:
//              the attention term above with q_proj's rows 2 x q_dim wide (query and gate) and
//              o·σ(gate) (o_proj's input) beside o;
//   tile       the rest of the layer, for the whole micro-batch (runtime.tile_tokens does not
//              apply): a dense tile's pieces, or qwen3_5_moe's norm outputs, h1, the MoE block's FP32
//              sum, the shared expert's gate/up, SwiGLU, output and gate logit, dxn and the residual
//              copies; plus the larger of the MoE block's and the shared expert's backward scratch
//              where it exceeds the mixer's backward scratch (they never coexist, only the larger
//              counts, in its part).
// Left out (so the figure is a floor, never an overestimate): the rest of cuDNN's workspace,
// the gradient buffers, the head's logits chunk, the allocator's slack and 256-byte alignment, the
// kernels' small partial-sum workspaces, CUDA's context. The layer figures assume the FP32 residual
// stream (the CUDA backend's default).
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
  // Whose parts `attention` and `tile` are: a tiled layer's (every family but qwen3_5), or the mixer
  // and the rest, whole, of the qwen3_5 layer kind that peaks higher.
  enum class PeakLayer { kTiled, kGatedDeltaNet, kGatedAttention };
  PeakLayer peak_layer = PeakLayer::kTiled;
  int64_t device_total() const { return checkpoints + attention + tile + residual + window; }
  // "42.1 GiB (layer inputs 36.0, attention 4.5, tile 1.1, residual 0.5, parameter window 0.0)";
  // qwen3_5: "... (layer inputs 31.8, Gated DeltaNet 27.9, rest of its layer 14.7, ...)".
  std::string ToString() const;
};

ContextMemory EstimateContextMemory(const ModelLayout& layout, const ContextMemoryInputs& in);

// A qwen3_5 decoder layer's backward at its peak over `tokens` tokens (the header comment's
// qwen3_5 parts): a Gated DeltaNet layer (TokenMixer::kLinearAttention) or a gated attention one,
// whose mixer part also holds `context_tokens` of gathered keys and values (context parallelism).
struct HybridLayerMemory {
  int64_t mixer = 0;  // `attention`
  int64_t rest = 0;   // `tile`
  int64_t total() const { return mixer + rest; }
};
HybridLayerMemory Qwen3_5LayerMemory(const ModelConfig& c, TokenMixer mixer, int64_t tokens,
                                     int64_t context_tokens = 0);

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
