// `slidedp run` stopped with Ctrl-C and resumed, as a user does it, with real processes: the first
// SIGINT (sent to the CLI's process group, as a terminal sends it) ends the job at the next step
// boundary with a checkpoint, and the CLI prints it with the command that resumes it and exits
// 130, without an UNAVAILABLE from the node going away; `slidedp run --resume latest` finishes the
// job, and its final checkpoint is bitwise the one of a run never stopped. A second SIGINT stops
// the private node at once; `--resume latest` with no checkpoint is a clear NOT_FOUND before any
// process starts.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/data/synthetic.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

namespace fs = std::filesystem;
using client::WaitExit;

constexpr int kSteps = 40;

// A fresh directory for one test, its path normalized (as the CLI prints paths).
std::string TestDir(const std::string& stem) {
  const std::string dir =
      fs::path(absl::StrCat(::testing::TempDir(), "/", stem, getpid())).lexically_normal().string();
  fs::remove_all(dir);
  return dir;
}

// A synthetic dataset in `dir`/data and a spec of the tiny preset, `dir`/NAME.yaml, whose output
// goes to `dir`/out-NAME (a checkpoint at the end only). The specs of one dir share the data.
std::string WriteSpec(const std::string& dir, const std::string& name, int steps) {
  fs::create_directories(dir);
  if (!fs::exists(dir + "/data")) WriteTinyDataset(dir + "/data", 64, 90, 64, 9);
  const std::string spec = absl::StrCat(dir, "/", name, ".yaml");
  std::ofstream(spec) << "name: resume\nmodel: {preset: tiny, init_seed: 1}\ndata: {path: data}\n"
                      << "output: {dir: out-" << name << ", keep_last: 5}\n"
                      << "train: {seq_len: 64, global_batch: 4, micro_batch: 2, steps: " << steps
                      << ", seed: 0, max_grad_norm: 1.0}\n"
                      << "optimizer: {lr: 1.0e-3, weight_decay: 0.01}\n"
                      << "schedule: {kind: cosine, warmup_steps: 5}\n"
                      << "runtime: {workers: 2}\n";
  return spec;
}

// Starts `slidedp run SPEC ARGS...` on two CPU workers; output in DIR/LOG. Its pid leads its own
// process group (SpawnProcess), as a shell's foreground job does.
int StartRun(const std::string& dir, const std::string& spec, const std::string& log,
             std::vector<std::string> args = {}) {
  std::vector<std::string> argv = {BuildDir() + "/bin/slidedp", "run",    spec,        "--backend", "cpu",
                                   "--cpu-workers",             "2",      "--run-dir", dir + "/run-" + log};
  argv.insert(argv.end(), args.begin(), args.end());
  auto pid = client::SpawnProcess(argv, dir + "/" + log + ".log");
  EXPECT_TRUE(pid.ok()) << pid.status();
  return pid.ok() ? *pid : -1;
}

// Steps the job has logged so far in its metrics file(s) under `out`.
int StepsLogged(const std::string& out) {
  int steps = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    if (e.path().filename().string().rfind("metrics-", 0) != 0) continue;
    for (const auto& line : absl::StrSplit(ReadFile(e.path().string()), '\n', absl::SkipEmpty())) {
      (void)line;
      ++steps;
    }
  }
  return steps;
}

// Waits until the job has logged `steps` steps; false after `timeout_s`.
bool WaitSteps(const std::string& out, int steps, double timeout_s) {
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  while (StepsLogged(out) < steps) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// Whether a process of the private node is left: a hostd or worker whose command line names the
// run dir's socket.
bool NodeProcessLeft(const std::string& run_dir) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    if (absl::StrContains(ReadFile(e.path().string() + "/cmdline"), run_dir + "/hostd.sock")) return true;
  }
  return false;
}

// The files of a checkpoint directory by name (regular files only), their bytes.
std::map<std::string, std::string> CheckpointFiles(const std::string& dir) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.is_regular_file()) out[e.path().filename().string()] = ReadFile(e.path().string());
  }
  return out;
}

// trainer_state.json without what names the job and when it ran.
nlohmann::json WithoutJobAndTimes(nlohmann::json j) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end();) {
      const std::string& k = it.key();
      if (k == "job_id" || k == "run_id" || absl::StrContains(k, "time") || absl::StrContains(k, "date")) {
        it = j.erase(it);
      } else {
        *it = WithoutJobAndTimes(*it);
        ++it;
      }
    }
  }
  return j;
}

TEST(RunResume, CtrlCSavesACheckpointAndResumeLatestFinishesBitwiseAsAnUninterruptedRun) {
  const std::string dir = TestDir("run-resume-");
  fs::remove_all(dir);
  const std::string whole = WriteSpec(dir, "whole", kSteps);
  const std::string stopped = WriteSpec(dir, "stopped", kSteps);

  // The run never stopped.
  const int a = StartRun(dir, whole, "whole");
  ASSERT_GT(a, 0);
  ASSERT_EQ(WaitExit(a, 300), 0) << ReadFile(dir + "/whole.log");
  const std::string want = absl::StrCat(dir, "/out-whole/checkpoint-", kSteps);
  ASSERT_TRUE(fs::exists(want + "/COMPLETE")) << ReadFile(dir + "/whole.log");

  // Ctrl-C after a few steps: a checkpoint at the next step boundary, printed with the command.
  const int b = StartRun(dir, stopped, "stopped");
  ASSERT_GT(b, 0);
  ASSERT_TRUE(WaitSteps(dir + "/out-stopped", 5, 120)) << ReadFile(dir + "/stopped.log");
  ASSERT_EQ(kill(-b, SIGINT), 0);  // the foreground process group, as a terminal does
  EXPECT_EQ(WaitExit(b, 120), 128 + SIGINT) << ReadFile(dir + "/stopped.log");
  const std::string log = ReadFile(dir + "/stopped.log");
  EXPECT_TRUE(absl::StrContains(log, "stopping at the next step boundary and saving a checkpoint (Ctrl-C again"))
      << log;
  std::smatch saved;
  ASSERT_TRUE(std::regex_search(log, saved, std::regex("checkpoint saved: (\\S+/checkpoint-(\\d+))\n"))) << log;
  const std::string checkpoint = saved[1];
  const int stopped_at = std::stoi(saved[2]);
  EXPECT_GE(stopped_at, 5);
  EXPECT_LT(stopped_at, kSteps);
  EXPECT_EQ(fs::path(checkpoint).parent_path(), fs::path(dir + "/out-stopped"));
  EXPECT_TRUE(fs::exists(checkpoint + "/COMPLETE"));
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("resume with: slidedp run ", stopped, " --resume ", checkpoint)))
      << log;
  EXPECT_FALSE(absl::StrContains(log, "UNAVAILABLE")) << log;
  EXPECT_FALSE(absl::StrContains(log, "stopping the private hostd and workers")) << log;  // not the hard stop
  EXPECT_FALSE(NodeProcessLeft(dir + "/run-stopped"));

  // Resumed from the newest checkpoint of the spec's output.dir, to the end.
  const int c = StartRun(dir, stopped, "resumed", {"--resume", "latest"});
  ASSERT_GT(c, 0);
  ASSERT_EQ(WaitExit(c, 300), 0) << ReadFile(dir + "/resumed.log");
  const std::string resumed_log = ReadFile(dir + "/resumed.log");
  EXPECT_TRUE(absl::StrContains(resumed_log, "resuming " + checkpoint)) << resumed_log;
  EXPECT_TRUE(absl::StrContains(resumed_log, absl::StrCat("succeeded after ", kSteps, " step(s)"))) << resumed_log;
  const std::string got = absl::StrCat(dir, "/out-stopped/checkpoint-", kSteps);
  ASSERT_TRUE(fs::exists(got + "/COMPLETE")) << resumed_log;

  // Bitwise: master weights and Adam moments, the model's weights, every other file; the trainer
  // state but for the job's name and times (and COMPLETE, which lists its size).
  const auto want_files = CheckpointFiles(want), got_files = CheckpointFiles(got);
  ASSERT_TRUE(want_files.count("optimizer.safetensors")) << want;
  ASSERT_TRUE(want_files.count("model.safetensors")) << want;
  std::vector<std::string> names_want, names_got;
  for (const auto& [name, bytes] : want_files) names_want.push_back(name);
  for (const auto& [name, bytes] : got_files) names_got.push_back(name);
  EXPECT_EQ(names_want, names_got);
  for (const auto& [name, bytes] : want_files) {
    if (name == "trainer_state.json" || name == "COMPLETE" || !got_files.count(name)) continue;
    EXPECT_TRUE(bytes == got_files.at(name)) << name << " differs between " << want << " and " << got;
  }
  nlohmann::json want_state = WithoutJobAndTimes(nlohmann::json::parse(want_files.at("trainer_state.json")));
  nlohmann::json got_state = WithoutJobAndTimes(nlohmann::json::parse(got_files.at("trainer_state.json")));
  ASSERT_TRUE(got_state["trainer_state"]["spec"].is_string());  // the resolved spec: another output.dir
  got_state["trainer_state"]["spec"] = absl::StrReplaceAll(got_state["trainer_state"]["spec"].get<std::string>(),
                                                           {{"/out-stopped\n", "/out-whole\n"}});
  EXPECT_EQ(want_state, got_state);
  if (!HasFailure()) fs::remove_all(dir);
}

// A second Ctrl-C does not wait for the step boundary: the private node stops at once, exit 130,
// nothing left running, no UNAVAILABLE from the job's stream.
TEST(RunResume, ASecondCtrlCStopsAtOnce) {
  const std::string dir = TestDir("run-twice-");
  fs::remove_all(dir);
  const std::string spec = WriteSpec(dir, "twice", 100000);
  // Slower steps (up to 100 ms before each gate wait and gradient post): the second signal comes
  // well before the step boundary the first one asked for.
  setenv("SLIDEDP_INJECT_DELAY_MS", "100", 1);
  const int cli = StartRun(dir, spec, "twice");
  unsetenv("SLIDEDP_INJECT_DELAY_MS");
  ASSERT_GT(cli, 0);
  ASSERT_TRUE(WaitSteps(dir + "/out-twice", 2, 120)) << ReadFile(dir + "/twice.log");
  ASSERT_EQ(kill(-cli, SIGINT), 0);
  // The second once the first has been taken (two signals sent at once would merge into one).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains(ReadFile(dir + "/twice.log"), "stopping at the next step boundary") &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(kill(-cli, SIGINT), 0);
  EXPECT_EQ(WaitExit(cli, 60), 128 + SIGINT) << ReadFile(dir + "/twice.log");
  const std::string log = ReadFile(dir + "/twice.log");
  EXPECT_TRUE(absl::StrContains(log, "stopping the private hostd and workers")) << log;
  EXPECT_FALSE(absl::StrContains(log, "UNAVAILABLE")) << log;
  EXPECT_FALSE(NodeProcessLeft(dir + "/run-twice"));
  if (!HasFailure()) fs::remove_all(dir);
}

// Ctrl-C before the job's first step ended (hostd saves nothing then): the CLI says there is no
// checkpoint and prints no resume command.
TEST(RunResume, CtrlCBeforeTheFirstStepSaysThereIsNothingToResume) {
  const std::string dir = TestDir("run-early-");
  fs::remove_all(dir);
  const std::string spec = WriteSpec(dir, "early", 100000);
  setenv("SLIDEDP_INJECT_DELAY_MS", "200", 1);  // a slow first step
  const int cli = StartRun(dir, spec, "early");
  unsetenv("SLIDEDP_INJECT_DELAY_MS");
  ASSERT_GT(cli, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (!absl::StrContains(ReadFile(dir + "/early.log"), "submitted job") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(StepsLogged(dir + "/out-early"), 0) << "the first step ended too soon to test this";
  ASSERT_EQ(kill(-cli, SIGINT), 0);
  EXPECT_EQ(WaitExit(cli, 60), 128 + SIGINT) << ReadFile(dir + "/early.log");
  const std::string log = ReadFile(dir + "/early.log");
  EXPECT_TRUE(absl::StrContains(log, "no checkpoint saved")) << log;
  EXPECT_TRUE(absl::StrContains(log, "nothing to resume")) << log;
  EXPECT_FALSE(absl::StrContains(log, "--resume")) << log;
  EXPECT_FALSE(absl::StrContains(log, "UNAVAILABLE")) << log;
  EXPECT_FALSE(NodeProcessLeft(dir + "/run-early"));
  if (!HasFailure()) fs::remove_all(dir);
}

// `--resume latest` where the output.dir holds no checkpoint: NOT_FOUND naming the directory, at
// once (no private node is started), exit 2.
TEST(RunResume, ResumeLatestWithoutACheckpointIsNotFound) {
  const std::string dir = TestDir("run-none-");
  fs::remove_all(dir);
  const std::string spec = WriteSpec(dir, "none", 10);
  const int cli = StartRun(dir, spec, "none", {"--resume", "latest"});
  ASSERT_GT(cli, 0);
  EXPECT_EQ(WaitExit(cli, 60), 2) << ReadFile(dir + "/none.log");
  const std::string log = ReadFile(dir + "/none.log");
  EXPECT_TRUE(absl::StrContains(log, "slidedp: NOT_FOUND: --resume latest: ")) << log;
  EXPECT_TRUE(absl::StrContains(log, dir + "/out-none")) << log;
  EXPECT_FALSE(absl::StrContains(log, "starting a private hostd")) << log;
  fs::create_directories(dir + "/out-none");  // there, but empty
  const int again = StartRun(dir, spec, "none-again", {"--resume", "latest"});
  EXPECT_EQ(WaitExit(again, 60), 2) << ReadFile(dir + "/none-again.log");
  EXPECT_TRUE(absl::StrContains(ReadFile(dir + "/none-again.log"), "no complete checkpoint under " + dir + "/out-none"))
      << ReadFile(dir + "/none-again.log");
  if (!HasFailure()) fs::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::testing
