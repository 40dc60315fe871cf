// `slidedp run`'s private node: spawn hostd and workers, wait for them, stop them.
#include "client/cli/embedded.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cli/client.h"
#include "common/status/status_macros.h"

extern char** environ;

namespace slidedp::client {

std::string SelfDir() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

absl::StatusOr<int> SpawnProcess(const std::vector<std::string>& argv, const std::string& log_path) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return ErrnoStatus(absl::StrCat("spawn ", argv[0]), rc);
  return static_cast<int>(pid);
}

int CountGpus(const std::string& worker_bin) {
  std::string cmd = absl::StrCat("'", worker_bin, "' --count-gpus 2>/dev/null");
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return 0;
  int n = 0;
  if (fscanf(f, "%d", &n) != 1) n = 0;
  pclose(f);
  return n;
}

namespace {

// How a child ended, from its waitpid status: "exited with status 3", "was killed by signal 9
// (SIGKILL: ...)".
std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  if (!WIFSIGNALED(wait_status)) return absl::StrCat("ended (wait status ", wait_status, ")");
  const int sig = WTERMSIG(wait_status);
  std::string out = absl::StrCat("was killed by signal ", sig);
  if (sig == SIGKILL) {
    absl::StrAppend(&out, " (SIGKILL: nothing here sends it, so most likely the kernel's OOM killer: "
                          "the host ran out of memory; `dmesg | grep -i oom` says)");
  } else if (const char* name = strsignal(sig); name != nullptr) {
    absl::StrAppend(&out, " (", name, ")");
  }
  return out;
}

// Removes /dev/shm/slidedp.<node>.*; returns how many it removed.
int RemoveNodeSegments(const std::string& node_name) {
  const std::string prefix = absl::StrCat("slidedp.", node_name, ".");
  int removed = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0 && std::filesystem::remove(e.path(), ec)) ++removed;
  }
  return removed;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EmbeddedNode>> EmbeddedNode::Start(const EmbeddedOptions& options) {
  std::unique_ptr<EmbeddedNode> node(new EmbeddedNode());
  node->options_ = options;
  std::filesystem::create_directories(options.run_dir);
  const std::string hostd = options.bin_dir + "/slidedp-hostd";
  const std::string worker = options.bin_dir + "/slidedp-worker";
  for (const auto& b : {hostd, worker}) {
    if (access(b.c_str(), X_OK) != 0) return absl::NotFoundError(absl::StrCat("cannot find executable ", b));
  }
  node->address_ = absl::StrCat("unix:", options.run_dir, "/hostd.sock");
  node->node_name_ = absl::StrCat("run", getpid());
  std::vector<std::string> hargs = {hostd, "--listen", node->address_, "--node-name", node->node_name_};
  hargs.insert(hargs.end(), options.hostd_args.begin(), options.hostd_args.end());
  ASSIGN_OR_RETURN(node->hostd_pid_, SpawnProcess(hargs, options.run_dir + "/hostd.log"));
  ClientOptions copt;
  copt.address = node->address_;
  Client client(copt);
  RETURN_IF_ERROR(Annotate(client.WaitReady(30), absl::StrCat("starting hostd (log: ", options.run_dir, "/hostd.log)")));

  std::string backend = options.backend;
  int gpus = backend == "cpu" ? 0 : CountGpus(worker);
  if (backend == "cuda" && gpus == 0) return absl::FailedPreconditionError("backend cuda requested but no GPU is visible");
  if (backend == "auto") backend = gpus > 0 ? "cuda" : "cpu";
  int n = backend == "cuda" ? gpus : std::max(1, options.cpu_workers);
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> wargs = {worker, "--hostd", node->address_, "--backend", backend,
                                      backend == "cuda" ? "--gpu" : "--index", std::to_string(i)};
    ASSIGN_OR_RETURN(int pid, SpawnProcess(wargs, absl::StrCat(options.run_dir, "/worker", i, ".log")));
    node->worker_pids_.push_back(pid);
  }
  // Wait for the workers to attach.
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (true) {
    auto ws = client.Workers();
    if (ws.ok() && static_cast<int>(ws->size()) >= n) break;
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(n, " worker(s) did not attach within 60 s (logs in ", options.run_dir, ")"));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return node;
}

std::vector<std::string> EmbeddedNode::Ended(absl::Duration grace) {
  const absl::Time deadline = absl::Now() + grace;
  while (true) {
    auto reap = [&](int& pid, const std::string& what) {
      if (pid <= 0) return;
      int st = 0;
      if (waitpid(pid, &st, WNOHANG) == pid) {
        ended_.push_back(absl::StrCat(what, " (pid ", pid, ") ", DescribeExit(st)));
        pid = -1;
      }
    };
    reap(hostd_pid_, "the private hostd");
    for (size_t i = 0; i < worker_pids_.size(); ++i) reap(worker_pids_[i], absl::StrCat("worker ", i));
    if (!ended_.empty() || absl::Now() >= deadline) return ended_;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

EmbeddedNode::~EmbeddedNode() {
  std::vector<int> pids;
  for (int pid : worker_pids_) {
    if (pid > 0) pids.push_back(pid);
  }
  if (hostd_pid_ > 0) pids.push_back(hostd_pid_);
  for (int pid : worker_pids_) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  absl::SleepFor(absl::Milliseconds(100));
  if (hostd_pid_ > 0) kill(hostd_pid_, SIGTERM);
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (int pid : pids) {
    while (waitpid(pid, nullptr, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  // Every process of the private node is gone: what it left in /dev/shm (a hostd killed mid-job
  // cannot unlink its job's state, tens of GB that no later hostd of another name would reclaim)
  // belongs to no one now.
  if (!node_name_.empty()) {
    const int removed = RemoveNodeSegments(node_name_);
    if (removed > 0) {
      fprintf(stderr, "slidedp: removed %d shared-memory segment(s) the private hostd left in /dev/shm\n", removed);
    }
  }
}

}  // namespace slidedp::client
