#include "common/model/model_config.h"

#include <cmath>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

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

// Qwen/Qwen3-32B's config.json (64 query heads of 128 on hidden 5120, untied): HF's 32.8B parameters.
TEST(ModelConfig, Qwen3_32bPresetIsTheHubsShape) {
  auto c = ModelConfig::Preset("qwen3-32b");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_hidden_layers, 64);
  EXPECT_EQ(c->q_dim(), 8192);
  EXPECT_EQ(c->kv_dim(), 1024);
  EXPECT_EQ(ModelLayout::Build(*c).param_count(), 32762123264);
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

// Sizes no model has are refused before anything is built from them: a layer count that would
// grow the layout's tables without end, products that would overflow, a RoPE base whose
// frequencies overflow, JSON nested without end.
TEST(ModelConfig, HostileSizesAreRefusedByName) {
  const std::string base = R"("model_type":"qwen3","hidden_size":64,"num_attention_heads":4,"num_key_value_heads":2,
      "intermediate_size":8,"vocab_size":10,)";
  EXPECT_TRUE(ModelConfig::FromJson("{" + base + R"("num_hidden_layers":2})").ok());
  for (const auto& [extra, names] : std::vector<std::pair<std::string, std::string>>{
           {R"("num_hidden_layers":100000000})", "num_hidden_layers"},
           {R"("num_hidden_layers":2,"intermediate_size":4611686018427387904})", "intermediate_size"},
           {R"("num_hidden_layers":2,"hidden_size":65536,"head_dim":128,"vocab_size":2000000000})", "parameters"},
           {R"("num_hidden_layers":2,"rope_theta":5e-324})", "rope_theta"},
           {R"("num_hidden_layers":2,"rope_scaling":{"rope_type":"dynamic","factor":1e300}})", "factor"},
       }) {
    auto c = ModelConfig::FromJson("{" + base + extra);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << extra;
    EXPECT_NE(c.status().message().find(names), std::string::npos) << extra << ": " << c.status();
  }
  auto deep = ModelConfig::FromJson("{" + base + R"("num_hidden_layers":2,"x":)" + std::string(100000, '[') +
                                    std::string(100000, ']') + "}");
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(deep.status().message().find("nested deeper"), std::string::npos) << deep.status();
}

TEST(ModelConfig, RopeParametersOfTransformers5) {
  const std::string base = R"("model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
      "num_key_value_heads":2,"intermediate_size":8,"vocab_size":10,)";
  auto c = ModelConfig::FromJson("{" + base + R"("rope_parameters":{"rope_type":"default","rope_theta":5000.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 5000.0);
  auto bad = ModelConfig::FromJson("{" + base + R"("rope_scaling":{"rope_type":"longrope","factor":4.0}})");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("longrope"), std::string::npos);
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
  refused(R"({"model_type":"llama",)" + Sizes() + R"(,"rope_scaling":{"rope_type":"longrope","factor":4.0}})",
          "rope_scaling.rope_type");
  refused(R"({"model_type":"llama",)" + Sizes() + R"(,"rope_scaling":{"rope_type":"llama3","factor":8.0}})",
          "low_freq_factor");
  refused(R"({"model_type":"qwen2",)" + Sizes() + R"(,"attention_dropout":0.1})", "attention_dropout");
  refused(R"({"model_type":"qwen2_moe",)" + Sizes() + "}", "model_type");
  refused(R"({"model_type":"mistral",)" + Sizes() + R"(,"sliding_window":-3})", "sliding_window");
}

// Sliding windows: model_window_test.cc.

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

namespace slidedp {
namespace {

// A Qwen3 config.json with the given rope_parameters (theta 1e6, head_dim 128 unless overridden).
absl::StatusOr<ModelConfig> Qwen3With(const std::string& rope, const std::string& extra = "") {
  return ModelConfig::FromJson(R"({"model_type":"qwen3","hidden_size":256,"num_hidden_layers":2,"num_attention_heads":2,
      "num_key_value_heads":1,"head_dim":128,"intermediate_size":96,"vocab_size":100,"max_position_embeddings":40960,
      "rope_parameters":)" + rope + extra + "}");
}

std::vector<float> DefaultFrequencies(const ModelConfig& c) {
  ModelConfig plain = c;
  plain.rope_scaling = RopeScaling{};
  return plain.RopeInverseFrequencies();
}

// Qwen3's documented long-context setting. HF _compute_yarn_parameters with beta_fast 32,
// beta_slow 1: the correction range is [floor(23.6), ceil(39.7)] = [23, 40] for head_dim 128,
// theta 1e6 and 32768 original positions; below it the default frequencies, above it those
// divided by the factor, a linear ramp between; cos and sin are scaled by 0.1 ln(4) + 1.
TEST(RopeScalingYarn, QwenDocumentedSetting) {
  const auto c = Qwen3With(R"({"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768,
                               "rope_theta":1000000.0})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 32768);
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_DOUBLE_EQ(c->RopeAttentionScaling(), 0.1 * std::log(4.0) + 1.0);
  const std::vector<float> yarn = c->RopeInverseFrequencies(), base = DefaultFrequencies(*c);
  ASSERT_EQ(yarn.size(), 64u);
  const double dim = 128, theta = 1e6, original = 32768;
  const double low = std::floor(dim * std::log(original / (32 * 2 * M_PI)) / (2 * std::log(theta)));
  const double high = std::ceil(dim * std::log(original / (1 * 2 * M_PI)) / (2 * std::log(theta)));
  ASSERT_EQ(low, 23);
  ASSERT_EQ(high, 40);
  for (int i = 0; i < 64; ++i) {
    if (i <= low) {
      EXPECT_EQ(yarn[i], base[i]) << i;  // extrapolated: HF's default frequencies, bit for bit
    } else if (i >= high) {
      EXPECT_EQ(yarn[i], base[i] / 4.0f) << i;  // interpolated: divided by the factor (a power of 2: exact)
    } else {
      const double ramp = (i - low) / (high - low);
      const double want = base[i] / 4.0 * ramp + base[i] * (1 - ramp);
      EXPECT_NEAR(yarn[i], want, 1e-6 * want) << i;
      EXPECT_LT(yarn[i], base[i]) << i;
      EXPECT_GT(yarn[i], base[i] / 4.0f) << i;
    }
  }
  // Plain RoPE and llama3 keep an attention scaling of exactly 1.
  EXPECT_EQ(ModelConfig::Preset("tiny")->RopeAttentionScaling(), 1.0);
  EXPECT_EQ(ModelConfig::Preset("llama3.1-8b")->RopeAttentionScaling(), 1.0);
}

// A small case worked by hand: head_dim 8, theta 1e4, 64 original positions: correction range
// [max(floor(-0.50), 0), ceil(1.008)] = [0, 2], so the ramp over the 4 frequencies is 0, 1/2, 1, 1.
TEST(RopeScalingYarn, RampWorkedByHand) {
  ModelConfig c = *ModelConfig::Preset("tiny");
  c.head_dim = 8;
  c.rope_theta = 10000;
  c.rope_scaling.type = RopeScaling::Type::kYarn;
  c.rope_scaling.factor = 4;
  c.rope_scaling.original_max_position_embeddings = 64;
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  const std::vector<float> yarn = c.RopeInverseFrequencies(), base = DefaultFrequencies(c);
  EXPECT_EQ(yarn[0], base[0]);
  const float interpolated = 1.0f / (4.0f * (1.0f / base[1]));
  EXPECT_NEAR(yarn[1], 0.5 * base[1] + 0.5 * interpolated, 1e-7);
  EXPECT_EQ(yarn[2], base[2] / 4.0f);
  EXPECT_EQ(yarn[3], base[3] / 4.0f);
  // Without truncation the range is [0, 1.008]: index 1 is just short of the top of the ramp.
  c.rope_scaling.truncate = false;
  const std::vector<float> untruncated = c.RopeInverseFrequencies();
  EXPECT_EQ(untruncated[0], base[0]);
  EXPECT_GT(untruncated[1], base[1] / 4.0f);
  EXPECT_LT(untruncated[1], yarn[1]);
  EXPECT_EQ(untruncated[2], base[2] / 4.0f);
}

TEST(RopeScalingYarn, AttentionFactorSources) {
  const std::string yarn = R"({"rope_type":"yarn","factor":40.0,"original_max_position_embeddings":4096)";
  const auto deepseek = Qwen3With(yarn + R"(,"mscale":0.707,"mscale_all_dim":0.707,"beta_fast":32,"beta_slow":1})");
  ASSERT_TRUE(deepseek.ok()) << deepseek.status();
  EXPECT_DOUBLE_EQ(deepseek->RopeAttentionScaling(), 1.0);  // equal mscales: the ratio is 1
  const auto ratio = Qwen3With(yarn + R"(,"mscale":1.0,"mscale_all_dim":0.5})");
  ASSERT_TRUE(ratio.ok()) << ratio.status();
  EXPECT_DOUBLE_EQ(ratio->RopeAttentionScaling(), (0.1 * std::log(40.0) + 1) / (0.1 * 0.5 * std::log(40.0) + 1));
  const auto given = Qwen3With(yarn + R"(,"attention_factor":1.25,"mscale":1.0,"mscale_all_dim":0.5})");
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->RopeAttentionScaling(), 1.25);
  // beta 0 or null is HF's default (`beta_fast or 32`).
  const auto zero_beta = Qwen3With(yarn + R"(,"beta_fast":0,"beta_slow":null})");
  ASSERT_TRUE(zero_beta.ok()) << zero_beta.status();
  EXPECT_EQ(zero_beta->rope_scaling.beta_fast, 32);
  EXPECT_EQ(zero_beta->rope_scaling.beta_slow, 1);
}

// HF's standardize_rope_params: a missing original_max_position_embeddings is max_position_embeddings;
// a null yarn factor is max_position_embeddings / original_max_position_embeddings.
TEST(RopeScalingYarn, Defaults) {
  const auto no_original = Qwen3With(R"({"rope_type":"yarn","factor":4.0})");
  ASSERT_TRUE(no_original.ok()) << no_original.status();
  EXPECT_EQ(no_original->rope_scaling.original_max_position_embeddings, 40960);
  const auto null_factor = Qwen3With(R"({"rope_type":"yarn","factor":null,"original_max_position_embeddings":10240})");
  ASSERT_TRUE(null_factor.ok()) << null_factor.status();
  EXPECT_EQ(null_factor->rope_scaling.factor, 4.0);
  // The older key with "type", and theta at the top level.
  const auto old = ModelConfig::FromJson(R"({"model_type":"qwen3","hidden_size":64,"num_hidden_layers":1,
      "num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":8,"vocab_size":10,"rope_theta":5e5,
      "rope_scaling":{"type":"yarn","factor":2.0,"original_max_position_embeddings":512}})");
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(old->rope_theta, 5e5);
}

TEST(RopeScaling, LinearAndDynamic) {
  const auto linear = Qwen3With(R"({"rope_type":"linear","factor":2.5})");
  ASSERT_TRUE(linear.ok()) << linear.status();
  const std::vector<float> base = DefaultFrequencies(*linear), lin = linear->RopeInverseFrequencies();
  for (size_t i = 0; i < base.size(); ++i) EXPECT_EQ(lin[i], base[i] / 2.5f) << i;
  EXPECT_EQ(linear->RopeAttentionScaling(), 1.0);
  // Dynamic NTK below max_position_embeddings: the init-time frequencies, theta's own.
  const auto dynamic = Qwen3With(R"({"rope_type":"dynamic","factor":3.0})");
  ASSERT_TRUE(dynamic.ok()) << dynamic.status();
  EXPECT_EQ(dynamic->RopeInverseFrequencies(), base);
  EXPECT_EQ(dynamic->RopeAttentionScaling(), 1.0);
}

TEST(RopeScaling, RefusalsNameTheKey) {
  auto refused = [](const absl::StatusOr<ModelConfig>& c, const std::string& key) {
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << key;
    EXPECT_NE(c.status().message().find(key), std::string::npos) << c.status();
  };
  refused(Qwen3With(R"({"rope_type":"yarn","original_max_position_embeddings":32768})"), "rope_parameters.factor");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":0.5,"original_max_position_embeddings":32768})"),
          "rope_parameters.factor");
  refused(Qwen3With(R"({"rope_type":"linear"})"), "rope_parameters.factor");
  // An explicit 0 is refused as a negative factor is, never read as absent (only a null yarn
  // factor is computed from the context lengths).
  refused(Qwen3With(R"({"rope_type":"yarn","factor":0,"original_max_position_embeddings":10240})"),
          "rope_parameters.factor");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":0.0})"), "rope_parameters.factor");
  refused(Qwen3With(R"({"rope_type":"linear","factor":0})"), "rope_parameters.factor");
  refused(Qwen3With(R"({"rope_type":"dynamic","factor":"2"})"), "rope_parameters.factor");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":4,"original_max_position_embeddings":0})"),
          "rope_parameters.original_max_position_embeddings");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":4,"original_max_position_embeddings":100.5})"),
          "rope_parameters.original_max_position_embeddings");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":4,"beta_fast":1,"beta_slow":32})"), "rope_parameters.beta_slow");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":4,"beta_fast":-2})"), "rope_parameters.beta_fast");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":4,"attention_factor":-1.0})"), "rope_parameters.attention_factor");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":4,"truncate":"no"})"), "rope_parameters.truncate");
  refused(Qwen3With(R"({"rope_type":"longrope","factor":4})"), "rope_parameters.rope_type");
  refused(Qwen3With(R"({"rope_type":"yarn","factor":4,"original_max_position_embeddings":32768})",
                    R"(,"original_max_position_embeddings":8192)"),
          "original_max_position_embeddings");
  refused(Qwen3With(R"({"rope_type":"default","partial_rotary_factor":0.5})"), "rope_parameters.partial_rotary_factor");
  refused(Qwen3With(R"({"full_attention":{"rope_type":"yarn","factor":4}})"), "rope_parameters.full_attention");
  refused(Qwen3With(R"({"rope_type":"default"})", R"(,"max_position_embeddings":0)"), "max_position_embeddings");
  // A config built in code is checked by Validate the same way.
  ModelConfig c = *ModelConfig::Preset("tiny");
  c.rope_scaling.type = RopeScaling::Type::kYarn;
  c.rope_scaling.factor = 0.5;
  EXPECT_NE(c.Validate().message().find("rope_scaling.factor"), std::string::npos) << c.Validate();
}

TEST(RopeScaling, RoundTrips) {
  // Presets write every parameter; FromJson reads the same scaling back.
  for (RopeScaling::Type type : {RopeScaling::Type::kLinear, RopeScaling::Type::kDynamic, RopeScaling::Type::kYarn}) {
    ModelConfig c = *ModelConfig::Preset("qwen3-0.6b");
    c.rope_scaling.type = type;
    c.rope_scaling.factor = 4;
    c.rope_scaling.original_max_position_embeddings = 32768;
    c.rope_scaling.beta_fast = 16;
    c.rope_scaling.truncate = false;
    c.rope_scaling.mscale = 0.8;
    c.rope_scaling.mscale_all_dim = 0.6;
    if (type != RopeScaling::Type::kYarn) {
      const RopeScaling keep{type, 4};
      c.rope_scaling = keep;
    }
    const auto back = ModelConfig::FromJson(c.ToJson());
    ASSERT_TRUE(back.ok()) << back.status() << c.ToJson();
    EXPECT_TRUE(back->rope_scaling == c.rope_scaling) << back->ToJson();
    EXPECT_EQ(back->RopeInverseFrequencies(), c.RopeInverseFrequencies());
    EXPECT_EQ(back->RopeAttentionScaling(), c.RopeAttentionScaling());
  }
  // A source keeps its own objects (no beta / truncate keys added) ...
  const auto src = Qwen3With(R"({"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768,
                                 "rope_theta":1000000.0})");
  ASSERT_TRUE(src.ok());
  const std::string saved = src->ToJson();
  EXPECT_EQ(saved.find("beta_fast"), std::string::npos) << saved;
  const auto again = ModelConfig::FromJson(saved);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->rope_scaling == src->rope_scaling);
  // ... unless its RoPE was changed after parsing (a longer context): then the new one is written.
  ModelConfig longer = *Qwen3With(R"({"rope_type":"default","rope_theta":1000000.0})");
  longer.rope_scaling = src->rope_scaling;
  longer.max_position_embeddings = 131072;
  const auto reloaded = ModelConfig::FromJson(longer.ToJson());
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_TRUE(reloaded->rope_scaling == longer.rope_scaling) << longer.ToJson();
  EXPECT_EQ(reloaded->max_position_embeddings, 131072);
  EXPECT_EQ(reloaded->rope_theta, 1e6);
}

}  // namespace
}  // namespace slidedp

namespace slidedp {
namespace {

// A qwen3_moe config.json: the given MoE keys after the shape (4 layers, hidden 64, 4 heads).
absl::StatusOr<ModelConfig> MoeWith(const std::string& extra) {
  return ModelConfig::FromJson(R"({"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":4,
      "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"intermediate_size":96,"vocab_size":100)" +
                               extra + "}");
}

void ExpectRefused(const absl::StatusOr<ModelConfig>& c, const std::string& field) {
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
}

// Qwen3MoeConfig's defaults (transformers 5.17) when a qwen3_moe config.json leaves a field out.
TEST(Qwen3Moe, DefaultsAreQwen3MoeConfigs) {
  const auto c = ModelConfig::FromJson(R"({"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":4,
      "num_attention_heads":4,"vocab_size":100})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kQwen3Moe);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_EQ(c->decoder_sparse_step, 1);
  EXPECT_TRUE(c->mlp_only_layers.empty());
  EXPECT_EQ(c->router_aux_loss_coef, 0.001);
  EXPECT_FALSE(c->output_router_logits);
  EXPECT_EQ(c->intermediate_size, 6144);  // only the dense layers read it; HF's default
  EXPECT_TRUE(c->has_qk_norm());
  EXPECT_FALSE(c->has_qkv_bias());
  EXPECT_EQ(c->NumSparseLayers(), 4);
  // The dense families keep num_experts 0 and no sparse layer.
  const ModelConfig dense = *ModelConfig::Preset("tiny");
  EXPECT_EQ(dense.num_experts, 0);
  EXPECT_FALSE(dense.IsSparseLayer(0));
  EXPECT_TRUE(dense.trainable());
}

TEST(Qwen3Moe, ParsesEveryField) {
  const auto c = MoeWith(R"(,"num_experts":6,"num_experts_per_tok":3,"moe_intermediate_size":24,"norm_topk_prob":true,
      "decoder_sparse_step":2,"mlp_only_layers":[3],"router_aux_loss_coef":0.01,"output_router_logits":true)");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 6);
  EXPECT_EQ(c->num_experts_per_tok, 3);
  EXPECT_EQ(c->moe_intermediate_size, 24);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->decoder_sparse_step, 2);
  EXPECT_EQ(c->mlp_only_layers, (std::vector<int64_t>{3}));
  EXPECT_EQ(c->router_aux_loss_coef, 0.01);
  EXPECT_TRUE(c->output_router_logits);
  EXPECT_EQ(c->intermediate_size, 96);
  // Nulls are HF's defaults.
  const auto nulls = MoeWith(R"(,"mlp_only_layers":null,"num_experts":null,"norm_topk_prob":null)");
  ASSERT_TRUE(nulls.ok()) << nulls.status();
  EXPECT_TRUE(nulls->mlp_only_layers.empty());
  EXPECT_EQ(nulls->num_experts, 128);
  // transformers 5.x saves num_experts as num_local_experts (Qwen3MoeConfig.attribute_map).
  const auto local = MoeWith(R"(,"num_local_experts":16,"num_experts_per_tok":2)");
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->num_experts, 16);
  const auto both = MoeWith(R"(,"num_local_experts":16,"num_experts":16,"num_experts_per_tok":2)");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(both->num_experts, 16);
  // Trainable (the CPU backend runs it; hostd's job plan refuses it on CUDA workers for now).
  EXPECT_TRUE(c->CheckTrainable().ok());
}

TEST(Qwen3Moe, RefusalsNameTheField) {
  // Types.
  ExpectRefused(MoeWith(R"(,"num_experts":"8")"), "num_experts");
  ExpectRefused(MoeWith(R"(,"num_experts":8.5)"), "num_experts");
  ExpectRefused(MoeWith(R"(,"num_experts_per_tok":true)"), "num_experts_per_tok");
  ExpectRefused(MoeWith(R"(,"moe_intermediate_size":"768")"), "moe_intermediate_size");
  ExpectRefused(MoeWith(R"(,"norm_topk_prob":1)"), "norm_topk_prob");
  ExpectRefused(MoeWith(R"(,"output_router_logits":"yes")"), "output_router_logits");
  ExpectRefused(MoeWith(R"(,"decoder_sparse_step":1.0)"), "decoder_sparse_step");
  ExpectRefused(MoeWith(R"(,"mlp_only_layers":2)"), "mlp_only_layers");
  ExpectRefused(MoeWith(R"(,"mlp_only_layers":[1.5])"), "mlp_only_layers");
  ExpectRefused(MoeWith(R"(,"router_aux_loss_coef":"0.001")"), "router_aux_loss_coef");
  // Ranges.
  ExpectRefused(MoeWith(R"(,"num_experts":0,"num_experts_per_tok":0)"), "num_experts");
  ExpectRefused(MoeWith(R"(,"num_experts":8,"num_experts_per_tok":0)"), "num_experts_per_tok");
  ExpectRefused(MoeWith(R"(,"num_experts":8,"num_experts_per_tok":9)"), "num_experts_per_tok");
  ExpectRefused(MoeWith(R"(,"moe_intermediate_size":0)"), "moe_intermediate_size");
  ExpectRefused(MoeWith(R"(,"decoder_sparse_step":0)"), "decoder_sparse_step");
  ExpectRefused(MoeWith(R"(,"mlp_only_layers":[4])"), "mlp_only_layers");
  ExpectRefused(MoeWith(R"(,"mlp_only_layers":[-1])"), "mlp_only_layers");
  ExpectRefused(MoeWith(R"(,"mlp_only_layers":[1,1])"), "mlp_only_layers");
  ExpectRefused(MoeWith(R"(,"router_aux_loss_coef":-0.1)"), "router_aux_loss_coef");
  ExpectRefused(MoeWith(R"(,"num_local_experts":16,"num_experts":8)"), "num_local_experts");
  ExpectRefused(MoeWith(R"(,"intermediate_size":0)"), "intermediate_size");
  // What is not built: shared experts and other MoE designs, by key and by model_type.
  ExpectRefused(MoeWith(R"(,"shared_expert_intermediate_size":5632)"), "shared_expert_intermediate_size");
  ExpectRefused(MoeWith(R"(,"n_shared_experts":1)"), "n_shared_experts");
  ExpectRefused(MoeWith(R"(,"first_k_dense_replace":1)"), "first_k_dense_replace");
  ExpectRefused(MoeWith(R"(,"scoring_func":"sigmoid")"), "scoring_func");
  ExpectRefused(MoeWith(R"(,"n_routed_experts":64)"), "n_routed_experts");
  EXPECT_TRUE(MoeWith(R"(,"shared_expert_intermediate_size":0,"scoring_func":"softmax")").ok());
  ExpectRefused(MoeWith(R"(,"attention_bias":true)"), "attention_bias");
  ExpectRefused(MoeWith(R"(,"use_sliding_window":true,"sliding_window":0)"), "sliding_window");
  ExpectRefused(MoeWith(R"(,"layer_types":["full_attention","sliding_attention","full_attention","full_attention"])"),
                "layer_types");
  const std::string shape = R"("hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"intermediate_size":96,
      "vocab_size":100)";
  const auto qwen2_moe =
      ModelConfig::FromJson(R"({"model_type":"qwen2_moe","shared_expert_intermediate_size":5632,)" + shape + "}");
  ExpectRefused(qwen2_moe, "model_type");
  ExpectRefused(qwen2_moe, "shared_expert_intermediate_size");
  ExpectRefused(ModelConfig::FromJson(R"({"model_type":"mixtral","num_local_experts":8,)" + shape + "}"), "model_type");
  ExpectRefused(ModelConfig::FromJson(R"({"model_type":"deepseek_v3",)" + shape + "}"), "model_type");
  // The dense families keep refusing experts.
  ExpectRefused(ModelConfig::FromJson(R"({"model_type":"qwen3","num_experts":8,)" + shape + "}"), "num_experts");
  ExpectRefused(ModelConfig::FromJson(R"({"model_type":"mistral","num_local_experts":8,)" + shape + "}"),
                "num_local_experts");
  ModelConfig dense = *ModelConfig::Preset("tiny");
  dense.num_experts = 8;
  EXPECT_NE(dense.Validate().message().find("num_experts"), std::string::npos) << dense.Validate();
}

// HF's Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0.
TEST(Qwen3Moe, SparseLayerRule) {
  const auto step2 = MoeWith(R"(,"num_experts":4,"num_experts_per_tok":2,"decoder_sparse_step":2)");
  ASSERT_TRUE(step2.ok()) << step2.status();
  EXPECT_FALSE(step2->IsSparseLayer(0));
  EXPECT_TRUE(step2->IsSparseLayer(1));
  EXPECT_FALSE(step2->IsSparseLayer(2));
  EXPECT_TRUE(step2->IsSparseLayer(3));
  EXPECT_EQ(step2->NumSparseLayers(), 2);
  const auto listed =
      MoeWith(R"(,"num_experts":4,"num_experts_per_tok":2,"decoder_sparse_step":2,"mlp_only_layers":[3,0])");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->IsSparseLayer(1));
  EXPECT_FALSE(listed->IsSparseLayer(3));
  EXPECT_EQ(listed->NumSparseLayers(), 1);
  const auto every = MoeWith(R"(,"num_experts":4,"num_experts_per_tok":2,"mlp_only_layers":[2])");
  ASSERT_TRUE(every.ok()) << every.status();
  for (int l = 0; l < 4; ++l) EXPECT_EQ(every->IsSparseLayer(l), l != 2) << l;
  // The layout follows the rule: sparse units hold the router and experts, the others the MLP.
  const ModelLayout layout = ModelLayout::Build(*listed);
  for (int l = 0; l < 4; ++l) {
    const UnitLayout& u = layout.units[1 + l];
    EXPECT_EQ(u.sparse(), listed->IsSparseLayer(l)) << l;
    EXPECT_EQ(u.Find(kRouter) != nullptr, u.sparse()) << l;
    EXPECT_EQ(u.Find(kGateProj) == nullptr, u.sparse()) << l;
    if (!u.sparse()) {
      EXPECT_EQ(u.Find(kDownProj)->shape, (std::vector<int64_t>{64, 96})) << l;
    }
  }
}

TEST(Qwen3Moe, SparseUnitLayout) {
  const ModelConfig c = *ModelConfig::Preset("tiny-moe");
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  const ModelLayout m = ModelLayout::Build(c);
  ASSERT_EQ(m.num_units(), 5);
  const UnitLayout& u = m.units[1];
  ASSERT_TRUE(u.sparse());
  EXPECT_EQ(u.num_experts(), 8);
  const int64_t h = 64, mi = 32, e_count = 8;
  // Attention as Qwen3, then the router, then each expert's three matrices, in index order.
  std::vector<std::string> names;
  for (const TensorSlot& t : u.tensors) names.push_back(t.hf_name.substr(std::string("model.layers.0.").size()));
  std::vector<std::string> want = {
      "input_layernorm.weight",  "self_attn.q_proj.weight",         "self_attn.k_proj.weight",
      "self_attn.v_proj.weight", "self_attn.o_proj.weight",         "self_attn.q_norm.weight",
      "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate.weight"};
  for (int e = 0; e < e_count; ++e) {
    for (const char* p : {"gate_proj", "up_proj", "down_proj"}) {
      want.push_back("mlp.experts." + std::to_string(e) + "." + p + ".weight");
    }
  }
  EXPECT_EQ(names, want);
  const TensorSlot* router = u.Find(kRouter);
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->hf_name, "model.layers.0.mlp.gate.weight");
  EXPECT_EQ(router->shape, (std::vector<int64_t>{e_count, h}));
  EXPECT_EQ(router->fp32_offset, -1);  // a matrix, not a norm
  EXPECT_LT(router->offset_numel, u.ExpertOffset(0));
  // Blocks: one stride, back to back, each holding exactly its expert's matrices; the last one
  // ends the unit.
  EXPECT_EQ(u.ExpertNumel(), 3 * mi * h);  // 32 x 64 = 2048 elements: no padding at this size
  EXPECT_EQ(u.ExpertOffset(0), router->offset_numel + router->numel);
  EXPECT_EQ(u.ExpertOffset(e_count), u.numel);
  for (int64_t e = 0; e < e_count; ++e) {
    const TensorSlot* gate = u.FindExpert(e, kExpertGateProj);
    const TensorSlot* up = u.FindExpert(e, kExpertUpProj);
    const TensorSlot* down = u.FindExpert(e, kExpertDownProj);
    ASSERT_NE(down, nullptr);
    EXPECT_EQ(gate->hf_name, "model.layers.0.mlp.experts." + std::to_string(e) + ".gate_proj.weight");
    EXPECT_EQ(gate->shape, (std::vector<int64_t>{mi, h}));
    EXPECT_EQ(up->shape, (std::vector<int64_t>{mi, h}));
    EXPECT_EQ(down->shape, (std::vector<int64_t>{h, mi}));
    EXPECT_EQ(gate->offset_numel, u.ExpertOffset(e));
    EXPECT_EQ(up->offset_numel, gate->offset_numel + gate->numel);
    EXPECT_EQ(down->offset_numel, up->offset_numel + up->numel);
    EXPECT_EQ(down->offset_numel + down->numel, u.ExpertOffset(e + 1));
    for (int t = 0; t < kNumExpertTensors; ++t) {
      EXPECT_EQ(u.FindExpert(e, static_cast<ExpertTensor>(t))->offset_numel,
                u.ExpertOffset(e) + u.experts.offset_in_expert[t]);
    }
    int unit = -1;
    EXPECT_EQ(m.Find(down->hf_name, &unit), down);
    EXPECT_EQ(unit, 1);
  }
  EXPECT_EQ(u.FindExpert(e_count, kExpertGateProj), nullptr);
  EXPECT_EQ(u.FindExpert(-1, kExpertGateProj), nullptr);
  // Layer 1 is in mlp_only_layers: dense, Qwen3's MLP of intermediate_size.
  const UnitLayout& dense = m.units[2];
  EXPECT_FALSE(dense.sparse());
  EXPECT_EQ(dense.FindExpert(0, kExpertGateProj), nullptr);
  EXPECT_EQ(dense.Find(kGateProj)->hf_name, "model.layers.1.mlp.gate_proj.weight");
  EXPECT_EQ(dense.Find(kGateProj)->shape, (std::vector<int64_t>{128, h}));
  EXPECT_TRUE(m.units[3].sparse());
  EXPECT_NE(dense.numel, u.numel);
  // Untied: the head holds lm_head. Every tensor aligned; names resolve to their units.
  EXPECT_EQ(m.head().tensors.size(), 2u);
  for (const UnitLayout& unit : m.units) {
    EXPECT_EQ(unit.numel % kTensorAlignNumel, 0);
    for (const TensorSlot& t : unit.tensors) {
      EXPECT_EQ(t.offset_numel % kTensorAlignNumel, 0) << t.hf_name;
      int found = -1;
      EXPECT_EQ(m.Find(t.hf_name, &found), &t);
      EXPECT_EQ(found, unit.index);
    }
  }
  EXPECT_EQ(m.Find("model.layers.1.mlp.gate.weight", nullptr), nullptr);
  EXPECT_EQ(m.Find("model.layers.0.mlp.experts.8.up_proj.weight", nullptr), nullptr);
  EXPECT_EQ(m.Find("model.layers.7.mlp.gate.weight", nullptr), nullptr);
}

// Expert matrices whose size is not a multiple of the alignment: padding inside each block, one
// stride between blocks.
TEST(Qwen3Moe, ExpertBlocksKeepOneStrideWithPadding) {
  const auto c = MoeWith(R"(,"num_experts":5,"num_experts_per_tok":2,"moe_intermediate_size":7,"hidden_size":24,
      "head_dim":6)");
  ASSERT_TRUE(c.ok()) << c.status();
  const ModelLayout m = ModelLayout::Build(*c);
  const UnitLayout& u = m.units[1];
  ASSERT_TRUE(u.sparse());
  EXPECT_EQ(u.ExpertNumel(), 3 * kTensorAlignNumel);  // 7 x 24 = 168 elements, padded to 256
  EXPECT_EQ(u.experts.offset_in_expert[kExpertUpProj], kTensorAlignNumel);
  EXPECT_EQ(u.experts.offset_in_expert[kExpertDownProj], 2 * kTensorAlignNumel);
  for (int64_t e = 0; e < 5; ++e) {
    EXPECT_EQ(u.FindExpert(e, kExpertGateProj)->offset_numel, u.ExpertOffset(e));
    EXPECT_EQ(u.FindExpert(e, kExpertDownProj)->numel, 168);
  }
  EXPECT_EQ(u.ExpertOffset(5), u.numel);
  EXPECT_EQ(DescribeUnitElement(u, u.ExpertOffset(2) + 170),
            "the padding after model.layers.0.mlp.experts.2.gate_proj.weight");
  EXPECT_EQ(DescribeUnitElement(u, u.ExpertOffset(3) + 2 * kTensorAlignNumel + 25),
            "model.layers.0.mlp.experts.3.down_proj.weight[3, 4]");  // [hidden 24, moe_I 7]: 25 = 3 x 7 + 4
}

TEST(Qwen3Moe, JsonRoundTrip) {
  for (const char* preset : {"tiny-moe", "qwen3-30b-a3b"}) {
    const ModelConfig c = *ModelConfig::Preset(preset);
    const std::string saved = c.ToJson();
    EXPECT_NE(saved.find("\"model_type\": \"qwen3_moe\""), std::string::npos) << saved;
    EXPECT_NE(saved.find("\"Qwen3MoeForCausalLM\""), std::string::npos) << saved;
    const auto back = ModelConfig::FromJson(saved);
    ASSERT_TRUE(back.ok()) << back.status() << saved;
    EXPECT_EQ(back->family, ModelFamily::kQwen3Moe);
    EXPECT_EQ(back->num_experts, c.num_experts);
    EXPECT_EQ(back->num_experts_per_tok, c.num_experts_per_tok);
    EXPECT_EQ(back->moe_intermediate_size, c.moe_intermediate_size);
    EXPECT_EQ(back->norm_topk_prob, c.norm_topk_prob);
    EXPECT_EQ(back->decoder_sparse_step, c.decoder_sparse_step);
    EXPECT_EQ(back->mlp_only_layers, c.mlp_only_layers);
    EXPECT_EQ(back->router_aux_loss_coef, c.router_aux_loss_coef);
    EXPECT_EQ(back->output_router_logits, c.output_router_logits);
    EXPECT_EQ(back->intermediate_size, c.intermediate_size);
    EXPECT_EQ(back->tie_word_embeddings, c.tie_word_embeddings);
    EXPECT_EQ(back->max_position_embeddings, c.max_position_embeddings);
    EXPECT_EQ(ModelLayout::Build(*back).param_count(), ModelLayout::Build(c).param_count());
  }
  // A source config keeps its own keys, the MoE fields written over it (num_local_experts in step).
  auto src = MoeWith(R"(,"num_local_experts":6,"num_experts_per_tok":2,"max_window_layers":4,"eos_token_id":7)");
  ASSERT_TRUE(src.ok()) << src.status();
  src->num_experts_per_tok = 3;
  src->mlp_only_layers = {0, 2};
  const std::string saved = src->ToJson();
  EXPECT_NE(saved.find("\"max_window_layers\": 4"), std::string::npos) << saved;
  EXPECT_NE(saved.find("\"num_local_experts\": 6"), std::string::npos) << saved;
  EXPECT_NE(saved.find("\"num_experts\": 6"), std::string::npos) << saved;
  const auto again = ModelConfig::FromJson(saved);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->num_experts_per_tok, 3);
  EXPECT_EQ(again->mlp_only_layers, (std::vector<int64_t>{0, 2}));
  // The dense families write no MoE key.
  EXPECT_EQ(ModelConfig::Preset("tiny")->ToJson().find("num_experts"), std::string::npos);
}

// Qwen/Qwen3-30B-A3B: HF's num_parameters() is 30,532,122,624 (transformers 5.17, docs/moe.md).
// Per layer: attention 18,878,720 (q, k, v, o, q/k norms, two RMSNorms), router 128 x 2048,
// experts 128 x 3 x 768 x 2048; embedding and LM head 151,936 x 2048 each.
TEST(Qwen3Moe, Qwen3A3BParameterCounts) {
  const ModelConfig c = *ModelConfig::Preset("qwen3-30b-a3b");
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  EXPECT_TRUE(c.trainable());
  const ModelLayout m = ModelLayout::Build(c);
  EXPECT_EQ(m.num_units(), 50);
  EXPECT_EQ(c.NumSparseLayers(), 48);
  const int64_t attention = 2 * 4096 * 2048 + 2 * 512 * 2048 + 2 * 128 + 2 * 2048;
  const int64_t router = 128 * 2048, expert = 3 * 768 * 2048;
  const int64_t embed = int64_t{151936} * 2048;
  EXPECT_EQ(attention, 18878720);
  EXPECT_EQ(m.param_count(), 48 * (attention + router + 128 * expert) + 2 * embed + 2048);
  EXPECT_EQ(m.param_count(), 30532122624);
  // Active: the 8 routed experts of 128 per layer; Qwen publishes "3.3B activated".
  EXPECT_EQ(m.ActiveParamCount(), 48 * (attention + router + 8 * expert) + 2 * embed + 2048);
  EXPECT_EQ(m.ActiveParamCount(), 3353032704);
  const UnitLayout& u = m.units[1];
  EXPECT_EQ(u.ExpertNumel(), expert);  // 768 x 2048 is a multiple of the alignment
  EXPECT_EQ(u.ExpertOffset(128), u.numel);
  // FLOPs per token count the active matmul parameters (LM head in, embedding lookup out).
  EXPECT_DOUBLE_EQ(m.ModelFlopsPerToken(4096),
                   6.0 * static_cast<double>(m.ActiveParamCount() - embed) + 6.0 * 48 * 4096 * 4096);
  // Dense models: active == total.
  const ModelLayout dense = ModelLayout::Build(*ModelConfig::Preset("qwen3-8b"));
  EXPECT_EQ(dense.ActiveParamCount(), dense.param_count());
  // tiny-moe: two sparse layers, 6 of 8 experts idle per token in each.
  const ModelLayout tiny = ModelLayout::Build(*ModelConfig::Preset("tiny-moe"));
  EXPECT_EQ(tiny.param_count() - tiny.ActiveParamCount(), 2 * 6 * 3 * 32 * 64);
}

}  // namespace
}  // namespace slidedp

// Qwen3.5 (issue 50): the text config as transformers 5.17 saves Qwen3_5ForCausalLM's, the
// multimodal wrapper, the MoE with its shared expert, and every field this build does not
// implement refused by name.
namespace slidedp {
namespace {

// A qwen3_5_text config at toy size, its fields as HF's Qwen3_5TextConfig names them.
std::string Qwen3_5Text(const std::string& extra = "", const std::string& type = "qwen3_5_text") {
  return R"({"model_type":")" + type + R"(","architectures":["Qwen3_5ForCausalLM"],"vocab_size":512,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":32,"hidden_act":"silu","max_position_embeddings":4096,
    "rms_norm_eps":1e-6,"tie_word_embeddings":true,"attention_bias":false,"attention_dropout":0.0,
    "linear_conv_kernel_dim":4,"linear_key_head_dim":16,"linear_value_head_dim":16,
    "linear_num_key_heads":2,"linear_num_value_heads":4,"use_cache":true,"dtype":"bfloat16",
    "layer_types":["linear_attention","linear_attention","linear_attention","full_attention"],
    "rope_parameters":{"rope_type":"default","rope_theta":10000000,"partial_rotary_factor":0.25,
                       "mrope_section":[11,11,10],"mrope_interleaved":true})" +
         extra + "}";
}

TEST(Qwen3_5Config, TextConfigParses) {
  const auto c = ModelConfig::FromJson(Qwen3_5Text());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kQwen3_5);
  EXPECT_FALSE(c->multimodal);
  EXPECT_TRUE(c->has_attention_output_gate());
  EXPECT_TRUE(c->norms_add_one());
  EXPECT_EQ(c->rotary_dim(), 8);
  EXPECT_EQ(c->RopeInverseFrequencies().size(), 4u);
  EXPECT_EQ(c->NumLinearAttentionLayers(), 3);
  EXPECT_TRUE(c->IsLinearAttentionLayer(0));
  EXPECT_FALSE(c->IsLinearAttentionLayer(3));
  EXPECT_EQ(c->linear.conv_dim(), 2 * 32 + 64);
  // The layout: the Gated DeltaNet's tensors in layers 0-2, the gated q_proj in layer 3.
  const ModelLayout m = ModelLayout::Build(*c);
  int unit = -1;
  const TensorSlot* qkv = m.Find("model.layers.0.linear_attn.in_proj_qkv.weight", &unit);
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->shape, (std::vector<int64_t>{128, 64}));
  ASSERT_NE(m.Find("model.layers.2.linear_attn.conv1d.weight", &unit), nullptr);
  EXPECT_EQ(m.Find("model.layers.2.linear_attn.conv1d.weight", &unit)->shape, (std::vector<int64_t>{128, 1, 4}));
  EXPECT_GE(m.Find("model.layers.1.linear_attn.A_log", &unit)->fp32_offset, 0);
  EXPECT_GE(m.Find("model.layers.1.linear_attn.dt_bias", &unit)->fp32_offset, 0);
  EXPECT_EQ(m.Find("model.layers.3.self_attn.q_proj.weight", &unit)->shape, (std::vector<int64_t>{2 * 4 * 32, 64}));
  EXPECT_EQ(m.Find("model.layers.0.self_attn.q_proj.weight", &unit), nullptr);
  // Round trip through the config HF reads back.
  const auto back = ModelConfig::FromJson(c->ToJson());
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << c->ToJson();
  EXPECT_EQ(back->layer_mixers, c->layer_mixers);
  EXPECT_EQ(back->linear, c->linear);
  EXPECT_EQ(back->partial_rotary_factor, 0.25);
  const nlohmann::json saved = nlohmann::json::parse(c->ToJson());
  EXPECT_EQ(saved["model_type"], "qwen3_5_text");
  EXPECT_EQ(saved["rope_parameters"]["mrope_section"], nlohmann::json({11, 11, 10}));
}

TEST(Qwen3_5Config, LayerTypesDefaultToTheFullAttentionInterval) {
  nlohmann::json j = nlohmann::json::parse(Qwen3_5Text());
  j.erase("layer_types");
  j["num_hidden_layers"] = 8;
  j["full_attention_interval"] = 4;
  const auto c = ModelConfig::FromJson(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  for (int l = 0; l < 8; ++l) EXPECT_EQ(c->IsLinearAttentionLayer(l), (l + 1) % 4 != 0) << l;
}

TEST(Qwen3_5Config, MultimodalWrapperKeepsTheLanguageModelUnderItsPrefix) {
  nlohmann::json text = nlohmann::json::parse(Qwen3_5Text());
  text.erase("architectures");
  const nlohmann::json j = {{"model_type", "qwen3_5"},
                            {"architectures", {"Qwen3_5ForConditionalGeneration"}},
                            {"text_config", text},
                            {"vision_config", {{"depth", 2}, {"hidden_size", 32}, {"out_hidden_size", 64}}},
                            {"image_token_id", 248056},
                            {"tie_word_embeddings", false}};
  const auto c = ModelConfig::FromJson(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->multimodal);
  EXPECT_FALSE(c->tie_word_embeddings);  // the wrapper's, over text_config's
  const ModelLayout m = ModelLayout::Build(*c);
  EXPECT_EQ(m.embedding().tensors[0].hf_name, "model.language_model.embed_tokens.weight");
  EXPECT_EQ(m.head().tensors[0].hf_name, "model.language_model.norm.weight");
  EXPECT_EQ(m.head().tensors[1].hf_name, "lm_head.weight");
  int unit = -1;
  ASSERT_NE(m.Find("model.language_model.layers.3.self_attn.o_proj.weight", &unit), nullptr);
  EXPECT_EQ(unit, 4);
  // Saved back: the wrapper, its vision config untouched, the language model in text_config.
  const nlohmann::json saved = nlohmann::json::parse(c->ToJson());
  EXPECT_EQ(saved["model_type"], "qwen3_5");
  EXPECT_EQ(saved["vision_config"], j["vision_config"]);
  EXPECT_EQ(saved["text_config"]["model_type"], "qwen3_5_text");
  EXPECT_EQ(saved["text_config"]["layer_types"].size(), 4u);
  const auto back = ModelConfig::FromJson(saved.dump());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->multimodal);
  EXPECT_EQ(back->layer_mixers, c->layer_mixers);
}

TEST(Qwen3_5Config, FieldsThisBuildDoesNotImplementAreRefusedByName) {
  auto refused = [](const std::string& json, const std::string& field) {
    const auto c = ModelConfig::FromJson(json);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
  };
  refused(Qwen3_5Text(R"(,"some_new_switch":true)"), "some_new_switch");
  refused(Qwen3_5Text(R"(,"attn_output_gate":false)"), "attn_output_gate");
  refused(Qwen3_5Text(R"(,"hidden_act":"gelu")"), "hidden_act");
  refused(Qwen3_5Text(R"(,"attention_bias":true)"), "attention_bias");
  refused(Qwen3_5Text(R"(,"num_experts":8)"), "num_experts");
  refused(Qwen3_5Text(R"(,"linear_conv_kernel_dim":9)"), "linear_conv_kernel_dim");
  refused(Qwen3_5Text(R"(,"linear_num_value_heads":3)"), "linear_num_value_heads");
  refused(Qwen3_5Text(R"(,"sliding_window":128)"), "sliding_window");
  nlohmann::json j = nlohmann::json::parse(Qwen3_5Text());
  j["layer_types"][1] = "sliding_attention";
  refused(j.dump(), "layer_types");
  j = nlohmann::json::parse(Qwen3_5Text());
  j["layer_types"].erase(0);
  refused(j.dump(), "layer_types");
  j = nlohmann::json::parse(Qwen3_5Text());
  j["rope_parameters"]["partial_rotary_factor"] = 0.01;  // int(32 x 0.01) = 0 rotary dims
  refused(j.dump(), "partial_rotary_factor");
  // The wrapper: an unknown key of its own, a text_config of another type, none at all.
  nlohmann::json text = nlohmann::json::parse(Qwen3_5Text());
  refused(nlohmann::json({{"model_type", "qwen3_5"}, {"text_config", text}, {"audio_config", {}}}).dump(),
          "audio_config");
  text["model_type"] = "qwen3_5_moe_text";
  refused(nlohmann::json({{"model_type", "qwen3_5"}, {"text_config", text}}).dump(), "text_config.model_type");
  refused(R"({"model_type":"qwen3_5"})", "text_config");
  // The families before qwen3_5 still refuse partial rotation.
  refused(R"({"model_type":"qwen3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
             "intermediate_size":128,"vocab_size":512,"partial_rotary_factor":0.5})",
          "partial_rotary_factor");
}

TEST(Qwen3_5Config, MoeWithSharedExpertAndFusedExperts) {
  const std::string moe = R"(,"num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":32,
      "shared_expert_intermediate_size":48,"router_aux_loss_coef":0.001,"output_router_logits":false)";
  nlohmann::json j = nlohmann::json::parse(Qwen3_5Text(moe, "qwen3_5_moe_text"));
  j.erase("intermediate_size");  // Qwen3_5MoeTextConfig has none
  auto c = ModelConfig::FromJson(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->family, ModelFamily::kQwen3_5Moe);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_EQ(c->shared_expert_intermediate_size, 48);
  EXPECT_EQ(c->NumSparseLayers(), 4);
  const nlohmann::json saved = nlohmann::json::parse(c->ToJson());
  EXPECT_FALSE(saved.contains("intermediate_size"));
  EXPECT_FALSE(saved.contains("norm_topk_prob"));
  EXPECT_EQ(saved["shared_expert_intermediate_size"], 48);
  j["norm_topk_prob"] = false;
  EXPECT_EQ(ModelConfig::FromJson(j.dump()).status().code(), absl::StatusCode::kInvalidArgument);
  // Fused experts: the same unit offsets, each expert's matrices slices of gate_up_proj / down_proj.
  ModelConfig fused = *c;
  fused.expert_storage = ExpertStorage::kFused;
  const ModelLayout per = ModelLayout::Build(*c), one = ModelLayout::Build(fused);
  ASSERT_EQ(per.units[2].numel, one.units[2].numel);
  const UnitLayout& u = one.units[2];
  const TensorSlot* up3 = u.FindExpert(3, kExpertUpProj);
  ASSERT_NE(up3, nullptr);
  EXPECT_EQ(up3->hf_name, "model.layers.1.mlp.experts.gate_up_proj");
  EXPECT_EQ(up3->hf_shape, (std::vector<int64_t>{8, 64, 64}));
  EXPECT_EQ(up3->hf_offset_numel, 3 * 64 * 64 + 32 * 64);
  EXPECT_EQ(up3->offset_numel, per.units[2].FindExpert(3, kExpertUpProj)->offset_numel);
  EXPECT_EQ(u.FindExpert(5, kExpertDownProj)->hf_offset_numel, 5 * 64 * 32);
  EXPECT_NE(up3->Key(), u.FindExpert(3, kExpertGateProj)->Key());
  int unit = -1;
  ASSERT_NE(one.Find("model.layers.1.mlp.shared_expert_gate.weight", &unit), nullptr);
  EXPECT_EQ(one.Find("model.layers.1.mlp.shared_expert_gate.weight", &unit)->shape, (std::vector<int64_t>{1, 64}));
}

TEST(Qwen3_5Config, HubPresetsHaveThePublishedSizes) {
  // Each preset's language model against the size Qwen publishes for the checkpoint, in billions.
  // The published names round, and the checkpoints also hold a vision tower and MTP weights that a
  // preset leaves out (0.8B: 0.75B of language model; llama.cpp reports Qwen3.5-9B's at 8.95B), so
  // each tolerance covers that rounding and no more. Active: what one token reads (the "A3B").
  struct Published {
    const char* name;
    double total_b, total_tol;
    double active_b, active_tol;  // MoE only
    int64_t layers;
  };
  const Published kPublished[] = {
      {"qwen3.5-0.8b", 0.8, 0.1, 0, 0, 24},
      {"qwen3.5-2b", 2.0, 0.2, 0, 0, 24},
      {"qwen3.5-4b", 4.2, 0.3, 0, 0, 32},
      {"qwen3.5-9b", 9.0, 0.3, 0, 0, 32},
      {"qwen3.5-27b", 27.0, 1.0, 0, 0, 64},
      {"qwen3.5-35b-a3b", 35.0, 1.5, 3.0, 0.6, 40},
      {"qwen3.5-122b-a10b", 122.0, 2.0, 10.0, 1.5, 48},
      {"qwen3.5-397b-a17b", 397.0, 5.0, 17.0, 1.5, 60},
  };
  for (const Published& p : kPublished) {
    SCOPED_TRACE(p.name);
    const auto c = ModelConfig::Preset(p.name);
    ASSERT_TRUE(c.ok()) << c.status();
    const ModelLayout layout = ModelLayout::Build(*c);
    EXPECT_NEAR(static_cast<double>(layout.param_count()) / 1e9, p.total_b, p.total_tol);
    // Layer kinds: the released 3:1 pattern (full attention where (l + 1) % 4 == 0), every layer
    // of a MoE sparse.
    ASSERT_EQ(c->num_hidden_layers, p.layers);
    EXPECT_EQ(c->NumLinearAttentionLayers(), p.layers / 4 * 3);
    for (int64_t l = 0; l < p.layers; ++l) {
      EXPECT_EQ(c->MixerOf(l), (l + 1) % 4 == 0 ? TokenMixer::kAttention : TokenMixer::kLinearAttention) << l;
    }
    if (p.active_b > 0) {
      EXPECT_EQ(c->family, ModelFamily::kQwen3_5Moe);
      EXPECT_EQ(c->NumSparseLayers(), p.layers);
      EXPECT_NEAR(static_cast<double>(layout.ActiveParamCount()) / 1e9, p.active_b, p.active_tol);
    } else {
      EXPECT_EQ(c->family, ModelFamily::kQwen3_5);
      EXPECT_EQ(layout.ActiveParamCount(), layout.param_count());
    }
  }
  // The shapes the sizes differ in, as the hub's text configs give them.
  const ModelConfig small = *ModelConfig::Preset("qwen3.5-0.8b");
  EXPECT_EQ(small.linear, (LinearAttentionConfig{16, 16, 128, 128, 4}));
  EXPECT_TRUE(small.tie_word_embeddings);
  const ModelConfig dense27 = *ModelConfig::Preset("qwen3.5-27b");
  EXPECT_EQ(dense27.linear.num_value_heads, 48);
  EXPECT_EQ(dense27.num_attention_heads, 24);
  EXPECT_FALSE(dense27.tie_word_embeddings);
  EXPECT_FALSE(ModelConfig::Preset("qwen3.5-9b")->tie_word_embeddings);
  const ModelConfig big = *ModelConfig::Preset("qwen3.5-397b-a17b");
  EXPECT_EQ(big.num_experts, 512);
  EXPECT_EQ(big.num_experts_per_tok, 10);
  EXPECT_EQ(big.shared_expert_intermediate_size, 1024);
  EXPECT_EQ(big.linear.num_value_heads, 64);
  // A real config's extra fields (the hub's 35B-A3B text config) parse.
  nlohmann::json j = nlohmann::json::parse(Qwen3_5Text(R"(,"mamba_ssm_dtype":"float32","mtp_num_hidden_layers":1,
      "mtp_use_dedicated_embeddings":false,"full_attention_interval":4,"partial_rotary_factor":0.25,
      "pad_token_id":null,"bos_token_id":248044,"eos_token_id":248044,"attn_output_gate":true)"));
  EXPECT_TRUE(ModelConfig::FromJson(j.dump()).ok()) << ModelConfig::FromJson(j.dump()).status();
}

TEST(Qwen3_5Config, PresetsValidate) {
  for (const char* name : {"tiny-qwen3.5", "tiny-qwen3.5-moe", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b",
                           "qwen3.5-27b", "qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"}) {
    const auto c = ModelConfig::Preset(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_TRUE(c->Validate().ok()) << name << ": " << c->Validate();
    const auto back = ModelConfig::FromJson(c->ToJson());
    ASSERT_TRUE(back.ok()) << name << ": " << back.status();
    EXPECT_EQ(ModelLayout::Build(*back).total_numel, ModelLayout::Build(*c).total_numel) << name;
    EXPECT_NE(ModelConfig::PresetNames().find(name), std::string::npos) << name;
  }
}

// ReduceDepth (a job's model.num_hidden_layers, bench_step --layers): the per-layer lists follow the
// depth (GPT-OSS's alternating windows, Qwen3.5's mixers), a depth left without sliding layers drops
// the window, and the depth only shrinks.
TEST(ModelConfig, ReduceDepthCutsThePerLayerLists) {
  auto oss = ModelConfig::Preset("gpt-oss-20b");
  ASSERT_TRUE(oss.ok());
  ASSERT_TRUE(oss->ReduceDepth(4).ok());
  EXPECT_EQ(oss->num_hidden_layers, 4);
  EXPECT_EQ(oss->layer_spans.size(), 4u);
  EXPECT_EQ(oss->NumSlidingLayers(), 2);
  auto q = ModelConfig::Preset("qwen3.5-4b");
  ASSERT_TRUE(q.ok());
  ASSERT_TRUE(q->ReduceDepth(3).ok());
  EXPECT_EQ(q->layer_mixers.size(), 3u);
  auto g = ModelConfig::Preset("gemma3-4b");
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(g->ReduceDepth(1).ok());
  EXPECT_EQ(g->NumSlidingLayers(), 1);
  auto t = ModelConfig::Preset("tiny");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->ReduceDepth(t->num_hidden_layers + 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->ReduceDepth(0).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp
