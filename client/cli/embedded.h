// `slidedp run`: a private hostd and one worker per device for one job, started as child
// processes of the CLI and stopped when the job ends.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace slidedp::client {

struct EmbeddedOptions {
  std::string bin_dir;        // where slidedp-hostd and slidedp-worker live
  std::string run_dir;        // private socket, logs; created
  std::string backend = "auto";  // auto: cuda when a GPU is visible, else cpu
  int cpu_workers = 1;        // CPU backend workers
  std::vector<std::string> hostd_args;
};

class EmbeddedNode {
 public:
  static absl::StatusOr<std::unique_ptr<EmbeddedNode>> Start(const EmbeddedOptions& options);
  // SIGTERM to workers and hostd, then wait (SIGKILL after a grace period); then removes the
  // private node's shared-memory segments that a hostd killed mid-job left in /dev/shm.
  ~EmbeddedNode();
  const std::string& address() const { return address_; }
  // The private processes that have ended, one line each ("the private hostd (pid 12) was killed
  // by signal 9 (SIGKILL: ...)"), waiting up to `grace` for one whose socket just closed to be
  // reaped; empty while all run. They are reaped here, so the destructor does not wait for them.
  std::vector<std::string> Ended(absl::Duration grace);
  int num_workers() const { return static_cast<int>(worker_pids_.size()); }
  std::string log_dir() const { return options_.run_dir; }

 private:
  EmbeddedNode() = default;
  EmbeddedOptions options_;
  std::string address_, node_name_;
  int hostd_pid_ = -1;
  std::vector<int> worker_pids_;
  std::vector<std::string> ended_;  // what Ended() found, kept for the next call
};

// Spawns argv[0] with args, stdout/stderr to log_path. Returns the pid.
absl::StatusOr<int> SpawnProcess(const std::vector<std::string>& argv, const std::string& log_path);
// Directory holding the running executable.
std::string SelfDir();
// Number of CUDA devices the worker binary reports (0 when none or no CUDA build).
int CountGpus(const std::string& worker_bin);

}  // namespace slidedp::client
