// `slidedp plan` (plan_command.h).
#include "client/cli/plan_command.h"

#include <unistd.h>

#include <iostream>

#include "client/cli/command_io.h"
#include "client/cli/plan_report.h"
#include "client/cli/plot.h"
#include "common/io/small_file.h"

namespace slidedp::client {

CLI::App* AddPlanCommand(CLI::App& app, PlanCommand& command) {
  auto* cmd =
      app.add_subcommand("plan", "predict a job's step (each resource's work, rate and busy time, the bottleneck)");
  AddJobSpecArgument(*cmd, command.spec_path)->required();
  cmd->add_option("--compare", command.compare, "a run's metrics (JSONL): predicted against measured");
  cmd->add_option("--json", command.json_path, "also write the prediction (PlanJobResponse) as JSON to this file");
  cmd->add_flag("--measure", command.measure,
                "when nothing measured predicts the job: run a short job that measures its shape first "
                "(AutoPolicy's probes on the real pipeline; it saves nothing), then predict");
  cmd->add_flag("--routes", command.routes,
                "with --measure: measure every gradient route and parameter delivery the workers can run, each "
                "by its own job (what runtime.grad_reduction / param_delivery: auto choose from)");
  return cmd;
}

int RunPlanCommand(const PlanCommand& command, const ClientOptions& client_options) {
  Client client(client_options);
  auto text = ReadJobSpec(command.spec_path);
  if (!text.ok()) return ReportFailure(text.status());
  v1::PlanJobRequest req;
  req.set_spec_yaml(*text);
  req.set_base_dir(JobSpecDir(command.spec_path));
  if (command.routes && !command.measure) {
    return ReportFailure(absl::InvalidArgumentError("plan: --routes goes with --measure"));
  }
  req.set_measure(command.measure);
  req.set_routes(command.routes);
  auto p = client.Plan(req);
  if (!p.ok()) return ReportFailure(p.status());
  if (p->measure_job_ids_size() > 0) {
    for (const std::string& id : p->measure_job_ids()) {
      std::cout << "nothing measured predicts this yet: job " << id
                << " measures it (a few steps on the real pipeline, nothing saved)\n";
      auto job = client.Watch(id, std::cout, isatty(1));
      if (!job.ok()) return ReportFailure(job.status());
      if (const int rc = ExitCodeForJob(*job); rc != 0) return rc;
    }
    req.set_measure(false);
    p = client.Plan(req);
    if (!p.ok()) return ReportFailure(p.status());
  }
  std::cout << FormatPlan(*p);
  if (!command.json_path.empty()) {
    if (absl::Status w = WritePlanJson(*p, command.json_path); !w.ok()) return ReportFailure(w);
  }
  if (!command.compare.empty()) {
    auto metrics = ReadSmallFile(command.compare, kMaxMetricsFileBytes, "metrics file");
    if (!metrics.ok()) return ReportFailure(metrics.status());
    auto cmp = ComparePlan(*p, *metrics);
    if (!cmp.ok()) return ReportFailure(cmp.status());
    std::cout << *cmp;
  }
  return 0;
}

}  // namespace slidedp::client
