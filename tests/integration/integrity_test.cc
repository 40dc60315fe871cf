// Integrity against a real hostd and real CPU workers (issue 19, class 5): what was verified is what
// trains, and nothing non-finite trains silently.
//   - a dataset file with a flipped bit fails its job at start with DATA_LOSS naming the file,
//     before any host state is allocated (the CRC-32s of the manifest are verified at job start);
//   - a dataset truncated while a job reads it fails that job with DATA_LOSS naming the file, and
//     the workers survive it (no SIGBUS) and run the next job;
//   - a NaN weight in a resume checkpoint or an HF model fails the job with DATA_LOSS naming the
//     file and the tensor;
//   - a NaN gradient or loss (injected by the workers, SLIDEDP_INJECT_NONFINITE) fails the job
//     with DATA_LOSS naming the step, and the unit and element or the rank; with
//     train.skip_nonfinite: true the job succeeds, that step skipped (metrics, log, checkpoint).
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "common/data/synthetic.h"
#include "gmock/gmock.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string MakeData(const std::string& dir) {
  data::SyntheticOptions o;
  o.vocab_size = 512;
  o.num_documents = 48;
  o.seed = 3;
  o.min_doc_tokens = 8;
  o.max_doc_tokens = 40;
  o.seq_len = 32;
  o.overwrite = data::Overwrite::kYes;
  auto m = data::WriteSyntheticDataset(dir, o);
  EXPECT_TRUE(m.ok()) << m.status();
  return dir;
}

struct SpecParts {
  std::string name = "integrity";
  std::string model = "{preset: tiny, init_seed: 1}";
  std::string data;
  std::string output = "out";
  std::string train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 4, seed: 1}";
  std::string runtime = "{workers: 2, grad_reduction: cpu, step_timeout_ms: 20000}";
  std::string save = "save_final: false";
};

std::string Spec(const SpecParts& p) {
  return absl::StrCat("name: ", p.name, "\nmodel: ", p.model, "\ndata: {path: ", p.data, "}\noutput: {dir: ", p.output,
                      ", ", p.save, "}\ntrain: ", p.train, "\noptimizer: {lr: 1.0e-3}\nruntime: ", p.runtime, "\n");
}

absl::StatusOr<v1::Job> RunSpec(NodeHarness& node, const SpecParts& p, const std::string& id,
                                const std::string& resume = "") {
  auto j = node.RunJob(Spec(p), id, 120, resume);
  if (j.ok()) std::cout << "  " << id << ": " << v1::JobState_Name(j->state()) << " " << j->error() << "\n";
  return j;
}

void ExpectFailed(const absl::StatusOr<v1::Job>& j, absl::StatusCode code, const std::vector<std::string>& fragments) {
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(j->error_code(), static_cast<int>(code)) << j->error();
  for (const std::string& f : fragments) EXPECT_THAT(j->error(), HasSubstr(f));
}

// The node's directory as paths in job errors show it (normalized).
std::string Dir(const NodeHarness& node) { return fs::path(node.dir()).lexically_normal().string(); }

void ExpectWorkersKept(NodeHarness& node, int n) {
  auto ws = node.client().Workers();
  ASSERT_TRUE(ws.ok()) << ws.status();
  EXPECT_EQ(static_cast<int>(ws->size()), n) << "a worker was lost; logs in " << node.dir();
  for (int pid : node.worker_pids()) EXPECT_EQ(::kill(pid, 0), 0) << "worker pid " << pid << " is gone";
}

void FlipBit(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x01));
}

// A CRC-32 mismatch is found when the job starts (not at submit: that would stall the gRPC
// handler on a large dataset), before admission and any host state.
TEST(Integrity, DatasetWithAFlippedBitFailsAtJobStartNamingTheFile) {
  NodeHarness node(2);
  SpecParts p;
  p.data = MakeData(Dir(node) + "/data-flipped");
  FlipBit(p.data + "/tokens.bin", 4 * 10);  // token 10's low bit: still a valid id below 512
  auto j = RunSpec(node, p, "flipped");
  ExpectFailed(j, absl::StatusCode::kDataLoss,
               {"dataset file " + p.data + "/tokens.bin is corrupt: CRC-32", "does not match the manifest's"});
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->host_state_bytes(), 0) << "refused before the state was sized";
  EXPECT_TRUE(node.Segments().empty()) << "nothing allocated";
  // The same dataset, intact, trains; hostd logs the verification.
  p.data = MakeData(Dir(node) + "/data-good");
  auto good = RunSpec(node, p, "good");
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->state(), v1::JOB_STATE_SUCCEEDED) << good->error();
  EXPECT_THAT(ReadFile(node.dir() + "/hostd0.log"), HasSubstr("dataset " + p.data + " verified: 4 files"));
  ExpectWorkersKept(node, 2);
}

// Workers read rows with pread and check the files' identity: a dataset truncated under a running
// job fails it with DATA_LOSS naming the file (with mmap the worker died of SIGBUS), the workers
// stay attached and run the next job.
TEST(Integrity, DatasetTruncatedWhileAJobReadsItFailsThatJobAndTheWorkersServeTheNext) {
  NodeHarness node(2);
  SpecParts p;
  p.data = MakeData(Dir(node) + "/data-truncated");
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 1000000, seed: 1}";
  v1::SubmitJobRequest req;
  req.set_job_id("long");
  req.set_spec_yaml(Spec(p));
  req.set_base_dir(node.dir());
  ASSERT_TRUE(node.client().Submit(req).ok());
  // Until it has made a few steps.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    auto job = node.client().GetJob("long");
    ASSERT_TRUE(job.ok()) << job.status();
    if (job->last().step() >= 3) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  fs::resize_file(p.data + "/tokens.bin", 0);
  auto j = node.WaitFinal("long", 60);
  ExpectFailed(j, absl::StatusCode::kDataLoss, {p.data + "/tokens.bin", "worker cpu"});
  ASSERT_TRUE(j.ok());
  EXPECT_TRUE(absl::StrContains(j->error(), "shorter than when the job opened it") ||
              absl::StrContains(j->error(), "changed while a job reads it"))
      << j->error();
  ExpectWorkersKept(node, 2);
  p.data = MakeData(Dir(node) + "/data-next");
  p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 3, seed: 1}";
  auto next = RunSpec(node, p, "next");
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->state(), v1::JOB_STATE_SUCCEEDED) << next->error();
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// A NaN in the state a job starts from: the resume checkpoint's optimizer state, or an HF model's
// weights. Either is DATA_LOSS naming the file, the tensor and the element.
TEST(Integrity, NonFiniteWeightsInACheckpointOrModelFailTheJobNamingTensorAndFile) {
  NodeHarness node(1);
  SpecParts p;
  p.data = MakeData(Dir(node) + "/data");
  p.runtime = "{workers: 1, step_timeout_ms: 20000}";
  p.save = "save_final: true, save_dtype: bf16";
  p.output = "out-ckpt";
  auto saved = RunSpec(node, p, "saved");
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ(saved->state(), v1::JOB_STATE_SUCCEEDED) << saved->error();
  const std::string ckpt = saved->last_checkpoint();
  ASSERT_FALSE(ckpt.empty());

  // Resume from it with a NaN in layer 0's master (element 300: q_proj[0, 44]).
  const std::string resume = Dir(node) + "/resume-nan/" + fs::path(ckpt).filename().string();
  fs::create_directories(resume);
  fs::copy(ckpt, resume, fs::copy_options::recursive);
  checkpoint::testing::PatchTensorElement(resume + "/optimizer.safetensors", "unit.layer.0.master", 300, std::nanf(""));
  SpecParts more = p;
  more.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 6, seed: 1}";
  more.output = "out-resumed";
  ExpectFailed(RunSpec(node, more, "resumed-nan", resume), absl::StatusCode::kDataLoss,
               {resume + "/optimizer.safetensors", "tensor \"unit.layer.0.master\" holds nan at element 300",
                "model.layers.0.self_attn.q_proj.weight[0, 44]"});
  // The intact checkpoint resumes.
  auto resumed = RunSpec(node, more, "resumed", ckpt);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->state(), v1::JOB_STATE_SUCCEEDED) << resumed->error();

  // The checkpoint as an HF model directory, with an infinite weight in its BF16 model file.
  const std::string model = Dir(node) + "/model-inf";
  fs::create_directories(model);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(ckpt + "/" + f, model + "/" + f);
  checkpoint::testing::PatchTensorElement(model + "/model.safetensors", "model.layers.1.mlp.down_proj.weight", 129,
                                          -INFINITY);
  SpecParts hf = p;
  hf.model = "{path: " + model + "}";
  hf.save = "save_final: false";
  ExpectFailed(RunSpec(node, hf, "hf-inf"), absl::StatusCode::kDataLoss,
               {model + "/model.safetensors", "tensor \"model.layers.1.mlp.down_proj.weight\" holds -inf at [1, 1]"});
  ExpectWorkersKept(node, 1);
}

// Non-finite values from the workers (test-only injection, SLIDEDP_INJECT_NONFINITE): without
// train.skip_nonfinite the job fails with the step and what is not finite; with it the job
// succeeds and the step is skipped: the metrics, hostd's log and the checkpoint record it.
TEST(Integrity, NonFiniteGradientOrLossFailsTheJobOrIsSkipped) {
  struct Case {
    std::string what;
    std::string inject;  // on every worker, filtered by rank
    std::vector<std::string> fail_message;
  };
  for (const Case& c :
       {Case{"gradient",
             "grad:3:2@1",
             {"step 3: gradient of unit 2 (layer.1) is not finite: model.layers.1.input_layernorm.weight[0] is NaN",
              "(rank 1))", "nothing of the step was applied", "train.skip_nonfinite"}},
        Case{"loss", "loss:2@1", {"step 2: loss is NaN on worker cpu", "(rank 1)"}}}) {
    SCOPED_TRACE(c.what);
    NodeHarness node(2, {}, {"SLIDEDP_INJECT_NONFINITE=" + c.inject});
    SpecParts p;
    p.data = MakeData(Dir(node) + "/data");
    p.output = "out-" + c.what;
    ExpectFailed(RunSpec(node, p, "fail-" + c.what), absl::StatusCode::kDataLoss, c.fail_message);
    ExpectWorkersKept(node, 2);

    p.train = "{seq_len: 32, global_batch: 4, micro_batch: 2, steps: 4, seed: 1, skip_nonfinite: true}";
    p.save = "save_final: true";
    const std::string id = "skip-" + c.what;
    auto j = RunSpec(node, p, id);
    ASSERT_TRUE(j.ok()) << j.status();
    ASSERT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
    const int skipped_step = c.what == "gradient" ? 3 : 2;
    auto lines = MetricsLines(node, p.output, id);
    ASSERT_EQ(lines.size(), 4u);
    for (const nlohmann::json& l : lines) {
      const int step = l["step"].get<int>();
      EXPECT_EQ(l["skipped"].get<bool>(), step == skipped_step) << l.dump();
      EXPECT_EQ(l["skipped_steps"].get<int>(), step >= skipped_step ? 1 : 0) << l.dump();
    }
    EXPECT_THAT(ReadFile(node.dir() + "/hostd0.log"),
                HasSubstr(absl::StrCat("warning: step ", skipped_step, " skipped (train.skip_nonfinite): ")));
    std::ifstream ts(j->last_checkpoint() + "/trainer_state.json");
    const nlohmann::json state = nlohmann::json::parse(ts);
    EXPECT_EQ(state["trainer_state"]["skipped_steps"], 1) << state.dump();
  }
}

}  // namespace
}  // namespace slidedp::testing
