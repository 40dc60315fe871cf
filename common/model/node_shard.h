// How a job over several nodes with runtime.node_state: sharded splits the host state (issue 52,
// docs/multi-node.md). Every hostd and worker computes it the same way.
//
// Unit u of numel elements, N nodes of G ranks each: s = ShardNumel(numel, N * G) (common/model/shard.h),
// node n owns elements [n*G*s, min(numel, (n+1)*G*s)) — contiguous, a multiple of 256 long, every node
// but the last G*s long. Inside its range a node's ranks split as ranks of one node always do
// (ShardOf(node numel, G, r)), so a node's hostd sees an ordinary job of G ranks over the units of its
// NodeLayout: each unit restricted to the node's range, the tensors cut to slices of it (TensorSlot's
// hf_shape / hf_offset_numel), offsets counted from the range's start.
//
// A unit can be kept whole on every node instead (replicated): the embedding when the workers read its
// FP32 rows from the master (runtime.embedding_rows f32), which needs every row on every node, and a
// unit too small to give every node a part (a tied model's head, the final norm alone). Its gradient is
// then summed over the nodes as in a replicated job, and every node updates it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "common/model/shard.h"

namespace slidedp {

struct NodeSharding {
  int nodes = 1;  // 1: not sharded (every unit whole)
  int ranks = 1;  // ranks per node
  int node = 0;   // this node
  // Units every node keeps whole (indexed by unit; shorter: the rest are sharded).
  std::vector<bool> replicated;

  bool sharded() const { return nodes > 1; }
  bool IsReplicated(int unit) const {
    return !sharded() || (unit >= 0 && unit < static_cast<int>(replicated.size()) && replicated[unit]);
  }
  // Unit u's range on node n (the whole unit where it is replicated or nothing is sharded).
  ShardRange RangeOf(int unit, int64_t unit_numel, int node) const;
  ShardRange Range(int unit, int64_t unit_numel) const { return RangeOf(unit, unit_numel, node); }
};

// Whether `sharding` (null: none) cuts `unit` into node ranges.
inline bool SplitsUnit(const NodeSharding* sharding, int unit) {
  return sharding != nullptr && sharding->sharded() && !sharding->IsReplicated(unit);
}

// The norm weights' FP32 side copy (TensorSlot::fp32_offset) within a range of the unit's elements: calls
// fn(side index, unit element, count) for each norm tensor's part inside [range.offset, +numel).
template <typename Fn>
void ForEachSidePart(const UnitLayout& unit, ShardRange range, Fn&& fn) {
  for (const TensorSlot& t : unit.tensors) {
    if (t.fp32_offset < 0) continue;
    const int64_t a = std::max(t.offset_numel, range.offset);
    const int64_t b = std::min(t.offset_numel + t.numel, range.offset + range.numel);
    if (a < b) fn(t.fp32_offset + (a - t.offset_numel), a, b - a);
  }
}

// Node n's range of a unit of `unit_numel` elements over `nodes` nodes of `ranks` ranks (above).
ShardRange NodeRangeOf(int64_t unit_numel, int nodes, int ranks, int node);

// The sharding of a job's host state: which units stay whole. `embedding_rows_f32`: the workers read the
// embedding's FP32 rows from the master (runtime.embedding_rows f32), so the embedding unit is replicated;
// so is every unit with fewer elements than the nodes need for a part each.
NodeSharding MakeNodeSharding(const ModelLayout& layout, int nodes, int ranks, int node, bool embedding_rows_f32);

// The layout of node `sharding.node`'s host state (above): the same units in the same order, each of
// its range's numel; every tensor of the full layout kept, as a slice of its checkpoint tensor cut to
// the range (numel 0 where the range misses it), so a loader or writer given it reads or writes
// exactly the node's elements. Replicated units are copied whole. The FP32 side copies (fp32_offset,
// fp32_numel) and expert blocks are the workers' concern and are cleared in sharded units.
ModelLayout NodeLayout(const ModelLayout& full, const NodeSharding& sharding);

// The elements of host state node `node` keeps (its ranges and the replicated units).
int64_t NodeNumel(const ModelLayout& full, const NodeSharding& sharding, int node);

}  // namespace slidedp
