// The multi-node gradient reduction of CPU-backend workers (common/collective/node_link.h): N nodes
// of G ranks, each node's ranks sharing a ShmCollective, each local index's ranks joined across the
// nodes by a GlooGroup over TCP loopback, every rank its own process. Each rank's shard must hold
// the sum over all N x G ranks in global rank order — bitwise what one node with N x G ranks gets —
// and every node the same bits. ChainReduceScatter (sharded state): each node keeps its own range's total,
// the same bits.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/collective/gloo_group.h"
#include "common/collective/node_link.h"
#include "gtest/gtest.h"
#include "shm/shm_collective.h"

namespace slidedp {
namespace {

// Rank `global`'s gradient: magnitudes far apart, so any other summation order changes the bits.
std::vector<float> Grad(int global, int64_t n) {
  std::mt19937 rng(77 + global);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng) * std::ldexp(1.0f, (global % 5) * 9 - 16);
  return v;
}

// runtime.node_state sharded (ChainReduceScatter): the gradient is `nodes` chunks of ranks x shard, one per
// node's range; each node's ranks reduce-scatter every chunk, the chain carries every rank's pieces, and
// each node keeps only the total of its own chunk.
int RunScatter(int node, int local, int nodes, int ranks, int64_t shard, shm::ShmCollective* coll, NodeLink& link) {
  std::vector<float> scratch(nodes * shard), packed(nodes * shard);
  for (int call = 0; call < 3; ++call) {
    const int64_t n = shard * ranks * nodes;
    std::vector<float> buf = Grad(node * ranks + local + 100 * call, n);
    auto local_sum = [&](const float* partial) -> absl::Status {
      for (int m = 0; m < nodes; ++m) {
        float* chunk = buf.data() + m * ranks * shard;
        const float* init = partial != nullptr ? partial + m * shard : nullptr;
        if (coll != nullptr) {
          if (absl::Status s = coll->ReduceScatterF32(chunk, shard, absl::Seconds(60), init); !s.ok()) return s;
        } else if (init != nullptr) {
          for (int64_t i = 0; i < shard; ++i) chunk[i] = init[i] + chunk[i];
        }
        std::copy_n(chunk + local * shard, shard, packed.data() + m * shard);
      }
      return absl::OkStatus();
    };
    if (!ChainReduceScatter(link, packed.data(), shard, scratch.data(), local_sum).ok()) return 22;
    const int64_t at = (node * ranks + local) * shard;  // this rank's piece of its node's chunk
    for (int64_t i = 0; i < shard; ++i) {
      float want = 0;
      for (int g = 0; g < nodes * ranks; ++g) {
        const float x = Grad(g + 100 * call, n)[at + i];
        want = g == 0 ? x : want + x;
      }
      if (std::memcmp(&packed[node * shard + i], &want, sizeof(float)) != 0) return 23;
    }
  }
  return 0;
}

int RunRank(int node, int local, int nodes, int ranks, int64_t shard, const std::string& coll_name,
            const std::string& store, bool scatter) {
  shm::AbortWord abort;
  std::unique_ptr<shm::ShmCollective> coll;
  if (ranks > 1) {
    auto c = shm::ShmCollective::Attach(coll_name, local, &abort);
    if (!c.ok()) return 10;
    coll = std::move(*c);
  }
  GlooGroupOptions o;
  o.rank = node;
  o.size = nodes;
  o.store_dir = store;
  o.prefix = absl::StrCat("local", local);
  o.timeout = absl::Seconds(60);
  auto link = GlooGroup::Connect(o);
  if (!link.ok()) return 11;
  if (scatter) return RunScatter(node, local, nodes, ranks, shard, coll.get(), **link);
  std::vector<float> scratch(shard);
  for (int call = 0; call < 3; ++call) {
    const int64_t n = shard * ranks;
    std::vector<float> buf = Grad(node * ranks + local + 100 * call, n);
    float* mine = buf.data() + local * shard;
    auto local_sum = [&](const float* partial) -> absl::Status {
      if (coll) return coll->ReduceScatterF32(buf.data(), shard, absl::Seconds(60), partial);
      if (partial != nullptr) {
        for (int64_t i = 0; i < shard; ++i) mine[i] = partial[i] + mine[i];
      }
      return absl::OkStatus();
    };
    if (!ChainReduce(**link, mine, shard, scratch.data(), local_sum).ok()) return 12;
    // One node with every rank: its collective starts from rank 0's shard and adds the others in order.
    std::vector<float> want(shard);
    for (int g = 0; g < nodes * ranks; ++g) {
      const std::vector<float> x = Grad(g + 100 * call, n);
      for (int64_t i = 0; i < shard; ++i) want[i] = g == 0 ? x[local * shard + i] : want[i] + x[local * shard + i];
    }
    for (int64_t i = 0; i < shard; ++i) {
      if (std::memcmp(&mine[i], &want[i], sizeof(float)) != 0) return 13;
    }
  }
  return 0;
}

void Check(int nodes, int ranks, int64_t shard, bool scatter = false) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/chain_", nodes, "x", ranks, "_", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  shm::AbortWord abort;
  std::vector<std::unique_ptr<shm::ShmCollective>> colls;
  for (int n = 0; n < nodes && ranks > 1; ++n) {
    auto c = shm::ShmCollective::Create(absl::StrCat("t", getpid(), "n", n), absl::StrCat("chain", nodes, ranks),
                                        ranks, shard * ranks * sizeof(float) * (scatter ? nodes : 1), &abort);
    ASSERT_TRUE(c.ok()) << c.status();
    colls.push_back(std::move(*c));
  }
  std::vector<pid_t> pids;
  for (int n = 0; n < nodes; ++n) {
    for (int r = 0; r < ranks; ++r) {
      const std::string name = ranks > 1 ? colls[n]->segment_name() : "";
      const pid_t pid = fork();
      if (pid == 0) _exit(RunRank(n, r, nodes, ranks, shard, name, dir, scatter));
      pids.push_back(pid);
    }
  }
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status)) << "a rank died";
    EXPECT_EQ(WEXITSTATUS(status), 0) << nodes << " nodes x " << ranks << " ranks";
  }
  for (auto& c : colls) EXPECT_TRUE(c->Unlink().ok());
  std::filesystem::remove_all(dir);
}

TEST(ChainReduce, TwoNodesOfTwoRanksSumInGlobalRankOrder) { Check(2, 2, 4099); }
TEST(ChainReduce, ThreeNodesOfOneRankSumInGlobalRankOrder) { Check(3, 1, 10007); }
TEST(ChainReduce, TwoNodesOfThreeRanksSumInGlobalRankOrder) { Check(2, 3, 513); }
TEST(ChainReduceScatter, TwoNodesOfTwoRanksKeepTheirOwnTotals) { Check(2, 2, 1031, /*scatter=*/true); }
TEST(ChainReduceScatter, ThreeNodesOfOneRankKeepTheirOwnTotals) { Check(3, 1, 2053, /*scatter=*/true); }

}  // namespace
}  // namespace slidedp
