// `slidedp run`: a private hostd and one worker per device for one job, started as child
// processes of the CLI and stopped when the job ends.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

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
  ~EmbeddedNode();  // SIGTERM to workers and hostd, then wait (SIGKILL after a grace period)
  const std::string& address() const { return address_; }
  int num_workers() const { return static_cast<int>(worker_pids_.size()); }
  std::string log_dir() const { return options_.run_dir; }

 private:
  EmbeddedNode() = default;
  EmbeddedOptions options_;
  std::string address_;
  int hostd_pid_ = -1;
  std::vector<int> worker_pids_;
};

// Spawns argv[0] with args, stdout/stderr to log_path. Returns the pid.
absl::StatusOr<int> SpawnProcess(const std::vector<std::string>& argv, const std::string& log_path);
// Directory holding the running executable.
std::string SelfDir();
// Number of CUDA devices the worker binary reports (0 when none or no CUDA build).
int CountGpus(const std::string& worker_bin);

}  // namespace slidedp::client
