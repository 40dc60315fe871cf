// `slidedp plot METRICS.jsonl -o curve.png|.svg`: a quick look at a job's curves without
// TensorBoard. The loss (and the validation loss, `eval_loss`, where records carry one) on the
// upper panel, the learning rate on the lower one, against the step; drawn with cairo, which
// writes both PNG and SVG.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp::client {

// What `slidedp plot` reads of a metrics file at most (as `slidedp plan --compare` does).
inline constexpr uint64_t kMaxMetricsFileBytes = 256ull << 20;

using Curve = std::vector<std::pair<int64_t, double>>;  // (step, value), by step

struct MetricsCurves {
  Curve loss;
  Curve eval_loss;  // empty when no record carries one
  Curve lr;
};

// The curves of a metrics JSONL (docs/operations.md): each line's `step` with its `loss`,
// `eval_loss` and `lr` where they are finite numbers (a non-finite loss is written as null). A
// step logged twice (a job resumed from an earlier checkpoint runs steps again) keeps its last
// record. A final line without its newline (a running job's file) is left out; any other line
// that is not a JSON object with a numeric `step` is INVALID_ARGUMENT naming the line. No
// finite loss at all: INVALID_ARGUMENT.
absl::StatusOr<MetricsCurves> ParseMetricsJsonl(absl::string_view text);

enum class ImageFormat { kPng, kSvg };

// By the file's extension, `.png` or `.svg` (any case); INVALID_ARGUMENT otherwise.
absl::StatusOr<ImageFormat> ImageFormatOf(const std::string& path);

struct PlotSize {
  int width_px = 960;
  int height_px = 600;
};

// Draws `curves` into `out_path`, making its directory (and parents) when missing; `title` heads
// the image. A path that cannot be made or written is PERMISSION_DENIED (not allowed),
// RESOURCE_EXHAUSTED (no room) or FAILED_PRECONDITION (a file in the way, a read-only file
// system, ...) naming it, and leaves no partial image; INTERNAL with cairo's reason otherwise.
absl::Status DrawCurves(const MetricsCurves& curves, const std::string& title, const std::string& out_path,
                        ImageFormat format, PlotSize size = {});

// The command: reads `metrics_path` (a regular file, at most kMaxMetricsFileBytes), parses it
// and draws it into `out_path`, whose extension picks the format (checked first).
absl::Status PlotMetricsFile(const std::string& metrics_path, const std::string& out_path);

}  // namespace slidedp::client
