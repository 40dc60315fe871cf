// Checkpoints as complete HF model directories: the model's tokenizer files and
// generation_config.json read with hostile-input care (regular files, bounded, links only inside
// the directory or a hub cache's blobs) and copied into every checkpoint, crash-safe like the rest;
// ExportModel writing the model directory without the optimizer state (dtype, sharding, atomic
// replace, refusals).
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "gtest/gtest.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace slidedp::checkpoint::testing;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::set<std::string> Names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

void FillMaster(const ModelLayout& layout, HostState& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (const UnitLayout& u : layout.units) {
    for (int64_t i = 0; i < u.numel; ++i) s.master[u.index][i] = n(rng);
  }
}

class CkptModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = (fs::temp_directory_path() / ("ckpt_model_dir_test." + std::to_string(::getpid()))).string();
    fs::remove_all(root_);
    fs::create_directories(root_ + "/model");
    std::ofstream(root_ + "/model/tokenizer.json") << R"({"version": "1.0", "model": {"type": "BPE"}})";
    std::ofstream(root_ + "/model/tokenizer_config.json") << R"({"eos_token": "<|im_end|>"})";
    std::ofstream(root_ + "/model/chat_template.jinja") << "{% for m in messages %}{{ m.content }}{% endfor %}";
    std::ofstream(root_ + "/model/generation_config.json") << R"({"eos_token_id": [151645, 151643], "top_p": 0.8})";
  }
  void TearDown() override { fs::remove_all(root_); }

  SaveRequest Request(const ModelLayout& layout, HostState& state, int64_t step, const std::string& root) {
    SaveRequest r;
    r.root_dir = root;
    r.step = step;
    r.layout = &layout;
    r.arrays = state.arrays();
    r.trainer_state = {{"job_id", "j-1"}};
    return r;
  }

  std::string root_;
};

TEST_F(CkptModelDirTest, ReadsTheFilesThereAndFollowsOnlyLinksThatStayInside) {
  const std::string dir = root_ + "/model";
  fs::create_symlink("tokenizer_config.json", dir + "/special_tokens_map.json");  // inside: followed
  fs::create_symlink("nothing-there", dir + "/added_tokens.json");                // dangling: absent
  auto files = ReadModelDirFiles(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  std::vector<std::string> names;
  for (const ModelDirFile& f : *files) names.push_back(f.name);
  EXPECT_EQ(names, (std::vector<std::string>{"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                             "chat_template.jinja", "generation_config.json"}));
  EXPECT_EQ((*files)[2].content, ReadAll(dir + "/tokenizer_config.json"));

  // Hostile: a link out of the directory, a FIFO, a device, a directory, a file over the cap.
  std::ofstream(root_ + "/secret") << "not a tokenizer";
  struct Case {
    std::function<void(const std::string&)> make;
    std::string says;
  };
  const std::vector<Case> cases = {
      {[&](const std::string& p) { fs::create_symlink(root_ + "/secret", p); }, "outside the model directory"},
      {[&](const std::string& p) { fs::create_symlink("../secret", p); }, "outside the model directory"},
      {[](const std::string& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0); }, "is not a regular file"},
      {[](const std::string& p) { fs::create_symlink("/dev/zero", p); }, "outside the model directory"},
      {[](const std::string& p) { fs::create_directory(p); }, "is not a regular file"},
      {[](const std::string& p) {
         std::ofstream(p).close();
         fs::resize_file(p, kMaxModelDirFileBytes + 1);
       },
       "may have 67108864 bytes each"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.says);
    const std::string p = dir + "/merges.txt";
    fs::remove_all(p);
    c.make(p);
    auto bad = ReadModelDirFiles(dir);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
    EXPECT_TRUE(absl::StrContains(bad.status().message(), p)) << bad.status();
    EXPECT_TRUE(absl::StrContains(bad.status().message(), c.says)) << bad.status();
    fs::remove_all(p);
  }
  EXPECT_EQ(ReadModelDirFiles(root_ + "/no-such-dir").status().code(), absl::StatusCode::kNotFound);

  // A hub cache snapshot: its files are links to ../../blobs/<hash>, which are followed.
  const std::string repo = root_ + "/hub/models--org--tiny";
  fs::create_directories(repo + "/blobs");
  fs::create_directories(repo + "/snapshots/abc123");
  std::ofstream(repo + "/blobs/0f1e2d") << R"({"version": "1.0"})";
  fs::create_symlink("../../blobs/0f1e2d", repo + "/snapshots/abc123/tokenizer.json");
  auto hub = ReadModelDirFiles(repo + "/snapshots/abc123");
  ASSERT_TRUE(hub.ok()) << hub.status();
  ASSERT_EQ(hub->size(), 1u);
  EXPECT_EQ((*hub)[0].content, R"({"version": "1.0"})");
}

// generation_config.json when the model has none: the config's token ids, as transformers'
// GenerationConfig.from_model_config takes them.
TEST_F(CkptModelDirTest, GenerationConfigFromTheConfigsTokenIds) {
  auto g = nlohmann::json::parse(GenerationConfigFromConfig(
      R"({"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": null, "hidden_size": 8})"));
  EXPECT_EQ(g, nlohmann::json({{"_from_model_config", true}, {"bos_token_id", 1}, {"eos_token_id", {2, 3}}}));
  EXPECT_EQ(nlohmann::json::parse(GenerationConfigFromConfig("not json")),
            nlohmann::json({{"_from_model_config", true}}));
}

TEST_F(CkptModelDirTest, CheckpointsHoldTheModelFilesAndAGenerationConfig) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState s(layout);
  FillMaster(layout, s, 1);
  auto files = ReadModelDirFiles(root_ + "/model");
  ASSERT_TRUE(files.ok()) << files.status();
  SaveRequest req = Request(layout, s, 4, root_ + "/out");
  req.model_files = &*files;
  auto saved = SaveCheckpoint(req);
  ASSERT_TRUE(saved.ok()) << saved.status();
  for (const char* name :
       {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}) {
    EXPECT_EQ(ReadAll(saved->dir + "/" + name), ReadAll(root_ + "/model/" + name)) << name;
  }
  // Listed in COMPLETE: a damaged copy makes the checkpoint incomplete, as any of its files.
  auto complete = nlohmann::json::parse(ReadAll(saved->dir + "/COMPLETE"));
  EXPECT_TRUE(complete["files"].contains("tokenizer.json"));
  EXPECT_TRUE(VerifyCheckpoint(saved->dir).ok());
  fs::resize_file(saved->dir + "/tokenizer.json", 3);
  EXPECT_EQ(VerifyCheckpoint(saved->dir).status().code(), absl::StatusCode::kDataLoss);

  // A preset (no model files): generation_config.json from the checkpoint's config.json.
  auto preset = SaveCheckpoint(Request(layout, s, 5, root_ + "/preset"));
  ASSERT_TRUE(preset.ok()) << preset.status();
  EXPECT_EQ(Names(preset->dir),
            (std::set<std::string>{"COMPLETE", "config.json", "generation_config.json", "model.safetensors",
                                   "optimizer.safetensors", "trainer_state.json"}));
  const auto config = nlohmann::json::parse(ReadAll(preset->dir + "/config.json"));
  const auto generation = nlohmann::json::parse(ReadAll(preset->dir + "/generation_config.json"));
  EXPECT_EQ(generation["_from_model_config"], true);
  for (const char* key : {"bos_token_id", "eos_token_id"}) {
    if (config.contains(key)) {
      EXPECT_EQ(generation[key], config[key]) << key;
    }
  }
}

// A crash while the model files are written leaves the previous checkpoint the latest.
TEST_F(CkptModelDirTest, CrashWhileCopyingModelFilesLeavesThePreviousCheckpoint) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState s(layout);
  auto files = ReadModelDirFiles(root_ + "/model");
  ASSERT_TRUE(files.ok());
  SaveRequest first = Request(layout, s, 1, root_ + "/out");
  first.model_files = &*files;
  ASSERT_TRUE(SaveCheckpoint(first).ok());
  SaveRequest second = Request(layout, s, 2, root_ + "/out");
  second.model_files = &*files;
  second.fault_hook = [](const std::string& at) {
    return at == "model_files" ? absl::ResourceExhaustedError("injected: no space left") : absl::OkStatus();
  };
  EXPECT_EQ(SaveCheckpoint(second).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*FindLatestCheckpoint(root_ + "/out"), root_ + "/out/checkpoint-1");
  EXPECT_EQ(Names(root_ + "/out"), (std::set<std::string>{"checkpoint-1"}));
}

// Export: the model directory only (no optimizer state), its weights those of the checkpoint (the
// same BF16 bytes as its model.safetensors; F32 = the master exactly), sharded with an index
// above the cap; the tokenizer files and generation_config.json come along.
TEST_F(CkptModelDirTest, ExportWritesTheModelDirectory) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState s(layout);
  FillMaster(layout, s, 2);
  auto files = ReadModelDirFiles(root_ + "/model");
  ASSERT_TRUE(files.ok());
  SaveRequest req = Request(layout, s, 7, root_ + "/out");
  req.model_files = &*files;
  ASSERT_TRUE(SaveCheckpoint(req).ok());
  const std::string ckpt = root_ + "/out/checkpoint-7";

  ExportRequest bf16;
  bf16.checkpoint = root_ + "/out";  // a directory of checkpoints: its newest
  bf16.out_dir = root_ + "/exported";
  auto res = ExportModel(bf16);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->checkpoint, ckpt);
  EXPECT_EQ(res->step, 7);
  EXPECT_EQ(res->dtype, Dtype::kBF16);
  EXPECT_FALSE(res->replaced);
  const std::set<std::string> want = {"config.json",           "model.safetensors",   "tokenizer.json",
                                      "tokenizer_config.json", "chat_template.jinja", "generation_config.json"};
  EXPECT_EQ(Names(bf16.out_dir), want);
  EXPECT_EQ(std::set<std::string>(res->files.begin(), res->files.end()), want);
  EXPECT_EQ(ReadAll(bf16.out_dir + "/model.safetensors"), ReadAll(ckpt + "/model.safetensors"));
  EXPECT_EQ(ReadAll(bf16.out_dir + "/config.json"), ReadAll(ckpt + "/config.json"));
  EXPECT_EQ(ReadAll(bf16.out_dir + "/tokenizer.json"), ReadAll(root_ + "/model/tokenizer.json"));
  for (const auto& e : fs::directory_iterator(root_)) {
    EXPECT_FALSE(absl::StartsWith(e.path().filename().string(), ".tmp-export")) << e.path();
  }

  ExportRequest f32 = bf16;
  f32.checkpoint = ckpt;
  f32.out_dir = root_ + "/exported-f32";
  f32.dtype = Dtype::kF32;
  f32.shard_max_bytes = 30000;
  res = ExportModel(f32);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_FALSE(fs::exists(f32.out_dir + "/model.safetensors"));
  const auto index = nlohmann::json::parse(ReadAll(f32.out_dir + "/model.safetensors.index.json"));
  std::set<std::string> shards;
  for (auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_GE(shards.size(), 3u);
  for (const std::string& shard : shards) EXPECT_TRUE(fs::exists(f32.out_dir + "/" + shard)) << shard;
  HostState loaded(layout);
  ASSERT_TRUE(LoadHfModel(f32.out_dir, layout, loaded.master_fn()).ok());
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      ASSERT_EQ(0,
                std::memcmp(&s.master[u.index][t.offset_numel], &loaded.master[u.index][t.offset_numel], t.numel * 4))
          << t.hf_name;
    }
  }
  EXPECT_EQ(ModelConfig::FromFile(f32.out_dir + "/config.json")->torch_dtype, "float32");
}

TEST_F(CkptModelDirTest, ExportRefusesOrReplacesAnExistingDirectory) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState a(layout), b(layout);
  FillMaster(layout, a, 3);
  FillMaster(layout, b, 4);
  ASSERT_TRUE(SaveCheckpoint(Request(layout, a, 1, root_ + "/out")).ok());
  ASSERT_TRUE(SaveCheckpoint(Request(layout, b, 2, root_ + "/out")).ok());
  ExportRequest req;
  req.checkpoint = root_ + "/out/checkpoint-1";
  req.out_dir = root_ + "/exported";
  fs::create_directories(req.out_dir);  // an empty directory is taken
  ASSERT_TRUE(ExportModel(req).ok());
  const std::string first = ReadAll(req.out_dir + "/model.safetensors");

  req.checkpoint = root_ + "/out/checkpoint-2";
  auto refused = ExportModel(req);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "--force")) << refused.status();
  EXPECT_EQ(ReadAll(req.out_dir + "/model.safetensors"), first);

  req.existing = ExportRequest::Existing::kReplace;
  auto replaced = ExportModel(req);
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  EXPECT_TRUE(replaced->replaced);
  EXPECT_EQ(ReadAll(req.out_dir + "/model.safetensors"), ReadAll(root_ + "/out/checkpoint-2/model.safetensors"));
  EXPECT_NE(ReadAll(req.out_dir + "/model.safetensors"), first);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(root_)) left.insert(e.path().filename().string());
  EXPECT_EQ(left, (std::set<std::string>{"exported", "model", "out"}));

  // Never replaced: a directory that is no model directory, a file, the checkpoint itself or a
  // directory holding it.
  fs::create_directories(root_ + "/notes");
  std::ofstream(root_ + "/notes/todo.txt") << "x";
  std::ofstream(root_ + "/file") << "x";
  for (const std::string& to : {root_ + "/notes", root_ + "/file", root_ + "/out/checkpoint-2"}) {
    req.out_dir = to;
    auto never = ExportModel(req);
    EXPECT_EQ(never.status().code(), absl::StatusCode::kFailedPrecondition) << to << ": " << never.status();
  }
  EXPECT_TRUE(VerifyCheckpoint(root_ + "/out/checkpoint-2").ok());
  EXPECT_EQ(ReadAll(root_ + "/notes/todo.txt"), "x");
}

TEST_F(CkptModelDirTest, ExportRefusesADamagedCheckpoint) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState s(layout);
  FillMaster(layout, s, 5);
  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 3, root_ + "/out")).ok());
  const std::string ckpt = root_ + "/out/checkpoint-3";
  ExportRequest req;
  req.checkpoint = ckpt;
  req.out_dir = root_ + "/exported";
  PatchTensorElement(ckpt + "/optimizer.safetensors", "unit.layer.0.master", 300, std::nanf(""));
  auto nan = ExportModel(req);
  EXPECT_EQ(nan.status().code(), absl::StatusCode::kDataLoss) << nan.status();
  EXPECT_TRUE(absl::StrContains(nan.status().message(), "unit.layer.0.master")) << nan.status();
  EXPECT_FALSE(fs::exists(req.out_dir));
  fs::remove(ckpt + "/COMPLETE");
  EXPECT_EQ(ExportModel(req).status().code(), absl::StatusCode::kFailedPrecondition);
  req.checkpoint = root_ + "/nowhere";
  EXPECT_EQ(ExportModel(req).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace slidedp::checkpoint
