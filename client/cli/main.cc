// slidedp: the user's command line. Parses flags (CLI11) and calls client/cli commands.
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_format.h"
#include "CLI/CLI.hpp"
#include "client/cli/client.h"
#include "client/cli/embedded.h"
#include "client/cli/export_model.h"
#include "client/cli/plan_report.h"
#include "client/cli/plot.h"
#include "client/cli/prepare_command.h"
#include "common/io/small_file.h"
#include "common/jobspec/job_spec.h"
#include "common/log/program_logging.h"
#include "common/version.h"

namespace sc = slidedp::client;

namespace {

int Fail(const absl::Status& s) {
  std::cerr << "slidedp: " << absl::StatusCodeToString(s.code()) << ": " << s.message() << "\n";
  return sc::ExitCodeFor(s);
}

// `--json`: the message as protobuf JSON on stdout.
int PrintJson(const google::protobuf::Message& message) {
  auto json = sc::ToJson(message);
  if (!json.ok()) return Fail(json.status());
  std::cout << *json;
  return 0;
}

// A job spec: a regular file of at most kMaxSpecBytes (what hostd parses), refused here with
// that figure rather than by gRPC's message limit.
absl::StatusOr<std::string> ReadFile(const std::string& path) {
  return slidedp::ReadSmallFile(path, slidedp::kMaxSpecBytes, "job spec");
}

// What the CLI's own address flag adds to a command it suggests ("" for the default address).
std::string HostdFlag(const sc::ClientOptions& o) {
  return o.address == sc::ClientOptions().address ? "" : absl::StrCat(" --hostd ", sc::ShellQuote(o.address));
}

// While `submit` or `watch` follows a job, the first Ctrl-C (or SIGTERM) stops the watching, not
// the job: it says so and how to follow or cancel the job, and the CLI exits with 128 + the
// signal (a script sees it was interrupted, not that the job succeeded). A second one meanwhile
// exits at once.
void DetachOnSignal(const sc::ClientOptions& o, const std::string& job_id) {
  const std::string hint =
      job_id.empty() ? std::string("interrupted while submitting: `slidedp jobs` shows whether the job was queued")
                     : absl::StrCat("stopped watching; the job goes on: slidedp", HostdFlag(o), " watch ", job_id,
                                    " follows it, slidedp", HostdFlag(o), " cancel ", job_id, " stops it");
  sc::SetFirstStopSignalAction([hint](int sig) {
    fprintf(stderr, "\nslidedp: %s: %s\n", strsignal(sig), hint.c_str());
    sc::ExitForSignal(sig);
  });
}

int SubmitAndMaybeWatch(sc::Client& client, const sc::ClientOptions& copt, const std::string& spec_path,
                        const std::string& job_id, const std::string& resume, bool dry_run, bool watch) {
  slidedp::v1::SubmitJobRequest req;
  if (spec_path.empty()) {
    // `submit --resume JOB_ID` alone: the interrupted job's own resolved spec.
    auto previous = client.GetJob(resume);
    if (!previous.ok()) {
      return Fail(absl::InvalidArgumentError("give a job spec, or --resume with the id of a job hostd knows"));
    }
    req.set_spec_yaml(previous->resolved_spec_yaml());
  } else {
    auto text = ReadFile(spec_path);
    if (!text.ok()) return Fail(text.status());
    req.set_spec_yaml(*text);
    req.set_base_dir(std::filesystem::absolute(spec_path).parent_path().string());
  }
  req.set_job_id(job_id);
  req.set_dry_run(dry_run);
  req.set_resume_from(sc::ResumeTarget(resume));
  if (watch && !dry_run) DetachOnSignal(copt, "");
  auto resp = client.Submit(req);
  if (!resp.ok()) return Fail(resp.status());
  if (dry_run) {
    std::cout << resp->job().resolved_spec_yaml();
    return 0;
  }
  std::cout << (resp->already_existed() ? "job exists: " : "submitted job ") << resp->job().job_id() << "\n";
  if (!watch) return 0;
  DetachOnSignal(copt, resp->job().job_id());
  auto job = client.Watch(resp->job().job_id(), std::cout, isatty(1));
  if (!job.ok()) return Fail(job.status());
  return sc::ExitCodeForJob(*job);
}

// `slidedp run`'s job on its private node: submits it (resuming `resume_dir` if set), follows it,
// and on the first Ctrl-C / SIGTERM asks hostd to save a checkpoint at the next step boundary and
// end the job there; then says where the checkpoint is and how to resume it, and returns 128 +
// the signal. A second signal stops the node at once (StopAtOnce).
int RunOnPrivateNode(sc::Client& client, const sc::ClientOptions& ropt, const std::string& spec_path,
                     const std::string& resume_dir) {
  auto text = ReadFile(spec_path);
  if (!text.ok()) return Fail(text.status());
  slidedp::v1::SubmitJobRequest req;
  req.set_spec_yaml(*text);
  req.set_base_dir(std::filesystem::absolute(spec_path).parent_path().string());
  req.set_resume_from(resume_dir);
  auto resp = client.Submit(req);
  if (!resp.ok()) return Fail(resp.status());
  const std::string id = resp->job().job_id();
  std::cout << "submitted job " << id << (resume_dir.empty() ? "" : absl::StrCat(", resuming ", resume_dir)) << "\n";
  sc::SetFirstStopSignalAction([ropt, id](int sig) {
    fprintf(stderr, "\nslidedp: %s: stopping at the next step boundary and saving a checkpoint (%s to stop at once)\n",
            strsignal(sig), sig == SIGINT ? "Ctrl-C again" : "a second signal");
    sc::Client c(ropt);
    auto cancelled = c.Cancel(id, sc::CancelCheckpoint::kSave);
    if (!cancelled.ok()) {
      fprintf(stderr, "slidedp: the private hostd did not take the cancel (%s); stopping at once\n",
              std::string(cancelled.status().message()).c_str());
      sc::StopAtOnce(sig);
    }
  });
  auto job = client.Watch(id, std::cout, isatty(1));
  sc::AwaitStopIfStopping();  // a second signal: its stream failing is no news
  if (!job.ok()) return Fail(job.status());
  const int sig = sc::FirstStopSignal();
  if (sig != 0 && job->state() == slidedp::v1::JOB_STATE_CANCELLED) {
    std::cout << sc::FormatStopReport(*job, spec_path);
    return 128 + sig;
  }
  return sc::ExitCodeForJob(*job);
}

}  // namespace

int main(int argc, char** argv) {
  slidedp::InitProgramLogging(argv[0], slidedp::ProgramKind::kCommandLine);
  // Line by line even into a file or a pipe: `slidedp run job.yaml > log` can be followed with
  // tail -f, and what was said before a signal ended the CLI is there.
  setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"slidedp: full-parameter fine-tuning with host-resident state and streamed layers"};
  app.require_subcommand(1);
  app.set_version_flag("--version", [] { return slidedp::VersionReport(); });
  bool verbose = false, quiet = false;
  auto* verbose_flag = app.add_flag("-v,--verbose", verbose, "log everything (info), not only warnings and errors");
  app.add_flag("-q,--quiet", quiet, "log errors only")->excludes(verbose_flag);
  sc::ClientOptions copt;
  if (const char* a = getenv("SLIDEDP_HOSTD")) copt.address = a;
  app.add_option("--hostd", copt.address, "hostd address: unix:PATH or HOST:PORT (env SLIDEDP_HOSTD)");
  app.add_option("--timeout", copt.timeout_s, "seconds per request (at most 1e6)");
  // TCP addresses only (always TLS): what hostd's TCP listener asks of clients.
  copt.credentials = slidedp::auth::ClientCredentialsOptions::FromEnvironment();
  app.add_option("--tls-ca", copt.credentials.tls_ca_file, "TCP: PEM CA of hostd's certificate (env SLIDEDP_TLS_CA)");
  app.add_option("--tls-cert", copt.credentials.tls_cert_file,
                 "TCP: PEM client certificate for mutual TLS (env SLIDEDP_TLS_CERT)");
  app.add_option("--tls-key", copt.credentials.tls_key_file, "TCP: PEM key of --tls-cert (env SLIDEDP_TLS_KEY)");
  app.add_option("--token-file", copt.credentials.token_file,
                 "TCP: file (mode 0600) with the bearer token hostd expects (env SLIDEDP_TOKEN_FILE)");
  app.add_option("--tls-server-name", copt.credentials.tls_server_name,
                 "TCP: name in hostd's certificate, when not the address's host (env SLIDEDP_TLS_SERVER_NAME)");

  auto* health = app.add_subcommand("health", "is hostd serving?");
  auto* node = app.add_subcommand("node", "node information: devices, memory, workers");
  bool json = false;
  constexpr char kJsonHelp[] = "print the record as protobuf JSON (the proto's field names), for scripts";
  auto* workers = app.add_subcommand("workers", "attached workers");
  workers->add_flag("--json", json, kJsonHelp);
  auto* jobs = app.add_subcommand("jobs", "list jobs");
  jobs->add_flag("--json", json, kJsonHelp);

  std::string spec_path, job_id, resume;
  bool dry_run = false, no_watch = false;
  std::string compare;
  auto* plan = app.add_subcommand("plan", "predict a job's step (each resource's work, rate and busy time, the bottleneck)");
  plan->add_option("spec", spec_path, "job spec (YAML)")->required()->check(CLI::ExistingFile);
  plan->add_option("--compare", compare, "a run's metrics (JSONL): predicted against measured");
  std::string plan_json;
  plan->add_option("--json", plan_json, "also write the prediction (PlanJobResponse) as JSON to this file");
  bool measure = false, routes = false;
  plan->add_flag("--measure", measure,
                 "when nothing measured predicts the job: run a short job that measures its shape first "
                 "(AutoPolicy's probes on the real pipeline; it saves nothing), then predict");
  plan->add_flag("--routes", routes,
                 "with --measure: measure every gradient route and parameter delivery the workers can run, each "
                 "by its own job (what runtime.grad_reduction / param_delivery: auto choose from)");

  auto* submit = app.add_subcommand("submit", "submit a job spec");
  submit->add_option("spec", spec_path, "job spec (YAML)")->check(CLI::ExistingFile);
  submit->add_option("--id", job_id, "job id (idempotent resubmission)");
  submit->add_option("--resume", resume, "resume from the last checkpoint of a job id or checkpoint dir");
  submit->add_flag("--dry-run", dry_run, "validate and print the resolved spec");
  submit->add_flag("--detach", no_watch,
                   "do not watch progress (while it watches, Ctrl-C stops the watching, not the job: exit 130)");
  submit->callback([&] {
    if (spec_path.empty() && resume.empty()) throw CLI::ValidationError("submit", "a job spec is required");
  });

  auto* status = app.add_subcommand("status", "show a job");
  status->add_option("job", job_id)->required();
  status->add_flag("--json", json, kJsonHelp);
  auto* watch = app.add_subcommand("watch", "follow a job's progress (Ctrl-C stops the watching, not the job)");
  watch->add_option("job", job_id)->required();
  auto* cancel = app.add_subcommand("cancel", "cancel a job");
  cancel->add_option("job", job_id)->required();

  std::string backend = "auto";
  int cpu_workers = 0;
  std::string run_dir;
  auto* run = app.add_subcommand(
      "run",
      "run one job on a private hostd and workers, then exit. Ctrl-C saves a checkpoint at the next step boundary "
      "and says how to resume (exit 130); Ctrl-C again stops at once");
  run->add_option("spec", spec_path, "job spec (YAML)")->required()->check(CLI::ExistingFile);
  run->add_option("--resume", resume,
                  "continue from a checkpoint: 'latest' (the newest complete one in the spec's output.dir), a "
                  "checkpoint directory, or a directory of checkpoints (its newest); exactly as if never stopped");
  run->add_option("--backend", backend, "auto | cuda | cpu")->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  run->add_option("--cpu-workers", cpu_workers,
                  absl::StrCat("CPU backend workers (default: the spec's runtime.workers, else ",
                               sc::kDefaultCpuWorkers, ")"));
  run->add_option("--run-dir", run_dir, "where the private socket and logs go");
  std::string policy_cache;
  run->add_option("--policy-cache", policy_cache,
                  "where runtime.policy auto keeps the layouts it chose, for the next run of the same shape "
                  "(default $XDG_CACHE_HOME/slidedp/policies or ~/.cache/slidedp/policies; 'none': nowhere)");

  sc::PrepareCommand prepare_command;
  auto* prepare = sc::AddPrepareCommand(app, prepare_command);

  std::string plot_metrics, plot_out;
  auto* plot = app.add_subcommand("plot", "draw a metrics JSONL's loss (and validation loss) and lr curves");
  plot->add_option("metrics", plot_metrics, "a job's metrics-<job>.jsonl")->required();
  plot->add_option("-o,--output", plot_out, "the image: .png or .svg")->required();

  sc::ExportOptions export_options;
  auto* export_cmd = sc::AddExportCommand(app, export_options);

  CLI11_PARSE(app, argc, argv);
  if (absl::Status t = sc::CheckTimeout(copt.timeout_s); !t.ok()) return Fail(t);
  if (verbose || quiet) {
    slidedp::SetLogVerbosity(slidedp::ProgramKind::kCommandLine,
                             verbose ? slidedp::LogVerbosity::kVerbose : slidedp::LogVerbosity::kQuiet);
  }

  if (*plot) {
    absl::Status drawn = sc::PlotMetricsFile(plot_metrics, plot_out);
    if (!drawn.ok()) return Fail(drawn);
    std::cout << "wrote " << plot_out << "\n";
    return 0;
  }

  if (*export_cmd) {
    absl::Status exported = sc::RunExport(export_options, std::cout);
    return exported.ok() ? 0 : Fail(exported);
  }

  if (*prepare) {
    absl::Status prepared = sc::RunPrepareCommand(prepare_command, std::cout, std::cerr);
    return prepared.ok() ? 0 : Fail(prepared);
  }

  if (*run) {
    auto text = ReadFile(spec_path);
    if (!text.ok()) return Fail(text.status());
    std::string base = std::filesystem::absolute(spec_path).parent_path().string();
    auto spec = slidedp::JobSpec::Parse(*text, base);
    if (!spec.ok()) return Fail(spec.status());
    // --resume: found here, before any process starts, so that "there is none" is said at once.
    // spec->output_dir is resolved against the spec's directory, as the private hostd's output
    // root (below) resolves it.
    std::string resume_dir;
    if (!resume.empty()) {
      auto found = sc::ResolveRunResume(resume, spec->output_dir);
      if (!found.ok()) return Fail(found.status());
      resume_dir = *found;
    }
    sc::EmbeddedOptions eopt;
    eopt.bin_dir = sc::SelfDir();
    eopt.run_dir = run_dir;
    eopt.backend = backend != "auto" ? backend : slidedp::ToString(spec->backend);
    // CPU backend: the spec's worker count, else two workers so the default run is data parallel.
    eopt.cpu_workers = cpu_workers > 0 ? cpu_workers : spec->num_workers > 0 ? spec->num_workers : sc::kDefaultCpuWorkers;
    if (absl::Status checked = sc::CheckEmbeddedOptions(eopt); !checked.ok()) return Fail(checked);
    // Before the first thread and the first child: SIGINT / SIGTERM stop the private node (once
    // the job runs, the first one ends it at a step boundary with a checkpoint: RunOnPrivateNode).
    sc::StopPrivateNodesOnSignal();
    auto made = sc::MakeRunDir(run_dir);  // default: a fresh /tmp/slidedp-run-XXXXXX
    if (!made.ok()) return Fail(made.status());
    eopt.run_dir = *made;
    // The private hostd runs as this user, for this user's one job: output.dir keeps meaning what
    // it means to the user (relative: next to the spec, as model.path and data.path; absolute:
    // anywhere the user may write), not a node service's output root.
    eopt.hostd_args = {"--output-root", base, "--allow-output-anywhere"};
    if (policy_cache.empty()) {
      const char* xdg = getenv("XDG_CACHE_HOME");
      const char* home = getenv("HOME");
      if (xdg != nullptr && xdg[0] == '/') {
        policy_cache = absl::StrCat(xdg, "/slidedp/policies");
      } else if (home != nullptr && home[0] == '/') {
        policy_cache = absl::StrCat(home, "/.cache/slidedp/policies");
      }
    }
    if (!policy_cache.empty() && policy_cache != "none") {
      eopt.hostd_args.push_back("--policy-cache");
      eopt.hostd_args.push_back(policy_cache);
    }
    std::cout << "starting a private hostd and workers (logs in " << eopt.run_dir << ")\n";
    auto embedded = sc::EmbeddedNode::Start(eopt);
    if (!embedded.ok()) return Fail(embedded.status());
    sc::ClientOptions ropt = copt;
    ropt.address = (*embedded)->address();
    sc::Client client(ropt);
    int rc = RunOnPrivateNode(client, ropt, spec_path, resume_dir);
    if (rc != 0 && sc::FirstStopSignal() == 0) {
      // A private process that died says more than the closed socket the job's stream reports
      // (exit 3, UNAVAILABLE: give a process whose socket just closed a moment to be reaped).
      const bool unavailable = rc == sc::ExitCodeFor(absl::UnavailableError(""));
      const absl::Duration grace = unavailable ? absl::Seconds(2) : absl::ZeroDuration();
      for (const std::string& line : (*embedded)->Ended(grace)) {
        std::cerr << "slidedp: " << line << " (logs in " << eopt.run_dir << ")\n";
      }
    }
    return rc;
  }

  // Before the client's first thread: while `submit` or `watch` follows a job, Ctrl-C stops the
  // watching (DetachOnSignal).
  if ((*submit && !no_watch && !dry_run) || *watch) sc::StopPrivateNodesOnSignal();
  sc::Client client(copt);
  if (*health) {
    std::string st;
    absl::Status s = client.Health(&st);
    std::cout << (st.empty() ? "UNREACHABLE" : st) << "\n";
    return s.ok() ? 0 : Fail(s);
  }
  if (*node) {
    auto n = client.Node();
    if (!n.ok()) return Fail(n.status());
    std::cout << absl::StrFormat(
        "node %s (%s)%s\n  cpu cores %d on %d NUMA node(s), %d LayerAdam threads\n"
        "  host memory %.1f GiB (%.1f available), /dev/shm free %.1f GiB\n",
        n->node_name(), n->version(), n->draining() ? " DRAINING" : "", n->cpu_cores(), n->numa_nodes(),
        n->update_threads(), n->host_memory_bytes() / 1073741824.0, n->host_memory_available_bytes() / 1073741824.0,
        n->shm_free_bytes() / 1073741824.0);
    for (const auto& w : n->workers()) {
      std::cout << absl::StrFormat("  worker %s pid %d: %s %s %.1f GiB numa %d %s\n", w.worker_id(), w.pid(),
                                   w.device().kind(), w.device().name(), w.device().memory_bytes() / 1073741824.0,
                                   w.device().numa_node(), w.state());
    }
    return 0;
  }
  if (*workers) {
    auto ws = client.Workers();
    if (!ws.ok()) return Fail(ws.status());
    if (json) {
      slidedp::v1::ListWorkersResponse all;
      for (const auto& w : *ws) *all.add_workers() = w;
      return PrintJson(all);
    }
    if (ws->empty()) std::cout << "no workers attached\n";
    for (const auto& w : *ws) {
      std::cout << absl::StrFormat("%-20s pid %-7d %-5s %-24s %s %s\n", w.worker_id(), w.pid(), w.device().kind(),
                                   w.device().name(), w.state(), w.job_id());
    }
    return 0;
  }
  if (*jobs) {
    auto js = client.ListJobs();
    if (!js.ok()) return Fail(js.status());
    if (json) {
      slidedp::v1::ListJobsResponse all;
      for (const auto& j : *js) *all.add_jobs() = j;
      return PrintJson(all);
    }
    std::cout << sc::FormatJobsTable(*js);
    return 0;
  }
  if (*submit) return SubmitAndMaybeWatch(client, copt, spec_path, job_id, resume, dry_run, !no_watch);
  if (*plan) {
    auto text = ReadFile(spec_path);
    if (!text.ok()) return Fail(text.status());
    slidedp::v1::PlanJobRequest req;
    req.set_spec_yaml(*text);
    req.set_base_dir(std::filesystem::absolute(spec_path).parent_path().string());
    if (routes && !measure) return Fail(absl::InvalidArgumentError("plan: --routes goes with --measure"));
    req.set_measure(measure);
    req.set_routes(routes);
    auto p = client.Plan(req);
    if (!p.ok()) return Fail(p.status());
    if (p->measure_job_ids_size() > 0) {
      for (const std::string& id : p->measure_job_ids()) {
        std::cout << "nothing measured predicts this yet: job " << id
                  << " measures it (a few steps on the real pipeline, nothing saved)\n";
        auto job = client.Watch(id, std::cout, isatty(1));
        if (!job.ok()) return Fail(job.status());
        if (const int rc = sc::ExitCodeForJob(*job); rc != 0) return rc;
      }
      req.set_measure(false);
      p = client.Plan(req);
      if (!p.ok()) return Fail(p.status());
    }
    std::cout << sc::FormatPlan(*p);
    if (!plan_json.empty()) {
      if (absl::Status w = sc::WritePlanJson(*p, plan_json); !w.ok()) return Fail(w);
    }
    if (!compare.empty()) {
      auto metrics = slidedp::ReadSmallFile(compare, 256ull << 20, "metrics file");
      if (!metrics.ok()) return Fail(metrics.status());
      auto cmp = sc::ComparePlan(*p, *metrics);
      if (!cmp.ok()) return Fail(cmp.status());
      std::cout << *cmp;
    }
    return 0;
  }
  if (*status) {
    auto j = client.GetJob(job_id);
    if (!j.ok()) return Fail(j.status());
    if (json) return PrintJson(*j);
    std::cout << sc::FormatJobStatus(*j, absl::LocalTimeZone());
    return 0;
  }
  if (*watch) {
    DetachOnSignal(copt, job_id);
    auto j = client.Watch(job_id, std::cout, isatty(1));
    if (!j.ok()) return Fail(j.status());
    return sc::ExitCodeForJob(*j);
  }
  if (*cancel) {
    auto j = client.Cancel(job_id);
    if (!j.ok()) return Fail(j.status());
    std::cout << sc::FormatJobLine(*j) << "\n";
    return 0;
  }
  return 2;
}
