// `slidedp run`'s private node without a real hostd: the run directory (private, refused when
// others may write it or when its socket path is too long), logs that never follow a symlink,
// children that die with the CLI (PR_SET_PDEATHSIG) and are stopped on SIGTERM (exit 128 + 15),
// a hostd that exits at start failing Start at once with its log, the CPU worker cap, and
// `run --resume` without a checkpoint.
#include "client/cli/embedded.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::client {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr char kChildEnv[] = "SLIDEDP_EMBEDDED_TEST_FAKE_CLI";

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/embedded_test_", getpid(), "_", name);
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteExecutable(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  fs::permissions(path, fs::perms::owner_all);
}


bool Gone(int pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

TEST(MakeRunDir, DefaultIsAFreshPrivateTempDir) {
  auto a = MakeRunDir(""), b = MakeRunDir("");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE(*a, *b);
  EXPECT_TRUE(absl::StartsWith(*a, "/tmp/slidedp-run-")) << *a;
  EXPECT_NE(*a, absl::StrCat("/tmp/slidedp-run-", getpid()));  // not predictable
  struct stat st;
  ASSERT_EQ(stat(a->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  fs::remove_all(*a);
  fs::remove_all(*b);
}

TEST(MakeRunDir, GivenDirIsCreatedPrivateOrCheckedWithoutThrowing) {
  const std::string base = TempPath("rundirs");
  fs::remove_all(base);
  auto made = MakeRunDir(base + "/a/run");
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(*made, base + "/a/run");
  struct stat st;
  ASSERT_EQ(stat(made->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_TRUE(MakeRunDir(*made).ok());  // again: the same directory is fine

  // An existing file: an error naming it (was an uncaught filesystem_error).
  std::ofstream(base + "/file") << "x";
  absl::StatusOr<std::string> r = absl::UnknownError("not run");
  EXPECT_NO_THROW(r = MakeRunDir(base + "/file"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(base + "/file"));
  EXPECT_NO_THROW(r = MakeRunDir(base + "/file/run"));
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(base + "/file"));

  // Writable by others: refused.
  fs::create_directories(base + "/open");
  chmod((base + "/open").c_str(), 0777);
  r = MakeRunDir(base + "/open");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("0777"));
  chmod((base + "/open").c_str(), 0770);
  EXPECT_EQ(MakeRunDir(base + "/open").status().code(), absl::StatusCode::kPermissionDenied);

  // Owned by another user: refused (root can make one).
  if (geteuid() == 0) {
    fs::create_directories(base + "/theirs");
    chmod((base + "/theirs").c_str(), 0700);
    ASSERT_EQ(chown((base + "/theirs").c_str(), 65534, 65534), 0);
    r = MakeRunDir(base + "/theirs");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("owned by uid 65534"));
  }
  fs::remove_all(base);
}

// A socket path longer than sockaddr_un holds is refused up front, before anything is created.
TEST(MakeRunDir, RefusesARunDirWhoseSocketPathIsTooLong) {
  const std::string base = TempPath("long");
  const std::string dir = base + "/" + std::string(120, 'd');
  auto r = MakeRunDir(dir);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("hostd.sock"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("107"));
  EXPECT_FALSE(fs::exists(base));
  EmbeddedOptions o;
  o.run_dir = dir;
  EXPECT_EQ(CheckEmbeddedOptions(o).code(), absl::StatusCode::kInvalidArgument);
  o.run_dir = std::string(107 - std::string("/hostd.sock").size(), 'd');  // exactly fits
  EXPECT_TRUE(CheckEmbeddedOptions(o).ok());
}

TEST(SpawnProcess, LogIsNeverASymlinksTarget) {
  const std::string dir = TempPath("spawnlog");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string victim = dir + "/victim";
  std::ofstream(victim) << "precious";
  fs::create_symlink(victim, dir + "/hostd.log");
  auto pid = SpawnProcess({"/bin/echo", "overwritten"}, dir + "/hostd.log");
  EXPECT_FALSE(pid.ok());
  if (pid.ok()) WaitExit(*pid, 10);
  EXPECT_THAT(std::string(pid.status().message()), HasSubstr(dir + "/hostd.log"));
  EXPECT_EQ(ReadText(victim), "precious");

  // A plain log works; a program that cannot run is an error, not a child that exits 127.
  pid = SpawnProcess({"/bin/echo", "hello"}, dir + "/echo.log");
  ASSERT_TRUE(pid.ok()) << pid.status();
  EXPECT_EQ(WaitExit(*pid, 10), 0);
  EXPECT_EQ(ReadText(dir + "/echo.log"), "hello\n");
  pid = SpawnProcess({dir + "/no-such-program"}, dir + "/missing.log");
  EXPECT_FALSE(pid.ok());
  EXPECT_THAT(std::string(pid.status().message()), HasSubstr("no-such-program"));
  fs::remove_all(dir);
}

// The fake CLI the two tests below spawn (this binary again, only this test, kChildEnv set): it
// stops private nodes on signals, as `slidedp run` does, starts a "hostd" and a "worker" (sleep),
// says their pids, and waits to be signalled or killed.
TEST(EmbeddedSignals, FakeCliChild) {
  const char* run_dir = std::getenv(kChildEnv);
  if (run_dir == nullptr) GTEST_SKIP() << "runs only as the fake CLI of the tests below";
  StopPrivateNodesOnSignal();
  auto hostd = SpawnProcess({"/bin/sleep", "1000"}, absl::StrCat(run_dir, "/hostd.log"));
  auto worker = SpawnProcess({"/bin/sleep", "1000"}, absl::StrCat(run_dir, "/worker0.log"));
  ASSERT_TRUE(hostd.ok() && worker.ok());
  auto node = EmbeddedNode::ForProcesses(run_dir, *hostd, {*worker});
  std::ofstream(absl::StrCat(run_dir, "/pids.tmp")) << *hostd << " " << *worker << "\n";
  fs::rename(absl::StrCat(run_dir, "/pids.tmp"), absl::StrCat(run_dir, "/pids"));
  absl::SleepFor(absl::Seconds(60));
  FAIL() << "not signalled";
}

// Starts the fake CLI with its run dir; returns its pid and the pids of its two children.
struct FakeCli {
  int pid = -1, hostd = -1, worker = -1;
};
FakeCli StartFakeCli(const std::string& run_dir) {
  FakeCli cli;
  std::error_code ec;
  const std::string self = fs::read_symlink("/proc/self/exe", ec).string();
  setenv(kChildEnv, run_dir.c_str(), 1);
  auto pid = SpawnProcess({self, "--gtest_filter=EmbeddedSignals.FakeCliChild"}, run_dir + "/cli.log");
  unsetenv(kChildEnv);
  EXPECT_TRUE(pid.ok()) << pid.status();
  if (!pid.ok()) return cli;
  cli.pid = *pid;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!fs::exists(run_dir + "/pids") && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  std::istringstream(ReadText(run_dir + "/pids")) >> cli.hostd >> cli.worker;
  EXPECT_GT(cli.hostd, 0) << ReadText(run_dir + "/cli.log");
  EXPECT_GT(cli.worker, 0);
  return cli;
}

// SIGTERM to the CLI only: it stops its hostd and workers, removes the socket, exits 128 + 15.
TEST(EmbeddedSignals, SigtermStopsThePrivateProcessesAndExits143) {
  auto run_dir = MakeRunDir(TempPath("sigterm"));
  ASSERT_TRUE(run_dir.ok()) << run_dir.status();
  // A socket left where the private hostd listens.
  const int sock = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sock_path = *run_dir + "/hostd.sock";
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock_path.c_str());
  ASSERT_EQ(bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  close(sock);

  FakeCli cli = StartFakeCli(*run_dir);
  ASSERT_GT(cli.pid, 0);
  ASSERT_GT(cli.hostd, 0);
  ASSERT_EQ(kill(cli.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(cli.pid, 30), 128 + SIGTERM) << ReadText(*run_dir + "/cli.log");
  // The CLI reaped them itself before exiting.
  EXPECT_TRUE(Gone(cli.hostd));
  EXPECT_TRUE(Gone(cli.worker));
  EXPECT_FALSE(fs::exists(sock_path));
  EXPECT_THAT(ReadText(*run_dir + "/cli.log"), HasSubstr("stopping the private hostd and workers"));
  fs::remove_all(*run_dir);
}

// SIGKILL to the CLI only: PR_SET_PDEATHSIG ends its children with SIGTERM. This process becomes
// their reaper (a subreaper) so their end can be waited for.
TEST(EmbeddedSignals, ChildrenDieWithAKilledCli) {
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  auto run_dir = MakeRunDir(TempPath("sigkill"));
  ASSERT_TRUE(run_dir.ok()) << run_dir.status();
  FakeCli cli = StartFakeCli(*run_dir);
  ASSERT_GT(cli.pid, 0);
  ASSERT_GT(cli.hostd, 0);
  ASSERT_EQ(kill(cli.pid, SIGKILL), 0);
  EXPECT_EQ(WaitExit(cli.pid, 30), 128 + SIGKILL);
  EXPECT_EQ(WaitExit(cli.hostd, 10), 128 + SIGTERM);
  EXPECT_EQ(WaitExit(cli.worker, 10), 128 + SIGTERM);
  prctl(PR_SET_CHILD_SUBREAPER, 0);
  fs::remove_all(*run_dir);
}

// A hostd that exits at start fails Start at once with the end of its log, not after 30 s with
// "Failed to create secure client channel".
TEST(EmbeddedNodeStart, HostdThatExitsAtStartFailsAtOnceWithItsLog) {
  const std::string bin = TempPath("bin_exits");
  fs::remove_all(bin);
  fs::create_directories(bin);
  WriteExecutable(bin + "/slidedp-hostd", "#!/bin/sh\necho 'hostd: cannot bind the socket: reason 42' >&2\nexit 3\n");
  WriteExecutable(bin + "/slidedp-worker", "#!/bin/sh\nexit 0\n");
  EmbeddedOptions o;
  o.bin_dir = bin;
  o.run_dir = bin + "/run";
  o.backend = "cpu";
  const absl::Time start = absl::Now();
  auto node = EmbeddedNode::Start(o);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(node.status().code(), absl::StatusCode::kUnavailable) << node.status();
  EXPECT_THAT(std::string(node.status().message()), HasSubstr("exited with status 3"));
  EXPECT_THAT(std::string(node.status().message()), HasSubstr("cannot bind the socket: reason 42"));
  EXPECT_THAT(std::string(node.status().message()), HasSubstr(o.run_dir + "/hostd.log"));
  fs::remove_all(bin);
}

// Too many CPU workers, or a socket path too long: refused before any process starts.
TEST(EmbeddedNodeStart, RefusesTooManyCpuWorkersBeforeStartingAnything) {
  const std::string bin = TempPath("bin_cap");
  fs::remove_all(bin);
  fs::create_directories(bin);
  WriteExecutable(bin + "/slidedp-hostd", absl::StrCat("#!/bin/sh\ntouch '", bin, "/hostd-ran'\nsleep 1000\n"));
  WriteExecutable(bin + "/slidedp-worker", "#!/bin/sh\nexit 0\n");
  EmbeddedOptions o;
  o.bin_dir = bin;
  o.run_dir = bin + "/run";
  o.backend = "cpu";
  o.cpu_workers = 100000;
  auto node = EmbeddedNode::Start(o);
  EXPECT_EQ(node.status().code(), absl::StatusCode::kInvalidArgument) << node.status();
  EXPECT_THAT(std::string(node.status().message()), HasSubstr("100000 CPU workers"));
  EXPECT_THAT(std::string(node.status().message()), HasSubstr(absl::StrCat(kMaxCpuWorkers)));
  o.cpu_workers = kMaxCpuWorkers;
  EXPECT_TRUE(CheckEmbeddedOptions(o).ok());
  o.cpu_workers = 2;
  o.run_dir = bin + "/" + std::string(120, 'r');
  node = EmbeddedNode::Start(o);
  EXPECT_EQ(node.status().code(), absl::StatusCode::kInvalidArgument) << node.status();
  EXPECT_FALSE(fs::exists(bin + "/hostd-ran"));
  fs::remove_all(bin);
}

// `run --resume`: NOT_FOUND naming the directory when there is no checkpoint to resume (the
// integration test run_resume_test resumes real ones).
TEST(ResolveRunResume, NoCheckpointIsNotFoundNamingTheDirectory) {
  const std::string dir = TempPath("resume");
  fs::remove_all(dir);
  absl::StatusOr<std::string> r = ResolveRunResume("latest", dir + "/out");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--resume latest: "));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(dir + "/out does not exist"));
  fs::create_directories(dir + "/out/checkpoint-3");  // not complete: no COMPLETE file
  r = ResolveRunResume("latest", dir + "/out");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("no complete checkpoint under " + dir + "/out"));
  r = ResolveRunResume(dir + "/nowhere", dir + "/out");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(dir + "/nowhere"));
  r = ResolveRunResume(dir + "/out", dir + "/unused");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--resume " + dir + "/out: no complete checkpoint"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace slidedp::client
