// Gemma 3's config (gemma3_text, the gemma3 multimodal wrapper): the hub's configs in transformers 4's
// and 5's spellings, Gemma3TextConfig's defaults, its two RoPEs, the 5:1 sliding pattern, the
// scales its math reads, refusals by field, round trips through config.json, the unit layout and the
// presets of the released sizes.
#include <cmath>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp {
namespace {

// google/gemma-3-1b-it's config.json (transformers 4.5x spelling).
constexpr const char* kGemma3_1bConfig = R"({
  "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
  "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
  "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
  "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null,
  "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
  "transformers_version": "4.50.0.dev0", "use_cache": true, "vocab_size": 262144})";

// google/gemma-3-4b-it's config.json: its text_config leaves the heads and the vocabulary to
// Gemma3TextConfig's defaults.
constexpr const char* kGemma3_4bConfig = R"({
  "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
  "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
  "model_type": "gemma3",
  "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                  "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                  "sliding_window": 1024},
  "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
  "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                    "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                    "patch_size": 14, "vision_use_head": false}})";

ModelConfig Parse(const std::string& json) {
  auto c = ModelConfig::FromJson(json);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

// The 1B config with `patch`'s keys set over it (a null value is written as null).
absl::StatusOr<ModelConfig> Patched1b(const nlohmann::json& patch) {
  nlohmann::json j = nlohmann::json::parse(kGemma3_1bConfig);
  for (const auto& [k, v] : patch.items()) j[k] = v;
  return ModelConfig::FromJson(j.dump());
}

// The 4B config with `patch`'s keys set in its text_config.
absl::StatusOr<ModelConfig> Patched4bText(const nlohmann::json& patch) {
  nlohmann::json j = nlohmann::json::parse(kGemma3_4bConfig);
  for (const auto& [k, v] : patch.items()) j["text_config"][k] = v;
  return ModelConfig::FromJson(j.dump());
}

// HF's default RoPE at `theta` over head_dim d, in float32 as HF computes it.
std::vector<float> DefaultInvFreq(double theta, int64_t d) {
  std::vector<float> inv(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) {
    inv[i] = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(d));
  }
  return inv;
}

TEST(Gemma3Config, TheOneBillionTextConfigParses) {
  const ModelConfig c = Parse(kGemma3_1bConfig);
  EXPECT_EQ(c.family, ModelFamily::kGemma3);
  EXPECT_FALSE(c.multimodal);
  EXPECT_EQ(c.hidden_size, 1152);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 1);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.vocab_size, 262144);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.pad_token_id, 0);
  EXPECT_EQ(c.final_logit_softcapping, 0);
  EXPECT_EQ(c.mlp_activation(), MlpActivation::kGeluTanh);
  EXPECT_TRUE(c.has_qk_norm() && c.norms_add_one() && c.has_sandwich_norms());
  // Five sliding layers over 512 keys, then a full one: (l + 1) % 6.
  EXPECT_EQ(c.sliding_window, 512);
  for (int64_t l = 0; l < 26; ++l) {
    EXPECT_EQ(c.IsSlidingLayer(l), (l + 1) % 6 != 0) << l;
    EXPECT_EQ(c.AttentionWindow(l), (l + 1) % 6 != 0 ? 512 : 0) << l;
    EXPECT_EQ(c.UsesSlidingRope(l), c.IsSlidingLayer(l)) << l;
  }
  // The global layers at 1e6, the sliding ones at rope_local_base_freq 1e4; no scaling in 1B.
  EXPECT_EQ(c.RopeInverseFrequencies(), DefaultInvFreq(1e6, 256));
  EXPECT_EQ(c.RopeInverseFrequencies(AttentionSpan::kSliding), DefaultInvFreq(1e4, 256));
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_DOUBLE_EQ(c.AttentionScale(), 1.0 / 16);
  // sqrt(1152) = 33.94 in bfloat16 (spacing 0.25 in [32, 64)) is 34.
  EXPECT_EQ(c.EmbeddingScale(), 34.0);
}

TEST(Gemma3Config, MultimodalWrapperTakesGemma3TextConfigsDefaults) {
  const ModelConfig c = Parse(kGemma3_4bConfig);
  EXPECT_EQ(c.family, ModelFamily::kGemma3);
  EXPECT_TRUE(c.multimodal);
  EXPECT_EQ(c.WeightPrefix(), "model.language_model.");
  EXPECT_EQ(c.num_hidden_layers, 34);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.vocab_size, 262208);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.query_pre_attn_scalar, 256);
  EXPECT_EQ(c.sliding_window, 1024);
  EXPECT_EQ(c.NumSlidingLayers(), 29);
  EXPECT_TRUE(c.tie_word_embeddings);
  // rope_scaling is the global layers' only: linear factor 8 on theta 1e6; the sliding layers plain 1e4.
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLinear);
  std::vector<float> global = DefaultInvFreq(1e6, 256);
  for (float& f : global) f = f / 8.0f;
  EXPECT_EQ(c.RopeInverseFrequencies(), global);
  EXPECT_EQ(c.RopeInverseFrequencies(AttentionSpan::kSliding), DefaultInvFreq(1e4, 256));
  // sqrt(2560) = 50.596 in bfloat16 is 50.5 (the wrapper's torch_dtype).
  EXPECT_EQ(c.EmbeddingScale(), 50.5);
}

// transformers 5's spelling: rope_parameters per layer type, either may be absent; rope_scaling
// still updates the full-attention object; a missing theta falls back to rope_theta /
// rope_local_base_freq, then 1e6 / 1e4.
TEST(Gemma3Config, RopeParametersPerLayerTypeAsTransformers5BuildsThem) {
  const nlohmann::json legacy_off = {
      {"rope_theta", nullptr}, {"rope_local_base_freq", nullptr}, {"rope_scaling", nullptr}};
  nlohmann::json patch = legacy_off;
  patch["rope_parameters"] = {{"full_attention", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 5e5}}},
                              {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 2e4}}}};
  ModelConfig c = *Patched1b(patch);
  EXPECT_EQ(c.rope_theta, 5e5);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(c.rope_scaling.factor, 4.0);
  EXPECT_EQ(c.sliding_rope_theta, 2e4);
  EXPECT_EQ(c.sliding_rope_scaling.type, RopeScaling::Type::kNone);

  patch = legacy_off;
  patch["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}}};
  c = *Patched1b(patch);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.sliding_rope_theta, 1e4);

  // Both spellings at once (what ToJson writes): the object's theta wins, rope_scaling is merged in.
  patch = {
      {"rope_theta", 7e5}, {"rope_local_base_freq", 3e4}, {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}}};
  patch["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 9e5}}}};
  c = *Patched1b(patch);
  EXPECT_EQ(c.rope_theta, 9e5);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(c.sliding_rope_theta, 3e4);
  // A sliding RoPE of its own type (yarn) is read too.
  patch = {
      {"rope_parameters",
       {{"sliding_attention", {{"rope_type", "yarn"}, {"factor", 2.0}, {"original_max_position_embeddings", 4096}}}}}};
  c = *Patched1b(patch);
  EXPECT_EQ(c.sliding_rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c.sliding_rope_theta, 1e4);
  EXPECT_NE(c.RopeAttentionScaling(AttentionSpan::kSliding), 1.0);
  EXPECT_EQ(c.RopeAttentionScaling(), 1.0);
}

TEST(Gemma3Config, LayerTypesAndThePatternDecideTheSlidingLayers) {
  ModelConfig c = *Patched1b({{"num_hidden_layers", 7}, {"sliding_window_pattern", 3}});
  for (int64_t l = 0; l < 7; ++l) EXPECT_EQ(c.IsSlidingLayer(l), (l + 1) % 3 != 0) << l;
  c = *Patched1b({{"num_hidden_layers", 3},
                  {"layer_types", {"full_attention", "sliding_attention", "full_attention"}},
                  {"sliding_window_pattern", nullptr}});
  EXPECT_FALSE(c.IsSlidingLayer(0));
  EXPECT_TRUE(c.IsSlidingLayer(1));
  EXPECT_TRUE(c.UsesSlidingRope(1));
  EXPECT_FALSE(c.UsesSlidingRope(2));
  // Absent, the window is Gemma3TextConfig's 4096.
  EXPECT_EQ(Patched1b(nlohmann::json::object())->sliding_window, 512);
  nlohmann::json j = nlohmann::json::parse(kGemma3_1bConfig);
  j.erase("sliding_window");
  EXPECT_EQ(ModelConfig::FromJson(j.dump())->sliding_window, 4096);
}

// Each field this build does not implement, or that transformers' model ignores so that training
// with it would be another model than HF's, is INVALID_ARGUMENT naming it.
TEST(Gemma3Config, FieldsThisBuildDoesNotImplementAreRefusedByName) {
  struct Case {
    nlohmann::json patch;
    const char* names;
  };
  const Case text_cases[] = {
      {{{"hidden_activation", "gelu"}}, "hidden_activation"},
      {{{"attn_logit_softcapping", 50.0}}, "attn_logit_softcapping"},
      {{{"use_bidirectional_attention", true}}, "use_bidirectional_attention"},
      {{{"some_new_field", 1}}, "some_new_field"},
      {{{"hidden_act", "gelu_pytorch_tanh"}}, "hidden_act"},
      {{{"partial_rotary_factor", 0.5}}, "partial_rotary_factor"},
      {{{"attention_bias", true}}, "attention_bias"},
      {{{"attention_dropout", 0.1}}, "attention_dropout"},
      {{{"rope_parameters", {{"rope_type", "default"}}}}, "rope_parameters.rope_type"},
      {{{"rope_parameters", {{"full_attention", {{"rope_type", "longrope"}}}}}},
       "rope_parameters.full_attention.rope_type"},
      {{{"rope_scaling", {{"type", "linear"}, {"factor", 8.0}}}}, "rope_parameters.full_attention.type"},
      {{{"sliding_window", nullptr}}, "sliding_window"},
      {{{"sliding_window_pattern", 0}}, "sliding_window_pattern"},
      {{{"layer_types", {"chunked_attention"}}}, "layer_types"},
      {{{"query_pre_attn_scalar", -1}}, "query_pre_attn_scalar"},
      {{{"rope_local_base_freq", 0.5}}, "rope_parameters.sliding_attention.rope_theta"},
      {{{"pad_token_id", 300000}}, "pad_token_id"},
  };
  for (const Case& k : text_cases) {
    const auto c = Patched1b(k.patch);
    ASSERT_FALSE(c.ok()) << k.patch.dump();
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(c.status().message(), k.names)) << c.status();
  }
  // The multimodal class: its text_config's fields named so; the wrapper's own keys checked; the
  // logits' soft cap refused (Gemma3ForConditionalGeneration never applies it).
  auto softcap = Patched4bText({{"final_logit_softcapping", 30.0}});
  ASSERT_FALSE(softcap.ok());
  EXPECT_TRUE(absl::StrContains(softcap.status().message(), "text_config.final_logit_softcapping")) << softcap.status();
  EXPECT_TRUE(absl::StrContains(softcap.status().message(), "Gemma3ForConditionalGeneration")) << softcap.status();
  EXPECT_TRUE(Patched4bText({{"final_logit_softcapping", nullptr}}).ok());
  auto unknown = Patched4bText({{"frobnicate", true}});
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(absl::StrContains(unknown.status().message(), "text_config.frobnicate")) << unknown.status();
  nlohmann::json j = nlohmann::json::parse(kGemma3_4bConfig);
  j["unsloth_fixed"] = true;
  EXPECT_TRUE(absl::StrContains(ModelConfig::FromJson(j.dump()).status().message(), "unsloth_fixed"));
  j = nlohmann::json::parse(kGemma3_4bConfig);
  j["text_config"]["model_type"] = "gemma2";
  EXPECT_TRUE(absl::StrContains(ModelConfig::FromJson(j.dump()).status().message(), "text_config.model_type"));
  // Gemma3ForCausalLM does soft-cap: gemma3_text keeps the field.
  EXPECT_EQ(Patched1b({{"final_logit_softcapping", 30.0}})->final_logit_softcapping, 30.0);
  // The other families have none of gemma3's fields.
  ModelConfig qwen = *ModelConfig::Preset("tiny");
  qwen.query_pre_attn_scalar = 64;
  EXPECT_TRUE(absl::StrContains(qwen.Validate().message(), "query_pre_attn_scalar"));
  qwen = *ModelConfig::Preset("tiny");
  qwen.sliding_rope_theta = 1e4;
  EXPECT_FALSE(qwen.Validate().ok());
}

TEST(Gemma3Config, ScalesFollowHf) {
  ModelConfig c = *ModelConfig::Preset("gemma3-27b");
  EXPECT_DOUBLE_EQ(c.AttentionScale(), std::pow(168.0, -0.5));  // query_pre_attn_scalar, not head_dim 128
  // sqrt(3072) = 55.4256...: HF's own example, 55.5 in bfloat16; 55.4375 in float16; float32 as is.
  c.hidden_size = 3072;
  EXPECT_EQ(c.EmbeddingScale(), 55.5);
  c.torch_dtype = "float16";
  EXPECT_EQ(c.EmbeddingScale(), 55.4375);
  c.torch_dtype = "float32";
  EXPECT_EQ(c.EmbeddingScale(), static_cast<double>(static_cast<float>(std::sqrt(3072.0))));
  // The other families: no embedding scale, scores by head_dim.
  const ModelConfig q = *ModelConfig::Preset("tiny");
  EXPECT_EQ(q.EmbeddingScale(), 1.0);
  EXPECT_EQ(q.AttentionScale(), 1.0 / std::sqrt(16.0));
}

// A gemma3 decoder unit: HF's names, the four norms and q/k norms with FP32 side copies, each
// layer's window and RoPE; the multimodal layout under model.language_model.
TEST(Gemma3Layout, UnitsHoldHfsTensors) {
  ModelConfig c = *ModelConfig::Preset("tiny-gemma3");
  ModelLayout m = ModelLayout::Build(c);
  ASSERT_EQ(m.num_units(), 8);
  const UnitLayout& u = m.units[1];
  for (const char* name : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                           "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"}) {
    const TensorSlot* t = m.Find(absl::StrCat("model.layers.0.", name, ".weight"), nullptr);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_GE(t->fp32_offset, 0) << name;
  }
  EXPECT_NE(u.Find(kPreFfnNorm), nullptr);
  EXPECT_NE(u.Find(kPostFfnNorm), nullptr);
  EXPECT_EQ(u.Find(kQBias), nullptr);
  EXPECT_EQ(u.tensors.size(), 13u);
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(m.units[l + 1].attention_window, l == 5 ? 0 : 16) << l;
    EXPECT_EQ(m.units[l + 1].sliding_rope, l != 5) << l;
  }
  EXPECT_TRUE(m.head_uses_embedding);
  c.multimodal = true;
  m = ModelLayout::Build(c);
  EXPECT_NE(m.Find("model.language_model.layers.5.pre_feedforward_layernorm.weight", nullptr), nullptr);
  EXPECT_EQ(m.embedding().tensors[0].hf_name, "model.language_model.embed_tokens.weight");
}

// The presets of the released sizes: their language models' shapes (docs/model-families.md gives
// the sources). 1B's count worked by hand from its config: 262144 x 1152 embedding, 26 layers of
// 26,842,112, the final norm.
TEST(Gemma3Presets, HubShapesAndCounts) {
  struct Want {
    const char* name;
    int64_t layers, hidden, heads, kv, head_dim, vocab, window;
  };
  for (const Want& w :
       {Want{"gemma3-1b", 26, 1152, 4, 1, 256, 262144, 512}, Want{"gemma3-4b", 34, 2560, 8, 4, 256, 262208, 1024},
        Want{"gemma3-12b", 48, 3840, 16, 8, 256, 262208, 1024},
        Want{"gemma3-27b", 62, 5376, 32, 16, 128, 262208, 1024}}) {
    const ModelConfig c = *ModelConfig::Preset(w.name);
    ASSERT_TRUE(c.Validate().ok()) << w.name << ": " << c.Validate();
    EXPECT_EQ(c.num_hidden_layers, w.layers);
    EXPECT_EQ(c.hidden_size, w.hidden);
    EXPECT_EQ(c.num_attention_heads, w.heads);
    EXPECT_EQ(c.num_key_value_heads, w.kv);
    EXPECT_EQ(c.head_dim, w.head_dim);
    EXPECT_EQ(c.vocab_size, w.vocab);
    EXPECT_EQ(c.sliding_window, w.window);
    EXPECT_EQ(c.NumSlidingLayers(), w.layers - w.layers / 6) << w.name;
    EXPECT_EQ(c.rope_scaling.type,
              std::string(w.name) == "gemma3-1b" ? RopeScaling::Type::kNone : RopeScaling::Type::kLinear);
    std::printf("%s: %lld parameters\n", w.name, static_cast<long long>(ModelLayout::Build(c).param_count()));
  }
  EXPECT_EQ(ModelLayout::Build(*ModelConfig::Preset("gemma3-1b")).param_count(), 999885952);
  EXPECT_TRUE(ModelConfig::Preset("tiny-gemma3")->Validate().ok());
}

// config.json round trips: a preset's, the hub's 1B and 4B (the wrapper and its vision_config kept),
// and a changed depth (layer_types rewritten).
TEST(Gemma3Config, JsonRoundTrips) {
  auto same = [](const ModelConfig& a, const ModelConfig& b) {
    EXPECT_EQ(a.family, b.family);
    EXPECT_EQ(a.multimodal, b.multimodal);
    EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
    EXPECT_EQ(a.vocab_size, b.vocab_size);
    EXPECT_EQ(a.query_pre_attn_scalar, b.query_pre_attn_scalar);
    EXPECT_EQ(a.final_logit_softcapping, b.final_logit_softcapping);
    EXPECT_EQ(a.RopeInverseFrequencies(), b.RopeInverseFrequencies());
    EXPECT_EQ(a.RopeInverseFrequencies(AttentionSpan::kSliding), b.RopeInverseFrequencies(AttentionSpan::kSliding));
    EXPECT_EQ(a.EmbeddingScale(), b.EmbeddingScale());
    EXPECT_EQ(a.pad_token_id, b.pad_token_id);
    for (int64_t l = 0; l < a.num_hidden_layers; ++l) EXPECT_EQ(a.AttentionWindow(l), b.AttentionWindow(l)) << l;
  };
  for (const char* preset : {"tiny-gemma3", "gemma3-1b", "gemma3-27b"}) {
    const ModelConfig c = *ModelConfig::Preset(preset);
    const std::string text = c.ToJson();
    const nlohmann::json j = nlohmann::json::parse(text);
    EXPECT_EQ(j["model_type"], "gemma3_text");
    EXPECT_EQ(j["architectures"][0], "Gemma3ForCausalLM");
    EXPECT_EQ(j["hidden_activation"], "gelu_pytorch_tanh");
    EXPECT_TRUE(j["rope_parameters"].contains("sliding_attention")) << text;
    EXPECT_TRUE(j.contains("rope_local_base_freq")) << text;
    same(c, Parse(text));
  }
  for (const char* source : {kGemma3_1bConfig, kGemma3_4bConfig}) {
    const ModelConfig c = Parse(source);
    const std::string text = c.ToJson();
    same(c, Parse(text));
    if (c.multimodal) {
      const nlohmann::json j = nlohmann::json::parse(text);
      EXPECT_EQ(j["model_type"], "gemma3");
      EXPECT_EQ(j["text_config"]["model_type"], "gemma3_text");
      EXPECT_EQ(j["vision_config"], nlohmann::json::parse(kGemma3_4bConfig)["vision_config"]);
      EXPECT_EQ(j["mm_tokens_per_image"], 256);
    }
    // Fewer layers (a job's model.num_hidden_layers): the windows written agree with the new depth.
    ModelConfig shallow = c;
    shallow.num_hidden_layers = 8;
    shallow.layer_spans.resize(8);
    const ModelConfig back = Parse(shallow.ToJson());
    same(shallow, back);
  }
}

}  // namespace
}  // namespace slidedp
