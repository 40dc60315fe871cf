// gemma3 checkpoints: a multimodal directory as the hub names it (language_model.model.*,
// vision_tower.*, multi_modal_projector.*, a tied language_model.lm_head.weight copy; transformers
// 5.17's save_pretrained writes these names too) loads, its vision tower and projector pass through
// byte for byte into a checkpoint and its export under the names the directory had, which load
// back; a tensor under both spellings and a text-only model with a vision tower are refused; InitRandom
// gives HF's (1 + w) norms at 0 and the padding_idx row at 0.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using safetensors::Dtype;
using namespace slidedp::checkpoint::testing;

std::string TempDir(const char* what) {
  const std::string d = (fs::temp_directory_path() / absl::StrCat(what, ".", ::getpid())).string();
  fs::remove_all(d);
  return d;
}

// The hub's spelling of a name of the layout (transformers 5 saves model.language_model.*).
std::string HubName(const std::string& name) {
  const std::string ours = "model.language_model.";
  return absl::StartsWith(name, ours) ? absl::StrCat("language_model.model.", name.substr(ours.size())) : name;
}

// tiny-gemma3 as a multimodal checkpoint: a Gemma3Config wrapper (a vision_config and the image
// token fields beside text_config), its language model and a few vision tensors, named as the hub's
// files name them. Returns the vision tensors by those names.
std::map<std::string, std::vector<int64_t>> WriteHubGemma3(const std::string& dir, ModelConfig* config) {
  *config = ModelConfig::Preset("tiny-gemma3").value();
  config->multimodal = true;
  config->final_logit_softcapping = 0;  // Gemma3ForConditionalGeneration does not cap
  config->vocab_size = 96;
  const ModelLayout layout = ModelLayout::Build(*config);
  std::vector<FakeTensor> tensors;
  for (const FakeTensor& t : HfTensors(layout, HeadCopy::kOmit)) tensors.push_back({HubName(t.name), t.shape});
  tensors.push_back({"language_model.lm_head.weight", {96, 64}});  // a tied copy, as some hub files hold
  const std::map<std::string, std::vector<int64_t>> vision = {
      {"vision_tower.vision_model.embeddings.patch_embedding.weight", {16, 3, 2, 2}},
      {"vision_tower.vision_model.post_layernorm.bias", {16}},
      {"multi_modal_projector.mm_input_projection_weight", {16, 64}},
      {"multi_modal_projector.mm_soft_emb_norm.weight", {16}}};
  for (const auto& [name, shape] : vision) tensors.push_back({name, shape});
  WriteHfModel(dir, *config, tensors, Dtype::kBF16, Sharding::kSharded);
  nlohmann::json j = nlohmann::json::parse(config->ToJson());
  j["vision_config"] = {{"model_type", "siglip_vision_model"},
                        {"hidden_size", 16},
                        {"image_size", 4},
                        {"patch_size", 2},
                        {"num_hidden_layers", 1},
                        {"vision_use_head", false}};
  j["mm_tokens_per_image"] = 4;
  j["image_token_index"] = 95;
  std::ofstream(dir + "/config.json") << j.dump(2);
  std::map<std::string, std::vector<int64_t>> ours;
  for (const auto& [name, shape] : vision) ours[name] = shape;
  return ours;
}

TEST(Gemma3Checkpoint, HubNamedMultimodalDirectoryLoadsAndKeepsItsVisionTowerByteForByte) {
  const std::string root = TempDir("ckpt_gemma3");
  const std::string src = root + "/model";
  ModelConfig written;
  const auto vision = WriteHubGemma3(src, &written);
  auto config = ModelConfigOfDir(src);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->is_gemma3() && config->multimodal && config->hub_wrapper_names);
  const ModelLayout layout = ModelLayout::Build(*config);
  EXPECT_EQ(layout.embedding().tensors[0].hf_name, "language_model.model.embed_tokens.weight");

  HostState state(layout);
  const PassThrough pass = LoadKeepingPassThrough(src, layout, state);
  ASSERT_FALSE(::testing::Test::HasFailure());
  // The trained tensors: tensor k of the file (its order above) holds KnownValue(k, i).
  const ModelLayout written_layout = ModelLayout::Build(written);
  int k = 0;
  for (const UnitLayout& u : written_layout.units) {
    for (const TensorSlot& t : u.tensors) {
      const float* got = state.master[u.index].data() + t.offset_numel;
      for (int64_t i = 0; i < t.numel; i += 7) ASSERT_EQ(got[i], KnownValue(k, i)) << t.hf_name << "[" << i << "]";
      ++k;
    }
  }
  // The vision tower and projector under the directory's names, bytes as written (BF16 of KnownValue).
  ASSERT_EQ(pass.size(), vision.size());
  for (const PassThroughTensor& p : pass) {
    ASSERT_TRUE(vision.count(p.name)) << p.name;
    EXPECT_EQ(p.shape, vision.at(p.name));
    EXPECT_EQ(p.dtype, Dtype::kBF16);
  }
  auto read = ReadPassThrough(src, *config);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), pass.size());

  // A checkpoint and its export: the directory's names throughout, the vision tensors' bytes, the
  // wrapper's config (vision_config, image tokens) kept; both load back to the same weights.
  const std::vector<std::string> dirs = SaveAndExportKeepingPassThrough(root, layout, state, pass, *config);
  ASSERT_EQ(dirs.size(), 2u);
  for (const std::string& dir : dirs) {
    const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    EXPECT_EQ(cfg["model_type"], "gemma3") << dir;
    EXPECT_EQ(cfg["architectures"][0], "Gemma3ForConditionalGeneration") << dir;
    EXPECT_EQ(cfg["vision_config"]["hidden_size"], 16) << dir;
    EXPECT_EQ(cfg["image_token_index"], 95) << dir;
    auto c = ModelConfigOfDir(dir);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE(c->hub_wrapper_names) << dir;
    HostState back(layout);
    PassThrough unused;
    LoadOptions o;
    o.pass_through = &unused;
    ASSERT_TRUE(LoadHfModel(dir, ModelLayout::Build(*c), back.master_fn(), o).ok()) << dir;
    EXPECT_EQ(back.master, state.master) << dir;
  }
  fs::remove_all(root);
}

TEST(Gemma3Checkpoint, BothSpellingsOfOneTensorAndAVisionTowerWithoutTheWrapperAreRefused) {
  const std::string root = TempDir("ckpt_gemma3_bad");
  ModelConfig config;
  WriteHubGemma3(root + "/both", &config);
  const ModelLayout layout = ModelLayout::Build(*ModelConfigOfDir(root + "/both"));
  // The embedding under both names.
  std::vector<FakeTensor> tensors;
  for (const FakeTensor& t : HfTensors(layout, HeadCopy::kOmit)) tensors.push_back({HubName(t.name), t.shape});
  tensors.push_back({"model.language_model.embed_tokens.weight", {96, 64}});
  WriteHfModel(root + "/both", config, tensors, Dtype::kBF16, Sharding::kSingle);
  HostState state(layout);
  absl::Status s = LoadHfModel(root + "/both", layout, state.master_fn());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "model.language_model.embed_tokens.weight")) << s;
  // gemma3_text (Gemma3ForCausalLM) has no vision tower: one in its directory is not its tensor.
  ModelConfig text = *ModelConfig::Preset("tiny-gemma3");
  text.vocab_size = 96;
  const ModelLayout text_layout = ModelLayout::Build(text);
  std::vector<FakeTensor> text_tensors = HfTensors(text_layout, HeadCopy::kOmit);
  text_tensors.push_back({"model.vision_tower.vision_model.post_layernorm.bias", {16}});
  WriteHfModel(root + "/text", text, text_tensors, Dtype::kBF16, Sharding::kSingle);
  HostState text_state(text_layout);
  s = LoadHfModel(root + "/text", text_layout, text_state.master_fn());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "vision_tower")) << s;
  fs::remove_all(root);
}

TEST(Gemma3Checkpoint, InitRandomIsHfsInitWeights) {
  ModelConfig c = *ModelConfig::Preset("tiny-gemma3");
  const ModelLayout layout = ModelLayout::Build(c);
  HostState a(layout);
  InitRandom(layout, 5, a.master_fn(), 2);
  int norms = 0;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      if (t.hf_name.find("norm.weight") == std::string::npos) continue;
      ++norms;
      for (int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(a.master[u.index][t.offset_numel + i], 0.0f) << t.hf_name;
    }
  }
  EXPECT_EQ(norms, 6 * 6 + 1);  // four per block, q_norm, k_norm; the final norm
  const float* embed = a.master[0].data();
  const int64_t h = c.hidden_size;
  for (int64_t i = 0; i < h; ++i) ASSERT_EQ(embed[i], 0.0f) << "pad_token_id 0's row";
  double sq = 0;
  for (int64_t i = h; i < 2 * h; ++i) sq += double(embed[i]) * embed[i];
  EXPECT_GT(sq, 0) << "the other rows are drawn";
}

}  // namespace
}  // namespace slidedp::checkpoint
