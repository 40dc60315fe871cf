// Checkpoints as complete model directories, end to end with the real binaries: `slidedp run`
// trains a tiny CPU job from an HF model directory that holds tokenizer files; its checkpoint
// holds them and a generation_config.json; `slidedp export` writes the model directory (sharded
// here, no optimizer state) whose weights are the checkpoint's bit for bit, refuses to overwrite
// it without --force, and writes FP32 weights equal to the master; a job then trains from the
// exported, sharded directory. A directory holding two runs' checkpoints is refused without
// --job, which chooses; destination mistakes (no parent, a directory that may not be written)
// are named with their code, never INTERNAL.
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "common/data/synthetic.h"
#include "common/model/model_config.h"
#include "common/safetensors/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;

// Runs argv to its end (at most timeout_s); returns the exit status and the output.
std::pair<int, std::string> RunCommand(const std::vector<std::string>& argv, const std::string& log, double timeout_s) {
  auto pid = client::SpawnProcess(argv, log);
  EXPECT_TRUE(pid.ok()) << pid.status();
  if (!pid.ok()) return {-1, ""};
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  int st = 0;
  while (waitpid(*pid, &st, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(*pid, SIGKILL);
      waitpid(*pid, nullptr, 0);
      return {-1, ReadFile(log)};
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), ReadFile(log)};
}

// Runs argv as the user nobody when this process is root (a directory of mode 0555 stops no
// root), else as itself, for at most timeout_s; returns the exit status and the output.
std::pair<int, std::string> RunUnprivileged(const std::vector<std::string>& argv, double timeout_s) {
  int fds[2];
  if (::pipe(fds) != 0) return {-1, "pipe failed"};
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    if (::geteuid() == 0 && (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      ::_exit(126);
    }
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  char buf[4096];
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    const int left_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (left_ms <= 0 || ::poll(&p, 1, left_ms) <= 0) {
      ::kill(pid, SIGKILL);
      break;
    }
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

// The tiny preset as an HF model directory (F32 weights from the seeded init) with the Qwen3
// tokenizer's files (tests/data/tokenizer/qwen3).
void WriteModelDir(const std::string& dir) {
  fs::create_directories(dir);
  const ModelConfig config = *ModelConfig::Preset("tiny");
  const ModelLayout layout = ModelLayout::Build(config);
  std::ofstream(dir + "/config.json") << config.ToJson();
  std::vector<std::vector<float>> master;
  for (const UnitLayout& u : layout.units) master.emplace_back(u.numel, 0.0f);
  checkpoint::InitRandom(layout, 5, [&](int u) { return master[u].data(); });
  std::vector<st::TensorSource> tensors;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      st::TensorSource s;
      s.name = t.hf_name;
      s.dtype = st::Dtype::kF32;
      s.shape = t.shape;
      s.data = master[u.index].data() + t.offset_numel;
      tensors.push_back(std::move(s));
    }
  }
  ASSERT_TRUE(st::WriteFile(dir + "/model.safetensors", tensors).ok());
  const char* src = getenv("SLIDEDP_SOURCE_DIR");
  const std::string tokenizer = absl::StrCat(src != nullptr ? src : ".", "/tests/data/tokenizer/qwen3");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) fs::copy_file(tokenizer + "/" + f, dir + "/" + f);
}

std::string WriteSpec(const std::string& dir, const std::string& name, const std::string& model, int steps) {
  const std::string spec = dir + "/" + name + ".yaml";
  std::ofstream(spec) << "name: " << name << "\nmodel: {path: " << model << "}\ndata: {path: data}\n"
                      << "output: {dir: out-" << name << ", save_every: 2}\n"
                      << "train: {seq_len: 64, global_batch: 4, micro_batch: 2, steps: " << steps
                      << ", seed: 0, max_grad_norm: 1.0}\n"
                      << "optimizer: {lr: 1.0e-3, weight_decay: 0.1}\nruntime: {workers: 2}\n";
  return spec;
}

std::pair<int, std::string> RunJob(const std::string& dir, const std::string& spec, const std::string& name) {
  return RunCommand({BuildDir() + "/bin/slidedp", "run", spec, "--backend", "cpu", "--cpu-workers", "2", "--run-dir",
                     dir + "/run-" + name},
                    dir + "/" + name + ".log", 180);
}

// Every weight tensor of an HF directory (single file or sharded with an index): name -> (dtype, bytes).
std::map<std::string, std::pair<st::Dtype, std::string>> Weights(const std::string& dir) {
  std::vector<std::string> files;
  if (fs::exists(dir + "/model.safetensors")) {
    files.push_back("model.safetensors");
  } else {
    std::set<std::string> shards;
    auto index = nlohmann::json::parse(ReadFile(dir + "/model.safetensors.index.json"));
    for (auto& [name, file] : index["weight_map"].items()) shards.insert(file.get<std::string>());
    files.assign(shards.begin(), shards.end());
  }
  std::map<std::string, std::pair<st::Dtype, std::string>> out;
  for (const std::string& f : files) {
    auto file = st::SafetensorsFile::Open(dir + "/" + f);
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) continue;
    for (const st::TensorInfo& t : (*file)->tensors()) out[t.name] = {t.dtype, std::string((*file)->Bytes(t))};
  }
  return out;
}

std::set<std::string> Names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

TEST(Export, CheckpointsAreModelDirectoriesAndExportWritesOne) {
  const std::string dir =
      (fs::path(::testing::TempDir()) / ("export-" + std::to_string(getpid()))).lexically_normal().string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  WriteModelDir(dir + "/model");
  data::SyntheticOptions o;
  o.vocab_size = 512;
  o.num_documents = 64;
  o.seed = 9;
  o.min_doc_tokens = 8;
  o.max_doc_tokens = 90;
  o.seq_len = 64;
  ASSERT_TRUE(data::WriteSyntheticDataset(dir + "/data", o).ok());

  auto [rc, log] = RunJob(dir, WriteSpec(dir, "train", "model", 4), "train");
  ASSERT_EQ(rc, 0) << log;
  EXPECT_TRUE(absl::StrContains(log, "succeeded after 4 step(s)")) << log;

  // The checkpoint: the model's tokenizer files as they were, and a generation_config.json made
  // from config.json (the model has none).
  const std::string ckpt = dir + "/out-train/checkpoint-4";
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_EQ(ReadFile(ckpt + "/" + f), ReadFile(dir + "/model/" + f)) << f;
  }
  const auto generation = nlohmann::json::parse(ReadFile(ckpt + "/generation_config.json"));
  const auto config = nlohmann::json::parse(ReadFile(ckpt + "/config.json"));
  EXPECT_EQ(generation["_from_model_config"], true);
  if (config.contains("eos_token_id")) {
    EXPECT_EQ(generation["eos_token_id"], config["eos_token_id"]);
  }
  EXPECT_TRUE(checkpoint::VerifyCheckpoint(ckpt).ok());

  // Export the job's newest checkpoint, sharded (the tiny model's BF16 weights are ~250 KB).
  const std::string slidedp = BuildDir() + "/bin/slidedp";
  const std::string exported = dir + "/exported";
  auto [erc, elog] = RunCommand({slidedp, "export", dir + "/out-train", "--to", exported, "--max-shard-size", "60KB"},
                                dir + "/export.log", 60);
  ASSERT_EQ(erc, 0) << elog;
  EXPECT_TRUE(absl::StrContains(elog, "exported " + ckpt + " (step 4)")) << elog;
  std::set<std::string> names = Names(exported);
  for (const char* f : {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                        "generation_config.json"}) {
    EXPECT_EQ(names.count(f), 1u) << f;
  }
  for (const char* f : {"optimizer.safetensors", "trainer_state.json", "COMPLETE", "model.safetensors"}) {
    EXPECT_EQ(names.count(f), 0u) << f;
  }
  int shards = 0;
  for (const std::string& n : names) shards += absl::StartsWith(n, "model-") && absl::EndsWith(n, ".safetensors");
  EXPECT_GE(shards, 3);
  EXPECT_EQ(ReadFile(exported + "/tokenizer.json"), ReadFile(dir + "/model/tokenizer.json"));
  EXPECT_EQ(ReadFile(exported + "/generation_config.json"), ReadFile(ckpt + "/generation_config.json"));
  const auto ours = Weights(ckpt), theirs = Weights(exported);
  ASSERT_FALSE(ours.empty());
  ASSERT_EQ(ours.size(), theirs.size());
  for (const auto& [name, w] : ours) {
    auto it = theirs.find(name);
    ASSERT_NE(it, theirs.end()) << name;
    EXPECT_EQ(it->second.first, st::Dtype::kBF16) << name;
    EXPECT_TRUE(it->second == w) << name << ": the exported weights are not the checkpoint's";
  }

  // An existing model directory is kept unless --force.
  auto [again, again_log] = RunCommand({slidedp, "export", ckpt, "--to", exported}, dir + "/again.log", 60);
  EXPECT_NE(again, 0) << again_log;
  EXPECT_TRUE(absl::StrContains(again_log, "FAILED_PRECONDITION")) << again_log;
  EXPECT_TRUE(absl::StrContains(again_log, "--force")) << again_log;
  auto [forced, forced_log] = RunCommand(
      {slidedp, "export", dir + "/out-train/checkpoint-2", "--to", exported, "--force"}, dir + "/force.log", 60);
  EXPECT_EQ(forced, 0) << forced_log;
  EXPECT_TRUE(absl::StrContains(forced_log, "(replaced)")) << forced_log;
  EXPECT_TRUE(Weights(exported) == Weights(dir + "/out-train/checkpoint-2"));

  // FP32: the master of optimizer.safetensors exactly.
  auto [f32, f32_log] =
      RunCommand({slidedp, "export", ckpt, "--to", dir + "/exported-f32", "--dtype", "fp32"}, dir + "/f32.log", 60);
  ASSERT_EQ(f32, 0) << f32_log;
  const ModelLayout layout = ModelLayout::Build(*ModelConfig::FromFile(ckpt + "/config.json"));
  auto optimizer = st::SafetensorsFile::Open(ckpt + "/optimizer.safetensors");
  ASSERT_TRUE(optimizer.ok()) << optimizer.status();
  const auto f32_weights = Weights(dir + "/exported-f32");
  for (const UnitLayout& u : layout.units) {
    const st::TensorInfo* master = (*optimizer)->Find("unit." + u.name + ".master");
    ASSERT_NE(master, nullptr) << u.name;
    const std::string bytes((*optimizer)->Bytes(*master));
    for (const TensorSlot& t : u.tensors) {
      const auto& w = f32_weights.at(t.hf_name);
      EXPECT_EQ(w.first, st::Dtype::kF32);
      EXPECT_EQ(w.second, bytes.substr(t.offset_numel * 4, t.numel * 4)) << t.hf_name;
    }
  }

  // The exported (sharded) directory is a model.path a job trains from; its checkpoint again
  // carries the tokenizer files.
  auto [next, next_log] = RunJob(dir, WriteSpec(dir, "again", "exported", 2), "again");
  ASSERT_EQ(next, 0) << next_log;
  EXPECT_EQ(ReadFile(dir + "/out-again/checkpoint-2/tokenizer.json"), ReadFile(dir + "/model/tokenizer.json"));

  // Two runs' checkpoints in one directory (put together by hand: hostd keeps runs apart): the
  // export names both and how to choose; --job chooses by the job's id.
  const std::string mixed = dir + "/mixed";
  fs::create_directories(mixed);
  fs::copy(ckpt, mixed + "/checkpoint-4", fs::copy_options::recursive);
  fs::copy(dir + "/out-again/checkpoint-2", mixed + "/checkpoint-2", fs::copy_options::recursive);
  const auto train_job = checkpoint::CheckpointJobId(mixed + "/checkpoint-4");
  const auto again_job = checkpoint::CheckpointJobId(mixed + "/checkpoint-2");
  ASSERT_TRUE(train_job.ok() && again_job.ok()) << train_job.status() << again_job.status();
  ASSERT_NE(*train_job, *again_job);
  auto [two, two_log] =
      RunCommand({slidedp, "export", mixed, "--to", dir + "/exported-mixed"}, dir + "/two-runs.log", 60);
  EXPECT_NE(two, 0) << two_log;
  for (const std::string& want :
       {std::string("FAILED_PRECONDITION"), "run " + *train_job, "run " + *again_job, mixed + "/checkpoint-4 (step 4)",
        mixed + "/checkpoint-2 (step 2)", std::string("--job")}) {
    EXPECT_TRUE(absl::StrContains(two_log, want)) << want << " in " << two_log;
  }
  EXPECT_FALSE(fs::exists(dir + "/exported-mixed"));
  auto [chosen, chosen_log] = RunCommand(
      {slidedp, "export", mixed, "--to", dir + "/exported-mixed", "--job", *again_job}, dir + "/chosen.log", 60);
  ASSERT_EQ(chosen, 0) << chosen_log;
  EXPECT_TRUE(absl::StrContains(chosen_log, "exported " + mixed + "/checkpoint-2 (step 2)")) << chosen_log;
  EXPECT_TRUE(Weights(dir + "/exported-mixed") == Weights(mixed + "/checkpoint-2"));

  // Destination mistakes: a parent that does not exist (NOT_FOUND, not created), a directory
  // that may not be written (PERMISSION_DENIED; run as nobody when the test runs as root).
  auto [no_parent, no_parent_log] =
      RunCommand({slidedp, "export", ckpt, "--to", dir + "/no/such/model"}, dir + "/no-parent.log", 60);
  EXPECT_NE(no_parent, 0) << no_parent_log;
  EXPECT_TRUE(absl::StrContains(no_parent_log, "NOT_FOUND")) << no_parent_log;
  EXPECT_TRUE(absl::StrContains(no_parent_log, dir + "/no/such")) << no_parent_log;
  EXPECT_FALSE(fs::exists(dir + "/no"));
  fs::create_directories(dir + "/ro");
  ASSERT_EQ(::chmod((dir + "/ro").c_str(), 0555), 0);
  auto [ro, ro_log] = RunUnprivileged({slidedp, "export", ckpt, "--to", dir + "/ro/model"}, 60);
  EXPECT_NE(ro, 0) << ro_log;
  EXPECT_TRUE(absl::StrContains(ro_log, "PERMISSION_DENIED")) << ro_log;
  EXPECT_TRUE(absl::StrContains(ro_log, dir + "/ro")) << ro_log;
  EXPECT_FALSE(absl::StrContains(ro_log, "INTERNAL")) << ro_log;
  EXPECT_TRUE(fs::is_empty(dir + "/ro"));
  ::chmod((dir + "/ro").c_str(), 0755);
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::testing
