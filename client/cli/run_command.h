// `slidedp run SPEC`: one job on a private hostd and workers (embedded.h) started for it and
// stopped when it ends. The first Ctrl-C / SIGTERM saves a checkpoint at the next step boundary,
// ends the job there and says how to resume it (--resume); a second one stops at once.
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "client/cli/client.h"

namespace slidedp::client {

struct RunCommand {
  std::string spec_path;
  std::string resume;            // --resume: 'latest', a checkpoint, or a directory of checkpoints
  std::string backend = "auto";  // --backend: auto (the spec's) | cuda | cpu
  int cpu_workers = 0;           // --cpu-workers; 0: the spec's runtime.workers, else kDefaultCpuWorkers
  std::string run_dir;           // --run-dir; empty: a fresh /tmp/slidedp-run-XXXXXX
  std::string policy_cache;      // --policy-cache; empty: the user's cache directory; "none": nowhere
};

// Adds `run` to app (parsing fills `command`).
CLI::App* AddRunCommand(CLI::App& app, RunCommand& command);

// Runs the job on its private node and returns the job's exit code (ExitCodeForJob), 128 + the
// signal after a stop on a signal, or the failure's (ReportFailure); a private process that ended
// on its own is named on stderr. `client` gives the timeout and credentials; the address is the
// private hostd's.
int RunRunCommand(const RunCommand& command, const ClientOptions& client);

}  // namespace slidedp::client
