// SaveCheckpoint / FindLatestCheckpoint / LoadCheckpoint: exact round trip, HF-loadable weights,
// sharding, retention, crashes at every stage of a save, failed saves, corrupted checkpoints.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "checkpoint/checkpoint.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "gtest/gtest.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace slidedp::checkpoint::testing;

// Fills master/m/v with awkward values: normals of several scales, subnormals, -0, and padding
// garbage, so a round trip that is not bit-exact shows.
void FillState(const ModelLayout& layout, HostState& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (const UnitLayout& u : layout.units) {
    for (int64_t i = 0; i < u.numel; ++i) {
      s.master[u.index][i] = n(rng) * 0.05f;
      s.m[u.index][i] = n(rng) * 1e-4f;
      s.v[u.index][i] = std::fabs(n(rng)) * 1e-9f;
    }
    s.m[u.index][0] = -0.0f;
    s.v[u.index][1] = 1e-42f;  // subnormal
  }
}

class CkptSaveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = (fs::temp_directory_path() / ("ckpt_save_test." + std::to_string(::getpid()))).string();
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  SaveRequest Request(const ModelLayout& layout, HostState& state, int64_t step) {
    SaveRequest r;
    r.root_dir = root_;
    r.step = step;
    r.layout = &layout;
    r.arrays = state.arrays();
    r.trainer_state = {{"data", {{"epoch", 1}, {"index", step * 32}}}, {"rng_seed", 1234}, {"job_spec", "model: x\n"}};
    return r;
  }

  std::string root_;
};

TEST_F(CkptSaveTest, RoundTripIsBitExactAndWeightsAreRneOfMaster) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState saved(layout);
  FillState(layout, saved, 7);
  SaveRequest req = Request(layout, saved, 10);
  auto res = SaveCheckpoint(req);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->dir, root_ + "/checkpoint-10");
  EXPECT_GT(res->bytes_written, 0u);

  auto latest = FindLatestCheckpoint(root_);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, res->dir);

  HostState loaded(layout);
  auto lc = LoadCheckpoint(*latest, layout, loaded.arrays());
  ASSERT_TRUE(lc.ok()) << lc.status();
  EXPECT_EQ(lc->step, 10);
  EXPECT_EQ(lc->trainer_state, req.trainer_state);
  for (const UnitLayout& u : layout.units) {
    ASSERT_EQ(0, std::memcmp(saved.master[u.index].data(), loaded.master[u.index].data(), u.numel * 4)) << u.name;
    ASSERT_EQ(0, std::memcmp(saved.m[u.index].data(), loaded.m[u.index].data(), u.numel * 4)) << u.name;
    ASSERT_EQ(0, std::memcmp(saved.v[u.index].data(), loaded.v[u.index].data(), u.numel * 4)) << u.name;
  }

  // model.safetensors: every layout tensor in BF16, equal to RNE of master; config says bfloat16.
  auto f = safetensors::SafetensorsFile::Open(*latest + "/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  size_t count = 0;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      const safetensors::TensorInfo* info = (*f)->Find(t.hf_name);
      ASSERT_NE(info, nullptr) << t.hf_name;
      ASSERT_EQ(info->dtype, safetensors::Dtype::kBF16);
      ASSERT_EQ(info->shape, t.shape);
      const auto bytes = (*f)->Bytes(*info);
      for (int64_t i = 0; i < t.numel; ++i) {
        uint16_t b;
        std::memcpy(&b, bytes.data() + 2 * i, 2);
        ASSERT_EQ(b, FloatToBf16(saved.master[u.index][t.offset_numel + i])) << t.hf_name << "[" << i << "]";
      }
      ++count;
    }
  }
  EXPECT_EQ((*f)->tensors().size(), count);
  auto cfg = ModelConfig::FromFile(*latest + "/config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->torch_dtype, "bfloat16");
  EXPECT_EQ(DescribeConfigMismatch(*cfg, layout.config), "");

  // The checkpoint directory is itself an HF model directory for LoadHfModel.
  HostState weights_only(layout);
  ASSERT_TRUE(LoadHfModel(*latest, layout, weights_only.master_fn()).ok());
  const TensorSlot& up = layout.units[1].tensors[kUpProj];
  EXPECT_EQ(weights_only.master[1][up.offset_numel + 5],
            Bf16ToFloat(FloatToBf16(saved.master[1][up.offset_numel + 5])));
}

TEST_F(CkptSaveTest, Fp32WeightsShardedAndTiedHaveNoLmHead) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState saved(layout);
  FillState(layout, saved, 8);
  SaveRequest req = Request(layout, saved, 3);
  req.weight_dtype = Dtype::kF32;
  req.shard_max_bytes = 40000;  // the tiny model is ~150 KB in F32: several shards
  req.io_threads = 3;
  auto res = SaveCheckpoint(req);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_FALSE(fs::exists(res->dir + "/model.safetensors"));
  auto index = nlohmann::json::parse(std::ifstream(res->dir + "/model.safetensors.index.json"));
  std::set<std::string> shards;
  for (auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
  EXPECT_GE(shards.size(), 3u);
  EXPECT_FALSE(index["weight_map"].contains("lm_head.weight"));
  uint64_t total = 0;
  for (const UnitLayout& u : layout.units)
    for (const TensorSlot& t : u.tensors) total += t.numel * 4;
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  for (const std::string& s : shards) {
    auto f = safetensors::SafetensorsFile::Open(res->dir + "/" + s);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_LE((*f)->file_size(), 40000u + 4096u);
  }
  HostState loaded(layout);
  ASSERT_TRUE(LoadHfModel(res->dir, layout, loaded.master_fn()).ok());
  for (const UnitLayout& u : layout.units)
    for (const TensorSlot& t : u.tensors)
      ASSERT_EQ(
          0, std::memcmp(&saved.master[u.index][t.offset_numel], &loaded.master[u.index][t.offset_numel], t.numel * 4));
  EXPECT_EQ(ModelConfig::FromFile(res->dir + "/config.json")->torch_dtype, "float32");
}

TEST_F(CkptSaveTest, KeepLastRemovesOlderCompleteCheckpoints) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState s(layout);
  FillState(layout, s, 9);
  for (int step = 1; step <= 5; ++step) {
    SaveRequest req = Request(layout, s, step * 100);
    req.keep_last = 2;
    auto res = SaveCheckpoint(req);
    ASSERT_TRUE(res.ok()) << res.status();
    if (step >= 3) {
      EXPECT_EQ(res->removed.size(), 1u);
    }
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-400", "checkpoint-500"}));
  EXPECT_EQ(*FindLatestCheckpoint(root_), root_ + "/checkpoint-500");
}

// Two jobs sharing an output directory: keep_last prunes only the saving job's own checkpoints,
// never another job's (even a newer one), nor one whose job cannot be read.
TEST_F(CkptSaveTest, KeepLastPrunesOnlyTheSavingJobsCheckpoints) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState s(layout);
  FillState(layout, s, 11);
  for (int step : {6, 7}) {  // job "alpha": two checkpoints, the newest of the directory
    SaveRequest req = Request(layout, s, step);
    req.trainer_state["job_id"] = "alpha";
    ASSERT_TRUE(SaveCheckpoint(req).ok());
  }
  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 5)).ok());  // saved by no job
  for (int step : {1, 2, 3}) {                              // job "beta", keep_last 1
    SaveRequest req = Request(layout, s, step);
    req.trainer_state["job_id"] = "beta";
    req.keep_last = 1;
    auto res = SaveCheckpoint(req);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->removed.size(), step == 1 ? 0u : 1u) << step;
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-3", "checkpoint-5", "checkpoint-6", "checkpoint-7"}));
  EXPECT_EQ(*FindLatestCheckpoint(root_, "alpha"), root_ + "/checkpoint-7");
}

TEST_F(CkptSaveTest, CrashAtAnyStageLeavesThePreviousCheckpointLatest) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState s(layout);
  FillState(layout, s, 10);
  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 1)).ok());
  int64_t next_step = 2;
  for (const char* stage :
       {"config.json", "model", "optimizer.safetensors", "trainer_state.json", "model_files", "COMPLETE", "rename"}) {
    SCOPED_TRACE(stage);
    pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      SaveRequest req = Request(layout, s, next_step);
      req.fault_hook = [stage](const std::string& at) {
        if (at == stage) ::raise(SIGKILL);
        return absl::OkStatus();
      };
      (void)SaveCheckpoint(req);
      ::_exit(3);  // reaching here means the hook never fired
    }
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL) << wstatus;
    EXPECT_TRUE(fs::exists(absl::StrCat(root_, "/.tmp-checkpoint-", next_step, "-", child)));
    EXPECT_FALSE(fs::exists(absl::StrCat(root_, "/checkpoint-", next_step)));
    auto latest = FindLatestCheckpoint(root_);
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest, root_ + "/checkpoint-1");
    ++next_step;
  }
  // The next save sweeps the dead processes' partial directories.
  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 50)).ok());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-1", "checkpoint-50"}));
}

TEST_F(CkptSaveTest, SigkillDuringALargeSaveLeavesThePreviousCheckpointLatest) {
  // ~48 MB of state; the parent kills the child once its optimizer file has started.
  ModelConfig c = TinyConfig(true);
  c.vocab_size = 32768;
  c.hidden_size = 128;
  const ModelLayout layout = ModelLayout::Build(c);
  HostState s(layout);
  FillState(layout, s, 11);
  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 1)).ok());
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    SaveRequest req = Request(layout, s, 2);
    req.io_threads = 1;
    (void)SaveCheckpoint(req);
    ::_exit(0);
  }
  const std::string partial = absl::StrCat(root_, "/.tmp-checkpoint-2-", child, "/optimizer.safetensors");
  for (int i = 0; i < 20000 && !fs::exists(partial); ++i) ::usleep(100);
  ::kill(child, SIGKILL);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  auto latest = FindLatestCheckpoint(root_);
  ASSERT_TRUE(latest.ok()) << latest.status();
  if (WIFSIGNALED(wstatus)) {
    EXPECT_EQ(*latest, root_ + "/checkpoint-1");
  } else {  // the save won the race: it must then be complete and valid
    EXPECT_EQ(*latest, root_ + "/checkpoint-2");
  }
}

TEST_F(CkptSaveTest, FailedSaveCleansUpAndKeepsPrevious) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState s(layout);
  FillState(layout, s, 12);
  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 1)).ok());
  SaveRequest req = Request(layout, s, 2);
  req.keep_last = 1;
  req.fault_hook = [](const std::string& at) {
    return at == "optimizer.safetensors" ? absl::ResourceExhaustedError("injected: no space left on device")
                                         : absl::OkStatus();
  };
  auto res = SaveCheckpoint(req);
  ASSERT_EQ(res.status().code(), absl::StatusCode::kResourceExhausted) << res.status();
  EXPECT_NE(res.status().message().find("checkpoint-2"), std::string::npos) << res.status();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root_)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint-1"}));
  EXPECT_TRUE(VerifyCheckpoint(root_ + "/checkpoint-1").ok());
}

TEST_F(CkptSaveTest, CorruptedNewestIsSkippedAndMismatchedLayoutRefused) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState s(layout);
  FillState(layout, s, 13);
  for (int step : {1, 2, 3}) ASSERT_TRUE(SaveCheckpoint(Request(layout, s, step)).ok());
  fs::resize_file(root_ + "/checkpoint-3/optimizer.safetensors", 1000);
  EXPECT_EQ(VerifyCheckpoint(root_ + "/checkpoint-3").status().code(), absl::StatusCode::kDataLoss);
  fs::remove(root_ + "/checkpoint-2/COMPLETE");
  EXPECT_EQ(VerifyCheckpoint(root_ + "/checkpoint-2").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*FindLatestCheckpoint(root_), root_ + "/checkpoint-1");

  // Lying header inside a checkpoint whose size still matches COMPLETE.
  {
    std::fstream f(root_ + "/checkpoint-1/optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(12);
    f.write("\"X", 2);
  }
  EXPECT_FALSE(VerifyCheckpoint(root_ + "/checkpoint-1").ok());
  EXPECT_EQ(FindLatestCheckpoint(root_).status().code(), absl::StatusCode::kNotFound);

  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 4)).ok());
  const ModelLayout other = ModelLayout::Build(TinyConfig(true));
  HostState t(other);
  auto lc = LoadCheckpoint(root_ + "/checkpoint-4", other, t.arrays());
  EXPECT_EQ(lc.status().code(), absl::StatusCode::kFailedPrecondition) << lc.status();
  EXPECT_NE(lc.status().message().find("tie_word_embeddings"), std::string::npos) << lc.status();
}

// Resuming from a checkpoint whose state holds a NaN or infinity (master, m) or a negative or
// non-finite v is DATA_LOSS naming the file, the tensor, the element and what it is.
TEST_F(CkptSaveTest, NonFiniteStateIsDataLossNamingTheTensor) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState s(layout);
  FillState(layout, s, 21);
  ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 5)).ok());
  const std::string dir = root_ + "/checkpoint-5";
  const std::string file = dir + "/optimizer.safetensors";
  const UnitLayout& layer = layout.units[2];
  const TensorSlot& down = layer.tensors[kDownProj];
  struct Case {
    std::string kind;
    int64_t element;
    float value;
    std::string what;
  };
  for (const Case& k : {Case{"master", down.offset_numel + 5, std::nanf(""), down.hf_name + "[0, 5]"},
                        Case{"adam_m", 3, std::numeric_limits<float>::infinity(), "input_layernorm.weight[3]"},
                        Case{"adam_v", down.offset_numel, -1e-9f, "second moment must be >= 0"},
                        Case{"adam_v", layer.tensors[kInputNorm].numel, std::nanf(""), "the padding after"}}) {
    SCOPED_TRACE(k.kind);
    ASSERT_TRUE(SaveCheckpoint(Request(layout, s, 5)).ok());
    HostState loaded(layout);
    ASSERT_TRUE(LoadCheckpoint(dir, layout, loaded.arrays()).ok());
    PatchTensorElement(file, "unit." + layer.name + "." + k.kind, k.element, k.value);
    auto lc = LoadCheckpoint(dir, layout, loaded.arrays());
    EXPECT_EQ(lc.status().code(), absl::StatusCode::kDataLoss) << lc.status();
    EXPECT_NE(lc.status().message().find(file), std::string::npos) << lc.status();
    EXPECT_NE(lc.status().message().find("unit." + layer.name + "." + k.kind), std::string::npos) << lc.status();
    EXPECT_NE(lc.status().message().find(k.what), std::string::npos) << lc.status();
  }
}

TEST_F(CkptSaveTest, SavingTheSameStepAgainReplacesIt) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState a(layout), b(layout), out(layout);
  FillState(layout, a, 1);
  FillState(layout, b, 2);
  ASSERT_TRUE(SaveCheckpoint(Request(layout, a, 5)).ok());
  ASSERT_TRUE(SaveCheckpoint(Request(layout, b, 5)).ok());
  ASSERT_TRUE(LoadCheckpoint(root_ + "/checkpoint-5", layout, out.arrays()).ok());
  EXPECT_EQ(0, std::memcmp(out.master[0].data(), b.master[0].data(), b.master[0].size() * 4));
  EXPECT_EQ(std::distance(fs::directory_iterator(root_), fs::directory_iterator()), 1);
}

TEST_F(CkptSaveTest, BadRequestsAreInvalidArgument) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState s(layout);
  SaveRequest req = Request(layout, s, 1);
  req.trainer_state = nlohmann::json::array();
  EXPECT_EQ(SaveCheckpoint(req).status().code(), absl::StatusCode::kInvalidArgument);
  req = Request(layout, s, -1);
  EXPECT_EQ(SaveCheckpoint(req).status().code(), absl::StatusCode::kInvalidArgument);
  req = Request(layout, s, 1);
  req.arrays.moments = nullptr;
  EXPECT_EQ(SaveCheckpoint(req).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FindLatestCheckpoint(root_ + "/nonexistent").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace slidedp::checkpoint

namespace slidedp::checkpoint {
namespace {

// A qwen3_moe checkpoint and a job whose routing differs (top-k, renormalisation, which layers are
// sparse) are different models: named.
TEST(ConfigMismatch, MoeFieldsAreNamed) {
  const ModelConfig a = *ModelConfig::Preset("tiny-moe");
  EXPECT_EQ(DescribeConfigMismatch(a, a), "");
  ModelConfig b = a;
  b.num_experts_per_tok = 3;
  EXPECT_NE(DescribeConfigMismatch(a, b).find("num_experts_per_tok is 2 in the checkpoint but 3"), std::string::npos);
  b = a;
  b.norm_topk_prob = !a.norm_topk_prob;
  EXPECT_NE(DescribeConfigMismatch(a, b).find("norm_topk_prob"), std::string::npos);
  b = a;
  b.mlp_only_layers = {};
  EXPECT_NE(DescribeConfigMismatch(a, b).find("mlp_only_layers is 1 in the checkpoint but "), std::string::npos);
}

}  // namespace
}  // namespace slidedp::checkpoint
