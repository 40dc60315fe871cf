// GlooGroup (gloo_group.h) over TCP loopback, each rank its own process (fork): the ring all-reduce
// sums like the reference and leaves the same bits on every rank, broadcast copies root's values, and
// a rank whose peer never comes fails its connect within the timeout instead of hanging.
#include "common/collective/gloo_group.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/netns/netns_pair.h"

namespace slidedp {
namespace {

std::vector<float> RankData(int rank, int64_t n) {
  std::mt19937 rng(1234 + rank);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng) * std::ldexp(1.0f, rank * 7 - 10);  // magnitudes apart: the order shows
  return v;
}

std::string FreshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/gloo_" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Runs `body(rank)` in `size` child processes; each writes its result file; returns the exit codes.
template <typename Body>
std::vector<int> RunRanks(int size, Body body) {
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(body(r));
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 100 + WTERMSIG(status));
  }
  return codes;
}

std::vector<float> ReadFloats(const std::string& path, int64_t n) {
  std::vector<float> v(n);
  std::ifstream f(path, std::ios::binary);
  f.read(reinterpret_cast<char*>(v.data()), n * 4);
  if (!f) v.clear();
  return v;
}

TEST(GlooGroup, RingAllReduceIsTheSumAndTheSameBitsOnEveryRank) {
  constexpr int kRanks = 3;
  constexpr int64_t kN = 100003;  // not a multiple of the ring's segments
  const std::string dir = FreshDir("allreduce");
  const std::vector<int> codes = RunRanks(kRanks, [&](int rank) {
    GlooGroupOptions o;
    o.rank = rank;
    o.size = kRanks;
    o.store_dir = dir + "/store";
    o.prefix = "allreduce";
    o.timeout = absl::Seconds(30);
    std::filesystem::create_directories(o.store_dir);
    auto group = GlooGroup::Connect(o);
    if (!group.ok()) return 2;
    std::vector<float> v = RankData(rank, kN);
    if (!(*group)->AllReduceSum(v.data(), kN).ok()) return 3;
    std::vector<float> b(kN, rank == 1 ? 7.5f : 0.0f);
    if (!(*group)->Broadcast(b.data(), kN, 1).ok()) return 4;
    for (float x : b) {
      if (x != 7.5f) return 5;
    }
    // All-gather: every rank's slice, bit for bit (NaN payloads too: BF16 pairs travel as floats).
    std::vector<float> mine(1001);
    for (size_t i = 0; i < mine.size(); ++i) {
      const uint32_t bits = 0x7fc00000u + static_cast<uint32_t>(rank * 4096 + i);
      std::memcpy(&mine[i], &bits, 4);
    }
    std::vector<float> all(mine.size() * kRanks);
    if (!(*group)->AllGather(mine.data(), static_cast<int64_t>(mine.size()), all.data()).ok()) return 7;
    for (int r = 0; r < kRanks; ++r) {
      for (size_t i = 0; i < mine.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &all[r * mine.size() + i], 4);
        if (bits != 0x7fc00000u + static_cast<uint32_t>(r * 4096 + i)) return 8;
      }
    }
    std::ofstream f(dir + "/out" + std::to_string(rank), std::ios::binary);
    f.write(reinterpret_cast<const char*>(v.data()), kN * 4);
    return f ? 0 : 6;
  });
  for (int r = 0; r < kRanks; ++r) ASSERT_EQ(codes[r], 0) << "rank " << r;
  const std::vector<float> first = ReadFloats(dir + "/out0", kN);
  ASSERT_EQ(first.size(), static_cast<size_t>(kN));
  for (int r = 1; r < kRanks; ++r) {
    const std::vector<float> other = ReadFloats(dir + "/out" + std::to_string(r), kN);
    ASSERT_EQ(other.size(), first.size());
    EXPECT_EQ(std::memcmp(other.data(), first.data(), kN * 4), 0) << "rank " << r << " differs from rank 0";
  }
  std::vector<std::vector<float>> in;
  for (int r = 0; r < kRanks; ++r) in.push_back(RankData(r, kN));
  for (int64_t i = 0; i < kN; ++i) {
    double ref = 0, mag = 0;
    for (int r = 0; r < kRanks; ++r) ref += in[r][i], mag += std::fabs(in[r][i]);
    ASSERT_NEAR(first[i], ref, 4e-7 * mag + 1e-30) << i;
  }
}

TEST(GlooGroup, RanksInSeparateNetworkNamespacesReduceOverAVethPair) {
  if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
  testing::NetnsPair net("g", "10.77.0");
  if (!net.ok()) GTEST_SKIP() << "could not make two network namespaces with a veth pair (ip netns)";
  constexpr int64_t kN = 4099;
  const std::string dir = FreshDir("netns");
  const std::vector<int> codes = RunRanks(2, [&](int rank) {
    if (!net.Enter(rank)) return 7;
    GlooGroupOptions o;
    o.rank = rank;
    o.size = 2;
    o.store_dir = dir;
    o.prefix = "netns";
    o.host = net.address(rank);
    o.timeout = absl::Seconds(30);
    auto group = GlooGroup::Connect(o);
    if (!group.ok()) {
      fprintf(stderr, "rank %d: %s\n", rank, group.status().ToString().c_str());
      return 2;
    }
    std::vector<float> v = RankData(rank, kN);
    if (!(*group)->AllReduceSum(v.data(), kN).ok()) return 3;
    std::ofstream f(dir + "/out" + std::to_string(rank), std::ios::binary);
    f.write(reinterpret_cast<const char*>(v.data()), kN * 4);
    return f ? 0 : 6;
  });
  ASSERT_EQ(codes[0], 0);
  ASSERT_EQ(codes[1], 0);
  const std::vector<float> a = ReadFloats(dir + "/out0", kN), b = ReadFloats(dir + "/out1", kN);
  ASSERT_EQ(a.size(), static_cast<size_t>(kN));
  ASSERT_EQ(b.size(), a.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), kN * 4), 0);
  const std::vector<float> x = RankData(0, kN), y = RankData(1, kN);
  for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(a[i], x[i] + y[i]) << i;  // two terms: one rounding either way
}

TEST(GlooGroup, AMissingPeerFailsTheConnectWithinTheTimeout) {
  const std::string dir = FreshDir("missing");
  const std::vector<int> codes = RunRanks(1, [&](int rank) {
    GlooGroupOptions o;
    o.rank = rank;
    o.size = 2;  // rank 1 never comes
    o.store_dir = dir;
    o.timeout = absl::Seconds(2);
    auto group = GlooGroup::Connect(o);
    if (!group.ok()) fprintf(stderr, "rank %d: %s\n", rank, group.status().ToString().c_str());
    return group.ok() ? 1 : (absl::IsDeadlineExceeded(group.status()) ? 0 : 2);
  });
  EXPECT_EQ(codes[0], 0);
}

TEST(GlooGroup, RejectsBadArguments) {
  GlooGroupOptions o;
  o.rank = 2;
  o.size = 2;
  o.store_dir = "/tmp";
  EXPECT_EQ(GlooGroup::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.rank = 0;
  o.store_dir = "";
  EXPECT_EQ(GlooGroup::Connect(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp
