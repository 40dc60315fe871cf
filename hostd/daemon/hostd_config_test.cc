#include "hostd/daemon/hostd_config.h"

#include <fstream>

#include "gtest/gtest.h"

namespace slidedp::hostd {
namespace {

absl::StatusOr<HostdConfig> ParseArgs(std::vector<const char*> args) {
  args.insert(args.begin(), "slidedp-hostd");
  return HostdConfig::Parse(static_cast<int>(args.size()), args.data());
}

TEST(HostdConfig, FlagsOverrideDefaults) {
  auto c = ParseArgs({"--listen", "unix:/tmp/x.sock", "--update-threads", "6", "--drain-mode", "finish"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "unix:/tmp/x.sock");
  EXPECT_EQ(c->update_threads, 6);
  EXPECT_EQ(c->drain_mode, "finish");
  EXPECT_TRUE(c->pool_host_state);  // default: keep a finished job's state for the next one
  auto off = ParseArgs({"--pool-host-state", "false"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->pool_host_state);
}

TEST(HostdConfig, ConfigFileThenCommandLineWins) {
  std::string path = ::testing::TempDir() + "/hostd.yaml";
  std::ofstream(path) << "listen: unix:/run/slidedp/hostd.sock\nnode_name: box1\nupdate_threads: 3\n";
  auto c = ParseArgs({"--config", path.c_str(), "--update-threads", "5"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "unix:/run/slidedp/hostd.sock");
  EXPECT_EQ(c->node_name, "box1");
  EXPECT_EQ(c->update_threads, 5);
}

TEST(HostdConfig, RejectsBadInput) {
  EXPECT_EQ(ParseArgs({"--drain-mode", "explode"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseArgs({"--bogus"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseArgs({"--listen", "0.0.0.0:7000"}).status().code(), absl::StatusCode::kInvalidArgument);
  std::string path = ::testing::TempDir() + "/bad.yaml";
  std::ofstream(path) << "listen_port: 3\n";
  auto c = ParseArgs({"--config", path.c_str()});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("listen_port"), std::string::npos);
}

}  // namespace
}  // namespace slidedp::hostd
