#include "common/policy/context_memory.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace slidedp {

namespace {
constexpr int64_t kResidualBytes = 4;  // FP32 residual stream
constexpr int64_t kWindowSlots = 3;    // worker/pipeline/cuda_streamer.h window_slots

// Bytes per token of the whole-micro-batch attention intermediates and their gradients (BF16 but
// the FP32 LSE): qkv and dqkv, q and dq after RoPE, k and dk, the output and its gradient; and of
// the attention backward's workspace at its least: an FP32 dQ accumulator and FP32 row sums, which
// the own kernels (FlashAttentionBackwardWorkspaceBytes) and cuDNN's both hold (cuDNN ~2x that:
// 8 GiB for Qwen3-8B at 256K, from the size of the block that ran out in docs/gpu-results.md row 85).
int64_t AttentionBytesPerToken(const ModelConfig& c) {
  const int64_t qkv = c.q_dim() + 2 * c.kv_dim();
  const int64_t intermediates = 2 * (2 * qkv + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.q_dim()) + 4 * c.num_attention_heads;
  const int64_t workspace = 4 * (c.q_dim() + c.num_attention_heads);
  return intermediates + workspace;
}

// Bytes per token of one tile's scratch in a layer's backward: xn1, xn2 (BF16), h1 (FP32), their
// rstd, act and gate/up (BF16), the MLP's gradients dact, dgate/up (BF16), dxn (FP32) and the two
// BF16 GEMM operands of the residual gradients.
int64_t TileBytesPerToken(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  return 2 * H + 2 * H + kResidualBytes * H + 8 + 2 * I + 4 * I + 2 * I + 4 * I + kResidualBytes * H + 4 * H;
}

// Bytes per token of a sparse (MoE) layer's backward scratch, which runs whole, not in tiles
// (worker/compute/cuda/cuda_moe_layer.cc, cuda_moe.h): its xn2 (BF16), h1 (FP32), the o_proj branch
// and residual-gradient copies (BF16), dxn (FP32) and the MoE block's backward for each of the k
// slots: gathered rows and expert outputs with their gradients (BF16, 6 H), gate/up, the activation
// and their gradients (BF16, 12 I), routing weights and indices.
int64_t SparseLayerBytesPerToken(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, k = c.num_experts_per_tok;
  return 2 * H + kResidualBytes * H + 2 * H + 2 * H + 4 * H + k * (6 * H + 12 * I + 16) + 8 * c.num_experts;
}

int64_t LargestUnitBf16Bytes(const ModelLayout& layout) {
  int64_t n = 0;
  for (const UnitLayout& u : layout.units) n = std::max(n, u.numel);
  return 2 * n;
}
}  // namespace

std::string ContextMemory::ToString() const {
  constexpr double kGiB = 1073741824.0;
  return absl::StrFormat("%.1f GiB (layer inputs %.1f, attention %.1f, tile %.1f, residual %.1f, parameter window %.1f)",
                         device_total() / kGiB, checkpoints / kGiB, attention / kGiB, tile / kGiB, residual / kGiB,
                         window / kGiB);
}

int64_t ContextGatherBytesPerToken(const ModelConfig& c) { return 2 * c.kv_dim() * (2 + 4 + 4); }

ContextMemory EstimateContextMemory(const ModelLayout& layout, const ContextMemoryInputs& in) {
  const ModelConfig& c = layout.config;
  const int64_t layers = c.num_hidden_layers;
  const int64_t kept_layers = std::max<int64_t>(0, layers - std::clamp<int64_t>(in.offloaded_layers, 0, layers));
  const int64_t element = std::clamp<int64_t>(in.checkpoint_element_bytes, 1, kResidualBytes);
  const int64_t input_bytes = in.step_tokens * c.hidden_size * element;
  // A narrower input is widened back to the residual stream's type one micro-batch at a time.
  const int64_t widened = in.micro_batch_tokens * c.hidden_size * (kResidualBytes - element);
  const int64_t tile = std::min(in.micro_batch_tokens, std::max<int64_t>(1, in.tile_tokens));
  ContextMemory m;
  m.checkpoints = kept_layers * input_bytes + widened;
  m.offloaded = (layers - kept_layers) * input_bytes;
  m.attention = in.micro_batch_tokens * AttentionBytesPerToken(c) +
                std::max<int64_t>(0, in.context_tokens) * ContextGatherBytesPerToken(c);
  m.tile = tile * TileBytesPerToken(c);
  // A MoE model's sparse layers run whole: their scratch grows with the micro-batch.
  if (c.NumSparseLayers() > 0) m.tile = std::max(m.tile, in.micro_batch_tokens * SparseLayerBytesPerToken(c));
  m.residual = 2 * in.micro_batch_tokens * c.hidden_size * kResidualBytes;
  m.window = kWindowSlots * LargestUnitBf16Bytes(layout);
  return m;
}

LongestSequence FindLongestSequence(const ModelLayout& layout, int64_t device_bytes, int64_t host_bytes,
                                    int64_t tile_tokens, int64_t max_tokens, int64_t checkpoint_element_bytes) {
  LongestSequence best;
  const int layers = static_cast<int>(layout.config.num_hidden_layers);
  auto fits = [&](int64_t tokens, int k) {
    const ContextMemory m = EstimateContextMemory(layout, {tokens, tokens, k, tile_tokens, checkpoint_element_bytes});
    return m.device_total() <= device_bytes && (host_bytes < 0 || m.offloaded <= host_bytes);
  };
  // For each k the floor grows with the tokens: the longest length is a binary search; fewer
  // offloaded layers win ties (less PCIe traffic).
  for (int k = 0; k <= layers; ++k) {
    if (!fits(1, k)) continue;
    int64_t lo = 1, hi = std::max<int64_t>(1, max_tokens);
    if (fits(hi, k)) {
      lo = hi;
    } else {
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        (fits(mid, k) ? lo : hi) = mid;
      }
    }
    if (lo > best.tokens) {
      best.tokens = lo;
      best.offloaded_layers = k;
    }
  }
  if (best.tokens > 0) {
    best.memory = EstimateContextMemory(
        layout, {best.tokens, best.tokens, best.offloaded_layers, tile_tokens, checkpoint_element_bytes});
  }
  return best;
}

}  // namespace slidedp
