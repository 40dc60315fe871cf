#include "common/model/node_shard.h"

#include <map>

#include "gtest/gtest.h"

namespace slidedp {
namespace {

TEST(NodeShard, RangesPartitionEveryUnitInNodeOrder) {
  for (int64_t numel : {256LL, 4096LL, 256LL * 1001, 1LL << 22, 256LL * 77777}) {
    for (int nodes : {2, 3, 8}) {
      for (int ranks : {1, 2, 3}) {
        int64_t next = 0;
        for (int n = 0; n < nodes; ++n) {
          const ShardRange r = NodeRangeOf(numel, nodes, ranks, n);
          EXPECT_EQ(r.offset, next) << numel << " " << nodes << "x" << ranks;
          EXPECT_EQ(r.offset % kShardAlignNumel, 0);
          next = r.offset + r.numel;
          if (n + 1 < nodes && next < numel) {
            // A full node: its ranks' shards are the global shards n*G + g of one node of N*G ranks.
            const int64_t s = ShardNumel(numel, nodes * ranks);
            EXPECT_EQ(r.numel, s * ranks);
            for (int g = 0; g < ranks; ++g) {
              const ShardRange local = ShardOf(r.numel, ranks, g);
              const ShardRange global = ShardOf(numel, nodes * ranks, n * ranks + g);
              EXPECT_EQ(local.offset + r.offset, global.offset);
              EXPECT_EQ(local.numel, global.numel);
            }
          }
        }
        EXPECT_EQ(next, numel);
      }
    }
  }
  EXPECT_EQ(NodeRangeOf(1000, 1, 4, 0).numel, 1000);
}

TEST(NodeShard, LastNodesPaddedShardsStayInsideTheirSpan) {
  // The gradient path reduce-scatters node m's part in place over ranks * ShardNumel(part, ranks)
  // elements from its start: never past the next node's start.
  for (int64_t numel : {256LL * 1001, 256LL * 13, 256LL * 4099}) {
    for (int nodes : {2, 3, 5}) {
      for (int ranks : {1, 2, 4}) {
        const int64_t span = ShardNumel(numel, nodes * ranks) * ranks;
        for (int n = 0; n < nodes; ++n) {
          const ShardRange r = NodeRangeOf(numel, nodes, ranks, n);
          if (r.numel == 0) continue;
          EXPECT_LE(PaddedNumel(r.numel, ranks), span) << numel << " " << nodes << "x" << ranks << " node " << n;
        }
      }
    }
  }
}

TEST(NodeShard, NodeLayoutsCutEveryTensorIntoTheNodesSlices) {
  const ModelLayout full = ModelLayout::Build(ModelConfig::Preset("tiny").value());
  const int nodes = 3, ranks = 2;
  std::map<std::string, int64_t> covered;  // tensor key -> elements over all nodes
  int64_t total = 0;
  for (int n = 0; n < nodes; ++n) {
    const NodeSharding sharding = MakeNodeSharding(full, nodes, ranks, n, /*embedding_rows_f32=*/true);
    const ModelLayout mine = NodeLayout(full, sharding);
    ASSERT_EQ(mine.num_units(), full.num_units());
    EXPECT_EQ(mine.total_numel, NodeNumel(full, sharding, n));
    total += mine.total_numel;
    for (const UnitLayout& u : mine.units) {
      const UnitLayout& f = full.units[u.index];
      // The embedding, whose FP32 rows every node reads, and the tied head (its final norm alone):
      // whole everywhere.
      EXPECT_EQ(sharding.IsReplicated(u.index), u.index == 0 || u.index == full.num_units() - 1);
      if (sharding.IsReplicated(u.index)) {
        EXPECT_EQ(u.numel, f.numel);
        EXPECT_FALSE(u.tensors[0].is_slice());
        continue;
      }
      const ShardRange range = sharding.Range(u.index, f.numel);
      EXPECT_EQ(u.numel, range.numel);
      ASSERT_EQ(u.tensors.size(), f.tensors.size());
      for (size_t t = 0; t < u.tensors.size(); ++t) {
        const TensorSlot& s = u.tensors[t];
        const TensorSlot& ft = f.tensors[t];
        EXPECT_TRUE(s.is_slice());
        EXPECT_EQ(s.hf_name, ft.hf_name);
        EXPECT_EQ(s.hf_shape, ft.shape);
        EXPECT_GE(s.offset_numel, 0);
        EXPECT_LE(s.offset_numel + s.numel, u.numel);
        if (s.numel > 0) {  // element i of the slice is element offset + i of the full unit
          EXPECT_EQ(range.offset + s.offset_numel, ft.offset_numel + s.hf_offset_numel);
        }
        covered[ft.Key()] += s.numel;
      }
    }
  }
  const NodeSharding any = MakeNodeSharding(full, nodes, ranks, 0, true);
  for (const UnitLayout& f : full.units) {
    if (any.IsReplicated(f.index)) {
      total -= (nodes - 1) * f.numel;  // counted on every node
      continue;
    }
    for (const TensorSlot& t : f.tensors) EXPECT_EQ(covered[t.Key()], t.numel) << t.hf_name;
  }
  EXPECT_EQ(total, full.total_numel);
}

TEST(NodeShard, UnitsTooSmallForEveryNodeStayWhole) {
  const ModelLayout full = ModelLayout::Build(ModelConfig::Preset("tiny").value());
  const NodeSharding few = MakeNodeSharding(full, 2, 1, 0, false);
  EXPECT_FALSE(few.IsReplicated(0));  // BF16 rows: the embedding is sharded too
  const NodeSharding many = MakeNodeSharding(full, 64, 64, 0, false);
  for (const UnitLayout& u : full.units) {
    const bool tiny = u.numel <= (64 * 64 - 1) * kShardAlignNumel;
    EXPECT_EQ(many.IsReplicated(u.index), NodeRangeOf(u.numel, 64, 64, 63).numel == 0) << u.name;
    if (!tiny) {
      EXPECT_FALSE(many.IsReplicated(u.index)) << u.name;
    }
    if (many.IsReplicated(u.index)) {
      EXPECT_EQ(many.Range(u.index, u.numel).numel, u.numel);
    }
  }
  EXPECT_TRUE(many.IsReplicated(full.num_units() - 1));  // the tied head: the final norm alone
}

}  // namespace
}  // namespace slidedp
