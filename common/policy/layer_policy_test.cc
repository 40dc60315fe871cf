// Policy files: a layout round-trips through its YAML; every malformed file is INVALID_ARGUMENT
// naming what is wrong; a layout for another model shape or device is FAILED_PRECONDITION naming
// the field; the file reader refuses what is not a small regular file.
#include "common/policy/layer_policy.h"

#include <gtest/gtest.h>

#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace slidedp {
namespace {

constexpr char kTwoLayers[] = R"(version: 1
model: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, intermediate_size: 128, vocab_size: 512}
device: NVIDIA H200
tokens_per_step: 65536
layers:
  - {kind: recompute, offload: true}
  - {kind: keep_all}
)";

ModelConfig Tiny() { return *ModelConfig::Preset("tiny"); }

TEST(LayerPolicy, ParsesAndRoundTrips) {
  auto l = LayerLayout::Parse(kTwoLayers, "p.yaml");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->model, ModelShape::Of(Tiny()));
  EXPECT_EQ(l->device, "NVIDIA H200");
  EXPECT_EQ(l->tokens_per_step, 65536);
  ASSERT_EQ(l->layers.size(), 2u);
  EXPECT_EQ(l->layers[0], (LayerPolicy{LayerKind::kRecompute, true}));
  EXPECT_EQ(l->layers[1], (LayerPolicy{LayerKind::kKeepAll, false}));
  auto again = LayerLayout::Parse(l->ToYaml(), "again");
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << l->ToYaml();
  EXPECT_EQ(*again, *l);
  EXPECT_TRUE(l->CheckModel(Tiny()).ok());
  EXPECT_TRUE(l->CheckDevice("NVIDIA H200").ok());
  LayerLayout any = *l;
  any.device.clear();
  EXPECT_TRUE(any.CheckDevice("cpu").ok());
}

// Segment checkpoints name the expensive pieces they keep; a segment without them, an unknown or
// repeated piece, or `keep` on another kind is refused naming it.
TEST(LayerPolicy, SegmentsNameTheirPieces) {
  const std::string seg = absl::StrReplaceAll(
      kTwoLayers, {{"{kind: keep_all}", "{kind: segment, keep: [gate_up, qkv], offload: true}"}});
  auto l = LayerLayout::Parse(seg, "seg.yaml");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->layers[1], (LayerPolicy{LayerKind::kSegment, true, kPieceQkv | kPieceGateUp}));
  EXPECT_EQ(l->layers[1].pieces(), kPieceQkv | kPieceGateUp);
  EXPECT_EQ(LayerPolicyName(l->layers[1]), "segment(qkv+gate_up)+offload");
  // A share of the checkpoints: a number in [0, 1]; true is all of them, false and 0 none.
  auto share = LayerLayout::Parse(absl::StrReplaceAll(seg, {{"offload: true", "offload: 0.25"}}), "share.yaml");
  ASSERT_TRUE(share.ok()) << share.status();
  EXPECT_EQ(share->layers[1].offload, 0.25);
  EXPECT_EQ(LayerPolicyName(share->layers[1]), "segment(qkv+gate_up)+offload(0.25)");
  auto share_again = LayerLayout::Parse(share->ToYaml(), "again");
  ASSERT_TRUE(share_again.ok()) << share_again.status() << "\n" << share->ToYaml();
  EXPECT_EQ(*share_again, *share);
  for (const auto& [text, want] : std::vector<std::pair<std::string, double>>{
           {"offload: false", 0}, {"offload: 0", 0}, {"offload: 1", 1}, {"offload: 1.0", 1}, {"offload: 0.75", 0.75}}) {
    auto v = LayerLayout::Parse(absl::StrReplaceAll(seg, {{"offload: true", text}}), "v.yaml");
    ASSERT_TRUE(v.ok()) << text << ": " << v.status();
    EXPECT_EQ(v->layers[1].offload, want) << text;
  }
  EXPECT_EQ((LayerPolicy{LayerKind::kSelective}).pieces(), kPieceAttention);
  EXPECT_EQ((LayerPolicy{LayerKind::kKeepAll}).pieces(), kAllPieces);
  auto again = LayerLayout::Parse(l->ToYaml(), "again");
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << l->ToYaml();
  EXPECT_EQ(*again, *l);
  for (const auto& [bad, named] : std::vector<std::pair<std::string, std::string>>{
           {"{kind: segment}", "keep"},
           {"{kind: segment, keep: []}", "keep"},
           {"{kind: segment, keep: [lm_head]}", "lm_head"},
           {"{kind: segment, keep: [qkv, qkv]}", "twice"},
           {"{kind: segment, keep: qkv}", "keep"},
           {"{kind: keep_all, keep: [qkv]}", "only a segment"}}) {
    auto st = LayerLayout::Parse(absl::StrReplaceAll(kTwoLayers, {{"{kind: keep_all}", bad}}), "p.yaml").status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(st.message(), named)) << bad << ": " << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "layers[1]")) << bad << ": " << st;
  }
}

TEST(LayerPolicy, MalformedFilesAreInvalidArgumentNamingTheProblem) {
  const std::string good = kTwoLayers;
  struct Case {
    std::string text;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"", "expected a map"},
      {"[1, 2]", "expected a map"},
      {"{", "not YAML"},
      {absl::StrReplaceAll(good, {{"version: 1", "version: 2"}}), "version 2"},
      {absl::StrReplaceAll(good, {{"version: 1\n", ""}}), "no version"},
      {absl::StrReplaceAll(good, {{"hidden_size: 64, ", ""}}), "model.hidden_size missing"},
      {absl::StrReplaceAll(good, {{"hidden_size: 64", "hidden_size: -64"}}), "model.hidden_size"},
      {absl::StrReplaceAll(good, {{"hidden_size: 64", "hidden_size: big"}}), "model.hidden_size"},
      {absl::StrReplaceAll(good, {{"hidden_size: 64", "hidden_sise: 64"}}), "unknown key 'hidden_sise'"},
      {absl::StrReplaceAll(good, {{"kind: keep_all", "kind: keep_some"}}), "layers[1]: kind 'keep_some'"},
      {absl::StrReplaceAll(good, {{"{kind: keep_all}", "{offload: true}"}}), "layers[1]: kind missing"},
      {absl::StrReplaceAll(good, {{"offload: true", "offload: 1.5"}}), "layers[0]: offload"},
      {absl::StrReplaceAll(good, {{"offload: true", "offload: -0.25"}}), "layers[0]: offload"},
      {absl::StrReplaceAll(good, {{"offload: true", "offload: nan"}}), "layers[0]: offload"},
      {absl::StrReplaceAll(good, {{"offload: true", "offload: half"}}), "layers[0]: offload"},
      {absl::StrReplaceAll(good, {{"offload: true", "offload: [1]"}}), "layers[0]: offload"},
      {absl::StrReplaceAll(good, {{"offload: true", "offloaded: true"}}), "unknown key 'offloaded'"},
      {absl::StrReplaceAll(good, {{"  - {kind: keep_all}\n", ""}}), "1 entries for model.num_hidden_layers 2"},
      {absl::StrReplaceAll(good, {{"  - {kind: keep_all}\n", "  - keep_all\n"}}), "layers[1]: expected"},
      {absl::StrReplaceAll(good, {{"tokens_per_step: 65536", "tokens_per_step: lots"}}), "tokens_per_step"},
      {absl::StrReplaceAll(good, {{"device: NVIDIA H200", "device: [a]"}}), "device"},
      {absl::StrCat(good, "extra: 1\n"), "unknown key 'extra'"},
      // What is not a short name is not echoed (the file could be one the client cannot read).
      {absl::StrCat(good, "root:*:20228:0:99999:7::: 1\n"), "unknown key (a value not shown)"},
      {std::string(kMaxPolicyFileBytes + 1, '#'), "more than"},
  };
  for (const Case& c : cases) {
    auto l = LayerLayout::Parse(c.text, "p.yaml");
    ASSERT_FALSE(l.ok()) << c.says;
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << l.status();
    EXPECT_TRUE(absl::StrContains(l.status().message(), c.says)) << c.says << " / " << l.status();
    EXPECT_TRUE(absl::StrContains(l.status().message(), "p.yaml")) << l.status();
  }
}

TEST(LayerPolicy, AnotherModelOrDeviceIsAFailedPreconditionNamingIt) {
  auto l = LayerLayout::Parse(kTwoLayers, "p.yaml");
  ASSERT_TRUE(l.ok()) << l.status();
  ModelConfig other = Tiny();
  other.intermediate_size = 256;
  absl::Status s = l->CheckModel(other);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "model.intermediate_size 128")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "256")) << s;
  s = l->CheckDevice("NVIDIA H100");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "NVIDIA H100")) << s;
}

TEST(LayerPolicy, LoadReadsSmallRegularFilesOnly) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/policy-ok.yaml";
  std::ofstream(path) << kTwoLayers;
  auto l = LayerLayout::Load(path);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->layers.size(), 2u);
  EXPECT_EQ(LayerLayout::Load(dir + "/no-such-policy.yaml").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LayerLayout::Load(dir).status().code(), absl::StatusCode::kInvalidArgument);  // a directory
  EXPECT_EQ(LayerLayout::Load("/dev/zero").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp

namespace slidedp {
namespace {

// A MoE model's kept gate_up piece is its sparse layers' block when that is larger than a dense
// layer's gate/up: E probabilities, 5 k routing entries, k x (2 moe_I + hidden) expert rows.
TEST(KeptElements, MoeBlockCountsItsRoutingAndExpertRows) {
  const ModelConfig moe = *ModelConfig::Preset("qwen3-30b-a3b");
  const ModelShape m = ModelShape::Of(moe);
  EXPECT_EQ(m.num_experts, 128);
  const int64_t block = 128 + 5 * 8 + 8 * (2 * 768 + 2048);
  EXPECT_EQ(KeptElementsPerToken(m, kPieceGateUp), std::max<int64_t>(2 * moe.intermediate_size, block));
  // A dense model: gate and up.
  const ModelShape d = ModelShape::Of(*ModelConfig::Preset("tiny"));
  EXPECT_EQ(KeptElementsPerToken(d, kPieceGateUp), 2 * d.intermediate_size);
  // Shapes that differ only in their experts are different shapes.
  ModelShape other = m;
  other.num_experts_per_tok = 4;
  EXPECT_FALSE(other == m);
}

// qwen3_5's, gemma3's and gemma4's layers keep nothing under any policy (both backends recompute
// them from their input): nothing per token, whatever the pieces, in FP32 elements and in the CUDA
// backend's bytes, also for a shape read back from a policy file.
TEST(KeptElements, SandwichAndHybridLayersKeepNothing) {
  for (const char* preset :
       {"qwen3.5-4b", "qwen3.5-35b-a3b", "tiny-qwen3.5", "tiny-qwen3.5-moe", "gemma3-4b", "tiny-gemma3", "tiny-gemma4"}) {
    const ModelShape m = ModelShape::Of(*ModelConfig::Preset(preset));
    EXPECT_FALSE(m.layers_keep_pieces()) << preset;
    for (uint32_t pieces : {uint32_t{kPieceAttention}, uint32_t{kPieceQkv | kPieceGateUp}, kExpensivePieces, kAllPieces}) {
      EXPECT_EQ(KeptElementsPerToken(m, pieces), 0) << preset << " " << LayerPiecesName(pieces);
      EXPECT_EQ(CudaKeptBytesPerToken(m, pieces), 0) << preset << " " << LayerPiecesName(pieces);
      EXPECT_EQ(CudaKeptBytesPerToken(m, pieces, 2), 0) << preset << " " << LayerPiecesName(pieces);
    }
  }
  const std::string file =
      absl::StrReplaceAll(kTwoLayers, {{"model: {hidden_size", "model: {model_type: qwen3_5, hidden_size"}});
  auto l = LayerLayout::Parse(file, "q.yaml");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_FALSE(l->model.layers_keep_pieces());
  EXPECT_EQ(KeptElementsPerToken(l->model, l->layers[1].pieces()), 0);
  // The other families keep what the pieces name.
  for (const char* preset : {"tiny", "qwen3-8b", "qwen3-30b-a3b", "llama3.2-1b", "tiny-gpt-oss"}) {
    const ModelShape m = ModelShape::Of(*ModelConfig::Preset(preset));
    EXPECT_TRUE(m.layers_keep_pieces()) << preset;
    EXPECT_GT(KeptElementsPerToken(m, kPieceAttention), 0) << preset;
    EXPECT_GT(CudaKeptBytesPerToken(m, kAllPieces), CudaKeptBytesPerToken(m, kPieceAttention)) << preset;
  }
}

}  // namespace
}  // namespace slidedp
