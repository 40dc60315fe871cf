// slidedp: the user's command line. Registers the global flags and each subcommand's (one
// Add...Command per subcommand, in client/cli/*_command*.h), parses, and runs the one given.
#include <cstdio>
#include <functional>
#include <iostream>

#include "CLI/CLI.hpp"
#include "client/cli/command_io.h"
#include "client/cli/export_model.h"
#include "client/cli/global_flags.h"
#include "client/cli/job_commands.h"
#include "client/cli/node_commands.h"
#include "client/cli/plan_command.h"
#include "client/cli/plot_command.h"
#include "client/cli/prepare_command.h"
#include "client/cli/run_command.h"
#include "common/log/program_logging.h"

namespace sc = slidedp::client;

namespace {

// A registered subcommand and what runs it; returns the process's exit code.
struct Subcommand {
  CLI::App* app;
  std::function<int()> run;
};

}  // namespace

int main(int argc, char** argv) {
  slidedp::InitProgramLogging(argv[0], slidedp::ProgramKind::kCommandLine);
  // Line by line even into a file or a pipe: `slidedp run job.yaml > log` can be followed with
  // tail -f, and what was said before a signal ended the CLI is there.
  setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"slidedp: full-parameter fine-tuning with host-resident state and streamed layers"};
  app.require_subcommand(1);
  sc::GlobalFlags global;
  sc::AddGlobalFlags(app, global);
  const sc::ClientOptions& client = global.client;  // read when a command runs, after parsing

  // What parsing fills, one per subcommand.
  sc::WorkersCommand workers;
  sc::JobsCommand jobs;
  sc::PlanCommand plan;
  sc::SubmitCommand submit;
  sc::JobIdCommand status, watch, cancel;
  sc::RunCommand run;
  sc::PrepareCommand prepare;
  sc::PlotCommand plot;
  sc::ExportOptions export_options;
  // A braced list is evaluated in order: the subcommands are registered, and listed by --help,
  // in this order.
  const Subcommand subcommands[] = {
      {sc::AddHealthCommand(app), [&] { return sc::RunHealthCommand(client); }},
      {sc::AddNodeCommand(app), [&] { return sc::RunNodeCommand(client); }},
      {sc::AddWorkersCommand(app, workers), [&] { return sc::RunWorkersCommand(workers, client); }},
      {sc::AddJobsCommand(app, jobs), [&] { return sc::RunJobsCommand(jobs, client); }},
      {sc::AddPlanCommand(app, plan), [&] { return sc::RunPlanCommand(plan, client); }},
      {sc::AddSubmitCommand(app, submit), [&] { return sc::RunSubmitCommand(submit, client); }},
      {sc::AddStatusCommand(app, status), [&] { return sc::RunStatusCommand(status, client); }},
      {sc::AddWatchCommand(app, watch), [&] { return sc::RunWatchCommand(watch, client); }},
      {sc::AddCancelCommand(app, cancel), [&] { return sc::RunCancelCommand(cancel, client); }},
      {sc::AddRunCommand(app, run), [&] { return sc::RunRunCommand(run, client); }},
      {sc::AddPrepareCommand(app, prepare),
       [&] { return sc::ReportResult(sc::RunPrepareCommand(prepare, std::cout, std::cerr)); }},
      {sc::AddPlotCommand(app, plot), [&] { return sc::ReportResult(sc::RunPlotCommand(plot, std::cout)); }},
      {sc::AddExportCommand(app, export_options),
       [&] { return sc::ReportResult(sc::RunExport(export_options, std::cout)); }},
  };

  CLI11_PARSE(app, argc, argv);
  if (absl::Status applied = sc::ApplyGlobalFlags(global); !applied.ok()) return sc::ReportFailure(applied);
  for (const Subcommand& s : subcommands) {
    if (*s.app) return s.run();
  }
  return 2;  // unreachable: require_subcommand(1)
}
