#include "common/policy/context_memory.h"

#include "gtest/gtest.h"

namespace slidedp {
namespace {

ModelLayout Layout(const char* preset) { return ModelLayout::Build(ModelConfig::Preset(preset).value()); }

// Each part is what its comment in context_memory.h says, for Qwen3-8B at 256K tokens.
TEST(ContextMemory, PartsOfQwen3_8BAt256K) {
  const ModelLayout l = Layout("qwen3-8b");
  const int64_t T = 262144, H = 4096, I = 12288;
  const ContextMemory m = EstimateContextMemory(l, {T, T, 12, 32768});
  EXPECT_EQ(m.checkpoints, 24 * T * H * 4);
  EXPECT_EQ(m.offloaded, 12 * T * H * 4);
  // qkv 6144, q 4096, kv 1024: (2 * 6144 + 2 * 4096 + 2 * 1024 + 2 * 4096) BF16 + 32 FP32 LSE
  // ... and the attention backward's FP32 dQ accumulator and row sums
  EXPECT_EQ(m.attention, T * (2 * (2 * 6144 + 2 * 4096 + 2 * 1024 + 2 * 4096) + 4 * 32 + 4 * (4096 + 32)));
  EXPECT_EQ(m.tile, 32768 * (16 * H + 8 + 12 * I));
  EXPECT_EQ(m.residual, 2 * T * H * 4);
  EXPECT_EQ(m.window, 3 * 2 * l.units.back().numel);  // the head: final norm + untied LM head, padded
  EXPECT_GE(l.units.back().numel, 151936 * H + H);
  EXPECT_EQ(m.device_total(), m.checkpoints + m.attention + m.tile + m.residual + m.window);
  // A micro-batch shorter than a tile: the tile is the micro-batch.
  EXPECT_EQ(EstimateContextMemory(l, {4096, 4096, 0, 32768}).tile, 4096 * (16 * H + 8 + 12 * I));
}

// Context parallelism: a rank's share of a 1M-token micro-batch on two ranks, plus the whole
// micro-batch's gathered keys and values (BF16) and their FP32 gradients twice in attention.
TEST(ContextMemory, AContextParallelShareHoldsTheWholeKeysInAttention) {
  const ModelLayout l = Layout("qwen3-8b");
  const int64_t whole = 1 << 20, share = whole / 2 + 2;
  ContextMemoryInputs in{share, share, 36, 32768, 2};
  const ContextMemory alone = EstimateContextMemory(l, in);
  in.context_tokens = whole;
  const ContextMemory cp = EstimateContextMemory(l, in);
  EXPECT_EQ(ContextGatherBytesPerToken(l.config), 2 * 1024 * 10);
  EXPECT_EQ(cp.attention - alone.attention, whole * 2 * 1024 * 10);  // 20 GiB at 1M on Qwen3-8B
  EXPECT_EQ(cp.checkpoints, alone.checkpoints);
  EXPECT_EQ(cp.tile, alone.tile);
}

// The longest sequence grows with the device and with host room for offloaded inputs, offloads
// only what it must, and its floor fits while one more token's would not.
TEST(ContextMemory, LongestSequenceFitsAndOneMoreDoesNot) {
  const ModelLayout l = Layout("qwen3-8b");
  const int64_t gib = int64_t{1} << 30, max = int64_t{1} << 24;
  const LongestSequence on_gpu = FindLongestSequence(l, 140 * gib, 0, 32768, max, 4);
  ASSERT_GT(on_gpu.tokens, 0);
  EXPECT_EQ(on_gpu.offloaded_layers, 0);
  EXPECT_LE(on_gpu.memory.device_total(), 140 * gib);
  EXPECT_GT(EstimateContextMemory(l, {on_gpu.tokens + 1, on_gpu.tokens + 1, 0, 32768}).device_total(), 140 * gib);
  const LongestSequence with_host = FindLongestSequence(l, 140 * gib, 60 * gib, 32768, max, 4);
  EXPECT_GT(with_host.tokens, on_gpu.tokens);
  EXPECT_GT(with_host.offloaded_layers, 0);
  EXPECT_LE(with_host.memory.offloaded, 60 * gib);
  EXPECT_LE(with_host.memory.device_total(), 140 * gib);
  const LongestSequence unbounded = FindLongestSequence(l, 140 * gib, -1, 32768, max, 4);
  EXPECT_GE(unbounded.tokens, with_host.tokens);
  EXPECT_EQ(FindLongestSequence(l, 140 * gib, -1, 32768, 1000, 4).tokens, 1000);  // capped
  EXPECT_EQ(FindLongestSequence(l, gib, -1, 32768, max, 4).tokens, 0);            // the window alone does not fit
  // A smaller tile leaves room for a longer sequence.
  EXPECT_GE(FindLongestSequence(l, 140 * gib, 0, 4096, max, 4).tokens, on_gpu.tokens);
}

// runtime.checkpoint_dtype bf16: the layer inputs take 2 B an element on the device and offloaded,
// plus one micro-batch's input widened back to FP32 (2 B an element more than its BF16 copy); the
// other parts do not change.
TEST(ContextMemory, Bf16CheckpointsHalveTheLayerInputs) {
  const ModelLayout l = Layout("qwen3-8b");
  const int64_t T = 262144, H = 4096, mb = 65536;
  const ContextMemory fp32 = EstimateContextMemory(l, {T, mb, 12, 32768});
  const ContextMemory bf16 = EstimateContextMemory(l, {T, mb, 12, 32768, 2});
  EXPECT_EQ(fp32.checkpoints, 24 * T * H * 4);
  EXPECT_EQ(bf16.checkpoints, 24 * T * H * 2 + mb * H * 2);
  EXPECT_EQ(fp32.offloaded, 12 * T * H * 4);
  EXPECT_EQ(bf16.offloaded, 12 * T * H * 2);
  EXPECT_EQ(bf16.attention, fp32.attention);
  EXPECT_EQ(bf16.tile, fp32.tile);
  EXPECT_EQ(bf16.residual, fp32.residual);
  EXPECT_EQ(bf16.window, fp32.window);
  // Every layer offloaded: the widened micro-batch is all that stays of the inputs.
  EXPECT_EQ(EstimateContextMemory(l, {T, mb, 36, 32768, 2}).checkpoints, mb * H * 2);
  // A longer sequence fits, on the device alone and with host room for the offloaded inputs.
  const int64_t gib = int64_t{1} << 30, max = int64_t{1} << 24;
  for (int64_t host : {int64_t{0}, 60 * gib}) {
    const LongestSequence a = FindLongestSequence(l, 140 * gib, host, 32768, max, 4);
    const LongestSequence b = FindLongestSequence(l, 140 * gib, host, 32768, max, 2);
    EXPECT_GT(b.tokens, a.tokens) << host;
    EXPECT_LE(b.memory.device_total(), 140 * gib) << host;
    EXPECT_LE(b.memory.offloaded, host) << host;
    const ContextMemory more = EstimateContextMemory(l, {b.tokens + 1, b.tokens + 1, b.offloaded_layers, 32768, 2});
    EXPECT_TRUE(more.device_total() > 140 * gib || more.offloaded > host) << host;
  }
}

// Qwen3.5-4B's two layer kinds, per token, from the buffers the CUDA backend allocates for a layer's
// backward (cuda_qwen3_5_layer.cc; H 2560, I 9216; 16 heads / 4 kv of 256; a Gated DeltaNet of 16 key
// and 32 value heads of 128: key_dim 2048, value_dim 4096, proj 2 x 2048 + 2 x 4096 + 2 x 32 = 12352).
TEST(ContextMemory, Qwen3_5LayersCountWhatTheirBackwardHolds) {
  const ModelConfig c = *ModelConfig::Preset("qwen3.5-4b");
  const int64_t T = 65536, H = 2560, I = 9216, KD = 2048, VD = 4096, nv = 32, P = 12352;
  // The token-local rest, whole: a dense tile's pieces (xn1, xn2, h1, rstds, gate/up, SwiGLU and
  // their gradients, dxn, the branch and dres copies).
  const int64_t rest = 16 * H + 8 + 12 * I;
  EXPECT_EQ(rest, 151560);
  // Gated DeltaNet: proj and dproj, qk_conv, v_conv, qn, kn, core, gated, dgated (BF16), g, beta;
  // GdnBackward's d_core (FP32 + BF16), dq, dk, dv, dqk, dg, dbeta (FP32); the chunked kernel's W, U,
  // dU, dgamma per token and a state and its gradient (32 x 128 x 128 FP32) per 64 tokens.
  const int64_t block = 2 * 2 * P + 2 * (2 * KD + VD + KD + KD + VD + VD + VD) + 4 * 2 * nv;
  const int64_t gradients = 6 * VD + 4 * KD + 4 * KD + 4 * VD + 8 * KD + 4 * 2 * nv;
  const int64_t workspace = 4 * nv * (128 + 2 * 128 + 2) + 2 * 4 * nv * 128 * 128 / 64;
  EXPECT_EQ(block, 98816);
  EXPECT_EQ(gradients, 73984);
  EXPECT_EQ(workspace, 114944);  // 7.02 GiB at 64K, as gated_delta.h says
  const HybridLayerMemory linear = Qwen3_5LayerMemory(c, TokenMixer::kLinearAttention, T);
  EXPECT_EQ(linear.mixer, T * (block + gradients + workspace));  // 287,744 B a token
  EXPECT_EQ(linear.rest, T * rest);
  // Gated attention: the fused rows 2 x 4096 + 2 x 1024 and their gradient, q and k after RoPE and
  // their gradients, o, o·σ(gate) and its gradient (BF16), the LSE; dQ and row sums (FP32).
  const int64_t qkv = 2 * 4096 + 2 * 1024;
  const int64_t attention = 2 * (2 * qkv + 2 * 4096 + 2 * 1024 + 3 * 4096) + 4 * 16 + 4 * (4096 + 16);
  EXPECT_EQ(attention, 102528);
  const HybridLayerMemory full = Qwen3_5LayerMemory(c, TokenMixer::kAttention, T);
  EXPECT_EQ(full.mixer, T * attention);
  EXPECT_EQ(full.rest, T * rest);
  // With context parallelism the gated attention also holds the whole micro-batch's keys.
  EXPECT_EQ(Qwen3_5LayerMemory(c, TokenMixer::kAttention, T, 2 * T).mixer,
            T * attention + 2 * T * ContextGatherBytesPerToken(c));
  // The floor's parts are the linear layer's (the larger), for the whole micro-batch: no tiles.
  const ContextMemory m = EstimateContextMemory(Layout("qwen3.5-4b"), {T, T, 0, 4096});
  EXPECT_EQ(m.attention, linear.mixer);
  EXPECT_EQ(m.tile, linear.rest);
  EXPECT_EQ(m.checkpoints, 32 * T * H * 4);
  EXPECT_EQ(m.residual, 2 * T * H * 4);
  EXPECT_EQ(m.peak_layer, ContextMemory::PeakLayer::kGatedDeltaNet);
  EXPECT_NE(m.ToString().find("Gated DeltaNet 17.6, rest of its layer 9.3"), std::string::npos) << m.ToString();
  // A model of gated attention layers only: theirs.
  ModelConfig attention_only = c;
  attention_only.layer_mixers.assign(c.num_hidden_layers, TokenMixer::kAttention);
  const ContextMemory a = EstimateContextMemory(ModelLayout::Build(attention_only), {T, T, 0, 4096});
  EXPECT_EQ(a.peak_layer, ContextMemory::PeakLayer::kGatedAttention);
  EXPECT_EQ(a.attention, full.mixer);
  EXPECT_NE(a.ToString().find("gated attention"), std::string::npos) << a.ToString();
  EXPECT_EQ(EstimateContextMemory(Layout("qwen3-8b"), {T, T, 0, 4096}).peak_layer, ContextMemory::PeakLayer::kTiled);
}

// The recurrent fallback (head dims the chunked kernels do not take, the tiny presets') keeps a
// state per token; a qwen3_5_moe layer's rest is its MoE block's backward where that is larger than
// the mixer's backward scratch, and the MoE block's and the shared expert's scratch never add up.
TEST(ContextMemory, Qwen3_5FallbackAndMoeLayers) {
  const ModelConfig tiny = *ModelConfig::Preset("tiny-qwen3.5");  // H 64, 2 key / 4 value heads of 16
  const int64_t T = 1000;
  const int64_t block = 16 * 32 + 16 * 64 + 16 * 4, gradients = 10 * 64 + 16 * 32 + 8 * 4;
  const int64_t recurrent = 4 * 4 * 16 * 16 + 2 * 4 * 4 * 16;  // a state per token and two [T, nv, dk]
  EXPECT_EQ(Qwen3_5LayerMemory(tiny, TokenMixer::kLinearAttention, T).mixer, T * (block + gradients + recurrent));
  const ModelConfig moe = *ModelConfig::Preset("qwen3.5-35b-a3b");  // H 2048, 8 of 256 experts of 512, shared 512
  const int64_t H = 2048, S = 512;
  const int64_t local = 5 * 2 * H + 3 * 4 * H + 3 * 4 + 6 * S;
  const int64_t moe_block = 8 * (6 * H + 12 * 512 + 16) + 8 * 256;
  const HybridLayerMemory full = Qwen3_5LayerMemory(moe, TokenMixer::kAttention, T);
  EXPECT_EQ(full.rest, T * (local + moe_block));
  // The Gated DeltaNet's backward scratch (188,928 B a token at 64-token multiples) is larger than
  // the MoE block's (149,632): it alone counts, in the mixer's part.
  const HybridLayerMemory linear = Qwen3_5LayerMemory(moe, TokenMixer::kLinearAttention, 64 * T);
  EXPECT_EQ(linear.rest, 64 * T * local);
  EXPECT_EQ(linear.mixer, 64 * T * (98816 + 73984 + 114944));
}

// A qwen3_5 floor: larger than the generic (tiled) formula would say, linear in the tokens, and
// the longest sequence is finite, fits, and one more token does not.
TEST(ContextMemory, Qwen3_5FloorIsUntiledLinearAndBoundsTheSequence) {
  const int64_t gib = int64_t{1} << 30, max = int64_t{1} << 24;
  for (const char* preset : {"qwen3.5-4b", "tiny-qwen3.5", "qwen3.5-35b-a3b"}) {
    const ModelLayout l = Layout(preset);
    // The same sizes read as a model of standard attention + MLP layers, tiled.
    ModelConfig generic_config = l.config;
    generic_config.family = generic_config.is_moe() ? ModelFamily::kQwen3Moe : ModelFamily::kQwen3;
    generic_config.layer_mixers.clear();
    generic_config.shared_expert_intermediate_size = 0;
    const ModelLayout generic = ModelLayout::Build(generic_config);
    const int64_t T = 131072, tile = 32768;
    const ContextMemory m = EstimateContextMemory(l, {T, T, 0, tile});
    const ContextMemory g = EstimateContextMemory(generic, {T, T, 0, tile});
    EXPECT_GT(m.attention + m.tile, g.attention + g.tile) << preset;
    // Linear in the tokens (at multiples of the delta rule's 64-token chunks), whatever the tile.
    const ContextMemory twice = EstimateContextMemory(l, {2 * T, 2 * T, 0, tile});
    EXPECT_EQ(twice.device_total() - twice.window, 2 * (m.device_total() - m.window)) << preset;
    EXPECT_EQ(EstimateContextMemory(l, {T, T, 0, 1024}).device_total(), m.device_total()) << preset;
    const LongestSequence longest = FindLongestSequence(l, 80 * gib, 0, tile, max, 4);
    ASSERT_GT(longest.tokens, 0) << preset;
    ASSERT_LT(longest.tokens, max) << preset;
    EXPECT_EQ(longest.offloaded_layers, 0) << preset;
    EXPECT_LE(longest.memory.device_total(), 80 * gib) << preset;
    EXPECT_EQ(longest.memory.device_total(),
              EstimateContextMemory(l, {longest.tokens, longest.tokens, 0, tile}).device_total())
        << preset;
    EXPECT_GT(EstimateContextMemory(l, {longest.tokens + 1, longest.tokens + 1, 0, tile}).device_total(), 80 * gib)
        << preset;
    EXPECT_LT(longest.tokens, FindLongestSequence(generic, 80 * gib, 0, tile, max, 4).tokens) << preset;
    // A smaller tile does not lengthen it: the layers run untiled.
    EXPECT_EQ(FindLongestSequence(l, 80 * gib, 0, 1024, max, 4).tokens, longest.tokens) << preset;
    // Host room for offloaded inputs lengthens it, within that room.
    const LongestSequence with_host = FindLongestSequence(l, 80 * gib, 200 * gib, tile, max, 4);
    EXPECT_GE(with_host.tokens, longest.tokens) << preset;
    EXPECT_LE(with_host.memory.offloaded, 200 * gib) << preset;
  }
}

}  // namespace
// A MoE model's sparse layers run whole: their block's scratch grows with the micro-batch, not the
// tile, and is counted (Qwen3-30B-A3B: 8 slots a token).
TEST(ContextMemory, SparseLayersScratchGrowsWithTheMicroBatch) {
  const ModelLayout moe = ModelLayout::Build(*ModelConfig::Preset("qwen3-30b-a3b"));
  const ContextMemory short_row = EstimateContextMemory(moe, {4096, 4096, 0, 1024, 4});
  const ContextMemory long_row = EstimateContextMemory(moe, {65536, 65536, 0, 1024, 4});
  EXPECT_EQ(long_row.tile, 16 * short_row.tile);
  // k x (6 hidden + 12 moe_intermediate) bytes a token at least: 8 x (12,288 + 9,216).
  EXPECT_GE(long_row.tile, int64_t{65536} * 8 * (6 * 2048 + 12 * 768));
  // A dense model's tile stays bounded by tile_tokens.
  const ModelLayout dense = ModelLayout::Build(*ModelConfig::Preset("qwen3-0.6b"));
  EXPECT_EQ(EstimateContextMemory(dense, {65536, 65536, 0, 1024, 4}).tile,
            EstimateContextMemory(dense, {4096, 4096, 0, 1024, 4}).tile);
}

}  // namespace slidedp
