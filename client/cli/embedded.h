// `slidedp run`: a private hostd and one worker per device for one job, started as child
// processes of the CLI and stopped when the job ends, when the CLI gets SIGINT or SIGTERM
// (StopPrivateNodesOnSignal: the first one may first end the job at a step boundary), and,
// through PR_SET_PDEATHSIG, when the CLI itself is killed. Also how the CLI answers those signals
// while it watches a job, and `run --resume`'s checkpoint.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace slidedp::client {

// Each CPU worker is a process with its own copy of the model's working set; more than this on
// one node is a typo, not a plan.
inline constexpr int kMaxCpuWorkers = 64;
// CPU backend workers when neither --cpu-workers nor the spec's runtime.workers says: two, so
// that the default run is data parallel.
inline constexpr int kDefaultCpuWorkers = 2;

struct EmbeddedOptions {
  std::string bin_dir;        // where slidedp-hostd and slidedp-worker live
  std::string run_dir;        // private socket, logs; made by MakeRunDir
  std::string backend = "auto";  // auto: cuda when a GPU is visible, else cpu
  int cpu_workers = kDefaultCpuWorkers;  // CPU backend workers, at most kMaxCpuWorkers
  std::vector<std::string> hostd_args;
};

// INVALID_ARGUMENT for options Start would refuse: too many CPU workers, or a run dir whose
// socket path does not fit a Unix socket address (sizeof(sockaddr_un::sun_path) - 1 bytes).
absl::Status CheckEmbeddedOptions(const EmbeddedOptions& options);

// The private node's run directory: `requested` (created with mode 0700 when missing, parents as
// needed), or, when empty, a fresh /tmp/slidedp-run-XXXXXX (mkdtemp). Refused, naming the path,
// when it is not a directory, not owned by this user, or writable by group or others: another
// user could plant a socket or a log symlink there.
absl::StatusOr<std::string> MakeRunDir(const std::string& requested);

class EmbeddedNode {
 public:
  static absl::StatusOr<std::unique_ptr<EmbeddedNode>> Start(const EmbeddedOptions& options);
  // Tests: a node of processes already running (stopped and reaped as Start's are; its socket
  // is run_dir/hostd.sock).
  static std::unique_ptr<EmbeddedNode> ForProcesses(const std::string& run_dir, int hostd_pid,
                                                    std::vector<int> worker_pids);
  // Stop().
  ~EmbeddedNode();
  // SIGTERM to workers and hostd, then wait (SIGKILL after a grace period); then removes the
  // private node's shared-memory segments that a hostd killed mid-job left in /dev/shm, and the
  // socket such a hostd leaves in the run dir. Idempotent; safe from another thread.
  void Stop();
  const std::string& address() const { return address_; }
  // The private processes that have ended, one line each ("the private hostd (pid 12) was killed
  // by signal 9 (SIGKILL: ...)"), waiting up to `grace` for one whose socket just closed to be
  // reaped; empty while all run. They are reaped here, so the destructor does not wait for them.
  std::vector<std::string> Ended(absl::Duration grace);
  int num_workers() const { return num_workers_; }
  std::string log_dir() const { return options_.run_dir; }

 private:
  EmbeddedNode();
  // What Ended() does once, without waiting.
  void ReapEnded() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  EmbeddedOptions options_;
  std::string address_, node_name_;
  int num_workers_ = 0;
  absl::Mutex mu_;  // Stop() may run on the signal thread while main is in Ended()
  int hostd_pid_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<int> worker_pids_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> ended_ ABSL_GUARDED_BY(mu_);  // what Ended() found, kept for the next call
};

// How the CLI answers SIGINT and SIGTERM. Call once, from main before any other thread starts:
// it blocks both signals (every later thread inherits the mask; SpawnProcess's children get them
// back) and waits for them on a thread of its own. Then:
//  - the first signal, while an action is set (SetFirstStopSignalAction), runs that action on a
//    thread of its own and the process goes on: `slidedp run` asks its hostd to save a checkpoint
//    at the next step boundary and cancel the job; `submit` and `watch` say the job goes on and
//    exit (ExitForSignal);
//  - any other signal stops at once (StopAtOnce).
void StopPrivateNodesOnSignal();
// Sets the first signal's action (an empty function: none). It runs at most once.
void SetFirstStopSignalAction(std::function<void(int signal)> action);
// The first SIGINT or SIGTERM received; 0 while none was.
int FirstStopSignal();
// Whether the process is stopping at once: it ends soon with 128 + the signal and its private
// nodes are going away, so what fails meanwhile on other threads (the job's stream, whose hostd
// went) is no error to print.
bool StoppingAtOnce();
// Blocks the calling thread for good while StoppingAtOnce() (the stopping thread ends the
// process); returns at once otherwise.
void AwaitStopIfStopping();
// Stops every EmbeddedNode not yet destroyed, then ends the process with 128 + signal.
[[noreturn]] void StopAtOnce(int signal);
// Flushes stdout and ends the process with 128 + signal (no node is stopped).
[[noreturn]] void ExitForSignal(int signal);

// `slidedp run --resume WHAT`: the checkpoint the private hostd resumes from. "latest": the
// newest complete checkpoint under `output_dir` (the spec's output.dir, resolved against the
// spec's directory as the private hostd resolves it); otherwise a path (relative to the working
// directory): a checkpoint directory, or a directory of checkpoints (its newest complete one).
// NOT_FOUND naming the directory when it holds none; what is wrong with a checkpoint that is
// there (incomplete, corrupt) as checkpoint::VerifyCheckpoint says.
absl::StatusOr<std::string> ResolveRunResume(const std::string& what, const std::string& output_dir);

// Spawns argv[0] with args, stdout/stderr to log_path (created or truncated; refused when it is a
// symlink or not a regular file). The child gets SIGTERM when the calling thread ends
// (PR_SET_PDEATHSIG), so a killed CLI leaves no private process behind, and leads a process group
// of its own, so that a terminal's Ctrl-C reaches the CLI alone (which decides what the private
// node does: first a checkpoint). Returns the pid.
absl::StatusOr<int> SpawnProcess(const std::vector<std::string>& argv, const std::string& log_path);
// The exit status of child `pid` (128 + the signal when a signal ended it), waiting at most
// `timeout_s`; -1 when it still runs then (it is killed with SIGKILL and reaped).
int WaitExit(int pid, double timeout_s);
// Directory holding the running executable.
std::string SelfDir();
// Number of CUDA devices the worker binary reports (0 when none or no CUDA build).
int CountGpus(const std::string& worker_bin);

}  // namespace slidedp::client
