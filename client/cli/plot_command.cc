// `slidedp plot` (plot_command.h).
#include "client/cli/plot_command.h"

#include "client/cli/plot.h"
#include "common/status/status_macros.h"

namespace slidedp::client {

CLI::App* AddPlotCommand(CLI::App& app, PlotCommand& command) {
  auto* cmd = app.add_subcommand("plot", "draw a metrics JSONL's loss (and validation loss) and lr curves");
  cmd->add_option("metrics", command.metrics_path, "a job's metrics-<job>.jsonl")->required();
  cmd->add_option("-o,--output", command.output_path, "the image: .png or .svg")->required();
  return cmd;
}

absl::Status RunPlotCommand(const PlotCommand& command, std::ostream& out) {
  RETURN_IF_ERROR(PlotMetricsFile(command.metrics_path, command.output_path));
  out << "wrote " << command.output_path << "\n";
  return absl::OkStatus();
}

}  // namespace slidedp::client
