// `slidedp run`'s private node: spawn hostd and workers, wait for them, stop them.
#include "client/cli/embedded.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>
#include <utility>

#include "absl/base/const_init.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
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
  if (argv.empty()) return absl::InvalidArgumentError("spawn: no program");
  // O_NOFOLLOW: a symlink planted as the log would have the child overwrite what it points to;
  // O_NONBLOCK: a planted FIFO fails (ENXIO) instead of blocking the open.
  int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY,
                    0644);
  if (log_fd < 0) return ErrnoStatus(absl::StrCat("open log ", log_path), errno);
  struct stat st;
  if (fstat(log_fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(log_fd);
    return absl::InvalidArgumentError(absl::StrCat("log ", log_path, " is not a regular file"));
  }
  fcntl(log_fd, F_SETFL, fcntl(log_fd, F_GETFL) & ~O_NONBLOCK);
  if (log_fd <= 2) {  // stdout or stderr was closed: dup2 onto itself would keep O_CLOEXEC
    const int moved = fcntl(log_fd, F_DUPFD_CLOEXEC, 3);
    close(log_fd);
    if (moved < 0) return ErrnoStatus(absl::StrCat("open log ", log_path), errno);
    log_fd = moved;
  }
  int exec_error[2];  // the child writes exec's errno here; closed on a successful exec
  if (pipe2(exec_error, O_CLOEXEC) != 0) {
    const int err = errno;
    close(log_fd);
    return ErrnoStatus("pipe2", err);
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  sigset_t no_signals;
  sigemptyset(&no_signals);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec: the parent may have threads.
    // The CLI dying by any signal, SIGKILL included, ends its private processes too.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // the parent died before prctl: nothing will signal us
    // A group of its own: a terminal's Ctrl-C goes to the foreground group, which is the CLI's;
    // the CLI decides whether its hostd stops at once or first checkpoints the job.
    setpgid(0, 0);
    sigprocmask(SIG_SETMASK, &no_signals, nullptr);  // StopPrivateNodesOnSignal blocks SIGINT/SIGTERM
    if (dup2(log_fd, 1) < 0 || dup2(log_fd, 2) < 0) {
      const int err = errno;
      (void)!write(exec_error[1], &err, sizeof err);
      _exit(127);
    }
    execve(args[0], args.data(), environ);
    const int err = errno;
    (void)!write(exec_error[1], &err, sizeof err);
    _exit(127);
  }
  const int fork_errno = errno;
  close(exec_error[1]);
  close(log_fd);
  if (pid < 0) {
    close(exec_error[0]);
    return ErrnoStatus(absl::StrCat("spawn ", argv[0]), fork_errno);
  }
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(exec_error[0], &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  close(exec_error[0]);
  if (n == static_cast<ssize_t>(sizeof child_errno)) {
    waitpid(pid, nullptr, 0);
    return ErrnoStatus(absl::StrCat("spawn ", argv[0]), child_errno);
  }
  return static_cast<int>(pid);
}

int WaitExit(int pid, double timeout_s) {
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  int st = 0;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      return -1;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

absl::Status CheckEmbeddedOptions(const EmbeddedOptions& options) {
  if (options.backend != "cuda" && options.cpu_workers > kMaxCpuWorkers) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.cpu_workers, " CPU workers (--cpu-workers or the spec's runtime.workers): more than the ",
                     kMaxCpuWorkers, " one private node runs"));
  }
  const std::string socket = absl::StrCat(options.run_dir, "/hostd.sock");
  constexpr size_t kMaxSocketPath = sizeof(sockaddr_un::sun_path) - 1;
  if (!options.run_dir.empty() && socket.size() > kMaxSocketPath) {
    return absl::InvalidArgumentError(absl::StrCat("run dir ", options.run_dir, ": its socket path ", socket, " is ",
                                                   socket.size(), " bytes, more than the ", kMaxSocketPath,
                                                   " a Unix socket path may have; use a shorter --run-dir"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> MakeRunDir(const std::string& requested) {
  namespace fs = std::filesystem;
  std::string dir = requested;
  if (dir.empty()) {
    char tmpl[] = "/tmp/slidedp-run-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return ErrnoStatus("mkdtemp /tmp/slidedp-run-XXXXXX", errno);
    return std::string(tmpl);  // mode 0700, ours, new: nothing to check
  }
  EmbeddedOptions probe;
  probe.run_dir = dir;
  RETURN_IF_ERROR(CheckEmbeddedOptions(probe));
  std::error_code ec;
  const fs::path parent = fs::path(dir).parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) return ErrnoStatus(absl::StrCat("create run dir ", dir, ": ", parent.string()), ec.value());
  }
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoStatus(absl::StrCat("create run dir ", dir), errno);
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return ErrnoStatus(absl::StrCat("stat run dir ", dir), errno);
  if (!S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat("run dir ", dir, " is not a directory"));
  if (st.st_uid != geteuid()) {
    return absl::PermissionDeniedError(
        absl::StrCat("run dir ", dir, " is owned by uid ", st.st_uid, ", not by this user (uid ", geteuid(), ")"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "run dir %s has mode %04o: others may write there (plant a socket or a log symlink); use a directory "
        "only you may write to (chmod go-w)",
        dir, st.st_mode & 07777));
  }
  return dir;
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

// The last lines of a log (up to max_bytes of them), for an error message.
std::string LogTail(const std::string& path, size_t max_bytes) {
  const int fd = open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return "";
  struct stat st;
  std::string out;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
    const off_t from = st.st_size > static_cast<off_t>(max_bytes) ? st.st_size - static_cast<off_t>(max_bytes) : 0;
    out.resize(static_cast<size_t>(st.st_size - from));
    const ssize_t n = pread(fd, out.data(), out.size(), from);
    out.resize(n > 0 ? static_cast<size_t>(n) : 0);
    if (from > 0) {  // start at a whole line
      const size_t nl = out.find('\n');
      out = nl == std::string::npos ? out : out.substr(nl + 1);
    }
  }
  close(fd);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

// The nodes StopPrivateNodesOnSignal stops: every EmbeddedNode between its creation and its
// destructor. Lock order: g_nodes_mu before a node's mu_.
ABSL_CONST_INIT absl::Mutex g_nodes_mu(absl::kConstInit);
std::vector<EmbeddedNode*>& LiveNodes() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_nodes_mu) {
  static auto* nodes = new std::vector<EmbeddedNode*>();
  return *nodes;
}

}  // namespace

EmbeddedNode::EmbeddedNode() {
  absl::MutexLock lock(&g_nodes_mu);
  LiveNodes().push_back(this);
}

std::unique_ptr<EmbeddedNode> EmbeddedNode::ForProcesses(const std::string& run_dir, int hostd_pid,
                                                         std::vector<int> worker_pids) {
  std::unique_ptr<EmbeddedNode> node(new EmbeddedNode());
  node->options_.run_dir = run_dir;
  node->address_ = absl::StrCat("unix:", run_dir, "/hostd.sock");
  node->num_workers_ = static_cast<int>(worker_pids.size());
  absl::MutexLock lock(&node->mu_);
  node->hostd_pid_ = hostd_pid;
  node->worker_pids_ = std::move(worker_pids);
  return node;
}

absl::StatusOr<std::unique_ptr<EmbeddedNode>> EmbeddedNode::Start(const EmbeddedOptions& options) {
  RETURN_IF_ERROR(CheckEmbeddedOptions(options));
  std::unique_ptr<EmbeddedNode> node(new EmbeddedNode());
  node->options_ = options;
  ASSIGN_OR_RETURN(node->options_.run_dir, MakeRunDir(options.run_dir));
  const std::string& run_dir = node->options_.run_dir;
  const std::string hostd = options.bin_dir + "/slidedp-hostd";
  const std::string worker = options.bin_dir + "/slidedp-worker";
  for (const auto& b : {hostd, worker}) {
    if (access(b.c_str(), X_OK) != 0) return absl::NotFoundError(absl::StrCat("cannot find executable ", b));
  }
  node->address_ = absl::StrCat("unix:", run_dir, "/hostd.sock");
  node->node_name_ = absl::StrCat("run", getpid());
  std::vector<std::string> hargs = {hostd, "--listen", node->address_, "--node-name", node->node_name_};
  hargs.insert(hargs.end(), options.hostd_args.begin(), options.hostd_args.end());
  const std::string hostd_log = run_dir + "/hostd.log";
  ASSIGN_OR_RETURN(int hostd_pid, SpawnProcess(hargs, hostd_log));
  {
    absl::MutexLock lock(&node->mu_);
    node->hostd_pid_ = hostd_pid;
  }
  ClientOptions copt;
  copt.address = node->address_;
  Client client(copt);
  {
    // Wait for hostd to serve; one that exits at start (a flag it refuses, a socket it cannot
    // bind) fails this at once, with the end of its log, rather than after the whole wait.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (true) {
      std::string serving;
      const absl::Status health = client.Health(&serving);
      if (health.ok()) break;
      {
        absl::MutexLock lock(&node->mu_);
        int st = 0;
        if (node->hostd_pid_ > 0 && waitpid(node->hostd_pid_, &st, WNOHANG) == node->hostd_pid_) {
          const int pid = node->hostd_pid_;
          node->hostd_pid_ = -1;
          const std::string tail = LogTail(hostd_log, 2048);
          return absl::UnavailableError(absl::StrCat("starting hostd: the private hostd (pid ", pid, ") ",
                                                     DescribeExit(st), " before serving; the end of its log (",
                                                     hostd_log, "):\n", tail.empty() ? "(empty)" : tail));
        }
      }
      if (absl::Now() > deadline) {
        return absl::UnavailableError(absl::StrCat("starting hostd (log: ", hostd_log, "): not serving after 30 s: ",
                                                   health.message()));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  }

  std::string backend = options.backend;
  int gpus = backend == "cpu" ? 0 : CountGpus(worker);
  if (backend == "cuda" && gpus == 0) return absl::FailedPreconditionError("backend cuda requested but no GPU is visible");
  if (backend == "auto") backend = gpus > 0 ? "cuda" : "cpu";
  int n = backend == "cuda" ? gpus : std::max(1, options.cpu_workers);
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> wargs = {worker, "--hostd", node->address_, "--backend", backend,
                                      backend == "cuda" ? "--gpu" : "--index", std::to_string(i)};
    ASSIGN_OR_RETURN(int pid, SpawnProcess(wargs, absl::StrCat(run_dir, "/worker", i, ".log")));
    absl::MutexLock lock(&node->mu_);
    node->worker_pids_.push_back(pid);
    node->num_workers_ = static_cast<int>(node->worker_pids_.size());
  }
  // Wait for the workers to attach.
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (true) {
    auto ws = client.Workers();
    if (ws.ok() && static_cast<int>(ws->size()) >= n) break;
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat(n, " worker(s) did not attach within 60 s (logs in ", run_dir, ")"));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return node;
}

void EmbeddedNode::ReapEnded() {
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
}

std::vector<std::string> EmbeddedNode::Ended(absl::Duration grace) {
  const absl::Time deadline = absl::Now() + grace;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      ReapEnded();
      if (!ended_.empty() || absl::Now() >= deadline) return ended_;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void EmbeddedNode::Stop() {
  absl::MutexLock lock(&mu_);
  std::vector<int> pids;
  for (int pid : worker_pids_) {
    if (pid > 0) pids.push_back(pid);
  }
  if (hostd_pid_ > 0) pids.push_back(hostd_pid_);
  for (int pid : worker_pids_) {
    if (pid > 0) kill(pid, SIGTERM);
  }
  if (!pids.empty()) absl::SleepFor(absl::Milliseconds(100));
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
  for (int& pid : worker_pids_) pid = -1;
  hostd_pid_ = -1;
  // Every process of the private node is gone: what it left in /dev/shm (a hostd killed mid-job
  // cannot unlink its job's state, tens of GB that no later hostd of another name would reclaim)
  // belongs to no one now.
  if (!node_name_.empty()) {
    const int removed = RemoveNodeSegments(node_name_);
    if (removed > 0) {
      fprintf(stderr, "slidedp: removed %d shared-memory segment(s) the private hostd left in /dev/shm\n", removed);
    }
  }
  // So does its socket, which a hostd that did not shut down cleanly leaves behind.
  if (!address_.empty()) {
    const std::string socket = address_.substr(5);  // "unix:"
    struct stat st;
    if (lstat(socket.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(socket.c_str());
  }
}

EmbeddedNode::~EmbeddedNode() {
  {
    absl::MutexLock lock(&g_nodes_mu);
    auto& nodes = LiveNodes();
    nodes.erase(std::remove(nodes.begin(), nodes.end(), this), nodes.end());
  }
  Stop();
}

namespace {

std::atomic<int> g_first_signal{0};
std::atomic<bool> g_stopping_at_once{false};
ABSL_CONST_INIT absl::Mutex g_action_mu(absl::kConstInit);
std::function<void(int)>& FirstSignalAction() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_action_mu) {
  static auto* action = new std::function<void(int)>();
  return *action;
}

}  // namespace

void SetFirstStopSignalAction(std::function<void(int signal)> action) {
  absl::MutexLock lock(&g_action_mu);
  FirstSignalAction() = std::move(action);
}

int FirstStopSignal() { return g_first_signal.load(); }

bool StoppingAtOnce() { return g_stopping_at_once.load(); }

void AwaitStopIfStopping() {
  while (StoppingAtOnce()) absl::SleepFor(absl::Seconds(1));
}

void ExitForSignal(int signal) {
  fflush(stdout);
  fflush(stderr);
  // The CLI's own exit status for the signal, as a shell reports a process killed by it.
  _exit(128 + signal);
}

void StopAtOnce(int signal) {
  g_stopping_at_once.store(true);
  absl::MutexLock lock(&g_nodes_mu);  // held until _exit: no node is destroyed meanwhile
  if (!LiveNodes().empty()) {
    fprintf(stderr, "\nslidedp: %s: stopping the private hostd and workers\n", strsignal(signal));
  }
  for (EmbeddedNode* node : LiveNodes()) node->Stop();
  ExitForSignal(signal);
}

void StopPrivateNodesOnSignal() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::thread([stop_signals] {
    pthread_setname_np(pthread_self(), "slidedp-signals");
    while (true) {
      int sig = 0;
      if (sigwait(&stop_signals, &sig) != 0) continue;
      int none = 0;
      std::function<void(int)> action;
      if (g_first_signal.compare_exchange_strong(none, sig)) {
        absl::MutexLock lock(&g_action_mu);
        action = std::exchange(FirstSignalAction(), nullptr);
      }
      if (!action) StopAtOnce(sig);
      // On a thread of its own: it may wait on hostd, and a second signal must still stop at once.
      std::thread([action = std::move(action), sig] {
        pthread_setname_np(pthread_self(), "slidedp-stop");
        action(sig);
      }).detach();
    }
  }).detach();
}

absl::StatusOr<std::string> ResolveRunResume(const std::string& what, const std::string& output_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (what == "latest") {
    if (!fs::is_directory(output_dir, ec)) {
      return absl::NotFoundError(absl::StrCat("--resume latest: no checkpoint to resume: the spec's output.dir ",
                                              output_dir, " does not exist"));
    }
    absl::StatusOr<std::string> latest = checkpoint::FindLatestCheckpoint(output_dir);
    if (!latest.ok()) {
      return absl::Status(latest.status().code(),
                          absl::StrCat("--resume latest: ", latest.status().message(), " (the spec's output.dir)"));
    }
    return *latest;
  }
  const fs::path absolute = fs::absolute(what, ec);
  const std::string dir = ec ? what : absolute.lexically_normal().string();
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("--resume ", what, ": no such directory (", dir, ")"));
  }
  if (fs::exists(fs::path(dir) / "COMPLETE", ec)) {
    absl::StatusOr<int64_t> step = checkpoint::VerifyCheckpoint(dir);
    if (!step.ok()) return Annotate(step.status(), absl::StrCat("--resume ", what));
    return dir;
  }
  absl::StatusOr<std::string> latest = checkpoint::FindLatestCheckpoint(dir);
  if (!latest.ok()) return Annotate(latest.status(), absl::StrCat("--resume ", what));
  return *latest;
}

}  // namespace slidedp::client
