// `slidedp run` (run_command.h).
#include "client/cli/run_command.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "client/cli/command_io.h"
#include "client/cli/embedded.h"
#include "common/jobspec/job_spec.h"

namespace slidedp::client {
namespace {

// --policy-cache as the private hostd gets it: the flag, else $XDG_CACHE_HOME/slidedp/policies,
// else ~/.cache/slidedp/policies; "" or "none": the hostd keeps no policies.
std::string PolicyCacheDir(const std::string& flag) {
  if (!flag.empty()) return flag;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  if (xdg != nullptr && xdg[0] == '/') return absl::StrCat(xdg, "/slidedp/policies");
  if (home != nullptr && home[0] == '/') return absl::StrCat(home, "/.cache/slidedp/policies");
  return "";
}

// The private node for `spec` (whose directory is `spec_dir`), checked (CheckEmbeddedOptions);
// run_dir is still the requested one (MakeRunDir makes it).
absl::StatusOr<EmbeddedOptions> PrivateNodeOptions(const RunCommand& c, const JobSpec& spec,
                                                   const std::string& spec_dir) {
  EmbeddedOptions eopt;
  eopt.bin_dir = SelfDir();
  eopt.run_dir = c.run_dir;
  eopt.backend = c.backend != "auto" ? c.backend : ToString(spec.runtime.backend);
  // CPU backend: the spec's worker count, else two workers so the default run is data parallel.
  eopt.cpu_workers = c.cpu_workers > 0          ? c.cpu_workers
                     : spec.runtime.workers > 0 ? spec.runtime.workers
                                                : kDefaultCpuWorkers;
  if (absl::Status checked = CheckEmbeddedOptions(eopt); !checked.ok()) return checked;
  // The private hostd runs as this user, for this user's one job: output.dir keeps meaning what
  // it means to the user (relative: next to the spec, as model.path and data.path; absolute:
  // anywhere the user may write), not a node service's output root.
  eopt.hostd_args = {"--output-root", spec_dir, "--allow-output-anywhere"};
  if (const std::string cache = PolicyCacheDir(c.policy_cache); !cache.empty() && cache != "none") {
    eopt.hostd_args.push_back("--policy-cache");
    eopt.hostd_args.push_back(cache);
  }
  return eopt;
}

// The job on its private node: submits it (resuming `resume_dir` if set), follows it, and on the
// first Ctrl-C / SIGTERM asks hostd to save a checkpoint at the next step boundary and end the job
// there; then says where the checkpoint is and how to resume it, and returns 128 + the signal. A
// second signal stops the node at once (StopAtOnce).
int RunOnPrivateNode(Client& client, const ClientOptions& ropt, const std::string& spec_path,
                     const std::string& resume_dir) {
  auto text = ReadJobSpec(spec_path);
  if (!text.ok()) return ReportFailure(text.status());
  v1::SubmitJobRequest req;
  req.set_spec_yaml(*text);
  req.set_base_dir(JobSpecDir(spec_path));
  req.set_resume_from(resume_dir);
  auto resp = client.Submit(req);
  if (!resp.ok()) return ReportFailure(resp.status());
  const std::string id = resp->job().job_id();
  std::cout << "submitted job " << id << (resume_dir.empty() ? "" : absl::StrCat(", resuming ", resume_dir)) << "\n";
  SetFirstStopSignalAction([ropt, id](int sig) {
    fprintf(stderr, "\nslidedp: %s: stopping at the next step boundary and saving a checkpoint (%s to stop at once)\n",
            strsignal(sig), sig == SIGINT ? "Ctrl-C again" : "a second signal");
    Client c(ropt);
    auto cancelled = c.Cancel(id, CancelCheckpoint::kSave);
    if (!cancelled.ok()) {
      fprintf(stderr, "slidedp: the private hostd did not take the cancel (%s); stopping at once\n",
              std::string(cancelled.status().message()).c_str());
      StopAtOnce(sig);
    }
  });
  auto job = client.Watch(id, std::cout, isatty(1));
  AwaitStopIfStopping();  // a second signal: its stream failing is no news
  if (!job.ok()) return ReportFailure(job.status());
  const int sig = FirstStopSignal();
  if (sig != 0 && job->state() == v1::JOB_STATE_CANCELLED) {
    std::cout << FormatStopReport(*job, spec_path);
    return 128 + sig;
  }
  return ExitCodeForJob(*job);
}

}  // namespace

CLI::App* AddRunCommand(CLI::App& app, RunCommand& command) {
  auto* cmd = app.add_subcommand(
      "run",
      "run one job on a private hostd and workers, then exit. Ctrl-C saves a checkpoint at the next step boundary "
      "and says how to resume (exit 130); Ctrl-C again stops at once");
  AddJobSpecArgument(*cmd, command.spec_path)->required();
  cmd->add_option("--resume", command.resume,
                  "continue from a checkpoint: 'latest' (the newest complete one in the spec's output.dir), a "
                  "checkpoint directory, or a directory of checkpoints (its newest); exactly as if never stopped");
  cmd->add_option("--backend", command.backend, "auto | cuda | cpu")->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  cmd->add_option("--cpu-workers", command.cpu_workers,
                  absl::StrCat("CPU backend workers (default: the spec's runtime.workers, else ", kDefaultCpuWorkers,
                               ")"));
  cmd->add_option("--run-dir", command.run_dir, "where the private socket and logs go");
  cmd->add_option("--policy-cache", command.policy_cache,
                  "where runtime.policy auto keeps the layouts it chose, for the next run of the same shape "
                  "(default $XDG_CACHE_HOME/slidedp/policies or ~/.cache/slidedp/policies; 'none': nowhere)");
  return cmd;
}

int RunRunCommand(const RunCommand& command, const ClientOptions& client_options) {
  auto text = ReadJobSpec(command.spec_path);
  if (!text.ok()) return ReportFailure(text.status());
  const std::string spec_dir = JobSpecDir(command.spec_path);
  auto spec = JobSpec::Parse(*text, spec_dir);
  if (!spec.ok()) return ReportFailure(spec.status());
  // --resume: found here, before any process starts, so that "there is none" is said at once.
  // spec->output.dir is resolved against the spec's directory, as the private hostd's output
  // root (PrivateNodeOptions) resolves it.
  std::string resume_dir;
  if (!command.resume.empty()) {
    auto found = ResolveRunResume(command.resume, spec->output.dir);
    if (!found.ok()) return ReportFailure(found.status());
    resume_dir = *found;
  }
  auto eopt = PrivateNodeOptions(command, *spec, spec_dir);
  if (!eopt.ok()) return ReportFailure(eopt.status());
  // Before the first thread and the first child: SIGINT / SIGTERM stop the private node (once
  // the job runs, the first one ends it at a step boundary with a checkpoint: RunOnPrivateNode).
  StopPrivateNodesOnSignal();
  auto made = MakeRunDir(command.run_dir);  // default: a fresh /tmp/slidedp-run-XXXXXX
  if (!made.ok()) return ReportFailure(made.status());
  eopt->run_dir = *made;
  std::cout << "starting a private hostd and workers (logs in " << eopt->run_dir << ")\n";
  auto embedded = EmbeddedNode::Start(*eopt);
  if (!embedded.ok()) return ReportFailure(embedded.status());
  ClientOptions ropt = client_options;
  ropt.address = (*embedded)->address();
  Client client(ropt);
  const int rc = RunOnPrivateNode(client, ropt, command.spec_path, resume_dir);
  if (rc != 0 && FirstStopSignal() == 0) {
    // A private process that died says more than the closed socket the job's stream reports
    // (exit 3, UNAVAILABLE: give a process whose socket just closed a moment to be reaped).
    const bool unavailable = rc == ExitCodeFor(absl::UnavailableError(""));
    const absl::Duration grace = unavailable ? absl::Seconds(2) : absl::ZeroDuration();
    for (const std::string& line : (*embedded)->Ended(grace)) {
      std::cerr << "slidedp: " << line << " (logs in " << eopt->run_dir << ")\n";
    }
  }
  return rc;
}

}  // namespace slidedp::client
