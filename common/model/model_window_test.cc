// Sliding-window attention in ModelConfig (model_config_window.cc): which layers slide and how far,
// as transformers 5.17 applies each family's config.json fields; refusals by field; the fields
// written back (ToJson) read again as the same windows; the windows in the unit layout.
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp {
namespace {

// A config of `layers` layers of the given model_type, `extra` appended to its fields.
absl::StatusOr<ModelConfig> Config(const std::string& type, int layers, const std::string& extra) {
  return ModelConfig::FromJson(R"({"model_type":")" + type + R"(","hidden_size":64,"num_hidden_layers":)" +
                               std::to_string(layers) +
                               R"(,"num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":96,)"
                               R"("vocab_size":100)" +
                               extra + "}");
}

// Each layer's window (0: full attention).
std::vector<int64_t> Windows(const ModelConfig& c) {
  std::vector<int64_t> w;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) w.push_back(c.AttentionWindow(l));
  return w;
}

std::vector<int64_t> WindowsOf(const absl::StatusOr<ModelConfig>& c) {
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? Windows(*c) : std::vector<int64_t>{-1};
}

void ExpectRefused(const absl::StatusOr<ModelConfig>& c, const std::string& field) {
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
}

using W = std::vector<int64_t>;

// MistralConfig: sliding_window defaults to 4096; null turns it off; it slides every layer.
TEST(SlidingWindowConfig, MistralSlidesEveryLayerByItsWindow) {
  const auto m = Config("mistral", 3, R"(,"sliding_window":4096)");
  EXPECT_EQ(WindowsOf(m), (W{4096, 4096, 4096}));
  EXPECT_EQ(m->sliding_window, 4096);
  EXPECT_EQ(m->NumSlidingLayers(), 3);
  EXPECT_TRUE(m->SlidingWindowCovers(4096));
  EXPECT_FALSE(m->SlidingWindowCovers(4097));
  EXPECT_EQ(WindowsOf(Config("mistral", 2, "")), (W{4096, 4096})) << "absent: HF's default";
  const auto none = Config("mistral", 2, R"(,"sliding_window":null)");
  EXPECT_EQ(WindowsOf(none), (W{0, 0}));
  EXPECT_EQ(none->sliding_window, 0);
  EXPECT_TRUE(none->layer_spans.empty());
  EXPECT_TRUE(none->SlidingWindowCovers(1 << 20));
  for (const char* bad : {"-3", "0", "\"16\"", "1.5"}) {
    ExpectRefused(Config("mistral", 2, std::string(R"(,"sliding_window":)") + bad), "sliding_window");
  }
  // MistralForCausalLM does not read layer_types: a list that agrees passes, one that does not is
  // another model (ministral's alternation), refused.
  EXPECT_EQ(
      WindowsOf(Config("mistral", 2, R"(,"sliding_window":8,"layer_types":["sliding_attention","sliding_attention"])")),
      (W{8, 8}));
  EXPECT_EQ(
      WindowsOf(Config("mistral", 2, R"(,"sliding_window":null,"layer_types":["full_attention","full_attention"])")),
      (W{0, 0}));
  ExpectRefused(Config("mistral", 2, R"(,"sliding_window":8,"layer_types":["full_attention","sliding_attention"])"),
                "layer_types");
  ExpectRefused(
      Config("mistral", 2, R"(,"sliding_window":null,"layer_types":["sliding_attention","sliding_attention"])"),
      "layer_types");
}

// Qwen2Config / Qwen3Config: the window only under use_sliding_window; the layers at or past
// max_window_layers (default 28) slide, or layer_types' sliding_attention entries.
TEST(SlidingWindowConfig, QwenSlidesFromMaxWindowLayersOrByLayerTypes) {
  for (const char* type : {"qwen2", "qwen3"}) {
    SCOPED_TRACE(type);
    EXPECT_EQ(WindowsOf(Config(type, 3, R"(,"sliding_window":32768,"use_sliding_window":false)")), (W{0, 0, 0}));
    EXPECT_EQ(WindowsOf(Config(type, 3, R"(,"sliding_window":512,"max_window_layers":1)")), (W{0, 0, 0}))
        << "use_sliding_window absent: off";
    EXPECT_EQ(WindowsOf(Config(type, 3, R"(,"use_sliding_window":true,"sliding_window":512)")), (W{0, 0, 0}))
        << "max_window_layers 28 by default: no layer of 3 reaches it";
    EXPECT_EQ(WindowsOf(Config(type, 30, R"(,"use_sliding_window":true,"sliding_window":512)"))[28], 512);
    EXPECT_EQ(WindowsOf(Config(type, 30, R"(,"use_sliding_window":true,"sliding_window":512)"))[27], 0);
    EXPECT_EQ(WindowsOf(Config(type, 3, R"(,"use_sliding_window":true,"sliding_window":512,"max_window_layers":1)")),
              (W{0, 512, 512}));
    EXPECT_EQ(WindowsOf(Config(type, 2, R"(,"use_sliding_window":true,"max_window_layers":0)")), (W{4096, 4096}))
        << "sliding_window absent: HF's default 4096";
    EXPECT_EQ(WindowsOf(Config(type, 2, R"(,"use_sliding_window":true,"sliding_window":null,"max_window_layers":0)")),
              (W{0, 0}));
    // layer_types decides where given (max_window_layers is then not read).
    EXPECT_EQ(WindowsOf(Config(type, 3,
                               R"(,"use_sliding_window":true,"sliding_window":6,"max_window_layers":0,)"
                               R"("layer_types":["sliding_attention","full_attention","sliding_attention"])")),
              (W{6, 0, 6}));
    EXPECT_EQ(WindowsOf(Config(type, 2,
                               R"(,"use_sliding_window":true,"sliding_window":6,)"
                               R"("layer_types":["full_attention","full_attention"])")),
              (W{0, 0}));
    // A sliding layer without a window: HF's forward fails ("Could not find a sliding_window").
    ExpectRefused(Config(type, 2, R"(,"sliding_window":512,"layer_types":["full_attention","sliding_attention"])"),
                  "layer_types");
    ExpectRefused(Config(type, 2,
                         R"(,"use_sliding_window":true,"sliding_window":null,)"
                         R"("layer_types":["full_attention","sliding_attention"])"),
                  "sliding_window is null");
    ExpectRefused(Config(type, 2, R"(,"use_sliding_window":true,"layer_types":["full_attention"])"), "layer_types");
    ExpectRefused(Config(type, 2, R"(,"layer_types":["full_attention","chunked_attention"])"), "layer_types");
    ExpectRefused(Config(type, 2, R"(,"layer_types":"sliding_attention")"), "layer_types");
    ExpectRefused(Config(type, 2, R"(,"use_sliding_window":"yes")"), "use_sliding_window");
    ExpectRefused(Config(type, 2, R"(,"use_sliding_window":true,"max_window_layers":"1")"), "max_window_layers");
    ExpectRefused(Config(type, 2, R"(,"use_sliding_window":true,"sliding_window":0,"max_window_layers":0)"),
                  "sliding_window");
  }
}

// Qwen3MoeConfig has no layer_types or max_window_layers: use_sliding_window slides every layer;
// LlamaConfig has no window at all.
TEST(SlidingWindowConfig, Qwen3MoeSlidesEveryLayerAndLlamaNone) {
  const std::string moe = R"(,"num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":32)";
  EXPECT_EQ(WindowsOf(Config("qwen3_moe", 2, moe + R"(,"use_sliding_window":true,"sliding_window":64)")), (W{64, 64}));
  EXPECT_EQ(WindowsOf(Config("qwen3_moe", 2, moe + R"(,"use_sliding_window":true)")), (W{4096, 4096}));
  EXPECT_EQ(WindowsOf(Config("qwen3_moe", 2, moe + R"(,"use_sliding_window":true,"sliding_window":null)")), (W{0, 0}));
  EXPECT_EQ(WindowsOf(Config("qwen3_moe", 2, moe + R"(,"sliding_window":64)")), (W{0, 0}));
  ExpectRefused(Config("qwen3_moe", 2,
                       moe + R"(,"use_sliding_window":true,"sliding_window":64,)"
                             R"("layer_types":["full_attention","sliding_attention"])"),
                "layer_types");
  EXPECT_EQ(WindowsOf(Config("llama", 2, R"(,"sliding_window":64,"use_sliding_window":true)")), (W{0, 0}));
  ExpectRefused(Config("llama", 2, R"(,"layer_types":["sliding_attention","full_attention"])"), "layer_types");
}

// What ModelConfig::Validate holds a config built in code to: what config.json can say.
TEST(SlidingWindowConfig, ValidateRefusesWhatConfigJsonCannotSay) {
  ModelConfig c = *ModelConfig::Preset("tiny-mistral-window");
  ASSERT_TRUE(c.Validate().ok()) << c.Validate();
  ModelConfig partial = c;
  partial.layer_spans[0] = AttentionSpan::kFull;
  EXPECT_FALSE(partial.Validate().ok()) << "mistral slides every layer or none";
  ModelConfig no_window = c;
  no_window.sliding_window = 0;
  EXPECT_FALSE(no_window.Validate().ok());
  ModelConfig no_layers = c;
  no_layers.layer_spans.clear();
  EXPECT_FALSE(no_layers.Validate().ok()) << "a window no layer uses";
  ModelConfig short_list = c;
  short_list.layer_spans.pop_back();
  EXPECT_FALSE(short_list.Validate().ok());
  ModelConfig llama = *ModelConfig::Preset("tiny-llama");
  llama.sliding_window = 8;
  llama.layer_spans.assign(llama.num_hidden_layers, AttentionSpan::kSliding);
  EXPECT_FALSE(llama.Validate().ok());
  ModelConfig qwen = *ModelConfig::Preset("tiny-qwen2");
  qwen.sliding_window = 8;
  qwen.layer_spans = {AttentionSpan::kSliding, AttentionSpan::kFull};
  EXPECT_TRUE(qwen.Validate().ok()) << qwen.Validate();
}

// Written back, the windows read again as they were: a preset's, a config changed in code, and a
// source config.json's own fields, kept as they were.
TEST(SlidingWindowConfig, ToJsonReadsBackAsTheSameWindows) {
  const ModelConfig mistral = *ModelConfig::Preset("tiny-mistral-window");
  EXPECT_EQ(Windows(mistral), (W{16, 16}));
  nlohmann::json saved = nlohmann::json::parse(mistral.ToJson());
  EXPECT_EQ(saved["sliding_window"], 16);
  EXPECT_EQ(WindowsOf(ModelConfig::FromJson(mistral.ToJson())), (W{16, 16}));
  saved = nlohmann::json::parse(ModelConfig::Preset("tiny-mistral")->ToJson());
  EXPECT_TRUE(saved["sliding_window"].is_null());
  EXPECT_EQ(WindowsOf(ModelConfig::FromJson(saved.dump())), (W{0, 0}));

  for (const std::vector<AttentionSpan>& spans :
       {std::vector<AttentionSpan>{AttentionSpan::kFull, AttentionSpan::kSliding, AttentionSpan::kSliding},
        std::vector<AttentionSpan>{AttentionSpan::kSliding, AttentionSpan::kFull, AttentionSpan::kSliding}}) {
    for (const char* preset : {"tiny-qwen2", "tiny"}) {
      ModelConfig q = *ModelConfig::Preset(preset);
      q.num_hidden_layers = 3;
      q.sliding_window = 5;
      q.layer_spans = spans;
      ASSERT_TRUE(q.Validate().ok()) << q.Validate();
      const nlohmann::json j = nlohmann::json::parse(q.ToJson());
      EXPECT_EQ(j["use_sliding_window"], true);
      EXPECT_EQ(j["sliding_window"], 5);
      EXPECT_EQ(j["layer_types"].size(), 3u);
      // transformers 4.x's max_window_layers where it can say the same (the sliding layers a suffix).
      EXPECT_EQ(j.contains("max_window_layers"), spans[0] == AttentionSpan::kFull) << j.dump();
      if (j.contains("max_window_layers")) {
        EXPECT_EQ(j["max_window_layers"], 1);
      }
      EXPECT_EQ(WindowsOf(ModelConfig::FromJson(j.dump())), Windows(q)) << preset;
    }
  }

  // A source config (Qwen2.5's: a window it does not use) is written with its own fields.
  const auto src = Config("qwen2", 2, R"(,"use_sliding_window":false,"sliding_window":32768,"max_window_layers":21)");
  ASSERT_TRUE(src.ok()) << src.status();
  nlohmann::json kept = nlohmann::json::parse(src->ToJson());
  EXPECT_EQ(kept["sliding_window"], 32768);
  EXPECT_EQ(kept["use_sliding_window"], false);
  EXPECT_EQ(kept["max_window_layers"], 21);
  EXPECT_FALSE(kept.contains("layer_types"));
  // Changed after parsing, the source's fields are rewritten to say the new windows.
  ModelConfig changed = *src;
  changed.sliding_window = 7;
  changed.layer_spans = {AttentionSpan::kFull, AttentionSpan::kSliding};
  EXPECT_EQ(WindowsOf(ModelConfig::FromJson(changed.ToJson())), (W{0, 7}));
  const auto mixed = Config("qwen3", 2,
                            R"(,"use_sliding_window":true,"sliding_window":9,)"
                            R"("layer_types":["sliding_attention","full_attention"])");
  EXPECT_EQ(WindowsOf(ModelConfig::FromJson(mixed->ToJson())), (W{9, 0}));
  EXPECT_EQ(nlohmann::json::parse(mixed->ToJson())["layer_types"][0], "sliding_attention");
}

// Each decoder unit carries its layer's window; the other units none.
TEST(SlidingWindowConfig, UnitLayoutCarriesEachLayersWindow) {
  ModelConfig q = *ModelConfig::Preset("tiny-qwen2");
  q.sliding_window = 3;
  q.layer_spans = {AttentionSpan::kSliding, AttentionSpan::kFull};
  const ModelLayout layout = ModelLayout::Build(q);
  ASSERT_EQ(layout.num_units(), 4);
  EXPECT_EQ(layout.units[0].attention_window, 0);
  EXPECT_EQ(layout.units[1].attention_window, 3);
  EXPECT_EQ(layout.units[2].attention_window, 0);
  EXPECT_EQ(layout.units[3].attention_window, 0);
}

// Model FLOPs count a sliding layer's attention as run: the band's area over the row, W - W^2 / (2 S)
// keys per query on average against a full layer's S / 2; a window covering the row is full.
TEST(SlidingWindowConfig, ModelFlopsCountTheBand) {
  ModelConfig q = *ModelConfig::Preset("tiny-qwen2");
  const double full = ModelLayout::Build(q).ModelFlopsPerToken(1024);
  const double per_key = 12.0 * static_cast<double>(q.q_dim());
  q.sliding_window = 256;
  q.layer_spans = {AttentionSpan::kSliding, AttentionSpan::kFull};
  const double band = 256.0 - 256.0 * 256.0 / (2.0 * 1024.0);
  EXPECT_DOUBLE_EQ(ModelLayout::Build(q).ModelFlopsPerToken(1024), full - per_key * (512.0 - band));
  // A window covering the row is full attention.
  EXPECT_DOUBLE_EQ(ModelLayout::Build(q).ModelFlopsPerToken(256),
                   ModelLayout::Build(*ModelConfig::Preset("tiny-qwen2")).ModelFlopsPerToken(256));
}

}  // namespace
}  // namespace slidedp
