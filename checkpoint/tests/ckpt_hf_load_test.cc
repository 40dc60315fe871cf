// LoadHfModel on generated HF directories (single/sharded, BF16/F16/F32, tied/untied) and its
// errors for broken ones; InitRandom's determinism and distribution.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include "checkpoint/checkpoint.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "gtest/gtest.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using safetensors::Dtype;
using namespace slidedp::checkpoint::testing;

class CkptHfLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("ckpt_hf_load_test." + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Loads into a state pre-filled with garbage and checks every tensor against KnownValue and
  // every padding element against zero.
  void LoadAndCheck(const ModelLayout& layout, const std::vector<FakeTensor>& written) {
    HostState state(layout);
    for (auto& u : state.master) std::fill(u.begin(), u.end(), 12345.0f);
    absl::Status s = LoadHfModel(dir_, layout, state.master_fn(), {.threads = 3});
    ASSERT_TRUE(s.ok()) << s;
    for (const UnitLayout& u : layout.units) {
      std::vector<bool> covered(u.numel, false);
      for (const TensorSlot& t : u.tensors) {
        int k = -1;
        for (size_t i = 0; i < written.size(); ++i)
          if (written[i].name == t.hf_name) k = static_cast<int>(i);
        ASSERT_GE(k, 0);
        for (int64_t i = 0; i < t.numel; ++i) {
          ASSERT_EQ(state.master[u.index][t.offset_numel + i], KnownValue(k, i)) << t.hf_name << "[" << i << "]";
          covered[t.offset_numel + i] = true;
        }
      }
      for (int64_t i = 0; i < u.numel; ++i)
        if (!covered[i]) {
          ASSERT_EQ(state.master[u.index][i], 0.0f) << u.name << " padding " << i;
        }
    }
  }

  absl::Status Load(const ModelLayout& layout) {
    HostState state(layout);
    return LoadHfModel(dir_, layout, state.master_fn());
  }

  std::string dir_;
};

TEST_F(CkptHfLoadTest, LoadsEveryDtypeSingleAndSharded) {
  for (bool tied : {true, false}) {
    const ModelLayout layout = ModelLayout::Build(TinyConfig(tied));
    for (Dtype dtype : {Dtype::kBF16, Dtype::kF16, Dtype::kF32}) {
      for (Sharding sh : {Sharding::kSingle, Sharding::kSharded}) {
        SCOPED_TRACE(absl::StrCat("tied=", tied, " dtype=", safetensors::DtypeName(dtype),
                                  " sharded=", sh == Sharding::kSharded));
        fs::remove_all(dir_);
        auto tensors = HfTensors(layout, HeadCopy::kOmit);
        WriteHfModel(dir_, layout.config, tensors, dtype, sh);
        LoadAndCheck(layout, tensors);
      }
    }
  }
}

TEST_F(CkptHfLoadTest, TensorsLargerThanOneConversionPieceLoadWhole) {
  ModelConfig c = TinyConfig(true);
  c.vocab_size = 65600;  // embedding 65600 x 64 = 4,198,400 elements: two 4 Mi-element pieces
  const ModelLayout layout = ModelLayout::Build(c);
  auto tensors = HfTensors(layout, HeadCopy::kOmit);
  WriteHfModel(dir_, layout.config, tensors, Dtype::kF16, Sharding::kSingle);
  LoadAndCheck(layout, tensors);
}

TEST_F(CkptHfLoadTest, TiedModelAcceptsAnLmHeadCopy) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  auto tensors = HfTensors(layout, HeadCopy::kInclude);
  WriteHfModel(dir_, layout.config, tensors, Dtype::kBF16, Sharding::kSharded);
  LoadAndCheck(layout, tensors);
}

TEST_F(CkptHfLoadTest, MissingExtraAndMisshapedTensorsAreNamed) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  auto tensors = HfTensors(layout, HeadCopy::kOmit);

  auto missing = tensors;
  missing.erase(missing.begin() + 3);
  WriteHfModel(dir_, layout.config, missing, Dtype::kBF16, Sharding::kSingle);
  absl::Status s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(tensors[3].name), std::string::npos) << s;
  EXPECT_NE(s.message().find("missing"), std::string::npos) << s;

  fs::remove_all(dir_);
  auto extra = tensors;
  extra.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {8}});
  WriteHfModel(dir_, layout.config, extra, Dtype::kBF16, Sharding::kSharded);
  s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("rotary_emb.inv_freq"), std::string::npos) << s;

  fs::remove_all(dir_);
  auto misshaped = tensors;
  misshaped[3].shape = {misshaped[3].shape[1], misshaped[3].shape[0]};
  WriteHfModel(dir_, layout.config, misshaped, Dtype::kF32, Sharding::kSingle);
  s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(tensors[3].name), std::string::npos) << s;

  // Untied layout: lm_head.weight is required.
  fs::remove_all(dir_);
  auto no_head = tensors;
  no_head.pop_back();
  ASSERT_EQ(tensors.back().name, "lm_head.weight");
  WriteHfModel(dir_, layout.config, no_head, Dtype::kBF16, Sharding::kSingle);
  s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("lm_head.weight"), std::string::npos) << s;
}

TEST_F(CkptHfLoadTest, ConfigAndDirectoryProblems) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  EXPECT_EQ(Load(layout).code(), absl::StatusCode::kNotFound);  // no directory

  auto tensors = HfTensors(layout, HeadCopy::kOmit);
  WriteHfModel(dir_, layout.config, tensors, Dtype::kBF16, Sharding::kSharded);
  ModelConfig other = layout.config;
  other.hidden_size = 128;
  std::ofstream(dir_ + "/config.json") << other.ToJson();
  absl::Status s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("hidden_size is 128"), std::string::npos) << s;

  std::ofstream(dir_ + "/config.json") << "{not json";
  EXPECT_EQ(Load(layout).code(), absl::StatusCode::kInvalidArgument);
  fs::remove(dir_ + "/config.json");
  EXPECT_EQ(Load(layout).code(), absl::StatusCode::kNotFound);
  std::ofstream(dir_ + "/config.json") << layout.config.ToJson();
  ASSERT_TRUE(Load(layout).ok());

  // A shard the index names is gone.
  fs::remove(dir_ + "/model-00002-of-00003.safetensors");
  s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("model-00002-of-00003"), std::string::npos) << s;

  // The index points a tensor at the wrong shard / at a path outside the directory.
  fs::remove_all(dir_);
  WriteHfModel(dir_, layout.config, tensors, Dtype::kBF16, Sharding::kSharded);
  auto index = nlohmann::json::parse(std::ifstream(dir_ + "/model.safetensors.index.json"));
  index["weight_map"][tensors[0].name] = "model-00002-of-00003.safetensors";
  std::ofstream(dir_ + "/model.safetensors.index.json") << index.dump();
  s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(tensors[0].name), std::string::npos) << s;
  index["weight_map"][tensors[0].name] = "../etc/passwd";
  std::ofstream(dir_ + "/model.safetensors.index.json") << index.dump();
  EXPECT_EQ(Load(layout).code(), absl::StatusCode::kInvalidArgument);

  // No weights at all.
  fs::remove(dir_ + "/model.safetensors.index.json");
  s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
}

TEST_F(CkptHfLoadTest, TruncatedShardAndUnsupportedDtype) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  auto tensors = HfTensors(layout, HeadCopy::kOmit);
  WriteHfModel(dir_, layout.config, tensors, Dtype::kBF16, Sharding::kSingle);
  const std::string f = dir_ + "/model.safetensors";
  fs::resize_file(f, fs::file_size(f) - 100);
  absl::Status s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("model.safetensors"), std::string::npos) << s;

  fs::remove_all(dir_);
  WriteHfModel(dir_, layout.config, tensors, Dtype::kF64, Sharding::kSingle);
  s = Load(layout);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("F64"), std::string::npos) << s;
}

// A NaN or infinite weight is DATA_LOSS naming the file, the tensor and the element: it would
// otherwise train NaN and report success. Found in pieces after the first one too.
TEST_F(CkptHfLoadTest, NonFiniteWeightsAreDataLossNamingTheTensor) {
  ModelConfig c = TinyConfig(false);
  c.vocab_size = 65600;  // the embedding spans two conversion pieces
  const ModelLayout layout = ModelLayout::Build(c);
  auto tensors = HfTensors(layout, HeadCopy::kOmit);
  struct Case {
    Dtype dtype;
    std::string tensor;
    int64_t element;
    float value;
    std::string where;
  };
  const float kInf = std::numeric_limits<float>::infinity();
  for (const Case& k : {Case{Dtype::kBF16, "model.layers.1.mlp.up_proj.weight", 70, std::nanf(""), "[1, 6]"},
                        Case{Dtype::kF32, "model.embed_tokens.weight", (int64_t{1} << 22) + 3, -kInf, "[65536, 3]"},
                        Case{Dtype::kF32, "model.norm.weight", 0, kInf, "[0]"}}) {
    SCOPED_TRACE(k.tensor);
    fs::remove_all(dir_);
    WriteHfModel(dir_, layout.config, tensors, k.dtype, Sharding::kSingle);
    ASSERT_TRUE(Load(layout).ok());
    PatchTensorElement(dir_ + "/model.safetensors", k.tensor, k.element, k.value);
    absl::Status s = Load(layout);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find(dir_ + "/model.safetensors"), std::string::npos) << s;
    EXPECT_NE(s.message().find("\"" + k.tensor + "\" holds"), std::string::npos) << s;
    EXPECT_NE(s.message().find(k.where), std::string::npos) << s;
  }
}

// A node's share of a sharded state (windows): each unit's array holds only its range, with exactly the
// values the whole unit gets (every chunk keeps its own stream, the padding its zeros).
TEST(CkptInitRandomTest, WindowsHoldTheWholeUnitsValues) {
  ModelConfig c = TinyConfig(false);
  c.vocab_size = 3000;  // the embedding spans several RNG chunks
  c.hidden_size = 512;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  const ModelLayout layout = ModelLayout::Build(c);
  HostState whole(layout);
  InitRandom(layout, 42, whole.master_fn(), 2);
  for (int node = 0; node < 3; ++node) {
    std::vector<ShardRange> windows;
    std::vector<std::vector<float>> arrays;
    for (const UnitLayout& u : layout.units) {
      const int64_t span = (u.numel / 3 + 255) / 256 * 256;
      const int64_t begin = std::min(u.numel, span * node), end = std::min(u.numel, span * (node + 1));
      windows.push_back({begin, end - begin});
      arrays.emplace_back(end - begin, std::nanf(""));
    }
    InitRandom(layout, 42, [&](int u) { return arrays[u].data(); }, 3, &windows);
    for (const UnitLayout& u : layout.units) {
      const ShardRange w = windows[u.index];
      ASSERT_EQ(0, std::memcmp(arrays[u.index].data(), whole.master[u.index].data() + w.offset, w.numel * 4))
          << u.name << " node " << node;
    }
  }
}

TEST(CkptInitRandomTest, DeterministicIndependentOfThreadsAndHfDistributed) {
  ModelConfig c = TinyConfig(false);
  c.vocab_size = 3000;  // embedding spans several RNG chunks
  c.hidden_size = 512;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.initializer_range = 0.02;
  const ModelLayout layout = ModelLayout::Build(c);
  HostState a(layout), b(layout), other(layout);
  InitRandom(layout, 42, a.master_fn(), 1);
  InitRandom(layout, 42, b.master_fn(), 7);
  InitRandom(layout, 43, other.master_fn(), 2);
  for (const UnitLayout& u : layout.units) {
    ASSERT_EQ(0, std::memcmp(a.master[u.index].data(), b.master[u.index].data(), u.numel * 4)) << u.name;
    ASSERT_NE(0, std::memcmp(a.master[u.index].data(), other.master[u.index].data(), u.numel * 4)) << u.name;
    for (const TensorSlot& t : u.tensors) {
      const float* p = a.master[u.index].data() + t.offset_numel;
      if (t.hf_name.find("norm") != std::string::npos) {
        for (int64_t i = 0; i < t.numel; ++i) ASSERT_EQ(p[i], 1.0f) << t.hf_name;
        continue;
      }
      double sum = 0, sq = 0;
      for (int64_t i = 0; i < t.numel; ++i) {
        sum += p[i];
        sq += double(p[i]) * p[i];
      }
      const double mean = sum / t.numel, sd = std::sqrt(sq / t.numel - mean * mean);
      // Tolerances: 6 standard errors of the estimates for the smallest tensor here.
      EXPECT_NEAR(mean, 0.0, 6 * 0.02 / std::sqrt(double(t.numel))) << t.hf_name;
      EXPECT_NEAR(sd, 0.02, 6 * 0.02 / std::sqrt(2.0 * t.numel)) << t.hf_name;
    }
  }
  // Same-shaped tensors in different layers get different values.
  const TensorSlot& q = layout.units[1].tensors[kQProj];
  EXPECT_NE(0, std::memcmp(a.master[1].data() + q.offset_numel, a.master[2].data() + q.offset_numel, q.numel * 4));
}

}  // namespace
}  // namespace slidedp::checkpoint

// Qwen3.5 (issue 50): a multimodal qwen3_5_moe directory with transformers 5's fused experts, a
// vision tower and mtp.* weights: the fused tensors load slice by slice, the vision tower and mtp
// weights pass through, and a checkpoint and its export hold every tensor with the same bytes.
namespace slidedp::checkpoint {
namespace {

TEST(Qwen3_5Checkpoint, FusedExpertsAndPassThroughTensorsKeepTheirBytes) {
  const std::string root = (fs::temp_directory_path() / ("ckpt_qwen35." + std::to_string(::getpid()))).string();
  fs::remove_all(root);
  ModelConfig config = ModelConfig::Preset("tiny-qwen3.5-moe").value();
  config.multimodal = true;
  config.expert_storage = ExpertStorage::kFused;
  config.vocab_size = 96;
  const ModelLayout layout = ModelLayout::Build(config);
  // The directory's tensors: each name once with its full shape, then the untrained ones.
  std::vector<FakeTensor> tensors;
  std::set<std::string> seen;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      if (seen.insert(t.hf_name).second) tensors.push_back({t.hf_name, t.is_slice() ? t.hf_shape : t.shape});
    }
  }
  const std::vector<std::string> passing = {"model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.fc.bias",
                                            "mtp.fc.weight", "mtp.layers.0.mlp.experts.gate_up_proj"};
  tensors.push_back({passing[0], {24, 8}});
  tensors.push_back({passing[1], {7}});
  tensors.push_back({passing[2], {64, 128}});
  tensors.push_back({passing[3], {8, 64, 64}});
  const std::string src = root + "/model";
  WriteHfModel(src, config, tensors, Dtype::kBF16, Sharding::kSharded);
  ASSERT_TRUE(ModelConfig::FromFile(src + "/config.json").ok()) << ModelConfig::FromFile(src + "/config.json").status();

  HostState state(layout);
  const PassThrough pass = LoadKeepingPassThrough(src, layout, state);
  ASSERT_FALSE(::testing::Test::HasFailure());
  ASSERT_EQ(pass.size(), passing.size());
  // Expert 3's up_proj is rows [3 x 64 + 32, 3 x 64 + 64) of gate_up_proj.
  int k = -1;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == "model.language_model.layers.1.mlp.experts.gate_up_proj") k = static_cast<int>(i);
  ASSERT_GE(k, 0);
  const UnitLayout& unit = layout.units[2];
  const TensorSlot* up3 = unit.FindExpert(3, kExpertUpProj);
  for (int64_t i = 0; i < up3->numel; i += 97) {
    EXPECT_EQ(state.master[2][up3->offset_numel + i], KnownValue(k, up3->hf_offset_numel + i)) << i;
  }

  // Saved: every tensor of the source directory, byte for byte (BF16 values exact in the master).
  const std::vector<std::string> dirs = SaveAndExportKeepingPassThrough(root, layout, state, pass, config);
  ASSERT_EQ(dirs.size(), 2u);
  for (const std::string& dir : dirs) {
    // The trained tensors come back as the source held them, the fused ones whole.
    HostState back(layout);
    PassThrough unused;
    LoadOptions o;
    o.pass_through = &unused;
    ASSERT_TRUE(LoadHfModel(dir, layout, back.master_fn(), o).ok()) << dir;
    EXPECT_EQ(back.master, state.master) << dir;
    auto c = ModelConfig::FromFile(dir + "/config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE(c->multimodal);
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace slidedp::checkpoint

// Experts fused only in the multi-token-prediction layer (or the vision tower) say nothing of the
// language model's: a per-expert directory with a fused mtp.* tensor stays per expert.
namespace slidedp::checkpoint {
namespace {

TEST(Qwen3_5Checkpoint, FusedExpertsOutsideTheLanguageModelDoNotDecideItsLayout) {
  const std::string dir = (fs::temp_directory_path() / ("ckpt_qwen35_mtp." + std::to_string(::getpid()))).string();
  fs::remove_all(dir);
  ModelConfig config = ModelConfig::Preset("tiny-qwen3.5-moe").value();
  config.vocab_size = 96;
  const ModelLayout layout = ModelLayout::Build(config);  // per expert
  std::vector<FakeTensor> tensors = HfTensors(layout, HeadCopy::kOmit);
  tensors.push_back({"mtp.layers.0.mlp.experts.gate_up_proj", {8, 64, 64}});
  WriteHfModel(dir, config, tensors, Dtype::kBF16, Sharding::kSingle);
  auto c = ModelConfigOfDir(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->expert_storage, ExpertStorage::kPerExpert);
  HostState state(layout);
  PassThrough pass;
  LoadOptions o;
  o.pass_through = &pass;
  const absl::Status s = LoadHfModel(dir, ModelLayout::Build(*c), state.master_fn(), o);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(pass.size(), 1u);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::checkpoint
