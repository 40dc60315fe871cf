// Checkpoint ownership (issue 48, "a user's results are never lost"): a save writes, rotates and
// replaces only its own run's checkpoints; output.overwrite moves other runs' aside; the bounded
// listing of a directory a client may have filled; export from a directory of several runs, and
// export's destination errors.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <regex>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_files.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "common/status/status_macros.h"
#include "gtest/gtest.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace slidedp::checkpoint::testing;

void FillMaster(const ModelLayout& layout, HostState& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (const UnitLayout& u : layout.units) {
    for (int64_t i = 0; i < u.numel; ++i) s.master[u.index][i] = n(rng);
  }
}

std::set<std::string> Names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

class CkptOwnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = (fs::temp_directory_path() / ("ckpt_owner_test." + std::to_string(::getpid()))).string();
    fs::remove_all(root_);
    fs::create_directories(root_);
    out_ = root_ + "/out";
    layout_ = ModelLayout::Build(TinyConfig(true));
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(root_ + "/ro", fs::perms::owner_all, ec);
    fs::remove_all(root_);
  }

  // A save of `step` into `dir` by job `job` of run `run` ("" = no run_id: the job's own run).
  absl::StatusOr<SaveResult> Save(HostState& s, int64_t step, const std::string& job, const std::string& run = "",
                                  int64_t keep_last = 0, const std::string& dir = "") {
    SaveRequest r;
    r.root_dir = dir.empty() ? out_ : dir;
    r.step = step;
    r.layout = &layout_;
    r.arrays = s.arrays();
    r.keep_last = keep_last;
    r.trainer_state = {{"step", step}};
    if (!job.empty()) r.trainer_state["job_id"] = job;
    if (!run.empty()) r.trainer_state["run_id"] = run;
    return SaveCheckpoint(r);
  }

  std::string root_, out_;
  ModelLayout layout_;
};

TEST_F(CkptOwnerTest, RunIdOfPrefersRunIdThenJobId) {
  EXPECT_EQ(RunIdOf({{"job_id", "b"}, {"run_id", "a"}}), "a");
  EXPECT_EQ(RunIdOf({{"job_id", "b"}}), "b");
  EXPECT_EQ(RunIdOf({{"job_id", "b"}, {"run_id", 7}}), "b");  // typed reads: not a string is absent
  EXPECT_EQ(RunIdOf({{"job_id", "b"}, {"run_id", ""}}), "b");
  EXPECT_EQ(RunIdOf(nlohmann::json::object()), "");
  EXPECT_EQ(RunIdOf(nlohmann::json::array()), "");
}

// keep_last rotates the saving run's checkpoints, those of its earlier jobs included (a resumed
// job inherits the run), never another run's (even an older one) nor one of no job.
TEST_F(CkptOwnerTest, KeepLastRotatesOnlyTheSavingRun) {
  HostState s(layout_);
  FillMaster(layout_, s, 1);
  ASSERT_TRUE(Save(s, 0, "").ok());                                  // no job: run ""
  for (int step : {1, 2}) ASSERT_TRUE(Save(s, step, "alpha").ok());  // run alpha (no run_id: the job's)
  for (int step : {3, 4}) ASSERT_TRUE(Save(s, step, "beta").ok());   // run beta
  // alpha-2, resumed from alpha's checkpoint: run alpha, keep_last 2.
  auto r5 = Save(s, 5, "alpha-2", "alpha", 2);
  ASSERT_TRUE(r5.ok()) << r5.status();
  EXPECT_EQ(std::set<std::string>(r5->removed.begin(), r5->removed.end()),
            (std::set<std::string>{out_ + "/checkpoint-1"}));
  auto r6 = Save(s, 6, "alpha-2", "alpha", 2);
  ASSERT_TRUE(r6.ok()) << r6.status();
  EXPECT_EQ(r6->removed, (std::vector<std::string>{out_ + "/checkpoint-2"}));
  // beta, keep_last 1: only its own 3 and 4 go.
  auto r7 = Save(s, 7, "beta", "", 1);
  ASSERT_TRUE(r7.ok()) << r7.status();
  EXPECT_EQ(std::set<std::string>(r7->removed.begin(), r7->removed.end()),
            (std::set<std::string>{out_ + "/checkpoint-3", out_ + "/checkpoint-4"}));
  EXPECT_EQ(Names(out_), (std::set<std::string>{"checkpoint-0", "checkpoint-5", "checkpoint-6", "checkpoint-7"}));
  EXPECT_EQ(*FindLatestCheckpointOfRun(out_, "alpha"), out_ + "/checkpoint-6");
  EXPECT_EQ(*FindLatestCheckpointOfRun(out_, "beta"), out_ + "/checkpoint-7");
  EXPECT_EQ(FindLatestCheckpointOfRun(out_, "gamma").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*FindLatestCheckpoint(out_, "alpha-2"), out_ + "/checkpoint-6");
  EXPECT_EQ(*CheckpointRunId(out_ + "/checkpoint-6"), "alpha");
  EXPECT_EQ(*CheckpointJobId(out_ + "/checkpoint-6"), "alpha-2");
  EXPECT_EQ(*CheckpointRunId(out_ + "/checkpoint-7"), "beta");
  EXPECT_EQ(CheckpointRunId(out_ + "/checkpoint-0").status().code(), absl::StatusCode::kDataLoss);
}

// Saving step N where another run's checkpoint-N is: refused before writing, naming the other
// job and the directory; the other checkpoint is left whole and no temporary directory remains.
// The same run replaces it.
TEST_F(CkptOwnerTest, SameStepOfAnotherRunIsRefusedAndKept) {
  HostState a(layout_), b(layout_), loaded(layout_);
  FillMaster(layout_, a, 2);
  FillMaster(layout_, b, 3);
  ASSERT_TRUE(Save(a, 5, "alpha").ok());
  const std::string before = ReadAll(out_ + "/checkpoint-5/optimizer.safetensors");
  auto refused = Save(b, 5, "beta");
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), out_ + "/checkpoint-5")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "job alpha")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "beta")) << refused.status();
  EXPECT_EQ(Names(out_), (std::set<std::string>{"checkpoint-5"}));
  EXPECT_EQ(ReadAll(out_ + "/checkpoint-5/optimizer.safetensors"), before);
  EXPECT_EQ(*CheckpointJobId(out_ + "/checkpoint-5"), "alpha");

  // A save that names no job may not replace a job's checkpoint either.
  EXPECT_EQ(Save(b, 5, "").status().code(), absl::StatusCode::kFailedPrecondition);

  // The same run (a resumed job of run alpha) replaces it, as before.
  auto same = Save(b, 5, "alpha-2", "alpha");
  ASSERT_TRUE(same.ok()) << same.status();
  ASSERT_TRUE(LoadCheckpoint(out_ + "/checkpoint-5", layout_, loaded.arrays()).ok());
  EXPECT_EQ(0, std::memcmp(loaded.master[0].data(), b.master[0].data(), b.master[0].size() * 4));
  EXPECT_EQ(Names(out_), (std::set<std::string>{"checkpoint-5"}));
}

// Another run's checkpoint appearing between the check and the rename: the exchange is undone,
// the save refused, and the other checkpoint whole in its place.
TEST_F(CkptOwnerTest, AnotherRunsCheckpointAppearingMidSaveIsSwappedBack) {
  HostState a(layout_), b(layout_);
  FillMaster(layout_, a, 4);
  FillMaster(layout_, b, 5);
  const std::string elsewhere = root_ + "/elsewhere";
  ASSERT_TRUE(Save(a, 7, "alpha", "", 0, elsewhere).ok());
  const std::string before = ReadAll(elsewhere + "/checkpoint-7/optimizer.safetensors");
  SaveRequest r;
  r.root_dir = out_;
  r.step = 7;
  r.layout = &layout_;
  r.arrays = b.arrays();
  r.trainer_state = {{"job_id", "beta"}};
  r.fault_hook = [&](const std::string& stage) {
    if (stage == "rename") fs::rename(elsewhere + "/checkpoint-7", out_ + "/checkpoint-7");
    return absl::OkStatus();
  };
  auto refused = SaveCheckpoint(r);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "job alpha")) << refused.status();
  EXPECT_EQ(Names(out_), (std::set<std::string>{"checkpoint-7"}));
  EXPECT_EQ(ReadAll(out_ + "/checkpoint-7/optimizer.safetensors"), before);
  EXPECT_TRUE(VerifyCheckpoint(out_ + "/checkpoint-7").ok());
}

// Entries named checkpoint-<N> that are no directory of this run: a file, a symbolic link (to
// this run's checkpoint elsewhere, even), one without a readable owner. Never replaced.
TEST_F(CkptOwnerTest, SameStepEntriesThatAreNotThisRunsAreRefused) {
  HostState s(layout_);
  FillMaster(layout_, s, 6);
  const std::string elsewhere = root_ + "/elsewhere";
  ASSERT_TRUE(Save(s, 9, "alpha", "", 0, elsewhere).ok());
  fs::create_directories(out_);
  std::ofstream(out_ + "/checkpoint-8") << "notes";
  fs::create_directory_symlink(elsewhere + "/checkpoint-9", out_ + "/checkpoint-9");
  fs::create_directories(out_ + "/checkpoint-10");
  std::ofstream(out_ + "/checkpoint-10/trainer_state.json") << "{not json";
  for (int step : {8, 9, 10}) {
    SCOPED_TRACE(step);
    auto refused = Save(s, step, "alpha");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  }
  EXPECT_EQ(ReadAll(out_ + "/checkpoint-8"), "notes");
  EXPECT_TRUE(fs::is_symlink(out_ + "/checkpoint-9"));
  EXPECT_TRUE(VerifyCheckpoint(elsewhere + "/checkpoint-9").ok());
  EXPECT_EQ(ReadAll(out_ + "/checkpoint-10/trainer_state.json"), "{not json");
  EXPECT_EQ(Names(out_), (std::set<std::string>{"checkpoint-8", "checkpoint-9", "checkpoint-10"}));
  // Never resumed from either: the link leads out of the root.
  EXPECT_EQ(FindLatestCheckpoint(out_).status().code(), absl::StatusCode::kNotFound);
}

// output.overwrite: other runs' checkpoints move to superseded-<UTC>-<job>/, whole; listings and
// resume see only the root's direct children, so they are out of the way; nothing is deleted.
TEST_F(CkptOwnerTest, MoveAsideKeepsOtherRunsOutOfTheWay) {
  HostState s(layout_);
  FillMaster(layout_, s, 7);
  for (int step : {1, 2}) ASSERT_TRUE(Save(s, step, "alpha").ok());
  ASSERT_TRUE(Save(s, 3, "beta").ok());
  auto listed = ListCheckpoints(out_);
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> others;
  for (const CheckpointEntry& e : *listed) {
    if (e.run_id != "beta") others.push_back(e.dir);
  }
  ASSERT_EQ(others.size(), 2u);
  auto moved = MoveCheckpointsAside(out_, others, "gamma");
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_TRUE(
      std::regex_match(fs::path(moved->dir).filename().string(), std::regex("superseded-[0-9]{8}T[0-9]{6}Z-gamma")))
      << moved->dir;
  EXPECT_EQ(fs::path(moved->dir).parent_path(), fs::path(out_));
  ASSERT_EQ(moved->moved.size(), 2u);
  for (const auto& [from, to] : moved->moved) {
    EXPECT_FALSE(fs::exists(from)) << from;
    EXPECT_EQ(fs::path(to).parent_path(), fs::path(moved->dir));
    EXPECT_TRUE(VerifyCheckpoint(to).ok()) << to;
    EXPECT_EQ(*CheckpointJobId(to), "alpha");
  }
  EXPECT_EQ(*FindLatestCheckpoint(out_), out_ + "/checkpoint-3");
  EXPECT_EQ(FindLatestCheckpoint(out_, "alpha").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FindLatestCheckpointOfRun(out_, "alpha").status().code(), absl::StatusCode::kNotFound);
  listed = ListCheckpoints(out_);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].run_id, "beta");

  // The new run saves step 1 and 2 now; keep_last never reaches into superseded-*.
  ASSERT_TRUE(Save(s, 1, "gamma", "", 1).ok());
  ASSERT_TRUE(Save(s, 2, "gamma", "", 1).ok());
  EXPECT_TRUE(VerifyCheckpoint(moved->dir + "/checkpoint-1").ok());
  EXPECT_TRUE(VerifyCheckpoint(moved->dir + "/checkpoint-2").ok());

  // A second move within the same second gets a directory of its own.
  auto again = MoveCheckpointsAside(out_, {out_ + "/checkpoint-3"}, "gamma");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->dir, moved->dir);
  EXPECT_TRUE(VerifyCheckpoint(again->dir + "/checkpoint-3").ok());

  // Nothing to move: nothing made. Not a child of the root, or a bad job id: refused.
  auto none = MoveCheckpointsAside(out_, {}, "gamma");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->dir.empty());
  EXPECT_EQ(MoveCheckpointsAside(out_, {moved->dir + "/checkpoint-1"}, "gamma").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MoveCheckpointsAside(out_, {out_ + "/metrics.jsonl"}, "gamma").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MoveCheckpointsAside(out_, {out_ + "/checkpoint-2"}, "../x").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(VerifyCheckpoint(out_ + "/checkpoint-2").ok());
}

// The listing of a directory a client may have filled: every checkpoint-<N> entry, newest first,
// with its owner only where a regular trainer_state.json of bounded size says; links not followed.
TEST_F(CkptOwnerTest, ListingHostileEntries) {
  HostState s(layout_);
  FillMaster(layout_, s, 8);
  ASSERT_TRUE(Save(s, 3, "alpha-2", "alpha").ok());
  const std::string elsewhere = root_ + "/elsewhere";
  ASSERT_TRUE(Save(s, 6, "outsider", "", 0, elsewhere).ok());
  std::ofstream(out_ + "/checkpoint-5") << "a file";
  fs::create_directory_symlink(elsewhere + "/checkpoint-6", out_ + "/checkpoint-6");
  auto dir_with_state = [&](int step, const std::string& text) {
    const std::string d = absl::StrCat(out_, "/checkpoint-", step);
    fs::create_directories(d);
    std::ofstream(d + "/COMPLETE") << "{}";
    if (!text.empty()) std::ofstream(d + "/trainer_state.json") << text;
    return d;
  };
  // Huge (sparse) trainer_state.json: not read.
  const std::string huge = dir_with_state(7, "");
  {
    std::ofstream(huge + "/trainer_state.json") << R"({"trainer_state": {"job_id": "huge"}})";
    fs::resize_file(huge + "/trainer_state.json", kMaxListedStateBytes + 1);
  }
  dir_with_state(8, "{\"trainer_state\": {\"job_id\": \"garbage\"");  // garbage JSON
  const std::string fifo = dir_with_state(9, "");
  ASSERT_EQ(::mkfifo((fifo + "/trainer_state.json").c_str(), 0644), 0);  // would block a plain open
  const std::string link = dir_with_state(10, "");
  fs::create_symlink(elsewhere + "/checkpoint-6/trainer_state.json", link + "/trainer_state.json");
  dir_with_state(11, std::string(100000, '[') + std::string(100000, ']'));  // too deep for a parser
  const std::string good_state = ReadAll(out_ + "/checkpoint-3/trainer_state.json");
  const std::string no_complete = dir_with_state(12, "");
  fs::remove(no_complete + "/COMPLETE");
  std::ofstream(no_complete + "/trainer_state.json")
      << R"({"format": "slidedp-checkpoint", "step": 12, "trainer_state": {"job_id": "beta"}})";
  dir_with_state(13, R"({"format": "slidedp-checkpoint", "step": 99, "trainer_state": {"job_id": "beta"}})");
  dir_with_state(14, R"({"format": "slidedp-checkpoint", "step": 14, "trainer_state": {"job_id": 5}})");
  fs::create_directories(out_ + "/checkpoint-x");
  fs::create_directories(out_ + "/superseded-20261203T000000Z-a/checkpoint-20");
  std::ofstream(out_ + "/metrics-alpha.jsonl") << "{}\n";

  auto listed = ListCheckpoints(out_);
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<int64_t> steps;
  for (const CheckpointEntry& e : *listed) steps.push_back(e.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 3}));
  for (const CheckpointEntry& e : *listed) {
    SCOPED_TRACE(e.dir);
    EXPECT_EQ(e.dir, absl::StrCat(out_, "/checkpoint-", e.step));
    if (e.step == 3) {
      EXPECT_TRUE(e.complete);
      EXPECT_EQ(e.job_id, "alpha-2");
      EXPECT_EQ(e.run_id, "alpha");
    } else if (e.step == 12 || e.step == 13) {  // its owner is known, but it is not complete
      EXPECT_FALSE(e.complete);
      EXPECT_EQ(e.job_id, "beta");
      EXPECT_EQ(e.run_id, "beta");
    } else if (e.step == 14) {  // as a checkpoint from before job ids: complete, of run ""
      EXPECT_TRUE(e.complete);
      EXPECT_EQ(e.job_id, "");
      EXPECT_EQ(e.run_id, "");
    } else {
      EXPECT_FALSE(e.complete);
      EXPECT_EQ(e.job_id, "");
      EXPECT_EQ(e.run_id, "");
    }
  }
  EXPECT_EQ(good_state, ReadAll(out_ + "/checkpoint-3/trainer_state.json"));
  EXPECT_EQ(*FindLatestCheckpoint(out_), out_ + "/checkpoint-3");

  EXPECT_EQ(ListCheckpoints(root_ + "/nowhere").status().code(), absl::StatusCode::kNotFound);
  fs::create_directories(root_ + "/empty");
  EXPECT_TRUE(ListCheckpoints(root_ + "/empty")->empty());
}

// The bounds: too many checkpoint-<N> entries, or trainer_state.json files too large together,
// make the listing FAILED_PRECONDITION (never a partial answer a caller could take as complete).
TEST_F(CkptOwnerTest, ListingIsBounded) {
  const std::string many = root_ + "/many";
  fs::create_directories(many);
  for (size_t i = 0; i <= kMaxListedCheckpoints; ++i) {
    ASSERT_EQ(::mkdir(absl::StrCat(many, "/checkpoint-", i).c_str(), 0755), 0);
  }
  auto listed = ListCheckpoints(many);
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kFailedPrecondition) << listed.status();
  EXPECT_TRUE(absl::StrContains(listed.status().message(), many)) << listed.status();
  ASSERT_EQ(::rmdir((many + "/checkpoint-0").c_str()), 0);
  listed = ListCheckpoints(many);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), kMaxListedCheckpoints);

  const std::string big = root_ + "/big";
  for (uint64_t i = 0; i <= kMaxListedStateTotalBytes / kMaxListedStateBytes; ++i) {
    const std::string d = absl::StrCat(big, "/checkpoint-", i);
    fs::create_directories(d);
    std::ofstream(d + "/trainer_state.json").close();
    fs::resize_file(d + "/trainer_state.json", kMaxListedStateBytes);  // sparse: no disk
  }
  listed = ListCheckpoints(big);
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kFailedPrecondition) << listed.status();
}

// Export from a directory holding complete checkpoints of several runs: refused naming each run,
// its jobs and its newest checkpoint, and how to choose; --job (a job or run id) chooses.
TEST_F(CkptOwnerTest, ExportFromSeveralRunsNeedsAChoice) {
  HostState a(layout_), b(layout_);
  FillMaster(layout_, a, 9);
  FillMaster(layout_, b, 10);
  for (int step : {1, 2}) ASSERT_TRUE(Save(a, step, "alpha").ok());
  ASSERT_TRUE(Save(a, 4, "alpha-2", "alpha").ok());
  ASSERT_TRUE(Save(b, 3, "beta").ok());
  ExportRequest req;
  req.checkpoint = out_;
  req.out_dir = root_ + "/exported";
  auto refused = ExportModel(req);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  const std::string m(refused.status().message());
  for (const std::string& want :
       {std::string("run alpha (jobs alpha-2, alpha)"), out_ + "/checkpoint-4 (step 4)",
        std::string("run beta (job beta)"), out_ + "/checkpoint-3 (step 3)", std::string("--job")}) {
    EXPECT_TRUE(absl::StrContains(m, want)) << want << " in " << m;
  }
  EXPECT_FALSE(fs::exists(req.out_dir));
  EXPECT_EQ(Names(root_), (std::set<std::string>{"out"}));

  struct Choice {
    std::string job;
    std::string exported;
  };
  for (const Choice& c :
       {Choice{"alpha", "checkpoint-4"}, Choice{"alpha-2", "checkpoint-4"}, Choice{"beta", "checkpoint-3"}}) {
    SCOPED_TRACE(c.job);
    req.run = c.job;
    req.out_dir = root_ + "/exported-" + c.job;
    auto res = ExportModel(req);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->checkpoint, out_ + "/" + c.exported);
  }
  // A job that saved none of them: NOT_FOUND naming those there are.
  req.run = "gamma";
  req.out_dir = root_ + "/exported-gamma";
  auto none = ExportModel(req);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
  EXPECT_TRUE(absl::StrContains(none.status().message(), "run beta")) << none.status();
  // A checkpoint directory itself needs no choice; with --job it must be theirs.
  req.checkpoint = out_ + "/checkpoint-2";
  req.run = "";
  EXPECT_TRUE(ExportModel(req).ok());
  req.run = "beta";
  req.out_dir = root_ + "/exported-2";
  auto theirs = ExportModel(req);
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kFailedPrecondition) << theirs.status();
  EXPECT_TRUE(absl::StrContains(theirs.status().message(), "job alpha")) << theirs.status();

  // Only complete checkpoints count: without beta's COMPLETE the directory holds one run again.
  fs::remove(out_ + "/checkpoint-3/COMPLETE");
  req = ExportRequest{};
  req.checkpoint = out_;
  req.out_dir = root_ + "/exported-one";
  auto one = ExportModel(req);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->checkpoint, out_ + "/checkpoint-4");
}

// Runs `fn` in a child process as the user nobody when this process is root (a 0555 directory
// stops no root), else as itself; returns fn's status code and message.
std::pair<absl::StatusCode, std::string> RunUnprivileged(const std::function<absl::Status()>& fn) {
  int fds[2];
  if (::pipe(fds) != 0) return {absl::StatusCode::kUnknown, "pipe"};
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(100);
    const absl::Status s = fn();
    const std::string m(s.message());
    if (::write(fds[1], m.data(), m.size()) < 0) ::_exit(101);
    ::_exit(static_cast<int>(s.code()));
  }
  ::close(fds[1]);
  std::string message;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) message.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) >= 100) return {absl::StatusCode::kUnknown, "child failed"};
  return {static_cast<absl::StatusCode>(WEXITSTATUS(status)), message};
}

// Destination mistakes are the user's, named, never INTERNAL: a parent that does not exist (not
// created), one that is a file, one that may not be written, a read-only file system.
TEST_F(CkptOwnerTest, ExportDestinationErrorsNameThePath) {
  HostState s(layout_);
  FillMaster(layout_, s, 11);
  ASSERT_TRUE(Save(s, 1, "alpha").ok());
  ExportRequest req;
  req.checkpoint = out_;

  req.out_dir = root_ + "/missing/deeper/exported";
  auto missing = ExportModel(req);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_TRUE(absl::StrContains(missing.status().message(), root_ + "/missing/deeper")) << missing.status();
  EXPECT_FALSE(fs::exists(root_ + "/missing"));

  std::ofstream(root_ + "/file") << "x";
  req.out_dir = root_ + "/file/exported";
  auto file = ExportModel(req);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition) << file.status();
  EXPECT_TRUE(absl::StrContains(file.status().message(), root_ + "/file")) << file.status();

  // Mode 0555: no entry may be made there (the child runs as nobody when the test runs as root).
  // The checkpoint must be readable to that user: the test's directories are 0755, files 0644.
  fs::create_directories(root_ + "/ro");
  fs::permissions(root_ + "/ro", fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                                     fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  req.out_dir = root_ + "/ro/exported";
  const auto [code, message] = RunUnprivileged([&] { return ExportModel(req).status(); });
  EXPECT_EQ(code, absl::StatusCode::kPermissionDenied) << message;
  EXPECT_TRUE(absl::StrContains(message, root_ + "/ro")) << message;
  EXPECT_TRUE(Names(root_ + "/ro").empty());

  // EROFS (no read-only mount to make here): the mapping every write in --to's parent goes through.
  const absl::Status rofs = internal::ExportDestinationErrno("create /mnt/x/.tmp-export-y-1", "/mnt/x", EROFS);
  EXPECT_EQ(rofs.code(), absl::StatusCode::kFailedPrecondition) << rofs;
  EXPECT_TRUE(absl::StrContains(rofs.message(), "/mnt/x is on a read-only file system")) << rofs;
  EXPECT_EQ(internal::ExportDestinationErrno("create x", "/p", EACCES).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(internal::ExportDestinationErrno("create x", "/p", ENOENT).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(internal::ExportDestinationErrno("create x", "/p", ENOSPC).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(slidedp::ErrnoStatus("create x", EROFS).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(slidedp::ErrnoStatus("create x", ENOTDIR).code(), absl::StatusCode::kFailedPrecondition);

  // A failed export leaves nothing behind; a good one still works.
  req.out_dir = root_ + "/exported";
  ASSERT_TRUE(ExportModel(req).ok());
  for (const std::string& n : Names(root_)) EXPECT_FALSE(absl::StartsWith(n, ".tmp-export")) << n;
}

}  // namespace
}  // namespace slidedp::checkpoint
