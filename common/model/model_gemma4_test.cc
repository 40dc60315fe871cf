// Gemma 4's config (gemma4_text, the gemma4 multimodal wrapper; model_config_gemma4.cc): transformers
// 5.17's own serialization of Gemma4TextConfig and the class defaults it stands for, the released E2B's
// text_config (global_head_dim, kv sharing, double-wide MLPs), per_layer_config, the forced full last
// layer, the RoPEs, refusals by field, round trips through config.json, the unit layout (per-layer
// inputs, layer 0's projection, shared layers without k/v, k_eq_v layers without v_proj, the frozen
// layer_scalar) and the presets of the released sizes.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model/model_config.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp {
namespace {

// transformers 5.17's Gemma4TextConfig().to_dict() (its default_configs dump): what the class
// defaults are, in the spelling it saves (per_layer_config with zero-padded keys).
constexpr const char* kDefaultTextConfig = R"({"transformers_version": "5.17.0", "architectures": null,
  "output_hidden_states": false, "return_dict": true, "dtype": null, "chunk_size_feed_forward": 0,
  "is_encoder_decoder": false, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
  "problem_type": null, "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
  "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": true,
  "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": true,
  "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                         "rope_theta": 1000000.0}},
  "attention_bias": false, "attention_dropout": 0.0, "sliding_window": 512,
  "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
    "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
    "sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
    "sliding_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
    "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention",
    "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
    "full_attention"],
  "final_logit_softcapping": null, "use_bidirectional_attention": null, "vocab_size_per_layer_input": 262144,
  "hidden_size_per_layer_input": 256, "attention_k_eq_v": false, "num_kv_shared_layers": 0,
  "enable_moe_block": false, "use_double_wide_mlp": false, "num_experts": null, "top_k_experts": null,
  "moe_intermediate_size": null, "_name_or_path": "", "model_type": "gemma4_text", "output_attentions": false,
  "per_layer_config": {"05": {"head_dim": 512}, "11": {"head_dim": 512}, "17": {"head_dim": 512},
                       "23": {"head_dim": 512}, "29": {"head_dim": 512}}})";

// google/gemma-4-E2B-it's config.json as its copies give it (docs/model-families.md): the multimodal
// wrapper (its towers' configs shortened here) and the text_config in transformers 5.5's spelling
// (global_head_dim, num_global_key_value_heads).
std::string E2bConfig() {
  nlohmann::json types = nlohmann::json::array();
  for (int l = 0; l < 35; ++l) types.push_back((l + 1) % 5 == 0 ? "full_attention" : "sliding_attention");
  nlohmann::json text = {
      {"attention_bias", false}, {"attention_dropout", 0.0}, {"attention_k_eq_v", false}, {"bos_token_id", 2},
      {"dtype", "bfloat16"}, {"enable_moe_block", false}, {"eos_token_id", 1}, {"final_logit_softcapping", 30.0},
      {"global_head_dim", 512}, {"head_dim", 256}, {"hidden_activation", "gelu_pytorch_tanh"}, {"hidden_size", 1536},
      {"hidden_size_per_layer_input", 256}, {"initializer_range", 0.02}, {"intermediate_size", 6144},
      {"layer_types", types}, {"max_position_embeddings", 131072}, {"model_type", "gemma4_text"},
      {"num_attention_heads", 8}, {"num_experts", nullptr}, {"num_global_key_value_heads", nullptr},
      {"num_hidden_layers", 35}, {"num_key_value_heads", 1}, {"num_kv_shared_layers", 20}, {"pad_token_id", 0},
      {"rms_norm_eps", 1e-6},
      {"rope_parameters",
       {{"full_attention", {{"partial_rotary_factor", 0.25}, {"rope_theta", 1000000.0}, {"rope_type", "proportional"}}},
        {"sliding_attention", {{"rope_theta", 10000.0}, {"rope_type", "default"}}}}},
      {"sliding_window", 512}, {"tie_word_embeddings", true}, {"top_k_experts", nullptr},
      {"use_bidirectional_attention", nullptr}, {"use_cache", true}, {"use_double_wide_mlp", true},
      {"vocab_size", 262144}, {"vocab_size_per_layer_input", 262144}};
  nlohmann::json j = {{"architectures", {"Gemma4ForConditionalGeneration"}},
                      {"audio_config", {{"model_type", "gemma4_audio"}, {"hidden_size", 1024}}},
                      {"audio_token_id", 258881}, {"boa_token_id", 256000}, {"boi_token_id", 255999},
                      {"dtype", "bfloat16"}, {"eoa_token_id", 258883}, {"eoa_token_index", 258883},
                      {"eoi_token_id", 258882}, {"image_token_id", 258880}, {"initializer_range", 0.02},
                      {"model_type", "gemma4"}, {"text_config", text}, {"tie_word_embeddings", true},
                      {"transformers_version", "5.5.0.dev0"}, {"video_token_id", 258884},
                      {"vision_config", {{"model_type", "gemma4_vision"}, {"hidden_size", 768}}},
                      {"vision_soft_tokens_per_image", 280}};
  return j.dump();
}

ModelConfig Parse(const std::string& json) {
  auto c = ModelConfig::FromJson(json);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

// A small gemma4_text config with `patch`'s keys set over it.
absl::StatusOr<ModelConfig> Small(const nlohmann::json& patch) {
  nlohmann::json j = {{"model_type", "gemma4_text"}, {"hidden_size", 64}, {"num_hidden_layers", 6},
                      {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 16},
                      {"intermediate_size", 96}, {"vocab_size", 512}, {"vocab_size_per_layer_input", 512},
                      {"hidden_size_per_layer_input", 8}, {"sliding_window", 16}, {"global_head_dim", 32}};
  for (const auto& [k, v] : patch.items()) j[k] = v;
  return ModelConfig::FromJson(j.dump());
}

void ExpectRefused(const absl::StatusOr<ModelConfig>& c, const std::string& field) {
  ASSERT_FALSE(c.ok()) << "accepted; expected a refusal naming " << field;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), field)) << c.status();
}

TEST(Gemma4Config, TransformersDefaultsAsSavedAndAsLeftOut) {
  for (const std::string& json : {std::string(kDefaultTextConfig), std::string(R"({"model_type": "gemma4_text"})")}) {
    const ModelConfig c = Parse(json);
    EXPECT_TRUE(c.is_gemma4());
    EXPECT_FALSE(c.multimodal);
    EXPECT_EQ(c.hidden_size, 2304);
    EXPECT_EQ(c.num_hidden_layers, 30);
    EXPECT_EQ(c.num_attention_heads, 8);
    EXPECT_EQ(c.num_key_value_heads, 4);
    EXPECT_EQ(c.intermediate_size, 9216);
    EXPECT_EQ(c.vocab_size, 262144);
    EXPECT_TRUE(c.tie_word_embeddings);
    EXPECT_EQ(c.sliding_window, 512);
    EXPECT_EQ(c.NumSlidingLayers(), 25);
    EXPECT_FALSE(c.IsSlidingLayer(5));
    EXPECT_FALSE(c.IsSlidingLayer(29));
    EXPECT_EQ(c.LayerHeadDim(0), 256);
    EXPECT_EQ(c.LayerHeadDim(5), 512);
    EXPECT_EQ(c.LayerKvHeads(5), 4);
    EXPECT_EQ(c.gemma4.ple_dim, 256);
    EXPECT_EQ(c.gemma4.ple_vocab, 262144);
    EXPECT_EQ(c.gemma4.kv_shared_layers, 0);
    EXPECT_EQ(c.final_logit_softcapping, 0);
    EXPECT_EQ(c.rope_theta, 1e6);
    EXPECT_EQ(c.sliding_rope_theta, 1e4);
    EXPECT_TRUE(c.gemma4.full_rope.proportional);
    EXPECT_EQ(c.gemma4.full_rope.fraction, 0.25);
    EXPECT_FALSE(c.gemma4.sliding_rope.proportional);
    EXPECT_EQ(c.pad_token_id, 0);
    EXPECT_EQ(c.AttentionScale(), 1.0);
  }
}

// transformers 5.17's Gemma4Config().to_dict(): the wrapper's keys around the text config's.
TEST(Gemma4Config, TransformersWrapperAsSaved) {
  nlohmann::json j = {{"transformers_version", "5.17.0"}, {"architectures", nullptr},
                      {"output_hidden_states", false}, {"return_dict", true}, {"dtype", nullptr},
                      {"chunk_size_feed_forward", 0}, {"is_encoder_decoder", false},
                      {"id2label", {{"0", "LABEL_0"}, {"1", "LABEL_1"}}}, {"label2id", {{"LABEL_0", 0}, {"LABEL_1", 1}}},
                      {"problem_type", nullptr}, {"text_config", nlohmann::json::parse(kDefaultTextConfig)},
                      {"vision_config", nullptr}, {"audio_config", nullptr}, {"boi_token_id", 255999},
                      {"eoi_token_id", 258882}, {"image_token_id", 258880}, {"video_token_id", 258884},
                      {"boa_token_id", 256000}, {"eoa_token_index", 258883}, {"audio_token_id", 258881},
                      {"initializer_range", 0.02}, {"tie_word_embeddings", true}, {"_name_or_path", ""},
                      {"model_type", "gemma4"}, {"output_attentions", false}};
  const ModelConfig c = Parse(j.dump());
  EXPECT_TRUE(c.multimodal);
  EXPECT_EQ(c.hidden_size, 2304);
  EXPECT_EQ(c.gemma4.placeholder_tokens, (std::vector<int64_t>{258880, 258884, 258881}));
  j["image_token_id"] = nullptr;
  EXPECT_EQ(Parse(j.dump()).gemma4.placeholder_tokens, (std::vector<int64_t>{258884, 258881}));
}

TEST(Gemma4Config, ReleasedE2bMultimodal) {
  const ModelConfig c = Parse(E2bConfig());
  EXPECT_TRUE(c.is_gemma4());
  EXPECT_TRUE(c.multimodal);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.WeightPrefix(), "model.language_model.");
  EXPECT_EQ(c.hidden_size, 1536);
  EXPECT_EQ(c.num_hidden_layers, 35);
  EXPECT_EQ(c.NumSlidingLayers(), 28);
  EXPECT_EQ(c.LayerHeadDim(4), 512);
  EXPECT_EQ(c.LayerKvHeads(4), 1);  // num_global_key_value_heads null (and no k_eq_v): the global 1
  EXPECT_EQ(c.final_logit_softcapping, 30);
  EXPECT_EQ(c.EmbeddingScale(), 39.25);  // sqrt(1536) = 39.19 in bfloat16
  EXPECT_EQ(c.PerLayerEmbeddingScale(), 16.0);
  // The last 20 layers (15..34) read the last sliding (13) and full (14) layer before them.
  for (int64_t l = 0; l < 15; ++l) EXPECT_EQ(c.KvSourceLayer(l), -1) << l;
  EXPECT_EQ(c.KvSourceLayer(15), 13);
  EXPECT_EQ(c.KvSourceLayer(19), 14);
  EXPECT_EQ(c.KvSourceLayer(34), 14);
  EXPECT_EQ(c.LayerIntermediate(14), 6144);
  EXPECT_EQ(c.LayerIntermediate(15), 12288);  // use_double_wide_mlp: the shared layers'
  EXPECT_EQ(c.gemma4.placeholder_tokens, (std::vector<int64_t>{258880, 258884, 258881}));
  const ModelLayout layout = ModelLayout::Build(c);
  const UnitLayout& l15 = layout.units[16];
  EXPECT_EQ(l15.Find(kKProj), nullptr);
  EXPECT_EQ(l15.Find(kVProj), nullptr);
  EXPECT_EQ(l15.Find(kKNorm), nullptr);
  EXPECT_EQ(l15.Find(kQProj)->shape, (std::vector<int64_t>{8 * 256, 1536}));
  EXPECT_EQ(layout.units[5].Find(kQProj)->shape, (std::vector<int64_t>{8 * 512, 1536}));
  EXPECT_EQ(layout.units[5].Find(kKProj)->shape, (std::vector<int64_t>{512, 1536}));
  EXPECT_EQ(layout.embedding().tensors[1].hf_name, "model.language_model.embed_tokens_per_layer.weight");
  EXPECT_EQ(layout.embedding().tensors[1].shape, (std::vector<int64_t>{262144, 35 * 256}));
  EXPECT_EQ(layout.units[1].Find(kPleModelProj)->hf_name, "model.language_model.per_layer_model_projection.weight");
  EXPECT_EQ(layout.units[1].Find(kPleModelProj)->shape, (std::vector<int64_t>{35 * 256, 1536}));
  EXPECT_EQ(layout.units[2].Find(kPleModelProj), nullptr);
}

TEST(Gemma4Config, PerLayerConfigAndItsOlderSpelling) {
  // per_layer_config wins over global_head_dim (transformers pops it unread); keys zero-padded or not.
  auto c = Small({{"per_layer_config", {{"02", {{"head_dim", 24}}}, {"5", {{"head_dim", 24}}}}},
                  {"layer_types", {"sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                                   "sliding_attention", "full_attention"}}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->LayerHeadDim(2), 24);
  EXPECT_EQ(c->LayerHeadDim(5), 24);
  EXPECT_EQ(c->LayerHeadDim(0), 16);
  // An empty per_layer_config: the full layers keep the global sizes.
  c = Small({{"per_layer_config", nlohmann::json::object()}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->LayerHeadDim(5), 16);
  // num_global_key_value_heads applies under attention_k_eq_v only (Gemma4TextConfig.__post_init__).
  c = Small({{"num_global_key_value_heads", 1}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->LayerKvHeads(5), 2);
  c = Small({{"num_global_key_value_heads", 1}, {"attention_k_eq_v", true}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->LayerKvHeads(5), 1);
  EXPECT_EQ(c->LayerHeadDim(5), 32);
  const ModelLayout layout = ModelLayout::Build(*c);
  EXPECT_EQ(layout.units[6].Find(kVProj), nullptr);  // layer 5: values from k_proj
  EXPECT_NE(layout.units[1].Find(kVProj), nullptr);
  // Refused: full layers of different sizes, a sliding layer's own sizes, another field, a bad index.
  ExpectRefused(Small({{"per_layer_config", {{"05", {{"head_dim", 24}}}}},
                       {"layer_types", {"sliding_attention", "sliding_attention", "full_attention",
                                        "sliding_attention", "sliding_attention", "full_attention"}}}),
                "per_layer_config.5: head_dim 24 and 2 kv heads, but full_attention layer 2 has 16 and 2");
  ExpectRefused(Small({{"per_layer_config", {{"00", {{"head_dim", 24}}}}}}), "per_layer_config.0");
  ExpectRefused(Small({{"per_layer_config", {{"05", {{"intermediate_size", 24}}}}}}),
                "per_layer_config.05.intermediate_size");
  ExpectRefused(Small({{"per_layer_config", {{"6", {{"head_dim", 24}}}}}}), "per_layer_config.6");
}

TEST(Gemma4Config, LayerTypesWindowAndTheForcedFullLastLayer) {
  // Without layer_types: (l + 1) % 6 slides; the last layer is full whatever the list says.
  auto c = Small({{"layer_types", {"sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                   "sliding_attention", "sliding_attention"}}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->IsSlidingLayer(5));
  EXPECT_FALSE(c->IsSlidingLayer(1));
  EXPECT_TRUE(c->IsSlidingLayer(4));
  c = Small({{"num_hidden_layers", 7}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->IsSlidingLayer(5));
  EXPECT_TRUE(c->IsSlidingLayer(0));
  EXPECT_FALSE(c->IsSlidingLayer(6));
  // No sliding layer: no window (and the sliding layers' RoPE object may be left out).
  c = Small({{"layer_types", {"full_attention", "full_attention", "full_attention", "full_attention",
                              "full_attention", "full_attention"}},
             {"rope_parameters", {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 5e5}}}}}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->NumSlidingLayers(), 0);
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_FALSE(c->gemma4.full_rope.proportional);
  EXPECT_EQ(c->rope_theta, 5e5);
  ExpectRefused(Small({{"sliding_window", nullptr}}), "sliding_window");
  ExpectRefused(Small({{"layer_types", {"full_attention"}}}), "layer_types");
}

TEST(Gemma4Config, RoPEs) {
  auto c = Small({{"rope_parameters",
                   {{"full_attention", {{"rope_type", "proportional"}, {"rope_theta", 2e6},
                                        {"partial_rotary_factor", 0.5}, {"factor", 4.0}}},
                    {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 5e4}}}}}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 2e6);
  EXPECT_EQ(c->sliding_rope_theta, 5e4);
  EXPECT_EQ(c->gemma4.full_rope.fraction, 0.5);
  EXPECT_EQ(c->gemma4.full_rope.factor, 4.0);
  const std::vector<float> full = c->RopeInverseFrequencies(AttentionSpan::kFull);
  ASSERT_EQ(full.size(), 16u);  // global_head_dim 32
  EXPECT_EQ(full[0], 0.25f);
  EXPECT_GT(full[7], 0.0f);
  EXPECT_EQ(full[8], 0.0f);
  EXPECT_EQ(c->RopeInverseFrequencies(AttentionSpan::kSliding).size(), 8u);
  ExpectRefused(Small({{"rope_parameters", {{"full_attention", {{"rope_type", "yarn"}, {"rope_theta", 1e6}}},
                                            {"sliding_attention", {{"rope_theta", 1e4}}}}}}),
                "rope_parameters.full_attention.rope_type");
  ExpectRefused(Small({{"rope_parameters", {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 1e6}}}}}}),
                "rope_parameters.sliding_attention");
  ExpectRefused(Small({{"rope_parameters", {{"full_attention", {{"rope_type", "default"}}},
                                            {"sliding_attention", {{"rope_theta", 1e4}}}}}}),
                "rope_parameters.full_attention.rope_theta");
  ExpectRefused(Small({{"rope_parameters", {{"global", {{"rope_theta", 1e4}}}}}}), "rope_parameters.global");
  ExpectRefused(Small({{"rope_theta", 1e4}}), "rope_theta");
  // A job's model.rope_scaling would change neither RoPE: refused.
  ModelConfig tiny = *ModelConfig::Preset("tiny-gemma4");
  EXPECT_FALSE(tiny.OverrideContext(0, R"({"rope_type": "linear", "factor": 2.0})").ok());
}

TEST(Gemma4Config, RefusesWhatItDoesNotBuildByField) {
  ExpectRefused(Small({{"enable_moe_block", true}, {"num_experts", 8}, {"top_k_experts", 2}}), "enable_moe_block");
  ExpectRefused(Small({{"use_bidirectional_attention", "all"}}), "use_bidirectional_attention");
  ExpectRefused(Small({{"hidden_activation", "gelu"}}), "hidden_activation");
  ExpectRefused(Small({{"attention_bias", true}}), "attention_bias");
  ExpectRefused(Small({{"attention_dropout", 0.1}}), "attention_dropout");
  ExpectRefused(Small({{"query_pre_attn_scalar", 256}}), "query_pre_attn_scalar");
  ExpectRefused(Small({{"num_kv_shared_layers", 6}}), "num_kv_shared_layers");
  // Layer 5 (full, shared) has no earlier full layer to read: every earlier one slides.
  ExpectRefused(Small({{"num_kv_shared_layers", 1}}), "num_kv_shared_layers");
  ExpectRefused(Small({{"vocab_size_per_layer_input", 100}}), "vocab_size_per_layer_input");
  ModelConfig sliding_last = *ModelConfig::Preset("tiny-gemma4");  // a config made in code
  sliding_last.layer_spans.back() = AttentionSpan::kSliding;
  sliding_last.gemma4.kv_shared_layers = 0;
  EXPECT_TRUE(absl::StrContains(sliding_last.Validate().message(), "last layer full_attention"))
      << sliding_last.Validate();
  // Accepted and without effect on text: "vision", MoE sizes with the block off, the unread pattern.
  EXPECT_TRUE(Small({{"use_bidirectional_attention", "vision"}}).ok());
  EXPECT_TRUE(Small({{"num_experts", nullptr}, {"top_k_experts", nullptr}, {"moe_intermediate_size", nullptr}}).ok());
  EXPECT_TRUE(Small({{"sliding_window_pattern", 5}}).ok());
  // No per-layer inputs: hidden_size_per_layer_input 0 or null.
  for (const nlohmann::json& none : {nlohmann::json(0), nlohmann::json(nullptr)}) {
    auto c = Small({{"hidden_size_per_layer_input", none}});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->gemma4.ple_dim, 0);
    EXPECT_EQ(ModelLayout::Build(*c).embedding().tensors.size(), 1u);
  }
  // The wrapper: an unknown key, a multimodal model without pad_token_id.
  nlohmann::json j = nlohmann::json::parse(E2bConfig());
  j["mm_tokens_per_image"] = 4;
  ExpectRefused(ModelConfig::FromJson(j.dump()), "mm_tokens_per_image");
  j = nlohmann::json::parse(E2bConfig());
  j["text_config"]["pad_token_id"] = nullptr;
  ExpectRefused(ModelConfig::FromJson(j.dump()), "pad_token_id");
  j = nlohmann::json::parse(E2bConfig());
  j["text_config"]["num_global_heads"] = 2;
  ExpectRefused(ModelConfig::FromJson(j.dump()), "text_config.num_global_heads");
}

// config.json out and back: the same model (per_layer_config and global_head_dim both written), for
// the presets, the released E2B's source, the class defaults, and a source at another depth.
TEST(Gemma4Config, RoundTrips) {
  auto same = [](const ModelConfig& a, const ModelConfig& b) {
    EXPECT_EQ(a.family, b.family);
    EXPECT_EQ(a.multimodal, b.multimodal);
    EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
    for (int64_t l = 0; l < a.num_hidden_layers; ++l) {
      EXPECT_EQ(a.AttentionWindow(l), b.AttentionWindow(l)) << l;
      EXPECT_EQ(a.LayerHeadDim(l), b.LayerHeadDim(l)) << l;
      EXPECT_EQ(a.LayerKvHeads(l), b.LayerKvHeads(l)) << l;
      EXPECT_EQ(a.LayerIntermediate(l), b.LayerIntermediate(l)) << l;
      EXPECT_EQ(a.KvSourceLayer(l), b.KvSourceLayer(l)) << l;
    }
    EXPECT_EQ(a.gemma4.k_eq_v, b.gemma4.k_eq_v);
    EXPECT_EQ(a.gemma4.ple_dim, b.gemma4.ple_dim);
    EXPECT_EQ(a.gemma4.ple_vocab, b.gemma4.ple_vocab);
    EXPECT_EQ(a.RopeInverseFrequencies(AttentionSpan::kFull), b.RopeInverseFrequencies(AttentionSpan::kFull));
    EXPECT_EQ(a.RopeInverseFrequencies(AttentionSpan::kSliding), b.RopeInverseFrequencies(AttentionSpan::kSliding));
    EXPECT_EQ(a.final_logit_softcapping, b.final_logit_softcapping);
    EXPECT_EQ(a.pad_token_id, b.pad_token_id);
    EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
    EXPECT_EQ(a.torch_dtype, b.torch_dtype);
    EXPECT_EQ(ModelLayout::Build(a).param_count(), ModelLayout::Build(b).param_count());
  };
  for (const char* name : {"tiny-gemma4", "gemma4-e2b", "gemma4-e4b", "gemma4-31b"}) {
    const ModelConfig p = *ModelConfig::Preset(name);
    const std::string json = p.ToJson();
    const nlohmann::json j = nlohmann::json::parse(json);
    EXPECT_EQ(j["architectures"][0], "Gemma4ForCausalLM") << name;
    EXPECT_EQ(j["model_type"], "gemma4_text") << name;
    EXPECT_EQ(j["global_head_dim"], 512 - (std::string(name) == "tiny-gemma4" ? 480 : 0)) << name;
    EXPECT_TRUE(j["per_layer_config"].is_object()) << name;
    SCOPED_TRACE(name);
    same(p, Parse(json));
  }
  for (const std::string& source : {E2bConfig(), std::string(kDefaultTextConfig)}) {
    const ModelConfig c = Parse(source);
    same(c, Parse(c.ToJson()));
    ModelConfig shallow = c;  // another depth: the layers' fields written anew
    shallow.num_hidden_layers = 12;
    shallow.layer_spans.resize(12);
    shallow.layer_spans.back() = AttentionSpan::kFull;
    shallow.gemma4.kv_shared_layers = c.gemma4.kv_shared_layers > 0 ? 4 : 0;
    ASSERT_TRUE(shallow.Validate().ok()) << shallow.Validate();
    same(shallow, Parse(shallow.ToJson()));
  }
  // The multimodal wrapper's own fields and towers are written back as read.
  const nlohmann::json back = nlohmann::json::parse(Parse(E2bConfig()).ToJson());
  EXPECT_EQ(back["model_type"], "gemma4");
  EXPECT_EQ(back["audio_config"]["hidden_size"], 1024);
  EXPECT_EQ(back["vision_soft_tokens_per_image"], 280);
  EXPECT_EQ(back["text_config"]["per_layer_config"]["04"]["head_dim"], 512);
}

// A unit's tensors: tiny-gemma4's layers of each kind; layer_scalar a frozen buffer outside the
// parameter count.
TEST(Gemma4Layout, TinyUnits) {
  const ModelConfig c = *ModelConfig::Preset("tiny-gemma4");
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  const ModelLayout layout = ModelLayout::Build(c);
  ASSERT_EQ(layout.num_units(), 8);
  EXPECT_EQ(layout.embedding().tensors.size(), 2u);
  EXPECT_EQ(layout.embedding().tensors[1].shape, (std::vector<int64_t>{512, 6 * 8}));
  EXPECT_EQ(layout.units[1].Find(kPleModelProj)->shape, (std::vector<int64_t>{48, 64}));
  EXPECT_EQ(layout.units[1].Find(kPleModelNorm)->hf_name, "model.per_layer_projection_norm.weight");
  const UnitLayout& full = layout.units[3];  // layer 2: full, k_eq_v, head_dim 32, 1 kv head
  EXPECT_EQ(full.Find(kQProj)->shape, (std::vector<int64_t>{4 * 32, 64}));
  EXPECT_EQ(full.Find(kKProj)->shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(full.Find(kVProj), nullptr);
  EXPECT_EQ(full.Find(kQNorm)->shape, (std::vector<int64_t>{32}));
  EXPECT_EQ(c.KvSourceLayer(4), 3);
  EXPECT_EQ(c.KvSourceLayer(5), 2);
  const UnitLayout& shared = layout.units[6];  // layer 5: full, shared, double-wide
  EXPECT_EQ(shared.Find(kKProj), nullptr);
  EXPECT_EQ(shared.Find(kGateProj)->shape, (std::vector<int64_t>{256, 64}));
  EXPECT_EQ(shared.Find(kPleGate)->shape, (std::vector<int64_t>{8, 64}));
  EXPECT_EQ(shared.Find(kPleProj)->shape, (std::vector<int64_t>{64, 8}));
  const TensorSlot* scalar = shared.Find(kLayerScalar);
  ASSERT_NE(scalar, nullptr);
  EXPECT_EQ(scalar->hf_name, "model.layers.5.layer_scalar");
  EXPECT_FALSE(scalar->trainable);
  EXPECT_GE(scalar->fp32_offset, 0);
  int64_t all = 0;
  for (const UnitLayout& u : layout.units)
    for (const TensorSlot& t : u.tensors) all += t.numel;
  EXPECT_EQ(layout.param_count(), all - c.num_hidden_layers);
}

// The released sizes (google/gemma-4-E2B, -E4B, -31B; docs/model-families.md lists the sources).
TEST(Gemma4Presets, HubShapesAndCounts) {
  struct Want {
    const char* name;
    int64_t hidden, layers, sliding, kv_shared, ple_dim;
  };
  for (const Want& w : {Want{"gemma4-e2b", 1536, 35, 28, 20, 256}, Want{"gemma4-e4b", 2560, 42, 35, 18, 256},
                        Want{"gemma4-31b", 5376, 60, 50, 0, 0}}) {
    const ModelConfig c = *ModelConfig::Preset(w.name);
    ASSERT_TRUE(c.Validate().ok()) << w.name << ": " << c.Validate();
    EXPECT_EQ(c.hidden_size, w.hidden) << w.name;
    EXPECT_EQ(c.num_hidden_layers, w.layers) << w.name;
    EXPECT_EQ(c.NumSlidingLayers(), w.sliding) << w.name;
    EXPECT_EQ(c.gemma4.kv_shared_layers, w.kv_shared) << w.name;
    EXPECT_EQ(c.gemma4.ple_dim, w.ple_dim) << w.name;
    const ModelLayout layout = ModelLayout::Build(c);
    std::printf("%s: %lld parameters\n", w.name, static_cast<long long>(layout.param_count()));
  }
  const ModelConfig b31 = *ModelConfig::Preset("gemma4-31b");
  EXPECT_TRUE(b31.gemma4.k_eq_v);
  EXPECT_EQ(b31.LayerKvHeads(5), 4);
  EXPECT_EQ(b31.LayerKvHeads(0), 16);
  EXPECT_EQ(b31.sliding_window, 1024);
  EXPECT_EQ(b31.max_position_embeddings, 262144);
}

}  // namespace
}  // namespace slidedp
