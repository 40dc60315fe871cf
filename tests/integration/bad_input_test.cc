// Malformed input against a real hostd + 1 CPU worker: every bad job spec, model directory,
// dataset and request gets a specific gRPC status and a message naming the problem, and the daemon
// keeps serving (health SERVING after every test, and a good tiny job still succeeds at the end).
// hostd's resident memory and open file descriptors before and after the suite go to the test
// log; the descriptors may not grow by more than a few.
//
// Two kinds of rejection are checked, whichever hostd actually does for the input:
//   ExpectRejected:  SubmitJob itself fails with the code (nothing is queued);
//   ExpectJobFails:  SubmitJob accepts, the job ends FAILED with error_code and message.
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "common/data/dataset.h"
#include "common/data/synthetic.h"
#include "common/model/model_config.h"
#include "gmock/gmock.h"
#include "hostd/admission/admission.h"
#include "nlohmann/json.hpp"
#include "grpcpp/grpcpp.h"
#include "slidedp/v1/slidedp.grpc.pb.h"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// One hostd + one CPU worker for the whole suite (spawning per test would dominate the run time).
class BadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    node_ = new NodeHarness(1);
    output_root_ = fs::canonical(node_->dir()).string();  // the harness's --output-root
    root_ = fs::path(node_->dir() + "/inputs").lexically_normal().string();
    fs::create_directories(root_);
    MakeGoodData();
    MakeGoodModel();
    fds_before_ = OpenFdCount(node_->hostd_pid());
    rss_kb_before_ = ResidentKb(node_->hostd_pid());
    std::cout << "hostd before the suite: VmRSS " << rss_kb_before_ / 1024 << " MiB, " << fds_before_
              << " open file descriptors\n";
  }
  static void TearDownTestSuite() {
    delete node_;
    node_ = nullptr;
  }

  static void MakeGoodData() {
    data::SyntheticOptions o;
    o.vocab_size = 512;
    o.num_documents = 32;
    o.seed = 2;
    o.min_doc_tokens = 8;
    o.max_doc_tokens = 40;
    o.seq_len = 32;
    o.overwrite = data::Overwrite::kYes;
    auto m = data::WriteSyntheticDataset(root_ + "/data", o);
    ASSERT_TRUE(m.ok()) << m.status();
  }

  // A HF-loadable tiny model directory (F32 weights, one model.safetensors), written by the
  // checkpoint code as a checkpoint of step 0.
  static void MakeGoodModel() {
    auto config = ModelConfig::Preset("tiny");
    ASSERT_TRUE(config.ok());
    ModelLayout layout = ModelLayout::Build(*config);
    std::vector<std::vector<float>> w(layout.num_units());
    for (int u = 0; u < layout.num_units(); ++u) w[u].assign(layout.units[u].numel, 0);
    checkpoint::InitRandom(layout, 7, [&](int u) { return w[u].data(); });
    checkpoint::SaveRequest req;
    req.root_dir = root_ + "/ckpt";
    req.step = 0;
    req.layout = &layout;
    req.arrays.master = [&](int u) { return w[u].data(); };
    req.arrays.moments = checkpoint::Fp32Moments(req.arrays.master, req.arrays.master);
    req.weight_dtype = Dtype::kF32;
    auto saved = checkpoint::SaveCheckpoint(req);
    ASSERT_TRUE(saved.ok()) << saved.status();
    model_dir_ = saved->dir;
    ASSERT_TRUE(fs::exists(model_dir_ + "/model.safetensors")) << "expected a single-file tiny model";
  }

  // A copy of the good model directory to corrupt.
  static std::string CopyModel(const std::string& name) {
    std::string dir = root_ + "/" + name;
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(model_dir_ + "/" + f, dir + "/" + f);
    return dir;
  }

  // model.safetensors split into its JSON header and data; Join writes it back (any header size).
  struct Safetensors {
    nlohmann::json header;
    std::string data;
  };
  static Safetensors Split(const std::string& path) {
    std::string bytes = ReadFile(path);
    uint64_t n = 0;
    memcpy(&n, bytes.data(), 8);
    return {nlohmann::json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
  }
  static void Join(const std::string& path, const Safetensors& st) {
    std::string h = st.header.dump();
    while (h.size() % 8) h.push_back(' ');
    uint64_t n = h.size();
    WriteAll(path, std::string(reinterpret_cast<const char*>(&n), 8) + h + st.data);
  }

  struct SpecParts {
    std::string name = "bad";
    std::string output = "out";
    std::string model = "{preset: tiny, init_seed: 1}";
    std::string data;  // default: the good dataset
    std::string train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 2, seed: 1}";
    std::string runtime = "{workers: 1, ring_slots: 4, step_timeout_ms: 20000}";
    std::string extra;
  };
  static std::string Spec(const SpecParts& p) {
    return absl::StrCat("name: ", p.name, "\nmodel: ", p.model, "\ndata: {path: ", p.data.empty() ? root_ + "/data" : p.data,
                        "}\noutput: {dir: ", p.output, ", save_final: false}\ntrain: ", p.train,
                        "\noptimizer: {lr: 1.0e-3}\nruntime: ", p.runtime, "\n", p.extra);
  }

  static std::string NextId(const std::string& what) { return absl::StrCat(what, "-", counter_++); }

  static absl::StatusOr<v1::SubmitJobResponse> Submit(const std::string& spec, const std::string& id) {
    v1::SubmitJobRequest req;
    req.set_job_id(id);
    req.set_spec_yaml(spec);
    req.set_base_dir(node_->dir());
    return node_->client().Submit(req);
  }

  // SubmitJob fails with `code` and a message containing `fragment`; no job is recorded.
  static void ExpectRejected(const std::string& spec, absl::StatusCode code, const std::string& fragment) {
    const std::string id = NextId("rej");
    auto r = Submit(spec, id);
    ASSERT_FALSE(r.ok()) << "accepted; expected " << absl::StatusCodeToString(code) << " '" << fragment << "'";
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(fragment));
    EXPECT_EQ(node_->client().GetJob(id).status().code(), absl::StatusCode::kNotFound);
    std::cout << "  " << id << " rejected " << r.status().ToString().substr(0, 300) << "\n";
  }

  // SubmitJob accepts; the job ends FAILED with error_code `code` and `fragment` in its error.
  static void ExpectJobFails(const std::string& spec, absl::StatusCode code, const std::string& fragment) {
    const std::string id = NextId("fail");
    auto r = Submit(spec, id);
    ASSERT_TRUE(r.ok()) << "rejected at submit: " << r.status();
    auto j = node_->WaitFinal(id, 60);
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ(j->state(), v1::JOB_STATE_FAILED) << "logs in " << node_->dir();
    EXPECT_EQ(j->error_code(), static_cast<int>(code)) << j->error();
    EXPECT_THAT(j->error(), HasSubstr(fragment));
    std::cout << "  " << id << " FAILED " << absl::StatusCodeToString(static_cast<absl::StatusCode>(j->error_code()))
              << ": " << j->error() << "\n";
  }

  void TearDown() override {
    // After every bad input the daemon still answers health SERVING and keeps its worker.
    std::string health;
    ASSERT_TRUE(node_->client().Health(&health).ok());
    EXPECT_EQ(health, "SERVING");
    auto ws = node_->client().Workers();
    ASSERT_TRUE(ws.ok()) << ws.status();
    EXPECT_EQ(ws->size(), 1u) << "the worker was lost; logs in " << node_->dir();
  }

  static NodeHarness* node_;
  static std::string root_, model_dir_, output_root_;
  static int counter_;
  static int64_t fds_before_, rss_kb_before_;
};

NodeHarness* BadInput::node_ = nullptr;
std::string BadInput::root_;
std::string BadInput::output_root_;
int64_t BadInput::fds_before_ = -1;
int64_t BadInput::rss_kb_before_ = -1;
std::string BadInput::model_dir_;
int BadInput::counter_ = 0;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

// ---- job spec syntax and values (JobSpec::Parse at submit) ----

TEST_F(BadInput, SpecUnknownKeys) {
  SpecParts p;
  p.extra = "trainer: {steps: 3}\n";
  ExpectRejected(Spec(p), kInvalid, "unknown key 'trainer'");
  p = {};
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 2, learning_rate: 3}";
  ExpectRejected(Spec(p), kInvalid, "unknown key 'train.learning_rate'");
}

TEST_F(BadInput, SpecWrongTypes) {
  SpecParts p;
  p.train = "{seq_len: long, global_batch: 4, micro_batch: 2, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.seq_len");
  p.train = "{seq_len: 32, global_batch: [4], micro_batch: 2, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.global_batch");
  p.train = "{seq_len: 32.5, global_batch: 4, micro_batch: 2, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.seq_len");
  p = {};
  p.extra = "optimizer: 0.001\n";  // a section that is not a map (duplicate key is YAML's problem too)
  auto r = Submit(absl::StrReplaceAll(Spec(p), {{"optimizer: {lr: 1.0e-3}\n", ""}}), NextId("type"));
  EXPECT_EQ(r.status().code(), kInvalid) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("optimizer"));
  ExpectRejected("[1, 2, 3]", kInvalid, "top level must be a map");
  ExpectRejected("model: {preset: tiny\n  data: [", kInvalid, "not valid YAML");
}

TEST_F(BadInput, SpecNegativeAndZeroSizes) {
  SpecParts p;
  p.train = "{seq_len: -32, global_batch: 4, micro_batch: 2, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.seq_len: must be >= 1, got -32");
  p.train = "{seq_len: 32, global_batch: 0, micro_batch: 2, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.global_batch: must be >= 1, got 0");
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 0, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.micro_batch: must be >= 1, got 0");
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: -1}";
  ExpectRejected(Spec(p), kInvalid, "train.steps: must be >= 0, got -1");
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 0}";
  ExpectRejected(Spec(p), kInvalid, "exactly one of train.steps or train.epochs");
  p = {};
  p.runtime = "{ring_slots: 1}";
  ExpectRejected(Spec(p), kInvalid, "runtime.ring_slots: must be >= 2, got 1");
  p.runtime = "{chunk_bytes: 0}";
  ExpectRejected(Spec(p), kInvalid, "runtime.chunk_bytes");
  p = {};
  p.extra = "optimizer: {lr: -1}\n";
  ExpectRejected(absl::StrReplaceAll(Spec(p), {{"optimizer: {lr: 1.0e-3}\n", ""}}), kInvalid, "optimizer.lr");
}

// Found by tests/fuzz (jobspec_fuzz; reproducers in tests/fuzz/crashes/jobspec/): a YAML map or
// sequence used as a key made yaml-cpp throw inside JobSpec::Parse (gRPC answered UNKNOWN).
// Parse now turns every YAML exception into INVALID_ARGUMENT.
TEST_F(BadInput, SpecWithNonScalarKeysIsInvalidArgument) {
  ExpectRejected("{{}}", kInvalid, "job spec");  // crash-038a68bc...: the minimal reproducer
  ExpectRejected("{model: {preset: tiny}, {path: d}: 1}", kInvalid, "job spec");
  ExpectRejected("model: {[preset]: tiny}\n", kInvalid, "model");
}

TEST_F(BadInput, GlobalBatchNotDivisible) {
  SpecParts p;
  p.train = "{seq_len: 32, global_batch: 6, micro_batch: 4, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.global_batch 6 is not a multiple of train.micro_batch 4");
  p.train = "{seq_len: 32, global_batch: 6, micro_batch: 2, steps: 2}";
  p.runtime = "{workers: 2}";
  ExpectRejected(Spec(p), kInvalid, "not divisible by runtime.workers x train.micro_batch = 2 x 2");
}

TEST_F(BadInput, SeqLenBeyondMaxPositions) {
  SpecParts p;
  p.train = "{seq_len: 8192, global_batch: 4, micro_batch: 2, steps: 2}";
  ExpectRejected(Spec(p), kInvalid, "train.seq_len 8192 exceeds the model's max_position_embeddings 4096");
}

// The router's coefficient means nothing to a dense model: refused at submit, naming the key.
TEST_F(BadInput, RouterAuxLossCoefOnADenseModel) {
  SpecParts p;
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 2, router_aux_loss_coef: 0.01}";
  ExpectRejected(Spec(p), kInvalid, "train.router_aux_loss_coef: the model (qwen3) has no router");
}

// ---- model directories ----

TEST_F(BadInput, ModelDirectoryMissingOrWithoutConfig) {
  SpecParts p;
  p.model = absl::StrCat("{path: ", root_, "/no-such-model}");
  ExpectRejected(Spec(p), kInvalid, "model.path: no config.json in");
  std::string dir = CopyModel("no-config");
  fs::remove(dir + "/config.json");
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectRejected(Spec(p), kInvalid, "no config.json in " + dir);
  p.model = absl::StrCat("{path: ", model_dir_, ", preset: tiny}");
  ExpectRejected(Spec(p), kInvalid, "exactly one of model.path");
}

// What would fail the job when it starts is refused at submit and at --dry-run (issue 48): a
// model directory with a config and no weights, a policy file made for another model shape.
TEST_F(BadInput, WeightlessModelAndPolicyOfAnotherShapeAreRefusedAtDryRun) {
  auto expect_refused = [](const std::string& spec, const std::string& fragment) {
    for (bool dry : {true, false}) {
      v1::SubmitJobRequest req;
      req.set_job_id(NextId("dry"));
      req.set_spec_yaml(spec);
      req.set_base_dir(node_->dir());
      req.set_dry_run(dry);
      auto r = node_->client().Submit(req);
      ASSERT_FALSE(r.ok()) << (dry ? "dry run" : "submit") << " accepted; expected '" << fragment << "'";
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      EXPECT_THAT(std::string(r.status().message()), HasSubstr(fragment));
    }
  };
  SpecParts p;
  const std::string weightless = CopyModel("weightless");
  fs::remove(weightless + "/model.safetensors");
  p.model = absl::StrCat("{path: ", weightless, "}");
  expect_refused(Spec(p), "has no weights: neither model.safetensors nor model.safetensors.index.json");
  WriteAll(weightless + "/pytorch_model.bin", "not read");
  expect_refused(Spec(p), "safe_serialization=True");

  // The tiny preset's shape but a hidden size of 96.
  const std::string policy = root_ + "/other-shape.policy.yaml";
  WriteAll(policy,
           "version: 1\nmodel: {hidden_size: 96, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
           "head_dim: 16, intermediate_size: 128, vocab_size: 512}\nlayers:\n  - {kind: recompute}\n  - {kind: "
           "keep_all}\n");
  p = {};
  p.runtime = absl::StrCat("{workers: 1, ring_slots: 4, step_timeout_ms: 20000, policy: ", policy, "}");
  expect_refused(Spec(p), "runtime.policy was made for model.hidden_size 96, this job's model has 64");
}

TEST_F(BadInput, ModelConfigNotJsonOrInvalid) {
  std::string dir = CopyModel("config-garbage");
  WriteAll(dir + "/config.json", "{\"hidden_size\": 64,,,");
  SpecParts p;
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectRejected(Spec(p), kInvalid, "config.json");
  dir = CopyModel("config-negative");
  auto cfg = nlohmann::json::parse(ReadFile(dir + "/config.json"));
  cfg["num_attention_heads"] = -4;
  WriteAll(dir + "/config.json", cfg.dump());
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectRejected(Spec(p), kInvalid, "num_attention_heads");
}

// The good model itself trains (so the failures below are due to the corruption alone).
TEST_F(BadInput, GoodModelDirectoryTrains) {
  SpecParts p;
  p.model = absl::StrCat("{path: ", model_dir_, "}");
  auto j = node_->RunJob(Spec(p), NextId("goodmodel"), 60);
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
}

TEST_F(BadInput, ModelConfigInconsistentWithShards) {
  std::string dir = CopyModel("config-mismatch");
  auto cfg = nlohmann::json::parse(ReadFile(dir + "/config.json"));
  cfg["intermediate_size"] = 96;  // a valid config, but the shards hold 128
  WriteAll(dir + "/config.json", cfg.dump());
  SpecParts p;
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectJobFails(Spec(p), kInvalid, "wrong shape: model.layers.0.mlp.gate_proj.weight is [128, 64] in " + dir);
}

TEST_F(BadInput, ModelTensorWithWrongShape) {
  std::string dir = CopyModel("wrong-shape");
  Safetensors st = Split(dir + "/model.safetensors");
  st.header["model.layers.1.mlp.gate_proj.weight"]["shape"] = {64, 128};  // [128, 64] transposed: same bytes
  Join(dir + "/model.safetensors", st);
  SpecParts p;
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectJobFails(
      Spec(p), kInvalid,
      "model.layers.1.mlp.gate_proj.weight is [64, 128] in " + dir + "/model.safetensors, expected [128, 64]");
}

TEST_F(BadInput, ModelTensorMissing) {
  std::string dir = CopyModel("missing-tensor");
  Safetensors st = Split(dir + "/model.safetensors");
  // Drop the last tensor by offset (its bytes go too, so the file stays self-consistent).
  std::string last;
  uint64_t last_begin = 0;
  for (auto& [name, t] : st.header.items()) {
    if (name == "__metadata__") continue;
    if (t["data_offsets"][0].get<uint64_t>() >= last_begin) {
      last_begin = t["data_offsets"][0].get<uint64_t>();
      last = name;
    }
  }
  st.header.erase(last);
  st.data.resize(last_begin);
  Join(dir + "/model.safetensors", st);
  SpecParts p;
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectJobFails(Spec(p), kInvalid, "1 tensor(s) missing: " + last);
}

TEST_F(BadInput, SafetensorsHeaderLies) {
  std::string dir = CopyModel("lying-header");
  Safetensors st = Split(dir + "/model.safetensors");
  // Offsets that run past the end of the data: a reader trusting them would read out of bounds.
  auto& t = st.header["model.norm.weight"];
  t["data_offsets"][1] = st.data.size() + 4096;
  Join(dir + "/model.safetensors", st);
  SpecParts p;
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectJobFails(Spec(p), kInvalid, "tensor \"model.norm.weight\": data_offsets");

  dir = CopyModel("huge-header-len");
  std::string bytes = ReadFile(dir + "/model.safetensors");
  const uint64_t lie = 1ull << 40;
  memcpy(bytes.data(), &lie, 8);
  WriteAll(dir + "/model.safetensors", bytes);
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectJobFails(Spec(p), kInvalid, "model.safetensors: header length 1099511627776 exceeds the limit");
}

TEST_F(BadInput, SafetensorsTruncated) {
  std::string dir = CopyModel("truncated-shard");
  std::string path = dir + "/model.safetensors";
  fs::resize_file(path, fs::file_size(path) / 2);
  SpecParts p;
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectJobFails(Spec(p), absl::StatusCode::kDataLoss, dir + "/model.safetensors: tensor \"");
}

// ---- datasets ----

TEST_F(BadInput, DatasetTokenIdsBeyondModelVocab) {
  data::SyntheticOptions o;
  o.vocab_size = 4096;  // ids up to 4095; the tiny model has 512
  o.num_documents = 16;
  o.seq_len = 32;
  o.min_doc_tokens = 8;
  o.max_doc_tokens = 30;
  o.overwrite = data::Overwrite::kYes;
  ASSERT_TRUE(data::WriteSyntheticDataset(root_ + "/data-big-vocab", o).ok());
  SpecParts p;
  p.data = root_ + "/data-big-vocab";
  ExpectRejected(Spec(p), kInvalid, "does not fit the model's vocabulary");
}

TEST_F(BadInput, DatasetTruncatedOrMissingFiles) {
  const std::string good = root_ + "/data";
  std::string dir = root_ + "/data-truncated";
  fs::remove_all(dir);
  fs::copy(good, dir);
  fs::resize_file(dir + "/tokens.bin", fs::file_size(dir + "/tokens.bin") - 12);
  SpecParts p;
  p.data = dir;
  ExpectRejected(Spec(p), absl::StatusCode::kDataLoss, dir + "/tokens.bin has");

  dir = root_ + "/data-no-manifest";
  fs::remove_all(dir);
  fs::copy(good, dir);
  fs::remove(dir + "/manifest.json");
  p.data = dir;
  ExpectRejected(Spec(p), absl::StatusCode::kNotFound, "cannot open manifest.json");

  p.data = root_ + "/no-such-data";
  ExpectRejected(Spec(p), kInvalid, "data.path: ");
}

// ---- host memory ----

// A job whose host state does not fit is refused by admission with RESOURCE_EXHAUSTED and the
// figures, before any state is allocated; the daemon and its worker stay (TearDown checks).
TEST_F(BadInput, TooLittleHostMemoryIsRefusedWithTheFigures) {
  auto host = hostd::ReadHostMemoryInfo();
  ASSERT_TRUE(host.ok()) << host.status();
  if (host->mem_available_bytes > (400ull << 30)) GTEST_SKIP() << "this host could hold Qwen3-14B's state";
  SpecParts p;
  p.model = "{preset: qwen3-14b, init_seed: 1}";  // ~193 GiB of state (14 B/param)
  ExpectJobFails(Spec(p), absl::StatusCode::kResourceExhausted, "GiB of host memory but only");
  EXPECT_TRUE(node_->LeakedSegments().empty());
}

// ---- requests ----

TEST_F(BadInput, OversizedRequests) {
  // Above the spec parser's 1 MiB limit but below gRPC's 4 MiB: the parser names the limit.
  SpecParts p;
  p.extra = "# " + std::string(2 << 20, 'x') + "\n";
  ExpectRejected(Spec(p), kInvalid, "the limit is 1048576");
  // Above hostd's 4 MiB receive limit: gRPC refuses it before any handler runs.
  p.extra = "# " + std::string(5 << 20, 'x') + "\n";
  auto r = Submit(Spec(p), NextId("huge"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
}

TEST_F(BadInput, BadAndUnknownJobIds) {
  for (const std::string& id : {std::string("../etc"), std::string("a b"), std::string(65, 'a'), std::string("x\ny")}) {
    auto r = Submit(Spec({}), id);
    EXPECT_EQ(r.status().code(), kInvalid) << id << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("is not valid: use 1-64 characters"));
  }
  EXPECT_EQ(node_->client().GetJob("never-submitted").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(node_->client().GetJob("never-submitted").status().message()),
              HasSubstr("no job 'never-submitted'"));
  EXPECT_EQ(node_->client().Cancel("never-submitted").status().code(), absl::StatusCode::kNotFound);
  // Ids that are not UTF-8 travel (bytes on the wire) and get hostd's own answer, printable.
  const std::string not_utf8 = "id\xff\xfe\x1b[31m";
  auto r = Submit(Spec({}), not_utf8);
  EXPECT_EQ(r.status().code(), kInvalid) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("job_id 'id???[31m' is not valid"));
  auto g = node_->client().GetJob(not_utf8);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound) << g.status();
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("no job 'id???[31m'"));
}

// A worker session that never says hello is cancelled after kHelloTimeout (it would hold a
// hostd thread for ever), and an attached worker's reports while it runs no job are dropped,
// not queued: a flood of 4 MiB reports leaves hostd's memory where it was.
TEST_F(BadInput, SilentAndFloodingWorkerSessions) {
  auto channel = grpc::CreateChannel(node_->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::WorkerService::NewStub(channel);
  grpc::ClientContext silent_ctx;
  silent_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto silent = stub->Session(&silent_ctx);
  const absl::Time opened = absl::Now();
  v1::HostCommand cmd;
  EXPECT_FALSE(silent->Read(&cmd));
  const grpc::Status ended = silent->Finish();
  // hostd cancels the call (TryCancel): the client sees CANCELLED, well before its own deadline.
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::CANCELLED) << ended.error_message();
  EXPECT_LT(absl::Now() - opened, absl::Seconds(20));

  grpc::ClientContext ctx;
  auto flood = stub->Session(&ctx);
  v1::WorkerReport hello;
  hello.mutable_hello()->set_worker_id("flooder");
  hello.mutable_hello()->set_pid(getpid());
  hello.mutable_hello()->mutable_device()->set_kind("cpu");
  ASSERT_TRUE(flood->Write(hello));
  const int64_t rss_before = ResidentKb(node_->hostd_pid());
  v1::WorkerReport big;
  big.mutable_policy_chosen()->set_job_id("nobody");
  big.mutable_policy_chosen()->set_policy_yaml(std::string((4 << 20) - 4096, 'p'));
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(flood->Write(big)) << i;
  // A report is read before the next write's flow control lets it through; one more round trip:
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t rss_after = ResidentKb(node_->hostd_pid());
  std::cout << "hostd VmRSS before / after 100 idle reports of 4 MiB: " << rss_before / 1024 << " / "
            << rss_after / 1024 << " MiB\n";
  EXPECT_LT(rss_after - rss_before, 128 * 1024);  // 400 MiB were sent
  flood->WritesDone();
  ctx.TryCancel();
  flood->Finish();
}

TEST_F(BadInput, SameJobIdWithAnotherSpec) {
  SpecParts p;
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 1}";
  const std::string id = NextId("dup");
  auto first = Submit(Spec(p), id);
  ASSERT_TRUE(first.ok()) << first.status();
  auto same = Submit(Spec(p), id);  // idempotent retry: the same job back
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->already_existed());
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 2}";
  auto other = Submit(Spec(p), id);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists) << other.status();
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("exists with a different spec"));
  auto j = node_->WaitFinal(id, 60);
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
}

// ---- hostile paths and names (issue: harden hostd) ----

// An output.dir hostd cannot make is refused at submit; before, the job runner threw
// std::filesystem::filesystem_error and took the daemon down.
TEST_F(BadInput, OutputDirThatCannotBeMadeIsRefused) {
  const std::string file = root_ + "/a-file";
  WriteAll(file, "x");
  SpecParts p;
  p.output = file;
  ExpectRejected(Spec(p), absl::StatusCode::kFailedPrecondition, "is not a directory");
  p.output = file + "/below/it";
  ExpectRejected(Spec(p), absl::StatusCode::kFailedPrecondition, file + " is not a directory");
}

// config.json and manifest.json are read with bounds: a FIFO would block the job runner forever
// and /dev/zero would grow hostd's memory without end; both are refused at once.
TEST_F(BadInput, ConfigAndManifestThatAreNotRegularFilesAreRefused) {
  const absl::Time t0 = absl::Now();
  std::string dir = CopyModel("config-fifo");
  fs::remove(dir + "/config.json");
  ASSERT_EQ(::mkfifo((dir + "/config.json").c_str(), 0600), 0);
  SpecParts p;
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectRejected(Spec(p), kInvalid, "is not a regular file");
  dir = CopyModel("config-zero");
  fs::remove(dir + "/config.json");
  fs::create_symlink("/dev/zero", dir + "/config.json");
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectRejected(Spec(p), kInvalid, "is not a regular file");
  dir = CopyModel("config-huge");
  WriteAll(dir + "/config.json", std::string(5 << 20, ' '));
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectRejected(Spec(p), kInvalid, "bytes, more than the");

  const std::string data = root_ + "/data-fifo";
  fs::remove_all(data);
  fs::copy(root_ + "/data", data, fs::copy_options::recursive);
  fs::remove(data + "/manifest.json");
  ASSERT_EQ(::mkfifo((data + "/manifest.json").c_str(), 0600), 0);
  p = {};
  p.data = data;
  ExpectRejected(Spec(p), kInvalid, "is not a regular file");
  // The weights as a FIFO (it once blocked the job runner: cancel and SIGTERM did nothing), and
  // a config.json nested a million deep (it once overflowed the stack of the submit handler).
  dir = CopyModel("weights-fifo");
  fs::remove(dir + "/model.safetensors");
  ASSERT_EQ(::mkfifo((dir + "/model.safetensors").c_str(), 0600), 0);
  p = {};
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectJobFails(Spec(p), kInvalid, "not a regular file");  // (the weights are read when it starts)
  dir = CopyModel("config-deep");
  {
    std::string text = ReadFile(dir + "/config.json");
    text.insert(text.find('{') + 1, "\"x\": " + std::string(1000000, '[') + std::string(1000000, ']') + ", ");
    WriteAll(dir + "/config.json", text);
  }
  p.model = absl::StrCat("{path: ", dir, "}");
  ExpectRejected(Spec(p), kInvalid, "nested deeper than");
  EXPECT_LT(absl::ToDoubleSeconds(absl::Now() - t0), 30);  // nothing blocked
}

// Job names cannot leave the state or output directories, reach a terminal raw, or be stored in a
// way a restart forgets; a name with a dot (qwen3-1.7b-sft) gets an id that can start.
TEST_F(BadInput, JobNamesAreValidatedAndIdsMadeFromThemCanStart) {
  for (const std::string& name : {std::string("../escape"), std::string("a/b"), std::string("\"ctl\\x01x\""),
                                  std::string("\"na\\u00efve\""), std::string(300, 'n'), std::string(".hidden")}) {
    SpecParts p;
    p.name = name;
    ExpectRejected(Spec(p), kInvalid, "name '");
  }
  SpecParts p;
  p.name = "qwen3-1.7b-sft";
  v1::SubmitJobRequest req;
  req.set_spec_yaml(Spec(p));
  req.set_base_dir(node_->dir());
  auto r = node_->client().Submit(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->job().job_id(), ::testing::StartsWith("qwen3-1_7b-sft-"));
  auto j = node_->WaitFinal(r->job().job_id(), 60);
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
}

// A path the kernel cannot even look up (ENAMETOOLONG) is "not there", not an exception in hostd.
TEST_F(BadInput, PathsTooLongToLookUpAreRefused) {
  SpecParts p;
  p.model = absl::StrCat("{path: ", root_, "/", std::string(5000, 'm'), "}");
  ExpectRejected(Spec(p), kInvalid, "model.path");
  p = {};
  p.data = root_ + "/" + std::string(5000, 'd');
  ExpectRejected(Spec(p), kInvalid, "data.path");
  p = {};
  p.output = root_ + "/" + std::string(5000, 'o');
  ExpectRejected(Spec(p), kInvalid, "output.dir");
  // Each over PATH_MAX, said so (the path quoted in part); and under it, a name the kernel
  // refuses (a component over NAME_MAX) is "not there".
  p = {};
  p.model = absl::StrCat("{path: ", root_, "/", std::string(300, 'm'), "}");
  ExpectRejected(Spec(p), kInvalid, "no config.json in");
  p = {};
  p.output = root_ + "/" + std::string(300, 'o');
  ExpectRejected(Spec(p), absl::StatusCode::kFailedPrecondition, "output.dir");
}

// Paths that are not UTF-8 text or hold control characters (the spec's directory itself
// included): refused at submit, before they reach a record, a log line or a worker (a base_dir
// byte that was not UTF-8 once made every worker fail to parse its assignment and hang).
TEST_F(BadInput, PathsThatAreNotUtf8OrHoldControlCharactersAreRefused) {
  v1::SubmitJobRequest req;
  req.set_job_id(NextId("rej"));
  req.set_spec_yaml(Spec({}));
  req.set_base_dir(node_->dir() + "/x\xffy");
  auto r = node_->client().Submit(req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), kInvalid) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("not UTF-8"));
  SpecParts p;
  p.output = "\"out\\x1b[31mred\"";
  ExpectRejected(Spec(p), kInvalid, "control character");
  p = {};
  p.data = "\"" + root_ + "/data\\nforged line\"";
  ExpectRejected(Spec(p), kInvalid, "data.path");
}

// --resume PATH is checked at submit: a looping symbolic link or a path over PATH_MAX once made
// the job's start throw past hostd (it died with every job); a relative path is the client's
// (its spec's directory), never hostd's working directory.
TEST_F(BadInput, ResumePathsAreCheckedAtSubmit) {
  const std::string loop = root_ + "/resume-loop";
  fs::remove(loop + "/a");
  fs::remove(loop + "/b");
  fs::create_directories(loop);
  fs::create_symlink(loop + "/b", loop + "/a");
  fs::create_symlink(loop + "/a", loop + "/b");
  struct Case {
    std::string resume;
    absl::StatusCode code;
    std::string says;
  };
  for (const Case& c : {Case{loop + "/a", absl::StatusCode::kNotFound, "neither a job of this hostd nor a directory"},
                        Case{root_ + "/" + std::string(5000, 'r'), kInvalid, "longer than 4096"},
                        Case{"no-such-job", absl::StatusCode::kNotFound, "neither a job of this hostd"},
                        Case{root_ + "/data", absl::StatusCode::kNotFound, "--resume"},
                        Case{root_ + "/r\x1b[2J", kInvalid, "control character"}}) {
    v1::SubmitJobRequest req;
    const std::string id = NextId("rej");
    req.set_job_id(id);
    req.set_spec_yaml(Spec({}));
    req.set_base_dir(node_->dir());
    req.set_resume_from(c.resume);
    auto r = node_->client().Submit(req);
    ASSERT_FALSE(r.ok()) << c.resume.substr(0, 80);
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.says));
    EXPECT_EQ(node_->client().GetJob(id).status().code(), absl::StatusCode::kNotFound);
  }
  std::string health;
  EXPECT_TRUE(node_->client().Health(&health).ok()) << health;
}

// A spec that is not UTF-8 gets INVALID_ARGUMENT with the offset (before: INTERNAL with no
// message, from gRPC's parser of a string field).
TEST_F(BadInput, SpecThatIsNotUtf8IsInvalidArgument) {
  ExpectRejected(Spec({}) + "# \xff\xfe\n", kInvalid, "not UTF-8 text: invalid byte 0xff at offset");
}

// Values that make training meaningless or undefined: a loss-mask byte that is not 0 or 1, a
// dataset that trains no token (it "succeeded" with loss 0.0000), optimizer.eps 0 (0/0 = NaN in
// the padding between tensors).
TEST_F(BadInput, DatasetMasksAndOptimizerValuesThatTrainNothingOrNaNAreRefused) {
  auto copy_data = [&](const std::string& name, char fill, int64_t at) {
    const std::string dir = root_ + "/" + name;
    fs::remove_all(dir);
    fs::copy(root_ + "/data", dir, fs::copy_options::recursive);
    std::string mask = ReadFile(dir + "/loss_mask.bin");
    if (at < 0) {
      mask.assign(mask.size(), fill);
    } else {
      mask[at] = fill;
    }
    WriteAll(dir + "/loss_mask.bin", mask);
    return dir;
  };
  SpecParts p;
  p.data = copy_data("data-mask7", 7, 5);
  ExpectRejected(Spec(p), absl::StatusCode::kDataLoss, "loss-mask entry at position 5 is 7");
  p.data = copy_data("data-mask0", 0, -1);
  ExpectRejected(Spec(p), kInvalid, "trains no token");
  p = {};
  p.extra = "";
  ExpectRejected(absl::StrReplaceAll(Spec(p), {{"optimizer: {lr: 1.0e-3}", "optimizer: {lr: 1.0e-3, eps: 0}"}}), kInvalid,
                 "optimizer.eps must be > 0");
}

// Two jobs sharing an output directory: --resume by job id takes that job's own checkpoint, never
// the other's (before: the newest one there, or one the other job had replaced, was loaded).
TEST_F(BadInput, ResumeByJobIdNeverTakesAnotherJobsCheckpoint) {
  SpecParts p;
  p.output = root_ + "/shared-out";
  fs::remove_all(p.output);
  const std::string spec = absl::StrReplaceAll(Spec(p), {{", save_final: false}", ", save_final: true}"}});
  const std::string a = NextId("share-a"), b = NextId("share-b");
  auto ja = node_->RunJob(spec, a, 60);
  ASSERT_TRUE(ja.ok()) << ja.status();
  ASSERT_EQ(ja->state(), v1::JOB_STATE_SUCCEEDED) << ja->error();
  auto ja_ckpt = checkpoint::CheckpointJobId(ja->last_checkpoint());
  ASSERT_TRUE(ja_ckpt.ok()) << ja_ckpt.status();
  EXPECT_EQ(*ja_ckpt, a);
  // Another job into a's directory is refused at submit: it would save a checkpoint-2 of its own.
  auto refused = node_->RunJob(spec, b, 60);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("job " + a + " (checkpoint-2)"));
  // With output.overwrite it runs; a's checkpoint is moved aside, not replaced or deleted.
  const std::string over = absl::StrReplaceAll(spec, {{", save_final: true}", ", save_final: true, overwrite: true}"}});
  auto jb = node_->RunJob(over, b, 60);
  ASSERT_TRUE(jb.ok()) << jb.status();
  ASSERT_EQ(jb->state(), v1::JOB_STATE_SUCCEEDED) << jb->error();
  ASSERT_EQ(jb->last_checkpoint(), ja->last_checkpoint());
  int kept = 0;
  for (const auto& e : fs::directory_iterator(p.output)) {
    if (absl::StartsWith(e.path().filename().string(), "superseded-")) {
      auto owner = checkpoint::CheckpointJobId((e.path() / "checkpoint-2").string());
      kept += owner.ok() && *owner == a;
    }
  }
  EXPECT_EQ(kept, 1) << "a's checkpoint-2 moved aside";
  v1::SubmitJobRequest req;
  req.set_job_id(NextId("resume-a"));
  req.set_spec_yaml(absl::StrReplaceAll(spec, {{"steps: 2,", "steps: 3,"}}));
  req.set_base_dir(node_->dir());
  req.set_resume_from(a);
  auto r = node_->client().Submit(req);
  ASSERT_FALSE(r.ok()) << "resumed job " << a << " from " << b << "'s checkpoint";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("no complete checkpoint of job " + a));
  req.set_job_id(NextId("resume-b"));
  req.set_resume_from(b);  // b's own checkpoint is there: its run continues in the directory
  auto rb = node_->client().Submit(req);
  ASSERT_TRUE(rb.ok()) << rb.status();
  auto jrb = node_->WaitFinal(rb->job().job_id(), 60);
  ASSERT_TRUE(jrb.ok()) << jrb.status();
  EXPECT_EQ(jrb->state(), v1::JOB_STATE_SUCCEEDED) << jrb->error();
  EXPECT_EQ(jrb->run_id(), b);
}

// YAML lets a key appear twice (the last one winning silently): a spec must not.
TEST_F(BadInput, DuplicateSpecKeysAreRefused) {
  SpecParts p;
  p.extra = "optimizer: {lr: 2.0e-3}\n";  // a second optimizer section
  ExpectRejected(Spec(p), kInvalid, "'optimizer' is given twice");
  p = {};
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 2, steps: 3}";
  ExpectRejected(Spec(p), kInvalid, "'train.steps' is given twice");
}

// One hostd per node and per socket: a second one started on the same node name, or on another
// node name but the same socket, exits with a clear refusal (before: it took the socket over and
// unlinked it on exit, leaving the first running and unreachable). The first keeps serving.
TEST_F(BadInput, SecondHostdOnTheSameNodeOrSocketIsRefused) {
  auto run_second = [&](const std::string& node, const std::string& log) -> int {
    auto pid = client::SpawnProcess({BuildDir() + "/bin/slidedp-hostd", "--listen", node_->address(), "--node-name",
                                     node, "--state-dir", node_->dir() + "/state2"},
                                    log);
    if (!pid.ok()) return -1;
    int status = 0;
    for (int i = 0; i < 300 && waitpid(*pid, &status, WNOHANG) == 0; ++i) absl::SleepFor(absl::Milliseconds(50));
    if (waitpid(*pid, &status, WNOHANG) == 0 && !WIFEXITED(status)) {
      kill(*pid, SIGKILL);
      waitpid(*pid, &status, 0);
      return -2;  // still running after 15 s: it did not refuse
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -3;
  };
  const std::string same_node_log = node_->dir() + "/second-same-node.log";
  EXPECT_EQ(run_second(node_->node(), same_node_log), 3);
  EXPECT_THAT(ReadFile(same_node_log), HasSubstr("one hostd per node"));
  const std::string same_socket_log = node_->dir() + "/second-same-socket.log";
  EXPECT_EQ(run_second(node_->node() + "other", same_socket_log), 3);
  EXPECT_THAT(ReadFile(same_socket_log), HasSubstr("not taking it over"));
  EXPECT_TRUE(fs::exists(node_->address().substr(5)));  // the first one's socket is still there
}

// ---- output paths (issue 19, class 4): where jobs may write ----
// The harness starts hostd with --output-root <its directory>; the bad specs below try to leave it.

constexpr auto kDeniedCode = absl::StatusCode::kPermissionDenied;

// A directory outside the output root (next to the harness's directory).
std::string Outside() {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/bad-input-outside-", getpid());
  fs::create_directories(dir);
  return fs::canonical(dir).string();
}

TEST_F(BadInput, OutputDirOutsideTheOutputRootIsRefused) {
  SpecParts p;
  for (const std::string& dir : {std::string("/etc/slidedp-escape"), Outside() + "/ckpt", std::string("/")}) {
    p.output = dir;
    ExpectRejected(Spec(p), kDeniedCode, "outside the output root " + output_root_);
  }
  EXPECT_FALSE(fs::exists("/etc/slidedp-escape"));
  EXPECT_FALSE(fs::exists(Outside() + "/ckpt"));
}

TEST_F(BadInput, OutputDirDotDotEscapeIsRefused) {
  SpecParts p;
  for (const std::string& dir : {std::string("../escaped"), std::string("out/../../escaped"),
                                 node_->dir() + "/out/../../escaped", std::string("../../../../../../../../../etc")}) {
    p.output = dir;
    ExpectRejected(Spec(p), kDeniedCode, "outside the output root " + output_root_);
  }
  EXPECT_FALSE(fs::exists(fs::path(output_root_).parent_path() / "escaped"));
}

TEST_F(BadInput, OutputDirSymlinkEscapeIsRefused) {
  const std::string link = output_root_ + "/link-out";
  fs::remove(link);
  fs::create_directory_symlink(Outside(), link);
  SpecParts p;
  for (const std::string& dir : {std::string("link-out/ckpt"), link + "/ckpt", link}) {
    p.output = dir;
    ExpectRejected(Spec(p), kDeniedCode, "resolves through a symbolic link to " + Outside());
  }
  // A link to a path that does not exist (yet) cannot be checked: refused too.
  const std::string dangling = output_root_ + "/dangling-out";
  fs::remove(dangling);
  fs::create_directory_symlink(Outside() + "/not-yet", dangling);
  p.output = "dangling-out/ckpt";
  ExpectRejected(Spec(p), kDeniedCode, "does not exist");
  EXPECT_FALSE(fs::exists(Outside() + "/ckpt"));
  EXPECT_FALSE(fs::exists(Outside() + "/not-yet"));
}

// A relative output.dir lands inside the root, whatever directory the client sends as base_dir
// (model.path and data.path still resolve against it); the record shows the resolved path.
TEST_F(BadInput, RelativeOutputDirLandsInsideTheRoot) {
  SpecParts p;
  p.output = "rel-out/./job";
  p.data = "inputs/data";  // relative to base_dir
  const std::string id = NextId("relative");
  v1::SubmitJobRequest req;
  req.set_job_id(id);
  req.set_spec_yaml(absl::StrReplaceAll(Spec(p), {{", save_final: false}", ", save_final: true}"}}));
  req.set_base_dir(node_->dir());
  auto r = node_->client().Submit(req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->job().resolved_spec_yaml(), HasSubstr("dir: " + output_root_ + "/rel-out/job\n"));
  auto j = node_->WaitFinal(id, 60);
  ASSERT_TRUE(j.ok()) << j.status();
  ASSERT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
  EXPECT_THAT(j->last_checkpoint(), ::testing::StartsWith(output_root_ + "/rel-out/job/checkpoint-"));
  EXPECT_TRUE(fs::exists(j->last_checkpoint() + "/model.safetensors"));
  EXPECT_THAT(j->resolved_spec_yaml(), HasSubstr("dir: " + output_root_ + "/rel-out/job\n"));
}

// The operator's opt-outs, each on a hostd of its own (dry runs: no worker needed):
// --extra-output-root allows one more tree, --allow-output-anywhere any directory hostd can write.
TEST_F(BadInput, OutputRootOptOutsAllowWhatTheOperatorSays) {
  SpecParts p;
  p.output = Outside() + "/allowed";
  auto dry_run = [&](NodeHarness& node) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(Spec(p));
    req.set_base_dir(node.dir());
    req.set_dry_run(true);
    return node.client().Submit(req);
  };
  {
    NodeHarness extra(0, {"--extra-output-root", Outside()});
    auto ok = dry_run(extra);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_THAT(ok->job().resolved_spec_yaml(), HasSubstr("dir: " + Outside() + "/allowed\n"));
    p.output = "/etc/slidedp-escape";
    EXPECT_EQ(dry_run(extra).status().code(), kDeniedCode);
  }
  {
    NodeHarness anywhere(0, {"--allow-output-anywhere"});
    p.output = Outside() + "/anywhere";
    auto ok = dry_run(anywhere);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_THAT(ok->job().resolved_spec_yaml(), HasSubstr("dir: " + Outside() + "/anywhere\n"));
    p.output = "../next-to-the-root";  // relative: still from the root, then wherever it leads
    ok = dry_run(anywhere);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_THAT(ok->job().resolved_spec_yaml(),
                HasSubstr("dir: " + fs::canonical(anywhere.dir()).parent_path().string() + "/next-to-the-root\n"));
  }
}

// Bounds on what the whole suite may leave in hostd: a few descriptors (a gRPC connection,
// LayerAdam's pools made by the first job), and memory growth well below one model's state.
constexpr int64_t kMaxFdGrowth = 8;
constexpr int64_t kMaxRssGrowthKb = 256 << 10;

// Last (gtest runs tests in definition order): after all of the above a good job still runs.
TEST_F(BadInput, ZzGoodJobStillSucceedsAfterwards) {
  auto j = node_->RunJob(Spec({}), NextId("good"), 60);
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
  EXPECT_EQ(j->last().step(), 2);
  EXPECT_TRUE(node_->LeakedSegments().empty());
  // What the whole suite cost the daemon (issue 19): printed into the test log, descriptors bounded.
  const int64_t fds_after = OpenFdCount(node_->hostd_pid());
  const int64_t rss_kb_after = ResidentKb(node_->hostd_pid());
  std::cout << "hostd after the suite: VmRSS " << rss_kb_after / 1024 << " MiB (before: " << rss_kb_before_ / 1024
            << "), " << fds_after << " open file descriptors (before: " << fds_before_ << ")\n";
  ASSERT_GT(fds_before_, 0);
  ASSERT_GT(fds_after, 0);
  EXPECT_LE(fds_after, fds_before_ + kMaxFdGrowth)
      << "hostd leaks file descriptors; ls -l /proc/" << node_->hostd_pid() << "/fd";
  EXPECT_LE(rss_kb_after - rss_kb_before_, kMaxRssGrowthKb);
}

}  // namespace
}  // namespace slidedp::testing
