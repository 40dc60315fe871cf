// `slidedp plot METRICS.jsonl -o curve.png|.svg`: its flags; the drawing is plot.h's.
#pragma once

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "CLI/CLI.hpp"

namespace slidedp::client {

struct PlotCommand {
  std::string metrics_path;
  std::string output_path;  // -o: .png or .svg
};

// Adds `plot` to app (parsing fills `command`).
CLI::App* AddPlotCommand(CLI::App& app, PlotCommand& command);

// Draws the curves (PlotMetricsFile) and says what it wrote on `out`.
absl::Status RunPlotCommand(const PlotCommand& command, std::ostream& out);

}  // namespace slidedp::client
