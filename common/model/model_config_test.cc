#include "common/model/model_config.h"

#include "gtest/gtest.h"

namespace slidedp {
namespace {

TEST(ModelConfig, PresetLayoutCountsMatchPublishedSizes) {
  auto c = ModelConfig::Preset("qwen3-0.6b");
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

TEST(ModelConfig, UntiedHeadHasLmHead) {
  auto c = ModelConfig::Preset("qwen3-8b");
  ASSERT_TRUE(c.ok());
  ModelLayout m = ModelLayout::Build(*c);
  EXPECT_EQ(m.head().tensors.size(), 2u);
  int unit = -1;
  const TensorSlot* t = m.Find("lm_head.weight", &unit);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(unit, m.num_units() - 1);
  EXPECT_EQ(m.param_count(), 8190735360);
}

TEST(ModelConfig, JsonRoundTrip) {
  auto c = ModelConfig::Preset("tiny");
  ASSERT_TRUE(c.ok());
  auto back = ModelConfig::FromJson(c->ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->hidden_size, c->hidden_size);
  EXPECT_EQ(back->head_dim, c->head_dim);
  EXPECT_EQ(back->tie_word_embeddings, c->tie_word_embeddings);
}

TEST(ModelConfig, RejectsBadConfigs) {
  EXPECT_EQ(ModelConfig::FromJson("[1,2]").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ModelConfig::FromJson("{\"model_type\":\"llama\"}").status().code(),
            absl::StatusCode::kInvalidArgument);
  auto s = ModelConfig::FromJson(
      R"({"model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":3,
          "num_key_value_heads":2,"intermediate_size":8,"vocab_size":10})");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  auto t = ModelConfig::FromJson(R"({"hidden_size":"64"})");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("hidden_size"), std::string::npos);
}

TEST(ModelConfig, RopeParametersOfTransformers5) {
  const std::string base = R"("model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
      "num_key_value_heads":2,"intermediate_size":8,"vocab_size":10,)";
  auto c = ModelConfig::FromJson("{" + base + R"("rope_parameters":{"rope_type":"default","rope_theta":5000.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 5000.0);
  auto bad = ModelConfig::FromJson("{" + base + R"("rope_scaling":{"rope_type":"yarn","factor":4.0}})");
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
    const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset(preset));
    const ModelConfig& c = layout.config;
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
  auto c = ModelConfig::Preset("tiny");
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

namespace slidedp {
namespace {

std::string Sizes() {
  return R"("hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "intermediate_size":96,"vocab_size":100)";
}

TEST(ModelFamilies, EachFamilyHasItsTensors) {
  auto names = [](const ModelLayout& l) {
    std::vector<std::string> out;
    for (const TensorSlot& t : l.units[1].tensors) out.push_back(t.hf_name.substr(std::string("model.layers.0.").size()));
    return out;
  };
  const auto qwen2 = ModelConfig::FromJson(R"({"model_type":"qwen2",)" + Sizes() + "}");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status();
  const ModelLayout l2 = ModelLayout::Build(*qwen2);
  EXPECT_EQ(names(l2), (std::vector<std::string>{"input_layernorm.weight", "self_attn.q_proj.weight",
                                                 "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                                                 "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                                                 "self_attn.v_proj.bias", "self_attn.o_proj.weight",
                                                 "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                                                 "mlp.up_proj.weight", "mlp.down_proj.weight"}));
  EXPECT_EQ(l2.units[1].Find(kQNorm), nullptr);
  ASSERT_NE(l2.units[1].Find(kKBias), nullptr);
  EXPECT_EQ(l2.units[1].Find(kKBias)->hf_name, "model.layers.0.self_attn.k_proj.bias");
  EXPECT_EQ(l2.units[1].Find(kKBias)->fp32_offset, -1);  // biases are not norms: no FP32 side copy
  EXPECT_GE(l2.units[1].Find(kPostNorm)->fp32_offset, 0);
  // qwen2 counts: 0.5B-shaped preset has HF's 494,032,768 parameters.
  EXPECT_EQ(ModelLayout::Build(*ModelConfig::Preset("qwen2.5-0.5b")).param_count(), 494032768);
  EXPECT_EQ(ModelLayout::Build(*ModelConfig::Preset("llama3.1-8b")).param_count(), 8030261248);
  EXPECT_EQ(ModelLayout::Build(*ModelConfig::Preset("llama3.2-1b")).param_count(), 1235814400);
  EXPECT_EQ(ModelLayout::Build(*ModelConfig::Preset("mistral-7b")).param_count(), 7248023552);

  const auto llama = ModelConfig::FromJson(R"({"model_type":"llama",)" + Sizes() + "}");
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(ModelLayout::Build(*llama).units[1].tensors.size(), 9u);
  EXPECT_FALSE(llama->has_qk_norm());
  EXPECT_FALSE(llama->has_qkv_bias());
}

TEST(ModelFamilies, FieldsThatChangeTheMathAreRefusedByName) {
  auto refused = [](const std::string& json, const std::string& field) {
    const auto c = ModelConfig::FromJson(json);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
  };
  refused(R"({"model_type":"llama",)" + Sizes() + R"(,"attention_bias":true})", "attention_bias");
  refused(R"({"model_type":"llama",)" + Sizes() + R"(,"mlp_bias":true})", "mlp_bias");
  refused(R"({"model_type":"qwen2",)" + Sizes() + R"(,"hidden_act":"gelu"})", "hidden_act");
  refused(R"({"model_type":"llama",)" + Sizes() + R"(,"rope_scaling":{"rope_type":"yarn","factor":4.0}})",
          "rope_scaling.rope_type");
  refused(R"({"model_type":"llama",)" + Sizes() + R"(,"rope_scaling":{"rope_type":"llama3","factor":8.0}})",
          "low_freq_factor");
  refused(R"({"model_type":"qwen2",)" + Sizes() + R"(,"attention_dropout":0.1})", "attention_dropout");
  refused(R"({"model_type":"qwen2_moe",)" + Sizes() + "}", "model_type");
  refused(R"({"model_type":"mistral",)" + Sizes() + R"(,"sliding_window":-3})", "sliding_window");
  refused(R"({"model_type":"qwen2",)" + Sizes() + R"(,"use_sliding_window":true,"max_window_layers":1})",
          "sliding_window");
}

TEST(ModelFamilies, SlidingWindows) {
  const auto m = ModelConfig::FromJson(R"({"model_type":"mistral",)" + Sizes() + R"(,"sliding_window":4096})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->sliding_window, 4096);
  EXPECT_TRUE(m->SlidingWindowCovers(4096));
  EXPECT_FALSE(m->SlidingWindowCovers(4097));
  // qwen2 carries a window it does not use unless use_sliding_window (and a layer reaches
  // max_window_layers).
  const auto q = ModelConfig::FromJson(R"({"model_type":"qwen2",)" + Sizes() +
                                       R"(,"sliding_window":32768,"use_sliding_window":false})");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->sliding_window, 0);
  const auto q2 = ModelConfig::FromJson(R"({"model_type":"qwen2",)" + Sizes() +
                                        R"(,"sliding_window":512,"use_sliding_window":true,"max_window_layers":2})");
  ASSERT_TRUE(q2.ok());
  EXPECT_EQ(q2->sliding_window, 0);
  const auto q3 = ModelConfig::FromJson(R"({"model_type":"qwen3",)" + Sizes() +
                                        R"(,"sliding_window":512,"layer_types":["full_attention","sliding_attention"]})");
  ASSERT_TRUE(q3.ok()) << q3.status();
  EXPECT_EQ(q3->sliding_window, 512);
}

// Llama 3.1's frequencies: the high-frequency band unchanged, the low one divided by the factor,
// the middle one smoothly between (HF _compute_llama3_parameters).
TEST(ModelFamilies, Llama3RopeScalingBands) {
  const ModelConfig c = *ModelConfig::Preset("llama3.1-8b");
  ModelConfig plain = c;
  plain.rope_scaling = RopeScaling{};
  const std::vector<float> scaled = c.RopeInverseFrequencies(), base = plain.RopeInverseFrequencies();
  ASSERT_EQ(scaled.size(), 64u);
  int high = 0, low = 0, mid = 0;
  for (size_t i = 0; i < scaled.size(); ++i) {
    const double wavelen = 2 * M_PI / base[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_EQ(scaled[i], base[i]) << i;
      ++high;
    } else if (wavelen > 8192.0) {
      EXPECT_EQ(scaled[i], base[i] / 8.0f) << i;
      ++low;
    } else {
      EXPECT_LT(scaled[i], base[i]) << i;
      EXPECT_GT(scaled[i], base[i] / 8.0f) << i;
      ++mid;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(mid, 0);
  // Round trip: the llama3 parameters survive ToJson / FromJson.
  const auto back = ModelConfig::FromJson(c.ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->family, ModelFamily::kLlama);
  EXPECT_EQ(back->RopeInverseFrequencies(), scaled);
}

TEST(ModelFamilies, SourceConfigIsKeptOnSave) {
  const auto c = ModelConfig::FromJson(R"({"model_type":"llama","architectures":["LlamaForCausalLM"],)" + Sizes() +
                                       R"(,"bos_token_id":128000,"eos_token_id":[128001,128009],
                                          "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":32.0,
                                          "low_freq_factor":1.0,"high_freq_factor":4.0,
                                          "original_max_position_embeddings":8192}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 500000.0);
  const std::string saved = c->ToJson();
  EXPECT_NE(saved.find("128009"), std::string::npos) << saved;
  EXPECT_NE(saved.find("rope_parameters"), std::string::npos);
  const auto back = ModelConfig::FromJson(saved);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->RopeInverseFrequencies(), c->RopeInverseFrequencies());
}

}  // namespace
}  // namespace slidedp
