// `slidedp run` as a user runs it: the CLI binary starts its private hostd and CPU workers, runs
// the job and exits with its result; when the private hostd is killed mid-job (as the kernel's
// OOM killer does), the CLI says which process died and how, exits non-zero in bounded time, and
// leaves nothing of the job's state in /dev/shm. The binaries' --version and logging start.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "common/data/synthetic.h"
#include "common/tensorboard/event_reader.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {
using client::WaitExit;

// A small synthetic dataset and a spec of the tiny preset with `steps` steps, in `dir`.
std::string WriteSpec(const std::string& dir, int steps) {
  std::filesystem::create_directories(dir);
  WriteTinyDataset(dir + "/data", 64, 90, 64, 9);
  const std::string spec = dir + "/job.yaml";
  std::ofstream(spec) << "name: cli\nmodel: {preset: tiny, init_seed: 1}\ndata: {path: data}\n"
                      << "output: {dir: out, save_final: false}\n"
                      << "train: {seq_len: 64, global_batch: 4, micro_batch: 2, steps: " << steps
                      << ", seed: 0, max_grad_norm: 1.0}\n"
                      << "optimizer: {lr: 1.0e-3}\nruntime: {workers: 2}\n";
  return spec;
}

// Runs `slidedp run SPEC` with the CPU backend; returns its pid (output in DIR/cli.log).
int StartCli(const std::string& dir, const std::string& spec) {
  auto pid = client::SpawnProcess({BuildDir() + "/bin/slidedp", "run", spec, "--backend", "cpu", "--cpu-workers", "2",
                                   "--run-dir", dir + "/run"},
                                  dir + "/cli.log");
  EXPECT_TRUE(pid.ok()) << pid.status();
  return pid.ok() ? *pid : -1;
}


// The pid of the process whose command line holds `a` followed by `b` (0 if none).
int FindProcess(const std::string& a, const std::string& b) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmd = ReadFile(e.path().string() + "/cmdline");
    if (absl::StrContains(cmd, a + std::string(1, '\0') + b)) return std::stoi(name);
  }
  return 0;
}

std::vector<std::string> NodeSegments(const std::string& node) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string n = e.path().filename().string();
    if (n.rfind(absl::StrCat("slidedp.", node, "."), 0) == 0) out.push_back(n);
  }
  return out;
}

TEST(CliRun, RunsTheJobOnAPrivateNodeAndExitsWithItsResult) {
  const std::string dir = ::testing::TempDir() + "/cli-ok-" + std::to_string(getpid());
  const int cli = StartCli(dir, WriteSpec(dir, 3));
  ASSERT_GT(cli, 0);
  EXPECT_EQ(WaitExit(cli, 120), 0) << ReadFile(dir + "/cli.log");
  const std::string log = ReadFile(dir + "/cli.log");
  EXPECT_TRUE(absl::StrContains(log, "succeeded after 3 step(s)")) << log;
  EXPECT_FALSE(absl::StrContains(log, "removed")) << log;  // a clean hostd leaves nothing behind
  EXPECT_TRUE(NodeSegments(absl::StrCat("run", cli)).empty());
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

// The three binaries say one version, "slidedp X.Y.Z (commit abc1234)" (the build's digest on a
// second line), and exit 0; a CLI command logs nothing before glog starts (no "Logging before
// InitGoogleLogging" line), and -v with --quiet is refused.
TEST(CliRun, BinariesSayTheirVersionAndLogFromTheStart) {
  const std::string dir = ::testing::TempDir() + "/cli-version-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  auto run = [&](std::vector<std::string> argv, const std::string& name) {
    auto pid = client::SpawnProcess(std::move(argv), dir + "/" + name + ".log");
    EXPECT_TRUE(pid.ok()) << pid.status();
    const int rc = pid.ok() ? WaitExit(*pid, 60) : -1;
    return std::pair<int, std::string>(rc, ReadFile(dir + "/" + name + ".log"));
  };
  const std::regex version(R"(slidedp \d+\.\d+\.\d+ \(commit ([0-9a-f]{7,}|unknown)\)\nbuild digest [0-9a-f]{16}\n)");
  std::set<std::string> first_lines;
  for (const char* bin : {"slidedp", "slidedp-hostd", "slidedp-worker"}) {
    const auto [rc, out] = run({BuildDir() + "/bin/" + bin, "--version"}, bin);
    EXPECT_EQ(rc, 0) << bin << ": " << out;
    EXPECT_TRUE(std::regex_match(out, version)) << bin << ": " << out;
    first_lines.insert(out.substr(0, out.find('\n')));
  }
  EXPECT_EQ(first_lines.size(), 1u) << "one version string for the three binaries";
  // A command that fails to reach hostd: one clear line, no glog preamble.
  const auto [rc, out] = run({BuildDir() + "/bin/slidedp", "--hostd", "unix:" + dir + "/no.sock", "--timeout", "2",
                              "health"},
                             "health");
  EXPECT_NE(rc, 0) << out;
  EXPECT_FALSE(absl::StrContains(out, "before InitGoogleLogging")) << out;
  EXPECT_TRUE(absl::StrContains(out, "slidedp: UNAVAILABLE")) << out;
  const auto [both, both_out] = run({BuildDir() + "/bin/slidedp", "-v", "--quiet", "health"}, "both");
  EXPECT_NE(both, 0) << both_out;
  EXPECT_TRUE(absl::StrContains(both_out, "excludes")) << both_out;
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

TEST(CliRun, AKilledPrivateHostdIsNamedAndItsStateRemoved) {
  const std::string dir = ::testing::TempDir() + "/cli-kill-" + std::to_string(getpid());
  const int cli = StartCli(dir, WriteSpec(dir, 100000));
  ASSERT_GT(cli, 0);
  const std::string node = absl::StrCat("run", cli);
  // Once the job runs (its first metrics line is out), SIGKILL its hostd, as the OOM killer does.
  int hostd = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    bool stepped = false;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir + "/out", ec)) {
      stepped |= e.path().filename().string().rfind("metrics-", 0) == 0 && !ReadFile(e.path().string()).empty();
    }
    if (stepped && (hostd = FindProcess("--node-name", node)) > 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_GT(hostd, 0) << "the job never ran: " << ReadFile(dir + "/cli.log");
  EXPECT_FALSE(NodeSegments(node).empty());  // the job's state, rings
  ASSERT_EQ(kill(hostd, SIGKILL), 0);

  const int rc = WaitExit(cli, 60);
  const std::string log = ReadFile(dir + "/cli.log");
  EXPECT_NE(rc, 0) << log;
  EXPECT_NE(rc, -1) << "the CLI did not exit within 60 s of its hostd's death: " << log;
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("the private hostd (pid ", hostd, ") was killed by signal 9")))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "OOM killer")) << log;
  EXPECT_TRUE(absl::StrContains(log, "shared-memory segment(s) the private hostd left in /dev/shm")) << log;
  EXPECT_TRUE(NodeSegments(node).empty());
  EXPECT_EQ(FindProcess("--hostd", absl::StrCat("unix:", dir, "/run/hostd.sock")), 0);  // no worker left behind
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

// output.tensorboard: the job writes a TensorBoard events file (every CRC checks, its first event
// says the file version) with one event per step that the JSONL has, the same loss, lr and memory
// as float32; `slidedp plot` draws that JSONL, and a bad input gets one clear line and exit != 0.
TEST(CliRun, TensorBoardEventsAndPlotOfAJob) {
  const std::string dir = ::testing::TempDir() + "/cli-tb-" + std::to_string(getpid());
  const std::string spec = WriteSpec(dir, 3);
  const std::string text = ReadFile(spec);  // before the ofstream truncates it
  std::ofstream(spec) << absl::StrReplaceAll(text, {{"save_final: false}", "save_final: false, tensorboard: true}"}});
  const int cli = StartCli(dir, spec);
  ASSERT_GT(cli, 0);
  ASSERT_EQ(WaitExit(cli, 120), 0) << ReadFile(dir + "/cli.log");

  std::vector<std::filesystem::path> runs, files;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/out/tensorboard")) runs.push_back(e.path());
  ASSERT_EQ(runs.size(), 1u);  // <output.dir>/tensorboard/<job-id>/
  const std::string job = runs[0].filename().string();
  for (const auto& e : std::filesystem::directory_iterator(runs[0])) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(files[0].filename().string(), "events.out.tfevents.")) << files[0];
  auto events = tensorboard::ReadEventFile(files[0].string());
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_EQ(events->file_version, "brain.Event:2");
  std::map<std::pair<int64_t, std::string>, float> scalars;
  for (const auto& s : events->scalars) scalars[{s.step, s.tag}] = s.value;
  auto at = [&](int64_t step, const std::string& tag) { return scalars[{step, tag}]; };

  const std::string jsonl = dir + "/out/metrics-" + job + ".jsonl";
  int records = 0;
  for (const auto& line : absl::StrSplit(ReadFile(jsonl), '\n', absl::SkipEmpty())) {
    const nlohmann::json r = nlohmann::json::parse(line);
    const int64_t step = r["step"];
    EXPECT_EQ(at(step, "train/loss"), static_cast<float>(r["loss"].get<double>())) << step;
    EXPECT_EQ(at(step, "train/lr"), static_cast<float>(r["lr"].get<double>())) << step;
    EXPECT_EQ(at(step, "train/grad_norm"), static_cast<float>(r["grad_norm"].get<double>())) << step;
    EXPECT_EQ(at(step, "memory/host_gib"), static_cast<float>(r["host_state_bytes"].get<double>() / (1 << 30)));
    ++records;
  }
  EXPECT_EQ(records, 3);
  EXPECT_EQ(events->scalars.size(), 3u * 8);  // 8 tags a step (no validation split, no MFU field)
  // (The job's log names the file, but a watcher may drop log lines: tensorboard_sink_test checks it.)

  auto run = [&](std::vector<std::string> args, const std::string& name) {
    args.insert(args.begin(), BuildDir() + "/bin/slidedp");
    auto pid = client::SpawnProcess(std::move(args), dir + "/" + name + ".log");
    EXPECT_TRUE(pid.ok()) << pid.status();
    const int rc = pid.ok() ? WaitExit(*pid, 60) : -1;
    return std::pair<int, std::string>(rc, ReadFile(dir + "/" + name + ".log"));
  };
  // Into a directory that does not exist yet: made.
  const auto [rc, out] = run({"plot", jsonl, "-o", dir + "/plots/new/curve.png"}, "plot");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(ReadFile(dir + "/plots/new/curve.png").substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  const auto [missing_rc, missing] = run({"plot", dir + "/nope.jsonl", "-o", dir + "/x.svg"}, "plot-missing");
  EXPECT_NE(missing_rc, 0);
  EXPECT_TRUE(absl::StrContains(missing, "slidedp: NOT_FOUND: open metrics file " + dir + "/nope.jsonl")) << missing;
  const auto [gif_rc, gif] = run({"plot", jsonl, "-o", dir + "/x.gif"}, "plot-gif");
  EXPECT_NE(gif_rc, 0);
  EXPECT_TRUE(absl::StrContains(gif, "unknown image type '.gif'")) << gif;
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::testing

namespace slidedp::testing {
namespace {
using client::WaitExit;

// `slidedp prepare` as a process on a Llama 3 tokenizer directory with its chat template: the
// train/ and validation/ splits, the template named in the manifests, assistant-only loss masks
// (some tokens trained, not all).
TEST(CliRun, PreparesLlamaChatsWithTheirTemplateAndAValidationSplit) {
  const char* src = std::getenv("SLIDEDP_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "ctest sets SLIDEDP_SOURCE_DIR";
  const std::string dir = ::testing::TempDir() + "/cli-prep-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  std::string chats;
  for (int copy = 0; copy < 4; ++copy) chats += ReadFile(std::string(src) + "/tests/data/chat_templates/conversations.jsonl");
  std::ofstream(dir + "/chats.jsonl") << chats;
  auto pid = client::SpawnProcess({BuildDir() + "/bin/slidedp", "prepare", "--model",
                                   std::string(src) + "/tests/data/chat_templates/llama3", "--input",
                                   dir + "/chats.jsonl", "--output", dir + "/ds", "--seq-len", "256", "--pack",
                                   "--validation-fraction", "0.25"},
                                  dir + "/prepare.log");
  ASSERT_TRUE(pid.ok()) << pid.status();
  ASSERT_EQ(WaitExit(*pid, 120), 0) << ReadFile(dir + "/prepare.log");
  for (const std::string split : {"train", "validation"}) {
    const nlohmann::json m = nlohmann::json::parse(ReadFile(dir + "/ds/" + split + "/manifest.json"));
    EXPECT_EQ(m["metadata"]["chat_template"], "llama3") << split;  // the directory's own (Llama 3 Instruct)
    auto d = data::DatasetReader::Open(dir + "/ds/" + split);
    ASSERT_TRUE(d.ok()) << d.status();
    std::vector<int64_t> rows((*d)->num_rows());
    for (size_t r = 0; r < rows.size(); ++r) rows[r] = static_cast<int64_t>(r);
    ASSERT_FALSE(rows.empty()) << split;
    auto trained = data::CountTrainedLabels(**d, rows);
    ASSERT_TRUE(trained.ok()) << trained.status();
    EXPECT_GT(*trained, 0) << split << ": the assistant turns are trained";
    EXPECT_LT(*trained, (*d)->manifest().num_tokens) << split << ": the prompts are not";
  }
  // Another known template, forced against the model's own, is refused naming both.
  auto bad = client::SpawnProcess({BuildDir() + "/bin/slidedp", "prepare", "--model",
                                   std::string(src) + "/tests/data/chat_templates/llama3", "--input",
                                   dir + "/chats.jsonl", "--output", dir + "/ds2", "--seq-len", "256",
                                   "--chat-template", "llama3.1"},
                                  dir + "/prepare-bad.log");
  ASSERT_TRUE(bad.ok());
  EXPECT_NE(WaitExit(*bad, 60), 0) << ReadFile(dir + "/prepare-bad.log");
  EXPECT_TRUE(absl::StrContains(ReadFile(dir + "/prepare-bad.log"), "llama3.1 requested")) << ReadFile(dir + "/prepare-bad.log");
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::testing
