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
