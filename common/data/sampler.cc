// GlobalBatchSampler: (seed, step) -> rows, identical on every rank and every run.
#include "common/data/sampler.h"

#include <numeric>

#include "absl/strings/str_cat.h"

namespace slidedp::data {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Unbiased integer in [0, bound) by rejection (Lemire's method without the multiply trick, kept simple).
uint64_t Below(uint64_t& state, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x;
  do {
    x = SplitMix64(state);
  } while (x >= limit);
  return x % bound;
}

}  // namespace

std::vector<int64_t> EpochPermutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  uint64_t state = seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(epoch + 1));
  SplitMix64(state);
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(Below(state, static_cast<uint64_t>(i + 1)));
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

absl::StatusOr<GlobalBatchSampler> GlobalBatchSampler::Create(int64_t num_rows, int64_t global_batch_rows,
                                                              int world_size, uint64_t seed, Shuffle shuffle) {
  if (num_rows <= 0) return absl::InvalidArgumentError("sampler: the dataset has no rows");
  if (global_batch_rows <= 0 || world_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("sampler: global batch ", global_batch_rows, " rows and world size ",
                                                   world_size, " must be positive"));
  }
  if (global_batch_rows % world_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("sampler: global batch of ", global_batch_rows,
                                                   " rows does not divide over ", world_size, " ranks"));
  }
  return GlobalBatchSampler(num_rows, global_batch_rows, world_size, seed, shuffle);
}

GlobalBatchSampler::GlobalBatchSampler(const GlobalBatchSampler& o)
    : num_rows_(o.num_rows_), global_batch_rows_(o.global_batch_rows_), world_size_(o.world_size_), seed_(o.seed_),
      shuffle_(o.shuffle_) {}

GlobalBatchSampler& GlobalBatchSampler::operator=(const GlobalBatchSampler& o) {
  if (this == &o) return *this;
  num_rows_ = o.num_rows_;
  global_batch_rows_ = o.global_batch_rows_;
  world_size_ = o.world_size_;
  seed_ = o.seed_;
  shuffle_ = o.shuffle_;
  absl::MutexLock lock(&mu_);
  cached_epoch_ = -1;
  cached_perm_.clear();
  return *this;
}

SamplePosition GlobalBatchSampler::PositionOfStep(int64_t step) const {
  const int64_t p = step * global_batch_rows_;
  return {p / num_rows_, p % num_rows_};
}

absl::StatusOr<int64_t> GlobalBatchSampler::StepOfPosition(const SamplePosition& pos) const {
  if (pos.epoch < 0 || pos.index < 0 || pos.index >= num_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("sample position (epoch ", pos.epoch, ", index ", pos.index,
                                                   ") is outside a dataset of ", num_rows_, " rows"));
  }
  const int64_t p = pos.epoch * num_rows_ + pos.index;
  if (p % global_batch_rows_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat("sample position (epoch ", pos.epoch, ", index ", pos.index,
                                                   ") is not at a step boundary of ", global_batch_rows_,
                                                   " rows: was the global batch size changed?"));
  }
  return p / global_batch_rows_;
}

int64_t GlobalBatchSampler::RowAt(int64_t epoch, int64_t index) const {
  if (shuffle_ == Shuffle::kNo) return index;
  absl::MutexLock lock(&mu_);
  if (cached_epoch_ != epoch) {
    cached_perm_ = EpochPermutation(num_rows_, seed_, epoch);
    cached_epoch_ = epoch;
  }
  return cached_perm_[index];
}

std::vector<int64_t> GlobalBatchSampler::GlobalRows(int64_t step) const {
  std::vector<int64_t> rows;
  rows.reserve(global_batch_rows_);
  const int64_t p0 = step * global_batch_rows_;
  for (int64_t p = p0; p < p0 + global_batch_rows_; ++p) rows.push_back(RowAt(p / num_rows_, p % num_rows_));
  return rows;
}

std::vector<int64_t> GlobalBatchSampler::RankRows(int64_t step, int rank) const {
  const int64_t per = rows_per_rank();
  std::vector<int64_t> rows;
  rows.reserve(per);
  const int64_t p0 = step * global_batch_rows_ + rank * per;
  for (int64_t p = p0; p < p0 + per; ++p) rows.push_back(RowAt(p / num_rows_, p % num_rows_));
  return rows;
}

}  // namespace slidedp::data
