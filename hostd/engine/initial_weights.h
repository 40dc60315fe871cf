// The job's state before its first step: resumed from a checkpoint (master, m and v, converted to
// the segment's moment layout when the checkpoint keeps another), loaded from the HF model, or
// seeded HF-style random init; the BF16 mirror written from the master; every unit's version gate
// published at the first step.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/jobspec/job_spec.h"
#include "common/model/model_config.h"
#include "common/model/node_shard.h"
#include "checkpoint/checkpoint.h"
#include "hostd/core/host_core.h"
#include "hostd/update/adamw_state.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

// The checkpoint code's view of the state segment's arrays: master and the moments in the
// segment's layout (moment_form, every unit's m, v and int8 scales).
checkpoint::StateArrays StateArraysOf(shm::JobState& js);

// Zeroes every unit's m, v and (int8) scales in pieces over `threads`: zero moments in each layout.
void ZeroMoments(const ModelLayout& layout, shm::JobState& js, int threads);

struct InitialState {
  int64_t first_step = 0;     // 0, or the resumed checkpoint's step
  int64_t skipped_steps = 0;  // of those, skipped as non-finite (trainer_state "skipped_steps")
  // The model's untrained tensors (a qwen3_5 vision tower, mtp.*), from the checkpoint resumed or
  // the HF model loaded, for every checkpoint the job saves (checkpoint::PassThrough).
  checkpoint::PassThrough pass_through;
};

// Writes the initial state and says where the job starts. `reused_segment`: a pooled segment,
// whose moments must be zeroed (a fresh one is zero). `threads`: for the bulk work (zeroing,
// loading and converting a checkpoint). Logs what it did to the job log, and the conversion when
// the resumed checkpoint keeps its moments in another state dtype than the segment. A weight (or
// Adam moment) that is not finite in the HF model or checkpoint is DATA_LOSS naming the file,
// tensor and element (the loaders check each piece as they write it). On any error the segment
// holds a partial state: the caller fails the job.
// A sharded state (runtime.node_state sharded): `layout` is this node's (NodeLayout of model_layout), and
// each unit's ranges are read from the checkpoint or drawn by the random init exactly as the whole
// model's would be. Otherwise model_layout is `layout`.
absl::StatusOr<InitialState> WriteInitialState(JobContext& ctx, const JobSpec& spec, const ModelLayout& layout,
                                               shm::JobState& js, bool reused_segment, int threads,
                                               const ModelLayout& model_layout, const NodeSharding& sharding);

}  // namespace slidedp::hostd
