// The multi-node gradient reduction of CPU-backend workers (common/collective/node_link.h): N nodes
// of G ranks, each node's ranks sharing a ShmCollective, each local index's ranks joined across the
// nodes by a GlooGroup over TCP loopback, every rank its own process. Each rank's shard must hold
// the sum over all N x G ranks in global rank order — bitwise what one node with N x G ranks gets —
// and every node the same bits.
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
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

int RunRank(int node, int local, int nodes, int ranks, int64_t shard, const std::string& coll_name,
            const std::string& store) {
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

void Check(int nodes, int ranks, int64_t shard) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/chain_", nodes, "x", ranks, "_", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  shm::AbortWord abort;
  std::vector<std::unique_ptr<shm::ShmCollective>> colls;
  for (int n = 0; n < nodes && ranks > 1; ++n) {
    auto c = shm::ShmCollective::Create(absl::StrCat("t", getpid(), "n", n), absl::StrCat("chain", nodes, ranks),
                                        ranks, shard * ranks * sizeof(float), &abort);
    ASSERT_TRUE(c.ok()) << c.status();
    colls.push_back(std::move(*c));
  }
  std::vector<pid_t> pids;
  for (int n = 0; n < nodes; ++n) {
    for (int r = 0; r < ranks; ++r) {
      const std::string name = ranks > 1 ? colls[n]->segment_name() : "";
      const pid_t pid = fork();
      if (pid == 0) _exit(RunRank(n, r, nodes, ranks, shard, name, dir));
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

}  // namespace
}  // namespace slidedp
