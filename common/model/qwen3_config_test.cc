#include "common/model/qwen3_config.h"

#include "gtest/gtest.h"

namespace slidedp {
namespace {

TEST(Qwen3Config, PresetLayoutCountsMatchPublishedSizes) {
  auto c = Qwen3Config::Preset("qwen3-0.6b");
  ASSERT_TRUE(c.ok());
  ModelLayout m = ModelLayout::Build(*c);
  EXPECT_EQ(m.num_units(), 30);
  EXPECT_TRUE(m.head_uses_embedding);
  // Qwen3-0.6B has 596,049,920 parameters (tied) in HF.
  EXPECT_EQ(m.param_count(), 596049920);
  for (const UnitLayout& u : m.units) {
    EXPECT_EQ(u.numel % kTensorAlignNumel, 0);
    for (const TensorSlot& t : u.tensors) EXPECT_EQ(t.offset_numel % kTensorAlignNumel, 0);
  }
}

TEST(Qwen3Config, UntiedHeadHasLmHead) {
  auto c = Qwen3Config::Preset("qwen3-8b");
  ASSERT_TRUE(c.ok());
  ModelLayout m = ModelLayout::Build(*c);
  EXPECT_EQ(m.head().tensors.size(), 2u);
  int unit = -1;
  const TensorSlot* t = m.Find("lm_head.weight", &unit);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(unit, m.num_units() - 1);
  EXPECT_EQ(m.param_count(), 8190735360);
}

TEST(Qwen3Config, JsonRoundTrip) {
  auto c = Qwen3Config::Preset("tiny");
  ASSERT_TRUE(c.ok());
  auto back = Qwen3Config::FromJson(c->ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->hidden_size, c->hidden_size);
  EXPECT_EQ(back->head_dim, c->head_dim);
  EXPECT_EQ(back->tie_word_embeddings, c->tie_word_embeddings);
}

TEST(Qwen3Config, RejectsBadConfigs) {
  EXPECT_EQ(Qwen3Config::FromJson("[1,2]").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Qwen3Config::FromJson("{\"model_type\":\"llama\"}").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto s = Qwen3Config::FromJson(
      R"({"model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":3,
          "num_key_value_heads":2,"intermediate_size":8,"vocab_size":10})");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  auto t = Qwen3Config::FromJson(R"({"hidden_size":"64"})");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("hidden_size"), std::string::npos);
}

TEST(Qwen3Config, RopeParametersOfTransformers5) {
  const std::string base = R"("model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
      "num_key_value_heads":2,"intermediate_size":8,"vocab_size":10,)";
  auto c = Qwen3Config::FromJson("{" + base + R"("rope_parameters":{"rope_type":"default","rope_theta":5000.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 5000.0);
  auto bad = Qwen3Config::FromJson("{" + base + R"("rope_scaling":{"rope_type":"yarn","factor":4.0}})");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("yarn"), std::string::npos);
}

}  // namespace
}  // namespace slidedp

namespace slidedp {
namespace {

// The FSDP2 peer's convention (../shared/bench/peers/fsdp2_qwen3.py): 6 x (parameters without the
// input embedding, which counts again as the LM head when tied) + 6 x layers x seq x heads x 128.
TEST(ModelLayout, ModelFlopsPerTokenFollowsThePeersConvention) {
  for (const char* preset : {"qwen3-4b", "qwen3-8b"}) {
    const ModelLayout layout = ModelLayout::Build(*Qwen3Config::Preset(preset));
    const Qwen3Config& c = layout.config;
    const double n = static_cast<double>(layout.param_count());
    const double n_matmul = c.tie_word_embeddings ? n : n - static_cast<double>(c.vocab_size * c.hidden_size);
    const double want = 6 * n_matmul + 6.0 * c.num_hidden_layers * 4096 * c.num_attention_heads * 128;
    EXPECT_DOUBLE_EQ(layout.ModelFlopsPerToken(4096), want) << preset;
  }
}

}  // namespace
}  // namespace slidedp

namespace slidedp {
namespace {

TEST(ModelLayout, DescribesElementsForErrorMessages) {
  auto c = Qwen3Config::Preset("tiny");
  ASSERT_TRUE(c.ok());
  const ModelLayout l = ModelLayout::Build(*c);
  const UnitLayout& layer = l.units[1];
  const TensorSlot& q = layer.tensors[kQProj];
  EXPECT_EQ(DescribeUnitElement(layer, q.offset_numel + q.shape[1] * 2 + 5), q.hf_name + "[2, 5]");
  const TensorSlot& norm = layer.tensors[kInputNorm];
  EXPECT_EQ(DescribeUnitElement(layer, norm.offset_numel + norm.numel), "the padding after " + norm.hf_name);
  EXPECT_EQ(TensorIndexString({3, 4, 5}, 4 * 5 + 2 * 5 + 1), "[1, 2, 1]");
  EXPECT_EQ(TensorIndexString({7}, 6), "[6]");
}

}  // namespace
}  // namespace slidedp
