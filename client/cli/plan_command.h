// `slidedp plan SPEC`: hostd's prediction of a job's step (each resource's work, rate and busy
// time, the bottleneck; plan_report.h prints it), optionally after measuring the job's shape with
// short jobs (--measure, --routes), written as JSON (--json FILE) and held against a run's
// metrics (--compare METRICS.jsonl).
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "client/cli/client.h"

namespace slidedp::client {

struct PlanCommand {
  std::string spec_path;
  std::string compare;    // --compare: a run's metrics JSONL
  std::string json_path;  // --json: where the PlanJobResponse goes as JSON
  bool measure = false;   // --measure: run a short measuring job when nothing measured predicts it
  bool routes = false;    // --routes (with --measure): measure every gradient route and delivery
};

// Adds `plan` to app (parsing fills `command`).
CLI::App* AddPlanCommand(CLI::App& app, PlanCommand& command);

// Prints the prediction (after following the measuring jobs, if hostd started any: a failed one's
// exit code ends it), then writes --json and prints --compare's table.
int RunPlanCommand(const PlanCommand& command, const ClientOptions& client);

}  // namespace slidedp::client
