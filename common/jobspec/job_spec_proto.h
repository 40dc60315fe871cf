// The job config as it travels from hostd to the workers (v1::JobConfig in an Assignment): the
// spec hostd parsed, validated and resolved, section for section. hostd writes it with
// JobConfigOf; a worker reads it back with JobSpecOf instead of parsing any text, so the two hold
// the same settings by construction (the round trip is the identity, tested field by field), with
// one exception: a runtime.layer_policy's AutoPolicy measurements (LayerLayout::autopolicy) stay
// on hostd.
#pragma once

#include "absl/status/statusor.h"
#include "common/jobspec/job_spec.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp {

v1::JobConfig JobConfigOf(const JobSpec& spec);

// INVALID_ARGUMENT naming the field for an enum value that is unset or unknown (a hostd of
// another version), or a section that is missing. The values were validated by the hostd that
// sent them: nothing else is checked again.
absl::StatusOr<JobSpec> JobSpecOf(const v1::JobConfig& config);

}  // namespace slidedp
