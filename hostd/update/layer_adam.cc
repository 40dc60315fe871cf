// LayerAdam engine, the work: chunks split into per-worker pieces, each piece's AdamW step (any
// moment form, checked or not, speculative undo and redo), completion counted per chunk (records
// recycled: no allocation per chunk in the steady state). The workers themselves (topology,
// pinning, queues, RunOnEachWorker, copy priority): layer_adam_workers.cc.
#include "hostd/update/layer_adam.h"

#include <hwloc.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/update/grad_norm.h"
#include "hostd/update/layer_adam_internal.h"
#include "shm/futex.h"

namespace slidedp::update {
namespace {

// The unit's mirror from element b, or nullptr when the state keeps none (param_source master).
bf16_t* MirrorOf(const UnitMemory& u, int64_t b) { return u.mirror != nullptr ? u.mirror + b : nullptr; }

// Pieces start on multiples of this many elements (a cache line of master/m/v is 16 elements,
// of the mirror 32), so two workers never write the same cache line.
constexpr int64_t kPieceAlignNumel = 64;

// Touches the first byte of every page overlapping [begin, begin + bytes) with an atomic no-op
// RMW: faults the page in (placing it) without changing contents or racing a neighbour piece.
void TouchPages(void* begin, int64_t bytes) {
  if (begin == nullptr || bytes <= 0) return;
  static const int64_t kPage = sysconf(_SC_PAGESIZE);
  auto* p = static_cast<unsigned char*>(begin);
  unsigned char* end = p + bytes;
  __atomic_fetch_or(p, 0, __ATOMIC_RELAXED);
  auto next = (reinterpret_cast<uintptr_t>(p) / kPage + 1) * kPage;
  for (unsigned char* q = reinterpret_cast<unsigned char*>(next); q < end; q += kPage) {
    __atomic_fetch_or(q, 0, __ATOMIC_RELAXED);
  }
}

// Calls fn(begin, numel, decay) for each part of [offset, offset + numel) that lies inside one of
// the unit's tensors, in order, with that tensor's weight decay: the padding between tensors is
// never handed to a kernel (with eps 0 a zero gradient there would make 0/0 = NaN; weight decay
// would scale whatever it holds). fn returns a status; the first error stops the walk.
template <typename Fn>
absl::Status ForEachTensorPart(absl::Span<const ElementRange> tensors, int64_t offset, int64_t numel, Fn&& fn) {
  const int64_t end = offset + numel;
  if (tensors.empty()) return numel > 0 ? fn(offset, numel, WeightDecay::kApply) : absl::OkStatus();
  // The first tensor ending after `offset` (units have a handful of tensors per piece).
  auto it = std::upper_bound(tensors.begin(), tensors.end(), offset,
                             [](int64_t o, const ElementRange& r) { return o < r.end; });
  for (; it != tensors.end() && it->begin < end; ++it) {
    const int64_t b = std::max(offset, it->begin);
    const int64_t e = std::min(end, it->end);
    if (e > b) {
      if (absl::Status s = fn(b, e - b, it->decay); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// Undo copies are made in blocks of this many elements (3 x 32 KiB: the block is still in L2
// when the update reads it).
constexpr int64_t kUndoBlockNumel = 8192;

// A unit's state, or its undo copy, as one view: the master and the moments in either form.
struct StateView {
  float* master;
  MomentForm moments;
  float* m;
  float* v;
  Bf16Moments bf16;
  Int8Moments int8;
};
StateView ViewOf(const UnitMemory& u) { return {u.master, u.moments, u.m, u.v, u.bf16, u.int8}; }
StateView ViewOf(const UndoMemory& d) { return {d.master, d.moments, d.m, d.v, d.bf16, d.int8}; }

// Whether the view's master and every array of its moment form are set.
bool StateSet(const StateView& s) {
  if (s.master == nullptr) return false;
  switch (s.moments) {
    case MomentForm::kF32: return s.m != nullptr && s.v != nullptr;
    case MomentForm::kBF16: return s.bf16.m != nullptr && s.bf16.v != nullptr;
    case MomentForm::kInt8:
      return s.int8.m_codes != nullptr && s.int8.v_codes != nullptr && s.int8.m_scales != nullptr &&
             s.int8.v_scales != nullptr;
  }
  return false;
}

// Elements [b, b + n) of master, m and v from `from` to `to` (both of one moment form; with int8
// moments b is a block boundary and the scales of the blocks the range touches go too). The
// master (and FP32 moments) go through `copy` (streaming stores for a save: it is read back only
// on a rollback), the compact moments through memcpy.
template <typename CopyF32>
void CopyState(const StateView& from, const StateView& to, int64_t b, int64_t n, CopyF32 copy) {
  copy(from.master + b, to.master + b, n);
  switch (from.moments) {
    case MomentForm::kF32:
      copy(from.m + b, to.m + b, n);
      copy(from.v + b, to.v + b, n);
      return;
    case MomentForm::kBF16:
      std::memcpy(to.bf16.m + b, from.bf16.m + b, n * sizeof(bf16_t));
      std::memcpy(to.bf16.v + b, from.bf16.v + b, n * sizeof(bf16_t));
      return;
    case MomentForm::kInt8: {
      std::memcpy(to.int8.m_codes + b, from.int8.m_codes + b, n);
      std::memcpy(to.int8.v_codes + b, from.int8.v_codes + b, n);
      const int64_t k = b / kInt8MomentBlock, blocks = Int8MomentBlocks(n);
      std::memcpy(to.int8.m_scales + k, from.int8.m_scales + k, blocks * sizeof(float));
      std::memcpy(to.int8.v_scales + k, from.int8.v_scales + k, blocks * sizeof(float));
      return;
    }
  }
}
void CopyState(const StateView& from, const StateView& to, int64_t b, int64_t n) {
  CopyState(from, to, b, n, [](const float* src, float* dst, int64_t k) { std::memcpy(dst, src, k * sizeof(float)); });
}

absl::Status NonFiniteGradError(int64_t offset, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  absl::Status s = absl::DataLossError(
      absl::StrCat("LayerAdam: gradient element ", offset, " of the unit is ", value, "; not applied from it on"));
  s.SetPayload(kNonFiniteGradPayload, absl::Cord(absl::StrCat(offset, " ", absl::Hex(bits))));
  return s;
}

float GradValue(float g) { return g; }
float GradValue(bf16_t g) { return Bf16ToFloat(g); }

}  // namespace

absl::Status LayerAdam::SubmitChunk(const UnitMemory& unit, int64_t offset, int64_t numel, const float* grad,
                                    const AdamWStepParams& params, DoneFn done, const UndoMemory* undo, UndoMode mode) {
  return Submit(TaskKind::kStepF32, unit, offset, numel, grad, params, std::move(done), undo, mode);
}

absl::Status LayerAdam::SubmitRestore(const UnitMemory& unit, int64_t offset, int64_t numel, const UndoMemory& undo,
                                      DoneFn done) {
  return Submit(TaskKind::kRestore, unit, offset, numel, nullptr, AdamWStepParams{}, std::move(done), &undo,
                UndoMode::kRedo);
}

absl::Status LayerAdam::SubmitChunkBf16(const UnitMemory& unit, int64_t offset, int64_t numel, const bf16_t* grad,
                                        const AdamWStepParams& params, DoneFn done, const UndoMemory* undo,
                                        UndoMode mode) {
  return Submit(TaskKind::kStepBf16, unit, offset, numel, grad, params, std::move(done), undo, mode);
}

absl::Status LayerAdam::SubmitGradSquared(const UnitMemory& unit, int64_t offset, int64_t numel, GradPtr grad,
                                          const AdamWStepParams& params, double* block_squares, DoneFn done) {
  if (numel > 0 && block_squares == nullptr) return absl::InvalidArgumentError("LayerAdam: null block squares");
  return Submit(grad.bf16 ? TaskKind::kStepBf16 : TaskKind::kStepF32, unit, offset, numel, grad.data, params,
                std::move(done), nullptr, UndoMode::kNone, block_squares);
}

absl::Status LayerAdam::FirstTouch(const UnitMemory& unit) {
  if (unit.numa_node < 0 || unit.numa_node >= num_numa_nodes() || unit.numel < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FirstTouch: bad unit (numel ", unit.numel, ", numa_node ", unit.numa_node, ")"));
  }
  if (num_numa_nodes() > 1) {
    auto topo = static_cast<hwloc_topology_t>(topology_);
    hwloc_obj_t node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, unit.numa_node);
    const int64_t n = unit.numel, blocks = Int8MomentBlocks(unit.numel);
    const bool f32 = unit.moments == MomentForm::kF32, b16 = unit.moments == MomentForm::kBF16;
    const std::pair<void*, int64_t> areas[] = {
        {unit.master, n * 4},
        {f32   ? static_cast<void*>(unit.m)
         : b16 ? static_cast<void*>(unit.bf16.m)
               : unit.int8.m_codes,
         f32   ? n * 4
         : b16 ? n * 2
               : n},
        {f32   ? static_cast<void*>(unit.v)
         : b16 ? static_cast<void*>(unit.bf16.v)
               : unit.int8.v_codes,
         f32   ? n * 4
         : b16 ? n * 2
               : n},
        {unit.moments == MomentForm::kInt8 ? unit.int8.m_scales : nullptr, blocks * 4},
        {unit.moments == MomentForm::kInt8 ? unit.int8.v_scales : nullptr, blocks * 4},
        {unit.mirror, n * 2}};
    for (const auto& [addr, bytes] : areas) {
      if (node == nullptr || addr == nullptr || bytes == 0) continue;
      if (hwloc_set_area_membind(topo, addr, bytes, node->nodeset, HWLOC_MEMBIND_BIND,
                                 HWLOC_MEMBIND_MIGRATE | HWLOC_MEMBIND_BYNODESET) != 0) {
        LOG(WARNING) << "FirstTouch: binding " << bytes << " bytes to NUMA node " << unit.numa_node << " failed (errno "
                     << errno << "); relying on first touch";
      }
    }
  }
  absl::Notification finished;
  absl::Status result;
  absl::Status s = Submit(TaskKind::kTouch, unit, 0, unit.numel, nullptr, AdamWStepParams{}, [&](absl::Status st) {
    result = st;
    finished.Notify();
  });
  if (!s.ok()) return s;
  finished.WaitForNotification();
  return result;
}

absl::Status LayerAdam::Submit(TaskKind kind, const UnitMemory& unit, int64_t offset, int64_t numel, const void* grad,
                               const AdamWStepParams& params, DoneFn done, const UndoMemory* undo, UndoMode undo_mode,
                               double* block_squares) {
  if (offset < 0 || numel < 0 || unit.numel < 0 || offset > unit.numel || numel > unit.numel - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("LayerAdam: chunk [", offset, ", +", numel, ") outside the unit's ", unit.numel, " elements"));
  }
  const bool needs_grad = kind == TaskKind::kStepF32 || kind == TaskKind::kStepBf16;
  if (numel > 0 && (!StateSet(ViewOf(unit)) || (needs_grad && grad == nullptr))) {
    return absl::InvalidArgumentError("LayerAdam: null state or gradient pointer");
  }
  if (undo_mode != UndoMode::kNone) {
    const bool undo_set = undo != nullptr && StateSet(ViewOf(*undo));
    if (!undo_set || kind == TaskKind::kTouch) {
      return absl::InvalidArgumentError("LayerAdam: an undo mode without an undo copy");
    }
    if (undo->moments != unit.moments) {
      return absl::InvalidArgumentError(absl::StrCat("LayerAdam: the undo copy holds ", ToString(undo->moments),
                                                     " moments, the unit keeps ", ToString(unit.moments)));
    }
  }
  if (unit.moments == MomentForm::kInt8 && kind != TaskKind::kTouch &&
      (offset % kInt8MomentBlock != 0 || ((offset + numel) % kInt8MomentBlock != 0 && offset + numel != unit.numel))) {
    return absl::InvalidArgumentError(absl::StrCat("LayerAdam: chunk [", offset, ", +", numel,
                                                   ") splits an int8 moment block (", kInt8MomentBlock,
                                                   " elements): chunks start and end on block boundaries"));
  }
  if (unit.numa_node < 0 || unit.numa_node >= num_numa_nodes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("LayerAdam: numa_node ", unit.numa_node, " not in [0, ", num_numa_nodes(), ")"));
  }
  if (needs_grad && params.step < 1) {
    return absl::InvalidArgumentError(absl::StrCat("LayerAdam: AdamW step must be >= 1, got ", params.step));
  }
  int64_t prev_end = 0;
  for (const ElementRange& r : unit.tensors) {
    if (r.begin < prev_end || r.end < r.begin || r.end > unit.numel) {
      return absl::InvalidArgumentError(absl::StrCat("LayerAdam: tensor range [", r.begin, ", ", r.end,
                                                     ") is not sorted, disjoint and inside the unit's ", unit.numel,
                                                     " elements"));
    }
    prev_end = r.end;
  }
  if (!done) return absl::InvalidArgumentError("LayerAdam: no completion callback");
  {
    absl::MutexLock l(&idle_mu_);
    if (shutting_down_) return absl::FailedPreconditionError("LayerAdam is shutting down");
    ++chunks_in_flight_;
  }

  NodeQueue& q = *nodes_[QueueFor(unit.numa_node)];
  // Split into at most one piece per worker, none below min_piece_numel, boundaries aligned (on
  // the norm grid when the pieces sum squares: each block is one piece's).
  const int64_t max_pieces = std::max<int64_t>(1, numel / min_piece_numel_);
  const int64_t pieces = std::min<int64_t>(q.num_workers, max_pieces);
  const int64_t align = block_squares != nullptr            ? kNormBlockNumel
                        : unit.moments == MomentForm::kInt8 ? kInt8MomentBlock
                                                            : kPieceAlignNumel;
  std::vector<int64_t> bounds{offset};
  for (int64_t k = 1; k < pieces; ++k) {
    int64_t b = (offset + numel * k / pieces) / align * align;
    if (b > bounds.back() && b < offset + numel) bounds.push_back(b);
  }
  bounds.push_back(offset + numel);

  ChunkState* chunk = nullptr;  // in flight until FinishPiece gives it back to chunk_pool_
  {
    absl::MutexLock l(&pool_mu_);
    if (!chunk_pool_.empty()) {
      chunk = chunk_pool_.back().release();
      chunk_pool_.pop_back();
    }
  }
  if (chunk == nullptr) chunk = std::make_unique<ChunkState>().release();
  chunk->done = std::move(done);
  chunk->remaining.store(static_cast<int>(bounds.size() - 1), std::memory_order_relaxed);
  AdamWConstants constants = needs_grad ? MakeAdamWConstants(params) : AdamWConstants{};
  constants.stream_mirror = stream_mirror_;
  const size_t elem_bytes = kind == TaskKind::kStepBf16 ? sizeof(bf16_t) : sizeof(float);
  {
    absl::MutexLock l(&q.mu);
    for (size_t k = 0; k + 1 < bounds.size(); ++k) {
      const void* piece_grad =
          grad == nullptr ? nullptr : static_cast<const char*>(grad) + (bounds[k] - offset) * elem_bytes;
      q.tasks.push_back(Task{kind, unit, bounds[k], bounds[k + 1] - bounds[k], piece_grad, constants,
                             params.nonfinite_grad, chunk, undo != nullptr ? *undo : UndoMemory{}, undo_mode,
                             block_squares, offset / kNormBlockNumel,
                             StochasticRounding{params.rounding_seed, params.step, 0}});
    }
  }
  return absl::OkStatus();
}

template <typename G>
absl::Status LayerAdam::RunStep(const Task& t, const G* grad, BlockPacer& pacer) {
  const UnitMemory& u = t.unit;
  const int64_t o = t.offset;
  const bool refuse = t.nonfinite == NonFiniteGrad::kRefuse;
  const auto kernel = [&](int64_t b, int64_t n, WeightDecay decay, const G* g) {
    return StepPart(t, b, n, decay, g, refuse);
  };
  const auto value = [](G x) -> float {
    if constexpr (std::is_same_v<G, float>) {
      return x;
    } else {
      return Bf16ToFloat(x);
    }
  };
  // Under copy priority a yielding worker runs each tensor part in blocks, pausing between them
  // (BlockPacer); otherwise in one kernel call. The kernels are elementwise, so the split changes
  // no result bit.
  const int64_t plain_block = pacer.active() ? kYieldBlockNumel : std::numeric_limits<int64_t>::max();
  int64_t saved_to = o;  // kSave: the undo copy holds [o, saved_to) of the piece
  absl::Status status = ForEachTensorPart(u.tensors, o, t.numel, [&](int64_t b, int64_t n, WeightDecay decay) {
    const G* g = grad + (b - o);
    // Block by block; with an undo copy the copy brings the block into cache, the update then
    // reads it there.
    const int64_t block = t.undo_mode == UndoMode::kNone ? plain_block : kUndoBlockNumel;
    for (int64_t bb = b; bb < b + n; bb += std::min(block, b + n - bb)) {
      const int64_t nn = std::min(block, b + n - bb);
      pacer.BeforeBlock();
      if (t.undo_mode == UndoMode::kSave) {  // streaming stores: the copy is read back only on a rollback
        CopyState(ViewOf(u), ViewOf(t.undo), bb, nn,
                  [this](const float* src, float* dst, int64_t k) { kernels_->copy_stream(src, dst, k); });
        saved_to = bb + nn;
      } else if (t.undo_mode == UndoMode::kRedo) {
        CopyState(ViewOf(t.undo), ViewOf(u), bb, nn);
      }
      const G* gg = g + (bb - b);
      if (const int64_t bad = kernel(bb, nn, decay, gg); bad >= 0) {
        return NonFiniteGradError(bb + bad, value(gg[bad]));
      }
    }
    return absl::OkStatus();
  });
  if (!status.ok() && t.undo_mode == UndoMode::kSave && saved_to < o + t.numel) {
    // Refused part-way: the rest of the piece is saved too (unchanged), so restoring the whole
    // chunk from the undo copy is exact.
    (void)ForEachTensorPart(u.tensors, saved_to, o + t.numel - saved_to, [&](int64_t b, int64_t n, WeightDecay) {
      CopyState(ViewOf(u), ViewOf(t.undo), b, n);
      return absl::OkStatus();
    });
  }
  return status;
}

template <typename G>
int64_t LayerAdam::StepPart(const Task& t, int64_t b, int64_t n, WeightDecay decay, const G* g, bool checked) const {
  constexpr bool kF32 = std::is_same_v<G, float>;
  const UnitMemory& u = t.unit;
  AdamWConstants c = t.constants;
  // A tensor exempt from decay multiplies by f32(1 - lr*0) = 1: bitwise torch's group with
  // weight_decay 0, which skips the multiply (x * 1 is x for every float).
  if (decay == WeightDecay::kNone) c.decay = 1.0f;
  switch (u.moments) {
    case MomentForm::kF32:
      if constexpr (kF32) {
        if (checked) return kernels_->step_f32_checked(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
        kernels_->step_f32(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
      } else {
        if (checked) return kernels_->step_bf16_checked(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
        kernels_->step_bf16(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
      }
      return -1;
    case MomentForm::kBF16: {
      StochasticRounding r = t.rounding;
      r.first_index = u.first_index + b;
      const Bf16Moments mv{u.bf16.m + b, u.bf16.v + b};
      if constexpr (kF32) {
        if (checked) return state_kernels_->bf16_step_f32_checked(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->bf16_step_f32(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
      } else {
        if (checked) return state_kernels_->bf16_step_bf16_checked(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->bf16_step_bf16(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
      }
      return -1;
    }
    case MomentForm::kInt8: {
      // b is a block boundary: tensors begin on kTensorAlignNumel (256) elements, pieces and
      // blocks of work split on multiples of kInt8MomentBlock.
      const Int8Moments mv = Int8MomentsAt(u.int8, b);
      if constexpr (kF32) {
        if (checked) return state_kernels_->int8_step_f32_checked(c, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->int8_step_f32(c, u.master + b, mv, MirrorOf(u, b), g, n);
      } else {
        if (checked) return state_kernels_->int8_step_bf16_checked(c, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->int8_step_bf16(c, u.master + b, mv, MirrorOf(u, b), g, n);
      }
      return -1;
    }
  }
  return -1;
}

template <typename G>
absl::Status LayerAdam::RunStepSquared(const Task& t, const G* grad, BlockPacer& pacer) {
  const UnitMemory& u = t.unit;
  const int64_t o = t.offset;
  const int64_t end = o + t.numel;
  const bool bf16 = !std::is_same_v<G, float>;
  // Block by block on the norm grid: the block's squares first (bringing it into cache), then its
  // update reads it there. A finite sum means every element is finite (squares formed in double
  // cannot overflow from finite floats), so the unchecked kernels do.
  for (int64_t bb = o; bb < end;) {
    const int64_t be = std::min(end, (bb / kNormBlockNumel + 1) * kNormBlockNumel);
    const G* g = grad + (bb - o);
    pacer.BeforeBlock();
    double& sq = t.squares[bb / kNormBlockNumel - t.squares_first_block];
    NormBlockSquares(bb, be - bb, g, bf16, 0, 1, &sq);
    if (!std::isfinite(sq) && t.nonfinite == NonFiniteGrad::kRefuse) {
      for (int64_t i = 0; i < be - bb; ++i) {
        if (!std::isfinite(GradValue(g[i]))) return NonFiniteGradError(bb + i, GradValue(g[i]));
      }
    }
    RETURN_IF_ERROR(ForEachTensorPart(u.tensors, bb, be - bb, [&](int64_t b, int64_t n, WeightDecay decay) {
      StepPart(t, b, n, decay, grad + (b - o), /*checked=*/false);
      return absl::OkStatus();
    }));
    bb = be;
  }
  return absl::OkStatus();
}

absl::Status LayerAdam::RunTask(const Task& t, BlockPacer& pacer) {
  const UnitMemory& u = t.unit;
  const int64_t o = t.offset;
  auto block_of = [&pacer](int64_t n) { return pacer.active() ? kYieldBlockNumel : std::max<int64_t>(n, 1); };
  switch (t.kind) {
    case TaskKind::kStepF32:
      if (t.squares != nullptr) return RunStepSquared(t, static_cast<const float*>(t.grad), pacer);
      return RunStep(t, static_cast<const float*>(t.grad), pacer);
    case TaskKind::kStepBf16:
      if (t.squares != nullptr) return RunStepSquared(t, static_cast<const bf16_t*>(t.grad), pacer);
      return RunStep(t, static_cast<const bf16_t*>(t.grad), pacer);
    case TaskKind::kRestore:
      return ForEachTensorPart(u.tensors, o, t.numel, [&](int64_t b, int64_t n, WeightDecay) {
        const int64_t block = block_of(n);
        for (int64_t bb = b; bb < b + n; bb += block) {
          const int64_t nn = std::min(block, b + n - bb);
          pacer.BeforeBlock();
          CopyState(ViewOf(t.undo), ViewOf(u), bb, nn);
          if (u.mirror == nullptr) continue;
          for (int64_t i = bb; i < bb + nn; ++i) u.mirror[i] = FloatToBf16(u.master[i]);
        }
        return absl::OkStatus();
      });
    case TaskKind::kTouch:  // (before a job's first step: never paced)
      TouchPages(u.master + o, t.numel * 4);
      switch (u.moments) {
        case MomentForm::kF32:
          TouchPages(u.m + o, t.numel * 4);
          TouchPages(u.v + o, t.numel * 4);
          break;
        case MomentForm::kBF16:
          TouchPages(u.bf16.m + o, t.numel * 2);
          TouchPages(u.bf16.v + o, t.numel * 2);
          break;
        case MomentForm::kInt8:  // (pieces split on blocks)
          TouchPages(u.int8.m_codes + o, t.numel);
          TouchPages(u.int8.v_codes + o, t.numel);
          TouchPages(u.int8.m_scales + o / kInt8MomentBlock, Int8MomentBlocks(t.numel) * 4);
          TouchPages(u.int8.v_scales + o / kInt8MomentBlock, Int8MomentBlocks(t.numel) * 4);
          break;
      }
      if (u.mirror != nullptr) TouchPages(u.mirror + o, t.numel * 2);  // (an undo copy has none)
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

std::optional<NonFiniteGradElement> NonFiniteGradOf(const absl::Status& status) {
  const absl::optional<absl::Cord> payload = status.GetPayload(kNonFiniteGradPayload);
  if (!payload) return std::nullopt;
  const std::string text(*payload);
  const size_t space = text.find(' ');
  NonFiniteGradElement e;
  uint32_t bits = 0;
  if (space == std::string::npos || !absl::SimpleAtoi(text.substr(0, space), &e.offset) ||
      !absl::SimpleHexAtoi(text.substr(space + 1), &bits)) {
    return std::nullopt;
  }
  std::memcpy(&e.value, &bits, 4);
  return e;
}

void LayerAdam::FinishPiece(ChunkState* chunk, const absl::Status& status) {
  if (!status.ok()) {
    absl::MutexLock l(&chunk->mu);
    if (chunk->status.ok()) chunk->status = status;
  }
  if (chunk->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  absl::Status final_status;
  {
    absl::MutexLock l(&chunk->mu);
    final_status = chunk->status;
  }
  chunk->done(final_status);
  chunk->done = nullptr;
  {
    absl::MutexLock l(&chunk->mu);
    chunk->status = absl::OkStatus();
  }
  {
    absl::MutexLock l(&pool_mu_);
    chunk_pool_.emplace_back(chunk);
  }
  absl::MutexLock l(&idle_mu_);
  --chunks_in_flight_;
}

void LayerAdam::WaitIdle() {
  absl::MutexLock l(&idle_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_mu_) { return chunks_in_flight_ == 0; };
  idle_mu_.Await(absl::Condition(&idle));
}

}  // namespace slidedp::update
