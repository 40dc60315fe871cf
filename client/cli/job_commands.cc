// `slidedp jobs`, `submit`, `status`, `watch` and `cancel` (job_commands.h).
#include "client/cli/job_commands.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "client/cli/command_io.h"
#include "client/cli/embedded.h"
#include "common/jobspec/node_list.h"

namespace slidedp::client {
namespace {

// What the CLI's own address flag adds to a command it suggests ("" for the default address).
std::string HostdFlag(const ClientOptions& o) {
  return o.address == ClientOptions().address ? "" : absl::StrCat(" --hostd ", ShellQuote(o.address));
}

// While `submit` or `watch` follows a job, the first Ctrl-C (or SIGTERM) stops the watching, not
// the job: it says so and how to follow or cancel the job, and the CLI exits with 128 + the
// signal (a script sees it was interrupted, not that the job succeeded). A second one meanwhile
// exits at once.
void DetachOnSignal(const ClientOptions& o, const std::string& job_id) {
  const std::string hint =
      job_id.empty() ? std::string("interrupted while submitting: `slidedp jobs` shows whether the job was queued")
                     : absl::StrCat("stopped watching; the job goes on: slidedp", HostdFlag(o), " watch ", job_id,
                                    " follows it, slidedp", HostdFlag(o), " cancel ", job_id, " stops it");
  SetFirstStopSignalAction([hint](int sig) {
    fprintf(stderr, "\nslidedp: %s: %s\n", strsignal(sig), hint.c_str());
    ExitForSignal(sig);
  });
}

// Follows job `id` to its end on stdout; its exit code (ExitCodeForJob).
int WatchToEnd(Client& client, const std::string& id) {
  auto job = client.Watch(id, std::cout, isatty(1));
  if (!job.ok()) return ReportFailure(job.status());
  return ExitCodeForJob(*job);
}

CLI::App* AddJobIdSubcommand(CLI::App& app, const std::string& name, const std::string& description,
                             JobIdCommand& command) {
  auto* cmd = app.add_subcommand(name, description);
  cmd->add_option("job", command.job_id)->required();
  return cmd;
}

}  // namespace

CLI::App* AddJobsCommand(CLI::App& app, JobsCommand& command) {
  auto* cmd = app.add_subcommand("jobs", "list jobs");
  AddJsonFlag(*cmd, command.json);
  return cmd;
}

int RunJobsCommand(const JobsCommand& command, const ClientOptions& client_options) {
  Client client(client_options);
  auto js = client.ListJobs();
  if (!js.ok()) return ReportFailure(js.status());
  if (command.json) {
    v1::ListJobsResponse all;
    for (const auto& j : *js) *all.add_jobs() = j;
    return PrintJson(all);
  }
  std::cout << FormatJobsTable(*js);
  return 0;
}

CLI::App* AddSubmitCommand(CLI::App& app, SubmitCommand& command) {
  auto* cmd = app.add_subcommand("submit", "submit a job spec");
  AddJobSpecArgument(*cmd, command.spec_path);
  cmd->add_option("--id", command.job_id, "job id (idempotent resubmission)");
  cmd->add_option("--resume", command.resume, "resume from the last checkpoint of a job id or checkpoint dir");
  cmd->add_flag("--dry-run", command.dry_run, "validate and print the resolved spec");
  cmd->add_option("--nodes", command.nodes,
                  "a job over nodes: runtime.nodes from HOST:PORT,..., @FILE (one a line) or slurm "
                  "(SLURM_JOB_NODELIST); submit to one of them");
  cmd->add_option("--node-port", command.node_port, "--nodes: the port of names given without one")
      ->check(CLI::Range(1, 65535));
  cmd->add_flag("--detach", command.detach,
                "do not watch progress (while it watches, Ctrl-C stops the watching, not the job: exit 130)");
  cmd->callback([&command] {
    if (command.spec_path.empty() && command.resume.empty()) {
      throw CLI::ValidationError("submit", "a job spec is required");
    }
  });
  return cmd;
}

int RunSubmitCommand(const SubmitCommand& command, const ClientOptions& client_options) {
  const bool watch = !command.detach && !command.dry_run;
  // Before the client's first thread: while it follows the job, Ctrl-C stops the watching.
  if (watch) StopPrivateNodesOnSignal();
  Client client(client_options);
  v1::SubmitJobRequest req;
  if (command.spec_path.empty()) {
    // `submit --resume JOB_ID` alone: the interrupted job's own resolved spec.
    auto previous = client.GetJob(command.resume);
    if (!previous.ok()) {
      return ReportFailure(absl::InvalidArgumentError("give a job spec, or --resume with the id of a job hostd knows"));
    }
    req.set_spec_yaml(previous->resolved_spec_yaml());
  } else {
    auto text = ReadJobSpec(command.spec_path);
    if (!text.ok()) return ReportFailure(text.status());
    if (!command.nodes.empty()) {
      auto nodes = slidedp::NodesFromArgument(command.nodes, command.node_port, std::getenv("SLURM_JOB_NODELIST"));
      if (!nodes.ok()) return ReportFailure(nodes.status());
      text = slidedp::SpecWithNodes(*text, *nodes);
      if (!text.ok()) return ReportFailure(text.status());
    }
    req.set_spec_yaml(*text);
    req.set_base_dir(JobSpecDir(command.spec_path));
  }
  req.set_job_id(command.job_id);
  req.set_dry_run(command.dry_run);
  req.set_resume_from(ResumeTarget(command.resume));
  if (watch) DetachOnSignal(client_options, "");
  auto resp = client.Submit(req);
  if (!resp.ok()) return ReportFailure(resp.status());
  if (command.dry_run) {
    std::cout << resp->job().resolved_spec_yaml();
    return 0;
  }
  std::cout << (resp->already_existed() ? "job exists: " : "submitted job ") << resp->job().job_id() << "\n";
  if (!watch) return 0;
  DetachOnSignal(client_options, resp->job().job_id());
  return WatchToEnd(client, resp->job().job_id());
}

CLI::App* AddStatusCommand(CLI::App& app, JobIdCommand& command) {
  auto* cmd = AddJobIdSubcommand(app, "status", "show a job", command);
  AddJsonFlag(*cmd, command.json);
  return cmd;
}

int RunStatusCommand(const JobIdCommand& command, const ClientOptions& client_options) {
  Client client(client_options);
  auto j = client.GetJob(command.job_id);
  if (!j.ok()) return ReportFailure(j.status());
  if (command.json) return PrintJson(*j);
  std::cout << FormatJobStatus(*j, absl::LocalTimeZone());
  return 0;
}

CLI::App* AddWatchCommand(CLI::App& app, JobIdCommand& command) {
  return AddJobIdSubcommand(app, "watch", "follow a job's progress (Ctrl-C stops the watching, not the job)",
                            command);
}

int RunWatchCommand(const JobIdCommand& command, const ClientOptions& client_options) {
  // Before the client's first thread: Ctrl-C stops the watching.
  StopPrivateNodesOnSignal();
  Client client(client_options);
  DetachOnSignal(client_options, command.job_id);
  return WatchToEnd(client, command.job_id);
}

CLI::App* AddCancelCommand(CLI::App& app, JobIdCommand& command) {
  return AddJobIdSubcommand(app, "cancel", "cancel a job", command);
}

int RunCancelCommand(const JobIdCommand& command, const ClientOptions& client_options) {
  Client client(client_options);
  auto j = client.Cancel(command.job_id);
  if (!j.ok()) return ReportFailure(j.status());
  std::cout << FormatJobLine(*j) << "\n";
  return 0;
}

}  // namespace slidedp::client#include "common/jobspec/node_list.h"

