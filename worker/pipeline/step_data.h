// A job's data on one rank: the training dataset read through its global-batch sampler (each
// step's micro-batches and the trained tokens of the whole global batch, which scale the loss), the
// rank's share of the validation split, and with context parallelism each micro-batch's share of
// tokens. hostd verified the files at job start (checksums, token ids, the loss mask) and sends
// their identities: the same files are read here, or DATA_LOSS names the one that changed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "common/data/sampler.h"

namespace slidedp {

// Context parallelism (runtime.context_parallel): the data-parallel rank and world of a rank (its
// group reads the same rows), its place in the group, and its share of a micro-batch.
struct ContextPlace {
  int ranks = 1, rank = 0, dp_rank = 0, dp_world = 1;
  static ContextPlace Of(int rank, int world, int context_parallel);
  absl::StatusOr<MicroBatch> Share(MicroBatch mb) const;
};

// One step's input on this rank.
struct StepBatch {
  std::vector<MicroBatch> micro_batches;
  int64_t trained_tokens = 0;  // labels trained in the whole global batch, every rank's rows
  float loss_scale = 0;        // 1 / trained_tokens; 0 without any
};

class StepData {
 public:
  // `files`: the dataset's .bin files as hostd verified them (empty: no comparison, and the
  // files' contents are not scanned either way: hostd did).
  static absl::StatusOr<std::unique_ptr<StepData>> Open(const std::string& path,
                                                        const std::vector<data::FileIdentity>& files,
                                                        int64_t global_batch, int64_t micro_batch, uint64_t seed,
                                                        ContextPlace place);
  // Step `step`'s (0-based) micro-batches of micro_batch rows. Errors name the step (1-based).
  absl::StatusOr<StepBatch> Batch(int64_t step) const;

 private:
  StepData(std::unique_ptr<data::DatasetReader> dataset, data::GlobalBatchSampler sampler, int64_t micro_batch,
           ContextPlace place)
      : dataset_(std::move(dataset)), sampler_(std::move(sampler)), micro_batch_(micro_batch), place_(place) {}

  std::unique_ptr<data::DatasetReader> dataset_;
  data::GlobalBatchSampler sampler_;
  int64_t micro_batch_;
  ContextPlace place_;
};

// This rank's share of the validation split (common/data/validation.h); no micro-batches when the
// job has no validation (an empty path).
struct ValidationShare {
  int64_t micro_batches_total = 0;  // over every rank
  std::vector<MicroBatch> micro_batches;
  int per_sweep = 1;
  int sweeps = 0;
};
absl::StatusOr<ValidationShare> OpenValidation(const std::string& path, const std::vector<data::FileIdentity>& files,
                                               int64_t global_batch, int64_t micro_batch, ContextPlace place);

}  // namespace slidedp
