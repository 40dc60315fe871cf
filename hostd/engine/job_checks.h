// What a job's spec, model, dataset and output directory must be before it runs: the checks
// TrainingExecutor::Validate makes at submit (and `--dry-run`) and again where the job starts, so
// what would fail a job at its start is refused before it is queued (docs/operations.md, "What
// hostd refuses"). Pure functions of the spec and the files, each tested by the executor's tests
// and the integration tests of the refusals.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/data/dataset.h"
#include "common/jobspec/job_spec.h"
#include "common/model/model_config.h"
#include "common/tokenizer/identity.h"
#include "hostd/engine/job_plan.h"
#include "hostd/update/schedule.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::hostd {

// Optimizer steps of a job: train.steps, or train.epochs over the dataset's rows (rounded up).
int64_t StepsOf(const JobSpec& spec, int64_t num_rows);

// The job's learning-rate schedule over `total_steps`; INVALID_ARGUMENT as LrSchedule::Create.
absl::StatusOr<update::LrSchedule> ScheduleOf(const JobSpec& spec, int64_t total_steps);

// A model directory names its weights (model.safetensors, or an index of shards): FAILED_PRECONDITION
// otherwise, with a hint for PyTorch .bin weights.
absl::Status CheckModelWeightsPresent(const std::string& model_dir);

// The model directory's tokenizer identity, to compare with a dataset's record of the one that made
// it; nullopt when there is none to compare with (a preset, no tokenizer.json, the check off).
// FAILED_PRECONDITION when its tokenizer files cannot be read.
absl::StatusOr<std::optional<tok::TokenizerIdentity>> ModelTokenizerOf(const JobSpec& spec);

// The dataset `key` (data.path, data.validation) at `path` was made with the model's tokenizer:
// FAILED_PRECONDITION naming both fingerprints when not; else a note for the job's log when it
// cannot be told (the check off, a dataset without the record, a model without tokenizer.json),
// or "".
absl::StatusOr<std::string> CheckDatasetTokenizer(const JobSpec& spec, absl::string_view key,
                                                  const std::string& path, const data::DatasetReader& dataset,
                                                  const std::optional<tok::TokenizerIdentity>& model);

// output.dir is a directory hostd may create files in, or one it can create below the nearest
// existing ancestor: FAILED_PRECONDITION (PERMISSION_DENIED for access) naming the part that fails.
absl::Status CheckOutputDir(const std::string& dir);

// `slidedp plan`'s and the job log's line on GPU memory: the step's floor and the longest single
// sequence the model fits on the first CUDA worker's device, with what the host has free for
// offloaded layer inputs.
std::string LongestSequenceNote(const JobSpec& spec, const ModelLayout& layout, const RoutePlan& plan,
                                const std::vector<v1::WorkerHello>& hellos);

}  // namespace slidedp::hostd
