// Exact global gradient-norm clipping for a step whose gradient arrives in chunks.
//
// GradNormAccumulator sums squares chunk by chunk (any thread, any order), refuses a chunk that
// overlaps one already counted (every element exactly once), and returns the norm only when every
// unit is covered. The partial sums are added in (unit, offset) order, so the norm does not depend
// on arrival order or thread timing.
//
// ClipCoefficient follows torch.nn.utils.clip_grad_norm_ (error_if_nonfinite=False): in float32,
// coef = min(1, max_norm / (norm + 1e-6)). A NaN norm gives NaN and an infinite norm gives 0, as
// in PyTorch (the update then writes NaN where the gradient was non-finite); callers that want to
// skip such steps check std::isfinite(norm) themselves.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/numeric/bf16.h"

namespace slidedp::update {

// The norm grid: every host path sums a chunk [offset, offset + numel) of a unit's gradient in
// the blocks where it meets a grid of kNormBlockNumel elements aligned at the unit's element 0
// (each block with SumSquares / SumSquaresBf16, the active ISA's), then adds the blocks' sums in
// order into the chunk's partial. A pass of its own (GradConsumer) and one fused into LayerAdam's
// update (LayerAdam::SubmitGradSquared) thus give the same bits for the same chunk, whatever the
// threads. A block of FP32 gradient is 32 KiB: still in L1/L2 when the update reads it.
inline constexpr int64_t kNormBlockNumel = 8192;
// Blocks of the chunk [offset, offset + numel) on the grid (0 for numel <= 0).
int64_t NormBlockCount(int64_t offset, int64_t numel);
// sq[k] = the sum of squares of the chunk's block k, for k in [first, last) (`grad` is the
// chunk's element 0, read as FP32 or BF16 per `bf16`).
void NormBlockSquares(int64_t offset, int64_t numel, const void* grad, bool bf16, int64_t first, int64_t last,
                      double* sq);
// The chunk's partial: sq[0] + sq[1] + ... in order.
double SumBlockSquares(const double* sq, int64_t blocks);

class GradNormAccumulator {
 public:
  explicit GradNormAccumulator(std::vector<int64_t> unit_numel);

  // Adds the squares of grad[0..numel) as elements [offset, offset + numel) of `unit`.
  // INVALID_ARGUMENT: bad unit or range; ALREADY_EXISTS: overlaps a chunk already added.
  absl::Status AddChunk(int unit, int64_t offset, int64_t numel, const float* grad);
  // For a sum computed elsewhere (e.g. on the GPU).
  absl::Status AddPartial(int unit, int64_t offset, int64_t numel, double sum_squares);

  bool complete() const;
  // sqrt of the total; FAILED_PRECONDITION naming the first uncovered unit until complete().
  absl::StatusOr<double> Norm() const;
  // The sum of squares of `unit`'s chunks added so far (in offset order).
  double UnitSquares(int unit) const;
  // Forgets every chunk (next step).
  void Reset();

 private:
  struct Partial {
    int64_t end;
    double sum_squares;
  };
  std::vector<int64_t> unit_numel_;
  mutable absl::Mutex mu_;
  // Keyed by (unit, begin). A tree: chunks arrive in backward order (thousands per step of a
  // large model), and a sorted vector would move all of them on every insert at its front.
  absl::btree_map<std::pair<int, int64_t>, Partial> partials_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> covered_ ABSL_GUARDED_BY(mu_);  // elements counted per unit
};

// torch.nn.utils.clip_grad_norm_'s clamped coefficient, computed in float32 as PyTorch does.
// max_norm <= 0 means clipping is off: returns 1.
float ClipCoefficient(double total_norm, double max_norm);

}  // namespace slidedp::update
