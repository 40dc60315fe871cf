// Who owns what an output directory holds (docs/operations.md, "Output ownership"): a job writes,
// rotates and deletes only its own run's checkpoints, metrics and events. A run is a job and the
// jobs that resume it (a resumed job continues its checkpoint's run_id); two runs never share an
// output directory unless the second asks to move the first's checkpoints aside
// (output.overwrite), and nothing here deletes anything.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "common/jobspec/job_spec.h"

namespace slidedp::hostd {

// Whether the job saves checkpoints (output.save_final or save_every, not train.measure_only):
// only such a job is refused an output directory that holds another run's. One that saves none
// writes only its own metrics and events files there.
bool SavesCheckpoints(const JobSpec& spec);

// The complete checkpoints in output_dir of runs other than `own_run` (every run's when empty),
// newest first. A missing directory (or a path that is no directory: the output.dir checks say
// why) holds none. Bounded and cheap (checkpoint::ListCheckpoints:
// trainer_state.json only), so a gRPC handler may call it.
absl::StatusOr<std::vector<checkpoint::CheckpointEntry>> OtherRunsCheckpoints(const std::string& output_dir,
                                                                              const std::string& own_run);

// FAILED_PRECONDITION naming the runs in `others` (their jobs and newest checkpoints) and the ways
// on: resume, another output.dir, or output.overwrite. OK when `others` is empty.
absl::Status RefuseOtherRuns(const std::string& output_dir, const std::vector<checkpoint::CheckpointEntry>& others);

// output.overwrite: moves `others` aside into output_dir/superseded-<UTC time>-<job_id>/ (renames on
// one file system; nothing is deleted). Returns one line for the job's log.
absl::StatusOr<std::string> MoveOtherRunsAside(const std::string& output_dir,
                                               const std::vector<checkpoint::CheckpointEntry>& others,
                                               const std::string& job_id);

// The run of the checkpoint `resume_from` names (a checkpoint directory, or a directory of
// checkpoints: its newest complete one): its trainer_state.json run_id, else job_id
// (checkpoint::CheckpointRunId; DATA_LOSS when it records neither).
absl::StatusOr<std::string> RunOfCheckpoint(const std::string& resume_from);

// Whether job id `id` has written into output_dir before (its metrics-<id>.jsonl or
// tensorboard/<id>): hostd's ids for new jobs skip such ids, so two jobs never share those files.
bool JobIdUsedIn(const std::string& output_dir, const std::string& id);

}  // namespace slidedp::hostd
