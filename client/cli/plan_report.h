// `slidedp plan`: the text of hostd's prediction (PlanJobResponse, hostd/engine/step_prediction.h), and
// the prediction against a run's metrics (--compare METRICS.jsonl).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::client {

std::string FormatPlan(const v1::PlanJobResponse& plan);

// `slidedp plan --json FILE`: the prediction as JSON (protobuf's mapping of PlanJobResponse, field
// names as in the proto), written to FILE.tmp and renamed over FILE. Errors name the path.
absl::Status WritePlanJson(const v1::PlanJobResponse& plan, const std::string& path);

// The plan's step and busy times against the medians of a run's metrics (JSONL, one line per
// step as hostd writes them) over its steps from `first_step` (1-based; 4: after AutoPolicy's
// measuring and validating steps, or all steps if the run has fewer). INVALID_ARGUMENT for a file
// that is not such metrics.
absl::StatusOr<std::string> ComparePlan(const v1::PlanJobResponse& plan, const std::string& metrics_jsonl,
                                        int64_t first_step = 4);

}  // namespace slidedp::client
