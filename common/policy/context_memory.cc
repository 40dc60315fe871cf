// The GPU memory floor of a step by part, and the longest sequence it fits; see context_memory.h.
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
// With qwen3_5's gated attention q_proj's rows hold a query and an output gate per head (the fused
// rows 2 q_dim + 2 kv_dim wide, with their gradient), and o·σ(gate), o_proj's input, sits beside o
// (its gradient is written over o's).
int64_t AttentionBytesPerToken(const ModelConfig& c) {
  const int64_t gate = c.has_attention_output_gate() ? c.q_dim() : 0;
  const int64_t qkv = c.q_dim() + gate + 2 * c.kv_dim();
  const int64_t intermediates =
      2 * (2 * qkv + 2 * c.q_dim() + 2 * c.kv_dim() + 2 * c.q_dim() + gate) + 4 * c.num_attention_heads;
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

// Bytes per token of the MoE block's backward (worker/compute/cuda/cuda_moe.h), for each of the k
// slots: gathered rows and expert outputs with their gradients (BF16, 6 H), gate/up, the activation
// and their gradients (BF16, 12 I), routing weights and indices; and the router's probabilities
// and logits' gradient.
int64_t MoeBlockBackwardBytesPerToken(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, k = c.num_experts_per_tok;
  return k * (6 * H + 12 * I + 16) + 8 * c.num_experts;
}

// Bytes per token of a sparse (MoE) layer's backward scratch, which runs whole, not in tiles
// (worker/compute/cuda/cuda_moe_layer.cc): its xn2 (BF16), h1 (FP32), the o_proj branch and
// residual-gradient copies (BF16), dxn (FP32) and the MoE block's backward.
int64_t SparseLayerBytesPerToken(const ModelConfig& c) {
  const int64_t H = c.hidden_size;
  return 2 * H + kResidualBytes * H + 2 * H + 2 * H + 4 * H + MoeBlockBackwardBytesPerToken(c);
}

// ---- qwen3_5 (worker/compute/cuda/cuda_qwen3_5_layer.cc: HybridDecoderBackward's block, laid out
// by ReserveHybrid, then GdnBackward's or SharedExpertBackward's and the MoE block's on top).

// Tokens per chunk of the chunked gated delta rule (worker/kernels/gated_delta_common.cuh kChunk),
// and the head dims it takes (the recurrent fallback runs the others: InitQwen3_5).
constexpr int64_t kDeltaChunkTokens = 64;
bool ChunkedDelta(const LinearAttentionConfig& la) {
  auto taken = [](int64_t d) { return d == 64 || d == 128; };
  return taken(la.key_head_dim) && taken(la.value_head_dim);
}

// The layer block's token-local part, per token: a dense tile's pieces (TileBytesPerToken: xn1, xn2,
// h1, the rstds, gate/up, SwiGLU and their gradients, dxn, the branch and dres copies), or a
// qwen3_5_moe layer's: xn1, xn2, the branch and dres copies and the shared expert's output (BF16),
// h1, the MoE block's sum and dxn (FP32), the two rstds and the shared gate's logit (FP32), the shared
// expert's gate/up and SwiGLU (BF16).
int64_t HybridLocalBytesPerToken(const ModelConfig& c) {
  if (!c.is_moe()) return TileBytesPerToken(c);
  const int64_t H = c.hidden_size, S = c.shared_expert_intermediate_size;
  return 5 * 2 * H + 2 * kResidualBytes * H + 4 * H + 3 * 4 + 2 * 2 * S + 2 * S;
}

// The shared expert's backward scratch per token (SharedExpertBackward): its output's gradient, the
// SwiGLU's and gate/up's (BF16), the gate logit's (FP32).
int64_t SharedExpertBackwardBytesPerToken(const ModelConfig& c) {
  const int64_t S = c.shared_expert_intermediate_size;
  return 2 * c.hidden_size + 2 * S + 2 * 2 * S + 4;
}

// The Gated DeltaNet's part of the layer block, per token: proj = [q|k|v | z | b | a] (P columns) and
// its gradient dproj, the conv outputs of q|k and v, q and k after their L2 norm, the core's output,
// the gated norm's output and its gradient (BF16); g and beta (FP32).
int64_t GdnBlockBytesPerToken(const LinearAttentionConfig& la) {
  const int64_t KD = la.key_dim(), VD = la.value_dim(), nv = la.num_value_heads;
  const int64_t P = la.conv_dim() + VD + 2 * nv;
  return 2 * 2 * P + 2 * (2 * KD + VD + KD + KD + VD + VD + VD) + 4 * 2 * nv;
}

// GdnBackward's own block over T tokens: the core's output gradient (FP32 and BF16), dq, dk, dv, dg,
// dbeta and the conv's q|k gradient (FP32); and the core's backward workspace: the chunked kernel's
// W [T, nv, dk], U and dU [T, nv, dv], dgamma [dk / 64, T, nv] and an FP32 state and its gradient
// [nv, dk, dv] per whole chunk (gated_delta.h), or the recurrent fallback's state per token and two
// [T, nv, dk] parts (qwen3_5_kernels.h).
int64_t GdnBackwardBytes(const LinearAttentionConfig& la, int64_t T) {
  const int64_t KD = la.key_dim(), VD = la.value_dim(), nv = la.num_value_heads;
  const int64_t dk = la.key_head_dim, dv = la.value_head_dim;
  const int64_t gradients = T * (4 * VD + 2 * VD + 4 * KD + 4 * KD + 4 * VD + 4 * 2 * nv + 4 * 2 * KD);
  const int64_t state = 4 * nv * dk * dv;
  const int64_t workspace = ChunkedDelta(la)
                                ? T * 4 * nv * (dk + 2 * dv + dk / 64) + 2 * (T / kDeltaChunkTokens) * state
                                : T * (state + 4 * 2 * nv * dk);
  return gradients + workspace;
}

int64_t LargestUnitBf16Bytes(const ModelLayout& layout) {
  int64_t n = 0;
  for (const UnitLayout& u : layout.units) n = std::max(n, u.numel);
  return 2 * n;
}
}  // namespace

std::string ContextMemory::ToString() const {
  constexpr double kGiB = 1073741824.0;
  const char* parts[2] = {"attention", "tile"};
  if (peak_layer == PeakLayer::kGatedDeltaNet) parts[0] = "Gated DeltaNet", parts[1] = "rest of its layer";
  if (peak_layer == PeakLayer::kGatedAttention) parts[0] = "gated attention", parts[1] = "rest of its layer";
  return absl::StrFormat("%.1f GiB (layer inputs %.1f, %s %.1f, %s %.1f, residual %.1f, parameter window %.1f)",
                         device_total() / kGiB, checkpoints / kGiB, parts[0], attention / kGiB, parts[1], tile / kGiB,
                         residual / kGiB, window / kGiB);
}

int64_t ContextGatherBytesPerToken(const ModelConfig& c) { return 2 * c.kv_dim() * (2 + 4 + 4); }

HybridLayerMemory Qwen3_5LayerMemory(const ModelConfig& c, TokenMixer mixer, int64_t tokens, int64_t context_tokens) {
  const int64_t T = std::max<int64_t>(0, tokens);
  HybridLayerMemory m;
  int64_t mixer_backward = 0;  // GdnBackward's block (a gated attention layer's scratch is all in the layer's)
  if (mixer == TokenMixer::kLinearAttention) {
    m.mixer = T * GdnBlockBytesPerToken(c.linear);
    mixer_backward = GdnBackwardBytes(c.linear, T);
  } else {
    m.mixer = T * AttentionBytesPerToken(c) + std::max<int64_t>(0, context_tokens) * ContextGatherBytesPerToken(c);
  }
  m.rest = T * HybridLocalBytesPerToken(c);
  // The MoE block's and the shared expert's backward run before the mixer's, each freeing its
  // scratch: the largest of the three is the layer's peak.
  const int64_t mlp_backward =
      c.is_moe() ? T * std::max(MoeBlockBackwardBytesPerToken(c), SharedExpertBackwardBytesPerToken(c)) : 0;
  if (mixer_backward >= mlp_backward) {
    m.mixer += mixer_backward;
  } else {
    m.rest += mlp_backward;
  }
  return m;
}

ContextMemory EstimateContextMemory(const ModelLayout& layout, const ContextMemoryInputs& in) {
  const ModelConfig& c = layout.config;
  const int64_t layers = c.num_hidden_layers;
  const int64_t kept_layers = std::max<int64_t>(0, layers - std::clamp<int64_t>(in.offloaded_layers, 0, layers));
  const int64_t element = std::clamp<int64_t>(in.checkpoint_element_bytes, 1, kResidualBytes);
  const int64_t input_bytes = in.step_tokens * c.hidden_size * element;
  // A narrower input is widened back to the residual stream's type one micro-batch at a time.
  const int64_t widened = in.micro_batch_tokens * c.hidden_size * (kResidualBytes - element);
  ContextMemory m;
  m.checkpoints = kept_layers * input_bytes + widened;
  m.offloaded = (layers - kept_layers) * input_bytes;
  if (c.is_qwen3_5()) {
    // Untiled layers of two kinds: the parts of the kind whose backward peaks higher.
    HybridLayerMemory peak;
    auto consider = [&](TokenMixer kind, ContextMemory::PeakLayer name) {
      const HybridLayerMemory l = Qwen3_5LayerMemory(c, kind, in.micro_batch_tokens, in.context_tokens);
      if (m.peak_layer != ContextMemory::PeakLayer::kTiled && l.total() <= peak.total()) return;
      peak = l;
      m.peak_layer = name;
    };
    const int64_t linear = c.NumLinearAttentionLayers();
    if (linear > 0) consider(TokenMixer::kLinearAttention, ContextMemory::PeakLayer::kGatedDeltaNet);
    if (layers > linear) consider(TokenMixer::kAttention, ContextMemory::PeakLayer::kGatedAttention);
    m.attention = peak.mixer;
    m.tile = peak.rest;
  } else {
    const int64_t tile = std::min(in.micro_batch_tokens, std::max<int64_t>(1, in.tile_tokens));
    m.attention = in.micro_batch_tokens * AttentionBytesPerToken(c) +
                  std::max<int64_t>(0, in.context_tokens) * ContextGatherBytesPerToken(c);
    m.tile = tile * TileBytesPerToken(c);
    // A MoE model's sparse layers run whole: their scratch grows with the micro-batch.
    if (c.NumSparseLayers() > 0) m.tile = std::max(m.tile, in.micro_batch_tokens * SparseLayerBytesPerToken(c));
  }
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
