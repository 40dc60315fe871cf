// A user's results are never lost (issue 48), against real processes: a second run into an output
// directory that holds another run's checkpoints is refused naming that job (node service and
// `slidedp run` alike) and the first run's checkpoint stays; a resume continues the run (its
// keep_last rotates the run's own checkpoints); output.overwrite moves the old ones aside; every
// job has its own metrics file. A dataset made with another tokenizer (Llama 3's, for a model
// with Qwen3's) is refused at submit naming both, unless data.tokenizer_check is false.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {
namespace fs = std::filesystem;
using client::WaitExit;

void WriteData(const std::string& dir) { WriteTinyDataset(dir, 32, 40, 32, 4); }

std::string Spec(const std::string& name, int steps, const std::string& output_extra = "") {
  return absl::StrCat("name: ", name, "\nmodel: {preset: tiny, init_seed: 1}\ndata: {path: data}\n",
                      "output: {dir: out/shared, keep_last: 1", output_extra, "}\n",
                      "train: {seq_len: 32, global_batch: 4, micro_batch: 2, steps: ", steps, ", seed: 1}\n",
                      "optimizer: {lr: 1.0e-3}\nruntime: {workers: 1}\n");
}

std::vector<std::string> Checkpoints(const std::string& dir) {
  std::vector<std::string> out;
  auto listed = checkpoint::ListCheckpoints(dir);
  if (!listed.ok()) return out;
  for (const auto& e : *listed) out.push_back(absl::StrCat(fs::path(e.dir).filename().string(), ":", e.run_id));
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Ownership, RunsIntoOneOutputDirKeepTheirResults) {
  NodeHarness node(1);
  WriteData(node.dir() + "/data");
  const std::string out = node.dir() + "/out/shared";
  MustSucceed(node, Spec("first", 4), "first");
  ASSERT_EQ(Checkpoints(out), std::vector<std::string>{"checkpoint-4:first"});

  // The same spec again (a new job, as a user who forgot to change the directory): refused, at
  // dry run too, naming the job and the ways on; the first run's checkpoint is untouched.
  for (bool dry : {true, false}) {
    v1::SubmitJobRequest req;
    req.set_job_id(dry ? "second-dry" : "second");
    req.set_spec_yaml(Spec("first", 2));
    req.set_base_dir(node.dir());
    req.set_dry_run(dry);
    const absl::Status s = node.client().Submit(req).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "job first (checkpoint-4)")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "output.overwrite: true")) << s;
  }
  EXPECT_EQ(Checkpoints(out), std::vector<std::string>{"checkpoint-4:first"});

  // A resume continues the run: its checkpoints are the run's, and keep_last 1 rotates the run's.
  v1::Job resumed = MustSucceed(node, Spec("first", 6), "resumed", "first");
  EXPECT_EQ(resumed.run_id(), "first");
  EXPECT_EQ(Checkpoints(out), std::vector<std::string>{"checkpoint-6:first"});

  // output.overwrite: the old run's checkpoints move aside, nothing is deleted.
  MustSucceed(node, Spec("other", 3, ", overwrite: true"), "other");
  EXPECT_EQ(Checkpoints(out), std::vector<std::string>{"checkpoint-3:other"});
  int superseded = 0;
  for (const auto& e : fs::directory_iterator(out)) {
    if (!absl::StartsWith(e.path().filename().string(), "superseded-")) continue;
    ++superseded;
    EXPECT_TRUE(fs::exists(e.path() / "checkpoint-6" / "COMPLETE")) << e.path();
    EXPECT_TRUE(absl::StrContains(e.path().filename().string(), "other")) << e.path();
  }
  EXPECT_EQ(superseded, 1);
  // Each job its own metrics file, each holding only its own steps.
  for (const auto& [id, first_step] : std::vector<std::pair<std::string, int>>{{"first", 1}, {"resumed", 5}, {"other", 1}}) {
    std::ifstream in(out + "/metrics-" + id + ".jsonl");
    std::string line;
    ASSERT_TRUE(std::getline(in, line)) << id;
    EXPECT_EQ(nlohmann::json::parse(line)["step"], first_step) << id;
  }
}

// `slidedp run` twice with the same spec: the second run is refused before it starts (its private
// hostd numbers jobs from 1 again, so this is also where two runs would have shared a job id and a
// metrics file); with output.overwrite it runs as another job id.
TEST(Ownership, SlidedpRunTwiceIsRefusedThenOverwriteKeepsBoth) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/own-run-", getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  WriteData(dir + "/data");
  auto run = [&](const std::string& spec_text, const std::string& log) {
    std::ofstream(dir + "/job.yaml") << spec_text;
    auto pid = client::SpawnProcess({BuildDir() + "/bin/slidedp", "run", dir + "/job.yaml", "--backend", "cpu",
                                     "--cpu-workers", "1", "--policy-cache", "none"},
                                    dir + "/" + log);
    EXPECT_TRUE(pid.ok()) << pid.status();
    return pid.ok() ? WaitExit(*pid, 180) : -1;
  };
  ASSERT_EQ(run(Spec("tiny", 3), "run1.log"), 0) << ReadFile(dir + "/run1.log");
  const std::string out = dir + "/out/shared";
  const std::vector<std::string> first = Checkpoints(out);
  ASSERT_EQ(first.size(), 1u);
  EXPECT_NE(run(Spec("tiny", 2), "run2.log"), 0);
  const std::string log2 = ReadFile(dir + "/run2.log");
  EXPECT_TRUE(absl::StrContains(log2, "FAILED_PRECONDITION")) << log2;
  EXPECT_TRUE(absl::StrContains(log2, "holds the checkpoints of another run: job tiny-1")) << log2;
  EXPECT_EQ(Checkpoints(out), first);

  ASSERT_EQ(run(Spec("tiny", 2, ", overwrite: true"), "run3.log"), 0) << ReadFile(dir + "/run3.log");
  EXPECT_EQ(Checkpoints(out), std::vector<std::string>{"checkpoint-2:tiny-2"});
  EXPECT_TRUE(fs::exists(out + "/metrics-tiny-1.jsonl"));
  EXPECT_TRUE(fs::exists(out + "/metrics-tiny-2.jsonl"));
  if (!HasFailure()) fs::remove_all(dir);
}

// A model directory with Qwen3's tokenizer and a vocabulary that holds every Llama 3 id, and
// datasets prepared by `slidedp prepare` with each tokenizer.
TEST(Ownership, DatasetOfAnotherTokenizerIsRefusedAtSubmit) {
  const char* src = std::getenv("SLIDEDP_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "ctest sets SLIDEDP_SOURCE_DIR";
  NodeHarness node(1);
  const std::string dir = node.dir();
  // The model: a tiny Qwen3 shape with Qwen3's vocabulary size (the weights are not read at submit).
  const std::string model = dir + "/qwen3-model";
  fs::create_directories(model);
  std::ofstream(model + "/config.json")
      << R"({"model_type":"qwen3","architectures":["Qwen3ForCausalLM"],"hidden_size":32,"num_hidden_layers":1,)"
      << R"("num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,"intermediate_size":64,)"
      << R"("vocab_size":151936,"max_position_embeddings":4096,"rms_norm_eps":1e-6,"rope_theta":1000000,)"
      << R"("tie_word_embeddings":true,"hidden_act":"silu"})";
  std::ofstream(model + "/model.safetensors") << "";
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    fs::copy_file(std::string(src) + "/tests/data/tokenizer/qwen3/" + f, model + "/" + f);
  }
  std::string text;
  for (int i = 0; i < 64; ++i) text += absl::StrCat(R"({"text": "Document )", i, R"( says hello to the tokenizer."})", "\n");
  std::ofstream(dir + "/docs.jsonl") << text;
  auto prepare = [&](const std::string& tokenizer_dir, const std::string& out) {
    auto pid = client::SpawnProcess({BuildDir() + "/bin/slidedp", "prepare", "--model", tokenizer_dir, "--input",
                                     dir + "/docs.jsonl", "--output", out, "--seq-len", "64", "--pack"},
                                    out + ".log");
    EXPECT_TRUE(pid.ok());
    EXPECT_EQ(pid.ok() ? WaitExit(*pid, 120) : -1, 0) << ReadFile(out + ".log");
  };
  prepare(std::string(src) + "/tests/data/chat_templates/llama3", dir + "/llama-data");
  prepare(model, dir + "/qwen-data");
  auto submit = [&](const std::string& data, const std::string& extra) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(absl::StrCat("name: tok\nmodel: {path: ", model, "}\ndata: {path: ", data, "/train", extra,
                                   "}\ntrain: {seq_len: 64, global_batch: 1, steps: 1}\n"));
    req.set_base_dir(dir);
    req.set_dry_run(true);
    return node.client().Submit(req).status();
  };
  const absl::Status refused = submit(dir + "/llama-data", "");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "was tokenized by another tokenizer than the model's")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "chat_templates/llama3")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "qwen3-model")) << refused;
  EXPECT_TRUE(submit(dir + "/llama-data", ", tokenizer_check: false").ok());
  const absl::Status same = submit(dir + "/qwen-data", "");
  EXPECT_TRUE(same.ok()) << same;
}

}  // namespace
}  // namespace slidedp::testing
