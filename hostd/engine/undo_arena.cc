// UndoArena: the undo copies of speculative clipping; see undo_arena.h.
#include "hostd/engine/undo_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status/status_macros.h"

namespace slidedp::hostd {
namespace {

// Each copy starts on a 4 KiB boundary (whole pages per unit, so first touch places them).
constexpr int64_t kAlignNumel = 1024;

int64_t AlignedNumel(int64_t n) { return (n + kAlignNumel - 1) / kAlignNumel * kAlignNumel; }

}  // namespace

int FirstSpeculatedUnit(const ModelLayout& layout, uint64_t budget_bytes) {
  uint64_t used = 0;
  int k = layout.num_units();
  while (k > 0) {
    const uint64_t unit = static_cast<uint64_t>(AlignedNumel(layout.units[k - 1].numel)) * kUndoBytesPerParam;
    if (used + unit > budget_bytes) break;
    used += unit;
    --k;
  }
  return k;
}

uint64_t UndoBytes(const ModelLayout& layout, int first_unit) {
  uint64_t bytes = 0;
  for (int u = std::max(first_unit, 0); u < layout.num_units(); ++u) {
    bytes += static_cast<uint64_t>(AlignedNumel(layout.units[u].numel)) * kUndoBytesPerParam;
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<UndoArena>> UndoArena::Create(const ModelLayout& layout, int first_unit,
                                                              absl::Span<const update::UnitMemory> memory,
                                                              update::LayerAdam& adam) {
  if (first_unit < 0 || first_unit > layout.num_units() || memory.size() != layout.units.size()) {
    return absl::InvalidArgumentError(absl::StrCat("undo arena: first unit ", first_unit, " of ", layout.num_units()));
  }
  std::unique_ptr<UndoArena> arena(new UndoArena());
  arena->first_unit_ = first_unit;
  arena->undo_.resize(layout.num_units());
  arena->bytes_ = UndoBytes(layout, first_unit);
  if (arena->bytes_ == 0) return arena;
  void* p = mmap(nullptr, arena->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrFormat("undo arena for speculative clipping: mmap of %.2f GiB: %s",
                                                        arena->bytes_ / double(1ull << 30), std::strerror(errno)));
  }
  arena->base_ = p;
  (void)madvise(p, arena->bytes_, MADV_HUGEPAGE);  // fewer TLB misses; best effort
  float* next = static_cast<float*>(p);
  for (int u = first_unit; u < layout.num_units(); ++u) {
    const int64_t n = AlignedNumel(layout.units[u].numel);
    update::UndoMemory& undo = arena->undo_[u];
    undo.master = next;
    undo.m = next + n;
    undo.v = next + 2 * n;
    next += 3 * n;
    // Faulted in by the unit's own LayerAdam workers: the pages land on its node.
    update::UnitMemory touch;
    touch.master = undo.master;
    touch.m = undo.m;
    touch.v = undo.v;
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
