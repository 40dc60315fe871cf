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

// A TCP listener needs TLS and client authentication, or the loudly named opt-out.
TEST(HostdConfig, TcpNeedsClientAuthentication) {
  const std::vector<const char*> tls = {"--listen", "127.0.0.1:7070", "--tls-cert", "c.pem", "--tls-key", "k.pem"};
  auto none = ParseArgs(tls);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("needs client authentication"), std::string::npos) << none.status();
  auto with = [&](std::vector<const char*> extra) {
    std::vector<const char*> a = tls;
    a.insert(a.end(), extra.begin(), extra.end());
    return ParseArgs(a);
  };
  EXPECT_TRUE(with({"--tls-client-ca", "ca.pem"}).ok());
  EXPECT_TRUE(with({"--auth-token-file", "token"}).ok());
  auto opted_out = with({"--dangerously-allow-unauthenticated-tcp"});
  ASSERT_TRUE(opted_out.ok()) << opted_out.status();
  EXPECT_TRUE(opted_out->dangerously_allow_unauthenticated_tcp);
  EXPECT_FALSE(with({"--dangerously-allow-unauthenticated-tcp=false"}).ok());
  // The Unix socket needs none of it.
  EXPECT_TRUE(ParseArgs({"--listen", "unix:/tmp/x.sock"}).ok());
}

TEST(HostdConfig, SocketModeStaysWithinOwnerAndGroup) {
  auto c = ParseArgs({"--socket-mode", "0600", "--socket-group", "slidedp"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->socket_mode_bits(), 0600u);
  EXPECT_EQ(c->socket_group, "slidedp");
  EXPECT_EQ(ParseArgs({})->socket_mode_bits(), 0660u);
  for (const char* bad : {"0666", "0777", "0640x", "9", "", "0060", "00660"}) {
    EXPECT_EQ(ParseArgs({"--socket-mode", bad}).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(HostdConfig, OutputRootDefaultsUnderTheStateDir) {
  auto c = ParseArgs({"--state-dir", "/var/lib/slidedp"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->output_root, "/var/lib/slidedp/outputs");
  EXPECT_FALSE(c->allow_output_anywhere);
  auto given = ParseArgs({"--state-dir", "/s", "--output-root", "/data/out", "--extra-output-root", "/a",
                          "--extra-output-root", "/b", "--allow-output-anywhere"});
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->output_root, "/data/out");
  EXPECT_EQ(given->extra_output_root, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_TRUE(given->allow_output_anywhere);
  EXPECT_EQ(ParseArgs({})->output_root, "");  // hostd then refuses to start (main: no output root)
}

// Every new flag is a config key too: lists as YAML sequences, the boolean flags as true/false.
TEST(HostdConfig, ConfigFileKeysForAuthenticationAndOutputs) {
  std::string path = ::testing::TempDir() + "/hostd-auth.yaml";
  std::ofstream(path) << "listen: 0.0.0.0:7070\ntls_cert: /c.pem\ntls_key: /k.pem\ntls_client_ca: /ca.pem\n"
                         "auth_token_file: /etc/slidedp/token\noutput_root: /data/out\n"
                         "extra_output_root: [/x, /y]\nallow_output_anywhere: false\n"
                         "dangerously_allow_unauthenticated_tcp: false\nsocket_group: slidedp\nsocket_mode: '0600'\n";
  auto c = ParseArgs({"--config", path.c_str(), "--extra-output-root", "/z"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tls_client_ca, "/ca.pem");
  EXPECT_EQ(c->auth_token_file, "/etc/slidedp/token");
  EXPECT_EQ(c->output_root, "/data/out");
  EXPECT_EQ(c->extra_output_root, (std::vector<std::string>{"/x", "/y", "/z"}));
  EXPECT_FALSE(c->allow_output_anywhere);
  EXPECT_EQ(c->socket_mode_bits(), 0600u);
  std::ofstream(path, std::ios::trunc) << "listen: 0.0.0.0:7070\ntls_cert: /c.pem\ntls_key: /k.pem\n";
  EXPECT_EQ(ParseArgs({"--config", path.c_str()}).status().code(), absl::StatusCode::kInvalidArgument);
  std::ofstream(path, std::ios::trunc) << "output_root: [/a, /b]\n";  // not a list key
  EXPECT_EQ(ParseArgs({"--config", path.c_str()}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Where the workers listen for other nodes: the flag, else the TCP listener's host, else the host name.
TEST(HostdConfig, NodeAddressFromTheFlagTheListenerOrTheHostName) {
  HostdConfig c;
  c.listen = "unix:/run/slidedp.sock";
  EXPECT_EQ(c.NodeAddress("node7"), "127.0.0.1");
  c.listen = "10.1.2.3:7070";
  EXPECT_EQ(c.NodeAddress("node7"), "10.1.2.3");
  c.listen = "[fd00::5]:7070";
  EXPECT_EQ(c.NodeAddress("node7"), "fd00::5");
  c.listen = "0.0.0.0:7070";
  EXPECT_EQ(c.NodeAddress("node7"), "node7");
  c.listen = "[::]:7070";
  EXPECT_EQ(c.NodeAddress("node7"), "node7");
  c.node_address = "192.168.0.9";
  EXPECT_EQ(c.NodeAddress("node7"), "192.168.0.9");
}

}  // namespace
}  // namespace slidedp::hostd
