// UndoArena: the undo copies of speculative clipping (docs/layeradam.md, "exact clipping that
// keeps LayerAdam overlapped with backward").
//
// With clipping (or train.skip_nonfinite) a step's updates need the whole step's gradient norm.
// Instead of waiting for it, hostd updates the units whose gradients are final with grad_scale 1
// while backward still runs, saving the master, m and v each update overwrites here (in the job's
// moment form: 12 bytes per parameter with FP32 moments, 8 with BF16, about 6 with int8; hostd's own
// memory, each unit's copy on its LayerAdam NUMA node). When the norm gives
// c == 1 the speculative updates are the step's; otherwise they are redone from these copies.
//
// The arena covers units [first_unit, num_units): the last units of the forward order, whose
// gradients arrive first in backward (the host is otherwise idle then); the first units, whose
// gradients come last, are updated once the norm is known, while the next forward already runs on
// the speculated units' gates. The budget decides first_unit (FirstSpeculatedUnit).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/model_config.h"
#include "hostd/update/layer_adam.h"

namespace slidedp::hostd {

// Bytes of one unit's undo copy of `numel` elements: the FP32 master and the moments in `moments`'
// form (MomentBytes), each array on whole 4 KiB pages.
uint64_t UnitUndoBytes(int64_t numel, MomentForm moments);
// The smallest unit index k such that units [k, num_units) take at most `budget_bytes` of undo
// copies; num_units when not even the last unit fits.
int FirstSpeculatedUnit(const ModelLayout& layout, uint64_t budget_bytes, MomentForm moments = MomentForm::kF32);
// Bytes of undo copies for units [first_unit, num_units).
uint64_t UndoBytes(const ModelLayout& layout, int first_unit, MomentForm moments = MomentForm::kF32);

class UndoArena {
 public:
  // Maps the copies of units [first_unit, num_units) and has LayerAdam's workers fault them in on
  // each unit's node (`memory`: the units' state, for their NUMA nodes and moment form, which must
  // be one for all units), so the hot path never page-faults. RESOURCE_EXHAUSTED when the mapping
  // fails.
  static absl::StatusOr<std::unique_ptr<UndoArena>> Create(const ModelLayout& layout, int first_unit,
                                                           absl::Span<const update::UnitMemory> memory,
                                                           update::LayerAdam& adam);
  ~UndoArena();
  UndoArena(const UndoArena&) = delete;
  UndoArena& operator=(const UndoArena&) = delete;

  int first_unit() const { return first_unit_; }
  bool covers(int u) const { return u >= first_unit_ && u < static_cast<int>(undo_.size()); }
  // Unit u's copies (element i of the unit at index i); only for covers(u).
  const update::UndoMemory& undo(int u) const { return undo_[u]; }
  uint64_t bytes() const { return bytes_; }

 private:
  UndoArena() = default;
  int first_unit_ = 0;
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<update::UndoMemory> undo_;  // per unit; empty below first_unit
};

}  // namespace slidedp::hostd
