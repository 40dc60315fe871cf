// Global gradient norm over chunks, and torch's clip coefficient; see grad_norm.h.
#include "hostd/update/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::update {

int64_t NormBlockCount(int64_t offset, int64_t numel) {
  if (numel <= 0) return 0;
  return (offset + numel - 1) / kNormBlockNumel - offset / kNormBlockNumel + 1;
}

void NormBlockSquares(int64_t offset, int64_t numel, const void* grad, bool bf16, int64_t first, int64_t last,
                      double* sq) {
  const int64_t base = offset / kNormBlockNumel;
  for (int64_t k = first; k < last; ++k) {
    const int64_t b = std::max(offset, (base + k) * kNormBlockNumel);
    const int64_t e = std::min(offset + numel, (base + k + 1) * kNormBlockNumel);
    sq[k] = bf16 ? SumSquaresBf16(static_cast<const bf16_t*>(grad) + (b - offset), e - b)
                 : SumSquares(static_cast<const float*>(grad) + (b - offset), e - b);
  }
}

double SumBlockSquares(const double* sq, int64_t blocks) {
  double total = 0;
  for (int64_t k = 0; k < blocks; ++k) total += sq[k];
  return total;
}

GradNormAccumulator::GradNormAccumulator(std::vector<int64_t> unit_numel)
    : unit_numel_(std::move(unit_numel)), covered_(unit_numel_.size(), 0) {}

absl::Status GradNormAccumulator::AddChunk(int unit, int64_t offset, int64_t numel, const float* grad) {
  if (numel > 0 && grad == nullptr) return absl::InvalidArgumentError("AddChunk: null gradient");
  return AddPartial(unit, offset, numel, SumSquares(grad, numel));
}

absl::Status GradNormAccumulator::AddPartial(int unit, int64_t offset, int64_t numel, double sum_squares) {
  if (unit < 0 || unit >= static_cast<int>(unit_numel_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("grad norm: unit ", unit, " not in [0, ", unit_numel_.size(), ")"));
  }
  if (numel <= 0 || offset < 0 || offset > unit_numel_[unit] || numel > unit_numel_[unit] - offset) {
    return absl::InvalidArgumentError(absl::StrCat("grad norm: chunk [", offset, ", +", numel, ") outside unit ", unit,
                                                   "'s ", unit_numel_[unit], " elements"));
  }
  const int64_t end = offset + numel;
  absl::MutexLock l(&mu_);
  auto next = partials_.lower_bound({unit, offset});
  const bool overlaps_next = next != partials_.end() && next->first.first == unit && next->first.second < end;
  const bool overlaps_prev =
      next != partials_.begin() && std::prev(next)->first.first == unit && std::prev(next)->second.end > offset;
  if (overlaps_next || overlaps_prev) {
    return absl::AlreadyExistsError(
        absl::StrCat("grad norm: chunk [", offset, ", ", end, ") of unit ", unit, " was already counted"));
  }
  partials_.emplace_hint(next, std::make_pair(unit, offset), Partial{end, sum_squares});
  covered_[unit] += numel;
  return absl::OkStatus();
}

bool GradNormAccumulator::complete() const {
  absl::MutexLock l(&mu_);
  for (size_t u = 0; u < unit_numel_.size(); ++u) {
    if (covered_[u] != unit_numel_[u]) return false;
  }
  return true;
}

absl::StatusOr<double> GradNormAccumulator::Norm() const {
  absl::MutexLock l(&mu_);
  for (size_t u = 0; u < unit_numel_.size(); ++u) {
    if (covered_[u] != unit_numel_[u]) {
      return absl::FailedPreconditionError(
          absl::StrCat("grad norm: unit ", u, " has ", covered_[u], " of ", unit_numel_[u], " elements"));
    }
  }
  double total = 0;
  for (const auto& [key, p] : partials_) total += p.sum_squares;  // in (unit, offset) order
  return std::sqrt(total);
}

double GradNormAccumulator::UnitSquares(int unit) const {
  absl::MutexLock l(&mu_);
  double total = 0;
  for (auto it = partials_.lower_bound({unit, 0}); it != partials_.end() && it->first.first == unit; ++it) {
    total += it->second.sum_squares;
  }
  return total;
}

void GradNormAccumulator::Reset() {
  absl::MutexLock l(&mu_);
  partials_.clear();
  std::fill(covered_.begin(), covered_.end(), 0);
}

float ClipCoefficient(double total_norm, double max_norm) {
  if (!(max_norm > 0)) return 1.0f;
  // total_norm is a float32 tensor in PyTorch; `max_norm / (total_norm + 1e-6)` runs in float32
  // with the Python scalars rounded to float; clamp(max=1) keeps NaN.
  const float norm = static_cast<float>(total_norm);
  const float coef = static_cast<float>(max_norm) / (norm + static_cast<float>(1e-6));
  return coef < 1.0f || std::isnan(coef) ? coef : 1.0f;
}

}  // namespace slidedp::update
