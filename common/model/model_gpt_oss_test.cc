// GPT-OSS's config (gpt_oss): the released configs (MXFP4 quantization_config, rope_scaling YaRN,
// the hub's extra keys), GptOssConfig's defaults, a transformers 5.17 save (rope_parameters),
// refusals by field, round trips through config.json, the unit layout (fused experts sliced per
// expert, biases, sinks, the biased router) and the presets of the released sizes.
#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp {
namespace {

// https://huggingface.co/openai/gpt-oss-20b/raw/main/config.json, as copies in public repositories
// give it (docs/model-families.md, "GPT-OSS"); layer_types written below.
constexpr const char* kGptOss20bConfig = R"({
  "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0, "eos_token_id": 200002,
  "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
  "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
  "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
  "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
  "output_router_logits": false, "pad_token_id": 199999,
  "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                     "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                   "rope_type": "yarn", "truncate": false},
  "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
  "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true, "vocab_size": 201088})";

// tests/data/hf/gpt_oss/config.json: what transformers 5.17's save_pretrained writes (rope_parameters).
constexpr const char* kSaved517 = R"({
  "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0, "bos_token_id": null,
  "dtype": "float32", "eos_token_id": null, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
  "initializer_range": 0.02, "intermediate_size": 64, "layer_types": ["sliding_attention", "full_attention"],
  "max_position_embeddings": 512, "model_type": "gpt_oss", "num_attention_heads": 4, "num_experts_per_tok": 2,
  "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": false,
  "pad_token_id": null, "rms_norm_eps": 1e-06,
  "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                      "rope_theta": 150000.0, "rope_type": "yarn", "truncate": false},
  "router_aux_loss_coef": 0.001, "sliding_window": 16, "tie_word_embeddings": false,
  "transformers_version": "5.17.0", "use_cache": true, "vocab_size": 512})";

nlohmann::json Released20b() {
  nlohmann::json j = nlohmann::json::parse(kGptOss20bConfig);
  j["layer_types"] = nlohmann::json::array();
  for (int l = 0; l < 24; ++l) j["layer_types"].push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
  return j;
}

absl::StatusOr<ModelConfig> Patched(nlohmann::json j, const nlohmann::json& patch) {
  for (const auto& [k, v] : patch.items()) j[k] = v;
  return ModelConfig::FromJson(j.dump());
}

void ExpectRefused(const absl::StatusOr<ModelConfig>& c, const std::string& field) {
  ASSERT_FALSE(c.ok()) << "accepted; expected a refusal naming " << field;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(c.status().message(), field)) << c.status();
}

TEST(GptOssConfig, TheReleased20bConfigParses) {
  auto parsed = ModelConfig::FromJson(Released20b().dump());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const ModelConfig& c = *parsed;
  EXPECT_EQ(c.family, ModelFamily::kGptOss);
  EXPECT_TRUE(c.is_moe() && c.has_qkv_bias() && c.has_o_bias() && c.has_attention_sinks());
  EXPECT_EQ(c.hidden_size, 2880);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 201088);
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.moe_intermediate_size, 2880);
  EXPECT_EQ(c.NumSparseLayers(), 24);
  EXPECT_EQ(c.router_aux_loss_coef, 0.9);
  EXPECT_FALSE(c.output_router_logits);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.pad_token_id, 199999);
  EXPECT_TRUE(c.mxfp4_experts);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.sliding_window, 128);
  for (int64_t l = 0; l < 24; ++l) EXPECT_EQ(c.IsSlidingLayer(l), l % 2 == 0) << l;
  EXPECT_EQ(c.rope_theta, 150000);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c.rope_scaling.factor, 32);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1);
  EXPECT_FALSE(c.rope_scaling.truncate);
  EXPECT_DOUBLE_EQ(c.RopeAttentionScaling(), 0.1 * std::log(32.0) + 1.0);
}

// GptOssConfig() with nothing set: the 120B's shape, sliding and full layers alternating over 128
// keys, and __post_init__'s YaRN (truncate false) at theta 150000.
TEST(GptOssConfig, AbsentFieldsTakeGptOssConfigsDefaults) {
  auto parsed = ModelConfig::FromJson(R"({"model_type": "gpt_oss"})");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const ModelConfig& c = *parsed;
  EXPECT_EQ(c.num_hidden_layers, 36);
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.head_dim, 64);  // not hidden / heads (45)
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.vocab_size, 201088);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_EQ(c.NumSlidingLayers(), 18);
  EXPECT_TRUE(c.IsSlidingLayer(0) && !c.IsSlidingLayer(1));
  EXPECT_EQ(c.rope_theta, 150000);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c.rope_scaling.factor, 32);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_FALSE(c.rope_scaling.truncate);
  EXPECT_FALSE(c.mxfp4_experts);
  EXPECT_EQ(c.pad_token_id, -1);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  // Nulls as __post_init__ reads them: kv heads = heads, head_dim = hidden // heads.
  auto nulls = ModelConfig::FromJson(
      R"({"model_type": "gpt_oss", "num_key_value_heads": null, "head_dim": null, "hidden_size": 256,
          "num_attention_heads": 8})");
  ASSERT_TRUE(nulls.ok()) << nulls.status();
  EXPECT_EQ(nulls->num_key_value_heads, 8);
  EXPECT_EQ(nulls->head_dim, 32);
}

TEST(GptOssConfig, TransformersOwnSaveParsesAndRoundTrips) {
  auto parsed = ModelConfig::FromJson(kSaved517);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->sliding_window, 16);
  EXPECT_TRUE(parsed->IsSlidingLayer(0));
  EXPECT_FALSE(parsed->IsSlidingLayer(1));
  EXPECT_EQ(parsed->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_FALSE(parsed->rope_scaling.truncate);
  EXPECT_EQ(parsed->num_experts, 4);
  EXPECT_EQ(parsed->num_experts_per_tok, 2);
  EXPECT_EQ(parsed->torch_dtype, "float32");
  auto again = ModelConfig::FromJson(parsed->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(nlohmann::json::parse(again->ToJson()), nlohmann::json::parse(parsed->ToJson()));
  EXPECT_EQ(again->RopeInverseFrequencies(), parsed->RopeInverseFrequencies());
}

// A checkpoint of an MXFP4 model holds unquantized experts: its config.json must not say mxfp4.
TEST(GptOssConfig, ConfigJsonDropsQuantizationAndReadsBackAlike) {
  auto c = ModelConfig::FromJson(Released20b().dump());
  ASSERT_TRUE(c.ok()) << c.status();
  const nlohmann::json written = nlohmann::json::parse(c->ToJson());
  EXPECT_FALSE(written.contains("quantization_config"));
  EXPECT_EQ(written["num_local_experts"], 32);
  EXPECT_EQ(written["experts_per_token"], 4);
  EXPECT_EQ(written["swiglu_limit"], 7.0);
  EXPECT_EQ(written["pad_token_id"], 199999);
  auto back = ModelConfig::FromJson(written.dump());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->mxfp4_experts);
  EXPECT_EQ(back->RopeInverseFrequencies(), c->RopeInverseFrequencies());
  EXPECT_EQ(back->RopeAttentionScaling(), c->RopeAttentionScaling());
  for (int64_t l = 0; l < 24; ++l) EXPECT_EQ(back->AttentionWindow(l), c->AttentionWindow(l));
  // rope_parameters without a rope_theta: the top level's, else 150000.
  auto top = Patched(
      Released20b(),
      {{"rope_scaling", nullptr}, {"rope_parameters", {{"rope_type", "yarn"}, {"factor", 8.0}}}, {"rope_theta", 5e5}});
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->rope_theta, 5e5);
  EXPECT_EQ(top->rope_scaling.factor, 8);
  EXPECT_TRUE(top->rope_scaling.truncate);  // HF's yarn default where the object does not say
  EXPECT_EQ(top->rope_scaling.original_max_position_embeddings, 131072);  // max_position_embeddings
}

TEST(GptOssConfig, FieldsThisBuildDoesNotComputeAreRefusedByName) {
  ExpectRefused(Patched(Released20b(), {{"some_new_field", 1}}), "some_new_field");
  ExpectRefused(Patched(Released20b(), {{"swiglu_limit", 10.0}}), "swiglu_limit");
  ExpectRefused(Patched(Released20b(), {{"attention_bias", false}}), "attention_bias");
  ExpectRefused(Patched(Released20b(), {{"experts_per_token", 2}}), "experts_per_token");
  ExpectRefused(Patched(Released20b(), {{"num_experts", 16}}), "num_experts");
  ExpectRefused(Patched(Released20b(), {{"quantization_config", {{"quant_method", "bitsandbytes"}}}}),
                "quantization_config.quant_method");
  ExpectRefused(Patched(Released20b(), {{"quantization_config", {{"quant_method", "mxfp4"}, {"bits", 4}}}}),
                "quantization_config.bits");
  ExpectRefused(Patched(Released20b(), {{"sliding_window", nullptr}}), "sliding_window");
  ExpectRefused(Patched(Released20b(), {{"attention_dropout", 0.1}}), "attention_dropout");
  ExpectRefused(Patched(Released20b(), {{"hidden_act", "gelu"}}), "hidden_act");
  ExpectRefused(Patched(Released20b(), {{"rope_scaling", {{"rope_type", "longrope"}, {"factor", 2.0}}}}), "rope_type");
  ExpectRefused(Patched(Released20b(), {{"pad_token_id", 201088}}), "pad_token_id");
  ExpectRefused(Patched(Released20b(), {{"layer_types", {"sliding_attention"}}}), "layer_types");
  // The same model under either spelling of the expert count, and a null window with no sliding layer.
  EXPECT_TRUE(Patched(Released20b(), {{"num_experts", 32}}).ok());
  nlohmann::json full = Released20b();
  for (auto& t : full["layer_types"]) t = "full_attention";
  auto no_window = Patched(full, {{"sliding_window", nullptr}});
  ASSERT_TRUE(no_window.ok()) << no_window.status();
  EXPECT_EQ(no_window->NumSlidingLayers(), 0);
}

// A decoder unit holds HF's tensors: q/k/v/o with biases, sinks, the norms, the biased router and,
// per expert, its slices of the fused gate_up_proj [E, h, 2I], gate_up_proj_bias, down_proj [E, I, h]
// and down_proj_bias.
TEST(GptOssLayout, DecoderUnitsHoldTransformersTensors) {
  const ModelConfig c = ModelConfig::Preset("tiny-gpt-oss").value();
  const ModelLayout layout = ModelLayout::Build(c);
  const UnitLayout& u = layout.units[1];
  ASSERT_TRUE(u.sparse());
  EXPECT_EQ(u.num_experts(), 4);
  EXPECT_EQ(u.attention_window, 16);
  EXPECT_EQ(layout.units[2].attention_window, 0);
  EXPECT_EQ(u.Find(kQBias)->hf_name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(u.Find(kOBias)->hf_name, "model.layers.0.self_attn.o_proj.bias");
  EXPECT_EQ(u.Find(kOBias)->shape, (std::vector<int64_t>{64}));
  EXPECT_EQ(u.Find(kSinks)->hf_name, "model.layers.0.self_attn.sinks");
  EXPECT_EQ(u.Find(kSinks)->shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(u.Find(kRouter)->hf_name, "model.layers.0.mlp.router.weight");
  EXPECT_EQ(u.Find(kRouterBias)->hf_name, "model.layers.0.mlp.router.bias");
  EXPECT_EQ(u.Find(kGateProj), nullptr);
  EXPECT_EQ(u.FindExpert(0, kExpertGateProj), nullptr);  // not a qwen3_moe block
  const int64_t h = 64, mi = 32;
  for (int64_t e = 0; e < 4; ++e) {
    const TensorSlot* gu = u.FindExpert(e, kGptOssGateUp);
    ASSERT_NE(gu, nullptr);
    EXPECT_EQ(gu->hf_name, "model.layers.0.mlp.experts.gate_up_proj");
    EXPECT_EQ(gu->shape, (std::vector<int64_t>{h, 2 * mi}));
    EXPECT_EQ(gu->hf_shape, (std::vector<int64_t>{4, h, 2 * mi}));
    EXPECT_EQ(gu->hf_offset_numel, e * h * 2 * mi);
    const TensorSlot* gub = u.FindExpert(e, kGptOssGateUpBias);
    EXPECT_EQ(gub->hf_shape, (std::vector<int64_t>{4, 2 * mi}));
    EXPECT_EQ(gub->hf_offset_numel, e * 2 * mi);
    const TensorSlot* down = u.FindExpert(e, kGptOssDown);
    EXPECT_EQ(down->hf_name, "model.layers.0.mlp.experts.down_proj");
    EXPECT_EQ(down->shape, (std::vector<int64_t>{mi, h}));
    EXPECT_EQ(down->hf_offset_numel, e * mi * h);
    const TensorSlot* db = u.FindExpert(e, kGptOssDownBias);
    EXPECT_EQ(db->hf_name, "model.layers.0.mlp.experts.down_proj_bias");
    EXPECT_EQ(db->hf_offset_numel, e * h);
    EXPECT_EQ(gu->offset_numel, u.ExpertOffset(e));
  }
  EXPECT_EQ(u.ExpertOffset(3) + u.ExpertNumel(), u.numel);
  // Parameters: HF's num_parameters() of GptOssForCausalLM at this shape.
  const int64_t attn = (64 * 64 + 64) + 2 * (32 * 64 + 32) + (64 * 64 + 64) + 4;
  const int64_t moe = (4 * 64 + 4) + 4 * (h * 2 * mi + 2 * mi + mi * h + h);
  EXPECT_EQ(layout.param_count(), 2 * (512 * 64) + 64 + 2 * (attn + moe + 2 * 64));
  EXPECT_EQ(layout.ActiveParamCount(), layout.param_count() - 2 * 2 * (h * 2 * mi + 2 * mi + mi * h + h));
}

// The released sizes: ModelLayout::param_count (HF's num_parameters(), unquantized) and the
// parameters a token's forward reads; config.json of a preset reads back as the same model.
TEST(GptOssPresets, ReleasedSizesAndRoundTrips) {
  struct Want {
    const char* name;
    int64_t layers, experts, params, active;
  };
  for (const Want& w : {Want{"gpt-oss-20b", 24, 32, 20914757184, 4187440704},
                        Want{"gpt-oss-120b", 36, 128, 116829156672, 5711982912}}) {
    auto c = ModelConfig::Preset(w.name);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(c->Validate().ok()) << c->Validate();
    EXPECT_EQ(c->num_hidden_layers, w.layers);
    EXPECT_EQ(c->num_experts, w.experts);
    const ModelLayout layout = ModelLayout::Build(*c);
    EXPECT_EQ(layout.param_count(), w.params) << w.name;
    EXPECT_EQ(layout.ActiveParamCount(), w.active) << w.name;
    auto back = ModelConfig::FromJson(c->ToJson());
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << c->ToJson();
    EXPECT_EQ(nlohmann::json::parse(back->ToJson()), nlohmann::json::parse(c->ToJson()));
    EXPECT_EQ(back->family, ModelFamily::kGptOss);
    EXPECT_EQ(back->RopeInverseFrequencies(), c->RopeInverseFrequencies());
    EXPECT_EQ(back->pad_token_id, 199999);
    for (int64_t l = 0; l < w.layers; ++l) EXPECT_EQ(back->AttentionWindow(l), l % 2 == 0 ? 128 : 0);
    EXPECT_EQ(back->num_experts, w.experts);
    EXPECT_EQ(back->router_aux_loss_coef, 0.9);
  }
  auto tiny = ModelConfig::Preset("tiny-gpt-oss");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  auto back = ModelConfig::FromJson(tiny->ToJson());
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << tiny->ToJson();
  EXPECT_EQ(nlohmann::json::parse(back->ToJson()), nlohmann::json::parse(tiny->ToJson()));
  EXPECT_EQ(back->AttentionWindow(0), 16);
  EXPECT_EQ(back->AttentionWindow(1), 0);
}

// YaRN as _compute_yarn_parameters computes it for the released RoPE at head_dim 64: the correction
// range from beta_fast 32 and beta_slow 1 over 4096 positions, not truncated (truncate false),
// frequencies below it extrapolated (theta^(-2i/d)), above it interpolated (divided by 32).
TEST(GptOssRope, YarnFrequenciesAsTransformersComputesThem) {
  const ModelConfig c = ModelConfig::Preset("gpt-oss-20b").value();
  const std::vector<float> inv = c.RopeInverseFrequencies();
  ASSERT_EQ(inv.size(), 32u);
  const double d = 64, base = 150000, orig = 4096;
  auto correction = [&](double rot) { return d * std::log(orig / (rot * 2 * M_PI)) / (2 * std::log(base)); };
  const double low = std::max(correction(32), 0.0), high = std::min(correction(1), d - 1);
  EXPECT_NEAR(low, 8.0928, 1e-3);    // not floored
  EXPECT_NEAR(high, 17.3980, 1e-3);  // not ceiled
  for (int i = 0; i < 32; ++i) {
    const double pos = std::pow(base, 2.0 * i / d);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double want = (1.0 / (32 * pos)) * ramp + (1.0 / pos) * (1 - ramp);
    EXPECT_NEAR(inv[i], want, 2e-6 * want) << i;
  }
  EXPECT_EQ(inv[0], 1.0f);
  // Truncated (HF's default when the object does not say) moves the ramp's ends to whole dims.
  ModelConfig truncated = c;
  truncated.rope_scaling.truncate = true;
  EXPECT_NE(truncated.RopeInverseFrequencies(), inv);
}

}  // namespace
}  // namespace slidedp
