// Validation passes (data.validation, train.eval_every): when a job evaluates and how the split's
// rows are divided, shared by hostd (which adds the ranks' sums) and the workers (which compute
// them). The rows in order make micro-batches of train.micro_batch rows (the last may be
// shorter); rank r of R evaluates micro-batches r, r + R, ...; each micro-batch's loss is computed
// on its own, and hostd adds them in micro-batch order, so the loss is the same for any R.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace slidedp::data {

// Whether a job of `total_steps` evaluates after step `step` (0-based): every eval_every steps
// (0: never in between) and after the last step.
inline bool EvaluatesAfter(int64_t eval_every, int64_t step, int64_t total_steps) {
  return step + 1 == total_steps || (eval_every > 0 && (step + 1) % eval_every == 0);
}

inline int64_t ValidationMicroBatches(int64_t num_rows, int64_t micro_batch) {
  return micro_batch > 0 ? (num_rows + micro_batch - 1) / micro_batch : 0;
}

// The rows of validation micro-batch k.
inline std::vector<int64_t> ValidationRows(int64_t k, int64_t num_rows, int64_t micro_batch) {
  std::vector<int64_t> rows;
  for (int64_t r = k * micro_batch; r < std::min(num_rows, (k + 1) * micro_batch); ++r) rows.push_back(r);
  return rows;
}

// Micro-batch indices of rank `rank` of `world`, in the order its EvalDone lists their sums.
inline std::vector<int64_t> RankValidationMicroBatches(int64_t micro_batches, int rank, int world) {
  std::vector<int64_t> out;
  for (int64_t k = rank; k < micro_batches; k += std::max(world, 1)) out.push_back(k);
  return out;
}

// Sweeps over the units every rank makes for one pass: enough for the rank with the most
// micro-batches, `per_sweep` at a time.
inline int ValidationSweeps(int64_t micro_batches, int world, int per_sweep) {
  const int64_t most = (micro_batches + std::max(world, 1) - 1) / std::max(world, 1);
  return static_cast<int>((most + std::max(per_sweep, 1) - 1) / std::max(per_sweep, 1));
}

}  // namespace slidedp::data
