// Deterministic global-batch sampling: which dataset rows step t trains on, on every rank.
//
// The rows of all epochs form one endless sequence: epoch e is a permutation of [0, num_rows)
// seeded by (seed, e), and global position p is row perm_{p / num_rows}[p % num_rows]. Step t
// takes positions [t*B, (t+1)*B) of that sequence (B = global batch in rows), so a batch may
// straddle an epoch boundary. Rank r of R takes the contiguous slice [r*B/R, (r+1)*B/R) of the
// step's rows; the union over ranks is exactly the 1-rank batch, so any R sees the same data.
// The resume position after step t is SamplePosition{epoch, index} of position (t+1)*B; nothing
// else is needed to continue exactly. The permutation uses its own PRNG (splitmix64 +
// Fisher-Yates), never std:: distributions, so it is the same on every platform and build.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace slidedp::data {

enum class Shuffle { kNo, kYes };

struct SamplePosition {
  int64_t epoch = 0;
  int64_t index = 0;  // within the epoch's permutation
  bool operator==(const SamplePosition&) const = default;
};

class GlobalBatchSampler {
 public:
  // INVALID_ARGUMENT unless num_rows > 0, global_batch_rows > 0, world_size > 0 and
  // global_batch_rows % world_size == 0.
  static absl::StatusOr<GlobalBatchSampler> Create(int64_t num_rows, int64_t global_batch_rows, int world_size,
                                                   uint64_t seed, Shuffle shuffle = Shuffle::kYes);

  GlobalBatchSampler(const GlobalBatchSampler& other);
  GlobalBatchSampler& operator=(const GlobalBatchSampler& other);

  int64_t num_rows() const { return num_rows_; }
  int64_t global_batch_rows() const { return global_batch_rows_; }
  int64_t rows_per_rank() const { return global_batch_rows_ / world_size_; }
  int world_size() const { return world_size_; }

  // Position of the first row step `step` reads; the resume point after step t is PositionOfStep(t + 1).
  SamplePosition PositionOfStep(int64_t step) const;
  // The step a saved position resumes at (INVALID_ARGUMENT unless it is a step boundary).
  absl::StatusOr<int64_t> StepOfPosition(const SamplePosition& pos) const;
  int64_t EpochOfStep(int64_t step) const { return PositionOfStep(step).epoch; }

  // Row ids of the whole global batch of `step`, in order.
  std::vector<int64_t> GlobalRows(int64_t step) const;
  // Rank `rank`'s contiguous slice of GlobalRows(step).
  std::vector<int64_t> RankRows(int64_t step, int rank) const;
  // Row at global sequence position p (epoch permutation lookup).
  int64_t RowAt(int64_t epoch, int64_t index) const;

 private:
  GlobalBatchSampler(int64_t num_rows, int64_t global_batch_rows, int world_size, uint64_t seed, Shuffle shuffle)
      : num_rows_(num_rows), global_batch_rows_(global_batch_rows), world_size_(world_size), seed_(seed),
        shuffle_(shuffle) {}
  int64_t num_rows_;
  int64_t global_batch_rows_;
  int world_size_;
  uint64_t seed_;
  Shuffle shuffle_;
  // One cached epoch permutation (steps walk epochs in order, so one is enough).
  mutable absl::Mutex mu_;
  mutable int64_t cached_epoch_ ABSL_GUARDED_BY(mu_) = -1;
  mutable std::vector<int64_t> cached_perm_ ABSL_GUARDED_BY(mu_);
};

// The permutation of [0, n) for (seed, epoch). Exposed for tests and tools.
std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace slidedp::data
