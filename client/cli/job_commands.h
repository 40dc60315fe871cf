// The commands on hostd's jobs: `slidedp jobs`, `submit`, `status`, `watch` and `cancel`. The text
// they print is client.h's (FormatJobsTable, FormatJobStatus, FormatJobLine, Watch's progress).
// While `submit` or `watch` follows a job, the first Ctrl-C (or SIGTERM) stops the watching, not
// the job: it says how to follow or cancel the job, and the CLI exits with 128 + the signal.
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "client/cli/client.h"

namespace slidedp::client {

struct JobsCommand {
  bool json = false;  // --json: ListJobsResponse as protobuf JSON
};

// Adds `jobs` to app (parsing fills `command`). Run: the jobs table.
CLI::App* AddJobsCommand(CLI::App& app, JobsCommand& command);
int RunJobsCommand(const JobsCommand& command, const ClientOptions& client);

struct SubmitCommand {
  std::string spec_path;  // empty with --resume: the resumed job's own resolved spec
  std::string job_id;     // --id: idempotent resubmission
  std::string resume;     // --resume: a job id or a checkpoint directory
  bool dry_run = false;   // --dry-run: validate and print the resolved spec
  bool detach = false;    // --detach: do not watch the job
  // A job over nodes: runtime.nodes from a comma list, @FILE or "slurm" (SLURM_JOB_NODELIST), and
  // the port of names given without one (common/jobspec/node_list.h).
  std::string nodes;
  int node_port = 0;
};

// Adds `submit` to app; parsing refuses it without a spec or --resume. Run: submits, then (unless
// --detach or --dry-run) follows the job and exits with its code (ExitCodeForJob).
CLI::App* AddSubmitCommand(CLI::App& app, SubmitCommand& command);
int RunSubmitCommand(const SubmitCommand& command, const ClientOptions& client);

// `status`, `watch`, `cancel`: one job by its id.
struct JobIdCommand {
  std::string job_id;
  bool json = false;  // status --json: the Job as protobuf JSON
};

CLI::App* AddStatusCommand(CLI::App& app, JobIdCommand& command);
int RunStatusCommand(const JobIdCommand& command, const ClientOptions& client);
// Run: follows the job to its end and exits with its code (ExitCodeForJob).
CLI::App* AddWatchCommand(CLI::App& app, JobIdCommand& command);
int RunWatchCommand(const JobIdCommand& command, const ClientOptions& client);
// Run: prints the cancelled job's line (FormatJobLine).
CLI::App* AddCancelCommand(CLI::App& app, JobIdCommand& command);
int RunCancelCommand(const JobIdCommand& command, const ClientOptions& client);

}  // namespace slidedp::client
