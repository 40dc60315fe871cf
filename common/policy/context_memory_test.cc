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
  EXPECT_EQ(m.attention, T * (2 * (2 * 6144 + 2 * 4096 + 2 * 1024 + 2 * 4096) + 4 * 32));
  EXPECT_EQ(m.tile, 32768 * (16 * H + 8 + 12 * I));
  EXPECT_EQ(m.residual, 2 * T * H * 4);
  EXPECT_EQ(m.window, 3 * 2 * l.units.back().numel);  // the head: final norm + untied LM head, padded
  EXPECT_GE(l.units.back().numel, 151936 * H + H);
  EXPECT_EQ(m.device_total(), m.checkpoints + m.attention + m.tile + m.residual + m.window);
  // A micro-batch shorter than a tile: the tile is the micro-batch.
  EXPECT_EQ(EstimateContextMemory(l, {4096, 4096, 0, 32768}).tile, 4096 * (16 * H + 8 + 12 * I));
}

// The longest sequence grows with the device and with host room for offloaded inputs, offloads
// only what it must, and its floor fits while one more token's would not.
TEST(ContextMemory, LongestSequenceFitsAndOneMoreDoesNot) {
  const ModelLayout l = Layout("qwen3-8b");
  const int64_t gib = int64_t{1} << 30, max = int64_t{1} << 24;
  const LongestSequence on_gpu = FindLongestSequence(l, 140 * gib, 0, 32768, max);
  ASSERT_GT(on_gpu.tokens, 0);
  EXPECT_EQ(on_gpu.offloaded_layers, 0);
  EXPECT_LE(on_gpu.memory.device_total(), 140 * gib);
  EXPECT_GT(EstimateContextMemory(l, {on_gpu.tokens + 1, on_gpu.tokens + 1, 0, 32768}).device_total(), 140 * gib);
  const LongestSequence with_host = FindLongestSequence(l, 140 * gib, 60 * gib, 32768, max);
  EXPECT_GT(with_host.tokens, on_gpu.tokens);
  EXPECT_GT(with_host.offloaded_layers, 0);
  EXPECT_LE(with_host.memory.offloaded, 60 * gib);
  EXPECT_LE(with_host.memory.device_total(), 140 * gib);
  const LongestSequence unbounded = FindLongestSequence(l, 140 * gib, -1, 32768, max);
  EXPECT_GE(unbounded.tokens, with_host.tokens);
  EXPECT_EQ(FindLongestSequence(l, 140 * gib, -1, 32768, 1000).tokens, 1000);  // capped
  EXPECT_EQ(FindLongestSequence(l, gib, -1, 32768, max).tokens, 0);  // the window alone does not fit
  // A smaller tile leaves room for a longer sequence.
  EXPECT_GE(FindLongestSequence(l, 140 * gib, 0, 4096, max).tokens, on_gpu.tokens);
}

}  // namespace
}  // namespace slidedp
