// UndoArena: the undo copies of speculative clipping; see undo_arena.h.
#include "hostd/engine/undo_arena.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"

namespace slidedp::hostd {
namespace {

constexpr uint64_t kPage = 4096;  // each array starts on a page (so first touch places it)

uint64_t PageUp(uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }

// One unit's arrays, in bytes from the copy's start: master, then m and v (and, for int8, their
// scales).
struct UndoLayout {
  uint64_t m = 0, v = 0, m_scales = 0, v_scales = 0, bytes = 0;
};

UndoLayout LayoutOf(int64_t numel, MomentForm moments) {
  const uint64_t n = static_cast<uint64_t>(std::max<int64_t>(numel, 0));
  const uint64_t moment_bytes = moments == MomentForm::kF32 ? n * 4 : moments == MomentForm::kBF16 ? n * 2 : n;
  UndoLayout l;
  l.m = PageUp(n * 4);
  l.v = l.m + PageUp(moment_bytes);
  l.bytes = l.v + PageUp(moment_bytes);
  if (moments == MomentForm::kInt8) {
    const uint64_t scale_bytes = static_cast<uint64_t>(Int8MomentBlocks(numel)) * 4;
    l.m_scales = l.bytes;
    l.v_scales = l.m_scales + PageUp(scale_bytes);
    l.bytes = l.v_scales + PageUp(scale_bytes);
  }
  return l;
}

}  // namespace

uint64_t UnitUndoBytes(int64_t numel, MomentForm moments) { return LayoutOf(numel, moments).bytes; }

int FirstSpeculatedUnit(const ModelLayout& layout, uint64_t budget_bytes, MomentForm moments) {
  uint64_t used = 0;
  int k = layout.num_units();
  while (k > 0) {
    const uint64_t unit = UnitUndoBytes(layout.units[k - 1].numel, moments);
    if (used + unit > budget_bytes) break;
    used += unit;
    --k;
  }
  return k;
}

uint64_t UndoBytes(const ModelLayout& layout, int first_unit, MomentForm moments) {
  uint64_t bytes = 0;
  for (int u = std::max(first_unit, 0); u < layout.num_units(); ++u) {
    bytes += UnitUndoBytes(layout.units[u].numel, moments);
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<UndoArena>> UndoArena::Create(const ModelLayout& layout, int first_unit,
                                                             absl::Span<const update::UnitMemory> memory,
                                                             update::LayerAdam& adam) {
  if (first_unit < 0 || first_unit > layout.num_units() || memory.size() != layout.units.size()) {
    return absl::InvalidArgumentError(absl::StrCat("undo arena: first unit ", first_unit, " of ", layout.num_units()));
  }
  const MomentForm moments = memory.empty() ? MomentForm::kF32 : memory[0].moments;
  for (const update::UnitMemory& m : memory) {
    if (m.moments != moments) return absl::InvalidArgumentError("undo arena: units of different moment forms");
  }
  std::unique_ptr<UndoArena> arena(new UndoArena());
  arena->first_unit_ = first_unit;
  arena->undo_.resize(layout.num_units());
  arena->bytes_ = UndoBytes(layout, first_unit, moments);
  if (arena->bytes_ == 0) return arena;
  void* p = mmap(nullptr, arena->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrFormat("undo arena for speculative clipping: mmap of %.2f GiB: %s",
                                                        arena->bytes_ / double(1ull << 30), std::strerror(errno)));
  }
  arena->base_ = p;
  (void)madvise(p, arena->bytes_, MADV_HUGEPAGE);  // fewer TLB misses; best effort
  char* next = static_cast<char*>(p);
  for (int u = first_unit; u < layout.num_units(); ++u) {
    const UndoLayout l = LayoutOf(layout.units[u].numel, moments);
    update::UndoMemory& undo = arena->undo_[u];
    undo.master = reinterpret_cast<float*>(next);
    undo.moments = moments;
    // Faulted in by the unit's own LayerAdam workers: the pages land on its node.
    update::UnitMemory touch;
    touch.master = undo.master;
    touch.moments = moments;
    switch (moments) {
      case MomentForm::kF32:
        undo.m = reinterpret_cast<float*>(next + l.m);
        undo.v = reinterpret_cast<float*>(next + l.v);
        touch.m = undo.m;
        touch.v = undo.v;
        break;
      case MomentForm::kBF16:
        undo.bf16 = {reinterpret_cast<bf16_t*>(next + l.m), reinterpret_cast<bf16_t*>(next + l.v)};
        touch.bf16 = undo.bf16;
        break;
      case MomentForm::kInt8:
        undo.int8 = {reinterpret_cast<int8_t*>(next + l.m), reinterpret_cast<uint8_t*>(next + l.v),
                     reinterpret_cast<float*>(next + l.m_scales), reinterpret_cast<float*>(next + l.v_scales)};
        touch.int8 = undo.int8;
        break;
    }
    next += l.bytes;
    touch.numel = layout.units[u].numel;
    touch.numa_node = memory[u].numa_node;
    RETURN_IF_ERROR(adam.FirstTouch(touch));
  }
  return arena;
}

UndoArena::~UndoArena() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

}  // namespace slidedp::hostd
