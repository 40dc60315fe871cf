#include "common/model/node_shard.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace slidedp {

ShardRange NodeRangeOf(int64_t unit_numel, int nodes, int ranks, int node) {
  if (nodes <= 1) return ShardRange{0, unit_numel};
  const int64_t span = ShardNumel(unit_numel, nodes * ranks) * ranks;
  const int64_t begin = std::min(unit_numel, span * node);
  const int64_t end = std::min(unit_numel, span * (node + 1));
  return ShardRange{begin, end - begin};
}

ShardRange NodeSharding::RangeOf(int unit, int64_t unit_numel, int n) const {
  if (IsReplicated(unit)) return ShardRange{0, unit_numel};
  return NodeRangeOf(unit_numel, nodes, ranks, n);
}

NodeSharding MakeNodeSharding(const ModelLayout& layout, int nodes, int ranks, int node, bool embedding_rows_f32) {
  NodeSharding s;
  s.nodes = std::max(1, nodes);
  s.ranks = std::max(1, ranks);
  s.node = node;
  s.replicated.assign(layout.units.size(), false);
  if (embedding_rows_f32 && !layout.units.empty() && layout.units.front().kind == UnitKind::kEmbedding) {
    s.replicated[0] = true;
  }
  // A unit too small to give the last node a part (a tied model's head: the final norm alone) is
  // kept whole everywhere: a few KiB, against a node with nothing to do for it.
  for (const UnitLayout& u : layout.units) {
    if (s.sharded() && NodeRangeOf(u.numel, s.nodes, s.ranks, s.nodes - 1).numel == 0) s.replicated[u.index] = true;
  }
  return s;
}

ModelLayout NodeLayout(const ModelLayout& full, const NodeSharding& sharding) {
  ModelLayout out = full;
  if (!sharding.sharded()) return out;
  out.total_numel = 0;
  for (UnitLayout& u : out.units) {
    const ShardRange range = sharding.Range(u.index, u.numel);
    if (!sharding.IsReplicated(u.index)) {
      const int64_t lo = range.offset, hi = range.offset + range.numel;
      for (TensorSlot& t : u.tensors) {
        const int64_t a = std::clamp(t.offset_numel, lo, hi), b = std::clamp(t.offset_numel + t.numel, lo, hi);
        if (!t.is_slice()) {
          t.hf_shape = t.shape;
          t.hf_offset_numel = 0;
        }
        t.hf_offset_numel += a - t.offset_numel;
        t.shape = {b - a};
        t.offset_numel = a - lo;
        t.numel = b - a;
        t.fp32_offset = -1;
      }
      u.numel = range.numel;
      u.fp32_numel = 0;
      u.experts = ExpertLayout{};
    }
    out.total_numel += u.numel;
  }
  return out;
}

int64_t NodeNumel(const ModelLayout& full, const NodeSharding& sharding, int node) {
  int64_t n = 0;
  for (const UnitLayout& u : full.units) n += sharding.RangeOf(u.index, u.numel, node).numel;
  return n;
}

}  // namespace slidedp
