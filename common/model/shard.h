// How a unit's flat parameter/gradient array is split across the ranks of a job, for the GPU
// gradient route (reduce-scatter: rank r ends up with the summed shard r) and sharded parameter
// delivery (rank r copies shard r host-to-device, then all-gather). Every rank and hostd compute
// it the same way.
//
// Shards are equal, ceil(numel / world) rounded up to kShardAlignNumel elements, so the padded
// array (world * shard_numel elements) is what collectives operate on in place; the last shards
// may extend past numel (their tail is padding, never posted) or be empty.
#pragma once

#include <algorithm>
#include <cstdint>

namespace slidedp {

// 1 KiB of FP32, 512 B of BF16; and a whole int8 moment block (kInt8MomentBlock), so no
// block of compact Adam state is split between two ranks' shards.
inline constexpr int64_t kShardAlignNumel = 256;

struct ShardRange {
  int64_t offset = 0;  // first element of the shard inside the unit
  int64_t numel = 0;   // elements of the shard inside [0, unit numel); may be 0
};

inline int64_t ShardNumel(int64_t unit_numel, int world) {
  const int64_t per = (unit_numel + world - 1) / world;
  return (per + kShardAlignNumel - 1) / kShardAlignNumel * kShardAlignNumel;
}

// world * ShardNumel: the padded length collectives use.
inline int64_t PaddedNumel(int64_t unit_numel, int world) { return ShardNumel(unit_numel, world) * world; }

inline ShardRange ShardOf(int64_t unit_numel, int world, int rank) {
  const int64_t per = ShardNumel(unit_numel, world);
  const int64_t begin = std::min(unit_numel, per * rank);
  const int64_t end = std::min(unit_numel, per * (rank + 1));
  return ShardRange{begin, end - begin};
}

}  // namespace slidedp
